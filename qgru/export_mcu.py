"""Export a whole converted QuantGRU as data for the C runtime in csrc/c/ (microcontrollers, ARM boards).

``write_mcu(params, "out/gru")`` writes ``out/gru.h`` and ``out/gru.c``: every layer and direction
(stacked, bidirectional) as one ``const qgru_rt_model <prefix>_model`` for csrc/c/qgru_rt.h, the
integers in the widths they need (int8 weights, rows padded to 4 for the SIMD loops; int16 tables
where the entries fit, else int32; 32-bit multipliers, 8-bit shifts; biases with the zero-point
term folded in, int32 where they fit), and golden vectors (qgru.golden on an integer sequence) with
``int <prefix>_selftest(void *work, size_t bytes)`` (0: bit-exact; it passes the runtime exactly
qgru_rt_work_bytes and checks 16 guard bytes after them), compiled only with ``-D<PREFIX>_GOLDEN``.

At export each GEMM is checked against the int32 bound the kernels need (docs/mcu.md): every
partial sum of |q_W| |q_x| fits int32. Where it does not (or the weights have more than 8 bits)
that layer's GEMM takes the runtime's int64 loop (``wide``), the same integers, slower.

The runtime takes integer x on layer 0's static grid (``qgru_rt_run``; ``qgru_rt_quantize_input``
quantizes floats onto it) or float x (``qgru_rt_run_float``), which takes each token's x level where
layer 0 has levels (config ``x.dynamic``, docs/spec.md section 4b): their grids, biases and W.x
rescales are exported with the model unless ``x_levels=False`` (``--no-x-levels``: less flash, every
float token on the static grid, as ``qgru_rt_run`` takes integers).

CLI: ``python -m qgru.export_mcu params.qgru out/gru [--prefix NAME] [--golden-steps 8]``;
``python -m qgru.export_mcu --runtime-dir`` prints the runtime's folder (``runtime_dir()``).
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

from .export import QuantParams, load_params
from .export_c import _IDENT, _lit, run_writer
from .golden import LayerParams, gru_direction, quantize_levels, requantize_input
from .primitives import dequantize, qrange, quantize, saturate
from .tables import table_geometry

ABI = 6  # csrc/c/qgru_rt.h QGRU_RT_ABI
INT32_MAX = (1 << 31) - 1
_SHARED_ONCE = True  # the fast cell's shared constants once a direction where uniform (tests: False stores them per unit)
LAYOUTS = ("interleaved", "rows", "pairs", "offset")  # csrc/c/qgru_rt.h QGRU_RT_LAYOUT_*; rows: Helium, pairs: Cortex-M DSP, offset: Cortex-M0
_GATE_RESCALES = ("Wx_r", "Rh_r", "Wx_z", "Rh_z", "Wx_g", "rRh_g")
_LEVEL_SMMLAR = True  # tests set False: a fast direction's x levels then take the 64-bit rescale


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def golden_model(params: QuantParams, qx: torch.Tensor, qh0: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """qgru.golden on the whole stack: integer qx [T, I] on layer 0's static grid, qh0 [L*D, H] ->
    (out [T, D*H] of the last layer, on each direction's h grid; h_n [L*D, H])."""
    layers = params.layers
    D = len(layers[0])
    inp: List[torch.Tensor] = [qx]
    h_n = []
    for li, row in enumerate(layers):
        outs = []
        for d, p in enumerate(row):
            p = dataclasses.replace(p, x_levels=None)
            if li == 0:
                x = qx
            else:
                x = torch.cat([requantize_input(q, layers[li - 1][e].zp["h"], p.rescale[f"in_{e}"], p.zp["x"],
                                                p.bits["x"]) for e, q in enumerate(inp)], dim=-1)
            if d == 1:
                x = x.flip(0)
            o, h = gru_direction(p, x.unsqueeze(1), qh0[li * D + d].unsqueeze(0))
            o = o.squeeze(1)
            outs.append(o.flip(0) if d == 1 else o)
            h_n.append(h.squeeze(0))
        inp = outs
    return torch.cat(inp, dim=-1), torch.stack(h_n)


def golden_model_float(params: QuantParams, x: torch.Tensor, qh0: torch.Tensor, x_levels: bool = True
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """qgru.golden on the whole stack from float x [T, I] (no NaN): layer 0 quantizes each token on
    its x level (golden.quantize_levels) where it has levels and ``x_levels``, else on the static
    grid, then golden_model's stack. qh0 [L*D, H]. -> (out [T, D*H], h_n [L*D, H])."""
    layers = params.layers
    D = len(layers[0])
    inp: List[torch.Tensor] = []
    h_n = []
    for li, row in enumerate(layers):
        outs = []
        for d, p in enumerate(row):
            level = None
            if li == 0:
                if p.x_levels is not None and x_levels:
                    qx, level = quantize_levels(p.x_levels, x, p.zp["x"], p.bits["x"])
                else:
                    qx = quantize(x, p.scale["x"], p.zp["x"], p.bits["x"])
                    p = dataclasses.replace(p, x_levels=None)
            else:
                qx = torch.cat([requantize_input(q, layers[li - 1][e].zp["h"], p.rescale[f"in_{e}"], p.zp["x"],
                                                 p.bits["x"]) for e, q in enumerate(inp)], dim=-1)
            if d == 1:
                qx = qx.flip(0)
                level = level.flip(0) if level is not None else None
            o, h = gru_direction(p, qx.unsqueeze(1), qh0[li * D + d].unsqueeze(0),
                                 level=level.unsqueeze(1) if level is not None else None)
            o = o.squeeze(1)
            outs.append(o.flip(0) if d == 1 else o)
            h_n.append(h.squeeze(0))
        inp = outs
    return torch.cat(inp, dim=-1), torch.stack(h_n)


def golden_float_inputs(params: QuantParams, qx: torch.Tensor) -> torch.Tensor:
    """float x [T, I] for the float self-test: qx's values on the static grid, token t scaled by
    1, 1.3, 2.2, 3.7, 6, 9, 0.6, 1.8, ... (tokens beyond calibration, each level's range and the
    last level's clipping), one value +inf and one -inf in token 2 when T > 2"""
    p0 = params.layers[0][0]
    x = dequantize(qx, p0.scale["x"], p0.zp["x"]).double()
    f = torch.tensor([1.0, 1.3, 2.2, 3.7, 6.0, 9.0, 0.6, 1.8], dtype=torch.float64, device=qx.device)
    x = (x * f[torch.arange(qx.shape[0], device=qx.device) % 8].unsqueeze(1)).float()
    if qx.shape[0] > 2 and qx.shape[1] > 1:
        x[2, 0], x[2, 1] = float("inf"), float("-inf")
    return x


def golden_inputs(params: QuantParams, steps: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(qx [T, I], qh0 [L*D, H]): x around its zero point with a quarter of its range as spread
    (a few percent saturate), step 0 at both extremes alternately; h0 uniform over h's range."""
    cpu = torch.device("cpu")
    g = torch.Generator(device=cpu).manual_seed(seed)
    p0 = params.layers[0][0]
    lo, hi = qrange(p0.bits["x"])
    d = torch.randn(steps, p0.input_size, generator=g, dtype=torch.float64, device=cpu) * ((hi - lo) / 4)
    qx = saturate(d.round().to(torch.int64) + p0.zp["x"], p0.bits["x"])
    if steps:
        qx[0, 0::2], qx[0, 1::2] = lo, hi
    h0 = [torch.randint(*_incl(qrange(p.bits["h"])), (p.hidden_size,), generator=g, dtype=torch.int64, device=cpu)
          for row in params.layers for p in row]
    return qx, torch.stack(h0)


def _incl(r):
    return r[0], r[1] + 1


def write_mcu(params: QuantParams, path: Union[str, Path], prefix: Optional[str] = None,
              golden_steps: int = 8, seed: int = 0, layout: str = "interleaved",
              x_levels: bool = True) -> Tuple[Path, Path]:
    """Write ``<stem>.h`` and ``<stem>.c`` (the whole model for csrc/c/); returns their paths.

    ``layout``: the weight order of the target's kernel: "interleaved" (plain C, NEON), "pairs"
    (Cortex-M DSP, SMLAD), "rows" (Helium MVE) or "offset" (Cortex-M0: interleaved, bytes + 128); the runtime refuses data of another (QGRU_RT_ELAYOUT).
    ``x_levels``: export layer 0's x levels where it has them (qgru_rt_run_float takes each token's
    level); False: leave them out (less flash; float tokens on the static grid, beyond it saturated)."""
    if not isinstance(x_levels, bool):
        raise TypeError(f"write_mcu: x_levels must be a bool, got {type(x_levels).__name__} {x_levels!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"write_mcu: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    for name, v in (("golden_steps", golden_steps), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"write_mcu: {name} must be an int, got {type(v).__name__} {v!r}")
    if golden_steps < 1:
        raise ValueError(f"golden_steps must be >= 1, got {golden_steps}")
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"write_mcu: prefix must be a str (a C identifier) or None, got {type(prefix).__name__}")
    stem = Path(path)
    if stem.suffix in (".h", ".c"):
        stem = stem.with_suffix("")
    bad = sorted({c for c in stem.name if not c.isprintable() or c in '"\\'})
    if bad:
        raise ValueError(f"write_mcu: the file name {stem.name!r} cannot be written into C: it holds "
                         f"{', '.join(map(repr, bad))}")
    if prefix is None:
        prefix = re.sub(r"\W", "_", stem.name, flags=re.ASCII) or "gru"
        if prefix[0].isdigit():
            prefix = "qgru_" + prefix
    if not _IDENT.match(prefix):
        raise ValueError(f"prefix {prefix!r} is not a C identifier")
    params.validate()
    qx, qh0 = golden_inputs(params, golden_steps, seed)
    out, h_n = golden_model(params, qx, qh0)
    xf = golden_float_inputs(params, qx)
    fout, fh_n = golden_model_float(params, xf, qh0, x_levels)
    text_c, text_h = _Writer(params, prefix, stem.name, (qx, qh0, out, h_n, xf, fout, fh_n), layout,
                             x_levels).files()
    stem.parent.mkdir(parents=True, exist_ok=True)
    h_path, c_path = stem.with_name(stem.name + ".h"), stem.with_name(stem.name + ".c")
    h_path.write_text(text_h)
    c_path.write_text(text_c)
    return h_path, c_path


def _fits(t: torch.Tensor, bits: int) -> bool:
    lo, hi = qrange(bits)
    return t.numel() == 0 or (int(t.min()) >= lo and int(t.max()) <= hi)


def _dlit(v: float) -> str:
    """a float64 as an exact C literal (hexadecimal; +-inf as HUGE_VAL from math.h)"""
    v = float(v)
    if v != v:
        raise ValueError("write_mcu: a NaN cannot be a grid bound")
    return "HUGE_VAL" if v == float("inf") else "-HUGE_VAL" if v == float("-inf") else v.hex()


def _f32(v: float, direction: int = 0) -> float:
    """v as a float32: rounded to nearest (direction 0), else the nearest float32 >= v (1) or <= v (-1)"""
    import numpy as np
    f = np.float32(v)
    if direction and (float(f) < v if direction > 0 else float(f) > v):
        f = np.nextafter(f, np.float32(np.inf if direction > 0 else -np.inf))
    return float(f)


def _flit(v: float) -> str:
    """a float32 value as an exact C float literal (+-inf as INFINITY)"""
    v = float(v)
    return "INFINITY" if v == float("inf") else "-INFINITY" if v == float("-inf") else v.hex() + "f"


def _fits_ints(vals, bits: int) -> bool:
    lo, hi = qrange(bits)
    return all(lo <= int(v) <= hi for v in vals)


class _Writer:
    def __init__(self, params: QuantParams, prefix: str, stem_name: str, golden, layout: str, x_levels: bool):
        self.layout, self.x_levels = layout, x_levels
        self.params, self.pre, self.P, self.stem_name, self.golden = params, prefix, prefix.upper(), stem_name, golden
        self.parts: List[str] = []
        self.sizes: Dict[str, int] = {}  # bytes of flash by kind (reported in the header)
        self.notes: List[str] = []
        self.cell_notes: List[str] = []

    def _arr(self, ctype: str, name: str, values, kind: str, per_line: int = 16, align: bool = False) -> str:
        vals = [_lit(v) for v in values]
        width = {"int8_t": 1, "uint8_t": 1, "int16_t": 2, "int32_t": 4, "int64_t": 8}[ctype]
        self.sizes[kind] = self.sizes.get(kind, 0) + width * len(vals)
        lines = [", ".join(vals[i:i + per_line]) for i in range(0, len(vals), per_line)]
        al = " QGRU_RT_ALIGN16" if align else ""
        self.parts.append(f"static const {ctype} {name}[{len(vals)}]{al} = {{\n    " + ",\n    ".join(lines) + "\n};\n")
        return name

    def _weights(self, name: str, q: torch.Tensor, bits: int, H: int, wide: int) -> Tuple[str, str, int]:
        """rows of each gate padded to a multiple of 4 (zero rows), each row to k_pad, in the kernel's
        layout (interleaved: each block of 4 rows as groups of 4 columns; pairs: the same groups, each
        word two rows' two columns, the even row's bytes + 128; offset: interleaved, every byte + 128;
        a wide GEMM's pairs or offset data is interleaved, the int64 loop's order), 64 zero bytes after"""
        K = q.shape[1]
        kp, G = _pad4(K), _pad4(H)
        w = torch.zeros(3, G, kp, dtype=torch.int64, device=q.device)
        w[:, :H, :K] = q.reshape(3, H, K)
        if self.layout == "pairs" and not wide:
            # row 4 blk + 2 p + r, column 4 grp + 2 h + c -> [gate][blk][grp][h][p][c][r], r = 0 + 128
            w = w.reshape(3, G // 4, 2, 2, kp // 4, 2, 2).permute(0, 1, 4, 5, 2, 6, 3).clone()
            w[..., 0] += 128
            w = torch.where(w > 127, w - 256, w)
        elif self.layout in ("interleaved", "pairs", "offset"):  # [gate][block][row 4][group][col 4] -> [gate][block][group][row][col]
            w = w.reshape(3, G // 4, 4, kp // 4, 4).permute(0, 1, 3, 2, 4)
            if self.layout == "offset" and not wide:  # bytes W + 128 (LDRB), as int8 values
                w = w + 128
                w = torch.where(w > 127, w - 256, w)
        flat = w.reshape(-1).tolist() + [0] * 64
        if bits <= 8:
            return self._arr("int8_t", name, flat, "weights", 32, align=True), "0", kp
        return "0", self._arr("int16_t", name, flat, "weights", 16, align=True), kp

    def _dir(self, li: int, d: int, p: LayerParams) -> str:
        b, zp, rs = p.bits, p.zp, p.rescale
        I, H = p.input_size, p.hidden_size
        n = f"{self.pre}_l{li}{'r' if d else 'f'}"
        op = "h_gemm" if "h_gemm" in b else "h"
        where = f"layer {li} {'reverse' if d else 'forward'}"
        for t in ("x", "h", op):
            if b[t] > 16:
                raise ValueError(f"write_mcu: {where}: {t} has {b[t]} bits; the runtime holds x and h in int16_t "
                                 "(at most 16 bits)")
        for t in ("W", "R"):
            if b[t] > 16:
                raise ValueError(f"write_mcu: {where}: {t} has {b[t]} bits (at most 16)")
        for t in ("Wx", "Rh", "r_pre", "z_pre", "g_pre", "r", "z", "g"):
            if b[t] > 30:
                raise ValueError(f"write_mcu: {where}: {t} has {b[t]} bits; the runtime's int32 intermediates "
                                 "take at most 30")
        # the int32 bound of the kernels: every partial sum of |q_W| |q_x| below 2^31
        wide = {}
        for t, q, a in (("x", p.W, "x"), ("h", p.R, op)):
            lo, hi = qrange(b[a])
            bound = int(q.abs().sum(1).max()) * max(-lo, hi) if q.numel() else 0
            wide[t] = int(b["W" if t == "x" else "R"] > 8 or bound > INT32_MAX)
            if wide[t]:
                wb = b["W" if t == "x" else "R"]
                why = f"{wb}-bit weights" if wb > 8 else f"bound {bound} >= 2^31"
                self.notes.append(f"{where}: {'W x' if t == 'x' else 'R h'} takes the int64 loop ({why})")
        cell32 = self._cell32(p, li, op, wide)
        if not cell32:
            self.notes.append(f"{where}: the cell takes the 64-bit path (a 32-bit bound fails, docs/mcu.md)")
        self.parts.append(f"\n/* ---- {where}: {I} -> {H} ---- */\n")
        w8, w16, kpx = self._weights(f"{n}_W", p.W, b["W"], H, wide["x"])
        r8, r16, kph = self._weights(f"{n}_R", p.R, b["R"], H, wide["h"])
        n_parts, sizes = len(self.parts), dict(self.sizes)
        why = self._fast(n, p, op) if cell32 else "the 32-bit cell's bounds fail"
        fast = why is None
        if not fast:  # nothing of it stays in the file
            del self.parts[n_parts:]
            self.sizes = sizes
            self.cell_notes.append(f"{where}: unit32 / unit, not the fast cell ({why})")
        fields = [f".input_size = {I}", f".hidden_size = {H}", f".rows_per_gate = {_pad4(H)}",
                  f".k_pad_x = {kpx}", f".k_pad_h = {kph}", f".x_bits = {b['x']}", f".op_bits = {b[op]}",
                  f".wide_x = {wide['x']}", f".wide_h = {wide['h']}",
                  f".layout = QGRU_RT_LAYOUT_{self.layout.upper()}", f".cell32 = {int(cell32)}",
                  f".w8 = {w8}", f".w16 = {w16}", f".r8 = {r8}", f".r16 = {r16}"]
        if fast:  # the fast cell reads its own data only: no per-channel arrays, tables
            fields.append(f".fast = &{n}_fast")
        else:
            for t, bias, comp in (("x", p.b_x, p.W_zp_comp), ("h", p.b_h, p.R_zp_comp)):
                v = bias - comp
                if _fits(v, 32):
                    fields += [f".bias_{t} = {self._arr('int32_t', f'{n}_bias_{t}', v.tolist(), 'biases')}",
                               f".bias_{t}64 = 0"]
                else:
                    fields += [f".bias_{t} = 0", f".bias_{t}64 = {self._arr('int64_t', f'{n}_bias_{t}64', v.tolist(), 'biases')}"]
            for t in ("Wx", "Rh"):
                fields.append(f".zp_{t.lower()} = {self._arr('int32_t', f'{n}_zp_{t}', zp[t].expand(3 * H).tolist(), 'rescales')}")
            for t in ("Wx", "Rh"):
                r = rs[t]
                fields.append(f".m_{t.lower()} = {self._arr('int32_t', f'{n}_m_{t}', r.multiplier.expand(3 * H).tolist(), 'rescales')}")
                fields.append(f".s_{t.lower()} = {self._arr('uint8_t', f'{n}_s_{t}', r.shift.expand(3 * H).tolist(), 'rescales')}")
            ms, ss = [], []
            for t in _GATE_RESCALES:
                r = rs[t]
                ms.append(self._arr("int32_t", f"{n}_m_{t}", r.multiplier.expand(H).tolist(), "rescales"))
                ss.append(self._arr("uint8_t", f"{n}_s_{t}", r.shift.expand(H).tolist(), "rescales"))
            fields += [".m_gate = {" + ", ".join(ms) + "}", ".s_gate = {" + ", ".join(ss) + "}"]

        def rng(t):
            lo, hi = qrange(b[t])
            return "{" + f"{_lit(lo)}, {_lit(hi)}" + "}"
        fields += [f".r_x = {rng('x')}", f".r_h = {rng('h')}", f".r_op = {rng(op)}", f".r_wx = {rng('Wx')}",
                   f".r_rh = {rng('Rh')}", f".r_rpre = {rng('r_pre')}", f".r_zpre = {rng('z_pre')}",
                   f".r_gpre = {rng('g_pre')}"]
        for f, t in (("x", "x"), ("h", "h"), ("op", op), ("rpre", "r_pre"), ("zpre", "z_pre"), ("gpre", "g_pre"),
                     ("r", "r"), ("z", "z"), ("g", "g")):
            fields.append(f".zp_{f} = {_lit(zp[t])}")
        fields.append(f".one_z = {int(p.one_z)}")
        for f, t in (("zh", "zh"), ("zg", "zg")) + ((("hg", "h_gemm"),) if op == "h_gemm" else ()):
            r = rs[t]
            m, s = int(r.multiplier), int(r.shift)
            if not (0 <= m <= INT32_MAX and 1 <= s <= 62):
                raise ValueError(f"write_mcu: {where}: rescale {t} ({m}, {s}) outside int32 / [1, 62]")
            fields += [f".m_{f} = {_lit(m)}", f".s_{f} = {s}"]
        fields.append(f".has_h_gemm = {int(op == 'h_gemm')}")
        for g in ("r", "z", "g"):
            fields.append(f".t_{g} = {self._table(n, g, p, where) if not fast else '{0}'}")
        if li > 0:
            prev = self.params.layers[li - 1]
            fields.append(".m_in = {" + ", ".join(_lit(rs[f"in_{e}"].multiplier) for e in range(len(prev))) + "}")
            fields.append(".s_in = {" + ", ".join(str(int(rs[f"in_{e}"].shift)) for e in range(len(prev))) + "}")
            fields.append(".zp_hprev = {" + ", ".join(_lit(q.zp["h"]) for q in prev) + "}")
        fields += [f".x_scale = {float(p.scale['x'])!r}", f".h_scale = {float(p.scale['h'])!r}",
                   f".x_rscale = {_flit(_f32(1.0 / float(p.scale['x'])))}"]
        if li == 0 and p.x_levels is not None and self.x_levels:
            fields.append(f".xlv = &{self._xlevels(n, p, fast, cell32, wide['x'], where)}")
        for t in [k for k in rs if k.startswith("in_")] + ["Wx", "Rh", *_GATE_RESCALES]:
            r = rs[t]
            if int(r.multiplier.max()) > INT32_MAX or int(r.multiplier.min()) < 0 or not (
                    1 <= int(r.shift.min()) <= int(r.shift.max()) <= 62):
                raise ValueError(f"write_mcu: {where}: rescale {t} outside int32 multipliers / shifts [1, 62]")
        return "    {\n        " + ",\n        ".join(fields) + "\n    }"

    def _fast(self, n: str, p: LayerParams, op: str) -> Optional[str]:
        """The fast cell's data (csrc/c/qgru_rt.h qgru_rt_fast, qgru_rt.c fast_unit), written into
        the parts; None when written, else why not (the runtime then takes unit32). Every bound the
        fast cell relies on is checked here on this layer's own integers and ranges."""
        b, zp, rs = p.bits, p.zp, p.rescale
        H, G = p.hidden_size, _pad4(p.hidden_size)

        def rng(t):
            return qrange(b[t])

        def dmax(t, z):  # the largest |q - z| of tensor t's range, z an int or a list
            lo, hi = rng(t)
            zs = z if isinstance(z, list) else [z]
            return max(max(abs(lo - v), abs(hi - v)) for v in zs)

        # the accumulators' rescales: s <= 32, a common operand shift a (|acc| 2^a < 2^31), m 2^b, a + b + s = 32
        acc, acc_a = {}, []
        for t, q, src, bias, comp in (("Wx", p.W, "x", p.b_x, p.W_zp_comp), ("Rh", p.R, op, p.b_h, p.R_zp_comp)):
            ms, ss = rs[t].multiplier.expand(3 * H).tolist(), rs[t].shift.expand(3 * H).tolist()
            lo, hi = rng(src)
            vb = int((q.abs().sum(1) * max(-lo, hi) + (bias - comp).abs()).max())
            a = max([0] + [32 - s_ - (31 - m.bit_length()) for m, s_ in zip(ms, ss)])
            if (vb << a) > INT32_MAX or any(32 - s_ - a < 0 for s_ in ss):
                return f"{t} does not fit one SMMLAR (shift {max(ss)}, accumulator {vb} << {a})"
            M = [m << (32 - s_ - a) for m, s_ in zip(ms, ss)]
            zps = [int(v) for v in zp[t].expand(3 * H).tolist()]
            acc[t] = (M, zps)
            acc_a.append(a)
        # the gate rescales: a common operand shift a, per channel m 2^b, a + b + s = 32
        gsrc = (("Wx_r", "Wx", 0), ("Rh_r", "Rh", 0), ("Wx_z", "Wx", 1), ("Rh_z", "Rh", 1), ("Wx_g", "Wx", 2))
        mg, ag, gb = [], [], []
        for t, src, gate in gsrc:
            ms, ss = rs[t].multiplier.expand(H).tolist(), rs[t].shift.expand(H).tolist()
            vmax = dmax(src, acc[src][1][gate * H:(gate + 1) * H])
            a = max([0] + [32 - s_ - (31 - m.bit_length()) for m, s_ in zip(ms, ss)])
            if (vmax << a) > INT32_MAX or any(32 - s_ - a < 0 for s_ in ss):
                return f"{t} does not fit one SMMLAR (shift {max(ss)}, operand {vmax} << {a})"
            M = [m << (32 - s_ - a) for m, s_ in zip(ms, ss)]
            mg.append(M)
            ag.append(a)
            gb.append((vmax << a) * max(M) // (1 << 32) + 1)  # |the rescaled value| bound
        in_lo = {g: rng(f"{g}_pre")[0] for g in "rzg"}
        span = {g: rng(f"{g}_pre")[1] - in_lo[g] for g in "rzg"}
        k_r, k_z = int(zp["r_pre"]) - in_lo["r"], int(zp["z_pre"]) - in_lo["z"]
        if abs(k_r) + gb[0] + gb[1] > INT32_MAX or abs(k_z) + gb[2] + gb[3] > INT32_MAX:
            return "a gate sum exceeds int32"

        def post(t, m, s_, amax, bmax, konst):  # a 64-bit product rescale: (hi + c) >> p, p = s - 32
            if s_ < 33:
                return None
            pp = s_ - 32
            c = (1 << (pp - 1)) + (konst << pp)
            if amax * bmax * m >= 1 << 63 or amax * bmax * m // (1 << 32) + 1 + abs(c) > INT32_MAX:
                return None
            return pp, c, (amax * bmax * m // (1 << 32) + 1 + abs(c)) // (1 << pp) + 1
        # r Rh_g: a common shift (multipliers scaled up to the largest)
        ms, ss = rs["rRh_g"].multiplier.expand(H).tolist(), rs["rRh_g"].shift.expand(H).tolist()
        S = max(ss)
        m_rg = [m << (S - s_) for m, s_ in zip(ms, ss)]
        if max(m_rg) > INT32_MAX:
            return "rRh_g multipliers do not share a shift"
        rmax, zmax, gmax = dmax("r", int(zp["r"])), dmax("z", int(zp["z"])), dmax("g", int(zp["g"]))
        rg = post("rRh_g", max(m_rg), S, rmax, dmax("Rh", acc["Rh"][1][2 * H:]), int(zp["g_pre"]) - in_lo["g"])
        if rg is None or rg[2] + gb[4] > INT32_MAX:
            return "r Rh_g is not a 64-bit product with shift >= 33 in bounds"
        one_z = int(p.one_z)
        zh = post("zh", int(rs["zh"].multiplier), int(rs["zh"].shift), zmax, dmax("h", int(zp["h"])), int(zp["h"]))
        zg = post("zg", int(rs["zg"].multiplier), int(rs["zg"].shift), abs(one_z) + zmax, gmax, 0)
        if zh is None or zg is None or zh[2] + zg[2] > INT32_MAX:
            return "z h or (1 - z) g is not a 64-bit product with shift >= 33 in bounds"
        # the tables: T 2^k + 2^(s-1), the last entry repeated (the lookup reads tab[i + 1] and takes
        # T[i+1] - T[i] as (tab[i+1] - tab[i]) >> k); the output never saturates
        tabs = []
        for g in "rzg":
            t = [int(v) for v in p.tables[g].tolist()]
            k, frac = table_geometry(b[f"{g}_pre"])
            sh = k + frac
            imax = span[g] >> k
            if len(t) < imax + (2 if k else 1):
                return f"table {g} is shorter than its input range"
            tp = [v * (1 << k) + ((1 << (sh - 1)) if sh else 0) for v in t]
            dif = [t[i + 1] - t[i] for i in range(len(t) - 1)] + [0]
            if max(abs(v) for v in tp) + max(abs(v) for v in dif) * ((1 << k) - 1) > INT32_MAX \
                    or max(abs(v) for v in dif) * (1 << k) > INT32_MAX:
                return f"table {g} does not interpolate in int32"
            lo, hi = rng(g)
            z = int(zp[g])
            for i in range(imax + 1):
                for f in ((0, (1 << k) - 1) if k else (0,)):
                    if i == imax and f > (span[g] & ((1 << k) - 1)):
                        continue
                    v = ((tp[i] + dif[i] * f) >> sh) + z
                    if not lo <= v <= hi:
                        return f"table {g} saturates its output"
            name = self._arr("int32_t", f"{n}_ftab_{g}", tp + tp[-1:], "tables")
            tabs.append(f"{{{name}, {(1 << k) - 1}, {k}, {sh}}}")
        # the kernels' accumulator starts: the biases (b - Z rowsum), pairs: b[2i] + 256 b[2i+1]
        inits = []
        for t, bias, comp in (("x", p.b_x, p.W_zp_comp), ("h", p.b_h, p.R_zp_comp)):
            v = (bias - comp).tolist()
            if not _fits_ints(v, 32):
                return f"bias_{t} does not fit int32"
            inits.append(self._arr("int32_t", f"{n}_init_{t}", self._init_rows(v, H), "biases"))
        std16 = all(b[t] == 16 for t in ("Wx", "Rh", "h", "r_pre", "z_pre", "g_pre")) and all(
            table_geometry(b[f"{g}_pre"]) == (6, 4) for g in "rzg")
        hg = ["0", "0", "0", "0"]  # m, c, p, mode: h -> h_gemm as one high word where s >= 33
        if op == "h_gemm":
            m, s_ = int(rs["h_gemm"].multiplier), int(rs["h_gemm"].shift)
            if s_ >= 33:
                pp = s_ - 32
                c = (1 << (pp - 1)) + (int(zp["h_gemm"]) << pp)
                if dmax("h", int(zp["h"])) * m // (1 << 32) + 1 + abs(c) <= INT32_MAX:
                    hg = [_lit(m), _lit(c), str(pp), "1"]
        # the per-unit constants (qgru_rt.h QGRU_RT_UNIT_FIELDS, 6 a unit: the accumulators' rescales) and
        # the shared ones (QGRU_RT_SHARED_FIELDS, 12: zero points, gate rescales), these stored once where
        # every unit's are equal (per-tensor and per-gate grids); unit by unit for the pairs layout (the
        # M4's scalar cell), else blocks of four units lane by lane (vector loads; a shared block's lanes equal)
        def ufields(j):
            return [acc[t][0][g * H + j] for g in range(3) for t in ("Wx", "Rh")]

        def sfields(j):
            return [acc[t][1][g * H + j] for g in range(3) for t in ("Wx", "Rh")] + [M[j] for M in mg] + [m_rg[j]]
        shared1 = _SHARED_ONCE and all(sfields(j) == sfields(0) for j in range(1, H))

        def blocks(fn, nf, count):
            out = []
            for q in range(count):
                fs = [fn(j) if j < H else [0] * nf for j in range(4 * q, 4 * q + 4)]
                out.append(", ".join(_lit(fs[lane][f]) for f in range(nf) for lane in range(4)))
            return out
        nb = (H + 3) // 4
        if self.layout == "pairs":
            units = [", ".join(_lit(v) for v in ufields(j)) for j in range(H)]
            shared = [", ".join(_lit(v) for v in sfields(j)) for j in range(1 if shared1 else H)]
            sstride = 0 if shared1 else 12
        else:
            units = blocks(ufields, 6, nb)
            shared = blocks(sfields if not shared1 else (lambda j: sfields(0)), 12, 1 if shared1 else nb)
            sstride = 0 if shared1 else 48
        nu = 6 * (H if self.layout == "pairs" else 4 * nb)
        ns = 12 * (1 if shared1 else H) if self.layout == "pairs" else 48 * (1 if shared1 else nb)
        self.sizes["cell"] = self.sizes.get("cell", 0) + 4 * (nu + ns)
        self.parts.append(f"static const int32_t {n}_units[{nu}] = {{\n    " + ",\n    ".join(units) + "\n};\n")
        self.parts.append(f"static const int32_t {n}_shared[{ns}] = {{\n    " + ",\n    ".join(shared) + "\n};\n")

        def r2(t):
            lo, hi = rng(t)
            return f"{{{_lit(lo)}, {_lit(hi)}}}"
        fields = [f".units = {n}_units", f".shared = {n}_shared", f".shared_stride = {sstride}",
                  f".init_x = {inits[0]}", f".init_h = {inits[1]}",
                  ".t = {" + ", ".join(tabs) + "}", f".k_r = {_lit(k_r)}", f".k_z = {_lit(k_z)}",
                  f".c_rg = {_lit(rg[1])}", f".m_zh = {_lit(int(rs['zh'].multiplier))}", f".c_zh = {_lit(zh[1])}",
                  f".m_zg = {_lit(int(rs['zg'].multiplier))}", f".c_zg = {_lit(zg[1])}", f".zp_h = {_lit(int(zp['h']))}",
                  f".one_z = {_lit(one_z)}", f".span_r = {span['r']}", f".span_z = {span['z']}",
                  f".span_g = {span['g']}", f".wx = {r2('Wx')}", f".rh = {r2('Rh')}", f".h = {r2('h')}",
                  ".a = {" + ", ".join(map(str, ag)) + "}", ".aa = {" + ", ".join(map(str, acc_a)) + "}", f".p_rg = {rg[0]}", f".p_zh = {zh[0]}",
                  f".p_zg = {zg[0]}", f".m_hg = {hg[0]}", f".c_hg = {hg[1]}", f".p_hg = {hg[2]}",
                  f".hg_mode = {hg[3]}", f".std16 = {int(std16)}"]
        self.parts.append(f"static const qgru_rt_fast {n}_fast = {{\n    " + ",\n    ".join(fields) + "\n};\n")
        return None

    def _init_rows(self, v: List[int], H: int) -> List[int]:
        """a fast kernel's accumulator starts from biases v [3H]: each gate's rows padded to 4 (zeros),
        pairs layout: b[2i] + 256 b[2i+1] (mod 2^32) in the even row"""
        G = _pad4(H)
        rows = [0] * (3 * G)
        for g in range(3):
            rows[g * G:g * G + H] = v[g * H:(g + 1) * H]
        if self.layout == "pairs":
            rows = [((rows[i] + 256 * rows[i + 1] + (1 << 31)) % (1 << 32)) - (1 << 31) if i % 2 == 0 else rows[i]
                    for i in range(3 * G)]
        return rows

    def _xlevels(self, n: str, p: LayerParams, fast: bool, cell32: bool, wide_x: int, where: str) -> str:
        """layer 0's x levels (csrc/c/qgru_rt.h qgru_rt_xlevels), written into the parts; returns the
        struct's name. Levels 1 .. J-1 carry their biases and W.x rescales; every bound their path
        relies on is checked here: the fast cell's int32 kernel sums with the level's bias, unit32's
        (per level, else that level takes unit), the rescales' ranges."""
        lv = p.x_levels
        J, H = int(lv.exponent.numel()), p.hidden_size
        lo_x, hi_x = qrange(p.bits["x"])
        gemm = p.W.abs().sum(1) * max(-lo_x, hi_x)  # [3H]: |q_W| |q_x| per row
        biases, ms, ss, c32, mx, aa = [], [], [], [], [], []
        for j in range(1, J):
            m, s_ = lv.rescale.multiplier[j].expand(3 * H), lv.rescale.shift[j].expand(3 * H)
            if int(m.min()) < 0 or int(m.max()) > INT32_MAX or int(s_.min()) < 1 or int(s_.max()) > 62:
                raise ValueError(f"write_mcu: {where}: x level {j}'s W.x rescale is outside int32 multipliers / "
                                 "shifts [1, 62]; export with x_levels=False")
            v = lv.b_x[j] - p.W_zp_comp
            if fast and int((gemm + v.abs()).max()) > INT32_MAX:
                raise ValueError(f"write_mcu: {where}: x level {j}'s W.x sums exceed int32 (the fast kernels); "
                                 "export with x_levels=False")
            acc = gemm + v.abs()
            c32.append(int(cell32 and not wide_x and _fits(v, 32)
                           and bool(((acc << (33 - s_).clamp(min=0)) <= INT32_MAX).all())))
            biases.append(v.tolist())
            ms += m.tolist()
            ss += s_.tolist()
            if fast and mx is not None:  # the SMMLAR form (_fast's), an operand shift a per channel, if it holds
                ml, sl, vb = m.tolist(), s_.tolist(), (gemm + v.abs()).tolist()
                a = [max(0, 32 - sh - (31 - mm.bit_length())) for mm, sh in zip(ml, sl)]
                if any(sh > 32 or (b_ << a_) > INT32_MAX for sh, b_, a_ in zip(sl, vb, a)) or not _LEVEL_SMMLAR:
                    mx = None
                else:
                    mx += [mm << (32 - sh - a_) for mm, sh, a_ in zip(ml, sl, a)]
                    aa += a
        f = [f".num = {J}"]
        for k in ("scale", "lo", "hi"):
            vals = ", ".join(_dlit(v) for v in getattr(lv, k).tolist())
            self.sizes["x levels"] = self.sizes.get("x levels", 0) + 8 * J
            self.parts.append(f"static const double {n}_xl_{k}[{J}] = {{{vals}}};\n")
            f.append(f".{k} = {n}_xl_{k}")
        for k, vals in (("rscale", [_f32(1.0 / v) for v in lv.scale.tolist()]),
                        ("lo32", [_f32(v, 1) for v in lv.lo.tolist()]), ("hi32", [_f32(v, -1) for v in lv.hi.tolist()])):
            self.sizes["x levels"] = self.sizes.get("x levels", 0) + 4 * J
            self.parts.append(f"static const float {n}_xl_{k}[{J}] = {{{', '.join(map(_flit, vals))}}};\n")
            f.append(f".{k} = {n}_xl_{k}")
        if J > 1:
            if fast:
                f.append(f".init = {self._arr('int32_t', f'{n}_xl_init', [r for b in biases for r in self._init_rows(b, H)], 'x levels')}")
            else:
                flat = [v for b in biases for v in b]
                if _fits_ints(flat, 32):
                    f.append(f".bias = {self._arr('int32_t', f'{n}_xl_bias', flat, 'x levels')}")
                else:
                    f.append(f".bias64 = {self._arr('int64_t', f'{n}_xl_bias64', flat, 'x levels')}")
                f.append(f".cell32 = {self._arr('uint8_t', f'{n}_xl_cell32', c32, 'x levels')}")
            if fast and mx is not None:
                f.append(f".mx = {self._arr('int32_t', f'{n}_xl_mx', mx, 'x levels')}")
                f.append(f".aa = {self._arr('uint8_t', f'{n}_xl_aa', aa, 'x levels')}")
            else:
                f.append(f".m = {self._arr('int32_t', f'{n}_xl_m', ms, 'x levels')}")
                f.append(f".s = {self._arr('uint8_t', f'{n}_xl_s', ss, 'x levels')}")
        self.parts.append(f"static const qgru_rt_xlevels {n}_xlv = {{\n    " + ",\n    ".join(f) + "\n};\n")
        return f"{n}_xlv"

    def _cell32(self, p: LayerParams, li: int, op: str, wide) -> bool:
        """Whether the runtime's 32-bit cell (qgru_rt.c unit32, qgru_rt_rescale32) is exact here:
        every rescale operand v has |v| 2^pre < 2^31, pre = max(0, 33 - shift), and the
        accumulators with their biases fit int32 (docs/mcu.md)."""
        b, rs = p.bits, p.rescale
        if wide["x"] or wide["h"]:
            return False
        H = p.hidden_size

        def pre(shift: torch.Tensor) -> torch.Tensor:
            return (33 - shift).clamp(min=0)

        def ok(bound: torch.Tensor, shift: torch.Tensor) -> bool:
            return bool(((bound.to(torch.int64) << pre(shift)) <= INT32_MAX).all())

        for q, a, bias, comp, name in ((p.W, "x", p.b_x, p.W_zp_comp, "Wx"), (p.R, op, p.b_h, p.R_zp_comp, "Rh")):
            lo, hi = qrange(b[a])
            acc = q.abs().sum(1) * max(-lo, hi) + (bias - comp).abs()
            if not ok(acc, rs[name].shift.expand(3 * H)):
                return False
        span = {t: (1 << b[t]) - 1 for t in ("Wx", "Rh", "h")}
        for t, src in (("Wx_r", "Wx"), ("Rh_r", "Rh"), ("Wx_z", "Wx"), ("Rh_z", "Rh"), ("Wx_g", "Wx")):
            if not ok(torch.tensor(span[src], device=rs[t].shift.device), rs[t].shift):
                return False
        if op == "h_gemm" and not ok(torch.tensor(span["h"], device=rs["h_gemm"].shift.device), rs["h_gemm"].shift):
            return False
        if li > 0:
            for e, q in enumerate(self.params.layers[li - 1]):
                if not ok(torch.tensor((1 << q.bits["h"]) - 1, device=rs[f"in_{e}"].shift.device), rs[f"in_{e}"].shift):
                    return False
        return True

    def _table(self, n: str, g: str, p: LayerParams, where: str) -> str:
        t = p.tables[g]
        in_bits = p.bits[f"{g}_pre"]
        k, frac = table_geometry(in_bits)
        mx = int(t.abs().max())
        if 3 * mx * (1 << k) + (1 << (k + frac)) > INT32_MAX:
            raise ValueError(f"write_mcu: {where}: table {g} ({mx}, k = {k}) does not interpolate in int32")
        ctype = "int16_t" if _fits(t, 16) else "int32_t"
        name = self._arr(ctype, f"{n}_table_{g}", t.tolist(), "tables")
        lo, hi = qrange(p.bits[g])
        t16, t32 = (name, "0") if ctype == "int16_t" else ("0", name)
        return (f"{{.t16 = {t16}, .t32 = {t32}, .in_lo = {_lit(qrange(in_bits)[0])}, .out_zp = {_lit(p.zp[g])}, "
                f".out = {{{_lit(lo)}, {_lit(hi)}}}, .k = {k}, .frac = {frac}}}")

    def files(self) -> Tuple[str, str]:
        params, pre, P = self.params, self.pre, self.P
        meta = params.meta
        L, D = len(params.layers), len(params.layers[0])
        I, H = meta["input_size"], meta["hidden_size"]
        dirs = [self._dir(li, d, p) for li, row in enumerate(params.layers) for d, p in enumerate(row)]
        p0 = params.layers[0][0]
        body = "".join(self.parts)
        qx, qh0, out, h_n, xf, fout, fh_n = self.golden
        cfg = meta.get("config", {})
        src = f"""/* {self.stem_name}.c: written by qgru.export_mcu: the data of a converted QuantGRU for the
 * runtime in csrc/c/ (qgru_rt.h). Config "{cfg.get('name', '?')}", scale_mode "{cfg.get('scale_mode', '?')}". */
#include <math.h>

#include "{self.stem_name}.h"

#if QGRU_RT_ABI != {ABI}
#error "{self.stem_name}.c was written for qgru_rt ABI {ABI}: export it again with this qgru"
#endif
{body}
static const qgru_rt_dir {pre}_dirs[{L * D}] = {{
{(","+chr(10)).join(dirs)}
}};

const qgru_rt_model {pre}_model = {{{ABI}, {L}, {D}, {I}, {H}, {pre}_dirs}};

#ifdef {P}_GOLDEN
/* ---- golden vectors: qgru.golden on these integers ---- */
static const int16_t {pre}_golden_x[{qx.numel()}] = {{{", ".join(map(str, qx.reshape(-1).tolist()))}}};
static const int16_t {pre}_golden_h0[{qh0.numel()}] = {{{", ".join(map(str, qh0.reshape(-1).tolist()))}}};
static const int16_t {pre}_golden_out[{out.numel()}] = {{{", ".join(map(str, out.reshape(-1).tolist()))}}};
static const int16_t {pre}_golden_hn[{h_n.numel()}] = {{{", ".join(map(str, h_n.reshape(-1).tolist()))}}};
/* float input (qgru_rt_run_float; tokens beyond calibration, on their x levels where exported) */
static const float {pre}_golden_xf[{xf.numel()}] = {{{", ".join(map(_flit, xf.reshape(-1).tolist()))}}};
static const int16_t {pre}_golden_fout[{fout.numel()}] = {{{", ".join(map(str, fout.reshape(-1).tolist()))}}};
static const int16_t {pre}_golden_fhn[{fh_n.numel()}] = {{{", ".join(map(str, fh_n.reshape(-1).tolist()))}}};

/* one pass of the golden sequence, integer (xf = 0) or float input: in one call, or
 * (unidirectional, step) one step a call with the state carried by the caller; the number of
 * integers that differ, or an error (< 0) */
static int32_t {pre}_golden_pass(const float *xf, int step, void *work, size_t work_bytes)
{{
    const int16_t *want_out = xf ? {pre}_golden_fout : {pre}_golden_out, *want_hn = xf ? {pre}_golden_fhn : {pre}_golden_hn;
    int16_t state[{L * D * H}], out[{qx.shape[0] * D * H}];
    int32_t i, t, rc = 0, bad = 0;
    for (i = 0; i < {L * D * H}; i++)
        state[i] = {pre}_golden_h0[i];
    for (t = 0; t < {qx.shape[0]} && !rc; t += step ? 1 : {qx.shape[0]}) {{
        const int32_t n = step ? 1 : {qx.shape[0]};
        rc = xf ? qgru_rt_run_float(&{pre}_model, xf + t * {I}, n, state, out + t * {D * H}, work, work_bytes)
                : qgru_rt_run(&{pre}_model, {pre}_golden_x + t * {I}, n, state, out + t * {D * H}, work, work_bytes);
    }}
    if (rc)
        return rc;
    for (i = 0; i < {out.numel()}; i++)
        bad += out[i] != want_out[i];
    for (i = 0; i < {L * D * H}; i++)
        bad += state[i] != want_hn[i];
    return bad;
}}

/* Runs the golden sequences, integer and float input, each in one call (and, unidirectional, one
 * step per call too): the number of integers (outputs and h_n) that differ from qgru.golden's,
 * 0 = bit-exact; < 0: an error (-100: the runtime wrote past the qgru_rt_work_bytes it asked for,
 * checked on 16 guard bytes where work_bytes leaves room for them). */
int {pre}_selftest(void *work, size_t work_bytes)
{{
    const size_t need = qgru_rt_work_bytes(&{pre}_model, {qx.shape[0]});
    unsigned char *guard = (unsigned char *)work + need;
    const int32_t ng = work_bytes >= need + 16 ? 16 : 0;
    int32_t f, step, rc, i, bad = 0;
    for (i = 0; i < ng; i++)
        guard[i] = 0x5a;
    for (f = 0; f < 2; f++)
        for (step = 0; step < ({D} == 1 ? 2 : 1); step++) {{
            rc = {pre}_golden_pass(f ? {pre}_golden_xf : 0, step, work, ng ? need : work_bytes);
            if (rc < 0)
                return rc;
            bad += rc;
        }}
    for (i = 0; i < ng; i++)
        if (guard[i] != 0x5a)
            return -100;
    return bad;
}}
#endif /* {P}_GOLDEN */
"""
        xlo, xhi = qrange(p0.bits["x"])
        lv = p0.x_levels
        levels = ("no x levels: every token on the static grid" if lv is None else
                  f"{lv.exponent.numel()} x levels, each token on its own" if self.x_levels else
                  "x levels left out (x_levels=False): every token on the static grid")
        sizes = ", ".join(f"{k} {v}" for k, v in self.sizes.items())
        notes = "".join(f" *   {s}\n" for s in self.notes) or " *   none: every GEMM accumulates in int32\n"
        notes += " * Cells (docs/mcu.md):\n" + ("".join(f" *   {s}\n" for s in self.cell_notes)
                                                 or " *   every direction takes the fast cell (build the runtime with -DQGRU_RT_FAST_ONLY to leave\n"
                                                    " *   the other cells' code out)\n")
        hdr = f"""/* {self.stem_name}.h: written by qgru.export_mcu (csrc/c/qgru_rt.h runs it; docs/mcu.md).
 *
 * {L} layer(s) x {D} direction(s), {I} -> {H}; config "{cfg.get('name', '?')}", scale_mode "{cfg.get('scale_mode', '?')}".
 * Input: x_q [T][{P}_INPUT_SIZE] int16_t on layer 0's x grid: real = (q - {P}_X_ZERO_POINT) * {P}_X_SCALE
 * (qgru_rt_run), or floats (qgru_rt_run_float: {levels}).
 * State: [{P}_STATE_SIZE] int16_t (h0 in, h_n out, torch's h_n order); outputs [T][{D * H}] on each
 * direction's h grid (qgru_rt_dequantize). Flash bytes of data: {sizes}.
 * GEMMs on the int64 loop (the int32 bound does not hold, docs/mcu.md):
{notes} *
 * Self-test: compile {self.stem_name}.c with -D{P}_GOLDEN for {pre}_selftest().
 */
#ifndef {P}_H_
#define {P}_H_

#include "qgru_rt.h"

#define {P}_INPUT_SIZE {I}
#define {P}_HIDDEN_SIZE {H}
#define {P}_NUM_LAYERS {L}
#define {P}_NUM_DIRECTIONS {D}
#define {P}_STATE_SIZE {L * D * H}
#define {P}_X_BITS {p0.bits['x']}
#define {P}_X_ZERO_POINT ({int(p0.zp['x'])})
#define {P}_X_MIN ({xlo})
#define {P}_X_MAX {xhi}
#define {P}_X_SCALE {float(p0.scale['x'])!r}
#define {P}_GOLDEN_T {qx.shape[0]}

extern const qgru_rt_model {pre}_model;

#ifdef {P}_GOLDEN
int {pre}_selftest(void *work, size_t work_bytes);
#endif

#endif /* {P}_H_ */
"""
        return src, hdr


def runtime_dir() -> Path:
    """The C runtime's folder (csrc/c/): of an installed wheel (qgru/csrc/c) or of a source checkout."""
    here = Path(__file__).resolve().parent
    for d in (here / "csrc" / "c", here.parent / "csrc" / "c"):
        if (d / "qgru_rt.h").is_file():
            return d
    raise FileNotFoundError("qgru's C runtime (csrc/c/) is missing from this installation")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qgru.export_mcu", description=__doc__.split("\n")[0],
                                 epilog="python -m qgru.export_mcu --runtime-dir: print the C runtime's folder")
    if argv is None:
        argv = sys.argv[1:]
    if list(argv) == ["--runtime-dir"]:  # where the C runtime's sources are, for a build's -I and sources
        print(runtime_dir())
        return 0
    ap.add_argument("params", help="a file written by QuantParams.save()")
    ap.add_argument("stem", help="output stem: writes STEM.h and STEM.c")
    ap.add_argument("--prefix", default=None, help="C identifier prefix (default: from the stem's name)")
    ap.add_argument("--golden-steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", choices=LAYOUTS, default="interleaved",
                    help="weight order of the target's kernel: pairs for Cortex-M DSP (M4/M7/M33: SMLAD), rows for "
                         "Helium (M55), else interleaved (plain C, NEON); the runtime refuses another")
    ap.add_argument("--no-x-levels", action="store_true",
                    help="leave layer 0's x levels out (less flash; qgru_rt_run_float then takes every token on the "
                         "static grid)")
    a = ap.parse_args(argv)
    return run_writer(ap.prog, lambda: write_mcu(load_params(a.params), a.stem, prefix=a.prefix,
                                                 golden_steps=a.golden_steps, seed=a.seed, layout=a.layout,
                                                 x_levels=not a.no_x_levels))


if __name__ == "__main__":
    sys.exit(main())
