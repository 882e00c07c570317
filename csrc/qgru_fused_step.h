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
// The persistent fused step (QGRU_CUDA_FUSED=2, fused_persistent_kernel): the same body for every
// step of a window in one launch, R's rows in shared memory, h exchanged by per-CTA step flags; its
// protocol, shared-memory layout and co-residency rule are the fp_ functions below, and
// fp_launch_on_host emulates a whole launch with the CTAs interleaved.
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
// fs_load_a_regs: the same four registers from wherever the CTA's rows are kept: word(tile, m, ch,
// k) returns the aligned word of row m of tile `tile` (R channel ch) at columns k .. k + 3 (the
// fused step: R in global memory; the persistent fused step: its shared-memory copy, fp_r_offset).
template <typename Word>
QGRU_HD void fs_load_a_regs(int64_t K_pad, int64_t H, int64_t cta, int tile, int64_t kstep, int lane, uint32_t a[4],
                            Word&& word) {
  QGRU_UNROLL
  for (int r = 0; r < 4; ++r) {
    const int m = fs_a_row(lane, 4 * r);
    const int64_t ch = fs_tile_channel(H, cta, tile, m);
    const int64_t k = kstep * kFsMmaK + fs_a_k(lane, 4 * r);
    a[r] = ch >= 0 && k < K_pad ? word(tile, m, ch, k) : 0u;
  }
}

template <typename Load>
QGRU_HD void fs_load_a_words(const int8_t* R, int64_t K_pad, int64_t H, int64_t cta, int tile, int64_t kstep,
                             int lane, uint32_t a[4], Load&& load) {
  fs_load_a_regs(K_pad, H, cta, tile, kstep, lane, a,
                 [&](int, int, int64_t ch, int64_t k) { return (uint32_t)load(R + ch * K_pad + k); });
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
// fs_cta_step_on_host: CTA `cta`'s part of it, its A fragments from a_frag(lane, tile, kstep, a[16])
// (the persistent fused step's emulation reads them from its shared-memory copy of the rows).
template <typename AFrag, typename Cell>
bool fs_cta_step_on_host(const FsShape& s, int64_t cta, AFrag&& a_frag, const int8_t* h, Cell&& cell) {
  const int64_t slots = s.warps * kFsTiles * 32 * 4;
  int32_t* acc = new int32_t[(size_t)slots];
  bool ok = true;
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
            a_frag(lane, tile, kstep, a[lane]);
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

template <typename Cell>
bool fs_step_on_host(const FsShape& s, const int8_t* R, const int8_t* h, Cell&& cell) {
  bool ok = true;
  for (int64_t cta = 0; ok && cta < s.ctas; ++cta)
    ok = fs_cta_step_on_host(
        s, cta, [&](int lane, int tile, int64_t kstep, int8_t a[16]) { fs_load_a(R, s.K_pad, s.H, cta, tile, kstep, lane, a); },
        h, [&](int64_t j, int64_t n, const int32_t* a0, const int32_t* a1, int p) { cell(j, n, a0, a1, p); });
  return ok;
}

// ---- the persistent fused step (csrc/qgru_cuda_fused.cu fused_persistent_kernel, QGRU_CUDA_FUSED=2) ----
// One launch runs the steps [t0, t1) of a W.x window. Each CTA (the fused step's: 8 units, the same
// schedule, fragments and cell, fused_step_body) copies its R rows into shared memory once, in the
// prologue, and keeps them there for the whole launch. The CTAs exchange h without an atomic and
// without a barrier counter:
// * the operand is double-buffered by step parity: step t reads h_buf[fp_in_parity(t)] (h_t) and
//   writes its units' limbs of h_{t+1} into h_buf[fp_out_parity(t)];
// * one flag word per CTA (fp_flag_index: a 128-byte line each), zeroed once per call (a memset
//   before the call's first launch; the flags then run on over the call's windows, never reset):
//   after step t a CTA's stores of h_{t+1} (its 8 columns of every row), a __syncthreads, then one
//   thread's fence and st.release.gpu of fp_flag_after(t) = t + 1 into its flag;
// * before step t every CTA waits until every CTA's flag is at least fp_flag_needed(t) = t (its
//   threads poll the flags with ld.acquire.gpu, then a __syncthreads), then reads h_t with
//   L2-only loads (ld.global.cg). Every CTA reads all of h_t (all K columns), so it waits on every
//   flag; that wait also proves that every CTA finished step t - 1, its last read of
//   h_buf[fp_out_parity(t)], before the CTA overwrites it: the double buffer is enough.
// Flags only grow within a call, so while a CTA waits at step t every flag is in [t - 1, t + 1]
// (no CTA can finish step t + 1 before this one has published t + 1).
// Co-residency: every CTA spins on the others, so all must be resident at once: the launch is
// cooperative (a grid that is not co-resident is a launch error, never a hang) and is planned only
// where ctas <= SMs x the occupancy API's blocks per SM at the layout's shared memory (fp_fit);
// anywhere else the layer runs the fused step of stage 1, and fp_fit's code says why.
constexpr int64_t kFpFlagStride = 32;  // uint32 words from one CTA's flag to the next: 128 bytes
constexpr int kFpRows = 24;            // rows kept in shared memory: gates r, z (tile 0), g (tile 1)

QGRU_HD int64_t fp_flag_index(int64_t cta) { return cta * kFpFlagStride; }
QGRU_HD int64_t fp_flag_words(int64_t ctas) { return ctas * kFpFlagStride; }
QGRU_HD int fp_in_parity(int64_t t) { return (int)(t & 1); }
QGRU_HD int fp_out_parity(int64_t t) { return (int)((t + 1) & 1); }
QGRU_HD uint32_t fp_flag_after(int64_t t) { return (uint32_t)(t + 1); }
QGRU_HD uint32_t fp_flag_needed(int64_t t) { return (uint32_t)t; }  // step 0: h0, written before the launch
QGRU_HD bool fp_flag_ready(uint32_t flag, int64_t t) { return flag >= fp_flag_needed(t); }

// Shared memory of one CTA: its 24 R rows [kFpRows][r_ld] (row 8 q + u: gate q of unit 8 cta + u,
// zero for units past H; bytes k >= K_pad zero), then the split-K partials [warps][kFsTiles][4][32]
// int32. r_ld = the least length >= K_pad with r_ld = 16 (mod 128): the 8 rows a fragment register
// reads (groupID g) start 4 banks apart, and its threadID_in_group t adds one bank, so the 32
// lanes' words of every A register fall in 32 different banks.
struct FpLayout {
  int64_t r_ld, r_words, part_offset, part_bytes, bytes;
};

QGRU_HD FpLayout fp_layout(int64_t K_pad, int64_t warps) {
  FpLayout L;
  L.r_ld = (K_pad + 127 - 16) / 128 * 128 + 16;
  L.r_words = kFpRows * L.r_ld / 4;
  L.part_offset = kFpRows * L.r_ld;  // a multiple of 16
  L.part_bytes = warps * kFsTiles * 4 * 32 * 4;
  L.bytes = L.part_offset + L.part_bytes;
  return L;
}

// The shared-memory row of row m of tile `tile` (-1: tile 1's rows 8-15, never kept: always zero).
QGRU_HD int fp_smem_row(int tile, int m) { return tile == 0 ? m : (m < 8 ? 16 + m : -1); }
// The byte offset of the word at columns k .. k + 3 of that row (the kernel's A loads).
QGRU_HD int64_t fp_r_offset(const FpLayout& L, int tile, int m, int64_t k) { return fp_smem_row(tile, m) * L.r_ld + k; }
// The prologue's copy: where shared word w (of L.r_words) comes from, a byte offset into R's limbs
// [M_pad, K_pad] (an aligned word), or -1 where it is zero (units past H, k >= K_pad). 32-bit
// division: w < 2^31 (r_words is at most the shared memory's words).
QGRU_HD int64_t fp_stage_source(const FpLayout& L, int64_t H, int64_t K_pad, int64_t cta, int64_t w) {
  const int row_words = (int)(L.r_ld / 4), row = (int)w / row_words;
  const int64_t k = 4 * (int64_t)((int)w - row * row_words);
  const int tile = row < 16 ? 0 : 1, m = row < 16 ? row : row - 16;
  const int64_t ch = fs_tile_channel(H, cta, tile, m);
  return ch >= 0 && k < K_pad ? ch * K_pad + k : -1;
}

// Why a layer runs (kFpFits) or not (the fused step of stage 1 then runs) the persistent fused step
// for a batch: the Layer's counter fused_persistent_reason holds the last refusal's code.
enum FpFit {
  kFpFits = 0,
  kFpNotFused = 1,        // the layer does not take the fused step (fused_supported)
  kFpNoCooperative = 2,   // the device cannot launch cooperatively (or a CUDA runtime before 12)
  kFpNoSharedMemory = 3,  // the layout's shared memory exceeds the device's opt-in amount per block
  kFpNotCoResident = 4,   // more CTAs than SMs x resident blocks per SM (the occupancy API)
  kFpInCapture = 5,       // a batch size first seen inside a caller's graph capture (no occupancy query there)
  kFpNoFlagRoom = 6,      // the flags do not fit the buffer that holds them (qgru_cuda.cpp)
};

struct FpDevice {
  int64_t sm_count, smem_optin, blocks_per_sm;  // blocks_per_sm: the occupancy API's, at L.bytes
  bool cooperative;
};

// A layer's persistent fused-step plan for a batch (s.ctas == 0: none; fused_persistent_plan).
struct FpPlan {
  FsShape s;
  FpLayout L;
  int64_t sm_count, blocks_per_sm;
};

QGRU_HD int fp_fit(const FsShape& s, const FpLayout& L, const FpDevice& d) {
  if (!d.cooperative) return kFpNoCooperative;
  if (L.bytes > d.smem_optin) return kFpNoSharedMemory;
  if (s.ctas > d.sm_count * d.blocks_per_sm) return kFpNotCoResident;
  return kFpFits;
}

// ---- the persistent launch on the host (tests: tests/cuda_persistent_host.cpp run_fused_persistent) ----
// Each CTA is a machine of four phases per step, the kernel's order: wait (runnable once every
// flag is fp_flag_ready), read (its accumulators from its shared rows, staged by fp_stage_source
// into a buffer of stale bytes, and from h_buf[fp_in_parity(t)]), write (cell(t, j, n, a0, a1, p,
// h_out) for its pairs, h_out = h_buf[fp_out_parity(t)]), publish (its flag = fp_flag_after(t)).
// A scheduler picks which runnable CTA moves one phase (FpOrder): in index order, reversed,
// at random, the most advanced first (one CTA runs ahead as far as the protocol lets it), the
// least advanced first, or CTA 0 only when nothing else can move (a slow SM). The emulation
// checks, besides the integers the caller compares with the golden model: every read finds h_t
// (each CTA's slice of the buffer last written for step t), every write overwrites a slice no CTA
// still has to read, and no CTA waits forever (a deadlock). `fault` breaks the protocol on purpose
// (the tests show that these checks catch it): 1 wait for one step less, 2 one buffer for both
// parities, 3 publish before the writes.
enum FpOrder { kFpInOrder = 0, kFpReversed = 1, kFpRandom = 2, kFpAheadFirst = 3, kFpBehindFirst = 4, kFpSlowCta0 = 5 };
enum FpEmuResult { kFpEmuOk = 0, kFpEmuDeadlock = 1, kFpEmuStaleRead = 2, kFpEmuOverwrite = 3, kFpEmuMaps = 4 };

// What persists between the launches of a call: the slices' versions (which h_t each CTA's slice
// of each buffer holds) and each CTA's last step read. fp_emu_begin_call: h0 in buffer 0.
struct FpEmuState {
  int64_t ctas = 0;
  int64_t* version = nullptr;    // [2][ctas]
  int64_t* read_done = nullptr;  // [ctas]
  uint32_t rng = 1;
  FpEmuState(const FpEmuState&) = delete;
  FpEmuState& operator=(const FpEmuState&) = delete;
  explicit FpEmuState(int64_t c, uint32_t seed) : ctas(c), rng(seed * 2654435761u + 1u) {
    version = new int64_t[(size_t)(2 * c)];
    read_done = new int64_t[(size_t)c];
    for (int64_t i = 0; i < c; ++i) version[i] = 0, version[c + i] = -1, read_done[i] = -1;
  }
  ~FpEmuState() {
    delete[] version;
    delete[] read_done;
  }
};

template <typename Cell>
int fp_launch_on_host(const FsShape& s, const FpLayout& L, const int8_t* R, int8_t* const h_buf[2], uint32_t* flags,
                      int64_t t0, int64_t t1, int order, int fault, FpEmuState& st, Cell&& cell) {
  const int64_t C = s.ctas;
  const int64_t pairs_max = s.nt_count * kFsMmaN * kFsUnits;  // a CTA's (unit, row) pairs, at most
  struct Pending {
    int64_t j, n;
    int32_t a0[4], a1[4];
    int p;
  };
  unsigned char* smem = new unsigned char[(size_t)(C * L.bytes)];
  Pending* pend = new Pending[(size_t)(C * pairs_max)];
  int64_t* npend = new int64_t[(size_t)C];
  int64_t* t = new int64_t[(size_t)C];
  int* phase = new int[(size_t)C];
  unsigned char* can = new unsigned char[(size_t)C];
  int rc = kFpEmuOk;
  const auto in_par = [&](int64_t u) { return fault == 2 ? 0 : fp_in_parity(u); };
  const auto out_par = [&](int64_t u) { return fault == 2 ? 0 : fp_out_parity(u); };
  const auto ready = [&](uint32_t v, int64_t u) { return fault == 1 ? v + 1 >= fp_flag_needed(u) : fp_flag_ready(v, u); };
  for (int64_t c = 0; c < C; ++c) {  // the prologue: shared memory of stale bytes, then the copy
    unsigned char* sm = smem + c * L.bytes;
    for (int64_t b = 0; b < L.bytes; ++b) sm[b] = 0xA5;
    for (int64_t w = 0; w < L.r_words; ++w) {
      const int64_t src = fp_stage_source(L, s.H, s.K_pad, c, w);
      for (int b = 0; b < 4; ++b) sm[4 * w + b] = src >= 0 ? (unsigned char)R[src + b] : 0;
    }
    t[c] = t0, phase[c] = 0, npend[c] = 0;
    if (t0 >= t1) phase[c] = 4;
  }
  for (;;) {
    int64_t runnable = 0, done = 0;
    for (int64_t c = 0; c < C; ++c) {
      bool ok = phase[c] != 4;
      done += !ok;
      if (ok && phase[c] == 0)
        for (int64_t q = 0; ok && q < C; ++q) ok = ready(flags[fp_flag_index(q)], t[c]);
      can[c] = ok;
      runnable += ok;
    }
    if (done == C) break;
    if (runnable == 0) {
      rc = kFpEmuDeadlock;
      break;
    }
    int64_t pick = -1;
    const auto prog = [&](int64_t c) { return 4 * t[c] + phase[c]; };
    if (order == kFpRandom) {
      st.rng = st.rng * 1103515245u + 12345u;
      int64_t k = (int64_t)((st.rng >> 8) % (uint32_t)runnable);
      for (int64_t c = 0; c < C; ++c)
        if (can[c] && k-- == 0) pick = c;
    } else {
      for (int64_t i = 0; i < C; ++i) {
        const int64_t c = order == kFpReversed ? C - 1 - i : (order == kFpSlowCta0 ? (i + 1) % C : i);
        if (!can[c]) continue;
        if (pick < 0 || (order == kFpAheadFirst && prog(c) > prog(pick)) ||
            (order == kFpBehindFirst && prog(c) < prog(pick)))
          pick = c;
      }
    }
    const int64_t c = pick, u = t[c];
    const int ph = phase[c];
    // the phase order: wait, read, write, publish (fault 3: wait, read, publish, write)
    const bool write_now = fault == 3 ? ph == 3 : ph == 2, publish_now = fault == 3 ? ph == 2 : ph == 3;
    if (ph == 1) {  // read h_t: every CTA's slice must hold it
      for (int64_t q = 0; q < C; ++q)
        if (st.version[in_par(u) * C + q] != u) rc = kFpEmuStaleRead;
      if (rc != kFpEmuOk) break;
      const unsigned char* sm = smem + c * L.bytes;
      npend[c] = 0;
      const bool ok = fs_cta_step_on_host(
          s, c,
          [&](int lane, int tile, int64_t kstep, int8_t a[16]) {
            uint32_t w[4];  // the kernel's A loads, from the shared copy
            fs_load_a_regs(s.K_pad, s.H, c, tile, kstep, lane, w, [&](int tl, int m, int64_t, int64_t k) {
              const int64_t off = fp_r_offset(L, tl, m, k);
              return (uint32_t)sm[off] | (uint32_t)sm[off + 1] << 8 | (uint32_t)sm[off + 2] << 16 |
                     (uint32_t)sm[off + 3] << 24;
            });
            for (int i = 0; i < 16; ++i) a[i] = (int8_t)(uint8_t)(w[i / 4] >> (8 * (i % 4)));
          },
          h_buf[in_par(u)], [&](int64_t j, int64_t n, const int32_t* a0, const int32_t* a1, int p) {
            Pending& e = pend[c * pairs_max + npend[c]++];
            e.j = j, e.n = n, e.p = p;
            for (int i = 0; i < 4; ++i) e.a0[i] = a0[i], e.a1[i] = a1[i];
          });
      if (!ok) {
        rc = kFpEmuMaps;
        break;
      }
      st.read_done[c] = u;
    } else if (write_now) {  // h_{u+1} into the other buffer: no CTA may still need what it held
      for (int64_t q = 0; q < C; ++q)
        if (st.read_done[q] < u - 1 || (out_par(u) == in_par(u) && st.read_done[q] < u)) rc = kFpEmuOverwrite;
      if (rc != kFpEmuOk) break;
      for (int64_t e = 0; e < npend[c]; ++e) {
        const Pending& x = pend[c * pairs_max + e];
        cell(u, x.j, x.n, x.a0, x.a1, x.p, h_buf[out_par(u)]);
      }
      st.version[out_par(u) * C + c] = u + 1;
    } else if (publish_now) {
      flags[fp_flag_index(c)] = fp_flag_after(u);
    }
    if (++phase[c] == 4) {
      phase[c] = ++t[c] < t1 ? 0 : 4;
    }
  }
  delete[] smem;
  delete[] pend;
  delete[] npend;
  delete[] t;
  delete[] phase;
  delete[] can;
  return rc;
}

}  // namespace cuda
}  // namespace qgru
