"""Span-restricted echo: echo only the characters a span selector marks inside messages.

An echo config chooses roles (and tools); a span selector narrows that to parts of messages: the
result of a command but not its banner, the one word that depends on a hidden state, or (as a
placebo) a span that carries no information about the environment. The selector names
*character* spans of message contents; [`span_echo_filter`][echoloss.data.spans.span_echo_filter]
turns them into the per-token keep masks of [`interleave`][echoloss.data.interleave]'s
``echo_filter``. Tokens removed this way still count in ``Z = |O|`` (docs/spec.md §5.3): the echo
target shrinks, its normaliser does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from echoloss.data.attribution import TokenAttribution
from echoloss.data.interleave import Step

__all__ = ["span_echo_filter", "span_token_mask"]

Spans = Mapping[int, Sequence[tuple[int, int]] | tuple[int, int]]


def _as_span_list(message: int, value: Any) -> list[tuple[int, int]]:
    """One message's spans as a list of ``(lo, hi)`` (a single pair is accepted)."""
    items = (
        [value]
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], int)
        else value
    )
    out = []
    for item in items:
        if (
            not isinstance(item, tuple)
            or len(item) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
            or not 0 <= item[0] < item[1]
        ):
            raise ValueError(
                f"span selector: message {message} has span {item!r}; expected (lo, hi) "
                "character offsets with 0 <= lo < hi"
            )
        out.append(item)
    return out


def span_token_mask(
    token_ids: Sequence[int],
    attribution: TokenAttribution | Mapping[str, Any],
    messages: Sequence[Mapping[str, Any]],
    spans: Spans,
    *,
    decode: Callable[[list[int]], str],
) -> list[bool]:
    """``[P]`` True on the body tokens of ``token_ids`` that lie inside ``spans``.

    Args:
        token_ids: ``[P]`` a rendered prompt (or conversation).
        attribution: its [`TokenAttribution`][echoloss.data.attribution.TokenAttribution]
            (``is_content`` required): which message each token's body bytes come from.
        messages: the conversation the indices of ``spans`` and of the attribution refer to.
        spans: message index -> ``(lo, hi)`` character span(s) of that message's ``content``.
        decode: token ids -> text (``tokenizer.decode``); a body token covers the characters
            it adds to the decoding of the message's body tokens before it, and all of them
            decode to the message's content.

    Raises:
        ValueError: the attribution has no ``is_content``; a span out of its message's range; a
            token that covers characters both inside and outside a span (the span does not fall
            on token boundaries); body tokens that do not decode to the message's content.

    Examples:
        >>> decode = lambda ids: "".join(chr(i) for i in ids)  # one character per token
        >>> msgs = [{"role": "tool", "content": "east 7"}]
        >>> att = {"message_indices": [-1, 0, 0, 0, 0, 0, 0],
        ...        "is_content": [False] + [True] * 6, "message_roles": ["tool"]}
        >>> ids = [0] + [ord(c) for c in "east 7"]
        >>> span_token_mask(ids, att, msgs, {0: (5, 6)}, decode=decode)
        [False, False, False, False, False, False, True]
    """
    att = (
        attribution
        if isinstance(attribution, TokenAttribution)
        else TokenAttribution.from_dict(dict(attribution))
    )
    n = len(token_ids)
    if len(att.message_indices) != n:
        raise ValueError(
            f"span_token_mask: attribution covers {len(att.message_indices)} tokens, token_ids "
            f"has {n}; pass the attribution of these token ids"
        )
    if len(att.is_content) != n:
        raise ValueError(
            "span_token_mask: the attribution has no is_content (which tokens are message body); "
            "character spans need it: attribute with echoloss.adapters.chat.render_attributed"
        )
    mask = [False] * n
    body: dict[int, list[int]] = {}
    for k, (mi, content) in enumerate(zip(att.message_indices, att.is_content, strict=True)):
        if content and mi in spans:
            body.setdefault(mi, []).append(k)
    for mi, positions in body.items():
        text = str(messages[mi].get("content") or "")
        ranges = _as_span_list(mi, spans[mi])
        for lo, hi in ranges:
            if hi > len(text):
                raise ValueError(
                    f"span selector: message {mi} span ({lo}, {hi}) ends past its content "
                    f"({len(text)} characters: {text!r})"
                )
        # a body token covers the characters its decoding adds to the message so far (decoding
        # prefixes, not single tokens: byte-level pieces and merges decode right only in context)
        ends = [
            len(decode([int(token_ids[k]) for k in positions[: j + 1]]))
            for j in range(len(positions))
        ]
        at = 0
        for k, end in zip(positions, ends, strict=True):
            width = end - at
            for lo, hi in ranges:
                if lo <= at and at + width <= hi:
                    mask[k] = width > 0
                elif at < hi and at + width > lo:
                    raise ValueError(
                        f"span selector: message {mi}: token {k} covers characters "
                        f"[{at}, {at + width}) of {text!r}, across the span ({lo}, {hi}); choose "
                        "spans on token boundaries (or a tokenizer whose tokens respect them)"
                    )
            at += width
        if at != len(text):
            raise ValueError(
                f"span selector: message {mi}: its {len(positions)} body tokens decode to {at} "
                f"characters, its content has {len(text)} ({text!r}); the attribution does not "
                "match these messages, or the tokenizer does not decode token by token"
            )
    return mask


def span_echo_filter(
    messages: Sequence[Mapping[str, Any]],
    select: Callable[[Sequence[Mapping[str, Any]]], Spans],
    *,
    decode: Callable[[list[int]], str],
) -> Callable[[list[Step]], list[list[bool]]]:
    """An ``echo_filter`` for [`interleave`][echoloss.data.interleave] that keeps only the
    tokens inside the character spans ``select(messages)`` marks (message index -> ``(lo, hi)``
    span or spans of its content); every other prompt token, and every completion token, leaves
    the echo target (they still count in ``Z = |O|``).

    Args:
        messages: the trajectory's whole conversation (each step's attribution indexes into it).
        select: the span selector, called once.
        decode: token ids -> text (``tokenizer.decode``).

    Returns:
        ``fn(steps) -> list[list[bool]]``, one ``[P + C]`` keep mask per step. Every step needs
        an attribution with ``is_content``.

    Examples:
        >>> from echoloss import EchoConfig, RoleEcho, Step, interleave
        >>> decode = lambda ids: "".join(chr(i) for i in ids)
        >>> msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "e"},
        ...         {"role": "tool", "content": "east 7"}]
        >>> att = {"message_indices": [0, 0, 1, 2, 2, 2, 2, 2, 2],
        ...        "is_content": [True] * 9, "message_roles": ["user", "assistant", "tool"]}
        >>> step = Step(prompt_ids=[ord(c) for c in "goeeast 7"], completion_ids=[1],
        ...             completion_logprobs=[0.0], attribution=att)
        >>> last_char = lambda m: {i: (len(x["content"]) - 1, len(x["content"]))
        ...                        for i, x in enumerate(m) if x["role"] == "tool"}
        >>> fn = span_echo_filter(msgs, last_char, decode=decode)
        >>> echo = EchoConfig(tool=RoleEcho(alpha=0.5), skip_initial_prompt=False)
        >>> s = interleave([step], echo=echo, echo_filter=fn)[0]
        >>> [w for w in s.token_echo_weights() if w], sum(s.token_observation_mask())
        ([0.5], 6)
    """
    spans = select(messages)
    if not isinstance(spans, Mapping):
        raise TypeError(
            f"span selector must return a mapping message index -> (lo, hi) span(s), got "
            f"{type(spans).__name__}"
        )
    for mi, value in spans.items():
        if not isinstance(mi, int) or not 0 <= mi < len(messages):
            raise ValueError(
                f"span selector: message index {mi!r} is not one of the {len(messages)} messages"
            )
        _as_span_list(mi, value)

    def keep(steps: list[Step]) -> list[list[bool]]:
        out = []
        for i, step in enumerate(steps):
            if step.attribution is None:
                raise ValueError(
                    f"span_echo_filter: step {i} has no attribution; spans need to know which "
                    "message each prompt token comes from"
                )
            mask = span_token_mask(
                step.prompt_ids, step.attribution, messages, spans, decode=decode
            )
            out.append(mask + [False] * len(step.completion_ids))
        return out

    keep.__name__ = f"span_echo_filter({getattr(select, '__name__', 'select')})"
    return keep
