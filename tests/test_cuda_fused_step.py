"""The fused step kernel's design (csrc/qgru_fused_step.h: R.h by int8 mma.sync.m16n8k32 with the
three gates of a unit in one lane's accumulators, the cell in that lane) run on the host against
qgru/golden.py bit for bit, without a GPU: tests/cuda_persistent_host.cpp run_fused emulates every
CTA, warp and MMA fragment of each step (fs_step_on_host), runs each (unit, row) pair's cell
(fs_cell, the shared qgru_cell.h function), and writes the next step's int8 operand into the other
half of a double buffer. The fragment maps and the schedule alone are checked against the exact
int8 product in tests/test_cuda_compile.py. The kernel built on them (csrc/qgru_cuda_fused.cu, opt-in:
QGRU_CUDA_FUSED=1) is compile-checked in tests/test_cuda_fused_compile.py and run on a GPU in
tests/test_cuda_fused.py.
"""
from __future__ import annotations

import pytest
import torch

from qgru import golden
from qgru.config import QuantConfig
from qgru.native.prepare import CUDA_GEMM_MIN, prepare_layer

from test_cuda_persistent import host_ext  # noqa: F401 (a fixture: the host emulation extension)
from test_native import _random_inputs, _random_layer

CASES = [  # I, H, T, N, warps per CTA
    (5, 12, 9, 5, 8),     # 2 CTAs (the last of 4 units), one n tile split over K by 8 warps (K = 32: 1 k step)
    (7, 37, 11, 6, 3),    # 5 CTAs, 3 warps (3 partial K splits of 2 k steps)
    (3, 1, 4, 2, 1),      # one unit, one warp
    (9, 40, 6, 17, 2),    # 3 n tiles over 2 warps: two passes
    (16, 70, 5, 9, 16),   # K = 80 (3 k steps, the last half padding), 16 warps
]



def fused_layer(config, I, H, seed):
    """A random layer of `config` whose tensors' ranges keep every requantization of the fused
    step's cell in its exact bounds (the CUDA fused-step tests' layers)."""
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))  # noqa: E731
    per = lambda lo, hi: (torch.full((3 * H,), lo, dtype=torch.float64),  # noqa: E731
                          torch.full((3 * H,), hi, dtype=torch.float64))
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4, 5), "Rh": per(-3, 2),
              "r_pre": one(-6, 6), "z_pre": one(-6, 6), "g_pre": one(-5, 7)}
    return _random_layer(config, I, H, ranges, w_exp=-2, b_exp=-2, zero_row=False, seed=seed)

@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
@pytest.mark.parametrize("I,H,T,N,warps", CASES)
def test_fused_step_schedule_is_the_golden_model(host_ext, mode, I, H, T, N, warps):  # noqa: F811
    """w8a8 (one limb pair: the accumulators are the exact products) in both scale modes, with
    lengths (rows past their length carry their state) and without: the fused step's out and
    h_n equal golden.gru_direction's."""
    p = fused_layer(QuantConfig.load("w8a8", overrides={"scale_mode": mode}), I, H, seed=I * 100 + H)
    t, v = prepare_layer(p, gemm_min=CUDA_GEMM_MIN)
    assert t["h_pairs"].shape[0] == 1, "w8a8's R.h must be one limb pair"
    for with_lengths in (True, False):
        gen = torch.Generator().manual_seed(T * 7 + N)
        qx, qh0, lengths = _random_inputs(p, T, N, with_lengths, gen)
        want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
        out, h = host_ext.run_fused(t, v, qx.int(), qh0.int(), lengths, warps)
        bad = (out.long() != want_out).nonzero()
        assert torch.equal(out.long(), want_out), f"out differs at {bad[:5].tolist()} ({len(bad)})"
        assert torch.equal(h.long(), want_h), "h_n differs"


def test_fused_step_refuses_two_limb_pairs(host_ext):  # noqa: F811
    """w8a16's R.h has two limb pairs (a 16-bit operand): the fused step (one pair) refuses it with
    a clear error rather than computing a wrong product."""
    config = QuantConfig.load("w8a16")
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))  # noqa: E731
    per = lambda lo, hi: (torch.full((24,), lo, dtype=torch.float64), torch.full((24,), hi, dtype=torch.float64))  # noqa: E731
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4, 5), "Rh": per(-3, 2),
              "r_pre": one(-6, 6), "z_pre": one(-6, 6), "g_pre": one(-5, 7)}
    p = _random_layer(config, 5, 8, ranges, w_exp=-2, b_exp=-2, zero_row=False, seed=3)
    t, v = prepare_layer(p, gemm_min=CUDA_GEMM_MIN)
    qx, qh0, lengths = _random_inputs(p, 3, 2, False, torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="one limb pair"):
        host_ext.run_fused(t, v, qx.int(), qh0.int(), lengths, 8)
