"""Calibration observers: running min/max estimates of activation tensors.

Three kinds (``config.observer.kind``):

* ``minmax``   -- the global min and max of everything seen.
* ``ema``      -- per forward call (one batch) take the batch's min/max, then a moving average
                  across batches: ``min = (1 - c) * min + c * batch_min`` (c = momentum).
* ``ema_step`` -- seed 001's per-time-step EMA: the same average, updated at every time step.

Why a reverse direction never corrupts a forward one: every (layer, direction, tensor) has its own
observer object, so statistics never mix across directions. ``ema_step`` is order dependent (a
reverse direction sees its sequence from the end), but each direction's estimate only depends on
the order in which that direction itself consumes the sequence, which is also the order used at
inference. Padded positions of a PackedSequence are never observed.

Weights have their own observer, ``WeightObserver``: exact per-channel (or per-group, or
per-tensor) max |w| of the frozen float weights, read once at convert(); nothing to average.

If ``torch.distributed`` is initialised, ``sync()`` reduces the statistics across ranks (min of
mins and max of maxes for ``minmax``; the mean over ranks that saw data for the averages) so that
calibration can be spread over processes and every rank converts to the same parameters.
"""
from __future__ import annotations

from typing import Optional

import torch


class NonFiniteCalibrationError(ValueError):
    """A calibration tensor held NaN or Inf."""


class Observer:
    """Tracks min/max of one activation tensor, per tensor or per channel (last dimension)."""

    def __init__(self, name: str, kind: str = "ema", momentum: float = 0.1, channels: int = 0):
        self.name = name
        self.kind = kind
        self.momentum = momentum
        self.channels = channels  # 0: one min/max for the whole tensor
        self.min: Optional[torch.Tensor] = None
        self.max: Optional[torch.Tensor] = None
        self.count = 0  # number of observed values
        self.calls = 0  # number of forward calls (batches) closed by end_call
        self._call_min: Optional[torch.Tensor] = None
        self._call_max: Optional[torch.Tensor] = None

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
        if not torch.isfinite(v).all():
            raise NonFiniteCalibrationError(f"non-finite value (NaN or Inf) in tensor {self.name!r}")
        lo, hi = self._reduce(v)
        self.count += v.numel()
        if self.kind == "ema_step":
            self._fold(lo, hi)
        else:  # minmax and ema collect the call's extremes first
            self._call_min = lo if self._call_min is None else torch.minimum(self._call_min, lo)
            self._call_max = hi if self._call_max is None else torch.maximum(self._call_max, hi)

    def end_call(self) -> None:
        """Close one forward call (one calibration batch)."""
        self.calls += 1
        if self._call_min is not None:
            self._fold(self._call_min, self._call_max)
        self._call_min = self._call_max = None

    def _fold(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if self.min is None:
            self.min, self.max = lo.clone(), hi.clone()
        elif self.kind == "minmax":
            self.min, self.max = torch.minimum(self.min, lo), torch.maximum(self.max, hi)
        else:
            c = self.momentum
            self.min = (1 - c) * self.min + c * lo
            self.max = (1 - c) * self.max + c * hi

    def sync(self) -> None:
        """Reduce the statistics over torch.distributed ranks, when a process group is running."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        shape = (self.channels,) if self.channels else ()
        saw = torch.tensor(1.0 if self.min is not None else 0.0, dtype=torch.float64)  # 0-dim: keeps shapes
        lo = self.min if self.min is not None else torch.zeros(shape, dtype=torch.float64)
        hi = self.max if self.max is not None else torch.zeros(shape, dtype=torch.float64)
        count = torch.tensor(float(self.count), dtype=torch.float64)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        ranks_with_data = saw.clone()
        dist.all_reduce(ranks_with_data, op=dist.ReduceOp.SUM)
        if ranks_with_data.item() == 0:
            return
        if self.kind == "minmax":
            big = torch.finfo(torch.float64).max
            lo = lo if self.min is not None else torch.full(shape, big, dtype=torch.float64)
            hi = hi if self.max is not None else torch.full(shape, -big, dtype=torch.float64)
            lo, hi = lo.clone(), hi.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        else:  # mean of the ranks' moving averages, over ranks that saw data
            lo, hi = lo * saw, hi * saw
            dist.all_reduce(lo, op=dist.ReduceOp.SUM)
            dist.all_reduce(hi, op=dist.ReduceOp.SUM)
            lo, hi = lo / ranks_with_data, hi / ranks_with_data
        self.min, self.max, self.count = lo, hi, int(count.item())

    def range(self):
        """(min, max) as float64 tensors; raises if nothing was observed."""
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
            group = torch.arange(rows) // self.group_size
            group_max = torch.zeros(int(group.max()) + 1, dtype=torch.float64).scatter_reduce(0, group, amax, "amax")
            amax = group_max[group]
        self.amax = amax

    def range(self):
        if self.amax is None:
            raise RuntimeError(f"weight observer {self.name!r} saw no weight")
        return -self.amax, self.amax
