"""Export of a converted QuantGRU: plain tensors and ints, saved without arbitrary pickling.

``QuantParams.to_dict()`` is a flat dict ``{key: tensor | int | str}``; keys are
``l{layer}.{fwd|rev}.{field}`` (e.g. ``l0.fwd.W``, ``l1.rev.rescale.Wx.multiplier``) plus
a ``meta`` entry (JSON) for the module's arguments and the config. Integers are stored in the
narrowest type that holds them: weights int8 (int16 above 8 bits; below 8 bits packed several per
int32 word as ``W.packed`` / ``R.packed``, seed 003), biases, zero points, multipliers, shifts and
table entries int32, zero-point compensations int64; the only floats are the x and h scales (used
where floats enter and leave the model) and the weight scales (for dequantized float weights).
``save()`` writes it with
torch.save and ``load_params()`` reads it back with ``torch.load(weights_only=True)``, which
refuses anything but tensors and plain containers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Union

import torch

from .golden import LayerParams, Rescale
from .primitives import pack_int32, unpack_int32

FORMAT_VERSION = 1
_DIRS = ("fwd", "rev")


@dataclass
class QuantParams:
    meta: Dict[str, Any]
    layers: List[List[LayerParams]]

    @classmethod
    def from_module(cls, m) -> "QuantParams":
        meta = {"format_version": FORMAT_VERSION, "input_size": m.input_size, "hidden_size": m.hidden_size,
                "num_layers": m.num_layers, "bias": m.bias, "batch_first": m.batch_first,
                "bidirectional": m.bidirectional, "config": m.qconfig.to_dict()}
        return cls(meta=meta, layers=[list(row) for row in m._qparams])

    def to_dict(self) -> Dict[str, Union[torch.Tensor, int, str]]:
        out: Dict[str, Union[torch.Tensor, int, str]] = {"meta": json.dumps(self.meta, sort_keys=True)}
        for li, row in enumerate(self.layers):
            for d, p in enumerate(row):
                pre = f"l{li}.{_DIRS[d]}."
                for f in fields(p):
                    v = getattr(p, f.name)
                    if f.name in ("W", "R"):
                        bits = p.bits[f.name]
                        if bits < 8:
                            out[f"{pre}{f.name}.packed"] = pack_int32(v, bits)
                        else:
                            out[pre + f.name] = v.to(torch.int8 if bits <= 8 else torch.int16)
                    elif isinstance(v, dict):
                        for k, x in v.items():
                            if isinstance(x, Rescale):
                                out[f"{pre}{f.name}.{k}.multiplier"] = x.multiplier.to(torch.int32)
                                out[f"{pre}{f.name}.{k}.shift"] = x.shift.to(torch.int32)
                            else:
                                out[f"{pre}{f.name}.{k}"] = _narrow(x)
                    else:
                        out[pre + f.name] = _narrow(v) if f.name in ("b_x", "b_h") else v
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "QuantParams":
        meta = json.loads(d["meta"])
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"unsupported qgru params format {meta.get('format_version')!r}")
        ndir = 2 if meta["bidirectional"] else 1
        layers = []
        for li in range(meta["num_layers"]):
            row = []
            for di in range(ndir):
                pre = f"l{li}.{_DIRS[di]}."
                kw: Dict[str, Any] = {}
                for f in fields(LayerParams):
                    if pre + f.name + ".packed" in d:
                        bits = d[pre + "bits." + f.name]
                        length = d[pre + ("input_size" if f.name == "W" else "hidden_size")]
                        kw[f.name] = unpack_int32(d[pre + f.name + ".packed"], bits, length)
                        continue
                    if pre + f.name in d:
                        kw[f.name] = _widen(d[pre + f.name])
                        continue
                    sub: Dict[str, Any] = {}
                    for key, v in d.items():
                        if key.startswith(pre + f.name + "."):
                            rest = key[len(pre + f.name) + 1:]
                            if f.name == "rescale":
                                name, part = rest.rsplit(".", 1)
                                sub.setdefault(name, {})[part] = v
                            else:
                                sub[rest] = _widen(v)
                    if f.name == "rescale":
                        sub = {k: Rescale(_widen(v["multiplier"]), _widen(v["shift"])) for k, v in sub.items()}
                    kw[f.name] = sub
                row.append(LayerParams(**kw))
            layers.append(row)
        return cls(meta=meta, layers=layers)

    def save(self, path: Union[str, Path]) -> None:
        torch.save(self.to_dict(), str(path))

    def to_c(self, path: Union[str, Path], **kw):
        """Write one layer and direction as C99 (``path``.h and ``path``.c): see qgru.export_c.write_c
        (keywords: layer, direction, golden_steps, seed, prefix). Returns (header path, source path)."""
        from .export_c import write_c  # export_c imports this module
        return write_c(self, path, **kw)

    def to_module(self):
        """A converted QuantGRU that runs these parameters (float weights are the dequantized ones)."""
        from .module import QuantGRU
        m = self.meta
        q = QuantGRU(m["input_size"], m["hidden_size"], m["num_layers"], m["bias"], m["batch_first"],
                     0.0, m["bidirectional"], config=m["config"])
        with torch.no_grad():
            for li, row in enumerate(self.layers):
                for d, p in enumerate(row):
                    w_ih, w_hh, b_ih, b_hh = q._weights(li, d)
                    w_ih.copy_(p.W.double() * p.scale["W"].unsqueeze(1))
                    w_hh.copy_(p.R.double() * p.scale["R"].unsqueeze(1))
                    if b_ih is not None:
                        b_ih.copy_(p.b_x.double() * p.scale["W"] * p.scale["x"])
                        b_hh.copy_(p.b_h.double() * p.scale["R"] * p.scale["h"])
        q._set_params([list(row) for row in self.layers])
        return q


def _narrow(v):
    """int64 tensors whose values fit in int32 are stored as int32 (floats and ints unchanged)."""
    if isinstance(v, torch.Tensor) and v.dtype == torch.int64 and \
            (v.numel() == 0 or (int(v.min()) >= -(1 << 31) and int(v.max()) < (1 << 31))):
        return v.to(torch.int32)
    return v


def _widen(v):
    """Stored integer tensors come back as int64, the golden model's working type."""
    if isinstance(v, torch.Tensor) and not v.is_floating_point():
        return v.to(torch.int64)
    return v


def load_params(path: Union[str, Path]) -> QuantParams:
    """Read a file written by QuantParams.save() (no arbitrary unpickling)."""
    return QuantParams.from_dict(torch.load(str(path), weights_only=True))
