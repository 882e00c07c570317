"""The CUDA sources compile with nvcc, on machines without a GPU (CI): a syntax or template error
in csrc/qgru_cuda_kernels.cu or qgru_cuda_persistent.cu (every kernel, the shared cell header
instantiated for every template flag, the cuBLAS calls) fails the suite here, not first on a GPU
machine.

Skipped without nvcc. cuBLAS headers come from CUDA_HOME, an installed nvidia-cublas wheel,
QGRU_CUDA_HEADERS, or are fetched once (the nvidia-cublas wheel, headers only kept) into
~/.cache/qgru/cuda-headers.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qgru.native import csrc_dir

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA compile check needs the CUDA toolkit")
CACHE = Path(os.environ.get("QGRU_BUILD_DIR", Path.home() / ".cache" / "qgru")) / "cuda-headers"


def _include_dirs_with(header: str):
    roots = [Path(os.environ[k]) for k in ("QGRU_CUDA_HEADERS", "CUDA_HOME") if os.environ.get(k)]
    roots += [Path(NVCC).resolve().parent.parent, CACHE]
    roots += [Path(p) / "nvidia" for p in sys.path if p and (Path(p) / "nvidia").is_dir()]
    for root in roots:
        for hit in root.rglob(header) if root.is_dir() else []:
            return hit.parent
    return None


def _fetch_cublas_headers() -> Path:
    """Download the nvidia-cublas wheel once and keep only its include/ folder."""
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / "download"
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp),
                        "nvidia-cublas"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"could not fetch the cuBLAS headers (pip download nvidia-cublas): {r.stderr.strip()[-300:]}")
    for whl in tmp.glob("*.whl"):
        with zipfile.ZipFile(whl) as z:
            for name in z.namelist():
                if "/include/" in name:
                    z.extract(name, CACHE)
        whl.unlink()
    found = _include_dirs_with("cublas_v2.h")
    assert found is not None, "the nvidia-cublas wheel had no cublas_v2.h"
    return found


@pytest.mark.parametrize("source", ["qgru_cuda_kernels.cu", "qgru_cuda_persistent.cu"])
def test_cuda_kernels_compile_with_nvcc(tmp_path, source):
    inc = _include_dirs_with("cublas_v2.h") or _fetch_cublas_headers()
    src = csrc_dir() / source
    # two architectures: Ampere and Hopper (the lent GPUs), as TORCH_CUDA_ARCH_LIST would give
    cmd = [NVCC, "-std=c++17", "-O1", "-c", str(src), "-o", str(tmp_path / "k.o"), "-I", str(csrc_dir()),
           "-I", str(inc), "-Werror", "all-warnings",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "k.o").stat().st_size > 0


# Stand-ins for the cuSPARSE and cuSOLVER headers where no toolkit provides them: torch's
# ATen/cuda/CUDAContext.h and Exceptions.h name a few of their types, and qgru_cuda.cpp uses none.
_SOLVER_STUBS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\n"
                  "typedef enum { CUSPARSE_STATUS_SUCCESS = 0 } cusparseStatus_t;\n"
                  "const char* cusparseGetErrorString(cusparseStatus_t);\n",
    "cusolver_common.h": "typedef enum { CUSOLVER_STATUS_SUCCESS = 0 } cusolverStatus_t;\n",
    "cusolverDn.h": "#include <cublas_v2.h>\n#include \"cusolver_common.h\"\n"
                    "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
}


def test_cuda_binding_type_checks_against_torch(tmp_path):
    """The torch binding (bind_cuda.cpp, and qgru_cuda.cpp behind it) against torch's CUDA headers,
    syntax and types only.

    Runs where the CUDA runtime's and cuBLAS's headers are found (the toolkit beside nvcc, or the
    nvidia-cublas wheel's, which test_cuda_kernels_compile_with_nvcc fetches). A CPU-only torch
    wheel lacks the one CMake-generated header c10/cuda/impl/cuda_cmake_macros.h, and a machine
    with nvcc but no full toolkit lacks the cuSPARSE and cuSOLVER headers that torch's headers
    include: stand-ins for them are written to tmp (_SOLVER_STUBS), which is enough to check the
    binding, which calls neither library.
    """
    from torch.utils.cpp_extension import include_paths
    incs = [_include_dirs_with(h) for h in ("cublas_v2.h", "cuda_runtime.h")]
    if any(i is None for i in incs):
        pytest.skip("the CUDA runtime's or cuBLAS's headers not found; the binding check needs them")
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    if _include_dirs_with("cusparse.h") is None or _include_dirs_with("cusolverDn.h") is None:
        for name, text in _SOLVER_STUBS.items():
            (tmp_path / "stub" / name).write_text("#pragma once\n" + text)
    incs += [d for d in (_include_dirs_with("cusparse.h"), _include_dirs_with("cusolverDn.h")) if d is not None]
    import sysconfig
    cmd = [os.environ.get("CXX", "c++"), "-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
           "-DTORCH_EXTENSION_NAME=x", "-DTORCH_API_INCLUDE_EXTENSION_H", '-DQGRU_TORCH_VERSION="x"',
           "-I", str(csrc_dir()), "-I", sysconfig.get_paths()["include"]]
    for d in include_paths() + [str(i) for i in incs] + [str(tmp_path / "stub")]:
        cmd += ["-isystem", d]
    for src in ("qgru_cuda.cpp", "bind_cuda.cpp"):
        r = subprocess.run(cmd + [str(csrc_dir() / src)], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{' '.join(cmd)} {src}\n{r.stderr[-4000:]}"


_LAUNCH_CHECK = r"""
#include <cstdio>
#include <vector>
#include "qgru_cuda_launch.h"

// The kernels' index loops (qgru_cuda_kernels.cu: this_col, first_row, row_stride), run on the
// host over the launch shape: every element of [rows, cols] must be visited exactly once.
static int check(long long rows, long long cols) {
  const qgru::cuda::Launch2DShape s = qgru::cuda::launch_2d_shape(rows, cols);
  if (s.block_x * s.block_y != qgru::cuda::kThreads || s.block_x % 32 != 0 || s.grid_y < 1 ||
      s.grid_y > 65535 || s.grid_x < 1 || s.grid_x > 2147483647LL || s.grid_x * s.block_x < cols) {
    std::printf("bad shape for rows %lld cols %lld: grid %lld x %lld, block %lld x %lld\n", rows, cols,
                (long long)s.grid_x, (long long)s.grid_y, (long long)s.block_x, (long long)s.block_y);
    return 1;
  }
  std::vector<unsigned char> seen((size_t)(rows * cols), 0);
  for (long long by = 0; by < s.grid_y; ++by)
    for (long long ty = 0; ty < s.block_y; ++ty)
      for (long long bx = 0; bx < s.grid_x; ++bx)
        for (long long tx = 0; tx < s.block_x; ++tx) {
          const long long c = bx * s.block_x + tx;
          if (c >= cols) continue;
          for (long long r = by * s.block_y + ty; r < rows; r += s.grid_y * s.block_y)
            if (seen[(size_t)(r * cols + c)]++ != 0) {
              std::printf("rows %lld cols %lld: (%lld, %lld) visited twice\n", rows, cols, r, c);
              return 1;
            }
        }
  for (long long i = 0; i < rows * cols; ++i)
    if (seen[(size_t)i] != 1) {
      std::printf("rows %lld cols %lld: (%lld, %lld) never visited\n", rows, cols, i / cols, i % cols);
      return 1;
    }
  return 0;
}

int main() {
  const long long rows[] = {1, 2, 7, 8, 9, 31, 32, 33, 64, 100, 16384, 65535LL * 8 + 3, 65535LL * 256 + 5};
  const long long cols[] = {1, 2, 3, 5, 20, 31, 32, 33, 63, 64, 100, 129, 255, 256, 257, 387, 1024, 3072};
  int bad = 0;
  for (long long r : rows)
    for (long long c : cols)
      if (r * c <= 40000000LL) bad |= check(r, c);
  bad |= check(3, 3 * 131071);  // the widest: 3H at the largest H
  if (!bad) std::printf("LAUNCH-OK\n");
  return bad;
}
"""


def test_cuda_launch_shapes_visit_every_element_once(tmp_path):
    """Item 10 of issue 13: the element-wise kernels index [rows, cols] by a 2-D launch without
    64-bit division; their launch shape (csrc/qgru_cuda_launch.h) and index loops, compiled for the
    host and run here, cover every element exactly once: narrow and wide arrays, partial blocks,
    and more rows than grid y reaches (the grid-stride loop)."""
    _host_check(tmp_path, "launch_check", _LAUNCH_CHECK, "LAUNCH-OK")


def _host_check(tmp_path, name: str, source: str, ok: str) -> None:
    """Compile a check program against csrc/ with the host compiler, run it, and require `ok` in
    its output (a failing check prints what it found)."""
    src = tmp_path / f"{name}.cpp"
    src.write_text(source)
    exe = tmp_path / name
    cxx = os.environ.get("CXX", "c++")
    r = subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-I", str(csrc_dir()), str(src), "-o", str(exe)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and ok in r.stdout, r.stdout + r.stderr


_PAIR_GEMM_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include <vector>
#include "qgru_cuda_launch.h"

// run_gemms' one GEMM per product (qgru_cuda_kernels.cu), emulated on the host with the layout of
// csrc/qgru_cuda_launch.h: activation limbs in consecutive buffers of buffer_rows rows, weight
// limbs in consecutive [M_pad, K] matrices, C = stacked activations . stacked weights^T with row
// stride ld over gemm_rows rows. Each pair's block must be that pair's own product.
static int check(int n_act, int n_w, long long rows, long long buffer_rows, long long M_pad, long long K) {
  int act[4], w[4], P = 0;
  for (int j = 0; j < n_w; ++j)  // prepare_layer's order: weight limb outer, activation limb inner
    for (int i = 0; i < n_act; ++i) { act[P] = i; w[P] = j; ++P; }
  qgru::cuda::PairGemm g{};
  if (!qgru::cuda::one_gemm_for_pairs(P, act, w, rows, buffer_rows, M_pad, &g)) {
    std::printf("layout refused: %d x %d, rows %lld\n", n_act, n_w, rows);
    return 1;
  }
  std::vector<int> A((size_t)(n_act * buffer_rows * K)), W((size_t)(n_w * M_pad * K));
  unsigned s = 12345;
  for (int& v : A) { s = s * 1103515245u + 12345u; v = (int)((s >> 16) % 256) - 128; }
  for (int& v : W) { s = s * 1103515245u + 12345u; v = (int)((s >> 16) % 255) - 127; }
  // the one GEMM, over its stacked rows and channels (what cuBLAS computes)
  const long long C_size = (n_act * buffer_rows) * g.ld;
  if (g.gemm_rows * g.ld > C_size || g.ld != n_w * M_pad) { std::printf("output does not fit\n"); return 1; }
  std::vector<long long> C((size_t)C_size, 0);
  for (long long r = 0; r < g.gemm_rows; ++r)
    for (long long c = 0; c < g.ld; ++c) {
      long long acc = 0;
      for (long long k = 0; k < K; ++k) acc += (long long)A[(size_t)(r * K + k)] * W[(size_t)(c * K + k)];
      C[(size_t)(r * g.ld + c)] = acc;
    }
  for (int p = 0; p < P; ++p)
    for (long long r = 0; r < rows; ++r)
      for (long long c = 0; c < M_pad; ++c) {
        long long want = 0;
        for (long long k = 0; k < K; ++k)
          want += (long long)A[(size_t)((act[p] * buffer_rows + r) * K + k)] * W[(size_t)((w[p] * M_pad + c) * K + k)];
        if (C[(size_t)(g.offset[p] + r * g.ld + c)] != want) {
          std::printf("pair %d (%d, %d) row %lld channel %lld: block holds another product\n", p, act[p], w[p], r, c);
          return 1;
        }
      }
  return 0;
}

int main() {
  int bad = 0;
  for (int n_act = 1; n_act <= 2; ++n_act)
    for (int n_w = 1; n_w <= 2; ++n_w) {
      bad |= check(n_act, n_w, 32, 32, 48, 32);  // R.h: rows = buffer rows
      bad |= check(n_act, n_w, 32, 64, 32, 48);  // a last W.x chunk shorter than its buffer
      bad |= check(n_act, n_w, 48, 48, 64, 16);
    }
  int act[2] = {0, 1}, w[2] = {0, 0};
  qgru::cuda::PairGemm g{};
  bad |= qgru::cuda::one_gemm_for_pairs(2, act, w, 64, 32, 32, &g);  // rows past the buffer: refused
  int dup_a[2] = {0, 0}, dup_w[2] = {0, 0};
  bad |= qgru::cuda::one_gemm_for_pairs(2, dup_a, dup_w, 32, 32, 32, &g);  // a pair twice: refused
  int miss_a[3] = {0, 1, 0}, miss_w[3] = {0, 0, 1};
  bad |= qgru::cuda::one_gemm_for_pairs(3, miss_a, miss_w, 32, 32, 32, &g);  // (1, 1) missing: refused
  if (!bad) std::printf("PAIRS-OK\n");
  return bad;
}
"""


def test_cuda_one_gemm_per_product_layout(tmp_path):
    """Item 8 of issue 13: the CUDA backend multiplies every limb pair of a product in one GEMM
    (run_gemms); the layout (csrc/qgru_cuda_launch.h, one_gemm_for_pairs), compiled for the host
    and run here with an emulated GEMM, places each pair's own product in that pair's block, for
    every limb count, a W.x chunk shorter than its buffer, and refuses layouts it cannot serve."""
    _host_check(tmp_path, "pair_gemm_check", _PAIR_GEMM_CHECK, "PAIRS-OK")


_PLAN_STEPS_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include <set>
#include "qgru_cuda_launch.h"

int main() {
  using qgru::cuda::plan_steps;
  int bad = 0;
  std::set<long long> octave;  // plan lengths of the current octave [2^e, 2^(e+1))
  long long lo = 32;
  for (long long T = 0; T <= 300000; ++T) {
    const long long p = plan_steps(T);
    if (T <= qgru::cuda::kExactPlanSteps) {
      if (p != T) { std::printf("T=%lld: short calls keep their own length, got %lld\n", T, p); bad = 1; }
      continue;
    }
    if (p < T || 8 * (p - T) >= T) { std::printf("T=%lld: plan of %lld steps (over 1/8 more)\n", T, p); bad = 1; }
    if (plan_steps(p) != p) { std::printf("T=%lld: plan length %lld is not its own\n", T, p); bad = 1; }
    if (T == 2 * lo) { lo = T; octave.clear(); }
    if (T >= lo) {
      octave.insert(p);
      if (octave.size() > 9) { std::printf("octave from %lld: more than 9 plan lengths\n", lo); bad = 1; }
    }
    if (bad) break;
  }
  // the README's example: T=1000 runs in a plan of 1024 steps, T=137 in 144
  if (plan_steps(1000) != 1024 || plan_steps(137) != 144 || plan_steps(17) != 18) { std::printf("examples\n"); bad = 1; }
  if (!bad) std::printf("PLAN-STEPS-OK\n");
  return bad;
}
"""


def test_cuda_plan_steps(tmp_path):
    """Item 9 of issue 13: CUDA plans (buffers and captured graph) hold plan_steps(T) steps
    (csrc/qgru_cuda_launch.h), so calls of nearby lengths share one graph. Compiled for the host:
    short calls keep their length, a longer one gets at most 1/8 more steps, a plan length maps to
    itself, and an octave of lengths needs at most 9 plans."""
    _host_check(tmp_path, "plan_steps_check", _PLAN_STEPS_CHECK, "PLAN-STEPS-OK")


_PLAN_CACHE_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include "qgru_cuda_launch.h"

int main() {
  using qgru::cuda::plans_to_keep;
  using qgru::cuda::kMaxPlans;
  using qgru::cuda::kPlanCacheBytes;
  int bad = 0;
  const int64_t MB = int64_t(1) << 20;
  auto expect = [&](const int64_t* b, int64_t n, int64_t want, const char* what) {
    const int64_t got = plans_to_keep(b, n);
    if (got != want) { std::printf("%s: keep %lld, want %lld\n", what, (long long)got, (long long)want); bad = 1; }
  };
  const int64_t small[6] = {MB, MB, MB, MB, MB, MB};
  expect(small, 0, 0, "no plans");
  expect(small, 1, 1, "one plan");
  expect(small, 3, 3, "three small plans");
  expect(small, 6, kMaxPlans, "more small plans than kMaxPlans");
  const int64_t huge[3] = {2 * kPlanCacheBytes, MB, MB};
  expect(huge, 3, 1, "the newest is kept whatever its size, and alone past the byte bound");
  const int64_t mixed[4] = {100 * MB, 100 * MB, 100 * MB, MB};
  expect(mixed, 4, 2, "older plans only while all stay within kPlanCacheBytes");
  if (kMaxPlans < 2) { std::printf("two alternating shapes must both stay\n"); bad = 1; }
  if (!bad) std::printf("PLAN-CACHE-OK\n");
  return bad;
}
"""


def test_cuda_plan_cache_bound(tmp_path):
    """Item 9 of issue 13, alternating shapes: a CUDA layer keeps the plans of its last few shapes
    (csrc/qgru_cuda_launch.h, plans_to_keep), newest first, at most kMaxPlans and older ones only
    within kPlanCacheBytes; the newest is always kept. Compiled for the host and run here."""
    _host_check(tmp_path, "plan_cache_check", _PLAN_CACHE_CHECK, "PLAN-CACHE-OK")


_WINDOW_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include "qgru_cuda_launch.h"

int main() {
  using namespace qgru::cuda;
  int bad = 0;
  auto fail = [&](const char* what, long long a, long long b) {
    std::printf("%s: %lld %lld\n", what, a, b);
    bad = 1;
  };
  const int64_t rows_bytes[] = {1, 64, 816, 26880, 63744, 1 << 20, kWindowBytes, 2 * kWindowBytes};
  const int64_t Ns[] = {1, 2, 25, 64, 4096, 20000};
  const int64_t Ts[] = {1, 3, 700, 100000};
  for (int64_t rb : rows_bytes)
    for (int64_t N : Ns)
      for (int64_t T : Ts) {
        const int64_t s = window_steps(rb, N, T);
        if (s < 1 || s > T) fail("steps outside [1, T]", s, T);
        // within the bytes and the row cap, unless one step alone is more
        if (s > 1 && (s * N * rb > kWindowBytes || s * N > kMaxWindowRows)) fail("window too large", s, N);
        // as many as allowed: one more step would pass a bound (or T)
        if (s < T && (s + 1) * N * rb <= kWindowBytes && (s + 1) * N <= kMaxWindowRows) fail("window too small", s, N);
      }
  if (!bad) std::printf("WINDOW-OK\n");
  return bad;
}
"""


def test_cuda_window_steps(tmp_path):
    """Item 4 of issue 13: a W.x window (csrc/qgru_cuda_launch.h, window_steps) holds at least one
    step and at most T, keeps its buffers within kWindowBytes and its rows within kMaxWindowRows
    (unless one step alone is more), and is as long as those bounds allow. Compiled for the host
    and run here, over row sizes from a tiny layer's to a 16-bit H = 1024 layer's and beyond."""
    _host_check(tmp_path, "window_check", _WINDOW_CHECK, "WINDOW-OK")
