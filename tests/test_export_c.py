"""C99 export (qgru/export_c.py): the generated C compiles warning-free and is bit-exact with the
golden model, with and without an h_gemm (the R.h operand on a grid narrower than the state's).

Each case is exported and compiled once (with a small harness main that reads integer inputs on
stdin and prints what the C computes); the tests then feed it sequences of their own (random,
and the extremes of every range) and compare every printed integer with qgru.golden run on the
same integers, independently of the self-test's own count.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import qgru
from qgru.export import QuantParams
from qgru import export_c
from qgru.golden import gru_direction, input_gemm, recurrent_operand, requantize_input
from qgru.primitives import qrange

CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler (cc, gcc or clang) on PATH")
CFLAGS = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O2"]

# exact (<= 10-bit) tables, 6-bit R per tensor, per_channel Wx, per_tensor symmetric Rh, 12-bit r
CUSTOM = {"observer": {"kind": "minmax"},
          "tensors": {"R": {"bits": 6, "symmetric": True, "granularity": "per_tensor"},
                      "W": {"bits": 8, "symmetric": True, "granularity": "per_group", "group_size": 4},
                      "Wx": {"bits": 12, "symmetric": False, "granularity": "per_channel"},
                      "Rh": {"bits": 16, "symmetric": True, "granularity": "per_tensor"},
                      "z_pre": {"bits": 8, "symmetric": False}, "r_pre": {"bits": 10, "symmetric": False},
                      "g_pre": {"bits": 8, "symmetric": False}, "z": {"bits": 8}, "r": {"bits": 12},
                      "g": {"bits": 8}}}

# an R.h operand narrower than the state (golden.recurrent_operand): the state keeps h's bits
# (16-bit values in int32_t arrays), the step requantizes it onto h_gemm's grid for R h every step.
# h's headroom (none on h_gemm) makes a state drawn over h's whole range saturate the operand.
H_GEMM = {"hg16_8": {"h": {"bits": 16, "headroom": 1.5}, "h_gemm": {"bits": 8, "dynamic": False}},
          "hg12_6": {"h": {"bits": 12, "headroom": 1.5}, "h_gemm": {"bits": 6, "dynamic": False}},
          "hg16_12": {"h": {"bits": 16}, "h_gemm": {"bits": 12, "dynamic": False}}}  # an int16_t operand

CASES = {  # id: (config, scale_mode, input, hidden, num_layers, bidirectional, layer, direction)
    "w8a8-pow2": ("w8a8", "pow2", 5, 3, 1, False, 0, 0),
    "w8a8-multiplier-l1-rev": ("w8a8", "multiplier", 20, 17, 2, True, 1, 1),
    "w8a16-pow2-l1": ("w8a16", "pow2", 7, 9, 2, False, 1, 0),
    "w8a16-multiplier-rev": ("w8a16", "multiplier", 12, 5, 1, True, 0, 1),
    "w16a16-pow2-l1-rev": ("w16a16", "pow2", 6, 4, 2, True, 1, 1),
    "w16a16-multiplier": ("w16a16", "multiplier", 16, 13, 1, False, 0, 0),
    "custom-multiplier-l1": ("custom", "multiplier", 9, 6, 2, True, 1, 0),
    "custom-pow2": ("custom", "pow2", 8, 7, 1, False, 0, 0),
    "hg16_8-multiplier": ("hg16_8", "multiplier", 6, 5, 1, False, 0, 0),
    "hg16_8-pow2-l1-rev": ("hg16_8", "pow2", 7, 6, 2, True, 1, 1),
    "hg12_6-multiplier-l1": ("hg12_6", "multiplier", 9, 7, 2, False, 1, 0),
    "hg12_6-pow2-rev": ("hg12_6", "pow2", 5, 4, 1, True, 0, 1),
    "hg16_12-multiplier": ("hg16_12", "multiplier", 8, 6, 1, False, 0, 0),
    # x levels and state-derived GEMM operands (docs/spec.md section 4b): layer 0 is refused (its
    # grid is chosen per token from float x), the layers above have static grids and export
    "dyn-multiplier-l1-rev": ("dyn", "multiplier", 6, 5, 2, True, 1, 1),
    "dyn-pow2-l1": ("dyn", "pow2", 4, 6, 2, False, 1, 0),
}
DYN = {"x": {"dynamic": True}, "h_gemm": {"dynamic": True}}

HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include "{stem}.h"

/* stdin: T, x_q [T][I], h0 [H] (and h_prev [I] for layer > 0). stdout: the self-test count,
 * dwx of step 0, out [T][H], h_T (and the requantized h_prev). */
static int32_t next(void)
{{
    long v;
    if (scanf("%ld", &v) != 1) exit(2);
    return (int32_t)v;
}}

int main(void)
{{
    const int32_t T = next();
    int32_t *x = malloc(sizeof(int32_t) * (size_t)(T * {P}_INPUT_SIZE + 1));
    int32_t *out = malloc(sizeof(int32_t) * (size_t)(T * {P}_HIDDEN_SIZE + 1));
    int32_t h[{P}_HIDDEN_SIZE], dwx[3 * {P}_HIDDEN_SIZE];
    int32_t i;
    for (i = 0; i < T * {P}_INPUT_SIZE; i++) x[i] = next();
    for (i = 0; i < {P}_HIDDEN_SIZE; i++) h[i] = next();
    printf("%d\n", {pre}_selftest());
    {pre}_input(x, dwx);
    for (i = 0; i < 3 * {P}_HIDDEN_SIZE; i++) printf("%ld\n", (long)dwx[i]);
    {pre}_run(x, T, h, out);
    for (i = 0; i < T * {P}_HIDDEN_SIZE; i++) printf("%ld\n", (long)out[i]);
    for (i = 0; i < {P}_HIDDEN_SIZE; i++) printf("%ld\n", (long)h[i]);
#if {layer} > 0
    {{
        int32_t hp[{P}_INPUT_SIZE], xq[{P}_INPUT_SIZE];
        for (i = 0; i < {P}_INPUT_SIZE; i++) hp[i] = next();
        {pre}_requantize_input(hp, xq);
        for (i = 0; i < {P}_INPUT_SIZE; i++) printf("%ld\n", (long)xq[i]);
    }}
#endif
    free(x);
    free(out);
    return 0;
}}
"""


@functools.lru_cache(maxsize=None)
def converted(case: str) -> qgru.QuantParams:
    config, mode, I, H, layers, bidir, _, _ = CASES[case]
    if config == "custom":
        cfg = qgru.QuantConfig.load("w8a8", overrides={**CUSTOM, "scale_mode": mode})
    elif config in H_GEMM:
        cfg = qgru.QuantConfig.load("w8a8", overrides={"tensors": H_GEMM[config], "scale_mode": mode})
    elif config == "dyn":
        cfg = qgru.QuantConfig.load("w8a8", overrides={"tensors": DYN, "scale_mode": mode})
    else:
        cfg = qgru.QuantConfig.load(config, overrides={"scale_mode": mode})
    if config != "dyn":  # static grids: what the C runs (x levels and state-range operands: the "dyn" cases)
        static = {"x": {"dynamic": False}, **({"h_gemm": {"dynamic": False}} if cfg.h_gemm is not None else {})}
        cfg = qgru.QuantConfig.load(cfg, overrides={"tensors": static})
    torch.manual_seed(len(case))
    m = qgru.QuantGRU(I, H, num_layers=layers, bidirectional=bidir, config=cfg)
    qgru.calibrate(m, [torch.randn(6, 3, I) * 1.5 for _ in range(3)], progress=False)
    return m.convert().export()


def compile_c(sources, out: Path, defines=(), extra=()):
    cmd = [CC, *CFLAGS, *extra, *[f"-D{d}" for d in defines], *map(str, sources), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}{r.stderr}"
    return out


class Built:
    """One exported layer, compiled with the harness; ``run`` feeds it integers."""

    def __init__(self, case: str, folder: Path):
        *_, self.layer, self.direction = CASES[case]
        self.params = converted(case)
        self.p = self.params.layers[self.layer][self.direction]
        self.prefix = "net_" + re.sub(r"\W", "_", case)  # an explicit prefix; the stem stays "gru"
        P = self.prefix.upper()
        self.h, self.c = self.params.to_c(folder / "gru", layer=self.layer, direction=self.direction,
                                          prefix=self.prefix)
        main = folder / "main.c"
        main.write_text(HARNESS.format(stem="gru", P=P, pre=self.prefix, layer=self.layer))
        self.binary = compile_c([self.c, main], folder / "harness", defines=[f"{P}_GOLDEN"])

    def run(self, qx: torch.Tensor, qh0: torch.Tensor, h_prev=None):
        ints = [qx.shape[0], *qx.reshape(-1).tolist(), *qh0.tolist()]
        if self.layer > 0:  # the harness then reads h_prev too
            h_prev = torch.zeros(self.p.input_size, dtype=torch.int64) if h_prev is None else h_prev
            ints += h_prev.tolist()
        r = subprocess.run([str(self.binary)], input=" ".join(map(str, ints)), capture_output=True,
                           text=True, check=True)
        vals = [int(v) for v in r.stdout.split()]
        H, I, T = self.p.hidden_size, self.p.input_size, qx.shape[0]
        sizes = [1, 3 * H, T * H, H] + ([I] if self.layer > 0 else [])
        assert len(vals) == sum(sizes), r.stdout
        chunks, at = [], 0
        for n in sizes:
            chunks.append(torch.tensor(vals[at:at + n], dtype=torch.int64))
            at += n
        return chunks  # selftest count, dwx of step 0, out, h_T[, requantized h_prev]


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory):
    if CC is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH")
    return Built(request.param, tmp_path_factory.mktemp(request.param))


def input_sets(p, gen):
    """Integer sequences (x [T, I], h0 [H]): random over the whole ranges, and the extremes."""
    xlo, xhi = qrange(p.bits["x"])
    hlo, hhi = qrange(p.bits["h"])
    I, H = p.input_size, p.hidden_size
    yield (torch.randint(xlo, xhi + 1, (12, I), generator=gen),
           torch.randint(hlo, hhi + 1, (H,), generator=gen))
    alternating = torch.tensor([xlo, xhi]).repeat(I)[:I]
    extremes = torch.stack([torch.full((I,), xlo), torch.full((I,), xhi), alternating, alternating.flip(0),
                            p.zp["x"].expand(I), torch.full((I,), xhi), torch.full((I,), xlo)])
    yield extremes, torch.tensor([hlo, hhi]).repeat(H)[:H]
    yield extremes.flip(0), torch.full((H,), hhi)
    qx, qh0, _ = export_c.golden_vectors(p)  # the sequence embedded in the self-test
    yield qx, qh0


def test_c_matches_golden_bit_for_bit(built):
    p, gen = built.p, torch.Generator().manual_seed(1)
    for qx, qh0 in input_sets(p, gen):
        selftest, dwx0, out, h_t, *_ = built.run(qx, qh0)
        exp_out, exp_h = gru_direction(p, qx.unsqueeze(1), qh0.unsqueeze(0))
        assert int(selftest) == 0
        assert torch.equal(dwx0, input_gemm(p, qx[:1])[0])
        assert torch.equal(out, exp_out.reshape(-1)), (out.reshape(-1, p.hidden_size), exp_out.squeeze(1))
        assert torch.equal(h_t, exp_h[0])
        assert len(set(exp_out.reshape(-1).tolist())) > 1  # a non-degenerate comparison


def test_requantize_input_matches_golden(built):
    """Layer > 0: the previous layer's outputs onto this layer's x grid (layer 0 has nothing to do)."""
    if built.layer == 0:
        assert "requantize_input" not in built.h.read_text()
        return
    p, prev = built.p, built.params.layers[built.layer - 1]
    hp = prev[0].hidden_size
    gen = torch.Generator().manual_seed(2)
    hlo, hhi = qrange(prev[0].bits["h"])
    for h_prev in (torch.randint(hlo, hhi + 1, (p.input_size,), generator=gen),
                   torch.tensor([hlo, hhi]).repeat(p.input_size)[:p.input_size]):
        *_, got = built.run(torch.zeros(1, p.input_size, dtype=torch.int64) + p.zp["x"],
                            torch.zeros(p.hidden_size, dtype=torch.int64), h_prev)
        expect = torch.cat([requantize_input(h_prev[e * hp:(e + 1) * hp], prev[e].zp["h"],
                                             p.rescale[f"in_{e}"], p.zp["x"], p.bits["x"])
                            for e in range(len(prev))])
        assert torch.equal(got, expect)


def test_golden_vectors_cover_both_saturated_ends():
    p = converted("w8a16-pow2-l1").layers[1][0]
    qx, qh0, out = export_c.golden_vectors(p, steps=8, seed=0)
    lo, hi = qrange(p.bits["x"])
    assert qx.shape == (8, p.input_size) and int(qx.min()) == lo and int(qx.max()) == hi
    assert ((qx == lo).sum() > p.input_size // 2) and ((qx == hi).sum() > p.input_size // 2)
    assert torch.equal(out, gru_direction(p, qx.unsqueeze(1), qh0.unsqueeze(0))[0].squeeze(1))
    assert torch.equal(qx, export_c.golden_vectors(p, steps=8, seed=0)[0])  # deterministic


def test_no_floating_point_in_generated_code(built):
    for path in (built.h, built.c):
        words = set(re.findall(r"\b(float|double|long double|_Complex)\b", path.read_text()))
        assert not words, (path, words)


@needs_cc
def test_selftest_main_no_golden_build_and_ubsan(tmp_path):
    """The stand-alone self-test main, the build without golden vectors, and (where the compiler
    has it) an undefined-behaviour-sanitizer run: no overflow and no bad shift on any path."""
    params = converted("custom-multiplier-l1")
    h, c = params.to_c(tmp_path / "my-gru", layer=1, direction=1, golden_steps=5, seed=3)
    assert (h.name, c.name) == ("my-gru.h", "my-gru.c")
    assert "void my_gru_step(" in h.read_text() and "#define MY_GRU_HIDDEN_SIZE 6" in h.read_text()
    compile_c([c], tmp_path / "obj.o", extra=["-c"])  # without -DMY_GRU_GOLDEN
    exe = compile_c([c], tmp_path / "selftest", defines=["MY_GRU_GOLDEN", "MY_GRU_SELFTEST_MAIN"])
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "my_gru_selftest: 0 mismatches", r.stdout
    ubsan = ["-fsanitize=undefined", "-fno-sanitize-recover=all"]
    probe = subprocess.run([CC, *ubsan, "-x", "c", "-", "-o", str(tmp_path / "probe")],
                           input="int main(void) { return 0; }", capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("the C compiler has no -fsanitize=undefined")
    exe = compile_c([c], tmp_path / "selftest_ubsan", defines=["MY_GRU_GOLDEN", "MY_GRU_SELFTEST_MAIN"],
                    extra=ubsan)
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr, r.stderr


@needs_cc
def test_selftest_and_harness_detect_a_wrong_rounding(tmp_path):
    """Negative control: truncating instead of rounding half up in the C makes both the self-test
    count and the bit comparison fail, so neither check passes vacuously."""
    b = Built("w8a16-multiplier-rev", tmp_path)
    src = b.c.read_text()
    rounding = "shr(v * m + ((int64_t)1 << (s - 1)), s)"
    assert src.count(rounding) == 1
    b.c.write_text(src.replace(rounding, "shr(v * m, s)"))
    b.binary = compile_c([b.c, tmp_path / "main.c"], tmp_path / "harness_bad",
                         defines=[f"{b.prefix.upper()}_GOLDEN"])
    qx, qh0, _ = export_c.golden_vectors(b.p)
    selftest, _, out, *_ = b.run(qx, qh0)
    assert int(selftest) > 0
    assert not torch.equal(out, gru_direction(b.p, qx.unsqueeze(1), qh0.unsqueeze(0))[0].reshape(-1))


def test_h_gemm_operand_in_the_generated_code(built):
    """With h_gemm, the header documents the operand and the step computes it (R h reads h_op, of
    h_gemm's width); without, neither appears. The state's arrays are int32_t either way. With h's
    headroom, the extreme states of input_sets saturate the operand at both ends, so the bit
    comparison covers its saturation."""
    h, c = built.h.read_text(), built.c.read_text()
    P = built.prefix.upper()
    if "h_gemm" not in built.p.bits:
        assert "h_gemm" not in h + c and "h_op" not in c
        return
    b = built.p.bits["h_gemm"]
    assert f"#define {P}_H_GEMM_BITS {b}\n" in h and f"#define {P}_H_BITS {built.p.bits['h']}\n" in h
    assert "recurrent_operand" in h and f"{P}_H_GEMM_ZERO_POINT" in h
    op_type = "int8_t" if b <= 8 else "int16_t"
    assert f"static int64_t rh(int32_t c, const {op_type} h_op[{P}_HIDDEN_SIZE])" in c
    assert f"const int32_t h_q[{P}_HIDDEN_SIZE]" in c and "R[c][k] * h_op[k]" in c
    _, extremes, *_ = input_sets(built.p, torch.Generator().manual_seed(1))
    q_op, bits = recurrent_operand(built.p, extremes[1].unsqueeze(0))
    assert bits == b and not torch.equal(q_op[0], extremes[1])
    if built.params.meta["config"]["tensors"]["h"].get("headroom", 1.0) > 1.0:
        assert (int(q_op.min()), int(q_op.max())) == qrange(b)


BROKEN_OPERAND = {  # a mistake in the C's h -> h_gemm requantization: what it replaces, and with what
    "truncating": ("mul_shift((int64_t)h_q[j] - {P}_H_ZERO_POINT, M_HG, S_HG)",
                   "shr(((int64_t)h_q[j] - {P}_H_ZERO_POINT) * M_HG, S_HG)"),
    "no_h_zero_point": ("(int64_t)h_q[j] - {P}_H_ZERO_POINT, M_HG", "(int64_t)h_q[j], M_HG"),
    "saturated_to_h_bits": ("{P}_H_GEMM_BITS);", "{P}_H_BITS);"),  # then wrapped by the cast
    "no_operand_zero_point": (" + {P}_H_GEMM_ZERO_POINT,", ","),
}


@needs_cc
@pytest.mark.parametrize("mistake", list(BROKEN_OPERAND))
def test_selftest_and_harness_detect_a_wrong_recurrent_operand(mistake, tmp_path):
    """Negative control for h_gemm: each mistake in the operand's formula (rounding, either zero
    point, saturation) makes both the self-test count and the bit comparison fail."""
    b = Built("hg16_8-multiplier", tmp_path)
    P = b.prefix.upper()
    old, new = (t.replace("{P}", P) for t in BROKEN_OPERAND[mistake])
    src = b.c.read_text()
    assert src.count(old) == 1, old
    b.c.write_text(src.replace(old, new))
    b.binary = compile_c([b.c, tmp_path / "main.c"], tmp_path / "harness_bad", defines=[f"{P}_GOLDEN"])
    qx, qh0, _ = export_c.golden_vectors(b.p)
    selftest, _, out, *_ = b.run(qx, qh0)
    assert int(selftest) > 0
    assert not torch.equal(out, gru_direction(b.p, qx.unsqueeze(1), qh0.unsqueeze(0))[0].reshape(-1))


def test_cli_writes_the_same_files(tmp_path, capsys):
    params = converted("w8a8-multiplier-l1-rev")
    params.save(tmp_path / "p.qgru")
    export_c.main([str(tmp_path / "p.qgru"), str(tmp_path / "cli" / "gru"), "--layer", "1", "--direction", "1"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "cli" / "gru.h"), str(tmp_path / "cli" / "gru.c")]
    h, c = params.to_c(tmp_path / "api" / "gru.h", layer=1, direction=1)  # a .h / .c suffix is dropped
    assert h == tmp_path / "api" / "gru.h" and c == tmp_path / "api" / "gru.c"
    for name in ("gru.h", "gru.c"):
        assert (tmp_path / "cli" / name).read_text() == (tmp_path / "api" / name).read_text()


def test_bad_arguments(tmp_path):
    params = converted("w8a8-pow2")
    with pytest.raises(ValueError, match="layer 1 out of range"):
        params.to_c(tmp_path / "gru", layer=1)
    with pytest.raises(ValueError, match="direction 1 out of range"):
        params.to_c(tmp_path / "gru", direction=1)
    with pytest.raises(ValueError, match="not a C identifier"):
        params.to_c(tmp_path / "gru", prefix="my-gru")
    h, _ = params.to_c(tmp_path / "2nd layer")
    assert "void qgru_2nd_layer_run(" in h.read_text()


def test_a_layer_with_x_levels_exports_its_static_grid_with_a_warning(tmp_path):
    """The C code takes integer x on one grid: x levels (chosen per token from float x) cannot be
    exported; the layer exports on level 0, its static grid, with a warning naming the override:
    the same C as the layer without levels (golden.gru_direction without levels runs level 0).
    The model converted with the override exports without a warning."""
    params = converted("dyn-multiplier-l1-rev")
    assert params.layers[0][1].x_levels is not None and params.layers[1][0].x_levels is None
    for d in (0, 1):
        with pytest.warns(UserWarning, match=r'x levels are not exported .* overrides=\{"tensors": \{"x": \{"dynamic": False\}\}\}'):
            h, c = params.to_c(tmp_path / f"lv{d}", layer=0, direction=d)
        text = h.read_text() + c.read_text()
        stripped = QuantParams(meta=params.meta, layers=[[dataclasses.replace(p, x_levels=None) for p in row]
                                                          for row in params.layers])
        h0, c0 = stripped.to_c(tmp_path / f"lv{d}", layer=0, direction=d)  # the same stem: the same prefix
        assert h0.read_text() + c0.read_text() == text
    torch.manual_seed(0)
    gru = torch.nn.GRU(6, 5)
    cfg = qgru.QuantConfig.load("w8a8", overrides={"tensors": {**DYN, "x": {"dynamic": False}}})
    m = qgru.prepare_model(gru, cfg)
    qgru.calibrate(m, [torch.randn(6, 3, 6)], progress=False)
    static = m.convert().export()
    assert static.layers[0][0].x_levels is None
    h, _ = static.to_c(tmp_path / "gru")
    assert "void gru_run(" in h.read_text()


def test_a_stem_that_cannot_be_written_into_c_is_refused(tmp_path):
    """Issue 30 item 11: a stem with '"' or a line break wrote C that did not compile (the name
    goes into #include "<stem>.h" and comments), with no error at export time. What the check lets
    through compiles: spaces, quotes ', parentheses, non-ASCII letters."""
    params = converted("w8a8-pow2")
    for name in ('my"gru', "my\ngru", "a\\b", "cr\rlf", "tab\there"):
        with pytest.raises(ValueError, match=r"cannot be written into C"):
            params.to_c(tmp_path / "bad" / name)
    assert not (tmp_path / "bad").exists()  # nothing written
    if CC is not None:
        h, c = params.to_c(tmp_path / "my 'gru' (v2) \u00e9")
        compile_c([c], tmp_path / "gru.o", extra=("-c",))


@pytest.mark.parametrize("kw", [{"layer": 1.0}, {"direction": "0"}, {"golden_steps": 2.5}, {"layer": True}])
def test_non_integer_arguments_are_named(kw, tmp_path):
    """Issue 30 item 11: layer=1.0 raised a raw TypeError from list indexing."""
    params = converted("w8a8-pow2")
    name = next(iter(kw))
    with pytest.raises(TypeError, match=rf"write_c: {name} must be an int, got"):
        params.to_c(tmp_path / "gru", **kw)
