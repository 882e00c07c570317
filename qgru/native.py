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
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
import sysconfig
import threading
import weakref
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .convert import recurrent_operand
from .golden import LayerParams
from .primitives import qrange, split_int8_limbs
from .tables import table_geometry

_HERE = Path(__file__).resolve().parent
_KINDS = ("cpu", "cuda")
# the CPU backend: the driver, the run-time path choice, and one file per instruction-set path
# (csrc/cpu/kernels.h describes them), each of which sets its own target
_CPU_PATHS = ("portable", "avx2", "avxvnni", "avx512vnni", "amx")
_SOURCES = {
    "cpu": ["cpu/qgru_cpu.cpp", "cpu/isa.cpp"] + [f"cpu/kernel_{p}.cpp" for p in _CPU_PATHS],
    "cuda": ["qgru_cuda.cpp", "qgru_cuda_kernels.cu"],
}
# every header the sources include: the build's cache key hashes them, so an edit to any of them
# rebuilds (tests/test_native.py checks that this list and _SOURCES cover every file in csrc/)
_HEADERS = ["qgru_fixedpoint.h", "qgru_cell.h", "qgru_layer.h", "qgru_cuda.h", "qgru_cuda_launch.h", "cpu/kernels.h",
            "cpu/cell_loops.h", "cpu/isa.h", "cpu/quantize_block.h", "cpu/lanes_avx2.h", "cpu/lanes_avx512.h",
            "cpu/vnni_gemm.h"]
GEMM_PAD = 16  # channel and reduction padding: int8 tensor-core GEMMs want multiples of 16
# the CUDA backend's smallest GEMM dimension (csrc/qgru_cuda.h kMinGemmDim: cuBLAS is never asked
# for 16 or fewer channels, rows or K, shapes PyTorch's own int8 GEMM refuses)
CUDA_GEMM_MIN = 32


def csrc_dir() -> Path:
    """csrc/ of an installed wheel (qgru/csrc) or of a source checkout (../csrc)."""
    for d in (_HERE / "csrc", _HERE.parent / "csrc"):
        if (d / "qgru_cell.h").is_file() and (d / "cpu" / "kernels.h").is_file():
            return d
    raise FileNotFoundError("qgru's csrc/ folder is missing from this installation")


def _cpu_flags() -> List[str]:
    flags = ["-O3", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        # No -march: the driver and the portable path are built for the x86-64 baseline, and each
        # faster path (csrc/cpu/kernel_*.cpp) sets its own target; csrc/cpu/isa.cpp picks the
        # path at run time from what the CPU and the OS offer.
        if _compiler_is_gcc():
            # gcc's tuning for recent Intel cores avoids AVX-512 gathers; the table lookups are
            # gathers and measure ~20% faster with them (csrc/cpu/cell_loops.h)
            flags.append("-mtune-ctrl=use_gather")
    elif platform.machine() in ("aarch64", "arm64"):
        flags.append("-march=native")  # only the portable path there; the cache key includes the machine
    return flags


def _toolchain_has_avxvnni(work: Path) -> bool:
    """Whether the compiler and assembler build csrc/cpu/kernel_avxvnni.cpp (the VEX form of
    vpdpbusd, written `{vex} vpdpbusd`, needs an assembler that knows it besides gcc 11 / clang 12): the
    file itself is compiled once, unoptimised (it includes no torch header). An older toolchain then
    builds every other path; without this check the whole extension would fail to build."""
    import subprocess
    src = csrc_dir()
    cmd = [os.environ.get("CXX", "c++"), "-std=c++17", "-O0", "-I", str(src), "-I", str(src / "cpu"), "-c",
           str(src / "cpu" / "kernel_avxvnni.cpp"), "-o", str(work / "avxvnni_probe.o")]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _compiler_is_gcc() -> bool:
    import subprocess
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out or out.startswith(("g++", "c++ (GCC)"))


def cpu_model_name() -> str:
    """The CPU's model name as lscpu prints it ("Model name", read from /proc/cpuinfo's "model
    name"), else what platform knows: every figure the scripts print names the CPU it came from."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine_id() -> str:
    """CPU model and feature flags: the cache key's machine part (aarch64 builds use -march=native,
    and a binary built for one CPU is not assumed to suit another)."""
    info = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                info += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        info += platform.processor()
    return info


def build_key(kind: str) -> str:
    h = hashlib.sha256()
    src = csrc_dir()
    for name in sorted(_SOURCES[kind] + _HEADERS):
        p = src / name
        if p.is_file():
            h.update(name.encode() + p.read_bytes())
    h.update(" ".join(_cpu_flags()).encode())
    h.update(_machine_id().encode())
    h.update((torch.version.git_version or "").encode())
    if kind == "cuda":
        h.update((os.environ.get("TORCH_CUDA_ARCH_LIST", "") + str(torch.version.cuda)).encode())
    abi = sysconfig.get_config_var("SOABI") or sys.version
    return f"{kind}-torch{torch.__version__}-{abi}-{h.hexdigest()[:12]}".replace("+", "_")


def build_dir(kind: str) -> Path:
    root = Path(os.environ.get("QGRU_BUILD_DIR", Path.home() / ".cache" / "qgru"))
    return root / build_key(kind)


def _ext_name(kind: str) -> str:
    return f"qgru_{kind}_ext"


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.modules: Dict[str, object] = {}
        self.errors: Dict[str, str] = {}
        self.forked = False  # this process is a child of os.fork() (made after qgru was imported)
        self.warned_fork = False


_state = _State()

# Every LayerParams that holds native Layers (its __dict__["_native"] cache), by id: the child of a
# fork drops them all (_after_fork_in_child).
_cached_layers: "weakref.WeakValueDictionary[int, LayerParams]" = weakref.WeakValueDictionary()
# The native state a fork's child inherited from its parent and must never touch nor free: kept.
_forked_away: List[object] = []


def _native_cache(p: LayerParams) -> Dict:
    """p's cache of native Layers (and Stacks), registered so that a fork's child can drop it."""
    cache = p.__dict__.get("_native")
    if cache is None:
        cache = p.__dict__.setdefault("_native", {})
        _cached_layers[id(p)] = p
    return cache


def _after_fork_in_child() -> None:
    """os.fork()'s child: forget every native Layer made before the fork, and the loader's lock.

    A C++ Layer serialises its calls with a mutex (its workspaces are shared by the calls on it),
    released when the call returns; a fork copies the mutex as it is, locked if another thread of
    the parent was inside a call, and that thread does not exist in the child: the child's first
    call on the Layer would wait for it forever (issue 30). Its workspaces may be half-written too.
    So the child starts afresh: each LayerParams drops its cached Layers and makes new ones on its
    next call (a millisecond or so per layer); the old ones are kept, never called and never freed
    (freeing a locked mutex is undefined). The loader's threading.Lock is replaced for the same
    reason.

    GNU OpenMP's thread pool (torch's intra-op threads, at::parallel_for) does not survive a fork
    either: a child forked by a thread that ran a parallel region waits forever in its next one
    (torch's own operators as well). The cpu backend's loops run on the calling thread in a child
    (csrc/cpu/qgru_cpu.cpp, parallel_for; its pthread_atfork handler, or set_forked_child where the
    extension is first loaded in the child); a warning says so where torch would use more threads."""
    _state.lock = threading.Lock()
    _state.forked = True
    for p in list(_cached_layers.values()):
        old = p.__dict__.pop("_native", None)
        if old:
            _forked_away.append(old)
    _cached_layers.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _cuda_unavailable_reason() -> str:
    if torch.version.cuda is None:
        return f"the installed torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    from torch.utils.cpp_extension import CUDA_HOME
    if CUDA_HOME is None:
        return "nvcc (the CUDA toolkit) was not found; set CUDA_HOME"
    return ""


def _load_built(kind: str, path: Path):
    """Import a built extension file, refusing one compiled against another torch."""
    spec = importlib.util.spec_from_file_location(_ext_name(kind), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if getattr(mod, "built_for_torch", None) != torch.__version__:
        raise RuntimeError(f"stale binary {path} was built for torch {getattr(mod, 'built_for_torch', '?')}, "
                           f"this is torch {torch.__version__}: rebuild with `python -m qgru build`")
    return mod


def _find_binary(kind: str) -> Optional[Path]:
    d = build_dir(kind)
    hits = sorted(d.glob(_ext_name(kind) + "*.so")) + sorted(d.glob(_ext_name(kind) + "*.pyd"))
    return hits[0] if hits else None


def find_cublas(maps: str, cuda_home: Optional[str], cuda_version: Optional[str]) -> Path:
    """The cuBLAS library the CUDA backend links: the one this torch process has loaded (``maps``:
    the text of /proc/self/maps), else the toolkit's (``cuda_home``) of torch's CUDA major version.

    Not ``-lcublas``: that needs an unversioned libcublas.so on the linker path, which a pip-only
    CUDA install (torch with the nvidia-* wheels) does not have; it has libcublas.so.<major>, the
    library torch itself runs. Linking that file records its soname, so at run time the extension
    shares torch's cuBLAS. cuBLAS's major version is CUDA's (11, 12, 13): a library of another
    major than torch.version.cuda is refused, naming both. Raises RuntimeError with the reason."""
    import re
    if not cuda_version:
        raise RuntimeError("torch has no CUDA version (a CPU-only build): no cuBLAS to link")
    major = cuda_version.split(".")[0]
    pattern = re.compile(r"(\S*/libcublas\.so\.(\d+)(?:\.[\d.]+)?)$")
    for line in maps.splitlines():
        m = pattern.search(line.strip())
        if m:
            if m.group(2) != major:
                raise RuntimeError(f"torch runs {m.group(1)}, cuBLAS {m.group(2)}, but reports CUDA {cuda_version}")
            return Path(m.group(1))
    if cuda_home:
        for lib in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            p = Path(cuda_home) / lib / f"libcublas.so.{major}"
            if p.exists():
                return p
    raise RuntimeError(f"no cuBLAS {major} (torch's CUDA {cuda_version}) found: torch has not loaded one and "
                       f"the toolkit ({cuda_home or 'CUDA_HOME unset'}) has no lib64/libcublas.so.{major}")


def _cublas_link_flags() -> List[str]:
    if not sys.platform.startswith("linux"):
        return ["cublas.lib" if sys.platform == "win32" else "-lcublas"]  # the toolkit's import library
    from torch.utils.cpp_extension import CUDA_HOME
    torch.cuda.init()  # torch's CUDA libraries (cuBLAS among them) are loaded by now
    maps = Path("/proc/self/maps").read_text()
    lib = find_cublas(maps, CUDA_HOME, torch.version.cuda)
    # the full path links the file itself; the rpath finds it again if torch has not loaded it
    return [str(lib), f"-Wl,-rpath,{lib.parent}"]


def _compile(kind: str, verbose: bool):
    from torch.utils import cpp_extension
    d = build_dir(kind)
    d.mkdir(parents=True, exist_ok=True)
    src = csrc_dir()
    # escaped for the shell that ninja runs the compiler through
    define = [f'-DQGRU_TORCH_VERSION=\\"{torch.__version__}\\"']
    if kind == "cpu" and platform.machine() in ("x86_64", "AMD64") and not _toolchain_has_avxvnni(d):
        define.append("-DQGRU_NO_AVXVNNI")  # the avxvnni path is then "not compiled into this binary"
    kw = dict(name=_ext_name(kind), sources=[str(src / s) for s in _SOURCES[kind]],
              extra_include_paths=[str(src), str(src / "cpu")], build_directory=str(d), verbose=verbose,
              extra_cflags=_cpu_flags() + define, extra_ldflags=["-fopenmp"])
    if kind == "cuda":
        kw["extra_cuda_cflags"] = ["-O3"] + define
        kw["extra_ldflags"] = ["-fopenmp"] + _cublas_link_flags()
    print(f"qgru: compiling the {kind} backend into {d} (once; about a minute)...", file=sys.stderr, flush=True)
    mod = cpp_extension.load(**kw)
    _prune_stale(kind, d)
    return mod


def _prune_stale(kind: str, current: Path) -> None:
    """Remove this environment's older builds of ``kind`` (same torch and ABI, other sources or flags)."""
    import shutil
    prefix = current.name[: current.name.rindex("-") + 1]
    for d in current.parent.glob(prefix + "*"):
        if d != current and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def load(kind: str, build: bool = True):
    """The extension module for ``kind``, building it if needed; raises with the reason if it can't."""
    if kind not in _KINDS:
        raise ValueError(f"unknown native backend {kind!r}")
    with _state.lock:
        if kind in _state.modules:
            return _state.modules[kind]
        if kind in _state.errors:
            raise RuntimeError(_state.errors[kind])
        try:
            if kind == "cuda":
                why = _cuda_unavailable_reason()
                if why:
                    raise RuntimeError(why)
            path = _find_binary(kind)
            mod = None
            if path is not None:
                try:
                    mod = _load_built(kind, path)
                except RuntimeError as e:
                    print(f"qgru: {e}", file=sys.stderr)
            if mod is None:
                if not build or os.environ.get("QGRU_NO_BUILD") == "1":
                    raise RuntimeError(f"not built (QGRU_NO_BUILD=1 or build disabled); "
                                       f"run `python -m qgru build` to compile it into {build_dir(kind)}")
                try:
                    mod = _compile(kind, verbose=os.environ.get("QGRU_VERBOSE_BUILD") == "1")
                except Exception as e:  # noqa: BLE001 - any compiler failure becomes the reason
                    msg = str(e).strip().splitlines()
                    raise RuntimeError(f"building the {kind} extension failed ({msg[-1] if msg else type(e).__name__}); "
                                       f"rerun with QGRU_VERBOSE_BUILD=1 python -m qgru build for the compiler output")
                if getattr(mod, "built_for_torch", None) != torch.__version__:
                    raise RuntimeError("freshly built extension reports another torch version")
            if kind == "cpu" and _state.forked:
                mod.set_forked_child()  # loaded in a child of fork: no OpenMP (_after_fork_in_child)
            if kind == "cuda":
                # the cuBLAS loaded at run time must be the major version the headers were (raises
                # with both versions otherwise)
                mod.check_cublas()
            _state.modules[kind] = mod
            return mod
        except RuntimeError as e:
            _state.errors[kind] = str(e)
            raise


def why_unavailable(kind: str) -> str:
    """'' when the backend loads (building it if needed), else the reason."""
    if kind in _state.modules:  # loaded: no lock (a streaming call asks this every step)
        return ""
    try:
        load(kind)
        return ""
    except RuntimeError as e:
        return str(e)


# ---------------------------------------------------------------------------------------------
# Parameters: LayerParams -> the flat tensors and values the C++ Layer takes (once per device)
# ---------------------------------------------------------------------------------------------
def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def _per_channel(v: torch.Tensor, n: int) -> torch.Tensor:
    return v.reshape(-1).expand(n).contiguous() if v.numel() == 1 else v.reshape(n).contiguous()


def direct16_fits(weights: torch.Tensor, w_bits: int, act_bits: int) -> bool:
    """Whether a 16-bit activation times these 8-bit weights is exact as one int16 x int16 GEMM
    with int32 sums (csrc/cpu/kernel_avx2.cpp): K 2^15 max|w| < 2^31 (K <= 516 at max|w| = 127)."""
    if act_bits <= 8 or w_bits > 8:
        return False
    K = weights.shape[1]
    max_w = int(weights.abs().max()) if weights.numel() else 0
    return K * 32768 * max_w < (1 << 31)


def one_limb_pair(p: LayerParams, act16: bool) -> bool:
    """Whether both of p's GEMMs are one limb pair (the CPU Layer's step is then one fused pass,
    gemm "<path>-fused"): 8-bit weights, and x and h of at most 8 bits or, on a path with int16
    operands (act16), taken whole where direct16_fits (prepare_layer's x_direct16 / h_direct16)."""
    b = p.bits
    h = b[recurrent_operand(b)]
    return (b["W"] <= 8 and b["R"] <= 8 and (b["x"] <= 8 or (act16 and direct16_fits(p.W, b["W"], b["x"])))
            and (h <= 8 or (act16 and direct16_fits(p.R, b["R"], h))))


def _limb_gemm(prefix: str, weights: torch.Tensor, w_bits: int, act_bits: int, M_pad: int,
               ones_col: int, act_direct: bool = False,
               gemm_min: int = GEMM_PAD) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """Weight limb matrices [L, M_pad, K_pad] int8, limb pairs [P, 4], constant per-channel terms [M].
    act_direct: the activations (up to 16 bits) enter whole, as one int16 limb. K_pad: a multiple
    of GEMM_PAD, at least gemm_min."""
    M, K = weights.shape
    K_pad = max(_round_up(max(K, 1), GEMM_PAD), gemm_min)
    w_limbs = split_int8_limbs(weights.to(torch.int64), w_bits)
    any_offset = any(c for _, _, c in w_limbs)
    # as csrc act_limb()
    act_limbs = [(1, 0)] if act_bits <= 8 or act_direct else [(1, 128), (256, 0)]
    stacked = torch.zeros(len(w_limbs), M_pad, K_pad, dtype=torch.int8, device=weights.device)
    const = torch.zeros(M, dtype=torch.int64, device=weights.device)
    pairs = []
    for j, (limb, wscale, d) in enumerate(w_limbs):
        stacked[j, :M, :K] = limb
        if any_offset:
            stacked[j, ones_col, :K] = 1  # its output column is rowsum of the activation limb
        colsum = limb.to(torch.int64).sum(1)
        for i, (ascale, c) in enumerate(act_limbs):
            s = ascale * wscale
            pairs.append([i, j, s, d])
            const += s * (c * colsum + c * d * K)
    return {f"{prefix}_weight_limbs": stacked, f"{prefix}_pairs": torch.tensor(pairs, dtype=torch.int64, device=weights.device)}, const


def pack_table(entries: torch.Tensor) -> torch.Tensor:
    """csrc Table layout: entry i = T[i] (low 32 bits) | (T[i+1] - T[i]) << 32, one per segment."""
    e = entries.to(torch.int64)
    lo, diff = e[:-1], e[1:] - e[:-1]
    assert int(e.abs().max()) < (1 << 30), "table entries exceed the packed layout"
    return (diff * (1 << 32) + (lo & 0xFFFFFFFF)).contiguous()


def prepare_layer(p: LayerParams, act16: bool = False,
                  gemm_min: int = GEMM_PAD) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
    """The C++ Layer's arguments for one layer and direction (CPU tensors; move them as needed).

    act16: the kernel takes int16 activations (the CPU's avx2 path), so a 16-bit x or h times 8-bit
    weights is one GEMM where ``direct16_fits`` proves its int32 sums exact. "h_bits" is the bits of
    the R.h GEMM's operand (h_gemm's when the layer has one, "hg" = 1: the cell then writes the
    operand from the new state, golden.recurrent_operand); "h_lo"/"h_hi" the state's range.
    gemm_min: the smallest
    padded channel count (M_pad) and reduction length (K_pad), CUDA_GEMM_MIN for the CUDA backend
    (zero padding: the same integers)."""
    H, I = p.hidden_size, p.input_size
    H3 = 3 * H
    b, zp, rs = p.bits, p.zp, p.rescale
    needs_ones = b["W"] > 8 or b["R"] > 8
    ones_col = H3
    M_pad = max(_round_up(H3 + (1 if needs_ones else 0), GEMM_PAD), gemm_min)
    t: Dict[str, torch.Tensor] = {}
    op = recurrent_operand(b)  # what R.h reads: "h" or "h_gemm"
    v: Dict[str, int] = {"H": H, "I": I, "M_pad": M_pad, "ones_col": ones_col if needs_ones else 0,
                         "x_bits": b["x"], "h_bits": b[op], "hg": int(op == "h_gemm")}
    x_direct = act16 and direct16_fits(p.W, b["W"], b["x"])
    h_direct = act16 and direct16_fits(p.R, b["R"], b[op])
    v["x_direct16"], v["h_direct16"] = int(x_direct), int(h_direct)
    gx, const_x = _limb_gemm("x", p.W, b["W"], b["x"], M_pad, ones_col, x_direct, gemm_min)
    gh, const_h = _limb_gemm("h", p.R, b["R"], b[op], M_pad, ones_col, h_direct, gemm_min)
    t.update(gx)
    t.update(gh)

    def rescale(name: str, r, n: int) -> None:
        m = _per_channel(r.multiplier, n).to(torch.int64)
        t[name + "_mult"] = m
        t[name + "_shift"] = _per_channel(r.shift, n).to(torch.int32)
        is_pow2 = (m > 0) & ((m & (m - 1)) == 0)
        # log2 of power-of-two multipliers (x * m becomes a shift); -1 marks the others
        t[name + "_mult_log2"] = torch.where(is_pow2, torch.log2(m.double().clamp(min=1)).round().long(),
                                             torch.full_like(m, -1)).to(torch.int32)

    def rng(name: str, bits: int) -> None:
        v[name + "_lo"], v[name + "_hi"] = qrange(bits)

    for name, bias, comp, const in (("Wx", p.b_x, p.W_zp_comp, const_x), ("Rh", p.b_h, p.R_zp_comp, const_h)):
        t[name + "_bias"] = (bias - comp + const).to(torch.int64).contiguous()
        rescale(name, rs[name], H3)
        t[name + "_zp"] = _per_channel(zp[name], H3).to(torch.int64)
        rng(name, b[name])
    for g in ("r", "z"):
        rescale(f"{g}_from_wx", rs[f"Wx_{g}"], H)
        rescale(f"{g}_from_rh", rs[f"Rh_{g}"], H)
    rescale("g_from_wx", rs["Wx_g"], H)
    rescale("g_from_rrh", rs["rRh_g"], H)
    rescale("zh", rs["zh"], 1)
    rescale("zg", rs["zg"], 1)
    for g in ("r", "z", "g"):
        v[f"{g}_pre_zp"] = int(zp[f"{g}_pre"])
        rng(f"{g}_pre", b[f"{g}_pre"])
        rng(g, b[g])
        v[f"{g}_zp"] = int(zp[g])
        k, frac = table_geometry(b[f"{g}_pre"])
        v[f"{g}_table_k"], v[f"{g}_table_frac"] = k, frac
        t[f"table_{g}"] = pack_table(p.tables[g])
    # the shift-only kernels are used when every multiplier is a power of two (pow2 scale mode)
    v["pow2"] = int(all(bool((x >= 0).all()) for k, x in t.items() if k.endswith("_mult_log2")))
    v["one_z"] = int(p.one_z)
    v["h_zp"] = int(zp["h"])
    rng("h", b["h"])
    if op == "h_gemm":
        rescale("hg", rs["h_gemm"], 1)
        v["hg_zp"] = int(zp["h_gemm"])
        rng("hg", b["h_gemm"])
    v["acc32"] = int(_add_acc32(t, v, b))
    return t, v


def _net_shift(t: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """R = shift - 1 - log2(mult) of a power-of-two rescale (int64): the rescale is v >> R, rounded."""
    return t[name + "_shift"].to(torch.int64) - 1 - t[name + "_mult_log2"].to(torch.int64)


def _add_acc32(t: Dict[str, torch.Tensor], v: Dict[str, int], bits: Dict[str, int]) -> bool:
    """Add the int32 forms (csrc AccRequant32 and Cell32) when they are exact for this layer.

    Common conditions: one limb pair on both GEMMs (8-bit x, W, R and R.h operand: h itself, or
    h_gemm beside a state of up to 16 bits) and K < 2^16, so every GEMM accumulator G is below
    K 2^14 <= 2^30 in magnitude. Then the pow2 form (_acc32_pow2) or
    the multiplier form (_acc32_mult) adds its fields where its own bounds hold (proofs in
    csrc/qgru_cell.h); otherwise the layer runs the int64 cell.
    """
    if max(bits["x"], bits[recurrent_operand(bits)], bits["W"], bits["R"]) > 8 or max(v["I"], v["H"]) >= (1 << 16):
        return False
    parts = _acc32_pow2(t, v) if v["pow2"] else _acc32_mult(t, v)
    if parts is None:
        return False
    t["c32_channels"] = _channel_blocks(parts, v["H"])
    # the W.x requantization pass of the unfused paths reads Wx's int32 form over all 3H channels
    t.update({k: x for k, x in parts.items() if k.startswith("Wx_")})
    return True


def _pow2_shifts(t: Dict[str, torch.Tensor], name: str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(lsh, rsh) int32 of a pow2 rescale of a value |v| < 2^17 in rescale32, or None where its left
    shift would pass 14 (v << lsh must stay below 2^31)."""
    r = _net_shift(t, name)
    if bool((r < -14).any()):
        return None
    # shifting a value below 2^31 right by 31 or more gives 0 or -1, the same after rounding as the
    # exact result: clamped, so no int32 shift reaches the undefined 32
    return (-r).clamp(min=0).to(torch.int32), r.clamp(min=0, max=31).to(torch.int32)


def _acc32_pow2(t: Dict[str, torch.Tensor], v: Dict[str, int]) -> Optional[Dict[str, torch.Tensor]]:
    """The pow2 form's fields, or None. Accumulators: R in [1, 30]; cell: left shifts <= 14 for
    the pre-activation rescales and h -> h_gemm, R >= 8 for r * Rh_g and z * h (rescale_wide32),
    R >= 0 for (1 - z) * g."""
    parts = {}
    for name in ("r_from_wx", "r_from_rh", "z_from_wx", "z_from_rh", "g_from_wx"):
        f = _pow2_shifts(t, name)
        if f is None:
            return None
        parts[name + "_lsh"], parts[name + "_rsh"] = f
    r = _net_shift(t, "g_from_rrh")
    if bool((r < 8).any()):
        return None
    parts["g_from_rrh_rsh"] = r.clamp(max=39).to(torch.int32)  # shifts by R - 8 <= 31
    r = int(_net_shift(t, "zh").reshape(-1)[0])
    if r < 8:
        return None
    v["zh_sh"], v["zh_m32"] = min(r, 39), 0
    r = _net_shift(t, "zg")
    if bool((r < 0).any()):
        return None
    v["zg_rsh"] = int(r.reshape(-1)[0].clamp(max=31))
    v["zg_lsh"] = v["zg_m32"] = 0
    if v["hg"]:  # h -> h_gemm (gemm_operand32): |q_h - Z_h| < 2^17
        f = _pow2_shifts(t, "hg")
        if f is None:
            return None
        v["hg_lsh"], v["hg_rsh"] = (int(x.reshape(-1)[0]) for x in f)
        v["hg_m32"] = 0
    for name in ("Wx", "Rh"):
        r = _net_shift(t, name)
        if bool((r < 1).any()) or bool((r > 30).any()):
            return None
        bias = t[name + "_bias"]
        hi = torch.div(bias, 1 << r, rounding_mode="floor")
        parts[name + "_bias_hi"] = hi.to(torch.int32)
        parts[name + "_bias_lo"] = (bias - hi * (1 << r)).to(torch.int32)
        parts[name + "_rshift"] = r.to(torch.int32)
        parts[name + "_zp32"] = t[name + "_zp"].to(torch.int32)
    zeros = torch.zeros(v["H"], dtype=torch.int32, device=bias.device)  # the multiplier form's fields, unused here
    parts.update({f"{name}_m": zeros for name in MULT_RESCALES})
    parts.update({f"{name}_mult32": zeros.repeat(3) for name in ("Wx", "Rh")})
    return parts


# The per-channel rescales of the int32 cell in multiplier form, in the order of their kMult fields.
MULT_RESCALES = ("r_from_wx", "r_from_rh", "z_from_wx", "z_from_rh", "g_from_wx", "g_from_rrh")


def _product_range(a: Tuple, b: Tuple) -> Tuple:
    """[lo, hi] of x y for x in [a0, a1], y in [b0, b1] (ints or per-channel int64 tensors)."""
    dev = next((v.device for v in (*a, *b) if isinstance(v, torch.Tensor)), torch.device("cpu"))
    corners = [torch.as_tensor(x, dtype=torch.int64, device=dev) * torch.as_tensor(y, dtype=torch.int64, device=dev)
               for x in a for y in b]
    lo, hi = corners[0], corners[0]
    for c in corners[1:]:
        lo, hi = torch.minimum(lo, c), torch.maximum(hi, c)
    return lo, hi


def _acc32_mult(t: Dict[str, torch.Tensor], v: Dict[str, int]) -> Optional[Dict[str, torch.Tensor]]:
    """The multiplier form's fields, or None (csrc/qgru_cell.h, the int32 cell's multiplier bounds).

    A rescale (m, s) becomes (mul_hi32(x << lsh, m) >> rsh + 1) >> 1 with lsh = max(0, 33 - s),
    rsh = max(0, s - 33); it is exact where every input x, known to lie in [x_lo, x_hi] from its
    grids, keeps x 2^lsh inside int32. r * Rh_g and z * h are rescaled in int64
    (rescale_wide32) and need s >= 17 and a result below 2^29."""
    H = v["H"]

    def shifts(name: str, x_lo, x_hi):
        m, s = t[name + "_mult"], t[name + "_shift"].to(torch.int64)
        lsh, rsh = (33 - s).clamp(min=0), (s - 33).clamp(min=0)
        step = torch.ones_like(lsh) << lsh.clamp(max=32)
        fits = ((torch.as_tensor(x_lo, device=step.device) * step >= -(1 << 31))
                & (torch.as_tensor(x_hi, device=step.device) * step < (1 << 31))
                & (m >= 0) & (m < (1 << 31)))
        return (lsh.to(torch.int32), rsh.to(torch.int32), m.to(torch.int32)) if bool(fits.all()) else None

    def rel(name: str, zp):  # [lo - Z, hi - Z] of a grid
        return v[name + "_lo"] - zp, v[name + "_hi"] - zp

    d_wx = rel("Wx", t["Wx_zp"])  # per channel [3H]
    d_rh = rel("Rh", t["Rh_zp"])
    gate = {g: slice(q * H, (q + 1) * H) for q, g in enumerate("rzg")}
    parts = {}
    for name, (lo, hi) in (
            ("r_from_wx", d_wx), ("z_from_wx", d_wx), ("g_from_wx", d_wx), ("r_from_rh", d_rh), ("z_from_rh", d_rh)):
        g = gate[name[0]]
        f = shifts(name, lo[g], hi[g])
        if f is None:
            return None
        parts[name + "_lsh"], parts[name + "_rsh"], parts[name + "_m"] = f
    def wide(name: str, y_lo, y_hi):
        """rescale_wide32's (s - 17, m) of a product in [y_lo, y_hi]: floor(y m / 2^16), then
        >> (s - 17); |y| m / 2^(s - 1) < 2^29 keeps it in int32. None where that fails."""
        m, s = t[name + "_mult"], t[name + "_shift"].to(torch.int64)
        y_max = torch.maximum(-y_lo, y_hi)
        if bool((s < 17).any()) or bool((m < 0).any()) or bool((m >= (1 << 31)).any()) \
                or bool(((y_max * m) >> (s - 1) >= (1 << 29)).any()):
            return None
        return (s - 17).to(torch.int32), m.to(torch.int32)

    f = wide("g_from_rrh", *_product_range(rel("r", v["r_zp"]), (d_rh[0][gate["g"]], d_rh[1][gate["g"]])))
    zh = wide("zh", *_product_range(rel("z", v["z_zp"]), rel("h", v["h_zp"])))
    if f is None or zh is None:
        return None
    parts["g_from_rrh_rsh"], parts["g_from_rrh_m"] = f
    v["zh_sh"], v["zh_m32"] = (int(x.reshape(-1)[0]) for x in zh)
    zg_range = _product_range((v["one_z"] - (v["z_hi"] - v["z_zp"]), v["one_z"] - (v["z_lo"] - v["z_zp"])),
                              rel("g", v["g_zp"]))
    f = shifts("zg", *zg_range)
    if f is None:
        return None
    v["zg_lsh"], v["zg_rsh"], v["zg_m32"] = (int(x.reshape(-1)[0]) for x in f)
    if v["hg"]:  # h -> h_gemm
        f = shifts("hg", *rel("h", v["h_zp"]))
        if f is None:
            return None
        v["hg_lsh"], v["hg_rsh"], v["hg_m32"] = (int(x.reshape(-1)[0]) for x in f)
    for name, K in (("Wx", v["I"]), ("Rh", H)):
        bias = t[name + "_bias"]
        acc_max = K * (1 << 14) + bias.abs()  # |G + bias|
        f = shifts(name, -acc_max, acc_max)
        if f is None or bool((bias.abs() >= (1 << 31)).any()):
            return None
        parts[name + "_bias_hi"] = bias.to(torch.int32)  # the whole bias
        parts[name + "_bias_lo"], parts[name + "_rshift"], parts[name + "_mult32"] = f  # lsh, rsh, m
        parts[name + "_zp32"] = t[name + "_zp"].to(torch.int32)
    return parts


# The fields of csrc Cell32's channel-blocked array, in the order of csrc/qgru_cell.h's
# Cell32Field; "{name}:{q}" is gate q's slice (channels q H .. q H + H - 1) of a [3H] tensor.
# In multiplier form bias_hi holds the whole bias, bias_lo the left shift and rshift the right
# shift of a requantization (qgru_cell.h, AccRequant32); pow2 layers leave the "_m" and "_mult32"
# fields at 0.
CELL32_FIELDS = (
    "r_from_wx_lsh", "r_from_wx_rsh", "r_from_rh_lsh", "r_from_rh_rsh", "z_from_wx_lsh", "z_from_wx_rsh",
    "z_from_rh_lsh", "z_from_rh_rsh", "g_from_wx_lsh", "g_from_wx_rsh", "g_from_rrh_rsh",
    *(f"{acc}_{f}:{q}" for acc in ("Rh", "Wx") for q in range(3) for f in ("bias_hi", "bias_lo", "rshift", "zp32")),
    *(f"{name}_m" for name in MULT_RESCALES), *(f"{acc}_mult32:{q}" for acc in ("Rh", "Wx") for q in range(3)),
)
CELL32_BLOCK = 128  # csrc kCell32Block


def _channel_blocks(parts: Dict[str, torch.Tensor], H: int) -> torch.Tensor:
    """int32 [ceil(H / 128), len(CELL32_FIELDS), 128]: field f of channel j at [j // 128, f, j % 128]
    (the padding channels are 0; no kernel reads them)."""
    rows = []
    for name in CELL32_FIELDS:
        key, _, q = name.partition(":")
        x = parts[key]
        rows.append(x[int(q) * H:(int(q) + 1) * H] if q else x)
    fields = torch.stack(rows)  # [F, H]
    blocks = -(-H // CELL32_BLOCK)
    padded = torch.zeros(len(CELL32_FIELDS), blocks * CELL32_BLOCK, dtype=torch.int32, device=fields.device)
    padded[:, :H] = fields
    return padded.reshape(len(CELL32_FIELDS), blocks, CELL32_BLOCK).permute(1, 0, 2).contiguous()


def _act_bytes(paths: List[Dict[str, object]], name: str) -> int:
    """A path's activation bytes from cpu_paths(): 1 on the int8 paths (amx, avx512vnni, avxvnni)."""
    return next((int(i["act_bytes"]) for i in paths if i["name"] == name), 0)


def _avx2_takes_whole(p: LayerParams) -> bool:
    """Whether p has a 16-bit x or R.h operand that avx2 takes whole as int16, so that its step is
    one fused pass there against two limb pairs per GEMM on the int8 paths."""
    b = p.bits
    return max(b["x"], b[recurrent_operand(b)]) > 8 and one_limb_pair(p, act16=True)


def layer_path(p: LayerParams, path: str, request: str) -> str:
    """The CPU path a layer runs on when the request ``request`` resolved to ``path``: ``path``, but
    for an auto request on avxvnni a layer that avx2 takes whole (_avx2_takes_whole) runs on avx2,
    whose int16 operands beat avxvnni's two limbs there (w8a16, T=100 N=64 I=256 H=512: 94 against
    113 ms, bench.py on lscpu "Intel(R) Xeon(R) Processor", 2026-11-25). amx and avx512vnni stay
    ahead of avx2 there (31 and 59 ms). A forced path (QGRU_CPU_ISA) is taken as asked."""
    if request == "auto" and path == "avxvnni" and _avx2_takes_whole(p) and \
            any(i["name"] == "avx2" and i["usable"] for i in cpu_paths()):
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
    * amx, avx512vnni or avxvnni, a layer with a 16-bit x or R.h operand that avx2 takes whole as
      int16 (one fused pass there, against two limb pairs per GEMM and a pass per GEMM on the int8
      paths): w8a16 57 us (amx) and 44 us (avx512vnni) against 37 us per step (bench.py, 2026-11-25)."""
    paths = cpu_paths()
    usable = {str(i["name"]) for i in paths if i["usable"]}
    if path == "amx" and "avx512vnni" in usable and one_limb_pair(p, act16=False):
        return "avx512vnni"
    if _act_bytes(paths, path) == 1 and "avx2" in usable and _avx2_takes_whole(p):
        return "avx2"
    return None


def cpu_isa_request() -> str:
    """The CPU path new CPU layers ask for: QGRU_CPU_ISA (auto, portable, avx2, avxvnni, avx512vnni,
    amx)."""
    return os.environ.get("QGRU_CPU_ISA", "auto").strip().lower() or "auto"


def cpu_paths() -> List[Dict[str, object]]:
    """Every CPU path of the built backend, fastest first: name, usable here, why not, act_bytes
    (0: not compiled in), needs (the CPU features it requires, by gcc target-attribute name)."""
    return [dict(name=n, usable=ok, why=why, act_bytes=ab, needs=list(needs))
            for n, ok, why, ab, needs in load("cpu").isa_table()]


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
    "avx512vnni": "AVX-512 VNNI int8 dot products",
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
    if info["name"] == "avxvnni" and "avx2" in usable and cpu_isa_request() == "auto":
        one_row += "; a layer with 16-bit x or h that avx2 takes whole as int16 runs on avx2 (one fused pass)"
    elif info["act_bytes"] == 1 and "avx2" in usable:
        one_row += ("; a streaming step of a layer with 16-bit x or h that avx2 takes whole as int16 runs on avx2 "
                    "(one fused pass instead of two limb pairs per GEMM)")
    return (f"path {info['name']}: {_PATH_TEXT.get(str(info['name']), info['name'])}, {why}; one fused pass per "
            f"step where x, the R.h operand (h or h_gemm), W and R take one limb each{one_row}; CPU: {mod.cpu_model()}"
            + (f"; not usable here: {'; '.join(skipped)}" if skipped else ""))


def _warn_forked_child(mod) -> None:
    """Once per process: a child of fork runs the cpu backend on one thread (_after_fork_in_child),
    which is slower where torch would use more (a DataLoader worker sets one thread itself)."""
    if _state.warned_fork or not mod.forked_child() or torch.get_num_threads() <= 1:
        return
    _state.warned_fork = True
    import warnings
    warnings.warn("qgru cpu backend: this process is a child of fork(), where OpenMP's thread pool does not "
                  "work (a parallel region can wait forever for threads of the parent): qgru's CPU kernels run "
                  f"on the calling thread here, not on torch's {torch.get_num_threads()} threads. Start worker "
                  "processes with the 'spawn' or 'forkserver' method for multi-threaded inference in them, or "
                  "call torch.set_num_threads(1) in the child to silence this.", RuntimeWarning, stacklevel=3)


class NativeLayer:
    """One layer and direction on one native backend: the C++ Layer and the tensors it points into.

    ``isa`` (CPU only): the instruction-set path (None: QGRU_CPU_ISA, default "auto", the fastest
    usable one). ``gemm`` says which path the layer took, as the built Layer reports it ("avx2-fused",
    "portable", ...; "-fused": one pass per step; "cublas" on CUDA)."""

    def __init__(self, kind: str, p: LayerParams, device: torch.device, isa: Optional[str] = None) -> None:
        mod = load(kind)
        if kind == "cpu":
            _warn_forked_child(mod)
            info = resolve_cpu_isa(isa)
            request = cpu_isa_request() if isa is None else isa.strip().lower()
            name = layer_path(p, str(info["name"]), request)
            if name != info["name"]:
                info = resolve_cpu_isa(name)
            # prepared on the host, then moved once
            tensors, values = prepare_layer(p.to("cpu"), act16=info["act_bytes"] == 2)
            self.layer = mod.Layer(tensors, values, str(info["name"]))
            other = one_row_path(p, str(info["name"]))
            if other is not None:
                act16 = resolve_cpu_isa(other)["act_bytes"] == 2
                if act16 != (info["act_bytes"] == 2):
                    tensors, values = prepare_layer(p.to("cpu"), act16=act16)
                self.layer.set_one_row(tensors, values, other)
        else:
            tensors, values = prepare_layer(p.to("cpu"), gemm_min=CUDA_GEMM_MIN)
            self.layer = mod.Layer({k: x.to(device) for k, x in tensors.items()}, values)
        self.kind = kind
        # what the built Layer reports (no default here: a Layer without it is a build mismatch,
        # and the tests' check of the path must see what the extension says)
        self.gemm = self.layer.gemm
        # CPU: the path whose Layer runs one-step calls of a batch of one ("": this one, one_row_path)
        self.one_row_gemm = self.layer.one_row_gemm if kind == "cpu" else ""

    def __call__(self, qx: torch.Tensor, qh0: torch.Tensor, lengths: Optional[torch.Tensor]):
        return self.layer.forward(qx, qh0, lengths)


def resolved(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` with its lazy view state applied: a negative or conjugate view (torch._neg_view(x),
    x.conj().imag) stores values whose sign torch applies only when it reads them. Native code reads
    the raw memory behind data_ptr(), so every tensor is resolved before it is handed over (a no-op,
    no copy, for an ordinary tensor)."""
    return None if t is None else t.resolve_conj().resolve_neg()


def gru_direction(kind: str, isa: Optional[str] = None):
    """A backend's gru_direction(p, qx, qh0, lengths): the native Layer is made once per LayerParams
    and CPU path (``isa``: see NativeLayer).

    Under torch.inference_mode() the Layer is made and run with inference mode off: it keeps
    workspaces (and the CUDA backend its buffers) from call to call, and a workspace made as an
    inference tensor could not be written by a later call outside inference mode (a Lightning
    predict, which runs under inference_mode, followed by any other call)."""
    def run(p: LayerParams, qx: torch.Tensor, qh0: torch.Tensor, lengths: Optional[torch.Tensor] = None):
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                return run(p, qx, qh0, lengths)
        qx, qh0, lengths = resolved(qx), resolved(qh0), resolved(lengths)
        cache = _native_cache(p)
        key = (kind, str(qx.device), (cpu_isa_request() if isa is None else isa) if kind == "cpu" else "")
        if key not in cache:
            cache[key] = NativeLayer(kind, p, qx.device, isa)
        return cache[key](qx, qh0, lengths)
    return run


def _cpu_layer(p: LayerParams, isa_request: str) -> "NativeLayer":
    """The CPU NativeLayer of p for this path request (the one gru_direction makes and caches)."""
    cache = _native_cache(p)
    key = ("cpu", "cpu", isa_request)
    if key not in cache:
        cache[key] = NativeLayer("cpu", p, torch.device("cpu"), isa_request)
    return cache[key]


def cpu_stack_plan(params: List[List[LayerParams]], req: str):
    """The native Stack (the layers' native Layers and per-layer grid values) of a unidirectional
    stack on CPU path request ``req``, made once and cached beside the first layer's Layers; None
    where the one-call form does not apply (a bidirectional stack, or a per-channel requantization
    between layers). Made outside inference mode (the Layers keep tensors)."""
    return _stack_plan(params, ("cpu-stack", req, len(params)),
                       lambda rows: load("cpu").Stack([_cpu_layer(p, req).layer for (p,) in params], rows))


def _stack_plan(params: List[List[LayerParams]], key: Tuple, make: Callable[[List[List[float]]], object]):
    """cpu_stack_plan's and cuda_stack_plan's cache: ``make(rows)`` builds the backend's Stack from
    stack_values' rows.

    One plan per key (path request or device, and depth: one LayerParams may head stacks of other
    depths, as qgru.compare runs a model's first layers alone), kept beside the first layer's
    Layers with the LayerParams of the layers below it, and used only while the stack holds those
    same objects: LayerParams are shared between models (QuantParams.to_module), and a key of their
    ids could match a later object at a freed one's address. A stack that heads with the same first
    layer but differs below it makes its own plan and replaces the kept one."""
    if len(params[0]) != 1:
        return None
    cache = _native_cache(params[0][0])
    entry = cache.get(key)
    if entry is not None and (len(params) == 1 or all(a is row[0] for a, row in zip(entry[0], params[1:]))):
        return entry[1]
    if any(len(row) != 1 for row in params):
        return None
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            return _stack_plan(params, key, make)
    rows = stack_values(params)
    plan = None if rows is None else make(rows)
    cache[key] = (tuple(row[0] for row in params[1:]), plan)  # None: a per-channel requantization between layers
    return plan


def stack_values(params: List[List[LayerParams]]) -> Optional[List[List[float]]]:
    """The native Stack's per-layer values of a unidirectional stack: (S_x, Z_x, bits_x, S_h, Z_h,
    bits_h, multiplier, shift of layer l - 1's h grid onto layer l's x grid; 1, 1 for layer 0), or
    None where a layer's requantization is per channel (the Stack takes one factor per layer)."""
    rows = []
    for layer, (p,) in enumerate(params):
        m, s = (1, 1)
        if layer > 0:
            r = p.rescale["in_0"]
            if r.multiplier.numel() != 1:
                return None
            m, s = int(r.multiplier), int(r.shift)
        rows.append([float(p.scale["x"]), float(int(p.zp["x"])), float(p.bits["x"]), float(p.scale["h"]),
                     float(int(p.zp["h"])), float(p.bits["h"]), float(m), float(s)])
    return rows


def cpu_stack_forward(params: List[List[LayerParams]], x: torch.Tensor, hx: torch.Tensor, resolve: bool = True):
    """A unidirectional stack without padding in one native call (float x [T, N, I] and h0
    [L, N, H] in; float32 output [T, N, H] and h_n [L, N, H] out), or None where it does not
    apply (cpu_stack_plan). The same integers as the layer-by-layer path (tests/test_native.py),
    without its Python round trips, which for one step of a batch of one cost more than the layer
    itself. It runs in the caller's mode: the C++ makes what it keeps across calls (workspaces,
    reused buffers) outside inference mode itself (leaving inference mode here for every call cost
    a streaming call ~5 us of its ~40). ``resolve=False``: the caller has checked that neither x
    nor hx is a negative view (float tensors are never conjugate views)."""
    plan = cpu_stack_plan(params, cpu_isa_request())
    if plan is None:
        return None
    return plan.forward(resolved(x), resolved(hx)) if resolve else plan.forward(x, hx)


def _cuda_layer(p: LayerParams, device: torch.device) -> "NativeLayer":
    """The CUDA NativeLayer of p on ``device`` (the one gru_direction makes and caches)."""
    cache = _native_cache(p)
    key = ("cuda", str(device), "")
    if key not in cache:
        cache[key] = NativeLayer("cuda", p, device)
    return cache[key]


def cuda_stack_plan(params: List[List[LayerParams]], device: torch.device):
    """The CUDA backend's Stack (csrc/qgru_cuda.cpp CudaStack: the layers' CUDA Layers and the
    per-layer grid values, as cpu_stack_plan's) of a unidirectional stack on ``device``, made once
    and cached beside the first layer's Layers (kept while the stack holds the same LayerParams
    below it, as cpu_stack_plan's); None where the one-call form does not apply (bidirectional, or
    a per-channel requantization between layers). Making it reads the parameters' values on the
    host (a device-to-host copy when they are on the GPU): the first call of a model on a device
    must therefore run outside a CUDA graph capture, as torch.cuda.graph's warm-up asks anyway."""
    return _stack_plan(params, ("cuda-stack", str(device), len(params)),
                       lambda rows: load("cuda").Stack([_cuda_layer(p, device).layer for (p,) in params], rows))


def cuda_stack_forward(params: List[List[LayerParams]], x: torch.Tensor, hx: torch.Tensor, resolve: bool = True):
    """A unidirectional stack without padding in one native call on the GPU (float x [T, N, I] and
    h0 [L, N, H] in, float32 output [T, N, H] and h_n [L, N, H] out), or None where it does not
    apply (cuda_stack_plan). The same integers as the layer-by-layer path; no host work in it waits
    for the GPU (docs/spec.md section 11), so a caller's torch.cuda.graph can capture it.
    ``resolve=False``: the caller has checked that neither x nor hx is a negative view."""
    plan = cuda_stack_plan(params, x.device)
    if plan is None:
        return None
    return plan.forward(resolved(x), resolved(hx)) if resolve else plan.forward(x, hx)


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
