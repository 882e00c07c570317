"""Random configs and shapes: every combination the config allows must run, stay bounded and
round-trip through export bit for bit. This is where unusual widths (2-bit weights, 4-bit table
inputs, 16-bit everything) meet the overflow bounds of docs/spec.md."""
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qgru
from qgru.config import GRANULARITIES, TENSOR_NAMES


@st.composite
def configs(draw):
    tensors = {}
    for name in TENSOR_NAMES:
        lo = 4 if name.endswith("_pre") else 2
        spec = {"bits": draw(st.integers(lo, 16))}
        gran = draw(st.sampled_from(GRANULARITIES[name]))
        if name not in ("z", "r", "g"):
            spec["granularity"] = gran
            if gran == "per_group":
                spec["group_size"] = draw(st.integers(1, 7))
        if name in ("x", "h", "Wx", "Rh", "z_pre", "r_pre", "g_pre"):
            spec["symmetric"] = draw(st.booleans())
            spec["headroom"] = draw(st.sampled_from([1.0, 1.5, 3.0]))
        tensors[name] = spec
    if draw(st.booleans()):  # the optional R.h operand: the state h requantized to <= h's bits
        tensors["h_gemm"] = {"bits": draw(st.integers(2, tensors["h"]["bits"])), "symmetric": draw(st.booleans()),
                             "headroom": draw(st.sampled_from([1.0, 1.5, 3.0]))}
    return {"name": "sweep", "scale_mode": draw(st.sampled_from(["pow2", "multiplier"])),
            "observer": {"kind": draw(st.sampled_from(["percentile", "minmax", "ema", "ema_step"])),
                         "momentum": draw(st.sampled_from([0.1, 0.5, 1.0]))},
            "tensors": tensors}


@settings(max_examples=int(os.environ.get("QGRU_SWEEP_EXAMPLES", "80")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), I=st.integers(1, 9), H=st.integers(1, 7), layers=st.integers(1, 2),
       bidirectional=st.booleans(), T=st.integers(1, 6), N=st.integers(1, 3), seed=st.integers(0, 999))
def test_any_config_runs_bounded_and_round_trips(tmp_path_factory, cfg, I, H, layers, bidirectional, T, N, seed):
    torch.manual_seed(seed)
    m = qgru.QuantGRU(I, H, num_layers=layers, bidirectional=bidirectional, config=cfg)
    qgru.calibrate(m, [torch.randn(T, N, I) for _ in range(2)], progress=False)
    m.convert()
    x = 3 * torch.randn(T, N, I)  # partly outside the calibrated range: must saturate, not wrap
    out, h_n = m(x)
    assert out.shape == (T, N, H * (2 if bidirectional else 1))
    assert torch.isfinite(out).all() and torch.isfinite(h_n).all()
    # z in [0, 1] and |g| <= 1 on their grids, so |z h + (1 - z) g| <= max(|h|, 1); the two rounded
    # terms add at most one h step per time step. A wrapped-around intermediate would break this.
    step = max(float(p.scale["h"]) for p in m._qparams[-1])
    assert out.abs().max().item() <= 1 + T * step + 1e-9
    path = tmp_path_factory.mktemp("sweep") / "p.qgru"
    m.export().save(path)
    out2, h2 = qgru.load_params(path).to_module()(x)
    assert torch.equal(out, out2) and torch.equal(h_n, h2)
