"""Weight rounding "gptq" (qgru/convert.py gptq_round, the default): the rounded weights against
independent references -- the optimal-brain-quantizer update written out with explicit inverses
(no Cholesky), a brute-force search over every floor/ceil choice, float64 second moments from
torch.nn.GRU's own outputs -- and end to end against torch.nn.GRU."""
import itertools
import math

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import qgru
from qgru.config import QuantConfig
from qgru.convert import GPTQ_DAMP, gptq_round
from qgru.module import QuantGRU
from qgru.observers import SecondMoment


def _obq_reference(w: torch.Tensor, s: torch.Tensor, M: torch.Tensor, bits: int) -> torch.Tensor:
    """The same greedy rounding written as the optimal brain quantizer states it (Frantar & Alistarh
    2022), one row at a time, with explicit inverses of the damped second moment: round the next
    column (decreasing M_jj) to nearest, move the other unrounded weights by the least-squares
    correction -e_j (M^-1)_{:,j} / (M^-1)_jj, and remove column j from the inverse."""
    qmax = 2 ** (bits - 1) - 1
    M = M.double() + GPTQ_DAMP * float(M.diagonal().mean()) * torch.eye(M.shape[0], dtype=torch.float64)
    order = torch.argsort(M.diagonal(), descending=True, stable=True).tolist()
    out = torch.empty(w.shape, dtype=torch.int64)
    for r in range(w.shape[0]):
        row = w[r].double().clone()
        Hinv = torch.linalg.inv(M)
        for j in order:
            q = math.floor(float(row[j] / s[r]) + 0.5)
            q = max(-qmax, min(qmax, q))
            out[r, j] = q
            err = float(row[j]) - q * float(s[r])
            row -= err * Hinv[:, j] / Hinv[j, j]
            row[j] = q * float(s[r])
            Hinv = Hinv - torch.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
    return out


def _product_error(w, q, s, M):
    """Per row, e M e^T with e = q s - w: the expected squared error of the row's product w.v."""
    e = q.double() * s.double().unsqueeze(1) - w.double()
    return ((e @ M.double()) * e).sum(1)


def _correlated(n_rows: int, K: int, seed: int, mean: float = 1.0):
    """Weights [n_rows, K] and the second moment of inputs with a common positive mean (as
    log-spectral features or a state near saturation): strongly coupled columns."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_rows, K, generator=g, dtype=torch.float64) * 0.3
    v = mean + 0.3 * torch.randn(4000, K, generator=g, dtype=torch.float64)
    return w, v.t() @ v / v.shape[0]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_matches_obq_reference(bits, seed):
    w, M = _correlated(12, 9, seed)
    s = w.abs().amax(1) / (2 ** (bits - 1) - 1)
    assert torch.equal(gptq_round(w, s, M, bits), _obq_reference(w, s, M, bits))


def test_gptq_beats_nearest_and_approaches_brute_force():
    """On coupled inputs the rounded rows' product error is far below nearest rounding's and close
    to the best of all 2^K floor/ceil choices (brute force, K = 8)."""
    w, M = _correlated(40, 8, 5)
    bits = 8
    s = w.abs().amax(1) / 127
    q_g = gptq_round(w, s, M, bits)
    q_n = torch.round(w / s.unsqueeze(1)).to(torch.int64)
    err_g, err_n = _product_error(w, q_g, s, M), _product_error(w, q_n, s, M)
    best = torch.empty(w.shape[0], dtype=torch.float64)
    lo = torch.floor(w / s.unsqueeze(1))
    choices = torch.tensor(list(itertools.product([0, 1], repeat=w.shape[1])), dtype=torch.float64)
    for r in range(w.shape[0]):
        cand = (lo[r] + choices).clamp(-127, 127)  # [2^K, K]
        e = cand * s[r] - w[r]
        best[r] = ((e @ M) * e).sum(1).min()
    assert float(err_g.sum()) < 0.3 * float(err_n.sum())  # measured 0.19
    assert float(err_g.sum()) < 1.3 * float(best.sum())  # measured 1.10
    assert (best <= err_g * (1 + 1e-9)).all()
    assert q_g.abs().max() <= 127


def test_gptq_is_nearest_without_coupling():
    """Uncoupled inputs (diagonal second moment), a single input, or no data: nearest rounding."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(10, 6, generator=g, dtype=torch.float64)
    s = w.abs().amax(1) / 127
    nearest = torch.floor(w / s.unsqueeze(1) + 0.5).to(torch.int64)
    diag = torch.diag(torch.rand(6, generator=g, dtype=torch.float64) + 0.1)
    assert torch.equal(gptq_round(w, s, diag, 8), nearest)
    assert torch.equal(gptq_round(w, s, torch.zeros(6, 6, dtype=torch.float64), 8), nearest)
    assert torch.equal(gptq_round(w[:, :1], s * 0 + w[:, :1].abs().squeeze(1) / 127,
                                  torch.ones(1, 1, dtype=torch.float64), 8),
                       torch.floor(w[:, :1] / (w[:, :1].abs() / 127) + 0.5).to(torch.int64))


def _gru_second_moments(gru: nn.GRU, x: torch.Tensor, lengths=None):
    """float64 E[x x^T], E[h h^T] of layer 0 from torch.nn.GRU itself (h: the state entering each
    step, h0 = 0 included), over the valid steps only."""
    g64 = nn.GRU(gru.input_size, gru.hidden_size, batch_first=True).double()
    g64.load_state_dict({k: v.double() for k, v in gru.state_dict().items()})
    with torch.no_grad():
        out, _ = g64(x.double())
    h_in = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)
    T = x.shape[1]
    valid = torch.ones(x.shape[:2], dtype=torch.bool) if lengths is None else \
        torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    xs, hs = x.double()[valid], h_in[valid]
    return xs.t() @ xs / xs.shape[0], hs.t() @ hs / hs.shape[0]


@pytest.mark.parametrize("calls", ["one", "steps", "packed"])
def test_second_moments_from_calibration(calls):
    """What calibration accumulates is E[v v^T] of the operands, the same however the data is cut
    into calls (one batch, or 1-step calls carrying h), padded steps excluded."""
    torch.manual_seed(0)
    gru = nn.GRU(5, 7, batch_first=True)
    x = torch.randn(4, 9, 5) + 0.5
    lengths = torch.tensor([9, 4, 7, 1]) if calls == "packed" else None
    ref_x, ref_h = _gru_second_moments(gru, x, lengths)
    q = QuantGRU.from_float(gru, "w8a16")
    q.start_calibration()
    with torch.no_grad():
        if calls == "one":
            q(x)
        elif calls == "steps":
            h = None
            for t in range(x.shape[1]):
                _, h = q(x[:, t:t + 1], h)
        else:
            q(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
    mom = q._second_moments()[(0, 0)]
    assert torch.allclose(mom["x"], ref_x, rtol=1e-5, atol=1e-6)
    assert torch.allclose(mom["h"], ref_h, rtol=1e-5, atol=1e-6)


def test_second_moment_accumulator():
    a = SecondMoment("t", 3)
    assert a.value() is None
    v = torch.randn(50, 3, dtype=torch.float64)
    for piece in v.split(7):
        a.observe(piece)
    assert torch.allclose(a.value(), v.t() @ v / 50, rtol=1e-12, atol=1e-14)


def _sqnr(ref, out):
    return 10 * math.log10(float(ref.double().pow(2).sum()) / float((out.double() - ref.double()).pow(2).sum()))


@pytest.mark.parametrize("config", ["w8a16", "w8a8"])
def test_gptq_end_to_end_against_nn_gru(config):
    """A bidirectional GRU on positive-mean features (the speechbrain classifier's case, where
    nearest-rounded 8-bit weights lost to torch's dynamic quant): against torch.nn.GRU in float,
    the default (gptq) weights' output error is well below nearest rounding's."""
    torch.manual_seed(1)
    gru = nn.GRU(16, 32, num_layers=2, bidirectional=True, batch_first=True)
    g = torch.Generator().manual_seed(2)
    feats = lambda n: torch.log1p(3 * torch.rand(n, 30, 16, generator=g) * (1 + torch.arange(16) / 8))
    calib, test = feats(64), feats(32)
    with torch.no_grad():
        ref = gru(test)[0]
    err = {}
    for rounding in ("gptq", "nearest"):
        cfg = QuantConfig.load(config, overrides={"weight_rounding": rounding})
        q = qgru.quantize_model(gru, list(calib.split(16)), cfg, progress=False)
        with torch.no_grad():
            err[rounding] = _sqnr(ref, q(test)[0])
    assert QuantConfig.load(config).weight_rounding == "gptq"
    if config == "w8a16":  # the weights' error dominates: gptq removes most of it
        assert err["gptq"] > err["nearest"] + 8.0, err
    else:  # 8-bit x and h dominate: gptq must not cost anything
        assert err["gptq"] > err["nearest"] - 0.2, err


def test_qat_convert_keeps_nearest_rounding():
    """QAT trains through nearest-rounded weights, so its convert() must not re-round them."""
    torch.manual_seed(0)
    gru = nn.GRU(4, 6, batch_first=True)
    x = torch.randn(3, 8, 4) + 1.0
    q = qgru.convert_qat(qgru.prepare_qat(gru, [x], "w8a8", progress=False))
    layer = q._qparams[0][0]
    w = gru.weight_ih_l0.detach().double()
    s = w.abs().amax(1) / 127
    assert torch.equal(layer.W.to(torch.int64), torch.floor(w / s.unsqueeze(1) + 0.5).to(torch.int64))


def test_config_weight_rounding():
    assert QuantConfig.load("w8a8", overrides={"weight_rounding": "nearest"}).weight_rounding == "nearest"
    c = QuantConfig.load("w8a8")
    assert QuantConfig.load(c.to_dict()).weight_rounding == "gptq"
    with pytest.raises(ValueError, match="weight_rounding"):
        QuantConfig.load("w8a8", overrides={"weight_rounding": "stochastic"})
