"""Chat messages + a local tokenizer's real chat template → token ids + attribution, and steps."""

from __future__ import annotations

import _templates as T
import pytest

import echoloss
from echoloss.adapters.chat import (
    ChatTemplateError,
    attribute,
    render_attributed,
    resolve_tool_names,
    steps_from_messages,
)

IM_START, IM_END = 257, 258  # byte tokenizer: specials after the 256 byte tokens
BOT, HDR, END_HDR, EOT = 256, 257, 258, 259


def b(text: str) -> list[int]:
    return list(text.encode())


def body_text(tok, r, k: int) -> str:
    s = r.spans[k]
    return tok.decode(r.token_ids[s.body_start : s.body_end])


def test_chatml_tool_conversation_roles_names_and_exact_spans():
    tok = T.chatml()
    msgs = T.tool_conversation()
    r = render_attributed(msgs, tok, tools=[T.WEATHER_TOOL])
    att = r.attribution
    assert att.message_roles == ("system", "user", "assistant", "tool", "tool", "assistant")
    # The second tool message has no `name`: resolved through tool_call_id "call_2".
    assert att.message_tool_names == (None, None, None, "get_weather", "get_time", None)
    assert [s.tool_name for s in r.spans] == list(att.message_tool_names)
    # Exact token ids of each tool message: the first opens the grouped user turn, the second
    # closes it (consecutive tool results share one <|im_start|>user ... <|im_end|>).
    s3, s4 = r.spans[3], r.spans[4]
    assert r.token_ids[s3.start : s3.end] == [
        IM_START,
        *b("user\n<tool_response>\n21C sunny\n</tool_response>"),
    ]
    assert r.token_ids[s3.body_start : s3.body_end] == b("21C sunny")
    assert r.token_ids[s4.start : s4.end] == [
        *b("\n<tool_response>\n14:05\n</tool_response>"),
        IM_END,
        *b("\n"),
    ]
    assert r.token_ids[s4.body_start : s4.body_end] == b("14:05")
    # Bodies of the other messages; the assistant body runs from its content to its last call.
    assert body_text(tok, r, 0) == "You are terse."
    assert body_text(tok, r, 1) == "Weather in Paris and Rome?"
    assert body_text(tok, r, 5) == "Paris 21C, Rome 14:05."
    assert body_text(tok, r, 2).startswith("Checking.\n<tool_call>\n")
    assert body_text(tok, r, 2).endswith('{"city": "Rome"')
    # Spans tile the whole rendering; body tokens lie inside the body ranges.
    assert r.spans[0].start == 0 and r.spans[-1].end == len(r.token_ids)
    for a, c in zip(r.spans, r.spans[1:], strict=False):
        assert a.end == c.start
    content = {k for s in r.spans for k in range(s.start, s.end) if s.body_start <= k < s.body_end}
    assert {k for k, c in enumerate(att.is_content) if c} <= content
    # Inside an assistant body only the payloads are body: content, names, arguments.
    s2 = r.spans[2]
    pieces, run = [], []
    for k in range(s2.body_start, s2.body_end):
        if att.is_content[k]:
            run.append(r.token_ids[k])
        elif run:
            pieces.append(tok.decode(run))
            run = []
    pieces.append(tok.decode(run))
    assert pieces == ["Checking.", "get_weather", 'city": "Paris"', "get_time", 'city": "Rome"']
    for s in r.spans:
        assert att.message_indices[s.start : s.end] == (s.index,) * (s.end - s.start)


def test_token_ids_are_the_templates_own_and_generation_prompt_is_unattributed():
    for kind in ("byte", "bpe"):
        tok = T.chatml(kind)
        msgs = T.tool_conversation()[:5]
        ids, att = attribute(msgs, tok, tools=[T.WEATHER_TOOL], add_generation_prompt=True)
        assert ids == tok.apply_chat_template(
            msgs, tools=[T.WEATHER_TOOL], add_generation_prompt=True, return_dict=False
        )
        assert len(att) == len(ids)
        gen = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        assert ids[-len(gen) :] == gen
        assert att.message_indices[-len(gen) :] == (-1,) * len(gen)
        assert -1 not in att.message_indices[: -len(gen)]


def test_same_conversation_without_tool_schemas():
    tok = T.chatml()
    r = render_attributed(T.tool_conversation(), tok)  # no tools: default system header
    assert body_text(tok, r, 0) == "You are terse."
    assert tok.decode(r.token_ids[r.spans[0].start : r.spans[0].end]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
    )
    assert [body_text(tok, r, k) for k in (1, 3, 4, 5)] == [
        "Weather in Paris and Rome?",
        "21C sunny",
        "14:05",
        "Paris 21C, Rome 14:05.",
    ]


def test_bpe_merges_keep_message_bodies_exact():
    tok = T.chatml("bpe")
    r = render_attributed(T.tool_conversation(), tok, tools=[T.WEATHER_TOOL])
    assert [body_text(tok, r, k) for k in (0, 1, 3, 4, 5)] == [
        "You are terse.",
        "Weather in Paris and Rome?",
        "21C sunny",
        "14:05",
        "Paris 21C, Rome 14:05.",
    ]
    # `"}}` is one token of this tokenizer: it mixes the end of the arguments with scaffold, so
    # it is scaffold (never body) and the body ends before it.
    s2 = r.spans[2]
    assert body_text(tok, r, 2).endswith('{"city": "Rome')
    assert tok.decode(r.token_ids[s2.body_end : s2.body_end + 1]) == '"}}'
    assert not r.attribution.is_content[s2.body_end]


def test_llama3_trims_content_and_bos_is_leading_scaffold_of_message_0():
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  hi  "},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "name": "ls", "content": "a.txt"},
    ]
    for kind in ("byte", "bpe"):
        tok = T.llama3(kind=kind)
        r = render_attributed(msgs, tok)
        assert [body_text(tok, r, k) for k in range(4)] == ["You are terse.", "hi", "ok", "a.txt"]
        assert r.attribution.message_tool_names == (None, None, None, "ls")
    tok = T.llama3()
    r = render_attributed(msgs, tok)
    s0, s1 = r.spans[0], r.spans[1]
    assert r.token_ids[s0.start : s0.body_start] == [BOT, HDR, *b("system"), END_HDR, *b("\n\n")]
    assert r.token_ids[s0.body_end : s0.end] == [EOT]
    assert r.token_ids[s1.start : s1.end] == [HDR, *b("user"), END_HDR, *b("\n\nhi"), EOT]


def test_llama31_tools_in_first_user_turn_and_ipython_results():
    tok = T.llama3(T.LLAMA31_TOOLS)
    conv = T.tool_conversation()
    msgs = [
        conv[0],
        conv[1],
        {"role": "assistant", "tool_calls": [conv[2]["tool_calls"][0]]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C sunny"},
        conv[5],
    ]
    r = render_attributed(msgs, tok, tools=[T.WEATHER_TOOL])
    assert r.attribution.message_tool_names == (None, None, None, "get_weather", None)
    assert body_text(tok, r, 0) == "You are terse."
    assert body_text(tok, r, 1) == "Weather in Paris and Rome?"
    # The tool result is rendered as a JSON string: the quotes are scaffold.
    s3 = r.spans[3]
    assert tok.decode(r.token_ids[s3.start : s3.end]) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"21C sunny"<|eot_id|>'
    )
    assert r.token_ids[s3.body_start : s3.body_end] == b("21C sunny")
    # The tool schemas sit in the first user turn's leading scaffold, never in a body.
    s1 = r.spans[1]
    scaffold = tok.decode(r.token_ids[s1.start : s1.body_start])
    assert '"get_weather"' in scaffold
    assert not any(r.attribution.is_content[s1.start : s1.body_start])


def test_template_that_rewrites_earlier_turns_is_an_error_naming_the_message():
    tok = T.byte_tokenizer(T.REASONING_STRIPPING, T.CHATML_SPECIALS, eos="<|im_end|>")
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r"},
        {"role": "user", "content": "c"},
    ]
    with pytest.raises(ChatTemplateError, match="not prefix-stable at message 1") as e:
        attribute(msgs, tok)
    assert e.value.message_index == 1
    # The same template is fine while no later user turn rewrites the history.
    r = render_attributed(msgs[:2], tok)
    assert body_text(tok, r, 1) == "r\n</think>\n\nb"
    # Without the requirement, bodies stay exact (from renders of the whole conversation).
    r = render_attributed(msgs, tok, require_prefix_stability=False)
    assert [body_text(tok, r, k) for k in range(3)] == ["a", "b", "c"]
    # Message 1 still ends with what the template writes after it as the last message.
    s1 = r.spans[1]
    assert tok.decode(r.token_ids[s1.body_end : s1.end]) == "<|im_end|>\n"
    assert r.spans[2].start == s1.end


def test_template_rendering_content_twice_or_not_at_all_is_an_error():
    twice = "{% for m in messages %}[{{ m.role }}]{{ m.content }}|{{ m.content }}\n{% endfor %}"
    tok = T.byte_tokenizer(twice, T.CHATML_SPECIALS, eos="<|im_end|>")
    with pytest.raises(ChatTemplateError, match="renders this value 2 times") as e:
        attribute([{"role": "user", "content": "hi"}], tok)
    assert e.value.message_index == 0
    drops_tools = (
        "{% for m in messages %}{% if m.role != 'tool' %}[{{ m.role }}]{{ m.content }}\n"
        "{% endif %}{% endfor %}"
    )
    tok = T.byte_tokenizer(drops_tools, T.CHATML_SPECIALS, eos="<|im_end|>")
    with pytest.raises(ChatTemplateError, match="does not render it") as e:
        attribute([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}], tok)
    assert e.value.message_index == 1


def test_token_merging_two_bodies_is_scaffold_of_neither(caplog):
    glued = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = T.bpe_tokenizer(glued, T.CHATML_SPECIALS, eos="<|im_end|>")
    assert tok.tokenize("Paris") == ["Paris"]
    msgs = [{"role": "user", "content": "Par"}, {"role": "tool", "content": "is"}]
    with caplog.at_level("WARNING", logger="echoloss"):
        ids, att = attribute(msgs, tok)
    assert tok.convert_ids_to_tokens(ids) == ["Paris"]
    # The token holds both bodies: it is body of neither, never silently one of them.
    assert att.is_content == (False,)
    assert "no token of its own" in caplog.text


def test_unknown_role_and_unmatched_tool_call_id_are_errors():
    tok = T.chatml()
    with pytest.raises(ValueError, match=r"messages\[1\]\.role = 'developer'.*extra_roles"):
        attribute([{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}], tok)
    dev = [{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}]
    # Llama 3 renders any role; this ChatML template silently drops roles it does not know.
    r = render_attributed(dev, T.llama3(), extra_roles=("developer",))
    assert r.attribution.message_roles == ("user", "developer")
    assert body_text(T.llama3(), r, 1) == "b"
    with pytest.raises(ChatTemplateError, match=r"message 1 .* does not render it"):
        attribute(dev, tok, extra_roles=("developer",))
    bad = [*T.tool_conversation()[:4], {"role": "tool", "tool_call_id": "call_9", "content": "x"}]
    with pytest.raises(ValueError, match=r"messages\[4\].*'call_9'.*\['call_1', 'call_2'\]"):
        attribute(bad, tok)
    with pytest.raises(ValueError, match="messages is empty"):
        attribute([], tok)
    with pytest.raises(TypeError, match=r"messages\[0\]\.content must be"):
        attribute([{"role": "user", "content": 3}], tok)


def test_resolve_tool_names_prefers_name_then_most_recent_call():
    msgs = [
        {"role": "assistant", "tool_calls": [{"id": "a", "name": "old"}]},
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "new"}}]},
        {"role": "tool", "tool_call_id": "a", "content": ""},
        {"role": "tool", "tool_call_id": "a", "name": "explicit", "content": ""},
        {"role": "tool", "content": ""},
    ]
    assert resolve_tool_names(msgs) == [None, None, "new", "explicit", None]


def test_steps_from_messages_merge_into_one_sample_with_tool_echo():
    tok = T.chatml()
    msgs = T.tool_conversation()
    steps = steps_from_messages(msgs, tok, tools=[T.WEATHER_TOOL], logprobs=None, temperature=0.8)
    assert [s.metadata["message_index"] for s in steps] == [2, 5]
    assert steps[1].completion_ids == [*b("Paris 21C, Rome 14:05."), IM_END]
    assert tok.decode(steps[0].completion_ids).endswith("</tool_call><|im_end|>")
    for s, k in zip(steps, (2, 5), strict=True):
        assert s.prompt_ids == tok.apply_chat_template(
            msgs[:k], tools=[T.WEATHER_TOOL], add_generation_prompt=True, return_dict=False
        )
        assert s.temperature == 0.8
    # The generation prompt is scaffold of no message, and message k is not in the prompt.
    att1 = steps[1].attribution
    assert att1.message_roles == ("system", "user", "assistant", "tool", "tool")
    assert att1.message_indices[-len(b("assistant\n")) - 1 :] == (-1,) * 11

    cfg = echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=0.5))
    [sample] = echoloss.interleave(steps, echo=cfg)
    assert sample.token_ids == steps[1].prompt_ids + steps[1].completion_ids
    echoed = [t for t, w in zip(sample.token_ids, sample.echo_weights, strict=True) if w]
    assert echoed == b("21C sunny") + b("14:05")
    assert {w for w in sample.echo_weights if w is not None} == {0.5}
    rl = [t for t, m in zip(sample.completion_ids, sample.completion_mask, strict=True) if m]
    assert rl == steps[0].completion_ids + steps[1].completion_ids


def test_steps_logprobs_must_match_completion_lengths():
    tok = T.chatml()
    msgs = T.tool_conversation()
    first = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n'
        "</tool_call>"
    )
    good = [[-0.1] * (len(first) + 1), [-0.2] * 23]
    steps = steps_from_messages(msgs, tok, tools=[T.WEATHER_TOOL], logprobs=good)
    assert steps[0].completion_ids == [*b(first), IM_END]
    assert [len(s.completion_ids) for s in steps] == [len(first) + 1, 23]
    assert steps[1].completion_logprobs == [-0.2] * 23
    with pytest.raises(ValueError, match=r"logprobs\[1\] \(assistant message 5\) has 3 values"):
        steps_from_messages(msgs, tok, tools=[T.WEATHER_TOOL], logprobs=[good[0], [0.0] * 3])
    with pytest.raises(ValueError, match="logprobs has 1 lists but messages has 2 assistant"):
        steps_from_messages(msgs, tok, tools=[T.WEATHER_TOOL], logprobs=[good[0]])
    with pytest.raises(ValueError, match="no assistant message"):
        steps_from_messages(msgs[:2], tok)
    with pytest.raises(ValueError, match="assistant message: it has no prompt"):
        steps_from_messages([{"role": "assistant", "content": "x"}], tok)


def test_generation_prompt_that_differs_from_the_turn_is_bridged():
    # The generation prompt opens a think block that history turns never have: the prompt is
    # what the model saw, the completion what follows it in the rendered turn.
    thinking = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    tok = T.byte_tokenizer(thinking, T.CHATML_SPECIALS, eos="<|im_end|>")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    [step] = steps_from_messages(msgs, tok, logprobs=[[0.0, 0.0]])
    assert tok.decode(step.prompt_ids).endswith("<|im_start|>assistant\n<think>\n")
    assert step.completion_ids == [*b("b"), IM_END]


def test_sentencepiece_style_tokenizer_uses_exact_prefix_boundaries():
    tok = T.chatml("metaspace")
    msgs = T.tool_conversation()
    # Piece-by-piece tokenization does not reproduce the whole (a dummy prefix per call).
    assert tok.encode("a", add_special_tokens=False) + tok.encode(
        "b", add_special_tokens=False
    ) != tok.encode("ab", add_special_tokens=False)
    r = render_attributed(msgs, tok, tools=[T.WEATHER_TOOL])
    assert r.token_ids == tok.apply_chat_template(msgs, tools=[T.WEATHER_TOOL], return_dict=False)
    assert [body_text(tok, r, k) for k in (0, 1, 3, 4, 5)] == [
        "You are terse.",
        "Weather in Paris and Rome?",
        "21C sunny",
        "14:05",
        "Paris 21C, Rome 14:05.",
    ]


def test_default_system_prompt_is_scaffold_of_the_first_message():
    tok = T.chatml()
    r = render_attributed([{"role": "user", "content": "hi"}], tok)
    [s] = r.spans
    assert tok.decode(r.token_ids[s.start : s.body_start]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    )
    assert r.token_ids[s.body_start : s.body_end] == b("hi")
    assert r.attribution.is_content == (False,) * s.body_start + (True, True) + (False,) * 2


def test_llama3_steps_end_at_the_end_of_turn_token():
    tok = T.llama3()
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    s0, s1 = steps_from_messages(msgs, tok, logprobs=[[-1.0] * 3, [-1.0] * 5])
    assert s0.completion_ids == [*b("yo"), EOT]
    assert s1.completion_ids == [*b("ciao"), EOT]
    assert tok.decode(s1.prompt_ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    [sample] = echoloss.interleave(
        [s0, s1], echo=echoloss.EchoConfig(user=echoloss.RoleEcho(alpha=0.1))
    )
    # The second user turn is an observation after the first action; the first is the task.
    assert [t for t, w in zip(sample.token_ids, sample.echo_weights, strict=True) if w] == b("bye")


def test_text_content_parts_form_one_body():
    parts = (
        "{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}\n{% endfor %}"
    )
    tok = T.byte_tokenizer(parts, T.CHATML_SPECIALS, eos="<|im_end|>")
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}],
        },
        {"role": "tool", "content": "ok"},
    ]
    r = render_attributed(msgs, tok)
    assert body_text(tok, r, 0) == "abcd"
    assert body_text(tok, r, 1) == "ok"


def test_template_branching_on_the_content_is_an_error_naming_the_message():
    # Scaffold away from the value that depends on the value cannot be told apart from it.
    branching = (
        "{% for m in messages %}{% if '!' in m.content %}[flag]{% endif %}<|im_start|>"
        "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tok = T.byte_tokenizer(branching, T.CHATML_SPECIALS, eos="<|im_end|>")
    msgs = [{"role": "user", "content": "ab"}, {"role": "tool", "content": "!1"}]
    with pytest.raises(ChatTemplateError, match=r"message 1 \(role 'tool'\) field 'content'") as e:
        attribute(msgs, tok)
    assert "branches on the content" in str(e.value)
    assert e.value.message_index == 1
    # Contents that take the same branch as the placeholders are fine.
    ids, att = attribute([msgs[0], {"role": "tool", "content": "y1"}], tok)
    assert bytes(t for t, c in zip(ids, att.is_content, strict=True) if c) == b"aby1"


def test_text_the_template_adds_next_to_the_value_is_scaffold():
    # "[!]" is written because of the content but is not the content: the body is the value.
    marking = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if '!' in m.content %}[!]"
        "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    tok = T.byte_tokenizer(marking, T.CHATML_SPECIALS, eos="<|im_end|>")
    r = render_attributed(
        [{"role": "user", "content": "ab"}, {"role": "tool", "content": "!1"}], tok
    )
    assert "[!]!1" in r.text
    assert body_text(tok, r, 1) == "!1"


def test_tokenizer_without_offsets_is_a_type_error_naming_the_need():
    class NoOffsets:
        def apply_chat_template(self, messages, tools=None, tokenize=True, **kw):
            text = "".join(m["content"] for m in messages)
            return [ord(c) for c in text] if tokenize else text

        def __call__(self, text, add_special_tokens=False, **kw):
            if kw.get("return_offsets_mapping"):
                raise NotImplementedError("return_offset_mapping is not available")
            return {"input_ids": [ord(c) for c in text]}

    with pytest.raises(TypeError, match=r"return_offsets_mapping=True.*use_fast=True"):
        attribute([{"role": "user", "content": "hi"}], NoOffsets())


def test_steps_apply_the_control_token_policy():
    tok = T.chatml()
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "name": "ls", "content": "a<|im_end|>b"},
        {"role": "assistant", "content": "done"},
    ]
    with pytest.raises(ChatTemplateError, match="control token"):
        steps_from_messages(msgs, tok, control_tokens="error")
    steps = steps_from_messages(msgs, tok)  # exclude: the ids stay the template's
    assert IM_END in steps[1].prompt_ids
    att = steps[1].attribution
    body = [t for t, i, c in zip(steps[1].prompt_ids, att.message_indices, att.is_content,
                                 strict=True) if c and i == 2]  # fmt: skip
    assert body == b("ab")


def test_a_lone_surrogate_in_a_body_is_the_messages_problem_not_the_tokenizers():
    """Bytes decoded with errors='surrogateescape' leave a lone surrogate: it was reported as a
    tokenizer that cannot encode the text; it is refused naming the message, field and index."""
    tok = T.chatml()
    convo = T.tool_conversation()
    bad = [*convo[:3], {**convo[3], "content": "ls: caf\udce9"}, *convo[4:]]
    with pytest.raises(
        ValueError, match=r"messages\[3\]\.content has a lone surrogate U\+DCE9 at index 7"
    ):
        attribute(bad, tok)
    parts = [{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]
    with pytest.raises(
        ValueError, match=r"messages\[0\]\.content\[0\]\['text'\] has a lone surrogate"
    ):
        attribute(parts, tok)
    with pytest.raises(ValueError, match=r"messages\[0\]\.reasoning_content has a lone surrogate"):
        attribute([{"role": "assistant", "content": "a", "reasoning_content": "\udfff"}], tok)
