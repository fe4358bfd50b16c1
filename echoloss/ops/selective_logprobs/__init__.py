"""Selective logprobs and entropy from logits, chunked over tokens, fp32 results.

The op is [`selective_logprobs`][echoloss.ops.selective_logprobs.selective_logprobs] (``op.py``);
its two phases come from a backend: ``reference.py`` (chunked PyTorch) or ``fused.py`` (Triton
kernels). ``naive.py`` holds the unchunked gold the tests compare both against. ``README.md`` has
the derivation.
"""

from __future__ import annotations

from echoloss.ops.selective_logprobs.op import BACKENDS, resolve_backend, selective_logprobs

__all__ = ["BACKENDS", "resolve_backend", "selective_logprobs"]
