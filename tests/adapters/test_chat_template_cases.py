"""The chat adapter on the real-template behaviours that used to break it, one test each."""

from __future__ import annotations

import _real_templates as R
import pytest

import echoloss
from echoloss.adapters.chat import (
    ChatTemplateError,
    attribute,
    render_attributed,
    steps_from_messages,
)


def _tok(family: str, style: str = "llama3"):
    return R.tokenizer(family, style)


def _body(tok, r, k: int) -> str:
    att = r.attribution
    ids = [
        t
        for t, i, c in zip(r.token_ids, att.message_indices, att.is_content, strict=False)
        if c and i == k
    ]
    return tok.decode(ids)


@pytest.mark.skipif(
    not R.SHARED.is_dir(),
    reason="the expected token split comes from the tokenizer trained on every template, the "
    "shared third-party ones included; without them its merges differ and '>\\n' is two tokens",
)
def test_scaffold_token_straddling_two_tool_results_is_not_a_refusal():
    # Qwen2.5 spells </tool_response> as text: ">\n" closes one result and opens the next.
    tok = _tok("qwen2.5")
    r = render_attributed(R.agent(), tok, tools=[R.WEATHER])
    s3, s4 = r.spans[3], r.spans[4]
    between = [tok.decode([t]) for t in r.token_ids[s3.body_end : s4.body_start]]
    assert between == ['"}\n', "</", "tool", "_response", ">\n", "<tool", "_response", ">\n"]
    assert tok.decode(r.token_ids[s4.start : s4.start + 1]) == ">\n"  # goes to the later one
    assert _body(tok, r, 3) == '{"temp": 21, "sky": "sunny'  # `"}\n` mixes: scaffold
    assert _body(tok, r, 4) == "Grüße aus Rom: 14°C ☀ 你好"


@pytest.mark.parametrize("style", R.STYLES)
def test_gpt2_whitespace_runs_never_widen_a_body(style):
    # Llama 3 headers end in "\n\n": with the GPT-2 regex a prefix ending there tokenizes
    # differently; bodies must still be exactly the trimmed contents.
    tok = _tok("llama-3.1", style)
    msgs = R.chat(system=True)
    r = render_attributed(msgs, tok)
    for k, m in enumerate(msgs):
        assert _body(tok, r, k) == m["content"].strip()
        before = r.token_ids[r.spans[k].body_start - 1]
        assert not r.attribution.is_content[r.spans[k].body_start - 1]
        assert tok.decode([before]).endswith("\n")


def test_tool_name_repeated_in_each_result_header_is_scaffold():
    # gpt-oss writes "<|start|>functions.get_weather to=assistant" before every tool result.
    tok = _tok("gpt-oss")
    msgs = R.edge()
    r = render_attributed(msgs, tok, require_prefix_stability=False)
    s2 = r.spans[2]
    header = tok.decode(r.token_ids[s2.start : s2.body_start])
    assert "functions.get_weather" in header
    assert not any(r.attribution.is_content[s2.start : s2.body_start])
    assert _body(tok, r, 4) == '[1, {\\"a\\": \\"}}\\"}]\\n\\n'  # JSON-escaped by the template


def test_special_token_boundaries_are_never_cut():
    # DeepSeek V3.1 closes consecutive tool outputs with special tokens; Phi-3.5 ends with
    # <|endoftext|> where the next turn starts <|user|>: every boundary is a token boundary.
    for family in ("deepseek-v3.1", "phi-3.5"):
        tok = _tok(family)
        f = R.BY_NAME[family]
        msgs, tools, _ = R.scenario(f, "agent")
        r = render_attributed(msgs, tok, tools=tools)
        specials = set(tok.all_special_ids) | {
            i for i, t in tok.added_tokens_decoder.items() if t.special
        }
        for s in r.spans[1:]:
            assert 0 < s.start < len(r.token_ids)
        # every special token is attributed whole to one message (ids are the template's)
        assert any(t in specials for t in r.token_ids)
        assert r.token_ids == tok.apply_chat_template(
            msgs, tools=tools, tokenize=True, return_dict=False
        )


def test_system_prompt_folded_into_the_first_user_turn_keeps_its_role():
    tok = _tok("gemma-3")
    msgs = R.chat(system=True)
    r = render_attributed(msgs, tok)  # prefix-stable: no error
    assert r.text.startswith("<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>")
    # "." shares its token with the "\n\n" separator (Llama-3 split regex): scaffold.
    assert _body(tok, r, 0) == "Be brief"
    assert _body(tok, r, 1) == "hi"
    assert r.attribution.message_roles[0] == "system"


def test_system_prompt_in_the_last_user_turn_is_displaced_not_lost():
    tok = _tok("mistral-v0.3")
    msgs = [*R.chat(system=True)[:4]]  # system, user, assistant, user: rendered with the last
    with pytest.raises(ChatTemplateError, match="not prefix-stable at message 1") as e:
        attribute(msgs, tok)
    assert "steps_from_messages" in str(e.value)
    r = render_attributed(msgs, tok, require_prefix_stability=False)
    assert _body(tok, r, 0) == "Be brief"  # "." shares a token with "\n\n"
    s0, s3 = r.spans[0], r.spans[3]
    assert (s0.start, s0.end) == (s0.body_start, s0.body_end)  # a body inside message 3's turn
    assert s3.start < s0.start < s0.end < s3.end
    assert set(r.attribution.message_indices[s0.start : s0.end]) == {0}


def test_not_prefix_stable_template_gets_per_generation_steps():
    # Qwen3 writes an empty <think></think> only on the last assistant turn.
    tok = _tok("qwen3")
    msgs = R.chat()
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        attribute(msgs, tok)
    steps = steps_from_messages(msgs, tok, logprobs=None)
    for s, k in zip(steps, (1, 3), strict=True):
        assert s.prompt_ids == tok.apply_chat_template(
            msgs[:k], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert tok.decode(s.completion_ids) == (
            f"<think>\n\n</think>\n\n{msgs[k]['content']}<|im_end|>"
        )
    # The second prompt does not extend the first step: two samples, nothing mixed up.
    samples = echoloss.interleave(
        steps, echo=echoloss.EchoConfig(user=echoloss.RoleEcho(alpha=0.1))
    )
    assert len(samples) == 2


@pytest.mark.parametrize("family", ["hermes-3", "deepseek-r1-distill", "command-r-plus"])
def test_generation_prompt_that_differs_from_the_rendered_turn(family):
    tok = _tok(family)
    f = R.BY_NAME[family]
    msgs, tools, _ = R.scenario(f, "agent")
    steps = steps_from_messages(msgs, tok, tools=tools)
    for s in steps:
        k = s.metadata["message_index"]
        assert s.prompt_ids == tok.apply_chat_template(
            msgs[:k], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        text = tok.decode(s.completion_ids)
        rendered = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
        if msgs[k]["content"] and msgs[k]["content"] in rendered:
            assert msgs[k]["content"] in text
        assert s.completion_ids[-1] == tok.eos_token_id or s.completion_ids[-1] in {
            i for i, t in tok.added_tokens_decoder.items() if t.special
        }


@pytest.mark.parametrize(("family", "end"), [("granite-3.3", "<|end_of_text|>"),
                                             ("smollm3", "<|im_end|>")])  # fmt: skip
def test_empty_assistant_body_stops_at_its_end_of_turn(family, end):
    tok = _tok(family)
    msgs = [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Now say hi."},
        {"role": "assistant", "content": "hi"},
    ]
    steps = steps_from_messages(msgs, tok, logprobs=None)
    assert tok.decode(steps[0].completion_ids) == end
    assert tok.decode(steps[1].completion_ids) == f"hi{end}"


def test_control_token_text_in_a_tool_result_follows_the_policy(caplog):
    tok = _tok("qwen2.5")
    msgs = R.control(R.BY_NAME["qwen2.5"])  # the tool result spells <|im_end|>
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    template_ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    with caplog.at_level("WARNING", logger="echoloss"):
        ids, att = attribute(msgs, tok)  # default: exclude, warned once
    assert ids == template_ids
    assert "<|im_end|>" in caplog.text and "never echoed" in caplog.text
    body = [
        t for t, i, c in zip(ids, att.message_indices, att.is_content, strict=False) if c and i == 2
    ]
    assert im_end not in body and tok.decode(body) == "before  after"
    with pytest.raises(ChatTemplateError, match=r"message 2 \(role 'tool'\) contains") as e:
        attribute(msgs, tok, control_tokens="error")
    assert e.value.message_index == 2
    ids, att = attribute(msgs, tok, control_tokens="escape")
    # the control text is encoded as ordinary text, as transformers' sanitizing does
    assert ids == tok.apply_chat_template(
        msgs, tokenize=True, return_dict=False, sanitize_control_tokens=True
    )
    body = [
        t for t, i, c in zip(ids, att.message_indices, att.is_content, strict=False) if c and i == 2
    ]
    assert im_end not in body and tok.decode(body) == "before <|im_end|> after"
    with pytest.raises(ValueError, match="control_tokens must be one of"):
        attribute(msgs, tok, control_tokens="keep")


def test_renders_do_not_grow_with_the_conversation(monkeypatch):
    """Linear time by construction: the number of whole-conversation renders is a constant."""
    tok = _tok("qwen2.5")
    calls: list[int] = []
    real = type(tok).apply_chat_template

    def counting(self, conversation, *a, **kw):
        calls.append(len(conversation))
        return real(self, conversation, *a, **kw)

    monkeypatch.setattr(type(tok), "apply_chat_template", counting)
    counts = []
    for rounds in (2, 20):
        msgs = R.agent()[:1]
        for _ in range(rounds):
            msgs += R.agent()[1:6]
        calls.clear()
        attribute(msgs, tok, tools=[R.WEATHER])
        counts.append(
            (len([c for c in calls if c == len(msgs)]), max(c for c in calls if c < len(msgs)))
        )
    # the same number of whole renders, and prefix renders only of the first rounds
    assert counts[0][0] == counts[1][0] <= 4
    assert counts[1][1] <= 11


def test_control_tokens_the_template_writes_inside_arguments_are_not_the_message_s():
    # GLM-4.6 renders mapping arguments as <arg_key>k</arg_key><arg_value>v</arg_value>: those
    # control tokens are scaffold written by the template, so even the strict policy passes.
    tok = _tok("glm-4.6")
    msgs, tools, _ = R.scenario(R.BY_NAME["glm-4.6"], "agent")
    r = render_attributed(msgs, tok, tools=tools, control_tokens="error")
    arg_value = tok.convert_tokens_to_ids("<arg_value>")
    assert arg_value in r.token_ids
    flags = zip(r.token_ids, r.attribution.is_content, strict=True)
    assert not any(c for t, c in flags if t == arg_value)
    assert _body(tok, r, 3) == '{"temp": 21, "sky": "sunny'  # `"}\n` mixes with scaffold
