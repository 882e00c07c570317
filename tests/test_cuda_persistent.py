"""The CUDA backend's persistent recurrence (issue 34; csrc/qgru_persistent.h, the kernel in
csrc/qgru_cuda_persistent.cu), checked without a GPU:

* its plan, compiled for the host with the host compiler: every hidden unit and every gate's
  channel owned by exactly one block, every (row, unit) cell computed exactly once per step, the
  shared-memory layout within the device's limit and its regions apart, the operand double
  buffer's size and parities, and the grid barrier's schedule, for shapes hypothesis draws;
* the whole schedule run on the host (pk_run_on_host: the kernel's phases, block after block,
  in two block orders) on layers prepared as the CUDA Layer prepares them, bit for bit against
  qgru/golden.py: several blocks with a partial last one, row tiles, windows, lengths, every config.

Nothing here runs the CUDA kernel itself; tests/test_cuda_speed_paths.py and test_native.py do on
a machine with a GPU.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qgru import golden
from qgru.config import QuantConfig
from qgru.native import csrc_dir
from qgru.native.build import build_guard
from qgru.native.prepare import CUDA_GEMM_MIN, prepare_layer

from test_native import _random_inputs, _random_layer, cuda_backend  # noqa: F401 (a fixture)

CXX = os.environ.get("CXX", "c++")

_PLAN_CHECK = r"""
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include "qgru_persistent.h"

using namespace qgru::cuda;

static int fail(const char* what, long long a, long long b) {
  std::printf("FAIL %s: %lld %lld\n", what, a, b);
  return 1;
}

// One shape: the plan, or the reason for none, and every property the kernel relies on.
static int check(long long H, long long N, long long K_pad, long long M_pad, int n_act, int n_w, int ones,
                 long long sm, long long smem) {
  PkShape s{};
  s.H = H, s.N = N, s.K_pad = K_pad, s.M_pad = M_pad, s.n_act = n_act, s.n_w = n_w, s.P = n_act * n_w;
  s.ones = ones != 0, s.ones_col = ones ? 3 * H : 0;
  PkPlan p{};
  const int rc = pk_plan(s, PkDevice{sm, smem}, &p);
  if (rc == kPkNoRoom) {  // refused only when not even one row fits beside the block's R rows
    const long long units = (H + sm - 1) / sm, ch = pk_round(3 * units + (ones ? 1 : 0), kPkChanBlock);
    const long long ld = pk_row_ld(K_pad), rows = kPkRowBlock;
    const long long need = pk_align(n_w * ch * ld) + pk_align(n_act * rows * ld) + pk_align(4 * s.P * rows * ch);
    return need > smem ? 0 : fail("refused a shape that fits", need, smem);
  }
  if (rc != kPkFits) return fail("refused a valid shape", rc, 0);
  // the grid: co-resident with one block per SM, no block without a unit
  if (p.blocks < 1 || p.blocks > sm || p.units < 1 || p.blocks * p.units < H || (p.blocks - 1) * p.units >= H)
    return fail("grid", p.blocks, p.units);
  // ownership: each of the 3H channels by exactly one (block, local channel); the ones row in every block
  std::vector<int> owned((size_t)(3 * H), 0);
  for (long long b = 0; b < p.blocks; ++b) {
    int64_t u0, u1;
    pk_units(p, b, &u0, &u1);
    if (u0 != b * p.units || u1 <= u0 || u1 > H) return fail("units", (long long)u0, (long long)u1);
    for (long long c = 0; c < p.channels; ++c) {
      const long long g = pk_channel(p, b, c);
      if (ones && c == 3 * p.units) {
        if (g != 3 * H) return fail("ones row", b, g);
        continue;
      }
      const long long q = c / p.units, j = u0 + c % p.units;
      if (j >= u1) {
        if (g != -1) return fail("a padding channel reads a row", b, c);
        continue;
      }
      if (g != q * H + j || g < 0 || g >= 3 * H) return fail("channel map", c, g);
      owned[(size_t)g]++;
    }
  }
  for (long long g = 0; g < 3 * H; ++g)
    if (owned[(size_t)g] != 1) return fail("channel owned other than once", g, owned[(size_t)g]);
  // cells: each (n, j) once per step, over blocks, tiles and elements (the index map of pk_cell)
  if (p.rows_tile < 1 || p.tiles * p.rows_tile < N || (p.tiles - 1) * p.rows_tile >= N)
    return fail("tiles", p.rows_tile, p.tiles);
  if (N * H <= 4000000) {
    std::vector<unsigned char> cell((size_t)(N * H), 0);
    for (long long b = 0; b < p.blocks; ++b)
      for (long long tile = 0; tile < p.tiles; ++tile)
        for (long long e = 0; e < pk_cells(p); ++e) {
          const long long r = e / p.units, u = e % p.units, n = tile * p.rows_tile + r, j = b * p.units + u;
          if (n >= N || j >= H) continue;  // pk_cell's skip
          if (cell[(size_t)(n * H + j)]++) return fail("cell twice", n, j);
        }
    for (long long i = 0; i < N * H; ++i)
      if (cell[(size_t)i] != 1) return fail("cell never computed", i / H, i % H);
  }
  // shared memory: within the limit, regions in order and apart, every access inside its region
  // (rows 16-byte aligned for the kernel's 16-byte reads, 8 consecutive rows 4 banks apart)
  if (p.smem_bytes > smem || p.r_offset != 0 || p.h_offset % 16 || p.acc_offset % 16 || p.row_ld % 16 ||
      p.row_ld < K_pad || (p.row_ld / 4) % 32 != 4 || p.ch_ld % kPkChanBlock || p.ch_ld < p.channels ||
      p.ch_ld >= p.channels + kPkChanBlock || p.rows_ld % kPkRowBlock || p.rows_ld < p.rows_tile ||
      p.rows_ld >= p.rows_tile + kPkRowBlock)
    return fail("smem layout", p.smem_bytes, smem);
  const long long r_end = p.n_w * p.ch_ld * p.row_ld, h_end = p.h_offset + p.n_act * p.rows_ld * p.row_ld;
  const long long acc_end = p.acc_offset + 4 * p.P * p.rows_ld * p.ch_ld;
  if (r_end > p.h_offset || h_end > p.acc_offset || acc_end > p.smem_bytes)
    return fail("smem regions overlap", r_end, h_end);
  // the staging and product index maps stay in their regions (last word of each)
  {
    const long long w = pk_r_words(p) - 1, kw = K_pad / 4;
    const long long at = ((w / (kw * p.ch_ld)) * p.ch_ld + (w / kw) % p.ch_ld) * p.row_ld + (w % kw) * 4 + 4;
    if (at > r_end) return fail("R staging past its region", at, r_end);
    if (pk_r_words(p) * 4 != p.n_w * p.ch_ld * K_pad) return fail("R words", pk_r_words(p), 0);
    if (pk_h_words(p) * 4 != p.n_act * p.rows_ld * K_pad) return fail("h words", pk_h_words(p), 0);
    if (pk_products(p) * kPkRowBlock * kPkChanBlock != p.P * p.rows_ld * p.ch_ld)
      return fail("products", pk_products(p), 0);
  }
  // the work items of pk_product: every product [P][rows_ld][ch_ld] written once, with its own
  // rows' and channel's dot product (staged h bytes 1 + row % 3, R bytes 1 + channel % 5)
  if ((long long)pk_products(p) * kPkRowBlock * kPkChanBlock * K_pad <= 50000000) {
    std::vector<uint32_t> sm_((size_t)(p.smem_bytes / 4), 0);
    unsigned char* b = (unsigned char*)sm_.data();
    PkArgs a{};
    for (int q = 0; q < s.P; ++q) a.act_limb[q] = q % n_act, a.weight_limb[q] = q / n_act;
    for (long long l = 0; l < n_w; ++l)
      for (long long c = 0; c < p.ch_ld; ++c)
        for (long long k = 0; k < K_pad; ++k)
          b[p.r_offset + (l * p.ch_ld + c) * p.row_ld + k] = (unsigned char)(1 + c % 5 + l);
    for (long long l = 0; l < n_act; ++l)
      for (long long r = 0; r < p.rows_ld; ++r)
        for (long long k = 0; k < K_pad; ++k)
          b[p.h_offset + (l * p.rows_ld + r) * p.row_ld + k] = (unsigned char)(1 + r % 3 + 2 * l);
    int32_t* acc = (int32_t*)(b + p.acc_offset);
    for (long long i = 0; i < p.P * p.rows_ld * p.ch_ld; ++i) acc[i] = -1;
    for (long long o = 0; o < pk_products(p); ++o) pk_product(p, a, b, o);
    for (long long q = 0; q < s.P; ++q)
      for (long long r = 0; r < p.rows_ld; ++r)
        for (long long c = 0; c < p.ch_ld; ++c) {
          const long long want = K_pad * (1 + r % 3 + 2 * a.act_limb[q]) * (1 + c % 5 + a.weight_limb[q]);
          const long long at = (q * p.rows_ld + r) * p.ch_ld + c;
          if (acc[at] != want) return fail("product", at, want);
        }
  }
  // the operand double buffer: [2][n_act][N][K_pad]; step t stages only parity t & 1, writes go
  // to (t + 1) & 1 (pk_cell): record what pk_stage_h reads
  if (p.h_buffer != 2 * n_act * N * K_pad) return fail("h buffer size", p.h_buffer, 0);
  if (pk_h_index(p, 1, n_act - 1, N - 1, K_pad - 1) != p.h_buffer - 1 || pk_h_index(p, 1, 0, 0, 0) != p.h_buffer / 2)
    return fail("h buffer index", pk_h_index(p, 1, n_act - 1, N - 1, K_pad - 1), p.h_buffer);
  if ((long long)pk_h_words(p) * p.tiles <= 2000000) {
    std::vector<uint32_t> smem_buf((size_t)p.smem_bytes / 4 + 4);
    std::vector<int8_t> hbuf((size_t)p.h_buffer, 0);
    PkArgs a{};
    a.h_buf = hbuf.data();
    for (long long t = 0; t < 3; ++t) {
      long long bad = -1, reads = 0;
      auto load = [&](const int8_t* q) -> uint32_t {
        const long long i = q - hbuf.data();
        if (i < 0 || i + 4 > p.h_buffer || (i >= p.h_buffer / 2) != (t & 1) || i % 4) bad = i;
        ++reads;
        return 0u;
      };
      for (long long tile = 0; tile < p.tiles; ++tile)
        for (long long w = 0; w < pk_h_words(p); ++w)
          pk_stage_h(p, a, (unsigned char*)smem_buf.data(), t, tile * p.rows_tile, w, load);
      if (bad >= 0) return fail("step reads outside its parity", t, bad);
      if (reads * 4 != n_act * N * K_pad) return fail("staged reads", reads, n_act * N * K_pad);
    }
  }
  // the barrier: the wait after launch step s ends when the last block of step s arrives, not before
  const long long steps = 5;
  unsigned counter = 0;
  for (long long st = 0; st < steps; ++st) {
    const unsigned target = pk_barrier_target(st, p.blocks);
    for (long long b = 0; b < p.blocks; ++b) {
      if (counter >= target) return fail("a wait would end before every block arrived", st, b);
      ++counter;
    }
    if (counter != target) return fail("the last arrival does not release the wait", st, counter);
  }
  const long long last = pk_launch_steps(p.blocks) - 1;
  if ((long long)pk_barrier_target(last, p.blocks) != (last + 1) * p.blocks || (last + 1) * p.blocks >= (1LL << 31) ||
      (last + 2) * p.blocks < (1LL << 31))
    return fail("launch steps", last, p.blocks);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 10)
    return check(atoll(argv[1]), atoll(argv[2]), atoll(argv[3]), atoll(argv[4]), atoi(argv[5]), atoi(argv[6]),
                 atoi(argv[7]), atoll(argv[8]), atoll(argv[9])) ? 1 : (std::printf("PK-PLAN-OK\n"), 0);
  int bad = 0;  // a fixed grid: the bench's shapes on an H100 / H200 (132 SMs, 227 KiB) and an A100
  const long long Hs[] = {1, 12, 131, 132, 133, 512, 1024};
  const long long Ns[] = {1, 3, 64, 256, 300};
  for (long long H : Hs)
    for (long long N : Ns)
      for (int limbs = 0; limbs < 3; ++limbs) {
        const int n_act = limbs ? 2 : 1, n_w = limbs == 2 ? 2 : 1, ones = limbs == 2;
        const long long K = H < 32 ? 32 : (H + 15) / 16 * 16, M = ((3 * H + ones + 15) / 16) * 16;
        bad |= check(H, N, K, M < 32 ? 32 : M, n_act, n_w, ones, 132, 227 * 1024);
        bad |= check(H, N, K, M < 32 ? 32 : M, n_act, n_w, ones, 108, 163 * 1024);
      }
  PkPlan p{};
  PkShape s{};
  s.H = 8, s.N = 1, s.K_pad = 32, s.M_pad = 32, s.n_act = 1, s.n_w = 1, s.P = 2;  // P != n_act n_w
  bad |= pk_plan(s, PkDevice{4, 1 << 16}, &p) != kPkBadShape;
  s.P = 1, s.K_pad = 4;  // K_pad < H
  bad |= pk_plan(s, PkDevice{4, 1 << 16}, &p) != kPkBadShape;
  s.K_pad = 32;
  bad |= pk_plan(s, PkDevice{0, 1 << 16}, &p) != kPkNoDevice;
  bad |= pk_plan(s, PkDevice{4, 64}, &p) != kPkNoRoom;
  if (!bad) std::printf("PK-PLAN-OK\n");
  return bad;
}
"""


@pytest.fixture(scope="module")
def plan_check(tmp_path_factory):
    """The plan check compiled once for the host (no CUDA header: qgru_persistent.h is plain C++)."""
    d = tmp_path_factory.mktemp("pk_plan")
    (d / "pk_plan.cpp").write_text(_PLAN_CHECK)
    exe = d / "pk_plan"
    r = subprocess.run([CXX, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(csrc_dir()),
                        str(d / "pk_plan.cpp"), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return exe


def _run_plan_check(exe, *args) -> None:
    r = subprocess.run([str(exe)] + [str(a) for a in args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "PK-PLAN-OK" in r.stdout, f"{args}: {r.stdout}{r.stderr}"


def test_persistent_plan_on_a_grid_of_shapes(plan_check):
    """The bench's shapes (H 512 and 1024, B 1 to 256) and small and odd ones, 8- and 16-bit
    operands, on an H100/H200 and an A100's SM count and shared memory; and the refusals."""
    _run_plan_check(plan_check)


@settings(max_examples=60, deadline=None)
@given(H=st.integers(1, 1500), N=st.integers(1, 400), k_extra=st.integers(0, 4), limbs=st.integers(0, 2),
       sm=st.integers(1, 160), smem_kib=st.integers(4, 228))
def test_persistent_plan_properties(plan_check, H, N, k_extra, limbs, sm, smem_kib):
    """Any shape hypothesis draws: a plan whose properties hold (ownership, cells, layout, parity,
    barrier), or a refusal that is right (not even one row fits beside the block's R rows)."""
    n_act, n_w, ones = (1, 1, 0) if limbs == 0 else ((2, 1, 0) if limbs == 1 else (2, 2, 1))
    K = max(32, (H + 15) // 16 * 16 + 16 * k_extra)
    M = max(32, (3 * H + ones + 15) // 16 * 16)
    _run_plan_check(plan_check, H, N, K, M, n_act, n_w, ones, sm, smem_kib * 1024)


# ---------------------------------------------------------------------------------------------
# The schedule on the host against the golden model
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def host_ext():
    """tests/cuda_persistent_host.cpp built once (a torch extension: it prepares the layer with
    qgru_layer.h's LayerTensors, as the CUDA Layer does), in QGRU_BUILD_DIR."""
    from torch.utils.cpp_extension import load
    src = Path(__file__).with_name("cuda_persistent_host.cpp")
    h = hashlib.sha256(src.read_bytes())
    for name in ("qgru_persistent.h", "qgru_fused_step.h", "qgru_cell.h", "qgru_fixedpoint.h", "qgru_layer.h"):
        h.update((csrc_dir() / name).read_bytes())
    root = Path(os.environ.get("QGRU_BUILD_DIR", Path.home() / ".cache" / "qgru"))
    d = root / f"pk-host-{torch.__version__}-{h.hexdigest()[:12]}".replace("+", "_")
    d.mkdir(parents=True, exist_ok=True)
    if shutil.which("ninja") is None:
        pytest.skip("ninja is needed to build the host emulation (torch.utils.cpp_extension)")
    with build_guard(d):
        return load(name="qgru_pk_host", sources=[str(src)], extra_include_paths=[str(csrc_dir())],
                    extra_cflags=["-O1"], build_directory=str(d), verbose=False)


def _smem_for_rows(p, rows: int, sm: int) -> int:
    """Shared memory per block that leaves room for `rows` rows per tile (pk_plan's layout)."""
    t, v = prepare_layer(p, gemm_min=CUDA_GEMM_MIN)
    H = v["H"]
    K = t["h_weight_limbs"].shape[2]
    n_w = t["h_weight_limbs"].shape[0]
    P = t["h_pairs"].shape[0]
    n_act = P // n_w
    ones = bool((t["h_pairs"][:, 3] != 0).any())
    units = -(-H // sm)
    up = lambda x, m: -(-x // m) * m
    ch, ld, rows_ld = up(3 * units + int(ones), 4), up(K, 128) + 16, up(rows, 2)
    return up(n_w * ch * ld, 16) + up(n_act * rows_ld * ld, 16) + up(4 * P * rows_ld * ch, 16)


CASES = [  # I, H, T, N, window, SMs, rows per tile (None: all; the plan's rows come in pairs)
    (5, 12, 9, 5, 4, 5, None),    # 4 blocks of 3 units, 3 windows, an odd tile (5 rows staged as 6)
    (7, 37, 11, 6, 5, 4, 2),      # 4 blocks of 10 units (the last 7), 3 row tiles
    (3, 1, 4, 2, 4, 3, None),     # one unit
    (9, 20, 6, 3, 6, 1, 2),       # one block, a last tile of one row
]


@pytest.mark.parametrize("cfg", ["w8a8", "w8a16", "w16a16"])
@pytest.mark.parametrize("mode", ["pow2", "multiplier"])
@pytest.mark.parametrize("I,H,T,N,window,sm,rows", CASES)
def test_persistent_schedule_is_the_golden_model(host_ext, cfg, mode, I, H, T, N, window, sm, rows):
    """The kernel's phases (qgru_persistent.h) run on the host over the whole schedule, blocks in
    order and in reverse within each step: out and h_n equal golden.gru_direction's, with lengths
    (rows that stop early carry their state and operand) and without."""
    config = QuantConfig.load(cfg, overrides={"scale_mode": mode})
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), lo, dtype=torch.float64), torch.full((3 * H,), hi, dtype=torch.float64))
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4, 5), "Rh": per(-3, 2),
              "r_pre": one(-6, 6), "z_pre": one(-6, 6), "g_pre": one(-5, 7)}
    p = _random_layer(config, I, H, ranges, w_exp=-2, b_exp=-2, zero_row=False, seed=I * 100 + H)
    t, v = prepare_layer(p, gemm_min=CUDA_GEMM_MIN)
    smem = _smem_for_rows(p, rows, sm) if rows else 227 * 1024
    for with_lengths in (True, False):
        gen = torch.Generator().manual_seed(T * 7 + N)
        qx, qh0, lengths = _random_inputs(p, T, N, with_lengths, gen)
        want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
        for reverse in (False, True):
            out, h, info = host_ext.run(t, v, qx.int(), qh0.int(), lengths, window, sm, smem, reverse)
            assert info["blocks"] == -(-H // info["units"]) and info["blocks"] <= sm
            if rows:
                assert info["rows_tile"] == min(rows, N) and info["tiles"] == -(-N // info["rows_tile"])
            bad = (out.long() != want_out).nonzero()
            assert torch.equal(out.long(), want_out), f"out differs at {bad[:5].tolist()} ({len(bad)}), {info}"
            assert torch.equal(h.long(), want_h), f"h_n differs, {info}"


# ---------------------------------------------------------------------------------------------
# On a GPU (skipped without one): the kernel itself, against the golden model and the per-step path
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", ["w8a8", "w8a16", "w16a16"])
@pytest.mark.parametrize("I,H,T,N", [(5, 12, 9, 5), (16, 300, 40, 3), (8, 64, 20, 70)])
def test_cuda_persistent_kernel_is_the_golden_model(cuda_backend, monkeypatch, cfg, I, H, T, N):  # noqa: F811
    """The persistent recurrence on the GPU (QGRU_CUDA_PERSISTENT=1: on where it fits) gives
    golden.gru_direction's integers with and without lengths and took the persistent path
    (Layer.persistent_calls); with QGRU_CUDA_PERSISTENT=0 the per-step path gives the same and
    does not take it. Two calls each: the eager run and the captured graph's replay."""
    from qgru import native
    config = QuantConfig.load(cfg)
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), lo, dtype=torch.float64), torch.full((3 * H,), hi, dtype=torch.float64))
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4, 5), "Rh": per(-3, 2),
              "r_pre": one(-6, 6), "z_pre": one(-6, 6), "g_pre": one(-5, 7)}
    p = _random_layer(config, I, H, ranges, w_exp=-2, b_exp=-2, zero_row=False, seed=H)
    dev = torch.device("cuda:0")
    for env in ("1", "0"):
        monkeypatch.setenv("QGRU_CUDA_PERSISTENT", env)
        pd = p.to(dev)  # a fresh copy: its native Layer reads the variable when it is made
        for with_lengths in (True, False):
            gen = torch.Generator().manual_seed(T + N)
            qx, qh0, lengths = _random_inputs(p, T, N, with_lengths, gen)
            want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
            for _ in range(2):
                out, h = native.gru_direction("cuda")(pd, qx.to(dev), qh0.to(dev),
                                                      None if lengths is None else lengths.to(dev))
                assert torch.equal(out.cpu().long(), want_out) and torch.equal(h.cpu().long(), want_h), env
        layer = pd.__dict__["_native"][("cuda", str(dev), "")].layer
        if env == "1":
            assert layer.persistent_plan(N), "the shape should fit on chip"
            assert layer.counters["persistent_calls"] == 4
        else:
            assert layer.persistent_plan(N) == {} and layer.counters["persistent_calls"] == 0


@settings(max_examples=25, deadline=None)
@given(cfg=st.sampled_from(["w8a8", "w8a16", "w16a16"]), mode=st.sampled_from(["pow2", "multiplier"]),
       I=st.integers(1, 20), H=st.integers(1, 70), T=st.integers(1, 12), N=st.integers(1, 9),
       window=st.integers(1, 12), sm=st.integers(1, 40), rows=st.sampled_from([None, 2, 4]),
       with_lengths=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_persistent_schedule_random_shapes(host_ext, cfg, mode, I, H, T, N, window, sm, rows, with_lengths, seed):
    """The host-run schedule against golden.gru_direction on shapes hypothesis draws: any split of
    the units over blocks, of the rows over tiles and of the steps over windows."""
    config = QuantConfig.load(cfg, overrides={"scale_mode": mode})
    one = lambda lo, hi: (torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64))
    per = lambda lo, hi: (torch.full((3 * H,), lo, dtype=torch.float64), torch.full((3 * H,), hi, dtype=torch.float64))
    ranges = {"x": one(-3, 2), "h": one(-1, 1), "Wx": per(-4, 5), "Rh": per(-3, 2),
              "r_pre": one(-6, 6), "z_pre": one(-6, 6), "g_pre": one(-5, 7)}
    p = _random_layer(config, I, H, ranges, w_exp=-2, b_exp=-2, zero_row=False, seed=seed)
    t, v = prepare_layer(p, gemm_min=CUDA_GEMM_MIN)
    smem = _smem_for_rows(p, rows, sm) if rows else 227 * 1024
    qx, qh0, lengths = _random_inputs(p, T, N, with_lengths, torch.Generator().manual_seed(seed))
    want_out, want_h = golden.gru_direction(p, qx, qh0, lengths)
    out, h, info = host_ext.run(t, v, qx.int(), qh0.int(), lengths, window, sm, smem, bool(seed % 2))
    assert torch.equal(out.long(), want_out) and torch.equal(h.long(), want_h), info
