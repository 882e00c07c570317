// The CPU backend's interface to its Python binding (bind_cpu.cpp): the Layer and the Stack as
// handles to their implementation in qgru_cpu.cpp (the layer and plan code, whose classes stay
// private to that file), and the free functions the binding exposes.
#pragma once

#include <ATen/ATen.h>  // (no torch/extension.h: this side of the binding has no Python)

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "qgru_layer.h"

namespace qgru {
namespace cpu_api {

// This process is a child of fork(): the loops run on the calling thread from now on (qgru_cpu.cpp).
void mark_forked_child();
bool forked_child();

// The phase profile (qgru_cpu.cpp): on/off, and the nanoseconds per phase summed over threads
// (quantize, W.x, R.h, cell, wait between steps, dequantize, whole Stack::forward calls) and the
// count of Stack calls, optionally reset to zero.
void profile_enable(bool on);
std::vector<int64_t> profile_read(bool reset);

at::Tensor quantize(const at::Tensor& x, double scale, int64_t zp, int64_t bits, const std::string& what,
                    const std::string& isa);
// golden.quantize_levels: (q int32, level int32 per token) on the x levels [scale, lo, hi].
std::tuple<at::Tensor, at::Tensor> quantize_levels(const at::Tensor& x, const std::vector<double>& scale,
                                                   const std::vector<double>& lo, const std::vector<double>& hi,
                                                   int64_t zp, int64_t bits, const std::string& what,
                                                   const std::string& isa);
// qgru_fixedpoint.h's token_level on every token of x [..., I] (tests: the level choice CUDA runs).
at::Tensor token_levels(const at::Tensor& x, const std::vector<double>& scale, const std::vector<double>& lo,
                        const std::vector<double>& hi);
at::Tensor dequantize(const at::Tensor& q, double scale, int64_t zp);
at::Tensor requantize(const at::Tensor& q, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                      int64_t to_bits);
// A 1-D int32 CPU buffer of at least n values from qgru_cpu.cpp's BufferPool (reused from call to
// call, its pages already faulted in), the caller's until it drops every view of it.
at::Tensor pooled_int32(int64_t n);
at::Tensor kernel_gemm(const std::string& isa, const at::Tensor& a, const at::Tensor& w, bool gates);

// One layer and direction (qgru_cpu.cpp CpuLayer).
class Layer {
 public:
  Layer(TensorMap tensors, IntMap values, const std::string& isa);
  std::string gemm_path() const;
  std::string one_row_path();
  bool one_row_made();
  void set_one_row(TensorMap tensors, IntMap values, const std::string& isa);
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& qx, const at::Tensor& qh0,
                                             const c10::optional<at::Tensor>& lengths,
                                             const c10::optional<at::Tensor>& level);
  // forward where the caller made qx int32 with values in the signed qx_bits-bit range (its quantize
  // or requantize saturated them there): qx is then not scanned where that is within the layer's
  // x range (op_cpu.cpp, whose x grid's bits are the layer's)
  std::tuple<at::Tensor, at::Tensor> forward_in_range(const at::Tensor& qx, int64_t qx_bits, const at::Tensor& qh0,
                                                      const c10::optional<at::Tensor>& lengths,
                                                      const c10::optional<at::Tensor>& level);
  int64_t x_levels() const;
  std::string cell_kind() const;  // "int32", "int32-wide", "int32-hybrid" or "int64"
  struct Impl;
  std::shared_ptr<Impl> impl;
};

// A unidirectional stack in one call (qgru_cpu.cpp Stack); levels: layer 0's x levels as
// [scale, lo, hi], or empty.
class Stack {
 public:
  Stack(const std::vector<std::shared_ptr<Layer>>& layers, std::vector<std::vector<double>> values,
        const std::vector<std::vector<double>>& levels);
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& h0) const;
  // forward where x and h0 (none: zeros) are float32 CPU tensors of this stack's shapes, without
  // negative views; else nullopt
  c10::optional<std::tuple<at::Tensor, at::Tensor>> call(const at::Tensor& x, const c10::optional<at::Tensor>& h0) const;
  struct Impl;
  std::shared_ptr<Impl> impl;
};

// A whole converted model as the operator qgru::integer_gru runs it (op_cpu.cpp): its spec parsed
// and its Layers (and, unidirectional, its Stack) made once from the operator's params (qgru/ops.py
// flatten_params) on CPU path request ``request``; forward(x, hx, lengths) is the operator's call
// with the same checks. The eager module runs every cpu backend call on one (its one-call form:
// call), so that eager and exported models run the same C++ on the same Layers.
class Model {
 public:
  Model(const std::vector<at::Tensor>& params, const std::string& spec, const std::string& request);
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& hx,
                                             const c10::optional<at::Tensor>& lengths) const;
  // forward through the device-generic layer loop the CUDA operator runs (qgru_op_loop.h
  // run_layers) on this CPU's kernels: the same integers (tests hold it to forward)
  std::tuple<at::Tensor, at::Tensor> forward_generic(const at::Tensor& x, const at::Tensor& hx,
                                                     const c10::optional<at::Tensor>& lengths) const;
  // the spec's CUDA variant of unit k (its "cuda" section, as op_cuda.cpp reads it): the CUDA
  // Layer's tensors (on the CPU) and values (tests compare them with prepare_layer's)
  std::map<std::string, at::Tensor> cuda_tensors(int64_t k) const;
  std::map<std::string, int64_t> cuda_values(int64_t k) const;
  // A PackedSequence's call (data, batch_sizes, sorted_indices, unsorted_indices as torch keeps
  // them; hx in the caller's order or none): (the output's packed data, h_n in the caller's order),
  // the rows run longest first, unpacked and packed in C++; nullopt where the PackedSequence is not
  // well formed or not of the form taken (the caller's general path then runs, and raises)
  c10::optional<std::tuple<at::Tensor, at::Tensor>> forward_packed(const at::Tensor& data, const at::Tensor& batch_sizes,
                                                                   const c10::optional<at::Tensor>& sorted_indices,
                                                                   const c10::optional<at::Tensor>& unsorted_indices,
                                                                   const c10::optional<at::Tensor>& hx) const;
  // Stack::call on its Stack (a unidirectional model whose layers requantize per tensor), else nullopt
  c10::optional<std::tuple<at::Tensor, at::Tensor>> call(const at::Tensor& x, const c10::optional<at::Tensor>& h0) const;
  std::vector<std::string> gemm_paths() const;  // each layer and direction's GEMM path (tests)
  std::vector<std::string> cell_kinds() const;  // each layer and direction's cell (Layer::cell_kind)
  std::vector<std::string> one_row_paths() const;  // each one's one-row path (Layer::one_row_path, "": none)
  std::vector<bool> one_row_made() const;          // whether each one's one-row Layer was made (a call ran it)
  struct Impl;
  std::shared_ptr<Impl> impl;
};

}  // namespace cpu_api
}  // namespace qgru
