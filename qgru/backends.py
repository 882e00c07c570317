"""Backend registry: who runs the integer GRU.

* ``reference``: the golden model (qgru/golden.py), always available, on any device torch runs on.
  It is the specification, not the fast path.
* ``cpu``: the C++ extension (csrc/qgru_cpu.cpp), for CPU tensors.
* ``cuda``: the CUDA extension (csrc/qgru_cuda*.cu/.cpp), for CUDA tensors.

Every native backend matches ``reference`` bit for bit (tests/test_native.py). Without a forced
backend, a converted QuantGRU runs on the native backend of its device; if that backend is
unavailable it falls back to ``reference`` and warns once, naming the reason.
``qgru.backends()`` reports every backend and, for an unavailable one, why (asking builds the
extension if needed).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

from . import golden, native, primitives


class BoundaryOps:
    """Where floats enter and leave the integer model, and the layer-to-layer requantization.

    The reference implementations (golden model primitives); a native backend may supply
    one-pass versions that return the same integers and floats (tests/test_native.py).
    """

    def quantize(self, x: torch.Tensor, scale, zp, bits: int, what: str) -> torch.Tensor:
        if torch.isnan(x).any():
            raise ValueError(f"QuantGRU {what} contains NaN, which has no quantized value "
                             "(out-of-range and infinite values saturate)")
        return primitives.quantize(x, scale, zp, bits)

    def quantize_levels(self, x: torch.Tensor, levels: "golden.XLevels", zp, bits: int, what: str):
        """(q, level): each token of x on its own x level (golden.quantize_levels)."""
        if torch.isnan(x).any():
            raise ValueError(f"QuantGRU {what} contains NaN, which has no quantized value "
                             "(out-of-range and infinite values saturate)")
        return golden.quantize_levels(levels, x, zp, bits)

    def dequantize(self, q: torch.Tensor, scale, zp) -> torch.Tensor:
        return primitives.dequantize(q, scale, zp)

    def requantize(self, q: torch.Tensor, from_zp, rescale, to_zp, bits: int) -> torch.Tensor:
        return golden.requantize_input(q, from_zp, rescale, to_zp, bits)


class _NativeCpuBoundaryOps(BoundaryOps):
    def __init__(self, mod) -> None:
        self.mod = mod

    # the C++ reads raw memory: negative / conjugate views are resolved first (native.resolved)
    def quantize(self, x, scale, zp, bits, what):
        return self.mod.quantize(native.resolved(x), float(scale), int(zp), int(bits), what, native.cpu_isa_request())

    def quantize_levels(self, x, levels, zp, bits, what):
        return self.mod.quantize_levels(native.resolved(x), *_level_lists(levels), int(zp), int(bits), what,
                                        native.cpu_isa_request())

    def dequantize(self, q, scale, zp):
        return self.mod.dequantize(native.resolved(q), float(scale), int(zp))

    def requantize(self, q, from_zp, rescale, to_zp, bits):
        if rescale.multiplier.numel() != 1:  # per-tensor factors only (what convert() derives)
            return super().requantize(q, from_zp, rescale, to_zp, bits)
        return self.mod.requantize(native.resolved(q), int(from_zp), int(rescale.multiplier), int(rescale.shift),
                                   int(to_zp), int(bits))


def _host_scalar(t, kind=float):
    """A one-element scalar parameter as a Python number, read once per tensor: device parameters
    (LayerParams.to("cuda")) would otherwise cost a device-to-host copy per call."""
    if not isinstance(t, torch.Tensor):
        return kind(t)
    v = getattr(t, "_qgru_host_value", None)
    if v is None:
        v = kind(t.item())
        t._qgru_host_value = v
    return v


def _level_lists(levels: "golden.XLevels"):
    """(scale, lo, hi) of x levels as lists of floats (what the native quantize_levels take), read
    once per XLevels: device parameters would otherwise cost a device-to-host copy per call."""
    v = getattr(levels, "_qgru_host_lists", None)
    if v is None:
        v = tuple([float(x) for x in t.reshape(-1).tolist()] for t in (levels.scale, levels.lo, levels.hi))
        levels._qgru_host_lists = v
    return v


class _NativeCudaBoundaryOps(BoundaryOps):
    """One kernel pass each for quantize and dequantize (csrc/qgru_cuda.cpp), on the arithmetic of
    csrc/qgru_fixedpoint.h that the CPU backend's boundary computes too; the layer-to-layer
    requantization stays the reference's (torch integer ops on the device). Neither waits for the
    GPU: NaN quantizes as 0.0 and sets the device's NaN flag (qgru.cuda_nan_seen), unless
    QGRU_CUDA_NAN_CHECK=1 (then the reference's ValueError, after a wait; docs/spec.md section 11)."""

    def __init__(self, mod) -> None:
        self.mod = mod

    def quantize(self, x, scale, zp, bits, what):
        return self.mod.quantize(native.resolved(x), _host_scalar(scale), _host_scalar(zp, int), int(bits), what)

    def quantize_levels(self, x, levels, zp, bits, what):
        return self.mod.quantize_levels(native.resolved(x), *_level_lists(levels), _host_scalar(zp, int), int(bits),
                                        what)

    def dequantize(self, q, scale, zp):
        return self.mod.dequantize(native.resolved(q), _host_scalar(scale), _host_scalar(zp, int))


_REFERENCE_BOUNDARY = BoundaryOps()


@dataclass(frozen=True)
class Backend:
    name: str
    device_type: Optional[str]  # the tensors it runs ("cpu", "cuda"), None for any

    @property
    def gru_direction(self) -> Callable:
        """(LayerParams, qx, qh0, lengths, level=None) -> (q outputs, q h_n); raises if unavailable.
        ``level``: each token's x level, for a layer with x levels (golden.gru_direction)."""
        if self.name == "reference":
            return golden.gru_direction
        why = native.why_unavailable(self.name)
        if why:
            raise RuntimeError(f"backend {self.name!r} is unavailable: {why}")
        return native.gru_direction(self.name)

    @property
    def boundary(self) -> BoundaryOps:
        if self.name == "cpu" and self.available:
            return _NativeCpuBoundaryOps(native.load("cpu"))
        if self.name == "cuda" and self.available:
            return _NativeCudaBoundaryOps(native.load("cuda"))
        return _REFERENCE_BOUNDARY

    @property
    def why_unavailable(self) -> str:
        return "" if self.name == "reference" else native.why_unavailable(self.name)

    @property
    def available(self) -> bool:
        return not self.why_unavailable


_REGISTRY: Dict[str, Backend] = {
    "reference": Backend("reference", None),
    "cpu": Backend("cpu", "cpu"),
    "cuda": Backend("cuda", "cuda"),
}


class _Forced(threading.local):
    """The backend qgru.backend() forces on this thread (each thread starts with None). A class
    default, not getattr(..., None): getattr raises and catches inside where a thread never set
    the attribute (0.63 us a read, against 0.08 us, on the AMD EPYC), and a streaming call reads it
    every call."""
    name: Optional[str] = None


_forced = _Forced()
_warned = set()
_warn_lock = threading.Lock()


def backends() -> Dict[str, Dict[str, object]]:
    """Every known backend: {"name": {"available": bool, "why": reason when unavailable}}; the
    available cpu backend also says which GEMMs it runs ("detail"). The cpu backend is reported
    unavailable while QGRU_CPU_ISA names a path that is unknown or that this CPU cannot run, with
    the ValueError every CPU forward call raises then as the reason."""
    out = {}
    for n, b in _REGISTRY.items():
        why = b.why_unavailable
        if n == "cpu" and not why:
            try:
                native.resolve_cpu_isa()
            except ValueError as e:
                why = str(e)
        out[n] = {"available": not why, "why": why}
        if n == "cpu" and not why:
            out[n]["detail"] = native.cpu_gemm_detail()
    return out


@contextlib.contextmanager
def backend(name: str) -> Iterator[Backend]:
    """Force one backend inside a ``with`` block (errors if it is unknown or unavailable)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}")
    b = _REGISTRY[name]
    why = b.why_unavailable
    if why:
        raise RuntimeError(f"backend {name!r} is unavailable: {why}")
    previous = _forced.name
    _forced.name = name
    try:
        yield b
    finally:
        _forced.name = previous


def forced_backend_name() -> Optional[str]:
    """The backend qgru.backend() forces on this thread, or None."""
    return _forced.name


def choose_backend(device_type: str = "cpu") -> Tuple[Backend, bool, str]:
    """(backend, forced, why_fallback): the backend a call on ``device_type`` tensors runs (the forced
    one, else that device's native backend, else reference), whether it was forced, and why the
    native backend is unavailable where reference stands in for it ("" otherwise). current_backend
    (which warns about the fallback) and qgru.summary both decide through this."""
    name = _forced.name
    if name is not None:
        b = _REGISTRY[name]
        if b.device_type not in (None, device_type):
            raise RuntimeError(f"backend {name!r} runs {b.device_type} tensors, the input is on {device_type}")
        return b, True, ""
    if device_type in _REGISTRY:
        why = _REGISTRY[device_type].why_unavailable
        if not why:
            return _REGISTRY[device_type], False, ""
        return _REGISTRY["reference"], False, why
    return _REGISTRY["reference"], False, ""


def current_backend(device_type: str = "cpu") -> Backend:
    """The forced backend, else the native backend for ``device_type``, else reference (warned once)."""
    b, _, why = choose_backend(device_type)
    if why:
        with _warn_lock:
            if device_type not in _warned:
                _warned.add(device_type)
                warnings.warn(f"qgru: the {device_type} backend is unavailable ({why}); falling back to the "
                              "reference backend, which is much slower. qgru.backends() lists the backends.",
                              RuntimeWarning, stacklevel=3)
    return b
