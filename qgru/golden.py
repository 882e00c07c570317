"""The golden integer GRU: the one definition of qgru's arithmetic ("reference" backend).

Plain PyTorch integer ops, int64 throughout so nothing can wrap; every rescale goes through
``primitives.rounding_mul_shift`` and every intermediate is saturated to its declared width. The
tensor-by-tensor spec (bits, scale, zero point, rounding, saturation, overflow bounds) is in
docs/spec.md; the names here are the names used there.

Gate layout follows torch.nn.GRU: the 3H channel axis is [r | z | g] (torch calls g "n").
The formula is torch's (and haste's, and seed 001's):
    r = sigmoid(Wx_r + Rh_r)            Wx = W x + b_ih,  Rh = R h + b_hh
    z = sigmoid(Wx_z + Rh_z)
    g = tanh(Wx_g + r * Rh_g)           (the reset gate multiplies R_g h + b_hg, "reset after")
    h' = z * h + (1 - z) * g
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Tuple

import torch

from .primitives import int_matmul, quantize, rounding_mul_shift, saturate
from .tables import lookup


@dataclass
class Rescale:
    """A fixed-point factor: v -> round_half_up(v * multiplier / 2**shift) (per-tensor or per-channel)."""
    multiplier: torch.Tensor  # int64, scalar or [C]
    shift: torch.Tensor       # int64, same shape

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        return rounding_mul_shift(v, self.multiplier, self.shift)


@dataclass
class XLevels:
    """Per-token grids of a layer's float input x ("x levels", docs/spec.md section 4b).

    Level j is x's calibrated grid widened by 2**(exponent[j] / 4): scale S_x * 2**(exponent[j]/4),
    the same zero point (so W_zp_comp is unchanged). Each token (the I values of x at one time
    step and batch row) is quantized on the first level that holds all its values (x/select_levels),
    and W.x is then requantized with that level's bias and rescale. Level ``exponent == 0`` is the
    static grid: its bias and rescale are the layer's b_x and rescale["Wx"], so tokens that fit the
    calibrated range give exactly the integers of a layer without levels. Only the first layer has
    levels (its x comes from float; later layers' x is the previous layer's tanh-bounded state).
    """
    exponent: torch.Tensor  # int64 [J], ascending, holds 0
    scale: torch.Tensor     # float64 [J]: S_x * 2**(exponent / 4)
    lo: torch.Tensor        # float64 [J]: the level's lowest value (q_min - Z_x) * scale; -inf when Z_x = q_min
    hi: torch.Tensor        # float64 [J]: (q_max - Z_x) * scale; +inf when Z_x = q_max
    b_x: torch.Tensor       # int64 [J, 3H]: b_ih at scale S_W[c] * scale[j]
    rescale: Rescale        # multiplier, shift int64 [J, 3H]: S_W[c] * scale[j] / S_Wx[c]


def _map_tensors(v, fn):
    """v with fn applied to every tensor inside it (tensors, Rescale, XLevels, dicts; others as they are)."""
    if isinstance(v, torch.Tensor):
        return fn(v)
    if isinstance(v, Rescale):
        return Rescale(fn(v.multiplier), fn(v.shift))
    if isinstance(v, XLevels):
        return XLevels(**{f.name: _map_tensors(getattr(v, f.name), fn) for f in fields(v)})
    if isinstance(v, dict):
        return {k: _map_tensors(x, fn) for k, x in v.items()}
    return v


@dataclass
class LayerParams:
    """Integer parameters of one layer and direction, frozen at convert(). All tensors int64."""
    input_size: int
    hidden_size: int
    bits: Dict[str, int]            # width of every tensor (config names: x, h, W, R, Wx, ...)
    W: torch.Tensor                 # [3H, I]  q_W, symmetric
    R: torch.Tensor                 # [3H, H]  q_R, symmetric
    b_x: torch.Tensor               # [3H] int32-range bias of W.x, at scale S_W[c] * S_x
    b_h: torch.Tensor               # [3H] bias of R.h, at scale S_R[c] * S_op (op: the R.h operand,
                                    # h_gemm when bits has it, else h: recurrent_operand)
    W_zp_comp: torch.Tensor         # [3H] Z_x * rowsum(q_W), precomputed once
    R_zp_comp: torch.Tensor         # [3H] Z_op * rowsum(q_R)
    zp: Dict[str, torch.Tensor]     # zero points: x, h, h_gemm (scalars), Wx, Rh ([3H]), z_pre, r_pre, g_pre, z, r, g
    rescale: Dict[str, Rescale]     # acc_x->Wx, acc_h->Rh, Wx_r->r_pre, Rh_r->r_pre, ..., zh->h, zg->h,
                                    # h->h_gemm (only with an h_gemm)
    tables: Dict[str, torch.Tensor]  # "r", "z" (sigmoid), "g" (tanh) entries
    one_z: int                      # 1.0 on z's grid, relative to its zero point
    scale: Dict[str, torch.Tensor]  # float64 scales of x, h, W, R (and h_gemm): used only at the float
                                    # boundary and to read the parameters back as floats
    x_levels: Optional[XLevels] = None  # per-token grids of x (first layer, config x.dynamic), else None

    # A native backend caches the layer it prepared from these parameters in __dict__["_native"]
    # (qgru/native/layer.py, gru_direction). That cache is not part of the parameters: copies and
    # pickles leave it out (a native Layer cannot be pickled), and the copy rebuilds its own.
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_native"}

    def to(self, device) -> "LayerParams":
        return LayerParams(**{f.name: _map_tensors(getattr(self, f.name), lambda t: t.to(device))
                              for f in fields(self)})

    def clone(self) -> "LayerParams":
        """A copy that shares no tensor (nor dict) with this one, and no native cache: what a module
        runs must not change when a caller edits, in place, what it was handed (export())."""
        return LayerParams(**{f.name: _map_tensors(getattr(self, f.name), lambda t: t.detach().clone())
                              for f in fields(self)})


def _gate(v: torch.Tensor, gate: int, hidden: int) -> torch.Tensor:
    """Slice gate ``gate`` (0 = r, 1 = z, 2 = g) out of the last (3H) axis."""
    return v[..., gate * hidden:(gate + 1) * hidden]


def select_levels(lv: XLevels, x: torch.Tensor) -> torch.Tensor:
    """The level index (int64 [...]) of every token of float x [..., I]: the first level j with
    lo[j] <= min(token) and max(token) <= hi[j], else the last level (whose grid then clips, as a
    static grid does). Compared in float64, where every float32/16 value is exact. A token holding
    a NaN fits no level (the last): the CPU and reference backends reject NaN input, and the CUDA
    backend's contract for NaN is this function on x.nan_to_num(0.0) (docs/spec.md section 11;
    csrc/qgru_fixedpoint.h token_range_add)."""
    xd = x.double()
    mn, mx = xd.amin(-1, keepdim=True), xd.amax(-1, keepdim=True)  # [..., 1]; NaN propagates
    fits = (mn >= lv.lo) & (mx <= lv.hi)  # [..., J]
    last = lv.exponent.numel() - 1
    idx = torch.arange(last + 1, device=x.device)
    return torch.where(fits, idx, last).amin(-1)


def quantize_levels(lv: XLevels, x: torch.Tensor, zero_point: torch.Tensor, bits: int
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q_x [..., I], level [...]): each token of float x on its own level's grid (same zero point)."""
    level = select_levels(lv, x)
    return quantize(x, lv.scale[level].unsqueeze(-1), zero_point, bits), level


def input_gemm(p: LayerParams, qx: torch.Tensor, level: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Wx for all time steps at once: qx [..., I] -> q_Wx - Z_Wx [..., 3H] (seed 001, step 1-2).

    ``level`` [...] (layers with x levels, from quantize_levels): each token's W.x takes its
    level's bias and rescale instead of b_x and rescale["Wx"]."""
    lead = qx.shape[:-1]
    acc = int_matmul(qx.reshape(-1, p.input_size), p.bits["x"], p.W.t(), p.bits["W"])
    acc = acc - p.W_zp_comp
    if level is None:
        q = p.rescale["Wx"](acc + p.b_x)
    else:
        j = level.reshape(-1)
        lv = p.x_levels
        q = rounding_mul_shift(acc + lv.b_x[j], lv.rescale.multiplier[j], lv.rescale.shift[j])
    q = saturate(q + p.zp["Wx"], p.bits["Wx"])
    return (q - p.zp["Wx"]).reshape(*lead, 3 * p.hidden_size)


Trace = Dict[str, List[torch.Tensor]]  # tensor name -> one entry per time step (qgru.compare)


def _record(trace: Optional[Trace], name: str, v: torch.Tensor) -> None:
    if trace is not None:
        trace.setdefault(name, []).append(v)


def recurrent_operand(p: LayerParams, qh: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """(q, bits) of what the R.h GEMM reads: the state h itself, or, with an h_gemm tensor, h
    requantized onto h_gemm's narrower grid, q = sat(rescale(q_h - Z_h) + Z_op) (docs/spec.md,
    "The recurrent operand"). The state keeps its own bits; only the GEMM operand is narrowed."""
    if "h_gemm" not in p.bits:
        return qh, p.bits["h"]
    return saturate(p.rescale["h_gemm"](qh - p.zp["h"]) + p.zp["h_gemm"], p.bits["h_gemm"]), p.bits["h_gemm"]


def gru_step(p: LayerParams, dWx: torch.Tensor, qh: torch.Tensor,
             trace: Optional[Trace] = None) -> torch.Tensor:
    """One time step: dWx [N, 3H] (= q_Wx - Z_Wx), qh [N, H] -> new q_h [N, H].

    ``trace`` (optional, for qgru.compare): a dict to which the step appends its stored integers
    q_Rh, q_r_pre, q_r, q_z_pre, q_z, q_g_pre, q_g and q_h (the new state, before any padding
    mask), and q_h_gemm (the R.h operand) when the layer has one. Tracing changes no result.
    """
    H = p.hidden_size
    b, zp, rs = p.bits, p.zp, p.rescale
    # Rh = R.h + b_hh, requantized (seed 001, step 3.1); R.h reads the recurrent operand
    q_op, op_bits = recurrent_operand(p, qh)
    if "h_gemm" in b:
        _record(trace, "h_gemm", q_op)
    acc = int_matmul(q_op, op_bits, p.R.t(), b["R"]) - p.R_zp_comp + p.b_h
    qRh = saturate(rs["Rh"](acc) + zp["Rh"], b["Rh"])
    _record(trace, "Rh", qRh)
    dRh = qRh - zp["Rh"]

    def sigmoid_gate(name: str, gate: int) -> torch.Tensor:  # computeR / computeZ
        pre = saturate(rs[f"Wx_{name}"](_gate(dWx, gate, H)) + rs[f"Rh_{name}"](_gate(dRh, gate, H))
                       + zp[f"{name}_pre"], b[f"{name}_pre"])
        q = lookup(pre, p.tables[name], b[f"{name}_pre"], int(zp[name]), b[name])
        _record(trace, f"{name}_pre", pre)
        _record(trace, name, q)
        return q - zp[name]

    d_r = sigmoid_gate("r", 0)
    d_z = sigmoid_gate("z", 1)
    # computeG: g = tanh(Wx_g + r * Rh_g); the product r * Rh_g is rescaled straight into g_pre
    g_pre = saturate(rs["Wx_g"](_gate(dWx, 2, H)) + rs["rRh_g"](d_r * _gate(dRh, 2, H)) + zp["g_pre"],
                     b["g_pre"])
    q_g = lookup(g_pre, p.tables["g"], b["g_pre"], int(zp["g"]), b["g"])
    _record(trace, "g_pre", g_pre)
    _record(trace, "g", q_g)
    d_g = q_g - zp["g"]
    # computeH: h' = z * h + (1 - z) * g, with 1 - z on z's own grid: one_z - d_z
    d_one_minus_z = p.one_z - d_z
    h_new = rs["zh"](d_z * (qh - zp["h"])) + rs["zg"](d_one_minus_z * d_g) + zp["h"]
    h_new = saturate(h_new, b["h"])
    _record(trace, "h", h_new)
    return h_new


def gru_direction(p: LayerParams, qx: torch.Tensor, qh0: torch.Tensor,
                  lengths: Optional[torch.Tensor] = None,
                  trace: Optional[Trace] = None,
                  level: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run one direction over time: qx [T, N, I], qh0 [N, H] -> (q outputs [T, N, H], q h_n [N, H]).

    ``lengths`` [N] (for packed input): steps t >= lengths[n] leave row n's state unchanged.
    A reverse direction is run by the caller on sequences reversed within their lengths.
    ``trace`` (optional, for qgru.compare): a dict that receives, per step, q_Wx and everything
    gru_step records. Tracing changes no result.
    ``level`` [T, N] (a layer with x levels): each token's level, from quantize_levels; None: every
    token on level 0 (qx on the static grid, as a caller that quantizes x itself hands it).
    """
    T = qx.shape[0]
    if level is not None and p.x_levels is None:
        raise ValueError("gru_direction: a level per token was given to a layer without x levels")
    dWx = input_gemm(p, qx, level)
    h = qh0
    outs = []
    for t in range(T):
        _record(trace, "Wx", dWx[t] + p.zp["Wx"])
        h_new = gru_step(p, dWx[t], h, trace)
        if lengths is not None:
            h_new = torch.where((t < lengths).unsqueeze(1), h_new, h)
        h = h_new
        outs.append(h)
    out = torch.stack(outs) if outs else qx.new_zeros((0,) + tuple(qh0.shape))
    return out, h


def requantize_input(q: torch.Tensor, from_zp: torch.Tensor, rescale: Rescale,
                     to_zp: torch.Tensor, to_bits: int) -> torch.Tensor:
    """Move a layer's output (one direction's h grid) onto the next layer's input grid.

    ``q`` may come from any backend in any integer dtype (native backends return int32); it is
    widened first, since a 0-dim int64 zero point would not promote an int32 tensor.
    """
    return saturate(rescale(q.to(torch.int64) - from_zp) + to_zp, to_bits)
