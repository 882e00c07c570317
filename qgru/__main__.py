"""Command line.

* ``python -m qgru demo [--out DIR] [--configs ...]``: quantize a GRU trained on a real data set
  (shipped with qgru) with every config and print the accuracy/SQNR table (qgru/demo.py).
* ``python -m qgru build [--kind cpu|cuda|all]`` compiles the native backends ahead of time (into
  the cache folder qgru/native/build.py describes) and prints what ``qgru.backends()`` says;
  ``--print-path``: only the path of the library without Python of that kind (cpu: the one that
  defines the operator qgru::integer_gru; cuda: its CUDA kernel; all, the default: the cpu one, then
  the cuda one where that backend is available)."""
from __future__ import annotations

import argparse
import sys


def _build(args) -> int:
    from . import native
    from .backends import backends
    if args.print_path:
        # the libraries without Python (qgru::integer_gru: the cpu one defines it, the cuda one adds
        # its CUDA kernel): torch.ops.load_library or dlopen them, the cpu one first
        kinds = [args.kind] if args.kind != "all" else ["cpu"] + (["cuda"] if not native.why_unavailable("cuda") else [])
        for kind in kinds:
            try:
                print(native.library_path() if kind == "cpu" else native.cuda_library_path())
            except RuntimeError as e:
                print(f"{kind}: unavailable: {e}", file=sys.stderr)
                return 1
        return 0
    kinds = ["cpu", "cuda"] if args.kind == "all" else [args.kind]
    failed = False
    for kind in kinds:
        why = native.why_unavailable(kind)
        if why:
            print(f"{kind}: unavailable: {why}")
            # a CUDA backend is optional where torch or the machine has no CUDA; a CPU failure is not
            failed |= kind == "cpu" or args.kind == "cuda"
        else:
            print(f"{kind}: built and loaded ({native.build_dir(kind)})")
    for name, info in backends().items():
        state = 'available' if info['available'] else 'unavailable: ' + info['why']
        print(f"  backend {name:9s} {state}" + (f" ({info['detail']})" if info.get("detail") else ""))
    return 1 if failed else 0


def _demo(args) -> int:
    from . import demo
    return demo.main(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qgru", description="qgru command line")
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the C++/CUDA backends ahead of time")
    b.add_argument("--kind", choices=["cpu", "cuda", "all"], default="all")
    b.add_argument("--print-path", action="store_true",
                   help="build if needed and print only the path of the library without Python: --kind cpu the "
                        "one that defines the operator qgru::integer_gru, --kind cuda its CUDA kernel, all (the "
                        "default) the cpu one and, where the cuda backend is available, the cuda one (for "
                        "torch.ops.load_library or a C++ program's dlopen, in that order)")
    b.set_defaults(func=_build)
    d = sub.add_parser("demo", help="float vs torch dynamic-quant vs every qgru config on a real data set, one table",
                       description="Quantize every nn.GRU of a small model trained on the Japanese Vowels data "
                                   "set (shipped with qgru, no network) with each config, calibrate on the "
                                   "training split, evaluate the test split and print one table; writes the "
                                   "exported integer models, C source of layer 0, errors.csv and a plot to --out. "
                                   "--model/--data run it on your own model and data; --model unpickles a whole "
                                   "module (weights_only=False), which runs any code in the file: only use model "
                                   "files you trust.")
    from .demo import add_arguments
    add_arguments(d)
    d.set_defaults(func=_demo)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
