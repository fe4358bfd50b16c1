"""The model side of the trainer: a tiny local model and tokenizer, loading a real one, and the
packed forward pass.

Nothing here downloads anything. The embedded default is a random-init Qwen3- or Llama-style
causal LM built from a ``transformers`` config, with a character-level tokenizer built with
``tokenizers`` and a real Jinja chat template (ChatML in the Qwen style: tool results are
``<tool_response>`` blocks inside a user turn). Any local Hugging Face causal-LM directory can
replace both (``[model] path = "..."``).

The packed forward pass runs one row of concatenated sequences. Without FlashAttention's varlen
kernels, an HF model would let the sequences of a row attend to each other, so
`packed_attention_mask` builds the block-diagonal causal mask from ``cu_seqlens`` and passes it
as a custom 4D mask, with position ids restarting per sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHAT_TEMPLATE",
    "ModelLoadError",
    "build_tiny_model",
    "build_tokenizer",
    "describe_model",
    "load_model",
    "packed_attention_mask",
    "packed_logits",
]


class ModelLoadError(ValueError):
    """``model.path`` could not be loaded: one line naming the path and the problem (the
    command line prints it and exits 2)."""


def _one_line(err: BaseException) -> str:
    """``err`` as ``Type: message`` on one line (libraries' messages span several)."""
    text = " ".join(str(err).split())
    kind = type(err).__name__
    if type(err).__module__ not in ("builtins", "__main__"):
        kind = f"{type(err).__module__}.{kind}"  # struct.error, not a bare "error"
    return f"{kind}: {text}" if text else kind


def _checked_config_json(p: Path) -> None:
    """``p/config.json`` is a JSON object with a ``model_type`` (transformers' Auto classes
    read it first; without it they blame a missing tokenizer library)."""
    import json

    f = p / "config.json"
    try:
        config = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(
            f"model.path: cannot read {str(f)!r} ({_one_line(err)}); it must be the JSON "
            "config of a Hugging Face causal LM"
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        got = sorted(config)[:6] if isinstance(config, dict) else type(config).__name__
        raise ModelLoadError(
            f"model.path: {str(f)!r} has no model_type (got {got!r}); it must be the config of "
            "a Hugging Face causal LM (save one with model.save_pretrained)"
        )
    missing = [
        what
        for what, names in (
            ("tokenizer", _TOKENIZER_FILES),
            ("weights", ("*.safetensors", "pytorch_model*.bin")),
        )
        if not any(any(p.glob(n)) for n in names)
    ]
    if missing:
        raise ModelLoadError(
            f"model.path: {str(p)!r} has a config.json but no {' and no '.join(missing)} files "
            f"(tokenizer: {', '.join(_TOKENIZER_FILES)}; weights: *.safetensors or "
            "pytorch_model*.bin); copy the whole model directory"
        )


#: Files one of which a Hugging Face tokenizer directory holds.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


# ChatML as Qwen renders it: tool results are <tool_response> blocks in a user turn; consecutive
# tool messages share one turn. The generation prompt is "<|im_start|>assistant\n".
CHAT_TEMPLATE = r"""{%- for message in messages %}
    {%- if message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
# Added (not special) tokens: whole words get one id each, as a trained BPE would give them (the
# tool-response tags are single tokens in Qwen's vocabulary too). Everything else is characters.
# A move is then one decision token plus <|im_end|>, which is what makes the demo learnable
# within minutes by a two-layer model.
ADDED_TOKENS = [
    "<tool_response>",
    "</tool_response>",
    "system",
    "user",
    "assistant",
    "up",
    "down",
    "left",
    "right",
    "done",
    "pos",
    "wall",
    "goal",
    "start",
    "hint",
    "error",
]
# mirrorgrid's own observation vocabulary (env.words = "compass"): no id shared with a key. Added
# only for it, after the others: the default vocabulary, and so the default model's
# initialisation, stay those of every earlier run.
COMPASS_TOKENS = ["north", "south", "west", "east"]


def build_tokenizer(*, compass: bool = False) -> Any:
    """A small word + character tokenizer (printable ASCII, newline, the words of
    `ADDED_TOKENS`) with the ChatML chat template.

    No merges: a known word is one token, anything else one token per character. Decoded replies
    tokenize back to the ids the model sampled (unless it spells a known word letter by letter;
    then the next prompt does not extend the last one token for token and
    [`echoloss.interleave`][echoloss.data.interleave] starts a new sample, as it does for any real retokenisation).

    Args:
        compass: also the words of `COMPASS_TOKENS` (mirrorgrid's ``env.words = "compass"``).

    Returns:
        a ``transformers.PreTrainedTokenizerFast`` (eos ``<|im_end|>``, pad ``<|endoftext|>``).

    Examples:
        >>> tok = build_tokenizer()
        >>> ids = tok("pos 1,2", add_special_tokens=False)["input_ids"]
        >>> len(ids), tok.decode(ids)
        (5, 'pos 1,2')
        >>> tok.apply_chat_template([{"role": "tool", "content": "pos 1,2"}], tokenize=False)
        '<|im_start|>user\\n<tool_response>\\npos 1,2\\n</tool_response><|im_end|>\\n'
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate(chars)}
    for t in SPECIAL_TOKENS:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    words = ADDED_TOKENS + (COMPASS_TOKENS if compass else [])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in words])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    *,
    arch: str,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int,
    rope_theta: float = 1000.0,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """A random-init Qwen3 or Llama causal LM (fp32), initialised from ``seed`` (no download).

    Examples:
        >>> m = build_tiny_model(arch="qwen3", vocab_size=100, hidden_size=32, num_layers=1,
        ...                      num_heads=2, num_kv_heads=1, intermediate_size=64,
        ...                      max_position_embeddings=64, seed=0)
        >>> type(m).__name__, sum(p.numel() for p in m.parameters())
        ('Qwen3ForCausalLM', 12544)
    """
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=0,
        # Short contexts: a small RoPE base lets every frequency pair turn over the distances a
        # conversation spans, so heads can learn "the digit k tokens back" quickly (Qwen3's
        # default 1e6 leaves most pairs nearly still over a few hundred tokens).
        rope_theta=rope_theta,
    )
    config: Any
    cls: Any
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=hidden_size // num_heads, **common)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"model.arch: expected 'qwen3' or 'llama', got {arch!r}")
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    fp32: torch.nn.Module = model.float()
    return fp32


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    attn_implementation: str,
    gguf_file: str | None = None,
) -> tuple[Any, Any]:
    """Load a local causal LM and its tokenizer (never a hub name): a Hugging Face directory, a
    ``.gguf`` file, the GGUF file ``gguf_file`` inside the directory ``path``, or
    ``"packaged:NAME"``, a model installed as a Python package (`echoloss.pretrained.materialize`
    converts it once into a cached directory).

    GGUF weights are dequantised to ``dtype`` (`echoloss.pretrained.load_gguf`): the model is
    an ordinary one from then on. `describe_model` says which it was.

    Raises:
        FileNotFoundError: ``path`` is neither a directory with a ``config.json`` nor a GGUF file.
        ModelLoadError: the files are there but do not load (a truncated GGUF file, a
            ``config.json`` without ``model_type``, a tokenizer without a chat template, any
            failure of the loading library), in one line naming the path and the problem.
    """
    p = Path(path).expanduser()
    try:
        return _load(
            path, dtype=dtype, attn_implementation=attn_implementation, gguf_file=gguf_file
        )
    except (ModelLoadError, FileNotFoundError):
        raise
    except Exception as err:  # a foreign file: any library's failure is the file's problem
        where = str(p / gguf_file) if gguf_file is not None else str(p)
        raise ModelLoadError(
            f"model.path: cannot load {where!r}: {_one_line(err)}; check that it is a complete "
            "Hugging Face model directory or GGUF file"
        ) from err


def _load(
    path: str | Path, *, dtype: torch.dtype, attn_implementation: str, gguf_file: str | None
) -> tuple[Any, Any]:
    import transformers

    if str(path).startswith("packaged:"):
        from echoloss.pretrained import materialize

        path = materialize(str(path).removeprefix("packaged:"))
    p = Path(path).expanduser()
    gguf = p if p.suffix == ".gguf" and p.is_file() else None
    if gguf_file is not None:
        gguf = p / gguf_file
    if gguf is not None:
        from echoloss.pretrained import load_gguf

        model, tok = load_gguf(gguf, dtype=dtype, attn_implementation=attn_implementation)
    elif not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path: {str(p)!r} is not a local Hugging Face model directory (no config.json) "
            "nor a .gguf file; echoloss-train never downloads models: download one first, make one "
            "from a packaged model (echoloss.pretrained.materialize), or leave model.path unset "
            "for the tiny built-in model"
        )
    else:
        _checked_config_json(p)
        tok = transformers.AutoTokenizer.from_pretrained(p, local_files_only=True)
        model = None
    if not getattr(tok, "chat_template", None):
        raise ModelLoadError(
            f"model.path: the tokenizer of {str(gguf or p)!r} has no chat template (a base "
            "model); the trainer renders conversations with it: use an instruct/chat model"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            p, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    return model, tok


def describe_model(path: str | None, gguf_file: str | None, dtype: torch.dtype) -> str:
    """The banner's words for where the weights came from.

    Examples:
        >>> describe_model("m/x.gguf", None, torch.bfloat16)
        'm/x.gguf (GGUF, dequantised to bfloat16)'
        >>> describe_model("m", None, torch.float32)
        'm (float32)'
        >>> describe_model("packaged:smollm2-135m-instruct", None, torch.bfloat16)
        'SmolLM2-135M-Instruct (Q4_1), packaged GGUF dequantised to bfloat16 (packaged:smollm2-135m-instruct)'
    """
    what = str(dtype).removeprefix("torch.")
    if path is None:
        return f"tiny built-in model ({what})"
    if path.startswith("packaged:"):
        from echoloss.pretrained import PACKAGED_MODELS

        spec = PACKAGED_MODELS[path.removeprefix("packaged:")]
        return f"{spec.title}, packaged GGUF dequantised to {what} ({path})"
    if gguf_file is not None:
        return f"{Path(path) / gguf_file} (GGUF, dequantised to {what})"
    if path.endswith(".gguf"):
        return f"{path} (GGUF, dequantised to {what})"
    return f"{path} ({what})"


def packed_attention_mask(
    cu_seqlens: torch.Tensor, length: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[1, 1, L, L]`` additive mask: token ``i`` sees token ``j`` iff ``j <= i`` in the same
    sequence (``0``), else ``-inf`` (the dtype's minimum). Padding is its own sequence.

    Examples:
        >>> m = packed_attention_mask(torch.tensor([0, 2, 3]), 3, torch.float32, torch.device("cpu"))
        >>> (m[0, 0] == 0).int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [0, 0, 1]], dtype=torch.int32)
    """
    seq = torch.zeros(length, dtype=torch.long, device=device)
    bounds = cu_seqlens.to(device=device, dtype=torch.long)[1:-1]
    seq[bounds] = 1
    seq = seq.cumsum(0)  # sequence index of every token
    idx = torch.arange(length, device=device)
    allowed = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def packed_logits(model: Any, batch: Any, *, attn_implementation: str) -> torch.Tensor:
    """Logits ``[L, V]`` of one [`echoloss.PackedBatch`][echoloss.data.packing.PackedBatch] row, sequences kept apart.

    FlashAttention implementations separate the sequences from the restarting ``position_ids``
    alone; every other implementation gets the block-diagonal mask of
    `packed_attention_mask`.
    """
    ids = batch.input_ids[None]
    pos = batch.position_ids[None]
    kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": pos, "use_cache": False}
    if "flash" not in attn_implementation:
        dtype = next(model.parameters()).dtype
        if torch.is_autocast_enabled(ids.device.type):  # fp32 weights computing in bf16
            dtype = torch.get_autocast_dtype(ids.device.type)
        kwargs["attention_mask"] = packed_attention_mask(
            batch.cu_seqlens, ids.shape[1], dtype, ids.device
        )
    logits: torch.Tensor = model(**kwargs).logits[0]
    return logits
