"""convert(): float weights + calibrated observer ranges + config -> integer LayerParams.

Every scale, zero point, multiplier/shift, bias and table of the golden model is derived here,
once. The bound passed to ``quantize_multiplier`` for each rescale is the largest magnitude its
operand can take (docs/spec.md, "Accumulators and bounds"); it sets how many multiplier bits fit.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from .config import QuantConfig, TensorSpec
from .golden import LayerParams, Rescale
from .observers import WeightObserver
from .primitives import (choose_qparams, quantize, quantize_multipliers, round_half_up,
                         saturate)
from .tables import build_table, output_grid

BIAS_BITS = 32


def weight_qparams(w: torch.Tensor, spec: TensorSpec, power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row (scale [rows] float64, q_W int64) of a weight matrix, symmetric.

    per_channel: one scale per row; per_group: rows in consecutive groups of ``group_size`` share
    one; per_tensor: one for all (the scale vector is still expanded to one entry per row).
    """
    observer = WeightObserver("weight", spec.granularity, spec.group_size)
    observer.observe(w)
    scale, _ = choose_qparams(*observer.range(), spec.bits, True, power_of_two)
    q = quantize(w.detach().double(), scale.unsqueeze(1), torch.zeros(1, dtype=torch.int64), spec.bits)
    return scale, q


def activation_qparams(lo: torch.Tensor, hi: torch.Tensor, spec: TensorSpec, hidden: int,
                       power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) of an activation from its observed range.

    Scalars for per_tensor; for Wx/Rh with per_gate or per_channel, vectors of 3H entries (per_gate
    first reduces the per-channel ranges over each gate's H channels).
    The observed range is first widened by the tensor's ``headroom`` factor.
    """
    lo, hi = lo * spec.headroom, hi * spec.headroom
    if spec.granularity == "per_gate":
        lo = lo.reshape(3, hidden).amin(1).repeat_interleave(hidden)
        hi = hi.reshape(3, hidden).amax(1).repeat_interleave(hidden)
    return choose_qparams(lo, hi, spec.bits, spec.symmetric, power_of_two)


def _bits_of(bound: int) -> int:
    """Smallest b with |v| < 2**b for every |v| <= bound."""
    return int(bound).bit_length()


def operand_bounds(bits: Dict[str, int], input_size: int, hidden_size: int) -> Dict[str, int]:
    """The largest |operand| of every rescale of a layer (docs/spec.md section 6), which sets its
    multiplier width (``primitives.multiplier_bits(_bits_of(bound))``). "in" is the rescale of the
    previous layer's outputs onto this layer's x grid (``in_0``, ``in_1``)."""
    def span(n):  # largest |q - Z| of a tensor stored in bits[n] bits
        return (1 << bits[n]) - 1

    bias_max = 1 << (BIAS_BITS - 1)
    return {
        "Wx": input_size * (1 << (bits["W"] - 1)) * span("x") + bias_max,
        "Rh": hidden_size * (1 << (bits["R"] - 1)) * span("h") + bias_max,
        "Wx_r": span("Wx"), "Rh_r": span("Rh"), "Wx_z": span("Wx"), "Rh_z": span("Rh"), "Wx_g": span("Wx"),
        "rRh_g": span("r") * span("Rh"),
        "zh": span("z") * span("h"),
        "zg": (1 << bits["z"]) * (1 << (bits["g"] - 1)),
        "in": span("h"),
    }


def _rescale(real: torch.Tensor, operand_bound: int, power_of_two: bool) -> Rescale:
    real = torch.as_tensor(real, dtype=torch.float64)
    m, s = quantize_multipliers(real, _bits_of(operand_bound), power_of_two)
    return Rescale(m, s)


def derive_layer_params(w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: Optional[torch.Tensor],
                        b_hh: Optional[torch.Tensor], ranges: Dict[str, Tuple[torch.Tensor, torch.Tensor]],
                        config: QuantConfig,
                        prev_h: Sequence[Tuple[torch.Tensor, torch.Tensor]] = (),
                        scales_out: Optional[Dict[str, torch.Tensor]] = None) -> LayerParams:
    """Integer parameters of one layer and direction.

    ``ranges`` maps x, h, Wx, Rh, r_pre, z_pre, g_pre to observed (min, max) (per channel for
    Wx/Rh when their granularity is not per_tensor). ``prev_h`` lists (scale, zero point) of the
    previous layer's h grid per direction, for the rescale of its outputs onto this layer's x grid.
    ``scales_out``, if given, receives the float64 scale of every tensor (LayerParams keeps only
    the boundary ones): quantization-aware training (qgru/qat.py) carries its float values on
    exactly the grids chosen here.
    """
    pow2 = config.power_of_two
    H3, I = w_ih.shape
    H = H3 // 3
    bits = {n: s.bits for n, s in config.tensors.items()}
    S, Z = {}, {}
    for n in ("x", "h", "Wx", "Rh", "r_pre", "z_pre", "g_pre"):
        S[n], Z[n] = activation_qparams(*ranges[n], config[n], H, pow2)
    S["W"], W = weight_qparams(w_ih, config["W"], pow2)
    S["R"], R = weight_qparams(w_hh, config["R"], pow2)

    def bias(b, w_scale, act_scale):
        if b is None:
            return torch.zeros(H3, dtype=torch.int64)
        return saturate(round_half_up(b.detach().double() / (w_scale * act_scale)), BIAS_BITS)

    b_x = bias(b_ih, S["W"], S["x"])
    b_h = bias(b_hh, S["R"], S["h"])

    grids = {"r": output_grid("sigmoid", bits["r"], pow2), "z": output_grid("sigmoid", bits["z"], pow2),
             "g": output_grid("tanh", bits["g"], pow2)}
    for n, grid in grids.items():
        S[n], Z[n] = torch.tensor(grid.scale, dtype=torch.float64), torch.tensor(grid.zero_point)

    bound = operand_bounds(bits, I, H)
    one_z = grids["z"].one

    def gate(v, i):
        return v if v.dim() == 0 else v[i * H:(i + 1) * H]

    rescale = {
        "Wx": _rescale(S["W"] * S["x"] / S["Wx"], bound["Wx"], pow2),
        "Rh": _rescale(S["R"] * S["h"] / S["Rh"], bound["Rh"], pow2),
        "Wx_r": _rescale(gate(S["Wx"], 0) / S["r_pre"], bound["Wx_r"], pow2),
        "Rh_r": _rescale(gate(S["Rh"], 0) / S["r_pre"], bound["Rh_r"], pow2),
        "Wx_z": _rescale(gate(S["Wx"], 1) / S["z_pre"], bound["Wx_z"], pow2),
        "Rh_z": _rescale(gate(S["Rh"], 1) / S["z_pre"], bound["Rh_z"], pow2),
        "Wx_g": _rescale(gate(S["Wx"], 2) / S["g_pre"], bound["Wx_g"], pow2),
        "rRh_g": _rescale(S["r"] * gate(S["Rh"], 2) / S["g_pre"], bound["rRh_g"], pow2),
        "zh": _rescale(S["z"], bound["zh"], pow2),
        "zg": _rescale(S["z"] * S["g"] / S["h"], bound["zg"], pow2),
    }
    for d, (s_prev, _) in enumerate(prev_h):
        rescale[f"in_{d}"] = _rescale(s_prev / S["x"], bound["in"], pow2)

    tables = {n: build_table("sigmoid" if n != "g" else "tanh", bits[f"{n}_pre"], float(S[f"{n}_pre"]),
                             int(Z[f"{n}_pre"]), float(S[n])) for n in ("r", "z", "g")}
    if scales_out is not None:
        scales_out.update(S)
    zp = {n: Z[n].to(torch.int64) for n in ("x", "h", "Wx", "Rh", "r_pre", "z_pre", "g_pre", "r", "z", "g")}
    return LayerParams(
        input_size=I, hidden_size=H, bits=bits, W=W, R=R, b_x=b_x, b_h=b_h,
        W_zp_comp=Z["x"] * W.sum(1), R_zp_comp=Z["h"] * R.sum(1), zp=zp, rescale=rescale,
        tables=tables, one_z=one_z,
        scale={"x": S["x"], "h": S["h"], "W": S["W"], "R": S["R"]})
