#!/usr/bin/env bash
# The README's test command: makes (or reuses) a virtual environment (scripts/_venv.sh), installs
# qgru with its test dependencies there, builds the native backends, then runs the tests.
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
"$PY" -m pip install --quiet -e ".[test]"
# compile the native backends ahead (about a minute the first time, cached after): a build
# failure is reported here with the reason, and the tests then see the cpu backend unavailable
"$PY" -m qgru build --kind all || echo "warning: the cpu backend did not build; native tests will fail" >&2
"$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|numpy|tqdm|pytest|hypothesis)==' | tr '\n' ' ' >&2
echo >&2
set +e
"$PY" -m pytest tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure for qgru" >&2
  exit 1
fi
exit "$rc"
