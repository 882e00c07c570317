"""The native backends (csrc/, qgru/native/, qgru/backends.py) against the reference backend.

The golden model (qgru/golden.py) is the specification: every native backend must reproduce it
bit for bit, for every config the config loader accepts, every shape nn.GRU accepts and any
input, including inputs far outside the calibrated range. Two levels are checked:

* integers: ``native.gru_direction(kind)(p, qx, qh0, lengths)`` against ``golden.gru_direction`` on
  random integer inputs spanning the whole x/h range (saturated extremes included), with
  LayerParams derived from random weights and random (often extreme) calibration ranges;
* modules: a converted QuantGRU forced onto each backend, floats compared with torch.equal.

Then the registry: availability report, default selection, the warn-once fallback, forcing,
refusing a stale binary, QGRU_NO_BUILD, and the layer preparation (weight limbs).

A "cuda" case runs on CUDA tensors when ``qgru.backends()["cuda"]`` says it is available and is
skipped with the reported reason otherwise. QGRU_NATIVE_EXAMPLES=N scales the hypothesis tests.
"""
from __future__ import annotations

import functools
import importlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import textwrap
import threading
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import qgru
from qgru import golden, native, primitives
from qgru.config import GRANULARITIES, TENSOR_NAMES, QuantConfig
from qgru.convert import derive_layer_params
from qgru.primitives import qrange, quantize_multipliers, split_int8_limbs

# `qgru.backends` is the function (re-exported by qgru/__init__), which hides the submodule
backends_mod = importlib.import_module("qgru.backends")
# the submodules of qgru.native that own the names the tests replace (monkeypatch): the package
# re-exports them, but the code that reads them reads its own module's global
native_build = importlib.import_module("qgru.native.build")
native_cpu = importlib.import_module("qgru.native.cpu")

NATIVE_KINDS = ("cpu", "cuda")
_EXAMPLES = int(os.environ.get("QGRU_NATIVE_EXAMPLES", "0")) or None


def _examples(default: int) -> int:
    return _EXAMPLES or default


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _device(kind: str) -> torch.device:
    return torch.device("cuda" if kind == "cuda" else "cpu")


def _backend(kind: str) -> str:
    """The registry's backend name of a test kind ("cpu:avx2" is the cpu backend on its avx2 path)."""
    return kind.split(":")[0]


CPU_PATHS = ("portable", "avx2", "avxvnni", "avx512vnni", "amx")


def _cuda_must_be_available(name: str, why: str) -> None:
    """Where torch sees a CUDA device, an unavailable cuda backend (a build or link failure) is a
    failure with its reason, never a skip: a skip would leave every CUDA case unrun and the suite
    green."""
    if name == "cuda" and torch.cuda.is_available():
        pytest.fail(f"torch sees a CUDA device ({torch.cuda.get_device_name()}) but the cuda backend is "
                    f"unavailable: {why}", pytrace=False)


def test_unavailable_cuda_backend_fails_where_torch_sees_a_gpu(monkeypatch):
    """The rule the fixtures apply, checked here without a GPU: with a device, an unavailable cuda
    backend is a failure carrying its reason; without one, the caller skips."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test GPU")
    with pytest.raises(pytest.fail.Exception, match=r"a test GPU.*unavailable: the link failed \(test\)"):
        _cuda_must_be_available("cuda", "the link failed (test)")
    _cuda_must_be_available("cpu", "not built (test)")  # only cuda has the rule
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _cuda_must_be_available("cuda", "the link failed (test)")


def _require_cuda_backend() -> str:
    """The cuda_backend fixture's body: skipped without a CUDA device, a failure if one is there and
    the backend does not load, else "cuda"."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    why = qgru.backends()["cuda"]["why"]
    if why:
        _cuda_must_be_available("cuda", why)
    return "cuda"


@pytest.fixture(scope="module")
def cuda_backend():
    """For the CUDA-only tests (see _require_cuda_backend)."""
    return _require_cuda_backend()


def test_cuda_backend_fixture_on_a_machine_with_a_gpu(monkeypatch):
    """What the fixture does where torch sees a GPU, checked without one (on 81e8d62 it failed every
    test that used it on a GPU machine, the backend loaded or not): with the backend loaded it
    gives "cuda"; with the backend unavailable it fails with the reason; with no GPU it skips."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test GPU")
    loaded = {"cuda": {"available": True, "why": ""}}
    monkeypatch.setattr(qgru, "backends", lambda: loaded)
    assert _require_cuda_backend() == "cuda"
    loaded["cuda"] = {"available": False, "why": "the link failed (test)"}
    with pytest.raises(pytest.fail.Exception, match=r"a test GPU.*unavailable: the link failed \(test\)"):
        _require_cuda_backend()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pytest.skip.Exception, match="no CUDA device"):
        _require_cuda_backend()


@pytest.fixture(scope="module", params=("cuda",) + tuple(f"cpu:{p}" for p in CPU_PATHS))
def kind(request):
    """Each native backend, and the cpu backend once per instruction-set path (QGRU_CPU_ISA);
    skipped, with the reason, where the backend or the path is unavailable (an AVX2-only machine
    runs portable and avx2, an AMX machine all four)."""
    name = _backend(request.param)
    why = qgru.backends()[name]["why"]
    if why:
        _cuda_must_be_available(name, why)
        pytest.skip(f"{name} backend unavailable: {why}")
    if name != "cpu":
        yield request.param
        return
    path = request.param.split(":")[1]
    info = {i["name"]: i for i in native.cpu_paths()}[path]
    if not info["usable"]:
        pytest.skip(f"cpu path {path} cannot run here: {info['why']}")
    before = os.environ.get("QGRU_CPU_ISA")
    os.environ["QGRU_CPU_ISA"] = path
    try:
        yield request.param
    finally:
        if before is None:
            os.environ.pop("QGRU_CPU_ISA")
        else:
            os.environ["QGRU_CPU_ISA"] = before


def _expected_gemm(kind: str, p) -> str:
    """The GEMM path (NativeLayer.gemm) a Layer of this test kind must take for these parameters:
    the cpu path's name, with "-fused" when both GEMMs take one limb pair (x, h, W, R of at most
    8 bits; on an int16 path, or an int8 path with an int16 sibling (avx512vnni), a 16-bit x or h
    times 8-bit weights where the int32 bound holds)."""
    if kind == "cuda":
        return "cublas"
    path = kind.split(":")[1] if ":" in kind else native.layer_path(p, native.resolve_cpu_isa()["name"],
                                                                     native.cpu_isa_request())
    return path + ("-fused" if native.one_limb_pair(p, native.layer_act16(p, path)) else "")


@pytest.fixture(scope="module")
def cpu_backend():
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")
    return "cpu"


# ---------------------------------------------------------------------------------------------
# Configs and converted modules
# ---------------------------------------------------------------------------------------------
@st.composite
def config_dicts(draw):
    """A built-in config in either scale mode, or random per-tensor overrides of every field the
    loader accepts (bits down to its minimum, symmetry, granularity, group size, headroom)."""
    mode = draw(st.sampled_from(["pow2", "multiplier"]))
    name = draw(st.sampled_from(["w8a8", "w8a16", "w16a16", "random", "random"]))
    if name != "random":
        return QuantConfig.load(name, overrides={"scale_mode": mode}).to_dict()
    tensors = {}
    for n in TENSOR_NAMES:
        spec = {"bits": draw(st.integers(4 if n.endswith("_pre") else 2, 16))}
        if n not in ("z", "r", "g"):
            gran = draw(st.sampled_from(GRANULARITIES[n]))
            spec["granularity"] = gran
            if gran == "per_group":
                spec["group_size"] = draw(st.sampled_from([1, 2, 3, 5, 7, 16, 64]))
        if n in ("x", "h", "Wx", "Rh", "z_pre", "r_pre", "g_pre"):
            spec["symmetric"] = draw(st.booleans())
            spec["headroom"] = draw(st.sampled_from([1.0, 1.5, 4.0]))
        tensors[n] = spec
    if draw(st.booleans()):  # the optional R.h operand: the state h requantized to <= h's bits
        tensors["h_gemm"] = {"bits": draw(st.integers(2, tensors["h"]["bits"])), "symmetric": draw(st.booleans()),
                             "headroom": draw(st.sampled_from([1.0, 1.5]))}
    return {"name": "random", "scale_mode": mode,
            "observer": {"kind": draw(st.sampled_from(["percentile", "minmax", "ema", "ema_step"])), "momentum": 0.5},
            "tensors": tensors}


@functools.lru_cache(maxsize=64)
def _converted(cfg_json: str, I: int, H: int, layers: int = 1, bidirectional: bool = False,
               batch_first: bool = False, seed: int = 0) -> qgru.QuantGRU:
    """A calibrated, converted QuantGRU (cached: conversion is the slow part of these tests)."""
    torch.manual_seed(seed)
    m = qgru.QuantGRU(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                      config=json.loads(cfg_json))
    qgru.calibrate(m, [torch.randn(5, 3, I) for _ in range(2)], progress=False)
    return m.convert()


def _cfg(name: str, **overrides) -> str:
    return QuantConfig.load(name, overrides=overrides or None).to_json()


def _to(v, device):
    if v is None:
        return None
    return v.to(device)  # Tensor and PackedSequence alike


def _run(m: qgru.QuantGRU, backend: str, device: torch.device, x, h0=None):
    """m(x, h0) with ``backend`` (a test kind) forced and everything on ``device``; results back on the CPU."""
    m.to(device)
    try:
        with qgru.backend(_backend(backend)):
            out, h_n = m(_to(x, device), _to(h0, device))
    finally:
        m.to("cpu")
    return _to(out, "cpu"), h_n.cpu()


def _assert_same(a, b):
    (out_a, h_a), (out_b, h_b) = a, b
    if isinstance(out_a, PackedSequence):
        assert isinstance(out_b, PackedSequence)
        assert torch.equal(out_a.batch_sizes, out_b.batch_sizes)
        for f in ("sorted_indices", "unsorted_indices"):
            ia, ib = getattr(out_a, f), getattr(out_b, f)
            assert (ia is None and ib is None) or torch.equal(ia, ib)
        out_a, out_b = out_a.data, out_b.data
    assert out_a.shape == out_b.shape and h_a.shape == h_b.shape
    bad = (out_a != out_b).nonzero()
    assert torch.equal(out_a, out_b), f"outputs differ at {bad[:5].tolist()} ({len(bad)} elements)"
    assert torch.equal(h_a, h_b), f"h_n differs at {(h_a != h_b).nonzero()[:5].tolist()}"


def _forget_native(m: qgru.QuantGRU) -> None:
    """Drop the native Layers cached on m's LayerParams (native.gru_direction makes them on use)."""
    for rows in m._qparams_on.values():
        for row in rows:
            for p in row:
                p.__dict__.pop("_native", None)


def _assert_native_ran(m: qgru.QuantGRU, kind: str) -> None:
    """Guard against a vacuous comparison: after _forget_native(m), running on ``kind`` must have
    made a native Layer for every layer and direction."""
    dev_type = _device(kind).type
    rows = [row for key, rs in m._qparams_on.items() if key.startswith(dev_type) for row in rs]
    if _backend(kind) == "cpu":
        # the calls the native Stack does not take ran on the module's Model (native.cpu_op_model:
        # the operator's C++), whose Layers are its own: their GEMM paths, in layer-direction order
        model = rows and rows[0][0].__dict__.get("_native", {}).get(("cpu-model", native.cpu_isa_request()))
        if model:
            assert model[1].gemm_paths == [_expected_gemm(kind, p) for row in m._qparams_on["cpu"] for p in row], \
                (model[1].gemm_paths, kind)
            return
    assert rows and all(any(k[0] == _backend(kind) for k in p.__dict__.get("_native", {})) for row in rows for p in row), \
        f"the {kind} backend was not used"
    for p in (p for row in rows for p in row):
        for key, layer in p.__dict__["_native"].items():
            if key[0] != _backend(kind):
                continue
            assert layer.gemm == _expected_gemm(kind, p), (layer.gemm, p.bits)


def _far_inputs(x: torch.Tensor, scale: float, inf: bool, gen: torch.Generator) -> torch.Tensor:
    """x scaled (1000x lands far outside the calibrated range) and optionally with +-inf entries."""
    x = x * scale
    if inf and x.numel():
        mask = torch.rand(x.shape, generator=gen) < 0.15
        sign = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)
        x = torch.where(mask, sign * float("inf"), x)
    return x


# ---------------------------------------------------------------------------------------------
# 1a. Integer level: native gru_direction == golden gru_direction, any params, any integers
# ---------------------------------------------------------------------------------------------
@st.composite
def ranges_for(draw, H: int, config: QuantConfig):
    """Observer ranges as convert() receives them: from tiny to huge, straddling or one-sided."""
    def one():
        mag = 2.0 ** draw(st.integers(-8, 8))
        shape = draw(st.sampled_from(["both", "both", "pos", "neg", "skew"]))
        lo, hi = {"both": (-mag, mag), "pos": (0.0, mag), "neg": (-mag, 0.0), "skew": (-mag / 37, mag)}[shape]
        return lo, hi

    out = {}
    for n in ("x", "h", "Wx", "Rh", "r_pre", "z_pre", "g_pre"):
        lo, hi = one()
        if n in ("Wx", "Rh") and config[n].granularity != "per_tensor":
            g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
            spread = 0.01 + 0.99 * torch.rand(3 * H, generator=g, dtype=torch.float64)  # per channel
            out[n] = (lo * spread, hi * spread)
        else:
            out[n] = (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    return out


def _random_layer(config: QuantConfig, I: int, H: int, ranges, w_exp: int, b_exp: Optional[int],
                  zero_row: bool, seed: int) -> golden.LayerParams:
    """Weights ~ 2^w_exp, biases ~ 2^b_exp (None: no bias); a large b_exp saturates the int32 biases."""
    g = torch.Generator().manual_seed(seed)
    w_ih = torch.randn(3 * H, I, generator=g) * 2.0 ** w_exp
    w_hh = torch.randn(3 * H, H, generator=g) * 2.0 ** w_exp
    if zero_row:  # an all-zero weight row (scale from the minimum range)
        w_ih[0] = 0
        w_hh[-1] = 0
    b_ih = torch.randn(3 * H, generator=g) * 2.0 ** b_exp if b_exp is not None else None
    b_hh = torch.randn(3 * H, generator=g) * 2.0 ** b_exp if b_exp is not None else None
    return derive_layer_params(w_ih, w_hh, b_ih, b_hh, ranges, config)


def _random_ints(shape, bits: int, gen: torch.Generator) -> torch.Tensor:
    """Uniform over the whole ``bits`` range, with about a third of the entries at either extreme."""
    lo, hi = qrange(bits)
    q = torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64)
    u = torch.rand(shape, generator=gen)
    return torch.where(u < 0.17, lo, torch.where(u < 0.34, hi, q))


def _random_inputs(p: golden.LayerParams, T: int, N: int, with_lengths: bool, gen: torch.Generator):
    """qx [T, N, I], qh0 [N, H] over their whole ranges, and lengths [N] in [0, T] (or None)."""
    qx = _random_ints((T, N, p.input_size), p.bits["x"], gen)
    qh0 = _random_ints((N, p.hidden_size), p.bits["h"], gen)
    lengths = torch.randint(0, T + 1, (N,), generator=gen) if with_lengths else None
    return qx, qh0, lengths


def _check_integer(kind: str, p: golden.LayerParams, T: int, N: int, with_lengths: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qx, qh0, lengths = _random_inputs(p, T, N, with_lengths, gen)
    want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
    dev = _device(kind)
    pd = p
    if dev.type != "cpu":  # one device copy of p, so its native Layer (and plan) serve every call with it
        copies = p.__dict__.setdefault("_test_device_copies", {})
        if str(dev) not in copies:
            copies[str(dev)] = p.to(dev)
        pd = copies[str(dev)]
    got_out, got_h = native.gru_direction(_backend(kind))(pd, qx.to(dev), qh0.to(dev), _to(lengths, dev))
    assert {layer.gemm for layer in pd.__dict__["_native"].values()} == {_expected_gemm(kind, p)}
    assert got_out.dtype == torch.int32 and got_h.dtype == torch.int32
    assert got_out.shape == (T, N, p.hidden_size) and got_h.shape == (N, p.hidden_size)
    got_out, got_h = got_out.cpu().long(), got_h.cpu().long()
    bad = (got_out != want_out).nonzero()
    assert torch.equal(got_out, want_out), (
        f"outputs differ at [t, n, j] {bad[:5].tolist()} ({len(bad)} of {want_out.numel()}): "
        f"got {got_out[tuple(bad[0])].item()} want {want_out[tuple(bad[0])].item()}")
    assert torch.equal(got_h, want_h)


@settings(max_examples=_examples(400), **_SETTINGS)
@given(data=st.data(), cfg=config_dicts(), I=st.integers(1, 40) | st.sampled_from([64, 100, 257]),
       H=st.integers(1, 40) | st.sampled_from([63, 64, 65, 129]),
       T=st.integers(0, 7), N=st.integers(1, 5), w_exp=st.integers(-6, 3),
       b_exp=st.none() | st.integers(-6, 3) | st.integers(4, 40), zero_row=st.booleans(),
       with_lengths=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_integer_bit_exact_random_params(kind, data, cfg, I, H, T, N, w_exp, b_exp, zero_row,
                                         with_lengths, seed):
    """Random weights and calibration ranges (so multipliers, shifts and zero points take extreme
    values) and integer inputs over the whole x/h range: the native result equals golden exactly."""
    config = QuantConfig.from_dict(cfg)
    ranges = data.draw(ranges_for(H, config))
    try:
        p = _random_layer(config, I, H, ranges, w_exp, b_exp, zero_row, seed)
    except ValueError as e:  # convert() refuses grids 2**30 finer than their inputs: not a layer
        assert "too large to represent" in str(e)
        reject()
    _check_integer(kind, p, T, N, with_lengths, seed)


@pytest.mark.parametrize("cfg", ["w8a8", "w8a16", "w16a16"])
@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
@pytest.mark.parametrize("I,H", [(1, 1), (100, 129), (17, 48)])
def test_integer_bit_exact_sizes(kind, cfg, mode, I, H):
    """Sizes around the padding multiples (GEMM_PAD = 16, vector widths) and a longer sequence;
    the same native Layer is reused for several (T, N) to catch state kept between calls."""
    config = QuantConfig.load(cfg, overrides={"scale_mode": mode})
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), lo, dtype=torch.float64), torch.full((3 * H,), hi, dtype=torch.float64))
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4, 5), "Rh": per(-3, 2),
              "r_pre": one(-6, 6), "z_pre": one(-6, 6), "g_pre": one(-5, 7)}
    p = _random_layer(config, I, H, ranges, w_exp=-2, b_exp=-2, zero_row=False, seed=I * 1000 + H)
    # N = 37: three 16-row tiles, the last partial; T = 30 x 37 rows of x: more than one chunk of steps
    for T, N, lengths in ((30, 3, True), (1, 1, False), (0, 2, False), (5, 7, True), (3, 1, False), (30, 37, True)):
        _check_integer(kind, p, T, N, lengths, seed=T * 10 + N)


@pytest.mark.parametrize("cfg,mode,K", [("w8a8", "pow2", 65535), ("w8a8", "multiplier", 65535),
                                         ("w8a16", "pow2", 4096), ("w16a16", "multiplier", 4096),
                                         # the largest K a 16-bit x takes whole on an int16 path
                                         # (K 2^15 127 < 2^31): the int32 sums reach 99.99% of 2^31
                                         ("w8a16", "pow2", 516), ("w8a16", "multiplier", 516)])
@pytest.mark.parametrize("sign", [1, -1])
def test_integer_worst_case_accumulators(kind, cfg, mode, K, sign):
    """The largest accumulators convert() allows: K input channels of full-scale weights, x at the
    end of its grid far from the zero point, b_x saturated at the int32 limit, and Wx / Rh grids
    from 4x the accumulator's step (rescale = a right shift by 2) to very coarse. With 8-bit
    operands and pow2 scales the kernels may use int32 accumulators (csrc AccRequant32, right
    shift R >= 1): an overflow there shows as a wrapped, opposite-end Wx."""
    config = QuantConfig.load(cfg, overrides={"scale_mode": mode, "tensors": {
        "Wx": {"headroom": 1.0}, "Rh": {"headroom": 1.0}}})
    H = 2
    w_bits, x_bits, h_bits = config["W"].bits, config["x"].bits, config["h"].bits
    w = (2 ** (w_bits - 1) - 1) * 2.0 ** -(w_bits - 1)  # a full-scale weight on a pow2 grid
    w_ih = torch.full((3 * H, K), sign * w)
    w_hh = torch.full((3 * H, H), w)
    b_ih = torch.full((3 * H,), sign * 1e12)              # b_x saturates at the int32 limit
    one = lambda lo, hi: (torch.tensor(float(lo), dtype=torch.float64), torch.tensor(float(hi), dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), float(lo), dtype=torch.float64),
                          torch.full((3 * H,), float(hi), dtype=torch.float64))
    # x all positive: Z_x at the bottom of the grid, so q_x = max is 2^bits - 1 steps from it
    base = {"x": one(0.0, (2 ** x_bits - 1) * 2.0 ** -x_bits), "h": one(-1, 1), "Wx": per(-1, 1),
            "Rh": per(-1, 1), "r_pre": one(-8, 8), "z_pre": one(-8, 8), "g_pre": one(-8, 8)}
    p0 = derive_layer_params(w_ih, w_hh, b_ih, None, base, config)
    acc_x = float(p0.scale["W"][0] * p0.scale["x"])  # the accumulators' steps
    acc_h = float(p0.scale["R"][0] * p0.scale["h"])
    lo, hi = qrange(x_bits)
    qx = torch.stack([torch.full((3, K), hi), torch.full((3, K), lo), torch.randint(lo, hi + 1, (3, K))], dim=1)
    h_lo, h_hi = qrange(h_bits)
    qh0 = torch.tensor([[h_hi, h_lo], [0, 0], [h_lo, h_hi]])
    for k in (2, 3, 9, 20, 33):  # S_Wx = 2^k acc_x (16-bit Wx: range +-32767 steps)
        wx = acc_x * 2.0 ** k * 32767
        pre = max(8.0, 2 * wx)  # gate grids follow, so that Wx -> pre-activation stays representable
        ranges = dict(base, Wx=per(-wx, wx), Rh=per(-acc_h * 4 * 32767, acc_h * 4 * 32767),
                      r_pre=one(-pre, pre), z_pre=one(-pre, pre), g_pre=one(-pre, pre))
        p = derive_layer_params(w_ih, w_hh, b_ih, None, ranges, config)
        assert int(p.zp["x"]) == lo and int(p.W.abs().max()) == 2 ** (w_bits - 1) - 1
        assert int(p.b_x.abs().max()) >= 2 ** 31 - 1
        want = golden.gru_direction(p, qx, qh0)
        dev = _device(kind)
        got = native.gru_direction(_backend(kind))(p if dev.type == "cpu" else p.to(dev), qx.to(dev), qh0.to(dev), None)
        assert torch.equal(got[0].cpu().long(), want[0]), (k, got[0].cpu().tolist(), want[0].tolist())
        assert torch.equal(got[1].cpu().long(), want[1])


@settings(max_examples=_examples(2000), **_SETTINGS)
@given(v=st.integers(-(2 ** 31), 2 ** 31 - 1), m=st.integers(0, 2 ** 31 - 1), s=st.integers(1, 62))
def test_int32_multiplier_rescale_identity(v, m, s):
    """The int32 cell's multiplier form (csrc rescale32 / requant32, qgru/native/prepare.py _acc32_mult):
    floor(v m / 2^(s-1)) = floor(floor(v 2^lsh m / 2^32) / 2^rsh) with lsh = max(0, 33 - s),
    rsh = max(0, s - 33), wherever v 2^lsh fits int32; and the r * Rh_g form
    floor(floor(y m / 2^16) / 2^(s-17)) with floor(y m / 2^16) = (y >> 16) m + ((y & 0xFFFF) m >> 16).
    Python integers are exact: this checks the identities, not the C++."""
    lsh, rsh = max(0, 33 - s), max(0, s - 33)
    want = (v * m) >> (s - 1)
    if -(2 ** 31) <= v * 2 ** lsh < 2 ** 31:
        assert ((v * 2 ** lsh * m) >> 32) >> rsh == want
    if s >= 17:
        assert ((v >> 16) * m + (((v & 0xFFFF) * m) >> 16)) >> (s - 17) == want


@pytest.mark.parametrize("k,j", [(-6, 0), (-2, 0), (0, 0), (1, 0), (2, 0), (4, 0), (9, 0), (20, 0),
                                 (0, -8), (0, -13), (0, -14), (0, -16), (2, 6)])
def test_int32_multiplier_cell_taken_and_exact(kind, k, j):
    """8-bit x, h, W, R in multiplier scale mode take the int32 cell (acc32) where its bounds hold
    and the int64 cell where they do not, and both equal the golden model on inputs at the grids'
    ends. The Wx / Rh grids range from 2^-6 to 2^20 times a plain grid (k), which moves the
    accumulators' shifts across lsh = 0 (s = 33) and past the int32 bound; the gate grids from
    2^-16 to 2^6 times theirs (j), which moves the pre-activation rescales' left shifts up to
    where a 16-bit Wx no longer fits int32 after them."""
    config = QuantConfig.load("w8a8", overrides={"scale_mode": "multiplier", **_STATIC})
    I, H = 40, 24
    one = lambda lo, hi: (torch.tensor(float(lo), dtype=torch.float64), torch.tensor(float(hi), dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), float(lo), dtype=torch.float64),
                          torch.full((3 * H,), float(hi), dtype=torch.float64))
    f, g = 2.0 ** k, 2.0 ** (k + j)
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4 * f, 5 * f), "Rh": per(-3 * f, 2 * f),
              "r_pre": one(-6 * g, 6 * g), "z_pre": one(-6 * g, 6 * g), "g_pre": one(-5 * g, 7 * g)}
    p = _random_layer(config, I, H, ranges, w_exp=-2, b_exp=-2 + max(k, 0), zero_row=False, seed=k + 100)
    acc32 = native.prepare_layer(p)[1]["acc32"]
    # grids of ordinary size take the int32 cell (the fast path is not lost); the extremes do not
    assert acc32 == (1 if k <= 9 and j >= -13 else 0), (k, j)
    for T, N, lengths in ((6, 3, True), (1, 1, False), (4, 37, True)):
        _check_integer(kind, p, T, N, lengths, seed=T * 10 + N + k)


@settings(max_examples=_examples(2000), **_SETTINGS)
@given(g=st.integers(-(2 ** 30), 2 ** 30), bias=st.integers(-(2 ** 31), 2 ** 31), L=st.integers(0, 30),
       s=st.integers(1, 62))
def test_int32_pow2_requant_identity(g, bias, L, s):
    """The int32 cell's pow2 accumulator requantization (csrc/qgru_cell.h AccRequant32, requant32_by;
    the fields of qgru/native/prepare.py _pow2_parts) equals rounding_mul_shift(G + bias, 2^L, s)
    for every net shift R = s - 1 - L the int32 form takes: R in [1, 30] (bias split into
    bias_hi 2^R + bias_lo, a right shift) and R <= 0 (a left shift by -R of G + bias) wherever
    (|G| + |bias|) 2^-R <= 2^31 - 2 (prepare's bound); every intermediate inside int32. Python integers are exact: this
    checks the identity and the fields, not the C++."""
    from qgru.native.prepare import _pow2_parts
    R = s - 1 - L
    if R > 30:
        reject()
    want = int(primitives.rounding_mul_shift(torch.tensor(g + bias), torch.tensor(1 << L), torch.tensor(s)))
    f = {k.split("_", 1)[1]: int(v) for k, v in _pow2_parts("Wx", torch.tensor([bias]), torch.tensor([R])).items()}
    lsh, rsh, a0, a1 = f["mult32"], f["rshift"], f["bias_hi"], f["bias_lo"]
    assert (lsh, rsh) == (max(-R, 0), max(R, 0))
    if R <= 0 and (abs(g) + abs(bias)) * 2 ** lsh > 2 ** 31 - 2:
        reject()  # prepare refuses the int32 form: its bound is (max |G| + |bias|) 2^-R, |G| <= K 2^14
    u = (g + a1) * 2 ** lsh
    assert -(2 ** 31) <= g + a1 < 2 ** 31 and -(2 ** 31) <= u < 2 ** 31 - 1
    v = (u >> rsh) + a0
    assert -(2 ** 31) <= v < 2 ** 31 - 1
    assert (v + 1) >> 1 == want


# (Wx / Rh grids 2^k times a plain grid, biases ~ 2^b_exp, whether the int32 cell takes the layer):
# k <= 0 makes W.x's and R.h's net shifts R <= 0 (down to -11: left shifts), the bias the
# (K 2^14 + |bias|) 2^-R <= 2^31 - 2 bound's other term; each refused case is one step past it
_POW2_LEFT = [(-10, -2, 1), (-11, -2, 0), (-7, 8, 1), (-8, 8, 0), (-1, 14, 1), (-2, 14, 0), (0, -2, 1),
              (1, 8, 1), (2, 14, 1)]


@pytest.mark.parametrize("k,b_exp,taken", _POW2_LEFT)
def test_int32_pow2_left_shift_cell_taken_and_exact(kind, k, b_exp, taken):
    """8-bit x, h, W, R in pow2 scale mode take the int32 cell where W.x's and R.h's requantizations
    shift left (net shift R <= 0: a Wx / Rh grid as fine as the products', as calibrated pow2
    layers with few inputs and the wider x levels have) as long as the left-shifted sum stays in
    int32, and the int64 cell one step past that; both equal the golden model on inputs at the
    grids' ends."""
    config = QuantConfig.load("w8a8", overrides={"scale_mode": "pow2", **_STATIC})
    I, H = 40, 24
    one = lambda lo, hi: (torch.tensor(float(lo), dtype=torch.float64), torch.tensor(float(hi), dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), float(lo), dtype=torch.float64),
                          torch.full((3 * H,), float(hi), dtype=torch.float64))
    f = 2.0 ** k
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4 * f, 5 * f), "Rh": per(-3 * f, 2 * f),
              "r_pre": one(-6 * f, 6 * f), "z_pre": one(-6 * f, 6 * f), "g_pre": one(-5 * f, 7 * f)}
    p = _random_layer(config, I, H, ranges, w_exp=-2, b_exp=b_exp, zero_row=False, seed=k + 100)
    t, v = native.prepare_layer(p)
    assert v["pow2"] == 1 and v["acc32"] == taken, (k, b_exp)
    if k <= 0:
        assert int(native.prepare._net_shift(t, "Wx").min()) <= 0 and int(native.prepare._net_shift(t, "Rh").min()) <= 0
    for T, N, lengths in ((6, 3, True), (1, 1, False), (4, 37, True)):
        _check_integer(kind, p, T, N, lengths, seed=T * 10 + N + k)


@pytest.mark.parametrize("mode", ["multiplier", "pow2"])
@pytest.mark.parametrize("h_range", [(-1, 1), (-0.3, 1.0), (-1.0, 0.1)])
def test_state16_with_h_gemm_takes_the_int32_cell(kind, mode, h_range):
    """The shipped w8a8 (16-bit state, 8-bit R.h operand h_gemm) keeps the fast CPU path: one limb
    pair per GEMM (the fused step) and the int32 cell, whose z * h now reaches 2^32
    (rescale_wide32) and which writes the next step's operand itself (gemm_operand32). Against
    golden, with a third of the states at either end of the 16-bit grid, h grids symmetric and
    lopsided (the operand's zero point far from the state's), H = 150 (a partial 128-channel
    block) and batches below and above a 16-row tile."""
    config = QuantConfig.load("w8a8", overrides={"scale_mode": mode, **_STATIC})  # the int32 cell of static grids
    assert config["h"].bits == 16 and config["h_gemm"].bits == 8
    I, H = 37, 150
    one = lambda lo, hi: (torch.tensor(float(lo), dtype=torch.float64), torch.tensor(float(hi), dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), float(lo), dtype=torch.float64),
                          torch.full((3 * H,), float(hi), dtype=torch.float64))
    # Wx / Rh grids coarser than their accumulators' (a pow2 int32 requantization shifts right)
    ranges = {"x": one(-3, 2), "h": one(*h_range), "Wx": per(-16, 20), "Rh": per(-12, 8),
              "r_pre": one(-24, 24), "z_pre": one(-24, 24), "g_pre": one(-20, 28)}  # h_gemm: h's range
    p = _random_layer(config, I, H, ranges, w_exp=-3, b_exp=-2, zero_row=False, seed=H)
    t, v = native.prepare_layer(p)
    assert v["hg"] == 1 and v["h_bits"] == 8 and v["h_hi"] == 32767
    assert native.one_limb_pair(p, act16=False) and v["acc32"] == 1
    for T, N, lengths in ((5, 3, True), (1, 1, False), (4, 37, True)):
        _check_integer(kind, p, T, N, lengths, seed=T * 10 + N)


@pytest.mark.parametrize("name,mode,path,other", [
    ("w8a8", "multiplier", "amx", "avx512vnni"), ("w8a8", "pow2", "amx", "avx512vnni"),
    ("w8a16", "multiplier", "amx", "avx2"), ("w8a16", "pow2", "avxvnni", "avx2")])
def test_one_row_calls_on_another_path(cpu_backend, name, mode, path, other):
    """A one-step call of a batch of one (streaming) runs on another path's Layer where
    native.one_row_path says so: on amx a fused layer's on avx512vnni (a 16-row tile would hold one
    real row), on amx and avxvnni a layer with 16-bit activations on avx2 (taken whole: one fused
    pass; avx512vnni takes them whole itself, with its int16 sibling). The golden integers; the other Layer is made on the first such call and only
    then; the layer's other calls (more rows, more steps) before and after it unchanged; the
    other path's own Layer and avx2's delegate nothing."""
    usable = {str(i["name"]) for i in native.cpu_paths() if i["usable"]}
    if not {path, other} <= usable:
        pytest.skip(f"needs a CPU that runs {path} and {other}")
    p = _converted(_cfg(name, scale_mode=mode), 37, 150)._qparams[0][0]
    layer = native.NativeLayer("cpu", p, torch.device("cpu"), isa=path)
    assert layer.one_row_gemm == other and native.one_row_path(p, path) == other
    for own in (other, "portable"):
        assert native.NativeLayer("cpu", p, torch.device("cpu"), isa=own).one_row_gemm == ""
    gen = torch.Generator().manual_seed(7)
    assert not layer.layer.one_row_made
    seen = False  # a one-row call so far: the other Layer is made by the first (the third call), not before
    for T, N in ((1, 17), (3, 1), (1, 1), (1, 17), (1, 1), (3, 1), (1, 2), (1, 1)):
        qx, qh0, _ = _random_inputs(p, T, N, False, gen)
        want_out, want_h = golden.gru_direction(p, qx, qh0, None)
        got_out, got_h = layer(qx, qh0, None)
        assert torch.equal(got_out.long(), want_out) and torch.equal(got_h.long(), want_h), (T, N)
        seen = seen or (T, N) == (1, 1)
        assert layer.layer.one_row_made == seen, (T, N)
    assert seen


def test_auto_avxvnni_runs_16_bit_layers_on_avx2(cpu_backend, monkeypatch):
    """Where auto resolves to avxvnni (here amx and avx512vnni are marked unusable), a layer whose
    16-bit x and h avx2 takes whole runs on avx2 (native.layer_path: one fused pass with int16
    operands beats avxvnni's two limb pairs), an 8-bit layer on avxvnni, and a forced avxvnni
    keeps every layer; golden's integers on each."""
    real = native.cpu_paths()
    if not {"avxvnni", "avx2"} <= {str(i["name"]) for i in real if i["usable"]}:
        pytest.skip("needs a CPU that runs avxvnni and avx2")
    monkeypatch.setattr(native_cpu, "cpu_paths", lambda: [
        dict(i, usable=False, why="marked unusable (test)") if i["name"] in ("amx", "avx512vnni") else i for i in real])
    monkeypatch.delenv("QGRU_CPU_ISA", raising=False)
    dev = torch.device("cpu")
    p16 = _converted(_cfg("w8a16"), 23, 37)._qparams[0][0]
    p8 = _converted(_cfg("w8a8"), 23, 37)._qparams[0][0]
    assert native.layer_path(p16, "avxvnni", "auto") == "avx2" and native.layer_path(p8, "avxvnni", "auto") == "avxvnni"
    assert native.layer_path(p16, "avxvnni", "avxvnni") == "avxvnni" and native.layer_path(p16, "amx", "auto") == "amx"
    gen = torch.Generator().manual_seed(17)
    for p, isa, want in ((p16, None, "avx2-fused"), (p8, None, "avxvnni-fused"), (p16, "avxvnni", "avxvnni")):
        layer = native.NativeLayer("cpu", p, dev, isa=isa)
        assert layer.gemm == want, (isa, layer.gemm)
        qx, qh0, lengths = _random_inputs(p, 6, 19, True, gen)
        want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
        got_out, got_h = layer(qx, qh0, lengths)
        assert torch.equal(got_out.long(), want_out) and torch.equal(got_h.long(), want_h), (isa, want)
    assert "avx2 takes whole as int16 runs on avx2 (one fused pass)" in qgru.backends()["cpu"]["detail"]


def test_one_row_layer_must_match(cpu_backend):
    """set_one_row refuses a Layer of another layer (sizes, bit widths) and a path that cannot run."""
    usable = [str(i["name"]) for i in native.cpu_paths() if i["usable"]]
    p = _converted(_cfg("w8a8"), 7, 12)._qparams[0][0]
    q = _converted(_cfg("w8a8"), 7, 20)._qparams[0][0]
    layer = native.NativeLayer("cpu", p, torch.device("cpu"), isa="portable")
    tensors, values = native.prepare_layer(q, act16=True)
    with pytest.raises(RuntimeError, match="one-row Layer's H"):
        layer.layer.set_one_row(tensors, values, "portable")
    tensors, values = native.prepare_layer(p, act16=True)
    missing = [n for n in CPU_PATHS if n not in usable]
    for name in missing + ["sse9"]:
        with pytest.raises(ValueError):
            layer.layer.set_one_row(tensors, values, name)
    layer.layer.set_one_row(tensors, values, "portable")
    assert layer.layer.one_row_gemm == "portable" and not layer.layer.one_row_made


def test_cpu_path_follows_isa_switch(cpu_backend, monkeypatch):
    """QGRU_CPU_ISA (or isa=) picks the path; auto takes the first usable one in the order amx,
    avx512vnni, avxvnni, avx2, portable; a path this CPU cannot run, or an unknown name, is a clear error;
    qgru.backends() names the path that runs and the CPU."""
    monkeypatch.delenv("QGRU_CPU_ISA", raising=False)  # the kind fixture may have set it
    paths = native.cpu_paths()
    assert [i["name"] for i in paths] == list(CPU_PATHS[::-1])
    usable = [i["name"] for i in paths if i["usable"]]
    assert "portable" in usable
    p8 = _converted(_cfg("w8a8"), 5, 20)._qparams[0][0]
    p16 = _converted(_cfg("w16a16"), 5, 20)._qparams[0][0]
    dev = torch.device("cpu")
    assert native.NativeLayer("cpu", p8, dev).gemm == usable[0] + "-fused"
    assert native.NativeLayer("cpu", p8, dev, isa="portable").gemm == "portable-fused"
    assert native.NativeLayer("cpu", p16, dev, isa="portable").gemm == "portable"  # 16-bit weights: limbs
    for path in (i for i in paths if not i["usable"]):
        with pytest.raises(ValueError, match=f"'{path['name']}' path .*cannot run here"):
            native.NativeLayer("cpu", p8, dev, isa=path["name"])
    with pytest.raises(ValueError, match="unknown path 'sse9'"):
        native.NativeLayer("cpu", p8, dev, isa="sse9")
    detail = qgru.backends()["cpu"]["detail"]
    assert detail.startswith(f"path {usable[0]}:") and native.load("cpu").cpu_model() in detail
    monkeypatch.setenv("QGRU_CPU_ISA", "portable")
    assert native.NativeLayer("cpu", p8, dev).gemm == "portable-fused"
    assert qgru.backends()["cpu"]["detail"].startswith("path portable:")
    assert "forced by QGRU_CPU_ISA" in qgru.backends()["cpu"]["detail"]


@pytest.mark.parametrize("request_", ["bogus", "unusable"])
def test_backends_report_cpu_unavailable_for_a_bad_isa_request(cpu_backend, monkeypatch, request_):
    """QGRU_CPU_ISA naming an unknown path, or a path this CPU cannot run: every CPU forward call
    raises a ValueError, so qgru.backends() reports cpu unavailable with that very message (it used
    to say available: True); with the variable unset or valid it is available again."""
    monkeypatch.delenv("QGRU_CPU_ISA", raising=False)
    assert qgru.backends()["cpu"]["available"] is True
    if request_ == "unusable":  # a path this CPU cannot run: the real table, one usable path marked not
        real = native.cpu_paths()
        path = next(i["name"] for i in real if i["usable"] and i["name"] != "portable") \
            if any(i["usable"] and i["name"] != "portable" for i in real) else "portable"
        monkeypatch.setattr(native_cpu, "cpu_paths", lambda: [
            dict(i, usable=False, why="the CPU lacks it (test)") if i["name"] == path else i for i in real])
        request_ = path
    monkeypatch.setenv("QGRU_CPU_ISA", request_)
    rep = qgru.backends()["cpu"]
    assert rep["available"] is False and "detail" not in rep, rep
    m = _converted(_cfg("w8a8"), 4, 6)
    with pytest.raises(ValueError) as ei:
        m(torch.randn(3, 2, 4))
    assert rep["why"] == str(ei.value) and "QGRU_CPU_ISA" in rep["why"] and repr(request_) in rep["why"]
    assert ("unknown path" if request_ == "bogus" else "cannot run here: the CPU lacks it (test)") in rep["why"]
    monkeypatch.setenv("QGRU_CPU_ISA", "auto")
    assert qgru.backends()["cpu"]["available"] is True


def test_cpu_paths_match_the_cpu_flags(cpu_backend):
    """The run-time detection agrees with what Linux reports for this CPU (/proc/cpuinfo flags):
    avx2 is usable exactly when the CPU has avx2 and fma, avxvnni when it also has avx_vnni,
    avx512vnni when it has avx512_vnni."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags on this system")
    usable = {i["name"]: i["usable"] for i in native.cpu_paths()}
    compiled = {i["name"]: i["act_bytes"] > 0 for i in native.cpu_paths()}
    assert usable["avx2"] == ("avx2" in flags and "fma" in flags)
    # Linux names avx_vnni in /proc/cpuinfo from 5.12 on: before, only the direction CPUID -> usable
    kernel = tuple(int(v) for v in re.findall(r"\d+", platform.release())[:2])
    if "avx_vnni" in flags or kernel >= (5, 12):
        assert usable["avxvnni"] == (compiled["avxvnni"] and usable["avx2"] and "avx_vnni" in flags)
    assert not usable["avxvnni"] or usable["avx2"]
    assert usable["avx512vnni"] == all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl",
                                                            "avx512_vnni"))
    if usable["amx"]:
        assert "amx_int8" in flags and "amx_tile" in flags


def test_avxvnni_toolchain_probe_agrees_with_the_build(cpu_backend, tmp_path):
    """The build compiles the avxvnni path exactly when its probe (qgru/native/build.py,
    _toolchain_has_avxvnni: kernel_avxvnni.cpp compiled alone) succeeds with this toolchain."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the avxvnni path is x86-64's")
    compiled = any(i["name"] == "avxvnni" and i["act_bytes"] > 0 for i in native.cpu_paths())
    assert native._toolchain_has_avxvnni(tmp_path) == compiled


@pytest.mark.parametrize("cfg,N", [("w8a16", 6), ("w8a8", 37)])
def test_integer_bit_exact_across_thread_counts(cpu_backend, cfg, N):
    """The CPU kernels split work across threads: 1 thread, the default and more threads than cores
    give golden's integers (a partitioning bug would show as a mismatch under one of them). w8a8
    with N >= 16 runs the fused step, whose threads wait for each other between steps: with more
    threads than cores they must still all make progress."""
    config = QuantConfig.load(cfg, overrides={"scale_mode": "multiplier"} if cfg == "w8a16" else None)
    p = _converted(config.to_json(), 23, 37)._qparams[0][0]
    before = torch.get_num_threads()
    try:
        for n in (1, max(2, before), 2 * (os.cpu_count() or 1) + 1):
            torch.set_num_threads(n)
            _check_integer("cpu", p, T=9, N=N, with_lengths=True, seed=n)
    finally:
        torch.set_num_threads(before)


def test_cpu_buffers_reused_only_when_dropped(cpu_backend):
    """The CPU layer's output and the boundary's quantized input reuse their memory across calls,
    but only once the caller has let go: a held result (or a view of it) is never overwritten by
    the next call, and a dropped one is reused (no fresh pages per call)."""
    p = _converted(_cfg("w8a8"), 7, 20)._qparams[0][0]
    layer = native.NativeLayer("cpu", p, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    qh0 = _random_ints((3, 20), 8, gen).int()
    xs = [_random_ints((4, 3, 7), 8, gen).int() for _ in range(3)]
    want = [golden.gru_direction(p, x.long(), qh0.long())[0] for x in xs]
    out0, _ = layer(xs[0], qh0, None)
    view1 = layer(xs[1], qh0, None)[0][1:]  # only a view of the second output is held
    out2, _ = layer(xs[2], qh0, None)
    assert out0.data_ptr() != out2.data_ptr() and view1.data_ptr() != out2.data_ptr()
    assert torch.equal(out0.long(), want[0]) and torch.equal(view1.long(), want[1][1:])
    assert torch.equal(out2.long(), want[2])
    ptr = out2.data_ptr()
    del out0, view1, out2
    out3, _ = layer(xs[0], qh0, None)
    assert out3.data_ptr() == ptr and torch.equal(out3.long(), want[0])

    # The quantize buffers are per thread (a few slots): a fresh thread starts with all of them
    # free, whatever earlier tests on this thread still hold (with the slots held, every call
    # would rightly take fresh memory, and the pointers below would not repeat).
    def quantize_pattern():
        mod = native.load("cpu")
        f = [torch.randn(2, 9, generator=gen) for _ in range(2)]
        q0 = mod.quantize(f[0], 0.01, 3, 8, "input")
        q1 = mod.quantize(f[1], 0.01, 3, 8, "input")
        assert q0.data_ptr() != q1.data_ptr()
        ref = [primitives.quantize(v, torch.tensor(0.01, dtype=torch.float64), torch.tensor(3), 8) for v in f]
        assert torch.equal(q0.long(), ref[0]) and torch.equal(q1.long(), ref[1])
        ptr = q1.data_ptr()
        del q1
        assert mod.quantize(f[0], 0.01, 3, 8, "input").data_ptr() == ptr
        # a module call's pattern: the input, then h0 while the input's result is held; both reused
        x, h = torch.randn(4, 3, 7, generator=gen), torch.randn(3, 20, generator=gen)
        qx, qh = mod.quantize(x, 0.01, 3, 8, "input"), mod.quantize(h, 0.01, 3, 8, "h0")
        ptrs = (qx.data_ptr(), qh.data_ptr())
        del qx, qh
        qx, qh = mod.quantize(x, 0.01, 3, 8, "input"), mod.quantize(h, 0.01, 3, 8, "h0")
        assert (qx.data_ptr(), qh.data_ptr()) == ptrs

    errors = []

    def run():
        try:
            quantize_pattern()
        except BaseException as e:  # the assertion, re-raised in the test's own thread
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------------------------
# CUDA only: one Layer over many calls (plan reuse, graph replay), streams, threads, a user's
# graph capture, cuBLAS workspaces, large shapes. Skipped without a CUDA device; where there is
# one, an unavailable backend fails (cuda_backend).
# ---------------------------------------------------------------------------------------------
def _cuda_layer(p: golden.LayerParams, graph: bool, monkeypatch) -> native.NativeLayer:
    """A CUDA Layer of p with qgru's own CUDA graph on or off (QGRU_CUDA_GRAPH, read when the
    Layer is made)."""
    monkeypatch.setenv("QGRU_CUDA_GRAPH", "1" if graph else "0")
    return native.NativeLayer("cuda", p, torch.device("cuda"))


def _on_cuda(*ts):
    return tuple(None if t is None else t.cuda() for t in ts)


def _assert_golden(got, p: golden.LayerParams, qx, qh0, lengths, what: str = "") -> None:
    """A CUDA Layer's (out, h_n) equals golden's for these (CPU) inputs."""
    want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
    out, h = got[0].cpu().long(), got[1].cpu().long()
    assert got[0].dtype == torch.int32 and out.shape == want_out.shape, what
    bad = (out != want_out).nonzero()
    assert torch.equal(out, want_out), f"{what}: outputs differ at [t, n, j] {bad[:5].tolist()} ({len(bad)} of {out.numel()})"
    assert torch.equal(h, want_h), f"{what}: h_n differs at {(h != want_h).nonzero()[:5].tolist()}"


# static grids (w8a8 before x levels): the tests of a layer's own arithmetic (its int32 cell, its
# h_gemm grid) pin them; x levels have tests of their own (_levels_layer)
_STATIC = {"tensors": {"x": {"dynamic": False}, "h_gemm": {"dynamic": False}}}


def _static(cfg: str) -> dict:
    """_STATIC for config ``cfg``: h_gemm only where the config has one (w16a16 has none; an override
    of a tensor the config lacks must give its bits, and gpu_check's first H200 run of 2026-11-28
    found test_cuda_large_layer[w16a16] failing on exactly that)."""
    has = "h_gemm" in QuantConfig.load(cfg).tensors
    return {"tensors": {k: v for k, v in _STATIC["tensors"].items() if k != "h_gemm" or has}}


def _plain_layer(cfg: str, mode: str, I: int, H: int, seed: int, w_exp: int = -2) -> golden.LayerParams:
    config = QuantConfig.load(cfg, overrides={"scale_mode": mode, **_static(cfg)})
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), lo, dtype=torch.float64), torch.full((3 * H,), hi, dtype=torch.float64))
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4, 5), "Rh": per(-3, 2),
              "r_pre": one(-6, 6), "z_pre": one(-6, 6), "g_pre": one(-5, 7)}
    return _random_layer(config, I, H, ranges, w_exp=w_exp, b_exp=-2, zero_row=False, seed=seed)


@pytest.mark.parametrize("cfg", ["w8a8", "w16a16"])
def test_cuda_graph_replay_matches_eager_on_later_calls(cuda_backend, monkeypatch, cfg):
    """One Layer with qgru's CUDA graph and one without (QGRU_CUDA_GRAPH=0), called again and again
    with new data and new lengths every call: a shape that keeps its plan (call 1 makes the plan and
    runs eagerly, call 2 captures the graph, calls 3 and 4 replay it), two more shapes (with no
    lengths, and another batch) and a return to the first, whose plan is still kept (three plans:
    within kMaxPlans and the byte bound) and replays at once. Every call equals golden, and every
    result is still intact after all the later calls (results are copies, never the plan's
    buffers)."""
    p = _converted(_cfg(cfg, scale_mode="multiplier"), 23, 37)._qparams[0][0]
    layers = {"graph": _cuda_layer(p, True, monkeypatch), "eager": _cuda_layer(p, False, monkeypatch)}
    gen = torch.Generator().manual_seed(13)
    shapes = [(9, 5, True)] * 4 + [(9, 5, False)] * 3 + [(4, 17, True)] * 3 + [(9, 5, True)] * 3
    kept = []
    for i, (T, N, with_lengths) in enumerate(shapes):
        inputs = _random_inputs(p, T, N, with_lengths, gen)
        for name, layer in layers.items():
            got = layer(*_on_cuda(*inputs))
            _assert_golden(got, p, *inputs, what=f"call {i + 1} {(T, N, with_lengths)} {name}")
            kept.append((got, inputs, f"call {i + 1} {name}"))
    for got, inputs, what in kept:
        _assert_golden(got, p, *inputs, what=what + ", checked again after the later calls")
    graph, eager = layers["graph"].layer.counters, layers["eager"].layer.counters
    # 3 plans, each: one eager run, one capture, then replays (the return to the first shape: 3)
    assert graph["plans"] == 3 and graph["eager_runs"] == 3, graph
    assert graph["captures"] == 3 and graph["replays"] == 13 - 3 - 3, graph
    assert eager["captures"] == 0 and eager["replays"] == 0 and eager["eager_runs"] == 13, eager


def test_cuda_nearby_lengths_share_one_graph(cuda_backend, monkeypatch):
    """Item 9 of issue 13: with graphs, calls of nearby lengths (T = 33 .. 36, with and without
    lengths) run in one plan of plan_steps(T) = 36 steps: one plan, one eager run, one capture and
    replays after it, every call equal to golden (the plan's extra steps leave each row's state as
    it is, and out holds the call's own steps). Without graphs (QGRU_CUDA_GRAPH=0) a plan keeps the
    call's own length: each change of T or of lengths makes a new one."""
    p = _converted(_cfg("w8a8"), 23, 37)._qparams[0][0]
    layers = {"graph": _cuda_layer(p, True, monkeypatch), "eager": _cuda_layer(p, False, monkeypatch)}
    gen = torch.Generator().manual_seed(5)
    calls = [(33, True), (36, False), (34, False), (35, True), (33, False), (36, True)]
    for i, (T, with_lengths) in enumerate(calls):
        inputs = _random_inputs(p, T, 5, with_lengths, gen)
        for name, layer in layers.items():
            _assert_golden(layer(*_on_cuda(*inputs)), p, *inputs, what=f"call {i + 1} T={T} {with_lengths} {name}")
    graph, eager = layers["graph"].layer.counters, layers["eager"].layer.counters
    # the steps' buffer a plan keeps between calls (qx and out share it) is int16: 2 bytes per value
    assert graph["plan_step_bytes"] == 2 * 36 * 5 * max(p.input_size, p.hidden_size), graph
    assert graph["plans"] == 1 and graph["eager_runs"] == 1 and graph["captures"] == 1, graph
    assert graph["replays"] == len(calls) - 2, graph
    assert eager["plans"] == len(calls) and eager["captures"] == 0, eager


def test_cuda_alternating_shapes_keep_their_plans(cuda_backend, monkeypatch):
    """Item 9 of issue 13: calls alternating between shapes (two length buckets, a full batch and a
    partial last one) keep one plan per shape (plans_to_keep): each shape is captured once and
    replayed after, instead of a new plan per call; a fifth shape drops the oldest (kMaxPlans = 4).
    Every call equals golden."""
    p = _converted(_cfg("w8a8"), 23, 37)._qparams[0][0]
    layer = _cuda_layer(p, True, monkeypatch)
    gen = torch.Generator().manual_seed(6)
    shapes = [(40, 5), (100, 5), (40, 3)]  # two buckets, and a smaller batch
    calls = shapes * 3
    for i, (T, N) in enumerate(calls):
        inputs = _random_inputs(p, T, N, True, gen)
        _assert_golden(layer(*_on_cuda(*inputs)), p, *inputs, what=f"call {i + 1} T={T} N={N}")
    c = layer.layer.counters
    assert c["plans"] == 3 and c["plans_kept"] == 3, c
    assert c["eager_runs"] == 3 and c["captures"] == 3 and c["replays"] == len(calls) - 6, c
    # newest first: (40, 3), (100, 5), (40, 5); then 200 (new), (40, 5) (kept: replayed), 300 (new:
    # the fifth plan drops the least recently used, (100, 5))
    for i, (T, N) in enumerate([(200, 5), (40, 5), (300, 5), (100, 5)]):
        inputs = _random_inputs(p, T, N, False, gen)
        _assert_golden(layer(*_on_cuda(*inputs)), p, *inputs, what=f"late call {i + 1} T={T} N={N}")
    c = layer.layer.counters
    assert c["plans_kept"] == 4 and c["plans"] == 6, c  # (100, 5) came back as a new plan
    assert c["eager_runs"] == 6 and c["replays"] == len(calls) - 6 + 1, c


def _same_then_alternating(a, b):
    """Call shapes for the stream and thread tests: one shape (one plan), then pairs of two shapes
    (each change switches to the other plan while the other stream may still be using the first)."""
    return [a] * 6, [a, a, b, b] * 2


@pytest.mark.parametrize("graph", [True, False])
def test_cuda_one_layer_two_streams(cuda_backend, monkeypatch, graph):
    """Calls on two streams of one Layer with no host sync between them, both streams held back
    (torch.cuda._sleep) so the calls' GPU work would overlap: unordered, the second call's copies
    and steps would overwrite the plan's buffers while the first call still reads them."""
    p = _converted(_cfg("w8a8"), 23, 37)._qparams[0][0]
    layer = _cuda_layer(p, graph, monkeypatch)
    gen = torch.Generator().manual_seed(17)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for shapes in _same_then_alternating((20, 8, True), (12, 3, False)):
        cases = [_random_inputs(p, T, N, L, gen) for T, N, L in shapes]
        dev_cases = [_on_cuda(*c) for c in cases]
        torch.cuda.synchronize()  # the inputs are on the device before either stream reads them
        results = []
        for i, c in enumerate(dev_cases):
            with torch.cuda.stream(streams[i % 2]):
                torch.cuda._sleep(20_000_000)  # some ms of GPU time before this call's work
                results.append(layer(*c))
        torch.cuda.synchronize()
        for i, (got, c) in enumerate(zip(results, cases)):
            _assert_golden(got, p, *c, what=f"call {i + 1} {shapes[i]} on stream {i % 2}")


def _in_threads(work, args_list) -> None:
    """work(*args) in one thread per args, all started before any is joined; the first exception
    a thread raised is re-raised here, in the test's thread."""
    errors = []

    def run(*args):
        try:
            work(*args)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=args) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("graph", [True, False])
def test_cuda_one_layer_two_threads(cuda_backend, monkeypatch, graph):
    """Two threads, each on a stream of its own, call one Layer: the same shape, then alternating
    shapes in one of them. Every result equals golden."""
    p = _converted(_cfg("w8a16"), 23, 37)._qparams[0][0]
    layer = _cuda_layer(p, graph, monkeypatch)
    same, alternating = _same_then_alternating((20, 8, True), (7, 2, False))
    results = []

    def work(seed, shapes):
        gen = torch.Generator().manual_seed(seed)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for T, N, L in shapes:
                c = _random_inputs(p, T, N, L, gen)
                dev = _on_cuda(*c)  # copied on s: ordered before the call
                torch.cuda._sleep(5_000_000)
                results.append((layer(*dev), c, f"thread {seed} {(T, N, L)}"))
        s.synchronize()

    _in_threads(work, [(1, same), (2, alternating)])
    torch.cuda.synchronize()
    assert len(results) == len(same) + len(alternating)
    for got, c, what in results:
        _assert_golden(got, p, *c, what=what)


def test_cuda_call_inside_torch_cuda_graph(cuda_backend, monkeypatch):
    """Inside a user's torch.cuda.graph capture a call runs eagerly on the capturing stream, caching
    no plan and launching no graph of qgru's own, also when the Layer already has a plan and a
    graph of that shape (which a cached path would launch, joining its side stream into the
    capture). The user's graph then replays new inputs exactly (two calls in it, the second fed
    the first's h_n), and the Layer still works after the capture."""
    p = _converted(_cfg("w8a16"), 23, 37)._qparams[0][0]
    layer = _cuda_layer(p, True, monkeypatch)
    gen = torch.Generator().manual_seed(19)
    T, N = 7, 6
    for _ in range(2):  # a plan and a graph of qgru's own for this shape exist before the capture
        c = _random_inputs(p, T, N, True, gen)
        _assert_golden(layer(*_on_cuda(*c)), p, *c, "before the capture")
    static = [t.clone() for t in _on_cuda(*_random_inputs(p, T, N, True, gen))]
    side = torch.cuda.Stream()  # torch's advice: warm up on a side stream before capturing
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(*static)
    torch.cuda.current_stream().wait_stream(side)
    before = dict(layer.layer.counters)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out1, h1 = layer(*static)
        out2, h2 = layer(static[0], h1, static[2])  # a second call of the same shape in the capture
    after = dict(layer.layer.counters)
    assert after["in_foreign_capture"] == before["in_foreign_capture"] + 2, (before, after)
    assert {k: v for k, v in after.items() if k != "in_foreign_capture"} == \
        {k: v for k, v in before.items() if k != "in_foreign_capture"}, (before, after)
    for r in range(2):
        qx, qh0, lengths = _random_inputs(p, T, N, True, gen)
        for dst, src in zip(static, (qx, qh0, lengths)):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        _, want_h1 = golden.gru_direction(p, qx, qh0, lengths)
        _assert_golden((out1, h1), p, qx, qh0, lengths, f"replay {r + 1}, first call")
        _assert_golden((out2, h2), p, qx, want_h1, lengths, f"replay {r + 1}, second call")
    c = _random_inputs(p, T, N, True, gen)
    _assert_golden(layer(*_on_cuda(*c)), p, *c, "after the capture")


def test_cuda_module_call_inside_a_capture(cuda_backend):
    """Issue 34: a converted QuantGRU's forward waits for nothing on the host (NaN sets a device
    flag instead of being read per call), so inside torch.cuda.graph, after a warm-up call, the
    module call is captured, and replaying the graph gives the eager call's result; the module
    runs again after it. (tests/test_cuda_speed_paths.py covers more shapes and the check mode.)"""
    m = _converted(_cfg("w8a8"), 7, 12).to("cuda")
    x = torch.randn(3, 2, 7, device="cuda")
    try:
        with qgru.backend("cuda"):
            want, _ = m(x)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                captured, _ = m(x)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, want)
            got, _ = m(x)
        assert torch.equal(got, want)
    finally:
        m.to("cpu")


def test_cuda_after_clearing_cublas_workspaces(cuda_backend, monkeypatch):
    """torch._C._cuda_clearCublasWorkspaces() frees PyTorch's cuBLAS workspaces. qgru's captured
    graph owns its workspace, so later replays stay exact and do not write memory handed out again
    after the clear (filled with a pattern here and checked)."""
    p = _converted(_cfg("w16a16"), 64, 96)._qparams[0][0]
    layer = _cuda_layer(p, True, monkeypatch)
    gen = torch.Generator().manual_seed(23)
    T, N = 12, 40
    for i in range(2):  # the plan, then the graph's capture
        c = _random_inputs(p, T, N, True, gen)
        _assert_golden(layer(*_on_cuda(*c)), p, *c, f"call {i + 1}")
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()  # the freed workspaces go back to the driver and can come back below
    fill = [torch.full((64 << 20,), 0x5A, dtype=torch.uint8, device="cuda") for _ in range(4)]
    torch.mm(torch.randn(256, 256, device="cuda"), torch.randn(256, 256, device="cuda"))  # torch's new workspace
    for i in range(2, 5):
        c = _random_inputs(p, T, N, True, gen)
        _assert_golden(layer(*_on_cuda(*c)), p, *c, f"call {i + 1}, after the clear")
    torch.cuda.synchronize()
    assert all(bool((f == 0x5A).all()) for f in fill), "memory handed out after the clear was written"
    assert layer.layer.counters["replays"] == 3


@pytest.mark.parametrize("cfg,mode", [("w8a8", "pow2"), ("w16a16", "multiplier")])
def test_cuda_large_layer(cuda_backend, monkeypatch, cfg, mode):
    """H = I = 1024, N = 64, T = 48 with lengths (3072 rows of x over at least two W.x windows: two
    of 24 steps at this size, csrc/qgru_cuda_launch.h window_steps): calls 1-3 on one Layer (eager,
    capture, replay) with new data, each equal to golden. (T was 300: the golden model's int64
    GEMMs on the CPU took 89-100 s a case; the windows, not the length, are what is tested.)"""
    T, N = 48, 64
    p = _plain_layer(cfg, mode, 1024, 1024, seed=29, w_exp=-5)
    layer = _cuda_layer(p, True, monkeypatch)
    assert layer.layer.window_steps(plan_steps(T), N) < T, "the call must span more than one W.x window"
    gen = torch.Generator().manual_seed(29)
    for i in range(3):
        c = _random_inputs(p, T, N, True, gen)
        _assert_golden(layer(*_on_cuda(*c)), p, *c, f"call {i + 1}")
    assert layer.layer.counters["replays"] == 1


@pytest.mark.parametrize("graph", [True, False])
def test_cuda_shape_too_large_for_a_plan(cuda_backend, monkeypatch, graph):
    """Item 4 of issue 13: a shape whose plan would keep more than QGRU_CUDA_PLAN_MAX_BYTES between
    calls (here set to 200 kB; the default is 256 MiB) runs without one, in buffers of its own call:
    equal to golden, no plan made or kept for it, and the small shape's plan (captured, replayed)
    untouched by the large calls in between. A bad value is a clear error."""
    p = _converted(_cfg("w8a8"), 23, 37)._qparams[0][0]
    monkeypatch.setenv("QGRU_CUDA_PLAN_MAX_BYTES", "x")
    with pytest.raises(ValueError, match="QGRU_CUDA_PLAN_MAX_BYTES"):
        _cuda_layer(p, graph, monkeypatch)
    # with a graph the plan also holds its cuBLAS workspace (qgru_cuda.cpp, cublas_workspace_bytes)
    ws = ((32 << 20) if torch.cuda.get_device_capability()[0] >= 9 else (4 << 20)) if graph else 0
    monkeypatch.setenv("QGRU_CUDA_PLAN_MAX_BYTES", str(ws + 200_000))
    layer = _cuda_layer(p, graph, monkeypatch)
    gen = torch.Generator().manual_seed(41)
    # (3, 2) without lengths: a plan of ~42 kB; (700, 25) with lengths: ~18 MB (W.x of a 16384-row
    # window alone is 8 MB), so no plan
    calls = [(3, 2, False), (3, 2, False), (700, 25, True), (3, 2, False), (700, 25, True), (3, 2, False)]
    for i, (T, N, with_lengths) in enumerate(calls):
        inputs = _random_inputs(p, T, N, with_lengths, gen)
        _assert_golden(layer(*_on_cuda(*inputs)), p, *inputs, what=f"call {i + 1} T={T} N={N}")
    c = layer.layer.counters
    assert c["unplanned_runs"] == 2 and c["plans"] == 1 and c["plans_kept"] == 1, c
    assert c["plan_step_bytes"] == 2 * 3 * 2 * max(p.input_size, p.hidden_size), c
    if graph:  # the small shape: eager, capture, replay, replay
        assert c["eager_runs"] == 1 and c["captures"] == 1 and c["replays"] == 2, c
    else:
        assert c["eager_runs"] == 4 and c["captures"] == 0, c


def plan_steps(T: int) -> int:
    """csrc/qgru_cuda_launch.h plan_steps: the steps of a CUDA plan for a call of T steps."""
    if T <= 16:
        return T
    q = 1 << (T.bit_length() - 1 - 3)
    return -(-T // q) * q


def test_cuda_window_is_bounded_by_bytes(cuda_backend, monkeypatch):
    """A W.x window (csrc/qgru_cuda_launch.h, window_steps) of a large layer takes the 32 steps
    that keep its 3 graph nodes under 0.1 per step where their buffers stay within 128 MiB (more
    than 32 MiB holds), so its plan stays under the plan bound: H = I = 1024, N = 64 takes 2048 of
    the 16384 rows a window may have; a small layer takes the row cap, spread evenly over windows."""
    big = _plain_layer("w8a8", "pow2", 1024, 1024, seed=3, w_exp=-5)
    small = _converted(_cfg("w8a8"), 30, 20)._qparams[0][0]
    cap = native.load("cuda").max_window_rows
    steps_big = _cuda_layer(big, True, monkeypatch).layer.window_steps(320, 64)
    row_bytes = 4 * 3072 + 12 * 1024 + 2 * 1024  # W.x outputs, Wx - Z_Wx, x limbs
    assert steps_big == 32 and steps_big * 64 * row_bytes > 32 << 20, steps_big
    T, most = 10 ** 5, cap // 25
    windows = -(-T // most)
    assert _cuda_layer(small, True, monkeypatch).layer.window_steps(T, 25) == -(-T // windows)


@pytest.mark.parametrize("graph", [True, False])
def test_cuda_wx_over_two_chunks(cuda_backend, monkeypatch, graph):
    """T steps over more than one W.x window and at most two (the Layer's window_steps: here the
    row cap, max_window_rows): W.x runs in two windows of steps, each followed by its steps'
    recurrence; the second window's rows (and the partial tile at its end) reach the right steps;
    three calls, new data."""
    T, N = 700, 25
    p = _converted(_cfg("w8a16", scale_mode="multiplier"), 30, 20)._qparams[0][0]
    layer = _cuda_layer(p, graph, monkeypatch)
    steps = layer.layer.window_steps(plan_steps(T) if graph else T, N)
    assert steps * N <= native.load("cuda").max_window_rows and steps < T <= 2 * steps, (steps, T)
    gen = torch.Generator().manual_seed(31)
    for i in range(3):
        c = _random_inputs(p, T, N, True, gen)
        _assert_golden(layer(*_on_cuda(*c)), p, *c, f"call {i + 1}")


# ---------------------------------------------------------------------------------------------
# 1b. Module level: a converted QuantGRU on each native backend == on the reference backend
# ---------------------------------------------------------------------------------------------
@settings(max_examples=_examples(300), **_SETTINGS)
@given(cfg=config_dicts(), I=st.integers(1, 40), H=st.integers(1, 40), layers=st.integers(1, 2),
       bidirectional=st.booleans(), batch_first=st.booleans(),
       form=st.sampled_from(["batched", "batched", "packed", "unbatched"]),
       T=st.integers(0, 6), N=st.integers(1, 4), with_h0=st.booleans(),
       scale=st.sampled_from([1.0, 3.0, 1000.0]), inf=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_module_bit_exact(kind, cfg, I, H, layers, bidirectional, batch_first, form, T, N, with_h0,
                          scale, inf, seed):
    m = _converted(json.dumps(cfg, sort_keys=True), I, H, layers, bidirectional, batch_first, seed % 4)
    D = 2 if bidirectional else 1
    gen = torch.Generator().manual_seed(seed)
    h0 = None
    if form == "packed":
        T = max(T, 1)  # a PackedSequence has at least one step
        lengths = torch.randint(1, T + 1, (N,), generator=gen)
        lengths[torch.randint(0, N, (1,), generator=gen)] = T
        x = torch.randn((N, T, I) if batch_first else (T, N, I), generator=gen)
        x = pack_padded_sequence(_far_inputs(x, scale, inf, gen), lengths, batch_first=batch_first,
                                 enforce_sorted=False)
        if with_h0:
            h0 = torch.randn(layers * D, N, H, generator=gen)
    elif form == "unbatched":
        x = _far_inputs(torch.randn(T, I, generator=gen), scale, inf, gen)
        if with_h0:
            h0 = torch.randn(layers * D, H, generator=gen)
    else:
        x = _far_inputs(torch.randn((N, T, I) if batch_first else (T, N, I), generator=gen), scale, inf, gen)
        if with_h0:
            h0 = torch.randn(layers * D, N, H, generator=gen)
    if h0 is not None:
        h0 = _far_inputs(h0, scale, inf, gen)  # h0 may be outside the h grid too: it saturates
    if T == 0 and form != "packed":  # nn.GRU refuses a sequence of length 0, so does every backend
        for k, dev in (("reference", torch.device("cpu")), (kind, _device(kind))):
            with pytest.raises(qgru.QGRUInputError, match="at least one step"):
                _run(m, k, dev, x, h0)
        return
    want = _run(m, "reference", torch.device("cpu"), x, h0)
    fresh = seed % 2 == 0  # else reuse the Layers made by earlier examples on this cached module
    if fresh:
        _forget_native(m)
    got = _run(m, kind, _device(kind), x, h0)
    _assert_same(got, want)
    if fresh:
        _assert_native_ran(m, kind)


@pytest.mark.parametrize("cfg", ["w8a8", "w8a16", "w16a16"])
@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
def test_module_bit_exact_large_bidirectional(kind, cfg, mode):
    """hidden 129 and input 100 (no multiple of 4 or 16), two bidirectional layers, batch_first,
    packed with unequal lengths, h0 given, and saturating inputs."""
    m = _converted(_cfg(cfg, scale_mode=mode), 100, 129, 2, True, True, 1)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 9, 100, generator=gen)
    h0 = torch.randn(4, 5, 129, generator=gen)
    packed = pack_padded_sequence(x * 1000, torch.tensor([9, 3, 1, 9, 6]), batch_first=True, enforce_sorted=False)
    _forget_native(m)
    for args in ((x, h0), (x * 1000, None), (packed, h0)):
        _assert_same(_run(m, kind, _device(kind), *args), _run(m, "reference", torch.device("cpu"), *args))
    _assert_native_ran(m, kind)


@pytest.mark.parametrize("T", [0, 1])
@pytest.mark.parametrize("unbatched", [False, True])
def test_module_bit_exact_degenerate_lengths(kind, T, unbatched):
    """T = 0 (refused on every backend, as nn.GRU refuses it; the integer level, gru_direction, runs
    it: an empty output and h_n = h0) and T = 1."""
    m = _converted(_cfg("w8a16"), 6, 5, 2, True, False, 0)
    x = torch.randn(T, 6) if unbatched else torch.randn(T, 1, 6)
    h0 = torch.randn(4, 5) if unbatched else torch.randn(4, 1, 5)
    for h in (None, h0):
        if T == 0:
            for k, dev in (("reference", torch.device("cpu")), (kind, _device(kind))):
                with pytest.raises(qgru.QGRUInputError, match="at least one step"):
                    _run(m, k, dev, x, h)
            continue
        want = _run(m, "reference", torch.device("cpu"), x, h)
        assert want[0].shape[0] == T
        _assert_same(_run(m, kind, _device(kind), x, h), want)


def test_module_infinite_inputs_saturate_identically(kind):
    """All-+inf, all--inf and mixed inputs (and h0): saturated at the grid ends, same on both."""
    m = _converted(_cfg("w8a8", scale_mode="multiplier"), 7, 11, 1, True, False, 2)
    inf = float("inf")
    for x in (torch.full((4, 2, 7), inf), torch.full((4, 2, 7), -inf),
              torch.tensor([inf, -inf]).repeat(14).reshape(4, 1, 7).expand(4, 2, 7).contiguous()):
        for h0 in (None, torch.full((2, 2, 11), -inf), torch.full((2, 2, 11), inf)):
            _assert_same(_run(m, kind, _device(kind), x, h0), _run(m, "reference", torch.device("cpu"), x, h0))


@pytest.mark.parametrize("form", ["batched", "packed", "unbatched"])
def test_module_bit_exact_float64(kind, form):
    """A float64 QuantGRU: the boundary (quantize / dequantize) takes and returns float64."""
    torch.manual_seed(5)
    m = qgru.QuantGRU(6, 9, num_layers=2, bidirectional=True, batch_first=True, config="w8a16",
                      dtype=torch.float64)
    qgru.calibrate(m, [torch.randn(3, 5, 6, dtype=torch.float64) for _ in range(2)], progress=False)
    m.convert()
    x = torch.randn(3, 7, 6, dtype=torch.float64) * 4
    h0 = torch.randn(4, 3, 9, dtype=torch.float64)
    if form == "packed":
        x = pack_padded_sequence(x, torch.tensor([2, 7, 5]), batch_first=True, enforce_sorted=False)
    elif form == "unbatched":
        x, h0 = x[0], h0[:, 0]
    want = _run(m, "reference", torch.device("cpu"), x, h0)
    got = _run(m, kind, _device(kind), x, h0)
    _assert_same(got, want)
    assert (got[0].data if form == "packed" else got[0]).dtype == torch.float64


@pytest.mark.parametrize("where", ["input", "h0"])
def test_nan_is_an_error_on_every_backend(kind, where, monkeypatch):
    """NaN has no quantized value: every backend raises the reference's ValueError, naming it (the
    cuda backend with its synchronous check on, QGRU_CUDA_NAN_CHECK=1: by default it quantizes NaN
    as 0.0 and sets a device flag, tests/test_cuda_speed_paths.py)."""
    if _backend(kind) == "cuda":
        monkeypatch.setenv("QGRU_CUDA_NAN_CHECK", "1")
    m = _converted(_cfg("w8a8"), 4, 6, 2, True, False, 0)
    x, h0 = torch.randn(3, 2, 4), torch.zeros(4, 2, 6)
    (x if where == "input" else h0)[-1, 1, 2] = float("nan")  # h0: the last layer and direction
    for b in ("reference", kind):
        with pytest.raises(ValueError, match=f"{where} contains NaN"):
            _run(m, b, _device(b), x, h0)


# The float boundary and the layer-to-layer requantization (Backend.boundary): a native backend's
# one-pass versions against the golden primitives, on floats chosen to hit every rounding case.
def _boundary_floats(n: int, scale: float, zp: int, bits: int, dtype, gen: torch.Generator) -> torch.Tensor:
    lo, hi = qrange(bits)
    k = torch.randint(lo - zp - 3, hi - zp + 4, (n,), generator=gen).double()
    kinds = torch.randint(0, 6, (n,), generator=gen)
    v = torch.where(kinds == 0, (k + 0.5) * scale,                      # exact ties (round half up)
        torch.where(kinds == 1, (k + 0.5) * scale * (1 - 2 ** -52),     # just below a tie
        torch.where(kinds == 2, k * scale,                              # on the grid
        torch.where(kinds == 3, torch.randn(n, generator=gen, dtype=torch.float64) * scale * 2.0 ** bits,
        torch.where(kinds == 4, torch.randn(n, generator=gen, dtype=torch.float64) * 1e30,
                    (torch.rand(n, generator=gen, dtype=torch.float64) - 0.5) * scale * 4)))))
    v = v.to(dtype)
    special = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38,
                            (lo - zp - 1) * scale, (hi - zp + 1) * scale, (lo - zp - 0.5) * scale,
                            (hi - zp + 0.5) * scale], dtype=torch.float64).to(dtype)
    return torch.cat([v, special])


class _ScalarBoundary:
    """The boundary arithmetic of docs/spec.md one value at a time, in Python floats and exact
    integers and fractions: a computation independent of primitives.py (and of torch's kernels),
    for a backend whose boundary is partly the reference's own code on another device (the cuda
    backend's requantize), where comparing with the reference would compare it with itself.
    Checked against the reference on the CPU by test_scalar_boundary_is_the_reference."""

    @staticmethod
    def quantize(x, scale, zp, bits, what):
        lo, hi = qrange(bits)
        s, z = float(scale), int(zp)
        out = []
        for v in x.double().reshape(-1).tolist():
            assert v == v, "NaN"
            d = v / s  # the float64 quotient (one IEEE division, as the spec's)
            if d >= hi - z + 1:  # +inf included: saturates
                q = hi
            elif d <= lo - z - 1:
                q = lo
            else:  # round half up, exactly: floor(d + 1/2) of the quotient's exact value
                q = min(max(math.floor(Fraction(d) + Fraction(1, 2)) + z, lo), hi)
            out.append(q)
        return torch.tensor(out, dtype=torch.int64).reshape(x.shape)

    @staticmethod
    def dequantize(q, scale, zp):
        s, z = float(scale), int(zp)
        # (q - zp) is exact in float64 (|q - zp| < 2^17); one IEEE product; then rounded to float32
        return torch.tensor([float(v - z) * s for v in q.reshape(-1).tolist()],
                            dtype=torch.float64).reshape(q.shape).to(torch.float32)

    @staticmethod
    def requantize(q, from_zp, rescale, to_zp, bits):
        lo, hi = qrange(bits)
        m, sh, fz, tz = int(rescale.multiplier), int(rescale.shift), int(from_zp), int(to_zp)
        # round_half_up(v m / 2^sh) in exact integers (Python's >> floors, as an arithmetic shift)
        return torch.tensor([min(max((((v - fz) * m + (1 << (sh - 1))) >> sh) + tz, lo), hi) for v in q.reshape(-1).tolist()],
                            dtype=torch.int64).reshape(q.shape)


_BOUNDARY_GIVEN = dict(bits=st.integers(2, 16), pow2=st.booleans(), exp=st.integers(-24, 6), mant=st.floats(1.0, 2.0),
                       zp_frac=st.floats(0.0, 1.0), dtype=st.sampled_from([torch.float32, torch.float64]),
                       shape=st.sampled_from([(0,), (1,), (7, 3), (2, 5, 33)]), seed=st.integers(0, 2 ** 16))


@settings(max_examples=_examples(150), **_SETTINGS)
@given(**_BOUNDARY_GIVEN)
def test_boundary_ops_match_reference(kind, bits, pow2, exp, mant, zp_frac, dtype, shape, seed):
    ops = backends_mod._REGISTRY[_backend(kind)].boundary
    # both native backends have one-pass versions (C++, CUDA kernels): comparing the reference with
    # itself would prove nothing
    assert type(ops) is not backends_mod.BoundaryOps
    # the cuda backend's requantize is the reference's own code (on the device): it is compared
    # with the independent scalar computation, and so are its native quantize and dequantize
    ref = _ScalarBoundary() if _backend(kind) == "cuda" else backends_mod.BoundaryOps()
    _check_boundary(ops, ref, _device(kind), bits, pow2, exp, mant, zp_frac, dtype, shape, seed)


@settings(max_examples=_examples(40), **_SETTINGS)
@given(**_BOUNDARY_GIVEN)
def test_scalar_boundary_is_the_reference(bits, pow2, exp, mant, zp_frac, dtype, shape, seed):
    """The scalar oracle above gives the reference's integers and floats (on the CPU), so a CUDA
    mismatch against it is the device's, not the oracle's."""
    _check_boundary(backends_mod.BoundaryOps(), _ScalarBoundary(), torch.device("cpu"), bits, pow2, exp, mant,
                    zp_frac, dtype, shape, seed)


def _check_boundary(ops, ref, dev, bits, pow2, exp, mant, zp_frac, dtype, shape, seed):
    """ops (on ``dev``) against ref (on the CPU): quantize, dequantize, requantize."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = qrange(bits)
    scale = torch.tensor(2.0 ** exp * (1.0 if pow2 else mant), dtype=torch.float64)
    zp = torch.tensor(int(lo + round(zp_frac * (hi - lo))))
    x = _boundary_floats(2000, float(scale), int(zp), bits, dtype, gen)
    for xs in (x, x[: int(torch.tensor(shape).prod())].reshape(shape)):
        want = ref.quantize(xs, scale, zp, bits, "input")
        got = ops.quantize(xs.to(dev), scale, zp, bits, "input").cpu()
        bad = (got.long() != want).nonzero()
        assert torch.equal(got.long(), want), (
            f"quantize differs for x = {xs.reshape(-1)[bad[:3].reshape(-1)].tolist() if xs.dim() == 1 else bad[:3].tolist()}")
    # a non-contiguous view (batch_first inputs are transposed before quantize)
    xt = x[:1998].reshape(999, 2).t()
    assert torch.equal(ops.quantize(xt.to(dev), scale, zp, bits, "input").cpu().long(),
                       ref.quantize(xt, scale, zp, bits, "input"))
    # dequantize every integer of the range (sampled for 16 bits)
    q = torch.arange(lo, hi + 1) if bits <= 12 else torch.randint(lo, hi + 1, (5000,), generator=gen)
    q = torch.cat([q, torch.tensor([lo, hi])]).to(torch.int32)
    got = ops.dequantize(q.to(dev), scale, zp).cpu()
    want = ref.dequantize(q, scale, zp)
    assert got.dtype == want.dtype and torch.equal(got, want)
    # requantize: a previous layer's h grid (bits) onto an x grid (to_bits), per-tensor factor
    to_bits = 2 + seed % 15
    to_lo, to_hi = qrange(to_bits)
    to_zp = torch.tensor(int(to_lo + (seed % 7) * (to_hi - to_lo) // 6))
    real = torch.tensor(2.0 ** ((seed % 17) - 8) * (1.0 if pow2 else mant), dtype=torch.float64)
    m_, s_ = quantize_multipliers(real, bits + 1, pow2)
    r = golden.Rescale(m_, s_)
    got = ops.requantize(q.to(dev), zp, r, to_zp, to_bits).cpu()
    want = ref.requantize(q, zp, r, to_zp, to_bits)
    assert torch.equal(got.long(), want)


# ---------------------------------------------------------------------------------------------
# 1c. x levels (issue 31): per-token grids of the first layer's float x, on every native path
# ---------------------------------------------------------------------------------------------
def _dynamic(cfg: str, mode: str) -> QuantConfig:
    # x levels only (h_gemm, where the config has it, on its calibrated grid: the layers these tests
    # draw were chosen with it so)
    tensors = {"x": {"dynamic": True}}
    if QuantConfig.load(cfg).h_gemm is not None:
        tensors["h_gemm"] = {"dynamic": False}
    return QuantConfig.load(cfg, overrides={"scale_mode": mode, "tensors": tensors})


def _levels_layer(cfg: str, mode: str, I: int, H: int, seed: int) -> golden.LayerParams:
    """A first layer with x levels (config x.dynamic), x calibrated to [-3, 2]."""
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), lo, dtype=torch.float64), torch.full((3 * H,), hi, dtype=torch.float64))
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4, 5), "Rh": per(-3, 2),
              "r_pre": one(-6, 6), "z_pre": one(-6, 6), "g_pre": one(-5, 7)}
    p = _random_layer(_dynamic(cfg, mode), I, H, ranges, w_exp=-2, b_exp=-2, zero_row=False, seed=seed)
    assert p.x_levels is not None and p.x_levels.exponent.numel() > 1
    return p


def _level_inputs(p: golden.LayerParams, shape, gen: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    """Float x of ``shape`` (last axis I): each token drawn in the static grid's range (level 0's
    [lo, hi], an infinite end taken as the other's mirror) and scaled by its own factor in [0.3, 5]
    (so that several levels occur); about one token in five has a value at exactly a level's lo or
    hi (in float64: a level's own edge)."""
    lo, hi = float(p.x_levels.lo[0]), float(p.x_levels.hi[0])
    lo, hi = (lo if math.isfinite(lo) else -hi), (hi if math.isfinite(hi) else -lo)
    x = torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    f = torch.exp(torch.rand(tuple(shape[:-1]) + (1,), generator=gen, dtype=torch.float64)
                  * (math.log(5) - math.log(0.3)) + math.log(0.3))
    x = x * f
    lv = p.x_levels
    edges = torch.cat([lv.lo, lv.hi])
    edges = edges[torch.isfinite(edges)]
    flat = x.reshape(-1, shape[-1])
    pick = torch.rand(flat.shape[0], generator=gen) < 0.2
    which = torch.randint(0, edges.numel(), (flat.shape[0],), generator=gen)
    col = torch.randint(0, shape[-1], (flat.shape[0],), generator=gen)
    rows = pick.nonzero().reshape(-1)
    flat[rows, col[rows]] = edges[which[rows]]
    return flat.reshape(shape).to(dtype)


def _check_levels(kind: str, p: golden.LayerParams, T: int, N: int, with_lengths: bool, seed: int) -> torch.Tensor:
    """native gru_direction == golden's on float x quantized on its tokens' levels; returns the levels."""
    gen = torch.Generator().manual_seed(seed)
    x = _level_inputs(p, (T, N, p.input_size), gen)
    qx, level = golden.quantize_levels(p.x_levels, x, p.zp["x"], p.bits["x"])
    qh0 = _random_ints((N, p.hidden_size), p.bits["h"], gen)
    lengths = torch.randint(0, T + 1, (N,), generator=gen) if with_lengths else None
    want_out, want_h = golden.gru_direction(p, qx, qh0, lengths, level=level)
    dev = _device(kind)
    pd = p
    if dev.type != "cpu":
        copies = p.__dict__.setdefault("_test_device_copies", {})
        if str(dev) not in copies:
            copies[str(dev)] = p.to(dev)
        pd = copies[str(dev)]
    got_out, got_h = native.gru_direction(_backend(kind))(pd, qx.to(dev), qh0.to(dev), _to(lengths, dev),
                                                          level=level.to(dev))
    assert {layer.gemm for layer in pd.__dict__["_native"].values()} == {_expected_gemm(kind, p)}
    got_out, got_h = got_out.cpu().long(), got_h.cpu().long()
    bad = (got_out != want_out).nonzero()
    assert torch.equal(got_out, want_out), (
        f"outputs differ at [t, n, j] {bad[:5].tolist()} ({len(bad)} of {want_out.numel()}), T={T} N={N}")
    assert torch.equal(got_h, want_h)
    return level


@pytest.mark.parametrize("cfg", ["w8a8", "w8a16", "w16a16"])
@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
@pytest.mark.parametrize("I,H", [(17, 48), (100, 129)])
def test_x_levels_bit_exact(kind, cfg, mode, I, H):
    """A layer with x levels, tokens spread over its levels: the native W.x requantization takes each
    row's level (the unfused W.x pass, the fused step's W.x tiles, the one-row Layer) as golden
    does. Shapes: one-row streaming (T = N = 1), a few rows (W.x per chunk), 20 and 37 rows (16-row
    tiles, the last partial), lengths, and a sequence longer than one chunk of steps."""
    p = _levels_layer(cfg, mode, I, H, seed=I * 100 + H)
    seen = set()
    for T, N, lengths in ((1, 1, False), (3, 1, False), (5, 7, True), (2, 20, False), (30, 37, True),
                          (1, 20, False), (40, 3, False)):
        seen |= set(_check_levels(kind, p, T, N, lengths, seed=T * 10 + N).unique().tolist())
    assert len(seen) >= 3, seen  # the inputs really used several levels


@pytest.mark.parametrize("cfg", ["w8a8", "w8a16"])
@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
def test_x_levels_tiles_on_level_0_run_as_static_and_mixed_tiles_per_row(kind, cfg, mode):
    """Issue 40: a fused step's 16-row tile whose rows are all on level 0 runs the cell as a layer
    without levels (W.x's fields from the channel blocks); a tile with any other level reads every
    row's level from the flat arrays. Rows 0-15 on level 0 at every step, rows 16-31 mixed (one of
    them off level 0 at some steps only), rows 32-39 (a partial tile) on level 0 but at one step:
    each against golden, bit for bit."""
    p = _levels_layer(cfg, mode, 40, 130, seed=11)
    gen = torch.Generator().manual_seed(12)
    T, N = 6, 40
    lo, hi = float(p.x_levels.lo[0]), float(p.x_levels.hi[0])
    lo, hi = (lo if math.isfinite(lo) else -hi), (hi if math.isfinite(hi) else -lo)
    x = (torch.rand(T, N, p.input_size, generator=gen, dtype=torch.float64) * (hi - lo) + lo) * 0.9
    x[:, 16:32] *= torch.linspace(0.5, 4.0, 16, dtype=torch.float64).reshape(1, 16, 1)
    x[3, 20] *= 3.0
    x[2, 35] *= 4.0
    x = x.to(torch.float32)
    qx, level = golden.quantize_levels(p.x_levels, x, p.zp["x"], p.bits["x"])
    assert (level[:, :16] == 0).all() and (level[:, 16:32] > 0).any() and (level[:, 32:] > 0).sum() == 1
    qh0 = _random_ints((N, p.hidden_size), p.bits["h"], gen)
    want_out, want_h = golden.gru_direction(p, qx, qh0, None, level=level)
    dev = _device(kind)
    pd = p.to(dev) if dev.type != "cpu" else p
    got_out, got_h = native.gru_direction(_backend(kind))(pd, qx.to(dev), qh0.to(dev), None, level=level.to(dev))
    assert torch.equal(got_out.cpu().long(), want_out)
    assert torch.equal(got_h.cpu().long(), want_h)


def test_x_levels_int32_cell_taken(cpu_backend):
    """Calibrated w8a8 layers with x levels take the int32 cell where the same layer without levels
    does, in both scale modes: a level's wider grid only lowers its shift (multiplier), or W.x's
    net right shift R by exponent / 4, up to 3 (pow2: R <= 0 is a left shift by -R in the int32
    form, csrc/qgru_cell.h AccRequant32; before 2026-12-01 such a level sent the whole layer to the
    int64 cell). Level 0's int32 fields are the static grid's."""
    from qgru.native.prepare import prepare_layer
    taken = 0
    for mode in ("pow2", "multiplier"):
        for (I, H), xs in (((12, 20), 1.0), ((64, 128), 0.1), ((64, 128), 10.0)):
            torch.manual_seed(I + H)
            m = qgru.QuantGRU(I, H, config=_dynamic("w8a8", mode))
            qgru.calibrate(m, [torch.randn(20, 8, I) * xs for _ in range(2)], progress=False)
            p = m.convert()._qparams[0][0]
            static = p.clone()
            static.x_levels = None
            with warnings.catch_warnings():  # a pow2 layer that falls back says so (tested below)
                warnings.simplefilter("ignore", RuntimeWarning)
                t, v = prepare_layer(p)
            J = p.x_levels.exponent.numel()
            was = prepare_layer(static)[1]["acc32"]
            assert v["x_levels"] == J and v["acc32"] == was == 1, (mode, I, H)
            if v["acc32"]:
                taken += 1
                assert t["Wxl_bias_hi"].shape == (J * 3 * H,)
                for f in ("bias_hi", "bias_lo", "rshift", "mult32"):
                    assert torch.equal(t[f"Wxl_{f}"][:3 * H], t[f"Wx_{f}"]), (mode, f)
    assert taken >= 3


def test_x_levels_int32_fallback_warns_and_stays_exact(cpu_backend, monkeypatch):
    """A calibrated pow2 layer whose static W.x requantization fits the int32 form and whose x levels'
    forms are refused (here by a _requant32 that refuses every x level's: since left shifts are taken, a
    calibrated layer's levels do not fail its bounds, 2026-12-01): the layer runs the int64 cell,
    says so once, and is still bit-exact."""
    from qgru.native import prepare
    torch.manual_seed(192)
    m = qgru.QuantGRU(64, 128, config=_dynamic("w8a8", "pow2"))
    qgru.calibrate(m, [torch.randn(20, 8, 64) * 0.1 for _ in range(2)], progress=False)
    p = m.convert()._qparams[0][0]
    assert prepare.prepare_layer(p)[1]["acc32"] == 1  # its widest levels' W.x shifts left (R <= 0)
    assert int(prepare._net_shift(prepare.prepare_layer(p)[0], "Wxl").min()) <= 0
    real = prepare._requant32
    monkeypatch.setattr(prepare, "_requant32", lambda t, name, pow2, K: None if name == "Wxl" else real(t, name, pow2, K))
    monkeypatch.setattr(prepare, "_warned_levels_int64", False)
    with pytest.warns(RuntimeWarning, match="int64 cell"):
        t, v = prepare.prepare_layer(p)
    static = p.clone()
    static.x_levels = None
    assert v["acc32"] == 0 and prepare.prepare_layer(static)[1]["acc32"] == 1
    for T, N in ((5, 3), (2, 20), (1, 1)):
        _check_levels("cpu", p, T, N, False, seed=T + N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_x_levels_quantize_matches_golden(kind, dtype):
    """The native quantize_levels (per token: minimum, maximum, level, quantize on it) == golden's,
    for values at levels' edges, infinities (the last level, saturated), one value per token, and
    unbatched shapes."""
    p = _levels_layer("w8a8", "multiplier", 37, 16, seed=3)
    gen = torch.Generator().manual_seed(5)
    dev = _device(kind)
    with qgru.backend(_backend(kind)) as b:
        ops = b.boundary
        # token lengths around the kernels' vector widths (min / max in 8- and 16-lane vectors, issue 40)
        for shape in ((6, 9, 37), (11, 37), (4, 5, 1), (3, 4, 8), (3, 4, 16), (3, 4, 17), (2, 5, 64), (2, 3, 71)):
            if shape[-1] != p.input_size:
                q1 = _levels_layer("w8a8", "pow2", shape[-1], 16, seed=4)
            else:
                q1 = p
            x = _level_inputs(q1, shape, gen, dtype)
            x[0, 0] = float("inf")  # a token holding +inf: the last level, saturated
            if len(shape) == 3 and shape[-1] >= 17:  # extremes in a vector's lanes, not only in the scalar tail
                x[-1, 0, 15] = -100.0
                x[-1, 1, 9] = float("-inf")
                x[-1, 2, 3] = -0.0
            want_q, want_l = golden.quantize_levels(q1.x_levels, x, q1.zp["x"], q1.bits["x"])
            got_q, got_l = ops.quantize_levels(x.to(dev), q1.x_levels, q1.zp["x"], q1.bits["x"], "input")
            assert torch.equal(got_l.cpu().long(), want_l), shape
            assert torch.equal(got_q.cpu().long(), want_q), shape
            assert got_q.shape == shape and got_l.shape == shape[:-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["multiplier", "pow2"])
def test_token_level_is_golden_on_nan_inf_and_edges(cpu_backend, mode, dtype):
    """qgru_fixedpoint.h's token_level (the level choice the CUDA kernel folds, run here on the host)
    == golden.select_levels of x.nan_to_num(0.0): the integers CUDA gives for NaN input. Tokens hold
    a NaN among values of every level, infinities, a level's ends exactly and the next value past
    them, and NaN alone. (The CUDA kernel once put any token holding a NaN on the widest level.)"""
    p = _levels_layer("w8a8", mode, 9, 16, seed=11)
    lv = p.x_levels
    J = lv.exponent.numel()
    token_levels = native.load("cpu").token_levels
    grid = [lv.scale.tolist(), lv.lo.tolist(), lv.hi.tolist()]
    gen = torch.Generator().manual_seed(7)
    x = _level_inputs(p, (40, 6, 9), gen, torch.float64)
    flat = x.reshape(-1, 9)
    k = 0
    for j in range(J):  # a level's ends and the values just past them, alone and beside a NaN
        for end, away in ((lv.lo[j].item(), -math.inf), (lv.hi[j].item(), math.inf)):
            if not math.isfinite(end):
                continue
            for v in (end, math.nextafter(end, away)):
                flat[k] = 0.0
                flat[k, 3] = v
                flat[k + 1] = flat[k]
                flat[k + 1, 0] = math.nan
                k += 2
    flat[k:k + 8, 2] = math.nan  # NaN among random values
    flat[k + 8, :] = math.nan  # a token of NaN alone: 0.0, level 0
    flat[k + 9, 1], flat[k + 10, 4], flat[k + 11, 5] = math.inf, -math.inf, math.nan
    flat[k + 11, 6] = math.inf
    x = x.to(dtype)  # float32 rounds some ends and the values past them: still edges, on either side
    got = token_levels(x, *grid).long()
    want = golden.select_levels(lv, x.nan_to_num(0.0))
    assert torch.equal(got, want), (got != want).nonzero()[:5].tolist()
    has_nan = torch.isnan(x).any(-1)
    assert set(want[has_nan].tolist()) != {J - 1}, "the NaN tokens must span levels other than the widest"
    assert len(set(want.reshape(-1).tolist())) >= 3
    # without NaN, the host fold is golden itself, and the cpu path's quantize_levels agrees
    clean = x.nan_to_num(0.0)
    assert torch.equal(token_levels(clean, *grid).long(), golden.select_levels(lv, clean))
    with qgru.backend("cpu") as b:
        _, lvl = b.boundary.quantize_levels(clean, lv, p.zp["x"], p.bits["x"], "input")
    assert torch.equal(lvl.long(), golden.select_levels(lv, clean))
    with pytest.raises(RuntimeError, match="token_levels"):
        token_levels(x.int(), *grid)


def test_x_levels_nan_is_an_error(cpu_backend):
    p = _levels_layer("w8a8", "pow2", 8, 16, seed=0)
    x = torch.randn(3, 2, 8)
    x[1, 1, 3] = float("nan")
    with qgru.backend("cpu") as b, pytest.raises(ValueError, match="contains NaN"):
        b.boundary.quantize_levels(x, p.x_levels, p.zp["x"], p.bits["x"], "input")


def test_x_levels_layer_checks_its_levels(cpu_backend):
    """A Layer with levels runs a call without them on level 0 (golden's meaning), refuses levels
    outside [0, J) and a level tensor of another shape; a Layer without levels refuses a level."""
    p = _levels_layer("w8a8", "multiplier", 8, 16, seed=0)
    plain = _plain_layer("w8a8", "multiplier", 8, 16, seed=0)
    J = p.x_levels.exponent.numel()
    run = native.gru_direction("cpu")
    qx, qh0 = torch.zeros(3, 2, 8, dtype=torch.int64), torch.zeros(2, 16, dtype=torch.int64)
    good = torch.zeros(3, 2, dtype=torch.int64)
    run(p, qx, qh0, None, level=good)
    # without levels: every token on level 0 (the static grid), as golden.gru_direction defines it
    qx1 = torch.randint(-128, 128, (3, 2, 8), generator=torch.Generator().manual_seed(1))
    want = golden.gru_direction(p, qx1, qh0, None, level=good)
    assert all(torch.equal(a.long(), b) for a, b in zip(run(p, qx1, qh0, None), want))
    assert all(torch.equal(a.long(), b) for a, b in zip(run(p, qx1, qh0, None, level=good), want))
    for bad in (good - 1, good + J):
        with pytest.raises(RuntimeError, match="level holds values"):
            run(p, qx, qh0, None, level=bad)
    with pytest.raises(RuntimeError, match="level must be"):
        run(p, qx, qh0, None, level=good[:2])
    with pytest.raises(RuntimeError, match="no x levels"):
        run(plain, qx, qh0, None, level=good)


@pytest.mark.parametrize("cfg", ["w8a8", "w8a16", "w16a16"])
@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
def test_module_x_levels_bit_exact(kind, cfg, mode):
    """A converted 2-layer QuantGRU with x levels (x.dynamic; h_gemm.dynamic where the config has an
    h_gemm) on each native backend == on the reference backend, for inputs 0.3 to 5 times the
    calibrated range per token: the one-call stack (batched), the layer-by-layer path (packed),
    streaming calls of one step and a batch of 20."""
    tensors = {"x": {"dynamic": True}}
    if "h_gemm" in QuantConfig.load(cfg).to_dict()["tensors"]:
        tensors["h_gemm"] = {"dynamic": True}
    cfg_json = QuantConfig.load(cfg, overrides={"scale_mode": mode, "tensors": tensors}).to_json()
    m = _converted(cfg_json, 12, 20, 2, False, False, 2)
    assert m._qparams[0][0].x_levels is not None and m._qparams[1][0].x_levels is None
    _forget_native(m)
    gen = torch.Generator().manual_seed(9)
    cases = []
    for T, N in ((7, 3), (1, 1), (4, 20)):
        x = torch.randn(T, N, 12, generator=gen) * torch.exp(torch.rand(T, N, 1, generator=gen) * 2.8 - 1.2)
        cases.append((x, None))
        cases.append((x, torch.randn(2, N, 20, generator=gen)))
    x = torch.randn(6, 4, 12, generator=gen) * 3
    cases.append((pack_padded_sequence(x, torch.tensor([6, 2, 5, 1]), enforce_sorted=False), None))
    for x, h0 in cases:
        want = _run(m, "reference", torch.device("cpu"), x, h0)
        got = _run(m, kind, _device(kind), x, h0)
        _assert_same(got, want)
    _assert_native_ran(m, kind)


# ---------------------------------------------------------------------------------------------
# 2-5. The registry: report, default selection, fallback, forcing
# ---------------------------------------------------------------------------------------------
def test_backends_report():
    """reference always; cpu here (a compiler is present); cuda only with a CUDA torch and device."""
    rep = qgru.backends()
    assert set(rep) == {"reference", "cpu", "cuda"}
    assert rep["reference"] == {"available": True, "why": ""}
    assert rep["cpu"]["available"] is True and rep["cpu"]["why"] == "", rep["cpu"]
    assert rep["cpu"]["detail"].startswith(f"path {native.resolve_cpu_isa()['name']}:")
    if torch.version.cuda is None or not torch.cuda.is_available():
        assert rep["cuda"]["available"] is False
        assert isinstance(rep["cuda"]["why"], str) and rep["cuda"]["why"].strip()
    if torch.version.cuda is None:
        assert "CPU-only" in rep["cuda"]["why"]
    if torch.cuda.is_available():  # a build or link failure must show here, with its reason
        assert rep["cuda"]["available"] is True, rep["cuda"]["why"]


def test_default_backend_is_native_cpu(cpu_backend, monkeypatch):
    """Without a forced backend a converted model on CPU tensors runs the cpu backend (a
    bidirectional one: on its Model, native.cpu_op_model, the operator's C++)."""
    assert backends_mod.current_backend("cpu").name == "cpu"
    calls = []
    real = native.cpu_op_model

    def spy(params, op_params):
        calls.append("cpu")
        return real(params, op_params)

    monkeypatch.setattr(native, "cpu_op_model", spy)
    m = _converted(_cfg("w8a8"), 4, 6, 2, True, False, 3)
    x = torch.randn(3, 2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning either
        got = m(x)
    assert calls and set(calls) == {"cpu"}, calls
    _assert_same(got, _run(m, "reference", torch.device("cpu"), x))


def test_fallback_warns_once_and_matches_reference(monkeypatch):
    """cpu made unavailable: the model falls back to reference, warning once with the reason."""
    reason = "the compiler is on strike (test)"
    real_why = native.why_unavailable
    monkeypatch.setattr(native, "why_unavailable", lambda k: reason if k == "cpu" else real_why(k))
    monkeypatch.setattr(backends_mod, "_warned", set())
    assert qgru.backends()["cpu"] == {"available": False, "why": reason}

    def no_native(kind):
        raise AssertionError(f"native backend {kind!r} used although unavailable")

    monkeypatch.setattr(native, "gru_direction", no_native)
    m = _converted(_cfg("w8a16"), 5, 7, 1, False, False, 0)
    x = torch.randn(4, 3, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # "once" must come from qgru, not from the warnings filter
        first = m(x)
        second = m(x)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert reason in msgs[0] and "reference" in msgs[0]
    with qgru.backend("reference"):
        want = m(x)
    _assert_same(first, want)
    _assert_same(second, want)


def test_forcing_backends(monkeypatch):
    """Forcing an unavailable backend is an error naming the reason; forcing cpu on CPU tensors is fine."""
    why_cuda = qgru.backends()["cuda"]["why"]
    if why_cuda:
        with pytest.raises(RuntimeError) as e:
            with qgru.backend("cuda"):
                pass
        assert why_cuda in str(e.value) and "cuda" in str(e.value)
    with pytest.raises(ValueError, match="unknown backend"):
        with qgru.backend("tpu"):
            pass
    m = _converted(_cfg("w8a8"), 4, 6, 1, False, False, 0)
    x = torch.randn(3, 2, 4)
    if not qgru.backends()["cpu"]["why"]:
        with qgru.backend("cpu") as b:
            assert b.name == "cpu" and backends_mod.current_backend("cpu").name == "cpu"
            got = m(x)
        _assert_same(got, _run(m, "reference", torch.device("cpu"), x))
        if torch.cuda.is_available():  # a CPU backend refuses CUDA tensors
            with pytest.raises(RuntimeError, match="cpu"):
                _run(m, "cpu", torch.device("cuda"), x)
    assert getattr(backends_mod._forced, "name", None) is None  # restored on leaving the block
    # a native backend made unavailable: forcing it fails with the reason, nothing stays forced
    monkeypatch.setattr(native, "why_unavailable", lambda k: "gone (test)")
    monkeypatch.setattr(backends_mod, "_warned", set())
    with pytest.raises(RuntimeError, match=r"gone \(test\)"):
        with qgru.backend("cpu"):
            pass
    assert getattr(backends_mod._forced, "name", None) is None
    with pytest.warns(RuntimeWarning, match=r"gone \(test\)"):
        assert backends_mod.current_backend("cpu").name == "reference"


def test_forced_backend_is_thread_local(cpu_backend):
    """qgru.backend() forces the backend for the calling thread only."""
    import threading
    seen = []
    with qgru.backend("reference"):
        t = threading.Thread(target=lambda: seen.append(backends_mod.current_backend("cpu").name))
        t.start()
        t.join()
        assert backends_mod.current_backend("cpu").name == "reference"
    assert seen == ["cpu"]


# ---------------------------------------------------------------------------------------------
# 6-7. Binaries: stale ones refused, QGRU_NO_BUILD
# ---------------------------------------------------------------------------------------------
def test_stale_binary_is_refused(cpu_backend, monkeypatch):
    path = Path(native.load("cpu").__file__)
    # control: under the torch it was built for, the same file loads
    ok = native._load_built("cpu", path)
    assert ok.built_for_torch == torch.__version__ and hasattr(ok, "Layer")
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    with pytest.raises(RuntimeError, match="stale") as e:
        native._load_built("cpu", path)
    msg = str(e.value)
    assert "python -m qgru build" in msg and "0.0.0" in msg and str(path) in msg


def test_build_key_covers_every_csrc_file():
    """The build's cache key hashes _SOURCES and _HEADERS: a file in csrc/ missing from both would
    be compiled (included) but not hashed, and an edit to it would load the stale binary. (A new
    lanes header once did exactly that.)"""
    from qgru.weight_only import cpu as wo_cpu  # the weight-only CPU kernel: its own build, whose key hashes its one file
    root = native.csrc_dir()
    # csrc/c/ is the torch-free C99 runtime for microcontrollers (qgru/export_mcu.py), not part of the extension
    on_disk = {str(f.relative_to(root)) for f in root.rglob("*") if f.suffix in (".h", ".cpp", ".cu")
               and f.relative_to(root).parts[0] != "c"}
    listed = set(native._HEADERS) | {f for files in native._SOURCES.values() for f in files} | {wo_cpu.SOURCE_FILE}
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))


def test_native_checks_format_numbers_without_iostreams():
    """Every argument check in csrc/ goes through qgru_check.h (QGRU_CHECK, QGRU_CHECK_VALUE), whose
    messages format numbers with snprintf: on an H200 image (2026-11-28) every TORCH_CHECK whose
    message streamed a number crashed the process, in both extensions (scripts/cuda_triage.py)."""
    root = native.csrc_dir()
    offenders = []
    for f in sorted(root.rglob("*")):
        if f.suffix in (".h", ".cpp", ".cu") and f.name != "qgru_check.h":
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if re.search(r"\bTORCH_CHECK\w*\(|c10::str\(|ostringstream", line) and not line.lstrip().startswith("//"):
                    offenders.append(f"{f.relative_to(root)}:{i}: {line.strip()[:80]}")
    assert not offenders, offenders


def test_native_check_messages_carry_their_numbers(cpu_backend):
    """QGRU_CHECK's messages read as TORCH_CHECK's did: integers, negative numbers and doubles (%g,
    an ostream's default) in place."""
    ext = native.load("cpu")
    for bits, zp, scale in ((40, 0, 0.1), (8, -70000, -2.5e-7), (1, 3, 1e300)):
        with pytest.raises(RuntimeError) as e:
            ext.quantize(torch.zeros(3), scale, zp, bits, "x")
        assert str(e.value).splitlines()[0] == f"qgru cpu quantize: bits {bits}, zero point {zp}, scale {scale:g} out of range"


def test_cuda_build_key_names_the_gpus_architectures(monkeypatch):
    """The cuda build's cache key changes with the GPU it compiles for (the compute capability of
    every visible GPU where TORCH_CUDA_ARCH_LIST is unset, else that list): a cache shared between
    machines with other GPUs must not load a binary without a kernel image for this one."""
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    keys = {}
    for cap in [(8, 0), (9, 0), (8, 0)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0, cap=cap: cap)
        keys.setdefault(cap, set()).add(native_build.build_key("cuda"))
        assert native_build.cuda_arch_key() == f"devices sm_{cap[0]}{cap[1]}"
    assert len(keys[(8, 0)]) == 1 and keys[(8, 0)] != keys[(9, 0)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # an A100 and an H100 in one machine
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: [(9, 0), (8, 0)][i])
    assert native_build.cuda_arch_key() == "devices sm_80,sm_90"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")  # what is compiled, whatever the GPUs
    with_list = native_build.build_key("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (10, 0))
    assert native_build.build_key("cuda") == with_list
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert native_build.build_key("cuda") != with_list
    assert native_build.build_key("cpu") == native_build.build_key("cpu")  # the cpu key knows no GPU


def test_load_skips_stale_binary_in_build_dir(cpu_backend, monkeypatch, tmp_path, capsys):
    """load(): a binary for another torch in the build folder is not used; without building
    allowed the backend is then unavailable, with the rebuild command as the reason."""
    real = Path(native.load("cpu").__file__)
    monkeypatch.setenv("QGRU_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(torch, "__version__", "0.0.0")  # the real binary says 2.x: stale here
    d = native.build_dir("cpu")
    d.mkdir(parents=True)
    (d / real.name).write_bytes(real.read_bytes())
    monkeypatch.setattr(native_build, "_state", native_build._State())  # forget the loaded module
    with pytest.raises(RuntimeError, match="python -m qgru build"):
        native.load("cpu", build=False)
    assert "stale" in capsys.readouterr().err


def test_no_build_env_falls_back_in_subprocess(tmp_path):
    """QGRU_NO_BUILD=1 and an empty build folder: cpu is unavailable (reason names the build
    command), nothing is compiled, and a converted model still runs on reference, warning once."""
    code = textwrap.dedent(r"""
        import os, warnings, torch, qgru
        rep = qgru.backends()["cpu"]
        assert rep["available"] is False, rep
        assert "python -m qgru build" in rep["why"], rep
        torch.manual_seed(0)
        m = qgru.QuantGRU(5, 7, config="w8a8")
        qgru.calibrate(m, [torch.randn(4, 2, 5)], progress=False)
        m.convert()
        x = torch.randn(4, 2, 5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, h = m(x)
            m(x)
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and "reference" in msgs[0] and "python -m qgru build" in msgs[0], msgs
        with qgru.backend("reference"):
            ref, href = m(x)
        assert torch.equal(out, ref) and torch.equal(h, href)
        root = os.environ["QGRU_BUILD_DIR"]
        built = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
        assert not built, built
        print("SUBPROCESS-OK")
    """)
    env = dict(os.environ, QGRU_NO_BUILD="1", QGRU_BUILD_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "SUBPROCESS-OK" in r.stdout, r.stdout + r.stderr


def test_find_cublas_links_the_library_torch_runs(tmp_path):
    """The CUDA build links the cuBLAS torch has loaded (a pip-only install has only
    libcublas.so.<major>, no unversioned libcublas.so for -lcublas), else the toolkit's of torch's
    CUDA major; another major, or none, is an error naming what was looked for."""
    pip = "/venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcublas.so.13"
    maps = "\n".join([
        f"7f00-7f10 r--p 00000000 08:01 123 {pip.replace('libcublas.so', 'libcublasLt.so')}",
        f"7f10-7f20 r-xp 00001000 08:01 124 {pip}",
        "7f20-7f30 rw-p 00000000 00:00 0 ",
    ])
    assert native.find_cublas(maps, None, "13.0") == Path(pip)
    with pytest.raises(RuntimeError, match="cuBLAS 13, but reports CUDA 12.8"):
        native.find_cublas(maps, None, "12.8")
    toolkit = tmp_path / "cuda"
    (toolkit / "lib64").mkdir(parents=True)
    (toolkit / "lib64" / "libcublas.so.12").write_bytes(b"")
    assert native.find_cublas("", str(toolkit), "12.8") == toolkit / "lib64" / "libcublas.so.12"
    with pytest.raises(RuntimeError, match=r"no cuBLAS 13 .*lib64/libcublas.so.13"):
        native.find_cublas("", str(toolkit), "13.0")
    with pytest.raises(RuntimeError, match="CPU-only"):
        native.find_cublas(maps, None, None)


# ---------------------------------------------------------------------------------------------
# 8. Layer preparation: the int8 weight limbs and the constant terms
# ---------------------------------------------------------------------------------------------
def _act_limbs(q: torch.Tensor, bits: int):
    """(int8 limb, scale, offset) of the activations, as csrc act_limb() splits them."""
    return [(l.to(torch.int64), s, c) for l, s, c in split_int8_limbs(q, bits)]


@pytest.mark.parametrize("gemm_min", [native.GEMM_PAD, native.CUDA_GEMM_MIN])
@pytest.mark.parametrize("w_bits,a_bits", [(8, 8), (8, 16), (16, 8), (16, 16), (4, 12), (12, 4)])
def test_prepare_layer_limbs_reconstruct_weights(w_bits, a_bits, gemm_min):
    """The limbs, pairs and folded constants rebuild W q + b exactly; gemm_min (the CUDA backend's
    32) pads the reduction (K = H = 13 here) and the channels further, with zeros."""
    H, I = 13, 21
    config = QuantConfig.load("w8a8", overrides={"tensors": {  # R.h reads h itself (no h_gemm)
        "W": {"bits": w_bits}, "R": {"bits": w_bits}, "x": {"bits": a_bits}, "h": {"bits": a_bits}, "h_gemm": None}})
    p = _converted(config.to_json(), I, H)._qparams[0][0]
    t, v = native.prepare_layer(p, gemm_min=gemm_min)
    gen = torch.Generator().manual_seed(w_bits * 100 + a_bits)
    for pre, Wq, K, bias_name, comp, b in (("x", p.W, I, "Wx", p.W_zp_comp, p.b_x),
                                           ("h", p.R, H, "Rh", p.R_zp_comp, p.b_h)):
        limbs = t[f"{pre}_weight_limbs"]
        pairs = t[f"{pre}_pairs"]
        assert limbs.dtype == torch.int8 and limbs.dim() == 3
        L, M_pad, K_pad = limbs.shape
        assert M_pad == v["M_pad"] and M_pad % native.GEMM_PAD == 0 and M_pad >= max(3 * H, gemm_min)
        assert K_pad % native.GEMM_PAD == 0 and K_pad >= max(K, gemm_min)
        assert L == (1 if w_bits <= 8 else 2)
        # the weights, from the pairs of activation limb 0 (scale 1): sum of scale * (limb + offset)
        a0 = [(j, s, d) for i, j, s, d in pairs.tolist() if i == 0]
        assert len(a0) == L
        rebuilt = sum(s * (limbs[j, :3 * H, :K].to(torch.int64) + d) for j, s, d in a0)
        assert torch.equal(rebuilt, Wq)
        # padding is zero (except the ones row that sums the activation limb for the offsets)
        pad = limbs.clone()
        pad[:, :3 * H, :K] = 0
        if v["ones_col"]:
            assert torch.all(pad[:, v["ones_col"], :K] == 1)
            pad[:, v["ones_col"], :K] = 0
        assert not pad.any()
        # the full GEMM identity the kernels rely on, for activations over the whole range:
        # W q + b - Z rowsum(W) == sum_pairs s * (G_p + d * G_p[ones]) + bias (constants folded in)
        q = _random_ints((6, K), a_bits, gen)
        acts = _act_limbs(q, a_bits)
        assert [(s, c) for _, s, c in acts] == ([(1, 0)] if a_bits <= 8 else [(1, 128), (256, 0)])
        acc = torch.zeros(6, 3 * H, dtype=torch.int64)
        for i, j, s, d in pairs.tolist():
            a = torch.zeros(6, K_pad, dtype=torch.int64)
            a[:, :K] = acts[i][0]
            G = a @ limbs[j].to(torch.int64).t()
            acc += s * G[:, :3 * H]
            if d:
                acc += s * d * G[:, v["ones_col"]:v["ones_col"] + 1]
        acc += t[f"{bias_name}_bias"]
        assert torch.equal(acc, q @ Wq.t() + b - comp)


def test_direct16_bound():
    """A 16-bit activation times 8-bit weights is one int16 GEMM only while 2^15 sum_k |w_ck| < 2^31
    for every row c (which bounds every partial sum too)."""
    w = torch.full((3, 516), 127)
    assert native.direct16_fits(w, 8, 16)
    assert 516 * 32768 * 127 < 2 ** 31 <= 517 * 32768 * 127
    assert not native.direct16_fits(torch.full((3, 517), 127), 8, 16)
    assert native.direct16_fits(torch.full((3, 4096), 15), 8, 16)  # small weights allow a larger K
    # a row's sum, not K max|w|: K = 1024 with one 127 per row fits, a single row past 2^16 does not
    big = torch.full((4, 1024), 63)
    big[:, 0] = 127
    assert int(big.abs().sum(1).max()) == 1023 * 63 + 127 < 2 ** 16 and native.direct16_fits(big, 8, 16)
    big[2, 1:] = -64
    assert int(big[2].abs().sum()) >= 2 ** 16 and not native.direct16_fits(big, 8, 16)
    assert not native.direct16_fits(w, 8, 8) and not native.direct16_fits(w, 16, 16)  # nothing to gain / no bound


def test_prepare_layer_direct16_accumulator():
    """With act16 (an int16 path) a w8a16 layer's GEMMs take x and h whole: one pair of scale 1 and
    offset 0, and the accumulator identity q W^T + bias == golden's holds over the whole range."""
    H, I = 13, 21
    p = _converted(_cfg("w8a16"), I, H)._qparams[0][0]
    t, v = native.prepare_layer(p, act16=True)
    t8, v8 = native.prepare_layer(p)
    assert v["x_direct16"] == v["h_direct16"] == 1 and v8["x_direct16"] == v8["h_direct16"] == 0
    gen = torch.Generator().manual_seed(3)
    for pre, Wq, K, bias_name, comp, b in (("x", p.W, I, "Wx", p.W_zp_comp, p.b_x),
                                           ("h", p.R, H, "Rh", p.R_zp_comp, p.b_h)):
        assert t[f"{pre}_pairs"].tolist() == [[0, 0, 1, 0]]
        assert len(t8[f"{pre}_pairs"]) == 2  # the limb form
        q = _random_ints((6, K), 16, gen)
        G = q @ t[f"{pre}_weight_limbs"][0, :3 * H, :K].to(torch.int64).t()
        assert torch.equal(G + t[f"{bias_name}_bias"], q @ Wq.t() + b - comp)


def _streaming_loop(m: qgru.QuantGRU, xs: torch.Tensor, backend: str, other_shape: bool = False):
    """m's outputs (rows of H) and h over one-step calls of xs [T, 1, I] carrying h on ``backend``;
    other_shape: a call of another shape (3 steps of a batch of 2) after step 2."""
    h, outs = None, []
    with qgru.backend(backend), torch.no_grad():
        for t in range(xs.shape[0]):
            o, h = m(xs[t:t + 1], h)
            outs.append(o.reshape(-1, o.shape[-1]))
            if other_shape and t == 2:
                wide = m(xs[:3].expand(3, 2, xs.shape[2]).contiguous(), h.expand(h.shape[0], 2, h.shape[2]).contiguous())
                outs.append(wide[0].reshape(-1, h.shape[2]))
    return torch.cat(outs), h


def test_stack_forward_is_the_layer_by_layer_path(cpu_backend):
    """A unidirectional stack without padding on the cpu backend runs as one native call
    (the Stack of the module's Model): it is used, and gives the reference's floats bit for bit, for 1 and
    3 layers, float32 and float64, and a T=1 N=1 streaming loop carrying h; with padding or two
    directions the layer-by-layer path runs instead."""
    gen = torch.Generator().manual_seed(11)
    for layers, cfg in ((1, "w8a8"), (3, "w8a16")):
        m = _converted(_cfg(cfg), 7, 12, layers, False, False, 0)
        _forget_native(m)
        for x in (torch.randn(5, 3, 7, generator=gen), torch.randn(4, 2, 7, generator=gen, dtype=torch.float64)):
            h0 = torch.randn(layers, x.shape[1], 12, generator=gen, dtype=x.dtype)
            _assert_same(_run(m, "cpu", torch.device("cpu"), x, h0), _run(m, "reference", torch.device("cpu"), x, h0))
        # the module's Model (native.cpu_op_model) ran it, on its Stack: its one-call form takes it
        model = m._qparams[0][0].__dict__["_native"][("cpu-model", native.cpu_isa_request())][1]
        assert model.call(torch.randn(5, 3, 7), None) is not None
        xs = torch.randn(6, 1, 7, generator=gen)
        _assert_same(_streaming_loop(m, xs, "cpu"), _streaming_loop(m, xs, "reference"))
    m = _converted(_cfg("w8a8"), 7, 12, 1, True, False, 0)
    _forget_native(m)
    _run(m, "cpu", torch.device("cpu"), torch.randn(3, 2, 7, generator=gen), None)
    model = m._qparams[0][0].__dict__["_native"][("cpu-model", native.cpu_isa_request())][1]
    assert model.call(torch.randn(3, 2, 7), None) is None  # two directions: no Stack


def test_stack_refuses_operands_of_other_shapes(cpu_backend):
    """The native Stack reads x and h0 through raw pointers: called directly (not through the
    module, which checks them first) with an x or h0 of another shape it raises before reading,
    and with the right shapes it still gives the module's floats."""
    m = _converted(_cfg("w8a8"), 7, 12, 2, False, False, 0)
    _forget_native(m)
    plan = native.cpu_stack_plan(m._qparams_on["cpu"], native.cpu_isa_request())
    assert plan is not None
    x, h0 = torch.randn(4, 3, 7), torch.randn(2, 3, 12)
    for bad_x, bad_h in ((torch.randn(4, 3, 8), h0), (torch.randn(4, 7), h0), (x, torch.randn(2, 2, 12)),
                         (x, torch.randn(2, 3, 13)), (x, torch.randn(1, 3, 12)), (x, torch.randn(3, 12))):
        with pytest.raises(RuntimeError, match="stack_forward"):
            plan.forward(bad_x, bad_h)
    # tensors on another device (meta: no memory at all) are refused too, by the Stack and by a
    # Layer called on its own
    with pytest.raises(RuntimeError, match="CPU tensor"):
        plan.forward(x, h0.to("meta"))
    layer = native._cpu_layer(m._qparams_on["cpu"][0][0], native.cpu_isa_request()).layer
    qx, qh = torch.zeros(4, 3, 7, dtype=torch.int32), torch.zeros(3, 12, dtype=torch.int32)
    for args in ((qx.to("meta"), qh), (qx, qh.to("meta")), (qx, qh, torch.full((3,), 4).to("meta"))):
        with pytest.raises(RuntimeError, match="CPU tensors"):
            layer.forward(*args)
    mod = native.load("cpu")
    with pytest.raises(RuntimeError, match="CPU tensor"):
        mod.dequantize(qh.to("meta"), 0.1, 0)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        mod.requantize(qh.to("meta"), 0, 1 << 30, 31, 0, 8)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        mod.quantize(h0.to("meta"), 0.1, 0, 8, "h0")
    with qgru.backend("cpu"), torch.no_grad():
        want = m(x, h0)
    _assert_same(plan.forward(x, h0), want)


def test_stack_call_takes_its_form_and_returns_none_for_the_rest(cpu_backend):
    """Stack.call (the module's one-call entry: Model.call, native.cpu_op_model) checks x and h0 itself: for
    a float32 CPU x [T >= 1, N, I] and h0 None or float32 [L, N, H], neither a negative view, it
    gives forward's floats (h0 None: zeros); for anything else it returns None (the module's
    general path then runs and raises), reading nothing."""
    m = _converted(_cfg("w8a8"), 7, 12, 2, False, False, 0)
    _forget_native(m)
    params = m._qparams_on["cpu"]
    plan = native.cpu_stack_plan(params, native.cpu_isa_request())
    x, h0 = torch.randn(4, 3, 7), torch.randn(2, 3, 12)
    _assert_same(plan.call(x, h0), plan.forward(x, h0))
    _assert_same(plan.call(x, None), plan.forward(x, torch.zeros(2, 3, 12)))
    _assert_same(plan.call(x), plan.forward(x, torch.zeros(2, 3, 12)))
    model = native.cpu_op_model(params, m._op_params)
    _assert_same(model.call(x, h0), plan.forward(x, h0))
    # strided views that are not negative ones are taken (the Stack makes them contiguous)
    xt = torch.randn(3, 4, 7).transpose(0, 1)
    _assert_same(plan.call(xt, h0), plan.forward(xt.contiguous(), h0))
    refused = {
        "x float64": (x.double(), h0), "x int32": (x.to(torch.int32), h0), "x 2-D": (x[0], h0),
        "x 4-D": (x.unsqueeze(0), h0), "x T=0": (x[:0], h0), "x other I": (torch.randn(4, 3, 8), h0),
        "x negative view": (torch._neg_view(x), h0), "x sparse": (x.to_sparse(), h0), "x meta": (x.to("meta"), h0),
        "h0 float64": (x, h0.double()), "h0 2-D": (x, h0[0]), "h0 other L": (x, torch.randn(1, 3, 12)),
        "h0 other N": (x, torch.randn(2, 2, 12)), "h0 other H": (x, torch.randn(2, 3, 13)),
        "h0 negative view": (x, torch._neg_view(h0)), "h0 meta": (x, h0.to("meta")),
    }
    for what, (bx, bh) in refused.items():
        assert plan.call(bx, bh) is None, what
        assert model.call(bx, bh) is None, what
    # forward itself (no T >= 1 test): no steps, h_n is h0 on its grid and back
    out, h_n = plan.forward(x[:0], h0)
    assert out.shape == (0, 3, 12) and h_n.shape == h0.shape and bool(torch.isfinite(h_n).all())


def test_stack_scratch_buffers_across_shapes_and_threads(cpu_backend):
    """The Stack quantizes into, and its layers write to, each calling thread's scratch buffers,
    kept from call to call (grown when a call needs more): calls that grow and shrink them (T and
    N up and down, 1 and 3 layers, x levels or not), and two threads calling one model at once,
    all equal the reference backend bit for bit."""
    gen = torch.Generator().manual_seed(23)
    for layers, cfg in ((1, _cfg("w8a8")), (3, _cfg("w8a16")),
                        (2, _cfg("w8a8", tensors={"x": {"dynamic": True}}))):
        m = _converted(cfg, 7, 12, layers, False, False, 0)
        _forget_native(m)
        for T, N in ((1, 1), (9, 5), (1, 1), (2, 17), (30, 1), (1, 1), (3, 2)):
            x, h0 = torch.randn(T, N, 7, generator=gen), torch.randn(layers, N, 12, generator=gen)
            _assert_same(_run(m, "cpu", torch.device("cpu"), x, h0), _run(m, "reference", torch.device("cpu"), x, h0))
    m = _converted(_cfg("w8a8"), 7, 12, 2, False, False, 0)
    cases = [(torch.randn(T, N, 7, generator=gen), torch.randn(2, N, 12, generator=gen))
             for T, N in ((1, 1), (6, 3), (1, 1), (11, 2), (1, 4)) * 4]
    want = [_run(m, "reference", torch.device("cpu"), x, h) for x, h in cases]
    got = {}

    def work(first):
        with qgru.backend("cpu"), torch.no_grad():
            for i in range(first, len(cases), 2):
                for _ in range(3):
                    got[i] = m(*cases[i])

    _in_threads(work, [(0,), (1,)])
    for i, w in enumerate(want):
        _assert_same(got[i], w)


def _layer_maps(cfg: str = "w8a8", I: int = 7, H: int = 12, act16: bool = False):
    """A converted one-layer model, its LayerParams and the C++ Layer's maps for it."""
    m = _converted(_cfg(cfg), I, H)
    p = m._qparams[0][0]
    t, v = native.prepare_layer(p, act16=act16)
    return m, p, t, v


def test_layer_keeps_its_own_copies_of_its_tensors(cpu_backend):
    """A native Layer reads copies of the tensors it was given, made before it checks them: an
    in-place edit of the caller's tensors afterwards (a shift past 62, a freed table) changes
    nothing, and a negative view is read with its sign (torch applies it only on reading)."""
    mod = native.load("cpu")
    m, p, t, v = _layer_maps()
    qx, qh, _ = _random_inputs(p, 5, 3, False, torch.Generator().manual_seed(1))  # int64, as golden takes them
    want = golden.gru_direction(p, qx, qh)
    layer = mod.Layer(dict(t), dict(v), "portable")
    t["r_from_wx_shift"].fill_(200)   # past any valid shift
    t["table_r"].set_(torch.zeros(1, dtype=torch.int64))  # the old storage is freed
    if "c32_channels" in t:
        t["c32_channels"].fill_(99)
    got = layer.forward(qx, qh)
    assert torch.equal(got[0].long(), want[0].long()) and torch.equal(got[1].long(), want[1].long())
    # negative views: made of the negated values, they hold the same numbers
    _, _, t2, v2 = _layer_maps()
    neg = {k: torch._neg_view(-x) if x.dtype in (torch.int32, torch.int64) else x for k, x in t2.items()}
    assert all(torch.equal(neg[k], t2[k]) for k in t2)
    got = mod.Layer(neg, v2, "portable").forward(torch._neg_view(-qx), torch._neg_view(-qh))
    assert torch.equal(got[0].long(), want[0].long()) and torch.equal(got[1].long(), want[1].long())


def test_layer_refuses_inconsistent_limb_pairs(cpu_backend):
    """One limb pair is the GEMM's output itself (the fused step reads it so): it must be (0, 0, 1,
    0) on a one-limb activation. A 16-bit h (two activation limbs) with one pair, or a pair with
    another scale or offset, is refused before anything runs."""
    mod = native.load("cpu")
    _, _, t, v = _layer_maps()
    assert t["h_pairs"].tolist() == [[0, 0, 1, 0]]
    bad_v = dict(v, h_bits=16, h_lo=-32768, h_hi=32767, acc32=0, hg=0, h_direct16=0)
    with pytest.raises(RuntimeError, match="one limb pair must be"):
        mod.Layer(dict(t), bad_v, "portable")
    for row, msg in (([0, 0, 2, 0], "one limb pair must be"), ([0, 0, 1, 128], "one limb pair must be"),
                     ([0, 0, 1 << 20, 0], "has scale 1048576")):
        with pytest.raises(RuntimeError, match=msg):
            mod.Layer(dict(t, h_pairs=torch.tensor([row])), dict(v), "portable")
    with pytest.raises(RuntimeError, match="outside"):
        mod.Layer(dict(t), dict(v, x_direct16=2), "portable")


def test_direct16_bound_counts_minus_128(cpu_backend):
    """A 16-bit activation taken whole needs 2^15 sum_k |w_ck| < 2^31 for every row: at K = 512 rows
    of 127 fit and a row of -128 does not (int8's abs of -128 is -128; the check must take it as
    128)."""
    mod = native.load("cpu")
    _, p, t, v = _layer_maps("w8a16", I=512, H=12, act16=True)
    assert v["x_direct16"] == 1 and t["x_pairs"].tolist() == [[0, 0, 1, 0]]
    mod.Layer(dict(t), dict(v), "portable")
    w = t["x_weight_limbs"].clone()
    w[0, : 3 * 12, :512] = 127
    mod.Layer(dict(t, x_weight_limbs=w), dict(v), "portable")
    w[0, 5, :512] = -128
    with pytest.raises(RuntimeError, match="direct16"):
        mod.Layer(dict(t, x_weight_limbs=w), dict(v), "portable")


def test_native_boundary_refuses_bad_arguments(cpu_backend):
    """The float boundary, requantize, a Layer's integer operands and the Stack's values are
    checked before any pointer is read or any shift is made: bits outside [2, 16], a scale that is
    not positive, shifts outside [1, 62], operands off their grid or of a float type, and values
    that do not match the Stack's Layers are errors; negative views are read with their sign."""
    mod = native.load("cpu")
    x = torch.randn(4, 3)
    for scale, zp, bits in ((0.1, 0, 0), (0.1, 0, 17), (0.0, 0, 8), (float("nan"), 0, 8), (-1.0, 0, 8),
                            (0.1, 1 << 17, 8)):
        with pytest.raises(RuntimeError, match="out of range"):
            mod.quantize(x, scale, zp, bits, "x")
    q = mod.quantize(x, 0.05, 3, 8, "x")
    assert torch.equal(mod.quantize(torch._neg_view(-x), 0.05, 3, 8, "x"), q)
    assert torch.equal(mod.dequantize(torch._neg_view(-q), 0.05, 3), mod.dequantize(q, 0.05, 3))
    for args in ((0, 1 << 30, 0, 0, 8), (0, 1 << 30, 63, 0, 8), (0, 1 << 31, 31, 0, 8), (0, -1, 31, 0, 8),
                 (0, 1 << 30, 31, 0, 1), (0, 1 << 30, 31, 1 << 17, 8)):
        with pytest.raises(RuntimeError, match="out of range"):
            mod.requantize(q, *args)
    with pytest.raises(RuntimeError, match="integer tensor"):
        mod.requantize(x, 0, 1 << 30, 31, 0, 8)
    assert torch.equal(mod.requantize(torch._neg_view(-q), 0, 1 << 30, 31, 0, 8), mod.requantize(q, 0, 1 << 30, 31, 0, 8))
    # a Layer's operands: on their grids, integers
    m = _converted(_cfg("w8a8"), 7, 12, 2, False, False, 0)
    _forget_native(m)
    params = m._qparams_on["cpu"]
    layer = native._cpu_layer(params[0][0], native.cpu_isa_request()).layer
    qx, qh = torch.zeros(4, 3, 7, dtype=torch.int32), torch.zeros(3, 12, dtype=torch.int32)
    layer.forward(qx, qh)
    for bad_x, bad_h, msg in ((qx + 128, qh, "qx holds"), (qx - 129, qh, "qx holds"), (qx, qh + (1 << 15), "qh0 holds"),
                              (qx.float(), qh, "integer tensor"), (qx.long() + (1 << 32), qh, "qx holds")):
        with pytest.raises(RuntimeError, match=msg):
            layer.forward(bad_x, bad_h)
    # the Stack's values against its Layers
    plan = native.cpu_stack_plan(params, native.cpu_isa_request())
    layers = [native._cpu_layer(p, native.cpu_isa_request()).layer for (p,) in params]
    rows = native.stack_values(params)
    xs, h0 = torch.randn(4, 3, 7), torch.randn(2, 3, 12)
    levels = native.stack_levels(params)
    assert all(torch.equal(a, b) for a, b in zip(mod.Stack(layers, rows, levels).forward(xs, h0), plan.forward(xs, h0)))
    for l, i, value, msg in ((0, 2, 16.0, "takes"), (1, 5, 8.0, "takes"), (0, 4, rows[0][4] + 1, "takes"),
                             (0, 1, 0.5, "not an integer"), (0, 0, 0.0, "out of range"), (1, 7, 0.0, "out of range"),
                             (1, 6, 2.0 ** 31, "out of range")):
        bad = [list(r) for r in rows]
        bad[l][i] = value
        with pytest.raises(RuntimeError, match=msg):
            mod.Stack(layers, bad, levels)
    with pytest.raises(RuntimeError, match="CPU tensors"):
        mod.kernel_gemm("portable", torch.zeros(2, 3).to("meta"), torch.zeros(4, 3))


def test_stack_owns_its_layers(cpu_backend):
    """The native Stack shares the ownership of its Layers: with the list it was made from
    emptied and every other reference dropped, it still runs them."""
    mod = native.load("cpu")
    m = _converted(_cfg("w8a8"), 7, 12, 1, False, False, 0)
    p = m._qparams[0][0]
    t, v = native.prepare_layer(p)
    layers = [mod.Layer(t, v, "portable")]
    rows = native.stack_values([[p]])
    stack = mod.Stack(layers, rows)
    x, h0 = torch.randn(5, 2, 7), torch.randn(1, 2, 12)
    want = stack.forward(x, h0)
    layers.clear()
    del t, v
    import gc
    gc.collect()
    got = stack.forward(x, h0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with qgru.backend("reference"), torch.no_grad():
        ref = m(x, h0)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_stack_plan_is_tied_to_its_layers(cpu_backend):
    """The stack plan kept with a first layer's LayerParams serves only stacks of those same
    LayerParams below it: another object in its place (as QuantParams.to_module shares
    LayerParams between models) gets a plan of its own, and the first layer keeps one plan per
    depth, not one per stack it ever headed."""
    import copy
    m = _converted(_cfg("w8a8"), 7, 12, 2, False, False, 0)
    _forget_native(m)
    (p0,), (p1,) = m._qparams_on["cpu"]
    req = native.cpu_isa_request()
    plan = native.cpu_stack_plan([[p0], [p1]], req)
    assert native.cpu_stack_plan([[p0], [p1]], req) is plan
    for i in range(5):
        other = copy.copy(p1)
        other.__dict__.pop("_native", None)
        assert native.cpu_stack_plan([[p0], [other]], req) is not plan
    assert sum(k[0] == "cpu-stack" for k in p0.__dict__["_native"]) == 1
    x, h0 = torch.randn(3, 2, 7), torch.randn(2, 2, 12)
    with qgru.backend("reference"), torch.no_grad():
        ref = m(x, h0)
    got = native.cpu_stack_plan([[p0], [p1]], req).forward(x, h0)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("cfg,layers", [("w8a16", 1), ("w8a16", 2), ("w8a8", 1)])
def test_stack_one_row_calls(cpu_backend, monkeypatch, cfg, layers):
    """A stack's one-step calls of a batch of one run on each layer's one-row Layer
    (native.one_row_path) in the module's Model: the reference's floats bit for bit over a
    streaming loop carrying h, with calls of other shapes in between, for every path request this
    CPU can run; the Model's Layers have the one-row paths a NativeLayer reports and made them."""
    monkeypatch.delenv("QGRU_CPU_ISA", raising=False)
    usable = [str(i["name"]) for i in native.cpu_paths() if i["usable"]]
    m = _converted(_cfg(cfg), 7, 12, layers, False, False, 0)
    xs = torch.randn(6, 1, 7, generator=torch.Generator().manual_seed(3))
    want = _streaming_loop(m, xs, "reference", other_shape=True)
    for req in ["auto"] + usable:
        _forget_native(m)
        params = m._qparams_on["cpu"]
        path = native.resolve_cpu_isa(req)["name"]
        if req == "auto" and path == "avxvnni" and cfg == "w8a16" and "avx2" in usable:
            path = "avx2"  # native.layer_path: the whole layer runs on avx2, nothing to hand over
        if req == "auto" and path == "amx" and cfg == "w8a16" and "avx512vnni" in usable:
            path = "avx512vnni"  # native.layer_path: on its int16 GEMM, which keeps its streaming calls
        expect = ("avx2" if cfg == "w8a16" and path in ("amx", "avxvnni") and "avx2" in usable
                  else "avx512vnni" if cfg == "w8a8" and path == "amx" and "avx512vnni" in usable else "")
        monkeypatch.setenv("QGRU_CPU_ISA", req)
        _assert_same(_streaming_loop(m, xs, "cpu", other_shape=True), want)
        assert native.cpu_stack_plan(params, req) is not None
        model = params[0][0].__dict__["_native"][("cpu-model", req)][1]  # the Model the calls ran on
        assert model.one_row_paths == [expect] * layers, (req, usable)
        assert model.one_row_made == [bool(expect)] * layers, req
        for (p,) in params:
            assert native._cpu_layer(p, req).one_row_gemm == expect, (req, usable)


def _unpack_table(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of the csrc Table layout (csrc/qgru_fixedpoint.h): one int64 per segment i holding
    T[i] in the low 32 bits (two's complement) and T[i+1] - T[i] in the high 32 bits."""
    lo = ((packed & 0xFFFFFFFF) ^ (1 << 31)) - (1 << 31)
    diff = packed >> 32  # arithmetic shift: the signed high half
    return torch.cat([lo, lo[-1:] + diff[-1:]])


@pytest.mark.parametrize("overrides", [
    {"scale_mode": "multiplier"},                                              # 16-bit tables, interpolated
    {"scale_mode": "pow2",                                                     # (w8a16's default is multiplier)
     "tensors": {"r_pre": {"bits": 4}, "z_pre": {"bits": 8}, "g_pre": {"bits": 11},
                 "r": {"bits": 2}, "z": {"bits": 16}, "g": {"bits": 5}}},       # exact and small tables
])
def test_prepare_layer_rescales_and_tables(overrides):
    """The flattened rescale, zero-point and table tensors carry golden's values per channel
    (the tables in the kernels' packed layout: entry and slope per segment)."""
    p = _converted(_cfg("w8a16", **overrides), 9, 10)._qparams[0][0]
    t, v = native.prepare_layer(p)
    H = p.hidden_size
    for name, r, n in (("Wx", p.rescale["Wx"], 3 * H), ("r_from_wx", p.rescale["Wx_r"], H),
                       ("g_from_rrh", p.rescale["rRh_g"], H), ("zg", p.rescale["zg"], 1)):
        assert torch.equal(t[name + "_mult"], r.multiplier.reshape(-1).expand(n).to(torch.int64))
        assert torch.equal(t[name + "_shift"].long(), r.shift.reshape(-1).expand(n).long())
    for g in ("r", "z", "g"):
        table = p.tables[g].to(torch.int64)
        if g == "g":
            assert bool((table < 0).any())  # the tanh table exercises negative entries and slopes
        assert torch.equal(_unpack_table(t[f"table_{g}"]), table)
        assert v[f"{g}_zp"] == int(p.zp[g])
    assert v["h_zp"] == int(p.zp["h"]) and v["one_z"] == p.one_z
    # the shift-only kernels exactly when every multiplier is a power of two
    assert v["pow2"] == (0 if overrides.get("scale_mode") == "multiplier" else 1)


# ---------------------------------------------------------------------------------------------
# Each CPU path's GEMM alone (qgru_cpu_ext.kernel_gemm), against int64 matmul
# ---------------------------------------------------------------------------------------------
def _usable_paths():
    return [str(i["name"]) for i in native.cpu_paths() if i["usable"]]


@settings(max_examples=_examples(40), **_SETTINGS)
@given(rows=st.integers(1, 40), K=st.integers(1, 300), M=st.integers(1, 70), gates=st.booleans(),
       extreme=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_cpu_path_gemm_exact(cpu_backend, rows, K, M, gates, extreme, seed):
    """Every usable path's packed GEMM (plain and the fused step's gate layout) gives the exact
    int8 x int8 products: shapes that are no multiple of 4, 8, 16 or 64, a single row, and the
    extremes -128 x -128 everywhere."""
    mod = native.load("cpu")
    gen = torch.Generator().manual_seed(seed)
    M = 3 * max(1, M // 3) if gates else M
    a = torch.randint(-128, 128, (rows, K), generator=gen)
    w = torch.randint(-128, 128, (M, K), generator=gen)
    if extreme:
        a[:, : K // 2 + 1], w[:, : K // 2 + 1] = -128, -128
    want = a @ w.t()
    for path in _usable_paths():
        got = mod.kernel_gemm(path, a, w, gates)
        assert torch.equal(got.long(), want), (path, (got.long() != want).nonzero()[:5].tolist())


@pytest.mark.parametrize("K", [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 40, 63, 64, 65, 72])
def test_cpu_path_gemm_k_around_the_packing_step(cpu_backend, K):
    """K packed and multiplied in steps of 8 (vpdpbusd paths) and 4 (avx2) instead of 64 (issue 40):
    exact at and around every step, one row and 1-3 row tiles, plain and gate layouts, extremes."""
    mod = native.load("cpu")
    gen = torch.Generator().manual_seed(K)
    for rows in (1, 3, 8, 17):
        a = torch.randint(-128, 128, (rows, K), generator=gen)
        w = torch.randint(-128, 128, (48, K), generator=gen)
        a[0], w[0] = -128, -128
        want = a @ w.t()
        for path in _usable_paths():
            for gates in (False, True):
                got = mod.kernel_gemm(path, a, w, gates)
                assert torch.equal(got.long(), want), (path, K, rows, gates)


@pytest.mark.parametrize("K", [4096, 65535, 131071])
def test_cpu_path_gemm_largest_k(cpu_backend, K):
    """int8 products at the extremes up to the largest K (|sum| = K 2^14 < 2^31): exact on every path
    (avx512vnni's offset sum passes 2^31 there and must wrap back)."""
    mod = native.load("cpu")
    for av, wv in ((-128, -128), (127, -128), (-128, 127)):
        a = torch.full((2, K), av)
        w = torch.full((3, K), wv)
        for path in _usable_paths():
            assert mod.kernel_gemm(path, a, w).long().tolist() == [[K * av * wv] * 3] * 2, (path, K, av, wv)


def test_avx2_gemm_takes_16_bit_activations_up_to_the_bound(cpu_backend):
    """The avx2 path's int16 operands: 16-bit activations times 8-bit weights are exact while
    K 2^15 max|w| < 2^31 (native.direct16_fits admits K <= 516 at 127), and wrap just past it, so
    the bound is the real one (this test fails if the kernel's sums were wider or narrower)."""
    if "avx2" not in _usable_paths():
        pytest.skip("this CPU cannot run the avx2 path")
    mod = native.load("cpu")
    for K in (516, 520):
        a = torch.tensor([[-32768] * K, [32767] * K])
        w = torch.tensor([[127] * K, [-127] * K, [-128] * (K // 2) + [127] * (K - K // 2)])
        want = a @ w.t()
        got = mod.kernel_gemm("avx2", a, w).long()
        fits = native.direct16_fits(w[:2], 8, 16)
        assert fits == (K == 516)
        if fits:
            assert torch.equal(got, want)
        else:  # past the bound the int32 sums wrap: that is why the layer splits into limbs there
            assert torch.equal(got, (want + 2 ** 31) % 2 ** 32 - 2 ** 31) and not torch.equal(got, want)


def test_phase_profile_clock(cpu_backend):
    """scripts/profile_cpu.py's phase clock (issue 40): off by default (a call adds nothing); on, one
    stack call counts once and times its quantize, W.x, R.h, cell and dequantize phases."""
    mod = native.load("cpu")
    torch.manual_seed(0)
    gru = torch.nn.GRU(8, 16)
    q = qgru.quantize_model(gru, [torch.randn(5, 20, 8)], progress=False)
    x = torch.randn(4, 20, 8)
    with qgru.backend("cpu"), torch.no_grad():
        want = q(x)
        mod.profile_read(True)
        q(x)
        assert mod.profile_read(True) == [0] * 8
        mod.profile_enable(True)
        try:
            got = q(x)
        finally:
            mod.profile_enable(False)
        v = mod.profile_read(True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    names = ["quantize", "W.x", "R.h", "cell", "wait", "dequantize", "stack"]
    assert v[7] == 1 and all(v[names.index(k)] > 0 for k in ("quantize", "W.x", "R.h", "cell", "stack")), v


def test_cpu_isa_request_follows_the_environment(monkeypatch):
    """cpu_isa_request reads os.environ's own dict (a streaming call's cost): every way of setting,
    changing and removing QGRU_CPU_ISA is seen at once, as os.environ.get would see it."""
    monkeypatch.delenv("QGRU_CPU_ISA", raising=False)
    assert native.cpu_isa_request() == "auto"
    for value, expect in ((" AVX2 ", "avx2"), ("", "auto"), ("portable", "portable"), ("  ", "auto"),
                          ("avx512VNNI", "avx512vnni")):
        monkeypatch.setenv("QGRU_CPU_ISA", value)
        assert native.cpu_isa_request() == expect == (os.environ.get("QGRU_CPU_ISA").strip().lower() or "auto")
    os.environ["QGRU_CPU_ISA"] = "amx"  # a plain write, then a delete
    assert native.cpu_isa_request() == "amx"
    del os.environ["QGRU_CPU_ISA"]
    assert native.cpu_isa_request() == "auto"


# ---------------------------------------------------------------------------------------------
# 16-bit activations taken whole (issue 40, w8a16): every int16 GEMM (avx2's, portable's, and
# avx512vnni's vpdpwssd sibling, Kernels::act16) up to the row-sum bound, and the int32 cell with
# wide accumulators (qgru_cell.h requant_wide32, cell_loops.h cell_tile's WIDE form) against golden at it
# ---------------------------------------------------------------------------------------------
def _int16_gemms():
    """(path, kernel_gemm name) of every usable path that takes 16-bit activations whole."""
    return [(str(i["name"]), str(i["name"]) + ("+int16" if i["act_bytes"] == 1 else ""))
            for i in native.cpu_paths() if i["usable"] and i["act16"]]


@pytest.mark.parametrize("K", [1, 5, 16, 63, 516, 517, 1024])
def test_int16_gemm_exact_to_the_row_sum_bound(cpu_backend, K):
    """16-bit activations at their extremes, aligned with the weights' signs (the largest sums),
    times 8-bit weights whose rows sum to just below 2^16 in magnitude (+-127 up to K = 516, smaller
    beyond): exact on every int16 GEMM, plain and gate layouts, 1 and 17 rows."""
    mod = native.load("cpu")
    gen = torch.Generator().manual_seed(K)
    mag = min(127, 65535 // K)
    w = (torch.randint(0, 2, (48, K), generator=gen) * 2 - 1) * mag
    w[5] = torch.randint(-mag, mag + 1, (K,), generator=gen)
    assert native.direct16_fits(w, 8, 16)
    for rows in (1, 17):
        a = _random_ints((rows, K), 16, gen)
        a[0] = torch.where(w[0] > 0, 32767, -32768)   # the largest positive sum of row 0
        if rows > 1:
            a[1] = torch.where(w[1] > 0, -32768, 32767)  # the most negative of row 1
        want = a @ w.t()
        for path, name in _int16_gemms():
            for gates in (False, True):
                got = mod.kernel_gemm(name, a, w, gates)
                assert torch.equal(got.long(), want), (path, K, rows, gates)


def test_int16_gemms_wrap_past_the_bound(cpu_backend):
    """Just past 2^15 sum|w| < 2^31 the int32 sums of the SIMD int16 GEMMs wrap (vpmaddwd / vpdpwssd
    add modulo 2^32): the bound is the real one, which is why prepare.py splits such a layer's
    activations into limbs."""
    mod = native.load("cpu")
    K = 520
    a = torch.tensor([[-32768] * K, [32767] * K])
    w = torch.tensor([[127] * K, [-127] * K, [-128] * (K // 2) + [127] * (K - K // 2)])
    want = a @ w.t()
    assert not native.direct16_fits(w, 8, 16)
    for path, name in _int16_gemms():
        if path == "portable":  # plain C++ int32 sums: past the bound they would overflow (never run)
            continue
        got = mod.kernel_gemm(name, a, w).long()
        assert torch.equal(got, (want + 2 ** 31) % 2 ** 32 - 2 ** 31) and not torch.equal(got, want), path


def _bound_layer(mode: str, I: int, H: int, shape: str, seed: int) -> golden.LayerParams:
    """A w8a16 layer whose integer weight rows sum to near the int16 GEMM's bound: "pm127", every
    weight +-127 (rows of I or H of them); "rowsum", one +-127 and the rest +-61 per row."""
    config = QuantConfig.load("w8a16", overrides={"scale_mode": mode})
    g = torch.Generator().manual_seed(seed)
    def weights(rows, K):
        s = torch.randint(0, 2, (rows, K), generator=g).double() * 2 - 1
        m = torch.full((rows, K), 1.0, dtype=torch.float64)
        if shape == "rowsum":
            m[:, 1:] = 61.0 / 127.0
        return (s * m * 2.0 ** -3).float()
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), lo, dtype=torch.float64), torch.full((3 * H,), hi, dtype=torch.float64))
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-16, 20), "Rh": per(-12, 8),
              "r_pre": one(-6, 6), "z_pre": one(-6, 6), "g_pre": one(-5, 7)}
    b = lambda: torch.randn(3 * H, generator=g) * 0.25
    return derive_layer_params(weights(3 * H, I), weights(3 * H, H), b(), b(), ranges, config)


@pytest.mark.parametrize("mode", ["multiplier", "pow2"])
@pytest.mark.parametrize("I,H,shape", [(516, 24, "pm127"), (517, 24, "pm127"), (1024, 20, "rowsum"),
                                       (40, 516, "pm127")])
def test_w8a16_int16_paths_at_the_bound(cpu_backend, mode, I, H, shape):
    """w8a16 layers at the int16 GEMM's bound (K = 516 of +-127: taken whole; K = 517: limbs; K = 1024
    with smaller weights: whole by the row sums) on every usable path, golden's integers with the
    activations at their extremes and aligned with the first weight rows (the largest sums), N = 17
    (a 16-row tile and one more) and a batch of one. Where both 16-bit operands are taken whole the
    layer is one fused pass with the int32 cell on wide accumulators (acc_wide)."""
    p = _bound_layer(mode, I, H, shape, seed=I + H)
    fits_x = int(p.W.abs().sum(1).max()) < 2 ** 16
    # (pow2 scales round the weights' grid up to a power of two: their integers fall below 127)
    assert (fits_x == (I != 517) or mode == "pow2") and native.direct16_fits(p.R, 8, 16)
    _, v = native.prepare_layer(p, act16=True)
    assert v["x_direct16"] == int(fits_x) and v["h_direct16"] == 1
    assert v["acc_wide"] == v["acc32"] == int(fits_x), (v["acc_wide"], v["acc32"])
    gen = torch.Generator().manual_seed(I * 7 + H)
    for path in [str(i["name"]) for i in native.cpu_paths() if i["usable"]]:
        layer = native.NativeLayer("cpu", p, torch.device("cpu"), isa=path)
        assert layer.gemm == _expected_gemm(f"cpu:{path}", p), (path, layer.gemm)
        if native.layer_act16(p, path):
            assert layer.gemm == path + ("-fused" if fits_x else "")
        for T, N in ((3, 17), (2, 1), (1, 1)):
            qx, qh0, _ = _random_inputs(p, T, N, False, gen)
            qx[:, 0] = torch.where(p.W[0] > 0, 32767, -32768)
            qh0[0] = torch.where(p.R[H] > 0, 32767, -32768)
            want_out, want_h = golden.gru_direction(p, qx, qh0, None)
            got_out, got_h = layer(qx, qh0, None)
            assert torch.equal(got_out.long(), want_out) and torch.equal(got_h.long(), want_h), (path, T, N)


@pytest.mark.parametrize("mode", ["multiplier", "pow2"])
def test_w8a16_avx512vnni_int16_sibling(cpu_backend, mode):
    """On avx512vnni a w8a16 layer whose x and h the int16 GEMM takes whole runs the int16 sibling:
    one fused pass with the wide int32 cell (not two limb pairs per GEMM and the int64 cell), its
    streaming calls on itself (one_row_path None), x levels and lengths included: golden's integers."""
    if "avx512vnni" not in {str(i["name"]) for i in native.cpu_paths() if i["usable"]}:
        pytest.skip("needs a CPU that runs avx512vnni")
    m = _converted(_cfg("w8a16", scale_mode=mode), 23, 70)
    p = m._qparams[0][0]
    assert p.x_levels is not None and native.layer_act16(p, "avx512vnni")
    assert native.one_row_path(p, "avx512vnni") is None
    _, v = native.prepare_layer(p, act16=True)
    assert v["acc32"] == v["acc_wide"] == 1
    layer = native.NativeLayer("cpu", p, torch.device("cpu"), isa="avx512vnni")
    assert layer.gemm == "avx512vnni-fused" and layer.one_row_gemm == ""
    gen = torch.Generator().manual_seed(5)
    J = int(p.x_levels.exponent.numel())
    for T, N, lengths in ((4, 19, True), (1, 1, False), (5, 3, True), (2, 33, False)):
        qx, qh0, ln = _random_inputs(p, T, N, lengths, gen)
        level = torch.randint(0, J, (T, N), generator=gen)
        level[:, 0] = 0
        want_out, want_h = golden.gru_direction(p, qx, qh0, ln, level=level)
        got_out, got_h = layer(qx, qh0, ln, level.int())
        assert torch.equal(got_out.long(), want_out) and torch.equal(got_h.long(), want_h), (T, N)
