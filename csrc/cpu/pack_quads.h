// The packed weights of the vpdpbusd paths (kernel_avx512vnni.cpp: groups of 16 output columns,
// one zmm row; kernel_avxvnni.cpp: groups of 8, one ymm row). Per group of G columns: for each
// quad of K values, the G columns' four int8 values side by side (4 G bytes, what vpdpbusd
// multiplies with a broadcast quad of activations), K padded with zeros to whole kKAlign slices;
// then the group's G values of 128 colsum(w) as int32, which the GEMM subtracts to take out the
// +128 offset of its unsigned activations: a . w = (a + 128) . w - 128 colsum(w).
// |colsum| <= K 128 < 2^24, so 128 colsum fits int32.
//
// Include from a kernel file only, after its target pragma (its functions go into the path's
// own namespace, QGRU_ISA).
#pragma once

#include <stdint.h>
#include <string.h>

#include "kernels.h"

namespace qgru {
namespace cpu {
QGRU_ISA_BEGIN

template <int64_t G>
inline int64_t quad_group_bytes(int64_t K) {
  return G * k_padded(K) + G * 4;
}

template <int64_t G>
inline int64_t quad_packed_bytes(int64_t groups, int64_t K) {
  return groups * quad_group_bytes<G>(K);
}

// Kernels::pack for this layout: column c of group g reads row channel[g G + c] of W (-1: zeros).
template <int64_t G>
inline void pack_quads(const int8_t* W, int64_t ldw, int64_t K, const int64_t* channel, int64_t groups, void* out) {
  const int64_t Kp = k_padded(K), gb = quad_group_bytes<G>(K);
  int8_t* o = static_cast<int8_t*>(out);
  memset(o, 0, (size_t)quad_packed_bytes<G>(groups, K));
  for (int64_t g = 0; g < groups; ++g) {
    int8_t* blk = o + g * gb;
    int32_t colsum128[G] = {0};
    for (int64_t c = 0; c < G; ++c) {
      const int64_t ch = channel[g * G + c];
      if (ch < 0) continue;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int8_t w = W[ch * ldw + k];
        blk[(k / 4) * 4 * G + c * 4 + (k & 3)] = w;
        sum += w;
      }
      colsum128[c] = 128 * sum;
    }
    memcpy(blk + G * Kp, colsum128, sizeof(colsum128));
  }
}

QGRU_ISA_END
}  // namespace cpu
}  // namespace qgru
