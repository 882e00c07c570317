#!/usr/bin/env python
"""Speed of qgru against float nn.GRU, torch's dynamic-quant GRU and cuDNN: one run, one table per device.

Every model in a scenario is timed on the same input tensor: warm-up calls, then the median of
``--repeats`` calls. The models of a scenario take their repeats in turns (ROUNDS rounds; in each,
every model makes one untimed call, then its share of the timed calls back to back), so that a
shared machine's speed drifting during the run shifts them alike and their ratios hold, while each
model still runs warm, as a model serving a stream of calls does. The
reference backend (a Python loop over time steps at about 1 s per call) is timed on its own, with
min(repeats, 3) repeats. CPU timings use time.perf_counter, GPU timings CUDA events. Every qgru
backend's output (and h_n) is checked bit for bit against the reference backend's on the same input.
A CPU run times a fixed float32 matmul before and after (the steadiness probe) and says in its
notes whether the machine kept one speed (within 25%); a run that did not should be repeated. It
cannot see a machine that was slow from start to end.

Scenarios (issue targets in brackets):
  cpu throughput  T=100 N=64 input 256 hidden 512, --threads 2, w8a8
                  [AMX: >= 2x faster than torch dynamic-quant, >= 6x faster than float nn.GRU;
                   AVX2-only: >= 2x dynamic-quant, >= 3x float]
  cpu streaming   N=1: a T=100 call, and T=1 calls repeated T times carrying h (`out, h = m(x_t, h)`)
                  [every path: T=1 calls >= 1.5x faster than dynamic-quant]
  gpu             hidden = input = 512 and 1024: T=1000 at B=64 and B=1, T=100 at B=256, and 100 calls of
                  T=1 carrying h at B=1 and B=64; cuDNN fp32 and fp16, qgru w8a8 and w8a16; peak memory
                  per call; a compact summary printed last (about a minute and a half on an H200)
                  [w8a8 vs cuDNN fp16: T=1000 B=64 >= 3x, T=1000 B=1 >= 5x, streaming >= 2x,
                   T=100 B=256 H=1024 >= 2x; peak memory <= fp16's; w8a16 within 1.3x of w8a8]

    python scripts/bench.py                        # cpu (+ cuda when available), writes BENCHMARKS.md
    python scripts/bench.py --quick --no-write     # small shapes, few repeats: a smoke test
    python scripts/bench.py --device cuda --configs w8a8,w8a16
    python scripts/bench.py --configs w8a8,w8a8:pow2   # a config in the other scale mode too
    python scripts/bench.py --configs w8a8,w8a8+dynamic   # and with x levels (x.dynamic, h_gemm.dynamic)
    python scripts/bench.py --T 50 --N 32 --hidden 256 --threads 4 --out /tmp/b.md
    python scripts/bench.py --sweep quick             # the CPU sweep, a subset (a few minutes)
    python scripts/bench.py --sweep full --sweep-peers   # every size; OpenVINO / ONNX Runtime rows if installed
    python scripts/bench.py --peers                # I=16 H=64, I=64 H=128 (1 thread), the benchmark call (2):
                                                   # OpenVINO (default, fp32), ONNX Runtime, float, dyn, w8a8, w8a16
    python scripts/bench.py --sweep quick --sweep-rows modes   # every shipped config x scale mode instead

--sweep: H (= I) in 32, 64, 128, 256, 512, 1024 x batch 1, 8, 64 at T=100, 1 and 2 threads
(--sweep-threads), plus streaming (100 single-step calls at batch 1 carrying h); float nn.GRU, torch
dynamic quant, qgru w8a8 (the default: x levels), w8a16 and w8a8 with a static x, timed together at
each point; torch._int_mm's int8 rate (2048^3) measured in the same run, and each w8a8 row's
multiply-adds per second as a fraction of it. `quick`: H 64 and 512 x batch 1 and 64. Written to
BENCHMARKS.md in a section of its own (`sweep-cpu-KIND`). `--sweep-rows modes` times every shipped
config in both scale modes instead (a table with each config's pow2 / multiplier time), `all` both.

The cpu backend is timed once per instruction-set path the CPU runs (rows `cpu:amx`, `cpu:avx2`,
...; `--paths` picks some), so one run shows each path against both peers. A CPU run's notes also
give torch._int_mm's int8 rate on --threads threads and each qgru throughput row's multiply-adds
per second as a share of it (how close the call comes to the CPU's int8 GEMM rate).

BENCHMARKS.md keeps one section per kind of machine (between <!-- bench:KIND:start/end -->
markers, KIND = cpu-amx, cpu-avx512vnni, cpu-avxvnni, cpu-avx2, cpu-portable after the fastest path the CPU
runs, or cuda): a rerun replaces its own kind's section only.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import re
import shlex
import statistics
import sys
import time

import torch

import qgru
from qgru import native
from qgru.config import BUILTIN_CONFIGS
from qgru.native import cpu_model_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accuracy import dynamic_quant_gru  # noqa: E402

REF_REPEATS = 3  # the reference backend's cap on --repeats
ROUNDS = 5  # turns the models of a scenario take at their repeats (timed_together)
STEADY_TOLERANCE = 0.25  # steadiness probe: a larger change between a run's start and end is reported
                         # (ten back-to-back probes spanned 6% on the 2-core AMD EPYC VM, 2026-11-26)
OTHER_DEVICE_BACKEND = {"cpu": "cuda", "cuda": "cpu"}  # backends that never run on the given device
BASELINES = {"cpu": ["float nn.GRU", "torch dynamic-quant"], "cuda": ["cuDNN fp32", "cuDNN fp16"]}
TARGETS = {"cpu": "CPU, 2 threads, T=100 N=64 I=256 H=512, w8a8: >= 2x faster than torch dynamic-quant and "
                  ">= 6x faster than float nn.GRU with AMX, >= 3x float on AVX2-only CPUs (w8a16 within 1.5x "
                  "of w8a8 there); on every path, T=1 N=1 calls >= 1.5x faster than dynamic-quant.",
           "cuda": "GPU, w8a8 against cuDNN fp16: T=1000 B=64 >= 3x, T=1000 B=1 >= 5x, 100 calls "
                   "of T=1 carrying h >= 2x per call, T=100 B=256 H=1024 >= 2x; peak memory per call at most "
                   "fp16's; w8a16 within 1.3x of w8a8."}


def time_once(fn, device: str) -> float:
    """Milliseconds of one fn() call."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    if device == "cpu-thread":  # the calling thread's CPU time (--sweep, one thread: see sweep_point)
        t0 = time.thread_time()
        fn()
        return (time.thread_time() - t0) * 1e3
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def timed_together(fns, device: str, warmup: int, repeats: int):
    """([median ms per call of each fn], [output of each fn's first call]): every fn is warmed up,
    then the repeats are split into up to ROUNDS rounds; in a round each fn in turn makes one
    untimed call (its caches refilled after the others ran) and then its timed calls."""
    outs = [fn() for fn in fns]
    for _ in range(max(warmup - 1, 0)):
        for fn in fns:
            fn()
    rounds = max(1, min(ROUNDS, repeats))
    times = [[] for _ in fns]
    for k in range(rounds):
        n = repeats // rounds + (1 if k < repeats % rounds else 0)
        for t, fn in zip(times, fns):
            fn()
            t.extend(time_once(fn, device) for _ in range(n))
    return [statistics.median(t) for t in times], outs


def in_backend(name: str, fn):
    """fn run with qgru's backend forced to ``name`` (timing happens after the caller's block);
    "cpu:PATH" is the cpu backend on one instruction-set path (QGRU_CPU_ISA=PATH)."""
    backend, _, path = name.partition(":")

    def run():
        before = os.environ.get("QGRU_CPU_ISA")
        if path:
            os.environ["QGRU_CPU_ISA"] = path
        try:
            with qgru.backend(backend):
                return fn()
        finally:
            if path:
                if before is None:
                    os.environ.pop("QGRU_CPU_ISA", None)
                else:
                    os.environ["QGRU_CPU_ISA"] = before
    return run


def full_call(m, x):
    return lambda: m(x)


def step_calls(m, x):
    """T single-step calls carrying h; returns (outputs concatenated over time, h_n)."""
    def run():
        h, outs = None, []
        for t in range(x.shape[0]):
            o, h = m(x[t:t + 1], h)
            outs.append(o)
        return torch.cat(outs), h
    return run


class Bench:
    def __init__(self, args, device: str):
        self.args, self.device, self.rows, self.notes, self.pending = args, device, [], [], []
        if device == "cuda":  # the cuda backend only (qgru.backends() would build the cpu one too)
            why = native.why_unavailable("cuda")
            self.backends = [] if why else ["cuda"]
            if why:
                self.notes.append(f"backend `cuda` unavailable: {why}")
            return
        names = qgru.backends()
        self.backends = []
        for name, info in names.items():
            if name == OTHER_DEVICE_BACKEND[device]:
                continue
            if not info["available"]:
                self.notes.append(f"backend `{name}` unavailable: {info['why']}")
            elif name == "cpu":  # one row per instruction-set path this CPU runs (or --paths)
                for p in cpu_paths(args):
                    self.backends.append(f"cpu:{p}")
            else:
                self.backends.append(name)
        if "reference" in self.backends:  # reference first: it gives the expected outputs
            self.backends.remove("reference")
            self.backends.insert(0, "reference")

    def add(self, scenario, model, backend, call, T, fn, expected=None, reference=False, calls=1):
        """Queue fn (which makes `calls` calls of T steps each) for the next flush(), which times
        the queued models together and reports per call and per step. reference=True times fn now,
        on its own, and returns its output (None if it failed)."""
        row = dict(scenario=scenario, model=model, backend=backend, call=call, ms=None, T=T, calls=calls,
                   fn=fn, expected=expected, exact="ref" if reference else "—")
        self.rows.append(row)
        if not reference:
            self.pending.append(row)
            return None
        self._run([row], warmup=1, repeats=min(self.args.repeats, REF_REPEATS))
        return row.get("out")

    def flush(self):
        """Time the queued models together (timed_together)."""
        rows, self.pending = self.pending, []
        self._run(rows, self.args.warmup, self.args.repeats)

    def _run(self, rows, warmup, repeats):
        ok = []
        with torch.inference_mode():
            for r in rows:  # a failing model is reported and dropped, the others still run
                try:
                    r["fn"]()
                    ok.append(r)
                except Exception as e:  # noqa: BLE001
                    self.notes.append(f"{r['scenario']} / {r['model']} / {r['backend']} / {r['call']}: failed "
                                      f"({type(e).__name__}: {e})")
                    self.rows.remove(r)
            if not ok:
                return
            times, outs = timed_together([r["fn"] for r in ok], self.device, warmup, repeats)
        for r, ms, out in zip(ok, times, outs):
            r["ms"], r["out"] = ms / r["calls"], out
            r["us_step"] = r["ms"] * 1e3 / r["T"]
            if r["expected"] is not None:
                same = torch.equal(out[0], r["expected"][0]) and torch.equal(out[1], r["expected"][1])
                r["exact"] = "yes" if same else "NO"

    def qgru_rows(self, scenario, q, cfg, call, T, make, calls=1):
        expected = None
        for b in self.backends:
            out = self.add(scenario, f"qgru {cfg}", b, call, T, in_backend(b, make(q)), expected,
                           reference=(b == "reference"), calls=calls)
            if b == "reference":
                expected = out


def cpu_paths(args):
    """The cpu backend's paths to time: --paths, else every path this CPU can run (fastest first)."""
    from qgru import native
    usable = [str(i["name"]) for i in native.cpu_paths() if i["usable"]]
    if not args.paths:
        return usable
    wanted = args.paths.split(",")
    bad = [p for p in wanted if p not in usable]
    if bad:
        sys.exit(f"--paths: {', '.join(bad)} cannot run here; usable: {', '.join(usable)}")
    return wanted


def cpu_kind(args) -> str:
    """The CPU kind a cpu section is filed under: the fastest path this CPU runs (amx, avx512vnni, avxvnni,
    avx2, portable), so that each kind of machine keeps its own section in BENCHMARKS.md."""
    from qgru import native
    if not qgru.backends()["cpu"]["available"]:
        return "cpu"
    return "cpu-" + next(str(i["name"]) for i in native.cpu_paths() if i["usable"])


def config_of(name: str) -> qgru.QuantConfig:
    """A --configs entry: a built-in config, or NAME:MODE for it with another scale mode
    (w8a8:pow2: every rescale a shift); a "+dynamic" suffix turns on x.dynamic (the first layer's x
    levels) and h_gemm.dynamic where the config has an h_gemm (w8a8+dynamic, w8a8:pow2+dynamic)."""
    name, plus, _ = name.partition("+dynamic")
    base, _, mode = name.partition(":")
    over = {"scale_mode": mode} if mode else {}
    if plus:
        tensors = {"x": {"dynamic": True}}
        if "h_gemm" in qgru.QuantConfig.load(base).to_dict()["tensors"]:
            tensors["h_gemm"] = {"dynamic": True}
        over["tensors"] = tensors
    return qgru.QuantConfig.load(base, overrides=over or None)


def quantized(gru, calib, configs):
    return {cfg: qgru.quantize_model(gru, calib, config=config_of(cfg), progress=False) for cfg in configs}


def steadiness_probe() -> float:
    """Milliseconds, median of 31: a fixed float32 matmul on one thread, timed at a CPU run's start
    and end. The same figure twice says the machine kept one speed; on a shared VM the host can
    take half the vector throughput for minutes (seen 2026-11-26 on a 2-core EPYC guest: vpaddd
    3.2 -> 1.7 per cycle), which slows every row, the peers' too, but not by the same factor."""
    # one thread, after a pause: the thread pool's workers spin for a while after parallel work
    # and would slow a multi-threaded probe right after a run (measured: 1.35 against 0.8 ms)
    threads = torch.get_num_threads()
    time.sleep(0.5)
    torch.set_num_threads(1)
    try:
        a, b = torch.full((384, 384), 0.5), torch.full((384, 384), 0.25)
        return statistics.median(time_once(lambda: torch.mm(a, b), "cpu") for _ in range(31))
    finally:
        torch.set_num_threads(threads)


def steadiness_note(before: float, after: float) -> str:
    change = after / before - 1
    # it compares the run's end with its start: a host that was slow throughout reads steady too
    # (2026-11-27, the same EPYC: -2% while a vector-add microbenchmark ran at half its quiet rate)
    verdict = ("steady (the same speed at start and end; a machine slow throughout also reads steady)"
               if abs(change) <= STEADY_TOLERANCE else
               "NOT steady: the machine's speed changed during the run; rerun on a quiet machine before comparing")
    return (f"steadiness probe (a 384 x 384 float32 matmul on one thread, median of 31): {before:.3f} ms "
            f"before the runs, {after:.3f} ms after ({change:+.0%}): {verdict}")


def bench_cpu(args, configs) -> Bench:
    torch.set_num_threads(args.threads)
    bench = Bench(args, "cpu")
    probe_before = steadiness_probe()
    T, N, I, H = args.T, args.N, args.input, args.hidden
    torch.manual_seed(args.seed)
    gru = torch.nn.GRU(I, H).eval()
    calib = [torch.randn(T, N, I) for _ in range(args.calib_batches)]
    qs = quantized(gru, calib, configs)
    dq = dynamic_quant_gru(gru)
    if dq is None:
        bench.notes.append("torch dynamic-quant GRU unavailable in this torch: skipped")

    x = torch.randn(T, N, I)
    sc = f"throughput T={T} N={N} I={I} H={H}"
    bench.add(sc, "float nn.GRU", "torch", f"T={T}", T, full_call(gru, x))
    if dq is not None:
        bench.add(sc, "torch dynamic-quant", "torch", f"T={T}", T, full_call(dq, x))
    for cfg, q in qs.items():
        bench.qgru_rows(sc, q, cfg, f"T={T}", T, lambda m: full_call(m, x))
    bench.flush()
    # the call's multiply-adds per second against torch._int_mm's in the same run
    rate = int8_rate(args.threads)
    if rate > 0:
        macs = T * N * 3 * H * (I + H)
        parts = [f"{r['model']} {r['backend']} {macs / (r['ms'] * 1e-3) / rate:.0%}" for r in bench.rows
                 if r["scenario"] == sc and r["model"].startswith("qgru") and r["ms"] and r["backend"] != "reference"]
        bench.notes.append(f"int8 rate: torch._int_mm (2048^3, {args.threads} threads) {rate / 1e12:.3f} T "
                           f"multiply-adds/s; the throughput call's {macs / 1e9:.2f} G multiply-adds at that rate "
                           f"take {macs / rate * 1e3:.1f} ms; each qgru row's share of the rate: " + ", ".join(parts))

    # streaming: batch 1, the same (already calibrated) models; calibration does not depend on N
    xs = torch.randn(T, 1, I)
    sc = f"streaming T={T} N=1 I={I} H={H}"
    for call, Tc, calls, make in ((f"T={T}", T, 1, full_call), (f"T=1 x{T}", 1, T, step_calls)):
        bench.add(sc, "float nn.GRU", "torch", call, Tc, make(gru, xs), calls=calls)
        if dq is not None:
            bench.add(sc, "torch dynamic-quant", "torch", call, Tc, make(dq, xs), calls=calls)
        for cfg, q in qs.items():
            bench.qgru_rows(sc, q, cfg, call, Tc, lambda m, make=make: make(m, xs), calls=calls)
        bench.flush()
    bench.notes.append("streaming reuses the throughput models' calibration; `T=1 xT` rows time T "
                       "single-step calls carrying h (one timed repeat = all T calls) and report the time per call (= per step)")
    bench.notes.append(steadiness_note(probe_before, steadiness_probe()))
    return bench


# the GPU rows: (I = H, T, B, streaming). streaming: T calls of one step carrying h (one
# timed repeat = all T calls; reported per call), else one call of T steps.
CUDA_SCENARIOS = [(512, 1000, 64, False), (512, 1000, 1, False), (512, 100, 256, False), (512, 100, 1, True),
                  (512, 100, 64, True), (1024, 1000, 64, False), (1024, 1000, 1, False), (1024, 100, 256, False),
                  (1024, 100, 1, True), (1024, 100, 64, True)]
CUDA_QUICK = [(64, 20, 4, False), (64, 10, 1, True)]


def peak_mib(fn) -> float:
    """MiB a call allocates at its peak above what was allocated before it (after warm-up: a
    layer's kept plans count as before)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2 ** 20


def layer_counters(q) -> dict:
    """The summed counters of a converted model's CUDA Layers (empty before its first CUDA call)."""
    total = {}
    for key, rows in q._qparams_on.items():
        if key.startswith("cuda"):
            for row in rows:
                for p in row:
                    layer = p.__dict__.get("_native", {}).get(("cuda", key, ""))
                    for k, v in (layer.layer.counters.items() if layer is not None else ()):
                        total[k] = total.get(k, 0) + v
    return total


def bench_cuda(args, configs) -> Bench:
    """The GPU rows: cuDNN fp32 and fp16 and each qgru config (cuda backend) on the same input,
    timed together with CUDA events (median), peak memory per call, and qgru's outputs checked bit
    for bit against one untimed call of the reference backend on the GPU. The qgru models are
    calibrated on the CPU (a short calibration: the rows time speed, not accuracy) and moved."""
    bench = Bench(args, "cuda")
    scenarios = CUDA_QUICK if args.quick else CUDA_SCENARIOS
    for H in sorted({s[0] for s in scenarios}):
        torch.manual_seed(args.seed)
        gru = torch.nn.GRU(H, H).eval()
        calib = [torch.randn(50, 8, H) for _ in range(args.calib_batches)]
        qs = {cfg: q.cuda() for cfg, q in quantized(gru, calib, configs).items()}
        gru = gru.cuda()
        gru16 = copy.deepcopy(gru).half()
        for H_, T, N, streaming in scenarios:
            if H_ != H:
                continue
            x = torch.randn(T, N, H, device="cuda")
            sc = f"H={H} " + (f"{T} calls of T=1 B={N}" if streaming else f"T={T} B={N}")
            call, steps, calls = ("T=1 x%d" % T, 1, T) if streaming else (f"T={T}", T, 1)
            make = step_calls if streaming else full_call
            # peak memory of one call: for streaming rows one step (the first, h0 None)
            one = (lambda m, x: full_call(m, x[:1])) if streaming else full_call
            x16 = x.half()
            peaks = [one(gru, x), one(gru16, x16)]
            bench.add(sc, "float nn.GRU", "cuDNN fp32", call, steps, make(gru, x), calls=calls)
            bench.add(sc, "float nn.GRU", "cuDNN fp16", call, steps, make(gru16, x16), calls=calls)
            for cfg, q in qs.items():
                with torch.inference_mode():
                    expected = in_backend("reference", make(q, x))()
                bench.add(sc, f"qgru {cfg}", "cuda", call, steps, in_backend("cuda", make(q, x)), expected, calls=calls)
                peaks.append(in_backend("cuda", one(q, x)))
            pending = list(bench.pending)
            before = {cfg: layer_counters(q) for cfg, q in qs.items()}
            bench.flush()
            for cfg, q in qs.items():  # which path the timed calls took (qgru_cuda.cpp's counters)
                after = layer_counters(q)
                d = {k: after.get(k, 0) - before[cfg].get(k, 0) for k in after}
                if d.get("persistent_calls", 0) > 0:
                    bench.notes.append(f"{sc} / qgru {cfg}: {d['persistent_calls']} layer calls took the persistent "
                                       "recurrence (QGRU_CUDA_PERSISTENT=1: one launch per window, instead of one GEMM "
                                       "and one cell kernel per step)")
                if d.get("unplanned_runs", 0) > 0:
                    bench.notes.append(f"{sc} / qgru {cfg}: {d['unplanned_runs']} layer runs without a plan (no "
                                       "graph: the plan would pass QGRU_CUDA_PLAN_MAX_BYTES, default a quarter of the free device memory, at least 256 MiB)")
            with torch.inference_mode():
                for r, fn in zip(pending, peaks):
                    if any(r is kept for kept in bench.rows):  # (a row that failed was dropped)
                        r["peak_mib"] = peak_mib(fn)
            del x, x16
        del gru, gru16, qs
        torch.cuda.empty_cache()
    bench.notes.append("peak MiB: torch.cuda.max_memory_allocated() during one call (for `T=1 xN` rows one step) "
                       "above torch.cuda.memory_allocated() before it, after the timed calls (a qgru layer's kept "
                       "plans count as allocated before)")
    bench.notes.append("qgru models calibrated on the CPU (2 batches T=50 B=8) and moved with .cuda(); bit-exact: "
                       "against one call of the reference backend on the GPU")
    return bench


def table(bench: Bench) -> str:
    base_cols = BASELINES[bench.device]
    base = {(r["scenario"], r["call"], r["backend"] if bench.device == "cuda" else r["model"]): r["ms"]
            for r in bench.rows}
    mem = bench.device == "cuda"
    head = ["scenario", "model", "backend", "call", "ms/call", "µs/step"] + [f"x vs {b}" for b in base_cols] + \
        (["peak MiB"] if mem else []) + ["bit-exact"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in bench.rows:
        ratios = []
        for b in base_cols:
            ms = base.get((r["scenario"], r["call"], b))
            ratios.append(f"{ms / r['ms']:.2f}x" if ms else "—")
        peak = [f"{r['peak_mib']:.1f}" if r.get("peak_mib") is not None else "—"] if mem else []
        cells = [r["scenario"], r["model"], r["backend"], r["call"], f"{r['ms']:.3f}", f"{r['us_step']:.1f}"] + ratios + \
            peak + [r["exact"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compact(bench: Bench) -> str:
    """One line per GPU scenario (printed last): ms per call of cuDNN fp32, fp16 and each qgru
    config, the first config's speedup over fp16, w8a16 / w8a8, peak MiB of
    fp16 and the first config, and whether every qgru row was bit-exact."""
    by = {}
    for r in bench.rows:
        by.setdefault(r["scenario"], {})[r["model"] if r["model"].startswith("qgru") else r["backend"]] = r
    qcols = [m for m in dict.fromkeys(r["model"] for r in bench.rows) if m.startswith("qgru")]
    head = ["scenario", "fp32 ms", "fp16 ms"] + [f"{m[5:]} ms" for m in qcols] + \
        ([f"{qcols[0][5:]} vs fp16"] if qcols else []) + (["w8a16/w8a8"] if {"qgru w8a8", "qgru w8a16"} <= set(qcols) else []) + \
        ["MiB fp16", f"MiB {qcols[0][5:]}" if qcols else "MiB", "exact"]
    out = ["  ".join(f"{h:>12}" if i else f"{h:<28}" for i, h in enumerate(head))]
    ms = lambda r: f"{r['ms']:.3f}" if r and r.get("ms") else "—"  # noqa: E731
    mib = lambda r: f"{r['peak_mib']:.1f}" if r and r.get("peak_mib") is not None else "—"  # noqa: E731
    for sc, rs in by.items():
        fp16, q0 = rs.get("cuDNN fp16"), rs.get(qcols[0]) if qcols else None
        cells = [sc, ms(rs.get("cuDNN fp32")), ms(fp16)] + [ms(rs.get(m)) for m in qcols]
        if qcols:
            cells.append(f"{fp16['ms'] / q0['ms']:.2f}x" if fp16 and q0 and fp16.get("ms") and q0.get("ms") else "—")
        if {"qgru w8a8", "qgru w8a16"} <= set(qcols):
            a, b = rs.get("qgru w8a8"), rs.get("qgru w8a16")
            cells.append(f"{b['ms'] / a['ms']:.2f}" if a and b and a.get("ms") and b.get("ms") else "—")
        exact = [rs[m]["exact"] for m in qcols if m in rs]
        cells += [mib(fp16), mib(q0), "yes" if exact and all(e == "yes" for e in exact) else ",".join(exact) or "—"]
        out.append("  ".join(f"{c:>12}" if i else f"{c:<28}" for i, c in enumerate(cells)))
    return "\n".join(out)


def section(bench: Bench, args) -> str:
    d = bench.device
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = f"; GPU {torch.cuda.get_device_name()}" if d == "cuda" else ""
    notes = list(bench.notes)
    notes.append(f"median of {args.repeats} repeats after {args.warmup} warm-up run(s), the models of a scenario "
                 f"taking their repeats in {ROUNDS} turns" + (
                     "" if d == "cuda" else "; the reference backend (golden model, a Python loop over steps) "
                     f"is timed alone: 1 warm-up and min(repeats, {REF_REPEATS}) repeats"))
    notes.append("ratios are speedups (baseline time / row time, > 1 is faster), against the baseline row "
                 "of the same scenario and call; bit-exact compares outputs and h_n with the reference backend")
    notes.append(f"target: {TARGETS[d]}")
    key = d
    if d == "cpu" and qgru.backends()["cpu"]["available"]:
        notes.append(f"qgru cpu backend (auto): {qgru.backends()['cpu']['detail']}")
        notes.append("backend `cpu:PATH` rows: the cpu backend forced onto one instruction-set path "
                     "(QGRU_CPU_ISA=PATH)")
        key = cpu_kind(args)
    title = {"cuda": "GPU"}.get(d, f"CPU ({key[4:]} machine)" if key.startswith("cpu-") else "CPU")
    return "\n".join([
        f"<!-- bench:{key}:start -->",
        f"## {title}",
        "",
        f"- date: {now}",
        f"- machine: {cpu_model_name()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}{gpu}",
        f"- torch {torch.__version__}, qgru {qgru.__version__}, configs {','.join(configs_for(args, d))}",
        f"- command: `{shlex.join(['python', 'scripts/bench.py', *args.argv])}`",
        "",
        table(bench),
        "",
        *[f"- {n}" for n in notes],
        f"<!-- bench:{key}:end -->",
    ])


HEADER = """# qgru benchmarks

Generated by `python scripts/bench.py` (see its docstring); one section per device kind, each
replaced only by a rerun on that kind of device. Times are per call (median) and per time step.
"""


def write(path: str, sections: dict) -> None:
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else HEADER
    for body in sections.values():
        d = re.match(r"<!-- bench:([\w-]+):start -->", body).group(1)
        pat = re.compile(rf"<!-- bench:{d}:start -->.*?<!-- bench:{d}:end -->", re.S)
        if pat.search(text):
            text = pat.sub(lambda _: body, text, count=1)
        else:
            text = text.rstrip("\n") + "\n\n" + body + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def configs_for(args, device: str):
    """--configs, or the device's default (w8a8; w8a8,w8a16 on the GPU)."""
    if args.configs:
        return args.configs.split(",")
    return ["w8a8", "w8a16"] if device == "cuda" else ["w8a8"]


# ---------------------------------------------------------------------------------------------
# --sweep: the grid of GRU sizes on the CPU
# ---------------------------------------------------------------------------------------------
SWEEP_H = {"full": (32, 64, 128, 256, 512, 1024), "quick": (64, 512)}
SWEEP_N = {"full": (1, 8, 64), "quick": (1, 64)}
SWEEP_THREADS = (1, 2)
SWEEP_T = 100
SWEEP_TARGET_MS = 400.0  # each model's timed calls at one point take about this long in all (3..15 repeats)
SWEEP_MODELS = ("float", "dyn", "w8a8", "w8a16", "w8a8 static x")
SWEEP_CONFIGS = {"w8a8": ("w8a8", None), "w8a16": ("w8a16", None),
                 "w8a8 static x": ("w8a8", {"tensors": {"x": {"dynamic": False}}})}
# --sweep-rows: the qgru models timed at each sweep point. "default": SWEEP_CONFIGS; "modes": every
# shipped config (qgru.config.BUILTIN_CONFIGS) in both scale modes, as shipped otherwise, and a table
# of their times with each config's pow2 / multiplier ratio (the pow2 scheme's every rescale is a
# shift: it should never be the slower one); "all": both sets.
SWEEP_MODE_CONFIGS = {f"{c} {m}": (c, {"scale_mode": m}) for c in BUILTIN_CONFIGS for m in ("multiplier", "pow2")}
SWEEP_ROW_SETS = {"default": SWEEP_CONFIGS, "modes": SWEEP_MODE_CONFIGS, "all": {**SWEEP_CONFIGS, **SWEEP_MODE_CONFIGS}}
SWEEP_TARGETS = ("benchmark call (T=100 N=64 I=256 H=512, 2 threads) >= 70% of the int8 rate and >= 2x dynamic "
                 "quant; every point: w8a8 >= 2x dynamic quant and >= 3x float, w8a16 >= 1.5x float and within 1.6x "
                 "of w8a8; x levels (w8a8 against w8a8 static x) <= 3%; streaming T=1 calls >= 3x dynamic quant")


def int8_rate(threads: int, size: int = 2048, repeats: int = 7) -> float:
    """Multiply-adds per second that torch._int_mm reaches on size^3 int8 with ``threads`` threads
    (median of ``repeats``); 0.0 where torch._int_mm does not run on this CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randint(-128, 128, (size, size), dtype=torch.int8)
        b = torch.randint(-128, 128, (size, size), dtype=torch.int8)
        torch._int_mm(a, b)
        clock = "cpu-thread" if threads == 1 else "cpu"  # as sweep_point times one thread
        ms = statistics.median(time_once(lambda: torch._int_mm(a, b), clock) for _ in range(repeats))
        return size ** 3 / (ms * 1e-3)
    except Exception:  # noqa: BLE001 - no int8 GEMM here: the fraction column stays empty
        return 0.0
    finally:
        torch.set_num_threads(before)


def optional_peers(gru, x, fp32: bool = False):
    """{name: callable} for OpenVINO's GRU (default settings: bf16 where the CPU has it; with
    ``fp32`` also "openvino fp32", its f32 precision hint) and ONNX Runtime's float GRU on an export
    of ``gru``, each on torch.get_num_threads() threads and only where its package is installed (an
    optional benchmark extra, never a qgru dependency); and notes on what was skipped or failed.
    Each callable returns the GRU's output as a float32 tensor."""
    peers, notes = {}, []
    threads = torch.get_num_threads()
    try:
        import openvino as ov  # noqa: F401
    except ImportError:
        notes.append("OpenVINO not installed: no OpenVINO rows")
    else:
        try:
            model = ov.convert_model(gru, example_input=(x,))
            hints = {"openvino": {}}
            if fp32:
                hints["openvino fp32"] = {"INFERENCE_PRECISION_HINT": "f32"}
            for name, hint in hints.items():
                compiled = ov.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": threads, **hint})
                peers[name] = (lambda c: lambda: torch.from_numpy(c((x.numpy(),))[0]))(compiled)
        except Exception as e:  # noqa: BLE001
            notes.append(f"OpenVINO GRU failed: {type(e).__name__}: {e}")
    try:
        import onnxruntime as ort
    except ImportError:
        notes.append("ONNX Runtime not installed: no ONNX Runtime rows")
    else:
        try:
            import io
            f = io.BytesIO()
            torch.onnx.export(gru, (x,), f, dynamo=False)
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            sess = ort.InferenceSession(f.getvalue(), opts, providers=["CPUExecutionProvider"])
            name = sess.get_inputs()[0].name
            peers["onnxruntime"] = lambda: torch.from_numpy(sess.run(None, {name: x.numpy()})[0])
        except Exception as e:  # noqa: BLE001
            notes.append(f"ONNX Runtime GRU failed: {type(e).__name__}: {e}")
    return peers, notes


def sweep_models(H: int, I: int, seed: int, rows: str = "default"):
    """float nn.GRU, torch dynamic quant and the qgru configs of SWEEP_ROW_SETS[rows] for one size,
    calibrated on two small random batches (the sweep times speed, not accuracy)."""
    torch.manual_seed(seed)
    gru = torch.nn.GRU(I, H).eval()
    calib = [torch.randn(20, 8, I) for _ in range(2)]
    models = {"float": gru, "dyn": dynamic_quant_gru(gru)}
    for name, (cfg, over) in SWEEP_ROW_SETS[rows].items():
        models[name] = qgru.quantize_model(gru, calib, config=qgru.QuantConfig.load(cfg, overrides=over), progress=False)
    return models


def sweep_point(models: dict, x: torch.Tensor, streaming: bool, extra=None):
    """{model: ms per call} at one point, the models timed together (timed_together): one call of
    x, or (streaming) x.shape[0] single-step calls carrying h, reported per call. Repeats chosen
    so that each model's timed calls take about SWEEP_TARGET_MS."""
    fns = {k: (step_calls if streaming else full_call)(m, x) for k, m in models.items() if m is not None}
    fns.update(extra or {})
    # one thread: every model runs on the calling thread, timed in its CPU time, which a shared
    # machine's other work does not inflate the way it does wall time (descheduled time is not
    # counted); more threads: wall time
    clock = "cpu-thread" if torch.get_num_threads() == 1 and not extra else "cpu"
    with torch.inference_mode():
        first = {k: time_once(f, clock) for k, f in fns.items()}  # (also the warm-up's first call)
        repeats = int(max(3, min(15, SWEEP_TARGET_MS / max(max(first.values()), 1e-3))))
        times, _ = timed_together(list(fns.values()), clock, 2, repeats)
    calls = x.shape[0] if streaming else 1
    return {k: ms / calls for k, ms in zip(fns, times)}


def bench_sweep(args):
    """The CPU sweep: (markdown section, summary lines)."""
    size = args.sweep
    Hs, Ns = SWEEP_H[size], SWEEP_N[size]
    threads = [int(t) for t in args.sweep_threads.split(",")] if args.sweep_threads else list(SWEEP_THREADS)
    probe_before = steadiness_probe()
    rate = {t: int8_rate(t) for t in threads}
    rows, stream_rows, notes = [], [], []
    for H in Hs:
        I = H
        models = sweep_models(H, I, args.seed, args.sweep_rows)
        for t in threads:
            torch.set_num_threads(t)
            for N in Ns:
                x = torch.randn(SWEEP_T, N, I)
                peers, peer_notes = optional_peers(models["float"], x) if args.sweep_peers else ({}, [])
                notes.extend(n for n in peer_notes if n not in notes)
                ms = sweep_point(models, x, False, peers)
                rows.append(dict(H=H, I=I, N=N, threads=t, ms=ms, macs=3 * H * (I + H) * N * SWEEP_T))
                print(f"  sweep H={H} N={N} threads={t}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()),
                      flush=True)
            xs = torch.randn(SWEEP_T, 1, I)
            ms = sweep_point(models, xs, True)
            stream_rows.append(dict(H=H, I=I, N=1, threads=t, ms=ms))
            print(f"  sweep streaming H={H} threads={t}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in ms.items()),
                  flush=True)
    torch.set_num_threads(args.threads)
    notes.append(steadiness_note(probe_before, steadiness_probe()))
    return sweep_section(args, rows, stream_rows, rate, notes)


def run_lines(args, now: str):
    """The date, machine, cpu backend path and command lines of a CPU section."""
    return [f"- date: {now}",
            f"- machine: {cpu_model_name()}, {os.cpu_count()} CPUs; torch {torch.__version__}, qgru {qgru.__version__}",
            f"- qgru cpu backend (auto): {qgru.backends()['cpu']['detail']}" if qgru.backends()["cpu"]["available"]
            else "- qgru cpu backend unavailable",
            f"- command: `{shlex.join(['python', 'scripts/bench.py', *args.argv])}`"]


PEER_SHAPES = ((16, 64, 32, 1), (64, 128, 16, 1), (256, 512, 64, 2))  # (I, H, N, threads), T = 100
PEER_TARGETS = ("1 thread, I=16 H=64 N=32 and I=64 H=128 N=16: w8a8 >= 1.5x OpenVINO's default GRU, w8a16 >= 1.0x; "
                "the benchmark call (I=256 H=512 N=64, 2 threads): w8a8 >= 1.5x OpenVINO and >= 2x dynamic quant")


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.double(), y.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum().clamp(min=1e-30)))


def bench_peers(args):
    """--peers: small GRUs and the benchmark call against OpenVINO (default and fp32) and ONNX
    Runtime as well as float and dynamic quant, all timed together in wall time (the peers run
    their own thread pools) at the thread count of each shape; SQNR of each output against float.
    Returns (markdown section, summary lines)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    names = ["float", "dyn", "openvino", "openvino fp32", "onnxruntime", "w8a8", "w8a16"]
    head = ["I", "H", "N", "thr"] + [f"{k} ms" for k in names] + [f"{k} dB" for k in names[1:]] + \
        ["w8a8 vs OpenVINO", "w8a16 vs OpenVINO", "w8a8 vs dyn"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    summary, notes = [], []
    before = steadiness_probe()
    for I, H, N, thr in PEER_SHAPES:
        torch.manual_seed(args.seed)
        torch.set_num_threads(thr)
        gru = torch.nn.GRU(I, H).eval()
        calib = [torch.randn(args.T, N, I) for _ in range(4)]
        x = torch.randn(args.T, N, I)
        fns = {"float": (lambda: gru(x)[0]), "dyn": (lambda m: lambda: m(x)[0])(dynamic_quant_gru(gru))}
        peers, peer_notes = optional_peers(gru, x, fp32=True)
        notes.extend(n for n in peer_notes if n not in notes)
        fns.update(peers)
        for c in ("w8a8", "w8a16"):
            q = qgru.quantize_model(gru, calib, config=c, progress=False)
            fns[c] = (lambda m: lambda: m(x)[0])(q)
        with torch.inference_mode():
            first = time_once(fns["float"], "cpu")
            repeats = int(max(5, min(args.repeats * 3, 3000 / max(first, 1e-3))))
            times, outs = timed_together(list(fns.values()), "cpu", args.warmup, repeats)
        ms = dict(zip(fns, times))
        out = dict(zip(fns, outs))
        db = {k: _sqnr(out["float"], out[k]) for k in out if k != "float"}
        g = ms.get
        cells = [str(I), str(H), str(N), str(thr)] + [f"{g(k):.3f}" if g(k) else "—" for k in names] + \
            [f"{db[k]:.1f}" if k in db else "—" for k in names[1:]] + \
            [_ratio(g("openvino"), g("w8a8")), _ratio(g("openvino"), g("w8a16")), _ratio(g("dyn"), g("w8a8"))]
        lines.append("| " + " | ".join(cells) + " |")
        summary.append(f"I={I:>3} H={H:>3} N={N:>2} thr={thr}  w8a8/OpenVINO {cells[-3]:>6}  "
                       f"w8a16/OpenVINO {cells[-2]:>6}  w8a8/dyn {cells[-1]:>6}")
        print("  peers " + summary[-1], flush=True)
    torch.set_num_threads(args.threads)
    notes.append(steadiness_note(before, steadiness_probe()))
    key = "peers-" + cpu_kind(args)
    body = "\n".join([
        f"<!-- bench:{key}:start -->",
        f"## CPU peers ({cpu_kind(args)[4:]} machine, `--peers`)",
        "",
        *run_lines(args, now),
        "",
        f"T={args.T}, one call per timing, ms per call (median, wall time, every model timed together on the same "
        "input at the row's thread count); dB: SQNR of the output against float nn.GRU's; ratios are speedups:",
        "",
        *lines,
        "",
        "- openvino: OpenVINO's converted nn.GRU with its default settings (bf16 inference where the CPU has it), "
        "openvino fp32: the f32 precision hint; onnxruntime: torch.onnx.export of the float GRU on ONNX Runtime's "
        "CPU provider; qgru: quantize_model calibrated on 4 random batches of the row's shape",
        f"- targets: {PEER_TARGETS}",
        *[f"- {n}" for n in notes],
        f"<!-- bench:{key}:end -->",
    ])
    return body, summary


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "—"


def sweep_section(args, rows, stream_rows, rate, notes):
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    extra = [k for k in ("openvino", "onnxruntime") if any(k in r["ms"] for r in rows)]
    head = ["H (=I)", "N", "thr", "float ms", "dyn ms", "w8a8 ms", "w8a16 ms", "w8a8 static x ms"] + \
        [f"{k} ms" for k in extra] + ["w8a8 vs dyn", "w8a8 vs float", "w8a16 vs float", "w8a16 / w8a8",
                                     "x levels cost", "w8a8 % int8 rate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    summary = []
    default_rows = args.sweep_rows in ("default", "all")
    for r in rows if default_rows else []:
        m = r["ms"]
        g = lambda k: m.get(k)  # noqa: E731
        frac = (r["macs"] / (g("w8a8") * 1e-3)) / rate[r["threads"]] if rate.get(r["threads"]) else None
        cells = [str(r["H"]), str(r["N"]), str(r["threads"])] + \
            [f"{g(k):.3f}" if g(k) else "—" for k in SWEEP_MODELS + tuple(extra)] + \
            [_ratio(g("dyn"), g("w8a8")), _ratio(g("float"), g("w8a8")), _ratio(g("float"), g("w8a16")),
             f"{g('w8a16') / g('w8a8'):.2f}" if g("w8a16") and g("w8a8") else "—",
             f"{g('w8a8') / g('w8a8 static x') - 1:+.1%}" if g("w8a8 static x") else "—",
             f"{frac:.0%}" if frac else "—"]
        lines.append("| " + " | ".join(cells) + " |")
        summary.append(f"H={r['H']:>4} N={r['N']:>2} thr={r['threads']}  w8a8/dyn {cells[-6]:>6}  w8a8/float "
                       f"{cells[-5]:>6}  w8a16/float {cells[-4]:>6}  xlev {cells[-2]:>6}  int8 {cells[-1]:>4}")
    sh = ["H (=I)", "thr", "float µs", "dyn µs", "w8a8 µs", "w8a16 µs", "w8a8 static x µs", "w8a8 vs dyn",
          "w8a8 vs float", "w8a16 vs float"]
    slines = ["| " + " | ".join(sh) + " |", "|" + "|".join("---:" for _ in sh) + "|"]
    for r in stream_rows if default_rows else []:
        m = r["ms"]
        cells = [str(r["H"]), str(r["threads"])] + [f"{m[k] * 1e3:.1f}" if m.get(k) else "—" for k in SWEEP_MODELS] + \
            [_ratio(m.get("dyn"), m.get("w8a8")), _ratio(m.get("float"), m.get("w8a8")),
             _ratio(m.get("float"), m.get("w8a16"))]
        slines.append("| " + " | ".join(cells) + " |")
        summary.append(f"stream H={r['H']:>4} thr={r['threads']}  w8a8/dyn {cells[-3]:>6}  w8a8/float {cells[-2]:>6}")
    mode_lines = mode_table(rows, stream_rows, summary) if args.sweep_rows in ("modes", "all") else []
    # a row set other than the default keeps a section of its own (sweep-cpu-KIND-modes)
    key = "sweep-" + cpu_kind(args) + ("" if args.sweep_rows == "default" else "-" + args.sweep_rows)
    rate_text = ", ".join(f"{t} thread{'s' if t > 1 else ''} {v / 1e12:.3f} T" for t, v in rate.items())
    body = "\n".join([
        f"<!-- bench:{key}:start -->",
        f"## CPU sweep ({cpu_kind(args)[4:]} machine, `--sweep {args.sweep}"
        f"{'' if args.sweep_rows == 'default' else ' --sweep-rows ' + args.sweep_rows}`)",
        "",
        *run_lines(args, now),
        f"- int8 GEMM rate (torch._int_mm 2048^3, median of 7, this run): {rate_text} multiply-adds/s",
        "",
        *([f"T={SWEEP_T}, input size = hidden size, one call per timing (ms per call, median):",
           "",
           *lines,
           "",
           f"Streaming: {SWEEP_T} single-step calls at batch 1 carrying h (`out, h = m(x_t, h)`), µs per call:",
           "",
           *slines,
           ""] if default_rows else []),
        *mode_lines,
        "- models of a point timed together (interleaved rounds, the same input); 1-thread points in the "
        "calling thread's CPU time (time.thread_time: robust to a shared machine; the 1-thread int8 rate too), "
        "2-thread points in wall time; ratios are speedups "
        "(> 1: faster); `x levels cost`: w8a8 (the default, x levels) against w8a8 with "
        "`overrides={\"tensors\": {\"x\": {\"dynamic\": False}}}`; `w8a8 % int8 rate`: the call's multiply-adds "
        "(3 H (I + H) N T) per second over torch._int_mm's rate at the same thread count",
        "- calibration: 2 random batches T=20 N=8 per size (the sweep times speed); outputs are not compared "
        "here (the tests check every path bit for bit against the golden model)",
        f"- targets: {SWEEP_TARGETS}",
        *[f"- {n}" for n in notes],
        f"<!-- bench:{key}:end -->",
    ])
    return body, summary


def mode_table(rows, stream_rows, summary):
    """--sweep-rows modes: every shipped config in both scale modes at each point (ms per call;
    streaming in µs per call), with each config's pow2 / multiplier time (<= 1: pow2 no slower)."""
    names = list(SWEEP_MODE_CONFIGS)
    head = ["H (=I)", "N", "thr"] + [f"{k} ms" for k in names] + [f"{c} pow2 / mult" for c in BUILTIN_CONFIGS]
    out = [f"Config x scale mode, T={SWEEP_T} (ms per call, median; streaming rows N=1s: {SWEEP_T} single-step "
           "calls, µs per call):", "", "| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for r, streaming in [(r, False) for r in rows] + [(r, True) for r in stream_rows]:
        m, scale = r["ms"], (1e3 if streaming else 1.0)
        ratios = [m[f"{c} pow2"] / m[f"{c} multiplier"] if m.get(f"{c} pow2") and m.get(f"{c} multiplier") else None
                  for c in BUILTIN_CONFIGS]
        cells = [str(r["H"]), f"{r['N']}s" if streaming else str(r["N"]), str(r["threads"])] + \
            [f"{m[k] * scale:.{1 if streaming else 3}f}" if m.get(k) else "—" for k in names] + \
            [f"{x:.2f}" if x else "—" for x in ratios]
        out.append("| " + " | ".join(cells) + " |")
        summary.append(f"{'stream ' if streaming else ''}H={r['H']:>4} N={r['N']:>2} thr={r['threads']}  pow2/mult " +
                       "  ".join(f"{c} {x:.2f}" if x else f"{c} —" for c, x in zip(BUILTIN_CONFIGS, ratios)))
    return out + [""]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default=None,
                    help="default: cpu, plus cuda when available")
    ap.add_argument("--configs", default=None, help="comma-separated built-in configs; NAME:MODE for another "
                    "scale mode (w8a8:pow2); default w8a8 on the CPU, w8a8,w8a16 on the GPU")
    ap.add_argument("--paths", default="", help="cpu backend paths to time, comma-separated (default: every "
                                                 "path this CPU runs: amx, avx512vnni, avxvnni, avx2, portable)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calib-batches", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats (smoke test)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    ap.add_argument("--out", default="BENCHMARKS.md")
    ap.add_argument("--sweep", choices=["quick", "full"], default=None,
                    help="the CPU sweep instead of the scenarios: H (= I) in 32..1024 x batch 1, 8, 64 at "
                         "T=100, 1 and 2 threads, plus streaming; full: every size (~10-20 min on 2 cores), quick: "
                         "H 64 and 512 x batch 1 and 64 (a few minutes)")
    ap.add_argument("--sweep-threads", default="", help="--sweep: thread counts, comma-separated (default 1,2)")
    ap.add_argument("--sweep-rows", choices=sorted(SWEEP_ROW_SETS), default="default",
                    help="--sweep: the qgru rows; default: w8a8, w8a16, w8a8 static x; modes: every shipped config "
                         "in both scale modes (multiplier, pow2) with each config's pow2 / multiplier time; all: both")
    ap.add_argument("--sweep-peers", action="store_true",
                    help="--sweep: also OpenVINO's and ONNX Runtime's GRU where installed (optional extras)")
    ap.add_argument("--peers", action="store_true",
                    help="small GRUs and the benchmark call against OpenVINO and ONNX Runtime (where installed), "
                         "float and dynamic quant, with SQNR (a section of its own)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.quick:
        args.T, args.N, args.input, args.hidden, args.repeats, args.warmup = 10, 4, 32, 64, 3, 1

    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "all": ["cpu", "cuda"],
               None: ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])}[args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")
    configs = (args.configs or "w8a8").split(",")
    for c in configs + configs_for(args, "cuda"):  # a bad name is an error before anything runs
        try:
            config_of(c)
        except (ValueError, TypeError) as e:
            sys.exit(f"--configs {c}: {e}")

    for flag, run in (("peers", bench_peers), ("sweep", bench_sweep)):  # a scenario with a section of its own
        if getattr(args, flag):
            body, summary = run(args)
            print("\n" + body + "\n\nsummary:\n" + "\n".join(summary), flush=True)
            if not args.no_write:
                write(args.out, {flag: body})
                print(f"\nwrote {args.out} ({flag} section)")
            return

    sections, last = {}, ""
    for d in devices:
        t0 = time.perf_counter()
        bench = bench_cpu(args, configs) if d == "cpu" else bench_cuda(args, configs_for(args, d))
        sections[d] = section(bench, args)
        took = f"({d} benchmark took {time.perf_counter() - t0:.0f} s)"
        print("\n" + sections[d] + "\n" + took, flush=True)
        if d == "cuda":
            last = f"\nGPU summary ({torch.cuda.get_device_name()}, ms per call, median; {took[1:-1]}):\n" + compact(bench)
    if not args.no_write:
        write(args.out, sections)
        print(f"\nwrote {args.out} ({', '.join(sections)} section{'s' if len(sections) > 1 else ''})")
    if last:
        print(last, flush=True)


if __name__ == "__main__":
    main()
