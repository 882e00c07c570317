// The packed weights and the GEMM of the vpdpbusd paths, written once over their register type:
// kernel_avx512vnni.cpp (one zmm: groups of 16 output columns) and kernel_avxvnni.cpp (one ymm,
// the VEX form: groups of 8) each supply a Regs type:
//   reg                     the register type
//   kGroup, kRowBlock       columns per packed group; rows of the widest micro-kernel
//   zero(), load(p)         a zero register; the register at p (unaligned)
//   quad(q)                 the activation quad q (four int8) offset to unsigned, a + 128
//                           (a XOR 0x80 per byte), in every lane
//   dpbusd(acc, a, b)       acc + the four-product sums of u8 a by s8 b per int32 lane (wrapping)
//   add(x, y), sub(x, y)    int32 lanes (wrapping)
//   store(p, x)             unaligned
//
// Exactness: vpdpbusd adds modulo 2^32 (not the saturating vpdpbusds), and so does the final
// subtraction of 128 colsum(w): a . w = (a + 128) . w - 128 colsum(w) holds modulo 2^32, and since
// |a . w| <= K 2^14 < 2^31 for K < 2^17 (every layer) the result is the true value, even where the
// offset sum itself (up to K 255 128) passes 2^31.
//
// Packed weights, per group of kGroup columns: for each quad of K values, the group's columns'
// four int8 values side by side (4 kGroup bytes, one register: what vpdpbusd multiplies with a
// broadcast activation quad), K padded with zeros to whole kKStep (8) slices; then the group's
// kGroup values of 128 colsum(w) as int32 (|colsum| <= K 128 < 2^24: it fits).
//
// Include from a kernel file only, after its target pragma (its functions go into the path's
// own namespace, QGRU_ISA).
#pragma once

#include <stdint.h>
#include <string.h>

#include "gemm_blocks.h"
#include "kernels.h"

namespace qgru {
namespace cpu {
QGRU_ISA_BEGIN

template <class Regs>
struct VnniGemm {
  using reg = typename Regs::reg;
  static constexpr int64_t G = Regs::kGroup;
  // K is packed and multiplied in whole steps of two quads (micro_row's even and odd chains)
  static constexpr int64_t kKStep = 8;
  static int64_t k_pad(int64_t K) { return k_padded_to(K, kKStep); }

  static int64_t group_bytes(int64_t K) { return G * k_pad(K) + G * 4; }
  static int64_t packed_bytes(int64_t groups, int64_t K) { return groups * group_bytes(K); }

  // Kernels::pack: column c of group g reads row channel[g G + c] of W (-1: zeros).
  static void pack(const int8_t* W, int64_t ldw, int64_t K, const int64_t* channel, int64_t groups, void* out) {
    const int64_t Kp = k_pad(K), gb = group_bytes(K);
    int8_t* o = static_cast<int8_t*>(out);
    memset(o, 0, (size_t)packed_bytes(groups, K));
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

  static reg quad_at(const int8_t* a, int64_t kq) {
    int32_t q;
    memcpy(&q, a + 4 * kq, 4);
    return Regs::quad(q);
  }
  static reg weights_at(const int8_t* b, int64_t kq) { return Regs::load(b + kq * 4 * G); }
  static reg colsum_of(const int8_t* b, int64_t Kp) { return Regs::load(b + G * Kp); }

  // Rows r .. r + MR - 1 x the NB groups from g (B: group g's block, groups gb bytes apart).
  template <int MR, int NB>
  QGRU_NOINLINE static void micro(const GemmArgs& a, const int8_t* A, int64_t r, const int8_t* B, int64_t Kp,
                                  int64_t g) {
    const int64_t gb = group_bytes(Kp);
    reg acc[MR][NB];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = Regs::zero();
    const int8_t* a0 = A + r * a.lda;
    for (int64_t kq = 0; kq < Kp / 4; ++kq) {
      reg b[NB];
      for (int j = 0; j < NB; ++j) b[j] = weights_at(B + j * gb, kq);
      for (int i = 0; i < MR; ++i) {
        const reg av = quad_at(a0 + i * a.lda, kq);
        for (int j = 0; j < NB; ++j) acc[i][j] = Regs::dpbusd(acc[i][j], av, b[j]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const reg cs = colsum_of(B + j * gb, Kp);
      for (int i = 0; i < MR; ++i) Regs::store(gemm_out(a, G, g + j, r + i), Regs::sub(acc[i][j], cs));
    }
  }

  // One row x NB groups (a batch of one, streaming): two chains per group (even and odd K quads),
  // since one chain per group waits on vpdpbusd's latency.
  template <int NB>
  QGRU_NOINLINE static void micro_row(const GemmArgs& a, const int8_t* A, int64_t r, const int8_t* B, int64_t Kp,
                                      int64_t g) {
    const int64_t gb = group_bytes(Kp);
    reg even[NB], odd[NB];
    for (int j = 0; j < NB; ++j) even[j] = odd[j] = Regs::zero();
    const int8_t* a0 = A + r * a.lda;
    for (int64_t kq = 0; kq < Kp / 4; kq += 2) {  // Kp / 4 is even: Kp is a multiple of kKStep
      const reg av = quad_at(a0, kq), aw = quad_at(a0, kq + 1);
      for (int j = 0; j < NB; ++j) {
        even[j] = Regs::dpbusd(even[j], av, weights_at(B + j * gb, kq));
        odd[j] = Regs::dpbusd(odd[j], aw, weights_at(B + j * gb, kq + 1));
      }
    }
    for (int j = 0; j < NB; ++j)
      Regs::store(gemm_out(a, G, g + j, r), Regs::sub(Regs::add(even[j], odd[j]), colsum_of(B + j * gb, Kp)));
  }

  // Kernels::gemm: gemm_blocks.h's blocking over the micro-kernels above.
  static void gemm(const GemmArgs& a) {
    GemmBlocks<VnniGemm, Regs::kRowBlock, int8_t>::run(a, k_pad(a.K), group_bytes(a.K));
  }
};

QGRU_ISA_END
}  // namespace cpu
}  // namespace qgru
