"""The chat adapter's error type."""

from __future__ import annotations

_CONTEXT_CHARS = 40


class ChatTemplateError(ValueError):
    """The chat template cannot be attributed exactly (or the messages cannot be rendered).

    Attributes:
        message_index: index of the message where attribution breaks, or ``None``.
    """

    def __init__(self, message: str, *, message_index: int | None = None) -> None:
        super().__init__(message)
        self.message_index = message_index


def excerpt(text: str, at: int) -> str:
    """``text`` around character ``at``, as ``'before' | 'after'``."""
    lo = max(0, at - _CONTEXT_CHARS)
    return repr(text[lo:at]) + " | " + repr(text[at : at + _CONTEXT_CHARS])
