"""The next-token view of a packed batch: row ``j`` of the logits predicts token ``j + 1``.

This is the last step of the data path and the record a loss consumes: labels and every per-token
stream shifted by one, so that ``logits[j]`` is scored against ``labels[j]`` with ``rl_mask[j]``,
``echo_weights[j]`` and the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from echoloss.data.packing import PackedBatch

__all__ = ["NextTokenTargets", "next_token_targets"]


class NextTokenTargets(NamedTuple):
    """Row-aligned view of a [`PackedBatch`][echoloss.data.packing.PackedBatch]: row ``j`` of the logits predicts ``labels[j]``.

    Rows whose next token belongs to another segment (the last row of each sequence) and padding
    rows predict nothing: their masks are False, weights 0, label ``0``.

    Attributes:
        labels: ``[L]`` int64.
        rl_mask: ``[L]`` bool.
        echo_weights: ``[L]`` float32 (0 = not echoed).
        observation_mask: ``[L]`` bool.
        advantages: ``[L]`` float32.
        inference_logprobs: ``[L]`` float32.
        temperatures: ``[L]`` float32.
        sequence_ids: ``[L]`` int64 segment of each row, ``-1`` for padding.
    """

    labels: torch.Tensor
    rl_mask: torch.Tensor
    echo_weights: torch.Tensor
    observation_mask: torch.Tensor
    advantages: torch.Tensor
    inference_logprobs: torch.Tensor
    temperatures: torch.Tensor
    sequence_ids: torch.Tensor


def next_token_targets(batch: PackedBatch) -> NextTokenTargets:
    """Shift a packed batch so that row ``j`` holds the streams of token ``j + 1``.

    Position 0 of every segment is never RL, echo or observation, so shifting the whole packed row
    by one already masks the row that would predict across a boundary; the last row predicts
    nothing.

    Args:
        batch: a [`PackedBatch`][echoloss.data.packing.PackedBatch] of length ``L``.

    Returns:
        [`NextTokenTargets`][echoloss.data.targets.NextTokenTargets] with every field of length ``L``.

    Examples:
        >>> from echoloss import Sample, pack
        >>> s = Sample(prompt_ids=[5], completion_ids=[6, 7], completion_mask=[True, True],
        ...            completion_logprobs=[-0.1, -0.2], advantage=1.0)
        >>> [b] = pack([s], max_tokens=8)
        >>> t = next_token_targets(b)
        >>> t.labels.tolist(), t.rl_mask.tolist(), t.advantages.tolist()
        ([6, 7, 0], [True, True, False], [1.0, 1.0, 0.0])
    """

    def shift(x: torch.Tensor, fill: float | bool | int) -> torch.Tensor:
        return torch.cat([x[1:], x.new_full((1,), fill)])

    # A segment's first token is never a target, so the row before it must predict nothing.
    starts = batch.cu_seqlens[1:-1].long()
    labels = shift(batch.input_ids, 0)
    labels[starts - 1] = 0
    seq = batch.sequence_ids()
    return NextTokenTargets(
        labels=labels,
        rl_mask=shift(batch.rl_mask, False),
        echo_weights=shift(batch.echo_weights, 0.0),
        observation_mask=shift(batch.observation_mask, False),
        advantages=shift(batch.advantages, 0.0),
        inference_logprobs=shift(batch.inference_logprobs, 0.0),
        temperatures=shift(batch.temperatures, 1.0),
        sequence_ids=seq,
    )
