// The AVX-512 VNNI path (Intel since Cascade Lake / Ice Lake, AMD Zen 4 and later).
//
// GEMM: vpdpbusd multiplies unsigned 8-bit by signed 8-bit values, sums each group of four
// products and adds it to an int32 lane. The activations are signed, so they enter offset by 128
// (a XOR 0x80 = a + 128, in [0, 255]) and the offset is taken out at the end:
//     a . w = (a + 128) . w - 128 colsum(w),
// with colsum(w) stored beside each packed group. vpdpbusd (not the saturating vpdpbusds) adds
// modulo 2^32, and so does the final subtraction: the result is the true a . w modulo 2^32, and
// since |a . w| <= K 2^14 < 2^31 for K < 2^17 (every layer), it is the true value, even where the
// offset sum itself (up to K 255 128) passes 2^31.
// Packed weights (pack_quads.h): groups of 16 output columns; for each quad of K values, the 16
// columns' four int8 values side by side (one 64-byte row), then the group's 16 values of
// 128 colsum (int32).
// The micro-kernel computes up to 8 rows x 3 groups (24 of the 32 zmm registers).
#define QGRU_ISA avx512vnni
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define QGRU_BUILD_VNNI 1
#define QGRU_QUANTIZE_AVX512
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,bmi2,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif
#else
#define QGRU_BUILD_VNNI 0
#endif
#if QGRU_BUILD_VNNI
#include "lanes_avx512.h"  // the int32 cell in explicit 16-lane vectors
#define QGRU_CELL_LANES I32x16
#endif
#include "cell_loops.h"
#include "quantize_block.h"

#if QGRU_BUILD_VNNI
#include <immintrin.h>
#include <string.h>

#include "pack_quads.h"
#endif

namespace qgru {
namespace cpu {
#if QGRU_BUILD_VNNI
QGRU_ISA_BEGIN
namespace {

constexpr int64_t kGroup = 16;

int64_t group_bytes(int64_t K) { return quad_group_bytes<kGroup>(K); }

// acc + the four-product sums of u8 a by s8 b per int32 lane (vpdpbusd, wrapping). gcc 12's
// _mm512_dpbusd_epi32 made every accumulator of the micro-kernel also stored to the stack, and
// copied twice, at every K quad; the same instruction as inline asm leaves them in registers.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
#if defined(__clang__)
  return _mm512_dpbusd_epi32(acc, a, b);
#else
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
#endif
}

template <int MR, int NB>
inline void micro(const GemmArgs& a, const int8_t* A, int64_t r, const int8_t* B, int64_t Kp, int64_t g) {
  const int64_t gb = kGroup * Kp + kGroup * 4;
  __m512i acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi32((int32_t)0x80808080u);
  const int8_t* a0 = A + r * a.lda;
  for (int64_t kq = 0; kq < Kp / 4; ++kq) {
    __m512i b[NB];
    for (int j = 0; j < NB; ++j) b[j] = _mm512_loadu_si512((const void*)(B + j * gb + kq * 4 * kGroup));
    for (int i = 0; i < MR; ++i) {
      int32_t quad;
      memcpy(&quad, a0 + i * a.lda + 4 * kq, 4);
      const __m512i av = _mm512_xor_si512(_mm512_set1_epi32(quad), flip);  // a + 128 as u8
      for (int j = 0; j < NB; ++j) acc[i][j] = dpbusd(acc[i][j], av, b[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512i cs = _mm512_loadu_si512((const void*)(B + j * gb + kGroup * Kp));
    for (int i = 0; i < MR; ++i)
      _mm512_storeu_si512((void*)gemm_out(a, kGroup, g + j, r + i), _mm512_sub_epi32(acc[i][j], cs));
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
  const int64_t Kp = k_padded(a.K), gb = group_bytes(a.K);
  const int8_t* A = static_cast<const int8_t*>(a.A);
  const int8_t* B = static_cast<const int8_t*>(a.B);
  for (int64_t g = a.g0; g < a.g1; g += 3) {
    const int8_t* b = B + g * gb;
    int64_t r = 0;
    for (; r + 8 <= a.rows; r += 8) row_block<8>(a, A, r, b, Kp, g);
    if (a.rows - r >= 4) {
      row_block<4>(a, A, r, b, Kp, g);
      r += 4;
    }
    switch (a.rows - r) {
      case 3: row_block<3>(a, A, r, b, Kp, g); break;
      case 2: row_block<2>(a, A, r, b, Kp, g); break;
      case 1: row_block<1>(a, A, r, b, Kp, g); break;
      default: break;
    }
  }
}

void no_init() {}

const Kernels kTable{"avx512vnni", 1, kGroup, quad_packed_bytes<kGroup>, pack_quads<kGroup>, gemm,
                     CellLoops<int8_t>::rows, CellLoops<int8_t>::tile, CellLoops<int8_t>::requant,
                     CellLoops<int8_t>::act, no_init, quantize_f32, quantize_f64};

}  // namespace
QGRU_ISA_END

const Kernels* avx512vnni_kernels() { return &kTable; }
#else
const Kernels* avx512vnni_kernels() { return nullptr; }
#endif

}  // namespace cpu
}  // namespace qgru

#if defined(__clang__) && QGRU_BUILD_VNNI
#pragma clang attribute pop
#endif
