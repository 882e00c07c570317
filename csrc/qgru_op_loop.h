// The integer GRU between its float boundaries as qgru/runtime.py _integer_forward runs it layer by
// layer, in ATen calls that run on any device: the operator's CUDA kernel (op_cuda.cpp) runs its
// calls through it. The backend gives four things (Ops): quantize, quantize_levels, dequantize and
// its Layer's forward; the rest is here, the reference's torch calls as ATen calls:
//   - layer 0: x quantized on each direction's own grid (on each token's x level where it has
//     levels), a backward direction's input reversed within each length (runtime.py
//     reverse_within_lengths: quantizing is elementwise and a level is its token's, so reversing
//     the quantized rows gives the quantized reversed rows) and its output reversed back;
//   - layer l > 0: each source direction's outputs moved onto this direction's x grid by the
//     backend's requantize (golden.requantize_input, per tensor: every QuantParams' in_ factors
//     are, qgru/export.py) and concatenated on the channel axis;
//   - every h0 quantized on its unit's h grid, the last layer's outputs and every h_n dequantized.
// The CPU operator (cpu/op_cpu.cpp) runs its own loop on raw pointers; the CPU backend runs this one
// too (cpu_api::Model::forward_generic), and tests/test_op_cuda_host.py holds the two equal on CPU
// tensors bit for bit: this file's part of a CUDA call is checked on machines without a GPU.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "qgru_check.h"
#include "qgru_op_spec.h"

namespace qgru {
namespace op {

// runtime.py reverse_within_lengths: each row of a time-major [T, N, ...] tensor reversed within its
// length (lengths int64 [N] on x's device; undefined: every row's length is T, a flip); padding
// steps stay where they are. One row gather, made on x's device.
inline at::Tensor reverse_within(const at::Tensor& x, const at::Tensor& lengths) {
  if (!lengths.defined()) return x.flip(0);
  const int64_t T = x.size(0), N = x.size(1);
  const at::TensorOptions i64 = x.options().dtype(at::kLong);
  const at::Tensor t = at::arange(T, i64).unsqueeze(1);
  const at::Tensor L = lengths.unsqueeze(0);
  const at::Tensor idx = at::where(t < L, L - 1 - t, t);  // [T, N]: each row's source step
  const at::Tensor flat = (idx * N + at::arange(N, i64)).reshape({-1});
  return x.reshape({T * N, -1}).index_select(0, flat).reshape(x.sizes());
}

// The layers and directions of spec s on x [T, N, I] and hx [L D, N, H] (floating point, on the
// backend's device; lengths: int64 [N] there, each in [1, T], or undefined) -> (out [T, N, D H], h_n
// [L D, N, H]) in x's dtype. Ops (the backend):
//   at::Tensor quantize(const at::Tensor& v, double scale, int64_t zp, int64_t bits, const char* what)
//   std::tuple<at::Tensor, at::Tensor> quantize_levels(const at::Tensor& x, const Unit& u)  (q, level [T, N])
//   at::Tensor requantize(const at::Tensor& q, int64_t from_zp, int64_t mult, int64_t shift,
//                         int64_t to_zp, int64_t to_bits)                                 (integer)
//   at::Tensor dequantize(const at::Tensor& q, double scale, int64_t zp)                     (float32)
//   std::tuple<at::Tensor, at::Tensor> layer(int64_t k, qx, qh0, lengths, level)             (out, h_n)
// (lengths and level: c10::optional). A spec whose layers requantize per channel (which no
// QuantParams holds) is refused.
template <class Ops>
std::tuple<at::Tensor, at::Tensor> run_layers(const Spec& s, Ops& ops, const at::Tensor& x, const at::Tensor& hx,
                                              const at::Tensor& lengths) {
  for (const Unit& u : s.units)
    for (const auto& m : u.in_mult)
      QGRU_CHECK_VALUE(m.size() == 1, "qgru::integer_gru: the spec requantizes a layer's input per channel, which no "
                       "QuantParams holds (its in_ factors are per tensor): not a spec qgru.ops.flatten_params made");
  const int64_t L = s.L, D = s.D;
  const c10::optional<at::Tensor> len = lengths.defined() ? c10::optional<at::Tensor>(lengths) : c10::nullopt;
  std::vector<at::Tensor> prev, h_n;  // the previous layer's integer outputs per direction (time order)
  for (int64_t l = 0; l < L; ++l) {
    std::vector<at::Tensor> outs;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t k = l * D + d;
      const Unit& u = s.units[(size_t)k];
      at::Tensor qx, level;
      if (l == 0 && !u.lv_scale.empty()) {
        std::tie(qx, level) = ops.quantize_levels(x, u);
      } else if (l == 0) {
        qx = ops.quantize(x, u.sx, u.zx, u.bx, "input");
      } else {
        std::vector<at::Tensor> parts;
        for (int64_t e = 0; e < D; ++e)
          parts.push_back(ops.requantize(prev[(size_t)e], s.units[(size_t)((l - 1) * D + e)].zh, u.in_mult[(size_t)e][0],
                                         u.in_shift[(size_t)e][0], u.zx, u.bx));
        qx = parts.size() == 1 ? parts[0] : at::cat(parts, -1);
      }
      if (d == 1) {
        qx = reverse_within(qx, lengths);
        if (level.defined()) level = reverse_within(level, lengths);
      }
      const at::Tensor qh0 = ops.quantize(hx.select(0, k), u.sh, u.zh, u.bh, "h0");
      const c10::optional<at::Tensor> lv = level.defined() ? c10::optional<at::Tensor>(level) : c10::nullopt;
      at::Tensor o, h;
      std::tie(o, h) = ops.layer(k, qx, qh0, len, lv);
      outs.push_back(d == 1 ? reverse_within(o, lengths) : o);
      h_n.push_back(h);
    }
    prev = std::move(outs);
  }
  std::vector<at::Tensor> out_parts, h_parts;
  for (int64_t d = 0; d < D; ++d) {
    const Unit& u = s.units[(size_t)((L - 1) * D + d)];
    out_parts.push_back(ops.dequantize(prev[(size_t)d], u.sh, u.zh).to(x.scalar_type()));
  }
  for (int64_t k = 0; k < L * D; ++k) {
    const Unit& u = s.units[(size_t)k];
    h_parts.push_back(ops.dequantize(h_n[(size_t)k], u.sh, u.zh).to(x.scalar_type()));
  }
  return {out_parts.size() == 1 ? out_parts[0] : at::cat(out_parts, -1), at::stack(h_parts)};
}

}  // namespace op
}  // namespace qgru
