#!/usr/bin/env python
"""Accuracy of qgru against float nn.GRU and torch's dynamic-quant GRU, one table, one run.

Default shape: T=100, N=64, input 256, hidden 512, nn.GRU's default init, randn inputs,
calibrated on batches different from the evaluation batch. Metrics are computed on the GRU's
output sequence against the float nn.GRU output: SQNR (dB) = 10 log10(sum ref^2 / sum err^2) and
cosine similarity.

    python scripts/accuracy.py                   # the default table (a few minutes on 2 cores)
    python scripts/accuracy.py --T 20 --N 8      # quicker
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

import qgru
from qgru.demo import dynamic_quant


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    err = (out.double() - ref.double()).pow(2).sum()
    return float("inf") if err == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / err))


def cosine(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(ref.double().flatten(), out.double().flatten(), dim=0))


def dynamic_quant_gru(gru: torch.nn.GRU):
    """torch's dynamic-quant GRU (qgru.demo.dynamic_quant), or None with a note where torch lacks it."""
    dq, why = dynamic_quant(gru)
    if dq is None:
        print(f"note: {why}")
    return dq


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--calib-batches", type=int, default=4)
    ap.add_argument("--configs", default="w8a8,w8a16,w16a16")
    ap.add_argument("--scale-modes", default="pow2,multiplier")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    gru = torch.nn.GRU(args.input, args.hidden).eval()
    calib = [torch.randn(args.T, args.N, args.input) for _ in range(args.calib_batches)]
    x = torch.randn(args.T, args.N, args.input)  # evaluation batch, never seen in calibration
    with torch.no_grad():
        ref, _ = gru(x)

    rows = []

    def add(name: str, fn) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = fn()
        rows.append((name, sqnr_db(ref, out), cosine(ref, out), time.perf_counter() - t0))

    add("float nn.GRU", lambda: gru(x)[0])
    dq = dynamic_quant_gru(gru)
    if dq is not None:
        add("torch dynamic-quant int8", lambda: dq(x)[0])
    for cfg in args.configs.split(","):
        for mode in args.scale_modes.split(","):
            config = qgru.QuantConfig.load(cfg, overrides={"scale_mode": mode})
            q = qgru.quantize_model(gru, calib, config=config)
            add(f"qgru {cfg} ({mode})", lambda: q(x)[0])

    print(f"\nT={args.T} N={args.N} input={args.input} hidden={args.hidden}, "
          f"{args.calib_batches} calibration batches, evaluated on a separate batch; "
          f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads\n")
    print(f"| {'model':<28} | {'SQNR (dB)':>9} | {'cosine':>10} | {'time (s)':>8} |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 12}|{'-' * 10}|")
    for name, s, c, t in rows:
        print(f"| {name:<28} | {s:>9.2f} | {c:>10.6f} | {t:>8.2f} |")


if __name__ == "__main__":
    main()
