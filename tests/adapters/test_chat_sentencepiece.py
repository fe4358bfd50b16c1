"""Attribution on real tokenizer files: SmolLM2-135M-Instruct's byte-level BPE and Gemma 3's
SentencePiece vocabulary (from the packaged models, ``tests/_pretrained.py``), with their own and
published chat templates, checked by the independent body check of
``test_chat_real_templates.py``; and SentencePiece tokenizers that prepend ``▁`` after every
added token (Llama-2-style normalizers, ``Metaspace(prepend_scheme="always")``), whose body
tokens decode with a space the text does not have."""

from __future__ import annotations

import json

import _real_templates as R
import pytest
import test_chat_real_templates as T
from _pretrained import gemma3_tokenizer, smollm2_tokenizer

from echoloss.adapters.chat import ChatTemplateError, render_attributed

transformers = pytest.importorskip("transformers")
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers  # noqa: E402

# (base tokenizer, family whose template and control tokens are used, style for token bytes)
REAL = [
    ("smollm2", "qwen2.5", "llama3"),  # ChatML with tool calls, SmolLM2's byte-level BPE
    ("gemma3", "gemma-3", "sentencepiece"),
    ("gemma3", "gemma-2", "sentencepiece"),
    ("gemma3", "mistral-v0.3", "sentencepiece"),
]
PREPENDING = ("llama2-normalizer", "metaspace-always")


def _base(name: str):
    return {"smollm2": smollm2_tokenizer, "gemma3": gemma3_tokenizer}[name]()


def _with_family(backend: Tokenizer, f: R.Family):
    """A transformers tokenizer: ``backend`` plus the family's control tokens and template."""
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in f.specials])
    if f.added:
        backend.add_tokens([AddedToken(s, special=False, normalized=False) for s in f.added])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=f.bos, eos_token=f.eos, pad_token=f.specials[0]
    )
    src = f.source()
    if src is None:
        pytest.skip(R.missing_reason(f))
    hf.chat_template = src.read_text(encoding="utf-8")
    return hf


def _renders(tok, msgs, tools, gen) -> bool:
    try:
        tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False)
    except Exception:  # the template itself rejects the conversation (Gemma 2: no system role)
        return False
    return True


@pytest.mark.parametrize(("base", "family", "style"), REAL, ids=[f"{b}-{f}" for b, f, _ in REAL])
def test_real_tokenizer_files_attribute_exactly(base: str, family: str, style: str) -> None:
    f = R.BY_NAME[family]
    tok = _with_family(Tokenizer.from_str(_base(base).backend_tokenizer.to_str()), f)
    checked = 0
    for name in R.SCENARIOS:
        msgs, tools, gen = R.scenario(f, name)
        if not _renders(tok, msgs, tools, gen):
            continue
        try:
            r = render_attributed(
                msgs, tok, tools=tools, add_generation_prompt=gen, require_prefix_stability=False
            )
        except ChatTemplateError as e:  # Mistral v0.3 leaves the system prompt out
            assert "does not render it in this conversation" in str(e), f"{name}: {e}"
            continue
        T._check_rendering(f, style, tok, msgs, tools, gen, r)
        checked += 1
    assert checked >= 4


def test_smollm2_own_template_on_a_tool_conversation() -> None:
    """SmolLM2's ChatML ignores ``tools=``: the call is written in the assistant's content (as
    the model was trained) and the result is a ``tool`` turn; its body is exactly the result."""
    tok = smollm2_tokenizer()
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    msgs = [
        {"role": "system", "content": "You can call add(a, b)."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "add", "content": '{"result": 5}'},
        {"role": "assistant", "content": "2 + 3 = 5."},
    ]
    r = render_attributed(msgs, tok)
    for k, m in enumerate(msgs):
        body = [t for t, i in enumerate(r.attribution.message_indices) if i == k]
        body = [t for t in body if r.attribution.is_content[t]]
        assert tok.decode([r.token_ids[t] for t in body]) == m["content"], k
    assert r.token_ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)


def _prepending(kind: str) -> Tokenizer:
    """Gemma 3's vocabulary with a tokenizer front end that prepends ``▁`` to every segment,
    and the Llama-2 decoder that strips the first space of a decoded text."""
    t = Tokenizer.from_str(gemma3_tokenizer().backend_tokenizer.to_str())
    if kind == "llama2-normalizer":
        t.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        t.normalizer = None
        t.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="always", split=False
        )
    t.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return t


@pytest.mark.parametrize("kind", PREPENDING)
@pytest.mark.parametrize("family", ["mistral-v0.3", "gemma-2"])
def test_prepended_sentencepiece_space_is_handled_exactly(kind: str, family: str) -> None:
    """A body right after an added token is tokenized ``▁word`` with offsets on ``word`` alone:
    its tokens decode to `` word``. The body is still exactly the content's characters, and the
    ids are the template's own."""
    f = R.BY_NAME[family]
    tok = _with_family(_prepending(kind), f)
    # The case this test is about occurs: a token with more leading ▁ than its text has spaces
    # ("there" after the added token "\n" in Gemma's vocabulary).
    text = tok.apply_chat_template([{"role": "user", "content": "hi\nthere"}], tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    pieces = tok.convert_ids_to_tokens(enc["input_ids"])
    assert any(
        len(p) - len(p.lstrip("▁")) > len(text[a:b]) - len(text[a:b].lstrip(" "))
        for p, (a, b) in zip(pieces, enc["offset_mapping"], strict=True)
    )
    checked = 0
    for name in R.SCENARIOS:
        msgs, tools, gen = R.scenario(f, name)
        if not _renders(tok, msgs, tools, gen):
            continue
        try:
            r = render_attributed(
                msgs, tok, tools=tools, add_generation_prompt=gen, require_prefix_stability=False
            )
        except ChatTemplateError as e:
            assert "does not render it in this conversation" in str(e), f"{name}: {e}"
            continue
        assert r.token_ids == tok.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=gen, tokenize=True, return_dict=False
        )
        enc = tok(r.text, add_special_tokens=False, return_offsets_mapping=True)
        for k, m in enumerate(msgs):
            text = m.get("content")
            if not isinstance(text, str) or not text.strip() or m.get("tool_calls"):
                continue
            body = [
                t
                for t, (i, c) in enumerate(
                    zip(r.attribution.message_indices, r.attribution.is_content, strict=True)
                )
                if i == k and c
            ]
            if not body:
                continue  # a body without tokens of its own (warned)
            covered = r.text[enc["offset_mapping"][body[0]][0] : enc["offset_mapping"][body[-1]][1]]
            forms = {text, text.strip(), json.dumps(text)[1:-1], json.dumps(text.strip())[1:-1]}
            # Whole tokens inside the content: the covered text is the content or lies in it.
            assert any(covered in form for form in forms), (name, k, covered, text)
            assert covered.strip() == text.strip() or len(covered) < len(text), (name, k)
        checked += 1
    assert checked >= 3


def test_a_literal_meta_symbol_is_a_space_to_sentencepiece() -> None:
    """``▁`` (U+2581) in the text encodes like a space; the body holds it and is exact."""
    f = R.BY_NAME["gemma-3"]
    tok = _with_family(Tokenizer.from_str(gemma3_tokenizer().backend_tokenizer.to_str()), f)
    msgs = [{"role": "user", "content": "a▁b ▁c"}, {"role": "assistant", "content": "ok"}]
    r = render_attributed(msgs, tok)
    body = [
        t
        for t, (i, c) in enumerate(
            zip(r.attribution.message_indices, r.attribution.is_content, strict=True)
        )
        if i == 0 and c
    ]
    assert tok.decode([r.token_ids[t] for t in body]) == "a b  c"
