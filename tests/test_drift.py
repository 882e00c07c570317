"""Inputs beyond the calibration range (issue 31): the drift stand-in of scripts/accuracy_models.py,
a forecaster trained and calibrated on the early part of series whose amplitude grows and run on
the late part (its inputs reach ~1.85x the largest calibration input). Real forecasters (darts,
neuralforecast on sunspots, AirPassengers) lost 5-18 dB against torch's dynamic quant there
with w8a8's static 8-bit x grid fitted to the calibration data. x levels (x.dynamic, each token on
the first of 13 grids up to 8x the calibrated range, with h_gemm.dynamic: docs/spec.md section 4b)
hold them at 8 bits, as does x in 16 bits over 4x its calibrated range (X16, README "Inputs beyond
the calibration range"). The native backends do not run x levels yet: those models run on the
reference backend (the same integers)."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

import qgru
from qgru.compare import sqnr_db
from qgru.demo import dynamic_quant

# x in 16 bits over 4x its calibrated range: the override for inputs beyond calibration
X16 = {"tensors": {"x": {"bits": 16, "headroom": 4.0, "dynamic": False}}}
# x levels and state-derived GEMM operands (docs/spec.md section 4b), and the static grids (the C
# export's mode; said explicitly, whatever the shipped config's default)
DYN = {"tensors": {"x": {"dynamic": True}, "h_gemm": {"dynamic": True}}}
STATIC = {"tensors": {"x": {"dynamic": False}, "h_gemm": {"dynamic": False}}}


@pytest.fixture(scope="module")
def drift():
    path = Path(__file__).resolve().parents[1] / "scripts" / "accuracy_models.py"
    spec = importlib.util.spec_from_file_location("qgru_accuracy_models", path)
    am = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(am)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = am.drift_case(torch.Generator().manual_seed(0))
    static = qgru.quantize_model(case.model, case.calib, progress=False,  # one 8-bit x grid
                                 config=qgru.QuantConfig.load("w8a8", overrides=STATIC))
    q = qgru.quantize_model(case.model, case.calib, progress=False,
                            config=qgru.QuantConfig.load("w8a8", overrides=X16))
    yield am, case, q, static
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def levels(drift):
    _, case, _, _ = drift
    return qgru.quantize_model(case.model, case.calib, progress=False,
                               config=qgru.QuantConfig.load("w8a8", overrides=DYN))


def _sqnr(case, model, ref, inputs=None) -> float:
    with torch.no_grad():
        out = torch.cat([model(x).reshape(-1) for x in (case.test if inputs is None else inputs)]).double()
    return sqnr_db(float((ref * ref).sum()), float(((out - ref) ** 2).sum()))


def _ref(case, inputs=None):
    with torch.no_grad():
        return torch.cat([case.model(x).reshape(-1) for x in (case.test if inputs is None else inputs)]).double()


def test_x_levels_keep_up_with_dynamic_quant_beyond_calibration(drift, levels):
    """Issue 31's target: w8a8 with x levels >= torch's dynamic quant - 1 dB on inputs beyond the
    calibration range (measured 49.3 vs 36.8 dB here); the static 8-bit x grid misses it by far."""
    _, case, _, static = drift
    ref = _ref(case)
    dq, why = dynamic_quant(case.model)
    with qgru.backend("reference"):
        got = _sqnr(case, levels, ref)
    # torch's dynamic quant measured 36.8 dB here (torch 2.13); without it, that figure is the bar
    bar = _sqnr(case, dq, ref) if dq is not None else 36.8
    assert got >= bar - 1.0
    assert _sqnr(case, static, ref) < bar - 1.0  # the static grid fails the same test (20.8 dB)


def test_x_levels_keep_the_in_range_accuracy(drift, levels):
    """On the calibration inputs (in range: every token on level 0 of the first layer), x levels
    keep the static grid's SQNR within 1 dB (scripts/accuracy_models.py: the in-range models)."""
    _, case, _, static = drift
    inputs = case.calib[:2]
    ref = _ref(case, inputs)
    with qgru.backend("reference"):
        got = _sqnr(case, levels, ref, inputs)
    assert got >= _sqnr(case, static, ref, inputs) - 1.0


def test_the_stand_in_reaches_beyond_calibration(drift):
    am, case, _, _ = drift
    assert 1.5 <= am.drift_ratio(case) <= 3.0


def test_16_bit_x_keeps_up_with_dynamic_quant_beyond_calibration(drift):
    _, case, q, static = drift
    with torch.no_grad():
        ref = torch.cat([case.model(x).reshape(-1) for x in case.test]).double()
    got = _sqnr(case, q, ref)
    dq, why = dynamic_quant(case.model)
    if dq is not None:
        assert got >= _sqnr(case, dq, ref) - 1.0
    # torch's dynamic quant measured 36.8 dB here (torch 2.13), the default's 8-bit x 20.8 dB
    assert got >= 35.0
    assert _sqnr(case, static, ref) < got - 10  # what the 8-bit x lost (the stand-in reproduces it)


def test_compare_warns_when_the_inputs_clip(drift):
    _, case, q, static = drift
    with pytest.warns(qgru.CalibrationWarning, match=r"GRU 'rnn': [0-9.]+% of its input x \(fwd\) lies beyond "
                                                     r"its calibrated grid.*more than 0\.1%"):
        report = qgru.compare(case.model, static, case.test, verbose=False, progress=False)
    assert report.row("x", 0, "fwd")["saturation"] > 1e-3
    # the 16-bit x's grid holds them: no warning; nor, with the static grid, on the calibration data itself
    with warnings.catch_warnings():
        warnings.simplefilter("error", qgru.CalibrationWarning)
        qgru.compare(case.model, q, case.test, verbose=False, progress=False)
        qgru.compare(case.model, static, case.calib[:1], verbose=False, progress=False)


def test_compare_counts_only_what_the_widest_x_level_clips(drift, levels):
    """With x levels the inputs beyond calibration lie on wider levels: no clipping, no warning,
    and the x row's own SQNR is an 8-bit grid's per token (the static grid's: clipping)."""
    _, case, _, static = drift
    with warnings.catch_warnings():
        warnings.simplefilter("error", qgru.CalibrationWarning)
        with qgru.backend("reference"):
            report = qgru.compare(case.model, levels, case.test, verbose=False, progress=False)
    x = report.row("x", 0, "fwd")
    assert x["saturation"] == 0 and x["above_level0"] > 0.01 and x["own_sqnr_db"] > 35
    with pytest.warns(qgru.CalibrationWarning):
        static_x = qgru.compare(case.model, static, case.test, verbose=False, progress=False).row("x", 0, "fwd")
    assert static_x["own_sqnr_db"] < x["own_sqnr_db"] - 10
