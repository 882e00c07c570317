"""Every workflow with the model and its data on the device they live on (issue 29).

Two checks:

* ``test_*_under_a_meta_default_device``: run on any machine. Under ``torch.device("meta")`` as the
  default device, every factory call without an explicit ``device=`` makes a meta tensor, and
  mixing it with the caller's CPU tensors raises: a library function that makes a tensor on the
  default device instead of its caller's device fails here, as ``torch.arange(C)`` in the
  observers failed on a GPU (81e8d62: calibrating a model that lives on the GPU crashed). The
  results must also equal those of the same calls without the meta default.
* ``test_*[cuda]``: the workflows on a CUDA device, where one is there (the same tests run on the
  CPU everywhere, so their logic is checked on machines without a GPU).

GPU calibration tolerance (docs/spec.md section 8): the weights, their scales and the biases'
float inputs are the same on every device, so W and R are bit-identical. The calibration pass's
float activations differ from the CPU's by float32 rounding (cuBLAS against the CPU's GEMMs,
a few ulps), which can move a value across a histogram bin edge; the grid search may then choose a
neighbouring candidate. The bound tested: W and R bit-identical; every activation scale within
one step of the search lattice of the CPU's (a factor 2^(1/16) in multiplier mode, 2 in pow2 mode);
the two models' output SQNR against the float model within 0.5 dB.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

import qgru

I, H = 5, 8


def _batches(n=3, seed=0, N=3, T=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, T, I, generator=g) for _ in range(n)]


def _gru(seed=0, **kw):
    torch.manual_seed(seed)
    return nn.GRU(I, H, num_layers=2, bidirectional=True, batch_first=True, **kw)


def _cfg(name: str) -> qgru.QuantConfig:
    """A built-in config, NAME or NAME:SCALE_MODE."""
    base, _, mode = name.partition(":")
    return qgru.QuantConfig.load(base, overrides={"scale_mode": mode} if mode else None)


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "data") and hasattr(a, "batch_sizes"):  # PackedSequence
        return _same(a.data, b.data)
    return torch.equal(a.detach().cpu(), b.detach().cpu())


# ---------------------------------------------------------------------------------------------
# 1. No tensor on the default device (any machine)
# ---------------------------------------------------------------------------------------------
def _inputs():
    """A model and its data, made by the caller (outside the meta default)."""
    gru, calib, x = _gru(), _batches(), _batches(1, seed=7)[0]
    h0 = torch.randn(4, x.shape[0], H, generator=torch.Generator().manual_seed(3))
    seqs = [torch.randn(t, I, generator=torch.Generator().manual_seed(t)) for t in (6, 2, 4)]
    return gru, calib, x, h0, pack_sequence(seqs, enforce_sorted=False)  # torch's packing: outside too


def _workflows(name: str, tmp_path, gru, calib, x, h0, packed):
    """Every workflow once, on the caller's CPU tensors; returns what each produced."""
    cfg, stem = _cfg(name), name.replace(":", "_")
    out = {}
    q = qgru.quantize_model(gru, calib + [(calib[0], h0[:, :3])], config=cfg, progress=False)
    out["forward"] = q(x, h0)
    out["packed"] = q(packed)
    with qgru.backend("reference"):
        out["reference"] = q(x, h0)
    h = h0
    steps = []
    for t in range(x.shape[1]):  # streaming: one step a call, carrying h
        y, h = q(x[:, t:t + 1], h)
        steps.append(y)
    out["streaming"] = (torch.cat(steps, 1), h)
    report = qgru.compare(gru, q, calib, verbose=False, progress=False)
    out["compare"] = torch.tensor([r["sqnr_db"] for r in report.rows], dtype=torch.float64, device="cpu")
    p = q.export()
    p.save(tmp_path / f"{stem}.qgru")
    out["file"] = qgru.load_params(tmp_path / f"{stem}.qgru").to_module()(x, h0)
    p.to_c(tmp_path / f"{stem}_c")
    fresh = qgru.prepare_model(gru, cfg)
    fresh.load_state_dict(q.state_dict())
    out["state_dict"] = fresh(x, h0)
    calibrated = qgru.calibrate(qgru.prepare_model(gru, cfg), calib, progress=False)
    qat = qgru.prepare_qat(calibrated)
    opt = torch.optim.SGD(qat.parameters(), lr=1e-2)
    loss = qat(x, h0)[0].pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    qat.eval()
    with torch.no_grad():
        want = qat(x, h0)
    qgru.convert_qat(qat)
    out["qat"] = qat(x, h0)
    assert _same(out["qat"], want), "convert_qat must equal the QAT model's eval forward"
    return out


@pytest.mark.parametrize("cfg", ["w8a8", "w16a16:pow2"])
def test_workflows_under_a_meta_default_device(cfg, tmp_path):
    """calibrate, quantize_model, forward (native and reference, packed, streaming), compare, export
    and its file, C export, the state_dict round trip, QAT: no tensor made on the default device,
    and the same results as without the meta default."""
    want = _workflows(cfg, tmp_path, *_inputs())
    inputs = _inputs()
    with torch.device("meta"):
        got = _workflows(cfg, tmp_path, *inputs)
    for k in want:
        assert _same(got[k], want[k]), k


def test_the_meta_check_catches_a_default_device_factory(monkeypatch):
    """The check above can fail: an observer that makes its index on the default device (as on
    81e8d62) raises under the meta default."""
    from qgru import observers
    with torch.device("meta"):  # torch reads its list of factories once, at the first use: before the patch
        torch.empty(0)
    real = observers.torch.arange

    def arange_default_device(*a, **kw):
        kw.pop("device", None)
        return real(*a, **kw)
    monkeypatch.setattr(observers.torch, "arange", arange_default_device)
    m, calib = qgru.QuantGRU(I, H), _batches(1)
    with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
        qgru.calibrate(m, calib, progress=False)
        m.convert()


# ---------------------------------------------------------------------------------------------
# 2. The workflows on each device (cuda where there is one)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
        why = qgru.backends()["cuda"]["why"]
        if why:
            pytest.fail(f"torch sees a CUDA device but the cuda backend is unavailable: {why}", pytrace=False)
    return torch.device(request.param)


def _sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().double().cpu(), out.detach().double().cpu()
    noise = float((ref - out).pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(ref.pow(2).sum()) / noise)


@pytest.mark.parametrize("cfg", ["w8a8", "w8a16:pow2"])
def test_calibrating_on_a_device_gives_the_cpu_parameters(device, cfg):
    """quantize_model of a model and data on ``device`` against the same on the CPU, within the
    module docstring's tolerance (on the CPU itself: identical)."""
    gru, calib, x = _gru(1), _batches(4, seed=1, N=8, T=12), _batches(1, seed=9, N=8, T=12)[0]
    on_cpu = qgru.quantize_model(gru, calib, config=_cfg(cfg), progress=False)
    on_dev = qgru.quantize_model(copy.deepcopy(gru).to(device), [b.to(device) for b in calib], config=_cfg(cfg),
                                 progress=False)
    assert next(on_dev.parameters()).device.type == device.type
    pc, pd = on_cpu.export(), on_dev.export()
    step = 2.0 if cfg.endswith(":pow2") else 2 ** (1 / 16)
    moved = 0
    for row_c, row_d in zip(pc.layers, pd.layers):
        for a, b in zip(row_c, row_d):
            assert torch.equal(a.W.cpu(), b.W.cpu()) and torch.equal(a.R.cpu(), b.R.cpu())
            for n, s in a.scale.items():
                ratio = float((b.scale[n].cpu().double() / s.double()).max())
                ratio = max(ratio, 1 / float((b.scale[n].cpu().double() / s.double()).min()))
                assert ratio <= step * (1 + 1e-9), (n, ratio)
                moved += ratio != 1.0
    with torch.no_grad():
        ref = gru(x)[0]
        s_cpu, s_dev = _sqnr(ref, on_cpu(x)[0]), _sqnr(ref, on_dev(x.to(device))[0])
    assert abs(s_cpu - s_dev) <= 0.5 or min(s_cpu, s_dev) > 60, (s_cpu, s_dev, moved)
    if device.type == "cpu":
        assert moved == 0 and s_cpu == s_dev


def test_workflows_on_a_device(device, tmp_path):
    """On ``device``: calibrate + convert, compare, export() and save from the device model, load
    back with .to(device), the state_dict round trip, QAT training and convert_qat; each result
    equals the same model's on the CPU, bit for bit (every backend matches the golden model)."""
    gru = _gru(2).to(device)
    calib = [b.to(device) for b in _batches(3, seed=2)]
    x = _batches(1, seed=5)[0]
    m = qgru.QuantGRU.from_float(gru, config="w8a8")
    qgru.calibrate(m, calib, progress=False)
    m.convert()
    out = m(x.to(device))[0]
    assert out.device.type == device.type
    assert _same(out, copy.deepcopy(m).cpu()(x)[0])
    report = qgru.compare(gru, m, calib, verbose=False, progress=False)
    assert report.rows
    m.export().save(tmp_path / "m.qgru")
    loaded = qgru.load_params(tmp_path / "m.qgru").to_module().to(device)
    assert _same(loaded(x.to(device))[0], out)
    fresh = qgru.prepare_model(_gru(2), "w8a8").to(device)
    fresh.load_state_dict(m.state_dict())
    assert _same(fresh(x.to(device))[0], out)
    qat = qgru.prepare_qat(gru, calib, config="w8a8")
    opt = torch.optim.Adam(qat.parameters(), lr=1e-3)
    for b in calib:
        loss = qat(b)[0].pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.device.type == device.type for p in qat.parameters())
    qat.eval()
    with torch.no_grad():
        want = qat(x.to(device))[0]
    qgru.convert_qat(qat)
    assert _same(qat(x.to(device))[0], want)


def test_demo_on_a_device(device, tmp_path, capsys):
    """``python -m qgru demo --device ...`` with one config: the model, calibration and evaluation
    on that device; the table has the qgru row."""
    import argparse
    from qgru import demo
    ap = argparse.ArgumentParser()
    demo.add_arguments(ap)
    args = ap.parse_args(["--configs", "w8a8", "--scale-modes", "pow2", "--device", str(device),
                          "--out", str(tmp_path / "demo"), "--no-progress"])
    result = demo.run_cli(args)
    names = [r.name for r in result.rows]
    assert "qgru w8a8 (pow2)" in names and "float" in names
    assert next(result.models["qgru w8a8 (pow2)"].parameters()).device.type == device.type


def test_demo_refuses_a_device_it_cannot_use():
    from qgru import demo
    with pytest.raises(SystemExit, match="--device nowhere"):
        demo._demo_device("nowhere")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA GPU"):
            demo._demo_device("cuda")
