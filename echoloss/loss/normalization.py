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

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from echoloss._validate import describe, problem
from echoloss.loss.inputs import LossInputs

__all__ = [
    "Normalizers",
    "all_reduce_normalizers",
    "count_normalizers",
    "count_rows",
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


def count_rows(
    rl: torch.Tensor, echo: torch.Tensor, sequence_ids: torch.Tensor | None
) -> Normalizers:
    """The counts of one micro-batch from its ``[N]`` row masks: the one counting rule.

    [`count_normalizers`][echoloss.loss.normalization.count_normalizers] and the loss (its local
    counts, when no ``normalizers`` are given, and the check that given ones cover them) both
    count here, so the two can never disagree.

    Args:
        rl: ``[N]`` bool RL rows (echoed rows already removed, `LossInputs.rl`).
        echo: ``[N]`` bool echo rows (`LossInputs.echo`).
        sequence_ids: ``[N]`` int64 row → sequence, or None (sequence counts stay 0).

    Examples:
        >>> count_rows(torch.tensor([True, False]), torch.tensor([False, True]), None)
        Normalizers(rl_tokens=1, echo_tokens=1, sequences=0, echo_batches=1, rl_sequences=0, echo_sequences=0)
    """
    n_echo = int(echo.sum())
    seqs = rl_seqs = echo_seqs = 0
    if sequence_ids is not None:
        sid = sequence_ids.reshape(-1)  # [N]
        seqs = int(torch.unique(sid[rl | echo]).numel())
        rl_seqs = int(torch.unique(sid[rl]).numel())
        echo_seqs = int(torch.unique(sid[echo]).numel())
    return Normalizers(
        rl_tokens=int(rl.sum()),
        echo_tokens=n_echo,
        sequences=seqs,
        echo_batches=int(n_echo > 0),
        rl_sequences=rl_seqs,
        echo_sequences=echo_seqs,
    )


def count_normalizers(inputs: LossInputs | None = None, /, **fields: Any) -> Normalizers:
    """Counts of one micro-batch (this rank only); sum them over micro-batches, then all-reduce.

    Takes the same record as the loss (only ``rl_mask``, ``echo_weights`` and ``sequence_ids``
    are read), so a micro-batch is counted exactly as [`echoloss.echo_loss`][echoloss.loss.echo_loss]
    counts it (`count_rows`).

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
    return count_rows(x.rl, x.echo, x.flat("sequence_ids"))


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
