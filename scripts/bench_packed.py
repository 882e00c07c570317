#!/usr/bin/env python
"""A converted QuantGRU's PackedSequence call against its padded call and float nn.GRU packed,
interleaved in one run (medians, 1 thread): what docs/packed_overhead.md reports.

    python scripts/bench_packed.py                        # the two default shapes, w8a8
    python scripts/bench_packed.py --shapes "12,32,370,29" --calls 400 --profile
    python scripts/bench_packed.py --shapes "12,32,370,29" --layers 2 --bidirectional   # the demo's model
"""
from __future__ import annotations

import argparse
import statistics
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


def run(I, H, N, T, config, calls, inference, layers=1, bidirectional=False):
    gru, q, x, packed = setup(I, H, N, T, config, layers, bidirectional)
    import copy
    old = copy.deepcopy(q)
    old._cpu_packed_call = lambda input, hx: None  # the general path: what a packed call ran before forward_packed
    cases = {"qgru packed": lambda: q(packed), "general path packed": lambda: old(packed), "qgru padded": lambda: q(x),
             "float packed": lambda: gru(packed)}
    ctx = torch.inference_mode if inference else torch.no_grad
    times = {k: [] for k in cases}
    with ctx():
        for f in cases.values():
            for _ in range(5):
                f()
        for _ in range(calls):
            for k, f in cases.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=";".join(SHAPES), help="I,H,N,T;I,H,N,T...")
    ap.add_argument("--config", default="w8a8")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--bidirectional", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the packed call (first shape)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    for shape in a.shapes.split(";"):
        I, H, N, T = (int(v) for v in shape.split(","))
        for inference in (True, False):
            r = run(I, H, N, T, a.config, a.calls, inference, a.layers, a.bidirectional)
            print(f"I={I} H={H} N={N} T={T} {'inference_mode' if inference else 'no_grad':14s} "
                  + "  ".join(f"{k} {v:.3f} ms" for k, v in r.items())
                  + f"  packed/float {r['qgru packed'] / r['float packed']:.2f}", flush=True)
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
