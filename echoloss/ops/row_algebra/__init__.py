"""The ``[N]`` loss algebra between the two selective-logprob phases, as one fused op.

[`row_algebra`][echoloss.ops.row_algebra.op.row_algebra] takes the per-row logprobs (and
entropy) of a loss call and returns the loss, its per-row derivatives, the metrics and the
numbers of the value checks in one pass: one Triton launch (``fused.py``) instead of a hundred
small PyTorch kernels (``naive.py``: the same contract in plain PyTorch, its gold). It covers the
built-in policies with every normaliser, mismatch correction and reference KL
(`RowAlgebraParams`); the loss module
decides when it applies and falls back to its general algebra otherwise.
"""

from __future__ import annotations

from echoloss.ops.row_algebra.op import (
    CHECK_SLOTS,
    STAT_SLOTS,
    RowAlgebraParams,
    RowInputs,
    row_algebra,
)

__all__ = ["CHECK_SLOTS", "STAT_SLOTS", "RowAlgebraParams", "RowInputs", "row_algebra"]
