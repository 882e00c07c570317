// The CUDA backend's interface to its Python binding (bind_cuda.cpp): the Layer and the Stack as
// handles to their implementation in qgru_cuda.cpp (the layer and plan code, whose classes stay
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
namespace cuda_api {

at::Tensor quantize(const at::Tensor& x, double scale, int64_t zp, int64_t bits, const std::string& what);
// golden.quantize_levels: (q int32, level int32 per token) on the x levels [scale, lo, hi]; NaN as quantize.
std::tuple<at::Tensor, at::Tensor> quantize_levels(const at::Tensor& x, const std::vector<double>& scale,
                                                   const std::vector<double>& lo, const std::vector<double>& hi,
                                                   int64_t zp, int64_t bits, const std::string& what);
at::Tensor dequantize(const at::Tensor& q, double scale, int64_t zp);
// golden.requantize_input, per tensor, of a layer's integer outputs (values of at most 16 bits, as
// every Layer's are): int16 [q.sizes()] on the target grid, one kernel pass (cuda::requantize, the
// CUDA Stack's).
at::Tensor requantize(const at::Tensor& q, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                      int64_t to_bits);
int64_t nan_flags(int64_t device, bool clear);
void check_cublas_version();

// One layer and direction (qgru_cuda.cpp CudaLayer).
class Layer {
 public:
  Layer(TensorMap tensors, IntMap values);
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& qx, const at::Tensor& qh0,
                                             const c10::optional<at::Tensor>& lengths,
                                             const c10::optional<at::Tensor>& level);
  int64_t x_levels() const;
  std::map<std::string, int64_t> counters() const;
  int64_t window_steps(int64_t T, int64_t N) const;
  std::map<std::string, int64_t> persistent_plan(int64_t N) const;
  struct Impl;
  std::shared_ptr<Impl> impl;
};

// A unidirectional stack in one call (qgru_cuda.cpp CudaStack); levels: layer 0's x levels as
// [scale, lo, hi], or empty.
class Stack {
 public:
  Stack(const std::vector<std::shared_ptr<Layer>>& layers, std::vector<std::vector<double>> values,
        const std::vector<std::vector<double>>& levels);
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& h0) const;
  struct Impl;
  std::shared_ptr<Impl> impl;
};

}  // namespace cuda_api
}  // namespace qgru
