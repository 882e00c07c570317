// The AVX2 path (x86-64 with AVX2: AMD Zen 1-3, Intel since Haswell), with no AVX-512 or VNNI.
//
// GEMM: activations as int16, weights packed as int8 and sign-extended to int16 as they are
// loaded (vpmovsxbw: half the bytes to stream, so a layer's weights stay in L2 longer and a batch
// of one, which reads every weight once per step, waits half as long), multiplied with vpmaddwd:
// each instruction forms 16 exact int16 x int16 products and adds adjacent pairs into int32
// lanes, |pair| <= 2 * 2^15 * 2^7 = 2^23, which cannot overflow (vpmaddubsw, the u8 x s8 form,
// saturates its pair sums at 2^15 and is not used). The lanes are summed with vpaddd, which wraps
// modulo 2^32: the result is exact whenever the true sum lies in int32, i.e.
//   * int8 limbs: |sum| <= K 2^14 < 2^31 for K < 2^17 (every layer);
//   * 16-bit activations taken whole (one GEMM instead of two limb GEMMs): |sum| <= K 2^15 max|w|,
//     which qgru/native.py (prepare_layer, act16) admits only when it is below 2^31
//     (K <= 516 with weights up to 127).
// Packed weights: groups of 8 output columns; for each pair of K values, the 8 columns' two
// int8 values side by side (16 bytes; sign-extended, one 32-byte row of int16, what vpmaddwd
// multiplies with a broadcast pair of activations). The micro-kernel computes up to 6 rows x 2
// groups (12 accumulators of the 16 ymm registers); a batch of one takes 1 row x 3 groups.
#define QGRU_ISA avx2
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QGRU_BUILD_AVX2 1
#define QGRU_QUANTIZE_AVX2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,bmi2,f16c,popcnt"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,bmi2,f16c,popcnt")
#endif
#else
#define QGRU_BUILD_AVX2 0
#endif
#if QGRU_BUILD_AVX2
#define QGRU_LANES_SCALAR_TABLE  // table lookups as scalar loads, not gathers (lanes_avx2.h says why)
#include "lanes_avx2.h"  // the int32 cell in explicit 8-lane vectors
#define QGRU_CELL_LANES I32x8
#endif
#include "cell_loops.h"
#include "quantize_block.h"

#if QGRU_BUILD_AVX2
#include <immintrin.h>
#include <string.h>
#endif

namespace qgru {
namespace cpu {
#if QGRU_BUILD_AVX2
QGRU_ISA_BEGIN
namespace {

constexpr int64_t kGroup = 8;
constexpr int64_t kKStep = 4;  // K packed and multiplied in pairs of K pairs (micro_1x3's two chains)
inline int64_t k_pad(int64_t K) { return k_padded_to(K, kKStep); }

// two zero groups past the last: micro_1x3 reads three groups at a time, micro_rx2 two
int64_t packed_bytes(int64_t groups, int64_t K) { return (groups + 2) * kGroup * k_pad(K); }

void pack(const int8_t* W, int64_t ldw, int64_t K, const int64_t* channel, int64_t groups, void* out) {
  const int64_t Kp = k_pad(K);
  int8_t* o = static_cast<int8_t*>(out);
  memset(o, 0, (size_t)packed_bytes(groups, K));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < kGroup; ++c) {
      const int64_t ch = channel[g * kGroup + c];
      if (ch < 0) continue;
      for (int64_t k = 0; k < K; ++k) o[g * kGroup * Kp + (k / 2) * 2 * kGroup + c * 2 + (k & 1)] = W[ch * ldw + k];
    }
}

inline __m256i pair_at(const int16_t* a, int64_t kk) {
  int32_t pair;
  memcpy(&pair, a + 2 * kk, 4);
  return _mm256_set1_epi32(pair);
}

// the int16 form of 16 packed int8 weights (one K pair of 8 columns)
inline __m256i weights_at(const int8_t* b) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)b)); }

#define QGRU_MADD(acc, av, bv) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(av, bv))

// Rows r .. r + R - 1 x the 2 groups from g (16 columns), R <= 6: up to twelve accumulators in
// registers (the loops over rows are unrolled at compile time, so the arrays live in registers).
// Six rows by two groups measured ~1.3x the four-by-three form on an AVX2-only AMD EPYC (Zen 3):
// per K pair it issues two vpmovsxbw instead of three for the same twelve vpmaddwd, and those
// share the vector pipes with the multiply-adds. A group past a.g1 reads the zero group that
// packed_bytes adds at the end and is not stored.
template <int R>
QGRU_NOINLINE void micro_rx2(const GemmArgs& a, const int16_t* A, int64_t r, const int8_t* B, int64_t Kp, int64_t g) {
  __m256i c0[R], c1[R];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) c0[i] = c1[i] = _mm256_setzero_si256();
  const int8_t* b1p = B + kGroup * Kp;  // the second group's block
  const int16_t* a0 = A + r * a.lda;
  for (int64_t kk = 0; kk < Kp / 2; ++kk) {
    const __m256i b0 = weights_at(B + kk * 2 * kGroup), b1 = weights_at(b1p + kk * 2 * kGroup);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256i av = pair_at(a0 + i * a.lda, kk);
      QGRU_MADD(c0[i], av, b0);
      QGRU_MADD(c1[i], av, b1);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_si256((__m256i*)gemm_out(a, kGroup, g, r + i), c0[i]);
    if (g + 1 < a.g1) _mm256_storeu_si256((__m256i*)gemm_out(a, kGroup, g + 1, r + i), c1[i]);
  }
}

// One row x 3 groups: a batch of one (streaming), where four rows would be three wasted.
QGRU_NOINLINE void micro_1x3(const GemmArgs& a, const int16_t* A, int64_t r, const int8_t* B, int64_t Kp, int64_t g) {
  __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, d0 = c0, d1 = c0, d2 = c0;
  const int64_t gs = kGroup * Kp;
  const int16_t* a0 = A + r * a.lda;
  int64_t kk = 0;
  for (; kk + 2 <= Kp / 2; kk += 2) {  // two independent chains per column group
    const __m256i av = pair_at(a0, kk), aw = pair_at(a0, kk + 1);
    QGRU_MADD(c0, av, weights_at(B + kk * 2 * kGroup));
    QGRU_MADD(c1, av, weights_at(B + gs + kk * 2 * kGroup));
    QGRU_MADD(c2, av, weights_at(B + 2 * gs + kk * 2 * kGroup));
    QGRU_MADD(d0, aw, weights_at(B + (kk + 1) * 2 * kGroup));
    QGRU_MADD(d1, aw, weights_at(B + gs + (kk + 1) * 2 * kGroup));
    QGRU_MADD(d2, aw, weights_at(B + 2 * gs + (kk + 1) * 2 * kGroup));
  }
  const __m256i c[3] = {_mm256_add_epi32(c0, d0), _mm256_add_epi32(c1, d1), _mm256_add_epi32(c2, d2)};
  for (int64_t j = 0; j < 3 && g + j < a.g1; ++j) _mm256_storeu_si256((__m256i*)gemm_out(a, kGroup, g + j, r), c[j]);
}
#undef QGRU_MADD

void gemm(const GemmArgs& a) {
  const int64_t Kp = k_pad(a.K);  // a multiple of kKStep: micro_1x3's pairs of K pairs divide it
  const int16_t* A = static_cast<const int16_t*>(a.A);
  const int8_t* B = static_cast<const int8_t*>(a.B);
  if (a.rows == 1) {  // three groups at a time, two chains each
    for (int64_t g = a.g0; g < a.g1; g += 3) micro_1x3(a, A, 0, B + g * kGroup * Kp, Kp, g);
    return;
  }
  // two groups at a time (their weights stay in L1 while the rows stream past), six rows at a
  // time and the last 1-5 rows exactly (no row past a.rows is read)
  for (int64_t g = a.g0; g < a.g1; g += 2) {
    const int8_t* b = B + g * kGroup * Kp;
    int64_t r = 0;
    for (; r + 6 <= a.rows; r += 6) micro_rx2<6>(a, A, r, b, Kp, g);
    switch (a.rows - r) {
      case 5: micro_rx2<5>(a, A, r, b, Kp, g); break;
      case 4: micro_rx2<4>(a, A, r, b, Kp, g); break;
      case 3: micro_rx2<3>(a, A, r, b, Kp, g); break;
      case 2: micro_rx2<2>(a, A, r, b, Kp, g); break;
      case 1: micro_rx2<1>(a, A, r, b, Kp, g); break;
      default: break;
    }
  }
}

void no_init() {}

// op_cpu.cpp requantize_cat's values of one row, four at a time in 64-bit lanes: the integers of
// saturate(rounding_mul_shift(a - z, m, s) + to_zp, r), per channel (m[c], s[c]) or per tensor
// (m[0], s[0]), for C values (C a multiple of 4). a - z is taken in int32 and its product with m
// (0 <= m < 2^31) by vpmuldq, exact; rounding_mul_shift's arithmetic shifts, which AVX2 lacks for
// 64-bit lanes, are logical shifts of v + 2^62 (|v| < 2^62: 2^62 is a multiple of 2^(s-1) for
// s <= 62, so the offset shifts out exactly and is subtracted after). False where some a - z is
// outside int32 (|a| near 2^31, never a layer's output): the caller then takes the row as scalars.
bool requant_row(const int32_t* a, int64_t C, int64_t z, const int64_t* m, const int64_t* s, bool per_channel,
                 int64_t to_zp, int64_t r_lo, int64_t r_hi, int32_t* dst) {
  // a - z fits int32 where a is in [INT32_MIN + max(z, 0), INT32_MAX + min(z, 0)] (|z| <= 2^16)
  const __m128i a_lo = _mm_set1_epi32((int32_t)(INT32_MIN + (z > 0 ? z : 0)));
  const __m128i a_hi = _mm_set1_epi32((int32_t)(INT32_MAX + (z < 0 ? z : 0)));
  const __m128i z32 = _mm_set1_epi32((int32_t)z);
  const __m256i off = _mm256_set1_epi64x(int64_t(1) << 62), one = _mm256_set1_epi64x(1);
  const __m256i zp = _mm256_set1_epi64x(to_zp), lo = _mm256_set1_epi64x(r_lo), hi = _mm256_set1_epi64x(r_hi);
  const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  __m256i mv = _mm256_set1_epi64x(m[0]), sv = _mm256_set1_epi64x(s[0]);
  __m128i bad = _mm_setzero_si128();
  for (int64_t c = 0; c < C; c += 4) {
    if (per_channel) {
      mv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + c));
      sv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c));
    }
    const __m128i av = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + c));
    bad = _mm_or_si128(bad, _mm_or_si128(_mm_cmplt_epi32(av, a_lo), _mm_cmpgt_epi32(av, a_hi)));
    const __m256i x = _mm256_cvtepi32_epi64(_mm_sub_epi32(av, z32));
    const __m256i v = _mm256_mul_epi32(x, mv);  // the low 32 bits of each lane, signed: exact
    const __m256i w = _mm256_srlv_epi64(_mm256_add_epi64(v, off), _mm256_sub_epi64(sv, one));
    // ((w + 1) >> 1) - 2^(62 - s): rounding_mul_shift's value; then + to_zp and saturate
    __m256i q = _mm256_sub_epi64(_mm256_srli_epi64(_mm256_add_epi64(w, one), 1), _mm256_srlv_epi64(off, sv));
    q = _mm256_add_epi64(q, zp);
    q = _mm256_blendv_epi8(q, lo, _mm256_cmpgt_epi64(lo, q));
    q = _mm256_blendv_epi8(q, hi, _mm256_cmpgt_epi64(q, hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c),
                     _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(q, pick)));
  }
  return _mm_testz_si128(bad, bad) != 0;
}

const Kernels kTable{"avx2", 2, kGroup, packed_bytes, pack, gemm,
                     CellLoops<int16_t>::rows, CellLoops<int16_t>::tile, CellLoops<int16_t>::requant,
                     CellLoops<int16_t>::act, no_init, quantize_f32, quantize_f64,
                     quantize_levels_f32, quantize_levels_f64};

}  // namespace
QGRU_ISA_END

const Kernels* avx2_kernels() { return &kTable; }
RequantRowFn avx2_requant_row() { return &requant_row; }
#else
const Kernels* avx2_kernels() { return nullptr; }
RequantRowFn avx2_requant_row() { return nullptr; }
#endif

}  // namespace cpu
}  // namespace qgru

#if defined(__clang__) && QGRU_BUILD_AVX2
#pragma clang attribute pop
#endif
