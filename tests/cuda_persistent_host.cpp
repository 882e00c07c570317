// Test-only extension (tests/test_cuda_persistent.py): the CUDA backend's persistent recurrence
// (csrc/qgru_persistent.h) run on the host, on a layer prepared as the CUDA Layer prepares it
// (qgru_layer.h LayerTensors: the same checks and the same structs), so that its index maps,
// ownership of units, double buffer and schedule are checked bit for bit against qgru/golden.py
// without a GPU. W.x comes from exact float64 matmuls of the int8 limbs (the values cuBLAS's int8
// GEMM gives) through the shared epilogue (requantize_product), as the CUDA forward's window does.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "qgru_fused_step.h"
#include "qgru_layer.h"
#include "qgru_persistent.h"

namespace {

using qgru::cuda::PkArgs;
using qgru::cuda::PkPlan;

struct Gemm {  // one product's limbs and pairs
  at::Tensor w;  // [n_w, M_pad, K_pad] int8
  int P = 0, n_act = 1;
  int act[qgru::kMaxPairs] = {}, wl[qgru::kMaxPairs] = {};
  int64_t scale[qgru::kMaxPairs] = {}, off[qgru::kMaxPairs] = {};
};

Gemm gemm_of(const qgru::LayerTensors& lt, const std::string& k, int64_t bits) {
  Gemm g;
  g.w = lt.tensor(k + "_weight_limbs");
  const at::Tensor pr = lt.pairs(k).contiguous();
  g.P = (int)pr.size(0);
  auto a = pr.accessor<int64_t, 2>();
  for (int p = 0; p < g.P; ++p)
    g.act[p] = (int)a[p][0], g.wl[p] = (int)a[p][1], g.scale[p] = a[p][2], g.off[p] = a[p][3];
  g.n_act = bits > 8 ? 2 : 1;
  return g;
}

// int8 limbs [n_act, rows, K_pad] of int values [rows, K] (op: the R.h operand's requantization)
at::Tensor limbs(const at::Tensor& v, int64_t K_pad, int32_t bits, const qgru::HOperand& op) {
  const int64_t rows = v.size(0), K = v.size(1), n_act = bits > 8 ? 2 : 1;
  at::Tensor out = at::zeros({n_act, rows, K_pad}, at::kChar);
  auto src = v.accessor<int64_t, 2>();
  int8_t* o = out.data_ptr<int8_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = qgru::gemm_operand(op, src[r][k]);
      for (int64_t i = 0; i < n_act; ++i) o[(i * rows + r) * K_pad + k] = qgru::act_limb(g, bits, (int)i);
    }
  return out;
}

// W.x - Z_Wx of every step [T N, 3H]: the exact int32 products of every limb pair (float64
// matmuls of the int8 limbs: the values cuBLAS's int8 GEMM gives), then the shared epilogue
// (requantize_product), as the CUDA forward's windows compute it.
at::Tensor wx_of(const qgru::LayerTensors& lt, const at::Tensor& qx_in) {
  const int64_t H = lt.value("H"), I = lt.value("I"), T = qx_in.size(0), N = qx_in.size(1);
  const int32_t x_bits = (int32_t)lt.value("x_bits");
  const bool pow2 = lt.value("pow2") != 0, acc32 = lt.value("acc32") != 0;
  const Gemm gx = gemm_of(lt, "x", x_bits);
  const qgru::AccRequant acc_x = lt.acc("Wx");
  const qgru::AccRequant32 acc_x32 = lt.acc32("Wx");
  const int64_t M_pad = gx.w.size(1);
  const qgru::HOperand none{0, qgru::Rescale{nullptr, nullptr, nullptr}, 0, 0, qgru::Range{0, 0}};
  const at::Tensor xl = limbs(qx_in.reshape({T * N, I}).to(at::kLong), gx.w.size(2), x_bits, none);
  std::vector<at::Tensor> Gx;
  for (int p = 0; p < gx.P; ++p)
    Gx.push_back(
        at::matmul(xl[gx.act[p]].to(at::kDouble), gx.w[gx.wl[p]].to(at::kDouble).t()).to(at::kInt).contiguous());
  qgru::LimbProducts lx{};
  for (int p = 0; p < qgru::kMaxPairs; ++p) {
    lx.G[p] = Gx[p < gx.P ? p : 0].data_ptr<int32_t>();
    lx.scale[p] = p < gx.P ? gx.scale[p] : 0;
    lx.weight_offset[p] = p < gx.P ? gx.off[p] : 0;
  }
  lx.ld = M_pad;
  lx.ones_col = lt.value("ones_col");
  at::Tensor dwx = at::empty({T * N, 3 * H}, at::kInt);
  int32_t* dw = dwx.data_ptr<int32_t>();
  qgru::dispatch_kernel(gx.P, pow2, acc32, [&](auto np, auto p2, auto a32) {
    for (int64_t r = 0; r < T * N; ++r)
      for (int64_t c = 0; c < 3 * H; ++c)
        dw[r * 3 * H + c] = (int32_t)qgru::requantize_product<decltype(np)::value, decltype(p2)::value,
                                                              decltype(a32)::value>(acc_x, acc_x32, lx, r, c);
  });
  return dwx;
}

}  // namespace

// out [T, N, H] int32 and the final state [N, H] of the persistent schedule, windows of
// `window` steps, on a device of `sm_count` SMs with `smem_per_block` bytes of shared memory per
// block; `reverse`: blocks run in reverse order within each step. Also returns the plan's fields.
std::tuple<at::Tensor, at::Tensor, std::map<std::string, int64_t>> run(
    qgru::TensorMap tensors, qgru::IntMap values, const at::Tensor& qx_in, const at::Tensor& qh0,
    const c10::optional<at::Tensor>& lengths_in, int64_t window, int64_t sm_count, int64_t smem_per_block,
    bool reverse) {
  const qgru::LayerTensors lt(std::move(tensors), std::move(values));
  const int64_t H = lt.value("H"), T = qx_in.size(0), N = qx_in.size(1);
  const int32_t h_bits = (int32_t)lt.value("h_bits");
  const bool pow2 = lt.value("pow2") != 0, acc32 = lt.value("acc32") != 0;
  const Gemm gh = gemm_of(lt, "h", h_bits);
  const qgru::CellParams cell = lt.cell();
  const at::Tensor dwx = wx_of(lt, qx_in);  // W.x of every step

  // the plan
  qgru::cuda::PkShape s{};
  s.H = H, s.N = N, s.K_pad = gh.w.size(2), s.M_pad = gh.w.size(1);
  s.n_act = gh.n_act, s.n_w = (int)gh.w.size(0), s.P = gh.P;
  s.ones = false;
  for (int p = 0; p < gh.P; ++p) s.ones = s.ones || gh.off[p] != 0;
  s.ones_col = lt.value("ones_col");
  PkPlan plan{};
  const int fit = qgru::cuda::pk_plan(s, qgru::cuda::PkDevice{sm_count, smem_per_block}, &plan);
  TORCH_CHECK(fit == qgru::cuda::kPkFits, "no persistent plan for this shape: reason ", fit);

  // buffers, as the CUDA forward keeps them; the operand's limbs of h0 at parity 0
  at::Tensor state = qh0.to(at::kInt).contiguous().clone();
  at::Tensor out = at::full({T, N, H}, -12345, at::kShort);  // every element must be written
  at::Tensor hbuf = at::full({plan.h_buffer}, 99, at::kChar);  // and padding k >= H zero:
  hbuf.view({2, plan.n_act, N, plan.K_pad}).narrow(3, H, plan.K_pad - H).zero_();
  const at::Tensor h0l = limbs(qh0.to(at::kLong), plan.K_pad, h_bits, cell.op);
  hbuf.view({2, plan.n_act, N, plan.K_pad})[0].copy_(h0l);
  at::Tensor lengths;
  if (lengths_in.has_value()) lengths = lengths_in->to(at::kLong).contiguous();
  std::vector<uint32_t> smem((size_t)(plan.blocks * plan.smem_bytes / 4), 0xA5A5A5A5u);  // stale
  std::vector<int64_t> order((size_t)plan.blocks);
  for (int64_t b = 0; b < plan.blocks; ++b) order[(size_t)b] = reverse ? plan.blocks - 1 - b : b;

  PkArgs a{};
  a.weight_limbs = gh.w.data_ptr<int8_t>();
  for (int p = 0; p < gh.P; ++p)
    a.act_limb[p] = gh.act[p], a.weight_limb[p] = gh.wl[p], a.scale[p] = gh.scale[p], a.weight_offset[p] = gh.off[p];
  a.state = state.data_ptr<int32_t>();
  a.out = out.data_ptr<int16_t>();
  a.lengths = lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr;
  a.h_buf = hbuf.data_ptr<int8_t>();
  a.h_bits = h_bits;
  for (int64_t t0 = 0; t0 < T; t0 += window) {
    const int64_t t1 = std::min(T, t0 + window);
    // the window's Wx - Z_Wx only (a copy: reading past it would read garbage, not the right step)
    const at::Tensor dwin = dwx.narrow(0, t0 * N, (t1 - t0) * N).clone();
    a.dwx = dwin.data_ptr<int32_t>();
    a.t0 = t0;
    qgru::dispatch_kernel(gh.P, pow2, acc32, [&](auto np, auto p2, auto a32) {
      qgru::cuda::pk_run_on_host<decltype(np)::value, decltype(p2)::value, decltype(a32)::value>(
          cell, plan, a, t0, t1, order.data(), (unsigned char*)smem.data());
    });
  }
  std::map<std::string, int64_t> info{{"blocks", plan.blocks},     {"units", plan.units},
                                      {"channels", plan.channels}, {"rows_tile", plan.rows_tile},
                                      {"tiles", plan.tiles},       {"smem_bytes", plan.smem_bytes},
                                      {"P", plan.P}};
  return {out.to(at::kInt), state, info};
}

// What both fused-step emulations start from: the layer (one limb pair: w8a8's R.h), W.x's
// requantized sums, the state from h0, the output filled with a sentinel (every element must be
// written), the operand's double buffer [2][N][K_pad] (padding k >= H stays zero) holding h0's limbs.
struct FusedCall {
  qgru::LayerTensors lt;
  int64_t H, T, N;
  int32_t h_bits;
  bool pow2, acc32;
  Gemm gh;
  qgru::CellParams cell;
  int64_t K_pad;
  at::Tensor dwx, state, out, hbuf, lengths;
  const int64_t* len;
  int32_t* st;
  int16_t* o;
  FusedCall(qgru::TensorMap tensors, qgru::IntMap values, const at::Tensor& qx_in, const at::Tensor& qh0,
            const c10::optional<at::Tensor>& lengths_in)
      : lt(std::move(tensors), std::move(values)), H(lt.value("H")), T(qx_in.size(0)), N(qx_in.size(1)),
        h_bits((int32_t)lt.value("h_bits")), pow2(lt.value("pow2") != 0), acc32(lt.value("acc32") != 0),
        gh(gemm_of(lt, "h", h_bits)), cell(lt.cell()) {
    TORCH_CHECK(gh.P == 1 && gh.w.size(0) == 1 && h_bits <= 8, "the fused step takes one limb pair (w8a8's R.h)");
    K_pad = gh.w.size(2);
    dwx = wx_of(lt, qx_in);
    state = qh0.to(at::kInt).contiguous().clone();
    out = at::full({T, N, H}, -12345, at::kShort);
    hbuf = at::zeros({2, N, K_pad}, at::kChar);
    hbuf[0].copy_(limbs(qh0.to(at::kLong), K_pad, h_bits, cell.op)[0]);
    if (lengths_in.has_value()) lengths = lengths_in->to(at::kLong).contiguous();
    len = lengths.defined() ? lengths.data_ptr<int64_t>() : nullptr;
    st = state.data_ptr<int32_t>();
    o = out.data_ptr<int16_t>();
  }
};

// out [T, N, H] int32 and the final state [N, H] of the fused step (csrc/qgru_fused_step.h), one
// step at a time on the host (fs_step_on_host: the emulated mma.sync fragments, `warps` warps per
// CTA), each (unit, row) pair's cell in the lane holding its gates (fs_cell), the next step's
// operand written into the other half of a double buffer [2][N][K_pad]. One limb pair only (w8a8's
// R.h): the accumulators are the exact products.
std::tuple<at::Tensor, at::Tensor> run_fused(qgru::TensorMap tensors, qgru::IntMap values, const at::Tensor& qx_in,
                                             const at::Tensor& qh0, const c10::optional<at::Tensor>& lengths_in,
                                             int64_t warps) {
  FusedCall c(std::move(tensors), std::move(values), qx_in, qh0, lengths_in);
  const int32_t* dw = c.dwx.data_ptr<int32_t>();
  const qgru::cuda::FsShape s = qgru::cuda::fs_shape(c.H, c.N, c.K_pad, warps);
  for (int64_t t = 0; t < c.T; ++t) {
    const int8_t* h_in = c.hbuf[t & 1].data_ptr<int8_t>();
    int8_t* h_out = c.hbuf[(t + 1) & 1].data_ptr<int8_t>();
    std::vector<int> done((size_t)(c.N * c.H), 0);
    bool ok = false;
    qgru::dispatch_kernel(1, c.pow2, c.acc32, [&](auto, auto p2, auto a32) {
      constexpr bool POW2 = decltype(p2)::value, ACC32 = decltype(a32)::value;
      ok = qgru::cuda::fs_step_on_host(s, c.gh.w.data_ptr<int8_t>(), h_in, [&](int64_t j, int64_t n, const int32_t* a0,
                                                                              const int32_t* a1, int p) {
        ++done[(size_t)(n * c.H + j)];
        qgru::cuda::fs_pair_step<POW2, ACC32>(c.cell, c.K_pad, c.h_bits, t, c.len, j, n, a0, a1, p, dw + t * c.N * 3 * c.H, c.st,
                                              c.o + t * c.N * c.H, h_out);  // the kernel's own
      });
    });
    TORCH_CHECK(ok, "the fused step's fragment maps are not a bijection");
    for (int v : done) TORCH_CHECK(v == 1, "a (unit, row) pair's cell ran ", v, " times in one step");
  }
  return {c.out.to(at::kInt), c.state};
}

// out [T, N, H] int32, the final state [N, H] and the emulation's result (qgru_fused_step.h
// FpEmuResult: 0 when every launch ran without a stale read, an overwrite or a deadlock) of the
// persistent fused step: the call's steps in launches of `window` steps (fp_launch_on_host: the
// CTAs as four-phase machines interleaved in FpOrder `order`, their R rows from a shared-memory copy
// of stale bytes, h exchanged through the double buffer and the step flags), the flags zeroed once
// for the whole call as the CUDA forward does, each (unit, row) pair's end of step by the kernel's
// fs_pair_step. `fault` breaks the protocol on purpose (fp_launch_on_host).
std::tuple<at::Tensor, at::Tensor, int64_t> run_fused_persistent(
    qgru::TensorMap tensors, qgru::IntMap values, const at::Tensor& qx_in, const at::Tensor& qh0,
    const c10::optional<at::Tensor>& lengths_in, int64_t warps, int64_t window, int64_t order, int64_t fault,
    int64_t seed) {
  TORCH_CHECK(window >= 1, "window must be at least 1");
  FusedCall c(std::move(tensors), std::move(values), qx_in, qh0, lengths_in);
  const qgru::cuda::FsShape s = qgru::cuda::fs_shape(c.H, c.N, c.K_pad, warps);
  const qgru::cuda::FpLayout L = qgru::cuda::fp_layout(c.K_pad, warps);
  std::vector<uint32_t> flags((size_t)qgru::cuda::fp_flag_words(s.ctas), 0u);  // the call's memset
  qgru::cuda::FpEmuState emu(s.ctas, (uint32_t)seed);
  int8_t* const h[2] = {c.hbuf[0].data_ptr<int8_t>(), c.hbuf[1].data_ptr<int8_t>()};
  std::vector<int> done((size_t)(c.T * c.N * c.H), 0);
  int rc = 0;
  for (int64_t t0 = 0; rc == 0 && t0 < c.T; t0 += window) {
    const int64_t t1 = std::min(c.T, t0 + window);
    const at::Tensor dwin = c.dwx.narrow(0, t0 * c.N, (t1 - t0) * c.N).clone();  // the window's only
    const int32_t* dw = dwin.data_ptr<int32_t>();
    qgru::dispatch_kernel(1, c.pow2, c.acc32, [&](auto, auto p2, auto a32) {
      constexpr bool POW2 = decltype(p2)::value, ACC32 = decltype(a32)::value;
      rc = qgru::cuda::fp_launch_on_host(
          s, L, c.gh.w.data_ptr<int8_t>(), h, flags.data(), t0, t1, (int)order, (int)fault, emu,
          [&](int64_t t, int64_t j, int64_t n, const int32_t* a0, const int32_t* a1, int p, int8_t* h_out) {
            ++done[(size_t)((t * c.N + n) * c.H + j)];
            qgru::cuda::fs_pair_step<POW2, ACC32>(c.cell, c.K_pad, c.h_bits, t, c.len, j, n, a0, a1, p,
                                                  dw + (t - t0) * c.N * 3 * c.H, c.st, c.o + t * c.N * c.H, h_out);
          });
    });
  }
  if (rc == 0)
    for (int v : done) TORCH_CHECK(v == 1, "a (unit, row) pair's cell ran ", v, " times in one step");
  return {c.out.to(at::kInt), c.state, (int64_t)rc};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("run", &run, pybind11::arg("tensors"), pybind11::arg("values"), pybind11::arg("qx"), pybind11::arg("qh0"),
        pybind11::arg("lengths"), pybind11::arg("window"), pybind11::arg("sm_count"),
        pybind11::arg("smem_per_block"), pybind11::arg("reverse"));
  m.def("run_fused", &run_fused, pybind11::arg("tensors"), pybind11::arg("values"), pybind11::arg("qx"),
        pybind11::arg("qh0"), pybind11::arg("lengths"), pybind11::arg("warps"));
  m.def("run_fused_persistent", &run_fused_persistent, pybind11::arg("tensors"), pybind11::arg("values"),
        pybind11::arg("qx"), pybind11::arg("qh0"), pybind11::arg("lengths"), pybind11::arg("warps"),
        pybind11::arg("window"), pybind11::arg("order"), pybind11::arg("fault"), pybind11::arg("seed"));
}
