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


_KERNEL = "fused_step_kernel"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the fused kernel's compile check needs the CUDA toolkit")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_fused_step_kernel_sass(tmp_path, arch):
    """csrc/qgru_cuda_fused.cu compiles (warnings as errors, -O3 as the build) for sm_<arch>; each of
    its four kernels (pow2 x acc32) has no stack frame, no spill stores or loads (ptxas -v) and at
    most 128 registers, and its SASS holds IMMA.16832.S8.S8 (the two m16 gate tiles of a k step: at
    least two), no called subroutine (RET, or a CALL to anything but the EXIT after it) and no
    local-memory access (LDL / STL)."""
    objdump = _cuobjdump()
    if objdump is None:
        pytest.skip("cuobjdump not found (CUDA toolkit or Triton's wheel): the SASS check needs it")
    inc = _include_dirs_with("cublas_v2.h") or _fetch_cublas_headers()
    obj = tmp_path / f"fused_{arch}.o"
    cmd = [NVCC, "-std=c++17", "-O3", "-c", str(csrc_dir() / "qgru_cuda_fused.cu"), "-o", str(obj), "-I",
           str(csrc_dir()), "-I", str(inc), "-Werror", "all-warnings", "-Xptxas", "-v",
           "-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    # ptxas -v: per entry "Compiling entry function '<name>'", then its stack / spill and register lines
    report = r.stdout + r.stderr
    entries = re.split(r"Compiling entry function '", report)[1:]
    fused = [e for e in entries if _KERNEL in e.split("'")[0]]
    assert len(fused) == 4, f"expected 4 instantiations of {_KERNEL} in the ptxas report:\n{report}"
    for e in fused:
        name = e.split("'")[0]
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", e)
        regs = re.search(r"Used (\d+) registers", e)
        assert m and regs, f"no ptxas summary for {name}:\n{e}"
        assert m.groups() == ("0", "0", "0"), f"{name}: stack frame / spill stores / spill loads {m.groups()}"
        assert int(regs.group(1)) <= 128, f"{name}: {regs.group(1)} registers"
    r = subprocess.run([objdump, "-sass", str(obj)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    functions = re.split(r"\n\s*Function : ", r.stdout)[1:]
    kernels = [f for f in functions if _KERNEL in f.split("\n")[0]]
    assert len(kernels) == 4, f"expected 4 {_KERNEL} functions in the SASS, found {len(kernels)}"
    for f in kernels:
        name, body = f.split("\n")[0].strip(), f
        imma = re.findall(r"\bIMMA\.16832\.S8\.S8\b", body)
        assert len(imma) >= 2, f"{name}: {len(imma)} IMMA.16832.S8.S8 (the int8 mma.sync)"
        # no call: a subroutine (64-bit division, an out-of-line function) ends in RET, and every
        # CALL must be ptxas's loop-exit idiom on sm_80 ("@P0 CALL.REL.NOINC" to the EXIT after it)
        code = dict(re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body))
        assert not re.search(r"\bRET\b", body), f"{name}: a RET (a called subroutine) in the step"
        for at, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?CALL\.\S+\s+0x([0-9a-f]+)", body):
            to = code.get(target.rjust(len(at), "0"), "")
            assert to.strip() == "EXIT", f"{name}: CALL at 0x{at} to 0x{target} ({to.strip()!r}), not the exit idiom"
        assert not re.search(r"\bCALL\.ABS", body), f"{name}: an absolute CALL in the step"
        assert not re.search(r"\b(LDL|STL)\b", body), f"{name}: local memory in the step"
