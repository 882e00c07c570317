"""qgru.compare(): where a quantized model loses accuracy, tensor by tensor.

``compare(float_model, quant_model, batches)`` runs every batch through both models, captures the
input of every converted QuantGRU (forward hooks), and replays that input through

* the golden integer model (qgru/golden.py), layer by layer and direction by direction, recording
  every stored integer of every step (x, Wx, Rh, r_pre, z_pre, g_pre, r, z, g, h, and h_gemm, the
  R.h GEMM's operand, in a model whose config has one), and
* the float step-by-step reference (qgru/float_gru.py) with the float weights of the paired
  nn.GRU in ``float_model``, on the same input, recording the same tensors in float.

It then reports, per GRU module, layer, direction and tensor: the SQNR, cosine and max abs error of
the dequantized integer tensor against its float counterpart, the tensor's *own* SQNR (below), how
often it saturated, and for the state h the SQNR per time step (drift). The h_gemm row (only for a
model with that tensor) compares the operand R.h read at each step with the float state it stands
for (the float h entering the step); its own SQNR is the error its grid adds to the integer state
it was requantized from. One extra row per module,
``output``, compares the quantized model's GRU output with the float model's GRU output as the two
models actually ran (so it also carries any difference in what reached the GRU). The report ends by
naming the worst tensor and the config override that changes just that tensor.

Columns
-------
SQNR, cosine, max |err|
    dequantized integer tensor vs the float model's tensor. Errors accumulate: layer 1 inherits
    layer 0's, step t inherits step t-1's, g inherits r's.
own SQNR
    the error this tensor's own grid adds: the integer tensor vs the exact (float64) result of its
    operation on the integer model's own dequantized operands (e.g. g_pre vs Wx_g + r * Rh_g computed
    from the integer Wx, r, Rh; x vs the input it quantized; W vs the float weight). This is what
    points at the tensor that needs more bits: a tensor downstream of a coarse one has a low SQNR
    but a high own SQNR.
saturation
    the fraction of (valid) elements stored as qmin or qmax of the tensor's bits while the value
    it should have stored (the own reference above) lies beyond that end of the grid: clipping,
    not a value that merely rounds to the end point (a zero point at qmin is not saturation). For
    the calibrated tensors (x, h, h_gemm, Wx, Rh, r_pre, z_pre, g_pre) that is clipping at the
    calibrated range (for x of layer 0: inputs outside it; with x levels, docs/spec.md section 4b,
    each token is on its own level's grid and only inputs beyond the widest level clip). For r, z, g the grid is the function's whole
    range, so it only means sigmoid/tanh itself is within a step of 0 or 1: reported, marked
    ``*``, never blamed. Weights are symmetric over their exact max: not reported.

calib dB (what the grid choice cost)
    for the calibrated tensors, the SQNR the tensor's grid has on its *own calibration data*,
    expected from the observer's histogram at convert() (rounding inside the grid, clipping
    outside: qgru.convert.expected_sq_error): the error convert() chose, before anything
    accumulates. The ``mse`` observer picks the grid that maximises it; own dB above is the
    same quantity measured on the compared batches (for x of layer 0 on the calibration data,
    the two agree).
calibration clip
    for the calibrated tensors, the share of the tensor's *own calibration data* beyond its grid
    (counted at convert() from the observer's histogram). Above 0.1% the report names the
    observer: it chose a range narrower than the data it saw (``ema`` does that when many small
    calls, e.g. 1-step autoregressive ones, make it follow only the last calls), and worst() blames
    the observer rather than the tensor's bits. Not for ``mse``: it clips exactly where clipping
    costs less error than the coarser grid that would hold those values (calib dB says what it
    won), so its clipping is listed as its choice, never blamed.

Scales of the inner tensors
---------------------------
LayerParams keeps only the x, h, W and R scales (and h_gemm's, when the model has it); the rest
is folded into rescale factors, so the others are rebuilt from the rescales: S_Wx = S_W S_x / M_Wx,
S_Rh = S_R S_op / M_Rh, S_r_pre = S_Wx_r / M_Wx_r (likewise z, g), with M = multiplier / 2^shift.
S_op is the scale of what R.h reads: S_h_gemm in a model with h_gemm, else S_h (b_h, too, is at
S_R S_op). In pow2 mode every M is an exact power of two, so these are the exact scales. In
multiplier mode M carries the multiplier's rounding, a relative error of at most 2^-B for a B-bit
multiplier (docs/spec.md section 3: B = 31 for 8-bit operands, 21 for a w16a16 GEMM with K = 512):
the dequantized inner tensors are then off by that relative amount, which caps their measured SQNR
near 6B dB (over 120 dB), far below any quantization error reported. Gate outputs use their fixed
grids (tables.output_grid).

Inputs
------
* ``float_model``: the float original (nn.GRU modules); ``quant_model``: what quantize_model()
  returned (same structure, converted QuantGRUs). GRUs are paired by module name
  (``named_modules``); a bare nn.GRU and a QuantGRU (e.g. ``QuantGRU.from_float(gru)``, calibrated
  and converted) pair too.
* ``batches``: calibrate()'s convention: a tuple/list batch is called as ``model(*batch)``,
  anything else as ``model(batch)``. Whatever each GRU receives is supported: 3-D (batch_first or
  not), unbatched 2-D, PackedSequence (padded steps are left out of every statistic), h0 given or
  not. A GRU called several times per forward pass has its calls pooled.
* Per-step statistics are indexed by the step each direction processes: for a reverse direction
  step 0 is the last time position (its first step), so drift reads the same way in both.

The integer side is always the golden model (it is what records intermediates); the module output
row uses whatever backend the model ran on, and a mismatch between the two is warned about (every
backend is bit-exact with golden, so it would be a bug).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from tqdm.auto import tqdm

from . import golden
from .backends import BoundaryOps
from .convert import recurrent_operand
from .float_gru import float_direction
from .module import CalibrationWarning, QuantGRU
from .primitives import dequantize, qrange
from .tables import output_grid

# h_gemm (the R.h GEMM's operand, only in a model whose config has one) is calibrated too: on h's
# data with a grid of its own (QuantGRU._calibrated); a model without it has no h_gemm row at all
CALIBRATED = ("x", "h", "h_gemm", "Wx", "Rh", "r_pre", "z_pre", "g_pre")  # clipping here is a calibration issue
GATE_OUTPUTS = ("r", "z", "g")
ROW_ORDER = ("x", "W", "R", "Wx", "h_gemm", "Rh", "r_pre", "z_pre", "g_pre", "r", "z", "g", "h", "h_n")
CONFIG_TENSORS = ("x", "h", "h_gemm", "W", "R", "Wx", "Rh", "r_pre", "z_pre", "g_pre", "r", "z", "g")
SATURATION_THRESHOLD = 1e-3  # worst(): clipping above 0.1 % of the elements is the reason
# compare() warns (CalibrationWarning) when more than this share of a GRU's input x (layer 0) lies
# beyond its grid: the batches reach beyond what calibration saw (drifting forecasts)
X_CLIP_WARN = 1e-3
MAX_HEADROOM_GUESS = 100.0  # worst() suggests a headroom only for a range this many times too small
_BOUNDARY = BoundaryOps()  # golden quantize (rejects NaN)


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
def sqnr_db(signal_power: float, noise_power: float) -> float:
    """10 log10(signal / noise): inf for an exact match, -inf for noise on a zero signal."""
    if noise_power == 0:
        return math.inf
    if signal_power == 0:
        return -math.inf
    return 10.0 * math.log10(signal_power / noise_power)


class _Stat:
    """Running sums of one (module, layer, direction, tensor) over every batch."""

    def __init__(self) -> None:
        self.ref2 = self.err2 = self.dot = self.got2 = 0.0
        self.max_abs = 0.0
        self.own_ref2 = self.own_err2 = 0.0
        self.has_own = False
        self.sat: Optional[int] = None
        self.n = 0
        self.need = 0.0  # largest (value the integer model had to store) / (edge of its grid)
        self.step_ref2: Optional[torch.Tensor] = None
        self.step_err2: Optional[torch.Tensor] = None
        self.tokens = 0  # x of a layer with x levels: tokens compared, and those on a level above 0
        self.above0: Optional[int] = None

    def add(self, ref: torch.Tensor, got: torch.Tensor, mask: Optional[torch.Tensor] = None,
            own: Optional[torch.Tensor] = None, q: Optional[torch.Tensor] = None, bits: int = 0,
            grid: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, steps: bool = False) -> None:
        """ref, got, own: float64 [T, N, C] (or [N, C] / [C, K] without mask); mask [T, N] bool."""
        ref, got = ref.double(), got.double()
        w = None if mask is None else mask.unsqueeze(-1).expand_as(ref).double()

        def total(v):
            return float((v if w is None else v * w).sum())

        err = got - ref
        self.ref2 += total(ref * ref)
        self.err2 += total(err * err)
        self.dot += total(ref * got)
        self.got2 += total(got * got)
        if err.numel():
            self.max_abs = max(self.max_abs, float((err.abs() if w is None else err.abs() * w).max()))
        self.n += ref.numel() if w is None else int(w.sum())
        if own is not None:
            own = own.double()
            oe = got - own
            self.has_own = True
            self.own_ref2 += total(own * own)
            self.own_err2 += total(oe * oe)
        if q is not None:
            lo, hi = qrange(bits)
            at_lo, at_hi = q == lo, q == hi
            if grid is not None and own is not None:  # on a rail *and* the value lies beyond it
                at_lo, at_hi = at_lo & (own < grid[0]), at_hi & (own > grid[1])
            self.sat = (self.sat or 0) + int(total((at_lo | at_hi).double()))
        if grid is not None and own is not None and own.numel():
            g_lo, g_hi = grid  # real values of qmin and qmax, broadcast over the last axis
            tiny = torch.finfo(torch.float64).tiny
            ratio = torch.where(own > 0, own / g_hi.clamp(min=tiny),
                                torch.where(own < 0, own / g_lo.clamp(max=-tiny), torch.zeros_like(own)))
            self.need = max(self.need, float((ratio if w is None else ratio * w).max()))
        if steps:
            e2 = err * err if w is None else err * err * w
            r2 = ref * ref if w is None else ref * ref * w
            e2, r2 = e2.flatten(1).sum(1).cpu(), r2.flatten(1).sum(1).cpu()
            if self.step_err2 is None:
                self.step_err2, self.step_ref2 = e2, r2
            else:
                T = max(len(e2), len(self.step_err2))
                pad = lambda v: torch.nn.functional.pad(v, (0, T - len(v)))
                self.step_err2 = pad(self.step_err2) + pad(e2)
                self.step_ref2 = pad(self.step_ref2) + pad(r2)

    def cosine(self) -> float:
        if self.ref2 == 0 and self.got2 == 0:
            return 1.0
        if self.ref2 == 0 or self.got2 == 0:
            return 0.0
        return self.dot / math.sqrt(self.ref2 * self.got2)

    def steps_sqnr(self) -> Optional[List[float]]:
        if self.step_err2 is None:
            return None
        return [sqnr_db(float(r), float(e)) for r, e in zip(self.step_ref2, self.step_err2)]


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------
@dataclass
class CompareReport:
    """What compare() returns. ``str(report)`` is the printed table.

    ``rows``: one dict per (module, layer, direction, tensor) with keys ``module`` (name in the
    model, "" for a bare GRU), ``layer`` and ``direction`` ("fwd"/"rev"; None for the module's
    ``output`` row), ``tensor``, ``bits``, ``sqnr_db``, ``cosine``, ``max_abs_err`` (vs float),
    ``own_sqnr_db`` (None where not defined), ``saturation`` (fraction, None for weights),
    ``saturated`` (count), ``numel`` (valid elements compared), ``steps_sqnr_db`` (list, one per
    step: rows ``h`` and ``output`` only, else None), ``range_needed`` (calibrated tensors: how
    many times wider than the grid the stored values wanted to be; <= 1: they fit), and
    ``headroom`` (the tensor's config headroom, calibrated tensors only) and ``scale_mode``;
    for calibrated tensors also ``observer`` (the config's observer, e.g. "percentile (99.99%)")
    and ``calib_clip``: the share of the tensor's own calibration values that its grid clips
    (counted at convert() from the observer's histogram, whole bins only, so a lower bound; None
    for a model not calibrated in this process, e.g. from load_params), ``calib_sqnr_db``: the
    SQNR its grid is expected to have on its own calibration data (the histogram's model of
    rounding and clipping; None likewise), and ``grid``: (scale, zero point) as floats and ints
    (per_gate/per_channel: the scale and zero point of the first channel; with x levels, level 0's).
    Layer 0's x row of a model with x levels (docs/spec.md section 4b) has every token on its own
    level's grid: saturation, range_needed and own SQNR are against that level (only the widest
    level clips), ``x_levels_widest`` is the widest level's range over the calibrated one (8.0;
    None without levels) and ``above_level0`` the share of tokens on a level above 0 (beyond the
    calibrated range; None without levels).
    """
    rows: List[Dict[str, Any]]
    batches: int
    configs: Dict[str, str] = field(default_factory=dict)  # module name -> "w8a8 (pow2), 1 layer(s) x ..."

    def row(self, tensor: str, layer: Optional[int] = 0, direction: Optional[str] = "fwd",
            module: Optional[str] = None) -> Dict[str, Any]:
        """The row of one tensor (``module`` may be omitted when there is one GRU module)."""
        for r in self.rows:
            if (r["tensor"] == tensor and r["layer"] == layer and r["direction"] == direction
                    and (module is None or r["module"] == module)):
                return r
        raise KeyError(f"no row for tensor {tensor!r}, layer {layer}, direction {direction!r}, module {module!r}")

    def worst(self, saturation_threshold: float = SATURATION_THRESHOLD) -> Dict[str, Any]:
        """The tensor to fix first, as its row plus ``reason``, ``override`` and ``message``.

        The tensor whose own grid adds the most error: the lowest own SQNR, which counts rounding
        and clipping alike. If it is a calibrated tensor (x, h, h_gemm, Wx, Rh, r_pre, z_pre,
        g_pre) saturating more than ``saturation_threshold`` of its elements, the reason is
        ``"saturation"`` and the override widens its range (``headroom``, from the measured
        ``range_needed``, with 16 bits for a narrower tensor so that resolution is not lost);
        otherwise the reason is ``"resolution"`` and the override is 16 bits (or exact scales
        for a 16-bit tensor in pow2 mode). The R.h operand h_gemm can have at most h's bits, so
        for it "16 bits" reads "h's bits", and at h's bits already the override removes it
        (``{"tensors": {"h_gemm": None}}``: R.h reads h itself). Before either: if the tensor's
        grid clips more than ``saturation_threshold`` of its *own calibration data* (recorded at convert()), the
        observer chose a range narrower than what it saw: the reason is ``"observer"``, the
        message names the observer and the override changes it (``ema`` -> ``percentile``,
        ``percentile`` -> ``minmax``). ``override`` is a QuantConfig overrides dict that
        changes only that tensor; a config is per model, so it changes that tensor in every
        layer and direction.
        """
        cands = [r for r in self.rows if r["tensor"] in CONFIG_TENSORS]
        if not cands:
            raise ValueError("the report has no rows")

        def own(r):
            v = r["own_sqnr_db"]
            return math.inf if v is None or math.isnan(v) else v

        r = min(cands, key=own)
        if own(r) == math.inf:
            return {**r, "reason": "exact", "override": {},
                    "message": "worst: none, every tensor's own grid is exact on these batches"}
        sat = r["saturation"] or 0.0
        if r["tensor"] in CALIBRATED and _blames_observer(r, saturation_threshold):
            override, why = _observer_advice(r)
            msg = (f"worst: {_where(r)} clips {100 * r['calib_clip']:.1f}% of its own calibration data "
                   f"(own SQNR {own(r):.1f} dB, the lowest; {100 * sat:.1f}% saturated here): {why} "
                   f"-> try overrides={override!r}")
            return {**r, "reason": "observer", "override": override, "message": msg}
        widest = self._widest(r)
        if r["tensor"] in CALIBRATED and sat > saturation_threshold:
            spec: Dict[str, Any] = {}
            if r["bits"] < widest:
                spec["bits"] = widest
            need = r["range_needed"]
            if need <= MAX_HEADROOM_GUESS:  # widen the grid by what the values needed, + 10 %
                spec["headroom"] = math.ceil(max(need, 1.0) * r["headroom"] * 1.1 * 10) / 10
                how = f"values up to {need:.2g}x its grid's range"
            else:  # e.g. a grid that ends at 0 (headroom scales the range, it cannot move that end)
                how = "far beyond its grid: calibrate on data that covers this range"
            override = {"tensors": {r["tensor"]: spec}} if spec else {}
            msg = (f"worst: {_where(r)} saturates {100 * sat:.1f}% ({how}; own SQNR {own(r):.1f} dB, "
                   f"the lowest) -> " + (f"try overrides={override!r}" if override else "recalibrate"))
            return {**r, "reason": "saturation", "override": override, "message": msg}
        if r["bits"] < widest:
            override = {"tensors": {r["tensor"]: {"bits": widest}}}
            hint = f"try overrides={override!r}"
        elif r["tensor"] == "h_gemm":  # as wide as h already: the narrowing itself is the error
            override = {"tensors": {"h_gemm": None}}
            hint = (f"already as wide as h ({widest} bits), the most the R.h operand can have: let R.h read "
                    f"h itself, overrides={override!r}")
        elif r["scale_mode"] == "pow2":
            override = {"scale_mode": "multiplier"}
            hint = f"already 16 bits, the widest: try exact scales, overrides={override!r}"
        else:
            override = {}
            hint = "already 16 bits with exact scales: no wider grid to offer"
        msg = f"worst: {_where(r)} own SQNR {own(r):.1f} dB at {r['bits']} bits, the lowest -> {hint}"
        return {**r, "reason": "resolution", "override": override, "message": msg}

    def _widest(self, r: Dict[str, Any]) -> int:
        """The most bits worst() may suggest for the tensor of row r: 16, but for the R.h operand
        h_gemm the bits of the state h it is requantized from (a config refuses more)."""
        if r["tensor"] != "h_gemm":
            return 16
        return self.row("h", r["layer"], r["direction"], r["module"])["bits"]

    def __str__(self) -> str:
        multi = len({r["module"] for r in self.rows}) > 1
        head = f"qgru.compare: {self.batches} batch{'es' if self.batches != 1 else ''}; " + "; ".join(
            f"GRU {_mod(m)!r}: {c}" for m, c in self.configs.items())
        cols = (["module"] if multi else []) + ["layer", "dir", "tensor", "bits", "SQNR dB", "own dB",
                                                 "calib dB", "cosine", "max |err|", "sat %"]
        lines = []
        for r in self.rows:
            sat = "-" if r["saturation"] is None else f"{100 * r['saturation']:.3f}"
            if r["tensor"] in GATE_OUTPUTS and r["saturation"] is not None:
                sat += "*"
            cells = ([_mod(r["module"])] if multi else []) + [
                "-" if r["layer"] is None else str(r["layer"]), r["direction"] or "-", r["tensor"],
                str(r["bits"]), _db(r["sqnr_db"]), _db(r["own_sqnr_db"]), _db(r.get("calib_sqnr_db")),
                f"{r['cosine']:.6f}",
                f"{r['max_abs_err']:.3g}", sat]
            lines.append(cells)
        width = [max(len(c), *(len(l[i]) for l in lines)) for i, c in enumerate(cols)]
        left = {"module", "dir", "tensor"}
        fmt = lambda cells: "  ".join(c.ljust(w) if n in left else c.rjust(w)
                                      for c, w, n in zip(cells, width, cols)).rstrip()
        out = [head, fmt(cols), fmt(["-" * w for w in width])] + [fmt(l) for l in lines]
        out.append("SQNR: vs the float model; own: the error this tensor's own grid adds; calib: its grid's "
                   "expected SQNR on its own calibration data; * r, z, g: the end of the function's range, not clipping")
        for r in self.rows:
            if r.get("above_level0") is not None:
                out.append(f"x levels: {_mod(r['module']) + ' ' if multi else ''}layer 0 {r['direction']}: "
                           f"{100 * r['above_level0']:.2f}% of the tokens beyond the calibrated range, on wider "
                           f"levels (up to {r['x_levels_widest']:g}x); sat % counts only what the widest clips")
        drift = [r for r in self.rows if r["steps_sqnr_db"]]
        if drift:
            out.append("drift: SQNR dB of h per step (a reverse direction counted in its own order)")
            for r in drift:
                s = r["steps_sqnr_db"]
                T = len(s)
                idx = sorted({0, T // 4, T // 2, (3 * T) // 4, T - 1})
                where = f"{_mod(r['module']) + ' ' if multi else ''}" + (
                    "output" if r["layer"] is None else f"layer {r['layer']} {r['direction']}")
                out.append(f"  {where:<16}" + "  ".join(f"t={t}: {_db(s[t])}" for t in idx))
        w = self.worst()
        key = lambda r: (r["module"], r["layer"], r["direction"], r["tensor"])
        clipped = [r for r in self.rows if _blames_observer(r, SATURATION_THRESHOLD)
                   and not (w["reason"] == "observer" and key(r) == key(w))]
        chosen = [r for r in self.rows if _observer_kind(r) == "mse" and (r.get("calib_clip") or 0.0) > SATURATION_THRESHOLD]
        if chosen:  # mse clips where that costs less than a coarser grid: reported, not blamed
            out.append("mse grids clipping by choice (calibration data clipped, expected SQNR on it): " +
                       ", ".join(f"{_where(r)} {100 * r['calib_clip']:.2f}% ({_db(r['calib_sqnr_db'])} dB)"
                                 for r in chosen))
        if clipped:  # every tensor whose grid clips its own calibration data, and its observer
            override, why = _observer_advice(clipped[0])
            out.append(("observer: also clipping their own calibration data: " if w["reason"] == "observer" else
                        "observer: clipping their own calibration data: ") +
                       ", ".join(f"{_where(r)} {100 * r['calib_clip']:.1f}%" for r in clipped) +
                       ("" if w["reason"] == "observer" else f"; {why} -> try overrides={override!r}"))
        out.append(w["message"])
        out.append("  (a config is per model, not per layer: the override changes that tensor in every layer "
                   "and direction; qgru.QuantConfig.load(config, overrides=...), then quantize again)")
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"CompareReport({len(self.rows)} rows, {self.batches} batches)"


def _observer_kind(r: Dict[str, Any]) -> Optional[str]:
    return r["observer"].split(" ")[0] if r.get("observer") else None


def _blames_observer(r: Dict[str, Any], threshold: float) -> bool:
    """A range narrower than the tensor's own calibration data is the observer's fault, except for
    mse, which clips on purpose (where that lowers the expected error)."""
    return _observer_kind(r) not in (None, "mse") and (r.get("calib_clip") or 0.0) > threshold


def _observer_name(config) -> str:
    o = config.observer
    if o.kind == "percentile":
        return f"percentile ({o.percentile:g}%)"
    if o.kind in ("ema", "ema_step"):
        return f"{o.kind} (momentum {o.momentum:g})"
    return o.kind


def _calib_sqnr(q: QuantGRU, layer: int, direction: str, tensor: str) -> Optional[float]:
    """The SQNR the tensor's grid is expected to have on its own calibration data (recorded at
    convert(); None for a model not calibrated here)."""
    pre = f"l{layer}.{direction}.{tensor}."
    calib = getattr(q, "_calib", None) or {}
    if pre + "grid_err2" not in calib:
        return None
    return sqnr_db(float(calib[pre + "calib_power"]), float(calib[pre + "grid_err2"]))


def _grid(p, tensor: str) -> Optional[Tuple[float, int]]:
    """(scale, zero point) of x, h or h_gemm (the grids LayerParams keeps), first channel of a vector."""
    if tensor not in p.scale or tensor not in p.zp:
        return None
    s, z = p.scale[tensor].reshape(-1), p.zp[tensor].reshape(-1)
    return float(s[0]), int(z[0])


def _calib_clip(q: QuantGRU, layer: int, direction: str, tensor: str) -> Optional[float]:
    """The share of the tensor's own calibration values that its grid clips (recorded at convert();
    None for a model that was not calibrated here, e.g. one made by load_params)."""
    pre = f"l{layer}.{direction}.{tensor}."
    calib = getattr(q, "_calib", None) or {}
    if pre + "count" not in calib:
        return None
    n = int(calib[pre + "count"])
    return int(calib[pre + "clipped"]) / n if n else 0.0


def _observer_advice(r: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
    """(override, why) for a tensor whose grid clips its own calibration data."""
    kind = r["observer"].split(" ")[0]
    if kind in ("ema", "ema_step"):
        why = (f"the {r['observer']} observer averages one extreme per call, so its range follows the last "
               "calls, not the data (many small calls, e.g. 1-step autoregressive ones, make it forget)")
        return {"observer": {"kind": "percentile"}}, why
    if kind == "percentile":
        why = f"the {r['observer']} observer leaves the rarest values out of the range by design"
        return {"observer": {"kind": "minmax"}}, why
    return {"observer": {"kind": "minmax"}}, f"the {r['observer']} observer's range is narrower than its data"




def _mod(name: str) -> str:
    return name if name else "<model>"


def _db(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return "inf" if v == math.inf else ("-inf" if v == -math.inf else f"{v:.2f}")


def _where(r: Dict[str, Any]) -> str:
    mod = f"module '{r['module']}' " if r["module"] else ""
    return f"{mod}layer {r['layer']} {r['direction']} {r['tensor']}"


# ---------------------------------------------------------------------------------------------
# compare()
# ---------------------------------------------------------------------------------------------
def _gru_modules(model: nn.Module) -> Dict[str, nn.GRU]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.GRU)}


def _float_weights(gru: nn.GRU, layer: int, direction: int):
    sfx = f"_l{layer}" + ("_reverse" if direction else "")
    get = lambda n: getattr(gru, n + sfx) if gru.bias or not n.startswith("bias") else None
    return tuple(None if w is None else w.detach() for w in
                 (get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh")))


def _pairs(float_model: nn.Module, quant_model: nn.Module) -> Dict[str, Tuple[nn.GRU, QuantGRU]]:
    if float_model is quant_model:
        raise ValueError("compare(): float_model and quant_model are the same object; pass the float "
                         "original and the model quantize_model() returned")
    qs = {n: m for n, m in _gru_modules(quant_model).items() if isinstance(m, QuantGRU)}
    if not qs:
        raise ValueError("compare(): quant_model contains no qgru.QuantGRU (pass what quantize_model returned)")
    floats = _gru_modules(float_model)
    pairs = {}
    for name, q in qs.items():
        if not q.is_converted:
            raise ValueError(f"compare(): QuantGRU {_mod(name)!r} is not converted (calibrate and convert it first)")
        f = floats.get(name)
        if f is None:
            raise ValueError(f"compare(): float_model has no nn.GRU named {_mod(name)!r} to pair with the QuantGRU "
                             f"there; its GRUs: {sorted(_mod(n) for n in floats) or 'none'}")
        if isinstance(f, QuantGRU) and f.is_converted:
            raise ValueError(f"compare(): float_model's {_mod(name)!r} is a converted QuantGRU; pass the float original")
        shape = lambda g: (g.input_size, g.hidden_size, g.num_layers, g.bidirectional, g.bias, g.batch_first)
        if shape(f) != shape(q):
            raise ValueError(f"compare(): GRU {_mod(name)!r} differs between the models: float "
                             f"(input, hidden, layers, bidirectional, bias, batch_first) = {shape(f)}, quantized {shape(q)}")
        pairs[name] = (f, q)
    return pairs


def _call(model: nn.Module, batch) -> None:
    if isinstance(batch, (tuple, list)) and not isinstance(batch, PackedSequence):
        model(*batch)
    else:
        model(batch)


def _time_major(output, gru: nn.GRU, unbatched: bool) -> torch.Tensor:
    out = output[0] if isinstance(output, tuple) and not isinstance(output, PackedSequence) else output
    if isinstance(out, PackedSequence):
        return pad_packed_sequence(out, batch_first=False)[0]
    if unbatched:
        return out.unsqueeze(1)
    return out.transpose(0, 1) if gru.batch_first else out


def _real(rs: golden.Rescale) -> torch.Tensor:
    return rs.multiplier.double() / torch.exp2(rs.shift.double())


def _grids(p: golden.LayerParams, pow2: bool) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """(scale float64, zero point int64) of every stored tensor; see the module docstring."""
    H = p.hidden_size
    op = recurrent_operand(p.bits)  # what R.h reads: its scale, not h's, is in Rh's rescale
    s_x, s_h, s_op = p.scale["x"].double(), p.scale["h"].double(), p.scale[op].double()
    s_wx = p.scale["W"].double() * s_x / _real(p.rescale["Wx"])
    s_rh = p.scale["R"].double() * s_op / _real(p.rescale["Rh"])
    g = {"x": (s_x, p.zp["x"]), "h": (s_h, p.zp["h"]), "Wx": (s_wx, p.zp["Wx"]), "Rh": (s_rh, p.zp["Rh"])}
    if op == "h_gemm":
        g["h_gemm"] = (s_op, p.zp["h_gemm"])
    for i, n in enumerate(("r", "z", "g")):
        pre = (s_wx[i * H:(i + 1) * H] / _real(p.rescale[f"Wx_{n}"])).reshape(-1).median()
        g[f"{n}_pre"] = (pre, p.zp[f"{n}_pre"])
        grid = output_grid("tanh" if n == "g" else "sigmoid", p.bits[n], pow2)
        g[n] = (torch.tensor(grid.scale, dtype=torch.float64, device=s_x.device), p.zp[n])
    return g


def _edges(scale: torch.Tensor, zp: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    lo, hi = qrange(bits)
    return (lo - zp).double() * scale, (hi - zp).double() * scale


class _Comparer:
    def __init__(self, pairs: Dict[str, Tuple[nn.GRU, QuantGRU]]) -> None:
        self.pairs = pairs
        self.stats: Dict[Tuple[str, Optional[int], Optional[str], str], _Stat] = {}
        self.warned = False
        for name, (f, q) in pairs.items():  # weights: once
            for layer in range(q.num_layers):
                for d in range(q.num_directions):
                    p = q._qparams[layer][d]
                    wf = _float_weights(f, layer, d)
                    for t, qw, fw in (("W", p.W, wf[0]), ("R", p.R, wf[1])):
                        s = p.scale[t].double().to(qw.device).unsqueeze(1)
                        self._stat(name, layer, d, t).add(fw.double().cpu(), (qw.double() * s).cpu(),
                                                          own=fw.double().cpu())

    def _stat(self, name, layer, d, tensor) -> _Stat:
        key = (name, layer, None if d is None else ("rev" if d else "fwd"), tensor)
        if key not in self.stats:
            self.stats[key] = _Stat()
        return self.stats[key]

    def call(self, name: str, qcall, fcall) -> None:
        f, q = self.pairs[name]
        (inp, hx, q_output), f_output = qcall, fcall[2]
        x, lengths, h0, unbatched, _ = q._prepare(inp, hx)
        dev = x.device
        params = q._params_on(dev)
        pow2 = q.qconfig.power_of_two
        if lengths is not None:
            lengths = lengths.to(dev)
        T = x.shape[0]
        mask = None if lengths is None else torch.arange(T, device=dev).unsqueeze(1) < lengths.unsqueeze(0)
        itr: Dict[Tuple[int, int], Dict[str, Any]] = {}
        ftr: Dict[Tuple[int, int], Dict[str, Any]] = {}

        def run_int(layer, d, inp_, h0_):
            p = params[layer][d]
            qx, qh0, level = q._integer_inputs(_BOUNDARY, params, layer, d, inp_, h0_)
            if layer == 0:
                x_own = inp_.double()
            else:
                prev = params[layer - 1]
                x_own = torch.cat([(v - prev[e].zp["h"]).double() * prev[e].scale["h"]
                                   for e, v in enumerate(inp_)], dim=-1)
            tr: Dict[str, Any] = {}
            out, hn = golden.gru_direction(p, qx, qh0, lengths, trace=tr, level=level)
            tr.update(qx=qx, x_own=x_own, qh0=qh0, out=out, hn=hn, level=level)
            itr[(layer, d)] = tr
            return out, hn

        def run_float(layer, d, inp_, h0_):
            inp_ = inp_ if layer == 0 else torch.cat(inp_, dim=-1)
            tr: Dict[str, Any] = {"x": inp_, "h0": h0_}
            out, hn = float_direction(*_float_weights(f, layer, d), inp_, h0_, lengths, trace=tr)
            tr["hn"] = hn
            ftr[(layer, d)] = tr
            return out, hn

        q_last, _ = q._run_stack(x, h0, lengths, run_int)
        q._run_stack(x, h0.to(x.dtype), lengths, run_float)
        for (layer, d), it in itr.items():
            self._layer(name, layer, d, params[layer][d], pow2, it, ftr[(layer, d)], mask)

        # the module's output as each model produced it
        got = _time_major(q_output, q, unbatched).double()
        ref = _time_major(f_output, f, unbatched).double()
        if got.shape != ref.shape:
            raise RuntimeError(f"compare(): GRU {_mod(name)!r} output shapes differ: quantized {tuple(got.shape)}, "
                               f"float {tuple(ref.shape)}")
        golden_out = torch.cat([dequantize(v, p.scale["h"], p.zp["h"]).to(x.dtype)
                                for v, p in zip(q_last, params[-1])], dim=-1).double()
        m = torch.ones(golden_out.shape[:2], dtype=torch.bool, device=dev) if mask is None else mask
        if not self.warned and not torch.equal(golden_out[m], got[m]):
            self.warned = True
            warnings.warn(f"compare(): GRU {_mod(name)!r}: the backend's output differs from the golden model's; "
                          "the per-tensor rows describe the golden model", RuntimeWarning, stacklevel=3)
        self._stat(name, None, None, "output").add(ref, got, mask, steps=True)

    def _layer(self, name, layer, d, p, pow2, it, ft, mask) -> None:
        T = it["qx"].shape[0]
        if T == 0:
            return
        H = p.hidden_size
        g = _grids(p, pow2)
        bits = p.bits
        deq = lambda n, v: (v - g[n][1]).double() * g[n][0]
        stack = lambda tr, n: torch.stack(tr[n])
        add = lambda t, ref, got, own=None, q=None, steps=False: self._stat(name, layer, d, t).add(
            ref, got, mask, own, q, bits[t], _edges(*g[t], bits[t]), steps)

        qx = it["qx"]
        W = p.W.double() * p.scale["W"].double().unsqueeze(1)
        R = p.R.double() * p.scale["R"].double().unsqueeze(1)
        level = it.get("level")
        if level is None:
            x_deq = deq("x", qx)
            add("x", ft["x"], x_deq, it["x_own"], qx)
            b_x = p.b_x.double() * p.scale["W"].double() * p.scale["x"].double()
        else:  # x levels: each token on its own level's grid, and W.x's bias at that level's scale
            lv = p.x_levels
            s_tok = lv.scale[level].unsqueeze(-1)  # [T, N, 1]
            x_deq = (qx - p.zp["x"]).double() * s_tok
            # saturation and range_needed against the token's own level: only the last level clips
            st = self._stat(name, layer, d, "x")
            st.add(ft["x"], x_deq, mask, it["x_own"], qx, bits["x"], _edges(s_tok, p.zp["x"], bits["x"]))
            on = level > 0 if mask is None else (level > 0) & mask
            st.tokens += level.numel() if mask is None else int(mask.sum())
            st.above0 = (st.above0 or 0) + int(on.sum())
            b_x = lv.b_x[level].double() * p.scale["W"].double() * s_tok
        # b_h is at the scale of R times R.h's operand: h_gemm's when the model has one, not h's
        b_h = p.b_h.double() * p.scale["R"].double() * g[recurrent_operand(bits)][0]

        q_wx = stack(it, "Wx")
        wx = deq("Wx", q_wx)
        add("Wx", stack(ft, "Wx"), wx, x_deq @ W.t() + b_x, q_wx)

        q_h = stack(it, "h")
        h_prev = deq("h", torch.cat([it["qh0"].unsqueeze(0), it["out"][:-1]]))
        operand = self._operand(name, layer, d, p, g, it, ft, h_prev, mask)
        q_rh = stack(it, "Rh")
        rh = deq("Rh", q_rh)
        add("Rh", stack(ft, "Rh"), rh, operand @ R.t() + b_h, q_rh)

        gates = {}
        for n in ("r", "z", "g"):
            q_pre, q_out = stack(it, f"{n}_pre"), stack(it, n)
            pre = deq(f"{n}_pre", q_pre)
            i = ("r", "z", "g").index(n)
            sl = slice(i * H, (i + 1) * H)
            own_pre = wx[..., sl] + (rh[..., sl] if n != "g" else gates["r"] * rh[..., sl])
            add(f"{n}_pre", stack(ft, f"{n}_pre"), pre, own_pre, q_pre)
            gates[n] = deq(n, q_out)
            func = torch.tanh if n == "g" else torch.sigmoid
            add(n, stack(ft, n), gates[n], func(pre), q_out)
        h_deq = deq("h", q_h)
        add("h", stack(ft, "h"), h_deq, gates["z"] * h_prev + (1 - gates["z"]) * gates["g"], q_h, steps=True)
        self._stat(name, layer, d, "h_n").add(ft["hn"], deq("h", it["hn"]))

    def _operand(self, name, layer, d, p, g, it, ft, h_prev, mask) -> torch.Tensor:
        """The dequantized operand that R.h read at every step [T, N, H]: the state entering the
        step, or, in a model with h_gemm, that state requantized onto h_gemm's grid. The latter
        gets a row of its own: vs the float state it stands for (h0, then the float h of the step
        before), own vs the integer state it was requantized from (the error h_gemm's grid adds),
        saturation at h_gemm's grid."""
        if recurrent_operand(p.bits) == "h":
            return h_prev
        q_op = torch.stack(it["h_gemm"])
        op = (q_op - g["h_gemm"][1]).double() * g["h_gemm"][0]
        # the float state entering each step (a padded step's is masked out of every statistic)
        ref = torch.cat([ft["h0"].unsqueeze(0), torch.stack(ft["h"])[:-1]]).double()
        bits = p.bits["h_gemm"]
        self._stat(name, layer, d, "h_gemm").add(ref, op, mask, h_prev, q_op, bits, _edges(*g["h_gemm"], bits))
        return op

    def report(self, batches: int) -> CompareReport:
        rows = []
        configs = {}
        for name, (f, q) in self.pairs.items():
            configs[name] = f"{q.qconfig.name} ({q.qconfig.scale_mode}), {q.num_layers} layer(s) x {q.num_directions} direction(s)"
            p0 = q._qparams[0][0]
            keys = [(name, layer, d, t) for layer in range(q.num_layers)
                    for d in (("fwd", "rev") if q.bidirectional else ("fwd",)) for t in ROW_ORDER]
            keys.append((name, None, None, "output"))
            for key in keys:
                s = self.stats.get(key)
                if s is None:
                    continue
                t = key[3]
                bits = p0.bits["h"] if t in ("h_n", "output") else p0.bits[t]
                rows.append({
                    "module": name, "layer": key[1], "direction": key[2], "tensor": t, "bits": bits,
                    "sqnr_db": sqnr_db(s.ref2, s.err2), "cosine": s.cosine(), "max_abs_err": s.max_abs,
                    "own_sqnr_db": sqnr_db(s.own_ref2, s.own_err2) if s.has_own else None,
                    "saturation": None if s.sat is None else (s.sat / s.n if s.n else 0.0),
                    "saturated": s.sat, "numel": s.n, "steps_sqnr_db": s.steps_sqnr(),
                    "range_needed": s.need if t in CALIBRATED else None,
                    "headroom": q.qconfig[t].headroom if t in CALIBRATED else None,
                    "observer": _observer_name(q.qconfig) if t in CALIBRATED else None,
                    "calib_clip": _calib_clip(q, key[1], key[2], t) if t in CALIBRATED else None,
                    "calib_sqnr_db": _calib_sqnr(q, key[1], key[2], t) if t in CALIBRATED else None,
                    "grid": (_grid(q._qparams[key[1]][("fwd", "rev").index(key[2])], t)
                             if t in ("x", "h", "h_gemm") and key[1] is not None else None),
                    "scale_mode": q.qconfig.scale_mode,
                    "x_levels_widest": (2.0 ** (int(q._qparams[0][0].x_levels.exponent[-1]) / 4)
                                        if t == "x" and key[1] == 0 and q._qparams[0][0].x_levels is not None
                                        else None),
                    "above_level0": (s.above0 / s.tokens if s.above0 is not None and s.tokens else
                                     (0.0 if s.above0 is not None else None)),
                })
        return CompareReport(rows=rows, batches=batches, configs=configs)


def compare(float_model: nn.Module, quant_model: nn.Module, batches: Iterable,
            verbose: bool = True, progress: Optional[bool] = None) -> CompareReport:
    """Per GRU layer, direction, time step and gate: how far the quantized model is from the float one.

    ``float_model``: the float original; ``quant_model``: quantize_model()'s result (or a bare
    nn.GRU and its converted QuantGRU). ``batches``: an iterable of model inputs, called as in
    calibrate() (tuple/list -> ``model(*batch)``). Both models run in eval mode without gradients
    (their modes are restored). Prints the table when ``verbose``; shows a progress bar when
    ``progress`` (default: when there are more than 3 batches or their number is unknown).
    Returns a CompareReport (``.rows``, ``.worst()``, ``str()``). See the module docstring for what
    each column means and how the inner tensors' scales are recovered.
    """
    pairs = _pairs(float_model, quant_model)
    total = len(batches) if hasattr(batches, "__len__") else None
    if progress is None:
        progress = total is None or total > 3
    calls: Dict[str, Dict[str, List]] = {"q": {n: [] for n in pairs}, "f": {n: [] for n in pairs}}

    def hook(store, name):
        def fn(module, args, kwargs, output):
            inp = args[0] if args else kwargs.get("input")
            hx = args[1] if len(args) > 1 else kwargs.get("hx")
            store[name].append((inp, hx, output))
        return fn

    handles = []
    for name, (f, q) in pairs.items():
        handles.append(q.register_forward_hook(hook(calls["q"], name), with_kwargs=True))
        handles.append(f.register_forward_hook(hook(calls["f"], name), with_kwargs=True))
    modes = {m: m.training for model in (float_model, quant_model) for m in model.modules()}
    comparer = _Comparer(pairs)
    seen = 0
    try:
        float_model.eval()
        quant_model.eval()
        with torch.no_grad():
            for batch in tqdm(batches, total=total, desc="qgru compare", unit="batch", disable=not progress):
                for store in calls.values():
                    for v in store.values():
                        v.clear()
                _call(quant_model, batch)
                _call(float_model, batch)
                for name in pairs:
                    qc, fc = calls["q"][name], calls["f"][name]
                    if len(qc) != len(fc):
                        raise RuntimeError(f"compare(): GRU {_mod(name)!r} ran {len(qc)} time(s) in quant_model but "
                                           f"{len(fc)} in float_model for batch {seen}")
                    for a, b in zip(qc, fc):
                        comparer.call(name, a, b)
                seen += 1
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    if seen == 0:
        raise ValueError("compare(): the batches iterable was empty")
    report = comparer.report(seen)
    if not any(r["tensor"] != "W" and r["tensor"] != "R" for r in report.rows):
        raise ValueError("compare(): no GRU of quant_model ran on these batches")
    _warn_input_clipping(report)
    if verbose:
        print(report)
    return report


def _warn_input_clipping(report: CompareReport) -> None:
    """A CalibrationWarning per GRU whose layer-0 input x saturated on more than X_CLIP_WARN of its
    elements in the compared batches: those inputs lie beyond the range calibration saw (with x
    levels: beyond the widest level, 8x that range; what the lower levels hold is not clipping)."""
    for r in report.rows:
        if r["tensor"] != "x" or r["layer"] != 0 or not r["saturation"] or r["saturation"] <= X_CLIP_WARN:
            continue
        need = r.get("range_needed")
        widen = f" (they need a range {need:.2g}x as wide)" if need and need > 1 else ""
        widest = r.get("x_levels_widest")
        if widest:  # x levels: only the widest clips; more range is recalibration (or a headroom)
            headroom = math.ceil(need * r["headroom"] * 11) / 10 if need and need > 1 else 2.0
            warnings.warn(f"compare(): GRU {_mod(r['module'])!r}: {100 * r['saturation']:.2f}% of its input x "
                          f"({r['direction']}) lies beyond its widest x level ({widest:g}x its calibrated range)"
                          f"{widen}, more than {100 * X_CLIP_WARN:g}%: these batches reach far beyond what "
                          f"calibration saw and those values saturate. Calibrate on data that spans the inputs the "
                          f"model will get, or widen every level: overrides={{'tensors': {{'x': {{'headroom': "
                          f"{headroom:g}}}}}}} (README, \"Inputs beyond the calibration range\")",
                          CalibrationWarning, stacklevel=3)
            continue
        headroom = max(4.0, math.ceil(need * 11) / 10) if need and need > 1 else 4.0
        warnings.warn(f"compare(): GRU {_mod(r['module'])!r}: {100 * r['saturation']:.2f}% of its input x "
                      f"({r['direction']}) lies beyond its calibrated grid{widen}, more than "
                      f"{100 * X_CLIP_WARN:g}%: these batches reach beyond what calibration saw and those values "
                      f"saturate. Calibrate on data that spans the inputs the model will get, or quantize x per "
                      f"token on x levels (8 bits, up to 8x the calibrated range; not for the C export): "
                      f"overrides={{'tensors': {{'x': {{'dynamic': True}}}}}}, or x in 16 bits over a wider range: "
                      f"overrides={{'tensors': {{'x': {{'bits': 16, 'headroom': {headroom:g}}}}}}} (README, "
                      f"\"Inputs beyond the calibration range\")", CalibrationWarning, stacklevel=3)
