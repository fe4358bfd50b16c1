#!/usr/bin/env bash
# Installs echoloss (editable) and the extras named in $1 (default "dev") into the Python chosen
# by scripts/python.sh: $PYTHON, the active virtual environment, or the project's .venv.
# torch is installed first at a pinned version only when it is missing: an unpinned resolve on
# a CPU-only machine would download several GB of CUDA wheels for nothing. On a machine without
# an NVIDIA driver the CPU build is taken from the PyTorch index when that index is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
# shellcheck source=scripts/python.sh
source scripts/python.sh
TORCH_SPEC="${ECHOLOSS_TORCH:-torch==2.13.0}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    cpu_index="https://download.pytorch.org/whl/cpu"
    if ! command -v nvidia-smi >/dev/null 2>&1 \
        && "$PY" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" >/dev/null 2>&1; then
        echo "[echoloss] installing $TORCH_SPEC (CPU build: no NVIDIA driver found)" >&2
        "$PY" -m pip install -q "$TORCH_SPEC" --index-url "$cpu_index" --extra-index-url https://pypi.org/simple
    else
        echo "[echoloss] installing $TORCH_SPEC" >&2
        "$PY" -m pip install -q "$TORCH_SPEC"
    fi
fi
echo "[echoloss] installing echoloss[${extras}] (editable)" >&2
"$PY" -m pip install -q -e ".[${extras}]"
# verl (extra "verl", and "dev") without its dependencies: only its loss modules are used, and its
# full requirements (ray, vLLM, a transformers pin) would not co-install with this package's.
case ",${extras}," in *,dev,*|*,verl,*) "$PY" -m pip install -q --no-deps "verl==0.9.1" ;; esac
