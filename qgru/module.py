"""QuantGRU: a drop-in torch.nn.GRU that calibrates, converts and runs integer-only inference.

Four modes, one module:
  float       (default)  forward is torch.nn.GRU's own (same parameters, same kernels, autograd)
  calibrating (inside qgru.calibrate) the step-by-step float reference runs with observers on
  qat         (start_qat, qgru.prepare_qat; after calibration) forward is the integer GRU's values
              with straight-through gradients to the float weights (qgru/qat_step.py, qgru/qat.py)
  converted   (after convert()) forward runs the integer GRU on the selected backend

Input and output stay float at the module boundary: the input and h0 are quantized on entry and
the outputs dequantized on exit; everything in between is integer (docs/spec.md).
"""

import copy
import re
import warnings
from typing import Dict, List, Optional, Tuple, Union, overload

import torch
from torch import _VF, nn
from torch.nn.utils.rnn import PackedSequence

from . import native
from .backends import current_backend, forced_backend_name
from .config import QuantConfig
from .convert import (RescaleError, activation_qparams, calibrated_range, derive_layer_params, grid_error,
                      recurrent_operand)
from .errors import (CalibrationWarning, QGRUDtypeError, QGRUInputError, ShardedWeightError,  # noqa: F401
                     WeightRoundingWarning, empty_sequence_error)
from .export import ParamsFileError, QuantParams, check_stored_tensors, read_archive_bytes
from .float_gru import float_direction
from .golden import LayerParams
from .observers import NonFiniteWeightError, Observer, SecondMoment
from .ops import flatten_params
from .primitives import MIN_RANGE, qrange
from .qat_step import qat_forward
from .runtime import (_compiled_integer_gru, _integer_forward, integer_forward, integer_inputs,  # noqa: F401
                      packed_rows, padded_from_packed, reverse_within_lengths, run_stack)

_ACT_OBSERVED = ("x", "h", "Wx", "Rh", "r_pre", "z_pre", "g_pre")


def _autocast_enabled() -> bool:
    check = getattr(torch._C, "_is_any_autocast_enabled", None)  # what nn.GRU's check_input asks
    return bool(check()) if check is not None else torch.is_autocast_enabled()


_NO_TORCHSCRIPT = ("{what}: a converted (or calibrating) qgru.QuantGRU cannot be TorchScript: its integer GRU runs "
                   "qgru's own kernels (C++/CUDA and Python), which TorchScript can neither compile nor record. "
                   "Use torch.compile(model) or torch.export.export(model, args): qgru registers the integer "
                   "forward as a torch.library custom operator (qgru::integer_gru) for both. A float "
                   "(unconverted) QuantGRU scripts as nn.GRU does.")


# torch.jit.is_tracing() less its is_scripting() test (always False in eager Python, where the
# one-call paths run): ~60 ns of a streaming call
_is_tracing = getattr(torch._C, "_is_tracing", None) or torch.jit.is_tracing

# Dynamo's frame hook, or None: not None while a torch.compile'd caller runs this module as Python.
# Dynamo refuses to trace GRU modules (nn.RNNBase) unless torch._dynamo.config.allow_rnn is set,
# and then compiles each function that the module's Python calls on its own: dozens of small graphs
# and guards per call (measured 12.4 ms against 0.26 ms eager, a 2-layer bidirectional model).
# Eager is what such a call should run. A builtin (no Python frame of its own for Dynamo to take);
# where torch has none, never.
_eval_frame_callback = getattr(getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None),
                               "get_eval_frame_callback", None) or (lambda: None)


@torch.compiler.disable  # the module's forward as eager code, with no frame of it handed to Dynamo
def _forward_eager(module, input, hx):
    return module._forward(input, hx)


_EXTRA_STATE = "_extra_state"  # torch.nn.Module's key for get_extra_state()
_EXTRA_STATE_VERSION = 1
_QUANTIZED_CLASSES: Dict[type, type] = {}


def _quantized_class_name(cls: type) -> str:
    """``Quant<Name>`` for a GRU subclass ``Name``; a library's ``class GRU(nn.GRU)`` would make that
    qgru's own ``QuantGRU``, so its top-level package goes in between, CamelCased:
    ``pytorch_forecasting...GRU`` -> ``QuantPytorchForecastingGRU``."""
    name = f"Quant{cls.__name__}"
    if name != QuantGRU.__name__:
        return name
    package = str(getattr(cls, "__module__", "") or "").split(".")[0]
    camel = "".join(w[:1].upper() + w[1:] for w in re.split(r"[^0-9A-Za-z]+", package) if w) or "Subclass"
    return f"Quant{camel}{cls.__name__}"


def quantized_class(cls: type) -> type:
    """The QuantGRU class for a GRU class: QuantGRU for nn.GRU; for a subclass ``C`` of nn.GRU, a
    class ``QuantC(C, QuantGRU)`` (made once per class; for a subclass itself named ``GRU``, the
    name holds its package too, see _quantized_class_name): C's forward and methods come first, and
    its ``super().forward(...)`` reaches QuantGRU's forward, which runs nn.GRU's in float mode and
    the integer GRU once converted."""
    if not (isinstance(cls, type) and issubclass(cls, nn.GRU)):
        raise TypeError(f"quantized_class expects torch.nn.GRU or a subclass, got {cls!r}")
    if cls is nn.GRU:
        return QuantGRU
    if issubclass(cls, QuantGRU):
        return cls
    if cls not in _QUANTIZED_CLASSES:
        import types
        name = _quantized_class_name(cls)
        q = types.new_class(name, (cls, QuantGRU), {}, lambda ns: ns.update(
            {"__module__": __name__, "__qualname__": name, "_qgru_float_class": cls,
             "__doc__": f"{cls.__module__}.{cls.__qualname__}, quantized by qgru (see qgru.QuantGRU)"}))
        _QUANTIZED_CLASSES[cls] = q
    return _QUANTIZED_CLASSES[cls]


_CALIB_KEY = re.compile(r"l(0|[1-9][0-9]{0,8})\.(fwd|rev)\.[A-Za-z_]+\.[a-z_0-9]+\Z")


def _described(v) -> str:
    """A short description of what an untrusted _extra_state archive held (for an error)."""
    if isinstance(v, dict):
        keys = sorted(map(repr, list(v)[:5]))
        return "an empty dict" if not v else f"a dict of {len(v)} entr{'y' if len(v) == 1 else 'ies'} ({', '.join(keys)})"
    return f"a {type(v).__name__}"


def _checked_calibration(calib, who: str) -> Dict[str, torch.Tensor]:
    """A loaded calibration record (what _calibration_record wrote), checked: names of its form,
    each value a real tensor of at most one dimension (qgru.compare reads them)."""
    if not isinstance(calib, dict):
        raise ParamsFileError(f"{who}: the saved calibration record is a {type(calib).__name__}, not a dict")
    for k, v in calib.items():
        if not isinstance(k, str) or not _CALIB_KEY.match(k):
            raise ParamsFileError(f"{who}: the saved calibration record has an entry named {k!r}")
        if not isinstance(v, torch.Tensor) or v.dim() > 1 or v.is_complex() or v.dtype == torch.bool:
            raise ParamsFileError(f"{who}: the saved calibration record's {k} is not a real scalar or 1-D tensor")
    return dict(calib)


def _new_quantized_instance(float_cls: type):
    """Unpickling and deep-copying an instance of a quantized_class(): an empty one to fill."""
    q = quantized_class(float_cls)
    return q.__new__(q)


class QuantGRU(nn.GRU):
    """torch.nn.GRU's signature, parameters and state_dict, plus ``config`` (see qgru.QuantConfig)."""

    __jit_unused_properties__ = [*getattr(nn.GRU, "__jit_unused_properties__", []), "is_converted", "num_directions",
                                 "is_qat", "__jit_ignored_attributes__"]
    _qat = None  # (class default: instances pickled before QAT existed have no such attribute)

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 device=None, dtype=None, config: Union[str, dict, QuantConfig] = "w8a8"):
        super().__init__(input_size, hidden_size, num_layers=num_layers, bias=bias,
                         batch_first=batch_first, dropout=dropout, bidirectional=bidirectional,
                         device=device, dtype=dtype)
        self._init_quant_state(config)

    def _init_quant_state(self, config) -> None:
        """The attributes QuantGRU adds to an nn.GRU (also given to a GRU subclass's instance that
        becomes its quantized class, see quantized_class)."""
        self.qconfig = QuantConfig.load(config)
        self._observers: Optional[Dict[Tuple[int, int], Dict[str, Observer]]] = None
        # calibration: E[v v^T] of x and h per (layer, direction), for weight_rounding "gptq"
        self._moments: Dict[Tuple[int, int], Dict[str, SecondMoment]] = {}
        self._calibrating = False
        self._qparams: Optional[List[List[LayerParams]]] = None
        self._qparams_on: Dict[str, List[List[LayerParams]]] = {}
        self._integer = False  # converted (mirrors is_converted, for TorchScript)
        self._op_params: Tuple[List[torch.Tensor], str] = ([], "")
        # after convert(): what calibration saw ("l0.fwd.x.seen_min", ...; qgru.compare reads it)
        self._calib: Dict[str, torch.Tensor] = {}
        # QAT mode (start_qat): the activation ranges frozen from calibration, per (layer, direction)
        self._qat: Optional[Dict[Tuple[int, int], Dict[str, Tuple[torch.Tensor, torch.Tensor]]]] = None

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_params(cls, qp: QuantParams) -> "QuantGRU":
        """A converted QuantGRU that runs the integer parameters ``qp`` (a QuantParams, e.g. from
        qgru.load_params); its float weights are the dequantized ones. ``qp`` is validated first
        (QuantParams.validate()) and copied: later edits of ``qp`` do not reach the module.
        QuantParams.to_module() is the same call."""
        # the module's own copies, validated: later edits of these parameters do not reach it
        params = QuantParams(meta=copy.deepcopy(qp.meta) if isinstance(qp.meta, dict) else qp.meta,
                             layers=[[p.clone() if isinstance(p, LayerParams) else p for p in row]
                                     if isinstance(row, (list, tuple)) else row for row in qp.layers]
                             if isinstance(qp.layers, (list, tuple)) else qp.layers)
        params.validate()
        m = params.meta
        q = cls(m["input_size"], m["hidden_size"], m["num_layers"], m["bias"], m["batch_first"],
                0.0, m["bidirectional"], device=qp.layers[0][0].W.device, config=m["config"])
        with torch.no_grad():
            for li, row in enumerate(params.layers):
                for d, p in enumerate(row):
                    w_ih, w_hh, b_ih, b_hh = q._weights(li, d)
                    w_ih.copy_(p.W.double() * p.scale["W"].unsqueeze(1))
                    w_hh.copy_(p.R.double() * p.scale["R"].unsqueeze(1))
                    if b_ih is not None:
                        b_ih.copy_(p.b_x.double() * p.scale["W"] * p.scale["x"])
                        # b_h is at the R.h operand's scale (S_h_gemm when there is one)
                        b_hh.copy_(p.b_h.double() * p.scale["R"] * p.scale[recurrent_operand(p.bits)])
        q._set_params([list(row) for row in params.layers])
        return q

    @classmethod
    def from_float(cls, gru: nn.GRU, config: Union[str, dict, QuantConfig] = "w8a8") -> "QuantGRU":
        """A QuantGRU with a copy of ``gru``'s parameters (``gru`` itself is not modified)."""
        if not isinstance(gru, nn.GRU):
            raise TypeError(f"from_float expects a torch.nn.GRU, got {type(gru).__name__}")
        p = next(gru.parameters())
        m = cls(gru.input_size, gru.hidden_size, gru.num_layers, gru.bias, gru.batch_first,
                gru.dropout, gru.bidirectional, device=p.device, dtype=p.dtype, config=config)
        sd = gru.state_dict()
        sd.pop(_EXTRA_STATE, None)  # the float parameters only (a converted QuantGRU's integer ones stay)
        m.load_state_dict(sd)
        m.train(gru.training)
        return m

    @classmethod
    def _from_gru(cls, gru: nn.GRU, config: Union[str, dict, QuantConfig] = "w8a8") -> "QuantGRU":
        """(For prepare_model, on its deep copy.) ``gru`` made a QuantGRU, keeping its class: a plain
        nn.GRU becomes a QuantGRU (a copy, see from_float), an instance of a subclass (a library's
        ``class GRU(nn.GRU)`` with its own forward and methods) becomes an instance of
        ``quantized_class(type(gru))`` *in place*: its attributes, parameters and methods stay; its
        forward must reach nn.GRU's through ``super().forward(...)``, which is then QuantGRU's."""
        if isinstance(gru, QuantGRU):
            raise TypeError(f"{type(gru).__name__} is already a QuantGRU")
        if type(gru) is nn.GRU:
            return cls.from_float(gru, config)
        if not isinstance(gru, nn.GRU):
            raise TypeError(f"expected a torch.nn.GRU, got {type(gru).__name__}")
        gru.__class__ = quantized_class(type(gru))
        QuantGRU._init_quant_state(gru, config)
        return gru

    def __reduce_ex__(self, protocol):
        # a class made by quantized_class() cannot be found by name when unpickling: rebuild it
        # from the float class it was made from (which can), then restore the instance's state
        float_cls = type(self).__dict__.get("_qgru_float_class")
        if float_cls is None:
            return super().__reduce_ex__(protocol)
        return _new_quantized_instance, (float_cls,), self.__getstate__()

    def to_float(self) -> nn.GRU:
        """A plain torch.nn.GRU with this module's float parameters."""
        p = next(self.parameters())
        g = nn.GRU(self.input_size, self.hidden_size, self.num_layers, self.bias, self.batch_first,
                   self.dropout, self.bidirectional, device=p.device, dtype=p.dtype)
        sd = self.state_dict()
        sd.pop(_EXTRA_STATE, None)
        g.load_state_dict(sd)
        g.train(self.training)
        return g

    # ---- state_dict: a converted module's integer parameters are its extra state ----------------
    def get_extra_state(self) -> torch.Tensor:
        """A converted module's integer parameters (QuantParams.to_dict(): tensors, ints and a JSON
        string) and its calibration record, as one uint8 tensor: the bytes of their torch.save
        archive, so that the state_dict holds tensors only (safetensors, and libraries that save
        through it, refuse anything else). set_extra_state reads it back as untrusted input. The
        state_dict entry is ``<prefix>_extra_state``; a float (unconverted) QuantGRU has none, so
        its state_dict is exactly nn.GRU's."""
        if not self.is_converted:
            return torch.empty(0, dtype=torch.uint8)  # (dropped by _save_to_state_dict)
        import io
        # the same parameters give the same bytes (a loaded module saves what it loaded): entries in
        # sorted order, each tensor its own compact copy (a view would save its whole storage)
        own = lambda d: {k: (d[k].detach().cpu().clone() if isinstance(d[k], torch.Tensor) else d[k])
                         for k in sorted(d)}
        buf = io.BytesIO()
        torch.save({"format": "qgru.QuantGRU", "version": _EXTRA_STATE_VERSION,
                    "params": own(self.export().to_dict()), "calibration": own(self._calib)}, buf)
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Load integer parameters saved by get_extra_state: the module becomes converted, with the
        saved config. It must have been built with the same input_size, hidden_size, num_layers,
        bias, batch_first and bidirectional as the module that was saved."""
        if isinstance(state, torch.Tensor):  # get_extra_state's form: untrusted bytes
            state = self._extra_state_from_tensor(state)
            if not isinstance(state, dict) or state.get("format") != "qgru.QuantGRU":
                # qgru writes this tensor only for a converted module, always with its parameters: an
                # archive of anything else ({} included) would leave the module float without a word
                raise ParamsFileError(f"{type(self).__name__} state_dict '_extra_state': the archive holds "
                                      f"{_described(state)}, not a converted qgru.QuantGRU's state (format "
                                      "'qgru.QuantGRU' with its parameters); qgru never writes such a state")
        # else a dict: the form qgru saved before (a state_dict saved with torch.save), still loaded
        if isinstance(state, dict) and not state:  # what a float QuantGRU had before
            if self.is_converted:
                raise RuntimeError(f"{type(self).__name__} is converted, but the state it is given is a float "
                                   "QuantGRU's (no integer parameters)")
            return
        if not isinstance(state, dict) or state.get("format") != "qgru.QuantGRU":
            raise RuntimeError(f"{type(self).__name__}: '_extra_state' is not a qgru.QuantGRU state "
                               f"(got {type(state).__name__}); was this state_dict saved from a QuantGRU?")
        if state.get("version") != _EXTRA_STATE_VERSION:
            raise RuntimeError(f"{type(self).__name__}: unsupported qgru state version {state.get('version')!r}")
        if "params" not in state:
            raise ParamsFileError(f"{type(self).__name__} state_dict '_extra_state': missing its 'params' entry "
                                  "(the integer parameters a converted QuantGRU saves)")
        calib = state.get("calibration", {})
        if not isinstance(calib, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in calib.items()):
            raise ParamsFileError(f"{type(self).__name__} state_dict '_extra_state.calibration': expected a dict of "
                                  f"named tensors (what convert() records), got {type(calib).__name__}")
        try:
            params = QuantParams.from_dict(state["params"])
        except ParamsFileError as e:
            raise ParamsFileError(f"{type(self).__name__} state_dict '_extra_state.params': {e}") from None
        mine = {"input_size": self.input_size, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
                "bias": self.bias, "batch_first": self.batch_first, "bidirectional": self.bidirectional}
        saved = {k: params.meta[k] for k in mine}
        if saved != mine:
            diff = ", ".join(f"{k}={saved[k]!r} (this module: {mine[k]!r})" for k in mine if saved[k] != mine[k])
            raise RuntimeError(f"{type(self).__name__}: the quantized state_dict was saved from a QuantGRU built "
                               f"with other arguments: {diff}; build this one with the same arguments")
        self.qconfig = QuantConfig.load(params.meta["config"])
        self._set_params([list(row) for row in params.layers])
        self._calib = {k: v.detach().clone() for k, v in _checked_calibration(calib, type(self).__name__).items()}
        self._observers = None
        self._moments = {}
        self._calibrating = False
        self._qat = None

    def _extra_state_from_tensor(self, t: torch.Tensor) -> Dict[str, object]:
        """The dict held by get_extra_state's uint8 tensor, read as untrusted input (the CRCs,
        torch.load(weights_only=True); set_extra_state checks the parameters with
        QuantParams.from_dict)."""
        name = f"{type(self).__name__}: '_extra_state'"
        if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() == 0:
            raise ParamsFileError(f"{name} must be a non-empty 1-D uint8 tensor (the bytes get_extra_state "
                                  f"writes), got {t.dtype} of shape {tuple(t.shape)}; was this state_dict saved "
                                  "from a converted qgru.QuantGRU?")
        # no meta tensor, no more elements than its storage holds: before .contiguous() copies it
        check_stored_tensors({name: t}, (torch.uint8,), what="get_extra_state's bytes")
        return read_archive_bytes(t.detach().cpu().contiguous().numpy().tobytes(), name)

    def _qat_keys(self) -> Dict[str, Tuple[Tuple[int, int], str, int]]:
        """QAT mode's state_dict entries: the frozen activation ranges, ``_qat_<tensor>_min_l<k>``
        (and ``_max``, ``_reverse``) -> ((layer, direction), tensor, 0 for min / 1 for max)."""
        out = {}
        for (layer, d), r in (self._qat or {}).items():
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            for n in r:
                out[f"_qat_{n}_min{sfx}"] = ((layer, d), n, 0)
                out[f"_qat_{n}_max{sfx}"] = ((layer, d), n, 1)
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.is_converted:  # a float QuantGRU's state_dict is nn.GRU's, key for key
            destination.pop(prefix + _EXTRA_STATE, None)
        # QAT mode: the frozen grids too (float64 tensors of fixed shape, so that a checkpoint, also a
        # torch.distributed.checkpoint one loaded in place, resumes training on exactly these grids)
        for key, (ld, n, i) in self._qat_keys().items():
            destination[prefix + key] = self._qat[ld][n][i].detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + _EXTRA_STATE
        had = key in state_dict
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # a float state_dict (nn.GRU's) into a float QuantGRU: all there is to load. Into a converted
        # one, the missing integer parameters stay missing: strict loading fails, naming the key (torch
        # passes strict=True here whatever the caller asked, and sorts missing keys out itself)
        if not had and not self.is_converted and key in missing_keys:
            missing_keys.remove(key)
        self._load_qat_grids(state_dict, prefix, missing_keys, unexpected_keys, error_msgs)

    def _load_qat_grids(self, state_dict, prefix, missing_keys, unexpected_keys, error_msgs) -> None:
        """A QAT model's frozen grids (_save_to_state_dict) into this QAT model. Into a module not in
        QAT mode they are unexpected keys (strict loading fails naming them)."""
        mine = self._qat_keys()
        theirs = [k for k in state_dict if k.startswith(prefix + "_qat_") and "." not in k[len(prefix):]]
        for k in theirs:
            if k[len(prefix):] in mine:
                if k in unexpected_keys:  # (nn.Module's loader lists every key it does not own)
                    unexpected_keys.remove(k)
            elif k not in unexpected_keys:
                unexpected_keys.append(k)
        loaded = {}
        for key, (ld, n, i) in mine.items():
            k = prefix + key
            if k not in state_dict:
                missing_keys.append(k)
                continue
            v, own = state_dict[k], self._qat[ld][n][i]
            if not isinstance(v, torch.Tensor) or v.shape != own.shape or not v.is_floating_point():
                got = f"{v.dtype} of shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else _described(v)
                error_msgs.append(f"QAT grid {k!r}: expected a float tensor of shape {tuple(own.shape)} (the frozen "
                                  f"range of {n}), got {got}; was the checkpoint saved with another config?")
                continue
            v = v.detach().to(device=own.device, dtype=own.dtype)
            if not bool(torch.isfinite(v).all()):
                error_msgs.append(f"QAT grid {k!r} holds NaN or Inf")
                continue
            loaded[(ld, n, i)] = v.clone()
        if error_msgs:
            return
        for (ld, n, i), v in loaded.items():
            r = self._qat[ld][n]
            self._qat[ld][n] = (v, r[1]) if i == 0 else (r[0], v)

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def is_converted(self) -> bool:
        return self._qparams is not None

    def extra_repr(self) -> str:
        state = "converted" if self.is_converted else ("calibrating" if self._calibrating else
                                                        "qat" if self._qat is not None else "float")
        return f"{super().extra_repr()}, config={self.qconfig.name}, {state}"

    def _weights(self, layer: int, direction: int):
        sfx = f"_l{layer}" + ("_reverse" if direction else "")
        get = lambda n: getattr(self, n + sfx) if self.bias or not n.startswith("bias") else None
        return get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh")

    # ---- calibration ------------------------------------------------------------------------
    def start_calibration(self) -> None:
        """Attach fresh observers; forward passes now run the float reference and record ranges."""
        if self.is_converted:
            raise RuntimeError("this QuantGRU is already converted; calibrate a float copy instead")
        if self._qat is not None:
            raise RuntimeError("this QuantGRU is in QAT mode, with the activation grids of its calibration "
                               "frozen: calibrate before qgru.prepare_qat (or prepare a fresh copy)")
        H3 = 3 * self.hidden_size
        obs_spec = self.qconfig.observer
        self._observers = {}
        self._moments = {}
        wide: Dict[Tuple[int, str], int] = {}  # operands too wide for gptq (gptq_max_size)
        for layer in range(self.num_layers):
            for d in range(self.num_directions):
                obs = {}
                for n in _ACT_OBSERVED:
                    per_channel = self.qconfig[n].granularity in ("per_gate", "per_channel")
                    label = f"layer {layer}{' reverse' if d else ''} {n}"
                    obs[n] = Observer(label, obs_spec.kind, obs_spec.momentum, H3 if per_channel else 0,
                                      obs_spec.percentile)
                self._observers[(layer, d)] = obs
                if self.qconfig.weight_rounding == "gptq":
                    label = f"layer {layer}{' reverse' if d else ''}"
                    size_x = self.input_size if layer == 0 else self.hidden_size * self.num_directions
                    sizes = {"x": size_x, "h": self.hidden_size}
                    # an operand wider than gptq_max_size gets no K x K moment: its weights round to nearest
                    self._moments[(layer, d)] = {n: SecondMoment(f"{label} {n}", k) for n, k in sizes.items()
                                                 if k <= self.qconfig.gptq_max_size}
                    for n, k in sizes.items():
                        if k > self.qconfig.gptq_max_size and (layer, n) not in wide:
                            wide[(layer, n)] = k
        if wide:
            self._warn_wide_operands(wide)
        self._calibrating = True

    def _warn_wide_operands(self, wide: Dict[Tuple[int, str], int]) -> None:
        """The WeightRoundingWarning of start_calibration(): gptq skips the operands ``wide`` ((layer,
        "x" or "h") -> width), whose weights convert() rounds to nearest."""
        cap = self.qconfig.gptq_max_size
        rev = " and its _reverse" if self.num_directions == 2 else ""
        what = ", ".join(f"{'weight_ih' if n == 'x' else 'weight_hh'}_l{layer}{rev} (its operand {n} is {k} wide)"
                         for (layer, n), k in wide.items())
        k = max(wide.values())
        warnings.warn(f"QuantGRU(input_size={self.input_size}, hidden_size={self.hidden_size}): weight_rounding "
                      f"'gptq' keeps a K x K float64 second moment of each GEMM operand and factors it at convert() "
                      f"in O(K^3) time; the config's gptq_max_size is {cap}, so {what} "
                      f"{'is' if len(wide) == 1 else 'are'} rounded to nearest instead (no moment collected; the "
                      f"other weights keep gptq). To choose explicitly: "
                      f"overrides={{'weight_rounding': 'nearest'}} rounds every weight to nearest without this "
                      f"warning; overrides={{'gptq_max_size': {k}}} uses gptq (a {k} x {k} moment is "
                      f"{k * k * 8 / 1e9:.2g} GB, convert() needs a few times that)",
                      WeightRoundingWarning, stacklevel=3)

    def stop_calibration(self) -> None:
        self._calibrating = False

    def convert(self, sync: bool = True, group=None) -> "QuantGRU":
        """Freeze integer parameters from the observers; forward then runs integer-only. Returns self.

        Under torch.distributed (a process group of more than one rank), convert() first reduces
        the calibration statistics over the ranks of ``group`` (default: the default group), as
        qgru.sync_calibration does: a collective, so every rank must call it. If they were reduced
        already (qgru.sync_calibration on every rank), convert() runs no collective: convert on one
        rank alone then. ``sync=False`` never reduces: it converts the statistics as they are (a
        CalibrationWarning says so when a group is running and they were not reduced).

        In QAT mode (qgru.prepare_qat) the activation ranges are the ones frozen when QAT started
        (the same the observers give), and the weights are the trained ones: the integer model is
        then exactly the QAT model's forward (docs/spec.md section 14); nothing is reduced."""
        if self.is_converted:
            raise RuntimeError("this QuantGRU is already converted")
        if self._observers is None:
            raise RuntimeError("convert() needs calibration first: run qgru.calibrate(model, batches)")
        moments = None
        if self._qat is not None:  # QAT's forward rounds the weights to nearest: so does its convert
            ranges = self._qat
        else:
            self._sync_statistics(sync, group, "convert()")
            ranges = self._observed_ranges()
            for (layer, d), r in ranges.items():
                self._warn_degenerate(layer, d, r)
            moments = self._second_moments()
        params = self._derive_params(ranges, moments=moments)
        calib: Dict[str, torch.Tensor] = {}
        for (layer, d), r in ranges.items():
            calib.update(self._calibration_record(layer, d, self._observers[(layer, d)], r))
        self._set_params(params)
        self._calib = calib
        self._calibrating = False
        self._observers = None
        self._moments = {}
        self._qat = None
        return self

    def _second_moments(self) -> Optional[Dict[Tuple[int, int], Dict[str, torch.Tensor]]]:
        """E[v v^T] of x and h per (layer, direction) from calibration (reduced over ranks), or None
        when the config rounds weights to nearest."""
        if not self._moments:
            return None
        out = {}
        for key, mom in self._moments.items():
            out[key] = {n: v for n, v in ((n, m.value()) for n, m in mom.items()) if v is not None}
        return out

    def _sync_statistics(self, sync: bool, group, who: str) -> None:
        """convert() / start_qat(): reduce the statistics over the ranks of ``group`` unless ``sync``
        is False or they were reduced already (qgru/distributed.py)."""
        from .distributed import running, sync_grus
        if not running(group):
            return
        if all(o._synced for obs in self._observers.values() for o in obs.values()):
            return  # qgru.sync_calibration ran on every rank: no collective here
        if sync:
            sync_grus([("", self)], group, f"QuantGRU.{who}")
        else:
            warnings.warn(f"QuantGRU.{who} with sync=False under torch.distributed: the calibration statistics "
                          "were not reduced over the ranks (qgru.sync_calibration(model) on every rank does "
                          "that), so this rank converts from its own calibration data alone",
                          CalibrationWarning, stacklevel=3)

    def _observed_ranges(self) -> Dict[Tuple[int, int], Dict[str, Tuple[torch.Tensor, torch.Tensor]]]:
        """The calibrated activation ranges per (layer, direction), on the CPU, from the observers
        (reduced over torch.distributed ranks before: _sync_statistics)."""
        q = self.qconfig
        return {key: {n: calibrated_range(o, q[n], self.hidden_size, q.power_of_two, q.observer.kind)
                      for n, o in self._calibrated(obs).items()}
                for key, obs in self._observers.items()}

    def _calibrated(self, obs: Dict[str, Observer]) -> Dict[str, Observer]:
        """The observer of every calibrated tensor: the R.h operand h_gemm, when configured, is h's
        values on a grid of its own, so it reads h's observer."""
        return {**obs, "h_gemm": obs["h"]} if self.qconfig.h_gemm is not None else obs

    def _derive_params(self, ranges, scales: Optional[Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = None,
                       moments: Optional[Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = None
                       ) -> List[List[LayerParams]]:
        """convert()'s integer parameters from the current float weights and ``ranges`` (as
        _observed_ranges gives them). QAT calls it on every forward, so that its grids are exactly
        convert()'s; ``scales``, if given, receives every tensor's scale per (layer, direction);
        ``moments`` (convert(), weight_rounding "gptq"): E[x x^T], E[h h^T] per (layer, direction)."""
        self._check_unsharded()
        params: List[List[LayerParams]] = []
        for layer in range(self.num_layers):
            row = []
            prev = [] if layer == 0 else [(p.scale["h"], p.zp["h"]) for p in params[layer - 1]]
            for d in range(self.num_directions):
                # integer parameters are derived on the CPU; _params_on() copies them to a device
                weights = [w.detach().cpu() if w is not None else None for w in self._weights(layer, d)]
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                names = [n + sfx for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
                for n, w in zip(names, weights):  # (QAT trains them: a step can make them NaN)
                    if w is not None and not bool(torch.isfinite(w).all()):
                        raise NonFiniteWeightError(
                            f"the QuantGRU's parameter {n!r} contains NaN or Inf"
                            + (" (after a QAT training step: lower the learning rate, clip the gradients)"
                               if self._qat is not None else "") + ": its integer parameters cannot be derived")
                out = None if scales is None else scales.setdefault((layer, d), {})
                mom = None if moments is None else moments.get((layer, d))
                try:
                    row.append(derive_layer_params(*weights, ranges[(layer, d)], self.qconfig, prev, out, mom))
                except RescaleError as e:
                    big = ", ".join(f"{n} {float(w.abs().max()):.3g}" for n, w in zip(names, weights)
                                    if w is not None and w.numel())
                    raise RescaleError(f"layer {layer}{' reverse' if d else ''}: {e} (largest |value| of the "
                                       f"parameters: {big}; a weight far beyond the calibrated activations' "
                                       "range makes such a factor)") from None
            params.append(row)
        return params

    def _check_unsharded(self) -> None:
        """Integer parameters need whole weight matrices: a DTensor (FSDP2, tensor parallel) is one
        rank's shard, which derive_layer_params cannot mix with plain tensors."""
        sharded = [n for n, p in self.named_parameters(recurse=False) if type(p).__name__ == "DTensor"
                   or type(getattr(p, "data", None)).__name__ == "DTensor"]
        if sharded:
            raise ShardedWeightError(
                f"QuantGRU.convert(): the parameters {', '.join(sharded)} are sharded torch.distributed DTensors "
                "(FSDP2's fully_shard, or tensor parallelism); integer parameters are derived from the whole "
                "weights: unshard them first, e.g. copy the full weights (p.full_tensor(), on every rank) or a "
                "full state dict (torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True))) into an unsharded model, then convert_qat / "
                "convert it")

    def start_qat(self, group=None) -> "QuantGRU":
        """Quantization-aware training mode (qgru.prepare_qat does this for a whole model): the
        calibrated activation ranges are frozen, and forward becomes the integer GRU's values with
        the float GRU's straight-through gradients (qgru/qat.py). Needs calibration; returns self.
        Under torch.distributed the statistics are first reduced over ``group``, as by convert()."""
        if self.is_converted:
            raise RuntimeError("this QuantGRU is already converted: QAT trains the float weights of a "
                               "calibrated, unconverted QuantGRU (start from the float model)")
        if self._qat is not None:
            raise RuntimeError("this QuantGRU is already in QAT mode")
        if self._observers is None:
            raise RuntimeError("QAT needs calibration first: run qgru.calibrate(model, batches), or pass "
                               "calibration batches to qgru.prepare_qat(model, batches)")
        self._sync_statistics(True, group, "start_qat()")
        ranges = self._observed_ranges()
        for (layer, d), r in ranges.items():
            self._warn_degenerate(layer, d, r)
        # what convert() would refuse (a grid it cannot rescale to) fails here, not in the first
        # training step; every forward derives the parameters again from the weights it then has
        self._derive_params(ranges)
        # (own copies: the state_dict hands these out, and a checkpoint may load into them in place)
        self._qat = {k: {n: (lo.clone(), hi.clone()) for n, (lo, hi) in r.items()} for k, r in ranges.items()}
        return self

    @property
    def is_qat(self) -> bool:
        """In quantization-aware training mode (see start_qat / qgru.prepare_qat)."""
        return self._qat is not None

    def _warn_degenerate(self, layer: int, d: int, ranges) -> None:
        """Warn (CalibrationWarning) about a calibrated range narrower than primitives.MIN_RANGE, 0
        included (every value 0, e.g. an all-zero calibration batch): choose_qparams then makes up a
        tiny grid around 0 and at inference every other value saturates at its ends, silently."""
        for n, (lo, hi) in ranges.items():
            width = torch.clamp(hi, min=0) - torch.clamp(lo, max=0)
            if bool((width >= MIN_RANGE).any()):  # per channel: one live channel is enough
                continue
            spec = self.qconfig[n]
            scale, zp = activation_qparams(lo, hi, spec, self.hidden_size, self.qconfig.power_of_two)
            qmin, qmax = -(1 << (spec.bits - 1)), (1 << (spec.bits - 1)) - 1
            lo_f, hi_f = float(((qmin - zp) * scale).min()), float(((qmax - zp) * scale).max())
            lo_v, hi_v = float(lo.min()), float(hi.max())
            warnings.warn(f"qgru convert(): layer {layer}{' reverse' if d else ''} {n}: the calibrated range "
                          f"[{lo_v:.3g}, {hi_v:.3g}] is degenerate: with 0 included it spans less than {MIN_RANGE:g}"
                          + (f" (every calibration value was {hi_v:.3g})" if lo_v == hi_v else "")
                          + f"; its grid spans only [{lo_f:.3g}, {hi_f:.3g}], and values outside it saturate at "
                          "inference. Calibrate with representative data.",
                          CalibrationWarning, stacklevel=3)

    def _calibration_record(self, layer: int, d: int, obs: Dict[str, Observer], ranges) -> Dict[str, torch.Tensor]:
        """What calibration saw, per calibrated tensor (for qgru.compare): the observer's range, the
        exact extremes of the calibration data, and how many of its values lie beyond the grid
        convert() chose (more than half a step past an end: they saturate), counted from the
        observer's histogram."""
        out = {}
        pre = f"l{layer}.{'rev' if d else 'fwd'}."
        for n, o in self._calibrated(obs).items():
            spec = self.qconfig[n]
            S, Z = activation_qparams(*ranges[n], spec, self.hidden_size, self.qconfig.power_of_two)
            qlo, qhi = qrange(spec.bits)
            lo_edge, hi_edge = (qlo - Z - 0.5) * S, (qhi - Z + 0.5) * S
            out[pre + n + ".range_min"], out[pre + n + ".range_max"] = ranges[n]
            out[pre + n + ".seen_min"] = o.seen_min.cpu()
            out[pre + n + ".seen_max"] = o.seen_max.cpu()
            cpu = torch.device("cpu")  # the record is kept on the CPU, as the observers' statistics
            out[pre + n + ".count"] = torch.tensor(o.count, dtype=torch.int64, device=cpu)
            out[pre + n + ".clipped"] = torch.tensor(o.count_outside(lo_edge, hi_edge), dtype=torch.int64, device=cpu)
            # the grid's expected squared error over its own calibration data, and that data's power
            err, power = grid_error(o, S, Z, spec.bits)
            out[pre + n + ".grid_err2"] = torch.tensor(err, dtype=torch.float64, device=cpu)
            out[pre + n + ".calib_power"] = torch.tensor(power, dtype=torch.float64, device=cpu)
        return out

    def _set_params(self, params: List[List[LayerParams]]) -> None:
        self._qparams = params
        self._qparams_on = {"cpu": params}
        self._integer = True  # a bool TorchScript can read (forward's TorchScript branch)
        # the custom operator's arguments (torch.compile / torch.export): plain tensors and a string
        self._op_params = flatten_params(QuantParams.from_module(self).to_dict())

    def _params_on(self, device: torch.device) -> List[List[LayerParams]]:
        key = str(device)
        if key not in self._qparams_on:
            self._qparams_on[key] = [[p.to(device) for p in row] for row in self._qparams]
        return self._qparams_on[key]

    def export(self):
        """The integer parameters as a qgru.QuantParams (plain tensors and ints)."""
        if not self.is_converted:
            raise RuntimeError("export() needs a converted model: calibrate, then convert()")
        return QuantParams.from_module(self)

    # ---- forward ----------------------------------------------------------------------------
    # nn.GRU's two signatures, so that TorchScript compiles a QuantGRU wherever it compiles nn.GRU
    @overload  # type: ignore[override]
    @torch._jit_internal._overload_method  # noqa: F811
    def forward(self, input: torch.Tensor, hx: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        pass

    @overload
    @torch._jit_internal._overload_method  # noqa: F811
    def forward(self, input: PackedSequence, hx: Optional[torch.Tensor] = None) -> Tuple[PackedSequence, torch.Tensor]:
        pass

    def forward(self, input, hx=None):  # noqa: F811
        if not torch.jit.is_scripting():
            if not torch.compiler.is_compiling() and _eval_frame_callback() is not None:
                return _forward_eager(self, input, hx)
            return self._forward(input, hx)
        # TorchScript (a float QuantGRU only: torch.jit.script refuses converted ones, see
        # __prepare_scriptable__): nn.GRU.forward's own code, which TorchScript cannot reach through
        # super(); tests/test_library_patterns.py checks it against nn.GRU bit for bit
        if self._integer or self._calibrating:
            raise RuntimeError("a converted (or calibrating) qgru.QuantGRU cannot run in TorchScript; "
                               "use torch.compile or torch.export")
        self._update_flat_weights()
        orig_input = input
        if isinstance(orig_input, PackedSequence):
            input, batch_sizes, sorted_indices, unsorted_indices = input
            max_batch_size = batch_sizes[0]
            if hx is None:
                num_directions = 2 if self.bidirectional else 1
                hx = torch.zeros(self.num_layers * num_directions, max_batch_size, self.hidden_size,
                                 dtype=input.dtype, device=input.device)
            else:
                hx = self.permute_hidden(hx, sorted_indices)
        else:
            batch_sizes = None
            if input.dim() not in (2, 3):
                raise ValueError(f"GRU: Expected input to be 2D or 3D, got {input.dim()}D instead")
            is_batched = input.dim() == 3
            batch_dim = 0 if self.batch_first else 1
            if not is_batched:
                input = input.unsqueeze(batch_dim)
                if hx is not None:
                    if hx.dim() != 2:
                        raise RuntimeError(f"For unbatched 2-D input, hx should also be 2-D but got {hx.dim()}-D tensor")
                    hx = hx.unsqueeze(1)
            else:
                if hx is not None and hx.dim() != 3:
                    raise RuntimeError(f"For batched 3-D input, hx should also be 3-D but got {hx.dim()}-D tensor")
            max_batch_size = input.size(0) if self.batch_first else input.size(1)
            sorted_indices = None
            unsorted_indices = None
            if hx is None:
                num_directions = 2 if self.bidirectional else 1
                hx = torch.zeros(self.num_layers * num_directions, max_batch_size, self.hidden_size,
                                 dtype=input.dtype, device=input.device)
            else:
                hx = self.permute_hidden(hx, sorted_indices)
        self.check_forward_args(input, hx, batch_sizes)
        if batch_sizes is None:
            result = _VF.gru(input, hx, self._flat_weights, self.bias, self.num_layers, self.dropout,
                             self.training, self.bidirectional, self.batch_first)
        else:
            result = _VF.gru(input, batch_sizes, hx, self._flat_weights, self.bias, self.num_layers,
                             self.dropout, self.training, self.bidirectional)
        output = result[0]
        hidden = result[1]
        if isinstance(orig_input, PackedSequence):
            output_packed = PackedSequence(output, batch_sizes, sorted_indices, unsorted_indices)
            return output_packed, self.permute_hidden(hidden, unsorted_indices)
        else:
            if not is_batched:
                output = output.squeeze(batch_dim)
                hidden = hidden.squeeze(1)
            return output, self.permute_hidden(hidden, unsorted_indices)

    def _forward(self, input, hx: Optional[torch.Tensor] = None):
        if self._qparams is not None:
            if type(input) is PackedSequence:
                fast = self._cpu_packed_call(input, hx)
                if fast is not None:
                    return fast
            fast = self._cpu_one_call(input, hx)
            if fast is None:
                fast = self._cuda_one_call(input, hx)
            if fast is not None:
                return fast
        if not self.is_converted and not self._calibrating and self._qat is None:
            self._check_input(input, hx)
            return super().forward(input, hx)
        # a converted model runs a PackedSequence's rows longest first (its sorted order): each row's
        # integers are its own, and the native steps then skip the tiles of rows already done
        by_length = self.is_converted and self._qat is None and isinstance(input, PackedSequence) \
            and input.sorted_indices is not None
        index = []  # a PackedSequence's packed index: unpacking's, then packing's (the same, in either order)
        x, lengths, hx, unbatched, packed = self._prepare(input, hx, sorted_order=by_length, index_out=index)
        if self._qat is not None and not self.is_converted:
            out, h_n = qat_forward(self, x, hx, lengths)
        elif self.is_converted:
            out, h_n = self._forward_integer(x, hx, lengths)
        else:
            with torch.no_grad():
                out, h_n = self._forward_float_reference(x, hx, lengths)
        return self._finish(out, h_n, input, unbatched, packed, sorted_order=by_length,
                            index=index[0] if index else None)

    def _cpu_one_call(self, input, hx):
        """A converted model's commonest call as one native call with only the checks it needs, or
        None (the general path then runs, and raises what it must). The call: a float32 CPU tensor
        [T >= 1, N, input_size], time-major, h0 None or a float32 CPU tensor [num_layers, N,
        hidden_size], neither a negative view, one direction, the cpu backend (loaded, not forced
        elsewhere), nothing tracing or compiling; for it these are all of _check_input's checks.
        The module's state is checked here; the tensors' dtype, shapes and views by the Stack's
        ``call`` on the module's Model (native.cpu_op_model: the operator's C++ and Layers, which
        every cpu backend call of the module runs), which returns None where they are not that form.
        It skips Python checks and dispatch that a streaming call (one step of a batch of one)
        otherwise pays: a tiny layer's call (I = H = 8) took 16 us this way and 31 us by the general
        path on an AVX2 AMD EPYC (2026-11-27); the tensor checks in C++ and the plan read from its
        cache entry took another ~2.5 us off an I = 256, H = 512 step (AMD EPYC Zen 4, 2026-11-28)."""
        # (the cheapest form of each check: is_cpu, not device.type; the bidirectional flag, not
        # the num_directions property; type() is, which also keeps a PackedSequence and tensor
        # subclasses away from the native call)
        # torch.compile / torch.export first: Dynamo cannot trace is_neg() (fullgraph=True failed on
        # it with "torch.* op returned non-Tensor"); compiled, the custom operator runs
        if (torch.compiler.is_compiling() or type(input) is not torch.Tensor or not input.is_cpu or self.batch_first
                or self.bidirectional or self._qat is not None or self._calibrating
                or (hx is not None and type(hx) is not torch.Tensor)):
            return None
        params = self._qparams_on.get("cpu")
        if (params is None or forced_backend_name() not in (None, "cpu") or _is_tracing()
                or not self._flat_weights[0].is_cpu):
            return None
        # the cpu backend as current_backend decides it (an unavailable one: the general path falls
        # back to reference and warns, or raises where cpu is forced)
        if native.why_unavailable("cpu"):
            return None
        # None where x or hx is not of the form above, or the one-call form does not apply
        return native.cpu_op_model(params, self._op_params).call(input, hx)

    def _cpu_packed_call(self, input: PackedSequence, hx):
        """A converted model's PackedSequence call on the cpu backend as one native call (the Model's
        forward_packed: unpacking into the padded batch, the rows longest first, the integer GRU
        and packing its output again, all in C++), or None (the general path then runs, and raises
        what it must). It runs exactly what the general path runs for it (_prepare in sorted order,
        the operator's C++ on the module's Model, _finish): the same padded x, lengths and h0 go
        into the same native run, so out and h_n are the same bit for bit. The general path's
        Python around the native call (checking the PackedSequence, building its index, unpacking,
        packing: some 30 torch calls) cost ~1 ms of a 3.8 ms call at I=12 H=32 N=370 T=29 (mean
        length 18, AMD EPYC Zen 3, 1 thread; docs/packed_overhead.md). The call: the module
        converted, not in QAT or calibration, the data a CPU tensor, the cpu backend current (loaded,
        not forced elsewhere), nothing tracing or compiling; _check_input's checks run here as on the
        general path (the same errors), and the PackedSequence's own are the C++'s, which returns None
        where one fails so that the general path raises its error."""
        data = input.data
        if (torch.compiler.is_compiling() or type(data) is not torch.Tensor or not data.is_cpu
                or self._qat is not None or self._calibrating or not self._op_params[0]
                or (hx is not None and type(hx) is not torch.Tensor)):
            return None
        if (forced_backend_name() not in (None, "cpu") or _is_tracing() or not self._flat_weights[0].is_cpu
                or native.why_unavailable("cpu")):
            return None
        self._check_input(input, hx)
        model = native.cpu_op_model(self._params_on(data.device), self._op_params)
        bs, si, ui = input.batch_sizes, input.sorted_indices, input.unsorted_indices
        if type(bs) is not torch.Tensor or (si is not None and type(si) is not torch.Tensor) \
                or (ui is not None and type(ui) is not torch.Tensor):
            return None
        res = model.forward_packed(data.detach(), bs, si, ui, None if hx is None else hx.detach())
        if res is None:
            return None
        return PackedSequence(res[0], bs, si, ui), res[1]

    def _cuda_one_call(self, input, hx):
        """_cpu_one_call's counterpart on the GPU (a streaming call's lean entry): a float32 CUDA
        tensor [T >= 1, N, input_size], time-major, h0 None or a float32 tensor [num_layers, N,
        hidden_size] on the same device, one direction, the cuda backend (loaded, not forced
        elsewhere), the module's weights and integer parameters already on that device (after a
        first call there), nothing tracing or compiling: native.cuda_stack_forward, one native call
        that quantizes, runs the layers and dequantizes, with nothing on the host that waits for the
        GPU. Else None (the general path then runs, and raises what it must)."""
        if (type(input) is not torch.Tensor or input.dtype is not torch.float32 or not input.is_cuda
                or self.batch_first or self.bidirectional or self._qat is not None or self._calibrating):
            return None
        shape = input.shape
        if len(shape) != 3 or shape[2] != self.input_size or shape[0] == 0 or input.is_neg():
            return None
        device = input.device
        if hx is not None and (type(hx) is not torch.Tensor or hx.dtype is not torch.float32 or hx.device != device
                               or hx.shape != (self.num_layers, shape[1], self.hidden_size) or hx.is_neg()):
            return None
        params = self._qparams_on.get(str(device))
        if (params is None or forced_backend_name() not in (None, "cuda") or torch.jit.is_tracing()
                or torch.compiler.is_compiling() or self._flat_weights[0].device != device):
            return None
        if native.why_unavailable("cuda"):
            return None
        if hx is None:
            hx = input.new_zeros(self.num_layers, shape[1], self.hidden_size)
        return native.cuda_stack_forward(params, input, hx, resolve=False)

    def _check_input(self, input, hx) -> None:
        """Refuse what torch.nn.GRU refuses, with the exception types it raises (QGRUInputError,
        QGRUDtypeError). A converted module takes any floating-point input and h0 (they are
        quantized on entry); the float modes, which compute with the weights, need the weights'."""
        data = input.data if isinstance(input, PackedSequence) else input
        if not isinstance(data, torch.Tensor):
            # a qgru type (a TypeError still): calibrate() names the batch it came from
            raise QGRUDtypeError(f"QuantGRU expects a Tensor or PackedSequence, got {type(input).__name__}")
        w = self.weight_ih_l0
        # nn.GRU's forward, or the float reference while calibrating, compute with the weights'
        # dtype (nn.GRU lets autocast cast for it, and so does a QuantGRU in float mode)
        float_math = self._calibrating or (not self.is_converted and not _autocast_enabled())
        if not data.is_floating_point():
            raise QGRUDtypeError(f"QuantGRU input must be a floating-point tensor, got {data.dtype}")
        if float_math and data.dtype != w.dtype:
            raise QGRUDtypeError(f"QuantGRU input dtype ({data.dtype}) does not match the weight dtype ({w.dtype}): "
                                 f"convert the input with input.to({w.dtype}), or the model with "
                                 f"model.to({data.dtype})")
        if data.device != w.device:
            raise QGRUInputError(f"input is on {data.device} but the module is on {w.device}")
        if isinstance(input, PackedSequence):
            if data.dim() != 2:
                raise QGRUInputError(f"PackedSequence data must be 2-D (sum of lengths, input_size), "
                                     f"got {tuple(data.shape)}")
        elif data.dim() not in (2, 3):
            raise QGRUInputError(f"QuantGRU expects 2-D (unbatched) or 3-D input, got {data.dim()}-D "
                                 f"of shape {tuple(data.shape)}")
        if data.shape[-1] != self.input_size:
            raise QGRUInputError(f"input size mismatch: expected last dimension {self.input_size}, "
                                 f"got {data.shape[-1]} (shape {tuple(data.shape)})")
        if not isinstance(input, PackedSequence) and data.shape[1 if self.batch_first and data.dim() == 3 else 0] == 0:
            raise empty_sequence_error(tuple(data.shape))
        if hx is not None:
            if not isinstance(hx, torch.Tensor) or not hx.is_floating_point():
                raise QGRUDtypeError("h0 must be a floating-point tensor" +
                                     (f", got {hx.dtype}" if isinstance(hx, torch.Tensor) else ""))
            if float_math and hx.dtype != data.dtype:
                raise QGRUDtypeError(f"h0 dtype ({hx.dtype}) does not match the input dtype ({data.dtype})")
            if hx.device != w.device:
                raise QGRUInputError(f"h0 is on {hx.device} but the module is on {w.device}")
            batched = isinstance(input, PackedSequence) or data.dim() == 3
            if batched:
                n = int(input.batch_sizes[0]) if isinstance(input, PackedSequence) else \
                    data.shape[0 if self.batch_first else 1]
                expect = (self.num_layers * self.num_directions, n, self.hidden_size)
            else:
                expect = (self.num_layers * self.num_directions, self.hidden_size)
            if tuple(hx.shape) != expect:
                raise QGRUInputError(f"h0 must have shape {expect}, got {tuple(hx.shape)}")

    def _prepare(self, input, hx, sorted_order: bool = False, index_out: Optional[list] = None):
        """-> time-major float x [T, N, I], lengths or None, h0 [L*D, N, H], flags. sorted_order: a
        PackedSequence's rows (x, lengths and h0) in its sorted order, not the original one."""
        self._check_input(input, hx)
        packed = isinstance(input, PackedSequence)
        unbatched = False
        lengths = None
        if packed:
            x, lengths = padded_from_packed(input, sorted_order, index_out)  # what pad_packed_sequence gives, one index_copy
            if sorted_order and hx is not None:
                hx = hx.index_select(1, input.sorted_indices.to(hx.device))
        else:
            x = input
            if x.dim() == 2:
                unbatched = True
                x = x.unsqueeze(1)
                hx = hx.unsqueeze(1) if hx is not None else None
            elif self.batch_first:
                x = x.transpose(0, 1)
        N = x.shape[1]
        if hx is None:
            hx = x.new_zeros(self.num_layers * self.num_directions, N, self.hidden_size)
        return x, lengths, hx, unbatched, packed

    def _finish(self, out, h_n, input, unbatched, packed, sorted_order: bool = False,
                index: Optional[torch.Tensor] = None):
        if packed:  # (sorted_order: the rows as packed, h_n back in the caller's order)
            data = packed_rows(out, input.batch_sizes, None if sorted_order else input.sorted_indices, index)
            if sorted_order:
                h_n = h_n.index_select(1, input.unsorted_indices.to(h_n.device))
            return PackedSequence(data, input.batch_sizes, input.sorted_indices, input.unsorted_indices), h_n
        if unbatched:
            return out.squeeze(1), h_n.squeeze(1)
        if self.batch_first:
            out = out.transpose(0, 1)
        return out, h_n

    def _run_stack(self, x, hx, lengths, direction_fn):
        """Layers and directions; direction_fn(layer, d, layer_inputs, h0) -> (out [T,N,H], h_n)."""
        return run_stack(self.num_layers, self.num_directions, x, hx, lengths, direction_fn)

    def _forward_float_reference(self, x, hx, lengths):
        def run(layer, d, inp, h0):
            inp = inp if layer == 0 else torch.cat(inp, dim=-1)
            return float_direction(*self._weights(layer, d), inp, h0, lengths, self._observers[(layer, d)],
                                   moments=self._moments.get((layer, d)))

        outs, h_n = self._run_stack(x, hx, lengths, run)
        for obs in self._observers.values():
            for o in obs.values():
                o.end_call()
        return torch.cat(outs, dim=-1), torch.stack(h_n)

    _integer_inputs = staticmethod(integer_inputs)  # (qgru/runtime.py; compare.py calls it here)

    def _forward_integer(self, x, hx, lengths):
        if torch.jit.is_tracing():
            raise RuntimeError(_NO_TORCHSCRIPT.format(what="torch.jit.trace"))
        if torch.compiler.is_compiling():
            return _compiled_integer_gru(x, hx, lengths, *self._op_params)
        if x.is_cpu and self._op_params[0] and current_backend("cpu").name == "cpu":
            # the cpu backend: the operator's C++ on this model's Layers (native.cpu_op_model), as
            # an exported program runs it; its prepared parameters are the operator's own (no
            # second copy), and no layer loop in Python (qgru/runtime.py keeps one for the others)
            model = native.cpu_op_model(self._params_on(x.device), self._op_params)
            return model.forward(x.detach(), hx.detach(), lengths)
        return _integer_forward(self._params_on(x.device), x, hx, lengths)

    # ---- TorchScript --------------------------------------------------------------------------
    @property
    def __jit_ignored_attributes__(self) -> List[str]:
        # TorchScript reads this (and nothing else does) for every module it compiles, submodules
        # included. torch.jit.trace of a model with a @torch.jit.export method (torchaudio's
        # WaveRNN) scripts the model and its submodules without __prepare_scriptable__ and would
        # fail on nn.GRU's overloads ("Couldn't find method: 'forward__0'"): the message is ours.
        if self._integer or self._calibrating:
            raise RuntimeError(_NO_TORCHSCRIPT.format(what="torch.jit.trace"))
        return []

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every module it scripts: a float QuantGRU scripts as the
        # nn.GRU it is (forward's TorchScript branch); the integer GRU runs qgru's own kernels
        if self.is_converted or self._calibrating:
            raise RuntimeError(_NO_TORCHSCRIPT.format(what="torch.jit.script"))
        if self._qat is not None:
            raise RuntimeError("torch.jit.script: a QuantGRU in QAT mode cannot be TorchScript (its forward "
                               "runs the golden integer model in Python); script it after convert_qat, or the "
                               "float model")
        return self
