"""Span-restricted echo (`echoloss.span_echo_filter`): echo only the characters a selector marks,
through real chat templates and the trainer's tokenizer; the rest of each observation leaves the
target but stays in ``Z = |O|``."""

from __future__ import annotations

import random

import _real_templates as R
import pytest

import echoloss
from echoloss.adapters.chat import render_attributed
from echoloss.data.spans import span_token_mask


def _placebo_case():
    from echoloss.train.data import scripted_steps
    from echoloss.train.envs import MirrorGrid, MirrorTask
    from echoloss.train.model import build_tokenizer

    tok = build_tokenizer(compass=True)
    env = MirrorGrid(size=4, variant="noise", words="compass")
    msgs = env.random_walk(MirrorTask((1, 2), (3, 0), (True, False)), random.Random(0), turns=5)
    return tok, env, msgs, scripted_steps(msgs, tok)


def test_placebo_echoes_exactly_the_digits_and_keeps_z():
    tok, env, msgs, steps = _placebo_case()
    echo = echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=0.05))
    only = echoloss.span_echo_filter(msgs, env.noise_spans, decode=tok.decode)
    full = echoloss.interleave(steps, echo=echo)
    narrow = echoloss.interleave(steps, echo=echo, echo_filter=only)
    assert len(full) == len(narrow) == 1
    ids = full[0].token_ids
    echoed = [ids[k] for k, w in enumerate(narrow[0].token_echo_weights()) if w]
    digits = [msgs[i]["content"][-1] for i in sorted(env.noise_spans(msgs))]
    assert [tok.decode([t]) for t in echoed] == digits  # one echoed token per observation
    assert all(w == 0.05 for w in narrow[0].token_echo_weights() if w)
    # the observation bodies still count in Z = |O|, exactly as without the filter
    assert narrow[0].token_observation_mask() == full[0].token_observation_mask()
    assert sum(full[0].token_observation_mask()) > 5 * len(digits)
    # the hidden-word selector picks the compass words, the same positions the trainer probes
    from echoloss.train.data import hidden_token_positions

    hidden = echoloss.interleave(
        steps,
        echo=echo,
        echo_filter=echoloss.span_echo_filter(msgs, env.hidden_spans, decode=tok.decode),
    )[0]
    _, positions = hidden_token_positions(msgs, tok, env.hidden_spans(msgs))
    assert [k for k, w in enumerate(hidden.token_echo_weights()) if w] == positions


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3.1", "gemma-3"])
def test_spans_through_real_chat_templates(family):
    """A byte-level BPE (and SentencePiece for gemma) tokenizer with the family's real chat
    template: the kept tokens decode to exactly the selected characters of the tool message."""
    style = "sentencepiece" if family.startswith("gemma") else "llama3"
    tok = R.tokenizer(family, style)
    msgs = [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": "run ls"},
        {"role": "tool", "content": "a.txt b.txt; exit 0"},
    ]
    if family.startswith("gemma"):  # gemma's template has no tool role: the result as a user turn
        msgs[2] = {"role": "user", "content": msgs[2]["content"]}
    r = render_attributed(msgs, tok)
    text = msgs[2]["content"]
    lo = text.index("exit")
    try:
        mask = span_token_mask(
            r.token_ids, r.attribution, msgs, {2: (lo, len(text))}, decode=tok.decode
        )
    except ValueError as err:  # a tokenizer may merge across the boundary: that must be named
        assert "across the span" in str(err) or "decode to" in str(err)
        mask = span_token_mask(
            r.token_ids, r.attribution, msgs, {2: (0, len(text))}, decode=tok.decode
        )
        lo = 0
    kept = [t for t, m in zip(r.token_ids, mask, strict=True) if m]
    assert tok.decode(kept) == text[lo:]
    if family == "llama-3.1":  # its template JSON-escapes tool results: a newline becomes "\\n",
        msgs[2] = {"role": "tool", "content": "a.txt\nexit 0"}  # the body no longer IS the
        r = render_attributed(msgs, tok)  # content, and character spans cannot be placed
        with pytest.raises(ValueError, match="decode to 13 characters, its content has 12"):
            span_token_mask(r.token_ids, r.attribution, msgs, {2: (0, 1)}, decode=tok.decode)


def test_bad_spans_are_errors_naming_the_problem():
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    msgs = [{"role": "tool", "content": "east 7"}]
    att = {"message_indices": [0] * 6, "is_content": [True] * 6, "message_roles": ["tool"]}
    ids = [ord(c) for c in "east 7"]
    assert span_token_mask(ids, att, msgs, {0: [(0, 4), (5, 6)]}, decode=decode) == [
        True, True, True, True, False, True,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="ends past its content"):
        span_token_mask(ids, att, msgs, {0: (5, 9)}, decode=decode)
    with pytest.raises(ValueError, match="0 <= lo < hi"):
        span_token_mask(ids, att, msgs, {0: (3, 3)}, decode=decode)
    two = lambda ids: "".join(chr(i) * 2 for i in ids)  # noqa: E731  (tokens of two characters)
    with pytest.raises(ValueError, match="decode to 12 characters"):
        span_token_mask(ids, att, msgs, {0: (0, 2)}, decode=two)
    wide = [ord("e")] * 3  # three tokens of two characters: "eeeeee" against a 6-char content
    msgs6 = [{"role": "tool", "content": "eeeeee"}]
    att3 = {"message_indices": [0] * 3, "is_content": [True] * 3, "message_roles": ["tool"]}
    with pytest.raises(ValueError, match="across the span"):
        span_token_mask(wide, att3, msgs6, {0: (1, 3)}, decode=two)
    no_content = {"message_indices": [0] * 6, "is_content": [], "message_roles": ["tool"]}
    with pytest.raises(ValueError, match="no is_content"):
        span_token_mask(ids, no_content, msgs, {0: (0, 1)}, decode=decode)
    with pytest.raises(ValueError, match="message index 3"):
        echoloss.span_echo_filter(msgs, lambda m: {3: (0, 1)}, decode=decode)
    with pytest.raises(TypeError, match="mapping"):
        echoloss.span_echo_filter(msgs, lambda m: [(0, 1)], decode=decode)
    step = echoloss.Step(prompt_ids=ids, completion_ids=[1], completion_logprobs=[0.0])
    with pytest.raises(ValueError, match="no attribution"):
        echoloss.span_echo_filter(msgs, lambda m: {0: (0, 1)}, decode=decode)([step])
