"""The persistent fused step (QGRU_CUDA_FUSED=2; csrc/qgru_cuda_fused.cu fused_persistent_kernel, its
protocol, shared-memory layout and co-residency rule in csrc/qgru_fused_step.h fp_*) without a GPU:

* the protocol's functions compiled for the host (a host program): the shared-memory copy of a
  CTA's R rows gives, through the kernel's A loads, the fragments of R itself (padding zero, stale
  bytes never read) with every register's 32 words in 32 banks; the layout's size for every H up
  to 1024 (and the largest H it takes) against the H200's 227 KB, independent of the batch; the
  flags' lines and values, the parities; the co-residency rule's verdicts;
* whole calls emulated on the host (tests/cuda_persistent_host.cpp run_fused_persistent:
  fp_launch_on_host runs each launch's CTAs as four-phase machines, interleaved in six orders,
  adversarial ones included, over several windows) bit for bit against qgru/golden.py, while the
  emulation checks that no CTA reads a stale slice of h, overwrites one still to be read, or waits
  forever; and the same emulation with the protocol broken on purpose reports it.

The kernel's machine code is checked in tests/test_cuda_fused_compile.py, and the kernel runs on a
GPU in tests/test_cuda_fused.py (skipped without one).
"""
from __future__ import annotations

import pytest
import torch

from qgru import golden
from qgru.config import QuantConfig
from qgru.native.prepare import CUDA_GEMM_MIN, prepare_layer

from test_cuda_compile import _host_check
from test_cuda_fused_step import fused_layer
from test_cuda_persistent import host_ext  # noqa: F401 (a fixture: the host emulation extension)
from test_native import _random_inputs

_PROTOCOL_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <set>
#include <vector>
#include "qgru_fused_step.h"

using namespace qgru::cuda;
typedef long long ll;

static unsigned rng = 4242u;
static int8_t rand8() { rng = rng * 1103515245u + 12345u; return (int8_t)((int)((rng >> 16) % 255) - 127); }
static uint32_t word(const int8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// The shared copy of CTA c's rows (fp_stage_source into stale bytes), read by the kernel's A loads
// (fs_load_a_regs, fp_r_offset), against the fused step's loads of R itself (fs_load_a_words), for
// every CTA, tile, k step (one past the end too) and lane; every register's 32 words in 32 banks;
// the staged bytes past the rows' K_pad zero.
static int check_rows(ll H, ll K_pad, ll warps) {
  const ll M = 3 * H + 16;
  std::vector<int8_t> R((size_t)(M * K_pad));
  for (auto& v : R) v = rand8();
  const FsShape s = fs_shape(H, 8, K_pad, warps);
  const FpLayout L = fp_layout(K_pad, warps);
  if (L.r_ld < K_pad || L.r_ld % 128 != 16 || L.r_ld - K_pad >= 128 || L.r_words * 4 != kFpRows * L.r_ld ||
      L.part_offset % 16 != 0 || L.part_offset < kFpRows * L.r_ld || L.part_bytes != warps * kFsTiles * 4 * 32 * 4 ||
      L.bytes != L.part_offset + L.part_bytes) {
    std::printf("layout K %lld: r_ld %lld bytes %lld\n", K_pad, (ll)L.r_ld, (ll)L.bytes);
    return 1;
  }
  std::vector<unsigned char> sm((size_t)L.bytes);
  for (ll c = 0; c < s.ctas; ++c) {
    std::memset(sm.data(), 0xA5, sm.size());
    for (ll w = 0; w < L.r_words; ++w) {
      const ll src = fp_stage_source(L, H, K_pad, c, w);
      if (src >= 0 && (src % 4 != 0 || src + 4 > M * K_pad)) { std::printf("source %lld\n", src); return 1; }
      const uint32_t v = src >= 0 ? word(R.data() + src) : 0u;
      std::memcpy(sm.data() + 4 * w, &v, 4);
    }
    for (ll row = 0; row < kFpRows; ++row)
      for (ll k = K_pad; k < L.r_ld; ++k)
        if (sm[(size_t)(row * L.r_ld + k)] != 0) { std::printf("padding byte not zero\n"); return 1; }
    for (ll kstep = 0; kstep < s.k_steps + 1; ++kstep)
      for (int tile = 0; tile < kFsTiles; ++tile) {
        std::set<ll> banks[4];
        for (int lane = 0; lane < 32; ++lane) {
          uint32_t want[4], got[4];
          fs_load_a_words(R.data(), K_pad, H, c, tile, kstep, lane, want, word);
          fs_load_a_regs(K_pad, H, c, tile, kstep, lane, got, [&](int tl, int m, int64_t, int64_t k) {
            const ll off = fp_r_offset(L, tl, m, k);
            if (off < 0 || off % 4 != 0 || off + 4 > L.part_offset) { std::printf("offset %lld\n", off); std::exit(1); }
            uint32_t v;
            std::memcpy(&v, sm.data() + off, 4);
            return v;
          });
          for (int r = 0; r < 4; ++r) {
            if (want[r] != got[r]) {
              std::printf("H %lld K %lld cta %lld tile %d k step %lld lane %d register %d: %08x, R %08x\n", H, K_pad,
                          c, tile, kstep, lane, r, got[r], want[r]);
              return 1;
            }
            const int m = fs_a_row(lane, 4 * r);
            if (fp_smem_row(tile, m) >= 0) banks[r].insert((fp_r_offset(L, tile, m, kstep * kFsMmaK + fs_a_k(lane, 4 * r)) / 4) % 32);
          }
        }
        for (int r = 0; r < 4; ++r)
          if (!banks[r].empty() && banks[r].size() != (tile == 1 && r % 2 == 1 ? 0u : 32u)) {
            std::printf("K %lld tile %d register %d: %zu banks for 32 lanes\n", K_pad, tile, r, banks[r].size());
            return 1;
          }
      }
  }
  return 0;
}

int main() {
  int bad = 0;
  const ll rows[][2] = {{1, 32}, {7, 32}, {12, 32}, {37, 48}, {70, 80}, {64, 64}, {100, 112}, {300, 304}};
  for (const auto& r : rows)
    for (ll warps : {1LL, 8LL}) bad |= check_rows(r[0], r[1], warps);
  // the budget: every H up to 1024 (K_pad = H padded to 16, at least 32, as prepare_layer pads it)
  // fits the H200's 227 KB per block, and even the 48 KB a launch gets without the opt-in; no N
  // enters the layout, so every batch size has the same; the largest H within 227 KB
  const ll kH200 = 227 * 1024;
  ll worst = 0;
  for (ll H = 1; H <= 1024; ++H) {
    const ll K = H < 32 ? 32 : (H + 15) / 16 * 16;
    const FpLayout L = fp_layout(K, 8);
    if (L.bytes > 48 * 1024) { std::printf("H %lld: %lld bytes of shared memory\n", H, (ll)L.bytes); bad = 1; }
    worst = L.bytes > worst ? L.bytes : worst;
  }
  ll h_max = 0;
  for (ll H = 1024; H <= 20000; H += 16)
    if (fp_layout(H, 8).bytes <= kH200) h_max = H;
  std::printf("FP-BUDGET H=1024: %lld bytes (24 x %lld R + %lld partials); largest H within 227 KB: %lld\n", worst,
              (ll)fp_layout(1024, 8).r_ld, (ll)fp_layout(1024, 8).part_bytes, h_max);
  if (worst != 24 * 1040 + 8192 || h_max < 8192) bad = 1;
  // flags: one 128-byte line each, apart; a step's flag is what the next step waits for; parities alternate
  for (ll c = 0; c + 1 < 200; ++c)
    if (fp_flag_index(c + 1) - fp_flag_index(c) != kFpFlagStride || kFpFlagStride * 4 < 128 ||
        fp_flag_words(c + 1) <= fp_flag_index(c)) { std::printf("flag index %lld\n", c); bad = 1; }
  for (ll t = 0; t < 5000; ++t) {
    if (fp_flag_after(t) != fp_flag_needed(t + 1) || !fp_flag_ready(fp_flag_after(t), t + 1) ||
        fp_flag_ready(fp_flag_after(t) - 1, t + 1) || fp_in_parity(t) == fp_out_parity(t) ||
        fp_out_parity(t) != fp_in_parity(t + 1)) { std::printf("flags at step %lld\n", t); bad = 1; break; }
  }
  if (!fp_flag_ready(0u, 0)) { std::printf("step 0 must not wait (h0 is written before the launch)\n"); bad = 1; }
  // co-residency: the H200 (132 SMs, 227 KB) takes H = 1024 (128 CTAs) at one block per SM, refuses
  // 133 CTAs then, takes them at two; no cooperative launch, or too little shared memory: refused
  const FpDevice h200{132, kH200, 1, true};
  for (ll N : {1LL, 64LL, 256LL, 4096LL, 1LL << 20}) {
    const FsShape s = fs_shape(1024, N, 1024, 8);
    if (s.ctas != 128 || fp_fit(s, fp_layout(1024, 8), h200) != kFpFits) { std::printf("H=1024 N=%lld\n", N); bad = 1; }
  }
  const FsShape s133 = fs_shape(1064, 64, 1072, 8);
  const FpLayout l133 = fp_layout(1072, 8);
  if (s133.ctas != 133 || fp_fit(s133, l133, h200) != kFpNotCoResident ||
      fp_fit(s133, l133, FpDevice{132, kH200, 2, true}) != kFpFits ||
      fp_fit(s133, l133, FpDevice{132, kH200, 2, false}) != kFpNoCooperative ||
      fp_fit(s133, l133, FpDevice{132, l133.bytes - 1, 2, true}) != kFpNoSharedMemory ||
      fp_fit(s133, l133, FpDevice{132, l133.bytes, 2, true}) != kFpFits) { std::printf("co-residency rule\n"); bad = 1; }
  if (!bad) std::printf("FP-PROTOCOL-OK\n");
  return bad;
}
"""


def test_fused_persistent_protocol_layout_and_budget(tmp_path):
    """The persistent fused step's shared copy of R's rows is R's own fragments through the kernel's
    loads (padding zero, no stale byte read) without bank conflicts; its shared memory for every H
    up to 1024 is within 48 KB (33,152 bytes at H=1024, whatever the batch) and H up to at least
    8192 fits the H200's 227 KB; one flag per 128-byte line, each step's flag the next step's wait,
    parities alternating; the co-residency rule takes exactly the grids the occupancy allows."""
    _host_check(tmp_path, "fp_protocol_check", _PROTOCOL_CHECK, "FP-PROTOCOL-OK")


ORDERS = {"in order": 0, "reversed": 1, "random": 2, "ahead first": 3, "behind first": 4, "slow CTA 0": 5}

CASES = [  # I, H, T, N, warps per CTA, window (steps per launch)
    (5, 12, 9, 5, 8, 4),     # 2 CTAs, K split over 8 warps, 3 launches (flags run on over them)
    (7, 37, 11, 6, 3, 11),   # 5 CTAs, 3 warps, one launch
    (3, 1, 4, 2, 1, 1),      # one CTA of one unit, one step per launch
    (9, 40, 6, 17, 2, 5),    # 3 n tiles over 2 warps (two passes), an odd window
    (16, 70, 5, 9, 16, 2),   # 9 CTAs, K = 80 (the last k step half padding), 16 warps
]


def _layer(mode, I, H, seed):
    return fused_layer(QuantConfig.load("w8a8", overrides={"scale_mode": mode}), I, H, seed)


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
@pytest.mark.parametrize("I,H,T,N,warps,window", CASES)
def test_fused_persistent_launch_is_the_golden_model(host_ext, order, mode, I, H, T, N, warps, window):  # noqa: F811
    """Every order of the CTAs' phases, with lengths and without: no stale read, overwrite or
    deadlock, and out and h_n equal golden.gru_direction's."""
    p = _layer(mode, I, H, seed=I * 100 + H)
    t, v = prepare_layer(p, gemm_min=CUDA_GEMM_MIN)
    assert t["h_pairs"].shape[0] == 1, "w8a8's R.h must be one limb pair"
    for with_lengths in (True, False):
        gen = torch.Generator().manual_seed(T * 7 + N)
        qx, qh0, lengths = _random_inputs(p, T, N, with_lengths, gen)
        want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
        out, h, rc = host_ext.run_fused_persistent(t, v, qx.int(), qh0.int(), lengths, warps, window,
                                                   ORDERS[order], 0, T + N)
        assert rc == 0, f"the emulation reported {rc} (1 deadlock, 2 stale read, 3 overwrite, 4 maps)"
        bad = (out.long() != want_out).nonzero()
        assert torch.equal(out.long(), want_out), f"out differs at {bad[:5].tolist()} ({len(bad)})"
        assert torch.equal(h.long(), want_h), "h_n differs"


@pytest.mark.parametrize("seed", range(6))
def test_fused_persistent_random_orders(host_ext, seed):  # noqa: F811
    """Random interleavings (a seed each) of a layer of 6 CTAs over windows of 3 steps stay exact."""
    p = _layer("multiplier", 11, 44, seed=seed)
    t, v = prepare_layer(p, gemm_min=CUDA_GEMM_MIN)
    qx, qh0, lengths = _random_inputs(p, 10, 4, seed % 2 == 0, torch.Generator().manual_seed(seed))
    want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
    out, h, rc = host_ext.run_fused_persistent(t, v, qx.int(), qh0.int(), lengths, 4, 3, ORDERS["random"], 0,
                                               1000 + seed)
    assert rc == 0 and torch.equal(out.long(), want_out) and torch.equal(h.long(), want_h)


FAULTS = {1: "wait for one step less", 2: "one buffer for both parities", 3: "publish before the writes"}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fused_persistent_emulation_catches_a_broken_protocol(host_ext, fault):  # noqa: F811
    """The emulation's checks are not vacuous: each way of breaking the protocol (FAULTS) is reported
    (a stale read or an overwrite) under at least one of the orders, and the correct protocol under
    none of them."""
    p = _layer("multiplier", 7, 37, seed=3)
    t, v = prepare_layer(p, gemm_min=CUDA_GEMM_MIN)
    qx, qh0, lengths = _random_inputs(p, 6, 5, False, torch.Generator().manual_seed(2))
    caught = []
    for name, order in ORDERS.items():
        _, _, ok = host_ext.run_fused_persistent(t, v, qx.int(), qh0.int(), lengths, 8, 3, order, 0, 5)
        assert ok == 0, f"the correct protocol reported {ok} in order {name!r}"
        _, _, rc = host_ext.run_fused_persistent(t, v, qx.int(), qh0.int(), lengths, 8, 3, order, fault, 5)
        if rc in (2, 3):
            caught.append(name)
    assert caught, f"fault {fault} ({FAULTS[fault]}) went unnoticed in every order"
