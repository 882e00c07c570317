"""Command line: ``python -m qgru build [--kind cpu|cuda|all]`` compiles the native backends ahead
of time (into the cache folder qgru/native.py describes) and prints what ``qgru.backends()`` says."""
from __future__ import annotations

import argparse
import sys


def _build(args) -> int:
    from . import native
    from .backends import backends
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
        print(f"  backend {name:9s} {'available' if info['available'] else 'unavailable: ' + info['why']}")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qgru", description="qgru command line")
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the C++/CUDA backends ahead of time")
    b.add_argument("--kind", choices=["cpu", "cuda", "all"], default="all")
    b.set_defaults(func=_build)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
