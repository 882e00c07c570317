"""Instructions per step, flash and RAM of the C runtime (csrc/c/) per target and shape.

For each shape (input -> hidden, one unidirectional layer, config w8a8 on a static x grid) the
model is exported once and scripts/mcu_build.py builds csrc/c/boards/bench_main.c for each target
twice (1 and 5 streaming steps). QEMU runs each build one instruction per translation block with
the execution log on (``-singlestep -d exec,nochain``); the difference of the two logs' line
counts / 4 is the exact count of instructions a step retires (startup and printing cancel out).
QEMU models no cycles (an M4 retires at most one instruction a cycle). Flash: arm-none-eabi-size
of the Cortex-M builds (runtime, model data, board start-up); RAM: the state, the work buffer
and the deepest stack of qgru_rt_run's call tree from GCC's call graph (-fcallgraph-info=su).

    python scripts/bench_mcu.py [--targets m0,m4,m55,a53,a64-dotprod] [--shapes 16x64,33x96,40x128] [--float]

--fast-only: the runtime built with -DQGRU_RT_FAST_ONLY (only the fast cell's code, which every
direction of these models takes). --float: the same model with x levels (config x.dynamic, the default's), each step one
qgru_rt_run_float call: its tokens within calibration (level 0) and at 3x it (a level > 0).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mcu_build as mb  # noqa: E402

ANCHORS = {  # (target, shape): instructions per step before the runtime (export_c), and the goal
    ("m4", "16x64"): "127,165 before; goal <= 30,000",
    ("m4", "33x96"): "260,995 before; NNoM+CMSIS-NN 145k cycles (STM32L476); goal <= 72,000",
    ("m55", "16x64"): "106,299 before; goal <= half the M4's",
    ("m55", "33x96"): "goal <= half the M4's",
    ("m0", "16x64"): "949,799 before; goal <= 3x the M4's",
    ("a64-dotprod", "16x64"): "39,681 before (2.6 / MAC); goal <= 0.4 / MAC",
}


def model(I: int, H: int, folder: Path, levels: bool = False):
    import torch
    import qgru
    from qgru.export_mcu import write_mcu
    cfg = qgru.QuantConfig.load("w8a8", overrides={"tensors": {"x": {"dynamic": levels}, "h_gemm": {"dynamic": False}}})
    torch.manual_seed(0)
    m = qgru.QuantGRU(I, H, config=cfg)
    qgru.calibrate(m, [torch.randn(20, 4, I) for _ in range(2)], progress=False)
    p = m.convert().export()
    out = {}
    for layout in ("interleaved", "rows", "pairs", "offset"):
        d = folder / f"{I}x{H}-{layout}{'-levels' if levels else ''}"
        write_mcu(p, d / "gru", layout=layout)
        out[layout] = d
    return out


FAST_ONLY = False  # --fast-only
WORK = {}  # model folder -> the work bytes of a streaming step, as the last build there printed them


def count(t, d: Path, steps: int, xf: float = 0.0) -> int:
    """instructions of `steps` steps; xf > 0: float input, x's integers times xf"""
    b = mb.build(t, d / "gru.c", mb.BOARDS / "bench_main.c", d / f"bench-{t.name}-{steps}",
                 defines=['QGRU_MODEL_HEADER="gru.h"', "QGRU_MODEL=gru", f"QGRU_BENCH_STEPS={steps}",
                          *([f"QGRU_BENCH_FLOAT={xf!r}"] if xf else []), *(["QGRU_RT_FAST_ONLY"] if FAST_ONLY else [])],
                 extra=["-fstack-usage", "-fcallgraph-info=su"])
    log = d / f"exec-{t.name}-{steps}.log"
    out = mb.run(t, b, timeout=600, extra=["-singlestep", "-d", "exec,nochain", "-D", str(log)])
    assert "rc 0" in out, out
    WORK[d] = int(re.search(r"work (\d+)", out).group(1))  # qgru_rt_work_bytes(m, 1), printed by the build
    n = sum(1 for line in log.open(errors="replace") if line.startswith("Trace"))
    log.unlink()
    return n


def flash(t, d: Path) -> str:
    if not t.bare:
        return "-"
    r = subprocess.run(["arm-none-eabi-size", str(d / f"bench-{t.name}-1")], capture_output=True, text=True)
    text, data = map(int, r.stdout.splitlines()[1].split()[:2])
    hdr = (d / "gru.h").read_text()
    w = int(re.search(r"weights (\d+)", hdr).group(1))
    return f"{text + data} (weights {w}, other {text + data - w})"


def stack(d: Path) -> int:
    """the deepest static stack of qgru_rt_run's call tree: GCC's call graph (-fcallgraph-info=su,
    one .ci file per object: each function's frame and its calls), the largest sum of frames along
    any path from qgru_rt_run (library calls such as memcpy count 0: newlib's leaf frames)"""
    frames, calls = {}, {}
    for ci in d.glob("*.ci"):
        text = ci.read_text()
        for title, label in re.findall(r'node: \{ title: "([^"]+)" label: "([^"]*)"', text):
            m = re.search(r"(\d+) bytes \((?:static|dynamic)", label)
            if m:
                frames[title.split(":")[-1]] = int(m.group(1))
        for a, b in re.findall(r'edge: \{ sourcename: "([^"]+)" targetname: "([^"]+)"', text):
            calls.setdefault(a.split(":")[-1], set()).add(b.split(":")[-1])

    def deepest(f, seen=()):
        if f in seen:
            raise RuntimeError(f"recursion through {f}: no static stack bound")
        return frames.get(f, 0) + max((deepest(g, seen + (f,)) for g in calls.get(f, ())), default=0)
    assert "qgru_rt_run" in frames, "no call graph for qgru_rt_run (-fcallgraph-info=su)"
    return deepest("qgru_rt_run")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="m0,m4,m55,a53,a64-dotprod")
    ap.add_argument("--shapes", default="16x64,33x96,40x128")
    ap.add_argument("--float", action="store_true", help="also float input with x levels (qgru_rt_run_float)")
    ap.add_argument("--fast-only", action="store_true", help="build the runtime with -DQGRU_RT_FAST_ONLY")
    a = ap.parse_args()
    global FAST_ONLY
    FAST_ONLY = a.fast_only
    targets = [mb.TARGETS[n] for n in a.targets.split(",")]
    print("| target | kernel | shape | instructions / step | per multiply-add | flash bytes | RAM: state + work + stack | anchor |")
    print("|---|---|---|---:|---:|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes.split(","):
            I, H = map(int, shape.split("x"))
            dirs = model(I, H, Path(tmp))
            macs = 3 * H * (I + H)
            for t in targets:
                if mb.missing(t):
                    print(f"| {t.name} | - | {shape} | skipped: {mb.missing(t)} missing | | | | |")
                    continue
                d = dirs[t.layout]
                for f in [*d.glob("*.su"), *d.glob("*.ci")]:  # (the call graph of this target's builds only)
                    f.unlink()
                n = (count(t, d, 5) - count(t, d, 1)) / 4
                kernel = {"m0": "v6m (MULS)", "m4": "dsp (SMLAD)", "m4f": "dsp (SMLAD), FPU", "m55": "mve", "a53": "neon", "a64-dotprod": "neon SDOT"}.get(t.name, "?")
                ram = f"{2 * H} + {WORK[d]} + {stack(d)}"
                print(f"| {t.name} | {kernel} | {I} -> {H} | {n:,.0f} | {n / macs:.2f} | {flash(t, d)} | {ram} | "
                      f"{ANCHORS.get((t.name, shape), '')} |", flush=True)
            if not a.float:
                continue
            ldirs = model(I, H, Path(tmp), levels=True)
            for t in targets:
                if mb.missing(t):
                    continue
                d = ldirs[t.layout]
                scale = float(re.search(r"_X_SCALE (\S+)", (d / "gru.h").read_text()).group(1))
                for f, what in ((1.0, "float x, level 0"), (3.0, "float x at 3x calibration (a level > 0)")):
                    n = (count(t, d, 5, scale * f) - count(t, d, 1, scale * f)) / 4
                    print(f"| {t.name} | {what} | {I} -> {H} | {n:,.0f} | {n / macs:.2f} | {flash(t, d)} | | |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
