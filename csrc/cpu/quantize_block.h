// The float boundary's quantize (primitives.quantize) over a block of elements, compiled per
// instruction-set path like cell_loops.h: round_half_up(x / scale) + zp, saturated, NaN flagged.
// gcc (12) leaves the scalar loop scalar whatever its form (measured 2 ns per element, 3 ms per
// call of the benchmark's input), so the AVX-512 and AVX2 forms are written out: the same float64
// operations (one IEEE division, floor, a compare with 1/2), a lane at a time identical to the
// scalar ones. A kernel file defines QGRU_QUANTIZE_AVX512 or QGRU_QUANTIZE_AVX2 before including.
#pragma once

#include <stdint.h>

#include "qgru_fixedpoint.h"

#if defined(QGRU_QUANTIZE_AVX512) || defined(QGRU_QUANTIZE_AVX2)
#include <immintrin.h>
#endif

namespace qgru {
namespace cpu {
QGRU_ISA_BEGIN

// Elements [0, n) of x into q; false if any is NaN. Values have at most 16 bits (r).
template <typename T>
bool quantize_block(const T* x, int32_t* q, int64_t n, double scale, int64_t zp, Range r) {
  const QuantizeBounds bounds = quantize_bounds(r, zp);  // qgru_fixedpoint.h
  const double lo = bounds.lo, hi = bounds.hi;
  bool nan = false;
  int64_t i = 0;
#if defined(QGRU_QUANTIZE_AVX512)
  const __m512d vscale = _mm512_set1_pd(scale), vlo = _mm512_set1_pd(lo), vhi = _mm512_set1_pd(hi);
  const __m512d half = _mm512_set1_pd(0.5);
  const __m512i vzp = _mm512_set1_epi64(zp), one = _mm512_set1_epi64(1);
  const __m512i qlo = _mm512_set1_epi64(r.lo), qhi = _mm512_set1_epi64(r.hi);
  __mmask8 any_nan = 0;
  for (; i + 8 <= n; i += 8) {
    __m512d xv;
    if (sizeof(T) == 4) xv = _mm512_cvtps_pd(_mm256_loadu_ps((const float*)(x + i)));
    else xv = _mm512_loadu_pd((const double*)(x + i));
    __m512d v = _mm512_div_pd(xv, vscale);
    const __mmask8 is_nan = _mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q);
    any_nan |= is_nan;
    v = _mm512_mask_mov_pd(v, is_nan, _mm512_setzero_pd());
    v = _mm512_min_pd(_mm512_max_pd(v, vlo), vhi);
    const __m512d f = _mm512_roundscale_pd(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __mmask8 up = _mm512_cmp_pd_mask(_mm512_sub_pd(v, f), half, _CMP_GE_OQ);
    __m512i k = _mm512_add_epi64(_mm512_cvttpd_epi64(f), vzp);
    k = _mm512_mask_add_epi64(k, up, k, one);
    k = _mm512_min_epi64(_mm512_max_epi64(k, qlo), qhi);
    _mm256_storeu_si256((__m256i*)(q + i), _mm512_cvtepi64_epi32(k));
  }
  nan = any_nan != 0;
#elif defined(QGRU_QUANTIZE_AVX2)
  // v is clamped to [lo, hi], within +-2^17 (zp and the range have at most 16 bits), so its floor
  // converts to int32 exactly (cvttpd of an integral value) and every sum below stays in int32
  const __m256d vscale = _mm256_set1_pd(scale), vlo = _mm256_set1_pd(lo), vhi = _mm256_set1_pd(hi);
  const __m256d half = _mm256_set1_pd(0.5);
  const __m128i vzp = _mm_set1_epi32((int32_t)zp), qlo = _mm_set1_epi32((int32_t)r.lo),
                qhi = _mm_set1_epi32((int32_t)r.hi);
  int any_nan = 0;
  for (; i + 4 <= n; i += 4) {
    __m256d xv;
    if (sizeof(T) == 4) xv = _mm256_cvtps_pd(_mm_loadu_ps((const float*)(x + i)));
    else xv = _mm256_loadu_pd((const double*)(x + i));
    __m256d v = _mm256_div_pd(xv, vscale);
    const __m256d is_nan = _mm256_cmp_pd(v, v, _CMP_UNORD_Q);
    any_nan |= _mm256_movemask_pd(is_nan);
    v = _mm256_andnot_pd(is_nan, v);  // NaN -> +0.0
    v = _mm256_min_pd(_mm256_max_pd(v, vlo), vhi);
    const __m256d f = _mm256_round_pd(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256d up = _mm256_cmp_pd(_mm256_sub_pd(v, f), half, _CMP_GE_OQ);  // all ones where rounding up
    // the 4 64-bit compare masks as 4 int32 lanes (-1 or 0): take the low half of each
    const __m128i up32 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(
        _mm256_castpd_si256(up), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)));
    __m128i k = _mm_sub_epi32(_mm_add_epi32(_mm256_cvttpd_epi32(f), vzp), up32);  // - (-1) = + 1
    k = _mm_min_epi32(_mm_max_epi32(k, qlo), qhi);
    _mm_storeu_si128((__m128i*)(q + i), k);
  }
  nan = any_nan != 0;
#endif
  for (; i < n; ++i) q[i] = quantize_value((double)x[i], scale, zp, r, bounds, &nan);  // qgru_fixedpoint.h
  return !nan;
}

// The minimum and maximum of v[0, n), n >= 1, exactly (min and max of floats are exact, in any
// order; where v holds a NaN the result is unspecified: the caller's quantize flags the NaN).
// One pass in the path's widest float vectors: the driver's scalar loop (baseline x86-64, 4 float
// lanes, two per-token calls) cost the x levels about 5% of a small layer's call (issue 40).
template <typename T>
void min_max(const T* v, int64_t n, T& mn_out, T& mx_out) {
  T mn = v[0], mx = v[0];
  int64_t i = 1;
#if defined(QGRU_QUANTIZE_AVX512)
  if (sizeof(T) == 4 && n >= 16) {
    __m512 a = _mm512_loadu_ps((const float*)v), b = a;
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 x = _mm512_loadu_ps((const float*)v + i);
      a = _mm512_min_ps(a, x);
      b = _mm512_max_ps(b, x);
    }
    mn = (T)_mm512_reduce_min_ps(a);
    mx = (T)_mm512_reduce_max_ps(b);
  } else if (sizeof(T) == 8 && n >= 8) {
    __m512d a = _mm512_loadu_pd((const double*)v), b = a;
    for (i = 8; i + 8 <= n; i += 8) {
      const __m512d x = _mm512_loadu_pd((const double*)v + i);
      a = _mm512_min_pd(a, x);
      b = _mm512_max_pd(b, x);
    }
    mn = (T)_mm512_reduce_min_pd(a);
    mx = (T)_mm512_reduce_max_pd(b);
  }
#elif defined(QGRU_QUANTIZE_AVX2)
  if (sizeof(T) == 4 && n >= 8) {
    __m256 a = _mm256_loadu_ps((const float*)v), b = a;
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 x = _mm256_loadu_ps((const float*)v + i);
      a = _mm256_min_ps(a, x);
      b = _mm256_max_ps(b, x);
    }
    alignas(32) float lo[8], hi[8];
    _mm256_store_ps(lo, a);
    _mm256_store_ps(hi, b);
    for (int k = 0; k < 8; ++k) {
      mn = (T)lo[k] < mn ? (T)lo[k] : mn;
      mx = (T)hi[k] > mx ? (T)hi[k] : mx;
    }
  }
#endif
  for (; i < n; ++i) {
    mn = v[i] < mn ? v[i] : mn;
    mx = v[i] > mx ? v[i] : mx;
  }
  mn_out = mn;
  mx_out = mx;
}

// Every token's level first, then each run of consecutive tokens on one level quantized in one
// quantize_block call (the values are contiguous; the same element-wise integers): per-token calls
// of a few values cost their set-up each (issue 40: I = 16, the x levels' cost).
template <typename T>
bool quantize_levels_block(const T* x, int32_t* q, int32_t* level, int64_t tokens, int64_t I, const XLevelGrid& g,
                           int64_t zp, Range r) {
  for (int64_t t = 0; t < tokens; ++t) {
    T mn, mx;
    min_max(x + t * I, I, mn, mx);
    level[t] = select_level(g, TokenRange{(double)mn, (double)mx});
  }
  bool ok = true;
  for (int64_t t0 = 0, t1; t0 < tokens; t0 = t1) {
    const int32_t j = level[t0];
    for (t1 = t0 + 1; t1 < tokens && level[t1] == j; ++t1) {
    }
    ok = quantize_block(x + t0 * I, q + t0 * I, (t1 - t0) * I, g.scale[j], zp, r) && ok;
  }
  return ok;
}

inline bool quantize_levels_f32(const float* x, int32_t* q, int32_t* level, int64_t tokens, int64_t I,
                                const XLevelGrid& g, int64_t zp, int64_t lo, int64_t hi) {
  return quantize_levels_block(x, q, level, tokens, I, g, zp, Range{lo, hi});
}

inline bool quantize_levels_f64(const double* x, int32_t* q, int32_t* level, int64_t tokens, int64_t I,
                                const XLevelGrid& g, int64_t zp, int64_t lo, int64_t hi) {
  return quantize_levels_block(x, q, level, tokens, I, g, zp, Range{lo, hi});
}

inline bool quantize_f32(const float* x, int32_t* q, int64_t n, double scale, int64_t zp, int64_t lo, int64_t hi) {
  return quantize_block(x, q, n, scale, zp, Range{lo, hi});
}

inline bool quantize_f64(const double* x, int32_t* q, int64_t n, double scale, int64_t zp, int64_t lo, int64_t hi) {
  return quantize_block(x, q, n, scale, zp, Range{lo, hi});
}

QGRU_ISA_END
}  // namespace cpu
}  // namespace qgru
