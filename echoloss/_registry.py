"""One registry type for every extension point that is named in a configuration.

Policies (``LossConfig.policy``), advantage functions (``compute_advantages(fn=...)``) and echo
filters (``EchoFilter(import_path=...)``) are each a [`Registry`][echoloss._registry.Registry]:
the same registration rules (a decorator or a direct call, one ``overwrite`` flag, built-ins that
cannot be replaced), the same listing (``names()``, sorted) and the same error for an unknown
name. A configuration names code only through a registry, so loading a config runs no code that
the process did not register itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Names to registered values of one kind, read-only from outside except by ``register``.

    Args:
        kind: what is registered, for messages (``"policy"``, ``"advantage fn"``).
        register_with: the public function that registers one, for messages.
        forbidden: characters a name may not contain (e.g. ``":."``, which mark import paths).

    Examples:
        >>> colours = Registry[str]("colour", register_with="add_colour")
        >>> colours.register("red", "#f00")
        '#f00'
        >>> colours.register("red", "#e00")
        Traceback (most recent call last):
        ...
        ValueError: colour 'red' is already registered ('#f00'); pick another name, or pass overwrite=True to add_colour to replace it
        >>> colours.names(), colours["red"]
        (['red'], '#f00')
    """

    def __init__(self, kind: str, *, register_with: str, forbidden: str = "") -> None:
        self.kind = kind
        self.register_with = register_with
        self.forbidden = forbidden
        self._items: dict[str, T] = {}
        self._builtin: set[str] = set()
        #: A read-only live view (``name -> value``) for module-level constants.
        self.view: Mapping[str, T] = MappingProxyType(self._items)

    def check_name(self, name: object) -> str:
        """``name`` if it is a valid registry name, else a ValueError naming the rule."""
        if (
            not isinstance(name, str)
            or not name
            or name != name.strip()
            or any(c in name for c in self.forbidden)
        ):
            rule = "a non-empty str without surrounding spaces"
            if self.forbidden:
                rule += " and without " + " or ".join(repr(c) for c in self.forbidden)
            raise ValueError(f"{self.kind} name must be {rule}, got {name!r}")
        return name

    def register(self, name: str, value: T, *, overwrite: bool = False) -> T:
        """Register ``value`` under ``name``; returns ``value``.

        Registering an equal value again is a no-op (a module imported twice, a notebook cell
        run again); another value under a taken name needs ``overwrite=True``; a built-in name
        can never be replaced.
        """
        self.check_name(name)
        if not isinstance(overwrite, bool):  # "no" or "false" would replace the entry
            raise TypeError(
                f"overwrite must be a bool (True replaces {self.kind} {name!r}), got "
                f"{overwrite!r}; pass True or False"
            )
        if name in self._builtin and self._items[name] != value:
            raise ValueError(
                f"{self.kind} {name!r} is built in and cannot be replaced; register yours under "
                "another name"
            )
        if name in self._items and self._items[name] != value and not overwrite:
            raise ValueError(
                f"{self.kind} {name!r} is already registered ({_describe(self._items[name])}); "
                f"pick another name, or pass overwrite=True to {self.register_with} to replace it"
            )
        self._items[name] = value
        return value

    def is_builtin(self, name: str) -> bool:
        """Whether ``name`` is one of the entries frozen as built in."""
        return name in self._builtin

    def decorator(self, name: str, *, overwrite: bool = False) -> Callable[[T], T]:
        """``@registry.decorator(name)``: register the decorated object, return it unchanged."""
        self.check_name(name)

        def decorate(value: T) -> T:
            return self.register(name, value, overwrite=overwrite)

        return decorate

    @contextmanager
    def isolated(self) -> Iterator[None]:
        """Registrations made inside the block are undone at its end (tests, notebooks)."""
        saved = dict(self._items)
        try:
            yield
        finally:
            self._items.clear()
            self._items.update(saved)

    def freeze_builtins(self) -> None:
        """Mark every name registered so far as built in (never replaced)."""
        self._builtin.update(self._items)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _describe(value: object) -> str:
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(value)
