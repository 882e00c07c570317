"""The CPU backend's instruction-set paths: which path a layer runs on (QGRU_CPU_ISA, the paths
the built extension and this CPU offer, per-layer and one-row choices), what qgru.backends()
says about them, and the CPU part of making a native Layer (cpu_layer).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch

from ..convert import recurrent_operand
from ..golden import LayerParams
from . import build
from .build import load
from .prepare import one_limb_pair, prepare_layer

def _act_bytes(paths: List[Dict[str, object]], name: str) -> int:
    """A path's activation bytes from cpu_paths(): 1 on the int8 paths (amx, avx512vnni, avxvnni)."""
    return next((int(i["act_bytes"]) for i in paths if i["name"] == name), 0)


def _path_act16(paths: List[Dict[str, object]], name: str) -> bool:
    """Whether a path takes 16-bit activations whole: int16 operands (avx2, portable) or an int16
    sibling of an int8 path (avx512vnni's vpdpwssd GEMM, Kernels::act16)."""
    return any(bool(i.get("act16")) for i in paths if i["name"] == name)


def _avx2_takes_whole(p: LayerParams) -> bool:
    """Whether p has a 16-bit x or R.h operand that an int16 GEMM (avx2's, or an int8 path's int16
    sibling) takes whole, so that its step is one fused pass there against two limb pairs per GEMM
    on the int8 GEMMs."""
    b = p.bits
    return max(b["x"], b[recurrent_operand(b)]) > 8 and one_limb_pair(p, act16=True)


def layer_act16(p: LayerParams, path: str) -> bool:
    """The act16 flag prepare_layer takes for p on the CPU path ``path``: every int16 path's layers;
    on an int8 path with an int16 sibling (avx512vnni) a layer whose every 16-bit GEMM operand it
    takes whole (_avx2_takes_whole: the C++ Layer then runs the sibling, one fused pass; a layer
    that would still need limbs for one operand keeps the int8 GEMMs, whose limbs are cheaper)."""
    paths = cpu_paths()
    if _act_bytes(paths, path) == 2:
        return True
    return _path_act16(paths, path) and _avx2_takes_whole(p)


def layer_path(p: LayerParams, path: str, request: str) -> str:
    """The CPU path a layer runs on when the request ``request`` resolved to ``path``: ``path``, but
    for an auto request a layer with a 16-bit x or R.h operand that an int16 GEMM takes whole
    (_avx2_takes_whole) leaves the int8 paths that would split it into two limbs:
    * amx -> avx512vnni (its int16 sibling: one fused pass with the int32 cell, against amx's two
      limb pairs per GEMM and the int32-hybrid cell): w8a16, T=100, 1.85 against 4.10 ms at I=16
      H=64 N=32 (1 thread), 2.60 against 4.48 at I=64 H=128 N=16 (1 thread), 56.1 against 80.0 at
      I=256 H=512 N=64 (2 threads); bench.py on lscpu "Intel(R) Xeon(R) Processor" (Sapphire
      Rapids), 2026-12-02;
    * avxvnni -> avx2 (int16 operands beat avxvnni's two limbs: w8a16, T=100 N=64 I=256 H=512, 94
      against 113 ms, bench.py on the same CPU, 2026-11-25).
    A forced path (QGRU_CPU_ISA) is taken as asked."""
    if request != "auto" or not _avx2_takes_whole(p):
        return path
    usable = {str(i["name"]) for i in cpu_paths() if i["usable"]}
    if path == "amx" and "avx512vnni" in usable and _path_act16(cpu_paths(), "avx512vnni"):
        return "avx512vnni"
    if path == "avxvnni" and "avx2" in usable:
        return "avx2"
    return path


def one_row_path(p: LayerParams, path: str) -> Optional[str]:
    """The CPU path on which a layer of path ``path`` runs its one-step calls of a batch of one
    (streaming), or None for ``path`` itself: the one place that decides it (the C++ Layer runs
    them on a Layer of that path, made on the first such call: CpuLayer::set_one_row). Measured on
    lscpu "Intel(R) Xeon(R) Processor" (a 2-core Sapphire Rapids VM), H = 512, 2 threads:
    * amx, a fused layer (one limb pair each, gemm "amx-fused"): a 16-row AMX tile holds one real
      row; one step took 18.4 us against 14.1 us with avx512vnni's GEMMs (from two rows AMX is
      faster: N = 2, 18.6 against 20.0 us), 2026-11-25;
    * amx or avxvnni, a layer with a 16-bit x or R.h operand that avx2 takes whole as int16 (one
      fused pass there, against two limb pairs per GEMM and a pass per GEMM on the int8 paths):
      w8a16 57 us (amx) and 44 us (avx512vnni, before its int16 sibling) against 37 us per step
      (bench.py, 2026-11-25). avx512vnni now takes such a layer whole itself (its int16 sibling,
      Kernels::act16: one fused pass with the int32 cell) and keeps its streaming calls."""
    paths = cpu_paths()
    usable = {str(i["name"]) for i in paths if i["usable"]}
    if path == "amx" and "avx512vnni" in usable and one_limb_pair(p, act16=False):
        return "avx512vnni"
    if _act_bytes(paths, path) == 1 and not _path_act16(paths, path) and "avx2" in usable and _avx2_takes_whole(p):
        return "avx2"
    return None


# os.environ.get encodes the key and decodes the value on every call (~1.5 us, 2026-11-28, AMD
# EPYC Zen 4), paid by every streaming call (~30 us). os.environ keeps its values in a dict of
# encoded keys (`_data`, kept in step by every os.environ write, monkeypatch.setenv included):
# read it where it exists, else os.environ.get.
_ENV_DATA = getattr(os.environ, "_data", None)
_ISA_KEY = os.environ.encodekey("QGRU_CPU_ISA") if _ENV_DATA is not None and hasattr(os.environ, "encodekey") \
    else None
_request_memo: Dict[object, str] = {}


def cpu_isa_request() -> str:
    """The CPU path new CPU layers ask for: QGRU_CPU_ISA (auto, portable, avx2, avxvnni, avx512vnni,
    amx)."""
    if _ISA_KEY is None or not isinstance(_ENV_DATA, dict):
        return os.environ.get("QGRU_CPU_ISA", "auto").strip().lower() or "auto"
    raw = _ENV_DATA.get(_ISA_KEY)
    req = _request_memo.get(raw)
    if req is None:
        value = "auto" if raw is None else os.environ.decodevalue(raw)
        req = _request_memo[raw] = value.strip().lower() or "auto"
        if len(_request_memo) > 64:  # a process that sets many values: keep the memo small
            _request_memo.clear()
    return req


def cpu_paths() -> List[Dict[str, object]]:
    """Every CPU path of the built backend, fastest first: name, usable here, why not, act_bytes
    (0: not compiled in), needs (the CPU features it requires, by gcc target-attribute name)."""
    return [dict(name=n, usable=ok, why=why, act_bytes=ab, needs=list(needs), act16=act16)
            for n, ok, why, ab, needs, act16 in load("cpu").isa_table()]


def resolve_cpu_isa(request: Optional[str] = None) -> Dict[str, object]:
    """The path that a CPU layer asked for ``request`` (None: QGRU_CPU_ISA) runs; a path this CPU
    cannot run, or an unknown name, is a ValueError with the reason."""
    req = cpu_isa_request() if request is None else request.strip().lower()
    paths = cpu_paths()
    for info in paths:
        if req == "auto" and info["usable"]:
            return info
        if info["name"] == req:
            if not info["usable"]:
                raise ValueError(f"qgru cpu: the {req!r} path (QGRU_CPU_ISA) cannot run here: {info['why']}")
            return info
    raise ValueError(f"qgru cpu: unknown path {req!r} (QGRU_CPU_ISA); known: auto, "
                     + ", ".join(str(i["name"]) for i in paths))


_PATH_TEXT = {
    "amx": "AMX int8 tiles",
    "avx512vnni": "AVX-512 VNNI int8 dot products (int16 ones for 16-bit activations taken whole)",
    "avxvnni": "AVX-VNNI int8 dot products (256-bit)",
    "avx2": "AVX2 int16 multiply-adds (vpmaddwd; 16-bit activations whole where exact)",
    "portable": "portable C++ loops (compiler-vectorised)",
}


def cpu_gemm_detail() -> str:
    """Which path new CPU layers run, on which CPU, and why (the cpu entry of qgru.backends())."""
    mod = load("cpu")
    try:
        info = resolve_cpu_isa()
    except ValueError as e:
        return f"{e} (CPU: {mod.cpu_model()})"
    why = ("forced by QGRU_CPU_ISA" if cpu_isa_request() != "auto"
           else "the fastest path this CPU and OS offer")
    skipped = [f"{i['name']}: {i['why']}" for i in cpu_paths() if not i["usable"]]
    usable = {str(i["name"]) for i in cpu_paths() if i["usable"]}
    one_row = ("; a streaming step (one step of a batch of one) runs on avx512vnni where the layer is one fused "
               "pass (a 16-row AMX tile would hold one real row)" if info["name"] == "amx" and "avx512vnni" in usable
               else "")
    if info["name"] == "amx" and "avx512vnni" in usable and _path_act16(cpu_paths(), "avx512vnni") and \
            cpu_isa_request() == "auto":
        one_row += ("; a layer with 16-bit x or h that avx512vnni's int16 GEMM (vpdpwssd) takes whole runs on "
                    "avx512vnni (one fused pass instead of two limb pairs per GEMM)")
    elif info["name"] == "avxvnni" and "avx2" in usable and cpu_isa_request() == "auto":
        one_row += "; a layer with 16-bit x or h that avx2 takes whole as int16 runs on avx2 (one fused pass)"
    elif info["act_bytes"] == 1 and info.get("act16"):
        one_row += ("; a layer with 16-bit x or h that its int16 GEMM (vpdpwssd) takes whole runs it: one fused "
                    "pass instead of two limb pairs per GEMM")
    elif info["act_bytes"] == 1 and "avx2" in usable:
        one_row += ("; a streaming step of a layer with 16-bit x or h that avx2 takes whole as int16 runs on avx2 "
                    "(one fused pass instead of two limb pairs per GEMM)")
    return (f"path {info['name']}: {_PATH_TEXT.get(str(info['name']), info['name'])}, {why}; one fused pass per "
            f"step where x, the R.h operand (h or h_gemm), W and R take one limb each{one_row}; CPU: {mod.cpu_model()}"
            + (f"; not usable here: {'; '.join(skipped)}" if skipped else ""))


def _warn_forked_child(mod) -> None:
    """Once per process: a child of fork runs the cpu backend on one thread (_after_fork_in_child),
    which is slower where torch would use more (a DataLoader worker sets one thread itself)."""
    if build._state.warned_fork or not mod.forked_child() or torch.get_num_threads() <= 1:
        return
    build._state.warned_fork = True
    import warnings
    warnings.warn("qgru cpu backend: this process is a child of fork(), where OpenMP's thread pool does not "
                  "work (a parallel region can wait forever for threads of the parent): qgru's CPU kernels run "
                  f"on the calling thread here, not on torch's {torch.get_num_threads()} threads. Start worker "
                  "processes with the 'spawn' or 'forkserver' method for multi-threaded inference in them, or "
                  "call torch.set_num_threads(1) in the child to silence this.", RuntimeWarning, stacklevel=4)


def cpu_layer(mod, p: LayerParams, isa: Optional[str]):
    """The C++ Layer of p on the cpu extension ``mod`` for the path request ``isa`` (None:
    QGRU_CPU_ISA; see NativeLayer), with its one-row Layer's path set where one_row_path says."""
    _warn_forked_child(mod)
    info = resolve_cpu_isa(isa)
    request = cpu_isa_request() if isa is None else isa.strip().lower()
    name = layer_path(p, str(info["name"]), request)
    if name != info["name"]:
        info = resolve_cpu_isa(name)
    # prepared on the host, then moved once
    act16 = layer_act16(p, str(info["name"]))
    tensors, values = prepare_layer(p.to("cpu"), act16=act16)
    layer = mod.Layer(tensors, values, str(info["name"]))
    other = one_row_path(p, str(info["name"]))
    if other is not None:
        if layer_act16(p, other) != act16:
            tensors, values = prepare_layer(p.to("cpu"), act16=layer_act16(p, other))
        layer.set_one_row(tensors, values, other)
    return layer
