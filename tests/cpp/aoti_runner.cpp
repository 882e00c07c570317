// A libtorch-only program (no Python): loads qgru's cpu library (dlopen: it registers the operator
// qgru::integer_gru), then an AOTInductor package with torch::inductor::AOTIModelPackageLoader, runs
// it on the inputs in a vectors folder and checks its outputs against the expected ones there, bit
// for bit. tests/test_cpp_operator.py builds it against the libtorch in the torch wheel, writes the
// package and the vectors (manifest.txt: per line "case name dtype ndim dims..." for a raw
// little-endian file <case>_<name>.bin; inputs are named x, outputs y0, y1, ...).
//   usage: aoti_runner LIBRARY[:LIBRARY...] PACKAGE VECTORS_DIR [cuda]
// prints "ok N" (N cases) or what differs. Libraries are loaded in order (a CUDA package: the cpu
// library, which defines the operator, then the cuda one, its CUDA kernel); with "cuda" the inputs
// are moved to the GPU and the outputs back before they are compared.
#include <dlfcn.h>

#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

static at::Tensor read_tensor(const std::string& path, at::ScalarType type, const std::vector<int64_t>& dims) {
  at::Tensor t = at::empty(dims, at::TensorOptions().dtype(type));
  std::ifstream f(path, std::ios::binary);
  f.read(static_cast<char*>(t.data_ptr()), (std::streamsize)t.nbytes());
  if (!f || f.gcount() != (std::streamsize)t.nbytes()) throw std::runtime_error("short file " + path);
  return t;
}

int main(int argc, char** argv) {
  if (argc != 4 && !(argc == 5 && std::string(argv[4]) == "cuda")) {
    std::cerr << "usage: aoti_runner LIBRARY[:LIBRARY...] PACKAGE VECTORS_DIR [cuda]\n";
    return 2;
  }
  const bool cuda = argc == 5;
  std::stringstream libs(argv[1]);
  for (std::string lib; std::getline(libs, lib, ':');)
    if (dlopen(lib.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::cerr << "dlopen failed: " << dlerror() << "\n";
      return 3;
    }
  const std::string dir = argv[3];
  std::map<int, std::map<std::string, at::Tensor>> cases;
  std::ifstream manifest(dir + "/manifest.txt");
  std::string line;
  while (std::getline(manifest, line)) {
    std::istringstream in(line);
    int c, ndim;
    std::string name, dtype;
    if (!(in >> c >> name >> dtype >> ndim)) continue;
    std::vector<int64_t> dims(ndim);
    for (auto& d : dims) in >> d;
    const at::ScalarType type = dtype == "float32" ? at::kFloat : at::kDouble;
    cases[c][name] = read_tensor(dir + "/" + std::to_string(c) + "_" + name + ".bin", type, dims);
  }
  if (cases.empty()) {
    std::cerr << "no cases in " << dir << "/manifest.txt\n";
    return 4;
  }
  torch::inductor::AOTIModelPackageLoader loader(argv[2]);
  int bad = 0;
  for (auto& kv : cases) {
    const at::Tensor x = kv.second.at("x");
    std::vector<at::Tensor> outs = loader.run({cuda ? x.to(at::Device(at::kCUDA, 0)) : x});
    for (auto& o : outs) o = o.cpu();
    for (size_t i = 0; i < outs.size() || kv.second.count("y" + std::to_string(i)); ++i) {
      const std::string k = "y" + std::to_string(i);
      if (i >= outs.size() || !kv.second.count(k) || !outs[i].sizes().equals(kv.second[k].sizes()) ||
          !at::equal(outs[i], kv.second[k])) {
        std::cout << "case " << kv.first << " output " << i << " differs\n";
        ++bad;
      }
    }
  }
  if (bad) return 1;
  std::cout << "ok " << cases.size() << "\n";
  return 0;
}
