"""Tests of qgru.primitives against independent references (Python ints and fractions.Fraction).

No expected value here is computed with the code under test: every reference is exact rational
arithmetic on Python integers, so an int64 overflow, a wrong rounding direction or an off-by-one
shift in qgru shows up as a mismatch.
"""
from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qgru.primitives import (INT8_GEMM_K_MAX, choose_qparams, dequantize, int_matmul, int_matmul_limbs,
                             qrange, quantize, quantize_multiplier, round_half_up, rounding_mul_shift,
                             rounding_shift, saturate)

HALF = Fraction(1, 2)
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ref_round_half_up(v: Fraction) -> int:
    """floor(v + 1/2) of an exact rational."""
    return math.floor(v + HALF)


def ref_mul_shift(x: int, m: int, s: int) -> int:
    return ref_round_half_up(Fraction(x * m, 2 ** s))


def mult_bits(x_bits: int) -> int:
    return min(31, 62 - x_bits)


def t64(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# rounding_mul_shift
# ---------------------------------------------------------------------------------------------
@st.composite
def mul_shift_case(draw):
    x_bits = draw(st.integers(1, 48))
    m_max = min(2 ** (62 - x_bits), 2 ** 31) - 1
    xs = draw(st.lists(st.integers(-(2 ** x_bits - 1), 2 ** x_bits - 1), min_size=1, max_size=16))
    m = draw(st.integers(0, m_max))
    s = draw(st.integers(1, 62))
    return x_bits, xs, m, s


@SETTINGS
@given(mul_shift_case())
def test_rounding_mul_shift_matches_fraction(case):
    _, xs, m, s = case
    got = rounding_mul_shift(t64(xs), t64(m), t64(s))
    assert got.dtype == torch.int64
    assert got.tolist() == [ref_mul_shift(x, m, s) for x in xs]


@pytest.mark.parametrize("x_bits", range(1, 49))
def test_rounding_mul_shift_extremes(x_bits):
    """Largest |x|, largest multiplier, both ends of the shift range: no int64 wrap-around."""
    x_max = 2 ** x_bits - 1
    m_max = min(2 ** (62 - x_bits), 2 ** 31) - 1
    xs = [x_max, -x_max, x_max - 1, -(x_max - 1), 1, -1, 0]
    for m in (m_max, m_max - 1, 1, 0):
        for s in (1, 2, 31, 32, 61, 62):
            got = rounding_mul_shift(t64(xs), t64(m), t64(s)).tolist()
            assert got == [ref_mul_shift(x, m, s) for x in xs], (x_bits, m, s)


def test_rounding_mul_shift_half_rounds_up():
    # x * m / 2**s exactly k + 1/2: rounds towards +inf for both signs
    xs = t64([1, 3, -1, -3, 5, -5])
    got = rounding_mul_shift(xs, t64(1), t64(1)).tolist()
    assert got == [1, 2, 0, -1, 3, -2]


@pytest.mark.parametrize("s", range(1, 62))
def test_rounding_mul_shift_ties_and_neighbours_at_every_shift(s):
    """x * m = (odd) * 2**(s-1) +- 1: ties round up, their neighbours round to nearest.

    (s = 62 has no tie within the preconditions: x * m = 2**61 needs m = 2**(62 - x_bits).)"""
    cases = []
    for a in range(0, s):  # x carries 2**a, m carries 2**(s-1-a)
        b = s - 1 - a
        for odd in (1, 3, 5):
            x = odd << a
            x_bits = x.bit_length()
            if x_bits > 48 or (1 << b) >= min(2 ** (62 - x_bits), 2 ** 31):
                continue
            cases += [(x, 1 << b), (-x, 1 << b)]
    for odd in (1, 3):  # neighbours of a tie: m = 1, x = odd * 2**(s-1) +- 1 (only while x fits)
        x = odd << (s - 1)
        if (x + 1).bit_length() <= 48:
            cases += [(x - 1, 1), (x + 1, 1), (-x - 1, 1), (-x + 1, 1)]
    assert cases
    xs, ms = t64([c[0] for c in cases]), t64([c[1] for c in cases])
    got = rounding_mul_shift(xs, ms, t64(s)).tolist()
    assert got == [ref_mul_shift(x, m, s) for x, m in cases]


@SETTINGS
@given(st.data())
def test_rounding_mul_shift_per_channel_broadcast(data):
    x_bits = data.draw(st.integers(1, 48))
    C = data.draw(st.integers(1, 6))
    N = data.draw(st.integers(1, 4))
    m_max = min(2 ** (62 - x_bits), 2 ** 31) - 1
    ints = st.integers(-(2 ** x_bits - 1), 2 ** x_bits - 1)
    x = data.draw(st.lists(st.lists(ints, min_size=C, max_size=C), min_size=N, max_size=N))
    m = data.draw(st.lists(st.integers(0, m_max), min_size=C, max_size=C))
    s = data.draw(st.lists(st.integers(1, 62), min_size=C, max_size=C))
    got = rounding_mul_shift(t64(x), t64(m), t64(s))
    assert got.shape == (N, C)
    expect = [[ref_mul_shift(x[n][c], m[c], s[c]) for c in range(C)] for n in range(N)]
    assert got.tolist() == expect
    # and a scalar multiplier with a per-channel shift, a per-channel multiplier with a scalar shift
    got = rounding_mul_shift(t64(x), t64(m[0]), t64(s)).tolist()
    assert got == [[ref_mul_shift(x[n][c], m[0], s[c]) for c in range(C)] for n in range(N)]
    got = rounding_mul_shift(t64(x), t64(m), t64(s[0])).tolist()
    assert got == [[ref_mul_shift(x[n][c], m[c], s[0]) for c in range(C)] for n in range(N)]


# ---------------------------------------------------------------------------------------------
# quantize_multiplier
# ---------------------------------------------------------------------------------------------
@SETTINGS
@given(st.floats(1e-9, 1e6, allow_nan=False, allow_infinity=False), st.integers(1, 54))
def test_quantize_multiplier_bounds_and_error(real, x_bits):
    bits = mult_bits(x_bits)
    if real >= 2 ** (bits - 1):
        # largest representable factor is (2**bits - 1) / 2 (shift 1): this one needs shift < 1
        with pytest.raises(ValueError):
            quantize_multiplier(real, x_bits)
        return
    assume(real <= 2 ** (bits - 1) - 1)  # skip the sliver where rounding decides
    m, s = quantize_multiplier(real, x_bits)
    assert isinstance(m, int) and isinstance(s, int)
    assert 0 <= m < 2 ** bits
    assert 2 ** (bits - 1) <= m  # normalised (no shift clamping happens for reals >= 1e-9)
    assert 1 <= s <= 62
    rel = abs(Fraction(m, 2 ** s) - Fraction(real)) / Fraction(real)
    assert rel <= Fraction(1, 2 ** (bits - 1))


@pytest.mark.parametrize("x_bits", [1, 8, 16, 24, 31, 32, 40, 48, 54])
def test_quantize_multiplier_power_of_two_exact(x_bits):
    bits = mult_bits(x_bits)
    for k in range(-62, bits - 1):  # every power of two whose shift is >= 1
        real = 2.0 ** k
        for pow2 in (True, False):
            m, s = quantize_multiplier(real, x_bits, power_of_two=pow2)
            assert Fraction(m, 2 ** s) == Fraction(real), (k, pow2, m, s)
            assert 0 <= m < 2 ** bits and 1 <= s <= 62
    with pytest.raises(ValueError):
        quantize_multiplier(2.0 ** (bits - 1), x_bits, power_of_two=True)


@pytest.mark.parametrize("real", [3.0, 0.3, 1.5, 0.75, 1.0 + 2 ** -52, 2.0 ** 10 * 1.25, 1e-7])
def test_quantize_multiplier_power_of_two_rejects_non_powers(real):
    with pytest.raises(ValueError):
        quantize_multiplier(real, 16, power_of_two=True)
    m, s = quantize_multiplier(real, 16)  # the general mode accepts it
    assert m > 0


@pytest.mark.parametrize("real", [0.0, -0.0, -1.0, -2.0 ** -20, float("inf"), float("-inf"), float("nan")])
def test_quantize_multiplier_rejects_non_positive_or_non_finite(real):
    for pow2 in (False, True):
        with pytest.raises(ValueError):
            quantize_multiplier(real, 16, power_of_two=pow2)


def test_quantize_multiplier_too_large_raises():
    with pytest.raises(ValueError):
        quantize_multiplier(2.0 ** 40, 32)
    with pytest.raises(ValueError):
        quantize_multiplier(2.0 ** 40, 32, power_of_two=True)
    # the boundary: 2**(bits-2) is shift 1; 2**(bits-1) needs shift 0
    for x_bits in (1, 31, 32, 48):
        bits = mult_bits(x_bits)
        assert quantize_multiplier(2.0 ** (bits - 2), x_bits) == (2 ** (bits - 1), 1)
        with pytest.raises(ValueError):
            quantize_multiplier(2.0 ** (bits - 1), x_bits)


def test_quantize_multiplier_too_few_multiplier_bits_raises():
    with pytest.raises(ValueError):
        quantize_multiplier(0.5, 55)  # 62 - 55 = 7 bits < 8


@st.composite
def composition_case(draw):
    x_bits = draw(st.integers(1, 48))
    bits = mult_bits(x_bits)
    e = draw(st.floats(-40.0, bits - 2.0))
    real = 2.0 ** e
    # the rescaled result stays below 2**(bits-2) (true at every call site: outputs are <= 32 bits);
    # the factor's relative error 2**-bits then moves x*real by at most 1/4
    bound = min(2 ** x_bits - 1, int(Fraction(2 ** (bits - 2)) / Fraction(real)))
    x = draw(st.integers(-bound, bound))
    return x_bits, x, real


@SETTINGS
@given(composition_case())
def test_quantize_multiplier_then_mul_shift_within_one(case):
    x_bits, x, real = case
    m, s = quantize_multiplier(real, x_bits)
    got = rounding_mul_shift(t64([x]), t64(m), t64(s)).item()
    exact = ref_round_half_up(Fraction(x) * Fraction(real))
    assert abs(got - exact) <= 1


@SETTINGS
@given(st.integers(1, 48), st.data())
def test_quantize_multiplier_then_mul_shift_power_of_two_exact(x_bits, data):
    bits = mult_bits(x_bits)
    k = data.draw(st.integers(-62, bits - 2))
    x = data.draw(st.integers(-(2 ** x_bits - 1), 2 ** x_bits - 1))
    real = 2.0 ** k
    for pow2 in (True, False):
        m, s = quantize_multiplier(real, x_bits, power_of_two=pow2)
        got = rounding_mul_shift(t64([x]), t64(m), t64(s)).item()
        assert got == ref_round_half_up(Fraction(x) * Fraction(real))


# ---------------------------------------------------------------------------------------------
# round_half_up, rounding_shift
# ---------------------------------------------------------------------------------------------
def test_round_half_up_ties():
    v = torch.tensor([-0.5, 0.5, -1.5, 2.5, 1.5, -2.5, 0.0, -0.0, 3.0, -3.0])
    got = round_half_up(v)
    assert got.dtype == torch.int64
    assert got.tolist() == [0, 1, -1, 3, 2, -2, 0, 0, 3, -3]
    # differs from torch.round (half to even) on these ties
    assert got.tolist() != torch.round(v).long().tolist()


def test_round_half_up_float32_neighbours_of_ties():
    vals = []
    for tie in (-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 1000.5, -1000.5, 2.0 ** 22 + 0.5):
        t = torch.tensor(tie, dtype=torch.float32)
        vals += [torch.nextafter(t, torch.tensor(-math.inf)), t, torch.nextafter(t, torch.tensor(math.inf))]
    v = torch.stack(vals)
    assert v.dtype == torch.float32
    expect = [ref_round_half_up(Fraction(float(x))) for x in v.tolist()]
    assert round_half_up(v).tolist() == expect


@SETTINGS
@given(st.lists(st.floats(-2.0 ** 40, 2.0 ** 40, width=32), min_size=1, max_size=32))
def test_round_half_up_exact_for_float32(vals):
    v = torch.tensor(vals, dtype=torch.float32)
    expect = [ref_round_half_up(Fraction(x)) for x in v.tolist()]
    assert round_half_up(v).tolist() == expect


@SETTINGS
@given(st.lists(st.integers(-(2 ** 61) + 1, 2 ** 61 - 1), min_size=1, max_size=16), st.integers(0, 62))
def test_rounding_shift_matches_fraction(vs, shift):
    got = rounding_shift(t64(vs), shift)
    assert got.tolist() == [ref_round_half_up(Fraction(v, 2 ** shift)) for v in vs]


def test_rounding_shift_small_cases():
    v = t64([-3, -2, -1, 0, 1, 2, 3, 5, -5])
    assert rounding_shift(v, 0).tolist() == v.tolist()
    assert rounding_shift(v, 1).tolist() == [-1, -1, 0, 0, 1, 1, 2, 3, -2]


# ---------------------------------------------------------------------------------------------
# qrange, saturate, quantize, dequantize
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(2, 17))
def test_qrange_and_saturate(bits):
    lo, hi = qrange(bits)
    assert (lo, hi) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    vals = list(range(-(2 ** 17), 2 ** 17, 97)) + [lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, -(2 ** 62), 2 ** 62]
    got = saturate(t64(vals), bits).tolist()
    assert got == [min(max(v, lo), hi) for v in vals]


@pytest.mark.parametrize("bits", [0, 1, 33, 64])
def test_qrange_rejects_bad_widths(bits):
    with pytest.raises(ValueError):
        qrange(bits)


@pytest.mark.parametrize("bits", [2, 4, 8, 12, 16])
def test_quantize_saturates_out_of_range(bits):
    qmin, qmax = qrange(bits)
    scale, zp = torch.tensor(0.1, dtype=torch.float64), t64(1)
    x = torch.tensor([1e3 * 2 ** bits, -1e3 * 2 ** bits, (qmax - 1 + 0.7) * 0.1, (qmin - 1 - 0.7) * 0.1,
                      1e12, -1e12])
    got = quantize(x, scale, zp, bits).tolist()
    assert got == [qmax, qmin, qmax, qmin, qmax, qmin]


def test_quantize_saturates_huge_and_infinite():
    # quotients beyond int64 (1e30 / 0.01, inf) must saturate, not wrap to INT64_MIN -> qmin
    # (regression: the float64 -> int64 cast used to happen before the saturation)
    for zp in (3, 0, -5, 127, -128):
        scale, z = torch.tensor(0.01, dtype=torch.float64), t64(zp)
        x = torch.tensor([1e30, float("inf"), 1e19, 3e38, -1e30, float("-inf"), -1e19, -3e38])
        assert quantize(x, scale, z, 8).tolist() == [127] * 4 + [-128] * 4
    tiny = torch.tensor(2.0 ** -40, dtype=torch.float64)  # degenerate-range grid
    assert quantize(torch.tensor([1e8, -1e8]), tiny, t64(-32768), 16).tolist() == [32767, -32768]


@pytest.mark.parametrize("bits", [2, 4, 8, 13, 16])
@pytest.mark.parametrize("seed", range(3))
def test_dequantize_quantize_error_within_half_step(bits, seed):
    g = torch.Generator().manual_seed(1000 * bits + seed)
    qmin, qmax = qrange(bits)
    scale = float(torch.exp(torch.empty(()).uniform_(-12, 4, generator=g)))
    zp = int(torch.randint(qmin, qmax + 1, (), generator=g))
    lo, hi = (qmin - zp) * scale, (qmax - zp) * scale
    x = (torch.rand(4000, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()
    x = torch.cat([x, torch.tensor([lo, hi, 0.0], dtype=torch.float32)])
    x = x.clamp(lo, hi)  # float32 rounding of the ends must not leave the grid
    s, z = torch.tensor(scale, dtype=torch.float64), t64(zp)
    q = quantize(x, s, z, bits)
    assert q.dtype == torch.int64 and q.min() >= qmin and q.max() <= qmax
    back = dequantize(q, s, z)
    assert back.dtype == torch.float32
    err = (back.double() - x.double()).abs()
    tol = scale / 2 * (1 + 1e-9) + x.double().abs() * 2.0 ** -23
    assert (err <= tol).all(), float((err - tol).max())
    # and the grid actually has that resolution: errors come close to half a step
    assert float(err.max()) > 0.3 * scale


# ---------------------------------------------------------------------------------------------
# choose_qparams
# ---------------------------------------------------------------------------------------------
finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False)


def check_qparams(lo: float, hi: float, bits: int, symmetric: bool, pow2: bool):
    scale_t, zp_t = choose_qparams(torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64),
                                   bits, symmetric, pow2)
    assert scale_t.dtype == torch.float64 and zp_t.dtype == torch.int64
    scale, zp = float(scale_t), int(zp_t)
    qmin, qmax = qrange(bits)
    assert math.isfinite(scale) and scale > 0
    assert qmin <= zp <= qmax
    if symmetric:
        assert zp == 0
    if pow2:
        assert math.frexp(scale)[0] == 0.5, scale  # exactly 2**k
    lo0, hi0 = min(lo, 0.0), max(hi, 0.0)
    tol = 1e-12 * max(abs(lo0), abs(hi0), 1e-8)
    assert (qmin - zp) * scale <= lo0 + scale / 2 + tol
    assert (qmax - zp) * scale >= hi0 - scale / 2 - tol
    # not wastefully coarse
    needed = max(max(-lo0, hi0) if symmetric else hi0 - lo0, 1e-8) / (qmax if symmetric else qmax - qmin)
    assert scale >= needed * (1 - 1e-12)
    assert scale <= needed * (2 if pow2 else 1 + 1e-12)
    # 0.0 is exactly representable
    zero = dequantize(quantize(torch.zeros(3), scale_t, zp_t, bits), scale_t, zp_t)
    assert zero.tolist() == [0.0, 0.0, 0.0]
    return scale, zp


@SETTINGS
@given(finite, finite, st.integers(2, 16), st.booleans(), st.booleans())
def test_choose_qparams_properties(a, b, bits, symmetric, pow2):
    lo, hi = min(a, b), max(a, b)
    check_qparams(lo, hi, bits, symmetric, pow2)


@pytest.mark.parametrize("bits", [2, 8, 16])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
def test_choose_qparams_degenerate_and_one_sided(bits, symmetric, pow2):
    for lo, hi in [(0.0, 0.0), (1e-20, 1e-20), (2.0, 3.0), (-3.0, -2.0), (-5.0, 0.0), (0.0, 5.0)]:
        check_qparams(lo, hi, bits, symmetric, pow2)


def test_choose_qparams_vectorised_matches_scalar():
    g = torch.Generator().manual_seed(7)
    lo = -torch.rand(20, generator=g, dtype=torch.float64) * 10
    hi = torch.rand(20, generator=g, dtype=torch.float64) * 3
    lo[3], hi[3] = 0.0, 0.0
    for symmetric in (False, True):
        for pow2 in (False, True):
            s, z = choose_qparams(lo, hi, 8, symmetric, pow2)
            assert s.shape == z.shape == (20,)
            for i in range(20):
                si, zi = choose_qparams(lo[i], hi[i], 8, symmetric, pow2)
                assert float(s[i]) == float(si) and int(z[i]) == int(zi)


# ---------------------------------------------------------------------------------------------
# int_matmul
# ---------------------------------------------------------------------------------------------
BITS_PAIRS = [(8, 8), (8, 16), (16, 8), (16, 16)]
SHAPES = [(1, 1, 1), (1, 5, 1), (1, 1, 7), (3, 1, 2), (1, 13, 3), (5, 7, 3), (4, 4, 4), (17, 33, 9),
          (2, 600, 3), (6, 1023, 5)]


@pytest.fixture(params=["float64", "limbs"])
def mm(request):
    """Both forms of the exact product: int_matmul (float64 on the CPU: the golden model's) and
    int_matmul_limbs (int8 limb GEMMs, the form on other devices), each against int64 matmul."""
    return int_matmul if request.param == "float64" else int_matmul_limbs


def rand_q(shape, bits, g):
    qmin, qmax = qrange(bits)
    q = torch.randint(qmin, qmax + 1, shape, generator=g, dtype=torch.int64)
    flat = q.view(-1)
    if flat.numel() >= 4:  # always include both extremes
        flat[0], flat[-1] = qmin, qmax
    return q


@pytest.mark.parametrize("a_bits,b_bits", BITS_PAIRS)
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_int_matmul_exact(mm, a_bits, b_bits, M, K, N):
    g = torch.Generator().manual_seed(M * 10007 + K * 101 + N + a_bits + 3 * b_bits)
    a, b = rand_q((M, K), a_bits, g), rand_q((K, N), b_bits, g)
    got = mm(a, a_bits, b, b_bits)
    assert got.dtype == torch.int64 and got.shape == (M, N)
    assert torch.equal(got, a.long() @ b.long())
    # narrow storage dtypes give the same result
    narrow = {8: torch.int8, 16: torch.int16}
    got2 = mm(a.to(narrow[a_bits]), a_bits, b.to(narrow[b_bits]), b_bits)
    assert torch.equal(got2, got)


def test_int_matmul_random_shapes(mm):
    rng = random.Random(1234)
    g = torch.Generator().manual_seed(1234)
    for _ in range(25):
        M, K, N = rng.randint(1, 9), rng.randint(1, 70), rng.randint(1, 9)
        a_bits, b_bits = rng.choice(BITS_PAIRS)
        a, b = rand_q((M, K), a_bits, g), rand_q((K, N), b_bits, g)
        assert torch.equal(mm(a, a_bits, b, b_bits), a.long() @ b.long()), (M, K, N, a_bits, b_bits)


@pytest.mark.parametrize("a_bits,b_bits", BITS_PAIRS)
def test_int_matmul_non_contiguous_operands(mm, a_bits, b_bits):
    """Transposed views (golden passes W.t()), strided slices, expanded (stride 0) and 0-dim-stride rows."""
    g = torch.Generator().manual_seed(a_bits * 7 + b_bits)
    a_big, b_big = rand_q((9, 40), a_bits, g), rand_q((40, 12), b_bits, g)
    views = [
        (rand_q((5, 11), a_bits, g), rand_q((6, 11), b_bits, g).t()),       # b transposed
        (rand_q((11, 5), a_bits, g).t(), rand_q((11, 6), b_bits, g)),       # a transposed
        (a_big[::2, 1::3], b_big[1::3, ::5]),                               # strided slices
        (rand_q((1, 13), a_bits, g).expand(4, 13), rand_q((13, 1), b_bits, g).expand(13, 3)),
        (torch.full((3, 7), qrange(a_bits)[0], dtype=torch.int64).t().t(), rand_q((7, 2), b_bits, g)),
        (rand_q((1, 1), a_bits, g).expand(1, 9), rand_q((9, 1), b_bits, g)),
        # size-1 dimensions with "contiguous" but degenerate strides, e.g. W.t() of a [3, 1] W
        (rand_q((1, 4), a_bits, g).t(), rand_q((3, 1), b_bits, g).t()),    # [4,1] @ [1,3]
        (rand_q((5, 1), a_bits, g).t(), rand_q((1, 5), b_bits, g).t()),    # [1,5] @ [5,1]
        (rand_q((6, 7), a_bits, g), rand_q((1, 7), b_bits, g).t()),        # [6,7] @ [7,1]
    ]
    for a, b in views:
        assert torch.equal(mm(a, a_bits, b, b_bits), a.long() @ b.long()), (a.stride(), b.stride())


def test_int_matmul_int16_by_int8_worst_case_k4096(mm):
    K = 4096
    a = torch.full((3, K), -32768, dtype=torch.int64)
    b = torch.full((K, 2), -128, dtype=torch.int64)
    got = mm(a, 16, b, 8)
    expect = 4096 * 32768 * 128
    assert expect > 2 ** 31 - 1  # a plain int32 accumulator would overflow here
    assert got.tolist() == [[expect] * 2] * 3
    # and swapped operands (int8 activations x int16 weights), plus the mixed-sign extremes
    assert mm(b.t().contiguous(), 8, a.t().contiguous(), 16).tolist() == [[expect] * 3] * 2
    for av, bv in [(-32768, 127), (32767, -128), (32767, 127)]:
        a = torch.full((2, K), av, dtype=torch.int64)
        b = torch.full((K, 2), bv, dtype=torch.int64)
        assert mm(a, 16, b, 8).tolist() == [[K * av * bv] * 2] * 2


@pytest.mark.parametrize("av,bv", [(-32768, -32768), (-32768, 32767), (32767, 32767)])
def test_int_matmul_int16_by_int16_extremes(mm, av, bv):
    K = 2048
    a = torch.full((2, K), av, dtype=torch.int64)
    b = torch.full((K, 3), bv, dtype=torch.int64)
    assert mm(a, 16, b, 16).tolist() == [[K * av * bv] * 3] * 2
    assert abs(K * av * bv) > 2 ** 31


def test_int_matmul_largest_supported_k(mm):
    K = INT8_GEMM_K_MAX - 1
    for bits, v in [(8, -128), (16, -32768)]:
        a = torch.full((1, K), v, dtype=torch.int64)
        b = torch.full((K, 1), v, dtype=torch.int64)
        assert mm(a, bits, b, bits).item() == K * v * v


def test_int_matmul_rejects_large_k_and_wide_operands(mm):
    assert INT8_GEMM_K_MAX == 2 ** 17
    for K in (2 ** 17, 2 ** 17 + 3):
        with pytest.raises(ValueError):
            mm(torch.zeros(1, K, dtype=torch.int64), 8, torch.zeros(K, 1, dtype=torch.int64), 8)
    with pytest.raises(ValueError):
        mm(torch.zeros(2, 3, dtype=torch.int64), 32, torch.zeros(3, 2, dtype=torch.int64), 8)


def test_pack_int32_hand_computed():
    from qgru.primitives import pack_int32, unpack_int32
    # 4-bit values 1, -1, 2, -2 -> nibbles 0x1, 0xF, 0x2, 0xE from the lowest bits up
    word = pack_int32(torch.tensor([[1, -1, 2, -2]]), 4)
    assert word.dtype == torch.int32 and word.tolist() == [[0xE2F1]]
    # eight 4-bit -8s fill the word: 0x88888888 as a signed int32
    full = pack_int32(torch.full((1, 8), -8), 4)
    assert full.tolist() == [[0x88888888 - (1 << 32)]]
    assert unpack_int32(full, 4, 8).tolist() == [[-8] * 8]


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(2, 16), rows=st.integers(1, 4), length=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(bits, rows, length, seed):
    from qgru.primitives import pack_int32, unpack_int32
    g = torch.Generator().manual_seed(seed)
    lo, hi = qrange(bits)
    q = torch.randint(lo, hi + 1, (rows, length), generator=g)
    words = pack_int32(q, bits)
    assert words.shape == (rows, -(-length // (32 // bits)))
    assert torch.equal(unpack_int32(words, bits, length), q)
