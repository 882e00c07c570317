// I32x8: eight int32 lanes in one AVX2 register, the lane type (V) that the 256-bit paths
// (kernel_avx2.cpp, kernel_avxvnni.cpp) run the fused step's int32 cell with: lanes_avx512.h's
// I32x16 with half the lanes, for the same reason (mul_hi32 as two vpmuldq and a blend). AVX2 has
// no 64-bit arithmetic shift, so wide_mul_shift32 forms it from the logical one (below). Include
// from those kernel files only, after their target pragma.
//
// Each function is the scalar primitive of qgru_cell.h of the same name, lane by lane, on the
// same integers: the path's tests compare it with the golden model bit for bit.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "qgru_cell.h"

namespace qgru {
QGRU_ISA_BEGIN

struct I32x8 {
  static constexpr int kLanes = 8;
  __m256i v;
  I32x8() = default;
  I32x8(__m256i x) : v(x) {}                     // NOLINT: implicit, the register itself
  I32x8(int32_t x) : v(_mm256_set1_epi32(x)) {}  // NOLINT: implicit, a scalar in every lane
  QGRU_INLINE static I32x8 load(const int32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  void store(int32_t* p) const { _mm256_storeu_si256((__m256i*)p, v); }
};

QGRU_INLINE inline I32x8 operator+(I32x8 a, I32x8 b) { return _mm256_add_epi32(a.v, b.v); }
QGRU_INLINE inline I32x8 operator-(I32x8 a, I32x8 b) { return _mm256_sub_epi32(a.v, b.v); }
QGRU_INLINE inline I32x8 operator*(I32x8 a, I32x8 b) { return _mm256_mullo_epi32(a.v, b.v); }  // low 32 bits
QGRU_INLINE inline I32x8 operator&(I32x8 a, I32x8 b) { return _mm256_and_si256(a.v, b.v); }
QGRU_INLINE inline I32x8 operator>>(I32x8 a, I32x8 k) { return _mm256_srav_epi32(a.v, k.v); }  // arithmetic
QGRU_INLINE inline I32x8 operator>>(I32x8 a, int32_t k) { return _mm256_sra_epi32(a.v, _mm_cvtsi32_si128(k)); }

QGRU_INLINE inline I32x8 clamp32(I32x8 v, I32x8 lo, I32x8 hi) {
  return _mm256_min_epi32(_mm256_max_epi32(v.v, lo.v), hi.v);  // lo <= hi (the layer's checks)
}
QGRU_INLINE inline I32x8 shl32(I32x8 v, I32x8 k) { return _mm256_sllv_epi32(v.v, k.v); }
QGRU_INLINE inline I32x8 shl32(I32x8 v, int32_t k) { return _mm256_sll_epi32(v.v, _mm_cvtsi32_si128(k)); }

// floor(a b / 2^32) per lane (lanes_avx512.h's mul_hi32, 8 lanes); b_odd: b's odd lanes in the
// even positions.
namespace lanes_detail {
QGRU_INLINE inline __m256i mul_hi(__m256i a, __m256i b, __m256i b_odd) {
  const __m256i even = _mm256_mul_epi32(a, b);
  const __m256i odd = _mm256_mul_epi32(_mm256_srli_epi64(a, 32), b_odd);
  return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}
}  // namespace lanes_detail

QGRU_INLINE inline I32x8 mul_hi32(I32x8 a, I32x8 b) { return lanes_detail::mul_hi(a.v, b.v, _mm256_srli_epi64(b.v, 32)); }

// mul_hi32 with the lanes' multipliers at m, the odd lanes' loaded one lane on (lanes_avx512.h).
QGRU_INLINE inline I32x8 mul_hi32_at(I32x8 a, const int32_t* m) {
  return lanes_detail::mul_hi(a.v, _mm256_loadu_si256((const __m256i*)m), _mm256_loadu_si256((const __m256i*)(m + 1)));
}

namespace lanes_detail {
// (int32)(floor(y m / 2^16) >> sh) for the even lanes, in 64-bit lanes. The two shifts by 16 may
// be logical: vpmuldq reads only the low 32 bits of y >> 16 (|y >> 16| < 2^17: the same bits
// either way), and (y & 0xFFFF) m >= 0 (m >= 0). The shift by sh (up to 45) is arithmetic, formed
// as s ^ ((v ^ s) >> sh) with s the sign mask and >> logical.
QGRU_INLINE inline __m256i wide_mul_shift_even(__m256i a, __m256i d, __m256i m, __m256i sh) {
  const __m256i y = _mm256_mul_epi32(a, d);
  const __m256i hi = _mm256_mul_epi32(_mm256_srli_epi64(y, 16), m);
  const __m256i lo = _mm256_srli_epi64(_mm256_mul_epi32(_mm256_and_si256(y, _mm256_set1_epi64x(0xFFFF)), m), 16);
  const __m256i v = _mm256_add_epi64(hi, lo);
  const __m256i sign = _mm256_cmpgt_epi64(_mm256_setzero_si256(), v);
  const __m256i count = _mm256_and_si256(sh, _mm256_set1_epi64x(0xFFFFFFFF));
  return _mm256_xor_si256(sign, _mm256_srlv_epi64(_mm256_xor_si256(v, sign), count));
}
}  // namespace lanes_detail

QGRU_INLINE inline I32x8 wide_mul_shift32(I32x8 a, I32x8 d, I32x8 m, I32x8 sh) {
  const __m256i even = lanes_detail::wide_mul_shift_even(a.v, d.v, m.v, sh.v);
  const __m256i odd = lanes_detail::wide_mul_shift_even(_mm256_srli_epi64(a.v, 32), _mm256_srli_epi64(d.v, 32),
                                                        _mm256_srli_epi64(m.v, 32), _mm256_srli_epi64(sh.v, 32));
  return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

namespace lanes_detail {
// Eight packed entries (e0: lanes 0-3, e1: lanes 4-7) split into their low halves (T[i]) and
// high halves (T[i+1] - T[i]): each 4-entry vector's to its two 128-bit halves, then paired up.
QGRU_INLINE inline void split_entries(__m256i e0, __m256i e1, I32x8& lo, I32x8& diff) {
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i p0 = _mm256_permutevar8x32_epi32(e0, split), p1 = _mm256_permutevar8x32_epi32(e1, split);
  lo = _mm256_permute2x128_si256(p0, p1, 0x20);
  diff = _mm256_permute2x128_si256(p0, p1, 0x31);
}
}  // namespace lanes_detail

// table_entry per lane: two 4-lane 64-bit gathers.
QGRU_INLINE inline void table_entry(const int64_t* packed, I32x8 i, I32x8& lo, I32x8& diff) {
  lanes_detail::split_entries(_mm256_i32gather_epi64((const long long*)packed, _mm256_castsi256_si128(i.v), 8),
                              _mm256_i32gather_epi64((const long long*)packed, _mm256_extracti128_si256(i.v, 1), 8),
                              lo, diff);
}

// table_entry_at per lane (qgru_cell.h lookup32_at: the lanes' values stored at q), in one of two
// ways; the including kernel file picks (each file compiles its own copy of these functions,
// QGRU_ISA):
// * QGRU_LANES_SCALAR_TABLE defined (kernel_avx2.cpp): eight scalar index loads from q (values a
//   previous pass stored, so no store forwarding from one wide store to eight narrow loads to
//   wait on) and eight scalar 64-bit entry loads straight into registers (vmovq / vpinsrq /
//   vinserti128). The avx2 path's CPUs (AMD Zen 1-3, Intel Haswell and Broadwell, Skylake to
//   Tiger Lake under the Gather Data Sampling microcode, which slows their gathers several-fold)
//   gather slowly: on a Zen 3 EPYC, 8 lookups from a 1025-entry table took 4.3-4.6 ns with scalar
//   loads against 7.7-8.3 ns with the gathers of table_entry (same binary, best of 200 rounds,
//   2026-11-26).
// * otherwise: table_entry of the indices computed in the lanes.
QGRU_INLINE inline void table_entry_at(const Table32& t, const int32_t* q, I32x8& lo, I32x8& diff) {
#if defined(QGRU_LANES_SCALAR_TABLE)
  const int64_t* p = t.packed;
  lanes_detail::split_entries(
      _mm256_set_epi64x(p[table_index(t, q[3])], p[table_index(t, q[2])], p[table_index(t, q[1])],
                        p[table_index(t, q[0])]),
      _mm256_set_epi64x(p[table_index(t, q[7])], p[table_index(t, q[6])], p[table_index(t, q[5])],
                        p[table_index(t, q[4])]),
      lo, diff);
#else
  table_entry(t.packed, table_index<I32x8>(t, I32x8::load(q)), lo, diff);
#endif
}

QGRU_INLINE inline void lanes_store(int32_t* p, I32x8 v) { v.store(p); }

// lanes_store_act per lane: (A)v of each lane, for values in A's range (the activation's bits),
// where AVX2's saturating packs and a truncation agree.
QGRU_INLINE inline void lanes_store_act(int8_t* p, I32x8 v) {
  const __m256i a = _mm256_packs_epi32(v.v, v.v);
  const __m256i w = _mm256_packs_epi16(a, a);  // bytes 0-3: lanes 0-3, bytes 16-19: lanes 4-7
  _mm_storel_epi64((__m128i*)p, _mm_unpacklo_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
QGRU_INLINE inline void lanes_store_act(int16_t* p, I32x8 v) {
  const __m256i w = _mm256_packs_epi32(v.v, v.v);  // 16-bit lanes 0-3: lanes 0-3, 8-11: lanes 4-7
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(w, 0x08)));
}

// lanes_store_floats per lane: dequantize_value's float64 operations, four lanes at a time.
QGRU_INLINE inline void lanes_store_floats(float* y, I32x8 v, double scale, double zp) {
  const __m256d sc = _mm256_set1_pd(scale), z = _mm256_set1_pd(zp);
  const __m256d lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(v.v));
  const __m256d hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256(v.v, 1));
  _mm_storeu_ps(y, _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_sub_pd(lo, z), sc)));
  _mm_storeu_ps(y + 4, _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_sub_pd(hi, z), sc)));
}

// mul_add_shift32 per lane (lanes_avx512.h's, 8 lanes): the shift by sh arithmetic from the
// logical one, as in wide_mul_shift_even.
namespace lanes_detail {
QGRU_INLINE inline __m256i mul_add_shift_even(__m256i u1, __m256i t, __m256i m, __m256i sh) {
  const __m256i y = _mm256_add_epi64(_mm256_mul_epi32(u1, m), _mm256_srli_epi64(_mm256_mul_epi32(t, m), 16));
  const __m256i sign = _mm256_cmpgt_epi64(_mm256_setzero_si256(), y);
  const __m256i count = _mm256_and_si256(sh, _mm256_set1_epi64x(0xFFFFFFFF));
  return _mm256_xor_si256(sign, _mm256_srlv_epi64(_mm256_xor_si256(y, sign), count));
}
}  // namespace lanes_detail

QGRU_INLINE inline I32x8 mul_add_shift32(I32x8 u1, I32x8 t, I32x8 m, I32x8 sh) {
  const __m256i even = lanes_detail::mul_add_shift_even(u1.v, t.v, m.v, sh.v);
  const __m256i odd = lanes_detail::mul_add_shift_even(_mm256_srli_epi64(u1.v, 32), _mm256_srli_epi64(t.v, 32),
                                                       _mm256_srli_epi64(m.v, 32), _mm256_srli_epi64(sh.v, 32));
  return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

QGRU_ISA_END
}  // namespace qgru
