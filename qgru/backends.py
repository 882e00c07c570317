"""Backend registry: who runs the integer GRU.

``reference`` is the golden model (qgru/golden.py), always available, on any device torch runs
on. Native backends (C++ CPU, CUDA) register here when built; each must match ``reference`` bit
for bit. ``qgru.backends()`` reports every known backend and, for an unavailable one, why.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

from . import golden


@dataclass(frozen=True)
class Backend:
    name: str
    gru_direction: Optional[Callable]  # (LayerParams, qx, qh0, lengths) -> (q outputs, q h_n)
    why_unavailable: str = ""

    @property
    def available(self) -> bool:
        return self.gru_direction is not None


_REGISTRY: Dict[str, Backend] = {
    "reference": Backend("reference", golden.gru_direction),
    "native": Backend("native", None, "the C++/CUDA extension (csrc/) is not part of this version of qgru"),
}
_forced = threading.local()


def backends() -> Dict[str, Dict[str, object]]:
    """Every known backend: {"name": {"available": bool, "why": reason when unavailable}}."""
    return {n: {"available": b.available, "why": b.why_unavailable} for n, b in _REGISTRY.items()}


@contextlib.contextmanager
def backend(name: str) -> Iterator[Backend]:
    """Force one backend inside a ``with`` block (errors if it is unknown or unavailable)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}")
    b = _REGISTRY[name]
    if not b.available:
        raise RuntimeError(f"backend {name!r} is unavailable: {b.why_unavailable}")
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield b
    finally:
        _forced.name = previous


def current_backend() -> Backend:
    """The forced backend, else the best available one (today: reference)."""
    name = getattr(_forced, "name", None)
    if name is not None:
        return _REGISTRY[name]
    return _REGISTRY["reference"]
