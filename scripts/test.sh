#!/usr/bin/env bash
# The README's test command: installs what the tests need, then runs them.
# torch==2.13.0 is installed first so that nothing pulls a multi-GB CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test]"
# compile the native backends ahead (about a minute the first time, cached after): a build
# failure is reported here with the reason, and the tests then see the cpu backend unavailable
python -m qgru build --kind all || echo "warning: the cpu backend did not build; native tests will fail" >&2
set +e
python -m pytest tests "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure for qgru" >&2
  exit 1
fi
exit "$rc"
