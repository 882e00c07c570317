"""The weight-only mode (seed 003; docs/weight_only.md): GRU weights packed at 2, 4 or 8
bits in groups, activations and gates in floating point. One package:

* format.py: configs, the storage of one matrix, the file format (read with qgru.export's loader)
* quantize.py: the grids and codes of one matrix (range search, GPTQ, coordinate descent)
* golden.py: the golden forward, the definition every path is tested against
* cpu.py: the CPU kernel's binding (csrc/cpu/wo_kernel.cpp, built on first use)
* triton_kernels.py: the CUDA kernels (Triton)
* module.py: WeightOnlyGRU, quantize_model's weight-only walk

The names below are re-exported so that ``from qgru import weight_only as wo; wo.quantize_weight``
works as before the package; qgru itself exports WeightOnlyGRU, WeightOnlyConfig, WeightOnlyError
and WeightOnlyFileError.
"""
from .format import (BUILTIN_WO_CONFIGS, FORMAT, FORMAT_VERSION, WO_BITS, WO_DTYPES, WO_ROUNDINGS, PackedWeight,
                     WeightOnlyConfig, WeightOnlyError, WeightOnlyFileError, WOLayer, check_bias, check_weight,
                     dequantize, from_dict, groups_of, is_weight_only, load_file, pack_codes, save, to_dict,
                     unpack_codes, weight_bytes)
from .golden import golden_forward
from .quantize import (DAMP, SEARCH_SHRINK, _descend, damped, group_params,
                       product_error, quantize_weight)
from .module import NATIVE_MAX_BATCH, NO_COMPILE, WeightOnlyGRU, quantize_model_weight_only, second_moments
