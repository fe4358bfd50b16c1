"""``LossInputs``: the per-token inputs of the loss, validated once, taken by every entry point.

One record instead of a dozen keyword arguments spelled out in three places: every loss entry
point ([`echoloss.echo_loss`][echoloss.loss.echo_loss], [`echoloss.echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs],
`echoloss.echo_loss_from_hidden`) takes a `LossInputs`, and they differ only in
how they get the log-probabilities. Each per-token field declares its kind and the rows on which
its values are read; construction checks every field from those declarations, so a new per-token
input is one more field here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from echoloss._validate import check_per_token, check_tensor, describe, problem
from echoloss.loss.metrics import RESERVED_ENV
from echoloss.ops.value_checks import DeferredChecks, check_finite, check_temperature

__all__ = [
    "LOGPROB_TOLERANCE",
    "LossInputs",
    "check_echo_weight_values",
    "check_float_values",
    "select_rows",
    "split_rows",
    "unchecked_inputs",
]

#: Largest log-probability accepted in ``inference_logprobs`` / ``old_logprobs`` /
#: ``ref_logprobs``. A logprob is ≤ 0; one computed in fp32 for a near-certain token may round
#: a few ulps above 0 (``|lse| · 2^-24``, about 1e-5 at ``|lse| = 100``), so the bound leaves
#: two orders of magnitude for that rounding and still refuses a negative-log-likelihood column
#: passed by mistake (whose values are mostly far above 1e-3).
LOGPROB_TOLERANCE = 1e-3

Rows = Literal["all", "rl", "participating"]


def split_rows(
    rl_mask: torch.Tensor, echo_weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rl, echo)`` bool masks: echo = ``echo_weights > 0``; rl = ``rl_mask`` and not echo.

    The single definition used by the loss, the counts and the metrics, so they always agree.

    Examples:
        >>> rl, echo = split_rows(torch.tensor([True, True, False]), torch.tensor([0.0, 0.5, 0.0]))
        >>> rl.tolist(), echo.tolist()
        ([True, False, False], [False, True, False])
    """
    if echo_weights is None:
        return rl_mask, torch.zeros_like(rl_mask)
    echo = echo_weights > 0
    return rl_mask & ~echo, echo


def _token(kind: str, rows: Rows, *, logprob: bool = False) -> dict[str, Any]:
    """The metadata of a per-token field: ``kind`` is bool/int/float; ``rows`` are where its
    values are read (and checked); ``logprob`` adds the ``≤ LOGPROB_TOLERANCE`` check."""
    return {"kind": kind, "rows": rows, "logprob": logprob}


@dataclass(frozen=True, eq=False)
class LossInputs:
    """The per-token inputs of the loss, one entry per row of the logits (validated at construction).

    Every tensor has the shape of ``rl_mask`` (``[N]``, or ``[B, T]`` next to ``[B, T, V]``
    logits) and its device. Values are read only on the rows where they matter (columns "read
    on"), so placeholders elsewhere (e.g. the ``0.0`` inference logprob of an observation token)
    are never checked nor used.

    ============================  =======  =============  =========================================
    field                         dtype    read on        meaning
    ============================  =======  =============  =========================================
    ``rl_mask``                   bool     all            True = RL row (an echoed row leaves it)
    ``echo_weights``              float    all            echo weight ≥ 0 (λ or α), 0 = not echoed
    ``advantages``                float    RL rows        advantage, required in mode ``"rl"``
    ``inference_logprobs``        float    RL rows        sampling logprobs (≤ 0)
    ``old_logprobs``              float    RL rows        trainer-side behaviour logprobs (≤ 0)
    ``ref_logprobs``              float    RL rows        reference-model logprobs (≤ 0)
    ``sequence_ids``              int      participating  row → sequence, ``-1`` = padding
    ``observation_mask``          bool     all            rows counted in ``Z_i = |O_i|``
    ``labels``                    int      participating  the token each row predicts
    ``temperature``               float    RL rows        sampling temperature (scalar or per row)
    ``env_names``                 str      per sequence   env of each sequence id
    ============================  =======  =============  =========================================

    ``labels`` and ``temperature`` say how a row is scored: the logits and hidden-state entry
    points read them; [`echoloss.echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs] takes logprobs already scored and
    reads neither. Build one from [`echoloss.next_token_targets`][echoloss.data.targets.next_token_targets] with `from_targets`,
    or by hand; `replace` gives a validated copy with some fields changed.

    Raises:
        TypeError, ValueError: on a wrong type, dtype, shape or device, a non-finite value on a
            row that reads it, a negative or non-finite echo weight, a log-probability above
            ``LOGPROB_TOLERANCE``, a participating row with sequence id ``-1``, or ``env_names``
            not matching the sequence ids; the message names the field, the row and the fix.

    Examples:
        >>> import torch
        >>> x = LossInputs(rl_mask=torch.tensor([True, False]),
        ...                echo_weights=torch.tensor([0.0, 0.5]),
        ...                advantages=torch.tensor([1.0, 0.0]),
        ...                inference_logprobs=torch.tensor([-0.2, 0.0]),
        ...                labels=torch.tensor([3, 1]))
        >>> x.shape, x.rl.tolist(), x.echo.tolist()
        (torch.Size([2]), [True, False], [False, True])
        >>> LossInputs(rl_mask=torch.tensor([True]), inference_logprobs=torch.tensor([0.7]))
        Traceback (most recent call last):
        ...
        ValueError: inference_logprobs[0] must be a log-probability ≤ 0 (up to 0.001), got 0.7; pass log p, not the negative log-likelihood -log p
    """

    rl_mask: torch.Tensor
    echo_weights: torch.Tensor | None = field(default=None, metadata=_token("float", "all"))
    advantages: torch.Tensor | None = field(default=None, metadata=_token("float", "rl"))
    inference_logprobs: torch.Tensor | None = field(
        default=None, metadata=_token("float", "rl", logprob=True)
    )
    old_logprobs: torch.Tensor | None = field(
        default=None, metadata=_token("float", "rl", logprob=True)
    )
    ref_logprobs: torch.Tensor | None = field(
        default=None, metadata=_token("float", "rl", logprob=True)
    )
    sequence_ids: torch.Tensor | None = field(default=None, metadata=_token("int", "participating"))
    observation_mask: torch.Tensor | None = field(default=None, metadata=_token("bool", "all"))
    labels: torch.Tensor | None = field(default=None, metadata=_token("int", "participating"))
    temperature: float | torch.Tensor = 1.0
    env_names: tuple[str, ...] | None = None
    rl: torch.Tensor = field(init=False, repr=False)
    echo: torch.Tensor = field(init=False, repr=False)
    _versions: tuple[tuple[str, torch.Tensor, int], ...] = field(init=False, repr=False)
    # Set only by `unchecked_inputs` for a caller that built the sequence ids itself in
    # non-decreasing order (the nn modules): the fused algebra skips their sort.
    _sequences_in_order: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        rl_mask = check_tensor("rl_mask", self.rl_mask)
        if rl_mask.dtype != torch.bool:
            check_per_token("rl_mask", rl_mask, rl_mask.shape, rl_mask.device, "bool")
        shape, dev = rl_mask.shape, rl_mask.device
        for f in self.per_token_fields():
            value = getattr(self, f.name)
            if value is not None:
                check_per_token(
                    f.name, value, shape, dev, f.metadata["kind"], what="the shape of rl_mask"
                )
        # The value checks of every field join one block: on the device path one copy to the
        # host per record (with the fused checks one launch per field), not one per field.
        checks = DeferredChecks(dev)
        with checks.collecting():
            self._split_rows_and_check_values(rl_mask)
            object.__setattr__(self, "env_names", self._checked_env_names())
        checks.submit()
        object.__setattr__(self, "_versions", self._tensor_versions())

    def _split_rows_and_check_values(self, rl_mask: torch.Tensor) -> None:
        """Set ``rl``, ``echo`` and the checked ``temperature``; check the values of every
        field on the rows where each is read (`__post_init__`)."""
        shape, dev = rl_mask.shape, rl_mask.device
        ew = None if self.echo_weights is None else self.echo_weights.reshape(-1)
        if ew is not None:
            check_echo_weight_values("echo_weights", ew)
        rl, echo = split_rows(rl_mask.reshape(-1), ew)
        object.__setattr__(self, "rl", rl)
        object.__setattr__(self, "echo", echo)
        where = {"rl": rl, "participating": rl | echo}
        for f in self.per_token_fields():
            value = getattr(self, f.name)
            rows = f.metadata["rows"]
            if value is None or rows == "all":
                continue
            flat = value.reshape(-1)
            if f.metadata["kind"] == "float":
                check_float_values(f.name, flat, where[rows], logprob=f.metadata["logprob"])
            if f.metadata["kind"] == "int":
                _check_rows(
                    f.name,
                    flat,
                    where[rows],
                    "below",  # 0
                    "≥ 0 on a row that participates (RL or echo)",
                    "padding rows (-1 / ignore index) must have rl_mask False and echo weight 0",
                    show=lambda v: str(int(v)),
                )
        object.__setattr__(self, "temperature", check_temperature(self.temperature, shape, dev))

    def _tensor_versions(self) -> tuple[tuple[str, torch.Tensor, int], ...]:
        """``(field, tensor, version)`` of every tensor field: PyTorch bumps a tensor's version
        on every in-place write (to it or any view of its storage), so comparing it later is
        O(1) per field."""
        out = []
        for name in ("rl_mask", *(f.name for f in self.per_token_fields()), "temperature"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and not value.is_inference():
                out.append((name, value, value._version))
        return tuple(out)

    def check_unchanged(self) -> None:
        """Raise if a tensor of this record was written in place after it was validated.

        The record is frozen, but its tensors are mutable (``x.echo_weights[4] = nan``, or the
        caller reusing a buffer it passed in). Rather than copying every tensor at construction
        (memory and time on every call) or re-checking every value at use (``O(N)`` host reads),
        each entry point compares the tensors' version counters with those seen at construction:
        ``O(1)`` per field, no host read. (A write that bypasses autograd's counter, such as
        ``.data`` assignment or a NumPy view, is not seen.)

        Examples:
            >>> x = LossInputs(rl_mask=torch.tensor([True]), echo_weights=torch.tensor([0.5]))
            >>> x.echo_weights[0] = float("nan")
            >>> x.check_unchanged()
            Traceback (most recent call last):
            ...
            ValueError: inputs.echo_weights must be unchanged since the LossInputs was built (its values were checked then), got a tensor written in place afterwards; build a new record, e.g. inputs.replace(echo_weights=new_tensor), or pass a copy (tensor.clone()) if the caller reuses the buffer
        """
        for name, tensor, version in self._versions:
            if tensor._version != version:
                raise ValueError(
                    problem(
                        f"inputs.{name}",
                        "unchanged since the LossInputs was built (its values were checked then)",
                        "a tensor written in place afterwards",
                        f"build a new record, e.g. inputs.replace({name}=new_tensor), or pass a "
                        "copy (tensor.clone()) if the caller reuses the buffer",
                    )
                )

    @classmethod
    def per_token_fields(cls) -> tuple[dataclasses.Field[Any], ...]:
        """The per-token tensor fields (those declared with a kind), in declaration order."""
        return tuple(f for f in dataclasses.fields(cls) if "kind" in f.metadata)

    @property
    def shape(self) -> torch.Size:
        """The per-token shape (``rl_mask.shape``): the logits' leading dimensions."""
        return self.rl_mask.shape

    @property
    def device(self) -> torch.device:
        """The device of every per-token tensor."""
        return self.rl_mask.device

    @property
    def sequences_in_order(self) -> bool:
        """Whether the caller built ``sequence_ids`` never decreasing along the rows
        (`unchecked_inputs`): the fused algebra then reads them without a sort."""
        return self._sequences_in_order

    def flat(self, name: str) -> torch.Tensor | None:
        """Field ``name`` flattened to ``[N]`` (None when not given).

        Examples:
            >>> LossInputs(rl_mask=torch.ones(2, 2, dtype=torch.bool)).flat("rl_mask").shape
            torch.Size([4])
        """
        value = getattr(self, name)
        return None if value is None else value.reshape(-1)

    def replace(self, **changes: Any) -> LossInputs:
        """A validated copy with ``changes`` applied (e.g. ``replace(echo_weights=None)``).

        Examples:
            >>> x = LossInputs(rl_mask=torch.tensor([True]), echo_weights=torch.tensor([0.5]))
            >>> x.replace(echo_weights=None).echo.tolist()
            [False]
        """
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Every field a caller sets (the record's table, in declaration order).

        The keyword form of the loss entry points and of
        [`count_normalizers`][echoloss.loss.normalization.count_normalizers] accepts exactly these
        names: a new field here is a new keyword there, with no edit to them.

        Examples:
            >>> LossInputs.field_names()[:3]
            ('rl_mask', 'echo_weights', 'advantages')
        """
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def from_keywords(cls, inputs: Any = None, /, **fields: Any) -> LossInputs:
        """The record of a call in either form: ``inputs`` itself, or built from ``fields``.

        The entry points' keyword form (``echo_loss(logits, labels, rl_mask=..., ...)``) ends
        here: ``fields`` are record fields by name (None = not given), and a tensor ``inputs``
        is the labels (the keyword form's positional argument).

        Raises:
            TypeError: a record and keywords together, an unknown keyword, or ``inputs`` neither
                a record, a tensor nor None.

        Examples:
            >>> x = LossInputs.from_keywords(torch.tensor([4]), rl_mask=torch.tensor([True]))
            >>> x.labels.tolist(), x.rl.tolist()
            ([4], [True])
        """
        given = {k: v for k, v in fields.items() if v is not None}
        names = cls.field_names()
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise TypeError(
                problem(
                    "keyword argument(s) " + ", ".join(unknown),
                    f"a LossInputs field ({', '.join(names)}) or an argument of the call",
                    "an unknown name",
                    "check the spelling",
                )
            )
        if isinstance(inputs, LossInputs):
            if given:
                raise TypeError(
                    problem(
                        "per-token keywords",
                        "absent when a LossInputs record is given",
                        ", ".join(sorted(given)),
                        "put them in the record: inputs.replace(name=value)",
                    )
                )
            return inputs
        if isinstance(inputs, torch.Tensor):
            if "labels" in given:
                raise TypeError("labels given twice (positional argument and labels=)")
            given["labels"] = inputs
        elif inputs is not None:
            raise TypeError(
                problem(
                    "inputs",
                    "an echoloss.LossInputs record (or the labels tensor of the keyword form)",
                    describe(inputs),
                    "build one with LossInputs.from_targets(next_token_targets(batch))",
                )
            )
        if "rl_mask" not in given:
            raise TypeError(
                "rl_mask is required: pass a LossInputs record, or rl_mask=[N] bool (True = RL "
                "row) in the keyword form"
            )
        return cls(**given)

    @classmethod
    def from_targets(cls, targets: Any, **extra: Any) -> LossInputs:
        """The record of [`echoloss.next_token_targets`][echoloss.data.targets.next_token_targets] (any object with those attributes).

        Every attribute of ``targets`` named like a field is taken, and every entry of its
        ``streams`` mapping named like one (so a stream added to the data path's table reaches the
        record with no edit here; ``temperatures`` becomes ``temperature``); ``extra`` adds or overrides fields, e.g.
        ``env_names=batch.env_names`` or ``old_logprobs=...``.

        Examples:
            >>> from echoloss import Sample, next_token_targets, pack
            >>> s = Sample(prompt_ids=[5], completion_ids=[6, 7], completion_mask=[True, True],
            ...            completion_logprobs=[-0.1, -0.2], advantage=1.0)
            >>> [b] = pack([s], max_tokens=8)
            >>> x = LossInputs.from_targets(next_token_targets(b), env_names=b.env_names)
            >>> x.labels.tolist(), x.rl.tolist(), x.env_names
            ([6, 7, 0], [True, True, False], ('',))
        """
        names = set(cls.field_names())
        values = {n: getattr(targets, n) for n in names if hasattr(targets, n)}
        streams = getattr(targets, "streams", None)  # NextTokenTargets: every declared stream
        if isinstance(streams, Mapping):
            values.update({n: v for n, v in streams.items() if n in names})
        if "temperature" not in values and hasattr(targets, "temperatures"):
            values["temperature"] = targets.temperatures
        if "rl_mask" not in values and "rl_mask" not in extra:
            raise TypeError(
                problem(
                    "targets",
                    "next_token_targets(batch) or an object with an rl_mask attribute",
                    describe(targets),
                )
            )
        unknown = sorted(set(extra) - names)
        if unknown:
            raise TypeError(
                problem("extra", f"LossInputs fields ({', '.join(sorted(names))})", str(unknown))
            )
        values.update(extra)
        return cls(**values)

    def _checked_env_names(self) -> tuple[str, ...] | None:
        names = self.env_names
        if names is None:
            return None
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise TypeError(
                problem("env_names", "a list of str (one per sequence id)", describe(names))
            )
        out = tuple(names)
        for i, e in enumerate(out):
            if not isinstance(e, str):
                raise TypeError(problem(f"env_names[{i}]", "a str", describe(e)))
            if e == RESERVED_ENV:
                raise ValueError(
                    f"env_names[{i}] = {RESERVED_ENV!r} is reserved (metrics use '<name>/all' for "
                    "every env); rename the env"
                )
        sid = self.flat("sequence_ids")
        if sid is None:
            raise ValueError(
                "sequence_ids is required by env_names ([N] int64 row -> sequence within the "
                "micro-batch, -1 for padding); pass both or neither"
            )
        if sid.numel() == 0:
            return out

        def message(v: Sequence[float]) -> Exception | None:
            num = max(int(v[0]) + 1, 0)
            # Entries past the last sequence id are allowed only as '' (a packed batch names
            # its padding segment ''): a name there would belong to no sequence.
            extra = [i for i in range(num, len(out)) if out[i]]
            if len(out) >= num and not extra:
                return None
            return ValueError(
                f"env_names has length {len(out)}, expected {num} (one name per sequence id "
                f"0..{num - 1}, as sequence_ids reaches {num - 1}; entries after that only '' "
                "for padding): a list that does not match the sequence ids labels the metrics "
                "of the wrong sequences"
            )

        checks = DeferredChecks(sid.device)
        checks.add([sid.max()], message)
        checks.submit()
        return out


def unchecked_inputs(
    *,
    split: tuple[torch.Tensor, torch.Tensor] | None = None,
    sequences_in_order: bool = False,
    **fields: Any,
) -> LossInputs:
    """A `LossInputs` of ``fields`` whose tensors' values the caller has checked itself.

    The one constructor of a record that is not validated again: the ``echoloss.nn`` modules
    check each argument as passed (named as passed, on the rows where it is read:
    `check_float_values`, `check_echo_weight_values`) and derive the rest, so their record is
    not validated a second time (under the record's field names, and about a hundred launches
    per call on a GPU); `select_rows` builds a record's rows with it. Metadata is not checked
    either; ``env_names`` (host strings) is, as `LossInputs` checks it. ``split``: the flat
    ``(rl, echo)`` rows when the caller has them already (exactly `split_rows` of ``rl_mask``
    and ``echo_weights``), else they are derived. ``sequences_in_order``: the caller built
    ``sequence_ids`` never decreasing along the rows (the fused algebra then skips their sort;
    a wrong promise gives wrong sequence sums).

    Examples:
        >>> x = unchecked_inputs(rl_mask=torch.tensor([True, True]),
        ...                      echo_weights=torch.tensor([0.0, 0.5]))
        >>> x.rl.tolist(), x.echo.tolist()
        ([True, False], [False, True])
    """
    names = {f.name for f in dataclasses.fields(LossInputs) if f.init}
    if set(fields) - names:
        raise TypeError(f"unchecked_inputs: unknown fields {sorted(set(fields) - names)}")
    x = object.__new__(LossInputs)
    for f in dataclasses.fields(LossInputs):
        if f.init:
            object.__setattr__(x, f.name, fields.get(f.name, f.default))
    ew = x.echo_weights
    if split is None:
        split = split_rows(x.rl_mask.reshape(-1), None if ew is None else ew.reshape(-1))
    rl, echo = split
    object.__setattr__(x, "_sequences_in_order", sequences_in_order)
    object.__setattr__(x, "rl", rl)
    object.__setattr__(x, "echo", echo)
    object.__setattr__(x, "_versions", ())
    if x.env_names is not None:
        object.__setattr__(x, "env_names", x._checked_env_names())
    return x


def select_rows(x: LossInputs, idx: torch.Tensor, **replace: torch.Tensor) -> LossInputs:
    """The record's per-token fields on rows ``idx`` (flat ``[c]``), without validating them
    again (they were validated in ``x``); sequence ids, env names and the temperature are left
    out (a chunk-additive loss reads none of them). ``replace``: fields given on those rows
    instead (``[c]``, checked by the caller).

    Examples:
        >>> x = LossInputs(rl_mask=torch.tensor([True, False, True]),
        ...                advantages=torch.tensor([1.0, 0.0, 2.0]))
        >>> select_rows(x, torch.tensor([2])).advantages.tolist()
        [2.0]
    """
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(LossInputs):
        if not f.init or f.name in ("sequence_ids", "env_names", "temperature"):
            continue
        value = getattr(x, f.name)
        if isinstance(value, torch.Tensor):
            value = value.reshape(-1).index_select(0, idx)
        fields[f.name] = replace.get(f.name, value)
    split = (x.rl.index_select(0, idx), x.echo.index_select(0, idx))
    return unchecked_inputs(split=split, **fields)


def _check_rows(
    name: str,
    values: torch.Tensor,
    rows: torch.Tensor | None,
    rule: str,
    expected: str,
    fix: str,
    *,
    show: Callable[[float], str],
    threshold: float = 0.0,
) -> None:
    """Raise naming the first entry of ``values [N]`` on ``rows [N]`` (None = all) that
    breaks ``rule`` (``echoloss.ops.value_checks.RULES``), with its value; deferred on the
    device path (``echoloss/_deferred.py``: one launch there on CUDA)."""
    if values.numel() == 0:
        return

    def message(v: Sequence[float]) -> Exception | None:
        if not v[0]:
            return None
        return ValueError(problem(f"{name}[{int(v[2])}]", expected, show(v[3]), fix))

    checks = DeferredChecks(values.device)
    checks.add_rows(values, rows, rule, message, threshold=threshold)
    checks.submit()


def check_echo_weight_values(
    name: str, weights: torch.Tensor, where: torch.Tensor | None = None
) -> None:
    """`LossInputs`' check of ``echo_weights``: every weight ``[N]`` (on the rows ``where``,
    None = every row) finite and ≥ 0, else name the first bad row of ``name`` (the argument
    as the caller passed it); deferred on the device path (``echoloss/_deferred.py``).

    Examples:
        >>> check_echo_weight_values("echo_weights", torch.tensor([0.0, -1.0]))
        Traceback (most recent call last):
        ...
        ValueError: echo_weights[1] must be a finite weight ≥ 0 (0 = not echoed), got -1.0; echo weights come from EchoConfig (λ or α per row)
    """
    _check_rows(
        name,
        weights,
        where,
        "not_weight",  # NaN fails too
        "a finite weight ≥ 0 (0 = not echoed)",
        "echo weights come from EchoConfig (λ or α per row)",
        show=lambda v: repr(v),
    )


def check_float_values(
    name: str, values: torch.Tensor, where: torch.Tensor, *, logprob: bool
) -> None:
    """`LossInputs`' checks of a float field ``[N]`` on the rows ``where``: finite, and with
    ``logprob`` a log-probability ≤ 0 (up to `LOGPROB_TOLERANCE`); errors name ``name`` (the
    argument as the caller passed it) and are deferred on the device path.

    Examples:
        >>> check_float_values("ref_logprobs", torch.tensor([-0.5, 2.0]),
        ...                    torch.tensor([True, True]), logprob=True)
        Traceback (most recent call last):
        ...
        ValueError: ref_logprobs[1] must be a log-probability ≤ 0 (up to 0.001), got 2.0; pass log p, not the negative log-likelihood -log p
    """
    check_finite(name, values, where)
    if logprob:
        _check_logprobs(name, values, where)


def _check_logprobs(name: str, t: torch.Tensor, where: torch.Tensor) -> None:
    _check_rows(
        name,
        t,
        where,
        "above",
        f"a log-probability ≤ 0 (up to {LOGPROB_TOLERANCE})",
        "pass log p, not the negative log-likelihood -log p",
        show=lambda v: repr(round(v, 6)),
        threshold=LOGPROB_TOLERANCE,
    )
