"""Per-step echo weights: for each token of one trajectory step, an echo weight or "not echoed".

Selection is by attribution only: the role through ``message_indices → message_roles``, body vs
scaffold through ``is_content``, the tool name through ``message_tool_names``. The rules are in
``docs/data-path.md``; the short version:

* completion tokens are echoed with the assistant weight iff the assistant role is enabled;
* a prompt token is echoed iff it belongs to a message (index ≥ 0) of an enabled role, is body
  (``target="content"``) or any token of that message (``target="message"``), passes the tool
  allow-list, is not a warning (unless ``echo_warnings``), is not in the initial task prompt (unless
  ``skip_initial_prompt=False``), is within ``max_tokens_per_message``, and the filter keeps it;
* missing or inconsistent attribution disables prompt-side echo and logs one warning per cause.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from echoloss._logging import warn_once
from echoloss._validate import bool_list, type_name
from echoloss.data._checks import MAX_TOKENS, exact_int
from echoloss.data.attribution import TokenAttribution
from echoloss.data.echo_config import EchoConfig, check_echo_config

__all__ = ["StepEcho", "echo_weights", "select_step_echo", "validate_keep_mask"]


@dataclass(frozen=True)
class StepEcho:
    """Echo selection for one step, parallel to ``prompt_ids + completion_ids`` (length ``P + C``).

    Attributes:
        weights: ``[P + C]`` echo weight of each token, ``None`` = not echoed.
        observation: ``[P + C]`` True on the tokens that count in the paper's per-sequence
            normaliser ``Z = |O|``: every prompt token the roles select *before* the warning
            exclusion, the per-message cap and the filter narrow it, and the completion tokens
            that are echoed (docs/spec.md §5.3). ``weights[k] is not None`` implies
            ``observation[k]``.
    """

    weights: list[float | None]
    observation: list[bool]


def validate_keep_mask(
    keep: Any, *, prompt_len: int, completion_len: int, step_index: int = 0
) -> list[bool]:
    """Check one step's filter output: a ``list`` of exact ``bool`` of length ``P + C``.

    Raises:
        TypeError: not a list, or an element is not exactly ``bool`` (0/1, numpy bools, strings).
        ValueError: wrong length.

    Examples:
        >>> validate_keep_mask([True, False], prompt_len=1, completion_len=1)
        [True, False]
        >>> validate_keep_mask([True, 1], prompt_len=1, completion_len=1, step_index=2)
        Traceback (most recent call last):
        ...
        TypeError: echo filter: step 2, keep[1] must be a bool, got int 1; masks are exact True/False (True = this token participates): convert with [bool(x) for x in ...]
    """
    if not isinstance(keep, list):
        raise TypeError(
            f"echo filter: step {step_index}: expected list[bool], got {type_name(keep)}"
        )
    expected = prompt_len + completion_len
    if len(keep) != expected:
        raise ValueError(
            f"echo filter: step {step_index}: mask has length {len(keep)}, expected {expected} "
            f"(prompt_len={prompt_len} + completion_len={completion_len})"
        )
    return bool_list(f"echo filter: step {step_index}, keep", keep)


def _coerce_attribution(attribution: Any) -> TokenAttribution | None:
    """Accept an object or a renderer dict; an unusable one degrades to None with a warning."""
    if attribution is None or isinstance(attribution, TokenAttribution):
        return attribution
    if isinstance(attribution, Mapping):
        try:
            return TokenAttribution.from_dict(attribution)
        except (TypeError, ValueError) as e:
            warn_once(
                f"attribution-invalid:{type(e).__name__}",
                f"echoloss: prompt attribution is invalid ({e}); prompt-side echo is disabled for "
                "such steps",
            )
            return None
    warn_once(
        f"attribution-type:{type(attribution).__name__}",
        f"echoloss: prompt attribution of type {type(attribution).__name__} is not a "
        "TokenAttribution or dict; prompt-side echo is disabled for such steps",
    )
    return None


def _usable_attribution(att: TokenAttribution | None, config: EchoConfig, prompt_len: int) -> bool:
    if att is None:
        warn_once(
            "attribution-missing",
            "echoloss: a step has no prompt attribution; only completion tokens can be echoed "
            "(assistant role). Pass TokenAttribution from your renderer to echo observations",
        )
        return False
    if len(att) != prompt_len:
        warn_once(
            "attribution-length",
            f"echoloss: prompt attribution covers {len(att)} tokens but the prompt has {prompt_len}; "
            "prompt-side echo is disabled for such steps",
        )
        return False
    if config.target == "content" and not att.has_content_signal:
        warn_once(
            "attribution-no-content",
            "echoloss: prompt attribution has an empty is_content (the renderer does not mark body "
            "vs scaffold); content-only echo cannot tell them apart, so prompt-side echo is disabled. "
            "Use a renderer that fills is_content, or EchoConfig(target='message')",
        )
        return False
    return True


def select_step_echo(
    attribution: TokenAttribution | Mapping[str, Any] | None,
    config: EchoConfig | Mapping[str, Any],
    *,
    prompt_len: int,
    completion_len: int,
    keep: Sequence[bool] | None = None,
    initial_prompt_len: int | None = None,
    seen_prefix_len: int = 0,
    step_index: int = 0,
    starts_sample: bool = False,
) -> StepEcho:
    """Echo weights *and* the ``Z = |O|`` observation mask of one step.

    Same arguments as [`echo_weights`][echoloss.data.echo_weights.echo_weights]; see there, plus
    ``starts_sample``: this step's first token is position 0 of its sample, which is never
    trained (it has no preceding token to predict it from), so it is neither echoed nor counted
    in ``max_tokens_per_message`` (the cap counts tokens that are actually echoed).

    Examples:
        >>> from echoloss import EchoConfig, RoleEcho
        >>> att = {"message_indices": [0, 1, 1], "is_content": [True, False, True],
        ...        "message_roles": ["user", "tool"], "message_tool_names": [None, "ls"],
        ...        "is_warning": [False, False, True]}
        >>> s = select_step_echo(att, EchoConfig(tool=RoleEcho(alpha=0.5)), prompt_len=3,
        ...                      completion_len=0, initial_prompt_len=1)
        >>> s.weights, s.observation
        ([None, None, None], [False, False, True])
    """
    cfg = check_echo_config("config", config, optional=False)
    exact_int("prompt_len", prompt_len, minimum=0, maximum=MAX_TOKENS)
    exact_int("completion_len", completion_len, minimum=0, maximum=MAX_TOKENS - prompt_len)
    exact_int("seen_prefix_len", seen_prefix_len, minimum=0)
    exact_int("step_index", step_index, minimum=0)
    if initial_prompt_len is not None:
        exact_int("initial_prompt_len", initial_prompt_len, minimum=0)
    n = prompt_len + completion_len
    if keep is not None:
        keep = validate_keep_mask(
            keep, prompt_len=prompt_len, completion_len=completion_len, step_index=step_index
        )
    weights: list[float | None] = [None] * n
    observation = [False] * n
    roles = cfg.role_settings()
    cap = cfg.max_tokens_per_message
    taken: dict[int, int] = {}  # message index (-2 = this step's completion) -> tokens echoed

    def mark(k: int, alpha: float, message: int, is_warning: bool) -> None:
        if starts_sample and k == 0:
            return  # position 0 of the sample: never trained, so not echoed and not counted
        observation[k] = True
        if is_warning and not cfg.echo_warnings:
            return
        if keep is not None and not keep[k]:
            return  # the filter narrows only, and before the cap so the cap counts echoed tokens
        if cap is not None:
            if taken.get(message, 0) >= cap:
                return
            taken[message] = taken.get(message, 0) + 1
        weights[k] = alpha

    known = cfg.known_roles()

    if initial_prompt_len is None:
        initial_prompt_len = prompt_len  # the trajectory's first step: its whole prompt
    first_eligible = max(seen_prefix_len if not cfg.reecho_restarted_prompts else 0, 0)
    if cfg.skip_initial_prompt:
        first_eligible = max(first_eligible, initial_prompt_len)

    att = _coerce_attribution(attribution)
    if first_eligible < prompt_len and _usable_attribution(att, cfg, prompt_len):
        assert att is not None
        content_only = cfg.target == "content"
        for k in range(first_eligible, prompt_len):
            mi = att.message_indices[k]
            if mi < 0 or (content_only and not att.is_content[k]):
                continue
            role = att.message_roles[mi]
            settings = roles.get(role)
            if settings is None:
                if role not in known:
                    warn_once(
                        f"unknown-role:{role}",
                        f"echoloss: prompt attribution has a message with role {role!r}, which "
                        f"the echo config does not know (known roles: {sorted(known)}); it is "
                        "not echoed. Fix the spelling, echo it with EchoConfig.other_roles, or "
                        "declare it in EchoConfig.ignored_roles",
                    )
                continue  # unknown or disabled role: never echoed
            if role == "tool" and settings.tool_names is not None:
                name = att.tool_name_of(mi)
                if name is None and (
                    att.message_tool_names is None or mi >= len(att.message_tool_names)
                ):
                    warn_once(
                        "tool-names-missing",
                        "echoloss: a tool message has no resolved name (message_tool_names missing "
                        "or shorter than message_roles, e.g. after prompt truncation); with a "
                        "tool_names allow-list such messages are not echoed",
                    )
                if name not in settings.tool_names:
                    continue
            warning = att.is_warning is not None and att.is_warning[k]
            mark(k, settings.alpha, mi, warning)

    assistant = roles.get("assistant")
    if assistant is not None:
        for k in range(prompt_len, n):
            mark(k, assistant.alpha, -2, False)
            # A completion token is the policy's action; it counts in Z = |O| only while it is
            # echoed. One that the filter or the cap hands back to RL is an action again
            # (docs/spec.md §5.3), so it must not grow the observation count.
            observation[k] = weights[k] is not None

    return StepEcho(weights=weights, observation=observation)


def echo_weights(
    attribution: TokenAttribution | Mapping[str, Any] | None,
    config: EchoConfig | Mapping[str, Any],
    *,
    prompt_len: int,
    completion_len: int,
    keep: Sequence[bool] | None = None,
    initial_prompt_len: int | None = None,
    seen_prefix_len: int = 0,
    step_index: int = 0,
) -> list[float | None]:
    """Echo weight of every token of one trajectory step (prompt then completion).

    Args:
        attribution: the prompt's [`TokenAttribution`][echoloss.data.attribution.TokenAttribution], its plain-dict form, or ``None``.
            Missing or inconsistent attribution disables prompt-side echo (one warning per cause).
        config: the [`EchoConfig`][echoloss.data.echo_config.EchoConfig] (or its dict form).
        prompt_len: ``P``, number of prompt tokens of the step.
        completion_len: ``C``, number of completion tokens of the step.
        keep: optional filter mask ``[P + C]`` of exact bools; ``False`` removes echo, ``True``
            keeps what the roles chose (it never enables echo).
        initial_prompt_len: how many leading tokens of this step are the trajectory's initial task
            prompt (everything before its first sampled token). ``None`` means this step is the
            first of its trajectory, so its whole prompt is initial. Only used when
            ``config.skip_initial_prompt``. On a *bridged* step the earlier history is scaffold
            (``-1``) anyway.
        seen_prefix_len: how many leading tokens an earlier sample of the same trajectory already
            covered; they are not echoed again unless ``config.reecho_restarted_prompts``.
        step_index: used in error messages.

    Returns:
        ``list[float | None]`` of length ``P + C``: the echo weight, or ``None`` for "not echoed".

    Raises:
        TypeError: a length argument that is not an exact int, or ``config`` that is neither an
            [`EchoConfig`][echoloss.data.echo_config.EchoConfig] nor its dict form.
        ValueError: a negative length, or a ``keep`` mask of the wrong length.

    Examples:
        >>> from echoloss import EchoConfig, RoleEcho
        >>> att = {"message_indices": [0, 0, 1, 1, 2, 2],
        ...        "is_content": [False, True, False, True, False, True],
        ...        "message_roles": ["user", "tool", "tool"],
        ...        "message_tool_names": [None, "calc", "lookup"]}
        >>> cfg = EchoConfig(tool=RoleEcho(alpha=0.5, tool_names={"lookup"}),
        ...                  skip_initial_prompt=False)
        >>> echo_weights(att, cfg, prompt_len=6, completion_len=0)
        [None, None, None, None, None, 0.5]
    """
    return select_step_echo(
        attribution,
        config,
        prompt_len=prompt_len,
        completion_len=completion_len,
        keep=keep,
        initial_prompt_len=initial_prompt_len,
        seen_prefix_len=seen_prefix_len,
        step_index=step_index,
    ).weights
