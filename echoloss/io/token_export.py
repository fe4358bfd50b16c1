"""Token JSONL export: what the loss saw, one record per packed sequence.

For debugging a run token by token (why was this token trained, with which weight, what did the
trainer and the sampler think of it). Files are ``{directory}/step_{step}/rank_{rank}.jsonl``. Each
record is one sequence of a [`echoloss.PackedBatch`][echoloss.data.packing.PackedBatch] that trains at least one token (padding
and fully masked sequences are skipped), with per-token columns aligned to its ``token_ids``
(entry ``t`` describes token ``t`` as a target, like every packed stream). Non-finite floats are
written as ``null``; so are RL diagnostics outside the RL mask.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from echoloss._validate import describe, problem
from echoloss.data.packing import PackedBatch

__all__ = ["RL_ONLY_COLUMNS", "TOKEN_EXPORT_SCHEMA_VERSION", "TokenExporter", "token_records"]

TOKEN_EXPORT_SCHEMA_VERSION = 1

RL_ONLY_COLUMNS = frozenset(
    {
        "mismatch_kl",
        "log_importance_ratio",
        "importance_ratio",
        "prob_delta",
        "is_masked",
        "is_masked_high",
        "is_masked_low",
    }
)
"""Extra columns that only mean something on RL tokens: written as null elsewhere."""

_RESERVED = frozenset(
    {
        "schema_version",
        "step",
        "rank",
        "micro_step",
        "micro_sequence_idx",
        "export_sequence_idx",
        "sample_index",
        "env_name",
        "prompt_len",
        "advantage",
        "token_ids",
        "position_ids",
        "loss_mask",
        "rl_mask",
        "echo_mask",
        "echo_weights",
        "observation_mask",
        "advantages",
        "inference_logprobs",
        "temperatures",
    }
)


def _floats(values: Any) -> list[float | None]:
    return [v if isinstance(v, bool) or math.isfinite(v) else None for v in values]


def _tensor_values(t: torch.Tensor) -> list[Any]:
    """Python values of a 1-D tensor; reduced-precision floats as the shortest decimal that
    round-trips in float32 (0.1, not 0.10000000149011612); non-finite as None."""
    t = t.detach().cpu()
    if t.dtype == torch.bool or not t.dtype.is_floating_point:
        return t.tolist()
    if t.dtype == torch.float64:
        return _floats(t.tolist())
    return [float(str(x)) if math.isfinite(x) else None for x in t.float().numpy()]


def _column(name: str, values: Any, length: int) -> list[Any]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(
                f"token stat {name!r} must be 1-D [L], got shape {tuple(values.shape)}"
            )
        values = _tensor_values(values)
    else:
        values = list(values)
    if len(values) != length:
        raise ValueError(
            f"token stat {name!r} has length {len(values)}, expected {length} (the batch's tokens)"
        )
    return list(values)


def token_records(
    batch: PackedBatch,
    *,
    step: int,
    rank: int = 0,
    micro_step: int = 0,
    token_stats: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
    row_stats: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
    rl_only: Collection[str] = RL_ONLY_COLUMNS,
    first_index: int = 0,
) -> list[dict[str, Any]]:
    """The export records of one packed micro-batch.

    Args:
        batch: the [`echoloss.PackedBatch`][echoloss.data.packing.PackedBatch] the loss was computed on.
        step: optimiser step.
        rank: data-parallel rank.
        micro_step: micro-batch index within the step.
        token_stats: extra per-token columns, ``[L]`` token-aligned (entry ``t`` is about token
            ``t``), e.g. ``trainer_logprobs``.
        row_stats: extra per-row columns, ``[L]`` row-aligned like the loss's inputs (row ``j``
            predicts token ``j + 1``, see [`echoloss.next_token_targets`][echoloss.data.targets.next_token_targets]): shifted onto the
            token they predict; the first token of each sequence gets null.
        rl_only: column names written as null outside the RL mask.
        first_index: ``export_sequence_idx`` of the first record (a running count in a step).

    Returns:
        One dict per exported sequence: identity (``schema_version``, ``step``, ``rank``,
        ``micro_step``, ``micro_sequence_idx``, ``export_sequence_idx``, ``sample_index``,
        ``env_name``, ``prompt_len``, ``advantage``) and per-token ``token_ids``,
        ``position_ids``, ``loss_mask`` (RL or echo), ``rl_mask``, ``echo_mask``,
        ``echo_weights`` (null where not echoed), ``observation_mask``, ``advantages``,
        ``inference_logprobs``, ``temperatures`` and the extra columns.

    Examples:
        >>> from echoloss import Sample, pack
        >>> s = Sample(prompt_ids=[1, 2], completion_ids=[3, 4], completion_mask=[True, False],
        ...            completion_logprobs=[-0.5, 0.0], echo_weights=[None, None, None, 0.1],
        ...            advantage=1.0)
        >>> [rec] = token_records(pack([s], max_tokens=8)[0], step=3,
        ...                       token_stats={"trainer_logprobs": [0.0, -1.0, float("nan"), -2.0]})
        >>> rec["rl_mask"], rec["echo_weights"], rec["trainer_logprobs"]
        ([False, False, True, False], [None, None, None, 0.1], [0.0, -1.0, None, -2.0])
    """
    if not isinstance(batch, PackedBatch):
        raise TypeError(
            problem(
                "batch",
                "an echoloss.PackedBatch",
                describe(batch),
                "pack the samples first: token_records(pack(samples, max_tokens=...)[0], ...)",
            )
        )
    for name, stats in (("token_stats", token_stats), ("row_stats", row_stats)):
        if stats is not None and not isinstance(stats, Mapping):
            raise TypeError(
                problem(name, "a dict column name -> [L] values, or None", describe(stats))
            )
    n = len(batch)
    extra: dict[str, list[Any]] = {}
    for name, values in (token_stats or {}).items():
        if name in _RESERVED:
            raise ValueError(f"token stat {name!r} collides with a built-in column; rename it")
        extra[name] = _column(name, values, n)
    cu = batch.cu_seqlens.tolist()
    for name, values in (row_stats or {}).items():
        if name in _RESERVED or name in extra:
            raise ValueError(f"row stat {name!r} collides with another column; rename it")
        rows = _column(name, values, n)
        shifted: list[Any] = [None] * n
        for a, b in itertools.pairwise(cu):
            shifted[a + 1 : b] = rows[a : b - 1]
        extra[name] = shifted

    ids = batch.input_ids.tolist()
    pos = batch.position_ids.tolist()
    rl = batch.rl_mask.tolist()
    echo = _tensor_values(batch.echo_weights)
    obs = batch.observation_mask.tolist()
    adv = _tensor_values(batch.advantages)
    lq = _tensor_values(batch.inference_logprobs)
    temps = _tensor_values(batch.temperatures)
    out: list[dict[str, Any]] = []
    for seg, (a, b) in enumerate(itertools.pairwise(cu)):
        sample_index = batch.sample_indices[seg]
        if sample_index < 0:
            continue  # padding
        seg_rl = rl[a:b]
        seg_echo = echo[a:b]
        loss = [r or (e is not None and e > 0) for r, e in zip(seg_rl, seg_echo, strict=True)]
        if not any(loss):
            continue
        advantage = batch.sample_advantages[seg]
        rec: dict[str, Any] = {
            "schema_version": TOKEN_EXPORT_SCHEMA_VERSION,
            "step": step,
            "rank": rank,
            "micro_step": micro_step,
            "micro_sequence_idx": seg,
            "export_sequence_idx": first_index + len(out),
            "sample_index": sample_index,
            "env_name": batch.env_names[seg],
            "prompt_len": batch.prompt_lens[seg],
            "advantage": None if advantage is None or not math.isfinite(advantage) else advantage,
            "token_ids": ids[a:b],
            "position_ids": pos[a:b],
            "loss_mask": loss,
            "rl_mask": seg_rl,
            "echo_mask": [e is not None and e > 0 for e in seg_echo],
            "echo_weights": [e if e is not None and e > 0 else None for e in seg_echo],
            "observation_mask": obs[a:b],
            "advantages": adv[a:b],
            "inference_logprobs": lq[a:b],
            "temperatures": temps[a:b],
        }
        for name, values in extra.items():
            col = [v if v is None or isinstance(v, bool) else _floats([v])[0] for v in values[a:b]]
            if name in rl_only:
                col = [v if r else None for v, r in zip(col, seg_rl, strict=True)]
            rec[name] = col
        out.append(rec)
    return out


class TokenExporter:
    """Writes [`token_records`][echoloss.io.token_export.token_records] to ``{directory}/step_{step}/rank_{rank}.jsonl``.

    The file of a step is opened at its first write and closed when the step changes (or on
    [`close`][echoloss.io.token_export.TokenExporter.close]); ``export_sequence_idx`` counts sequences within a step. Use as a context
    manager or call [`close`][echoloss.io.token_export.TokenExporter.close].

    Examples:
        >>> import tempfile
        >>> from echoloss import Sample, pack
        >>> s = Sample(prompt_ids=[1], completion_ids=[2], completion_mask=[True],
        ...            completion_logprobs=[-0.5], advantage=1.0)
        >>> with tempfile.TemporaryDirectory() as d, TokenExporter(d) as ex:
        ...     ex.write(pack([s], max_tokens=4)[0], step=0)
        ...     ex.close()
        ...     (Path(d) / "step_0" / "rank_0.jsonl").read_text().count("\\n")
        1
        1
    """

    def __init__(self, directory: str | os.PathLike[str], *, rank: int = 0) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self._step: int | None = None
        self._file: IO[str] | None = None
        self._count = 0

    def write(
        self,
        batch: PackedBatch,
        *,
        step: int,
        micro_step: int = 0,
        token_stats: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
        row_stats: Mapping[str, torch.Tensor | Sequence[float]] | None = None,
        rl_only: Collection[str] = RL_ONLY_COLUMNS,
    ) -> int:
        """Append one micro-batch's records; returns how many sequences were written."""
        if step != self._step:
            self.close()
            path = self.directory / f"step_{step}" / f"rank_{self.rank}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
            self._step, self._count = step, 0
        assert self._file is not None
        records = token_records(
            batch,
            step=step,
            rank=self.rank,
            micro_step=micro_step,
            token_stats=token_stats,
            row_stats=row_stats,
            rl_only=rl_only,
            first_index=self._count,
        )
        for rec in records:
            self._file.write(json.dumps(rec, allow_nan=False, separators=(",", ":")) + "\n")
        self._file.flush()
        self._count += len(records)
        return len(records)

    def close(self) -> None:
        """Close the current file (a later [`write`][echoloss.io.token_export.TokenExporter.write] opens the next one)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._step = None

    def __enter__(self) -> TokenExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
