"""Calibration observers: what activation tensors took during calibration.

Five kinds (``config.observer.kind``):

* ``mse`` (default) -- the histogram below; convert() chooses the tensor's grid (scale and zero
                  point, at its bits and scale mode) with the least expected squared error over it:
                  rounding inside the grid, clipping outside (qgru.convert.calibrated_range;
                  docs/spec.md section 8). ``range()`` gives the percentile range, one of the grids
                  it compares.
* ``percentile`` -- a histogram of every value seen; the range keeps all but at most
                  (100 - p)% of the values on each side (``config.observer.percentile`` = p, default
                  99.99), and is never wider than ``minmax``'s.
* ``minmax``   -- the global min and max of everything seen.
* ``ema``      -- per forward call (one batch) take the batch's min/max, then a moving average
                  across batches: ``min = (1 - c) * min + c * batch_min`` (c = momentum).
* ``ema_step`` -- seed 001's per-time-step EMA: the same average, updated at every time step.

The histogram: per channel (or one for a per-tensor observer), 2B bins of width 2^e / B with e the
smallest exponent above every |v| seen (B = HIST_HALF_BINS_TENSOR = 2048 per tensor, where the
search needs resolution and one histogram is cheap; HIST_HALF_BINS = 256 per channel), plus the
count of exact zeros (they lie on every grid: the search must not charge them rounding error).
A larger value widens the bins by merging them exactly, so the histogram is the one binning all
values at the final width would give.

Why data-weighted kinds are the default: an observer must weigh what it has seen by data, not by
calls. ``mse``, ``percentile`` and ``minmax`` see a multiset of values: cutting the same data into
calls any other way (one big batch, or hundreds of 1-step calls carrying the state, as
autoregressive forecasters calibrate) gives the same histogram and range (exactly; a state passed
back as the next call's h0 is seen once more, which moves a percentile by at most a bin). ``ema``
averages one extreme per call, so the newest ~1/c calls decide its range: with many small calls in
time order it forgets most of the data and clips its own calibration data
(tests/test_library_patterns.py: sine series calibrated with 1-step calls, where ema's x range
clips 15% of the data it saw). ``percentile`` ignores the rarest 1e-4 of the values on each side,
which keeps a single outlier from widening an 8-bit grid (with power-of-two scales that is a whole
step: the demo's w8a8 (pow2) loses ~2.5 dB with ``minmax``); with fewer than 10^4 values per side
it equals ``minmax``. ``mse`` instead weighs what clipping a value costs against the rounding error
a wider grid adds to every other value, for this tensor's bits. ``ema`` stays available by name.

Why a reverse direction never corrupts a forward one: every (layer, direction, tensor) has its own
observer object, so statistics never mix across directions. ``ema_step`` is order dependent (a
reverse direction sees its sequence from the end), but each direction's estimate only depends on
the order in which that direction itself consumes the sequence, which is also the order used at
inference. Padded positions of a PackedSequence are never observed.

Weights have their own observer, ``WeightObserver``: exact per-channel (or per-group, or
per-tensor) max |w| of the frozen float weights, read once at convert(); nothing to average.

If ``torch.distributed`` is initialised, ``sync()`` reduces the statistics across ranks (the
histograms and zero counts are summed on common bins, so ``mse`` and ``percentile`` give what one
process would; min of mins
and max of maxes for ``minmax``; the mean over ranks that saw data for the averages) so that
calibration can be spread over processes and every rank converts to the same parameters. The
collectives, their checks and their order are qgru/distributed.py's (qgru.sync_calibration for a
whole model, in one fingerprint exchange and three reductions); a reduced observer is marked
``_synced`` (a second reduction would count every value again) and observes no more values.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from .errors import WeightRoundingMemoryError, is_out_of_memory


class NonFiniteCalibrationError(ValueError):
    """A calibration tensor held NaN or Inf."""


class NonFiniteWeightError(ValueError):
    """A GRU's weight or bias held NaN or Inf while it was calibrated: the model is broken, not the
    calibration data (so it is not a NonFiniteCalibrationError, which calibrate() blames on a batch)."""


HIST_HALF_BINS = 256  # histogram bins on each side of 0, per channel of a per-channel observer
# A per-tensor observer (x, h, the gate pre-activations) holds one histogram, so it can afford 8x
# finer bins: the mse search (qgru.convert) places an 8-bit grid's ends and judges its rounding from
# the bins, and a tensor whose bulk is far narrower than its largest value (one outlier 100x the
# rest) still has its bulk spread over ~20 bins per side instead of ~3.
HIST_HALF_BINS_TENSOR = 2048
_PENDING_LIMIT = 1 << 20  # percentile: values held before they are binned
HISTOGRAM_KINDS = ("percentile", "mse")  # kinds whose statistic is the histogram alone
_CPU = torch.device("cpu")  # where the statistics are read (factories name their device: never the default one)
_EXP_NONE = -1100  # exponent of a channel that saw only zeros: below every double's (2^-1074)


def rebin_counts(hist: torch.Tensor, exp: torch.Tensor, new_exp: torch.Tensor, half_bins: int) -> torch.Tensor:
    """Histogram counts [C, 2B] with bins covering [-2^exp, 2^exp) per row, rebinned (exactly, by
    merging bins) to cover [-2^new_exp, 2^new_exp) (new_exp >= exp); a new tensor."""
    k = (new_exp - exp).clamp(max=62)
    B = half_bins
    i = torch.arange(2 * B, dtype=torch.int64, device=hist.device).unsqueeze(0) - B
    idx = (i >> k.to(hist.device).unsqueeze(1)) + B
    return torch.zeros_like(hist).scatter_add_(1, idx, hist)


def _times_pow2(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """v * 2^e (e int64, broadcast over v's last axis), exact for float64 results in the normal range:
    two steps, so that neither factor overflows for any exponent a double can need."""
    e1 = torch.div(e, 2, rounding_mode="floor")
    return v * torch.pow(2.0, e1.to(torch.float64)) * torch.pow(2.0, (e - e1).to(torch.float64))


class Histogram(NamedTuple):
    """What the calibration data was, as the grid search reads it: per row (a channel, a gate, or the
    whole tensor) ``counts`` [G, 2B] of the nonzero values in bins of ``width`` [G] with edges at
    the multiples of the width (bin j covers [(j - B) width, (j - B + 1) width)), ``zeros`` [G]
    values exactly 0 (any grid holds 0 exactly), and the exact extremes ``lo``, ``hi`` [G]."""
    counts: torch.Tensor
    width: torch.Tensor
    zeros: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


class Observer:
    """Tracks the range of one activation tensor, per tensor or per channel (last dimension).

    Besides its kind's estimate it keeps the exact extremes of everything it saw (``seen_min``,
    ``seen_max``), which convert() records so that qgru.compare can tell when a tensor's grid
    does not contain its own calibration data.
    """

    _synced = False  # (class default: see __init__)

    def __init__(self, name: str, kind: str = "percentile", momentum: float = 0.1, channels: int = 0,
                 percentile: float = 99.99):
        self.name = name
        self.kind = kind
        self.momentum = momentum
        self.percentile = percentile
        self.channels = channels  # 0: one range for the whole tensor
        self.min: Optional[torch.Tensor] = None
        self.max: Optional[torch.Tensor] = None
        self.seen_min: Optional[torch.Tensor] = None
        self.seen_max: Optional[torch.Tensor] = None
        self.count = 0  # number of observed values
        self.calls = 0  # number of forward calls (batches) closed by end_call
        self._call_min: Optional[torch.Tensor] = None
        self._call_max: Optional[torch.Tensor] = None
        self.hist: Optional[torch.Tensor] = None  # percentile: int64 [C, 2B] counts (C = 1 per tensor)
        self.exp: Optional[torch.Tensor] = None   # percentile: int64 [C]; bins cover [-2^exp, 2^exp)
        self._pending: List[torch.Tensor] = []   # percentile: values not binned yet, [rows, C] float64
        self._pending_numel = 0
        self.zeros: Optional[torch.Tensor] = None  # int64 [C]: values exactly 0 (in bin [0, width))
        self.half_bins = HIST_HALF_BINS if channels else HIST_HALF_BINS_TENSOR
        self._synced = False  # reduced over torch.distributed ranks (sync()): holds every rank's values

    def _reduce(self, v: torch.Tensor):
        v = v.detach().double()
        if self.channels:
            v = v.reshape(-1, self.channels)
            return v.amin(0), v.amax(0)
        return v.amin(), v.amax()

    def observe(self, v: torch.Tensor) -> None:
        """Observe one time step's (or one call's) values; rows already restricted to valid ones."""
        if v.numel() == 0:
            return
        if self._synced:
            raise RuntimeError(f"observer {self.name!r} was reduced over torch.distributed ranks already: a "
                               "second reduction would count its values again; start a fresh calibration")
        if not torch.isfinite(v).all():
            raise NonFiniteCalibrationError(f"non-finite value (NaN or Inf) in tensor {self.name!r}")
        self.count += v.numel()
        # every kind keeps the histogram (binned in bulk: it does not depend on how), for its
        # range (percentile) or to count the calibration values its range leaves out (convert())
        self._pending.append(v.detach().double().reshape(-1, self.channels or 1))
        self._pending_numel += v.numel()
        if self._pending_numel >= _PENDING_LIMIT:
            self._flush()
        if self.kind in HISTOGRAM_KINDS:
            return
        lo, hi = self._reduce(v)
        if self.kind == "ema_step":
            self._fold(lo, hi)
        else:  # minmax and ema collect the call's extremes first
            self._call_min = lo if self._call_min is None else torch.minimum(self._call_min, lo)
            self._call_max = hi if self._call_max is None else torch.maximum(self._call_max, hi)

    def _flush(self) -> None:
        if not self._pending:
            return
        # the statistics stay on the data's device while calibrating (binning a GPU model's values
        # on the GPU: no copy to the host), and move to the CPU when read (_to_cpu). Binning is
        # exact integer work, so the histogram is the same on every device for the same values.
        v = torch.cat(self._pending)
        if self.hist is not None:
            v = v.to(self.hist.device)
        self._pending, self._pending_numel = [], 0
        lo, hi = v.amin(0), v.amax(0)
        if not self.channels:
            lo, hi = lo.reshape(()), hi.reshape(())
        zeros = (v == 0).sum(0)
        self.zeros = zeros if self.zeros is None else self.zeros + zeros
        if self.seen_min is None:
            self.seen_min, self.seen_max = lo, hi
        else:
            self.seen_min, self.seen_max = torch.minimum(self.seen_min, lo), torch.maximum(self.seen_max, hi)
        self._hist_add(v)

    def count_outside(self, lo: torch.Tensor, hi: torch.Tensor) -> int:
        """How many observed values lie below ``lo`` or above ``hi`` (scalars, or one per channel),
        counting whole bins only: a lower bound, short by at most the two bins the ends fall in."""
        self._flush()
        self._to_cpu()
        if self.hist is None:
            return 0
        B = self.half_bins
        C = self.hist.shape[0]
        lo = torch.as_tensor(lo, dtype=torch.float64, device=_CPU).reshape(-1).expand(C)
        hi = torch.as_tensor(hi, dtype=torch.float64, device=_CPU).reshape(-1).expand(C)
        width_exp = self.exp - self._log2_b
        i = torch.arange(2 * B, dtype=torch.float64, device=_CPU).unsqueeze(0) - B
        upper = _times_pow2(i + 1, width_exp.unsqueeze(1))  # bin i covers [lower, upper)
        lower = _times_pow2(i, width_exp.unsqueeze(1))
        out = (upper <= lo.unsqueeze(1)) | (lower > hi.unsqueeze(1))
        return int((self.hist * out).sum())

    def end_call(self) -> None:
        """Close one forward call (one calibration batch)."""
        self.calls += 1
        self._flush()
        if self._call_min is not None:
            self._fold(self._call_min, self._call_max)
        self._call_min = self._call_max = None

    def _to_cpu(self) -> None:
        """Move the statistics to the CPU, where convert() and the reports read them."""
        for name in ("hist", "exp", "zeros", "seen_min", "seen_max", "min", "max"):
            t = getattr(self, name)
            if t is not None and t.device != _CPU:
                setattr(self, name, t.to(_CPU))

    def _fold(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if self.min is not None:
            lo, hi = lo.to(self.min.device), hi.to(self.min.device)
        if self.min is None:
            self.min, self.max = lo.clone(), hi.clone()
        elif self.kind == "minmax":
            self.min, self.max = torch.minimum(self.min, lo), torch.maximum(self.max, hi)
        else:
            c = self.momentum
            self.min = (1 - c) * self.min + c * lo
            self.max = (1 - c) * self.max + c * hi

    # ---- percentile: a histogram that is the same however the data is cut into calls -----------
    # Channel c's 2B bins have width 2^exp[c] / B and edges at the multiples of that width, with
    # exp[c] the smallest exponent such that every |v| seen is below 2^exp[c]. A value v lies in
    # bin floor(v B / 2^exp) + B. When a larger value raises exp by k, bin i moves to
    # ((i - B) >> k) + B: floor(floor(y) / 2^k) = floor(y / 2^k), so the merged histogram is exactly
    # the one that binning every value at the new width would give. exp depends only on the largest
    # |v|, so the histogram, and the range read from it, depend only on the values seen: not on how
    # they were cut into calls or time steps, nor on their order.
    @property
    def _log2_b(self) -> int:
        return self.half_bins.bit_length() - 1

    def _hist_add(self, v: torch.Tensor) -> None:
        C = v.shape[1]
        B = self.half_bins
        amax = v.abs().amax(0)
        exp = torch.where(amax > 0, torch.frexp(amax).exponent.to(torch.int64),
                          torch.full_like(amax, _EXP_NONE, dtype=torch.int64))  # amax < 2^exp
        if self.hist is None:
            self.hist = torch.zeros(C, 2 * B, dtype=torch.int64, device=v.device)
            self.exp = exp
        else:
            self._rebin(torch.maximum(self.exp, exp))
        # v * B / 2^exp is exact (a power-of-two scaling); |v| < 2^exp puts it in [-B, B)
        idx = torch.floor(_times_pow2(v, self._log2_b - self.exp)).to(torch.int64)
        idx = idx.clamp(-B, B - 1) + B + torch.arange(C, device=v.device).unsqueeze(0) * (2 * B)
        self.hist += torch.bincount(idx.reshape(-1), minlength=C * 2 * B).reshape(C, 2 * B)

    def _rebin(self, exp: torch.Tensor) -> None:
        """Widen each channel's bins to cover [-2^exp, 2^exp) (exp >= the current one)."""
        if bool((exp == self.exp).all()):
            return
        self.hist = rebin_counts(self.hist, self.exp, exp, self.half_bins)
        self.exp = exp

    def _percentile_range(self):
        """Per channel: the narrowest range of whole bins with at most (100 - percentile)% of the values
        above it and as many below it, clamped to the seen extremes (never wider than minmax)."""
        B = self.half_bins
        h = self.hist
        n = h.sum(1, keepdim=True)
        allowed = torch.floor(n.double() * (100.0 - self.percentile) / 100.0).to(torch.int64)
        # above[i]: values in bins > i; below[i]: values in bins < i
        above = n - h.cumsum(1)
        below = h.cumsum(1) - h
        i = torch.arange(2 * B, dtype=torch.int64, device=_CPU).unsqueeze(0)
        hi_bin = torch.where(above <= allowed, i, torch.full_like(i, 2 * B)).amin(1)
        lo_bin = torch.where(below <= allowed, i, torch.full_like(i, -1)).amax(1)
        width_exp = self.exp - self._log2_b
        hi = _times_pow2((hi_bin - B + 1).to(torch.float64), width_exp)
        lo = _times_pow2((lo_bin - B).to(torch.float64), width_exp)
        seen_lo, seen_hi = self.seen_min.reshape(-1), self.seen_max.reshape(-1)
        lo, hi = torch.maximum(lo, seen_lo), torch.minimum(hi, seen_hi)
        if not self.channels:
            lo, hi = lo.reshape(()), hi.reshape(())
        return lo, hi

    def histogram(self, groups: int = 0) -> "Histogram":
        """The histogram as the mse search reads it (qgru.convert): one row per channel, or per group
        of ``C // groups`` consecutive channels (per_gate: 3 gates of H channels) merged on the
        group's common bins (each channel rebinned to the group's widest, exactly as a later, larger
        value would), or one row for a per-tensor observer."""
        self._flush()
        self._to_cpu()
        if self.hist is None:
            raise RuntimeError(f"observer {self.name!r} saw no data: run qgru.calibrate() with at "
                               "least one batch before convert()")
        hist, exp, zeros = self.hist, self.exp, self.zeros
        seen_lo, seen_hi = self.seen_min.reshape(-1), self.seen_max.reshape(-1)
        if groups and groups != hist.shape[0]:
            C = hist.shape[0]
            g = torch.arange(C, device=_CPU) // (C // groups)
            wide = exp.reshape(groups, -1).amax(1)
            k = (wide[g] - exp).clamp(max=62)
            B = self.half_bins
            i = torch.arange(2 * B, dtype=torch.int64, device=_CPU).unsqueeze(0) - B
            moved = torch.zeros_like(hist).scatter_add_(1, (i >> k.unsqueeze(1)) + B, hist)
            hist = moved.reshape(groups, -1, 2 * B).sum(1)
            exp, zeros = wide, zeros.reshape(groups, -1).sum(1)
            seen_lo, seen_hi = seen_lo.reshape(groups, -1).amin(1), seen_hi.reshape(groups, -1).amax(1)
        counts = hist.double()
        counts[:, self.half_bins] -= zeros.double()  # exact zeros: bin [0, width) holds them
        # a row that saw only zeros has no nonzero count: any positive width reads the same (none)
        width = torch.where(exp == _EXP_NONE, torch.ones_like(exp, dtype=torch.float64),
                            _times_pow2(torch.ones_like(exp, dtype=torch.float64), exp - self._log2_b))
        return Histogram(counts, width, zeros.double(), seen_lo, seen_hi)

    def sync(self, group=None) -> None:
        """Reduce the statistics over the torch.distributed ranks of ``group`` (default: the default
        group), when a process group of more than one rank is running; every rank calls it, with
        observers of the same kind and shape (checked first: qgru/distributed.py)."""
        from .distributed import reduce_statistics
        self._flush()
        self._to_cpu()
        reduce_statistics([self], [], group, who=f"observer {self.name!r} sync()")

    def range(self):
        """(min, max) as float64 tensors; raises if nothing was observed."""
        self._flush()
        self._to_cpu()
        if self.kind in HISTOGRAM_KINDS and self.hist is not None and self.seen_min is not None:
            self.min, self.max = self._percentile_range()
        if self.min is None:
            if self.calls:
                raise RuntimeError(f"observer {self.name!r} saw no data in {self.calls} calibration batch(es): "
                                   "each held no values (batch size 0); calibrate with batches that hold data")
            raise RuntimeError(f"observer {self.name!r} saw no data: run qgru.calibrate() with at "
                               "least one batch before convert()")
        return self.min, self.max


class WeightObserver:
    """Symmetric range of a weight matrix [rows, K] per output row, per group of rows, or per tensor.

    ``range()`` returns (-amax, amax) with one entry per row (groups and the whole tensor are
    expanded to their rows), ready for a per-row scale.
    """

    def __init__(self, name: str, granularity: str = "per_channel", group_size: int = 0):
        self.name = name
        self.granularity = granularity
        self.group_size = group_size
        self.amax: Optional[torch.Tensor] = None

    def observe(self, w: torch.Tensor) -> None:
        w = w.detach().double()
        if not torch.isfinite(w).all():
            raise NonFiniteCalibrationError(f"weight {self.name!r} contains NaN or Inf")
        amax = w.abs().amax(dim=1)
        rows = amax.shape[0]
        if self.granularity == "per_tensor":
            amax = amax.amax().expand(rows)
        elif self.granularity == "per_group":
            group = torch.arange(rows, device=amax.device) // self.group_size
            group_max = torch.zeros(int(group.max()) + 1, dtype=torch.float64,
                                    device=amax.device).scatter_reduce(0, group, amax, "amax")
            amax = group_max[group]
        self.amax = amax

    def range(self):
        if self.amax is None:
            raise RuntimeError(f"weight observer {self.name!r} saw no weight")
        return -self.amax, self.amax


class SecondMoment:
    """E[v v^T] of a GEMM operand (x or h of one layer and direction) over every calibration row:
    the sum of v v^T and the row count, so that it is the same however the data is cut into calls
    (up to float64 rounding). convert() rounds the weights that multiply v with it (config
    ``weight_rounding = "gptq"``, qgru.convert.gptq_round). Reduced over torch.distributed ranks
    by summing, like the histograms."""

    _synced = False  # (class default: see __init__)

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size
        self.count = 0
        self.sum: Optional[torch.Tensor] = None  # float64 [size, size]
        self._synced = False  # reduced over torch.distributed ranks (sync())

    def observe(self, v: torch.Tensor) -> None:
        """Rows v [..., size] (already restricted to valid ones)."""
        v = v.detach().reshape(-1, self.size)
        if v.shape[0] == 0:
            return
        if self._synced:
            raise RuntimeError(f"second moment {self.name!r} was reduced over torch.distributed ranks already; "
                               "start a fresh calibration")
        try:
            v = v.to(dtype=torch.float64)  # on the data's device; read on the CPU (value())
            s = v.t() @ v
            if self.sum is None:
                self.sum = s
            else:
                self.sum += s.to(self.sum.device)  # (in place: no third K x K buffer)
        except RuntimeError as e:
            if not is_out_of_memory(e):
                raise
            k = self.size
            raise WeightRoundingMemoryError(
                f"weight_rounding 'gptq': the {k} x {k} float64 second moment of {self.name} "
                f"({k * k * 8 / 1e9:.3g} GB, twice that while a batch is added) could not be allocated; set the "
                f"config's gptq_max_size below {k} (those weights then round to nearest) or weight_rounding "
                f"'nearest' ({e})") from None
        self.count += v.shape[0]

    def sync(self, group=None) -> None:
        """Sum over the torch.distributed ranks of ``group`` (qgru/distributed.py), when running."""
        from .distributed import reduce_statistics
        reduce_statistics([], [self], group, who=f"second moment {self.name!r} sync()")

    def value(self) -> Optional[torch.Tensor]:
        """E[v v^T] (float64 [size, size]), or None if nothing was observed."""
        return None if self.count == 0 or self.sum is None else self.sum.to(_CPU) / self.count

