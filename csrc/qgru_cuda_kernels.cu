// qgru CUDA backend, torch-free: int8 limb GEMMs on cuBLAS, the shared cell (qgru_cell.h) as
// kernels, and the forward driver. Built by qgru/native.py with torch.utils.cpp_extension; CI
// compiles this file with nvcc on machines without a GPU (tests/test_cuda_compile.py).
#include <stdexcept>
#include <string>
#include <type_traits>

#include "qgru_cuda.h"

namespace qgru {
namespace cuda {
namespace {

constexpr int kThreads = 256;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("qgru cuda: ") + what + ": " + cudaGetErrorString(e));
}

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("qgru cuda: ") + what + " failed with cuBLAS status " + std::to_string((int)s));
}

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

unsigned blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return (unsigned)(b < 65535 * 8 ? (b > 0 ? b : 1) : 65535 * 8);
}

// C [rows, M_pad] int32 = act [rows, K_pad] int8 . weight [M_pad, K_pad]^T, in cuBLAS's column-major
// terms C^T = W . act^T: op(A) = T on W (lda = K_pad), op(B) = N on act (ldb = K_pad), ldc = M_pad.
// This is the "TN" layout the int8 path requires; K_pad and M_pad are multiples of 16 and every
// buffer starts 256-byte aligned, which meets the 4-byte alignment and leading-dimension rules.
void gemm_s8(cublasHandle_t handle, const int8_t* act, const int8_t* weight, int32_t* C, int64_t rows, int64_t M_pad,
             int64_t K_pad) {
  const int32_t alpha = 1, beta = 0;
  check(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, (int)M_pad, (int)rows, (int)K_pad, &alpha, weight, CUDA_R_8I,
                     (int)K_pad, act, CUDA_R_8I, (int)K_pad, &beta, C, CUDA_R_32I, (int)M_pad, CUBLAS_COMPUTE_32I,
                     CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (int8 -> int32)");
}

// limbs[i][r, k] = act_limb(src[r, k]) for r < rows, k < K (padding stays zero).
__global__ void split_limbs_kernel(const int64_t* __restrict__ src, int64_t rows, int64_t K, int32_t bits,
                                   int8_t* __restrict__ lo, int8_t* __restrict__ hi, int64_t ld) {
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < rows * K;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = idx / K, k = idx % K;
    const int64_t v = src[idx];
    lo[r * ld + k] = act_limb(v, bits, 0);
    if (hi != nullptr) hi[r * ld + k] = act_limb(v, bits, 1);
  }
}

// The limbs of the initial state (int32 [N, H]) for the first R.h GEMM.
__global__ void state_limbs_kernel(const int32_t* __restrict__ state, int64_t N, int64_t H, int32_t bits,
                                   int8_t* __restrict__ lo, int8_t* __restrict__ hi, int64_t ld) {
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < N * H;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = idx / H, j = idx % H;
    lo[n * ld + j] = act_limb(state[idx], bits, 0);
    if (hi != nullptr) hi[n * ld + j] = act_limb(state[idx], bits, 1);
  }
}

template <int NP, bool POW2, bool ACC32>
__global__ void input_epilogue_kernel(AccRequant a, AccRequant32 a32, LimbProducts lp, int64_t rows, int64_t H3,
                                      int32_t* __restrict__ dwx) {
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < rows * H3;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = idx / H3, c = idx % H3;
    dwx[idx] = (int32_t)requantize_product<NP, POW2, ACC32>(a, a32, lp, r, c);
  }
}

// One time step for every (n, j): the shared cell, then the new state, its output copy and the
// int8 limbs the next step's R.h GEMM reads. Padding rows (t >= lengths[n]) carry the state.
template <int NP, bool POW2, bool ACC32>
__global__ void cell_kernel(CellParams p, LimbProducts lp, int64_t N, int64_t t, const int32_t* __restrict__ dwx_t,
                            int32_t* __restrict__ state, int32_t* __restrict__ out_t, const int64_t* __restrict__ lengths,
                            int32_t h_bits, int8_t* __restrict__ h_lo, int8_t* __restrict__ h_hi, int64_t ld) {
  const int64_t H = p.H;
  for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < N * H;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int64_t n = idx / H, j = idx % H;
    const int32_t q_h = state[idx];
    if (lengths != nullptr && t >= lengths[n]) {
      out_t[idx] = q_h;
      continue;
    }
    const int32_t h_new = (int32_t)gru_cell<NP, POW2, ACC32>(p, lp, n, j, cell32_channel<ACC32>(p, j), dwx_t + n * 3 * H, q_h);
    state[idx] = h_new;
    out_t[idx] = h_new;
    h_lo[n * ld + j] = act_limb(h_new, h_bits, 0);
    if (h_hi != nullptr) h_hi[n * ld + j] = act_limb(h_new, h_bits, 1);
  }
}

// The limb GEMMs of one product and their LimbProducts view.
LimbProducts run_gemms(const GemmDesc& g, int8_t* const act_limbs[2], int32_t* const G[kMaxPairs], int64_t rows,
                       int64_t ones_col, cublasHandle_t handle) {
  LimbProducts lp{};
  for (int p = 0; p < g.P; ++p) {
    gemm_s8(handle, act_limbs[g.act_limb[p]], g.weight_limbs + g.weight_limb[p] * g.M_pad * g.K_pad, G[p], rows,
            g.M_pad, g.K_pad);
    lp.G[p] = G[p];
    lp.scale[p] = g.scale[p];
    lp.weight_offset[p] = g.weight_offset[p];
  }
  lp.ld = g.M_pad;
  lp.ones_col = ones_col;
  return lp;
}

}  // namespace

WorkspaceSizes workspace_sizes(const LayerDesc& d, int64_t T, int64_t N) {
  WorkspaceSizes s;
  const int64_t rows = T * N;
  s.chunk_rows = round_up(rows < 16384 ? (rows > 0 ? rows : 1) : 16384, kPad);
  s.N_pad = round_up(N > 0 ? N : 1, kPad);
  s.x_limb = s.chunk_rows * d.wx.K_pad;
  s.Gx = s.chunk_rows * d.wx.M_pad;
  s.h_limb = s.N_pad * d.rh.K_pad;
  s.Gh = s.N_pad * d.rh.M_pad;
  s.dwx = rows * 3 * d.H;
  return s;
}

void forward(const LayerDesc& d, const Workspace& ws, const int64_t* qx, int64_t T, int64_t N, int32_t* state,
             int32_t* out, const int64_t* lengths, cudaStream_t stream, cublasHandle_t handle) {
  if (T == 0 || N == 0) return;
  // `handle` must already be bound to `stream` with a workspace (PyTorch's handle is): calling
  // cublasSetStream here would reset that workspace, and cuBLAS would allocate inside a graph capture.
  const int64_t H = d.H, H3 = 3 * H, rows_total = T * N;
  // W.x for all steps, in chunks of rows (seed 001 steps 1-2)
  for (int64_t r0 = 0; r0 < rows_total; r0 += ws.chunk_rows) {
    const int64_t rows = rows_total - r0 < ws.chunk_rows ? rows_total - r0 : ws.chunk_rows;
    split_limbs_kernel<<<blocks_for(rows * d.I), kThreads, 0, stream>>>(
        qx + r0 * d.I, rows, d.I, d.x_bits, ws.x_limbs[0], d.x_bits > 8 ? ws.x_limbs[1] : nullptr, d.wx.K_pad);
    check(cudaGetLastError(), "split_limbs_kernel launch");
    // rows padded to kPad: the extra rows hold stale limbs, their outputs are never read
    const LimbProducts lp = run_gemms(d.wx, ws.x_limbs, ws.Gx, round_up(rows, kPad), d.ones_col, handle);
    dispatch_kernel(d.wx.P, d.pow2, d.acc32, [&](auto np, auto pow2, auto acc32) {
      input_epilogue_kernel<decltype(np)::value, decltype(pow2)::value, decltype(acc32)::value>
          <<<blocks_for(rows * H3), kThreads, 0, stream>>>(d.acc_x, d.acc_x32, lp, rows, H3, ws.dwx + r0 * H3);
    });
    check(cudaGetLastError(), "input_epilogue_kernel launch");
  }
  // h0's limbs, then one R.h GEMM + one cell kernel per step (seed 001 step 3)
  state_limbs_kernel<<<blocks_for(N * H), kThreads, 0, stream>>>(state, N, H, d.h_bits, ws.h_limbs[0],
                                                                  d.h_bits > 8 ? ws.h_limbs[1] : nullptr, d.rh.K_pad);
  check(cudaGetLastError(), "state_limbs_kernel launch");
  for (int64_t t = 0; t < T; ++t) {
    const LimbProducts lp = run_gemms(d.rh, ws.h_limbs, ws.Gh, ws.N_pad, d.ones_col, handle);
    dispatch_kernel(d.rh.P, d.pow2, d.acc32, [&](auto np, auto pow2, auto acc32) {
      cell_kernel<decltype(np)::value, decltype(pow2)::value, decltype(acc32)::value>
          <<<blocks_for(N * H), kThreads, 0, stream>>>(d.cell, lp, N, t, ws.dwx + t * N * H3, state, out + t * N * H,
                                                       lengths, d.h_bits, ws.h_limbs[0],
                                                       d.h_bits > 8 ? ws.h_limbs[1] : nullptr, d.rh.K_pad);
    });
    check(cudaGetLastError(), "cell_kernel launch");
  }
}

}  // namespace cuda
}  // namespace qgru
