# Sourced by scripts/test.sh and scripts/demo.sh: picks the Python that runs qgru and installs into it.
# Inside an active virtual environment ($VIRTUAL_ENV) that one is used; otherwise ./.venv (or
# $QGRU_VENV) is created once with `python3 -m venv` and reused. Nothing is installed into the
# system's Python. torch==2.13.0 is installed first so that nothing pulls a multi-GB CUDA build.
if [ -n "${VIRTUAL_ENV:-}" ] && [ -z "${QGRU_VENV:-}" ]; then
  PY="$VIRTUAL_ENV/bin/python"
else
  VENV="${QGRU_VENV:-.venv}"
  if [ ! -x "$VENV/bin/python" ]; then
    echo "qgru: creating the virtual environment $VENV (python3 -m venv)" >&2
    python3 -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
fi
"$PY" -m pip install --quiet torch==2.13.0
# the native backends compile through torch.utils.cpp_extension, which runs `ninja`: the venv's
# bin folder goes first on PATH, and pip's ninja is installed there if the machine has none
export PATH="$(dirname "$PY"):$PATH"
command -v ninja >/dev/null 2>&1 || "$PY" -m pip install --quiet ninja
