#!/usr/bin/env bash
# The main job of the README: installs echoloss with the trainer's extra and runs the reference
# trainer on its embedded default (tiny model, local tokenizer, built-in tool environment, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh train
exec "${PYTHON:-python3}" -m echoloss.train.cli --output-dir "${ECHOLOSS_DEMO_DIR:-runs/demo}" "$@"
