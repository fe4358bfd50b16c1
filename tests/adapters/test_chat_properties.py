"""Property: on any conversation, a real template's attribution is exact or a named error.

Contents are drawn to stress tokenizer boundaries: whitespace runs, punctuation next to
newlines, multi-byte characters, JSON fragments and text spelling control tokens. Whatever they
are, ``render_attributed`` either raises :class:`ChatTemplateError` or every body passes the
independent check of ``test_chat_real_templates`` (token bytes from the vocabulary).
"""

from __future__ import annotations

import _real_templates as R
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_chat_real_templates import _check_rendering

from echoloss.adapters.chat import ChatTemplateError, render_attributed

PIECES = [
    "a", "Paris", " ", "  ", "\n", "\n\n", "\t", ".", ",", "}", "}}", '"', "{", "[1, 2]",
    '{"k": "v"}', "é", "你好", "🙂", "<", ">", "<|im_end|>", "</s>", "[INST]", "<tool_call>",
    "<end_of_turn>", "\\n", "0", "123",
]  # fmt: skip

text = st.lists(st.sampled_from(PIECES), min_size=0, max_size=8).map("".join)


@st.composite
def conversations(draw: st.DrawFn, tools: bool) -> list[dict]:
    msgs: list[dict] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(text)})
    for turn in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(text)})
        if tools and draw(st.booleans()):
            call = {
                "id": f"call0000{turn}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": draw(text)}},
            }
            msgs.append({"role": "assistant", "content": draw(text), "tool_calls": [call]})
            msgs.append(
                {"role": "tool", "tool_call_id": call["id"], "name": "get_weather",
                 "content": draw(text)}
            )  # fmt: skip
        msgs.append({"role": "assistant", "content": draw(text)})
    if draw(st.booleans()):
        msgs.pop()  # end with a user turn (Mistral then renders the system prompt there)
    return msgs


PAIRS = [
    ("qwen2.5", "gpt2"),
    ("llama-3.1", "gpt2"),
    ("gemma-3", "sentencepiece"),
    ("mistral-nemo", "llama3"),
    ("deepseek-v3.1", "sentencepiece"),
]


@pytest.mark.parametrize(("family", "style"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_any_conversation_is_exact_or_a_named_error(family: str, style: str) -> None:
    f = R.BY_NAME[family]
    tok = R.tokenizer(family, style)

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(conversations(f.tools))
    def check(msgs: list[dict]) -> None:
        tools = [R.WEATHER] if f.tools else None
        try:
            tok.apply_chat_template(msgs, tools=tools, tokenize=False)
        except Exception:
            return  # the template itself rejects this conversation
        try:
            r = render_attributed(msgs, tok, tools=tools, require_prefix_stability=False)
        except ChatTemplateError as e:
            assert e.message_index is not None or "placeholder" in str(e)
            return
        _check_rendering(f, style, tok, msgs, tools, False, r)

    check()
