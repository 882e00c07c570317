"""How libraries that hold nn.GRU use it (issue 17), with minimal stand-ins for their patterns:

* an autoregressive forecaster calibrated with hundreds of 1-step calls carrying h (darts,
  neuralforecast): the default observer weighs data, not calls;
* Lightning's predict, which runs under torch.inference_mode (every order of inference_mode,
  no_grad and grad-enabled calls, on every backend);
* a library's own ``class GRU(nn.GRU)`` with its own forward (pytorch-forecasting's takes
  ``lengths=``);
* TorchScript (a scripted wrapper, a traced one with an exported method as torchaudio's WaveRNN
  has), torch.compile and torch.export;
* save/load through state_dict, as the libraries' checkpoints do.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import qgru
from qgru.compare import sqnr_db


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors, many calls: one torch thread (on a busy machine a second one makes each small
    op wait for it, up to 100x slower); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return sqnr_db(float((ref * ref).sum()), float(((got - ref) ** 2).sum()))


# =============================================================================================
# 3. Autoregressive calibration: the same data cut into 1-step calls calibrates the same ranges
# =============================================================================================
class Forecaster(nn.Module):
    """darts RNNModel-like: a GRU and a linear head; one call takes (x, h) and returns (y, h_n)."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.rnn = nn.GRU(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x, h=None):
        out, h = self.rnn(x, h)
        return self.head(out), h


class OneStepRollout(nn.Module):
    """The forecaster run as its library runs it when predicting: one call per time step, in
    time order, the state passed back (Lightning-style predict loop)."""

    def __init__(self, model: Forecaster):
        super().__init__()
        self.model = model

    def forward(self, series):
        h, ys = None, []
        for t in range(series.shape[1]):
            y, h = self.model(series[:, t:t + 1], h)
            ys.append(y)
        return torch.cat(ys, dim=1)


def sine_series(N: int = 4, T: int = 300) -> torch.Tensor:
    t = torch.arange(T, dtype=torch.float32)
    rows = [(0.5 + 0.25 * i) * torch.sin(2 * math.pi * t / (40 + 7 * i) + i) for i in range(N)]
    return torch.stack(rows).unsqueeze(-1)  # [N, T, 1]


CALIBRATED = ("x", "h", "Wx", "Rh", "r_pre", "z_pre", "g_pre")


def test_one_step_calls_calibrate_what_one_call_does():
    torch.manual_seed(0)
    model = Forecaster().eval()
    series = sine_series()
    whole = qgru.quantize_model(model, [series], progress=False)  # one call over the whole series
    steps = qgru.quantize_model(OneStepRollout(model), [series], progress=False).model  # 300 calls
    cw, cs = whole.rnn._calib, steps.rnn._calib
    for n in CALIBRATED:
        for end in ("range_min", "range_max"):
            key = f"l0.fwd.{n}.{end}"
            if n == "x":  # the very same values: exactly the same range
                assert torch.equal(cw[key], cs[key]), key
            else:  # W.x of one row at a time rounds differently from one GEMM over all: float32 ulps
                assert torch.allclose(cw[key], cs[key], rtol=1e-5, atol=1e-6), key
        assert int(cs[f"l0.fwd.{n}.clipped"]) == 0, n  # nothing the calibration saw is clipped
    with torch.no_grad():
        ref = model(series)[0]
        s_whole, s_steps = _sqnr(ref, whole(series)[0]), _sqnr(ref, steps(series)[0])
    assert s_whole > 30.0
    assert abs(s_steps - s_whole) < 0.1, (s_steps, s_whole)


def test_compare_names_the_observer_that_clips_its_own_calibration_data():
    """ema weighs calls: over 1-step calls in time order it keeps only the last ~1/momentum calls'
    extremes, and its range clips the data it was calibrated on; compare says so, and advises a
    data-weighted observer instead of more bits."""
    torch.manual_seed(0)
    model = Forecaster().eval()
    series = sine_series()
    # x on one static grid (x levels would hold what the ema range clips)
    cfg = qgru.QuantConfig.load("w8a8", overrides={"observer": {"kind": "ema"}, "tensors": {"x": {"dynamic": False}}})
    q = qgru.quantize_model(OneStepRollout(model), [series], config=cfg, progress=False).model
    assert int(q.rnn._calib["l0.fwd.x.clipped"]) > 0.1 * int(q.rnn._calib["l0.fwd.x.count"])
    report = qgru.compare(model, q, [series], verbose=False, progress=False)
    w = report.worst()
    assert w["tensor"] == "x" and w["reason"] == "observer"
    assert w["override"] == {"observer": {"kind": "percentile"}}
    assert "ema (momentum 0.1) observer" in w["message"] and "own calibration data" in w["message"]
    assert report.row("x", module="rnn")["calib_clip"] > 0.1
    text = str(report)
    assert "observer" in text and "'bits': 16" not in text.splitlines()[-2]
    # the default observer on the same calls: nothing to blame on it
    q2 = qgru.quantize_model(OneStepRollout(model), [series], progress=False).model
    r2 = qgru.compare(model, q2, [series], verbose=False, progress=False)
    assert r2.worst()["reason"] != "observer"
    assert all((r["calib_clip"] or 0.0) == 0.0 for r in r2.rows if r["tensor"] in CALIBRATED)


# =============================================================================================
# 1. torch.inference_mode (Lightning's predict) before, between and after other calls
# =============================================================================================
@pytest.fixture(params=["reference", "cpu", "cpu:portable", "cuda"])
def backend_kind(request, monkeypatch):
    """Each backend ("cpu": its fastest path here; "cpu:portable": forced onto the portable path),
    skipped where unavailable."""
    name = request.param.split(":")[0]
    why = qgru.backends()[name]["why"]
    if why:
        pytest.skip(f"{name} backend unavailable: {why}")
    if request.param == "cpu:portable":
        monkeypatch.setenv("QGRU_CPU_ISA", "portable")
    return request.param


def _device(kind: str) -> torch.device:
    return torch.device("cuda" if kind == "cuda" else "cpu")


MODES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": torch.enable_grad,
}


def _converted(config: str = "w8a8", seed: int = 0) -> qgru.QuantParams:
    torch.manual_seed(seed)
    m = qgru.QuantGRU(3, 8, num_layers=2, batch_first=True, config=config)
    qgru.calibrate(m, [torch.randn(4, 6, 3) for _ in range(2)], progress=False)
    return m.convert().export()


@pytest.mark.parametrize("config", ["w8a8", "w16a16"])
def test_every_order_of_inference_mode_no_grad_and_grad(backend_kind, config):
    """The first call of a shape under inference_mode used to leave inference tensors in the cpu
    backend's reused buffers, and the next call of that shape outside it failed ("Inplace update to
    inference tensor outside InferenceMode"). Every order of three modes, two shapes (the cpu
    backend's few-rows loop and its GEMM path), a fresh model each time; results bit-identical to
    plain calls, and outside inference_mode never an inference tensor."""
    import itertools
    dev = _device(backend_kind)
    params = _converted(config)
    plain = params.to_module().to(dev)
    for i, order in enumerate(itertools.product(MODES, repeat=3)):
        # shapes no call has used yet (the cpu backend's quantize buffers are kept per shape and
        # thread, across modules), and the expected values from the reference backend, which keeps
        # no buffers: the first call of each shape is this order's first
        T, k = 2 + i % 9, i // 9
        xs = [torch.randn(1 + k, T, 3, device=dev), torch.randn(17 + k, T, 3, device=dev)]
        with qgru.backend("reference"), torch.no_grad():
            want = [plain(x) for x in xs]
        m = params.to_module().to(dev)  # fresh: no layer buffer made yet
        with qgru.backend(backend_kind.split(":")[0]):
            for mode in order:
                for x, (w_out, w_h) in zip(xs, want):
                    with MODES[mode]():
                        out, h = m(x)
                    assert torch.equal(out, w_out) and torch.equal(h, w_h), (order, mode)
                    if mode != "inference_mode":
                        assert not out.is_inference() and not h.is_inference(), (order, mode)
                        out.add_(1.0)  # the caller may write its result in place
                        h.mul_(2.0)


class LitForecaster(nn.Module):
    """A LightningModule stand-in: predict_step as Lightning's predict loop runs it."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x, h=None):
        out, h = self.gru(x, h)
        return self.head(out), h

    def predict_step(self, batch):
        return self(batch)


def lightning_predict(model: nn.Module, batches):
    """What Trainer.predict does around predict_step: eval mode, torch.inference_mode."""
    model.eval()
    with torch.inference_mode():
        return [model.predict_step(b) for b in batches]


def test_lightning_predict_then_plain_calls_then_streaming(backend_kind):
    dev = _device(backend_kind)
    torch.manual_seed(1)
    q = qgru.quantize_model(LitForecaster(), [torch.randn(4, 6, 3) for _ in range(2)], progress=False).to(dev)
    x = torch.randn(3, 31, 3, device=dev)  # a shape no other test uses
    with qgru.backend("reference"), torch.no_grad():  # keeps no buffers
        want_y, want_h = q(x)
    with qgru.backend(backend_kind.split(":")[0]):
        (y, h), = lightning_predict(q, [x])  # first call of this shape: under inference_mode
        assert y.is_inference() and torch.equal(y, want_y) and torch.equal(h, want_h)
        for ctx in (torch.no_grad, torch.enable_grad, torch.no_grad):  # the issue: this raised
            with ctx():
                y2, h2 = q(x)
            assert torch.equal(y2, want_y) and torch.equal(h2, want_h) and not y2.is_inference()
        # a state from inference_mode passed back as h0 outside it (streaming after a predict)
        with torch.no_grad():
            a, h_a = q(x[:, :11])
            b, _ = q(x[:, 11:], h_a)
        with torch.inference_mode():
            _, h_i = q(x[:, :11])
        with torch.no_grad():
            b2, _ = q(x[:, 11:], h_i)
        assert torch.equal(b, b2) and torch.equal(b, want_y[:, 11:])


def test_cpu_quantize_buffers_are_never_inference_tensors():
    """The cpu boundary's reused quantize buffers (and the layer's output buffer) are made outside
    inference mode: a buffer first made under inference_mode is handed out, and writable, later."""
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")
    from qgru import native
    mod = native.load("cpu")
    x = torch.randn(7, 5, 3)
    with torch.inference_mode():
        q_inf = mod.quantize(x, 0.05, 3, 8, "input")
    want = q_inf.clone()
    del q_inf  # its buffer may now be reused
    q = mod.quantize(x, 0.05, 3, 8, "input")
    assert not q.is_inference() and torch.equal(q, want)
    q.add_(1)


# =============================================================================================
# 2. A library's own GRU class (pytorch-forecasting: `class GRU(RNN, nn.GRU)`, forward(lengths=))
# =============================================================================================
from abc import ABC, abstractmethod  # noqa: E402

from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence  # noqa: E402


class LibRNN(ABC, nn.RNNBase):
    """pytorch-forecasting's pattern: an abstract mixin over nn.RNNBase whose forward takes
    ``lengths=`` and packs the input itself, calling ``super().forward``."""

    @abstractmethod
    def init_hidden_state(self, x: torch.Tensor) -> torch.Tensor:
        ...

    def forward(self, x, hx=None, lengths=None, enforce_sorted: bool = True):
        if isinstance(x, PackedSequence) or lengths is None:
            return super().forward(x, hx=hx)
        if int(lengths.max()) == 0:
            return torch.zeros(*x.shape[:2], self.hidden_size), self.init_hidden_state(x)
        packed = pack_padded_sequence(x, lengths.clamp(min=1).cpu(), batch_first=self.batch_first,
                                      enforce_sorted=enforce_sorted)
        out, h = super().forward(packed, hx=hx)
        out, _ = pad_packed_sequence(out, batch_first=self.batch_first, total_length=x.shape[1])
        return out, h


class LibGRU(LibRNN, nn.GRU):
    def init_hidden_state(self, x):
        n = x.shape[0] if self.batch_first else x.shape[1]
        return torch.zeros(self.num_layers, n, self.hidden_size, device=x.device)

    def repeat_interleave(self, h: torch.Tensor, n_samples: int) -> torch.Tensor:
        return h.repeat_interleave(n_samples, 1)


class DeepARLike(nn.Module):
    """Encoder with lengths, then a decoder that samples n paths step by step from repeated states."""

    def __init__(self):
        super().__init__()
        self.rnn = LibGRU(2, 12, num_layers=2, batch_first=True)
        self.rnn.note = "kept"  # an attribute the library set on its module
        self.head = nn.Linear(12, 2)

    def forward(self, x, lengths):
        out, h = self.rnn(x, lengths=lengths, enforce_sorted=False)
        return self.head(out), h

    def sample(self, x, lengths, n_samples: int, steps: int, generator: torch.Generator):
        _, h = self.rnn(x, lengths=lengths, enforce_sorted=False)
        h = self.rnn.repeat_interleave(h, n_samples)
        last = x[torch.arange(x.shape[0]), lengths - 1].repeat_interleave(n_samples, 0).unsqueeze(1)
        paths = []
        for _ in range(steps):
            out, h = self.rnn(last, h)
            mu, log_sigma = self.head(out).unbind(-1)
            y = mu + log_sigma.exp() * torch.randn(mu.shape, generator=generator)
            last = torch.stack([y, mu], dim=-1)
            paths.append(y)
        return torch.cat(paths, dim=1)


def _lib_batches(n: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 9, 2, generator=g), torch.tensor([9, 4, 7, 1, 9])) for _ in range(n)]


def test_quantize_model_keeps_a_gru_subclass_and_its_methods():
    torch.manual_seed(3)
    model = DeepARLike().eval()
    q = qgru.quantize_model(model, _lib_batches(), progress=False)
    rnn = q.rnn
    assert isinstance(rnn, LibGRU) and isinstance(rnn, qgru.QuantGRU) and rnn.is_converted
    assert type(rnn).__name__ == "QuantLibGRU" and rnn.note == "kept"
    assert type(model.rnn) is LibGRU and not hasattr(model.rnn, "qconfig")  # the original is untouched
    x, lengths = _lib_batches(1, seed=9)[0]
    with torch.no_grad():
        y_f, h_f = model(x, lengths)
        y_q, h_q = q(x, lengths)  # the library's forward, with lengths=: the TypeError
        with qgru.backend("reference"):  # the integer GRU ran: the golden model gives the same bits
            y_r, h_r = q(x, lengths)
    assert torch.equal(y_q, y_r) and torch.equal(h_q, h_r)
    assert not torch.equal(h_q, h_f) and _sqnr(h_f, h_q) > 25.0
    # the same integer GRU as a plain QuantGRU with the same parameters, called as the library does
    plain = rnn.export().to_module()
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    assert torch.equal(plain(packed)[1], h_q)
    # sampling as DeepAR does: repeat_interleave of the state, then 1-step calls
    with torch.no_grad():
        paths_f = model.sample(x, lengths, 4, 6, torch.Generator().manual_seed(0))
        paths_q = q.sample(x, lengths, 4, 6, torch.Generator().manual_seed(0))
    assert paths_q.shape == (20, 6) and torch.isfinite(paths_q).all()
    assert _sqnr(paths_f, paths_q) > 15.0


def test_a_bare_gru_subclass_and_an_unconverted_one_behave_as_the_float_one():
    torch.manual_seed(4)
    gru = LibGRU(2, 6, batch_first=True).eval()
    x, lengths = _lib_batches(1)[0]
    kw = dict(lengths=lengths, enforce_sorted=False)
    prepared = qgru.prepare_model(gru)  # float mode: exactly the library's module
    assert isinstance(prepared, qgru.QuantGRU) and not prepared.is_converted
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(prepared(x, **kw), gru(x, **kw)))
    q = qgru.quantize_model(gru, [b[0] for b in _lib_batches()], progress=False)  # called as gru(x)
    assert isinstance(q, LibGRU) and q.is_converted
    with torch.no_grad():
        assert _sqnr(gru(x, **kw)[1], q(x, **kw)[1]) > 25.0


class BypassGRU(nn.GRU):
    """A subclass that runs torch's GRU itself instead of through super().forward."""

    def forward(self, x, hx=None):
        return nn.GRU.forward(self, x, hx)


def test_a_subclass_that_bypasses_super_forward_is_an_error_not_a_float_model():
    model = nn.Sequential(BypassGRU(2, 4))
    with pytest.raises(TypeError, match=r"BypassGRU.*never reached QuantGRU's.*super\(\)\.forward"):
        qgru.quantize_model(model, [torch.randn(3, 2, 2)], progress=False)


def test_quantized_subclass_model_pickles_and_deep_copies():
    """darts saves whole models with torch.save, Lightning deep-copies them: a converted model that
    has run on a native backend (which caches its native layers) and a class made for a library's
    GRU subclass both survive, with the same outputs bit for bit."""
    import copy
    import io
    torch.manual_seed(5)
    q = qgru.quantize_model(DeepARLike().eval(), _lib_batches(), progress=False)
    x, lengths = _lib_batches(1, seed=2)[0]
    with torch.no_grad():
        want = q(x, lengths)  # builds the native layers where a native backend runs
        buf = io.BytesIO()
        torch.save(q, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        for other in (loaded, copy.deepcopy(q)):
            assert type(other.rnn) is type(q.rnn) and other.rnn.is_converted
            got = other(x, lengths)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# =============================================================================================
# 6. save and load through state_dict (the libraries' checkpoints)
# =============================================================================================
class Seq2Seq(nn.Module):
    """Two GRUs (one bidirectional, two layers, fed packed sequences) and a head."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.GRU(3, 6, num_layers=2, bidirectional=True)
        self.decoder = nn.GRU(12, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x, lengths):
        enc, _ = self.encoder(pack_padded_sequence(x, lengths, enforce_sorted=False))
        enc, _ = pad_packed_sequence(enc)
        out, h = self.decoder(enc.transpose(0, 1))
        return self.head(out), h


def _s2s_batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(7, 4, 3, generator=g), torch.tensor([7, 3, 5, 1])) for _ in range(n)]


def _plain_types(v) -> bool:
    if isinstance(v, dict):
        return all(isinstance(k, str) and _plain_types(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return all(_plain_types(x) for x in v)
    return isinstance(v, (torch.Tensor, int, float, str, bool)) or v is None


def _saved_and_loaded(sd):
    import io
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # tensors and plain containers only


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same_state(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("config, mode", [("w8a8", "pow2"), ("w8a16", "multiplier"), ("w16a16", "pow2")])
def test_quantized_state_dict_round_trips_bit_for_bit(config, mode):
    torch.manual_seed(6)
    model = Seq2Seq().eval()
    cfg = qgru.QuantConfig.load(config, overrides={"scale_mode": mode})
    q = qgru.quantize_model(model, _s2s_batches(), config=cfg, progress=False)
    sd = q.state_dict()
    assert _plain_types(sd["encoder._extra_state"]) and _plain_types(sd["decoder._extra_state"])
    # a fresh model of the library's class, its GRUs made QuantGRUs (float), loads it strictly
    fresh = qgru.prepare_model(Seq2Seq())  # any config: the saved one comes with the state
    fresh.load_state_dict(_saved_and_loaded(sd))
    assert fresh.encoder.is_converted and fresh.decoder.is_converted
    assert fresh.encoder.qconfig.to_dict() == cfg.to_dict()
    _assert_same_state(fresh.state_dict(), sd)
    for x, lengths in _s2s_batches(2, seed=1):
        with torch.no_grad():
            want, got = q(x, lengths), fresh(x, lengths)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    # the calibration record came along: compare still names what calibration saw
    report = qgru.compare(model, fresh, _s2s_batches(1, seed=2), verbose=False, progress=False)
    assert report.row("x", module="encoder")["calib_clip"] is not None


def test_quantized_state_dict_into_a_float_model_fails_loudly():
    torch.manual_seed(7)
    model = Seq2Seq().eval()
    q = qgru.quantize_model(model, _s2s_batches(), progress=False)
    sd = _saved_and_loaded(q.state_dict())
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "encoder\._extra_state", '
                                           r'"decoder\._extra_state"'):
        Seq2Seq().load_state_dict(sd)  # the library's own reload: nn.GRU, strict
    # a float state_dict into a converted model: its integer parameters are missing (strict)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "encoder\._extra_state"'):
        q.load_state_dict(model.state_dict())
    # and a float QuantGRU's state_dict is nn.GRU's, key for key, both ways
    f = qgru.prepare_model(model)
    assert list(f.state_dict()) == list(model.state_dict())
    f.load_state_dict(model.state_dict())
    model.load_state_dict(f.state_dict())


def test_quantized_state_dict_needs_the_same_constructor_arguments():
    torch.manual_seed(8)
    q = qgru.quantize_model(nn.GRU(3, 6, num_layers=2), [torch.randn(5, 2, 3)], progress=False)
    sd = q.state_dict()
    other = qgru.QuantGRU(3, 6, num_layers=2, batch_first=True)
    with pytest.raises(RuntimeError, match=r"built with other arguments: batch_first=False \(this module: True\)"):
        other.load_state_dict(sd)
    with pytest.raises(RuntimeError, match="not a qgru.QuantGRU state"):
        qgru.QuantGRU(3, 6, num_layers=2).load_state_dict({**sd, "_extra_state": {"format": "other"}})


def test_quantized_gru_subclass_state_dict_round_trips():
    torch.manual_seed(9)
    q = qgru.quantize_model(DeepARLike().eval(), _lib_batches(), progress=False)
    fresh = qgru.prepare_model(DeepARLike())
    fresh.load_state_dict(_saved_and_loaded(q.state_dict()))
    assert isinstance(fresh.rnn, LibGRU) and fresh.rnn.is_converted
    x, lengths = _lib_batches(1, seed=3)[0]
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(q(x, lengths), fresh(x, lengths)))



def test_quantized_state_dict_holds_tensors_only():
    # issue 31: safetensors (and libraries saving through it) refused the dict '_extra_state'
    torch.manual_seed(6)
    q = qgru.quantize_model(Seq2Seq().eval(), _s2s_batches(), progress=False)
    sd = q.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values()), {k: type(v) for k, v in sd.items()}
    assert sd["encoder._extra_state"].dtype == torch.uint8 and sd["encoder._extra_state"].dim() == 1


@pytest.mark.parametrize("config", ["w8a8", "w8a16", "w8a8-levels"])
def test_quantized_state_dict_round_trips_through_safetensors(tmp_path, config):
    st = pytest.importorskip("safetensors.torch")
    if config == "w8a8-levels":  # x levels (docs/spec.md section 4b), run by the reference backend
        config = qgru.QuantConfig.load("w8a8", overrides={"tensors": {"x": {"dynamic": True},
                                                                      "h_gemm": {"dynamic": True}}})
        with qgru.backend("reference"):
            return _safetensors_round_trip(tmp_path, config, st)
    _safetensors_round_trip(tmp_path, config, st)


def _safetensors_round_trip(tmp_path, config, st):
    torch.manual_seed(6)
    model = Seq2Seq().eval()
    q = qgru.quantize_model(model, _s2s_batches(), config=config, progress=False)
    path = tmp_path / "model.safetensors"
    st.save_file(q.state_dict(), str(path))
    fresh = qgru.prepare_model(Seq2Seq())
    fresh.load_state_dict(st.load_file(str(path)))
    assert fresh.encoder.is_converted and fresh.decoder.qconfig.to_dict() == q.decoder.qconfig.to_dict()
    if q.encoder.qconfig["x"].dynamic:
        assert torch.equal(fresh.encoder._qparams[0][0].x_levels.b_x, q.encoder._qparams[0][0].x_levels.b_x)
    _assert_same_state(fresh.state_dict(), q.state_dict())
    for x, lengths in _s2s_batches(2, seed=1):
        with torch.no_grad():
            assert _same(q(x, lengths), fresh(x, lengths))
    report = qgru.compare(model, fresh, _s2s_batches(1, seed=2), verbose=False, progress=False)
    assert report.row("x", module="encoder")["calib_clip"] is not None  # the calibration record came too
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "encoder\._extra_state", '
                                           r'"decoder\._extra_state"'):
        Seq2Seq().load_state_dict(st.load_file(str(path)))  # a float model refuses it


def test_quantized_state_dict_bytes_are_checked_and_the_dict_form_still_loads():
    from qgru.export import ParamsFileError
    torch.manual_seed(8)
    q = qgru.quantize_model(nn.GRU(3, 6, num_layers=2), [torch.randn(5, 2, 3)], progress=False)
    sd = q.state_dict()
    blob = sd["_extra_state"]

    def load(extra):
        m = qgru.QuantGRU(3, 6, num_layers=2)
        m.load_state_dict({**sd, "_extra_state": extra})
        return m

    x = torch.randn(4, 2, 3)
    assert torch.equal(load(blob.clone())(x)[0], q(x)[0])
    with pytest.raises(ParamsFileError, match="uint8"):
        load(blob.to(torch.int16))
    with pytest.raises(ParamsFileError, match="uint8"):
        load(torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ParamsFileError, match="zip archive"):
        load(blob[: blob.numel() // 2].clone())  # truncated
    bad = blob.clone()
    bad[blob.numpy().tobytes().index(b"l0.fwd.rescale")] ^= 0x10  # one flipped bit inside a record
    with pytest.raises(ParamsFileError):
        load(bad)
    # the parameters inside are checked as a .qgru file's are (checksum, every field)
    import io
    d = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
    d["params"]["l0.fwd.W"] = d["params"]["l0.fwd.W"].clone()
    d["params"]["l0.fwd.W"][0, 0] += 1
    buf = io.BytesIO()
    torch.save(d, buf)
    with pytest.raises(ParamsFileError, match="checksum"):
        load(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    d = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
    d["calibration"] = {"no such entry": torch.zeros(1)}
    buf = io.BytesIO()
    torch.save(d, buf)
    with pytest.raises(ParamsFileError, match="calibration record"):
        load(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    # a state_dict saved by qgru before (the dict itself as '_extra_state', torch.save) still loads
    old = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
    m = load(old)
    assert m.is_converted and torch.equal(m(x)[0], q(x)[0]) and m._calib.keys() == q._calib.keys()


def test_a_gru_subclass_named_gru_is_not_named_quantgru():
    # issue 31: a library's ``class GRU(nn.GRU)`` became a class named QuantGRU, as qgru's own
    GRU = type("GRU", (nn.GRU,), {"__module__": "some_lib.nn.rnn"})
    q = qgru.quantize_model(nn.Sequential(GRU(2, 3)), [torch.randn(4, 1, 2)], progress=False)
    name = type(q[0]).__name__
    assert isinstance(q[0], GRU) and isinstance(q[0], qgru.QuantGRU) and q[0].is_converted
    assert name != "QuantGRU" and name == "QuantSomeLibGRU"
    assert repr(q).count("QuantSomeLibGRU(2, 3") == 1

# =============================================================================================
# 5. TorchScript, torch.compile, torch.export
# =============================================================================================
from typing import Optional  # noqa: E402


class ScriptedWrapper(nn.Module):
    """A model a library scripts: the GRU called with and without h0."""

    def __init__(self, gru: nn.GRU):
        super().__init__()
        self.gru = gru

    def forward(self, x: torch.Tensor, h: Optional[torch.Tensor] = None):
        out, h_n = self.gru(x, h)
        return out, h_n


class PackedWrapper(nn.Module):
    def __init__(self, gru: nn.GRU):
        super().__init__()
        self.gru = gru

    def forward(self, x: PackedSequence):
        out, h_n = self.gru(x)
        return out.data, h_n


class WaveRNNLike(nn.Module):
    """torchaudio's WaveRNN: traced with torch.jit.trace, it has an @torch.jit.export method (infer)
    that TorchScript compiles, GRU call included."""

    def __init__(self, gru: nn.GRU):
        super().__init__()
        self.rnn = gru
        self.fc = nn.Linear(gru.hidden_size, 1)

    def forward(self, x):
        return self.fc(self.rnn(x)[0])

    @torch.jit.export
    def infer(self, x: torch.Tensor, steps: int) -> torch.Tensor:
        h = torch.zeros(1, x.shape[0], self.rnn.hidden_size)
        outs = []
        for t in range(steps):
            out, h = self.rnn(x[:, t:t + 1], h)
            outs.append(self.fc(out))
        return torch.cat(outs, dim=1)


def _same(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("batch_first", [False, True])
def test_float_quantgru_scripts_wherever_nn_gru_does(batch_first):
    import io
    torch.manual_seed(10)
    gru = nn.GRU(4, 5, num_layers=2, bidirectional=True, batch_first=batch_first)
    q = qgru.QuantGRU.from_float(gru)
    n = 3
    x = torch.randn(n, 6, 4) if batch_first else torch.randn(6, n, 4)
    h0 = torch.randn(4, n, 5)
    ref, scripted = ScriptedWrapper(gru), torch.jit.script(ScriptedWrapper(q))
    for args in ((x,), (x, h0), (x[0] if batch_first else x[:, 0],)):  # batched, with h0, unbatched
        assert _same(scripted(*args), ref(*args))
    lengths = torch.tensor([6, 2, 4])
    packed = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)
    assert _same(torch.jit.script(PackedWrapper(q))(packed), PackedWrapper(gru)(packed))
    buf = io.BytesIO()  # and it saves and loads like any script module
    torch.jit.save(scripted, buf)
    buf.seek(0)
    assert _same(torch.jit.load(buf)(x, h0), ref(x, h0))
    # the scripted module shares the parameters, as scripting nn.GRU does
    with torch.no_grad():
        q.weight_hh_l0.mul_(0.5)
        gru.weight_hh_l0.mul_(0.5)
    assert _same(scripted(x), ref(x))


def test_wavernn_pattern_scripts_and_traces_as_with_nn_gru():
    torch.manual_seed(11)
    gru = nn.GRU(2, 6, batch_first=True)
    model = WaveRNNLike(gru).eval()
    x = torch.randn(2, 5, 2)
    q = qgru.prepare_model(model)
    scripted = torch.jit.script(q)  # infer() is compiled, the QuantGRU calls in it included
    with torch.no_grad():
        assert torch.equal(scripted(x), model(x))
        assert torch.equal(scripted.infer(x, 5), model.infer(x, 5))
        traced = torch.jit.trace(ScriptedWrapper(q.rnn), (x,))  # a plain trace records nn.GRU's op
        assert _same(traced(x), gru(x))

    def outcome(m):
        try:
            t = torch.jit.trace(m, (x,))
        except RuntimeError as e:
            return type(e)
        with torch.no_grad():
            return t.infer(x, 5)

    # torch.jit.trace of a model with an @export method: whatever it does with nn.GRU (torch 2.13
    # cannot compile the GRU's overloaded forward there), it does with a QuantGRU
    want, got = outcome(model), outcome(q)
    assert want is got if isinstance(want, type) else torch.equal(got, want)


def test_converted_quantgru_refuses_tracing_naming_compile_and_export():
    torch.manual_seed(11)
    model = WaveRNNLike(nn.GRU(2, 6, batch_first=True)).eval()
    x = torch.randn(2, 5, 2)
    qc = qgru.quantize_model(model, [x], progress=False)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace.*torch\.compile.*torch\.export"):
        torch.jit.trace(ScriptedWrapper(qc.rnn), (x,))
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script.*torch\.compile.*torch\.export"):
        torch.jit.script(qc)


def test_tracing_a_model_with_an_exported_method_names_compile_and_export():
    # issue 31: torch.jit.trace of WaveRNN's pattern (an @torch.jit.export method) scripts the model
    # without __prepare_scriptable__; it failed with "Couldn't find method: 'forward__0'"
    torch.manual_seed(11)
    model = WaveRNNLike(nn.GRU(2, 6, batch_first=True)).eval()
    x = torch.randn(2, 5, 2)
    qc = qgru.quantize_model(model, [x], progress=False)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace: a converted .*QuantGRU cannot be TorchScript.*"
                                           r"torch\.compile\(model\) or torch\.export\.export"):
        torch.jit.trace(qc, (x,))
    # a library's GRU subclass, quantized, too
    sub = qgru.quantize_model(WaveRNNLike(LibGRU(2, 6, batch_first=True)).eval(), [x], progress=False)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace: .*torch\.compile"):
        torch.jit.trace(sub, (x,))


def test_converted_quantgru_refuses_torchscript_naming_compile_and_export():
    torch.manual_seed(12)
    q = qgru.quantize_model(ScriptedWrapper(nn.GRU(3, 4)), [torch.randn(5, 2, 3)], progress=False)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script: a converted .*QuantGRU cannot be TorchScript.*"
                                           r"torch\.compile\(model\) or torch\.export\.export"):
        torch.jit.script(q)
    assert type(q.gru) is qgru.QuantGRU  # scripting did not replace anything in the model
    m = qgru.QuantGRU(3, 4)
    m.start_calibration()  # calibrating: also refused (observers are Python)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script"):
        torch.jit.script(m)


class CompileNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(3, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        out, h = self.gru(x)
        return self.head(out), h


@pytest.fixture(scope="module")
def converted_net():
    torch.manual_seed(13)
    model = CompileNet().eval()
    return model, qgru.quantize_model(model, [torch.randn(4, 6, 3) for _ in range(2)], progress=False)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_is_bit_identical_to_eager(converted_net, backend):
    _, q = converted_net
    torch._dynamo.reset()
    compiled = torch.compile(q, backend=backend)
    with torch.no_grad():
        for shape in ((5, 7, 3), (5, 7, 3), (2, 4, 3)):
            x = torch.randn(*shape)
            assert _same(compiled(x), q(x)), shape


def _recording_backend():
    """A torch.compile backend that keeps every graph Dynamo hands it and runs it as is."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def test_torch_compile_without_allow_rnn_runs_the_module_eager(converted_net):
    """Without allow_rnn Dynamo refuses GRU modules and runs them as Python; QuantGRU then runs its
    forward eager under torch.compiler.disable. Before, Dynamo compiled each function that forward
    called on its own: 71 small graphs and 77 graph breaks for this model, ~50x slower than eager."""
    _, q = converted_net
    # torch's own patch, not monkeypatch.setattr: pytest >= 9.2's undo deletes a config entry that
    # torch's config module serves through __getattr__, and every later use of it then fails
    with torch._dynamo.config.patch(allow_rnn=False):
        torch._dynamo.reset()
        graphs, backend = _recording_backend()
        compiled = torch.compile(q, backend=backend)
        with torch.no_grad():
            for shape in ((5, 7, 3), (2, 4, 3)):
                x = torch.randn(*shape)
                assert _same(compiled(x), q(x)), shape
    qgru_code = [gm for gm in graphs if "qgru" in gm.code or any(
        "qgru" in str(n.meta.get("stack_trace", "")) for n in gm.graph.nodes)]
    assert not qgru_code, f"{len(qgru_code)} of {len(graphs)} graphs compiled from qgru's Python"
    torch._dynamo.reset()


def test_torch_compile_fullgraph_puts_the_custom_op_in_the_graph(converted_net):
    """torch.compile does not trace into GRU modules by default (it runs them as Python, and a
    converted QuantGRU runs eager: the test above); with allow_rnn it traces the QuantGRU whole,
    one graph around the custom op."""
    _, q = converted_net
    with torch._dynamo.config.patch(allow_rnn=True):  # not monkeypatch: see the test above
        torch._dynamo.reset()
        graphs, backend = _recording_backend()
        compiled = torch.compile(q, backend=backend, fullgraph=True)
        x = torch.randn(3, 5, 3)
        with torch.no_grad():
            assert _same(compiled(x), q(x))
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.qgru.integer_gru.default in targets or torch.ops.qgru.integer_gru in targets
    torch._dynamo.reset()


def test_torch_export_is_bit_identical_to_eager(converted_net):
    _, q = converted_net
    x = torch.randn(5, 7, 3)
    ep = torch.export.export(q, (x,))
    ops = {n.target for gm in ep.graph_module.modules() if isinstance(gm, torch.fx.GraphModule)
           for n in gm.graph.nodes if n.op == "call_function"}  # (any submodule: torch may wrap a region in a subgraph)
    assert torch.ops.qgru.integer_gru.default in ops
    with torch.no_grad():
        assert _same(ep.module()(x), q(x))
        x2 = torch.randn(5, 7, 3)
        assert _same(ep.module()(x2), q(x2))


def test_custom_op_passes_opcheck(converted_net):
    """torch.library.opcheck: schema, fake kernel (shapes and dtypes against the real one),
    autograd registration, AOT dispatch; with and without lengths."""
    _, q = converted_net
    params, spec = q.gru._op_params
    x, hx = torch.randn(6, 2, 3), torch.randn(4, 2, 8)
    for lengths in (None, torch.tensor([6, 3])):
        result = torch.library.opcheck(torch.ops.qgru.integer_gru.default, (x, hx, lengths, params, spec))
        assert all(v == "SUCCESS" for v in result.values()), result
    out, h_n = torch.ops.qgru.integer_gru(x, hx, None, params, spec)
    with torch.no_grad():
        want_out, want_h = q.gru(x.transpose(0, 1), hx)  # the module is batch_first
    assert torch.equal(out.transpose(0, 1), want_out) and torch.equal(h_n, want_h)
