"""qgru.export_onnx: a whole model with converted QuantGRUs as one .onnx file (layer 5: workflow).

``export_onnx(model, args, path)`` exports ``model`` (any nn.Module; its GRUs converted QuantGRUs)
with torch's TorchScript-based ONNX exporter (``torch.onnx.export(..., dynamo=False)``: it needs
no package beyond torch, and it traces whatever the model does around its GRUs), with every
converted QuantGRU's integer forward recorded as one placeholder node (an autograd Function
with a ``symbolic``); then each placeholder is replaced by the integer GRU written with standard
ONNX operators (qgru/onnx_graph.py), the placeholder domain is dropped, the qgru version and the
GRUs' configs go into the model's metadata, and ``onnx.checker.check_model(full_check=True)``
runs before the file is written. docs/onnx.md has the design and the limits.

The module's own torch code around the integer forward (batch_first transposes, unbatched
inputs, a missing h0 made as zeros) is traced as any other layer, so the exported graph takes
what the model takes.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from .export import QuantParams
from .module import QuantGRU
from .onnx_graph import ONNXExportError  # (onnx_graph imports onnx only when it builds a graph)

PLACEHOLDER_DOMAIN = "qgru.placeholder"
_PACKED = ("a PackedSequence cannot be an ONNX input (ONNX has no packed sequences, and the exported "
           "integer GRU has no lengths input): export the model with padded tensors (its GRUs then run "
           "every step of every row; pad_packed_sequence's padding is not masked)")


class _Slot:
    """One converted QuantGRU met while tracing: its parameters and the dtype its outputs take."""

    def __init__(self, name: str, params: QuantParams):
        self.name, self.params = name, params
        self.dtype: Optional[torch.dtype] = None
        self.traced = 0  # calls seen while torch.onnx.export traces


class _IntegerGRU(torch.autograd.Function):
    """The integer forward as one traced node: forward runs it (so the trace has the right
    values and shapes), symbolic records a placeholder that export_onnx replaces."""

    @staticmethod
    def forward(ctx, x, hx, index: int, L: int, D: int, H: int, fn):
        return _run_untraced(fn, x, hx)

    @staticmethod
    def symbolic(g, x, hx, index, L, D, H, fn):
        out, h_n = g.op(f"{PLACEHOLDER_DOMAIN}::QuantGRU", x, hx, index_i=index, outputs=2)
        try:
            out.setType(x.type().with_sizes([None, None, D * H]))
            h_n.setType(x.type().with_sizes([L * D, None, H]))
        except Exception:  # a type without sizes: shape inference fills them after the splice
            out.setType(x.type())
            h_n.setType(x.type())
        return out, h_n


def _placeholder_forward(module: QuantGRU, index: int, slot: _Slot):
    original = module._forward_integer

    def forward_integer(x, hx, lengths):
        if lengths is not None:
            raise ONNXExportError(f"qgru.export_onnx: {slot.name}: {_PACKED}")
        slot.dtype = x.dtype
        if torch.jit.is_tracing():
            slot.traced += 1
            if slot.traced > 1:
                # the TorchScript tracer fails inside autograd.Function.apply on a second call
                # ("unordered_map::at", torch 2.13): say what is not supported instead
                raise ONNXExportError(f"qgru.export_onnx: {slot.name} is called more than once in one forward; "
                                    "the export supports one call per QuantGRU (use one module per call site)")
        D = 2 if module.bidirectional else 1
        return _IntegerGRU.apply(x, hx, index, module.num_layers, D, module.hidden_size, original)

    return forward_integer


def _run_untraced(original, x, hx):
    """The module's integer forward on concrete values, outside the tracer's view (the tracer
    records only the placeholder node)."""
    from .runtime import integer_forward
    module = original.__self__
    out, h_n = integer_forward(module._params_on(x.device), x.detach(), hx.detach(), None)
    # copies: the cpu backend hands out aliases of buffers it reuses on its next call
    return out.clone(), h_n.clone()


def _check_model(model: nn.Module) -> List[tuple]:
    """(name, module) of every converted QuantGRU; an error naming any GRU the export cannot take."""
    found = []
    for name, m in model.named_modules():
        label = name or type(model).__name__
        if isinstance(m, QuantGRU):
            if m.is_qat:
                raise ONNXExportError(f"qgru.export_onnx: {label} ({type(m).__name__}) is in QAT mode: convert it "
                                      "first (qgru.convert_qat(model))")
            if not m.is_converted:
                raise ONNXExportError(f"qgru.export_onnx: {label} ({type(m).__name__}) is not converted: calibrate "
                                      "and convert it first (qgru.quantize_model, or qgru.calibrate then convert())")
            found.append((label, m))
        elif isinstance(m, nn.GRU):
            raise ONNXExportError(f"qgru.export_onnx: {label} is a float {type(m).__name__}, not a converted "
                                  "qgru.QuantGRU: quantize the model first (qgru.quantize_model(model, batches))")
    if not found:
        raise ONNXExportError(f"qgru.export_onnx: {type(model).__name__} holds no converted qgru.QuantGRU "
                              "(nothing for qgru to export; torch.onnx.export exports a float model)")
    return found


def _flat_args(args) -> List[Any]:
    """the leaves of args (tuples, lists, dicts opened; a PackedSequence, itself a tuple, kept whole)"""
    out = []
    for a in args if isinstance(args, (tuple, list)) and not isinstance(args, PackedSequence) else (args,):
        if isinstance(a, PackedSequence):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out.extend(_flat_args(a))
        elif isinstance(a, dict):
            out.extend(_flat_args(list(a.values())))
        else:
            out.append(a)
    return out


def export_onnx(model: nn.Module, args, path: Union[str, os.PathLike], *,
                input_names: Optional[Sequence[str]] = None, output_names: Optional[Sequence[str]] = None,
                dynamic_axes: Optional[Dict[str, Any]] = None, opset: Optional[int] = None,
                integer_gemm: bool = True, check: bool = True) -> Path:
    """Write ``model`` (its GRUs converted QuantGRUs) as an ONNX file at ``path``, traced with the
    example ``args`` (a tensor or a tuple of positional arguments); returns the path.

    Every converted QuantGRU becomes its integer GRU in standard ONNX operators (bit for bit
    the module's outputs and h_n under ONNX Runtime's CPU provider); the other layers are exported
    as torch.onnx.export exports them. ``input_names`` / ``output_names`` default to input0, ... and
    output0, ...; ``dynamic_axes`` (torch.onnx.export's) defaults to every axis of every tensor
    input and output except the last (sequence length and batch, whatever the layout). ``opset``:
    qgru.onnx_graph.OPSET (17), the only one tested. ``integer_gemm``: 8-bit GEMMs as MatMulInteger
    (uint8 x int8 with the weights split in halves of magnitude <= 64, so that no CPU kernel
    saturates; fast); False writes float64 MatMuls instead (exact in any runtime, slower; see
    docs/onnx.md, "Limits"). ``check``: run
    onnx.checker.check_model(full_check=True) before writing.
    """
    try:
        import onnx
    except ImportError as e:  # the optional extra
        raise ImportError("qgru.export_onnx needs the onnx package: pip install 'qgru[onnx]'") from e
    __version__ = _qgru_version()
    from .onnx_graph import OPSET, Graph, gru_nodes

    if opset is not None and opset != OPSET:
        raise ONNXExportError(f"qgru.export_onnx: opset {opset} is not supported; the export writes opset {OPSET}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"qgru.export_onnx expects an nn.Module, got {type(model).__name__}")
    args = args if isinstance(args, tuple) else (args,)
    flat = _flat_args(args)
    if any(isinstance(a, PackedSequence) for a in flat):
        raise ONNXExportError(f"qgru.export_onnx: {_PACKED}")
    grus = _check_model(model)
    slots = []
    patched = []
    tensors_in = [a for a in flat if isinstance(a, torch.Tensor)]
    if input_names is None:
        input_names = [f"input{i}" for i in range(len(tensors_in))]
    try:
        for i, (name, m) in enumerate(grus):
            slot = _Slot(name, m.export())
            slots.append(slot)
            m._forward_integer = _placeholder_forward(m, i, slot)
            patched.append(m)
        with torch.no_grad():
            example_out = model(*args)
        outs = [o for o in _flat_args(example_out) if isinstance(o, torch.Tensor)]
        if output_names is None:
            output_names = [f"output{i}" for i in range(len(outs))]
        if dynamic_axes is None:
            dynamic_axes = {}
            for n, t in list(zip(input_names, tensors_in)) + list(zip(output_names, outs)):
                if t.dim() > 1:
                    dynamic_axes[n] = {k: f"{n}_dim{k}" for k in range(t.dim() - 1)}
        buf = io.BytesIO()
        was_training = model.training
        model.eval()
        try:
            import warnings
            # torch.device("cpu"): the exporter makes its shape constants on the default device, and
            # under a caller's torch.set_default_device("meta") it fails on them (torch 2.13)
            with warnings.catch_warnings(), torch.device("cpu"):
                warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
                torch.onnx.export(model, args, buf, dynamo=False, opset_version=OPSET, input_names=list(input_names),
                                  output_names=list(output_names), dynamic_axes=dynamic_axes,
                                  do_constant_folding=True)
        finally:
            model.train(was_training)
    finally:
        for m in patched:
            m.__dict__.pop("_forward_integer", None)
    proto = onnx.load_from_string(buf.getvalue())
    _bfloat16_constant_of_shape(proto.graph)
    _splice(proto, slots, Graph, gru_nodes, ONNXExportError, integer_gemm)
    meta = {"qgru_version": __version__, "qgru_opset": str(OPSET),
            "qgru_grus": json.dumps([{"module": s.name, "meta": s.params.meta} for s in slots], sort_keys=True)}
    for k, v in meta.items():
        e = proto.metadata_props.add()
        e.key, e.value = k, v
    proto.producer_name = "qgru"
    proto.producer_version = __version__
    if check:
        onnx.checker.check_model(proto, full_check=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(path))
    return path


def _qgru_version() -> str:
    """qgru.__version__ without importing the package namespace (layer 6) from here: the package is
    loaded whenever this module is (it is its parent)."""
    import sys
    v = getattr(sys.modules.get(__package__), "__version__", None)
    if v is None:
        from importlib.metadata import version
        v = version("qgru")
    return str(v)


def _bfloat16_constant_of_shape(graph) -> None:
    """Each bfloat16 ConstantOfShape (the zero h0 a QuantGRU makes for bfloat16 input without one, or
    any the model's own code traces) as a float32 ConstantOfShape and a Cast to bfloat16, in place:
    opset 17's ConstantOfShape has no bfloat16 output (opset 20 adds it), and the checker refuses
    the model. Every bfloat16 value is a float32 value, so the Cast gives the same tensor."""
    import onnx
    from onnx import numpy_helper
    BF16 = onnx.TensorProto.BFLOAT16
    nodes = []
    for node in graph.node:
        value = next((a for a in node.attribute if a.name == "value"), None)
        if node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx") or value is None \
                or value.t.data_type != BF16:
            nodes.append(node)
            continue
        v = numpy_helper.to_array(value.t)  # (float32 or ml_dtypes.bfloat16, by onnx version)
        f32 = numpy_helper.from_array(np.asarray(v, dtype=np.float32).reshape(1), value.t.name or "value")
        mid = f"{node.output[0]}_float32"
        nodes.append(onnx.helper.make_node("ConstantOfShape", list(node.input), [mid], name=f"{node.name}_float32",
                                           value=f32))
        nodes.append(onnx.helper.make_node("Cast", [mid], list(node.output), name=f"{node.name}_to_bfloat16",
                                           to=BF16))
    del graph.node[:]
    graph.node.extend(nodes)


_DTYPES = {torch.float32: 1, torch.float64: 11, torch.float16: 10, torch.bfloat16: 16}


def _splice(proto, slots: List[_Slot], Graph, gru_nodes, ONNXExportError, integer_gemm: bool = True) -> None:
    """Replace each placeholder node by its GRU's nodes and initializers, in place."""
    graph = proto.graph
    nodes = list(graph.node)
    new_nodes = []
    seen: List[int] = []
    for node in nodes:
        if node.domain != PLACEHOLDER_DOMAIN:
            new_nodes.append(node)
            continue
        index = next(a.i for a in node.attribute if a.name == "index")
        slot = slots[index]
        if slot.dtype not in _DTYPES:
            raise ONNXExportError(f"qgru.export_onnx: {slot.name}: input dtype {slot.dtype} has no ONNX form here")
        g = Graph(f"qgru{index}_{len(seen)}_")  # a module called twice gets two subgraphs
        seen.append(index)
        gru_nodes(slot.params, g, node.input[0], node.input[1], node.output[0], node.output[1],
                  _DTYPES[slot.dtype], where=slot.name, integer_gemm=integer_gemm)
        new_nodes.extend(g.nodes)
        graph.initializer.extend(g.inits)
    if not seen:
        raise ONNXExportError("qgru.export_onnx: the traced graph holds no QuantGRU: the example args did not "
                              "reach any converted QuantGRU's forward")
    del graph.node[:]
    graph.node.extend(new_nodes)
    keep = [o for o in proto.opset_import if o.domain != PLACEHOLDER_DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(keep)
    # the exporter's value_info for the placeholder outputs may carry guessed shapes: drop them
    outs = {o for n in nodes if n.domain == PLACEHOLDER_DOMAIN for o in n.output}
    keep_vi = [v for v in graph.value_info if v.name not in outs]
    del graph.value_info[:]
    graph.value_info.extend(keep_vi)
