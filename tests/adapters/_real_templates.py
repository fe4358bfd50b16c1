"""Real published chat templates with locally trained tokenizers of three styles (no hub).

Templates are read where they live: the installed ``trl`` package (``trl/chat_templates/``) and
``<repo>/../shared/chat-templates/`` (third-party files, never copied into the repository).
Tokenizers are trained here, once per style and cached for the session, on text taken from the
templates themselves (so scaffold merges such as ``>\\n``, ``}}`` and ``\\n\\n`` exist); each
template's special tokens are added as special tokens:

- ``llama3``: byte-level BPE with the Llama-3 / Qwen2 split regex (how real models tokenize);
- ``sentencepiece``: Metaspace + BPE with byte fallback (Llama-2 / Mistral / Gemma style);
- ``gpt2``: byte-level BPE with the GPT-2 split regex, where a run of two or more whitespace
  characters tokenizes differently at the end of a string (the adversarial case).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "chat-templates"
STYLES = ("llama3", "sentencepiece", "gpt2")

# The Llama-3 split regex (Qwen2's differs only in \p{N} vs \p{N}{1,3}).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def trl_templates_dir() -> Path:
    import trl

    return Path(os.path.dirname(trl.__file__)) / "chat_templates"


@dataclass(frozen=True)
class Family:
    """One published template: where it is, its special tokens, BOS/EOS."""

    name: str
    file: str  # in ../shared/chat-templates/
    trl_file: str | None  # the same file in trl/chat_templates/, if TRL ships it
    specials: tuple[str, ...]
    eos: str
    bos: str | None = None
    added: tuple[str, ...] = ()  # added (non-special) tokens, e.g. <tool_call>
    tools: bool = True  # the template renders tool calls and results
    parallel: bool = True  # several tool calls in one assistant message
    string_args: bool = False  # tool-call arguments must be a JSON string
    needs_tools: bool = False  # the template fails without tool schemas
    stable: bool = True  # renders every message the same whether or not later ones follow
    end_of_turn: bool = True  # assistant turns end with a token (GLM's end at the next header)

    def source(self) -> Path | None:
        if self.trl_file is not None:
            try:
                p = trl_templates_dir() / self.trl_file
            except ImportError:  # trl not installed: the shared copy, if any
                p = SHARED / self.file
            if p.exists():
                return p
        p = SHARED / self.file
        return p if p.exists() else None


CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen2.5's vocabulary has <tool_call> tokens but spells <tool_response> as ordinary text.
QWEN25_TAGS = ("<tool_call>", "</tool_call>")
THINK = ("<think>", "</think>")
LLAMA3 = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
MISTRAL = (
    "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
)  # fmt: skip
DEEPSEEK = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>", "<｜tool▁sep｜>",
)  # fmt: skip
COHERE = (
    "<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>",
    "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
)  # fmt: skip

FAMILIES: tuple[Family, ...] = (
    Family("qwen2.5", "qwen2.5-7b-instruct.jinja", "qwen2_5.jinja", CHATML, "<|im_end|>",
           added=QWEN25_TAGS),
    Family("qwen3", "qwen3.jinja", "qwen3.jinja", CHATML, "<|im_end|>", added=QWEN_TAGS + THINK,
           stable=False),
    Family("qwen3-2507", "qwen3-instruct-2507.jinja", "qwen3_instruct_2507.jinja", CHATML,
           "<|im_end|>", added=QWEN_TAGS),
    Family("llama-3.1", "llama-3.1-8b-instruct.jinja", "llama3_1.jinja",
           (*LLAMA3, "<|eom_id|>", "<|python_tag|>"), "<|eot_id|>", bos="<|begin_of_text|>",
           parallel=False),
    Family("llama-3.2", "llama-3.2-3b-instruct.jinja", "llama3_2.jinja",
           (*LLAMA3, "<|eom_id|>", "<|python_tag|>"), "<|eot_id|>", bos="<|begin_of_text|>",
           parallel=False),
    Family("mistral-v0.3", "mistral-7b-instruct-v0.3.jinja", None, MISTRAL, "</s>", bos="<s>",
           stable=False),
    Family("mistral-nemo", "mistral-nemo-instruct-2407.jinja", None, MISTRAL, "</s>", bos="<s>",
           stable=False),
    Family("mistral-small-3.2", "mistral-small-3.2-24b-instruct-2506.jinja", None,
           (*MISTRAL, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]", "[TOOL_CONTENT]", "[IMG]"), "</s>", bos="<s>", stable=False),
    Family("gemma-2", "gemma-2-it.jinja", "gemma.jinja",
           ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<eos>", bos="<bos>",
           tools=False),
    Family("gemma-3", "gemma-3-it.jinja", "gemma3.jinja",
           ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
           "<eos>", bos="<bos>", tools=False),
    Family("deepseek-v3", "deepseek-v3.jinja", "deepseekv3.jinja", DEEPSEEK,
           "<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>", added=THINK, string_args=True),
    Family("deepseek-v3.1", "deepseek-v3.1.jinja", None, DEEPSEEK, "<｜end▁of▁sentence｜>",
           bos="<｜begin▁of▁sentence｜>", added=THINK),
    Family("deepseek-r1-distill", "deepseek-r1-distill.jinja", "deepseek_r1_distill.jinja",
           DEEPSEEK, "<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>", added=THINK),
    Family("phi-3.5", "phi-3.5-mini-instruct.jinja", "phi3_5.jinja",
           ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
           "<|endoftext|>", tools=False),
    Family("phi-4-mini", "phi-4-mini-instruct.jinja", None,
           ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>",
            "<|/tool|>"), "<|endoftext|>"),
    Family("gpt-oss", "gpt-oss.jinja", "gptoss.jinja",
           ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>",
            "<|return|>", "<|constrain|>"), "<|return|>", stable=False),
    Family("hermes-3", "hermes-3-llama-3.1-tool_use.jinja", None,
           ("<|begin_of_text|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>",
           bos="<|begin_of_text|>", added=(*QWEN_TAGS, "<tools>", "</tools>"), needs_tools=True),
    Family("glm-4.6", "glm-4.6.jinja", None,
           ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|observation|>"), "<|endoftext|>",
           added=QWEN_TAGS + THINK + ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
           end_of_turn=False),
    Family("granite-3.3", "granite-3.3-2b-instruct.jinja", None,
           ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>",
            "<|start_of_cite|>", "<|end_of_cite|>"), "<|end_of_text|>", added=THINK),
    Family("smollm3", "smollm3-3b-unsloth.jinja", None, CHATML, "<|im_end|>", added=THINK),
    Family("command-r-plus", "command-r-plus-tool_use.jinja", None, COHERE,
           "<|END_OF_TURN_TOKEN|>", bos="<BOS_TOKEN>", needs_tools=True),
    Family("command-r7b", "command-r7b-tool_use.jinja", None,
           (*COHERE, "<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>", "<|END_THINKING|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>"),
           "<|END_OF_TURN_TOKEN|>", bos="<BOS_TOKEN>"),
    Family("aya-expanse", "aya-expanse.jinja", "cohere.jinja", COHERE, "<|END_OF_TURN_TOKEN|>",
           bos="<BOS_TOKEN>", tools=False),
)  # fmt: skip

BY_NAME = {f.name: f for f in FAMILIES}


def available() -> list[Family]:
    return [f for f in FAMILIES if f.source() is not None]


def missing_reason(f: Family) -> str:
    return (
        f"chat template {f.file} is not installed in trl and {SHARED} is absent (the shared "
        "folder of third-party chat templates beside the checkout)"
    )


# -- training -------------------------------------------------------------------------------

_PROSE = [
    "What is the weather in Paris today? Let me check the weather for you.",
    "The temperature in Paris is 21 degrees and sunny. Rome is warmer.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"temp": 21, "sky": "sunny"}\n{"city": "Rome"}},\n',
    "total 8 drwxr-xr-x a.txt b.txt README.md\n\n",
    "You are a helpful assistant. Given the following functions, respond with JSON.\n\n",
    "Grüße aus Rom: 14°C ☀ 你好",
]


@functools.cache
def _corpus() -> tuple[str, ...]:
    texts = list(_PROSE) * 10
    for f in FAMILIES:
        src = f.source()
        if src is not None:
            texts += src.read_text(encoding="utf-8").splitlines(keepends=True)
    return tuple(texts)


def _byte_level(split: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def _sentencepiece() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte fallback: any character outside the vocabulary as its bytes
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    out = Tokenizer.from_str(json.dumps(spec))
    out.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return out


@functools.cache
def _base(style: str) -> str:
    """The trained tokenizer of a style, serialized (copied per template)."""
    if style == "llama3":
        return _byte_level(LLAMA3_SPLIT).to_str()
    if style == "gpt2":
        return _byte_level(None).to_str()
    if style == "sentencepiece":
        return _sentencepiece().to_str()
    raise ValueError(style)


@functools.cache
def tokenizer(name: str, style: str):
    """A transformers fast tokenizer for family ``name`` in ``style`` (cached per session)."""
    f = BY_NAME[name]
    src = f.source()
    if src is None:
        pytest.skip(missing_reason(f))
    tok = Tokenizer.from_str(_base(style))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in f.specials])
    if f.added:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in f.added])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=f.bos,
        eos_token=f.eos,
        pad_token=f.specials[0],
    )
    hf.chat_template = src.read_text(encoding="utf-8")
    return hf


# -- conversations --------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name."}},
            "required": ["city"],
        },
    },
}


def _call(i: int, city: str) -> dict:
    return {
        "id": f"call0000{i}",  # nine characters: Mistral's templates require it
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": city}},
    }


def agent(*, system: bool = True) -> list[dict]:
    """System, user, an assistant with content and two parallel calls, a JSON result and a
    unicode result, an answer, a second user turn (padded with spaces), an answer."""
    head = [{"role": "system", "content": "You are terse."}] if system else []
    return [
        *head,
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [_call(1, "Paris"),
                                                                          _call(2, "Rome")]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather",
         "content": '{"temp": 21, "sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "call00002", "name": "get_weather",
         "content": "Grüße aus Rom: 14°C ☀ 你好"},
        {"role": "assistant", "content": "Paris 21C, Rome 14C."},
        {"role": "user", "content": "  And tomorrow?  "},
        {"role": "assistant", "content": "No forecast tool."},
    ]  # fmt: skip


def chat(*, system: bool = False) -> list[dict]:
    head = [{"role": "system", "content": "Be brief."}] if system else []
    return [
        *head,
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Second question?"},
        {"role": "assistant", "content": "Second answer."},
    ]


def edge() -> list[dict]:
    """An assistant with an empty body and a call; empty, whitespace and JSON-like results."""
    return [
        {"role": "user", "content": "Run it"},
        {"role": "assistant", "content": "", "tool_calls": [_call(1, "Paris")]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "   "},
        {"role": "assistant", "content": "", "tool_calls": [_call(2, "Rome")]},
        {"role": "tool", "tool_call_id": "call00002", "name": "get_weather",
         "content": '[1, {"a": "}}"}]\n\n'},
        {"role": "assistant", "content": "done"},
    ]  # fmt: skip


def control(f: Family) -> list[dict]:
    """A tool result that spells the template's end-of-turn control token."""
    return [
        {"role": "user", "content": "Run it"},
        {"role": "assistant", "content": "ok", "tool_calls": [_call(1, "Paris")]},
        {"role": "tool", "tool_call_id": "call00001", "name": "get_weather",
         "content": f"before {f.eos} after"},
        {"role": "assistant", "content": "done"},
    ]  # fmt: skip


def without_tools(messages: list[dict]) -> list[dict]:
    """The conversation for a template without a tool role: tool turns become user turns and
    assistants' calls are dropped (consecutive user turns merged)."""
    out: list[dict] = []
    for m in messages:
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")}
        if m["role"] == "tool":
            m["role"] = "user"
        if out and out[-1]["role"] == m["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + m["content"]}
            continue
        out.append(m)
    return out


SCENARIOS = ("agent", "agent_no_system", "chat", "chat_system", "edge", "control", "generation")


def _adapt(f: Family, messages: list[dict]) -> list[dict]:
    """The conversation in the form the template accepts: one call per assistant message,
    arguments as a JSON string, or no tool turns at all."""
    if not f.tools:
        return without_tools(messages)
    out: list[dict] = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls and f.string_args:
            calls = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"]),
                    },
                }
                for c in calls
            ]
            m = {**m, "tool_calls": calls}
        if calls and not f.parallel and len(calls) > 1:
            results = {c["id"] for c in calls}
            for i, c in enumerate(calls):
                out.append({**m, "content": m["content"] if i == 0 else "", "tool_calls": [c]})
                out.append("RESULT:" + c["id"])  # placeholder: the result follows its call
            del results
            continue
        if m["role"] == "tool" and not f.parallel and ("RESULT:" + m["tool_call_id"]) in out:
            out[out.index("RESULT:" + m["tool_call_id"])] = m
            continue
        out.append(m)
    return out


def scenario(f: Family, name: str) -> tuple[list[dict], list[dict] | None, bool]:
    """``(messages, tools, add_generation_prompt)`` of a named conversation for family ``f``."""
    gen = False
    if name == "agent":
        msgs = agent()
    elif name == "agent_no_system":
        msgs = agent(system=False)
    elif name == "chat":
        msgs = chat()
    elif name == "chat_system":
        msgs = chat(system=True)
    elif name == "edge":
        msgs = edge()
    elif name == "control":
        msgs = control(f)
    elif name == "generation":
        msgs, gen = agent()[:5], True
    else:
        raise ValueError(name)
    msgs = _adapt(f, msgs)
    wants_tools = name in ("agent", "agent_no_system", "generation") or f.needs_tools
    tools = [WEATHER] if f.tools and wants_tools else None
    return msgs, tools, gen
