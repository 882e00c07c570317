"""Export of converted QuantGRUs: ranges and types of the integer parameters, save/load round trip
(bit-exact), safe loading (weights_only), the weight quantization error, and the optional R.h
operand h_gemm (its entries, their checks, and files without it)."""
from __future__ import annotations

import copy
import functools
import json
import zlib

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import qgru
from qgru.primitives import qrange

INPUT_SIZE, HIDDEN = 5, 6

CUSTOM = {  # exercises per_group / per_tensor weights, per_channel / per_tensor GEMM outputs, 8-bit tables
    "base": "w8a8",
    "overrides": {"observer": {"kind": "minmax"},
                  "tensors": {"W": {"bits": 8, "symmetric": True, "granularity": "per_group", "group_size": 4},
                              "R": {"bits": 6, "symmetric": True, "granularity": "per_tensor"},
                              "Wx": {"bits": 12, "symmetric": False, "granularity": "per_channel"},
                              "Rh": {"bits": 16, "symmetric": True, "granularity": "per_tensor"},
                              "z_pre": {"bits": 8, "symmetric": False},
                              "r_pre": {"bits": 10, "symmetric": False},
                              "g_pre": {"bits": 8, "symmetric": False},
                              "z": {"bits": 8}, "r": {"bits": 12}, "g": {"bits": 8}}},
}
# h_gemm: the state keeps 16 (12) bits, the R.h GEMM reads it requantized to 8 (6) bits (golden.recurrent_operand)
H_GEMM = {"hg16_8": {"h": {"bits": 16, "headroom": 1.5}, "h_gemm": {"bits": 8, "dynamic": False}},
          "hg12_6": {"h": {"bits": 12, "headroom": 1.5}, "h_gemm": {"bits": 6, "dynamic": False}}}
CONFIGS = ["w8a8", "w8a16", "w16a16", "custom", "hg16_8"]
SCALE_MODES = ["pow2", "multiplier"]
ARCHS = {  # (num_layers, bidirectional, bias, batch_first)
    "1layer": (1, False, True, False),
    "2layer_bidir_nobias": (2, True, False, False),
    "2layer_bidir_bf": (2, True, True, True),
    "2layer_uni_nobias_bf": (2, False, False, True),
}
CASES = [(c, s, a) for c in CONFIGS for s in SCALE_MODES for a in ARCHS]
CASE_IDS = [f"{c}-{s}-{a}" for c, s, a in CASES]


def make_config(name: str, scale_mode: str) -> qgru.QuantConfig:
    if name == "custom":
        over = json.loads(json.dumps(CUSTOM["overrides"]))
        over["scale_mode"] = scale_mode
        return qgru.QuantConfig.load(CUSTOM["base"], overrides=over)
    if name in H_GEMM:
        return qgru.QuantConfig.load("w8a8", overrides={"scale_mode": scale_mode, "tensors": H_GEMM[name]})
    return qgru.QuantConfig.load(name, overrides={"scale_mode": scale_mode})


def make_input(batch_first: bool, T: int, N: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, N, INPUT_SIZE, generator=g) * 1.5
    return x.transpose(0, 1).contiguous() if batch_first else x


@functools.lru_cache(maxsize=None)
def build(config: str, scale_mode: str, arch: str) -> qgru.QuantGRU:
    """A calibrated and converted QuantGRU (cached: tests must not modify it)."""
    num_layers, bidir, bias, batch_first = ARCHS[arch]
    torch.manual_seed(zlib.crc32(f"{config}/{scale_mode}/{arch}".encode()))
    m = qgru.QuantGRU(INPUT_SIZE, HIDDEN, num_layers, bias, batch_first, 0.0, bidir,
                      config=make_config(config, scale_mode))
    batches = [make_input(batch_first, 7, 3, seed) for seed in range(4)]
    qgru.calibrate(m, batches, progress=False)
    m.convert()
    assert m.is_converted
    return m


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request):
    config, scale_mode, arch = request.param
    return build(config, scale_mode, arch), make_config(config, scale_mode)


def layer_params(params):
    for li, row in enumerate(params.layers):
        for d, p in enumerate(row):
            yield li, d, p


def float_weights(m, li, d):
    sfx = f"_l{li}" + ("_reverse" if d else "")
    return getattr(m, "weight_ih" + sfx).detach().double(), getattr(m, "weight_hh" + sfx).detach().double()


def assert_dicts_identical(a, b):
    assert set(a) == set(b)
    for k in a:
        va, vb = a[k], b[k]
        assert type(va) is type(vb), k
        if isinstance(va, torch.Tensor):
            assert va.dtype == vb.dtype and va.shape == vb.shape, k
            assert torch.equal(va, vb), k
        else:
            assert va == vb, k


# ---------------------------------------------------------------------------------------------
def test_export_ranges_and_dtypes(case):
    m, cfg = case
    params = m.export()
    assert isinstance(params, qgru.QuantParams)
    ndir = 2 if m.bidirectional else 1
    assert len(params.layers) == m.num_layers and all(len(row) == ndir for row in params.layers)
    i32min, i32max = qrange(32)
    for li, d, p in layer_params(params):
        H3, I = 3 * HIDDEN, (INPUT_SIZE if li == 0 else HIDDEN * ndir)
        for name, w, shape in (("W", p.W, (H3, I)), ("R", p.R, (H3, HIDDEN))):
            bits = cfg[name].bits
            assert p.bits[name] == bits
            assert w.dtype == torch.int64 and tuple(w.shape) == shape
            qmin, qmax = qrange(bits)
            assert int(w.min()) >= qmin and int(w.max()) <= qmax, name
            assert int(w.abs().max()) <= qmax  # symmetric: -2**(bits-1) is never used
        for b in (p.b_x, p.b_h):
            assert b.dtype == torch.int64 and tuple(b.shape) == (H3,)
            assert int(b.min()) >= i32min and int(b.max()) <= i32max
            if not m.bias:
                assert not b.any()
        for name, t in p.tables.items():
            assert not t.is_floating_point() and t.dtype == torch.int64, name
        assert set(p.tables) == {"r", "z", "g"}
        expected_rescales = {"Wx", "Rh", "Wx_r", "Rh_r", "Wx_z", "Rh_z", "Wx_g", "rRh_g", "zh", "zg"}
        if cfg.h_gemm is not None:  # h -> the R.h operand's grid
            expected_rescales |= {"h_gemm"}
            assert p.bits["h_gemm"] == cfg.h_gemm.bits < p.bits["h"] == cfg["h"].bits
            assert p.zp["h_gemm"].shape == () and p.scale["h_gemm"].shape == ()
        else:
            assert not {"h_gemm"} & (set(p.bits) | set(p.zp) | set(p.scale))
        if li > 0:
            expected_rescales |= {f"in_{e}" for e in range(ndir)}
        assert set(p.rescale) == expected_rescales
        for name, r in p.rescale.items():
            assert r.multiplier.dtype == torch.int64 and r.shift.dtype == torch.int64, name
            assert r.multiplier.shape == r.shift.shape
            assert int(r.multiplier.min()) >= 0 and int(r.multiplier.max()) < 2 ** 31, name
            assert int(r.shift.min()) >= 1 and int(r.shift.max()) <= 62, name
            if cfg.power_of_two:  # every multiplier is a power of two (a pure shift)
                mm = r.multiplier[r.multiplier > 0]
                assert torch.equal(mm & (mm - 1), torch.zeros_like(mm)), name
        for name, z in p.zp.items():
            bits = p.bits[name]
            assert z.dtype == torch.int64
            assert int(z.min()) >= qrange(bits)[0] and int(z.max()) <= qrange(bits)[1], name


def _expected_storage_dtype(key, config):
    """The export's storage contract: narrow integers, floats only for boundary/weight scales."""
    field = key.split(".", 2)[2]
    if field.startswith("scale.") or field in ("x_levels.scale", "x_levels.lo", "x_levels.hi"):
        return torch.float64
    if field in ("W", "R"):
        return torch.int8 if config[field].bits <= 8 else torch.int16
    if field in ("W.packed", "R.packed"):
        return torch.int32
    if field in ("W_zp_comp", "R_zp_comp"):
        return torch.int64
    return torch.int32  # biases, zero points, multipliers, shifts, tables


def test_to_dict_plain_values(case):
    m, _ = case
    d = m.export().to_dict()
    assert isinstance(d, dict) and d
    for k, v in d.items():
        assert isinstance(k, str)
        assert isinstance(v, torch.Tensor) or type(v) in (int, str), (k, type(v))
        if isinstance(v, torch.Tensor):
            assert v.dtype == _expected_storage_dtype(k, m.qconfig), (k, v.dtype)
    meta = json.loads(d["meta"])
    assert meta["format_version"] == qgru.export.FORMAT_VERSION == 2
    assert meta["num_layers"] == m.num_layers and meta["bidirectional"] == m.bidirectional
    assert meta["config"] == m.qconfig.to_dict()


def test_save_load_roundtrip_identical(case, tmp_path):
    m, _ = case
    params = m.export()
    path = tmp_path / "params.pt"
    params.save(path)
    loaded = qgru.load_params(path)
    assert loaded.meta == params.meta
    assert_dicts_identical(loaded.to_dict(), params.to_dict())
    # save(load(save(p))) is stable too
    path2 = tmp_path / "params2.pt"
    loaded.save(path2)
    assert_dicts_identical(qgru.load_params(path2).to_dict(), params.to_dict())


def test_loaded_module_bit_exact(case, tmp_path):
    m, _ = case
    path = tmp_path / "params.pt"
    m.export().save(path)
    m2 = qgru.load_params(path).to_module()
    assert m2.is_converted and m2.batch_first == m.batch_first and m2.bidirectional == m.bidirectional
    ndir = 2 if m.bidirectional else 1
    for seed, (T, N) in enumerate([(9, 4), (1, 1), (5, 2)]):
        x = make_input(m.batch_first, T, N, 100 + seed)
        o1, h1 = m(x)
        o2, h2 = m2(x)
        assert torch.equal(o1, o2) and torch.equal(h1, h2)
        assert o1.abs().sum() > 0  # not a vacuous comparison of zeros
        h0 = torch.randn(m.num_layers * ndir, N, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.5
        o1, h1 = m(x, h0)
        o2, h2 = m2(x, h0)
        assert torch.equal(o1, o2) and torch.equal(h1, h2)
    # PackedSequence input (unsorted lengths)
    x = make_input(m.batch_first, 8, 4, 200)
    lengths = torch.tensor([3, 8, 1, 5])
    packed = pack_padded_sequence(x, lengths, batch_first=m.batch_first, enforce_sorted=False)
    (p1, h1), (p2, h2) = m(packed), m2(packed)
    assert torch.equal(p1.data, p2.data) and torch.equal(h1, h2)
    assert torch.equal(p1.batch_sizes, p2.batch_sizes)
    assert torch.equal(p1.unsorted_indices, p2.unsorted_indices)


def test_loaded_module_float_weights_are_dequantized(tmp_path):
    m = build("w8a8", "multiplier", "2layer_bidir_bf")
    params = m.export()
    m2 = params.to_module()
    for li, d, p in layer_params(params):
        w_ih, w_hh = float_weights(m2, li, d)
        assert torch.allclose(w_ih, p.W.double() * p.scale["W"].unsqueeze(1), rtol=1e-6, atol=1e-7)
        assert torch.allclose(w_hh, p.R.double() * p.scale["R"].unsqueeze(1), rtol=1e-6, atol=1e-7)


def test_saved_file_loads_with_weights_only(tmp_path):
    m = build("w8a16", "pow2", "2layer_bidir_nobias")
    path = tmp_path / "params.pt"
    m.export().save(path)
    raw = torch.load(path, weights_only=True)
    assert isinstance(raw, dict)
    assert_dicts_identical(raw, m.export().to_dict())


UNPICKLED = []


def _record_unpickle(tag):
    UNPICKLED.append(tag)
    return tag


class Payload:
    """Not on torch's weights_only allowlist; unpickling it runs _record_unpickle."""

    def __reduce__(self):
        return (_record_unpickle, ("payload ran",))


def test_load_params_refuses_arbitrary_pickles(tmp_path):
    m = build("w8a8", "pow2", "1layer")
    d = m.export().to_dict()
    d["meta"] = Payload()
    path = tmp_path / "evil.pt"
    torch.save(d, path)
    UNPICKLED.clear()
    # issue 39: a ParamsFileError naming the file and the global, without torch's weights_only=False advice
    with pytest.raises(qgru.ParamsFileError, match=r"evil\.pt: refused: its pickle holds the global .*must not be "
                                                   r"loaded unsafely") as e:
        qgru.load_params(path)
    assert "will likely succeed" not in str(e.value)
    assert UNPICKLED == []
    # the payload is real: an unrestricted load would have run it
    torch.load(path, weights_only=False)
    assert UNPICKLED == ["payload ran"]
    UNPICKLED.clear()
    path2 = tmp_path / "evil2.pt"
    torch.save({"meta": Payload()}, path2)
    with pytest.raises(qgru.ParamsFileError, match=r"evil2\.pt: refused"):
        qgru.load_params(path2)
    assert UNPICKLED == []


def test_load_params_rejects_other_format_version(tmp_path):
    m = build("w8a8", "pow2", "1layer")
    d = m.export().to_dict()
    meta = json.loads(d["meta"])
    meta["format_version"] = 99
    d["meta"] = json.dumps(meta)
    path = tmp_path / "v99.pt"
    torch.save(d, path)
    with pytest.raises(ValueError):
        qgru.load_params(path)


def _nearest_rounded(m: qgru.QuantGRU, cfg: qgru.QuantConfig) -> qgru.QuantGRU:
    """``m``'s float weights converted again with weight_rounding "nearest" (same calibration data)."""
    nearest = qgru.QuantConfig.load(cfg, overrides={"weight_rounding": "nearest"})
    f = qgru.QuantGRU.from_float(m.to_float(), nearest)
    batches = [make_input(m.batch_first, 7, 3, seed) for seed in range(4)]
    qgru.calibrate(f, batches, progress=False)
    return f.convert()


def test_dequantized_weights_close_to_float(case):
    """Nearest rounding: every weight within half a step of its float value, the scales tight. The
    default (gptq) moves weights by more (qgru.convert.gptq_round; tests/test_weight_rounding.py)
    but keeps the same scales and range."""
    m_default, cfg = case
    assert cfg.weight_rounding == "gptq"
    m = _nearest_rounded(m_default, cfg)
    params = m.export()
    for (li, d, p), (_, _, p_default) in zip(layer_params(params), layer_params(m_default.export())):
        for name, q, w in zip(("W", "R"), (p.W, p.R), float_weights(m, li, d)):
            scale = p.scale[name]
            assert scale.dtype == torch.float64 and tuple(scale.shape) == (q.shape[0],)
            assert (scale > 0).all()
            assert torch.equal(p_default.scale[name], scale)
            qmax_default = qrange(cfg[name].bits)[1]
            assert int(getattr(p_default, name).abs().max()) <= qmax_default
            err = (q.double() * scale.unsqueeze(1) - w).abs()
            assert (err <= scale.unsqueeze(1) / 2 * (1 + 1e-9)).all(), (li, d, name, float(err.max()))
            # the scale is tight: the largest |w| of each scale group uses (nearly) the full range
            qmax = qrange(cfg[name].bits)[1]
            top = int(q.abs().max())
            assert top >= (qmax // 2 if cfg.power_of_two else qmax), (name, top, qmax)
            if cfg[name].granularity == "per_channel" and not cfg.power_of_two:
                assert torch.equal(q.abs().amax(1), torch.full((q.shape[0],), qmax, dtype=torch.int64))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 7])
def test_sub_8_bit_weights_are_packed_and_round_trip(bits, tmp_path):
    torch.manual_seed(bits)
    over = {"tensors": {"W": {"bits": bits}, "R": {"bits": bits}}}
    m = qgru.QuantGRU(11, 6, config=qgru.QuantConfig.load("w8a8", overrides=over))
    qgru.calibrate(m, [torch.randn(5, 3, 11) for _ in range(2)], progress=False)
    m.convert()
    d = m.export().to_dict()
    packed = d["l0.fwd.W.packed"]
    per_word = 32 // bits
    assert packed.dtype == torch.int32 and packed.shape == (18, -(-11 // per_word))
    assert "l0.fwd.W" not in d
    path = tmp_path / "p.qgru"
    m.export().save(path)
    loaded = qgru.load_params(path)
    assert torch.equal(loaded.layers[0][0].W, m._qparams[0][0].W)
    assert torch.equal(loaded.layers[0][0].R, m._qparams[0][0].R)
    x = torch.randn(4, 2, 11)
    assert torch.equal(loaded.to_module()(x)[0], m(x)[0])


# ---------------------------------------------------------------------------------------------
# h_gemm: the R.h GEMM's operand on a grid of its own (qgru/config.py OPTIONAL_TENSORS)
# ---------------------------------------------------------------------------------------------
H_GEMM_FIELDS = ("bits.h_gemm", "zp.h_gemm", "rescale.h_gemm.multiplier", "rescale.h_gemm.shift", "scale.h_gemm")


@functools.lru_cache(maxsize=None)
def build_h_gemm(config: str, scale_mode: str, arch: str = "2layer_bidir_bf") -> qgru.QuantGRU:
    """A converted h_gemm model, calibrated on the reference backend (cached: not to be modified)."""
    with qgru.backend("reference"):
        return build(config, scale_mode, arch)


def hg_entries(config="hg16_8", scale_mode="pow2"):
    return build_h_gemm(config, scale_mode).export().to_dict()


def write_entries(d, path):
    """Save a (tampered) dict as save() does, with a matching checksum (as a hostile writer would),
    so that what is tested is the checks behind the checksum."""
    d = dict(d)
    d["checksum"] = qgru.export.checksum(d)
    torch.save(d, path)
    return path


def test_h_gemm_entries_exactly_with_the_config():
    """Every layer and direction carries h_gemm's bits, zero point, rescale and scale when the config
    has h_gemm; a config without it writes the layout of files from before h_gemm existed."""
    d = hg_entries()
    for li in range(2):
        for di in ("fwd", "rev"):
            for f in H_GEMM_FIELDS:
                assert f"l{li}.{di}.{f}" in d
            assert d[f"l{li}.{di}.bits.h_gemm"] == 8 and d[f"l{li}.{di}.bits.h"] == 16
    assert "h_gemm" in json.loads(d["meta"])["config"]["tensors"]
    plain = build("w8a16", "pow2", "2layer_bidir_bf").export().to_dict()  # no h_gemm
    assert not [k for k in plain if "h_gemm" in k] and "h_gemm" not in plain["meta"]
    assert {k for k in d if "h_gemm" not in k} == set(plain)  # h_gemm adds its entries, nothing else
    default = build("w8a8", "pow2", "2layer_bidir_bf").export().to_dict()  # w8a8 ships with h_gemm
    assert default["l1.rev.bits.h_gemm"] == 8 and default["l1.rev.bits.h"] == 16


@pytest.mark.parametrize("config", list(H_GEMM))
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
def test_h_gemm_round_trip_bit_exact(config, scale_mode, tmp_path):
    m = build_h_gemm(config, scale_mode)
    params = m.export()
    params.save(tmp_path / "p.qgru")
    loaded = qgru.load_params(tmp_path / "p.qgru")
    assert_dicts_identical(loaded.to_dict(), params.to_dict())
    p = loaded.layers[1][1]
    assert p.bits["h_gemm"] == H_GEMM[config]["h_gemm"]["bits"] and "h_gemm" in p.rescale
    # the operand is not the state: the R.h GEMM reads other integers than without h_gemm
    qh = torch.arange(*qrange(p.bits["h"]), 97).unsqueeze(0)
    assert not torch.equal(qgru.golden.recurrent_operand(p, qh)[0], qh)
    with qgru.backend("reference"):
        m2 = loaded.to_module()
        for seed, (T, N) in enumerate([(9, 3), (1, 1)]):
            x = make_input(m.batch_first, T, N, 300 + seed)
            o1, h1 = m(x)
            o2, h2 = m2(x)
            assert torch.equal(o1, o2) and torch.equal(h1, h2)
            assert o1.abs().sum() > 0


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
def test_h_gemm_float_bias_read_back_at_the_operand_scale(scale_mode):
    """to_module()'s float b_hh is b_h at S_R[c] * S_h_gemm, the scale convert() put it on (S_h
    would be 2^8 times too small here): it lies within half a step of the original float bias."""
    m = build_h_gemm("hg16_8", scale_mode)
    params = m.export()
    m2 = params.to_module()
    for li, d, p in layer_params(params):
        sfx = f"_l{li}" + ("_reverse" if d else "")
        b_hh = getattr(m2, "bias_hh" + sfx).detach().double()
        step = p.scale["R"] * p.scale["h_gemm"]
        assert torch.allclose(b_hh, p.b_h.double() * step, rtol=1e-6, atol=0)
        original = getattr(m, "bias_hh" + sfx).detach().double()
        assert ((b_hh - original).abs() <= step / 2 * (1 + 1e-6) + 1e-7).all(), (li, d)
        assert original.abs().max() > 100 * step.max()  # the bias is many steps: not a vacuous test


def test_files_without_h_gemm_still_load(tmp_path):
    """A file of a config without h_gemm (the layout of every file written before it) loads and
    runs as before, in format 1 too; giving its config an h_gemm afterwards is refused."""
    m = build("w8a16", "multiplier", "2layer_bidir_bf")
    d = m.export().to_dict()
    assert not [k for k in d if "h_gemm" in k]
    x = make_input(m.batch_first, 6, 2, 400)
    for version in (2, 1):
        e = dict(d)
        if version == 1:
            del e["checksum"]
            e["meta"] = json.dumps({**json.loads(e["meta"]), "format_version": 1}, sort_keys=True)
        torch.save(e, tmp_path / f"v{version}.qgru")
        loaded = qgru.load_params(tmp_path / f"v{version}.qgru")
        assert all("h_gemm" not in p.bits and "h_gemm" not in p.rescale for _, _, p in layer_params(loaded))
        with qgru.backend("reference"):
            assert torch.equal(loaded.to_module()(x)[0], m(x)[0])
    meta = json.loads(d["meta"])
    meta["config"]["tensors"]["h_gemm"] = {"bits": 8, "symmetric": False, "granularity": "per_tensor"}
    path = write_entries({**d, "meta": json.dumps(meta)}, tmp_path / "gained.qgru")
    with pytest.raises(qgru.ParamsFileError, match=r"missing entries l0\.fwd\.bits\.h_gemm, l0\.fwd\.rescale\.h_gemm"):
        qgru.load_params(path)


def _set_entry(key, value):
    def f(d):
        d[key] = value(d) if callable(value) else value
    return f


def _scalar(v, dtype=torch.int32):
    return torch.tensor(v, dtype=dtype)


def _drop(*keys):
    def f(d):
        for k in keys:
            del d[k]
    return f


def _config(change):
    def f(d):
        meta = json.loads(d["meta"])
        change(meta["config"]["tensors"])
        d["meta"] = json.dumps(meta)
    return f


def _rowsum_R(d, pre="l0.fwd."):
    return d[pre + "R"].to(torch.int64).sum(1)


HOSTILE_H_GEMM = {  # name: (scale_mode, mutation, the error's message); model hg16_8, 2 layers, bidirectional
    # present exactly when meta.config has h_gemm
    "missing_zp": ("pow2", _drop("l1.rev.zp.h_gemm"), r"missing entry l1\.rev\.zp\.h_gemm$"),
    "missing_shift": ("pow2", _drop("l0.fwd.rescale.h_gemm.shift"), r"missing entry l0\.fwd\.rescale\.h_gemm\.shift$"),
    "missing_all": ("pow2", _drop(*[f"l0.rev.{f}" for f in H_GEMM_FIELDS]),
                    r"missing entries l0\.rev\.bits\.h_gemm, l0\.rev\.rescale\.h_gemm\.multiplier, "
                    r"l0\.rev\.rescale\.h_gemm\.shift, l0\.rev\.scale\.h_gemm, l0\.rev\.zp\.h_gemm$"),
    "config_without": ("pow2", _config(lambda t: t.pop("h_gemm")), r"unexpected entries l0\.fwd\.bits\.h_gemm, "),
    "config_wider_than_h": ("pow2", _config(lambda t: t["h"].update(bits=6)),
                            r"meta\.config\.tensors\.h_gemm: the R\.h operand \(8 bits\) .* more than h \(6\)"),
    # bits
    "bits": ("pow2", _set_entry("l1.fwd.bits.h_gemm", 7), r"l1\.fwd\.bits\.h_gemm: 7, but meta\.config\.tensors\.h_gemm\.bits is 8"),
    "bits_str": ("pow2", _set_entry("l0.fwd.bits.h_gemm", "8"), r"l0\.fwd\.bits\.h_gemm: expected an int, got str"),
    # the zero point: on h_gemm's grid, per tensor, int32, 0 when symmetric
    "zp_off_grid": ("pow2", _set_entry("l0.fwd.zp.h_gemm", _scalar(200)), r"l0\.fwd\.zp\.h_gemm: 200 is outside \[-128, 127\]"),
    "zp_on_h_grid_only": ("multiplier", _set_entry("l0.fwd.zp.h_gemm", _scalar(-1000)), r"zp\.h_gemm: -1000 is outside \[-128, 127\]"),
    "zp_shape": ("pow2", _set_entry("l0.fwd.zp.h_gemm", lambda d: d["l0.fwd.zp.h_gemm"].reshape(1)),
                 r"l0\.fwd\.zp\.h_gemm: expected shape \(\), got \(1,\)"),
    "zp_dtype": ("pow2", _set_entry("l0.fwd.zp.h_gemm", lambda d: d["l0.fwd.zp.h_gemm"].to(torch.int64)),
                 r"l0\.fwd\.zp\.h_gemm: expected a torch\.int32 tensor, got torch\.int64"),
    "zp_symmetric": ("pow2", _config(lambda t: t["h_gemm"].update(symmetric=True)),
                     r"zp\.h_gemm: -?[1-9][0-9]*, but h_gemm is symmetric \(meta\.config\): zero point 0"),
    # R_zp_comp caches Z_h_gemm * rowsum(R), not Z_h * rowsum(R)
    "R_zp_comp_stale": ("pow2", _set_entry("l0.fwd.zp.h_gemm", lambda d: d["l0.fwd.zp.h_gemm"] + 1),
                        r"l0\.fwd\.R_zp_comp: differs from zp\.h_gemm \* rowsum\(R\), the value it caches"),
    "R_zp_comp_of_h": ("multiplier", _set_entry("l0.fwd.R_zp_comp", lambda d: d["l0.fwd.zp.h"].to(torch.int64) * _rowsum_R(d)),
                       r"l0\.fwd\.R_zp_comp: differs from zp\.h_gemm \* rowsum\(R\)"),
    # the rescale h -> h_gemm: per tensor, its multiplier within its bound, its shift in [1, 62]
    "multiplier_negative": ("multiplier", _set_entry("l1.rev.rescale.h_gemm.multiplier", _scalar(-3)),
                            r"l1\.rev\.rescale\.h_gemm\.multiplier: -3 is outside \[0, 2147483647\]"),
    "multiplier_not_pow2": ("pow2", _set_entry("l0.fwd.rescale.h_gemm.multiplier", _scalar(3 << 20)),
                            r"rescale\.h_gemm\.multiplier: 3145728 is not a power of two"),
    "multiplier_shape": ("multiplier", _set_entry("l0.fwd.rescale.h_gemm.multiplier", lambda d: d["l0.fwd.rescale.h_gemm.multiplier"].repeat(2)),
                         r"rescale\.h_gemm\.multiplier: expected shape \(\) or \(1,\), got \(2,\)"),
    "shift_shape": ("multiplier", _set_entry("l0.fwd.rescale.h_gemm.shift", lambda d: d["l0.fwd.rescale.h_gemm.shift"].reshape(1)),
                    r"rescale\.h_gemm\.shift: expected shape \(\), got \(1,\)"),
    "shift_0": ("pow2", _set_entry("l0.fwd.rescale.h_gemm.shift", _scalar(0)), r"l0\.fwd\.rescale\.h_gemm\.shift: 0 is outside \[1, 62\]"),
    "shift_63": ("multiplier", _set_entry("l1.fwd.rescale.h_gemm.shift", _scalar(63)), r"l1\.fwd\.rescale\.h_gemm\.shift: 63 is outside \[1, 62\]"),
    "shift_dtype": ("pow2", _set_entry("l0.fwd.rescale.h_gemm.shift", lambda d: d["l0.fwd.rescale.h_gemm.shift"].to(torch.int16)),
                    r"rescale\.h_gemm\.shift: expected a torch\.int32 tensor, got torch\.int16"),
    # the scale: float64, per tensor, positive and finite, within calibration's reach, pow2 in pow2 mode
    "scale_negative": ("multiplier", _set_entry("l0.fwd.scale.h_gemm", _scalar(-0.5, torch.float64)),
                       r"l0\.fwd\.scale\.h_gemm: scales are positive and finite"),
    "scale_nan": ("pow2", _set_entry("l0.fwd.scale.h_gemm", _scalar(float("nan"), torch.float64)), r"scale\.h_gemm: scales are positive and finite"),
    "scale_huge": ("multiplier", _set_entry("l0.fwd.scale.h_gemm", _scalar(1e300, torch.float64)),
                   r"scale\.h_gemm: 1e\+300: the grid's end value .* beyond float32's largest value"),
    "scale_not_pow2": ("pow2", _set_entry("l0.fwd.scale.h_gemm", lambda d: d["l0.fwd.scale.h_gemm"] * 1.5),
                       r"scale\.h_gemm: not a power of two"),
    "scale_shape": ("pow2", _set_entry("l0.fwd.scale.h_gemm", lambda d: d["l0.fwd.scale.h_gemm"].reshape(1)),
                    r"scale\.h_gemm: expected shape \(\), got \(1,\)"),
    "scale_float32": ("pow2", _set_entry("l0.fwd.scale.h_gemm", lambda d: d["l0.fwd.scale.h_gemm"].float()),
                      r"l0\.fwd\.scale\.h_gemm: a torch\.float32 tensor"),
}


@pytest.mark.parametrize("case", list(HOSTILE_H_GEMM))
def test_h_gemm_crafted_file_is_refused_naming_the_field(case, tmp_path):
    scale_mode, mutate, message = HOSTILE_H_GEMM[case]
    d = hg_entries("hg16_8", scale_mode)
    mutate(d)
    path = write_entries(d, tmp_path / "crafted.qgru")
    with pytest.raises(qgru.ParamsFileError, match=message) as e:
        qgru.load_params(path)
    assert str(e.value).startswith(str(path))


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
def test_h_gemm_untampered_files_load(scale_mode, tmp_path):
    """The checks above refuse only what is wrong: the untampered files load (and hg16_8's zero point
    is nonzero, which zp_symmetric needs)."""
    d = hg_entries("hg16_8", scale_mode)
    assert int(d["l0.fwd.zp.h_gemm"]) != 0
    qgru.load_params(write_entries(d, tmp_path / "ok.qgru"))


def test_h_gemm_in_memory_params_are_validated():
    """QuantParams built in memory: h_gemm's dicts must match the config like a file's entries."""
    params = copy.deepcopy(build_h_gemm("hg16_8", "multiplier").export())
    del params.layers[0][1].zp["h_gemm"]
    with pytest.raises(qgru.ParamsFileError, match=r"l0\.rev\.zp: expected the entries x, h, .*, h_gemm, got"):
        params.validate()
    params = copy.deepcopy(build("w8a16", "multiplier", "2layer_bidir_bf").export())
    params.layers[1][0].bits["h_gemm"] = 8  # a config without h_gemm
    with pytest.raises(qgru.ParamsFileError, match=r"l1\.fwd\.bits: expected the entries x, h, W, .*, g, got"):
        params.to_module()
    params = copy.deepcopy(build_h_gemm("hg12_6", "multiplier").export())
    params.layers[1][1].R_zp_comp = params.layers[1][1].zp["h"] * params.layers[1][1].R.sum(1)
    with pytest.raises(qgru.ParamsFileError, match=r"l1\.rev\.R_zp_comp: differs from zp\.h_gemm"):
        params.validate()
