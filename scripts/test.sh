#!/usr/bin/env bash
# The test command of the README: installs what it needs, lints, runs the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
PY="${PYTHON:-python3}"
"$PY" -m ruff check .
"$PY" -m ruff format --check .
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as a failure" >&2
    exit 1
fi
exit "$rc"
