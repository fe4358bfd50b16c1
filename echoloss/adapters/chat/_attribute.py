"""Attribute every token of a rendered conversation to a message, body or scaffold."""

from __future__ import annotations

import bisect
import functools
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from echoloss import TokenAttribution
from echoloss._logging import warn_once
from echoloss.adapters.chat._errors import ChatTemplateError, excerpt
from echoloss.adapters.chat._messages import (
    Field,
    check_messages,
    message_fields,
    resolve_tool_names,
)
from echoloss.adapters.chat._slots import Slots, field_value, locate_slots
from echoloss.adapters.chat._tokenizer import (
    Decoder,
    Renderer,
    control_ids,
    encode,
    encode_plain,
    is_hf_tokenizer,
)

ControlTokens = Literal["exclude", "error", "escape"]
CONTROL_TOKEN_POLICIES: tuple[str, ...] = ("exclude", "error", "escape")


@dataclass(frozen=True)
class MessageSpan:
    """Where one message lies in the rendered token ids (token indices, end exclusive).

    ``start <= body_start <= body_end <= end``: ``[start, body_start)`` is leading scaffold (role
    header), ``[body_start, body_end)`` holds the body tokens (``is_content``; separators
    between an assistant's content and its tool calls inside it are scaffold),
    ``[body_end, end)`` trailing scaffold (end-of-turn tokens, separators). ``body_start ==
    body_end`` when no token of the message is body (empty content). A message whose body the
    template renders inside another message's turn (a system prompt folded into a later user
    turn) has ``start == body_start`` and ``end == body_end``; that span lies inside the other
    message's span.
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
        token_ids: ``[P]`` the template's own token ids for it (with
            ``control_tokens="escape"``, control tokens inside bodies encoded as text).
        attribution: [`echoloss.TokenAttribution`][echoloss.data.attribution.TokenAttribution] parallel to ``token_ids``.
        spans: one [`MessageSpan`][echoloss.adapters.chat.MessageSpan] per message, in order.
    """

    text: str
    token_ids: list[int]
    attribution: TokenAttribution
    spans: tuple[MessageSpan, ...]


# -- message regions (characters) -------------------------------------------------------------


def _lcp_from(a: str, b: str, at: int, limit: int) -> int:
    """End of the common prefix of ``a`` and ``b`` starting at ``at`` (which both share), at
    most ``limit``."""
    n = min(len(a), len(b), limit)
    lo, hi = at, n
    if a[at:n] == b[at:n]:
        return n
    while hi - lo > 1:  # a[at:lo] == b[at:lo], a[at:hi] != b[at:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _in_order(hulls: Sequence[tuple[int, int] | None]) -> set[int]:
    """Messages whose bodies appear in message order: the longest increasing run of body
    positions. The others are *displaced* (rendered inside a later message's turn)."""
    idx = [k for k, h in enumerate(hulls) if h is not None]
    tails: list[int] = []  # tails[L] = body start of the last message of the best run of L + 1
    tail_at: list[int] = []
    prev: dict[int, int] = {}
    for k in idx:
        s = hulls[k][0]  # type: ignore[index]
        pos = bisect.bisect_left(tails, s)
        prev[k] = tail_at[pos - 1] if pos else -1
        if pos == len(tails):
            tails.append(s)
            tail_at.append(k)
        else:
            tails[pos], tail_at[pos] = s, k
    keep: set[int] = set()
    k = tail_at[-1] if tail_at else -1
    while k >= 0:
        keep.add(k)
        k = prev[k]
    return keep


@dataclass
class _Regions:
    order: list[int]  # messages in rendering order (displaced ones excluded)
    start: list[int]  # character where each of them starts
    end: int  # where the last one ends (the generation prompt follows)
    displaced: set[int]


def _regions(
    msgs: Sequence[Mapping[str, Any]],
    hulls: Sequence[tuple[int, int] | None],
    full: str,
    renderer: Renderer,
    *,
    add_generation_prompt: bool,
    strict: bool,
) -> _Regions:
    """Split the rendering into message regions.

    Message ``b`` starts where the rendering of ``messages[:b]`` stops agreeing with the whole
    rendering, searched only in the scaffold gap between the previous body and ``b``'s body. The
    split of a gap is rendered once per kind of gap (its text and the roles around it) and
    reused, which keeps the cost linear in the conversation length.
    """
    n = len(msgs)
    ordered = _in_order(hulls)
    displaced = {k for k in range(n) if hulls[k] is not None and k not in ordered}
    order = [k for k in range(n) if k not in displaced]
    last_body = max((hulls[k][1] for k in ordered), default=0)  # type: ignore[index]
    end = len(full)
    if add_generation_prompt:
        bare = renderer.text(msgs, False, what="the conversation without the generation prompt")
        end = max(_lcp_from(bare, full, 0, len(full)), last_body)
    # For each position in `order`: body end of the latest earlier message with a body, and body
    # start of the first later (or this) message with one.
    before: list[int] = []
    run = 0
    for k in order:
        before.append(run)
        if hulls[k] is not None:
            run = hulls[k][1]  # type: ignore[index]
    after: list[int] = [end] * len(order)
    nxt = end
    for i in range(len(order) - 1, -1, -1):
        h = hulls[order[i]]
        if h is not None:
            nxt = h[0]
        after[i] = nxt
    starts = [0]
    cache: dict[tuple[Any, ...], int] = {}
    for i in range(1, len(order)):
        b = order[i]
        lo, hi = max(before[i], starts[-1]), after[i]
        if hi < lo:
            raise ChatTemplateError(
                f"message {b} (role {msgs[b]['role']!r}): its body starts before the previous "
                "message's body ends; the chat template interleaves the two messages",
                message_index=b,
            )
        # The messages between the previous body and the next one share this gap.
        p = i - 1
        while p > 0 and hulls[order[p]] is None:
            p -= 1
        q = i
        while q < len(order) - 1 and hulls[order[q]] is None:
            q += 1
        key = (full[lo:hi], tuple(msgs[order[x]]["role"] for x in range(p, q + 1)), i - p)
        if key not in cache:
            cache[key] = (
                _split(msgs, b, full, lo, hi, renderer, strict=strict, regions=starts, order=order)
                - lo
            )
        starts.append(min(lo + cache[key], hi))
    return _Regions(order=order, start=starts, end=end, displaced=displaced)


def _tail_split(prefix: str, full: str, lo: int, hi: int) -> int:
    """Where the earlier message ends when the template is not prefix-stable: as far into the
    gap as the prefix rendering's own ending reaches (what the template writes after the
    earlier message when it is the last one, aligned on the body's last character); the gap's
    start if they do not align."""
    ctx = 1 if lo > 0 else 0
    best = lo
    for x in range(lo + 1, hi + 1):
        if prefix.endswith(full[lo - ctx : x]):
            best = x
    return best


def _split(
    msgs: Sequence[Mapping[str, Any]],
    b: int,
    full: str,
    lo: int,
    hi: int,
    renderer: Renderer,
    *,
    strict: bool,
    regions: Sequence[int],
    order: Sequence[int],
) -> int:
    """Where message ``b`` starts inside the gap ``full[lo:hi]``."""
    try:
        prefix = renderer.text(msgs[:b], False, what=f"messages[:{b}]", message_index=b - 1)
    except ChatTemplateError:
        # Some templates refuse some prefixes (tools without a first user message): the earlier
        # message then ends with its body.
        return lo
    if prefix.startswith(full[:lo]):
        return _lcp_from(prefix, full, lo, hi)
    if full.startswith(prefix):
        # The template renders part of the earlier message only once a later one follows
        # (Gemma 3 folds the system prompt into the first user turn): stable, and the earlier
        # message ends with its body.
        return lo
    if not strict:
        return _tail_split(prefix, full, lo, hi)
    at = _lcp_from(prefix, full, 0, lo)
    k = order[max(0, bisect.bisect_right(list(regions), at) - 1)]
    raise ChatTemplateError(
        f"the chat template is not prefix-stable at message {k} (role {msgs[k]['role']!r}): "
        f"with messages[:{b}] it renders {excerpt(prefix, at)} but inside the whole "
        f"conversation {excerpt(full, at)} (character {at}). The template renders earlier "
        "messages differently once later messages follow (it strips reasoning, or moves the "
        "system prompt), so this rendering is not what the model saw at each turn. For "
        "training turns use steps_from_messages (it renders each turn's prompt as the model "
        "saw it); to attribute this rendering as it is, pass require_prefix_stability=False",
        message_index=k,
    )


# -- tokens -----------------------------------------------------------------------------------


def _owners(
    spans: Sequence[tuple[int, int]],
    regions: _Regions,
    slots: Slots,
    slot_message: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:
    """Per token: its message (``-1`` after the last message) and the body slot it lies in
    (``-1``: scaffold); and the token where each region of ``regions.order`` starts.

    A token belongs to the region holding its last character, so a scaffold token straddling
    two messages (``>\\n`` between two tool results, a special token the prefix rendering
    replaces) goes to the later one; a token that mixes a body with scaffold is scaffold of the
    body's message. A token is body only when it lies entirely inside a body. Token ranges come
    from binary searches over the offsets, so the cost is one pass over the tokens."""
    n = len(spans)
    starts = [s for s, _ in spans]
    ends = list(itertools.accumulate((e for _, e in spans), max))
    lasts = [max(e - 1, s) for s, e in zip(starts, ends, strict=True)]
    owner = [-1] * n
    slot_of = [-1] * n
    region_tok = [bisect.bisect_left(lasts, c) for c in regions.start]
    stop = bisect.bisect_left(lasts, regions.end)
    for r, k in enumerate(regions.order):
        lo = region_tok[r]
        hi = region_tok[r + 1] if r + 1 < len(region_tok) else stop
        if hi > lo:
            owner[lo:hi] = [k] * (hi - lo)
    empty = {t for t, (s, e) in enumerate(spans) if s == e}
    for j in range(len(slots.start)):
        if not slots.first[j]:
            continue
        a, z, k = slots.start[j], slots.end[j], slot_message[j]
        if k not in regions.displaced:
            # tokens crossing the slot's edges: scaffold of the body's message
            for c in (a, z - 1):
                t = bisect.bisect_right(starts, c) - 1
                if 0 <= t < n and (starts[t] < a or ends[t] > z) and ends[t] > c:
                    owner[t] = k
        lo = bisect.bisect_left(starts, a)
        hi = bisect.bisect_right(ends, z)
        if hi > lo:
            owner[lo:hi] = [k] * (hi - lo)
            slot_of[lo:hi] = [j] * (hi - lo)
    for t in empty:
        slot_of[t] = -1
    return owner, slot_of, region_tok


def _trim_shared(spans: Sequence[tuple[int, int]], content: list[bool]) -> None:
    """A content token sharing a character with a neighbouring scaffold token (a byte-level
    token holding part of a multi-byte character) becomes scaffold too."""
    changed = True
    while changed:
        changed = False
        for t in range(len(spans)):
            if not content[t]:
                continue
            if (t > 0 and not content[t - 1] and spans[t - 1][1] > spans[t][0]) or (
                t + 1 < len(spans) and not content[t + 1] and spans[t + 1][0] < spans[t][1]
            ):
                content[t] = False
                changed = True


def _warn_tokenless_bodies(
    full: str,
    slots: Slots,
    slot_message: Sequence[int],
    slot_of: Sequence[int],
    content: Sequence[bool],
    msgs: Sequence[Mapping[str, Any]],
) -> None:
    """Warn (once) when a body has no token of its own: every token holding it also holds
    scaffold or another body, so none of it can be echoed."""
    covered = {sl for sl, c in zip(slot_of, content, strict=True) if c}
    for j in range(len(slots.start)):
        text = full[slots.start[j] : slots.end[j]]
        if slots.first[j] and j not in covered and text.strip():
            k = slot_message[j]
            warn_once(
                "chat-body-without-tokens",
                f"echoloss: message {k} (role {msgs[k]['role']!r}): its body {text[:40]!r} has no "
                "token of its own (each token holding it also holds scaffold or another "
                "message), so none of it is body or echoed",
            )
            return


def _runs(content: Sequence[bool], slot_of: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    t = 0
    n = len(content)
    while t < n:
        if not content[t]:
            t += 1
            continue
        u = t + 1
        while u < n and content[u] and slot_of[u] == slot_of[t]:
            u += 1
        out.append((t, u))
        t = u
    return out


def _verify(
    tokenizer: Any,
    full: str,
    ids: Sequence[int],
    spans: Sequence[tuple[int, int]],
    runs: Sequence[tuple[int, int]],
    owner: Sequence[int],
    msgs: Sequence[Mapping[str, Any]],
) -> None:
    """Every run of body tokens decodes to exactly the text its offsets point at, up to what a
    SentencePiece tokenizer cannot tell apart (`Decoder.expected`)."""
    if not runs:
        return
    decoder = Decoder(tokenizer)
    decoded = decoder([list(ids[a:b]) for a, b in runs])
    for (a, b), text in zip(runs, decoded, strict=True):
        want = decoder.expected(full, ids[a:b], spans[a:b])
        if text != want:
            k = owner[a]
            raise ChatTemplateError(
                f"message {k} (role {msgs[k]['role']!r}): its body tokens {a}:{b} decode to "
                f"{text[:60]!r} but the tokenizer's offsets place them on {want[:60]!r}; the "
                "tokenizer's offset_mapping does not describe its tokens, so the body cannot be "
                "proven. Use the tokenizer's fast (Rust) implementation",
                message_index=k,
            )


def _control_hits(
    tokenizer: Any,
    ids: Sequence[int],
    owner: Sequence[int],
    content: list[bool],
    msgs: Sequence[Mapping[str, Any]],
    policy: str,
    template_written: Callable[[int, str], bool],
) -> dict[int, str]:
    """Body tokens that are control tokens (token index → its text), after applying the
    ``"error"`` policy and the warning of ``"exclude"``. ``template_written`` are body tokens
    the template itself wrote (GLM's ``</arg_key>`` inside arguments given as a mapping): they
    are made scaffold without a policy."""
    controls = control_ids(tokenizer)
    hits = {t: controls[ids[t]] for t in range(len(ids)) if content[t] and ids[t] in controls}
    for t in [t for t in hits if template_written(t, hits[t])]:
        del hits[t]
        content[t] = False
    if not hits:
        return hits
    t0 = min(hits)
    k = owner[t0]
    where = (
        f"message {k} (role {msgs[k]['role']!r}) contains the text {hits[t0]!r}, which the "
        f"tokenizer encodes as its control token {ids[t0]}"
    )
    if policy == "error":
        raise ChatTemplateError(
            f"{where}; a model trained to predict it learns to emit a control token. Pass "
            "control_tokens='exclude' (kept in the ids, never echoed) or 'escape' (encoded as "
            "ordinary text), or clean the message",
            message_index=k,
        )
    if policy == "exclude":
        warn_once(
            "chat-control-token-in-body",
            f"echoloss: {where}; such tokens stay in the ids but are not body, so they are "
            "never echoed (control_tokens='escape' encodes them as text instead, 'error' "
            "refuses)",
        )
    return hits


def _in_mapping_arguments(
    slot_of: Sequence[int],
    slots: Slots,
    flat: Sequence[Field],
    msgs: Sequence[Mapping[str, Any]],
    t: int,
    text: str,
) -> bool:
    """Token ``t`` (control text ``text``) lies in tool-call arguments given as a mapping, and
    the arguments do not spell it: the template wrote it (its key/value separators)."""
    field = flat[slots.field[slot_of[t]]]
    if field.kind != "args":
        return False
    return text not in json.dumps(field_value(msgs, field), ensure_ascii=False, default=str)


def _escaped(
    tokenizer: Any,
    ids: Sequence[int],
    owner: Sequence[int],
    content: Sequence[bool],
    controls: Mapping[int, str],
) -> tuple[list[int], list[int], list[bool]]:
    """Each control token inside a body replaced by its text encoded as ordinary text (body)."""
    new_ids: list[int] = []
    new_owner: list[int] = []
    new_content: list[bool] = []
    for t, tid in enumerate(ids):
        if t in controls:
            plain = encode_plain(tokenizer, controls[t])
            new_ids += plain
            new_owner += [owner[t]] * len(plain)
            new_content += [True] * len(plain)
        else:
            new_ids.append(tid)
            new_owner.append(owner[t])
            new_content.append(content[t])
    return new_ids, new_owner, new_content


def _message_spans(
    msgs: Sequence[Mapping[str, Any]],
    names: Sequence[str | None],
    owner: Sequence[int],
    content: Sequence[bool],
    regions: _Regions,
    region_tok: Sequence[int],
) -> tuple[MessageSpan, ...]:
    n = len(msgs)
    first = [-1] * n
    last = [-1] * n
    body_first = [-1] * n
    body_last = [-1] * n
    for t, k in enumerate(owner):
        if k < 0:
            continue
        if first[k] < 0:
            first[k] = t
        last[k] = t
        if content[t]:
            if body_first[k] < 0:
                body_first[k] = t
            body_last[k] = t
    region_at = dict(zip(regions.order, region_tok, strict=True))
    out = []
    for k in range(n):
        if first[k] < 0:
            a = z = region_at.get(k, 0)
        else:
            a, z = first[k], last[k] + 1
        if body_first[k] < 0:
            b = e = z
        else:
            b, e = body_first[k], body_last[k] + 1
        if k in regions.displaced:
            a, z = b, e
        out.append(
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
    return tuple(out)


def render_attributed(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    extra_roles: Sequence[str] = (),
    require_prefix_stability: bool = True,
    control_tokens: ControlTokens = "exclude",
) -> ChatRendering:
    """Render ``messages`` with the tokenizer's chat template and attribute every token.

    Same arguments as [`attribute`][echoloss.adapters.chat.attribute], which returns the short form of this result.

    Returns:
        [`ChatRendering`][echoloss.adapters.chat.ChatRendering] with the text, the token ids ``[P]``, the attribution and
        per-message token spans.

    Examples:
        >>> class CharTokenizer:  # one token per character; the template is a Python function
        ...     def apply_chat_template(self, messages, tools=None, tokenize=True,
        ...                             add_generation_prompt=False, **kw):
        ...         text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        ...         text += "<assistant>" if add_generation_prompt else ""
        ...         return [ord(c) for c in text] if tokenize else text
        ...     def __call__(self, text, add_special_tokens=False, **kw):
        ...         return {"input_ids": [ord(c) for c in text],
        ...                 "offset_mapping": [(i, i + 1) for i in range(len(text))]}
        ...     def decode(self, ids, **kw):
        ...         return "".join(map(chr, ids))
        >>> r = render_attributed([{"role": "user", "content": "hi"},
        ...                        {"role": "tool", "name": "ls", "content": "a b"}], CharTokenizer())
        >>> r.text
        '<user>hi</><tool>a b</>'
        >>> [(s.role, s.start, s.body_start, s.body_end, s.end) for s in r.spans]
        [('user', 0, 6, 8, 11), ('tool', 11, 17, 20, 23)]
        >>> r.text[r.spans[1].body_start:r.spans[1].body_end]
        'a b'
    """
    return _render_attributed(
        messages,
        tokenizer,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs,
        extra_roles=extra_roles,
        require_prefix_stability=require_prefix_stability,
        control_tokens=control_tokens,
    )


def _render_attributed(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    extra_roles: Sequence[str] = (),
    require_prefix_stability: bool = True,
    control_tokens: ControlTokens = "exclude",
    strict_missing: bool = True,
) -> ChatRendering:
    """[`render_attributed`][echoloss.adapters.chat.render_attributed]; ``strict_missing=False`` warns instead of raising when the
    template leaves a message's content out (the per-generation steps render partial
    conversations, where Mistral v0.3 leaves the system prompt out by design)."""
    if control_tokens not in CONTROL_TOKEN_POLICIES:
        raise ValueError(
            f"control_tokens must be one of {CONTROL_TOKEN_POLICIES}, got {control_tokens!r}"
        )
    msgs = check_messages(messages, extra_roles)
    names = resolve_tool_names(msgs)
    renderer = Renderer(tokenizer, tools, chat_template_kwargs or {})
    full = renderer.text(msgs, add_generation_prompt)
    fields: list[list[Field]] = []
    count = 0
    for k, m in enumerate(msgs):
        fields.append(message_fields(m, k, count))
        count += len(fields[-1])
    slots = locate_slots(
        msgs,
        fields,
        full,
        lambda ms: renderer.text(ms, add_generation_prompt),
        strict_missing=strict_missing,
    )
    flat = [f for fs in fields for f in fs]
    slot_message = [flat[fid].message for fid in slots.field]
    hulls: list[tuple[int, int] | None] = [None] * len(msgs)
    for j, k in enumerate(slot_message):
        if slots.first[j]:
            h = hulls[k]
            hulls[k] = (slots.start[j], slots.end[j]) if h is None else (h[0], slots.end[j])
    regions = _regions(
        msgs,
        hulls,
        full,
        renderer,
        add_generation_prompt=add_generation_prompt,
        strict=require_prefix_stability,
    )
    ids, spans = encode(tokenizer, full)
    if not is_hf_tokenizer(tokenizer):
        expected = renderer.template_ids(msgs, add_generation_prompt)
        if expected != ids:
            raise ChatTemplateError(
                "tokenizer(rendered_text, add_special_tokens=False) differs from "
                "apply_chat_template(tokenize=True) for this conversation; echoloss attributes "
                "the template's own token ids and needs both to agree"
            )
    owner, slot_of, region_tok = _owners(spans, regions, slots, slot_message)
    content = [s >= 0 for s in slot_of]
    _trim_shared(spans, content)
    _warn_tokenless_bodies(full, slots, slot_message, slot_of, content, msgs)
    controls = _control_hits(
        tokenizer,
        ids,
        owner,
        content,
        msgs,
        control_tokens,
        functools.partial(_in_mapping_arguments, slot_of, slots, flat, msgs),
    )
    for t in controls:
        content[t] = False
    _verify(tokenizer, full, ids, spans, _runs(content, slot_of), owner, msgs)
    if control_tokens == "escape" and controls:
        ids, owner, content = _escaped(tokenizer, ids, owner, content, controls)
    if len(ids) != len(spans):  # escaped: region starts move with the inserted tokens
        region_tok = _retarget(region_tok, owner, regions.order)
    attribution = TokenAttribution(
        message_indices=tuple(owner),
        is_content=tuple(content),
        message_roles=tuple(str(m["role"]) for m in msgs),
        message_tool_names=tuple(names),
    )
    out_spans = _message_spans(msgs, names, owner, content, regions, region_tok)
    return ChatRendering(text=full, token_ids=ids, attribution=attribution, spans=out_spans)


def _retarget(region_tok: Sequence[int], owner: Sequence[int], order: Sequence[int]) -> list[int]:
    firsts: dict[int, int] = {}
    for t, k in enumerate(owner):
        firsts.setdefault(k, t)
    return [firsts.get(k, region_tok[i]) for i, k in enumerate(order)]


def attribute(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    extra_roles: Sequence[str] = (),
    require_prefix_stability: bool = True,
    control_tokens: ControlTokens = "exclude",
) -> tuple[list[int], TokenAttribution]:
    """Token ids of ``messages`` under the tokenizer's chat template, and their attribution.

    Args:
        messages: chat messages (OpenAI / Hugging Face format: ``role``, ``content`` as a str, None
            or a list of ``{"type": "text", "text": ...}`` parts, optional ``tool_calls``,
            ``tool_call_id``, ``name``, ``reasoning_content``).
        tokenizer: a Hugging Face (fast) tokenizer with a chat template (duck-typed: see
            ``docs/adapters.md``).
        tools: tool schemas passed to the template (``apply_chat_template(tools=...)``).
        add_generation_prompt: append the generation prompt (attributed ``-1``).
        chat_template_kwargs: extra template variables (e.g. ``{"enable_thinking": False}``).
        extra_roles: roles besides system/user/assistant/tool that the template renders (e.g.
            ``"developer"``, ``"ipython"``); any other role is an error.
        require_prefix_stability: True (default): a template that renders an earlier message
            differently once later messages follow (Qwen3, Mistral v0.3 with a system prompt) is
            an error, because this rendering is then not what the model saw at each turn (use
            [`steps_from_messages`][echoloss.adapters.chat.steps_from_messages]). False: attribute this rendering as it is; bodies stay
            exact, and where the template is unstable a message's trailing scaffold is
            attributed to the next message.
        control_tokens: what to do with a control token (``<|im_end|>``, ``<tool_call>``) that a
            message body spells and the tokenizer encodes as that token: ``"exclude"``
            (default: it stays in the ids, is not body, and is never echoed; warned once),
            ``"error"``, or ``"escape"`` (encoded as ordinary text; the ids then differ from
            ``apply_chat_template``'s).

    Returns:
        ``(token_ids, attribution)``: ``token_ids`` ``[P]`` exactly as
        ``apply_chat_template(..., tokenize=True)`` returns them, and a
        [`echoloss.TokenAttribution`][echoloss.data.attribution.TokenAttribution] of length ``P`` with ``message_indices`` (``-1`` after
        the last message), ``is_content`` (True on body tokens, each proven to decode to the
        message's rendered text), ``message_roles`` and ``message_tool_names`` (see
        [`resolve_tool_names`][echoloss.adapters.chat.resolve_tool_names]).

    Raises:
        ChatTemplateError: the template is not prefix-stable (with the default), renders a body
            twice, branches on the content, or drops a message's content; the error names the
            message, the cause and the fix.
        ValueError: unknown role, a ``tool_call_id`` that matches no tool call, or an unknown
            ``control_tokens`` policy.
        TypeError: malformed messages, or a tokenizer without offsets.

    Examples:
        >>> class CharTokenizer:  # one token per character; the template is a Python function
        ...     def apply_chat_template(self, messages, tools=None, tokenize=True,
        ...                             add_generation_prompt=False, **kw):
        ...         text = "".join(f"[{m['role']}]{m['content']}." for m in messages)
        ...         return [ord(c) for c in text] if tokenize else text
        ...     def __call__(self, text, add_special_tokens=False, **kw):
        ...         return {"input_ids": [ord(c) for c in text],
        ...                 "offset_mapping": [(i, i + 1) for i in range(len(text))]}
        ...     def decode(self, ids, **kw):
        ...         return "".join(map(chr, ids))
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
        control_tokens=control_tokens,
    )
    return r.token_ids, r.attribution
