"""A build that was killed must not hang the next one: torch.utils.cpp_extension guards a build
folder with a `lock` file (FileBaton) that a killed build leaves behind, and every later build of
that folder then waits on it forever (a CI run hung so, at the first weight-only build after a
killed one). qgru.native.build.build_guard holds a flock for the build and removes such a file
under it. These tests leave a stale `lock` where each of qgru's builders builds and check, through
torch's own FileBaton, that the build would go ahead (without the guard it would wait forever)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from qgru.native import build as native_build
from qgru.native.build import build_guard
from qgru.weight_only import cpu as wo_cpu

fcntl = pytest.importorskip("fcntl")


def _baton_free(folder: str) -> bool:
    """What cpp_extension does first in a build: True where it builds, False where it would wait."""
    baton = FileBaton(str(Path(folder) / "lock"))
    if baton.try_acquire():
        baton.release()
        return True
    return False


def test_a_stale_lock_is_removed_and_the_folder_held(tmp_path, capfd):
    (tmp_path / "lock").write_text("")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "lock").write_text("")
    with build_guard(tmp_path, tmp_path / "lib"):
        assert _baton_free(str(tmp_path)) and _baton_free(str(tmp_path / "lib"))
        # the flock is held: another holder is refused
        fd = open(tmp_path / ".qgru-build.lock", "rb")
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        fd.close()
    assert "left by a build that was killed" in capfd.readouterr().err
    fd = open(tmp_path / ".qgru-build.lock", "rb")
    fcntl.flock(fd.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the block
    fd.close()


def test_a_running_build_is_waited_for_not_broken(tmp_path):
    """A second process waits while the first holds the folder (and then finds no `lock` of a live
    build removed under it)."""
    holder = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from qgru.native.build import build_guard
        with build_guard(Path({str(tmp_path)!r})):
            (Path({str(tmp_path)!r}) / "lock").write_text("")   # a live build's baton
            print("held", flush=True)
            time.sleep(1.5)
            (Path({str(tmp_path)!r}) / "lock").unlink()
    """)
    p = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with build_guard(tmp_path):
            waited = time.monotonic() - t0
            assert _baton_free(str(tmp_path))
        assert waited > 0.5, waited
        assert p.wait(timeout=30) == 0, p.stderr.read()
    finally:
        p.kill()


def test_the_weight_only_build_goes_ahead(tmp_path, monkeypatch):
    monkeypatch.setenv("QGRU_CACHE", str(tmp_path))
    d = wo_cpu.build_dir()
    d.mkdir(parents=True)
    (d / "lock").write_text("")  # what a killed build leaves
    seen = []

    def fake_load_inline(**kw):
        seen.append(_baton_free(kw["build_directory"]))
        return "module"

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    monkeypatch.setattr(wo_cpu, "_state", {"module": None, "error": None})
    assert wo_cpu.load() == "module" and seen == [True]


def test_the_native_build_goes_ahead(tmp_path, monkeypatch):
    monkeypatch.setenv("QGRU_BUILD_DIR", str(tmp_path))
    d = native_build.build_dir("cpu")
    lib = native_build._cpu_library_file(d).parent
    lib.mkdir(parents=True)
    (d / "lock").write_text("")
    (lib / "lock").write_text("")
    seen = []

    def fake_load(**kw):
        seen.append((kw["build_directory"], _baton_free(kw["build_directory"])))
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(native_build, "_toolchain_has_avxvnni", lambda work: True)
    assert native_build._compile("cpu", verbose=False) == "module"
    assert seen == [(str(lib), True), (str(d), True)]


def test_other_builds_are_pruned_only_when_unused(tmp_path):
    """A build of other sources (another checkout or qgru version on this torch) that a process
    loaded recently stays: two environments side by side must not remove each other's builds (a
    test run beside a second checkout failed so, its build removed under QGRU_NO_BUILD=1)."""
    import os
    import time
    current = tmp_path / "cpu-torchX-abi-aaaa"
    recent, old, other_kind = (tmp_path / "cpu-torchX-abi-bbbb", tmp_path / "cpu-torchX-abi-cccc",
                               tmp_path / "cuda-torchX-abi-dddd")
    for d in (current, recent, old, other_kind):
        d.mkdir()
    native_build._mark_used(recent)
    native_build._mark_used(old)
    week_ago = time.time() - native_build._PRUNE_AFTER_S - 60
    os.utime(old / native_build._USED_STAMP, (week_ago, week_ago))
    os.utime(other_kind, (week_ago, week_ago))
    native_build._prune_stale("cpu", current)
    assert current.is_dir() and recent.is_dir() and other_kind.is_dir() and not old.exists()


def test_the_cuda_build_is_a_library_without_python_then_the_binding(tmp_path, monkeypatch):
    """The cuda backend builds as the cpu one: first the library without Python (every source but
    bind_cuda.cpp, the operator's CUDA kernel op_cuda.cpp among them, linked with cuBLAS) into
    lib/qgru_cuda_ops.so, then the binding alone, linked to that library by its path. (The
    compilers are not run: cpp_extension.load is recorded; on a GPU scripts/gpu_check.sh builds it.)"""
    monkeypatch.setenv("QGRU_BUILD_DIR", str(tmp_path))
    calls = []

    def fake_load(**kw):
        calls.append(kw)
        return "module"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(native_build, "_cublas_link_flags", lambda: ["/fake/libcublas.so.13"])
    assert native_build._compile("cuda", verbose=False) == "module"
    d = native_build.build_dir("cuda")
    lib, binding = calls
    assert lib["name"] == "qgru_cuda_ops" and lib["is_python_module"] is False and lib["with_cuda"] is True
    assert lib["build_directory"] == str(d / "lib")
    names = sorted(Path(s).name for s in lib["sources"])
    assert names == sorted(s for s in native_build._SOURCES["cuda"] if s != "bind_cuda.cpp") and "op_cuda.cpp" in names
    assert "-Wl,--as-needed" in lib["extra_ldflags"] and "/fake/libcublas.so.13" in lib["extra_ldflags"]
    assert binding["name"] == "qgru_cuda_ext" and binding.get("is_python_module", True) is True
    assert [Path(s).name for s in binding["sources"]] == ["bind_cuda.cpp"] and binding["with_cuda"] is True
    assert str(d / "lib" / "qgru_cuda_ops.so") in binding["extra_ldflags"]
    assert f"-Wl,-rpath,{d / 'lib'}" in binding["extra_ldflags"]
