"""Streaming: a converted QuantGRU run chunk by chunk, h_n passed back as h0, is bit-exact.

Why it holds. Between two calls the state leaves the integer model and comes back:
``h_n = dequantize(q) = float32(float64((q - Z) * S))`` and the next call's
``q' = quantize(h_n) = saturate(round_half_up(float64(h_n) / S) + Z)``. With a = q - Z we have
|a| <= 2^16 - 1 < 2^16 (q and Z both lie in a signed range of at most 16 bits), and

    float64(h_n) / S = a (1 + e1)(1 + e2)(1 + e3),  |e1|, |e3| <= 2^-53 (float64 product, quotient),
                                                    |e2| <= 2^-24 (the float32 rounding),

so |float64(h_n) / S - a| < 2^16 * (2^-24 + 2^-51) < 2^-8 + 2^-35 < 1/2: rounding half up returns a
exactly, the clamp in quantize (to [qmin - Z - 1, qmax - Z + 1]) and the final saturation leave
a + Z = q alone, and q' = q. (In pow2 mode e1 = e2 = e3 = 0: a has at most 16 significant bits and
S is a power of two, so every step is exact.) The float32 bound assumes (q - Z) S is a normal
float32, which holds for every grid choose_qparams makes (S >= 1e-8 / 65535, far above 2^-126).
Everything else the next call computes depends only on q and the integer parameters, so a
sequence cut anywhere gives the same integers as the uncut sequence. docs/spec.md has the same
argument; ``test_state_round_trip_every_q`` checks it for every q of 8- and 16-bit grids.

A bidirectional GRU cannot stream: its reverse direction starts at the *end* of the sequence,
which a chunk does not have yet. Models with float16/bfloat16 state are not covered (a 16-bit
state does not fit their mantissa); float32 and float64 are.
"""
from __future__ import annotations

import importlib
import itertools
import math

import pytest
import torch

import qgru
from qgru.primitives import choose_qparams, dequantize, qrange, quantize

backends_mod = importlib.import_module("qgru.backends")

T, N, I, H = 23, 3, 5, 6
CONFIGS = ("w8a8", "w8a16", "w16a16")
MODES = ("pow2", "multiplier")
CHUNKS = (1, 7, T)


def _cpu_available() -> bool:
    return qgru.backends()["cpu"]["available"]


def _backend_or_skip(name: str):
    if name != "reference" and not _cpu_available():
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    return qgru.backend(name)


_MODELS = {}


def _model(config: str, mode: str, layers: int, batch_first: bool) -> qgru.QuantGRU:
    key = (config, mode, layers, batch_first)
    if key not in _MODELS:
        torch.manual_seed(hash(key) % 1000)
        cfg = qgru.QuantConfig.load(config, overrides={"scale_mode": mode})
        m = qgru.QuantGRU(I, H, num_layers=layers, batch_first=batch_first, config=cfg)
        shape = (N, T, I) if batch_first else (T, N, I)
        qgru.calibrate(m, [torch.randn(shape) for _ in range(3)], progress=False)
        _MODELS[key] = m.convert()
    return _MODELS[key]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("config,mode,layers,batch_first",
                         list(itertools.product(CONFIGS, MODES, (1, 2), (False, True))))
def test_chunks_equal_whole_sequence(backend, config, mode, layers, batch_first):
    m = _model(config, mode, layers, batch_first)
    gen = torch.Generator().manual_seed(7)
    time_dim = 1 if batch_first else 0
    shape = (N, T, I) if batch_first else (T, N, I)
    x = 1.5 * torch.randn(shape, generator=gen)  # wider than calibration: x saturates too
    h0 = 0.5 * torch.randn(layers, N, H, generator=gen)
    with _backend_or_skip(backend):
        for start in (None, h0):
            whole, h_whole = m(x, start)
            for chunk in CHUNKS:
                outs, h = [], start
                for piece in x.split(chunk, dim=time_dim):
                    out, h = m(piece, h)
                    outs.append(out)
                assert torch.equal(torch.cat(outs, dim=time_dim), whole), (chunk, start is None)
                assert torch.equal(h, h_whole), (chunk, start is None)


def _grids(bits: int, power_of_two: bool):
    """(scale, zero point) pairs: random ranges over many magnitudes, and the extreme zero points."""
    gen = torch.Generator().manual_seed(bits * 2 + power_of_two)
    ranges = [(0.0, 1.0), (-1.0, 0.0), (-1.0, 1.0), (-1e-8, 0.0), (0.0, 1e-8), (-3e4, 1.0),
              (-0.37, 0.91), (-math.pi, math.e)]
    for _ in range(16):
        mag = 10 ** (torch.rand(2, generator=gen, dtype=torch.float64) * 10 - 6)
        ranges.append((-float(mag[0]) * float(torch.rand(1, generator=gen)), float(mag[1])))
    qmin, qmax = qrange(bits)
    for lo, hi in ranges:
        for symmetric in (False, True):
            s, z = choose_qparams(torch.tensor(lo), torch.tensor(hi), bits, symmetric, power_of_two)
            yield s, z
        # the same scale with the extreme zero points: |q - Z| up to 2^bits - 1
        for z in (qmin, qmax):
            yield s, torch.tensor(z)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("mode", MODES)
def test_state_round_trip_every_q(bits, mode):
    """quantize(dequantize(q)) == q for every q of the grid, on golden's and the cpu backend's ops."""
    lo, hi = qrange(bits)
    q = torch.arange(lo, hi + 1, dtype=torch.int64)
    grids = list(_grids(bits, mode == "pow2"))
    assert {lo, hi} <= {int(z) for _, z in grids}  # the widest |q - Z| (2^bits - 1) is covered
    # golden primitives, every grid at once: rows are grids, columns every q
    S = torch.stack([s for s, _ in grids]).reshape(-1, 1)
    Z = torch.stack([z for _, z in grids]).reshape(-1, 1)
    v = dequantize(q.expand(len(grids), -1), S, Z)
    assert v.dtype == torch.float32
    back = quantize(v, S, Z, bits)
    bad = (back != q).nonzero()
    assert bad.numel() == 0, [(float(S[i]), int(Z[i]), int(q[j])) for i, j in bad[:3].tolist()]
    # the cpu backend's one-pass boundary ops (what the module runs by default)
    if _cpu_available():
        ops = backends_mod._REGISTRY["cpu"].boundary
        for s, z in grids:
            v = ops.dequantize(q, s, z)
            assert v.dtype == torch.float32
            assert torch.equal(ops.quantize(v, s, z, bits, "h0").to(torch.int64), q), (float(s), int(z))


def test_round_trip_bound_is_tight_enough():
    """The proof's margin: (1 + e1)(1 + e2)(1 + e3) - 1 <= 2^-24 + 2^-51, times 2^16, is far below 1/2."""
    from fractions import Fraction as F
    worst = (1 + F(1, 2 ** 53)) ** 2 * (1 + F(1, 2 ** 24)) - 1
    assert worst <= F(1, 2 ** 24) + F(1, 2 ** 51)
    assert (2 ** 16 - 1) * (F(1, 2 ** 24) + F(1, 2 ** 51)) < F(1, 2 ** 8) + F(1, 2 ** 35) < F(1, 2)
    assert torch.finfo(torch.float32).eps == 2 ** -23  # unit roundoff 2^-24


# ---------------------------------------------------------------------------------------------
# The one-call fast path (QuantGRU._cpu_one_call): a streaming call skips the general path's
# Python checks and dispatch; it must take every call it can, give the general path's results,
# and hand everything else to the general path (which raises what it must)
# ---------------------------------------------------------------------------------------------
def _general_only(monkeypatch):
    monkeypatch.setattr(qgru.QuantGRU, "_cpu_one_call", lambda self, input, hx: None)


def _refuse_general(monkeypatch):
    def refuse(self, input, hx):
        raise AssertionError("the general path ran")
    monkeypatch.setattr(qgru.QuantGRU, "_check_input", refuse)


@pytest.mark.parametrize("config,mode,layers", list(itertools.product(CONFIGS, MODES, (1, 2))))
@pytest.mark.parametrize("mode_ctx", ["grad", "no_grad", "inference_mode"])
def test_one_call_path_taken_and_equal_to_general(monkeypatch, config, mode, layers, mode_ctx):
    """Time-major float32 CPU calls (T = 1 and T = 23, h0 given or not) take the one-call path
    (the general path's _check_input would raise here) and equal the general path bit for bit."""
    if not _cpu_available():
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    m = _model(config, mode, layers, False)
    gen = torch.Generator().manual_seed(11)
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode_ctx]
    calls = [(torch.randn(1, 1, I, generator=gen), torch.randn(layers, 1, H, generator=gen)),
             (torch.randn(T, N, I, generator=gen), None)]
    with monkeypatch.context() as mp:
        _general_only(mp)
        with ctx():
            want = [m(x, h) for x, h in calls]
    with monkeypatch.context() as mp:
        _refuse_general(mp)
        with ctx():
            got = [m(x, h) for x, h in calls]
    for (o, h), (wo, wh) in zip(got, want):
        assert torch.equal(o, wo) and torch.equal(h, wh)
        assert o.dtype == torch.float32 and o.shape == wo.shape and h.shape == wh.shape


@pytest.mark.parametrize("case", ["batch_first", "float64", "unbatched", "packed", "T0", "bad_I", "bad_h0",
                                  "h0_float64", "neg_view", "reference", "bidirectional", "h0_neg_view",
                                  "h0_layers", "h0_batch", "sparse", "h0_subclass"])
def test_one_call_path_leaves_other_calls_to_the_general_path(monkeypatch, case):
    """Every call outside the fast path's form reaches the general path (which checks it, and
    raises nn.GRU's errors where it must): the fast path never accepts what it does not check."""
    if not _cpu_available():
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    m = _model("w8a8", "multiplier", 1, case == "batch_first")
    if case == "bidirectional":
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, bidirectional=True)
        qgru.calibrate(m, [torch.randn(T, N, I)], progress=False)
        m.convert()
    x, h = torch.randn(T, N, I), torch.zeros(1 + (case == "bidirectional"), N, H)
    x, h, ctx = {
        "batch_first": (x.transpose(0, 1), h, None), "float64": (x.double(), h, None),
        "unbatched": (x[:, 0], h[:, 0], None),
        "packed": (torch.nn.utils.rnn.pack_padded_sequence(x, torch.full((N,), T), enforce_sorted=False), h, None),
        "T0": (x[:0], h, None), "bad_I": (x[..., :-1], h, None), "bad_h0": (x, h[:, :-1], None),
        "h0_float64": (x, h.double(), None), "neg_view": (torch._neg_view(x), h, None),
        "reference": (x, h, "reference"), "bidirectional": (x, h, None),
        "h0_neg_view": (x, torch._neg_view(h), None), "h0_layers": (x, torch.zeros(2, N, H), None),
        "h0_batch": (x, h[:, :-1], None), "sparse": (x.to_sparse(), h, None),
        "h0_subclass": (x, torch.nn.Parameter(h), None),
    }[case]
    seen = []

    def check(self, input, hx):
        seen.append(case)
        raise RuntimeError("general path")
    monkeypatch.setattr(qgru.QuantGRU, "_check_input", check)
    with pytest.raises(RuntimeError, match="general path"):
        if ctx is None:
            m(x, h)
        else:
            with qgru.backend(ctx):
                m(x, h)
    assert seen == [case]


# ---------------------------------------------------------------------------------------------
# x levels (issue 31, config x.dynamic): the one-call stack quantizes each token of the input on
# its own level (native quantize_levels) and runs the first layer's W.x on it
# ---------------------------------------------------------------------------------------------
_LEVEL_MODELS = {}


def _levels_model(config: str, mode: str, layers: int) -> qgru.QuantGRU:
    key = (config, mode, layers)
    if key not in _LEVEL_MODELS:
        torch.manual_seed(len(_LEVEL_MODELS) + 5)
        cfg = qgru.QuantConfig.load(config, overrides={"scale_mode": mode, "tensors": {"x": {"dynamic": True}}})
        m = qgru.QuantGRU(I, H, num_layers=layers, config=cfg)
        qgru.calibrate(m, [torch.randn(T, N, I) for _ in range(3)], progress=False)
        _LEVEL_MODELS[key] = m.convert()
        assert m._qparams[0][0].x_levels is not None
    return _LEVEL_MODELS[key]


def _spread_tokens(shape, gen: torch.Generator) -> torch.Tensor:
    """randn tokens, each scaled by its own factor in [0.3, 5]: inside and far outside calibration."""
    f = torch.exp(torch.rand(tuple(shape[:-1]) + (1,), generator=gen) * (math.log(5) - math.log(0.3)) + math.log(0.3))
    return torch.randn(shape, generator=gen) * f


@pytest.mark.parametrize("config,mode,layers", list(itertools.product(CONFIGS, MODES, (1, 2))))
def test_x_levels_one_call_stack_streams_like_reference(monkeypatch, config, mode, layers):
    """With x levels: streaming calls (T = 1, N = 1; and chunks of a batch of 3 and of 20) take the
    one-call stack (the general path's _check_input would raise), equal the reference backend bit
    for bit, and chunks equal the whole sequence."""
    if not _cpu_available():
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    m = _levels_model(config, mode, layers)
    gen = torch.Generator().manual_seed(17)
    for n in (1, N, 20):
        x = _spread_tokens((T, n, I), gen)
        h0 = 0.5 * torch.randn(layers, n, H, generator=gen)
        with qgru.backend("reference"):
            want, h_want = m(x, h0)
        for chunk in (1, 7, T):
            with monkeypatch.context() as mp:
                _refuse_general(mp)
                outs, h = [], h0
                for piece in x.split(chunk):
                    out, h = m(piece, h)
                    outs.append(out)
            assert torch.equal(torch.cat(outs), want), (n, chunk)
            assert torch.equal(h, h_want), (n, chunk)


# ---------------------------------------------------------------------------------------------
# A one-step call's threads (csrc/cpu/qgru_cpu.cpp fused_steps: one per task, and one per
# kMinStepMacs of a step's multiply-adds): results never depend on the thread count
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", ["w8a8", "w8a16"])
@pytest.mark.parametrize("size", [(16, 160), (8, 256), (64, 256), (256, 512)])
def test_one_step_calls_equal_reference_on_one_and_two_threads(monkeypatch, config, size):
    """Shapes of one and two fused tasks below and above the thread threshold (84K, 203K, 246K
    and 1.2M multiply-adds a step): T = 1 calls carrying h at batch 1 and 3, and a chunk of 9
    steps, on 1 and 2 torch threads, equal the reference backend bit for bit."""
    if not _cpu_available():
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    i_size, h_size = size
    torch.manual_seed(3)
    m = qgru.QuantGRU(i_size, h_size, config=config)
    qgru.calibrate(m, [torch.randn(12, 4, i_size) for _ in range(2)], progress=False)
    m.convert()
    gen = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n in (1, 3):
                xs, h0 = torch.randn(9, n, i_size, generator=gen), 0.5 * torch.randn(1, n, h_size, generator=gen)
                with qgru.backend("reference"):
                    want, h_want = m(xs, h0)
                with monkeypatch.context() as mp:
                    _refuse_general(mp)
                    outs, h = [], h0
                    for t in range(xs.shape[0]):
                        out, h = m(xs[t:t + 1], h)
                        outs.append(out)
                    whole, h_whole = m(xs, h0)
                assert torch.equal(torch.cat(outs), want) and torch.equal(h, h_want), (threads, n)
                assert torch.equal(whole, want) and torch.equal(h_whole, h_want), (threads, n)
    finally:
        torch.set_num_threads(before)
