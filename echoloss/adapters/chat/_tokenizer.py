"""What the chat adapter asks of a tokenizer: render, tokenize with offsets, decode, control ids.

The tokenizer is duck-typed (every ``transformers`` tokenizer qualifies; nothing here imports
``transformers``): ``apply_chat_template(messages, tools=..., tokenize=..., add_generation_prompt=...,
**kwargs)``, ``tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)`` returning
``input_ids`` and ``offset_mapping`` (character spans), and ``decode(ids)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from echoloss.adapters.chat._errors import ChatTemplateError


class Renderer:
    """The tokenizer's chat template with fixed tools and template variables."""

    def __init__(self, tokenizer: Any, tools: Any, kwargs: Mapping[str, Any]) -> None:
        missing = [
            name
            for name in ("apply_chat_template",)
            if not callable(getattr(tokenizer, name, None))
        ]
        if missing or not callable(tokenizer):
            what = "None" if tokenizer is None else f"a {type(tokenizer).__name__}"
            lacks = ", ".join(missing) or "__call__"
            raise TypeError(
                f"tokenizer must be a tokenizer with a chat template (callable, with "
                f"apply_chat_template), got {what} (no {lacks}); pass a Hugging Face "
                "tokenizer, e.g. AutoTokenizer.from_pretrained(path)"
            )
        self.tokenizer = tokenizer
        self.tools = tools
        self.kwargs = dict(kwargs)

    def text(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        *,
        what: str = "the conversation",
        message_index: int | None = None,
    ) -> str:
        try:
            out = self.tokenizer.apply_chat_template(
                list(messages),
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.kwargs,
            )
        except Exception as e:  # the template's own error, re-raised with context
            raise ChatTemplateError(
                f"the chat template failed to render {what}: {type(e).__name__}: {e}",
                message_index=message_index,
            ) from e
        if not isinstance(out, str):
            raise TypeError(
                f"apply_chat_template(tokenize=False) returned {type(out).__name__}, expected str"
            )
        return out

    def template_ids(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool
    ) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
            **self.kwargs,
        )
        if isinstance(out, Mapping):
            out = out["input_ids"]
        return [int(t) for t in out]


def is_hf_tokenizer(tokenizer: Any) -> bool:
    """A ``transformers`` tokenizer, whose ``apply_chat_template(tokenize=True)`` is by
    construction ``tokenizer(rendered_text, add_special_tokens=False)``."""
    return any(c.__name__ == "PreTrainedTokenizerBase" for c in type(tokenizer).__mro__)


def encode(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` and each token's character span ``[start, end)`` in it."""
    try:
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = out["input_ids"], out["offset_mapping"]
    except (TypeError, KeyError, NotImplementedError, ValueError) as e:
        raise TypeError(
            "the chat adapter needs a tokenizer that maps tokens to characters: "
            "tokenizer(text, add_special_tokens=False, return_offsets_mapping=True) must return "
            "'input_ids' and 'offset_mapping' (every fast transformers tokenizer does; load it "
            f"with use_fast=True): {type(e).__name__}: {e}"
        ) from e
    ids = [int(t) for t in ids]
    spans = [(int(a), int(b)) for a, b in offsets]
    if len(spans) != len(ids):
        raise TypeError(
            f"the tokenizer returned {len(ids)} ids but {len(spans)} offsets for one text"
        )
    # Offsets must run forward; neighbours may share one character (the bytes of one character
    # split over two byte-level tokens).
    ends = [0, *(b for _, b in spans)]
    bad = next(
        (
            t
            for t, ((a, b), prev) in enumerate(zip(spans, ends, strict=False))
            if not 0 <= a <= b <= len(text) or b < prev or a < prev - 1
        ),
        None,
    )
    if bad is not None:
        raise ChatTemplateError(
            f"the tokenizer's offset_mapping is not monotone at token {bad} ({spans[bad]} after "
            f"character {ends[bad]}); echoloss cannot map its tokens to the rendered text"
        )
    return ids, spans


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """``text`` as ordinary text: no control token (`control_ids`) is matched inside it.

    ``split_special_tokens=True`` keeps the tokenizer from matching its *special* tokens, but an
    added non-special markup token (``<tool_response>``, ``<think>`` in Qwen3's vocabulary) is
    still matched. Each occurrence of such a token is then cut after its first character and
    the pieces are encoded one after another (each after an anchor, so a SentencePiece
    tokenizer adds no ``▁`` at a cut); the result is verified to decode to ``text`` with no
    control token left, else `ChatTemplateError`.
    """
    controls = control_ids(tokenizer)
    out = _encode_after_anchor(tokenizer, text)
    matched = sorted({controls[i] for i in out if controls.get(i)}, key=len)
    if matched:  # added non-special tokens: cut each occurrence so no piece spells it
        out = [
            t for p in _cut_markup(text, matched[::-1]) for t in _encode_after_anchor(tokenizer, p)
        ]
    left = sorted({controls[i] for i in out if i in controls})
    decoder = Decoder(tokenizer)
    # A SentencePiece vocabulary encodes a literal ▁ exactly as a space (see Decoder).
    want = text.replace(META, " ") if decoder.sentencepiece else text
    if left or decoder([out])[0] != want:
        raise ChatTemplateError(
            f"control_tokens='escape' cannot encode {text!r} as ordinary text with this "
            f"tokenizer ({'it still matches ' + ', '.join(left) if left else 'the pieces do not decode to the text'}); "
            "use control_tokens='exclude' (kept in the ids, never echoed) or 'error'"
        )
    return out


def _encode_after_anchor(tokenizer: Any, text: str) -> list[int]:
    """``text``'s ids as they read after other text: encoded after an anchor ``Q`` whose ids are
    then cut off, so a SentencePiece tokenizer adds no ``▁`` at the start."""
    anchor = _encode_split(tokenizer, "Q")
    full = _encode_split(tokenizer, "Q" + text)
    return full[len(anchor) :] if full[: len(anchor)] == anchor else _encode_split(tokenizer, text)


def _encode_split(tokenizer: Any, text: str) -> list[int]:
    try:
        out = tokenizer(text, add_special_tokens=False, split_special_tokens=True)
    except TypeError as e:
        raise TypeError(
            "control_tokens='escape' needs a tokenizer that accepts split_special_tokens=True "
            "(transformers tokenizers do)"
        ) from e
    return [int(t) for t in out["input_ids"]]


def _cut_markup(text: str, markup: list[str]) -> list[str]:
    """``text`` cut after the first character of every occurrence of a markup string, so that
    no piece spells one (longest strings first: ``</tool_call>`` before ``<tool_call>``).

    Examples:
        >>> _cut_markup("a<think>b</think>", ["</think>", "<think>"])
        ['a<', 'think>b<', '/think>']
    """
    cuts: set[int] = set()
    for m in markup:
        start = text.find(m)
        while start >= 0:
            cuts.add(start + 1)
            start = text.find(m, start + 1)
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]


#: SentencePiece's meta symbol: the vocabulary's spelling of a space.
META = "\u2581"


class Decoder:
    """Decodes runs of tokens as they read in the middle of a text: each run is decoded after a
    fixed anchor token, whose own text is then cut off, so a decoder that strips a leading
    space from the whole text (SentencePiece's) does not strip the run's.

    `expected` is the text a run must decode to. For a SentencePiece tokenizer (one whose
    vocabulary spells a space as ``▁``) that is the text its offsets cover, with two things the
    tokenizer itself adds: the ``▁`` it prepends to a segment (Llama-2-style normalizers and
    ``Metaspace(prepend_scheme="always")`` prepend one to the text after every added token;
    the token's offsets cover only the real characters), and a literal ``▁`` in the text,
    which such a tokenizer encodes exactly as a space (both decode to ``" "``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decode = getattr(tokenizer, "decode", None)
        if decode is None:
            raise TypeError("the chat adapter needs tokenizer.decode(ids) to verify bodies")
        self.anchor = [int(t) for t in tokenizer("Q", add_special_tokens=False)["input_ids"]]
        self.anchor_text = self._decode([self.anchor])[0]
        self.pieces = getattr(tokenizer, "convert_ids_to_tokens", None)
        space = tokenizer(" Q Q", add_special_tokens=False)["input_ids"]
        self.sentencepiece = self.pieces is not None and any(
            META in str(p) for p in self.pieces([int(t) for t in space])
        )

    def _decode(self, runs: list[list[int]]) -> list[str]:
        batch = getattr(self.tokenizer, "batch_decode", None)
        kw = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
        if batch is not None:
            return [str(s) for s in batch(runs, **kw)]
        return [str(self.tokenizer.decode(r, **kw)) for r in runs]

    def __call__(self, runs: list[list[int]]) -> list[str]:
        out = self._decode([self.anchor + r for r in runs])
        n = len(self.anchor_text)
        return [s[n:] if s.startswith(self.anchor_text) else "\0" for s in out]

    def expected(self, text: str, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> str:
        """What the tokens ``ids`` (character spans ``spans`` in ``text``) must decode to.

        Examples:
            >>> class Tok:  # a SentencePiece vocabulary that prepends ▁ after added tokens
            ...     vocab = {"▁Q": 0, "▁a": 1, "b": 2, "▁": 3}
            ...     def __call__(self, text, add_special_tokens=False):
            ...         return {"input_ids": [0] if text == "Q" else [3, 0, 3, 0]}
            ...     def convert_ids_to_tokens(self, ids):
            ...         inv = {v: k for k, v in self.vocab.items()}
            ...         return [inv[i] for i in ids]
            ...     def decode(self, ids, **kw):
            ...         return "".join(self.convert_ids_to_tokens(ids)).replace("▁", " ")[1:]
            >>> d = Decoder(Tok())
            >>> d.expected("<x>ab", [1, 2], [(3, 4), (4, 5)])  # "▁a" covers "a": one prepended
            ' ab'
        """
        lo, hi = spans[0][0], spans[-1][1]
        if not self.sentencepiece or self.pieces is None:
            return text[lo:hi]
        out = []
        at = lo
        for piece, (s, e) in zip(self.pieces([int(t) for t in ids]), spans, strict=True):
            covered = text[s:e]
            piece = str(piece)
            added = (
                len(piece)
                - len(piece.lstrip(META))
                - (len(covered) - len(covered.lstrip(" " + META)))
            )
            if s >= at:
                out.append(text[at:s])
                at = s
            if added == 1:
                out.append(" ")
            out.append(text[at:e])
            at = max(at, e)
        return "".join(out).replace(META, " ")


def control_ids(tokenizer: Any) -> dict[int, str]:
    """Token ids (with their text) that a chat template uses as control tokens: the tokenizer's
    special tokens, and added markup tokens whose text appears in its chat template
    (``<tool_call>``, ``<think>``); whitespace tokens excepted.

    An added token that is a plain word (``user``, ``start``: vocabularies add whole words as
    single tokens) is ordinary text even when the template's source contains it (``'<|im_start|>'
    + 'user'``): only markup (text with one of ``<>[]{}|``) is taken for a control token.

    Examples:
        >>> class Added:
        ...     def __init__(self, content): self.content, self.special = content, False
        >>> class Tok:
        ...     chat_template = "{{ '<|im_start|>user' }}<tool_call>"
        ...     added_tokens_decoder = {5: Added("<tool_call>"), 6: Added("start"), 7: Added("user")}
        >>> control_ids(Tok())
        {5: '<tool_call>'}
    """
    out: dict[int, str] = {}
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tid, tok in dict(added).items():
        content = getattr(tok, "content", str(tok))
        special = bool(getattr(tok, "special", False))
        markup = content in template and any(c in content for c in "<>[]{}|")
        if content and not content.isspace() and (special or markup):
            out[int(tid)] = content
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    for tid in getattr(tokenizer, "all_special_ids", None) or []:
        if int(tid) not in out:
            out[int(tid)] = str(convert(int(tid))) if convert is not None else ""
    return out
