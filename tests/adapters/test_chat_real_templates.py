"""The chat adapter on real published chat templates × three tokenizer styles × conversations.

Every attributed body is checked independently of the adapter: token bytes are recomputed from
the vocabulary (byte-level table, SentencePiece pieces and byte fallback), the message content is
located in the rendered bytes in the forms a template writes it (as is, trimmed, JSON-escaped),
and then every token inside that occurrence must be body (unless it is a control token the
policy excludes, or part of a character a boundary token shares), and no token crossing its
border or outside it may be body.
"""

from __future__ import annotations

import json

import _real_templates as R
import pytest

import echoloss
from echoloss.adapters.chat import ChatTemplateError, render_attributed, steps_from_messages

CASES = [(f.name, style) for f in R.FAMILIES for style in R.STYLES]


def _byte_table() -> dict[str, int]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTES = _byte_table()


def token_bytes(tok, style: str, ids: list[int]) -> list[bytes]:
    """Each token's bytes from the vocabulary alone (no decoder, no offsets)."""
    added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
    out = []
    for i, piece in zip(ids, tok.convert_ids_to_tokens(ids), strict=True):
        if i in added:
            out.append(added[i].encode())
        elif style == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("▁", " ").encode())
        else:
            out.append(bytes(_BYTES[c] for c in piece))
    return out


def _forms(text: str) -> list[bytes]:
    forms = {text, text.strip(), json.dumps(text)[1:-1], json.dumps(text, ensure_ascii=False)[1:-1]}
    forms |= {json.dumps(text.strip())[1:-1], json.dumps(text.strip(), ensure_ascii=False)[1:-1]}
    return sorted((f.encode() for f in forms if f.strip()), key=len, reverse=True)


def _char_boundary(data: bytes, at: int) -> bool:
    return at <= 0 or at >= len(data) or (data[at] & 0xC0) != 0x80


def check_body(tok, style, r, k: int, text: str, *, controls: set[int]) -> None:
    """Message ``k``'s content ``text`` is attributed exactly (see the module docstring)."""
    ids, att = r.token_ids, r.attribution
    pieces = token_bytes(tok, style, ids)
    data = b"".join(pieces)
    if data != r.text.encode():  # a SentencePiece prefix space on the very first piece
        assert data[1:] == r.text.encode() and pieces[0].startswith(b" ")
        pieces[0] = pieces[0][1:]
        data = data[1:]
    starts = [0]
    for p in pieces:
        starts.append(starts[-1] + len(p))
    mine = [t for t in range(len(ids)) if att.message_indices[t] == k and att.is_content[t]]
    owned = [t for t in range(len(ids)) if att.message_indices[t] == k]
    lo = starts[owned[0]] if owned else 0
    hi = starts[owned[-1] + 1] if owned else len(data)
    anchor = starts[mine[0]] if mine else None
    # The content in one of the forms a template writes it, at the body tokens: the first
    # occurrence that satisfies every rule (a trimmed form can also be found one scaffold
    # character early, e.g. "\na" when the template wrote "\n\n" + "a").
    problems = []
    for form in _forms(text):
        at = data.find(form, max(0, (anchor if anchor is not None else lo) - len(form)))
        while 0 <= at <= (anchor if anchor is not None else hi):
            if anchor is None or at <= anchor < at + len(form):
                problem = _occurrence_problem(
                    att, ids, pieces, starts, data, k, text, at, at + len(form), mine, controls
                )
                if problem is None:
                    return
                problems.append(problem)
            at = data.find(form, at + 1)
    raise AssertionError(
        f"message {k}: content {text!r} is not attributed exactly: {problems or 'not found'}"
    )


def _occurrence_problem(att, ids, pieces, starts, data, k, text, a, z, mine, controls):
    """Why the content occurrence ``data[a:z]`` is not exactly message ``k``'s body, or None."""
    for t in range(len(ids)):
        s, e = starts[t], starts[t + 1]
        if e <= a or s >= z or s == e:
            continue
        inside = a <= s and e <= z
        if not inside:
            if att.is_content[t]:
                return f"token {t} crosses the body border"
            continue
        if att.is_content[t]:
            if att.message_indices[t] != k:
                return f"token {t} is body of message {att.message_indices[t]}"
            continue
        # An inside token may be scaffold only as an excluded control token, or as part of a
        # character whose other bytes sit in a border-crossing token.
        split_char = not _char_boundary(data, s) or not _char_boundary(data, e)
        if not (ids[t] in controls or split_char):
            return f"token {t} {pieces[t]!r} lies inside the content but is not body"
    # No body token of this message outside the content (other fields excepted by the caller).
    for t in mine:
        if not (a <= starts[t] and starts[t + 1] <= z):
            return f"body token {t} lies outside the content"
    return None


def _check_rendering(f, style, tok, msgs, tools, gen, r) -> None:
    ids = tok.apply_chat_template(
        msgs, tools=tools, add_generation_prompt=gen, tokenize=True, return_dict=False
    )
    assert r.token_ids == ids
    att = r.attribution
    assert len(att) == len(ids)
    assert att.message_roles == tuple(m["role"] for m in msgs)
    # Added tokens the template writes, except whitespace ones (Gemma's vocabulary adds "\n" and
    # runs of spaces as tokens: text, in bodies too)
    controls = set(tok.all_special_ids) | {
        i
        for i, t in tok.added_tokens_decoder.items()
        if t.content in tok.chat_template and not t.content.isspace()
    }
    for k, m in enumerate(msgs):
        text = m.get("content")
        if not isinstance(text, str) or not text.strip():
            continue
        if m.get("tool_calls"):
            continue  # content and calls form several bodies; the calls are checked below
        if not any(i == k for i in att.message_indices):
            continue  # the template leaves this message out (warned)
        check_body(tok, style, r, k, text, controls=controls)
    # Tool-call bodies never contain control tokens or role headers.
    for t, (i, c) in enumerate(zip(att.message_indices, att.is_content, strict=True)):
        if c:
            assert i >= 0 and ids[t] not in controls
    tail = [t for t, i in enumerate(att.message_indices) if i == -1]
    assert tail == list(range(len(ids) - len(tail), len(ids)))  # only a suffix is unattributed
    if gen:
        bare = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
        if r.text != bare:  # the template has a generation prompt: it is the unattributed tail
            assert tail and r.text.endswith(tok.decode([ids[t] for t in tail]))
    else:
        assert not tail


@pytest.mark.parametrize(("family", "style"), CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_real_template_attribution(family: str, style: str) -> None:
    f = R.BY_NAME[family]
    tok = R.tokenizer(family, style)  # skips with the reason when the template is absent
    for name in R.SCENARIOS:
        msgs, tools, gen = R.scenario(f, name)
        try:
            tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False)
        except Exception as e:  # the template itself refuses (Gemma 2 has no system role)
            with pytest.raises(ChatTemplateError, match="failed to render the conversation") as err:
                render_attributed(msgs, tok, tools=tools, add_generation_prompt=gen)
            assert str(e) in str(err.value)  # the template's own message is passed on
            continue
        try:
            render_attributed(msgs, tok, tools=tools, add_generation_prompt=gen)
        except ChatTemplateError as e:
            assert not f.stable, f"{family}/{name}: {e}"
            assert "not prefix-stable" in str(e) or "does not render it in this" in str(e)
            assert e.message_index is not None
        try:
            r = render_attributed(
                msgs, tok, tools=tools, add_generation_prompt=gen, require_prefix_stability=False
            )
        except ChatTemplateError as e:
            # Only a template that leaves a message with content out entirely.
            assert "does not render it in this conversation" in str(e), f"{family}/{name}: {e}"
            continue
        _check_rendering(f, style, tok, msgs, tools, gen, r)


@pytest.mark.parametrize(("family", "style"), CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_real_template_steps(family: str, style: str) -> None:
    f = R.BY_NAME[family]
    check_steps(f, R.tokenizer(family, style))


def check_steps(f: R.Family, tok) -> int:
    """`steps_from_messages` on the training conversations ``f``'s template renders: every
    prompt is exactly what the model saw, every completion its turn up to the end-of-turn
    token. Returns how many conversations were checked."""
    eos = {tok.eos_token_id}
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    family = f.name
    checked = 0
    for name in ("agent", "chat_system", "edge"):
        msgs, tools, _ = R.scenario(f, name)
        try:
            tok.apply_chat_template(msgs, tools=tools, tokenize=False)
        except Exception:
            continue
        steps = steps_from_messages(msgs, tok, tools=tools)
        assistant = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
        assert [s.metadata["message_index"] for s in steps] == assistant
        for s, k in zip(steps, assistant, strict=True):
            # The prompt is exactly what the model saw for this turn.
            assert s.prompt_ids == tok.apply_chat_template(
                msgs[:k], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            c = s.completion_ids
            assert c, f"{family}/{name}: empty completion for message {k}"
            # It ends with the end-of-turn token and never runs into the next message.
            assert c[-1] in special or not f.end_of_turn, f"{family}/{name}: {tok.decode(c)!r}"
            assert not any(t in eos for t in c[:-1]), f"{family}/{name}: {tok.decode(c)!r}"
            body = msgs[k]["content"].strip()
            if body and body in tok.apply_chat_template(msgs, tools=tools, tokenize=False):
                assert body in tok.decode(c)
            bare = tok.apply_chat_template(msgs[:k], tools=tools, tokenize=False)
            prompted = tok.apply_chat_template(
                msgs[:k], tools=tools, tokenize=False, add_generation_prompt=True
            )
            header = prompted[len(bare) :] if prompted.startswith(bare) else ""
            if header.strip():  # the generation prompt is in the prompt, not the completion
                text = tok.decode(c)
                before_body = text[: text.find(body)] if body and body in text else text[:1]
                assert header not in before_body and not text.startswith(header), text
            if k + 1 < len(msgs) and msgs[k + 1]["content"].strip():
                assert msgs[k + 1]["content"].strip() not in tok.decode(c)
        cfg = echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=0.5))
        assert echoloss.interleave(steps, echo=cfg)
        checked += 1
    return checked


def support_table() -> str:
    """The support table of ``docs/adapters.md``, measured: per family and tokenizer style, how
    many of the conversations the template renders are attributed exactly (independent check)
    with ``require_prefix_stability=False``, and what the default ``attribute`` says."""
    lines = [
        "| family | `attribute` (default) | " + " | ".join(R.STYLES) + " |",
        "|---|---|" + "---|" * len(R.STYLES),
    ]
    for f in R.available():
        verdicts: set[str] = set()
        cells = []
        for style in R.STYLES:
            tok = R.tokenizer(f.name, style)
            exact = tried = 0
            for name in R.SCENARIOS:
                msgs, tools, gen = R.scenario(f, name)
                try:
                    tok.apply_chat_template(
                        msgs, tools=tools, add_generation_prompt=gen, tokenize=False
                    )
                except Exception:
                    verdicts.add("the template rejects some conversations")
                    continue
                tried += 1
                try:
                    render_attributed(msgs, tok, tools=tools, add_generation_prompt=gen)
                except ChatTemplateError as e:
                    verdicts.add(
                        "not prefix-stable" if "prefix-stable" in str(e) else "message left out"
                    )
                try:
                    r = render_attributed(
                        msgs,
                        tok,
                        tools=tools,
                        add_generation_prompt=gen,
                        require_prefix_stability=False,
                    )
                except ChatTemplateError:
                    continue
                _check_rendering(f, style, tok, msgs, tools, gen, r)
                exact += 1
            cells.append(f"{exact}/{tried} exact")
        verdict = "; ".join(sorted(verdicts)) or "exact"
        lines.append(f"| {f.name} | {verdict} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/adapters/test_chat_real_templates.py
    import logging

    logging.disable(logging.WARNING)
    print(support_table())
