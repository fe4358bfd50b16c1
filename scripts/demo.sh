#!/usr/bin/env bash
# The main job of the README: installs echoloss and runs the end-to-end example on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
"${PYTHON:-python3}" examples/quickstart.py "$@"
