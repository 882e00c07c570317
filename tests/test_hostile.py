"""Hostile and careless use (issue 16): crafted and corrupted parameter files, copies and pickles of
models that ran on a native backend, lazy views (negative / conjugate bits), drop-in exceptions,
unclear errors of calibration and of the command lines.

Every test here failed before its fix (see the commit that added it)."""
from __future__ import annotations

import copy
import io
import json
import pickle
import zipfile

import pytest
import torch
from torch import nn

import qgru
from qgru import export, native

I, H = 3, 4


def calib_batches(n=2, seed=0, T=5, N=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, N, I, generator=g) for _ in range(n)]


def converted(config="w8a8", seed=0, **kw) -> qgru.QuantGRU:
    torch.manual_seed(seed)
    m = qgru.QuantGRU(I, H, config=config, **kw)
    qgru.calibrate(m, calib_batches(), progress=False)
    return m.convert()


def _device(name: str) -> torch.device:
    return torch.device("cuda" if name == "cuda" else "cpu")


@pytest.fixture(params=["reference", "cpu", "cuda"])
def backend_name(request):
    """Every backend; a native one is skipped, with the registry's reason, where unavailable."""
    why = qgru.backends()[request.param]["why"]
    if why:
        pytest.skip(f"{request.param} backend unavailable: {why}")
    return request.param


@pytest.fixture
def cpu_backend():
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")
    return "cpu"


def _native_layers(m: qgru.QuantGRU):
    return [layer for rows in m._qparams_on.values() for row in rows for p in row
            for layer in p.__dict__.get("_native", {}).values()]


# =============================================================================================
# 2. Copies and pickles of a model that ran on a native backend
# =============================================================================================
class TestCopies:
    def _ran(self, backend_name):
        m = converted(num_layers=2, bidirectional=True).to(_device(backend_name))
        x = torch.randn(6, 3, I, device=_device(backend_name))
        with qgru.backend(backend_name):
            out, h = m(x)
        if backend_name != "reference":
            assert _native_layers(m), "the native backend made no Layer: the test would be vacuous"
        return m, x, out, h

    def test_deepcopy_after_forward(self, backend_name):
        m, x, out, h = self._ran(backend_name)
        m2 = copy.deepcopy(m)
        assert not _native_layers(m2)  # the cache is not copied, the copy makes its own
        with qgru.backend(backend_name):
            out2, h2 = m2(x)
            out1, h1 = m(x)  # the original still runs, on its own cache
        assert torch.equal(out, out2) and torch.equal(h, h2)
        assert torch.equal(out, out1) and torch.equal(h, h1)
        if backend_name != "reference":
            assert _native_layers(m2)
            assert not {id(a) for a in _native_layers(m2)} & {id(a) for a in _native_layers(m)}

    def test_pickle_and_torch_save_after_forward(self, backend_name):
        m, x, out, h = self._ran(backend_name)
        for m2 in (pickle.loads(pickle.dumps(m)), self._torch_roundtrip(m)):
            with qgru.backend(backend_name):
                out2, h2 = m2(x)
            assert torch.equal(out, out2) and torch.equal(h, h2)

    @staticmethod
    def _torch_roundtrip(m):
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    def test_export_copy_and_pickle_after_forward(self, backend_name, tmp_path):
        m, x, out, _ = self._ran(backend_name)
        params = m.export()
        for p2 in (copy.deepcopy(params), pickle.loads(pickle.dumps(params)), copy.copy(params)):
            assert p2.meta == params.meta
            m2 = p2.to_module().to(_device(backend_name))
            with qgru.backend(backend_name):
                assert torch.equal(m2(x)[0], out)

    def test_quantize_model_with_a_used_quantgru(self, backend_name):
        """quantize_model deep-copies: a converted QuantGRU that ran is copied and kept as it is,
        the float nn.GRU next to it is quantized."""
        enc, x, _, _ = self._ran(backend_name)

        class EncDec(nn.Module):
            def __init__(self):
                super().__init__()
                self.enc = enc
                self.dec = nn.GRU(2 * H, H)

            def forward(self, v):
                return self.dec(self.enc(v)[0])

        model = EncDec().to(_device(backend_name))
        with qgru.backend(backend_name):
            q = qgru.quantize_model(model, [x, x * 0.5], progress=False)
            assert isinstance(q.dec, qgru.QuantGRU) and q.dec.is_converted
            assert q.enc is not enc and q.enc.is_converted
            assert torch.equal(q.enc(x)[0], enc(x)[0])
            out, _ = q(x)
        assert out.shape == (6, 3, H) and torch.isfinite(out).all()
        assert isinstance(model.dec, nn.GRU) and not isinstance(model.dec, qgru.QuantGRU)  # untouched

    def test_quantize_model_with_only_converted_quantgrus(self):
        with pytest.raises(ValueError, match=r"no torch\.nn\.GRU to quantize"):
            qgru.quantize_model(nn.Sequential(converted()), calib_batches(), progress=False)


# =============================================================================================
# 3. Negative and conjugate views: the values torch reads, on every backend
# =============================================================================================
def _neg_view(v: torch.Tensor) -> torch.Tensor:
    """-v as a lazy view: the memory holds v, the negative bit says "negate when read"."""
    w = torch._neg_view(v)
    assert w.is_neg() and w.is_contiguous()
    return w


class TestLazyViews:
    @pytest.mark.parametrize("where", ["x", "h0", "both"])
    def test_negative_view_is_read_negated(self, backend_name, where):
        make_view = _neg_view
        dev = _device(backend_name)
        m = converted(num_layers=2, bidirectional=True).to(dev)
        g = torch.Generator().manual_seed(3)
        x = (torch.randn(5, 2, I, generator=g) * 1.5).to(dev)
        h0 = (torch.randn(4, 2, H, generator=g) * 0.5).to(dev)
        xv = make_view(-x) if where in ("x", "both") else x
        hv = make_view(-h0) if where in ("h0", "both") else h0
        assert torch.equal(xv, x) and torch.equal(hv, h0)  # torch reads the same values
        with qgru.backend(backend_name):
            want = m(x, h0)
            got = m(xv, hv)
            stored = m(-x if where != "h0" else x, -h0 if where != "x" else h0)  # what ignoring the bit reads
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert not torch.equal(stored[0], want[0])  # the view's memory differs: not a vacuous test

    def test_conj_imag_view(self, backend_name):
        """The issue's example: x.conj().imag of a one-element complex tensor is a contiguous
        negative view (-1.3 stored as 1.3), for x and for h0."""
        dev = _device(backend_name)
        torch.manual_seed(0)
        m = qgru.QuantGRU(1, 1)
        qgru.calibrate(m, [torch.randn(3, 2, 1) * 2], progress=False)
        m = m.convert().to(dev)
        v = torch.tensor([[[0.7 + 1.3j]]], device=dev).conj().imag
        assert v.is_neg() and v.is_contiguous() and float(v) == pytest.approx(-1.3)
        plain = torch.tensor([[[-1.3]]], device=dev)
        with qgru.backend(backend_name):
            want, stored = m(plain, plain), m(-plain, -plain)
            for got in (m(v, v), m(v, plain), m(plain, v)):
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert not torch.equal(stored[0], want[0])

    def test_negative_view_unbatched_and_float_mode(self, backend_name):
        dev = _device(backend_name)
        x = torch.randn(5, I).to(dev)
        m = converted().to(dev)
        with qgru.backend(backend_name):
            assert torch.equal(m(_neg_view(-x))[0], m(x)[0])
        torch.manual_seed(0)
        f = qgru.QuantGRU(I, H).to(dev)  # float mode: nn.GRU's own kernels
        assert torch.equal(f(_neg_view(-x))[0], f(x)[0])

    def test_native_entry_points_resolve_views(self, cpu_backend):
        """The boundary ops and gru_direction of the cpu backend, called directly."""
        from qgru.backends import current_backend
        m = converted()
        p = m._qparams[0][0]
        with qgru.backend("cpu"):
            ops = current_backend("cpu").boundary
            x = torch.randn(4, 2, I)
            q = ops.quantize(x, p.scale["x"], p.zp["x"], p.bits["x"], "input")
            assert torch.equal(ops.quantize(_neg_view(-x), p.scale["x"], p.zp["x"], p.bits["x"], "input"), q)
            assert torch.equal(ops.dequantize(_neg_view(-q), p.scale["x"], p.zp["x"]),
                               ops.dequantize(q, p.scale["x"], p.zp["x"]))
            qh0 = torch.zeros(2, H, dtype=torch.int32) + p.zp["h"].to(torch.int32) + 3
            run = native.gru_direction("cpu")
            want = [v.clone() for v in run(p, q, qh0)]
            got = run(p, _neg_view(-q), _neg_view(-qh0))
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# =============================================================================================
# 1, 4, 5. Parameter files: crafted, corrupted, truncated, not a qgru file at all
# =============================================================================================
_MODELS = {}


def _model(name="2layer"):
    """Converted models whose exports the file tests tamper with (cached: not modified)."""
    if name not in _MODELS:
        if name == "2layer":
            # pow2 (w8a8's default is multiplier): the power-of-two checks below need pow2 files
            _MODELS[name] = converted(config=qgru.QuantConfig.load("w8a8", overrides={"scale_mode": "pow2"}),
                                      num_layers=2, bidirectional=True)
        elif name == "wide":  # 12-bit W (int16 storage), per-channel Wx, multiplier mode, 6-bit R (packed)
            cfg = qgru.QuantConfig.load("w8a16", overrides={"scale_mode": "multiplier", "tensors": {
                "W": {"bits": 12}, "R": {"bits": 6}, "Wx": {"granularity": "per_channel"}}})
            _MODELS[name] = converted(config=cfg)
        else:
            raise KeyError(name)
    return _MODELS[name]


def _entries(name="2layer"):
    return _model(name).export().to_dict()


def _write(d, path, resign=True):
    """Save a (tampered) dict the way save() does; resign: with a matching checksum, as a hostile
    writer would make it (so that the checks behind the checksum are what is tested)."""
    d = dict(d)
    if resign:
        d["checksum"] = export.checksum(d)
    torch.save(d, path)
    return path


def _set(key, value):
    def f(d):
        d[key] = value(d[key]) if callable(value) else value
    return f


def _meta(**changes):
    def f(d):
        meta = json.loads(d["meta"])
        for k, v in changes.items():
            if callable(v):
                v(meta)
            else:
                meta[k] = v
        d["meta"] = json.dumps(meta)
    return f


def _edit(key, index, value):
    def f(d):
        t = d[key].clone()
        t.view(-1)[index] = value
        d[key] = t
    return f


def _cfg_bits(tensor, bits):
    def f(meta):
        meta["config"]["tensors"][tensor]["bits"] = bits
    return f


i32 = torch.int32
HOSTILE = {  # name: (model, mutation, the error's message)
    # the cases
    "table_len_1": ("2layer", _set("l0.fwd.tables.r", lambda t: t[:1]), r"l0\.fwd\.tables\.r: expected shape \(1025,\), got \(1,\)"),
    "table_len_2": ("2layer", _set("l0.fwd.tables.r", lambda t: t[:2]), r"l0\.fwd\.tables\.r: expected shape"),
    "table_len_100": ("2layer", _set("l1.rev.tables.g", lambda t: t[:100]), r"l1\.rev\.tables\.g: expected shape"),
    "table_too_long": ("2layer", _set("l0.fwd.tables.z", lambda t: torch.cat([t, t])), r"tables\.z: expected shape"),
    "table_entry": ("2layer", _edit("l0.fwd.tables.g", 7, 1 << 24), r"tables\.g: 16777216 is outside \[-1048576, 1048576\]"),
    "bits_x_24": ("2layer", _set("l0.fwd.bits.x", 24), r"l0\.fwd\.bits\.x: 24, but meta\.config\.tensors\.x\.bits is 8"),
    "bits_h_32": ("2layer", _set("l1.fwd.bits.h", 32), r"l1\.fwd\.bits\.h: 32"),
    "config_bits_24": ("2layer", _meta(config=_cfg_bits("x", 24)), r"meta\.config\.tensors\.x: bits must be an integer in \[2, 16\]"),
    "shift_0": ("2layer", _set("l0.fwd.rescale.zh.shift", torch.tensor(0, dtype=i32)), r"rescale\.zh\.shift: 0 is outside \[1, 62\]"),
    "shift_-5": ("2layer", _edit("l0.rev.rescale.Wx.shift", 3, -5), r"l0\.rev\.rescale\.Wx\.shift: -5 is outside \[1, 62\]"),
    "shift_63": ("2layer", _edit("l1.fwd.rescale.Rh_z.shift", 0, 63), r"rescale\.Rh_z\.shift: 63 is outside"),
    # multipliers: the bound that keeps the int64 product exact, non-negative, pow2 mode
    "multiplier_wide": ("2layer", _edit("l0.fwd.rescale.Wx.multiplier", 0, (1 << 31) - 1), r"rescale\.Wx\.multiplier: 2147483647 is outside \[0, 1073741823\]"),
    "multiplier_negative": ("wide", _edit("l0.fwd.rescale.zg.multiplier", 0, -3), r"rescale\.zg\.multiplier: -3 is outside"),
    "multiplier_not_pow2": ("2layer", _edit("l0.fwd.rescale.Wx_r.multiplier", 0, 3 << 20), r"rescale\.Wx_r\.multiplier: 3145728 is not a power of two"),
    "rescale_shape": ("2layer", _set("l0.fwd.rescale.Rh.multiplier", lambda t: t[:5]), r"rescale\.Rh\.multiplier: expected shape \(\) or \(12,\), got \(5,\)"),
    # zero points within their grids, fixed ones fixed
    "zp_x_off_grid": ("2layer", _set("l0.fwd.zp.x", torch.tensor(200, dtype=i32)), r"l0\.fwd\.zp\.x: 200 is outside \[-128, 127\]"),
    "zp_Wx_off_grid": ("2layer", _edit("l0.fwd.zp.Wx", 2, 40000), r"zp\.Wx: 40000 is outside \[-32768, 32767\]"),
    "zp_r_not_qmin": ("2layer", _set("l0.fwd.zp.r", torch.tensor(0, dtype=i32)), r"zp\.r: 0, but the sigmoid output grid of 16 bits has zero point -32768"),
    "zp_W_symmetric": ("wide", _meta(config=lambda c: c["config"]["tensors"]["x"].update(symmetric=True)), r"zp\.x: .*symmetric"),
    "one_z": ("2layer", _set("l0.fwd.one_z", 12345), r"one_z: 12345, but 1\.0 on z's 16-bit grid is 65536"),
    # weights: dtype, shape, range
    "W_dtype": ("2layer", _set("l0.fwd.W", lambda t: t.to(torch.int16)), r"l0\.fwd\.W: expected a torch\.int8 tensor, got torch\.int16"),
    "W_shape": ("2layer", _set("l0.fwd.W", lambda t: t.t().contiguous()), r"l0\.fwd\.W: expected shape \(12, 3\), got \(3, 12\)"),
    "W_12bit_range": ("wide", _edit("l0.fwd.W", 4, 4000), r"l0\.fwd\.W: 4000 is outside \[-2048, 2047\]"),
    "R_packed_words": ("wide", _set("l0.fwd.R.packed", lambda t: torch.cat([t, t], 1)), r"R\.packed: 2 words per row cannot hold 4 6-bit weights"),
    "b_x_dtype": ("2layer", _set("l0.fwd.b_x", lambda t: t.to(torch.int64)), r"b_x: expected a torch\.int32 tensor, got torch\.int64"),
    # consistency between cached values, and with the meta data
    "W_zp_comp": ("2layer", _edit("l0.fwd.W_zp_comp", 1, 17), r"W_zp_comp: differs from zp\.x \* rowsum\(W\)"),
    "bias_false": ("2layer", _meta(bias=False), r"l0\.fwd\.b_x: nonzero, but meta\.bias is false"),
    "input_size": ("2layer", _meta(input_size=5), r"l0\.fwd\.input_size: 3, but the meta data make it 5"),
    "hidden_entry": ("2layer", _set("l1.rev.hidden_size", 5), r"l1\.rev\.hidden_size: 5, but the meta data make it 4"),
    # scales
    "scale_negative": ("2layer", _set("l0.fwd.scale.x", torch.tensor(-0.5, dtype=torch.float64)), r"scale\.x: scales are positive and finite"),
    "scale_nan": ("2layer", _edit("l0.fwd.scale.W", 0, float("nan")), r"scale\.W: scales are positive and finite"),
    "scale_tiny": ("wide", _set("l0.fwd.scale.h", torch.tensor(1e-300, dtype=torch.float64)), r"scale\.h: 1e-300 is below 2\^-64"),
    "scale_not_pow2": ("2layer", _set("l0.fwd.scale.h", lambda t: t * 1.5), r"scale\.h: not a power of two"),
    "scale_float32": ("2layer", _set("l0.fwd.scale.x", lambda t: t.float()), r"l0\.fwd\.scale\.x: a torch\.float32 tensor"),
    # entries: missing, extra, layers and directions that meta does not describe
    "missing_tensor": ("2layer", lambda d: d.pop("l0.fwd.W"), r"missing entry l0\.fwd\.W$"),
    "extra_entry": ("2layer", _set("l0.fwd.evil", torch.zeros(3, dtype=torch.int32)), r"unexpected entry l0\.fwd\.evil"),
    "unknown_entry": ("2layer", _set("payload", "x"), r"unexpected entry 'payload'"),
    "layers_10000": ("2layer", _meta(num_layers=10000), r"meta\.num_layers is 10000, but the file holds the parameters of 2 layer\(s\) \(0, 1\)"),
    "layers_1_of_2": ("2layer", _meta(num_layers=1), r"meta\.num_layers is 1, but the file holds the parameters of 2 layer"),
    "not_bidirectional": ("2layer", _meta(bidirectional=False), r"meta\.bidirectional is false, but the file holds reverse"),
    "bidirectional": ("wide", _meta(bidirectional=True), r"missing entries l0\.rev\."),
    # meta data
    "meta_unknown_key": ("2layer", _meta(evil=1), r"meta: unknown key\(s\) evil"),
    "meta_not_json": ("2layer", _set("meta", "{not json"), r"meta: not valid JSON"),
    "meta_hidden_str": ("2layer", _meta(hidden_size="4"), r"meta\.hidden_size: expected an integer"),
    "meta_bias_int": ("2layer", _meta(bias=1), r"meta\.bias: expected true or false, got 1"),
    "version_99": ("2layer", _meta(format_version=99), r"meta\.format_version: unsupported qgru params format 99"),
    "float_entry": ("2layer", _set("l0.fwd.one_z", 1.5), r"l0\.fwd\.one_z: a float"),
}


class TestParamFiles:
    @pytest.mark.parametrize("case", list(HOSTILE))
    def test_crafted_file_is_refused_naming_the_field(self, case, tmp_path):
        model, mutate, message = HOSTILE[case]
        d = _entries(model)
        mutate(d)
        path = _write(d, tmp_path / "crafted.qgru")
        with pytest.raises(qgru.ParamsFileError, match=message) as e:
            qgru.load_params(path)
        assert str(e.value).startswith(str(path))
        with pytest.raises(qgru.ParamsFileError, match=message):  # the dict as well as the file
            qgru.QuantParams.from_dict(torch.load(path, weights_only=True))

    @pytest.mark.parametrize("model", ["2layer", "wide"])
    def test_untampered_files_load(self, model, tmp_path):
        """The checks refuse only what is wrong (the cases above are not refused for another reason)."""
        m = _model(model)
        path = _write(_entries(model), tmp_path / "ok.qgru")
        x = torch.randn(4, 2, I)
        assert torch.equal(qgru.load_params(path).to_module()(x)[0], m(x)[0])

    def test_in_memory_params_are_validated_by_to_module(self):
        """QuantParams built in memory (not through a file) are checked before a module runs them."""
        params = copy.deepcopy(_model().export())
        params.layers[0][0].tables["r"] = params.layers[0][0].tables["r"][:1]
        with pytest.raises(qgru.ParamsFileError, match=r"l0\.fwd\.tables\.r: expected shape"):
            params.to_module()

    def test_checksum_catches_an_edit_the_checks_allow(self, tmp_path):
        """A bias changed by one: inside every range, so only the checksum can tell."""
        d = _entries()
        d["l0.fwd.b_x"] = d["l0.fwd.b_x"].clone()
        d["l0.fwd.b_x"][0] += 1
        if "l0.fwd.x_levels.b_x" in d:  # x levels: level 0 is the static grid, b_x with it
            d["l0.fwd.x_levels.b_x"] = d["l0.fwd.x_levels.b_x"].clone()
            d["l0.fwd.x_levels.b_x"][0, 0] += 1
        _write(d, tmp_path / "resigned.qgru")
        qgru.load_params(tmp_path / "resigned.qgru")  # valid parameters, just other ones
        torch.save(d, tmp_path / "edited.qgru")  # the old checksum
        with pytest.raises(qgru.ParamsFileError, match="checksum mismatch"):
            qgru.load_params(tmp_path / "edited.qgru")

    def test_format_1_files_still_load(self, tmp_path):
        """Files of format 1 (before the checksum) load, with every other check."""
        m = _model()
        d = _entries()
        del d["checksum"]
        d["meta"] = json.dumps({**json.loads(d["meta"]), "format_version": 1}, sort_keys=True)
        torch.save(d, tmp_path / "v1.qgru")
        x = torch.randn(4, 2, I)
        loaded = qgru.load_params(tmp_path / "v1.qgru")
        assert torch.equal(loaded.to_module()(x)[0], m(x)[0])
        assert json.loads(loaded.to_dict()["meta"])["format_version"] == 2  # saved again: the current format
        d["l0.fwd.tables.r"] = d["l0.fwd.tables.r"][:1]
        torch.save(d, tmp_path / "v1bad.qgru")
        with pytest.raises(qgru.ParamsFileError, match="tables.r"):
            qgru.load_params(tmp_path / "v1bad.qgru")
        d["checksum"] = "sha256:0"
        torch.save(d, tmp_path / "v1sum.qgru")
        with pytest.raises(qgru.ParamsFileError, match="unexpected entry 'checksum' in a format 1 file"):
            qgru.load_params(tmp_path / "v1sum.qgru")

    def test_missing_checksum(self, tmp_path):
        d = _entries()
        del d["checksum"]
        torch.save(d, tmp_path / "nosum.qgru")
        with pytest.raises(qgru.ParamsFileError, match="missing entry 'checksum'"):
            qgru.load_params(tmp_path / "nosum.qgru")

    def test_flipped_byte_in_a_tensor_record(self, tmp_path):
        """The issue's case: one byte of a tensor's data changed; zipfile sees the CRC mismatch."""
        path = tmp_path / "p.qgru"
        _model().export().save(path)
        with zipfile.ZipFile(path) as z:
            info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size >= 8)
        raw = bytearray(path.read_bytes())
        local = info.header_offset  # the local header: name and extra field lengths at 26 and 28
        start = local + 30 + int.from_bytes(raw[local + 26:local + 28], "little") + \
            int.from_bytes(raw[local + 28:local + 30], "little")
        with zipfile.ZipFile(path) as z:
            assert z.read(info.filename) == bytes(raw[start:start + info.file_size])  # the record's data
        raw[start + 1] ^= 0x40
        path.write_bytes(bytes(raw))
        with pytest.raises(qgru.ParamsFileError, match=r"corrupted: record '.*/data/.*' fails its CRC check"):
            qgru.load_params(path)

    def test_random_corruptions_never_load_silently(self, tmp_path):
        """200 random 4-byte corruptions: each is refused, or loads the very same parameters (a
        byte that no reader looks at, e.g. a zip timestamp or alignment padding)."""
        import random
        path = tmp_path / "p.qgru"
        _model().export().save(path)
        good = path.read_bytes()
        want = _entries()
        rng = random.Random(16)
        refused = 0
        for _ in range(200):
            raw = bytearray(good)
            pos = rng.randrange(len(raw) - 4)
            raw[pos:pos + 4] = bytes(rng.randrange(256) for _ in range(4))
            if raw == good:
                continue
            path.write_bytes(bytes(raw))
            try:
                got = qgru.load_params(path).to_dict()
            except (qgru.ParamsFileError, pickle.UnpicklingError):
                refused += 1
                continue
            assert got.keys() == want.keys(), pos
            for k in want:
                assert (torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]), (pos, k)
        assert refused >= 150  # nearly every byte is data, covered by a CRC

    @pytest.mark.parametrize("what", ["truncated", "empty", "text", "zip_of_something_else", "pickle"])
    def test_not_a_parameter_file(self, what, tmp_path):
        path = tmp_path / "f.qgru"
        if what in ("truncated", "empty"):
            _model().export().save(path)
            raw = path.read_bytes()
            path.write_bytes(raw[:len(raw) // 2] if what == "truncated" else b"")
            message = r"not a readable zip archive.*truncated or damaged"
        elif what == "text":
            path.write_text("hello, this is a text file\n" * 20)
            message = r"not a readable zip archive"
        elif what == "zip_of_something_else":
            with zipfile.ZipFile(path, "w") as z:
                z.writestr("readme.txt", "hello")
            message = r"not a readable qgru parameter file"
        else:
            torch.save([1, 2, 3], path)
            message = r"expected the dict of entries QuantParams\.save\(\) writes, got list"
        with pytest.raises(qgru.ParamsFileError, match=message) as e:
            qgru.load_params(path)
        assert str(path) in str(e.value)

    def test_missing_file(self, tmp_path):
        with pytest.raises(FileNotFoundError):
            qgru.load_params(tmp_path / "nope.qgru")


# =============================================================================================
# 1. Native layer preparation checks what it is handed (csrc/qgru_layer.h, LayerTensors::validate)
# =============================================================================================
# Run in a child process: without the checks some of these cases crash the process (a table of one
# entry) or read memory they do not own.
_NATIVE_CASES = r'''
import json, sys, torch, qgru
from qgru import native
from qgru.golden import LayerParams

def converted(config):
    torch.manual_seed(0)
    m = qgru.QuantGRU(3, 4, config=config)
    qgru.calibrate(m, [torch.randn(5, 2, 3) for _ in range(2)], progress=False)
    return m.convert()

mod = native.load("cpu")
# pow2, as these layouts were written for (w8a8 and w8a16 default to multiplier scales)
base = {name: converted(qgru.QuantConfig.load(name, overrides={"scale_mode": "pow2"}))._qparams[0][0]
        for name in ("w8a8", "w8a16")}
# 8-bit W.x and R.h too: the int32 path (c32_channels, Wx_rshift, ...)
base["int32"] = converted(qgru.QuantConfig.load("w8a8", overrides={"scale_mode": "pow2", "tensors": {
    "Wx": {"bits": 8, "headroom": 1.0}, "Rh": {"bits": 8, "headroom": 1.0}}}))._qparams[0][0]
assert native.prepare_layer(base["int32"])[1]["acc32"] == 1
# w8a8's default multiplier scales: the int32 path's multiplier form
base["int32m"] = converted(qgru.QuantConfig.load("w8a8"))._qparams[0][0]
assert native.prepare_layer(base["int32m"])[1]["acc32"] == 1

def cut(k, n):
    return lambda t, v: t.__setitem__(k, t[k][:n].clone())

def setv(k, x):
    return lambda t, v: v.__setitem__(k, x)

def edit(k, i, x):
    def f(t, v):
        t[k] = t[k].clone()
        t[k].view(-1)[i] = x
    return f

def narrow_k(k):
    return lambda t, v: t.__setitem__(k, t[k][:, :, :1].contiguous())

def drop(k):
    return lambda t, v: t.pop(k)

CASES = {
    "table_0": ("w8a8", cut("table_r", 0)), "table_2": ("w8a8", cut("table_r", 2)),
    "table_100": ("w8a8", cut("table_g", 100)), "table_long": ("w8a8", lambda t, v: t.__setitem__("table_z", torch.cat([t["table_z"], t["table_z"]]))),
    "table_entry": ("w8a8", edit("table_g", 3, 1 << 25)), "table_k": ("w8a8", setv("r_table_k", 20)),
    "x_bits_24": ("w8a8", setv("x_bits", 24)), "h_bits_32": ("w8a16", setv("h_bits", 32)),
    "shift_0": ("w8a8", edit("zh_shift", 0, 0)), "shift_-5": ("w8a16", edit("Wx_shift", 2, -5)),
    "mult_wide": ("w8a16", edit("r_from_wx_mult", 1, 1 << 40)), "log2_neg_pow2": ("w8a8", edit("zg_mult_log2", 0, -1)),
    "limbs_short_K": ("w8a8", narrow_k("x_weight_limbs")), "pairs_limb": ("w8a8", edit("h_pairs", 0, 1)),
    "bias_short": ("w8a16", cut("Rh_bias", 5)), "zp_off_range": ("w8a16", edit("Wx_zp", 0, 1 << 20)),
    "range_wide": ("w8a8", setv("r_pre_lo", -40000)), "ones_col": ("w8a16", lambda t, v: v.__setitem__("ones_col", v["M_pad"])),
    "M_pad": ("w8a8", setv("M_pad", 4)), "zp_value": ("w8a8", setv("h_zp", 40000)),
    "c32_shift": ("int32", edit("c32_channels", 1, 40)), "missing": ("w8a8", drop("g_from_rrh_shift")),
    "c32_mult": ("int32", edit("c32_channels", 35 * 128 + 1, -5)),  # a multiplier field (Cell32Field kMult)
    "lsh": ("int32m", edit("Wx_bias_lo", 2, 40)),  # multiplier form: Wx_bias_lo holds the left shift
    "rshift": ("int32", edit("Wx_rshift", 0, 31)), "dtype": ("w8a8", lambda t, v: t.__setitem__("Wx_zp", t["Wx_zp"].to(torch.int32))),
}
out = {}
for name, (config, change) in CASES.items():
    t, v = native.prepare_layer(base[config])
    v["cpu_amx"] = 0
    change(t, v)
    try:
        mod.Layer(t, v)
        out[name] = ["accepted", ""]
    except Exception as e:
        out[name] = [type(e).__name__, str(e).splitlines()[0]]
# and a LayerParams that never went through a file's checks, run through the backend
p = base["w8a8"]
bad = LayerParams(**{**p.__dict__, "tables": {**p.tables, "r": p.tables["r"][:1]}})
bad.__dict__.pop("_native", None)
try:
    native.gru_direction("cpu")(bad, torch.zeros(2, 1, 3, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32))
    out["gru_direction"] = ["accepted", ""]
except Exception as e:
    out["gru_direction"] = [type(e).__name__, str(e).splitlines()[0]]
# the unchanged layers are accepted (the cases above fail for their own reason)
for config, p in base.items():
    t, v = native.prepare_layer(p)
    v["cpu_amx"] = 0
    mod.Layer(t, v)
    out["ok_" + config] = ["accepted", ""]
print("RESULT " + json.dumps(out))
'''

NATIVE_EXPECT = {
    "table_0": r"'table_r' must be a contiguous Long tensor of 1024 elements, got Long \[0\]",
    "table_2": r"'table_r' must be a contiguous Long tensor of 1024 elements",
    "table_100": r"'table_g' must be a contiguous Long tensor of 1024 elements",
    "table_long": r"'table_z' must be a contiguous Long tensor of 1024 elements",
    "table_entry": r"table 'g' entry 3 .* out of range",
    "table_k": r"'r_table_k' = 20 is outside \[0, 6\]",
    "x_bits_24": r"'x_bits' = 24 is outside \[2, 16\]",
    "h_bits_32": r"'h_bits' = 32 is outside \[2, 16\]",
    "shift_0": r"'zh_shift' holds values in \[0, 0\], outside \[1, 62\]",
    "shift_-5": r"'Wx_shift' holds values in \[-5, .*outside \[1, 62\]",
    "mult_wide": r"'r_from_wx_mult' holds values .* outside \[0, 2147483647\]",
    "log2_neg_pow2": r"'zg_mult_log2' holds values in \[-1, -1\], outside \[0, 30\]",
    "limbs_short_K": r"'x_weight_limbs' must be contiguous int8",
    "pairs_limb": r"'h_pairs' row 0 names limbs \(1, 0\) of 1 activation",
    "bias_short": r"'Rh_bias' must be a contiguous Long tensor of 12 elements",
    "zp_off_range": r"'Wx_zp' holds values in .*1048576\], outside \[-32768, 32767\]",
    "range_wide": r"range of r_pre \[-40000, 32767\] is not a range of at most 16 bits",
    "ones_col": r"'ones_col' = 16 is outside \[0, 15\]",
    "M_pad": r"M_pad = 4 must lie in \[3H, 3H \+ 64\]",
    "zp_value": r"'h_zp' = 40000 is outside \[-32768, 32767\]",
    "c32_shift": r"c32_channels field 0' holds values in \[\d+, 40\], outside \[0, 14\]",
    "c32_mult": r"c32_channels field 35' holds values in \[-5, \d+\], outside \[0, \d+\]",  # a pow2 layer's: its left shift
    "lsh": r"'Wx_bias_lo' holds values in \[\d+, 40\], outside \[0, 31\]",
    "missing": r"missing tensor 'g_from_rrh_shift'",
    "rshift": r"'Wx_rshift' holds values in \[.*, 31\], outside \[[01], 30\]",
    "dtype": r"'Wx_zp' must be a contiguous Long tensor",
    "gru_direction": r"'table_r' must be a contiguous Long tensor of 1024 elements",
}


@pytest.fixture(scope="module")
def native_cases():
    import os
    import subprocess
    import sys
    from pathlib import Path
    if qgru.backends()["cpu"]["why"]:
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", _NATIVE_CASES], cwd=root, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "QGRU_NO_BUILD": "1"})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"child process failed (rc {r.returncode}): {r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", list(NATIVE_EXPECT))
def test_native_layer_refuses_bad_parameters(native_cases, case):
    import re
    kind, message = native_cases[case]
    assert kind == "RuntimeError", (case, kind, message)
    assert message.startswith("qgru native layer: ") and re.search(NATIVE_EXPECT[case], message), message


def test_native_layer_accepts_good_parameters(native_cases):
    assert native_cases["ok_w8a8"] == native_cases["ok_w8a16"] == native_cases["ok_int32"] == ["accepted", ""]


# =============================================================================================
# 6. Drop-in exceptions: what nn.GRU raises, QuantGRU raises (a subclass with its own message)
# =============================================================================================
def _packed(T_N_I, lengths):
    from torch.nn.utils.rnn import pack_padded_sequence
    return pack_padded_sequence(torch.randn(*T_N_I), torch.tensor(lengths))


BAD_CALLS = {  # name: (args builder, batch_first, float-mode only)
    "input_size": (lambda: (torch.randn(5, 2, I + 2),), False, False),
    "input_size_unbatched": (lambda: (torch.randn(5, I - 1),), False, False),
    "rank_1": (lambda: (torch.randn(I),), False, False),
    "rank_4": (lambda: (torch.randn(2, 5, 2, I),), False, False),
    "h0_batch": (lambda: (torch.randn(5, 2, I), torch.zeros(1, 3, H)), False, False),
    "h0_hidden": (lambda: (torch.randn(5, 2, I), torch.zeros(1, 2, H + 1)), False, False),
    "h0_rank": (lambda: (torch.randn(5, 2, I), torch.zeros(H)), False, False),
    "h0_unbatched_3d": (lambda: (torch.randn(5, I), torch.zeros(1, 1, H)), False, False),
    "h0_batch_first": (lambda: (torch.randn(2, 5, I), torch.zeros(1, 5, H)), True, False),
    "int_input": (lambda: (torch.ones(5, 2, I, dtype=torch.int64),), False, False),
    "bool_input": (lambda: (torch.ones(5, 2, I, dtype=torch.bool),), False, False),
    "int_h0": (lambda: (torch.randn(5, 2, I), torch.zeros(1, 2, H, dtype=torch.int64)), False, False),
    "float64_input": (lambda: (torch.randn(5, 2, I, dtype=torch.float64),), False, True),
    "float16_input": (lambda: (torch.randn(5, 2, I).half(),), False, True),
    "float64_h0": (lambda: (torch.randn(5, 2, I), torch.zeros(1, 2, H, dtype=torch.float64)), False, True),
    "T_0": (lambda: (torch.randn(0, 2, I),), False, False),
    "T_0_unbatched": (lambda: (torch.randn(0, I),), False, False),
    "T_0_batch_first": (lambda: (torch.randn(2, 0, I),), True, False),
    "packed_input_size": (lambda: (_packed((4, 2, I + 1), [4, 3]),), False, False),
    "packed_h0_batch": (lambda: (_packed((4, 2, I), [4, 3]), torch.zeros(1, 3, H)), False, False),
}


class TestDropInExceptions:
    @pytest.mark.parametrize("mode", ["float", "converted"])
    @pytest.mark.parametrize("case", list(BAD_CALLS))
    def test_raises_what_nn_gru_raises(self, case, mode):
        build, batch_first, float_only = BAD_CALLS[case]
        if mode == "converted" and float_only:
            pytest.skip("a converted QuantGRU quantizes any float dtype on entry")
        torch.manual_seed(0)
        gru = nn.GRU(I, H, batch_first=batch_first)
        args = build()
        with pytest.raises(Exception) as nn_exc:
            gru(*args)
        q = qgru.QuantGRU.from_float(gru)
        if mode == "converted":
            qgru.calibrate(q, [torch.randn(2, 5, I) if batch_first else torch.randn(5, 2, I)], progress=False)
            q.convert()
        with pytest.raises(type(nn_exc.value)) as ours:  # code that catches nn.GRU's error still works
            q(*args)
        assert isinstance(ours.value, (qgru.QGRUInputError, qgru.QGRUDtypeError)), type(ours.value)

    def test_exception_classes(self):
        # shape errors stay ValueErrors, dtype errors TypeErrors (what qgru raised before)
        assert issubclass(qgru.QGRUInputError, RuntimeError) and issubclass(qgru.QGRUInputError, ValueError)
        for base in (TypeError, ValueError, RuntimeError):
            assert issubclass(qgru.QGRUDtypeError, base)

    def test_autocast_float_mode_like_nn_gru(self):
        """nn.GRU lets autocast cast a bfloat16 input for its float32 weights; so does a float QuantGRU."""
        torch.manual_seed(0)
        gru = nn.GRU(I, H)
        q = qgru.QuantGRU.from_float(gru)
        x = torch.randn(5, 2, I, dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = gru(x)[0], q(x)[0]
        assert torch.equal(want, got)

    @pytest.mark.parametrize("mode", ["float", "converted"])
    def test_empty_batch_runs_like_nn_gru(self, mode):
        """N = 0 (no sequences) is valid for nn.GRU: an empty output, not an error."""
        m = converted() if mode == "converted" else qgru.QuantGRU(I, H)
        out, h = m(torch.randn(5, 0, I))
        assert out.shape == (5, 0, H) and h.shape == (1, 0, H)


# =============================================================================================
# 5. Calibration errors that say what is wrong
# =============================================================================================
class TestCalibrationErrors:
    @pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
    def test_batches_of_another_dtype(self, dtype):
        m = qgru.QuantGRU(I, H)
        with pytest.raises(qgru.QGRUDtypeError, match=rf"calibration batch 0: QuantGRU input dtype \({dtype}\) does "
                                                      r"not match the weight dtype \(torch\.float32\)"):
            qgru.calibrate(m, [b.to(dtype) for b in calib_batches()], progress=False)
        with pytest.raises(ValueError):  # the class nn.GRU raises for it
            qgru.calibrate(m, [b.to(dtype) for b in calib_batches()], progress=False)

    def test_h0_of_another_dtype(self):
        m = qgru.QuantGRU(I, H)
        batch = (torch.randn(5, 2, I), torch.zeros(1, 2, H, dtype=torch.float64))
        with pytest.raises(qgru.QGRUDtypeError, match=r"calibration batch 0: h0 dtype \(torch\.float64\) does not "
                                                      r"match the input dtype"):
            qgru.calibrate(m, [batch], progress=False)

    def test_only_batch_has_no_steps(self):
        m = qgru.QuantGRU(I, H)
        with pytest.raises(qgru.QGRUInputError, match=r"calibration batch 0: .*at least one step.*sequence length 0"):
            qgru.calibrate(m, [torch.randn(0, 2, I)], progress=False)

    def test_only_batch_has_no_sequences(self):
        m = qgru.QuantGRU(I, H)
        qgru.calibrate(m, [torch.randn(5, 0, I)], progress=False)  # valid for nn.GRU: nothing to observe
        with pytest.raises(RuntimeError, match=r"saw no data in 1 calibration batch\(es\): each held no values "
                                               r"\(batch size 0\)"):
            m.convert()

    def test_all_zero_calibration_warns(self):
        m = qgru.QuantGRU(I, H)
        qgru.calibrate(m, [torch.zeros(5, 2, I)], progress=False)
        with pytest.warns(qgru.CalibrationWarning, match=r"layer 0 x: the calibrated range \[0, 0\] is degenerate"):
            m.convert()
        # and that is what happens at inference: ordinary inputs saturate at the grid's ends
        x = torch.randn(5, 2, I)
        assert torch.equal(m(x)[0], m(x * 1e6)[0])

    def test_tiny_range_warning_says_what_is_degenerate(self):
        # x in [-1e-12, 3e-11]: two different ends, both tiny; the warning must not claim every
        # value was the same (it did), and says what the range falls short of
        m = qgru.QuantGRU(I, H)
        x = torch.full((5, 2, I), 3e-11)
        x[0, 0, 0] = -1e-12
        qgru.calibrate(m, [x], progress=False)
        with pytest.warns(qgru.CalibrationWarning, match=r"layer 0 x: .* is degenerate: with 0 included it spans "
                                                         r"less than 1e-08;") as rec:
            m.convert()
        assert not any("every calibration value" in str(w.message) for w in rec if "layer 0 x:" in str(w.message))

    def test_representative_calibration_does_not_warn(self):
        import warnings
        m = qgru.QuantGRU(I, H, num_layers=2, bidirectional=True)
        qgru.calibrate(m, calib_batches(), progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", qgru.CalibrationWarning)
            m.convert()


# =============================================================================================
# 5, 7. Command lines: one clear line instead of a traceback; unpickling said where it is seen
# =============================================================================================
class TestCommandLines:
    @pytest.mark.parametrize("what", ["truncated", "text", "missing_tensor", "crafted_table", "no_file", "bad_layer"])
    def test_export_c_cli_errors(self, what, tmp_path, capsys):
        from qgru.export_c import main
        path = tmp_path / "p.qgru"
        d = _entries()
        message = {"truncated": "not a readable zip archive", "text": "not a readable zip archive",
                   "missing_tensor": "missing entry l0.fwd.R", "crafted_table": "l0.fwd.tables.r: expected shape",
                   "no_file": "No such file", "bad_layer": "layer 5 out of range"}[what]
        if what == "missing_tensor":
            del d["l0.fwd.R"]
        if what == "crafted_table":
            d["l0.fwd.tables.r"] = d["l0.fwd.tables.r"][:1]
        if what != "no_file":
            _write(d, path)
        if what == "truncated":
            path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
        if what == "text":
            path.write_text("not a model\n")
        rc = main([str(path), str(tmp_path / "out" / "gru")] + (["--layer", "5"] if what == "bad_layer" else []))
        err = capsys.readouterr().err
        assert rc == 1
        assert err.startswith("python -m qgru.export_c: error: ") and message in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "out" / "gru.c").exists()

    def test_export_c_cli_good_file(self, tmp_path, capsys):
        from qgru.export_c import main
        path = tmp_path / "p.qgru"
        _model().export().save(path)
        assert main([str(path), str(tmp_path / "gru")]) == 0
        assert (tmp_path / "gru.c").is_file() and (tmp_path / "gru.h").is_file()

    def test_demo_help_says_model_files_are_unpickled(self, capsys):
        from qgru.__main__ import main
        with pytest.raises(SystemExit):
            main(["demo", "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--model" in text and "UNSAFE with files you did not write" in text
        assert "runs any code the file holds" in text and "weights_only=True" in text

    def test_demo_warns_before_unpickling_a_model(self, tmp_path, capsys):
        from qgru import demo
        torch.save(nn.GRU(I, H), tmp_path / "model.pt")
        torch.save({"calib": calib_batches(), "test": calib_batches()}, tmp_path / "data.pt")
        model, calib, test, targets = demo.load_user_inputs(str(tmp_path / "model.pt"), str(tmp_path / "data.pt"))
        assert isinstance(model, nn.GRU) and len(calib) == 2 and targets is None
        err = capsys.readouterr().err
        assert "warning: --model" in err and "weights_only=False" in err and "runs whatever code" in err

    def test_demo_data_is_loaded_weights_only(self, tmp_path, capsys):
        from qgru import demo
        torch.save(nn.GRU(I, H), tmp_path / "model.pt")
        torch.save({"calib": calib_batches(), "test": [Payload()]}, tmp_path / "data.pt")
        UNPICKLED.clear()
        with pytest.raises(SystemExit, match=r"--data .*refused.*weights_only=True"):
            demo.load_user_inputs(str(tmp_path / "model.pt"), str(tmp_path / "data.pt"))
        assert UNPICKLED == []  # the data file's payload never ran
        assert "warning: --model" not in capsys.readouterr().err  # nor was the model unpickled
        torch.load(tmp_path / "data.pt", weights_only=False)  # the payload is real: a full unpickling runs it
        assert UNPICKLED == ["payload ran"]


UNPICKLED = []


def _record_unpickle(tag):
    UNPICKLED.append(tag)
    return tag


class Payload:
    """Not on torch's weights_only allowlist; unpickling it runs _record_unpickle."""

    def __reduce__(self):
        return (_record_unpickle, ("payload ran",))


# =============================================================================================
# Round two (issue 30): memory bombs in valid files, fork, fullgraph compile, export() aliasing,
# scales beyond float32, unclear errors. Every test here failed on 81e8d62.
# =============================================================================================
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent

_FORK_SCRIPT = r"""
import os, sys, threading, time, torch, qgru
layers, bidir = int(sys.argv[1]), sys.argv[2] == "1"
torch.manual_seed(0)
m = qgru.QuantGRU(16, 64, num_layers=layers, bidirectional=bidir)
qgru.calibrate(m, [torch.randn(12, 8, 16)], progress=False)
m.convert()
x = torch.randn(30, 8, 16)
want_out, want_h = m(x)  # the main thread runs the model too (its native state exists)
stop = False
def loop():
    while not stop:
        m(x)
t = threading.Thread(target=loop, daemon=True)
t.start()
hung, wrong = 0, 0
for i in range(8):
    time.sleep(0.02)
    pid = os.fork()
    if pid == 0:  # the child runs the same model while the parent's thread may be inside a call
        out, h = m(x)
        os._exit(0 if torch.equal(out, want_out) and torch.equal(h, want_h) else 3)
    deadline = time.time() + 20
    while True:
        r, status = os.waitpid(pid, os.WNOHANG)
        if r:
            wrong += os.waitstatus_to_exitcode(status) != 0
            break
        if time.time() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.01)
stop = True
t.join()
print(f"hung {hung} wrong {wrong}")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
@pytest.mark.parametrize("layers,bidir", [(3, False), (1, True)])
def test_fork_during_a_call_does_not_hang_the_child(cpu_backend, layers, bidir):
    """Issue 30 item 2: a thread calls the model in a loop, the main thread forks, the child calls the
    same model. The C++ Layer's mutex was copied locked into the child (held by a thread that the
    child does not have): the child waited forever (3 of 6 children of a 3-layer model). Each child
    must return the parent's outputs; a hang is seen as a child killed after 20 s, not a stuck CI."""
    r = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, str(layers), "1" if bidir else "0"], cwd=_ROOT,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "hung 0 wrong 0", r.stdout + r.stderr[-2000:]


_COMPILE_SHAPES = [  # (num_layers, bidirectional, batch_first): the time-major unidirectional ones failed
    (1, False, False), (2, False, False), (1, False, True), (2, True, False), (1, True, True)]


@pytest.mark.parametrize("layers,bidir,batch_first", _COMPILE_SHAPES)
def test_torch_compile_fullgraph_every_model_shape(layers, bidir, batch_first):
    """Issue 30 items 3 and 10: torch.compile(m, fullgraph=True) of a converted unidirectional
    time-major model failed ("torch.* op returned non-Tensor": the CPU fast path's input.is_neg()
    ran before it asked whether it was being compiled). Every shape compiles to one graph around
    the custom operator, bit for bit the eager outputs (h0 given or not)."""
    torch.manual_seed(layers * 4 + bidir * 2 + batch_first)
    m = qgru.QuantGRU(I, H, num_layers=layers, bidirectional=bidir, batch_first=batch_first)
    qgru.calibrate(m, calib_batches(), progress=False)
    m.convert()
    x = torch.randn(2, 5, I) if batch_first else torch.randn(5, 2, I)  # T = 5, N = 2
    h0 = torch.randn(layers * (1 + bidir), 2, H)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch._dynamo.config.patch(allow_rnn=True), torch.no_grad():
        compiled = torch.compile(m, backend=backend, fullgraph=True)
        for args in ((x,), (x, h0)):
            got, want = compiled(*args), m(*args)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert graphs and all(any(n.target in (torch.ops.qgru.integer_gru.default, torch.ops.qgru.integer_gru)
                              for n in gm.graph.nodes) for gm in graphs)
    torch._dynamo.reset()


_BOUNDED_LOAD = r"""
import resource, sys, time
import torch, qgru
def vm_data():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
# from here on the process may map at most 512 MiB more: a load that allocates for what the file
# claims, not what it holds, fails with MemoryError (on 81e8d62: 12.8 GB for num_layers = 10^9)
limit = vm_data() + (512 << 20)
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
t0 = time.perf_counter()
try:
    qgru.load_params(sys.argv[1])
    print("loaded")
except qgru.ParamsFileError as e:
    print(f"ParamsFileError {time.perf_counter() - t0:.2f} s: {e}")
except MemoryError:
    print("MemoryError")
"""


def _load_bounded(path) -> str:
    r = subprocess.run([sys.executable, "-c", _BOUNDED_LOAD, str(path)], cwd=_ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA bounds mmap'ed memory on Linux")
class TestClaimedCounts:
    """Issue 30 item 1: a count or size the file claims is compared with what the file holds
    before anything is allocated for it. Each load runs in a child process that may allocate at
    most 512 MiB more (RLIMIT_DATA): on 81e8d62 these raised MemoryError there."""

    def test_num_layers_1e9_is_refused_quickly(self, tmp_path):
        d = _entries()
        _meta(num_layers=10 ** 9)(d)
        line = _load_bounded(_write(d, tmp_path / "bomb.qgru"))  # checksum recomputed: a valid file
        assert line.startswith("ParamsFileError"), line
        assert "meta.num_layers is 1000000000, but the file holds the parameters of 2 layer(s)" in line
        assert float(line.split()[1]) < 5.0, line

    def test_a_shape_over_a_smaller_storage_is_refused(self, tmp_path):
        """torch.load rebuilds any shape whose strides stay in the stored bytes: one stored byte
        read as 10^9 elements (stride 0). The checksum's copy of it took 1 GB before anything else
        was checked."""
        d = _entries()
        d["l0.fwd.W"] = torch.zeros(1, dtype=torch.int8).expand(10 ** 9)
        path = tmp_path / "expanded.qgru"
        torch.save(d, path)  # the stored file holds one byte of it
        assert path.stat().st_size < 1 << 20
        line = _load_bounded(path)
        assert line.startswith("ParamsFileError"), line
        assert "l0.fwd.W: shape (1000000000,) (1000000000 elements) over a storage of 1 bytes" in line

    def test_extra_state_num_layers_is_bounded_before_allocating(self):
        """The same path through a module's state_dict (set_extra_state), measured in this process
        with tracemalloc: a claim of 3 * 10^6 layers built a 3-million-entry list (~100 MB)."""
        import tracemalloc
        m = _model()
        sd = m.state_dict()
        # _extra_state is the bytes of a torch.save archive (issue 31: state_dicts through safetensors)
        state = _extra_state_dict(sd)
        _meta(num_layers=3 * 10 ** 6)(state["params"])
        state["params"]["checksum"] = export.checksum(state["params"])
        buf = io.BytesIO()
        torch.save(state, buf)
        sd["_extra_state"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        target = qgru.QuantGRU(I, H, num_layers=2, bidirectional=True)
        tracemalloc.start()
        try:
            with pytest.raises(qgru.ParamsFileError, match=r"_extra_state\.params': meta\.num_layers is 3000000"):
                target.load_state_dict(sd)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, f"{peak / 2 ** 20:.1f} MiB traced while refusing the state"


def _extra_state_dict(sd) -> dict:
    """A converted QuantGRU's _extra_state read back: the bytes of a torch.save archive (issue 31)."""
    return torch.load(io.BytesIO(sd["_extra_state"].numpy().tobytes()), weights_only=True)


class TestRoundTwoFiles:
    @pytest.mark.parametrize("scale", [2.0 ** 127, 2.0 ** 129, 2.0 ** 120])
    def test_h_scale_beyond_float32_is_refused(self, scale, tmp_path):
        """Issue 30 item 5: S_h = 2^127 or 2^129 (last layer) loaded, and every output was +-inf on
        both backends. The grid's end values (qmin - zp) S, (qmax - zp) S must be float32s."""
        d = _entries("wide")  # 16-bit h: 2^120 too puts its ends (2^15 steps) beyond float32
        d["l0.fwd.scale.h"] = torch.tensor(scale, dtype=torch.float64)
        path = _write(d, tmp_path / "huge.qgru")
        with pytest.raises(qgru.ParamsFileError, match=r"l0\.fwd\.scale\.h: .*beyond float32's largest value"):
            qgru.load_params(path)

    def test_x_scale_beyond_float32_is_refused(self, tmp_path):
        d = _entries()  # pow2, 8-bit x
        d["l1.rev.scale.x"] = torch.tensor(2.0 ** 126, dtype=torch.float64)  # 128 steps: 2^133
        with pytest.raises(qgru.ParamsFileError, match=r"l1\.rev\.scale\.x: .*beyond float32's largest value"):
            qgru.load_params(_write(d, tmp_path / "huge.qgru"))
        # the bound is float32's: a grid whose ends are float32s loads, and its outputs are finite
        d = _entries("wide")
        lo, hi = -(1 << 15), (1 << 15) - 1
        z = int(d["l0.fwd.zp.h"])
        s = 2.0 ** 127 / max(hi - z, z - lo)
        d["l0.fwd.scale.h"] = torch.tensor(s, dtype=torch.float64)
        p = qgru.load_params(_write(d, tmp_path / "big.qgru"))
        with qgru.backend("reference"):
            out, h = p.to_module()(torch.randn(4, 2, I) * 1e30)
        assert torch.isfinite(out).all() and torch.isfinite(h).all()

    def test_deeply_nested_meta_json(self, tmp_path):
        """Issue 30 item 6: RecursionError before."""
        d = _entries()
        d["meta"] = "[" * 100000 + "]" * 100000
        with pytest.raises(qgru.ParamsFileError, match=r"meta: JSON nested too deeply"):
            qgru.load_params(_write(d, tmp_path / "deep.qgru"))

    def test_meta_device_tensor_is_refused(self):
        """Issue 30 item 7: NotImplementedError from the checksum before."""
        d = _entries()
        d["l0.fwd.b_x"] = d["l0.fwd.b_x"].to("meta")
        with pytest.raises(qgru.ParamsFileError, match=r"l0\.fwd\.b_x: a tensor on the meta device"):
            qgru.QuantParams.from_dict(d)

    @pytest.mark.parametrize("case", ["no_params", "calibration_str", "calibration_list", "bad_params"])
    def test_bad_extra_state_names_the_entry(self, case):
        """Issue 30 item 7: a bare KeyError: 'params', and "dictionary update sequence element #0"
        for calibration='abc', before."""
        sd = _model().state_dict()
        state = _extra_state_dict(sd)  # set back as a dict: the form qgru saved before, still loaded
        if case == "no_params":
            del state["params"]
            message = r"'_extra_state': missing its 'params' entry"
        elif case == "bad_params":
            state["params"] = {**state["params"], "l0.fwd.one_z": 7}
            message = r"'_extra_state\.params': checksum mismatch"
        else:
            state["calibration"] = "abc" if case == "calibration_str" else [("a", 1)]
            message = r"'_extra_state\.calibration': expected a dict of named tensors"
        sd["_extra_state"] = state
        target = qgru.QuantGRU(I, H, num_layers=2, bidirectional=True)
        with pytest.raises(qgru.ParamsFileError, match=message):
            target.load_state_dict(sd)


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_export_does_not_alias_the_module(name):
    """Issue 30 item 4: an in-place edit of m.export()'s tables reached the module's own
    LayerParams: the reference backend ran the edited, never-validated values while the cpu
    backend ran its copies, and the two disagreed without an error."""
    why = qgru.backends()[name]["why"]
    if why:
        pytest.skip(why)
    m = converted(num_layers=2)
    x = torch.randn(6, 2, I)
    with qgru.backend("reference"):
        want = m(x)
    params = m.export()
    with torch.no_grad():
        params.layers[0][0].tables["r"].fill_(0)
        params.layers[1][0].W.fill_(7)
        params.layers[0][0].scale["h"].fill_(1e9)
        params.layers[0][0].zp["x"].fill_(3)
    with qgru.backend(name):
        got = m(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # and to_module() owns its parameters: editing them afterwards does not reach it
    p2 = m.export()
    m2 = p2.to_module()
    with torch.no_grad():
        p2.layers[0][0].tables["z"].fill_(0)
    with qgru.backend(name):
        got2 = m2(x)
    assert torch.equal(got2[0], want[0]) and torch.equal(got2[1], want[1])


@pytest.mark.parametrize("dim", ["dynamic", "min0"])
def test_exported_program_refuses_an_empty_sequence(dim):
    """Issue 30 item 12: eager mode refuses T = 0; an exported program with a dynamic sequence
    length accepted it and returned h0 as h_n. Both raise QGRUInputError now."""
    from torch.export import Dim
    m = converted(batch_first=True)
    x = torch.randn(2, 5, I)
    T = Dim.DYNAMIC if dim == "dynamic" else Dim("T", min=0, max=64)
    ep = torch.export.export(m, (x,), dynamic_shapes={"input": {1: T}})
    empty = torch.randn(2, 0, I)
    with pytest.raises(qgru.QGRUInputError, match=r"sequence of at least one step.*sequence length 0"):
        m(empty)
    assert torch.is_grad_enabled()
    with pytest.raises(qgru.QGRUInputError, match=r"sequence of at least one step.*sequence length 0"):
        ep.module()(empty)
    # the error leaves the caller's grad mode alone (an operator that raised inside an exported
    # no_grad region left grad mode off: torch's wrap_with_set_grad_enabled has no finally)
    assert torch.is_grad_enabled()
    with torch.no_grad():
        assert torch.equal(ep.module()(x)[0], m(x)[0])
