"""The fused step kernel on a GPU (csrc/qgru_cuda_fused.cu, QGRU_CUDA_FUSED=1: one kernel per step,
R.h by int8 mma.sync and the cell in registers) against the golden model and the reference
backend, bit for bit, with the layer counter fused_calls showing which path ran.

Skipped without a CUDA device (test_native's cuda_backend fixture; where torch sees one, an
unavailable cuda backend is a failure). Without a GPU, tests/test_cuda_fused_step.py runs the
kernel's schedule on the host and tests/test_cuda_fused_compile.py checks its machine code.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

from qgru import golden
from qgru.config import QuantConfig

from test_cuda_fused_step import fused_layer
from test_cuda_speed_paths import _model, _reference, _same
from test_native import _random_inputs, cuda_backend  # noqa: F401 (a fixture)

# an 8-bit state read by R.h directly (w8a8 before h_gemm): the operand without requantization
_STATE8 = {"tensors": {"h": {"bits": 8, "headroom": 1.0}, "h_gemm": None}}

SHAPES = [  # I, H, T, N
    (3, 1, 4, 2),      # one unit: one CTA of 1 unit, K_pad 16 (half a k step)
    (5, 12, 9, 5),     # a partial CTA (4 of 8 units), one n tile split over K
    (16, 300, 40, 3),  # K_pad 304 (not a multiple of 32), 38 CTAs
    (8, 64, 20, 70),   # 9 n tiles over 8 warps: two passes
    (32, 256, 12, 1),  # B = 1: K split over the 8 warps
    (24, 128, 6, 64),  # B = 64: one n tile per warp
]


def _layer_params(cfg, mode, I, H, seed):
    overrides = dict(_STATE8) if cfg == "w8a8-state8" else {}
    overrides["scale_mode"] = mode
    return fused_layer(QuantConfig.load("w8a8" if cfg == "w8a8-state8" else cfg, overrides=overrides), I, H, seed)


@pytest.mark.parametrize("cfg,mode", [("w8a8", "pow2"), ("w8a8", "multiplier"), ("w8a8-state8", "multiplier")])
@pytest.mark.parametrize("I,H,T,N", SHAPES)
def test_cuda_fused_step_is_the_golden_model(cuda_backend, monkeypatch, cfg, mode, I, H, T, N):  # noqa: F811
    """With QGRU_CUDA_FUSED=1 a one-limb-pair layer's recurrence runs the fused step (fused_calls
    counts every call: the eager first call, the graph's capture and its replay) and gives
    golden.gru_direction's integers with and without lengths; with QGRU_CUDA_FUSED=2 every call runs
    the persistent fused step or, counted with its reason, the fused step, with the same integers;
    with QGRU_CUDA_FUSED=0 the per-step path gives the same and fused_calls stays 0."""
    from qgru import native
    p = _layer_params(cfg, mode, I, H, seed=H * 31 + N)
    dev = torch.device("cuda:0")
    monkeypatch.delenv("QGRU_CUDA_PERSISTENT", raising=False)  # (the persistent plan would take precedence)
    for env in ("1", "2", "0"):
        monkeypatch.setenv("QGRU_CUDA_FUSED", env)
        pd = p.to(dev)  # a fresh copy: its native Layer reads the variable when it is made
        calls = 0
        for with_lengths in (True, False):
            gen = torch.Generator().manual_seed(T + N)
            qx, qh0, lengths = _random_inputs(p, T, N, with_lengths, gen)
            want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
            for _ in range(3):
                out, h = native.gru_direction("cuda")(pd, qx.to(dev), qh0.to(dev),
                                                      None if lengths is None else lengths.to(dev))
                calls += 1
                bad = (out.cpu().long() != want_out).nonzero()
                assert torch.equal(out.cpu().long(), want_out), \
                    f"QGRU_CUDA_FUSED={env}: out differs at {bad[:5].tolist()}"
                assert torch.equal(h.cpu().long(), want_h), f"QGRU_CUDA_FUSED={env}: h_n differs"
        c = pd.__dict__["_native"][("cuda", str(dev), "")].layer.counters
        assert c["fused_calls"] == (calls if env in ("1", "2") else 0), c
        assert c["persistent_calls"] == 0, c
        if env == "2":
            assert c["fused_persistent_calls"] + c["fused_persistent_fallbacks"] == calls, c
        else:
            assert c["fused_persistent_calls"] == c["fused_persistent_fallbacks"] == 0, c


@pytest.mark.parametrize("cfg", ["w8a16", "w16a16"])
def test_cuda_fused_step_leaves_other_layers_on_the_per_step_path(cuda_backend, monkeypatch, cfg):  # noqa: F811
    """A layer whose R.h has more than one limb pair (a 16-bit operand) keeps the per-step path
    under QGRU_CUDA_FUSED=1 (fused_calls 0) and stays exact."""
    from qgru import native
    p = _layer_params(cfg, "multiplier", 7, 40, seed=5)
    dev = torch.device("cuda:0")
    monkeypatch.delenv("QGRU_CUDA_PERSISTENT", raising=False)
    monkeypatch.setenv("QGRU_CUDA_FUSED", "1")
    pd = p.to(dev)
    qx, qh0, lengths = _random_inputs(p, 11, 6, True, torch.Generator().manual_seed(3))
    want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
    out, h = native.gru_direction("cuda")(pd, qx.to(dev), qh0.to(dev), lengths.to(dev))
    assert torch.equal(out.cpu().long(), want_out) and torch.equal(h.cpu().long(), want_h)
    assert pd.__dict__["_native"][("cuda", str(dev), "")].layer.counters["fused_calls"] == 0


def test_cuda_fused_env_value_is_checked(cuda_backend, monkeypatch):  # noqa: F811
    """QGRU_CUDA_FUSED takes 0, 1 or 2: anything else is a clear error when a Layer is made."""
    from qgru import native
    p = _layer_params("w8a8", "pow2", 5, 12, seed=1)
    monkeypatch.setenv("QGRU_CUDA_FUSED", "yes")
    qx, qh0, _ = _random_inputs(p, 3, 2, False, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="QGRU_CUDA_FUSED='yes' must be 0, 1 or 2"):
        native.gru_direction("cuda")(p.to("cuda:0"), qx.cuda(), qh0.cuda(), None)


def _cuda_layers(m, device="cuda:0"):
    """Every CUDA Layer the model's calls made (the Stack's and the layer-by-layer path's)."""
    return [v.layer for row in m._qparams_on[device] for p in row
            for k, v in p.__dict__.get("_native", {}).items() if k[0] == "cuda" and hasattr(v, "layer")]


MODULES = [  # I, H, layers, bidirectional, T, N, packed
    (16, 64, 2, True, 20, 64, True),    # bidirectional, B = 64, unequal lengths
    (8, 40, 1, False, 30, 1, False),    # B = 1 (the one-call Stack)
    (24, 128, 2, False, 50, 64, False),  # B = 64, two layers (the Stack)
    (12, 33, 1, True, 9, 1, True),      # bidirectional, B = 1, packed
]


@pytest.mark.parametrize("I,H,layers,bidi,T,N,packed", MODULES)
def test_cuda_fused_module_is_the_reference(cuda_backend, monkeypatch, I, H, layers, bidi, T, N, packed):  # noqa: F811
    """A converted w8a8 QuantGRU on the GPU with QGRU_CUDA_FUSED=1 gives the reference backend's
    floats bit for bit (twice: the graph's capture and replay), and every one of its CUDA Layers
    took the fused step."""
    monkeypatch.delenv("QGRU_CUDA_PERSISTENT", raising=False)
    monkeypatch.setenv("QGRU_CUDA_FUSED", "1")
    m = _model("w8a8", I, H, layers, bidi, seed=7).to("cuda")
    gen = torch.Generator().manual_seed(T * 3 + N)
    D = 2 if bidi else 1
    x = torch.randn(T, N, I, generator=gen) * 3
    h0 = torch.randn(layers * D, N, H, generator=gen)
    if packed:
        lengths = torch.randint(1, T + 1, (N,), generator=gen)
        lengths[0] = T
        x = pack_padded_sequence(x, lengths, enforce_sorted=False)
    want = _reference("w8a8", I, H, layers, bidi, 7, x, h0)
    for i in range(3):
        with torch.no_grad():
            out, h = m(x.to("cuda"), h0.cuda())
        if packed:
            assert torch.equal(out.batch_sizes, want[0].batch_sizes)
            _same((out.data, h), (want[0].data, want[1]), f"call {i + 1}")
        else:
            _same((out, h), want, f"call {i + 1}")
    layers_made = _cuda_layers(m)
    assert layers_made, "no CUDA Layer was made"
    assert all(layer.counters["fused_calls"] > 0 for layer in layers_made), [c.counters for c in layers_made]
