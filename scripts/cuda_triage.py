"""Triage of the CudaStack crash: which native calls that raise on a bad value crash the
process on this machine, each in its own child process (a crash then ends only that case).
First run (H200, 2026-11-28, both extensions built with the image's /opt/gcc): every call whose
error message formats a number crashed (the CUDA quantize and Stack, and the CPU Stack
too), and those whose message holds only text raised cleanly; the native checks now format their
numbers without iostreams (csrc/qgru_check.h), and the second run on that machine raised cleanly in
every case (tests/test_cuda_speed_paths.py, test_cuda_calls_that_raise_do_not_crash).

    python scripts/cuda_triage.py                 # every case; those that crash again with TORCH_SHOW_CPP_STACKTRACES=1
    python scripts/cuda_triage.py --case NAME     # one case in this process (what the children run)

Cases: a plain function that raises (the CUDA quantize with a bad bit width), a constructor that
raises (a CUDA Layer with no tensors; a CUDA Stack with a bad value or a missing row), and the CPU Stack with a bad value (the same template, another extension). Each child
runs under `python -X faulthandler`; the table says whether it raised the expected error (ok), crashed
(the signal) or did something else. For the first case that crashes, a native backtrace is taken
with cuda-gdb (or gdb) when either is installed. Needs a GPU and the cuda backend; prints a table last.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

CASES = ["cuda_quantize_bad_bits", "cpu_stack_bad", "cuda_layer_empty", "cuda_stack_bad",
         "cuda_stack_rows_missing"]


def _stack_inputs(device):
    import torch
    import qgru
    from qgru import native
    torch.manual_seed(17)
    m = qgru.QuantGRU(6, 10, 2, config="w8a8")
    qgru.calibrate(m, [torch.randn(5, 4, 6) for _ in range(2)], progress=False)
    m.convert()
    params = [[p.to(device) for p in row] for row in m._qparams]
    rows = native.stack_values(params)
    levels = native.stack_levels(params)
    return params, rows, levels


def run_case(name: str) -> None:
    """Runs one case here; exits 0 when it raised the expected error, 3 when it did not raise."""
    import torch
    from qgru import native
    expected = (RuntimeError, ValueError)
    ext = native.load("cpu" if name == "cpu_stack_bad" else "cuda")  # unavailable: an error, not a case's outcome
    # the C++ runtimes this process has loaded (two libstdc++ copies would explain a crash that
    # only messages formatting a number show: 2026-11-28, H200 image with /opt/gcc)
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "libstdc++" in line or "libgcc_s" in line})
    print("loaded:", ", ".join(libs), flush=True)
    try:
        if name == "cuda_quantize_bad_bits":
            ext.quantize(torch.zeros(4, device="cuda"), 0.1, 0, 40, "x")
        elif name == "cpu_stack_bad":
            params, rows, levels = _stack_inputs(torch.device("cpu"))
            layers = [native.stacks._cpu_layer(p, "auto").layer for (p,) in params]
            ext.Stack(layers, rows, levels)  # the good values first
            bad = [list(r) for r in rows]
            bad[0][2] += 1
            ext.Stack(layers, bad, levels)
        else:
            if name == "cuda_layer_empty":
                ext.Layer({}, {})
            else:
                params, rows, levels = _stack_inputs(torch.device("cuda:0"))
                layers = [native.stacks._cuda_layer(p, torch.device("cuda:0")).layer for (p,) in params]
                ext.Stack(layers, rows, levels)  # the good values first
                bad = [list(r) for r in rows]
                bad[0][2] += 1
                if name == "cuda_stack_bad":
                    ext.Stack(layers, bad, levels)
                elif name == "cuda_stack_rows_missing":
                    ext.Stack(layers, rows[:1], levels)
                else:
                    raise SystemExit(f"unknown case {name}")
    except expected as e:
        print(f"raised {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        sys.exit(0)
    print("did not raise", flush=True)
    sys.exit(3)


def _outcome(rc: int) -> str:
    if rc == 0:
        return "ok (raised)"
    if rc < 0:
        try:
            return f"CRASH ({signal.Signals(-rc).name})"
        except ValueError:
            return f"CRASH (signal {-rc})"
    return {3: "did not raise"}.get(rc, f"exit {rc}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=CASES)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--no-gdb", action="store_true")
    a = ap.parse_args()
    if a.case:
        run_case(a.case)
        return 0
    rows, crashed = [], []
    for show in ("0", "1"):  # the second round (C++ stack traces on) only for the cases that crashed
        for name in (CASES if show == "0" else list(dict.fromkeys(crashed))):
            env = dict(os.environ, TORCH_SHOW_CPP_STACKTRACES=show)
            t0 = time.time()
            try:
                r = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--case", name], env=env,
                                   capture_output=True, text=True, timeout=a.timeout)
                rc, text = r.returncode, (r.stdout + r.stderr)
            except subprocess.TimeoutExpired as e:
                rc, text = 124, f"timed out after {a.timeout} s: {e.stdout or ''}{e.stderr or ''}"
            out = _outcome(rc) if rc != 124 else "TIMEOUT"
            rows.append((name, show, out, time.time() - t0, text.strip().splitlines()[-1][:110] if text.strip() else ""))
            if rc < 0 or rc == 124:
                crashed.append(name)
                print(f"--- {name} (TORCH_SHOW_CPP_STACKTRACES={show}): {out}; its output:\n{text[-3000:]}", flush=True)
    dbg = shutil.which("gdb") or shutil.which("cuda-gdb")
    if crashed and dbg and not a.no_gdb:
        name = crashed[0]
        print(f"--- native backtrace of {name} ({dbg})", flush=True)
        try:
            r = subprocess.run([dbg, "-batch", "-ex", "run", "-ex", "bt 40", "--args", sys.executable, __file__, "--case",
                                name], capture_output=True, text=True, timeout=240)
            lines = (r.stdout + r.stderr).splitlines()
            start = next((i for i, l in enumerate(lines) if "signal" in l.lower() and "received" in l.lower()), 0)
            print("\n".join(lines[max(0, start - 5):start + 60]), flush=True)
        except subprocess.TimeoutExpired:
            print(f"{dbg} timed out", flush=True)
    print("\n| case | TORCH_SHOW_CPP_STACKTRACES | outcome | s | last line |\n|---|---|---|---:|---|")
    for name, show, out, s, last in rows:
        print(f"| {name} | {show} | {out} | {s:.1f} | {last} |")
    return 1 if crashed or any(not r[2].startswith("ok") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
