"""Echo configuration: which roles are echoed, with which weight, and which tokens of them.

Validated once at construction (pydantic) so a bad config fails where it is written, not deep in
a training step.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from echoloss._registry import Registry
from echoloss._validate import describe, problem
from echoloss.data._checks import FLOAT32_MAX, FLOAT32_TINY

__all__ = [
    "STANDARD_ROLES",
    "EchoConfig",
    "EchoFilter",
    "RoleEcho",
    "list_echo_filters",
    "register_echo_filter",
]

STANDARD_ROLES = ("system", "user", "assistant", "tool")


class RoleEcho(BaseModel):
    """Echo settings for one role.

    Attributes:
        alpha: cross-entropy weight of this role's echoed tokens; finite and ``> 0``. (There is no
            "echo with weight 0": a weight of 0 would take tokens out of the RL set yet train nothing,
            and would still count in echo denominators. To stop echoing a role, leave it ``None``.)
        tool_names: for the ``tool`` role only, an allow-list of function names. ``None`` (default)
            echoes every tool message, *including* those whose name could not be resolved; a set
            echoes only tool messages whose resolved name is in it. An empty set is rejected.

    Examples:
        >>> RoleEcho(alpha=0.05, tool_names=["bash"]).tool_names
        frozenset({'bash'})
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    alpha: float = Field(gt=0.0, description="Cross-entropy weight; finite and > 0.")
    tool_names: frozenset[str] | None = Field(
        default=None, description="Tool allow-list (tool role only); None means every tool."
    )

    @field_validator("alpha")
    @classmethod
    def _finite_alpha(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"alpha must be finite, got {v}")
        if not FLOAT32_TINY <= v <= FLOAT32_MAX:
            raise ValueError(
                f"alpha must be in [1.18e-38, 3.4e38] (a normal float32: packed batches store "
                f"echo weights as float32), got {v}"
            )
        return v

    @field_validator("tool_names")
    @classmethod
    def _non_empty(cls, v: frozenset[str] | None) -> frozenset[str] | None:
        if v is not None and len(v) == 0:
            raise ValueError(
                "tool_names must be None (every tool) or a non-empty set of names; an empty "
                "allow-list would silently echo nothing"
            )
        return v


def import_object(path: str) -> Any:
    """Import ``"pkg.mod:attr"`` or ``"pkg.mod.attr"``; errors name the path and the fix."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"import path {path!r} must look like 'package.module:function' or "
            "'package.module.function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"cannot import module {module_name!r} from import path {path!r}: {e}"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ImportError(
                f"module {module_name!r} has no attribute {attr!r} (import path {path!r})"
            ) from e
    return obj


_FILTERS: Registry[Callable[..., Any]] = Registry(
    "echo filter", register_with="register_echo_filter", forbidden=":."
)

_Filter = TypeVar("_Filter", bound=Callable[..., Any])


@overload
def register_echo_filter(name: str, fn: _Filter, *, overwrite: bool = False) -> _Filter: ...


@overload
def register_echo_filter(
    name: str, fn: None = None, *, overwrite: bool = False
) -> Callable[[_Filter], _Filter]: ...


def register_echo_filter(
    name: str, fn: _Filter | None = None, *, overwrite: bool = False
) -> _Filter | Callable[[_Filter], _Filter]:
    """Register an echo filter under ``name`` (a decorator, or a direct call), for ``EchoFilter(import_path=name)``.

    A configuration names filters by registry name; registering is how your own process vouches
    for the code. The function is called as ``fn(steps, **kwargs)`` (see [`EchoFilter`][echoloss.data.echo_config.EchoFilter]).
    Like every registry of echoloss (policies, advantage functions): ``@register_echo_filter(name)``
    or ``register_echo_filter(name, fn)``, one ``overwrite`` flag, and a listing
    ([`list_echo_filters`][echoloss.data.echo_config.list_echo_filters]).

    Args:
        name: the registry name; it may not contain ``":"`` or ``"."``, which mark import paths.
        fn: the filter (a direct call); None = return a decorator.
        overwrite: replace another filter registered under ``name`` instead of raising
            (registering the same function again is a no-op).

    Returns:
        ``fn``; without it, a decorator that registers the function and returns it unchanged.

    Examples:
        >>> @register_echo_filter("keep_all_doc_example")
        ... def keep_all(steps):
        ...     return [[True] * (len(s.prompt_ids) + len(s.completion_ids)) for s in steps]
        >>> EchoFilter(import_path="keep_all_doc_example").resolve().__name__
        'keep_all'
    """
    _FILTERS.check_name(name)

    def decorator(f: _Filter) -> _Filter:
        if not callable(f):
            raise TypeError(f"register_echo_filter({name!r}) needs a callable, got {f!r}")
        _FILTERS.register(name, f, overwrite=overwrite)
        return f

    return decorator if fn is None else decorator(fn)


def list_echo_filters() -> list[str]:
    """Registered echo filter names, sorted (what ``EchoFilter(import_path=name)`` resolves).

    Examples:
        >>> @register_echo_filter("keep_everything_doc_example")
        ... def keep_everything(steps):
        ...     return [[True] * (len(s.prompt_ids) + len(s.completion_ids)) for s in steps]
        >>> "keep_everything_doc_example" in list_echo_filters()
        True
    """
    return _FILTERS.names()


class EchoFilter(BaseModel):
    """A user filter that narrows echo: a registered name (or an import path) plus keyword arguments.

    The callable is called once per trajectory as ``fn(steps, **kwargs)`` with the list of
    [`echoloss.Step`][echoloss.data.interleave.Step] and must return one ``list[bool]`` per step, each of length
    ``len(prompt_ids) + len(completion_ids)`` of that step, exact ``bool`` values. ``False`` removes a
    token from echo; ``True`` keeps whatever the roles selected (a filter never enables echo).

    Code named by a configuration runs only from the registry ([`register_echo_filter`][echoloss.data.echo_config.register_echo_filter])
    unless the caller opts in to import paths with ``allow_import_paths=True``
    (docs/spec.md §4.9): a configuration or rollout file copied from elsewhere could otherwise
    name any importable callable.

    Attributes:
        import_path: a registered name, or ``"package.module:function"`` /
            ``"package.module.function"`` (needs ``allow_import_paths=True`` to resolve).
        kwargs: bound to the callable by keyword.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    import_path: str = Field(min_length=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)

    def resolve(self, *, allow_import_paths: bool = False) -> Callable[..., Any]:
        """The callable with ``kwargs`` bound.

        Args:
            allow_import_paths: also resolve an import path (runs the named module's code).

        Raises:
            ValueError: an unknown registry name, or an import path without the opt-in.
            ImportError: the import path does not import.
            TypeError: the target is not callable.
        """
        if not isinstance(allow_import_paths, bool):
            raise TypeError(
                f"allow_import_paths must be a bool, got {type(allow_import_paths).__name__}"
            )
        path = self.import_path
        if ":" not in path and "." not in path:
            if path not in _FILTERS:
                raise ValueError(
                    f"EchoFilter.import_path {path!r} is not a registered echo filter "
                    f"(registered: {list_echo_filters()}); register it with "
                    "echoloss.register_echo_filter, or give an import path 'pkg.mod:fn'"
                )
            fn: Any = _FILTERS[path]
        elif not allow_import_paths:
            raise ValueError(
                f"EchoFilter.import_path {path!r} is an import path; a configuration runs code "
                f"only from echoloss's echo filter registry (registered: {list_echo_filters()}). "
                "If you trust this configuration, pass allow_import_paths=True (to interleave() "
                "or EchoFilter.resolve()), or register the function with "
                "echoloss.register_echo_filter and name it"
            )
        else:
            fn = import_object(path)
        if not callable(fn):
            raise TypeError(f"EchoFilter.import_path {path!r} is not callable")
        kwargs = dict(self.kwargs)

        def bound(steps: Any) -> Any:
            return fn(steps, **kwargs)

        bound.__name__ = getattr(fn, "__name__", "echo_filter")
        return bound


class EchoConfig(BaseModel):
    """Which observation tokens are echoed, and with which weight.

    Attributes:
        system, user, assistant, tool: per-role settings, ``None`` = role not echoed. At least one
            role (here or in ``other_roles``) is required. ``assistant`` echoes every completion
            token of every step (and assistant message bodies inside prompts): it *replaces* RL
            with cross-entropy on the policy's own samples.
        other_roles: settings for non-standard roles (``"developer"``, ``"ipython"``, ...), keyed by
            the exact role string. Roles not named anywhere are never echoed.
        ignored_roles: non-standard role strings your renderer emits that are deliberately not
            echoed (``{"developer"}``). A role string that is neither standard, nor in
            ``other_roles``, nor here is reported once (a misspelt ``"toool"`` would otherwise
            silently echo nothing; docs/spec.md §4.2).
        skip_initial_prompt: the initial task prompt (every token before the trajectory's first
            sampled token: the system and task messages) is not echoed, as in the ECHO paper.
        target: ``"content"`` (default; the paper's ``env_only``) echoes only message body tokens
            (``is_content``); ``"message"`` (the paper's ``full_observation``) echoes every token
            attributed to the message, template scaffold included. Scaffold trained as a target
            teaches the model to emit envelopes; use ``"message"`` only to reproduce the paper's
            ablation.
        echo_warnings: echo harness warning prefixes too. Default False: warnings are memorised in
            tens of steps and only add noise, but they are always counted in the paper's ``Z = |O|``.
        max_tokens_per_message: keep only the first N echoed tokens of each message (None = all).
        reecho_restarted_prompts: when a trajectory step cannot extend an earlier sample and a new
            sample starts, echo again the tokens it shares with an earlier sample. Default False: a
            token is trained at most once per trajectory.
        filter: optional [`EchoFilter`][echoloss.data.echo_config.EchoFilter] that can only narrow the selection.

    Examples:
        >>> cfg = EchoConfig(tool=RoleEcho(alpha=0.05))
        >>> cfg.enabled_roles()
        {'tool': 0.05}
        >>> try:
        ...     EchoConfig()  # no role enabled
        ... except ValueError as e:
        ...     print("EchoConfig enables no role" in str(e))
        True
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    system: RoleEcho | None = None
    user: RoleEcho | None = None
    assistant: RoleEcho | None = None
    tool: RoleEcho | None = None
    other_roles: dict[str, RoleEcho] = Field(default_factory=dict)
    ignored_roles: frozenset[str] = frozenset()
    skip_initial_prompt: bool = True
    target: Literal["content", "message"] = "content"
    echo_warnings: bool = False
    max_tokens_per_message: int | None = Field(default=None, ge=1)
    reecho_restarted_prompts: bool = False
    filter: EchoFilter | None = None

    @model_validator(mode="after")
    def _check(self) -> EchoConfig:
        if not self.enabled_roles():
            raise ValueError(
                "EchoConfig enables no role: set at least one of system, user, assistant, tool "
                "(or other_roles), e.g. EchoConfig(tool=RoleEcho(alpha=0.05)). A filter alone "
                "cannot enable echo"
            )
        for name in STANDARD_ROLES:
            if name in self.other_roles:
                raise ValueError(
                    f"other_roles[{name!r}]: {name!r} is a standard role; set EchoConfig.{name} instead"
                )
        for name in self.ignored_roles:
            if name in STANDARD_ROLES or name in self.other_roles:
                raise ValueError(
                    f"ignored_roles[{name!r}]: {name!r} is a standard role or named in "
                    "other_roles; ignored_roles lists only non-standard roles that are not echoed"
                )
        for name, rc in self.role_settings().items():
            if name != "tool" and rc.tool_names is not None:
                raise ValueError(
                    f"{name}.tool_names is set but the allow-list applies to the tool role only; "
                    f"remove it from the {name!r} settings"
                )
        return self

    def role_settings(self) -> dict[str, RoleEcho]:
        """Every enabled role's settings, keyed by role string."""
        out = {
            name: getattr(self, name) for name in STANDARD_ROLES if getattr(self, name) is not None
        }
        out.update(self.other_roles)
        return out

    def known_roles(self) -> frozenset[str]:
        """Every role string this config knows: standard, ``other_roles`` and ``ignored_roles``."""
        return frozenset(STANDARD_ROLES) | frozenset(self.other_roles) | self.ignored_roles

    def enabled_roles(self) -> dict[str, float]:
        """``{role: alpha}`` for every enabled role."""
        return {name: rc.alpha for name, rc in self.role_settings().items()}


@overload
def check_echo_config(name: str, config: Any, *, optional: Literal[False]) -> EchoConfig: ...


@overload
def check_echo_config(name: str, config: Any, *, optional: Literal[True]) -> EchoConfig | None: ...


def check_echo_config(name: str, config: Any, *, optional: bool) -> EchoConfig | None:
    """An [`EchoConfig`][echoloss.data.echo_config.EchoConfig] (a dict is validated into one), or None if ``optional``.

    Examples:
        >>> check_echo_config("echo", {"tool": {"alpha": 0.5}}, optional=True).enabled_roles()
        {'tool': 0.5}
    """
    if config is None and optional:
        return None
    if isinstance(config, EchoConfig):
        return config
    if isinstance(config, Mapping):
        return EchoConfig.model_validate(dict(config))
    raise TypeError(
        problem(
            name,
            "an EchoConfig" + (" or None" if optional else ""),
            describe(config),
            "build one with EchoConfig(tool=RoleEcho(alpha=0.05)) or pass its dict form",
        )
    )
