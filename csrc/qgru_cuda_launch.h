// Host-side shapes of the CUDA backend (qgru_cuda_kernels.cu): the element-wise kernels' launch
// shapes, the layout of the one GEMM per product and the steps of a plan (qgru_cuda.cpp). Host code without CUDA headers, so that
// tests/test_cuda_compile.py can compile it with the host compiler and check, for many shapes,
// that the kernels' index loops visit every element exactly once and that the GEMM's blocks are
// the limb pairs' products.
#pragma once

#include <cstdint>

namespace qgru {
namespace cuda {

constexpr int kThreads = 256;  // threads per block

// A [rows, cols] array: x (threads and blocks) along the columns, which cover cols exactly once,
// y along the rows, with a grid-stride loop over them. Each kernel thread takes
//   column c = blockIdx.x * blockDim.x + threadIdx.x (and returns if c >= cols),
//   rows r = blockIdx.y * blockDim.y + threadIdx.y, r += gridDim.y * blockDim.y while r < rows,
// so that an element's (row, column) comes from the thread's coordinates, with no 64-bit `/` or
// `%` per element (a 64-bit division is a long instruction sequence on the GPU). Narrow arrays get
// narrow, taller blocks (block_x a power of two from 32 to kThreads, block_x * block_y = kThreads).
// cols is a channel or input count (< 3 * 2^17, LayerTensors::validate), far below grid x's limit.
struct Launch2DShape {
  int64_t grid_x, grid_y, block_x, block_y;
};

inline Launch2DShape launch_2d_shape(int64_t rows, int64_t cols) {
  if (cols < 1) cols = 1;
  int64_t bx = 32;  // the smallest power of two >= cols, from a warp to kThreads: it divides kThreads
  while (bx < cols && bx < kThreads) bx *= 2;
  const int64_t by = kThreads / bx;
  const int64_t gx = (cols + bx - 1) / bx;
  int64_t gy = (rows + by - 1) / by;
  gy = gy < 1 ? 1 : (gy > 65535 ? 65535 : gy);  // gridDim.y's limit; the row loop covers the rest
  return {gx, gy, bx, by};
}

// Every limb pair of one product as one GEMM (run_gemms). The activation limbs are consecutive
// buffers of buffer_rows rows each (limb i's rows start at row i buffer_rows of the stacked
// matrix), the weight limbs consecutive [M_pad, K] matrices (n_w M_pad channels stacked). The GEMM
// runs over gemm_rows = (n_act - 1) buffer_rows + rows stacked activation rows and all n_w M_pad
// channels, output row stride ld = n_w M_pad; pair p = (activation limb i, weight limb j) is the
// block starting at offset[p] = i buffer_rows ld + j M_pad (its row r, channel c at
// offset[p] + r ld + c). Valid when the pairs are every (i, j) combination (prepare_layer makes
// them so) and rows <= buffer_rows; returns false otherwise. The rows of limb i past `rows` are
// computed and never read.
struct PairGemm {
  int64_t gemm_rows, ld;
  int64_t offset[4];
};

inline bool one_gemm_for_pairs(int P, const int* act_limb, const int* weight_limb, int64_t rows, int64_t buffer_rows,
                               int64_t M_pad, PairGemm* out) {
  if (P < 1 || P > 4 || rows > buffer_rows) return false;
  int n_act = 1, n_w = 1;
  for (int p = 0; p < P; ++p) {
    if (act_limb[p] < 0 || act_limb[p] > 1 || weight_limb[p] < 0 || weight_limb[p] > 1) return false;
    n_act = act_limb[p] + 1 > n_act ? act_limb[p] + 1 : n_act;
    n_w = weight_limb[p] + 1 > n_w ? weight_limb[p] + 1 : n_w;
  }
  for (int i = 0; i < n_act; ++i)  // every combination, once
    for (int j = 0; j < n_w; ++j) {
      int seen = 0;
      for (int p = 0; p < P; ++p) seen += act_limb[p] == i && weight_limb[p] == j;
      if (seen != 1) return false;
    }
  out->ld = n_w * M_pad;
  out->gemm_rows = (n_act - 1) * buffer_rows + rows;
  for (int p = 0; p < P; ++p) out->offset[p] = act_limb[p] * buffer_rows * out->ld + weight_limb[p] * M_pad;
  return true;
}

// The steps a CUDA plan (buffers and captured graph) holds for a call of T steps. Calls of up to
// kExactPlanSteps steps get a plan of their own length; a longer call runs in a plan of T rounded
// up to a multiple of 2^(e - 3), where 2^e <= T < 2^(e + 1): at most 1/8 more steps (never
// computed for nothing past the call's own: every row's length is at most T, so the extra steps
// carry the state unchanged), at most 8 plan lengths per octave, and a plan length is its own
// (plan_steps(plan_steps(T)) == plan_steps(T)). Variable-length inference then reuses a few
// captured graphs instead of capturing one per distinct T.
constexpr int64_t kExactPlanSteps = 16;

inline int64_t plan_steps(int64_t T) {
  if (T <= kExactPlanSteps) return T;
  int e = 0;
  while ((int64_t(2) << e) <= T) ++e;  // 2^e <= T < 2^(e + 1), e >= 4
  const int64_t q = int64_t(1) << (e - 3);
  return (T + q - 1) / q * q;
}

// Steps per W.x window (qgru_cuda_kernels.cu, workspace_sizes): as many as keep the window's
// buffers (W.x GEMM outputs, Wx - Z_Wx and x limbs: row_bytes per input row) within
// kWindowBytes, and its rows within kMaxWindowRows (one cuBLAS GEMM's m), at least one step and at
// most T. A fixed row count made the window of a large layer the largest thing a plan keeps
// (H = I = 1024, N = 64: 400 MB of W.x outputs and Wx for 16384 rows), past the bound a plan may
// keep (kPlanCacheBytes); 32 MiB still gives the W.x GEMM hundreds of rows there.
constexpr int64_t kWindowBytes = int64_t(32) << 20;
constexpr int64_t kMaxWindowRows = 16384;

inline int64_t window_steps(int64_t row_bytes, int64_t N, int64_t T) {
  const int64_t n = N > 0 ? N : 1;
  int64_t rows = kWindowBytes / (row_bytes > 0 ? row_bytes : 1);
  if (rows > kMaxWindowRows) rows = kMaxWindowRows;
  int64_t steps = rows / n;
  if (steps < 1) steps = 1;
  if (T > 0 && steps > T) steps = T;
  return steps;
}

// Plans hold at most kMaxGraphSteps steps (plan_steps of the call's T): a longer call runs
// without a plan (qgru_cuda.cpp), since its captured graph (2 or more nodes per step) would cost
// seconds to capture and instantiate per length bucket.
constexpr int64_t kMaxGraphSteps = 4096;

// A layer keeps the plans of its last few shapes, so that calls alternating between shapes (two
// length buckets, a training batch and a last partial one) replay their graphs instead of
// rebuilding a plan per call. Bounded: at most kMaxPlans plans, and older plans only while all the
// plans' buffers together stay within kPlanCacheBytes (the newest is always kept, whatever its
// size). plans_to_keep(bytes, n): how many of the n plans, newest first with bytes[i] each, stay.
constexpr int64_t kMaxPlans = 4;
constexpr int64_t kPlanCacheBytes = int64_t(256) << 20;

inline int64_t plans_to_keep(const int64_t* bytes, int64_t n) {
  if (n <= 0) return 0;
  int64_t keep = 1, total = bytes[0];
  while (keep < n && keep < kMaxPlans && total + bytes[keep] <= kPlanCacheBytes) total += bytes[keep++];
  return keep;
}

}  // namespace cuda
}  // namespace qgru
