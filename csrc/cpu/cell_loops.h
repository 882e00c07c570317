// The CPU backend's pointwise loops, compiled once per instruction-set path: each kernel_*.cpp
// includes this file after setting its target and its QGRU_ISA namespace, and points its Kernels
// table at cell_rows / cell_tile / requant_rows / to_act below. The arithmetic is qgru_cell.h's
// (the functions the CUDA backend runs too); these loops only arrange it so that the compiler
// vectorises it for the path's instruction set.
//
// Include only from a kernel file (it defines functions, not just declarations).
#pragma once

#include "kernels.h"

namespace qgru {
namespace cpu {
QGRU_ISA_BEGIN

#if defined(__GNUC__)
#define QGRU_NOINLINE __attribute__((noinline))
#else
#define QGRU_NOINLINE
#endif

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// One step of channels [j0, j1) of batch row n: state s is read and overwritten, o gets a copy.
// A separate, never inlined function with restrict pointers and by-value parameters: inlined into
// its caller, gcc loses sight of the copies and falls back to scalar table loads (measured 2x slower).
template <int NP, bool POW2, bool ACC32>
QGRU_NOINLINE void cell_block(const CellParams p, const LimbProducts lp, int64_t n, int64_t j0, int64_t j1,
                              const int32_t* __restrict wx, int32_t* __restrict s, int32_t* __restrict o) {
  // channel j's int32 fields are at fields + (j - j0): one pointer, every field at a fixed offset
  const int32_t* fields = cell32_channel<ACC32>(p, j0).at;
#pragma omp simd
  for (int64_t j = j0; j < j1; ++j) {
    const Channel32 ch{ACC32 ? fields + (j - j0) : nullptr};
    const int32_t h_new = (int32_t)gru_cell<NP, POW2, ACC32>(p, lp, n, j, ch, wx, s[j]);
    s[j] = h_new;
    o[j] = h_new;
  }
}

// LimbRequant32's requantization of one two-pair product (kernels.h gives the identity and bounds):
// q - Z of Wx or Rh from the lo and hi limbs' sums g0, g1 and the activation row's sum rs.
QGRU_HD QGRU_INLINE int32_t requant_limbs32(int32_t g0, int32_t g1, int32_t rs, int32_t bias_hi, int32_t bias_lo, int32_t R,
                                    int32_t zp, int32_t lo, int32_t hi) {
  const int32_t m8 = shl32(1, R - 8) - 1, m0 = shl32(1, R) - 1, m7 = shl32(1, R - 7) - 1;
  const int32_t q = (g1 >> (R - 8)) + (g0 >> R) + (rs >> (R - 7)) + bias_hi;
  const int32_t rem = shl32(g1 & m8, 8) + (g0 & m0) + shl32(rs & m7, 7) + bias_lo;
  const int32_t v = q + (rem >> R);
  return clamp32(((v + 1) >> 1) + zp, lo, hi) - zp;
}

// requant_limbs32 over channels [c0, c1) of row r's two limb products into o[c - c0]; the bias and
// shift arrays at offset `off` (a row's x level), the zero points at c.
QGRU_NOINLINE inline void requant_limbs32_row(const LimbRequant32 l, int64_t off, const LimbProducts lp, int64_t r,
                                              int64_t c0, int64_t c1, int32_t* __restrict o) {
  const int32_t* __restrict g0 = lp.G[0] + r * lp.ld;
  const int32_t* __restrict g1 = lp.G[1] + r * lp.ld;
  const int32_t rs = g0[lp.ones_col];
  const int32_t* __restrict bh = l.bias_hi + off;
  const int32_t* __restrict bl = l.bias_lo + off;
  const int32_t* __restrict sh = l.rshift + off;
  const int32_t* __restrict zp = l.zp;
  const int32_t lo = l.lo, hi = l.hi;
#pragma omp simd
  for (int64_t c = c0; c < c1; ++c) o[c - c0] = requant_limbs32(g0[c], g1[c], rs, bh[c], bl[c], sh[c], zp[c], lo, hi);
}

// cell_block's hybrid form (CellRowsArgs.hybrid): each gate's R.h exact product (NP limb pairs, int64)
// requantized in int64 (requantize_acc), or with L32 (two pairs, pow2) in int32 (requant_limbs32),
// then the gates and the new state in the int32 cell (gru_cell32_d) from the channel's int32 fields.
template <int NP, bool POW2, bool L32>
QGRU_NOINLINE void cell_block_hybrid(const CellParams p, const LimbProducts lp, const LimbRequant32 l32, int64_t n,
                                     int64_t j0, int64_t j1, const int32_t* __restrict wx, int32_t* __restrict s,
                                     int32_t* __restrict o) {
  const int32_t* fields = channel32(p.c32.channels, j0).at;
  const int64_t H = p.H;
  int32_t d_rh[3][kCell32Block];
  for (int q = 0; q < 3; ++q) {
    if constexpr (L32) {
      requant_limbs32_row(l32, 0, lp, n, q * H + j0, q * H + j1, d_rh[q]);
      continue;
    }
#pragma omp simd
    for (int64_t j = j0; j < j1; ++j)
      d_rh[q][j - j0] = (int32_t)requantize_acc<POW2>(p.rh, q * H + j, exact_product<NP>(lp, n, q * H + j));
  }
#pragma omp simd
  for (int64_t j = j0; j < j1; ++j) {
    const Channel32 ch{fields + (j - j0)};
    const int64_t i = j - j0;
    const int32_t h_new = gru_cell32_d<POW2>(p.c32, ch, d_rh[0][i], d_rh[1][i], d_rh[2][i], wx[j], wx[H + j],
                                             wx[2 * H + j], s[j]);
    s[j] = h_new;
    o[j] = h_new;
  }
}

// The R.h operand of the states s[0 .. n) (gemm_operand, for a layer with an h_gemm): in int32
// lanes with the int32 cell's fields (acc32), else in int64.
QGRU_NOINLINE inline void operand_of(const CellParams& p, int pow2, int acc32, const int32_t* __restrict s, int64_t n,
                                     int32_t* __restrict d) {
  const Cell32 c = p.c32;
  if (acc32 && pow2) {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) d[k] = gemm_operand32<true>(c, s[k]);
  } else if (acc32) {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) d[k] = gemm_operand32<false>(c, s[k]);
  } else {
    for (int64_t k = 0; k < n; ++k) d[k] = (int32_t)gemm_operand(p.op, s[k]);
  }
}

// Activation limbs of rows of states as the R.h operand, in blocks of kCell32Block values.
template <typename A>
void operand_limbs(const CellParams& p, int pow2, int acc32, const int32_t* s, int64_t n, int bits, int n_limbs,
                   int direct, void* const* dst, int64_t offset);

// Activation limb i of the values v[0 .. n) (act_limb; direct: the value itself as int16).
template <typename A>
QGRU_NOINLINE void limbs_of(const int32_t* __restrict v, int64_t n, int bits, int i, int direct, A* __restrict d) {
  if (direct || bits <= 8) {  // constant arguments: gcc vectorizes this loop (the general one stays scalar)
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) d[k] = (A)v[k];
    return;
  }
  for (int64_t k = 0; k < n; ++k) d[k] = (A)act_limb(v[k], bits, i);
}

template <typename A>
void operand_limbs(const CellParams& p, int pow2, int acc32, const int32_t* s, int64_t n, int bits, int n_limbs,
                   int direct, void* const* dst, int64_t offset) {
  int32_t op[kCell32Block];
  for (int64_t j0 = 0; j0 < n; j0 += kCell32Block) {
    const int64_t nj = min64(n - j0, kCell32Block);
    operand_of(p, pow2, acc32, s + j0, nj, op);
    for (int i = 0; i < n_limbs; ++i) limbs_of<A>(op, nj, bits, i, direct, static_cast<A*>(dst[i]) + offset + j0);
  }
}

template <typename A>
void to_act_t(const ToActArgs& a) {
  for (int64_t r = a.r0; r < a.r1; ++r) {
    if (a.cell != nullptr && a.cell->op.on) {
      operand_limbs<A>(*a.cell, a.pow2, a.acc32, a.src + r * a.K, a.K, a.bits, a.n_limbs, a.direct, a.dst, r * a.ld);
      continue;
    }
    for (int i = 0; i < a.n_limbs; ++i)
      limbs_of<A>(a.src + r * a.K, a.K, a.bits, i, a.direct, static_cast<A*>(a.dst[i]) + r * a.ld);
  }
}

template <typename A>
void cell_rows_t(const CellRowsArgs& a) {
  const int64_t H = a.p->H;
  for (int64_t n = a.n0; n < a.n1; ++n) {
    int32_t* s = a.state + n * H;
    int32_t* o = a.out + n * H;
    if (a.lengths != nullptr && a.t >= a.lengths[n]) {  // padding: the state is carried unchanged
      for (int64_t j = 0; j < H; ++j) o[j] = s[j];
      continue;
    }
    for (int64_t j0 = 0; j0 < H; j0 += kCell32Block) {
      const int64_t j1 = min64(H, j0 + kCell32Block);
      const int32_t* dwx = a.dwx + n * 3 * H;
      if (a.hybrid && a.l32 != nullptr && a.np == 2) {
        cell_block_hybrid<2, true, true>(*a.p, *a.rh, *a.l32, n, j0, j1, dwx, s, o);
        continue;
      }
      if (a.hybrid) {
        dispatch_kernel(a.np, a.pow2, false, [&](auto np, auto pow2, auto) {
          cell_block_hybrid<np.value, pow2.value, false>(*a.p, *a.rh, LimbRequant32{}, n, j0, j1, dwx, s, o);
        });
        continue;
      }
      dispatch_kernel(a.np, a.pow2, a.acc32, [&](auto np, auto pow2, auto acc32) {
        cell_block<np.value, pow2.value, acc32.value>(*a.p, *a.rh, n, j0, j1, dwx, s, o);
      });
    }
    if (a.p->op.on) {  // the next step's R.h operand: h_gemm from the state
      operand_limbs<A>(*a.p, a.pow2, a.acc32, s, H, a.h_bits, a.n_h_limbs, a.h_direct, a.h_limbs, n * a.lda);
      continue;
    }
    for (int i = 0; i < a.n_h_limbs; ++i)
      limbs_of<A>(s, H, a.h_bits, i, a.h_direct, static_cast<A*>(a.h_limbs[i]) + n * a.lda);
  }
}

// The fused path's cells of one task: rows x nj elements (batch rows n0 + r, channels j0 + c; j0
// a multiple of kCell32Block, nj <= kTaskUnits) from the three gates' R.h tiles acc_h
// ([3][16][kTaskUnits] int32, gate q's at acc_h + q gs) and their W.x: with XACC the W.x tiles x
// (same layout, requantized here), else the rows' Wx - Z_Wx x ([rows, 3H]). Rows past their
// sequence length carry their state. Pointers are at row n0; s, o have row stride H; h_in / h_out,
// the h of this step and the next as one activation limb (h and R of at most 8 bits, or h taken
// whole as int16), stride lda.
// All rows in one call, the row loops around the channel loops: per row calls of the same loops
// paid their start-up (setup, pipeline fill) for every 128 elements; measured ~15% of the cell.
// With XACC, row r's W.x is requantized on its x level (level[r]; nullptr: level 0), from wx / wx32
// moved to that level (at_level).
// WIDE (with ACC32; CellTileArgs.wide, issue 40: w8a16 on the int16 GEMMs): a 16-bit x or h taken
// whole, so the accumulators may use all 31 bits and are requantized with requant_wide32
// (qgru_cell.h, "Wide accumulators"), not requant32; everything after that is the same cell.
template <bool WIDE, bool POW2, typename V>
QGRU_INLINE V requant_acc32_at(Channel32 ch, int group, int q, V v) {
  if constexpr (WIDE) return requant_wide32_at<POW2, V>(ch, group, q, v);
  else return requant32_at<POW2, V>(ch, group, q, v);
}

template <bool WIDE, bool POW2, typename V>
QGRU_INLINE V requant_acc32_flat(const AccRequant32& a, int64_t c, V v) {
  if constexpr (WIDE) return requant_wide32_flat<POW2, V>(a, c, v);
  else return requant32_flat<POW2, V>(a, c, v);
}

template <bool POW2, bool ACC32, bool XACC, typename A, bool WIDE = false>
QGRU_NOINLINE void cell_tile(const CellParams& p, const AccRequant& wx, const AccRequant32& wx32,
                             const int32_t* __restrict level, bool level0_static, int64_t j0, int64_t nj,
                             int64_t rows,
                             const uint8_t* __restrict active, const int32_t* __restrict x,
                             const int32_t* __restrict acc_h, int32_t* __restrict s, int32_t* __restrict o,
                             const A* __restrict h_in, A* __restrict h_out, int64_t lda, float* __restrict y,
                             double y_scale, double y_zp) {
  constexpr int64_t W = kTaskUnits, gs = kTileRows * W;  // gs: from one gate's tile rows to the next's
  const int64_t H = p.H;
#if defined(QGRU_CELL_LANES)
  using VL = QGRU_CELL_LANES;
  constexpr int64_t L = VL::kLanes;
  const int64_t nv = ACC32 ? nj / L * L : 0;  // channels the int32 cell runs in the path's explicit vectors
#else
  const int64_t nv = 0;
#endif
  // gate q of row r, channel c: W.x at x[r * xr + q * xs + c], R.h at acc_h[r * W + q * gs + c]
  const int64_t xs = XACC ? gs : H, xr = XACC ? W : 3 * H;
  if (!XACC) x += j0;
  s += j0;  // row r's state and output channel c: s[r * H + c], o[r * H + c] (or y[r * H + c])
  const bool int_out = o != nullptr;
  if (int_out) o += j0;
  if constexpr (ACC32) {
    const Cell32 c32 = p.c32;
    const int32_t* fields = cell32_channel<ACC32>(p, j0).at;  // channel j0 + c's at fields + c
    // W.x of gate q at channel j0 + c: a row without levels from the channel's blocked fields (ch), a
    // row of a layer with x levels (LV) from the flat arrays at its level (wl: wx32 at the row's level)
    const auto d_wx = [&](auto lv, const AccRequant32& wl, Channel32 ch, int q, int64_t c, auto v) QGRU_INLINE {
      if constexpr (!XACC) return v;
      else if constexpr (decltype(lv)::value) return requant_acc32_flat<WIDE, POW2, decltype(v)>(wl, q * H + j0 + c, v);
      else return requant_acc32_at<WIDE, POW2, decltype(v)>(ch, kWxRequant, q, v);
    };
    // Rh - Z_Rh of gate q from its R.h accumulator
    const auto d_rh = [&](Channel32 ch, int q, auto v) QGRU_INLINE {
      return requant_acc32_at<WIDE, POW2, decltype(v)>(ch, kRhRequant, q, v);
    };
    // Three passes over the tile, each a short loop: the gates' pre-activations r and z; their
    // table lookups and g's pre-activation; g's lookup and the new state. A table lookup waits
    // on an index, then on a load, then on the interpolation: in one long loop body with the
    // rescales around it few iterations fit in flight and the core waits on each chain; as a loop
    // of its own the lookups of many iterations overlap. (Two loops, r and z then g and h, had
    // measured ~15% faster than one on the AMX machine; four took the cell's samples per GEMM
    // sample from 0.234-0.236 to 0.196-0.228 on a Zen 3 EPYC, avx2 layer T=100 N=64, perf.)
    // A lookup's index must come from memory a previous pass wrote (lookup32_at: scalar loads of
    // values just stored from a register wait on store forwarding), so each pass that looks up
    // reads the previous pass's values; the r and z lookups share their pass with g's pre-activation,
    // whose vector arithmetic overlaps their scalar loads (four passes, one for the r and z lookups
    // alone, measured 4% slower: Zen 4, 16,64,32,100 w8a8).
    alignas(64) int32_t d_r[kTileRows * W], d_z[kTileRows * W], g_pre[kTileRows * W];  // row r's at [r * W]
    const auto rz_pre = [&](auto lanes, auto lv, const AccRequant32& wl, int64_t rx, int64_t rh, int64_t, int64_t c) QGRU_INLINE {
      using V = decltype(lanes);
      const Channel32 ch{fields + c};
      lanes_store(d_r + rh + c, sigmoid_pre32_d<POW2, V>(c32, ch, 0, d_rh(ch, 0, lanes_load<V>(acc_h + rh + c)),
                                                         d_wx(lv, wl, ch, 0, c, lanes_load<V>(x + rx + c))));
      lanes_store(d_z + rh + c, sigmoid_pre32_d<POW2, V>(c32, ch, 1, d_rh(ch, 1, lanes_load<V>(acc_h + rh + gs + c)),
                                                         d_wx(lv, wl, ch, 1, c, lanes_load<V>(x + rx + xs + c))));
    };
    // rz_table and g_preact in one pass (r's table output straight into g's pre-activation): the
    // lookups' scalar loads and g_preact's vector arithmetic overlap
    const auto rz_table_g_preact = [&](auto lanes, auto lv, const AccRequant32& wl, int64_t rx, int64_t rh, int64_t,
                                       int64_t c) QGRU_INLINE {
      using V = decltype(lanes);
      const Channel32 ch{fields + c};
      const V d_r_c = lookup32_at<V>(c32.table[0], d_r + rh + c);
      lanes_store(d_z + rh + c, lookup32_at<V>(c32.table[1], d_z + rh + c));
      const V d_rh_g = d_rh(ch, 2, lanes_load<V>(acc_h + rh + 2 * gs + c));
      lanes_store(g_pre + rh + c, candidate_pre32_d<POW2, V>(
                                      c32, ch, d_rh_g, d_wx(lv, wl, ch, 2, c, lanes_load<V>(x + rx + 2 * xs + c)), d_r_c));
    };
    // g's lookup, the new state, and (explicit lanes only, see the loops after the passes) what the
    // step hands on from it: the next step's R.h operand (h_out: h_gemm, or h itself) and the floats
    const bool op_on = p.op.on != 0;
    const auto h_step = [&](auto lanes, auto, const AccRequant32&, int64_t, int64_t rh, int64_t rs, int64_t c) QGRU_INLINE {
      using V = decltype(lanes);
      const V h_new = new_state32<POW2, V>(c32, lookup32_at<V>(c32.table[2], g_pre + rh + c),
                                           lanes_load<V>(d_z + rh + c), lanes_load<V>(s + rs + c));
      lanes_store(s + rs + c, h_new);
      if (int_out) lanes_store(o + rs + c, h_new);
      if constexpr (!std::is_same<V, int32_t>::value) {
        lanes_store_act(h_out + (rh / W) * lda + j0 + c, op_on ? gemm_operand32<POW2, V>(c32, h_new) : h_new);
        if (y != nullptr) lanes_store_floats(y + j0 + rs + c, h_new, y_scale, y_zp);
      }
    };
    // One pass: body(lanes, lv, wl, rx, rh, rs, c) on every active row's channels, the path's
    // explicit vector (csrc/cpu/lanes_*.h) over whole groups of its lanes, int32_t lanes (the
    // compiler's vectors) over the rest; lv (a type: true for a layer with x levels, XACC) and wl,
    // the row's W.x requantization at its level. A layer without levels keeps reading W.x's fields
    // from the blocked array (the flat arrays' extra base pointers measured ~4% of a T=100 N=64 call).
    const auto row_pass = [&](auto lv, auto body, int64_t r) {
      const int64_t rx = r * xr, rh = r * W, rs = r * H;
      const AccRequant32 wl = decltype(lv)::value ? at_level(wx32, level[r] * 3 * H) : wx32;
#if defined(QGRU_CELL_LANES)
      for (int64_t c = 0; c < nv; c += L) body(VL{}, lv, wl, rx, rh, rs, c);
#endif
#pragma omp simd
      for (int64_t c = nv; c < nj; ++c) body(int32_t{}, lv, wl, rx, rh, rs, c);
    };
    // (a row on level 0 of a layer whose level 0 is the static grid's: as without levels)
    const auto pass = [&](auto body) {
      for (int64_t r = 0; r < rows; ++r) {
        if (!active[r]) continue;
        if (XACC && level != nullptr && (level[r] != 0 || !level0_static)) row_pass(std::true_type{}, body, r);
        else row_pass(std::false_type{}, body, r);
      }
    };
    pass(rz_pre);
    pass(rz_table_g_preact);
    pass(h_step);
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      if (!active[r]) continue;
      const int64_t rx = r * xr, rh = r * W, rs = r * H;
      const AccRequant wa = XACC && level != nullptr ? at_level(wx, level[r] * 3 * H) : wx;  // the row's level
      const auto d_wx = [&](int q, int64_t j, int32_t v) {
        return XACC ? (int32_t)requantize_acc<POW2>(wa, q * H + j, v) : v;
      };
#pragma omp simd
      for (int64_t c = 0; c < nj; ++c) {
        const int64_t j = j0 + c;
        const int32_t h_new = (int32_t)gru_cell_acc<POW2, false>(
            p, j, Channel32{nullptr}, acc_h[rh + c], acc_h[rh + gs + c], acc_h[rh + 2 * gs + c],
            d_wx(0, j, x[rx + c]), d_wx(1, j, x[rx + xs + c]), d_wx(2, j, x[rx + 2 * xs + c]), s[rs + c]);
        s[rs + c] = h_new;
        if (int_out) o[rs + c] = h_new;
      }
    }
  }
  // The rest of the next step's R.h operand and of the floats, in loops of their own: an int8 store
  // in the compiler-vectorised loops above makes gcc pick 64 lanes (one zmm of int8), more than a
  // row's 16 channels, and run every cell in the scalar remainder (measured 8x slower). Active rows
  // from channel nv on (h_step wrote channels [0, nv) with explicit lanes stores: one pass over the
  // new state instead of three, issue 40); inactive rows (past their length) carry h and the state
  // into this step's output.
  h_in += j0;
  h_out += j0;
  if (y != nullptr) y += j0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rs = r * H, ra = r * lda, c0 = active[r] ? nv : 0;
    if (c0 == nj) continue;
    if (active[r] && p.op.on) {  // the R.h operand h_gemm, one limb: its value
      int32_t op[kTaskUnits];
      operand_of(p, POW2, ACC32, s + rs + c0, nj - c0, op);
      for (int64_t c = c0; c < nj; ++c) h_out[ra + c] = (A)op[c - c0];
    } else if (active[r]) {
      for (int64_t c = c0; c < nj; ++c) h_out[ra + c] = (A)s[rs + c];  // h's one limb: the value itself
    } else {
      for (int64_t c = 0; c < nj; ++c) {
        if (int_out) o[rs + c] = s[rs + c];
        h_out[ra + c] = h_in[ra + c];
      }
    }
    // the output as floats (an inactive row's is its carried state), while s is in L1: no int32
    // output to write and read back in a pass of its own (issue 40: that pass was 2-4% of a call)
    if (y != nullptr) {
#pragma omp simd
      for (int64_t c = c0; c < nj; ++c) y[rs + c] = dequantize_value(s[rs + c], y_scale, y_zp);
    }
  }
}

template <typename A>
void cell_tile_t(const CellTileArgs& a) {
  const A* h_in = static_cast<const A*>(a.h_in);
  A* h_out = static_cast<A*>(a.h_out);
  if (a.wide) {  // wide accumulators: the int32 cell (acc32 is set too)
#define QGRU_CELL_TILE_WIDE(P2, XA)                                                                          \
  cell_tile<P2, true, XA, A, true>(*a.p, *a.wx, *a.wx32, a.level, a.level0_static != 0, a.j0, a.nj, a.rows, \
                                   a.active, a.x, a.acc_h, a.s, a.o, h_in, h_out, a.lda, a.y, a.y_scale, a.y_zp)
    if (a.pow2) {
      if (a.xacc) QGRU_CELL_TILE_WIDE(true, true);
      else QGRU_CELL_TILE_WIDE(true, false);
    } else {
      if (a.xacc) QGRU_CELL_TILE_WIDE(false, true);
      else QGRU_CELL_TILE_WIDE(false, false);
    }
#undef QGRU_CELL_TILE_WIDE
    return;
  }
#define QGRU_CELL_TILE(P2, A32, XA)                                                                       \
  cell_tile<P2, A32, XA, A>(*a.p, *a.wx, *a.wx32, a.level, a.level0_static != 0, a.j0, a.nj, a.rows, a.active, a.x, \
                            a.acc_h, a.s, a.o, h_in, h_out, a.lda, a.y, a.y_scale, a.y_zp)
  if (a.acc32 && a.pow2) {
    if (a.xacc) QGRU_CELL_TILE(true, true, true);
    else QGRU_CELL_TILE(true, true, false);
  } else if (a.acc32) {
    if (a.xacc) QGRU_CELL_TILE(false, true, true);
    else QGRU_CELL_TILE(false, true, false);
  } else if (a.pow2) {
    if (a.xacc) QGRU_CELL_TILE(true, false, true);
    else QGRU_CELL_TILE(true, false, false);
  } else {
    if (a.xacc) QGRU_CELL_TILE(false, false, true);
    else QGRU_CELL_TILE(false, false, false);
  }
#undef QGRU_CELL_TILE
}

// One row of W.x: the exact products of row r, plus bias, rescaled onto Wx (relative to Z_Wx).
template <int NP, bool POW2, bool ACC32>
QGRU_NOINLINE void requantize_row(const AccRequant a, const AccRequant32 a32, const LimbProducts lp, int64_t r,
                                  int64_t H3, int32_t* __restrict o) {
#pragma omp simd
  for (int64_t c = 0; c < H3; ++c) o[c] = (int32_t)requantize_product<NP, POW2, ACC32>(a, a32, lp, r, c);
}

// Rows [r0, r1), each on its x level (level[r]; nullptr: level 0).
inline void requant_rows(const RequantRowsArgs& a) {
  if (a.l32 != nullptr && a.np == 2) {
    for (int64_t r = a.r0; r < a.r1; ++r)
      requant_limbs32_row(*a.l32, a.level != nullptr ? a.level[r] * a.H3 : 0, *a.lp, r, 0, a.H3, a.dwx + r * a.H3);
    return;
  }
  dispatch_kernel(a.np, a.pow2, a.acc32, [&](auto np, auto pow2, auto acc32) {
    for (int64_t r = a.r0; r < a.r1; ++r) {
      const int64_t off = a.level != nullptr ? a.level[r] * a.H3 : 0;
      requantize_row<np.value, pow2.value, acc32.value>(at_level(*a.a, off), at_level(*a.a32, off), *a.lp, r, a.H3,
                                                        a.dwx + r * a.H3);
    }
  });
}

// Where group g's column c of row r lands (GemmArgs).
inline int32_t* gemm_out(const GemmArgs& a, int64_t group, int64_t g, int64_t r) {
  const int64_t i = g - a.g0;
  if (a.gate_stride == 0) return a.C + r * a.ldc + i * group;
  return a.C + (i % 3) * a.gate_stride + r * a.ldc + (i / 3) * group;
}

// A Kernels table's cell entries for activations of type A.
template <typename A>
struct CellLoops {
  static void rows(const CellRowsArgs& a) { cell_rows_t<A>(a); }
  static void tile(const CellTileArgs& a) { cell_tile_t<A>(a); }
  static void requant(const RequantRowsArgs& a) { requant_rows(a); }
  static void act(const ToActArgs& a) { to_act_t<A>(a); }
};

QGRU_ISA_END
}  // namespace cpu
}  // namespace qgru
