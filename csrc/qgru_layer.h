// Host-side glue shared by the CPU and CUDA bindings: turns the prepared parameter tensors of one
// layer and direction (qgru/native.py, `prepare_layer`) into the plain structs of qgru_cell.h.
// The tensors live on the backend's device and are owned by the Layer object, so the raw pointers
// stay valid for its lifetime.
//
// The kernels index tables, per-channel arrays and GEMM outputs with values they are handed, and
// shift by others. Constructing a LayerTensors checks every one of them (validate()), whatever
// made the tensors, so that no parameters can make native code read or write out of bounds or
// shift by an undefined amount: a bad layer is a clear error at preparation, never a crash or an
// output that depends on unrelated memory. (qgru/export.py checks files against the full spec
// when they are loaded; this is the backstop in front of the raw pointers.)
#pragma once

#include <ATen/ATen.h>  // (no torch/extension.h: the cpu library that holds the operator has no Python)

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qgru_cell.h"
#include "qgru_check.h"

namespace qgru {

using TensorMap = std::map<std::string, at::Tensor>;
using IntMap = std::map<std::string, int64_t>;

// The float boundary's arguments (quantize: x / scale, then a zero point on a `bits`-bit grid):
// bits in [2, 16] (signed_range shifts by bits - 1), a zero point within 2^16 and a positive scale
// (a NaN or non-positive scale would turn every element into NaN or an infinity). The bounds keep
// every intermediate of quantize_value and its vector forms within +-2^17.
inline void check_quantize_args(const char* who, double scale, int64_t zp, int64_t bits) {
  QGRU_CHECK(bits >= 2 && bits <= 16 && zp >= -(int64_t(1) << 16) && zp <= (int64_t(1) << 16) && scale > 0,
              who, ": bits ", bits, ", zero point ", zp, ", scale ", scale, " out of range");
}

// requantize's arguments: rounding_mul_shift's domain, |(q - from_zp) mult| < 2^63 for int32 q
// and a shift in [1, 62], and a target grid of 2 to 16 bits (both backends' requantize and Stacks).
inline void check_requantize_args(const char* who, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                                  int64_t to_bits) {
  QGRU_CHECK(to_bits >= 2 && to_bits <= 16 && std::abs(from_zp) <= (int64_t(1) << 16) &&
                  std::abs(to_zp) <= (int64_t(1) << 16) && mult >= 0 && mult < (int64_t(1) << 31) && shift >= 1 &&
                  shift <= 62,
              who, ": to_bits ", to_bits, ", zero points ", from_zp, " and ", to_zp, ", multiplier ", mult, ", shift ",
              shift, " out of range");
}

// A Stack's per-layer values (q[l] = S_x, Z_x, bits_x, S_h, Z_h, bits_h, multiplier and shift of
// S_h,l-1 / S_x,l; qgru/native stack_values), checked against its Layers once, when a Stack is made
// (the CPU's and the CUDA's: Layer has hidden_size, input_size, x_bits, state_range and state_zp).
// same_place(a, b): whether Layer b can read Layer a's output where it is (the CUDA Stack: one
// device). The calls the Stack makes with the values are checked here too (quantize_into and
// requantize check them again, as every entry point does).
template <class Layer, class SamePlace>
void check_stack_values(const char* who, const std::vector<std::shared_ptr<Layer>>& layers,
                        const std::vector<std::vector<double>>& q, SamePlace same_place) {
  QGRU_CHECK(!layers.empty() && layers.size() == q.size(), who, ": one parameter row per Layer");
  const std::string name(who);
  for (size_t l = 0; l < layers.size(); ++l) {
    const Layer* layer = layers[l].get();
    QGRU_CHECK(layer != nullptr, who, ": a Layer is None");
    const int64_t H = layers[0]->hidden_size();
    QGRU_CHECK(l == 0 || (layer->hidden_size() == H && layer->input_size() == H && same_place(*layers[0], *layer)),
                who, ": layer ", l, " does not take layer ", l - 1, "'s output");
    const std::vector<double>& v = q[l];
    QGRU_CHECK(v.size() == 8, who, ": 8 values per layer");
    // integer values must be integers (they are passed as doubles) before any cast
    for (int i : {1, 2, 4, 5, 6, 7})
      QGRU_CHECK(std::abs(v[i]) < 9.0e15 && v[i] == std::floor(v[i]), who, ": layer ", l, " value ", i, " (", v[i],
                  ") is not an integer");
    check_quantize_args((name + " (x)").c_str(), v[0], (int64_t)v[1], (int64_t)v[2]);
    check_quantize_args((name + " (h)").c_str(), v[3], (int64_t)v[4], (int64_t)v[5]);
    if (l > 0)  // layer l - 1's output onto layer l's x grid
      check_requantize_args(who, (int64_t)q[l - 1][4], (int64_t)v[6], (int64_t)v[7], (int64_t)v[1], (int64_t)v[2]);
    const Range h = signed_range((int32_t)v[5]), state = layer->state_range();
    QGRU_CHECK((int64_t)v[2] == layer->x_bits() && h.lo == state.lo && h.hi == state.hi &&
                    (int64_t)v[4] == layer->state_zp(),
                who, ": layer ", l, " values name ", (int64_t)v[2], "-bit x and ", (int64_t)v[5], "-bit h with zero point ",
                (int64_t)v[4], "; its Layer takes ", layer->x_bits(), "-bit x and h in [", state.lo, ", ", state.hi,
                "] with zero point ", layer->state_zp());
  }
}

// The x levels' grids (golden.XLevels: scale, lo, hi per level) as the kernels take them, checked:
// 1 to kMaxXLevels levels, each a valid quantize scale, lo and hi not NaN.
inline XLevelGrid level_grid(const std::vector<double>& scale, const std::vector<double>& lo, const std::vector<double>& hi,
                      const char* who) {
  const size_t J = scale.size();
  QGRU_CHECK(J >= 1 && J <= (size_t)kMaxXLevels && lo.size() == J && hi.size() == J, who, ": 1 to ", kMaxXLevels,
              " x levels with a scale, lo and hi each, got ", scale.size(), ", ", lo.size(), " and ", hi.size());
  XLevelGrid g{};
  g.count = (int32_t)J;
  for (size_t j = 0; j < J; ++j) {
    QGRU_CHECK(std::isfinite(scale[j]) && scale[j] > 0 && !std::isnan(lo[j]) && !std::isnan(hi[j]), who,
                ": x level ", j, " has scale ", scale[j], ", lo ", lo[j], " and hi ", hi[j]);
    g.scale[j] = scale[j], g.lo[j] = lo[j], g.hi[j] = hi[j];
  }
  return g;
}

// A Stack's x levels (layer 0's, as [scale, lo, hi], or none), checked against its Layers (which
// have hidden_size ... and x_levels()): layer 0's count, and no levels below it (their x is the
// previous layer's output, requantized). A grid of count 0 when none are given (then every token of
// layer 0 is quantized on its static grid, level 0, even where the layer has levels).
template <class Layer>
XLevelGrid check_stack_levels(const char* who, const std::vector<std::shared_ptr<Layer>>& layers,
                              const std::vector<std::vector<double>>& levels) {
  for (size_t l = 1; l < layers.size(); ++l)
    QGRU_CHECK(layers[l]->x_levels() == 0, who, ": layer ", l, " has x levels; only the first layer takes a float x");
  const int64_t J = layers[0]->x_levels();
  if (levels.empty()) return XLevelGrid{};  // none given: layer 0's x on its static grid (level 0)
  QGRU_CHECK(levels.size() == 3, who, ": x levels as [scale, lo, hi]");
  const XLevelGrid g = level_grid(levels[0], levels[1], levels[2], who);
  QGRU_CHECK(g.count == J, who, ": ", g.count, " x levels given, layer 0 has ", J);
  return g;
}

struct LayerTensors {
  TensorMap t;
  IntMap v;

  // Every tensor is copied first: the checks below and the raw pointers the kernels keep then see
  // memory nobody else holds. (A caller's tensor edited in place after construction, or a negative
  // view whose sign torch applies only on reading, would otherwise pass the checks with one value
  // and be read with another; clone() applies the sign.)
  LayerTensors(TensorMap tensors, IntMap values) : t(std::move(tensors)), v(std::move(values)) {
    for (auto& kv : t) kv.second = kv.second.clone();
    validate();
  }

  static constexpr int64_t kMaxK = int64_t(1) << 17;  // primitives.INT8_GEMM_K_MAX: sizes below it

  // What the kernels rely on for memory safety and defined shifts (see the header comment):
  // sizes, bit widths, GEMM shapes and limb indices, ranges and zero points, every per-channel
  // array's dtype and length, rescale shifts, table lengths (the largest index a saturated
  // pre-activation can give) and entries, and the int32 path's shift fields.
  void validate() const {
    const int64_t H = value("H"), I = value("I");
    QGRU_CHECK(1 <= H && H < kMaxK && 1 <= I && I < kMaxK, "qgru native layer: H = ", H, " and I = ", I,
                " must lie in [1, ", kMaxK - 1, "]");
    check_value("x_bits", 2, 16);
    check_value("h_bits", 2, 16);
    const int64_t H3 = 3 * H, M_pad = value("M_pad");
    QGRU_CHECK(M_pad >= H3 && M_pad <= H3 + 64, "qgru native layer: M_pad = ", M_pad, " must lie in [3H, 3H + 64]");
    check_value("ones_col", 0, M_pad - 1);
    check_value("x_direct16", 0, 1);
    check_value("h_direct16", 0, 1);
    const int64_t px = check_gemm("x", I, value("x_bits"), value("x_direct16") != 0, M_pad),
                  ph = check_gemm("h", H, value("h_bits"), value("h_direct16") != 0, M_pad);
    for (const char* r : {"Wx", "Rh", "r_pre", "z_pre", "g_pre", "r", "z", "g", "h"}) {
      const std::string k = r;
      const int64_t lo = value(k + "_lo"), hi = value(k + "_hi");
      QGRU_CHECK(-32768 <= lo && lo <= hi && hi <= 32767, "qgru native layer: range of ", k, " [", lo, ", ", hi,
                  "] is not a range of at most 16 bits");
    }
    for (const char* g : {"r", "z", "g"}) {
      const std::string k = g;
      check_value(k + "_zp", value(k + "_lo"), value(k + "_hi"));
      check_value(k + "_pre_zp", value(k + "_pre_lo"), value(k + "_pre_hi"));
    }
    check_value("h_zp", value("h_lo"), value("h_hi"));
    if (value("hg") != 0) {  // the R.h operand h_gemm: its range is the GEMM's activation bits
      const int64_t lo = value("hg_lo"), hi = value("hg_hi"), b = value("h_bits");
      QGRU_CHECK(lo == -(int64_t(1) << (b - 1)) && hi == (int64_t(1) << (b - 1)) - 1, "qgru native layer: range of "
                  "hg [", lo, ", ", hi, "] is not that of the R.h GEMM's ", b, "-bit operand");
      check_value("hg_zp", lo, hi);
      check_rescale("hg", 1, false);
    } else {  // the GEMM reads the state itself
      QGRU_CHECK(value("h_hi") - value("h_lo") + 1 == (int64_t(1) << value("h_bits")), "qgru native layer: the "
                  "state's range [", value("h_lo"), ", ", value("h_hi"), "] is not that of the R.h GEMM's ",
                  value("h_bits"), "-bit operand");
    }
    check_value("one_z", 0, int64_t(1) << 16);
    const bool pow2 = value("pow2") != 0;
    for (const char* a : {"Wx", "Rh"}) {
      const std::string k = a;
      host(k + "_bias", at::kLong, H3);
      check_values(k + "_zp", host(k + "_zp", at::kLong, H3), value(k + "_lo"), value(k + "_hi"));
      check_rescale(k, H3, pow2);
    }
    for (const char* r : {"r_from_wx", "r_from_rh", "z_from_wx", "z_from_rh", "g_from_wx", "g_from_rrh"})
      check_rescale(r, H, pow2);
    check_rescale("zh", 1, pow2);
    check_rescale("zg", 1, pow2);
    for (const char* g : {"r", "z", "g"}) check_table(g);
    // x levels (first layer, config x.dynamic): W.x's bias and rescale per level, [J, 3H] flat
    const int64_t J = x_levels();
    QGRU_CHECK(0 <= J && J <= kMaxXLevels, "qgru native layer: 'x_levels' = ", J, " is outside [0, ", kMaxXLevels, "]");
    if (J > 0) {
      host("Wxl_bias", at::kLong, J * H3);
      check_rescale("Wxl", J * H3, pow2);
    }
    QGRU_CHECK(0 <= acc_wide() && acc_wide() <= 1 && (acc_wide() == 0 || value("acc32") != 0),
                "qgru native layer: 'acc_wide' = ", acc_wide(), " must be 0, or 1 with acc32 = 1");
    QGRU_CHECK(0 <= hybrid32() && hybrid32() <= 1 && (hybrid32() == 0 || value("acc32") == 0),
                "qgru native layer: 'hybrid32' = ", hybrid32(), " must be 0, or 1 with acc32 = 0");
    if (value("acc32") != 0 || hybrid32() != 0) check_acc32(H, I, px, ph, pow2);
  }

  // Wide accumulators (qgru_cell.h requant_wide32; the CPU's cell_tile, WIDE): 1 where the int32 cell
  // requantizes a GEMM output that may use all of int32 (a 16-bit operand taken whole). Maps made
  // before it existed have no entry: 0.
  int64_t acc_wide() const {
    auto it = v.find("acc_wide");
    return it == v.end() ? 0 : it->second;
  }
  // The hybrid cell (prepare.py _add_hybrid32): the accumulators requantized in int64, the gates
  // and the new state in the int32 cell ("hybrid32" = 1, with acc32 = 0; maps without it: 0).
  int64_t hybrid32() const { return value_or("hybrid32", 0); }
  // An optional value: `fallback` where the map has none.
  int64_t value_or(const std::string& k, int64_t fallback) const {
    auto it = v.find(k);
    return it == v.end() ? fallback : it->second;
  }

  // The number of x levels (0: none). Maps made before levels existed have no entry.
  int64_t x_levels() const {
    auto it = v.find("x_levels");
    return it == v.end() ? 0 : it->second;
  }

  void check_value(const std::string& k, int64_t lo, int64_t hi) const {
    const int64_t x = value(k);
    QGRU_CHECK(lo <= x && x <= hi, "qgru native layer: '", k, "' = ", x, " is outside [", lo, ", ", hi, "]");
  }
  // A host copy of a parameter tensor after checking its dtype, contiguity and element count.
  at::Tensor host(const std::string& k, at::ScalarType type, int64_t numel) const {
    const at::Tensor& x = tensor(k);
    QGRU_CHECK(x.scalar_type() == type && x.is_contiguous() && x.numel() == numel, "qgru native layer: '", k,
                "' must be a contiguous ", type, " tensor of ", numel, " elements, got ", x.scalar_type(), " ",
                x.sizes());
    return x.cpu();
  }
  void check_values(const std::string& k, const at::Tensor& x, int64_t lo, int64_t hi) const {
    if (x.numel() == 0) return;
    const int64_t mn = x.min().item<int64_t>(), mx = x.max().item<int64_t>();
    QGRU_CHECK(lo <= mn && mx <= hi, "qgru native layer: '", k, "' holds values in [", mn, ", ", mx,
                "], outside [", lo, ", ", hi, "]");
  }
  // The weight limbs [L, M_pad, K_pad] (K_pad >= K: rows of K activations are written at that
  // stride) and the limb pairs [P, 4] (activation limb, weight limb, scale, weight offset), whose
  // limb indices select buffers. The scales and offsets are native.py's _limb_gemm's (1, 256 or
  // 65536; 0 or 128), which keeps exact_product's int64 sums far from overflow; one pair is the
  // GEMM's output itself (exact_product<1>, the fused step), so it must be (0, 0, 1, 0) on one
  // activation limb. Returns P.
  int64_t check_gemm(const std::string& k, int64_t K, int64_t bits, bool direct, int64_t M_pad) const {
    const at::Tensor& w = tensor(k + "_weight_limbs");
    QGRU_CHECK(w.scalar_type() == at::kChar && w.dim() == 3 && w.is_contiguous() && (w.size(0) == 1 || w.size(0) == 2) &&
                    w.size(1) == M_pad && w.size(2) >= K && w.size(2) <= K + 64,
                "qgru native layer: '", k, "_weight_limbs' must be contiguous int8 [1 or 2, ", M_pad, ", ", K,
                " .. ", K + 64, "], got ", w.scalar_type(), " ", w.sizes());
    const at::Tensor& p = tensor(k + "_pairs");
    QGRU_CHECK(p.scalar_type() == at::kLong && p.dim() == 2 && p.size(1) == 4 &&
                    (p.size(0) == 1 || p.size(0) == 2 || p.size(0) == 4),
                "qgru native layer: '", k, "_pairs' must be int64 [1, 2 or 4, 4], got ", p.scalar_type(), " ", p.sizes());
    const at::Tensor hp = p.cpu().contiguous();
    const int64_t* a = hp.data_ptr<int64_t>();
    const int64_t n_act = bits > 8 && !direct ? 2 : 1;
    for (int64_t i = 0; i < p.size(0); ++i) {
      QGRU_CHECK(0 <= a[4 * i] && a[4 * i] < n_act && 0 <= a[4 * i + 1] && a[4 * i + 1] < w.size(0),
                  "qgru native layer: '", k, "_pairs' row ", i, " names limbs (", a[4 * i], ", ", a[4 * i + 1],
                  ") of ", n_act, " activation and ", w.size(0), " weight limb(s)");
      QGRU_CHECK(1 <= a[4 * i + 2] && a[4 * i + 2] <= 65536 && 0 <= a[4 * i + 3] && a[4 * i + 3] <= 128,
                  "qgru native layer: '", k, "_pairs' row ", i, " has scale ", a[4 * i + 2], " and weight offset ",
                  a[4 * i + 3], ", outside [1, 65536] and [0, 128]");
    }
    QGRU_CHECK(p.size(0) > 1 || (n_act == 1 && a[0] == 0 && a[1] == 0 && a[2] == 1 && a[3] == 0),
                "qgru native layer: one limb pair must be (0, 0, 1, 0) on a one-limb activation (", bits,
                " bits", direct ? ", taken whole" : "", "), got (", a[0], ", ", a[1], ", ", a[2], ", ", a[3], ")");
    return p.size(0);
  }
  // Multipliers fit the 32 x 32 -> 64 multiply, shifts lie in [1, 62] (rounding_mul_shift), and
  // log2 of power-of-two multipliers (shift amounts on the pow2 path) in [0, 30] (-1: none).
  void check_rescale(const std::string& k, int64_t n, bool pow2) const {
    check_values(k + "_mult", host(k + "_mult", at::kLong, n), 0, (int64_t(1) << 31) - 1);
    check_values(k + "_shift", host(k + "_shift", at::kInt, n), 1, 62);
    check_values(k + "_mult_log2", host(k + "_mult_log2", at::kInt, n), pow2 ? 0 : -1, 30);
  }
  // A table is read at index (q - pre_lo) >> k for q saturated to [pre_lo, pre_hi]: it needs
  // ((pre_hi - pre_lo) >> k) + 1 packed entries. The geometry is that of tables.table_geometry
  // (k <= 16 - 10, F <= 4) and entries are bounded (|T| <= 2^20 for every table of at most 16-bit
  // outputs with 4 fraction bits), so that the int32 interpolation (lookup32) cannot overflow.
  void check_table(const std::string& g) const {
    check_value(g + "_table_k", 0, 6);
    check_value(g + "_table_frac", 0, 4);
    const int64_t n = ((value(g + "_pre_hi") - value(g + "_pre_lo")) >> value(g + "_table_k")) + 1;
    const at::Tensor e = host("table_" + g, at::kLong, n);
    const int64_t* p = e.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lo = (int64_t)(int32_t)(uint32_t)(uint64_t)p[i], diff = p[i] >> 32;
      QGRU_CHECK(-(int64_t(1) << 21) <= lo && lo <= (int64_t(1) << 21) && -(int64_t(1) << 22) <= diff &&
                      diff <= (int64_t(1) << 22),
                  "qgru native layer: table '", g, "' entry ", i, " (", lo, ", difference ", diff, ") is out of range");
    }
  }
  // The int32 path (qgru/native.py, _add_acc32): its conditions, its arrays, its shift fields, in
  // pow2 or multiplier form (qgru_cell.h, AccRequant32 and the int32 cell). These checks keep
  // every shift and multiplier where the C++ is defined; the bounds that make the int32 results
  // equal the int64 ones are _add_acc32's, derived from the same parameters.
  // With wide accumulators (acc_wide) a 16-bit GEMM operand taken whole is allowed, and the
  // requantization fields take their wide form's ranges (multiplier: bias_lo = B0 < 2^16,
  // rshift = s - 17 <= 45).
  // The hybrid cell (hybrid32) takes only the gates' fields: its accumulators are the int64 ones,
  // any limb pairs and operands, and the requantization fields of c32_channels are unused (0).
  void check_acc32(int64_t H, int64_t I, int64_t px, int64_t ph, bool pow2) const {
    const bool wide = acc_wide() != 0, hybrid = value("acc32") == 0;
    const bool operands = wide ? (value("x_bits") <= 8 || value("x_direct16") != 0) &&
                                     (value("h_bits") <= 8 || value("h_direct16") != 0)
                               : value("x_bits") <= 8 && value("h_bits") <= 8;
    QGRU_CHECK(hybrid || (px == 1 && ph == 1 && operands && I < (1 << 16) && H < (1 << 16)),
                "qgru native layer: the int32 path needs 8-bit GEMM operands (or, with wide accumulators, 16-bit "
                "ones taken whole), one limb pair and sizes below 2^16");
    const int64_t lsh_hi = wide ? 65535 : 31, rsh_hi = wide ? 45 : 31;  // multiplier form's requantization
    if (!hybrid) host("Wx_zp32", at::kInt, 3 * H);
    const int64_t i32max = INT32_MAX;
    // W.x's int32 form: the static grid's [3H], and every x level's [J 3H] (Wxl_*)
    for (const std::string k : {"Wx", "Wxl"}) {
      const int64_t n = hybrid ? 0 : (k == "Wx" ? 1 : x_levels()) * 3 * H;
      if (n == 0) continue;
      if (pow2) {  // narrow: R in [1, 30] with lsh 0, or R <= 0 as lsh = -R <= 30 with rshift 0
        for (const char* f : {"_bias_hi", "_bias_lo"}) host(k + f, at::kInt, n);
        check_values(k + "_rshift", host(k + "_rshift", at::kInt, n), wide ? 1 : 0, 30);
        check_values(k + "_mult32", host(k + "_mult32", at::kInt, n), 0, wide ? 0 : 30);
      } else {
        host(k + "_bias_hi", at::kInt, n);  // the whole bias (wide: B1)
        check_values(k + "_bias_lo", host(k + "_bias_lo", at::kInt, n), 0, lsh_hi);  // lsh (wide: B0)
        check_values(k + "_rshift", host(k + "_rshift", at::kInt, n), 0, rsh_hi);
        check_values(k + "_mult32", host(k + "_mult32", at::kInt, n), 0, i32max);
      }
    }
    check_value("zg_rsh", 0, 31);
    check_value("zg_lsh", 0, pow2 ? 0 : 31);
    check_value("zg_m32", 0, i32max);
    check_value("zh_sh", pow2 ? 8 : 0, pow2 ? 39 : 47);  // as r * Rh_g's: rescale_wide32
    check_value("zh_m32", 0, i32max);
    if (value("hg") != 0) {  // gemm_operand32's rescale32
      check_value("hg_lsh", 0, pow2 ? 14 : 31);
      check_value("hg_rsh", 0, 31);
      check_value("hg_m32", 0, i32max);
    }
    const int64_t blocks = (H + kCell32Block - 1) / kCell32Block;
    // [field][channel] of the first H channels (padding channels are never read)
    const at::Tensor c = host("c32_channels", at::kInt, blocks * kCell32Fields * kCell32Block)
                             .view({blocks, kCell32Fields, kCell32Block}).permute({1, 0, 2})
                             .reshape({kCell32Fields, blocks * kCell32Block}).narrow(1, 0, H);
    for (int f = 0; f < kCell32Fields; ++f) {
      int64_t lo = INT32_MIN, hi = INT32_MAX;  // bias_hi, bias_lo (pow2), bias, lo_z, hi_z: arithmetic only
      if (f <= kGWxRsh) {
        lo = 0, hi = (f % 2 == 0 && pow2) ? 14 : 31;  // kRWxLsh ... kGWxRsh: (lsh, rsh) pairs
      } else if (f == kGRRhRsh) {
        lo = pow2 ? 8 : 0, hi = pow2 ? 39 : 47;  // a shift of int32 (pow2, by R - 8) or int64
      } else if (f < kMult && (f - kRhRequant) % 4 == 2) {
        lo = pow2 && wide ? 1 : 0, hi = pow2 ? 30 : rsh_hi;  // R (pow2; narrow: 0 where R <= 0) or rsh
      } else if (f < kMult && (f - kRhRequant) % 4 == 1 && !pow2) {
        lo = 0, hi = lsh_hi;  // lsh of a requantization (wide: B0)
      } else if (f >= kMult && f < kHiZ) {
        lo = 0;  // multipliers; pow2: 0, but the narrow requantizations' lsh (<= 30; AccRequant32)
        if (pow2) hi = (f >= kMult + 6 && !wide) ? 30 : 0;
      } else if (f == kPad) {
        lo = hi = 0;  // the padding row
      }
      check_values("c32_channels field " + std::to_string(f), c[f], lo, hi);
    }
  }

  const at::Tensor& tensor(const std::string& k) const {
    auto it = t.find(k);
    QGRU_CHECK(it != t.end(), "qgru native layer: missing tensor '", k, "'");
    return it->second;
  }
  int64_t value(const std::string& k) const {
    auto it = v.find(k);
    QGRU_CHECK(it != v.end(), "qgru native layer: missing value '", k, "'");
    return it->second;
  }
  const int64_t* i64(const std::string& k) const {
    const at::Tensor& x = tensor(k);
    QGRU_CHECK(x.scalar_type() == at::kLong && x.is_contiguous(), "qgru native layer: '", k, "' must be contiguous int64");
    return x.data_ptr<int64_t>();
  }
  const int32_t* i32(const std::string& k) const {
    const at::Tensor& x = tensor(k);
    QGRU_CHECK(x.scalar_type() == at::kInt && x.is_contiguous(), "qgru native layer: '", k, "' must be contiguous int32");
    return x.data_ptr<int32_t>();
  }
  Range range(const std::string& k) const { return Range{value(k + "_lo"), value(k + "_hi")}; }
  Rescale rescale(const std::string& k) const {
    return Rescale{i64(k + "_mult"), i32(k + "_shift"), i32(k + "_mult_log2")};
  }
  Table table(const std::string& k) const {
    return Table{i64("table_" + k), (int32_t)value(k + "_table_k"), (int32_t)value(k + "_table_frac"),
                 value(k + "_pre_lo"), value(k + "_zp"), range(k)};
  }
  AccRequant acc(const std::string& k) const {  // k = "Wx" or "Rh"
    return AccRequant{i64(k + "_bias"), rescale(k), i64(k + "_zp"), range(k)};
  }
  // The int32 form, when prepare_layer found it exact for this layer ("acc32" = 1).
  AccRequant32 acc32(const std::string& k) const {
    if (value("acc32") == 0) return AccRequant32{nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0};
    return AccRequant32{i32(k + "_bias_hi"), i32(k + "_bias_lo"), i32(k + "_rshift"), i32(k + "_zp32"),
                        i32(k + "_mult32"), (int32_t)value(k + "_lo"), (int32_t)value(k + "_hi")};
  }
  // W.x's requantization as the kernels take it: a layer with x levels, every level's bias and
  // rescale ([J, 3H] flat, qgru_cell.h at_level), else the static grid's ([3H], level 0 only).
  AccRequant acc_x() const {
    if (x_levels() == 0) return acc("Wx");
    return AccRequant{i64("Wxl_bias"), rescale("Wxl"), i64("Wx_zp"), range("Wx")};
  }
  AccRequant32 acc32_x() const {
    if (x_levels() == 0 || value("acc32") == 0) return acc32("Wx");
    return AccRequant32{i32("Wxl_bias_hi"), i32("Wxl_bias_lo"), i32("Wxl_rshift"), i32("Wx_zp32"),
                        i32("Wxl_mult32"), (int32_t)value("Wx_lo"), (int32_t)value("Wx_hi")};
  }
  SigmoidGate sigmoid(const std::string& k) const {  // k = "r" or "z"
    return SigmoidGate{rescale(k + "_from_wx"), rescale(k + "_from_rh"), value(k + "_pre_zp"), range(k + "_pre"),
                       table(k)};
  }
  Table32 table32(const std::string& k) const {
    return Table32{i64("table_" + k), (int32_t)value(k + "_table_k"),
                   (int32_t)value(k + "_table_frac"), (int32_t)value(k + "_pre_lo"), (int32_t)value(k + "_zp"),
                   (int32_t)value(k + "_lo"), (int32_t)value(k + "_hi")};
  }
  // The int32 cell, when prepare_layer found it exact for this layer ("acc32" = 1, or its gates
  // alone: "hybrid32" = 1).
  Cell32 cell32() const {
    Cell32 c{};
    if (value("acc32") == 0 && hybrid32() == 0) return c;
    const at::Tensor& ch = tensor("c32_channels");
    QGRU_CHECK(ch.dim() == 3 && ch.size(0) == (value("H") + kCell32Block - 1) / kCell32Block &&
                    ch.size(1) == kCell32Fields && ch.size(2) == kCell32Block,
                "qgru native layer: c32_channels must be [ceil(H/", kCell32Block, "), ", kCell32Fields, ", ",
                kCell32Block, "], got ", ch.sizes());
    c.channels = i32("c32_channels");
    const auto v32 = [&](const std::string& k) { return (int32_t)value(k); };  // checked by validate()
    c.zh_m = v32("zh_m32"), c.zh_sh = v32("zh_sh");
    c.zg_m = v32("zg_m32"), c.zg_lsh = v32("zg_lsh"), c.zg_rsh = v32("zg_rsh");
    const char* gates[3] = {"r", "z", "g"};
    for (int q = 0; q < 3; ++q) {
      const std::string g = gates[q];
      c.pre_zp[q] = v32(g + "_pre_zp"), c.pre_lo[q] = v32(g + "_pre_lo"), c.pre_hi[q] = v32(g + "_pre_hi");
      c.table[q] = table32(g);
    }
    c.one_z = v32("one_z");
    c.h_zp = v32("h_zp"), c.h_lo = v32("h_lo"), c.h_hi = v32("h_hi");
    c.wx_lo = v32("Wx_lo"), c.wx_hi = v32("Wx_hi"), c.rh_lo = v32("Rh_lo"), c.rh_hi = v32("Rh_hi");
    if (value("hg") != 0) {
      c.hg_m = v32("hg_m32"), c.hg_lsh = v32("hg_lsh"), c.hg_rsh = v32("hg_rsh");
      c.hg_zp = v32("hg_zp"), c.hg_lo = v32("hg_lo"), c.hg_hi = v32("hg_hi");
    }
    return c;
  }
  CellParams cell() const {
    CellParams p;
    p.H = value("H");
    p.c32 = cell32();
    p.rh = acc("Rh");
    p.r = sigmoid("r");
    p.z = sigmoid("z");
    p.g_from_wx = rescale("g_from_wx");
    p.g_from_rrh = rescale("g_from_rrh");
    p.g_pre_zp = value("g_pre_zp");
    p.g_pre = range("g_pre");
    p.g = table("g");
    p.zh = rescale("zh");
    p.zg = rescale("zg");
    p.one_z = value("one_z");
    p.h_zp = value("h_zp");
    p.h = range("h");
    p.op = HOperand{0, Rescale{nullptr, nullptr, nullptr}, 0, 0, Range{0, 0}};
    if (value("hg") != 0) p.op = HOperand{1, rescale("hg"), value("h_zp"), value("hg_zp"), range("hg")};
    return p;
  }
  // The limb pairs of one GEMM ("x": W.x, "h": R.h): [P, 4] int64 rows (act limb, weight limb,
  // scale, weight offset), read on the host.
  at::Tensor pairs(const std::string& k) const { return tensor(k + "_pairs").cpu(); }
};

}  // namespace qgru
