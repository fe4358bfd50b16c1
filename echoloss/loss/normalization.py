"""Global normalisers for the RL and echo terms, under gradient accumulation and data parallelism.

Each term is divided by its own *global* count (over every micro-batch of the optimiser step, on
every data-parallel rank), so that summing the micro-batch gradients and then the ranks' gradients
gives the true per-token (or per-sequence) mean over the global batch. Recipe, once per step::

    local = sum((count_normalizers(x) for x in micro_batch_inputs), Normalizers())
    norms = all_reduce_normalizers(local)                 # SUM over the data-parallel group
    for x in micro_batch_inputs:
        echo_loss(logits, x, normalizers=norms).loss.backward()  # gradients accumulate
    undo_data_parallel_averaging(model, world_size)        # DDP/FSDP averaged: multiply back

``docs/normalization.md`` has the formulas of every mode and the λ conversion table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch

from echoloss._validate import describe, problem
from echoloss.loss.config import LossConfig
from echoloss.loss.inputs import LossInputs
from echoloss.ops.value_checks import DeferredChecks

__all__ = [
    "Divisors",
    "LocalSequences",
    "Normalizers",
    "RowCounts",
    "all_reduce_normalizers",
    "count_normalizers",
    "local_sequences",
    "row_counts",
    "undo_data_parallel_averaging",
]


#: Largest count a ``Normalizers`` field takes: exact in float64 (and in int64).
MAX_COUNT = 2**53


@dataclass(frozen=True)
class Normalizers:
    """Global counts for one optimiser step (sum over micro-batches and data-parallel ranks).

    Add two with ``+`` (or ``sum(..., Normalizers())``) to accumulate micro-batches.

    Attributes:
        rl_tokens: RL rows (``rl_mask`` and not echoed): denominator of RL ``token_mean``.
        echo_tokens: echo rows (``echo_weights > 0``; weight 0 is never counted): denominator of
            echo ``token_mean``.
        sequences: sequences with at least one RL or echo row (reported; no term divides by it).
        echo_batches: micro-batches with at least one echo row: denominator of echo
            ``batch_token_mean``.
        rl_sequences: sequences with at least one RL row: denominator of the RL
            ``sequence_mean*`` modes.
        echo_sequences: sequences with at least one echo row: denominator of echo
            ``sequence_mean``.

    Each term has its own sequence count, so a sequence that trains only one term does not
    dilute the other (an echo-only sequence leaves the RL mean unchanged); padding and sequences
    that train nothing count nowhere, so dummy micro-batches cannot dilute a mean.

    Examples:
        >>> Normalizers(rl_tokens=3, echo_tokens=1) + Normalizers(rl_tokens=2, rl_sequences=1)
        Normalizers(rl_tokens=5, echo_tokens=1, sequences=0, echo_batches=0, rl_sequences=1, echo_sequences=0)
    """

    rl_tokens: int = 0
    echo_tokens: int = 0
    sequences: int = 0
    echo_batches: int = 0
    rl_sequences: int = 0
    echo_sequences: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
                raise ValueError(
                    problem(
                        f"Normalizers.{f.name}",
                        f"an int in [0, {MAX_COUNT}] (2**53: exact in float64 and int64)",
                        describe(v),
                        "a count of tokens or sequences of one step; sum the per-micro-batch "
                        "counts (count_normalizers), not their products",
                    )
                )

    def __add__(self, other: Normalizers) -> Normalizers:
        if not isinstance(other, Normalizers):
            return NotImplemented
        return Normalizers(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    def __radd__(self, other: object) -> Normalizers:
        if other == 0:  # sum() starts from 0
            return self
        return NotImplemented

    def as_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[6]`` int64 in field order (what [`all_reduce_normalizers`][echoloss.loss.normalization.all_reduce_normalizers] reduces)."""
        return torch.tensor(list(asdict(self).values()), dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Normalizers:
        """Inverse of [`as_tensor`][echoloss.loss.normalization.Normalizers.as_tensor]."""
        return cls(*(int(v) for v in t.tolist()))


@dataclass(frozen=True)
class LocalSequences:
    """Local sequence numbering, as ``[N]`` tensors of static size (no host read).

    The sequences with an RL or echo row are numbered ``0..S_local-1`` in the order of their
    ids; every per-sequence tensor has ``size = N + 1`` slots, the last one (``pad``) collecting
    the rows that belong to none of them, so its entry is dropped from every sum.
    """

    size: int  # N + 1 slots of every per-sequence tensor
    row: torch.Tensor | None  # [N] int64 local sequence of each row (pad: no local sequence)
    rl_index: torch.Tensor | None  # [N] int64 local sequence of each RL row, pad elsewhere
    echo_index: torch.Tensor | None  # [N] int64 local sequence of each echo row, pad elsewhere
    num: torch.Tensor | int  # S_local: sequences with an RL or echo row
    rl_count: torch.Tensor | int  # sequences with an RL row
    echo_count: torch.Tensor | int  # sequences with an echo row

    @property
    def pad(self) -> int:
        return self.size - 1


def _seq_has(index: torch.Tensor, size: int) -> torch.Tensor:
    """``[size - 1]`` bool: which local sequences some row of ``index`` (pad = none) points to."""
    ones = torch.ones_like(index, dtype=torch.int32)
    return (
        torch.zeros(size, dtype=torch.int32, device=index.device).index_add_(0, index, ones)[:-1]
        > 0
    )


def local_sequences(x: LossInputs) -> LocalSequences:
    """Number the sequences that have an RL or echo row ``0..S_local-1`` in id order.

    The one definition of "a sequence takes part in a term", shared by the loss and
    [`count_normalizers`][echoloss.loss.normalization.count_normalizers] (through `row_counts`).

    Sort-based (no id-sized table, no ``unique``): rows sorted by id, a new group where the id
    changes, groups without a participating row skipped by a cumulative sum.

    Examples:
        >>> s = local_sequences(LossInputs(rl_mask=torch.tensor([True, False, True]),
        ...                                sequence_ids=torch.tensor([7, 7, 3])))
        >>> s.row.tolist(), int(s.num), int(s.rl_count)
        ([1, 1, 0], 2, 2)
    """
    sid = x.flat("sequence_ids")
    n = x.rl.numel()
    if sid is None:
        return LocalSequences(n + 1, None, None, None, 0, 0, 0)
    sid = sid.long()  # [N]
    part = x.rl | x.echo  # [N] bool
    key = sid.masked_fill(sid < 0, torch.iinfo(torch.int64).max)  # [N] padding sorts last
    sorted_key, order = torch.sort(key)  # [N], [N]
    starts = torch.ones_like(part)
    starts[1:] = sorted_key[1:] != sorted_key[:-1]  # [N] bool: first row of each id
    group = torch.empty_like(order).scatter_(0, order, starts.long().cumsum(0) - 1)  # [N]
    pad = n  # slot for rows in no participating sequence
    group_part = _seq_has(torch.where(part, group, pad), n + 1)  # [N] group has a part. row
    local_of_group = group_part.long().cumsum(0) - 1  # [N]
    row = torch.where(group_part[group], local_of_group[group], pad)  # [N]
    rl_index = torch.where(x.rl, row, pad)  # [N]
    echo_index = torch.where(x.echo, row, pad)  # [N]
    return LocalSequences(
        size=n + 1,
        row=row,
        rl_index=rl_index,
        echo_index=echo_index,
        num=group_part.sum(),
        rl_count=_seq_has(rl_index, n + 1).sum(),
        echo_count=_seq_has(echo_index, n + 1).sum(),
    )


def no_sequences(x: LossInputs) -> LocalSequences:
    """The `LocalSequences` of a loss that reads none: every row in the padding slot, counts 0
    (no sort, no launch)."""
    return LocalSequences(x.rl.numel() + 1, None, None, None, 0, 0, 0)


class RowCounts(NamedTuple):
    """One micro-batch's counts as 0-dim tensors on its device (no host read): the fields of
    [`Normalizers`][echoloss.loss.normalization.Normalizers] (an int 0 where ``sequence_ids`` is
    missing); the denominators a call divides by (`resolve_normalizers`) take the same form,
    with the given normalisers' Python ints."""

    rl_tokens: torch.Tensor | int
    echo_tokens: torch.Tensor | int
    sequences: torch.Tensor | int
    echo_batches: torch.Tensor | int
    rl_sequences: torch.Tensor | int
    echo_sequences: torch.Tensor | int


def row_counts(x: LossInputs, seqs: LocalSequences | None = None) -> RowCounts:
    """The counts of one micro-batch: the one counting rule of the loss and of
    [`count_normalizers`][echoloss.loss.normalization.count_normalizers], so that the counts given
    as ``normalizers`` and the loss's own can never disagree.

    Args:
        x: the micro-batch's record.
        seqs: its `local_sequences` when already computed.

    Examples:
        >>> x = LossInputs(rl_mask=torch.tensor([True, False]), echo_weights=torch.tensor([0.0, 1.0]))
        >>> [int(v) for v in row_counts(x)]
        [1, 1, 0, 1, 0, 0]
    """
    seqs = local_sequences(x) if seqs is None else seqs
    n_echo = x.echo.sum()  # 0-dim int64
    return RowCounts(
        rl_tokens=x.rl.sum(),
        echo_tokens=n_echo,
        sequences=seqs.num,
        echo_batches=(n_echo > 0).long(),
        rl_sequences=seqs.rl_count,
        echo_sequences=seqs.echo_count,
    )


def count_normalizers(inputs: LossInputs | None = None, /, **fields: Any) -> Normalizers:
    """Counts of one micro-batch (this rank only); sum them over micro-batches, then all-reduce.

    Takes the same record as the loss (only ``rl_mask``, ``echo_weights`` and ``sequence_ids``
    are read), so a micro-batch is counted exactly as [`echoloss.echo_loss`][echoloss.loss.echo_loss]
    counts it (`row_counts`).

    Args:
        inputs: the micro-batch's `echoloss.LossInputs`.
        **fields: the keyword form instead of ``inputs``: record fields by name
            (``rl_mask=``, ``echo_weights=``, ``sequence_ids=``, ...).

    Returns:
        [`Normalizers`][echoloss.loss.normalization.Normalizers] of this micro-batch. Without
        ``sequence_ids`` the sequence counts stay 0 and the ``sequence_mean*`` modes cannot use
        them.

    Raises:
        TypeError, ValueError: as `echoloss.LossInputs` (the same checks: a NaN or
            negative echo weight, a participating row with sequence id -1, ...).

    Examples:
        >>> x = LossInputs(rl_mask=torch.tensor([True, True, False, False]),
        ...                echo_weights=torch.tensor([0.0, 0.5, 0.1, 0.0]),
        ...                sequence_ids=torch.tensor([0, 0, 1, -1]))
        >>> count_normalizers(x)
        Normalizers(rl_tokens=1, echo_tokens=2, sequences=2, echo_batches=1, rl_sequences=1, echo_sequences=2)
    """
    x = LossInputs.from_keywords(inputs, **fields)
    return Normalizers(*(int(v) for v in row_counts(x)))  # the loss's counts, read once


def all_reduce_normalizers(
    normalizers: Normalizers,
    *,
    group: Any = None,
    device: torch.device | str | None = None,
) -> Normalizers:
    """SUM-all-reduce the counts over the data-parallel group (one int64 collective).

    Call it once per optimiser step, after summing this rank's micro-batches. Without an
    initialised ``torch.distributed`` it returns ``normalizers`` unchanged. With context
    parallelism, reduce over the dp×cp group as prime-rl does (each cp rank counts the full
    micro-batch; the all-gather backward cancels the factor).

    Args:
        normalizers: this rank's counts, summed over its micro-batches.
        group: the process group (None = the default group).
        device: where the collective runs; None = CUDA for NCCL, CPU otherwise.

    Returns:
        The global [`Normalizers`][echoloss.loss.normalization.Normalizers], identical on every rank.

    Examples:
        >>> all_reduce_normalizers(Normalizers(rl_tokens=4))  # not distributed: unchanged
        Normalizers(rl_tokens=4, echo_tokens=0, sequences=0, echo_batches=0, rl_sequences=0, echo_sequences=0)
    """
    if not isinstance(normalizers, Normalizers):
        raise TypeError(problem("normalizers", "echoloss.Normalizers", describe(normalizers)))
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return normalizers
    if device is None:
        backend = str(dist.get_backend(group))
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else "cpu"
    t = normalizers.as_tensor(device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return Normalizers.from_tensor(t.cpu())


def undo_data_parallel_averaging(
    model_or_params: torch.nn.Module | Iterable[torch.Tensor], world_size: int
) -> None:
    """Multiply every gradient by ``world_size`` to undo DDP/FSDP gradient averaging.

    With global normalisers each rank's loss is its share of the global mean, so the correct
    gradient is the *sum* over ranks. DDP and FSDP average instead (divide by the world size);
    call this once after the last backward of the step, before clipping and the optimiser step.
    ``world_size`` is the number of ranks the gradient was averaged over (dp_replicate × dp_shard,
    times cp if the reduction spans context-parallel ranks too). Equivalent alternative: scale
    the loss by ``world_size`` before backward, or set FSDP2's gradient divide factor to 1.

    Args:
        model_or_params: a module, or an iterable of parameters; parameters without a gradient
            are skipped. DTensor gradients are scaled in place too.
        world_size: positive int.

    Examples:
        >>> lin = torch.nn.Linear(2, 1)
        >>> lin(torch.ones(1, 2)).sum().backward()
        >>> undo_data_parallel_averaging(lin, 4)
        >>> lin.weight.grad
        tensor([[4., 4.]])
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(problem("world_size", "an int ≥ 1", describe(world_size)))
    params: list[torch.Tensor]
    if isinstance(model_or_params, torch.nn.Module):
        params = list(model_or_params.parameters())
    elif isinstance(model_or_params, (str, bytes, torch.Tensor)) or not isinstance(
        model_or_params, Iterable
    ):
        raise TypeError(
            problem(
                "model_or_params",
                "a torch.nn.Module or an iterable of parameters",
                describe(model_or_params),
                "pass the model, or model.parameters()",
            )
        )
    else:
        params = list(model_or_params)
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(problem(f"model_or_params[{i}]", "a tensor", describe(p)))
    if world_size == 1:
        return
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(world_size)


# ---------------------------------------------------------------- the divisors of one call


class Divisors(NamedTuple):
    """Denominators a caller computed for one call, replacing the loss's own (the ``nn``
    modules: Liger's and TRL's divisors of one step).

    Each is a Python float (a constant of the call: no launch) or a 0-dim fp32 tensor on the
    loss's device (a count given as a tensor or all-reduced over ranks: read by the kernels,
    never by the host); None = the loss's own (its count, the given `Normalizers`, the config's
    constant).

    Attributes:
        rl: the RL term's divisor, in every RL mode: ``token_mean``'s RL-token count,
            ``token_sum_constant``'s constant, the ``sequence_mean*`` modes' ``S_RL``.
        echo: the echo term's divisor of ``token_mean`` (echo tokens) and ``sequence_mean``
            (``S_echo``); refused with ``batch_token_mean`` and ``sum``.

        checked: True where the tensors' values are known to be finite and ≥ 1 (the modules'
            clamped counts, themselves checked): their value check is skipped.

    Each is checked when a loss call reads it (`checked_divisors`): a divisor ≤ 0 would flip
    its term's sign (gradient ascent) or divide by zero, an infinite one would zero it.

    Example:
        >>> Divisors(rl=4.0)
        Divisors(rl=4.0, echo=None, checked=False)
    """

    rl: float | torch.Tensor | None = None
    echo: float | torch.Tensor | None = None
    checked: bool = False


#: The loss's own divisors everywhere.
NO_DIVISORS = Divisors()

#: The echo modes whose divisor `Divisors.echo` replaces.
ECHO_DIVIDED = ("token_mean", "sequence_mean")


def checked_divisors(divisors: Any, device: torch.device, checks: DeferredChecks) -> Divisors:
    """``divisors`` checked for a loss call on ``device``: a `Divisors` whose entries are None,
    a finite float > 0 (a Python ``bool`` is refused) or a 0-dim (1-element) float32 tensor on
    ``device`` whose value is finite and > 0. Types, shapes and devices are checked at once;
    a tensor's value through ``checks`` (deferred on the device path: no host read, no
    launch: the value itself is one of the call's check numbers).

    Raises:
        TypeError: not a `Divisors`, or an entry of the wrong kind (str, list, bool, an
            integer or fp16 tensor).
        ValueError: a number ≤ 0 or not finite, a tensor of more than one element or on
            another device (a meta tensor included).

    Examples:
        >>> checked_divisors(Divisors(rl=4), torch.device("cpu"), DeferredChecks(torch.device("cpu")))
        Divisors(rl=4.0, echo=None, checked=False)
        >>> checked_divisors(Divisors(rl=-4.0), torch.device("cpu"), DeferredChecks(torch.device("cpu")))
        Traceback (most recent call last):
        ...
        ValueError: divisors.rl must be finite and > 0 (the RL term is divided by it: ≤ 0 flips its sign or divides by 0, inf zeroes it), got -4.0; pass the term's count (≥ 1), or None for the loss's own
    """
    if not isinstance(divisors, Divisors):
        raise TypeError(
            problem("divisors", "a Divisors(rl=..., echo=...)", describe(divisors))
            + "; build one with echoloss.loss.normalization.Divisors"
        )
    out: dict[str, float | torch.Tensor | None] = {}
    for name, term in (("rl", "RL"), ("echo", "echo")):
        value = getattr(divisors, name)
        what = (
            f"finite and > 0 (the {term} term is divided by it: ≤ 0 flips its sign or divides "
            "by 0, inf zeroes it)"
        )
        fix = "pass the term's count (≥ 1), or None for the loss's own"
        arg = f"divisors.{name}"
        if value is None:
            out[name] = None
        elif isinstance(value, torch.Tensor):
            if value.dtype != torch.float32:
                raise TypeError(
                    problem(arg, "a float or a 0-dim float32 tensor", describe(value))
                    + "; pass the count as float32 (fp16 overflows above 65504, and an "
                    "integer count is cast once by its caller)"
                )
            if value.numel() != 1 or value.device != device:
                raise ValueError(
                    problem(arg, f"a 0-dim float32 tensor on the loss's device ({device})",
                            describe(value))
                    + "; one divisor per term, on the logprobs' device"
                )  # fmt: skip
            if not divisors.checked:
                checks.add([value.reshape(())], _divisor_message(arg, what, fix))
            out[name] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(problem(arg, what, repr(float(value))) + f"; {fix}")
            out[name] = float(value)
        else:
            raise TypeError(
                problem(arg, "a float, a 0-dim float32 tensor or None", describe(value))
                + f"; {fix}"
            )
    return Divisors(out["rl"], out["echo"], divisors.checked)


def _divisor_message(
    arg: str, what: str, fix: str
) -> Callable[[Sequence[float]], Exception | None]:
    def message(v: Sequence[float]) -> Exception | None:
        if math.isfinite(v[0]) and v[0] > 0:
            return None
        return ValueError(problem(arg, what, repr(float(v[0]))) + f"; {fix}")

    return message


def divisor_or_count(
    given: float | torch.Tensor | None, count: int | torch.Tensor
) -> float | int | torch.Tensor:
    """The caller's divisor when given (used as is), else the count, at least 1."""
    return at_least_one(count) if given is None else given


def at_least_one(count: int | torch.Tensor) -> int | torch.Tensor:
    """``max(count, 1)`` of a host or device count."""
    return max(count, 1) if isinstance(count, int) else count.clamp(min=1)


def used_counts(cfg: LossConfig) -> list[str]:
    """The `Normalizers` fields the configured RL and echo modes divide by."""
    used = []
    if cfg.rl_normalization == "token_mean":
        used.append("rl_tokens")
    if cfg.rl_normalization.startswith("sequence"):
        used.append("rl_sequences")
    if cfg.echo_normalization == "token_mean":
        used.append("echo_tokens")
    if cfg.echo_normalization == "batch_token_mean":
        used.append("echo_batches")
    if cfg.echo_normalization == "sequence_mean":
        used.append("echo_sequences")
    return used


def given_normalizers(normalizers: Any) -> Normalizers:
    """``normalizers`` if it is a `Normalizers`, else a TypeError naming it."""
    if not isinstance(normalizers, Normalizers):
        raise TypeError(
            problem(
                "normalizers",
                "echoloss.Normalizers or None (None = this call is the whole batch)",
                describe(normalizers),
            )
        )
    return normalizers


def covers_message(name: str, given: int) -> Callable[[Sequence[float]], Exception | None]:
    """The message of the check that ``normalizers.<name>`` (``given``) is at least this
    call's own count (``v[0]``; for ``echo_batches`` the call's echo tokens, 1 if any)."""

    def message(v: Sequence[float]) -> Exception | None:
        loc = int(v[0])
        if name == "echo_batches":
            loc = min(loc, 1)  # this call is one micro-batch: it has echo rows or not
        if given >= loc:
            return None
        hint = (
            " (count_normalizers needs sequence_ids for the sequence_mean* modes)"
            if name.endswith("sequences") and given == 0
            else ""
        )
        return ValueError(
            f"normalizers.{name}={given} is smaller than this call's {loc}{hint}: normalizers "
            "must be the sum over every micro-batch of the step on every rank "
            "(count_normalizers for each micro-batch, summed, then all_reduce_normalizers)"
        )

    return message


def resolve_normalizers(
    normalizers: Any, local: RowCounts, cfg: LossConfig, checks: DeferredChecks
) -> RowCounts:
    """``normalizers`` (checked to cover this call's own counts), or ``local`` when None."""
    if normalizers is None:
        return local
    given = given_normalizers(normalizers)
    for name in used_counts(cfg):
        checks.add([getattr(local, name)], covers_message(name, getattr(given, name)))
    return RowCounts(*(getattr(given, name) for name in RowCounts._fields))
