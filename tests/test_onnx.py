"""qgru.export_onnx: the exported integer GRU under ONNX Runtime equals the module bit for bit.

Every test needs the optional packages onnx and onnxruntime (setup.cfg extras "onnx" and "test")
and skips without them. References are independent of the graph: the module on the reference
backend (golden.py, int64) and on the default backend, and primitives.rounding_mul_shift for the
rescale forms. docs/onnx.md says what is proven where.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import qgru  # noqa: E402
from qgru.onnx_graph import OPSET, Form, Graph, ONNXExportError, apply_rescale  # noqa: E402
from qgru.primitives import rounding_mul_shift  # noqa: E402

CONFIGS = ("w8a8", "w8a16", "w16a16")
MODES = ("multiplier", "pow2")


def _session(path_or_model):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    src = path_or_model if isinstance(path_or_model, str) else path_or_model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def _quant_gru(config, mode, I, H, layers, bidirectional, batch_first=False, seed=0, bias=True):
    torch.manual_seed(seed)
    overrides = {"scale_mode": mode}
    if config.endswith("-static"):  # one static x grid (no x levels)
        config = config[:-len("-static")]
        overrides["tensors"] = {"x": {"dynamic": False}}
    cfg = qgru.QuantConfig.load(config, overrides=overrides)
    m = qgru.QuantGRU(I, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first, config=cfg,
                      bias=bias)
    shape = (3, 9, I) if batch_first else (9, 3, I)
    qgru.calibrate(m, [torch.randn(*shape), torch.randn(*shape) * 0.5])
    return m.convert().eval()


def _inputs(m, T, N, scale, seed, unbatched=False):
    g = torch.Generator().manual_seed(seed)
    D = 2 if m.bidirectional else 1
    if unbatched:
        x = torch.randn(T, m.input_size, generator=g) * scale
        h0 = torch.randn(m.num_layers * D, m.hidden_size, generator=g)
        return x, h0
    shape = (N, T, m.input_size) if m.batch_first else (T, N, m.input_size)
    x = torch.randn(*shape, generator=g) * scale
    x[..., 0, :] *= 4  # tokens far beyond calibration (x levels, saturation)
    h0 = torch.randn(m.num_layers * D, N, m.hidden_size, generator=g) * 1.5  # beyond [-1, 1]: saturates
    return x, h0


def _assert_exact(sess, m, feeds, x, h0):
    got = sess.run(None, feeds)
    with torch.no_grad():
        want = m(x, h0)
        with qgru.backend("reference"):  # the golden model, int64
            gold = m(x, h0)
    for a, w, gd in zip(got, want, gold):
        assert a.dtype == np.float32
        assert np.array_equal(a, w.numpy()), f"differs from the module: max {np.abs(a - w.numpy()).max()}"
        assert np.array_equal(a, gd.numpy()), "differs from the golden model"


# ---------------------------------------------------------------------------------------------
# every shipped config, both scale modes, 1-3 layers, both directions, h0 given or not
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layers,bidirectional", [(1, False), (2, True), (3, False)])
def test_bit_exact_every_config(tmp_path, config, mode, layers, bidirectional):
    m = _quant_gru(config, mode, 7, 10, layers, bidirectional)
    x, h0 = _inputs(m, 9, 3, 1.0, seed=1)
    path = qgru.export_onnx(m, (x, h0), tmp_path / "m.onnx")
    sess = _session(str(path))
    # other sequence lengths and batch sizes than the example's (dynamic axes), inputs beyond calibration
    for T, N, scale, seed in ((9, 3, 1.0, 2), (1, 1, 3.0, 3), (17, 5, 10.0, 4), (4, 2, 0.01, 5)):
        x, h0 = _inputs(m, T, N, scale, seed)
        _assert_exact(sess, m, {"input0": x.numpy(), "input1": h0.numpy()}, x, h0)


def test_float64_input(tmp_path):
    """A model traced with float64 input returns float64, the module's values (float32 cast up)."""
    m = _quant_gru("w8a16", "multiplier", 5, 6, 1, True)
    x, h0 = _inputs(m, 6, 2, 1.0, seed=3)
    x, h0 = x.double(), h0.double()
    sess = _session(str(qgru.export_onnx(m, (x, h0), tmp_path / "f64in.onnx")))
    got = sess.run(None, {"input0": x.numpy(), "input1": h0.numpy()})
    want = m(x, h0)
    for a, w in zip(got, want):
        assert a.dtype == np.float64 and np.array_equal(a, w.numpy())


def test_integer_gemms_never_saturate(tmp_path):
    """Every MatMulInteger multiplies uint8 [a, a] (zero point 128) by int8 weights of magnitude <= 64
    (no weight zero point): ONNX Runtime's uint8 x int8 kernel on x86 CPUs without VNNI sums pairs of
    products in int16, which 2 x 255 x 64 cannot overflow (255 x 127 x 2 can). The two halves of each
    weight matrix add up to one gate's rows of the module's W or R, exactly."""
    from onnx import numpy_helper
    m = _quant_gru("w8a8", "multiplier", 7, 10, 2, True)
    x, h0 = _inputs(m, 6, 3, 2.0, seed=1)
    model = onnx.load(str(qgru.export_onnx(m, (x, h0), tmp_path / "u8.onnx")))
    nodes = list(model.graph.node) + [n for scan in model.graph.node if scan.op_type == "Scan"
                                      for a in scan.attribute for n in a.g.node]
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    made_by = {o: n for n in nodes for o in n.output}
    mm = [n for n in nodes if n.op_type == "MatMulInteger"]
    assert mm, "w8a8 exports its 8-bit GEMMs as MatMulInteger"
    weights = []
    for n in mm:
        assert len(n.input) == 3, n.input  # no zero point for the weights
        b, azp = consts[n.input[1]], consts[n.input[2]]
        assert b.dtype == np.int8 and azp.dtype == np.uint8 and int(azp) == 128
        assert np.abs(b.astype(np.int64)).max() <= 64
        cat = made_by[n.input[0]]
        assert cat.op_type == "Concat" and cat.input[0] == cat.input[1]  # [a, a]
        K = b.shape[0] // 2
        weights.append(b[:K].astype(np.int64) + b[K:].astype(np.int64))
    assert any(np.abs(w).max() > 64 for w in weights)  # (the split mattered)
    H = m.hidden_size
    for full in (m._qparams[0][0].W, m._qparams[0][0].R):  # layer 0, forward: each gate's W.x and R.h
        full = full.numpy().astype(np.int64)
        for q in range(3):
            assert any(np.array_equal(w, full[q * H:(q + 1) * H].T) for w in weights)


def test_export_under_a_meta_default_device(tmp_path):
    """A caller's torch.set_default_device("meta") changes nothing: the same file, the same integers
    (torch's exporter makes shape constants on the default device; export_onnx keeps them on the CPU)."""
    m = _quant_gru("w8a8", "multiplier", 5, 6, 2, False)
    x, h0 = _inputs(m, 6, 2, 1.0, seed=4)
    want = qgru.export_onnx(m, (x, h0), tmp_path / "plain.onnx").read_bytes()
    torch.set_default_device("meta")
    try:
        path = qgru.export_onnx(m, (x, h0), tmp_path / "meta.onnx")
    finally:
        torch.set_default_device(None)
    assert path.read_bytes() == want
    _assert_exact(_session(str(path)), m, {"input0": x.numpy(), "input1": h0.numpy()}, x, h0)


def test_float64_gemms(tmp_path):
    """integer_gemm=False: every GEMM a float64 MatMul (no MatMulInteger), the same integers."""
    m = _quant_gru("w8a8", "multiplier", 7, 10, 2, True)
    x, h0 = _inputs(m, 6, 3, 2.0, seed=1)
    path = qgru.export_onnx(m, (x, h0), tmp_path / "f64.onnx", integer_gemm=False)
    model = onnx.load(str(path))
    ops = {n.op_type for n in model.graph.node} | {n.op_type for n in model.graph.node if n.op_type == "Scan"
                                                   for a in n.attribute for n in a.g.node}
    assert "MatMulInteger" not in ops and "MatMul" in ops
    _assert_exact(_session(str(path)), m, {"input0": x.numpy(), "input1": h0.numpy()}, x, h0)


@pytest.mark.parametrize("config", CONFIGS)
def test_h0_missing_batch_first_unbatched(tmp_path, config):
    m = _quant_gru(config, "multiplier", 6, 8, 2, True, batch_first=True)
    x, _ = _inputs(m, 7, 3, 1.0, seed=1)
    sess = _session(str(qgru.export_onnx(m, (x,), tmp_path / "bf.onnx")))
    for T, N in ((7, 3), (2, 6)):
        x, _ = _inputs(m, T, N, 2.0, seed=T)
        got = sess.run(None, {"input0": x.numpy()})
        want = m(x)
        for a, w in zip(got, want):
            assert np.array_equal(a, w.numpy())
    # unbatched input: [T, I] and h0 [L*D, H]
    xu, hu = _inputs(m, 5, 1, 1.0, seed=9, unbatched=True)
    sess = _session(str(qgru.export_onnx(m, (xu, hu), tmp_path / "unbatched.onnx")))
    for T in (5, 11):
        xu, hu = _inputs(m, T, 1, 3.0, seed=T, unbatched=True)
        _assert_exact(sess, m, {"input0": xu.numpy(), "input1": hu.numpy()}, xu, hu)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=st.sampled_from(CONFIGS + ("w8a8-static",)), mode=st.sampled_from(MODES), I=st.integers(1, 12),
       H=st.integers(1, 12), layers=st.integers(1, 3), bidirectional=st.booleans(), bias=st.booleans(),
       seed=st.integers(0, 2 ** 16), T=st.integers(1, 12), N=st.integers(1, 4),
       scale=st.sampled_from([0.1, 1.0, 5.0, 30.0]))
def test_random_models_bit_exact(tmp_path, config, mode, I, H, layers, bidirectional, bias, seed, T, N, scale):
    m = _quant_gru(config, mode, I, H, layers, bidirectional, seed=seed, bias=bias)
    x, h0 = _inputs(m, 5, 2, 1.0, seed=seed)
    sess = _session(qgru.export_onnx(m, (x, h0), tmp_path / "r.onnx").as_posix())
    x, h0 = _inputs(m, T, N, scale, seed=seed + 1)
    _assert_exact(sess, m, {"input0": x.numpy(), "input1": h0.numpy()}, x, h0)


# ---------------------------------------------------------------------------------------------
# a whole model: other layers exported as torch exports them, the GRU's outputs exact
# ---------------------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 8)
        self.gru = qgru.QuantGRU(8, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        y, h = self.gru(torch.relu(self.proj(x)))
        return self.head(y[:, -1]), y, h


def test_whole_model(tmp_path):
    torch.manual_seed(0)
    net = _Net().eval()
    qgru.calibrate(net, [torch.randn(4, 10, 5) for _ in range(2)])
    net.gru.convert()
    x = torch.randn(4, 10, 5)
    path = qgru.export_onnx(net, (x,), tmp_path / "net.onnx", input_names=["x"], output_names=["logits", "y", "h"])
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", OPSET)]
    ops = {n.op_type for n in model.graph.node}
    assert {"MatMulInteger", "Scan", "Gemm"} <= ops or {"MatMulInteger", "Scan", "MatMul"} <= ops
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["qgru_version"] == qgru.__version__
    grus = json.loads(meta["qgru_grus"])
    assert grus[0]["module"] == "gru" and grus[0]["meta"]["config"]["name"] == "w8a8"
    sess = _session(str(path))
    for B, T in ((4, 10), (1, 3), (6, 21)):
        x = torch.randn(B, T, 5) * 2
        logits, y, h = sess.run(None, {"x": x.numpy()})
        with torch.no_grad():
            rl, ry, rh = net(x)
        assert np.array_equal(y, ry.numpy()) and np.array_equal(h, rh.numpy())
        np.testing.assert_allclose(logits, rl.numpy(), rtol=1e-5, atol=1e-6)  # ORT's float Gemm


def test_module_called_twice(tmp_path):
    m = _quant_gru("w8a8", "multiplier", 6, 5, 1, False)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = m

        def forward(self, x):
            y, h = self.gru(x)
            return self.gru(x * 0.5, h)

    net = Twice().eval()
    x = torch.randn(4, 2, 6)
    with pytest.raises(ONNXExportError, match="gru is called more than once in one forward"):
        qgru.export_onnx(net, (x,), tmp_path / "twice.onnx")
    assert torch.equal(net(x)[0], net(x)[0])  # the module itself is unchanged


# ---------------------------------------------------------------------------------------------
# the exact rescale forms, against primitives.rounding_mul_shift, at the ends of their bounds
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_rescale_forms_exact(seed):
    rng = np.random.default_rng(seed)
    C = 16
    vbits = int(rng.integers(8, 40))
    vmax = (1 << vbits) - 1
    mbits = int(min(31, 62 - vbits))
    m = rng.integers(1 << (mbits - 1), 1 << mbits, C)
    if seed % 3 == 0:
        m[:] = 1 << (mbits - 1)  # pow2 mode's multipliers
    # shifts as the spec makes them: results (before saturation) up to 2^30, or rounding to 0
    s = rng.integers(max(1, vbits + mbits - 30), min(62, mbits + vbits + 2) + 1, C)
    f = Form(m, s, vmax)
    assert f.kind in ("f1", "f2")
    v = np.concatenate([rng.integers(-vmax, vmax + 1, (200, C)), np.full((1, C), vmax), np.full((1, C), -vmax),
                        np.zeros((1, C), np.int64), np.ones((1, C), np.int64)]).astype(np.int64)
    off = rng.integers(-1000, 1000, C)
    g = Graph("t_")
    y = apply_rescale(g, "v", f)
    y2 = apply_rescale(g, "v", f, add_const=off.astype(np.float64), add_bound=1000)
    D = onnx.TensorProto.DOUBLE
    graph = onnx.helper.make_graph(g.nodes, "t", [onnx.helper.make_tensor_value_info("v", D, None)],
                                   [onnx.helper.make_tensor_value_info(y, D, None),
                                    onnx.helper.make_tensor_value_info(y2, D, None)], g.inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)])
    got, got2 = _session(model).run(None, {"v": v.astype(np.float64)})
    want = rounding_mul_shift(torch.from_numpy(v), torch.from_numpy(m), torch.from_numpy(s)).numpy()
    assert np.array_equal(got, want.astype(np.float64))
    assert np.array_equal(got2, (want + off).astype(np.float64))


def _run_rescales(v, outs_of):
    g = Graph("t_")
    outs = outs_of(g)
    D = onnx.TensorProto.DOUBLE
    graph = onnx.helper.make_graph(g.nodes, "t", [onnx.helper.make_tensor_value_info("v", D, None)],
                                   [onnx.helper.make_tensor_value_info(y, D, None) for y in outs], g.inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)])
    return [n.op_type for n in g.nodes], _session(model).run(None, {"v": v.astype(np.float64)})


def _edge_values(vmax, m, s):
    """+-vmax and its neighbours, 0, +-1, and every round-half-up tie v m = 2^(s-1) (mod 2^s) near
    +-vmax and 0 with its neighbours (m odd)."""
    mod = 1 << s
    v0 = ((1 << (s - 1)) * pow(int(m), -1, mod)) % mod  # v0 m = 2^(s-1) (mod 2^s)
    ties = []
    for base in (0, vmax - mod, -vmax):
        t = base + ((v0 - base) % mod)
        ties += [t - 1, t, t + 1, t + mod, -t]
    vals = [vmax, vmax - 1, -vmax, -vmax + 1, 0, 1, -1] + ties
    return np.array(sorted({v for v in vals if -vmax <= v <= vmax}), np.int64)


@pytest.mark.parametrize("s", [1, 2, 7, 20, 33, 46, 52])
def test_rescale_round_to_nearest_at_its_bound(s):
    """The last floor taken as RNE(t) = (t + 3 2^51) - 3 2^51 (Form.rne_ok): exact at the largest
    operand the bound admits, on every tie of round half up and its neighbours, with and without
    a folded add; one past the bound the form keeps the Floor (and stays exact)."""
    rng = np.random.default_rng(s)
    for mbits in (1, 15, 31):
        m = int(rng.integers(1 << (mbits - 1), 1 << mbits)) | 1  # odd: no factor of two to normalize
        add = 977
        vmax = ((1 << 53) - 1 - 2 * add * (1 << s)) // (2 * m)  # 2 (vmax m + add 2^s) + 1 <= 2^53
        f = Form(np.array([m]), np.array([s]), vmax)
        assert f.kind == "f1" and f.rne_ok(add) and not Form(np.array([m]), np.array([s]), vmax + 1).rne_ok(add)
        v = _edge_values(vmax, m, s)[:, None]
        ops, (got, got_add) = _run_rescales(v, lambda g: [
            apply_rescale(g, "v", f), apply_rescale(g, "v", f, add_const=float(add), add_bound=add)])
        assert "Floor" not in ops
        want = rounding_mul_shift(torch.from_numpy(v), torch.tensor([m]), torch.tensor([s])).numpy()
        assert np.array_equal(got, want.astype(np.float64))
        assert np.array_equal(got_add, (want + add).astype(np.float64))
        # one past the bound: the Floor form, still exact
        big = Form(np.array([m]), np.array([s]), vmax + 1)
        vb = np.concatenate([v, [[vmax + 1], [-vmax - 1]]])
        ops, (got,) = _run_rescales(vb, lambda g: [apply_rescale(g, "v", big, add_const=float(add), add_bound=add)])
        want = rounding_mul_shift(torch.from_numpy(vb), torch.tensor([m]), torch.tensor([s])).numpy()
        assert np.array_equal(got, (want + add).astype(np.float64))


@pytest.mark.parametrize("seed", range(4))
def test_rescale_f2_round_to_nearest(seed):
    """The f2 form's outer floor as RNE: 32-bit operands times 31-bit multipliers (the rRh_g and zg
    rescales' sizes), at +-vmax, the ties and around them."""
    rng = np.random.default_rng(100 + seed)
    vmax = (1 << 32) - 1
    m = int(rng.integers(1 << 30, 1 << 31)) | 1
    s = int(rng.integers(40, 50))
    f = Form(np.array([m]), np.array([s]), vmax)
    assert f.kind == "f2" and f.rne_ok(1 << 17)
    v = _edge_values(vmax, m, s)[:, None]
    add = int(rng.integers(-(1 << 17), 1 << 17))
    ops, (got, got_add) = _run_rescales(v, lambda g: [apply_rescale(g, "v", f),
                                                      apply_rescale(g, "v", f, add_const=float(add), add_bound=1 << 17)])
    assert ops.count("Floor") == 2  # the inner floors only
    want = rounding_mul_shift(torch.from_numpy(v), torch.tensor([m]), torch.tensor([s])).numpy()
    assert np.array_equal(got, want.astype(np.float64))
    assert np.array_equal(got_add, (want + add).astype(np.float64))


# ---------------------------------------------------------------------------------------------
# errors name the module
# ---------------------------------------------------------------------------------------------
def test_errors(tmp_path):
    net = _Net().eval()
    x = torch.randn(2, 4, 5)
    with pytest.raises(ONNXExportError, match=r"gru \(QuantGRU\) is not converted"):
        qgru.export_onnx(net, (x,), tmp_path / "a.onnx")

    class Float(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(5, 4)

        def forward(self, x):
            return self.rnn(x)

    with pytest.raises(ONNXExportError, match="rnn is a float GRU"):
        qgru.export_onnx(Float(), (x,), tmp_path / "b.onnx")
    m = _quant_gru("w8a8", "multiplier", 5, 4, 1, False)
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(4, 2, 5), torch.tensor([4, 2]))
    with pytest.raises(ONNXExportError, match="PackedSequence cannot be an ONNX input"):
        qgru.export_onnx(m, (packed,), tmp_path / "c.onnx")

    class Packs(nn.Module):
        def __init__(self, gru):
            super().__init__()
            self.gru = gru

        def forward(self, x):
            p = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([x.shape[0]] * x.shape[1]))
            return self.gru(p)[1]

    with pytest.raises(ONNXExportError, match=r"gru: a PackedSequence cannot be an ONNX input"):
        qgru.export_onnx(Packs(m), (torch.randn(4, 2, 5),), tmp_path / "d.onnx")
    assert not (tmp_path / "d.onnx").exists()
    # the module runs as before after a failed export (its forward is restored)
    out, _ = m(torch.randn(3, 2, 5))
    assert out.shape == (3, 2, 4)
    with pytest.raises(ONNXExportError, match="opset 13"):
        qgru.export_onnx(m, (torch.randn(3, 2, 5),), tmp_path / "e.onnx", opset=13)


# ---------------------------------------------------------------------------------------------
# h0 of another shape than [L*D, N, H] fails at run time (the module raises QGRUInputError)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers,bidirectional", [(2, False), (1, True)])
def test_h0_of_another_shape_is_refused(tmp_path, layers, bidirectional):
    """Each layer reads its row of h0 with a Gather: without the check an h0 of more rows than
    L*D ran silently on its first rows. Rows, batch of 1 (which would broadcast) or of another size
    than x's, on a graph with a dynamic batch axis: each fails in the check, and the module refuses
    every one of them too."""
    m = _quant_gru("w8a8", "multiplier", 5, 6, layers, bidirectional)
    rows = layers * (2 if bidirectional else 1)
    x, h0 = _inputs(m, 6, 3, 1.0, seed=1)
    sess = _session(str(qgru.export_onnx(m, (x, h0), tmp_path / "h0.onnx")))
    x2, h02 = _inputs(m, 4, 2, 2.0, seed=2)  # another batch than the example's: still exact
    _assert_exact(sess, m, {"input0": x2.numpy(), "input1": h02.numpy()}, x2, h02)
    g = torch.Generator().manual_seed(3)
    bad = [((6, 3, 5), (rows + 1, 3, 6)), ((6, 3, 5), (1, 3, 6)), ((6, 3, 5), (rows + 3, 3, 6)),
           ((6, 3, 5), (rows, 4, 6)), ((6, 3, 5), (rows, 1, 6)), ((6, 1, 5), (rows, 3, 6))]
    for xs, hs in bad:
        xb, hb = torch.randn(*xs, generator=g), torch.randn(*hs, generator=g)
        with pytest.raises(qgru.QGRUInputError, match="h0 must have shape"):
            m(xb, hb)
        with pytest.raises(Exception, match=f"h0_must_be_{rows}xNx6"):
            sess.run(None, {"input0": xb.numpy(), "input1": hb.numpy()})


def test_h0_check_in_the_graph_itself():
    """build_model's graph with an h0 input of unknown shape (as inside a larger model, where no
    input declaration checks it): a wrong hidden size or row count fails in the check, another rank
    fails too, the right shape gives the module's outputs."""
    from qgru.onnx_graph import build_model
    m = _quant_gru("w8a16", "multiplier", 4, 5, 2, True)
    model = build_model(m.export())
    h0_in = next(i for i in model.graph.input if i.name == "h0")
    h0_in.type.tensor_type.ClearField("shape")
    sess = _session(model)
    x, h0 = _inputs(m, 5, 2, 1.0, seed=4)
    _assert_exact(sess, m, {"x": x.numpy(), "h0": h0.numpy()}, x, h0)
    for hs in ((4, 2, 6), (4, 2, 4), (4, 2, 1), (3, 2, 5), (2, 4, 5), (4, 10)):  # (2, 4, 5): same size
        with pytest.raises(Exception, match="h0_must_be_4xNx5" if len(hs) == 3 else None):
            sess.run(None, {"x": x.numpy(), "h0": np.zeros(hs, np.float32)})


# ---------------------------------------------------------------------------------------------
# bfloat16 input, with and without h0
# ---------------------------------------------------------------------------------------------
def _run_bf16(sess, feeds, shapes):
    """sess on bfloat16 torch tensors (numpy has no bfloat16: the bits as uint16 OrtValues, typed
    bfloat16), the outputs of ``shapes`` back as bfloat16 torch tensors."""
    BF16 = onnx.TensorProto.BFLOAT16
    io = sess.io_binding()
    for name, t in feeds.items():
        io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            t.contiguous().view(torch.int16).numpy().view(np.uint16), BF16))
    bufs = [np.zeros(s, np.uint16) for s in shapes]
    for o, b in zip(sess.get_outputs(), bufs):
        io.bind_ortvalue_output(o.name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(b, BF16))
    sess.run_with_iobinding(io)
    return [torch.from_numpy(b.view(np.int16)).view(torch.bfloat16) for b in bufs]


def test_bfloat16_input(tmp_path):
    """The zero h0 a QuantGRU makes for bfloat16 input without one is a bfloat16 ConstantOfShape in
    torch's trace, which opset 17 does not have (the checker refused the model): the export writes it
    in float32 and casts. With and without h0, the outputs are the module's, bfloat16 bit for bit."""
    m = _quant_gru("w8a8", "multiplier", 5, 6, 2, True, batch_first=True)
    x = (torch.randn(3, 6, 5) * 2).bfloat16()
    path = qgru.export_onnx(m, (x,), tmp_path / "bf16.onnx")
    model = onnx.load(str(path))
    cos = [n for n in model.graph.node if n.op_type == "ConstantOfShape"]
    assert cos and all(a.t.data_type != onnx.TensorProto.BFLOAT16 for n in cos for a in n.attribute)
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    sess = _session(str(path))
    for N, T, seed in ((3, 6, 1), (2, 9, 2)):
        x = (torch.randn(N, T, 5, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()
        with torch.no_grad():
            want = m(x)
            with qgru.backend("reference"):
                gold = m(x)
        got = _run_bf16(sess, {"input0": x}, [w.shape for w in want])
        for a, w, gd in zip(got, want, gold):
            assert w.dtype == torch.bfloat16 and torch.equal(a, w) and torch.equal(a, gd)
    h0 = torch.randn(4, 2, 6).bfloat16()
    sess = _session(str(qgru.export_onnx(m, (x, h0), tmp_path / "bf16_h0.onnx")))
    with torch.no_grad():
        want = m(x, h0)
    got = _run_bf16(sess, {"input0": x, "input1": h0}, [w.shape for w in want])
    assert all(torch.equal(a, w) for a, w in zip(got, want))


# ---------------------------------------------------------------------------------------------
# serving: ONNX Runtime in a process where torch and qgru cannot be imported
# ---------------------------------------------------------------------------------------------
_SERVE = r"""
import sys
sys.modules["torch"] = None  # `import torch` (by anything below) now raises ImportError
sys.modules["qgru"] = None
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("torch was importable")
import numpy as np
import onnxruntime as ort
folder = sys.argv[1]
sess = ort.InferenceSession(folder + "/net.onnx", providers=["CPUExecutionProvider"])
n = int(open(folder + "/count").read())
for i in range(n):
    x = np.load(f"{folder}/x{i}.npy")
    h0 = np.load(f"{folder}/h0{i}.npy")
    y, h = sess.run(None, {"x": x, "h0": h0})
    assert np.array_equal(y, np.load(f"{folder}/y{i}.npy")), f"outputs of set {i} differ"
    assert np.array_equal(h, np.load(f"{folder}/h{i}.npy")), f"h_n of set {i} differs"
print("served", n, "torch" in sys.modules and sys.modules["torch"] is not None)
"""


def test_served_bit_exact_in_a_process_without_torch(tmp_path):
    import subprocess
    import sys

    m = _quant_gru("w8a8", "multiplier", 5, 6, 2, True, batch_first=True, seed=3)
    x, h0 = _inputs(m, 7, 2, 1.0, seed=4)
    path = qgru.export_onnx(m, (x, h0), tmp_path / "net.onnx", input_names=["x", "h0"], output_names=["y", "h"])
    sets = [(x, h0)] + [_inputs(m, T, N, 2.0, seed=T) for T, N in ((1, 1), (23, 5))]
    for i, (xi, hi) in enumerate(sets):
        with torch.no_grad():
            y, h = m(xi, hi)
            with qgru.backend("reference"):
                gy, gh = m(xi, hi)
        assert torch.equal(y, gy) and torch.equal(h, gh)  # the vectors are the golden model's too
        for name, t in (("x", xi), ("h0", hi), ("y", y), ("h", h)):
            np.save(tmp_path / f"{name}{i}.npy", t.numpy())
    (tmp_path / "count").write_text(str(len(sets)))
    r = subprocess.run([sys.executable, "-c", _SERVE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["served", "3", "False"]
