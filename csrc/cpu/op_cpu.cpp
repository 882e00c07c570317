// qgru C++ CPU backend: the operator qgru::integer_gru, defined here (TORCH_LIBRARY) and run on the
// CPU (TORCH_LIBRARY_IMPL), so that a saved torch.export program or an AOTInductor package of a
// model with converted QuantGRUs runs wherever this library is loaded: a Python process that never
// imports qgru (torch.ops.load_library), or a libtorch-only C++ program (dlopen).
//
// It is the whole integer GRU between its float boundaries, as qgru/runtime.py _integer_forward
// runs it on the cpu backend, with the same C++ functions (cpu_backend.h: quantize,
// quantize_levels, requantize, dequantize and the Layer): quantize x (on each token's x level
// where layer 0 has levels) and every h0, run every layer and direction (a backward direction on
// its input reversed within each sequence's length, and its output reversed back), move each
// layer's outputs onto the next layer's x grid, dequantize the last layer's outputs and every h_n.
//
// Arguments: x [T, N, I] float, hx [L D, N, H] float, lengths int64 [N] or None, params (tensors)
// and spec (text), both made at convert time by qgru/ops.py flatten_params (format 2, described
// there): per layer and direction its grid values and the native Layer's arguments (what
// qgru/native/prepare.py prepare_layer gives), once or, where a 16-bit activation taken whole makes
// them differ, for both kinds of CPU path; the kernel picks the path of this CPU (QGRU_CPU_ISA as
// in qgru/native/cpu.py) and builds the Layers once per set of parameter tensors.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cpu_backend.h"
#include "isa.h"
#include "qgru_check.h"
#include "qgru_fixedpoint.h"
#include "qgru_op_loop.h"
#include "qgru_op_spec.h"

namespace qgru {
namespace op {
namespace {

constexpr size_t kCacheSize = 8;

std::string trim_lower(const char* v) {
  std::string s = v == nullptr ? "" : v;
  s.erase(0, s.find_first_not_of(" \t\n\r"));
  s.erase(s.find_last_not_of(" \t\n\r") + 1);
  for (auto& c : s) c = (char)std::tolower((unsigned char)c);
  return s.empty() ? "auto" : s;
}

// What qgru/native/cpu.py decides for a layer, from the path table (isa.cpp): the path it runs on
// (resolve_cpu_isa, layer_path), its act16 flag (layer_act16) and its one-row path (one_row_path).
struct PathRow {
  bool usable;
  int act_bytes;
  bool act16;
};

PathRow path_row(const std::string& name) {
  for (const auto& i : cpu::isa_table())
    if (i.name == name)
      return PathRow{i.supported, i.kernels ? i.kernels->act_bytes : 0,
                     i.kernels != nullptr && (i.kernels->act_bytes == 2 || i.kernels->act16 != nullptr)};
  return PathRow{false, 0, false};
}

std::string resolve_path(const std::string& request) {
  for (const auto& i : cpu::isa_table()) {
    if (request == "auto" && i.supported) return i.name;
    if (i.name == request) {
      QGRU_CHECK_VALUE(i.supported, "qgru cpu: the '", request, "' path (QGRU_CPU_ISA) cannot run here: ", i.why);
      return i.name;
    }
  }
  std::string known = "auto";
  for (const auto& i : cpu::isa_table()) known += ", " + i.name;
  QGRU_CHECK_VALUE(false, "qgru cpu: unknown path '", request, "' (QGRU_CPU_ISA); known: ", known);
  return "";
}

bool layer_act16(const Unit& u, const std::string& path) {
  const PathRow p = path_row(path);
  return p.act_bytes == 2 || (p.act16 && u.takes_whole);
}

const Variant& variant_for(const Unit& u, bool act16) {
  for (const Variant& v : u.variants)
    if (v.act16 == 2 || v.act16 == (int)act16) return v;
  QGRU_CHECK_VALUE(false, "qgru::integer_gru: no parameter variant for this CPU path");
  return u.variants[0];
}

std::pair<TensorMap, IntMap> layer_args(const Variant& v, const std::vector<at::Tensor>& params) {
  return variant_args(v, params, at::Device(at::kCPU), false);
}

std::shared_ptr<cpu_api::Layer> make_layer(const Unit& u, const std::vector<at::Tensor>& params,
                                           const std::string& request) {
  std::string path = resolve_path(request);
  // qgru/native/cpu.py layer_path: an auto request's 16-bit layer that an int16 GEMM takes whole
  if (request == "auto" && u.takes_whole) {
    const PathRow v = path_row("avx512vnni");
    if (path == "amx" && v.usable && v.act16)
      path = "avx512vnni";
    else if (path == "avxvnni" && path_row("avx2").usable)
      path = "avx2";
  }
  const bool act16 = layer_act16(u, path);
  auto args = layer_args(variant_for(u, act16), params);
  auto layer = std::make_shared<cpu_api::Layer>(std::move(args.first), std::move(args.second), path);
  std::string other;
  const PathRow here = path_row(path);
  if (path == "amx" && path_row("avx512vnni").usable && u.one_pair8)
    other = "avx512vnni";
  else if (here.act_bytes == 1 && !here.act16 && path_row("avx2").usable && u.takes_whole)
    other = "avx2";
  if (!other.empty()) {
    auto o = layer_args(variant_for(u, layer_act16(u, other)), params);
    layer->set_one_row(std::move(o.first), std::move(o.second), other);
  }
  return layer;
}

// A spec and its Layers, for one set of parameter tensors at their versions, on one path request.
struct Entry {
  std::string spec, request;
  HeldParams held;
  Spec parsed;
  std::vector<std::shared_ptr<cpu_api::Layer>> layers;
  // a unidirectional stack whose layers requantize per tensor: the Stack the eager module's
  // one-call form runs (qgru/native/stacks.py), for calls without lengths; else null
  std::shared_ptr<cpu_api::Stack> stack;
  cpu::RequantRowFn requant_row = nullptr;  // kernel_avx2.cpp's row requantization: the CPU has AVX2, the path is not portable
};

// The Stack of a unidirectional spec (qgru/native/stacks.py stack_values and stack_levels), or
// null where a layer's requantization of its input is per channel.
std::shared_ptr<cpu_api::Stack> make_stack(const Spec& s, const std::vector<std::shared_ptr<cpu_api::Layer>>& layers) {
  std::vector<std::vector<double>> rows, levels;
  if (!stack_args(s, rows, levels)) return nullptr;
  return std::make_shared<cpu_api::Stack>(layers, std::move(rows), levels);
}

// A spec's Entry (parsed, its Layers and Stack made) for params on path request ``request``.
std::shared_ptr<Entry> make_entry(const std::vector<at::Tensor>& params, const std::string& spec,
                                  const std::string& request) {
  auto e = std::make_shared<Entry>();
  e->spec = spec, e->request = request;
  e->held.hold(params);
  e->parsed = parse_spec(spec, (int64_t)params.size());
  // the Layers keep tensors (workspaces): made as normal tensors (qgru/native/layer.py says why)
  c10::InferenceMode normal(false);
  for (const Unit& u : e->parsed.units) e->layers.push_back(make_layer(u, params, request));
  e->stack = make_stack(e->parsed, e->layers);
  const bool portable = !e->layers.empty() && e->layers[0]->gemm_path().rfind("portable", 0) == 0;
  for (const cpu::IsaInfo& i : cpu::isa_table())
    if (i.name == "avx2" && i.supported && !portable) e->requant_row = cpu::avx2_requant_row();
  return e;
}

std::mutex g_mu;
std::list<std::shared_ptr<Entry>> g_cache;  // most recently used first

std::shared_ptr<Entry> entry_for(const std::vector<at::Tensor>& params, const std::string& spec) {
  const std::string request = trim_lower(std::getenv("QGRU_CPU_ISA"));
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto it = g_cache.begin(); it != g_cache.end(); ++it)
    if ((*it)->request == request && (*it)->spec == spec && (*it)->held.same(params)) {
      auto e = *it;
      g_cache.erase(it);
      g_cache.push_front(e);
      return e;
    }
  auto e = make_entry(params, spec, request);
  g_cache.push_front(e);
  while (g_cache.size() > kCacheSize) g_cache.pop_back();
  return e;
}

// at::parallel_for, or the whole range on the calling thread in a child of fork (as qgru_cpu.cpp's
// parallel_for: OpenMP's pool does not work there).
template <typename F>
void rows_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (!cpu_api::forked_child()) return at::parallel_for(begin, end, grain, f);
  if (begin < end) f(begin, end);
}

// A direction's time order on a time-major [T, N, ...] batch: row (t, n) of a backward direction
// (rev) is row (Ln - 1 - t, n) where t < Ln = its length, else (t, n), what qgru/runtime.py
// reverse_within_lengths gives (T for every row without lengths: a flip); a forward one's is (t, n).
inline int64_t src_step(int64_t t, int64_t Ln, bool rev) { return rev && t < Ln ? Ln - 1 - t : t; }

// An int32 [sizes] view of a BufferPool buffer (cpu_api::pooled_int32): reused from call to call,
// so that the [T, N, ...] intermediates of a call fault in no fresh pages (at::empty of a few MB
// does, every call).
at::Tensor scratch_int32(at::IntArrayRef sizes) {
  const int64_t n = c10::multiply_integers(sizes);
  return cpu_api::pooled_int32(n).narrow(0, 0, n).view(sizes);
}

// A PackedSequence's layout in its sorted order (packed_run): step t's rows are the block
// [off_t, off_t + b[t]) of the packed data and the block [0, b[t]) of the padded batch's step t.
struct Packing {
  const int64_t* b = nullptr;  // batch_sizes [T], non-increasing, b[0] = N
  int64_t T = 0, N = 0, rows = 0;
  bool inference = false;  // the caller runs under inference mode
};

// The layer-0 input of one direction, [T, N, C] int32 in its time order (rev: reversed within
// each length), from src: the quantized rows, [T, N, C] (pk null: the padded batch; a row at or
// past its length stays where it is) or [rows, C] (a PackedSequence's data in its sorted order,
// off[t] its step t's first row; each padding row a copy of pad [C]). One copy per row: the
// reversal and the padded layout in one pass.
at::Tensor lay_out(const at::Tensor& src_in, const Packing* pk, const int64_t* off, const int64_t* len, int64_t T,
                   int64_t N, bool rev, const int32_t* pad) {
  const at::Tensor src = src_in.contiguous();
  const int64_t C = src.numel() / std::max<int64_t>(pk ? pk->rows : T * N, 1);
  at::Tensor dst = scratch_int32({T, N, C});
  const int32_t* a = src.data_ptr<int32_t>();
  int32_t* d = dst.data_ptr<int32_t>();
  rows_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(N * C, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int32_t* step = d + t * N * C;
      if (pk && !rev) {
        std::memcpy(step, a + off[t] * C, (size_t)(pk->b[t] * C) * sizeof(int32_t));
        for (int64_t n = pk->b[t]; n < N; ++n) std::copy_n(pad, C, step + n * C);
        continue;
      }
      for (int64_t n = 0; n < N; ++n) {
        const int32_t* row;
        if (pk)
          row = t < len[n] ? a + (off[rev ? len[n] - 1 - t : t] + n) * C : pad;
        else
          row = a + (src_step(t, len[n], rev) * N + n) * C;
        std::copy_n(row, C, step + n * C);
      }
    }
  });
  return dst;
}


// golden.requantize_input of each source direction's integer outputs src[e] [T, N, C_e] onto one
// grid, concatenated on the last axis (what requantizing each and at::cat give, in one pass: the
// same rounding_mul_shift and saturate per value), per tensor (m[e], s[e] of size 1) or per
// channel (of size C_e); source e's rows read in the time order rev[e] (src_step: a backward
// direction's outputs are kept in its own order, and reversed where they are read). The arguments
// are checked as the two requantizations checked them (cpu_backend's per-tensor one, this file's
// per-channel one).
at::Tensor requantize_cat(const std::vector<at::Tensor>& src_in, const std::vector<bool>& rev, const int64_t* len,
                          const std::vector<int64_t>& from_zp, const std::vector<const std::vector<int64_t>*>& m,
                          const std::vector<const std::vector<int64_t>*>& s, int64_t to_zp, int64_t to_bits,
                          cpu::RequantRowFn requant_row) {
  const size_t E = src_in.size();
  std::vector<at::Tensor> src;
  int64_t width = 0;
  for (size_t e = 0; e < E; ++e) {
    const std::vector<int64_t>& me = *m[e];
    const std::vector<int64_t>& se = *s[e];
    if (me.size() == 1) {
      QGRU_CHECK(src_in[e].device().is_cpu(), "qgru cpu requantize: a CPU tensor expected");
      check_requantize_args("qgru cpu requantize", from_zp[e], me[0], se[0], to_zp, to_bits);
      QGRU_CHECK(!src_in[e].is_floating_point(), "qgru cpu requantize: an integer tensor expected");
    } else {
      for (size_t c = 0; c < me.size(); ++c)
        check_requantize_args("qgru::integer_gru requantize", from_zp[e], me[c], se[c], to_zp, to_bits);
    }
    src.push_back(src_in[e].resolve_neg().to(at::kInt).contiguous());
    QGRU_CHECK(me.size() == 1 || (int64_t)me.size() == src.back().size(-1),
               "qgru::integer_gru requantize: ", me.size(), " factors for ", src.back().size(-1), " channels");
    QGRU_CHECK(src.back().dim() == 3 && src.back().size(0) == src[0].size(0) && src.back().size(1) == src[0].size(1),
               "qgru::integer_gru requantize: the directions' outputs differ in shape");
    width += src.back().size(-1);
  }
  const int64_t T = src[0].size(0), N = src[0].size(1);
  at::Tensor out = scratch_int32({T, N, width});
  const Range r = signed_range((int32_t)to_bits);
  int32_t* o = out.data_ptr<int32_t>();
  std::vector<const int32_t*> base;
  std::vector<int64_t> chans;
  for (const at::Tensor& t : src) base.push_back(t.data_ptr<int32_t>()), chans.push_back(t.size(-1));
  rows_for(0, T * N, std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t t = i / N, n = i % N;
      int32_t* dst = o + i * width;
      for (size_t e = 0; e < E; ++e) {
        const int64_t C = chans[e];
        const int32_t* a = base[e] + (src_step(t, len[n], rev[e]) * N + n) * C;
        const std::vector<int64_t>& me = *m[e];
        const std::vector<int64_t>& se = *s[e];
        const int64_t z = from_zp[e];
        if (requant_row && C % 4 == 0 && requant_row(a, C, z, me.data(), se.data(), me.size() != 1, to_zp, r.lo, r.hi, dst)) {
          dst += C;
          continue;
        }
        if (me.size() == 1) {
          const int64_t mult = me[0];
          const int32_t shift = (int32_t)se[0];
          for (int64_t c = 0; c < C; ++c)
            dst[c] = (int32_t)saturate(rounding_mul_shift((int64_t)a[c] - z, mult, shift) + to_zp, r);
        } else {
          for (int64_t c = 0; c < C; ++c)
            dst[c] = (int32_t)saturate(rounding_mul_shift((int64_t)a[c] - z, me[c], (int32_t)se[c]) + to_zp, r);
        }
        dst += C;
      }
    }
  });
  return out;
}

// Every layer and direction's h_n dequantized, stacked [L D, N, H] in x's dtype.
at::Tensor stack_h(const Spec& s, const std::vector<at::Tensor>& h_n, const at::Tensor& x) {
  std::vector<at::Tensor> fh;
  for (int64_t k = 0; k < s.L * s.D; ++k) {
    const Unit& u = s.units[(size_t)k];
    fh.push_back(cpu_api::dequantize(h_n[(size_t)k], u.sh, u.zh).to(x.scalar_type()));
  }
  return at::stack(fh);
}

// Whether two layer-0 directions quantize x alike (the same grid and x levels): x is then
// quantized once for both.
bool same_x_grid(const Unit& a, const Unit& b) {
  return a.sx == b.sx && a.zx == b.zx && a.bx == b.bx && a.lv_scale == b.lv_scale && a.lv_lo == b.lv_lo &&
         a.lv_hi == b.lv_hi;
}

// The integer GRU between its float boundaries on x [T, N, I] (or, with ``pk``, a PackedSequence's
// data [rows, I] in its sorted order: its rows quantized as they are and then laid out padded, the
// padding quantized from zeros, and the last layer's outputs packed as they are dequantized,
// which gives the values of the padded call on the padded batch: quantize and dequantize are
// elementwise, a token's level is its own). A backward direction runs on its input reversed within
// each length (laid out so in the copy that makes layer 0's input, or in the requantization that
// makes a later layer's) and its outputs are kept in that order: the requantization into the next
// layer and the last dequantize read them reversed back, so no pass reverses them.
std::tuple<at::Tensor, at::Tensor> run(const Entry& e, const at::Tensor& x, const at::Tensor& hx,
                                       const at::Tensor& lengths, const Packing* pk = nullptr) {
  const Spec& s = e.parsed;
  if (e.stack && !lengths.defined()) {  // the eager module's one-call form: the same integers
    at::Tensor out, h_n;
    std::tie(out, h_n) = e.stack->forward(x, hx);  // float32
    if (x.scalar_type() == at::kFloat) return {out, h_n};
    return {out.to(x.scalar_type()), h_n.to(x.scalar_type())};
  }
  const int64_t L = s.L, D = s.D, H = s.H;
  const int64_t T = pk ? pk->T : x.size(0), N = pk ? pk->N : x.size(1);
  const std::string& isa = e.request;
  // each row's length (T each without lengths) and, packed, each step's first row
  std::vector<int64_t> len_all, off;
  const int64_t* len = lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr;
  if (!len) len_all.assign((size_t)N, T), len = len_all.data();
  if (pk) {
    off.resize((size_t)T);
    for (int64_t t = 0, o = 0; t < T; o += pk->b[t], ++t) off[(size_t)t] = o;
  }
  std::vector<at::Tensor> prev;  // the previous layer's integer outputs, per direction (in its time order)
  std::vector<at::Tensor> h_n;
  const c10::optional<at::Tensor> len_opt = lengths.defined() ? c10::optional<at::Tensor>(lengths) : c10::nullopt;
  for (int64_t l = 0; l < L; ++l) {
    std::vector<at::Tensor> outs;
    at::Tensor q0, lv0;          // layer 0: x quantized on q0_unit's grid
    const Unit* q0_unit = nullptr;
    for (int64_t d = 0; d < D; ++d) {
      const Unit& u = s.units[(size_t)(l * D + d)];
      const bool rev = d == 1;
      at::Tensor qx, level;
      if (l == 0) {
        // x on this direction's own grid (golden integer_inputs): the two directions' observers
        // calibrate apart, and their grids differ where they saw different ranges (ema_step);
        // where they are the same, the other direction's quantized x is this one's
        if (!q0_unit || !same_x_grid(*q0_unit, u)) {
          q0 = at::Tensor(), lv0 = at::Tensor();  // (a quantize output is a reused buffer, reused only once no tensor holds it)
          if (!u.lv_scale.empty()) {
            std::tie(q0, lv0) = cpu_api::quantize_levels(x, u.lv_scale, u.lv_lo, u.lv_hi, u.zx, u.bx, "input", isa);
          } else {
            q0 = cpu_api::quantize(x, u.sx, u.zx, u.bx, "input", isa);
          }
          q0_unit = &u;
        }
        if (!pk && !rev) {
          qx = q0, level = lv0;
        } else {
          // packed, the padding: a zero token's quantized values (and level), as the padded batch's
          at::Tensor zq, zl;
          if (pk) {
            const at::Tensor zero = at::zeros({1, s.I}, x.options());
            if (!u.lv_scale.empty()) {
              std::tie(zq, zl) = cpu_api::quantize_levels(zero, u.lv_scale, u.lv_lo, u.lv_hi, u.zx, u.bx, "input", isa);
            } else {
              zq = cpu_api::quantize(zero, u.sx, u.zx, u.bx, "input", isa);
            }
            zq = zq.contiguous(), zl = zl.defined() ? zl.contiguous() : zl;
          }
          qx = lay_out(q0, pk, off.data(), len, T, N, rev, pk ? zq.data_ptr<int32_t>() : nullptr);
          if (lv0.defined())
            level = lay_out(lv0, pk, off.data(), len, T, N, rev, pk ? zl.data_ptr<int32_t>() : nullptr).view({T, N});
        }
      } else {
        std::vector<int64_t> zps;
        std::vector<bool> revs;
        std::vector<const std::vector<int64_t>*> mults, shifts;
        for (int64_t src = 0; src < D; ++src) {
          zps.push_back(s.units[(size_t)((l - 1) * D + src)].zh);
          revs.push_back((src == 1) != rev);  // source 1's outputs are in the backward order
          mults.push_back(&u.in_mult[(size_t)src]), shifts.push_back(&u.in_shift[(size_t)src]);
        }
        qx = requantize_cat(prev, revs, len, zps, mults, shifts, u.zx, u.bx, e.requant_row);
      }
      at::Tensor qh0 = cpu_api::quantize(hx.select(0, l * D + d), u.sh, u.zh, u.bh, "h0", isa);
      const c10::optional<at::Tensor> lv = level.defined() ? c10::optional<at::Tensor>(level) : c10::nullopt;
      at::Tensor o, h;
      // qx: quantize's or requantize's, saturated to the u.bx-bit range
      std::tie(o, h) = e.layers[(size_t)(l * D + d)]->forward_in_range(qx, u.bx, qh0, len_opt, lv);
      qx = at::Tensor(), level = at::Tensor();
      outs.push_back(o);  // (the Layer reuses its output buffer only once the caller has let go of it)
      h_n.push_back(h);
    }
    prev = std::move(outs);
  }
  at::Tensor out;
  {
    // a PackedSequence's output data is made in the caller's mode (an inference tensor under
    // torch.inference_mode, as the general path's packed_rows makes it)
    c10::optional<c10::InferenceMode> caller;
    if (pk && pk->inference) caller.emplace(true);
    // the last layer's outputs dequantized (primitives.dequantize: float32) straight into their
    // place: packed, the valid rows only; each direction's H channels side by side (at::cat)
    const int64_t W = D * H;
    std::vector<at::Tensor> pc;
    std::vector<const int32_t*> a;
    std::vector<double> sc, zp;
    for (int64_t d = 0; d < D; ++d) {
      const Unit& u = s.units[(size_t)((L - 1) * D + d)];
      pc.push_back(prev[(size_t)d].resolve_neg().to(at::kInt).contiguous());
      QGRU_CHECK(pc.back().numel() == T * N * H, "qgru::integer_gru: a layer's output is not [T, N, H]");
      a.push_back(pc.back().data_ptr<int32_t>()), sc.push_back(u.sh), zp.push_back((double)u.zh);
    }
    const at::TensorOptions f32 = x.options().dtype(at::kFloat);
    out = pk ? at::empty({pk->rows, W}, f32) : at::empty({T, N, W}, f32);
    float* o = out.data_ptr<float>();
    rows_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(N * W, 1)), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t nb = pk ? pk->b[t] : N;
        float* step = o + (pk ? off[(size_t)t] : t * N) * W;
        for (int64_t n = 0; n < nb; ++n)
          for (int64_t d = 0; d < D; ++d) {
            const int32_t* q = a[(size_t)d] + (src_step(t, len[n], d == 1) * N + n) * H;
            float* dst = step + n * W + d * H;
            const double scale = sc[(size_t)d], z = zp[(size_t)d];
            for (int64_t c = 0; c < H; ++c) dst[c] = dequantize_value(q[c], scale, z);
          }
      }
    });
    if (x.scalar_type() != at::kFloat) out = out.to(x.scalar_type());
  }
  return {out, stack_h(s, h_n, x)};
}

// The backend run_layers (qgru_op_loop.h) calls: this CPU path's quantize, requantize and
// dequantize, the Layers.
struct CpuOps {
  const Entry& e;
  at::Tensor quantize(const at::Tensor& v, double scale, int64_t zp, int64_t bits, const char* what) {
    return cpu_api::quantize(v, scale, zp, bits, what, e.request);
  }
  std::tuple<at::Tensor, at::Tensor> quantize_levels(const at::Tensor& x, const Unit& u) {
    return cpu_api::quantize_levels(x, u.lv_scale, u.lv_lo, u.lv_hi, u.zx, u.bx, "input", e.request);
  }
  at::Tensor requantize(const at::Tensor& q, int64_t from_zp, int64_t mult, int64_t shift, int64_t to_zp,
                        int64_t to_bits) {
    return cpu_api::requantize(q, from_zp, mult, shift, to_zp, to_bits);
  }
  at::Tensor dequantize(const at::Tensor& q, double scale, int64_t zp) { return cpu_api::dequantize(q, scale, zp); }
  std::tuple<at::Tensor, at::Tensor> layer(int64_t k, const at::Tensor& qx, const at::Tensor& qh0,
                                           const c10::optional<at::Tensor>& lengths,
                                           const c10::optional<at::Tensor>& level) {
    return e.layers[(size_t)k]->forward(qx, qh0, lengths, level);
  }
};

// The generic loop on this CPU's kernels (the one the CUDA operator runs; Model::forward_generic).
std::tuple<at::Tensor, at::Tensor> run_generic(const Entry& e, const at::Tensor& x, const at::Tensor& hx,
                                               const at::Tensor& lengths) {
  CpuOps ops{e};
  return run_layers(e.parsed, ops, x, hx, lengths);
}

// The operator's checks of x, hx and lengths against the spec, then run (``generic``: run_generic).
std::tuple<at::Tensor, at::Tensor> checked_run(const Entry& e, const at::Tensor& x_in, const at::Tensor& hx_in,
                                               const c10::optional<at::Tensor>& lengths_in, bool generic = false) {
  const Spec& s = e.parsed;
  QGRU_CHECK_VALUE(x_in.dim() == 3 && x_in.is_floating_point() && x_in.device().is_cpu(),
                   "qgru::integer_gru: x must be a float CPU tensor [T, N, I], got ", x_in.scalar_type(), " ",
                   x_in.sizes(), " on ", x_in.device());
  QGRU_CHECK_VALUE(x_in.size(0) >= 1, "QuantGRU expects a sequence of at least one step, got an input of shape ",
                   x_in.sizes(), " (sequence length 0; torch.nn.GRU refuses it too)");
  const int64_t T = x_in.size(0), N = x_in.size(1);
  QGRU_CHECK_VALUE(x_in.size(2) == s.I, "qgru::integer_gru: x must be [T, N, ", s.I, "], got ", x_in.sizes());
  QGRU_CHECK_VALUE(hx_in.dim() == 3 && hx_in.size(0) == s.L * s.D && hx_in.size(1) == N && hx_in.size(2) == s.H &&
                       hx_in.is_floating_point() && hx_in.device().is_cpu(),
                   "qgru::integer_gru: hx must be a float CPU tensor [", s.L * s.D, ", ", N, ", ", s.H, "], got ",
                   hx_in.sizes());
  at::Tensor lengths;
  if (lengths_in.has_value()) {
    QGRU_CHECK_VALUE(lengths_in->dim() == 1 && lengths_in->size(0) == N && !lengths_in->is_floating_point() &&
                         lengths_in->device().is_cpu(),
                     "qgru::integer_gru: lengths must be an integer CPU tensor [", N, "]");
    lengths = lengths_in->resolve_neg().to(at::kLong).contiguous();
    const int64_t* p = lengths.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n)
      QGRU_CHECK_VALUE(p[n] >= 1 && p[n] <= T, "qgru::integer_gru: lengths[", n, "] = ", p[n], " is outside [1, ", T,
                       "]");
  }
  const at::Tensor x = x_in.resolve_conj().resolve_neg(), hx = hx_in.resolve_conj().resolve_neg();
  if (c10::InferenceMode::is_enabled()) {
    // the Layers' reused buffers must stay normal tensors (qgru/native/layer.py gru_direction)
    c10::InferenceMode normal(false);
    return generic ? run_generic(e, x, hx, lengths) : run(e, x, hx, lengths);
  }
  return generic ? run_generic(e, x, hx, lengths) : run(e, x, hx, lengths);
}

// A PackedSequence's call (Model::forward_packed): its rows in the sorted order (longest first),
// which makes each step's rows one block in both layouts: step t's rows are data[off_t, off_t +
// batch_sizes[t]) and row 0 to batch_sizes[t] of the padded batch's step t, so laying them out
// padded and packing them again are a copy per step (run with a Packing: of the quantized input,
// and of the last layer's integer outputs before they are dequantized). The integer input (a zero
// token's at the padding), lengths, h0 and h_n are those qgru/module.py's general path gives
// (runtime.padded_from_packed in sorted order, hx.index_select(1, sorted_indices), the operator's
// run, packed_rows, h_n.index_select(1, unsorted_indices)), so out and h_n are its values bit for
// bit. nullopt where the PackedSequence is not well formed (the general path then raises its
// error) or a tensor is not of the form taken here (data a 2-D float CPU tensor [rows, I], int64
// CPU batch_sizes and indices, hx none or a float CPU tensor [L D, N, H]).
c10::optional<std::tuple<at::Tensor, at::Tensor>> packed_run(const Entry& e, const at::Tensor& data_in,
                                                             const at::Tensor& bs,
                                                             const c10::optional<at::Tensor>& si_in,
                                                             const c10::optional<at::Tensor>& ui_in,
                                                             const c10::optional<at::Tensor>& hx_in) {
  const Spec& s = e.parsed;
  if (!data_in.defined() || data_in.dim() != 2 || !data_in.is_floating_point() || !data_in.device().is_cpu() ||
      data_in.size(1) != s.I)
    return c10::nullopt;
  if (!bs.defined() || bs.dim() != 1 || bs.scalar_type() != at::kLong || !bs.device().is_cpu() || bs.numel() == 0)
    return c10::nullopt;
  const at::Tensor bsc = bs.resolve_neg().contiguous();
  const int64_t T = bsc.numel();
  const int64_t* b = bsc.data_ptr<int64_t>();
  const int64_t N = b[0];
  int64_t rows = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (b[t] < 1 || (t > 0 && b[t] > b[t - 1])) return c10::nullopt;
    rows += b[t];
  }
  if (rows != data_in.size(0)) return c10::nullopt;
  const bool has_si = si_in.has_value() && si_in->defined(), has_ui = ui_in.has_value() && ui_in->defined();
  if (has_si != has_ui) return c10::nullopt;
  at::Tensor si, ui;
  if (has_si) {
    for (const at::Tensor* v : {&*si_in, &*ui_in})
      if (v->dim() != 1 || v->size(0) != N || v->scalar_type() != at::kLong || !v->device().is_cpu())
        return c10::nullopt;
    si = si_in->resolve_neg().contiguous(), ui = ui_in->resolve_neg().contiguous();
    const int64_t* ps = si.data_ptr<int64_t>();
    const int64_t* pu = ui.data_ptr<int64_t>();
    std::vector<char> seen((size_t)N, 0);
    for (int64_t k = 0; k < N; ++k) {
      if (ps[k] < 0 || ps[k] >= N || seen[(size_t)ps[k]]) return c10::nullopt;
      seen[(size_t)ps[k]] = 1;
    }
    for (int64_t k = 0; k < N; ++k)
      if (pu[k] < 0 || pu[k] >= N || ps[pu[k]] != k) return c10::nullopt;
  }
  if (hx_in.has_value() && hx_in->defined()) {
    const at::Tensor& h = *hx_in;
    if (h.dim() != 3 || h.size(0) != s.L * s.D || h.size(1) != N || h.size(2) != s.H || !h.is_floating_point() ||
        !h.device().is_cpu())
      return c10::nullopt;
  }
  // lengths in the sorted order: row j's is the number of steps with more than j rows
  at::Tensor lengths = at::empty({N}, bsc.options());
  int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = t + 1 < T ? b[t + 1] : 0; j < b[t]; ++j) len[j] = t + 1;
  const at::Tensor data = data_in.resolve_conj().resolve_neg().contiguous();
  at::Tensor hx;
  if (hx_in.has_value() && hx_in->defined()) {
    hx = hx_in->resolve_conj().resolve_neg();
    if (has_si) hx = hx.index_select(1, si);
  } else {
    hx = at::zeros({s.L * s.D, N, s.H}, data.options());  // (the general path: x.new_zeros)
  }
  Packing pk;
  pk.b = b, pk.T = T, pk.N = N, pk.rows = rows, pk.inference = c10::InferenceMode::is_enabled();
  at::Tensor packed, h_n;
  if (c10::InferenceMode::is_enabled()) {
    // the Layers' reused buffers must stay normal tensors (qgru/native/layer.py gru_direction)
    c10::InferenceMode normal(false);
    std::tie(packed, h_n) = run(e, data, hx, lengths, &pk);
  } else {
    std::tie(packed, h_n) = run(e, data, hx, lengths, &pk);
  }
  if (has_ui) h_n = h_n.index_select(1, ui);
  return std::make_tuple(packed, h_n);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> integer_gru_cpu(const at::Tensor& x, const at::Tensor& hx,
                                                   const c10::optional<at::Tensor>& lengths,
                                                   at::TensorList params_in, c10::string_view spec_in) {
  const std::string spec(spec_in.data(), spec_in.size());
  const std::vector<at::Tensor> params(params_in.begin(), params_in.end());
  return checked_run(*entry_for(params, spec), x, hx, lengths);
}

}  // namespace op

namespace cpu_api {

struct Model::Impl {
  std::shared_ptr<op::Entry> entry;
};

Model::Model(const std::vector<at::Tensor>& params, const std::string& spec, const std::string& request)
    : impl(std::make_shared<Impl>(Impl{op::make_entry(params, spec, op::trim_lower(request.c_str()))})) {}

std::tuple<at::Tensor, at::Tensor> Model::forward(const at::Tensor& x, const at::Tensor& hx,
                                                  const c10::optional<at::Tensor>& lengths) const {
  return op::checked_run(*impl->entry, x, hx, lengths);
}

std::tuple<at::Tensor, at::Tensor> Model::forward_generic(const at::Tensor& x, const at::Tensor& hx,
                                                          const c10::optional<at::Tensor>& lengths) const {
  return op::checked_run(*impl->entry, x, hx, lengths, /*generic=*/true);
}

std::map<std::string, at::Tensor> Model::cuda_tensors(int64_t k) const {
  const op::Spec& s = impl->entry->parsed;
  QGRU_CHECK_VALUE(!s.cuda.empty() && k >= 0 && k < (int64_t)s.cuda.size(), "qgru Model: no CUDA variant ", k);
  return op::variant_args(s.cuda[(size_t)k], impl->entry->held.params, at::Device(at::kCPU), true).first;
}

std::map<std::string, int64_t> Model::cuda_values(int64_t k) const {
  const op::Spec& s = impl->entry->parsed;
  QGRU_CHECK_VALUE(!s.cuda.empty() && k >= 0 && k < (int64_t)s.cuda.size(), "qgru Model: no CUDA variant ", k);
  return s.cuda[(size_t)k].values;
}

c10::optional<std::tuple<at::Tensor, at::Tensor>> Model::forward_packed(
    const at::Tensor& data, const at::Tensor& batch_sizes, const c10::optional<at::Tensor>& sorted_indices,
    const c10::optional<at::Tensor>& unsorted_indices, const c10::optional<at::Tensor>& hx) const {
  return op::packed_run(*impl->entry, data, batch_sizes, sorted_indices, unsorted_indices, hx);
}

c10::optional<std::tuple<at::Tensor, at::Tensor>> Model::call(const at::Tensor& x,
                                                              const c10::optional<at::Tensor>& h0) const {
  if (!impl->entry->stack) return c10::nullopt;
  return impl->entry->stack->call(x, h0);
}

std::vector<std::string> Model::gemm_paths() const {
  std::vector<std::string> v;
  for (const auto& l : impl->entry->layers) v.push_back(l->gemm_path());
  return v;
}

std::vector<std::string> Model::one_row_paths() const {
  std::vector<std::string> v;
  for (const auto& l : impl->entry->layers) v.push_back(l->one_row_path());
  return v;
}

std::vector<bool> Model::one_row_made() const {
  std::vector<bool> v;
  for (const auto& l : impl->entry->layers) v.push_back(l->one_row_made());
  return v;
}

std::vector<std::string> Model::cell_kinds() const {
  std::vector<std::string> v;
  for (const auto& l : impl->entry->layers) v.push_back(l->cell_kind());
  return v;
}

}  // namespace cpu_api
}  // namespace qgru

TORCH_LIBRARY(qgru, m) {
  m.def("integer_gru(Tensor x, Tensor hx, Tensor? lengths, Tensor[] params, str spec) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(qgru, CPU, m) { m.impl("integer_gru", &qgru::op::integer_gru_cpu); }

// No gradient: a converted QuantGRU is inference only (QAT trains the float model). Inputs that
// ask for one are refused; otherwise the call goes on below autograd, and its outputs need none.
namespace qgru {
namespace op {
namespace {
std::tuple<at::Tensor, at::Tensor> integer_gru_autograd(const at::Tensor& x, const at::Tensor& hx,
                                                        const c10::optional<at::Tensor>& lengths,
                                                        at::TensorList params, c10::string_view spec) {
  QGRU_CHECK(!(at::GradMode::is_enabled() && (x.requires_grad() || hx.requires_grad())),
             "qgru::integer_gru has no gradient: a converted QuantGRU runs integer inference only "
             "(train the float model, or use qgru's QAT, and convert again)");
  at::AutoDispatchBelowADInplaceOrView below;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("qgru::integer_gru", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       const c10::optional<at::Tensor>&,
                                                                       at::TensorList, c10::string_view)>();
  return op.call(x, hx, lengths, params, spec);
}
}  // namespace
}  // namespace op
}  // namespace qgru

TORCH_LIBRARY_IMPL(qgru, Autograd, m) { m.impl("integer_gru", &qgru::op::integer_gru_autograd); }
