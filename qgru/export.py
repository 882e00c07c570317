"""Export of a converted QuantGRU: plain tensors and ints, saved without arbitrary pickling.

``QuantParams.to_dict()`` is a flat dict ``{key: tensor | int | str}``; keys are
``l{layer}.{fwd|rev}.{field}`` (e.g. ``l0.fwd.W``, ``l1.rev.rescale.Wx.multiplier``) plus
``meta.*`` entries for the module's arguments and the config (JSON). ``save()`` writes it with
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
                    if isinstance(v, dict):
                        for k, x in v.items():
                            if isinstance(x, Rescale):
                                out[f"{pre}{f.name}.{k}.multiplier"] = x.multiplier
                                out[f"{pre}{f.name}.{k}.shift"] = x.shift
                            else:
                                out[f"{pre}{f.name}.{k}"] = x
                    else:
                        out[pre + f.name] = v
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
                    if pre + f.name in d:
                        kw[f.name] = d[pre + f.name]
                        continue
                    sub: Dict[str, Any] = {}
                    for key, v in d.items():
                        if key.startswith(pre + f.name + "."):
                            rest = key[len(pre + f.name) + 1:]
                            if f.name == "rescale":
                                name, part = rest.rsplit(".", 1)
                                sub.setdefault(name, {})[part] = v
                            else:
                                sub[rest] = v
                    if f.name == "rescale":
                        sub = {k: Rescale(v["multiplier"], v["shift"]) for k, v in sub.items()}
                    kw[f.name] = sub
                row.append(LayerParams(**kw))
            layers.append(row)
        return cls(meta=meta, layers=layers)

    def save(self, path: Union[str, Path]) -> None:
        torch.save(self.to_dict(), str(path))

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


def load_params(path: Union[str, Path]) -> QuantParams:
    """Read a file written by QuantParams.save() (no arbitrary unpickling)."""
    return QuantParams.from_dict(torch.load(str(path), weights_only=True))
