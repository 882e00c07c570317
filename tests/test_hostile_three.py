"""Hostile and careless input, round three (issue 39): memory bombs (compressed archive records, a
weight-only file's stride-0 entry), silent wrong results and silent loads of the weight-only mode
(negative views, state_dicts that skip validation, gradients that depend on the batch size), an
unsafe hint on a hostile pickle, and a state that silently leaves a GRU float.

Every test of a numbered defect failed on 7e23107, before its fix."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import qgru
from qgru import export
from qgru import weight_only as wo
from qgru.weight_only import WeightOnlyGRU

I, H = 3, 4
_ROOT = Path(__file__).resolve().parent.parent


def _converted(**kw) -> qgru.QuantGRU:
    torch.manual_seed(0)
    m = qgru.QuantGRU(I, H, **kw)
    g = torch.Generator().manual_seed(0)
    qgru.calibrate(m, [torch.randn(5, 2, I, generator=g) for _ in range(2)], progress=False)
    return m.convert()


def _wo_model(config="w4g32", **kw) -> WeightOnlyGRU:
    torch.manual_seed(0)
    g = nn.GRU(20, 16, **kw)
    return WeightOnlyGRU.from_float(g, wo.WeightOnlyConfig.load(config, weight_rounding="nearest"))


def _native_ok() -> bool:
    from qgru.weight_only import cpu as wo_cpu
    return not wo_cpu.why_unavailable()


def _deflated(raw: bytes) -> bytes:
    """The same archive with every record deflate-compressed (torch's reader inflates them)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _extra_state_of(obj) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


# =============================================================================================
# 1. compressed records are refused before anything is inflated
# =============================================================================================
class TestCompressedRecords:
    def test_the_reader_inflates_them(self, tmp_path):
        """What made it a bomb: torch.load reads deflated records (so 7e23107 loaded this file)."""
        path = tmp_path / "p.qgru"
        _converted().export().save(path)
        (tmp_path / "z.qgru").write_bytes(_deflated(path.read_bytes()))
        assert torch.load(tmp_path / "z.qgru", weights_only=True).keys() == torch.load(path, weights_only=True).keys()

    def test_params_file(self, tmp_path):
        path = tmp_path / "p.qgru"
        _converted().export().save(path)
        qgru.load_params(path)  # stored records: loads
        bad = tmp_path / "deflated.qgru"
        bad.write_bytes(_deflated(path.read_bytes()))
        with pytest.raises(qgru.ParamsFileError, match=r"deflated\.qgru: record '.*' is compressed \(zip method 8\)"):
            qgru.load_params(bad)

    def test_weight_only_file(self, tmp_path):
        path = tmp_path / "w.qgru"
        _wo_model().save(path)
        bad = tmp_path / "deflated.qgru"
        bad.write_bytes(_deflated(path.read_bytes()))
        with pytest.raises(wo.WeightOnlyFileError, match=r"deflated\.qgru: record '.*' is compressed"):
            WeightOnlyGRU.load(bad)

    def test_extra_state(self):
        sd = _converted().state_dict()
        raw = _deflated(sd["_extra_state"].numpy().tobytes())
        sd["_extra_state"] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        with pytest.raises(qgru.ParamsFileError, match=r"'_extra_state': record '.*' is compressed"):
            qgru.QuantGRU(I, H).load_state_dict(sd)


def test_records_overlapping_in_the_archive(tmp_path):
    """Stored records can overlap: many directory entries pointing at one record's bytes each read
    it whole (a quadratic bomb without compression). Their sizes may add up to no more than the
    archive's."""
    import copy
    path = tmp_path / "overlap.qgru"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("overlap/data.pkl", b"\0" * 100_000)
    with zipfile.ZipFile(path, "a") as z:  # 20 more directory entries for the same bytes
        first = z.filelist[0]
        for k in range(20):
            dup = copy.copy(first)
            dup.filename = dup.orig_filename = f"overlap/data{k}"
            z.filelist.append(dup)
        z._didModify = True
    with pytest.raises(qgru.ParamsFileError, match=r"overlap\.qgru: its records claim 2100000 bytes in all, more "
                                                   r"than the archive's"):
        qgru.load_params(path)


# =============================================================================================
# 2. a weight-only file's stride-0 entry is refused before it is made contiguous
# =============================================================================================
_BOUNDED_WO_LOAD = r"""
import resource, sys
import qgru
def vm_data():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
limit = vm_data() + (512 << 20)  # at most 512 MiB more from here on
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
try:
    qgru.WeightOnlyGRU.load(sys.argv[1])
    print("loaded")
except qgru.WeightOnlyFileError as e:
    print(f"WeightOnlyFileError: {e}")
except MemoryError:
    print("MemoryError")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA bounds mmap'ed memory on Linux")
@pytest.mark.parametrize("key", ["extra", "l0.fwd.W.scale"])
def test_weight_only_stride0_entry_is_refused_before_allocating(key, tmp_path):
    m = _wo_model()
    d = wo.to_dict(m.meta(), m.layers())
    d[key] = torch.zeros(1, dtype=torch.float32).expand(2 ** 31)  # 8 GiB as a claim, 4 bytes stored
    d["checksum"] = "sha256:" + "0" * 64
    path = tmp_path / "expanded.qgru"
    torch.save(d, path)
    assert path.stat().st_size < 1 << 20
    r = subprocess.run([sys.executable, "-c", _BOUNDED_WO_LOAD, str(path)], cwd=_ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("WeightOnlyFileError"), line
    assert f"{key}: shape (2147483648,) (2147483648 elements) over a storage of 4 bytes" in line


# =============================================================================================
# 3. the weight-only native path reads negative views negated
# =============================================================================================
@pytest.mark.parametrize("backend", ["native", "auto", "dequant", "golden"])
def test_weight_only_negative_view(backend):
    if backend == "native" and not _native_ok():
        pytest.skip("the weight-only CPU kernel is unavailable")
    m = _wo_model(num_layers=2, bidirectional=True)
    m.backend = backend
    g = torch.Generator().manual_seed(1)
    x, h0 = torch.randn(6, 3, 20, generator=g), torch.randn(4, 3, 16, generator=g)
    want = m(-x, -h0)
    got = m(torch._neg_view(x), torch._neg_view(h0))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    m.batch_first = True  # a transposed negative view, and the unbatched form
    assert torch.equal(m(torch._neg_view(x.transpose(0, 1)))[0], m(-x.transpose(0, 1))[0])
    assert torch.equal(m(torch._neg_view(x[:, 0]))[0], m(-x[:, 0])[0])


def test_weight_only_cpu_binding_resolves_views():
    if not _native_ok():
        pytest.skip("the weight-only CPU kernel is unavailable")
    from qgru.weight_only import cpu as wo_cpu
    p = _wo_model().layers()[0][0]
    x = torch.randn(5, 20)
    assert torch.equal(wo_cpu.wo_mm(torch._neg_view(x), p.W), wo_cpu.wo_mm(-x, p.W))
    assert torch.allclose(wo_cpu.wo_mm(-x, p.W), -x @ wo.dequantize(p.W).t(), atol=1e-5)


# =============================================================================================
# 4. WeightOnlyGRU.load_state_dict checks what a file's loader checks
# =============================================================================================
_STATE_EDITS = [
    ("l0_fwd_W_scale", lambda t: t * float("nan"), r"'l0_fwd_W_scale': scales must be finite and > 0"),
    ("l0_fwd_R_scale", lambda t: t * 0, r"'l0_fwd_R_scale': scales must be finite and > 0"),
    ("l0_fwd_W_scale", lambda t: -t, r"'l0_fwd_W_scale': scales must be finite and > 0"),
    ("l0_fwd_W_scale", lambda t: t * float("inf"), r"'l0_fwd_W_scale': scales must be finite and > 0"),
    ("l0_fwd_R_zp", lambda t: t + 16, r"'l0_fwd_R_zp': zero points must be in \[0, 15\] at 4 bits"),
    ("l0_fwd_W_codes", lambda t: t | (1 << 31), r"'l0_fwd_W_codes': the padding codes past the input size 20"),
    ("l0_fwd_W_codes", lambda t: t.float(), r"'l0_fwd_W_codes': expected torch\.int32 \[3, 48\] \(config w4g32\), "
                                            r"got torch\.float32"),
    ("l0_fwd_b_ih", lambda t: t * float("nan"), r"'l0_fwd_b_ih': not finite"),
    ("l0_fwd_W_zp", lambda t: t.to("meta"), r"'l0_fwd_W_zp': a tensor on the meta device"),
    ("l0_fwd_W_scale", lambda t: t[:1, :1].clone().expand(t.shape), r"'l0_fwd_W_scale': shape \(1, 48\) .* over a storage"),
]


@pytest.mark.parametrize("key,edit,match", _STATE_EDITS)
def test_weight_only_state_dict_is_validated(key, edit, match):
    src = _wo_model()
    sd = src.state_dict()
    target = _wo_model()
    with torch.no_grad():
        for b in target.buffers():
            b.add_(1) if b.is_floating_point() else None
    before = {k: v.clone() for k, v in target.state_dict().items()}
    bad = {**sd, key: edit(sd[key])}
    with pytest.raises(wo.WeightOnlyFileError, match=r"WeightOnlyGRU state_dict " + match):
        target.load_state_dict(bad)
    # nothing was copied: the refusal came before any buffer was written
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    # the same values in a file are refused as well (the one set of checks)
    d = wo.to_dict(src.meta(), src.layers())
    file_key = key.replace("l0_fwd_", "l0.fwd.").replace("_codes", ".codes").replace("_scale", ".scale") \
        .replace("_zp", ".zp")
    if "meta" not in match and "storage" not in match:
        d[file_key] = edit(d[file_key])
        d["checksum"] = export.checksum(d)
        with pytest.raises(wo.WeightOnlyFileError):
            wo.from_dict(d)


def test_weight_only_symmetric_state_dict_and_nested_prefix():
    src = _wo_model("w4g32s")
    outer = nn.Sequential(_wo_model("w4g32s"))
    sd = {f"0.{k}": v for k, v in src.state_dict().items()}
    outer.load_state_dict(sd)  # a good state loads, under a prefix
    sd["0.l0_fwd_R_codes"] = torch.zeros_like(sd["0.l0_fwd_R_codes"])
    with pytest.raises(wo.WeightOnlyFileError, match=r"'0\.l0_fwd_R_codes': a symmetric config's codes"):
        outer.load_state_dict(sd)
    sd = {f"0.{k}": v for k, v in src.state_dict().items()}
    sd["0.l0_fwd_W_zp"] = sd["0.l0_fwd_W_zp"] - 1
    with pytest.raises(wo.WeightOnlyFileError, match=r"'0\.l0_fwd_W_zp': a symmetric config's zero points are 8"):
        outer.load_state_dict(sd)


def test_weight_only_state_dict_round_trips_and_keeps_torch_errors(tmp_path):
    src = _wo_model(num_layers=2, bidirectional=True)
    x = torch.randn(4, 2, 20)
    target = _wo_model(num_layers=2, bidirectional=True)
    target.load_state_dict(src.state_dict())
    src.backend = target.backend = "golden"
    assert torch.equal(target(x)[0], src(x)[0])
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    fresh = _wo_model(num_layers=2, bidirectional=True)
    fresh.load_state_dict(safetensors.load_file(str(tmp_path / "w.safetensors")))
    fresh.backend = "golden"
    assert torch.equal(fresh(x)[0], src(x)[0])
    # a size mismatch stays torch's RuntimeError; a partial non-strict state is checked with the rest
    other = WeightOnlyGRU(20, 16, num_layers=2, bidirectional=True, config="w8g32")
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict(src.state_dict())
    part = {"l0_fwd_W_scale": src.state_dict()["l0_fwd_W_scale"] * float("nan")}
    with pytest.raises(wo.WeightOnlyFileError, match="l0_fwd_W_scale"):
        target.load_state_dict(part, strict=False)


# =============================================================================================
# 5. gradients: one behaviour at every batch size
# =============================================================================================
def _reference_grads(m: WeightOnlyGRU, x, h0):
    """d sum(out * w) / dx and / dh0 through float64 nn.GRU holding the dequantized weights."""
    ref = nn.GRU(m.input_size, m.hidden_size, m.num_layers, bidirectional=m.bidirectional).double()
    with torch.no_grad():
        for li, row in enumerate(m.layers()):
            for d, p in enumerate(row):
                sfx = f"_l{li}" + ("_reverse" if d else "")
                getattr(ref, "weight_ih" + sfx).copy_(wo.dequantize(p.W))
                getattr(ref, "weight_hh" + sfx).copy_(wo.dequantize(p.R))
                getattr(ref, "bias_ih" + sfx).copy_(p.b_ih)
                getattr(ref, "bias_hh" + sfx).copy_(p.b_hh)
    xd, hd = x.detach().double().requires_grad_(), h0.detach().double().requires_grad_()
    out, h_n = ref(xd, hd)
    w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    ((out * w).sum() + h_n.sum()).backward()
    return xd.grad, hd.grad, w


@pytest.mark.parametrize("B", [1, 8, 9, 16])
def test_weight_only_gradients_at_every_batch_size(B):
    m = _wo_model(num_layers=2, bidirectional=True)
    g = torch.Generator().manual_seed(B)
    x = torch.randn(5, B, 20, generator=g).requires_grad_()
    h0 = torch.randn(4, B, 16, generator=g).requires_grad_()
    out, h_n = m(x, h0)
    assert out.grad_fn is not None and h_n.grad_fn is not None
    gx, gh, w = _reference_grads(m, x, h0)
    ((out * w.float()).sum() + h_n.sum()).backward()
    assert torch.allclose(x.grad.double(), gx, atol=1e-4, rtol=1e-4)
    assert torch.allclose(h0.grad.double(), gh, atol=1e-4, rtol=1e-4)
    # without grad the same call runs its fast path and gives the same numbers
    with torch.no_grad():
        fast = m(x, h0)[0]
    assert torch.allclose(fast, out.detach(), atol=2e-5)


def test_weight_only_forced_native_refuses_grad():
    if not _native_ok():
        pytest.skip("the weight-only CPU kernel is unavailable")
    m = _wo_model()
    m.backend = "native"
    x = torch.randn(3, 2, 20, requires_grad=True)
    with pytest.raises(wo.WeightOnlyError, match=r"backend 'native' computes no gradients"):
        m(x)
    with torch.no_grad():
        m(x)  # no grad needed: runs
    assert m.last_path == "native"


# =============================================================================================
# 6. a refused pickle: ParamsFileError naming the file (or key) and the global, no unsafe advice
# =============================================================================================
def _assert_safe_message(e, name: str):
    text = str(e)
    assert name in text and ("posix.system" in text or "nt.system" in text), text
    assert "must not be loaded unsafely" in text, text
    assert "will likely succeed" not in text and "add_safe_globals" not in text, text


def test_refused_pickle_in_a_params_file(tmp_path):
    path = tmp_path / "evil.qgru"
    torch.save({"meta": "{}", "payload": os.system}, path)
    with pytest.raises(qgru.ParamsFileError) as e:
        qgru.load_params(path)
    _assert_safe_message(e.value, "evil.qgru")


def test_refused_pickle_in_a_weight_only_file(tmp_path):
    path = tmp_path / "evil.qgru"
    torch.save({"meta": "{}", "payload": os.system}, path)
    with pytest.raises(qgru.ParamsFileError) as e:
        WeightOnlyGRU.load(path)
    assert isinstance(e.value, wo.WeightOnlyFileError)
    _assert_safe_message(e.value, "evil.qgru")


def test_refused_pickle_in_an_extra_state():
    sd = _converted().state_dict()
    sd["_extra_state"] = _extra_state_of({"format": "qgru.QuantGRU", "params": eval})
    with pytest.raises(qgru.ParamsFileError) as e:
        qgru.QuantGRU(I, H).load_state_dict(sd)
    text = str(e.value)
    assert "'_extra_state'" in text and "global eval" in text and "must not be loaded unsafely" in text, text
    assert "will likely succeed" not in text


# =============================================================================================
# 7. an _extra_state archive of another state does not leave the GRU float
# =============================================================================================
@pytest.mark.parametrize("state", [{}, {"format": "other"}, [1, 2], "text"])
def test_extra_state_archive_of_another_state(state):
    sd = _converted().state_dict()
    sd["_extra_state"] = _extra_state_of(state)
    target = qgru.QuantGRU(I, H)
    with pytest.raises(qgru.ParamsFileError, match=r"'_extra_state': the archive holds .*qgru never writes such a state"):
        target.load_state_dict(sd)
    assert not target.is_converted
    # the dict form qgru wrote before (a state_dict saved whole with torch.save) still loads: {} is float
    sd = _converted().state_dict()
    fresh = qgru.QuantGRU(I, H)
    fresh.load_state_dict(sd)
    assert fresh.is_converted


# =============================================================================================
# Also: weight-only T=0, meta tensors, torch.compile / torch.export
# =============================================================================================
@pytest.mark.parametrize("backend", ["auto", "native", "dequant", "golden"])
def test_weight_only_empty_sequence_raises_like_nn_gru(backend):
    if backend == "native" and not _native_ok():
        pytest.skip("the weight-only CPU kernel is unavailable")
    m = _wo_model()
    m.backend = backend
    g = nn.GRU(20, 16)
    for shape in ((0, 2, 20), (0, 20)):
        with pytest.raises(RuntimeError, match="sequence length"):
            g(torch.randn(*shape))
        with pytest.raises(qgru.QGRUInputError, match=r"WeightOnlyGRU expects a sequence of at least one step.*"
                                                      r"sequence length 0"):
            m(torch.randn(*shape))
    assert m(torch.randn(3, 0, 20))[0].shape == g(torch.randn(3, 0, 20))[0].shape  # an empty batch runs


@pytest.mark.parametrize("part", ["exponent", "scale", "lo", "hi", "b_x"])
def test_meta_x_levels_in_validate(part):
    p = _converted().export()
    lv = p.layers[0][0].x_levels
    assert lv is not None
    setattr(lv, part, getattr(lv, part).to("meta"))
    with pytest.raises(qgru.ParamsFileError, match=rf"l0\.fwd\.x_levels\.{part}: a tensor on the meta device"):
        p.validate()


def test_meta_params_in_validate():
    p = _converted().export()
    p.layers[0][0].b_h = p.layers[0][0].b_h.to("meta")
    with pytest.raises(qgru.ParamsFileError, match=r"l0\.fwd\.b_h: a tensor on the meta device"):
        p.validate()


def test_extra_state_stride0_is_refused_before_copying():
    """A state_dict file (torch.load, weights_only) may hold an _extra_state of 10^9 bytes that are
    one stored byte repeated: it was made contiguous (1 GB) before its archive was read."""
    sd = _converted().state_dict()
    sd["_extra_state"] = torch.zeros(1, dtype=torch.uint8).expand(10 ** 9)
    with pytest.raises(qgru.ParamsFileError, match=r"'_extra_state': shape \(1000000000,\) .* over a storage of 1 bytes"):
        qgru.QuantGRU(I, H).load_state_dict(sd)


def test_meta_extra_state():
    sd = _converted().state_dict()
    sd["_extra_state"] = sd["_extra_state"].to("meta")
    with pytest.raises(qgru.ParamsFileError, match=r"'_extra_state': a tensor on the meta device"):
        qgru.QuantGRU(I, H).load_state_dict(sd)


def test_weight_only_compile_fullgraph_and_export_name_the_limit():
    from qgru.weight_only import NO_COMPILE
    m = _wo_model()
    x = torch.randn(4, 2, 20)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"no torch\.compile or torch\.export operator \(README") as e:
        torch.compile(m, fullgraph=True, backend="eager")(x)
    assert "torch.compile" in str(e.value)
    with pytest.raises(wo.WeightOnlyError, match=r"no torch\.compile or torch\.export operator \(README"):
        torch.export.export(m, (x,))
    # without fullgraph the module runs eagerly between graphs, as documented
    out = torch.compile(nn.Sequential(m), backend="eager")(x)
    assert torch.equal(out[0], m(x)[0])
    torch._dynamo.reset()
    assert "Limits and known open defects" in NO_COMPILE
    readme = (_ROOT / "README.md").read_text()
    assert "## Limits and known open defects" in readme and "torch.compile" in readme


# =============================================================================================
# Also: qgru.summary, the one way to see what a (re)loaded model holds
# =============================================================================================
class _Forecaster(nn.Module):
    """A library-style model (darts, NeuralForecast): a GRU and a head."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(I, H, num_layers=2)
        self.head = nn.Linear(H, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_summary_names_the_non_strict_load_trap():
    torch.manual_seed(0)
    model = _Forecaster()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(5, 2, I, generator=g) for _ in range(2)]
    q = qgru.quantize_model(model, batches, progress=False)
    s = qgru.summary(q)
    assert [(r.name, r.cls, r.mode, r.config) for r in s] == [("rnn", "QuantGRU", "integer", "w8a8")]
    assert s.all_quantized and s[0].backend in ("cpu", "reference") and "2 layer(s)" in s[0].shape
    assert "1 of 1 GRU(s) quantized" in str(s)
    # the libraries' own load: rebuild the float model, load the state non-strictly -> float
    rebuilt = _Forecaster()
    result = rebuilt.load_state_dict(q.state_dict(), strict=False)
    assert result.unexpected_keys == ["rnn._extra_state"]  # the only trace: a key the library ignores
    s = qgru.summary(rebuilt)
    assert not s.all_quantized and s.float_grus == ["rnn"] and s[0].mode == "float"
    assert "0 of 1 GRU(s) quantized; float: rnn" in str(s)
    # prepared (QuantGRU, not converted) and then loaded: integer
    prepared = qgru.prepare_model(_Forecaster())
    assert qgru.summary(prepared)[0].mode == "float" and qgru.summary(prepared)[0].cls == "QuantGRU"
    prepared.load_state_dict(q.state_dict())
    assert qgru.summary(prepared).all_quantized
    x = torch.randn(4, 2, I)
    assert torch.equal(prepared(x), q(x))
    with qgru.backend("reference"):
        assert qgru.summary(prepared)[0].backend == "reference (forced)"


def test_summary_weight_only_qat_and_plain():
    w = _wo_model()
    s = qgru.summary(nn.Sequential(w, nn.Identity()))
    assert [(r.name, r.cls, r.mode, r.config) for r in s] == [("0", "WeightOnlyGRU", "weight-only", "w4g32")]
    assert s.all_quantized
    w(torch.randn(2, 1, 20))
    assert "last call:" in qgru.summary(w)[0].backend
    assert not qgru.summary(nn.Linear(2, 2)).all_quantized and "no GRU" in str(qgru.summary(nn.Linear(2, 2)))
    shared = nn.GRU(I, H)
    tied = nn.ModuleDict({"a": shared, "b": shared})
    assert len(qgru.summary(tied)) == 1
    g = torch.Generator().manual_seed(0)
    qat = qgru.prepare_qat(nn.GRU(I, H), [torch.randn(5, 2, I, generator=g)], config="w8a8")
    assert qgru.summary(qat)[0].mode == "qat" and not qgru.summary(qat).all_quantized
