"""Integer sigmoid / tanh tables, built at convert() from the calibrated input grid.

A table maps a ``b_in``-bit pre-activation q (scale S_in, zero point Z_in) to a ``b_out``-bit
gate output (scale S_out, zero point Z_out). One lookup rule serves both table kinds:

    i = (q - qmin_in) >> k            segment index
    f = (q - qmin_in) & (2**k - 1)    position inside the segment
    v = T[i] * 2**k + (T[i+1] - T[i]) * f
    out = saturate(round_half_up(v / 2**(k + F)) + Z_out, b_out)

with T[i] = round_half_up(2**F * func((qmin_in + i * 2**k - Z_in) * S_in) / S_out).

* Inputs of at most ``EXACT_TABLE_MAX_BITS`` bits: k = 0, F = 0, one entry per input value:
  the table is exact (error <= 1/2 output step from rounding alone).
* Wider inputs (16 bits): k = b_in - SEGMENT_BITS (1024 segments), F = FRACTION_BITS extra
  fractional bits per entry, and linear interpolation between entries. The measured maximum error
  is reported by tests/test_tables.py and docs/spec.md.

Output grids are fixed by the function's range, not calibrated:
  sigmoid: [0, 1], zero point qmin, scale 2**-b (pow2) or 1 / (2**b - 1) (multiplier mode)
  tanh:    [-1, 1], zero point 0,   scale 2**-(b-1) or 1 / (2**(b-1) - 1)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .primitives import qrange, round_half_up, rounding_shift, saturate

EXACT_TABLE_MAX_BITS = 10
SEGMENT_BITS = 10
FRACTION_BITS = 4

FUNCTIONS = {"sigmoid": torch.sigmoid, "tanh": torch.tanh}


@dataclass(frozen=True)
class OutputGrid:
    scale: float
    zero_point: int
    one: int  # the integer that 1.0 is on this grid, relative to the zero point: round(1 / scale)


def output_grid(func: str, bits: int, power_of_two: bool) -> OutputGrid:
    qmin, qmax = qrange(bits)
    if func == "sigmoid":
        steps = (1 << bits) if power_of_two else (1 << bits) - 1
        return OutputGrid(scale=1.0 / steps, zero_point=qmin, one=steps)
    if func == "tanh":
        steps = (1 << (bits - 1)) if power_of_two else (1 << (bits - 1)) - 1
        return OutputGrid(scale=1.0 / steps, zero_point=0, one=steps)
    raise ValueError(f"unknown gate function {func!r}")


def table_geometry(in_bits: int):
    """(k, F): segment width 2**k and fraction bits F for a table on ``in_bits``-bit inputs."""
    if in_bits <= EXACT_TABLE_MAX_BITS:
        return 0, 0
    return in_bits - SEGMENT_BITS, FRACTION_BITS


def build_table(func: str, in_bits: int, in_scale: float, in_zero_point: int, out_scale: float) -> torch.Tensor:
    """The entries T (int64, 2**(in_bits - k) + 1 of them); see the module docstring."""
    k, frac = table_geometry(in_bits)
    qmin, _ = qrange(in_bits)
    n = (1 << (in_bits - k)) + 1
    q = qmin + torch.arange(n, dtype=torch.float64, device=torch.device("cpu")) * (1 << k)  # tables: built on the CPU
    real = FUNCTIONS[func]((q - in_zero_point) * in_scale)
    return round_half_up(real * (1 << frac) / out_scale)


def lookup(q: torch.Tensor, table: torch.Tensor, in_bits: int, out_zero_point: int, out_bits: int) -> torch.Tensor:
    """Apply a table to integer pre-activations ``q`` (int64, already saturated to ``in_bits``)."""
    k, frac = table_geometry(in_bits)
    qmin, _ = qrange(in_bits)
    u = q - qmin
    i = u >> k
    f = u & ((1 << k) - 1)
    lo = table[i]
    v = (lo << k) + (table[i + 1] - lo) * f
    return saturate(rounding_shift(v, k + frac) + out_zero_point, out_bits)
