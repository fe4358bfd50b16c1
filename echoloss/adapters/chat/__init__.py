"""Chat messages + a Hugging Face tokenizer's own chat template → token ids + attribution.

Most users have messages and a tokenizer, not a renderer that reports which message produced which
token. This package recovers that from the chat template itself, with a constant number of
renders of the whole conversation (linear time):

1. **Bodies, proven by construction.** Every payload value (content, text parts, reasoning,
   tool-call names and arguments) is replaced by a unique sentinel and the conversation rendered
   once; then once per colour of a two-colouring with half the values real. Each real value sits
   between two known sentinels, so its rendered text is read off exactly, and the real rendering
   must equal the scaffold with those texts put back (``_slots``).
2. **Message regions.** Message ``k`` starts where the rendering of ``messages[:k]`` stops
   agreeing with the whole rendering, searched in the scaffold gap before its body; each kind of
   gap is rendered once. A template that renders earlier messages differently once later ones
   follow is detected there (``require_prefix_stability``). A body the template renders inside
   another message's turn (Mistral v0.3's system prompt in the last user turn, Gemma 3's in the
   first) keeps its own message index and role.
3. **Tokens.** The rendered text is tokenized once with character offsets. A token is body only
   when it lies entirely inside a body; one that mixes body and scaffold is scaffold. Every run
   of body tokens must decode to exactly the text it covers, or it is an error naming the
   message. Scaffold tokens straddling two messages go to the later one.
4. **Control tokens** spelled inside a body (a tool result containing ``<|im_end|>``) follow the
   ``control_tokens`` policy: ``"exclude"`` (default), ``"error"`` or ``"escape"``.

[`steps_from_messages`][echoloss.adapters.chat.steps_from_messages] renders each assistant turn's prompt as the model saw it and cuts
its completion, bridging templates that are not prefix-stable. ``docs/adapters.md`` has the
per-family support table and the limits.
"""

from echoloss.adapters.chat._attribute import (
    CONTROL_TOKEN_POLICIES,
    ChatRendering,
    ControlTokens,
    MessageSpan,
    attribute,
    render_attributed,
)
from echoloss.adapters.chat._errors import ChatTemplateError
from echoloss.adapters.chat._messages import resolve_tool_names
from echoloss.adapters.chat._steps import steps_from_messages

__all__ = [
    "CONTROL_TOKEN_POLICIES",
    "ChatRendering",
    "ChatTemplateError",
    "ControlTokens",
    "MessageSpan",
    "attribute",
    "render_attributed",
    "resolve_tool_names",
    "steps_from_messages",
]
