"""The next-token view of a packed batch: row ``j`` of the logits predicts token ``j + 1``.

This is the last step of the data path and the record a loss consumes: labels and every per-token
stream shifted by one, so that ``logits[j]`` is scored against ``labels[j]`` with ``rl_mask[j]``,
``echo_weights[j]`` and the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from echoloss._validate import describe, problem
from echoloss.data.interleave import STREAMS
from echoloss.data.packing import PackedBatch

__all__ = ["NextTokenTargets", "next_token_targets"]


class NextTokenTargets(NamedTuple):
    """Row-aligned view of a [`PackedBatch`][echoloss.data.packing.PackedBatch]: row ``j`` of the logits predicts ``labels[j]``.

    Rows whose next token belongs to another segment (the last row of each sequence) and padding
    rows predict nothing: their streams hold each stream's ``fill`` (masks False, weights 0),
    label ``0``.

    Attributes:
        labels: ``[L]`` int64.
        sequence_ids: ``[L]`` int64 segment of each row, ``-1`` for padding.
        advantages: ``[L]`` float32.
        streams: every packed stream shifted by one, by packed name (``[L]`` each): the
            attributes below and any stream added to [`STREAMS`][echoloss.data.interleave.STREAMS];
            `echoloss.LossInputs.from_targets` takes those named like a record field.
        rl_mask: ``[L]`` bool.
        echo_weights: ``[L]`` float32 (0 = not echoed).
        observation_mask: ``[L]`` bool.
        inference_logprobs: ``[L]`` float32.
        temperatures: ``[L]`` float32.
    """

    labels: torch.Tensor
    sequence_ids: torch.Tensor
    advantages: torch.Tensor
    streams: Mapping[str, torch.Tensor]

    @property
    def rl_mask(self) -> torch.Tensor:
        return self.streams["rl_mask"]

    @property
    def echo_weights(self) -> torch.Tensor:
        return self.streams["echo_weights"]

    @property
    def observation_mask(self) -> torch.Tensor:
        return self.streams["observation_mask"]

    @property
    def inference_logprobs(self) -> torch.Tensor:
        return self.streams["inference_logprobs"]

    @property
    def temperatures(self) -> torch.Tensor:
        return self.streams["temperatures"]


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

    # A segment's first token is never a target, so the row before it predicts nothing: it holds
    # label 0 and every stream's fill, never a value of the next sequence.
    starts = batch.cu_seqlens[1:-1].long()  # [S - 1] first token of every segment but the first

    def shift(x: torch.Tensor, fill: float | bool | int) -> torch.Tensor:
        out = torch.cat([x[1:], x.new_full((1,), fill)])  # [L]
        out[starts - 1] = fill
        return out

    labels = shift(batch.input_ids, 0)  # [L]
    streams = {st.packed: shift(batch.streams[st.packed], st.fill) for st in STREAMS}
    return NextTokenTargets(
        labels=labels,
        sequence_ids=batch.sequence_ids(),
        advantages=shift(batch.advantages, 0.0),
        streams=MappingProxyType(streams),
    )


def _check_segment_starts_untrained(batch: PackedBatch) -> None:
    """Raise if the first token of any segment is marked in a stream that position 0 must leave
    at its fill (RL, echo, observation: ``untrained_at_zero`` in `STREAMS`; docs/spec.md §7)."""
    starts = batch.cu_seqlens[:-1].long()  # [S] first token of every segment
    starts = starts[starts < len(batch)]  # an empty segment has no first token
    streams = {
        st.packed: batch.streams[st.packed][starts] != st.fill  # [S] bool
        for st in STREAMS
        if st.untrained_at_zero
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
