// qgru CUDA backend, torch binding: owns the parameter tensors and per-shape buffers, runs the
// torch-free driver (qgru_cuda_kernels.cu) on PyTorch's current stream and cuBLAS handle, and
// replays the whole forward as a CUDA graph from the second call of a shape on: launch latency,
// not arithmetic, bounds a per-step design (one GEMM + one cell kernel per step).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdlib>
#include <memory>
#include <mutex>

#include "qgru_cuda.h"
#include "qgru_layer.h"

namespace qgru {
namespace {

void check_cuda(cudaError_t e, const char* what) {
  TORCH_CHECK(e == cudaSuccess, "qgru cuda: ", what, ": ", cudaGetErrorString(e));
}

void check_cublas(cublasStatus_t s, const char* what) {
  TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, "qgru cuda: ", what, " failed with cuBLAS status ", (int)s);
}

// The cuBLAS loaded at run time (qgru/native.py links the one torch runs) must have the major
// version of the headers this file was compiled with: its API and ABI are those of a major version.
void check_cublas_version() {
  int major = -1, minor = -1, patch = -1;
  check_cublas(cublasGetProperty(MAJOR_VERSION, &major), "cublasGetProperty");
  check_cublas(cublasGetProperty(MINOR_VERSION, &minor), "cublasGetProperty");
  check_cublas(cublasGetProperty(PATCH_LEVEL, &patch), "cublasGetProperty");
  TORCH_CHECK(major == CUBLAS_VER_MAJOR, "qgru cuda: compiled against the cuBLAS ", CUBLAS_VER_MAJOR, ".",
              CUBLAS_VER_MINOR, " headers, but the loaded libcublas is ", major, ".", minor, ".", patch,
              ": rebuild with the CUDA toolkit of torch's CUDA version (", "python -m qgru build --kind cuda)");
}

cuda::GemmDesc gemm_desc(const LayerTensors& lt, const std::string& k) {
  const at::Tensor& w = lt.tensor(k + "_weight_limbs");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 3 && w.is_contiguous(), "qgru cuda: bad ", k, "_weight_limbs");
  cuda::GemmDesc g{};
  g.weight_limbs = w.data_ptr<int8_t>();
  g.M_pad = w.size(1);
  g.K_pad = w.size(2);
  TORCH_CHECK(g.M_pad % cuda::kPad == 0 && g.K_pad % cuda::kPad == 0 && g.M_pad >= cuda::kMinGemmDim &&
                  g.K_pad >= cuda::kMinGemmDim,
              "qgru cuda: ", k, "_weight_limbs [", g.M_pad, ", ", g.K_pad, "] must be padded to multiples of ", cuda::kPad,
              ", at least ", cuda::kMinGemmDim, " (prepare_layer(gemm_min=CUDA_GEMM_MIN))");
  at::Tensor pr = lt.pairs(k);
  g.P = (int)pr.size(0);
  TORCH_CHECK(g.P == 1 || g.P == 2 || g.P == 4, "qgru cuda: unsupported number of limb pairs ", g.P);
  auto a = pr.accessor<int64_t, 2>();
  for (int p = 0; p < g.P; ++p) {
    g.act_limb[p] = (int)a[p][0];
    g.weight_limb[p] = (int)a[p][1];
    g.scale[p] = a[p][2];
    g.weight_offset[p] = a[p][3];
  }
  return g;
}

struct Plan {  // buffers (and the captured graph) for one (T, N, lengths?) shape
  int64_t T = -1, N = -1;
  bool has_lengths = false;
  at::Tensor qx, state, out, lengths, x_limbs, Gx, h_limbs, Gh, dwx;
  cuda::Workspace ws{};
  cudaGraphExec_t exec = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;

  ~Plan() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (ready != nullptr) cudaEventDestroy(ready);
    if (done != nullptr) cudaEventDestroy(done);
  }
};

class CudaLayer {
 public:
  CudaLayer(TensorMap tensors, IntMap values) : lt_{std::move(tensors), std::move(values)} {
    for (auto& kv : lt_.t)
      TORCH_CHECK(kv.second.is_cuda(), "qgru cuda backend: '", kv.first, "' is not on a CUDA device");
    d_.H = lt_.value("H");
    d_.I = lt_.value("I");
    d_.x_bits = (int32_t)lt_.value("x_bits");
    d_.h_bits = (int32_t)lt_.value("h_bits");
    d_.ones_col = lt_.value("ones_col");
    d_.pow2 = lt_.value("pow2") != 0;
    d_.acc32 = lt_.value("acc32") != 0;
    d_.wx = gemm_desc(lt_, "x");
    d_.rh = gemm_desc(lt_, "h");
    d_.acc_x = lt_.acc("Wx");
    d_.acc_x32 = lt_.acc32("Wx");
    d_.cell = lt_.cell();
    device_ = lt_.tensor("Wx_bias").device();
    const char* env = std::getenv("QGRU_CUDA_GRAPH");
    use_graph_ = env == nullptr || std::string(env) != "0";
  }

  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& qx, const at::Tensor& qh0,
                                             const c10::optional<at::Tensor>& lengths) {
    TORCH_CHECK(qx.is_cuda() && qh0.is_cuda(), "qgru cuda: inputs must be CUDA tensors");
    TORCH_CHECK(qx.device() == device_, "qgru cuda: input on ", qx.device(), ", parameters on ", device_);
    TORCH_CHECK(qx.dim() == 3 && qx.size(2) == d_.I, "qgru cuda: qx must be [T, N, ", d_.I, "]");
    TORCH_CHECK(qh0.dim() == 2 && qh0.size(0) == qx.size(1) && qh0.size(1) == d_.H, "qgru cuda: qh0 must be [N, ",
                d_.H, "]");
    c10::cuda::CUDAGuard guard(device_);
    std::lock_guard<std::mutex> lock(mu_);  // the plan's buffers serve one call at a time
    const int64_t T = qx.size(0), N = qx.size(1);
    if (T == 0 || N == 0)
      return {at::empty({T, N, d_.H}, qx.options().dtype(at::kInt)), qh0.to(at::kInt).clone()};
    const bool has_lengths = lengths.has_value();
    bool fresh = false;
    if (!plan_ || plan_->T != T || plan_->N != N || plan_->has_lengths != has_lengths) {
      make_plan(T, N, has_lengths, qx.options());
      fresh = true;
    }
    Plan& p = *plan_;
    p.qx.copy_(qx);
    p.state.copy_(qh0);
    if (has_lengths) p.lengths.copy_(*lengths);
    const int64_t* len_ptr = has_lengths ? p.lengths.data_ptr<int64_t>() : nullptr;
    cudaStream_t cur = at::cuda::getCurrentCUDAStream().stream();
    if (!use_graph_ || fresh) {
      // eager: the first call of a shape also warms cuBLAS up before anything is captured
      cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
      cuda::forward(d_, p.ws, p.qx.data_ptr<int64_t>(), T, N, p.state.data_ptr<int32_t>(), p.out.data_ptr<int32_t>(),
                    len_ptr, cur, handle);
    } else {
      // graphs cannot be captured on the legacy default stream: capture and replay on a side stream
      // ordered after the copies above and before the caller's next work
      c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device_.index());
      check_cuda(cudaEventRecord(p.ready, cur), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(side.stream(), p.ready, 0), "cudaStreamWaitEvent");
      if (p.exec == nullptr) {
        c10::cuda::CUDAStreamGuard sg(side);
        cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // bound to `side`, with workspace
        cudaGraph_t graph = nullptr;
        check_cuda(cudaStreamBeginCapture(side.stream(), cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
        try {
          cuda::forward(d_, p.ws, p.qx.data_ptr<int64_t>(), T, N, p.state.data_ptr<int32_t>(),
                        p.out.data_ptr<int32_t>(), len_ptr, side.stream(), handle);
        } catch (...) {
          cudaStreamEndCapture(side.stream(), &graph);
          if (graph != nullptr) cudaGraphDestroy(graph);
          throw;
        }
        check_cuda(cudaStreamEndCapture(side.stream(), &graph), "cudaStreamEndCapture");
        cudaError_t e = cudaGraphInstantiate(&p.exec, graph, 0);
        cudaGraphDestroy(graph);
        check_cuda(e, "cudaGraphInstantiate");
      }
      check_cuda(cudaGraphLaunch(p.exec, side.stream()), "cudaGraphLaunch");
      check_cuda(cudaEventRecord(p.done, side.stream()), "cudaEventRecord");
      check_cuda(cudaStreamWaitEvent(cur, p.done, 0), "cudaStreamWaitEvent");
    }
    // the plan's buffers are reused by the next call: hand out copies
    return {p.out.clone(), p.state.clone()};
  }

 private:
  void make_plan(int64_t T, int64_t N, bool has_lengths, const at::TensorOptions& opts) {
    plan_.reset();  // frees the previous shape's buffers and graph first
    auto p = std::make_unique<Plan>();
    p->T = T;
    p->N = N;
    p->has_lengths = has_lengths;
    const cuda::WorkspaceSizes s = cuda::workspace_sizes(d_, T, N);
    auto i8 = opts.dtype(at::kChar), i32 = opts.dtype(at::kInt), i64 = opts.dtype(at::kLong);
    p->qx = at::empty({T, N, d_.I}, i64);
    p->state = at::empty({N, d_.H}, i32);
    p->out = at::empty({T, N, d_.H}, i32);
    if (has_lengths) p->lengths = at::empty({N}, i64);
    // limb buffers zeroed once: their padding (K and rows) must read as 0 in every GEMM
    p->x_limbs = at::zeros({2, s.x_limb}, i8);
    p->h_limbs = at::zeros({2, s.h_limb}, i8);
    p->Gx = at::empty({d_.wx.P, s.Gx}, i32);
    p->Gh = at::empty({d_.rh.P, s.Gh}, i32);
    p->dwx = at::empty({s.dwx}, i32);
    cuda::Workspace& ws = p->ws;
    ws.chunk_rows = s.chunk_rows;
    ws.N_pad = s.N_pad;
    for (int i = 0; i < 2; ++i) {
      ws.x_limbs[i] = p->x_limbs[i].data_ptr<int8_t>();
      ws.h_limbs[i] = p->h_limbs[i].data_ptr<int8_t>();
    }
    for (int i = 0; i < d_.wx.P; ++i) ws.Gx[i] = p->Gx[i].data_ptr<int32_t>();
    for (int i = 0; i < d_.rh.P; ++i) ws.Gh[i] = p->Gh[i].data_ptr<int32_t>();
    ws.dwx = p->dwx.data_ptr<int32_t>();
    check_cuda(cudaEventCreateWithFlags(&p->ready, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventCreateWithFlags(&p->done, cudaEventDisableTiming), "cudaEventCreate");
    plan_ = std::move(p);
  }

  LayerTensors lt_;
  cuda::LayerDesc d_{};
  at::Device device_{at::kCUDA};
  bool use_graph_ = true;
  std::mutex mu_;
  std::unique_ptr<Plan> plan_;
};

}  // namespace
}  // namespace qgru

#ifndef QGRU_TORCH_VERSION
#error "QGRU_TORCH_VERSION must be defined by the build (qgru/native.py)"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qgru CUDA backend (bit-exact with qgru/golden.py)";
  m.attr("built_for_torch") = QGRU_TORCH_VERSION;
  m.attr("wx_chunk_rows") = qgru::cuda::kChunkRows;  // rows of x per W.x GEMM (the tests span two)
  m.def("check_cublas", &qgru::check_cublas_version,
        "raise unless the loaded cuBLAS has the major version of the headers the extension was built with");
  pybind11::class_<qgru::CudaLayer>(m, "Layer")
      .def(pybind11::init<qgru::TensorMap, qgru::IntMap>())
      .def("forward", &qgru::CudaLayer::forward, pybind11::arg("qx"), pybind11::arg("qh0"),
           pybind11::arg("lengths") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>())
      // the GEMM path, as the CPU Layer reports its own (NativeLayer.gemm; the tests check it)
      .def_property_readonly("gemm", [](const qgru::CudaLayer&) { return std::string("cublas"); });
}
