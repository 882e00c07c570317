// qgru CUDA backend, torch-free: int8 limb GEMMs on cuBLAS, the shared cell (qgru_cell.h) as
// kernels, and the forward driver. Built by qgru/native/build.py with torch.utils.cpp_extension; CI
// compiles this file with nvcc on machines without a GPU (tests/test_cuda_compile.py).
#include <stdexcept>
#include <string>
#include <type_traits>

#include "qgru_cuda.h"
#include "qgru_cuda_launch.h"

namespace qgru {
namespace cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("qgru cuda: ") + what + ": " + cudaGetErrorString(e));
}

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("qgru cuda: ") + what + " failed with cuBLAS status " + std::to_string((int)s));
}

struct Launch2D {
  dim3 grid, block;
};

// qgru_cuda_launch.h: columns along x, exactly once; rows along y with a grid-stride loop
Launch2D launch_2d(int64_t rows, int64_t cols) {
  const Launch2DShape s = launch_2d_shape(rows, cols);
  return {dim3((unsigned)s.grid_x, (unsigned)s.grid_y), dim3((unsigned)s.block_x, (unsigned)s.block_y)};
}

// The column of this thread (kernels return when it is >= cols) and the rows it visits:
// for (int64_t r = first_row(); r < rows; r += row_stride()).
__device__ __forceinline__ int32_t this_col() { return (int32_t)(blockIdx.x * blockDim.x + threadIdx.x); }
__device__ __forceinline__ int64_t first_row() { return (int64_t)blockIdx.y * blockDim.y + threadIdx.y; }
__device__ __forceinline__ int64_t row_stride() { return (int64_t)gridDim.y * blockDim.y; }

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

// limbs[i][r, k] = act_limb(op(src[r, k])) for r < rows, k < K (padding stays zero): x's limbs
// (int16 qx [rows, I], op off) for W.x, and the initial state's R.h operand (int32 [N, H],
// gemm_operand: the state, or its h_gemm) for the first R.h GEMM.
template <typename S>
__global__ void limbs_kernel(const S* __restrict__ src, int64_t rows, int32_t K, int32_t bits, HOperand op,
                             int8_t* __restrict__ lo, int8_t* __restrict__ hi, int64_t ld) {
  const int32_t k = this_col();
  if (k >= K) return;
  for (int64_t r = first_row(); r < rows; r += row_stride()) {
    const int32_t v = (int32_t)gemm_operand(op, (int64_t)src[r * K + k]);
    lo[r * ld + k] = act_limb(v, bits, 0);
    if (hi != nullptr) hi[r * ld + k] = act_limb(v, bits, 1);
  }
}

constexpr HOperand kNoOperand{0, Rescale{nullptr, nullptr, nullptr}, 0, 0, Range{0, 0}};

// W.x of rows [0, rows): the limb products requantized, row r on its x level (level[r], clamped
// into [0, levels); nullptr: level 0, a layer without levels) with that level's bias and rescale.
template <int NP, bool POW2, bool ACC32>
__global__ void input_epilogue_kernel(AccRequant a, AccRequant32 a32, LimbProducts lp, int64_t rows, int32_t H3,
                                      const int32_t* __restrict__ level, int32_t levels, int32_t* __restrict__ dwx) {
  const int32_t c = this_col();
  if (c >= H3) return;
  for (int64_t r = first_row(); r < rows; r += row_stride()) {
    int32_t j = level != nullptr ? level[r] : 0;
    j = j < 0 ? 0 : (j >= levels ? levels - 1 : j);
    const int64_t off = (int64_t)j * H3;
    dwx[r * H3 + c] = (int32_t)requantize_product<NP, POW2, ACC32>(at_level(a, off), at_level(a32, off), lp, r, c);
  }
}

// One time step for every (n, j): the shared cell, then the new state, its output copy (int16: a
// state has at most 16 bits) and the int8 limbs of the operand (gemm_operand) the next step's R.h
// GEMM reads. Padding rows
// (t >= lengths[n]) carry the state.
template <int NP, bool POW2, bool ACC32>
__global__ void cell_kernel(CellParams p, LimbProducts lp, int64_t N, int64_t t, const int32_t* __restrict__ dwx_t,
                            int32_t* __restrict__ state, int16_t* __restrict__ out_t, const int64_t* __restrict__ lengths,
                            int32_t h_bits, int8_t* __restrict__ h_lo, int8_t* __restrict__ h_hi, int64_t ld) {
  const int32_t H = (int32_t)p.H;
  const int32_t j = this_col();
  if (j >= H) return;
  const Channel32 ch = cell32_channel<ACC32>(p, j);  // the channel's fields, the same for every row
  for (int64_t n = first_row(); n < N; n += row_stride()) {
    const int64_t idx = n * H + j;
    const int32_t q_h = state[idx];
    if (lengths != nullptr && t >= lengths[n]) {
      out_t[idx] = (int16_t)q_h;
      continue;
    }
    const int32_t h_new = (int32_t)gru_cell<NP, POW2, ACC32>(p, lp, n, j, ch, dwx_t + n * 3 * H, q_h);
    state[idx] = h_new;
    out_t[idx] = (int16_t)h_new;
    const int64_t g = gemm_operand(p.op, h_new);
    h_lo[n * ld + j] = act_limb(g, h_bits, 0);
    if (h_hi != nullptr) h_hi[n * ld + j] = act_limb(g, h_bits, 1);
  }
}

// The float boundary in one pass each (issue 13 item 7): qgru_fixedpoint.h's quantize_value and
// dequantize_value, the functions the CPU backend's boundary computes too. A grid-stride loop over
// the elements. A NaN takes the value 0.0 takes (quantize_value) and ORs nan_bit into *nan_flag
// (a device word that the binding reads only where it checks synchronously: docs/spec.md 11).
// Q: int32, or int16 straight into a plan's qx (values of at most 16 bits).
template <typename X, typename Q>
__global__ void quantize_kernel(const X* __restrict__ x, Q* __restrict__ q, int64_t n, double scale, int64_t zp,
                                Range r, QuantizeBounds b, int32_t* __restrict__ nan_flag, int32_t nan_bit) {
  bool nan = false;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    q[i] = (Q)quantize_value((double)x[i], scale, zp, r, b, &nan);
  if (nan && nan_flag != nullptr) atomicOr(nan_flag, nan_bit);
}

// golden.quantize_levels, one warp per token (a grid-stride loop over tokens): the lanes fold the
// token's values into its range (token_range_add, qgru_fixedpoint.h: a NaN counts as 0.0, so the
// token's level is golden's for x.nan_to_num(0.0), the integers this backend gives for NaN input),
// the warp merges the lanes' ranges, lane 0 writes the level (select_level), and every lane
// quantizes its values on that level's grid (quantize_value, which flags a NaN and takes 0.0).
template <typename X, typename Q>
__global__ void quantize_levels_kernel(const X* __restrict__ x, Q* __restrict__ q, int32_t* __restrict__ level,
                                       int64_t tokens, int64_t I, XLevelGrid g, int64_t zp, Range r,
                                       int32_t* __restrict__ nan_flag, int32_t nan_bit) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x / 32);
  bool nan = false;
  for (int64_t t = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; t < tokens; t += warps) {
    const X* v = x + t * I;
    TokenRange range = token_range_empty();
    for (int64_t i = lane; i < I; i += 32) token_range_add(range, (double)v[i]);
    for (int o = 16; o > 0; o /= 2)  // the whole warp's range (a lane with no value holds the empty one)
      token_range_merge(range, TokenRange{__shfl_xor_sync(0xffffffffu, range.mn, o),
                                          __shfl_xor_sync(0xffffffffu, range.mx, o)});
    const int32_t j = select_level(g, range);
    if (lane == 0) level[t] = j;
    const QuantizeBounds b = quantize_bounds(r, zp);
    for (int64_t i = lane; i < I; i += 32) q[t * I + i] = (Q)quantize_value((double)v[i], g.scale[j], zp, r, b, &nan);
  }
  if (nan && nan_flag != nullptr) atomicOr(nan_flag, nan_bit);
}

template <typename Q>
__global__ void dequantize_kernel(const Q* __restrict__ q, float* __restrict__ out, int64_t n, double scale,
                                  double zp) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = dequantize_value((int32_t)q[i], scale, zp);
}

// golden.requantize_input with a per-tensor factor: sat(rounding_mul_shift(q - from_zp) + to_zp)
__global__ void requantize_kernel(const int16_t* __restrict__ q, int16_t* __restrict__ out, int64_t n, int64_t from_zp,
                                  int64_t mult, int32_t shift, int64_t to_zp, Range r) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = (int16_t)saturate(rounding_mul_shift((int64_t)q[i] - from_zp, mult, shift) + to_zp, r);
}

unsigned elementwise_blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return (unsigned)(b < 1 ? 1 : (b > 65535 ? 65535 : b));  // the grid-stride loop covers the rest
}

// Every limb pair of one product in one GEMM (qgru_cuda_launch.h, one_gemm_for_pairs), and their
// LimbProducts view: w8a16 and w16a16 launch one GEMM per product and step instead of 2 and 4.
// The activation limbs are consecutive buffers of `buffer_rows` rows (act_limbs[1] = act_limbs[0]
// + buffer_rows K_pad), the weight limbs consecutive [M_pad, K_pad] matrices, and G the pair
// buffers of one allocation ([P][buffer_rows M_pad], which holds the GEMM's n_act buffer_rows x
// n_w M_pad output): checked here.
LimbProducts run_gemms(const GemmDesc& g, int8_t* const act_limbs[2], int32_t* const G[kMaxPairs], int64_t rows,
                       int64_t buffer_rows, int64_t ones_col, cublasHandle_t handle) {
  PairGemm pg{};
  bool ok = one_gemm_for_pairs(g.P, g.act_limb, g.weight_limb, rows, buffer_rows, g.M_pad, &pg);
  for (int p = 0; ok && p < g.P; ++p) {
    ok = ok && (g.act_limb[p] == 0 || act_limbs[1] == act_limbs[0] + buffer_rows * g.K_pad);
    ok = ok && G[p] == G[0] + (int64_t)p * buffer_rows * g.M_pad;
  }
  if (!ok) throw std::runtime_error("qgru cuda: limb buffers are not laid out for one GEMM per product");
  gemm_s8(handle, act_limbs[0], g.weight_limbs, G[0], pg.gemm_rows, pg.ld, g.K_pad);
  LimbProducts lp{};
  for (int p = 0; p < g.P; ++p) {
    lp.G[p] = G[0] + pg.offset[p];
    lp.scale[p] = g.scale[p];
    lp.weight_offset[p] = g.weight_offset[p];
  }
  lp.ld = pg.ld;
  lp.ones_col = ones_col;
  return lp;
}

}  // namespace

WorkspaceSizes workspace_sizes(const LayerDesc& d, int64_t T, int64_t N) {
  WorkspaceSizes s;
  const int64_t n = N > 0 ? N : 1;
  // a window: as many steps as its buffers allow (window_steps, qgru_cuda_launch.h): per input row
  // the W.x GEMM outputs (int32, P pairs), Wx - Z_Wx (int32, 3H) and the two x limb buffers
  const int64_t row_bytes = 4 * d.wx.P * d.wx.M_pad + 4 * 3 * d.H + 2 * d.wx.K_pad;
  s.window_steps = window_steps(row_bytes, n, T);
  const int64_t window_rows = s.window_steps * n;
  s.chunk_rows = gemm_rows(window_rows);
  s.N_pad = gemm_rows(n);
  s.x_limb = s.chunk_rows * d.wx.K_pad;
  s.Gx = s.chunk_rows * d.wx.M_pad;
  s.h_limb = s.N_pad * d.rh.K_pad;
  s.Gh = s.N_pad * d.rh.M_pad;
  s.dwx = window_rows * 3 * d.H;
  return s;
}

void forward(const LayerDesc& d, const Workspace& ws, const int16_t* qx, const int32_t* level, int64_t T, int64_t N,
             int32_t* state, int16_t* out, const int64_t* lengths, cudaStream_t stream, cublasHandle_t handle) {
  if (T == 0 || N == 0) return;
  // `handle` must already be bound to `stream` with a workspace (qgru_cuda.cpp binds its own handle;
  // PyTorch's comes bound): calling cublasSetStream here would reset that workspace, and cuBLAS would
  // allocate inside a graph capture.
  const int64_t H = d.H, H3 = 3 * H;
  // the persistent recurrence where the layer's plan has one (ws.pk.blocks > 0): its operand's
  // double buffer [2][n_act][N][K_pad] takes h0's limbs at parity 0
  const bool persistent = ws.pk.blocks > 0;
  if (persistent && (ws.pk.N != N || ws.pk.H != H || ws.pk.K_pad != d.rh.K_pad || ws.pk_h == nullptr ||
                     ws.pk_counter == nullptr))
    throw std::runtime_error("qgru cuda: the persistent plan is not this call's shape");
  // h0's limbs for the first R.h GEMM (or the persistent kernel's first step)
  const Launch2D lh = launch_2d(N, H);
  int8_t* h0_lo = persistent ? ws.pk_h : ws.h_limbs[0];
  int8_t* h0_hi = d.h_bits <= 8 ? nullptr : (persistent ? ws.pk_h + N * d.rh.K_pad : ws.h_limbs[1]);
  limbs_kernel<int32_t><<<lh.grid, lh.block, 0, stream>>>(state, N, (int32_t)H, d.h_bits, d.cell.op, h0_lo, h0_hi,
                                                       d.rh.K_pad);
  check(cudaGetLastError(), "limbs_kernel (state) launch");
  const bool fused_persistent = ws.fused && ws.fp.s.ctas > 0;  // (qgru_cuda_fused.cu)
  if (fused_persistent) {
    if (ws.fp.s.N != N || ws.fp.s.H != H || ws.fp.s.K_pad != d.rh.K_pad || ws.fp_flags == nullptr || d.h_bits > 8)
      throw std::runtime_error("qgru cuda: the persistent fused plan is not this call's shape");
    check(cudaMemsetAsync(ws.fp_flags, 0, (size_t)fp_flag_words(ws.fp.s.ctas) * sizeof(uint32_t), stream),
          "cudaMemsetAsync (step flags)");
  }
  PkArgs pk{};
  if (persistent) {
    pk.weight_limbs = d.rh.weight_limbs;
    for (int q = 0; q < d.rh.P; ++q) {
      pk.act_limb[q] = d.rh.act_limb[q];
      pk.weight_limb[q] = d.rh.weight_limb[q];
      pk.scale[q] = d.rh.scale[q];
      pk.weight_offset[q] = d.rh.weight_offset[q];
    }
    pk.dwx = ws.dwx;
    pk.state = state;
    pk.out = out;
    pk.lengths = lengths;
    pk.h_buf = ws.pk_h;
    pk.h_bits = d.h_bits;
    pk.counter = ws.pk_counter;
  }
  // Windows of steps: W.x of a window's steps in one GEMM (seed 001 steps 1-2), then their
  // recurrence, one R.h GEMM + one cell kernel per step (step 3). Wx - Z_Wx is kept for one window
  // only (window_steps, qgru_cuda_launch.h: sized by the graph nodes a window saves), not for all T steps.
  for (int64_t t0 = 0; t0 < T; t0 += ws.window_steps) {
    const int64_t steps = T - t0 < ws.window_steps ? T - t0 : ws.window_steps;
    const int64_t rows = steps * N;
    const Launch2D lx = launch_2d(rows, d.I);
    limbs_kernel<int16_t><<<lx.grid, lx.block, 0, stream>>>(qx + t0 * N * d.I, rows, (int32_t)d.I, d.x_bits,
                                                         kNoOperand, ws.x_limbs[0], d.x_bits > 8 ? ws.x_limbs[1] : nullptr,
                                                         d.wx.K_pad);
    check(cudaGetLastError(), "limbs_kernel (x) launch");
    // rows padded (gemm_rows): the extra rows hold stale or zero limbs, their outputs are never read
    const LimbProducts lx_p = run_gemms(d.wx, ws.x_limbs, ws.Gx, gemm_rows(rows), ws.chunk_rows, d.ones_col, handle);
    const Launch2D le = launch_2d(rows, H3);
    dispatch_kernel(d.wx.P, d.pow2, d.acc32, [&](auto np, auto pow2, auto acc32) {
      input_epilogue_kernel<decltype(np)::value, decltype(pow2)::value, decltype(acc32)::value>
          <<<le.grid, le.block, 0, stream>>>(d.acc_x, d.acc_x32, lx_p, rows, (int32_t)H3,
                                             level != nullptr ? level + t0 * N : nullptr,
                                             (int32_t)(d.x_levels > 0 ? d.x_levels : 1), ws.dwx);
    });
    check(cudaGetLastError(), "input_epilogue_kernel launch");
    if (persistent) {  // the window's steps in one launch (qgru_cuda_persistent.cu)
      pk.t0 = t0;
      persistent_steps(d, ws.pk, pk, t0, t0 + steps, stream);
      continue;
    }
    if (fused_persistent) {  // the window's steps in one launch, the operand in h_limbs[t % 2]
      fused_persistent_steps(d, ws.fp, ws.h_limbs, ws.dwx, state, out, lengths, ws.fp_flags, t0, t0 + steps, stream);
      continue;
    }
    if (ws.fused) {  // one kernel per step (qgru_cuda_fused.cu), the operand in h_limbs[t % 2]
      if (d.h_bits > 8) throw std::runtime_error("qgru cuda: the fused step takes an operand of one limb");
      for (int64_t t = t0; t < t0 + steps; ++t)
        fused_step(d, ws.h_limbs[t & 1], ws.h_limbs[(t + 1) & 1], ws.dwx + (t - t0) * N * H3, state, out + t * N * H,
                   lengths, t, N, stream);
      continue;
    }
    for (int64_t t = t0; t < t0 + steps; ++t) {
      const LimbProducts lp = run_gemms(d.rh, ws.h_limbs, ws.Gh, ws.N_pad, ws.N_pad, d.ones_col, handle);
      dispatch_kernel(d.rh.P, d.pow2, d.acc32, [&](auto np, auto pow2, auto acc32) {
        cell_kernel<decltype(np)::value, decltype(pow2)::value, decltype(acc32)::value>
            <<<lh.grid, lh.block, 0, stream>>>(d.cell, lp, N, t, ws.dwx + (t - t0) * N * H3, state, out + t * N * H,
                                               lengths, d.h_bits, ws.h_limbs[0],
                                               d.h_bits > 8 ? ws.h_limbs[1] : nullptr, d.rh.K_pad);
      });
      check(cudaGetLastError(), "cell_kernel launch");
    }
  }
}

template <typename X, typename Q>
void quantize(const X* x, Q* q, int64_t n, double scale, int64_t zp, int32_t bits, int32_t* nan_flag, int32_t nan_bit,
              cudaStream_t stream) {
  static_assert(std::is_same<Q, int32_t>::value || std::is_same<Q, int16_t>::value, "int32 or int16 output");
  if (n == 0) return;
  const Range r = signed_range(bits);
  quantize_kernel<X, Q><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, q, n, scale, zp, r, quantize_bounds(r, zp),
                                                                        nan_flag, nan_bit);
  check(cudaGetLastError(), "quantize_kernel launch");
}

template <typename X, typename Q>
void quantize_levels(const X* x, Q* q, int32_t* level, int64_t tokens, int64_t I, const XLevelGrid& g, int64_t zp,
                     int32_t bits, int32_t* nan_flag, int32_t nan_bit, cudaStream_t stream) {
  static_assert(std::is_same<Q, int32_t>::value || std::is_same<Q, int16_t>::value, "int32 or int16 output");
  if (tokens == 0) return;
  if (g.count < 1 || g.count > kMaxXLevels || I < 1) throw std::runtime_error("qgru cuda: bad x levels");
  const int64_t warps_per_block = kThreads / 32;
  int64_t blocks = (tokens + warps_per_block - 1) / warps_per_block;
  blocks = blocks > 65535 ? 65535 : blocks;  // the grid-stride loop covers the rest
  quantize_levels_kernel<X, Q><<<(unsigned)blocks, kThreads, 0, stream>>>(x, q, level, tokens, I, g, zp,
                                                                          signed_range(bits), nan_flag, nan_bit);
  check(cudaGetLastError(), "quantize_levels_kernel launch");
}

template <typename Q>
void dequantize(const Q* q, float* out, int64_t n, double scale, int64_t zp, cudaStream_t stream) {
  if (n == 0) return;
  dequantize_kernel<Q><<<elementwise_blocks(n), kThreads, 0, stream>>>(q, out, n, scale, (double)zp);
  check(cudaGetLastError(), "dequantize_kernel launch");
}

void requantize(const int16_t* q, int16_t* out, int64_t n, int64_t from_zp, int64_t mult, int32_t shift, int64_t to_zp,
                int32_t to_bits, cudaStream_t stream) {
  if (n == 0) return;
  requantize_kernel<<<elementwise_blocks(n), kThreads, 0, stream>>>(q, out, n, from_zp, mult, shift, to_zp,
                                                                   signed_range(to_bits));
  check(cudaGetLastError(), "requantize_kernel launch");
}

// the forms qgru_cuda.cpp calls
template void quantize<float, int32_t>(const float*, int32_t*, int64_t, double, int64_t, int32_t, int32_t*, int32_t,
                                       cudaStream_t);
template void quantize<double, int32_t>(const double*, int32_t*, int64_t, double, int64_t, int32_t, int32_t*, int32_t,
                                        cudaStream_t);
template void quantize<float, int16_t>(const float*, int16_t*, int64_t, double, int64_t, int32_t, int32_t*, int32_t,
                                       cudaStream_t);
template void quantize<double, int16_t>(const double*, int16_t*, int64_t, double, int64_t, int32_t, int32_t*, int32_t,
                                        cudaStream_t);
template void quantize_levels<float, int32_t>(const float*, int32_t*, int32_t*, int64_t, int64_t, const XLevelGrid&,
                                              int64_t, int32_t, int32_t*, int32_t, cudaStream_t);
template void quantize_levels<double, int32_t>(const double*, int32_t*, int32_t*, int64_t, int64_t,
                                               const XLevelGrid&, int64_t, int32_t, int32_t*, int32_t, cudaStream_t);
template void quantize_levels<float, int16_t>(const float*, int16_t*, int32_t*, int64_t, int64_t, const XLevelGrid&,
                                              int64_t, int32_t, int32_t*, int32_t, cudaStream_t);
template void quantize_levels<double, int16_t>(const double*, int16_t*, int32_t*, int64_t, int64_t,
                                               const XLevelGrid&, int64_t, int32_t, int32_t*, int32_t, cudaStream_t);
template void dequantize<int32_t>(const int32_t*, float*, int64_t, double, int64_t, cudaStream_t);
template void dequantize<int16_t>(const int16_t*, float*, int64_t, double, int64_t, cudaStream_t);

}  // namespace cuda
}  // namespace qgru
