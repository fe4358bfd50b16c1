#!/usr/bin/env bash
# The GPU check: one command on a fresh GPU machine with no network, within 10 minutes.
#
# Before it, here (with network): bash benchmarks/gpu_prepare.sh   (wheels into .gpu-wheels/)
# There, from the repository root, with .gpu-wheels carried along:
#   ECHOLOSS_GIT_SHA=<commit> OUT=<results folder> bash benchmarks/gpu_check.sh
#
# Needs on the machine: nvidia-smi, and a python3 with a CUDA build of torch and its triton (and
# numpy, transformers, accelerate, huggingface-hub, pandas, pyarrow, pytest): too large to carry,
# so the `setup` step prints the version of each, or MISSING. Everything else echoloss, its
# tests and the peers (TRL, Liger) need is installed from .gpu-wheels/cpXY/ offline, into a
# scratch folder put first on PYTHONPATH.
#
# Steps, each in its own time box (`timeout`) and independent of the others: a step that fails
# or runs out of time is recorded in steps.jsonl and the next one runs. The boxes add up to at
# most BUDGET_S = 540 s (checked before anything runs; each step gets 5 s more to exit after its
# box), so the whole check ends inside a 600 s command.
#   setup     40 s  GPU, driver, versions; offline install of the carried wheels; import echoloss
#   tests    140 s  pytest -m gpu tests/ops: the GPU tests and the GPU twins of the CPU tests
#   values    75 s  echoloss.nn modules, every loss_type, on CUDA against the CPU path
#   check    150 s  five bf16 shapes, echoloss vs TRL vs Liger (+ naive), and fused-linear
#   rounds    85 s  fused-linear against logits-then-loss in 30 paired rounds (H = 4096)
#   launches  40 s  launches and host syncs of echo_loss and the nn modules per call
#   goals     10 s  the goals summary, printed last
# At most 8 files land in $OUT: env.txt, log.txt (every step's output), steps.jsonl,
# check.jsonl, values.jsonl, linear-rounds.json, launches.md, summary.md. Every row carries the
# GPU's name and ECHOLOSS_GIT_SHA (else the commit gpu_prepare.sh recorded).
#
# GPU_CHECK_STEPS="setup check" runs only the steps named (setup first where another step needs
# the carried wheels), then the goals summary.
# GPU_CHECK_DRY_RUN=1 runs the same sequence with stand-in steps (no GPU, seconds): each step's
# box is GPU_CHECK_DRY_BOX seconds (default 3), GPU_CHECK_STUB="tests=fail,check=hang" makes
# steps fail or hang, and a step that passes leaves its file (copied from the folder
# GPU_CHECK_DRY_FIXTURES, else empty); the collection and the goals summary run for real
# (tests/test_benchmarks.py).
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
DRY=${GPU_CHECK_DRY_RUN:-0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
SITE=$WORK/site
BUDGET_S=540
GRACE_S=5
STEPS=(setup tests values check rounds launches goals)
if [ -n "${GPU_CHECK_STEPS:-}" ]; then  # a subset, e.g. "setup check" (goals always runs last)
  read -r -a STEPS <<<"${GPU_CHECK_STEPS/goals/} goals"
fi
declare -A BOX=([setup]=40 [tests]=140 [values]=75 [check]=150 [rounds]=85 [launches]=40 [goals]=10)
mkdir -p "$OUT"
LOG=$OUT/log.txt
: >"$LOG"
: >"$OUT/steps.jsonl"

total=0
for s in "${STEPS[@]}"; do
  if [ -z "${BOX[$s]:-}" ]; then
    echo "gpu_check: GPU_CHECK_STEPS names '$s'; the steps are: ${!BOX[*]}" >&2
    exit 2
  fi
  total=$((total + BOX[$s]))
done
if [ "$total" -gt "$BUDGET_S" ]; then
  echo "gpu_check: the time boxes add up to $total s, over the budget of $BUDGET_S s" >&2
  exit 2
fi

SHA=${ECHOLOSS_GIT_SHA:-}
if [ -z "$SHA" ]; then
  SHA=$(git rev-parse HEAD 2>/dev/null || sed -n 's/^prepared_at_commit //p' .gpu-wheels/MANIFEST 2>/dev/null)
fi
export ECHOLOSS_GIT_SHA=${SHA:-unknown}
export PYTHONUNBUFFERED=1

# The command of each step (run by `bash -c` under `timeout`; $WORK and $SITE are exported).
export WORK SITE PY
declare -A CMD
CMD[setup]='
  { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    echo "commit $ECHOLOSS_GIT_SHA"
  } >"$WORK/env.txt" 2>&1
  tag=cp$("$PY" -c "import sys; print(\"%d%d\" % sys.version_info[:2])")
  echo "python $("$PY" -V 2>&1) ($tag), wheels from .gpu-wheels/$tag" >>"$WORK/env.txt"
  if ls .gpu-wheels/"$tag"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
      .gpu-wheels/"$tag"/*.whl || echo "offline install FAILED" >>"$WORK/env.txt"
  else
    echo "no wheels for $tag: run bash benchmarks/gpu_prepare.sh with GPU_PYTHONS" >>"$WORK/env.txt"
  fi
  PYTHONPATH="$SITE:$PWD" "$PY" - >>"$WORK/env.txt" 2>&1 <<EOF
from importlib.metadata import PackageNotFoundError, version
names = ["torch", "triton", "numpy", "pydantic", "pydantic-core", "transformers", "accelerate",
         "huggingface-hub", "datasets", "pandas", "pyarrow", "trl", "liger-kernel", "pytest",
         "hypothesis"]
for n in names:
    try:
        print(f"{n} {version(n)}")
    except PackageNotFoundError:
        print(f"{n} MISSING")
import importlib
for mod in ("echoloss",):  # the peers imports: recorded by the check (seconds each)
    try:
        importlib.import_module(mod)
        print(f"import {mod}: ok")
    except Exception as e:  # recorded; the steps that need it fail on their own
        print(f"import {mod}: FAILED {type(e).__name__}: {e}")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
EOF
  cat "$WORK/env.txt"'
CMD[tests]='"$PY" -m pytest -m gpu tests/ops -q -p no:cacheprovider'
CMD[values]='"$PY" -m benchmarks.device_values --device cuda --output "$WORK/values.jsonl"'
CMD[check]='"$PY" -m benchmarks --device cuda --check --no-plot --output "$WORK/check" --name check'
CMD[rounds]='"$PY" -m benchmarks.linear_chunks --chunks "" --rounds 30 --repeats 6 --output "$WORK/linear-rounds.json"'
CMD[launches]='set -o pipefail; "$PY" -m benchmarks.launch_count --n 16384 --v 151936 --no-compile --modules | tee "$WORK/launches.md"'
CMD[goals]='"$PY" -m benchmarks.gpu_goals "$OUT" --write "$OUT/summary.md"'

stub() {  # the dry run's stand-in for step $1: ok, fail or hang as GPU_CHECK_STUB says; an ok
  # step leaves the file its real command writes, from GPU_CHECK_DRY_FIXTURES where given
  local what fx=${GPU_CHECK_DRY_FIXTURES:-/nonexistent} f
  what=$(echo ",${GPU_CHECK_STUB:-}," | sed -n "s/.*,$1=\([a-z]*\),.*/\1/p")
  case "$what" in
    fail) echo "stub: $1 fails"; return 3 ;;
    hang) echo "stub: $1 hangs"; sleep 60 ;;
  esac
  echo "stub: $1 ran"
  case "$1" in
    setup) f=env.txt ;; values) f=values.jsonl ;; rounds) f=linear-rounds.json ;;
    launches) f=launches.md ;; check) mkdir -p "$WORK/check"; f=check/check.jsonl ;;
    tests) [ -f "$fx/tests.txt" ] && cat "$fx/tests.txt"; return 0 ;;
  esac
  if [ -f "$fx/$(basename "$f")" ]; then cp "$fx/$(basename "$f")" "$WORK/$f"; else : >"$WORK/$f"; fi
}
export -f stub

collect() {  # the steps' outputs into $OUT (at most 8 files in all), as far as they got
  [ -f "$WORK/env.txt" ] && cp "$WORK/env.txt" "$OUT/env.txt"
  cat "$WORK"/check/*.jsonl >"$OUT/check.jsonl" 2>/dev/null || rm -f "$OUT/check.jsonl"
  for f in values.jsonl linear-rounds.json launches.md; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/$f"
  done
  return 0
}

for s in "${STEPS[@]}"; do
  box=${BOX[$s]}
  if [ "$s" = goals ] && [ "$DRY" = 1 ]; then
    cmd=${CMD[goals]}  # the summary runs for real: over whatever the stand-ins left
    limit=$box
  elif [ "$DRY" = 1 ]; then
    cmd="stub $s"
    limit=${GPU_CHECK_DRY_BOX:-3}
  else
    cmd=${CMD[$s]}
    limit=$box
  fi
  # the summary is the output's last block: its step's header and record go to the log only
  echo "== $s (time box $box s) ==" >>"$LOG"
  [ "$s" != goals ] && echo "== $s (time box $box s) =="
  start=$(date +%s%N)
  if [ "$s" = goals ]; then
    OUT=$OUT PYTHONPATH="$SITE:$PWD" timeout -k "$GRACE_S" "$limit" bash -c "$cmd" 2>>"$LOG"
    rc=$?
  else
    OUT=$OUT PYTHONPATH="$SITE:$PWD" timeout -k "$GRACE_S" "$limit" bash -c "$cmd" 2>&1 \
      | tee -a "$LOG" | tail -n 5
    rc=${PIPESTATUS[0]}
  fi
  ms=$((($(date +%s%N) - start) / 1000000))
  secs=$(printf "%d.%01d" $((ms / 1000)) $((ms % 1000 / 100)))
  timed_out=false
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && timed_out=true
  printf '{"step": "%s", "box_s": %d, "seconds": %s, "rc": %d, "timed_out": %s}\n' \
    "$s" "$box" "$secs" "$rc" "$timed_out" >>"$OUT/steps.jsonl"
  echo "== $s: rc $rc, $secs s (timed out: $timed_out) ==" >>"$LOG"
  collect  # after every step: a command stopped from outside still returns what ran
  if [ "$s" = goals ] && [ "$rc" -ne 0 ]; then
    echo "gpu_check: the goals summary failed (rc $rc); see $LOG" >&2
  fi
done
rm -rf "$WORK"
exit 0
