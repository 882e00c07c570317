// The persistent recurrence of the CUDA backend (issue 34; docs/design.md "Persistent recurrence"):
// one launch runs a window's time loop, each block keeping its rows of R in shared memory for the
// whole launch. Plain C++ with QGRU_HD functions, no CUDA header: the plan (which shapes fit,
// ownership of hidden units, shared-memory layout, buffer sizes, barrier schedule) and the phases
// of a block's step are compiled for the host by the tests (tests/test_cuda_persistent.py), which
// check the plan for many shapes and run the whole schedule on the host (pk_run_on_host) against
// qgru/golden.py bit for bit. The CUDA kernel (qgru_cuda_persistent.cu) is the same phases in a
// thread-strided loop, with __syncthreads between phases and a grid barrier between steps.
//
// Block b owns hidden units [b units, min(H, (b + 1) units)) for all three gates: its local
// channel c < 3 units is gate c / units of unit c % units (global channel q H + j), channel
// 3 units (when a pair has a weight offset) the weight limbs' ones row (prepare_layer's ones_col).
// Per step t and row tile: stage the tile's R.h operand (int8 limbs of every unit, read from the
// global double buffer at parity t & 1), the tile's int32 products of every limb pair for the
// block's channels, then the shared cell (qgru_cell.h, the functions cell_kernel runs) for the
// block's units, which writes the state, out[t] and the next operand's limbs at parity (t + 1) & 1.
// No step reads a buffer it writes, so one grid barrier per step orders everything.
#pragma once

#include <stdint.h>

#include "qgru_cell.h"

namespace qgru {
namespace cuda {

constexpr int kPkThreads = 256;          // threads per block
constexpr int64_t kPkMaxRowsTile = 256;  // batch rows staged at once (fewer where shared memory is short)
constexpr int64_t kPkRowBlock = 2;       // rows and channels of one thread's products (pk_product)
constexpr int64_t kPkChanBlock = 4;

// What a plan depends on: the layer's R.h GEMM and the batch.
struct PkShape {
  int64_t H, N, K_pad, M_pad;  // units, batch rows, the R.h GEMM's padded K (>= H) and channels
  int n_act, n_w, P;           // activation limbs, weight limbs, limb pairs
  int64_t ones_col;            // the weight limbs' ones row (a pair with a weight offset reads it)
  bool ones;                   // whether any pair has a weight offset
};

// The device: SMs and the opt-in shared memory one block may have (cudaDevAttrMaxSharedMemoryPerBlockOptin).
struct PkDevice {
  int64_t sm_count, smem_per_block;
};

struct PkPlan {
  int64_t H, N, K_pad, M_pad;
  int n_act, n_w, P;
  int64_t blocks, units;      // grid and units per block (the last block may own fewer)
  int64_t channels;           // local channels: 3 units (+ 1: the ones row)
  int64_t ch_ld;              // channels rounded up to kPkChanBlock (staged R rows, product columns)
  int64_t ones_col, ones_local;  // the ones row's global and local channel (0, 0: none; any valid column)
  int64_t row_ld;             // bytes per staged row of R or h (pk_row_ld)
  int64_t rows_tile, tiles;   // batch rows per tile, tiles per step
  int64_t rows_ld;            // rows_tile rounded up to kPkRowBlock (staged operand rows, product rows)
  int64_t r_offset, h_offset, acc_offset, smem_bytes;  // shared memory layout in bytes
  int64_t h_buffer;           // int8 elements of the global operand double buffer [2][n_act][N][K_pad]
};

enum PkFit : int {
  kPkFits = 0,
  kPkBadShape = 1,   // a shape the plan does not describe (sizes, limb counts)
  kPkNoRoom = 2,     // the block's R rows and one row of h and products exceed its shared memory
  kPkNoDevice = 3,   // no SM count, or no cooperative launch (device, or a CUDA before 12)
};

QGRU_HD int64_t pk_align(int64_t v) { return (v + 15) / 16 * 16; }

QGRU_HD int64_t pk_round(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Bytes from one staged row to the next: K_pad rounded up to 128, plus 16. Rows stay 16-byte
// aligned (the kernel reads them 16 bytes at a time), and 8 consecutive rows start 4 banks apart,
// so 8 threads reading 16 bytes of 8 consecutive rows at one k touch all 32 banks once.
QGRU_HD int64_t pk_row_ld(int64_t K_pad) { return pk_round(K_pad, 128) + 16; }

// Shared memory of a plan with `rows` rows per tile: R [n_w][ch_ld][row_ld] int8,
// h [n_act][rows_ld][row_ld] int8, products [P][rows_ld][ch_ld] int32 (rows_ld = rows rounded up
// to kPkRowBlock), each 16-byte aligned.
QGRU_HD int64_t pk_smem_bytes(const PkPlan& p, int64_t rows, int64_t* h_offset, int64_t* acc_offset) {
  const int64_t rows_ld = pk_round(rows, kPkRowBlock);
  const int64_t r = pk_align(p.n_w * p.ch_ld * p.row_ld);
  const int64_t h = pk_align(p.n_act * rows_ld * p.row_ld);
  *h_offset = r;
  *acc_offset = r + h;
  return r + h + pk_align(4 * p.P * rows_ld * p.ch_ld);
}

// The plan of a shape on a device, or why there is none. One block per SM (fewer where H is
// small): blocks = ceil(H / units) with units = ceil(H / sm_count), so every block owns at least
// one unit and the grid fits co-resident when one block fits per SM (the binding checks that with
// the occupancy API, and the launch is cooperative). Rows per tile: all N if they fit, else as
// many as the shared memory left after R allows (at most kPkMaxRowsTile).
inline int pk_plan(const PkShape& s, const PkDevice& dev, PkPlan* out) {
  if (dev.sm_count < 1 || dev.smem_per_block < 1) return kPkNoDevice;
  if (s.H < 1 || s.N < 1 || s.K_pad < s.H || s.K_pad % 16 != 0 || s.M_pad < 3 * s.H + (s.ones ? 1 : 0) ||
      s.n_act < 1 || s.n_act > 2 || s.n_w < 1 || s.n_w > 2 || (s.P != 1 && s.P != 2 && s.P != 4) ||
      s.P != s.n_act * s.n_w || (s.ones && (s.ones_col < 3 * s.H || s.ones_col >= s.M_pad)))
    return kPkBadShape;
  PkPlan p{};
  p.H = s.H, p.N = s.N, p.K_pad = s.K_pad, p.M_pad = s.M_pad;
  p.n_act = s.n_act, p.n_w = s.n_w, p.P = s.P;
  p.units = (s.H + dev.sm_count - 1) / dev.sm_count;
  p.blocks = (s.H + p.units - 1) / p.units;
  p.channels = 3 * p.units + (s.ones ? 1 : 0);
  p.ch_ld = pk_round(p.channels, kPkChanBlock);
  p.ones_col = s.ones ? s.ones_col : 0;
  p.ones_local = s.ones ? 3 * p.units : 0;
  p.row_ld = pk_row_ld(s.K_pad);
  int64_t rows = s.N < kPkMaxRowsTile ? s.N : kPkMaxRowsTile;
  int64_t ho = 0, ao = 0;
  while (rows > 0 && pk_smem_bytes(p, rows, &ho, &ao) > dev.smem_per_block) --rows;
  if (rows < 1) return kPkNoRoom;
  p.rows_tile = rows;
  p.rows_ld = pk_round(rows, kPkRowBlock);
  p.tiles = (s.N + rows - 1) / rows;
  p.r_offset = 0;
  p.smem_bytes = pk_smem_bytes(p, rows, &p.h_offset, &p.acc_offset);
  p.h_buffer = 2 * p.n_act * s.N * s.K_pad;
  *out = p;
  return kPkFits;
}

// Units [*u0, *u1) of block b.
QGRU_HD void pk_units(const PkPlan& p, int64_t b, int64_t* u0, int64_t* u1) {
  *u0 = b * p.units;
  const int64_t e = *u0 + p.units;
  *u1 = e < p.H ? e : p.H;
}

// The global channel (row of the weight limbs) of block b's local channel c, or -1 for a channel
// past the last unit or past `channels` (padding: its R rows are zero, its products never read).
QGRU_HD int64_t pk_channel(const PkPlan& p, int64_t b, int64_t c) {
  if (c >= p.channels) return -1;
  if (c == p.ones_local && p.channels > 3 * p.units) return p.ones_col;
  const int64_t q = c / p.units, j = b * p.units + c % p.units;
  return j < p.H ? q * p.H + j : -1;
}

// Index of (parity, limb, row n, k) in the global operand double buffer.
QGRU_HD int64_t pk_h_index(const PkPlan& p, int64_t parity, int64_t limb, int64_t n, int64_t k) {
  return ((parity * p.n_act + limb) * p.N + n) * p.K_pad + k;
}

// The grid barrier after launch-local step s (0-based): every block adds 1 to a counter the launch
// starts at 0 and waits until it reaches (s + 1) blocks, so the wait after step s ends exactly
// when every block has finished step s, and no counter reset (and no reuse of a value) is ever
// needed. A launch runs at most pk_launch_steps(blocks) steps: every target stays below 2^31.
QGRU_HD uint32_t pk_barrier_target(int64_t s, int64_t blocks) { return (uint32_t)((s + 1) * blocks); }
QGRU_HD int64_t pk_launch_steps(int64_t blocks) { return ((int64_t(1) << 31) - 1) / (blocks < 1 ? 1 : blocks); }

// The pointers and values a launch reads besides the cell's parameters.
struct PkArgs {
  const int8_t* weight_limbs;  // [n_w][M_pad][K_pad]
  int act_limb[kMaxPairs], weight_limb[kMaxPairs];
  int64_t scale[kMaxPairs], weight_offset[kMaxPairs];
  const int32_t* dwx;          // [window steps][N][3H]: Wx - Z_Wx of the window starting at step t0
  int64_t t0;
  int32_t* state;              // [N][H]
  int16_t* out;                // [T][N][H]
  const int64_t* lengths;      // [N] or nullptr
  int8_t* h_buf;               // [2][n_act][N][K_pad] (padding k >= H zero)
  int32_t h_bits;
  uint32_t* counter;           // the grid barrier's counter, 0 at the launch
};

// ---- the phases of block b's step: each handles one index of a thread-strided loop ----------

// R rows of the block, once per launch: 4-byte word w of [n_w][ch_ld][K_pad] into shared memory
// (padding channels zero).
QGRU_HD int64_t pk_r_words(const PkPlan& p) { return p.n_w * p.ch_ld * (p.K_pad / 4); }
QGRU_HD void pk_stage_r(const PkPlan& p, const PkArgs& a, unsigned char* smem, int64_t b, int64_t w) {
  const int64_t kw = p.K_pad / 4, k = (w % kw) * 4, c = (w / kw) % p.ch_ld, limb = w / (kw * p.ch_ld);
  const int64_t g = pk_channel(p, b, c);
  int8_t* dst = (int8_t*)(smem + p.r_offset + (limb * p.ch_ld + c) * p.row_ld + k);
  const int8_t* src = a.weight_limbs + (limb * p.M_pad + (g < 0 ? 0 : g)) * p.K_pad + k;
  for (int i = 0; i < 4; ++i) dst[i] = g < 0 ? (int8_t)0 : src[i];
}

// The operand of rows [row0, row0 + rows_tile) at step t: word w of [n_act][rows_ld][K_pad].
// Rows past N or past the tile stage zeros. `load` reads 4 global bytes (the kernel bypasses L1: other blocks wrote
// them before the barrier).
template <typename Load>
QGRU_HD void pk_stage_h(const PkPlan& p, const PkArgs& a, unsigned char* smem, int64_t t, int64_t row0, int64_t w,
                        Load load) {
  const int64_t kw = p.K_pad / 4, k = (w % kw) * 4, r = (w / kw) % p.rows_ld, limb = w / (kw * p.rows_ld);
  const int64_t n = row0 + r;
  uint32_t v = 0;
  if (r < p.rows_tile && n < p.N) v = load(a.h_buf + pk_h_index(p, t & 1, limb, n, k));
  *(uint32_t*)(smem + p.h_offset + (limb * p.rows_ld + r) * p.row_ld + k) = v;
}
QGRU_HD int64_t pk_h_words(const PkPlan& p) { return p.n_act * p.rows_ld * (p.K_pad / 4); }

// The products [P][rows_ld][ch_ld] in work items of kPkRowBlock x kPkChanBlock: item o of pair q
// takes rows rb + i nrb and channels cb + j ncb (nrb = rows_ld / kPkRowBlock, ncb = ch_ld /
// kPkChanBlock; consecutive items: consecutive cb, so a warp reads consecutive R rows, conflict-free
// (pk_row_ld), and few distinct operand rows, broadcast). Each staged row is read once per 16 bytes
// of K for all the item's products. Exact in int32: |sum| <= K 2^14 < 2^31 for K < 2^17, on the
// GPU with dp4a, on the host with int32 multiply-adds (the same integers).
QGRU_HD int64_t pk_products(const PkPlan& p) {
  return p.P * (p.rows_ld / kPkRowBlock) * (p.ch_ld / kPkChanBlock);
}
QGRU_HD void pk_product(const PkPlan& p, const PkArgs& a, unsigned char* smem, int64_t o) {
  const int64_t nrb = p.rows_ld / kPkRowBlock, ncb = p.ch_ld / kPkChanBlock;
  const int64_t cb = o % ncb, rb = (o / ncb) % nrb, q = o / (ncb * nrb);
  const unsigned char* x0 = smem + p.h_offset + (a.act_limb[q] * p.rows_ld + rb) * p.row_ld;
  const unsigned char* w0 = smem + p.r_offset + (a.weight_limb[q] * p.ch_ld + cb) * p.row_ld;
  const int64_t xs = nrb * p.row_ld, ws = ncb * p.row_ld;  // bytes between an item's rows, channels
  int32_t acc[kPkRowBlock][kPkChanBlock] = {};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
  for (int64_t k = 0; k < p.K_pad; k += 16) {
    int4 xv[kPkRowBlock], wv[kPkChanBlock];
    QGRU_UNROLL
    for (int i = 0; i < kPkRowBlock; ++i) xv[i] = *(const int4*)(x0 + i * xs + k);
    QGRU_UNROLL
    for (int j = 0; j < kPkChanBlock; ++j) wv[j] = *(const int4*)(w0 + j * ws + k);
    QGRU_UNROLL
    for (int i = 0; i < kPkRowBlock; ++i) {
      QGRU_UNROLL
      for (int j = 0; j < kPkChanBlock; ++j) {
        acc[i][j] = __dp4a(xv[i].x, wv[j].x, acc[i][j]);
        acc[i][j] = __dp4a(xv[i].y, wv[j].y, acc[i][j]);
        acc[i][j] = __dp4a(xv[i].z, wv[j].z, acc[i][j]);
        acc[i][j] = __dp4a(xv[i].w, wv[j].w, acc[i][j]);
      }
    }
  }
#else
  for (int i = 0; i < kPkRowBlock; ++i)
    for (int j = 0; j < kPkChanBlock; ++j)
      for (int64_t k = 0; k < p.K_pad; ++k)
        acc[i][j] += (int32_t)(int8_t)x0[i * xs + k] * (int32_t)(int8_t)w0[j * ws + k];
#endif
  int32_t* out = (int32_t*)(smem + p.acc_offset) + (q * p.rows_ld + rb) * p.ch_ld + cb;
  for (int i = 0; i < kPkRowBlock; ++i)
    for (int j = 0; j < kPkChanBlock; ++j) out[i * nrb * p.ch_ld + j * ncb] = acc[i][j];
}

// The tile's products as qgru_cell.h's LimbProducts (row = tile row, column = local channel).
QGRU_HD LimbProducts pk_limb_products(const PkPlan& p, const PkArgs& a, unsigned char* smem) {
  LimbProducts lp{};
  int32_t* acc = (int32_t*)(smem + p.acc_offset);
  for (int q = 0; q < kMaxPairs; ++q) {
    lp.G[q] = acc + (q < p.P ? q : 0) * p.rows_ld * p.ch_ld;
    lp.scale[q] = q < p.P ? a.scale[q] : 0;
    lp.weight_offset[q] = q < p.P ? a.weight_offset[q] : 0;
  }
  lp.ld = p.ch_ld;
  lp.ones_col = p.ones_local;
  return lp;
}

// The new state of unit j (local u) of row n (tile row r) from the tile's products: the function
// cell_kernel runs (qgru_cell.h gru_cell_at, here on the block-local layout: column u, stride units).
template <int NPAIRS, bool POW2, bool ACC32>
QGRU_HD int64_t pk_cell_value(const CellParams& c, const LimbProducts& lp, int64_t units, int64_t r, int64_t u,
                              int64_t j, const int32_t* d_wx, int64_t q_h) {
  return gru_cell_at<NPAIRS, POW2, ACC32>(c, lp, r, u, units, j, cell32_channel<ACC32>(c, j), d_wx, q_h);
}

// Element e of [rows_tile][units]: the cell of row row0 + e / units, unit b units + e % units, at
// step t (rows past N and units past the block's skip). Writes the state (owned by this element
// alone), out[t] and the limbs of the next step's operand at parity (t + 1) & 1 (a row past its
// length carries its state, and its operand, unchanged into the other buffer).
template <int NPAIRS, bool POW2, bool ACC32>
QGRU_HD void pk_cell(const CellParams& c, const PkPlan& p, const PkArgs& a, unsigned char* smem, int64_t b, int64_t t,
                     int64_t row0, int64_t e) {
  const int64_t r = e / p.units, u = e % p.units, n = row0 + r, j = b * p.units + u;
  if (n >= p.N || j >= p.H || u >= p.units) return;
  const int64_t H = p.H, idx = n * H + j;
  const int32_t q_h = a.state[idx];
  int64_t h_new = q_h;
  if (a.lengths == nullptr || t < a.lengths[n]) {
    const LimbProducts lp = pk_limb_products(p, a, smem);
    h_new = pk_cell_value<NPAIRS, POW2, ACC32>(c, lp, p.units, r, u, j, a.dwx + ((t - a.t0) * p.N + n) * 3 * H, q_h);
    a.state[idx] = (int32_t)h_new;
  }
  a.out[t * p.N * H + idx] = (int16_t)h_new;
  const int64_t g = gemm_operand(c.op, h_new);
  const int64_t next = (t + 1) & 1;
  a.h_buf[pk_h_index(p, next, 0, n, j)] = act_limb(g, a.h_bits, 0);
  if (p.n_act > 1) a.h_buf[pk_h_index(p, next, 1, n, j)] = act_limb(g, a.h_bits, 1);
}
QGRU_HD int64_t pk_cells(const PkPlan& p) { return p.rows_tile * p.units; }

// ---- the whole schedule on the host (tests): what the kernel does, sequentially ----------------
// Steps [t_begin, t_end) of the window at a.t0: per step, every block in `order` (a permutation of
// the blocks: the result must not depend on it) runs its tiles' three phases; the barrier after
// the step is the loop's next iteration. `smem` holds smem_bytes per block (R staged once each).
template <int NPAIRS, bool POW2, bool ACC32>
inline void pk_run_on_host(const CellParams& c, const PkPlan& p, const PkArgs& a, int64_t t_begin, int64_t t_end,
                           const int64_t* order, unsigned char* smem) {
  for (int64_t b = 0; b < p.blocks; ++b)
    for (int64_t w = 0; w < pk_r_words(p); ++w) pk_stage_r(p, a, smem + b * p.smem_bytes, b, w);
  const auto load = [](const int8_t* q) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= (uint32_t)(uint8_t)q[i] << (8 * i);
    return v;
  };
  for (int64_t t = t_begin; t < t_end; ++t)
    for (int64_t i = 0; i < p.blocks; ++i) {
      const int64_t b = order[i];
      unsigned char* s = smem + b * p.smem_bytes;
      for (int64_t tile = 0; tile < p.tiles; ++tile) {
        const int64_t row0 = tile * p.rows_tile;
        for (int64_t w = 0; w < pk_h_words(p); ++w) pk_stage_h(p, a, s, t, row0, w, load);
        for (int64_t o = 0; o < pk_products(p); ++o) pk_product(p, a, s, o);
        for (int64_t e = 0; e < pk_cells(p); ++e) pk_cell<NPAIRS, POW2, ACC32>(c, p, a, s, b, t, row0, e);
      }
    }
}

}  // namespace cuda
}  // namespace qgru
