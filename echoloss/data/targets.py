"""The next-token view of a packed batch: row ``j`` of the logits predicts token ``j + 1``.

This is the last step of the data path and the record a loss consumes: labels and every per-token
stream shifted by one, so that ``logits[j]`` is scored against ``labels[j]`` with ``rl_mask[j]``,
``echo_weights[j]`` and the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from echoloss._validate import describe, problem
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

    Position 0 of every segment has no prediction (docs/spec.md §7): the row before it belongs to
    the previous segment, so it must predict nothing. This function checks that every segment's
    first token is neither RL, echo nor observation (``pack`` guarantees it; a hand-built batch may
    not) and raises otherwise, so that shifting the whole packed row by one cannot train a
    cross-sequence prediction. The last row of the batch predicts nothing.

    Args:
        batch: a [`PackedBatch`][echoloss.data.packing.PackedBatch] of length ``L``.

    Returns:
        [`NextTokenTargets`][echoloss.data.targets.NextTokenTargets] with every field of length ``L``.

    Raises:
        TypeError: ``batch`` is not a [`PackedBatch`][echoloss.data.packing.PackedBatch].
        ValueError: a segment's first token is marked RL, echo or observation.

    Examples:
        >>> from echoloss import Sample, pack
        >>> s = Sample(prompt_ids=[5], completion_ids=[6, 7], completion_mask=[True, True],
        ...            completion_logprobs=[-0.1, -0.2], advantage=1.0)
        >>> [b] = pack([s], max_tokens=8)
        >>> t = next_token_targets(b)
        >>> t.labels.tolist(), t.rl_mask.tolist(), t.advantages.tolist()
        ([6, 7, 0], [True, True, False], [1.0, 1.0, 0.0])
    """

    if not isinstance(batch, PackedBatch):
        raise TypeError(
            problem("next_token_targets: batch", "an echoloss.PackedBatch", describe(batch))
        )
    _check_segment_starts_untrained(batch)

    def shift(x: torch.Tensor, fill: float | bool | int) -> torch.Tensor:
        return torch.cat([x[1:], x.new_full((1,), fill)])  # [L]

    # A segment's first token is never a target, so the row before it must predict nothing.
    starts = batch.cu_seqlens[1:-1].long()  # [S - 1] first token of every segment but the first
    labels = shift(batch.input_ids, 0)  # [L]
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


def _check_segment_starts_untrained(batch: PackedBatch) -> None:
    """Raise if the first token of any segment is RL, echo or observation (docs/spec.md §7)."""
    starts = batch.cu_seqlens[:-1].long()  # [S] first token of every segment
    starts = starts[starts < len(batch)]  # an empty segment has no first token
    streams = {
        "rl_mask": batch.rl_mask[starts],  # [S]
        "echo_weights": batch.echo_weights[starts] != 0,  # [S]
        "observation_mask": batch.observation_mask[starts],  # [S]
    }
    for name, marked in streams.items():
        if bool(marked.any()):
            k = int(marked.nonzero()[0, 0])
            t = int(starts[k])
            raise ValueError(
                f"next_token_targets: batch.{name}[{t}] marks the first token of segment {k} "
                "for training, but position 0 of a sequence has no prediction (the row before "
                "it belongs to the previous sequence); build batches with echoloss.pack, which "
                "clears it, or clear that entry"
            )
