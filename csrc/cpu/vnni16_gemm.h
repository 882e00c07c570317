// The int16-activation GEMM of the VNNI paths (issue 40: w8a16): vpdpwssd multiplies signed 16-bit
// activations by signed 16-bit weights (the int8 weights widened), sums each pair of products and
// adds it to an int32 lane. It serves the int8 paths' int16 sibling (Kernels::act16): a layer whose
// 16-bit x or h the GEMM takes whole (prepare.py direct16_fits) runs one GEMM pass per product
// instead of two limb passes of vpdpbusd, with as many multiply instructions (2 K values per lane
// here, against 4 K values in each of two limb passes there), but no limb split, no offset column
// sums, no limb products to combine, and one limb pair: the fused step with the int32 cell.
//
// Exactness: every pair sum is below 2^15 2^7 2 = 2^23 in magnitude, and vpdpwssd adds modulo 2^32
// (not the saturating vpdpwssds): the result is the true sum wherever that lies in int32. For
// 8-bit activations |sum| <= K 2^14 < 2^31 (K < 2^17); for 16-bit ones taken whole, prepare.py
// admits a weight matrix only where 2^15 sum_k |w_ck| < 2^31 for every row c (and the Layer
// checks it again, qgru_cpu.cpp Gemm::init).
//
// Packed weights, per group of kGroup columns: for each pair of K values, the group's columns'
// two values side by side, K padded with zeros to whole kKStep (4) slices. Regs::kWeightBytes = 2:
// as int16 (4 kGroup bytes, one register: what vpdpwssd multiplies with a broadcast activation
// pair); 1: as int8 (2 kGroup bytes), widened to that register as loaded (Regs::load_w8), half the
// bytes to keep in cache and to stream.
//
// The Regs type (kernel file) supplies: reg, kGroup, kRowBlock, kWeightBytes, zero(), load(p),
// load_w8(p) (kWeightBytes 1: 2 kGroup int8 sign-extended to int16), pair(q) (an int32 holding two
// int16 activations, in every lane), dpwssd(acc, a, b), add(x, y), store(p, x).
// Include from a kernel file only, after its target pragma.
#pragma once

#include <stdint.h>
#include <string.h>

#include "gemm_blocks.h"
#include "kernels.h"

namespace qgru {
namespace cpu {
QGRU_ISA_BEGIN

template <class Regs>
struct Vnni16Gemm {
  using reg = typename Regs::reg;
  static constexpr int64_t G = Regs::kGroup;
  static constexpr int64_t kKStep = 4;  // two K pairs: micro_row's even and odd chains
  static int64_t k_pad(int64_t K) { return k_padded_to(K, kKStep); }

  static constexpr int64_t WB = Regs::kWeightBytes;  // 2: packed as int16; 1: int8, widened as loaded
  static int64_t group_bytes(int64_t K) { return G * k_pad(K) * WB; }
  static int64_t packed_bytes(int64_t groups, int64_t K) { return groups * group_bytes(K); }

  static void pack(const int8_t* W, int64_t ldw, int64_t K, const int64_t* channel, int64_t groups, void* out) {
    const int64_t gb = group_bytes(K);
    int8_t* o = static_cast<int8_t*>(out);
    memset(o, 0, (size_t)packed_bytes(groups, K));
    for (int64_t g = 0; g < groups; ++g) {
      int16_t* blk = reinterpret_cast<int16_t*>(o + g * gb);
      int8_t* blk8 = o + g * gb;
      for (int64_t c = 0; c < G; ++c) {
        const int64_t ch = channel[g * G + c];
        if (ch < 0) continue;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t at = (k / 2) * 2 * G + c * 2 + (k & 1);
          if (WB == 2) blk[at] = W[ch * ldw + k];
          else blk8[at] = W[ch * ldw + k];
        }
      }
    }
  }

  static reg pair_at(const int16_t* a, int64_t kp) {
    int32_t q;
    memcpy(&q, a + 2 * kp, 4);
    return Regs::pair(q);
  }
  static reg weights_at(const int8_t* b, int64_t kp) {
    return WB == 2 ? Regs::load(b + kp * 4 * G) : Regs::load_w8(b + kp * 2 * G);
  }

  // Rows r .. r + MR - 1 x the NB groups from g (B: group g's block, groups gb bytes apart).
  template <int MR, int NB>
  QGRU_NOINLINE static void micro(const GemmArgs& a, const int16_t* A, int64_t r, const int8_t* B, int64_t Kp,
                                  int64_t g) {
    const int64_t gb = group_bytes(Kp);
    reg acc[MR][NB];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = Regs::zero();
    const int16_t* a0 = A + r * a.lda;
    for (int64_t kp = 0; kp < Kp / 2; ++kp) {
      reg b[NB];
      for (int j = 0; j < NB; ++j) b[j] = weights_at(B + j * gb, kp);
      for (int i = 0; i < MR; ++i) {
        const reg av = pair_at(a0 + i * a.lda, kp);
        for (int j = 0; j < NB; ++j) acc[i][j] = Regs::dpwssd(acc[i][j], av, b[j]);
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < MR; ++i) Regs::store(gemm_out(a, G, g + j, r + i), acc[i][j]);
  }

  // One row x NB groups (a batch of one): two chains per group (even and odd K pairs).
  template <int NB>
  QGRU_NOINLINE static void micro_row(const GemmArgs& a, const int16_t* A, int64_t r, const int8_t* B, int64_t Kp,
                                      int64_t g) {
    const int64_t gb = group_bytes(Kp);
    reg even[NB], odd[NB];
    for (int j = 0; j < NB; ++j) even[j] = odd[j] = Regs::zero();
    const int16_t* a0 = A + r * a.lda;
    for (int64_t kp = 0; kp < Kp / 2; kp += 2) {  // Kp / 2 is even: Kp is a multiple of kKStep
      const reg av = pair_at(a0, kp), aw = pair_at(a0, kp + 1);
      for (int j = 0; j < NB; ++j) {
        even[j] = Regs::dpwssd(even[j], av, weights_at(B + j * gb, kp));
        odd[j] = Regs::dpwssd(odd[j], aw, weights_at(B + j * gb, kp + 1));
      }
    }
    for (int j = 0; j < NB; ++j) Regs::store(gemm_out(a, G, g + j, r), Regs::add(even[j], odd[j]));
  }

  // Kernels::gemm: gemm_blocks.h's blocking over the micro-kernels above.
  static void gemm(const GemmArgs& a) {
    GemmBlocks<Vnni16Gemm, Regs::kRowBlock, int16_t>::run(a, k_pad(a.K), group_bytes(a.K));
  }
};

QGRU_ISA_END
}  // namespace cpu
}  // namespace qgru
