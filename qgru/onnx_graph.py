"""A converted GRU's integer forward as standard ONNX operators (layer 2: parameters -> a graph).

``gru_nodes(params, x, h0, out, h_n, prefix)`` builds, from a QuantParams (every layer and
direction), the nodes and initializers of one ONNX subgraph that computes exactly what
``runtime.integer_forward`` computes: time-major float x [T, N, I] and h0 [L*D, N, H] in, the
float32 outputs [T, N, D*H] and h_n [L*D, N, H] out (then cast to x's dtype). qgru.export_onnx
splices it into a whole model's graph (qgru/onnx_export.py). docs/onnx.md has the design; every
operation is golden.py's, written with the default ONNX domain only:

* the float boundary: primitives.quantize (float64 division, clamp, round half up as
  ``floor(v) + (v - floor(v) >= 0.5)``, saturate), golden.select_levels for x levels (ReduceMin /
  ReduceMax per token, compared in float64, the first level that holds the token: ArgMax),
  primitives.dequantize ((q - Z) S in float64, then Cast to float32);
* the GEMMs: MatMulInteger (uint8 activation with zero point 128, int8 weights: (a - 128) . w,
  the exact int32 dot product) where x / the R.h operand and the weights have at most 8 bits; a
  float64 MatMul otherwise (exact: every partial sum is an integer below 2^47, docs/spec.md
  section 6, as golden's own CPU GEMM). W.x for the whole sequence is one GEMM before the loop;
* the cell: a Scan over time (scan_input_directions = 1 for a reverse direction), whose body is
  gru_step. Integers are held in float64 tensors (every stored value and every product formed is
  an integer below 2^53, so float64 Add / Mul / Floor are exact on them). Each rescale
  round_half_up(v m / 2^s) is one of two forms chosen per rescale from the static bound of |v|
  (``_rescale``: each form's proof is in its docstring, and an export whose bounds fit neither
  raises); the tables are golden's lookup over every input integer (``Gather``).

The graph never reads a NaN check (ONNX has no exceptions): a NaN in x or h0 gives unspecified
integers where the module raises. Everything here is plain numpy + onnx.helper.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .convert import _bits_of, operand_bounds, recurrent_operand
from .export import QuantParams
from .golden import LayerParams
from .primitives import qrange
from .tables import lookup

OPSET = 17
F64_EXACT = 1 << 53


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

    def clip(self, a, lo, hi):
        """Clamp to [lo, hi]: scalars (Clip) or per-channel arrays (Max, Min)."""
        lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
        if lo.ndim == 0 and hi.ndim == 0:
            return self.op("Clip", [a, self.const(lo), self.const(hi)])
        if lo.ndim and np.all(lo == lo.flat[0]) and np.all(hi == hi.flat[0]):
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


def _pow2f(e: np.ndarray) -> np.ndarray:
    return np.ldexp(np.ones(np.shape(e)), np.asarray(e, np.int64))


def rescale_form(m, s, vmax: int):
    """The exact float64 form of round_half_up(v m / 2^s) for every integer |v| <= vmax, or None.

    Returns ("f1", c) or ("f2", k, mh, ml_scaled, half, inv):

    * f1: floor(v c + 1/2), c = m 2^-s. When vmax m + 2^(s-1) <= 2^53: v m is an integer below
      2^53, so v c = v m 2^-s exactly (a power-of-two scaling), and v c + 1/2 = (v m + 2^(s-1)) 2^-s
      has an integer numerator of magnitude <= 2^53: exact; floor is exact. When s >= 54 and
      vmax m < 2^52: |v c| < 1/4, the computed sum lies in [1/4, 3/4], floor 0, which is the
      true result ((v m + 2^(s-1)) / 2^s in (1/4, 3/4)).
    * f2: with m = mh 2^k + ml (0 <= ml < 2^k, 1 <= k <= s - 1):
        floor((v m + 2^(s-1)) / 2^s) = floor((v mh + floor(v ml / 2^k) + 2^(s-1-k)) / 2^(s-k))
      (divide by 2^k first: the integers v mh and 2^(s-1-k) leave the inner floor; nested floors
      of divisions by powers of two compose). v ml 2^-k is exact when vmax 2^k <= 2^53, and the
      outer sum when vmax mh + vmax + 1 + 2^(s-1-k) < 2^53.
    """
    m = np.asarray(m, np.int64)
    s = np.asarray(s, np.int64)
    m, s = _normalized(m, s)
    mm = [int(v) for v in m.reshape(-1)]
    ss = [int(v) for v in s.reshape(-1)]
    ok1 = all(vmax * a + (1 << (b - 1)) <= F64_EXACT or (b >= 54 and vmax * a < (1 << 52)) for a, b in zip(mm, ss))
    if ok1:
        return ("f1", np.ldexp(m.astype(np.float64), -s))
    k = min(min(ss) - 1, 53 - max(int(vmax).bit_length(), 1))
    if k < 1:
        return None
    mh = m >> k
    ml = m & ((1 << k) - 1)
    if any(vmax * (a >> k) + vmax + 1 + (1 << max(b - 1 - k, 0)) >= F64_EXACT for a, b in zip(mm, ss)):
        return None
    return ("f2", k, mh.astype(np.float64), np.ldexp(ml.astype(np.float64), -k),
            _pow2f(s - 1 - k), _pow2f(-(s - k)))


def _fold_ok(m, s, vmax: int, offset) -> bool:
    """Whether floor(v c + 1/2 + offset) is exact for the f1 form: the numerator
    v m + 2^(s-1) + offset 2^s (normalized m, s) is an integer of magnitude <= 2^53."""
    m, s = _normalized(np.asarray(m, np.int64), np.asarray(s, np.int64))
    off = np.broadcast_to(np.abs(np.asarray(offset, np.float64)), np.broadcast_shapes(m.shape, np.shape(offset)))
    m = np.broadcast_to(m, off.shape).reshape(-1)
    s = np.broadcast_to(s, off.shape).reshape(-1)
    return all(vmax * int(a) + (1 << (int(b) - 1)) + int(o) * (1 << int(b)) <= F64_EXACT
               for a, b, o in zip(m, s, off.reshape(-1)))


def apply_rescale(g: Graph, v: str, form, offset=None) -> str:
    """The nodes of a form from rescale_form on tensor v (constants broadcast on the last axis).
    ``offset`` (f1 only, an array or None): an integer added before the floor, when the caller
    proved the sum exact (it is then round_half_up(...) + offset)."""
    if form[0] == "f1":
        half = 0.5 if offset is None else np.asarray(offset, np.float64) + 0.5
        return g.floor(g.add(g.mul(v, g.const(form[1])), g.const(half)))
    _, k, mh, mls, half, inv = form
    a = g.mul(v, g.const(mh))
    b = g.floor(g.mul(v, g.const(mls)))
    return g.floor(g.mul(g.add(g.add(a, b), g.const(half)), g.const(inv)))


def rescale(g: Graph, v: str, m, s, vmax: int, what: str) -> str:
    form = rescale_form(_np(m), _np(s), vmax)
    if form is None:
        raise ONNXExportError(f"{what}: no exact float64 form of this rescale for operands up to {vmax} "
                              f"(multipliers up to {int(_np(m).max())}, shifts {int(_np(s).min())}..{int(_np(s).max())})")
    return apply_rescale(g, v, form)


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
    q = torch.arange(lo, hi + 1, dtype=torch.int64)
    zp = int(p.zp[name])
    return (lookup(q, p.tables[name], b, zp, p.bits[name]) - zp).double().numpy()


class _Layer:
    """One layer and direction: its constants and the nodes of W.x, the Scan and its body."""

    def __init__(self, g: Graph, p: LayerParams, where: str):
        self.g, self.p, self.where = g, p, where
        self.H, self.I = p.hidden_size, p.input_size
        self.bounds = operand_bounds(p.bits, p.input_size, p.hidden_size)

    def _fail(self, what):
        raise ONNXExportError(f"{self.where}: {what}")

    def rescale(self, v, name: str, vmax: int, m=None, s=None, offset=None):
        p = self.p
        if m is None:
            m, s = p.rescale[name].multiplier, p.rescale[name].shift
        form = rescale_form(_np(m), _np(s), vmax)
        if form is None:
            self._fail(f"the rescale {name} has no exact float64 form for operands up to {vmax}")
        if offset is not None and not (form[0] == "f1" and _fold_ok(_np(m), _np(s), vmax, offset)):
            return self.g.add(apply_rescale(self.g, v, form), self.g.const(offset))
        return apply_rescale(self.g, v, form, offset)

    # -- GEMM ---------------------------------------------------------------------------------
    def gemm(self, q: str, q_bits: int, w: torch.Tensor, w_bits: int) -> str:
        """q [.., K] (float64 integers of q_bits bits) times w^T (w [C, K]) -> float64 [.., C]."""
        g = self.g
        wt = _np(w).T.copy()
        if q_bits <= 8 and w_bits <= 8 and wt.size and wt.min() >= -128 and wt.max() <= 127:
            a = g.cast(g.add(q, g.const(128.0)), 2)  # uint8, zero point 128
            prod = g.op("MatMulInteger", [a, g.const(wt, np.int8, "w"), g.const(np.uint8(128), np.uint8)])
            return g.cast(prod, 11)
        return g.op("MatMul", [q, g.const(wt.astype(np.float64), np.float64, "w")])

    # -- W.x ------------------------------------------------------------------------------------
    def input_terms(self, qx: str, level: Optional[str]) -> str:
        """golden.input_gemm then each gate's Wx rescale onto its pre-activation grid, for the whole
        sequence: [T, N, 3H] float64, gate q's channels holding rescale(d_Wx) + Z_pre - qmin_pre
        (+ the offset of its table, see _tables)."""
        g, p, H = self.g, self.p, self.H
        acc = self.gemm(qx, p.bits["x"], p.W, p.bits["W"])
        zp_wx = _np(p.zp["Wx"]).astype(np.float64) * np.ones(3 * H)
        lo, hi = qrange(p.bits["Wx"])
        vmax = self.bounds["Wx"]
        if level is None:
            bias = _np(p.b_x).astype(np.float64) - _np(p.W_zp_comp).astype(np.float64)
            acc = g.add(acc, g.const(bias))
            q = self.rescale(acc, "Wx", vmax)
        else:
            lv = p.x_levels
            m, s = _np(lv.rescale.multiplier), _np(lv.rescale.shift)  # [J, 3H]
            form = rescale_form(m, s, vmax)
            if form is None:
                self._fail(f"the x levels' W.x rescale has no exact float64 form for operands up to {vmax}")
            bias = _np(lv.b_x).astype(np.float64) - _np(p.W_zp_comp).astype(np.float64)[None, :]

            def per_token(arr):
                arr = np.broadcast_to(np.asarray(arr, np.float64), m.shape)
                return g.op("Gather", [g.const(arr), level], axis=0)  # [T, N, 3H]

            acc = g.add(acc, per_token(bias))
            if form[0] == "f1":
                q = g.floor(g.add(g.mul(acc, per_token(form[1])), g.const(0.5)))
            else:
                _, k, mh, mls, half, inv = form
                a = g.mul(acc, per_token(mh))
                b = g.floor(g.mul(acc, per_token(mls)))
                q = g.floor(g.mul(g.add(g.add(a, b), per_token(half)), per_token(inv)))
        d_wx = g.clip(q, lo - zp_wx, hi - zp_wx)  # sat(q + Z) - Z
        # the three gates' Wx rescales at once: per channel of [r | z | g]
        ms = [p.rescale[n] for n in ("Wx_r", "Wx_z", "Wx_g")]
        m = np.concatenate([np.broadcast_to(_np(r.multiplier), (H,)) for r in ms])
        s = np.concatenate([np.broadcast_to(_np(r.shift), (H,)) for r in ms])
        wmax = (1 << p.bits["Wx"]) - 1
        return self.rescale(d_wx, "Wx_gates", wmax, m, s, offset=self.gate_offset)

    # -- the step -----------------------------------------------------------------------------
    def setup_tables(self):
        p, H = self.p, self.H
        t_r, t_z, t_g = _table(p, "r"), _table(p, "z"), _table(p, "g")
        self.t_rz = np.concatenate([t_r, t_z])
        self.t_g = t_g
        off = []
        for name, base in (("r", 0), ("z", len(t_r)), ("g", 0)):
            b = p.bits[f"{name}_pre"]
            lo, _ = qrange(b)
            off.append(np.full(H, float(int(p.zp[f"{name}_pre"]) - lo + base)))
        self.gate_offset = np.concatenate(off)  # Z_pre - qmin (+ r's table length for z)
        self.pre_range = {n: (len(t_r) if n == "z" else 0, (1 << p.bits[f"{n}_pre"]) - 1) for n in "rzg"}

    def body(self, state: str, wx: str) -> Tuple[str, str]:
        """gru_step on the state q_h [N, H] (float64) and this step's input terms [N, 3H]."""
        g, p, H = self.g, self.p, self.H
        b, zp = p.bits, p.zp
        z_h = float(int(zp["h"]))
        h_lo, h_hi = qrange(b["h"])
        d_h = g.sub(state, g.const(z_h))
        # the recurrent operand (golden.recurrent_operand)
        if "h_gemm" in b:
            lo, hi = qrange(b["h_gemm"])
            op = self.rescale(d_h, "h_gemm", self.bounds["h_gemm"])
            op = g.clip(g.add(op, g.const(float(int(zp["h_gemm"])))), lo, hi)
            op_bits = b["h_gemm"]
        else:
            op, op_bits = state, b["h"]
        acc = self.gemm(op, op_bits, p.R, b["R"])
        bias = _np(p.b_h).astype(np.float64) - _np(p.R_zp_comp).astype(np.float64)
        acc = g.add(acc, g.const(bias))
        lo, hi = qrange(b["Rh"])
        zp_rh = _np(zp["Rh"]).astype(np.float64) * np.ones(3 * H)
        d_rh = g.clip(self.rescale(acc, "Rh", self.bounds["Rh"]), lo - zp_rh, hi - zp_rh)
        d_rh_rz, d_rh_g = g.op("Split", [d_rh, g.const(np.array([2 * H, H]), np.int64)], n_out=2, axis=-1)
        wx_rz, wx_g = g.op("Split", [wx, g.const(np.array([2 * H, H]), np.int64)], n_out=2, axis=-1)
        # r and z: pre-activation index (Wx term + Rh term, saturated), one lookup in [T_r | T_z]
        rmax = (1 << b["Rh"]) - 1
        m = np.concatenate([np.broadcast_to(_np(p.rescale[n].multiplier), (H,)) for n in ("Rh_r", "Rh_z")])
        s = np.concatenate([np.broadcast_to(_np(p.rescale[n].shift), (H,)) for n in ("Rh_r", "Rh_z")])
        pre = g.add(self.rescale(d_rh_rz, "Rh_rz", rmax, m, s), wx_rz)
        (r_off, r_top), (z_off, z_top) = self.pre_range["r"], self.pre_range["z"]
        pre = g.clip(pre, np.concatenate([np.zeros(H), np.full(H, float(z_off))]),
                     np.concatenate([np.full(H, float(r_top)), np.full(H, float(z_off + z_top))]))
        d_rz = g.op("Gather", [g.const(self.t_rz), g.cast(pre, 7)], axis=0)
        d_r, d_z = g.op("Split", [d_rz, g.const(np.array([H, H]), np.int64)], n_out=2, axis=-1)
        # g: Wx_g + rescale(r * Rh_g), saturated, tanh table
        rr_max = ((1 << b["r"]) - 1) * rmax
        pre_g = g.add(self.rescale(g.mul(d_r, d_rh_g), "rRh_g", rr_max), wx_g)
        pre_g = g.clip(pre_g, 0.0, float(self.pre_range["g"][1]))
        d_g = g.op("Gather", [g.const(self.t_g), g.cast(pre_g, 7)], axis=0)
        # h' = sat(rescale(z (h - Z_h)) + rescale((1 - z) g) + Z_h)
        zh_max = ((1 << b["z"]) - 1) * ((1 << b["h"]) - 1)
        zh = self.rescale(g.mul(d_z, d_h), "zh", zh_max)
        zg_max = (1 << b["z"]) * (1 << (b["g"] - 1))
        one_minus_z = g.sub(g.const(float(p.one_z)), d_z)
        zg = self.rescale(g.mul(one_minus_z, d_g), "zg", zg_max)
        h_new = g.clip(g.add(g.add(zh, zg), g.const(z_h)), h_lo, h_hi)
        return h_new, h_new

    def run(self, qx: str, qh0: str, level: Optional[str], reverse: bool) -> Tuple[str, str]:
        """(q outputs [T, N, H], q h_n [N, H]) as float64 integer tensors."""
        onnx = _onnx()
        g = self.g
        self.setup_tables()
        wx = self.input_terms(qx, level)
        outer_nodes = g.nodes
        g.nodes = []
        st_in, wx_in = g.name("h_in"), g.name("wx_in")
        h_new, h_out = self.body(st_in, wx_in)
        h_keep = g.op("Identity", [h_new])
        y_out = g.op("Identity", [h_out])
        body_nodes, g.nodes = g.nodes, outer_nodes
        D = onnx.TensorProto.DOUBLE
        body = onnx.helper.make_graph(
            body_nodes, g.name("step"),
            [onnx.helper.make_tensor_value_info(st_in, D, None), onnx.helper.make_tensor_value_info(wx_in, D, None)],
            [onnx.helper.make_tensor_value_info(h_keep, D, None), onnx.helper.make_tensor_value_info(y_out, D, None)])
        hn, out = g.op("Scan", [qh0, wx], n_out=2, body=body, num_scan_inputs=1,
                       scan_input_directions=[1 if reverse else 0], scan_output_directions=[1 if reverse else 0])
        return out, hn


def gru_nodes(params: QuantParams, g: Graph, x: str, h0: str, out: str, h_n: str, out_dtype: int,
              where: str = "QuantGRU") -> None:
    """Append to ``g`` the nodes computing integer_forward: x [T, N, I] and h0 [L*D, N, H] (float
    tensors of any float dtype, time-major) -> ``out`` [T, N, D*H] and ``h_n`` [L*D, N, H] of ONNX
    dtype ``out_dtype``. ``where`` names the module in errors."""
    layers = params.layers
    L, D = len(layers), len(layers[0])
    x64 = g.cast(x, 11)
    h064 = g.cast(h0, 11)
    q_prev: List[str] = []
    h_ns: List[str] = []
    for li, row in enumerate(layers):
        outs = []
        for d, p in enumerate(row):
            lay = _Layer(g, p, f"{where} (layer {li}, {'reverse' if d else 'forward'})")
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
                for e, q in enumerate(q_prev):
                    pe = layers[li - 1][e]
                    dq = g.sub(q, g.const(float(int(pe.zp["h"]))))
                    v = lay.rescale(dq, f"in_{e}", (1 << pe.bits["h"]) - 1)
                    parts.append(g.clip(g.add(v, g.const(float(int(p.zp["x"])))), lo, hi))
                qx = parts[0] if len(parts) == 1 else g.op("Concat", parts, axis=-1)
            h0_i = g.op("Gather", [h064, g.const(np.int64(li * D + d), np.int64)], axis=0)
            qh0 = quantize(g, h0_i, g.const(float(p.scale["h"])), int(p.zp["h"]), p.bits["h"])
            o, hn = lay.run(qx, qh0, level, reverse=d == 1)
            outs.append(o)
            h_ns.append(hn)
        q_prev = outs

    def dequant(q, p):
        v = g.mul(g.sub(q, g.const(float(int(p.zp["h"])))), g.const(float(p.scale["h"])))
        return g.cast(g.cast(v, 1), out_dtype) if out_dtype != 1 else g.cast(v, 1)

    last = [dequant(q, p) for q, p in zip(q_prev, layers[-1])]
    flat = [p for row in layers for p in row]
    hns = [g.op("Unsqueeze", [dequant(q, p), g.const(np.array([0]), np.int64)]) for q, p in zip(h_ns, flat)]
    g.nodes.append(_onnx().helper.make_node("Identity", [last[0]] if len(last) == 1 else
                                            [g.op("Concat", last, axis=-1)], [out]))
    g.nodes.append(_onnx().helper.make_node("Identity", [hns[0]] if len(hns) == 1 else
                                            [g.op("Concat", hns, axis=0)], [h_n]))


def build_model(params: QuantParams, batch_first: bool = False):
    """A standalone ModelProto of a QuantParams' integer forward: inputs x [T, N, I] float32 and h0
    [L*D, N, H] float32 (time-major), outputs out and h_n (float32), dynamic T and N."""
    onnx = _onnx()
    g = Graph("qgru_")
    meta = params.meta
    L, D, I, H = meta["num_layers"], 2 if meta["bidirectional"] else 1, meta["input_size"], meta["hidden_size"]
    gru_nodes(params, g, "x", "h0", "out", "h_n", onnx.TensorProto.FLOAT)
    F = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(
        g.nodes, "qgru", [onnx.helper.make_tensor_value_info("x", F, ["T", "N", I]),
                          onnx.helper.make_tensor_value_info("h0", F, [L * D, "N", H])],
        [onnx.helper.make_tensor_value_info("out", F, ["T", "N", D * H]),
         onnx.helper.make_tensor_value_info("h_n", F, [L * D, "N", H])], g.inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)])
