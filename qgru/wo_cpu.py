"""The weight-only CPU kernel: float32 activations times packed 2/4/8-bit weights, unpacked in
registers (never a float copy of the weights), and the GRU's time loop around it.

A small C++ extension, compiled on first use with torch.utils.cpp_extension.load_inline into
~/.cache/qgru/wo-<hash> (the hash covers the source, the compiler flags and the CPU model, since
it is built with -march=native: correct on the machine that builds it, vectorized for its
instruction set). Two functions:

* ``wo_mm(x [M, K], codes, scale, zp, bits, group) -> y [M, N]``: y = x . dequantize(w)^T,
  computed per group as ``y += scale * sum_k float(code - zp) * x[k]`` (the integer difference is
  exact, one float32 product and sum per weight, the scale once per group).
* ``wo_gru_direction(gi [T, B, 3H], h0 [B, H], R codes/scale/zp, bits, group, b_hh, reverse)``: the
  whole time loop of one layer and direction, R.h by the same kernel and the gates in float32,
  given gi = W.x + b_ih for all steps.

Where no C++ compiler works, ``why_unavailable()`` says why; the module then refuses backend
"native" and says so once for backend "auto" (it runs the dequantizing path instead).
"""
from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path
from typing import Optional

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// y[m, n] = sum_g scale[g, n] * sum_{k in g} float(code[n, k] - zp[g, n]) * x[m, k], n in [n0, n0 + NB)
// NB output rows at once: their codes are read as NB consecutive words of a word row, unpacked
// in registers, and their accumulators stay in registers through a group.
template <int BITS, int NB>
inline void mm_block(const float* x, int64_t M, int64_t K, const uint32_t* codes, const float* scale,
                     const uint8_t* zp, int64_t N, int64_t group, float* y, int64_t ldy, int64_t n0) {
  constexpr int PER = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1;
  const int64_t J = (K + PER - 1) / PER;
  const int64_t G = (K + group - 1) / group;
  const int64_t wpg = group / PER;  // word rows per group (group is a multiple of PER)
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float out[NB];
    for (int l = 0; l < NB; ++l) out[l] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      float acc[NB];
      int32_t z[NB];
      for (int l = 0; l < NB; ++l) { acc[l] = 0.f; z[l] = zp[g * N + n0 + l]; }
      const int64_t j1 = std::min(J, (g + 1) * wpg);
      for (int64_t j = g * wpg; j < j1; ++j) {
        uint32_t w[NB];
        for (int l = 0; l < NB; ++l) w[l] = codes[j * N + n0 + l];
        const int64_t k0 = j * PER;
        if (k0 + PER <= K) {
          for (int i = 0; i < PER; ++i) {
            const float xv = xm[k0 + i];
            for (int l = 0; l < NB; ++l)
              acc[l] += (float)((int32_t)((w[l] >> (BITS * i)) & MASK) - z[l]) * xv;
          }
        } else {
          for (int i = 0; i < K - k0; ++i) {
            const float xv = xm[k0 + i];
            for (int l = 0; l < NB; ++l)
              acc[l] += (float)((int32_t)((w[l] >> (BITS * i)) & MASK) - z[l]) * xv;
          }
        }
      }
      for (int l = 0; l < NB; ++l) out[l] += scale[g * N + n0 + l] * acc[l];
    }
    for (int l = 0; l < NB; ++l) y[m * ldy + n0 + l] = out[l];
  }
}

template <int BITS>
void mm_rows(const float* x, int64_t M, int64_t K, const uint32_t* codes, const float* scale,
             const uint8_t* zp, int64_t N, int64_t group, float* y, int64_t ldy, int64_t b0, int64_t b1) {
  constexpr int NB = 32;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NB;
    if (n0 + NB <= N) {
      mm_block<BITS, NB>(x, M, K, codes, scale, zp, N, group, y, ldy, n0);
    } else {
      for (int64_t n = n0; n < N; ++n) mm_block<BITS, 1>(x, M, K, codes, scale, zp, N, group, y, ldy, n);
    }
  }
}

void mm_dispatch(const float* x, int64_t M, int64_t K, const uint32_t* codes, const float* scale,
                 const uint8_t* zp, int64_t N, int64_t group, int64_t bits, float* y, int64_t ldy) {
  // chunks of output rows: a few hundred per task keeps acc in L1 and gives the threads work
  const int64_t blocks = (N + 31) / 32;  // mm_rows' blocks of 32 output rows
  auto body = [&](int64_t b0, int64_t b1) {
    if (bits == 2) mm_rows<2>(x, M, K, codes, scale, zp, N, group, y, ldy, b0, b1);
    else if (bits == 4) mm_rows<4>(x, M, K, codes, scale, zp, N, group, y, ldy, b0, b1);
    else mm_rows<8>(x, M, K, codes, scale, zp, N, group, y, ldy, b0, b1);
  };
  if (N * K * std::max<int64_t>(M, 1) < (1 << 17)) body(0, blocks);
  else at::parallel_for(0, blocks, 4, body);
}

void check(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
           const torch::Tensor& zp, int64_t bits, int64_t group, int64_t K) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "wo_mm: bits must be 2, 4 or 8");
  const int64_t per = 32 / bits;
  TORCH_CHECK(group > 0 && group % per == 0, "wo_mm: group must be a positive multiple of ", per);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "wo_mm: x must be a contiguous float32 CPU matrix");
  TORCH_CHECK(x.size(1) == K, "wo_mm: x has ", x.size(1), " columns, the weight ", K, " inputs");
  const int64_t N = codes.size(1);
  TORCH_CHECK(codes.scalar_type() == torch::kInt32 && codes.dim() == 2 && codes.is_contiguous() &&
              codes.size(0) == (K + per - 1) / per, "wo_mm: codes must be contiguous int32 [ceil(K/per), N]");
  const int64_t G = (K + group - 1) / group;
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.dim() == 2 &&
              scale.size(0) == G && scale.size(1) == N, "wo_mm: scale must be contiguous float32 [G, N]");
  TORCH_CHECK(zp.scalar_type() == torch::kUInt8 && zp.is_contiguous() && zp.dim() == 2 &&
              zp.size(0) == G && zp.size(1) == N, "wo_mm: zp must be contiguous uint8 [G, N]");
}

torch::Tensor wo_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, torch::Tensor zp,
                    int64_t bits, int64_t group, int64_t K) {
  check(x, codes, scale, zp, bits, group, K);
  const int64_t M = x.size(0), N = codes.size(1);
  auto y = torch::empty({M, N}, x.options());
  mm_dispatch(x.data_ptr<float>(), M, K, reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>()),
              scale.data_ptr<float>(), zp.data_ptr<uint8_t>(), N, group, bits, y.data_ptr<float>(), N);
  return y;
}

inline float sigmoidf_(float v) { return 1.f / (1.f + std::exp(-v)); }

std::vector<torch::Tensor> wo_gru_direction(torch::Tensor gi, torch::Tensor h0, torch::Tensor codes,
                                            torch::Tensor scale, torch::Tensor zp, int64_t bits,
                                            int64_t group, torch::Tensor b_hh, torch::Tensor lengths,
                                            bool reverse) {
  TORCH_CHECK(gi.dim() == 3 && gi.is_contiguous() && gi.scalar_type() == torch::kFloat32 && gi.device().is_cpu(),
              "wo_gru_direction: gi must be contiguous float32 [T, B, 3H] on the CPU");
  const int64_t T = gi.size(0), B = gi.size(1), H = h0.size(1);
  TORCH_CHECK(gi.size(2) == 3 * H && h0.dim() == 2 && h0.size(0) == B && h0.is_contiguous() &&
              h0.scalar_type() == torch::kFloat32, "wo_gru_direction: h0 must be contiguous float32 [B, H]");
  check(h0, codes, scale, zp, bits, group, H);
  TORCH_CHECK(codes.size(1) == 3 * H, "wo_gru_direction: R has ", codes.size(1), " rows, expected 3H");
  const bool has_b = b_hh.numel() > 0;
  TORCH_CHECK(!has_b || (b_hh.scalar_type() == torch::kFloat32 && b_hh.is_contiguous() && b_hh.numel() == 3 * H),
              "wo_gru_direction: b_hh must be contiguous float32 [3H] or empty");
  const bool has_len = lengths.numel() > 0;
  TORCH_CHECK(!has_len || (lengths.scalar_type() == torch::kInt64 && lengths.numel() == B && lengths.is_contiguous()),
              "wo_gru_direction: lengths must be contiguous int64 [B] or empty");
  const int64_t* len = has_len ? lengths.data_ptr<int64_t>() : nullptr;
  auto out = torch::empty({T, B, H}, gi.options());
  auto h = h0.clone();
  std::vector<float> gh(B * 3 * H);
  const uint32_t* c = reinterpret_cast<const uint32_t*>(codes.data_ptr<int32_t>());
  const float* bh = has_b ? b_hh.data_ptr<float>() : nullptr;
  float* hp = h.data_ptr<float>();
  for (int64_t s = 0; s < T; ++s) {
    const int64_t t = reverse ? T - 1 - s : s;
    mm_dispatch(hp, B, H, c, scale.data_ptr<float>(), zp.data_ptr<uint8_t>(), 3 * H, group, bits, gh.data(), 3 * H);
    const float* g = gi.data_ptr<float>() + t * B * 3 * H;
    float* o = out.data_ptr<float>() + t * B * H;
    for (int64_t b = 0; b < B; ++b) {
      if (has_len && t >= len[b]) {  // padding of a shorter sequence: state kept, output 0
        std::fill(o + b * H, o + (b + 1) * H, 0.f);
        continue;
      }
      const float* gib = g + b * 3 * H;
      const float* ghb = gh.data() + b * 3 * H;
      for (int64_t j = 0; j < H; ++j) {
        const float hr = ghb[j] + (has_b ? bh[j] : 0.f);
        const float hz = ghb[H + j] + (has_b ? bh[H + j] : 0.f);
        const float hn = ghb[2 * H + j] + (has_b ? bh[2 * H + j] : 0.f);
        const float r = sigmoidf_(gib[j] + hr);
        const float z = sigmoidf_(gib[H + j] + hz);
        const float n = std::tanh(gib[2 * H + j] + r * hn);
        const float hv = (1.f - z) * n + z * hp[b * H + j];
        o[b * H + j] = hv;
      }
      std::copy(o + b * H, o + (b + 1) * H, hp + b * H);
    }
  }
  return {out, h};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("wo_mm", &wo_mm, "x [M, K] float32 times packed weights -> [M, N]");
  m.def("wo_gru_direction", &wo_gru_direction, "one GRU layer direction over T steps");
}
"""

_FLAGS = ["-O3", "-march=native"]
_lock = threading.Lock()
_state = {"module": None, "error": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_dir() -> Path:
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + _cpu_model() + torch.__version__).encode()).hexdigest()[:16]
    root = Path(os.environ.get("QGRU_CACHE", Path.home() / ".cache" / "qgru"))
    return root / f"wo-{key}"


def load(build: bool = True):
    """The compiled module, building it first if needed (``build``); None where it cannot be built
    (why_unavailable() then says why)."""
    with _lock:
        if _state["module"] is not None or _state["error"] is not None:
            return _state["module"]
        d = build_dir()
        if not build and not any(d.glob("*.so")):
            return None
        try:
            from torch.utils import cpp_extension
            d.mkdir(parents=True, exist_ok=True)
            _state["module"] = cpp_extension.load_inline(
                name="qgru_wo_cpu", cpp_sources=[_SOURCE], extra_cflags=_FLAGS, build_directory=str(d),
                verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure: reported by why_unavailable()
            _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        return _state["module"]


def why_unavailable() -> str:
    """'' when the kernel is usable, else why not (after trying to build it)."""
    load()
    return _state["error"] or ""


def wo_mm(x: torch.Tensor, p) -> torch.Tensor:
    """x [M, K] float32 (CPU) times the PackedWeight ``p`` transposed: [M, N]."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"the weight-only CPU kernel is unavailable: {why_unavailable()}")
    return mod.wo_mm(x.contiguous(), p.codes, p.scale, p.zp, p.bits, p.group, p.K)


def gru_direction(gi: torch.Tensor, h0: torch.Tensor, R, b_hh: Optional[torch.Tensor], reverse: bool,
                  lengths: Optional[torch.Tensor] = None):
    mod = load()
    if mod is None:
        raise RuntimeError(f"the weight-only CPU kernel is unavailable: {why_unavailable()}")
    empty = torch.empty(0, dtype=torch.float32, device=gi.device)
    b = b_hh if b_hh is not None else empty
    empty = torch.empty(0, dtype=torch.int64, device=gi.device)
    return mod.wo_gru_direction(gi.contiguous(), h0.contiguous(), R.codes, R.scale, R.zp, R.bits, R.group,
                                b.contiguous(), empty if lengths is None else lengths.to(torch.int64).contiguous(),
                                reverse)
