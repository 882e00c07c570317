"""The CUDA backend's speed paths (issue 34): no host synchronisation inside a forward, NaN without
one, a caller's torch.cuda.graph capture around a converted module, and the one-call Stack
(csrc/qgru_cuda.cpp CudaStack; QuantGRU._cuda_one_call, the streaming entry), each against the
reference backend on the CPU bit for bit.

Skipped without a CUDA device (torch.cuda.is_available() is False); where there is one, an
unavailable cuda backend is a failure (test_native's cuda_backend fixture).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qgru
from qgru import native

from test_native import _cfg, _converted, cuda_backend  # noqa: F401 (a fixture)

# a GPU busy for about this many cycles (torch.cuda._sleep): far longer than a forward's host side
_BUSY_CYCLES = 400_000_000


def _model(cfg: str, I: int, H: int, layers: int = 1, bidirectional: bool = False, seed: int = 0):
    """A fresh calibrated, converted QuantGRU (not test_native's cached one: these tests move it)."""
    return _converted.__wrapped__(_cfg(cfg), I, H, layers, bidirectional, False, seed)


def _reference(cfg: str, I: int, H: int, layers: int, bidirectional: bool, seed: int, x, h0):
    """The reference backend's (out, h_n) on the CPU for an identical model."""
    m = _model(cfg, I, H, layers, bidirectional, seed)
    with qgru.backend("reference"):
        out, h = m(x.cpu(), None if h0 is None else h0.cpu())
    return out, h


def _same(got, want, what=""):
    out, h = got[0].cpu(), got[1].cpu()
    bad = (out != want[0]).nonzero()
    assert out.dtype == want[0].dtype and out.shape == want[0].shape, what
    assert torch.equal(out, want[0]), f"{what}: outputs differ at {bad[:5].tolist()} ({len(bad)})"
    assert torch.equal(h, want[1]), f"{what}: h_n differs at {(h != want[1]).nonzero()[:5].tolist()}"


def _stack_layers(m, device="cuda:0"):
    """The CUDA Layers of the model's one-call Stack (native.cuda_stack_plan, made by its first
    call on the device; an error where the calls did not take the Stack)."""
    params = m._qparams_on[device]
    assert ("cuda-stack", device, len(params)) in params[0][0].__dict__["_native"], "the calls did not take the Stack"
    return [p.__dict__["_native"][("cuda", device, "")].layer for row in params for p in row]


SHAPES = [  # cfg, I, H, layers, bidirectional
    ("w8a8", 7, 12, 1, False),
    ("w8a16", 9, 20, 2, False),
    ("w16a16", 6, 10, 2, False),
    ("w8a8", 5, 8, 2, True),  # the general (layer-by-layer) path
]


@pytest.mark.parametrize("cfg,I,H,layers,bidi", SHAPES)
def test_cuda_module_is_the_reference(cuda_backend, cfg, I, H, layers, bidi):
    """A converted module on the GPU (the one-call Stack where it applies, the layer-by-layer path
    for a bidirectional one) gives the reference backend's floats bit for bit: lengths of one
    graph bucket (T = 33, 35, 36 share a plan of 36 steps), h0 given or not, float64 input, under
    inference_mode and after it, and inputs far outside the calibrated range."""
    m = _model(cfg, I, H, layers, bidi, seed=3).to("cuda")
    gen = torch.Generator().manual_seed(1)
    D = 2 if bidi else 1
    for i, (T, N, with_h, dtype) in enumerate([(33, 4, True, torch.float32), (35, 4, False, torch.float32),
                                               (36, 4, True, torch.float32), (36, 4, True, torch.float32),
                                               (5, 3, True, torch.float64), (1, 1, True, torch.float32)]):
        x = (torch.randn(T, N, I, generator=gen) * (1 + 20 * (i % 2))).to(dtype)
        h0 = torch.randn(layers * D, N, H, generator=gen).to(dtype) if with_h else None
        want = _reference(cfg, I, H, layers, bidi, 3, x, h0)
        ctx = torch.inference_mode() if i == 2 else torch.no_grad()
        with ctx:
            got = m(x.cuda(), None if h0 is None else h0.cuda())
        _same(got, want, f"call {i + 1} T={T} N={N} {dtype}")
    if not bidi:  # the Stack ran (its Layers' graphs replayed)
        assert all(layer.counters["replays"] >= 2 for layer in _stack_layers(m))


@pytest.mark.parametrize("N", [1, 64])
def test_cuda_streaming_calls_carrying_h(cuda_backend, N):
    """100 calls of one step carrying h (the streaming pattern of issue 34's bench) through the lean
    entry (after the first call, which moves the parameters, the general path is never taken):
    each call's output and state equal the reference's for the same step, and the whole run equals
    one call over the 100 steps."""
    cfg, I, H, layers = "w8a8", 16, 32, 2
    m = _model(cfg, I, H, layers, seed=5).to("cuda")
    ref = _model(cfg, I, H, layers, seed=5)
    gen = torch.Generator().manual_seed(2)
    xs = torch.randn(100, 1, N, I, generator=gen)
    h, h_ref = torch.zeros(layers, N, H, device="cuda"), torch.zeros(layers, N, H)
    outs = []
    with torch.no_grad():
        for t in range(100):
            out, h = m(xs[t].cuda(), h)
            with qgru.backend("reference"):
                want_out, h_ref = ref(xs[t], h_ref)
            outs.append(out)
            if t == 0:  # from here on the lean entry (QuantGRU._cuda_one_call), never the general path
                m._prepare = lambda *a: pytest.fail("a streaming call took the general path")
            if t % 10 == 0 or t == 99:
                _same((out, h), (want_out, h_ref), f"step {t}")
        with qgru.backend("reference"):
            whole_out, whole_h = ref(xs.reshape(100, N, I))
    _same((torch.cat(outs), h), (whole_out, whole_h), "100 one-step calls against one call")
    assert all(layer.counters["replays"] >= 90 for layer in _stack_layers(m))


def _returns_before_the_gpu(fn):
    """Runs fn() while the GPU is held busy (torch.cuda._sleep on the current stream) and says
    whether it returned before that work finished: a call that waited for the GPU on the host
    (item(), a synchronising copy, a stream or event synchronise) returns only after it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(_BUSY_CYCLES)
    result = fn()
    early = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return early, result


@pytest.mark.parametrize("cfg,I,H,layers,bidi", SHAPES)
def test_cuda_forward_does_not_synchronise(cuda_backend, cfg, I, H, layers, bidi):
    """After a first call of each shape (which makes the Layers, reads the parameters' values and
    sets up the plans), a forward enqueues its work and returns while the GPU is still busy with
    earlier work: nothing in it waits for the GPU on the host (the NaN flag read of issue 34 did,
    every call). Checked for a long call (graph replay), a streaming call (one step carrying h),
    an input holding NaN, and with torch's sync debug mode set to raise on any synchronising torch
    call."""
    m = _model(cfg, I, H, layers, bidi, seed=7).to("cuda")
    D = 2 if bidi else 1
    x_long = torch.randn(200, 8, I, device="cuda")
    x_step = torch.randn(1, 8, I, device="cuda")
    x_nan = x_step.clone()
    x_nan[0, 3, 1] = float("nan")
    h0 = torch.randn(layers * D, 8, H, device="cuda")
    with torch.no_grad():
        for _ in range(3):  # plans, captures
            m(x_long, h0)
            m(x_step, h0)
        qgru.cuda_nan_seen()
        for what, x in (("T=200", x_long), ("T=1", x_step), ("NaN input", x_nan)):
            early, _ = _returns_before_the_gpu(lambda: m(x, h0))
            assert early, f"{what}: the forward waited for the GPU"
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x in (x_long, x_step, x_nan):
                m(x, h0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert qgru.cuda_nan_seen() == {"input": True, "h0": False}


@pytest.mark.parametrize("cfg,I,H,layers,bidi", SHAPES)
def test_cuda_nan_quantizes_as_zero_and_sets_the_flag(cuda_backend, cfg, I, H, layers, bidi):
    """On CUDA, NaN in an input or h0 takes the quantized value of 0.0 (the reference's result for
    the input with NaN replaced by 0.0, bit for bit) and sets the device's flag, which
    qgru.cuda_nan_seen() reports per kind and clears; a call without NaN leaves it clear."""
    m = _model(cfg, I, H, layers, bidi, seed=9).to("cuda")
    D = 2 if bidi else 1
    gen = torch.Generator().manual_seed(4)
    x, h0 = torch.randn(6, 3, I, generator=gen), torch.randn(layers * D, 3, H, generator=gen)
    qgru.cuda_nan_seen()  # clear what earlier tests left
    with torch.no_grad():
        _same(m(x.cuda(), h0.cuda()), _reference(cfg, I, H, layers, bidi, 9, x, h0), "no NaN")
        assert qgru.cuda_nan_seen() == {"input": False, "h0": False}
        for where in ("input", "h0", "both"):
            xn, hn = x.clone(), h0.clone()
            if where in ("input", "both"):
                xn[2, 1, 0] = xn[5, 2, I - 1] = float("nan")
            if where in ("h0", "both"):
                hn[-1, 0, 1] = float("nan")
            got = m(xn.cuda(), hn.cuda())
            _same(got, _reference(cfg, I, H, layers, bidi, 9, xn.nan_to_num(0.0), hn.nan_to_num(0.0)), where)
            assert qgru.cuda_nan_seen(clear=False) == {"input": where != "h0", "h0": where != "input"}, where
            assert qgru.cuda_nan_seen() == {"input": where != "h0", "h0": where != "input"}, where
            assert qgru.cuda_nan_seen() == {"input": False, "h0": False}, where


@pytest.mark.parametrize("bidi", [False, True])
def test_cuda_nan_check_mode_raises(cuda_backend, monkeypatch, bidi):
    """QGRU_CUDA_NAN_CHECK=1 restores the synchronous check: NaN in an input or h0 is the CPU
    backend's ValueError naming it; a value other than 0 or 1 is a clear error."""
    layers = 2
    m = _model("w8a8", 5, 8, layers, bidi, seed=11).to("cuda")
    D = 2 if bidi else 1
    x, h0 = torch.randn(4, 2, 5, device="cuda"), torch.zeros(layers * D, 2, 8, device="cuda")
    with torch.no_grad():
        m(x, h0)
        monkeypatch.setenv("QGRU_CUDA_NAN_CHECK", "1")
        m(x, h0)  # no NaN: no error
        for where in ("input", "h0"):
            xn, hn = x.clone(), h0.clone()
            (xn if where == "input" else hn)[-1, 1, 2] = float("nan")
            with pytest.raises(ValueError, match=f"{where} contains NaN"):
                m(xn, hn)
        monkeypatch.setenv("QGRU_CUDA_NAN_CHECK", "yes")
        with pytest.raises(ValueError, match="QGRU_CUDA_NAN_CHECK"):
            m(x, h0)


@pytest.mark.parametrize("cfg,I,H,layers,bidi", SHAPES)
def test_cuda_module_inside_a_callers_graph_capture(cuda_backend, cfg, I, H, layers, bidi):
    """A converted module inside a caller's torch.cuda.graph (after warm-up calls, as torch
    advises): captured, then replayed on new data copied into the static input and h0, each replay
    equal to the reference; a one-step graph replayed 5 times with its h_n fed back equals the
    reference over those 5 steps; the module still runs outside the graph afterwards."""
    m = _model(cfg, I, H, layers, bidi, seed=13).to("cuda")
    D = 2 if bidi else 1
    gen = torch.Generator().manual_seed(8)
    for T in (12, 1):
        static_x = torch.randn(T, 3, I, device="cuda")
        static_h = torch.randn(layers * D, 3, H, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):
                m(static_x, static_h)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            out, h_n = m(static_x, static_h)
        for r in range(3):
            x, h0 = torch.randn(T, 3, I, generator=gen) * (1 + 10 * r), torch.randn(layers * D, 3, H, generator=gen)
            static_x.copy_(x)
            static_h.copy_(h0)
            g.replay()
            torch.cuda.synchronize()
            _same((out, h_n), _reference(cfg, I, H, layers, bidi, 13, x, h0), f"T={T} replay {r + 1}")
        if T == 1 and not bidi:  # streaming (one direction: a reverse one does not carry over calls)
            xs = torch.randn(5, 3, I, generator=gen)
            h0 = torch.randn(layers * D, 3, H, generator=gen)
            static_h.copy_(h0)
            outs = []
            for t in range(5):
                static_x.copy_(xs[t:t + 1])
                g.replay()
                outs.append(out.clone())
                static_h.copy_(h_n)
            torch.cuda.synchronize()
            _same((torch.cat(outs), h_n), _reference(cfg, I, H, layers, bidi, 13, xs, h0), "5 replays carrying h")
        del g
    x = torch.randn(4, 2, I, generator=gen)
    with torch.no_grad():
        _same(m(x.cuda()), _reference(cfg, I, H, layers, bidi, 13, x, None), "after the captures")


def test_cuda_nan_check_mode_inside_a_capture_is_a_clear_error(cuda_backend, monkeypatch):
    """The synchronous check (QGRU_CUDA_NAN_CHECK=1) reads a flag on the host, which a capture
    forbids: inside torch.cuda.graph it is a RuntimeError saying so, raised before any work is
    enqueued; the module runs again after it."""
    m = _model("w8a8", 7, 12, seed=15).to("cuda")
    x = torch.randn(3, 2, 7, device="cuda")
    with torch.no_grad():
        want, _ = m(x)
        monkeypatch.setenv("QGRU_CUDA_NAN_CHECK", "1")
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="QGRU_CUDA_NAN_CHECK=1 reads each call's NaN flag"):
            with torch.cuda.graph(g):
                m(x)
        got, _ = m(x)
    assert torch.equal(got, want)


# On an H200 (torch 2.11.0+cu130, 2026-11-27 and 2026-11-28) this test crashed its process: every
# native check whose message formatted a number did (constructors and plain functions, both
# extensions; scripts/cuda_triage.py). csrc/qgru_check.h formats them without iostreams; with it the
# test passed on the same machine (2026-11-28 08:47).
def test_cuda_stack_checks_its_values(cuda_backend):
    """The CUDA Stack checks its per-layer values against its Layers when it is made (as the CPU
    Stack does): a wrong x bit count, an h zero point its Layer does not have, a non-integer
    value, a row count that is not one per Layer."""
    m = _model("w8a8", 6, 10, 2, seed=17)
    params = [[p.to("cuda") for p in row] for row in m._qparams]
    layers = [native._cuda_layer(p, torch.device("cuda:0")).layer for (p,) in params]
    rows = native.stack_values(params)
    Stack = native.load("cuda").Stack
    Stack(layers, rows)  # the right values
    for l, i, v, match in [(0, 2, rows[0][2] + 1, "-bit x"), (1, 4, rows[1][4] + 1, "zero point"),
                           (1, 6, 0.5, "not an integer")]:
        bad = [list(r) for r in rows]
        bad[l][i] = v
        with pytest.raises(RuntimeError, match=match):
            Stack(layers, bad)
    with pytest.raises(RuntimeError, match="one parameter row per Layer"):
        Stack(layers, rows[:1])
    with pytest.raises(RuntimeError, match="h0 must be"):
        Stack(layers, rows).forward(torch.zeros(2, 3, 6, device="cuda"), torch.zeros(1, 3, 10, device="cuda"))


@pytest.mark.parametrize("case", ["cuda_layer_empty", "cuda_stack_bad", "cuda_stack_rows_missing",
                                  "cuda_quantize_bad_bits", "cpu_stack_bad"])
def test_cuda_calls_that_raise_do_not_crash(cuda_backend, case):
    """Each native call given a bad value raises a Python error and the process lives on:
    constructors (a Layer with no tensors, a Stack with a bad value or a missing row) and plain
    functions, each in a child process (scripts/cuda_triage.py --case), so that a crash fails this
    case alone with its faulthandler output."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "cuda_triage.py"
    r = subprocess.run([sys.executable, "-X", "faulthandler", str(script), "--case", case], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "raised" in r.stdout, (r.returncode, (r.stdout + r.stderr)[-3000:])
