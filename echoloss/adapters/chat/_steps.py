"""One [`echoloss.Step`][echoloss.data.interleave.Step] per assistant message: the prompt the model saw, what it emitted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from echoloss import Step, TokenAttribution
from echoloss._logging import warn_once
from echoloss.adapters.chat._attribute import (
    ChatRendering,
    ControlTokens,
    MessageSpan,
    _render_attributed,
)
from echoloss.adapters.chat._messages import check_messages
from echoloss.adapters.chat._tokenizer import Renderer, encode


def _prompt_attribution(full: ChatRendering, length: int, k: int) -> TokenAttribution:
    """``full``'s attribution cut to ``length`` tokens, with messages ``>= k`` made scaffold."""
    att = full.attribution
    indices = [i if i < k else -1 for i in att.message_indices[:length]]
    content = [c and i >= 0 for c, i in zip(att.is_content[:length], indices, strict=True)]
    names = att.message_tool_names
    return TokenAttribution(
        message_indices=tuple(indices),
        is_content=tuple(content),
        message_roles=att.message_roles[:k],
        message_tool_names=None if names is None else names[:k],
    )


def _stop_ids(tokenizer: Any) -> tuple[set[int], set[int]]:
    """The tokenizer's EOS ids, and every special token id (its special added tokens too:
    ``<end_of_turn>``, ``<|im_end|>``, ``<|call|>``)."""
    special = {int(t) for t in getattr(tokenizer, "all_special_ids", None) or []}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {int(t) for t, tok in dict(added).items() if getattr(tok, "special", False)}
    eos_id = getattr(tokenizer, "eos_token_id", None)
    eos = (
        set()
        if eos_id is None
        else {int(t) for t in (eos_id if isinstance(eos_id, list) else [eos_id])}
    )
    return eos, special


def _completion_end(
    span: MessageSpan, ids: Sequence[int], begin: int, eos: set[int], special: set[int]
) -> int:
    """End of what the model emitted for message ``span``: its body, then its trailing scaffold
    up to and including the end-of-turn token (the tokenizer's EOS, else the first special token
    after the body, e.g. ``<|im_end|>``, ``<|eot_id|>``, ``<|call|>``); the whole message if
    there is neither. An empty body searches from where the completion begins, so it never runs
    into the next message."""
    has_body = span.body_end > span.body_start
    first = max(begin, span.body_end if has_body else begin)
    for stops in (eos, special):
        for t in range(first, span.end):
            if ids[t] in stops:
                return t + 1
    return max(span.end, begin)


def steps_from_messages(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    logprobs: Sequence[Sequence[float]] | None = None,
    temperature: float = 1.0,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    extra_roles: Sequence[str] = (),
    control_tokens: ControlTokens = "exclude",
) -> list[Step]:
    """One [`echoloss.Step`][echoloss.data.interleave.Step] per assistant message of a multi-turn conversation.

    Step ``j`` (the ``j``-th assistant message, at index ``k``): the prompt is ``messages[:k]``
    rendered with the generation prompt, exactly as the model saw it, with its attribution; the
    completion is what the model emitted after it: the tokens the template renders for message
    ``k`` from where the prompt stops, up to and including its end-of-turn token (the
    tokenizer's EOS after the body, else the first special token after it).

    Two paths, chosen per turn: when the prompt is a token prefix of the whole conversation's
    rendering (a prefix-stable template), prompt and completion are cut from that one attributed
    rendering. Otherwise (Qwen3's ``<think></think>`` on the last turn only, a system prompt
    moved to the last user turn, a generation prompt that differs from how the template renders
    the turn) the prompt is rendered and attributed on its own and the completion is cut from
    ``messages[:k + 1]`` rendered without it. Feed the steps to [`echoloss.interleave`][echoloss.data.interleave]:
    steps that extend each other merge into one sample whose completion region interleaves the
    assistant turns with the observations; the others start a new sample.

    Args:
        messages: the conversation (see [`attribute`][echoloss.adapters.chat.attribute]); at least one assistant message, and
            not as the first message.
        tokenizer: a Hugging Face (fast) tokenizer with a chat template.
        tools: tool schemas for the template.
        logprobs: the sampling logprobs of each assistant message's completion tokens, one list
            per assistant message; each must have exactly as many values as the completion has
            tokens. ``None`` fills ``0.0`` placeholders (logged once): fine for echo and for
            on-policy losses that recompute them, wrong for an importance ratio.
        temperature: sampling temperature stamped on every step.
        chat_template_kwargs: extra template variables.
        extra_roles: roles besides the standard four that the template renders.
        control_tokens: as [`attribute`][echoloss.adapters.chat.attribute].

    Returns:
        ``list[Step]``, one per assistant message; ``step.metadata["message_index"]`` is ``k``.

    Raises:
        ChatTemplateError: as [`attribute`][echoloss.adapters.chat.attribute]; or no completion can be located for a turn.
        ValueError: no assistant message, an assistant message first, or a ``logprobs`` length
            that does not match.

    Examples:
        >>> class CharTokenizer:
        ...     def apply_chat_template(self, messages, tools=None, tokenize=True,
        ...                             add_generation_prompt=False, **kw):
        ...         text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        ...         text += "<assistant>" if add_generation_prompt else ""
        ...         return [ord(c) for c in text] if tokenize else text
        ...     def __call__(self, text, add_special_tokens=False, **kw):
        ...         return {"input_ids": [ord(c) for c in text],
        ...                 "offset_mapping": [(i, i + 1) for i in range(len(text))]}
        ...     def decode(self, ids, **kw):
        ...         return "".join(map(chr, ids))
        ...     all_special_ids = [ord("|")]
        >>> steps = steps_from_messages(
        ...     [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ls"},
        ...      {"role": "tool", "name": "ls", "content": "a"},
        ...      {"role": "assistant", "content": "done"}], CharTokenizer())
        >>> ["".join(map(chr, s.completion_ids)) for s in steps]
        ['ls|', 'done|']
        >>> "".join(map(chr, steps[1].prompt_ids))
        '<user>go|<assistant>ls|<tool>a|<assistant>'
    """
    msgs = check_messages(messages, extra_roles)
    assistant = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    if not assistant:
        raise ValueError("messages has no assistant message, so there is no step to train")
    if assistant[0] == 0:
        raise ValueError(
            "messages[0] is an assistant message: it has no prompt to condition on; start the "
            "conversation with a system or user message"
        )
    if logprobs is not None and len(logprobs) != len(assistant):
        raise ValueError(
            f"logprobs has {len(logprobs)} lists but messages has {len(assistant)} assistant "
            f"message(s) (at indices {assistant}); give one list per assistant message"
        )
    common: dict[str, Any] = {
        "tools": tools,
        "chat_template_kwargs": dict(chat_template_kwargs or {}),
        "extra_roles": extra_roles,
        "control_tokens": control_tokens,
        "require_prefix_stability": False,
        # A template that renders a message only in some positions (Mistral v0.3's system
        # prompt with the last user turn) renders each prompt right even where the whole
        # conversation or a finished turn leaves it out.
        "strict_missing": False,
    }
    full = _render_attributed(msgs, tokenizer, **common)
    renderer = Renderer(tokenizer, tools, common["chat_template_kwargs"])
    eos, special = _stop_ids(tokenizer)
    steps: list[Step] = []
    for j, k in enumerate(assistant):
        head_text = renderer.text(msgs[:k], True, what=f"messages[:{k}] with the generation prompt")
        turn_text = renderer.text(msgs[: k + 1], False, what=f"messages[:{k + 1}]")
        span = full.spans[k]
        n = -1
        if full.text.startswith(head_text) and full.text.startswith(turn_text):
            head_ids = encode(tokenizer, head_text)[0]
            n = len(head_ids)
            body_at = span.body_start if span.body_end > span.body_start else span.end
            if full.token_ids[:n] != head_ids or not span.start <= n <= body_at:
                n = -1
        if n >= 0:
            # One rendering serves all turns so far: cut prompt and completion from it.
            prompt, attribution = full.token_ids[:n], _prompt_attribution(full, n, k)
            end = _completion_end(span, full.token_ids, n, eos, special)
            completion = full.token_ids[n:end]
        else:
            # Per-generation: the prompt as the model saw it, the turn rendered as the last one.
            head = _render_attributed(msgs[:k], tokenizer, add_generation_prompt=True, **common)
            prompt, attribution = head.token_ids, head.attribution
            completion = _bridged_completion(msgs, tokenizer, k, head, common, eos, special)
        if logprobs is None:
            warn_once(
                "chat-steps-no-logprobs",
                "echoloss: steps_from_messages got no logprobs; completion logprobs are 0.0 "
                "placeholders (fine for echo and recomputed old logprobs, wrong as the inference "
                "logprobs of an importance ratio)",
            )
            lp: list[float] = [0.0] * len(completion)
        else:
            lp = list(logprobs[j])
            if len(lp) != len(completion):
                raise ValueError(
                    f"logprobs[{j}] (assistant message {k}) has {len(lp)} values but the template "
                    f"renders that completion as {len(completion)} tokens; give one "
                    "logprob per completion token (the body and the end-of-turn token)"
                )
        steps.append(
            Step(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=lp,
                attribution=attribution,
                temperature=temperature,
                metadata={"message_index": k},
            )
        )
    return steps


def _bridged_completion(
    msgs: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    k: int,
    head: ChatRendering,
    common: Mapping[str, Any],
    eos: set[int],
    special: set[int],
) -> list[int]:
    """Message ``k``'s completion when the prompt is not how the whole conversation renders the
    turn: ``messages[:k + 1]`` rendered without a generation prompt; the completion begins after
    the generation prompt inside message ``k``'s leading scaffold (where the template writes it
    differently, after the part the two share: DeepSeek-R1's prompt ends ``<think>\n``, its
    history turns do not) and ends with the end-of-turn token."""
    turn = _render_attributed(msgs[: k + 1], tokenizer, **common)
    span = turn.spans[k]
    has_body = span.body_end > span.body_start
    lead = turn.token_ids[span.start : span.body_start if has_body else span.end]
    tail = [
        t for t, i in zip(head.token_ids, head.attribution.message_indices, strict=False) if i < 0
    ]
    gen = head.token_ids[len(head.token_ids) - len(tail) :] if tail else []
    begin = span.start + _after(lead, gen)
    end = _completion_end(span, turn.token_ids, begin, eos, special)
    return list(turn.token_ids[begin:end])


def _after(lead: Sequence[int], gen: Sequence[int]) -> int:
    """Tokens of ``lead`` that the generation prompt ``gen`` already holds: up to its last
    occurrence in ``lead``, else their common prefix."""
    g = len(gen)
    if g:
        for p in range(len(lead) - g, -1, -1):
            if list(lead[p : p + g]) == list(gen):
                return p + g
    n = 0
    while n < min(len(lead), g) and lead[n] == gen[n]:
        n += 1
    return n
