"""What instructions the built CPU library holds, function by function (issue 12: "passes on
AVX2-only, AVX-512 and AMX CPUs").

A machine only runs the paths its CPU offers, so on this one the avx2 and portable paths are run
but an AVX2-only CPU is not: an AVX-512 instruction that leaked into code such a CPU executes (the
driver, the dispatch, the portable path, the avx2 path, or an inline function that the linker
took from a kernel file built for AVX-512) would pass every test here and crash there with
SIGILL. So this file disassembles the built library and checks, for every function, that its
instructions are ones its path may use:

  qgru::(cpu::)amx::         anything below, AMX tiles included
  qgru::(cpu::)avx512vnni::  VEX and EVEX (AVX-512) encodings, vpdp* (VNNI)
  qgru::(cpu::)avxvnni::     VEX encodings, vpdp* (AVX-VNNI, VEX-encoded): no EVEX
  qgru::(cpu::)avx2::        VEX encodings only (AVX, AVX2, FMA, BMI2, F16C): no EVEX, no VNNI
  everything else            the x86-64 baseline: no VEX, no EVEX, no VNNI, no AMX

isa.cpp enters a path only where CPUID, XCR0 and the OS offer all of its instructions.
"""
import platform
import re
import shutil
import subprocess
from collections import defaultdict

import pytest

# Legacy prefixes that may precede a VEX (C4/C5) or EVEX (62) prefix in objdump's byte column.
_LEGACY_PREFIXES = {0x66, 0x67, 0xF2, 0xF3, 0x2E, 0x3E, 0x26, 0x64, 0x65, 0x36, 0xF0}
_FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")
_INSTRUCTION = re.compile(r"^\s*[0-9a-f]+:\t((?:[0-9a-f]{2} )+)\s*\t?(.*)$")
# The ISA namespace a function lives in, from its mangled name: _Z, Z for a local entity (a
# lambda's operator() inside a path's function), N, cv-qualifiers, then qgru[::cpu]::<path>.
_PATH = re.compile(r"^_ZZ?N[KVr]*4qgru(?:3cpu)?(?:3(amx)|10(avx512vnni)|7(avxvnni)|4(avx2))")
ALLOWED = {
    "amx": {"vex", "evex", "vnni", "amx"},
    "avx512vnni": {"vex", "evex", "vnni"},
    "avxvnni": {"vex", "vnni"},
    "avx2": {"vex"},
    None: set(),
}
DEFINING = {"amx": "amx", "avx512vnni": "vnni", "avxvnni": "vnni", "avx2": "vex"}  # each compiled path uses its own


def features(objdump_text: str) -> dict:
    """{mangled function name: set of "vex" | "evex" | "vnni" | "amx"} from `objdump -d -w`."""
    found = defaultdict(set)
    function = None
    for line in objdump_text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            function = m.group(1)
            found[function]  # listed even when it uses none
            continue
        m = _INSTRUCTION.match(line)
        if m is None or function is None:
            continue
        code = [int(b, 16) for b in m.group(1).split()]
        i = 0
        while i < len(code) and code[i] in _LEGACY_PREFIXES:
            i += 1
        if i < len(code) and code[i] == 0x62:  # EVEX in 64-bit mode (BOUND is invalid there)
            found[function].add("evex")
        elif i < len(code) and code[i] in (0xC4, 0xC5):
            found[function].add("vex")
        words = m.group(2).split()
        mnemonic = words[1] if words[:1] == ["{vex}"] and len(words) > 1 else (words[0] if words else "")
        if mnemonic.startswith("vpdp"):  # vpdpbusd(s), vpdpwssd(s): AVX-512 VNNI or AVX-VNNI
            found[function].add("vnni")
        if mnemonic.startswith(("tdp", "tile", "ldtilecfg", "sttilecfg")):
            found[function].add("amx")
    return dict(found)


def path_of(mangled: str):
    m = _PATH.match(mangled)
    return next((g for g in m.groups() if g), None) if m else None


def test_features_classify_known_encodings():
    # hand-assembled lines in objdump -d -w's format (bytes from the Intel SDM encodings)
    text = "\n".join([
        "0000000000001000 <_ZN4qgru3cpu4avx21fEv>:",
        "    1000:\tc5 fd 6f 04 07       \tvmovdqa (%rdi,%rax,1),%ymm0",
        "    1005:\t66 0f 6f 04 07       \tmovdqa (%rdi,%rax,1),%xmm0",
        "0000000000002000 <_ZN4qgru3cpu10avx512vnni1gEv>:",
        "    2000:\t67 62 f1 fd 48 6f 00 \tvmovdqa64 (%eax),%zmm0",
        "    2007:\t62 f2 75 48 50 c2    \tvpdpbusd %zmm2,%zmm1,%zmm0",
        "0000000000003000 <_ZZN4qgru3cpu4avx24rowsEvENKUlvE_clEv>:",
        "    3000:\tc4 e2 75 50 c2       \t{vex} vpdpbusd %ymm2,%ymm1,%ymm0",
        "0000000000004000 <_ZN4qgru3cpu3amx4tileEv>:",
        "    4000:\tc4 e2 78 49 00       \tldtilecfg (%rax)",
        "0000000000005000 <_ZNK4qgru5Stack7forwardEv>:",
        "    5000:\t48 89 c7             \tmov    %rax,%rdi",
        "0000000000006000 <memcpy@plt>:",
        "    6000:\tff 25 00 00 00 00    \tjmp    *0x0(%rip)",
        "0000000000007000 <_ZN4qgru3cpu7avxvnni1hEv>:",
        "    7000:\tc4 e2 75 50 c2       \t{vex} vpdpbusd %ymm2,%ymm1,%ymm0",
    ])
    f = features(text)
    assert f["_ZN4qgru3cpu4avx21fEv"] == {"vex"}
    assert f["_ZN4qgru3cpu10avx512vnni1gEv"] == {"evex", "vnni"}
    assert f["_ZZN4qgru3cpu4avx24rowsEvENKUlvE_clEv"] == {"vex", "vnni"}  # AVX-VNNI: not AVX2
    assert f["_ZN4qgru3cpu3amx4tileEv"] == {"vex", "amx"}
    assert f["_ZNK4qgru5Stack7forwardEv"] == set() and f["memcpy@plt"] == set()
    assert f["_ZN4qgru3cpu7avxvnni1hEv"] == {"vex", "vnni"} <= ALLOWED["avxvnni"]
    assert not f["_ZN4qgru3cpu10avx512vnni1gEv"] <= ALLOWED["avxvnni"]  # EVEX: never on avxvnni
    assert [path_of(n) for n in f] == ["avx2", "avx512vnni", "avx2", "amx", None, None, "avxvnni"]
    assert path_of("_ZN4qgru4avx215dispatch_kernelIZNS_3cpu4avx2EvEEvv") == "avx2"  # qgru::avx2 (header)
    assert path_of("_ZN4qgru3cpu8portable4cellEv") is None  # portable: the baseline
    assert path_of("_ZN4qgru3cpu9avx2_like1fEv") is None  # a name that only starts like a path


@pytest.fixture(scope="module")
def library():
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the instruction-set paths are x86-64's; other machines build only the portable path")
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    from qgru import native
    try:
        mod = native.load("cpu")
    except Exception as e:  # noqa: BLE001 - the backend's own tests report why it is unavailable
        pytest.skip(f"cpu backend unavailable: {e}")
    compiled = {str(i["name"]) for i in native.cpu_paths() if i["act_bytes"]}
    # the kernels live in the library without Python (native.library_path()), the binding beside it
    text = "\n".join(subprocess.run(["objdump", "-d", "-w", str(f)], capture_output=True, text=True,
                                    check=True).stdout for f in (native.library_path(), mod.__file__))
    return compiled, features(text)


def test_every_function_uses_only_its_paths_instructions(library):
    _compiled, found = library
    wrong = sorted(f"{name}: {sorted(used - ALLOWED[path_of(name)])} in path {path_of(name) or 'baseline'}"
                   for name, used in found.items() if used - ALLOWED[path_of(name)])
    assert not wrong, "instructions outside their path (an AVX2-only or older CPU would fault):\n" + "\n".join(wrong[:20])


def test_each_compiled_path_holds_its_instructions(library):
    # the check above is not vacuous: the disassembly parsed, and each compiled path's functions
    # were found and use the instructions that define the path
    compiled, found = library
    assert "portable" in compiled
    for path in set(DEFINING) & compiled:
        used = set().union(*(u for n, u in found.items() if path_of(n) == path))
        assert DEFINING[path] in used, f"{path}: no {DEFINING[path]} instruction found in its functions"
    assert sum(1 for n in found if path_of(n) is None) > 100  # the driver, pybind11, torch inlines


def test_each_path_requires_every_feature_its_target_enables(library):
    # kernel_<path>.cpp's `#pragma GCC target(...)` lets gcc use any of those features anywhere in
    # the file (the cells' shifts compile to BMI2's shlx / sarx): isa.cpp must find every one of
    # them on the CPU before it enters the path, or a CPU with AVX2 but not BMI2 faults
    from qgru import native
    csrc = native.csrc_dir() / "cpu"
    needs = {i["name"]: set(i["needs"]) for i in native.cpu_paths()}
    checked = 0
    for path in ("avx2", "avxvnni", "avx512vnni", "amx"):
        source = (csrc / f"kernel_{path}.cpp").read_text()
        m = re.search(r'#pragma GCC target\("([^"]+)"\)', source)
        assert m, f"kernel_{path}.cpp: no #pragma GCC target"
        target = set(m.group(1).split(","))
        clang = re.search(r'#pragma clang attribute push\(__attribute__\(\(target\("([^"]+)"\)', source)
        assert clang and set(clang.group(1).split(",")) == target, f"kernel_{path}.cpp: gcc and clang targets differ"
        assert target <= needs[path], f"{path}: isa.cpp does not check {sorted(target - needs[path])}"
        checked += 1
    assert checked == 4 and needs["portable"] == set()
