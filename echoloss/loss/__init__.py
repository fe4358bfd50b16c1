"""The split RL + echo loss: per-token inputs record, config, policy registry, normalisers, metrics.

The entry points ([`echo_loss`][echoloss.loss.echo_loss] from logits, [`echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs],
`echo_loss_from_hidden` from hidden states) take one `LossInputs` record and differ
only in how they get the log-probabilities.
"""

from __future__ import annotations

from echoloss._deferred import raise_deferred_errors
from echoloss.loss.config import LossConfig
from echoloss.loss.core import LossOutput, echo_loss, echo_loss_from_logprobs
from echoloss.loss.diagnosis import NonFiniteLossError
from echoloss.loss.hidden import echo_loss_from_hidden
from echoloss.loss.inputs import LossInputs
from echoloss.loss.normalization import (
    Normalizers,
    all_reduce_normalizers,
    count_normalizers,
    undo_data_parallel_averaging,
)
from echoloss.loss.policy import (
    POLICIES,
    PolicyInputs,
    PolicyOutput,
    PolicySpec,
    register_policy,
)

__all__ = [
    "POLICIES",
    "LossConfig",
    "LossInputs",
    "LossOutput",
    "NonFiniteLossError",
    "Normalizers",
    "PolicyInputs",
    "PolicyOutput",
    "PolicySpec",
    "all_reduce_normalizers",
    "count_normalizers",
    "echo_loss",
    "echo_loss_from_hidden",
    "echo_loss_from_logprobs",
    "raise_deferred_errors",
    "register_policy",
    "undo_data_parallel_averaging",
]
