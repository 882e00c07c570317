"""A native Layer (one layer and direction on one backend) and the backends' gru_direction."""
from __future__ import annotations

from typing import Optional

import torch

from ..golden import LayerParams
from .build import _native_cache, load
from .cpu import cpu_isa_request, cpu_layer
from .cuda import cuda_layer


class NativeLayer:
    """One layer and direction on one native backend: the C++ Layer and the tensors it points into.

    ``isa`` (CPU only): the instruction-set path (None: QGRU_CPU_ISA, default "auto", the fastest
    usable one). ``gemm`` says which path the layer took, as the built Layer reports it ("avx2-fused",
    "portable", ...; "-fused": one pass per step; "cublas" on CUDA); ``cell`` (CPU) which cell."""

    def __init__(self, kind: str, p: LayerParams, device: torch.device, isa: Optional[str] = None) -> None:
        mod = load(kind)
        if kind == "cpu":
            self.layer = cpu_layer(mod, p, isa)
        else:
            self.layer = cuda_layer(mod, p, device)
        self.kind = kind
        # what the built Layer reports (no default here: a Layer without it is a build mismatch,
        # and the tests' check of the path must see what the extension says)
        self.gemm = self.layer.gemm
        # CPU: the path whose Layer runs one-step calls of a batch of one ("": this one, one_row_path)
        self.one_row_gemm = self.layer.one_row_gemm if kind == "cpu" else ""
        # CPU: the cell the built Layer runs, "int32", "int32-wide" (wide accumulators), "int32-hybrid"
        # (accumulators beyond int32, e.g. 16-bit weights, requantized in int64 or as two limbs in
        # int32, the gates in the int32 cell) or "int64" (prepare_layer found an int32 bound that
        # fails: correct, slower); "" on CUDA
        self.cell = self.layer.cell if kind == "cpu" else ""

    def __call__(self, qx: torch.Tensor, qh0: torch.Tensor, lengths: Optional[torch.Tensor],
                 level: Optional[torch.Tensor] = None):
        if level is None:
            return self.layer.forward(qx, qh0, lengths)
        return self.layer.forward(qx, qh0, lengths, level)


def resolved(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` with its lazy view state applied: a negative or conjugate view (torch._neg_view(x),
    x.conj().imag) stores values whose sign torch applies only when it reads them. Native code reads
    the raw memory behind data_ptr(), so every tensor is resolved before it is handed over (a no-op,
    no copy, for an ordinary tensor)."""
    return None if t is None else t.resolve_conj().resolve_neg()


def gru_direction(kind: str, isa: Optional[str] = None):
    """A backend's gru_direction(p, qx, qh0, lengths, level=None): the native Layer is made once per
    LayerParams and CPU path (``isa``: see NativeLayer). ``level`` [T, N]: each token's x level, for
    a layer with x levels (golden.gru_direction); the Layer checks that it is given exactly then.

    Under torch.inference_mode() the Layer is made and run with inference mode off: it keeps
    workspaces (and the CUDA backend its buffers) from call to call, and a workspace made as an
    inference tensor could not be written by a later call outside inference mode (a Lightning
    predict, which runs under inference_mode, followed by any other call)."""
    def run(p: LayerParams, qx: torch.Tensor, qh0: torch.Tensor, lengths: Optional[torch.Tensor] = None,
            level: Optional[torch.Tensor] = None):
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                return run(p, qx, qh0, lengths, level)
        qx, qh0, lengths, level = resolved(qx), resolved(qh0), resolved(lengths), resolved(level)
        cache = _native_cache(p)
        key = (kind, str(qx.device), (cpu_isa_request() if isa is None else isa) if kind == "cpu" else "")
        if key not in cache:
            cache[key] = NativeLayer(kind, p, qx.device, isa)
        return cache[key](qx, qh0, lengths, level)
    return run
