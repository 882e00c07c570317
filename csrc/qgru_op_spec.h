// The operator qgru::integer_gru's spec (qgru/ops.py flatten_params, format 2, described there),
// parsed once per set of parameters: per layer and direction its grid values, its input
// requantizations, x levels, CPU path facts and the native Layer's arguments for each kind of CPU
// path; then (the "cuda" section) the CUDA Layers' arguments. Read by the CPU kernel
// (cpu/op_cpu.cpp) and the CUDA one (op_cuda.cpp); every count and value is checked against its
// range before anything is made from it (a spec may come from a saved program: untrusted text).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "qgru_check.h"
#include "qgru_layer.h"

namespace qgru {
namespace op {

constexpr int kSpecFormat = 2;


// One variant of a layer's native arguments: for act16 CPU paths (1), the others (0), or any (2).
struct Variant {
  int act16 = 2;
  std::vector<std::pair<std::string, int64_t>> tensors;  // key, index into params
  IntMap values;
};

// One layer and direction.
struct Unit {
  double sx = 0, sh = 0;
  int64_t zx = 0, bx = 0, zh = 0, bh = 0;
  std::vector<std::vector<int64_t>> in_mult, in_shift;  // per source direction e (layer > 0): [1] or [H]
  std::vector<double> lv_scale, lv_lo, lv_hi;           // x levels (layer 0), or empty
  bool takes_whole = false;  // qgru/native/cpu.py _avx2_takes_whole
  bool one_pair8 = false;    // qgru/native/prepare.py one_limb_pair(p, act16=False)
  std::vector<Variant> variants;
};

struct Spec {
  int64_t L = 0, D = 0, H = 0, I = 0, n_tensors = 0;
  std::vector<Unit> units;  // [l D + d]
  // the CUDA Layers' arguments (prepare_layer with CUDA_GEMM_MIN), one per unit [l D + d]: the
  // spec's "cuda" section; empty in a spec made before it existed (the CUDA kernel then refuses it)
  std::vector<Variant> cuda;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : in_(s) {}
  // whether the next word is w (then read), else nothing is read
  bool next_is(const char* w) {
    const std::streampos at = in_.tellg();
    std::string got;
    if (in_ >> got && got == w) return true;
    in_.clear();
    in_.seekg(at);
    return false;
  }
  std::string word() {
    std::string w;
    QGRU_CHECK_VALUE(bool(in_ >> w), "qgru::integer_gru: the spec ends early (not one made by qgru.ops.flatten_params)");
    return w;
  }
  void expect(const char* w) {
    const std::string got = word();
    QGRU_CHECK_VALUE(got == w, "qgru::integer_gru: the spec has '", got, "' where '", w, "' belongs");
  }
  int64_t integer(int64_t lo, int64_t hi) {
    const std::string w = word();
    char* end = nullptr;
    const long long v = std::strtoll(w.c_str(), &end, 10);
    QGRU_CHECK_VALUE(end != w.c_str() && *end == '\0' && v >= lo && v <= hi, "qgru::integer_gru: spec value '", w,
                     "' is not an integer in [", lo, ", ", hi, "]");
    return v;
  }
  double real() {  // float.hex() (exact), inf, -inf
    const std::string w = word();
    char* end = nullptr;
    const double v = std::strtod(w.c_str(), &end);
    QGRU_CHECK_VALUE(end != w.c_str() && *end == '\0' && !std::isnan(v), "qgru::integer_gru: spec value '", w,
                     "' is not a number");
    return v;
  }

 private:
  std::istringstream in_;
};

// "variant A nt (key index)*nt nv (key value)*nv", A in [a_lo, a_hi].
inline Variant read_variant(Reader& r, int64_t n_tensors, int a_lo, int a_hi) {
  Variant v;
  r.expect("variant");
  v.act16 = (int)r.integer(a_lo, a_hi);
  const int64_t nt = r.integer(1, 256);
  for (int64_t i = 0; i < nt; ++i) {
    std::string key = r.word();
    const int64_t idx = r.integer(0, n_tensors - 1);
    v.tensors.emplace_back(std::move(key), idx);
  }
  const int64_t nv = r.integer(1, 1024);
  for (int64_t i = 0; i < nv; ++i) {
    std::string key = r.word();
    v.values[key] = r.integer(INT64_MIN + 1, INT64_MAX);
  }
  return v;
}

inline Spec parse_spec(const std::string& text, int64_t n_params) {
  Reader r(text);
  Spec s;
  r.expect("qgru.integer_gru");
  const int64_t format = r.integer(0, 1 << 20);
  QGRU_CHECK_VALUE(format == kSpecFormat, "qgru::integer_gru: spec format ", format, ", this library reads format ",
                   kSpecFormat, " (convert the model again with this qgru)");
  r.expect("layers");
  s.L = r.integer(1, 1 << 16);
  s.D = r.integer(1, 2);
  s.H = r.integer(1, 1 << 24);
  s.I = r.integer(1, 1 << 24);
  s.n_tensors = r.integer(0, n_params);
  for (int64_t l = 0; l < s.L; ++l)
    for (int64_t d = 0; d < s.D; ++d) {
      Unit u;
      r.expect("unit");
      QGRU_CHECK_VALUE(r.integer(0, s.L - 1) == l && r.integer(0, s.D - 1) == d,
                       "qgru::integer_gru: the spec's units are out of order");
      r.expect("grid");
      u.sx = r.real(), u.zx = r.integer(-(1 << 16), 1 << 16), u.bx = r.integer(2, 16);
      u.sh = r.real(), u.zh = r.integer(-(1 << 16), 1 << 16), u.bh = r.integer(2, 16);
      check_quantize_args("qgru::integer_gru (x grid)", u.sx, u.zx, u.bx);
      check_quantize_args("qgru::integer_gru (h grid)", u.sh, u.zh, u.bh);
      r.expect("in");
      const int64_t E = r.integer(0, 2);
      QGRU_CHECK_VALUE(E == (l == 0 ? 0 : s.D), "qgru::integer_gru: unit (", l, ", ", d, ") has ", E,
                       " input requantizations");
      for (int64_t e = 0; e < E; ++e) {
        const int64_t n = r.integer(1, s.H);
        QGRU_CHECK_VALUE(n == 1 || n == s.H, "qgru::integer_gru: a requantization of ", n, " factors (1 or H)");
        std::vector<int64_t> m((size_t)n), sh((size_t)n);
        for (auto& v : m) v = r.integer(0, (int64_t(1) << 31) - 1);
        for (auto& v : sh) v = r.integer(1, 62);
        u.in_mult.push_back(std::move(m));
        u.in_shift.push_back(std::move(sh));
      }
      r.expect("levels");
      const int64_t J = r.integer(0, 64);
      QGRU_CHECK_VALUE(J == 0 || l == 0, "qgru::integer_gru: only the first layer has x levels");
      for (auto* v : {&u.lv_scale, &u.lv_lo, &u.lv_hi})
        for (int64_t j = 0; j < J; ++j) v->push_back(r.real());
      r.expect("paths");
      u.takes_whole = r.integer(0, 1) != 0;
      u.one_pair8 = r.integer(0, 1) != 0;
      r.expect("variants");
      const int64_t V = r.integer(1, 2);
      for (int64_t k = 0; k < V; ++k) {
        Variant v = read_variant(r, s.n_tensors, 0, 2);
        QGRU_CHECK_VALUE((V == 1) == (v.act16 == 2), "qgru::integer_gru: a unit has one variant for any path or two");
        u.variants.push_back(std::move(v));
      }
      s.units.push_back(std::move(u));
    }
  // the CUDA section (after the units, where a reader of the units alone stops): "cuda U" and one
  // variant (A = 3) per unit
  if (r.next_is("cuda")) {
    QGRU_CHECK_VALUE(r.integer(0, 1 << 20) == s.L * s.D, "qgru::integer_gru: the spec's cuda section has not one "
                     "variant per unit");
    for (int64_t k = 0; k < s.L * s.D; ++k) s.cuda.push_back(read_variant(r, s.n_tensors, 3, 3));
  }
  return s;
}

// A variant's Layer arguments: its tensors (params[index], contiguous) and values; ``where``: the
// device they must be on (the CPU kernel refuses others) or, with ``move``, are copied to.
inline std::pair<TensorMap, IntMap> variant_args(const Variant& v, const std::vector<at::Tensor>& params,
                                                 const at::Device& where, bool move) {
  TensorMap t;
  for (const auto& kv : v.tensors) {
    at::Tensor p = params[(size_t)kv.second];
    if (move)
      p = p.to(where);
    else
      QGRU_CHECK(p.device() == where, "qgru::integer_gru: parameter '", kv.first, "' is not on ", where);
    t[kv.first] = p.is_contiguous() ? p : p.contiguous();
  }
  return {t, v.values};
}

// The values and x levels of a unidirectional spec's Stack, the CPU's or the CUDA's (qgru/native/
// stacks.py stack_values and stack_levels: per layer S_x, Z_x, bits_x, S_h, Z_h, bits_h and the
// multiplier and shift of its input requantization; layer 0's levels as [scale, lo, hi] or none);
// false where no Stack applies (bidirectional, or a per-channel requantization between layers).
inline bool stack_args(const Spec& s, std::vector<std::vector<double>>& rows,
                       std::vector<std::vector<double>>& levels) {
  rows.clear(), levels.clear();
  if (s.D != 1) return false;
  for (int64_t l = 0; l < s.L; ++l) {
    const Unit& u = s.units[(size_t)l];
    double m = 1, sh = 1;
    if (l > 0) {
      if (u.in_mult[0].size() != 1) return false;
      m = (double)u.in_mult[0][0], sh = (double)u.in_shift[0][0];
    }
    rows.push_back({u.sx, (double)u.zx, (double)u.bx, u.sh, (double)u.zh, (double)u.bh, m, sh});
  }
  const Unit& u0 = s.units[0];
  if (!u0.lv_scale.empty()) levels = {u0.lv_scale, u0.lv_lo, u0.lv_hi};
  return true;
}

// The parameter tensors a cached kernel entry was made from, held (no storage is freed and reused
// while cached), and their versions then: same() is whether a call's params are those, unchanged.
struct HeldParams {
  std::vector<at::Tensor> params;
  std::vector<int64_t> versions;
  void hold(const std::vector<at::Tensor>& p) {
    params = p, versions.clear();
    for (const auto& t : p) versions.push_back(t._version());
  }
  bool same(const std::vector<at::Tensor>& p) const {
    if (params.size() != p.size()) return false;
    for (size_t i = 0; i < p.size(); ++i)
      if (!params[i].is_same(p[i]) || versions[i] != p[i]._version()) return false;
    return true;
  }
};

}  // namespace op
}  // namespace qgru
