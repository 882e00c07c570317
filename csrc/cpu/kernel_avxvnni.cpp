// The AVX-VNNI path: x86-64 CPUs with AVX2 and the VEX-encoded vpdpbusd but no AVX-512 (Intel
// client cores since Alder Lake, whose AVX-512 is fused off, and the E-core Xeons such as Sierra
// Forest). CPUs with AVX-512 VNNI take the avx512vnni path (or amx) instead.
//
// GEMM: the AVX-512 VNNI path's (kernel_avx512vnni.cpp, where the exactness proof is) in 256-bit
// registers. vpdpbusd multiplies unsigned 8-bit by signed 8-bit values and adds each group of
// four products to an int32 lane, modulo 2^32: the activations enter offset by 128 (a XOR 0x80)
// and the GEMM subtracts 128 colsum(w), which gives a . w modulo 2^32, the true value since
// |a . w| <= K 2^14 < 2^31. Per K quad that is 32 products per instruction, against the avx2
// path's 16 (vpmaddwd on operands widened to int16). Weights packed in groups of 8 columns
// (pack_quads.h, one ymm row per K quad). The micro-kernel computes up to 4 rows x 3 groups (12
// of the 16 ymm registers); a batch of one takes one row x 3 groups in two chains per group.
// The cell: the int32 cell in 8-lane vectors (lanes_avx2.h), as on the avx2 path.
#define QGRU_ISA avxvnni
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    (!defined(__GNUC__) || defined(__clang__) || __GNUC__ >= 11)
#define QGRU_BUILD_AVXVNNI 1
#define QGRU_QUANTIZE_AVX2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,bmi2,f16c,popcnt,avxvnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,bmi2,f16c,popcnt,avxvnni")
#endif
#else
#define QGRU_BUILD_AVXVNNI 0  // gcc before 11 has no AVX-VNNI intrinsics
#endif
#if QGRU_BUILD_AVXVNNI
#include "lanes_avx2.h"  // the int32 cell in explicit 8-lane vectors
#define QGRU_CELL_LANES I32x8
#endif
#include "cell_loops.h"
#include "quantize_block.h"

#if QGRU_BUILD_AVXVNNI
#include <immintrin.h>
#include <string.h>

#include "pack_quads.h"
#endif

namespace qgru {
namespace cpu {
#if QGRU_BUILD_AVXVNNI
QGRU_ISA_BEGIN
namespace {

constexpr int64_t kGroup = 8;

// The activation quad of row a at K quad kq, offset to unsigned (a + 128 = a XOR 0x80 per byte),
// in every lane.
inline __m256i quad_at(const int8_t* a, int64_t kq) {
  int32_t quad;
  memcpy(&quad, a + 4 * kq, 4);
  return _mm256_xor_si256(_mm256_set1_epi32(quad), _mm256_set1_epi32((int32_t)0x80808080u));
}

inline __m256i weights_at(const int8_t* b, int64_t kq) {
  return _mm256_loadu_si256((const __m256i*)(b + kq * 4 * kGroup));
}

// acc + the four-product sums of u8 a by s8 b per int32 lane (vpdpbusd, VEX form, wrapping).
// gcc 12's _mm256_dpbusd_avx_epi32 made every accumulator of the micro-kernel also stored to the
// stack and copied at every K quad (the 4 x 3 kernel ran ~1.3x slower); the same instruction as
// inline asm leaves them in registers.
inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
#if defined(__clang__)
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
  __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
  return acc;
#endif
}

// Rows r .. r + MR - 1 x the NB groups from g (B: group g's block, groups gb bytes apart).
template <int MR, int NB>
QGRU_NOINLINE void micro(const GemmArgs& a, const int8_t* A, int64_t r, const int8_t* B, int64_t Kp, int64_t g) {
  const int64_t gb = quad_group_bytes<kGroup>(Kp);
  __m256i acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
  const int8_t* a0 = A + r * a.lda;
  for (int64_t kq = 0; kq < Kp / 4; ++kq) {
    __m256i b[NB];
    for (int j = 0; j < NB; ++j) b[j] = weights_at(B + j * gb, kq);
    for (int i = 0; i < MR; ++i) {
      const __m256i av = quad_at(a0 + i * a.lda, kq);
      for (int j = 0; j < NB; ++j) acc[i][j] = dpbusd(acc[i][j], av, b[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m256i cs = _mm256_loadu_si256((const __m256i*)(B + j * gb + kGroup * Kp));
    for (int i = 0; i < MR; ++i)
      _mm256_storeu_si256((__m256i*)gemm_out(a, kGroup, g + j, r + i), _mm256_sub_epi32(acc[i][j], cs));
  }
}

// One row x NB groups (a batch of one, streaming): two chains per group (even and odd K quads),
// since one chain per group would wait on vpdpbusd's latency.
template <int NB>
QGRU_NOINLINE void micro_row(const GemmArgs& a, const int8_t* A, int64_t r, const int8_t* B, int64_t Kp, int64_t g) {
  const int64_t gb = quad_group_bytes<kGroup>(Kp);
  __m256i even[NB], odd[NB];
  for (int j = 0; j < NB; ++j) even[j] = odd[j] = _mm256_setzero_si256();
  const int8_t* a0 = A + r * a.lda;
  for (int64_t kq = 0; kq < Kp / 4; kq += 2) {  // Kp / 4 is even: Kp is a multiple of 64
    const __m256i av = quad_at(a0, kq), aw = quad_at(a0, kq + 1);
    for (int j = 0; j < NB; ++j) {
      even[j] = dpbusd(even[j], av, weights_at(B + j * gb, kq));
      odd[j] = dpbusd(odd[j], aw, weights_at(B + j * gb, kq + 1));
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m256i cs = _mm256_loadu_si256((const __m256i*)(B + j * gb + kGroup * Kp));
    _mm256_storeu_si256((__m256i*)gemm_out(a, kGroup, g + j, r),
                        _mm256_sub_epi32(_mm256_add_epi32(even[j], odd[j]), cs));
  }
}

template <int MR>
void row_block(const GemmArgs& a, const int8_t* A, int64_t r, const int8_t* B, int64_t Kp, int64_t g) {
  const int64_t left = a.g1 - g;
  if (left >= 3) micro<MR, 3>(a, A, r, B, Kp, g);
  else if (left == 2) micro<MR, 2>(a, A, r, B, Kp, g);
  else micro<MR, 1>(a, A, r, B, Kp, g);
}

void gemm(const GemmArgs& a) {
  const int64_t Kp = k_padded(a.K), gb = quad_group_bytes<kGroup>(a.K);
  const int8_t* A = static_cast<const int8_t*>(a.A);
  const int8_t* B = static_cast<const int8_t*>(a.B);
  for (int64_t g = a.g0; g < a.g1; g += 3) {
    const int8_t* b = B + g * gb;
    const int64_t left = a.g1 - g;
    if (a.rows == 1) {
      if (left >= 3) micro_row<3>(a, A, 0, b, Kp, g);
      else if (left == 2) micro_row<2>(a, A, 0, b, Kp, g);
      else micro_row<1>(a, A, 0, b, Kp, g);
      continue;
    }
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

const Kernels kTable{"avxvnni", 1, kGroup, quad_packed_bytes<kGroup>, pack_quads<kGroup>, gemm,
                     CellLoops<int8_t>::rows, CellLoops<int8_t>::tile, CellLoops<int8_t>::requant,
                     CellLoops<int8_t>::act, no_init, quantize_f32, quantize_f64};

}  // namespace
QGRU_ISA_END

const Kernels* avxvnni_kernels() { return &kTable; }
#else
const Kernels* avxvnni_kernels() { return nullptr; }
#endif

}  // namespace cpu
}  // namespace qgru

#if defined(__clang__) && QGRU_BUILD_AVXVNNI
#pragma clang attribute pop
#endif
