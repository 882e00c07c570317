"""qgru's modules form layers that a reader can follow upward, with no import circle (issue 32).

The test reads every qgru/*.py and qgru/<subpackage>/*.py (a subpackage's module "native.build",
its __init__.py the module "native") with ast (nothing is imported or run), collects every import of a
qgru module, at the top of the file and inside functions (``from .x import``, ``from . import x``,
``from qgru.x import``, ``import qgru.x``, ``from qgru import name``, and within a subpackage
``from .y import`` / ``from ..x import``), and fails on:

* a module missing from LAYERS (a new file must be placed in a layer), or a LAYERS entry with no file;
* a circle among the top-level imports;
* an import, top-level or lazy, of a module in a higher layer than the importer's;
* a circle in the whole graph (top-level and lazy imports) other than through ALLOWED_LAZY.

A module may import its own layer or any lower one, at the top or inside a function. The only
exceptions are the lazy imports in ALLOWED_LAZY, each a convenience that points the other way.

LAYERS is declared here, in this test, and nowhere else.
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "qgru"

# module -> layer. A module imports only modules of its own layer or below.
LAYERS = {
    # L0 arithmetic: integer primitives, tables, configuration, observers, the golden model, errors
    "primitives": 0, "tables": 0, "config": 0, "observers": 0, "golden": 0, "errors": 0,
    # L1 convert: float weights and calibrated ranges -> integer parameters; the float reference step
    "convert": 1, "float_gru": 1,
    # L2 parameters and files: QuantParams and the .qgru format, C export, weight-only packing
    "export": 2, "export_c": 2, "export_mcu": 2, "onnx_graph": 2,
    # the weight-only package (qgru/weight_only/): format -> quantize, golden (L2) -> cpu, triton_kernels (L3)
    # -> module (L4); its __init__ re-exports all of them, so it sits with the module
    "weight_only.format": 2, "weight_only.quantize": 2, "weight_only.golden": 2,
    "weight_only.cpu": 3, "weight_only.triton_kernels": 3, "weight_only.module": 4, "weight_only": 4,
    # L3 runtime: backends and native kernels, the integer forward, the custom op, QAT's forward step
    "backends": 3, "native": 3, "runtime": 3, "ops": 3, "qat_step": 3,
    # the native package (qgru/native/): build -> prepare -> cpu, cuda -> layer -> stacks, all runtime
    "native.build": 3, "native.prepare": 3, "native.cpu": 3, "native.cuda": 3, "native.layer": 3,
    "native.stacks": 3,
    # L4 the modules: QuantGRU, WeightOnlyGRU
    "module": 4,
    # L5 workflows: calibrate / quantize_model, QAT, compare, calibration across torch.distributed ranks
    "distributed": 5, "calibrate": 5, "qat": 5, "compare": 5, "summary": 5, "onnx_export": 5,
    # L6 apps and the public namespace
    "demo": 6, "__main__": 6, "__init__": 6,
}

# (importer, imported) lazy imports (inside a function) allowed to point upward or to close a circle.
# Each is a one-line convenience forwarder on a lower-layer class; the code lives on the upper side.
ALLOWED_LAZY = {
    # QuantParams.to_module() -> QuantGRU.from_params: module (L4) imports export at the top
    ("export", "module"): "QuantParams.to_module() forwards to QuantGRU.from_params (module imports export)",
    # QuantParams.to_c() -> export_c.write_c: export_c imports export at the top (QuantParams, load_params)
    ("export", "export_c"): "QuantParams.to_c() forwards to export_c.write_c (export_c imports export)",
    # Observer.sync() / SecondMoment.sync() -> distributed.reduce_statistics: distributed imports observers
    ("observers", "distributed"): "Observer.sync() forwards to distributed.reduce_statistics (distributed imports observers)",
    # QuantGRU.convert()'s reduction -> distributed.sync_grus: the collective code lives in the workflow layer
    ("module", "distributed"): "QuantGRU.convert() forwards its reduction to distributed.sync_grus",
}


def _modules():
    """{module: path}: "x" for qgru/x.py; "sub" for qgru/sub/__init__.py and "sub.y" for qgru/sub/y.py."""
    mods = {p.stem: p for p in sorted(PKG.glob("*.py"))}
    for init in sorted(PKG.glob("*/__init__.py")):
        sub = init.parent.name
        mods[sub] = init
        mods.update({f"{sub}.{p.stem}": p for p in sorted(init.parent.glob("*.py")) if p.stem != "__init__"})
    return mods


_SUBPACKAGES = {p.parent.name for p in PKG.glob("*/__init__.py")}


def _package(mod):
    """The package (a list of names below qgru) that relative imports in ``mod`` start from."""
    return mod.split(".") if mod in _SUBPACKAGES else mod.split(".")[:-1]


def _resolve(parts, mods, base_len):
    """The module that an import of qgru.<parts> loads: the longest prefix of ``parts`` (longer than
    the importer's package, ``base_len`` names) that is a module; else the name it asks for."""
    for n in range(len(parts), base_len, -1):
        if ".".join(parts[:n]) in mods:
            return ".".join(parts[:n])
    return ".".join(parts[:base_len + 1])


def _targets(node, mods, pkg=()):
    """The qgru modules an Import / ImportFrom node names; ``pkg``: the importer's package below qgru
    (() for qgru/x.py, ("native",) for qgru/native/*.py)."""
    out = []
    if isinstance(node, ast.ImportFrom):
        if node.level > len(pkg) + 1:
            raise AssertionError(f"line {node.lineno}: relative import beyond the package")
        if node.level:
            base = list(pkg[:len(pkg) + 1 - node.level])
            parts = base + (node.module.split(".") if node.module else [])
        elif node.module == "qgru" or (node.module or "").startswith("qgru."):
            base = []
            parts = node.module.split(".")[1:]
        else:
            return out
        if len(parts) > len(base):
            out.append(_resolve(parts, mods, len(base)))
        else:  # from . import x / from qgru import x: a submodule, or a name of the package (__init__)
            pkg_mod = ".".join(base) or "__init__"
            out.extend(".".join(base + [a.name]) if ".".join(base + [a.name]) in mods else pkg_mod
                       for a in node.names)
    else:
        for a in node.names:
            if a.name == "qgru":
                out.append("__init__")
            elif a.name.startswith("qgru."):
                out.append(_resolve(a.name.split(".")[1:], mods, 0))
    return out


def _imports(path, mods, pkg=()):
    """[(imported module, top-level?, line)] of one file (``pkg``: its package, as _targets')."""
    found = []

    def rec(node, top):
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                rec(ch, False)
            elif isinstance(ch, (ast.Import, ast.ImportFrom)):
                found.extend((t, top, ch.lineno) for t in _targets(ch, mods, pkg))
            else:
                rec(ch, top)

    rec(ast.parse(path.read_text(), str(path)), True)
    return found


def _graph():
    mods = _modules()
    return mods, {m: _imports(p, mods, tuple(_package(m))) for m, p in mods.items()}


def _cycle(edges):
    """One circle of a {node: set(nodes)} graph, as a list of nodes, or None."""
    color = {}
    stack = []

    def visit(n):
        color[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if color.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in color:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(edges):
        if n not in color:
            c = visit(n)
            if c:
                return c
    return None


def test_every_module_has_a_layer():
    mods = _modules()
    missing = sorted(set(mods) - set(LAYERS))
    assert not missing, f"qgru modules without a layer in tests/test_layers.py LAYERS: {missing}"
    stale = sorted(set(LAYERS) - set(mods))
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_imports_point_down():
    mods, graph = _graph()
    bad = []
    for m, imps in graph.items():
        for t, top, line in imps:
            if t not in mods:
                bad.append(f"{mods[m].relative_to(PKG.parent)}:{line} imports qgru.{t}, which does not exist")
                continue
            if t == m or m not in LAYERS or t not in LAYERS:
                continue
            if LAYERS[t] > LAYERS[m] and (top or (m, t) not in ALLOWED_LAZY):
                bad.append(f"{mods[m].relative_to(PKG.parent)}:{line} ({'top-level' if top else 'lazy'}) imports {t} "
                           f"(L{LAYERS[t]}) from L{LAYERS[m]}")
    assert not bad, "imports pointing up the layer order:\n" + "\n".join(bad)


def test_no_circle_among_top_level_imports():
    _, graph = _graph()
    edges = {m: {t for t, top, _ in imps if top and t != m} for m, imps in graph.items()}
    c = _cycle(edges)
    assert c is None, "top-level import circle: " + " -> ".join(c)


def test_no_circle_but_the_allowed_lazy_forwarders():
    _, graph = _graph()
    edges = {m: {t for t, _, _ in imps if t != m and (m, t) not in ALLOWED_LAZY} for m, imps in graph.items()}
    c = _cycle(edges)
    assert c is None, "import circle (top-level and lazy imports): " + " -> ".join(c)


def test_allowed_lazy_imports_are_lazy_and_used():
    """Each allow-list entry exists, only as a lazy import (a top-level one would be a real circle)."""
    _, graph = _graph()
    for (m, t), why in ALLOWED_LAZY.items():
        kinds = {top for tt, top, _ in graph.get(m, ()) if tt == t}
        assert kinds == {False}, f"ALLOWED_LAZY {m} -> {t} ({why}): found as {kinds or 'absent'}"


@pytest.mark.parametrize("src,expect", [
    ("from .module import QuantGRU", [("module", True)]),
    ("from . import native, golden", [("native", True), ("golden", True)]),
    ("from qgru.export import QuantParams", [("export", True)]),
    ("import qgru.ops", [("ops", True)]),
    ("from qgru import QuantGRU", [("__init__", True)]),
    ("def f():\n    from .qat import qat_forward\n", [("qat", False)]),
    ("class C:\n    def f(self):\n        import qgru.module\n", [("module", False)]),
    ("import torch\nfrom torch import nn", []),
])
def test_the_parser_sees_every_import_form(tmp_path, src, expect):
    p = tmp_path / "x.py"
    p.write_text(src)
    mods = {"module", "native", "golden", "export", "ops", "qat"}
    assert [(t, top) for t, top, _ in _imports(p, mods)] == expect


@pytest.mark.parametrize("src,expect", [
    ("from .build import load", ["native.build"]),
    ("from . import build, cpu", ["native.build", "native"]),  # cpu: not a module here, a name of native
    ("from ..golden import LayerParams", ["golden"]),
    ("from .. import golden", ["golden"]),
    ("from qgru.native.build import load", ["native.build"]),
    ("from qgru.native import load", ["native"]),
    ("import qgru.native.build", ["native.build"]),
    ("from .missing import x", ["native.missing"]),
])
def test_the_parser_resolves_subpackage_imports(tmp_path, src, expect):
    """Inside qgru/native/ (package ("native",)): relative imports of its modules and of qgru's."""
    p = tmp_path / "x.py"
    p.write_text(src)
    mods = {"native", "native.build", "golden"}
    assert [t for t, _, _ in _imports(p, mods, ("native",))] == expect


def test_a_relative_import_beyond_qgru_is_refused(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("from ...x import y")
    with pytest.raises(AssertionError, match="beyond the package"):
        _imports(p, {"native"}, ("native",))
