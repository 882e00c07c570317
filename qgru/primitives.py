"""Pure integer quantization primitives: the only place qgru defines an integer operation.

Everything else (the golden GRU, the tables, the observers' scale choice, export) calls these
functions, in the spirit of torchao's ``quant_primitives`` and gemmlowp's ``fixedpoint.h``.
All integer tensors here are ``torch.int64`` unless stated otherwise, so that no intermediate can
wrap around silently; the bounds that make each function exact are stated in its docstring and
proven in ``docs/spec.md``.

The one rounding rule (used everywhere, for floats and integers alike):
    round half up, i.e. ``floor(v + 1/2)``.
For an integer divided by ``2**s`` that is ``(v + 2**(s-1)) >> s`` with an arithmetic shift,
which is what C and CUDA compute too.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

# An operand bounded by |x| < 2**x_bits gets a multiplier of min(MULT_BITS_MAX,
# MULT_BITS_TOTAL - x_bits) bits, so that x * m always fits in a signed 64-bit integer.
MULT_BITS_TOTAL = 62
MULT_BITS_MAX = 31  # seed 002: a 31-bit multiplier, the most an int32 operand allows
MAX_SHIFT = 62


def qrange(bits: int) -> Tuple[int, int]:
    """Range of a signed ``bits``-wide integer: (-2**(bits-1), 2**(bits-1) - 1)."""
    if not 2 <= bits <= 32:
        raise ValueError(f"bit width must be in [2, 32], got {bits}")
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def saturate(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Clamp an integer tensor to the signed ``bits``-wide range (saturation, never wrap)."""
    lo, hi = qrange(bits)
    return q.clamp(lo, hi)


def round_half_up(v: torch.Tensor) -> torch.Tensor:
    """The rounding rule applied to a float tensor: floor(v + 0.5), returned as int64.

    Computed in float64 as ``r = floor(v); r + (v - r >= 0.5)``, which is exact for every float64
    (``floor(v + 0.5)`` itself would misround e.g. 0.49999999999999994, where v + 0.5 rounds up).
    """
    v = v.double()
    r = torch.floor(v)
    return (r + (v - r >= 0.5).double()).to(torch.int64)


def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, bits: int) -> torch.Tensor:
    """Float -> integer: q = saturate(round_half_up(x / scale) + zero_point).

    The division is done in float64 and clamped to just beyond the integer range before the
    conversion to int64, so that any finite or infinite input saturates to the correct end
    (a NaN has no quantized value: callers reject it). Only used where a float enters the integer
    model (the module's input, h0, and the float weights at convert()).
    """
    lo, hi = qrange(bits)
    zp = zero_point.to(torch.int64)
    v = (x.double() / scale.double()).clamp(lo - zp.double() - 1, hi - zp.double() + 1)
    return saturate(round_half_up(v) + zp, bits)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """Integer -> float32: (q - zero_point) * scale (the model's output boundary)."""
    return ((q.to(torch.int64) - zero_point.to(torch.int64)).double() * scale.double()).float()


def rounding_mul_shift(x: torch.Tensor, multiplier: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """round_half_up(x * multiplier / 2**shift), exactly, in int64 (seed 002's approx_mul).

    Preconditions (guaranteed by ``quantize_multiplier``'s ``x_bits`` argument and proven per call
    site in docs/spec.md): 0 <= multiplier < 2**(62 - x_bits), |x| < 2**x_bits, 1 <= shift <= 62.
    Then |x * multiplier| < 2**62 and adding the rounding constant 2**(shift-1) <= 2**61 stays below
    2**63, so the int64 arithmetic is exact. ``multiplier`` and ``shift`` broadcast against ``x``
    (per-tensor scalars or per-channel vectors).
    """
    shift = shift.to(torch.int64)
    rounding = torch.ones_like(shift) << (shift - 1)
    return (x * multiplier.to(torch.int64) + rounding) >> shift


def multiplier_bits(x_bits: int) -> int:
    """Bits of the multiplier of a factor whose operand satisfies |x| < 2**x_bits (docs/spec.md
    section 3): min(31, 62 - x_bits), so that x * multiplier fits in int64."""
    return min(MULT_BITS_MAX, MULT_BITS_TOTAL - x_bits)


def quantize_multiplier(real: float, x_bits: int, power_of_two: bool = False) -> Tuple[int, int]:
    """Represent a positive real rescale factor as (multiplier, shift): real ~= multiplier / 2**shift.

    ``x_bits`` bounds the operand (|x| < 2**x_bits) that the factor will multiply, so that the
    product fits in int64: the multiplier gets ``min(31, 62 - x_bits)`` bits, normalised to
    [2**(b-1), 2**b) as in seed 002 (31 bits for an int32 operand). With ``power_of_two`` the factor
    must be an exact power of two and is represented exactly (multiplier = 2**(b-1)).

    Shifts are kept in [1, 62]: a factor too large for that raises (it would mean an output grid
    2**30 times finer than its input's, i.e. a broken calibration); a factor so small that the shift
    would pass 62 keeps fewer multiplier bits (the result is then 0 or +-1 for every bounded x).
    """
    if not (real > 0 and math.isfinite(real)):
        raise ValueError(f"rescale factor must be positive and finite, got {real}")
    bits = multiplier_bits(x_bits)
    if bits < 8:
        raise ValueError(f"operand of {x_bits} bits leaves only {bits} multiplier bits")
    mantissa, exponent = math.frexp(real)  # real = mantissa * 2**exponent, mantissa in [0.5, 1)
    if power_of_two and mantissa != 0.5:
        raise ValueError(f"power-of-two mode needs a power-of-two rescale factor, got {real!r}")
    multiplier = int(math.floor(mantissa * (1 << bits) + 0.5))
    shift = bits - exponent
    if multiplier == (1 << bits):  # mantissa rounded up to 1.0
        multiplier >>= 1
        shift -= 1
    if shift < 1:
        raise ValueError(
            f"rescale factor {real:.3e} is too large to represent (shift {shift} < 1); "
            "this means an output grid far finer than its input: check the calibration")
    if shift > MAX_SHIFT:
        drop = shift - MAX_SHIFT
        multiplier = (multiplier + (1 << (drop - 1))) >> drop
        shift = MAX_SHIFT
    return multiplier, shift


def quantize_multipliers(reals: torch.Tensor, x_bits: int, power_of_two: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Vector form of ``quantize_multiplier``: one (multiplier, shift) per element, int64 tensors."""
    pairs = [quantize_multiplier(float(r), x_bits, power_of_two) for r in reals.reshape(-1).tolist()]
    m = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=reals.device).reshape(reals.shape)
    s = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=reals.device).reshape(reals.shape)
    return m, s


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= v (elementwise, v > 0): how power-of-two mode rounds a scale."""
    return torch.exp2(torch.ceil(torch.log2(v.double())))


# ---------------------------------------------------------------------------------------------
# Exact integer matrix products on int8 engines
# ---------------------------------------------------------------------------------------------
INT8_GEMM_K_MAX = 1 << 17  # |sum of K int8*int8 products| <= K * 2**14 < 2**31 for K < 2**17


def split_int8_limbs(a: torch.Tensor, bits: int):
    """Write a signed ``bits``-wide integer tensor as int8 limbs: a = sum_i 256**i * (limb_i + c_i).

    8-bit values are one limb with c = 0. 16-bit values are a = 256 * hi + lo with hi = a >> 8 in
    [-128, 127] and lo = (a & 255) in [0, 255], stored as lo - 128 in int8 with c = 128.
    Returns a list of (int8 limb, weight 256**i, offset c_i).
    """
    if bits <= 8:
        return [(a.to(torch.int8), 1, 0)]
    if bits <= 16:
        a = a.to(torch.int64)
        hi = (a >> 8).to(torch.int8)
        lo = ((a & 255) - 128).to(torch.int8)
        return [(lo, 1, 128), (hi, 256, 0)]
    raise ValueError(f"integer matmul operands are at most 16 bits, got {bits}")


def _row_major(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2 and t.stride() == (t.shape[1], 1):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int8 [M,K] @ int8 [K,N] -> int32 with torch._int_mm, exact for K < 2**17.

    On CPU torch._int_mm takes any shape. On CUDA it needs M > 16 and K, N multiples of 8: the
    operands are zero-padded to meet that (zeros add nothing to any dot product), never sent to a
    slower path.
    """
    # Canonical row-major strides: torch._int_mm reads leading dimensions from strides, and a tensor
    # with a size-1 dimension can be "contiguous" with a degenerate stride (e.g. W.t() of a [3, 1] W).
    a, b = _row_major(a), _row_major(b)
    if a.device.type == "cpu":
        return torch._int_mm(a, b)
    m, k = a.shape
    n = b.shape[1]
    pm, pk, pn = max(17, m) - m, (-k) % 8, (-n) % 8
    a_p = torch.nn.functional.pad(a, (0, pk, 0, pm))
    b_p = torch.nn.functional.pad(b, (0, pn, 0, pk))
    return torch._int_mm(a_p, b_p)[:m, :n]


FLOAT64_EXACT = 1 << 53  # every integer of magnitude <= 2**53 is a float64


def int_matmul(a: torch.Tensor, a_bits: int, b: torch.Tensor, b_bits: int) -> torch.Tensor:
    """Exact integer product a [M,K] @ b [K,N] -> int64 of operands of at most 16 bits, K < 2**17.

    On the CPU it is one float64 matmul: every product has |a b| <= 2**15 * 2**15 = 2**30 and
    every partial sum, in any order the BLAS adds them, |sum| <= K 2**30 < 2**47 <= 2**53, an
    integer that float64 holds exactly; so each multiply, add or fused multiply-add is exact and
    the result is the integer product whatever the summation order, blocking or threading. (This
    is fast on every CPU: ATen's int8 GEMM, torch._int_mm, is a scalar loop on CPUs without
    AVX-512 VNNI, ~30x slower than float64 there.)

    On other devices the operands are split into int8 limbs (``split_int8_limbs``); every limb
    product is one int8 GEMM whose int32 accumulator cannot overflow because K < 2**17; the limb
    products and the offset terms (offset * column/row sums) are combined in int64. This is how the
    int16-activation case avoids the int32 overflow at K > ~516 (docs/spec.md, "Accumulators").
    """
    k = a.shape[-1]
    if k >= INT8_GEMM_K_MAX:
        raise ValueError(f"inner dimension {k} exceeds the supported maximum {INT8_GEMM_K_MAX - 1}")
    for bits in (a_bits, b_bits):
        if bits > 16:
            raise ValueError(f"integer matmul operands are at most 16 bits, got {bits}")
    if a.device.type == "cpu":
        assert k * (1 << 30) <= FLOAT64_EXACT  # K < 2**17: partial sums below 2**47
        return (a.to(torch.float64) @ b.to(torch.float64)).to(torch.int64)
    return int_matmul_limbs(a, a_bits, b, b_bits)


def int_matmul_limbs(a: torch.Tensor, a_bits: int, b: torch.Tensor, b_bits: int) -> torch.Tensor:
    """``int_matmul`` as int8 x int8 -> int32 GEMMs of limbs (any device), combined in int64."""
    k = a.shape[-1]
    if k >= INT8_GEMM_K_MAX:
        raise ValueError(f"inner dimension {k} exceeds the supported maximum {INT8_GEMM_K_MAX - 1}")
    a64, b64 = a.to(torch.int64), b.to(torch.int64)
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int64, device=a.device)
    for la, wa, ca in split_int8_limbs(a64, a_bits):
        for lb, wb, cb in split_int8_limbs(b64, b_bits):
            # (la + ca) @ (lb + cb) = la@lb + ca * colsum(lb) + cb * rowsum(la) + ca*cb*K
            term = _int8_mm(la, lb).to(torch.int64)
            if ca:
                term = term + ca * lb.to(torch.int64).sum(0, keepdim=True)
            if cb:
                term = term + cb * la.to(torch.int64).sum(1, keepdim=True)
            if ca and cb:
                term = term + ca * cb * k
            out += (wa * wb) * term
    return out


def rounding_shift(v: torch.Tensor, shift: int) -> torch.Tensor:
    """round_half_up(v / 2**shift) for shift >= 0 (shift 0 returns v unchanged)."""
    return (v + ((1 << shift) >> 1)) >> shift


# ---------------------------------------------------------------------------------------------
# Choosing a grid (scale, zero point) from a range
# ---------------------------------------------------------------------------------------------
MIN_RANGE = 1e-8  # a tensor that never left 0 still gets a valid (tiny) grid


def choose_qparams(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool,
                   power_of_two: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale float64, zero_point int64) of a grid that covers [lo, hi] (elementwise).

    The range is first widened to contain 0 so that 0.0 is exactly representable.
    symmetric:  scale = max(|lo|, |hi|) / (2**(bits-1) - 1), zero point 0.
    asymmetric: scale = (hi - lo) / (2**bits - 1), zero point = round_half_up(qmin - lo / scale)
                clamped to [qmin, qmax] (zero points are saturated to their type like any integer).
    power_of_two rounds the scale up to 2**-k before the zero point is chosen.
    """
    lo = torch.clamp(lo.double(), max=0.0)
    hi = torch.clamp(hi.double(), min=0.0)
    qmin, qmax = qrange(bits)
    if symmetric:
        scale = torch.maximum(-lo, hi).clamp(min=MIN_RANGE) / qmax
    else:
        scale = (hi - lo).clamp(min=MIN_RANGE) / (qmax - qmin)
    if power_of_two:
        scale = pow2_ceil(scale)
    if symmetric:
        zp = torch.zeros_like(scale, dtype=torch.int64)
    else:
        zp = (round_half_up(qmin - lo / scale)).clamp(qmin, qmax)
    return scale, zp


# ---------------------------------------------------------------------------------------------
# Bit packing (seed 003): several narrow integers per int32 word
# ---------------------------------------------------------------------------------------------
def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed ``bits``-wide integers along the last dimension into int32 words.

    Word j of a row holds elements j*n ... j*n + n - 1 (n = 32 // bits), element i at bit offset
    bits * (i % n), in two's complement. The last word is zero-padded. Inverse: ``unpack_int32``.
    """
    n = 32 // bits
    q = q.to(torch.int64)
    pad = (-q.shape[-1]) % n
    q = torch.nn.functional.pad(q, (0, pad)).reshape(*q.shape[:-1], -1, n)
    shifts = torch.arange(n, dtype=torch.int64, device=q.device) * bits
    words = ((q & ((1 << bits) - 1)) << shifts).sum(-1)
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)


def unpack_int32(words: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of ``pack_int32``: the first ``length`` signed values of each row, as int64."""
    n = 32 // bits
    shifts = torch.arange(n, dtype=torch.int64, device=words.device) * bits
    u = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    q = torch.where(u >= (1 << (bits - 1)), u - (1 << bits), u)
    return q.reshape(*words.shape[:-1], -1)[..., :length]
