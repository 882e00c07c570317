// I32x16: sixteen int32 lanes in one AVX-512 register, the lane type (V) that the AVX-512 paths
// (kernel_amx.cpp, kernel_avx512vnni.cpp) run the int32 cell with (qgru_cell.h: every function of
// the int32 cell is written once, over V). Include from those kernel files only, after their
// target pragma.
//
// Why not leave the loop to the compiler, as the other paths do: the multiplier form's
// mul_hi32(a, b) = floor(a b / 2^32) is one 32 x 32 -> 64 product per lane. gcc 12 vectorises it
// by sign-extending both operands to 64-bit lanes and multiplying with vpmullq (3 uops, 15 cycles
// of latency on Sapphire Rapids), about 12 instructions per 16 lanes; vpmuldq multiplies the even
// lanes' int32 values into int64 exactly in one uop, so even and odd lanes take one each, and a
// blend puts the high halves back in place: 5 instructions.
//
// Each function below is the scalar primitive of qgru_cell.h of the same name, lane by lane, on
// the same integers (two's complement wrap-around where the scalar form is exact, so the same
// values): the path's tests compare it with the golden model bit for bit.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "qgru_cell.h"

namespace qgru {
QGRU_ISA_BEGIN

struct I32x16 {
  static constexpr int kLanes = 16;
  __m512i v;
  I32x16() = default;
  I32x16(__m512i x) : v(x) {}                      // NOLINT: implicit, the register itself
  I32x16(int32_t x) : v(_mm512_set1_epi32(x)) {}   // NOLINT: implicit, a scalar in every lane
  QGRU_INLINE static I32x16 load(const int32_t* p) { return _mm512_loadu_si512(p); }
  void store(int32_t* p) const { _mm512_storeu_si512(p, v); }
};

QGRU_INLINE inline I32x16 operator+(I32x16 a, I32x16 b) { return _mm512_add_epi32(a.v, b.v); }
QGRU_INLINE inline I32x16 operator-(I32x16 a, I32x16 b) { return _mm512_sub_epi32(a.v, b.v); }
QGRU_INLINE inline I32x16 operator*(I32x16 a, I32x16 b) { return _mm512_mullo_epi32(a.v, b.v); }  // low 32 bits
QGRU_INLINE inline I32x16 operator&(I32x16 a, I32x16 b) { return _mm512_and_si512(a.v, b.v); }
QGRU_INLINE inline I32x16 operator>>(I32x16 a, I32x16 k) { return _mm512_srav_epi32(a.v, k.v); }  // arithmetic
QGRU_INLINE inline I32x16 operator>>(I32x16 a, int32_t k) { return _mm512_sra_epi32(a.v, _mm_cvtsi32_si128(k)); }

QGRU_INLINE inline I32x16 clamp32(I32x16 v, I32x16 lo, I32x16 hi) {
  return _mm512_min_epi32(_mm512_max_epi32(v.v, lo.v), hi.v);  // lo <= hi (the layer's checks)
}
QGRU_INLINE inline I32x16 shl32(I32x16 v, I32x16 k) { return _mm512_sllv_epi32(v.v, k.v); }
QGRU_INLINE inline I32x16 shl32(I32x16 v, int32_t k) { return _mm512_sll_epi32(v.v, _mm_cvtsi32_si128(k)); }

// floor(a b / 2^32) per lane: vpmuldq takes each 64-bit lane's low int32 (the even lanes; the odd
// ones after a 32-bit shift down) and gives the exact int64 product. b_odd: b's odd lanes in the
// even positions.
namespace lanes_detail {
QGRU_INLINE inline __m512i mul_hi(__m512i a, __m512i b, __m512i b_odd) {
  const __m512i even = _mm512_mul_epi32(a, b);
  const __m512i odd = _mm512_mul_epi32(_mm512_srli_epi64(a, 32), b_odd);
  // odd lanes: the high half of their product, in place; even lanes: the high half of theirs,
  // moved down by a masked vpshufd (one instruction for a shift and a blend)
  return _mm512_mask_shuffle_epi32(odd, 0x5555, even, _MM_PERM_CDAB);
}
}  // namespace lanes_detail

QGRU_INLINE inline I32x16 mul_hi32(I32x16 a, I32x16 b) {
  return lanes_detail::mul_hi(a.v, b.v, _mm512_srli_epi64(b.v, 32));
}

// mul_hi32 with the lanes' multipliers at m: the odd lanes' from a load one lane on (m + 1: lane
// 2i holds m[2i + 1], what vpmuldq reads), not a shift of the even load (one vector instruction
// fewer per multiply: the int32 cell is bound by its vector instructions).
QGRU_INLINE inline I32x16 mul_hi32_at(I32x16 a, const int32_t* m) {
  return lanes_detail::mul_hi(a.v, _mm512_loadu_si512(m), _mm512_loadu_si512(m + 1));
}

// wide_mul_shift32 per lane: (int32)(floor(y m / 2^16) >> sh), y = a d, in 64-bit lanes, even and
// odd lanes apart (the scalar form's own int64 arithmetic, lane by lane).
namespace lanes_detail {
QGRU_INLINE inline __m512i wide_mul_shift_even(__m512i a, __m512i d, __m512i m, __m512i sh) {
  const __m512i y = _mm512_mul_epi32(a, d);                                 // a d, int64
  const __m512i hi = _mm512_mul_epi32(_mm512_srai_epi64(y, 16), m);         // (y >> 16) m
  const __m512i lo = _mm512_srai_epi64(_mm512_mul_epi32(_mm512_and_si512(y, _mm512_set1_epi64(0xFFFF)), m), 16);
  const __m512i count = _mm512_and_si512(sh, _mm512_set1_epi64(0xFFFFFFFF));  // the lane's own shift
  return _mm512_srav_epi64(_mm512_add_epi64(hi, lo), count);
}
}  // namespace lanes_detail

QGRU_INLINE inline I32x16 wide_mul_shift32(I32x16 a, I32x16 d, I32x16 m, I32x16 sh) {
  const __m512i even = lanes_detail::wide_mul_shift_even(a.v, d.v, m.v, sh.v);
  const __m512i odd = lanes_detail::wide_mul_shift_even(_mm512_srli_epi64(a.v, 32), _mm512_srli_epi64(d.v, 32),
                                                        _mm512_srli_epi64(m.v, 32), _mm512_srli_epi64(sh.v, 32));
  // each result is an int32 in its 64-bit lane's low half: the odd ones move up into place
  return _mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CDAB);
}

namespace lanes_detail {
// Sixteen packed entries (e0: lanes 0-7, e1: lanes 8-15) split into their low halves (T[i]) and
// high halves (T[i+1] - T[i]), each into one register.
QGRU_INLINE inline void split_entries(__m512i e0, __m512i e1, I32x16& lo, I32x16& diff) {
  const __m512i low = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  lo = _mm512_permutex2var_epi32(e0, low, e1);
  diff = _mm512_permutex2var_epi32(e0, _mm512_add_epi32(low, _mm512_set1_epi32(1)), e1);
}
}  // namespace lanes_detail

// table_entry per lane: two 8-lane 64-bit gathers.
QGRU_INLINE inline void table_entry(const int64_t* packed, I32x16 i, I32x16& lo, I32x16& diff) {
  lanes_detail::split_entries(_mm512_i32gather_epi64(_mm512_castsi512_si256(i.v), packed, 8),
                              _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(i.v, 1), packed, 8), lo, diff);
}

// table_entry_at per lane (qgru_cell.h lookup32_at: the lanes' values stored at q), in one of two
// ways; the including kernel file picks:
// * QGRU_LANES_SCALAR_TABLE defined (kernel_avx512vnni.cpp): sixteen scalar index loads from q
//   (values a previous pass stored: no store forwarding to wait on) and sixteen scalar 64-bit
//   entry loads straight into registers (vmovq / vpinsrq / vinserti128). On AMD Zen 4, 16 lookups
//   from a 1025-entry table took ~4 ns this way against ~6.5 ns with the two gathers of
//   table_entry (microbenchmark, 2026-11-28); Intel's AVX-512 VNNI CPUs before Sapphire Rapids
//   gather slowly under the Gather Data Sampling microcode (lanes_avx2.h).
// * otherwise: table_entry of the indices computed in the lanes.
QGRU_INLINE inline void table_entry_at(const Table32& t, const int32_t* q, I32x16& lo, I32x16& diff) {
#if defined(QGRU_LANES_SCALAR_TABLE)
  const int64_t* p = t.packed;
  __m128i x[8];
  for (int l = 0; l < 8; ++l)
    x[l] = _mm_insert_epi64(_mm_cvtsi64_si128(p[table_index(t, q[2 * l])]), p[table_index(t, q[2 * l + 1])], 1);
  lanes_detail::split_entries(
      _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(x[1], x[0])), _mm256_set_m128i(x[3], x[2]), 1),
      _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(x[5], x[4])), _mm256_set_m128i(x[7], x[6]), 1),
      lo, diff);
#else
  table_entry(t.packed, table_index<I32x16>(t, I32x16::load(q)), lo, diff);
#endif
}

QGRU_INLINE inline void lanes_store(int32_t* p, I32x16 v) { v.store(p); }

// lanes_store_act per lane: truncating narrowing stores (vpmovdb, vpmovdw), (A)v of each lane.
QGRU_INLINE inline void lanes_store_act(int8_t* p, I32x16 v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(v.v)); }
QGRU_INLINE inline void lanes_store_act(int16_t* p, I32x16 v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(v.v));
}

// lanes_store_floats per lane: dequantize_value's float64 operations, eight lanes at a time.
QGRU_INLINE inline void lanes_store_floats(float* y, I32x16 v, double scale, double zp) {
  const __m512d sc = _mm512_set1_pd(scale), z = _mm512_set1_pd(zp);
  const __m512d lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(v.v));
  const __m512d hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(v.v, 1));
  _mm256_storeu_ps(y, _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_sub_pd(lo, z), sc)));
  _mm256_storeu_ps(y + 8, _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_sub_pd(hi, z), sc)));
}

// mul_add_shift32 per lane (qgru_cell.h, the wide accumulators' multiplier form): even and odd
// lanes apart in 64-bit lanes, as wide_mul_shift32. t m >= 0 (t, m >= 0), so its shift by 16 may
// be logical; the shift by sh is arithmetic (vpsravq).
namespace lanes_detail {
QGRU_INLINE inline __m512i mul_add_shift_even(__m512i u1, __m512i t, __m512i m, __m512i sh) {
  const __m512i y = _mm512_add_epi64(_mm512_mul_epi32(u1, m), _mm512_srli_epi64(_mm512_mul_epi32(t, m), 16));
  return _mm512_srav_epi64(y, _mm512_and_si512(sh, _mm512_set1_epi64(0xFFFFFFFF)));
}
}  // namespace lanes_detail

QGRU_INLINE inline I32x16 mul_add_shift32(I32x16 u1, I32x16 t, I32x16 m, I32x16 sh) {
  const __m512i even = lanes_detail::mul_add_shift_even(u1.v, t.v, m.v, sh.v);
  const __m512i odd = lanes_detail::mul_add_shift_even(_mm512_srli_epi64(u1.v, 32), _mm512_srli_epi64(t.v, 32),
                                                       _mm512_srli_epi64(m.v, 32), _mm512_srli_epi64(sh.v, 32));
  return _mm512_mask_shuffle_epi32(even, 0xAAAA, odd, _MM_PERM_CDAB);
}

QGRU_ISA_END
}  // namespace qgru
