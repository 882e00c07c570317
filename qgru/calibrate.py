"""calibrate() and quantize_model(): the user-facing workflow around QuantGRU."""
from __future__ import annotations

import copy
from typing import Dict, Iterable, List, Optional, Union

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from tqdm.auto import tqdm

from .config import QuantConfig
from .distributed import running, sync_grus
from .module import QGRUDtypeError, QGRUInputError, QuantGRU
from .observers import NonFiniteCalibrationError, NonFiniteWeightError
from .weight_only.format import is_weight_only
from .weight_only.module import quantize_model_weight_only


def _quant_grus(model: nn.Module) -> List[QuantGRU]:
    return [m for m in model.modules() if isinstance(m, QuantGRU)]


def calibrate(model: nn.Module, batches: Iterable, progress: bool = True) -> nn.Module:
    """Run ``model`` over ``batches`` with every QuantGRU in it observing its ranges.

    A tuple or list batch is called as ``model(*batch)``, anything else as ``model(batch)``.
    Runs in eval mode and without gradients (the previous mode is restored). Observers start fresh,
    so calling calibrate() again recalibrates from scratch. Returns ``model``.

    Under torch.distributed (a process group of more than one rank) each rank calibrates on its
    own shard, which may be empty (the rank then joins the reduction with no data); convert(),
    or qgru.sync_calibration on every rank, reduces the statistics (qgru/distributed.py).
    """
    grus = _quant_grus(model)
    if not grus:
        raise ValueError("calibrate(): the model contains no qgru.QuantGRU "
                         "(use qgru.quantize_model to swap its nn.GRU modules)")
    converted = [g for g in grus if g.is_converted]
    if converted:
        raise RuntimeError(f"calibrate(): {len(converted)} QuantGRU(s) in the model are already converted; "
                           "calibrate a float model (or a fresh copy) instead")
    return _calibrate(model, grus, batches, progress)


def _calibrate(model: nn.Module, grus: List[QuantGRU], batches: Iterable, progress: bool) -> nn.Module:
    """calibrate() of the QuantGRUs ``grus`` of ``model`` (others in it, converted, run integer)."""
    # a NaN or Inf weight is the model's fault: said here, before it shows up as a non-finite W.x
    # that the batch loop below would blame on the calibration batch
    where = {id(m): n for n, m in model.named_modules()}
    for g in grus:
        for name, p in g.named_parameters(recurse=False):
            if not bool(torch.isfinite(p).all()):
                raise NonFiniteWeightError(
                    f"the model's parameter {name!r} contains NaN or Inf (module {where.get(id(g)) or 'the model'!r}): "
                    f"its GRU weights are broken, not the calibration data; fix or reload the model's weights")
    modes = {m: m.training for m in model.modules()}  # restored one by one, submodules included
    seen = 0
    try:
        model.eval()
        for g in grus:
            g.start_calibration()
        total = len(batches) if hasattr(batches, "__len__") else None
        with torch.no_grad():
            for i, batch in enumerate(tqdm(batches, total=total, desc="qgru calibrate",
                                           unit="batch", disable=not progress)):
                try:
                    # a PackedSequence is a namedtuple, but it is one input, not an argument list
                    if isinstance(batch, (tuple, list)) and not isinstance(batch, PackedSequence):
                        model(*batch)
                    else:
                        model(batch)
                except (NonFiniteCalibrationError, QGRUInputError, QGRUDtypeError) as e:
                    raise type(e)(f"calibration batch {i}: {e}") from None
                seen += 1
    finally:
        for g in grus:
            g.stop_calibration()
        for m, training in modes.items():
            m.training = training
    if seen == 0 and not running():  # (under torch.distributed an empty shard joins with no data)
        raise ValueError("calibrate(): the batches iterable was empty; calibration needs at least one batch")
    return model


def quantize_model(model: nn.Module, batches: Iterable, config: Union[str, dict, QuantConfig] = "w8a8",
                   progress: bool = True, group=None) -> nn.Module:
    """A deep copy of ``model`` with every torch.nn.GRU replaced by a calibrated, converted QuantGRU.

    ``model`` itself is left untouched. ``batches`` is iterated once (see calibrate()). QuantGRUs
    in ``model`` that are converted already are kept as they are (and run integer-only while the
    others calibrate). A subclass of nn.GRU keeps its own forward and methods (see prepare_model);
    its forward must call ``super().forward(...)``, else this raises a TypeError naming the class.

    A weight-only config (``"w4g128"``, ``"w8pc"``, ... or a qgru.WeightOnlyConfig; qgru/weight_only/format.py)
    makes every nn.GRU a qgru.WeightOnlyGRU instead: packed weights, float activations; ``batches``
    then feed only gptq rounding (docs/weight_only.md).

    Under torch.distributed every rank of ``group`` (default: the default group) calls it with its
    own shard of the batches; the statistics of all the model's QuantGRUs are reduced together
    (qgru.sync_calibration) and every rank gets the same converted model.
    """
    if is_weight_only(config):
        return quantize_model_weight_only(model, batches, config, None if progress else False)
    qmodel = prepare_model(model, config)
    # QuantGRUs converted already (e.g. a quantized encoder) stay as they are and run integer-only
    # while the others calibrate: those see the inputs they will see after quantization
    todo = [g for g in _quant_grus(qmodel) if not g.is_converted]
    if not todo:
        raise ValueError("quantize_model(): the model contains no torch.nn.GRU to quantize")
    calls = {}
    handles = [g.register_forward_pre_hook(lambda mod, args: calls.__setitem__(mod, calls.get(mod, 0) + 1))
               for g in todo if type(g) is not QuantGRU]
    try:
        _calibrate(qmodel, todo, batches, progress)
    finally:
        for h in handles:
            h.remove()
    for g, n in calls.items():
        if n and all(o.count == 0 for obs in g._observers.values() for o in obs.values()):
            raise TypeError(
                f"quantize_model(): {type(g).__name__} (a subclass of nn.GRU) was called {n} time(s) during "
                f"calibration, but its forward never reached QuantGRU's: it must run nn.GRU's computation "
                f"through super().forward(...) (calling torch's kernels itself, e.g. _VF.gru or "
                f"nn.GRU.forward(self, ...), bypasses quantization)")
    if running(group):
        where = {id(m): n for n, m in qmodel.named_modules()}
        sync_grus([(where.get(id(g), ""), g) for g in todo], group, "quantize_model()")
    for g in todo:
        g.convert(group=group)
    return qmodel


def prepare_model(model: nn.Module, config: Union[str, dict, QuantConfig] = "w8a8") -> nn.Module:
    """A deep copy of ``model`` with every torch.nn.GRU made a QuantGRU (float mode, same parameters),
    ready to calibrate (what quantize_model does next) or to load a quantized state_dict into.

    A plain nn.GRU becomes a QuantGRU; an instance of a subclass of nn.GRU (a library's own
    ``class GRU(nn.GRU)``) keeps its class's forward and methods: it becomes an instance of
    ``qgru.module.quantized_class(its class)``, which derives from both. ``model`` itself is left
    untouched.
    """
    config = QuantConfig.load(config)
    qmodel = copy.deepcopy(model)
    if isinstance(qmodel, nn.GRU) and not isinstance(qmodel, QuantGRU):
        qmodel = QuantGRU._from_gru(qmodel, config)
    else:
        _swap(qmodel, config)
    if not _quant_grus(qmodel):
        raise ValueError("quantize_model(): the model contains no torch.nn.GRU to quantize")
    return qmodel


def _swap(module: nn.Module, config: QuantConfig, done: Optional[Dict[int, nn.Module]] = None) -> None:
    """Replace every nn.GRU under ``module`` by its QuantGRU. A GRU held under several names (tied:
    ``self.dec = self.enc``, or one module inside two parents) becomes one QuantGRU held under all
    of them, calibrated on every call: named_children() lists a shared module once, which would
    leave its other names holding the float GRU."""
    done = {} if done is None else done  # id(original child) -> what replaces it
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        if id(child) in done:
            setattr(module, name, done[id(child)])
        elif isinstance(child, nn.GRU) and not isinstance(child, QuantGRU):
            done[id(child)] = QuantGRU._from_gru(child, config)
            setattr(module, name, done[id(child)])
        else:
            done[id(child)] = child
            _swap(child, config, done)
