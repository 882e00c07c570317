"""The CUDA backend's part of making a native Layer (cuda_layer), and its NaN flag (cuda_nan_seen)."""
from __future__ import annotations

from typing import Dict

import torch

from ..golden import LayerParams
from .build import load
from .prepare import CUDA_GEMM_MIN, prepare_layer


def cuda_layer(mod, p: LayerParams, device: torch.device):
    """The C++ Layer of p on the cuda extension ``mod``, its tensors on ``device``."""
    tensors, values = prepare_layer(p.to("cpu"), gemm_min=CUDA_GEMM_MIN)
    return mod.Layer({k: x.to(device) for k, x in tensors.items()}, values)


def cuda_nan_seen(device=None, clear: bool = True) -> Dict[str, bool]:
    """Whether a converted model's CUDA forward on ``device`` (default: the current one) met NaN in
    an input or an h0 since the last clear: {"input": bool, "h0": bool}. A CUDA forward never
    synchronises with the host to check for NaN (it quantizes NaN as 0.0 and sets this device
    flag); this reads the flag after the work enqueued so far on the current stream, waiting for
    it, and clears it when ``clear``. QGRU_CUDA_NAN_CHECK=1 makes every CUDA forward raise the CPU
    backend's ValueError instead (one wait per call; not inside a graph capture)."""
    d = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"cuda_nan_seen: a CUDA device expected, got {d}")
    v = int(load("cuda").nan_flags(d.index if d.index is not None else torch.cuda.current_device(), bool(clear)))
    return {"input": bool(v & 1), "h0": bool(v & 2)}
