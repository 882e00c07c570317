// The integer GRU cell, shared by the CPU and CUDA backends: seed 001's computeR / computeZ /
// computeG / computeH, the accumulator requantization, and the exact product assembled from int8
// GEMMs. The contract is qgru/golden.py (gru_step, input_gemm); docs/spec.md names every tensor.
//
// Parameters are plain structs of raw pointers and values, valid on the device that runs the code
// (host memory for the CPU backend, device memory for CUDA). Per-tensor quantities are expanded to
// one entry per channel when the parameters are prepared (qgru/native.py), so the code is the
// same for every granularity.
#pragma once

#include <type_traits>

#include "qgru_fixedpoint.h"

namespace qgru {
QGRU_ISA_BEGIN

// ---------------------------------------------------------------------------------------------
// Exact integer products from int8 x int8 -> int32 GEMMs
// ---------------------------------------------------------------------------------------------
// An operand of up to 16 bits is written as int8 limbs, v = sum_i scale_i * (limb_i + offset_i)
// (8 bits: one limb; 16 bits: lo = (v & 255) - 128 with offset 128, hi = v >> 8). The product
// a . w over K then expands, for every pair p = (activation limb i, weight limb j), into
//     scale_i scale_j [ G_p + d_j rowsum(a_i) + c_i colsum(w_j) + c_i d_j K ],   G_p = a_i . w_j
// The last two terms are constants per channel and are folded into the bias when the parameters
// are prepared. rowsum(a_i) (needed only for 16-bit weights, d_j != 0) is read from an extra
// "ones" output channel appended to every weight limb matrix. Each G_p is exact in int32 for
// K < 2^17 (|G_p| <= K 2^14 < 2^31), the sum is exact in int64 (< 2^49).
constexpr int kMaxPairs = 4;

QGRU_ISA_END
struct LimbProducts {
  const int32_t* G[kMaxPairs];   // [rows, ld] int32 GEMM outputs, one per limb pair
  int64_t scale[kMaxPairs];      // scale_i * scale_j
  int64_t weight_offset[kMaxPairs];  // d_j
  int64_t ld;                    // row stride of every G_p (padded channel count)
  int64_t ones_col;              // the column holding rowsum(a_i) when any d_j != 0, else 0
};
QGRU_ISA_BEGIN

// The exact product a[row] . w[c] (without bias), for NPAIRS limb pairs. One pair means 8-bit
// operands on both sides: scale 1, offset 0, the GEMM output itself.
template <int NPAIRS>
QGRU_HD int64_t exact_product(const LimbProducts& g, int64_t row, int64_t c) {
  if (NPAIRS == 1) return g.G[0][row * g.ld + c];
  int64_t acc = 0;
  QGRU_UNROLL
  for (int p = 0; p < NPAIRS; ++p) {
    const int32_t* G = g.G[p] + row * g.ld;
    // Branch-free (so the CPU loop vectorises): with 8-bit weights the offset is 0 and ones_col
    // is any valid column.
    acc += g.scale[p] * ((int64_t)G[c] + g.weight_offset[p] * (int64_t)G[g.ones_col]);
  }
  return acc;
}

// ---------------------------------------------------------------------------------------------
// The recurrent operand (golden.recurrent_operand): what the R.h GEMM reads. Without an h_gemm
// tensor, the state h itself; with one, h requantized onto h_gemm's narrower grid every step,
// sat(rescale(q_h - Z_h) + Z_op), so the state keeps its bits and the GEMM takes fewer limbs.
// |q_h - Z_h| < 2^16 and the multiplier has at most 31 bits (convert.operand_bounds), so the
// product fits the 32 x 32 -> 64 multiply of apply<false, false> (pow2 multipliers included).
QGRU_ISA_END
struct HOperand {
  int32_t on;       // 0: the GEMM reads h itself (the other fields unused)
  Rescale rescale;  // [1] S_h / S_op
  int64_t h_zp, zp;
  Range out;        // h_gemm's bits
};
QGRU_ISA_BEGIN

QGRU_HD int64_t gemm_operand(const HOperand& o, int64_t q_h) {
  if (!o.on) return q_h;
  return saturate(apply<false, false>(o.rescale, 0, q_h - o.h_zp) + o.zp, o.out);
}

// One int8 limb of a value of `bits` bits (1 or 2 limbs, as described above).
QGRU_HD int8_t act_limb(int64_t v, int32_t bits, int limb) {
  if (bits <= 8) return (int8_t)v;
  return limb == 0 ? (int8_t)((v & 255) - 128) : (int8_t)(v >> 8);
}

QGRU_ISA_END
// ---------------------------------------------------------------------------------------------
// Accumulator -> Wx / Rh (seed 001 steps 2 and 3.1)
// ---------------------------------------------------------------------------------------------
struct AccRequant {
  const int64_t* bias;  // [3H] b - zp_comp + the constant limb terms
  Rescale rescale;      // [3H] S_W S_x / S_Wx (or S_R S_h / S_Rh)
  const int64_t* zp;    // [3H] zero point of Wx / Rh
  Range out;            // Wx / Rh bits
};
QGRU_ISA_BEGIN

// q - Z of Wx (or Rh) at channel c from the exact product: sat(rescale(acc) + Z) - Z.
template <bool POW2>
QGRU_HD int64_t requantize_acc(const AccRequant& a, int64_t c, int64_t product) {
  const int64_t acc = product + a.bias[c];
  return saturate(apply<POW2, true>(a.rescale, c, acc) + a.zp[c], a.out) - a.zp[c];
}

QGRU_ISA_END
// The same result in int32 lanes (twice as many per vector), for the common case of 8-bit
// operands (one limb pair), in two forms (the template flag POW2; qgru/native.py, _add_acc32,
// derives the fields and checks every bound below per layer, else the int64 path runs):
//
// * pow2 scales, where the rescale is ((v << L) >> (s - 1) + 1) >> 1 (rounding_mul_shift with
//   m = 2^L), i.e. v >> R rounded, R = shift - 1 - log2(mult), and K < 2^16. In int32:
//     v' = ((G + a1) << lsh) >> rsh) + a0, then (v' + 1) >> 1, with fields a0 = bias_hi,
//   a1 = bias_lo, rsh = rshift and lsh = mult (the multiplier form's mult field; no multiplier here):
//   - 1 <= R <= 30: lsh = 0, rsh = R, bias = bias_hi 2^R + bias_lo with 0 <= bias_lo < 2^R:
//       floor((G + bias) / 2^R) = floor((G + bias_lo) / 2^R) + bias_hi.
//     |G| <= K 2^14 <= 2^30 and |bias| <= 2^31 give |G + bias_lo| <= 2^30 + 2^R - 1 < 2^31 and
//     |v'| <= (2^30 + 2^R) / 2^R + 2^31 / 2^R <= 2^29 + 1 + 2^30 < 2^31 - 1: every term fits int32.
//   - R <= 0 (a factor of at least 1/2: the Wx / Rh grid as fine as the products', seen in pow2
//     layers with few inputs and on the wider x levels): lsh = -R, rsh = 0, bias_hi = 0,
//     bias_lo = bias, so v' = (G + bias) 2^(-R) = (v << L) >> (s - 1) exactly; prepare checks
//     (K 2^14 + |bias|) 2^(-R) <= 2^31 - 2 (so v' and v' + 1 fit int32), which also bounds lsh <= 16.
//   Then round half up as in rounding_mul_shift: (v' + 1) >> 1.
// * multiplier scales (m < 2^31, shift s): floor(v m / 2^(s-1)) = floor(mul_hi32(v 2^lsh, m) / 2^rsh)
//   with lsh = max(0, 33 - s), rsh = max(0, s - 33) (both floors are exact: floor(floor(y / 2^32)
//   / 2^rsh) = floor(y / 2^(32 + rsh)), and 32 + rsh - lsh = s - 1), where v = G + bias and
//   (K 2^14 + |bias|) 2^lsh < 2^31 per channel. Then |mul_hi32| < 2^30: every term fits int32.
struct AccRequant32 {
  const int32_t* bias_hi;  // pow2: bias_hi; multiplier: the whole bias
  const int32_t* bias_lo;  // pow2: bias_lo; multiplier: lsh
  const int32_t* rshift;   // pow2: R; multiplier: rsh
  const int32_t* zp;
  const int32_t* mult;     // multiplier: m; pow2: lsh (the narrow form's; the wide form's are 0, unused)
  int32_t lo, hi;
};
QGRU_ISA_BEGIN

// The int32 cell's functions are templates over V, the type that holds one value per int32 lane:
// int32_t (CUDA, and the CPU loops the compiler vectorises) or an explicit SIMD vector
// (csrc/cpu/lanes_avx512.h, lanes_avx2.h: the fused step's cell on those paths). A vector type
// brings the operators + - * & >> and its own forms of the few primitives below that are not
// plain operators (clamp32, mul_hi32, shl32, lanes_load / lanes_store, table_entry,
// wide_mul_shift32), each the same integers lane by lane; everything built from them is written
// once, here.
QGRU_HD int32_t clamp32(int32_t v, int32_t lo, int32_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The V at p (one lane: *p; a vector: its lanes' consecutive values).
template <typename V>
QGRU_HD QGRU_INLINE V lanes_load(const int32_t* p) { return V::load(p); }
template <>
QGRU_HD int32_t lanes_load<int32_t>(const int32_t* p) { return *p; }
QGRU_HD void lanes_store(int32_t* p, int32_t v) { *p = v; }

// The lanes as activation limbs of type A (int8_t or int16_t, values in its range) at p, and as
// floats (dequantize_value) at y. (A vector type brings its own: lanes_avx512.h, lanes_avx2.h.)
template <typename A>
QGRU_HD void lanes_store_act(A* p, int32_t v) { *p = (A)v; }
QGRU_HD void lanes_store_floats(float* y, int32_t v, double scale, double zp) { *y = dequantize_value(v, scale, zp); }

// floor(a b / 2^32): the high half of the exact signed 64-bit product. (gcc 12 vectorises it with
// 64-bit lane multiplies, about 12 instructions per 16 lanes; lanes_avx512.h's form takes 5.)
QGRU_HD int32_t mul_hi32(int32_t a, int32_t b) { return (int32_t)(((int64_t)a * (int64_t)b) >> 32); }

// v * 2^k without the undefined behaviour of shifting a negative value (the bounds keep it exact).
QGRU_HD int32_t shl32(int32_t v, int32_t k) { return (int32_t)((uint32_t)v << k); }

// mul_hi32(a, *m) per lane, the lanes' multipliers at m (an array of at least lanes + 1 values: a
// vector type may read its odd lanes' multipliers one lane on, lanes_avx512.h).
QGRU_HD int32_t mul_hi32_at(int32_t a, const int32_t* m) { return mul_hi32(a, *m); }

// rounding_mul_shift of v in int32 lanes: pow2, ((v << lsh) >> rsh + 1) >> 1 (mul unused);
// multiplier, (mul(v << lsh) >> rsh + 1) >> 1 with mul(u) = mul_hi32(u, m) (see AccRequant32 for
// both identities).
template <bool POW2, typename V, typename Mul>
QGRU_HD QGRU_INLINE V rescale32_by(V v, V lsh, V rsh, Mul mul) {
  const V u = shl32(v, lsh);
  return ((POW2 ? u >> rsh : mul(u) >> rsh) + 1) >> 1;
}

template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V rescale32(V v, V m, V lsh, V rsh) {
  return rescale32_by<POW2, V>(v, lsh, rsh, [m](V u) { return mul_hi32(u, m); });
}

// The int32 requantization of one accumulator from its channel's fields (AccRequant32's meaning
// of a0, a1, rsh per form; mul(u) = mul_hi32(u, m) in multiplier form, shl32(u, lsh) in pow2
// form, lsh the mult field), relative to its zero
// point Z: clamp(round + Z, lo, hi) - Z, taken as clamp(round, lo - Z, hi - Z) from lo_z = lo - Z
// and hi_z = hi - Z (the same integers, every term far inside int32; the channel fields hold lo_z
// and hi_z themselves: two vector instructions fewer per requantization).
template <bool POW2, typename V, typename Mul>
QGRU_HD QGRU_INLINE V requant32_by(V product, V a0, V a1, V rsh, Mul mul, V lo_z, V hi_z) {
  const V v = POW2 ? (mul(product + a1) >> rsh) + a0 : mul(shl32(product + a0, a1)) >> rsh;
  return clamp32((v + 1) >> 1, lo_z, hi_z);
}

// m: the mult field (multiplier form: the multiplier; pow2: lsh).
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V requant32(V product, V a0, V a1, V rsh, V zp, V m, int32_t lo, int32_t hi) {
  return requant32_by<POW2, V>(product, a0, a1, rsh, [m](V u) { return POW2 ? shl32(u, m) : mul_hi32(u, m); },
                               V(lo) - zp, V(hi) - zp);
}

template <bool POW2>
QGRU_HD int32_t requantize_acc32(const AccRequant32& a, int64_t c, int32_t product) {
  return requant32<POW2>(product, a.bias_hi[c], a.bias_lo[c], a.rshift[c], a.zp[c], a.mult[c], a.lo, a.hi);
}

// requantize_acc of the limb products at (row, c), for the kernels' template flags (ACC32, set
// only with one limb pair: the int32 form above).
template <int NPAIRS, bool POW2, bool ACC32>
QGRU_HD int64_t requantize_product(const AccRequant& a, const AccRequant32& a32, const LimbProducts& g,
                                   int64_t row, int64_t c) {
  if (ACC32) return requantize_acc32<POW2>(a32, c, g.G[0][row * g.ld + c]);
  return requantize_acc<POW2>(a, c, exact_product<NPAIRS>(g, row, c));
}

// x levels (golden.input_gemm with `level`): W.x of a token on level j is requantized with that
// level's bias and rescale (same zero point and range). A Layer with levels keeps them as [J, 3H]
// arrays, level j's channel c at j 3H + c, in both forms (AccRequant's bias and rescale, and
// AccRequant32's bias_hi, bias_lo, rshift, mult: every level passed the int32 bounds, or the layer
// runs the int64 form); level 0 is the static grid's. A row's requantization is the layer's
// AccRequant(32) with those pointers moved to its level: `offset` = level 3H (the zero point is
// shared and stays).
QGRU_HD AccRequant at_level(const AccRequant& a, int64_t offset) {
  return AccRequant{a.bias + offset, Rescale{a.rescale.mult + offset, a.rescale.shift + offset,
                                             a.rescale.mult_log2 + offset},
                    a.zp, a.out};
}

QGRU_HD AccRequant32 at_level(const AccRequant32& a, int64_t offset) {
  if (a.bias_hi == nullptr) return a;  // no int32 form
  return AccRequant32{a.bias_hi + offset, a.bias_lo + offset, a.rshift + offset, a.zp, a.mult + offset, a.lo, a.hi};
}

// requantize_acc32 in V lanes from the flat arrays of an AccRequant32 (channels c .. c + lanes - 1):
// the fused step's W.x of a row on its level.
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V requant32_flat(const AccRequant32& a, int64_t c, V product) {
  return requant32<POW2, V>(product, lanes_load<V>(a.bias_hi + c), lanes_load<V>(a.bias_lo + c),
                            lanes_load<V>(a.rshift + c), lanes_load<V>(a.zp + c), lanes_load<V>(a.mult + c), a.lo,
                            a.hi);
}

QGRU_ISA_END
// ---------------------------------------------------------------------------------------------
// The gates
// ---------------------------------------------------------------------------------------------
struct SigmoidGate {  // r or z
  Rescale from_wx;    // [H] S_Wx / S_pre (the gate's slice)
  Rescale from_rh;    // [H] S_Rh / S_pre
  int64_t pre_zp;
  Range pre;
  Table table;
};
QGRU_ISA_BEGIN

// ---------------------------------------------------------------------------------------------
// The int32 cell: the same step in int32 lanes, for layers where prepare_layer proved every
// intermediate fits (the ACC32 flag: 8-bit GEMM operands x, W, R and h, or h_gemm with a state h
// of up to 16 bits, and the bounds below), in the two forms of AccRequant32 (template flag POW2).
// * pow2: a rescale with multiplier 2^L and shift s is
//     ((v << L) >> (s - 1) + 1) >> 1 = ((v << lsh) >> rsh + 1) >> 1,  R = s - 1 - L,
//   with rsh = max(R, 0), lsh = max(-R, 0) (for R < 0 both sides equal v << (-R - 1)).
//   Bounds (checked in qgru/native.py, _add_acc32): |q - Z| < 2^16 and lsh <= 14 keep (v << lsh)
//   < 2^30; the r * Rh_g product (< 2^32) is never formed: with d_r = 256 a1 + a0 (d_r >= 0, the
//   sigmoid's zero point is qmin), floor(d_r d / 2^R) = floor((a1 d + floor(a0 d / 2^8)) / 2^(R-8))
//   for R >= 8, all terms < 2^25 (|d| < 2^17); z * h (up to 2^32 with a 16-bit state) the same
//   way (rescale_wide32, R >= 8); (1 - z) * g lies in
//   [-2^(b_z + b_g - 1), 2^b_z (2^(b_g - 1) - 1)], inside int32 for b_z, b_g <= 16; table terms
//   < 2^29.
// * multiplier: a rescale (m, s) is (mul_hi32(v << lsh, m) >> rsh + 1) >> 1 with lsh = max(0, 33 - s),
//   rsh = max(0, s - 33) (rescale32). Bounds (_add_acc32): every input v of a rescale lies in an
//   interval [v_lo, v_hi] known from its grids, with v_lo 2^lsh >= -2^31 and v_hi 2^lsh < 2^31;
//   then |mul_hi32| <= 2^30 and each rounded term is at most 2^29 in magnitude, so the sums of two
//   terms and a zero point fit int32. r * Rh_g and z * h (< 2^32 each) are formed in int64
//   (y = d_r d, one 32 x 32 -> 64 product) and rescaled without a 64 x 64 product:
//     floor(y m / 2^16) = (y >> 16) m + floor((y & 0xFFFF) m / 2^16),
//   both products 32 x 32 -> 64, then >> (s - 17), for s >= 17 and max|y| m / 2^(s-1) < 2^29 (so
//   the result fits int32 beside the other terms).
//
// Every per-channel value the int32 cell reads (the rescales' shifts, multipliers and the int32
// requantization of Wx and Rh for each gate, 47 in all, then a padding row; pow2 layers leave the
// rescales' multiplier fields at 0 and keep the requantizations' lsh in theirs) lives in one channel-blocked array, [ceil(H / 128)][field][128]
// (qgru/native.py, CELL32_FIELDS, in the order of Cell32Field). A CPU loop over the channels of
// one block then reads every field at a constant offset from one pointer. As 35 separate arrays
// they took 35 base registers, which gcc kept on the stack and reloaded in every iteration
// (~130 of the loop's ~470 instructions; the cell ran ~8% slower).
constexpr int64_t kCell32Block = 128;
QGRU_ISA_END
enum Cell32Field : int {
  kRWxLsh, kRWxRsh, kRRhLsh, kRRhRsh,  // lsh, rsh of r's rescales from Wx_r and from Rh_r
  kZWxLsh, kZWxRsh, kZRhLsh, kZRhRsh,  // the same for z: kRWxLsh + 4 gate, gate 0 r, 1 z
  kGWxLsh, kGWxRsh,
  kGRRhRsh,         // r * Rh_g -> g_pre: pow2, R (>= 8; no left shift); multiplier, s - 17
  kRhRequant = 11,  // Rh of gate q (0 r, 1 z, 2 g): kRhRequant + 4 q + {0 bias_hi, 1 bias_lo, 2 R, 3 lo_z}
                    // (multiplier: {0 bias, 1 lsh, 2 rsh, 3 lo_z}, see AccRequant32); lo_z = lo - Z and
                    // hi_z = hi - Z (at kHiZ + q), the clamp's range relative to the zero point
  kWxRequant = 23,  // the same for Wx
  kMult = 35,       // multiplier form: m of the rescale whose lsh is field f at kMult + f / 2
                    // (f = kRWxLsh ... kGWxLsh), of r * Rh_g at kMult + 5, of gate q's Rh
                    // requantization at kMult + 6 + q and of its Wx requantization at kMult + 9 + q;
                    // pow2 form: 0 at kMult + 0 .. 5, the requantizations' lsh at kMult + 6 .. 11
                    // (AccRequant32; 0 in the wide form)
  kHiZ = 47,        // hi_z of gate q's Rh requantization at kHiZ + q, of its Wx requantization at kHiZ + 3 + q
  kPad = 53,        // zeros: a vector's read of the last multiplier field one lane on (mul_hi32_at)
                    // stays inside the array
  kCell32Fields = 54
};

struct Channel32 {  // one channel's fields: field f at at[f * kCell32Block]
  const int32_t* at;
};
QGRU_ISA_BEGIN

template <typename V = int32_t>
QGRU_HD QGRU_INLINE V field(Channel32 c, int f) { return lanes_load<V>(c.at + f * kCell32Block); }

// Channel j of the blocked array.
QGRU_HD Channel32 channel32(const int32_t* blocked, int64_t j) {
  return Channel32{blocked + (j / kCell32Block) * (kCell32Fields * kCell32Block) + j % kCell32Block};
}

// mul_hi32(u, m) with m the channels' multiplier field f (mul_hi32_at: the padding field after the
// last one keeps the read one lane on inside the array).
template <typename V>
QGRU_HD QGRU_INLINE V mul_hi32_field(V u, Channel32 c, int f) {
  return mul_hi32_at(u, c.at + f * kCell32Block);
}

// The int32 requantization of gate q's accumulator (group kRhRequant or kWxRequant), its clamp's
// bounds relative to the zero point from the fields (lo_z and hi_z, Cell32Field).
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V requant32_at(Channel32 c, int group, int q, V product) {
  const int f = group + 4 * q, gq = (group - kRhRequant) / 4 + q, fm = kMult + 6 + gq;
  return requant32_by<POW2, V>(product, field<V>(c, f), field<V>(c, f + 1), field<V>(c, f + 2),
                               [c, fm](V u) { return POW2 ? shl32(u, field<V>(c, fm)) : mul_hi32_field<V>(u, c, fm); },
                               field<V>(c, f + 3), field<V>(c, kHiZ + gq));
}

// The rescale whose shifts are fields lsh_field (lsh) and lsh_field + 1 (rsh).
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V apply32(Channel32 c, int lsh_field, V v) {
  const int fm = kMult + lsh_field / 2;
  return rescale32_by<POW2, V>(v, field<V>(c, lsh_field), field<V>(c, lsh_field + 1),
                               [c, fm](V u) { return mul_hi32_field<V>(u, c, fm); });
}

QGRU_ISA_END
struct Table32 {  // tables.lookup in int32 lanes, on the packed entries of Table
  const int64_t* packed;  // T[i] in the low 32 bits, T[i+1] - T[i] in the high 32 bits
  int32_t k, frac, in_min, out_zp, out_lo, out_hi;
};
QGRU_ISA_BEGIN

// The entry (segment) of table t that holds input q: (q - in_min) >> k. The one definition for
// every lookup form (lookup32, lookup32_at, and the lane files' table_entry_at).
template <typename V = int32_t>
QGRU_HD QGRU_INLINE V table_index(const Table32& t, V q) {
  return (q - t.in_min) >> t.k;
}

// Entry i of a packed table: T[i] (lo) and T[i+1] - T[i] (diff), one 64-bit load (one gather lane).
QGRU_HD void table_entry(const int64_t* packed, int32_t i, int32_t& lo, int32_t& diff) {
  const int64_t e = packed[i];
  lo = (int32_t)e;
  diff = (int32_t)(e >> 32);
}

// The interpolation of lookup32 from u = q - in_min and the entry of segment u >> k.
// (clamp(x + Z, lo, hi) - Z taken as clamp(x, lo - Z, hi - Z): the same integers, no term near
// 2^31; two vector instructions fewer per lookup)
template <typename V = int32_t>
QGRU_HD QGRU_INLINE V interpolate32(const Table32& t, V u, V lo, V diff) {
  const V f = u & ((1 << t.k) - 1);
  const V v = shl32(lo, t.k) + diff * f;
  const int32_t s = t.k + t.frac;
  return clamp32((v + ((1 << s) >> 1)) >> s, t.out_lo - t.out_zp, t.out_hi - t.out_zp);
}

template <typename V = int32_t>
QGRU_HD QGRU_INLINE V lookup32(const Table32& t, V q) {
  V lo, diff;
  table_entry(t.packed, table_index<V>(t, q), lo, diff);
  return interpolate32<V>(t, q - t.in_min, lo, diff);
}

// The entry table_index(q[l]) of each lane l, from the lanes' values stored at q.
QGRU_HD void table_entry_at(const Table32& t, const int32_t* q, int32_t& lo, int32_t& diff) {
  table_entry(t.packed, table_index(t, *q), lo, diff);
}

// lookup32 of the lanes' values stored at q, the same integers. A vector type's table_entry_at
// (csrc/cpu/lanes_avx512.h, lanes_avx2.h) may read the indices from memory with scalar loads: on
// AMD Zen 4 a gather, or scalar loads of indices just stored from a register (store forwarding
// from one wide store to many narrow loads), took ~6.6 ns per 16 lookups, scalar loads of indices
// computed from values stored a pass earlier ~4 ns.
template <typename V = int32_t>
QGRU_HD QGRU_INLINE V lookup32_at(const Table32& t, const int32_t* q) {
  V lo, diff;
  table_entry_at(t, q, lo, diff);
  return interpolate32<V>(t, lanes_load<V>(q) - t.in_min, lo, diff);
}

QGRU_ISA_END
struct Cell32 {
  const int32_t* channels;  // [ceil(H / 128)][kCell32Fields][128], see Cell32Field
  int32_t zh_m, zh_sh;           // z * h -> h (rescale_wide32): multiplier (multiplier form), shift
  int32_t zg_m, zg_lsh, zg_rsh;  // (1 - z) * g -> h
  int32_t pre_zp[3], pre_lo[3], pre_hi[3];  // r_pre, z_pre, g_pre
  Table32 table[3];                         // r, z, g
  int32_t one_z, h_zp, h_lo, h_hi;
  int32_t wx_lo, wx_hi, rh_lo, rh_hi;  // ranges of Wx and Rh
  int32_t hg_m, hg_lsh, hg_rsh, hg_zp, hg_lo, hg_hi;  // h -> h_gemm (rescale32), when the layer has one
};
QGRU_ISA_BEGIN

// computeR (gate 0) or computeZ (gate 1) in int32 up to the table: the gate's pre-activation
// (on its table's input grid, saturated) from its raw R.h accumulator and Wx - Z_Wx.
// (sigmoid_pre32_d: the same from Rh - Z_Rh already requantized, d_rh; the wide accumulators'
// form of csrc/cpu/cell_loops.h cell_tile requantizes them itself)
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V sigmoid_pre32_d(const Cell32& p, Channel32 ch, int gate, V d_rh, V d_wx) {
  const int f = kRWxLsh + 4 * gate;
  return clamp32(apply32<POW2, V>(ch, f, d_wx) + apply32<POW2, V>(ch, f + 2, d_rh) + p.pre_zp[gate],
                 p.pre_lo[gate], p.pre_hi[gate]);
}

template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V sigmoid_pre32(const Cell32& p, Channel32 ch, int gate, V acc_rh, V d_wx) {
  return sigmoid_pre32_d<POW2, V>(p, ch, gate, requant32_at<POW2, V>(ch, kRhRequant, gate, acc_rh),
                                  d_wx);
}

// The multiplier form's floor(a d m / 2^(16 + sh)) (rescale_wide32), in int64 (|a d| < 2^33).
QGRU_HD int32_t wide_mul_shift32(int32_t a, int32_t d, int32_t m, int32_t sh) {
  const int64_t y = (int64_t)a * d;
  const int64_t y_m_16 = mul32(y >> 16, m) + (mul32(y & 0xFFFF, m) >> 16);  // floor(y m / 2^16)
  return (int32_t)(y_m_16 >> sh);
}

// The rescale of a product a d that may pass int32 (a a gate's output, 0 <= a < 2^16, and
// |d| < 2^17), without forming it in int32: pow2, sh = R >= 8 and the split a = 256 a1 + a0;
// multiplier, sh = s - 17 and floor(y m / 2^16) from two 32 x 32 -> 64 products (the int32 cell's
// bounds above). Used for r * Rh_g and for z * h (a 16-bit state makes z * h up to 2^32).
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V rescale_wide32(V a, V d, V m, V sh) {
  if (POW2) {
    const V a1 = a >> 8, a0 = a & 255;
    return (((a1 * d + ((a0 * d) >> 8)) >> (sh - 8)) + 1) >> 1;
  }
  return (wide_mul_shift32(a, d, m, sh) + 1) >> 1;
}

// The rescale of r * Rh_g onto g_pre.
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V rrh32(Channel32 ch, V d_r, V d_rh_g) {
  return rescale_wide32<POW2, V>(d_r, d_rh_g, POW2 ? V(0) : field<V>(ch, kMult + 5), field<V>(ch, kGRRhRsh));
}

// computeG in int32 up to the table: g's pre-activation from its raw R.h accumulator, Wx_g - Z
// and the gate r (its table output relative to its zero point).
// (candidate_pre32_d: the same from Rh_g - Z_Rh already requantized, d_rh_g)
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V candidate_pre32_d(const Cell32& p, Channel32 ch, V d_rh_g, V d_wx_g, V d_r) {
  return clamp32(apply32<POW2, V>(ch, kGWxLsh, d_wx_g) + rrh32<POW2, V>(ch, d_r, d_rh_g) + p.pre_zp[2],
                 p.pre_lo[2], p.pre_hi[2]);
}

template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V candidate_pre32(const Cell32& p, Channel32 ch, V acc_rh_g, V d_wx_g, V d_r) {
  return candidate_pre32_d<POW2, V>(p, ch, requant32_at<POW2, V>(ch, kRhRequant, 2, acc_rh_g),
                                    d_wx_g, d_r);
}

// computeH in int32: the new state from the candidate's table output d_g, the gate z and the
// state h.
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V new_state32(const Cell32& p, V d_g, V d_z, V q_h) {
  const V zh = rescale_wide32<POW2, V>(d_z, q_h - p.h_zp, p.zh_m, p.zh_sh);
  const V zg = rescale32<POW2, V>((V(p.one_z) - d_z) * d_g, p.zg_m, p.zg_lsh, p.zg_rsh);
  return clamp32(zh + zg + p.h_zp, p.h_lo, p.h_hi);
}

// ---------------------------------------------------------------------------------------------
// Wide accumulators (issue 40: w8a16 on the CPU's int16 paths): the int32 cell from a GEMM
// output G that is exact in int32 but may use all of it (a 16-bit activation taken whole times
// 8-bit weights: |G| <= 2^15 max_c sum_k |w_ck| < 2^31, prepare.direct16_fits), where AccRequant32's
// int32 forms (|G| <= 2^30, G + bias inside int32) do not hold. The requantization of G to Wx / Rh
// is exact in int32 lanes by splitting the sum G + bias; everything after it is the int32 cell
// above (sigmoid_pre32_d, candidate_pre32_d take the requantized d_rh and d_wx). Same fields as
// AccRequant32 (the Cell32 groups kRhRequant / kWxRequant and the flat Wx / Wxl arrays), other
// meanings (qgru/native/prepare.py _requant_wide derives them and checks the bounds per channel):
// * pow2, R = shift - 1 - log2(mult) in [1, 30]: bias_hi = floor(bias / 2^R), bias_lo = bias mod
//   2^R, and floor((G + bias) / 2^R) = (G >> R) + (((G & (2^R - 1)) + bias_lo) >> R) + bias_hi:
//   (G & (2^R - 1)) + bias_lo < 2^(R+1) <= 2^31, the middle term is 0 or 1, and prepare checks
//   |bias_hi| + 2^(31 - R) + 2 < 2^31.
// * multiplier (m, s), s >= 17: bias = B1 2^16 + B0 (0 <= B0 < 2^16; fields bias_hi = B1,
//   bias_lo = B0, rshift = s - 17, mult = m). With u1 = (G >> 16) + B1 and t = (G & 0xFFFF) + B0
//   (0 <= t < 2^17), G + bias = u1 2^16 + t and
//     floor((G + bias) m / 2^(s-1)) = floor((u1 m + floor(t m / 2^16)) / 2^(s-17))
//   (two 32 x 32 -> 64 products, mul_add_shift32). prepare checks |B1| + 2^15 < 2^31 (u1 fits)
//   and (max|G| + |bias|) m / 2^(s-1) < 2^30 per channel (the result fits int32 with room).
// Then, as requant32: round half up, add Z, saturate, subtract Z (as one clamp relative to Z).

// floor((u1 m + floor(t m / 2^16)) / 2^sh) as int32 (the caller's bounds keep it in range), for
// t, m >= 0; in int64 (lanes_avx512.h, lanes_avx2.h: the same in 64-bit lanes).
QGRU_HD int32_t mul_add_shift32(int32_t u1, int32_t t, int32_t m, int32_t sh) {
  const int64_t y = (int64_t)u1 * (int64_t)m + (((int64_t)t * (int64_t)m) >> 16);
  return (int32_t)(y >> sh);
}

// requant32's result (q - Z of Wx or Rh) from a wide accumulator, with the fields above, its clamp's
// bounds relative to the zero point (lo_z = lo - Z, hi_z = hi - Z, as requant32_by).
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V requant_wide32(V product, V a0, V a1, V rsh, V m, V lo_z, V hi_z) {
  V v;
  if (POW2) {
    const V mask = shl32(V(1), rsh) - V(1);
    v = (product >> rsh) + (((product & mask) + a1) >> rsh) + a0;
  } else {
    v = mul_add_shift32((product >> 16) + a0, (product & V(0xFFFF)) + a1, m, rsh);
  }
  return clamp32((v + 1) >> 1, lo_z, hi_z);
}

// requant32_at's wide form: gate q's accumulator from the channel's group (kRhRequant or kWxRequant).
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V requant_wide32_at(Channel32 c, int group, int q, V product) {
  const int f = group + 4 * q, gq = (group - kRhRequant) / 4 + q;
  const V m = POW2 ? V(0) : field<V>(c, kMult + 6 + gq);
  return requant_wide32<POW2, V>(product, field<V>(c, f), field<V>(c, f + 1), field<V>(c, f + 2), m,
                                 field<V>(c, f + 3), field<V>(c, kHiZ + gq));
}

// requant32_flat's wide form (W.x of a row on its x level, from the flat arrays).
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V requant_wide32_flat(const AccRequant32& a, int64_t c, V product) {
  const V zp = lanes_load<V>(a.zp + c);
  return requant_wide32<POW2, V>(product, lanes_load<V>(a.bias_hi + c), lanes_load<V>(a.bias_lo + c),
                                 lanes_load<V>(a.rshift + c), POW2 ? V(0) : lanes_load<V>(a.mult + c), V(a.lo) - zp,
                                 V(a.hi) - zp);
}

// gemm_operand in int32 (layers with an h_gemm): |q_h - Z_h| < 2^17 and the bounds of rescale32
// (_add_acc32 checks them with the others).
template <bool POW2, typename V = int32_t>
QGRU_HD QGRU_INLINE V gemm_operand32(const Cell32& p, V q_h) {
  return clamp32(rescale32<POW2, V>(q_h - p.h_zp, V(p.hg_m), V(p.hg_lsh), V(p.hg_rsh)) + p.hg_zp, p.hg_lo, p.hg_hi);
}

// One element of one step from the three gates' int32 R.h accumulators and Wx - Z_Wx: the int32
// form of gru_cell_acc, its pieces in the order the CPU's fused step runs them as three passes
// over a task (cpu/cell_loops.h cell_tile says why): computeR and computeZ (pre-activation, then
// table: each gate's output relative to its zero point), computeG's pre-activation and table,
// computeH.
template <bool POW2>
QGRU_HD int32_t gru_cell32(const Cell32& p, Channel32 ch, int32_t acc_r, int32_t acc_z, int32_t acc_g, int32_t d_wx_r,
                           int32_t d_wx_z, int32_t d_wx_g, int32_t q_h) {
  const int32_t d_r = lookup32(p.table[0], sigmoid_pre32<POW2>(p, ch, 0, acc_r, d_wx_r));
  const int32_t d_z = lookup32(p.table[1], sigmoid_pre32<POW2>(p, ch, 1, acc_z, d_wx_z));
  const int32_t d_g = lookup32(p.table[2], candidate_pre32<POW2>(p, ch, acc_g, d_wx_g, d_r));
  return new_state32<POW2>(p, d_g, d_z, q_h);
}

// gru_cell32 from the gates' Rh - Z_Rh already requantized (d_rh_*): the hybrid cell's int32 part
// (its accumulators are the int64 exact products of any limb pairs, requantized by requantize_acc;
// qgru/native/prepare.py _add_hybrid32 checks the gates' bounds, which do not involve them).
template <bool POW2>
QGRU_HD int32_t gru_cell32_d(const Cell32& p, Channel32 ch, int32_t d_rh_r, int32_t d_rh_z, int32_t d_rh_g,
                             int32_t d_wx_r, int32_t d_wx_z, int32_t d_wx_g, int32_t q_h) {
  const int32_t d_r = lookup32(p.table[0], sigmoid_pre32_d<POW2>(p, ch, 0, d_rh_r, d_wx_r));
  const int32_t d_z = lookup32(p.table[1], sigmoid_pre32_d<POW2>(p, ch, 1, d_rh_z, d_wx_z));
  const int32_t d_g = lookup32(p.table[2], candidate_pre32_d<POW2>(p, ch, d_rh_g, d_wx_g, d_r));
  return new_state32<POW2>(p, d_g, d_z, q_h);
}

QGRU_ISA_END
struct CellParams {
  int64_t H;
  Cell32 c32;         // the int32 form, valid when the kernel's ACC32 flag is set
  AccRequant rh;      // R.h accumulator -> Rh
  SigmoidGate r, z;
  Rescale g_from_wx;  // [H] S_Wx_g / S_gpre
  Rescale g_from_rrh; // [H] S_r S_Rh_g / S_gpre
  int64_t g_pre_zp;
  Range g_pre;
  Table g;
  Rescale zh;         // [1] S_z           (z * h -> h)
  Rescale zg;         // [1] S_z S_g / S_h ((1 - z) * g -> h)
  int64_t one_z;      // 1.0 on z's grid, relative to its zero point
  int64_t h_zp;
  Range h;
  HOperand op;        // the next step's R.h operand from the new state (gemm_operand)
};
QGRU_ISA_BEGIN

// computeR / computeZ: d = table(sat(Wx_gate + Rh_gate + Z_pre)) - Z_out.
template <bool POW2>
QGRU_HD int64_t sigmoid_gate(const SigmoidGate& s, int64_t j, int64_t d_wx, int64_t d_rh) {
  const int64_t pre =
      saturate(apply<POW2, false>(s.from_wx, j, d_wx) + apply<POW2, false>(s.from_rh, j, d_rh) + s.pre_zp, s.pre);
  return lookup(s.table, pre);
}

template <bool POW2>
QGRU_HD int64_t computeR(const CellParams& p, int64_t j, int64_t d_wx_r, int64_t d_rh_r) {
  return sigmoid_gate<POW2>(p.r, j, d_wx_r, d_rh_r);
}

template <bool POW2>
QGRU_HD int64_t computeZ(const CellParams& p, int64_t j, int64_t d_wx_z, int64_t d_rh_z) {
  return sigmoid_gate<POW2>(p.z, j, d_wx_z, d_rh_z);
}

// computeG: g = tanh(Wx_g + r * Rh_g); the product r * Rh_g is rescaled straight into g_pre.
template <bool POW2>
QGRU_HD int64_t computeG(const CellParams& p, int64_t j, int64_t d_wx_g, int64_t d_rh_g, int64_t d_r) {
  const int64_t pre = saturate(
      apply<POW2, false>(p.g_from_wx, j, d_wx_g) + apply<POW2, true>(p.g_from_rrh, j, mul32(d_r, d_rh_g)) + p.g_pre_zp,
      p.g_pre);
  return lookup(p.g, pre);
}

// computeH: h' = z * h + (1 - z) * g, with 1 - z on z's own grid (one_z - d_z).
template <bool POW2>
QGRU_HD int64_t computeH(const CellParams& p, int64_t d_z, int64_t d_g, int64_t q_h) {
  const int64_t h_new = apply<POW2, true>(p.zh, 0, mul32(d_z, q_h - p.h_zp)) +
                        apply<POW2, true>(p.zg, 0, mul32(p.one_z - d_z, d_g)) + p.h_zp;
  return saturate(h_new, p.h);
}

// Channel j's fields of the int32 cell when the kernel runs it (ACC32), else none. Vectorised CPU
// loops over the channels of one 128-channel block take its first channel's pointer and step from
// it (qgru_cpu.cpp), so that every field is at a constant offset.
template <bool ACC32>
QGRU_HD Channel32 cell32_channel(const CellParams& p, int64_t j) {
  return ACC32 ? channel32(p.c32.channels, j) : Channel32{nullptr};
}

// One element (batch row n, channel j) of one time step from its three raw R.h accumulators,
// when R.h is one int8 x int8 GEMM (one limb pair: h and R of at most 8 bits), so the accumulator
// is the exact product: golden.gru_step. d_wx: the three gates' Wx - Z_Wx at channel j; ch: channel
// j's int32 fields (cell32_channel), read only with ACC32.
template <bool POW2, bool ACC32>
QGRU_HD int64_t gru_cell_acc(const CellParams& p, int64_t j, Channel32 ch, int32_t acc_r, int32_t acc_z,
                             int32_t acc_g, int32_t d_wx_r, int32_t d_wx_z, int32_t d_wx_g, int64_t q_h) {
  if (ACC32) return gru_cell32<POW2>(p.c32, ch, acc_r, acc_z, acc_g, d_wx_r, d_wx_z, d_wx_g, (int32_t)q_h);
  const int64_t H = p.H;
  const int64_t d_r = computeR<POW2>(p, j, d_wx_r, requantize_acc<POW2>(p.rh, j, acc_r));
  const int64_t d_z = computeZ<POW2>(p, j, d_wx_z, requantize_acc<POW2>(p.rh, H + j, acc_z));
  const int64_t d_g = computeG<POW2>(p, j, d_wx_g, requantize_acc<POW2>(p.rh, 2 * H + j, acc_g), d_r);
  return computeH<POW2>(p, d_z, d_g, q_h);
}

// One element (channel j) of one time step: golden.gru_step. d_wx points at the row's 3H values of
// Wx - Z_Wx; the R.h products of gates r, z, g are row `row`'s columns col, col + stride and
// col + 2 stride of the limb GEMMs' output (gru_cell: the layer's own layout, column j, stride H;
// the persistent kernel's block-local products, qgru_persistent.h: its unit's column, stride units).
template <int NPAIRS, bool POW2, bool ACC32>
QGRU_HD int64_t gru_cell_at(const CellParams& p, const LimbProducts& rh_products, int64_t row, int64_t col,
                            int64_t stride, int64_t j, Channel32 ch, const int32_t* d_wx, int64_t q_h) {
  const int64_t H = p.H;
  if (NPAIRS == 1) {
    const int32_t* G = rh_products.G[0] + row * rh_products.ld;
    return gru_cell_acc<POW2, ACC32>(p, j, ch, G[col], G[stride + col], G[2 * stride + col], d_wx[j], d_wx[H + j],
                                     d_wx[2 * H + j], q_h);
  }
  // two or more limb pairs: never the int32 form (prepare_layer enables it with one pair only)
  const int64_t d_rh_r = requantize_acc<POW2>(p.rh, j, exact_product<NPAIRS>(rh_products, row, col));
  const int64_t d_rh_z = requantize_acc<POW2>(p.rh, H + j, exact_product<NPAIRS>(rh_products, row, stride + col));
  const int64_t d_rh_g =
      requantize_acc<POW2>(p.rh, 2 * H + j, exact_product<NPAIRS>(rh_products, row, 2 * stride + col));
  const int64_t d_r = computeR<POW2>(p, j, d_wx[j], d_rh_r);
  const int64_t d_z = computeZ<POW2>(p, j, d_wx[H + j], d_rh_z);
  const int64_t d_g = computeG<POW2>(p, j, d_wx[2 * H + j], d_rh_g, d_r);
  return computeH<POW2>(p, d_z, d_g, q_h);
}

// One element (batch row n, channel j) of one time step: golden.gru_step, from the layer's own
// R.h products (row n, column j of each gate's H).
template <int NPAIRS, bool POW2, bool ACC32>
QGRU_HD int64_t gru_cell(const CellParams& p, const LimbProducts& rh_products, int64_t n, int64_t j, Channel32 ch,
                         const int32_t* d_wx, int64_t q_h) {
  return gru_cell_at<NPAIRS, POW2, ACC32>(p, rh_products, n, j, p.H, j, ch, d_wx, q_h);
}

// Calls f(NPAIRS, POW2, ACC32), as std::integral_constant values, with the kernel template flags
// of a layer: its limb-pair count, power-of-two multipliers, and the int32 path (which
// prepare_layer only enables with one pair; in either scale mode). Host code; both backends
// dispatch with it.
template <typename F>
inline void dispatch_kernel(int64_t pairs, bool pow2, bool acc32, F&& f) {
  using T = std::true_type;
  using Fl = std::false_type;
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  if (pairs == 1) {
    if (acc32) pow2 ? f(One{}, T{}, T{}) : f(One{}, Fl{}, T{});
    else if (pow2) f(One{}, T{}, Fl{});
    else f(One{}, Fl{}, Fl{});
  } else if (pairs == 2) {
    pow2 ? f(Two{}, T{}, Fl{}) : f(Two{}, Fl{}, Fl{});
  } else {
    pow2 ? f(Four{}, T{}, Fl{}) : f(Four{}, Fl{}, Fl{});
  }
}

QGRU_ISA_END
}  // namespace qgru
