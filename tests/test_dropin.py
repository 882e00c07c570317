"""QuantGRU as a drop-in torch.nn.GRU, checked against torch.nn.GRU itself.

* parameters / state_dict / from_float / to_float are nn.GRU's;
* float mode (before convert) and the float reference used during calibration
  (qgru/float_gru.py + the layer/direction/packing logic of module.py) equal nn.GRU;
* the integer path (after calibrate + convert) returns what nn.GRU returns (types, shapes,
  packing metadata), close to the float values, and a packed batch is bit-identical to running
  every sequence on its own: padding never leaks, in either direction;
* dropout, quantize_model and the backend registry.

Shapes are kept tiny so the whole file runs in a few seconds on 2 CPU cores.
"""
from __future__ import annotations

import copy
import functools
import importlib
import itertools

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import qgru
from qgru import QuantGRU

INPUT, HIDDEN, T, N = 5, 6, 7, 4
# Variable lengths for packed inputs, in the original (unsorted) batch order; all include length 1.
LENGTHS = {"packed_unsorted": [5, 1, T, 3], "packed_sorted": [T, 5, 3, 1]}
INPUT_KINDS = ("batched", "unbatched", "packed_unsorted", "packed_sorted")

MODEL_GRID = list(itertools.product([1, 2, 3], [False, True], [False, True], [True, False]))
MODEL_IDS = [f"L{L}-{'bi' if bi else 'uni'}-{'bf' if bf else 'tm'}-{'bias' if b else 'nobias'}"
             for L, bi, bf, b in MODEL_GRID]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def make_gru(num_layers, bidirectional, batch_first, bias, seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return nn.GRU(INPUT, HIDDEN, num_layers, bias=bias, batch_first=batch_first,
                  dropout=dropout, bidirectional=bidirectional).eval()


def make_input(kind, gru, with_h0, seed=1):
    """-> (input for the GRU, h0 or None, lengths tensor or None, padded batch-first x or None)."""
    g = torch.Generator().manual_seed(seed)
    states = gru.num_layers * (2 if gru.bidirectional else 1)
    if kind == "unbatched":
        x = torch.randn(T, INPUT, generator=g)
        h0 = torch.rand(states, HIDDEN, generator=g) * 2 - 1
        return x, (h0 if with_h0 else None), None, None
    h0 = torch.rand(states, N, HIDDEN, generator=g) * 2 - 1
    h0 = h0 if with_h0 else None
    if kind == "batched":
        x = torch.randn(N, T, INPUT, generator=g)
        return (x if gru.batch_first else x.transpose(0, 1).contiguous()), h0, None, None
    lengths = torch.tensor(LENGTHS[kind])
    padded = torch.randn(N, T, INPUT, generator=g)
    padded = padded * (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(-1)
    packed = pack_padded_sequence(padded, lengths, batch_first=True,
                                  enforce_sorted=(kind == "packed_sorted"))
    return packed, h0, lengths, padded


def call(module, x, h0):
    return module(x) if h0 is None else module(x, h0)


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def assert_like_gru(got, ref, tol):
    """``got`` has nn.GRU's output types, shapes, dtypes, packing metadata, and rel error <= tol."""
    (out, h_n), (r_out, r_h_n) = got, ref
    if isinstance(r_out, PackedSequence):
        assert isinstance(out, PackedSequence)
        assert torch.equal(out.batch_sizes, r_out.batch_sizes)
        for name in ("sorted_indices", "unsorted_indices"):
            a, b = getattr(out, name), getattr(r_out, name)
            assert (a is None) == (b is None), name
            if b is not None:
                assert torch.equal(a, b), name
        out, r_out = out.data, r_out.data
    else:
        assert isinstance(out, torch.Tensor) and not isinstance(out, PackedSequence)
    for a, b, what in ((out, r_out, "output"), (h_n, r_h_n, "h_n")):
        assert a.shape == b.shape, what
        assert a.dtype == b.dtype, what
        assert torch.isfinite(a).all(), what
        err = rel_err(a, b)
        assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def assert_h_n_is_last_output(result, gru):
    """nn.GRU's invariant: the last layer's h_n is its output at each sequence's last step
    (forward direction) and at step 0 (reverse direction)."""
    out, h_n = result
    D, H = (2 if gru.bidirectional else 1), gru.hidden_size
    if isinstance(out, PackedSequence):
        out, lengths = pad_packed_sequence(out)  # [T, N, D*H]
    else:
        if out.dim() == 2:  # unbatched
            out, h_n = out.unsqueeze(1), h_n.unsqueeze(1)
        elif gru.batch_first:
            out = out.transpose(0, 1)
        lengths = torch.full((out.shape[1],), out.shape[0])
    last = h_n[-D:]
    n = torch.arange(out.shape[1])
    assert torch.equal(out[lengths - 1, n, :H], last[0])
    if D == 2:
        assert torch.equal(out[0, :, H:], last[1])


def calib_config(name):
    """A built-in config with a min/max observer: calibrating on the very inputs the test runs
    means nothing is clipped, so the measured error is pure rounding error."""
    return qgru.QuantConfig.load(name, overrides={"observer": {"kind": "minmax"}})


@functools.lru_cache(maxsize=None)
def converted_pair(num_layers, bidirectional, batch_first, bias, config="w8a8"):
    """(nn.GRU, converted QuantGRU copy), calibrated on every input of the combination grid."""
    gru = make_gru(num_layers, bidirectional, batch_first, bias)
    m = QuantGRU.from_float(gru, calib_config(config))
    batches = []
    for kind, with_h0 in itertools.product(INPUT_KINDS, [False, True]):
        x, h0, _, _ = make_input(kind, gru, with_h0)
        batches.append((x,) if h0 is None else (x, h0))
    qgru.calibrate(m, batches, progress=False)
    m.convert()
    return gru, m


# ---------------------------------------------------------------------------------------------
# 1. parameters, state_dict, from_float, to_float
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers,bidirectional,bias",
                         list(itertools.product([1, 2, 3], [False, True], [True, False])))
def test_parameters_and_state_dict_match_nn_gru(num_layers, bidirectional, bias):
    torch.manual_seed(0)
    ref = nn.GRU(INPUT, HIDDEN, num_layers, bias=bias, bidirectional=bidirectional)
    m = QuantGRU(INPUT, HIDDEN, num_layers, bias, False, 0.0, bidirectional, config="w8a8")
    assert isinstance(m, nn.GRU)
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [(k, v.shape) for k, v in m.state_dict().items()] == \
        [(k, v.shape) for k, v in ref.state_dict().items()]
    # nn.GRU's state_dict loads into QuantGRU (strict) and back
    m.load_state_dict(ref.state_dict())
    ref.load_state_dict(m.state_dict())


@pytest.mark.parametrize("num_layers,bidirectional,bias", [(1, False, True), (2, True, False), (3, True, True)])
def test_from_float_copies_without_aliasing(num_layers, bidirectional, bias):
    gru = make_gru(num_layers, bidirectional, True, bias)
    original = copy.deepcopy(gru.state_dict())
    m = QuantGRU.from_float(gru, "w16a16")
    assert type(m) is QuantGRU and m.qconfig.name == "w16a16"
    for attr in ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional"):
        assert getattr(m, attr) == getattr(gru, attr), attr
    assert m.state_dict().keys() == original.keys()
    for k, v in m.state_dict().items():
        assert torch.equal(v, original[k]), k
        assert v.data_ptr() != gru.state_dict()[k].data_ptr(), f"{k} aliases the original"
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    for k, v in gru.state_dict().items():
        assert torch.equal(v, original[k]), f"modifying the copy changed the original's {k}"


def test_from_float_rejects_non_gru():
    with pytest.raises(TypeError):
        QuantGRU.from_float(nn.LSTM(INPUT, HIDDEN))


@pytest.mark.parametrize("converted", [False, True])
def test_to_float_returns_plain_gru_with_equal_state(converted):
    m = converted_pair(2, True, True, True)[1] if converted else QuantGRU.from_float(make_gru(2, True, True, True))
    g = m.to_float()
    assert type(g) is nn.GRU
    for attr in ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout", "bidirectional"):
        assert getattr(g, attr) == getattr(m, attr), attr
    sd = m.state_dict()
    # a converted QuantGRU's state_dict also holds its integer parameters, as '_extra_state'
    assert ("_extra_state" in sd) == converted
    sd.pop("_extra_state", None)
    assert list(g.state_dict()) == list(sd)
    for k, v in g.state_dict().items():
        assert torch.equal(v, sd[k]), k
    with torch.no_grad():
        g.weight_hh_l0.add_(1.0)
    assert torch.equal(m.weight_hh_l0, sd["weight_hh_l0"]), "to_float() aliases the QuantGRU's weights"


# ---------------------------------------------------------------------------------------------
# 2./3. float mode and the float reference path equal nn.GRU on every combination
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("num_layers,bidirectional,batch_first,bias", MODEL_GRID, ids=MODEL_IDS)
@pytest.mark.parametrize("path", ["float", "calibration_reference"])
def test_float_paths_match_nn_gru(path, num_layers, bidirectional, batch_first, bias, kind, with_h0):
    gru = make_gru(num_layers, bidirectional, batch_first, bias)
    m = QuantGRU.from_float(gru)
    x, h0, _, _ = make_input(kind, gru, with_h0)
    with torch.no_grad():
        ref = call(gru, x, h0)
        if path == "float":
            got = call(m, x, h0)
        else:
            m.start_calibration()
            try:
                got = call(m, x, h0)
            finally:
                m.stop_calibration()
    assert_like_gru(got, ref, tol=1e-5)
    assert_h_n_is_last_output(got, gru)


def test_calibration_reference_actually_runs_qgru_float_gru(monkeypatch):
    """Guard for test 3: the calibrating forward really goes through qgru.float_gru, not nn.GRU."""
    import qgru.module as module
    calls = []
    real = module.float_direction
    monkeypatch.setattr(module, "float_direction", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = QuantGRU.from_float(make_gru(2, True, False, True))
    x, _, _, _ = make_input("batched", m, False)
    m.start_calibration()
    m(x)
    m.stop_calibration()
    assert len(calls) == 4  # 2 layers x 2 directions


# ---------------------------------------------------------------------------------------------
# 4. integer path: nn.GRU's interface, close to float, packed == each sequence alone
# ---------------------------------------------------------------------------------------------
# Measured max relative errors over this grid (minmax calibration on the very same inputs):
# w8a8 0.146, w16a16 7.0e-4, both on 3 layers without bias and without h0, whose outputs are
# small next to the h grid (calibrated to cover h0 in [-1, 1]); typical cases are ~0.02 / ~1e-4.
# The bounds leave margin but still catch a broken path (wrong direction order, leaked padding,
# mis-scaled layer hand-off all give errors of order 1).
INT_TOL = {"w8a8": 0.2, "w16a16": 1.5e-3}


@pytest.mark.parametrize("num_layers,bidirectional,batch_first,bias", MODEL_GRID, ids=MODEL_IDS)
def test_integer_path_matches_nn_gru_interface_and_values(num_layers, bidirectional, batch_first, bias):
    gru, m = converted_pair(num_layers, bidirectional, batch_first, bias)
    assert m.is_converted
    for kind, with_h0 in itertools.product(INPUT_KINDS, [False, True]):
        x, h0, _, _ = make_input(kind, gru, with_h0)
        with torch.no_grad():
            got = call(m, x, h0)
        assert_like_gru(got, call(gru, x, h0), tol=INT_TOL["w8a8"])
        assert_h_n_is_last_output(got, gru)


@pytest.mark.parametrize("num_layers,bidirectional,batch_first,bias",
                         [(1, False, False, True), (2, True, True, False), (3, False, False, False),
                          (3, True, False, True)])
def test_integer_path_w16a16_is_much_closer(num_layers, bidirectional, batch_first, bias):
    gru, m = converted_pair(num_layers, bidirectional, batch_first, bias, "w16a16")
    for kind, with_h0 in itertools.product(INPUT_KINDS, [False, True]):
        x, h0, _, _ = make_input(kind, gru, with_h0)
        with torch.no_grad():
            assert_like_gru(call(m, x, h0), call(gru, x, h0), tol=INT_TOL["w16a16"])


@pytest.mark.parametrize("with_h0", [False, True], ids=["no_h0", "h0"])
@pytest.mark.parametrize("kind", ["packed_unsorted", "packed_sorted"])
@pytest.mark.parametrize("num_layers,bidirectional,batch_first,bias", MODEL_GRID, ids=MODEL_IDS)
def test_integer_packed_equals_each_sequence_alone(num_layers, bidirectional, batch_first, bias, kind, with_h0):
    gru, m = converted_pair(num_layers, bidirectional, batch_first, bias)
    x, h0, lengths, padded = make_input(kind, gru, with_h0)
    out, h_n = m(x) if h0 is None else m(x, h0)
    out_pad, out_len = pad_packed_sequence(out, batch_first=True)  # original batch order
    assert torch.equal(out_len, lengths)
    for i, L in enumerate(lengths.tolist()):
        xi = padded[i:i + 1, :L]  # batch of 1, true length, batch-first
        xi = xi if batch_first else xi.transpose(0, 1)
        hi = None if h0 is None else h0[:, i:i + 1].contiguous()
        o_i, h_i = call(m, xi, hi)
        o_i = o_i[0] if batch_first else o_i[:, 0]
        assert torch.equal(out_pad[i, :L], o_i), f"sequence {i} (length {L}): outputs differ"
        assert torch.equal(h_n[:, i], h_i[:, 0]), f"sequence {i} (length {L}): h_n differs"


# ---------------------------------------------------------------------------------------------
# 5. integer path: padding values of the input never matter
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_layers,bidirectional", [(1, True), (2, True), (3, False)])
def test_integer_padding_values_do_not_affect_results(num_layers, bidirectional):
    gru, m = converted_pair(num_layers, bidirectional, False, True)
    x, h0, lengths, padded = make_input("packed_unsorted", gru, True)
    pad_mask = (torch.arange(T).unsqueeze(0) >= lengths.unsqueeze(1)).unsqueeze(-1)
    garbage = padded + pad_mask * torch.randn(padded.shape).mul(50)
    assert not torch.equal(garbage, padded)

    # public API: pack the garbage-padded batch
    out_a, h_a = m(x, h0)
    out_b, h_b = m(pack_padded_sequence(garbage, lengths, batch_first=True, enforce_sorted=False), h0)
    assert torch.equal(out_a.data, out_b.data) and torch.equal(h_a, h_b)

    # One level down (private API): the time-major padded tensor the integer stack consumes, with
    # garbage at t >= length. Within-length reversal and the layer hand-off must ignore it.
    o_clean, h_clean = m._forward_integer(padded.transpose(0, 1), h0, lengths)
    o_garb, h_garb = m._forward_integer(garbage.transpose(0, 1), h0, lengths)
    assert torch.equal(o_clean, o_garb) and torch.equal(h_clean, h_garb)
    assert torch.equal(h_clean, h_a)


# ---------------------------------------------------------------------------------------------
# 6. dropout between layers (float mode)
# ---------------------------------------------------------------------------------------------
def test_dropout_train_is_random_and_eval_matches_nn_gru():
    gru = make_gru(2, True, False, True, dropout=0.5)
    m = QuantGRU.from_float(gru)
    x, h0, _, _ = make_input("batched", gru, True)

    m.train()
    a, _ = m(x, h0)
    b, _ = m(x, h0)
    assert not torch.equal(a, b), "dropout=0.5 in training mode gave identical outputs twice"
    # same RNG stream -> the same mask as nn.GRU's own training forward
    gru.train()
    torch.manual_seed(123)
    c, hc = m(x, h0)
    torch.manual_seed(123)
    r, hr = gru(x, h0)
    assert torch.allclose(c, r, rtol=1e-5, atol=1e-6) and torch.allclose(hc, hr, rtol=1e-5, atol=1e-6)

    m.eval()
    gru.eval()
    e1, h1 = m(x, h0)
    e2, h2 = m(x, h0)
    assert torch.equal(e1, e2) and torch.equal(h1, h2)
    ref, ref_h = gru(x, h0)
    assert rel_err(e1, ref) <= 1e-5 and rel_err(h1, ref_h) <= 1e-5
    assert not torch.allclose(a, ref), "training-mode output should differ from eval (dropout)"


# ---------------------------------------------------------------------------------------------
# 7. quantize_model
# ---------------------------------------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(INPUT, HIDDEN, 2, batch_first=True, bidirectional=True)

    def forward(self, x, h0=None):
        return self.rnn(x, h0)[0]


class Net(nn.Module):
    """GRUs nested in a submodule and in a ModuleList, plus a Linear head; called as net(x, h0)."""

    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.extra = nn.ModuleList([nn.GRU(2 * HIDDEN, HIDDEN, batch_first=True)])
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, x, h0):
        y, _ = self.extra[0](self.encoder(x, h0))
        return self.head(y)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_quantize_model_swaps_nested_grus_and_leaves_original_untouched():
    torch.manual_seed(0)
    net = Net().eval()
    before = _state(net)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(3, T, INPUT, generator=g), torch.rand(4, 3, HIDDEN, generator=g) * 2 - 1)
               for _ in range(3)]  # tuples: called as net(x, h0); net((x, h0)) would fail
    q = qgru.quantize_model(net, batches, calib_config("w8a8"), progress=False)

    assert q is not net and type(q) is Net
    for qmod in (q.encoder.rnn, q.extra[0]):
        assert type(qmod) is QuantGRU and qmod.is_converted
    assert not any(type(mod) is nn.GRU for mod in q.modules())
    # deep copy: nothing shared with the original
    assert q.head.weight.data_ptr() != net.head.weight.data_ptr()
    assert q.encoder.rnn.weight_ih_l0.data_ptr() != net.encoder.rnn.weight_ih_l0.data_ptr()
    # original untouched
    assert type(net.encoder.rnn) is nn.GRU and type(net.extra[0]) is nn.GRU
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    # same float parameters in the copy (and, for each converted GRU, its integer ones as extra state)
    sd = q.state_dict()
    assert {k for k in sd if k.endswith("_extra_state")} == {"encoder.rnn._extra_state", "extra.0._extra_state"}
    for k, v in sd.items():
        if not k.endswith("_extra_state"):
            assert torch.equal(v, before[k]), k
    x, h0 = batches[0]
    with torch.no_grad():
        ref = net(x, h0)
        got = q(x, h0)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < 0.1


class _Tied(nn.Module):
    """One GRU under two names (self.dec = self.enc) and a second one inside two parents."""

    def __init__(self):
        super().__init__()
        self.enc = nn.GRU(INPUT, INPUT)
        self.dec = self.enc
        shared = nn.GRU(INPUT, HIDDEN)
        self.a, self.b = nn.Sequential(shared), nn.Sequential(shared)

    def forward(self, x):
        y, _ = self.dec(self.enc(x)[0])
        return self.a[0](y)[0] + self.b[0](x)[0]


def test_quantize_model_keeps_a_tied_gru_one_quantgru_under_all_its_names():
    # named_children() lists a module held twice once: a swap through it left q.dec the float GRU
    torch.manual_seed(0)
    net = _Tied().eval()
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(T, 3, INPUT, generator=g) for _ in range(3)]
    p = qgru.prepare_model(net, calib_config("w8a8"))
    assert type(p.enc) is QuantGRU and p.dec is p.enc and type(p.a[0]) is QuantGRU and p.b[0] is p.a[0]
    assert not any(isinstance(m, nn.GRU) and not isinstance(m, QuantGRU) for m in p.modules())
    qgru.calibrate(p, batches, progress=False)
    # calibration saw every use: the tied GRU's x observer took enc's input and dec's (enc's output)
    assert p.enc._observers[(0, 0)]["x"].count == 3 * 2 * T * 3 * INPUT
    assert p.a[0]._observers[(0, 0)]["x"].count == 3 * 2 * T * 3 * INPUT
    q = qgru.quantize_model(net, batches, calib_config("w8a8"), progress=False)
    assert q.enc.is_converted and q.dec is q.enc and q.a[0].is_converted and q.b[0] is q.a[0]
    assert len({id(m) for m in q.modules() if isinstance(m, QuantGRU)}) == 2
    with torch.no_grad():
        ref, got = net(batches[0]), q(batches[0])
    assert rel_err(got, ref) < 0.1
    # the original keeps its float GRUs, tied as they were
    assert type(net.enc) is nn.GRU and net.dec is net.enc and net.b[0] is net.a[0]


def test_quantize_model_on_a_bare_gru():
    gru = make_gru(1, True, False, True)
    before = _state(gru)
    x, _, _, _ = make_input("batched", gru, False)
    q = qgru.quantize_model(gru, [x], calib_config("w16a16"), progress=False)
    assert type(q) is QuantGRU and q.is_converted and q is not gru
    assert type(gru) is nn.GRU
    for k, v in gru.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        assert_like_gru(q(x), gru(x), tol=INT_TOL["w16a16"])


def test_calibrate_restores_each_submodules_training_flag():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(INPUT, HIDDEN)
            self.norm = nn.BatchNorm1d(HIDDEN)

        def forward(self, x):
            return self.norm(self.rnn(x)[0][-1])

    torch.manual_seed(0)
    net = Head().train()
    net.norm.eval()  # frozen statistics
    x = torch.randn(T, 3, INPUT)
    q = qgru.quantize_model(net, [x], progress=False)
    assert net.norm.training is False  # the original is untouched (a deep copy was calibrated)
    assert q.training is True and q.norm.training is False


def test_quantize_model_without_gru_raises():
    with pytest.raises(ValueError):
        qgru.quantize_model(nn.Linear(3, 3), [torch.randn(2, 3)], progress=False)


# ---------------------------------------------------------------------------------------------
# 8. backends
# ---------------------------------------------------------------------------------------------
def test_backend_reference_context_and_registry():
    info = qgru.backends()
    assert info["reference"]["available"] is True
    gru, m = converted_pair(2, True, False, True)
    x, h0, _, _ = make_input("packed_unsorted", gru, True)
    default_out, default_h = m(x, h0)
    with qgru.backend("reference"):
        out, h = m(x, h0)
    assert torch.equal(out.data, default_out.data) and torch.equal(h, default_h)


def test_unknown_backend_raises_and_names_known_ones():
    with pytest.raises(ValueError) as exc:
        with qgru.backend("no-such-backend"):
            pass
    msg = str(exc.value)
    assert "no-such-backend" in msg
    for name in qgru.backends():
        assert name in msg


def test_unavailable_backend_raises_and_forced_backend_is_restored():
    backends_mod = importlib.import_module("qgru.backends")  # qgru.backends is also a function
    unavailable = [n for n, i in qgru.backends().items() if not i["available"]]
    for name in unavailable:
        with pytest.raises(RuntimeError):
            with qgru.backend(name):
                pass
    with pytest.raises(KeyError):
        with qgru.backend("reference"):
            raise KeyError("boom")
    assert getattr(backends_mod._forced, "name", None) is None  # the with block restored it


@pytest.mark.parametrize("bidirectional", [True, False])
def test_packed_rows_run_longest_first_and_come_back_in_order(bidirectional):
    """A converted model runs a PackedSequence's rows in its sorted order (longest first, so the
    native steps skip tiles of finished rows) and hands out and h_n back in the caller's order:
    every row of a packed call, with its own h0, equals that row run alone without packing."""
    torch.manual_seed(3)
    g = torch.nn.GRU(6, 20, 2, bidirectional=bidirectional).eval()
    q = qgru.quantize_model(g, [torch.randn(12, 8, 6) for _ in range(2)], config="w8a8", progress=False)
    T, N, D = 12, 37, 2 if bidirectional else 1
    lengths = torch.randint(1, T + 1, (N,), generator=torch.Generator().manual_seed(5))
    lengths[7] = T
    x, h0 = torch.randn(T, N, 6), torch.randn(2 * D, N, 20)
    with torch.inference_mode():
        po, ph = q(pack_padded_sequence(x, lengths, enforce_sorted=False), h0)
        po, plen = pad_packed_sequence(po)
        assert torch.equal(plen, lengths)
        for n in range(N):
            L = int(lengths[n])
            o1, h1 = q(x[:L, n:n + 1], h0[:, n:n + 1].contiguous())
            assert torch.equal(o1[:, 0], po[:L, n]) and torch.equal(h1[:, 0], ph[:, n]), n


def _layer0_x_grids(q):
    """Each layer-0 direction's x grid (scale, zero point, bits) and x levels, as the spec of the
    operator (qgru/ops.py flatten_params) names them: "unit 0 d grid S_x Z_x bits_x ... levels ..."."""
    spec = q._op_params[1].split()
    grids = []
    for i in range(len(spec) - 3):
        if spec[i] == "unit" and spec[i + 1] == "0" and spec[i + 3] == "grid":
            j = spec.index("levels", i)
            grids.append((tuple(spec[i + 4:i + 7]), tuple(spec[j:j + 1 + 3 * int(spec[j + 1]) + 1])))
    return grids


@pytest.mark.parametrize("observer", ["mse", "ema_step"])
def test_bidirectional_packed_call_on_shared_and_distinct_x_grids_equals_the_reference(observer):
    """The bidirectional packed call quantizes x once where both layer-0 directions have the same
    grid and levels (mse: both observers saw the same values), per direction where they differ
    (ema_step: the backward direction sees the steps in the other order), lays the backward
    direction's input out reversed within each length in the copy that pads it, keeps its outputs
    in that order and reads them back reversed in the requantization into layer 1 and in the last
    dequantize; at H = 32 the requantization runs four values at a time (AVX2 where the CPU has it).
    out and h_n are the general path's and the reference backend's bit for bit."""
    if qgru.backends()["cpu"]["why"]:
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    torch.manual_seed(8)
    I, H, T, N = 12, 32, 17, 41
    g = torch.nn.GRU(I, H, 2, bidirectional=True).eval()
    cfg = qgru.QuantConfig.load("w8a8", overrides={"observer": {"kind": observer}})
    calib = [torch.randn(T, 8, I) * torch.linspace(0.2, 3, T).view(T, 1, 1) for _ in range(2)]
    q = qgru.quantize_model(g, calib, config=cfg, progress=False)
    grids = _layer0_x_grids(q)
    assert len(grids) == 2 and (grids[0] == grids[1]) == (observer == "mse"), grids
    general = copy.deepcopy(q)
    general._cpu_packed_call = lambda input, hx: None  # the general path only
    lengths = torch.randint(1, T + 1, (N,), generator=torch.Generator().manual_seed(9))
    lengths[3] = T
    x = torch.randn(T, N, I) * 4  # beyond calibration: several x levels
    p = pack_padded_sequence(x, lengths, enforce_sorted=False)
    h0 = torch.randn(4, N, H)
    for h in (None, h0):
        with torch.inference_mode():
            assert q._cpu_packed_call(p, h) is not None
            out, h_n = q(p, h)
            want, want_h = general(p, h)
            with qgru.backend("reference"):
                ref, ref_h = q(p, h)
        assert torch.equal(out.data, want.data) and torch.equal(h_n, want_h)
        assert torch.equal(out.data, ref.data) and torch.equal(h_n, ref_h)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_packed_one_native_call_equals_the_general_path_and_the_reference(bidirectional):
    """A converted model's PackedSequence call on the cpu backend is one native call (unpacking and
    packing in C++, QuantGRU._cpu_packed_call); it gives the general path's values bit for bit
    (Python unpacking, the operator's C++ on the padded batch, Python packing), and the reference
    backend's, for every kind of input it takes: h0 or none, a non-contiguous or float64 h0, float64
    or float16 data, a negative view, sorted or not, under inference_mode or not; its outputs are
    inference tensors exactly where the general path's are. A malformed PackedSequence still raises
    the general path's error."""
    if qgru.backends()["cpu"]["why"]:
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    import copy
    torch.manual_seed(4)
    I, H, T, N, D = 5, 11, 13, 29, 2 if bidirectional else 1
    g = torch.nn.GRU(I, H, 2, bidirectional=bidirectional).eval()
    q = qgru.quantize_model(g, [torch.randn(T, 8, I) for _ in range(2)], config="w8a8", progress=False)
    general = copy.deepcopy(q)
    general._cpu_packed_call = lambda input, hx: None  # the general path only
    lengths = torch.randint(1, T + 1, (N,), generator=torch.Generator().manual_seed(6))
    x = torch.randn(T, N, I) * 3
    x[0, 0, 0] = float("inf")
    p = pack_padded_sequence(x, lengths, enforce_sorted=False)
    ps = pack_padded_sequence(x, lengths.sort(descending=True).values, enforce_sorted=True)
    h0 = torch.randn(N, 2 * D, H).transpose(0, 1)  # not contiguous
    cases = [(p, None), (p, h0), (p, h0.double()), (ps, None), (ps, h0),
             (PackedSequence(p.data.double(), p.batch_sizes, p.sorted_indices, p.unsorted_indices), h0),
             (PackedSequence(p.data.half(), p.batch_sizes, p.sorted_indices, p.unsorted_indices), None),
             (PackedSequence(torch._neg_view(-p.data), p.batch_sizes, p.sorted_indices, p.unsorted_indices), h0)]
    for mode in (torch.inference_mode, torch.no_grad):
        for i, (seq, h) in enumerate(cases):
            with mode():
                assert q._cpu_packed_call(seq, h) is not None, i
                out, h_n = q(seq, h)
                want, want_h = general(seq, h)
                with qgru.backend("reference"):
                    ref, ref_h = q(seq, h)
            assert torch.equal(out.data, want.data) and torch.equal(h_n, want_h), (mode, i)
            assert torch.equal(out.data, ref.data) and torch.equal(h_n, ref_h), (mode, i)
            assert out.data.dtype == want.data.dtype and h_n.dtype == want_h.dtype
            assert out.data.is_inference() == want.data.is_inference() and h_n.is_inference() == want_h.is_inference()
            assert torch.equal(out.batch_sizes, seq.batch_sizes) and out.sorted_indices is seq.sorted_indices
    bad = PackedSequence.__new__(PackedSequence, p.data, p.batch_sizes, p.sorted_indices, p.sorted_indices)
    assert q._cpu_packed_call(bad, None) is None
    with pytest.raises(qgru.QGRUInputError, match="unsorted_indices its inverse"):
        q(bad)
