"""Logits-level ops: pure-PyTorch references (and, later, fused kernels beside them)."""

from __future__ import annotations

from echoloss.ops.selective_logprobs import selective_logprobs

__all__ = ["selective_logprobs"]
