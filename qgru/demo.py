"""``python -m qgru demo``: quantize a real recurrent model end to end and print one table.

The default needs no network: the Japanese Vowels speaker-recognition data set (UCI; 640
utterances as sequences of 12 LPC cepstrum coefficients, 7 to 29 frames long, 9 speakers; shipped
in qgru/data/, see its README.md for source and license) and a 2-layer bidirectional GRU trained
on it (hidden 32, a linear head on the last layer's final states; qgru/data/japanese_vowels_gru.pt,
reproduced by ``train_model()`` / ``--retrain``). Sequences have their own lengths and go through
the GRU as PackedSequences.

Steps: the cpu backend is compiled where it is not built yet and a compiler is there (a progress
line; ``--no-build`` skips it); every nn.GRU is swapped by ``qgru.quantize_model`` for each config
and scale mode, calibrated on the training split (progress bar), converted, and evaluated on the
test split next to the float model and torch's dynamic-quant GRU (where the installed torch still
ships it). One table: test accuracy, agreement with the float model's predictions, SQNR of the
logits and of each GRU layer's output sequence against float, and each model's inference time over
the test split in this run with its speed against float and dynamic quant; the header names the
CPU and the cpu backend's path. Written to the output folder: the table (table.md), the
exported integer models (``QuantParams.save``, one .qgru per config), the first config as data for
the C runtime (``qgru.export_mcu.write_mcu``: every layer and direction, its x levels, golden
vectors), the error per layer and time step (errors.csv and, with matplotlib,
error_per_layer.png).

The same runs on your own model and data: ``run(model, calib_batches, test_batches, targets)``
from Python, or ``python -m qgru demo --model model.pt --data data.pt`` (see ``load_user_inputs``).
"""
from __future__ import annotations

import argparse
import copy
import csv
import math
import pickle
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

from .calibrate import quantize_model
from .compare import sqnr_db
from .config import QuantConfig
from .export import QuantParams
from .module import QuantGRU

DATA_DIR = Path(__file__).resolve().parent / "data"
DATASET = DATA_DIR / "japanese_vowels.npz"
CHECKPOINT = DATA_DIR / "japanese_vowels_gru.pt"
DEFAULT_CONFIGS = ("w8a8", "w8a16", "w16a16")
DEFAULT_SCALE_MODES = ("pow2", "multiplier")
TRAIN_SEED = 0
BATCH = 27  # training and calibration batch size (270 training sequences: 10 batches)


# ---------------------------------------------------------------------------------------------
# data and model
# ---------------------------------------------------------------------------------------------
def load_dataset(path=DATASET) -> Dict[str, Tuple[List[torch.Tensor], torch.Tensor]]:
    """{"train": (sequences, labels), "test": (...)}: sequences are float32 [T_i, 12] tensors,
    labels int64 speakers 0..8 (qgru/data/README.md describes the file)."""
    with np.load(path, allow_pickle=False) as d:
        out = {}
        for split in ("train", "test"):
            x = torch.from_numpy(d[f"{split}_x"])
            lengths = d[f"{split}_lengths"].tolist()
            out[split] = (list(torch.split(x, lengths)), torch.from_numpy(d[f"{split}_y"]))
    return out


class SpeakerGRU(nn.Module):
    """Feature standardization, a multi-layer (bidirectional) nn.GRU over a PackedSequence, and a
    linear classifier on the last layer's final hidden states."""

    def __init__(self, input_size: int = 12, hidden_size: int = 32, num_layers: int = 2,
                 bidirectional: bool = True, num_classes: int = 9, dropout: float = 0.2):
        super().__init__()
        self.register_buffer("mean", torch.zeros(input_size))
        self.register_buffer("std", torch.ones(input_size))
        self.gru = nn.GRU(input_size, hidden_size, num_layers, dropout=dropout, bidirectional=bidirectional)
        self.head = nn.Linear(hidden_size * (2 if bidirectional else 1), num_classes)

    def hparams(self) -> dict:
        g = self.gru
        return {"input_size": g.input_size, "hidden_size": g.hidden_size, "num_layers": g.num_layers,
                "bidirectional": g.bidirectional, "num_classes": self.head.out_features, "dropout": g.dropout}

    def forward(self, x: PackedSequence) -> torch.Tensor:
        x = PackedSequence((x.data - self.mean) / self.std, x.batch_sizes, x.sorted_indices, x.unsorted_indices)
        _, h_n = self.gru(x)
        d = 2 if self.gru.bidirectional else 1
        return self.head(torch.cat(list(h_n[-d:]), dim=-1))  # last layer, every direction


def batches(seqs: Sequence[torch.Tensor], size: int = BATCH) -> List[PackedSequence]:
    """Consecutive PackedSequence batches (original order kept: enforce_sorted=False)."""
    return [pack_sequence(list(seqs[i:i + size]), enforce_sorted=False) for i in range(0, len(seqs), size)]


def train_model(data=None, epochs: int = 20, seed: int = TRAIN_SEED, lr: float = 1e-2,
                log=print) -> SpeakerGRU:
    """Train SpeakerGRU on the training split (a few seconds on one core). Deterministic for a given
    seed, torch version and thread count; the shipped checkpoint was trained with 1 thread."""
    data = data or load_dataset()
    xs, ys = data["train"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = SpeakerGRU()
        allx = torch.cat(xs)
        model.mean.copy_(allx.mean(0))
        model.std.copy_(allx.std(0))
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-4)
        gen = torch.Generator().manual_seed(seed)
        model.train()
        for epoch in range(epochs):
            perm = torch.randperm(len(xs), generator=gen)
            total = 0.0
            for i in range(0, len(xs), BATCH):
                idx = perm[i:i + BATCH]
                logits = model(pack_sequence([xs[j] for j in idx], enforce_sorted=False))
                loss = nn.functional.cross_entropy(logits, ys[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(idx)
            if log and (epoch + 1) % 5 == 0:
                log(f"  epoch {epoch + 1:3d}: training loss {total / len(xs):.4f}")
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def save_checkpoint(model: SpeakerGRU, path, test_accuracy: float) -> None:
    torch.save({"hparams": model.hparams(), "state_dict": model.state_dict(), "test_accuracy": test_accuracy,
                "seed": TRAIN_SEED, "torch": str(torch.__version__)}, str(path))


def load_checkpoint(path=CHECKPOINT) -> Tuple[SpeakerGRU, dict]:
    ckpt = torch.load(str(path), weights_only=True)
    model = SpeakerGRU(**ckpt["hparams"])
    model.load_state_dict(ckpt["state_dict"])
    return model.eval(), ckpt


# ---------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------
def _out_tensor(out) -> torch.Tensor:
    """The tensor a model's output is judged on: the output itself, the data of a PackedSequence,
    or the first element of a tuple (e.g. a GRU's output sequence)."""
    if isinstance(out, PackedSequence):
        return out.data
    if isinstance(out, (tuple, list)):
        return _out_tensor(out[0])
    return out


def _call(model: nn.Module, batch):
    if isinstance(batch, (tuple, list)) and not isinstance(batch, PackedSequence):
        return model(*batch)
    return model(batch)


def _time_major(out, batch_first: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A GRU output (PackedSequence, [T,N,F], [N,T,F] or unbatched [T,F]) as [T, N, F] + lengths."""
    if isinstance(out, PackedSequence):
        x, lengths = pad_packed_sequence(out)
        return x, lengths
    if out.dim() == 2:
        return out.unsqueeze(1), None
    return (out.transpose(0, 1) if batch_first else out), None




def _first_layers_float(gru: nn.GRU, k: int) -> nn.GRU:
    if k == gru.num_layers:
        return gru
    w = gru.weight_ih_l0
    g = nn.GRU(gru.input_size, gru.hidden_size, k, gru.bias, gru.batch_first, 0.0, gru.bidirectional,
               device=w.device, dtype=w.dtype)
    sd = {n: v for n, v in gru.state_dict().items() if int(n.split("_l")[1].split("_")[0]) < k}
    g.load_state_dict(sd)
    return g.eval()


def _first_layers_quant(q: QuantGRU, k: int) -> QuantGRU:
    """The first k layers of a converted QuantGRU: the same integer computation, so its outputs are
    exactly layer k-1's outputs inside the full model."""
    if k == q.num_layers:
        return q
    p = q.export()
    sub = QuantParams(meta=dict(p.meta, num_layers=k), layers=p.layers[:k]).to_module()
    return sub.to(q.weight_ih_l0.device).eval()


class _LayerErrors:
    """Per GRU module, per layer and per time step: sum of ref^2 and of err^2 over the test set."""

    def __init__(self) -> None:
        self.sums: Dict[Tuple[str, int], List[np.ndarray]] = {}  # -> [signal[T], noise[T], count[T]]

    def add(self, key, ref: torch.Tensor, out: torch.Tensor, lengths: Optional[torch.Tensor]) -> None:
        ref, out = ref.detach().cpu().double(), out.detach().cpu().double()
        lengths = None if lengths is None else lengths.cpu()
        T, N = ref.shape[:2]
        sig = ref.pow(2).sum(dim=(1, 2)).numpy()
        noise = (out - ref).pow(2).sum(dim=(1, 2)).numpy()
        cpu = torch.device("cpu")
        cnt = ((lengths.unsqueeze(0) > torch.arange(T, device=cpu).unsqueeze(1)).sum(1) if lengths is not None
               else torch.full((T,), N, device=cpu)).numpy().astype(np.float64)
        acc = self.sums.setdefault(key, [np.zeros(0)] * 3)
        for i, v in enumerate((sig, noise, cnt)):
            a = acc[i]
            if len(a) < T:
                a = np.concatenate([a, np.zeros(T - len(a))])
            a[:T] += v
            acc[i] = a

    def per_layer(self) -> Dict[Tuple[str, int], float]:
        return {k: sqnr_db(s.sum(), n.sum()) for k, (s, n, _) in self.sums.items()}

    def per_step(self) -> Dict[Tuple[str, int], List[Tuple[int, float, int]]]:
        return {k: [(t, sqnr_db(s[t], n[t]), int(c[t])) for t in range(len(s))]
                for k, (s, n, c) in self.sums.items()}


def _gru_modules(model: nn.Module, cls=nn.GRU) -> Dict[str, nn.GRU]:
    return {name: m for name, m in model.named_modules() if isinstance(m, cls)}


def _capture_gru_inputs(model: nn.Module, batches_, cls) -> Tuple[list, Dict[str, list]]:
    """Run the model over the batches; -> (outputs, {gru name: [(input, hx), ...]})."""
    grus = _gru_modules(model, cls)
    seen: Dict[str, list] = {n: [] for n in grus}
    handles = []
    for name, g in grus.items():
        def hook(mod, args, kwargs, name=name):
            inp = args[0] if args else kwargs["input"]
            hx = args[1] if len(args) > 1 else kwargs.get("hx")
            seen[name].append((inp, hx))
        handles.append(g.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            outs = [_call(model, b) for b in batches_]
    finally:
        for h in handles:
            h.remove()
    return outs, seen


@dataclass
class Row:
    name: str
    accuracy: Optional[float]        # % on the test targets (None without targets)
    agreement: Optional[float]       # % of test predictions equal to the float model's (idem)
    sqnr: float                      # dB, model outputs vs float
    layer_sqnr: Dict[Tuple[str, int], float]  # (gru name, layer) -> dB of that layer's outputs
    seconds: float                   # quantize (calibrate + convert) + evaluate
    infer_ms: Optional[float] = None  # one pass of the model over the test batches, ms (best of repeats)


@dataclass
class Result:
    rows: List[Row]
    models: Dict[str, nn.Module]      # row name -> model (the float one included)
    per_step: Dict[str, Dict[Tuple[str, int], List[Tuple[int, float, int]]]] = field(default_factory=dict)
    files: List[Path] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    backend: str = ""
    where: str = ""                   # the CPU (lscpu's model name) and the cpu backend's path, or the device

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)


def dynamic_quant(model: nn.Module) -> Tuple[Optional[nn.Module], str]:
    """torch's dynamic-quant GRU (int8 weights, float activations) swapped into a copy of ``model``,
    or (None, reason) where the installed torch no longer ships it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.ao.quantization import quantize_dynamic
            if isinstance(model, nn.GRU):
                return quantize_dynamic(nn.Sequential(copy.deepcopy(model)), {nn.GRU}, dtype=torch.qint8)[0], ""
            return quantize_dynamic(copy.deepcopy(model), {nn.GRU}, dtype=torch.qint8), ""
    except Exception as e:  # noqa: BLE001 - any reason it is unavailable is reported, not fatal
        return None, f"torch {torch.__version__} has no usable dynamic-quant GRU ({type(e).__name__}: {e})"


def _native_ready(kind: str) -> bool:
    """Whether a native backend is usable *without compiling it now* (a build takes a minute)."""
    from . import native
    try:
        if kind in native.build._state.modules:
            return True
        if native.build._find_binary(kind) is None:
            return False
        return native.why_unavailable(kind) == ""
    except Exception:  # noqa: BLE001 - anything unexpected: use the reference backend
        return False


def _compiler() -> Optional[str]:
    """The C++ compiler torch.utils.cpp_extension would run ($CXX, else c++), or None."""
    import os
    import shutil
    return shutil.which(os.environ.get("CXX", "c++"))


def build_native(kind: str = "cpu", progress: bool = True, log=print) -> str:
    """Compile (or load) native backend ``kind`` with a progress line ticking the elapsed time; ->
    '' when it loads, else the reason."""
    import threading
    from tqdm.auto import tqdm
    from . import native
    if log:
        log(f"qgru demo: building the {kind} backend (once: about a minute on 2 cores; cached in "
            f"{native.build_dir(kind).parent}; `--backend reference` skips it)")
    why: List[str] = []
    worker = threading.Thread(target=lambda: why.append(native.why_unavailable(kind)), daemon=True)
    t0 = time.perf_counter()
    worker.start()
    with tqdm(desc=f"qgru build {kind}", bar_format="{desc}: {elapsed}", disable=not progress) as bar:
        while worker.is_alive():
            worker.join(0.5)
            bar.refresh()
    if log:
        log(f"qgru demo: the {kind} backend " + (f"did not build: {why[0]}" if why[0] else
                                                 f"is ready ({time.perf_counter() - t0:.0f} s)"))
    return why[0]


def choose_backend(name: str = "auto", device_type: str = "cpu", build: bool = True,
                   progress: bool = True, log=print) -> Tuple[Optional[str], str]:
    """-> (backend name, note). ``auto`` on CPU: the cpu backend, built now (``build_native``, with a
    progress line) where it is not built yet and a C++ compiler is there (not with ``build=False`` or
    QGRU_NO_BUILD=1); else reference (bit-identical results, slower: the note says why); on another
    device: None (qgru's own default for that device)."""
    import os
    if name != "auto":
        return name, ""
    if device_type != "cpu":
        return None, ""
    if _native_ready("cpu"):
        return "cpu", ""
    if not build or os.environ.get("QGRU_NO_BUILD") == "1":
        reason = "QGRU_NO_BUILD=1" if build else "--no-build"
    elif _compiler() is None:
        reason = "no C++ compiler was found (c++ or $CXX)"
    else:
        why = build_native("cpu", progress=progress, log=log)
        if not why:
            return "cpu", ""
        reason = f"it did not build: {why}"
    return "reference", (f"the cpu backend is not built ({reason}), so the integer models run on the reference "
                         "backend (bit-identical results, far slower: its inference times are not the cpu "
                         "backend's); `python -m qgru build` compiles it (about a minute)")


def where_it_runs(backend: Optional[str], device_type: str) -> str:
    """The machine and path the integer models run on, for the table's header."""
    if device_type != "cpu":
        return f"{device_type} ({torch.cuda.get_device_name() if device_type == 'cuda' else device_type})"
    from .native.build import cpu_model_name
    cpu = f"CPU {cpu_model_name() or platform.processor() or platform.machine()}"
    if backend == "cpu":
        from .native.cpu import resolve_cpu_isa
        try:
            return f"{cpu}, cpu backend path {resolve_cpu_isa()['name']}"
        except ValueError as e:
            return f"{cpu}, cpu backend ({_first_line(e)})"
    return f"{cpu}, {backend} backend"


def time_inference(model: nn.Module, batches_: Sequence, repeats: int = 5) -> float:
    """ms of one pass of ``model`` over ``batches_`` (no_grad), the best of ``repeats`` after a warm-up
    pass; CUDA work is synchronised inside each timed pass."""
    best = math.inf
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with torch.no_grad():
        for i in range(repeats + 1):
            sync()
            t = time.perf_counter()
            for b in batches_:
                _call(model, b)
            sync()
            if i:
                best = min(best, time.perf_counter() - t)
    return 1e3 * best


def run(model: nn.Module, calib_batches: Sequence, test_batches: Sequence,
        targets: Optional[Sequence[torch.Tensor]] = None,
        configs: Sequence[str] = DEFAULT_CONFIGS, scale_modes: Sequence[str] = DEFAULT_SCALE_MODES,
        backend: str = "auto", dynamic: bool = True, progress: bool = True, log=print,
        build: bool = True, timing_repeats: int = 5) -> Result:
    """Quantize ``model`` (every nn.GRU in it) with each config and scale mode, calibrating on
    ``calib_batches``; evaluate on ``test_batches`` next to the float model and (``dynamic``) torch's
    dynamic-quant GRU. ``targets`` (one label tensor per test batch) adds accuracy, for models whose
    output's last dimension is class scores. Batches are called as in qgru.calibrate. ``model`` is
    put in eval mode and otherwise left as it is (the quantized models are copies). Each row also
    times one pass over ``test_batches`` (``time_inference``, best of ``timing_repeats``; 0: not
    timed). ``backend`` "auto" on the CPU builds the cpu backend where it can (``choose_backend``)."""
    import contextlib
    from .backends import backend as force_backend
    model = model.eval()
    try:
        device_type = next(model.parameters()).device.type
    except StopIteration:
        device_type = "cpu"
    backend, note = choose_backend(backend, device_type, build=build, progress=progress, log=log)
    result = Result(rows=[], models={}, backend=backend or f"default {device_type}",
                    where=where_it_runs(backend, device_type))
    if note:
        result.notes.append(note)
    if dynamic and device_type != "cpu":
        dynamic = False
        result.notes.append(f"torch's dynamic-quant GRU runs on the CPU only: its row is left out on {device_type}")
    calib_batches, test_batches = list(calib_batches), list(test_batches)
    float_grus = _gru_modules(model)
    if not float_grus:
        raise ValueError("the model contains no torch.nn.GRU")

    t0 = time.perf_counter()
    ref_outs, ref_inputs = _capture_gru_inputs(model, test_batches, nn.GRU)
    ref = [_out_tensor(o).double() for o in ref_outs]
    ref_pred = [r.argmax(-1) for r in ref]
    # every layer of every GRU on the float model's own inputs: the reference for the layer errors
    ref_layers: Dict[Tuple[str, int], list] = {}
    with torch.no_grad():
        for name, g in float_grus.items():
            for k in range(1, g.num_layers + 1):
                sub = _first_layers_float(g, k)
                ref_layers[(name, k - 1)] = [
                    _time_major(sub(inp, None if hx is None else hx[:k * (2 if g.bidirectional else 1)])[0],
                                g.batch_first) for inp, hx in ref_inputs[name]]
    float_seconds = time.perf_counter() - t0

    def evaluate(name: str, m: nn.Module, cls, seconds0: float, first_layers) -> None:
        """first_layers(gru name, k) -> a module running the first k layers of that GRU of ``m``."""
        t = time.perf_counter()
        outs, inputs = _capture_gru_inputs(m, test_batches, cls)
        errs = _LayerErrors()
        with torch.no_grad():
            for (gname, layer), refs in ref_layers.items():
                g = float_grus[gname]
                d = 2 if g.bidirectional else 1
                sub = first_layers(gname, layer + 1)
                for (inp, hx), (r, lengths) in zip(inputs[gname], refs):
                    o, _ = _time_major(sub(inp, None if hx is None else hx[:(layer + 1) * d])[0], g.batch_first)
                    errs.add((gname, layer), r, o, lengths)
        out = [_out_tensor(o).double() for o in outs]
        signal = sum(float(r.pow(2).sum()) for r in ref)
        noise = sum(float((o - r).pow(2).sum()) for o, r in zip(out, ref))
        acc = agree = None
        if targets is not None:  # a classifier: the argmax of its outputs is the prediction
            pred = [o.argmax(-1) for o in out]
            agree = 100 * sum(int((p == q).sum()) for p, q in zip(pred, ref_pred)) / sum(p.numel() for p in pred)
            acc = 100 * sum(int((p == y.to(p.device)).sum()) for p, y in zip(pred, targets)) / \
                sum(y.numel() for y in targets)
        seconds = seconds0 + time.perf_counter() - t
        infer = time_inference(m, test_batches, timing_repeats) if timing_repeats > 0 else None
        result.rows.append(Row(name, acc, agree, sqnr_db(signal, noise), errs.per_layer(), seconds, infer))
        result.per_step[name] = errs.per_step()
        result.models[name] = m

    evaluate("float", model, nn.GRU, float_seconds, lambda n, k: _first_layers_float(float_grus[n], k))
    if dynamic:
        t = time.perf_counter()
        dq, why = dynamic_quant(model)
        if dq is None:
            result.notes.append(why)
        else:
            modules = dict(dq.named_modules())
            dq_cls = type(modules[next(iter(float_grus))])
            # torch quantizes each layer's weights on its own: the first k layers of a dynamic-quant
            # GRU are the dynamic-quant version of the float GRU's first k layers
            evaluate("torch dynamic-quant int8", dq, dq_cls, time.perf_counter() - t,
                     lambda n, k: modules[n] if k == float_grus[n].num_layers
                     else dynamic_quant(_first_layers_float(float_grus[n], k))[0])

    with (force_backend(backend) if backend else contextlib.nullcontext()):
        for cfg in configs:
            for mode in scale_modes:
                name = f"qgru {cfg} ({mode})"
                if log:
                    log(f"{name}: calibrating on {len(calib_batches)} batches")
                t = time.perf_counter()
                config = QuantConfig.load(cfg, overrides={"scale_mode": mode})
                q = quantize_model(model, calib_batches, config=config, progress=progress)
                qgrus = _gru_modules(q, QuantGRU)
                evaluate(name, q, QuantGRU, time.perf_counter() - t,
                         lambda n, k, qgrus=qgrus: _first_layers_quant(qgrus[n], k))
    return result


# ---------------------------------------------------------------------------------------------
# output: table, files, plot
# ---------------------------------------------------------------------------------------------
def _fmt_db(v: float) -> str:
    return "inf" if v == math.inf else f"{v:.2f}"


def format_table(result: Result) -> str:
    keys = sorted({k for r in result.rows for k in r.layer_sqnr})
    single = len({g for g, _ in keys}) == 1
    lcols = [f"layer {l}" if single else f"{g or 'gru'} l{l}" for g, l in keys]
    has_acc = any(r.accuracy is not None for r in result.rows)
    timed = any(r.infer_ms is not None for r in result.rows)
    base = {n: next((r.infer_ms for r in result.rows if r.name == n), None)
            for n in ("float", "torch dynamic-quant int8")}
    speed = [("vs float", base["float"])] + ([("vs dyn-quant", base["torch dynamic-quant int8"])]
                                             if base["torch dynamic-quant int8"] else [])
    head = ["model"] + (["accuracy (%)", "agrees (%)"] if has_acc else []) + ["output SQNR (dB)"] + \
        [f"{c} SQNR (dB)" for c in lcols] + \
        ((["inference (ms)"] + [f"speed {n}" for n, b in speed if b]) if timed else []) + ["quantize+eval (s)"]
    lines = []
    for r in result.rows:
        cells = [r.name] + ([f"{r.accuracy:.2f}", f"{r.agreement:.2f}"] if has_acc else []) + [_fmt_db(r.sqnr)] + \
            [_fmt_db(r.layer_sqnr[k]) if k in r.layer_sqnr else "-" for k in keys]
        if timed:
            cells += ["-" if r.infer_ms is None else f"{r.infer_ms:.2f}"] + \
                ["-" if r.infer_ms is None else f"{b / r.infer_ms:.2f}x" for _, b in speed if b]
        lines.append(cells + [f"{r.seconds:.2f}"])
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(head), sep] + [fmt(c) for c in lines])


def write_errors_csv(result: Result, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "gru", "layer", "t", "sqnr_db", "sequences"])
        for name, per in result.per_step.items():
            for (g, layer), steps in sorted(per.items()):
                for t, db, n in steps:
                    w.writerow([name, g, layer, t, f"{db:.4f}", n])


def plot_errors(result: Result, path: Path) -> Optional[str]:
    """error_per_layer.png: output SQNR against float per time step, one panel per GRU layer, one
    line per model. Returns a note instead when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("matplotlib is not installed, so no plot was drawn (pip install 'qgru[plot]' adds it); "
                "the same numbers are in errors.csv")
    keys = sorted({k for per in result.per_step.values() for k in per})
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2), squeeze=False, sharey=True)
    for ax, key in zip(axes[0], keys):
        for name, per in result.per_step.items():
            if key not in per or name == "float":
                continue
            steps = [(t, db) for t, db, n in per[key] if n > 0 and math.isfinite(db)]
            if steps:
                ax.plot([t for t, _ in steps], [db for _, db in steps], marker=".", label=name)
        g, layer = key
        ax.set_title(f"{g + ' ' if g and len({k[0] for k in keys}) > 1 else ''}GRU layer {layer}")
        ax.set_xlabel("time step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("SQNR vs float (dB), higher is better")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=8, frameon=False)
    fig.suptitle("Quantization error per layer and time step (test split)")
    fig.tight_layout(rect=(0, 0.06 + 0.035 * ((len(labels) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(result: Result, out, c_layer: bool = True) -> None:
    """Into folder ``out``: table.md, one .qgru file per qgru model (and per GRU in it), the first
    one as data for the C runtime (``c_layer``: qgru.export_mcu.write_mcu, the whole model), errors.csv
    and error_per_layer.png (with matplotlib)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(result)
    (out / "table.md").write_text(table + "\n")
    result.files.append(out / "table.md")
    first = True
    for name, m in result.models.items():
        if not name.startswith("qgru "):
            continue
        stem = name[len("qgru "):].replace(" (", "-").replace(")", "")  # "w8a8-pow2"
        for gname, g in _gru_modules(m, QuantGRU).items():
            params = g.export()
            many = len(_gru_modules(m, QuantGRU)) > 1
            f = out / f"{stem}{'.' + (gname or 'gru') if many else ''}.qgru"
            params.save(f)
            result.files.append(f)
            if first and c_layer:
                from .export_mcu import write_mcu
                result.files.extend(write_mcu(params, out / "c" / stem / "gru"))
                first = False
    write_errors_csv(result, out / "errors.csv")
    result.files.append(out / "errors.csv")
    note = plot_errors(result, out / "error_per_layer.png")
    if note:
        result.notes.append(note)
    else:
        result.files.append(out / "error_per_layer.png")


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
MODEL_FILE_WARNING = ("--model {path} is loaded with torch.load(weights_only=False): a whole nn.Module is unpickled "
                      "in full, which runs whatever code the file holds. Only use a model file you trust "
                      "(one you saved yourself).")


def load_user_inputs(model_path: str, data_path: str):
    """``--data``: a dict saved with torch.save with "calib" (list of batches), "test" (list of
    batches) and optionally "targets" (one label tensor per test batch), loaded with
    ``weights_only=True`` (tensors and plain containers only, nothing else is unpickled).
    ``--model``: a whole nn.Module saved with torch.save(model). A module can only be unpickled in
    full (``weights_only=False``), which runs any code the file holds: a warning on stderr says so
    before it is loaded. Use model files you trust."""
    try:
        data = torch.load(data_path, weights_only=True)
    except OSError as e:
        raise SystemExit(f"--data {data_path}: cannot read it ({e.strerror or e})")
    except pickle.UnpicklingError as e:
        raise SystemExit(f"--data {data_path}: refused: it holds more than tensors and plain containers (lists, "
                         f"dicts, numbers) and is loaded with weights_only=True ({_first_line(e)})")
    except (EOFError, RuntimeError, KeyError, ValueError) as e:
        raise SystemExit(f"--data {data_path}: not a file written by torch.save ({type(e).__name__}: {_first_line(e)})")
    if not isinstance(data, dict):
        raise SystemExit(f"--data {data_path}: expected a dict with keys calib, test, targets, "
                         f"got {type(data).__name__}")
    missing = {"calib", "test"} - set(data)
    if missing:
        raise SystemExit(f"--data {data_path}: missing {sorted(missing)} (keys: calib, test, targets)")
    print(f"qgru demo: warning: {MODEL_FILE_WARNING.format(path=model_path)}", file=sys.stderr, flush=True)
    try:
        model = torch.load(model_path, weights_only=False)
    except OSError as e:
        raise SystemExit(f"--model {model_path}: cannot read it ({e.strerror or e})")
    except (AttributeError, ImportError) as e:
        if not isinstance(e, ImportError) and "Can't get attribute" not in str(e):
            raise
        # pickle records a class by module and name; a class defined in the script that saved the
        # model is recorded as __main__.Name, which is not that script once qgru runs
        raise SystemExit(f"--model {model_path}: the model's class cannot be imported ({_first_line(e)}): "
                         f"it must be defined in a module on PYTHONPATH and imported by the script that saves "
                         f"the model, not defined in that script (whose classes are saved as __main__.Name)")
    except (pickle.UnpicklingError, EOFError, RuntimeError) as e:
        raise SystemExit(f"--model {model_path}: not a model written by torch.save(model) "
                         f"({type(e).__name__}: {_first_line(e)})")
    if not isinstance(model, nn.Module):
        raise SystemExit(f"--model {model_path}: expected a saved torch.nn.Module, got {type(model).__name__}")
    return model, data["calib"], data["test"], data.get("targets")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def check_arguments(args) -> Tuple[List[str], List[str]]:
    """The demo's arguments, checked before anything is loaded or run: -> (configs, scale modes).
    A bad one stops it with a one-line message naming it (SystemExit, exit status 1), as a bad
    --data file does, instead of a traceback minutes later."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    modes = [m.strip() for m in args.scale_modes.split(",") if m.strip()]
    if not configs:
        raise SystemExit(f"--configs {args.configs!r}: no config given (e.g. {','.join(DEFAULT_CONFIGS)})")
    if not modes:
        raise SystemExit(f"--scale-modes {args.scale_modes!r}: no scale mode given "
                         f"(e.g. {','.join(DEFAULT_SCALE_MODES)})")
    for m in modes:
        try:
            QuantConfig.load(DEFAULT_CONFIGS[0], overrides={"scale_mode": m})
        except (ValueError, TypeError) as e:
            raise SystemExit(f"--scale-modes {m}: {_first_line(e)}")
    for c in configs:
        try:
            QuantConfig.load(c)
        except (ValueError, TypeError, OSError) as e:
            raise SystemExit(f"--configs {c}: {_first_line(e)}")
        for m in modes:
            try:
                QuantConfig.load(c, overrides={"scale_mode": m})
            except (ValueError, TypeError) as e:
                raise SystemExit(f"--scale-modes {m}" + (f" (with --configs {c})" if len(configs) > 1 else "")
                                 + f": {_first_line(e)}")
    if getattr(args, "repeats", 5) < 0:
        raise SystemExit(f"--repeats {args.repeats}: must be >= 0 (0: no inference times)")
    if args.threads < 0:
        raise SystemExit(f"--threads {args.threads}: must be a number of threads >= 1 (or 0: keep torch's)")
    if bool(args.model) != bool(args.data):
        raise SystemExit("--model and --data go together")
    for opt, path in (("--model", args.model), ("--data", args.data)):
        if path and not Path(path).is_file():
            raise SystemExit(f"{opt} {path}: " + ("a folder, not a file" if Path(path).is_dir() else "no such file"))
    return configs, modes


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="qgru-demo", help="output folder (default: ./qgru-demo)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--scale-modes", default=",".join(DEFAULT_SCALE_MODES), help="comma-separated (default: %(default)s)")
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "cuda"],
                    help="integer backend; auto: on the CPU, cpu if already built, else reference (same "
                         "results); on a GPU, cuda")
    ap.add_argument("--device", default="cpu",
                    help="where the model, its calibration and its evaluation run: cpu (default) or cuda[:N] "
                         "(torch's dynamic-quant row is CPU-only and is left out there)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the model is tiny, threads only add overhead; 0 keeps torch's)")
    ap.add_argument("--retrain", action="store_true",
                    help="train the float model from scratch (seeded) instead of loading the shipped checkpoint; "
                         "writes it to OUT/japanese_vowels_gru.pt")
    ap.add_argument("--model", help="your own model: a file written by torch.save(model) (needs --data). "
                                    "UNSAFE with files you did not write: a whole module is unpickled in full "
                                    "(weights_only=False), which runs any code the file holds")
    ap.add_argument("--data", help="your own data: torch.save({'calib': [...], 'test': [...], 'targets': [...]}); "
                                   "loaded with weights_only=True (tensors and plain containers only)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (calibration, build)")
    ap.add_argument("--no-build", action="store_true",
                    help="with --backend auto: never compile the cpu backend (the reference backend runs "
                         "where it is not built yet)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="inference timing: best of this many passes over the test split per model "
                         "(default %(default)s; 0: no inference times)")


def main(args) -> int:
    """``python -m qgru demo`` (args from add_arguments): 0 on success."""
    run_cli(args)
    return 0


def run_cli(args) -> Result:
    """What ``python -m qgru demo`` does: prints the table, writes the files, returns the Result."""
    t_start = time.perf_counter()
    configs, modes = check_arguments(args)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run_cli(args, t_start, configs, modes)
    finally:
        torch.set_num_threads(threads)


def to_device(batch, device: torch.device):
    """A batch (tensor, PackedSequence, or a tuple/list of them) on ``device``."""
    if isinstance(batch, (torch.Tensor, PackedSequence)):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    return batch


def _demo_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise SystemExit(f"--device {name}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch {torch.__version__} sees no CUDA GPU on this machine")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: qgru runs on cpu or cuda")
    return device


def _run_cli(args, t_start: float, configs: List[str], modes: List[str]) -> Result:
    out = Path(args.out)
    device = _demo_device(getattr(args, "device", "cpu"))
    if args.model:
        model, calib, test, targets = load_user_inputs(args.model, args.data)
        print(f"qgru demo: your model ({args.model}), {len(calib)} calibration and {len(test)} test batches")
    else:
        data = load_dataset()
        if args.retrain:
            print(f"qgru demo: training the float model (seed {TRAIN_SEED})")
            model = train_model(data)
        else:
            model, ckpt = load_checkpoint()
            print(f"qgru demo: float model from {CHECKPOINT.name} (trained by train_model(), seed {ckpt['seed']}, "
                  f"torch {ckpt['torch']}; `--retrain` retrains it)")
        (xtr, _), (xte, yte) = data["train"], data["test"]
        calib = batches(xtr)
        test, targets = batches(xte, size=len(xte)), [yte]
        g = model.gru
        print(f"qgru demo: Japanese Vowels speaker recognition (UCI; 9 speakers, 12 LPC cepstrum coefficients "
              f"per frame, {min(map(len, xte + xtr))}-{max(map(len, xte + xtr))} frames), "
              f"{len(xtr)} training / {len(xte)} test sequences;\n"
              f"  model: {g.num_layers}-layer {'bidirectional ' if g.bidirectional else ''}GRU, hidden "
              f"{g.hidden_size}, linear head on the final states ({sum(p.numel() for p in model.parameters())} "
              f"parameters), variable lengths as PackedSequence")
        if args.retrain:
            out.mkdir(parents=True, exist_ok=True)
            with torch.no_grad():
                acc = 100 * float((model(test[0]).argmax(-1) == yte).double().mean())
            save_checkpoint(model, out / CHECKPOINT.name, acc)
            print(f"  float test accuracy {acc:.2f}%; checkpoint written to {out / CHECKPOINT.name} "
                  f"(copy it over {CHECKPOINT} to ship it)")
    if device.type != "cpu":
        model = model.to(device)
        calib, test = [to_device(b, device) for b in calib], [to_device(b, device) for b in test]
        targets = None if targets is None else [to_device(t, device) for t in targets]
    result = run(model, calib, test, targets, configs, modes, backend=args.backend,
                 progress=not args.no_progress, build=not getattr(args, "no_build", False),
                 timing_repeats=getattr(args, "repeats", 5))
    write_outputs(result, out)
    total = time.perf_counter() - t_start
    what = "the model's outputs" + (" (logits)" if targets is not None else "")
    print(f"\nTest split; integer models on {result.where}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s). SQNR against the float model: output = {what}, layer N = that "
          f"GRU layer's output sequence; inference = one pass over the test split (best of {args.repeats}, "
          f"this run), speed = the float (or dynamic-quant) model's inference time / this one's; "
          f"quantize+eval = calibrate + convert + evaluate.\n")
    print(format_table(result))
    for n in result.notes:
        print(f"\nnote: {n}")
    print(f"\nwritten to {out}/:")
    for f in result.files:
        print(f"  {f}")
    print(f"\ndone in {total:.1f} s")
    return result
