"""Calibration: observers, qgru.calibrate(), PackedSequence padding, directions, progress bar,
training mode, non-finite data and torch.distributed reduction of the statistics."""
from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import qgru
from conftest import spawn_ranks
from qgru.observers import Observer

I, H = 3, 4


def cfg(kind: str, **tensor_overrides) -> qgru.QuantConfig:
    over = {"observer": {"kind": kind}}
    if tensor_overrides:
        over["tensors"] = tensor_overrides
    return qgru.QuantConfig.load("w8a8", overrides=over)


def make_batches(n=4, T=5, N=2, size=I, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, N, size, generator=g) * (1 + b) for b in range(n)]


def val(t) -> float:
    assert t.dtype == torch.float64
    return float(t)


# =============================================================================================
# Observer against hand-computed values
# =============================================================================================
class TestObserverKinds:
    def test_minmax_is_global_min_max_over_batches(self):
        o = Observer("t", "minmax")
        o.observe(torch.tensor([1.0, -2.0, 3.0]))
        o.end_call()
        assert (val(o.min), val(o.max)) == (-2.0, 3.0)
        o.observe(torch.tensor([0.5, 4.0]))
        o.end_call()
        assert (val(o.min), val(o.max)) == (-2.0, 4.0)
        o.observe(torch.tensor([-5.0, 0.0]))
        o.end_call()
        assert (val(o.min), val(o.max)) == (-5.0, 4.0)
        o.observe(torch.tensor([-1.0, 1.0]))  # inside the range: nothing changes
        o.end_call()
        assert (val(o.min), val(o.max)) == (-5.0, 4.0)
        assert o.count == 9
        lo, hi = o.range()
        assert (float(lo), float(hi)) == (-5.0, 4.0)

    def test_minmax_several_steps_in_one_call(self):
        o = Observer("t", "minmax")
        o.observe(torch.tensor([[1.0, 2.0]]))
        o.observe(torch.tensor([[-7.0, 0.0]]))
        o.observe(torch.tensor([[0.0, 9.0]]))
        assert o.min is None  # folded only at end_call
        o.end_call()
        assert (val(o.min), val(o.max)) == (-7.0, 9.0)

    def test_ema_first_batch_initialises_then_moving_average(self):
        o = Observer("t", "ema", momentum=0.1)
        o.observe(torch.tensor([-1.0, 2.0, 0.5]))
        o.end_call()
        assert (val(o.min), val(o.max)) == (-1.0, 2.0)  # first batch initialises, no averaging
        o.observe(torch.tensor([-3.0, 4.0]))
        o.end_call()
        # min = 0.9 * -1 + 0.1 * -3 = -1.2; max = 0.9 * 2 + 0.1 * 4 = 2.2
        assert val(o.min) == pytest.approx(-1.2, abs=1e-12)
        assert val(o.max) == pytest.approx(2.2, abs=1e-12)
        o.observe(torch.tensor([0.0, 1.0]))
        o.end_call()
        # min = 0.9 * -1.2 + 0.1 * 0 = -1.08; max = 0.9 * 2.2 + 0.1 * 1 = 2.08
        assert val(o.min) == pytest.approx(-1.08, abs=1e-12)
        assert val(o.max) == pytest.approx(2.08, abs=1e-12)

    def test_ema_averages_per_call_not_per_step(self):
        o = Observer("t", "ema", momentum=0.1)
        o.observe(torch.tensor([0.0, 1.0]))
        o.end_call()
        # one call of three steps: only the call's extremes (-10, 10) enter the average, once
        o.observe(torch.tensor([-10.0, 0.0]))
        o.observe(torch.tensor([0.0, 10.0]))
        o.observe(torch.tensor([-1.0, 1.0]))
        o.end_call()
        assert val(o.min) == pytest.approx(0.9 * 0.0 + 0.1 * -10.0, abs=1e-12)
        assert val(o.max) == pytest.approx(0.9 * 1.0 + 0.1 * 10.0, abs=1e-12)

    def test_ema_other_momentum(self):
        o = Observer("t", "ema", momentum=0.5)
        for v in ([-4.0, 4.0], [0.0, 0.0], [-2.0, 8.0]):
            o.observe(torch.tensor(v))
            o.end_call()
        # min: -4 -> -2 -> -2 ; max: 4 -> 2 -> 5
        assert (val(o.min), val(o.max)) == (-2.0, 5.0)

    def test_ema_step_updates_at_every_observe(self):
        o = Observer("t", "ema_step", momentum=0.1)
        o.observe(torch.tensor([-1.0, 2.0]))
        assert (val(o.min), val(o.max)) == (-1.0, 2.0)  # first step initialises
        o.observe(torch.tensor([-3.0, 4.0]))
        assert val(o.min) == pytest.approx(-1.2, abs=1e-12)
        assert val(o.max) == pytest.approx(2.2, abs=1e-12)
        o.end_call()  # the end of a call changes nothing for ema_step
        assert val(o.min) == pytest.approx(-1.2, abs=1e-12)
        assert val(o.max) == pytest.approx(2.2, abs=1e-12)
        o.observe(torch.tensor([0.0, 1.0]))
        o.end_call()
        assert val(o.min) == pytest.approx(-1.08, abs=1e-12)
        assert val(o.max) == pytest.approx(2.08, abs=1e-12)

    def test_kinds_differ_on_the_same_stream(self):
        steps = [torch.tensor([-1.0, 1.0]), torch.tensor([-5.0, 3.0]), torch.tensor([-2.0, 7.0])]
        out = {}
        for kind in ("minmax", "ema", "ema_step"):
            o = Observer("t", kind)
            for s in steps:
                o.observe(s)
            o.end_call()
            out[kind] = (val(o.min), val(o.max))
        assert out["minmax"] == (-5.0, 7.0)
        assert out["ema"] == (-5.0, 7.0)  # a single call: the first call initialises with its extremes
        # ema_step: -1 -> 0.9*-1 + 0.1*-5 = -1.4 -> 0.9*-1.4 + 0.1*-2 = -1.46
        #            1 -> 0.9*1 + 0.1*3 = 1.2   -> 0.9*1.2 + 0.1*7 = 1.78
        assert out["ema_step"] == (pytest.approx(-1.46, abs=1e-12), pytest.approx(1.78, abs=1e-12))

    def test_per_channel_minmax(self):
        o = Observer("t", "minmax", channels=3)
        o.observe(torch.tensor([[1.0, -2.0, 3.0],
                                [0.0, 5.0, -1.0]]))
        o.end_call()
        assert o.min.tolist() == [0.0, -2.0, -1.0]
        assert o.max.tolist() == [1.0, 5.0, 3.0]
        # 3-D input: every leading dimension is reduced, only the last one is a channel
        o.observe(torch.tensor([[[-4.0, 0.0, 0.0]], [[0.0, 0.0, 9.0]]]))
        o.end_call()
        assert o.min.tolist() == [-4.0, -2.0, -1.0]
        assert o.max.tolist() == [1.0, 5.0, 9.0]
        assert o.min.shape == (3,) and o.min.dtype == torch.float64

    def test_per_channel_ema(self):
        o = Observer("t", "ema", momentum=0.1, channels=2)
        o.observe(torch.tensor([[1.0, -1.0], [3.0, 1.0]]))
        o.end_call()
        assert o.min.tolist() == [1.0, -1.0] and o.max.tolist() == [3.0, 1.0]
        o.observe(torch.tensor([[-9.0, 11.0]]))
        o.end_call()
        assert o.min.tolist() == pytest.approx([0.9 * 1 + 0.1 * -9, 0.9 * -1 + 0.1 * 11], abs=1e-12)
        assert o.max.tolist() == pytest.approx([0.9 * 3 + 0.1 * -9, 0.9 * 1 + 0.1 * 11], abs=1e-12)

    def test_per_channel_ema_step(self):
        o = Observer("t", "ema_step", momentum=0.1, channels=2)
        o.observe(torch.tensor([[0.0, 10.0]]))
        o.observe(torch.tensor([[10.0, 0.0]]))
        assert o.min.tolist() == pytest.approx([1.0, 9.0], abs=1e-12)
        assert o.max.tolist() == pytest.approx([1.0, 9.0], abs=1e-12)

    def test_empty_tensor_is_ignored_and_range_needs_data(self):
        o = Observer("nothing", "ema")
        o.observe(torch.zeros(0, 3))
        o.end_call()
        assert o.min is None and o.count == 0
        with pytest.raises(RuntimeError, match="saw no data"):
            o.range()

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
    def test_non_finite_value_raises(self, bad):
        o = Observer("layer 0 x", "minmax")
        with pytest.raises(qgru.NonFiniteCalibrationError, match="layer 0 x"):
            o.observe(torch.tensor([0.0, bad]))
        assert issubclass(qgru.NonFiniteCalibrationError, ValueError)



# =============================================================================================
# percentile (the default): weighs data, not calls
# =============================================================================================
def _cuts(v: torch.Tensor, seed: int):
    """v [n, ...] cut into pieces of random sizes (1 to 40 rows), in order."""
    g = torch.Generator().manual_seed(seed)
    sizes, left = [], v.shape[0]
    while left:
        sizes.append(min(left, int(torch.randint(1, 41, (1,), generator=g))))
        left -= sizes[-1]
    return list(v.split(sizes))


def _percentile_reference(v: torch.Tensor, p: float):
    """(lo, hi) bounds by sorting: at most floor(n (100 - p) / 100) values may lie beyond each end,
    so hi >= the value with that many above it (likewise lo); the observer rounds outwards to
    its bin edges, at most one bin (2^exp / 256, |v| < 2^exp) further."""
    v = v.double().reshape(-1)
    n = v.numel()
    allowed = int(n * (100.0 - p) / 100.0)
    s = v.sort().values
    width = 2.0 ** int(torch.frexp(v.abs().max()).exponent) / 256
    return s[allowed].item(), s[n - 1 - allowed].item(), width


class TestPercentileObserver:
    def test_default_config_uses_its_histogram(self):
        # mse (w8a8's and w8a16's default) searches percentile's histogram; w16a16 keeps percentile
        for name, kind in (("w8a8", "mse"), ("w8a16", "mse"), ("w16a16", "percentile")):
            spec = qgru.QuantConfig.load(name).observer
            assert (spec.kind, spec.percentile) == (kind, 99.99)

    @pytest.mark.parametrize("p", [99.99, 99.0, 90.0])
    def test_range_against_sorted_values(self, p):
        g = torch.Generator().manual_seed(3)
        v = torch.randn(50_000, generator=g) * 3 + torch.randn(50_000, generator=g).pow(3)  # heavy tails
        o = Observer("t", "percentile", percentile=p)
        o.observe(v)
        o.end_call()
        lo, hi = (float(t) for t in o.range())
        ref_lo, ref_hi, width = _percentile_reference(v, p)
        allowed = int(v.numel() * (100.0 - p) / 100.0)
        assert int((v.double() > hi).sum()) <= allowed and int((v.double() < lo).sum()) <= allowed
        assert ref_hi <= hi <= ref_hi + width and ref_lo - width <= lo <= ref_lo
        assert v.min() <= lo and hi <= v.max()  # never wider than minmax
        assert hi < float(v.max()) and lo > float(v.min())  # and it does drop the rarest values

    def test_small_data_equals_minmax(self):
        v = torch.tensor([-3.0, 0.5, 7.25, 1.0])  # fewer than 10^4 values: nothing may be dropped
        o = Observer("t", "percentile")
        o.observe(v)
        assert tuple(float(t) for t in o.range()) == (-3.0, 7.25)

    @pytest.mark.parametrize("channels", [0, 3])
    def test_same_range_however_the_data_is_cut(self, channels):
        g = torch.Generator().manual_seed(5)
        v = torch.randn(20_000, 3, generator=g) * torch.tensor([1.0, 1e-3, 50.0])
        v[:7000] *= 0.01  # the first calls see a much narrower range than the later ones
        v[:, 1][5000:9000] = 0.0
        data = v if channels else v[:, 0]

        def run(pieces):
            o = Observer("t", "percentile", channels=channels)
            for piece in pieces:
                o.observe(piece)
                o.end_call()
            return o

        whole = run([data])
        for seed in range(3):
            cuts = _cuts(data, seed)
            for pieces in (cuts, cuts[::-1], cuts[::2] + cuts[1::2]):  # in order, reversed, shuffled
                o = run(pieces)
                assert torch.equal(o.hist, whole.hist) and torch.equal(o.exp, whole.exp)
                assert all(torch.equal(a, b) for a, b in zip(o.range(), whole.range()))
        ema_o = Observer("t", "ema", channels=channels)
        for piece in _cuts(data, 0):
            ema_o.observe(piece)
            ema_o.end_call()
        assert not torch.equal(ema_o.range()[1], whole.range()[1])  # ema does depend on the cutting

    def test_per_channel_against_sorted_values(self):
        g = torch.Generator().manual_seed(9)
        v = torch.randn(30_000, 4, generator=g) * torch.tensor([1.0, 10.0, 0.1, 1.0])
        v[:, 3] = v[:, 3].abs()  # one channel never negative: its range starts at its minimum
        o = Observer("t", "percentile", channels=4, percentile=99.9)
        o.observe(v)
        lo, hi = o.range()
        assert lo.shape == hi.shape == (4,)
        for c in range(4):
            ref_lo, ref_hi, width = _percentile_reference(v[:, c], 99.9)
            assert ref_hi <= float(hi[c]) <= ref_hi + width and ref_lo - width <= float(lo[c]) <= ref_lo
        assert float(lo[3]) >= 0.0

    def test_seen_extremes_are_exact_for_every_kind(self):
        v = torch.tensor([[1.0, -2.0], [3.0, 0.5], [-4.0, 8.0]])
        for kind in ("percentile", "minmax", "ema", "ema_step"):
            o = Observer("t", kind, channels=2)
            for row in v:
                o.observe(row.unsqueeze(0))
                o.end_call()
            o.range()
            assert o.seen_min.tolist() == [-4.0, -2.0] and o.seen_max.tolist() == [3.0, 8.0], kind

# =============================================================================================
# Through QuantGRU
# =============================================================================================
class TestModuleObservers:
    def test_minmax_x_observer_is_exact_min_max_of_inputs(self):
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, num_layers=2, config=cfg("minmax"))
        batches = make_batches()
        qgru.calibrate(m, batches, progress=False)
        allx = torch.cat([b.reshape(-1) for b in batches]).double()
        o = m._observers[(0, 0)]["x"]
        assert torch.equal(o.min, allx.min()) and torch.equal(o.max, allx.max())
        assert o.count == allx.numel()
        # layer 0's h observer saw h0 = 0 and every layer-0 state, which layer 1's x observer sees as
        # its input: compare both with torch's own nn.GRU
        l0 = nn.GRU(I, H)
        l0.load_state_dict({k: v for k, v in m.state_dict().items() if k.endswith("_l0")})
        with torch.no_grad():
            l0_out = torch.cat([l0(b)[0].reshape(-1) for b in batches]).double()
        oh = m._observers[(0, 0)]["h"]
        assert float(oh.min) == pytest.approx(min(float(l0_out.min()), 0.0), abs=1e-5)
        assert float(oh.max) == pytest.approx(max(float(l0_out.max()), 0.0), abs=1e-5)
        o1 = m._observers[(1, 0)]["x"]
        assert float(o1.min) == pytest.approx(float(l0_out.min()), abs=1e-5)
        assert float(o1.max) == pytest.approx(float(l0_out.max()), abs=1e-5)

    def test_minmax_wx_observer_is_per_channel(self):
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, config=cfg("minmax"))  # Wx is per_gate in w8a8: observed per channel
        batches = make_batches()
        qgru.calibrate(m, batches, progress=False)
        with torch.no_grad():
            wx = torch.cat([(b @ m.weight_ih_l0.t() + m.bias_ih_l0).reshape(-1, 3 * H) for b in batches])
        o = m._observers[(0, 0)]["Wx"]
        assert o.min.shape == (3 * H,)
        torch.testing.assert_close(o.min, wx.amin(0).double(), rtol=0, atol=1e-6)
        torch.testing.assert_close(o.max, wx.amax(0).double(), rtol=0, atol=1e-6)

    def test_ema_x_observer_averages_batch_extremes(self):
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, config=cfg("ema"))
        batches = make_batches()
        qgru.calibrate(m, batches, progress=False)
        lo, hi = float(batches[0].min()), float(batches[0].max())
        for b in batches[1:]:
            lo = 0.9 * lo + 0.1 * float(b.min())
            hi = 0.9 * hi + 0.1 * float(b.max())
        o = m._observers[(0, 0)]["x"]
        assert float(o.min) == pytest.approx(lo, abs=1e-12)
        assert float(o.max) == pytest.approx(hi, abs=1e-12)
        # and it is not the global extremes
        allx = torch.cat([b.reshape(-1) for b in batches])
        assert float(o.max) < float(allx.max()) - 1e-3

    def test_ema_step_x_observer_updates_per_time_step(self):
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, batch_first=True, config=cfg("ema_step"))
        batches = [b.transpose(0, 1).contiguous() for b in make_batches(n=2)]  # [N, T, I]
        qgru.calibrate(m, batches, progress=False)
        lo = hi = None
        for b in batches:
            for t in range(b.shape[1]):
                s_lo, s_hi = float(b[:, t].min()), float(b[:, t].max())
                lo = s_lo if lo is None else 0.9 * lo + 0.1 * s_lo
                hi = s_hi if hi is None else 0.9 * hi + 0.1 * s_hi
        o = m._observers[(0, 0)]["x"]
        assert float(o.min) == pytest.approx(lo, abs=1e-12)
        assert float(o.max) == pytest.approx(hi, abs=1e-12)

    def test_calibrate_again_starts_fresh(self):
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, config=cfg("minmax"))
        qgru.calibrate(m, [torch.full((2, 1, I), 100.0)], progress=False)
        small = make_batches(n=1)
        qgru.calibrate(m, small, progress=False)
        o = m._observers[(0, 0)]["x"]
        assert float(o.max) == float(small[0].max())
        assert o.count == small[0].numel()

    @pytest.mark.parametrize("enforce_sorted", [True, False])
    @pytest.mark.parametrize("kind", ["minmax", "ema_step"])
    def test_packed_padding_is_never_observed(self, kind, enforce_sorted):
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, bidirectional=True, config=cfg(kind))
        lengths = torch.tensor([5, 3, 1]) if enforce_sorted else torch.tensor([3, 5, 1])
        T, N = 5, 3
        x = torch.rand(T, N, I) + 1.0  # valid data in [1, 2): a zero from re-padding would show as min 0
        valid = torch.arange(T).unsqueeze(1) < lengths.unsqueeze(0)  # [T, N]
        x = torch.where(valid.unsqueeze(-1), x, torch.full_like(x, 1e6))
        packed = pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted)
        # wrapped in a tuple: a bare PackedSequence batch hits a bug (test_bare_packed_sequence_batch)
        qgru.calibrate(m, [(packed,)], progress=False)
        true = x[valid].double()
        n_valid = int(lengths.sum()) * I
        for d in (0, 1):
            o = m._observers[(0, d)]["x"]
            assert o.count == n_valid
            if kind == "minmax":
                assert torch.equal(o.max, true.max()) and torch.equal(o.min, true.min())
            else:
                assert 1.0 <= float(o.min) <= float(o.max) < 2.0
        # nothing else saw a padded step either: every observer of an [N, *] tensor counted valid rows
        for d in (0, 1):
            assert m._observers[(0, d)]["Wx"].count == int(lengths.sum()) * 3 * H
            assert m._observers[(0, d)]["r_pre"].count == int(lengths.sum()) * H

    def test_bare_packed_sequence_batch(self):
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, config=cfg("minmax"))
        m2 = copy.deepcopy(m)
        packed = pack_padded_sequence(torch.randn(4, 2, I), torch.tensor([4, 2]))
        qgru.calibrate(m2, [(packed,)], progress=False)
        qgru.calibrate(m, [packed], progress=False)
        assert torch.equal(m._observers[(0, 0)]["x"].max, m2._observers[(0, 0)]["x"].max)

    def test_packed_calibration_equals_per_sequence_calibration(self):
        """minmax over a packed batch == minmax over each sequence run on its own (unpadded)."""
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, bidirectional=True, config=cfg("minmax"))
        m2 = copy.deepcopy(m)
        lengths = torch.tensor([4, 2])
        x = torch.randn(4, 2, I)
        x[2:, 1] = 50.0
        qgru.calibrate(m, [(pack_padded_sequence(x, lengths),)], progress=False)
        qgru.calibrate(m2, [x[:4, 0:1], x[:2, 1:2]], progress=False)
        for key in m._observers:
            for n, o in m._observers[key].items():
                o2 = m2._observers[key][n]
                torch.testing.assert_close(o.min, o2.min, rtol=0, atol=1e-6, msg=f"{key} {n}")
                torch.testing.assert_close(o.max, o2.max, rtol=0, atol=1e-6, msg=f"{key} {n}")


# =============================================================================================
# Directions have their own observers
# =============================================================================================
def _copy_direction(src: qgru.QuantGRU, dst: qgru.QuantGRU, reverse: bool) -> None:
    sfx = "_l0_reverse" if reverse else "_l0"
    with torch.no_grad():
        for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(dst, n + "_l0").copy_(getattr(src, n + sfx))


def _assert_same_stats(a, b):
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n].min, b[n].min), n
        assert torch.equal(a[n].max, b[n].max), n
        assert a[n].count == b[n].count, n


class TestDirections:
    def test_bidirectional_forward_stats_equal_unidirectional_ema_step(self):
        torch.manual_seed(0)
        bi = qgru.QuantGRU(I, H, bidirectional=True, config=cfg("ema_step"))
        uni = qgru.QuantGRU(I, H, config=cfg("ema_step"))
        uni_rev = qgru.QuantGRU(I, H, config=cfg("ema_step"))
        _copy_direction(bi, uni, reverse=False)
        _copy_direction(bi, uni_rev, reverse=True)
        batches = make_batches(n=3, T=6)
        qgru.calibrate(bi, batches, progress=False)
        qgru.calibrate(uni, batches, progress=False)
        qgru.calibrate(uni_rev, [b.flip(0) for b in batches], progress=False)
        _assert_same_stats(bi._observers[(0, 0)], uni._observers[(0, 0)])
        # the reverse direction is a forward GRU over the reversed sequences, with its own observers
        _assert_same_stats(bi._observers[(0, 1)], uni_rev._observers[(0, 0)])
        # not vacuous: the directions really do hold different statistics
        assert not torch.equal(bi._observers[(0, 0)]["h"].max, bi._observers[(0, 1)]["h"].max)
        assert not torch.equal(bi._observers[(0, 0)]["x"].min, bi._observers[(0, 1)]["x"].min)
        assert bi._observers[(0, 0)]["x"] is not bi._observers[(0, 1)]["x"]

    def test_bidirectional_forward_stats_with_packed_input(self):
        torch.manual_seed(0)
        bi = qgru.QuantGRU(I, H, bidirectional=True, config=cfg("ema_step"))
        uni = qgru.QuantGRU(I, H, config=cfg("ema_step"))
        _copy_direction(bi, uni, reverse=False)
        lengths = torch.tensor([6, 4, 2])
        x = torch.randn(6, 3, I)
        x[4:, 1] = 1e3  # padding
        x[2:, 2] = -1e3
        batches = [(pack_padded_sequence(x, lengths),), (pack_padded_sequence(x * 0.5, lengths),)]
        qgru.calibrate(bi, batches, progress=False)
        qgru.calibrate(uni, batches, progress=False)
        _assert_same_stats(bi._observers[(0, 0)], uni._observers[(0, 0)])


# =============================================================================================
# calibrate(): progress bar, modes
# =============================================================================================
class TestCalibrateWorkflow:
    def test_progress_bar_on_stderr(self, capfd):
        m = qgru.QuantGRU(I, H)
        qgru.calibrate(m, make_batches(n=2), progress=True)
        out, err = capfd.readouterr()
        assert "qgru calibrate" in err
        assert "2/2" in err

    def test_progress_bar_with_generator(self, capfd):
        m = qgru.QuantGRU(I, H)
        qgru.calibrate(m, (b for b in make_batches(n=2)), progress=True)
        _, err = capfd.readouterr()
        assert "qgru calibrate" in err

    def test_no_progress_writes_nothing(self, capfd):
        m = qgru.QuantGRU(I, H)
        qgru.calibrate(m, make_batches(n=2), progress=False)
        out, err = capfd.readouterr()
        assert out == "" and err == ""

    @pytest.mark.parametrize("training", [True, False])
    def test_mode_restored_and_eval_no_grad_inside(self, training):
        m = qgru.QuantGRU(I, H)
        seen = []
        m.register_forward_hook(lambda mod, inp, out: seen.append((mod.training, torch.is_grad_enabled())))
        m.train(training)
        ret = qgru.calibrate(m, make_batches(n=2), progress=False)
        assert ret is m
        assert m.training is training
        assert seen == [(False, False), (False, False)]
        assert "calibrating" not in repr(m)

    def test_calibrated_module_forward_is_float_again(self):
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H)
        x = torch.randn(5, 2, I)
        qgru.calibrate(m, [x], progress=False)
        out = m(x)[0]
        ref = m.to_float()(x)[0]
        assert torch.equal(out, ref)

    def test_submodule_modes_restored(self):
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.gru = qgru.QuantGRU(I, H)
                self.norm = nn.BatchNorm1d(H)

            def forward(self, x):
                return self.norm(self.gru(x)[0][-1])

        net = Net()
        net.train()
        net.norm.eval()  # frozen statistics
        qgru.calibrate(net, make_batches(n=1), progress=False)
        assert net.training and net.gru.training
        assert net.norm.training is False

    def test_error_while_starting_leaves_model_unchanged(self):
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = qgru.QuantGRU(I, H)
                self.b = qgru.QuantGRU(H, H)

            def forward(self, x):
                return self.b(self.a(x)[0])

        net = Net()
        batches = make_batches(n=1)
        qgru.calibrate(net, batches, progress=False)
        net.b.convert()
        net.train()
        with pytest.raises(RuntimeError, match="already converted"):
            qgru.calibrate(net, batches, progress=False)
        assert net.training
        assert "calibrating" not in repr(net.a)


# =============================================================================================
# Non-finite calibration data
# =============================================================================================
class TestNonFinite:
    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
    @pytest.mark.parametrize("form", ["tensor", "tuple_x", "tuple_h0", "tuple_packed"])
    def test_batch_index_in_message(self, bad, form):
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H)
        m.train()
        xs = make_batches(n=4)
        h0 = torch.zeros(1, 2, H)
        bad_at = 2
        if form in ("tensor", "tuple_x", "tuple_packed"):
            xs[bad_at] = xs[bad_at].clone()
            xs[bad_at][1, 0, 2] = bad
        if form == "tensor":
            batches = xs
        elif form in ("tuple_x", "tuple_h0"):
            batches = [(x, h0.clone()) for x in xs]
            if form == "tuple_h0":
                batches[bad_at][1][0, 1, 0] = bad
        else:
            lengths = torch.tensor([5, 4])
            packed = [pack_padded_sequence(x, lengths) for x in xs]
            batches = [(p,) for p in packed]
        with pytest.raises(qgru.NonFiniteCalibrationError, match=r"batch 2\b") as ei:
            qgru.calibrate(m, batches, progress=False)
        assert "batch 1" not in str(ei.value) and "batch 3" not in str(ei.value)
        # the failure leaves the module usable: training mode back, not calibrating
        assert m.training
        assert "calibrating" not in repr(m)

    def test_first_batch_index_zero(self):
        m = qgru.QuantGRU(I, H)
        xs = make_batches(n=2)
        xs[0] = xs[0].clone()
        xs[0][0, 0, 0] = float("nan")
        with pytest.raises(qgru.NonFiniteCalibrationError, match=r"batch 0\b"):
            qgru.calibrate(m, xs, progress=False)

    def test_nan_in_padding_is_fine(self):
        """Padding is never observed, so NaN there is not calibration data."""
        torch.manual_seed(0)
        m = qgru.QuantGRU(I, H, config=cfg("minmax"))
        x = torch.randn(4, 2, I)
        x[2:, 1] = float("nan")
        qgru.calibrate(m, [(pack_padded_sequence(x, torch.tensor([4, 2])),)], progress=False)
        assert torch.isfinite(m._observers[(0, 0)]["x"].max)

    @pytest.mark.parametrize("param, bad", [("bias_hh_l0", float("inf")), ("weight_ih_l0", float("nan")),
                                            ("weight_hh_l1_reverse", float("-inf")), ("bias_ih_l1", float("nan"))])
    def test_nonfinite_weights_name_the_parameter_not_a_batch(self, param, bad):
        """A NaN/Inf in the model's weights is the model's fault: the error names the parameter and
        blames no calibration batch (it used to read "calibration batch 0: non-finite value (NaN
        or Inf) in tensor 'layer 0 Wx'"), and it is not a NonFiniteCalibrationError."""
        m = qgru.QuantGRU(I, H, num_layers=2, bidirectional=True)
        with torch.no_grad():
            getattr(m, param)[0] = bad
        with pytest.raises(qgru.NonFiniteWeightError, match=rf"parameter '{param}' contains NaN or Inf") as ei:
            qgru.calibrate(m, make_batches(n=2), progress=False)
        assert "batch" not in str(ei.value) and "not the calibration data" in str(ei.value)
        assert not isinstance(ei.value, qgru.NonFiniteCalibrationError) and isinstance(ei.value, ValueError)
        assert "calibrating" not in repr(m)
        # quantize_model on a model holding such an nn.GRU says the same
        gru = torch.nn.GRU(I, H)
        with torch.no_grad():
            gru.weight_hh_l0[1, 2] = bad
        with pytest.raises(qgru.NonFiniteWeightError, match=r"parameter 'weight_hh_l0'"):
            qgru.quantize_model(torch.nn.Sequential(gru), make_batches(n=2), progress=False)


# =============================================================================================
# torch.distributed: observers reduced across ranks before convert()
# =============================================================================================
DIST_N_BATCHES = 4
PER_TENSOR_GEMM = {"Wx": {"granularity": "per_tensor"}, "Rh": {"granularity": "per_tensor"}}


def _dist_model(kind: str, **tensor_overrides) -> qgru.QuantGRU:
    torch.manual_seed(1234)
    return qgru.QuantGRU(I, H, num_layers=2, bidirectional=True, config=cfg(kind, **tensor_overrides))


def _dist_data():
    return make_batches(n=DIST_N_BATCHES, T=4, N=2, seed=77)


def _dist_worker(rank: int, world: int, init_method: str, outdir: str) -> None:
    """Top-level so that torch.multiprocessing.spawn can pickle it."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        data = _dist_data()
        half = DIST_N_BATCHES // world
        mine = data[rank * half:(rank + 1) * half]
        results = {}
        for kind in ("minmax", "ema", "percentile", "mse"):
            m = _dist_model(kind)
            qgru.calibrate(m, mine, progress=False)
            m.convert()
            results[f"export_{kind}"] = m.export().to_dict()
            results[f"out_{kind}"] = m(data[0])[0]
        # per_tensor Wx/Rh: the converted model must still run after the reduction
        m = _dist_model("ema", **PER_TENSOR_GEMM)
        qgru.calibrate(m, mine, progress=False)
        m.convert()
        try:
            results["per_tensor_ema_out"] = m(data[0])[0]
        except Exception as e:  # recorded, checked by the test
            results["per_tensor_ema_out"] = f"{type(e).__name__}: {e}"
        # observer level: known values, and a rank that saw no data
        obs = {}
        for kind in ("minmax", "ema", "percentile"):
            o = Observer("o", kind)
            o.observe(torch.tensor([-1.0 - rank, 2.0 + 3 * rank]))
            o.end_call()
            o.sync()
            obs[f"{kind}_scalar"] = (*o.range(), o.count)
            oc = Observer("c", kind, channels=2)
            oc.observe(torch.tensor([[rank * 1.0, -rank * 2.0]]))
            oc.end_call()
            oc.sync()
            obs[f"{kind}_channels"] = (*oc.range(), oc.count)
            on = Observer("n", kind)
            if rank == 0:
                on.observe(torch.tensor([-3.0, 5.0]))
                on.end_call()
            on.sync()
            obs[f"{kind}_one_rank"] = (*on.range(), on.count)
        results["obs"] = obs
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    return spawn_ranks(_dist_worker, tmp_path_factory.mktemp("dist"))


def _assert_export_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


class TestDistributed:
    def test_minmax_ranks_agree_and_equal_single_process(self, dist_results):
        r0, r1 = dist_results
        _assert_export_equal(r0["export_minmax"], r1["export_minmax"])
        single = _dist_model("minmax")
        qgru.calibrate(single, _dist_data(), progress=False)
        single.convert()
        _assert_export_equal(r0["export_minmax"], single.export().to_dict())
        assert torch.equal(r0["out_minmax"], single(_dist_data()[0])[0])

    def test_percentile_ranks_agree_and_equal_single_process(self, dist_results):
        """The histograms are summed on common bins: two ranks with half the data each convert
        exactly as one process with all of it."""
        r0, r1 = dist_results
        _assert_export_equal(r0["export_percentile"], r1["export_percentile"])
        single = _dist_model("percentile")
        qgru.calibrate(single, _dist_data(), progress=False)
        single.convert()
        _assert_export_equal(r0["export_percentile"], single.export().to_dict())
        assert torch.equal(r0["out_percentile"], single(_dist_data()[0])[0])

    def test_mse_ranks_agree_and_equal_single_process(self, dist_results):
        """The mse search reads the summed histogram (and zero counts): every rank chooses the grids
        one process with all the data would."""
        r0, r1 = dist_results
        _assert_export_equal(r0["export_mse"], r1["export_mse"])
        single = _dist_model("mse")
        qgru.calibrate(single, _dist_data(), progress=False)
        single.convert()
        _assert_export_equal(r0["export_mse"], single.export().to_dict())
        assert torch.equal(r0["out_mse"], single(_dist_data()[0])[0])

    def test_minmax_needs_the_reduction(self, dist_results):
        """Without the reduction a rank would convert from half of the data: it differs."""
        half = _dist_model("minmax")
        qgru.calibrate(half, _dist_data()[:DIST_N_BATCHES // 2], progress=False)
        half.convert()
        e = half.export().to_dict()
        r0 = dist_results[0]["export_minmax"]
        assert any(isinstance(v, torch.Tensor) and not torch.equal(v, r0[k]) for k, v in e.items())

    def test_ema_ranks_agree(self, dist_results):
        r0, r1 = dist_results
        _assert_export_equal(r0["export_ema"], r1["export_ema"])
        assert torch.equal(r0["out_ema"], r1["out_ema"])

    def test_observer_sync_values(self, dist_results):
        for r in dist_results:
            obs = r["obs"]
            for kind in ("minmax", "percentile"):  # 4 values: the percentile keeps them all
                lo, hi, n = obs[f"{kind}_scalar"]
                assert (float(lo), float(hi), n) == (-2.0, 5.0, 4)  # rank0 [-1, 2], rank1 [-2, 5]
            lo, hi, n = obs["ema_scalar"]
            assert float(lo) == pytest.approx(-1.5) and float(hi) == pytest.approx(3.5) and n == 4
            for kind in ("minmax", "percentile"):
                lo, hi, n = obs[f"{kind}_channels"]
                assert lo.tolist() == [0.0, -2.0] and hi.tolist() == [1.0, 0.0] and n == 4
            lo, hi, n = obs["ema_channels"]
            assert lo.tolist() == [0.5, -1.0] and hi.tolist() == [0.5, -1.0]
            for kind in ("minmax", "ema", "percentile"):  # the rank without data adopts the other rank's
                lo, hi, n = obs[f"{kind}_one_rank"]
                assert (float(lo), float(hi), n) == (-3.0, 5.0, 2)

    def test_observer_sync_keeps_shape(self, dist_results):
        for r in dist_results:
            for key in ("minmax_scalar", "ema_scalar", "percentile_scalar", "minmax_one_rank", "ema_one_rank",
                        "percentile_one_rank"):
                lo, hi, _ = r["obs"][key]
                assert lo.shape == () and hi.shape == (), key

    def test_ema_export_shapes_match_single_process(self, dist_results):
        single = _dist_model("ema")
        qgru.calibrate(single, _dist_data(), progress=False)
        single.convert()
        s = single.export().to_dict()
        d = dist_results[0]["export_ema"]
        assert {k: tuple(v.shape) for k, v in d.items() if isinstance(v, torch.Tensor)} == \
               {k: tuple(v.shape) for k, v in s.items() if isinstance(v, torch.Tensor)}

    def test_ema_per_tensor_gemm_model_runs_after_reduction(self, dist_results):
        for r in dist_results:
            out = r["per_tensor_ema_out"]
            assert isinstance(out, torch.Tensor), out
            assert torch.isfinite(out).all()


class TestWeightObserver:
    W = torch.tensor([[1.0, -3.0], [0.5, 0.25], [-2.0, 1.0], [0.0, 4.0], [0.125, -0.25]])

    def test_per_channel(self):
        from qgru.observers import WeightObserver
        o = WeightObserver("W", "per_channel")
        o.observe(self.W)
        lo, hi = o.range()
        assert hi.tolist() == [3.0, 0.5, 2.0, 4.0, 0.25] and torch.equal(lo, -hi)

    def test_per_group_and_per_tensor(self):
        from qgru.observers import WeightObserver
        g = WeightObserver("W", "per_group", group_size=2)
        g.observe(self.W)
        assert g.range()[1].tolist() == [3.0, 3.0, 4.0, 4.0, 0.25]  # groups {0,1} {2,3} {4}
        t = WeightObserver("W", "per_tensor")
        t.observe(self.W)
        assert t.range()[1].tolist() == [4.0] * 5

    def test_rejects_non_finite_and_unobserved(self):
        from qgru.observers import WeightObserver
        o = WeightObserver("W")
        with pytest.raises(RuntimeError, match="saw no weight"):
            o.range()
        with pytest.raises(qgru.NonFiniteCalibrationError, match="NaN or Inf"):
            o.observe(torch.tensor([[1.0, float("nan")]]))


def test_w16a16_synthetic_floor():
    """Issue 39: w16a16 on the synthetic GRU (one layer, I=256, H=512, T=100, batch 64, randn inputs,
    three calibration batches, evaluated on a fourth) has a 70 dB output SQNR floor against float
    nn.GRU. The mse observer made the default on 2026-11-23 gave 69.73 dB here; percentile 73.86."""
    torch.manual_seed(0)
    gru = torch.nn.GRU(256, 512).eval()
    calib = [torch.randn(100, 64, 256) for _ in range(3)]
    x = torch.randn(100, 64, 256)
    q = qgru.quantize_model(gru, calib, config="w16a16", progress=False)
    with torch.no_grad():
        ref, out = gru(x)[0].double(), q(x)[0].double()
    sqnr = float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum()))
    assert sqnr >= 70.0, sqnr
