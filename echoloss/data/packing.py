"""Packing samples into micro-batches (FlashAttention varlen layout).

A [`PackedBatch`][echoloss.data.packing.PackedBatch] is one row of concatenated sequences (batch size 1), FlashAttention style:
``cu_seqlens`` marks the boundaries and ``position_ids`` restart at 0 for every sequence. Every
per-token stream is a tensor of the same length ``L``; optional streams of the samples (echo
weights, observation mask, temperatures) are backfilled so that bins mixing samples with and
without them stay aligned. Every per-token stream is handled by looping over
[`STREAMS`][echoloss.data.interleave.STREAMS], the streams' one declaration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from echoloss._logging import warn_once
from echoloss._validate import describe, problem
from echoloss.advantages import broadcast_packed_advantages
from echoloss.data._checks import MAX_TOKEN_ID, MAX_TOKENS, exact_bool, exact_int, token_id_list
from echoloss.data.interleave import STREAMS, Sample

__all__ = ["PackedBatch", "pack", "truncate_sample", "unpack"]


@dataclass(frozen=True, kw_only=True)
class PackedBatch:
    """Samples concatenated into one sequence of ``L`` tokens (``S`` segments, padding included).

    Token-indexed streams: entry ``t`` describes token ``t`` as a *target* (predicted from ``< t``).
    Use [`echoloss.data.targets.next_token_targets`][echoloss.data.targets.next_token_targets] to get the row-aligned view for ``logits[t]`` predicting ``t+1``.

    Attributes:
        input_ids: ``[L]`` int64.
        position_ids: ``[L]`` int64, restarting at 0 for every segment.
        cu_seqlens: ``[S + 1]`` int32 cumulative segment lengths, ``cu_seqlens[-1] == L``.
        max_seqlen: longest segment.
        streams: every per-token stream of [`STREAMS`][echoloss.data.interleave.STREAMS] by its
            packed name, ``[L]`` each (``fill`` where a sample says nothing and on padding):
            ``rl_mask``, ``inference_logprobs``, ``temperatures``, ``echo_weights``,
            ``observation_mask`` (each also an attribute below) and any stream added to the table.
        advantages: ``[L]`` float32, the sample's advantage on its RL tokens, 0 elsewhere.
        sample_indices: per segment, the index of the sample in the list given to [`pack`][echoloss.data.packing.pack];
            ``-1`` for the padding segment.
        prompt_lens: per segment, the sample's prompt length (0 for padding).
        sample_advantages: per segment, the sample's advantage (``None`` if unset).
        env_names: per segment, the sample's env name (``""`` for padding).
        num_padding: padding tokens at the end (one extra segment when > 0).
        carried: per optional stream (by ``Sample`` attribute name), per segment, whether the
            sample carried it (so [`unpack`][echoloss.data.packing.unpack] can restore ``None``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    streams: Mapping[str, torch.Tensor]
    advantages: torch.Tensor
    sample_indices: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    sample_advantages: tuple[float | None, ...]
    env_names: tuple[str, ...]
    num_padding: int
    carried: Mapping[str, tuple[bool, ...]]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def rl_mask(self) -> torch.Tensor:
        """``[L]`` bool, token trained with RL."""
        return self.streams["rl_mask"]

    @property
    def echo_weights(self) -> torch.Tensor:
        """``[L]`` float32 echo weight, ``0.0`` = not echoed. Disjoint from ``rl_mask``."""
        return self.streams["echo_weights"]

    @property
    def observation_mask(self) -> torch.Tensor:
        """``[L]`` bool, token counted in ``Z = |O|``."""
        return self.streams["observation_mask"]

    @property
    def inference_logprobs(self) -> torch.Tensor:
        """``[L]`` float32 sampling logprobs (0.0 outside completions)."""
        return self.streams["inference_logprobs"]

    @property
    def temperatures(self) -> torch.Tensor:
        """``[L]`` float32 sampling temperature of each token (prompt tokens take the sample's
        first completion temperature, or 1.0)."""
        return self.streams["temperatures"]

    @property
    def has_echo(self) -> tuple[bool, ...]:
        """Per segment: the sample carried echo weights."""
        return self.carried["echo_weights"]

    @property
    def has_observation(self) -> tuple[bool, ...]:
        """Per segment: the sample carried an observation mask."""
        return self.carried["observation_mask"]

    @property
    def has_temperatures(self) -> tuple[bool, ...]:
        """Per segment: the sample carried completion temperatures."""
        return self.carried["completion_temperatures"]

    @property
    def num_sequences(self) -> int:
        """Segments holding a sample (padding excluded)."""
        return sum(1 for i in self.sample_indices if i >= 0)

    def sequence_ids(self) -> torch.Tensor:
        """``[L]`` int64: segment index of each token, ``-1`` on padding."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        ids = torch.tensor(
            [i if s >= 0 else -1 for i, s in enumerate(self.sample_indices)], dtype=torch.long
        )
        return torch.repeat_interleave(ids, lengths)

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on ``device``."""
        moved: dict[str, Any] = {
            k: v.to(device) for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)
        }
        moved["streams"] = MappingProxyType({k: v.to(device) for k, v in self.streams.items()})
        return dataclasses.replace(self, **moved)


def truncate_sample(sample: Sample, max_tokens: int) -> Sample:
    """Cut a sample to its first ``max_tokens`` tokens, every stream in lockstep.

    Examples:
        >>> s = Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_mask=[True, True],
        ...            completion_logprobs=[-0.1, -0.2], echo_weights=[None, 0.5, None, None])
        >>> t = truncate_sample(s, 3)
        >>> t.completion_ids, t.completion_mask, t.echo_weights
        ([3], [True], [None, 0.5, None])
    """
    exact_int("max_tokens", max_tokens, minimum=1)
    if len(sample) <= max_tokens:
        return sample
    p = min(len(sample.prompt_ids), max_tokens)
    return Sample(
        prompt_ids=sample.prompt_ids[:p],
        completion_ids=sample.completion_ids[: max_tokens - p],
        advantage=sample.advantage,
        env_name=sample.env_name,
        **{s.name: s.truncate(getattr(sample, s.name), max_tokens, p) for s in STREAMS},
    )


def _first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def pack(
    samples: Sequence[Sample],
    *,
    max_tokens: int,
    pad_to_multiple_of: int | None = None,
    pad_token_id: int = 0,
    truncate: bool = False,
    vocab_size: int | None = None,
) -> list[PackedBatch]:
    """Pack samples into micro-batches of at most ``max_tokens`` tokens (first-fit-decreasing).

    Args:
        samples: the samples; each is validated first. A sample with RL tokens must have its
            ``advantage`` set.
        max_tokens: token budget per micro-batch (padding included).
        pad_to_multiple_of: pad each micro-batch's length up to a multiple of this with one padding
            segment (positions restart at 0, every mask False). ``max_tokens`` must be a multiple.
        pad_token_id: token id written on padding.
        truncate: cut samples longer than ``max_tokens`` (every stream in lockstep; a cut inside
            the prompt keeps the sample's sampling temperature on the remaining prompt tokens);
            otherwise such a sample is an error.
        vocab_size: the model's vocabulary size, if known: every token id (``pad_token_id``
            included) must be below it.

    Returns:
        ``list[PackedBatch]``, fullest first.

    Raises:
        TypeError: an argument of the wrong type (``pad_to_multiple_of="4"``,
            ``pad_token_id=1.7``, a single ``Sample`` instead of a list).
        ValueError: a sample longer than ``max_tokens`` without ``truncate``, RL tokens without an
            advantage, a token id at or above ``vocab_size``, or an out-of-range argument.

    Examples:
        >>> from echoloss import Sample
        >>> a = Sample(prompt_ids=[1, 2], completion_ids=[3], completion_mask=[True],
        ...            completion_logprobs=[-0.5], advantage=1.0)
        >>> b = Sample(prompt_ids=[4], completion_ids=[5, 6], completion_mask=[True, True],
        ...            completion_logprobs=[-0.1, -0.2], advantage=-1.0,
        ...            echo_weights=[None, None, 0.5])
        >>> [batch] = pack([a, b], max_tokens=8, pad_to_multiple_of=4)
        >>> batch.input_ids.tolist(), batch.cu_seqlens.tolist(), batch.position_ids.tolist()
        ([1, 2, 3, 4, 5, 6, 0, 0], [0, 3, 6, 8], [0, 1, 2, 0, 1, 2, 0, 1])
        >>> batch.rl_mask.tolist(), batch.echo_weights.tolist()
        ([False, False, True, False, True, False, False, False], [0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0])
    """
    exact_int(
        "pack: max_tokens", max_tokens, minimum=1, maximum=MAX_TOKENS, fix="cu_seqlens are int32"
    )
    if pad_to_multiple_of is not None:
        exact_int("pack: pad_to_multiple_of", pad_to_multiple_of, minimum=1, fix="or None")
        if max_tokens % pad_to_multiple_of:
            raise ValueError(
                f"pack: pad_to_multiple_of={pad_to_multiple_of} must divide "
                f"max_tokens={max_tokens}, so that a padded micro-batch still fits the budget"
            )
    exact_bool("pack: truncate", truncate)
    if vocab_size is not None:
        exact_int("pack: vocab_size", vocab_size, minimum=1)
    exact_int("pack: pad_token_id", pad_token_id, minimum=0)
    upper = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    if pad_token_id >= upper:
        raise ValueError(
            problem(
                "pack: pad_token_id",
                "a token id in [0, 2**63)" if vocab_size is None else f"< vocab_size={vocab_size}",
                describe(pad_token_id),
            )
        )
    if isinstance(samples, Sample):
        raise TypeError(
            problem(
                "pack: samples", "a list of echoloss.Sample", "a single Sample", "wrap it: [sample]"
            )
        )
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence):
        raise TypeError(problem("pack: samples", "a list of echoloss.Sample", describe(samples)))
    prepared: list[Sample] = []
    prompt_values: list[dict[str, Any]] = []
    for i, s in enumerate(samples):
        if not isinstance(s, Sample):
            raise TypeError(
                f"pack: samples[{i}] must be an echoloss.Sample, got {type(s).__name__}"
            )
        s.validate(where=f"samples[{i}]")
        if vocab_size is not None:
            token_id_list(f"samples[{i}].token_ids", s.token_ids, vocab_size=vocab_size)
        # A completion stream's value on the prompt (e.g. the prompt's temperature is the
        # sample's first sampling temperature) is read before a truncation that may cut every
        # completion token away (docs/spec.md §8.4).
        prompt_values.append(
            {st.name: st.fill if st.prompt_value is None else st.prompt_value(s) for st in STREAMS}
        )
        if len(s) > max_tokens:
            if not truncate:
                raise ValueError(
                    f"pack: samples[{i}] has {len(s)} tokens > max_tokens={max_tokens}; raise "
                    "max_tokens, or pass truncate=True to cut it (every stream in lockstep)"
                )
            s = truncate_sample(s, max_tokens)
        if s.num_rl_tokens and s.advantage is None:
            raise ValueError(
                f"pack: samples[{i}] has {s.num_rl_tokens} RL tokens but advantage=None; stamp "
                "each sample with its rollout's advantage (see echoloss.compute_advantages)"
            )
        if (s.echo_weights is not None and s.echo_weights[0] is not None) or (
            s.completion_mask and not s.prompt_ids and s.completion_mask[0]
        ):
            warn_once(
                "position-zero-target",
                "echoloss: a sample marks its first token for RL or echo; position 0 has no "
                "prediction and is never trained",
            )
        prepared.append(s)
    bins = _first_fit_decreasing([len(s) for s in prepared], max_tokens)
    return [_build(prepared, prompt_values, idx, pad_to_multiple_of, pad_token_id) for idx in bins]


def _build(
    samples: list[Sample],
    prompt_values: list[dict[str, Any]],
    indices: list[int],
    pad_to: int | None,
    pad_id: int,
) -> PackedBatch:
    ids: list[int] = []
    pos: list[int] = []
    values: dict[str, list[Any]] = {st.name: [] for st in STREAMS}
    lengths: list[int] = []
    for i in indices:
        s = samples[i]
        ids += s.token_ids
        pos += range(len(s))
        for st in STREAMS:
            values[st.name] += st.token_values(s, prompt_values[i][st.name])
        lengths.append(len(s))
    num_padding = 0
    if pad_to is not None and len(ids) % pad_to:
        num_padding = pad_to - len(ids) % pad_to
        ids += [pad_id] * num_padding
        pos += range(num_padding)
        for st in STREAMS:
            values[st.name] += [st.fill] * num_padding
        lengths.append(num_padding)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    chosen = [samples[i] for i in indices]
    pad = (num_padding > 0,)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    streams = {st.packed: torch.tensor(values[st.name], dtype=st.dtype) for st in STREAMS}
    sample_advantages = tuple(s.advantage for s in chosen) + ((None,) if pad[0] else ())
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths),
        streams=MappingProxyType(streams),
        advantages=broadcast_packed_advantages(sample_advantages, cu_seqlens, streams["rl_mask"]),
        sample_indices=tuple(indices) + ((-1,) if pad[0] else ()),
        prompt_lens=tuple(len(s.prompt_ids) for s in chosen) + ((0,) if pad[0] else ()),
        sample_advantages=sample_advantages,
        env_names=tuple(s.env_name for s in chosen) + (("",) if pad[0] else ()),
        num_padding=num_padding,
        carried=MappingProxyType(
            {
                st.name: tuple(getattr(s, st.name) is not None for s in chosen)
                + ((False,) if pad[0] else ())
                for st in STREAMS
                if st.optional
            }
        ),
    )


def unpack(batch: PackedBatch) -> list[tuple[int, Sample]]:
    """Recover ``(sample_index, Sample)`` for every non-padding segment of a packed batch.

    Inverse of [`pack`][echoloss.data.packing.pack] for samples in normal form (position 0 untrained, echoed tokens out of
    the completion mask), which is what [`interleave`][echoloss.data.interleave] produces.

    Examples:
        >>> from echoloss import Sample
        >>> s = Sample(prompt_ids=[1, 2], completion_ids=[3], completion_mask=[True],
        ...            completion_logprobs=[-0.5], advantage=1.0)
        >>> [(index, back)] = unpack(pack([s], max_tokens=4, pad_to_multiple_of=4)[0])
        >>> index, back == s
        (0, True)
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(problem("unpack: batch", "an echoloss.PackedBatch", describe(batch)))
    out: list[tuple[int, Sample]] = []
    cu = batch.cu_seqlens.tolist()
    for k, idx in enumerate(batch.sample_indices):
        if idx < 0:
            continue
        lo, hi = cu[k], cu[k + 1]
        p = batch.prompt_lens[k]
        ids = batch.input_ids[lo:hi].tolist()
        streams: dict[str, Any] = {
            st.name: st.from_packed(
                batch.streams[st.packed][lo:hi].tolist(),
                p,
                carried=not st.optional or batch.carried[st.name][k],
            )
            for st in STREAMS
        }
        sample = Sample(
            prompt_ids=ids[:p],
            completion_ids=ids[p:],
            advantage=batch.sample_advantages[k],
            env_name=batch.env_names[k],
            **streams,
        )
        out.append((idx, sample))
    return out
