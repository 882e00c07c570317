"""How libraries that hold nn.GRU use it (issue 17), with minimal stand-ins for their patterns:

* an autoregressive forecaster calibrated with hundreds of 1-step calls carrying h (darts,
  neuralforecast): the default observer weighs data, not calls;
* Lightning's predict, which runs under torch.inference_mode (every order of inference_mode,
  no_grad and grad-enabled calls, on every backend);
* a library's own ``class GRU(nn.GRU)`` with its own forward (pytorch-forecasting's takes
  ``lengths=``);
* TorchScript (a scripted wrapper, a traced one with an exported method as torchaudio's WaveRNN
  has), torch.compile and torch.export;
* save/load through state_dict, as the libraries' checkpoints do.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import qgru
from qgru.compare import sqnr_db


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors, many calls: one torch thread (on a busy machine a second one makes each small
    op wait for it, up to 100x slower); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return sqnr_db(float((ref * ref).sum()), float(((got - ref) ** 2).sum()))


# =============================================================================================
# 3. Autoregressive calibration: the same data cut into 1-step calls calibrates the same ranges
# =============================================================================================
class Forecaster(nn.Module):
    """darts RNNModel-like: a GRU and a linear head; one call takes (x, h) and returns (y, h_n)."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.rnn = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x, h=None):
        out, h = self.rnn(x, h)
        return self.head(out), h


class OneStepRollout(nn.Module):
    """The forecaster run as its library runs it when predicting: one call per time step, in
    time order, the state passed back (Lightning-style predict loop)."""

    def __init__(self, model: Forecaster):
        super().__init__()
        self.model = model

    def forward(self, series):
        h, ys = None, []
        for t in range(series.shape[1]):
            y, h = self.model(series[:, t:t + 1], h)
            ys.append(y)
        return torch.cat(ys, dim=1)


def sine_series(N: int = 4, T: int = 300) -> torch.Tensor:
    t = torch.arange(T, dtype=torch.float32)
    rows = [(0.5 + 0.25 * i) * torch.sin(2 * math.pi * t / (40 + 7 * i) + i) for i in range(N)]
    return torch.stack(rows).unsqueeze(-1)  # [N, T, 1]


CALIBRATED = ("x", "h", "Wx", "Rh", "r_pre", "z_pre", "g_pre")


def test_one_step_calls_calibrate_what_one_call_does():
    torch.manual_seed(0)
    model = Forecaster().eval()
    series = sine_series()
    whole = qgru.quantize_model(model, [series], progress=False)  # one call over the whole series
    steps = qgru.quantize_model(OneStepRollout(model), [series], progress=False).model  # 300 calls
    cw, cs = whole.rnn._calib, steps.rnn._calib
    for n in CALIBRATED:
        for end in ("range_min", "range_max"):
            key = f"l0.fwd.{n}.{end}"
            if n == "x":  # the very same values: exactly the same range
                assert torch.equal(cw[key], cs[key]), key
            else:  # W.x of one row at a time rounds differently from one GEMM over all: float32 ulps
                assert torch.allclose(cw[key], cs[key], rtol=1e-5, atol=1e-6), key
        assert int(cs[f"l0.fwd.{n}.clipped"]) == 0, n  # nothing the calibration saw is clipped
    with torch.no_grad():
        ref = model(series)[0]
        s_whole, s_steps = _sqnr(ref, whole(series)[0]), _sqnr(ref, steps(series)[0])
    assert s_whole > 30.0
    assert abs(s_steps - s_whole) < 0.1, (s_steps, s_whole)


def test_compare_names_the_observer_that_clips_its_own_calibration_data():
    """ema weighs calls: over 1-step calls in time order it keeps only the last ~1/momentum calls'
    extremes, and its range clips the data it was calibrated on; compare says so, and advises a
    data-weighted observer instead of more bits."""
    torch.manual_seed(0)
    model = Forecaster().eval()
    series = sine_series()
    cfg = qgru.QuantConfig.load("w8a8", overrides={"observer": {"kind": "ema"}})
    q = qgru.quantize_model(OneStepRollout(model), [series], config=cfg, progress=False).model
    assert int(q.rnn._calib["l0.fwd.x.clipped"]) > 0.1 * int(q.rnn._calib["l0.fwd.x.count"])
    report = qgru.compare(model, q, [series], verbose=False, progress=False)
    w = report.worst()
    assert w["tensor"] == "x" and w["reason"] == "observer"
    assert w["override"] == {"observer": {"kind": "percentile"}}
    assert "ema (momentum 0.1) observer" in w["message"] and "own calibration data" in w["message"]
    assert report.row("x", module="rnn")["calib_clip"] > 0.1
    text = str(report)
    assert "observer" in text and "'bits': 16" not in text.splitlines()[-2]
    # the default observer on the same calls: nothing to blame on it
    q2 = qgru.quantize_model(OneStepRollout(model), [series], progress=False).model
    r2 = qgru.compare(model, q2, [series], verbose=False, progress=False)
    assert r2.worst()["reason"] != "observer"
    assert all((r["calib_clip"] or 0.0) == 0.0 for r in r2.rows if r["tensor"] in CALIBRATED)
