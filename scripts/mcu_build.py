"""Build and run csrc/c/ (the C runtime) with an exported model for a target, natively or under QEMU.

Shared by tests/test_mcu.py (bit-exactness on every target) and scripts/bench_mcu.py
(instructions per step, flash, RAM). A target is a compiler, its flags, and how to run the
binary; ``missing(target)`` names the tool that is absent (the tests skip with it).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RT = ROOT / "csrc" / "c"
BOARDS = RT / "boards"
WARN = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-O2"]
A64_SYSROOT = "/usr/aarch64-linux-gnu"


@dataclass(frozen=True)
class Target:
    name: str
    cc: str
    flags: Sequence[str]
    run: Sequence[str]          # command prefix; the binary is appended (-kernel for qemu-system-arm)
    bare: bool                  # bare metal (boards/cortex_m.c + .ld, semihosting) or hosted
    layout: str = "interleaved"  # the weight layout its kernel reads (pairs: DSP, rows: MVE, offset: v6m) (export_mcu.write_mcu's layout)
    tools: Sequence[str] = field(default_factory=tuple)


def _qsys(machine: str) -> List[str]:
    # semihosting output on stdout (a chardev: with -nographic alone it bypasses a pipe)
    return ["qemu-system-arm", "-M", machine, "-nographic", "-semihosting-config", "enable=on,target=native,chardev=c0",
            "-chardev", "stdio,id=c0", "-serial", "none", "-monitor", "none", "-kernel"]


TARGETS = {
    "host": Target("host", "cc", ["-fsanitize=undefined", "-fno-sanitize-recover"], [], False),
    "host-ref": Target("host-ref", "cc", ["-DQGRU_RT_KERNEL=QGRU_RT_KERNEL_REF"], [], False),
    "a53": Target("a53", "aarch64-linux-gnu-gcc", ["-mcpu=cortex-a53"],
                  ["qemu-aarch64", "-cpu", "cortex-a53", "-L", A64_SYSROOT], False, tools=("qemu-aarch64",)),
    "a64-dotprod": Target("a64-dotprod", "aarch64-linux-gnu-gcc", ["-march=armv8.2-a+dotprod", "-mtune=cortex-a76"],
                          ["qemu-aarch64", "-cpu", "max", "-L", A64_SYSROOT], False, tools=("qemu-aarch64",)),
    "m0": Target("m0", "arm-none-eabi-gcc", ["-mcpu=cortex-m0", "-mthumb"], _qsys("microbit"), True,
                 layout="offset", tools=("qemu-system-arm",)),
    "m4": Target("m4", "arm-none-eabi-gcc", ["-mcpu=cortex-m4", "-mthumb"], _qsys("mps2-an386"), True,
                 layout="pairs", tools=("qemu-system-arm",)),
    "m4f": Target("m4f", "arm-none-eabi-gcc", ["-mcpu=cortex-m4", "-mthumb", "-mfloat-abi=hard", "-mfpu=fpv4-sp-d16"],
                  _qsys("mps2-an386"), True, layout="pairs", tools=("qemu-system-arm",)),  # an M4 with its FPU
    "m55": Target("m55", "arm-none-eabi-gcc", ["-mcpu=cortex-m55", "-mthumb", "-mfloat-abi=hard"],
                  _qsys("mps3-an547"), True, layout="rows", tools=("qemu-system-arm",)),
}


def missing(t: Target) -> Optional[str]:
    """The first tool of the target that is not on PATH (None: all there)."""
    for tool in (t.cc, *t.tools):
        if shutil.which(tool) is None:
            return tool
    if t.cc == "aarch64-linux-gnu-gcc" and not Path(A64_SYSROOT, "lib").is_dir():
        return f"{A64_SYSROOT} (libc6-dev-arm64-cross)"
    return None


def build(t: Target, model_c: Path, main_c: Path, out: Path, defines: Sequence[str] = (),
          extra: Sequence[str] = ()) -> Path:
    """Compile the runtime, the model data and a main for target t into out (raises on errors)."""
    srcs = [*sorted(RT.glob("*.c")), model_c, main_c]
    if t.bare:
        srcs.append(BOARDS / "cortex_m.c")
        link = ["-T", str(BOARDS / "cortex_m.ld"), "-nostartfiles", "--specs=nano.specs", "-Wl,--gc-sections",
                f"-Wl,-Map={out}.map"]
    else:
        srcs.append(BOARDS / "hosted.c")
        link = []
    cmd = [t.cc, *WARN, *t.flags, "-ffunction-sections", "-fdata-sections", *extra,
           "-I", str(RT), "-I", str(BOARDS), "-I", str(model_c.parent), *[f"-D{d}" for d in defines],
           *map(str, srcs), *link, "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return out


def run(t: Target, binary: Path, timeout: float = 60, extra: Sequence[str] = (), stdin: str = "",
        check: bool = True) -> str:
    """Run the binary (under QEMU for a cross target); its stdout (semihosting output included)."""
    cmd = [*t.run[:-1], *extra, t.run[-1], str(binary)] if t.bare else [*t.run, *extra, str(binary)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=stdin,
                       env={**os.environ, "UBSAN_OPTIONS": "halt_on_error=1"})
    if r.returncode and check:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    return r.stdout


def mismatches(output: str) -> int:
    m = re.search(r"mismatches (-?\d+)", output)
    if not m:
        raise RuntimeError(f"no self-test count in the output:\n{output}")
    return int(m.group(1))
