#!/usr/bin/env bash
# The README's main command: installs qgru, then runs `python -m qgru demo` (qgru/demo.py): a GRU
# trained on a real data set shipped with qgru, quantized with every config, one table, and the
# exported models and plot in ./qgru-demo/. Arguments go to the demo (python -m qgru demo --help).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
# matplotlib (the [plot] extra) draws the error plot; without it the demo prints a note and goes on
python -m pip install --quiet -e ".[plot]" || python -m pip install --quiet -e .
python -m qgru demo "$@"
