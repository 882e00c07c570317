"""Weight-only quantization (seed 003): 2/4/8-bit packed, group-quantized GRU weights;
activations, biases and the gate arithmetic stay in floating point (float32, float16 or bfloat16).

This file is the floor of the weight-only mode (the package qgru/weight_only/): configs, the
storage of one matrix (packing along the input dimension, dequantization) and the file format,
read with qgru.export's loader and checks shared with the parameter files. Beside it:
quantize.py (grids and codes of one matrix), golden.py (the golden forward); above it cpu.py and
triton_kernels.py (the kernels) and module.py (WeightOnlyGRU). docs/weight_only.md describes the
whole mode.

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

from ..export import ParamsFileError, check_stored_tensors, checksum, read_archive

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


# ---------------------------------------------------------------------------------------------
# one layer's stored parameters
# ---------------------------------------------------------------------------------------------
@dataclass
class WOLayer:
    """One layer and direction: W (weight_ih), R (weight_hh), float32 biases (or None)."""
    W: PackedWeight
    R: PackedWeight
    b_ih: Optional[torch.Tensor]
    b_hh: Optional[torch.Tensor]


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
