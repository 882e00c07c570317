#!/usr/bin/env python
"""A converted QuantGRU's PackedSequence call against its padded call and float nn.GRU packed,
interleaved in one run (medians, 1 thread): what docs/packed_overhead.md reports.

    python scripts/bench_packed.py                        # the two default shapes, w8a8
    python scripts/bench_packed.py --shapes "12,32,370,29" --calls 400 --profile
    python scripts/bench_packed.py --shapes "12,32,370,29" --layers 2 --bidirectional   # the demo's model
    python scripts/bench_packed.py --shapes "12,32,370,29" --layers 2 --bidirectional --against /tmp/old
        # also the packed call of the qgru checkout at /tmp/old ("before"; its own build), run in a worker
        # process call by call between this process's calls: the same machine load for both
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.nn.utils.rnn import pack_padded_sequence

import qgru

SHAPES = ["12,32,370,29", "64,128,64,100"]


def setup(I, H, N, T, config, layers=1, bidirectional=False, seed=0):
    torch.manual_seed(seed)
    gru = torch.nn.GRU(I, H, num_layers=layers, bidirectional=bidirectional).eval()
    q = qgru.quantize_model(gru, [torch.randn(T, 8, I) for _ in range(2)], config=config, progress=False)
    x = torch.randn(T, N, I)
    lengths = torch.randint(max(T // 4, 1), T + 1, (N,))
    lengths[0] = T
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    return gru, q, x, packed


WORKER = r"""
import sys, time, torch
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/scripts"]
import bench_packed
torch.set_num_threads(1)
_, q, _, packed = bench_packed.setup(*(int(v) for v in sys.argv[2:6]), sys.argv[6], int(sys.argv[7]), sys.argv[8] == "1")
for line in sys.stdin:
    ctx = torch.inference_mode if line.strip() == "i" else torch.no_grad
    with ctx():
        t0 = time.perf_counter()
        q(packed)
        t = time.perf_counter() - t0
    print(t, flush=True)
"""


class Against:
    """The packed call of another qgru checkout (its bench_packed.setup, the same model and data),
    in a worker process that runs one call per request and reports its time."""

    def __init__(self, path, I, H, N, T, config, layers, bidirectional):
        env = dict(os.environ, PYTHONPATH=path)
        args = [sys.executable, "-c", WORKER, path, str(I), str(H), str(N), str(T), config, str(layers),
                "1" if bidirectional else "0"]
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def call(self, inference):
        self.p.stdin.write("i\n" if inference else "g\n")
        self.p.stdin.flush()
        return float(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def run(I, H, N, T, config, calls, inference, layers=1, bidirectional=False, against=None):
    gru, q, x, packed = setup(I, H, N, T, config, layers, bidirectional)
    import copy
    old = copy.deepcopy(q)
    old._cpu_packed_call = lambda input, hx: None  # the general path: what a packed call ran before forward_packed
    cases = {"qgru packed": lambda: q(packed), "general path packed": lambda: old(packed), "qgru padded": lambda: q(x),
             "float packed": lambda: gru(packed)}
    ctx = torch.inference_mode if inference else torch.no_grad
    times = {k: [] for k in cases}
    other = Against(against, I, H, N, T, config, layers, bidirectional) if against else None
    if other:
        times["before packed"] = []
    with ctx():
        for f in cases.values():
            for _ in range(5):
                f()
        for _ in range(5 if other else 0):
            other.call(inference)
        for _ in range(calls):
            for k, f in cases.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
            if other:
                times["before packed"].append(other.call(inference))
    if other:
        other.close()
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=";".join(SHAPES), help="I,H,N,T;I,H,N,T...")
    ap.add_argument("--config", default="w8a8")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--bidirectional", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the packed call (first shape)")
    ap.add_argument("--against", metavar="DIR", help="also time the packed call of the qgru checkout at DIR")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for shape in a.shapes.split(";"):
        I, H, N, T = (int(v) for v in shape.split(","))
        for inference in (True, False):
            r = run(I, H, N, T, a.config, a.calls, inference, a.layers, a.bidirectional, a.against)
            print(f"I={I} H={H} N={N} T={T} {'inference_mode' if inference else 'no_grad':14s} "
                  + "  ".join(f"{k} {v:.3f} ms" for k, v in r.items())
                  + f"  packed/float {r['qgru packed'] / r['float packed']:.2f}"
                  + (f"  before/float {r['before packed'] / r['float packed']:.2f}" if a.against else ""), flush=True)
        if a.profile:
            import cProfile
            import pstats
            _, q, _, packed = setup(I, H, N, T, a.config, a.layers, a.bidirectional)
            with torch.inference_mode():
                q(packed)
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(a.calls):
                    q(packed)
                pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
            a.profile = False


if __name__ == "__main__":
    main()
