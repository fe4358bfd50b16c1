"""Checked chat messages, tool names, and the payload *fields* whose rendering is message body."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from echoloss.data import STANDARD_ROLES

# Message fields whose text is message *body* when the template renders it.
TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "thinking")


def check_messages(messages: Any, extra_roles: Sequence[str]) -> list[Mapping[str, Any]]:
    """``messages`` as a list of mappings, or a TypeError/ValueError naming the bad message."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages is empty; a chat template needs at least one message")
    known = set(STANDARD_ROLES) | set(extra_roles)
    out: list[Mapping[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}] has no string 'role' (got {role!r})")
        if role not in known:
            raise ValueError(
                f"messages[{i}].role = {role!r} is not a known role (expected one of "
                f"{sorted(known)}); if your chat template renders it, pass "
                f"extra_roles=({role!r},) (its tokens are attributed to that role, and echoed only "
                "if EchoConfig.other_roles names it)"
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            if not isinstance(content, Sequence) or isinstance(content, bytes):
                raise TypeError(
                    f"messages[{i}].content must be a str, None or a list of content parts, got "
                    f"{type(content).__name__}"
                )
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                    raise TypeError(
                        f"messages[{i}].content[{j}] must be a dict with a 'type' (e.g. "
                        f"{{'type': 'text', 'text': ...}}), got {part!r}"
                    )
        for field in TEXT_FIELDS:
            _check_text(f"messages[{i}].{field}", m.get(field))
        if isinstance(content, Sequence) and not isinstance(content, str):
            for j, part in enumerate(content):
                _check_text(f"messages[{i}].content[{j}]['text']", part.get("text"))
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"messages[{i}].name must be a str, got {type(name).__name__}")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
                raise TypeError(
                    f"messages[{i}].tool_calls must be a list, got {type(calls).__name__}"
                )
            for j, tc in enumerate(calls):
                if not isinstance(tc, Mapping):
                    raise TypeError(
                        f"messages[{i}].tool_calls[{j}] must be a dict, got {type(tc).__name__}"
                    )
        out.append(m)
    return out


def _check_text(where: str, text: Any) -> None:
    """A body text that is not valid Unicode (a lone surrogate, e.g. bytes decoded with
    ``errors='surrogateescape'``) is the message's problem: no tokenizer can encode it, so a
    later error would blame the tokenizer.

    Examples:
        >>> _check_text("messages[1].content", "ok")
        >>> _check_text("messages[1].content", "a\\udce9b")
        Traceback (most recent call last):
        ...
        ValueError: messages[1].content has a lone surrogate U+DCE9 at index 1, which is not valid Unicode text (no tokenizer can encode it); decode the tool's bytes with errors='replace' (or 'backslashreplace') before building the messages
    """
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{where} has a lone surrogate U+{ord(text[err.start]):04X} at index {err.start}, "
            "which is not valid Unicode text (no tokenizer can encode it); decode the tool's "
            "bytes with errors='replace' (or 'backslashreplace') before building the messages"
        ) from None


def call_function(tc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a tool call holding ``name``/``arguments`` (OpenAI nests it in ``function``)."""
    fn = tc.get("function")
    return fn if isinstance(fn, Mapping) else tc


def resolve_tool_names(messages: Sequence[Mapping[str, Any]]) -> list[str | None]:
    """Function name of each tool message: its ``name``, else its ``tool_call_id`` resolved.

    The id is looked up among the ``tool_calls`` of earlier assistant messages (the most recent
    match wins; ``tool_calls[j]["function"]["name"]`` or ``tool_calls[j]["name"]``).

    Args:
        messages: chat messages (dicts with ``role``; tool messages with ``name`` and/or
            ``tool_call_id``).

    Returns:
        ``[M]``: the name for each ``tool`` message, ``None`` for other roles and for a tool
        message with neither ``name`` nor ``tool_call_id``.

    Raises:
        ValueError: a ``tool_call_id`` matches no earlier tool call.

    Examples:
        >>> resolve_tool_names([
        ...     {"role": "assistant", "content": "", "tool_calls": [
        ...         {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        ...     {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        ...     {"role": "tool", "name": "cat", "content": "hi"},
        ... ])
        [None, 'ls', 'cat']
    """
    names: list[str | None] = []
    issued: dict[str, str] = {}
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "assistant":
            for j, tc in enumerate(m.get("tool_calls") or []):
                fn = call_function(tc)
                call_id, call_name = tc.get("id"), fn.get("name")
                if call_id is not None and not isinstance(call_id, str):
                    raise TypeError(
                        f"messages[{i}].tool_calls[{j}].id must be a str, got {call_id!r}"
                    )
                if call_id and isinstance(call_name, str):
                    issued[call_id] = call_name
        if role != "tool":
            names.append(None)
            continue
        name = m.get("name")
        if name is not None:
            names.append(name)
            continue
        call_id = m.get("tool_call_id")
        if call_id is None:
            names.append(None)
            continue
        if call_id not in issued:
            raise ValueError(
                f"messages[{i}] (role 'tool') has tool_call_id {call_id!r}, which matches no tool "
                f"call of an earlier assistant message (known ids: {sorted(issued)}); fix the id or "
                "give the tool message a 'name'"
            )
        names.append(issued[call_id])
    return names


# -- payload fields ---------------------------------------------------------------------------

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Field:
    """One payload value of one message whose rendering is body: a text (content, a text part,
    reasoning, string tool-call arguments), a tool-call name, or tool-call arguments given as a
    mapping. ``path`` leads from the message dict to the value."""

    index: int  # global field number, in message order
    message: int
    kind: str  # "text" | "name" | "args"
    path: Path


def _has_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def message_fields(m: Mapping[str, Any], k: int, start: int) -> list[Field]:
    """The fields of message ``k``, numbered from ``start``. Whitespace-only texts and empty
    values are not fields: templates branch on emptiness (``{% if content %}``, ``| trim``), so
    they stay as they are in every rendering and render as scaffold."""
    out: list[Field] = []

    def add(kind: str, path: Path) -> None:
        out.append(Field(index=start + len(out), message=k, kind=kind, path=path))

    for key in TEXT_FIELDS:
        value = m.get(key)
        if _has_text(value):
            add("text", (key,))
        elif key == "content" and isinstance(value, Sequence) and not isinstance(value, str):
            for j, part in enumerate(value):
                if part.get("type") == "text" and _has_text(part.get("text")):
                    add("text", (key, j, "text"))
    for j, tc in enumerate(m.get("tool_calls") or []):
        fn = call_function(tc)
        base: Path = ("tool_calls", j, "function") if fn is not tc else ("tool_calls", j)
        if isinstance(fn.get("name"), str) and fn["name"]:
            add("name", (*base, "name"))
        args = fn.get("arguments")
        if _has_text(args):
            add("text", (*base, "arguments"))
        elif isinstance(args, Mapping) and args:
            add("args", (*base, "arguments"))
    return out


def get_path(m: Mapping[str, Any], path: Path) -> Any:
    node: Any = m
    for step in path:
        node = node[step]
    return node


def with_values(m: Mapping[str, Any], values: Sequence[tuple[Path, Any]]) -> dict[str, Any]:
    """A copy of message ``m`` with the value at each path replaced; containers on a path are
    copied (never the whole message deeply), so the caller's message is untouched."""
    out = dict(m)
    for path, value in values:
        node: Any = out
        for step in path[:-1]:
            child = node[step]
            child = dict(child) if isinstance(child, Mapping) else list(child)
            node[step] = child
            node = child
        node[path[-1]] = value
    return out
