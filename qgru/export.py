"""Export of a converted QuantGRU: plain tensors and ints, saved without arbitrary pickling.

``QuantParams.to_dict()`` is a flat dict ``{key: tensor | int | str}``; keys are
``l{layer}.{fwd|rev}.{field}`` (e.g. ``l0.fwd.W``, ``l1.rev.rescale.Wx.multiplier``) plus
a ``meta`` entry (JSON) for the module's arguments and the config, and a ``checksum`` entry
(``sha256:`` of every other entry, see ``checksum()``). Integers are stored in the
narrowest type that holds them: weights int8 (int16 above 8 bits; below 8 bits packed several per
int32 word as ``W.packed`` / ``R.packed``, seed 003), biases, zero points, multipliers, shifts and
table entries int32, zero-point compensations int64; the only floats are the x and h scales (used
where floats enter and leave the model), the weight scales (for dequantized float weights) and, with
an h_gemm (the R.h GEMM's operand, qgru/config.py), its scale (that of the R.h bias).
``save()`` writes it with torch.save (a zip archive) and ``load_params()`` reads it back.

A file is untrusted input. ``load_params()`` reads it with ``read_archive()`` (the reader of every
qgru archive: compressed records refused before anything is inflated, record sizes bounded by the
archive's, CRCs verified, ``torch.load(weights_only=True)``, which refuses anything but tensors
and plain containers; a refused global is a ParamsFileError naming it),
verifies the checksum, and checks every field against docs/spec.md before anything runs: the set
of entries, dtypes and shapes, bit widths (those of the config in ``meta``), integer ranges,
zero points on their grids, multipliers and shifts within the bounds that keep the arithmetic exact,
table lengths and entries, scales, and the cached values that must agree with others
(``W_zp_comp = zp.x * rowsum(W)``). Anything else is a ``ParamsFileError`` (a ValueError) naming
the file and the field. ``format_version`` 2 added the checksum; version 1 files (without it)
still load, with every other check.

The optional tensor h_gemm adds its ``bits``, ``zp``, ``rescale`` (h -> h_gemm) and ``scale``
entries to every layer, exactly when ``meta.config`` has it; the R.h bias and ``R_zp_comp`` are then
on its grid. Files of configs without it are the same as before it existed.
"""
from __future__ import annotations

import hashlib
import json
import pickle
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple, Union

import torch

from .config import GATE_OUTPUTS, OPTIONAL_TENSORS, TENSOR_NAMES, QuantConfig
from .convert import X_LEVEL_EXPONENTS, X_LEVEL_EXPONENTS_POW2, _bits_of, operand_bounds, recurrent_operand
from .golden import LayerParams, Rescale, XLevels
from .primitives import INT8_GEMM_K_MAX, MAX_SHIFT, multiplier_bits, pack_int32, qrange, unpack_int32
from .tables import output_grid, table_geometry

FORMAT_VERSION = 2  # 2: a "checksum" entry; 1: the same without it
READABLE_VERSIONS = (1, 2)
_DIRS = ("fwd", "rev")
_META_KEYS = ("format_version", "input_size", "hidden_size", "num_layers", "bias", "batch_first",
              "bidirectional", "config")
_STORED_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.float64)
_ZP_NAMES = ("x", "h", "Wx", "Rh", "r_pre", "z_pre", "g_pre", "r", "z", "g")
_RESCALES = ("Wx", "Rh", "Wx_r", "Rh_r", "Wx_z", "Rh_z", "Wx_g", "rRh_g", "zh", "zg")
_SCALES = ("x", "h", "W", "R")
_GATES = ("r", "z", "g")
_X_LEVEL_PARTS = ("exponent", "scale", "lo", "hi", "b_x", "multiplier", "shift")
_F32_MAX = float(torch.finfo(torch.float32).max)
_LAYER_KEY = re.compile(r"l(0|[1-9][0-9]{0,8})\.(fwd|rev)\.(.+)\Z", re.S)


class ParamsFileError(ValueError):
    """A parameter file (or dict) that is not what QuantParams.save() writes: unreadable, corrupted,
    or with a field outside the spec. The message names the file and the field."""


@dataclass
class QuantParams:
    meta: Dict[str, Any]
    layers: List[List[LayerParams]]

    @classmethod
    def from_module(cls, m) -> "QuantParams":
        meta = {"format_version": FORMAT_VERSION, "input_size": m.input_size, "hidden_size": m.hidden_size,
                "num_layers": m.num_layers, "bias": m.bias, "batch_first": m.batch_first,
                "bidirectional": m.bidirectional, "config": m.qconfig.to_dict()}
        # copies: an in-place edit of what export() hands out must not reach the module, whose
        # native backends run their own copies while the reference backend would run the edit
        return cls(meta=meta, layers=[[p.clone() for p in row] for row in m._qparams])

    def to_dict(self) -> Dict[str, Union[torch.Tensor, int, str]]:
        meta = {**self.meta, "format_version": FORMAT_VERSION}  # what this qgru writes
        out: Dict[str, Union[torch.Tensor, int, str]] = {"meta": json.dumps(meta, sort_keys=True)}
        for li, row in enumerate(self.layers):
            for d, p in enumerate(row):
                pre = f"l{li}.{_DIRS[d]}."
                for f in fields(p):
                    v = getattr(p, f.name)
                    if f.name in ("W", "R"):
                        bits = p.bits[f.name]
                        if bits < 8:
                            out[f"{pre}{f.name}.packed"] = pack_int32(v, bits)
                        else:
                            out[pre + f.name] = v.to(torch.int8 if bits <= 8 else torch.int16)
                    elif f.name == "x_levels":
                        if v is not None:  # x levels (first layer, config x.dynamic)
                            for k in ("exponent", "scale", "lo", "hi", "b_x"):
                                out[f"{pre}x_levels.{k}"] = _narrow(getattr(v, k)) if k in ("exponent", "b_x") \
                                    else getattr(v, k)
                            out[f"{pre}x_levels.multiplier"] = v.rescale.multiplier.to(torch.int32)
                            out[f"{pre}x_levels.shift"] = v.rescale.shift.to(torch.int32)
                    elif isinstance(v, dict):
                        for k, x in v.items():
                            if isinstance(x, Rescale):
                                out[f"{pre}{f.name}.{k}.multiplier"] = x.multiplier.to(torch.int32)
                                out[f"{pre}{f.name}.{k}.shift"] = x.shift.to(torch.int32)
                            else:
                                out[f"{pre}{f.name}.{k}"] = _narrow(x)
                    else:
                        out[pre + f.name] = _narrow(v) if f.name in ("b_x", "b_h") else v
        out["checksum"] = checksum(out)
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "QuantParams":
        """The parameters of a dict written by to_dict() (or a file's contents), checked as untrusted
        input: raises ParamsFileError, naming the field, for anything outside the spec."""
        meta, cfg = _read_header(d)
        ndir = 2 if meta["bidirectional"] else 1
        _check_entries(d, meta, cfg, ndir)
        layers = [[_read_layer(d, f"l{li}.{_DIRS[di]}.", cfg) for di in range(ndir)]
                  for li in range(meta["num_layers"])]
        params = cls(meta=meta, layers=layers)
        params.validate()
        return params

    def validate(self) -> None:
        """Check every layer against the spec and the meta data (docs/spec.md; the module docstring
        lists what). Raises ParamsFileError naming the field; from_dict() and to_module() call it."""
        cfg = _check_meta(self.meta)
        meta = self.meta
        ndir = 2 if meta["bidirectional"] else 1
        if not isinstance(self.layers, (list, tuple)) or len(self.layers) != meta["num_layers"]:
            raise ParamsFileError(f"meta.num_layers is {meta['num_layers']}, but there are "
                                  f"{len(self.layers) if isinstance(self.layers, (list, tuple)) else 'no'} layers")
        for li, row in enumerate(self.layers):
            if not isinstance(row, (list, tuple)) or len(row) != ndir:
                raise ParamsFileError(f"l{li}: expected {ndir} direction(s) (meta.bidirectional is "
                                      f"{str(meta['bidirectional']).lower()})")
            for di, p in enumerate(row):
                expect_i = meta["input_size"] if li == 0 else meta["hidden_size"] * ndir
                _check_layer(p, f"l{li}.{_DIRS[di]}", cfg, meta, expect_i, ndir if li > 0 else 0)

    def save(self, path: Union[str, Path]) -> None:
        torch.save(self.to_dict(), str(path))

    def to_c(self, path: Union[str, Path], **kw):
        """Write one layer and direction as C99 (``path``.h and ``path``.c): see qgru.export_c.write_c
        (keywords: layer, direction, golden_steps, seed, prefix). Returns (header path, source path)."""
        # imported here: qgru.export_c imports this module at its top (QuantParams, load_params);
        # this is write_c's convenience forwarder (tests/test_layers.py ALLOWED_LAZY)
        from .export_c import write_c
        return write_c(self, path, **kw)

    def to_module(self):
        """A converted QuantGRU that runs these parameters (float weights are the dequantized ones).
        The parameters are validated first (validate()). Same as QuantGRU.from_params(self)."""
        # imported here: qgru.module (layer 4) imports this module (layer 2) at its top; the code is
        # QuantGRU.from_params, this is its convenience forwarder (tests/test_layers.py ALLOWED_LAZY)
        from .module import QuantGRU
        return QuantGRU.from_params(self)


def _narrow(v):
    """int64 tensors whose values fit in int32 are stored as int32 (floats and ints unchanged)."""
    if isinstance(v, torch.Tensor) and v.dtype == torch.int64 and \
            (v.numel() == 0 or (int(v.min()) >= -(1 << 31) and int(v.max()) < (1 << 31))):
        return v.to(torch.int32)
    return v


def load_params(path: Union[str, Path]) -> QuantParams:
    """Read a file written by QuantParams.save(), as untrusted input (read_archive: the zip records
    stored, their sizes within the file's and their CRCs verified, nothing but tensors and plain
    containers unpickled), then the checksum and every field (QuantParams.from_dict). A file that
    fails any of these raises ParamsFileError (a ValueError) naming the file and what is wrong (a
    pickle that names any other global too: it must not be loaded unsafely); a missing file,
    FileNotFoundError."""
    path = Path(path)
    d = read_archive(path, str(path))
    try:
        return QuantParams.from_dict(d)
    except ParamsFileError as e:
        raise ParamsFileError(f"{path}: {e}") from None


def read_archive_bytes(data: bytes, name: str) -> Any:
    """The contents of a torch.save archive held in memory (a converted QuantGRU's state_dict entry,
    see QuantGRU.get_extra_state), read as untrusted input the way load_params reads a file
    (read_archive). Raises ParamsFileError naming ``name``; the caller checks what it holds."""
    return read_archive(bytes(data), name, kind="qgru archive")


def read_archive(source: Union[str, Path, bytes], name: str, error: type = ParamsFileError,
                 kind: str = "qgru parameter file") -> Any:
    """The one reader of qgru's archives (parameter files, weight-only files, a converted module's
    _extra_state bytes), as untrusted input: check_archive first (nothing is inflated or read
    into memory beyond the stored bytes), then torch.load(weights_only=True) on the CPU. Every
    failure is ``error`` (ParamsFileError or a subclass) naming ``name``; a pickle naming a global
    that weights_only refuses (os.system, eval, any class) says which, and that the file must
    not be loaded with weights_only=False: for a hostile file that runs the attacker's code."""
    import io
    if isinstance(source, (bytes, bytearray)):
        f = io.BytesIO(source)
        check_archive(f, name, error)
        f.seek(0)
        target: Any = f
    else:
        with open(source, "rb") as fh:  # OSError as usual for a missing or unreadable file
            check_archive(fh, name, error)
        target = str(source)
    try:
        return torch.load(target, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise error(refused_pickle_message(name, e)) from None
    except Exception as e:  # noqa: BLE001 - whatever torch's reader trips over, the file is bad
        raise error(f"{name}: not a readable {kind} ({type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None


_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def refused_pickle_message(name: str, e: BaseException) -> str:
    """What read_archive says for a pickle that torch.load(weights_only=True) refused. torch's own
    message advises weights_only=False and allow-listing the global: for a hostile file both run
    its code, so that advice is not passed on; only the global (or torch's first line) is."""
    text = str(e)
    m = _GLOBAL.search(text)
    if m:
        what = f"global {m[1]}"
    else:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip() and "weights_only" not in ln
                      and "Weights only" not in ln and "torch.load" not in ln), "")
        what = f"content ({first[:200]})" if first else "content"
    return (f"{name}: refused: its pickle holds the {what}, which no qgru file holds (tensors, ints and strings "
            "only). This file must not be loaded unsafely: torch.load(weights_only=False), or allow-listing "
            "that global, would run whatever code the file names")


def check_archive(f, name: str, error: type = ParamsFileError) -> None:
    """torch.save writes a zip archive of stored (uncompressed) records, and its reader inflates a
    compressed record whole and does not check CRC-32s. This refuses, before any record is read:
    a compressed record (a few hundred KB can inflate to gigabytes), a record whose stored size
    differs from its size, and records whose sizes add up to more than the archive (records
    overlapping in the file); then it checks every record's CRC, reading in chunks."""
    import zipfile
    try:
        f.seek(0, 2)
        total = f.tell()
        f.seek(0)
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
            for i in infos:
                if i.compress_type != zipfile.ZIP_STORED:
                    raise error(f"{name}: record {i.filename!r} is compressed (zip method {i.compress_type}); "
                                "torch.save writes stored records only, and a compressed record is not inflated "
                                "(it may be a decompression bomb)")
                if i.file_size != i.compress_size:
                    raise error(f"{name}: record {i.filename!r} claims {i.file_size} bytes but stores "
                                f"{i.compress_size}")
            claimed = sum(i.file_size for i in infos)
            if claimed > total:
                raise error(f"{name}: its records claim {claimed} bytes in all, more than the archive's {total} "
                            "(records overlapping in the file)")
            bad = z.testzip()
    except error:
        raise
    except Exception as e:  # noqa: BLE001 - BadZipFile, EOFError, OSError, zlib.error, ...
        raise error(f"{name}: not a qgru parameter file: not a readable zip archive ({e}); the file "
                    "is truncated or damaged, or was not written by QuantParams.save()") from None
    if bad is not None:
        raise error(f"{name}: corrupted: record {bad!r} fails its CRC check (the file was damaged "
                    "after it was written)")


def check_stored_tensors(d: Dict[str, Any], dtypes: Sequence[torch.dtype], error: type = ParamsFileError,
                         what: str = "qgru files") -> None:
    """Each tensor of an untrusted dict of entries (a file's, a state_dict's) before anything reads
    its values: a dense tensor of one of ``dtypes``, not on the meta device, and with no more
    elements than its storage holds. A tensor's shape is a claim: torch.load accepts any shape
    whose strides stay inside the stored bytes, stride 0 included (one stored byte read as 10^9
    elements), and a checksum or dtype check makes a contiguous copy of it."""
    for k, v in d.items():
        if not isinstance(v, torch.Tensor):
            continue
        if v.layout != torch.strided or v.is_quantized or v.dtype not in dtypes:
            raise error(f"{k}: a {v.dtype} tensor ({v.layout}); {what} hold dense "
                        f"{', '.join(str(t).replace('torch.', '') for t in dtypes)} tensors only")
        if v.is_meta:
            raise error(f"{k}: a tensor on the meta device, which holds no values")
        if v.numel() * v.element_size() > v.untyped_storage().nbytes():
            raise error(f"{k}: shape {tuple(v.shape)} ({v.numel()} elements) over a storage of "
                        f"{v.untyped_storage().nbytes()} bytes (elements repeated by zero or "
                        "overlapping strides); qgru writes every element")


def checksum(d: Dict[str, Any]) -> str:
    """"sha256:" and the hex digest of every entry of a to_dict() dict but "checksum" itself: names,
    types, dtypes, shapes and the tensors' bytes (little-endian, as torch.save stores them)."""
    h = hashlib.sha256()
    for k in sorted(d):
        if k == "checksum":
            continue
        v = d[k]
        h.update(k.encode() + b"\0")
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().resolve_conj().resolve_neg().contiguous()
            h.update(f"tensor {t.dtype} {tuple(t.shape)}\0".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{type(v).__name__} {v!r}\0".encode())
    return "sha256:" + h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Validation (every error names its field as the flat key of to_dict(), e.g. l0.fwd.tables.r)
# ---------------------------------------------------------------------------------------------
def _listed(items: Sequence, n: int = 5) -> str:
    items = list(items)
    return ", ".join(map(str, items[:n])) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def _optional(cfg: QuantConfig) -> Tuple[str, ...]:
    """The optional tensors (config.OPTIONAL_TENSORS) that ``cfg`` has: each is in a layer's bits, zp,
    rescale and scale entries exactly when the config has it (and then after the others, as in
    convert.derive_layer_params)."""
    return tuple(n for n in OPTIONAL_TENSORS if n in cfg.tensors)


def _names(cfg: QuantConfig) -> Dict[str, Tuple[str, ...]]:
    """The keys of a layer's bits, zp, rescale (but the in_e ones) and scale dicts under ``cfg``."""
    opt = _optional(cfg)
    return {"bits": TENSOR_NAMES + opt, "zp": _ZP_NAMES + opt, "rescale": _RESCALES + opt, "scale": _SCALES + opt}


def _read_header(d) -> Tuple[Dict[str, Any], QuantConfig]:
    """The entries' types, the format version, the checksum and the meta data."""
    if not isinstance(d, dict):
        raise ParamsFileError(f"expected the dict of entries QuantParams.save() writes, got {type(d).__name__}")
    for k, v in d.items():
        if not isinstance(k, str):
            raise ParamsFileError(f"entry names are strings, got {k!r}")
        if not isinstance(v, torch.Tensor) and type(v) not in (int, str):
            raise ParamsFileError(f"{k}: a {type(v).__name__}; qgru files hold tensors, ints and strings only")
    check_stored_tensors(d, _STORED_DTYPES)
    if "meta" not in d:
        raise ParamsFileError("missing entry 'meta': not a qgru parameter file")
    if not isinstance(d["meta"], str):
        raise ParamsFileError(f"meta: expected a JSON string, got {type(d['meta']).__name__}")
    try:
        meta = json.loads(d["meta"])
    except ValueError as e:
        raise ParamsFileError(f"meta: not valid JSON ({e})") from None
    except RecursionError:  # arrays or objects nested thousands deep (qgru writes 4 levels)
        raise ParamsFileError("meta: JSON nested too deeply to read (qgru writes 4 levels)") from None
    if not isinstance(meta, dict):
        raise ParamsFileError(f"meta: expected a JSON object, got {type(meta).__name__}")
    version = meta.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise ParamsFileError(f"meta.format_version: unsupported qgru params format {version!r}; this qgru reads "
                              f"format(s) {', '.join(map(str, READABLE_VERSIONS))} (a newer qgru wrote it?)")
    if version >= 2:
        if "checksum" not in d:
            raise ParamsFileError("missing entry 'checksum' (a format 2 file carries the checksum of its parameters)")
        if d["checksum"] != checksum(d):
            raise ParamsFileError("checksum mismatch: the parameters are not the ones the file was written with "
                                  "(corrupted or edited)")
    elif "checksum" in d:
        raise ParamsFileError("unexpected entry 'checksum' in a format 1 file")
    return meta, _check_meta(meta)


def _check_meta(meta) -> QuantConfig:
    if not isinstance(meta, dict):
        raise ParamsFileError(f"meta: expected a dict, got {type(meta).__name__}")
    missing = [k for k in _META_KEYS if k not in meta]
    unknown = sorted(map(str, set(meta) - set(_META_KEYS)))
    if missing or unknown:
        raise ParamsFileError("meta: " + "; ".join(
            ([f"missing {_listed(missing)}"] if missing else []) + ([f"unknown key(s) {_listed(unknown)}"] if unknown else [])))
    for k in ("input_size", "hidden_size"):
        v = meta[k]
        if type(v) is not int or not 1 <= v < INT8_GEMM_K_MAX:
            raise ParamsFileError(f"meta.{k}: expected an integer in [1, {INT8_GEMM_K_MAX - 1}], got {v!r}")
    if type(meta["num_layers"]) is not int or meta["num_layers"] < 1:
        raise ParamsFileError(f"meta.num_layers: expected a positive integer, got {meta['num_layers']!r}")
    for k in ("bias", "batch_first", "bidirectional"):
        if type(meta[k]) is not bool:
            raise ParamsFileError(f"meta.{k}: expected true or false, got {meta[k]!r}")
    ndir = 2 if meta["bidirectional"] else 1
    if meta["num_layers"] > 1 and meta["hidden_size"] * ndir >= INT8_GEMM_K_MAX:
        raise ParamsFileError(f"meta.hidden_size: {meta['hidden_size']} x {ndir} direction(s), the input size of "
                              f"layers > 0, exceeds {INT8_GEMM_K_MAX - 1}")
    try:
        return QuantConfig.from_dict(meta["config"])
    except (ValueError, TypeError) as e:
        raise ParamsFileError(f"meta.{e}" if str(e).startswith("config") else f"meta.config: {e}") from None


def _layer_fields(cfg: QuantConfig, layer: int, ndir: int) -> set:
    """The entries (without the l{layer}.{dir}. prefix) of one layer and direction in to_dict()."""
    names = _names(cfg)
    f = {"input_size", "hidden_size", "one_z", "b_x", "b_h", "W_zp_comp", "R_zp_comp"}
    f |= {f"bits.{n}" for n in names["bits"]}
    f |= {w + ".packed" if cfg[w].bits < 8 else w for w in ("W", "R")}
    f |= {f"zp.{n}" for n in names["zp"]}
    rescales = list(names["rescale"]) + ([f"in_{e}" for e in range(ndir)] if layer > 0 else [])
    f |= {f"rescale.{n}.{part}" for n in rescales for part in ("multiplier", "shift")}
    f |= {f"tables.{g}" for g in _GATES}
    f |= {f"scale.{n}" for n in names["scale"]}
    if layer == 0 and cfg["x"].dynamic:  # x levels: the first layer's, exactly when meta.config has x.dynamic
        f |= {f"x_levels.{k}" for k in _X_LEVEL_PARTS}
    return f


def _check_entries(d: Dict[str, Any], meta: Dict[str, Any], cfg: QuantConfig, ndir: int) -> None:
    """Exactly the entries of meta's layers and directions: none missing, none extra."""
    found: Dict[Tuple[int, int], set] = {}
    for k in d:
        if k in ("meta", "checksum"):
            continue
        m = _LAYER_KEY.match(k)
        if not m:
            raise ParamsFileError(f"unexpected entry {k!r}")
        found.setdefault((int(m[1]), _DIRS.index(m[2])), set()).add(m[3])
    # num_layers is a claim: compared with the layers the entries hold before anything is made per
    # claimed layer (a count of 10^9 with resigned checksums once built a list of 10^9 indices)
    n = meta["num_layers"]
    layers = sorted({li for li, _ in found})
    if len(layers) != n or (layers and layers[-1] != n - 1):
        raise ParamsFileError(f"meta.num_layers is {n}, but the file holds the parameters of "
                              f"{len(layers)} layer(s) ({_listed(layers) or 'none'})")
    dirs = {di for _, di in found}
    if not dirs <= set(range(ndir)):
        raise ParamsFileError("meta.bidirectional is false, but the file holds reverse-direction parameters")
    for li in range(n):
        for di in range(ndir):
            pre = f"l{li}.{_DIRS[di]}."
            want, have = _layer_fields(cfg, li, ndir), found.get((li, di), set())
            if want - have:
                raise ParamsFileError(f"missing entr{'y' if len(want - have) == 1 else 'ies'} "
                                      f"{_listed(sorted(pre + k for k in want - have))}")
            if have - want:
                raise ParamsFileError(f"unexpected entr{'y' if len(have - want) == 1 else 'ies'} "
                                      f"{_listed(sorted(pre + k for k in have - want))}")


def _read_layer(d: Dict[str, Any], pre: str, cfg: QuantConfig) -> LayerParams:
    """One layer and direction from its entries (types and storage dtypes checked; values by _check_layer)."""
    def tensor(field: str, dtype: torch.dtype) -> torch.Tensor:
        v = d[pre + field]
        if not isinstance(v, torch.Tensor) or v.dtype != dtype:
            what = v.dtype if isinstance(v, torch.Tensor) else type(v).__name__
            raise ParamsFileError(f"{pre}{field}: expected a {dtype} tensor, got {what}")
        # the golden model's working types, always a copy: the parameters own their tensors (the
        # caller's dict, a state_dict, may be edited in place afterwards)
        return v.to(torch.int64, copy=True) if dtype != torch.float64 else v.detach().clone()

    def integer(field: str) -> int:
        v = d[pre + field]
        if type(v) is not int:
            raise ParamsFileError(f"{pre}{field}: expected an int, got {type(v).__name__}")
        return v

    names = _names(cfg)  # _check_entries: exactly these entries, h_gemm's only when cfg has it
    bits = {n: integer(f"bits.{n}") for n in names["bits"]}
    for n in names["bits"]:
        if bits[n] != cfg[n].bits:
            raise ParamsFileError(f"{pre}bits.{n}: {bits[n]}, but meta.config.tensors.{n}.bits is {cfg[n].bits}")
    kw: Dict[str, Any] = {"input_size": integer("input_size"), "hidden_size": integer("hidden_size"), "bits": bits}
    for w in ("W", "R"):
        b = bits[w]
        if b >= 8:
            kw[w] = tensor(w, torch.int8 if b == 8 else torch.int16)
            continue
        words = d[pre + w + ".packed"]
        if not isinstance(words, torch.Tensor) or words.dtype != torch.int32 or words.dim() != 2:
            raise ParamsFileError(f"{pre}{w}.packed: expected a 2-D torch.int32 tensor of packed {b}-bit weights")
        length = kw["input_size" if w == "W" else "hidden_size"]
        if not 1 <= length < INT8_GEMM_K_MAX or words.shape[1] != -(-length // (32 // b)):
            raise ParamsFileError(f"{pre}{w}.packed: {words.shape[1]} words per row cannot hold {length} "
                                  f"{b}-bit weights")
        kw[w] = unpack_int32(words, b, length)
    for f in ("b_x", "b_h"):
        kw[f] = tensor(f, torch.int32)
    for f in ("W_zp_comp", "R_zp_comp"):
        kw[f] = tensor(f, torch.int64)
    kw["zp"] = {n: tensor(f"zp.{n}", torch.int32) for n in names["zp"]}
    present = {k[len(pre + "rescale."):].rsplit(".", 1)[0] for k in d if k.startswith(pre + "rescale.")}
    rescales = [n for n in names["rescale"] + ("in_0", "in_1") if n in present]  # convert()'s order (_check_entries: no other)
    kw["rescale"] = {n: Rescale(tensor(f"rescale.{n}.multiplier", torch.int32), tensor(f"rescale.{n}.shift", torch.int32))
                     for n in rescales}
    kw["tables"] = {g: tensor(f"tables.{g}", torch.int32) for g in _GATES}
    kw["one_z"] = integer("one_z")
    kw["scale"] = {n: tensor(f"scale.{n}", torch.float64) for n in names["scale"]}
    if pre + "x_levels.exponent" in d:  # _check_entries: exactly in layer 0 with meta.config x.dynamic
        kw["x_levels"] = XLevels(
            exponent=tensor("x_levels.exponent", torch.int32), scale=tensor("x_levels.scale", torch.float64),
            lo=tensor("x_levels.lo", torch.float64), hi=tensor("x_levels.hi", torch.float64),
            b_x=tensor("x_levels.b_x", torch.int32),
            rescale=Rescale(tensor("x_levels.multiplier", torch.int32), tensor("x_levels.shift", torch.int32)))
    return LayerParams(**kw)


def _check_layer(p: LayerParams, where: str, cfg: QuantConfig, meta: Dict[str, Any], input_size: int,
                 n_prev: int) -> None:
    """One layer and direction against the spec (docs/spec.md sections 2-7) and the meta data.
    ``n_prev``: directions of the previous layer (0 for layer 0)."""
    def fail(field: str, msg: str):
        raise ParamsFileError(f"{where}.{field}: {msg}")

    def tensor(field: str, v, shapes: Sequence[Tuple[int, ...]], dtype=torch.int64) -> torch.Tensor:
        if not isinstance(v, torch.Tensor) or v.dtype != dtype:
            fail(field, f"expected a {dtype} tensor, got {v.dtype if isinstance(v, torch.Tensor) else type(v).__name__}")
        if v.is_meta:
            fail(field, "a tensor on the meta device, which holds no values")
        if tuple(v.shape) not in [tuple(s) for s in shapes]:
            fail(field, f"expected shape {' or '.join(str(tuple(s)) for s in shapes)}, got {tuple(v.shape)}")
        return v

    def in_range(field: str, v: torch.Tensor, lo: int, hi: int, why: str) -> None:
        if v.numel() == 0:
            return
        v_min, v_max = torch.aminmax(v)
        if int(v_min) >= lo and int(v_max) <= hi:
            return
        bad = (v < lo) | (v > hi)
        fail(field, f"{int(v[bad].reshape(-1)[0])} is outside [{lo}, {hi}] ({why})")

    def keys(field: str, d, want) -> None:
        if not isinstance(d, dict) or set(d) != set(want):
            have = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
            fail(field, f"expected the entries {', '.join(want)}, got {have}")

    if not isinstance(p, LayerParams):
        raise ParamsFileError(f"{where}: expected LayerParams, got {type(p).__name__}")
    H = meta["hidden_size"]
    H3 = 3 * H
    for field, want in (("input_size", input_size), ("hidden_size", H)):
        if type(getattr(p, field)) is not int or getattr(p, field) != want:
            fail(field, f"{getattr(p, field)!r}, but the meta data make it {want}")
    names = _names(cfg)  # h_gemm's entries exactly when meta.config has it
    keys("bits", p.bits, names["bits"])
    bits = p.bits
    for n in names["bits"]:
        if bits[n] != cfg[n].bits or type(bits[n]) is not int:
            fail(f"bits.{n}", f"{bits[n]!r}, but meta.config.tensors.{n}.bits is {cfg[n].bits}")
    pow2 = cfg.power_of_two
    for name, w, k in (("W", p.W, input_size), ("R", p.R, H)):
        tensor(name, w, [(H3, k)])
        in_range(name, w, *qrange(bits[name]), f"{bits[name]}-bit weights")
    for name in ("b_x", "b_h"):
        b = tensor(name, getattr(p, name), [(H3,)])
        in_range(name, b, *qrange(32), "32-bit biases")
        if not meta["bias"] and bool(b.any()):
            fail(name, "nonzero, but meta.bias is false")
    keys("zp", p.zp, names["zp"])
    for n in names["zp"]:
        per_channel = n in ("Wx", "Rh") and cfg[n].granularity != "per_tensor"
        z = tensor(f"zp.{n}", p.zp[n], [(H3,)] if per_channel else [()])
        lo, hi = qrange(bits[n])
        if n in GATE_OUTPUTS:  # fixed by the function's range (spec section 4)
            want = 0 if n == "g" else lo
            if int(z) != want:
                fail(f"zp.{n}", f"{int(z)}, but the {'tanh' if n == 'g' else 'sigmoid'} output grid of "
                                f"{bits[n]} bits has zero point {want}")
        elif cfg[n].symmetric and bool(z.any()):
            fail(f"zp.{n}", f"{int(z[z != 0].reshape(-1)[0])}, but {n} is symmetric (meta.config): zero point 0")
        else:
            in_range(f"zp.{n}", z, lo, hi, f"zero points lie on {n}'s {bits[n]}-bit grid")
    op = recurrent_operand(bits)  # R.h reads h, or h_gemm: R_zp_comp is on the operand's grid
    for name, w, zn in (("W_zp_comp", p.W, "x"), ("R_zp_comp", p.R, op)):
        c = tensor(name, getattr(p, name), [(H3,)])
        if not torch.equal(c, p.zp[zn] * w.sum(1)):
            fail(name, f"differs from zp.{zn} * rowsum({name[0]}), the value it caches")
    bound = operand_bounds(bits, input_size, H)
    rescales = list(names["rescale"]) + [f"in_{e}" for e in range(n_prev)]
    keys("rescale", p.rescale, rescales)
    for n in rescales:
        r = p.rescale[n]
        if not isinstance(r, Rescale):
            fail(f"rescale.{n}", f"expected a Rescale, got {type(r).__name__}")
        # per tensor: zh, zg (S_z, S_g, S_h), in_e, h_gemm (S_h / S_h_gemm); the gates' per unit
        size = {"Wx": H3, "Rh": H3, "zh": 1, "zg": 1, "h_gemm": 1}.get(n, 1 if n.startswith("in_") else H)
        m = tensor(f"rescale.{n}.multiplier", r.multiplier, [(), (size,)])  # per tensor or per channel
        tensor(f"rescale.{n}.shift", r.shift, [tuple(m.shape)])
        operand = _bits_of(bound["in" if n.startswith("in_") else n])
        mb = multiplier_bits(operand)
        in_range(f"rescale.{n}.multiplier", m, 0, (1 << mb) - 1,
                 f"its operand needs up to {operand} bits, which leaves {mb} multiplier bits in int64")
        in_range(f"rescale.{n}.shift", r.shift, 1, MAX_SHIFT, "shifts are kept in [1, 62]")
        if pow2 and bool((m & (m - 1)).any()):
            fail(f"rescale.{n}.multiplier", f"{int(m[(m & (m - 1)) != 0].reshape(-1)[0])} is not a power of two "
                                            "(meta.config.scale_mode is pow2)")
    keys("tables", p.tables, _GATES)
    for g in _GATES:
        b_in = bits[f"{g}_pre"]
        k, frac = table_geometry(b_in)
        t = tensor(f"tables.{g}", p.tables[g], [((1 << (b_in - k)) + 1,)])
        lim = 1 << (frac + bits[g])
        in_range(f"tables.{g}", t, -lim, lim, f"a {'tanh' if g == 'g' else 'sigmoid'} table of {bits[g]}-bit "
                                               f"outputs with {frac} fraction bits")
    one = output_grid("sigmoid", bits["z"], pow2).one
    if type(p.one_z) is not int or p.one_z != one:
        fail("one_z", f"{p.one_z!r}, but 1.0 on z's {bits['z']}-bit grid is {one}")
    keys("scale", p.scale, names["scale"])
    for n in names["scale"]:
        s = tensor(f"scale.{n}", p.scale[n], [(H3,) if n in ("W", "R") else ()], torch.float64)
        if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
            fail(f"scale.{n}", "scales are positive and finite")
        # the calibrated grids (x, h and h_gemm, which is h's data on fewer bits): choose_qparams makes
        # >= 1e-8 / (2^16 - 1) from any range; below 2^-64, dequantized values (and the b_hh read back
        # at S_R S_h_gemm) leave float32's normal range
        if n not in ("W", "R") and not 2.0 ** -64 <= float(s):
            fail(f"scale.{n}", f"{float(s)!r} is below 2^-64, the smallest scale calibration can make")
        if n not in ("W", "R"):
            # every value of the grid must be a float32: the outputs and h_n are (q - zp) S rounded
            # to float32, and a grid end beyond float32's largest value makes them +-inf (S_h = 2^127
            # made every output inf). Calibrated from float32 data a grid spans that data's range.
            lo, hi = qrange(bits[n])
            z = int(p.zp[n])
            end = max(hi - z, z - lo) * float(s)
            if not end <= _F32_MAX:
                fail(f"scale.{n}", f"{float(s)!r}: the grid's end value ({max(hi - z, z - lo)} steps from its zero "
                                   f"point {z}) is {end:.4g}, beyond float32's largest value {_F32_MAX:.4g}: its "
                                   "values would dequantize to +-inf (x and h grids lie in float32's range)")
        if pow2 and not bool((torch.frexp(s).mantissa == 0.5).all()):
            fail(f"scale.{n}", "not a power of two (meta.config.scale_mode is pow2)")
    _check_x_levels(p, fail, tensor, in_range, cfg, meta, n_prev == 0, bound["Wx"])


def _check_x_levels(p: LayerParams, fail, tensor, in_range, cfg: QuantConfig, meta: Dict[str, Any], first: bool,
                    wx_bound: int) -> None:
    """The x levels (docs/spec.md section 4b) against the layer's own x grid, b_x and rescale.Wx: exactly
    in the first layer when meta.config has x.dynamic; exponents as convert makes them (ascending from
    0, in [0, 12], whole octaves in pow2); every scale S_x 2^(e/4) and range end exactly as convert
    computes them; biases, multipliers and shifts within rescale.Wx's bounds; level 0 equal to the
    static b_x and rescale.Wx (tokens within calibration give the integers of a layer without levels)."""
    lv = p.x_levels
    want = first and cfg["x"].dynamic
    if lv is None:
        if want:
            fail("x_levels", "missing: meta.config has x.dynamic, so the first layer quantizes x on levels")
        return
    if not want:
        fail("x_levels", "present, but only the first layer of a config with x.dynamic has x levels"
             + ("" if first else " (this layer's x is the previous layer's state)"))
    if not isinstance(lv, XLevels):
        fail("x_levels", f"expected XLevels, got {type(lv).__name__}")
    allowed = X_LEVEL_EXPONENTS_POW2 if cfg.power_of_two else X_LEVEL_EXPONENTS
    e = lv.exponent
    if not isinstance(e, torch.Tensor) or e.dtype != torch.int64 or e.dim() != 1:
        fail("x_levels.exponent", "expected a 1-D torch.int64 tensor")
    for k in ("scale", "lo", "hi", "b_x"):  # before any is read (the exponents are, next)
        if isinstance(getattr(lv, k), torch.Tensor) and getattr(lv, k).is_meta:
            fail(f"x_levels.{k}", "a tensor on the meta device, which holds no values")
    if e.is_meta:
        fail("x_levels.exponent", "a tensor on the meta device, which holds no values")
    J = e.numel()
    if not 1 <= J <= len(X_LEVEL_EXPONENTS):
        fail("x_levels.exponent", f"{J} levels; a layer has 1 to {len(X_LEVEL_EXPONENTS)}")
    exps = [int(v) for v in e]
    if exps != list(allowed[:J]):
        fail("x_levels.exponent", f"{_listed(exps, 13)}, but convert makes {_listed(allowed[:J], 13)} "
                                  f"(ascending from 0{', whole octaves: meta.config.scale_mode is pow2' if cfg.power_of_two else ''})")
    H3 = 3 * p.hidden_size
    S_x = p.scale["x"]
    scale = tensor("x_levels.scale", lv.scale, [(J,)], torch.float64)
    # as convert computes them: S_x * 2^(e/4) (a float64 product), the ends (q_min/max - Z_x) * scale
    want_scale = S_x * torch.tensor([2.0 ** (v / 4) for v in exps], dtype=torch.float64, device=S_x.device)
    if not torch.equal(scale, want_scale):
        k = int((scale != want_scale).nonzero()[0, 0])
        fail("x_levels.scale", f"level {k}: {float(scale[k])!r}, but scale.x * 2^({exps[k]}/4) is "
                               f"{float(want_scale[k])!r}")
    lo_q, hi_q = qrange(p.bits["x"])
    zx = int(p.zp["x"])
    inf = torch.full((J,), float("inf"), dtype=torch.float64, device=S_x.device)
    for name, v, end in (("lo", lv.lo, lo_q), ("hi", lv.hi, hi_q)):
        v = tensor(f"x_levels.{name}", v, [(J,)], torch.float64)
        w = (inf if end == hi_q else -inf) if zx == end else (end - zx) * want_scale
        if not torch.equal(v, w):
            k = int((v != w).nonzero()[0, 0])
            fail(f"x_levels.{name}", f"level {k}: {float(v[k])!r}, but x's {p.bits['x']}-bit grid (zero point {zx}) "
                                     f"at that level's scale makes it {float(w[k])!r}")
    b = tensor("x_levels.b_x", lv.b_x, [(J, H3)])
    in_range("x_levels.b_x", b, *qrange(32), "32-bit biases")
    if not meta["bias"] and bool(b.any()):
        fail("x_levels.b_x", "nonzero, but meta.bias is false")
    if not torch.equal(b[0], p.b_x):
        fail("x_levels.b_x", "level 0 differs from b_x (level 0 is the static grid)")
    if not isinstance(lv.rescale, Rescale):
        fail("x_levels", f"expected a Rescale in rescale, got {type(lv.rescale).__name__}")
    m = tensor("x_levels.multiplier", lv.rescale.multiplier, [(J, H3)])
    sh = tensor("x_levels.shift", lv.rescale.shift, [(J, H3)])
    operand = _bits_of(wx_bound)
    mb = multiplier_bits(operand)
    in_range("x_levels.multiplier", m, 0, (1 << mb) - 1,
             f"W.x's operand needs up to {operand} bits, which leaves {mb} multiplier bits in int64")
    in_range("x_levels.shift", sh, 1, MAX_SHIFT, "shifts are kept in [1, 62]")
    if cfg.power_of_two and bool((m & (m - 1)).any()):
        fail("x_levels.multiplier", f"{int(m[(m & (m - 1)) != 0].reshape(-1)[0])} is not a power of two "
                                    "(meta.config.scale_mode is pow2)")
    static = p.rescale["Wx"]
    if not (torch.equal(m[0], static.multiplier.expand(H3)) and torch.equal(sh[0], static.shift.expand(H3))):
        fail("x_levels.multiplier", "level 0 differs from rescale.Wx (level 0 is the static grid)")
