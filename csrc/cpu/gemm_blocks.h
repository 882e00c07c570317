// The row and column blocking the vpdpbusd and vpdpwssd GEMMs share (vnni_gemm.h, int8
// activations; vnni16_gemm.h, int16 ones): three column groups at a time (their weights stay in L1
// while the rows pass), rows in blocks of the widest micro-kernel (RB, 4 or 8), then 4 (where RB is
// 8), then the last 1-3 rows exactly. Gemm brings the micro-kernels over activations of type A:
//   micro<MR, NB>(a, A, r, B, Kp, g)   rows r .. r + MR - 1, groups g .. g + NB - 1
//   micro_row<NB>(a, A, r, B, Kp, g)   row r alone
// with B at group g's packed weights and Kp the packed K.
//
// Include from a kernel file only, after its target pragma (its functions go into the path's own
// namespace, QGRU_ISA).
#pragma once

#include <stdint.h>

#include "kernels.h"

namespace qgru {
namespace cpu {
QGRU_ISA_BEGIN

template <class Gemm, int RB, typename A>
struct GemmBlocks {
  static_assert(RB == 4 || RB == 8, "row blocks of 4 or 8");

  template <int MR>
  static void row_block(const GemmArgs& a, const A* act, int64_t r, const int8_t* B, int64_t Kp, int64_t g) {
    const int64_t left = a.g1 - g;
    if (MR == 1) {
      if (left >= 3) Gemm::template micro_row<3>(a, act, r, B, Kp, g);
      else if (left == 2) Gemm::template micro_row<2>(a, act, r, B, Kp, g);
      else Gemm::template micro_row<1>(a, act, r, B, Kp, g);
    } else if (left >= 3) {
      Gemm::template micro<MR, 3>(a, act, r, B, Kp, g);
    } else if (left == 2) {
      Gemm::template micro<MR, 2>(a, act, r, B, Kp, g);
    } else {
      Gemm::template micro<MR, 1>(a, act, r, B, Kp, g);
    }
  }

  // Kernels::gemm over weights packed in groups of gb bytes, K packed to Kp.
  static void run(const GemmArgs& a, int64_t Kp, int64_t gb) {
    const A* act = static_cast<const A*>(a.A);
    const int8_t* B = static_cast<const int8_t*>(a.B);
    for (int64_t g = a.g0; g < a.g1; g += 3) {
      const int8_t* b = B + g * gb;
      int64_t r = 0;
      for (; r + RB <= a.rows; r += RB) row_block<RB>(a, act, r, b, Kp, g);
      if (RB == 8 && a.rows - r >= 4) {
        row_block<4>(a, act, r, b, Kp, g);
        r += 4;
      }
      switch (a.rows - r) {
        case 3: row_block<3>(a, act, r, b, Kp, g); break;
        case 2: row_block<2>(a, act, r, b, Kp, g); break;
        case 1: row_block<1>(a, act, r, b, Kp, g); break;
        default: break;
      }
    }
  }
};

QGRU_ISA_END
}  // namespace cpu
}  // namespace qgru
