"""Quantization configs: which bit width, symmetry and granularity each tensor of the GRU gets.

A config is a small TOML file (configs/w8a8.toml, w8a16.toml, w16a16.toml ship with qgru) or a dict
of the same shape. Any tensor can be overridden::

    qgru.QuantConfig.load("w8a8", overrides={"tensors": {"h": {"bits": 16}}})

Each tensor takes ``bits``, ``symmetric``, ``granularity`` (+ ``group_size`` for per_group) and,
for calibrated activations, ``headroom``: the calibrated range is widened by that factor before
the grid is chosen. Wide (16-bit) tensors have resolution to spare, and widening them keeps
inference inputs beyond the calibration extremes from saturating; the shipped configs use
headroom 1.5 on every 16-bit activation and none on 8-bit ones, where resolution matters more.

Top-level ``weight_rounding`` ("gptq", the default, or "nearest") says how W and R are rounded
onto their grids at convert() (qgru.convert.gptq_round; docs/spec.md section 8). gptq keeps, per
layer and direction, a K x K float64 second moment of each GEMM operand (K: the input size I for
layer 0's x, H for h) and factors it at convert() in O(K^3) time. Top-level ``gptq_max_size``
(default 4096) caps K: the weights of a wider operand (a one-hot or bag-of-words input x) are
rounded to nearest, no moment collected, with a qgru.WeightRoundingWarning at calibration naming
the operand; the others keep gptq. Choose explicitly: ``weight_rounding = "nearest"`` (no
warning), or a ``gptq_max_size`` >= I for gptq on that W (~8 I^2 bytes during calibration, a few
times that and minutes at convert() for I of 16384; an allocation that fails raises
qgru.WeightRoundingMemoryError).

Unknown keys are errors, never ignored. The tensors (names as in docs/spec.md):

==========  ==========================================  =======================================
name        what it is                                  granularities allowed
==========  ==========================================  =======================================
x           layer input (GEMM operand)                  per_tensor (one grid for the GEMM)
h           hidden state (GEMM operand)                 per_tensor
W, R        weight_ih, weight_hh (symmetric, zp = 0)    per_tensor, per_group, per_channel
Wx, Rh      W.x + b_ih, R.h + b_hh, requantized         per_tensor, per_gate, per_channel
z_pre ...   gate pre-activations (table inputs)         per_tensor (one table per gate)
z, r, g     sigmoid / tanh outputs (grid fixed by the   (bits only)
            function's range)
h_gemm      optional: the R.h GEMM operand, h requan-   per_tensor
            tized each step onto a grid of its own
            (at most h's bits; calibrated on h's data)
==========  ==========================================  =======================================

Without h_gemm the R.h GEMM reads the state h itself. With it (the shipped w8a8: h 16 bits,
h_gemm 8) the state keeps 16 bits through every update while R.h stays an int8 x int8 GEMM, as
dynamic quantization keeps h in float and quantizes only the GEMM's operand. Remove it with
``overrides={"tensors": {"h_gemm": None}}`` (an 8-bit state read by R.h directly, w8a8 before
2026-11-25, is ``{"h": {"bits": 8, "headroom": 1.0}, "h_gemm": None}``). An h_gemm as wide as h
is allowed but only rounds h once more (qgru.compare then suggests removing it).
"""
from __future__ import annotations

import copy
import math
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

ACTIVATIONS = ("x", "h")
WEIGHTS = ("W", "R")
GEMM_OUTPUTS = ("Wx", "Rh")
PRE_ACTIVATIONS = ("z_pre", "r_pre", "g_pre")
GATE_OUTPUTS = ("z", "r", "g")
TENSOR_NAMES = ACTIVATIONS + WEIGHTS + GEMM_OUTPUTS + PRE_ACTIVATIONS + GATE_OUTPUTS
# Optional tensors: a config may leave them out (the model then has no such tensor).
# h_gemm: the R.h GEMM's operand, h requantized every step onto a narrower grid of its own, so that
# the state keeps its bits while the GEMM stays int8 x int8 (docs/spec.md, "The recurrent operand").
OPTIONAL_TENSORS = ("h_gemm",)

GRANULARITIES = {
    **{n: ("per_tensor",) for n in ACTIVATIONS + OPTIONAL_TENSORS + PRE_ACTIVATIONS + GATE_OUTPUTS},
    **{n: ("per_tensor", "per_group", "per_channel") for n in WEIGHTS},
    **{n: ("per_tensor", "per_gate", "per_channel") for n in GEMM_OUTPUTS},
}
SCALE_MODES = ("pow2", "multiplier")
OBSERVER_KINDS = ("mse", "percentile", "minmax", "ema", "ema_step")
WEIGHT_ROUNDINGS = ("gptq", "nearest")
# gptq rounds the weights of GEMM operands at most this wide (config gptq_max_size's default): a
# 4096-wide operand's second moment is 134 MB of float64, factored at convert() in a few seconds
GPTQ_MAX_SIZE = 4096
BUILTIN_CONFIGS = ("w8a8", "w8a16", "w16a16")
# the weight-only configs' names (qgru/weight_only/format.py: w4g128, w8pc, w4g128s ...), named in errors
_WEIGHT_ONLY_NAME = re.compile(r"w(2|4|8)(g[0-9]+|pc)s?\Z")


def _config_dir() -> Path:
    here = Path(__file__).resolve().parent
    for d in (here / "configs", here.parent / "configs"):  # installed wheel, then source checkout
        if d.is_dir():
            return d
    raise FileNotFoundError("qgru's configs/ folder is missing from this installation")


@dataclass(frozen=True)
class TensorSpec:
    """How one tensor is quantized."""
    bits: int
    symmetric: bool
    granularity: str = "per_tensor"
    group_size: int = 0  # channels per group, only for granularity "per_group"
    headroom: float = 1.0  # calibrated range is widened by this factor (activations only)
    # x only: the first layer quantizes each token (time step, batch row) on the first of a few
    # wider grids that holds it (x levels: qgru.golden.XLevels), so inputs beyond calibration
    # do not clip; False: one static grid (the C export's integer-only boundary takes either)
    dynamic: bool = False

    def to_dict(self) -> Dict[str, Any]:
        d = {"bits": self.bits, "symmetric": self.symmetric, "granularity": self.granularity}
        if self.granularity == "per_group":
            d["group_size"] = self.group_size
        if self.headroom != 1.0:
            d["headroom"] = self.headroom
        if self.dynamic:
            d["dynamic"] = True
        return d


@dataclass(frozen=True)
class ObserverSpec:
    """Which observer calibrates activations (weights always use exact per-channel min/max).

    Default ``mse``: the grid with the least expected squared error over a data-weighted histogram,
    the same however the data is cut into calls (qgru/observers.py says why)."""
    kind: str = "mse"
    momentum: float = 0.1  # ema, ema_step: weight of the newest batch (or time step, for ema_step)
    percentile: float = 99.99  # percentile: the share of values (%) kept inside the range on each side


@dataclass(frozen=True)
class QuantConfig:
    name: str
    scale_mode: str
    observer: ObserverSpec
    tensors: Mapping[str, TensorSpec] = field(default_factory=dict)
    # how W and R are rounded onto their grids at convert(): "gptq" (default) uses calibration's
    # E[x x^T], E[h h^T] to make the products' error small (qgru.convert.gptq_round); "nearest"
    # rounds each weight alone. The scales are the same (max |w| / qmax) either way.
    weight_rounding: str = "gptq"
    # gptq only: the widest operand (K features: x's I, h's H) whose K x K float64 moment calibration
    # collects; the weights of a wider one are rounded to nearest, with a WeightRoundingWarning
    gptq_max_size: int = GPTQ_MAX_SIZE

    def __getitem__(self, tensor: str) -> TensorSpec:
        return self.tensors[tensor]

    @property
    def h_gemm(self) -> Optional[TensorSpec]:
        """The R.h GEMM operand's spec, or None when the GEMM reads the state h itself."""
        return self.tensors.get("h_gemm")

    @property
    def power_of_two(self) -> bool:
        return self.scale_mode == "pow2"

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def load(cls, config: Union[str, Path, Mapping, "QuantConfig"] = "w8a8",
             overrides: Optional[Mapping] = None) -> "QuantConfig":
        """A config from a built-in name, a .toml path, a dict, or a QuantConfig; then overrides."""
        if isinstance(config, QuantConfig):
            base, name = config.to_dict(), config.name
        elif isinstance(config, Mapping):
            base, name = copy.deepcopy(dict(config)), str(config.get("name", "custom"))
        elif isinstance(config, (str, Path)):
            path = Path(config)
            if str(config) in BUILTIN_CONFIGS:
                path = _config_dir() / f"{config}.toml"
            elif path.suffix != ".toml" or not path.is_file():
                raise ValueError(f"unknown config {config!r}: use one of {', '.join(BUILTIN_CONFIGS)} "
                                 "or the path of a .toml file" + (
                                     " (weight-only configs such as w4g128 are qgru.WeightOnlyConfig: pass the "
                                     "name to qgru.quantize_model)" if _WEIGHT_ONLY_NAME.match(str(config)) else ""))
            with open(path, "rb") as f:
                base = tomllib.load(f)
            name = base.get("name", path.stem)
        else:
            raise TypeError(f"config must be a name, a path, a dict or a QuantConfig, got {type(config).__name__}")
        if overrides:
            had = set(base.get("tensors", {})) if isinstance(base.get("tensors"), Mapping) else set()
            base = _merge(base, overrides, "config")
            over_t = overrides.get("tensors") if isinstance(overrides.get("tensors"), Mapping) else {}
            for n, v in over_t.items():  # a tensor the config lacks, added by an override without its bits
                if n not in had and isinstance(v, Mapping) and "bits" not in v:
                    raise ValueError(f"config.tensors.{n}: config {name!r} has no {n}; an override that adds it "
                                     f"must give its bits (got {dict(v)!r})")
        return cls.from_dict(base, default_name=name)

    @classmethod
    def from_dict(cls, d: Mapping, default_name: str = "custom") -> "QuantConfig":
        _check_keys(d, {"name", "scale_mode", "observer", "tensors", "weight_rounding", "gptq_max_size"}, "config")
        scale_mode = d.get("scale_mode", "pow2")
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"config: scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
        obs = dict(d.get("observer", {}))
        _check_keys(obs, {"kind", "momentum", "percentile"}, "config.observer")
        for key in ("momentum", "percentile"):
            if key in obs and (isinstance(obs[key], bool) or not isinstance(obs[key], (int, float))):
                raise ValueError(f"config.observer: {key} must be a number, got {obs[key]!r}")
        observer = ObserverSpec(kind=obs.get("kind", "mse"), momentum=float(obs.get("momentum", 0.1)),
                                percentile=float(obs.get("percentile", 99.99)))
        if observer.kind not in OBSERVER_KINDS:
            raise ValueError(f"config.observer: kind must be one of {OBSERVER_KINDS}, got {observer.kind!r}")
        if not 0.0 < observer.momentum <= 1.0:
            raise ValueError(f"config.observer: momentum must be in (0, 1], got {observer.momentum}")
        if not 50.0 < observer.percentile <= 100.0:
            raise ValueError(f"config.observer: percentile must be in (50, 100], got {observer.percentile}")
        weight_rounding = d.get("weight_rounding", "gptq")
        if weight_rounding not in WEIGHT_ROUNDINGS:
            raise ValueError(f"config: weight_rounding must be one of {WEIGHT_ROUNDINGS}, got {weight_rounding!r}")
        gptq_max_size = d.get("gptq_max_size", GPTQ_MAX_SIZE)
        if isinstance(gptq_max_size, bool) or not isinstance(gptq_max_size, int) or gptq_max_size < 1:
            raise ValueError(f"config: gptq_max_size must be a positive integer (the widest GEMM operand whose "
                             f"weights gptq rounds), got {gptq_max_size!r}")
        raw = d.get("tensors", {})
        _check_keys(raw, set(TENSOR_NAMES + OPTIONAL_TENSORS), "config.tensors")
        # an optional tensor set to None (overrides={"tensors": {"h_gemm": None}}) is left out
        raw = {n: v for n, v in raw.items() if not (n in OPTIONAL_TENSORS and v is None)}
        missing = [n for n in TENSOR_NAMES if n not in raw]
        if missing:
            raise ValueError(f"config.tensors: missing {', '.join(missing)}")
        tensors = {n: _tensor_spec(n, raw[n]) for n in TENSOR_NAMES + OPTIONAL_TENSORS if n in raw}
        if "h_gemm" in tensors and tensors["h_gemm"].bits > tensors["h"].bits:
            raise ValueError(f"config.tensors.h_gemm: the R.h operand ({tensors['h_gemm'].bits} bits) is h "
                             f"requantized to fewer bits; it cannot have more than h ({tensors['h'].bits})")
        return cls(name=str(d.get("name", default_name)), scale_mode=scale_mode,
                   observer=observer, tensors=tensors, weight_rounding=weight_rounding,
                   gptq_max_size=gptq_max_size)

    def to_dict(self) -> Dict[str, Any]:
        d = {"name": self.name, "scale_mode": self.scale_mode, "weight_rounding": self.weight_rounding,
             "observer": {"kind": self.observer.kind, "momentum": self.observer.momentum,
                          "percentile": self.observer.percentile},
             "tensors": {n: ({"bits": s.bits} if n in GATE_OUTPUTS else s.to_dict())
                         for n, s in self.tensors.items()}}
        if self.gptq_max_size != GPTQ_MAX_SIZE:  # (only when set: the default's dict is as before)
            d["gptq_max_size"] = self.gptq_max_size
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _check_keys(d: Mapping, allowed: set, where: str) -> None:
    if not isinstance(d, Mapping):
        raise TypeError(f"{where} must be a table/dict, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(sorted(allowed))}")


def _merge(base: Mapping, over: Mapping, where: str) -> Dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(out[k], v, f"{where}.{k}")
        else:
            out[k] = v
    return out


def _tensor_spec(name: str, d: Mapping) -> TensorSpec:
    where = f"config.tensors.{name}"
    _check_keys(d, {"bits", "symmetric", "granularity", "group_size", "headroom", "dynamic"}, where)
    bits = d.get("bits")
    max_bits = 16
    if not isinstance(bits, int) or not 2 <= bits <= max_bits:
        raise ValueError(f"{where}: bits must be an integer in [2, {max_bits}], got {bits!r}")
    if name in PRE_ACTIVATIONS and bits < 4:
        raise ValueError(f"{where}: a table input needs at least 4 bits, got {bits}")
    granularity = d.get("granularity", "per_tensor")
    if granularity not in GRANULARITIES[name]:
        raise ValueError(f"{where}: granularity {granularity!r} is not supported for {name}; "
                         f"allowed: {', '.join(GRANULARITIES[name])}")
    if name in GATE_OUTPUTS:
        if "symmetric" in d:
            raise ValueError(f"{where}: the grid of a gate output is fixed by its function's range "
                             "(sigmoid [0, 1], tanh [-1, 1]); only 'bits' can be set")
        symmetric = name == "g"
    elif name in WEIGHTS:
        symmetric = d.get("symmetric", True)
        if symmetric is not True:
            raise ValueError(f"{where}: weights are symmetric (zero point 0) so that W.x needs no "
                             "weight zero-point term; symmetric must be true")
    else:
        symmetric = d.get("symmetric", False)
        if not isinstance(symmetric, bool):
            raise ValueError(f"{where}: symmetric must be true or false, got {symmetric!r}")
    group_size = d.get("group_size", 0)
    if granularity == "per_group":
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"{where}: per_group needs a positive integer group_size, got {group_size!r}")
    elif "group_size" in d:
        raise ValueError(f"{where}: group_size is only meaningful with granularity 'per_group'")
    headroom = d.get("headroom", 1.0)
    if "headroom" in d and name in WEIGHTS + GATE_OUTPUTS:
        raise ValueError(f"{where}: headroom applies to calibrated activations only, not to {name}")
    if not isinstance(headroom, (int, float)) or isinstance(headroom, bool) or not 1.0 <= headroom < math.inf:
        raise ValueError(f"{where}: headroom must be a number >= 1, got {headroom!r}")
    dynamic = d.get("dynamic", False)
    if "dynamic" in d and name not in ("x", "h_gemm"):
        raise ValueError(f"{where}: dynamic applies to the GEMM operands x and h_gemm only")
    if not isinstance(dynamic, bool):
        raise ValueError(f"{where}: dynamic must be true or false, got {dynamic!r}")
    return TensorSpec(bits=bits, symmetric=symmetric, granularity=granularity, group_size=group_size,
                      headroom=float(headroom), dynamic=dynamic)
