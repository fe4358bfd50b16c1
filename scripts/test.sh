#!/usr/bin/env bash
# The test command of the README: installs what it needs, lints, runs the whole suite on CPU.
# The Python is $PYTHON, the active virtual environment, or the project's .venv (scripts/python.sh).
# Arguments go to pytest (`bash scripts/test.sh -x -q -k docs`). The suite runs on one worker
# process per CPU, at most 4 (pytest-xdist; most of its time is single-threaded Python: the
# Triton interpreter, Hypothesis); `-n 0` runs it in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python.sh
source scripts/python.sh
bash scripts/install.sh dev
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy  # strict on the library and the benchmarks ([tool.mypy] in pyproject.toml)
set +e
"$PY" -m pytest -n auto --maxprocesses=4 --dist worksteal "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as a failure" >&2
    exit 1
fi
exit "$rc"
