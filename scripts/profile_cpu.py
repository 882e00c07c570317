#!/usr/bin/env python
"""Where a qgru CPU call's time goes, per phase: Python and dispatch, quantize (the input
on its grid or x levels, h0), W.x, R.h, the cell, the wait between steps, dequantize.

The cpu backend's phase clock (csrc/cpu/qgru_cpu.cpp, off unless asked: profile_enable) sums each
phase's steady-clock time over the threads that run it; `Python/dispatch` is the module call's wall
time minus the native Stack call's. W.x on the fused path (batch >= 16, or T = 1) runs inside each
step's tasks and is timed there; below 16 rows it is one GEMM per chunk of steps (+ requantization).
Timing itself costs two clock reads per task phase: a few % of a small step.

    python scripts/profile_cpu.py                           # the default shapes
    python scripts/profile_cpu.py --shape 256,512,64,100,2  # I,H,N,T,threads
    python scripts/profile_cpu.py --configs w8a8,w8a16
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import qgru
from qgru.native import cpu_model_name, load

SHAPES = ["256,512,64,100,2", "16,64,32,100,1", "64,128,16,100,1", "128,512,1,100,1", "256,512,1,1,1"]
PHASES = ["quantize", "W.x", "R.h", "cell", "wait", "dequantize"]


def profile(I, H, N, T, threads, cfg, seconds):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    gru = torch.nn.GRU(I, H).eval()
    name, _, static = cfg.partition(":")
    over = {"tensors": {"x": {"dynamic": False}}} if static == "static" else None
    q = qgru.quantize_model(gru, [torch.randn(20, 8, I) for _ in range(2)],
                            config=qgru.QuantConfig.load(name, overrides=over), progress=False)
    mod = load("cpu")
    x = torch.randn(T, N, I)
    with torch.inference_mode():
        for _ in range(3):
            q(x)
        mod.profile_enable(True)
        mod.profile_read(True)
        walls, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(walls) < 3:
            t0 = time.perf_counter()
            q(x)
            walls.append(time.perf_counter() - t0)
        mod.profile_enable(False)
        ns = mod.profile_read(True)
    calls = ns[-1] or 1
    us = [v / calls / 1e3 for v in ns[:-1]]
    phases, stack = us[:6], us[6]
    wall = sum(walls) / len(walls) * 1e6
    return dict(wall=wall, median=statistics.median(walls) * 1e6, stack=stack, python=max(wall - stack, 0.0),
                phases=phases, calls=len(walls))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", help="I,H,N,T,threads (repeatable); default: " + " ".join(SHAPES))
    ap.add_argument("--configs", default="w8a8", help="comma-separated; NAME:static for x without levels")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed calls per shape and config, about")
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_model_name()}; torch {torch.__version__}; {qgru.backends()['cpu']['detail'].split(';')[0]}")
    head = ["I", "H", "N", "T", "thr", "config", "call µs", "Python/dispatch"] + PHASES + ["other"]
    print("| " + " | ".join(head) + " |\n|" + "|".join("---" for _ in head) + "|")
    for shape in args.shape or SHAPES:
        I, H, N, T, thr = (int(v) for v in shape.split(","))
        for cfg in args.configs.split(","):
            r = profile(I, H, N, T, thr, cfg, args.seconds)
            # thread-time of the phases; other: the Stack call's wall time times the threads, less the phases
            total = r["python"] + max(r["stack"] * thr, sum(r["phases"]))
            other = max(r["stack"] * thr - sum(r["phases"]), 0.0)
            cells = [f"{v:.1f} ({v / total:.0%})" for v in [r["python"]] + r["phases"] + [other]]
            print(f"| {I} | {H} | {N} | {T} | {thr} | {cfg} | {r['wall']:.1f} | " + " | ".join(cells) + " |", flush=True)
    print("\nphases: µs per call summed over threads (share of the call's thread time); other: the native call's "
          "wall time x threads, less the timed phases (buffers, state conversion, thread start)")


if __name__ == "__main__":
    main()
