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


class WeightRoundingWarning(UserWarning):
    """weight_rounding "gptq" rounds a weight matrix to nearest instead: its operand (e.g. a
    one-hot or bag-of-words input x) is wider than the config's gptq_max_size, whose K x K second
    moment calibration does not collect (docs/spec.md section 8, "Weight rounding")."""


class WeightRoundingMemoryError(MemoryError, RuntimeError):
    """weight_rounding "gptq" could not allocate an operand's K x K float64 second moment (during
    calibration) or its factors (at convert()). A RuntimeError too, as torch's allocator error is."""


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure: torch's CPU allocator raises a RuntimeError ("can't
    allocate memory"), its CUDA one torch.OutOfMemoryError, Python a MemoryError."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e)


class DistributedCalibrationError(RuntimeError):
    """Calibration statistics could not be reduced across torch.distributed ranks: the ranks hold
    different models (structure, config, observer, scale mode or float weights), no rank saw data,
    or a collective failed (a rank that did not call it, or died). Raised on every rank alike where
    the ranks could compare (qgru/distributed.py)."""


class ShardedWeightError(TypeError):
    """convert() (or convert_qat) was given sharded weights (torch.distributed DTensors, e.g. under
    FSDP2): integer parameters are derived from whole weight matrices; unshard them first."""
