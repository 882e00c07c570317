"""Quantization-aware training: a QuantGRU whose forward *is* the integer GRU, with gradients.

``prepare_qat(model, batches)`` calibrates the QuantGRUs of a copy of ``model`` and puts them in
QAT mode; train it with any optimizer; ``convert_qat(model)`` (or each QuantGRU's ``convert()``)
then freezes the integer model. docs/spec.md section 14 is the contract; in short:

* **Forward values are the golden model's, bit for bit.** Every forward derives the integer
  parameters from the current float weights with convert()'s own code (``QuantGRU._derive_params``:
  the activation grids come from the ranges frozen at prepare_qat, the per-channel weight grids
  follow the weights), runs ``golden.gru_direction`` on them with its trace on, and returns
  ``dequantize(q_out)``. Nothing of the integer arithmetic is re-implemented here, so a change to
  golden.py, the tables or the grid choice carries over to QAT unchanged. Converting the trained
  model derives the same parameters from the same weights, so the converted model's outputs equal
  the QAT model's forward exactly (bound 0, tests/test_qat.py).
* **Gradients are the float GRU's, evaluated at the quantized values.** Alongside the integer run,
  a float64 "surrogate" computes the float GRU op by op (Wx, Rh, r_pre, r, z_pre, z, g_pre, g, h)
  from inputs that carry the golden values; at each point where the integer model rounds,
  saturates or looks up a table, ``_Golden`` replaces the surrogate's value by the golden one and
  passes the gradient straight through (STE), masked to zero where the surrogate lies beyond the
  grid's range (clipped STE: a saturated value does not move with its input). So the gradient of
  a sigmoid / tanh table is the float derivative at the quantized pre-activation, and the
  gradient of a fake-quantized weight reaches the float weight unchanged. With an h_gemm tensor
  (the R.h operand, qgru/config.py) the surrogate's R.h reads h fake-quantized onto h_gemm's
  grid, as the integer GEMM reads the operand, while the state carried to the next step keeps
  h's grid: R's gradient is taken at the operand's values, and h's through R.h is masked where
  the operand's narrower grid clips it. With x levels (config x.dynamic, docs/spec.md section 4b)
  the first layer's x is fake-quantized per token on the level golden chooses for it, and only
  what that level clips (beyond the widest) passes no gradient.

The forward itself (qat_forward, _Golden, _direction) lives in qgru/qat_step.py, below qgru.module,
which calls it; this module, above both, holds the workflow (prepare_qat, convert_qat) and
re-exports those names.
"""
from __future__ import annotations

import copy
from typing import List

from torch import nn

from .calibrate import _calibrate, prepare_model
from .distributed import running, sync_grus
from .module import QuantGRU
from .qat_step import _BOUNDARY, _Golden, _dequant, _direction, _fake, _within, qat_forward  # noqa: F401


def _quant_grus(model: nn.Module) -> List[QuantGRU]:
    return [m for m in model.modules() if isinstance(m, QuantGRU)]


def prepare_qat(model: nn.Module, batches=None, config="w8a8", progress: bool = True, group=None) -> nn.Module:
    """A copy of ``model`` ready for quantization-aware training (``model`` itself is untouched).

    Every torch.nn.GRU in the copy becomes a QuantGRU with ``config`` (as qgru.prepare_model does);
    with ``batches``, every unconverted QuantGRU is calibrated on them (as qgru.calibrate does:
    ``model(*batch)`` for a tuple batch). Without ``batches`` the model's QuantGRUs must be
    calibrated already (qgru.calibrate). Their activation grids are then frozen, and their forward
    becomes the integer GRU's values with straight-through gradients (qgru/qat.py); the weights stay
    float ``nn.Parameter``s, trainable with any optimizer (build it on the returned model's
    parameters). Afterwards ``qgru.convert_qat(model)`` gives the integer model, whose outputs
    equal the QAT model's eval-mode forward exactly. QuantGRUs converted already stay as they are.

    Under torch.distributed every rank of ``group`` calls it (each with its shard of ``batches``):
    the statistics are reduced over the ranks first (qgru.sync_calibration), so every rank freezes
    the same grids. The frozen grids are part of the QAT model's state_dict (keys
    ``_qat_<tensor>_min_l<k>`` / ``_max``): loading a checkpoint into a fresh prepare_qat model
    restores them, so training resumes exactly.
    """
    if batches is None:
        plain = [m for m in model.modules() if isinstance(m, nn.GRU) and not isinstance(m, QuantGRU)]
        if plain:
            raise ValueError(f"prepare_qat(): the model has {len(plain)} torch.nn.GRU module(s) that are not "
                             "calibrated QuantGRUs; pass calibration batches: prepare_qat(model, batches)")
        qmodel = copy.deepcopy(model)
    else:
        qmodel = prepare_model(model, config)  # a deep copy, nn.GRU -> QuantGRU
    todo = [g for g in _quant_grus(qmodel) if not g.is_converted]
    if not todo:
        raise ValueError("prepare_qat(): the model contains no torch.nn.GRU or unconverted QuantGRU to train")
    if batches is not None:
        _calibrate(qmodel, todo, batches, progress)
    else:
        missing = [g for g in todo if g._observers is None and not g.is_qat]
        if missing:
            raise RuntimeError(f"prepare_qat(): {len(missing)} QuantGRU(s) in the model are not calibrated; pass "
                               "calibration batches, prepare_qat(model, batches), or run qgru.calibrate first")
    for g in todo:
        if g.is_qat:
            raise RuntimeError("prepare_qat(): the model is already in QAT mode")
    if running(group):
        where = {id(m): n for n, m in qmodel.named_modules()}
        sync_grus([(where.get(id(g), ""), g) for g in todo], group, "prepare_qat()")
    for g in todo:
        g.start_qat(group=group)
    return qmodel


def convert_qat(model: nn.Module) -> nn.Module:
    """Convert every QuantGRU of a QAT model (prepare_qat) to the integer model, in place, with its
    trained weights and frozen grids; returns ``model``. The converted outputs equal the QAT
    model's eval-mode forward exactly (same weights, same convert() code, same golden integers)."""
    grus = [g for g in _quant_grus(model) if g.is_qat]
    if not grus:
        raise ValueError("convert_qat(): the model has no QuantGRU in QAT mode; make one with "
                         "qgru.prepare_qat(model, batches) (a calibrated model converts with quantize_model)")
    for g in grus:
        g.convert()
    return model
