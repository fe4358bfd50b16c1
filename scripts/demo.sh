#!/usr/bin/env bash
# The main job of the README: installs echoloss with the trainer's extra and runs the reference
# trainer on its embedded default (tiny model, local tokenizer, built-in tool environment, CPU).
# The Python is $PYTHON, the active virtual environment, or the project's .venv (scripts/python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python.sh
source scripts/python.sh
bash scripts/install.sh train
exec "$PY" -m echoloss.train.cli --output-dir "${ECHOLOSS_DEMO_DIR:-runs/demo}" "$@"
