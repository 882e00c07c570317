"""The integer forward of a converted QuantGRU as a torch.library custom operator.

``torch.ops.qgru.integer_gru(x, h0, lengths, params, spec) -> (out, h_n)`` runs what
``QuantGRU._forward_integer`` runs eagerly (runtime.integer_forward: quantize, every layer and
direction on the current backend, dequantize), with a fake kernel that gives the output shapes.
torch.compile and torch.export see one opaque operator instead of qgru's Python and native kernels,
which they could not trace; the results are the eager ones, bit for bit (the same function runs).

Arguments: x time-major float [T, N, I], h0 [L*D, N, H], lengths (PackedSequence input) or None;
``params`` and ``spec`` are a converted module's integer parameters as QuantParams.to_dict()
gives them, split into the tensors (``params``, in key order) and a JSON string with the keys and
the other entries (``spec``). A QuantGRU makes them once, when it is converted (``_op_params``).

The operator rebuilds the LayerParams from ``params`` once per set of tensors and device: a small
cache keyed by the tensors' identities and versions, holding them (so no identity is reused while
cached). Eager calls do not go through the operator (its dispatch and argument checks would cost a
1-step streaming call several microseconds); inside torch.compile / torch.export they do.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import torch

from .errors import empty_sequence_error
from .export import QuantParams
from .runtime import integer_forward

_CACHE_SIZE = 8
_cache: "OrderedDict[Tuple, Dict[str, Any]]" = OrderedDict()
_lock = threading.Lock()


def flatten_params(flat: Dict[str, Any]) -> Tuple[List[torch.Tensor], str]:
    """QuantParams.to_dict() -> (its tensors in key order, a JSON string of everything else)."""
    keys = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor))
    meta = json.loads(flat["meta"])
    spec = {"format": 1, "keys": keys, "values": {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)},
            "layers": meta["num_layers"], "dirs": 2 if meta["bidirectional"] else 1, "hidden": meta["hidden_size"]}
    return [flat[k].contiguous() for k in keys], json.dumps(spec, sort_keys=True)


def _spec(spec: str) -> Dict[str, Any]:
    s = json.loads(spec)
    if not isinstance(s, dict) or s.get("format") != 1:
        raise ValueError("qgru::integer_gru: spec is not one made by qgru.ops.flatten_params")
    return s


def _layers(params: List[torch.Tensor], spec: str, device: torch.device):
    """LayerParams [layer][direction] on ``device``, rebuilt once per set of parameter tensors."""
    key = (spec, tuple(id(t) for t in params))
    versions = tuple(t._version for t in params)
    with _lock:
        entry = _cache.get(key)
        if entry is not None and entry["versions"] != versions:  # written in place since: rebuild
            entry = None
        if entry is None:
            s = _spec(spec)
            if len(params) != len(s["keys"]):
                raise ValueError(f"qgru::integer_gru: {len(params)} parameter tensors, the spec names {len(s['keys'])}")
            d = dict(s["values"])
            d.update({k: t.cpu() for k, t in zip(s["keys"], params)})
            entry = {"params": list(params), "versions": versions, "on": {"cpu": QuantParams.from_dict(d).layers}}
            _cache[key] = entry
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
        _cache.move_to_end(key)
        on = entry["on"]
        dev = str(device)
        if dev not in on:
            on[dev] = [[p.to(device) for p in row] for row in on["cpu"]]
        return on[dev]


@torch.library.custom_op("qgru::integer_gru", mutates_args=())
def integer_gru(x: torch.Tensor, hx: torch.Tensor, lengths: Optional[torch.Tensor], params: List[torch.Tensor],
                spec: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """A converted QuantGRU's integer forward (runtime.integer_forward), as one operator."""
    if x.shape[0] == 0:
        # eager mode refuses it in the module (_check_input); an exported program whose sequence
        # length is dynamic traced that check for lengths >= 2 (torch's size rule) and runs only
        # this operator: it refuses it here, as eager mode does
        raise empty_sequence_error(tuple(x.shape))
    return integer_forward(_layers(params, spec, x.device), x, hx, lengths)


@integer_gru.register_fake
def _integer_gru_fake(x, hx, lengths, params, spec):
    s = _spec(spec)
    T, N = x.shape[0], x.shape[1]
    return (x.new_empty((T, N, s["dirs"] * s["hidden"])),
            x.new_empty((s["layers"] * s["dirs"], N, s["hidden"])))
