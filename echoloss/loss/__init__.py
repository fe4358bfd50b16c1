"""The split RL + echo loss: config, policy variants, normalisers, metrics."""

from __future__ import annotations

from echoloss.loss.config import LossConfig
from echoloss.loss.core import LossOutput, echo_loss, echo_loss_from_logprobs
from echoloss.loss.normalization import (
    Normalizers,
    all_reduce_normalizers,
    count_normalizers,
    undo_data_parallel_averaging,
)
from echoloss.loss.policy import PolicyInputs, PolicyOutput

__all__ = [
    "LossConfig",
    "LossOutput",
    "Normalizers",
    "PolicyInputs",
    "PolicyOutput",
    "all_reduce_normalizers",
    "count_normalizers",
    "echo_loss",
    "echo_loss_from_logprobs",
    "undo_data_parallel_averaging",
]
