"""The exceptions and warning a QuantGRU raises for its callers' inputs and calibration (layer 0:
they import nothing of qgru, so that every layer can raise them). qgru.module and qgru re-export them."""


class QGRUInputError(RuntimeError, ValueError):
    """An input or h0 that torch.nn.GRU refuses too (shape, sequence length, device): a
    RuntimeError, as nn.GRU raises for these, so that code catching nn.GRU's errors still works
    (and a ValueError, as qgru raised before)."""


class QGRUDtypeError(TypeError, ValueError, RuntimeError):
    """An input or h0 of the wrong dtype: torch.nn.GRU raises ValueError for the input's dtype and
    RuntimeError for h0's; qgru raised TypeError before. This is all three."""


def empty_sequence_error(shape) -> QGRUInputError:
    """What a QuantGRU raises for an input of sequence length 0 (eagerly, and in the custom operator
    that torch.export'ed programs run, qgru/ops.py)."""
    return QGRUInputError(f"QuantGRU expects a sequence of at least one step, got an input of shape {tuple(shape)} "
                          "(sequence length 0; torch.nn.GRU refuses it too)")


class CalibrationWarning(UserWarning):
    """convert() found a calibrated range that cannot be right (e.g. every value was 0)."""
