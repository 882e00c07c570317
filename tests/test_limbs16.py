"""16-bit weights times 16-bit activations on the CPU's int16 paths (portable, avx2): the activation
taken whole as int16, the weights as their two int8 limbs (prepare.limbs16_fits: two limb pairs per
GEMM, not four), and the hybrid cell ("int32-hybrid": the accumulators requantized in int64, the
gates and the new state in the int32 cell). Every result is checked against the golden model,
including layers whose rows sit just under and just over the limb bound (2^15 sum_k |limb_ck|
< 2^31), with activations at the range's end where a wrong choice would overflow int32.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import qgru
from qgru import golden, native
from qgru.config import QuantConfig
from qgru.native import prepare
from qgru.primitives import qrange, split_int8_limbs

INT16_PATHS = ("portable", "avx2")


def _layer(mode: str, I: int, H: int, dynamic: bool = False) -> golden.LayerParams:
    torch.manual_seed(I * 7 + H)
    gru = torch.nn.GRU(I, H).eval()
    over = {"scale_mode": mode, "weight_rounding": "nearest"}
    if not dynamic:
        over["tensors"] = {"x": {"dynamic": False}}
    cfg = QuantConfig.load("w16a16", overrides=over)
    q = qgru.quantize_model(gru, [torch.randn(20, 8, I) for _ in range(2)], config=cfg, progress=False)
    return q._qparams[0][0]


def _paths():
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")
    paths = [str(i["name"]) for i in native.cpu_paths() if i["usable"] and i["name"] in INT16_PATHS]
    if not paths:
        pytest.skip("no int16 CPU path usable here")
    return paths


def _ints(shape, bits, gen):
    lo, hi = qrange(bits)
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64)


def _check(p: golden.LayerParams, paths, qx, qh0, level=None, want_direct=(1, 1)):
    want_out, want_h = golden.gru_direction(p, qx, qh0, None, level=level)
    for path in paths:
        layer = native.NativeLayer("cpu", p, torch.device("cpu"), isa=path)
        _, v = prepare.prepare_layer(p, act16=True)
        assert (v["x_direct16"], v["h_direct16"]) == want_direct, path
        assert layer.cell == "int32-hybrid" and layer.gemm == path, (path, layer.cell, layer.gemm)
        out, h = layer(qx, qh0, None, level)
        assert torch.equal(out.long(), want_out) and torch.equal(h.long(), want_h), path


def test_limbs16_bound():
    """The bound is on each limb's row sums: lo limbs of -128 (w a multiple of 256) fit up to
    K = 511 (511 * 128 < 2^16) and not at 512; one lo limb of 127 (w & 255 = 255) in place of a
    -128 keeps a row of 512 under it (65535)."""
    assert prepare.limbs16_fits(torch.full((3, 511), 256), 16, 16)
    assert not prepare.limbs16_fits(torch.full((3, 512), 256), 16, 16)
    w = torch.full((3, 512), 256)
    w[1, 0] = 255
    assert int(split_int8_limbs(w, 16)[0][0][1].long().abs().sum()) == 65535
    w[0, 0] = w[2, 0] = 255
    assert prepare.limbs16_fits(w, 16, 16)
    w[2, 0] = -256  # lo limb -128 again in one row
    assert not prepare.limbs16_fits(w, 16, 16)
    # the hi limb counts too: w = -32768 is hi = -128 (and lo = -128)
    assert not prepare.limbs16_fits(torch.full((2, 512), -32768), 16, 16)
    # nothing to take whole, or the other function's case
    assert not prepare.limbs16_fits(torch.full((2, 4), 256), 16, 8)
    assert not prepare.limbs16_fits(torch.full((2, 4), 100), 8, 16)


@pytest.mark.parametrize("mode", ("pow2", "multiplier"))
def test_prepare_two_limb_pairs_and_identity(mode):
    """With act16 a w16a16 layer's GEMMs are two pairs (the activation whole, scale 1 / 256, the
    lo limb's offset 128 through the ones column), and their sum plus the bias is golden's
    accumulator over the whole 16-bit range; without act16, four pairs as before."""
    I, H = 21, 13
    p = _layer(mode, I, H)
    t, v = prepare.prepare_layer(p, act16=True)
    t4, _ = prepare.prepare_layer(p)
    gen = torch.Generator().manual_seed(2)
    for pre, Wq, K, bias_name, comp, b in (("x", p.W, I, "Wx", p.W_zp_comp, p.b_x),
                                           ("h", p.R, H, "Rh", p.R_zp_comp, p.b_h)):
        assert t[f"{pre}_pairs"].tolist() == [[0, 0, 1, 128], [0, 1, 256, 0]]
        assert len(t4[f"{pre}_pairs"]) == 4
        q = _ints((6, K), 16, gen)
        q[0] = qrange(16)[0]
        q[1] = qrange(16)[1]
        limbs = t[f"{pre}_weight_limbs"].to(torch.int64)
        K_pad = limbs.shape[2]
        a = torch.zeros(6, K_pad, dtype=torch.int64)
        a[:, :K] = q
        acc = torch.zeros(6, 3 * H, dtype=torch.int64)
        for i, j, s, d in t[f"{pre}_pairs"].tolist():
            G = a @ limbs[j].t()
            assert int(G.abs().max()) < 2 ** 31  # each pair's int32 sums are exact
            acc += s * (G[:, :3 * H] + d * G[:, v["ones_col"]:v["ones_col"] + 1])
        assert torch.equal(acc + t[f"{bias_name}_bias"], q @ Wq.t() + b - comp)
    assert v["hybrid32"] == 1 and v["acc32"] == 0


@pytest.mark.parametrize("mode", ("pow2", "multiplier"))
@pytest.mark.parametrize("dynamic", (False, True))
def test_w16a16_hybrid_matches_golden(mode, dynamic):
    """As calibrated (static x and x levels): two limb pairs per GEMM, the hybrid cell, golden's
    integers, on random operands over the whole range, with sequence lengths too."""
    paths = _paths()
    p = _layer(mode, 16, 64, dynamic)
    gen = torch.Generator().manual_seed(7)
    T, N = 4, 6
    qx, qh0 = _ints((T, N, 16), 16, gen), _ints((N, 64), 16, gen)
    qh0[0] = qrange(16)[0]
    level = None
    if p.x_levels is not None:
        level = torch.randint(0, p.x_levels.exponent.numel(), (T, N), generator=gen, dtype=torch.int32)
    _check(p, paths, qx, qh0, level)
    lengths = torch.tensor([4, 1, 3, 0, 2, 4])
    want = golden.gru_direction(p, qx, qh0, lengths, level=level)
    for path in paths:
        got = native.NativeLayer("cpu", p, torch.device("cpu"), isa=path)(qx, qh0, lengths, level)
        assert all(torch.equal(g.long(), w) for g, w in zip(got, want)), path


@pytest.mark.parametrize("over", (False, True))
def test_limb_bound_edges_take_the_right_path(over):
    """A layer with K = 512 inputs whose W rows are set to a lo-limb sum of 65535 (under the bound:
    the two-pair GEMM) or 65536 (over it: the four-pair GEMM), run with every x at -2^15 on some
    steps (a row over the bound would then sum to -2^31 - ... in int32), matches golden either way."""
    paths = _paths()
    I, H = 512, 8
    p = _layer("pow2", I, H)
    W = p.W.clone()
    W[3] = 256  # lo limbs of -128 (hi 1)
    W[3, 0] = -256 if over else 255  # lo -128 or 127: 65536 or 65535
    W[5] = -256 * 3  # a second row at 511 * 128 = 65408, with hi limbs of -3
    W[5, 0] = 128 - 256 * 3  # lo 0
    p = dataclasses.replace(p, W=W)
    assert prepare.limbs16_fits(W, 16, 16) == (not over)
    gen = torch.Generator().manual_seed(11)
    T, N = 3, 4
    qx, qh0 = _ints((T, N, I), 16, gen), _ints((N, H), 16, gen)
    qx[0] = qrange(16)[0]
    qx[1, :2] = qrange(16)[1]
    _check(p, paths, qx, qh0, want_direct=(int(not over), 1))


def test_limb32_fields_and_the_int64_requantization(monkeypatch):
    """pow2 layers requantize both two-pair products in int32 (limb32_x / limb32_h, R in [8, 29]);
    with those refused the hybrid cell requantizes them in int64: golden's integers either way. A
    Layer given limb32 fields outside their bounds (R = 7, bias_lo = 2^R) refuses them."""
    paths = _paths()
    p = _layer("pow2", 16, 64, dynamic=True)
    t, v = prepare.prepare_layer(p, act16=True)
    assert v["limb32_x"] == v["limb32_h"] == 1
    r = t["Wxl_l32_rshift"]
    assert int(r.min()) >= 8 and int(r.max()) <= 29
    assert bool(((t["Wxl_l32_bias_lo"] >= 0) & (t["Wxl_l32_bias_lo"].long() < (1 << r.long()))).all())
    assert torch.equal(t["Wxl_l32_bias_hi"].long() * (1 << r.long()) + t["Wxl_l32_bias_lo"], t["Wxl_bias"])
    mod = native.load("cpu")
    for field, value in (("Rh_l32_rshift", 7), ("Wxl_l32_bias_lo", None)):
        bad = dict(t)
        x = t[field].clone()
        x[3] = value if value is not None else (1 << int(t["Wxl_l32_rshift"][3]))
        bad[field] = x
        with pytest.raises(RuntimeError, match="_l32_"):
            mod.Layer(bad, dict(v), paths[0])
    gen = torch.Generator().manual_seed(13)
    qx, qh0 = _ints((3, 5, 16), 16, gen), _ints((5, 64), 16, gen)
    level = torch.randint(0, p.x_levels.exponent.numel(), (3, 5), generator=gen, dtype=torch.int32)
    _check(p, paths, qx, qh0, level)
    monkeypatch.setattr(prepare, "_limb32_parts", lambda t, name: None)
    assert prepare.prepare_layer(p, act16=True)[1]["limb32_x"] == 0
    p2 = dataclasses.replace(p)  # a fresh object: no cached native layer
    _check(p2, paths, qx, qh0, level)


@pytest.mark.parametrize("mode", ("pow2", "multiplier"))
def test_four_pairs_hybrid_matches_golden(mode):
    """The int8 paths' form of the same layer (no act16: four limb pairs per GEMM, both products in
    int64) also runs the hybrid cell, here on an int16 path given those maps: golden's integers."""
    paths = _paths()
    p = _layer(mode, 16, 33, dynamic=True)
    t, v = prepare.prepare_layer(p)
    assert len(t["x_pairs"]) == len(t["h_pairs"]) == 4 and v["limb32_x"] == v["limb32_h"] == 0
    gen = torch.Generator().manual_seed(17)
    qx, qh0 = _ints((3, 5, 16), 16, gen), _ints((5, 33), 16, gen)
    level = torch.randint(0, p.x_levels.exponent.numel(), (3, 5), generator=gen, dtype=torch.int32)
    want_out, want_h = golden.gru_direction(p, qx, qh0, None, level=level)
    mod = native.load("cpu")
    for path in paths:
        layer = mod.Layer(dict(t), dict(v), path)
        assert layer.cell == "int32-hybrid"
        out, h = layer.forward(qx, qh0, None, level)
        assert torch.equal(out.long(), want_out) and torch.equal(h.long(), want_h), path
