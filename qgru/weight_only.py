"""Weight-only quantization (seed 003, issue 33): 2/4/8-bit packed, group-quantized GRU weights;
activations, biases and the gate arithmetic stay in floating point (float32, float16 or bfloat16).

This file is the floor of the weight-only mode: configs, quantization of one weight matrix
(nearest or GPTQ rounding), packing along the input dimension, dequantization, the golden forward
and the file format. The module (qgru/wo_module.py) and the kernels (qgru/wo_cpu.py,
qgru/wo_triton.py) sit on top of it; docs/weight_only.md describes the whole mode.

Storage of one matrix w [N, K] (N = 3H output rows in torch's [r | z | n] order, K the input
dimension) with ``bits`` b, ``group_size`` g (0: per channel, one group of all K inputs):

* ``codes``: int32 [ceil(K / p), N], p = 32 // b codes per word. Word ``[j, n]`` holds the codes
  of w[n, j*p + i] for i = 0 .. p-1, code i at bit offset b*i (unsigned, in [0, 2^b - 1]); codes
  past K are 0. Packing runs along the input dimension, so a kernel reading one word row j
  reads p consecutive inputs for every output row (the layout of seed 003's w248a16 kernel).
* ``scale``: float32 [G, N], G = ceil(K / g): one scale per group of g consecutive inputs of a row
  (the last group may be shorter).
* ``zp``: uint8 [G, N], the zero point of each group, in [0, 2^b - 1]; symmetric configs fix it
  at 2^(b-1) and keep codes in [2^(b-1) - (2^(b-1) - 1), 2^b - 1].

The dequantized weight is ``w[n, k] = float32(code - zp[k // g, n]) * scale[k // g, n]``: one
float32 product, exact in float64, so every consumer that dequantizes sees the same numbers.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .export import ParamsFileError, check_stored_tensors, checksum, read_archive

WO_BITS = (2, 4, 8)
WO_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WO_ROUNDINGS = ("nearest", "gptq")
# Built-in names: w{bits}g{group} (asymmetric, per group along the input), w{bits}pc (asymmetric,
# per output channel) and a trailing "s" for symmetric (e.g. w4g128s). Others of the same form
# parse too (group sizes: any multiple of the codes per word, 32 // bits).
BUILTIN_WO_CONFIGS = ("w8g128", "w8pc", "w4g128", "w4g64", "w4g32", "w4pc", "w2g64", "w2g32", "w4g128s")
_NAME = re.compile(r"w(2|4|8)(?:g([1-9][0-9]{0,5})|pc)(s?)\Z")


class WeightOnlyError(ValueError):
    """A weight-only config, module argument or file that is not what qgru writes or accepts."""


class WeightOnlyFileError(WeightOnlyError, ParamsFileError):
    """A weight-only file (or state_dict) that is unreadable, corrupted or has a field outside the
    format; the message names the file or key and the field. A qgru.ParamsFileError too: both file
    kinds are read by the one loader (qgru.export.read_archive) and refused alike."""


@dataclass(frozen=True)
class WeightOnlyConfig:
    """How a weight-only GRU stores W (weight_ih) and R (weight_hh)."""
    name: str
    bits: int = 4
    group_size: int = 128  # inputs per group along K; 0 = per output channel (one group per row)
    symmetric: bool = False
    weight_rounding: str = "gptq"  # "gptq" (uses calibration batches) or "nearest"
    dtype: str = "float32"  # activations, biases and gate arithmetic
    # each group's range searched among shrunk ranges for the least error of the row's products
    # (quantize_weight); false: the min/max range. None (the default): on at 4 bits only, where it
    # gained 1.9 dB on the demo; at 8 bits it cost 0.6 dB there (and w8g128's lead over w8a16 on the
    # synthetic GRU), at 2 bits -1.1 dB on the demo and +0.5 on the synthetic GRU (docs/weight_only.md)
    search: Optional[bool] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or len(self.name) > 200:
            raise WeightOnlyError("weight-only config: name must be a string of at most 200 characters")
        if self.bits not in WO_BITS:
            raise WeightOnlyError(f"weight-only config {self.name!r}: bits must be one of {WO_BITS}, got {self.bits!r}")
        per = 32 // self.bits
        if (not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 0
                or self.group_size % per or self.group_size > 1 << 20):
            raise WeightOnlyError(f"weight-only config {self.name!r}: group_size must be 0 (per channel) or a positive "
                                  f"multiple of {per} (codes per 32-bit word at {self.bits} bits), got {self.group_size!r}")
        if self.search is None and self.bits in WO_BITS:
            object.__setattr__(self, "search", self.bits == 4)
        if not isinstance(self.search, bool):
            raise WeightOnlyError(f"weight-only config {self.name!r}: search must be true or false")
        if not isinstance(self.symmetric, bool):
            raise WeightOnlyError(f"weight-only config {self.name!r}: symmetric must be true or false")
        if self.weight_rounding not in WO_ROUNDINGS:
            raise WeightOnlyError(f"weight-only config {self.name!r}: weight_rounding must be one of {WO_ROUNDINGS}, "
                                  f"got {self.weight_rounding!r}")
        if self.dtype not in WO_DTYPES:
            raise WeightOnlyError(f"weight-only config {self.name!r}: dtype must be one of {tuple(WO_DTYPES)}, "
                                  f"got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return WO_DTYPES[self.dtype]

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric,
                "weight_rounding": self.weight_rounding, "dtype": self.dtype, "search": self.search,
                "kind": "weight_only"}

    @classmethod
    def load(cls, config: Union[str, Mapping, "WeightOnlyConfig"], **overrides) -> "WeightOnlyConfig":
        """From a name (w4g128, w8pc, w4g128s ...), a dict (to_dict()'s keys) or a config; keyword
        overrides (e.g. dtype="float16", weight_rounding="nearest") replace fields."""
        if isinstance(config, WeightOnlyConfig):
            d = config.to_dict()
        elif isinstance(config, str):
            m = _NAME.match(config)
            if not m:
                raise WeightOnlyError(f"unknown weight-only config {config!r}: names are w{{2,4,8}}g{{group}} or "
                                      f"w{{2,4,8}}pc, optionally ending in 's' (symmetric); built in: "
                                      f"{', '.join(BUILTIN_WO_CONFIGS)}")
            d = {"name": config, "bits": int(m.group(1)), "group_size": int(m.group(2) or 0),
                 "symmetric": m.group(3) == "s"}
        elif isinstance(config, Mapping):
            d = dict(config)
        else:
            raise TypeError(f"weight-only config must be a name, a dict or a WeightOnlyConfig, got {type(config).__name__}")
        d.update(overrides)
        d.pop("kind", None)
        unknown = sorted(set(d) - {"name", "bits", "group_size", "symmetric", "weight_rounding", "dtype", "search"})
        if unknown:
            raise WeightOnlyError(f"weight-only config: unknown key(s) {', '.join(map(repr, unknown))}")
        d.setdefault("name", "custom")
        if isinstance(d.get("bits"), bool) or not isinstance(d.get("bits", 4), int):
            raise WeightOnlyError(f"weight-only config: bits must be an integer, got {d.get('bits')!r}")
        return cls(**d)


def is_weight_only(config) -> bool:
    """Whether ``config`` (as quantize_model takes it) names the weight-only mode."""
    if isinstance(config, WeightOnlyConfig):
        return True
    if isinstance(config, str):
        return _NAME.match(config) is not None
    if isinstance(config, Mapping):
        return config.get("kind") == "weight_only"
    return False


# ---------------------------------------------------------------------------------------------
# one quantized matrix
# ---------------------------------------------------------------------------------------------
@dataclass
class PackedWeight:
    """A weight matrix [N, K] as stored (module docstring): packed codes, group scales, zero points."""
    codes: torch.Tensor  # int32 [ceil(K / per), N]
    scale: torch.Tensor  # float32 [G, N]
    zp: torch.Tensor  # uint8 [G, N]
    bits: int
    group: int  # effective group size (K for per channel)
    K: int

    @property
    def N(self) -> int:
        return self.codes.shape[1]

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zp))

    def to(self, device) -> "PackedWeight":
        return PackedWeight(self.codes.to(device), self.scale.to(device), self.zp.to(device), self.bits,
                            self.group, self.K)


def groups_of(K: int, group_size: int) -> Tuple[int, int]:
    """(effective group size, number of groups) of K inputs."""
    g = K if group_size == 0 else group_size
    return g, max(1, -(-K // g)) if K else 0


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes q [N, K] (integers in [0, 2^bits - 1]) -> int32 words [ceil(K / per), N] (module docstring)."""
    per = 32 // bits
    N, K = q.shape
    q = q.to(torch.int64)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > (1 << bits) - 1):
        raise WeightOnlyError(f"pack_codes: codes must be in [0, {(1 << bits) - 1}]")
    pad = (-K) % per
    q = torch.nn.functional.pad(q, (0, pad)).reshape(N, -1, per)
    shifts = torch.arange(per, dtype=torch.int64, device=q.device) * bits
    words = (q << shifts).sum(-1)  # [N, J], each in [0, 2^32)
    words = torch.where(words >= (1 << 31), words - (1 << 32), words)
    return words.to(torch.int32).t().contiguous()


def unpack_codes(words: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    """Inverse of pack_codes: int32 words [J, N] -> codes [N, K] int64."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64, device=words.device) * bits
    u = (words.to(torch.int64).unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)  # [J, per, N]
    return u.reshape(-1, words.shape[1])[:K].t()


def dequantize(p: PackedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the file stores: float32(code - zp) * scale, per group."""
    per = 32 // p.bits
    shifts = torch.arange(per, dtype=torch.int32, device=p.codes.device) * p.bits
    # int32 arithmetic shifts: the sign bits they bring in are masked off
    q = ((p.codes.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << p.bits) - 1)).reshape(-1, p.N)[:p.K]  # [K, N]
    zp = p.zp.to(torch.int32).repeat_interleave(p.group, 0)[:p.K]
    scale = p.scale.repeat_interleave(p.group, 0)[:p.K]
    return ((q - zp).to(torch.float32) * scale).t().contiguous()


SEARCH_SHRINK = tuple(1.0 - 0.04 * i for i in range(13))  # range factors tried per group: 1.0 ... 0.52
SEARCH_RUNS = 4  # grids (per group: the best SEARCH_RUNS ranges by the group's own error) rounded in full
CD_SWEEPS = 4  # coordinate-descent passes over the codes after rounding (each only lowers the error)
DAMP = 0.001  # dampening: M + DAMP * mean(diag M) * I, the objective the rounding and search minimize
# (0.01, GPTQ's usual value, gave 38.4 dB instead of 39.8 on the demo's w4g128; docs/weight_only.md)


def _grid(lo: torch.Tensor, hi: torch.Tensor, bits: int, symmetric: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale float32, zp int64) of ranges [lo, hi] (lo <= 0 <= hi), any shape (module docstring)."""
    if symmetric:
        scale = torch.maximum(hi, -lo) / ((1 << (bits - 1)) - 1)
    else:
        scale = (hi - lo) / ((1 << bits) - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float32)
    if symmetric:
        zp = torch.full_like(scale, 1 << (bits - 1), dtype=torch.int64)
    else:
        zp = torch.round(-lo / scale.double()).clamp(0, (1 << bits) - 1).to(torch.int64)
    return scale, zp


def _ranges(w: torch.Tensor, group_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w padded to [N, G, g] float64, lo [N, G], hi [N, G]): each group's range widened to include 0."""
    N, K = w.shape
    g, G = groups_of(K, group_size)
    wp = torch.nn.functional.pad(w.detach().to(torch.float64), (0, G * g - K)).reshape(N, G, g)
    return wp, wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)  # padded zeros lie inside any range with 0


def _shrinks(symmetric: bool) -> List[Tuple[float, float]]:
    """(factor of lo, factor of hi) pairs searched; (1, 1) first. Symmetric grids have one range."""
    if symmetric:
        return [(a, a) for a in SEARCH_SHRINK]
    return [(a, b) for a in SEARCH_SHRINK for b in SEARCH_SHRINK]


def group_params(w: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale float32 [G, N], zp int64 [G, N]) of w [N, K] (float): each group's min/max grid.

    Asymmetric: the group's range widened to include 0, scale = (hi - lo) / (2^b - 1), zp =
    round(-lo / scale) (so 0 is exact). Symmetric: scale = max |w| / (2^(b-1) - 1), zp = 2^(b-1).
    An all-zero group gets scale 1."""
    _, lo, hi = _ranges(w, group_size)
    scale, zp = _grid(lo, hi, bits, symmetric)
    return scale.t().contiguous(), zp.t().contiguous()


def _code_range(bits: int, symmetric: bool) -> Tuple[int, int]:
    if symmetric:
        return 1 if bits > 1 else 0, (1 << bits) - 1
    return 0, (1 << bits) - 1


def damped(second_moment: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """M + DAMP * mean(diag M) * I in float64: what gptq rounding and the range search minimize
    (e M e^T per row, e the row's weight error); None where ``second_moment`` is None, not finite
    or has no positive diagonal."""
    if second_moment is None or not bool(torch.isfinite(second_moment).all()):
        return None
    M = second_moment.detach().double().clone()
    K = M.shape[0]
    mean_diag = float(M.diagonal().mean()) if K else 0.0
    if not mean_diag > 0:
        return None
    return M + DAMP * mean_diag * torch.eye(K, dtype=torch.float64, device=M.device)


def product_error(w: torch.Tensor, deq: torch.Tensor, M: Optional[torch.Tensor]) -> torch.Tensor:
    """Per row, e M e^T with e = deq - w (float64 [N]); M None: the identity (squared error)."""
    e = deq.double() - w.double()
    if M is None:
        return (e * e).sum(1)
    return ((e @ M.double()) * e).sum(1)


def _gptq(W: torch.Tensor, s_cols: torch.Tensor, z_cols: torch.Tensor, U: torch.Tensor, order: torch.Tensor,
          lo: int, hi: int) -> torch.Tensor:
    """GPTQ (OPTQ) codes of W [N, K] float64 on fixed grids (scale, zp per column, [N, K]): columns
    in ``order``; U the upper Cholesky factor of the inverse of the damped, permuted M."""
    W = W[:, order].clone()
    S, Z = s_cols[:, order], z_cols[:, order]
    Q = torch.empty_like(W)
    for j in range(W.shape[1]):
        Q[:, j] = torch.round(W[:, j] / S[:, j] + Z[:, j]).clamp(lo, hi)
        e = (W[:, j] - (Q[:, j] - Z[:, j]) * S[:, j]) / U[j, j]
        W[:, j + 1:] -= e.unsqueeze(1) * U[j, j + 1:].unsqueeze(0)
    q = torch.empty_like(Q)
    q[:, order] = Q
    return q


def _descend(w: torch.Tensor, q: torch.Tensor, s_cols: torch.Tensor, z_cols: torch.Tensor, M: torch.Tensor,
             lo: int, hi: int, sweeps: Optional[int] = None) -> torch.Tensor:
    """Coordinate descent on e M e^T (e = (q - z) s - w, per row) over the integer codes: each
    column in turn moves to its best code with the others fixed (the rounded minimum of a 1-D
    quadratic, clamped to the code range: never a higher error); ``sweeps`` passes at most."""
    q = q.clone()
    eM = (((q - z_cols) * s_cols - w) @ M)
    sweeps = CD_SWEEPS if sweeps is None else sweeps
    d = M.diagonal()
    for _ in range(sweeps):
        moved = False
        for j in range(w.shape[1]):
            s = s_cols[:, j]
            new = (q[:, j] + torch.round(-eM[:, j] / (s * d[j]))).clamp(lo, hi)
            delta = new - q[:, j]
            if bool((delta != 0).any()):
                moved = True
                q[:, j] = new
                eM += (delta * s).unsqueeze(1) * M[j].unsqueeze(0)
        if not moved:
            break
    return q


def quantize_weight(w: torch.Tensor, config: WeightOnlyConfig,
                    second_moment: Optional[torch.Tensor] = None) -> PackedWeight:
    """w [N, K] -> PackedWeight.

    Rounding: with ``second_moment`` M (E[v v^T] [K, K] of the operand the matrix multiplies) and
    ``config.weight_rounding == "gptq"``, GPTQ's column-by-column rounding (columns by decreasing
    M_jj, the grids fixed beforehand), then coordinate descent on the codes; both lower e M_d e^T,
    the expected squared error of the row's product w.v (M_d = M damped, ``damped``). Else nearest.

    Grids (``config.search``, the default): each group's range [lo, hi] shrunk by every pair of
    SEARCH_SHRINK factors (one factor for symmetric grids); per group the SEARCH_RUNS ranges with
    the least nearest-rounding error on the group's own block of M_d are kept; the matrix is
    rounded on each of those SEARCH_RUNS grids (the r-th best range of every group), on the
    min/max grid, and (to nearest) on the min/max grid again; each row keeps the grid and codes
    with the least e M_d e^T (float64). So a row's error is never above nearest rounding's on the
    min/max grid. Without search: the min/max grid (group_params)."""
    if w.dim() != 2 or not bool(torch.isfinite(w).all()):
        raise WeightOnlyError("quantize_weight: a finite 2-D weight matrix is needed")
    N, K = w.shape
    bits = config.bits
    g, G = groups_of(K, config.group_size)
    dev = w.device
    M = damped(second_moment.to(dev)) if second_moment is not None and config.weight_rounding == "gptq" else None
    lo, hi = _code_range(bits, config.symmetric)
    W = w.detach().double()
    idx = torch.arange(K, device=dev) // g
    wp, lo0, hi0 = _ranges(W, config.group_size)

    U = order = None
    if M is not None:
        order = torch.argsort(M.diagonal(), descending=True, stable=True)
        try:
            U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(M[order][:, order])), upper=True)
        except RuntimeError:
            U = None

    def cols(scale, zp):  # [N, G] -> per column [N, K], float64
        return scale.double()[:, idx], zp.double()[:, idx]

    def nearest(scale, zp):
        s, z = cols(scale, zp)
        return torch.round(W / s + z).clamp(lo, hi)

    def rounded(scale, zp):  # the config's rounding on one grid
        if U is None:
            return nearest(scale, zp)
        s, z = cols(scale, zp)
        return _descend(W, _gptq(W, s, z, U, order, lo, hi), s, z, M, lo, hi)

    scale0, zp0 = _grid(lo0, hi0, bits, config.symmetric)  # [N, G]
    grids = [(scale0, zp0)]
    if config.search:
        # per group, every shrunk range's nearest-rounding error on the group's block of M_d
        blocks = None
        if M is not None:
            Mp = torch.nn.functional.pad(M, (0, G * g - K, 0, G * g - K))
            blocks = torch.stack([Mp[i * g:(i + 1) * g, i * g:(i + 1) * g] for i in range(G)])  # [G, g, g]
        mask = torch.ones(G * g, dtype=torch.float64, device=dev)
        mask[K:] = 0
        mask = mask.reshape(G, g)
        cand_s, cand_z, cand_e = [], [], []
        for a, b in _shrinks(config.symmetric):
            s, z = _grid(lo0 * a, hi0 * b, bits, config.symmetric)
            sd, zd = s.double().unsqueeze(-1), z.double().unsqueeze(-1)
            e = ((torch.round(wp / sd + zd).clamp(lo, hi) - zd) * sd - wp) * mask  # [N, G, g]
            err = (e * e).sum(-1) if blocks is None else torch.einsum("ngi,gij,ngj->ng", e, blocks, e)
            cand_s.append(s)
            cand_z.append(z)
            cand_e.append(err)
        best = torch.argsort(torch.stack(cand_e), dim=0, stable=True)[:SEARCH_RUNS]  # [R, N, G]
        S, Z = torch.stack(cand_s), torch.stack(cand_z)
        for r in range(best.shape[0]):
            grids.append((S.gather(0, best[r:r + 1])[0], Z.gather(0, best[r:r + 1])[0]))
    out_s, out_z, out_q, out_e = None, None, None, None
    tries = [(s, z, rounded) for s, z in grids]
    if U is not None:
        tries.append((scale0, zp0, nearest))  # the bound the search promises
    for s, z, how in tries:
        q = how(s, z)
        sc, zc = cols(s, z)
        deq = (q - zc) * sc.float().double()
        err = product_error(W, deq, M)
        if out_e is None:
            out_s, out_z, out_q, out_e = s, z, q, err
        else:
            better = err < out_e
            out_e = torch.where(better, err, out_e)
            b1 = better.unsqueeze(1)
            out_s, out_z, out_q = torch.where(b1, s, out_s), torch.where(b1, z, out_z), torch.where(b1, q, out_q)
    return PackedWeight(pack_codes(out_q.to(torch.int64), bits), out_s.t().contiguous(), out_z.t().contiguous().to(torch.uint8),
                        bits, g, K)


# ---------------------------------------------------------------------------------------------
# the golden forward
# ---------------------------------------------------------------------------------------------
@dataclass
class WOLayer:
    """One layer and direction: W (weight_ih), R (weight_hh), float32 biases (or None)."""
    W: PackedWeight
    R: PackedWeight
    b_ih: Optional[torch.Tensor]
    b_hh: Optional[torch.Tensor]


def golden_forward(layers: Sequence[Sequence[WOLayer]], x: torch.Tensor, h0: Optional[torch.Tensor] = None,
                   lengths: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The definition of a weight-only GRU's forward, in float64: dequantize the stored weights
    (``dequantize``), round them, the biases and the input to the module's ``dtype`` (what its
    kernels read; each layer's input too), then the float GRU of torch.nn.GRU in float64 (the state
    between steps is not rounded).

    x [T, B, I] time-major, h0 [L * D, B, H] or None, lengths [B] (steps t >= lengths[b] of
    sequence b are padding: its state is not updated and its output is 0, as for a PackedSequence).
    Returns (output [T, B, D * H], h_n [L * D, B, H]), float64."""
    T, B, _ = x.shape
    D = len(layers[0])
    H = layers[0][0].R.K
    f64 = torch.float64
    dev = x.device

    def as_module(t):  # what the module's kernels read: the value in the module's dtype
        return t.to(dtype).to(f64)

    inp = x
    valid = torch.ones(T, B, 1, dtype=torch.bool, device=dev) if lengths is None else \
        (torch.arange(T, device=dev).unsqueeze(1) < lengths.to(dev).unsqueeze(0)).unsqueeze(-1)
    h_n = []
    for li, row in enumerate(layers):
        inp = as_module(inp)  # each layer reads its input in the module's dtype
        outs = []
        for d, p in enumerate(row):
            W, R = as_module(dequantize(p.W)), as_module(dequantize(p.R))
            b_ih = as_module(p.b_ih) if p.b_ih is not None else torch.zeros(3 * H, dtype=f64, device=dev)
            b_hh = as_module(p.b_hh) if p.b_hh is not None else torch.zeros(3 * H, dtype=f64, device=dev)
            h = torch.zeros(B, H, dtype=f64, device=dev) if h0 is None else as_module(h0[li * D + d])
            out = torch.zeros(T, B, H, dtype=f64, device=dev)
            for t in (range(T) if d == 0 else reversed(range(T))):
                gi = inp[t] @ W.t() + b_ih
                gh = h @ R.t() + b_hh
                r = torch.sigmoid(gi[:, :H] + gh[:, :H])
                z = torch.sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
                n = torch.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
                h_new = (1 - z) * n + z * h
                h = torch.where(valid[t], h_new, h)
                out[t] = torch.where(valid[t], h_new, torch.zeros_like(h_new))
            outs.append(out)
            h_n.append(h)
        inp = torch.cat(outs, -1)
    return inp, torch.stack(h_n)


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
FORMAT = "qgru-weight-only"
FORMAT_VERSION = 1
_DIRS = ("fwd", "rev")
_MAX_SIZE = 1 << 24  # input_size, hidden_size: far above any GRU, small enough that 3 * H * K fits int64
_MAX_LAYERS = 1024


def to_dict(meta: Dict[str, Any], layers: Sequence[Sequence[WOLayer]]) -> Dict[str, Any]:
    """The flat dict a weight-only file holds: ``meta`` (JSON), ``l{i}.{fwd|rev}.{W|R}.{codes|scale|zp}``,
    ``l{i}.{dir}.b_ih`` / ``b_hh`` and a ``checksum`` (qgru.export.checksum)."""
    out: Dict[str, Any] = {"meta": json.dumps({**meta, "format": FORMAT, "format_version": FORMAT_VERSION},
                                              sort_keys=True)}
    for li, row in enumerate(layers):
        for d, p in enumerate(row):
            pre = f"l{li}.{_DIRS[d]}."
            for name, w in (("W", p.W), ("R", p.R)):
                out[f"{pre}{name}.codes"] = w.codes.cpu()
                out[f"{pre}{name}.scale"] = w.scale.cpu()
                out[f"{pre}{name}.zp"] = w.zp.cpu()
            if p.b_ih is not None:
                out[pre + "b_ih"] = p.b_ih.detach().to(torch.float32).cpu()
                out[pre + "b_hh"] = p.b_hh.detach().to(torch.float32).cpu()
    out["checksum"] = checksum(out)
    return out


def save(path: Union[str, Path], meta: Dict[str, Any], layers: Sequence[Sequence[WOLayer]]) -> None:
    torch.save(to_dict(meta, layers), str(path))


def _fail(msg: str):
    raise WeightOnlyFileError(msg)


def _check_meta(meta: Any) -> Tuple[Dict[str, Any], WeightOnlyConfig]:
    if not isinstance(meta, dict):
        _fail("meta: not a JSON object")
    want = {"format", "format_version", "input_size", "hidden_size", "num_layers", "bias", "batch_first",
            "bidirectional", "config"}
    if set(meta) != want:
        _fail(f"meta: keys {sorted(meta)}; expected {sorted(want)}")
    if meta["format"] != FORMAT:
        _fail(f"meta.format: {meta['format']!r}, not a {FORMAT} file")
    if meta["format_version"] != FORMAT_VERSION or type(meta["format_version"]) is not int:
        _fail(f"meta.format_version: {meta['format_version']!r}; this qgru reads version {FORMAT_VERSION}")
    for k, hi in (("input_size", _MAX_SIZE), ("hidden_size", _MAX_SIZE), ("num_layers", _MAX_LAYERS)):
        v = meta[k]
        if type(v) is not int or not 1 <= v <= hi:
            _fail(f"meta.{k}: must be an integer in [1, {hi}], got {v!r}")
    for k in ("bias", "batch_first", "bidirectional"):
        if type(meta[k]) is not bool:
            _fail(f"meta.{k}: must be true or false, got {meta[k]!r}")
    if not isinstance(meta["config"], dict):
        _fail("meta.config: not a JSON object")
    try:
        cfg = WeightOnlyConfig.load(meta["config"])
    except (WeightOnlyError, TypeError) as e:
        _fail(f"meta.config: {e}")
    return meta, cfg


def from_dict(d: Any) -> Tuple[Dict[str, Any], WeightOnlyConfig, List[List[WOLayer]]]:
    """(meta, config, layers) of a dict to_dict() wrote, checked as untrusted input: the set of entries,
    the checksum, every dtype and shape against the meta data, code words (padding bits 0, symmetric
    codes in range), zero points, scales (finite, > 0) and biases (finite). WeightOnlyFileError else.
    Every tensor's storage is checked (qgru.export.check_stored_tensors) before the checksum reads it."""
    if not isinstance(d, dict):
        _fail(f"expected a dict of entries, got {type(d).__name__}")
    for k, v in d.items():
        if not isinstance(k, str):
            _fail(f"entry names are strings, got {k!r}")
        if not isinstance(v, torch.Tensor) and type(v) is not str:
            _fail(f"{k}: a {type(v).__name__}; weight-only files hold tensors and strings only")
    check_stored_tensors(d, (torch.int32, torch.uint8, torch.float32), WeightOnlyFileError, "weight-only files")
    if not isinstance(d.get("meta"), str) or not isinstance(d.get("checksum"), str):
        _fail("missing entry 'meta' or 'checksum': not a qgru weight-only file")
    if len(d["meta"]) > 1 << 16:
        _fail("meta: longer than 64 KiB")
    try:
        meta = json.loads(d["meta"])
    except ValueError as e:
        _fail(f"meta: not JSON ({e})")
    meta, cfg = _check_meta(meta)
    if d["checksum"] != checksum(d):
        _fail("checksum: does not match the entries (the file was changed after it was written)")
    I, H, L = meta["input_size"], meta["hidden_size"], meta["num_layers"]
    D = 2 if meta["bidirectional"] else 1
    names = {"meta", "checksum"}
    for li in range(L):
        for di in range(D):
            pre = f"l{li}.{_DIRS[di]}."
            names |= {f"{pre}{w}.{f}" for w in "WR" for f in ("codes", "scale", "zp")}
            if meta["bias"]:
                names |= {pre + "b_ih", pre + "b_hh"}
    if set(d) != names:  # checked before any layer is read: the counts match the meta data
        missing, extra = sorted(names - set(d)), sorted(set(d) - names)
        _fail(f"entries: missing {missing[:5]}, unexpected {extra[:5]} for the meta data's "
              f"{L} layer(s), {D} direction(s), bias={meta['bias']}")
    layers = []
    for li in range(L):
        row = []
        for di in range(D):
            pre = f"l{li}.{_DIRS[di]}."
            K = I if li == 0 else H * D
            W = _read_weight(d, pre + "W", cfg, 3 * H, K)
            R = _read_weight(d, pre + "R", cfg, 3 * H, H)
            b = [None, None]
            if meta["bias"]:
                for i, name in enumerate(("b_ih", "b_hh")):
                    b[i] = check_bias(d[pre + name], H, pre + name)
            row.append(WOLayer(W, R, b[0], b[1]))
        layers.append(row)
    return meta, cfg, layers


def _read_weight(d: Dict[str, Any], key: str, cfg: WeightOnlyConfig, N: int, K: int) -> PackedWeight:
    return check_weight(d[key + ".codes"], d[key + ".scale"], d[key + ".zp"], cfg, N, K, lambda f: f"{key}.{f}")


def check_weight(codes: Any, scale: Any, zp: Any, cfg: WeightOnlyConfig, N: int, K: int, name) -> PackedWeight:
    """One stored matrix [N, K] (codes, scale, zp) against the format (module docstring) under
    ``cfg``: dtypes and shapes, scales finite and > 0, zero points in range (symmetric: 2^(b-1)),
    padding codes 0, symmetric codes nonzero. ``name(field)`` names a field in the error (a
    file's key, or a state_dict's). The file loader and WeightOnlyGRU.load_state_dict call it."""
    bits = cfg.bits
    per = 32 // bits
    g, G = groups_of(K, cfg.group_size)
    J = -(-K // per)
    for field, t, dt, shape in (("codes", codes, torch.int32, (J, N)), ("scale", scale, torch.float32, (G, N)),
                                ("zp", zp, torch.uint8, (G, N))):
        if not isinstance(t, torch.Tensor) or t.dtype != dt or tuple(t.shape) != shape:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            _fail(f"{name(field)}: expected {dt} {list(shape)}, got {got}")
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        _fail(f"{name('scale')}: scales must be finite and > 0")
    if cfg.symmetric:
        if not bool((zp == (1 << (bits - 1))).all()):
            _fail(f"{name('zp')}: a symmetric config's zero points are {1 << (bits - 1)}")
    elif zp.numel() and int(zp.max()) > (1 << bits) - 1:
        _fail(f"{name('zp')}: zero points must be in [0, {(1 << bits) - 1}] at {bits} bits")
    tail = J * per - K
    if tail:  # the codes past K in the last word row are 0
        mask = -(1 << (bits * (per - tail)))  # the high bits, as a signed 64-bit value
        if bool(((codes[-1].to(torch.int64) & (mask & 0xFFFFFFFF)) != 0).any()):
            _fail(f"{name('codes')}: the padding codes past the input size {K} must be 0")
    if cfg.symmetric and bits > 1 and K:
        q = unpack_codes(codes, bits, K)
        if bool((q == 0).any()):
            _fail(f"{name('codes')}: a symmetric config's codes are in [1, {(1 << bits) - 1}]")
    return PackedWeight(codes, scale, zp, bits, g, K)


def check_bias(t: Any, H: int, name: str) -> torch.Tensor:
    """A stored bias (b_ih or b_hh): float32 [3H], finite."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (3 * H,):
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        _fail(f"{name}: expected float32 [{3 * H}], got {got}")
    if not bool(torch.isfinite(t).all()):
        _fail(f"{name}: not finite")
    return t


def load_file(path: Union[str, Path]) -> Tuple[Dict[str, Any], WeightOnlyConfig, List[List[WOLayer]]]:
    """Read a weight-only file as untrusted input with the parameter files' loader
    (qgru.export.read_archive: stored records within the file's size, CRCs, ``weights_only``
    unpickling), then from_dict(). WeightOnlyFileError names the file and the field."""
    path = Path(path)
    d = read_archive(path, str(path), WeightOnlyFileError, "qgru weight-only file")
    try:
        return from_dict(d)
    except WeightOnlyFileError as e:
        raise WeightOnlyFileError(f"{path}: {e}") from None


def weight_bytes(layers: Sequence[Sequence[WOLayer]]) -> int:
    """Bytes of the stored W and R (codes, scales, zero points), biases excluded."""
    return sum(p.W.nbytes() + p.R.nbytes() for row in layers for p in row)
