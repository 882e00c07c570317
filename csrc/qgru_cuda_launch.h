// Host-side shapes of the CUDA backend (qgru_cuda_kernels.cu): the element-wise kernels' launch
// shapes, the layout of the one GEMM per product, and a plan's steps, W.x windows, buffers and
// bound (qgru_cuda.cpp). Host code without CUDA headers, so that tests/test_cuda_compile.py can
// compile it with the host compiler and check, for many shapes, that the kernels' index loops visit
// every element exactly once, that the GEMM's blocks are the limb pairs' products, and what every
// GPU benchmark shape's plan keeps and each call allocates.
#pragma once

#include <cstdint>

namespace qgru {
namespace cuda {

constexpr int kThreads = 256;  // threads per block

constexpr int kPad = 16;  // rows, channels and K are padded to multiples of 16 (int8 tensor cores)
// ...and to at least 32: every GEMM dimension (m = channels, n = rows, k) is >= 32. PyTorch's own
// int8 GEMM (_int_mm) refuses 16 or fewer rows ("cuBLAS is currently broken for some combination
// of transposed inputs") and a K of 16 or less; rather than prove those shapes safe on every cuBLAS
// version, qgru never asks for them. The weight limbs come padded by prepare_layer (gemm_min);
// the row counts are padded here (gemm_rows).
constexpr int64_t kMinGemmDim = 32;

// Rows of a GEMM over `rows` rows of activations: a multiple of kPad, at least kMinGemmDim.
inline int64_t gemm_rows(int64_t rows) {
  const int64_t r = (rows + kPad - 1) / kPad * kPad;
  return r < kMinGemmDim ? kMinGemmDim : r;
}

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

// Steps per W.x window (qgru_cuda_kernels.cu, workspace_sizes). A window costs 3 graph nodes (the
// x limbs, the W.x GEMM, its epilogue) next to the 2 of each of its steps (R.h GEMM, cell), so a
// window of s steps adds 3 / s nodes per step: what a longer window saves is nodes, and past a few
// dozen steps little (32 -> 64 steps saves 0.05 nodes per step, ~0.15 us on an H200 at ~3.3 us per
// dependent node). Its buffers (W.x GEMM outputs, Wx - Z_Wx and x limbs: row_bytes per input row)
// grow with every step. So a window holds:
//   * at least as many steps as kWindowBytes of buffers hold (cheap: a small layer or batch gets
//     long windows, up to all T steps in one), and at least kWindowTargetSteps where those stay
//     within kMaxWindowBytes (a large layer at a large batch: H = I = 1024, N = 256 took 4-step
//     windows at 32 MiB, 26 windows per 104 steps; now 6);
//   * at most kMaxWindowRows rows (one cuBLAS GEMM's m), at least one step and at most T;
//   * then the fewest windows those counts allow, each as short as that many windows can be
//     (T = 104 in windows of at most 19 steps: 6 windows of 18, not 5 of 19 and one of 9): the
//     same nodes, smaller buffers.
constexpr int64_t kWindowBytes = int64_t(32) << 20;
constexpr int64_t kWindowTargetSteps = 32;
constexpr int64_t kMaxWindowBytes = int64_t(128) << 20;
constexpr int64_t kMaxWindowRows = 16384;

inline int64_t window_steps(int64_t row_bytes, int64_t N, int64_t T) {
  const int64_t n = N > 0 ? N : 1, rb = row_bytes > 0 ? row_bytes : 1;
  const int64_t by_bytes = kWindowBytes / rb / n;  // what kWindowBytes holds
  int64_t target = kMaxWindowBytes / rb / n;       // kWindowTargetSteps, within kMaxWindowBytes
  if (target > kWindowTargetSteps) target = kWindowTargetSteps;
  int64_t steps = by_bytes > target ? by_bytes : target;
  if (steps > kMaxWindowRows / n) steps = kMaxWindowRows / n;
  if (steps < 1) steps = 1;
  if (T > 0) {
    if (steps > T) steps = T;
    const int64_t windows = (T + steps - 1) / steps;
    steps = (T + windows - 1) / windows;  // as short as the same number of windows allows
  }
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


// What a plan (qgru_cuda.cpp make_buffers) allocates, from plain sizes, so that the bound on plans,
// the window and the per-call memory can be computed and tested on the host. LayerDims: a layer's
// sizes (LayerDesc's, qgru_cuda.h); wx / rh: the W.x and R.h products' limb pairs and padded
// [M_pad, K_pad] weight limbs.
struct LayerDims {
  int64_t H, I, x_levels;
  int64_t wx_P, wx_M_pad, wx_K_pad;
  int64_t rh_P, rh_M_pad, rh_K_pad;
};

// A W.x window's bytes per input row (workspace_sizes): its GEMM outputs (int32, one block per
// pair), Wx - Z_Wx (int32, 3H) and the two x limb buffers.
inline int64_t window_row_bytes(const LayerDims& d) { return 4 * d.wx_P * d.wx_M_pad + 4 * 3 * d.H + 2 * d.wx_K_pad; }

// The T-sized int16 buffer of a plan, shared by qx [T, N, I] and out [T, N, H]: out at element 0,
// qx at element T N max(0, H - I), T N max(I, H) elements in all (not T N (I + H): half at I = H).
// Valid because the forward reads step t's qx (its window's x limbs, all of them before the
// window's first step) before it writes out[t], and out[t] = elements [t N H, (t + 1) N H) ends at
// or before qx[t + 1]'s first element, T N max(0, H - I) + (t + 1) N I (for t < T): a step's
// output overwrites only x of its own or earlier steps, which every later read has no use for.
struct StepBuffer {
  int64_t elems, qx_offset, out_offset;
};

inline StepBuffer step_buffer(int64_t T, int64_t N, int64_t I, int64_t H) {
  const int64_t wide = I > H ? I : H;
  return {T * N * wide, H > I ? T * N * (H - I) : 0, 0};
}

// A plan's buffers for a forward of T steps and N rows (element counts: WorkspaceSizes, qgru_cuda.h,
// which qgru_cuda.cpp checks against these), and their bytes (buffer_bytes): the step buffer, the
// x levels [T, N] int32 (a layer with levels), the state [N, H] int32, lengths [N] int64, the limb
// buffers (two each, int8), the products' pair buffers and Wx - Z_Wx (int32), and the persistent
// recurrence's operand buffer and counter (pk_h_buffer > 0).
struct PlanSizes {
  int64_t window_steps, chunk_rows, N_pad, x_limb, Gx, h_limb, Gh, dwx;
  StepBuffer steps;
  int64_t bytes;
};

inline PlanSizes plan_sizes(const LayerDims& d, int64_t T, int64_t N, bool has_lengths, int64_t pk_h_buffer) {
  PlanSizes s;
  const int64_t n = N > 0 ? N : 1;
  s.window_steps = window_steps(window_row_bytes(d), n, T);
  const int64_t window_rows = s.window_steps * n;
  s.chunk_rows = gemm_rows(window_rows);
  s.N_pad = gemm_rows(n);
  s.x_limb = s.chunk_rows * d.wx_K_pad;
  s.Gx = s.chunk_rows * d.wx_M_pad;
  s.h_limb = s.N_pad * d.rh_K_pad;
  s.Gh = s.N_pad * d.rh_M_pad;
  s.dwx = window_rows * 3 * d.H;
  s.steps = step_buffer(T, N, d.I, d.H);
  s.bytes = 2 * s.steps.elems + (d.x_levels > 0 ? 4 * T * N : 0) + 4 * N * d.H + (has_lengths ? 8 * N : 0) +
            2 * (s.x_limb + s.h_limb) + 4 * (d.wx_P * s.Gx + d.rh_P * s.Gh + s.dwx) +
            (pk_h_buffer > 0 ? pk_h_buffer + 4 : 0);
  return s;
}

// The most bytes a plan may keep between calls (qgru_cuda.cpp run_call): QGRU_CUDA_PLAN_MAX_BYTES
// where it is set (env_bytes >= 0), else a share of the memory the device has free when the plan
// would be made (free_bytes: cudaMemGetInfo's, plus what PyTorch's caching allocator holds
// unallocated), 1 / kPlanFreeDivisor of it, and never less than kPlanCacheBytes. A fixed 256 MiB
// left H = I = 1024, T = 1000, N = 64 without a plan (its T-sized buffers alone were 256 MiB): it
// ran eagerly, two host launches per step, in buffers of each call's own. A shape over the bound
// runs so still. (Which of its plans a layer keeps is plans_to_keep's: the newest always.)
constexpr int64_t kPlanFreeDivisor = 4;

inline int64_t plan_max_bytes(int64_t env_bytes, int64_t free_bytes) {
  if (env_bytes >= 0) return env_bytes;
  const int64_t share = (free_bytes > 0 ? free_bytes : 0) / kPlanFreeDivisor;
  return share > kPlanCacheBytes ? share : kPlanCacheBytes;
}

}  // namespace cuda
}  // namespace qgru
