"""The update's forward pass: hidden states and the LM head only where the loss reads them, and a
prompt prefix shared by many samples computed once.

A calculator rollout of SmolLM2 is ~500 tokens of system prompt and worked examples, identical
in every sample of a step, then ~100 tokens of its own; the loss reads only the ~50 RL and echo
rows of each. Three ways to compute the loss's inputs (``model.update_forward``):

``"logits"``
    The packed forward of the whole row and the ``[L, V]`` logits at every position (the token
    export needs them).
``"packed"``
    The packed forward of the decoder (`packed_hidden`), then the LM head only on the rows that
    carry loss (`loss_rows`), through [`echoloss.echo_loss_from_hidden`][echoloss.loss.echo_loss_from_hidden].
``"shared_prefix"``
    Samples that start with the same tokens are put in one *prefix cluster*
    (`prefix_clusters`); the decoder runs the cluster's common prefix once
    (`SharedPrefixForward`), keeps its keys and values, and runs every sample's continuation
    against them, batched (right-padded, one 4D mask). The prefix's keys and values are leaves
    of each micro-batch's graph; after the last micro-batch their summed gradients flow once
    through the prefix's own graph (`SharedPrefixForward.backward`), so the parameters get the
    gradient of the unshared computation (tested in fp64). The prefix ends before the first row
    that carries loss (row ``j`` predicts token ``j + 1``), so no loss row is in it.

Everything here runs under the caller's autocast (the trainer's fp32 master weights computing in
``model.dtype``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import echoloss
from echoloss.loss import LossInputs

__all__ = [
    "MIN_SHARED_PREFIX",
    "PrefixCluster",
    "SharedPrefixForward",
    "cache_keyword",
    "common_prefix_length",
    "continuation_batch",
    "first_loss_rows",
    "lm_head_weight",
    "loss_rows",
    "packed_hidden",
    "prefix_clusters",
    "resolve_update_forward",
    "returned_cache",
    "select_rows",
]

#: Shortest common prefix worth sharing (tokens): below it a sample is its own cluster and runs
#: unshared (a second forward call costs more than it saves).
MIN_SHARED_PREFIX = 16


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share.

    Examples:
        >>> common_prefix_length([1, 2, 3], [1, 2, 4, 5]), common_prefix_length([], [1])
        (2, 0)
    """
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class PrefixCluster:
    """Samples that share their first ``prefix_len`` tokens.

    Attributes:
        members: indices of the samples (in the list given to `prefix_clusters`), in that order.
        prefix_len: tokens computed once for all members (0: the members run unshared).
    """

    members: tuple[int, ...]
    prefix_len: int


def prefix_clusters(
    token_ids: Sequence[Sequence[int]],
    first_loss_row: Sequence[int],
    *,
    min_prefix: int = MIN_SHARED_PREFIX,
) -> list[PrefixCluster]:
    """Group samples whose common prefix is at least ``min_prefix`` tokens.

    Sorted by their tokens, samples sharing a prefix are neighbours, and the common prefix of a
    run of neighbours is the smallest common prefix of adjacent pairs; runs are cut where it
    would fall below ``min_prefix``. A cluster's prefix is capped so that it ends before every
    member's first loss row (``first_loss_row[i]``: the first row ``j`` of sample ``i`` whose
    next token carries loss, or its length when none does) and leaves every member at least one
    token. Single samples get ``prefix_len = 0``.

    Examples:
        >>> a, b, c = [1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [9, 9, 9]
        >>> prefix_clusters([a, b, c], [4, 4, 2], min_prefix=2)
        [PrefixCluster(members=(0, 1), prefix_len=4), PrefixCluster(members=(2,), prefix_len=0)]
        >>> prefix_clusters([a, b], [2, 4], min_prefix=2)  # the first loss row caps the prefix
        [PrefixCluster(members=(0, 1), prefix_len=2)]
    """
    if len(token_ids) != len(first_loss_row):
        raise ValueError(
            f"first_loss_row: one per sample ({len(token_ids)}), got {len(first_loss_row)}"
        )
    order = sorted(range(len(token_ids)), key=lambda i: list(token_ids[i]))
    runs: list[list[int]] = []
    shared: list[int] = []
    for i in order:
        if runs:
            cap = min(len(token_ids[i]) - 1, first_loss_row[i])
            n = min(shared[-1], common_prefix_length(token_ids[runs[-1][-1]], token_ids[i]), cap)
            if n >= min_prefix:
                runs[-1].append(i)
                shared[-1] = n
                continue
        runs.append([i])
        shared.append(min(len(token_ids[i]) - 1, first_loss_row[i]))
    return [
        PrefixCluster(tuple(sorted(r)), p if len(r) > 1 else 0)
        for r, p in zip(runs, shared, strict=True)
    ]


def first_loss_rows(samples: Sequence[echoloss.Sample]) -> list[int]:
    """Per sample, the first row ``j`` whose next token carries loss (RL, or echoed), or the
    sample's length when none does: a shared prefix must end at or before it.

    Examples:
        >>> from echoloss import Sample
        >>> s = Sample(prompt_ids=[1, 2, 3], completion_ids=[4, 5], completion_mask=[False, True],
        ...            completion_logprobs=[-0.1, -0.2], advantage=1.0)
        >>> first_loss_rows([s])
        [3]
    """
    out = []
    for s in samples:
        [b] = echoloss.pack([s], max_tokens=max(len(s), 1))
        trained = (b.rl_mask | (b.echo_weights > 0)).nonzero()
        out.append(int(trained[0, 0]) - 1 if len(trained) else len(s))
    return out


def resolve_update_forward(
    update_forward: str, *, attn_implementation: str, world: int, export_tokens: bool
) -> str:
    """The update's forward for ``model.update_forward = update_forward`` on ``world``
    processes: ``auto`` is ``"shared_prefix"`` on one process with a non-flash attention
    (``model.attn_implementation``) and no token export (``train.export_tokens``), ``"packed"``
    with a flash attention (its varlen kernels need the packed row), ``"logits"`` under FSDP
    (its root unit gathers the LM head inside the model's own forward) or with
    ``export_tokens`` (which writes every row's logprob).

    Raises:
        ValueError: a forward that cannot run with these settings, naming the setting to change.

    Examples:
        >>> kw = {"attn_implementation": "sdpa", "export_tokens": False}
        >>> [resolve_update_forward("auto", world=w, **kw) for w in (1, 2)]
        ['shared_prefix', 'logits']
    """
    flash = "flash" in attn_implementation
    needs = "FSDP (several processes)" if world > 1 else None
    if export_tokens:
        needs = "train.export_tokens (every row's logprob)"
    if update_forward == "auto":
        if needs is not None:
            return "logits"
        return "packed" if flash else "shared_prefix"
    if needs is not None and update_forward != "logits":
        raise ValueError(
            f"model.update_forward = {update_forward!r}: {needs} needs every row's logits; "
            "set model.update_forward = 'logits' (or 'auto')"
        )
    if flash and update_forward == "shared_prefix":
        raise ValueError(
            f"model.update_forward = 'shared_prefix' needs a 4D attention mask, which "
            f"attn_implementation = {attn_implementation!r} does not take; use 'packed' "
            "(or 'auto'), or attn_implementation = 'sdpa'"
        )
    return update_forward


def lm_head_weight(model: Any) -> torch.Tensor:
    """The ``[V, H]`` LM-head weight of a Hugging Face causal LM (the embedding when tied)."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(
            f"{type(model).__name__} has no output embedding with a weight; use "
            "model.update_forward = 'logits'"
        )
    if getattr(head, "bias", None) is not None:
        raise TypeError(
            f"{type(model).__name__}'s LM head has a bias, which the hidden-state loss does not "
            "add; use model.update_forward = 'logits'"
        )
    weight: torch.Tensor = head.weight
    return weight


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype a matmul computes in here: the autocast dtype when autocast is on."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def select_rows(x: LossInputs, rows: torch.Tensor) -> LossInputs:
    """``x`` restricted to the rows ``rows`` (``[n]`` int64 indices into ``[N]``), in that order;
    sequence ids and env names are kept, so per-sequence normalisers see the same sequences.

    Examples:
        >>> x = LossInputs(rl_mask=torch.tensor([False, True, True]),
        ...                labels=torch.tensor([4, 5, 6]), temperature=torch.tensor([1., .7, .7]))
        >>> y = select_rows(x, torch.tensor([1, 2]))
        >>> y.labels.tolist(), y.rl.tolist(), y.temperature.tolist()
        ([5, 6], [True, True], [0.699999988079071, 0.699999988079071])
    """
    changes: dict[str, Any] = {}
    for f in LossInputs.per_token_fields():
        value = getattr(x, f.name)
        if value is not None:
            changes[f.name] = value[rows]
    changes["rl_mask"] = x.rl_mask[rows]
    temp = x.temperature
    if isinstance(temp, torch.Tensor) and temp.dim() > 0:
        changes["temperature"] = temp[rows]
    return dataclasses.replace(x, **changes)


def participating_rows(x: LossInputs) -> torch.Tensor:
    """``[n]`` int64: the rows either term of the loss reads (RL rows and echoed rows)."""
    return torch.nonzero(x.rl | x.echo).flatten()


def packed_hidden(model: Any, batch: echoloss.PackedBatch, *, attn_implementation: str) -> Any:
    """Final hidden states ``[L, H]`` of one packed row, sequences kept apart (the decoder of
    `echoloss.train.model.packed_logits`, without the LM head)."""
    from echoloss.train.model import packed_attention_mask

    ids = batch.input_ids[None]
    kwargs: dict[str, Any] = {
        "input_ids": ids,
        "position_ids": batch.position_ids[None],
        "use_cache": False,
    }
    if "flash" not in attn_implementation:
        dtype = _compute_dtype(ids.device, next(model.parameters()).dtype)
        kwargs["attention_mask"] = packed_attention_mask(
            batch.cu_seqlens, ids.shape[1], dtype, ids.device
        )
    hidden: torch.Tensor = model.get_decoder()(**kwargs).last_hidden_state[0]
    return hidden


@dataclass(frozen=True)
class LossRows:
    """The rows of one micro-batch that carry loss: their final hidden states, the LM head and
    their loss inputs (``[n]``), for [`echoloss.echo_loss_from_hidden`][echoloss.loss.echo_loss_from_hidden]."""

    hidden: torch.Tensor
    weight: torch.Tensor
    inputs: LossInputs


def loss_rows(hidden: torch.Tensor, weight: torch.Tensor, x: LossInputs) -> LossRows:
    """`LossRows` from the hidden states of every row (``[L, H]``) and the micro-batch's loss
    inputs: the participating rows, hidden and weight in the compute dtype (what the LM head's
    matmul would run in under autocast)."""
    rows = participating_rows(x)
    dtype = _compute_dtype(hidden.device, weight.dtype)
    return LossRows(hidden[rows].to(dtype), weight.to(dtype), select_rows(x, rows))


@dataclass(frozen=True)
class ContinuationBatch:
    """The continuations of a micro-batch's samples after their shared prefix, right-padded.

    Attributes:
        input_ids: ``[S, C]`` (padding: the pad id).
        position_ids: ``[S, C]``, from ``prefix_len``.
        lengths: ``[S]`` real tokens of each row.
        gather: ``[L]`` int64: for every row of the packed batch, its index in the flattened
            ``[S * C]`` hidden states, or -1 for a row inside the prefix (or padding).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: torch.Tensor
    gather: torch.Tensor


def continuation_batch(
    batch: echoloss.PackedBatch, prefix_len: int, pad_id: int
) -> ContinuationBatch:
    """Split every sequence of ``batch`` after its first ``prefix_len`` tokens (shared by all of
    them) into one right-padded row per sequence.

    Examples:
        >>> from echoloss import Sample, pack
        >>> s = [Sample(prompt_ids=[1, 2, 3], completion_ids=c, completion_mask=[True] * len(c),
        ...             completion_logprobs=[-0.1] * len(c), advantage=1.0) for c in ([4], [5, 6])]
        >>> [b] = pack(s, max_tokens=16)
        >>> c = continuation_batch(b, 2, pad_id=0)
        >>> c.input_ids.tolist(), c.position_ids.tolist(), c.gather.tolist()
        ([[3, 5, 6], [3, 4, 0]], [[2, 3, 4], [2, 3, 4]], [-1, -1, 0, 1, 2, -1, -1, 3, 4])
    """
    cu = batch.cu_seqlens.tolist()
    segments = [
        (cu[k], cu[k + 1]) for k, s in enumerate(batch.sample_indices) if s >= 0
    ]  # padding segments carry no loss
    width = max(b - a for a, b in segments) - prefix_len
    ids = torch.full((len(segments), width), pad_id, dtype=torch.long)
    gather = torch.full((len(batch),), -1, dtype=torch.long)
    lengths = []
    for row, (a, b) in enumerate(segments):
        n = b - a - prefix_len
        ids[row, :n] = batch.input_ids[a + prefix_len : b].cpu()
        gather[a + prefix_len : b] = row * width + torch.arange(n)
        lengths.append(n)
    device = batch.input_ids.device
    pos = torch.arange(prefix_len, prefix_len + width).expand(len(segments), -1)
    return ContinuationBatch(
        ids.to(device), pos.to(device), torch.tensor(lengths, device=device), gather.to(device)
    )


def _continuation_mask(
    lengths: torch.Tensor, prefix_len: int, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[S, 1, C, P + C]`` additive mask: every query sees the whole prefix and the earlier
    tokens of its own row; padding keys are hidden (a padding query still sees the prefix, so no
    row is fully masked)."""
    device = lengths.device
    q = torch.arange(width, device=device)
    allowed = (q[None, :] <= q[:, None])[None] & (q[None, None, :] < lengths[:, None, None])
    allowed = torch.cat(
        [torch.ones(len(lengths), width, prefix_len, dtype=torch.bool, device=device), allowed], 2
    )
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def cache_keyword(module: Any) -> str:
    """The keyword a Hugging Face model's forward takes its KV cache by: ``cache`` since
    transformers 5.2x (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a forward with ``use_cache=True`` returned (``cache`` or ``past_key_values``)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@dataclass
class _Prefix:
    """A computed prefix: its keys and values per layer (``[1, heads, P, D]``, in the prefix's
    graph) and their detached leaves, which every micro-batch's graph starts from."""

    length: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    leaves: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class SharedPrefixForward:
    """The decoder on each prefix once, and on every micro-batch's continuations against it.

    Use: `hidden` per micro-batch (under autocast), each micro-batch's loss backward, then
    `backward` once, which sends the gradients accumulated on the prefixes' keys and values
    through the prefixes' own forward.

    Args:
        model: a Hugging Face causal LM (``get_decoder()`` takes ``past_key_values``).
        prefixes: the token ids of each cluster's prefix (``[]`` for an unshared cluster).
        pad_id: the token id written on continuation padding.
    """

    def __init__(self, model: Any, prefixes: Sequence[Sequence[int]], pad_id: int) -> None:
        self.model = model
        self.prefixes = [list(p) for p in prefixes]
        self.pad_id = pad_id
        self.done: dict[int, _Prefix] = {}

    def _prefix(self, index: int, device: torch.device) -> _Prefix:
        if index not in self.done:
            ids = torch.tensor([self.prefixes[index]], device=device)
            out = self.model.get_decoder()(input_ids=ids, use_cache=True)
            kv = [(layer.keys, layer.values) for layer in returned_cache(out).layers]
            grad = torch.is_grad_enabled()
            leaves = [
                (k.detach().requires_grad_(grad), v.detach().requires_grad_(grad)) for k, v in kv
            ]
            self.done[index] = _Prefix(len(self.prefixes[index]), kv, leaves)
        return self.done[index]

    def hidden(self, batch: echoloss.PackedBatch, index: int) -> torch.Tensor:
        """Final hidden states ``[L, H]`` of ``batch`` (every sequence starts with prefix
        ``index``); rows inside the prefix are zeros (no loss row is there)."""
        from transformers import DynamicCache

        device = batch.input_ids.device
        p = len(self.prefixes[index])
        c = continuation_batch(batch, p, self.pad_id)
        rows, width = c.input_ids.shape
        dtype = _compute_dtype(device, next(self.model.parameters()).dtype)
        kwargs: dict[str, Any] = {}
        if p:
            cache = DynamicCache()
            for layer, (k, v) in enumerate(self._prefix(index, device).leaves):
                cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), layer)
            kwargs[cache_keyword(self.model.get_decoder())] = cache
        out = self.model.get_decoder()(
            input_ids=c.input_ids,
            position_ids=c.position_ids,
            attention_mask=_continuation_mask(c.lengths, p, width, dtype),
            use_cache=bool(p),
            **kwargs,
        ).last_hidden_state  # [S, C, H]
        flat: torch.Tensor = out.reshape(rows * width, -1)
        inside = c.gather >= 0
        hidden = flat.new_zeros(len(batch), flat.shape[-1])
        return hidden.index_put((inside.nonzero().flatten(),), flat[c.gather[inside]])

    def backward(self) -> None:
        """Send the gradients the micro-batches left on each prefix's keys and values through
        the prefix's forward (once per prefix), then drop the prefixes."""
        outputs, grads = [], []
        for prefix in self.done.values():
            for (k, v), (lk, lv) in zip(prefix.kv, prefix.leaves, strict=True):
                for t, leaf in ((k, lk), (v, lv)):
                    if leaf.grad is not None and t.requires_grad:
                        outputs.append(t)
                        grads.append(leaf.grad)
        if outputs:
            torch.autograd.backward(outputs, grads)
        self.done.clear()
