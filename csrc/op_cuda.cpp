// qgru CUDA backend: the operator qgru::integer_gru's CUDA kernel (TORCH_LIBRARY_IMPL), in the CUDA
// backend's library without Python (qgru/native/build.py CUDA_LIBRARY), so that a saved
// torch.export program or an AOTInductor package of a model on the GPU runs wherever the cpu
// library (which defines the operator) and this one are loaded: a Python process that never imports
// qgru (torch.ops.load_library, both), or a libtorch-only C++ program (dlopen, both).
//
// It runs what qgru/runtime.py _integer_forward runs on the cuda backend, with the same C++: a
// unidirectional stack without lengths whose layers requantize per tensor is the CUDA Stack
// (native.cuda_stack_forward's), every other call the layer loop of qgru_op_loop.h (run_layers:
// the reference's reversal within lengths in ATen calls on the device) around this backend's
// quantize, quantize_levels, requantize, dequantize and Layers. The Layers are made once per set of parameter
// tensors and device from the spec's "cuda" section (prepare_layer with CUDA_GEMM_MIN, as
// native/cuda.py cuda_layer makes them), the parameters copied to the device then.
//
// Nothing here waits for the GPU: lengths are taken on the CPU only (as pack_padded_sequence takes
// them), checked there, and copied to the device from pinned memory without a wait; NaN in x or
// h0 quantizes as 0 and sets the device flag (qgru.cuda_nan_seen), or raises with
// QGRU_CUDA_NAN_CHECK=1, as every CUDA forward does. The first call of a model on a device makes
// its Layers and copies (outside a CUDA graph capture, as torch.cuda.graph's warm-up runs it).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "qgru_check.h"
#include "qgru_cuda_backend.h"
#include "qgru_op_loop.h"
#include "qgru_op_spec.h"

namespace qgru {
namespace op {
namespace {

constexpr size_t kCudaCacheSize = 8;

// A spec's CUDA Layers (and Stack) for one set of parameter tensors at their versions, on one device.
struct CudaEntry {
  std::string spec;
  at::Device device{at::kCUDA, 0};
  HeldParams held;
  Spec parsed;
  std::vector<std::shared_ptr<cuda_api::Layer>> layers;  // [l D + d]
  std::shared_ptr<cuda_api::Stack> stack;                 // unidirectional, per-tensor requantization; else null
};

// The CUDA Stack of a unidirectional spec (qgru/native/stacks.py cuda_stack_plan's rows and
// levels), or null where it does not apply (bidirectional, a per-channel requantization).
std::shared_ptr<cuda_api::Stack> make_cuda_stack(const Spec& s,
                                                 const std::vector<std::shared_ptr<cuda_api::Layer>>& layers) {
  std::vector<std::vector<double>> rows, levels;
  if (!stack_args(s, rows, levels)) return nullptr;
  return std::make_shared<cuda_api::Stack>(layers, std::move(rows), levels);
}

std::shared_ptr<CudaEntry> make_cuda_entry(const std::vector<at::Tensor>& params, const std::string& spec,
                                           const at::Device& device) {
  auto e = std::make_shared<CudaEntry>();
  e->spec = spec, e->device = device;
  e->held.hold(params);
  e->parsed = parse_spec(spec, (int64_t)params.size());
  QGRU_CHECK_VALUE(e->parsed.cuda.size() == e->parsed.units.size(),
                   "qgru::integer_gru: this spec has no CUDA parameters (a model converted by an older qgru, "
                   "or a program exported from one): convert the model again with this qgru");
  // the Layers keep tensors across calls (workspaces, plans): made as normal tensors
  c10::InferenceMode normal(false);
  c10::cuda::CUDAGuard guard(device);
  for (const Variant& v : e->parsed.cuda) {
    auto args = variant_args(v, params, device, /*move=*/true);
    e->layers.push_back(std::make_shared<cuda_api::Layer>(std::move(args.first), std::move(args.second)));
  }
  e->stack = make_cuda_stack(e->parsed, e->layers);
  return e;
}

std::mutex g_cuda_mu;
std::list<std::shared_ptr<CudaEntry>> g_cuda_cache;  // most recently used first

std::shared_ptr<CudaEntry> cuda_entry_for(const std::vector<at::Tensor>& params, const std::string& spec,
                                          const at::Device& device) {
  std::lock_guard<std::mutex> lock(g_cuda_mu);
  for (auto it = g_cuda_cache.begin(); it != g_cuda_cache.end(); ++it)
    if ((*it)->device == device && (*it)->spec == spec && (*it)->held.same(params)) {
      auto e = *it;
      g_cuda_cache.erase(it);
      g_cuda_cache.push_front(e);
      return e;
    }
  auto e = make_cuda_entry(params, spec, device);
  g_cuda_cache.push_front(e);
  while (g_cuda_cache.size() > kCudaCacheSize) g_cuda_cache.pop_back();
  return e;
}

// The backend run_layers calls: the CUDA backend's quantize, requantize and dequantize (one kernel
// pass each, on qgru_fixedpoint.h) and the entry's Layers.
struct CudaOps {
  const CudaEntry& e;
  at::Tensor quantize(const at::Tensor& v, double scale, int64_t zp, int64_t bits, const char* what) {
    return cuda_api::quantize(v, scale, zp, bits, what);
  }
  std::tuple<at::Tensor, at::Tensor> quantize_levels(const at::Tensor& x, const Unit& u) {
    return cuda_api::quantize_levels(x, u.lv_scale, u.lv_lo, u.lv_hi, u.zx, u.bx, "input");
  }
  at::Tensor requantize(const at::Tensor& q, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                        int64_t to_bits) {
    return cuda_api::requantize(q, from_zp, mult, shift, to_zp, to_bits);
  }
  at::Tensor dequantize(const at::Tensor& q, double scale, int64_t zp) { return cuda_api::dequantize(q, scale, zp); }
  std::tuple<at::Tensor, at::Tensor> layer(int64_t k, const at::Tensor& qx, const at::Tensor& qh0,
                                           const c10::optional<at::Tensor>& lengths,
                                           const c10::optional<at::Tensor>& level) {
    return e.layers[(size_t)k]->forward(qx, qh0, lengths, level);
  }
};

std::tuple<at::Tensor, at::Tensor> run_cuda(const CudaEntry& e, const at::Tensor& x, const at::Tensor& hx,
                                            const at::Tensor& lengths) {
  if (e.stack && !lengths.defined()) {  // the eager module's one-call form (native.cuda_stack_forward)
    at::Tensor out, h_n;
    std::tie(out, h_n) = e.stack->forward(x, hx);  // float32
    if (x.scalar_type() == at::kFloat) return {out, h_n};
    return {out.to(x.scalar_type()), h_n.to(x.scalar_type())};
  }
  CudaOps ops{e};
  return run_layers(e.parsed, ops, x, hx, lengths);
}

}  // namespace

// The operator's checks of x, hx and lengths (op_cpu.cpp checked_run's, on the GPU's terms), then run.
std::tuple<at::Tensor, at::Tensor> integer_gru_cuda(const at::Tensor& x_in, const at::Tensor& hx_in,
                                                    const c10::optional<at::Tensor>& lengths_in,
                                                    at::TensorList params_in, c10::string_view spec_in) {
  QGRU_CHECK_VALUE(x_in.dim() == 3 && x_in.is_floating_point() && x_in.is_cuda(),
                   "qgru::integer_gru: x must be a float CUDA tensor [T, N, I] here, got ", x_in.scalar_type(), " ",
                   x_in.sizes(), " on ", x_in.device());
  QGRU_CHECK_VALUE(x_in.size(0) >= 1, "QuantGRU expects a sequence of at least one step, got an input of shape ",
                   x_in.sizes(), " (sequence length 0; torch.nn.GRU refuses it too)");
  const at::Device device = x_in.device();
  const std::string spec(spec_in.data(), spec_in.size());
  const std::vector<at::Tensor> params(params_in.begin(), params_in.end());
  const auto e = cuda_entry_for(params, spec, device);
  const Spec& s = e->parsed;
  const int64_t T = x_in.size(0), N = x_in.size(1);
  QGRU_CHECK_VALUE(x_in.size(2) == s.I, "qgru::integer_gru: x must be [T, N, ", s.I, "], got ", x_in.sizes());
  QGRU_CHECK_VALUE(hx_in.dim() == 3 && hx_in.size(0) == s.L * s.D && hx_in.size(1) == N && hx_in.size(2) == s.H &&
                       hx_in.is_floating_point() && hx_in.device() == device,
                   "qgru::integer_gru: hx must be a float tensor [", s.L * s.D, ", ", N, ", ", s.H, "] on ", device,
                   ", got ", hx_in.sizes(), " on ", hx_in.device());
  c10::cuda::CUDAGuard guard(device);
  at::Tensor lengths;
  if (lengths_in.has_value()) {
    QGRU_CHECK_VALUE(lengths_in->dim() == 1 && lengths_in->size(0) == N && !lengths_in->is_floating_point() &&
                         lengths_in->device().is_cpu(),
                     "qgru::integer_gru: lengths must be an integer CPU tensor [", N,
                     "] (as pack_padded_sequence takes them: checking them on the GPU would wait for it)");
    const at::Tensor host = lengths_in->resolve_neg().to(at::kLong).contiguous();
    const int64_t* p = host.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n)
      QGRU_CHECK_VALUE(p[n] >= 1 && p[n] <= T, "qgru::integer_gru: lengths[", n, "] = ", p[n], " is outside [1, ", T,
                       "]");
    lengths = host.pin_memory().to(device, /*non_blocking=*/true);  // no wait for the GPU
  }
  const at::Tensor x = x_in.resolve_conj().resolve_neg(), hx = hx_in.resolve_conj().resolve_neg();
  if (c10::InferenceMode::is_enabled()) {
    // the Layers' reused buffers must stay normal tensors (qgru/native/layer.py gru_direction)
    c10::InferenceMode normal(false);
    return run_cuda(*e, x, hx, lengths);
  }
  return run_cuda(*e, x, hx, lengths);
}

}  // namespace op
}  // namespace qgru

TORCH_LIBRARY_IMPL(qgru, CUDA, m) { m.impl("integer_gru", &qgru::op::integer_gru_cuda); }
