"""Token attribution: which message, and which part of it, produced each rendered token.

A chat renderer turns messages into token ids. Echo selection needs to know, for every token of a
step's prompt, the message it came from and whether it is message *body* (content) or template
*scaffold* (role tags, tool-response wrappers, separators). This module holds that description.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from echoloss._validate import bool_list, int_list

__all__ = ["TokenAttribution"]

# Keys a renderer's plain-dict attribution may carry besides ours; accepted and not needed here.
_IGNORED_RENDERER_KEYS = frozenset({"token_ids", "sampled_mask", "multi_modal_data"})
_FIELDS = frozenset(
    {"message_indices", "is_content", "message_roles", "message_tool_names", "is_warning"}
)
_REQUIRED = ("message_indices", "is_content", "message_roles")


def _bool_list(name: str, values: Any) -> tuple[bool, ...]:
    return tuple(bool_list(f"TokenAttribution.{name}", values))


@dataclass(frozen=True, init=False)
class TokenAttribution:
    """Per-token attribution of a rendered prompt to chat messages.

    Per-token fields run parallel to the prompt's token ids (length ``P``); per-message fields run
    parallel to ``message_roles`` (length ``M``).

    Attributes:
        message_indices: ``[P]`` index of the message each token belongs to, ``-1`` for template
            scaffold that belongs to no message (generation prompt, separators, and on a *bridged*
            turn the whole earlier history, whose messages are not counted).
        is_content: ``[P]`` True where the token comes from message body bytes, False for template
            scaffold. May be empty: the renderer does not provide the signal.
        message_roles: ``[M]`` role of each message (``"system"``, ``"user"``, ``"assistant"``,
            ``"tool"``, or any other string).
        message_tool_names: ``[M]`` function name of each tool message, ``None`` for other roles or
            where the name could not be resolved. ``None`` as a whole means "not provided".
        is_warning: ``[P]`` optional; True on the tokens of a harness *warning* prefix inside an
            observation (excluded from the echo target by default, still counted in ``Z = |O|``).

    Examples:
        >>> att = TokenAttribution.from_dict({
        ...     "message_indices": [-1, 0, 0, -1, 1, 1],
        ...     "is_content": [False, False, True, False, False, True],
        ...     "message_roles": ["user", "tool"],
        ...     "message_tool_names": [None, "ls"],
        ... })
        >>> len(att), att.role_of(1), att.tool_name_of(1)
        (6, 'tool', 'ls')
    """

    message_indices: tuple[int, ...]
    is_content: tuple[bool, ...]
    message_roles: tuple[str, ...]
    message_tool_names: tuple[str | None, ...] | None = None
    is_warning: tuple[bool, ...] | None = None

    def __init__(
        self,
        message_indices: Sequence[int],
        is_content: Sequence[bool],
        message_roles: Sequence[str],
        message_tool_names: Sequence[str | None] | None = None,
        is_warning: Sequence[bool] | None = None,
    ) -> None:
        # Lists are accepted and normalised to tuples, so the instance is hashable and cannot be
        # mutated behind our back.
        object.__setattr__(self, "message_indices", self._indices(message_indices))
        object.__setattr__(self, "is_content", _bool_list("is_content", is_content))
        object.__setattr__(self, "message_roles", self._roles(message_roles))
        names = None if message_tool_names is None else self._names(message_tool_names)
        object.__setattr__(self, "message_tool_names", names)
        warning = None if is_warning is None else _bool_list("is_warning", is_warning)
        object.__setattr__(self, "is_warning", warning)
        self._check_lengths()

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TokenAttribution:
        """Build from the plain-dict form that renderers and verifiers emit.

        Keys: ``message_indices``, ``is_content``, ``message_roles`` (required),
        ``message_tool_names`` and ``is_warning`` (optional, ``None`` allowed). The renderer keys
        ``token_ids``, ``sampled_mask`` and ``multi_modal_data`` are accepted and ignored, except that
        ``token_ids`` must have the same length as ``message_indices``. Any other key is an error.

        Raises:
            TypeError: ``d`` is not a mapping, or a field has the wrong type.
            ValueError: a required key is missing, an unknown key is present, or lengths disagree.
        """
        if isinstance(d, TokenAttribution):
            return d
        if not isinstance(d, Mapping):
            raise TypeError(f"TokenAttribution.from_dict expects a dict, got {type(d).__name__}")
        unknown = set(d) - _FIELDS - _IGNORED_RENDERER_KEYS
        if unknown:
            raise ValueError(
                f"TokenAttribution.from_dict got unknown key(s) {sorted(unknown)}; expected "
                f"{sorted(_FIELDS)} (plus the ignored renderer keys {sorted(_IGNORED_RENDERER_KEYS)})"
            )
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(
                f"TokenAttribution.from_dict is missing required key(s) {missing}; a renderer "
                "attribution dict carries message_indices, is_content and message_roles"
            )
        att = cls(
            message_indices=d["message_indices"],
            is_content=d["is_content"],
            message_roles=d["message_roles"],
            message_tool_names=d.get("message_tool_names"),
            is_warning=d.get("is_warning"),
        )
        token_ids = d.get("token_ids")
        if token_ids is not None and len(token_ids) != len(att.message_indices):
            raise ValueError(
                f"TokenAttribution: token_ids has length {len(token_ids)} but message_indices has "
                f"length {len(att.message_indices)}; both must cover the same prompt tokens"
            )
        return att

    def to_dict(self) -> dict[str, Any]:
        """The plain-dict form accepted by [`from_dict`][echoloss.data.attribution.TokenAttribution.from_dict] (lists, JSON-serialisable)."""
        return {
            "message_indices": list(self.message_indices),
            "is_content": list(self.is_content),
            "message_roles": list(self.message_roles),
            "message_tool_names": None
            if self.message_tool_names is None
            else list(self.message_tool_names),
            "is_warning": None if self.is_warning is None else list(self.is_warning),
        }

    # -- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.message_indices)

    @property
    def has_content_signal(self) -> bool:
        """False when the renderer left ``is_content`` empty (body vs scaffold unknown)."""
        return len(self.is_content) > 0 or len(self.message_indices) == 0

    def role_of(self, message_index: int) -> str:
        """Role of message ``message_index``."""
        return self.message_roles[message_index]

    def tool_name_of(self, message_index: int) -> str | None:
        """Resolved tool name of message ``message_index``; None if unknown or not provided."""
        names = self.message_tool_names
        if names is None or message_index >= len(names):
            return None
        return names[message_index]

    # -- validation ---------------------------------------------------------------------------

    @staticmethod
    def _indices(values: Any) -> tuple[int, ...]:
        out = int_list("TokenAttribution.message_indices", values)
        for i, v in enumerate(out):
            if v < -1:
                raise ValueError(
                    f"TokenAttribution.message_indices[{i}] = {v}; expected -1 (scaffold) or a "
                    "message index >= 0"
                )
        return tuple(out)

    @staticmethod
    def _roles(values: Any) -> tuple[str, ...]:
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
            raise TypeError(
                f"TokenAttribution.message_roles must be a list of str, got {type(values).__name__}"
            )
        for i, v in enumerate(values):
            if not isinstance(v, str):
                raise TypeError(
                    f"TokenAttribution.message_roles[{i}] must be a str, got {type(v).__name__} {v!r}"
                )
        return tuple(values)

    @staticmethod
    def _names(values: Any) -> tuple[str | None, ...]:
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
            raise TypeError(
                "TokenAttribution.message_tool_names must be a list of str | None, got "
                f"{type(values).__name__}"
            )
        for i, v in enumerate(values):
            if v is not None and not isinstance(v, str):
                raise TypeError(
                    f"TokenAttribution.message_tool_names[{i}] must be a str or None, got "
                    f"{type(v).__name__} {v!r}"
                )
        return tuple(values)

    def _check_lengths(self) -> None:
        n = len(self.message_indices)
        if self.is_content and len(self.is_content) != n:
            raise ValueError(
                f"TokenAttribution: is_content has length {len(self.is_content)} but "
                f"message_indices has length {n}; per-token fields must be parallel (or is_content "
                "empty when the renderer does not provide it)"
            )
        if self.is_warning is not None and len(self.is_warning) != n:
            raise ValueError(
                f"TokenAttribution: is_warning has length {len(self.is_warning)} but "
                f"message_indices has length {n}; per-token fields must be parallel"
            )
        m = len(self.message_roles)
        # A shorter tool-name list is tolerated (verifiers' prompt truncation drops it); the
        # selection logs that names are missing. A longer one is a real inconsistency.
        if self.message_tool_names is not None and len(self.message_tool_names) > m:
            raise ValueError(
                f"TokenAttribution: message_tool_names has length {len(self.message_tool_names)} "
                f"but message_roles has length {m}; per-message fields must be parallel"
            )
        for k, mi in enumerate(self.message_indices):
            if mi >= m:
                raise ValueError(
                    f"TokenAttribution.message_indices[{k}] = {mi} but only {m} message role(s) "
                    "are given; every index must be -1 or < len(message_roles)"
                )
        if self.is_warning is not None:
            for k, w in enumerate(self.is_warning):
                if w and self.message_indices[k] < 0:
                    raise ValueError(
                        f"TokenAttribution.is_warning[{k}] is True on a scaffold token "
                        "(message_indices == -1); warnings must lie inside a message"
                    )
