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

// A function every caller must inline: in the CPU kernels' vector cell a call (through the PLT, as
// gcc kept lookup32 for I32x16 out of line) spills the lanes and measured ~1/5 of the cell's samples
#if defined(__CUDACC__)
#define QGRU_INLINE
#elif defined(__GNUC__) || defined(__clang__)
#define QGRU_INLINE __attribute__((always_inline))
#else
#define QGRU_INLINE
#endif

// The CPU backend compiles the code below once per instruction set (csrc/cpu/kernel_*.cpp, each
// with its own target): each copy lives in its own inline namespace (QGRU_ISA, set by that file
// before any include), so the linker can never hand one path's inline function to another, e.g.
// an AVX2 copy to the portable path of a CPU without AVX2. The structs stay in namespace qgru:
// they are the same types for every path (the kernels' interface passes them).
#ifndef QGRU_ISA
#define QGRU_ISA generic
#endif
#define QGRU_ISA_BEGIN inline namespace QGRU_ISA {
#define QGRU_ISA_END }

namespace qgru {

// Signed range [lo, hi] of a b-bit integer: every stored tensor is saturated to one.
struct Range {
  int64_t lo;
  int64_t hi;
};
QGRU_ISA_BEGIN

QGRU_HD int64_t saturate(int64_t v, Range r) { return v < r.lo ? r.lo : (v > r.hi ? r.hi : v); }

// round_half_up(x * m / 2^s) for 1 <= s <= 62, |x * m| < 2^62 (primitives.rounding_mul_shift).
// Written as ((v >> (s-1)) + 1) >> 1, which equals (v + 2^(s-1)) >> s for every v: with
// v = q 2^(s-1) + r, 0 <= r < 2^(s-1), both are floor((q + 1) / 2). This form has no per-lane
// variable shift of a constant, so gcc vectorises it (AVX-512 vpsravq), and it cannot overflow.
QGRU_HD int64_t rounding_mul_shift(int64_t x, int64_t m, int32_t s) {
  return (((x * m) >> (s - 1)) + 1) >> 1;
}

// The integers of a signed `bits`-bit value (primitives.qrange).
QGRU_HD Range signed_range(int32_t bits) { return Range{-(int64_t(1) << (bits - 1)), (int64_t(1) << (bits - 1)) - 1}; }

// The float boundary (primitives.quantize / dequantize), one element; the CPU paths' vector forms
// (csrc/cpu/quantize_block.h) compute the same float64 operations lane by lane.
// quantize: saturate(round_half_up(x / scale) + zp) on the range r, with x / scale clamped first
// to quantize_bounds (one step beyond what the range can hold, so that +-inf saturate); NaN gives
// 0 and sets *nan.
QGRU_ISA_END
struct QuantizeBounds {
  double lo, hi;
};
QGRU_ISA_BEGIN
QGRU_HD QuantizeBounds quantize_bounds(Range r, int64_t zp) {
  return QuantizeBounds{(double)(r.lo - zp - 1), (double)(r.hi - zp + 1)};
}

QGRU_HD int32_t quantize_value(double x, double scale, int64_t zp, Range r, QuantizeBounds b, bool* nan) {
  double v = x / scale;
  if (v != v) {
    *nan = true;
    v = 0.0;
  }
  v = v < b.lo ? b.lo : (v > b.hi ? b.hi : v);
#if defined(__CUDA_ARCH__)
  const double f = floor(v);
#else
  const double f = __builtin_floor(v);
#endif
  const int64_t rounded = (int64_t)f + ((v - f) >= 0.5 ? 1 : 0);  // round half up, exact
  return (int32_t)saturate(rounded + zp, r);
}

// dequantize: float32((q - zp) * scale) with the product in float64; (double)q - (double)zp is the
// int64 difference exactly (both below 2^53).
QGRU_HD float dequantize_value(int32_t q, double scale, double zp) { return (float)(((double)q - zp) * scale); }

// x levels (golden.XLevels, select_levels): per-token grids of a first layer's float x. Level j
// holds the values in [lo[j], hi[j]] (float64; -inf / +inf where the zero point is at the range's
// end); a token (the I values of x at one time step and batch row) takes the first level that holds
// its minimum and maximum, else the last. Passed by value (CUDA: a kernel argument, nothing to copy
// to the device), so the count is bounded.
QGRU_ISA_END
constexpr int kMaxXLevels = 16;
struct XLevelGrid {
  int32_t count;  // 1 .. kMaxXLevels
  double scale[kMaxXLevels], lo[kMaxXLevels], hi[kMaxXLevels];
};
// The smallest and largest value of a token as the level choice sees them (float64, where every
// float32 and float64 value is exact). Empty: mn = +inf, mx = -inf (every fold below keeps them).
struct TokenRange {
  double mn, mx;
};
QGRU_ISA_BEGIN

QGRU_HD TokenRange token_range_empty() { return TokenRange{__builtin_huge_val(), -__builtin_huge_val()}; }

// Adds one value of the token. A NaN counts as 0.0: the level of a token holding a NaN is then
// golden.select_levels of x.nan_to_num(0.0), the integers the CUDA backend gives for NaN input
// (docs/spec.md section 11; it flags the NaN and quantizes it as 0.0). The CPU backend rejects NaN
// input, so there the level of such a token is never used. (Comparisons with a NaN are false, so
// without this a NaN would be skipped by the minimum and maximum alike: equal for levels that hold
// 0.0, which every level does, but stated here rather than left to the order of the comparisons.)
QGRU_HD void token_range_add(TokenRange& r, double v) {
  v = v != v ? 0.0 : v;
  r.mn = v < r.mn ? v : r.mn;
  r.mx = v > r.mx ? v : r.mx;
}

// Two parts of one token (the lanes of a warp, the threads of a block).
QGRU_HD void token_range_merge(TokenRange& r, const TokenRange& o) {
  r.mn = o.mn < r.mn ? o.mn : r.mn;
  r.mx = o.mx > r.mx ? o.mx : r.mx;
}

// The level of a token from its range: the first level that holds both ends, else the last.
QGRU_HD int32_t select_level(const XLevelGrid& g, const TokenRange& r) {
  for (int32_t j = 0; j < g.count; ++j)
    if (r.mn >= g.lo[j] && r.mx <= g.hi[j]) return j;
  return g.count - 1;
}

// The level of one token of I values at stride 1 (the host's form of the CUDA kernel's warp fold:
// the same adds, in another order, which min and max do not see).
template <typename X>
QGRU_HD int32_t token_level(const XLevelGrid& g, const X* v, int64_t I) {
  TokenRange r = token_range_empty();
  for (int64_t i = 0; i < I; ++i) token_range_add(r, (double)v[i]);
  return select_level(g, r);
}

// round_half_up(v / 2^s) for s >= 0; s = 0 returns v (primitives.rounding_shift).
QGRU_HD int64_t rounding_shift(int64_t v, int32_t s) { return (v + ((int64_t(1) << s) >> 1)) >> s; }

QGRU_ISA_END
// A fixed-point factor, one (multiplier, shift) per channel (per-tensor factors are expanded to
// one entry per channel when the backend's parameters are prepared, so kernels never branch).
// In power-of-two scale mode every multiplier is 2^mult_log2, and x * m is computed as a shift.
struct Rescale {
  const int64_t* mult;
  const int32_t* shift;
  const int32_t* mult_log2;  // log2(mult) when every multiplier is a power of two, else unused
};
QGRU_ISA_BEGIN

// The product of two values that fit in int32 (every q - Z below: |q - Z| < 2^16, and every
// multiplier: m < 2^31), as one signed 32 x 32 -> 64 multiply (vpmuldq) instead of a 64-bit one.
QGRU_HD int64_t mul32(int64_t a, int64_t b) { return (int64_t)(int32_t)a * (int64_t)(int32_t)b; }

// x * 2^k for k >= 0 without the undefined behaviour of shifting a negative value (C++17, CUDA).
QGRU_HD int64_t shift_left(int64_t x, int64_t k) { return (int64_t)((uint64_t)x << k); }

// rounding_mul_shift with the channel's factor. WIDE: the operand may exceed int32 (accumulators,
// products of two q - Z values); otherwise |v| < 2^31. POW2: multipliers are powers of two. All
// four variants compute the same integer (x * m is exact in int64, see rounding_mul_shift).
template <bool POW2, bool WIDE>
QGRU_HD int64_t apply(Rescale r, int64_t c, int64_t v) {
  int64_t prod;
  if (POW2) {
    prod = shift_left(v, r.mult_log2[c]);
  } else if (WIDE) {
    prod = v * r.mult[c];
  } else {
    prod = mul32(v, r.mult[c]);
  }
  return ((prod >> (r.shift[c] - 1)) + 1) >> 1;
}

QGRU_ISA_END
// A sigmoid or tanh table on a b_in-bit grid (tables.lookup): 2^(b_in - k) + 1 entries T with F
// extra fraction bits, linear interpolation inside segments of 2^k inputs (k = F = 0: exact table).
// Stored packed, one int64 per segment: T[i] in the low 32 bits, T[i+1] - T[i] in the high 32
// bits (|T| < 2^(b_out + F + 1) <= 2^21), so a lookup is one load (one gather when vectorised).
struct Table {
  const int64_t* packed;  // [2^(b_in - k)]
  int32_t k;
  int32_t frac;
  int64_t in_min;  // qmin of the input grid
  int64_t out_zp;  // zero point of the output grid
  Range out;       // range of the output bits
};
QGRU_ISA_BEGIN

// Returns the output relative to its zero point (q_out - Z_out), which is what every caller uses.
QGRU_HD int64_t lookup(const Table& t, int64_t q) {
  const int64_t u = q - t.in_min;
  const int64_t i = u >> t.k;
  const int64_t f = u & ((int64_t(1) << t.k) - 1);
  const int64_t e = t.packed[i];
  const int64_t lo = (int64_t)(int32_t)(uint32_t)(uint64_t)e;
  const int64_t diff = e >> 32;
  // f < 2^k and |diff| < 2^22: the interpolation term fits in int32.
  const int64_t v = shift_left(lo, t.k) + mul32(diff, f);
  return saturate(rounding_shift(v, t.k + t.frac) + t.out_zp, t.out) - t.out_zp;
}

QGRU_ISA_END
}  // namespace qgru
