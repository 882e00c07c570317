"""qgru.summary(model): what each GRU of a model holds and what runs it, one row per GRU.

A model rebuilt and loaded non-strictly (darts' and NeuralForecast's own save()/load(), any
``load_state_dict(sd, strict=False)`` into a plain model) comes back float without a word: its
GRUs are torch.nn.GRU, or QuantGRUs that were never converted. summary() says so:

    >>> print(qgru.summary(model))          # a table: name, class, mode, config, backend, shape
    >>> assert qgru.summary(model).all_quantized, qgru.summary(model)

Mode: ``float`` (torch.nn.GRU, or a QuantGRU not converted), ``calibrating``, ``qat``,
``integer`` (a converted QuantGRU) or ``weight-only`` (a WeightOnlyGRU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from torch import nn

from .module import QuantGRU
from .weight_only.module import WeightOnlyGRU


@dataclass(frozen=True)
class GRUSummary:
    name: str  # the GRU's name in the model ("" for the model itself)
    cls: str  # its class
    mode: str  # float, calibrating, qat, integer, weight-only
    config: str  # the quantization config's name ("-" for a float nn.GRU)
    backend: str  # what runs a call on the module's device
    shape: str  # input -> hidden, layers, directions

    @property
    def quantized(self) -> bool:
        """Runs quantized parameters: integer or weight-only."""
        return self.mode in ("integer", "weight-only")


class Summary(list):
    """A list of GRUSummary, one per GRU (each once, even where held under several names); its
    str() is a table."""

    @property
    def all_quantized(self) -> bool:
        """Every GRU runs quantized parameters (and there is at least one GRU)."""
        return bool(self) and all(r.quantized for r in self)

    @property
    def float_grus(self) -> List[str]:
        """The names of the GRUs that run float."""
        return [r.name or "(model)" for r in self if not r.quantized]

    def __str__(self) -> str:
        head = ("name", "class", "mode", "config", "backend", "shape")
        rows = [head] + [(r.name or "(model)", r.cls, r.mode, r.config, r.backend, r.shape) for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if not self:
            lines.append("(no GRU in this model)")
        else:
            n = sum(r.quantized for r in self)
            lines.append(f"{n} of {len(self)} GRU(s) quantized" +
                         ("" if n == len(self) else f"; float: {', '.join(self.float_grus)}"))
        return "\n".join(lines)


def _device(m: nn.Module) -> torch.device:
    for t in list(m.parameters()) + list(m.buffers()):
        return t.device
    return torch.device("cpu")


def _shape(m) -> str:
    return (f"{m.input_size}->{m.hidden_size}, {m.num_layers} layer(s)" +
            (", bidirectional" if m.bidirectional else ""))


def _integer_backend(dev: torch.device) -> str:
    """The backend a converted QuantGRU's call runs on, as the call decides it (backends.choose_backend)."""
    from .backends import choose_backend, forced_backend_name
    try:
        b, forced, _ = choose_backend(dev.type)
    except RuntimeError:  # a forced backend that cannot run this device's tensors: the call raises
        return f"{forced_backend_name()} (forced; a call on {dev.type} raises)"
    return b.name + (" (forced)" if forced else "")


def _row(name: str, m: nn.Module) -> GRUSummary:
    if isinstance(m, WeightOnlyGRU):
        backend = m.backend + (f" (last call: {m.last_path})" if m.last_path else "")
        return GRUSummary(name, type(m).__name__, "weight-only", m.config.name, backend, _shape(m))
    if isinstance(m, QuantGRU):
        if m.is_converted:
            mode, backend = "integer", _integer_backend(_device(m))
        elif m.is_qat:
            mode, backend = "qat", "golden (QAT surrogate)"
        else:
            mode = "calibrating" if m._calibrating else "float"
            backend = "torch (float)"
        return GRUSummary(name, type(m).__name__, mode, m.qconfig.name, backend, _shape(m))
    return GRUSummary(name, type(m).__name__, "float", "-", "torch (float)", _shape(m))


def summary(model: nn.Module) -> Summary:
    """One GRUSummary per GRU of ``model`` (torch.nn.GRU and its subclasses, QuantGRU, WeightOnlyGRU),
    in module order; print it for a table, or check ``.all_quantized`` after loading a model."""
    out, seen = Summary(), set()
    for name, m in model.named_modules():
        if isinstance(m, (nn.GRU, WeightOnlyGRU)) and id(m) not in seen:
            seen.add(id(m))
            out.append(_row(name, m))
    return out
