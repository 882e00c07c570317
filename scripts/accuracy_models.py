#!/usr/bin/env python
"""Accuracy inside the model kinds of real libraries, rebuilt in plain torch: one table.

Eleven GRU models as six libraries build them (speechbrain, darts, neuralforecast,
pytorch-forecasting, torchaudio, asteroid), rebuilt without the libraries, each trained for a few
seconds (seeded, 1 thread) on realistic synthetic data (sine/AR series with noise, audio-like
signals), calibrated with the library's own call pattern (autoregressive forecasters: a warm-up
call on the history, then many 1-step calls carrying h, in time order) on training data, and
evaluated on held-out data: output SQNR (dB) against the float model for torch's dynamic-quant GRU
and qgru's configs, every GRU swapped (qgru.prepare_model + calibrate + convert, as quantize_model).
Two more rows: the drift stand-in (drift_case: a forecaster calibrated on the early part
of series whose amplitude grows, evaluated on the late part, test inputs 1.75x and 2.1x the
calibration range here). Column "x levels": w8a8 with x.dynamic and h_gemm.dynamic (docs/spec.md
section 4b; run on the reference backend until the native backends run it). docs/accuracy.md holds the table.

    python scripts/accuracy_models.py --backend reference --study   # docs/accuracy.md's table (~10 min)
    python scripts/accuracy_models.py                  # without the Wx-headroom study columns
    python scripts/accuracy_models.py --only darts     # models whose name contains "darts"
    python scripts/accuracy_models.py --seed 1         # every model trained from another seed
    python scripts/accuracy_models.py --compare NAME   # + qgru.compare of the default w8a8 on model NAME
"""
from __future__ import annotations

import argparse
import contextlib
import math
import platform
import time
import zlib
from typing import Callable

import torch
from torch import nn

import qgru
from qgru.backends import forced_backend_name
from qgru.native import cpu_model_name
from qgru.demo import dynamic_quant
from qgru.module import QuantGRU

NEAREST = {"weight_rounding": "nearest"}
# x in 16 bits over 4x its calibrated range (inputs beyond the calibration range; W.x int8 x int16)
X16 = {"tensors": {"x": {"bits": 16, "symmetric": False, "headroom": 4.0, "dynamic": False}}}
# x levels and state-derived GEMM operands (docs/spec.md section 4b): each token of the
# first layer's x on the first of 13 grids (calibrated range x 2^(e/4), e = 0..12) that holds it
DYN = {"tensors": {"x": {"dynamic": True}, "h_gemm": {"dynamic": True}}}
STATIC = {"tensors": {"x": {"dynamic": False}, "h_gemm": {"dynamic": False}}}  # one calibrated grid each
# w8a8 before 2026-11-25: an 8-bit state that R.h reads directly (no h_gemm)
STATE8 = {"tensors": {"h": {"bits": 8, "headroom": 1.0}, "h_gemm": None}}
COLUMNS = [  # (column, config, overrides)
    ("w8a8 static", "w8a8", STATIC),  # 8-bit x on one grid, 16-bit state, 8-bit h_gemm, multiplier, mse, gptq
    ("w8a8 x levels", "w8a8", DYN),  # x.dynamic + h_gemm.dynamic
    ("w8a8 16-bit x (headroom 4)", "w8a8", X16),  # for inputs beyond the calibration range
    ("w8a8 pow2", "w8a8", {"scale_mode": "pow2"}),  # the other scale mode
    ("w8a8 8-bit state (before)", "w8a8", STATE8),  # the default before h_gemm
    ("w8a16 default", "w8a16", {}),
]
# --study: x levels with W.x's grid widened (W.x grows with x: Wx has headroom 1.5 in w8a8)
STUDY = [
    (f"w8a8 x levels, Wx headroom {h}", "w8a8",
     {"tensors": {**DYN["tensors"], "Wx": {"headroom": h}}})
    for h in (2.0, 3.0)
]


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    err = float((out - ref).pow(2).sum())
    return math.inf if err == 0 else 10 * math.log10(float(ref.pow(2).sum()) / err)


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def series(n: int, T: int, g: torch.Generator) -> torch.Tensor:
    """[n, T] sine mixtures (periods 12-40 steps, a slow trend) with AR(1) noise: forecasting data."""
    t = torch.arange(T, dtype=torch.float32)
    p1, p2 = 12 + 28 * torch.rand(n, 1, generator=g), 6 + 10 * torch.rand(n, 1, generator=g)
    ph = 2 * math.pi * torch.rand(n, 2, generator=g)
    y = torch.sin(2 * math.pi * t / p1 + ph[:, :1]) + 0.4 * torch.sin(2 * math.pi * t / p2 + ph[:, 1:])
    y = y * (0.5 + torch.rand(n, 1, generator=g)) + 0.3 * torch.randn(n, 1, generator=g) + 0.002 * t
    e = 0.1 * torch.randn(n, T, generator=g)
    for i in range(1, T):  # AR(1) noise
        e[:, i] += 0.6 * e[:, i - 1]
    return y + e


def audio(n: int, T: int, g: torch.Generator, f_lo: float = 0.01, f_hi: float = 0.08) -> torch.Tensor:
    """[n, T] audio-like signal: a harmonic tone with vibrato and a decaying envelope, plus noise."""
    t = torch.arange(T, dtype=torch.float32)
    f0 = f_lo + (f_hi - f_lo) * torch.rand(n, 1, generator=g)
    phase = 2 * math.pi * torch.cumsum(f0 * (1 + 0.02 * torch.sin(2 * math.pi * t / 200)), 1)
    env = torch.exp(-t / (T * (0.5 + torch.rand(n, 1, generator=g))))
    x = env * (torch.sin(phase) + 0.5 * torch.sin(2 * phase) + 0.25 * torch.sin(3 * phase))
    return 0.5 * x + 0.02 * torch.randn(n, T, generator=g)


def class_features(n: int, T: int, F: int, C: int, g: torch.Generator):
    """([n, T, F] spectrogram-like features, [n] class, [n, T] frame class): each class excites its
    own band, with a class-dependent temporal modulation and noise."""
    y = torch.randint(0, C, (n,), generator=g)
    f = torch.arange(F, dtype=torch.float32)
    t = torch.arange(T, dtype=torch.float32)
    centre = (y.float() + 0.5) * F / C
    band = torch.exp(-((f - centre.view(n, 1)) ** 2) / 8).unsqueeze(1)  # [n, 1, F]
    mod = 1 + 0.5 * torch.sin(2 * math.pi * t.view(1, T) * (y.float().view(n, 1) + 1) / T).unsqueeze(2)
    x = torch.log1p(3 * band * mod + 0.3 * torch.rand(n, T, F, generator=g))
    frame_y = y.view(n, 1).expand(n, T).clone()
    frame_y[:, : T // 5] = C  # a "silence" class at the start
    x[:, : T // 5] = torch.log1p(0.3 * torch.rand(n, T // 5, F, generator=g))
    return x, y, frame_y


def fit(model: nn.Module, loss_fn: Callable[[], torch.Tensor], steps: int, lr: float = 1e-2) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


# ---------------------------------------------------------------------------------------------
# the models (names as the libraries', shapes scaled down to train in seconds)
# ---------------------------------------------------------------------------------------------
class SBGRUClassifier(nn.Module):
    """speechbrain nnet.RNN.GRU (2-layer bidirectional, batch_first) + mean pooling + linear."""

    def __init__(self, F=20, H=64, C=5):
        super().__init__()
        self.rnn = nn.GRU(F, H, num_layers=2, bidirectional=True, batch_first=True)
        self.out = nn.Linear(2 * H, C)

    def forward(self, x):
        return self.out(self.rnn(x)[0].mean(1))


class CRDNN(nn.Module):
    """speechbrain CRDNN: CNN blocks (conv, layer norm, LeakyReLU), a 2-layer biGRU, DNN blocks
    (linear, batch norm, LeakyReLU), per-frame outputs."""

    def __init__(self, F=40, ch=32, H=64, C=6):
        super().__init__()
        self.cnn = nn.Sequential(nn.Conv1d(F, ch, 3, padding=1), nn.GroupNorm(1, ch), nn.LeakyReLU(),
                                 nn.Conv1d(ch, ch, 3, padding=1), nn.GroupNorm(1, ch), nn.LeakyReLU())
        self.rnn = nn.GRU(ch, H, num_layers=2, bidirectional=True, batch_first=True)
        self.dnn = nn.Sequential(nn.Linear(2 * H, 64), nn.BatchNorm1d(64), nn.LeakyReLU())
        self.out = nn.Linear(64, C)

    def forward(self, x):
        h = self.cnn(x.transpose(1, 2)).transpose(1, 2)
        h = self.rnn(h)[0]
        N, T, D = h.shape
        return self.out(self.dnn(h.reshape(N * T, D))).reshape(N, T, -1)


class StepRNN(nn.Module):
    """A GRU + linear head run one step at a time (darts RNNModel, neuralforecast recurrent=True,
    pytorch-forecasting RecurrentNetwork / DeepAR): inputs [N, T, I] -> outputs [N, T, O], state."""

    def __init__(self, I, H, O, layers=1):
        super().__init__()
        self.rnn = nn.GRU(I, H, num_layers=layers, batch_first=True)
        self.head = nn.Linear(H, O)

    def forward(self, x, h=None):
        o, h = self.rnn(x, h)
        return self.head(o), h


def time_features(T0: int, T: int, N: int) -> torch.Tensor:
    t = torch.arange(T0, T0 + T, dtype=torch.float32)
    return torch.stack([torch.sin(2 * math.pi * t / 24), torch.cos(2 * math.pi * t / 24)], -1).expand(N, T, 2)


def rollout(model: StepRNN, history: torch.Tensor, steps: int, covariates: bool = False,
            sample_noise: torch.Tensor = None) -> torch.Tensor:
    """Autoregressive forecast: one call over the history (teacher forcing), then ``steps`` 1-step
    calls carrying h, each fed the previous prediction (the mean; with ``sample_noise`` [N, steps],
    a sample mu + sigma * noise, as DeepAR's sampling). Returns the predictions [N, steps]."""
    N, L = history.shape
    inp = history.unsqueeze(-1)
    if covariates:
        inp = torch.cat([inp, time_features(0, L, N)], -1)
    out, h = model(inp)
    preds = []
    y = out[:, -1]
    for i in range(steps):
        mu = y[:, 0]
        v = mu if sample_noise is None else mu + nn.functional.softplus(y[:, 1]) * sample_noise[:, i]
        preds.append(v)
        inp = v.view(N, 1, 1)
        if covariates:
            inp = torch.cat([inp, time_features(L + i, 1, N)], -1)
        out, h = model(inp, h)
        y = out[:, -1]
    return torch.stack(preds, 1)


def train_step_model(model: StepRNN, data: torch.Tensor, covariates: bool, gaussian: bool, steps: int):
    """Teacher forcing: predict x[t+1] from x[<=t] (Gaussian NLL for DeepAR)."""
    N, T = data.shape
    inp = data[:, :-1].unsqueeze(-1)
    if covariates:
        inp = torch.cat([inp, time_features(0, T - 1, N)], -1)
    target = data[:, 1:]

    def loss():
        out = model(inp)[0]
        if gaussian:
            sigma = nn.functional.softplus(out[..., 1]) + 1e-3
            return nn.functional.gaussian_nll_loss(out[..., 0], target, sigma ** 2)
        return nn.functional.mse_loss(out[..., 0], target)
    return fit(model, loss, steps)


class BlockRNN(nn.Module):
    """darts BlockRNNModel: a GRU encoder over the input chunk, its last output -> the whole output chunk."""

    def __init__(self, H=32, out_len=12, layers=2):
        super().__init__()
        self.rnn = nn.GRU(1, H, num_layers=layers, batch_first=True)
        self.fc = nn.Linear(H, out_len)

    def forward(self, x):
        return self.fc(self.rnn(x.unsqueeze(-1))[0][:, -1])


class NFGRU(nn.Module):
    """neuralforecast GRU (recurrent=False): a 2-layer GRU encoder over the window, a context
    vector per horizon step from its last state, an MLP decoder per step."""

    def __init__(self, H=64, horizon=12, ctx=10):
        super().__init__()
        self.h, self.ctx = horizon, ctx
        self.rnn = nn.GRU(1, H, num_layers=2, batch_first=True)
        self.context = nn.Linear(H, horizon * ctx)
        self.mlp = nn.Sequential(nn.Linear(ctx, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        c = self.context(self.rnn(x.unsqueeze(-1))[0][:, -1]).view(-1, self.h, self.ctx)
        return self.mlp(torch.relu(c)).squeeze(-1)


class WaveRNNLike(nn.Module):
    """torchaudio WaveRNN's recurrent core: a GRU over [previous sample, upsampled conditioning
    features] per audio sample, two linear layers to 256 mu-law classes; generation runs 1-step calls."""

    def __init__(self, cond=8, H=96, classes=256):
        super().__init__()
        self.rnn = nn.GRU(1 + cond, H, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(H, 128), nn.Linear(128, classes)

    def forward(self, x, h=None):
        o, h = self.rnn(x, h)
        return self.fc2(torch.relu(self.fc1(o))), h


def mulaw_class(x: torch.Tensor) -> torch.Tensor:
    y = torch.sign(x) * torch.log1p(255 * x.abs().clamp(max=1)) / math.log(256)
    return ((y + 1) / 2 * 255).round().long().clamp(0, 255)


def conditioning(wav: torch.Tensor, cond: int = 8, hop: int = 16) -> torch.Tensor:
    """Frame features (band energies of each hop-long frame), upsampled back to samples: [N, T, cond]."""
    N, T = wav.shape
    frames = wav[:, : T // hop * hop].reshape(N, -1, hop)
    spec = torch.fft.rfft(frames, dim=-1).abs()[..., 1:1 + cond]
    feat = torch.log1p(spec)
    return feat.repeat_interleave(hop, 1)[:, :T] if feat.shape[1] * hop >= T else \
        nn.functional.pad(feat.repeat_interleave(hop, 1), (0, 0, 0, T - feat.shape[1] * hop))


def wavernn_inputs(wav: torch.Tensor) -> torch.Tensor:
    prev = nn.functional.pad(wav[:, :-1], (1, 0)).unsqueeze(-1)
    return torch.cat([prev, conditioning(wav)], -1)


def one_step_calls(model, x: torch.Tensor) -> torch.Tensor:
    """WaveRNN's generation call pattern (teacher-forced, so that float and quantized runs see the
    same inputs): one call per sample, h carried."""
    h, outs = None, []
    for t in range(x.shape[1]):
        o, h = model(x[:, t:t + 1], h)
        outs.append(o)
    return torch.cat(outs, 1)


class DPRNNBlock(nn.Module):
    def __init__(self, D, H):
        super().__init__()
        self.intra = nn.GRU(D, H, batch_first=True, bidirectional=True)
        self.intra_fc, self.intra_norm = nn.Linear(2 * H, D), nn.GroupNorm(1, D)
        self.inter = nn.GRU(D, H, batch_first=True, bidirectional=True)
        self.inter_fc, self.inter_norm = nn.Linear(2 * H, D), nn.GroupNorm(1, D)

    def forward(self, x):  # [B, D, K, S]
        B, D, K, S = x.shape
        y = x.permute(0, 3, 2, 1).reshape(B * S, K, D)  # along each chunk
        y = self.intra_fc(self.intra(y)[0]).reshape(B, S, K, D).permute(0, 3, 2, 1)
        x = x + self.intra_norm(y)
        y = x.permute(0, 2, 3, 1).reshape(B * K, S, D)  # across chunks
        y = self.inter_fc(self.inter(y)[0]).reshape(B, K, S, D).permute(0, 3, 1, 2)
        return x + self.inter_norm(y)


class DPRNNLike(nn.Module):
    """asteroid DPRNNTasNet with GRU: conv encoder, chunking (50% overlap), dual-path biGRU blocks,
    masks per source, transposed-conv decoder."""

    def __init__(self, D=32, H=32, K=16, sources=2, blocks=2, kernel=8):
        super().__init__()
        self.K, self.sources = K, sources
        self.enc = nn.Conv1d(1, D, kernel, stride=kernel // 2, bias=False)
        self.blocks = nn.Sequential(*[DPRNNBlock(D, H) for _ in range(blocks)])
        self.mask = nn.Conv1d(D, sources * D, 1)
        self.dec = nn.ConvTranspose1d(D, 1, kernel, stride=kernel // 2, bias=False)

    def forward(self, wav):  # [B, T] -> [B, sources, T']
        w = torch.relu(self.enc(wav.unsqueeze(1)))  # [B, D, L]
        B, D, L = w.shape
        K, hop = self.K, self.K // 2
        pad = (-(L - K)) % hop + hop
        wp = nn.functional.pad(w, (hop, pad))
        chunks = wp.unfold(2, K, hop).permute(0, 1, 3, 2)  # [B, D, K, S]
        y = self.blocks(chunks)
        S = y.shape[-1]
        folded = nn.functional.fold(y.reshape(B, D * K, S), (1, wp.shape[-1]), (1, K), stride=(1, hop))
        y = folded.reshape(B, D, -1)[..., hop:hop + L]
        m = torch.relu(self.mask(y)).view(B, self.sources, D, L)
        return self.dec((m * w.unsqueeze(1)).reshape(B * self.sources, D, L)).view(B, self.sources, -1)


def growing_series(n: int, T: int, g: torch.Generator, grow: float = 3.0) -> torch.Tensor:
    """[n, T] forecasting data whose amplitude grows linearly, 1x at t=0 to ``grow``x at t=T (the drift
    stand-in: sunspots at a new peak, a trending target scaled by statistics of its past): sine mixtures
    with AR(1) noise, scaled."""
    t = torch.arange(T, dtype=torch.float32)
    p1, p2 = 12 + 28 * torch.rand(n, 1, generator=g), 5 + 6 * torch.rand(n, 1, generator=g)
    ph = 2 * math.pi * torch.rand(n, 2, generator=g)
    y = torch.sin(2 * math.pi * t / p1 + ph[:, :1]) + 0.4 * torch.sin(2 * math.pi * t / p2 + ph[:, 1:])
    e = 0.1 * torch.randn(n, T, generator=g)
    for i in range(1, T):
        e[:, i] += 0.6 * e[:, i - 1]
    return (y + e) * (1 + (grow - 1) * t / T)


def drift_case(g: torch.Generator, grow: float = 3.0) -> "Case":
    """The drift stand-in (no library needed): a darts-BlockRNN-like forecaster (2-layer
    GRU over a 48-step window, the next 12 steps from its last output) trained and calibrated on
    the early part of series whose amplitude grows (1x to ``grow``x), evaluated on the late part:
    with grow=3 its inputs reach about 1.75-1.85x the largest calibration input (``drift_ratio``;
    it depends on the seed), with grow=5 about 2.1-2.2x."""
    s = growing_series(64, 400, g, grow)
    win = s.unfold(1, 60, 10)  # [n, 35 windows, 60], window w starts at 10 w
    xin, yout = win[..., :48], win[..., 48:]
    early, late = slice(0, 10), slice(23, 35)  # windows inside t < 150 (amplitude <= 2.1x) / t >= 230
    x_tr, y_tr = xin[:, early].reshape(-1, 48), yout[:, early].reshape(-1, 12)
    m = BlockRNN(H=32)
    pick = lambda: torch.randint(0, x_tr.shape[0], (128,), generator=g)
    fit(m, lambda: (lambda i: nn.functional.mse_loss(m(x_tr[i]), y_tr[i]))(pick()), 60)
    case = Case("drift stand-in", m, list(x_tr.split(128)), [xin[:, late].reshape(-1, 48)])
    case.name = f"drift stand-in (BlockRNN, test inputs {drift_ratio(case):.2f}x calibration)"
    return case


def drift_ratio(case: "Case") -> float:
    """max |test input| / max |calibration input|."""
    return float(max(x.abs().max() for x in case.test) / max(x.abs().max() for x in case.calib))


# ---------------------------------------------------------------------------------------------
# the cases: (model, calibration inputs, test inputs, run(model, input) -> output)
# ---------------------------------------------------------------------------------------------
class Case:
    def __init__(self, name, model, calib, test, run=lambda m, x: m(x)):
        self.name, self.model, self.calib, self.test, self.run = name, model, calib, test, run


def cases(only: str = "", seed: int = 0):
    """Each case, trained on first use (a generator: the table starts while later models train).
    ``seed`` moves every case's seed (data, initialisation, training) by the same offset."""
    g = torch.Generator().manual_seed(0)

    def want(name):
        """Whether to build this case; reseeds, so that each case is the same with or without --only."""
        torch.manual_seed(zlib.crc32(name.encode()) + seed)
        g.manual_seed(zlib.crc32(name.encode()) + seed)
        return only.lower() in name.lower()

    if want("speechbrain biGRU"):
        x, y, _ = class_features(160, 40, 20, 5, g)
        m = SBGRUClassifier(H=48)
        fit(m, lambda: nn.functional.cross_entropy(m(x[:128]), y[:128]), 30, lr=1e-2)
        yield (Case("speechbrain biGRU classifier", m, list(x[:128].split(32)), [x[128:]]))
    if want("speechbrain CRDNN"):
        x, _, fy = class_features(160, 40, 40, 5, g)
        m = CRDNN(H=48)
        fit(m, lambda: nn.functional.cross_entropy(m(x[:128]).reshape(-1, 6), fy[:128].reshape(-1)), 30, lr=1e-2)
        yield (Case("speechbrain CRDNN", m, list(x[:128].split(32)), [x[128:]]))
    if want("darts RNNModel"):
        s = series(96, 200, g)
        m = train_step_model(StepRNN(1, 25, 1), s[:32, :120], False, False, 80)
        run = lambda mm, v: rollout(mm, v, 24)
        # darts predict: input chunk of 24 steps, then 1-step calls, one series at a time in time order
        calib = [s[i:i + 1, j:j + 24] for i in range(16) for j in range(0, 150, 50)]
        yield (Case("darts RNNModel (autoregressive)", m, calib, [s[64:, 100:124]], run))
    if want("darts BlockRNN"):
        s = series(128, 160, g)
        win = s.unfold(1, 60, 10)  # [n, windows, 60]
        xin, yout = win[..., :48].reshape(-1, 48), win[..., 48:].reshape(-1, 12)
        n_tr = 96 * win.shape[1]
        m = BlockRNN()
        pick = lambda: torch.randint(0, n_tr, (128,), generator=g)
        fit(m, lambda idx=None: (lambda i: nn.functional.mse_loss(m(xin[i]), yout[i]))(pick()), 80)
        yield (Case("darts BlockRNNModel", m, list(xin[:n_tr].split(128))[:8], [xin[n_tr:]]))
    if want("neuralforecast GRU"):
        s = series(128, 160, g)
        win = s.unfold(1, 60, 10)
        xin, yout = win[..., :48].reshape(-1, 48), win[..., 48:].reshape(-1, 12)
        n_tr = 96 * win.shape[1]
        m = NFGRU(H=48)
        pick = lambda: torch.randint(0, n_tr, (128,), generator=g)
        fit(m, lambda: (lambda i: nn.functional.mse_loss(m(xin[i]), yout[i]))(pick()), 80)
        yield (Case("neuralforecast GRU", m, list(xin[:n_tr].split(128))[:8], [xin[n_tr:]]))
    if want("neuralforecast recurrent"):
        s = series(96, 200, g)
        m = train_step_model(StepRNN(1, 48, 1, layers=2), s[:32, :120], False, False, 80)
        calib = [s[i * 4:(i + 1) * 4, :48] for i in range(16)]
        yield (Case("neuralforecast GRU recurrent=True", m, calib, [s[64:, 100:148]],
                        lambda mm, v: rollout(mm, v, 24)))
    if want("pytorch-forecasting RecurrentNetwork"):
        s = series(96, 200, g)
        m = train_step_model(StepRNN(3, 32, 1, layers=2), s[:32, :120], True, False, 80)
        calib = [s[i * 4:(i + 1) * 4, :36] for i in range(16)]
        yield (Case("pytorch-forecasting RecurrentNetwork", m, calib, [s[64:, 100:136]],
                        lambda mm, v: rollout(mm, v, 12, covariates=True)))
    if want("DeepAR"):
        s = series(96, 200, g)
        m = train_step_model(StepRNN(3, 32, 2, layers=2), s[:32, :120], True, True, 100)
        calib = [s[i * 4:(i + 1) * 4, :36] for i in range(16)]
        yield (Case("pytorch-forecasting DeepAR (mean path)", m, calib, [s[64:, 100:136]],
                        lambda mm, v: rollout(mm, v, 12, covariates=True)))
        noise = torch.randn(32 * 8, 12, generator=g)
        sampled = lambda mm, v: rollout(mm, v.repeat_interleave(8, 0), 12, covariates=True,
                                        sample_noise=noise[:v.shape[0] * 8])
        yield (Case("pytorch-forecasting DeepAR (8 samples)", m, calib, [s[64:, 100:136]], sampled))
    if want("WaveRNN"):
        wav = audio(40, 400, g)
        xin, cls = wavernn_inputs(wav), mulaw_class(wav)
        m = WaveRNNLike()
        fit(m, lambda: nn.functional.cross_entropy(m(xin[:16, :240])[0].reshape(-1, 256), cls[:16, :240].reshape(-1)), 50)
        yield (Case("torchaudio WaveRNN (1-step)", m, [xin[i:i + 4, :200] for i in range(0, 32, 4)],
                        [xin[32:, :200]], one_step_calls))
    if want("DPRNN"):
        a, b = audio(64, 600, g), 0.3 * series(64, 600, g) / 2
        mix = a + b
        src = torch.stack([a, b], 1)
        m = DPRNNLike()

        def loss():
            est = m(mix[:32])
            T = min(est.shape[-1], src.shape[-1])
            return nn.functional.mse_loss(est[..., :T], src[:32, :, :T])
        fit(m, loss, 30)
        yield (Case("asteroid DPRNN (GRU)", m, list(mix[:48].split(16)), [mix[48:]]))
    if want("drift stand-in"):
        yield drift_case(g)
    if want("drift stand-in, grow 5"):
        yield drift_case(g, grow=5.0)


# ---------------------------------------------------------------------------------------------
# quantizing with the call pattern, and the table
# ---------------------------------------------------------------------------------------------
class CallPattern(nn.Module):
    """``model`` driven by the case's call pattern: what calibrate() runs on each calibration input."""

    def __init__(self, model, run):
        super().__init__()
        self.model, self.run = model, run

    def forward(self, x):
        return self.run(self.model, x)


def quantize(case: Case, config) -> nn.Module:
    """As qgru.quantize_model, but calibrating through the case's call pattern."""
    q = qgru.prepare_model(case.model, config)
    qgru.calibrate(CallPattern(q, case.run), case.calib, progress=False)
    for m in q.modules():
        if isinstance(m, QuantGRU):
            m.convert()
    return q.eval()


def outputs(case: Case, model) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([case.run(model, x).reshape(-1) for x in case.test])


def evaluate(case: Case, compare: bool = False, columns=None):
    ref = outputs(case, case.model)
    row = {}
    dq, why = dynamic_quant(case.model)
    row["torch dynamic-quant"] = sqnr_db(ref, outputs(case, dq)) if dq is not None else math.nan
    models = {}
    for col, cfg, over in columns or COLUMNS:
        config = qgru.QuantConfig.load(cfg, overrides=over)
        # x levels run on the reference backend until the native backends run them (the same integers)
        levels = config["x"].dynamic and forced_backend_name() is None
        with qgru.backend("reference") if levels else contextlib.nullcontext():
            q = quantize(case, config)
            models[col] = q
            row[col] = sqnr_db(ref, outputs(case, q))
    if compare:
        print(f"\nqgru.compare, {case.name}, w8a8 static:")
        _compare(case, models["w8a8 static"])
    return row


def _compare(case: Case, q: nn.Module) -> None:
    """qgru.compare through the case's call pattern (each test input run as the library runs it)."""
    qgru.compare(CallPattern(case.model, case.run), CallPattern(q, case.run), case.test, progress=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="run the models whose name contains this")
    ap.add_argument("--compare", default="", help="print qgru.compare of the default w8a8 for the models "
                                                  "whose name contains this")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="", help="force a qgru backend (reference: the golden model, which "
                                                  "runs x levels before the native backends do)")
    ap.add_argument("--study", action="store_true", help="the x-levels study's columns (docs/accuracy.md): "
                                                         "x levels with Wx headroom 2 and 3")
    ap.add_argument("--seed", type=int, default=0, help="offset of every model's seed (0: docs/accuracy.md's table)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    columns = COLUMNS + (STUDY if args.study else [])
    t0 = time.perf_counter()
    default = qgru.QuantConfig.load("w8a8")
    print(f"default w8a8: scale_mode {default.scale_mode}, observer {default.observer.kind}")
    rows = []
    with (qgru.backend(args.backend) if args.backend else contextlib.nullcontext()):
        for case in cases(args.only, args.seed):
            t = time.perf_counter()
            row = evaluate(case, bool(args.compare) and args.compare.lower() in case.name.lower(), columns)
            rows.append((case.name, row))
            print(f"  {case.name}: {time.perf_counter() - t:.1f} s", flush=True)
    cols = ["torch dynamic-quant"] + [c for c, _, _ in columns]
    print(f"\noutput SQNR vs float (dB); torch {torch.__version__}, {platform.machine()} {cpu_model_name()}, "
          f"{torch.get_num_threads()} thread(s), {args.backend or 'default'} backend; "
          f"{time.perf_counter() - t0:.0f} s in all\n")
    checks = [("static >= dyn-1", "w8a8 static", -1), ("x levels >= dyn-1", "w8a8 x levels", -1),
              ("16-bit x >= dyn-1", "w8a8 16-bit x (headroom 4)", -1), ("w8a16 >= dyn", "w8a16 default", 0)]
    print("| model | " + " | ".join(cols) + " | " + " | ".join(c for c, _, _ in checks) + " |")
    print("|---|" + "---:|" * len(cols) + "---|" * len(checks))
    for name, row in rows:
        dyn = row["torch dynamic-quant"]
        ok = ["yes" if row[col] >= dyn + margin else "NO" for _, col, margin in checks]
        print(f"| {name} | " + " | ".join(f"{row[c]:.1f}" for c in cols) + " | " + " | ".join(ok) + " |")


if __name__ == "__main__":
    main()
