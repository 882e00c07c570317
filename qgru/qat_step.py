"""QAT's forward step (layer 3, runtime): the integer GRU's values with straight-through gradients.

QuantGRU's forward calls ``qat_forward`` in QAT mode (qgru/module.py imports this module; it does not
import qgru.qat, which sits above it with prepare_qat / convert_qat). What the forward computes and
why is qgru/qat.py's docstring (and docs/spec.md section 14); the code is here so that the module
and the QAT workflow need not import each other.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch.nn import functional as F

from . import golden
from .backends import BoundaryOps
from .convert import recurrent_operand
from .golden import LayerParams
from .primitives import qrange
from .runtime import reverse_within_lengths

_BOUNDARY = BoundaryOps()  # the reference quantize / requantize (golden semantics, NaN check)


class _Golden(torch.autograd.Function):
    """Forward: ``exact`` (the golden model's value). Backward: the gradient goes to ``surrogate``
    unchanged (straight-through), times ``mask`` where one is given (clipped STE)."""

    @staticmethod
    def forward(ctx, surrogate, exact, mask):
        ctx.has_mask = mask is not None
        if ctx.has_mask:
            ctx.save_for_backward(mask)
        return exact.to(surrogate.dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.has_mask:
            (mask,) = ctx.saved_tensors
            grad = grad * mask
        return grad, None, None


def _dequant(q: torch.Tensor, S: torch.Tensor, Z: torch.Tensor) -> torch.Tensor:
    """(q - Z) * S in float64: every golden value as the surrogate carries it."""
    return (q - Z).double() * S


def _within(v: torch.Tensor, S: torch.Tensor, Z: torch.Tensor, bits: int) -> torch.Tensor:
    """Where the float value ``v`` lies inside the grid's range (to within half a step beyond its
    ends, where rounding, not saturation, decides): the clipped STE's mask."""
    lo, hi = qrange(bits)
    return ((v >= (lo - Z - 0.5) * S) & (v <= (hi - Z + 0.5) * S)).to(v.dtype)


def _fake(surrogate: torch.Tensor, q: torch.Tensor, S, Z, bits: Optional[int]) -> torch.Tensor:
    """The golden value (q - Z) * S with the surrogate's gradient; ``bits`` None: no clipping mask
    (the grid cannot clip: weights, whose scale covers max|w|, and the sigmoid/tanh outputs)."""
    mask = None if bits is None else _within(surrogate.detach(), S, Z, bits)
    return _Golden.apply(surrogate, _dequant(q, S, Z), mask)


def _direction(p: LayerParams, S: Dict[str, torch.Tensor], weights, x_sur: torch.Tensor, qx: torch.Tensor,
               h0: torch.Tensor, lengths: Optional[torch.Tensor], level: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One direction: golden's integers, and the float64 surrogate that carries them with the
    float GRU's gradients. ``S``: every tensor's scale (convert's, see derive_layer_params'
    scales_out). x_sur [T, N, I]: the layer input before quantization (any float dtype), qx: its
    golden integers; h0 [N, H] float. ``level`` [T, N] (a layer with x levels): each token's x
    level, whose scale is that token's x scale (the clipped STE's mask too: only what the chosen
    level clips passes no gradient). Returns (out [T, N, H] float64, h_n float64, q_out)."""
    H = p.hidden_size
    w_ih, w_hh, b_ih, b_hh = weights
    Z = p.zp
    qh0 = _BOUNDARY.quantize(h0, S["h"], Z["h"], p.bits["h"], "h0")
    trace: Dict[str, List[torch.Tensor]] = {}
    q_out, _ = golden.gru_direction(p, qx, qh0, lengths, trace, level=level)

    S_x = S["x"] if level is None else p.x_levels.scale[level].unsqueeze(-1)  # [T, N, 1]: per token
    x = _fake(x_sur.double(), qx, S_x, Z["x"], p.bits["x"])
    h = _fake(h0.double(), qh0, S["h"], Z["h"], p.bits["h"])
    W = _fake(w_ih.double(), p.W, S["W"].unsqueeze(1), 0, None)
    R = _fake(w_hh.double(), p.R, S["R"].unsqueeze(1), 0, None)

    def step_value(name, t, surrogate, clip=True):
        return _fake(surrogate, trace[name][t], S[name], Z[name], p.bits[name] if clip else None)

    def gemm_operand(t, h):
        """What R.h reads at step t: the state itself, or (h_gemm) the state on the operand's own
        grid: its golden value, with h's gradient masked where that grid clips h."""
        return h if recurrent_operand(p.bits) == "h" else step_value("h_gemm", t, h)

    # the surrogate of a requantized GEMM is the float GEMM of the golden operands: its value is
    # (to rounding) the integer accumulator's real value, which is what saturates or not
    Wx_sur = x @ W.t()
    if b_ih is not None:
        Wx_sur = Wx_sur + b_ih.double()
    Wx = _fake(Wx_sur, torch.stack(trace["Wx"]), S["Wx"], Z["Wx"], p.bits["Wx"])
    outs = []
    for t in range(qx.shape[0]):
        Rh_sur = gemm_operand(t, h) @ R.t()
        if b_hh is not None:
            Rh_sur = Rh_sur + b_hh.double()
        Rh = step_value("Rh", t, Rh_sur)
        r_pre = step_value("r_pre", t, Wx[t, :, :H] + Rh[:, :H])
        r = step_value("r", t, torch.sigmoid(r_pre), clip=False)
        z_pre = step_value("z_pre", t, Wx[t, :, H:2 * H] + Rh[:, H:2 * H])
        z = step_value("z", t, torch.sigmoid(z_pre), clip=False)
        g_pre = step_value("g_pre", t, Wx[t, :, 2 * H:] + r * Rh[:, 2 * H:])
        g = step_value("g", t, torch.tanh(g_pre), clip=False)
        h_new = step_value("h", t, z * h + (1 - z) * g)
        if lengths is not None:  # golden keeps a finished sequence's state: so does the surrogate
            h_new = torch.where((t < lengths).unsqueeze(1), h_new, h)
        h = h_new
        outs.append(h)
    out = torch.stack(outs) if outs else h.new_zeros((0,) + tuple(h.shape))
    return out, h, q_out


def qat_forward(module, x: torch.Tensor, hx: torch.Tensor,
                lengths: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """QuantGRU's forward in QAT mode, between its float boundaries: time-major x [T, N, I], h0
    [L*D, N, H], lengths or None -> (out [T, N, D*H], h_n) in x's dtype, whose values are exactly
    the integer model's (convert() of the current weights) and whose gradients are the STE's.
    ``module``: a QuantGRU in QAT mode, used duck-typed (its _derive_params, _qat ranges, _weights,
    num_layers, num_directions, dropout, training): this module sits below qgru.module, which calls it."""
    scales: Dict[Tuple[int, int], Dict[str, torch.Tensor]] = {}
    params = module._derive_params(module._qat, scales)  # convert()'s own path, current weights
    dev = x.device
    if dev.type != "cpu":
        params = [[p.to(dev) for p in row] for row in params]
        scales = {k: {n: s.to(dev) for n, s in v.items()} for k, v in scales.items()}
    if lengths is not None:
        lengths = lengths.to(dev)
    # nn.GRU drops out each layer's output but the last in training mode; so does QAT (the dropped
    # values are then quantized onto the next layer's grid). Eval mode has no dropout: exact.
    drop = module.dropout if module.training and module.num_layers > 1 else 0.0
    D = module.num_directions
    h_n: List[torch.Tensor] = []
    prev_sur: List[torch.Tensor] = []
    prev_q: List[torch.Tensor] = []
    for layer in range(module.num_layers):
        if layer > 0 and drop > 0:
            dropped = F.dropout(torch.cat(prev_sur, dim=-1), drop, True)
        outs_sur, outs_q = [], []
        for d in range(D):
            p, S = params[layer][d], scales[(layer, d)]
            level = None
            if layer == 0 and p.x_levels is not None:  # x levels (x.dynamic): each token on its own grid
                x_sur = x
                qx, level = _BOUNDARY.quantize_levels(x, p.x_levels, p.zp["x"], p.bits["x"], "input")
            elif layer == 0:
                x_sur = x
                qx = _BOUNDARY.quantize(x, p.scale["x"], p.zp["x"], p.bits["x"], "input")
            elif drop > 0:
                x_sur = dropped
                qx = _BOUNDARY.quantize(dropped, p.scale["x"], p.zp["x"], p.bits["x"], "input")
            else:  # the integer model's layer-to-layer rescale, on the previous layer's integers
                x_sur = torch.cat(prev_sur, dim=-1)
                prev = params[layer - 1]
                qx = torch.cat([_BOUNDARY.requantize(q, prev[e].zp["h"], p.rescale[f"in_{e}"], p.zp["x"],
                                                     p.bits["x"]) for e, q in enumerate(prev_q)], dim=-1)
            if d == 1:  # the reverse direction runs on sequences reversed within their lengths
                x_sur, qx = reverse_within_lengths(x_sur, lengths), reverse_within_lengths(qx, lengths)
                if level is not None:
                    level = reverse_within_lengths(level, lengths)
            o, h, q_out = _direction(p, S, module._weights(layer, d), x_sur, qx, hx[layer * D + d], lengths, level)
            if d == 1:
                o, q_out = reverse_within_lengths(o, lengths), reverse_within_lengths(q_out, lengths)
            outs_sur.append(o)
            outs_q.append(q_out)
            h_n.append(h)
        prev_sur, prev_q = outs_sur, outs_q
    out = prev_sur[0] if D == 1 else torch.cat(prev_sur, dim=-1)
    # the converted model dequantizes to float32 (primitives.dequantize), then casts to x's dtype:
    # the golden float64 values take the same two roundings, so the outputs are equal, not close
    return out.float().to(x.dtype), torch.stack(h_n).float().to(x.dtype)
