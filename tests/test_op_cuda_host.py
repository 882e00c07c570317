"""The operator qgru::integer_gru's CUDA kernel in C++ (csrc/op_cuda.cpp), in the parts a machine
without a GPU can check, and on a GPU where one is present.

Without a GPU: the kernel runs its calls through the device-generic layer loop of
csrc/qgru_op_loop.h (run_layers: layer-0 quantization per direction, the reversal within lengths
in ATen calls, the requantization between layers, dequantization) around the backend's quantize,
requantize, dequantize and Layers. The cpu backend runs the same loop on its own kernels
(Model.forward_generic), which must give the CPU operator's integers (itself held to the golden
model by tests/test_cpp_operator.py); and the spec's "cuda" section, from which the kernel makes
its Layers, must hold exactly what native/cuda.py cuda_layer gives the CUDA Layer (prepare_layer
with CUDA_GEMM_MIN). op_cuda.cpp itself is type-checked against torch's CUDA headers by
tests/test_cuda_compile.py.

On a GPU (tests named *cuda*, run by scripts/gpu_check.sh): the C++ kernel is the one registered,
bit-exact with the golden model on CUDA tensors, and a fresh process that loads only the two
libraries runs a saved program of a CUDA model.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import qgru
from qgru import native, ops
from qgru.config import QuantConfig
from qgru.native.prepare import CUDA_GEMM_MIN, prepare_layer


def _cpu_or_skip():
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")


def _converted(cfg: str, mode: str, static: bool, layers: int, bidir: bool, seed: int, I: int = 5, H: int = 16):
    over = {"scale_mode": mode}
    if static:
        over["tensors"] = {"x": {"dynamic": False}, **({"h_gemm": {"dynamic": False}} if cfg == "w8a8" else {})}
    torch.manual_seed(seed)
    m = qgru.QuantGRU(I, H, num_layers=layers, bidirectional=bidir, config=QuantConfig.load(cfg, overrides=over))
    qgru.calibrate(m, [torch.randn(7, 3, I) for _ in range(3)], progress=False)
    return m.convert()


_CASES = [("w8a8", "multiplier", False, 2, True), ("w8a8", "pow2", True, 3, True),
          ("w8a16", "pow2", False, 2, True), ("w8a16", "multiplier", True, 2, False),
          ("w16a16", "multiplier", False, 1, True), ("w16a16", "pow2", True, 2, True),
          ("w8a8", "multiplier", False, 3, False)]


@pytest.mark.parametrize("cfg,mode,static,layers,bidir", _CASES)
def test_generic_layer_loop_gives_the_cpu_operators_integers(cfg, mode, static, layers, bidir):
    """run_layers on the cpu backend's kernels equals the CPU operator: with and without lengths
    (one of them the full length, one of length 1), x beyond the calibrated range (x levels),
    float64 input (outputs in its dtype), h0 nonzero."""
    _cpu_or_skip()
    m = _converted(cfg, mode, static, layers, bidir, seed=len(cfg) + layers)
    params, spec = m._op_params
    model = native.load("cpu").Model(params, spec, "auto")
    D = 2 if bidir else 1
    torch.manual_seed(5)
    for lengths in (None, torch.tensor([6, 1, 4]), torch.tensor([6, 6, 6])):
        for dtype in (torch.float32, torch.float64):
            x = (torch.randn(6, 3, 5) * 3).to(dtype)
            h0 = (torch.randn(layers * D, 3, 16) * 0.5).to(dtype)
            want = model.forward(x, h0, lengths)
            got = model.forward_generic(x, h0, lengths)
            assert got[0].dtype == dtype and got[1].dtype == dtype
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (lengths, dtype)
    # and the golden model itself, once (the reference backend through the Python kernel)
    x, h0 = torch.randn(6, 3, 5) * 3, torch.randn(layers * D, 3, 16) * 0.5
    with qgru.backend("reference"):
        want = ops._python_kernel(x, h0, torch.tensor([2, 6, 5]), params, spec)
    got = model.forward_generic(x, h0, torch.tensor([2, 6, 5]))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_generic_loop_refuses_a_per_channel_requantization():
    """Every QuantParams requantizes between layers per tensor (qgru/export.py); the generic loop
    takes only that (its backends' requantize is per tensor) and refuses a spec that says otherwise,
    where the CPU kernel's own loop runs it."""
    _cpu_or_skip()
    m = _converted("w8a8", "multiplier", False, 2, False, seed=6)
    params, spec = m._op_params
    w = spec.split(" ")
    i = [j for j in range(len(w)) if w[j] == "in" and w[j + 1] == "1"][0]  # layer 1's: "in 1 1 m s"
    assert w[i + 2] == "1"
    w[i + 2:i + 5] = ["16"] + [w[i + 3]] * 16 + [w[i + 4]] * 16  # the same factor for each of H = 16 channels
    wide = " ".join(w)
    model = native.load("cpu").Model(params, wide, "auto")
    x, h0 = torch.randn(5, 2, 5), torch.randn(2, 2, 16)
    want = native.load("cpu").Model(params, spec, "auto").forward(x, h0, torch.tensor([5, 3]))
    got = model.forward(x, h0, torch.tensor([5, 3]))  # the CPU kernel's loop: the same integers
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="per channel"):
        model.forward_generic(x, h0, torch.tensor([5, 3]))


def test_generic_loop_refuses_bad_calls_as_the_operator_does():
    _cpu_or_skip()
    m = _converted("w8a8", "multiplier", False, 1, True, seed=2)
    model = native.load("cpu").Model(*m._op_params, "auto")
    x, h0 = torch.randn(4, 2, 5), torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 5 is outside \[1, 4\]"):
        model.forward_generic(x, h0, torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="hx must be"):
        model.forward_generic(x, torch.zeros(1, 2, 16), None)


@pytest.mark.parametrize("I,H,layers,bidir,cfg", [(5, 16, 2, True, "w8a8"), (40, 33, 2, False, "w8a16"),
                                                  (3, 8, 1, True, "w16a16"), (64, 48, 2, True, "w8a8")])
def test_spec_cuda_section_is_what_the_cuda_layer_is_given(I, H, layers, bidir, cfg):
    """Each unit's CUDA variant, read back by the C++ parser op_cuda.cpp uses (parse_spec and
    variant_args), is prepare_layer(p, gemm_min=CUDA_GEMM_MIN): the same keys, tensors (dtype,
    shape, values) and values; small shapes (padding to CUDA_GEMM_MIN) and larger ones (tensors
    shared with the CPU variants: no extra parameter tensors)."""
    _cpu_or_skip()
    m = _converted(cfg, "multiplier", False, layers, bidir, seed=I + H, I=I, H=H)
    params, spec = m._op_params
    model = native.load("cpu").Model(params, spec, "auto")
    k = 0
    for row in m._qparams:
        for p in row:
            t, v = prepare_layer(p.to("cpu"), gemm_min=CUDA_GEMM_MIN)
            got_t, got_v = model.cuda_tensors(k), model.cuda_values(k)
            assert got_v == v and sorted(got_t) == sorted(t), k
            for key in t:
                assert got_t[key].dtype == t[key].dtype and torch.equal(got_t[key], t[key]), (k, key)
            k += 1
    with pytest.raises(ValueError, match="no CUDA variant"):
        model.cuda_tensors(k)
    if min(I, 3 * H) >= CUDA_GEMM_MIN:  # nothing padded further for CUDA: every tensor shared
        units, cuda = spec.split("\n")[1].split(" cuda ")
        assert set(_indices(cuda)) <= set(_indices(units))


def _indices(words: str):
    w = words.split()
    out, i = [], 0
    while i < len(w):
        if w[i] == "variant":
            nt = int(w[i + 2])
            out += [int(w[i + 4 + 2 * j]) for j in range(nt)]
            i += 3 + 2 * nt
        else:
            i += 1
    return out


def test_spec_without_cuda_section_runs_on_cpu_and_a_bad_one_is_refused():
    """A spec made before the cuda section existed (an older program) still runs on the CPU; a
    cuda section whose count is not one variant per unit, or whose index is out of range, is
    refused before anything is made from it."""
    _cpu_or_skip()
    m = _converted("w8a8", "multiplier", False, 2, True, seed=4)
    params, spec = m._op_params
    head, units, py = spec.split("\n")
    old_units, cuda = units.split(" cuda ")
    old = "\n".join([head, old_units, py])
    x, h0 = torch.randn(5, 2, 5), torch.randn(4, 2, 16)
    want = torch.ops.qgru.integer_gru(x, h0, None, params, spec)
    got = torch.ops.qgru.integer_gru(x, h0, None, params, old)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    model = native.load("cpu").Model(params, old, "auto")
    with pytest.raises(ValueError, match="no CUDA variant"):
        model.cuda_values(0)
    bad = "\n".join([head, old_units + " cuda 3 " + cuda.split(" ", 1)[1], py])
    with pytest.raises(ValueError, match="not one variant per unit"):
        native.load("cpu").Model(params, bad, "auto")
    first = cuda.split()
    i = first.index("variant") + 4  # the first tensor index of the first CUDA variant
    first[i] = str(len(params) + 7)
    with pytest.raises(ValueError, match="is not an integer in"):
        native.load("cpu").Model(params, "\n".join([head, old_units + " cuda " + " ".join(first), py]), "auto")


def test_cuda_library_sources_and_binding_are_split():
    """The cuda backend is built as the cpu one is: a library without Python holding the operator's
    CUDA kernel (every source but the binding) and the binding; nothing in the library's sources
    includes torch/extension.h (Python)."""
    from qgru.native import build
    assert "op_cuda.cpp" in build._SOURCES["cuda"] and build._CUDA_BINDING in build._SOURCES["cuda"]
    def includes(name):
        return [ln.split("//")[0] for ln in (native.csrc_dir() / name).read_text().splitlines() if ln.startswith("#include")]
    for name in [s for s in build._SOURCES["cuda"] if s != build._CUDA_BINDING] + [
            "qgru_cuda_backend.h", "qgru_op_loop.h", "qgru_op_spec.h", "qgru_layer.h"]:
        assert not [ln for ln in includes(name) if "torch/extension.h" in ln or "pybind11" in ln], name
    assert any("torch/extension.h" in ln for ln in includes(build._CUDA_BINDING))
    assert build._library_file(build.build_dir("cuda"), "cuda").name == "qgru_cuda_ops.so"


# ---- on a GPU -------------------------------------------------------------------------------

def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    why = qgru.backends()["cuda"]["why"]
    if why:
        pytest.skip(f"cuda backend unavailable: {why}")


@pytest.mark.parametrize("cfg,mode,static,layers,bidir", _CASES)
def test_cuda_cpp_operator_is_the_golden_model(cfg, mode, static, layers, bidir):
    """On a GPU the operator's CUDA kernel is the C++ one (loaded with the cuda backend), and its
    outputs are the golden model's: with and without lengths, x levels, float64 input."""
    _cuda_or_skip()
    native.load("cuda")
    ops.ensure_operator()
    cuda_row = [r for r in torch._C._dispatch_dump("qgru::integer_gru").splitlines() if r.startswith("CUDA:")]
    assert len(cuda_row) == 1 and "op_cuda.cpp" in cuda_row[0], cuda_row  # the C++ kernel, not ops.py's
    m = _converted(cfg, mode, static, layers, bidir, seed=len(cfg) + layers)
    params, spec = m._op_params
    D = 2 if bidir else 1
    x, h0 = torch.randn(6, 3, 5) * 3, torch.randn(layers * D, 3, 16) * 0.5
    for lengths in (None, torch.tensor([6, 1, 4])):
        for dtype in (torch.float32, torch.float64):
            with qgru.backend("reference"):
                want = ops._python_kernel(x.to(dtype), h0.to(dtype), lengths, params, spec)
            got = torch.ops.qgru.integer_gru(x.to(dtype).cuda(), h0.to(dtype).cuda(), lengths, params, spec)
            assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), (lengths, dtype)
    with pytest.raises(ValueError, match="lengths must be an integer CPU tensor"):
        torch.ops.qgru.integer_gru(x.cuda(), h0.cuda(), torch.tensor([6, 1, 4]).cuda(), params, spec)


_FRESH_CUDA = r"""
import sys, torch
cpu_lib, cuda_lib, path = sys.argv[1:4]
torch.ops.load_library(cpu_lib)
torch.ops.load_library(cuda_lib)
assert torch._C._dispatch_has_kernel_for_dispatch_key("qgru::integer_gru", "CUDA")
program = torch.export.load(path + "/program.pt2").module()
x = torch.load(path + "/x.pt")
want = torch.load(path + "/want.pt")
got = program(x.cuda())
assert "qgru" not in sys.modules, "the process imported qgru"
print("ok", all(torch.equal(g.cpu(), w) for g, w in zip(got, want)))
"""


def test_cuda_fresh_process_runs_an_exported_cuda_model_with_the_libraries_only(tmp_path):
    """torch.export of a two-layer bidirectional model on the GPU, saved; a process that never
    imports qgru loads the cpu and cuda libraries and runs it, bit-exact with the golden model."""
    _cuda_or_skip()
    torch.manual_seed(3)
    m = qgru.QuantGRU(5, 16, num_layers=2, bidirectional=True)
    qgru.calibrate(m, [torch.randn(7, 3, 5) for _ in range(3)], progress=False)
    m.convert()

    class Net(torch.nn.Module):  # (no float head: a GPU Linear need not give the CPU's float bits)
        def __init__(self):
            super().__init__()
            self.gru = m

        def forward(self, x):
            return self.gru(x)

    net = Net().eval()
    x = torch.randn(6, 2, 5) * 3
    with torch.no_grad(), qgru.backend("reference"):
        want = net(x)
    net = net.cuda()
    with torch.no_grad():
        ep = torch.export.export(net, (x.cuda(),))
    torch.export.save(ep, str(tmp_path / "program.pt2"))
    torch.save(x, str(tmp_path / "x.pt"))
    torch.save(tuple(w.contiguous() for w in want), str(tmp_path / "want.pt"))
    r = subprocess.run([sys.executable, "-c", _FRESH_CUDA, str(native.library_path()), str(native.cuda_library_path()),
                        str(tmp_path)], capture_output=True, text=True, timeout=600, cwd="/")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.strip().splitlines()[-1] == "ok True", r.stdout


_MAKE_CUDA_PACKAGE = r"""
import sys, torch, qgru
out = sys.argv[1]
torch.manual_seed(2)
m = qgru.QuantGRU(3, 16, num_layers=2, bidirectional=True)
qgru.calibrate(m, [torch.randn(6, 4, 3) for _ in range(2)], progress=False)
m.convert()
xs = [torch.randn(5, 2, 3), torch.randn(7, 3, 3) * 4]  # the second beyond the calibrated range
lines = []
for c, x in enumerate(xs):
    with torch.no_grad(), qgru.backend("reference"):  # the golden model
        ys = m(x)
    for name, t in [("x", x)] + [(f"y{i}", y) for i, y in enumerate(ys)]:
        t.contiguous().numpy().tofile(f"{out}/{c}_{name}.bin")
        lines.append(f"{c} {name} float32 {t.dim()} " + " ".join(map(str, t.shape)))
open(out + "/manifest.txt", "w").write("\n".join(lines) + "\n")
m = m.cuda()
Dim = torch.export.Dim
with torch.no_grad():
    ep = torch.export.export(m, (xs[0].cuda(),), dynamic_shapes=({0: Dim("T", min=1, max=64), 1: Dim("B", min=1, max=16)},))
torch._inductor.aoti_compile_and_package(ep, package_path=out + "/model.pt2",
                                         inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0"})
print("written")
"""


def test_cuda_cpp_program_runs_a_cuda_package_bit_exact(tmp_path):
    """A libtorch-only C++ program (tests/cpp/aoti_runner.cpp) loads the cpu and cuda libraries and
    an AOTInductor package of a two-layer bidirectional model on the GPU (dynamic length and
    batch), and gets the golden model's outputs, bit for bit. Opt-in (QGRU_TEST_CUDA_AOTI=1): the
    AOTInductor compile takes minutes, beyond scripts/gpu_check.sh's test stage."""
    _cuda_or_skip()
    if os.environ.get("QGRU_TEST_CUDA_AOTI") != "1":
        pytest.skip("an AOTInductor compile of minutes: QGRU_TEST_CUDA_AOTI=1 runs it")
    from test_cpp_operator import _compiler, _runner_command
    if not sys.platform.startswith("linux") or not _compiler():
        pytest.skip("the C++ runner is built on Linux with a C++ compiler")
    runner = tmp_path / "aoti_runner"
    build = subprocess.run(_runner_command(runner), capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    r = subprocess.run([sys.executable, "-c", _MAKE_CUDA_PACKAGE, str(tmp_path)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("written"), r.stdout[-2000:] + r.stderr[-4000:]
    libs = f"{native.library_path()}:{native.cuda_library_path()}"
    r = subprocess.run([str(runner), libs, str(tmp_path / "model.pt2"), str(tmp_path), "cuda"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok 2", r.stdout + r.stderr[-3000:]
