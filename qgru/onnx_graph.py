"""A converted GRU's integer forward as standard ONNX operators (layer 2: parameters -> a graph).

``gru_nodes(params, g, x, h0, out, h_n, out_dtype)`` builds, from a QuantParams (every layer and
direction), the nodes and initializers of one ONNX subgraph that computes exactly what
``runtime.integer_forward`` computes: time-major float x [T, N, I] and h0 [L*D, N, H] in, the
float32 outputs [T, N, D*H] and h_n [L*D, N, H] out (then cast to x's dtype). qgru.export_onnx
splices it into a whole model's graph (qgru/onnx_export.py). docs/onnx.md has the design; every
operation is golden.py's, written with the default ONNX domain only:

* the float boundary: primitives.quantize (float64 division, clamp, round half up as
  ``floor(v) + (v - floor(v) >= 0.5)``, saturate), golden.select_levels for x levels (ReduceMin /
  ReduceMax per token, compared in float64, the first level that holds the token: ArgMax),
  primitives.dequantize ((q - Z) S in float64, then Cast to float32);
* the GEMMs: MatMulInteger (the uint8 activation a = q + 128 with zero point 128, twice, times the
  int8 weights split in two halves of magnitude <= 64: (a - 128) . w1 + (a - 128) . w2, the exact
  int32 dot product; split because ONNX Runtime's uint8 x int8 kernels can saturate on CPUs without
  VNNI for larger weights, _SPLIT_WEIGHTS_WHY) where x / the R.h
  operand and the weights have at most 8 bits; a float64 MatMul otherwise (exact: every partial sum is an integer below 2^47, docs/spec.md
  section 6, as golden's own CPU GEMM). W.x for the whole sequence is one GEMM per gate before
  the loop;
* the cell: a Scan over time (scan_input_directions = 1 for a reverse direction), whose body is
  W.x's requantization and gru_step. Integers are held in float64 tensors (every stored value and
  every product formed is an integer below 2^53, so float64 Add / Mul / Floor are exact on them).
  Each rescale round_half_up(v m / 2^s) is one of two forms chosen per rescale from the static
  bound of |v|, its last floor a round to nearest by 3 2^51 where the bound leaves room (``Form``:
  each form's proof is in its docstring, and an export whose bounds fit neither raises); the
  tables are golden's lookup over every input integer (``GatherElements``), stored as 16-bit
  integers where the entries fit; the scan output is the state in float32 (17 bits: exact).

Parts: Graph (names, constants, nodes); Form / apply_rescale (the exact rescales); quantize (the
float boundary); _checked_h0 (h0 of another shape than [L*D, N, H] fails at run time); _Layer
(one layer and direction: GEMMs, requantization, the step, the Scan);
gru_nodes (every layer and direction between the float boundaries); build_model (a standalone
model of one QuantParams, for tests and benchmarks).

The graph never reads a NaN check (ONNX has no exceptions): a NaN in x or h0 gives unspecified
integers where the module raises. Everything here is plain numpy + onnx.helper.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .convert import operand_bounds
from .export import QuantParams
from .golden import LayerParams
from .primitives import qrange
from .tables import lookup

OPSET = 17
F64_EXACT = 1 << 53
# MAGIC = 3 2^51: for a float64 t with |t| <= 2^51, t + MAGIC lies in [2^52, 2^53), where the float64
# numbers are the integers, so fl(t + MAGIC) = RNE(t) + MAGIC (round to nearest, ties to even; MAGIC
# is an integer) and subtracting MAGIC again is exact: RNE(t) in two Adds. Form.rne_ok says when an
# rescale's floor may be taken this way (ONNX Runtime's float64 Floor costs more than two Adds).
MAGIC = float(3 << 51)


# _SPLIT_WEIGHTS_WHY: an 8-bit GEMM a . w (a = q + 128 uint8, zero point 128) is written as
# [a, a] . [w1; w2] with w1 = clip(w, -64, 64), w2 = w - w1 (int8, |w1|, |w2| <= 64): the same int32
# dot product over twice the depth. ONNX Runtime multiplies uint8 x int8 on x86 CPUs without VNNI
# (AVX2, AVX-512 without VNNI) with vpmaddubsw, whose int16 sum of two products saturates for
# 255 x 127 x 2 > 32767: a silently wrong GEMM on, for example, an AMD Zen 3. With |w| <= 64 every
# pair sum is within 2 x 255 x 64 = 32640 < 2^15, whichever two products the kernel pairs: exact on
# every CPU. uint8 x int8 at twice the depth still beats uint8 x uint8 (whose kernels widen to 16
# bits first): [64, 512] x [512, 1024] took 312 us against 401 us on one thread of an AMD EPYC Zen 4
# (AVX-512 VNNI, ONNX Runtime 1.32.0, 2026-11-28), W.x of the whole sequence 19.1 ms against 20.8.


class ONNXExportError(ValueError):
    """A GRU (or an argument) that the ONNX export cannot express; the message names the module."""


def _onnx():
    import onnx  # optional dependency (setup.cfg extra "onnx")
    return onnx


class Graph:
    """Nodes and initializers under construction, with unique names under ``prefix``."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: List = []
        self.inits: List = []
        self._n = 0
        self._consts: Dict = {}

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{self.prefix}{hint}_{self._n}"

    def const(self, value, dtype=np.float64, hint: str = "c") -> str:
        onnx = _onnx()
        a = np.array(value, dtype=dtype, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        key = (a.dtype.str, a.shape, a.tobytes())
        if key in self._consts:
            return self._consts[key]
        n = self.name(hint)
        self.inits.append(onnx.numpy_helper.from_array(a, n))
        self._consts[key] = n
        return n

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, hint: Optional[str] = None, **attrs):
        onnx = _onnx()
        outs = [self.name(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(onnx.helper.make_node(op_type, list(inputs), outs, name=self.name("n_" + op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    # small helpers on float64 integer tensors
    def add(self, a, b):
        return self.op("Add", [a, b])

    def sub(self, a, b):
        return self.op("Sub", [a, b])

    def mul(self, a, b):
        return self.op("Mul", [a, b])

    def floor(self, a):
        return self.op("Floor", [a])

    def rne(self, t):
        """RNE(t) for |t| <= 2^51 (MAGIC)."""
        return self.sub(self.add(t, self.const(MAGIC)), self.const(MAGIC))

    def clip(self, a, lo, hi):
        """Clamp to [lo, hi]: scalars (Clip) or per-channel arrays (Max, Min)."""
        lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
        if np.all(lo == lo.flat[0]) and np.all(hi == hi.flat[0]):
            return self.op("Clip", [a, self.const(lo.flat[0]), self.const(hi.flat[0])])
        return self.op("Min", [self.op("Max", [a, self.const(lo)]), self.const(hi)])

    def cast(self, a, to):
        return self.op("Cast", [a], to=to)


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def _normalized(m: np.ndarray, s: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(m, s) with common factors of two taken out while s > 1: round_half_up(v m / 2^s) is
    unchanged ((2 v m' + 2^s') / 2^(s'+1) = (v m' + 2^(s'-1)) / 2^s'), and a power-of-two factor
    becomes m = 1 (pow2 mode), whose product v m is v itself."""
    m = m.astype(np.int64).copy()
    s = s.astype(np.int64).copy()
    while True:
        red = (m % 2 == 0) & (s > 1) & (m > 0)
        if not red.any():
            return m, s
        m = np.where(red, m // 2, m)
        s = np.where(red, s - 1, s)


def _pow2f(e) -> np.ndarray:
    return np.ldexp(np.ones(np.shape(e)), np.asarray(e, np.int64))


def _ints(a) -> List[int]:
    return [int(v) for v in np.asarray(a).reshape(-1)]


class Form:
    """The exact float64 form of round_half_up(v m / 2^s) for every integer |v| <= vmax.

    * "f1": floor(v c + 1/2), c = m 2^-s. When vmax m + 2^(s-1) <= 2^53, v m is an integer below
      2^53, so v c = v m 2^-s exactly (a power-of-two scaling), and v c + 1/2 = (v m + 2^(s-1)) 2^-s
      has an integer numerator of magnitude <= 2^53: exact; floor is exact. When s >= 54 and
      vmax m < 2^52: |v c| < 1/4, the computed sum lies in [1/4, 3/4], floor 0, which is the
      true result ((v m + 2^(s-1)) / 2^s in (1/4, 3/4)).
    * "f2": with m = mh 2^k + ml (0 <= ml < 2^k, 1 <= k <= s - 1),
        floor((v m + 2^(s-1)) / 2^s) = floor((v mh + floor(v ml / 2^k) + 2^(s-1-k)) / 2^(s-k))
      (divide by 2^k first: the integers v mh and 2^(s-1-k) leave the inner floor; nested floors
      of divisions by powers of two compose). v ml 2^-k is exact when vmax 2^k <= 2^53, and the
      outer sum S when vmax mh + vmax + 1 + 2^(s-1-k) < 2^53; S 2^-(s-k) is a power-of-two scaling.

    An integer ``add`` (a constant or a tensor, |add| <= B) joins the sum before the last floor
    (``fold_ok(B)``): for f1 when the numerator vm + 2^(s-1) + add 2^s stays within 2^53 (s <= 53),
    for f2 when S + add 2^(s-k) does: then floor(y + add) = floor(y) + add exactly, and a caller
    that clamps to a range with integer ends >= 0 may leave the floor to a truncating Cast.

    The last floor as a round to nearest (``rne_ok(B)``, Graph.rne: two Adds instead of a Floor):
    the quantity floored is X / 2^F with X an integer (f1: X = v m + 2^(s-1) + add 2^s, F = s;
    f2: X = S + add 2^(s-k), F = s - k), F >= 1. Then floor(X / 2^F) = RNE((2X - 2^F + 1) / 2^(F+1)):
    that argument is X / 2^F - 1/2 + 2^-(F+1), and X / 2^F has at most F fractional bits, so it lies
    strictly between floor(X / 2^F) - 1/2 and floor(X / 2^F) + 1/2 (never a tie). The constant
    that held 1/2 (f1) or 2^(s-1-k) (f2) holds 2^-(s+1) or 1/2 instead; the computed sum is exact
    when its numerator |2 (X - 2^(F-1)) + 1| <= 2 N + 1 <= 2^53 (N = vmax m + B 2^s for f1,
    vmax mh + vmax + B 2^(s-k) for f2, a bound of |X - 2^(F-1)|), and then |t| <= 2^(52-F) <= 2^51
    as MAGIC needs.
    """

    def __init__(self, m, s, vmax: int, normalize: bool = True):
        m, s = np.broadcast_arrays(np.asarray(m, np.int64), np.asarray(s, np.int64))
        if normalize:
            m, s = _normalized(m, s)
        self.m, self.s, self.vmax = m, s, int(vmax)
        mm, ss = _ints(m), _ints(s)
        if all(vmax * a + (1 << (b - 1)) <= F64_EXACT or (b >= 54 and vmax * a < (1 << 52)) for a, b in zip(mm, ss)):
            self.kind, self.c = "f1", np.ldexp(m.astype(np.float64), -s)
            return
        self.kind = None
        k = min(min(ss) - 1, 53 - max(int(vmax).bit_length(), 1))
        if k < 1:
            return
        if any(vmax * (a >> k) + vmax + 1 + (1 << (b - 1 - k)) >= F64_EXACT for a, b in zip(mm, ss)):
            return
        self.kind, self.k = "f2", k
        self.mh = (m >> k).astype(np.float64)
        self.mls = np.ldexp((m & ((1 << k) - 1)).astype(np.float64), -k)
        self.half = _pow2f(s - 1 - k)
        self.inv = _pow2f(-(s - k))

    def fold_ok(self, bound) -> bool:
        b = np.broadcast_to(np.asarray(bound, np.float64), np.broadcast_shapes(self.m.shape, np.shape(bound)))
        m = np.broadcast_to(self.m, b.shape)
        s = np.broadcast_to(self.s, b.shape)
        for a, e, o in zip(_ints(m), _ints(s), [int(np.ceil(v)) for v in b.reshape(-1)]):
            if self.kind == "f1":
                if e > 53 or self.vmax * a + (1 << (e - 1)) + o * (1 << e) > F64_EXACT:
                    return False
            elif (self.vmax * (a >> self.k) + self.vmax + 1 + (1 << (e - 1 - self.k)) + o * (1 << (e - self.k))
                  >= F64_EXACT):
                return False
        return True

    def rne_ok(self, bound=0) -> bool:
        """Whether the last floor (with an add of magnitude <= bound folded) may be Graph.rne (above)."""
        if self.kind is None:
            return False
        b = np.broadcast_to(np.asarray(bound, np.float64), np.broadcast_shapes(self.m.shape, np.shape(bound)))
        m = np.broadcast_to(self.m, b.shape)
        s = np.broadcast_to(self.s, b.shape)
        for a, e, o in zip(_ints(m), _ints(s), [int(np.ceil(v)) for v in b.reshape(-1)]):
            F = e if self.kind == "f1" else e - self.k
            if F < 1 or F > 52:
                return False
            n = self.vmax * a + o * (1 << e) if self.kind == "f1" else \
                self.vmax * (a >> self.k) + self.vmax + o * (1 << F)
            if 2 * n + 1 > F64_EXACT:  # (then |t| <= (2n + 1) / 2^(F+1) <= 2^(52-F) <= 2^51)
                return False
        return True

    def result_bound(self) -> int:
        """max |round_half_up(v m / 2^s)| over |v| <= vmax."""
        return max((self.vmax * a >> b) + 1 for a, b in zip(_ints(self.m), _ints(self.s)))


def apply_rescale(g: Graph, v: str, form: Form, add_const=None, add_tensor: Optional[str] = None,
                  add_bound=0.0, floor: bool = True) -> str:
    """round_half_up(v m / 2^s) + add_const + add_tensor on tensor v (constants broadcast on the last
    axis). With floor=False the result may be a float y whose floor is that integer (when the adds
    fold, see Form), else the integer itself."""
    has_add = add_const is not None or add_tensor is not None
    fold = form.fold_ok(add_bound) if has_add or not floor else False
    rne = floor and form.rne_ok(add_bound if fold else 0)  # the last floor as Graph.rne (Form)
    cst = np.zeros(()) if add_const is None else np.asarray(add_const, np.float64)
    if form.kind == "f1":
        y = g.mul(v, g.const(form.c))
        y = g.add(y, g.const((_pow2f(-(form.s + 1)) if rne else 0.5) + (cst if fold else 0.0)))
    else:
        a = g.mul(v, g.const(form.mh))
        b = g.floor(g.mul(v, g.const(form.mls)))
        half = (np.full(np.shape(form.half), 0.5) if rne else form.half) + (cst * _pow2f(form.s - form.k) if fold else 0.0)
        y = g.mul(g.add(g.add(a, b), g.const(half)), g.const(form.inv))
    last = g.rne if rne else g.floor
    if fold:
        if add_tensor is not None:
            y = g.add(y, add_tensor)
        return last(y) if floor else y
    y = last(y)
    if add_const is not None:
        y = g.add(y, g.const(cst))
    if add_tensor is not None:
        y = g.add(y, add_tensor)
    return y


def quantize(g: Graph, x64: str, scale: str, zp: int, bits: int) -> str:
    """primitives.quantize on a float64 tensor: x / scale (scale a float64 tensor name,
    broadcasting), clamped to [lo - zp - 1, hi - zp + 1], round half up as floor(v) + (v - floor(v)
    >= 1/2) (exact for every float64, unlike floor(v + 1/2)), + zp, saturated."""
    lo, hi = qrange(bits)
    v = g.op("Div", [x64, scale])
    v = g.clip(v, lo - zp - 1, hi - zp + 1)
    r = g.floor(v)
    up = g.cast(g.op("GreaterOrEqual", [g.sub(v, r), g.const(0.5)]), 11)
    return g.clip(g.add(g.add(r, up), g.const(float(zp))), lo, hi)


def _table(p: LayerParams, name: str) -> np.ndarray:
    """golden's lookup of gate ``name`` for every input integer of its pre-activation grid, minus
    the output zero point (float64, 2^b entries, index q - qmin)."""
    b = p.bits[f"{name}_pre"]
    lo, hi = qrange(b)
    table = p.tables[name]
    q = torch.arange(lo, hi + 1, dtype=torch.int64, device=table.device)
    zp = int(p.zp[name])
    return (lookup(q, table, b, zp, p.bits[name]) - zp).double().cpu().numpy()


def _table_dtype(t: np.ndarray):
    """The narrowest of uint16, int16, int32 that holds every entry of the integer table t (None: keep
    float64). A 16-bit output grid's table (2^16 entries) is then 128 KiB instead of 512 KiB:
    ONNX Runtime's GatherElements measured ~2.4x faster on it at N=64, H=512 (fewer cache misses),
    more than the Cast to float64 that follows costs."""
    for dt in (np.uint16, np.int16, np.int32):
        info = np.iinfo(dt)
        if t.min() >= info.min and t.max() <= info.max:
            return dt
    return None


def _span(bits: int, zp) -> int:
    """max |q - Z| over a grid of ``bits`` bits with zero point(s) Z."""
    lo, hi = qrange(bits)
    z = _ints(zp)
    return max(max(hi - v, v - lo) for v in z)


def _acc_clip(m, s, bias, top: int) -> int:
    """A bound V such that clamping the raw product G (acc = G + bias) to [-V, V] changes no
    saturated result sat(round_half_up(acc m / 2^s) + Z) whose range before + Z lies within
    [-top, top]: with V = max_c(floor((top + 2) 2^s / m) + 1 + |bias_c|), a G beyond V gives
    |acc m / 2^s| > top + 1 before and after the clamp (the rescale is monotone), which saturates
    to the same end."""
    top = top + 2
    # (a multiplier 0, which the spec allows for a vanishing factor, maps every acc to 0: no bound)
    return max(((top << int(e)) // int(a) if int(a) else 0) + 1 + abs(int(b)) for a, e, b in
               zip(_ints(np.broadcast_to(m, np.shape(bias))), _ints(np.broadcast_to(s, np.shape(bias))), _ints(bias)))


def _cols(p: LayerParams, names, H: int):
    m = np.concatenate([np.broadcast_to(_np(p.rescale[n].multiplier), (H,)) for n in names])
    s = np.concatenate([np.broadcast_to(_np(p.rescale[n].shift), (H,)) for n in names])
    return m, s


class _Layer:
    """One layer and direction: its constants and the nodes of W.x, the Scan and its body."""

    def __init__(self, g: Graph, p: LayerParams, where: str, integer_gemm: bool = True):
        self.g, self.p, self.where, self.integer_gemm = g, p, where, integer_gemm
        self.H, self.I = p.hidden_size, p.input_size
        self.bounds = operand_bounds(p.bits, p.input_size, p.hidden_size)

    def form(self, what: str, m, s, vmax: int, normalize: bool = True) -> Form:
        f = Form(_np(m), _np(s), vmax, normalize)
        if f.kind is None:
            raise ONNXExportError(f"{self.where}: the rescale {what} has no exact float64 form for operands up "
                                  f"to {vmax} (multipliers up to {int(_np(m).max())}, shifts "
                                  f"{int(_np(s).min())}..{int(_np(s).max())})")
        return f

    def rescale(self, v, name: str, vmax: int, **kw) -> str:
        r = self.p.rescale[name]
        return apply_rescale(self.g, v, self.form(name, r.multiplier, r.shift, vmax), **kw)

    # -- GEMM ---------------------------------------------------------------------------------
    def doubled(self, u8: str) -> str:
        """[a, a]: a uint8 GEMM activation a = q + 128, twice on its last axis (gemm's operand)."""
        return self.g.op("Concat", [u8, u8], axis=-1)

    def gemm(self, q: str, q_bits: int, w: torch.Tensor, w_bits: int, u8: Optional[str] = None) -> str:
        """q [.., K] (float64 integers of q_bits bits) times w^T (w [C, K]) -> [.., C]: int32 from
        MatMulInteger when both have at most 8 bits ([a, a] . [w1; w2], a = q + 128 uint8 with zero
        point 128, w = w1 + w2 int8 halves of magnitude <= 64: see _SPLIT_WEIGHTS_WHY), else float64
        (MatMul; every partial sum an integer below 2^47). ``u8``: the doubled uint8 activation
        [a, a] (``doubled``), when the caller made it (once for the three gates)."""
        g = self.g
        wt = _np(w).T.copy()
        if self.int8(q_bits, w_bits):
            a2 = u8 if u8 is not None else self.doubled(g.cast(g.add(q, g.const(128.0)), 2))
            w1 = np.clip(wt.astype(np.int64), -64, 64)
            w12 = np.concatenate([w1, wt.astype(np.int64) - w1]).astype(np.int8)
            return g.op("MatMulInteger", [a2, g.const(w12, np.int8, "w"),
                                          g.const(np.uint8(128), np.uint8)])
        return g.op("MatMul", [q, g.const(wt.astype(np.float64), np.float64, "w")])

    def int8(self, q_bits: int, w_bits: int) -> bool:
        """Whether a GEMM of these operands is a MatMulInteger (else float64 MatMul)."""
        return self.integer_gemm and q_bits <= 8 and w_bits <= 8

    def requant(self, prod: str, bits_in: Tuple[int, int], w: np.ndarray, bias, m, s, zp, out_bits: int,
                what: str, per_token=None) -> str:
        """golden's Wx / Rh of one gate minus its zero point, sat(round_half_up((prod + bias) m / 2^s)
        + Z) - Z, as float64 (prod: the raw GEMM output q . w^T). ``per_token(array [J, C]) -> tensor``
        (x levels): bias, m, s are per level, gathered per token. The raw product is first clamped to
        +-V (_acc_clip: no result changes), which bounds the rescale's operand far below the static
        bound, so that the short form usually applies."""
        g = self.g
        lo, hi = qrange(out_bits)
        zpa = np.broadcast_to(_np(zp).astype(np.int64), np.shape(bias)[-1:])
        bias_i = np.asarray(bias, np.int64)
        V = _acc_clip(m, s, bias_i, max(abs(lo), abs(hi)) + int(np.abs(zpa).max()))
        rowsum = np.abs(w.astype(np.int64)).sum(1)  # |G| <= max|q| rowsum(|w|)
        V = min(V, int(rowsum.max()) * (1 << (bits_in[0] - 1)))
        vmax = V + int(np.abs(bias_i).max())
        # No clamp is applied: every operation below is monotone in the product (positive constants,
        # Add, Mul, Floor, all correctly rounded), exact for |G| <= V, and for |G| > V gives a value at
        # least as far out as G = +-V does, beyond the range: the clamp to it gives the true result.
        x = g.cast(prod, 11) if self.int8(*bits_in) else prod
        zf = zpa.astype(np.float64)
        if per_token is None:
            f = self.form(what, m, s, vmax)
            if f.kind == "f1" and f.rne_ok():  # floor((G + b) c + 1/2) = RNE(G c + (b c + 2^-(s+1))) (Form)
                y = g.rne(g.add(g.mul(x, g.const(f.c)), g.const(bias_i.astype(np.float64) * f.c + _pow2f(-(f.s + 1)))))
            elif f.kind == "f1":  # floor((G + b) c + 1/2) = floor(G c + (b c + 1/2)): b c + 1/2 exact (|b| <= vmax)
                y = g.floor(g.add(g.mul(x, g.const(f.c)), g.const(bias_i.astype(np.float64) * f.c + 0.5)))
            else:
                y = apply_rescale(g, g.add(x, g.const(bias_i.astype(np.float64))), f)
            return g.clip(y, lo - zf, hi - zf)
        # x levels: one shift for every level and channel (m 2^(S - s), S = max s), so that the
        # form's scalar constants are shared and only bias, mh, ml (or c) are gathered per token
        S = int(np.max(s))
        mm = [[int(a) << (S - int(e)) for a, e in zip(ra, rs)] for ra, rs in zip(m.tolist(), s.tolist())]
        if max(max(r) for r in mm) >= (1 << 62):
            raise ONNXExportError(f"{self.where}: the x levels' W.x rescales span too many octaves for the ONNX form")
        f = Form(np.array(mm, np.int64), np.full(np.shape(s), S), vmax, normalize=False)
        if f.kind is None:
            raise ONNXExportError(f"{self.where}: the x levels' W.x rescale has no exact float64 form")
        rne = f.rne_ok()  # the last floor as Graph.rne (Form); every level has the shift S
        last = g.rne if rne else g.floor
        if f.kind == "f1":  # floor(G c + (b c + 1/2)), the bias folded as without levels (exact: above)
            e = _pow2f(-(S + 1)) if rne else 0.5
            y = last(g.add(g.mul(x, per_token(f.c)), per_token(bias_i.astype(np.float64) * f.c + e)))
        else:
            acc = g.add(x, per_token(bias_i.astype(np.float64)))
            a = g.mul(acc, per_token(f.mh))
            b = g.floor(g.mul(acc, per_token(f.mls)))
            y = last(g.mul(g.add(g.add(a, b), g.const(0.5 if rne else float(f.half.reshape(-1)[0]))),
                           g.const(float(f.inv.reshape(-1)[0]))))
        return g.clip(y, lo - zf, hi - zf)

    # -- W.x ------------------------------------------------------------------------------------
    def input_products(self, qx: str) -> List[str]:
        """W.x of the whole sequence, one GEMM per gate (golden.input_gemm's product q_x . W^T):
        [T, N, H] each, int32 (MatMulInteger) or float64 (MatMul)."""
        g, p, H = self.g, self.p, self.H
        bx, bw = p.bits["x"], p.bits["W"]
        W = _np(p.W)
        u8 = self.doubled(g.cast(g.add(qx, g.const(128.0)), 2)) if self.int8(bx, bw) else None
        return [self.gemm(qx, bx, W[q * H:(q + 1) * H], bw, u8=u8) for q in range(3)]

    def input_term(self, q: int, prod: str, level: Optional[str]) -> str:
        """One step's (or the sequence's) W.x term of gate q from its product: golden.input_gemm's
        requantization (x levels: the token's bias and rescale), then the gate's Wx rescale onto its
        pre-activation grid, offset to the table's index: rescale(q_Wx - Z_Wx) + Z_pre - qmin_pre.
        Run inside the step: elementwise work on [N, H] stays in cache, where the same work on the
        whole [T, N, H] sequence streams through memory (measured ~10x slower per element)."""
        g, p, H = self.g, self.p, self.H
        bx, bw = p.bits["x"], p.bits["W"]
        W = _np(p.W)
        wzp = _np(p.W_zp_comp).astype(np.int64)
        name = "rzg"[q]
        cols = slice(q * H, (q + 1) * H)
        if level is None:
            r = p.rescale["Wx"]
            d_wx = self.requant(prod, (bx, bw), W[cols], _np(p.b_x).astype(np.int64)[cols] - wzp[cols],
                                _gate_cols(r.multiplier, cols), _gate_cols(r.shift, cols),
                                _gate_cols(p.zp["Wx"], cols), p.bits["Wx"], f"Wx ({name})")
        else:
            lv = p.x_levels

            def per_token(arr):
                arr = np.ascontiguousarray(np.broadcast_to(np.asarray(arr, np.float64), (lv.b_x.shape[0], H)))
                return g.op("Gather", [g.const(arr), level], axis=0)  # [.., N, H]

            d_wx = self.requant(prod, (bx, bw), W[cols], _np(lv.b_x).astype(np.int64)[:, cols] - wzp[None, cols],
                                _np(lv.rescale.multiplier)[:, cols], _np(lv.rescale.shift)[:, cols],
                                _gate_cols(p.zp["Wx"], cols), p.bits["Wx"], f"Wx ({name}, x levels)",
                                per_token=per_token)
        r = p.rescale[f"Wx_{name}"]
        f = self.form(f"Wx_{name}", r.multiplier, r.shift, (1 << p.bits["Wx"]) - 1)
        off = self.offset[name]
        return apply_rescale(g, d_wx, f, add_const=off, add_bound=abs(off))

    # -- the step -----------------------------------------------------------------------------
    def setup(self):
        """Tables, the step's rescale forms, and which additions fold into them."""
        p, H, b = self.p, self.H, self.p.bits
        self.tables = {n: _table(p, n) for n in "rzg"}
        self.offset = {n: float(int(p.zp[f"{n}_pre"]) - qrange(b[f"{n}_pre"])[0]) for n in "rzg"}  # Z_pre - qmin
        self.top = {n: float(len(self.tables[n]) - 1) for n in "rzg"}
        span_rh = (1 << b["Rh"]) - 1
        self.forms, self.fold = {}, {}
        for n in "rzg":
            r = p.rescale[f"Wx_{n}"]
            wx_bound = Form(_np(r.multiplier), _np(r.shift), (1 << b["Wx"]) - 1).result_bound() + int(self.offset[n]) + 1
            if n == "g":  # r * Rh_g
                f = self.form("rRh_g", p.rescale["rRh_g"].multiplier, p.rescale["rRh_g"].shift,
                              ((1 << b["r"]) - 1) * span_rh)
            else:
                f = self.form(f"Rh_{n}", p.rescale[f"Rh_{n}"].multiplier, p.rescale[f"Rh_{n}"].shift, span_rh)
            self.forms[n], self.fold[n] = f, wx_bound

    def body(self, d_h: str, wx: Sequence[str]) -> str:
        """gru_step on the state d_h = q_h - Z_h [N, H] (float64) and this step's Wx terms."""
        g, p, H = self.g, self.p, self.H
        b, zp = p.bits, p.zp
        z_h = int(zp["h"])
        h_lo, h_hi = qrange(b["h"])
        span_h = _span(b["h"], z_h)
        R = _np(p.R)
        # the recurrent operand (golden.recurrent_operand), straight into MatMulInteger's uint8
        u8 = None
        if "h_gemm" in b:
            lo, hi = qrange(b["h_gemm"])
            zo = int(zp["h_gemm"])
            op_bits = b["h_gemm"]
            f = self.form("h_gemm", p.rescale["h_gemm"].multiplier, p.rescale["h_gemm"].shift, span_h)
            if self.int8(op_bits, b["R"]):
                y = apply_rescale(g, d_h, f, add_const=float(zo + 128), add_bound=abs(zo) + 128, floor=False)
                u8 = self.doubled(g.cast(g.clip(y, float(lo + 128), float(hi + 128)), 2))
                op = None
            else:
                op = g.clip(apply_rescale(g, d_h, f, add_const=float(zo), add_bound=abs(zo)), lo, hi)
        else:
            op_bits = b["h"]
            op = g.add(d_h, g.const(float(z_h)))
            if self.int8(op_bits, b["R"]):
                u8 = self.doubled(g.cast(g.add(d_h, g.const(float(z_h + 128))), 2))
        r = p.rescale["Rh"]
        bias = _np(p.b_h).astype(np.int64) - _np(p.R_zp_comp).astype(np.int64)
        d_rh = {}
        for q, name in enumerate("rzg"):
            cols = slice(q * H, (q + 1) * H)
            prod = self.gemm(op, op_bits, R[cols], b["R"], u8=u8)
            d_rh[name] = self.requant(prod, (op_bits, b["R"]), R[cols], bias[cols], _gate_cols(r.multiplier, cols),
                                      _gate_cols(r.shift, cols), _gate_cols(zp["Rh"], cols), b["Rh"], f"Rh ({name})")
        # r, z: index = Wx term + rescale(d_Rh), saturated to the table; the floor is the Cast's
        d = {}
        for q, name in enumerate("rz"):
            y = apply_rescale(g, d_rh[name], self.forms[name], add_tensor=wx[q], add_bound=self.fold[name],
                              floor=False)
            d[name] = self.lookup(name, y)
        # g: Wx_g term + rescale(r * Rh_g), saturated, tanh table
        y = apply_rescale(g, g.mul(d["r"], d_rh["g"]), self.forms["g"], add_tensor=wx[2], add_bound=self.fold["g"],
                          floor=False)
        d_g = self.lookup("g", y)
        # h' - Z_h = sat(rescale(z (h - Z_h)) + rescale((1 - z) g) + Z_h) - Z_h
        zh = self.rescale(g.mul(d["z"], d_h), "zh", ((1 << b["z"]) - 1) * span_h)
        one_minus_z = g.sub(g.const(float(p.one_z)), d["z"])
        zg_max = (1 << b["z"]) * (1 << (b["g"] - 1))
        zh_bound = Form(_np(p.rescale["zh"].multiplier), _np(p.rescale["zh"].shift),
                        ((1 << b["z"]) - 1) * span_h).result_bound()
        h_new = self.rescale(g.mul(one_minus_z, d_g), "zg", zg_max, add_tensor=zh, add_bound=zh_bound)
        return g.clip(h_new, float(h_lo - z_h), float(h_hi - z_h))

    def lookup(self, name: str, y: str) -> str:
        """The gate's table at floor(y), y clamped to the table (a float whose floor is the index:
        Cast truncates, and the clamp keeps it >= 0): GatherElements on the flattened indices (ONNX
        Runtime's Gather copies one element per index through a generic block copy, ~10x slower)."""
        g = self.g
        idx = g.cast(g.clip(y, 0.0, self.top[name]), 6)  # int32 indices: ORT gathers them faster than int64
        flat = g.op("Reshape", [idx, g.const(np.array([-1]), np.int64)])
        t = self.tables[name]
        dt = _table_dtype(t)
        if dt is None:
            v = g.op("GatherElements", [g.const(t), flat], axis=0)
        else:  # the entries as 16-bit (or 32-bit) integers, exactly, then float64: a smaller table to read
            v = g.cast(g.op("GatherElements", [g.const(t.astype(dt), dt), flat], axis=0), 11)
        return g.op("Reshape", [v, g.const(np.array([-1, self.H]), np.int64)])

    def run(self, qx: str, d_h0: str, level: Optional[str], reverse: bool) -> Tuple[str, str]:
        """(outputs - Z_h [T, N, H], h_n - Z_h [N, H]) as float64 integer tensors."""
        onnx = _onnx()
        g = self.g
        self.setup()
        prods = self.input_products(qx)  # the GEMM for the whole sequence, before the loop
        P = onnx.TensorProto
        p_type = P.INT32 if self.int8(self.p.bits["x"], self.p.bits["W"]) else P.DOUBLE
        outer_nodes = g.nodes
        g.nodes = []
        st_in = g.name("h_in")
        p_in = [g.name(f"wx{n}_in") for n in "rzg"]
        lv_in = g.name("level_in") if level is not None else None
        wx = [self.input_term(q, p_in[q], lv_in) for q in range(3)]
        h_new = self.body(st_in, wx)
        # (one value listed as both body outputs passes onnx's checker but ONNX Runtime 1.32 then
        # returns garbage: the output buffer is reused as the next step's state.) The scan output is
        # a float32 Cast: q_h - Z_h has at most 17 bits, exact in float32; half the bytes of a float64
        # Identity (which cost more than a Cast inside ORT's Scan), cast back once after the loop.
        y_out = g.cast(h_new, P.FLOAT)
        body_nodes, g.nodes = g.nodes, outer_nodes
        vi = onnx.helper.make_tensor_value_info
        inputs = [vi(st_in, P.DOUBLE, None)] + [vi(n, p_type, None) for n in p_in]
        scans = prods
        if level is not None:
            inputs.append(vi(lv_in, P.INT64, None))
            scans = prods + [level]
        body = onnx.helper.make_graph(body_nodes, g.name("step"), inputs,
                                      [vi(h_new, P.DOUBLE, None), vi(y_out, P.FLOAT, None)])
        direction = [1 if reverse else 0]
        hn, out = g.op("Scan", [d_h0] + scans, n_out=2, body=body, num_scan_inputs=len(scans),
                       scan_input_directions=direction * len(scans), scan_output_directions=direction)
        return g.cast(out, P.DOUBLE), hn


def _gate_cols(v, cols: slice) -> np.ndarray:
    """A per-channel (or per-tensor) [3H] parameter's entries for one gate's channels."""
    a = _np(v)
    return a[cols] if a.ndim else a


def _checked_h0(g: Graph, x: str, h0: str, rows: int, H: int) -> str:
    """h0 [rows, N, H] (N: x's batch) unchanged, or a run-time error for any other shape: the module
    raises QGRUInputError there, and a Gather of each layer's row alone would silently take the
    first rows of an h0 with too many (and broadcast a batch or rows of 1). ONNX has no assert: h0
    goes through a Reshape to its own shape when Shape(h0) equals [rows, N, H], else to
    [Size(h0) + 1, 1, 1], which no tensor of Size(h0) elements can take (Reshape fails in every
    conforming runtime). The node's name says what h0 must be; a rank other than 3 fails at the
    Equal (shape vectors of different lengths) or at the Reshape."""
    i64 = np.int64
    want = g.op("Concat", [g.const(np.array([rows]), i64), g.op("Shape", [x], start=1, end=2),
                           g.const(np.array([H]), i64)], axis=0)
    same = g.op("ReduceMin", [g.cast(g.op("Equal", [g.op("Shape", [h0]), want]), 7)], keepdims=1)  # [1], 0 or 1
    wrong = g.op("Concat", [g.op("Unsqueeze", [g.add(g.op("Size", [h0]), g.const(i64(1), i64)),
                                              g.const(np.array([0]), i64)]),
                            g.const(np.array([1, 1]), i64)], axis=0)
    target = g.op("Where", [g.cast(same, 9), want, wrong])
    out = g.op("Reshape", [h0, target], hint="h0_checked")
    g.nodes[-1].name = g.name(f"h0_must_be_{rows}xNx{H}")
    return out


def gru_nodes(params: QuantParams, g: Graph, x: str, h0: str, out: str, h_n: str, out_dtype: int,
              where: str = "QuantGRU", integer_gemm: bool = True) -> None:
    """Append to ``g`` the nodes computing integer_forward: x [T, N, I] and h0 [L*D, N, H] (float
    tensors of any float dtype, time-major) -> ``out`` [T, N, D*H] and ``h_n`` [L*D, N, H] of ONNX
    dtype ``out_dtype``. ``where`` names the module in errors. ``integer_gemm=False``: every GEMM a
    float64 MatMul (exact in any runtime, slower) instead of MatMulInteger for 8-bit operands."""
    layers = params.layers
    L, D = len(layers), len(layers[0])
    x64 = g.cast(x, 11)
    h064 = _checked_h0(g, x, g.cast(h0, 11), L * D, layers[0][0].hidden_size)
    q_prev: List[str] = []
    h_ns: List[str] = []
    for li, row in enumerate(layers):
        outs = []
        for d, p in enumerate(row):
            lay = _Layer(g, p, f"{where} (layer {li}, {'reverse' if d else 'forward'})", integer_gemm)
            level = None
            if li == 0 and p.x_levels is not None:
                lv = p.x_levels
                mn = g.op("ReduceMin", [x64], axes=[-1], keepdims=1)
                mx = g.op("ReduceMax", [x64], axes=[-1], keepdims=1)
                fits = g.op("And", [g.op("GreaterOrEqual", [mn, g.const(_np(lv.lo).astype(np.float64))]),
                                    g.op("LessOrEqual", [mx, g.const(_np(lv.hi).astype(np.float64))])])
                J = int(lv.exponent.numel())
                last = np.zeros(J, np.bool_)
                last[-1] = True
                fits = g.cast(g.op("Or", [fits, g.const(last, np.bool_)]), 6)  # int32 [T, N, J]
                level = g.op("ArgMax", [fits], axis=-1, keepdims=0, select_last_index=0)  # [T, N] int64
                scale = g.op("Unsqueeze", [g.op("Gather", [g.const(_np(lv.scale).astype(np.float64)), level], axis=0),
                                           g.const(np.array([-1]), np.int64)])
                qx = quantize(g, x64, scale, int(p.zp["x"]), p.bits["x"])
            elif li == 0:
                qx = quantize(g, x64, g.const(float(p.scale["x"])), int(p.zp["x"]), p.bits["x"])
            else:
                lo, hi = qrange(p.bits["x"])
                parts = []
                for e, dq in enumerate(q_prev):  # (q - Z_h) of the previous layer
                    pe = layers[li - 1][e]
                    zx = int(p.zp["x"])
                    v = lay.rescale(dq, f"in_{e}", _span(pe.bits["h"], pe.zp["h"]), add_const=float(zx),
                                    add_bound=abs(zx))
                    parts.append(g.clip(v, lo, hi))
                qx = parts[0] if len(parts) == 1 else g.op("Concat", parts, axis=-1)
            h0_i = g.op("Gather", [h064, g.const(np.int64(li * D + d), np.int64)], axis=0)
            qh0 = quantize(g, h0_i, g.const(float(p.scale["h"])), int(p.zp["h"]), p.bits["h"])
            d_h0 = g.sub(qh0, g.const(float(int(p.zp["h"]))))
            o, hn = lay.run(qx, d_h0, level, reverse=d == 1)
            outs.append(o)
            h_ns.append(hn)
        q_prev = outs

    def dequant(q, p):
        v = g.mul(q, g.const(float(p.scale["h"])))  # (q - Z) S: q holds q - Z
        return g.cast(g.cast(v, 1), out_dtype) if out_dtype != 1 else g.cast(v, 1)

    last = [dequant(q, p) for q, p in zip(q_prev, layers[-1])]
    flat = [p for row in layers for p in row]
    hns = [g.op("Unsqueeze", [dequant(q, p), g.const(np.array([0]), np.int64)]) for q, p in zip(h_ns, flat)]
    g.nodes.append(_onnx().helper.make_node("Identity", [last[0]] if len(last) == 1 else
                                            [g.op("Concat", last, axis=-1)], [out]))
    g.nodes.append(_onnx().helper.make_node("Identity", [hns[0]] if len(hns) == 1 else
                                            [g.op("Concat", hns, axis=0)], [h_n]))


def build_model(params: QuantParams, integer_gemm: bool = True):
    """A standalone ModelProto of a QuantParams' integer forward: inputs x [T, N, I] float32 and h0
    [L*D, N, H] float32 (time-major), outputs out and h_n (float32), dynamic T and N."""
    onnx = _onnx()
    g = Graph("qgru_")
    meta = params.meta
    L, D, I, H = meta["num_layers"], 2 if meta["bidirectional"] else 1, meta["input_size"], meta["hidden_size"]
    gru_nodes(params, g, "x", "h0", "out", "h_n", onnx.TensorProto.FLOAT, integer_gemm=integer_gemm)
    F = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(
        g.nodes, "qgru", [onnx.helper.make_tensor_value_info("x", F, ["T", "N", I]),
                          onnx.helper.make_tensor_value_info("h0", F, [L * D, "N", H])],
        [onnx.helper.make_tensor_value_info("out", F, ["T", "N", D * H]),
         onnx.helper.make_tensor_value_info("h_n", F, [L * D, "N", H])], g.inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)])
