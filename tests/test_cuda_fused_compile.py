"""The fused step kernel (csrc/qgru_cuda_fused.cu) without a GPU: its word loads against the byte
fragment maps the host emulation runs (a host program), and its machine code, compiled by nvcc as
the cuda build compiles it (-O3) for sm_80 and sm_90: ptxas reports no stack frame and no spills,
and the SASS of every instantiation holds the int8 tensor-core instruction (IMMA), no called
subroutine (a 64-bit division or an out-of-line function in the step would be one: a CALL to code
ending in RET; the only CALL allowed is ptxas's loop-exit idiom on sm_80, a predicated
CALL.REL.NOINC to the EXIT right after it) and no local memory.

The SASS checks need cuobjdump (beside nvcc, on PATH, or the copy Triton's wheel ships); skipped
with the reason where nvcc or cuobjdump is absent.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from qgru.native import csrc_dir

from test_cuda_compile import NVCC, _fetch_cublas_headers, _host_check, _include_dirs_with

_WORDS_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include "qgru_fused_step.h"

using namespace qgru::cuda;
typedef long long ll;

static unsigned rng = 77u;
static int8_t rand8() { rng = rng * 1103515245u + 12345u; return (int8_t)((int)((rng >> 16) % 255) - 127); }
static uint32_t word(const int8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
static uint8_t byte_of(uint32_t w, int b) { return (uint8_t)(w >> (8 * b)); }  // byte b: element 4r + b

// The kernel's loads (fs_load_a_words, fs_load_b_words: one 32-bit word per register) against the
// byte maps the emulation runs (fs_load_a, fs_load_b), for every lane, tile and k step, including
// k steps past K_pad (K_pad a multiple of 16, not of 32) and units / rows past H / N; the buffers
// hold random bytes everywhere, padding included, so a load that reads padding shows.
static int check(ll H, ll N, ll K_pad) {
  const ll M = 3 * H + 16;
  std::vector<int8_t> R((size_t)(M * K_pad)), h((size_t)((N + 8) * K_pad));
  for (auto& v : R) v = rand8();
  for (auto& v : h) v = rand8();
  const FsShape s = fs_shape(H, N, K_pad, 8);
  for (ll cta = 0; cta < s.ctas; ++cta)
    for (ll kstep = 0; kstep < s.k_steps + 1; ++kstep)
      for (int lane = 0; lane < 32; ++lane) {
        for (int tile = 0; tile < kFsTiles; ++tile) {
          int8_t a[16];
          uint32_t w[4];
          fs_load_a(R.data(), K_pad, H, cta, tile, kstep, lane, a);
          fs_load_a_words(R.data(), K_pad, H, cta, tile, kstep, lane, w, word);
          for (int i = 0; i < 16; ++i)
            if ((uint8_t)a[i] != byte_of(w[i / 4], i % 4)) {
              std::printf("A: H %lld K %lld cta %lld tile %d k step %lld lane %d element %d\n", H, K_pad, cta,
                          tile, kstep, lane, i);
              return 1;
            }
        }
        for (ll nt = 0; nt < s.nt_count + 1; ++nt) {
          int8_t b[8];
          uint32_t w[2];
          fs_load_b(h.data(), K_pad, N, nt, kstep, lane, b);
          fs_load_b_words(h.data(), K_pad, N, nt, kstep, lane, w, word);
          for (int i = 0; i < 8; ++i)
            if ((uint8_t)b[i] != byte_of(w[i / 4], i % 4)) {
              std::printf("B: N %lld K %lld n tile %lld k step %lld lane %d element %d\n", N, K_pad, nt, kstep,
                          lane, i);
              return 1;
            }
        }
      }
  return 0;
}

int main() {
  int bad = 0;
  const ll shapes[][3] = {{1, 1, 16}, {7, 3, 16}, {12, 5, 16}, {37, 9, 48}, {70, 17, 80}, {64, 64, 64}};
  for (const auto& sh : shapes) bad |= check(sh[0], sh[1], sh[2]);
  if (!bad) std::printf("FUSED-WORDS-OK\n");
  return bad;
}
"""


def test_fused_step_word_loads_are_the_byte_maps(tmp_path):
    """The kernel's 32-bit fragment loads hold, byte for byte (byte b of register r: element
    4r + b), the A and B fragments of the byte maps that the host emulation runs against the golden
    model (tests/test_cuda_fused_step.py), zero past K_pad, past H's units and past N's rows."""
    _host_check(tmp_path, "fused_words_check", _WORDS_CHECK, "FUSED-WORDS-OK")


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found is None and NVCC is not None:
        beside = Path(NVCC).resolve().parent / "cuobjdump"
        found = str(beside) if beside.is_file() else None
    if found is None:  # the copy in Triton's wheel (a CUDA 13 cuobjdump), without importing triton
        spec = importlib.util.find_spec("triton")
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            p = Path(root) / "backends" / "nvidia" / "bin" / "cuobjdump"
            if p.is_file():
                found = str(p)
    return found


# the kernels of csrc/qgru_cuda_fused.cu: the fused step (one launch per step) and the persistent
# fused step (one cooperative launch per window, QGRU_CUDA_FUSED=2), four instantiations each
_KERNELS = ["fused_step_kernel", "fused_persistent_kernel"]
_ARCHS = ["80", "90", "90a"]


@pytest.fixture(scope="module")
def fused_build(tmp_path_factory):
    """csrc/qgru_cuda_fused.cu compiled once per architecture (as the cuda build compiles it, -O3,
    warnings as errors, ptxas -v): arch -> (ptxas report, SASS)."""
    objdump = _cuobjdump()
    if objdump is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or Triton's wheel): the SASS check needs it")
    inc = _include_dirs_with("cublas_v2.h") or _fetch_cublas_headers()
    built = {}

    def get(arch):
        if arch not in built:
            obj = tmp_path_factory.mktemp("fused") / f"fused_{arch}.o"
            cmd = [NVCC, "-std=c++17", "-O3", "-c", str(csrc_dir() / "qgru_cuda_fused.cu"), "-o", str(obj), "-I",
                   str(csrc_dir()), "-I", str(inc), "-Werror", "all-warnings", "-Xptxas", "-v",
                   "-gencode", f"arch=compute_{arch},code=sm_{arch}"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
            d = subprocess.run([objdump, "-sass", str(obj)], capture_output=True, text=True, timeout=300)
            assert d.returncode == 0, d.stderr
            built[arch] = (r.stdout + r.stderr, d.stdout)
        return built[arch]
    return get


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the fused kernel's compile check needs the CUDA toolkit")
@pytest.mark.parametrize("kernel", _KERNELS)
@pytest.mark.parametrize("arch", _ARCHS)
def test_fused_step_kernel_sass(fused_build, arch, kernel):
    """csrc/qgru_cuda_fused.cu compiles (warnings as errors, -O3 as the build) for sm_<arch>; each of
    the four instantiations (pow2 x acc32) of `kernel` has no stack frame, no spill stores or loads
    (ptxas -v) and at most 128 registers, and its SASS holds IMMA.16832.S8.S8 (the two m16 gate tiles
    of a k step: at least two), no called subroutine (RET, or a CALL to anything but the EXIT after
    it) and no local-memory access (LDL / STL). The persistent fused step's also holds no atomic
    (ATOM / ATOMG / ATOMS / RED: its exchange is per-CTA flags, no shared counter) and its flag path:
    a strong GPU-scope store (the st.release of a CTA's flag) after a GPU memory barrier, and strong
    GPU-scope loads (the ld.acquire polls), one followed within four instructions by an L1
    invalidation."""
    report, sass = fused_build(arch)
    # ptxas -v: per entry "Compiling entry function '<name>'", then its stack / spill and register lines
    entries = re.split(r"Compiling entry function '", report)[1:]
    fused = [e for e in entries if kernel in e.split("'")[0]]
    assert len(fused) == 4, f"expected 4 instantiations of {kernel} in the ptxas report:\n{report}"
    for e in fused:
        name = e.split("'")[0]
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", e)
        regs = re.search(r"Used (\d+) registers", e)
        assert m and regs, f"no ptxas summary for {name}:\n{e}"
        assert m.groups() == ("0", "0", "0"), f"{name}: stack frame / spill stores / spill loads {m.groups()}"
        assert int(regs.group(1)) <= 128, f"{name}: {regs.group(1)} registers"
    functions = re.split(r"\n\s*Function : ", sass)[1:]
    kernels = [f for f in functions if kernel in f.split("\n")[0]]
    assert len(kernels) == 4, f"expected 4 {kernel} functions in the SASS, found {len(kernels)}"
    for f in kernels:
        name, body = f.split("\n")[0].strip(), f
        imma = re.findall(r"\bIMMA\.16832\.S8\.S8\b", body)
        assert len(imma) >= 2, f"{name}: {len(imma)} IMMA.16832.S8.S8 (the int8 mma.sync)"
        # no call: a subroutine (64-bit division, an out-of-line function) ends in RET, and every
        # CALL must be ptxas's loop-exit idiom on sm_80: a predicated "CALL.REL.NOINC" (no return
        # address pushed: a branch) over the loop's back branch (BRA) right after it
        code = dict(re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body))
        assert not re.search(r"\bRET\b", body), f"{name}: a RET (a called subroutine) in the step"
        for at, op, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?(CALL\.\S+)\s+0x([0-9a-f]+)",
                                         body):
            after = code.get(format(int(at, 16) + 0x10, "x").rjust(len(at), "0"), "").strip()
            exit_idiom = op == "CALL.REL.NOINC" and int(target, 16) == int(at, 16) + 0x20 and after.startswith("BRA")
            assert exit_idiom, f"{name}: {op} at 0x{at} to 0x{target} (then {after!r}), not the loop-exit idiom"
        assert not re.search(r"\bCALL\.ABS", body), f"{name}: an absolute CALL in the step"
        assert not re.search(r"\b(LDL|STL)\b", body), f"{name}: local memory in the step"
        if kernel != "fused_persistent_kernel":
            continue
        atomics = re.findall(r"\b(ATOMG?|ATOMS|RED|REDG)\.\S*", body)
        assert not atomics, f"{name}: atomics {atomics[:4]} (the exchange must be per-CTA flags)"
        ins = [v.strip() for v in code.values()]
        releases = [i for i, v in enumerate(ins) if re.search(r"\bSTG\.E\.STRONG\.GPU\b", v)]
        assert len(releases) == 1, f"{name}: {len(releases)} strong GPU-scope stores (one flag release)"
        assert any(re.search(r"\bMEMBAR\.\S*GPU\b", v) for v in ins[max(0, releases[0] - 8):releases[0]]), \
            f"{name}: no GPU memory barrier before the flag's store"
        polls = [i for i, v in enumerate(ins) if re.search(r"\bLDG\.E\.STRONG\.GPU\b", v)]
        assert any(any("CCTL.IVALL" in v for v in ins[i + 1:i + 5]) for i in polls), \
            f"{name}: no acquire load (a strong GPU-scope load, then the L1 invalidated)"
