#!/usr/bin/env bash
# The main job of the README: installs echoloss with the trainer's extra and runs the reference
# trainer on its embedded default (tiny model, local tokenizer, built-in tool environment, CPU).
# The Python is $PYTHON, the active virtual environment, or the project's .venv (scripts/python.sh).
# Output: runs/demo ($ECHOLOSS_DEMO_DIR); when that already holds a run, a new runs/demo-<UTC time>
# (the trainer never overwrites a run unasked): pass --resume to continue the earlier run,
# --overwrite to replace it, or --output-dir DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/python.sh
source scripts/python.sh
bash scripts/install.sh train
dir="${ECHOLOSS_DEMO_DIR:-runs/demo}"
chosen=0
for arg in "$@"; do
    case "$arg" in --resume | --resume=* | --overwrite | --output-dir | --output-dir=*) chosen=1 ;; esac
done
if [[ $chosen == 0 && -d "$dir" && -n "$(ls -A "$dir")" ]]; then
    fresh="$dir-$(date -u +%Y%m%d-%H%M%S)"
    echo "demo.sh: $dir holds an earlier run; this one writes to $fresh (--resume continues that run, --overwrite replaces it)" >&2
    dir="$fresh"
fi
exec "$PY" -m echoloss.train.cli --output-dir "$dir" "$@"
