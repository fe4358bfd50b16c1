"""Where each payload field lies in the rendered conversation, from a constant number of renders.

Every field (see ``_messages``) is replaced by a unique sentinel and the conversation is
rendered once (``S``). Between the sentinels lies the template's scaffold, which does not depend
on the payload values (checked below). Fields are then coloured so that two fields rendered next
to each other never share a colour, and the conversation is rendered once per colour with that
colour's fields real and all others sentinels: each real value then sits between two known
sentinels, so its rendered text (trimmed, JSON-escaped, whatever the template does to it) is read
off exactly. Finally the real rendering must equal the scaffold with those texts put back; that
check proves every body by construction, and a template that renders scaffold differently
depending on the payload fails it with an error naming the message.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from echoloss._logging import warn_once
from echoloss.adapters.chat._errors import ChatTemplateError, excerpt
from echoloss.adapters.chat._messages import Field, get_path, with_values

_SENTINEL = re.compile(r"Qx(\d+)echo([QK])")
_ARG_BASE = 7_100_000_000  # an integer argument value no real argument is rendered next to
_ARG_REACH = 64  # characters between an argument-key sentinel and its value

Render = Callable[[Sequence[Mapping[str, Any]]], str]


def sentinel(field: Field) -> Any:
    """The stand-in value of a field: letters and digits only, so trimming and JSON escaping
    leave it as it is; arguments given as a mapping stay a one-item mapping."""
    if field.kind == "args":
        return {f"Qx{field.index}echoK": _ARG_BASE + field.index}
    return f"Qx{field.index}echoQ"


def substituted(
    messages: Sequence[Mapping[str, Any]],
    fields: Sequence[Sequence[Field]],
    keep_real: Callable[[Field], bool],
) -> list[Mapping[str, Any]]:
    """``messages`` with every field for which ``keep_real`` is False replaced by its sentinel."""
    out: list[Mapping[str, Any]] = []
    for m, fs in zip(messages, fields, strict=True):
        repl = [(f.path, sentinel(f)) for f in fs if not keep_real(f)]
        out.append(with_values(m, repl) if repl else m)
    return out


@dataclass(frozen=True)
class Slots:
    """Rendered fields in the real rendering, sorted by position (character offsets).

    ``first[j]`` is True on the first rendering of a field: that one is body. A field the
    template renders again elsewhere (gpt-oss repeats the called function's name in each tool
    result header) is scaffold of the message around the repetition.
    """

    start: list[int]
    end: list[int]
    field: list[int]
    first: list[bool]


def _has_colour(colour: Sequence[int], c: int, field: Field) -> bool:
    return colour[field.index] == c


def _describe(field: Field, messages: Sequence[Mapping[str, Any]]) -> str:
    what = ".".join(str(p) for p in field.path)
    return f"message {field.message} (role {messages[field.message]['role']!r}) field {what!r}"


def _scan(skeleton: str, fields: Sequence[Field]) -> list[tuple[int, int, int]]:
    """Every sentinel occurrence in ``skeleton`` as ``(start, end, field index)``."""
    found: list[tuple[int, int, int]] = []
    for m in _SENTINEL.finditer(skeleton):
        fid = int(m.group(1))
        if fid >= len(fields) or (m.group(2) == "K") != (fields[fid].kind == "args"):
            raise ChatTemplateError(
                f"the rendered conversation contains {m.group(0)!r}, which looks like one of "
                "echoloss's own placeholders but is not one; remove that text from the messages "
                "or tool schemas"
            )
        end = m.end()
        if m.group(2) == "K":
            value = str(_ARG_BASE + fid)
            at = skeleton.find(value, end, end + _ARG_REACH + len(value))
            if at < 0:
                raise ChatTemplateError(
                    f"the chat template renders the arguments of a tool call (field {fid}) "
                    "without their values next to their names; echoloss cannot delimit them",
                    message_index=fields[fid].message,
                )
            end = at + len(value)
        found.append((m.start(), end, fid))
    return found


def _colours(order: Sequence[int], n_fields: int) -> list[int]:
    """Colour of each field such that neighbouring occurrences have different colours
    (greedy; two colours for the usual one-field-after-another rendering)."""
    neighbours: list[set[int]] = [set() for _ in range(n_fields)]
    for a, b in itertools.pairwise(order):
        if a != b:
            neighbours[a].add(b)
            neighbours[b].add(a)
    colour = [-1] * n_fields
    for f in dict.fromkeys(order):
        used = {colour[g] for g in neighbours[f]}
        colour[f] = next(c for c in range(len(used) + 1) if c not in used)
    return colour


def _branch_error(
    field: Field, messages: Sequence[Mapping[str, Any]], text: str, at: int
) -> ChatTemplateError:
    return ChatTemplateError(
        f"{_describe(field, messages)}: the chat template renders the scaffold around this "
        "value differently depending on the value itself (it branches on the content, e.g. "
        f"on `'</think>' in content`; at character {at}: {excerpt(text, at)}), so the body "
        "cannot be delimited by rendering it with different values. Check the message for "
        "text the template treats specially",
        message_index=field.message,
    )


def locate_slots(
    messages: Sequence[Mapping[str, Any]],
    fields: Sequence[Sequence[Field]],
    full: str,
    render: Render,
    *,
    strict_missing: bool = True,
) -> Slots:
    """Character span of every rendered field in ``full`` (the real rendering of ``messages``
    with ``render``). Raises [`ChatTemplateError`][echoloss.adapters.chat.ChatTemplateError] naming the message when a body is
    rendered more than once, not at all while its message has content, or cannot be proven."""
    flat = [f for fs in fields for f in fs]
    if not flat:
        return Slots(start=[], end=[], field=[], first=[])
    skeleton = render(substituted(messages, fields, lambda f: False))
    found = _scan(skeleton, flat)
    counts = [0] * len(flat)
    for _, _, fid in found:
        counts[fid] += 1
    for f in flat:
        if counts[f.index] > 1 and f.kind != "name":
            raise ChatTemplateError(
                f"{_describe(f, messages)}: the chat template renders this value "
                f"{counts[f.index]} times, so its body is not one span; echoloss cannot tell "
                "body from scaffold for this template",
                message_index=f.message,
            )
    for k, fs in enumerate(fields):
        _check_rendered(k, fs, counts, messages, strict=strict_missing)
    order = [fid for _, _, fid in found]
    for a, b in itertools.pairwise(order):
        if a == b:
            raise ChatTemplateError(
                f"{_describe(flat[a], messages)}: the chat template renders this value twice "
                "in a row; echoloss cannot delimit it",
                message_index=flat[a].message,
            )
    colour = _colours(order, len(flat))
    # Scaffold pieces: gaps[j] precedes occurrence j; gaps[-1] follows the last one.
    bounds = [0, *(x for s, e, _ in found for x in (s, e)), len(skeleton)]
    gaps = [skeleton[bounds[2 * j] : bounds[2 * j + 1]] for j in range(len(found) + 1)]
    marks = [skeleton[s:e] for s, e, _ in found]
    real: dict[int, str] = {}
    try:
        for c in sorted({colour[f] for f in order}):
            text = render(substituted(messages, fields, functools.partial(_has_colour, colour, c)))
            _read_values(text, gaps, marks, order, colour, c, real, flat, messages)
    except ChatTemplateError as e:
        raise _culprit(messages, fields, render, gaps, marks, order, flat) or e from None
    inner = {fid: _inside(flat[fid], field_value(messages, flat[fid]), v, messages)
             for fid, v in real.items()}  # fmt: skip
    # The real rendering is the scaffold with the real values put back: proven body spans.
    start: list[int] = []
    end: list[int] = []
    first: list[bool] = []
    seen: set[int] = set()
    at = 0
    for j, fid in enumerate(order):
        if not full.startswith(gaps[j], at):
            raise _branch_error(flat[fid], messages, full, at)
        at += len(gaps[j])
        value = real[fid]
        if not full.startswith(value, at):
            raise _branch_error(flat[fid], messages, full, at)
        lo, hi = inner[fid]
        start.append(at + lo)
        end.append(at + hi)
        at += len(value)
        first.append(fid not in seen)
        seen.add(fid)
    if full[at:] != gaps[-1]:
        raise _branch_error(flat[order[-1]], messages, full, at)
    return Slots(start=start, end=end, field=order, first=first)


def _check_rendered(
    k: int,
    fs: Sequence[Field],
    counts: Sequence[int],
    messages: Sequence[Mapping[str, Any]],
    *,
    strict: bool,
) -> None:
    """A message whose content the template does not render at all is an error (``strict``) or
    a warning; dropped tool calls are a warning; dropped reasoning is the template's documented
    behaviour (earlier turns lose it) and passes."""
    role = messages[k]["role"]
    content = [f for f in fs if f.path[0] == "content"]
    if content and not any(counts[f.index] for f in fs):
        text = (
            f"message {k} (role {role!r}) has content but the chat template does not render it "
            "in this conversation, so its tokens cannot be attributed. Some templates render a "
            "role only in some positions (Mistral v0.3 renders the system prompt only when the "
            "conversation ends with a user turn) or not at all; steps_from_messages renders "
            "each turn's prompt as the model saw it"
        )
        if strict:
            raise ChatTemplateError(text, message_index=k)
        warn_once("chat-message-not-rendered", "echoloss: " + text)
        return
    if any(counts[f.index] == 0 for f in content):
        warn_once(
            "chat-content-not-rendered",
            f"echoloss: the chat template does not render the content of message {k} (role "
            f"{role!r}) next to its other fields; that text is in no token",
        )
    if any(counts[f.index] == 0 for f in fs if f.path[0] == "tool_calls"):
        warn_once(
            "chat-tool-calls-not-rendered",
            f"echoloss: the chat template does not render the tool calls of message {k} (role "
            f"{role!r}); they are in no token",
        )


def _culprit(
    messages: Sequence[Mapping[str, Any]],
    fields: Sequence[Sequence[Field]],
    render: Render,
    gaps: Sequence[str],
    marks: Sequence[str],
    order: Sequence[int],
    flat: Sequence[Field],
) -> ChatTemplateError | None:
    """The error for the first field whose real value alone changes the scaffold (one render
    per field: only on the error path)."""
    for f in dict.fromkeys(order):
        alone = [1 if g == f else 0 for g in range(len(flat))]
        text = render(substituted(messages, fields, functools.partial(_has_colour, alone, 1)))
        try:
            _read_values(text, gaps, marks, order, alone, 1, {}, flat, messages)
        except ChatTemplateError as e:
            return e
    return None


def _read_values(
    text: str,
    gaps: Sequence[str],
    marks: Sequence[str],
    order: Sequence[int],
    colour: Sequence[int],
    c: int,
    real: dict[int, str],
    flat: Sequence[Field],
    messages: Sequence[Mapping[str, Any]],
) -> None:
    """Read the rendered text of every field of colour ``c`` out of ``text`` (a rendering with
    those fields real and all others sentinels) into ``real``."""
    at = 0
    n = len(order)
    for j, fid in enumerate(order):
        if not text.startswith(gaps[j], at):
            raise _branch_error(flat[fid], messages, text, at)
        at += len(gaps[j])
        if colour[fid] != c:
            if not text.startswith(marks[j], at):
                raise _branch_error(flat[fid], messages, text, at)
            at += len(marks[j])
            continue
        if j + 1 < n:
            stop = text.find(gaps[j + 1] + marks[j + 1], at)
        else:
            stop = len(text) - len(gaps[-1])
            if stop < at or not text.endswith(gaps[-1]):
                stop = -1
        if stop < 0:
            raise _branch_error(flat[fid], messages, text, at)
        value = text[at:stop]
        if real.setdefault(fid, value) != value:
            raise _branch_error(flat[fid], messages, text, at)
        at = stop


def _inside(
    field: Field, value: Any, rendered: str, messages: Sequence[Mapping[str, Any]]
) -> tuple[int, int]:
    """The part of a field's rendering that is the value itself: all of it when the template
    wrote the value as is, trimmed or JSON-escaped; the one occurrence of the value inside it
    when the template added text around it that depends on the value (the rest is scaffold);
    else all of it, with a warning (the template transforms the value beyond recognition)."""
    if not isinstance(value, str):
        return 0, len(rendered)  # arguments given as a mapping: rendered by the template's JSON
    forms = [value, value.strip()]
    forms += [json.dumps(f, ensure_ascii=a)[1:-1] for f in forms for a in (True, False)]
    if rendered in forms:
        return 0, len(rendered)
    for form in forms:
        if form and rendered.count(form) == 1:
            at = rendered.index(form)
            return at, at + len(form)
    warn_once(
        "chat-body-transformed",
        f"echoloss: {_describe(field, messages)}: the chat template renders this value as "
        f"{rendered[:60]!r}, which does not contain it as written; that rendering is its body",
    )
    return 0, len(rendered)


def field_value(messages: Sequence[Mapping[str, Any]], field: Field) -> Any:
    return get_path(messages[field.message], field.path)
