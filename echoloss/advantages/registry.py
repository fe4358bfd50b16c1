"""The advantage-function registry: names, import paths and callables to one per-group function."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast, overload

from echoloss._registry import Registry

__all__ = ["AdvantageFn", "list_advantage_fns", "register_advantage_fn", "resolve_advantage_fn"]

AdvantageFn = Callable[..., Sequence[float]]
"""``fn(rewards: list[float], **kwargs) -> one finite float per reward, in input order``."""

_REGISTRY: Registry[AdvantageFn] = Registry(
    "advantage fn", register_with="register_advantage_fn", forbidden=":."
)


_Fn = TypeVar("_Fn", bound=Callable[..., Sequence[float]])


@overload
def register_advantage_fn(name: str, fn: _Fn, *, overwrite: bool = False) -> _Fn: ...


@overload
def register_advantage_fn(
    name: str, fn: None = None, *, overwrite: bool = False
) -> Callable[[_Fn], _Fn]: ...


def register_advantage_fn(
    name: str, fn: _Fn | None = None, *, overwrite: bool = False
) -> _Fn | Callable[[_Fn], _Fn]:
    """Register a per-group advantage function under ``name`` (a decorator, or a direct call).

    The function must take one group's rewards as its first positional argument (``[G]``,
    ``list[float]``, survivors only) and return one finite float per reward, in input order;
    hyperparameters are keyword arguments, bound later by [`resolve_advantage_fn`][echoloss.advantages.registry.resolve_advantage_fn].
    Like every registry of echoloss (policies, echo filters): ``@register_advantage_fn(name)``
    or ``register_advantage_fn(name, fn)``, one ``overwrite`` flag, and a listing
    ([`list_advantage_fns`][echoloss.advantages.registry.list_advantage_fns]).

    Args:
        name: The registry name, e.g. ``"my_grpo"``. It may not contain ``":"`` or ``"."``,
            which mark import paths.
        fn: the function (a direct call); None = return a decorator.
        overwrite: Replace another function registered under ``name`` instead of raising
            (registering the same function again is a no-op).

    Returns:
        ``fn``; without it, a decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: If ``name`` is invalid or already registered and ``overwrite`` is False.
        TypeError: If the function is not callable.

    Examples:
        >>> from echoloss.advantages import compute_advantages
        >>> @register_advantage_fn("sign_doc_example")
        ... def sign(rewards):
        ...     return [float(r > 0) - float(r < 0) for r in rewards]
        >>> compute_advantages([2.0, -1.0], ["a", "a"], fn="sign_doc_example")
        [1.0, -1.0]
    """
    _REGISTRY.check_name(name)

    def decorator(f: _Fn) -> _Fn:
        if not callable(f):
            raise TypeError(f"register_advantage_fn({name!r}) needs a callable, got {f!r}")
        _REGISTRY.register(name, f, overwrite=overwrite)
        return f

    return decorator if fn is None else decorator(fn)


def list_advantage_fns() -> list[str]:
    """Names accepted by [`resolve_advantage_fn`][echoloss.advantages.registry.resolve_advantage_fn] and ``compute_advantages(fn=...)``.

    Returns:
        The registered names, sorted.

    Examples:
        >>> [n for n in list_advantage_fns() if n in ("grpo", "rloo")]
        ['grpo', 'rloo']
    """
    return _REGISTRY.names()


def _describe(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def _import_fn(path: str) -> AdvantageFn:
    module_name, sep, attr_path = path.partition(":")
    if not sep:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(
            f"advantage fn import path {path!r} must look like 'pkg.mod:fn' or 'pkg.mod.fn'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"cannot import module {module_name!r} for advantage fn {path!r}: {err}"
        ) from err
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise ValueError(
                f"advantage fn {path!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from err
    if not callable(obj):
        raise TypeError(f"advantage fn {path!r} resolved to a non-callable {type(obj).__name__}")
    return cast(AdvantageFn, obj)


def resolve_advantage_fn(spec: str | AdvantageFn, **kwargs: Any) -> AdvantageFn:
    """Turn a registry name, an import path or a callable into a per-group function.

    Args:
        spec: A registered name (``"grpo"``, ``"rloo"``, … see [`list_advantage_fns`][echoloss.advantages.registry.list_advantage_fns]), an
            import path to a function with the same contract (``"pkg.mod:fn"`` or
            ``"pkg.mod.fn"``), or the callable itself.
        **kwargs: Hyperparameters bound to the function (e.g. ``scale="trl"`` for ``"grpo"``).

    Returns:
        ``fn(rewards) -> list[float]`` with ``kwargs`` bound.

    Raises:
        ValueError: If the name is unknown or the import path cannot be imported.
        TypeError: If the target is not callable or does not accept the keyword arguments.

    Examples:
        >>> resolve_advantage_fn("grpo", scale="group", eps=0.0)([0.0, 2.0, 4.0])
        [-1.0, 0.0, 1.0]
        >>> resolve_advantage_fn("echoloss.advantages:rloo")([3.0, 1.0, 2.0])
        [1.5, -1.5, 0.0]
    """
    if callable(spec):
        fn = spec
    elif isinstance(spec, str):
        if spec in _REGISTRY:
            fn = _REGISTRY[spec]
        elif ":" in spec or "." in spec:
            fn = _import_fn(spec)
        else:
            raise ValueError(
                f"unknown advantage fn {spec!r}; registered names: {', '.join(list_advantage_fns())}, "
                "or give an import path 'pkg.mod:fn'"
            )
    else:
        raise TypeError(f"advantage fn must be a name, an import path or a callable, got {spec!r}")
    if not kwargs:
        return fn
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        signature = None
    if signature is not None:
        try:
            signature.bind([0.0], **kwargs)
        except TypeError as err:
            raise TypeError(
                f"advantage fn {spec if isinstance(spec, str) else _describe(fn)!r} does not accept "
                f"{sorted(kwargs)}: {err}; its signature is {signature}"
            ) from err

    def bound(rewards: list[float]) -> Sequence[float]:
        return fn(rewards, **kwargs)

    bound.__name__ = getattr(fn, "__name__", "advantage_fn")
    bound.__qualname__ = getattr(fn, "__qualname__", bound.__name__)
    bound.__doc__ = getattr(fn, "__doc__", None)
    return bound
