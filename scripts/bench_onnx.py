"""ONNX Runtime speed of qgru's exported integer GRU against ORT's own float32 GRU operator on the
same GRU, and qgru's native CPU backend, in one run (BENCHMARKS.md, "ONNX export").

    python scripts/bench_onnx.py [--T 100] [--N 64] [--I 256] [--H 512] [--threads 2] [--config w8a8]

Prints the median of --reps calls of each (the two ORT sessions' calls interleaved, so load on a
shared machine reaches both alike; qgru native in its own loop after them, as its OpenMP threads
keep spinning after a call), then batch-1 streaming (T = 1 calls carrying h, interleaved the same
way) per step, each with the ratio ORT integer / ORT float GRU, and the lscpu model name.
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def float_gru_model(gru: torch.nn.GRU):
    """ONNX GRU operator (linear_before_reset = 1: torch's formula) with gru's float weights."""
    from onnx import TensorProto, helper, numpy_helper
    H = gru.hidden_size

    def reorder(w):  # torch [r | z | n] -> ONNX [z | r | h]
        r, z, n = w.detach().float().numpy().reshape(3, H, -1)
        return np.concatenate([z, r, n]).reshape(3 * H, -1)

    W = reorder(gru.weight_ih_l0)[None]
    R = reorder(gru.weight_hh_l0)[None]
    B = np.concatenate([reorder(gru.bias_ih_l0[:, None])[:, 0], reorder(gru.bias_hh_l0[:, None])[:, 0]])[None]
    inits = [numpy_helper.from_array(W.astype(np.float32), "W"), numpy_helper.from_array(R.astype(np.float32), "R"),
             numpy_helper.from_array(B.astype(np.float32), "B")]
    node = helper.make_node("GRU", ["x", "W", "R", "B", "", "h0"], ["y", "h_n"], hidden_size=H, linear_before_reset=1)
    F = TensorProto.FLOAT
    g = helper.make_graph([node], "float_gru", [helper.make_tensor_value_info("x", F, ["T", "N", gru.input_size]),
                                                helper.make_tensor_value_info("h0", F, [1, "N", H])],
                          [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("h_n", F, None)],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except Exception:
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--I", type=int, default=256)
    ap.add_argument("--H", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", default="w8a8")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--stream-steps", type=int, default=1000)
    a = ap.parse_args(argv)
    import onnxruntime as ort
    import qgru
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    gru = torch.nn.GRU(a.I, a.H)
    m = qgru.QuantGRU.from_float(gru, config=a.config)
    calib = [torch.randn(a.T, a.N, a.I) for _ in range(2)]
    qgru.calibrate(m, calib)
    m.convert()
    x = torch.randn(a.T, a.N, a.I)
    h0 = torch.zeros(1, a.N, a.H)
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    with tempfile.TemporaryDirectory() as d:
        path = qgru.export_onnx(m, (x, h0), Path(d) / "qgru.onnx")
        s_int = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        s_flt = ort.InferenceSession(float_gru_model(gru).SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {"input0": x.numpy(), "input1": h0.numpy()}
    ffeeds = {"x": x.numpy(), "h0": h0.numpy()}
    ref, ref_h = m(x, h0)
    y, yh = s_int.run(None, feeds)
    assert np.array_equal(y, ref.numpy()) and np.array_equal(yh, ref_h.numpy()), "ONNX graph differs from the module"
    # The two ORT sessions alternate call by call; qgru native runs in its own loop afterwards (its
    # OpenMP threads keep spinning after a call and would slow whichever ORT call came next).
    runs = {"ort_int": lambda: s_int.run(None, feeds), "ort_float_gru": lambda: s_flt.run(None, ffeeds),
            "qgru_native": lambda: m(x, h0)}
    times = {k: [] for k in runs}
    with torch.no_grad():
        for group in (("ort_int", "ort_float_gru"), ("qgru_native",)):
            for k in group:
                runs[k]()
            for _ in range(a.reps):
                for k in group:
                    t = time.perf_counter()
                    runs[k]()
                    times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"CPU: {cpu_name()}; onnxruntime {ort.__version__}, torch {torch.__version__}, {a.threads} threads")
    print(f"T={a.T} N={a.N} I={a.I} H={a.H} {a.config}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()))
    print(f"ratio ort_int / ort_float_gru = {med['ort_int'] / med['ort_float_gru']:.3f}")
    # batch-1 streaming: one step per call, h carried; the two ORT sessions alternate call by call
    # (load on a shared machine reaches both alike), qgru native after them; median per call
    x1 = torch.randn(a.stream_steps, 1, 1, a.I)
    st = {k: [] for k in runs}
    h_i = h_f = np.zeros((1, 1, a.H), np.float32)
    h_n = torch.zeros(1, 1, a.H)
    with torch.no_grad():
        for group in (("ort_int", "ort_float_gru"), ("qgru_native",)):
            for i in range(a.stream_steps):
                xi = x1[i]
                for k in group:
                    t = time.perf_counter()
                    if k == "ort_int":
                        _, h_i = s_int.run(None, {"input0": xi.numpy(), "input1": h_i})
                    elif k == "ort_float_gru":
                        _, h_f = s_flt.run(None, {"x": xi.numpy(), "h0": h_f})
                    else:
                        _, h_n = m(xi, h_n)
                    st[k].append(time.perf_counter() - t)
    smed = {k: statistics.median(v[len(v) // 10:]) * 1e6 for k, v in st.items()}  # (the first 10%: warm-up)
    print("batch-1 streaming, per step: " + ", ".join(f"{k} {v:.0f} us" for k, v in smed.items()))
    print(f"ratio ort_int / ort_float_gru (streaming) = {smed['ort_int'] / smed['ort_float_gru']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
