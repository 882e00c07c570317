"""x levels (issue 31, docs/spec.md section 4b): the first layer quantizes each token of its float
input on the first of a few wider grids that holds it. The golden definition against hand-computed
integers and its properties (level 0 is the static layer; per token: streaming == one call, batch
rows independent; error <= half the token's step; 2x and 3x the calibrated range not clipped);
config errors; files (entries, checks as untrusted input, round trips: save/load, state_dict,
safetensors); QAT (its forward equals the converted model); the C export's refusal. Native
backends do not run levels yet: everything runs on the reference backend."""
from __future__ import annotations

import copy
import functools
import json
import math

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

import qgru
from qgru import golden
from qgru.golden import LayerParams, Rescale, XLevels
from qgru.primitives import qrange

DYN = {"tensors": {"x": {"dynamic": True}, "h_gemm": {"dynamic": True}}}
X_ONLY = {"tensors": {"x": {"dynamic": True}, "h_gemm": {"dynamic": False}}}
STATIC = {"tensors": {"x": {"dynamic": False}, "h_gemm": {"dynamic": False}}}  # w8a8 before x levels


def config(mode="multiplier", over=DYN, base="w8a8") -> qgru.QuantConfig:
    return qgru.QuantConfig.load(base, overrides={"scale_mode": mode, **copy.deepcopy(over)})


@functools.lru_cache(maxsize=None)
def build(mode="multiplier", layers=2, bidirectional=True, over="dyn", bias=True) -> qgru.QuantGRU:
    """A converted GRU(3, 5) with x levels, calibrated on randn (cached: tests must not modify it)."""
    torch.manual_seed(3)
    gru = nn.GRU(3, 5, layers, bidirectional=bidirectional, bias=bias)
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(8, 4, 3, generator=g) for _ in range(3)]
    cfg = config(mode, {"dyn": DYN, "x_only": X_ONLY, "static": STATIC}[over])
    with qgru.backend("reference"):
        return qgru.quantize_model(gru, calib, config=cfg, progress=False)


def levels_of(m) -> XLevels:
    return m._qparams[0][0].x_levels


def drifted(T=6, N=4, seed=0, scales=(0.5, 1.0, 2.0, 3.0)):
    """Inputs whose tokens sit at several multiples of the calibrated range (per batch row)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.tensor([scales[n % len(scales)] for n in range(N)]).reshape(1, N, 1)
    return torch.randn(T, N, 3, generator=g) * s


# ---------------------------------------------------------------------------------------------
# the golden definition
# ---------------------------------------------------------------------------------------------
def hand_layer() -> LayerParams:
    """I=2, H=1 (3H=3): S_x 0.5, Z_x 0, 8-bit x; levels e = 0, 4 (scales 0.5 and 1.0); W.x halved
    by level 0's rescale (m 2^30, shift 31) and kept by level 1's (m 2^30, shift 30)."""
    W = torch.tensor([[2, -1], [1, 1], [0, 3]])
    lv = XLevels(exponent=torch.tensor([0, 4]), scale=torch.tensor([0.5, 1.0], dtype=torch.float64),
                 lo=torch.tensor([-64.0, -128.0], dtype=torch.float64),
                 hi=torch.tensor([63.5, 127.0], dtype=torch.float64),
                 b_x=torch.tensor([[5, 0, -2], [3, 0, -1]]),
                 rescale=Rescale(torch.full((2, 3), 1 << 30), torch.tensor([[31] * 3, [30] * 3])))
    return LayerParams(input_size=2, hidden_size=1, bits={"x": 8, "W": 8, "Wx": 16}, W=W, R=None,
                       b_x=lv.b_x[0].clone(), b_h=None, W_zp_comp=torch.zeros(3, dtype=torch.int64), R_zp_comp=None,
                       zp={"x": torch.tensor(0), "Wx": torch.tensor(0)},
                       rescale={"Wx": Rescale(torch.tensor(1 << 30), torch.tensor(31))}, tables={}, one_z=0,
                       scale={"x": torch.tensor(0.5, dtype=torch.float64)}, x_levels=lv)


def test_hand_computed_level_choice_and_W_x():
    p = hand_layer()
    x = torch.tensor([[10.0, -3.0],     # fits level 0: q (20, -6)
                      [100.0, 2.0],     # beyond 63.5: level 1, q (100, 2)
                      [300.0, -200.0],  # fits no level: the last, which clips: q (127, -128)
                      [63.5, -64.0],    # level 0's ends exactly (<=, >=): level 0, q (127, -128)
                      [63.6, 0.0]])     # just beyond: level 1, q (64, 0)
    qx, level = golden.quantize_levels(p.x_levels, x, p.zp["x"], 8)
    assert level.tolist() == [0, 1, 1, 0, 1]
    assert qx.tolist() == [[20, -6], [100, 2], [127, -128], [127, -128], [64, 0]]
    # W.x: acc = W q - W_zp_comp + b_x[level], then round_half_up(acc * m / 2^shift)
    # (46, 14, -18) + (5, 0, -2) = (51, 14, -20) -> /2 -> (26, 7, -10)
    # (198, 102, 6) + (3, 0, -1) -> x1 -> (201, 102, 5)
    # (382, -1, -384) + (3, 0, -1) -> (385, -1, -385)
    # (382, -1, -384) + (5, 0, -2) = (387, -1, -386) -> /2 -> (194, 0, -193)
    # (128, 64, 0) + (3, 0, -1) -> (131, 64, -1)
    want = [[26, 7, -10], [201, 102, 5], [385, -1, -385], [194, 0, -193], [131, 64, -1]]
    assert golden.input_gemm(p, qx, level).tolist() == want
    # a token's level is its own: the same token alone, or among others, gives the same integers
    for i in range(5):
        q1, l1 = golden.quantize_levels(p.x_levels, x[i:i + 1], p.zp["x"], 8)
        assert golden.input_gemm(p, q1, l1).tolist() == [want[i]]
    # level 0 is the static layer: without levels, the static grid clips token 1 to (127, 4)
    static = golden.input_gemm(p, torch.tensor([[127, 4]]))
    assert static.tolist() == [[(2 * 127 - 4 + 5 + 1) // 2, (127 + 4 + 1) // 2, (12 - 2 + 1) // 2]]


def test_a_layer_with_levels_runs_level_0_without_levels_and_only_it_takes_them():
    """No level: every token on level 0 (qx on the static grid, as integer callers hand it); a
    level given to a layer without levels is an error."""
    p = hand_layer()
    qx = torch.tensor([[[127, 4]], [[-3, 9]]])
    h0 = torch.zeros(1, 1, dtype=torch.int64)
    zeros = torch.zeros(2, 1, dtype=torch.int64)
    assert torch.equal(golden.input_gemm(p, qx), golden.input_gemm(p, qx, zeros))
    assert not torch.equal(golden.input_gemm(p, qx[:1], torch.ones(1, 1, dtype=torch.int64)),
                           golden.input_gemm(p, qx[:1]))  # a level does change W.x
    plain = hand_layer()
    plain.x_levels = None
    with pytest.raises(ValueError, match="without x levels"):
        golden.gru_direction(plain, qx, h0, level=zeros)  # refused before any step runs


def test_select_levels_of_a_nan_token_is_the_last_level():
    lv = hand_layer().x_levels
    assert golden.select_levels(lv, torch.tensor([[float("nan"), 0.0], [0.0, 0.0]])).tolist() == [1, 0]


@pytest.mark.parametrize("mode", ["multiplier", "pow2"])
def test_levels_as_convert_makes_them(mode):
    """Exponents 0..12 (pow2: 0, 4, 8, 12), scales S_x 2^(e/4), ends on x's grid, level 0 = b_x and
    rescale.Wx; only the first layer (and direction) has levels."""
    m = build(mode)
    for li, row in enumerate(m._qparams):
        for p in row:
            lv = p.x_levels
            if li > 0:
                assert lv is None
                continue
            e = lv.exponent.tolist()
            assert e == (list(range(13)) if mode == "multiplier" else [0, 4, 8, 12])
            assert torch.equal(lv.scale, p.scale["x"] * torch.tensor([2.0 ** (v / 4) for v in e], dtype=torch.float64))
            lo, hi = qrange(8)
            z = int(p.zp["x"])
            assert torch.equal(lv.lo, (lo - z) * lv.scale) and torch.equal(lv.hi, (hi - z) * lv.scale)
            assert torch.equal(lv.b_x[0], p.b_x)
            assert torch.equal(lv.rescale.multiplier[0], p.rescale["Wx"].multiplier.expand(15))
            assert torch.equal(lv.rescale.shift[0], p.rescale["Wx"].shift.expand(15))
            # the rescale follows the scale: level j's factor is 2^(e/4) times level 0's (to rounding)
            real = lv.rescale.multiplier.double() / 2.0 ** lv.rescale.shift.double()
            ratio = real / real[0]
            want = torch.tensor([2.0 ** (v / 4) for v in e], dtype=torch.float64).unsqueeze(1)
            assert torch.allclose(ratio, want.expand_as(ratio), rtol=1e-6)


def test_tokens_fitting_level_0_give_the_static_layers_integers():
    """x.dynamic alone changes nothing of a 1-layer model but the levels: inputs within the
    calibrated grid give the static model's outputs bit for bit; beyond it they differ (less clipping)."""
    torch.manual_seed(5)
    gru = nn.GRU(3, 5, bidirectional=True)
    calib = [torch.randn(8, 4, 3) for _ in range(2)]
    with qgru.backend("reference"):
        dyn = qgru.quantize_model(gru, calib, config=config(over=X_ONLY), progress=False)
        static = qgru.quantize_model(gru, calib, config=config(over=STATIC), progress=False)
        pd, ps = dyn._qparams[0][0], static._qparams[0][0]
        for f in ("W", "R", "b_x", "b_h", "W_zp_comp", "R_zp_comp"):
            assert torch.equal(getattr(pd, f), getattr(ps, f)), f
        lv = pd.x_levels
        x = torch.randn(6, 3, 3) * 3
        inside = x.clamp(float(lv.lo[0]) * 0.9999, float(lv.hi[0]) * 0.9999)  # float32 within the ends
        assert (golden.select_levels(lv, inside) == 0).all()
        assert torch.equal(dyn(inside)[0], static(inside)[0])
        out_d, out_s = dyn(x)[0], static(x)[0]
        assert not torch.equal(out_d, out_s)
        ref = gru(x)[0]
        assert ((out_d - ref) ** 2).sum() < ((out_s - ref) ** 2).sum()


def test_level_choice_is_per_token_streaming_and_batch_rows():
    """Streaming T=1 calls (h carried) equal one call, and every batch row alone equals its row of
    the batch, bit for bit, with rows at 0.5x to 3x the calibrated range."""
    m = build("multiplier", layers=2, bidirectional=False)
    x = drifted(T=7, N=4)
    with qgru.backend("reference"), torch.no_grad():
        out, hn = m(x)
        h = None
        steps = []
        for t in range(x.shape[0]):
            o, h = m(x[t:t + 1], h)
            steps.append(o)
        assert torch.equal(torch.cat(steps), out) and torch.equal(h, hn)
        for n in range(x.shape[1]):
            o, hn1 = m(x[:, n:n + 1])
            assert torch.equal(o, out[:, n:n + 1]) and torch.equal(hn1, hn[:, n:n + 1])
    levels = golden.select_levels(levels_of(m), x)
    assert len(set(levels.reshape(-1).tolist())) > 2  # the rows do take different levels


@pytest.mark.parametrize("mode", ["multiplier", "pow2"])
def test_dequantized_error_is_at_most_half_the_tokens_step(mode):
    m = build(mode)
    p = m._qparams[0][0]
    lv = p.x_levels
    x = drifted(T=20, N=8, seed=1, scales=(0.3, 1.0, 1.7, 2.5, 3.0, 5.0))
    qx, level = golden.quantize_levels(lv, x, p.zp["x"], 8)
    step = lv.scale[level].unsqueeze(-1)
    err = ((qx - p.zp["x"]).double() * step - x.double()).abs()
    assert (err <= step / 2).all()  # no token clips: every one fits a level (5x < 8x the range)
    # and each token is on the finest level that holds it
    finer = (level - 1).clamp(min=0)
    xd = x.double()
    fits_finer = (xd.amin(-1) >= lv.lo[finer]) & (xd.amax(-1) <= lv.hi[finer])
    assert not (fits_finer & (level > 0)).any()


@pytest.mark.parametrize("factor", [2.0, 3.0])
def test_a_token_at_2x_and_3x_the_calibrated_range_is_not_clipped(factor):
    m = build("multiplier")
    p = m._qparams[0][0]
    lv = p.x_levels
    lo_q, hi_q = qrange(8)
    x = torch.tensor([[[float(lv.hi[0]) * factor, float(lv.lo[0]) * factor, 0.0]]])
    qx, level = golden.quantize_levels(lv, x, p.zp["x"], 8)
    j = int(level)
    assert 0 < j < len(lv.exponent) - 1 and 2.0 ** (int(lv.exponent[j]) / 4) >= factor
    assert (((qx - p.zp["x"]).double() * lv.scale[j] - x.double()).abs() <= lv.scale[j] / 2).all()
    # the static grid clips the same token to its ends
    qs = qgru.primitives.quantize(x, p.scale["x"], p.zp["x"], 8)
    assert int(qs[0, 0, 0]) == hi_q and int(qs[0, 0, 1]) == lo_q


def test_config_errors():
    for name in ("W", "R", "h", "Wx", "z"):
        with pytest.raises(ValueError, match=rf"config\.tensors\.{name}: dynamic applies to the GEMM operands x "
                                             r"and h_gemm only"):
            qgru.QuantConfig.load("w8a8", overrides={"tensors": {name: {"dynamic": True}}})
    for bad in (1, "true", None, 0.0):
        with pytest.raises(ValueError, match=r"config\.tensors\.x: dynamic must be true or false"):
            qgru.QuantConfig.load("w8a8", overrides={"tensors": {"x": {"dynamic": bad}}})
    cfg = config()
    assert cfg["x"].dynamic and cfg["h_gemm"].dynamic and not cfg["W"].dynamic
    assert qgru.QuantConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    assert qgru.QuantConfig.load("w8a8").to_dict() == cfg.to_dict()  # the shipped default
    assert "dynamic" not in json.dumps(config(over=STATIC).to_dict())


# ---------------------------------------------------------------------------------------------
# QAT
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["multiplier", "pow2"])
def test_qat_forward_equals_the_converted_model_with_levels(mode):
    torch.manual_seed(2)
    gru = nn.GRU(3, 4, 2, bidirectional=True)
    gen = torch.Generator().manual_seed(0)
    calib = [pack_sequence([torch.randn(L, 3, generator=gen) for L in (6, 4, 3)], enforce_sorted=False)
             for _ in range(2)]
    model = qgru.prepare_qat(gru, calib, config(mode), progress=False).eval()
    x = pack_sequence([torch.randn(L, 3, generator=gen) * s for L, s in ((6, 3.0), (5, 0.5), (2, 2.0))],
                      enforce_sorted=False)
    out_qat, hn_qat = copy.deepcopy(model)(x)
    qgru.convert_qat(model)
    assert levels_of(model) is not None
    with qgru.backend("reference"), torch.no_grad():
        out_int, hn_int = model(x)
    assert torch.equal(out_qat.data, out_int.data) and torch.equal(hn_qat, hn_int)


def test_qat_gradient_passes_where_a_level_holds_the_input():
    """The clipped STE masks only what the chosen level clips: an input at 2x the calibrated range
    gets the float GRU's gradient with levels; the static grid clips it (no gradient)."""
    torch.manual_seed(4)
    gru = nn.GRU(3, 4)
    calib = [torch.randn(6, 4, 3) for _ in range(2)]
    grads = {}
    for name, over in (("dyn", DYN), ("static", STATIC)):
        model = qgru.prepare_qat(gru, calib, config(over=over), progress=False)
        p = model._derive_params(model._qat, {})[0][0]
        big = float(max(abs(p.scale["x"] * (qrange(8)[1] - p.zp["x"])), abs(p.scale["x"] * (qrange(8)[0] - p.zp["x"]))))
        x = torch.full((2, 1, 3), 2.0 * big, requires_grad=True)
        model(x)[0].sum().backward()
        grads[name] = x.grad
    assert (grads["static"] == 0).all()
    assert (grads["dyn"] != 0).all()


# ---------------------------------------------------------------------------------------------
# files: entries, round trips, untrusted input
# ---------------------------------------------------------------------------------------------
PARTS = ("exponent", "scale", "lo", "hi", "b_x", "multiplier", "shift")


def entries(mode="multiplier", **kw):
    return build(mode, **kw).export().to_dict()


def write(d, path):
    d = dict(d)
    d["checksum"] = qgru.export.checksum(d)
    torch.save(d, path)
    return path


def test_entries_exactly_in_the_first_layer_with_the_config():
    d = entries()
    assert {k for k in d if "x_levels" in k} == {f"l0.{di}.x_levels.{k}" for di in ("fwd", "rev") for k in PARTS}
    assert d["l0.fwd.x_levels.exponent"].dtype == torch.int32 and d["l0.fwd.x_levels.scale"].dtype == torch.float64
    static = entries(over="static")
    assert not [k for k in static if "x_levels" in k]  # files without levels: the layout as before


@pytest.mark.parametrize("mode", ["multiplier", "pow2"])
def test_save_load_round_trip_bit_exact(mode, tmp_path):
    m = build(mode)
    path = tmp_path / "m.qgru"
    m.export().save(path)
    loaded = qgru.load_params(path)
    for a, b in zip(loaded.layers[0], m._qparams[0]):
        for f in ("exponent", "scale", "lo", "hi", "b_x"):
            assert torch.equal(getattr(a.x_levels, f), getattr(b.x_levels, f)), f
        assert torch.equal(a.x_levels.rescale.multiplier, b.x_levels.rescale.multiplier)
    x = drifted()
    with qgru.backend("reference"), torch.no_grad():
        assert torch.equal(loaded.to_module()(x)[0], m(x)[0])


def test_files_without_levels_still_load_and_a_config_claiming_them_is_refused(tmp_path):
    d = entries(over="static")
    with qgru.backend("reference"), torch.no_grad():
        qgru.load_params(write(d, tmp_path / "old.qgru"))
    meta = json.loads(d["meta"])
    meta["config"]["tensors"]["x"]["dynamic"] = True
    d["meta"] = json.dumps(meta)
    with pytest.raises(qgru.ParamsFileError, match=r"missing entries l0\.fwd\.x_levels\.b_x, l0\.fwd\.x_levels\.exponent"):
        qgru.load_params(write(d, tmp_path / "claim.qgru"))


def _set(key, fn):
    def f(d):
        d[key] = fn(d[key]) if callable(fn) else fn
    return f


def _config(change):
    def f(d):
        meta = json.loads(d["meta"])
        change(meta["config"])
        d["meta"] = json.dumps(meta)
    return f


def _move_to_layer_1(d):
    for k in PARTS:
        d[f"l1.fwd.x_levels.{k}"] = d[f"l0.fwd.x_levels.{k}"]


def _row(j, fn):
    def g(t):
        t = t.clone()
        t[j] = fn(t[j])
        return t
    return g


L0 = "l0.fwd.x_levels."
HOSTILE = {  # name: (scale mode, mutation, message)
    "static_config": ("multiplier", _config(lambda c: c["tensors"]["x"].pop("dynamic")),
                      r"unexpected entries l0\.fwd\.x_levels\.b_x, "),
    "layer_1": ("multiplier", _move_to_layer_1, r"unexpected entries l1\.fwd\.x_levels\."),
    "missing": ("multiplier", lambda d: d.pop(L0 + "hi"), r"missing entry l0\.fwd\.x_levels\.hi$"),
    "no_levels": ("multiplier", lambda d: [d.__setitem__(L0 + k, d[L0 + k][:0]) for k in PARTS],
                  r"l0\.fwd\.x_levels\.exponent: 0 levels; a layer has 1 to 13"),
    "14_levels": ("multiplier", lambda d: [d.__setitem__(L0 + k, torch.cat([d[L0 + k], d[L0 + k][-1:]]))
                                           for k in PARTS], r"x_levels\.exponent: 14 levels; a layer has 1 to 13"),
    "not_from_0": ("multiplier", _set(L0 + "exponent", lambda t: t + 1), r"x_levels\.exponent: 1, 2, .* but convert makes 0, 1"),
    "descending": ("multiplier", _set(L0 + "exponent", lambda t: t.flip(0)), r"x_levels\.exponent: 12, 11"),
    "repeated": ("multiplier", _set(L0 + "exponent", _row(2, lambda v: v - 1)), r"x_levels\.exponent: 0, 1, 1, 3"),
    "pow2_quarter": ("pow2", _set(L0 + "exponent", _row(1, lambda v: v - 1)),
                     r"x_levels\.exponent: 0, 3, 8, 12, but convert makes 0, 4, 8, 12 .*pow2"),
    "exponent_dtype": ("multiplier", _set(L0 + "exponent", lambda t: t.double()),
                       r"l0\.fwd\.x_levels\.exponent: expected a torch\.int32 tensor, got torch\.float64"),
    "scale_ulp": ("multiplier", _set(L0 + "scale", _row(3, lambda v: torch.nextafter(v, v * 2))),
                  r"x_levels\.scale: level 3: .* but scale\.x \* 2\^\(3/4\) is"),
    "scale_negative": ("multiplier", _set(L0 + "scale", lambda t: -t), r"x_levels\.scale: level 0: -"),
    "scale_nan": ("pow2", _set(L0 + "scale", _row(2, lambda v: v * float("nan"))), r"x_levels\.scale: level 2: nan"),
    "scale_shape": ("multiplier", _set(L0 + "scale", lambda t: t[:-1]), r"x_levels\.scale: expected shape \(13,\), got \(12,\)"),
    "lo_wrong": ("multiplier", _set(L0 + "lo", _row(5, lambda v: v * 0.5)), r"x_levels\.lo: level 5: .* makes it"),
    "hi_inf": ("multiplier", _set(L0 + "hi", _row(0, lambda v: v * float("inf"))), r"x_levels\.hi: level 0: inf"),
    "b_x_row_0": ("multiplier", _set(L0 + "b_x", _row(0, lambda v: v + 1)), r"x_levels\.b_x: level 0 differs from b_x"),
    "b_x_shape": ("multiplier", _set(L0 + "b_x", lambda t: t[:, :-1]), r"x_levels\.b_x: expected shape \(13, 15\)"),
    "multiplier_negative": ("multiplier", _set(L0 + "multiplier", _row(4, lambda v: -v)),
                            r"x_levels\.multiplier: -[0-9]+ is outside \[0, "),
    "multiplier_row_0": ("multiplier", _set(L0 + "multiplier", _row(0, lambda v: v + 1)),
                         r"x_levels\.multiplier: level 0 differs from rescale\.Wx"),
    "multiplier_not_pow2": ("pow2", _set(L0 + "multiplier", _row(3, lambda v: v + 1)),
                            r"x_levels\.multiplier: [0-9]+ is not a power of two"),
    "shift_0": ("multiplier", _set(L0 + "shift", _row(6, lambda v: v * 0)), r"x_levels\.shift: 0 is outside \[1, 62\]"),
    "shift_63": ("pow2", _set(L0 + "shift", _row(1, lambda v: v * 0 + 63)), r"x_levels\.shift: 63 is outside \[1, 62\]"),
    "shift_shape": ("multiplier", _set(L0 + "shift", lambda t: t.reshape(-1)), r"x_levels\.shift: expected shape \(13, 15\)"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_crafted_levels_are_refused_naming_the_field(case, tmp_path):
    mode, mutate, message = HOSTILE[case]
    d = entries(mode)
    mutate(d)
    path = write(d, tmp_path / "crafted.qgru")
    with pytest.raises(qgru.ParamsFileError, match=message) as e:
        qgru.load_params(path)
    assert str(e.value).startswith(str(path))


def test_levels_of_a_model_without_bias_are_zero_biases(tmp_path):
    d = entries("multiplier", bias=False)
    assert not d[L0 + "b_x"].any()
    qgru.load_params(write(d, tmp_path / "ok.qgru"))
    d[L0 + "b_x"] = _row(3, lambda v: v + 1)(d[L0 + "b_x"])
    with pytest.raises(qgru.ParamsFileError, match=r"x_levels\.b_x: nonzero, but meta\.bias is false"):
        qgru.load_params(write(d, tmp_path / "bad.qgru"))


@pytest.mark.parametrize("mode", ["multiplier", "pow2"])
def test_untampered_files_load(mode, tmp_path):
    qgru.load_params(write(entries(mode), tmp_path / "ok.qgru"))


def test_in_memory_params_are_validated():
    params = copy.deepcopy(build().export())
    params.layers[1][0].x_levels = params.layers[0][0].x_levels
    with pytest.raises(qgru.ParamsFileError, match=r"l1\.fwd\.x_levels: present, but only the first layer"):
        params.validate()
    params = copy.deepcopy(build().export())
    params.layers[0][1].x_levels = None
    with pytest.raises(qgru.ParamsFileError, match=r"l0\.rev\.x_levels: missing: meta\.config has x\.dynamic"):
        params.to_module()


def test_state_dict_round_trip_carries_levels():
    m = build()
    fresh = qgru.QuantGRU(3, 5, 2, bidirectional=True)
    fresh.load_state_dict(m.state_dict())
    assert fresh.is_converted and torch.equal(levels_of(fresh).scale, levels_of(m).scale)
    x = drifted()
    with qgru.backend("reference"), torch.no_grad():
        assert torch.equal(fresh(x)[0], m(x)[0])


def test_state_dict_round_trip_through_safetensors_carries_levels(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    m = build()
    path = tmp_path / "m.safetensors"
    st.save_file(m.state_dict(), str(path))
    fresh = qgru.QuantGRU(3, 5, 2, bidirectional=True)
    fresh.load_state_dict(st.load_file(str(path)))
    assert torch.equal(levels_of(fresh).b_x, levels_of(m).b_x)
    x = drifted()
    with qgru.backend("reference"), torch.no_grad():
        assert torch.equal(fresh(x)[0], m(x)[0])


# ---------------------------------------------------------------------------------------------
# qgru.compare
# ---------------------------------------------------------------------------------------------
def test_compare_x_row_counts_only_what_the_widest_level_clips():
    """On inputs at 2x-3x the calibrated range, the x row of a model with levels reports no clipping
    and the own SQNR of an 8-bit grid per token (the static model's x clips, with a warning); the
    share of tokens above level 0 is reported; beyond the widest level (8x) it warns again."""
    import warnings
    gru_l = build("multiplier", layers=1, bidirectional=False)
    gru_s = build("multiplier", layers=1, bidirectional=False, over="static")
    torch.manual_seed(3)
    ref = nn.GRU(3, 5, 1)  # build()'s float GRU (same seed and shape)
    x = drifted(T=10, N=4, scales=(2.0, 3.0))
    with qgru.backend("reference"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", qgru.CalibrationWarning)
            rep_l = qgru.compare(ref, gru_l, [x], verbose=False, progress=False)
        with pytest.warns(qgru.CalibrationWarning, match=r"lies beyond its calibrated grid.*'dynamic': True"):
            rep_s = qgru.compare(ref, gru_s, [x], verbose=False, progress=False)
        row_l, row_s = rep_l.row("x"), rep_s.row("x")
        assert row_l["saturation"] == 0 and row_s["saturation"] > 0.05
        assert row_l["range_needed"] <= 1.0 < row_s["range_needed"]
        # the own error: each element within half its token's step, against clipping
        assert row_l["own_sqnr_db"] > 35 and row_l["own_sqnr_db"] > row_s["own_sqnr_db"] + 15
        assert 0.2 < row_l["above_level0"] < 1 and row_l["x_levels_widest"] == 8.0
        assert row_s["above_level0"] is None and row_s["x_levels_widest"] is None
        assert "x levels: layer 0 fwd:" in str(rep_l) and "x levels" not in str(rep_s)
        # inputs in range: tokens on level 0 only, the static model's x and W.x
        x_in = drifted(scales=(0.3,))
        rep_in = qgru.compare(ref, gru_l, [x_in], verbose=False, progress=False)
        rep_in_s = qgru.compare(ref, gru_s, [x_in], verbose=False, progress=False)
        assert rep_in.row("x")["above_level0"] == 0.0
        for t in ("x", "Wx"):
            assert rep_in.row(t)["own_sqnr_db"] == rep_in_s.row(t)["own_sqnr_db"]
        # beyond level 0, W.x's own reference takes each token's level bias: W.x as exact as in range
        # (1.2x: W.x does not saturate yet; its own SQNR is that of its 16-bit grid)
        rep_12 = qgru.compare(ref, gru_l, [drifted(scales=(1.2,))], verbose=False, progress=False)
        assert rep_12.row("x")["above_level0"] > 0 and rep_12.row("Wx")["saturation"] == 0
        assert rep_12.row("Wx")["own_sqnr_db"] > 70
        with pytest.warns(qgru.CalibrationWarning, match=r"lies beyond its widest x level \(8x its calibrated range\)"):
            qgru.compare(ref, gru_l, [drifted(scales=(20.0,))], verbose=False, progress=False)
