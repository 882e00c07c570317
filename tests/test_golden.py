"""The golden integer GRU against independent references: float64 math and hand computation."""
from fractions import Fraction
import math

import pytest
import torch

import qgru
from qgru.convert import derive_layer_params
from qgru.golden import gru_step, input_gemm, recurrent_operand
from qgru.primitives import dequantize, qrange, quantize


def _calibrated(I, H, config, layers=1, bidirectional=False, seed=0, T=6, N=3):
    torch.manual_seed(seed)
    m = qgru.QuantGRU(I, H, num_layers=layers, bidirectional=bidirectional, config=config)
    qgru.calibrate(m, [torch.randn(T, N, I) for _ in range(3)], progress=False)
    return m.convert()


def _float64_step(p, h_real, wx_real):
    """One GRU step in float64 on the dequantized integer weights (an independent reference)."""
    H = p.hidden_size
    R = p.R.double() * p.scale["R"].unsqueeze(1)
    b_h = p.b_h.double() * p.scale["R"] * p.scale["h"]
    rh = h_real @ R.t() + b_h
    r = torch.sigmoid(wx_real[:, :H] + rh[:, :H])
    z = torch.sigmoid(wx_real[:, H:2 * H] + rh[:, H:2 * H])
    g = torch.tanh(wx_real[:, 2 * H:] + r * rh[:, 2 * H:])
    return z * h_real + (1 - z) * g


@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
def test_step_matches_float64_gru_math(mode):
    """With 16-bit tensors the integer step is within a few h steps of float64 math.

    The inputs are taken from the calibration data itself (minmax observers), so no tensor leaves
    its calibrated range and nothing saturates: the only differences are rounding.
    """
    torch.manual_seed(0)
    config = qgru.QuantConfig.load("w16a16", overrides={"scale_mode": mode, "observer": {"kind": "minmax"}})
    m = qgru.QuantGRU(7, 5, config=config)
    batch = torch.randn(6, 4, 7)
    qgru.calibrate(m, [batch], progress=False)
    with torch.no_grad():
        h_seq, _ = m.to_float()(batch)
    m.convert()
    p = m._qparams[0][0]
    t = 3
    qx = quantize(batch[t + 1], p.scale["x"], p.zp["x"], 16)
    qh = quantize(h_seq[t], p.scale["h"], p.zp["h"], 16)
    dWx = input_gemm(p, qx)
    h_new = gru_step(p, dWx, qh)
    wx_real = dWx.double() * _wx_scale(m, p)
    expect = _float64_step(p, dequantize(qh, p.scale["h"], p.zp["h"]).double(), wx_real)
    got = dequantize(h_new, p.scale["h"], p.zp["h"]).double()
    err_steps = ((got - expect).abs() / p.scale["h"]).max().item()
    assert err_steps <= 4, err_steps


def _wx_scale(m, p):
    """S_Wx per channel, recovered from the rescale factor S_W S_x / S_Wx."""
    factor = p.rescale["Wx"].multiplier.double() / torch.exp2(p.rescale["Wx"].shift.double())
    return p.scale["W"] * p.scale["x"] / factor


def test_hand_computed_step():
    """H = I = 1, pow2 grids chosen by hand, every integer checked against Fraction arithmetic."""
    no_headroom = {n: {"headroom": 1.0} for n in ("Wx", "Rh", "r_pre", "z_pre", "g_pre")}
    state8 = {"h": {"bits": 8, "headroom": 1.0}, "h_gemm": None}  # R.h reads the 8-bit state itself
    config = qgru.QuantConfig.load("w8a8", overrides={"scale_mode": "pow2", "tensors": {**no_headroom, **state8}})
    w_ih = torch.tensor([[0.5], [0.25], [1.0]])   # r, z, g rows
    w_hh = torch.tensor([[0.5], [-0.5], [0.75]])
    b_ih = torch.tensor([0.0, 0.0, 0.0])
    b_hh = torch.tensor([0.0, 0.0, 0.25])
    one = lambda lo, hi: (torch.tensor(float(lo), dtype=torch.float64), torch.tensor(float(hi), dtype=torch.float64))
    per3 = lambda lo, hi: (torch.full((3,), float(lo), dtype=torch.float64), torch.full((3,), float(hi), dtype=torch.float64))
    # ranges just below powers of two, so that every pow2 grid below is easy to derive by hand
    ranges = {"x": one(-2, 1.9), "h": one(-1, 0.98), "Wx": per3(-2, 1.99), "Rh": per3(-2, 1.99),
              "r_pre": one(-4, 3.99), "z_pre": one(-4, 3.99), "g_pre": one(-4, 3.99)}
    p = derive_layer_params(w_ih, w_hh, b_ih, b_hh, ranges, config)
    # grids by hand: x: 3.9/255 -> pow2 2^-6, Z = round(-128 + 2 * 64) = 0; h: 1.98/255 -> 2^-7, Z = 0
    assert p.scale["x"].item() == 2 ** -6 and p.zp["x"].item() == 0
    assert p.scale["h"].item() == 2 ** -7 and p.zp["h"].item() == 0
    # W rows: max|w| / 127 -> pow2: 0.5 -> 2^-7 (0.5/127 < 2^-7), 0.25 -> 2^-8, 1.0 -> 2^-6
    assert p.scale["W"].tolist() == [2 ** -7, 2 ** -8, 2 ** -6]
    assert p.W.flatten().tolist() == [64, 64, 64]
    x_real, h_real = 0.75, 0.5
    qx = torch.tensor([[48]])                               # 0.75 * 2^6
    qh = torch.tensor([[64]])                               # 0.5 * 2^7
    dWx = input_gemm(p, qx)
    # Wx: 16-bit per gate, 3.99/65535 -> 2^-14, Z = round(-32768 + 2 * 16384) = 0
    assert p.zp["Wx"].tolist() == [0, 0, 0]
    exact_wx = [w * x_real for w in (0.5, 0.25, 1.0)]       # representable exactly
    assert dWx.flatten().tolist() == [int(v * 2 ** 14) for v in exact_wx]
    h_new = gru_step(p, dWx, qh)
    # hand computation with exact fractions on the same grids
    S_pre = Fraction(1, 2 ** 13)                            # 7.99/65535 -> 2^-13, Z = 0
    rh = [Fraction(0.5) * Fraction(h_real), Fraction(-0.5) * Fraction(h_real), Fraction(0.75) * Fraction(h_real) + Fraction(0.25)]
    q_rpre = math.floor((Fraction(exact_wx[0]) + rh[0]) / S_pre + Fraction(1, 2))
    q_zpre = math.floor((Fraction(exact_wx[1]) + rh[1]) / S_pre + Fraction(1, 2))
    r = 1 / (1 + math.exp(-q_rpre * 2 ** -13))
    z = 1 / (1 + math.exp(-q_zpre * 2 ** -13))
    g_pre = Fraction(exact_wx[2]) + Fraction(r) * rh[2]
    g = math.tanh(g_pre)
    h_expect = z * h_real + (1 - z) * g
    got = (h_new.item() - int(p.zp["h"])) * 2 ** -7
    assert abs(got - h_expect) <= 2 ** -7, (got, h_expect)  # within one 8-bit step of h


def test_worst_case_accumulator_is_exact():
    """16-bit W and x at their extremes with K = 4096: |acc| > 2^42, still exact end to end."""
    K, H = 4096, 2
    config = qgru.QuantConfig.load("w16a16", overrides={"scale_mode": "multiplier"})
    w_ih = torch.full((3 * H, K), 0.01)
    w_hh = torch.full((3 * H, H), 0.01)
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), lo, dtype=torch.float64), torch.full((3 * H,), hi, dtype=torch.float64))
    ranges = {"x": one(0.0, 1.0), "h": one(-1.0, 1.0), "Wx": per(-50.0, 50.0), "Rh": per(-1.0, 1.0),
              "r_pre": one(-8.0, 8.0), "z_pre": one(-8.0, 8.0), "g_pre": one(-8.0, 8.0)}
    p = derive_layer_params(w_ih, w_hh, None, None, ranges, config)
    lo, hi = qrange(16)
    assert int(p.zp["x"]) == lo and int(p.W.max()) == hi   # worst case: d_x = 2^16 - 1, q_W = 2^15 - 1
    qx = torch.full((1, K), hi)
    got = input_gemm(p, qx)[0]
    acc = K * (2 ** 15 - 1) * (2 ** 16 - 1)
    assert acc > 2 ** 42
    for c in range(3 * H):
        m, s = int(p.rescale["Wx"].multiplier[c]), int(p.rescale["Wx"].shift[c])
        q = math.floor(Fraction(acc * m, 2 ** s) + Fraction(1, 2)) + int(p.zp["Wx"][c])
        expect = max(lo, min(hi, q)) - int(p.zp["Wx"][c])
        assert int(got[c]) == expect


def test_more_bits_more_accuracy():
    torch.manual_seed(3)
    g = torch.nn.GRU(12, 16, num_layers=2, bidirectional=True)
    calib = [torch.randn(10, 4, 12) for _ in range(4)]
    x = torch.randn(10, 4, 12)
    with torch.no_grad():
        ref = g(x)[0]
    sqnr = {}
    for cfg in ("w8a8", "w8a16", "w16a16"):
        config = qgru.QuantConfig.load(cfg, overrides={"observer": {"kind": "minmax"}})
        out = qgru.quantize_model(g, calib, config=config, progress=False)(x)[0]
        sqnr[cfg] = (10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum())).item()
    assert sqnr["w8a8"] > 20
    assert sqnr["w8a16"] > sqnr["w8a8"] + 6
    assert sqnr["w16a16"] > sqnr["w8a16"] + 6, sqnr


def test_integer_path_is_deterministic_and_batch_independent():
    """Row n of a batch gives the same integers as running row n alone (no cross-row leakage)."""
    m = _calibrated(6, 8, "w8a8", layers=2, bidirectional=True)
    x = torch.randn(9, 5, 6)
    out, h = m(x)
    for n in range(5):
        o1, h1 = m(x[:, n:n + 1])
        assert torch.equal(o1[:, 0], out[:, n]) and torch.equal(h1[:, 0], h[:, n])


@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
def test_recurrent_operand_is_the_state_on_its_own_grid(mode):
    """With h_gemm (the shipped w8a8) R.h reads the 16-bit state requantized onto an 8-bit grid:
    every state integer maps to the h_gemm integer nearest its real value (Fractions, round half
    up), saturated at the grid's ends, and the step's R.h equals the GEMM of that operand."""
    m = _calibrated(6, 5, qgru.QuantConfig.load("w8a8", overrides={"scale_mode": mode}))
    p = m._qparams[0][0]
    assert p.bits["h"] == 16 and p.bits["h_gemm"] == 8
    qh = torch.arange(-32768, 32768, 37).reshape(1, -1)
    q_op, bits = recurrent_operand(p, qh)
    assert bits == 8
    S_h, S_op = Fraction(float(p.scale["h"])), Fraction(float(p.scale["h_gemm"]))
    m_, s_ = int(p.rescale["h_gemm"].multiplier), int(p.rescale["h_gemm"].shift)
    factor = Fraction(m_, 2 ** s_)
    # the multiplier is S_h / S_op to 31 bits (exactly, in pow2 mode)
    assert abs(factor / (S_h / S_op) - 1) <= (Fraction(1, 2 ** 29) if mode == "multiplier" else Fraction(0))
    lo, hi = qrange(8)
    z_h, z_op = int(p.zp["h"]), int(p.zp["h_gemm"])
    want = [min(hi, max(lo, math.floor((q - z_h) * factor + Fraction(1, 2)) + z_op)) for q in qh[0].tolist()]
    assert q_op[0].tolist() == want
    inside = [lo < w < hi for w in want]
    # inside the grid, the operand is within half an 8-bit step (plus the multiplier's error) of h
    err = [abs((w - z_op) * S_op - (q - z_h) * S_h) / S_op for w, q, i in zip(want, qh[0].tolist(), inside) if i]
    assert err and max(err) <= Fraction(1, 2) + Fraction(1, 2 ** 12)
    # the step's R.h is the integer GEMM of the operand, not of the state
    trace = {}
    gru_step(p, input_gemm(p, torch.zeros(1, 6, dtype=torch.int64)), qh[:, :5], trace)
    assert torch.equal(trace["h_gemm"][0], recurrent_operand(p, qh[:, :5])[0])
    acc = q_op[:, :5] @ p.R.t() - p.R_zp_comp + p.b_h
    assert torch.equal(trace["Rh"][0], qgru.primitives.saturate(p.rescale["Rh"](acc) + p.zp["Rh"], p.bits["Rh"]))
