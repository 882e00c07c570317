"""qgru: a quantized, integer-only drop-in replacement for torch.nn.GRU."""
from .backends import backend, backends
from .calibrate import calibrate, prepare_model, quantize_model
from .compare import CompareReport, compare
from .config import QuantConfig, TensorSpec
from .convert import RescaleError
from .export import ParamsFileError, QuantParams, load_params
from .native import cuda_nan_seen
from .module import CalibrationWarning, QGRUDtypeError, QGRUInputError, QuantGRU
from .errors import (DistributedCalibrationError, ShardedWeightError, WeightRoundingMemoryError,
                     WeightRoundingWarning)
from .distributed import sync_calibration
from . import ops as _ops  # torch.ops.qgru.integer_gru's Python parts (registered when a model is converted)
from .onnx_export import export_onnx
from .onnx_graph import ONNXExportError
from .observers import NonFiniteCalibrationError, NonFiniteWeightError
from .qat import convert_qat, prepare_qat
from .summary import GRUSummary, Summary, summary
from .weight_only.format import WeightOnlyConfig, WeightOnlyError, WeightOnlyFileError
from .weight_only.module import WeightOnlyGRU

__version__ = "0.1.0"
__all__ = ["QuantGRU", "QuantConfig", "TensorSpec", "QuantParams", "calibrate", "quantize_model", "prepare_model",
           "prepare_qat", "convert_qat",
           "load_params", "backends", "backend", "compare", "CompareReport", "NonFiniteCalibrationError",
           "NonFiniteWeightError", "CalibrationWarning", "ParamsFileError", "QGRUInputError", "QGRUDtypeError",
           "cuda_nan_seen", "RescaleError", "summary", "Summary", "GRUSummary", "export_onnx", "ONNXExportError",
           "WeightOnlyGRU", "WeightOnlyConfig", "WeightOnlyError", "WeightOnlyFileError",
           "WeightRoundingWarning", "WeightRoundingMemoryError", "sync_calibration", "DistributedCalibrationError",
           "ShardedWeightError", "__version__"]
