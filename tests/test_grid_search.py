"""Grids chosen by error (observer kind "mse", qgru/convert.py): the searched grid against
references computed from the raw values, never from the histogram the search reads."""
import math

import pytest
import torch

import qgru
from qgru.config import QuantConfig, TensorSpec
from qgru.convert import calibrated_range, expected_sq_error, search_grid
from qgru.observers import Observer
from qgru.primitives import choose_qparams, dequantize, qrange, quantize


def _observer(v: torch.Tensor, kind: str = "mse", channels: int = 0, pieces: int = 1) -> Observer:
    o = Observer("t", kind, channels=channels)
    for piece in v.chunk(pieces):
        o.observe(piece)
        o.end_call()
    return o


def _grid(v: torch.Tensor, bits: int = 8, symmetric: bool = False, pow2: bool = True, pieces: int = 1):
    """(scale, zero point) convert() chooses for a per-tensor activation that saw ``v``."""
    spec = TensorSpec(bits=bits, symmetric=symmetric)
    lo, hi = calibrated_range(_observer(v, pieces=pieces), spec, 1, pow2, "mse")
    return choose_qparams(lo, hi, bits, symmetric, pow2)


def _sse(v: torch.Tensor, scale, zp, bits: int = 8) -> float:
    """The exact sum of squared errors of quantizing the raw values on a grid (float64)."""
    v = v.double()
    s, z = torch.as_tensor(scale, dtype=torch.float64), torch.as_tensor(zp, dtype=torch.int64)
    return float((dequantize(quantize(v, s, z, bits), s, z).double() - v).pow(2).sum())


def _brute_force(v: torch.Tensor, bits: int, symmetric: bool, pow2: bool) -> float:
    """The least exact SSE over grids built from the raw values alone: scales from the min/max grid
    down 8 octaves (powers of two) or 6 (multiplier, 16 steps per octave), every zero point."""
    qmin, qmax = qrange(bits)
    lo, hi = min(float(v.min()), 0.0), max(float(v.max()), 0.0)
    full = (max(-lo, hi) / qmax) if symmetric else (hi - lo) / (qmax - qmin)
    if pow2:
        full = 2.0 ** math.ceil(math.log2(full))
        scales = [full * 2.0 ** -k for k in range(9)]
    else:
        scales = [full * 2.0 ** (-k / 16) for k in range(6 * 16 + 1)]
    zps = [0] if symmetric else range(qmin, qmax + 1)
    v = v.double()
    best = math.inf
    for s in scales:  # vectorized over zero points: exact quantize/dequantize of every raw value
        z = torch.tensor(list(zps), dtype=torch.float64).unsqueeze(1)
        q = (torch.floor(v / s + 0.5).unsqueeze(0) + z).clamp(qmin, qmax)
        best = min(best, float(((q - z) * s - v).pow(2).sum(1).min()))
    return best


def _mixture(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g) * 0.8 + 0.3
    v[: n // 5] = torch.randn(n // 5, generator=g).pow(3)  # heavy tails
    return v


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("symmetric", [False, True])
def test_searched_grid_beats_range_grids_and_matches_brute_force(pow2, symmetric):
    v = _mixture(5_000, seed=1)
    s, z = _grid(v, 8, symmetric, pow2)
    got = _sse(v, s, z)
    for lo, hi in ((v.min(), v.max()), tuple(_observer(v, "percentile").range())):  # minmax, percentile
        ref_s, ref_z = choose_qparams(torch.as_tensor(lo), torch.as_tensor(hi), 8, symmetric, pow2)
        assert got <= _sse(v, ref_s, ref_z)
    best = _brute_force(v, 8, symmetric, pow2)
    # the search reads a histogram (values uniform within 2048 bins per side): within 2% of the
    # exact optimum over grids from the raw values
    assert got <= best * 1.02, (got, best)


def test_expected_error_matches_the_exact_error_of_raw_values():
    v = _mixture(100_000, seed=2)
    h = _observer(v).histogram()
    for scale, zp in ((0.02, -30), (0.05, 0), (0.004, 100), (0.1, -128)):
        est = float(expected_sq_error(h, torch.tensor([[scale]]), torch.tensor([[float(zp)]]), 8))
        exact = _sse(v, torch.tensor(scale), torch.tensor(zp))
        assert est == pytest.approx(exact, rel=0.03), (scale, zp)


@pytest.mark.parametrize("pow2", [True, False])
def test_grid_scale_is_a_power_of_two_in_pow2_mode(pow2):
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        v = torch.randn(5000, generator=g) * float(torch.rand(1, generator=g) * 50) + float(torch.randn(1, generator=g))
        s, _ = _grid(v, 8, False, pow2)
        assert (float(torch.log2(s)) == round(float(torch.log2(s)))) == pow2 or not pow2


def test_one_far_outlier_is_clipped():
    """Clipping one value at 30 costs ~(30 - 5)^2; holding it would coarsen the step of a million
    others (N s^2 / 12 grows by ~1500): the search clips it."""
    g = torch.Generator().manual_seed(3)
    v = torch.cat([torch.randn(1_000_000, generator=g), torch.tensor([30.0])])
    for pow2 in (True, False):
        s, z = _grid(v, 8, False, pow2)
        hi = float((127 - z) * s)
        assert hi < 15.0, hi  # clipped: a grid near the bulk's, not one stretched to 30
        assert _sse(v, s, z) < 0.5 * _sse(v, *choose_qparams(v.min(), v.max(), 8, False, pow2))


@pytest.mark.parametrize("pow2", [True, False])
def test_uniform_data_keeps_its_full_range(pow2):
    g = torch.Generator().manual_seed(4)
    v = torch.rand(100_000, generator=g) * 4 - 1  # uniform on [-1, 3]
    s, z = _grid(v, 8, False, pow2)
    lo, hi = float((-128 - z) * s), float((127 - z) * s)
    covered = (min(hi, float(v.max())) - max(lo, float(v.min()))) / float(v.max() - v.min())
    if pow2:
        # 4 / 255 is just above 2^-6: the min/max grid doubles the step to 2^-5; the search keeps
        # 2^-6, whose 255 steps hold 99.6% of the range (clipping the last 0.4% by at most one step
        # costs far less than 4x the rounding error everywhere)
        assert float(s) == 2.0 ** -6 and covered > 0.99, (lo, hi)
        assert float(choose_qparams(v.min(), v.max(), 8, False, True)[0]) == 2.0 ** -5
    else:  # clipping uniform data never pays: the whole range, within half a step
        assert lo <= float(v.min()) + s / 2 and hi >= float(v.max()) - s / 2, (lo, hi, float(s))


def test_histogram_merged_across_calls_gives_the_grid_of_one_call():
    v = _mixture(30_000, seed=5)
    v[5000:9000] *= 0.01  # calls of very different widths: the bins are widened (merged) later
    for pow2 in (True, False):
        one = _grid(v, 8, False, pow2)
        for pieces in (7, 300):
            many = _grid(v, 8, False, pow2, pieces=pieces)
            assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_exact_zeros_cost_nothing_and_do_not_shrink_the_grid():
    """Values exactly 0 (ReLU outputs, padding) lie on every grid; without counting them apart the
    rounding cost of the bin that holds 0 would push the search to clip the real data."""
    v = _mixture(20_000, seed=6)
    with_zeros = torch.cat([v, torch.zeros(200_000)])
    for pow2 in (True, False):
        a, b = _grid(v, 8, False, pow2), _grid(with_zeros, 8, False, pow2)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_per_gate_histogram_is_the_histogram_of_the_gate_values():
    g = torch.Generator().manual_seed(7)
    H = 4
    v = torch.randn(3000, 3 * H, generator=g) * torch.linspace(0.1, 30, 3 * H)
    o = _observer(v, channels=3 * H)
    merged = o.histogram(3)
    for gate in range(3):
        alone = _observer(v[:, gate * H:(gate + 1) * H].reshape(-1, 1), channels=1).histogram()
        assert torch.equal(merged.counts[gate], alone.counts[0]) and torch.equal(merged.width[gate], alone.width[0])


def test_searched_range_gives_back_the_searched_grid():
    """convert() hands activation_qparams a range; choose_qparams must rebuild the chosen grid."""
    v = _mixture(20_000, seed=8)
    h = _observer(v).histogram()
    for pow2 in (True, False):
        for symmetric in (False, True):
            lo, hi = search_grid(h, 8, symmetric, pow2)
            s, z = choose_qparams(lo, hi, 8, symmetric, pow2)
            err = expected_sq_error(h, s.view(1, 1), z.double().view(1, 1), 8)
            # the rebuilt grid is the search's minimum: its neighbours on the searched lattice (the next
            # scale up and down, zero point +-1) are no better (a grid rebuilt with an off-by-one
            # zero point or a scale one step off would lose to one of them)
            step = 2.0 if pow2 else 2.0 ** (1 / 16)
            for f in (1 / step, 1.0, step):
                for dz in ((0,) if symmetric else (-1, 0, 1)):
                    if f == 1.0 and dz == 0:
                        continue
                    zz = (z + dz).clamp(-128, 127).double().view(1, 1)
                    assert float(err) <= float(expected_sq_error(h, (s * f).view(1, 1), zz, 8)) * (1 + 1e-12)


def test_module_converts_with_mse_and_compare_reports_the_expected_error():
    torch.manual_seed(0)
    gru = torch.nn.GRU(6, 8)
    calib = [torch.randn(20, 4, 6) * 2 for _ in range(3)]
    q = qgru.quantize_model(gru, calib, QuantConfig.load("w8a8", overrides={"observer": {"kind": "mse"}}),
                            progress=False)
    report = qgru.compare(gru, q, calib, verbose=False, progress=False)
    x = report.row("x")
    # layer 0's x on its own calibration data: the expected SQNR (histogram) is the measured one
    assert x["calib_sqnr_db"] == pytest.approx(x["own_sqnr_db"], abs=0.5)
    assert x["observer"] == "mse" and x["grid"] is not None
    assert "calib dB" in str(report)


def test_unknown_observer_kind_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"kind must be one of \('mse', 'percentile', 'minmax', 'ema', 'ema_step'\)"):
        QuantConfig.load("w8a8", overrides={"observer": {"kind": "kl"}})
