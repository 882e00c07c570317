"""qgru.compare: per layer / direction / step / gate error report, and the tensor it blames."""
from __future__ import annotations

import copy
import math
import re
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


def h_gemm_config(h_bits=16, op_bits=4, base="w8a8", **over):
    """``base`` with a ``h_bits`` state h whose R.h GEMM reads an ``op_bits`` operand h_gemm."""
    h = {"bits": h_bits, **({"headroom": 1.5} if h_bits == 16 else {})}
    # h_gemm on its calibrated grid (dynamic false): these tests measure that grid's own error
    return qgru.QuantConfig.load(base, overrides={**over, "tensors": {"h": h, "h_gemm": {"bits": op_bits,
                                                                                         "dynamic": False}}})


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
    """Calibrated on small inputs, run on 10x larger ones: x clips, and the report says so (an 8-bit
    x over its calibrated range, w8a8's before issue 31; the default's x has 4x headroom)."""
    torch.manual_seed(2)
    gru = nn.GRU(I, H)
    static = qgru.QuantConfig.load("w8a8", overrides={"tensors": {"x": {"bits": 8, "headroom": 1.0, "dynamic": False}}})
    q = qgru.quantize_model(gru, _batches(scale=0.1), config=static, progress=False)
    big = _batches(seed=1)
    with pytest.warns(qgru.CalibrationWarning, match="of its input x"):
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
    tensors = [t for t in ROW_ORDER if t != "h_gemm" or q.gru.qconfig.h_gemm is not None]  # h_gemm: if configured
    want = {("gru", layer, d, t) for layer in (0, 1) for d in ("fwd", "rev") for t in tensors}
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
    assert r.row("h", module="dec")["bits"] == 16 and r.row("h_gemm", module="dec")["bits"] == 8
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
@pytest.mark.parametrize("cfg", ["w8a16", "h_gemm"])
def test_golden_trace_matches_the_backend(backend, cfg):
    """compare's golden replay reproduces the module's own output (else it warns)."""
    torch.manual_seed(6)
    gru = nn.GRU(I, H, num_layers=2)
    cfg = h_gemm_config(op_bits=8) if cfg == "h_gemm" else cfg
    q = qgru.quantize_model(gru, _batches(), config=cfg, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if backend == "reference":
            with qgru.backend("reference"):
                qgru.compare(gru, q, _batches(1, seed=3), verbose=False)
        else:
            qgru.compare(gru, q, _batches(1, seed=3), verbose=False)


@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
@pytest.mark.parametrize("operand", ["h", "h_gemm"])
def test_recovered_inner_scales(mode, operand):
    """The pre-activation and Wx/Rh scales rebuilt from the rescales match convert()'s scales; with
    an h_gemm, Rh's is rebuilt from the operand's scale (S_R S_h_gemm / M_Rh), not h's."""
    torch.manual_seed(7)
    if operand == "h":
        cfg = qgru.QuantConfig.load("w8a8", overrides={"scale_mode": mode, "tensors": {"h_gemm": None}})
    else:
        cfg = h_gemm_config(scale_mode=mode)
    m = qgru.QuantGRU(I, H, config=cfg)
    qgru.calibrate(m, _batches(), progress=False)
    # the ranges convert() hands activation_qparams (for the default mse observer: the searched grids')
    ranges = {n: calibrated_range(o, cfg[n], H, cfg.power_of_two, cfg.observer.kind)
              for n, o in m._calibrated(m._observers[(0, 0)]).items()}
    m.convert()
    got = _grids(m._qparams[0][0], cfg.power_of_two)
    assert ("h_gemm" in got) == (operand == "h_gemm")
    for n in ("Wx", "Rh", "r_pre", "z_pre", "g_pre") + (("h_gemm",) if operand == "h_gemm" else ()):
        want, _ = activation_qparams(*ranges[n], cfg[n], H, cfg.power_of_two)
        scale = got[n][0]
        if mode == "pow2":
            assert torch.equal(scale, want.to(scale.dtype).expand_as(scale)), n
        else:
            assert torch.allclose(scale, want.double().expand_as(scale), rtol=2 ** -20, atol=0), n


# ---- h_gemm: the R.h GEMM's own operand ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
def test_h_gemm_row(mode):
    """A 16-bit state whose R.h reads a 4-bit operand: every layer and direction gets an h_gemm row
    (its bits, grid and calibration record), its own SQNR is the error its grid adds (about what
    calibration expected of it), and Rh is rebuilt from what R.h read, at the operand's scale: its
    own SQNR stays that of a 16-bit grid. Were the R.h product rebuilt from h (its values, its
    scale for b_h or for S_Rh) it would carry the operand's whole 4-bit error, or worse."""
    torch.manual_seed(10)
    gru = nn.GRU(I, H, num_layers=2, bidirectional=True)
    calib = _batches()
    cfg = h_gemm_config(scale_mode=mode)
    with qgru.backend("reference"):
        q = qgru.quantize_model(gru, calib, config=cfg, progress=False)
        r = qgru.compare(gru, q, calib, verbose=False)
    for layer in (0, 1):
        for d in ("fwd", "rev"):
            p = q._qparams[layer][("fwd", "rev").index(d)]
            row = r.row("h_gemm", layer, d)
            assert row["bits"] == 4 and r.row("h", layer, d)["bits"] == 16
            assert row["grid"] == (float(p.scale["h_gemm"]), int(p.zp["h_gemm"])) != r.row("h", layer, d)["grid"]
            assert row["numel"] == len(calib) * T * N * H and row["steps_sqnr_db"] is None
            assert row["headroom"] == cfg["h_gemm"].headroom and row["calib_clip"] is not None
            assert 14 < row["own_sqnr_db"] < 30, row  # 4 bits: about 6 dB a bit
            assert abs(row["own_sqnr_db"] - row["calib_sqnr_db"]) < 2, row
            assert row["sqnr_db"] < row["own_sqnr_db"] + 1  # vs float it also carries h's error
            assert r.row("Rh", layer, d)["own_sqnr_db"] > 70, r.row("Rh", layer, d)
            assert r.row("h", layer, d)["own_sqnr_db"] > 70
    assert re.search(r"^\s*0\s+fwd\s+h_gemm\s+4\s", str(r), re.M)  # a line of the table
    assert [row["tensor"] for row in r.rows[:6]] == ["x", "W", "R", "Wx", "h_gemm", "Rh"]


def test_h_gemm_is_blamed_with_bits_it_can_have():
    """The operand at fault is named, and the override is one a config accepts: at most h's bits
    (8 here, not 16), and, once it has h's bits, removing it (R.h then reads h itself)."""
    torch.manual_seed(1)
    gru = nn.GRU(I, H)
    calib = _batches()
    cfg = h_gemm_config(h_bits=8, op_bits=4, scale_mode="pow2", observer={"kind": "minmax"})
    with qgru.backend("reference"):
        r = qgru.compare(gru, qgru.quantize_model(gru, calib, config=cfg, progress=False), calib, verbose=False)
    w = r.worst()
    assert (w["tensor"], w["reason"]) == ("h_gemm", "resolution")
    assert w["override"] == {"tensors": {"h_gemm": {"bits": 8}}}
    assert "worst: layer 0 fwd h_gemm own SQNR" in w["message"] and w["message"] in str(r)
    fixed = qgru.QuantConfig.load(cfg, overrides=w["override"])
    assert fixed["h_gemm"].bits == 8 and {n for n, s in fixed.tensors.items() if s != cfg[n]} == {"h_gemm"}
    # saturating: the widest grid it may have, and a headroom from what its values needed
    row = {**w, "saturation": 0.05, "range_needed": 1.3}
    sat = qgru.CompareReport([row if x is r.row("h_gemm") else x for x in r.rows], 1).worst()
    assert sat["reason"] == "saturation" and sat["override"] == {"tensors": {"h_gemm": {"bits": 8, "headroom": 1.5}}}
    qgru.QuantConfig.load(cfg, overrides=sat["override"])
    # as wide as h already (its wider headroom is what costs): the operand goes
    wide = h_gemm_config(h_bits=6, op_bits=6, scale_mode="pow2", observer={"kind": "minmax"})
    wide = qgru.QuantConfig.load(wide, overrides={"tensors": {"h_gemm": {"headroom": 4}}})
    with qgru.backend("reference"):
        r = qgru.compare(gru, qgru.quantize_model(gru, calib, config=wide, progress=False), calib, verbose=False)
    w = r.worst()
    assert (w["tensor"], w["reason"], w["override"]) == ("h_gemm", "resolution", {"tensors": {"h_gemm": None}})
    assert "let R.h read h itself" in w["message"]
    assert qgru.QuantConfig.load(wide, overrides=w["override"]).h_gemm is None


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
    assert set(tr) == {"h_gemm", "Wx", "Rh", "r_pre", "r", "z_pre", "z", "g_pre", "g", "h"}  # w8a8 has h_gemm
    assert all(len(v) == T for v in tr.values())
    x = torch.randn(T, N, I)
    w = m._weights(0, 0)
    ftr = {}
    assert all(torch.equal(a, b) for a, b in zip(float_direction(*w, x, torch.zeros(N, H), lengths),
                                                 float_direction(*w, x, torch.zeros(N, H), lengths, trace=ftr)))
    # the float GRU has no R.h operand of its own: h_gemm is compared with the state it narrows
    assert set(ftr) == set(tr) - {"h_gemm"}


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
