"""Hostile input, round four: each test named here failed on the code before its fix."""


# ---- PackedSequence at long T: the way in and out of a packed call were per-step Python loops ----
def _count_torch_calls(fn):
    """The number of Python-level torch function and Tensor method calls fn() makes."""
    from torch.overrides import TorchFunctionMode

    class _Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            _Count.n += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return _Count.n


def _packed_of(T, batch_first=False, enforce_sorted=False, I=4, seed=0):
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T - 3, T, T // 2, T - 3, 1])  # uneven, a tie, a sequence of one step
    if enforce_sorted:
        lengths = lengths.sort(descending=True).values
    x = torch.randn(len(lengths), T, I, generator=g)  # batch-first; padding stays random (garbage)
    x = x if batch_first else x.transpose(0, 1).contiguous()
    return pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=enforce_sorted), x, lengths


def test_packed_call_makes_as_many_torch_calls_at_T_500_as_at_T_50():
    """A converted model's PackedSequence call (cpu backend): its Python-level torch calls do not
    grow with T. Before the fix, QuantGRU._finish turned the padded output back into packed data one
    step at a time (three torch calls per step), so that one call at T = 20000, N = 2 took ~10x the
    same batch padded."""
    import torch
    import qgru
    torch.manual_seed(0)
    m = qgru.QuantGRU(4, 5, num_layers=2, bidirectional=True)
    qgru.calibrate(m, [torch.randn(20, 3, 4)], progress=False)
    m.convert()
    packed = {T: _packed_of(T)[0] for T in (50, 500)}
    with qgru.backend("cpu"):
        m(packed[50])  # the first call prepares the native layers (once)
        counts = {T: _count_torch_calls(lambda: m(packed[T])) for T in (50, 500)}
    assert counts[50] == counts[500], counts


def test_packed_way_out_of_every_mode_makes_as_many_torch_calls_at_any_T():
    """The float reference (calibration) and QAT paths share the converted path's way out
    (QuantGRU._finish, padded -> PackedSequence), and WeightOnlyGRU has its own (_repack): neither
    loops over the steps in Python."""
    import torch
    import qgru
    from qgru.weight_only import module as wo_module
    m = qgru.QuantGRU(4, 5)
    counts = {}
    for T in (50, 500):
        p, _, _ = _packed_of(T)
        out = torch.randn(T, 5, 5)
        h_n = torch.randn(1, 5, 5)
        counts[T] = (_count_torch_calls(lambda: m._finish(out, h_n, p, False, True)),
                     _count_torch_calls(lambda: wo_module._repack(out, p)))
    assert counts[50] == counts[500], counts


def test_packed_data_and_reversal_match_torch_and_a_per_sequence_flip():
    """The vectorised way out equals torch's own pack_padded_sequence (sorted and unsorted, ties
    in the lengths), and the reversal within lengths (bidirectional packed input) equals flipping
    each sequence's valid steps alone, padding rows left in place."""
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence
    from qgru.runtime import packed_rows, reverse_within_lengths
    g = torch.Generator().manual_seed(3)
    for lengths, es in (([7, 7, 3, 1], True), ([2, 9, 9, 4, 1, 9], False), ([1], True)):
        L = torch.tensor(lengths)
        T, N = int(L.max()), len(lengths)
        out = torch.randn(T, N, 6, generator=g)
        ref = pack_padded_sequence(out, L, enforce_sorted=es)
        assert torch.equal(packed_rows(out, ref.batch_sizes, ref.sorted_indices), ref.data)
        for x in (out, out[..., 0].to(torch.int16)):  # [T, N, F] and [T, N] (a level index)
            r = reverse_within_lengths(x, L)
            for n, l in enumerate(lengths):
                assert torch.equal(r[:l, n], x[:l, n].flip(0))
                assert torch.equal(r[l:, n], x[l:, n])


def test_packed_call_is_bit_exact_per_sequence_on_cpu_and_reference():
    """Packed input (uneven lengths, enforce_sorted True and False, batch_first or not, 2 layers
    bidirectional, with h0) gives, per sequence, exactly what that sequence alone gives padded,
    on the cpu and the reference backend; and the two backends agree."""
    import torch
    import qgru
    from torch.nn.utils.rnn import pad_packed_sequence
    results = {}
    for bf in (False, True):
        torch.manual_seed(1)
        m = qgru.QuantGRU(4, 5, num_layers=2, bidirectional=True, batch_first=bf)
        qgru.calibrate(m, [torch.randn(3, 12, 4) if bf else torch.randn(12, 3, 4)], progress=False)
        m.convert()
        h0 = torch.randn(4, 5, 5) * 0.5
        for es in (True, False):
            p, x, lengths = _packed_of(9, batch_first=bf, enforce_sorted=es, seed=2)
            for be in ("cpu", "reference"):
                with qgru.backend(be):
                    out, h_n = m(p, h0)
                    padded, out_len = pad_packed_sequence(out, batch_first=bf)
                    assert torch.equal(out_len, lengths)
                    for i, L in enumerate(lengths.tolist()):
                        xi = x[i:i + 1, :L] if bf else x[:L, i:i + 1]
                        o_i, h_i = m(xi, h0[:, i:i + 1].contiguous())
                        assert torch.equal(padded[i:i + 1, :L] if bf else padded[:L, i:i + 1], o_i), (bf, es, be, i)
                        assert torch.equal(h_n[:, i], h_i[:, 0]), (bf, es, be, i)
                results[(bf, es, be)] = (out.data, h_n)
            assert all(torch.equal(a, b) for a, b in zip(results[(bf, es, "cpu")], results[(bf, es, "reference")]))


# ---- wide inputs and gptq: E[x x^T] is I x I float64 (I=16384: 146 s, 10.7 GB; I=32768: an allocator error) ----
def _wide_calib(I, seed=0, T=6, N=2):
    """Bag-of-words-like calibration batches [T, N, I] with a common positive mean (gptq then differs
    from nearest rounding)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(T, N, I, generator=g) < 0.3).float() * 2.0 + 0.5 for _ in range(2)]


def _calibrated_converted(gru, config, batches):
    import qgru
    from qgru.module import QuantGRU
    q = QuantGRU.from_float(gru, config)
    qgru.calibrate(q, batches, progress=False)
    moments = {k: {n: m.size for n, m in v.items()} for k, v in q._moments.items()}
    q.convert()
    return q, moments


def test_gptq_default_rounds_a_wider_input_than_4096_to_nearest_with_a_warning_and_no_i_by_i_moment():
    """Default config, I = 4097 (just above gptq_max_size's default 4096): one WeightRoundingWarning
    at calibration naming I, the threshold and both ways to choose; no 4097 x 4097 moment is kept;
    W's integers are exactly weight_rounding 'nearest''s, R keeps gptq (its H x H moment stays)."""
    import warnings
    import pytest
    import torch
    import qgru
    from qgru.config import GPTQ_MAX_SIZE, QuantConfig
    I = GPTQ_MAX_SIZE + 1
    torch.manual_seed(0)
    gru = torch.nn.GRU(I, 4)
    batches = _wide_calib(I)
    with pytest.warns(qgru.WeightRoundingWarning) as rec:
        q, moments = _calibrated_converted(gru, "w8a16", batches)
    ours = [w for w in rec if issubclass(w.category, qgru.WeightRoundingWarning)]
    assert len(ours) == 1  # one for the model, not one per batch or direction
    msg = str(ours[0].message)
    assert "input_size=4097" in msg and "gptq_max_size is 4096" in msg and "weight_ih_l0" in msg
    assert "'weight_rounding': 'nearest'" in msg and "'gptq_max_size': 4097" in msg
    assert moments == {(0, 0): {"h": 4}}  # the x moment was never created; h's is
    with warnings.catch_warnings():
        warnings.simplefilter("error", qgru.WeightRoundingWarning)  # explicit nearest: no warning
        near, moments_n = _calibrated_converted(gru, QuantConfig.load("w8a16", {"weight_rounding": "nearest"}), batches)
    assert moments_n == {}
    p, pn = q._qparams[0][0], near._qparams[0][0]
    assert torch.equal(p.W, pn.W) and torch.equal(p.scale["W"], pn.scale["W"])
    assert not torch.equal(p.R, pn.R)  # R is still rounded by gptq


def test_gptq_max_size_boundary_and_explicit_choice():
    """gptq_max_size K: an operand exactly K wide keeps gptq, K + 1 rounds to nearest; the rest of the
    model is unchanged (R's integers equal a full-gptq model's, W's a nearest model's); the same for
    h (weight_hh) and for a later layer's x (H * directions wide). The key round-trips and is
    validated."""
    import warnings
    import pytest
    import torch
    import qgru
    from qgru.config import QuantConfig
    torch.manual_seed(1)
    gru = torch.nn.GRU(9, 4)
    batches = _wide_calib(9, T=20, N=4)
    cfg = lambda **o: QuantConfig.load("w8a16", o)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qgru.WeightRoundingWarning)
        full, m_full = _calibrated_converted(gru, cfg(gptq_max_size=9), batches)  # exactly I: gptq, no warning
    near, _ = _calibrated_converted(gru, cfg(weight_rounding="nearest"), batches)
    with pytest.warns(qgru.WeightRoundingWarning, match=r"weight_ih_l0 \(its operand x is 9 wide\) is rounded to nearest"):
        capped, m_cap = _calibrated_converted(gru, cfg(gptq_max_size=8), batches)
    assert m_full == {(0, 0): {"x": 9, "h": 4}} and m_cap == {(0, 0): {"h": 4}}
    f, n, c = (m._qparams[0][0] for m in (full, near, capped))
    assert not torch.equal(f.W, n.W)  # the data tell gptq from nearest
    assert torch.equal(c.W, n.W) and torch.equal(c.R, f.R)
    # h wider than the cap: weight_hh rounds to nearest; a 2-layer bidirectional GRU names layer 1's x too
    gru2 = torch.nn.GRU(3, 4, num_layers=2, bidirectional=True)
    with pytest.warns(qgru.WeightRoundingWarning) as rec:
        q2, m2 = _calibrated_converted(gru2, cfg(gptq_max_size=3), _wide_calib(3))
    msg = str(rec[0].message)
    assert "weight_hh_l0 and its _reverse (its operand h is 4 wide)" in msg
    assert "weight_ih_l1 and its _reverse (its operand x is 8 wide)" in msg and "weight_ih_l0 " not in msg
    assert m2 == {(0, 0): {"x": 3}, (0, 1): {"x": 3}, (1, 0): {}, (1, 1): {}}
    c = cfg(gptq_max_size=9)
    assert QuantConfig.load(c.to_dict()) == c and c.to_dict()["gptq_max_size"] == 9
    assert "gptq_max_size" not in QuantConfig.load("w8a16").to_dict()  # the default's dict is as before
    for bad in (0, -1, True, 2.5, "9"):
        with pytest.raises(ValueError, match="gptq_max_size must be a positive integer"):
            cfg(gptq_max_size=bad)


def test_gptq_allocation_failure_is_a_clear_qgru_error(monkeypatch):
    """An explicit gptq_max_size too large for the machine: the allocator's raw RuntimeError (as
    torch's CPU allocator raises it) becomes qgru.WeightRoundingMemoryError naming the size and the
    way out, at calibration (the moment) and at convert() (its factors); a moment that is not
    positive definite still rounds to nearest."""
    import pytest
    import torch
    import qgru
    from qgru.convert import gptq_round
    from qgru.observers import SecondMoment
    oom = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)")

    def fail(*a, **k):
        raise oom

    m = SecondMoment("layer 0 x", 5)
    with monkeypatch.context() as mp:
        mp.setattr(torch.Tensor, "__matmul__", fail)
        with pytest.raises(qgru.WeightRoundingMemoryError, match=r"5 x 5 float64 second moment of layer 0 x.*"
                                                                   r"gptq_max_size below 5") as e:
            m.observe(torch.ones(3, 5))
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, MemoryError)
    w, s = torch.randn(6, 5), torch.full((6,), 0.02, dtype=torch.float64)  # (some clamp at 127)
    M = torch.eye(5, dtype=torch.float64) + 1.0
    with monkeypatch.context() as mp:
        mp.setattr(torch.linalg, "cholesky", fail)
        with pytest.raises(qgru.WeightRoundingMemoryError, match=r"5 x 5 float64 factors.*gptq_max_size below 5"):
            gptq_round(w, s, M, 8)

    def not_pd(*a, **k):
        raise torch.linalg.LinAlgError("not positive-definite")

    with monkeypatch.context() as mp:
        mp.setattr(torch.linalg, "cholesky", not_pd)
        nearest = (w.double() / s.unsqueeze(1)).round().clamp(-127, 127).to(torch.int64)
        assert torch.equal(gptq_round(w, s, M, 8), nearest)


# A calling thread keeps no large scratch between calls (csrc/cpu/qgru_cpu.cpp BufferPool): eight
# pool threads that each made one large call used to keep their buffers (the quantized input, each
# layer's int32 output) until they ended, 8x the largest call's, never given back.
_THREAD_SCRATCH = r"""
import ctypes, gc, json, sys
from concurrent.futures import ThreadPoolExecutor
import torch, qgru
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
def trim():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
config = qgru.QuantConfig.load("w8a8", {"observer": {"kind": "minmax"}, "weight_rounding": "nearest"})
growth = {}
# (name, layers, bidirectional, I, H): the one-call path (unidirectional) and the layer-by-layer
# one (bidirectional: the input quantized by the quantize binding, once per direction)
for name, L, bidir, I, H in [("one_call", 2, False, 128, 128), ("bidirectional", 1, True, 256, 32)]:
    torch.manual_seed(0)
    m = qgru.QuantGRU(I, H, num_layers=L, bidirectional=bidir, config=config)
    qgru.calibrate(m, [torch.randn(4, 2, I)], progress=False)
    m.convert()
    x = torch.randn(250, 64, I)
    with torch.no_grad(), ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda _: m(x[:2, :2]) and None, range(8)))  # each thread's first (small) call
        trim()
        base = rss_mb()
        # what stays held after every one of three rounds: glibc's arenas keep a varying part of
        # freed memory (the bidirectional case read 60-105 MB after a single round on a 2-core AMD
        # EPYC Zen 3, 2026-12-02), while scratch that threads kept would be there after each round
        kept = []
        for _ in range(3):
            list(ex.map(lambda _: m(x) and None, range(8)))
            trim()
            kept.append(rss_mb() - base)
        growth[name] = min(kept)
    del m
print("RESULT " + json.dumps(growth))
"""


def test_threads_keep_no_large_scratch_between_calls():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    import pytest
    import qgru
    if not sys.platform.startswith("linux"):
        pytest.skip("RSS from /proc, glibc's malloc_trim")
    if qgru.backends()["cpu"]["why"]:
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    r = subprocess.run([sys.executable, "-c", _THREAD_SCRATCH], cwd=Path(__file__).resolve().parent.parent,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "QGRU_NO_BUILD": "1"})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"child process failed (rc {r.returncode}): {r.stderr[-3000:]}"
    growth = json.loads(lines[-1][len("RESULT "):])
    # T=250 N=64: 8.2 MB per int32 buffer of I=H=128, 16.4 MB per quantized I=256 input. Kept per
    # thread (the old code), 8 threads held ~130 MB (one call: input and layer 0's output) and ~260 MB
    # (two directions' inputs); now at most the shared pool's 32 MiB, plus the layers' own outputs.
    assert growth["one_call"] < 48, growth
    assert growth["bidirectional"] < 80, growth


def test_packed_way_in_equals_pad_packed_sequence_and_refuses_malformed_packing():
    """The vectorised way in gives pad_packed_sequence's padded batch (zeros at the padding) and
    lengths (int64, CPU, original order); a PackedSequence that pack_padded_sequence could not have
    made (batch sizes growing, zero, not summing to the data's rows; indices not a permutation and
    its inverse) is a QGRUInputError on the converted model, not a read out of bounds."""
    import pytest
    import torch
    import qgru
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence
    from qgru.runtime import padded_from_packed
    g = torch.Generator().manual_seed(4)
    for lengths, es in (([7, 7, 3, 1], True), ([2, 9, 9, 4, 1, 9], False), ([1], True)):
        L = torch.tensor(lengths)
        p = pack_padded_sequence(torch.randn(int(L.max()), len(lengths), 3, generator=g), L, enforce_sorted=es)
        x, lens = padded_from_packed(p)
        rx, rlens = pad_packed_sequence(p)
        assert torch.equal(x, rx) and torch.equal(lens, rlens) and lens.dtype == rlens.dtype and lens.is_cpu
    torch.manual_seed(0)
    m = qgru.QuantGRU(3, 4)
    qgru.calibrate(m, [torch.randn(6, 2, 3)], progress=False)
    m.convert()
    d = torch.randn(6, 3)
    perm = torch.tensor([1, 0, 2])
    bad = {"growing": (torch.tensor([1, 2, 3]), None, None),
           "zero": (torch.tensor([3, 3, 0]), None, None),
           "short": (torch.tensor([3, 2]), None, None),
           "not_a_permutation": (torch.tensor([3, 2, 1]), torch.tensor([0, 0, 2]), torch.tensor([0, 1, 2])),
           "not_the_inverse": (torch.tensor([3, 2, 1]), torch.tensor([1, 2, 0]), torch.tensor([1, 2, 0])),
           "indices_too_short": (torch.tensor([3, 2, 1]), perm[:2], perm[:2])}
    for name, (bs, si, ui) in bad.items():
        p = PackedSequence.__new__(PackedSequence, d, bs, si, ui)  # the namedtuple, unchecked
        with pytest.raises(qgru.QGRUInputError, match="PackedSequence"):
            m(p)
        assert name
    ok = PackedSequence.__new__(PackedSequence, d, torch.tensor([3, 2, 1]), perm, perm)  # perm is its own inverse
    assert m(ok)[0].data.shape == (6, 4)


def test_pooled_scratch_is_bit_exact_shared_by_threads_and_never_overwritten_while_held():
    """Buffers above a thread's own cap (256 KiB) come from the process's shared pool: one-call and
    bidirectional calls across that cap, from two threads at once, equal the reference backend
    bit for bit; a held quantize result is never handed out again, and a dropped one is reused,
    also by another thread (one pool, not one per thread)."""
    import threading
    import pytest
    import torch
    import qgru
    from qgru import native, primitives
    if qgru.backends()["cpu"]["why"]:
        pytest.skip(f"cpu backend unavailable: {qgru.backends()['cpu']['why']}")
    config = qgru.QuantConfig.load("w8a8", {"observer": {"kind": "minmax"}, "weight_rounding": "nearest"})
    gen = torch.Generator().manual_seed(3)
    models = []
    for L, bidir in ((2, False), (1, True)):
        torch.manual_seed(0)
        m = qgru.QuantGRU(48, 48, num_layers=L, bidirectional=bidir, config=config)
        qgru.calibrate(m, [torch.randn(6, 3, 48, generator=gen)], progress=False)
        models.append(m.convert())
    # T N 48 int32 values: 368 KiB at (40, 49) and (49, 40), over the cap; (1, 1) and (5, 3) under it
    shapes = [(40, 49), (1, 1), (49, 40), (5, 3), (40, 49)]
    cases = [(m, torch.randn(T, N, 48, generator=gen) * 3) for m in models for T, N in shapes]
    with torch.no_grad(), qgru.backend("reference"):
        want = [m(x) for m, x in cases]
    got = {}

    def work(first):
        with torch.no_grad(), qgru.backend("cpu"):
            for i in range(first, len(cases), 2):
                for _ in range(2):
                    got[i] = cases[i][0](cases[i][1])

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(cases)
    for i, w in enumerate(want):
        g = got[i]
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]), (i, cases[i][1].shape)

    mod = native.load("cpu")
    scale, zp = torch.tensor(0.01, dtype=torch.float64), torch.tensor(3)
    f = [torch.randn(70001, generator=gen) for _ in range(2)]  # 273 KiB of int32: pooled
    q0 = mod.quantize(f[0], 0.01, 3, 8, "input")
    q1 = mod.quantize(f[1], 0.01, 3, 8, "input")
    assert q0.data_ptr() != q1.data_ptr()
    assert torch.equal(q0.long(), primitives.quantize(f[0], scale, zp, 8))
    assert torch.equal(q1.long(), primitives.quantize(f[1], scale, zp, 8))
    ptr = q1.data_ptr()
    del q1
    q2 = [None]
    t = threading.Thread(target=lambda: q2.__setitem__(0, mod.quantize(f[1], 0.01, 3, 8, "input")))
    t.start()
    t.join()
    assert q2[0].data_ptr() == ptr and torch.equal(q2[0].long(), primitives.quantize(f[1], scale, zp, 8))
    assert torch.equal(q0.long(), primitives.quantize(f[0], scale, zp, 8))  # held: untouched
