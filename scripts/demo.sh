#!/usr/bin/env bash
# The README's main command: makes (or reuses) a virtual environment (scripts/_venv.sh), installs
# qgru there, then runs `python -m qgru demo` (qgru/demo.py): a GRU trained on a real data set
# shipped with qgru, quantized with every config, one table, and the exported models and plot in
# ./qgru-demo/. Arguments go to the demo (python -m qgru demo --help; --device cuda on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
# matplotlib (the [plot] extra) draws the error plot; without it the demo prints a note and goes on
"$PY" -m pip install --quiet -e ".[plot]" || "$PY" -m pip install --quiet -e .
"$PY" -m qgru demo "$@"
