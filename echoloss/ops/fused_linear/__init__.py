"""Fused-linear path: selective logprobs from hidden states and the LM-head weight, never the
full logits.

[`linear_selective_logprobs`][echoloss.ops.fused_linear.linear_selective_logprobs] is the op (chunked over participating tokens; the two
selective-logprob phases of the chosen backend run on each chunk's logits). The loss on top of
it, `echoloss.echo_loss_from_hidden`, lives with the other loss entry points in
``echoloss/loss/hidden.py``. ``README.md`` has the design.
"""

from __future__ import annotations

from echoloss.ops.fused_linear.op import (
    default_linear_chunk_size,
    linear_selective_logprobs,
)

__all__ = ["default_linear_chunk_size", "linear_selective_logprobs"]
