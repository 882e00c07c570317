#!/usr/bin/env python
"""The weight-only mode measured: accuracy, weight bytes, CPU speed, and GPU speed
where a GPU is present. Prints markdown tables (docs/weight_only.md holds a run's output).

1. Accuracy on the demo (qgru/demo.py: Japanese Vowels, the shipped 2-layer bidirectional GRU,
   hidden 32; calibrated on the training split, measured on the test split) and on synthetic
   data (nn.GRU(256, 512) at torch's default init, randn inputs): output SQNR against the float
   model and, for the demo, test accuracy. Rows: float, torch dynamic-quant int8, qgru w8a8 and
   w8a16 (integer-only), and the weight-only configs.
2. Weight bytes of nn.GRU(256, 512): float16, w8a8 (int8 + its scales), each weight-only config
   (codes + scales + zero points).
3. CPU speed, nn.GRU(256, 512): B=1 streaming (T=1 calls carrying h, the time per call) and
   B=64 T=100 (one call), float nn.GRU vs qgru w8a8 (the cpu backend) vs weight-only; the models
   take turns call by call and each reports its median (robust to a shared machine's drift).
4. GPU speed (only with CUDA; skipped here otherwise): cuDNN fp16 nn.GRU vs the weight-only
   w4g128 float16 module through Triton, each recurrent kernel (triton_kernel "step": one launch
   per time step; "fused": one launch per layer direction) called plainly and, cuda_graph=True,
   replayed as a CUDA graph; B=1 and B=64, T=1000 and T=1 calls, hidden 512 / 1024.

    python scripts/weight_only.py                 # everything this machine can run
    python scripts/weight_only.py --quick         # fewer repeats, smaller synthetic data
    python scripts/weight_only.py --skip-speed    # accuracy and bytes only
    python scripts/weight_only.py --only-speed --threads 1   # the speed tables, one thread
    python scripts/weight_only.py --only-gpu --repeats 5 [--gpu-sweep]   # the GPU table (and launch shapes)
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import time
import warnings

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's qgru
import qgru  # noqa: E402
from qgru import demo  # noqa: E402
from qgru import weight_only as wo
from qgru.compare import sqnr_db
from qgru.weight_only import WeightOnlyGRU

WO_CONFIGS = ("w8g128", "w4g128", "w4g64", "w4pc", "w2g64", "w2g32")
INT_CONFIGS = ("w8a8", "w8a16")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _call(m, b):
    return demo._call(m, b)


def _outputs(model, batches):
    with torch.no_grad():
        return [demo._out_tensor(_call(model, b)).double() for b in batches]


def _row(name, ref, outs, targets=None):
    signal = sum(float(r.pow(2).sum()) for r in ref)
    noise = sum(float((o - r).pow(2).sum()) for o, r in zip(outs, ref))
    acc = None
    if targets is not None:
        acc = 100 * sum(int((o.argmax(-1) == y).sum()) for o, y in zip(outs, targets)) / sum(y.numel() for y in targets)
    return name, sqnr_db(signal, noise), acc


def _int_backend():
    """qgru's cpu backend where it builds (a minute the first time), else the reference backend."""
    from qgru import native
    try:
        native.load("cpu")
        return "cpu"
    except Exception:  # noqa: BLE001 - no compiler: bit-identical reference backend
        return "reference"


def accuracy_rows(model, calib, test, targets, backend):
    rows = []
    ref = _outputs(model, test)
    rows.append(_row("float", ref, ref, targets))
    dq, why = demo.dynamic_quant(model)
    if dq is not None:
        rows.append(_row("torch dynamic-quant int8", ref, _outputs(dq, test), targets))
    with qgru.backend(backend):
        for cfg in INT_CONFIGS:
            q = qgru.quantize_model(model, calib, config=cfg, progress=False)
            rows.append(_row(f"qgru {cfg} (integer-only)", ref, _outputs(q, test), targets))
    for cfg in WO_CONFIGS:
        q = qgru.quantize_model(model, calib, config=cfg)
        rows.append(_row(f"weight-only {cfg} (gptq)", ref, _outputs(q, test), targets))
    for cfg in ("w4g128", "w2g64"):
        q = qgru.quantize_model(model, None, config=wo.WeightOnlyConfig.load(cfg, weight_rounding="nearest"))
        rows.append(_row(f"weight-only {cfg} (nearest)", ref, _outputs(q, test), targets))
    return rows


def _table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _fmt(rows, with_acc):
    return [(n, f"{s:.2f}" if s != float("inf") else "inf") + ((f"{a:.2f}",) if with_acc else ())
            for n, s, a in rows]


def bytes_rows(I=256, H=512):
    g = nn.GRU(I, H)
    n_w = sum(p.numel() for n, p in g.named_parameters() if n.startswith("weight"))
    fp16 = 2 * n_w
    w8a8 = n_w + 8 * 3 * H * 2  # int8 weights + a float64 scale per output row of W and R (qgru files)
    rows = [("float16", fp16, "1.000", f"{fp16 / w8a8:.3f}"), ("w8a8 (int8, per-row scales)", w8a8,
                                                               f"{w8a8 / fp16:.3f}", "1.000")]
    for cfg in WO_CONFIGS:
        m = WeightOnlyGRU.from_float(g, wo.WeightOnlyConfig.load(cfg, weight_rounding="nearest"))
        b = m.weight_bytes()
        rows.append((cfg, b, f"{b / fp16:.3f}", f"{b / w8a8:.3f}"))
    return rows


def _median_time(fn, repeats, warmup=3, sync=None):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        if sync:
            sync()
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def cpu_speed_rows(repeats, I=256, H=512, T=100, B=64):
    """Paired timing: the models take turns call by call (each carries its own h), so a shared
    machine's drift shifts them alike; the median per model is reported. B=1: 20 * repeats T=1
    calls each; B=64 T=100: ``repeats`` calls each."""
    torch.manual_seed(0)
    g = nn.GRU(I, H).eval()
    models = {"float nn.GRU": g}
    backend = _int_backend()
    with qgru.backend(backend):
        q = qgru.quantize_model(g, [torch.randn(20, 8, I) for _ in range(2)], config="w8a8", progress=False)
    models[f"qgru w8a8 ({backend} backend)"] = q
    for cfg in ("w8g128", "w4g128", "w2g64"):
        models[f"weight-only {cfg}"] = WeightOnlyGRU.from_float(
            g, wo.WeightOnlyConfig.load(cfg, weight_rounding="nearest"))
    x1 = torch.randn(1, 1, I)
    xb = torch.randn(T, B, I)
    t1 = {n: [] for n in models}
    tb = {n: [] for n in models}
    hs = {n: None for n in models}
    with qgru.backend(backend), torch.no_grad():
        for it in range(20 * repeats + 5):
            for name, m in models.items():
                a = time.perf_counter()
                _, hs[name] = m(x1, hs[name])
                if it >= 5:  # warm-up
                    t1[name].append(time.perf_counter() - a)
        for it in range(repeats + 1):
            for name, m in models.items():
                a = time.perf_counter()
                m(xb)
                if it >= 1:
                    tb[name].append(time.perf_counter() - a)
        rows = []
        f1, fb = statistics.median(t1["float nn.GRU"]), statistics.median(tb["float nn.GRU"])
        for name, m in models.items():
            a, b = statistics.median(t1[name]), statistics.median(tb[name])
            if isinstance(m, WeightOnlyGRU):
                m(x1)
                p1 = m.last_path
                m(xb)
                name = f"{name} ({p1} / {m.last_path})"
            rows.append((name, f"{a * 1e6:.0f}", f"{f1 / a:.2f}x", f"{b * 1e3:.1f}", f"{fb / b:.2f}x"))
    return rows


GPU_VARIANTS = (("step", False), ("step", True), ("fused", False), ("fused", True))  # (triton_kernel, cuda_graph)


def gpu_speed_rows(repeats, shapes=None):
    """cuDNN fp16 vs weight-only w4g128 float16 through Triton, each recurrent kernel ("step": one
    launch per time step, "fused": one launch per layer direction) called plainly and replayed as
    a CUDA graph, on CUDA; [] without CUDA. Shapes: hidden 512 / 1024 (input = hidden), B 1 / 64,
    T 1000 / 1. A path that fails reports its error in its cells; max diff is the largest
    |w4g128 - cuDNN fp16| over the variants' outputs (the 4-bit weights' error, about 0.1)."""
    if not torch.cuda.is_available():
        return []
    from qgru.weight_only import triton_kernels as wo_triton
    if wo_triton.why_unavailable():
        return [("(skipped)", wo_triton.why_unavailable()) + ("",) * (2 * len(GPU_VARIANTS) + 1)]
    rows = []
    sync = torch.cuda.synchronize
    shapes = shapes or [(H, B, T) for H in (512, 1024) for B in (1, 64) for T in (1000, 1)]
    models = {}
    for H, B, T in shapes:
        if H not in models:
            torch.manual_seed(0)
            g = nn.GRU(H, H).eval()
            m = WeightOnlyGRU.from_float(g, wo.WeightOnlyConfig.load("w4g128", weight_rounding="nearest")).cuda().half()
            models[H] = (g.cuda().half(), m)
        g, m = models[H]
        x = torch.randn(T, B, H, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            tc = _median_time(lambda: g(x), repeats, sync=sync)
            ref = g(x)[0].float()
            cells, diff = [], 0.0
            for kernel, graph in GPU_VARIANTS:
                m.triton_kernel, m.cuda_graph = kernel, graph
                try:
                    tw = _median_time(lambda: m(x), repeats, sync=sync)
                    assert m.last_path == f"triton-{kernel}", m.last_path
                    diff = max(diff, float((m(x)[0].float() - ref).abs().max()))
                    cells += [f"{tw * 1e3:.3f}", f"{tc / tw:.2f}x"]
                except Exception as e:  # noqa: BLE001 - reported in the row, the others still run
                    cells += ["error", f"{type(e).__name__}: {str(e)[:80]}"]
            m.triton_kernel, m.cuda_graph = "auto", False
            m(x)
            rows.append((f"H={H} B={B} T={T}", f"{tc * 1e3:.3f}", *cells, f"{diff:.2f}", m.last_path))
    return rows


GPU_HEADERS = ["shape", "cuDNN fp16 ms", "step ms", "vs cuDNN", "step graph ms", "vs cuDNN", "fused ms", "vs cuDNN",
               "fused graph ms", "vs cuDNN", "max diff", "auto path"]

# fused kernel launch shapes tried by --gpu-sweep (qgru.weight_only.triton_kernels.fused_blocks gives the default)
SWEEP_BLOCKS = ({"BLOCK_H": 256, "BLOCK_K": 32, "num_warps": 8}, {"BLOCK_H": 512, "BLOCK_K": 16, "num_warps": 16},
                {"BLOCK_H": 128, "BLOCK_K": 32, "num_warps": 4}, {"BLOCK_H": 128, "BLOCK_K": 64, "num_warps": 8},
                {"BLOCK_H": 64, "BLOCK_K": 32, "num_warps": 4})


def gpu_sweep_rows(repeats):
    """The fused kernel at B=1 T=1000 (w4g128 float16) for each of SWEEP_BLOCKS, hidden 512 / 1024,
    against cuDNN fp16: which launch shape to make the default."""
    if not torch.cuda.is_available():
        return []
    from qgru.weight_only import triton_kernels as wo_triton
    rows = []
    sync = torch.cuda.synchronize
    for H in (512, 1024):
        torch.manual_seed(0)
        g = nn.GRU(H, H).eval()
        m = WeightOnlyGRU.from_float(g, wo.WeightOnlyConfig.load("w4g128", weight_rounding="nearest")).cuda().half()
        g = g.cuda().half()
        x = torch.randn(1000, 1, H, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            tc = _median_time(lambda: g(x), repeats, sync=sync)
            for blk in SWEEP_BLOCKS:
                run = lambda: wo_triton.gru_forward(m.layers(), x, None, torch.float16, None, "fused", blk)
                try:
                    tw = _median_time(run, repeats, sync=sync)
                    rows.append((f"H={H}", str(blk), f"{tc * 1e3:.3f}", f"{tw * 1e3:.3f}", f"{tc / tw:.2f}x"))
                except Exception as e:  # noqa: BLE001
                    rows.append((f"H={H}", str(blk), f"{tc * 1e3:.3f}", "error", f"{type(e).__name__}: {str(e)[:80]}"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--only-speed", action="store_true", help="the speed tables only")
    ap.add_argument("--only-gpu", action="store_true", help="the GPU speed table only")
    ap.add_argument("--gpu-sweep", action="store_true", help="with --only-gpu: also the fused kernel's launch shapes")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (5 if args.quick else 15)
    warnings.simplefilter("ignore")
    print(f"# weight-only mode, measured {datetime.date.today()} on {cpu_name()} "
          f"({torch.get_num_threads()} threads), torch {torch.__version__}\n")

    if args.only_gpu:
        return gpu_speed(args, repeats)
    if args.only_speed:
        return speed(args, repeats)
    data = demo.load_dataset()
    model, _ = demo.load_checkpoint()
    calib = demo.batches(data["train"][0])
    test = demo.batches(data["test"][0])
    targets = [data["test"][1][i:i + demo.BATCH] for i in range(0, len(data["test"][1]), demo.BATCH)]
    backend = _int_backend()
    print(f"## Accuracy: demo (Japanese Vowels, {sum(len(t) for t in targets)} test sequences; integer configs "
          f"on the {backend} backend)\n")
    print(_table(["model", "output SQNR (dB)", "test accuracy (%)"],
                 _fmt(accuracy_rows(model, calib, test, targets, backend), True)))

    torch.manual_seed(1)
    I, H, T, B = (64, 128, 20, 8) if args.quick else (256, 512, 50, 8)
    syn = nn.GRU(I, H).eval()
    s_calib = [torch.randn(T, B, I) for _ in range(4)]
    s_test = [torch.randn(T, B, I) for _ in range(2)]
    print(f"\n## Accuracy: synthetic (nn.GRU({I}, {H}), default init, randn inputs T={T} B={B})\n")
    print(_table(["model", "output SQNR (dB)"], _fmt(accuracy_rows(syn, s_calib, s_test, None, backend), False)))

    print("\n## Weight bytes, nn.GRU(256, 512) (W and R; biases excluded)\n")
    print(_table(["weights", "bytes", "vs float16", "vs w8a8"], bytes_rows()))

    if args.skip_speed:
        return
    speed(args, repeats)


def speed(args, repeats):
    print(f"\n## CPU speed, nn.GRU(256, 512), {cpu_name()}, {torch.get_num_threads()} threads "
          f"(models in turns call by call, medians; weight-only rows name the path of the B=1 / B=64 calls)\n")
    print(_table(["model", "B=1 streaming, us per T=1 call", "vs float", "B=64 T=100 call, ms", "vs float"],
                 cpu_speed_rows(repeats)))
    gpu_speed(args, repeats)


def gpu_speed(args, repeats):
    rows = gpu_speed_rows(repeats)
    if not rows:
        print("\n## GPU speed: skipped (no CUDA device here)")
        return
    import triton
    print(f"\n## GPU speed, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}: "
          f"cuDNN fp16 vs weight-only w4g128 float16 (medians of {repeats})\n")
    print(_table(GPU_HEADERS, rows))
    if getattr(args, "gpu_sweep", False):
        print("\n## GPU: the fused kernel's launch shapes, w4g128 float16, B=1 T=1000\n")
        print(_table(["hidden", "blocks", "cuDNN fp16 ms", "fused ms", "vs cuDNN"], gpu_sweep_rows(repeats)))

if __name__ == "__main__":
    main()
