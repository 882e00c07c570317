// qgru CUDA backend, torch binding: owns the parameter tensors and per-shape buffers (a "plan"),
// runs the torch-free driver (qgru_cuda_kernels.cu) on PyTorch's current stream, and replays the
// whole forward as a CUDA graph from the second call of a shape on: launch latency, not
// arithmetic, bounds a per-step design (one GEMM + one cell kernel per step). Calls of nearby
// lengths share a shape: a plan holds plan_steps(T) steps (qgru_cuda_launch.h) and a shorter call
// caps its rows' lengths at T. A layer keeps the plans of its last few shapes (plans_to_keep), so
// alternating shapes replay their graphs. A shape whose plan would keep more than
// QGRU_CUDA_PLAN_MAX_BYTES (default: a quarter of the device's free memory when the plan would be
// made, at least 256 MiB: qgru_cuda_launch.h plan_max_bytes; its T-sized qx and out above all,
// which share one buffer) gets none: it runs eagerly in buffers of its own call, and the layer keeps
// nothing of it.
//
// Ordering: calls may come from several threads and streams. A mutex orders the host side; on the
// device every use of a plan's buffers waits for the previous call's last use (an event), and a
// plan is freed only after its last use. The graph's GEMMs run on qgru's own cuBLAS handle with a
// workspace the plan owns, so nothing PyTorch frees can be baked into the graph. Inside a capture
// of the caller's (torch.cuda.graph) a call runs eagerly on the capturing stream with buffers of
// its own and touches no plan.
//
// Its Python binding is bind_cuda.cpp, which sees this file through qgru_cuda_backend.h only.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ATen.h>  // (no torch/extension.h: the CUDA library that holds the operator's CUDA kernel has no Python)

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "qgru_cuda.h"
#include "qgru_cuda_backend.h"
#include "qgru_cuda_launch.h"
#include "qgru_layer.h"
#include "qgru_check.h"

namespace qgru {
namespace {

void check_cuda(cudaError_t e, const char* what) {
  QGRU_CHECK(e == cudaSuccess, "qgru cuda: ", what, ": ", cudaGetErrorString(e));
}

void check_cublas(cublasStatus_t s, const char* what) {
  QGRU_CHECK(s == CUBLAS_STATUS_SUCCESS, "qgru cuda: ", what, " failed with cuBLAS status ", (int)s);
}

// The cuBLAS loaded at run time (qgru/native/build.py links the one torch runs) must have the major
// version of the headers this file was compiled with: its API and ABI are those of a major version.
void check_cublas_version() {
  int major = -1, minor = -1, patch = -1;
  check_cublas(cublasGetProperty(MAJOR_VERSION, &major), "cublasGetProperty");
  check_cublas(cublasGetProperty(MINOR_VERSION, &minor), "cublasGetProperty");
  check_cublas(cublasGetProperty(PATCH_LEVEL, &patch), "cublasGetProperty");
  QGRU_CHECK(major == CUBLAS_VER_MAJOR, "qgru cuda: compiled against the cuBLAS ", CUBLAS_VER_MAJOR, ".",
              CUBLAS_VER_MINOR, " headers, but the loaded libcublas is ", major, ".", minor, ".", patch,
              ": rebuild with the CUDA toolkit of torch's CUDA version (python -m qgru build --kind cuda)");
}

// NaN at the float boundary (docs/spec.md section 11). NaN has no quantized value: it takes the
// value 0.0 takes (quantize_value) and sets a bit of its device's NaN flag, kNanInput for an input,
// kNanH0 for an h0. By default nothing reads the flag during a forward (reading it would wait for
// the GPU: no forward synchronises, and a caller's torch.cuda.graph can capture one); qgru's
// cuda_nan_seen() reads it and clears it (nan_flags below). QGRU_CUDA_NAN_CHECK=1 restores the
// synchronous check instead: each call then raises the CPU backend's ValueError on NaN, reading a
// flag of its own on the host (and cannot run inside a capture).
constexpr int32_t kNanInput = 1, kNanH0 = 2;

// The device's flag: one int32, made once, outside any capture (captured graphs keep its
// address, so it is never freed), zeroed before its first use.
int32_t* device_nan_flag(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, int32_t*> flags;
  std::lock_guard<std::mutex> lock(mu);
  int32_t*& f = flags[device];
  if (f == nullptr) {
    c10::cuda::CUDAGuard guard(device);
    cudaStream_t cur = at::cuda::getCurrentCUDAStream().stream();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(cur, &capture), "cudaStreamIsCapturing");
    QGRU_CHECK(capture == cudaStreamCaptureStatusNone, "qgru cuda: the first qgru call on a device must run ",
                "outside a CUDA graph capture (it sets up the device's NaN flag): call the model once before ",
                "capturing, as torch.cuda.graph's warm-up advice says");
    int32_t* made = nullptr;
    check_cuda(cudaMalloc(&made, sizeof(int32_t)), "cudaMalloc (NaN flag)");
    // once per device and process: zeroed before any stream can use it
    check_cuda(cudaMemsetAsync(made, 0, sizeof(int32_t), cur), "cudaMemsetAsync (NaN flag)");
    check_cuda(cudaStreamSynchronize(cur), "cudaStreamSynchronize (NaN flag)");
    f = made;
  }
  return f;
}

// QGRU_CUDA_NAN_CHECK: unset, "" or "0": no check (the default); "1": the synchronous check.
bool nan_check_enabled() {
  const char* env = std::getenv("QGRU_CUDA_NAN_CHECK");
  if (env == nullptr || *env == '\0' || std::string(env) == "0") return false;
  QGRU_CHECK_VALUE(std::string(env) == "1", "qgru cuda: QGRU_CUDA_NAN_CHECK='", env, "' must be 0 or 1");
  return true;
}

// The synchronous check's flag: this call's own, zeroed on the current stream; refused inside a
// capture, where reading it on the host is impossible.
at::Tensor checked_nan_flag(const at::TensorOptions& opts) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream().stream(), &capture), "cudaStreamIsCapturing");
  QGRU_CHECK(capture == cudaStreamCaptureStatusNone, "qgru cuda: QGRU_CUDA_NAN_CHECK=1 reads each call's NaN ",
              "flag on the host, which a CUDA graph capture forbids: unset it to capture (NaN then quantizes as ",
              "0.0 and is reported by qgru.cuda_nan_seen())");
  return at::zeros({1}, opts.dtype(at::kInt));
}

// Reads a call's own flag (waits for the GPU): the CPU backend's ValueError where it is set.
void raise_on_nan(const at::Tensor& flag) {
  const int32_t v = flag.item<int32_t>();
  const char* what = (v & kNanInput) ? "input" : "h0";
  QGRU_CHECK_VALUE(v == 0, "QuantGRU ", what, " contains NaN, which has no quantized value ",
                    "(out-of-range and infinite values saturate)");
}

// qgru.cuda_nan_seen(): the device's flag (kNanInput | kNanH0 bits) after the work enqueued on the
// current stream so far, cleared when `clear`. Waits for that work.
int64_t nan_flags(int64_t device, bool clear) {
  QGRU_CHECK(device >= 0 && device < at::cuda::device_count(), "qgru cuda: no CUDA device ", device);
  c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  int32_t* f = device_nan_flag((c10::DeviceIndex)device);
  cudaStream_t cur = at::cuda::getCurrentCUDAStream().stream();
  int32_t v = 0;
  check_cuda(cudaMemcpyAsync(&v, f, sizeof(int32_t), cudaMemcpyDeviceToHost, cur), "cudaMemcpyAsync (NaN flag)");
  if (clear) check_cuda(cudaMemsetAsync(f, 0, sizeof(int32_t), cur), "cudaMemsetAsync (NaN flag)");
  check_cuda(cudaStreamSynchronize(cur), "cudaStreamSynchronize (NaN flag)");
  return v;
}

cuda::GemmDesc gemm_desc(const LayerTensors& lt, const std::string& k) {
  const at::Tensor& w = lt.tensor(k + "_weight_limbs");
  QGRU_CHECK(w.scalar_type() == at::kChar && w.dim() == 3 && w.is_contiguous(), "qgru cuda: bad ", k, "_weight_limbs");
  cuda::GemmDesc g{};
  g.weight_limbs = w.data_ptr<int8_t>();
  g.M_pad = w.size(1);
  g.K_pad = w.size(2);
  QGRU_CHECK(g.M_pad % cuda::kPad == 0 && g.K_pad % cuda::kPad == 0 && g.M_pad >= cuda::kMinGemmDim &&
                  g.K_pad >= cuda::kMinGemmDim,
              "qgru cuda: ", k, "_weight_limbs [", g.M_pad, ", ", g.K_pad, "] must be padded to multiples of ", cuda::kPad,
              ", at least ", cuda::kMinGemmDim, " (prepare_layer(gemm_min=CUDA_GEMM_MIN))");
  at::Tensor pr = lt.pairs(k);
  g.P = (int)pr.size(0);
  QGRU_CHECK(g.P == 1 || g.P == 2 || g.P == 4, "qgru cuda: unsupported number of limb pairs ", g.P);
  auto a = pr.accessor<int64_t, 2>();
  for (int p = 0; p < g.P; ++p) {
    g.act_limb[p] = (int)a[p][0];
    g.weight_limb[p] = (int)a[p][1];
    g.scale[p] = a[p][2];
    g.weight_offset[p] = a[p][3];
  }
  return g;
}

// Device buffers for one forward of shape (T, N): a plan's (kept between calls), or one call's
// own inside a foreign graph capture.
struct Buffers {
  // qx [T, N, I] and out [T, N, H]: views of `steps`, one int16 buffer (qgru_cuda_launch.h
  // step_buffer: out overwrites only x the forward has read)
  at::Tensor steps, qx, state, out, lengths, x_limbs, Gx, h_limbs, Gh, dwx;
  at::Tensor pk_h, pk_counter;  // the persistent recurrence's (ws.pk.blocks > 0)
  at::Tensor level;  // a layer with x levels: int32 [T, N], each token's (zeros: see plan_steps)
  cuda::Workspace ws{};
  int fp_reason = -1;  // QGRU_CUDA_FUSED=2: why ws.fp runs (cuda::kFpFits) or not (FpFit); -1: not asked
};

cuda::LayerDims layer_dims(const cuda::LayerDesc& d) {
  return {d.H, d.I, d.x_levels, d.wx.P, d.wx.M_pad, d.wx.K_pad, d.rh.P, d.rh.M_pad, d.rh.K_pad};
}

// The plan's sizes (qgru_cuda_launch.h plan_sizes), checked against the driver's workspace_sizes.
cuda::PlanSizes plan_sizes(const cuda::LayerDesc& d, int64_t T, int64_t N, bool has_lengths, const cuda::PkPlan& pk) {
  const cuda::PlanSizes p = cuda::plan_sizes(layer_dims(d), T, N, has_lengths, pk.blocks > 0 ? pk.h_buffer : 0);
  const cuda::WorkspaceSizes s = cuda::workspace_sizes(d, T, N);
  QGRU_CHECK(p.window_steps == s.window_steps && p.chunk_rows == s.chunk_rows && p.N_pad == s.N_pad &&
                  p.x_limb == s.x_limb && p.Gx == s.Gx && p.h_limb == s.h_limb && p.Gh == s.Gh && p.dwx == s.dwx,
              "qgru cuda: internal error: plan_sizes and workspace_sizes disagree");
  return p;
}

// pk: the layer's persistent plan for N rows (pk.blocks == 0: none; CudaLayer::persistent_plan).
Buffers make_buffers(const cuda::LayerDesc& d, int64_t T, int64_t N, bool has_lengths, const cuda::PkPlan& pk,
                     const at::TensorOptions& opts) {
  Buffers b;
  const cuda::PlanSizes s = plan_sizes(d, T, N, has_lengths, pk);
  auto i8 = opts.dtype(at::kChar), i32 = opts.dtype(at::kInt), i64 = opts.dtype(at::kLong);
  auto i16 = opts.dtype(at::kShort);  // T-sized: activations of at most 16 bits (qgru_cuda.h)
  b.steps = at::zeros({s.steps.elems}, i16);  // quantized x (zeros: see plan_steps) and the output
  b.qx = b.steps.narrow(0, s.steps.qx_offset, T * N * d.I).view({T, N, d.I});
  b.out = b.steps.narrow(0, s.steps.out_offset, T * N * d.H).view({T, N, d.H});
  if (d.x_levels > 0) b.level = at::zeros({T, N}, i32);
  b.state = at::empty({N, d.H}, i32);
  if (has_lengths) b.lengths = at::empty({N}, i64);
  // limb buffers zeroed once: their padding (K and rows) must read as 0 in every GEMM
  b.x_limbs = at::zeros({2, s.x_limb}, i8);
  b.h_limbs = at::zeros({2, s.h_limb}, i8);
  b.Gx = at::empty({d.wx.P, s.Gx}, i32);
  b.Gh = at::empty({d.rh.P, s.Gh}, i32);
  b.dwx = at::empty({s.dwx}, i32);
  cuda::Workspace& ws = b.ws;
  ws.window_steps = s.window_steps;
  ws.chunk_rows = s.chunk_rows;
  ws.N_pad = s.N_pad;
  for (int i = 0; i < 2; ++i) {
    ws.x_limbs[i] = b.x_limbs[i].data_ptr<int8_t>();
    ws.h_limbs[i] = b.h_limbs[i].data_ptr<int8_t>();
  }
  for (int i = 0; i < d.wx.P; ++i) ws.Gx[i] = b.Gx[i].data_ptr<int32_t>();
  for (int i = 0; i < d.rh.P; ++i) ws.Gh[i] = b.Gh[i].data_ptr<int32_t>();
  ws.dwx = b.dwx.data_ptr<int32_t>();
  ws.pk = pk;
  if (pk.blocks > 0) {
    b.pk_h = at::zeros({pk.h_buffer}, i8);  // zeroed once: the padding k >= H reads as 0 in every step
    b.pk_counter = at::zeros({1}, i32);
    ws.pk_h = b.pk_h.data_ptr<int8_t>();
    ws.pk_counter = (uint32_t*)b.pk_counter.data_ptr<int32_t>();
  }
  return b;
}

int64_t buffer_bytes(const Buffers& b) {
  int64_t n = 0;
  for (const at::Tensor* t :  // (qx and out are views of steps)
       {&b.steps, &b.level, &b.state, &b.lengths, &b.x_limbs, &b.Gx, &b.h_limbs, &b.Gh, &b.dwx, &b.pk_h,
        &b.pk_counter})
    if (t->defined()) n += (int64_t)t->nbytes();
  return n;
}

// buffer_bytes(make_buffers(d, T, N, has_lengths, ...)) before allocating them (make_plan checks
// that the two agree).
int64_t buffer_bytes(const cuda::LayerDesc& d, int64_t T, int64_t N, bool has_lengths, const cuda::PkPlan& pk) {
  return plan_sizes(d, T, N, has_lengths, pk).bytes;
}

// QGRU_CUDA_PLAN_MAX_BYTES: the most bytes a plan may keep between calls, a non-negative integer
// or a clear error; unset or "": -1, a share of the device's free memory (plan_max_bytes).
int64_t plan_max_bytes_from_env() {
  const char* env = std::getenv("QGRU_CUDA_PLAN_MAX_BYTES");
  if (env == nullptr || *env == '\0') return -1;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(env, &end, 10);
  QGRU_CHECK_VALUE(errno == 0 && end != env && *end == '\0' && v >= 0, "qgru cuda: QGRU_CUDA_PLAN_MAX_BYTES='",
                    env, "' is not a non-negative integer (bytes)");
  return (int64_t)v;
}

// QGRU_CUDA_PERSISTENT: "1": the persistent recurrence where a layer's shape fits (qgru_persistent.h
// pk_plan, persistent_plan); unset, "" or "0": never (one R.h GEMM and one cell kernel per step). Off by
// default until a GPU has run it against the golden model (it has only been checked on the host).
bool persistent_from_env() {
  const char* env = std::getenv("QGRU_CUDA_PERSISTENT");
  if (env == nullptr || *env == '\0' || std::string(env) == "0") return false;
  QGRU_CHECK_VALUE(std::string(env) == "1", "qgru cuda: QGRU_CUDA_PERSISTENT='", env, "' must be 0 or 1");
  return true;
}

// QGRU_CUDA_FUSED: "1": the fused step (qgru_cuda_fused.cu: one kernel per step, R.h by int8 mma.sync
// and the cell in registers) for the layers it takes (cuda::fused_supported: one R.h limb pair, sm_80
// or newer) where no persistent plan runs; "2": the same step body persistent (one cooperative launch
// per W.x window, R's rows in shared memory, h exchanged by per-CTA step flags) where its plan fits
// (cuda::fused_persistent_plan: co-residency by the occupancy API), else the fused step of "1", the
// reason in the counter fused_persistent_reason; unset, "" or "0": never. Read once, when a Layer is
// made. Off by default until a GPU has run them against the golden model (host emulation and SASS
// checks only).
int fused_from_env() {
  const char* env = std::getenv("QGRU_CUDA_FUSED");
  if (env == nullptr || *env == '\0' || std::string(env) == "0") return 0;
  QGRU_CHECK_VALUE(std::string(env) == "1" || std::string(env) == "2", "qgru cuda: QGRU_CUDA_FUSED='", env,
                    "' must be 0, 1 or 2");
  return std::string(env) == "1" ? 1 : 2;
}

// qgru's own cuBLAS handle, one per device, for the runs on a workspace qgru owns (the first call of
// a shape, the capture of its graph, and calls inside a caller's capture). A graph captured on PyTorch's handle would
// bake in PyTorch's workspace for that stream, which torch._C._cuda_clearCublasWorkspaces(), a
// pooled stream's reuse, or torch's own workspace policy can free while the graph lives. The handle
// is not thread-safe: `mu` is held from cublasSetStream to the last GEMM enqueued. Never destroyed:
// cuBLAS may be unloaded before static destructors run at exit.
struct OwnHandle {
  std::mutex mu;
  cublasHandle_t handle = nullptr;
};

OwnHandle& own_handle(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::map<c10::DeviceIndex, OwnHandle*> handles;
  std::lock_guard<std::mutex> lock(mu);
  OwnHandle*& h = handles[device];
  if (h == nullptr) {
    cublasHandle_t created = nullptr;
    check_cublas(cublasCreate(&created), "cublasCreate");  // on `device` (the caller's CUDAGuard)
    h = new OwnHandle;
    h->handle = created;
  }
  return *h;
}

// cuBLAS's recommended workspace (cublasSetWorkspace): 32 MiB on Hopper and later, 4 MiB before.
int64_t cublas_workspace_bytes(c10::DeviceIndex device) {
  return at::cuda::getDeviceProperties(device)->major >= 9 ? (int64_t)32 << 20 : (int64_t)4 << 20;
}

struct Plan {  // buffers (and the captured graph) for one (steps, N, lengths?) shape (plan_steps)
  int64_t T = -1, N = -1;
  bool has_lengths = false;
  int64_t bytes = 0;     // of its buffers and workspace (plans_to_keep)
  Buffers b;
  at::Tensor cublas_ws;  // the workspace of the graph's GEMMs (and of the eager run before its capture)
  cudaGraphExec_t exec = nullptr;
  // recorded on the caller's stream after every call's last use of the buffers (the output copies);
  // the next call, on whichever stream, waits for it before touching them
  cudaEvent_t last_use = nullptr;

  ~Plan() {
    // The caching allocator hands the buffers' memory out again on the stream they were allocated
    // on, which need not be ordered after their last use (a later call on another stream, or the
    // graph on a side stream): wait for it on the host before they are freed (after this body).
    if (last_use != nullptr) cudaEventSynchronize(last_use);
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (last_use != nullptr) cudaEventDestroy(last_use);
  }
};

// Records `event` on `stream` when the scope ends, also when it ends by an exception: the next call
// must wait for whatever this one enqueued.
class RecordOnExit {
 public:
  RecordOnExit(cudaEvent_t event, cudaStream_t stream) : event_(event), stream_(stream) {}
  void record() {
    recorded_ = true;
    check_cuda(cudaEventRecord(event_, stream_), "cudaEventRecord");
  }
  ~RecordOnExit() {
    if (!recorded_) cudaEventRecord(event_, stream_);
  }

 private:
  cudaEvent_t event_;
  cudaStream_t stream_;
  bool recorded_ = false;
};

class CudaLayer {
 public:
  CudaLayer(TensorMap tensors, IntMap values) : lt_{std::move(tensors), std::move(values)} {
    for (auto& kv : lt_.t)
      QGRU_CHECK(kv.second.is_cuda(), "qgru cuda backend: '", kv.first, "' is not on a CUDA device");
    // the kernels split every activation of more than 8 bits into two limbs: none is taken whole
    QGRU_CHECK(lt_.value("x_direct16") == 0 && lt_.value("h_direct16") == 0 && lt_.acc_wide() == 0,
                "qgru cuda backend: 16-bit activations taken whole (x_direct16, h_direct16) and the int32 cell's "
                "wide accumulators (acc_wide) are a CPU path's");
    d_.H = lt_.value("H");
    d_.I = lt_.value("I");
    d_.x_bits = (int32_t)lt_.value("x_bits");
    d_.h_bits = (int32_t)lt_.value("h_bits");
    d_.ones_col = lt_.value("ones_col");
    d_.pow2 = lt_.value("pow2") != 0;
    d_.acc32 = lt_.value("acc32") != 0;
    d_.wx = gemm_desc(lt_, "x");
    d_.rh = gemm_desc(lt_, "h");
    d_.x_levels = lt_.x_levels();
    d_.acc_x = lt_.acc_x();  // every x level's (x_levels > 0), else the static grid's
    d_.acc_x32 = lt_.acc32_x();
    d_.cell = lt_.cell();
    device_ = lt_.tensor("Wx_bias").device();
    const char* env = std::getenv("QGRU_CUDA_GRAPH");
    use_graph_ = env == nullptr || std::string(env) != "0";
    plan_env_bytes_ = plan_max_bytes_from_env();
    persistent_ = persistent_from_env();
    fused_mode_ = fused_from_env();
    fused_ = fused_mode_ > 0 && cuda::fused_supported(d_, device_.index());
    // qgru's own cuBLAS handle exists from here on: creating it inside a graph capture would fail
    c10::cuda::CUDAGuard guard(device_);
    own_handle(device_.index());
    device_nan_flag(device_.index());  // so is the device's NaN flag
  }

  // level: each token's x level [T, N] (a layer with x levels; its values are not read on the host,
  // which would wait for the GPU: the kernels clamp them into range), else none.
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& qx, const at::Tensor& qh0,
                                             const c10::optional<at::Tensor>& lengths,
                                             const c10::optional<at::Tensor>& level = c10::nullopt) {
    QGRU_CHECK(qx.is_cuda() && qh0.is_cuda(), "qgru cuda: inputs must be CUDA tensors");
    QGRU_CHECK(qx.device() == device_ && qh0.device() == device_, "qgru cuda: inputs on ", qx.device(), " and ",
                qh0.device(), ", parameters on ", device_);
    QGRU_CHECK(qx.dim() == 3 && qx.size(2) == d_.I, "qgru cuda: qx must be [T, N, ", d_.I, "]");
    QGRU_CHECK(qh0.dim() == 2 && qh0.size(0) == qx.size(1) && qh0.size(1) == d_.H, "qgru cuda: qh0 must be [N, ",
                d_.H, "]");
    const bool has_lengths = lengths.has_value();
    if (has_lengths)
      QGRU_CHECK(lengths->device() == device_ && lengths->dim() == 1 && lengths->size(0) == qx.size(1),
                  "qgru cuda: lengths must be [N] on ", device_);
    QGRU_CHECK(!level.has_value() || d_.x_levels > 0, "qgru cuda: this layer has no x levels, yet a level per token ",
                "was given");
    // a layer with x levels given no level: every token on level 0, the static grid (golden.gru_direction)
    if (level.has_value())
      QGRU_CHECK(level->device() == device_ && !level->is_floating_point() && level->dim() == 2 &&
                      level->size(0) == qx.size(0) && level->size(1) == qx.size(1),
                  "qgru cuda: level must be an integer tensor [T, N] = [", qx.size(0), ", ", qx.size(1), "] on ",
                  device_);
    c10::cuda::CUDAGuard guard(device_);
    const int64_t T = qx.size(0), N = qx.size(1);
    if (T == 0 || N == 0)
      return {at::empty({T, N, d_.H}, qx.options().dtype(at::kInt)), qh0.to(at::kInt).clone()};
    at::Tensor out, state;
    run_call(
        T, N, lengths, qx.options(),
        [&](Buffers& b, cudaStream_t) {
          // (steps T .. Tp - 1 of a plan's qx: run_call zeroes them)
          b.qx.narrow(0, 0, T).copy_(qx);
          if (level.has_value()) b.level.narrow(0, 0, T).copy_(*level);
          else if (b.level.defined()) b.level.narrow(0, 0, T).zero_();  // level 0: the static grid
          b.state.copy_(qh0);
        },
        [&](const Buffers& b, cudaStream_t) {
          // a plan's buffers are reused by the next call: hand out copies (of the call's own
          // steps), the output as the int32 the Layer returns
          out = b.out.narrow(0, 0, T).to(at::kInt);
          state = b.state.clone();
        });
    return {out, state};
  }

  // What one call writes into a run's buffers before it (`fill`: qx's first T steps and the
  // state) and reads from them after it (`drain`: out's first T steps and the state), each on the
  // stream passed (the caller's current one). A Layer call copies its integer operands in and its
  // results out; a Stack call (CudaStack) quantizes its floats straight into them and dequantizes
  // straight out of them. Everything between is this function's: the plan (or a call's own
  // buffers), the lengths, the ordering against other calls, the eager run or the graph. Nothing
  // here waits on the host for the GPU.
  using Fill = std::function<void(Buffers&, cudaStream_t)>;
  using Drain = std::function<void(const Buffers&, cudaStream_t)>;

  void run_call(int64_t T, int64_t N, const c10::optional<at::Tensor>& lengths, const at::TensorOptions& opts,
                const Fill& fill, const Drain& drain) {
    const bool has_lengths = lengths.has_value();
    cudaStream_t cur = at::cuda::getCurrentCUDAStream().stream();
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(cur, &capture), "cudaStreamIsCapturing");
    QGRU_CHECK(capture != cudaStreamCaptureStatusInvalidated,
                "qgru cuda: the current stream's graph capture was invalidated (by an earlier error in it)");
    if (capture == cudaStreamCaptureStatusActive) return run_unplanned(T, N, lengths, opts, cur, true, fill, drain);

    // With graphs, a call of more than kExactPlanSteps steps runs in a plan of plan_steps(T) steps
    // (qgru_cuda_launch.h), its rows' lengths capped at T: calls of nearby lengths share a plan and
    // its graph. Without graphs a plan has the call's own length (nothing to share but buffers).
    const bool bucketed = use_graph_ && T > cuda::kExactPlanSteps;
    const int64_t Tp = bucketed ? cuda::plan_steps(T) : T;
    const bool masked = has_lengths || bucketed;
    // A call of more than kMaxGraphSteps steps runs without a plan: its graph would be too large to
    // capture and instantiate quickly, and launches matter little over so many steps.
    if (use_graph_ && Tp > cuda::kMaxGraphSteps) return run_unplanned(T, N, lengths, opts, cur, false, fill, drain);
    std::unique_lock<std::mutex> lock(mu_);  // one call at a time enqueues work on the plan
    Plan* found = find_plan(Tp, N, masked);
    const bool fresh = found == nullptr;
    if (fresh) {
      // A shape whose plan would keep more than the plan bound between calls (its T-sized buffers
      // above all: at T = 1000, N = 4096, H = I = 1024, 8 GB) runs without one: its buffers are
      // this call's, from PyTorch's caching allocator, and nothing stays with the layer. Decided
      // when the plan would be made (the device's free memory then), not on every call.
      const int64_t ws_bytes = use_graph_ ? cublas_workspace_bytes(device_.index()) : 0;
      if (buffer_bytes(d_, Tp, N, masked, persistent_plan(N)) + ws_bytes > plan_max_bytes()) {
        lock.unlock();
        return run_unplanned(T, N, lengths, opts, cur, false, fill, drain);
      }
      found = &add_plan(Tp, N, masked, opts);
    }
    Plan& p = *found;
    if (p.b.ws.pk.blocks > 0) ++counters_.persistent_calls;
    count_fused(p.b);
    // The mutex orders only the host side. On the device, every use of the plan's buffers (the
    // copies in, the run, eager or graph, and the copies out) is ordered after the previous call's
    // last use, whichever stream or thread that call ran on.
    check_cuda(cudaStreamWaitEvent(cur, p.last_use, 0), "cudaStreamWaitEvent");
    RecordOnExit last_use(p.last_use, cur);
    fill(p.b, cur);
    // steps T .. Tp - 1 of the plan's qx: zeros (valid operands whose results are never read; an
    // earlier call's output, which shares their memory, need not be a valid x)
    if (Tp != T) p.b.qx.narrow(0, T, Tp - T).zero_();
    if (has_lengths) {
      p.b.lengths.copy_(*lengths);
      if (Tp != T) p.b.lengths.clamp_max_(T);  // the plan's extra steps leave every row's state as it is
    } else if (masked) {
      p.b.lengths.fill_(T);
    }
    if (!use_graph_) {
      ++counters_.eager_runs;
      run(p.b, cur, at::cuda::getCurrentCUDABlasHandle());  // PyTorch's handle: no graph keeps its workspace
    } else if (fresh) {
      // the first call of a shape runs eagerly on the handle and workspace its graph will capture
      // with: cuBLAS's lazy set-up (kernel loading, heuristics) happens here, not in the capture
      ++counters_.eager_runs;
      run_owned(p.b, p.cublas_ws, cur, nullptr);
    } else {
      // graphs cannot be captured on the legacy default stream: capture on the layer's own side
      // stream (its own, not one of PyTorch's pooled streams: a capture records whatever any thread
      // enqueues on the capturing stream, and a pooled stream can be another thread's current
      // stream). A capture runs nothing. The graph is launched on the caller's stream, in order
      // after the fill above and before the drain below, with no event hops between streams (a
      // streaming call's latency); launches of one graph are ordered after its earlier launches.
      if (p.exec == nullptr) {
        run_owned(p.b, p.cublas_ws, side_stream(), &p.exec);
        ++counters_.captures;
      } else {
        ++counters_.replays;
      }
      check_cuda(cudaGraphLaunch(p.exec, cur), "cudaGraphLaunch");
    }
    drain(p.b, cur);
    last_use.record();
  }

  // The Stack's checks (CudaStack): the bits of x this Layer takes, its state's grid and zero point.
  int64_t x_bits() const { return d_.x_bits; }
  Range state_range() const { return lt_.range("h"); }
  int64_t state_zp() const { return lt_.value("h_zp"); }
  int64_t hidden_size() const { return d_.H; }
  int64_t input_size() const { return d_.I; }
  int64_t x_levels() const { return d_.x_levels; }
  at::Device device() const { return device_; }

  int64_t window_steps(int64_t T, int64_t N) const { return cuda::workspace_sizes(d_, T, N).window_steps; }

  // The persistent plan of this layer for N batch rows (blocks == 0: none, the per-step path runs),
  // decided once per N (the device's SMs, shared memory and the kernel's occupancy: qgru_cuda_persistent.cu).
  cuda::PkPlan persistent_plan(int64_t N) const {
    std::lock_guard<std::mutex> lock(pk_mu_);
    auto it = pk_plans_.find(N);
    if (it != pk_plans_.end()) return it->second;
    cuda::PkPlan p{};
    if (persistent_) {
      c10::cuda::CUDAGuard guard(device_);
      // decided outside a capture only (it sets a kernel attribute and asks the occupancy API):
      // a batch size first seen inside a caller's capture runs the per-step path there
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      check_cuda(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream().stream(), &capture), "cudaStreamIsCapturing");
      if (capture != cudaStreamCaptureStatusNone) return p;
      if (cuda::persistent_plan(d_, N, device_.index(), &p) != cuda::kPkFits) p = cuda::PkPlan{};
    }
    pk_plans_[N] = p;
    return p;
  }

  // Layer.persistent_plan(N): the plan's fields ({} where there is none).
  std::map<std::string, int64_t> persistent_info(int64_t N) const {
    QGRU_CHECK(N >= 1, "qgru cuda: N must be at least 1");
    const cuda::PkPlan p = persistent_plan(N);
    if (p.blocks == 0) return {};
    return {{"blocks", p.blocks},       {"units", p.units},   {"channels", p.channels},
            {"rows_tile", p.rows_tile}, {"tiles", p.tiles},   {"smem_bytes", p.smem_bytes},
            {"h_buffer", p.h_buffer}};
  }

  ~CudaLayer() {
    plans_.clear();  // each waits for its last use
    if (side_ != nullptr) cudaStreamDestroy(side_);  // its work is done: the plans' last uses follow it
  }

  std::map<std::string, int64_t> counters() const {
    std::lock_guard<std::mutex> lock(mu_);
    // the bytes the newest plan keeps for its steps between calls (qx and out, one int16 buffer)
    const Plan* newest = plans_.empty() ? nullptr : plans_.front().get();
    const int64_t step_bytes = newest ? (int64_t)newest->b.steps.nbytes() : 0;
    return {{"plans", counters_.plans.load()},
            {"plans_kept", (int64_t)plans_.size()},
            {"plan_step_bytes", step_bytes},
            {"plan_bytes", newest ? newest->bytes : 0},  // all the newest plan keeps (plans_to_keep's measure)
            {"eager_runs", counters_.eager_runs.load()},
            {"captures", counters_.captures.load()},
            {"replays", counters_.replays.load()},
            {"in_foreign_capture", counters_.in_foreign_capture.load()},
            {"unplanned_runs", counters_.unplanned_runs.load()},
            {"persistent_calls", counters_.persistent_calls.load()},
            {"fused_calls", counters_.fused_calls.load()},
            {"fused_persistent_calls", counters_.fused_persistent_calls.load()},
            {"fused_persistent_fallbacks", counters_.fused_persistent_fallbacks.load()},
            {"fused_persistent_reason", counters_.fused_persistent_reason.load()}};
  }

 private:
  // What the calls took (Layer.counters; the tests check which path ran).
  struct Counters {
    std::atomic<int64_t> plans{0};               // plans made (a new shape)
    std::atomic<int64_t> eager_runs{0};          // runs on the caller's stream without a graph
    std::atomic<int64_t> captures{0};            // graphs captured (each launched at once)
    std::atomic<int64_t> replays{0};             // launches of a graph captured by an earlier call
    std::atomic<int64_t> in_foreign_capture{0};  // calls inside a capture of the caller's
    std::atomic<int64_t> unplanned_runs{0};      // calls of a shape too large for a plan (plan_max_bytes)
    std::atomic<int64_t> persistent_calls{0};    // calls whose recurrence ran persistent (qgru_cuda_persistent.cu)
    std::atomic<int64_t> fused_calls{0};         // calls whose recurrence ran the fused step (qgru_cuda_fused.cu)
    // QGRU_CUDA_FUSED=2: calls whose fused step ran persistent, calls that ran the fused step of
    // QGRU_CUDA_FUSED=1 instead, and the last such call's reason (qgru_fused_step.h FpFit; 0: none yet)
    std::atomic<int64_t> fused_persistent_calls{0};
    std::atomic<int64_t> fused_persistent_fallbacks{0};
    std::atomic<int64_t> fused_persistent_reason{0};
  };

  // Which fused step a run's buffers take: none (ws.fused false: not QGRU_CUDA_FUSED, a layer the
  // fused step does not take, or a persistent plan), the fused step, or with QGRU_CUDA_FUSED=2 the
  // persistent fused step where its plan fits; its step flags live in Gh, which no fused step uses.
  void set_fused(Buffers& b, int64_t N) const {
    b.ws.fused = fused_ && b.ws.pk.blocks == 0;
    if (!b.ws.fused || fused_mode_ != 2) return;
    cuda::FpPlan p{};
    b.fp_reason = fused_persistent_plan(N, &p);
    if (b.fp_reason == cuda::kFpFits && (!b.Gh.defined() || b.Gh.numel() < cuda::fp_flag_words(p.s.ctas)))
      b.fp_reason = cuda::kFpNoFlagRoom;
    if (b.fp_reason != cuda::kFpFits) return;
    b.ws.fp = p;
    b.ws.fp_flags = reinterpret_cast<uint32_t*>(b.Gh.data_ptr<int32_t>());
  }

  void count_fused(const Buffers& b) {
    if (b.ws.fused) ++counters_.fused_calls;
    if (b.fp_reason == cuda::kFpFits) {
      ++counters_.fused_persistent_calls;
    } else if (b.fp_reason > 0) {
      ++counters_.fused_persistent_fallbacks;
      counters_.fused_persistent_reason = b.fp_reason;
    }
  }

  // The persistent fused-step plan of this layer for N batch rows, or why there is none (FpFit),
  // decided once per N outside a capture (it sets a kernel attribute and asks the occupancy API):
  // a batch size first seen inside a caller's capture runs the fused step there (kFpInCapture).
  int fused_persistent_plan(int64_t N, cuda::FpPlan* out) const {
    std::lock_guard<std::mutex> lock(pk_mu_);
    auto it = fp_plans_.find(N);
    if (it != fp_plans_.end()) {
      *out = it->second.first;
      return it->second.second;
    }
    c10::cuda::CUDAGuard guard(device_);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream().stream(), &capture), "cudaStreamIsCapturing");
    *out = cuda::FpPlan{};
    if (capture != cudaStreamCaptureStatusNone) return cuda::kFpInCapture;
    const int rc = cuda::fused_persistent_plan(d_, N, device_.index(), out);
    fp_plans_[N] = {*out, rc};
    return rc;
  }

  void run(const Buffers& b, cudaStream_t stream, cublasHandle_t handle) const {
    const int64_t T = b.qx.size(0), N = b.qx.size(1);
    cuda::forward(d_, b.ws, b.qx.data_ptr<int16_t>(), b.level.defined() ? b.level.data_ptr<int32_t>() : nullptr, T, N,
                  b.state.data_ptr<int32_t>(), b.out.data_ptr<int16_t>(),
                  b.lengths.defined() ? b.lengths.data_ptr<int64_t>() : nullptr, stream, handle);
  }

  // The forward on `stream` with qgru's own cuBLAS handle and `workspace` as its cuBLAS workspace;
  // with `capture_into`, captured into that graph (not run).
  void run_owned(const Buffers& b, const at::Tensor& workspace, cudaStream_t stream,
                 cudaGraphExec_t* capture_into) {
    OwnHandle& own = own_handle(device_.index());
    std::lock_guard<std::mutex> lock(own.mu);
    // cublasSetStream resets the handle's workspace to cuBLAS's default pool: set ours after it
    check_cublas(cublasSetStream(own.handle, stream), "cublasSetStream");
    check_cublas(cublasSetWorkspace(own.handle, workspace.data_ptr(), (size_t)workspace.numel()),
                 "cublasSetWorkspace");
    if (capture_into == nullptr) {
      run(b, stream, own.handle);
      return;
    }
    cudaGraph_t graph = nullptr;
    check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      run(b, stream, own.handle);
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      throw;
    }
    check_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    // no memory nodes in the graph (all buffers are the plan's), so no auto-free flag is needed
    cudaError_t e = cudaGraphInstantiate(capture_into, graph, 0);
    cudaGraphDestroy(graph);
    check_cuda(e, "cudaGraphInstantiate");
  }

  // A call without a plan: everything on the current stream, in buffers of this call from
  // PyTorch's allocator (stream-ordered: freed for reuse after this call's work on `cur`), no plan
  // cached or used. Two cases:
  // * in_capture, inside a capture of the caller's (torch.cuda.graph): the buffers come from the
  //   capture's memory pool, kept for the caller's graph as long as it lives. A plan's buffers baked
  //   into the caller's graph would be shared with later calls, and launching a graph of qgru's own
  //   on its side stream would join that stream into the caller's capture and break it. The GEMMs
  //   run on qgru's own handle (made with the Layer, outside any capture) with a workspace from the
  //   same pool, so nothing depends on whether or how PyTorch's handle for this thread and stream
  //   was set up.
  // * else a shape too large for a plan (plan_max_bytes()): run eagerly on PyTorch's handle, as
  //   QGRU_CUDA_GRAPH=0 does (no graph keeps its workspace).
  void run_unplanned(int64_t T, int64_t N, const c10::optional<at::Tensor>& lengths, const at::TensorOptions& opts,
                     cudaStream_t cur, bool in_capture, const Fill& fill, const Drain& drain) {
    ++(in_capture ? counters_.in_foreign_capture : counters_.unplanned_runs);
    if (in_capture) keep_for_foreign_graphs();
    Buffers b = make_buffers(d_, T, N, lengths.has_value(), persistent_plan(N), opts);
    set_fused(b, N);
    if (b.ws.pk.blocks > 0) ++counters_.persistent_calls;
    count_fused(b);
    fill(b, cur);
    if (lengths.has_value()) b.lengths.copy_(*lengths);
    if (in_capture) {
      at::Tensor workspace = at::empty({cublas_workspace_bytes(device_.index())}, opts.dtype(at::kByte));
      run_owned(b, workspace, cur, nullptr);
    } else {
      run(b, cur, at::cuda::getCurrentCUDABlasHandle());
    }
    drain(b, cur);  // (the buffers are this call's: freed for reuse after its work on `cur`)
  }

  // The caller's graph holds pointers into this layer's parameter tensors and may outlive the
  // layer (its LayerParams replaced, the layer freed): once a layer has run inside a foreign
  // capture, its tensors are kept for the rest of the process.
  void keep_for_foreign_graphs() {
    static std::mutex mu;
    static std::vector<TensorMap>* kept = new std::vector<TensorMap>();  // never freed: see above
    std::lock_guard<std::mutex> lock(mu);
    if (kept_for_graphs_) return;
    kept->push_back(lt_.t);
    kept_for_graphs_ = true;
  }

  // The layer's own stream for capturing and replaying its graphs, made on first use (under mu_).
  cudaStream_t side_stream() {
    if (side_ == nullptr) check_cuda(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate");
    return side_;
  }

  // The plan of shape (T, N, has_lengths), moved to the front (newest), or nullptr (under mu_).
  Plan* find_plan(int64_t T, int64_t N, bool has_lengths) {
    for (auto it = plans_.begin(); it != plans_.end(); ++it) {
      if ((*it)->T == T && (*it)->N == N && (*it)->has_lengths == has_lengths) {
        if (it != plans_.begin()) plans_.splice(plans_.begin(), plans_, it);
        return plans_.front().get();
      }
    }
    return nullptr;
  }

  // A new plan of shape (T, N, has_lengths) as the newest, then the plans past plans_to_keep
  // dropped, each after its last use (~Plan) (under mu_).
  Plan& add_plan(int64_t T, int64_t N, bool has_lengths, const at::TensorOptions& opts) {
    plans_.push_front(make_plan(T, N, has_lengths, opts));
    std::vector<int64_t> bytes;
    for (const auto& p : plans_) bytes.push_back(p->bytes);
    plans_.resize((size_t)cuda::plans_to_keep(bytes.data(), (int64_t)bytes.size()));
    return *plans_.front();
  }

  // The bound on a new plan's bytes (qgru_cuda_launch.h plan_max_bytes): QGRU_CUDA_PLAN_MAX_BYTES,
  // else a share of the device's free memory now, counting what PyTorch's caching allocator holds
  // unallocated (the plan's buffers come from it).
  int64_t plan_max_bytes() const {
    if (plan_env_bytes_ >= 0) return plan_env_bytes_;
    size_t free_bytes = 0, total_bytes = 0;
    check_cuda(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
    const int64_t cached = stats.reserved_bytes[0].current - stats.allocated_bytes[0].current;  // [0]: all pools
    return cuda::plan_max_bytes(-1, (int64_t)free_bytes + (cached > 0 ? cached : 0));
  }

  std::unique_ptr<Plan> make_plan(int64_t T, int64_t N, bool has_lengths, const at::TensorOptions& opts) {
    auto p = std::make_unique<Plan>();
    p->T = T;
    p->N = N;
    p->has_lengths = has_lengths;
    p->b = make_buffers(d_, T, N, has_lengths, persistent_plan(N), opts);
    set_fused(p->b, N);  // the fused step where no persistent plan runs
    QGRU_CHECK(buffer_bytes(p->b) == buffer_bytes(d_, T, N, has_lengths, persistent_plan(N)),
                "qgru cuda: internal error: a plan's buffer size differs from its estimate");
    if (use_graph_) p->cublas_ws = at::empty({cublas_workspace_bytes(device_.index())}, opts.dtype(at::kByte));
    check_cuda(cudaEventCreateWithFlags(&p->last_use, cudaEventDisableTiming), "cudaEventCreate");
    p->bytes = buffer_bytes(p->b) + (p->cublas_ws.defined() ? (int64_t)p->cublas_ws.nbytes() : 0);
    ++counters_.plans;
    return p;
  }

  LayerTensors lt_;
  cuda::LayerDesc d_{};
  at::Device device_{at::kCUDA};
  bool use_graph_ = true;
  bool persistent_ = false;  // QGRU_CUDA_PERSISTENT
  bool fused_ = false;       // QGRU_CUDA_FUSED, for a layer the fused step takes
  int fused_mode_ = 0;       // QGRU_CUDA_FUSED: 0, 1 or 2 (fused_from_env)
  mutable std::mutex pk_mu_;
  mutable std::map<int64_t, cuda::PkPlan> pk_plans_;  // persistent_plan, by N
  mutable std::map<int64_t, std::pair<cuda::FpPlan, int>> fp_plans_;  // fused_persistent_plan, by N
  int64_t plan_env_bytes_ = -1;  // QGRU_CUDA_PLAN_MAX_BYTES (-1: unset, plan_max_bytes)
  cudaStream_t side_ = nullptr;   // side_stream()
  bool kept_for_graphs_ = false;  // keep_for_foreign_graphs()
  mutable std::mutex mu_;
  std::list<std::unique_ptr<Plan>> plans_;  // newest first
  Counters counters_;
};

// The float boundary (BoundaryOps of the cuda backend, qgru/backends.py): one kernel pass each on
// the current stream, the arithmetic of qgru_fixedpoint.h shared with the CPU backend. NaN: see
// kNanInput above (no host synchronisation unless QGRU_CUDA_NAN_CHECK=1).
at::Tensor float_operand(const at::Tensor& x_in) {
  // (resolve_neg: a negative view's memory holds the values before the sign torch applies on reading)
  return (x_in.scalar_type() == at::kDouble ? x_in : x_in.to(at::kFloat)).resolve_neg().contiguous();
}

template <typename Q>
void quantize_into(const at::Tensor& x, int64_t first, Q* q, int64_t n, double scale, int64_t zp, int64_t bits,
                   int32_t* flag, int32_t bit, cudaStream_t stream) {
  if (x.scalar_type() == at::kDouble)
    cuda::quantize(x.data_ptr<double>() + first, q, n, scale, zp, (int32_t)bits, flag, bit, stream);
  else
    cuda::quantize(x.data_ptr<float>() + first, q, n, scale, zp, (int32_t)bits, flag, bit, stream);
}

// quantize_into with x levels: each token of x (float_operand, [tokens, I]) on its level.
template <typename Q>
void levels_into(const at::Tensor& x, Q* q, int32_t* level, int64_t tokens, int64_t I, const XLevelGrid& g, int64_t zp,
                 int64_t bits, int32_t* flag, int32_t bit, cudaStream_t stream) {
  if (x.scalar_type() == at::kDouble)
    cuda::quantize_levels(x.data_ptr<double>(), q, level, tokens, I, g, zp, (int32_t)bits, flag, bit, stream);
  else
    cuda::quantize_levels(x.data_ptr<float>(), q, level, tokens, I, g, zp, (int32_t)bits, flag, bit, stream);
}

at::Tensor quantize(const at::Tensor& x_in, double scale, int64_t zp, int64_t bits, const std::string& what) {
  QGRU_CHECK(x_in.is_cuda() && x_in.is_floating_point(), "qgru cuda quantize: a floating-point CUDA tensor expected");
  check_quantize_args("qgru cuda quantize", scale, zp, bits);  // qgru_layer.h
  c10::cuda::CUDAGuard guard(x_in.device());
  const bool check = nan_check_enabled();
  const at::Tensor own_flag = check ? checked_nan_flag(x_in.options()) : at::Tensor();
  int32_t* flag = check ? own_flag.data_ptr<int32_t>() : device_nan_flag(x_in.device().index());
  const at::Tensor x = float_operand(x_in);
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kInt));
  quantize_into(x, 0, q.data_ptr<int32_t>(), x.numel(), scale, zp, bits, flag, what == "h0" ? kNanH0 : kNanInput,
                at::cuda::getCurrentCUDAStream().stream());
  if (check) raise_on_nan(own_flag);
  return q;
}

// x [..., I] -> (q int32 [..., I], level int32 [...]) on the x levels g, one kernel pass (NaN: as
// quantize).
std::tuple<at::Tensor, at::Tensor> quantize_levels(const at::Tensor& x_in, const XLevelGrid& g, int64_t zp,
                                                   int64_t bits, const std::string& what) {
  QGRU_CHECK(x_in.is_cuda() && x_in.is_floating_point(),
              "qgru cuda quantize_levels: a floating-point CUDA tensor expected");
  QGRU_CHECK(x_in.dim() >= 1 && x_in.size(-1) >= 1, "qgru cuda quantize_levels: ", what,
              " must have at least one value per token (its last axis)");
  for (int j = 0; j < g.count; ++j) check_quantize_args("qgru cuda quantize_levels", g.scale[j], zp, bits);
  c10::cuda::CUDAGuard guard(x_in.device());
  const bool check = nan_check_enabled();
  const at::Tensor own_flag = check ? checked_nan_flag(x_in.options()) : at::Tensor();
  int32_t* flag = check ? own_flag.data_ptr<int32_t>() : device_nan_flag(x_in.device().index());
  const at::Tensor x = float_operand(x_in);
  const int64_t I = x.size(-1), tokens = x.numel() / I;
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kInt));
  at::Tensor level = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kInt));
  levels_into(x, q.data_ptr<int32_t>(), level.data_ptr<int32_t>(), tokens, I, g, zp, bits, flag,
              what == "h0" ? kNanH0 : kNanInput, at::cuda::getCurrentCUDAStream().stream());
  if (check) raise_on_nan(own_flag);
  return {q, level};
}

at::Tensor dequantize(const at::Tensor& q_in, double scale, int64_t zp) {
  QGRU_CHECK(q_in.is_cuda() && !q_in.is_floating_point(), "qgru cuda dequantize: an integer CUDA tensor expected");
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.to(at::kInt).resolve_neg().contiguous();  // values of at most 16 bits
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  cuda::dequantize(q.data_ptr<int32_t>(), out.data_ptr<float>(), q.numel(), scale, zp,
                   at::cuda::getCurrentCUDAStream().stream());
  return out;
}

// A whole unidirectional stack without padding in one native call (the CPU backend's Stack, on the
// GPU): quantize the input straight into layer 0's qx buffer and each layer's h0 straight into its
// state, run the layers (layer l > 0 on layer l - 1's output moved onto its x grid), dequantize
// the last layer's output and every h_n straight out of the layers' buffers. The same functions as
// the separate calls (quantize, the Layer, requantize, dequantize), without their Python round
// trips and copies: a streaming call (one step carrying h) is a few kernels, the layers' graphs
// and no host work that waits for the GPU. q[l] = (S_x, Z_x, bits_x, S_h, Z_h, bits_h, multiplier
// and shift of S_h,l-1 / S_x,l), as for the CPU Stack (qgru/native/stacks.py stack_values); checked
// against the Layers once, when the Stack is made.
class CudaStack {
 public:
  // levels: layer 0's x levels as [scale, lo, hi] (golden.XLevels), or empty for a stack without.
  CudaStack(std::vector<std::shared_ptr<CudaLayer>> layers, std::vector<std::vector<double>> q,
            const std::vector<std::vector<double>>& levels)
      : layers_(std::move(layers)), q_(std::move(q)) {  // qgru_layer.h: the values against the Layers
    check_stack_values("qgru cuda Stack", layers_, q_,
                       [](const CudaLayer& a, const CudaLayer& b) { return a.device() == b.device(); });
    levels_ = check_stack_levels("qgru cuda Stack", layers_, levels);
  }

  // x float [T, N, I] and h0 [L, N, H] (floating point, on the layers' device) -> float32 output
  // [T, N, H] and h_n [L, N, H].
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x_in, const at::Tensor& h0_in) const {
    const int64_t L = (int64_t)layers_.size(), H = layers_[0]->hidden_size(), I = layers_[0]->input_size();
    const at::Device device = layers_[0]->device();
    QGRU_CHECK(x_in.is_cuda() && h0_in.is_cuda() && x_in.device() == device && h0_in.device() == device &&
                    x_in.is_floating_point() && h0_in.is_floating_point(),
                "qgru cuda Stack: x and h0 must be floating-point tensors on ", device);
    QGRU_CHECK(x_in.dim() == 3 && x_in.size(2) == I && x_in.size(0) > 0, "qgru cuda Stack: x must be [T >= 1, N, ", I,
                "]");
    const int64_t T = x_in.size(0), N = x_in.size(1);
    QGRU_CHECK(h0_in.dim() == 3 && h0_in.size(0) == L && h0_in.size(1) == N && h0_in.size(2) == H,
                "qgru cuda Stack: h0 must be [", L, ", ", N, ", ", H, "]");
    // what the layers keep across calls (plans) is made outside inference mode: a plan made as
    // inference tensors could not be written by a later call outside it
    c10::InferenceMode no_inference(false);
    c10::cuda::CUDAGuard guard(device);
    const at::TensorOptions opts = x_in.options();
    at::Tensor out = at::empty({T, N, H}, opts.dtype(at::kFloat));
    at::Tensor h_n = at::empty({L, N, H}, opts.dtype(at::kFloat));
    if (N == 0) return {out, h_n};
    const bool check = nan_check_enabled();
    const at::Tensor own_flag = check ? checked_nan_flag(opts) : at::Tensor();
    int32_t* flag = check ? own_flag.data_ptr<int32_t>() : device_nan_flag(device.index());
    const at::Tensor x = float_operand(x_in), h0 = float_operand(h0_in);
    at::Tensor moved;  // int16 [T, N, H]: layer l - 1's output on layer l's x grid
    for (int64_t l = 0; l < L; ++l) {
      const std::vector<double>& v = q_[l];
      layers_[l]->run_call(
          T, N, c10::nullopt, opts,
          [&](Buffers& b, cudaStream_t s) {
            if (l == 0 && levels_.count > 0)  // each token straight onto its level, its level into the plan's
              levels_into(x, b.qx.data_ptr<int16_t>(), b.level.data_ptr<int32_t>(), T * N, I, levels_, (int64_t)v[1],
                          (int64_t)v[2], flag, kNanInput, s);
            else if (l == 0) {
              quantize_into(x, 0, b.qx.data_ptr<int16_t>(), T * N * I, v[0], (int64_t)v[1], (int64_t)v[2], flag,
                            kNanInput, s);
              if (b.level.defined()) b.level.narrow(0, 0, T).zero_();  // a Stack given no levels: level 0
            }
            else
              b.qx.narrow(0, 0, T).copy_(moved);
            quantize_into(h0, l * N * H, b.state.data_ptr<int32_t>(), N * H, v[3], (int64_t)v[4], (int64_t)v[5], flag,
                          kNanH0, s);
          },
          [&](const Buffers& b, cudaStream_t s) {
            cuda::dequantize(b.state.data_ptr<int32_t>(), h_n.data_ptr<float>() + l * N * H, N * H, v[3],
                             (int64_t)v[4], s);
            if (l == L - 1) {
              cuda::dequantize(b.out.data_ptr<int16_t>(), out.data_ptr<float>(), T * N * H, v[3], (int64_t)v[4], s);
            } else {
              const std::vector<double>& w = q_[l + 1];
              moved = at::empty({T, N, H}, opts.dtype(at::kShort));
              cuda::requantize(b.out.data_ptr<int16_t>(), moved.data_ptr<int16_t>(), T * N * H, (int64_t)v[4],
                               (int64_t)w[6], (int32_t)w[7], (int64_t)w[1], (int32_t)w[2], s);
            }
          });
    }
    if (check) raise_on_nan(own_flag);
    return {out, h_n};
  }

 private:
  std::vector<std::shared_ptr<CudaLayer>> layers_;
  std::vector<std::vector<double>> q_;
  XLevelGrid levels_{};
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// The interface the binding (bind_cuda.cpp) uses: qgru_cuda_backend.h
// ---------------------------------------------------------------------------------------------
namespace cuda_api {

at::Tensor quantize(const at::Tensor& x, double scale, int64_t zp, int64_t bits, const std::string& what) {
  return qgru::quantize(x, scale, zp, bits, what);
}
std::tuple<at::Tensor, at::Tensor> quantize_levels(const at::Tensor& x, const std::vector<double>& scale,
                                                   const std::vector<double>& lo, const std::vector<double>& hi,
                                                   int64_t zp, int64_t bits, const std::string& what) {
  return qgru::quantize_levels(x, level_grid(scale, lo, hi, "qgru cuda quantize_levels"), zp, bits, what);
}
at::Tensor dequantize(const at::Tensor& q, double scale, int64_t zp) { return qgru::dequantize(q, scale, zp); }
at::Tensor requantize(const at::Tensor& q_in, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                      int64_t to_bits) {
  QGRU_CHECK(q_in.is_cuda() && !q_in.is_floating_point(), "qgru cuda requantize: an integer CUDA tensor expected");
  check_requantize_args("qgru cuda requantize", from_zp, mult, shift, to_zp, to_bits);  // qgru_layer.h
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.resolve_neg().to(at::kShort).contiguous();  // a Layer's outputs: at most 16 bits
  at::Tensor out = at::empty(q.sizes(), q.options());
  cuda::requantize(q.data_ptr<int16_t>(), out.data_ptr<int16_t>(), q.numel(), from_zp, mult, (int32_t)shift, to_zp,
                   (int32_t)to_bits, at::cuda::getCurrentCUDAStream().stream());
  return out;
}
int64_t nan_flags(int64_t device, bool clear) { return qgru::nan_flags(device, clear); }
void check_cublas_version() { qgru::check_cublas_version(); }

struct Layer::Impl {
  std::shared_ptr<CudaLayer> layer;
};

Layer::Layer(TensorMap tensors, IntMap values)
    : impl(std::make_shared<Impl>(Impl{std::make_shared<CudaLayer>(std::move(tensors), std::move(values))})) {}
std::tuple<at::Tensor, at::Tensor> Layer::forward(const at::Tensor& qx, const at::Tensor& qh0,
                                                  const c10::optional<at::Tensor>& lengths,
                                                  const c10::optional<at::Tensor>& level) {
  return impl->layer->forward(qx, qh0, lengths, level);
}
int64_t Layer::x_levels() const { return impl->layer->x_levels(); }
std::map<std::string, int64_t> Layer::counters() const { return impl->layer->counters(); }
int64_t Layer::window_steps(int64_t T, int64_t N) const { return impl->layer->window_steps(T, N); }
std::map<std::string, int64_t> Layer::persistent_plan(int64_t N) const { return impl->layer->persistent_info(N); }

struct Stack::Impl {
  CudaStack stack;
};

namespace {
std::vector<std::shared_ptr<CudaLayer>> cuda_layers(const std::vector<std::shared_ptr<Layer>>& layers) {
  std::vector<std::shared_ptr<CudaLayer>> out;
  for (const auto& l : layers) out.push_back(l ? l->impl->layer : nullptr);  // None: CudaStack refuses it
  return out;
}
}  // namespace

Stack::Stack(const std::vector<std::shared_ptr<Layer>>& layers, std::vector<std::vector<double>> values,
             const std::vector<std::vector<double>>& levels)
    : impl(std::make_shared<Impl>(Impl{CudaStack(cuda_layers(layers), std::move(values), levels)})) {}
std::tuple<at::Tensor, at::Tensor> Stack::forward(const at::Tensor& x, const at::Tensor& h0) const {
  return impl->stack.forward(x, h0);
}

}  // namespace cuda_api
}  // namespace qgru
