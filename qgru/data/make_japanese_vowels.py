#!/usr/bin/env python
"""Regenerate japanese_vowels.npz from the UCR/UEA ``.ts`` files that sktime ships.

    pip download sktime==1.2.0 --no-deps -d /tmp/sk
    unzip -q /tmp/sk/sktime-1.2.0-py3-none-any.whl 'sktime/datasets/data/JapaneseVowels/*' -d /tmp/sk
    python qgru/data/make_japanese_vowels.py /tmp/sk/sktime/datasets/data/JapaneseVowels qgru/data/japanese_vowels.npz

The .npz holds, per split (``train``, ``test``): ``{split}_x`` float32 [sum of lengths, 12] (the
sequences one after another, frames in time order), ``{split}_lengths`` int64 [N] and
``{split}_y`` int64 [N] (speaker 0..8; the .ts files number them 1..9). Only numpy is needed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def parse_ts(path: Path):
    """-> list of [T, D] float arrays, list of int labels (a .ts file: one series a line,
    dimensions separated by ':', values by ',', the class label last)."""
    xs, ys, in_data = [], [], False
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.lower().startswith("@data"):
            in_data = True
            continue
        if not in_data:
            continue
        *dims, label = line.split(":")
        cols = [np.array([float(v) for v in d.split(",")]) for d in dims]
        if len({len(c) for c in cols}) != 1:
            raise ValueError(f"{path}: dimensions of unequal length in one series")
        xs.append(np.stack(cols, axis=1))
        ys.append(int(label))
    return xs, ys


def main(src: str, out: str) -> None:
    arrays = {}
    for split in ("train", "test"):
        xs, ys = parse_ts(Path(src) / f"JapaneseVowels_{split.upper()}.ts")
        arrays[f"{split}_x"] = np.concatenate(xs).astype(np.float32)
        arrays[f"{split}_lengths"] = np.array([len(x) for x in xs], dtype=np.int64)
        arrays[f"{split}_y"] = np.array(ys, dtype=np.int64) - 1
        print(f"{split}: {len(xs)} series, lengths {min(map(len, xs))}-{max(map(len, xs))}, "
              f"{xs[0].shape[1]} features, classes {sorted(set(ys))}")
    np.savez_compressed(out, **arrays)
    print(f"wrote {out} ({Path(out).stat().st_size} bytes)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
