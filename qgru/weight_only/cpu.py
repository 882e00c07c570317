"""The weight-only CPU kernel: float32 activations times packed 2/4/8-bit weights, unpacked in
registers (never a float copy of the weights), and the GRU's time loop around it.

A small C++ extension (csrc/cpu/wo_kernel.cpp), compiled on first use with
torch.utils.cpp_extension.load_inline into ~/.cache/qgru/wo-<hash> (the hash covers the source
file's text, the csrc headers it includes, the compiler flags and the CPU model, since
it is built with -march=native: correct on the machine that builds it, vectorized for its
instruction set). Two functions:

* ``wo_mm(x [M, K], codes, scale, zp, bits, group) -> y [M, N]``: y = x . dequantize(w)^T,
  computed per group as ``y += scale * (sum_k code * x[k] - zp * sum_k x[k])`` in float32 (the
  codes are unpacked in registers without a shift: see mm_block).
* ``wo_gru_direction(gi [T, B, 3H], h0 [B, H], R codes/scale/zp, bits, group, b_hh, lengths, reverse)``:
  the whole time loop of one layer and direction, R.h by the same kernel and the gates in float32,
  given gi = W.x + b_ih for all steps; ``wo_gru_layer`` computes gi (one wo_mm over all T * B rows)
  and runs it, one call per layer and direction.

Where no C++ compiler works, ``why_unavailable()`` says why; the module then refuses backend
"native" and says so once for backend "auto" (it runs the dequantizing path instead).
"""
from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path
from typing import Optional

import torch

from ..native.build import build_guard, csrc_dir

SOURCE_FILE = "cpu/wo_kernel.cpp"  # the C++ source, under csrc/ (qgru.native.build.csrc_dir)
HEADERS = ["qgru_check.h"]  # what it includes from csrc/ (hashed into the build folder's name)


def source() -> str:
    """The kernel's C++ source: csrc/cpu/wo_kernel.cpp (FileNotFoundError where it is missing)."""
    return (csrc_dir() / SOURCE_FILE).read_text()


_FLAGS = ["-O3", "-march=native", "-fopenmp"]  # at::parallel_for is OpenMP in torch's CPU builds
_lock = threading.Lock()
_state = {"module": None, "error": None}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_dir(src: Optional[str] = None) -> Path:
    """The build folder: its name hashes the source (``src``, else source()), the flags, the CPU
    model and torch's version, and the csrc/ headers it includes (HEADERS)."""
    src = source() if src is None else src
    headers = "".join((csrc_dir() / h).read_text() for h in HEADERS)
    key = hashlib.sha256((src + headers + " ".join(_FLAGS) + _cpu_model() + torch.__version__).encode()).hexdigest()[:16]
    root = Path(os.environ.get("QGRU_CACHE", Path.home() / ".cache" / "qgru"))
    return root / f"wo-{key}"


def load(build: bool = True):
    """The compiled module, building it first if needed (``build``); None where it cannot be built
    (why_unavailable() then says why)."""
    with _lock:
        if _state["module"] is not None or _state["error"] is not None:
            return _state["module"]
        try:
            src = source()
        except OSError as e:
            _state["error"] = f"the kernel's source is missing ({type(e).__name__}: {e})"
            return None
        d = build_dir(src)
        if not build and not any(d.glob("*.so")):
            return None
        try:
            from torch.utils import cpp_extension
            with build_guard(d):
                _state["module"] = cpp_extension.load_inline(
                    name="qgru_wo_cpu", cpp_sources=[src], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                    extra_include_paths=[str(csrc_dir())],
                    build_directory=str(d),
                    verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure: reported by why_unavailable()
            _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        return _state["module"]


def why_unavailable() -> str:
    """'' when the kernel is usable, else why not (after trying to build it)."""
    load()
    return _state["error"] or ""


def _dense(t: torch.Tensor) -> torch.Tensor:
    """What the kernel reads: the tensor's values in a contiguous buffer. A lazy negative (or
    conjugate) view, torch._neg_view(x), keeps x's buffer and a flag that .contiguous() keeps too;
    the C++ reads the buffer, so the flag is resolved first (else it computes with +x)."""
    return t.resolve_conj().resolve_neg().contiguous()


def wo_mm(x: torch.Tensor, p) -> torch.Tensor:
    """x [M, K] float32 (CPU) times the PackedWeight ``p`` transposed: [M, N]."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"the weight-only CPU kernel is unavailable: {why_unavailable()}")
    return mod.wo_mm(_dense(x), _dense(p.codes), _dense(p.scale), _dense(p.zp), p.bits, p.group, p.K)


def gru_layer(x: torch.Tensor, h0: torch.Tensor, p, reverse: bool, lengths: Optional[torch.Tensor] = None):
    """One layer direction (a qgru.weight_only.format.WOLayer ``p``) on x [T, B, K] float32 from h0 [B, H]:
    (out [T, B, H], h_T), W.x and the time loop in one call."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"the weight-only CPU kernel is unavailable: {why_unavailable()}")
    f = torch.empty(0, dtype=torch.float32, device=x.device)
    i = torch.empty(0, dtype=torch.int64, device=x.device)
    return mod.wo_gru_layer(_dense(x), _dense(p.W.codes), _dense(p.W.scale), _dense(p.W.zp), p.W.group,
                            f if p.b_ih is None else _dense(p.b_ih), _dense(h0), _dense(p.R.codes),
                            _dense(p.R.scale), _dense(p.R.zp), p.R.group, f if p.b_hh is None else _dense(p.b_hh),
                            i if lengths is None else _dense(lengths.to(torch.int64)), p.W.bits, reverse)


def gru_direction(gi: torch.Tensor, h0: torch.Tensor, R, b_hh: Optional[torch.Tensor], reverse: bool,
                  lengths: Optional[torch.Tensor] = None):
    mod = load()
    if mod is None:
        raise RuntimeError(f"the weight-only CPU kernel is unavailable: {why_unavailable()}")
    empty = torch.empty(0, dtype=torch.float32, device=gi.device)
    b = b_hh if b_hh is not None else empty
    empty = torch.empty(0, dtype=torch.int64, device=gi.device)
    return mod.wo_gru_direction(_dense(gi), _dense(h0), _dense(R.codes), _dense(R.scale), _dense(R.zp), R.bits,
                                R.group, _dense(b), empty if lengths is None else _dense(lengths.to(torch.int64)),
                                reverse)
