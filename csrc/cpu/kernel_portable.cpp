// The portable path: plain C++ for the build's baseline target (x86-64, aarch64, anything), which
// the compiler vectorises as well as it can. Every CPU runs it; it is the sibling every fast path
// is tested against besides the golden model.
//
// GEMM: activations as int16, weights int8 widened to int16 in registers, products summed in
// int32, exact: |sum| <= K 2^14 < 2^31 for 8-bit activations and K < 2^17, the
// layer's limit; a 16-bit activation is taken whole where K 2^15 max|w| < 2^31
// (native.direct16_fits, as on avx2). Weights are packed as groups of 8 output columns, each
// column's K values contiguous (padded to a multiple of 64 with zeros, as the activation rows are):
// a dot product is one contiguous loop, four rows at a time so that each weight load serves four
// rows (a last row alone against 8 columns at a time). Why int16: an int16 x int16 -> int32 dot product is the pattern compilers turn into their
// widening multiply-add (x86 pmaddwd from SSE2 on, aarch64 smlal); gcc 12 vectorises an int8 one at
// the x86-64 baseline only with unpacks and 16-bit multiplies, and the loops carry no omp simd
// pragma because with it gcc 12 does not form pmaddwd either (checked with objdump).
#define QGRU_ISA portable
#include "cell_loops.h"
#include "quantize_block.h"

#include <string.h>

namespace qgru {
namespace cpu {
QGRU_ISA_BEGIN
namespace {

constexpr int64_t kGroup = 8;

int64_t packed_bytes(int64_t groups, int64_t K) { return groups * kGroup * k_padded(K); }

void pack(const int8_t* W, int64_t ldw, int64_t K, const int64_t* channel, int64_t groups, void* out) {
  const int64_t Kp = k_padded(K);
  int8_t* o = static_cast<int8_t*>(out);
  memset(o, 0, (size_t)packed_bytes(groups, K));
  for (int64_t m = 0; m < groups * kGroup; ++m)
    if (channel[m] >= 0) memcpy(o + m * Kp, W + channel[m] * ldw, (size_t)K);
}

// The weights stay int8 in memory (a batch of one streams them from cache every step: half the
// bytes of int16) and are widened in registers, where the compiler sign-extends them and forms
// the int16 dot product.
QGRU_NOINLINE void dot4(const int16_t* __restrict a0, const int16_t* __restrict a1, const int16_t* __restrict a2,
                        const int16_t* __restrict a3, const int8_t* __restrict w, int64_t K, int32_t* acc) {
  int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t wk = (int16_t)w[k];
    s0 += (int32_t)a0[k] * wk;
    s1 += (int32_t)a1[k] * wk;
    s2 += (int32_t)a2[k] * wk;
    s3 += (int32_t)a3[k] * wk;
  }
  acc[0] = s0, acc[1] = s1, acc[2] = s2, acc[3] = s3;
}

// One row against a group's 8 columns (w: the group's first column, columns Kp apart): each
// activation load serves 8 products, and the 8 sums are independent chains (as 8 calls of a
// one-column dot product, a batch of one ran ~2x slower: one load of a per product, one chain).
QGRU_NOINLINE void dot1x8(const int16_t* __restrict a0, const int8_t* __restrict w, int64_t Kp, int64_t K,
                          int32_t* __restrict acc) {
  const int8_t *w0 = w, *w1 = w + Kp, *w2 = w + 2 * Kp, *w3 = w + 3 * Kp, *w4 = w + 4 * Kp, *w5 = w + 5 * Kp,
               *w6 = w + 6 * Kp, *w7 = w + 7 * Kp;
  int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t ak = a0[k];
    s0 += ak * (int16_t)w0[k];
    s1 += ak * (int16_t)w1[k];
    s2 += ak * (int16_t)w2[k];
    s3 += ak * (int16_t)w3[k];
    s4 += ak * (int16_t)w4[k];
    s5 += ak * (int16_t)w5[k];
    s6 += ak * (int16_t)w6[k];
    s7 += ak * (int16_t)w7[k];
  }
  acc[0] = s0, acc[1] = s1, acc[2] = s2, acc[3] = s3, acc[4] = s4, acc[5] = s5, acc[6] = s6, acc[7] = s7;
}

void gemm(const GemmArgs& a) {
  const int64_t Kp = k_padded(a.K);
  const int16_t* A = static_cast<const int16_t*>(a.A);
  const int8_t* B = static_cast<const int8_t*>(a.B);
  const int64_t rows4 = a.rows / 4 * 4;
  for (int64_t g = a.g0; g < a.g1; ++g) {
    for (int64_t r = 0; r < rows4; r += 4) {
      for (int64_t c = 0; c < kGroup; ++c) {
        int32_t acc[4];
        const int16_t* ar = A + r * a.lda;
        dot4(ar, ar + a.lda, ar + 2 * a.lda, ar + 3 * a.lda, B + (g * kGroup + c) * Kp, Kp, acc);
        for (int64_t i = 0; i < 4; ++i) gemm_out(a, kGroup, g, r + i)[c] = acc[i];
      }
    }
    // the last 1-3 rows one at a time (a batch of one: four rows would be three wasted)
    for (int64_t r = rows4; r < a.rows; ++r) dot1x8(A + r * a.lda, B + g * kGroup * Kp, Kp, Kp, gemm_out(a, kGroup, g, r));
  }
}

void no_init() {}

const Kernels kTable{"portable", 2, kGroup, packed_bytes, pack, gemm,
                     CellLoops<int16_t>::rows, CellLoops<int16_t>::tile, CellLoops<int16_t>::requant,
                     CellLoops<int16_t>::act, no_init, quantize_f32, quantize_f64,
                     quantize_levels_f32, quantize_levels_f64};

}  // namespace
QGRU_ISA_END

const Kernels* portable_kernels() { return &kTable; }

}  // namespace cpu
}  // namespace qgru
