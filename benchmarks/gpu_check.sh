#!/usr/bin/env bash
# The short GPU check, prepared for one run on one GPU (its steps without the quick sweep and the
# compiled launch count ran in 147 s on an H100; the whole script is not timed yet):
# the kernels' GPU tests, the quick sweep and the one-table check (echoloss vs TRL vs Liger vs
# naive at five bf16 shapes + fused-linear at H = 4096, with host syncs and launches per call).
# Results land in benchmarks/results/ with the GPU name, versions and git sha in every row.
# Needs echoloss's dependencies (pydantic, einops, hypothesis for the tests) and the peers (trl,
# liger-kernel) importable by $PYTHON: on a machine without network, unpack their wheels into a
# folder on PYTHONPATH (python -m zipfile -e WHEEL DIR).
# Run from the repository root:  bash benchmarks/gpu_check.sh
set -euo pipefail
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export ECHOLOSS_GIT_SHA=${ECHOLOSS_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu_check_env.txt"
timeout 120 "$PY" -m pytest -q -m gpu tests/ops 2>&1 | tail -5 | tee -a "$OUT/gpu_check_env.txt"
timeout 120 "$PY" -m benchmarks --device cuda --quick --output "$OUT" --no-plot
timeout 240 "$PY" -m benchmarks --device cuda --check --output "$OUT" --no-plot
# Launches and host syncs of one echo_loss forward+backward (the three Triton kernels among the
# launches): the default (fused row algebra), and the compiled [N] algebra (compile_loss_algebra);
# then EchoGRPOLoss with its value checks in Triton and in PyTorch, side by side (--modules).
timeout 180 "$PY" -m benchmarks.launch_count --n 16384 --v 151936 --modules \
  | tee "$OUT/gpu_check_launches.md"
# Where the time goes: kernels, launches and host time per forward+backward, echoloss vs TRL.
timeout 90 "$PY" -m benchmarks.profile_step | tee "$OUT/gpu_check_profile.md"
# The fused-linear op's chunk size against time and memory, beside logits-then-loss (H = 4096),
# then the automatic chunk alone in 20 paired rounds (a difference of 0.3 % needs them), beside
# the same op with phase 2 writing into a new buffer (does writing over the logits cost time?).
timeout 90 "$PY" -m benchmarks.linear_chunks | tee "$OUT/gpu_check_linear_chunks.md"
timeout 150 "$PY" -m benchmarks.linear_chunks --chunks "" --rounds 20 --repeats 6 --new-buffer \
  | tee "$OUT/gpu_check_linear_rounds.md"
# The chunked LM head's GEMMs one by one, and the kernels of logits-then-loss beside fused-linear.
timeout 60 "$PY" -m benchmarks.gemm_chunks | tee "$OUT/gpu_check_gemm_chunks.md"
timeout 60 "$PY" -m benchmarks.linear_profile | tee "$OUT/gpu_check_linear_profile.md"
