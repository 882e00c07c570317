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
