"""Echo configuration: which roles are echoed, with which weight, and which tokens of them.

Validated once at construction (pydantic) so a bad config fails where it is written, not deep in
a training step.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["STANDARD_ROLES", "EchoConfig", "EchoFilter", "RoleEcho"]

STANDARD_ROLES = ("system", "user", "assistant", "tool")


class RoleEcho(BaseModel):
    """Echo settings for one role.

    Args:
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


class EchoFilter(BaseModel):
    """A user filter that narrows echo: an import path to a callable plus keyword arguments.

    The callable is called once per trajectory as ``fn(steps, **kwargs)`` with the list of
    [`echoloss.Step`][echoloss.data.interleave.Step] and must return one ``list[bool]`` per step, each of length
    ``len(prompt_ids) + len(completion_ids)`` of that step, exact ``bool`` values. ``False`` removes a
    token from echo; ``True`` keeps whatever the roles selected (a filter never enables echo).

    Args:
        import_path: ``"package.module:function"`` or ``"package.module.function"``.
        kwargs: bound to the callable by keyword.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    import_path: str = Field(min_length=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)

    def resolve(self) -> Callable[..., Any]:
        """Import the callable and bind ``kwargs``; raises ImportError/TypeError with the path."""
        fn = import_object(self.import_path)
        if not callable(fn):
            raise TypeError(f"EchoFilter.import_path {self.import_path!r} is not callable")
        kwargs = dict(self.kwargs)

        def bound(steps: Any) -> Any:
            return fn(steps, **kwargs)

        bound.__name__ = getattr(fn, "__name__", "echo_filter")
        return bound


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


class EchoConfig(BaseModel):
    """Which observation tokens are echoed, and with which weight.

    Args:
        system, user, assistant, tool: per-role settings, ``None`` = role not echoed. At least one
            role (here or in ``other_roles``) is required. ``assistant`` echoes every completion
            token of every step (and assistant message bodies inside prompts): it *replaces* RL
            with cross-entropy on the policy's own samples.
        other_roles: settings for non-standard roles (``"developer"``, ``"ipython"``, ...), keyed by
            the exact role string. Roles not named anywhere are never echoed.
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

    def enabled_roles(self) -> dict[str, float]:
        """``{role: alpha}`` for every enabled role."""
        return {name: rc.alpha for name, rc in self.role_settings().items()}
