"""qgru.compare: per layer / direction / step / gate error report, and the tensor it blames."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import qgru
from qgru import golden
from qgru.convert import calibrated_range
from qgru.compare import ROW_ORDER, _grids, _Stat, sqnr_db
from qgru.convert import activation_qparams
from qgru.float_gru import float_direction

I, H, T, N = 6, 10, 15, 4


def _batches(n=3, scale=1.0, seed=0, shape=(T, N, I)):
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=g) for _ in range(n)]


class GruHead(nn.Module):
    """A GRU inside a wrapper with a float layer after it (the usual model shape)."""

    def __init__(self, layers=1, bidirectional=False):
        super().__init__()
        self.gru = nn.GRU(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=True)
        self.fc = nn.Linear(H * (2 if bidirectional else 1), 3)

    def forward(self, x):
        return self.fc(self.gru(x)[0])


# ---- the statistics, by hand ------------------------------------------------------------------
def test_sqnr_and_cosine_by_hand():
    s = _Stat()
    ref = torch.tensor([[3.0, 4.0]])
    s.add(ref, torch.tensor([[3.0, 5.0]]))
    assert sqnr_db(s.ref2, s.err2) == pytest.approx(10 * math.log10(25 / 1))
    assert s.cosine() == pytest.approx((9 + 20) / (5 * math.sqrt(34)))
    assert s.max_abs == 1.0
    exact = _Stat()
    exact.add(ref, ref.clone())
    assert sqnr_db(exact.ref2, exact.err2) == math.inf and exact.cosine() == 1.0 and exact.max_abs == 0
    # masked-out positions count for nothing
    m = _Stat()
    m.add(torch.tensor([[[1.0], [2.0]]]), torch.tensor([[[1.0], [99.0]]]), mask=torch.tensor([[True, False]]))
    assert m.err2 == 0 and m.n == 1


@pytest.mark.filterwarnings("ignore::qgru.CalibrationWarning")  # all-zero calibration, on purpose
def test_exact_model_is_inf_everywhere():
    """Zero weights and zero input: h stays 0, r = z = 1/2, g = 0, all exact on their grids."""
    gru = nn.GRU(3, 4)
    with torch.no_grad():
        for p in gru.parameters():
            p.zero_()
    x = torch.zeros(5, 2, 3)
    # pow2 grids: the sigmoid's 1/2 is a grid point (a 16-bit multiplier-mode grid over [0, 1] is 1/65535 apart)
    q = qgru.quantize_model(gru, [x], config=qgru.QuantConfig.load("w8a8", overrides={"scale_mode": "pow2"}),
                            progress=False)
    r = qgru.compare(gru, q, [x], verbose=False)
    for row in r.rows:
        assert row["sqnr_db"] == math.inf and row["cosine"] == 1.0 and row["max_abs_err"] == 0, row
        assert row["own_sqnr_db"] in (None, math.inf)
        assert not row["saturation"]  # a zero point at qmin (range [0, 0]) is not saturation
    assert r.row("r")["numel"] == 5 * 2 * 4
    assert r.worst()["reason"] == "exact"


# ---- real properties --------------------------------------------------------------------------
def test_w16a16_high_sqnr_and_no_saturation():
    torch.manual_seed(0)
    model = GruHead()
    calib = _batches(4, shape=(N, T, I))
    q = qgru.quantize_model(model, calib, config="w16a16", progress=False)
    r = qgru.compare(model, q, calib, verbose=False)
    assert r.row("output", None, None)["sqnr_db"] > 60
    for row in r.rows:
        if row["tensor"] not in ("r", "z", "g"):
            assert row["sqnr_db"] > 60, row
        assert (row["saturation"] or 0) < 1e-3, row
    # per step: one SQNR per time step, all high
    steps = r.row("h")["steps_sqnr_db"]
    assert len(steps) == T and min(steps) > 60
    assert len(r.row("output", None, None)["steps_sqnr_db"]) == T


def test_tiny_g_pre_is_blamed():
    torch.manual_seed(1)
    gru = nn.GRU(I, H)
    calib = _batches()
    cfg = qgru.QuantConfig.load("w8a8", overrides={"tensors": {"g_pre": {"bits": 4}}})
    q = qgru.quantize_model(gru, calib, config=cfg, progress=False)
    r = qgru.compare(gru, q, calib, verbose=False)
    w = r.worst()
    assert (w["tensor"], w["layer"], w["direction"]) == ("g_pre", 0, "fwd")
    assert w["override"] == {"tensors": {"g_pre": {"bits": 16}}}
    # the override changes just that tensor, and fixes it
    fixed_cfg = qgru.QuantConfig.load(cfg, overrides=w["override"])
    assert {n: s for n, s in fixed_cfg.tensors.items() if s != cfg[n]} == {"g_pre": fixed_cfg["g_pre"]}
    fixed = qgru.compare(gru, qgru.quantize_model(gru, calib, config=fixed_cfg, progress=False), calib,
                         verbose=False)
    assert fixed.row("g_pre")["own_sqnr_db"] > w["own_sqnr_db"] + 30
    assert fixed.row("output", None, None)["sqnr_db"] > r.row("output", None, None)["sqnr_db"] + 3


def test_out_of_range_inputs_saturate_x():
    """Calibrated on small inputs, run on 10x larger ones: x clips, and the report says so."""
    torch.manual_seed(2)
    gru = nn.GRU(I, H)
    q = qgru.quantize_model(gru, _batches(scale=0.1), progress=False)
    big = _batches(seed=1)
    r = qgru.compare(gru, q, big, verbose=False)
    w = r.worst()
    assert (w["tensor"], w["reason"]) == ("x", "saturation")
    assert w["saturation"] > 0.3 and w["saturated"] > 0
    assert 5 < w["range_needed"] < 20
    spec = w["override"]["tensors"]["x"]
    assert spec["bits"] == 16 and spec["headroom"] >= w["range_needed"]
    assert "worst: layer 0 fwd x saturates" in str(r)
    # following the advice removes the clipping of x
    cfg = qgru.QuantConfig.load("w8a8", overrides=w["override"])
    q2 = qgru.quantize_model(gru, _batches(scale=0.1), config=cfg, progress=False)
    r2 = qgru.compare(gru, q2, big, verbose=False)
    assert r2.row("x")["saturation"] == 0
    assert r2.row("output", None, None)["sqnr_db"] > r.row("output", None, None)["sqnr_db"]


def test_layers_directions_and_wrapper_rows():
    torch.manual_seed(3)
    model = GruHead(layers=2, bidirectional=True)
    calib = _batches(2, shape=(N, T, I))
    q = qgru.quantize_model(model, calib, progress=False)
    r = qgru.compare(model, q, calib[:1], verbose=False)
    keys = {(row["module"], row["layer"], row["direction"], row["tensor"]) for row in r.rows}
    want = {("gru", layer, d, t) for layer in (0, 1) for d in ("fwd", "rev") for t in ROW_ORDER}
    assert keys == want | {("gru", None, None, "output")}
    for layer in (0, 1):
        for d in ("fwd", "rev"):
            assert len(r.row("h", layer, d)["steps_sqnr_db"]) == T
            assert 20 < r.row("h", layer, d)["sqnr_db"] < 60  # w8a8: real but bounded error
    text = str(r)
    assert "layer 1 rev" in text and "worst:" in text and "overrides=" in text


def test_two_grus_in_one_model_are_paired_by_name():
    torch.manual_seed(4)

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = nn.GRU(I, H), nn.GRU(H, 5)

        def forward(self, x):
            return self.dec(self.enc(x)[0])

    model = Chain()
    calib = _batches(2)
    q = qgru.quantize_model(model, calib, progress=False)
    r = qgru.compare(model, q, calib, verbose=False)
    assert {row["module"] for row in r.rows} == {"enc", "dec"}
    assert r.row("h", module="dec")["bits"] == 8
    assert "enc" in str(r) and "dec" in str(r)


def test_bare_gru_packed_sequence_and_h0():
    torch.manual_seed(5)
    gru = nn.GRU(I, H)
    qm = qgru.QuantGRU.from_float(gru, "w8a16")
    qgru.calibrate(qm, _batches(), progress=False)
    qm.convert()
    x = torch.randn(T, 3, I)
    lengths = torch.tensor([T, 4, 9])
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    h0 = 0.3 * torch.randn(1, 3, H)
    r = qgru.compare(gru, qm, [(packed, h0), torch.randn(7, I)], verbose=False)  # + an unbatched call
    assert r.row("h")["numel"] == (int(lengths.sum()) + 7) * H  # padding is never counted
    assert r.row("output", None, None)["numel"] == (int(lengths.sum()) + 7) * H
    assert len(r.row("h")["steps_sqnr_db"]) == T
    assert r.row("output", None, None)["sqnr_db"] > 35


@pytest.mark.parametrize("backend", ["default", "reference"])
def test_golden_trace_matches_the_backend(backend):
    """compare's golden replay reproduces the module's own output (else it warns)."""
    torch.manual_seed(6)
    gru = nn.GRU(I, H, num_layers=2)
    q = qgru.quantize_model(gru, _batches(), config="w8a16", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if backend == "reference":
            with qgru.backend("reference"):
                qgru.compare(gru, q, _batches(1, seed=3), verbose=False)
        else:
            qgru.compare(gru, q, _batches(1, seed=3), verbose=False)


@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
def test_recovered_inner_scales(mode):
    """The pre-activation and Wx/Rh scales rebuilt from the rescales match convert()'s scales."""
    torch.manual_seed(7)
    cfg = qgru.QuantConfig.load("w8a8", overrides={"scale_mode": mode})
    m = qgru.QuantGRU(I, H, config=cfg)
    qgru.calibrate(m, _batches(), progress=False)
    # the ranges convert() hands activation_qparams (for the default mse observer: the searched grids')
    ranges = {n: calibrated_range(o, cfg[n], H, cfg.power_of_two, cfg.observer.kind)
              for n, o in m._observers[(0, 0)].items()}
    m.convert()
    got = _grids(m._qparams[0][0], cfg.power_of_two)
    for n in ("Wx", "Rh", "r_pre", "z_pre", "g_pre"):
        want, _ = activation_qparams(*ranges[n], cfg[n], H, cfg.power_of_two)
        scale = got[n][0]
        if mode == "pow2":
            assert torch.equal(scale, want.to(scale.dtype).expand_as(scale)), n
        else:
            assert torch.allclose(scale, want.double().expand_as(scale), rtol=2 ** -20, atol=0), n


def test_tracing_changes_nothing():
    torch.manual_seed(8)
    m = qgru.QuantGRU(I, H, config="w8a8")
    qgru.calibrate(m, _batches(), progress=False)
    p = m.convert()._qparams[0][0]
    qx = torch.randint(-128, 128, (T, N, I))
    qh0 = torch.randint(-128, 128, (N, H))
    lengths = torch.tensor([T, 3, 9, 1])
    tr = {}
    plain = golden.gru_direction(p, qx, qh0, lengths)
    traced = golden.gru_direction(p, qx, qh0, lengths, trace=tr)
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))
    assert set(tr) == {"Wx", "Rh", "r_pre", "r", "z_pre", "z", "g_pre", "g", "h"}
    assert all(len(v) == T for v in tr.values())
    x = torch.randn(T, N, I)
    w = m._weights(0, 0)
    ftr = {}
    assert all(torch.equal(a, b) for a, b in zip(float_direction(*w, x, torch.zeros(N, H), lengths),
                                                 float_direction(*w, x, torch.zeros(N, H), lengths, trace=ftr)))
    assert set(ftr) == set(tr)


def test_prints_table_by_default(capsys):
    torch.manual_seed(9)
    gru = nn.GRU(I, H)
    q = qgru.quantize_model(gru, _batches(), progress=False)
    r = qgru.compare(gru, q, _batches(1))
    out = capsys.readouterr().out
    assert out.strip() == str(r).strip()
    assert "SQNR dB" in out and "own dB" in out and "sat %" in out and "drift" in out
    assert out.strip().splitlines()[-2].startswith("worst: layer 0 fwd")


def test_errors():
    gru = nn.GRU(I, H)
    q = qgru.quantize_model(gru, _batches(1), progress=False)
    with pytest.raises(ValueError, match="same object"):
        qgru.compare(q, q, _batches(1))
    with pytest.raises(ValueError, match="no qgru.QuantGRU"):
        qgru.compare(gru, copy.deepcopy(gru), _batches(1))
    with pytest.raises(ValueError, match="not converted"):
        qgru.compare(gru, qgru.QuantGRU.from_float(gru), _batches(1))
    with pytest.raises(ValueError, match="no nn.GRU named"):
        qgru.compare(nn.Sequential(nn.GRU(I, H)), q, _batches(1))
    with pytest.raises(ValueError, match="differs between"):
        qgru.compare(nn.GRU(I, H + 1), q, _batches(1))
    with pytest.raises(ValueError, match="empty"):
        qgru.compare(gru, q, [])
