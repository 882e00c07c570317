"""`python -m qgru demo`: the shipped data set and model, the full demo end to end (table, accuracy,
SQNR ordering, exported files bit-exact, plot or its note), and the demo on a user's own model."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import qgru
from qgru import demo
from qgru.__main__ import main as cli_main

CONFIGS = ("w8a8", "w8a16", "w16a16")
MODES = ("pow2", "multiplier")
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _args(*argv):
    ap = argparse.ArgumentParser()
    demo.add_arguments(ap)
    return ap.parse_args(list(argv))


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The full default demo (every config and scale mode), run once in-process: (result, stdout, out)."""
    out = tmp_path_factory.mktemp("demo")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = demo.run_cli(_args("--out", str(out), "--no-progress"))
    return result, buf.getvalue(), out


# ---- the shipped data ----------------------------------------------------------------------------
def test_dataset_is_small_real_and_licensed():
    assert demo.DATASET.stat().st_size < 2 * 1024 * 1024
    assert demo.CHECKPOINT.stat().st_size < 1024 * 1024
    text = (demo.DATA_DIR / "README.md").read_text()
    assert "License" in text and "CC BY 4.0" in text
    assert "10.24432/C5NS47" in text and "Kudo" in text  # source and citation
    data = demo.load_dataset()
    (xtr, ytr), (xte, yte) = data["train"], data["test"]
    assert (len(xtr), len(xte)) == (270, 370)
    assert all(x.dtype == torch.float32 and x.shape[1] == 12 for x in xtr + xte)
    lengths = [len(x) for x in xtr + xte]
    assert min(lengths) == 7 and max(lengths) == 29  # variable lengths, as in the original
    assert torch.equal(torch.bincount(ytr), torch.full((9,), 30))  # 30 utterances per speaker
    assert torch.bincount(yte).tolist() == [31, 35, 88, 44, 29, 24, 40, 50, 29]


def test_checkpoint_is_a_multilayer_bidirectional_gru():
    model, ckpt = demo.load_checkpoint()
    assert model.gru.num_layers >= 2 and model.gru.bidirectional
    assert 95.0 <= ckpt["test_accuracy"] <= 100.0


# ---- the full demo -------------------------------------------------------------------------------
def test_table_rows(full):
    result, text, _ = full
    names = [r.name for r in result.rows]
    expect = ["float"] + [f"qgru {c} ({m})" for c in CONFIGS for m in MODES]
    assert [n for n in names if n != "torch dynamic-quant int8"] == expect
    if "torch dynamic-quant int8" not in names:  # absent only where torch no longer ships it, with a note
        assert any("dynamic-quant" in n for n in result.notes)
        assert "dynamic-quant" in text
    for n in names:
        assert re.search(rf"^\| {re.escape(n)} +\|", text, flags=re.M), n
    for col in ("accuracy (%)", "output SQNR (dB)", "layer 0 SQNR (dB)", "layer 1 SQNR (dB)"):
        assert col in text
    assert "done in" in text


def test_accuracy(full):
    result, _, _ = full
    _, ckpt = demo.load_checkpoint()
    fl = result.row("float")
    assert fl.accuracy == pytest.approx(ckpt["test_accuracy"], abs=1e-9)
    assert 95.0 <= fl.accuracy <= 100.0
    margin = {"w16a16": 1.0, "w8a16": 2.0, "w8a8": 3.0}  # percentage points below float, at most
    for c in CONFIGS:
        for m in MODES:
            r = result.row(f"qgru {c} ({m})")
            assert r.accuracy >= fl.accuracy - margin[c], (r.name, r.accuracy)
            assert r.agreement >= 100.0 - 2 * margin[c]


def test_sqnr_ordering(full):
    result, _, _ = full
    assert result.row("float").sqnr == math.inf
    for m in MODES:
        s = {c: result.row(f"qgru {c} ({m})") for c in CONFIGS}
        assert s["w16a16"].sqnr > s["w8a16"].sqnr > s["w8a8"].sqnr > 30.0, m
        for layer in (0, 1):
            key = ("gru", layer)
            assert s["w16a16"].layer_sqnr[key] > s["w8a16"].layer_sqnr[key] > s["w8a8"].layer_sqnr[key], (m, layer)


def test_exported_files_reproduce_the_quantized_gru_bit_for_bit(full):
    result, _, out = full
    xte = demo.load_dataset()["test"][0]
    packed = demo.batches(xte, size=len(xte))[0]
    for c in CONFIGS:
        for m in MODES:
            qmodel = result.models[f"qgru {c} ({m})"]
            x = torch.nn.utils.rnn.PackedSequence((packed.data - qmodel.mean) / qmodel.std, packed.batch_sizes,
                                                  packed.sorted_indices, packed.unsorted_indices)
            loaded = qgru.load_params(out / f"{c}-{m}.qgru").to_module()
            with qgru.backend(result.backend), torch.no_grad():
                want, want_h = qmodel.gru(x)
                got, got_h = loaded(x)
            assert torch.equal(got.data, want.data) and torch.equal(got_h, want_h), (c, m)


def test_other_outputs(full):
    result, text, out = full
    assert (out / "table.md").read_text().strip() in text
    first = CONFIGS[0] + "-" + MODES[0]
    assert (out / "c" / first / "gru.h").is_file() and (out / "c" / first / "gru.c").is_file()
    rows = (out / "errors.csv").read_text().splitlines()
    assert rows[0] == "model,gru,layer,t,sqnr_db,sequences" and len(rows) > 100
    assert str(out) in text


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib (the [plot] extra) is not installed")
def test_plot_written(full):
    result, _, out = full
    png = out / "error_per_layer.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any("matplotlib" in n for n in result.notes)


# ---- the command line, without matplotlib, and on a user's own model -------------------------------
def test_cli_without_matplotlib(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    rc = cli_main(["demo", "--out", str(tmp_path), "--configs", "w8a8", "--scale-modes", "pow2", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "note: matplotlib is not installed" in text and "qgru[plot]" in text
    assert not (tmp_path / "error_per_layer.png").exists()
    assert (tmp_path / "w8a8-pow2.qgru").is_file() and (tmp_path / "errors.csv").is_file()
    assert re.search(r"^\| qgru w8a8 \(pow2\) +\|", text, flags=re.M)


def test_cli_on_a_user_model(tmp_path, capsys):
    torch.manual_seed(0)
    model = torch.nn.GRU(4, 8, num_layers=2, batch_first=True)  # any module that contains an nn.GRU
    torch.save(model, tmp_path / "model.pt")
    torch.save({"calib": [torch.randn(3, 6, 4) for _ in range(2)], "test": [torch.randn(2, 5, 4)]},
               tmp_path / "data.pt")
    rc = cli_main(["demo", "--model", str(tmp_path / "model.pt"), "--data", str(tmp_path / "data.pt"),
                   "--out", str(tmp_path / "out"), "--configs", "w8a16", "--scale-modes", "multiplier",
                   "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"^\| qgru w8a16 \(multiplier\) +\|", text, flags=re.M)
    assert "accuracy" not in text.split("| model")[1].splitlines()[0]  # no targets: no accuracy column
    params = qgru.load_params(tmp_path / "out" / "w8a16-multiplier.qgru")
    assert params.meta["num_layers"] == 2 and params.meta["batch_first"]


def _user_files(tmp_path, model=None):
    torch.save(model if model is not None else torch.nn.GRU(4, 8), tmp_path / "model.pt")
    torch.save({"calib": [torch.randn(3, 6, 4)], "test": [torch.randn(2, 5, 4)]}, tmp_path / "data.pt")
    return str(tmp_path / "model.pt"), str(tmp_path / "data.pt")


@pytest.mark.parametrize("argv, message", [
    (["--configs", "w9a9"], r"^--configs w9a9: unknown config 'w9a9'"),
    (["--configs", "w8a8,w9a9"], r"^--configs w9a9: unknown config"),
    (["--scale-modes", "foo"], r"^--scale-modes foo: .*scale_mode must be one of"),
    (["--threads", "-1"], r"^--threads -1: must be a number of threads >= 1"),
    (["--model", "MISSING", "--data", "DATA"], r"^--model \S*missing.pt: no such file$"),
    (["--model", "MODEL", "--data", "MISSING"], r"^--data \S*missing.pt: no such file$"),
])
def test_cli_user_errors_are_one_line(argv, message, tmp_path, capsys):
    """A bad argument or file stops the demo up front with one line naming it (as a bad --data file
    does), not a traceback; nothing is loaded or run and torch's thread count is left alone."""
    model, data = _user_files(tmp_path)
    subst = {"MODEL": model, "DATA": data, "MISSING": str(tmp_path / "missing.pt")}
    threads = torch.get_num_threads()
    with pytest.raises(SystemExit) as exc:
        cli_main(["demo", "--out", str(tmp_path / "out"), "--no-progress"] + [subst.get(a, a) for a in argv])
    err = exc.value.code
    assert isinstance(err, str) and len(err.splitlines()) == 1 and re.search(message, err), err
    assert torch.get_num_threads() == threads
    assert not (tmp_path / "out").exists()
    assert capsys.readouterr().err == ""  # not even the --model warning: nothing was unpickled


def test_cli_model_class_defined_in_main_says_it_must_be_importable(tmp_path, monkeypatch):
    """A model whose class was defined in the script that saved it (pickled as __main__.M) cannot be
    unpickled by `python -m qgru`: one line says the class must be importable, not a raw
    "AttributeError: Can't get attribute 'M' on <module ...>"."""
    main_module = sys.modules["__main__"]

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = torch.nn.GRU(4, 8)

    M.__module__, M.__qualname__ = "__main__", "M"
    monkeypatch.setattr(main_module, "M", M, raising=False)
    model, data = _user_files(tmp_path, M())
    monkeypatch.delattr(main_module, "M")  # as in another process: __main__ has no M
    with pytest.raises(SystemExit) as exc:
        cli_main(["demo", "--model", model, "--data", data, "--out", str(tmp_path / "out"), "--no-progress"])
    err = exc.value.code
    assert isinstance(err, str) and len(err.splitlines()) == 1, err
    assert err.startswith(f"--model {model}: the model's class cannot be imported") and "Can't get attribute 'M'" in err
    assert "module on PYTHONPATH" in err and "not defined in that script" in err


def test_cli_error_has_no_traceback(tmp_path):
    """The real command line: the one-line message on stderr, exit status 1, no traceback."""
    import os
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(Path(qgru.__file__).parent.parent),
                                                                  os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-m", "qgru", "demo", "--configs", "w9a9", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("--configs w9a9: unknown config") and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_run_api_with_targets():
    """run() on a classifier with the first GRU inside a submodule, targets given."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = torch.nn.Sequential()
            self.enc.rnn = torch.nn.GRU(3, 6, bidirectional=True)
            self.fc = torch.nn.Linear(12, 4)

        def forward(self, x):
            out, _ = self.enc.rnn(x)
            return self.fc(out[-1])

    net = Net().eval()
    calib = [torch.randn(7, 5, 3) for _ in range(3)]
    test = [torch.randn(7, 9, 3)]
    with torch.no_grad():
        targets = [net(test[0]).argmax(-1)]
    r = demo.run(net, calib, test, targets, configs=["w16a16"], scale_modes=["pow2"], progress=False, log=None)
    assert r.row("float").accuracy == 100.0
    q = r.row("qgru w16a16 (pow2)")
    assert q.accuracy >= 75.0 and q.sqnr > 50.0 and set(q.layer_sqnr) == {("enc.rnn", 0)}


# ---- the demo's speed columns and its backend choice ----------------------------------------------
def test_table_times_inference_against_float_and_dynamic_quant(full):
    """Every row has an inference time measured in this run, and each speed column is the float (or
    dynamic-quant) row's time over this row's, as printed."""
    result, text, _ = full
    head = next(l for l in text.splitlines() if l.startswith("| model"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert "inference (ms)" in cols and "speed vs float" in cols
    fl = result.row("float").infer_ms
    for r in result.rows:
        assert r.infer_ms is not None and r.infer_ms > 0, r.name
        line = next(l for l in text.splitlines() if re.match(rf"^\| {re.escape(r.name)} +\|", l))
        cells = dict(zip(cols, (c.strip() for c in line.strip("|").split("|"))))
        assert float(cells["inference (ms)"]) == pytest.approx(r.infer_ms, abs=0.006)
        assert cells["speed vs float"] == f"{fl / r.infer_ms:.2f}x"
        if "speed vs dyn-quant" in cols:
            assert cells["speed vs dyn-quant"] == f"{result.row('torch dynamic-quant int8').infer_ms / r.infer_ms:.2f}x"
    # the header names the CPU and, on the cpu backend, its path
    from qgru.native.build import cpu_model_name
    assert f"CPU {cpu_model_name()}" in text
    if result.backend == "cpu":
        from qgru.native.cpu import resolve_cpu_isa
        assert f"cpu backend path {resolve_cpu_isa()['name']}" in text


def test_auto_backend_builds_the_cpu_backend_when_a_compiler_is_there(monkeypatch):
    """A fresh clone has no built cpu backend: "auto" compiles it (with a line saying so) instead of
    running every integer model on the reference backend; without a compiler, or with --no-build,
    it says why it runs the reference backend."""
    calls, lines = [], []
    monkeypatch.setattr(demo, "_native_ready", lambda kind: False)
    monkeypatch.setattr(demo, "_compiler", lambda: "/usr/bin/c++")
    monkeypatch.delenv("QGRU_NO_BUILD", raising=False)
    monkeypatch.setattr(demo, "build_native", lambda kind, progress=True, log=print: calls.append(kind) or "")
    assert demo.choose_backend("auto", "cpu", log=lines.append) == ("cpu", "")
    assert calls == ["cpu"]
    # the build fails: reference, with the reason
    monkeypatch.setattr(demo, "build_native", lambda kind, progress=True, log=print: "the compiler crashed")
    name, note = demo.choose_backend("auto", "cpu")
    assert name == "reference" and "the compiler crashed" in note
    monkeypatch.setattr(demo, "_compiler", lambda: None)
    name, note = demo.choose_backend("auto", "cpu")
    assert name == "reference" and "no C++ compiler" in note
    monkeypatch.setattr(demo, "_compiler", lambda: "/usr/bin/c++")
    calls.clear()
    name, note = demo.choose_backend("auto", "cpu", build=False)
    assert name == "reference" and "--no-build" in note and calls == []
    monkeypatch.setenv("QGRU_NO_BUILD", "1")
    name, note = demo.choose_backend("auto", "cpu")
    assert name == "reference" and "QGRU_NO_BUILD=1" in note and calls == []
    assert demo.choose_backend("reference", "cpu") == ("reference", "")


def test_build_native_reports_progress_and_the_outcome(monkeypatch, capsys):
    from qgru import native
    monkeypatch.setattr(native, "why_unavailable", lambda kind: (__import__("time").sleep(0.6), "")[1])
    lines = []
    assert demo.build_native("cpu", progress=True, log=lines.append) == ""
    assert "building the cpu backend" in lines[0] and "is ready" in lines[-1]
    assert "qgru build cpu" in capsys.readouterr().err  # the progress line (tqdm, on stderr)
    monkeypatch.setattr(native, "why_unavailable", lambda kind: "no ninja")
    lines.clear()
    assert demo.build_native("cpu", progress=False, log=lines.append) == "no ninja"
    assert "did not build: no ninja" in lines[-1]
