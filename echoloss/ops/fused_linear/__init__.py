"""Fused-linear path: the loss from hidden states and the LM-head weight, never the full logits.

[`linear_selective_logprobs`][echoloss.ops.fused_linear.linear_selective_logprobs] is the op (chunked over participating tokens; the two
selective-logprob phases of the chosen backend run on each chunk's logits);
`echo_loss_from_hidden` is [`echoloss.echo_loss`][echoloss.loss.echo_loss] on top of it, with the same loss
algebra ([`echoloss.loss.echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs]). ``README.md`` has the design.
"""

from __future__ import annotations

from echoloss.ops.fused_linear.loss import echo_loss_from_hidden
from echoloss.ops.fused_linear.op import (
    default_linear_chunk_size,
    linear_selective_logprobs,
)

__all__ = ["default_linear_chunk_size", "echo_loss_from_hidden", "linear_selective_logprobs"]
