"""``control_tokens="escape"`` escapes every token the template or tokenizer treats as markup:
special tokens and added non-special ones (``<tool_response>``, ``<think>``), which
``split_special_tokens=True`` alone does not split. Real published templates (Qwen3, Hermes-3 on
Llama 3.1, DeepSeek-V3, GLM-4.6), tokenizers of two styles with those templates' vocabularies.
"""

from __future__ import annotations

import _real_templates as R
import pytest

from echoloss.adapters.chat import attribute
from echoloss.adapters.chat._tokenizer import control_ids

FAMILIES = ["qwen3-2507", "hermes-3", "deepseek-v3", "glm-4.6"]
STYLES = ["llama3", "sentencepiece"]


def _conversation(text: str) -> list[dict]:
    return [
        {"role": "user", "content": "Run it"},
        {"role": "assistant", "content": "ok", "tool_calls": [R._call(1, "Paris")]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": text},
        {"role": "assistant", "content": "done"},
    ]


def _body(ids, att, k):
    return [
        t for t, i, c in zip(ids, att.message_indices, att.is_content, strict=False) if c and i == k
    ]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_markup_token_in_a_tool_result_is_escaped(family, style):
    f = R.BY_NAME[family]
    tok = R.tokenizer(family, style)
    controls = control_ids(tok)
    added = [a for a in f.added if tok.convert_tokens_to_ids(a) in controls]
    assert added, "the family's added markup tokens are control tokens of its template"
    text = "x " + " ".join(added) + f" {f.eos} y"
    msgs = R._adapt(f, _conversation(text))
    tools = [R.WEATHER] if f.needs_tools else None
    ids, att = attribute(msgs, tok, tools=tools, control_tokens="escape")
    k = 2
    body = _body(ids, att, k)
    assert not set(body) & set(controls), [
        tok.convert_ids_to_tokens(t) for t in body if t in controls
    ]
    # (a SentencePiece vocabulary reads a literal ▁, as in DeepSeek's markup, as a space)
    assert tok.decode(body) == (text.replace("▁", " ") if style == "sentencepiece" else text)
    # exclude keeps them out of the body (never echoed); error refuses
    ids_x, att_x = attribute(msgs, tok, tools=tools, control_tokens="exclude")
    assert not set(_body(ids_x, att_x, k)) & set(controls)
    with pytest.raises(Exception, match=r"message 2 \(role 'tool'\) contains"):
        attribute(msgs, tok, tools=tools, control_tokens="error")
