// qgru fixed-point primitives, shared by the C++ CPU backend and the CUDA backend.
//
// Each function is the C form of one function of the golden model (qgru/primitives.py,
// qgru/tables.py) and must return the same integer for every input the golden model can give it.
// All intermediates are int64_t, as in the golden model; docs/spec.md section 6 bounds every
// operand so that no product or sum below can overflow.
//
// Right shifts of negative int64_t are arithmetic (floor division by 2^s) on every compiler qgru
// builds with (gcc, clang, MSVC, nvcc; guaranteed by C++20): that is the rounding rule's floor.
// Left shifts of possibly negative values are written as multiplications (a negative left shift
// is undefined behaviour before C++20).
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define QGRU_HD __host__ __device__ __forceinline__
#define QGRU_UNROLL _Pragma("unroll")
#else
#define QGRU_HD inline
#define QGRU_UNROLL
#endif

namespace qgru {

// Signed range [lo, hi] of a b-bit integer: every stored tensor is saturated to one.
struct Range {
  int64_t lo;
  int64_t hi;
};

QGRU_HD int64_t saturate(int64_t v, Range r) { return v < r.lo ? r.lo : (v > r.hi ? r.hi : v); }

// round_half_up(x * m / 2^s) for 1 <= s <= 62, |x * m| < 2^62 (primitives.rounding_mul_shift).
QGRU_HD int64_t rounding_mul_shift(int64_t x, int64_t m, int32_t s) {
  return (x * m + (int64_t(1) << (s - 1))) >> s;
}

// round_half_up(v / 2^s) for s >= 0; s = 0 returns v (primitives.rounding_shift).
QGRU_HD int64_t rounding_shift(int64_t v, int32_t s) { return (v + ((int64_t(1) << s) >> 1)) >> s; }

// A fixed-point factor, one (multiplier, shift) per channel (per-tensor factors are expanded to
// one entry per channel when the backend's parameters are prepared, so kernels never branch).
struct Rescale {
  const int64_t* mult;
  const int32_t* shift;
};

QGRU_HD int64_t apply(Rescale r, int64_t c, int64_t v) { return rounding_mul_shift(v, r.mult[c], r.shift[c]); }

// A sigmoid or tanh table on a b_in-bit grid (tables.lookup): 2^(b_in - k) + 1 entries with F extra
// fraction bits, linear interpolation inside segments of 2^k inputs (k = F = 0: exact table).
struct Table {
  const int64_t* entries;
  int32_t k;
  int32_t frac;
  int64_t in_min;  // qmin of the input grid
  int64_t out_zp;  // zero point of the output grid
  Range out;       // range of the output bits
};

// Returns the output relative to its zero point (q_out - Z_out), which is what every caller uses.
QGRU_HD int64_t lookup(const Table& t, int64_t q) {
  const int64_t u = q - t.in_min;
  const int64_t i = u >> t.k;
  const int64_t f = u & ((int64_t(1) << t.k) - 1);
  const int64_t lo = t.entries[i];
  const int64_t v = lo * (int64_t(1) << t.k) + (t.entries[i + 1] - lo) * f;
  return saturate(rounding_shift(v, t.k + t.frac) + t.out_zp, t.out) - t.out_zp;
}

}  // namespace qgru
