"""Local tokenizers and real chat templates for the adapter tests (no hub downloads).

``byte_tokenizer`` is a byte-level BPE without merges: every byte is one token whose id is the byte
value, and special tokens get ids from 256 up, so expected token ids can be written down exactly.
``bpe_tokenizer`` is a byte-level BPE trained on a small corpus (real merges).
"""

from __future__ import annotations

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

# ChatML with tools in the Qwen2.5 style: tool schemas in the system turn, tool calls as JSON in
# <tool_call> tags, consecutive tool results grouped in one user turn of <tool_response> blocks.
CHATML_TOOLS = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Llama 3: header tokens, content trimmed, <|eot_id|> after every turn.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Llama 3.1 with JSON tool calling: tools in the first user turn, tool results as ipython turns
# (string results rendered with tojson), one tool call per assistant turn.
LLAMA31_TOOLS = r"""{{- bos_token }}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# A Qwen3-style template that shows reasoning only on assistant turns after the last user turn:
# earlier turns render differently once a later user turn exists (not prefix-stable).
REASONING_STRIPPING = r"""{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'assistant' and loop.index0 > ns.last_user %}
        {{- '<|im_start|>assistant\n<think>\n' + (message.reasoning_content or '') + '\n</think>\n\n' + message.content + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (what the ByteLevel pre-tokenizer emits)."""
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
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def _wrap(tok: Tokenizer, specials: list[str], template: str, *, bos: str | None, eos: str):
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=specials[0],
        additional_special_tokens=[s for s in specials if s not in (bos, eos, specials[0])],
    )
    hf.chat_template = template
    return hf


def byte_tokenizer(template: str, specials: list[str], *, bos: str | None = None, eos: str):
    """Byte-level tokenizer without merges: byte ``b`` is token ``b``; specials are 256, 257, ..."""
    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return _wrap(tok, specials, template, bos=bos, eos=eos)


_CORPUS = [
    "What is the weather in Paris today? Let me check the weather for you.",
    "The temperature in Paris is 21 degrees and sunny.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "total 8 drwxr-xr-x a.txt b.txt README.md",
    "You are a helpful assistant. Given the following functions, respond with JSON.",
] * 20


def bpe_tokenizer(template: str, specials: list[str], *, bos: str | None = None, eos: str):
    """Byte-level BPE with real merges, trained on a small fixed corpus (deterministic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return _wrap(tok, specials, template, bos=bos, eos=eos)


def metaspace_tokenizer(template: str, specials: list[str], *, bos: str | None = None, eos: str):
    """SentencePiece-style: a ``▁`` is prepended to the start of every encoded text, so texts
    tokenized piece by piece do not concatenate to the whole text's tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False)
    alphabet = '\n <>|/_-.,:?!{}"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ#'
    tok.train_from_iterator([*_CORPUS, alphabet], trainer=trainer)
    return _wrap(tok, specials, template, bos=bos, eos=eos)


def chatml(kind: str = "byte"):
    make = {"byte": byte_tokenizer, "bpe": bpe_tokenizer, "metaspace": metaspace_tokenizer}[kind]
    return make(CHATML_TOOLS, CHATML_SPECIALS, eos="<|im_end|>")


def llama3(template: str = LLAMA3, kind: str = "byte"):
    make = byte_tokenizer if kind == "byte" else bpe_tokenizer
    return make(template, LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def tool_conversation() -> list[dict]:
    """System, user, an assistant with two tool calls, two tool results (the second without a
    ``name``, resolved through its ``tool_call_id``), a final assistant answer."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21C sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
        {"role": "assistant", "content": "Paris 21C, Rome 14:05."},
    ]
