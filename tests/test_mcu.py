"""The C runtime for microcontrollers and ARM boards (csrc/c/, qgru/export_mcu.py): bit-exact with
the golden model on the host and, cross-compiled, under QEMU (aarch64 with and without dotprod,
Cortex-M0, M4, M55).

Each case is one converted model (stacked, bidirectional, w8a8 with its h_gemm, w8a16, w16a16 on
the int64 path, an 8-bit state read directly, exact small tables), exported once. On the host a
harness reads integer inputs on stdin and prints what the runtime computes, in one call and in
chunks; the test compares every integer with qgru.golden run layer by layer here, and the floats
with QuantGRU's own forward. On the cross targets the exported golden self-test runs (one whole
call and, unidirectional, one step per call) and must count 0 mismatches. Targets whose
toolchain or QEMU is absent skip with the missing tool's name (.ci/run installs them).
"""
from __future__ import annotations

import functools
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

import qgru
from qgru.export_mcu import write_mcu
from qgru.golden import gru_direction, requantize_input
from qgru.primitives import dequantize, qrange

_spec = importlib.util.spec_from_file_location("mcu_build", Path(__file__).resolve().parents[1] / "scripts" / "mcu_build.py")
mb = importlib.util.module_from_spec(_spec)
sys.modules["mcu_build"] = mb  # its dataclasses look their module up
_spec.loader.exec_module(mb)

CUSTOM = {"observer": {"kind": "minmax"},  # exact (<= 10-bit) tables, 6-bit R per tensor, per-group W
          "tensors": {"R": {"bits": 6, "symmetric": True, "granularity": "per_tensor"},
                      "W": {"bits": 8, "symmetric": True, "granularity": "per_group", "group_size": 4},
                      "Wx": {"bits": 12, "symmetric": False, "granularity": "per_channel"},
                      "z_pre": {"bits": 8, "symmetric": False}, "r_pre": {"bits": 10, "symmetric": False},
                      "g_pre": {"bits": 8, "symmetric": False}, "z": {"bits": 8}, "r": {"bits": 12},
                      "g": {"bits": 8}}}
CASES = {  # id: (config, overrides, scale_mode, input, hidden, layers, bidirectional)
    "w8a8-bidir2": ("w8a8", {}, "multiplier", 5, 6, 2, True),
    "w8a16-pow2-stack": ("w8a16", {}, "pow2", 7, 9, 2, False),
    "w16a16-wide-bidir": ("w16a16", {}, "multiplier", 6, 5, 1, True),
    "w8a8-h8-pow2": ("w8a8", {"tensors": {"h": {"bits": 8, "headroom": 1.0}, "h_gemm": None}}, "pow2", 16, 12, 1, False),
    "custom-bidir2": ("w8a8", CUSTOM, "multiplier", 9, 7, 2, True),
    "w8a8-fast-bidir2": ("w8a8", {}, "multiplier", 8, 32, 2, True),  # the fast cell (qgru_rt.c fast_unit)
    # hidden % 4 != 0: the last block of four units is partial (scalar cell on the blocked constants)
    "w8a8-fast-h30": ("w8a8", {}, "multiplier", 8, 30, 1, False),
    # x levels (config x.dynamic, each token on its own grid: qgru_rt_run_float): the fast cell
    # (13 levels), the fast cell's pairs / vector layouts with pow2's 4 levels, unit32 and unit
    "w8a8-levels-bidir2": ("w8a8", {}, "multiplier", 6, 16, 2, True),
    "w8a16-levels-pow2": ("w8a16", {}, "pow2", 7, 12, 1, False),
    "custom-levels": ("w8a8", CUSTOM, "multiplier", 9, 7, 1, False),
    "w16a16-levels-wide": ("w16a16", {}, "multiplier", 6, 5, 1, True),
}
GOLDEN = ["GRU_GOLDEN", 'QGRU_MODEL_HEADER="gru.h"', "QGRU_MODEL=gru"]

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "gru.h"

/* stdin: T, x [T][I] (HARNESS_FLOAT: floats as %a for qgru_rt_run_float, else x_q integers for
 * qgru_rt_run), h0 [STATE]. stdout: (HARNESS_FLOAT: the return code,) out [T][D H] and h_n of one
 * call; then the same from two calls (the first T/2 steps, then the rest) for a unidirectional
 * model; HARNESS_FLOAT: then the return code of a call whose x holds a NaN and whether it left the
 * state as it was. Exit 4: the runtime wrote into the 64 guard bytes past qgru_rt_work_bytes. */
#ifdef HARNESS_FLOAT
typedef float x_type;
#define RUN qgru_rt_run_float
#else
typedef int16_t x_type;
#define RUN qgru_rt_run
#endif

static long next(void)
{
    long v;
    if (scanf("%ld", &v) != 1) exit(2);
    return v;
}

int main(void)
{
    const int32_t T = (int32_t)next(), D = GRU_NUM_DIRECTIONS, H = GRU_HIDDEN_SIZE, S = GRU_STATE_SIZE;
    const size_t nw = qgru_rt_work_bytes(&gru_model, T);
    x_type *x = malloc(sizeof(x_type) * (size_t)(T * GRU_INPUT_SIZE + 1));
    int16_t *out = malloc(sizeof(int16_t) * (size_t)(T * D * H + 1));
    int16_t h0[GRU_STATE_SIZE], h[GRU_STATE_SIZE];
    unsigned char *work = malloc(nw + 64); /* 64 guard bytes past qgru_rt_work_bytes: never written */
    int32_t i, c, rc;
    memset(work + nw, 0x5a, 64);
    for (i = 0; i < T * GRU_INPUT_SIZE; i++) {
#ifdef HARNESS_FLOAT
        if (scanf("%a", &x[i]) != 1) return 2;
#else
        x[i] = (int16_t)next();
#endif
    }
    for (i = 0; i < S; i++) h0[i] = (int16_t)next();
    for (c = 0; c < (D == 1 ? 2 : 1); c++) {
        const int32_t first = c ? T / 2 : T;
        for (i = 0; i < S; i++) h[i] = h0[i];
        rc = RUN(&gru_model, x, first, h, out, work, nw);
        if (!rc && first < T)
            rc = RUN(&gru_model, x + first * GRU_INPUT_SIZE, T - first, h, out + first * D * H, work, nw);
#ifdef HARNESS_FLOAT
        printf("%d\n", (int)rc);
#else
        if (rc) return 3;
#endif
        for (i = 0; i < T * D * H; i++) printf("%d\n", out[i]);
        for (i = 0; i < S; i++) printf("%d\n", h[i]);
    }
#ifdef HARNESS_FLOAT
    {
        int32_t same = 1;
        for (i = 0; i < S; i++) h[i] = h0[i];
        x[T * GRU_INPUT_SIZE - 1] = 0.0f / 0.0f;
        rc = RUN(&gru_model, x, T, h, out, work, nw);
        for (i = 0; i < S; i++) same &= h[i] == h0[i];
        printf("%d\n%d\n", (int)rc, (int)same);
    }
#endif
    for (i = 0; i < 64; i++)
        if (work[nw + i] != 0x5a) return 4;
    free(x), free(out), free(work);
    return 0;
}
"""
FLOAT_HARNESS = "#define HARNESS_FLOAT 1\n" + HARNESS


@functools.lru_cache(maxsize=None)
def converted(case: str) -> qgru.QuantParams:
    config, over, mode, I, H, layers, bidir = CASES[case]
    cfg = qgru.QuantConfig.load(config, overrides={**over, "scale_mode": mode})
    static = {"x": {"dynamic": "levels" in case}, **({"h_gemm": {"dynamic": False}} if cfg.h_gemm is not None else {})}
    cfg = qgru.QuantConfig.load(cfg, overrides={"tensors": static})
    torch.manual_seed(len(case))
    m = qgru.QuantGRU(I, H, num_layers=layers, bidirectional=bidir, config=cfg)
    qgru.calibrate(m, [torch.randn(6, 3, I) * 1.5 for _ in range(2)], progress=False)
    return m.convert().export()


@functools.lru_cache(maxsize=None)
def exported(case: str, layout: str, folder: str) -> Path:
    d = Path(folder) / f"{case}-{layout}"
    write_mcu(converted(case), d / "gru", layout=layout)
    return d


def golden_stack(params, qx, qh0):
    """qgru.golden layer by layer (written here, apart from export_mcu): out [T, D*H], h_n [L*D, H]"""
    D = len(params.layers[0])
    inp, h_n = [qx], []
    for li, row in enumerate(params.layers):
        outs = []
        for d, p in enumerate(row):
            x = qx if li == 0 else torch.cat(
                [requantize_input(q, params.layers[li - 1][e].zp["h"], p.rescale[f"in_{e}"], p.zp["x"], p.bits["x"])
                 for e, q in enumerate(inp)], -1)
            o, h = gru_direction(p, (x.flip(0) if d else x).unsqueeze(1), qh0[li * D + d].unsqueeze(0))
            outs.append(o.squeeze(1).flip(0) if d else o.squeeze(1))
            h_n.append(h.squeeze(0))
        inp = outs
    return torch.cat(inp, -1), torch.stack(h_n)


def inputs(params, gen, T=11):
    p0 = params.layers[0][0]
    xlo, xhi = qrange(p0.bits["x"])
    qx = torch.randint(xlo, xhi + 1, (T, p0.input_size), generator=gen)
    qx[0], qx[1, ::2] = xlo, xhi  # the extremes
    qh0 = torch.stack([torch.randint(*(lambda r: (r[0], r[1] + 1))(qrange(p.bits["h"])), (p.hidden_size,), generator=gen)
                       for row in params.layers for p in row])
    return qx, qh0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("mcu"))


@pytest.mark.parametrize("case", list(CASES))
def test_host_runtime_matches_golden_and_module(case, folder):
    t = mb.TARGETS["host"]
    if mb.missing(t):
        pytest.skip(f"no host C compiler ({mb.missing(t)})")
    params = converted(case)
    d = exported(case, "interleaved", folder)
    (d / "harness.c").write_text(HARNESS)
    binary = mb.build(t, d / "gru.c", d / "harness.c", d / "harness")
    L, D, H = len(params.layers), len(params.layers[0]), params.meta["hidden_size"]
    qx, qh0 = inputs(params, torch.Generator().manual_seed(3))
    T = qx.shape[0]
    text = mb.run(t, binary, stdin=" ".join(map(str, [T, *qx.reshape(-1).tolist(), *qh0.reshape(-1).tolist()])))
    vals = torch.tensor([int(v) for v in text.split()], dtype=torch.int64)
    n = T * D * H + L * D * H
    assert vals.numel() == n * (2 if D == 1 else 1)
    want_out, want_h = golden_stack(params, qx, qh0)
    for c in range(vals.numel() // n):  # one call, then (unidirectional) two chunks
        out, h_n = vals[c * n:c * n + T * D * H].reshape(T, D * H), vals[c * n + T * D * H:(c + 1) * n].reshape(L * D, H)
        assert torch.equal(out, want_out), (c, out, want_out)
        assert torch.equal(h_n, want_h), (c, h_n, want_h)
    if "levels" in case:  # x's extremes as float32 may lie just beyond level 0 (test_host_float_input_*)
        return
    # the module's own float forward on the same integers (x and h0 as floats on their grids)
    m = params.to_module()
    p0 = params.layers[0][0]
    x = dequantize(qx, p0.scale["x"], p0.zp["x"]).unsqueeze(1)
    flat = [p for row in params.layers for p in row]
    h0 = torch.stack([dequantize(qh0[i], p.scale["h"], p.zp["h"]) for i, p in enumerate(flat)]).unsqueeze(1)
    with torch.no_grad(), qgru.backend("reference"):  # golden.py itself: no native build needed here
        y, hy = m(x, h0)
    last = params.layers[-1]
    c_y = torch.cat([dequantize(want_out[:, e * H:(e + 1) * H], p.scale["h"], p.zp["h"]) for e, p in enumerate(last)], -1)
    assert torch.equal(y.squeeze(1), c_y)
    assert torch.equal(hy.squeeze(1), torch.stack([dequantize(want_h[i], p.scale["h"], p.zp["h"])
                                                   for i, p in enumerate(flat)]))


def test_wide_and_narrow_paths_are_both_exercised(folder):
    """w16a16's GEMMs exceed the int32 bound (16-bit weights): the export sends them to the int64
    loop and says so; w8a8's all accumulate in int32 (the kernels)"""
    assert "takes the int64 loop" in (exported("w16a16-wide-bidir", "interleaved", folder) / "gru.h").read_text()
    assert "none: every GEMM accumulates in int32" in (exported("w8a8-bidir2", "interleaved", folder) / "gru.h").read_text()


def test_fast_and_general_cells_are_both_exercised(folder):
    """w8a8 at 8 -> 32 takes the fast cell (16-bit variant) in every direction; the custom case
    (a Wx shift above 32) keeps unit32. The fast cell's general variant (any saturation width,
    any table geometry) runs on the same data when the 16-bit one is compiled out."""
    for layout in ("interleaved", "pairs", "rows", "offset"):
        hdr = (exported("w8a8-fast-bidir2", layout, folder) / "gru.h").read_text()
        assert "every direction takes the fast cell" in hdr
        assert "every direction takes the fast cell" in (exported("w8a8-fast-h30", layout, folder) / "gru.h").read_text()
        assert ".std16 = 1" in (exported("w8a8-fast-bidir2", layout, folder) / "gru.c").read_text()
    assert "not the fast cell" in (exported("custom-bidir2", "interleaved", folder) / "gru.h").read_text()
    t = mb.TARGETS["host"]
    if mb.missing(t):
        pytest.skip(f"no host C compiler ({mb.missing(t)})")
    for case in ("w8a8-fast-bidir2", "w8a8-levels-bidir2"):  # (the latter: its x levels' float self-test too)
        d = exported(case, "interleaved", folder)
        b = mb.build(t, d / "gru.c", mb.BOARDS / "selftest_main.c", d / "st-host-general",
                     defines=GOLDEN + ["QGRU_RT_NO_STD16"])
        assert mb.mismatches(mb.run(t, b)) == 0, case


def test_fast_only_build_runs_fast_models_and_refuses_others(folder):
    """A runtime built with -DQGRU_RT_FAST_ONLY (the general cells' code left out) runs a model whose
    every direction takes the fast cell bit-exact, and refuses one that needs unit32 with
    QGRU_RT_ECELL (-5) instead of computing anything."""
    t = mb.TARGETS["host"]
    if mb.missing(t):
        pytest.skip(f"no host C compiler ({mb.missing(t)})")
    for case, want in (("w8a8-fast-bidir2", 0), ("custom-bidir2", -5)):  # -5: QGRU_RT_ECELL
        d = exported(case, "interleaved", folder)
        b = mb.build(t, d / "gru.c", mb.BOARDS / "selftest_main.c", d / "st-host-fastonly",
                     defines=GOLDEN + ["QGRU_RT_FAST_ONLY"])
        assert mb.mismatches(mb.run(t, b, check=False)) == want, case


@pytest.mark.parametrize("target", ["host", "a53", "a64-dotprod", "m0", "m4", "m55"])
def test_fast_cell_shared_constants_stored_per_unit(target, tmp_path, monkeypatch):
    """The fast cell's shared constants (zero points, gate rescales: qgru_rt.h QGRU_RT_SHARED_FIELDS)
    are stored once where every unit's are equal, as in every model above that takes the fast cell;
    the per-unit form (shared_stride 12 / 48, for data whose units differ) is exercised here by
    exporting with the single copy off: the same integers (the scalar cell, the vector blocks and a
    partial last block at H = 30)."""
    import qgru.export_mcu as em
    t = mb.TARGETS[target]
    if mb.missing(t):
        pytest.skip(f"{target}: {mb.missing(t)} is not installed")
    monkeypatch.setattr(em, "_SHARED_ONCE", False)
    d = tmp_path / "per-unit"
    write_mcu(converted("w8a8-fast-h30"), d / "gru", layout=t.layout)
    assert f".shared_stride = {12 if t.layout == 'pairs' else 48}" in (d / "gru.c").read_text()
    b = mb.build(t, d / "gru.c", mb.BOARDS / "selftest_main.c", d / f"st-{target}", defines=GOLDEN)
    assert mb.mismatches(mb.run(t, b, timeout=60)) == 0


def test_runtime_refuses_data_of_another_layout(folder):
    t = mb.TARGETS["host"]
    if mb.missing(t):
        pytest.skip(f"no host C compiler ({mb.missing(t)})")
    d = exported("w8a8-h8-pow2", "rows", folder)
    b = mb.build(t, d / "gru.c", mb.BOARDS / "selftest_main.c", d / "st-host", defines=GOLDEN)
    assert mb.mismatches(mb.run(t, b, check=False)) == -4  # QGRU_RT_ELAYOUT


def test_export_arguments():
    p = converted("w8a8-h8-pow2")
    with pytest.raises(ValueError, match="not a C identifier"):
        write_mcu(p, "/tmp/x", prefix="1bad")
    with pytest.raises(ValueError, match="layout"):
        write_mcu(p, "/tmp/x", layout="columns")


CROSS = ["a53", "a64-dotprod", "m0", "m4", "m55"]


@pytest.mark.parametrize("target", CROSS)
@pytest.mark.parametrize("case", list(CASES))
def test_cross_targets_self_test_bit_exact(case, target, folder):
    t = mb.TARGETS[target]
    tool = mb.missing(t)
    if tool:
        pytest.skip(f"{target}: {tool} is not installed (.ci/run installs the cross toolchains and QEMU)")
    d = exported(case, t.layout, folder)
    b = mb.build(t, d / "gru.c", mb.BOARDS / "selftest_main.c", d / f"st-{target}", defines=GOLDEN)
    out = mb.run(t, b, timeout=60)
    kernel = {"a53": "neon", "a64-dotprod": "neon-dotprod", "m0": "v6m", "m4": "dsp", "m55": "mve"}[target]
    assert f"kernel {kernel}\n" in out, out
    assert mb.mismatches(out) == 0, out


WORK_MAIN = r"""
#include <stdio.h>
#include "gru.h"
int main(void) { printf("work %lu\n", (unsigned long)qgru_rt_work_bytes(&gru_model, 1)); return 0; }
"""


@pytest.mark.parametrize("target", ["host", "a53"])
def test_work_buffer_holds_operands_in_their_width_and_the_self_test_guards_it(target, folder, tmp_path, monkeypatch):
    """qgru_rt_work_bytes: the x and R.h operands as int8 (1 byte a value) where every direction's
    are int8 and the kernel takes int8 (NEON, MVE), else int16; a streaming step of a unidirectional
    model needs nothing more. The self-test hands the runtime exactly that many bytes and fails
    (-100) when it writes into the 16 guard bytes after them: a runtime whose work size is 16 bytes
    short (a copy of csrc/c edited here) is caught."""
    t = mb.TARGETS[target]
    if mb.missing(t):
        pytest.skip(f"{target}: {mb.missing(t)} is not installed (.ci/run installs the cross toolchains and QEMU)")
    a8 = target != "host"  # (the host build's portable kernel widens int8 to int16)
    for case, width in (("w8a8-fast-h30", 1 if a8 else 2), ("w8a16-pow2-stack", 2)):
        d = exported(case, t.layout, folder)
        (d / "work.c").write_text(WORK_MAIN)
        out = mb.run(t, mb.build(t, d / "gru.c", d / "work.c", d / f"work-{target}"))
        p = converted(case).layers[0][0]
        want = width * (mb_pad16(max(p.input_size, p.hidden_size)) + mb_pad16(p.hidden_size))
        assert out == f"work {want}\n", (case, out)
    rt = tmp_path / "rt"
    shutil.copytree(mb.RT, rt, ignore=shutil.ignore_patterns("boards"))
    src = (rt / "qgru_rt.c").read_text()
    fixed = "return act_size(m) * (size_t)(qgru_rt_pad16(max_input(m)) + qgru_rt_pad16(m->hidden_size));"
    assert src.count(fixed) == 1
    (rt / "qgru_rt.c").write_text(src.replace(fixed, fixed[:-1] + " - 16;"))
    d = exported("w8a8-fast-h30", t.layout, folder)
    good = mb.run(t, mb.build(t, d / "gru.c", mb.BOARDS / "selftest_main.c", d / f"guard-ok-{target}", defines=GOLDEN))
    assert mb.mismatches(good) == 0, good
    monkeypatch.setattr(mb, "RT", rt)
    bad = mb.run(t, mb.build(t, d / "gru.c", mb.BOARDS / "selftest_main.c", d / f"guard-short-{target}", defines=GOLDEN),
                 check=False)
    assert mb.mismatches(bad) == -100, bad


def mb_pad16(n: int) -> int:
    return (n + 15) & ~15


QUANTIZE = r"""
#include <stdio.h>
#include <stdlib.h>
#include "gru.h"

/* stdin: n, then n floats (%a) -> the integers of qgru_rt_quantize_input, the NaN count, and the
 * floats of qgru_rt_dequantize of those integers on the last layer's first direction */
int main(void)
{
    int n, i;
    float *x, *y;
    int16_t *q;
    if (scanf("%d", &n) != 1 || n < 1) return 2;
    x = malloc(sizeof(float) * (size_t)n), y = malloc(sizeof(float) * (size_t)n), q = malloc(sizeof(int16_t) * (size_t)n);
    if (!x || !y || !q) return 2;
    for (i = 0; i < n; i++)
        if (scanf("%a", &x[i]) != 1) return 2;
    printf("%d\n", (int)qgru_rt_quantize_input(&gru_model, x, n, q));
    qgru_rt_dequantize(&gru_model, (GRU_NUM_LAYERS - 1) * GRU_NUM_DIRECTIONS, q, n, y);
    for (i = 0; i < n; i++) printf("%d %a\n", q[i], (double)y[i]);
    free(x), free(y), free(q);
    return 0;
}
"""


def half_steps(scale: float, zp: int, bits: int, ulps: int = 3) -> torch.Tensor:
    """float32 x around every rounding boundary of a grid: (k + 1/2) scale for each k of the range
    (and one beyond each end), with its `ulps` float32 neighbours either side"""
    lo, hi = qrange(bits)
    k = torch.arange(lo - zp - 2, hi - zp + 2, dtype=torch.float64)
    c = ((k + 0.5) * scale).float()
    out = [c]
    up, down = c.clone(), c.clone()
    for _ in range(ulps):
        up, down = torch.nextafter(up, torch.tensor(float("inf"))), torch.nextafter(down, torch.tensor(float("-inf")))
        out += [up, down]
    return torch.cat(out)


@pytest.mark.parametrize("case", ["w8a16-pow2-stack", "w16a16-wide-bidir"])
@pytest.mark.parametrize("float64", [False, True])
def test_float_boundary_matches_quantize_and_dequantize(folder, case, float64):
    """qgru_rt_quantize_input is primitives.quantize on layer 0's static grid (round half up of the
    float64 quotient, saturation, +-inf) for every float32 next to a rounding boundary of the grid
    (8- and 16-bit x), zeros, extremes and random values, whether the float32 estimate decides
    (the default) or float64 division always does (-DQGRU_RT_FLOAT64_QUANTIZE); NaN counted;
    qgru_rt_dequantize is primitives.dequantize"""
    from qgru.primitives import quantize
    t = mb.TARGETS["host"]
    if mb.missing(t):
        pytest.skip(f"no host C compiler ({mb.missing(t)})")
    params = converted(case)
    d = exported(case, "interleaved", folder)
    (d / "quant.c").write_text(QUANTIZE)
    b = mb.build(t, d / "gru.c", d / "quant.c", d / f"quant{int(float64)}",
                 defines=["QGRU_RT_FLOAT64_QUANTIZE"] if float64 else [])
    p0, last = params.layers[0][0], params.layers[-1][0]
    s = float(p0.scale["x"])
    x = torch.tensor([0.0, -0.0, s * 0.5, -s * 0.5, s * 1.5, s * 2.4999999, 1e30, -1e30, float("inf"), float("-inf"),
                      *(torch.randn(4000, generator=torch.Generator().manual_seed(5)) * 3 * s * 2 ** (p0.bits["x"] - 1)
                        ).tolist(), s * 1e4, 1e-45, -1e-45, 3e38],
                     dtype=torch.float32)
    x = torch.cat([x, half_steps(s, int(p0.zp["x"]), p0.bits["x"], 3 if p0.bits["x"] <= 8 else 1),
                   torch.tensor([float("nan")])])
    out = mb.run(t, b, stdin=f"{x.numel()} " + " ".join(float(v).hex() for v in x.tolist())).split("\n")
    assert int(out[0]) == 1  # the NaN
    q = torch.tensor([int(line.split()[0]) for line in out[1:1 + x.numel()]])
    y = torch.tensor([float.fromhex(line.split()[1]) for line in out[1:1 + x.numel()]], dtype=torch.float32)
    want = quantize(x[:-1], p0.scale["x"], p0.zp["x"], p0.bits["x"])
    assert torch.equal(q[:-1], want) and int(q[-1]) == int(p0.zp["x"])
    assert torch.equal(y, dequantize(q, last.scale["h"], last.zp["h"]))





def float_inputs(params, gen, T=13):
    """float x [T, I]: tokens within calibration and beyond it (up to ~12x: every level, and the
    last level's clipping), one +inf and one -inf value, a token of zeros"""
    p0 = params.layers[0][0]
    span = float(p0.scale["x"]) * (qrange(p0.bits["x"])[1] - qrange(p0.bits["x"])[0]) / 2
    f = torch.tensor([0.3, 0.9, 1.2, 1.5, 2.0, 2.6, 3.3, 4.5, 6.0, 8.0, 12.0, 1.0, 0.5])[:T]
    x = (torch.rand(T, p0.input_size, generator=gen) * 2 - 1) * span * f.unsqueeze(1)
    x[3, 0], x[4, -1], x[5] = float("inf"), float("-inf"), 0.0
    lv = p0.x_levels
    if lv is not None:  # tokens whose largest (smallest) value is a level's bound, or its float32 neighbour
        rows = []
        for j in range(lv.exponent.numel()):
            for bound, col in ((float(lv.hi[j]), 0), (float(lv.lo[j]), 1)):
                if abs(bound) == float("inf"):
                    continue
                b32 = torch.tensor(bound, dtype=torch.float32)
                for v in (b32, torch.nextafter(b32, torch.tensor(float("inf"))), torch.nextafter(b32, torch.tensor(-float("inf")))):
                    r = torch.zeros(p0.input_size)
                    r[col % p0.input_size] = v
                    rows.append(r)
        x = torch.cat([x, torch.stack(rows)])
    return x


@pytest.mark.parametrize("case,smmlar", [(c, True) for c in CASES if "levels" in c] + [("w8a8-fast-bidir2", True),
                                                                                      ("w8a8-levels-bidir2", False)])
def test_host_float_input_takes_x_levels_as_the_module(case, smmlar, folder, monkeypatch):
    """qgru_rt_run_float: each token quantized on its x level (golden.quantize_levels, W.x with
    the level's bias and rescale) in every cell the runtime has, in one call and in chunks, gives
    the golden integers, and dequantized, exactly the converted module's float outputs; a model
    without levels quantizes on the static grid; a NaN anywhere is refused (QGRU_RT_ENAN) with the
    state untouched. Exported without levels, every token takes the static grid. The fast cell's
    levels rescale W.x by one SMMLAR where the export proves its form, else by a 64-bit product
    (smmlar=False: that path forced)."""
    import qgru.export_mcu as em
    monkeypatch.setattr(em, "_LEVEL_SMMLAR", smmlar)
    from qgru.golden import quantize_levels
    from qgru.primitives import quantize
    t = mb.TARGETS["host"]
    if mb.missing(t):
        pytest.skip(f"no host C compiler ({mb.missing(t)})")
    params = converted(case)
    L, D, H = len(params.layers), len(params.layers[0]), params.meta["hidden_size"]
    gen = torch.Generator().manual_seed(11)
    x = float_inputs(params, gen)
    T = x.shape[0]
    qh0 = inputs(params, gen)[1]
    p0 = params.layers[0][0]
    if "levels" in case:  # the inputs reach beyond level 0 and onto the last level
        lv = p0.x_levels.exponent.numel()
        levels = quantize_levels(p0.x_levels, x, p0.zp["x"], p0.bits["x"])[1]
        assert lv > 1 and int(levels.max()) == lv - 1 and len(set(levels.tolist())) >= 3
    for with_levels in ((True, False) if "levels" in case else (True,)):
        d = Path(folder) / f"{case}-float-{with_levels}-{smmlar}"
        write_mcu(params, d / "gru", x_levels=with_levels)
        if with_levels and case == "w8a8-levels-bidir2":  # layer 0 forward takes the fast cell
            assert ("gru_l0f_xl_mx" in (d / "gru.c").read_text()) == smmlar
        (d / "harness.c").write_text(FLOAT_HARNESS)
        binary = mb.build(t, d / "gru.c", d / "harness.c", d / "harness")
        stdin = " ".join([str(T), *(float(v).hex() for v in x.reshape(-1).tolist()), *map(str, qh0.reshape(-1).tolist())])
        vals = [int(v) for v in mb.run(t, binary, stdin=stdin).split()]
        n = 1 + T * D * H + L * D * H
        assert len(vals) == n * (2 if D == 1 else 1) + 2
        assert vals[-2:] == [-6, 1]  # QGRU_RT_ENAN, the state untouched
        # the golden stack, written here: layer 0 on each token's level (or the static grid)
        inp, want_h = [], []
        for li, row in enumerate(params.layers):
            outs = []
            for e, p in enumerate(row):
                level = None
                if li == 0 and p.x_levels is not None and with_levels:
                    q, level = quantize_levels(p.x_levels, x, p.zp["x"], p.bits["x"])
                elif li == 0:
                    q = quantize(x, p.scale["x"], p.zp["x"], p.bits["x"])
                else:
                    q = torch.cat([requantize_input(v, params.layers[li - 1][k].zp["h"], p.rescale[f"in_{k}"], p.zp["x"],
                                                    p.bits["x"]) for k, v in enumerate(inp)], -1)
                if e:
                    q, level = q.flip(0), (level.flip(0) if level is not None else None)
                o, hn = gru_direction(p, q.unsqueeze(1), qh0[li * D + e].unsqueeze(0),
                                      level=None if level is None else level.unsqueeze(1))
                outs.append(o.squeeze(1).flip(0) if e else o.squeeze(1))
                want_h.append(hn.squeeze(0))
            inp = outs
        want_out, want_h = torch.cat(inp, -1), torch.stack(want_h)
        for c in range(2 if D == 1 else 1):
            v = torch.tensor(vals[c * n:(c + 1) * n])
            assert int(v[0]) == 0
            assert torch.equal(v[1:1 + T * D * H].reshape(T, D * H), want_out), (case, with_levels, c)
            assert torch.equal(v[1 + T * D * H:].reshape(L * D, H), want_h), (case, with_levels, c)
        if with_levels:  # the converted module on the same floats: the same numbers
            m = params.to_module()
            flat = [p for row in params.layers for p in row]
            h0 = torch.stack([dequantize(qh0[i], p.scale["h"], p.zp["h"]) for i, p in enumerate(flat)]).unsqueeze(1)
            with torch.no_grad(), qgru.backend("reference"):
                y, hy = m(x.unsqueeze(1), h0)
            last = params.layers[-1]
            assert torch.equal(y.squeeze(1), torch.cat([dequantize(want_out[:, e * H:(e + 1) * H], p.scale["h"], p.zp["h"])
                                                        for e, p in enumerate(last)], -1))
            assert torch.equal(hy.squeeze(1), torch.stack([dequantize(want_h[i], p.scale["h"], p.zp["h"])
                                                           for i, p in enumerate(flat)]))


def test_command_line_and_x_levels_option(tmp_path, capsys):
    """python -m qgru.export_mcu writes the two files (exit 0) and answers an unreadable file with
    one error line (exit 1); a first layer's x levels are exported, or left out with --no-x-levels"""
    from qgru import export_mcu
    cfg = qgru.QuantConfig.load("w8a8", overrides={"tensors": {"x": {"dynamic": True}}})
    torch.manual_seed(0)
    m = qgru.QuantGRU(4, 4, config=cfg)
    qgru.calibrate(m, [torch.randn(5, 2, 4)], progress=False)
    params = m.convert().export()
    params.save(tmp_path / "m.qgru")
    assert export_mcu.main([str(tmp_path / "m.qgru"), str(tmp_path / "out" / "net")]) == 0
    assert (tmp_path / "out" / "net.c").is_file() and "net_model" in (tmp_path / "out" / "net.h").read_text()
    J = params.layers[0][0].x_levels.exponent.numel()
    assert f"{J} x levels, each token on its own" in (tmp_path / "out" / "net.h").read_text()
    assert ".xlv = &net_l0f_xlv" in (tmp_path / "out" / "net.c").read_text()
    assert export_mcu.main([str(tmp_path / "m.qgru"), str(tmp_path / "out" / "bare"), "--no-x-levels"]) == 0
    assert "x levels left out" in (tmp_path / "out" / "bare.h").read_text()
    assert "xlv" not in (tmp_path / "out" / "bare.c").read_text()
    with pytest.raises(TypeError, match="x_levels"):
        write_mcu(params, tmp_path / "x", x_levels=1)
    (tmp_path / "bad.qgru").write_bytes(b"not a parameter file")
    assert export_mcu.main([str(tmp_path / "bad.qgru"), str(tmp_path / "x")]) == 1
    assert "python -m qgru.export_mcu: error:" in capsys.readouterr().err


def test_readme_section_runs_as_written(tmp_path, monkeypatch):
    """README's "Microcontrollers and ARM boards": its export and host self-test commands, as
    written (with this interpreter as `python`), on a saved two-layer bidirectional w8a8 model."""
    import re
    import shutil
    import subprocess
    if shutil.which("cc") is None:
        pytest.skip("no host C compiler (cc)")
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("**Microcontrollers and ARM boards (C runtime).**", 1)[1]
    shell = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    assert "python -m qgru.export_mcu gru.qgru" in shell
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    m = qgru.QuantGRU(6, 8, num_layers=2, bidirectional=True, config="w8a8")
    qgru.calibrate(m, [torch.randn(9, 3, 6) for _ in range(2)], progress=False)
    m.convert().export().save("gru.qgru")
    script = "set -e\n" + shell.replace("python -m ", f"{sys.executable} -m ")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "mismatches 0" == shell.split("#")[-1].strip()


def test_export_under_a_meta_default_device_writes_the_same_files(tmp_path):
    """write_mcu makes every tensor on its parameters' device: under a meta default device it
    writes exactly the files it writes otherwise."""
    torch.manual_seed(1)
    m = qgru.QuantGRU(5, 6, num_layers=2, bidirectional=True, config="w8a8")
    qgru.calibrate(m, [torch.randn(7, 2, 5) for _ in range(2)], progress=False)
    params = m.convert().export()
    write_mcu(params, tmp_path / "a" / "g")
    torch.set_default_device("meta")
    try:
        write_mcu(params, tmp_path / "b" / "g")
    finally:
        torch.set_default_device(None)
    for name in ("g.c", "g.h"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()


_V6M_HIGH = r"""
#include <stdint.h>
#ifdef V6M_BOARD /* on the Cortex-M0 under QEMU: the inline assembly of qgru_rt_fixed.h */
#include "board.h"
#define REPORT(bad, n) (qgru_board_put_int("bad ", bad), qgru_board_put_int("prod ", n))
#define NOTE(...) ((void)0)
#else
#include <stdio.h>
#define REPORT(bad, n) printf("bad %ld prod %ld\n", bad, n)
#define NOTE(...) printf(__VA_ARGS__)
#endif
#include "qgru_rt_fixed.h"
#ifndef V6M_N
#define V6M_N 3000
#endif
#ifndef QGRU_RT_V6M_MULH
#error "the ARMv6-M branch of qgru_rt_fixed.h was not taken"
#endif
static uint64_t s = 88172645463325252ull;
static uint32_t rnd(void) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return (uint32_t)(s >> 11); }
static int32_t pick(int i) {  /* edges, then every bit width */
    static const int64_t e[] = {0, 1, -1, 2, -2, 32767, 32768, -32768, -32769, 65535, 65536, -65536,
                                2147483647, -2147483647 - 1, 2147483646, -2147483647, 0x7fff0000, -0x7fff0000, 0x8000, 0xffff};
    if (i < (int)(sizeof e / sizeof e[0])) return (int32_t)e[i];
    return (int32_t)(rnd() >> (rnd() % 32)) * ((rnd() & 1) ? 1 : -1);
}
int main(void) {
    long bad = 0, n = 0, i, j;
    for (i = 0; i < V6M_N; i++)
        for (j = 0; j < 300; j++) {
            const int32_t v = pick((int)i), m0 = pick((int)j), m = m0 < 0 ? ~m0 : m0, k = (int32_t)(rnd() % 2001) - 1000;
            const int64_t p = (int64_t)v * m;
            const int64_t want_r = (int64_t)k + ((p + 2147483648LL) >> 32), want_h = p >> 32;
            const int32_t vs = v >> (rnd() % 20); /* the clamps (Thumb-1 assembly on the M0) */
            const int32_t want_s = vs < -32768 ? -32768 : vs > 32767 ? 32767 : vs, want_u = vs < 0 ? 0 : vs > 65535 ? 65535 : vs;
            const int32_t want_8 = vs < -128 ? -128 : vs > 127 ? 127 : vs;
            if (QGRU_RT_SSAT16(vs) != want_s || QGRU_RT_USAT16(vs) != want_u || QGRU_RT_SSAT8(vs) != want_8) {
                if (bad++ < 5) NOTE("sat %d\n", (int)vs);
            }
            if ((int64_t)qgru_rt_mulhr(v, m, k) != want_r || (int64_t)qgru_rt_mulhi(v, m) != want_h) {
                if (bad++ < 5) NOTE("v %d m %d\n", (int)v, (int)m);
            }
#ifdef __SIZEOF_INT128__
            /* prod_hi: a b m with m >= 0, |a b m| < 2^63, the result in int32 */
            {
                const int32_t a = (int32_t)(v >> (rnd() % 17)), b = (int32_t)(m0 >> (rnd() % 17));
                const int64_t ab = (int64_t)a * b;
                const int32_t mm = (int32_t)(rnd() & 0x7fffffff) >> (rnd() % 31);
                const __int128 x = (__int128)ab * mm;
                const __int128 w = x >> 32;
                if (w >= -2147483648LL && w <= 2147483647LL) {
                    n++;
                    if ((int64_t)qgru_rt_prod_hi(a, b, mm) != (int64_t)w && bad++ < 5)
                        NOTE("a %d b %d m %d\n", (int)a, (int)b, (int)mm);
                }
            }
#else
            /* without int128: a b = ph 2^32 + pl (pl unsigned), floor(a b m / 2^32) = ph m + floor(pl m / 2^32) */
            {
                const int32_t a = (int32_t)(v >> (rnd() % 17)), b = (int32_t)(m0 >> (rnd() % 17));
                const int64_t ab = (int64_t)a * b;
                const int32_t mm = (int32_t)(rnd() & 0x7fffffff) >> (rnd() % 31);
                const int64_t ph = ab >> 32;
                const uint64_t pl = (uint64_t)ab & 0xffffffffu;
                const int64_t w = ph * mm + (int64_t)((pl * (uint32_t)mm) >> 32);
                if (ph >= -(1LL << 31) && ph < (1LL << 31) && w >= -2147483648LL && w <= 2147483647LL) {
                    n++;
                    if ((int64_t)qgru_rt_prod_hi(a, b, mm) != w && bad++ < 5)
                        NOTE("a %d b %d m %d\n", (int)a, (int)b, (int)mm);
                }
            }
#endif
        }
    REPORT(bad, n);
    return bad != 0;
}
"""


def test_v6m_high_products_exact_for_every_int32(tmp_path):
    """The ARMv6-M forms of qgru_rt_fixed.h's high products (16-bit halves: Cortex-M0 has no 64-bit
    multiply), compiled for the host with the v6-M branch forced, give int64 / int128 arithmetic's
    floor((v m + 2^31) / 2^32) + k, floor(v m / 2^32) and floor(a b m / 2^32) on edge values and
    900,000 random operands of every bit width."""
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no host C compiler (cc)")
    src = tmp_path / "v6m.c"
    src.write_text(_V6M_HIGH)
    exe = tmp_path / "v6m"
    r = subprocess.run([cc, "-std=gnu99", "-O1", "-D__ARM_ARCH_6M__=1", "-I", str(Path(qgru.__file__).resolve().parents[1] / "csrc" / "c"),
                        str(src), "-o", str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("bad 0"), out.stdout
    assert int(out.stdout.split()[-1]) > 100000, out.stdout


def test_v6m_high_products_on_cortex_m0(tmp_path):
    """The same check of qgru_rt_mulhr / qgru_rt_mulhi, qgru_rt_prod_hi and the 16-bit clamps built
    for the Cortex-M0 (their Thumb-1 inline assembly) and run under QEMU: edge values and 90,000
    random operands (prod_hi against int64 words in place of int128)."""
    t = mb.TARGETS["m0"]
    tool = mb.missing(t)
    if tool:
        pytest.skip(f"m0: {tool} is not installed")
    src = tmp_path / "v6m.c"
    src.write_text(_V6M_HIGH)
    empty = tmp_path / "none.c"
    empty.write_text("typedef int qgru_none;\n")
    b = mb.build(t, empty, src, tmp_path / "v6m-m0", defines=["V6M_BOARD", "V6M_N=300"])
    out = mb.run(t, b, timeout=120)
    assert "bad 0\n" in out, out
    assert int(out.split("prod ")[1].split()[0]) > 10000, out
