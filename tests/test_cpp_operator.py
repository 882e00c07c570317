"""The operator qgru::integer_gru in C++ (csrc/cpu/op_cpu.cpp, in the cpu backend's library
without Python): the same integers as the golden model, and programs that run it without qgru's
Python: a fresh Python process that only loads the library (torch.export.load, aoti_load_package),
and a libtorch-only C++ program (tests/cpp/aoti_runner.cpp, AOTIModelPackageLoader).

The AOTInductor package is compiled once for the module (slow: minutes on 2 cores), in a subprocess
with a timeout, while the C++ program builds beside it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import qgru
from qgru import ops
from qgru.config import QuantConfig

ROOT = Path(__file__).resolve().parent.parent
RUNNER_SRC = ROOT / "tests" / "cpp" / "aoti_runner.cpp"


def _cpu_or_skip():
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")


@pytest.fixture(scope="module")
def library() -> str:
    _cpu_or_skip()
    path = qgru.native.library_path()
    assert path.is_file(), path
    return str(path)


def _converted(cfg: str, mode: str, static: bool, layers: int, bidir: bool, seed: int):
    over = {"scale_mode": mode}
    if static:  # one static x grid (and h_gemm's, where the config has one) instead of x levels
        over["tensors"] = {"x": {"dynamic": False}, **({"h_gemm": {"dynamic": False}} if cfg == "w8a8" else {})}
    torch.manual_seed(seed)
    m = qgru.QuantGRU(5, 16, num_layers=layers, bidirectional=bidir, config=QuantConfig.load(cfg, overrides=over))
    qgru.calibrate(m, [torch.randn(7, 3, 5) for _ in range(3)], progress=False)
    return m.convert()


_CASES = [("w8a8", "multiplier", False, 2, True), ("w8a8", "pow2", True, 1, False),
          ("w8a16", "pow2", False, 2, True), ("w8a16", "multiplier", True, 2, False),
          ("w16a16", "multiplier", False, 1, True), ("w16a16", "pow2", True, 2, True)]


@pytest.mark.parametrize("cfg,mode,static,layers,bidir", _CASES)
def test_cpp_operator_is_the_golden_model(library, cfg, mode, static, layers, bidir):
    """The C++ CPU kernel against the golden model (the reference backend, through the operator's
    Python kernel), with and without lengths, inputs beyond the calibrated range (x levels), h0."""
    assert ops.ensure_operator() == "c++"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("qgru::integer_gru", "CPU")
    m = _converted(cfg, mode, static, layers, bidir, seed=len(cfg) + layers)
    params, spec = m._op_params
    D = 2 if bidir else 1
    x, h0 = torch.randn(6, 3, 5) * 3, torch.randn(layers * D, 3, 16) * 0.5
    for lengths in (None, torch.tensor([6, 2, 4])):
        got = torch.ops.qgru.integer_gru(x, h0, lengths, params, spec)
        with qgru.backend("reference"):
            want = ops._python_kernel(x, h0, lengths, params, spec)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), lengths
    # and the eager module (no lengths), float64 input: outputs in its dtype
    with torch.no_grad():
        want = m(x.double(), h0.double())
    got = torch.ops.qgru.integer_gru(x.double(), h0.double(), None, params, spec)
    assert got[0].dtype == torch.float64 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_cpp_operator_directions_on_their_own_x_grids(library):
    """Each direction of the first layer quantizes x on its own grid: with an ema_step observer the
    backward direction, which sees the sequence reversed, calibrates another one. The C++ refused
    such a model (an exported program of it failed) until the eager module ran its bidirectional
    calls through the same C++ (native.cpu_op_model) and the module tests drew one."""
    over = {"scale_mode": "multiplier", "observer": {"kind": "ema_step", "momentum": 0.5},
            "tensors": {"x": {"dynamic": False}}}
    torch.manual_seed(11)
    m = qgru.QuantGRU(5, 16, num_layers=2, bidirectional=True, config=QuantConfig.load("w8a8", overrides=over))
    qgru.calibrate(m, [torch.randn(7, 3, 5) * torch.linspace(0.2, 3, 7).view(7, 1, 1) for _ in range(3)],
                   progress=False)
    m.convert()
    fwd, bwd = m._qparams[0]
    assert (float(fwd.scale["x"]), int(fwd.zp["x"])) != (float(bwd.scale["x"]), int(bwd.zp["x"]))
    params, spec = m._op_params
    x, h0 = torch.randn(6, 3, 5) * 2, torch.randn(4, 3, 16) * 0.5
    for lengths in (None, torch.tensor([6, 2, 4])):
        got = torch.ops.qgru.integer_gru(x, h0, lengths, params, spec)
        with qgru.backend("reference"):
            want = ops._python_kernel(x, h0, lengths, params, spec)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), lengths


def test_cpp_operator_refuses_what_it_cannot_run(library):
    m = _converted("w8a8", "multiplier", False, 1, False, seed=3)
    params, spec = m._op_params
    x, h0 = torch.randn(4, 2, 5), torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="spec format 1"):
        torch.ops.qgru.integer_gru(x, h0, None, params, spec.replace("qgru.integer_gru 2", "qgru.integer_gru 1", 1))
    with pytest.raises(ValueError, match="spec ends early"):
        torch.ops.qgru.integer_gru(x, h0, None, params, spec.split("\n")[0])
    with pytest.raises(ValueError, match=r"lengths\[1\] = 5 is outside \[1, 4\]"):
        torch.ops.qgru.integer_gru(x, h0, torch.tensor([4, 5]), params, spec)
    with pytest.raises(ValueError, match="contains NaN"):
        torch.ops.qgru.integer_gru(torch.full((4, 2, 5), float("nan")), h0, None, params, spec)
    with pytest.raises(qgru.QGRUInputError, match="sequence length 0"):
        torch.ops.qgru.integer_gru(torch.randn(0, 2, 5), h0, None, params, spec)
    with pytest.raises(RuntimeError, match="no gradient"):
        torch.ops.qgru.integer_gru(x.requires_grad_(), h0, None, params, spec)


_MAKE = r"""
import sys, torch, qgru
from torch.export import Dim
out = sys.argv[1]
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = torch.nn.GRU(3, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(16, 2)
    def forward(self, x):
        o, h = self.gru(x)
        return self.head(o), h
q = qgru.quantize_model(Net().eval(), [torch.randn(4, 6, 3) for _ in range(2)], progress=False)
with torch.no_grad():
    ep = torch.export.export(q, (torch.randn(2, 5, 3),),
                             dynamic_shapes={"x": {0: Dim("B", min=1, max=16), 1: Dim("T", min=1, max=64)}})
torch.export.save(ep, out + "/program.pt2")
torch._inductor.aoti_compile_and_package(ep, package_path=out + "/model.pt2",
                                         inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0"})
# batch and length other than the traced (2, 5), one beyond the calibrated range (x levels)
xs = [torch.randn(1, 1, 3), torch.randn(3, 7, 3), torch.randn(5, 2, 3) * 4]
lines = []
for c, x in enumerate(xs):
    with torch.no_grad():
        eager = q(x)
        with qgru.backend("reference"):  # the golden model
            ys = q(x)
    assert all(torch.equal(a, b) for a, b in zip(eager, ys))
    for name, t in [("x", x)] + [(f"y{i}", y) for i, y in enumerate(ys)]:
        t.contiguous().numpy().tofile(f"{out}/{c}_{name}.bin")
        lines.append(f"{c} {name} float32 {t.dim()} " + " ".join(map(str, t.shape)))
open(out + "/manifest.txt", "w").write("\n".join(lines) + "\n")
print("written")
"""

_FRESH = r"""
import sys, torch
d = sys.argv[2]
try:  # the control: without the library the operator is unknown (what the library supplies)
    torch.export.load(d + "/program.pt2").module()(torch.randn(1, 2, 3))
    print("ran without the library")
except Exception:  # torch.export.load: "an error when deserializing" (its warning names qgru::integer_gru)
    pass
torch.ops.load_library(sys.argv[1])
manifest = [l.split() for l in open(d + "/manifest.txt").read().splitlines()]
def read(c, name):
    row = next(r for r in manifest if r[0] == str(c) and r[1] == name)
    shape = [int(v) for v in row[4:4 + int(row[3])]]
    return torch.from_file(f"{d}/{c}_{name}.bin", size=max(1, torch.Size(shape).numel()), dtype=torch.float32)[
        :torch.Size(shape).numel()].reshape(shape)
program = torch.export.load(d + "/program.pt2").module()
package = torch._inductor.aoti_load_package(d + "/model.pt2")
cases = sorted({int(r[0]) for r in manifest})
bad = 0
for c in cases:
    x, want = read(c, "x"), (read(c, "y0"), read(c, "y1"))
    for name, run in (("export", program), ("aoti", package)):
        got = run(x)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            print("differs", name, c)
            bad += 1
assert "qgru" not in sys.modules, "the process imported qgru"
print("ok", len(cases), "bad", bad)
"""


def _compiler() -> str:
    return shutil.which(os.environ.get("CXX", "c++")) or ""


def _runner_command(out: Path):
    from torch.utils.cpp_extension import include_paths, library_paths
    lib = library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ([_compiler(), "-std=c++17", "-O0", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
            + [a for p in include_paths() for a in ("-isystem", p)]
            + [str(RUNNER_SRC), "-o", str(out), f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10",
               "-ldl"])


@pytest.fixture(scope="module")
def artifacts(library, tmp_path_factory):
    """The saved program, the .pt2 package and the vectors (golden outputs) of a two-layer
    bidirectional QuantGRU with a Linear head, written by a subprocess; and the C++ runner, built
    meanwhile (None, with the reason, where it cannot be built)."""
    out = tmp_path_factory.mktemp("aoti")
    runner = out / "aoti_runner"
    build = None
    why = ""
    if not sys.platform.startswith("linux"):
        why = "the C++ runner is built on Linux only"
    elif not _compiler():
        why = "no C++ compiler (c++ / $CXX) on PATH"
    else:
        build = subprocess.Popen(_runner_command(runner), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        r = subprocess.run([sys.executable, "-c", _MAKE, str(out)], capture_output=True, text=True, timeout=900,
                           cwd=str(ROOT))
        assert r.returncode == 0 and r.stdout.strip().endswith("written"), r.stdout[-2000:] + r.stderr[-4000:]
    finally:
        if build is not None:
            try:
                log, _ = build.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                build.kill()
                log, _ = build.communicate()
            if build.returncode != 0:
                why = "building tests/cpp/aoti_runner.cpp against the torch wheel's libtorch failed: " + log[-1500:]
    return {"dir": out, "runner": runner if not why else None, "why": why, "library": library}


def test_fresh_python_without_qgru_runs_export_and_aoti_bit_exact(artifacts):
    """torch.ops.load_library(<the library>) and nothing of qgru: the saved program and the package
    run, bit-exact with the golden model's outputs (batch and length other than the traced ones);
    before the library is loaded the program cannot run (the control)."""
    r = subprocess.run([sys.executable, "-c", _FRESH, artifacts["library"], str(artifacts["dir"])],
                       capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "ran without" not in r.stdout and r.stdout.strip().splitlines()[-1] == "ok 3 bad 0", r.stdout


def test_cpp_program_runs_the_package_bit_exact(artifacts, tmp_path):
    if artifacts["runner"] is None:
        pytest.skip(artifacts["why"])
    cmd = [str(artifacts["runner"]), artifacts["library"], str(artifacts["dir"] / "model.pt2")]
    r = subprocess.run(cmd + [str(artifacts["dir"])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok 3", r.stdout + r.stderr[-3000:]
    # the check can fail: one expected value changed by one float32 step
    bad = tmp_path / "vectors"
    shutil.copytree(artifacts["dir"], bad)
    y = bad / "2_y1.bin"
    data = bytearray(y.read_bytes())
    data[0] ^= 1
    y.write_bytes(bytes(data))
    r = subprocess.run(cmd + [str(bad)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "case 2 output 1 differs" in r.stdout, r.stdout + r.stderr[-3000:]


_NO_BACKEND = r"""
import warnings, torch, qgru
from qgru import ops
warnings.simplefilter("ignore")  # the fallback's warning (reference backend)
torch.manual_seed(1)
m = qgru.QuantGRU(5, 16, num_layers=2, bidirectional=True)
qgru.calibrate(m, [torch.randn(7, 3, 5) for _ in range(3)], progress=False)
m.convert()
params, spec = m._op_params
x, h0 = torch.randn(6, 2, 5), torch.randn(4, 2, 16)
got = torch.ops.qgru.integer_gru(x, h0, None, params, spec)
with torch.no_grad():
    want = m(x, h0)
print(ops.ensure_operator(), torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
"""


def test_without_the_cpu_backend_the_operator_is_python(tmp_path):
    """Where the cpu backend cannot be built (here: QGRU_NO_BUILD=1 and an empty build folder) the
    operator is defined in Python instead, with the same integers (the reference backend's)."""
    env = dict(os.environ, QGRU_NO_BUILD="1", QGRU_BUILD_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _NO_BACKEND], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "python True", r.stdout
