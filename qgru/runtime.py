"""The integer forward of a converted QuantGRU, without the module (layer 3: runtime).

``integer_forward(params, x, hx, lengths)`` runs the integer GRU between its float boundaries on the
current backend: quantize, every layer and direction, dequantize. QuantGRU's eager forward calls it
(qgru/module.py), and so does the custom operator that torch.compile / torch.export see
(qgru/ops.py); both reach it without importing each other. qgru.module re-exports these names.
"""
from typing import List, Optional, Tuple

import torch

from . import native
from .backends import current_backend
from .golden import LayerParams


def reverse_within_lengths(x: torch.Tensor, lengths: Optional[torch.Tensor]) -> torch.Tensor:
    """Reverse each sequence of a time-major [T, N, ...] tensor within its own length.

    Padding positions (t >= length) stay where they are. Applying it twice is the identity.
    """
    if lengths is None:
        return x.flip(0)
    T, N = x.shape[0], x.shape[1]
    t = torch.arange(T, device=x.device).unsqueeze(1)
    L = lengths.to(x.device).unsqueeze(0)
    idx = torch.where(t < L, L - 1 - t, t)  # [T, N]: the source step of each row
    # one row gather of [T * N, rest] (an elementwise gather with an expanded index took 5-10x as long)
    flat = (idx * N + torch.arange(N, device=x.device)).reshape(-1)
    return x.reshape(T * N, *x.shape[2:]).index_select(0, flat).reshape(x.shape)


def _packed_index(batch_sizes: torch.Tensor, sorted_indices: Optional[torch.Tensor], N: int,
                  device: torch.device) -> torch.Tensor:
    """Where each row of a PackedSequence's data sits in the flat [T * N] time-major padded batch
    (original batch order): step t's rows are sorted_indices[:batch_sizes[t]] (0.. where None),
    stacked step after step. A few torch calls on ``device``, whatever T."""
    total = int(batch_sizes.sum())  # batch_sizes is on the CPU (PackedSequence's rule): no device sync
    bs = batch_sizes.to(device)
    t = torch.repeat_interleave(torch.arange(batch_sizes.shape[0], device=device), bs, output_size=total)
    start = torch.cumsum(bs, 0) - bs  # each step's first row in the packed data
    b = torch.arange(total, device=device) - start[t]  # the row's place within its step (sorted order)
    col = b if sorted_indices is None else sorted_indices.to(device)[b]
    return t * N + col


def padded_from_packed(seq, sorted_order: bool = False, index_out: Optional[list] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """pad_packed_sequence(seq) (time-major, zeros at the padding; lengths int64 on the CPU, in the
    original batch order; with ``sorted_order`` the rows in the PackedSequence's sorted order
    instead, longest first, lengths likewise) as one index_copy, after checking that the PackedSequence is well formed
    (QGRUInputError otherwise: torch's own unpacking checks little of it, and reads out of bounds
    on some of it). pad_packed_sequence took 5x as long (a copy per run of equal batch sizes, then
    an index_select into the original order). index_out (a list): the index it used is appended
    (packed_rows takes it back for the same PackedSequence and order)."""
    from .errors import QGRUInputError
    data, bs, si, ui = seq.data, seq.batch_sizes, seq.sorted_indices, seq.unsorted_indices
    if not isinstance(bs, torch.Tensor) or bs.dim() != 1 or bs.dtype != torch.int64 or not bs.is_cpu \
            or bs.shape[0] == 0:
        raise QGRUInputError("PackedSequence batch_sizes must be a non-empty 1-D int64 CPU tensor (as "
                             "pack_padded_sequence makes it)")
    N = int(bs[0])
    if N < 1 or bool((bs < 1).any()) or bool((bs[1:] > bs[:-1]).any()):
        raise QGRUInputError("PackedSequence batch_sizes must be positive and non-increasing, got "
                             f"{bs[:8].tolist()}{' ...' if bs.shape[0] > 8 else ''}")
    if int(bs.sum()) != data.shape[0]:
        raise QGRUInputError(f"PackedSequence data has {data.shape[0]} rows but its batch_sizes sum to "
                             f"{int(bs.sum())}")
    order = torch.arange(N, device=bs.device)  # the CPU, like batch_sizes (never the default device)
    for name, v in (("sorted_indices", si), ("unsorted_indices", ui)):
        if (v is None) != (si is None and ui is None) or (v is not None and (
                not isinstance(v, torch.Tensor) or v.dtype != torch.int64 or tuple(v.shape) != (N,))):
            raise QGRUInputError(f"PackedSequence {name} must be None or an int64 tensor of shape ({N},), as "
                                 "pack_padded_sequence makes it")
    if si is not None:
        si_c, ui_c = si.cpu(), ui.cpu()  # (pad_packed_sequence reads unsorted_indices on the CPU too)
        if not torch.equal(si_c.sort().values, order) or not torch.equal(si_c[ui_c], order):
            raise QGRUInputError("PackedSequence sorted_indices must be a permutation of the batch and "
                                 "unsorted_indices its inverse")
    T = bs.shape[0]
    # the steps with more than j rows (sorted order): batch sizes are non-increasing
    lengths = torch.bincount(bs, minlength=N + 1).flip(0).cumsum(0).flip(0)[1:]
    if si is not None and not sorted_order:
        lengths = lengths[ui_c]
    idx = _packed_index(bs, None if sorted_order else si, N, data.device)
    if index_out is not None:
        index_out.append(idx)
    x = data.new_zeros((T * N,) + tuple(data.shape[1:])).index_copy(0, idx, data)
    return x.view((T, N) + tuple(data.shape[1:])), lengths


def packed_rows(out: torch.Tensor, batch_sizes: torch.Tensor, sorted_indices: Optional[torch.Tensor],
                index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A PackedSequence's data from a time-major [T, N, F] tensor in the original batch order (what
    padded_from_packed gives), in one index_select (a per-step loop of Python indexing took 10x a
    padded call's time at T = 20000, N = 2). index: padded_from_packed's for the same sequence and
    order (index_out), when the caller kept it."""
    T, N = out.shape[0], out.shape[1]
    idx = _packed_index(batch_sizes, sorted_indices, N, out.device) if index is None else index
    return out.reshape(T * N, out.shape[-1]).index_select(0, idx)


def run_stack(num_layers: int, num_directions: int, x, hx, lengths, direction_fn):
    """Layers and directions; direction_fn(layer, d, layer_inputs, h0) -> (out [T,N,H], h_n)."""
    h_n = []
    layer_out = None
    for layer in range(num_layers):
        outs = []
        for d in range(num_directions):
            h0 = hx[layer * num_directions + d]
            inp = x if layer == 0 else layer_out
            if d == 1:
                inp = [reverse_within_lengths(v, lengths) for v in inp] if isinstance(inp, list) \
                    else reverse_within_lengths(inp, lengths)
            o, h = direction_fn(layer, d, inp, h0)
            if d == 1:
                o = reverse_within_lengths(o, lengths)
            outs.append(o)
            h_n.append(h)
        layer_out = outs
    return layer_out, h_n


def _compiled_integer_gru(x, hx, lengths, params: List[torch.Tensor], spec: str):
    """Inside torch.compile / torch.export: the integer GRU as one custom operator (qgru/ops.py, with
    a fake kernel for shapes), whose arguments are plain tensors and a string. None otherwise (the
    caller runs integer_forward itself). A function of its own, without the module: torch.compile
    does not trace into GRU modules (nn.RNNBase) unless torch._dynamo.config.allow_rnn is set, and
    runs them as Python, but it does compile the frames they call, like this one."""
    if not torch.compiler.is_compiling():
        return None
    # outputs detached (a converted model gives no gradients), not the call under torch.no_grad():
    # torch.export records no_grad as a wrap_with_set_grad_enabled region, which leaves grad mode
    # off for the caller when the operator raises inside it (torch 2.13: no finally)
    out, h_n = torch.ops.qgru.integer_gru(x.detach(), hx.detach(), lengths, params, spec)
    return out.detach(), h_n.detach()


def _integer_forward(params: List[List[LayerParams]], x: torch.Tensor, hx: torch.Tensor,
                     lengths: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """integer_forward without torch.compiler.disable's wrapper, whose frame hooks cost a streaming
    call (one step, batch of one) more than a tenth of its time: QuantGRU's eager forward calls
    this, having checked that no compiler is tracing."""
    backend = current_backend(x.device.type)
    if backend.name == "cpu" and lengths is None and len(params[0]) == 1:
        # the whole stack in one native call: the same integers, without a Python round trip
        # per quantize, layer and dequantize (they cost more than a streaming step's layer)
        fast = native.cpu_stack_forward(params, x, hx)
        if fast is not None:
            out, h_n = fast  # float32
            return (out, h_n) if x.dtype == torch.float32 else (out.to(x.dtype), h_n.to(x.dtype))
    if backend.name == "cuda" and lengths is None and len(params[0]) == 1:
        # the same on the GPU: one native call, nothing in it waiting for the GPU on the host
        fast = native.cuda_stack_forward(params, x, hx)
        if fast is not None:
            out, h_n = fast  # float32
            return (out, h_n) if x.dtype == torch.float32 else (out.to(x.dtype), h_n.to(x.dtype))
    ops = backend.boundary  # quantize / dequantize / requantize, golden semantics
    if lengths is not None:
        lengths = lengths.to(x.device)

    def run(layer, d, inp, h0):
        qx, qh0, level = integer_inputs(ops, params, layer, d, inp, h0)
        if level is None:
            return backend.gru_direction(params[layer][d], qx, qh0, lengths)
        return backend.gru_direction(params[layer][d], qx, qh0, lengths, level=level)

    with torch.no_grad():
        q_outs, q_hn = run_stack(len(params), len(params[0]), x, hx, lengths, run)

    def to_float(q, p):
        return ops.dequantize(q, p.scale["h"], p.zp["h"]).to(x.dtype)

    flat = [p for row in params for p in row]  # h_n order: layer-major, then direction
    outs = [to_float(q, p) for q, p in zip(q_outs, params[-1])]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    h_n = torch.stack([to_float(q, p) for q, p in zip(q_hn, flat)])
    return out, h_n


def integer_inputs(ops, params, layer: int, d: int, inp, h0):
    """(q_x, q_h0, level) of one layer and direction: the float input quantized (layer 0; on each
    token's x level when the layer has levels, else level is None) or the previous layer's integer
    outputs (one tensor per direction) moved onto this direction's x grid."""
    p = params[layer][d]
    level = None
    if layer == 0 and p.x_levels is not None:
        qx, level = ops.quantize_levels(inp, p.x_levels, p.zp["x"], p.bits["x"], "input")
    elif layer == 0:
        qx = ops.quantize(inp, p.scale["x"], p.zp["x"], p.bits["x"], "input")
    else:
        prev = params[layer - 1]
        qx = torch.cat([ops.requantize(q, prev[e].zp["h"], p.rescale[f"in_{e}"], p.zp["x"], p.bits["x"])
                        for e, q in enumerate(inp)], dim=-1)
    return qx, ops.quantize(h0, p.scale["h"], p.zp["h"], p.bits["h"], "h0"), level


@torch.compiler.disable  # eager code (also when a torch.compile'd model calls it): nothing to trace
def integer_forward(params: List[List[LayerParams]], x: torch.Tensor, hx: torch.Tensor,
                    lengths: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The integer GRU of a converted QuantGRU between its float boundaries, on the current backend:
    time-major float x [T, N, I], h0 [L*D, N, H], lengths or None -> (out [T, N, D*H], h_n) in
    x's dtype. ``params``: its LayerParams on x's device, [layer][direction]."""
    return _integer_forward(params, x, hx, lengths)
