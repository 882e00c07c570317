"""The README's Python examples run as written (docs that match the code)."""
import contextlib
import importlib.util
import io
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _compare_rows(text):
    """(layer, dir, tensor, bits) of each row of a qgru.compare table."""
    return re.findall(r"^ +(\d+|-) +(\w+|-) +(\w+) +(\d+) ", text, flags=re.M)


def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = _python_blocks()
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)  # the example saves a file
    torch.manual_seed(0)
    # the README's user model: anything that contains an nn.GRU
    my_model = torch.nn.Sequential(torch.nn.GRU(256, 512, batch_first=True))
    namespace = {"my_model": my_model}
    printed = {}
    for i, block in enumerate(blocks):
        if "qgru.export_onnx" in block and not all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime")):
            continue  # the optional extra (setup.cfg "onnx"; tests/test_onnx.py skips without it too)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(block, str(README), "exec"), namespace)
        printed[i] = buf.getvalue()
    # the qgru.compare example: its table in the README has the rows (tensors, bits) it prints now
    i = next(i for i, b in enumerate(blocks) if "qgru.compare(" in b)
    shown = re.search(r"```text\n(qgru\.compare:.*?)```", README.read_text(), flags=re.S)
    assert shown, "the README shows no qgru.compare output"
    assert _compare_rows(shown.group(1)) == _compare_rows(printed[i]) != []
    m, m2 = namespace["m"], namespace["m2"]
    x = torch.randn(2, 5, 256)
    assert torch.equal(m(x)[0], m2(x)[0])
    assert namespace["cfg"]["h"].bits == 16 and namespace["cfg"].scale_mode == "multiplier"


def test_readme_is_short_and_user_facing_text_names_no_project_issue():
    """The README stays a short page of current facts (dated figures live in BENCHMARKS.md), and no
    user-facing text (README, docs/, BENCHMARKS.md, the package's docstrings and messages, the
    scripts and configs users run) cites the project's internal issue numbers, which mean nothing
    to a reader."""
    root = README.parent
    assert len(README.read_text().splitlines()) < 300
    files = [README, root / "BENCHMARKS.md", *(root / "docs").glob("*.md"), *(root / "qgru").rglob("*.py"),
             *(root / "scripts").glob("*"), *(root / "configs").glob("*.toml")]
    hits = [f"{f.relative_to(root)}:{i}: {line.strip()}" for f in files if f.is_file()
            for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
            if re.search(r"\bissues? \d+", line, flags=re.I)]
    assert not hits, "\n".join(hits)
