// One fused step kernel per time step (csrc/qgru_cuda_fused.cu runs it, opt-in: QGRU_CUDA_FUSED=1):
// the R.h product by int8 mma.sync.m16n8k32 with the three gates of a hidden unit in one thread's
// accumulators, then the shared cell (qgru_cell.h gru_cell_acc, the function cell_kernel runs) in
// registers, instead of a cuBLAS GEMM node, a cell node and the Gh int32 round trip between them.
// Plain C++ with QGRU_HD functions and no CUDA header: the fragment maps (which lane holds which
// element of A, B and the accumulators, PTX ISA "Matrix Fragments for mma.m16n8k32", .s8) and the
// schedule (CTAs, warps, n tiles, K split) are compiled for the host by tests/test_cuda_compile.py,
// which emulates the warp's MMA from these maps and checks every accumulator against the exact int8
// product for many shapes. The kernel (qgru_cuda_fused.cu) calls these same functions: the word
// loaders fs_load_a_words / fs_load_b_words (the byte maps' registers, one aligned 32-bit load
// each: tests/test_cuda_fused_compile.py checks them against fs_load_a / fs_load_b), fs_item,
// fs_acc and fs_cell; the FsShape is computed on the host (fs_shape divides in 64 bits).
//
// Layout. CTA c owns hidden units [8c, 8c + 8) (kFsUnits) of all three gates. Its R rows (channels
// q H + j of the [M_pad, K_pad] weight limbs, gate q in r, z, g order) form two m16 tiles:
//   tile 0: rows 0-7 gate r, rows 8-15 gate z of units 8c + 0..7;
//   tile 1: rows 0-7 gate g of those units, rows 8-15 zero (unused).
// With the accumulator layout (c0, c1: row groupID, columns 2t, 2t + 1; c2, c3: row groupID + 8),
// lane (groupID g, threadID_in_group t) holds, over the two tiles, r (tile 0 c0/c1), z (tile 0 c2/c3)
// and g (tile 1 c0/c1) of unit 8c + g for batch rows 8 nt + 2t and 8 nt + 2t + 1 of n tile nt: the
// cell of those two (unit, row) pairs runs in that lane with no exchange. B (the operand, h's int8
// limbs [N, K_pad], row-major) is column-major for the MMA: b0 and b1 are 4 consecutive k of one
// batch row, one 32-bit load each.
//
// Schedule. A CTA has `warps` warps. With nt_count n tiles, the warps split K when there are fewer
// n tiles than warps: k_split = max(1, warps / nt_count) warps share an n tile, warp w taking k
// steps ks, ks + k_split, ... (ks = w % k_split) of n tile w / k_split, then passes of
// warps / k_split n tiles each until every n tile is done. The k_split partial accumulators of an n
// tile are summed (int32, exact: every partial sum of an int8 x int8 product over K < 2^17 terms
// fits) before the cell, by the lane of warp ks = 0.
#pragma once

#include <stdint.h>

#include "qgru_cell.h"

namespace qgru {
namespace cuda {

constexpr int kFsUnits = 8;    // hidden units per CTA: one m16 tile holds two gates of 8 units
constexpr int kFsTiles = 2;    // m16 tiles per CTA: [r | z], [g | 0]
constexpr int kFsMmaK = 32;    // k per mma.sync.m16n8k32
constexpr int kFsMmaN = 8;     // batch rows per n tile

// ---- mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 fragments (PTX ISA), lane = 4 g + t ----
// A (16 x 32, row): 16 int8 per lane, element i of register i / 4 (byte i % 4):
//   row g for i in [0, 4) and [8, 12), g + 8 otherwise; column 4t + (i % 4), + 16 for i >= 8.
QGRU_HD int fs_a_row(int lane, int i) { return (lane >> 2) + (((i >> 2) & 1) ? 8 : 0); }
QGRU_HD int fs_a_k(int lane, int i) { return 4 * (lane & 3) + (i & 3) + (i >= 8 ? 16 : 0); }
// B (32 x 8, col): 8 int8 per lane: k 4t + (i % 4), + 16 for i >= 4; column (batch row) g.
QGRU_HD int fs_b_k(int lane, int i) { return 4 * (lane & 3) + (i & 3) + (i >= 4 ? 16 : 0); }
QGRU_HD int fs_b_n(int lane, int /*i*/) { return lane >> 2; }
// C / D (16 x 8, s32): 4 per lane: row g for i < 2, g + 8 otherwise; column 2t + (i % 2).
QGRU_HD int fs_c_row(int lane, int i) { return (lane >> 2) + (i >= 2 ? 8 : 0); }
QGRU_HD int fs_c_col(int lane, int i) { return 2 * (lane & 3) + (i & 1); }

// The R channel (row of the weight limbs, q H + j) of row m of tile `tile` in CTA `cta`, or -1
// where none (tile 1's rows 8-15, and units past H).
// fs_tile_gate: the gate (0 r, 1 z, 2 g; -1 none) of row m of tile `tile`, whatever the unit.
QGRU_HD int fs_tile_gate(int tile, int m) { return tile == 0 ? (m >> 3) : (m < 8 ? 2 : -1); }
QGRU_HD int64_t fs_tile_channel(int64_t H, int64_t cta, int tile, int m) {
  const int64_t j = cta * kFsUnits + (m & 7);
  if (j >= H) return -1;
  const int gate = fs_tile_gate(tile, m);
  return gate < 0 ? -1 : gate * H + j;
}

// The launch and its loops for a layer of H units, N batch rows and an operand of K_pad int8
// columns (the R.h GEMM's K, zero padded past H), with `warps` warps per CTA.
struct FsShape {
  int64_t H, N, K_pad;
  int64_t ctas;       // ceil(H / kFsUnits)
  int64_t nt_count;   // n tiles: ceil(N / 8)
  int64_t k_steps;    // ceil(K_pad / 32): columns past K_pad read as zero
  int64_t warps, k_split, tiles_per_pass, passes;
};

QGRU_HD FsShape fs_shape(int64_t H, int64_t N, int64_t K_pad, int64_t warps) {
  FsShape s;
  s.H = H;
  s.N = N;
  s.K_pad = K_pad;
  s.ctas = (H + kFsUnits - 1) / kFsUnits;
  s.nt_count = (N + kFsMmaN - 1) / kFsMmaN;
  s.k_steps = (K_pad + kFsMmaK - 1) / kFsMmaK;
  s.warps = warps < 1 ? 1 : warps;
  s.k_split = s.nt_count >= s.warps ? 1 : s.warps / (s.nt_count > 0 ? s.nt_count : 1);
  if (s.k_split > s.k_steps) s.k_split = s.k_steps > 0 ? s.k_steps : 1;  // no warp without a k step
  s.tiles_per_pass = s.warps / s.k_split;
  s.passes = (s.nt_count + s.tiles_per_pass - 1) / s.tiles_per_pass;
  return s;
}

// Warp w's work in pass p: its n tile (-1: none this pass) and first k step; it takes k steps
// ks, ks + k_split, ... < k_steps.
struct FsItem {
  int64_t nt, ks;
};

QGRU_HD FsItem fs_item(const FsShape& s, int64_t warp, int64_t pass) {
  // 32-bit division (warps and k_split are small): a 64-bit one is a called routine on the device
  const int64_t slot = (int)warp / (int)s.k_split, ks = (int)warp % (int)s.k_split;
  if (slot >= s.tiles_per_pass) return {-1, 0};  // warps past the last full group of k_split
  const int64_t nt = pass * s.tiles_per_pass + slot;
  return {nt < s.nt_count ? nt : -1, ks};
}

// Lane `lane`'s A fragment of tile `tile`, k step `kstep` of CTA `cta`: R's int8 weight limbs
// [M_pad, K_pad] (one limb: w8 weights), zero where fs_tile_channel has no channel or k >= K_pad.
QGRU_HD void fs_load_a(const int8_t* R, int64_t K_pad, int64_t H, int64_t cta, int tile, int64_t kstep, int lane,
                       int8_t a[16]) {
  for (int i = 0; i < 16; ++i) {
    const int64_t ch = fs_tile_channel(H, cta, tile, fs_a_row(lane, i));
    const int64_t k = kstep * kFsMmaK + fs_a_k(lane, i);
    a[i] = ch >= 0 && k < K_pad ? R[ch * K_pad + k] : (int8_t)0;
  }
}

// The same fragment as the four 32-bit registers mma.sync takes: register r holds elements
// 4r .. 4r + 3 (byte b: element 4r + b), which the maps put in one row at 4 consecutive k from a
// multiple of 4, so with K_pad a multiple of 4 and R 4-byte aligned each is one aligned word
// load(R + ch K_pad + k) (`load`: a plain or read-only load on the device, memcpy on the host), or 0.
template <typename Load>
QGRU_HD void fs_load_a_words(const int8_t* R, int64_t K_pad, int64_t H, int64_t cta, int tile, int64_t kstep,
                             int lane, uint32_t a[4], Load&& load) {
  QGRU_UNROLL
  for (int r = 0; r < 4; ++r) {
    const int64_t ch = fs_tile_channel(H, cta, tile, fs_a_row(lane, 4 * r));
    const int64_t k = kstep * kFsMmaK + fs_a_k(lane, 4 * r);
    a[r] = ch >= 0 && k < K_pad ? load(R + ch * K_pad + k) : 0u;
  }
}

// Lane `lane`'s B fragment of n tile nt, k step kstep: the operand's int8 limbs [N, K_pad]
// (row n, column k), zero for rows n >= N or k >= K_pad.
QGRU_HD void fs_load_b(const int8_t* h, int64_t K_pad, int64_t N, int64_t nt, int64_t kstep, int lane, int8_t b[8]) {
  for (int i = 0; i < 8; ++i) {
    const int64_t n = nt * kFsMmaN + fs_b_n(lane, i);
    const int64_t k = kstep * kFsMmaK + fs_b_k(lane, i);
    b[i] = n < N && k < K_pad ? h[n * K_pad + k] : (int8_t)0;
  }
}

// The B fragment as mma.sync's two registers (register r: elements 4r .. 4r + 3, one batch row at
// 4 consecutive k from a multiple of 4: one aligned word of the operand, or 0).
template <typename Load>
QGRU_HD void fs_load_b_words(const int8_t* h, int64_t K_pad, int64_t N, int64_t nt, int64_t kstep, int lane,
                             uint32_t b[2], Load&& load) {
  QGRU_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int64_t n = nt * kFsMmaN + fs_b_n(lane, 4 * r);
    const int64_t k = kstep * kFsMmaK + fs_b_k(lane, 4 * r);
    b[r] = n < N && k < K_pad ? load(h + n * K_pad + k) : 0u;
  }
}

// What lane `lane`'s accumulator i of tile `tile` holds after the n tile's k steps: gate (0 r,
// 1 z, 2 g), unit j and batch row n of its (unit, row) pair; gate -1 where nothing (tile 1's
// c2, c3, units past H, rows past N).
struct FsAcc {
  int gate;
  int64_t j, n;
};

QGRU_HD FsAcc fs_acc(const FsShape& s, int64_t cta, int tile, int64_t nt, int lane, int i) {
  const int m = fs_c_row(lane, i);
  const int gate = fs_tile_gate(tile, m);  // (fs_tile_channel's gate and unit, without a division)
  const int64_t j = cta * kFsUnits + (m & 7);
  const int64_t n = nt * kFsMmaN + fs_c_col(lane, i);
  if (gate < 0 || j >= s.H || n >= s.N) return {-1, 0, 0};
  return {gate, j, n};
}

// The cell of one (unit j, row n) pair in the lane that holds its accumulators (one limb pair:
// w8a8's R.h, whose accumulator is the exact product): the shared cell, the same function
// cell_kernel runs on the cuBLAS output. acc: lane's tile 0 c0..c3 (r, r, z, z) and tile 1 c0, c1
// (g, g); p: 0 or 1, the first or second of the lane's two batch rows.
template <bool POW2, bool ACC32>
QGRU_HD int64_t fs_cell(const CellParams& cp, int64_t j, Channel32 ch, const int32_t acc0[4], const int32_t acc1[4],
                        int p, const int32_t* d_wx_row, int64_t q_h) {
  const int64_t H = cp.H;
  return gru_cell_acc<POW2, ACC32>(cp, j, ch, acc0[p], acc0[2 + p], acc1[p], d_wx_row[j], d_wx_row[H + j],
                                   d_wx_row[2 * H + j], q_h);
}

// The end of step t for lane's (unit j, row n) pair p, the kernel's and the host emulation's: a row
// past its length carries its state (out_t = state), else the cell (fs_cell) gives the new state,
// written to state and out_t, and its operand limb (gemm_operand, one limb: h_bits <= 8) to h_out,
// the next step's buffer. A row past its length writes no operand: it stays past its length for
// the rest of the call, so the products of its stale operand are never used (a call starts from
// h0's limbs). state, out_t [N, H]; dwx_t [N, 3H] (Wx - Z_Wx of step t); h_out [N, K_pad]; lengths
// [N] or nullptr.
template <bool POW2, bool ACC32>
QGRU_HD void fs_pair_step(const CellParams& cp, int64_t K_pad, int32_t h_bits, int64_t t, const int64_t* lengths,
                          int64_t j, int64_t n, const int32_t acc0[4], const int32_t acc1[4], int p,
                          const int32_t* dwx_t, int32_t* state, int16_t* out_t, int8_t* h_out) {
  const int64_t H = cp.H, idx = n * H + j;
  const int32_t q_h = state[idx];
  if (lengths != nullptr && t >= lengths[n]) {
    out_t[idx] = (int16_t)q_h;
    return;
  }
  const Channel32 ch = cell32_channel<ACC32>(cp, j);
  const int32_t h_new = (int32_t)fs_cell<POW2, ACC32>(cp, j, ch, acc0, acc1, p, dwx_t + n * 3 * H, q_h);
  state[idx] = h_new;
  out_t[idx] = (int16_t)h_new;
  h_out[n * K_pad + j] = act_limb(gemm_operand(cp.op, h_new), h_bits, 0);
}

// ---- the host emulation (tests: tests/test_cuda_compile.py, tests/cuda_persistent_host.cpp) ----
// The warp's mma.sync.m16n8k32 (s8 x s8 + s32): A and B assembled from the 32 lanes' fragments by
// the maps above, each element from exactly one lane, D = A B + C, scattered back by the
// accumulator map. False where a map is not a bijection (nothing written then).
inline bool fs_mma_emulated(const int8_t a[32][16], const int8_t b[32][8], int32_t c[32][4]) {
  int32_t A[16][32], B[32][8], C[16][8];
  unsigned char seen_a[16][32] = {}, seen_b[32][8] = {}, seen_c[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 16; ++i) {
      const int r = fs_a_row(lane, i), k = fs_a_k(lane, i);
      if (r < 0 || r >= 16 || k < 0 || k >= 32 || seen_a[r][k]++) return false;
      A[r][k] = a[lane][i];
    }
    for (int i = 0; i < 8; ++i) {
      const int k = fs_b_k(lane, i), n = fs_b_n(lane, i);
      if (k < 0 || k >= 32 || n < 0 || n >= 8 || seen_b[k][n]++) return false;
      B[k][n] = b[lane][i];
    }
    for (int i = 0; i < 4; ++i) {
      const int r = fs_c_row(lane, i), n = fs_c_col(lane, i);
      if (r < 0 || r >= 16 || n < 0 || n >= 8 || seen_c[r][n]++) return false;
      C[r][n] = c[lane][i];
    }
  }
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      int32_t acc = C[r][n];
      for (int k = 0; k < 32; ++k) acc += A[r][k] * B[k][n];
      C[r][n] = acc;
    }
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) c[lane][i] = C[fs_c_row(lane, i)][fs_c_col(lane, i)];
  return true;
}

// One step's R.h and cells on the host, as the kernel would run them: every CTA, pass and warp
// (fs_item), its k steps' fragments (fs_load_a of R's limbs [M_pad, K_pad], fs_load_b of the
// operand [N, K_pad]) through the emulated MMA, the k_split partials of each n tile summed into
// its ks = 0 warp, then in each of that warp's lanes cell(j, n, acc0, acc1, p) for its two
// (unit j, row n) pairs p = 0, 1 that exist (acc0, acc1: the lane's tile 0 and tile 1
// accumulators, fs_cell's). False where the maps fail (fs_mma_emulated).
template <typename Cell>
bool fs_step_on_host(const FsShape& s, const int8_t* R, const int8_t* h, Cell&& cell) {
  const int64_t slots = s.warps * kFsTiles * 32 * 4;
  int32_t* acc = new int32_t[(size_t)slots];
  bool ok = true;
  for (int64_t cta = 0; ok && cta < s.ctas; ++cta)
    for (int64_t pass = 0; ok && pass < s.passes; ++pass) {
      for (int64_t i = 0; i < slots; ++i) acc[i] = 0;
      for (int64_t w = 0; ok && w < s.warps; ++w) {
        const FsItem it = fs_item(s, w, pass);
        if (it.nt < 0) continue;
        for (int64_t kstep = it.ks; ok && kstep < s.k_steps; kstep += s.k_split)
          for (int tile = 0; ok && tile < kFsTiles; ++tile) {
            int8_t a[32][16], b[32][8];
            int32_t* c = acc + (w * kFsTiles + tile) * 32 * 4;
            for (int lane = 0; lane < 32; ++lane) {
              fs_load_a(R, s.K_pad, s.H, cta, tile, kstep, lane, a[lane]);
              fs_load_b(h, s.K_pad, s.N, it.nt, kstep, lane, b[lane]);
            }
            ok = fs_mma_emulated(a, b, reinterpret_cast<int32_t(*)[4]>(c));
          }
      }
      for (int64_t w = 0; ok && w < s.warps; ++w) {
        const FsItem it = fs_item(s, w, pass);
        if (it.nt < 0 || it.ks != 0) continue;
        for (int lane = 0; lane < 32; ++lane) {
          int32_t a0[4], a1[4];
          for (int i = 0; i < 4; ++i) {
            int32_t v0 = 0, v1 = 0;
            for (int64_t q = 0; q < s.k_split; ++q) {
              v0 += acc[(((w + q) * kFsTiles + 0) * 32 + lane) * 4 + i];
              v1 += acc[(((w + q) * kFsTiles + 1) * 32 + lane) * 4 + i];
            }
            a0[i] = v0;
            a1[i] = v1;
          }
          for (int p = 0; p < 2; ++p) {
            const FsAcc t = fs_acc(s, cta, 0, it.nt, lane, p);  // tile 0 c_p: gate r of the pair
            if (t.gate == 0) cell(t.j, t.n, a0, a1, p);
          }
        }
      }
    }
  delete[] acc;
  return ok;
}

}  // namespace cuda
}  // namespace qgru
