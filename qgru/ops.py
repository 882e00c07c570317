"""The integer forward of a converted QuantGRU as one operator, ``qgru::integer_gru``.

``torch.ops.qgru.integer_gru(x, h0, lengths, params, spec) -> (out, h_n)`` runs what
``QuantGRU._forward_integer`` runs eagerly (runtime.integer_forward: quantize, every layer and
direction, dequantize). torch.compile and torch.export see one opaque operator instead of qgru's
Python and native kernels; the results are the eager ones, bit for bit.

The operator is defined and implemented for CPU tensors in C++ (csrc/cpu/op_cpu.cpp, in the cpu
backend's library without Python, qgru.native.library_path()): a saved torch.export program or an
AOTInductor package runs in a process that only loaded that library (torch.ops.load_library, or
dlopen from C++), without qgru's Python; the eager module runs its bidirectional calls and those
with lengths through the same C++ (native.cpu_op_model). Its CUDA kernel is C++ too
(csrc/op_cuda.cpp, in the cuda backend's library without Python, native.cuda_library_path(),
loaded with the cuda backend). This module adds what must be Python: the fake kernel (shapes, for
tracing), the sequence-length-0 error as eager mode raises it (QGRUInputError) and, where a
backend cannot be built, its kernel in Python (runtime.integer_forward: the same integers, slower).

Arguments: x time-major float [T, N, I], h0 [L*D, N, H], lengths (PackedSequence input) or None;
``params`` and ``spec``, made once when a QuantGRU is converted (``flatten_params``). ``spec`` is
text (format 2), whitespace-separated words that the C++ reads without a JSON parser::

    qgru.integer_gru 2
    layers L D H I NT                       (NT: how many params the C++ reads: the first NT)
    then per layer l and direction d:
    unit l d grid S_x Z_x bits_x S_h Z_h bits_h      (scales as float.hex(): exact)
    in E [n m_1..m_n s_1..s_n]*E            (layer > 0: each source direction's requantization)
    levels J scale_1..J lo_1..J hi_1..J     (layer 0's x levels, J = 0 without)
    paths W P                               (cpu.py _avx2_takes_whole, one_limb_pair(act16=False))
    variants V [variant A nt (key index)*nt nv (key value)*nv]*V
    cuda U [variant 3 nt (key index)*nt nv (key value)*nv]*U    (U = L*D: the CUDA Layers')
    python {json}                            (ignored by the C++)

A variant is prepare_layer's output (the native Layer's tensors and values) for CPU paths with
int16 activations (A = 1) or without (A = 0), or for any (A = 2, V = 1: where both are the same);
the kernel picks the one of the path it runs on (QGRU_CPU_ISA as qgru/native/cpu.py resolves it).
The cuda section holds each unit's CUDA Layer arguments (prepare_layer with CUDA_GEMM_MIN), which
the CUDA kernel (csrc/op_cuda.cpp) reads; a reader of the units alone (an older library) stops
before it. Every variant shares a unit's tensors that are equal.
After the NT prepared tensors come the QuantParams.to_dict() tensors (named in the JSON), which
the Python kernel (other devices, or no cpu backend) rebuilds LayerParams from.
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

SPEC_FORMAT = 2
SCHEMA = "integer_gru(Tensor x, Tensor hx, Tensor? lengths, Tensor[] params, str spec) -> (Tensor, Tensor)"
_CACHE_SIZE = 8
_cache: "OrderedDict[Tuple, Dict[str, Any]]" = OrderedDict()
_lock = threading.RLock()
_state: Dict[str, Any] = {"ready": False, "where": None, "libs": []}


def _hex(v) -> str:
    return float(v).hex()


def _variant_words(flag: int, t: Dict[str, torch.Tensor], v: Dict[str, int], index: List[int],
                   tensors: List[torch.Tensor], mine: Dict[str, List[Tuple[torch.Tensor, int]]]) -> List[str]:
    """One variant's words ("variant A nt (key index)*nt nv (key value)*nv"), its tensors appended to
    ``tensors`` unless an equal one of the same unit (``mine``) is there already."""
    w = ["variant", str(flag), str(len(t))]
    for k in sorted(t):
        x = t[k].contiguous()
        same = [i for old, i in mine.get(k, []) if old.dtype == x.dtype and old.shape == x.shape and torch.equal(old, x)]
        if same:
            i = same[0]
        else:
            i = index[0]
            index[0] += 1
            tensors.append(x)
            mine.setdefault(k, []).append((x, i))
        w += [k, str(i)]
    return w + [str(len(v))] + [f"{k} {int(v[k])}" for k in sorted(v)]


def _unit_words(p, layer: int, d: int, prev_dirs: int, index: List[int], tensors: List[torch.Tensor],
                mine: Dict[str, List[Tuple[torch.Tensor, int]]]) -> List[str]:
    """One layer and direction's words of the spec (its prepared tensors appended to ``tensors``;
    ``mine``: the unit's tensors so far, which its variants share where equal)."""
    from .native.cpu import _avx2_takes_whole
    from .native.prepare import one_limb_pair, prepare_layer
    w = ["unit", str(layer), str(d), "grid", _hex(p.scale["x"]), str(int(p.zp["x"])), str(int(p.bits["x"])),
         _hex(p.scale["h"]), str(int(p.zp["h"])), str(int(p.bits["h"])), "in", str(prev_dirs)]
    for e in range(prev_dirs):
        r = p.rescale[f"in_{e}"]
        m, s = r.multiplier.reshape(-1).tolist(), r.shift.reshape(-1).tolist()
        w += [str(len(m))] + [str(int(v)) for v in m] + [str(int(v)) for v in s]
    lv = p.x_levels
    if lv is None:
        w += ["levels", "0"]
    else:
        w += ["levels", str(int(lv.exponent.numel()))] + [_hex(v) for t in (lv.scale, lv.lo, lv.hi)
                                                          for v in t.reshape(-1).tolist()]
    w += ["paths", str(int(_avx2_takes_whole(p))), str(int(one_limb_pair(p, act16=False)))]
    q = p.to("cpu")
    plain, wide = prepare_layer(q, act16=False), prepare_layer(q, act16=True)
    same = wide[1]["x_direct16"] == 0 and wide[1]["h_direct16"] == 0  # act16 changes nothing else
    variants = [(2, plain)] if same else [(0, plain), (1, wide)]
    w += ["variants", str(len(variants))]
    for flag, (t, v) in variants:
        w += _variant_words(flag, t, v, index, tensors, mine)
    return w


def _cuda_words(p, index: List[int], tensors: List[torch.Tensor], mine: Dict[str, List[Tuple[torch.Tensor, int]]]) -> List[str]:
    """A unit's CUDA variant (A = 3): the CUDA Layer's arguments (native/cuda.py cuda_layer's)."""
    from .native.prepare import CUDA_GEMM_MIN, prepare_layer
    t, v = prepare_layer(p.to("cpu"), gemm_min=CUDA_GEMM_MIN)
    return _variant_words(3, t, v, index, tensors, mine)


def flatten_params(flat: Dict[str, Any]) -> Tuple[List[torch.Tensor], str]:
    """QuantParams.to_dict() -> the operator's (params, spec): see the module docstring."""
    ensure_operator()
    layers = QuantParams.from_dict(dict(flat)).layers
    L, D = len(layers), len(layers[0])
    p0 = layers[0][0]
    tensors: List[torch.Tensor] = []
    index = [0]
    words: List[str] = []
    mine: List[Dict[str, List[Tuple[torch.Tensor, int]]]] = []
    for layer, row in enumerate(layers):
        for d, p in enumerate(row):
            mine.append({})
            words += _unit_words(p, layer, d, 0 if layer == 0 else D, index, tensors, mine[-1])
    # the CUDA Layers' arguments, after the units (a reader of the units alone stops before them)
    words += ["cuda", str(L * D)]
    for k, p in enumerate(q for row in layers for q in row):
        words += _cuda_words(p, index, tensors, mine[k])
    keys = sorted(k for k, v in flat.items() if isinstance(v, torch.Tensor))
    py = {"keys": keys, "values": {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}}
    head = ["qgru.integer_gru", str(SPEC_FORMAT), "layers", str(L), str(D), str(p0.hidden_size), str(p0.input_size),
            str(len(tensors))]
    spec = " ".join(head) + "\n" + " ".join(words) + "\npython " + json.dumps(py, sort_keys=True)
    return tensors + [flat[k].contiguous() for k in keys], spec


def _spec(spec: str) -> Dict[str, Any]:
    """The spec's header and its JSON (the Python kernel's part)."""
    words = spec.split(None, 8)
    if len(words) < 8 or words[0] != "qgru.integer_gru" or words[1] != str(SPEC_FORMAT) or "\npython " not in spec:
        raise ValueError("qgru::integer_gru: spec is not one made by qgru.ops.flatten_params (format "
                         f"{SPEC_FORMAT})")
    s = json.loads(spec.rsplit("\npython ", 1)[1])
    s.update(layers=int(words[3]), dirs=int(words[4]), hidden=int(words[5]), prepared=int(words[7]))
    return s


def _layers(params: List[torch.Tensor], spec: str, device: torch.device):
    """LayerParams [layer][direction] on ``device`` from params' QuantParams tensors, rebuilt once
    per set of parameter tensors (a small cache keyed by their identities and versions, holding them
    so that no identity is reused while cached)."""
    key = (spec, tuple(id(t) for t in params))
    versions = tuple(t._version for t in params)
    with _lock:
        entry = _cache.get(key)
        if entry is not None and entry["versions"] != versions:  # written in place since: rebuild
            entry = None
        if entry is None:
            s = _spec(spec)
            raw = params[s["prepared"]:]
            if len(raw) != len(s["keys"]):
                raise ValueError(f"qgru::integer_gru: {len(raw)} parameter tensors, the spec names {len(s['keys'])}")
            d = dict(s["values"])
            d.update({k: t.cpu() for k, t in zip(s["keys"], raw)})
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


def _python_kernel(x, hx, lengths, params, spec):
    """The operator in Python (CUDA tensors; every device where the cpu backend cannot be built)."""
    if x.shape[0] == 0:
        raise empty_sequence_error(tuple(x.shape))
    return integer_forward(_layers(params, spec, x.device), x, hx, lengths)


def _fake(x, hx, lengths, params, spec):
    words = spec.split(None, 7)
    if len(words) < 7 or words[0] != "qgru.integer_gru" or words[1] != str(SPEC_FORMAT):
        raise ValueError(f"qgru::integer_gru: spec is not one made by qgru.ops.flatten_params (format {SPEC_FORMAT})")
    L, D, H = int(words[3]), int(words[4]), int(words[5])
    T, N = x.shape[0], x.shape[1]
    return x.new_empty((T, N, D * H)), x.new_empty((L * D, N, H))


def _checked(x, hx, lengths, params, spec):
    """The Autograd kernel qgru's Python adds for CPU and CUDA tensors: a real (not fake) input of
    sequence length 0 raises QGRUInputError as eager mode does (the C++ raises a ValueError of the
    same text); the rest is the C++ Autograd kernel's (no gradient), then the device's kernel."""
    if type(x) is torch.Tensor and x.shape[0] == 0:
        # eager mode refuses it in the module (_check_input); an exported program whose sequence
        # length is dynamic traced that check for lengths >= 2 (torch's size rule) and runs only
        # this operator: it refuses it here, as eager mode does
        raise empty_sequence_error(tuple(x.shape))
    if torch.is_grad_enabled() and (x.requires_grad or hx.requires_grad):
        raise RuntimeError("qgru::integer_gru has no gradient: a converted QuantGRU runs integer inference only "
                           "(train the float model, or use qgru's QAT, and convert again)")
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.qgru.integer_gru.default(x, hx, lengths, params, spec)


def _has_schema() -> bool:
    try:
        torch._C._get_schema("qgru::integer_gru", "")
        return True
    except RuntimeError:
        return False


def _has_cuda_kernel() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("qgru::integer_gru", "CUDA")


def ensure_operator() -> str:
    """Register qgru::integer_gru in this process, once: the cpu backend's C++ operator (building
    the backend if needed) with this module's Python parts, else the whole operator in Python.
    Returns where its CPU kernel is: "c++" or "python"."""
    with _lock:
        if _state["ready"]:
            return _state["where"]
        from . import native
        where = "c++"
        if not _has_schema():
            try:
                native.load("cpu")  # loads the library that defines it (qgru/native/build.py)
            except RuntimeError:
                pass
        if not _has_schema():
            where = "python"
            lib = torch.library.Library("qgru", "FRAGMENT")
            lib.define(SCHEMA)
            lib.impl("integer_gru", _python_kernel, "CPU")
            _state["libs"].append(lib)
        lib = torch.library.Library("qgru", "IMPL")
        if torch.cuda.is_available() and not _has_cuda_kernel():
            try:
                native.load("cuda")  # its library holds the C++ CUDA kernel (csrc/op_cuda.cpp)
            except RuntimeError:
                pass
        if not _has_cuda_kernel():  # no cuda backend here: the operator's CUDA kernel in Python
            lib.impl("integer_gru", _python_kernel, "CUDA")
        # (over the C++ library's own Autograd kernel, whose error for a sequence of length 0 is a
        # ValueError: this one raises eager mode's QGRUInputError; it costs a call ~10 us of boxing
        # its ~100 tensors, and nothing in inference mode, which skips Autograd kernels)
        for key in ("AutogradCPU", "AutogradCUDA"):
            lib.impl("integer_gru", _checked, key)
        _state["libs"].append(lib)
        torch.library.register_fake("qgru::integer_gru", _fake, lib=lib)
        _state.update(ready=True, where=where)
        return where
