#!/usr/bin/env python
"""Which grids and which default: logit/output SQNR against float for each observer and scale mode,
on the demo (Japanese Vowels, 2-layer bidirectional GRU, H=32) and on scripts/accuracy.py's
synthetic GRU (T=100 N=64 I=256 H=512), next to torch's dynamic-quant GRU; plus the demo's
calibration time (calibrate + convert) per observer. One run, one table (README "Configs").

    python scripts/accuracy_grids.py                 # docs/accuracy.md's table (~2 min on 2 cores)
    python scripts/accuracy_grids.py --T 20 --N 8    # quicker synthetic case
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

import qgru
from qgru.native import cpu_model_name
from qgru.demo import batches, dynamic_quant, load_checkpoint, load_dataset

OBSERVERS = ("percentile", "mse")
MODES = ("pow2", "multiplier")


def sqnr_db(ref, out) -> float:
    ref, out = ref.double(), out.double()
    err = float((out - ref).pow(2).sum())
    return float("inf") if err == 0 else 10 * torch.log10(ref.pow(2).sum() / err).item()


def quantize(model, calib, cfg: str, kind: str, mode: str):
    config = qgru.QuantConfig.load(cfg, overrides={"scale_mode": mode, "observer": {"kind": kind}})
    t = time.perf_counter()
    q = qgru.quantize_model(model, calib, config=config, progress=False)
    return q, time.perf_counter() - t


def measure(model, calib, test, cfgs):
    """{column: (SQNR dB, calibration seconds)} on ``test`` (a list of model inputs)."""
    with torch.no_grad():
        ref = [model(x) for x in test]
        cols = {}
        dq, why = dynamic_quant(model)
        if dq is None:
            print(f"note: {why}")
        else:
            cols["torch dynamic-quant"] = (sqnr_db(torch.cat(ref), torch.cat([dq(x) for x in test])), None, dq)
        for cfg in cfgs:
            for kind in OBSERVERS:
                for mode in MODES:
                    q, secs = quantize(model, calib, cfg, kind, mode)
                    cols[f"{cfg} {mode} {kind}"] = (sqnr_db(torch.cat(ref), torch.cat([q(x) for x in test])), secs, q)
    return cols


class GRUOut(torch.nn.Module):
    """A bare GRU returning its output sequence (scripts/accuracy.py's quantity)."""

    def __init__(self, gru):
        super().__init__()
        self.gru = gru

    def forward(self, x):
        return self.gru(x)[0]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "reference"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from qgru.backends import backend as force_backend

    data = load_dataset()
    demo_model, _ = load_checkpoint()
    demo_model.eval()
    (xtr, _), (xte, yte) = data["train"], data["test"]
    demo_calib, demo_test = batches(xtr), batches(xte, size=len(xte))

    torch.manual_seed(0)  # scripts/accuracy.py's model and data (seed 0)
    gru = torch.nn.GRU(args.input, args.hidden).eval()
    syn_calib = [torch.randn(args.T, args.N, args.input) for _ in range(4)]
    syn_test = [torch.randn(args.T, args.N, args.input)]
    syn_model = GRUOut(gru).eval()

    with force_backend(args.backend):
        demo = measure(demo_model, demo_calib, demo_test, ("w8a8", "w8a16"))
        syn = measure(syn_model, syn_calib, syn_test, ("w8a8", "w8a16"))
    with torch.no_grad():
        float_acc = 100 * float((demo_model(demo_test[0]).argmax(-1) == yte).double().mean())
    cpu = cpu_model_name()
    print(f"\nlogit (demo) / output (synthetic T={args.T} N={args.N} I={args.input} H={args.hidden}) SQNR vs float, "
          f"dB; {args.backend} backend; torch {torch.__version__}, {platform.machine()} {cpu}, "
          f"{torch.get_num_threads()} thread(s)\n")
    print(f"| {'column':<28} | {'demo':>7} | {'demo acc %':>10} | {'synthetic':>9} | {'demo calib s':>12} |")
    print(f"|{'-' * 30}|{'-' * 9}|{'-' * 12}|{'-' * 11}|{'-' * 14}|")
    print(f"| {'float':<28} | {'-':>7} | {float_acc:>10.2f} | {'-':>9} | {'-':>12} |")
    for col in demo:
        d, secs, m = demo[col]
        with torch.no_grad():
            acc = 100 * float((m(demo_test[0]).argmax(-1) == yte).double().mean())
        print(f"| {col:<28} | {d:>7.2f} | {acc:>10.2f} | {syn[col][0]:>9.2f} | "
              f"{'-' if secs is None else f'{secs:.2f}':>12} |")


if __name__ == "__main__":
    main()
