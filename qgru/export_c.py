"""Export one converted layer and direction as self-contained C99 (for microcontrollers).

``write_c(params, "out/gru")`` writes ``out/gru.h`` and ``out/gru.c``:

* the integer parameters of ``params.layers[layer][direction]`` (weights int8_t / int16_t,
  biases int32_t, zero-point compensations int64_t, zero points, every rescale's multiplier and
  shift expanded per channel, the three tables int32_t, one_z, bit widths), ``static const``;
* a plain integer implementation of the golden model (stdint types only, int64_t intermediates):
  ``<prefix>_input`` (= golden ``input_gemm`` for one row), ``<prefix>_step`` (= ``gru_step`` for
  one batch row), ``<prefix>_run`` (a sequence) and, for layer > 0,
  ``<prefix>_requantize_input`` (the previous layer's outputs onto this layer's x grid). With an
  h_gemm tensor the step first requantizes the state onto h_gemm's grid (golden
  ``recurrent_operand``) and R.h reads that; the state arrays hold h's own bits either way;
* golden vectors (an integer input sequence, h0 and qgru.golden's outputs on them) and
  ``int <prefix>_selftest(void)``, compiled only with ``-D<PREFIX>_GOLDEN``; adding
  ``-D<PREFIX>_SELFTEST_MAIN`` also compiles a ``main`` that prints the mismatch count.

The C code takes integer x: a layer with x levels (the first layer of a config with x.dynamic,
docs/spec.md section 4b, which picks each token's grid from its float values) exports on its static
grid, level 0 (a UserWarning names the static override); layers above it have static x grids and
export as any other.

``path`` is a stem: ``.h`` and ``.c`` are appended (a trailing ``.h`` / ``.c`` is dropped first)
and missing parent folders are created. The C identifier prefix is the stem's file name with
every character that cannot appear in an identifier replaced by ``_`` (``out/my-gru`` ->
``my_gru``), or the ``prefix`` argument; macros use it upper-cased (``MY_GRU_HIDDEN_SIZE``).

CLI: ``python -m qgru.export_c params.qgru out/gru --layer 0 --direction 0``.
"""
from __future__ import annotations

import argparse
import dataclasses
import pickle
import re
import sys
import warnings
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch

from .convert import recurrent_operand
from .export import QuantParams, load_params
from .golden import LayerParams, gru_direction
from .primitives import qrange, saturate
from .tables import table_geometry

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_GATE_RESCALES = ("Wx_r", "Rh_r", "Wx_z", "Rh_z", "Wx_g", "rRh_g")  # one entry per hidden unit


def golden_vectors(p: LayerParams, steps: int = 8, seed: int = 0) -> Tuple[torch.Tensor, ...]:
    """(q_x [T, I], q_h0 [H], q_out [T, H]): a deterministic input sequence and the golden outputs.

    x is drawn around its zero point with a spread of a quarter of its range, so a few percent of
    the values fall outside it and saturate (as quantize() would saturate out-of-range floats);
    step 0 is set to x's two extremes (alternating) so that both ends always occur. h0 is uniform
    over h's range.
    """
    cpu = torch.device("cpu")  # the vectors are made where the generator is (not the default device)
    g = torch.Generator(device=cpu).manual_seed(seed)
    lo, hi = qrange(p.bits["x"])
    d = torch.randn(steps, p.input_size, generator=g, dtype=torch.float64, device=cpu) * ((hi - lo) / 4)
    qx = saturate(d.round().to(torch.int64) + p.zp["x"], p.bits["x"])
    if steps:
        qx[0, 0::2], qx[0, 1::2] = lo, hi
    hlo, hhi = qrange(p.bits["h"])
    qh0 = torch.randint(hlo, hhi + 1, (p.hidden_size,), generator=g, dtype=torch.int64, device=cpu)
    out, _ = gru_direction(p, qx.unsqueeze(1), qh0.unsqueeze(0))
    return qx, qh0, out.squeeze(1)


def write_c(params: QuantParams, path: Union[str, Path], layer: int = 0, direction: int = 0,
            golden_steps: int = 8, seed: int = 0, prefix: Optional[str] = None) -> Tuple[Path, Path]:
    """Write ``<stem>.h`` and ``<stem>.c`` for ``params.layers[layer][direction]``; returns their paths."""
    for name, v in (("layer", layer), ("direction", direction), ("golden_steps", golden_steps), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"write_c: {name} must be an int, got {type(v).__name__} {v!r}")
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"write_c: prefix must be a str (a C identifier) or None, got {type(prefix).__name__}")
    if not 0 <= layer < len(params.layers):
        raise ValueError(f"layer {layer} out of range: the model has {len(params.layers)} layer(s)")
    row = params.layers[layer]
    if not 0 <= direction < len(row):
        raise ValueError(f"direction {direction} out of range: the model has {len(row)} direction(s)")
    stem = Path(path)
    if stem.suffix in (".h", ".c"):
        stem = stem.with_suffix("")
    # the stem's name is written into the C text, in #include "<stem>.h" and in comments, where a
    # '"', a backslash or a line break would end them early (C that does not compile); a file name
    # holds no '/', so no "*/" either
    bad = sorted({c for c in stem.name if not c.isprintable() or c in '"\\'})
    if bad:
        raise ValueError(f"write_c: the file name {stem.name!r} cannot be written into C (#include \"{{name}}.h\" "
                         f"and comments): it holds {', '.join(map(repr, bad))}; use printable characters other "
                         "than '\"' and '\\'")
    if prefix is None:
        prefix = re.sub(r"\W", "_", stem.name, flags=re.ASCII) or "gru"
        if prefix[0].isdigit():
            prefix = "qgru_" + prefix
    if not _IDENT.match(prefix):
        raise ValueError(f"prefix {prefix!r} is not a C identifier")
    if golden_steps < 1:
        raise ValueError(f"golden_steps must be >= 1, got {golden_steps}")
    p = row[direction]
    if p.x_levels is not None:
        # the C code takes integer x (q_x on one grid; the float input is quantized by the caller):
        # x levels choose a grid per token from the float values, which it never sees. It runs the
        # layer on level 0, the static grid (golden.gru_direction without levels: the same integers)
        warnings.warn("write_c: this layer's x levels are not exported (config x.dynamic: each token of the float "
                      "input on its own grid, docs/spec.md section 4b): the C code takes integer x on the static "
                      "grid (level 0, the calibrated range), where inputs beyond calibration saturate. For a model "
                      "that runs the same on the host, convert with overrides={\"tensors\": {\"x\": {\"dynamic\": "
                      "False}}} (docs/spec.md section 10)", UserWarning, stacklevel=3)
        p = dataclasses.replace(p, x_levels=None)
    prev = params.layers[layer - 1] if layer > 0 else []
    golden = golden_vectors(p, golden_steps, seed)
    ctx = _Ctx(p, prefix, layer, direction, params.meta, prev, golden, stem.name)
    stem.parent.mkdir(parents=True, exist_ok=True)
    h_path, c_path = stem.with_name(stem.name + ".h"), stem.with_name(stem.name + ".c")
    h_path.write_text(ctx.header())
    c_path.write_text(ctx.source())
    return h_path, c_path


# ---------------------------------------------------------------------------------------------
# C text
# ---------------------------------------------------------------------------------------------
def _lit(v: int) -> str:
    """A C integer literal of the right value on any target (int may be 16 bits on an MCU: decimal
    literals then widen to long on their own; INT32_MIN and 64-bit values need spelling out)."""
    v = int(v)
    if v == -(1 << 31):
        return "INT32_MIN"
    if not -(1 << 31) < v < (1 << 31):
        return f"INT64_C({v})"
    return str(v)


def _c(v) -> str:
    """A macro body: the literal, parenthesized when negative (so it is safe after any operator)."""
    s = _lit(v)
    return f"({s})" if s.startswith("-") else s


def _list(values: Iterable[int], per_line: int = 16, indent: str = "    ") -> str:
    vals = [_lit(v) for v in values]
    lines = [", ".join(vals[i:i + per_line]) for i in range(0, len(vals), per_line)]
    return indent + (",\n" + indent).join(lines)


def _array(ctype: str, name: str, t: torch.Tensor, comment: str = "") -> str:
    """``static const`` 1-D or 2-D (row-major, one row a line) array definition."""
    c = f"/* {comment} */\n" if comment else ""
    if t.dim() == 2:
        rows = ",\n".join("    {" + ", ".join(map(_lit, r)) + "}" for r in t.tolist())
        return f"{c}static const {ctype} {name}[{t.shape[0]}][{t.shape[1]}] = {{\n{rows}\n}};\n"
    return f"{c}static const {ctype} {name}[{t.numel()}] = {{\n{_list(t.tolist())}\n}};\n"


def _weight_type(bits: int) -> str:
    return "int8_t" if bits <= 8 else "int16_t"


class _Ctx:
    def __init__(self, p: LayerParams, prefix: str, layer: int, direction: int, meta, prev: Sequence[LayerParams],
                 golden, stem_name: str):
        self.p, self.pre, self.PRE = p, prefix, prefix.upper()
        self.layer, self.direction, self.meta, self.prev, self.golden = layer, direction, meta, prev, golden
        self.stem_name = stem_name
        self.I, self.H = p.input_size, p.hidden_size
        # what R.h reads: the state h itself, or h_gemm (h requantized every step onto a narrower grid)
        self.hg = recurrent_operand(p.bits) == "h_gemm"

    # -- header ----------------------------------------------------------------------------------
    def header(self) -> str:
        p, P, pre, I, H = self.p, self.PRE, self.pre, self.I, self.H
        cfg = self.meta.get("config", {})
        xlo, xhi = qrange(p.bits["x"])
        hlo, hhi = qrange(p.bits["h"])
        dname = "reverse" if self.direction else "forward"
        hg_grid, hg_note, hg_macros, hg_stack = self._header_h_gemm()
        req = ""
        layer_note = "Layer 0: x_q is the model's input, quantized on the x grid above."
        if self.layer > 0:
            layer_note = (f"Layer {self.layer}: x_q comes from the previous layer's outputs through "
                          f"{pre}_requantize_input.")
            req = f"""
/* The previous layer's integer outputs at one time step, its directions concatenated as in
 * nn.GRU's output ({len(self.prev)} x {self.prev[0].hidden_size} values, [forward | reverse], each on its
 * direction's h grid) -> x_q on this layer's x grid (golden requantize_input). */
void {pre}_requantize_input(const int32_t h_prev[{P}_INPUT_SIZE], int32_t x_q[{P}_INPUT_SIZE]);
"""
        return f"""/* {self.stem_name}.h: generated by qgru.export_c (qgru integer GRU, docs/spec.md).
 *
 * Layer {self.layer}, {dname} direction, config "{cfg.get('name', '?')}", scale_mode "{cfg.get('scale_mode', '?')}".
 * Integer-only C99, bit-exact with qgru.golden (stdint types, int64_t intermediates). Gate order
 * on the 3H channel axis is torch's [r | z | g].
 *
 * Grids (real value = (q - zero point) * scale; the scales are only for code that quantizes its
 * input or dequantizes the output, the step itself is integer-only):
 *   x: {p.bits['x']} bits, scale {float(p.scale['x'])!r}, zero point {int(p.zp['x'])}
 *   h: {p.bits['h']} bits, scale {float(p.scale['h'])!r}, zero point {int(p.zp['h'])}
{hg_grid} * Quantize as q = saturate(round_half_up(real / scale) + zero point) to [MIN, MAX] below.
{hg_note} *
 * Direction: x_q[t] is the t-th step this direction consumes; a reverse direction consumes the
 * sequence reversed (run it on x[T-1], ..., x[0] and its outputs come out reversed too).
 * {layer_note}
 *
 * Self-test: compile {self.stem_name}.c with -D{P}_GOLDEN to get {pre}_selftest() (and with
 * -D{P}_SELFTEST_MAIN as well, a main() that prints the count and fails on a mismatch):
 *   cc -std=c99 -D{P}_GOLDEN -D{P}_SELFTEST_MAIN {self.stem_name}.c -o selftest && ./selftest
 */
#ifndef {P}_H_
#define {P}_H_

#include <stdint.h>

#define {P}_INPUT_SIZE {I}
#define {P}_HIDDEN_SIZE {H}
#define {P}_X_BITS {p.bits['x']}
#define {P}_X_ZERO_POINT {_c(p.zp['x'])}
#define {P}_X_MIN {_c(xlo)}
#define {P}_X_MAX {xhi}
#define {P}_H_BITS {p.bits['h']}
#define {P}_H_ZERO_POINT {_c(p.zp['h'])}
#define {P}_H_MIN {_c(hlo)}
#define {P}_H_MAX {hhi}
{hg_macros}
/* Input GEMM of one time step (golden input_gemm for one row): x_q (each in [X_MIN, X_MAX]) ->
 * dwx = q_Wx - Z_Wx, the 3H requantized values of W x + b_ih relative to their zero points. */
void {pre}_input(const int32_t x_q[{P}_INPUT_SIZE], int32_t dwx[3 * {P}_HIDDEN_SIZE]);

/* One recurrent step (golden gru_step for one batch row): dwx from {pre}_input and the state h_q
 * (each in [H_MIN, H_MAX]) -> the new state h_out. h_out must not alias h_q. */
void {pre}_step(const int32_t dwx[3 * {P}_HIDDEN_SIZE], const int32_t h_q[{P}_HIDDEN_SIZE],
{" " * (len(pre) + 11)}int32_t h_out[{P}_HIDDEN_SIZE]);

/* T steps (golden gru_direction for one batch row): x_q is [T][INPUT_SIZE] row-major; h_q holds
 * h0 on entry and h_T on return; out ([T][HIDDEN_SIZE], may be NULL) receives every step's h.
 * Uses 16 * HIDDEN_SIZE bytes of stack{hg_stack}. */
void {pre}_run(const int32_t *x_q, int32_t T, int32_t *h_q, int32_t *out);
{req}
/* Defined only when the .c is compiled with -D{P}_GOLDEN: runs the embedded golden sequence and
 * returns the number of h values that differ from qgru.golden's (0 = bit-exact). */
int {pre}_selftest(void);

#endif /* {P}_H_ */
"""

    def _header_h_gemm(self) -> Tuple[str, str, str, str]:
        """The header's lines on the R.h operand h_gemm (grid, note, macros, stack): empty without one."""
        p, P = self.p, self.PRE
        if not self.hg:
            return "", "", "", ""
        b = p.bits["h_gemm"]
        grid = (f" *   h_gemm: {b} bits, scale {float(p.scale['h_gemm'])!r}, zero point {int(p.zp['h_gemm'])}"
                " (the R.h operand, below)\n")
        note = f""" *
 * The state (h_q, h_out: int32_t arrays) keeps h's {p.bits['h']} bits from step to step; the GEMM R h
 * reads it requantized onto the narrower h_gemm grid each step (golden recurrent_operand):
 *   h_op = saturate(round_half_up((h_q - H_ZERO_POINT) * M_HG / 2^S_HG) + H_GEMM_ZERO_POINT)
 * to H_GEMM_BITS ({_weight_type(b)} values; M_HG and S_HG are in the .c), so R h multiplies {p.bits['R']}-bit
 * weights by {b}-bit values. Inputs and outputs are on h's grid, as without h_gemm.
"""
        macros = f"#define {P}_H_GEMM_BITS {b}\n#define {P}_H_GEMM_ZERO_POINT {_c(p.zp['h_gemm'])}\n"
        stack = f", and {self.pre}_step {2 if b > 8 else 1} * HIDDEN_SIZE more for the operand"
        return grid, note, macros, stack

    # -- source ----------------------------------------------------------------------------------
    def source(self) -> str:
        p, H = self.p, self.H
        b, zp, rs = p.bits, p.zp, p.rescale
        parts = [f"""/* {self.stem_name}.c: generated by qgru.export_c; see {self.stem_name}.h. Parameters of layer {self.layer},
 * {"reverse" if self.direction else "forward"} direction, then the integer GRU (docs/spec.md section 5). */
#include "{self.stem_name}.h"

/* ---- bit widths (every stored intermediate saturates to its width) ---- */
#define BITS_WX {b['Wx']}
#define BITS_RH {b['Rh']}
#define BITS_R_PRE {b['r_pre']}
#define BITS_Z_PRE {b['z_pre']}
#define BITS_G_PRE {b['g_pre']}
#define BITS_R {b['r']}
#define BITS_Z {b['z']}
#define BITS_G {b['g']}

/* ---- per-tensor zero points, and 1.0 on z's grid relative to its zero point ---- */
#define ZP_R_PRE {_c(zp['r_pre'])}
#define ZP_Z_PRE {_c(zp['z_pre'])}
#define ZP_G_PRE {_c(zp['g_pre'])}
#define ZP_R {_c(zp['r'])}
#define ZP_Z {_c(zp['z'])}
#define ZP_G {_c(zp['g'])}
#define ONE_Z {p.one_z}
"""]
        parts.append("\n/* ---- per-tensor rescales z h -> h and (1 - z) g -> h: multiplier M, shift S ---- */\n")
        for name in ("zh", "zg"):
            m, s = rs[name].multiplier, rs[name].shift
            assert m.numel() == 1, name  # S_z, S_g and S_h are per tensor
            parts.append(f"#define M_{name.upper()} {_lit(m)}\n#define S_{name.upper()} {int(s)}\n")
        if self.hg:
            r = rs["h_gemm"]
            assert r.multiplier.numel() == 1 and int(r.multiplier) < (1 << 31) and 1 <= int(r.shift) <= 62
            parts.append("\n/* ---- per-tensor rescale h -> h_gemm (the R.h operand): multiplier M, shift S ---- */\n"
                         f"#define M_HG {_lit(r.multiplier)}\n#define S_HG {int(r.shift)}\n")
        parts.append("\n/* ---- table geometry: segments of 2^K inputs, F fraction bits (tables.table_geometry) ---- */\n")
        for n in ("r", "z", "g"):
            k, frac = table_geometry(b[f"{n}_pre"])
            parts.append(f"#define K_{n.upper()} {k}\n#define F_{n.upper()} {frac}\n")
        if self.prev:
            parts.append("\n/* ---- previous layer's direction e: its h zero point, rescale onto this x grid ---- */\n")
        for e, prev in enumerate(self.prev):
            r = rs[f"in_{e}"]
            parts.append(f"#define M_IN_{e} {_lit(r.multiplier)}\n#define S_IN_{e} {int(r.shift)}\n"
                         f"#define ZP_HPREV_{e} {_c(prev.zp['h'])}\n")
        parts.append("\n/* ---- weights [3H][I] and [3H][H] (symmetric), biases, Z * rowsum(q_W) ---- */\n")
        parts.append(_array(_weight_type(b["W"]), "W", p.W, f"q_W, {b['W']} bits"))
        parts.append(_array(_weight_type(b["R"]), "R", p.R, f"q_R, {b['R']} bits"))
        parts.append(_array("int32_t", "b_x", p.b_x, "bias of W x at scale S_W[c] S_x"))
        op = "h_gemm" if self.hg else "h"  # R.h's operand: its bias and zero-point term are on its grid
        parts.append(_array("int32_t", "b_h", p.b_h, f"bias of R {op} at scale S_R[c] S_{op}"))
        parts.append(_array("int64_t", "W_zp_comp", p.W_zp_comp, "Z_x * rowsum(q_W)"))
        parts.append(_array("int64_t", "R_zp_comp", p.R_zp_comp, f"Z_{op} * rowsum(q_R)"))
        parts.append("\n/* ---- per-channel zero points and rescales (multiplier m, shift s: v -> round(v m / 2^s)) ---- */\n")
        for name in ("Wx", "Rh"):
            parts.append(_array("int32_t", f"zp_{name}", zp[name].expand(3 * H), f"Z_{name}"))
        for name, n in [("Wx", 3 * H), ("Rh", 3 * H)] + [(g, H) for g in _GATE_RESCALES]:
            r = rs[name]
            assert int(r.multiplier.max()) < (1 << 31) and 1 <= int(r.shift.min()) <= int(r.shift.max()) <= 62
            parts.append(_array("int32_t", f"m_{name}", r.multiplier.expand(n)))
            parts.append(_array("uint8_t", f"s_{name}", r.shift.expand(n)))
        parts.append("\n/* ---- tables: sigmoid (r, z) and tanh (g) of the pre-activation grids ---- */\n")
        for n in ("r", "z", "g"):
            parts.append(_array("int32_t", f"table_{n}", p.tables[n]))
        parts.append(_ARITH)
        parts.append(self._functions())
        parts.append(self._golden())
        return "".join(parts)

    def _recurrent_operand(self) -> Tuple[str, str, str]:
        """(rh's operand parameter, the step's declaration and loop that make it, its name there):
        the state h_q itself, or with h_gemm the state requantized onto h_gemm's grid each step
        (golden recurrent_operand, with the same rounding mul_shift as every other rescale)."""
        P = self.PRE
        if not self.hg:
            return f"const int32_t h_q[{P}_HIDDEN_SIZE]", "", "h_q"
        t = _weight_type(self.p.bits["h_gemm"])  # h_gemm has at most 16 bits (at most h's)
        make = f"""    {t} h_op[{P}_HIDDEN_SIZE];
    /* R h reads the state requantized onto h_gemm's narrower grid (golden recurrent_operand); the
     * state itself keeps its {P}_H_BITS bits */
    for (j = 0; j < H; j++)
        h_op[j] = ({t})sat(mul_shift((int64_t)h_q[j] - {P}_H_ZERO_POINT, M_HG, S_HG) + {P}_H_GEMM_ZERO_POINT,
                           {P}_H_GEMM_BITS);
"""
        return f"const {t} h_op[{P}_HIDDEN_SIZE]", make, "h_op"

    def _functions(self) -> str:
        pre, P = self.pre, self.PRE
        rh_param, make_op, gemm_in = self._recurrent_operand()
        rh_note = (" (h_op: the state on h_gemm's grid)" if self.hg else "")
        out = f"""
void {pre}_input(const int32_t x_q[{P}_INPUT_SIZE], int32_t dwx[3 * {P}_HIDDEN_SIZE])
{{
    int32_t c, k;
    for (c = 0; c < 3 * {P}_HIDDEN_SIZE; c++) {{
        /* acc_x = q_W . q_x - W_zp_comp + b_x, exact in int64 (spec section 6) */
        int64_t acc = (int64_t)b_x[c] - W_zp_comp[c];
        for (k = 0; k < {P}_INPUT_SIZE; k++)
            acc += (int64_t)W[c][k] * x_q[k];
        dwx[c] = (int32_t)(sat(mul_shift(acc, m_Wx[c], s_Wx[c]) + zp_Wx[c], BITS_WX) - zp_Wx[c]);
    }}
}}

/* Rh row c: q_Rh - Z_Rh of R h + b_hh{rh_note} */
static int64_t rh(int32_t c, {rh_param})
{{
    int32_t k;
    int64_t acc = (int64_t)b_h[c] - R_zp_comp[c];
    for (k = 0; k < {P}_HIDDEN_SIZE; k++)
        acc += (int64_t)R[c][k] * {gemm_in}[k];
    return sat(mul_shift(acc, m_Rh[c], s_Rh[c]) + zp_Rh[c], BITS_RH) - zp_Rh[c];
}}

void {pre}_step(const int32_t dwx[3 * {P}_HIDDEN_SIZE], const int32_t h_q[{P}_HIDDEN_SIZE],
{" " * (len(pre) + 11)}int32_t h_out[{P}_HIDDEN_SIZE])
{{
    const int32_t H = {P}_HIDDEN_SIZE;
    int32_t j;
{make_op}    /* Unit j needs only rows j, H + j, 2H + j of Rh: no 3H buffer */
    for (j = 0; j < H; j++) {{
        const int64_t d_rh_r = rh(j, {gemm_in}), d_rh_z = rh(H + j, {gemm_in}), d_rh_g = rh(2 * H + j, {gemm_in});
        const int64_t r_pre = sat(mul_shift(dwx[j], m_Wx_r[j], s_Wx_r[j])
                                  + mul_shift(d_rh_r, m_Rh_r[j], s_Rh_r[j]) + ZP_R_PRE, BITS_R_PRE);
        const int64_t d_r = lookup(r_pre, table_r, BITS_R_PRE, K_R, F_R, ZP_R, BITS_R) - ZP_R;
        const int64_t z_pre = sat(mul_shift(dwx[H + j], m_Wx_z[j], s_Wx_z[j])
                                  + mul_shift(d_rh_z, m_Rh_z[j], s_Rh_z[j]) + ZP_Z_PRE, BITS_Z_PRE);
        const int64_t d_z = lookup(z_pre, table_z, BITS_Z_PRE, K_Z, F_Z, ZP_Z, BITS_Z) - ZP_Z;
        /* g = tanh(Wx_g + r * Rh_g): the product r * Rh_g is rescaled straight into g_pre */
        const int64_t g_pre = sat(mul_shift(dwx[2 * H + j], m_Wx_g[j], s_Wx_g[j])
                                  + mul_shift(d_r * d_rh_g, m_rRh_g[j], s_rRh_g[j]) + ZP_G_PRE, BITS_G_PRE);
        const int64_t d_g = lookup(g_pre, table_g, BITS_G_PRE, K_G, F_G, ZP_G, BITS_G) - ZP_G;
        /* h' = z h + (1 - z) g, with 1 - z on z's own grid: ONE_Z - d_z */
        const int64_t h = mul_shift(d_z * ((int64_t)h_q[j] - {P}_H_ZERO_POINT), M_ZH, S_ZH)
                          + mul_shift((ONE_Z - d_z) * d_g, M_ZG, S_ZG) + {P}_H_ZERO_POINT;
        h_out[j] = (int32_t)sat(h, {P}_H_BITS);
    }}
}}

void {pre}_run(const int32_t *x_q, int32_t T, int32_t *h_q, int32_t *out)
{{
    int32_t dwx[3 * {P}_HIDDEN_SIZE], h_new[{P}_HIDDEN_SIZE];
    int32_t t, j;
    for (t = 0; t < T; t++) {{
        {pre}_input(x_q + t * (int32_t){P}_INPUT_SIZE, dwx);
        {pre}_step(dwx, h_q, h_new);
        for (j = 0; j < {P}_HIDDEN_SIZE; j++) {{
            h_q[j] = h_new[j];
            if (out)
                out[t * (int32_t){P}_HIDDEN_SIZE + j] = h_new[j];
        }}
    }}
}}
"""
        if self.prev:
            hp = self.prev[0].hidden_size
            body = "".join(
                f"    for (k = 0; k < {hp}; k++)\n"
                f"        x_q[{e * hp} + k] = (int32_t)sat(mul_shift((int64_t)h_prev[{e * hp} + k] - ZP_HPREV_{e}, "
                f"M_IN_{e}, S_IN_{e})\n"
                f"                                  + {P}_X_ZERO_POINT, {P}_X_BITS);\n"
                for e in range(len(self.prev)))
            out += f"""
void {pre}_requantize_input(const int32_t h_prev[{P}_INPUT_SIZE], int32_t x_q[{P}_INPUT_SIZE])
{{
    int32_t k;
{body}}}
"""
        return out

    def _golden(self) -> str:
        pre, P = self.pre, self.PRE
        qx, qh0, qout = self.golden
        return f"""
#ifdef {P}_GOLDEN
/* ---- golden vectors: qgru.golden on these integers (x includes values saturated at both ends) ---- */
#define GOLDEN_T {qx.shape[0]}
{_array("int32_t", "golden_x", qx)}{_array("int32_t", "golden_h0", qh0)}{_array("int32_t", "golden_out", qout)}
int {pre}_selftest(void)
{{
    int32_t h[{P}_HIDDEN_SIZE];
    int32_t t, j;
    int mismatches = 0;
    for (j = 0; j < {P}_HIDDEN_SIZE; j++)
        h[j] = golden_h0[j];
    for (t = 0; t < GOLDEN_T; t++) {{
        {pre}_run(golden_x[t], 1, h, 0);
        for (j = 0; j < {P}_HIDDEN_SIZE; j++)
            mismatches += h[j] != golden_out[t][j];
    }}
    return mismatches;
}}

#ifdef {P}_SELFTEST_MAIN
#include <stdio.h>
int main(void)
{{
    const int n = {pre}_selftest();
    printf("{pre}_selftest: %d mismatches\\n", n);
    return n != 0;
}}
#endif /* {P}_SELFTEST_MAIN */
#endif /* {P}_GOLDEN */
"""


# The arithmetic primitives, written once (qgru/primitives.py and qgru/tables.py).
_ARITH = r"""
/* ---- integer primitives (qgru/primitives.py, qgru/tables.py) ---- */

/* floor(v / 2^s) for 0 <= s <= 62, i.e. an arithmetic right shift. C99 leaves >> of a negative
 * value implementation-defined, so a negative v is shifted through its complement (~v >= 0;
 * int64_t is two's complement by definition); compilers turn this back into one shift. */
static int64_t shr(int64_t v, int s)
{
    return v < 0 ? ~(~v >> s) : v >> s;
}

/* rounding_mul_shift: round_half_up(v * m / 2^s), 1 <= s <= 62. By construction |v * m| < 2^62
 * (spec section 3), so adding 2^(s-1) cannot overflow. */
static int64_t mul_shift(int64_t v, int64_t m, int s)
{
    return shr(v * m + ((int64_t)1 << (s - 1)), s);
}

/* saturate to a signed bits-wide range */
static int64_t sat(int64_t v, int bits)
{
    const int64_t hi = ((int64_t)1 << (bits - 1)) - 1, lo = -hi - 1;
    return v < lo ? lo : v > hi ? hi : v;
}

/* tables.lookup: segment i = u >> k and position f of u = q - qmin (u >= 0), linear interpolation
 * T[i] 2^k + (T[i+1] - T[i]) f (multiplied, not shifted: T[i] may be negative), then a rounding
 * shift by k + frac (none when 0), the output zero point and saturation. */
static int64_t lookup(int64_t q, const int32_t *table, int in_bits, int k, int frac, int64_t out_zp,
                      int out_bits)
{
    const int64_t u = q + ((int64_t)1 << (in_bits - 1));
    const int64_t i = u >> k, f = u & (((int64_t)1 << k) - 1);
    const int64_t lo = table[i];
    const int64_t v = lo * ((int64_t)1 << k) + (table[i + 1] - lo) * f;
    const int s = k + frac;
    return sat((s ? shr(v + ((int64_t)1 << (s - 1)), s) : v) + out_zp, out_bits);
}
"""


def main(argv: Optional[List[str]] = None) -> int:
    """The command line: 0 on success; a file that cannot be used, or bad arguments, print one
    line ``python -m qgru.export_c: error: ...`` to stderr and return 1 (no traceback)."""
    ap = argparse.ArgumentParser(prog="python -m qgru.export_c", description=__doc__.split("\n")[0])
    ap.add_argument("params", help="a file written by QuantParams.save()")
    ap.add_argument("stem", help="output stem: writes STEM.h and STEM.c")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--direction", type=int, default=0, help="0 = forward, 1 = reverse")
    ap.add_argument("--prefix", default=None, help="C identifier prefix (default: from the stem's name)")
    ap.add_argument("--golden-steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    return run_writer(ap.prog, lambda: write_c(load_params(a.params), a.stem, layer=a.layer, direction=a.direction,
                                               golden_steps=a.golden_steps, seed=a.seed, prefix=a.prefix))


def run_writer(prog: str, write) -> int:
    """A C exporter's command line: print the paths ``write()`` returns (exit 0), or the error of a
    bad file or argument (exit 1)."""
    try:
        paths = write()
    except (OSError, ValueError, pickle.UnpicklingError) as e:  # ParamsFileError is a ValueError
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(*paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
