"""Which cell the CPU backend runs (NativeLayer.cell, the built C++ Layer's own report) for every
shipped config in both scale modes, on every CPU path this machine runs: a config that falls to
the int64 cell (correct, but 2-8x slower at small H) where the int32 cell is meant to take it
fails here, not silently in a benchmark.

The int32 cell (csrc/qgru_cell.h) takes a layer whose GEMMs have one limb pair each (8-bit
weights; 8-bit operands, or 16-bit ones that the path takes whole as int16: then with wide
accumulators, "int32-wide") and whose requantizations pass prepare_layer's int32 bounds. So by
design:
* w8a8: "int32" on every path, either scale mode, x levels or a static x, with or without h_gemm;
* w8a16 (16-bit x and h): "int32-wide" on the paths with int16 operands (portable, avx2) or an
  int16 sibling (avx512vnni); "int32-hybrid" on amx and avxvnni, whose int8 GEMMs take each 16-bit
  operand as two limbs (two limb pairs per GEMM: the exact products are int64 sums, requantized
  in int64, the gates and the new state then in the int32 cell);
* w16a16 (16-bit weights): "int32-hybrid" everywhere: one 16 x 16-bit product reaches 2^30 and a
  row of K >= 3 of them passes 2^31, so the accumulators themselves are not int32 (two limb pairs
  on the int16 paths, prepare.limbs16_fits; four on the int8 ones).
Each layer is calibrated the way a user's is (two random batches; weights rounded to nearest, as
fast as GPTQ is slow: the rounding moves no scale or shift), at the sweep's small and large shapes
(pow2 layers with few inputs have requantizations that shift left: seed 001's scheme fell to the
int64 cell there before 2026-12-01), and the small ones checked against golden on a few steps.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import qgru
from qgru import golden, native
from qgru.config import BUILTIN_CONFIGS, SCALE_MODES, QuantConfig
from qgru.primitives import qrange

PATHS = ("portable", "avx2", "avxvnni", "avx512vnni", "amx")
EXPECTED = {
    "w8a8": {p: "int32" for p in PATHS},
    "w8a16": {"portable": "int32-wide", "avx2": "int32-wide", "avx512vnni": "int32-wide",
              "avxvnni": "int32-hybrid", "amx": "int32-hybrid"},
    "w16a16": {p: "int32-hybrid" for p in PATHS},
}
SHAPES = ((16, 64), (64, 128), (256, 512))  # the large shape for the config as shipped only


def test_every_shipped_config_has_an_expectation():
    assert set(EXPECTED) == set(BUILTIN_CONFIGS)


def _variants(name: str):
    """(label, overrides) of the config: as shipped (x levels), a static x, and for a config with an
    h_gemm the 8-bit state read by R.h directly (configs/w8a8.toml's override for it)."""
    out = [("levels", {}), ("static x", {"tensors": {"x": {"dynamic": False}}})]
    if QuantConfig.load(name).h_gemm is not None:
        out.append(("no h_gemm", {"tensors": {"h": {"bits": 8, "headroom": 1.0}, "h_gemm": None}}))
    return out


def _layer(name: str, mode: str, over: dict, I: int, H: int) -> golden.LayerParams:
    torch.manual_seed(I + H)
    gru = torch.nn.GRU(I, H).eval()
    cfg = QuantConfig.load(name, overrides={"scale_mode": mode, "weight_rounding": "nearest", **over})
    q = qgru.quantize_model(gru, [torch.randn(20, 8, I) for _ in range(2)], config=cfg, progress=False)
    return q._qparams[0][0]


def _ints(shape, bits: int, gen: torch.Generator) -> torch.Tensor:
    lo, hi = qrange(bits)
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64)


@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("name", BUILTIN_CONFIGS)
def test_cell_kind_per_config_mode_and_path(name, mode):
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")
    paths = [str(i["name"]) for i in native.cpu_paths() if i["usable"]]
    gen = torch.Generator().manual_seed(5)
    seen = []
    for label, over in _variants(name):
        for I, H in SHAPES if not over else SHAPES[:2]:
            p = _layer(name, mode, over, I, H)
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # no int64 fallback warning either
                layers = {path: native.NativeLayer("cpu", p, torch.device("cpu"), isa=path) for path in paths}
            got = {path: layer.cell for path, layer in layers.items()}
            want = {path: EXPECTED[name][path] for path in paths}
            assert got == want, (name, mode, label, I, H)
            seen.append(got)
            if H > 128:
                continue  # the golden check below on the small shapes only (keeps the test fast)
            T, N = 3, 5
            qx, qh0 = _ints((T, N, I), p.bits["x"], gen), _ints((N, H), p.bits["h"], gen)
            level = None
            if p.x_levels is not None:
                level = torch.randint(0, p.x_levels.exponent.numel(), (T, N), generator=gen, dtype=torch.int32)
            want_out, want_h = golden.gru_direction(p, qx, qh0, None, level=level)
            for path, layer in layers.items():
                out, h = layer(qx, qh0, None, level)
                assert torch.equal(out.long(), want_out) and torch.equal(h.long(), want_h), (name, mode, label, path)
    assert seen


def test_cell_kind_reports_the_int64_cell(monkeypatch):
    """The report itself can say int64: a w8a8 layer whose int32 bounds are refused (prepare's
    _add_acc32 made to fail) reports "int64" on every path."""
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")
    from qgru.native import prepare
    p = _layer("w8a8", "pow2", {}, 16, 64)
    paths = [str(i["name"]) for i in native.cpu_paths() if i["usable"]]
    assert {native.NativeLayer("cpu", p, torch.device("cpu"), isa=path).cell for path in paths} == {"int32"}

    def refuse(t, v, bits, bound=None):
        v["acc_wide"] = v["hybrid32"] = 0
        return False
    monkeypatch.setattr(prepare, "_add_acc32", refuse)
    assert {path: native.NativeLayer("cpu", p, torch.device("cpu"), isa=path).cell for path in paths} == \
        {path: "int64" for path in paths}


@pytest.mark.parametrize("mode", SCALE_MODES)
@pytest.mark.parametrize("name", BUILTIN_CONFIGS)
def test_the_module_runs_the_cells_its_layers_report(name, mode):
    """A converted module's cpu calls run on its Model (native.cpu_op_model: the operator's C++,
    which makes its own Layers from the operator's parameters): each of them runs the cell and the
    GEMM path that a NativeLayer of the same parameters on this CPU's path reports (the table
    above), for a stacked bidirectional model."""
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")
    torch.manual_seed(3)
    m = qgru.QuantGRU(16, 64, num_layers=2, bidirectional=True,
                      config=QuantConfig.load(name, overrides={"scale_mode": mode}))
    qgru.calibrate(m, [torch.randn(6, 4, 16) for _ in range(2)], progress=False)
    m.convert()
    with torch.no_grad():
        m(torch.randn(5, 2, 16))
    params = m._qparams_on["cpu"]
    model = params[0][0].__dict__["_native"][("cpu-model", native.cpu_isa_request())][1]
    want = [native.NativeLayer("cpu", p, torch.device("cpu"), isa=native.cpu_isa_request()) for row in params for p in row]
    assert model.cells == [layer.cell for layer in want], (name, mode)
    assert model.gemm_paths == [layer.gemm for layer in want], (name, mode)


_COST = ("int32", "int32-wide", "int32-hybrid", "int64")  # the cells, cheapest first


@pytest.mark.parametrize("name", BUILTIN_CONFIGS)
def test_auto_takes_the_cheapest_cell_a_path_here_offers(name, monkeypatch):
    """An auto request (QGRU_CPU_ISA unset) runs each layer on a path whose cell is the cheapest
    that any usable path gives it: a w8a16 layer on an AMX CPU runs on avx512vnni's int16 GEMM
    ("int32-wide", one fused pass) instead of amx's two limb pairs ("int32-hybrid"), on an avxvnni
    CPU on avx2; the C++ operator's Model makes the same choice (the test above), and the layer
    gives golden's integers."""
    why = qgru.backends()["cpu"]["why"]
    if why:
        pytest.skip(f"cpu backend unavailable: {why}")
    monkeypatch.delenv("QGRU_CPU_ISA", raising=False)
    paths = [str(i["name"]) for i in native.cpu_paths() if i["usable"]]
    p = _layer(name, "multiplier", {}, 16, 64)
    best = min((native.NativeLayer("cpu", p, torch.device("cpu"), isa=path).cell for path in paths), key=_COST.index)
    auto = native.NativeLayer("cpu", p, torch.device("cpu"), isa="auto")
    assert auto.cell == best, (name, auto.gemm, paths)
    if name == "w8a16" and {"amx", "avx512vnni"} <= set(paths):
        assert auto.gemm.startswith("avx512vnni"), auto.gemm
    gen = torch.Generator().manual_seed(11)
    qx, qh0 = _ints((4, 3, 16), p.bits["x"], gen), _ints((3, 64), p.bits["h"], gen)
    level = None
    if p.x_levels is not None:
        level = torch.randint(0, p.x_levels.exponent.numel(), (4, 3), generator=gen, dtype=torch.int32)
    want_out, want_h = golden.gru_direction(p, qx, qh0, None, level=level)
    out, h = auto(qx, qh0, None, level)
    assert torch.equal(out.long(), want_out) and torch.equal(h.long(), want_h)
