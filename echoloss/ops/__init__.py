"""Logits-level ops: each op folder holds its PyTorch reference beside its fused kernels.

Ops are leaves: nothing here imports the loss (`tests/test_import_layering.py`)."""

from __future__ import annotations

from echoloss.ops.selective_logprobs import selective_logprobs

__all__ = ["selective_logprobs"]
