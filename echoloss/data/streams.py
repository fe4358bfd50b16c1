"""Per-token streams, declared once: what every step of the data path does with each of them.

A [`TokenStream`][echoloss.data.streams.TokenStream] says everything the data path needs to know
about one per-token list of a [`Sample`][echoloss.data.interleave.Sample]: its kind and element
check, whether it covers the whole sequence or the completion only, whether a sample may omit it,
the value that stands for "nothing here", and how a model call
([`Step`][echoloss.data.interleave.Step]) produces it. The table of them,
[`STREAMS`][echoloss.data.interleave.STREAMS] (next to ``Sample``), is the one declaration that
sample validation, ``interleave``'s merge, ``truncate_sample``, ``pack``, ``unpack`` and
``next_token_targets`` loop over (and the test strategies draw from), so a new stream is one
``Sample`` field plus one row there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from echoloss._validate import check_len

__all__ = ["Scope", "StepValues", "TokenStream"]

Scope = Literal["sequence", "completion"]

#: ``fn(step, selection, rl) -> values over the step's P + C tokens, or None``: how one model call
#: produces a stream (``selection`` is the step's echo selection or None, ``rl`` its completion
#: tokens' RL mask after echo). None = this step does not produce the stream.
StepValues = Callable[[Any, Any, list[bool]], "list[Any] | None"]

_DTYPES = {"bool": torch.bool, "int": torch.int64, "float": torch.float32}


@dataclass(frozen=True, kw_only=True)
class TokenStream:
    """One per-token stream of a ``Sample``, and how the data path carries it.

    Attributes:
        name: the ``Sample`` attribute (a list, or None when ``optional``).
        packed: its name in ``PackedBatch.streams`` and ``NextTokenTargets.streams``; when a
            `echoloss.LossInputs` field has this name, ``LossInputs.from_targets`` takes it.
        kind: ``"bool"``, ``"int"`` or ``"float"``: packed as ``torch.bool``, ``int64`` or
            ``float32``.
        scope: ``"sequence"`` (one entry per token, ``P + C``) or ``"completion"`` (``C``
            entries; prompt tokens are packed with ``prompt_value`` or ``fill``).
        fill: the packed value where the stream says nothing: padding, a sample without this
            optional stream, the prompt of a completion stream, the row after a segment's last
            token in the targets, a token an ``interleave`` step does not produce.
        optional: a sample may carry None (packed as ``fill``; ``unpack`` restores None).
        may_be_none: an element may be None ("nothing here", packed as ``fill``; ``unpack``
            turns ``fill`` back into None), like the echo weights; otherwise "nothing here" is
            ``fill`` itself.
        empty_is_none: ``interleave`` stores a list of nothing but `missing` as None (a sample
            with no echoed token carries no echo stream).
        examples: valid element values (the test strategies draw from them; exactly
            representable in float32, so that pack → unpack is bit-exact).
        check: ``fn(name, values) -> values``: the element check, raising with ``name[i]``.
        from_step: how ``interleave`` gets the values of one model call
            ([`StepValues`][echoloss.data.streams.StepValues]); None = no step produces it (it
            stays None on interleaved samples).
        untrained_at_zero: position 0 of a sample has no prediction, so this stream holds
            [`missing`][echoloss.data.streams.TokenStream.missing] there (packed as ``fill``;
            ``next_token_targets`` refuses a batch that marks a segment's first token in it).
        pack_values: ``fn(sample) -> P + C values`` when packing is not the plain list (RL mask
            after echo, position 0 cleared, observation mask defaulting to the echoed tokens).
        prompt_value: ``fn(sample) -> value`` on the prompt tokens of a completion stream, read
            before any truncation (default ``fill``).
    """

    name: str
    packed: str
    kind: Literal["bool", "int", "float"]
    scope: Scope
    fill: bool | int | float
    optional: bool = False
    may_be_none: bool = False
    empty_is_none: bool = False
    examples: tuple[Any, ...] = ()
    check: Callable[[str, Any], list[Any]] | None = None
    from_step: StepValues | None = None
    untrained_at_zero: bool = False
    pack_values: Callable[[Any], list[Any]] | None = None
    prompt_value: Callable[[Any], Any] | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The packed tensor dtype."""
        return _DTYPES[self.kind]

    @property
    def missing(self) -> Any:
        """The list element meaning "nothing here": None if ``may_be_none``, else ``fill``."""
        return None if self.may_be_none else self.fill

    def length(self, prompt_len: int, completion_len: int) -> int:
        """Entries of this stream in a sample of ``P`` prompt and ``C`` completion tokens."""
        return completion_len if self.scope == "completion" else prompt_len + completion_len

    def validate(self, sample: Any, where: str) -> list[Any] | None:
        """The sample's list after the element check and the length check (None if omitted).

        Raises:
            TypeError, ValueError: a required stream omitted, a bad element, a wrong length.
        """
        values = getattr(sample, self.name)
        name = f"{where}.{self.name}"
        if values is None:
            if self.optional:
                return None
            raise TypeError(f"{name} is required (a list with one entry per {self._per()})")
        out = self.check(name, values) if self.check is not None else list(values)
        p, c = len(sample.prompt_ids), len(sample.completion_ids)
        check_len(name, out, self.length(p, c), self._what())
        return out

    def token_values(self, sample: Any, prompt_value: Any) -> list[Any]:
        """The ``P + C`` values packed for ``sample`` (``prompt_value``: see the attribute)."""
        if self.pack_values is not None:
            return list(self.pack_values(sample))
        p, c = len(sample.prompt_ids), len(sample.completion_ids)
        values = getattr(sample, self.name)
        if values is None:
            body = [self.fill] * self.length(p, c)
        else:
            body = [self.fill if v is None else v for v in values]
        if self.untrained_at_zero and (p + c) and (self.scope == "sequence" or p == 0):
            body = [self.fill, *body[1:]]
        return [prompt_value] * p + body if self.scope == "completion" else body

    def from_packed(self, values: list[Any], prompt_len: int, carried: bool) -> list[Any] | None:
        """The sample's list back from its segment's packed ``values`` (``unpack``)."""
        if self.optional and not carried:
            return None
        body = values[prompt_len:] if self.scope == "completion" else values
        if self.may_be_none:
            return [None if v == self.fill else v for v in body]
        return body

    def truncate(self, values: list[Any] | None, max_tokens: int, prompt_len: int) -> Any:
        """The first ``max_tokens`` tokens' entries (``prompt_len``: the kept prompt length)."""
        if values is None:
            return None
        keep = max_tokens - prompt_len if self.scope == "completion" else max_tokens
        return values[:keep]

    def step_view(self, step: Any, selection: Any, rl: list[bool]) -> list[Any] | None:
        """The values of one model call over its ``P + C`` tokens (None: not produced)."""
        if self.from_step is None:
            return None
        out = self.from_step(step, selection, rl)
        return None if out is None else list(out)

    def carries_nothing(self, values: Sequence[Any]) -> bool:
        """Every element is `missing` (then ``empty_is_none`` streams are left None)."""
        return all(v == self.missing for v in values)

    def _per(self) -> str:
        return "completion token" if self.scope == "completion" else "token"

    def _what(self) -> str:
        if self.scope == "completion":
            return "len(completion_ids)"
        return "len(prompt_ids) + len(completion_ids)"
