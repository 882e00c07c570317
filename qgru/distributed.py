"""Calibration across torch.distributed ranks: the statistics of every rank reduced into one.

``sync_calibration(model, group)`` (called on every rank of ``group``) reduces the calibration
statistics of every calibrated QuantGRU in ``model``: afterwards each rank holds what one process
calibrating on all ranks' data would hold (histograms and zero counts summed on common bins, exact
extremes, min/max for ``minmax``, the mean over ranks that saw data for ``ema``/``ema_step``, the
gptq second moments summed), and ``convert()`` on any one rank runs with no collective at all.
``QuantGRU.convert()``, ``start_qat()``, ``quantize_model`` and ``prepare_qat`` call it when a process
group of more than one rank is running and the statistics were not reduced yet.

Order of the collectives (the same on every rank, whatever its data):

1. one ``all_gather`` of a fixed-size int64 fingerprint: a hash per field (structure, config,
   observer, scale mode, float weights, calibration state, statistics layout). If any field
   differs, or a rank could not prepare its statistics, every rank raises the same
   DistributedCalibrationError naming the fields and which ranks hold what (their descriptions
   come from one ``all_gather_object``), before any statistic is reduced. Equal fingerprints
   also mean equal tensor sizes below, so no collective can mismatch.
2. one MAX reduction (float64): every observer's extremes, histogram exponents, minmax ranges;
3. one SUM reduction (int64): counts, calls, the histograms rebinned to the common exponents,
   zero counts, the ranks that saw data;
4. one SUM reduction (float64): the ema ranges, the gptq second moments.

Each reduction flattens its tensors into one (in buckets of at most _BUCKET elements, so a huge
second moment does not need a second copy of everything). The tensors travel on the device the
group reduces: the CPU when its backend has one (gloo), else the backend's device (``nccl``:
the current CUDA device), and come back to the CPU, where convert() reads them. A rank whose shard
was empty joins with no data (the other ranks' data decide); no rank with data at all is the
same error on every rank. A failing collective (a rank that never called it, or died) becomes a
DistributedCalibrationError saying so.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .errors import DistributedCalibrationError
from .observers import _EXP_NONE, HISTOGRAM_KINDS, Observer, SecondMoment, rebin_counts

_CPU = torch.device("cpu")
_BUCKET = 1 << 23  # elements per reduction (64 MB of float64); a larger tensor is reduced alone
_FIELDS = ("preparing the statistics", "QuantGRU modules", "structure", "config", "observer", "scale mode",
           "float weights", "calibration state", "statistics layout")
_MAGIC = 0x71677275  # "qgru": the fingerprint's first entry
_HOW = ("every rank of the process group must call it (convert(), quantize_model, prepare_qat or "
        "qgru.sync_calibration); to convert on one rank only, call qgru.sync_calibration(model) on every rank "
        "first, then convert(sync=False) on that rank")


def running(group=None) -> bool:
    """Whether a torch.distributed process group of more than one rank is running (``group``, or
    the default one)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1


def comm_device(group=None) -> torch.device:
    """The device whose tensors ``group`` reduces: the CPU when the group has a CPU backend (gloo,
    mpi, ucc), else its backend's device (nccl: the current CUDA device)."""
    import torch.distributed as dist
    pg = group if group is not None else dist.group.WORLD
    types = [d.type for d in getattr(pg, "_device_types", None) or []]
    backend = str(dist.get_backend(pg)).lower()
    if not types:  # (older torch) read the backend's name: "nccl", "gloo", "cpu:gloo,cuda:nccl"
        for part in backend.split(","):
            dev, _, name = part.rpartition(":")
            types.append(dev or ("cuda" if name == "nccl" else "cpu"))
    if "cpu" in types:
        return _CPU
    kind = types[0]
    mod = getattr(torch, kind, None)
    if mod is None or not mod.is_available():
        raise DistributedCalibrationError(
            f"qgru distributed calibration: the process group's backend {backend!r} reduces only {kind} tensors, "
            f"but {kind} is not available in this process; use a group with a CPU backend (gloo)")
    return torch.device(kind, mod.current_device())


# ---- the fingerprint ------------------------------------------------------------------------------
def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _weights_digest(g) -> str:
    h = hashlib.sha256()
    for name, p in sorted(g.named_parameters(recurse=False)):
        t = p.detach()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        if type(t).__name__ == "DTensor":  # a shard per rank: its layout is compared, not its values
            h.update(f"DTensor {getattr(t, 'placements', '')}".encode())
            continue
        h.update(t.to(device=_CPU, dtype=torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def _layout(observers: Sequence[Observer], moments: Sequence[SecondMoment]) -> str:
    """What the reductions' tensors are made of (equal layouts: equal sizes in every collective)."""
    kinds: Dict[str, int] = {}
    for o in observers:
        k = f"{o.kind} {f'{o.channels} channels' if o.channels else 'per tensor'}"
        kinds[k] = kinds.get(k, 0) + 1
    obs = ", ".join(f"{n} {k}" for k, n in kinds.items())
    mom = ", ".join(f"{m.size}x{m.size}" for m in moments)
    order = _hash63(";".join(f"{o.kind}/{o.channels}/{o.half_bins}" for o in observers) + mom)
    return f"{len(observers)} observer(s) ({obs or 'none'}), {len(moments)} moment(s) ({mom or 'none'}), order {order:x}"


def _state(g) -> str:
    if g.is_converted:
        return "converted"
    if g.is_qat:
        return "in QAT mode (grids frozen)"
    if g._observers is None:
        return "not calibrated"
    done = all(o._synced for obs in g._observers.values() for o in obs.values())
    return "calibrated, reduced already" if done else "calibrated"


def model_fields(named: Sequence[Tuple[str, nn.Module]]) -> Dict[str, str]:
    """The fingerprint fields of the QuantGRUs ``named`` ((path, module) pairs): what must be equal on
    every rank for their statistics to be reduced and converted to the same parameters."""
    out = {f: [] for f in _FIELDS[2:]}
    for path, g in named:
        q = g.qconfig
        settings = {k: v for k, v in q.to_dict().items() if k not in ("observer", "scale_mode")}
        o = q.observer
        out["structure"].append(f"input_size={g.input_size}, hidden_size={g.hidden_size}, num_layers={g.num_layers}, "
                                f"bidirectional={g.bidirectional}, bias={g.bias}")
        out["config"].append(f"{q.name!r} (settings {_hash63(repr(sorted(settings.items()))):x})")
        out["observer"].append(f"{o.kind!r} (momentum {o.momentum}, percentile {o.percentile})")
        out["scale mode"].append(repr(q.scale_mode))
        out["float weights"].append(f"sha256 {_weights_digest(g)}")
        out["calibration state"].append(_state(g))
        obs, mom = _statistics([g])
        out["statistics layout"].append(_layout(obs, mom))
    many = len(named) > 1
    fields = {f: "; ".join(f"{p or 'model'}: {v}" if many else v for (p, _), v in zip(named, vals))
              for f, vals in out.items()}
    fields["QuantGRU modules"] = f"{len(named)}: " + ", ".join(repr(p or type(g).__name__) for p, g in named)
    return fields


def _check_fingerprint(fields: Callable[[], Dict[str, str]], group, world: int, device: torch.device,
                       who: str) -> None:
    """Collective 1: all_gather the fingerprint; every rank raises the same error on a difference."""
    import torch.distributed as dist
    try:
        mine = {"preparing the statistics": "ok", **fields()}
    except Exception as e:  # raised after the exchange, on every rank: never alone (the others would hang)
        mine = {"preparing the statistics": f"failed: {type(e).__name__}: {e}"}
    fp = torch.tensor([_MAGIC] + [_hash63(mine.get(f, "-")) for f in _FIELDS], dtype=torch.int64, device=device)
    got = [torch.empty_like(fp) for _ in range(world)]
    _collective(lambda: dist.all_gather(got, fp, group=group), "fingerprint all_gather", group, who)
    table = torch.stack(got).to(_CPU)
    differ = [i for i in range(table.shape[1]) if bool((table[:, i] != table[0, i]).any())]
    if not differ:
        return
    descs: List[Optional[Dict[str, str]]] = [None] * world
    try:  # every rank saw the same table, so every rank is here: the descriptions, for the message
        dist.all_gather_object(descs, mine, group=group)
    except Exception:  # noqa: BLE001 (the message then names hashes, not values)
        descs = [None] * world
    lines = []
    for i in differ:
        f = "qgru version" if i == 0 else _FIELDS[i - 1]
        groups: Dict[int, List[int]] = {}
        for r in range(world):
            groups.setdefault(int(table[r, i]), []).append(r)
        parts = []
        for h, ranks in groups.items():
            d = descs[ranks[0]]
            val = d.get(f, "-") if d is not None else f"hash {h:x}"
            parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {val}")
        lines.append(f"{f}: " + "; ".join(parts))
    failed = 0 in differ or 1 in differ
    raise DistributedCalibrationError(
        f"{who}: the {world} ranks of the process group "
        + ("could not all prepare their calibration statistics" if failed else "disagree")
        + " (nothing was reduced): " + " | ".join(lines)
        + ("" if failed else ". Every rank must reduce the same statistics: calibrate the same model (same "
           "structure, config, observer, scale mode and float weights) and reduce it once, so that every rank "
           "converts to the same parameters"))


def _collective(fn, what: str, group, who: str):
    try:
        return fn()
    except DistributedCalibrationError:
        raise
    except Exception as e:  # a timeout, a reset connection, a backend without this device
        import torch.distributed as dist
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        raise DistributedCalibrationError(
            f"{who}: the torch.distributed {what} of the calibration statistics failed on rank {rank} of {world} "
            f"({type(e).__name__}: {e}). qgru reduces the statistics with collectives: {_HOW}. A rank that "
            "failed or exited earlier (an error in its calibration) shows up here as a timeout or a reset "
            "connection") from e


# ---- the reductions -----------------------------------------------------------------------------
def _all_reduce(parts: List[torch.Tensor], op, dtype, device, group, who: str, what: str) -> List[torch.Tensor]:
    """Reduce every tensor of ``parts`` with ``op``, flattened into as few collectives as buckets of
    _BUCKET elements allow; the results come back on the CPU, in the parts' shapes."""
    import torch.distributed as dist
    out: List[torch.Tensor] = []
    i = 0
    while i < len(parts):
        j, n = i, 0
        while j < len(parts) and (j == i or n + parts[j].numel() <= _BUCKET):
            n += parts[j].numel()
            j += 1
        chunk = parts[i:j]
        flat = torch.cat([p.reshape(-1).to(device=device, dtype=dtype) for p in chunk])
        _collective(lambda: dist.all_reduce(flat, op=op, group=group), what, group, who)
        flat = flat.to(_CPU)
        k = 0
        for p in chunk:
            out.append(flat[k:k + p.numel()].reshape(p.shape))
            k += p.numel()
        i = j
    return out


def _statistics(grus) -> Tuple[List[Observer], List[SecondMoment]]:
    """Every observer and second moment of ``grus``, in an order that is the same on every rank."""
    obs: List[Observer] = []
    mom: List[SecondMoment] = []
    for g in grus:
        if g._observers is None or g.is_qat or g.is_converted:
            continue
        for key in sorted(g._observers):
            obs.extend(g._observers[key][n] for n in sorted(g._observers[key]))
        for key in sorted(g._moments):
            mom.extend(g._moments[key][n] for n in sorted(g._moments[key]))
    return obs, mom


def reduce_statistics(observers: Sequence[Observer], moments: Sequence[SecondMoment], group=None,
                      fields: Optional[Callable[[], Dict[str, str]]] = None, who: str = "qgru") -> None:
    """Reduce ``observers`` and ``moments`` over the ranks of ``group`` (every rank calls this with
    the same statistics layout; ``fields`` adds the model's fingerprint fields). A no-op without a
    process group of more than one rank, or when every rank reduced them already."""
    import torch.distributed as dist
    if not running(group):
        return
    world = dist.get_world_size(group)
    device = comm_device(group)

    def all_fields() -> Dict[str, str]:
        for o in observers:  # (inside: an error here is reported on every rank)
            o._flush()
            o._to_cpu()
        done = [o._synced for o in observers] + [m._synced for m in moments]
        f = dict(fields()) if fields is not None else {}
        f.setdefault("statistics layout", _layout(observers, moments))
        f.setdefault("calibration state", "reduced already" if done and all(done) else
                     "partly reduced" if any(done) else "not reduced")
        return f

    _check_fingerprint(all_fields, group, world, device, who)
    if all(o._synced for o in observers) and all(m._synced for m in moments):
        return  # reduced already, on every rank (the fingerprint says so)
    big = torch.finfo(torch.float64).max
    ema = [o for o in observers if o.kind not in HISTOGRAM_KINDS and o.kind != "minmax"]
    mm = [o for o in observers if o.kind == "minmax"]

    def full(o: Observer, v: float, dtype=torch.float64) -> torch.Tensor:
        return torch.full((o.channels or 1,), v, dtype=dtype, device=_CPU)

    def flat(t: Optional[torch.Tensor], o: Observer, missing: float) -> torch.Tensor:
        return full(o, missing) if t is None else t.reshape(-1).to(dtype=torch.float64)

    # 2. MAX: extremes (min as the max of -v), histogram exponents, minmax ranges
    maxed = []
    for o in observers:
        maxed += [-flat(o.seen_min, o, big), flat(o.seen_max, o, -big),
                  flat(None if o.exp is None else o.exp.double(), o, float(_EXP_NONE))]
    for o in mm:
        maxed += [-flat(o.min, o, big), flat(o.max, o, -big)]
    maxed = _all_reduce(maxed, dist.ReduceOp.MAX, torch.float64, device, group, who, "MAX reduction")
    # 3. SUM (int64): counts, calls, histograms on the common bins, zero counts, ranks with data
    summed, exps = [], []
    for i, o in enumerate(observers):
        exp = maxed[3 * i + 2].round().to(torch.int64)
        C, B2 = o.channels or 1, 2 * o.half_bins
        if o.hist is None:
            hist = torch.zeros(C, B2, dtype=torch.int64, device=_CPU)
        else:
            hist = rebin_counts(o.hist, o.exp, exp, o.half_bins)
        zeros = o.zeros if o.zeros is not None else torch.zeros(C, dtype=torch.int64, device=_CPU)
        exps.append(exp)
        summed += [torch.tensor([o.count, o.calls], dtype=torch.int64, device=_CPU), hist, zeros]
    ranged = mm + ema  # their ranks with a range (min/max), then the moments' counts
    summed += [torch.tensor([int(o.min is not None) for o in ranged] + [m.count for m in moments],
                            dtype=torch.int64, device=_CPU)]
    summed = _all_reduce(summed, dist.ReduceOp.SUM, torch.int64, device, group, who, "SUM reduction")
    # 4. SUM (float64): the ema ranges of the ranks that saw data, the second moments
    floats = []
    for o in ema:
        floats += [flat(o.min, o, 0.0), flat(o.max, o, 0.0)]
    for m in moments:
        floats.append(m.sum.reshape(-1) if m.sum is not None else
                      torch.zeros(m.size * m.size, dtype=torch.float64, device=_CPU))
    floats = _all_reduce(floats, dist.ReduceOp.SUM, torch.float64, device, group, who, "SUM reduction")
    # every rank holds the same sums: an observer no rank fed is the same error everywhere
    for i, o in enumerate(observers):
        count, calls = (int(v) for v in summed[3 * i])
        if count == 0:
            raise DistributedCalibrationError(
                f"{who}: observer {o.name!r} saw no data on any of the {world} ranks ({calls} calibration "
                "batch(es) in all, none holding values): every rank's calibration shard was empty; calibrate "
                "with data on at least one rank")
    flags = summed[-1]
    for i, o in enumerate(observers):
        shape = (o.channels,) if o.channels else ()
        count, calls = (int(v) for v in summed[3 * i])
        o.seen_min, o.seen_max = -maxed[3 * i].reshape(shape), maxed[3 * i + 1].reshape(shape)
        o.hist, o.exp, o.zeros = summed[3 * i + 1].clone(), exps[i], summed[3 * i + 2].clone()
        o.count, o.calls = count, calls
        o._synced = True
    base = 3 * len(observers)
    for i, o in enumerate(ranged):
        shape = (o.channels,) if o.channels else ()
        ranks = int(flags[i])
        if ranks == 0:  # values observed, but no call closed (end_call) on any rank: no range yet
            o.min = o.max = None
        elif o.kind == "minmax":
            o.min, o.max = -maxed[base + 2 * i].reshape(shape), maxed[base + 2 * i + 1].reshape(shape)
        else:  # the mean of the moving averages of the ranks that saw data
            j = 2 * (i - len(mm))
            o.min, o.max = (floats[j] / ranks).reshape(shape), (floats[j + 1] / ranks).reshape(shape)
    for i, m in enumerate(moments):
        m.sum = floats[2 * len(ema) + i].reshape(m.size, m.size).clone()
        m.count = int(flags[len(ranged) + i])
        m._synced = True


def _named_grus(model: nn.Module):
    from .module import QuantGRU
    return [(p, m) for p, m in model.named_modules() if isinstance(m, QuantGRU)]


def sync_grus(named, group=None, who: str = "qgru.sync_calibration") -> None:
    """reduce_statistics of the QuantGRUs ``named`` ((path, module) pairs), fingerprinted."""
    obs, mom = _statistics([g for _, g in named])
    reduce_statistics(obs, mom, group, lambda: model_fields(named), who)


def sync_calibration(model: nn.Module, group=None) -> nn.Module:
    """Reduce the calibration statistics of every calibrated QuantGRU in ``model`` over the ranks of
    ``group`` (default: the default process group); call it on every rank of the group, after
    qgru.calibrate and before convert. Afterwards every rank holds what one process calibrating on
    all ranks' data would, and ``convert()`` (or quantize_model's conversion) on any one rank runs
    without a collective: e.g. calibrate on every rank, sync_calibration on every rank, then
    convert and save on rank 0 alone (``convert(sync=False)`` says that it must not reduce).

    Before reducing anything the ranks compare a fingerprint of each QuantGRU (structure, config,
    observer, scale mode, float weights, calibration state): if they differ, every rank raises the
    same qgru.DistributedCalibrationError naming what differs on which ranks. A rank whose shard
    was empty joins with no data; if no rank saw data, every rank raises. Without a process group
    of more than one rank this does nothing. Returns ``model``."""
    named = _named_grus(model)
    if not running(group):
        return model
    sync_grus(named, group, "qgru.sync_calibration()")
    todo = [g for _, g in named if g._observers is not None and not g.is_qat and not g.is_converted]
    if not todo:  # (every rank has the same states: the fingerprint compared them)
        raise ValueError("qgru.sync_calibration(): the model holds no calibrated, unconverted QuantGRU; run "
                         "qgru.calibrate(model, batches) on every rank first")
    return model
