#!/usr/bin/env bash
# The README's main command: installs qgru, then prints the accuracy table (scripts/accuracy.py).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e .
python scripts/accuracy.py "$@"
