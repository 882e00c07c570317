"""convert(): float weights + calibrated observer ranges + config -> integer LayerParams.

Every scale, zero point, multiplier/shift, bias and table of the golden model is derived here,
once. The bound passed to ``quantize_multiplier`` for each rescale is the largest magnitude its
operand can take (docs/spec.md, "Accumulators and bounds"); it sets how many multiplier bits fit.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Sequence, Tuple

import torch

from .config import QuantConfig, TensorSpec
from .errors import WeightRoundingMemoryError, is_out_of_memory
from .golden import LayerParams, Rescale, XLevels
from .observers import Histogram, Observer, WeightObserver
from .primitives import (choose_qparams, qrange, quantize, quantize_multipliers, round_half_up,
                         saturate)
from .tables import build_table, output_grid

_CPU = torch.device("cpu")  # integer parameters are derived on the CPU; factories name it (never the default device)

BIAS_BITS = 32


def weight_qparams(w: torch.Tensor, spec: TensorSpec, power_of_two: bool,
                   second_moment: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row (scale [rows] float64, q_W int64) of a weight matrix, symmetric.

    per_channel: one scale per row; per_group: rows in consecutive groups of ``group_size`` share
    one; per_tensor: one for all (the scale vector is still expanded to one entry per row).
    The scale is always max |w| / qmax. The integers: nearest rounding of w / scale, or, given
    ``second_moment`` (E[v v^T] [K, K] of the operand v the matrix multiplies, from calibration),
    ``gptq_round``: the rounding that makes the product's error E|(q s - w) v|^2 small.
    """
    observer = WeightObserver("weight", spec.granularity, spec.group_size)
    observer.observe(w)
    scale, _ = choose_qparams(*observer.range(), spec.bits, True, power_of_two)
    if second_moment is not None:
        return scale, gptq_round(w, scale, second_moment, spec.bits)
    q = quantize(w.detach().double(), scale.unsqueeze(1), torch.zeros(1, dtype=torch.int64, device=w.device), spec.bits)
    return scale, q


GPTQ_DAMP = 0.01  # gptq_round: the second moment's diagonal is raised by this share of its mean


def gptq_round(w: torch.Tensor, scale: torch.Tensor, second_moment: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers q [rows, K] (int64, in [-qmax, qmax]) for w [rows, K] on the per-row grids ``scale``
    chosen to make E|(q s - w) v|^2 small over the operand's calibration data, given its second
    moment M = E[v v^T] (docs/spec.md section 8, "Weight rounding").

    Nearest rounding makes each weight's error alone small; the product's error is e M e^T (e a
    row's error), which nearest rounding leaves to chance. This is OPTQ/GPTQ's column-by-column
    rounding (Frantar et al., 2022): columns are rounded in order of decreasing M_jj, each to the
    nearest grid point, and the error just made is compensated on the columns not yet rounded
    (the least-squares update w_rest -= e_j (M^-1)_{j,rest} / (M^-1)_jj, done with the upper
    Cholesky factor of M^-1). M is damped by GPTQ_DAMP of its mean diagonal, so that it is
    positive definite (an input never seen has M_jj = damping and no coupling: it is rounded to
    nearest). Rows are independent (each has its own scale); the scale itself is not changed.
    Without information (M all zero or not finite) it is nearest rounding.
    """
    qmax = (1 << (bits - 1)) - 1
    W = w.detach().double().clone()
    s = scale.double().reshape(-1, 1)
    M = second_moment.detach().double()  # (not copied: read only, up to the permuted copy below)
    K = W.shape[1]
    mean_diag = float(M.diagonal().mean()) if K else 0.0
    nearest = lambda v: round_half_up(v / s).clamp(-qmax, qmax).double()
    if not (mean_diag > 0 and torch.isfinite(M).all()):
        return nearest(W).to(torch.int64)
    damp = GPTQ_DAMP * mean_diag
    order = torch.argsort(M.diagonal() + damp, descending=True, stable=True)
    W = W[:, order]
    # the K x K buffers one at a time (at most two alive): the damped, permuted M, its Cholesky
    # factor, M^-1, U (an operand wider than config gptq_max_size never gets here from convert())
    try:
        M = M[order.unsqueeze(1), order]
        M.diagonal().add_(damp)
        L = torch.linalg.cholesky(M)
        del M
        M_inv = torch.cholesky_inverse(L)
        del L
        U = torch.linalg.cholesky(M_inv, upper=True)
        del M_inv
    except RuntimeError as e:
        if is_out_of_memory(e):
            raise WeightRoundingMemoryError(
                f"weight_rounding 'gptq': the {K} x {K} float64 factors of a weight's operand moment "
                f"({K * K * 8 / 1e9:.3g} GB each, two at a time) could not be allocated; set the config's "
                f"gptq_max_size below {K} (those weights then round to nearest) or weight_rounding 'nearest' "
                f"({e})") from None
        return nearest(w.detach().double()).to(torch.int64)  # numerically not positive definite: no compensation
    Q = torch.empty_like(W)
    for j in range(K):
        Q[:, j] = nearest(W[:, j:j + 1]).squeeze(1)
        e = (W[:, j] - Q[:, j] * s.squeeze(1)) / U[j, j]
        W[:, j + 1:] -= e.unsqueeze(1) * U[j, j + 1:].unsqueeze(0)
    q = torch.empty_like(Q)
    q[:, order] = Q
    return q.to(torch.int64)


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


# ---------------------------------------------------------------------------------------------
# Grids chosen by error (observer kind "mse"): docs/spec.md section 8, "Grids chosen by error"
# ---------------------------------------------------------------------------------------------
SEARCH_OCTAVES = 8  # scales searched: from the full-range grid's down to 2^-8 of it
MULTIPLIER_STEPS_PER_OCTAVE = 16  # multiplier mode: scales 2^(1/16) (4.4 %) apart
COARSE = 4  # multiplier mode: the first pass tries every 4th scale (2^(1/4) apart)
COARSE_ZERO_POINTS = 65  # zero points per scale in each pass (8 bits: every 4th, then every one near the best)
_CHUNK = 1 << 21  # candidates evaluated at once (memory: ~20 float64 temporaries of this size)


def expected_sq_error(h: Histogram, scale: torch.Tensor, zero_point: torch.Tensor, bits: int) -> torch.Tensor:
    """Expected sum of squared quantization errors of the histogram's values on grids (scale, zero
    point) [G, K] (K candidate grids per histogram row), float64 [G, K].

    Model: a value inside the grid's range [L, U] = [(qmin - zp) s, (qmax - zp) s] rounds with
    the error of a uniform rounding, s^2 / 12; a value v beyond it is clipped, error (v - U)^2 or
    (L - v)^2; exact zeros have none (0 is on every grid). Values are taken as uniform within
    their bin, so a bin cut by an end of the grid is split exactly. The clipped part uses prefix
    sums of the bins' moments, so each candidate costs O(1): sum_{bins past U} (m2 - 2 U m1 + U^2 m0).
    """
    c = h.counts
    G, nb = c.shape
    B = nb // 2
    w = h.width.unsqueeze(1)
    a = (torch.arange(nb, dtype=torch.float64, device=w.device) - B).unsqueeze(0) * w  # lower edges [G, 2B]
    b = a + w
    zero = torch.zeros(G, 1, dtype=torch.float64, device=w.device)
    P0 = torch.cat([zero, c.cumsum(1)], 1)
    P1 = torch.cat([zero, (c * (a + b) / 2).cumsum(1)], 1)
    P2 = torch.cat([zero, (c * (a * a + a * b + b * b) / 3).cumsum(1)], 1)
    qmin, qmax = qrange(bits)
    s, z = scale.double(), zero_point.double()
    L, U = (qmin - z) * s, (qmax - z) * s
    take = lambda t, k: torch.gather(t, 1, k)
    density = c / w

    def beyond(edge, upper: bool):
        """(count, sum of squared distances to edge) of the values beyond edge."""
        k = torch.floor(edge / w) + B
        inside = (k >= 0) & (k < nb)
        kc = k.clamp(0, nb - 1).to(torch.int64)
        d = take(density, kc) * inside
        if upper:  # bins above kc whole, bin kc from edge to its upper end
            j = torch.where(k < 0, torch.zeros_like(kc), torch.where(k >= nb, torch.full_like(kc, nb), kc + 1))
            n0, n1, n2 = (P[:, nb:] - take(P, j) for P in (P0, P1, P2))
            part = (take(b, kc) - edge) * inside
            count = n0 + d * part
            sq = n2 - 2 * edge * n1 + edge * edge * n0 + d * part ** 3 / 3
        else:  # bins below kc whole, bin kc from its lower end to edge
            j = torch.where(k < 0, torch.zeros_like(kc), torch.where(k >= nb, torch.full_like(kc, nb), kc))
            n0, n1, n2 = (take(P, j) for P in (P0, P1, P2))
            part = (edge - take(a, kc)) * inside
            count = n0 + d * part
            sq = edge * edge * n0 - 2 * edge * n1 + n2 + d * part ** 3 / 3
        return count, sq.clamp(min=0.0)  # the moment sums may cancel to a tiny negative

    n_hi, sq_hi = beyond(U, True)
    n_lo, sq_lo = beyond(L, False)
    n_in = (P0[:, nb:] - n_hi - n_lo).clamp(min=0.0)
    return n_in * s * s / 12 + sq_hi + sq_lo


def _zero_point_lattice(bits: int, symmetric: bool, count: int, device: torch.device) -> torch.Tensor:
    """Up to ``count`` zero points spread evenly over the integer range (all of them if fewer), float64."""
    if symmetric:
        return torch.zeros(1, dtype=torch.float64, device=device)
    qmin, qmax = qrange(bits)
    return torch.unique(torch.round(torch.linspace(qmin, qmax, min(count, qmax - qmin + 1), dtype=torch.float64,
                                                   device=device)))


def _best(h: Histogram, scale: torch.Tensor, zp: torch.Tensor, bits: int):
    """(scale [G], zero point [G], error [G]) of the candidate [G, K] with the least expected error
    (the first of equal minima)."""
    G, K = scale.shape
    step = max(1, _CHUNK // G)
    err = torch.cat([expected_sq_error(h, scale[:, i:i + step], zp[:, i:i + step], bits)
                     for i in range(0, K, step)], 1)
    best = err.argmin(1, keepdim=True)
    return scale.gather(1, best).squeeze(1), zp.gather(1, best).squeeze(1), err.gather(1, best).squeeze(1)


def _grid_product(scales: torch.Tensor, zps: torch.Tensor):
    """Every (scale, zero point) pair: scales [G, S] x zps [G, Z] -> two [G, S * Z] tensors."""
    G, S, Z = scales.shape[0], scales.shape[1], zps.shape[1]
    return scales.repeat_interleave(Z, 1), zps.repeat(1, S).expand(G, S * Z)


def search_grid(h: Histogram, bits: int, symmetric: bool, power_of_two: bool,
                anchors: Sequence[Tuple[torch.Tensor, torch.Tensor]] = ()) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per histogram row, the range (lo, hi) [G] of the grid with the least expected squared error
    (expected_sq_error) among the candidates; choose_qparams(lo, hi, ...) gives that grid back.

    Candidates: the grids of the data's extremes and of the ``anchors`` ranges (the observer's own),
    and scales from the extremes' grid down SEARCH_OCTAVES octaves: powers of two in pow2 mode, in
    multiplier mode 2^(1/16) apart. Searched in two passes, since each candidate costs a few
    tensor operations and convert() runs this for every tensor of every layer: first every
    COARSE-th scale with up to COARSE_ZERO_POINTS zero points spread over the range, then every
    scale and zero point between the best one's neighbours on that coarse lattice. The first minimum
    wins, so a tie keeps the earlier candidate: the extremes' grid, then wider scales."""
    seen = (h.lo.clamp(max=0.0), h.hi.clamp(min=0.0))
    grids = [choose_qparams(lo, hi, bits, symmetric, power_of_two) for lo, hi in (seen, *anchors)]
    G = h.counts.shape[0]
    dev = h.counts.device
    steps = 1 if power_of_two else MULTIPLIER_STEPS_PER_OCTAVE
    coarse = 1 if power_of_two else COARSE
    j = torch.arange(coarse, SEARCH_OCTAVES * steps + 1, coarse, dtype=torch.float64, device=dev)
    z1 = _zero_point_lattice(bits, symmetric, COARSE_ZERO_POINTS, dev)
    s1, zz1 = _grid_product(grids[0][0].unsqueeze(1) * torch.pow(2.0, -j / steps), z1.expand(G, -1))
    scale = torch.cat([torch.stack([g[0] for g in grids], 1), s1], 1)
    zp = torch.cat([torch.stack([g[1].double() for g in grids], 1), zz1], 1)
    s, z, _ = _best(h, scale, zp, bits)
    # second pass: the scales and zero points between the best one's coarse neighbours
    f2 = torch.pow(2.0, torch.arange(-coarse + 1, coarse, dtype=torch.float64, device=dev) / steps)
    qmin, qmax = qrange(bits)
    if symmetric:
        z2 = torch.zeros(G, 1, dtype=torch.float64, device=dev)
    else:
        gap = float(z1[1] - z1[0]) if z1.numel() > 1 else 1.0  # the coarse lattice's spacing
        dz = torch.unique(torch.round(torch.linspace(-gap, gap, min(COARSE_ZERO_POINTS, 2 * int(gap) + 1),
                                                     dtype=torch.float64, device=dev)))
        z2 = (z.unsqueeze(1) + dz).clamp(qmin, qmax)
    s2, zz2 = _grid_product(s.unsqueeze(1) * f2, z2)
    s, z, _ = _best(h, torch.cat([s.unsqueeze(1), s2], 1), torch.cat([z.unsqueeze(1), zz2], 1), bits)
    if symmetric:
        lo, hi = -qmax * s, qmax * s
    else:
        lo, hi = (qmin - z) * s, (qmax - z) * s
    # a row without nonzero data keeps its extremes (convert() warns about a degenerate range)
    empty = h.counts.sum(1) == 0
    return torch.where(empty, seen[0], lo), torch.where(empty, seen[1], hi)


def _histogram_rows(spec: TensorSpec) -> int:
    """How the histogram's channels are grouped for one grid each: per_gate merges each gate's."""
    return 3 if spec.granularity == "per_gate" else 0


def calibrated_range(observer: Observer, spec: TensorSpec, hidden: int, power_of_two: bool,
                     kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The range convert() hands to activation_qparams for one calibrated tensor: the observer's own
    for percentile, minmax, ema, ema_step; for ``mse``, the range of the grid (this tensor's bits,
    symmetry, scale mode, granularity) with the least expected squared error over the observer's
    histogram, the percentile range's grid among the candidates. Headroom widens it afterwards, as
    any range (activation_qparams)."""
    lo, hi = (v.cpu() for v in observer.range())
    if kind != "mse":
        return lo, hi
    groups = _histogram_rows(spec)
    h = observer.histogram(groups)
    if groups:  # the observer's per-channel range, reduced to the gate's (as activation_qparams does)
        anchor = (lo.reshape(3, hidden).amin(1), hi.reshape(3, hidden).amax(1))
    else:
        anchor = (lo.reshape(-1), hi.reshape(-1))
    s_lo, s_hi = search_grid(h, spec.bits, spec.symmetric, power_of_two, [anchor])
    if groups:
        return s_lo.repeat_interleave(hidden), s_hi.repeat_interleave(hidden)
    return s_lo.reshape(lo.shape), s_hi.reshape(hi.shape)


def grid_error(observer: Observer, scale: torch.Tensor, zero_point: torch.Tensor, bits: int) -> Tuple[float, float]:
    """(expected sum of squared errors, sum of squares) of the observer's calibration data on the
    grid (scale, zero point) (scalars, or one per channel): what qgru.compare reports as the grid's
    expected SQNR on its own calibration data."""
    h = observer.histogram()
    G = h.counts.shape[0]
    s = torch.as_tensor(scale, dtype=torch.float64, device=h.counts.device).reshape(-1).expand(G).unsqueeze(1)
    z = torch.as_tensor(zero_point, dtype=torch.float64, device=h.counts.device).reshape(-1).expand(G).unsqueeze(1)
    err = float(expected_sq_error(h, s, z, bits).sum())
    B = h.counts.shape[1] // 2
    a = (torch.arange(2 * B, dtype=torch.float64, device=h.width.device) - B).unsqueeze(0) * h.width.unsqueeze(1)
    b = a + h.width.unsqueeze(1)
    power = float((h.counts * (a * a + a * b + b * b) / 3).sum())
    return err, power


def _bits_of(bound: int) -> int:
    """Smallest b with |v| < 2**b for every |v| <= bound."""
    return int(bound).bit_length()


def recurrent_operand(bits: Dict[str, int]) -> str:
    """The name of the tensor the R.h GEMM reads: h_gemm when the config has one, else h itself."""
    return "h_gemm" if "h_gemm" in bits else "h"


def operand_bounds(bits: Dict[str, int], input_size: int, hidden_size: int) -> Dict[str, int]:
    """The largest |operand| of every rescale of a layer (docs/spec.md section 6), which sets its
    multiplier width (``primitives.multiplier_bits(_bits_of(bound))``). "in" is the rescale of the
    previous layer's outputs onto this layer's x grid (``in_0``, ``in_1``); "h_gemm" that of the
    state onto the R.h operand's grid (only with an h_gemm tensor)."""
    def span(n):  # largest |q - Z| of a tensor stored in bits[n] bits
        return (1 << bits[n]) - 1

    bias_max = 1 << (BIAS_BITS - 1)
    return {
        "Wx": input_size * (1 << (bits["W"] - 1)) * span("x") + bias_max,
        "Rh": hidden_size * (1 << (bits["R"] - 1)) * span(recurrent_operand(bits)) + bias_max,
        "h_gemm": span("h"),
        "Wx_r": span("Wx"), "Rh_r": span("Rh"), "Wx_z": span("Wx"), "Rh_z": span("Rh"), "Wx_g": span("Wx"),
        "rRh_g": span("r") * span("Rh"),
        "zh": span("z") * span("h"),
        "zg": (1 << bits["z"]) * (1 << (bits["g"] - 1)),
        "in": span("h"),
    }


class RescaleError(ValueError):
    """convert() (or a QAT forward, which derives the same parameters) met a ratio of two grids that
    the fixed-point rescale cannot represent (a factor of 2^30 or more): a broken weight (1e30) or
    calibration. The message names the layer, direction, rescale and the weights' largest values."""


# what each rescale maps (docs/spec.md section 6): named in RescaleError's message
_RESCALE_TEXT = {
    "Wx": "S_W S_x / S_Wx: the input GEMM x.W onto the Wx grid", "Rh": "S_R S_h / S_Rh: the recurrent GEMM onto "
    "the Rh grid", "Wx_r": "S_Wx / S_r_pre", "Rh_r": "S_Rh / S_r_pre", "Wx_z": "S_Wx / S_z_pre", "Rh_z": "S_Rh / S_z_pre",
    "Wx_g": "S_Wx / S_g_pre", "rRh_g": "S_r S_Rh / S_g_pre", "zh": "S_z", "zg": "S_z S_g / S_h",
    "h_gemm": "S_h / S_h_gemm", "in_0": "S_h of the previous layer / S_x", "in_1": "S_h of the previous layer's "
    "reverse direction / S_x"}


def _rescale(name: str, real: torch.Tensor, operand_bound: int, power_of_two: bool) -> Rescale:
    real = torch.as_tensor(real, dtype=torch.float64, device=real.device if isinstance(real, torch.Tensor) else _CPU)
    try:
        m, s = quantize_multipliers(real, _bits_of(operand_bound), power_of_two)
    except ValueError as e:
        raise RescaleError(f"rescale {name} ({_RESCALE_TEXT.get(name, name)}): {e}") from None
    return Rescale(m, s)


def derive_layer_params(w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: Optional[torch.Tensor],
                        b_hh: Optional[torch.Tensor], ranges: Dict[str, Tuple[torch.Tensor, torch.Tensor]],
                        config: QuantConfig,
                        prev_h: Sequence[Tuple[torch.Tensor, torch.Tensor]] = (),
                        scales_out: Optional[Dict[str, torch.Tensor]] = None,
                        second_moments: Optional[Dict[str, torch.Tensor]] = None) -> LayerParams:
    """Integer parameters of one layer and direction.

    ``ranges`` maps x, h, Wx, Rh, r_pre, z_pre, g_pre (and h_gemm, when the config has it) to
    observed (min, max) (per channel for Wx/Rh when their granularity is not per_tensor). h_gemm
    is h's values on its own grid: without an entry of its own it takes h's range. ``prev_h`` lists (scale, zero point) of the
    previous layer's h grid per direction, for the rescale of its outputs onto this layer's x grid.
    ``scales_out``, if given, receives the float64 scale of every tensor (LayerParams keeps only
    the boundary ones): quantization-aware training (qgru/qat.py) carries its float values on
    exactly the grids chosen here. ``second_moments``, if given, maps "x" and "h" to their E[v v^T]
    from calibration: W and R are then rounded by ``gptq_round`` (config.weight_rounding "gptq").
    """
    pow2 = config.power_of_two
    H3, I = w_ih.shape
    H = H3 // 3
    bits = {n: s.bits for n, s in config.tensors.items()}
    S, Z = {}, {}
    op = recurrent_operand(bits)  # the R.h GEMM's operand: h itself or h_gemm
    operand = (op,) if op != "h" else ()  # h_gemm, the one tensor a config may leave out
    calibrated = ("x", "h", "Wx", "Rh", "r_pre", "z_pre", "g_pre") + operand
    for n in calibrated:
        r = ranges["h"] if n == "h_gemm" and n not in ranges else ranges[n]
        if config[n].dynamic and (n == "h_gemm" or (n == "x" and prev_h)):
            # a GEMM operand made from a state: its grid covers what that state's grid can hold,
            # within the tanh bound [-1, 1], instead of the values calibration saw (x.dynamic,
            # h_gemm.dynamic; docs/spec.md section 4b)
            src = [(S["h"], Z["h"])] if n == "h_gemm" else prev_h
            r = state_span(src, bits["h"], src[0][0].device)
            S[n], Z[n] = activation_qparams(*r, replace(config[n], headroom=1.0), H, pow2)
            continue
        S[n], Z[n] = activation_qparams(*r, config[n], H, pow2)
    mom = second_moments or {}
    S["W"], W = weight_qparams(w_ih, config["W"], pow2, mom.get("x"))
    S["R"], R = weight_qparams(w_hh, config["R"], pow2, mom.get("h"))

    def bias(b, w_scale, act_scale):
        if b is None:
            return torch.zeros(H3, dtype=torch.int64, device=w_scale.device)
        return saturate(round_half_up(b.detach().double() / (w_scale * act_scale)), BIAS_BITS)

    b_x = bias(b_ih, S["W"], S["x"])
    b_h = bias(b_hh, S["R"], S[op])

    grids = {"r": output_grid("sigmoid", bits["r"], pow2), "z": output_grid("sigmoid", bits["z"], pow2),
             "g": output_grid("tanh", bits["g"], pow2)}
    for n, grid in grids.items():
        S[n] = torch.tensor(grid.scale, dtype=torch.float64, device=_CPU)
        Z[n] = torch.tensor(grid.zero_point, device=_CPU)

    bound = operand_bounds(bits, I, H)
    one_z = grids["z"].one

    def gate(v, i):
        return v if v.dim() == 0 else v[i * H:(i + 1) * H]

    rescale = {
        "Wx": _rescale("Wx", S["W"] * S["x"] / S["Wx"], bound["Wx"], pow2),
        "Rh": _rescale("Rh", S["R"] * S[op] / S["Rh"], bound["Rh"], pow2),
        "Wx_r": _rescale("Wx_r", gate(S["Wx"], 0) / S["r_pre"], bound["Wx_r"], pow2),
        "Rh_r": _rescale("Rh_r", gate(S["Rh"], 0) / S["r_pre"], bound["Rh_r"], pow2),
        "Wx_z": _rescale("Wx_z", gate(S["Wx"], 1) / S["z_pre"], bound["Wx_z"], pow2),
        "Rh_z": _rescale("Rh_z", gate(S["Rh"], 1) / S["z_pre"], bound["Rh_z"], pow2),
        "Wx_g": _rescale("Wx_g", gate(S["Wx"], 2) / S["g_pre"], bound["Wx_g"], pow2),
        "rRh_g": _rescale("rRh_g", S["r"] * gate(S["Rh"], 2) / S["g_pre"], bound["rRh_g"], pow2),
        "zh": _rescale("zh", S["z"], bound["zh"], pow2),
        "zg": _rescale("zg", S["z"] * S["g"] / S["h"], bound["zg"], pow2),
    }
    if op == "h_gemm":
        rescale["h_gemm"] = _rescale("h_gemm", S["h"] / S["h_gemm"], bound["h_gemm"], pow2)
    for d, (s_prev, _) in enumerate(prev_h):
        rescale[f"in_{d}"] = _rescale(f"in_{d}", s_prev / S["x"], bound["in"], pow2)

    x_levels = None
    if not prev_h and config["x"].dynamic:  # the first layer: x comes from float
        x_levels = derive_x_levels(S, Z, bits, b_ih, bound["Wx"], pow2, bias)

    tables = {n: build_table("sigmoid" if n != "g" else "tanh", bits[f"{n}_pre"], float(S[f"{n}_pre"]),
                             int(Z[f"{n}_pre"]), float(S[n])) for n in ("r", "z", "g")}
    if scales_out is not None:
        scales_out.update(S)
    zp = {n: Z[n].to(torch.int64) for n in calibrated + ("r", "z", "g")}
    return LayerParams(
        input_size=I, hidden_size=H, bits=bits, W=W, R=R, b_x=b_x, b_h=b_h,
        W_zp_comp=Z["x"] * W.sum(1), R_zp_comp=Z[op] * R.sum(1), zp=zp, rescale=rescale,
        tables=tables, one_z=one_z,
        scale={n: S[n] for n in ("x", "h", "W", "R") + operand}, x_levels=x_levels)


def state_span(grids, h_bits: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi): the values the states on ``grids`` ((scale, zero point) per direction, h_bits
    bits) can hold, within [-1, 1] (a GRU's state is a convex mix of tanh outputs and h0)."""
    lo_q, hi_q = qrange(h_bits)
    lo = min(max((lo_q - int(z)) * float(s), -1.0) for s, z in grids)
    hi = max(min((hi_q - int(z)) * float(s), 1.0) for s, z in grids)
    return (torch.tensor(lo, dtype=torch.float64, device=device), torch.tensor(hi, dtype=torch.float64, device=device))


# x levels (qgru.golden.XLevels): x's grid widened by 2^(e/4), e = 0 .. 12 (up to 8x the calibrated
# range, in quarter octaves); pow2 scale mode keeps whole octaves (every scale a power of two)
X_LEVEL_EXPONENTS = tuple(range(0, 13))
X_LEVEL_EXPONENTS_POW2 = (0, 4, 8, 12)


def derive_x_levels(S, Z, bits, b_ih, wx_bound: int, pow2: bool, bias) -> XLevels:
    """The first layer's x levels: per level its scale, its range, b_ih at its accumulator scale and
    the W.x rescale onto the (static) Wx grid. Level 0 reproduces b_x and rescale["Wx"] exactly. A
    level whose rescale cannot be represented ends the list (the levels below it still apply)."""
    lo_q, hi_q = qrange(bits["x"])
    zx = int(Z["x"])
    exps, scales, b_xs, mults, shifts = [], [], [], [], []
    for e in (X_LEVEL_EXPONENTS_POW2 if pow2 else X_LEVEL_EXPONENTS):
        s = S["x"] * (2.0 ** (e / 4))
        try:
            r = _rescale("Wx", S["W"] * s / S["Wx"], wx_bound, pow2)
        except RescaleError:
            if e == 0:
                raise
            break
        b = bias(b_ih, S["W"], s)
        n = b.numel()
        exps.append(e)
        scales.append(s)
        b_xs.append(b)
        mults.append(r.multiplier.expand(n) if r.multiplier.dim() == 0 else r.multiplier)
        shifts.append(r.shift.expand(n) if r.shift.dim() == 0 else r.shift)
    dev = S["x"].device
    scale = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev) for v in scales])
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=dev)
    lo = -inf.expand_as(scale).clone() if zx == lo_q else (lo_q - zx) * scale
    hi = inf.expand_as(scale).clone() if zx == hi_q else (hi_q - zx) * scale
    return XLevels(exponent=torch.tensor(exps, dtype=torch.int64, device=dev), scale=scale, lo=lo, hi=hi,
                   b_x=torch.stack(b_xs), rescale=Rescale(torch.stack(mults), torch.stack(shifts)))
