// The fused step's cell for layers with wide accumulators (issue 40: w8a16 on the int16 paths,
// CellTileArgs.wide): a 16-bit x or h taken whole by the GEMM, so that its int32 products may use
// all 31 bits. The accumulators are requantized with requant_wide32 (qgru_cell.h, "Wide
// accumulators": exact in int32 lanes), everything after that is the int32 cell that w8a8 runs
// (sigmoid_pre32_d, candidate_pre32_d, lookup32, new_state32), in the path's explicit vectors
// (QGRU_CELL_LANES) where it has them. The same four passes over a task as cell_loops.h's
// cell_tile (it says why), with the wide requantization where that one has requant32.
//
// Included by cell_loops.h (after operand_of, before cell_tile_t): not on its own.
#pragma once

#include <type_traits>

#include "kernels.h"

namespace qgru {
namespace cpu {
QGRU_ISA_BEGIN

// The cells of one task (cell_tile's contract): rows x nj elements from the three gates' R.h tiles
// acc_h and their W.x: with XACC the W.x tiles x (requantized here, each row on its x level where
// the layer has levels), else the rows' Wx - Z_Wx ([rows, 3H], requantized by the W.x pass).
template <bool POW2, bool XACC, typename A>
QGRU_NOINLINE void cell_tile_wide(const CellParams& p, const AccRequant32& wx32, const int32_t* __restrict level,
                                  bool level0_static, int64_t j0, int64_t nj, int64_t rows,
                                  const uint8_t* __restrict active, const int32_t* __restrict x,
                                  const int32_t* __restrict acc_h, int32_t* __restrict s, int32_t* __restrict o,
                                  const A* __restrict h_in, A* __restrict h_out, int64_t lda) {
  constexpr int64_t W = kTaskUnits, gs = kTileRows * W;
  const int64_t H = p.H;
  const int64_t xs = XACC ? gs : H, xr = XACC ? W : 3 * H;
  if (!XACC) x += j0;
  s += j0;
  o += j0;
  const Cell32 c32 = p.c32;
  const int32_t* fields = cell32_channel<true>(p, j0).at;
  // Wx - Z_Wx of gate q at channel j0 + c
  const auto d_wx = [&](auto lv, const AccRequant32& wl, Channel32 ch, int q, int64_t c, auto v) {
    if constexpr (!XACC) return v;
    else if constexpr (decltype(lv)::value) return requant_wide32_flat<POW2, decltype(v)>(wl, q * H + j0 + c, v);
    else return requant_wide32_at<POW2, decltype(v)>(ch, kWxRequant, q, v, c32.wx_lo, c32.wx_hi);
  };
  const auto d_rh = [&](Channel32 ch, int q, auto v) {
    return requant_wide32_at<POW2, decltype(v)>(ch, kRhRequant, q, v, c32.rh_lo, c32.rh_hi);
  };
  alignas(64) int32_t d_r[kTileRows * W], d_z[kTileRows * W], g_pre[kTileRows * W];
  const auto rz_pre = [&](auto lanes, auto lv, const AccRequant32& wl, int64_t rx, int64_t rh, int64_t, int64_t c) {
    using V = decltype(lanes);
    const Channel32 ch{fields + c};
    lanes_store(d_r + rh + c, sigmoid_pre32_d<POW2, V>(c32, ch, 0, d_rh(ch, 0, lanes_load<V>(acc_h + rh + c)),
                                                       d_wx(lv, wl, ch, 0, c, lanes_load<V>(x + rx + c))));
    lanes_store(d_z + rh + c, sigmoid_pre32_d<POW2, V>(c32, ch, 1, d_rh(ch, 1, lanes_load<V>(acc_h + rh + gs + c)),
                                                       d_wx(lv, wl, ch, 1, c, lanes_load<V>(x + rx + xs + c))));
  };
  const auto rz_table = [&](auto lanes, auto, const AccRequant32&, int64_t, int64_t rh, int64_t, int64_t c) {
    using V = decltype(lanes);
    lanes_store(d_r + rh + c, lookup32<V>(c32.table[0], lanes_load<V>(d_r + rh + c)));
    lanes_store(d_z + rh + c, lookup32<V>(c32.table[1], lanes_load<V>(d_z + rh + c)));
  };
  const auto g_preact = [&](auto lanes, auto lv, const AccRequant32& wl, int64_t rx, int64_t rh, int64_t, int64_t c) {
    using V = decltype(lanes);
    const Channel32 ch{fields + c};
    const V d_rh_g = d_rh(ch, 2, lanes_load<V>(acc_h + rh + 2 * gs + c));
    lanes_store(g_pre + rh + c,
                candidate_pre32_d<POW2, V>(c32, ch, d_rh_g, d_wx(lv, wl, ch, 2, c, lanes_load<V>(x + rx + 2 * xs + c)),
                                           lanes_load<V>(d_r + rh + c)));
  };
  const auto h_step = [&](auto lanes, auto, const AccRequant32&, int64_t, int64_t rh, int64_t rs, int64_t c) {
    using V = decltype(lanes);
    const V h_new = new_state32<POW2, V>(c32, lookup32<V>(c32.table[2], lanes_load<V>(g_pre + rh + c)),
                                         lanes_load<V>(d_z + rh + c), lanes_load<V>(s + rs + c));
    lanes_store(s + rs + c, h_new);
    lanes_store(o + rs + c, h_new);
  };
#if defined(QGRU_CELL_LANES)
  using VL = QGRU_CELL_LANES;
  constexpr int64_t L = VL::kLanes;
  const int64_t nv = nj / L * L;
#else
  const int64_t nv = 0;
#endif
  const auto row_pass = [&](auto lv, auto body, int64_t r) {
    const int64_t rx = r * xr, rh = r * W, rs = r * H;
    const AccRequant32 wl = decltype(lv)::value ? at_level(wx32, level[r] * 3 * H) : wx32;
#if defined(QGRU_CELL_LANES)
    for (int64_t c = 0; c < nv; c += L) body(VL{}, lv, wl, rx, rh, rs, c);
#endif
#pragma omp simd
    for (int64_t c = nv; c < nj; ++c) body(int32_t{}, lv, wl, rx, rh, rs, c);
  };
  const auto pass = [&](auto body) {
    for (int64_t r = 0; r < rows; ++r) {
      if (!active[r]) continue;
      if (XACC && level != nullptr && (level[r] != 0 || !level0_static)) row_pass(std::true_type{}, body, r);
      else row_pass(std::false_type{}, body, r);
    }
  };
  pass(rz_pre);
  pass(rz_table);
  pass(g_preact);
  pass(h_step);
  // the next step's R.h operand (cell_tile's loops of their own)
  h_in += j0;
  h_out += j0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rs = r * H, ra = r * lda;
    if (active[r] && p.op.on) {
      int32_t op[kTaskUnits];
      operand_of(p, POW2, true, s + rs, nj, op);
      for (int64_t c = 0; c < nj; ++c) h_out[ra + c] = (A)op[c];
    } else if (active[r]) {
      for (int64_t c = 0; c < nj; ++c) h_out[ra + c] = (A)s[rs + c];
    } else {
      for (int64_t c = 0; c < nj; ++c) {
        o[rs + c] = s[rs + c];
        h_out[ra + c] = h_in[ra + c];
      }
    }
  }
}

template <typename A>
void cell_tile_wide_t(const CellTileArgs& a) {
  const A* h_in = static_cast<const A*>(a.h_in);
  A* h_out = static_cast<A*>(a.h_out);
#define QGRU_CELL_TILE_WIDE(P2, XA)                                                                           \
  cell_tile_wide<P2, XA, A>(*a.p, *a.wx32, a.level, a.level0_static != 0, a.j0, a.nj, a.rows, a.active, a.x, \
                            a.acc_h, a.s, a.o, h_in, h_out, a.lda)
  if (a.pow2) {
    if (a.xacc) QGRU_CELL_TILE_WIDE(true, true);
    else QGRU_CELL_TILE_WIDE(true, false);
  } else {
    if (a.xacc) QGRU_CELL_TILE_WIDE(false, true);
    else QGRU_CELL_TILE_WIDE(false, false);
  }
#undef QGRU_CELL_TILE_WIDE
}

QGRU_ISA_END
}  // namespace cpu
}  // namespace qgru
