"""Preparing a layer's parameters for the native code: LayerParams -> the flat tensors and values
the C++/CUDA Layer takes (once per device): the weight limb matrices of each GEMM, the packed
tables, the rescales, and where they are exact the int32 cell's fields (pow2 shift tables or the
multiplier form; csrc/qgru_cell.h proves the bounds checked here).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..convert import recurrent_operand
from ..golden import LayerParams, Rescale
from ..primitives import qrange, split_int8_limbs
from ..tables import table_geometry

GEMM_PAD = 16  # channel and reduction padding: int8 tensor-core GEMMs want multiples of 16
# the CUDA backend's smallest GEMM dimension (csrc/qgru_cuda.h kMinGemmDim: cuBLAS is never asked
# for 16 or fewer channels, rows or K, shapes PyTorch's own int8 GEMM refuses)
CUDA_GEMM_MIN = 32


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def _per_channel(v: torch.Tensor, n: int) -> torch.Tensor:
    return v.reshape(-1).expand(n).contiguous() if v.numel() == 1 else v.reshape(n).contiguous()


def direct16_fits(weights: torch.Tensor, w_bits: int, act_bits: int) -> bool:
    """Whether a 16-bit activation times these 8-bit weights is exact as one int16 x int16 GEMM
    with int32 sums (csrc/cpu/kernel_avx2.cpp, vnni16_gemm.h): 2^15 sum_k |w_ck| < 2^31 for every
    row c, which bounds every partial sum too (at max|w| = 127 any K <= 516 fits; typical rows far
    beyond: their weights are mostly well below the row's largest)."""
    if act_bits <= 8 or w_bits > 8:
        return False
    max_row = int(weights.to(torch.int64).abs().sum(1).max()) if weights.numel() else 0
    return max_row * 32768 < (1 << 31)


def limbs16_fits(weights: torch.Tensor, w_bits: int, act_bits: int) -> bool:
    """Whether a 16-bit activation taken whole times the two int8 limbs of these 16-bit weights
    (split_int8_limbs) is exact as two int16 x int16 GEMMs with int32 sums: 2^15 sum_k |limb_ck|
    < 2^31 for every row c of each limb, and for the ones row of the limb offsets (sum_k 1 = K),
    which bounds every partial sum too (|lo limb| <= 128: any K < 512 fits). The two products
    are combined exactly in int64 (qgru_cell.h exact_product): two limb pairs, not four."""
    if act_bits <= 8 or w_bits <= 8 or w_bits > 16:
        return False
    K = weights.shape[1] if weights.dim() == 2 else 0
    if K * 32768 >= (1 << 31):
        return False
    for limb, _, _ in split_int8_limbs(weights.to(torch.int64), w_bits):
        max_row = int(limb.to(torch.int64).abs().sum(1).max()) if limb.numel() else 0
        if max_row * 32768 >= (1 << 31):
            return False
    return True


def _gemm_bound(weights: torch.Tensor, act_bits: int) -> torch.Tensor:
    """int64 [rows]: max |a . w_c| over activations of act_bits bits (|a| <= 2^(act_bits - 1))."""
    return weights.to(torch.int64).abs().sum(1) << (act_bits - 1)


def one_limb_pair(p: LayerParams, act16: bool) -> bool:
    """Whether both of p's GEMMs are one limb pair (the CPU Layer's step is then one fused pass,
    gemm "<path>-fused"): 8-bit weights, and x and h of at most 8 bits or, on a path with int16
    operands (act16), taken whole where direct16_fits (prepare_layer's x_direct16 / h_direct16)."""
    b = p.bits
    h = b[recurrent_operand(b)]
    return (b["W"] <= 8 and b["R"] <= 8 and (b["x"] <= 8 or (act16 and direct16_fits(p.W, b["W"], b["x"])))
            and (h <= 8 or (act16 and direct16_fits(p.R, b["R"], h))))


def _limb_gemm(prefix: str, weights: torch.Tensor, w_bits: int, act_bits: int, M_pad: int,
               ones_col: int, act_direct: bool = False,
               gemm_min: int = GEMM_PAD) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """Weight limb matrices [L, M_pad, K_pad] int8, limb pairs [P, 4], constant per-channel terms [M].
    act_direct: the activations (up to 16 bits) enter whole, as one int16 limb. K_pad: a multiple
    of GEMM_PAD, at least gemm_min."""
    M, K = weights.shape
    K_pad = max(_round_up(max(K, 1), GEMM_PAD), gemm_min)
    w_limbs = split_int8_limbs(weights.to(torch.int64), w_bits)
    any_offset = any(c for _, _, c in w_limbs)
    # as csrc act_limb()
    act_limbs = [(1, 0)] if act_bits <= 8 or act_direct else [(1, 128), (256, 0)]
    stacked = torch.zeros(len(w_limbs), M_pad, K_pad, dtype=torch.int8, device=weights.device)
    const = torch.zeros(M, dtype=torch.int64, device=weights.device)
    pairs = []
    for j, (limb, wscale, d) in enumerate(w_limbs):
        stacked[j, :M, :K] = limb
        if any_offset:
            stacked[j, ones_col, :K] = 1  # its output column is rowsum of the activation limb
        colsum = limb.to(torch.int64).sum(1)
        for i, (ascale, c) in enumerate(act_limbs):
            s = ascale * wscale
            pairs.append([i, j, s, d])
            const += s * (c * colsum + c * d * K)
    return {f"{prefix}_weight_limbs": stacked, f"{prefix}_pairs": torch.tensor(pairs, dtype=torch.int64, device=weights.device)}, const


def pack_table(entries: torch.Tensor) -> torch.Tensor:
    """csrc Table layout: entry i = T[i] (low 32 bits) | (T[i+1] - T[i]) << 32, one per segment."""
    e = entries.to(torch.int64)
    lo, diff = e[:-1], e[1:] - e[:-1]
    assert int(e.abs().max()) < (1 << 30), "table entries exceed the packed layout"
    return (diff * (1 << 32) + (lo & 0xFFFFFFFF)).contiguous()


_FORK_SAFE_CHUNK = 1024  # elements per float op in prepare_layer (see rescale)


def prepare_layer(p: LayerParams, act16: bool = False,
                  gemm_min: int = GEMM_PAD) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
    """The C++ Layer's arguments for one layer and direction (CPU tensors; move them as needed).

    act16: the kernel takes int16 activations (the CPU's avx2 path), so a 16-bit x or h times 8-bit
    weights is one GEMM where ``direct16_fits`` proves its int32 sums exact, and times 16-bit weights
    two (one per weight limb, not four limb pairs) where ``limbs16_fits`` does. "h_bits" is the bits of
    the R.h GEMM's operand (h_gemm's when the layer has one, "hg" = 1: the cell then writes the
    operand from the new state, golden.recurrent_operand); "h_lo"/"h_hi" the state's range.
    gemm_min: the smallest
    padded channel count (M_pad) and reduction length (K_pad), CUDA_GEMM_MIN for the CUDA backend
    (zero padding: the same integers)."""
    H, I = p.hidden_size, p.input_size
    H3 = 3 * H
    b, zp, rs = p.bits, p.zp, p.rescale
    needs_ones = b["W"] > 8 or b["R"] > 8
    ones_col = H3
    M_pad = max(_round_up(H3 + (1 if needs_ones else 0), GEMM_PAD), gemm_min)
    t: Dict[str, torch.Tensor] = {}
    op = recurrent_operand(b)  # what R.h reads: "h" or "h_gemm"
    v: Dict[str, int] = {"H": H, "I": I, "M_pad": M_pad, "ones_col": ones_col if needs_ones else 0,
                         "x_bits": b["x"], "h_bits": b[op], "hg": int(op == "h_gemm")}
    x_direct = act16 and (direct16_fits(p.W, b["W"], b["x"]) or limbs16_fits(p.W, b["W"], b["x"]))
    h_direct = act16 and (direct16_fits(p.R, b["R"], b[op]) or limbs16_fits(p.R, b["R"], b[op]))
    v["x_direct16"], v["h_direct16"] = int(x_direct), int(h_direct)
    gx, const_x = _limb_gemm("x", p.W, b["W"], b["x"], M_pad, ones_col, x_direct, gemm_min)
    gh, const_h = _limb_gemm("h", p.R, b["R"], b[op], M_pad, ones_col, h_direct, gemm_min)
    t.update(gx)
    t.update(gh)

    def rescale(name: str, r, n: int) -> None:
        m = _per_channel(r.multiplier, n).to(torch.int64)
        t[name + "_mult"] = m
        t[name + "_shift"] = _per_channel(r.shift, n).to(torch.int32)
        # log2 of power-of-two multipliers (x * m becomes a shift); -1 marks the others. In chunks of
        # at most _FORK_SAFE_CHUNK elements: torch's float kernels split larger tensors over OpenMP
        # threads, which hangs in a child of fork() (a layer is prepared there anew; x levels make
        # these arrays J times 3H long)
        parts = []
        for c in m.split(_FORK_SAFE_CHUNK):
            is_pow2 = (c > 0) & ((c & (c - 1)) == 0)
            parts.append(torch.where(is_pow2, torch.log2(c.double().clamp(min=1)).round().long(),
                                     torch.full_like(c, -1)).to(torch.int32))
        t[name + "_mult_log2"] = torch.cat(parts) if len(parts) != 1 else parts[0]

    def rng(name: str, bits: int) -> None:
        v[name + "_lo"], v[name + "_hi"] = qrange(bits)

    for name, bias, comp, const in (("Wx", p.b_x, p.W_zp_comp, const_x), ("Rh", p.b_h, p.R_zp_comp, const_h)):
        t[name + "_bias"] = (bias - comp + const).to(torch.int64).contiguous()
        rescale(name, rs[name], H3)
        t[name + "_zp"] = _per_channel(zp[name], H3).to(torch.int64)
        rng(name, b[name])
    # x levels (golden.XLevels, first layer with config x.dynamic): W.x's bias and rescale per level,
    # [J, 3H] flattened, level j's channel c at j 3H + c (csrc/qgru_cell.h at_level); level 0 is the
    # static grid's (the same integers as Wx_bias and Wx's rescale)
    lv = p.x_levels
    v["x_levels"] = 0 if lv is None else int(lv.exponent.numel())
    if lv is not None:
        J = v["x_levels"]
        t["Wxl_bias"] = (lv.b_x.reshape(J, H3) - p.W_zp_comp + const_x).to(torch.int64).reshape(-1).contiguous()
        rescale("Wxl", Rescale(lv.rescale.multiplier.reshape(-1), lv.rescale.shift.reshape(-1)), J * H3)
    for g in ("r", "z"):
        rescale(f"{g}_from_wx", rs[f"Wx_{g}"], H)
        rescale(f"{g}_from_rh", rs[f"Rh_{g}"], H)
    rescale("g_from_wx", rs["Wx_g"], H)
    rescale("g_from_rrh", rs["rRh_g"], H)
    rescale("zh", rs["zh"], 1)
    rescale("zg", rs["zg"], 1)
    for g in ("r", "z", "g"):
        v[f"{g}_pre_zp"] = int(zp[f"{g}_pre"])
        rng(f"{g}_pre", b[f"{g}_pre"])
        rng(g, b[g])
        v[f"{g}_zp"] = int(zp[g])
        k, frac = table_geometry(b[f"{g}_pre"])
        v[f"{g}_table_k"], v[f"{g}_table_frac"] = k, frac
        t[f"table_{g}"] = pack_table(p.tables[g])
    # the shift-only kernels are used when every multiplier is a power of two (pow2 scale mode)
    v["pow2"] = int(all(bool((x >= 0).all()) for k, x in t.items() if k.endswith("_mult_log2")))
    v["one_z"] = int(p.one_z)
    v["h_zp"] = int(zp["h"])
    rng("h", b["h"])
    if op == "h_gemm":
        rescale("hg", rs["h_gemm"], 1)
        v["hg_zp"] = int(zp["h_gemm"])
        rng("hg", b["h_gemm"])
    # wide accumulators (a 16-bit operand taken whole): each GEMM output's bound per channel
    bound = {"Wx": _gemm_bound(p.W, b["x"]), "Rh": _gemm_bound(p.R, b[op])}
    v["acc32"] = int(_add_acc32(t, v, b, bound))
    _add_limb32(t, v, b, op, x_direct, h_direct)
    return t, v


# the limb pairs of a 16-bit activation taken whole times 16-bit weights (_limb_gemm, limbs16_fits)
_LIMB16_PAIRS = [[0, 0, 1, 128], [0, 1, 256, 0]]


def _add_limb32(t: Dict[str, torch.Tensor], v: Dict[str, int], bits: Dict[str, int], op: str,
                x_direct: bool, h_direct: bool) -> None:
    """"limb32_x" / "limb32_h" = 1 and their int32 fields where a GEMM is two limb pairs of a
    16-bit activation taken whole (limbs16_fits) in a pow2 layer and _limb32_parts' bounds hold:
    the CPU then requantizes those products in int32 (csrc/cpu/kernels.h LimbRequant32), W.x in
    its requantization pass and R.h in the hybrid cell."""
    v["limb32_x"] = v["limb32_h"] = 0
    if not v["pow2"]:
        return
    for flag, pre, acc, arrays, direct, w_bits, a_bits in (
            ("limb32_x", "x", "Wx", "Wxl" if v["x_levels"] else "Wx", x_direct, bits["W"], bits["x"]),
            ("limb32_h", "h", "Rh", "Rh", h_direct, bits["R"], bits[op])):
        if not direct or w_bits <= 8 or a_bits <= 8 or t[pre + "_pairs"].tolist() != _LIMB16_PAIRS:
            continue
        parts = _limb32_parts(t, arrays)
        if parts is None:
            continue
        t.update(parts)
        t[acc + "_l32_zp"] = t[acc + "_zp"].to(torch.int32)
        v[flag] = 1


def _limb32_parts(t: Dict[str, torch.Tensor], name: str) -> Optional[Dict[str, torch.Tensor]]:
    """The fields of csrc/cpu/kernels.h LimbRequant32 for the pow2 requantization ``name`` (Wx, Wxl:
    every x level's, or Rh): R = _net_shift in [8, 29], bias = bias_hi 2^R + bias_lo with
    0 <= bias_lo < 2^R, |bias_hi| + 2^25 < 2^31 (the proof is at LimbRequant32); None where they
    fail."""
    r = _net_shift(t, name)
    if bool((r < 8).any()) or bool((r > 29).any()):
        return None
    bias = t[name + "_bias"]
    hi = torch.div(bias, 1 << r, rounding_mode="floor")
    if bool((hi.abs() + (1 << 25) >= (1 << 31)).any()):
        return None
    return {name + "_l32_bias_hi": hi.to(torch.int32), name + "_l32_bias_lo": (bias - hi * (1 << r)).to(torch.int32),
            name + "_l32_rshift": r.to(torch.int32)}


def _net_shift(t: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """R = shift - 1 - log2(mult) of a power-of-two rescale (int64): the rescale is v >> R, rounded."""
    return t[name + "_shift"].to(torch.int64) - 1 - t[name + "_mult_log2"].to(torch.int64)


def _add_acc32(t: Dict[str, torch.Tensor], v: Dict[str, int], bits: Dict[str, int],
               bound: Optional[Dict[str, torch.Tensor]] = None) -> bool:
    """Add the int32 forms (csrc AccRequant32 and Cell32) when they are exact for this layer.

    Common conditions: one limb pair on both GEMMs and K < 2^16. Either 8-bit x, W, R and R.h
    operand (h itself, or h_gemm beside a state of up to 16 bits), so every GEMM accumulator G is
    below K 2^14 <= 2^30 in magnitude (the accumulators' int32 form, _requant32); or a 16-bit x or
    R.h operand taken whole (x_direct16 / h_direct16, an int16 CPU path) and 8-bit weights: the
    accumulators may use all of int32 and take the wide form (_requant_wide with the per-channel
    bounds ``bound``, "acc_wide" = 1; qgru_cell.h requant_wide32), the gates the same int32 cell.
    Then the pow2 form (_acc32_pow2) or the multiplier form (_acc32_mult) adds its fields where its
    own bounds hold (proofs in csrc/qgru_cell.h); otherwise the hybrid cell's fields where the
    gates' bounds hold (_add_hybrid32, "hybrid32" = 1: the CPU's unfused step), else the layer runs
    the int64 cell.
    """
    v["acc_wide"] = 0
    v["hybrid32"] = 0
    ok = _add_acc32_full(t, v, bits, bound)
    if not ok:
        _add_hybrid32(t, v)
    return ok


def _add_hybrid32(t: Dict[str, torch.Tensor], v: Dict[str, int]) -> bool:
    """The hybrid cell's fields ("hybrid32" = 1) where the int32 cell's own accumulator forms do not
    hold (16-bit weights, two or more limb pairs, or their bounds fail): the accumulators are then
    requantized in int64 (exact for any limb pairs), and the gates and the new state run in the
    int32 cell (csrc/qgru_cell.h gru_cell32_d, csrc/cpu/cell_loops.h cell_block_hybrid), whose
    bounds (_acc32_pow2 / _acc32_mult: from the grids of Wx, Rh, the gates and h, never from the
    accumulators) are checked here. The CPU Layer runs it on its unfused step (a layer of more
    than one limb pair); the fused step and the CUDA backend keep the int64 cell."""
    if max(v["I"], v["H"]) >= (1 << 16):
        return False
    zeros = {n: torch.zeros(t[n + "_bias"].numel(), dtype=torch.int32, device=t["Wx_bias"].device)
             for n in ("Wx", "Rh")}

    def requant(name: str, pow2: bool) -> Dict[str, torch.Tensor]:  # unused fields: the int64 form runs
        z = zeros[name]
        return {name + "_bias_hi": z, name + "_bias_lo": z, name + "_rshift": z, name + "_mult32": z}
    parts = _acc32_pow2(t, v, requant) if v["pow2"] else _acc32_mult(t, v, requant)
    if parts is None:
        return False
    for name in ("Wx", "Rh"):
        parts[name + "_lo_z"] = parts[name + "_hi_z"] = zeros[name]
    t["c32_channels"] = _channel_blocks(parts, v["H"])
    v["hybrid32"] = 1
    return True


def _add_acc32_full(t: Dict[str, torch.Tensor], v: Dict[str, int], bits: Dict[str, int],
                    bound: Optional[Dict[str, torch.Tensor]] = None) -> bool:
    """_add_acc32's int32 cell with its int32 accumulator forms (narrow or wide), or False."""
    op_bits = bits[recurrent_operand(bits)]
    if max(bits["W"], bits["R"]) > 8 or max(v["I"], v["H"]) >= (1 << 16):
        return False
    narrow = max(bits["x"], op_bits) <= 8
    wide = (not narrow and bound is not None and (bits["x"] <= 8 or v["x_direct16"])
            and (op_bits <= 8 or v["h_direct16"]))
    if not (narrow or wide):
        return False
    if narrow:
        def requant(name: str, pow2: bool) -> Optional[Dict[str, torch.Tensor]]:
            return _requant32(t, name, pow2, v["I"] if name in ("Wx", "Wxl") else v["H"])
    else:
        def requant(name: str, pow2: bool) -> Optional[Dict[str, torch.Tensor]]:
            b = bound["Rh" if name == "Rh" else "Wx"]
            return _requant_wide(t, name, pow2, b.repeat(v["x_levels"]) if name == "Wxl" else b)
    parts = _acc32_pow2(t, v, requant) if v["pow2"] else _acc32_mult(t, v, requant)
    if parts is None:
        return False
    if v["x_levels"]:
        levels = requant("Wxl", bool(v["pow2"]))
        if levels is None:
            _warn_levels_int64()
            return False
        parts.update(levels)
    v["acc_wide"] = int(wide)
    for name in ("Wx", "Rh"):  # the channel blocks' clamp ranges relative to the zero point
        zp = t[name + "_zp"].to(torch.int64)
        parts[name + "_lo_z"], parts[name + "_hi_z"] = ((v[name + k] - zp).to(torch.int32) for k in ("_lo", "_hi"))
    parts["Wx_zp32"] = t["Wx_zp"].to(torch.int32)  # the flat arrays' (requant32_flat), every x level's
    t["c32_channels"] = _channel_blocks(parts, v["H"])
    # the W.x requantization pass of the unfused paths reads Wx's int32 form over all 3H channels
    # (and the fused step's, with W.x inside the step); a layer with x levels, Wxl_* per level
    t.update({k: x for k, x in parts.items() if k.startswith(("Wx_", "Wxl_")) and not k.endswith(("_lo_z", "_hi_z"))})
    return True


def _pow2_parts(name: str, bias: torch.Tensor, r: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The pow2 fields of an accumulator requantization with net shift r (both int32 forms,
    _requant32 and _requant_wide; their callers check the bounds, and only _requant32 takes r <= 0).
    r >= 1: bias = bias_hi 2^r + bias_lo with 0 <= bias_lo < 2^r, rshift r and lsh 0; r <= 0:
    bias_hi 0, bias_lo the whole bias, rshift 0 and lsh -r. The lsh is kept in the multiplier
    form's mult32 field (csrc/qgru_cell.h AccRequant32)."""
    right = r.clamp(min=0)
    hi = torch.where(r > 0, torch.div(bias, 1 << right, rounding_mode="floor"), torch.zeros_like(bias))
    return {name + "_bias_hi": hi.to(torch.int32), name + "_bias_lo": (bias - hi * (1 << right)).to(torch.int32),
            name + "_rshift": right.to(torch.int32), name + "_mult32": (-r).clamp(min=0).to(torch.int32)}


def _requant32(t: Dict[str, torch.Tensor], name: str, pow2: bool, K: int) -> Optional[Dict[str, torch.Tensor]]:
    """The int32 form of the accumulator requantization ``name`` (Wx, Rh, or Wxl: every x level's,
    [J 3H]) over K products of int8 operands (|G| <= K 2^14), or None where its bounds fail (csrc
    AccRequant32: pow2, R <= 30 and |bias| <= 2^31, and where R <= 0 (a left shift by -R)
    (K 2^14 + |bias|) 2^-R <= 2^31 - 2; multiplier, (K 2^14 + |bias|) 2^lsh < 2^31 and
    |bias| < 2^31)."""
    bias = t[name + "_bias"]
    parts = {}
    if pow2:
        r = _net_shift(t, name)
        if bool((r > 30).any()) or bool((bias.abs() > (1 << 31)).any()):
            return None
        lsh = (-r).clamp(min=0)
        if bool(((r <= 0) & ((K * (1 << 14) + bias.abs()) << lsh.clamp(max=32) > (1 << 31) - 2)).any()):
            return None
        return _pow2_parts(name, bias, r)
    m, s = t[name + "_mult"], t[name + "_shift"].to(torch.int64)
    lsh, rsh = (33 - s).clamp(min=0), (s - 33).clamp(min=0)
    acc_max = K * (1 << 14) + bias.abs()  # |G + bias|
    step = torch.ones_like(lsh) << lsh.clamp(max=32)
    if not bool(((acc_max * step < (1 << 31)) & (m >= 0) & (m < (1 << 31))).all()) \
            or bool((bias.abs() >= (1 << 31)).any()):
        return None
    parts[name + "_bias_hi"] = bias.to(torch.int32)  # the whole bias
    parts[name + "_bias_lo"], parts[name + "_rshift"], parts[name + "_mult32"] = (
        lsh.to(torch.int32), rsh.to(torch.int32), m.to(torch.int32))  # lsh, rsh, m
    return parts


def _requant_wide(t: Dict[str, torch.Tensor], name: str, pow2: bool,
                  g_max: torch.Tensor) -> Optional[Dict[str, torch.Tensor]]:
    """The wide form of the accumulator requantization ``name`` (Wx, Rh, or Wxl: every x level's,
    [J 3H]) of a GEMM output G with |G| <= g_max per channel (< 2^31: exact in int32), in the
    fields of _requant32 with the meanings of csrc/qgru_cell.h "Wide accumulators", or None where
    its bounds fail: pow2, 1 <= R <= 30 and |bias_hi| + 2^(31 - R) + 2 < 2^31; multiplier, s >= 17,
    |B1| + 2^15 + 1 < 2^31 and (max|G| + |bias|) m / 2^(s-1) < 2^30 (bounded from above without an
    int64 overflow: (floor(v / 2^8) + 1) m / 2^(s-9))."""
    bias = t[name + "_bias"]
    g_max = g_max.to(device=bias.device, dtype=torch.int64)
    if bool((g_max >= (1 << 31)).any()):
        return None
    parts = {}
    if pow2:
        r = _net_shift(t, name)
        if bool((r < 1).any()) or bool((r > 30).any()):
            return None
        if bool((torch.div(bias, 1 << r, rounding_mode="floor").abs() + (1 << (31 - r)) + 2 >= (1 << 31)).any()):
            return None
        return _pow2_parts(name, bias, r)
    m, s = t[name + "_mult"], t[name + "_shift"].to(torch.int64)
    if bool((s < 17).any()) or bool((m < 0).any()) or bool((m >= (1 << 31)).any()):
        return None
    b1 = torch.div(bias, 1 << 16, rounding_mode="floor")
    if bool((b1.abs() + (1 << 15) + 1 >= (1 << 31)).any()):
        return None
    v_max = g_max + bias.abs()
    if bool(((((v_max >> 8) + 1) * m) >> (s - 9) >= (1 << 30)).any()):
        return None
    parts[name + "_bias_hi"] = b1.to(torch.int32)
    parts[name + "_bias_lo"] = (bias - b1 * (1 << 16)).to(torch.int32)
    parts[name + "_rshift"] = (s - 17).to(torch.int32)
    parts[name + "_mult32"] = m.to(torch.int32)
    return parts


_warned_levels_int64 = False


def _warn_levels_int64() -> None:
    """Once per process: a layer whose static W.x fits the int32 cell but one of its x levels does
    not runs the int64 cell (correct, slower)."""
    global _warned_levels_int64
    if _warned_levels_int64:
        return
    _warned_levels_int64 = True
    import warnings
    warnings.warn("qgru native: a layer's widest x levels' W.x requantization does not fit the int32 cell's bounds "
                  "(csrc/qgru_cell.h AccRequant32), which its static grid fits: the layer runs the int64 cell "
                  "(the same integers, slower)", RuntimeWarning, stacklevel=2)


def _pow2_shifts(t: Dict[str, torch.Tensor], name: str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(lsh, rsh) int32 of a pow2 rescale of a value |v| < 2^17 in rescale32, or None where its left
    shift would pass 14 (v << lsh must stay below 2^31)."""
    r = _net_shift(t, name)
    if bool((r < -14).any()):
        return None
    # shifting a value below 2^31 right by 31 or more gives 0 or -1, the same after rounding as the
    # exact result: clamped, so no int32 shift reaches the undefined 32
    return (-r).clamp(min=0).to(torch.int32), r.clamp(min=0, max=31).to(torch.int32)


def _acc32_pow2(t: Dict[str, torch.Tensor], v: Dict[str, int], requant) -> Optional[Dict[str, torch.Tensor]]:
    """The pow2 form's fields, or None. Accumulators: requant(name, True) (_requant32 or
    _requant_wide: R in [1, 30]); cell: left shifts <= 14 for the pre-activation rescales and
    h -> h_gemm, R >= 8 for r * Rh_g and z * h (rescale_wide32), R >= 0 for (1 - z) * g."""
    parts = {}
    for name in ("r_from_wx", "r_from_rh", "z_from_wx", "z_from_rh", "g_from_wx"):
        f = _pow2_shifts(t, name)
        if f is None:
            return None
        parts[name + "_lsh"], parts[name + "_rsh"] = f
    r = _net_shift(t, "g_from_rrh")
    if bool((r < 8).any()):
        return None
    parts["g_from_rrh_rsh"] = r.clamp(max=39).to(torch.int32)  # shifts by R - 8 <= 31
    r = int(_net_shift(t, "zh").reshape(-1)[0])
    if r < 8:
        return None
    v["zh_sh"], v["zh_m32"] = min(r, 39), 0
    r = _net_shift(t, "zg")
    if bool((r < 0).any()):
        return None
    v["zg_rsh"] = int(r.reshape(-1)[0].clamp(max=31))
    v["zg_lsh"] = v["zg_m32"] = 0
    if v["hg"]:  # h -> h_gemm (gemm_operand32): |q_h - Z_h| < 2^17
        f = _pow2_shifts(t, "hg")
        if f is None:
            return None
        v["hg_lsh"], v["hg_rsh"] = (int(x.reshape(-1)[0]) for x in f)
        v["hg_m32"] = 0
    for name in ("Wx", "Rh"):  # the accumulators: as every x level's
        f = requant(name, True)
        if f is None:
            return None
        parts.update(f)
    zeros = torch.zeros(v["H"], dtype=torch.int32, device=t["Wx_bias"].device)  # the multiplier form's, unused
    parts.update({f"{name}_m": zeros for name in MULT_RESCALES})
    return parts


# The per-channel rescales of the int32 cell in multiplier form, in the order of their kMult fields.
MULT_RESCALES = ("r_from_wx", "r_from_rh", "z_from_wx", "z_from_rh", "g_from_wx", "g_from_rrh")


def _product_range(a: Tuple, b: Tuple) -> Tuple:
    """[lo, hi] of x y for x in [a0, a1], y in [b0, b1] (ints or per-channel int64 tensors)."""
    dev = next((v.device for v in (*a, *b) if isinstance(v, torch.Tensor)), torch.device("cpu"))
    corners = [torch.as_tensor(x, dtype=torch.int64, device=dev) * torch.as_tensor(y, dtype=torch.int64, device=dev)
               for x in a for y in b]
    lo, hi = corners[0], corners[0]
    for c in corners[1:]:
        lo, hi = torch.minimum(lo, c), torch.maximum(hi, c)
    return lo, hi


def _acc32_mult(t: Dict[str, torch.Tensor], v: Dict[str, int], requant) -> Optional[Dict[str, torch.Tensor]]:
    """The multiplier form's fields, or None (csrc/qgru_cell.h, the int32 cell's multiplier bounds;
    the accumulators' by requant(name, False): _requant32 or _requant_wide).

    A rescale (m, s) becomes (mul_hi32(x << lsh, m) >> rsh + 1) >> 1 with lsh = max(0, 33 - s),
    rsh = max(0, s - 33); it is exact where every input x, known to lie in [x_lo, x_hi] from its
    grids, keeps x 2^lsh inside int32. r * Rh_g and z * h are rescaled in int64
    (rescale_wide32) and need s >= 17 and a result below 2^29."""
    H = v["H"]

    def shifts(name: str, x_lo, x_hi):
        m, s = t[name + "_mult"], t[name + "_shift"].to(torch.int64)
        lsh, rsh = (33 - s).clamp(min=0), (s - 33).clamp(min=0)
        step = torch.ones_like(lsh) << lsh.clamp(max=32)
        fits = ((torch.as_tensor(x_lo, device=step.device) * step >= -(1 << 31))
                & (torch.as_tensor(x_hi, device=step.device) * step < (1 << 31))
                & (m >= 0) & (m < (1 << 31)))
        return (lsh.to(torch.int32), rsh.to(torch.int32), m.to(torch.int32)) if bool(fits.all()) else None

    def rel(name: str, zp):  # [lo - Z, hi - Z] of a grid
        return v[name + "_lo"] - zp, v[name + "_hi"] - zp

    d_wx = rel("Wx", t["Wx_zp"])  # per channel [3H]
    d_rh = rel("Rh", t["Rh_zp"])
    gate = {g: slice(q * H, (q + 1) * H) for q, g in enumerate("rzg")}
    parts = {}
    for name, (lo, hi) in (
            ("r_from_wx", d_wx), ("z_from_wx", d_wx), ("g_from_wx", d_wx), ("r_from_rh", d_rh), ("z_from_rh", d_rh)):
        g = gate[name[0]]
        f = shifts(name, lo[g], hi[g])
        if f is None:
            return None
        parts[name + "_lsh"], parts[name + "_rsh"], parts[name + "_m"] = f
    def wide(name: str, y_lo, y_hi):
        """rescale_wide32's (s - 17, m) of a product in [y_lo, y_hi]: floor(y m / 2^16), then
        >> (s - 17); |y| m / 2^(s - 1) < 2^29 keeps it in int32. None where that fails."""
        m, s = t[name + "_mult"], t[name + "_shift"].to(torch.int64)
        y_max = torch.maximum(-y_lo, y_hi)
        if bool((s < 17).any()) or bool((m < 0).any()) or bool((m >= (1 << 31)).any()) \
                or bool(((y_max * m) >> (s - 1) >= (1 << 29)).any()):
            return None
        return (s - 17).to(torch.int32), m.to(torch.int32)

    f = wide("g_from_rrh", *_product_range(rel("r", v["r_zp"]), (d_rh[0][gate["g"]], d_rh[1][gate["g"]])))
    zh = wide("zh", *_product_range(rel("z", v["z_zp"]), rel("h", v["h_zp"])))
    if f is None or zh is None:
        return None
    parts["g_from_rrh_rsh"], parts["g_from_rrh_m"] = f
    v["zh_sh"], v["zh_m32"] = (int(x.reshape(-1)[0]) for x in zh)
    zg_range = _product_range((v["one_z"] - (v["z_hi"] - v["z_zp"]), v["one_z"] - (v["z_lo"] - v["z_zp"])),
                              rel("g", v["g_zp"]))
    f = shifts("zg", *zg_range)
    if f is None:
        return None
    v["zg_lsh"], v["zg_rsh"], v["zg_m32"] = (int(x.reshape(-1)[0]) for x in f)
    if v["hg"]:  # h -> h_gemm
        f = shifts("hg", *rel("h", v["h_zp"]))
        if f is None:
            return None
        v["hg_lsh"], v["hg_rsh"], v["hg_m32"] = (int(x.reshape(-1)[0]) for x in f)
    for name in ("Wx", "Rh"):  # the accumulators: as every x level's
        f = requant(name, False)
        if f is None:
            return None
        parts.update(f)
    return parts


# The fields of csrc Cell32's channel-blocked array, in the order of csrc/qgru_cell.h's
# Cell32Field; "{name}:{q}" is gate q's slice (channels q H .. q H + H - 1) of a [3H] tensor.
# lo_z and hi_z: a requantization's clamp range relative to its zero point (lo - Z, hi - Z).
# In multiplier form bias_hi holds the whole bias, bias_lo the left shift and rshift the right
# shift of a requantization (qgru_cell.h, AccRequant32); pow2 layers leave the "_m" and "_mult32"
# fields at 0.
CELL32_FIELDS = (
    "r_from_wx_lsh", "r_from_wx_rsh", "r_from_rh_lsh", "r_from_rh_rsh", "z_from_wx_lsh", "z_from_wx_rsh",
    "z_from_rh_lsh", "z_from_rh_rsh", "g_from_wx_lsh", "g_from_wx_rsh", "g_from_rrh_rsh",
    *(f"{acc}_{f}:{q}" for acc in ("Rh", "Wx") for q in range(3) for f in ("bias_hi", "bias_lo", "rshift", "lo_z")),
    *(f"{name}_m" for name in MULT_RESCALES), *(f"{acc}_mult32:{q}" for acc in ("Rh", "Wx") for q in range(3)),
    *(f"{acc}_hi_z:{q}" for acc in ("Rh", "Wx") for q in range(3)),
    "_pad",  # zeros (csrc kPad): a vector reads the last multiplier field one lane on
)
CELL32_BLOCK = 128  # csrc kCell32Block


def _channel_blocks(parts: Dict[str, torch.Tensor], H: int) -> torch.Tensor:
    """int32 [ceil(H / 128), len(CELL32_FIELDS), 128]: field f of channel j at [j // 128, f, j % 128]
    (the padding channels are 0; no kernel reads them)."""
    rows = []
    for name in CELL32_FIELDS:
        key, _, q = name.partition(":")
        x = parts[key] if key != "_pad" else torch.zeros(H, dtype=torch.int32, device=parts["Rh_lo_z"].device)
        rows.append(x[int(q) * H:(int(q) + 1) * H] if q else x)
    fields = torch.stack(rows)  # [F, H]
    blocks = -(-H // CELL32_BLOCK)
    padded = torch.zeros(len(CELL32_FIELDS), blocks * CELL32_BLOCK, dtype=torch.int32, device=fields.device)
    padded[:, :H] = fields
    return padded.reshape(len(CELL32_FIELDS), blocks, CELL32_BLOCK).permute(1, 0, 2).contiguous()
