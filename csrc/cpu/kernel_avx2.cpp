// The AVX2 path (x86-64 with AVX2: AMD Zen 1-3, Intel since Haswell), with no AVX-512 or VNNI.
//
// GEMM: activations as int16, weights (int8 values) packed as int16, multiplied with vpmaddwd:
// each instruction forms 16 exact int16 x int16 products and adds adjacent pairs into int32
// lanes, |pair| <= 2 * 2^15 * 2^7 = 2^23, which cannot overflow (vpmaddubsw, the u8 x s8 form,
// saturates its pair sums at 2^15 and is not used). The lanes are summed with vpaddd, which wraps
// modulo 2^32: the result is exact whenever the true sum lies in int32, i.e.
//   * int8 limbs: |sum| <= K 2^14 < 2^31 for K < 2^17 (every layer);
//   * 16-bit activations taken whole (one GEMM instead of two limb GEMMs): |sum| <= K 2^15 max|w|,
//     which qgru/native.py (prepare_layer, act16) admits only when it is below 2^31
//     (K <= 516 with weights up to 127).
// Packed weights: groups of 8 output columns; for each pair of K values, the 8 columns' two
// int16 values side by side (one 32-byte row, what vpmaddwd multiplies with a broadcast pair of
// activations). The micro-kernel computes up to 4 rows x 3 groups (12 accumulators of the 16 ymm
// registers): in the fused step's gate layout the 3 groups are the r, z and g columns of 8 units.
#define QGRU_ISA avx2
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,bmi2,f16c,popcnt")
#elif defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,bmi2,f16c,popcnt"))), apply_to = function)
#endif
#include "cell_loops.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QGRU_BUILD_AVX2 1
#include <immintrin.h>
#include <string.h>
#else
#define QGRU_BUILD_AVX2 0
#endif

namespace qgru {
namespace cpu {
#if QGRU_BUILD_AVX2
QGRU_ISA_BEGIN
namespace {

constexpr int64_t kGroup = 8;

int64_t k_pad(int64_t K) { return (K + kKAlign - 1) / kKAlign * kKAlign; }

int64_t packed_bytes(int64_t groups, int64_t K) { return groups * kGroup * k_pad(K) * 2; }

void pack(const int8_t* W, int64_t ldw, int64_t K, const int64_t* channel, int64_t groups, void* out) {
  const int64_t Kp = k_pad(K);
  int16_t* o = static_cast<int16_t*>(out);
  memset(o, 0, (size_t)packed_bytes(groups, K));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < kGroup; ++c) {
      const int64_t ch = channel[g * kGroup + c];
      if (ch < 0) continue;
      for (int64_t k = 0; k < K; ++k) o[g * kGroup * Kp + (k / 2) * 2 * kGroup + c * 2 + (k & 1)] = W[ch * ldw + k];
    }
}

// Rows [r, r + MR) x NB groups from g (the NB groups' packed blocks are consecutive).
template <int MR, int NB>
inline void micro(const GemmArgs& a, const int16_t* A, int64_t r, const int16_t* B, int64_t Kp, int64_t g) {
  __m256i acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
  const int64_t gstride = kGroup * Kp;  // int16 elements from one group's block to the next
  const int16_t* a0 = A + r * a.lda;
  for (int64_t kk = 0; kk < Kp / 2; ++kk) {
    __m256i b[NB];
    for (int j = 0; j < NB; ++j) b[j] = _mm256_loadu_si256((const __m256i*)(B + j * gstride + kk * 2 * kGroup));
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      memcpy(&pair, a0 + i * a.lda + 2 * kk, 4);
      const __m256i av = _mm256_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(av, b[j]));
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) _mm256_storeu_si256((__m256i*)gemm_out(a, kGroup, g + j, r + i), acc[i][j]);
}

template <int MR>
void row_block(const GemmArgs& a, const int16_t* A, int64_t r, const int16_t* B, int64_t Kp, int64_t g) {
  const int64_t left = a.g1 - g;
  if (left >= 3) micro<MR, 3>(a, A, r, B, Kp, g);
  else if (left == 2) micro<MR, 2>(a, A, r, B, Kp, g);
  else micro<MR, 1>(a, A, r, B, Kp, g);
}

void gemm(const GemmArgs& a) {
  const int64_t Kp = k_pad(a.K);
  const int16_t* A = static_cast<const int16_t*>(a.A);
  const int16_t* B = static_cast<const int16_t*>(a.B);
  // three groups at a time (their weights stay in L1 while the row blocks stream past)
  for (int64_t g = a.g0; g < a.g1; g += 3) {
    const int16_t* b = B + g * kGroup * Kp;
    int64_t r = 0;
    for (; r + 4 <= a.rows; r += 4) row_block<4>(a, A, r, b, Kp, g);
    switch (a.rows - r) {
      case 3: row_block<3>(a, A, r, b, Kp, g); break;
      case 2: row_block<2>(a, A, r, b, Kp, g); break;
      case 1: row_block<1>(a, A, r, b, Kp, g); break;
      default: break;
    }
  }
}

void no_init() {}

const Kernels kTable{"avx2", 2, kGroup, packed_bytes, pack, gemm,
                     CellLoops<int16_t>::rows, CellLoops<int16_t>::tile, CellLoops<int16_t>::requant,
                     CellLoops<int16_t>::act, no_init};

}  // namespace
QGRU_ISA_END

const Kernels* avx2_kernels() { return &kTable; }
#else
const Kernels* avx2_kernels() { return nullptr; }
#endif

}  // namespace cpu
}  // namespace qgru

#if defined(__clang__)
#pragma clang attribute pop
#endif
