"""WeightOnlyGRU: a drop-in for torch.nn.GRU whose weights are stored packed at 2, 4 or 8 bits
(qgru/weight_only/format.py) and whose activations and gates stay in float32, float16 or bfloat16.

The module holds only the packed weights, scales, zero points and float32 biases (buffers), no
float copy of the weights. Its forward takes what nn.GRU's takes: [T, B, I] (or batch_first
[B, T, I]) tensors, unbatched [T, I] tensors, PackedSequence, and h0; it returns (output, h_n) as
nn.GRU does. Which path runs a call (``last_path`` says which ran last):

* ``native`` (CPU, float32, batch <= NATIVE_MAX_BATCH): qgru/weight_only/cpu.py's kernel
  multiplies the packed weights directly, unpacking them in registers; the time loop is in C++.
* ``triton-fused`` / ``triton-step`` (CUDA, float16/bfloat16/float32): qgru/weight_only/triton_kernels.py's
  dequant-GEMM for W.x over the whole sequence, then the recurrence (R.h fused with the gates):
  ``fused``, one launch per layer direction running the whole time loop, or ``step``, one launch
  per time step. ``triton_kernel`` ("auto", "fused", "step") picks; "auto" is
  qgru.weight_only.triton_kernels.choose_kernel.
* ``dequant`` (any other call): the weights are dequantized once for the call into the module's
  dtype and torch's own GRU runs (the batched and PackedSequence calls, where a float GEMM over
  many rows outweighs reading the weights).
* ``golden`` (``backend="golden"``): qgru.weight_only.golden.golden_forward, float64, the definition.

``backend`` (constructor argument or attribute) is "auto" (the first of native / triton /
dequant that applies), or one of "native", "triton", "dequant", "golden" (a call that the forced
path cannot run raises WeightOnlyError instead of running another); ``last_path`` names the
Triton kernel too ("triton-fused" or "triton-step").

Gradients: the native and Triton kernels have none, so a call whose input or h0 requires grad
runs ``dequant`` at every batch size under "auto" (a forced native / triton backend raises): one
behaviour whatever the batch. load_state_dict checks what it loads as load() checks a file.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from tqdm.auto import tqdm

from ..errors import QGRUInputError
from ..export import check_stored_tensors
from .format import (WO_DTYPES, PackedWeight, WeightOnlyConfig, WeightOnlyError, WeightOnlyFileError, WOLayer,
                     check_bias, check_weight, dequantize, groups_of, load_file, save, weight_bytes)
from .golden import golden_forward
from .quantize import quantize_weight

NATIVE_MAX_BATCH = 8
# README "Limits and known open defects": what torch.compile(fullgraph=True) and torch.export say
NO_COMPILE = ("qgru.WeightOnlyGRU has no torch.compile or torch.export operator (README, \"Limits and known "
              "open defects\": weight-only modules have no C export, QAT or torch.compile operator); compile "
              "without fullgraph=True (the module then runs eagerly between graphs) or export a QuantGRU")


def _disable_compile(fn):
    """fn, run eagerly under torch.compile: dynamo breaks the graph there, and with fullgraph=True
    its error gives NO_COMPILE as the reason (torch >= 2.8; older torch: no reason)."""
    try:
        return torch.compiler.disable(fn, reason=NO_COMPILE)
    except TypeError:
        return torch.compiler.disable(fn)
BACKENDS = ("auto", "native", "triton", "dequant", "golden")
TRITON_KERNELS = ("auto", "fused", "step")  # qgru.weight_only.triton_kernels.KERNELS
_DIRS = ("fwd", "rev")
_warned: set = set()


class WeightOnlyGRU(nn.Module):
    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, bidirectional: bool = False,
                 config: Union[str, dict, WeightOnlyConfig] = "w4g128", backend: str = "auto", device=None):
        super().__init__()
        for name, v in (("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise WeightOnlyError(f"WeightOnlyGRU: {name} must be a positive integer, got {v!r}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.bidirectional = bool(bias), bool(batch_first), bool(bidirectional)
        self.config = WeightOnlyConfig.load(config)
        self.backend = backend
        self.triton_kernel = "auto"  # the Triton path's recurrence: "auto", "fused" or "step"
        self.dtype = self.config.torch_dtype
        self.last_path: Optional[str] = None
        # CUDA only, opt-in: the Triton path replayed as a CUDA graph per input shape (qgru.weight_only.triton_kernels.
        # GraphedForward; checked on an H200, 2026-11-28). Dropped with the layers cache when buffers change.
        self.cuda_graph = False
        self._graphed = None
        D = 2 if bidirectional else 1
        H = hidden_size
        for li in range(num_layers):
            K = input_size if li == 0 else H * D
            for d in range(D):
                for name, k in (("W", K), ("R", H)):
                    g, G = groups_of(k, self.config.group_size)
                    per = 32 // self.config.bits
                    self.register_buffer(self._key(li, d, name, "codes"), torch.zeros(-(-k // per), 3 * H, dtype=torch.int32, device=device))
                    self.register_buffer(self._key(li, d, name, "scale"), torch.ones(G, 3 * H, dtype=torch.float32, device=device))
                    self.register_buffer(self._key(li, d, name, "zp"), torch.zeros(G, 3 * H, dtype=torch.uint8, device=device))
                if bias:
                    self.register_buffer(self._key(li, d, "b_ih"), torch.zeros(3 * H, dtype=torch.float32, device=device))
                    self.register_buffer(self._key(li, d, "b_hh"), torch.zeros(3 * H, dtype=torch.float32, device=device))

    # ---- storage -----------------------------------------------------------------------------
    @staticmethod
    def _key(li: int, d: int, *parts: str) -> str:
        return f"l{li}_{_DIRS[d]}_" + "_".join(parts)

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, b: str) -> None:
        if b not in BACKENDS:
            raise WeightOnlyError(f"WeightOnlyGRU: backend must be one of {BACKENDS}, got {b!r}")
        self._backend = b

    @property
    def triton_kernel(self) -> str:
        return self._triton_kernel

    @triton_kernel.setter
    def triton_kernel(self, k: str) -> None:
        if k not in TRITON_KERNELS:
            raise WeightOnlyError(f"WeightOnlyGRU: triton_kernel must be one of {TRITON_KERNELS}, got {k!r}")
        self._triton_kernel = k

    def layers(self) -> List[List[WOLayer]]:
        """The stored parameters as qgru.weight_only.format.WOLayer rows (the buffers themselves). Cached;
        the cache is dropped whenever a buffer is assigned, moved or loaded."""
        cached = self.__dict__.get("_layers_cache")
        if cached is None:
            cached = self.__dict__["_layers_cache"] = self._make_layers()
        return cached

    def __setattr__(self, name, value):
        if name in self.__dict__.get("_buffers", ()) or name == "config":
            self.__dict__.pop("_layers_cache", None)
            self.__dict__["_graphed"] = None
        super().__setattr__(name, value)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._check_state(state_dict, prefix)  # before any buffer is written
        self.__dict__.pop("_layers_cache", None)
        self.__dict__["_graphed"] = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _check_state(self, state_dict, prefix: str) -> None:
        """The entries of a state_dict (torch.save, safetensors: untrusted) that load_state_dict
        would copy into this module, checked as the file loader checks a file's, before anything is
        copied: dense tensors within their storage (qgru.export.check_stored_tensors), each of its
        buffer's dtype (copy_ would cast a float scale into codes silently), and each matrix and
        bias against the format under this module's config (qgru.weight_only.format.check_weight). A
        matrix partly in the state is checked with this module's other fields. WeightOnlyFileError
        names the key and the field."""
        mine = {prefix + k: k for k in self._buffers}
        given = {k: state_dict[k] for k in mine if k in state_dict}
        if not given:
            return
        where = f"{type(self).__name__} state_dict"
        for k, v in given.items():
            if not isinstance(v, torch.Tensor):
                raise WeightOnlyFileError(f"{where} '{k}': expected a tensor, got {type(v).__name__}")
        check_stored_tensors({f"{where} '{k}'": v for k, v in given.items()},
                             (torch.int32, torch.uint8, torch.float32), WeightOnlyFileError, "weight-only states")
        for k, v in given.items():
            own = self._buffers[mine[k]]
            if v.dtype != own.dtype:
                raise WeightOnlyFileError(f"{where} '{k}': expected {own.dtype} {list(own.shape)} (config "
                                          f"{self.config.name}), got {v.dtype} {list(v.shape)}")
        # a shape that differs is torch's "size mismatch" (RuntimeError, nothing copied): left to it
        given = {k: v for k, v in given.items() if tuple(v.shape) == tuple(self._buffers[mine[k]].shape)}
        D = 2 if self.bidirectional else 1
        H = self.hidden_size
        for li in range(self.num_layers):
            K = self.input_size if li == 0 else H * D
            for d in range(D):
                for name, k in (("W", K), ("R", H)):
                    keys = [self._key(li, d, name, f) for f in ("codes", "scale", "zp")]
                    if not any(prefix + b in given for b in keys):
                        continue
                    t = [given.get(prefix + b, self._buffers[b]) for b in keys]
                    if any(x.is_meta for x in t):  # this module's own field has no values to check with
                        continue
                    check_weight(*t, self.config, 3 * H, k,
                                    lambda f, li=li, d=d, name=name: f"{where} '{prefix}{self._key(li, d, name, f)}'")
                if self.bias:
                    for b in ("b_ih", "b_hh"):
                        key = prefix + self._key(li, d, b)
                        if key in given:
                            check_bias(given[key], H, f"{where} '{key}'")

    def _make_layers(self) -> List[List[WOLayer]]:
        D = 2 if self.bidirectional else 1
        out = []
        for li in range(self.num_layers):
            K = self.input_size if li == 0 else self.hidden_size * D
            row = []
            for d in range(D):
                def pw(name, k):
                    g, _ = groups_of(k, self.config.group_size)
                    return PackedWeight(getattr(self, self._key(li, d, name, "codes")),
                                        getattr(self, self._key(li, d, name, "scale")),
                                        getattr(self, self._key(li, d, name, "zp")), self.config.bits, g, k)
                b_ih = getattr(self, self._key(li, d, "b_ih")) if self.bias else None
                b_hh = getattr(self, self._key(li, d, "b_hh")) if self.bias else None
                row.append(WOLayer(pw("W", K), pw("R", self.hidden_size), b_ih, b_hh))
            out.append(row)
        return out

    def _set_layers(self, layers: List[List[WOLayer]]) -> None:
        for li, row in enumerate(layers):
            for d, p in enumerate(row):
                for name, w in (("W", p.W), ("R", p.R)):
                    for f in ("codes", "scale", "zp"):
                        getattr(self, self._key(li, d, name, f)).copy_(getattr(w, f))
                if self.bias:
                    getattr(self, self._key(li, d, "b_ih")).copy_(p.b_ih)
                    getattr(self, self._key(li, d, "b_hh")).copy_(p.b_hh)

    def _apply(self, fn, recurse=True):
        # .to(device) moves the buffers; .half() / .bfloat16() / .to(dtype) change the activation
        # dtype only: codes, scales, zero points and biases keep the types they are stored in
        probe = fn(torch.zeros(1, dtype=self.dtype, device="cpu"))
        if probe.dtype != self.dtype:
            if probe.dtype not in WO_DTYPES.values():
                raise WeightOnlyError(f"WeightOnlyGRU: activations are float32, float16 or bfloat16, not {probe.dtype}")
            self.dtype = probe.dtype
            self.config = dataclasses.replace(self.config, dtype=_dtype_name(probe.dtype))
        self.__dict__.pop("_layers_cache", None)
        self.__dict__["_graphed"] = None
        return super()._apply(lambda t: fn(t).to(t.dtype), recurse)

    def weight_bytes(self) -> int:
        """Bytes of the stored weights (codes, scales, zero points), biases excluded."""
        return weight_bytes(self.layers())

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, bias={self.bias}, "
                f"batch_first={self.batch_first}, bidirectional={self.bidirectional}, config={self.config.name}, "
                f"dtype={self.dtype}")

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_float(cls, gru: nn.GRU, config: Union[str, dict, WeightOnlyConfig] = "w4g128",
                   batches: Optional[Iterable] = None, model: Optional[nn.Module] = None,
                   progress: Optional[bool] = None) -> "WeightOnlyGRU":
        """Quantize a float nn.GRU. With ``config.weight_rounding == "gptq"``, ``batches`` (run
        through ``model``, or through ``gru`` itself when model is None) give the second moments of
        each layer's inputs and states; without batches, gptq rounds to nearest. ``progress``: a
        progress bar over the weight matrices (default: when the GRU has over 2^18 weights, where
        the range search takes seconds per matrix)."""
        config = WeightOnlyConfig.load(config)
        if type(gru) is not nn.GRU:
            raise TypeError(f"WeightOnlyGRU.from_float: a torch.nn.GRU is needed, got {type(gru).__name__} "
                            "(subclasses of nn.GRU with their own forward are not converted to weight-only)")
        if getattr(gru, "proj_size", 0):
            raise WeightOnlyError("WeightOnlyGRU: proj_size is not supported")
        moments = None
        if config.weight_rounding == "gptq" and batches is not None:
            moments = second_moments(gru, batches, model)
        m = cls(gru.input_size, gru.hidden_size, gru.num_layers, gru.bias, gru.batch_first, gru.bidirectional,
                config, device="cpu")
        D = 2 if gru.bidirectional else 1
        if progress is None:
            progress = sum(p.numel() for n, p in gru.named_parameters() if n.startswith("weight")) > 1 << 18
        bar = tqdm(total=2 * gru.num_layers * D, desc="qgru weight-only", unit="matrix", disable=not progress)
        layers = []
        for li in range(gru.num_layers):
            row = []
            for d in range(D):
                sfx = f"_l{li}" + ("_reverse" if d else "")
                w_ih, w_hh = getattr(gru, "weight_ih" + sfx), getattr(gru, "weight_hh" + sfx)
                mx, mh = (None, None) if moments is None else moments[li][d]
                W = quantize_weight(w_ih.detach().float().cpu(), config, mx)
                bar.update()
                R = quantize_weight(w_hh.detach().float().cpu(), config, mh)
                bar.update()
                b = [getattr(gru, n + sfx).detach().float().cpu() if gru.bias else None for n in ("bias_ih", "bias_hh")]
                row.append(WOLayer(W, R, b[0], b[1]))
            layers.append(row)
        bar.close()
        m._set_layers(layers)
        dev = gru.weight_ih_l0.device
        return m.to(dev)

    # ---- files -------------------------------------------------------------------------------
    def meta(self) -> Dict[str, Any]:
        return {"input_size": self.input_size, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
                "bias": self.bias, "batch_first": self.batch_first, "bidirectional": self.bidirectional,
                "config": self.config.to_dict()}

    def save(self, path: Union[str, Path]) -> None:
        """Write the packed weights, scales, zero points and biases bit for bit (qgru.weight_only.format.save)."""
        save(path, self.meta(), [[WOLayer(p.W.to("cpu"), p.R.to("cpu"), p.b_ih, p.b_hh) for p in row]
                                    for row in self.layers()])

    @classmethod
    def load(cls, path: Union[str, Path], backend: str = "auto") -> "WeightOnlyGRU":
        """A WeightOnlyGRU from a file save() wrote, checked as untrusted input (WeightOnlyFileError)."""
        meta, cfg, layers = load_file(path)
        m = cls(meta["input_size"], meta["hidden_size"], meta["num_layers"], meta["bias"], meta["batch_first"],
                meta["bidirectional"], cfg, backend, device="cpu")
        m._set_layers(layers)
        return m

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, input, hx: Optional[torch.Tensor] = None):
        return self._forward(input, hx)

    @_disable_compile
    def _forward(self, input, hx: Optional[torch.Tensor] = None):
        if torch.compiler.is_compiling():  # torch.export traces this in Python, with fake tensors
            raise WeightOnlyError(NO_COMPILE)
        D = 2 if self.bidirectional else 1
        H = self.hidden_size
        packed = isinstance(input, PackedSequence)
        dev = self.l0_fwd_W_codes.device
        if packed:
            x = input.data
            if x.dim() != 2:
                raise WeightOnlyError(f"WeightOnlyGRU: a PackedSequence's data must be [sum(T), {self.input_size}]")
            B = int(input.batch_sizes[0])
            unbatched = False
        else:
            if not isinstance(input, torch.Tensor):
                raise TypeError(f"WeightOnlyGRU: input must be a Tensor or PackedSequence, got {type(input).__name__}")
            if input.dim() not in (2, 3):
                raise WeightOnlyError(f"WeightOnlyGRU: expected a 2-D (unbatched) or 3-D input, got {input.dim()}-D")
            unbatched = input.dim() == 2
            x = input.unsqueeze(0 if self.batch_first else 1) if unbatched else input
            if self.batch_first:
                x = x.transpose(0, 1)
            B = x.shape[1]
        if x.shape[-1] != self.input_size:
            raise WeightOnlyError(f"WeightOnlyGRU: input has {x.shape[-1]} features, expected {self.input_size}")
        if not packed and x.shape[0] == 0:  # every path: nn.GRU's RuntimeError (a QGRUInputError is one)
            raise QGRUInputError(f"WeightOnlyGRU expects a sequence of at least one step, got an input of shape "
                                 f"{tuple(input.shape)} (sequence length 0; torch.nn.GRU refuses it too)")
        if x.device != dev:
            raise WeightOnlyError(f"WeightOnlyGRU: input on {x.device}, module on {dev}")
        if not x.is_floating_point():
            raise WeightOnlyError(f"WeightOnlyGRU: input must be floating point, got {x.dtype}")
        if hx is not None:
            want = (self.num_layers * D, H) if unbatched else (self.num_layers * D, B, H)
            if tuple(hx.shape) != want:
                raise WeightOnlyError(f"WeightOnlyGRU: h0 has shape {list(hx.shape)}, expected {list(want)}")
            if hx.device != dev:
                raise WeightOnlyError(f"WeightOnlyGRU: h0 on {hx.device}, module on {dev}")
            if unbatched:
                hx = hx.unsqueeze(1)
        # a lazy negative view (torch._neg_view) is a flag over the positive values' buffer: the
        # kernels read buffers, so the values are made real first (every path then reads -x)
        x = x.resolve_conj().resolve_neg()
        if hx is not None:
            hx = hx.resolve_conj().resolve_neg()
        grad = torch.is_grad_enabled() and (x.requires_grad or (hx is not None and hx.requires_grad))
        out_dtype = self.dtype
        path = self._path(dev, packed, B, grad)
        self.last_path = path
        if path == "dequant":
            out, h_n = self._dequant_forward(input if packed else x, hx, packed)
        else:
            if packed:
                xt, lengths = pad_packed_sequence(input)  # [T, B, I], original batch order
                xt = xt.to(dev)
                lengths = lengths.to(dev)
            else:
                xt, lengths = x, None
            if packed:
                xt = xt.resolve_conj().resolve_neg()
            if path == "golden":
                out, h_n = golden_forward(self.layers(), xt, hx, lengths, self.dtype)
            elif path == "native":
                out, h_n = self._native_forward(xt, hx, lengths)
            else:
                from . import triton_kernels as wo_triton
                kernel = wo_triton.choose_kernel(H, xt.shape[1], self.triton_kernel)
                self.last_path = f"triton-{kernel}"
                if self.cuda_graph:
                    if self._graphed is None:
                        self._graphed = wo_triton.GraphedForward()
                    out, h_n = self._graphed(self.layers(), xt, hx, self.dtype, lengths, kernel)
                else:
                    out, h_n = wo_triton.gru_forward(self.layers(), xt, hx, self.dtype, lengths, kernel)
            out, h_n = out.to(out_dtype), h_n.to(out_dtype)
            if packed:
                out = _repack(out, input)
        if packed:
            return out, h_n
        if self.batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out, h_n = out.squeeze(0 if self.batch_first else 1), h_n.squeeze(1)
        return out, h_n

    def _path(self, dev: torch.device, packed: bool, B: int, grad: bool = False) -> str:
        """The path of a call (module docstring). ``grad``: the input or h0 requires grad (with grad
        mode on): gradients flow back to them on the golden and dequant paths (torch's GRU on the
        dequantized weights), so "auto" runs dequant at every batch size and device, and a forced
        native or triton backend raises instead of returning outputs without a grad_fn."""
        b = self.backend
        if b == "golden" or b == "dequant":
            return b
        if grad:
            if b != "auto":
                raise WeightOnlyError(f"WeightOnlyGRU: backend {b!r} computes no gradients, and this call's input or "
                                      "h0 requires grad: use backend 'auto' or 'dequant' (gradients flow to the input "
                                      "and h0 there), or call it under torch.no_grad()")
            return "dequant"
        native_ok = dev.type == "cpu" and self.dtype == torch.float32 and B <= NATIVE_MAX_BATCH
        if b == "native":
            if not native_ok:
                raise WeightOnlyError("WeightOnlyGRU: backend 'native' runs float32 modules on the CPU with tensor "
                                      f"batch <= {NATIVE_MAX_BATCH}; this call is not one")
            from . import cpu as wo_cpu
            why = wo_cpu.why_unavailable()
            if why:
                raise WeightOnlyError(f"WeightOnlyGRU: backend 'native' is unavailable: {why}")
            return "native"
        if b == "triton":
            if dev.type != "cuda":
                raise WeightOnlyError("WeightOnlyGRU: backend 'triton' runs CUDA modules (tests use TRITON_INTERPRET=1 "
                                      "through qgru.weight_only.triton_kernels directly)")
            return "triton"
        # auto
        if dev.type == "cuda":
            from . import triton_kernels as wo_triton
            why = wo_triton.why_unavailable()
            if not why:
                return "triton"
            _warn_once("triton", f"qgru weight-only: Triton is unavailable ({why}); CUDA calls dequantize the "
                                 "weights and run cuDNN's GRU (pip install qgru[triton])")
            return "dequant"
        if native_ok:
            from . import cpu as wo_cpu
            why = wo_cpu.why_unavailable()
            if not why:
                return "native"
            _warn_once("native", f"qgru weight-only: the CPU kernel could not be built ({why}); small-batch CPU "
                                 "calls dequantize the weights for every call instead")
        return "dequant"

    def dequantized_weights(self) -> List[torch.Tensor]:
        """torch.nn.GRU's flat weight list (w_ih, w_hh, b_ih, b_hh per layer and direction), in the
        module's dtype: what the dequant path computes for every call."""
        flat = []
        for row in self.layers():
            for p in row:
                flat += [dequantize(p.W).to(self.dtype), dequantize(p.R).to(self.dtype)]
                if self.bias:
                    flat += [p.b_ih.to(self.dtype), p.b_hh.to(self.dtype)]
        return flat

    def _dequant_forward(self, x, hx, packed: bool):
        D = 2 if self.bidirectional else 1
        flat = self.dequantized_weights()
        if packed:
            data = x.data.to(self.dtype)
            B = int(x.batch_sizes[0])
            h = hx if hx is not None else torch.zeros(self.num_layers * D, B, self.hidden_size, dtype=self.dtype,
                                                      device=data.device)
            h = h.to(self.dtype)
            if x.sorted_indices is not None:
                h = h.index_select(1, x.sorted_indices)
            out, h_n = torch._VF.gru(data, x.batch_sizes, h, flat, self.bias, self.num_layers, 0.0, False,
                                     self.bidirectional)
            if x.unsorted_indices is not None:
                h_n = h_n.index_select(1, x.unsorted_indices)
            return PackedSequence(out, x.batch_sizes, x.sorted_indices, x.unsorted_indices), h_n
        B = x.shape[1]
        h = hx.to(self.dtype) if hx is not None else torch.zeros(self.num_layers * D, B, self.hidden_size,
                                                                 dtype=self.dtype, device=x.device)
        out, h_n = torch._VF.gru(x.to(self.dtype), h, flat, self.bias, self.num_layers, 0.0, False,
                                 self.bidirectional, False)
        return out, h_n

    def _native_forward(self, x: torch.Tensor, hx: Optional[torch.Tensor], lengths: Optional[torch.Tensor]):
        from . import cpu as wo_cpu
        T, B, _ = x.shape
        H = self.hidden_size
        D = 2 if self.bidirectional else 1
        inp = x.to(torch.float32)
        h_n = []
        for li, row in enumerate(self.layers()):
            outs = []
            for d, p in enumerate(row):
                h0 = hx[li * D + d].to(torch.float32) if hx is not None else \
                    torch.zeros(B, H, dtype=torch.float32, device=x.device)
                o, h = wo_cpu.gru_layer(inp, h0, p, d == 1, lengths)
                outs.append(o)
                h_n.append(h)
            inp = outs[0] if D == 1 else torch.cat(outs, -1)
        return inp, torch.stack(h_n)


def _dtype_name(dt: torch.dtype) -> str:
    return {v: k for k, v in WO_DTYPES.items()}[dt]


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _repack(out: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """out [T, B, F] in original batch order -> a PackedSequence with ``like``'s batch sizes and order."""
    from ..runtime import packed_rows  # one gather, not a Python loop over the steps
    return PackedSequence(packed_rows(out, like.batch_sizes, like.sorted_indices), like.batch_sizes,
                          like.sorted_indices, like.unsorted_indices)


# ---------------------------------------------------------------------------------------------
# calibration: the second moments GPTQ rounds against
# ---------------------------------------------------------------------------------------------
def _call(model: nn.Module, batch):
    if isinstance(batch, (tuple, list)) and not isinstance(batch, PackedSequence):
        return model(*batch)
    return model(batch)


def second_moments(gru: nn.GRU, batches: Iterable, model: Optional[nn.Module] = None
                   ) -> List[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """E[x x^T] of each layer's input and E[h h^T] of the state its R multiplies, per layer and
    direction, over the calls ``gru`` sees while ``model`` (or gru itself) runs ``batches``. The
    float GRU is re-run layer by layer in float64 on what it was given."""
    captured = []
    handle = gru.register_forward_pre_hook(lambda mod, args: captured.append(args))
    try:
        with torch.no_grad():
            for b in batches:
                _call(model if model is not None else gru, b)
    finally:
        handle.remove()
    if not captured:
        raise WeightOnlyError("gptq rounding: the calibration batches never called the GRU")
    D = 2 if gru.bidirectional else 1
    H = gru.hidden_size
    sums = [[[None, None, 0, 0] for _ in range(D)] for _ in range(gru.num_layers)]
    with torch.no_grad():
        for args in captured:
            inp = args[0]
            hx = args[1] if len(args) > 1 else None
            if isinstance(inp, PackedSequence):
                x, lengths = pad_packed_sequence(inp)
                if hx is not None and hx.dim() == 3:
                    pass
            else:
                x = inp.unsqueeze(0 if gru.batch_first else 1) if inp.dim() == 2 else inp
                if gru.batch_first:
                    x = x.transpose(0, 1)
                lengths = torch.full((x.shape[1],), x.shape[0], dtype=torch.int64, device="cpu")
                if hx is not None and hx.dim() == 2:
                    hx = hx.unsqueeze(1)
            x = x.double().cpu()
            T, B, _ = x.shape
            valid = (torch.arange(T, device="cpu").unsqueeze(1) < lengths.cpu().unsqueeze(0))  # [T, B]
            for li in range(gru.num_layers):
                outs = []
                for d in range(D):
                    sfx = f"_l{li}" + ("_reverse" if d else "")
                    W = getattr(gru, "weight_ih" + sfx).detach().double().cpu()
                    R = getattr(gru, "weight_hh" + sfx).detach().double().cpu()
                    b_ih = getattr(gru, "bias_ih" + sfx).detach().double().cpu() if gru.bias else torch.zeros(3 * H, dtype=torch.float64, device="cpu")
                    b_hh = getattr(gru, "bias_hh" + sfx).detach().double().cpu() if gru.bias else torch.zeros(3 * H, dtype=torch.float64, device="cpu")
                    h = hx[li * D + d].double().cpu() if hx is not None else torch.zeros(B, H, dtype=torch.float64, device="cpu")
                    out = torch.zeros(T, B, H, dtype=torch.float64, device="cpu")
                    hs = []
                    gi_all = x @ W.t() + b_ih
                    for t in (range(T) if d == 0 else reversed(range(T))):
                        hs.append(h[valid[t]])
                        gh = h @ R.t() + b_hh
                        gi = gi_all[t]
                        r = torch.sigmoid(gi[:, :H] + gh[:, :H])
                        z = torch.sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
                        n = torch.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
                        hn = (1 - z) * n + z * h
                        v = valid[t].unsqueeze(1)
                        h = torch.where(v, hn, h)
                        out[t] = torch.where(v, hn, torch.zeros_like(hn))
                    xv = x[valid]
                    hv = torch.cat(hs, 0)
                    s = sums[li][d]
                    s[0] = xv.t() @ xv if s[0] is None else s[0] + xv.t() @ xv
                    s[1] = hv.t() @ hv if s[1] is None else s[1] + hv.t() @ hv
                    s[2] += xv.shape[0]
                    s[3] += hv.shape[0]
                    outs.append(out)
                x = torch.cat(outs, -1)
    return [[(s[0] / max(s[2], 1), s[1] / max(s[3], 1)) for s in row] for row in sums]


def quantize_model_weight_only(model: nn.Module, batches: Optional[Iterable],
                               config: Union[str, dict, WeightOnlyConfig] = "w4g128",
                               progress: Optional[bool] = None) -> nn.Module:
    """A deep copy of ``model`` with every torch.nn.GRU replaced by a WeightOnlyGRU (``model`` itself
    is untouched). ``batches`` (called as in qgru.calibrate) feed gptq rounding; they are run once."""
    import copy
    config = WeightOnlyConfig.load(config)
    qmodel = copy.deepcopy(model)
    if batches is not None:
        batches = list(batches)
    if isinstance(qmodel, nn.GRU):
        if type(qmodel) is not nn.GRU:
            raise TypeError(f"weight-only mode converts torch.nn.GRU, not its subclass {type(qmodel).__name__}")
        return WeightOnlyGRU.from_float(qmodel, config, batches, progress=progress)
    grus = [(name, m) for name, m in qmodel.named_modules() if isinstance(m, nn.GRU)]
    if not grus:
        raise ValueError("quantize_model(): the model contains no torch.nn.GRU to quantize")
    for name, m in grus:
        if type(m) is not nn.GRU:
            raise TypeError(f"weight-only mode converts torch.nn.GRU, not its subclass {type(m).__name__} ({name!r})")
    done: Dict[int, nn.Module] = {}
    for name, g in grus:  # every GRU sees the batches through the whole float model
        if id(g) not in done:
            done[id(g)] = WeightOnlyGRU.from_float(g, config, batches, model=qmodel, progress=progress)
    _swap(qmodel, done)
    return qmodel


def _swap(module: nn.Module, done: Dict[int, nn.Module]) -> None:
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        if id(child) in done:
            setattr(module, name, done[id(child)])
        else:
            _swap(child, done)
