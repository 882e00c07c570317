"""The native backends: building, loading and feeding the C++/CUDA extension in csrc/.

* ``cpu``  (csrc/qgru_cpu.cpp): always buildable where a C++ compiler is; runs CPU tensors.
* ``cuda`` (csrc/qgru_cuda_kernels.cu + qgru_cuda.cpp): buildable where torch has CUDA and nvcc is
  found; runs CUDA tensors.

Both use the cell functions of csrc/qgru_cell.h and must match the golden model bit for bit.

Building never breaks importing qgru: extensions are compiled on first use (or ahead of time with
``python -m qgru build``) with ``torch.utils.cpp_extension``, into a cache folder whose name
includes the torch version, the Python ABI, a hash of the sources and flags, and the machine;
a failure is recorded and reported by ``qgru.backends()``. A cached binary is loaded only if the
torch version compiled into it equals the running one; otherwise it is refused (and rebuilt).

Environment: ``QGRU_BUILD_DIR`` (cache folder, default ~/.cache/qgru), ``QGRU_NO_BUILD=1``
(never compile; use only a binary built ahead), ``TORCH_CUDA_ARCH_LIST`` (CUDA architectures,
honoured by torch.utils.cpp_extension), ``QGRU_VERBOSE_BUILD=1`` (show compiler output).

The package, by concern (each module imports only those above it in this list):

* ``build``: sources, flags, toolchain probes, the cache folder, compiling and loading
  (``load``, ``why_unavailable``), the cuBLAS link, and the per-LayerParams cache of native
  Layers with what a fork's child drops of it;
* ``prepare``: LayerParams -> the C++ Layer's tensors and values (``prepare_layer``: weight
  limbs, int32-cell eligibility, pow2 and multiplier shift tables);
* ``cpu``: the CPU instruction-set paths (QGRU_CPU_ISA) and the CPU part of making a Layer;
* ``cuda``: the CUDA part of making a Layer, and the CUDA NaN flag;
* ``layer``: ``NativeLayer`` and the backends' ``gru_direction``;
* ``stacks``: a unidirectional stack in one native call (CPU and CUDA plans and forwards).

This module re-exports the names the rest of qgru, the tests and the scripts use. A test that
replaces a module attribute (monkeypatch) patches the submodule that owns the name: the other
submodules read that module's global, not this package's.
"""
from __future__ import annotations

from .build import (_CPU_PATHS, _HEADERS, _KINDS, _SOURCES, _State, _after_fork_in_child, _compile,
                    _cuda_unavailable_reason, _find_binary, _load_built, _native_cache, _toolchain_has_avxvnni,
                    build_dir, build_key, cpu_model_name, csrc_dir, cuda_library_path, find_cublas, library_path, load,
                    why_unavailable)
from .cpu import (cpu_gemm_detail, cpu_isa_request, cpu_layer, cpu_paths, layer_act16, layer_path, one_row_path,
                  resolve_cpu_isa)
from .cuda import cuda_layer, cuda_nan_seen
from .layer import NativeLayer, gru_direction, resolved
from .prepare import (CELL32_BLOCK, CELL32_FIELDS, CUDA_GEMM_MIN, GEMM_PAD, MULT_RESCALES, direct16_fits, limbs16_fits,
                      one_limb_pair, pack_table, prepare_layer)
from .stacks import (_cpu_layer, _cuda_layer, cpu_op_model, cpu_stack_forward, cpu_stack_plan,
                     cuda_stack_plan, stack_levels, stack_values)
