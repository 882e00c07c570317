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
    """The torch binding (bind_cuda.cpp, and qgru_cuda.cpp behind it) and the operator's CUDA kernel
    (op_cuda.cpp) against torch's CUDA headers, syntax and types only.

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
    for src in ("qgru_cuda.cpp", "bind_cuda.cpp", "op_cuda.cpp"):
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

using namespace qgru::cuda;

// The rule of window_steps, by brute force: a step count s is allowed when one step, or when its
// rows fit kMaxWindowRows and its buffers kWindowBytes, or kMaxWindowBytes for at most
// kWindowTargetSteps steps; the window takes the fewest windows any allowed count gives, and of
// the counts giving that many, the smallest.
static long long reference(long long rb, long long N, long long T) {
  auto allowed = [&](long long s) {
    const long long bytes = s * N * rb;
    return s == 1 || (s * N <= kMaxWindowRows &&
                      (bytes <= kWindowBytes || (s <= kWindowTargetSteps && bytes <= kMaxWindowBytes)));
  };
  long long best = 1;
  for (long long s = 1; s <= T; ++s)
    if (allowed(s)) best = s;
  const long long windows = (T + best - 1) / best;
  for (long long s = 1; s <= T; ++s)
    if ((T + s - 1) / s == windows) return s;
  return -1;
}

int main() {
  int bad = 0;
  const long long rows_bytes[] = {1, 64, 816, 13312, 19968, 26624, 38912, 63744, 1 << 20, kWindowBytes, 2 * kWindowBytes};
  const long long Ns[] = {1, 2, 25, 64, 256, 4096, 20000};
  const long long Ts[] = {1, 3, 16, 33, 104, 700, 1024, 4096};
  for (long long rb : rows_bytes)
    for (long long N : Ns)
      for (long long T : Ts) {
        const long long s = window_steps(rb, N, T), want = reference(rb, N, T);
        if (s != want) {
          std::printf("row_bytes %lld N %lld T %lld: %lld steps, want %lld\n", rb, N, T, s, want);
          bad = 1;
        }
      }
  // the large layer at a large batch (H = I = 1024, w8a8: 26624 bytes a row, N = 256, T = 104):
  // 6 windows of 18 steps (32 MiB gave 26 of 4)
  if (window_steps(26624, 256, 104) != 18) { std::printf("H=1024 N=256: %lld\n", (long long)window_steps(26624, 256, 104)); bad = 1; }
  if (!bad) std::printf("WINDOW-OK\n");
  return bad;
}
"""


def test_cuda_window_steps(tmp_path):
    """A W.x window (csrc/qgru_cuda_launch.h, window_steps) costs 3 graph nodes, so it is sized by
    the nodes it saves: at least what kWindowBytes holds, at least kWindowTargetSteps steps where
    those fit kMaxWindowBytes, within kMaxWindowRows rows, one step at least and T at most, and then
    the fewest windows at the shortest length giving that many. Compiled for the host and checked
    against a brute-force search over the allowed step counts, for row sizes from a tiny layer's to
    past the byte bounds, batches 1-20000 and T 1-4096."""
    _host_check(tmp_path, "window_check", _WINDOW_CHECK, "WINDOW-OK")


_STEP_BUFFER_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include <vector>
#include "qgru_cuda_launch.h"

using namespace qgru::cuda;

// The forward's order of reads and writes on a plan's step buffer (qgru_cuda_kernels.cu forward):
// per window of `steps` steps, first the x limbs of all its steps (reads of qx [t, n, i]), then each
// step's cell (writes of out [t, n, h]). qx and out share one int16 buffer (step_buffer): every read
// must see the x written before the run, and out must hold every step's output at the end.
static int check(long long T, long long N, long long I, long long H, long long steps) {
  const StepBuffer b = step_buffer(T, N, I, H);
  const long long wide = I > H ? I : H;
  if (b.elems != T * N * wide || b.qx_offset + T * N * I > b.elems || b.out_offset + T * N * H > b.elems) {
    std::printf("T %lld N %lld I %lld H %lld: qx or out outside the buffer\n", T, N, I, H);
    return 1;
  }
  std::vector<int> buf((size_t)b.elems, -1);
  auto x_value = [&](long long e) { return (int)(e % 30011); };  // qx element e
  auto out_value = [&](long long e) { return 30011 + (int)(e % 2729); };
  for (long long e = 0; e < T * N * I; ++e) buf[(size_t)(b.qx_offset + e)] = x_value(e);
  for (long long t0 = 0; t0 < T; t0 += steps) {
    const long long t1 = t0 + steps < T ? t0 + steps : T;
    for (long long e = t0 * N * I; e < t1 * N * I; ++e)
      if (buf[(size_t)(b.qx_offset + e)] != x_value(e)) {
        std::printf("T %lld N %lld I %lld H %lld window %lld: x of step %lld overwritten\n", T, N, I, H, steps,
                    e / (N * I));
        return 1;
      }
    for (long long t = t0; t < t1; ++t)
      for (long long e = t * N * H; e < (t + 1) * N * H; ++e) buf[(size_t)(b.out_offset + e)] = out_value(e);
  }
  for (long long e = 0; e < T * N * H; ++e)
    if (buf[(size_t)(b.out_offset + e)] != out_value(e)) {
      std::printf("T %lld N %lld I %lld H %lld: output of step %lld lost\n", T, N, I, H, e / (N * H));
      return 1;
    }
  return 0;
}

int main() {
  int bad = 0;
  const long long sizes[] = {1, 2, 3, 7, 16, 33};
  for (long long T : {1LL, 2LL, 5LL, 17LL, 40LL})
    for (long long N : {1LL, 3LL, 8LL})
      for (long long I : sizes)
        for (long long H : sizes)
          for (long long steps : {1LL, 2LL, 3LL, 16LL, 64LL}) bad |= check(T, N, I, H, steps);
  // the benchmark's shapes at their windows (I = H) and an input wider and narrower than H
  bad |= check(104, 4, 64, 64, 18) | check(104, 4, 200, 64, 7) | check(104, 4, 64, 200, 7) | check(1024, 2, 96, 96, 32);
  if (step_buffer(1024, 64, 1024, 1024).elems * 2 != 128LL << 20) { std::printf("H=1024 T=1024 N=64\n"); bad = 1; }
  if (!bad) std::printf("STEP-BUFFER-OK\n");
  return bad;
}
"""


def test_cuda_step_buffer_shared_by_x_and_output(tmp_path):
    """A plan's quantized x [T, N, I] and output [T, N, H] share one int16 buffer of T N max(I, H)
    values (csrc/qgru_cuda_launch.h, step_buffer; half the T-sized memory at I = H). The forward's
    order of reads and writes on it (each window's x limbs before its steps' outputs) is emulated
    on the host for every small T, N, I, H and window length and at the benchmark's shapes: no x is
    overwritten before it is read, and the output holds every step's values at the end."""
    _host_check(tmp_path, "step_buffer_check", _STEP_BUFFER_CHECK, "STEP-BUFFER-OK")


_BENCH_PLAN_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include "qgru_cuda_launch.h"

using namespace qgru::cuda;
typedef long long ll;
static const ll MiB = 1LL << 20, kCublasWs = 32 * MiB;  // the plan's cuBLAS workspace on Hopper

// PyTorch's caching allocator: a block is the request rounded up to 512 bytes; one over 1 MiB (the
// large pool) can hold up to 1 MiB more (a segment's remainder of at most 1 MiB is not split off).
struct Bytes { ll lo = 0, hi = 0; };
static void alloc(Bytes& b, ll n) {
  const ll r = (n + 511) / 512 * 512;
  b.lo += r;
  b.hi += r + (n > MiB ? MiB : 0);
}

// The configs the benchmark times (configs/*.toml; qgru/native/prepare.py: M_pad = 3H and K_pad = H
// for 8-bit weights and I = H): w8a8's x and R.h operand are 8 bits (one limb each), w8a16's x and
// h 16 bits (two limbs: two pairs per product); both have x levels.
static LayerDims dims(bool a16, ll H) { return {H, H, 13, a16 ? 2 : 1, 3 * H, H, a16 ? 2 : 1, 3 * H, H}; }

// What one call of QuantGRU's one-call path (CudaStack, one layer, h0 None) allocates beyond the
// layer's kept plan: h0 zeros, the float32 output [T, N, H] and h_n.
static Bytes call_bytes(ll T, ll N, ll H) {
  Bytes b;
  alloc(b, 4 * N * H);
  alloc(b, 4 * T * N * H);
  alloc(b, 4 * N * H);
  return b;
}

// The code measured on the H200 (2026-11-28): windows of 32 MiB, qx and out apart, plans within
// 256 MiB; a shape over it allocated its buffers in every call (make_buffers, no lengths).
static ll old_window(ll rb, ll N, ll T) {
  ll rows = kWindowBytes / rb;
  if (rows > kMaxWindowRows) rows = kMaxWindowRows;
  ll s = rows / N;
  if (s < 1) s = 1;
  return s > T ? T : s;
}
static Bytes old_call_bytes(const LayerDims& d, ll T, ll N, bool* planned) {
  const ll Tp = T > kExactPlanSteps ? plan_steps(T) : T;
  const PlanSizes p = plan_sizes(d, Tp, N, Tp != T, 0);
  const ll steps = old_window(window_row_bytes(d), N, Tp), rows = steps * N, chunk = gemm_rows(rows);
  const ll plan = p.bytes - 2 * p.steps.elems + 2 * Tp * N * (d.I + d.H) +
                  4 * (d.wx_P * chunk * d.wx_M_pad + rows * 3 * d.H) + 2 * chunk * d.wx_K_pad -
                  4 * (d.wx_P * p.Gx + p.dwx) - 2 * p.x_limb;
  *planned = plan + kCublasWs <= kPlanCacheBytes;
  Bytes b = call_bytes(T, N, d.H);
  if (!*planned) {  // make_buffers for the call's own T
    const ll n[] = {2 * T * N * d.I, 4 * T * N, 4 * N * d.H, 2 * T * N * d.H, 2 * chunk * d.wx_K_pad,
                    2 * gemm_rows(N) * d.rh_K_pad, 4 * d.wx_P * chunk * d.wx_M_pad,
                    4 * d.rh_P * gemm_rows(N) * d.rh_M_pad, 4 * rows * 3 * d.H};
    for (ll v : n) alloc(b, v);
  }
  return b;
}

struct Row { ll H, T, N; bool streaming; double fp16, w8a8, w8a16; };  // measured peak MiB per call

int main() {
  // BENCHMARKS.md "GPU", NVIDIA H200, 2026-11-28 08:47 (scripts/bench.py --device cuda): peak MiB
  // of one call (of one step for the streaming rows) above what was allocated before it
  const Row rows[] = {
      {512, 1000, 64, false, 246.9, 126.2, 126.2}, {512, 1000, 1, false, 14.7, 2.0, 2.0},
      {512, 100, 256, false, 162.8, 51.0, 51.0},   {512, 100, 1, true, 11.0, 0.0, 0.0},
      {512, 100, 64, true, 11.8, 0.4, 0.4},        {1024, 1000, 64, false, 491.9, 533.4, 534.5},
      {1024, 1000, 1, false, 27.4, 3.9, 3.9},      {1024, 100, 256, false, 323.5, 102.0, 102.0},
      {1024, 100, 1, true, 20.0, 0.0, 0.0},        {1024, 100, 64, true, 21.6, 0.8, 0.8}};
  int bad = 0;
  std::printf("| H | T | B | config | plan steps | windows x steps | nodes/step | plan MiB (kept) | per call MiB |"
              " fp16 est. MiB | fp16 meas. MiB | plan + call MiB | 2026-11-28 model / meas. MiB |\n");
  // (nodes/step: the graph's kernels and GEMMs per step, h0's limbs and each window's three included)
  for (const Row& r : rows)
    for (int a16 = 0; a16 < 2; ++a16) {
      const LayerDims d = dims(a16, r.H);
      const ll T = r.streaming ? 1 : r.T, N = r.N, H = r.H;
      const ll Tp = T > kExactPlanSteps ? plan_steps(T) : T;
      const PlanSizes p = plan_sizes(d, Tp, N, Tp != T, 0);
      const ll plan = p.bytes + kCublasWs, windows = (Tp + p.window_steps - 1) / p.window_steps;
      // a plan for every row, whatever the device has free (the bound's floor, 256 MiB)
      if (plan > plan_max_bytes(-1, 0)) { std::printf("H=%lld T=%lld B=%lld: no plan (%lld bytes)\n", H, T, N, plan); bad = 1; }
      const Bytes call = call_bytes(T, N, H);
      // fp16 cuDNN's per call, estimated: its output and h_n (fp16), h0 zeros, and its workspace's
      // input projection of every step (3H fp16 per row)
      const double est = (2.0 * T * N * H + 4.0 * N * H + 6.0 * T * N * H) / MiB;
      const double ours = (double)call.hi / MiB;
      if (ours > r.fp16 || (!r.streaming && ours > est)) {
        std::printf("H=%lld T=%lld B=%lld a16=%d: %.1f MiB per call, fp16 %.1f (est. %.1f)\n", H, T, N, a16, ours, r.fp16, est);
        bad = 1;
      }
      bool old_planned = false;
      const Bytes old = old_call_bytes(d, T, N, &old_planned);
      const double meas = a16 ? r.w8a16 : r.w8a8;
      if (meas < (double)old.lo / MiB - 0.05 || meas > (double)old.hi / MiB + 0.05) {
        std::printf("H=%lld T=%lld B=%lld a16=%d: the model of the measured code gives %.2f-%.2f MiB, measured %.1f\n",
                    H, T, N, a16, (double)old.lo / MiB, (double)old.hi / MiB, meas);
        bad = 1;
      }
      std::printf("| %lld | %lld%s | %lld | %s | %lld | %lld x %lld | %.3f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f%s / %.1f |\n",
                  H, T, r.streaming ? " (x100 calls)" : "", N, a16 ? "w8a16" : "w8a8", Tp, windows, (ll)p.window_steps,
                  (2.0 * Tp + 3.0 * windows + 1) / Tp, (double)plan / MiB, ours, est, r.fp16, (double)(plan + call.hi) / MiB,
                  (double)old.hi / MiB, old_planned ? "" : " (no plan)", meas);
    }
  // the bound: QGRU_CUDA_PLAN_MAX_BYTES where set (0 too), else a quarter of what is free, at least 256 MiB
  if (plan_max_bytes(5, 1LL << 40) != 5 || plan_max_bytes(0, 1LL << 40) != 0 ||
      plan_max_bytes(-1, 8LL << 30) != 2LL << 30 || plan_max_bytes(-1, 100 * MiB) != kPlanCacheBytes ||
      plan_max_bytes(-1, -1) != kPlanCacheBytes) {
    std::printf("plan_max_bytes\n");
    bad = 1;
  }
  if (!bad) std::printf("BENCH-PLAN-OK\n");
  return bad;
}
"""


def test_cuda_benchmark_shapes_plan_and_memory(tmp_path):
    """Every GPU benchmark row (scripts/bench.py CUDA_SCENARIOS, w8a8 and w8a16) gets a CUDA-graph
    plan whatever the device has free (within the plan bound's 256 MiB floor,
    csrc/qgru_cuda_launch.h plan_sizes / plan_max_bytes), and a call's memory beyond the kept plan
    (h0 zeros, the float32 output, h_n; PyTorch's allocator rounding bounded above) is at most
    cuDNN fp16's measured peak on the H200 and, for the sequence rows, its estimate (output +
    h0/h_n + a 3H fp16 input projection per step). The same memory model applied to the code that
    ran then (32 MiB windows, qx and out apart, a fixed 256 MiB bound) brackets the peaks measured
    for qgru in that run, including the 533 MiB of H=1024 T=1000 B=64, which had no plan."""
    _host_check(tmp_path, "bench_plan_check", _BENCH_PLAN_CHECK, "BENCH-PLAN-OK")


_FUSED_STEP_CHECK = r"""
#include <cstdio>
#include <cstdint>
#include <vector>
#include "qgru_fused_step.h"

using namespace qgru::cuda;
typedef long long ll;

static unsigned rng = 2024u;
static int8_t rand8() { rng = rng * 1103515245u + 12345u; return (int8_t)((int)((rng >> 16) % 255) - 127); }

// One step's schedule (fs_step_on_host: every CTA, pass and warp, the fragments through the
// emulated mma.sync, the split-K partials summed): each lane's cell callback must see the r, z and
// g of its (unit, row) pairs, every pair exactly once, equal to the exact int8 product
// R[q H + j] . h[n] (the cuBLAS / golden R.h integer). Without `numeric` (the benchmark's sizes, too
// large to emulate here), the same walk without the MMA: which lane holds which accumulator.
static int check(ll H, ll N, ll K_pad, ll warps, bool numeric) {
  const FsShape s = fs_shape(H, N, K_pad, warps);
  std::vector<int> seen((size_t)(3 * H * N), 0);
  std::vector<int> ksteps((size_t)(s.nt_count * s.k_steps), 0);
  for (ll pass = 0; pass < s.passes; ++pass)  // every k step of every n tile once, in any CTA
    for (ll w = 0; w < s.warps; ++w) {
      const FsItem it = fs_item(s, w, pass);
      for (ll kstep = it.ks; it.nt >= 0 && kstep < s.k_steps; kstep += s.k_split) ++ksteps[(size_t)(it.nt * s.k_steps + kstep)];
    }
  for (size_t i = 0; i < ksteps.size(); ++i)
    if (ksteps[i] != 1) { std::printf("H %lld N %lld K %lld warps %lld: n tile %lld k step %lld taken %d times\n", H, N, K_pad, warps, (ll)(i / s.k_steps), (ll)(i % s.k_steps), ksteps[i]); return 1; }
  if (!numeric) {
    for (ll cta = 0; cta < s.ctas; ++cta)
      for (ll pass = 0; pass < s.passes; ++pass)
        for (ll w = 0; w < s.warps; ++w) {
          const FsItem it = fs_item(s, w, pass);
          if (it.nt < 0 || it.ks != 0) continue;
          for (int tile = 0; tile < kFsTiles; ++tile)
            for (int lane = 0; lane < 32; ++lane)
              for (int i = 0; i < 4; ++i) {
                const FsAcc t = fs_acc(s, cta, tile, it.nt, lane, i);
                if (t.gate >= 0) ++seen[(size_t)((t.gate * N + t.n) * H + t.j)];
              }
        }
    for (size_t i = 0; i < seen.size(); ++i)
      if (seen[i] != 1) { std::printf("H %lld N %lld: accumulator %lld held %d times\n", H, N, (ll)i, seen[i]); return 1; }
    return 0;
  }
  std::vector<int8_t> R((size_t)(3 * H * K_pad)), h((size_t)(N * K_pad));
  for (ll c = 0; c < 3 * H; ++c)
    for (ll k = 0; k < K_pad; ++k) R[(size_t)(c * K_pad + k)] = k < H ? rand8() : 0;
  for (ll n = 0; n < N; ++n)
    for (ll k = 0; k < K_pad; ++k) h[(size_t)(n * K_pad + k)] = k < H ? rand8() : 0;
  std::vector<int32_t> got((size_t)(3 * H * N), 0);
  int twice = 0;
  const bool ok = fs_step_on_host(s, R.data(), h.data(), [&](int64_t j, int64_t n, const int32_t* a0, const int32_t* a1, int p) {
    const int32_t gates[3] = {a0[p], a0[2 + p], a1[p]};  // fs_cell's reading of the lane's accumulators
    for (int q = 0; q < 3; ++q) {
      const size_t at = (size_t)((q * N + n) * H + j);
      twice |= seen[at]++ != 0;
      got[at] = gates[q];
    }
  });
  if (!ok) { std::printf("fragment maps are not a bijection\n"); return 1; }
  if (twice) { std::printf("H %lld N %lld: a (unit, row) pair's cell ran twice\n", H, N); return 1; }
  for (ll q = 0; q < 3; ++q)
    for (ll n = 0; n < N; ++n)
      for (ll j = 0; j < H; ++j) {
        const size_t at = (size_t)((q * N + n) * H + j);
        if (seen[at] != 1) { std::printf("H %lld N %lld: gate %lld unit %lld row %lld never held\n", H, N, q, j, n); return 1; }
        ll want = 0;
        for (ll k = 0; k < K_pad; ++k) want += (ll)R[(size_t)((q * H + j) * K_pad + k)] * h[(size_t)(n * K_pad + k)];
        if (got[at] != want) { std::printf("H %lld N %lld K %lld warps %lld: gate %lld unit %lld row %lld: %d, want %lld\n", H, N, K_pad, warps, q, j, n, got[at], want); return 1; }
      }
  return 0;
}

int main() {
  int bad = 0;
  // the emulated MMA against the exact product: small layers, partial CTAs and n tiles, K_pad not
  // a multiple of 32, one to many warps per CTA (K split, several passes)
  const ll shapes[][3] = {{1, 1, 32}, {7, 3, 32}, {8, 8, 32}, {9, 9, 48}, {20, 17, 32}, {37, 5, 48},
                          {64, 64, 64}, {100, 70, 112}, {33, 130, 48}};
  for (const auto& sh : shapes)
    for (ll warps : {1LL, 3LL, 8LL, 16LL}) bad |= check(sh[0], sh[1], sh[2], warps, true);
  // the benchmark's shapes (H = I = K_pad, 8 warps): every accumulator held once, every k step once
  for (ll H : {512LL, 1024LL})
    for (ll N : {1LL, 64LL, 256LL}) bad |= check(H, N, H, 8, false);
  const FsShape b1 = fs_shape(1024, 1, 1024, 8), b256 = fs_shape(1024, 256, 1024, 8);
  if (b1.ctas != 128 || b1.k_split != 8 || b1.passes != 1 || b256.k_split != 1 || b256.passes != 4) {
    std::printf("schedule at H=1024: %lld CTAs, k_split %lld, passes %lld / %lld\n", (ll)b1.ctas, (ll)b1.k_split,
                (ll)b1.passes, (ll)b256.passes);
    bad = 1;
  }
  if (!bad) std::printf("FUSED-STEP-OK\n");
  return bad;
}
"""


def test_cuda_fused_step_fragments_and_schedule(tmp_path):
    """The fused step's design (csrc/qgru_fused_step.h, run by csrc/qgru_cuda_fused.cu): the mma.sync.m16n8k32
    s8 fragment maps are bijections onto A, B and the accumulators, and the whole schedule (CTAs of
    8 units with the gates in two m16 tiles, warps over n tiles and split K, the partials summed)
    run on the host through an emulated MMA puts every gate of every (unit, batch row) in exactly
    one lane, equal to the exact int8 R.h product, for partial tiles, K not a multiple of 32 and
    1-16 warps; at the benchmark's shapes every k step of every n tile is taken once."""
    _host_check(tmp_path, "fused_step_check", _FUSED_STEP_CHECK, "FUSED-STEP-OK")


_FUSED_STEP_DEVICE = r"""
#include "qgru_fused_step.h"

// The fused step's maps, loads and cell compiled for the device (a stand-in kernel, not the step).
template <bool POW2, bool ACC32>
__global__ void fused_step_maps(qgru::CellParams cp, const int8_t* R, const int8_t* h, const int32_t* d_wx,
                                int32_t* out, int64_t H, int64_t N, int64_t K_pad) {
  using namespace qgru::cuda;
  const int lane = threadIdx.x & 31;
  const FsShape s = fs_shape(H, N, K_pad, blockDim.x / 32);
  const FsItem it = fs_item(s, threadIdx.x / 32, 0);
  if (it.nt < 0) return;
  int8_t a[16], b[8];
  fs_load_a(R, K_pad, H, blockIdx.x, 0, it.ks, lane, a);
  fs_load_b(h, K_pad, N, it.nt, it.ks, lane, b);
  int32_t acc0[4] = {a[0] * b[0], a[1] * b[1], a[2] * b[2], a[3] * b[3]}, acc1[4] = {a[4], a[5], a[6], a[7]};
  const FsAcc t = fs_acc(s, blockIdx.x, 0, it.nt, lane, 0);
  if (t.gate < 0) return;
  const qgru::Channel32 ch = qgru::cell32_channel<ACC32>(cp, t.j);
  out[t.n * H + t.j] = (int32_t)fs_cell<POW2, ACC32>(cp, t.j, ch, acc0, acc1, 0, d_wx + t.n * 3 * H, 0);
}

template __global__ void fused_step_maps<false, true>(qgru::CellParams, const int8_t*, const int8_t*, const int32_t*,
                                                      int32_t*, int64_t, int64_t, int64_t);
template __global__ void fused_step_maps<true, false>(qgru::CellParams, const int8_t*, const int8_t*, const int32_t*,
                                                      int32_t*, int64_t, int64_t, int64_t);
"""


def test_cuda_fused_step_header_compiles_with_nvcc(tmp_path):
    """csrc/qgru_fused_step.h (host-tested above) is device code too: its maps, fragment loads and
    cell compile with nvcc for sm_90 in a stand-in kernel, warnings as errors."""
    src = tmp_path / "fused_step_maps.cu"
    src.write_text(_FUSED_STEP_DEVICE)
    cmd = [NVCC, "-std=c++17", "-O1", "-c", str(src), "-o", str(tmp_path / "f.o"), "-I", str(csrc_dir()),
           "-Werror", "all-warnings", "-gencode", "arch=compute_90,code=sm_90"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"nvcc failed:\n{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
