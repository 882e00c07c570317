"""A unidirectional stack in one native call (CPU and CUDA): its plan (the native Stack), the plan's
cache beside the first layer's Layers, and the forward."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from ..golden import LayerParams
from .build import _native_cache, load
from .cpu import cpu_isa_request, resolve_cpu_isa
from .layer import NativeLayer, resolved


def _cpu_layer(p: LayerParams, isa_request: str) -> "NativeLayer":
    """The CPU NativeLayer of p for this path request (the one gru_direction makes and caches)."""
    cache = _native_cache(p)
    key = ("cpu", "cpu", isa_request)
    if key not in cache:
        cache[key] = NativeLayer("cpu", p, torch.device("cpu"), isa_request)
    return cache[key]


def cpu_stack_plan(params: List[List[LayerParams]], req: str):
    """The native Stack (the layers' native Layers and per-layer grid values) of a unidirectional
    stack on CPU path request ``req``, made once and cached beside the first layer's Layers; None
    where the one-call form does not apply (a bidirectional stack, or a per-channel requantization
    between layers). Made outside inference mode (the Layers keep tensors). A kept plan is read
    first, before anything is made for a miss (a streaming call pays this lookup every step)."""
    key = ("cpu-stack", req, len(params))
    plan = _kept_plan(params, key)
    if plan is not _NOT_KEPT:
        return plan
    return _stack_plan(params, key, lambda rows: load("cpu").Stack([_cpu_layer(p, req).layer for (p,) in params], rows,
                                                                   stack_levels(params)))


_NOT_KEPT = object()


def _kept_plan(params: List[List[LayerParams]], key: Tuple):
    """The plan _stack_plan keeps for ``key`` beside params' first layer, if it is this stack's
    (None is a kept answer too: the one-call form does not apply); else _NOT_KEPT."""
    cache = params[0][0].__dict__.get("_native") if len(params[0]) == 1 else None
    entry = None if cache is None else cache.get(key)
    if entry is not None and (len(params) == 1 or all(a is row[0] for a, row in zip(entry[0], params[1:]))):
        return entry[1]
    return _NOT_KEPT


def _stack_plan(params: List[List[LayerParams]], key: Tuple, make: Callable[[List[List[float]]], object]):
    """cpu_stack_plan's and cuda_stack_plan's cache: ``make(rows)`` builds the backend's Stack from
    stack_values' rows.

    One plan per key (path request or device, and depth: one LayerParams may head stacks of other
    depths, as qgru.compare runs a model's first layers alone), kept beside the first layer's
    Layers with the LayerParams of the layers below it, and used only while the stack holds those
    same objects: LayerParams are shared between models (QuantParams.to_module), and a key of their
    ids could match a later object at a freed one's address. A stack that heads with the same first
    layer but differs below it makes its own plan and replaces the kept one."""
    if len(params[0]) != 1:
        return None
    plan = _kept_plan(params, key)
    if plan is not _NOT_KEPT:
        return plan
    cache = _native_cache(params[0][0])
    if any(len(row) != 1 for row in params):
        return None
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            return _stack_plan(params, key, make)
    rows = stack_values(params)
    plan = None if rows is None else make(rows)
    cache[key] = (tuple(row[0] for row in params[1:]), plan)  # None: a per-channel requantization between layers
    return plan


def stack_levels(params: List[List[LayerParams]]) -> List[List[float]]:
    """The native Stack's x levels: the first layer's [scale, lo, hi] (golden.XLevels, float64 values,
    infinities included), or [] for a first layer without levels."""
    lv = params[0][0].x_levels
    if lv is None:
        return []
    return [[float(v) for v in t.reshape(-1).tolist()] for t in (lv.scale, lv.lo, lv.hi)]


def stack_values(params: List[List[LayerParams]]) -> Optional[List[List[float]]]:
    """The native Stack's per-layer values of a unidirectional stack: (S_x, Z_x, bits_x, S_h, Z_h,
    bits_h, multiplier, shift of layer l - 1's h grid onto layer l's x grid; 1, 1 for layer 0), or
    None where a layer's requantization is per channel (the Stack takes one factor per layer)."""
    rows = []
    for layer, (p,) in enumerate(params):
        m, s = (1, 1)
        if layer > 0:
            r = p.rescale["in_0"]
            if r.multiplier.numel() != 1:
                return None
            m, s = int(r.multiplier), int(r.shift)
        rows.append([float(p.scale["x"]), float(int(p.zp["x"])), float(p.bits["x"]), float(p.scale["h"]),
                     float(int(p.zp["h"])), float(p.bits["h"]), float(m), float(s)])
    return rows


def cpu_stack_forward(params: List[List[LayerParams]], x: torch.Tensor, hx: torch.Tensor, resolve: bool = True):
    """A unidirectional stack without padding in one native call (float x [T, N, I] and h0
    [L, N, H] in; float32 output [T, N, H] and h_n [L, N, H] out), or None where it does not
    apply (cpu_stack_plan). The same integers as the layer-by-layer path (tests/test_native.py),
    without its Python round trips, which for one step of a batch of one cost more than the layer
    itself. It runs in the caller's mode: the C++ makes what it keeps across calls (workspaces,
    reused buffers) outside inference mode itself (leaving inference mode here for every call cost
    a streaming call ~5 us of its ~40). ``resolve=False``: the caller has checked that neither x
    nor hx is a negative view (float tensors are never conjugate views)."""
    plan = cpu_stack_plan(params, cpu_isa_request())
    if plan is None:
        return None
    return plan.forward(resolved(x), resolved(hx)) if resolve else plan.forward(x, hx)


def cpu_op_model(params: List[List[LayerParams]], op_params: Tuple[List[torch.Tensor], str]):
    """The cpu backend's Model of a converted QuantGRU (csrc/cpu/op_cpu.cpp: the operator
    qgru::integer_gru's C++, its spec parsed and its Layers and Stack made once from ``op_params``,
    the module's flatten_params) on this CPU path request: the module runs the calls that its native
    Stack does not take (bidirectional, lengths) through it, the operator's code and not a second
    loop in Python. Kept beside the first layer's Layers (so a fork's child drops it, and pickling
    leaves it out) while the module's operator arguments are the same objects."""
    req = cpu_isa_request()
    cache = _native_cache(params[0][0])
    key = ("cpu-model", req)
    entry = cache.get(key)
    if entry is None or entry[0] is not op_params[0]:
        resolve_cpu_isa(req)  # an unknown or unusable QGRU_CPU_ISA: the ValueError a NativeLayer raises
        entry = cache[key] = (op_params[0], load("cpu").Model(op_params[0], op_params[1], req))
    return entry[1]


def _cuda_layer(p: LayerParams, device: torch.device) -> "NativeLayer":
    """The CUDA NativeLayer of p on ``device`` (the one gru_direction makes and caches)."""
    cache = _native_cache(p)
    key = ("cuda", str(device), "")
    if key not in cache:
        cache[key] = NativeLayer("cuda", p, device)
    return cache[key]


def cuda_stack_plan(params: List[List[LayerParams]], device: torch.device):
    """The CUDA backend's Stack (csrc/qgru_cuda.cpp CudaStack: the layers' CUDA Layers and the
    per-layer grid values, as cpu_stack_plan's) of a unidirectional stack on ``device``, made once
    and cached beside the first layer's Layers (kept while the stack holds the same LayerParams
    below it, as cpu_stack_plan's); None where the one-call form does not apply (bidirectional, or
    a per-channel requantization between layers). Making it reads the parameters' values on the
    host (a device-to-host copy when they are on the GPU): the first call of a model on a device
    must therefore run outside a CUDA graph capture, as torch.cuda.graph's warm-up asks anyway."""
    return _stack_plan(params, ("cuda-stack", str(device), len(params)),
                       lambda rows: load("cuda").Stack([_cuda_layer(p, device).layer for (p,) in params], rows,
                                                       stack_levels(params)))


def cuda_stack_forward(params: List[List[LayerParams]], x: torch.Tensor, hx: torch.Tensor, resolve: bool = True):
    """A unidirectional stack without padding in one native call on the GPU (float x [T, N, I] and
    h0 [L, N, H] in, float32 output [T, N, H] and h_n [L, N, H] out), or None where it does not
    apply (cuda_stack_plan). The same integers as the layer-by-layer path; no host work in it waits
    for the GPU (docs/spec.md section 11), so a caller's torch.cuda.graph can capture it.
    ``resolve=False``: the caller has checked that neither x nor hx is a negative view."""
    plan = cuda_stack_plan(params, x.device)
    if plan is None:
        return None
    return plan.forward(resolved(x), resolved(hx)) if resolve else plan.forward(x, hx)
