#!/usr/bin/env bash
# Installs echoloss and the extras named in $1 (default "dev") into the current Python.
# torch is installed first at a pinned version only when it is missing: an unpinned resolve on
# a CPU-only machine would download several GB of CUDA wheels for nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[${extras}]"
