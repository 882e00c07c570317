"""Building and loading the native extensions (csrc/), and the process state they share.

Extensions are compiled on first use (or ahead of time with ``python -m qgru build``) with
``torch.utils.cpp_extension``, into a cache folder whose name includes the torch version, the
Python ABI, a hash of the sources and flags, and the machine; a failure is recorded and reported
by ``qgru.backends()`` (why_unavailable). A cached binary is loaded only if the torch version
compiled into it equals the running one; otherwise it is refused (and rebuilt). The CUDA backend
links torch's own cuBLAS (find_cublas).

Also here: the per-LayerParams cache of native Layers (_native_cache) and what a fork's child
drops of it (_after_fork_in_child).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import sys
import sysconfig
import threading
import weakref
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..golden import LayerParams

_HERE = Path(__file__).resolve().parent.parent  # the qgru package folder
_KINDS = ("cpu", "cuda")
# the CPU backend: the driver, the run-time path choice, and one file per instruction-set path
# (csrc/cpu/kernels.h describes them), each of which sets its own target
_CPU_PATHS = ("portable", "avx2", "avxvnni", "avx512vnni", "amx")
_SOURCES = {
    "cpu": ["cpu/qgru_cpu.cpp", "cpu/bind_cpu.cpp", "cpu/isa.cpp", "cpu/op_cpu.cpp"] + [f"cpu/kernel_{p}.cpp" for p in _CPU_PATHS],
    "cuda": ["qgru_cuda.cpp", "bind_cuda.cpp", "op_cuda.cpp", "qgru_cuda_kernels.cu", "qgru_cuda_persistent.cu",
             "qgru_cuda_fused.cu"],
}
# every header the sources include: the build's cache key hashes them, so an edit to any of them
# rebuilds (tests/test_native.py checks that this list and _SOURCES cover every file in csrc/)
_HEADERS = ["qgru_fixedpoint.h", "qgru_cell.h", "qgru_check.h", "qgru_layer.h", "qgru_cuda.h", "qgru_cuda_launch.h",
            "qgru_persistent.h", "qgru_fused_step.h", "qgru_cuda_backend.h", "cpu/kernels.h", "cpu/cell_loops.h", "cpu/isa.h",
            "cpu/quantize_block.h", "cpu/lanes_avx2.h", "cpu/lanes_avx512.h", "cpu/vnni_gemm.h", "cpu/cpu_backend.h",
            "cpu/vnni16_gemm.h", "cpu/gemm_blocks.h", "qgru_op_spec.h", "qgru_op_loop.h"]


def csrc_dir() -> Path:
    """csrc/ of an installed wheel (qgru/csrc) or of a source checkout (../csrc)."""
    for d in (_HERE / "csrc", _HERE.parent / "csrc"):
        if (d / "qgru_cell.h").is_file() and (d / "cpu" / "kernels.h").is_file():
            return d
    raise FileNotFoundError("qgru's csrc/ folder is missing from this installation")


@contextlib.contextmanager
def build_guard(d: Path, *more: Path):
    """Held around a torch.utils.cpp_extension build into ``d`` (and ``more``): an exclusive
    flock on ``d/.qgru-build.lock`` (the kernel drops it when its holder exits, killed or not)
    for the whole build, and under it the ``lock`` file that cpp_extension's FileBaton leaves
    behind when a build is killed is removed: that file alone makes every later build of the
    folder wait on it forever. A second process building the same folder waits here, and says so."""
    d.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no flock (Windows): cpp_extension's own baton, stale files and all
        yield
        return
    fd = os.open(d / ".qgru-build.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"qgru: waiting for another process that builds into {d}...", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        for folder in (d,) + more:
            stale = folder / "lock"
            if stale.exists():  # no qgru build is running here (we hold the flock): a killed one's
                print(f"qgru: removing {stale}, left by a build that was killed", file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


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


def cuda_arch_key() -> str:
    """The GPU architectures a cuda build compiles for, as torch.utils.cpp_extension picks them:
    TORCH_CUDA_ARCH_LIST where set, else the compute capability of every visible GPU. Part of the
    cuda build's cache key, so that a cache shared between machines with other GPUs (a home folder
    on a cluster) never loads a binary without a kernel image for this one."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return "arch list " + env
    caps = set()
    try:
        if torch.cuda.is_available():
            caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    except Exception:  # noqa: BLE001 - no usable GPU: the build is refused later, with the reason
        caps = set()
    return "devices " + ",".join(f"sm_{a}{b}" for a, b in sorted(caps))


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
        h.update((cuda_arch_key() + " cuda " + str(torch.version.cuda)).encode())
    abi = sysconfig.get_config_var("SOABI") or sys.version
    return f"{kind}-torch{torch.__version__}-{abi}-{h.hexdigest()[:12]}".replace("+", "_")


def build_dir(kind: str) -> Path:
    root = Path(os.environ.get("QGRU_BUILD_DIR", Path.home() / ".cache" / "qgru"))
    return root / build_key(kind)


def _ext_name(kind: str) -> str:
    return f"qgru_{kind}_ext"


# The cpu backend is two files: a library without Python (every source but the binding: the kernels,
# the Layer, and the operator qgru::integer_gru, csrc/cpu/op_cpu.cpp), which torch.ops.load_library
# or a C++ program's dlopen loads, and the pybind11 module (bind_cpu.cpp), linked against it.
CPU_LIBRARY = "qgru_cpu_ops"
_CPU_BINDING = "cpu/bind_cpu.cpp"


def library_path(build: bool = True) -> Path:
    """The cpu backend's library without Python (qgru::integer_gru and the kernels), building it if
    needed: ``torch.ops.load_library(path)`` in a process that never imports qgru, or dlopen in a
    C++ program, registers the operator; ``python -m qgru build --print-path`` prints it. In a
    process that also imports qgru, load this very file (not a copy): qgru's binding links it by
    this path, and a second copy would register the operator twice (an abort)."""
    load("cpu", build=build)
    return _library_file(build_dir("cpu"), "cpu")


def _cpu_library_file(d: Path) -> Path:
    return _library_file(d, "cpu")


# The cuda backend likewise: a library without Python (the kernels, the Layer and Stack, and the
# operator's CUDA kernel, csrc/op_cuda.cpp) and the binding (bind_cuda.cpp) linked against it.
CUDA_LIBRARY = "qgru_cuda_ops"
_CUDA_BINDING = "bind_cuda.cpp"


def cuda_library_path(build: bool = True) -> Path:
    """The cuda backend's library without Python (qgru::integer_gru's CUDA kernel), building it if
    needed. A process that never imports qgru loads library_path() (which defines the operator)
    and then this one; in a process that imports qgru, loading the cuda backend loaded it."""
    load("cuda", build=build)
    return _library_file(build_dir("cuda"), "cuda")


def _library_file(d: Path, kind: str) -> Path:
    return d / "lib" / f"{CPU_LIBRARY if kind == 'cpu' else CUDA_LIBRARY}.so"


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
    call on the Layer would wait for it forever. Its workspaces may be half-written too.
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
    _mark_used(path.parent)
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
        kw["with_cuda"] = True  # (the binding alone has no .cu source)
    lib = _library_file(d, kind)
    with build_guard(d, lib.parent):  # (the library's own folder)
        print(f"qgru: compiling the {kind} backend into {d} (once; about a minute)...", file=sys.stderr, flush=True)
        # first the library without Python (--as-needed drops the libtorch_python that
        # cpp_extension links: nothing in it uses Python), loaded into this process as it is built
        binding = _CPU_BINDING if kind == "cpu" else _CUDA_BINDING
        lib.parent.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(**dict(kw, name=lib.stem, sources=[str(src / s) for s in _SOURCES[kind] if s != binding],
                                  build_directory=str(lib.parent), is_python_module=False,
                                  extra_ldflags=["-Wl,--as-needed"] + kw["extra_ldflags"]))
        # then the binding, linked by the library's full path (the same object once loaded)
        kw["sources"] = [str(src / binding)]
        kw["extra_ldflags"] = kw["extra_ldflags"] + [str(lib), f"-Wl,-rpath,{lib.parent}"]
        mod = cpp_extension.load(**kw)
    _mark_used(d)
    _prune_stale(kind, d)
    return mod


# A build of another source (another qgru version or checkout sharing this torch and ABI) is
# removed once no process has loaded it for this long: two environments that load their own builds
# side by side must not remove each other's (a process that finds its build gone rebuilds it, or,
# with QGRU_NO_BUILD=1, fails: a test run did, beside a second checkout's build).
_PRUNE_AFTER_S = 7 * 24 * 3600
_USED_STAMP = ".qgru-last-load"


def _mark_used(d: Path) -> None:
    """Record that a process loads the build in ``d`` now (_prune_stale reads it)."""
    try:
        (d / _USED_STAMP).touch()
    except OSError:  # a read-only cache: nothing prunes it either
        pass


def _prune_stale(kind: str, current: Path) -> None:
    """Remove this environment's builds of ``kind`` of other sources or flags (same torch and ABI)
    that no process has loaded for _PRUNE_AFTER_S."""
    import shutil
    import time
    prefix = current.name[: current.name.rindex("-") + 1]
    now = time.time()
    for d in current.parent.glob(prefix + "*"):
        if d == current or not d.is_dir():
            continue
        stamp = d / _USED_STAMP
        try:
            last = stamp.stat().st_mtime if stamp.exists() else d.stat().st_mtime
        except OSError:
            continue
        if now - last > _PRUNE_AFTER_S:
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
