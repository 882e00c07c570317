"""The CUDA backend's plans at the GPU benchmark's sequence shapes, measured in one process (a
prepared GPU run: scripts/gpu_check.sh runs it after the benchmark; written without a GPU).

For each shape (H, T, B) of the benchmark's long-sequence rows, a one-layer nn.GRU quantized to
w8a8 (``--configs`` for more) and its cuDNN fp16 copy on the same input:
  * which path the calls took (the Layer's counters: plans, captures, replays, unplanned_runs;
    every shape should replay a graph now, H=1024 T=1000 B=64 included, which had no plan under
    the fixed 256 MiB bound);
  * the W.x window (Layer.window_steps of the plan's steps) against the host model of
    csrc/qgru_cuda_launch.h window_steps (recomputed here), and the windows per call;
  * memory: what the model keeps after its warm-up calls (parameters and plans) and one call's
    peak above that (bench.py peak_mib), against cuDNN fp16's peak for the same call;
  * us per step, qgru and cuDNN fp16 timed together (bench.py timed_together), and their ratio;
  * bit-exactness against the reference backend on the GPU (outputs and h_n).
``--ab`` adds H=1024 T=1000 B=64 without a plan (QGRU_CUDA_PLAN_MAX_BYTES=1: the eager path that
shape took before) in a child process, for the plan's effect in µs/step and memory.

Prints a markdown table; exit status 1 when a row is not bit-exact, ran without a plan where one
was expected, differs from the host window model, or peaks above cuDNN fp16.
"""
from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import full_call, in_backend, layer_counters, peak_mib, quantized, timed_together  # noqa: E402

import qgru  # noqa: E402
from qgru.native.prepare import CUDA_GEMM_MIN, prepare_layer  # noqa: E402

SHAPES = [(512, 1000, 64), (1024, 1000, 64), (512, 1000, 1), (1024, 1000, 1), (512, 100, 256), (1024, 100, 256)]
MiB = 2 ** 20


def plan_steps(T: int) -> int:
    """csrc/qgru_cuda_launch.h plan_steps."""
    if T <= 16:
        return T
    q = 1 << (T.bit_length() - 1 - 3)
    return -(-T // q) * q


def window_steps(row_bytes: int, N: int, T: int) -> int:
    """csrc/qgru_cuda_launch.h window_steps, recomputed: at least what 32 MiB holds, at least 32
    steps within 128 MiB, at most 16384 rows, then the fewest windows at the shortest length."""
    by_bytes = (32 * MiB) // row_bytes // N
    target = min(32, (128 * MiB) // row_bytes // N)
    steps = max(1, min(max(by_bytes, target), 16384 // N))
    steps = min(steps, T)
    windows = -(-T // steps)
    return -(-T // windows)


def plan_mib(p, T: int, N: int, ws_mib: int = 32) -> float:
    """csrc/qgru_cuda_launch.h plan_sizes(...).bytes + the cuBLAS workspace (Hopper's 32 MiB), in MiB:
    what the host model says the newest plan of layer params p keeps (one call of QuantGRU's one-call
    path: lengths kept where the plan is longer than the call)."""
    t, v = prepare_layer(p.to("cpu"), gemm_min=CUDA_GEMM_MIN)
    H, I = p.hidden_size, p.input_size
    wx, rh = t["x_weight_limbs"], t["h_weight_limbs"]
    Px, Ph = t["x_pairs"].shape[0], t["h_pairs"].shape[0]
    Tp = plan_steps(T)
    steps = window_steps(row_bytes(p), N, Tp)
    rows = steps * N
    gemm = lambda r: max(32, -(-r // 16) * 16)  # noqa: E731 (launch.h gemm_rows)
    chunk, N_pad = gemm(rows), gemm(N)
    levels = 4 * Tp * N if v.get("x_levels", 0) > 0 else 0
    b = (2 * Tp * N * max(I, H) + levels + 4 * N * H + (8 * N if Tp != T else 0) + 2 * (chunk * wx.shape[2])
         + 2 * (N_pad * rh.shape[2]) + 4 * (Px * chunk * wx.shape[1] + Ph * N_pad * rh.shape[1] + rows * 3 * H))
    return b / MiB + ws_mib


def row_bytes(p) -> int:
    """A W.x window's bytes per input row (launch.h window_row_bytes) of layer params p."""
    t, v = prepare_layer(p.to("cpu"), gemm_min=CUDA_GEMM_MIN)
    w = t["x_weight_limbs"]
    return 4 * t["x_pairs"].shape[0] * w.shape[1] + 12 * p.hidden_size + 2 * w.shape[2]


def cuda_layers(q):
    """The CUDA Layers of a converted model (after a call on the GPU)."""
    out = []
    for key, rows in q._qparams_on.items():
        if key.startswith("cuda"):
            for row in rows:
                for p in row:
                    layer = p.__dict__.get("_native", {}).get(("cuda", key, ""))
                    if layer is not None:
                        out.append(layer.layer)
    return out


def run(args) -> int:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    configs = args.configs.split(",")
    bad = 0
    print(f"# plans at the benchmark's shapes ({args.tag}; QGRU_CUDA_PLAN_MAX_BYTES="
          f"{os.environ.get('QGRU_CUDA_PLAN_MAX_BYTES', 'unset')}; {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__})")
    print("| tag | H | T | B | config | plan steps | window steps (host model) | windows | plans/captures/replays/"
          "unplanned | plan MiB (host model) | kept MiB | peak MiB per call | fp16 peak MiB | qgru us/step |"
          " fp16 us/step | x vs fp16 | bit-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for H in sorted({s[0] for s in shapes}):
        torch.manual_seed(args.seed)
        gru = torch.nn.GRU(H, H).eval()
        calib = [torch.randn(50, 8, H) for _ in range(2)]
        qs = quantized(gru, calib, configs)
        rb = {cfg: row_bytes(q._qparams[0][0]) for cfg, q in qs.items()}
        gru16 = copy.deepcopy(gru).half().cuda()
        for H_, T, N in shapes:
            if H_ != H:
                continue
            x = torch.randn(T, N, H, device="cuda")
            x16 = x.half()
            fp16_peak = peak_mib(full_call(gru16, x16))
            for cfg, q_cpu in qs.items():
                q = copy.deepcopy(q_cpu).cuda()
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                fn = in_backend("cuda", full_call(q, x))
                with torch.inference_mode():
                    for _ in range(3):  # plan (eager run), capture, replay
                        fn()
                    torch.cuda.synchronize()
                    kept = (torch.cuda.memory_allocated() - before) / MiB
                    peak = peak_mib(fn)
                    (t16, tq), outs = timed_together([full_call(gru16, x16), fn], "cuda", 2, args.repeats)
                    want = in_backend("reference", full_call(q, x))()
                got = outs[1]
                exact = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                layers = cuda_layers(q)
                c = layer_counters(q)
                Tp = plan_steps(T)
                ws = layers[0].window_steps(Tp, N) if layers else -1
                model = window_steps(rb[cfg], N, Tp)
                windows = -(-Tp // ws) if ws > 0 else -1
                counts = f"{c.get('plans', 0)}/{c.get('captures', 0)}/{c.get('replays', 0)}/{c.get('unplanned_runs', 0)}"
                plan_got = c.get("plan_bytes", -1) / MiB
                ws_mib = 32 if torch.cuda.get_device_capability()[0] >= 9 else 4  # qgru_cuda.cpp cublas_workspace_bytes
                plan_model = plan_mib(q_cpu._qparams[0][0], T, N, ws_mib)
                print(f"| {args.tag} | {H} | {T} | {N} | {cfg} | {Tp} | {ws} ({model}) | {windows} | {counts} | "
                      f"{plan_got:.1f} ({plan_model:.1f}) | {kept:.1f} | {peak:.1f} | {fp16_peak:.1f} | "
                      f"{1e3 * tq / T:.2f} | {1e3 * t16 / T:.2f} | {t16 / tq:.2f}x | {'yes' if exact else 'NO'} |",
                      flush=True)
                problems = []
                if not exact:
                    problems.append("not bit-exact")
                if args.expect_unplanned:  # the A/B's other arm: the eager path, no plan
                    if c.get("unplanned_runs", 0) < 1:
                        problems.append("a plan was made (QGRU_CUDA_PLAN_MAX_BYTES=1 should refuse it)")
                else:
                    if c.get("unplanned_runs", 0) > 0 or c.get("replays", 0) < 1:
                        problems.append("no graph replay")
                    if peak > fp16_peak:
                        problems.append(f"peak {peak:.1f} MiB over fp16's {fp16_peak:.1f}")
                if ws != model:
                    problems.append(f"window {ws} steps, host model {model}")
                if not args.expect_unplanned and abs(plan_got - plan_model) > 0.01:
                    problems.append(f"plan {plan_got:.2f} MiB, host model {plan_model:.2f}")
                if problems:
                    print(f"  {args.tag} H={H} T={T} B={N} {cfg}: " + "; ".join(problems), flush=True)
                    bad = 1
                del q, fn, outs, got, want
                torch.cuda.empty_cache()
            del x, x16
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help="HxTxB,... (default: the six sequence rows)")
    ap.add_argument("--configs", default="w8a8")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="plan")
    ap.add_argument("--ab", action="store_true", help="also H=1024 T=1000 B=64 without a plan, in a child process")
    ap.add_argument("--expect-unplanned", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_plan_check: no CUDA device")
        return 2
    bad = run(args)
    if args.ab:
        env = dict(os.environ, QGRU_CUDA_PLAN_MAX_BYTES="1")
        r = subprocess.run([sys.executable, __file__, "--shapes", "1024x1000x64", "--configs", args.configs,
                            "--repeats", str(args.repeats), "--tag", "no-plan", "--expect-unplanned"], env=env)
        bad |= r.returncode != 0
    return bad


if __name__ == "__main__":
    sys.exit(main())
