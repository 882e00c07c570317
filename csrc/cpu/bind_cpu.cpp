// qgru C++ CPU backend: the Python binding (pybind11) of the layer and plan code in qgru_cpu.cpp,
// through its interface cpu_backend.h; isa.h for the path table and the CPU's name.
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#if !defined(_WIN32)
#include <pthread.h>
#endif

#include "cpu_backend.h"
#include "isa.h"
#include "kernels.h"

#ifndef QGRU_TORCH_VERSION
#error "QGRU_TORCH_VERSION must be defined by the build (qgru/native/build.py)"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qgru C++ CPU backend (bit-exact with qgru/golden.py)";
  // The torch version this binary was compiled against: qgru refuses to load a stale binary.
  m.attr("built_for_torch") = QGRU_TORCH_VERSION;
#if !defined(_WIN32)
  pthread_atfork(nullptr, nullptr, qgru::cpu_api::mark_forked_child);
#endif
  // Whether this process is a child of fork() made after this module was imported: the loops
  // then run on the calling thread (g_forked).
  m.def("forked_child", &qgru::cpu_api::forked_child);
  m.def("set_forked_child", &qgru::cpu_api::mark_forked_child,
        "Run on the calling thread from now on (this process is a child of fork; qgru/native/build.py calls it)");
  m.def("isa_table", []() {
    std::vector<std::tuple<std::string, bool, std::string, int, std::vector<std::string>, bool>> rows;
    for (const auto& i : qgru::cpu::isa_table())
      rows.emplace_back(i.name, i.supported, i.why, i.kernels ? i.kernels->act_bytes : 0, i.needs,
                        i.kernels != nullptr && (i.kernels->act_bytes == 2 || i.kernels->act16 != nullptr));
    return rows;
  }, "(path, usable here, why not, activation bytes (0: not compiled), CPU features it requires, whether it "
     "takes 16-bit activations whole: int16 operands or an int16 sibling) for every CPU path, fastest first");
  m.def("profile_enable", &qgru::cpu_api::profile_enable, "phase profile on/off (scripts/profile_cpu.py)");
  m.def("profile_read", &qgru::cpu_api::profile_read, pybind11::arg("reset") = true,
        "phase nanoseconds summed over threads: quantize, W.x, R.h, cell, wait, dequantize, stack calls; and the "
        "count of stack calls");
  m.def("cpu_model", &qgru::cpu::cpu_model, "the CPU's model name (CPUID)");
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("quantize", &qgru::cpu_api::quantize,
        "float -> int32 (primitives.quantize) on a CPU path", pybind11::arg("x"), pybind11::arg("scale"),
        pybind11::arg("zp"), pybind11::arg("bits"), pybind11::arg("what"), pybind11::arg("isa") = "auto", release_gil());
  m.def("quantize_levels", &qgru::cpu_api::quantize_levels,
        "golden.quantize_levels on a CPU path: (q int32, level int32 per token)", pybind11::arg("x"),
        pybind11::arg("scale"), pybind11::arg("lo"), pybind11::arg("hi"), pybind11::arg("zp"), pybind11::arg("bits"),
        pybind11::arg("what"), pybind11::arg("isa") = "auto", release_gil());
  m.def("token_levels", &qgru::cpu_api::token_levels,
        "the x level of every token by the shared token_level (NaN counts as 0.0): what the CUDA kernel runs",
        pybind11::arg("x"), pybind11::arg("scale"), pybind11::arg("lo"), pybind11::arg("hi"));
  m.def("dequantize", &qgru::cpu_api::dequantize, "int -> float (primitives.dequantize)", release_gil());
  m.def("requantize", &qgru::cpu_api::requantize, "golden.requantize_input, per-tensor factor", release_gil());
  m.def("kernel_gemm", &qgru::cpu_api::kernel_gemm, "one CPU path's GEMM alone (tests)", pybind11::arg("isa"),
        pybind11::arg("a"), pybind11::arg("w"), pybind11::arg("gates") = false);
  pybind11::class_<qgru::cpu_api::Stack>(m, "Stack")
      .def(pybind11::init<const std::vector<std::shared_ptr<qgru::cpu_api::Layer>>&, std::vector<std::vector<double>>,
                          const std::vector<std::vector<double>>&>(),
           pybind11::arg("layers"), pybind11::arg("values"), pybind11::arg("levels") = std::vector<std::vector<double>>())
      .def("forward", &qgru::cpu_api::Stack::forward, pybind11::arg("x"), pybind11::arg("h0"), release_gil())
      .def("call", &qgru::cpu_api::Stack::call,
           "forward where x is a float32 CPU tensor [T >= 1, N, I] and h0 None (zeros) or one [L, N, H], neither a "
           "negative view; else None", pybind11::arg("x"), pybind11::arg("h0") = pybind11::none(), release_gil());
  pybind11::class_<qgru::cpu_api::Model>(m, "Model")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::string&, const std::string&>(),
           pybind11::arg("params"), pybind11::arg("spec"), pybind11::arg("isa") = "auto")
      .def("forward", &qgru::cpu_api::Model::forward, "the operator qgru::integer_gru's call on this model",
           pybind11::arg("x"), pybind11::arg("hx"), pybind11::arg("lengths") = pybind11::none(), release_gil())
      .def("forward_generic", &qgru::cpu_api::Model::forward_generic,
           "forward through the device-generic layer loop the CUDA operator runs (csrc/qgru_op_loop.h), on this "
           "CPU's kernels", pybind11::arg("x"), pybind11::arg("hx"), pybind11::arg("lengths") = pybind11::none(),
           release_gil())
      .def("cuda_tensors", &qgru::cpu_api::Model::cuda_tensors, pybind11::arg("k"),
           "unit k's CUDA Layer tensors as the spec's cuda section gives them")
      .def("cuda_values", &qgru::cpu_api::Model::cuda_values, pybind11::arg("k"),
           "unit k's CUDA Layer values as the spec's cuda section gives them")
      .def("forward_packed", &qgru::cpu_api::Model::forward_packed,
           "a PackedSequence's call, rows longest first: (packed output data, h_n in the caller's order), or None "
           "where the PackedSequence is not well formed or not of the form taken", pybind11::arg("data"),
           pybind11::arg("batch_sizes"), pybind11::arg("sorted_indices") = pybind11::none(),
           pybind11::arg("unsorted_indices") = pybind11::none(), pybind11::arg("hx") = pybind11::none(),
           release_gil())
      .def("call", &qgru::cpu_api::Model::call,
           "Stack.call on the model's Stack (unidirectional, per-tensor requantization between layers), else None",
           pybind11::arg("x"), pybind11::arg("h0") = pybind11::none(), release_gil())
      .def_property_readonly("gemm_paths", &qgru::cpu_api::Model::gemm_paths)
      .def_property_readonly("cells", &qgru::cpu_api::Model::cell_kinds)
      .def_property_readonly("one_row_paths", &qgru::cpu_api::Model::one_row_paths)
      .def_property_readonly("one_row_made", &qgru::cpu_api::Model::one_row_made);
  pybind11::class_<qgru::cpu_api::Layer, std::shared_ptr<qgru::cpu_api::Layer>>(m, "Layer")
      .def(pybind11::init<qgru::TensorMap, qgru::IntMap, const std::string&>(), pybind11::arg("tensors"),
           pybind11::arg("values"), pybind11::arg("isa") = "auto")
      .def_property_readonly("gemm", &qgru::cpu_api::Layer::gemm_path)
      .def_property_readonly("one_row_gemm", &qgru::cpu_api::Layer::one_row_path)
      .def_property_readonly("one_row_made", &qgru::cpu_api::Layer::one_row_made)
      .def("set_one_row", &qgru::cpu_api::Layer::set_one_row, pybind11::arg("tensors"), pybind11::arg("values"),
           pybind11::arg("isa"))
      .def("forward", &qgru::cpu_api::Layer::forward, pybind11::arg("qx"), pybind11::arg("qh0"),
           pybind11::arg("lengths") = pybind11::none(), pybind11::arg("level") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("x_levels", &qgru::cpu_api::Layer::x_levels)
      .def_property_readonly("cell", &qgru::cpu_api::Layer::cell_kind,
                             "the cell it runs: int32, int32-wide (wide accumulators), int32-hybrid (int64 requantization, int32 gates) or int64");
}
