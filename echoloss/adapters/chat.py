"""Chat messages + a Hugging Face tokenizer's own chat template → token ids + attribution.

Most users have messages and a tokenizer, not a renderer that reports which message produced which
token. This module recovers that from the chat template itself, by rendering it several times:

1. **Message spans.** The whole conversation is rendered once (``R``), and every prefix
   ``messages[:k]`` once more. Message ``k`` starts where the rendering of ``messages[:k]`` stops
   agreeing with ``R`` (their longest common prefix) and ends where message ``k + 1`` starts.
   Whatever the template writes before the first message (a BOS token, a default system prompt)
   is leading scaffold of message 0; whatever follows the last message (the generation prompt) is
   scaffold of no message (``-1``).
2. **Body vs scaffold.** Message ``k``'s payload (content, reasoning, tool-call names and
   arguments) is replaced by two different sentinel values and ``messages[:k + 1]`` is rendered
   with each; the renderings agree outside the payload, so their common prefix and suffix
   delimit the *body* of the message inside ``R`` (the technique of the ECHO reference code).
   Role headers, ``<tool_response>`` wrappers, end-of-turn tokens are scaffold.
3. **Prefix stability.** Each message's body must render the same whether or not later messages
   follow. A template that rewrites earlier turns once later turns exist (for example one that
   strips reasoning from earlier assistant turns) is a [`ChatTemplateError`][echoloss.adapters.chat.ChatTemplateError] naming the first
   message where it breaks; attribution is never guessed.
4. **Token for token.** Character boundaries become token boundaries only where the tokenizer
   splits there: the pieces between boundaries, tokenized one by one, must concatenate to the
   template's own token ids (``apply_chat_template(..., tokenize=True)``); otherwise each
   boundary is checked by tokenizing the text up to it (exact for SentencePiece-style tokenizers
   too). A token that straddles a boundary is a [`ChatTemplateError`][echoloss.adapters.chat.ChatTemplateError] naming the message.

The tokenizer is duck-typed: ``apply_chat_template(messages, tools=..., tokenize=...,
add_generation_prompt=..., **kwargs)`` and ``tokenizer(list_of_texts, add_special_tokens=False)``
returning ``{"input_ids": [...]}``, which every ``transformers`` tokenizer provides. Nothing here
imports ``transformers``. ``docs/adapters.md`` lists the limits.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from echoloss._logging import warn_once
from echoloss.data.attribution import TokenAttribution
from echoloss.data.echo_config import STANDARD_ROLES
from echoloss.data.interleave import Step

__all__ = [
    "ChatRendering",
    "ChatTemplateError",
    "MessageSpan",
    "attribute",
    "render_attributed",
    "resolve_tool_names",
    "steps_from_messages",
]

# Message fields whose text is message *body* when the template renders it.
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "thinking")
_CONTEXT_CHARS = 40


class ChatTemplateError(ValueError):
    """The chat template cannot be attributed exactly (or the messages cannot be rendered).

    Attributes:
        message_index: index of the message where attribution breaks, or ``None``.
    """

    def __init__(self, message: str, *, message_index: int | None = None) -> None:
        super().__init__(message)
        self.message_index = message_index


@dataclass(frozen=True)
class MessageSpan:
    """Where one message lies in the rendered token ids (token indices, end exclusive).

    ``start <= body_start <= body_end <= end``: ``[start, body_start)`` is leading scaffold (role
    header), ``[body_start, body_end)`` the body, ``[body_end, end)`` trailing scaffold
    (end-of-turn tokens, separators). ``body_start == body_end`` when the message has no rendered
    body (empty content).
    """

    index: int
    role: str
    tool_name: str | None
    start: int
    end: int
    body_start: int
    body_end: int


@dataclass(frozen=True)
class ChatRendering:
    """A rendered conversation with per-message spans.

    Attributes:
        text: the template's rendering.
        token_ids: ``[P]`` the template's own token ids for it.
        attribution: [`echoloss.TokenAttribution`][echoloss.data.attribution.TokenAttribution] parallel to ``token_ids``.
        spans: one [`MessageSpan`][echoloss.adapters.chat.MessageSpan] per message, in order.
    """

    text: str
    token_ids: list[int]
    attribution: TokenAttribution
    spans: tuple[MessageSpan, ...]


# -- validation -------------------------------------------------------------------------------


def _check_messages(messages: Any, extra_roles: Sequence[str]) -> list[Mapping[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages is empty; a chat template needs at least one message")
    known = set(STANDARD_ROLES) | set(extra_roles)
    out: list[Mapping[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}] has no string 'role' (got {role!r})")
        if role not in known:
            raise ValueError(
                f"messages[{i}].role = {role!r} is not a known role (expected one of "
                f"{sorted(known)}); if your chat template renders it, pass "
                f"extra_roles=({role!r},) (its tokens are attributed to that role, and echoed only "
                "if EchoConfig.other_roles names it)"
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            if not isinstance(content, Sequence) or isinstance(content, bytes):
                raise TypeError(
                    f"messages[{i}].content must be a str, None or a list of content parts, got "
                    f"{type(content).__name__}"
                )
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                    raise TypeError(
                        f"messages[{i}].content[{j}] must be a dict with a 'type' (e.g. "
                        f"{{'type': 'text', 'text': ...}}), got {part!r}"
                    )
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"messages[{i}].name must be a str, got {type(name).__name__}")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
                raise TypeError(
                    f"messages[{i}].tool_calls must be a list, got {type(calls).__name__}"
                )
            for j, tc in enumerate(calls):
                if not isinstance(tc, Mapping):
                    raise TypeError(
                        f"messages[{i}].tool_calls[{j}] must be a dict, got {type(tc).__name__}"
                    )
        out.append(m)
    return out


def _call_function(tc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a tool call holding ``name``/``arguments`` (OpenAI nests it in ``function``)."""
    fn = tc.get("function")
    return fn if isinstance(fn, Mapping) else tc


def resolve_tool_names(messages: Sequence[Mapping[str, Any]]) -> list[str | None]:
    """Function name of each tool message: its ``name``, else its ``tool_call_id`` resolved.

    The id is looked up among the ``tool_calls`` of earlier assistant messages (the most recent
    match wins; ``tool_calls[j]["function"]["name"]`` or ``tool_calls[j]["name"]``).

    Args:
        messages: chat messages (dicts with ``role``; tool messages with ``name`` and/or
            ``tool_call_id``).

    Returns:
        ``[M]``: the name for each ``tool`` message, ``None`` for other roles and for a tool
        message with neither ``name`` nor ``tool_call_id``.

    Raises:
        ValueError: a ``tool_call_id`` matches no earlier tool call.

    Examples:
        >>> resolve_tool_names([
        ...     {"role": "assistant", "content": "", "tool_calls": [
        ...         {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        ...     {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        ...     {"role": "tool", "name": "cat", "content": "hi"},
        ... ])
        [None, 'ls', 'cat']
    """
    names: list[str | None] = []
    issued: dict[str, str] = {}
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant":
            for j, tc in enumerate(m.get("tool_calls") or []):
                fn = _call_function(tc)
                call_id, call_name = tc.get("id"), fn.get("name")
                if call_id is not None and not isinstance(call_id, str):
                    raise TypeError(
                        f"messages[{i}].tool_calls[{j}].id must be a str, got {call_id!r}"
                    )
                if call_id and isinstance(call_name, str):
                    issued[call_id] = call_name
        if role != "tool":
            names.append(None)
            continue
        name = m.get("name")
        if name is not None:
            names.append(name)
            continue
        call_id = m.get("tool_call_id")
        if call_id is None:
            names.append(None)
            continue
        if call_id not in issued:
            raise ValueError(
                f"messages[{i}] (role 'tool') has tool_call_id {call_id!r}, which matches no tool "
                f"call of an earlier assistant message (known ids: {sorted(issued)}); fix the id or "
                "give the tool message a 'name'"
            )
        names.append(issued[call_id])
    return names


# -- rendering helpers ------------------------------------------------------------------------


def _render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Any,
    add_generation_prompt: bool,
    kwargs: Mapping[str, Any],
    what: str,
    message_index: int | None,
) -> str:
    try:
        text = tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except Exception as e:  # the template's own error, re-raised with context
        raise ChatTemplateError(
            f"the chat template failed to render {what}: {type(e).__name__}: {e}. Attribution "
            "renders every prefix of the conversation, so each prefix must be renderable",
            message_index=message_index,
        ) from e
    if not isinstance(text, str):
        raise TypeError(
            f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str"
        )
    return text


def _template_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Any,
    add_generation_prompt: bool,
    kwargs: Mapping[str, Any],
) -> list[int]:
    out = tokenizer.apply_chat_template(
        list(messages),
        tools=tools,
        tokenize=True,
        add_generation_prompt=add_generation_prompt,
        return_dict=False,
        **kwargs,
    )
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(t) for t in out]


def _encode_many(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    if not texts:
        return []
    out = tokenizer(list(texts), add_special_tokens=False)
    ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
    return [[int(t) for t in row] for row in ids]


def _lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _lcs(a: str, b: str, limit: int) -> int:
    """Longest common suffix, at most ``limit`` characters."""
    if limit <= 0:
        return 0
    return _lcp(a[len(a) - limit :][::-1], b[len(b) - limit :][::-1])


def _excerpt(text: str, at: int) -> str:
    lo = max(0, at - _CONTEXT_CHARS)
    return repr(text[lo:at]) + " | " + repr(text[at : at + _CONTEXT_CHARS])


def _variants(message: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Two copies of ``message`` with every non-empty payload field replaced by a sentinel.

    The two sentinels of a field differ in their first and last character, so the renderings'
    common prefix and suffix stop exactly at the payload. Returns both copies and the sentinel
    strings of the first copy (to check that the template renders each at most once).
    """
    a, b = copy.deepcopy(dict(message)), copy.deepcopy(dict(message))
    sentinels: list[str] = []
    counter = 0

    def pair() -> tuple[str, str]:
        nonlocal counter
        counter += 1
        s = f"Qecholoss{counter}sentinelQ"
        sentinels.append(s)
        return s, f"Zecholoss{counter}sentinelZ"

    for key in _TEXT_FIELDS:
        value = message.get(key)
        if isinstance(value, str) and value:
            a[key], b[key] = pair()
        elif key == "content" and isinstance(value, Sequence) and not isinstance(value, str):
            for j, part in enumerate(value):
                if (
                    part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                    and part["text"]
                ):
                    sa, sb = pair()
                    a[key][j]["text"], b[key][j]["text"] = sa, sb
    for j, tc in enumerate(message.get("tool_calls") or []):
        fn = _call_function(tc)
        nested = fn is not tc
        targets = [(a["tool_calls"][j], b["tool_calls"][j])]
        if nested:
            targets = [(a["tool_calls"][j]["function"], b["tool_calls"][j]["function"])]
        ta, tb = targets[0]
        if isinstance(fn.get("name"), str) and fn["name"]:
            ta["name"], tb["name"] = pair()
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            ta["arguments"], tb["arguments"] = pair()
        elif isinstance(args, Mapping) and args:
            # Different keys and values whose last rendered characters differ (1 vs 2), so the
            # common suffix stops inside the arguments whatever the real values' types are.
            counter += 1
            ta["arguments"] = {f"qa{counter}": 1}
            tb["arguments"] = {f"zb{counter}": 2}
    return a, b, sentinels


@dataclass
class _CharSpans:
    start: list[int]  # [M + 1] message start offsets; start[M] = end of the last message
    body: list[tuple[int, int]]


def _locate_body(
    tokenizer: Any,
    messages: list[Mapping[str, Any]],
    k: int,
    full: str,
    *,
    tools: Any,
    add_generation_prompt: bool,
    kwargs: Mapping[str, Any],
) -> tuple[int, int] | None:
    """Character range of message ``k``'s body inside ``full``; None if it renders no body."""
    m = messages[k]
    va, vb, sentinels = _variants(m)
    if not sentinels and va == dict(m):
        return None
    what = f"the conversation with message {k}'s content replaced by a sentinel"
    renders = [
        _render(
            tokenizer,
            [*messages[:k], v, *messages[k + 1 :]],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            kwargs=kwargs,
            what=what,
            message_index=k,
        )
        for v in (va, vb)
    ]
    ra, rb = renders
    if ra == rb:
        if _has_text(m):
            raise ChatTemplateError(
                f"message {k} (role {m['role']!r}) has content but the chat template does not "
                "render it; its tokens cannot be attributed (is the role supported by this "
                "template?)",
                message_index=k,
            )
        return None
    for s in sentinels:
        if ra.count(s) > 1:
            raise ChatTemplateError(
                f"message {k} (role {m['role']!r}): the chat template renders its content "
                f"{ra.count(s)} times, so its body is not one contiguous span; echoloss cannot "
                "tell body from scaffold for this template",
                message_index=k,
            )
    pre = _lcp(ra, rb)
    suf = _lcs(ra, rb, min(len(ra), len(rb)) - pre)
    if not (
        full.startswith(ra[:pre]) and full.endswith(ra[len(ra) - suf :]) and pre <= len(full) - suf
    ):
        raise ChatTemplateError(
            f"message {k} (role {m['role']!r}): the chat template renders the text around this "
            "message's body differently when the body changes (it branches on the content), so "
            "the body cannot be delimited by rendering it with different contents",
            message_index=k,
        )
    return pre, len(full) - suf


def _locate(
    tokenizer: Any,
    messages: list[Mapping[str, Any]],
    full: str,
    *,
    tools: Any,
    add_generation_prompt: bool,
    kwargs: Mapping[str, Any],
    strict: bool,
) -> _CharSpans:
    n = len(messages)
    bodies = [
        _locate_body(
            tokenizer,
            messages,
            k,
            full,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            kwargs=kwargs,
        )
        for k in range(n)
    ]
    starts = [0]
    for k in range(1, n + 1):
        prev = messages[k - 1]
        last_end = next((b[1] for b in reversed(bodies[:k]) if b is not None), 0)
        try:
            prefix = _render(
                tokenizer,
                messages[:k],
                tools=tools,
                add_generation_prompt=False,
                kwargs=kwargs,
                what=f"messages[:{k}]",
                message_index=k - 1,
            )
        except ChatTemplateError:
            # Some templates refuse some prefixes (e.g. tools without a first user message).
            # The boundary then falls at the end of the previous body; prefix stability is still
            # checked by the next prefix that renders, and bodies come from full renders.
            starts.append(max(last_end, starts[-1]))
            continue
        s = _lcp(prefix, full)
        if (s < last_end or s < starts[-1]) and not strict:
            starts.append(max(last_end, starts[-1]))  # bodies stay exact; the boundary falls back
            continue
        if s < last_end or s < starts[-1]:
            raise ChatTemplateError(
                f"the chat template is not prefix-stable at message {k - 1} (role "
                f"{prev['role']!r}): rendered as the last message it reads {_excerpt(prefix, s)} "
                f"but inside the whole conversation {_excerpt(full, s)} (character {s}). The "
                "template renders this message differently once later messages follow (e.g. it "
                "strips reasoning from earlier turns), so tokens cannot be attributed to messages "
                "exactly. Use a prefix-stable template, or a renderer that reports attribution "
                "itself",
                message_index=k - 1,
            )
        starts.append(s)
    spans: list[tuple[int, int]] = []
    for k, body in enumerate(bodies):
        if body is None:
            spans.append((starts[k + 1], starts[k + 1]))
            continue
        if not starts[k] <= body[0] <= body[1] <= starts[k + 1]:
            raise ChatTemplateError(
                f"message {k} (role {messages[k]['role']!r}): its body (characters {body[0]} to "
                f"{body[1]}) does not lie inside its span ({starts[k]} to {starts[k + 1]}); the "
                "chat template is not prefix-stable here",
                message_index=k,
            )
        spans.append(body)
    return _CharSpans(start=starts, body=spans)


def _has_text(m: Mapping[str, Any]) -> bool:
    c = m.get("content")
    if isinstance(c, str):
        return bool(c.strip())
    if isinstance(c, Sequence):
        return any(isinstance(p.get("text"), str) and p["text"].strip() for p in c)
    return False


_MAX_SNAP_CHARS = 256


def _boundaries_exact(
    tokenizer: Any, text: str, ids: list[int], bounds: list[int]
) -> dict[int, int] | None:
    """Token index of each character bound if tokenizing the pieces between consecutive bounds
    one by one reproduces ``ids`` (then every bound is a token boundary); else None."""
    pieces = _encode_many(tokenizer, [text[a:b] for a, b in itertools.pairwise(bounds)])
    if [t for p in pieces for t in p] != ids:
        return None
    out, pos = {bounds[0]: 0}, 0
    for c, p in zip(bounds[1:], pieces, strict=True):
        pos += len(p)
        out[c] = pos
    return out


class _PrefixBoundaries:
    """Is character ``c`` of ``text`` a token boundary of ``ids``? Decided by tokenizing
    ``text[:c]`` (exact for any tokenizer whose encoding of a prefix is a prefix of the encoding
    at real boundaries); results are cached."""

    def __init__(self, tokenizer: Any, text: str, ids: list[int]) -> None:
        self.tokenizer, self.text, self.ids = tokenizer, text, ids
        self.cache: dict[int, int | None] = {0: 0, len(text): len(ids)}

    def prefetch(self, cuts: Sequence[int]) -> None:
        todo = [c for c in cuts if c not in self.cache]
        for c, p in zip(
            todo, _encode_many(self.tokenizer, [self.text[:c] for c in todo]), strict=True
        ):
            self.cache[c] = len(p) if self.ids[: len(p)] == p else None

    def __call__(self, c: int) -> int | None:
        if c not in self.cache:
            self.prefetch([c])
        return self.cache[c]

    def snap(self, c: int, step: int, limit: int) -> int | None:
        """Token index of the nearest boundary from character ``c`` moving by ``step`` (-1 or
        +1), not past character ``limit``; None if there is none."""
        while True:
            t = self(c)
            if t is not None or c == limit:
                return t
            c += step


def _token_cuts(
    tokenizer: Any,
    full: str,
    ids: list[int],
    spans: _CharSpans,
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token index of every message start, and each body's token range.

    Message boundaries must be token boundaries (else [`ChatTemplateError`][echoloss.adapters.chat.ChatTemplateError]). A body
    boundary inside a token is widened to the enclosing token boundaries: a token that holds any
    body character is body (the closing ``}}`` of tool-call arguments, say).
    """
    n = len(spans.body)
    starts = [*spans.start, len(full)]
    every = sorted({0, len(full), *starts, *(c for b in spans.body for c in b)})
    exact = _boundaries_exact(tokenizer, full, ids, every)
    if exact is not None:
        return (
            [exact[c] for c in spans.start],
            [(exact[b], exact[e]) for b, e in spans.body],
        )
    # Message boundaries first: tokenizing each message on its own, or else each prefix.
    message_bounds = sorted(set(starts))
    at = _boundaries_exact(tokenizer, full, ids, message_bounds)
    # When each message tokenizes on its own, body boundaries are searched within the message.
    whole = None if at is not None else _PrefixBoundaries(tokenizer, full, ids)
    if whole is not None:
        whole.prefetch(message_bounds)
        at = {}
        for c in message_bounds:
            t = whole(c)
            if t is None:
                k = min(spans.start.index(c) if c in spans.start else n - 1, n - 1)
                raise ChatTemplateError(
                    f"message {k} (role {messages[k]['role']!r}): the tokenizer merges text across "
                    f"the boundary between two messages (character {c}: {_excerpt(full, c)}), so "
                    "no token boundary lies there and its tokens cannot be attributed to one "
                    "message",
                    message_index=k,
                )
            at[c] = t
    bodies: list[tuple[int, int]] = []
    for k, (b, e) in enumerate(spans.body):
        lo, hi = spans.start[k], spans.start[k + 1]
        if whole is None:
            check = _PrefixBoundaries(tokenizer, full[lo:hi], ids[at[lo] : at[hi]])
            base, shift = lo, at[lo]
        else:
            check, base, shift = whole, 0, 0
        rb, re_ = b - base, e - base
        tb = check.snap(rb, -1, max(lo - base, rb - _MAX_SNAP_CHARS))
        te = tb if e == b else check.snap(re_, +1, min(hi - base, re_ + _MAX_SNAP_CHARS))
        if tb is None or te is None:
            raise ChatTemplateError(
                f"message {k} (role {messages[k]['role']!r}): no token boundary near its body "
                f"(characters {b} to {e}: {_excerpt(full, b if tb is None else e)}); its body "
                "cannot be located in tokens",
                message_index=k,
            )
        bodies.append((tb + shift, te + shift))
    return [at[c] for c in spans.start], bodies


# -- public API -------------------------------------------------------------------------------


def render_attributed(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    extra_roles: Sequence[str] = (),
    require_prefix_stability: bool = True,
) -> ChatRendering:
    """Render ``messages`` with the tokenizer's chat template and attribute every token.

    Same arguments as [`attribute`][echoloss.adapters.chat.attribute], which returns the short form of this result.

    Returns:
        [`ChatRendering`][echoloss.adapters.chat.ChatRendering] with the text, the token ids, the attribution and per-message
        token spans.

    Examples:
        >>> class CharTokenizer:  # one token per character; the template is a Python function
        ...     def apply_chat_template(self, messages, tools=None, tokenize=True,
        ...                             add_generation_prompt=False, **kw):
        ...         text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        ...         text += "<assistant>" if add_generation_prompt else ""
        ...         return [ord(c) for c in text] if tokenize else text
        ...     def __call__(self, texts, add_special_tokens=False):
        ...         return {"input_ids": [[ord(c) for c in t] for t in texts]}
        >>> r = render_attributed([{"role": "user", "content": "hi"},
        ...                        {"role": "tool", "name": "ls", "content": "a b"}], CharTokenizer())
        >>> r.text
        '<user>hi</><tool>a b</>'
        >>> [(s.role, s.start, s.body_start, s.body_end, s.end) for s in r.spans]
        [('user', 0, 6, 8, 11), ('tool', 11, 17, 20, 23)]
        >>> r.text[r.spans[1].body_start:r.spans[1].body_end]
        'a b'
    """
    kwargs = dict(chat_template_kwargs or {})
    msgs = _check_messages(messages, extra_roles)
    names = resolve_tool_names(msgs)
    full = _render(
        tokenizer,
        msgs,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        kwargs=kwargs,
        what="the conversation",
        message_index=None,
    )
    ids = _template_ids(
        tokenizer, msgs, tools=tools, add_generation_prompt=add_generation_prompt, kwargs=kwargs
    )
    [encoded] = _encode_many(tokenizer, [full])
    if encoded != ids:
        raise ChatTemplateError(
            "tokenizer(rendered_text, add_special_tokens=False) differs from "
            "apply_chat_template(tokenize=True) for this conversation; echoloss attributes the "
            "template's own token ids and needs both to agree"
        )
    spans = _locate(
        tokenizer,
        msgs,
        full,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        kwargs=kwargs,
        strict=require_prefix_stability,
    )
    n = len(msgs)
    tok_starts, tok_bodies = _token_cuts(tokenizer, full, ids, spans, msgs)
    indices = [-1] * len(ids)
    content = [False] * len(ids)
    out_spans = []
    for k in range(n):
        a, z = tok_starts[k], tok_starts[k + 1]
        b, e = tok_bodies[k]
        indices[a:z] = [k] * (z - a)
        content[b:e] = [True] * (e - b)
        out_spans.append(
            MessageSpan(
                index=k,
                role=msgs[k]["role"],
                tool_name=names[k],
                start=a,
                end=z,
                body_start=b,
                body_end=e,
            )
        )
    attribution = TokenAttribution(
        message_indices=indices,
        is_content=content,
        message_roles=[m["role"] for m in msgs],
        message_tool_names=names,
    )
    return ChatRendering(text=full, token_ids=ids, attribution=attribution, spans=tuple(out_spans))


def attribute(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    extra_roles: Sequence[str] = (),
    require_prefix_stability: bool = True,
) -> tuple[list[int], TokenAttribution]:
    """Token ids of ``messages`` under the tokenizer's chat template, and their attribution.

    Args:
        messages: chat messages (OpenAI / Hugging Face format: ``role``, ``content`` as a str, None
            or a list of ``{"type": "text", "text": ...}`` parts, optional ``tool_calls``,
            ``tool_call_id``, ``name``, ``reasoning_content``).
        tokenizer: a Hugging Face tokenizer with a chat template (duck-typed, see the module
            docstring).
        tools: tool schemas passed to the template (``apply_chat_template(tools=...)``).
        add_generation_prompt: append the generation prompt (attributed ``-1``).
        chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).
        extra_roles: roles besides system/user/assistant/tool that the template renders (e.g.
            ``"developer"``, ``"ipython"``); any other role is an error.
        require_prefix_stability: True (default): a template that renders a message differently
            once later messages follow is an error. False: message *bodies* are still exact
            (they come from renders of the whole conversation), but where the template is not
            prefix-stable the boundary between two messages falls back to the end of the earlier
            body, so trailing scaffold may be attributed to the next message. Enough for
            ``target="content"`` echo, which reads bodies only.

    Returns:
        ``(token_ids, attribution)``: ``token_ids`` ``[P]`` exactly as
        ``apply_chat_template(..., tokenize=True)`` returns them, and a
        [`echoloss.TokenAttribution`][echoloss.data.attribution.TokenAttribution] of length ``P`` with ``message_indices`` (``-1`` after
        the last message), ``is_content`` (True on message bodies), ``message_roles`` and
        ``message_tool_names`` (see [`resolve_tool_names`][echoloss.adapters.chat.resolve_tool_names]).

    Raises:
        ChatTemplateError: the template is not prefix-stable, renders a body twice, branches on
            the content, drops a message's content, or the tokenizer merges text across a
            message boundary; the error names the message.
        ValueError: unknown role, or a ``tool_call_id`` that matches no tool call.
        TypeError: malformed messages.

    Examples:
        >>> class CharTokenizer:  # one token per character; the template is a Python function
        ...     def apply_chat_template(self, messages, tools=None, tokenize=True,
        ...                             add_generation_prompt=False, **kw):
        ...         text = "".join(f"[{m['role']}]{m['content']}." for m in messages)
        ...         return [ord(c) for c in text] if tokenize else text
        ...     def __call__(self, texts, add_special_tokens=False):
        ...         return {"input_ids": [[ord(c) for c in t] for t in texts]}
        >>> ids, att = attribute([{"role": "user", "content": "ls"},
        ...                       {"role": "tool", "tool_call_id": None, "content": "ok"}],
        ...                      CharTokenizer())
        >>> "".join(chr(t) for t in ids)
        '[user]ls.[tool]ok.'
        >>> att.message_indices
        (0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1)
        >>> "".join(chr(t) for t, c in zip(ids, att.is_content) if c)
        'lsok'
    """
    r = render_attributed(
        messages,
        tokenizer,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
        extra_roles=extra_roles,
        require_prefix_stability=require_prefix_stability,
    )
    return r.token_ids, r.attribution


def _prompt_attribution(full: ChatRendering, length: int, k: int) -> TokenAttribution:
    """``full``'s attribution cut to ``length`` tokens, with messages ``>= k`` made scaffold."""
    att = full.attribution
    indices = [i if i < k else -1 for i in att.message_indices[:length]]
    content = [c and i >= 0 for c, i in zip(att.is_content[:length], indices, strict=True)]
    names = att.message_tool_names
    return TokenAttribution(
        message_indices=indices,
        is_content=content,
        message_roles=att.message_roles[:k],
        message_tool_names=None if names is None else names[:k],
    )


def _completion_end(span: MessageSpan, ids: list[int], eos: set[int], special: set[int]) -> int:
    """End of what the model emitted: the body, then the trailing scaffold up to and including
    its end-of-turn token (the tokenizer's EOS, else its first special token, e.g.
    ``<|im_end|>``, ``<|eot_id|>``); the whole message if it has neither."""
    for stops in (eos, special):
        for t in range(span.body_end, span.end):
            if ids[t] in stops:
                return t + 1
    return span.end


def steps_from_messages(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    logprobs: Sequence[Sequence[float]] | None = None,
    temperature: float = 1.0,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    extra_roles: Sequence[str] = (),
) -> list[Step]:
    """One [`echoloss.Step`][echoloss.data.interleave.Step] per assistant message of a multi-turn conversation.

    Step ``j`` (the ``j``-th assistant message, at index ``k``): the prompt is
    ``messages[:k]`` rendered with the generation prompt, with its attribution; the completion is
    the tokens the template renders for message ``k`` after that prompt, up to and including its
    end-of-turn token (the tokenizer's EOS after the body, else the first special token after
    it), or to the end of the message if it has neither.
    Feed the steps to [`echoloss.interleave`][echoloss.data.interleave]: with a prefix-stable template they merge into
    one sample whose completion region interleaves the assistant turns with the observations.

    Args:
        messages: the conversation (see [`attribute`][echoloss.adapters.chat.attribute]); at least one assistant message, and
            not as the first message.
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: tool schemas for the template.
        logprobs: the sampling logprobs of each assistant message's completion tokens, one list
            per assistant message; each must have exactly as many values as the completion has
            tokens. ``None`` fills ``0.0`` placeholders (logged once): fine for echo and for
            on-policy losses that recompute them, wrong for an importance ratio.
        temperature: sampling temperature stamped on every step.
        chat_template_kwargs: extra template variables.
        extra_roles: roles besides the standard four that the template renders.

    Returns:
        ``list[Step]``, one per assistant message; ``step.metadata["message_index"]`` is ``k``.

    Raises:
        ChatTemplateError: as [`attribute`][echoloss.adapters.chat.attribute]; or the generation prompt is not how the template
            starts the assistant message (no completion can be located).
        ValueError: no assistant message, an assistant message first, or a ``logprobs`` length
            that does not match.

    Examples:
        >>> class CharTokenizer:
        ...     def apply_chat_template(self, messages, tools=None, tokenize=True,
        ...                             add_generation_prompt=False, **kw):
        ...         text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        ...         text += "<assistant>" if add_generation_prompt else ""
        ...         return [ord(c) for c in text] if tokenize else text
        ...     def __call__(self, texts, add_special_tokens=False):
        ...         return {"input_ids": [[ord(c) for c in t] for t in texts]}
        ...     all_special_ids = [ord("|")]
        >>> steps = steps_from_messages(
        ...     [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ls"},
        ...      {"role": "tool", "name": "ls", "content": "a"},
        ...      {"role": "assistant", "content": "done"}], CharTokenizer())
        >>> ["".join(map(chr, s.completion_ids)) for s in steps]
        ['ls|', 'done|']
        >>> "".join(map(chr, steps[1].prompt_ids))
        '<user>go|<assistant>ls|<tool>a|<assistant>'
    """
    msgs = _check_messages(messages, extra_roles)
    assistant = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    if not assistant:
        raise ValueError("messages has no assistant message, so there is no step to train")
    if assistant[0] == 0:
        raise ValueError(
            "messages[0] is an assistant message: it has no prompt to condition on; start the "
            "conversation with a system or user message"
        )
    if logprobs is not None and len(logprobs) != len(assistant):
        raise ValueError(
            f"logprobs has {len(logprobs)} lists but messages has {len(assistant)} assistant "
            f"message(s) (at indices {assistant}); give one list per assistant message"
        )
    kwargs = dict(chat_template_kwargs or {})
    common = {
        "tools": tools,
        "chat_template_kwargs": kwargs,
        "extra_roles": extra_roles,
    }
    full = render_attributed(msgs, tokenizer, **common)
    special = {int(t) for t in getattr(tokenizer, "all_special_ids", None) or []}
    eos_id = getattr(tokenizer, "eos_token_id", None)
    eos = (
        set()
        if eos_id is None
        else {int(t) for t in (eos_id if isinstance(eos_id, list) else [eos_id])}
    )
    steps: list[Step] = []
    for j, k in enumerate(assistant):
        prompt = _template_ids(
            tokenizer, msgs[:k], tools=tools, add_generation_prompt=True, kwargs=kwargs
        )
        span = full.spans[k]
        if full.token_ids[: len(prompt)] == prompt and span.start <= len(prompt) <= span.body_start:
            attribution = _prompt_attribution(full, len(prompt), k)
            completion = full.token_ids[
                len(prompt) : _completion_end(span, full.token_ids, eos, special)
            ]
        else:
            # The generation prompt differs from how the full conversation renders this turn
            # (a template that rewrites history): attribute this turn on its own.
            head = render_attributed(msgs[:k], tokenizer, add_generation_prompt=True, **common)
            turn = render_attributed(msgs[: k + 1], tokenizer, **common)
            span = turn.spans[k]
            p = len(head.token_ids)
            if turn.token_ids[:p] != head.token_ids or not span.start <= p <= span.body_start:
                raise ChatTemplateError(
                    f"assistant message {k}: the generation prompt is not how the template starts "
                    "this assistant message, so its completion tokens cannot be located "
                    f"(prompt ends {_excerpt(head.text, len(head.text))}, the turn renders "
                    f"{_excerpt(turn.text, len(head.text))})",
                    message_index=k,
                )
            prompt, attribution = head.token_ids, head.attribution
            completion = turn.token_ids[p : _completion_end(span, turn.token_ids, eos, special)]
        if logprobs is None:
            warn_once(
                "chat-steps-no-logprobs",
                "echoloss: steps_from_messages got no logprobs; completion logprobs are 0.0 "
                "placeholders (fine for echo and recomputed old logprobs, wrong as the inference "
                "logprobs of an importance ratio)",
            )
            lp: list[float] = [0.0] * len(completion)
        else:
            lp = list(logprobs[j])
            if len(lp) != len(completion):
                raise ValueError(
                    f"logprobs[{j}] (assistant message {k}) has {len(lp)} values but the template "
                    f"renders that completion as {len(completion)} tokens; give one "
                    "logprob per completion token (the body and the end-of-turn token)"
                )
        steps.append(
            Step(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=lp,
                attribution=attribution,
                temperature=temperature,
                metadata={"message_index": k},
            )
        )
    return steps
