"""OpenEnv RFC 010 per-token role tags → [`echoloss.Sample`][echoloss.data.interleave.Sample].

RFC 010 ("env-token world modeling") describes a rollout as token ids with three aligned boolean
masks: ``action_mask`` (the agent's tokens, the RL target), ``obs_mask`` (environment output, the
world-model target) and ``warning_mask`` (harness boilerplate, excluded from the world loss by
default), plus a world-model coefficient ``λ`` (``world_model_coeff``, ``0`` = plain GRPO) and a
world-loss target (``"env_only"`` or ``"all"``). Tokens in none of the masks are context.

The mapping:

* ``prompt_ids`` are the tokens before the first action token, the completion region the rest;
  ``completion_mask`` is ``action_mask`` on the completion region.
* Echo weight ``λ`` on the world-loss target: ``obs_mask and not warning_mask`` for
  ``"env_only"``, ``obs_mask or warning_mask`` for ``"all"``. (OpenEnv's own ``"all"`` mode puts
  warnings into ``obs_mask`` already; both forms are accepted.)
* ``observation_mask`` (the paper's ``Z = |O|``): ``obs_mask or warning_mask``.
* Position 0 has no prediction and is never echoed.

Which normaliser ``λ`` multiplies is the loss's choice (``echoloss.LossConfig``): OpenEnv's
examples take a batch token mean over observation tokens, the ECHO paper a per-sequence mean
over ``|O|``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from echoloss._logging import warn_once
from echoloss.data._checks import logprob_list, positive_float32
from echoloss.data.interleave import Sample

__all__ = ["sample_from_record", "sample_from_tags"]


def _as_list(name: str, values: Any) -> list[Any]:
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        shape = getattr(values, "shape", None)
        if shape is not None and len(shape) != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(shape)}")
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be a list or a 1-D tensor, got {type(values).__name__}")
    return list(values)


def _mask(name: str, values: Any, n: int) -> list[bool]:
    out = []
    for i, v in enumerate(_as_list(name, values)):
        if v is True or v is False:
            out.append(v)
        elif isinstance(v, int) and v in (0, 1):
            out.append(bool(v))
        else:
            raise ValueError(f"{name}[{i}] = {v!r}; a mask holds bools or 0/1")
    if len(out) != n:
        raise ValueError(f"{name} has length {len(out)}, expected {n} (one per input_ids token)")
    return out


def sample_from_tags(
    input_ids: Any,
    *,
    action_mask: Any,
    obs_mask: Any,
    warning_mask: Any = None,
    world_model_coeff: float,
    world_loss_target: Literal["env_only", "all"] = "env_only",
    logprobs: Any = None,
    temperature: float = 1.0,
    env_name: str = "",
) -> Sample:
    """One [`echoloss.Sample`][echoloss.data.interleave.Sample] from RFC 010 token ids and role masks.

    Args:
        input_ids: ``[N]`` token ids (list or 1-D tensor).
        action_mask: ``[N]`` True on action tokens (RL target). Bools or 0/1.
        obs_mask: ``[N]`` True on environment-output tokens.
        warning_mask: ``[N]`` True on harness warning tokens, or None (no warnings).
        world_model_coeff: ``λ >= 0``, the echo weight; ``0`` gives a sample without echo.
        world_loss_target: ``"env_only"`` (default: ``obs_mask`` minus warnings) or ``"all"``
            (observations and warnings).
        logprobs: sampling logprobs of the action tokens: ``[N]`` aligned to ``input_ids``
            (values off the action tokens are ignored) or one per action token. None fills
            ``0.0`` placeholders (logged once): right for verifier-free echo-only training, wrong
            as the inference logprobs of an importance ratio.
        temperature: sampling temperature of the action tokens.
        env_name: stamped on the sample.

    Returns:
        The [`echoloss.Sample`][echoloss.data.interleave.Sample]: prompt = tokens before the first action token.

    Raises:
        ValueError: lengths that do not match ``input_ids``, a mask value other than bool/0/1,
            an action token that is also an observation or warning, a negative or non-finite
            ``λ``, or an unknown ``world_loss_target``.

    Examples:
        >>> s = sample_from_tags([5, 6, 7, 8, 9, 10],
        ...                      action_mask=[0, 1, 1, 0, 0, 1], obs_mask=[0, 0, 0, 1, 1, 0],
        ...                      warning_mask=[0, 0, 0, 1, 0, 0], world_model_coeff=0.05,
        ...                      logprobs=[-0.1, -0.2, -0.3])
        >>> s.prompt_ids, s.completion_ids, s.completion_mask
        ([5], [6, 7, 8, 9, 10], [True, True, False, False, True])
        >>> s.echo_weights, s.observation_mask
        ([None, None, None, None, 0.05, None], [False, False, False, True, True, False])
    """
    ids = _as_list("input_ids", input_ids)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"input_ids[{i}] must be an int, got {type(t).__name__} {t!r}")
    n = len(ids)
    if n == 0:
        raise ValueError("input_ids is empty")
    action = _mask("action_mask", action_mask, n)
    obs = _mask("obs_mask", obs_mask, n)
    warn = [False] * n if warning_mask is None else _mask("warning_mask", warning_mask, n)
    for i in range(n):
        if action[i] and (obs[i] or warn[i]):
            which = "obs_mask" if obs[i] else "warning_mask"
            raise ValueError(
                f"token {i} is in both action_mask and {which}; an action is never an observation "
                "(the RFC 010 masks are disjoint)"
            )
    if not isinstance(world_loss_target, str) or world_loss_target not in ("env_only", "all"):
        raise ValueError(f"world_loss_target = {world_loss_target!r}; expected 'env_only' or 'all'")
    coeff = world_model_coeff
    if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not math.isfinite(coeff):
        raise ValueError(f"world_model_coeff must be a finite float, got {coeff!r}")
    if coeff < 0:
        raise ValueError(f"world_model_coeff = {coeff}; λ must be >= 0 (0 = plain GRPO)")

    p = action.index(True) if any(action) else n
    n_action = sum(action)
    if logprobs is None:
        if n_action:
            warn_once(
                "openenv-no-logprobs",
                "echoloss: sample_from_tags got no logprobs; action logprobs are 0.0 placeholders",
            )
        lp_full = [0.0] * n
    else:
        lp = _as_list("logprobs", logprobs)
        if len(lp) == n:
            lp_full = [v if a else 0.0 for v, a in zip(lp, action, strict=True)]
        elif len(lp) == n_action:
            it = iter(lp)
            lp_full = [next(it) if a else 0.0 for a in action]
        else:
            raise ValueError(
                f"logprobs has length {len(lp)}; expected {n} (aligned to input_ids) or "
                f"{n_action} (one per action token)"
            )
        # Only the action tokens' values are read (the others are ignored placeholders).
        lp_full = logprob_list("logprobs (on action tokens)", lp_full)

    echo_weights = observation = None
    if coeff > 0:
        target = [
            o and not w if world_loss_target == "env_only" else o or w
            for o, w in zip(obs, warn, strict=True)
        ]
        if target[0]:
            warn_once(
                "openenv-position-zero",
                "echoloss: the first token of an OpenEnv rollout is tagged as an observation; "
                "position 0 has no prediction and is not echoed",
            )
        echo_weights = [float(coeff) if t and i > 0 else None for i, t in enumerate(target)]
        observation = [(o or w) and i > 0 for i, (o, w) in enumerate(zip(obs, warn, strict=True))]
    temp = positive_float32("temperature", temperature, "pass the sampling temperature, e.g. 0.7")
    return Sample(
        prompt_ids=ids[:p],
        completion_ids=ids[p:],
        completion_mask=action[p:],
        completion_logprobs=lp_full[p:],
        completion_temperatures=[temp] * (n - p),
        echo_weights=echo_weights,
        observation_mask=observation,
        env_name=env_name,
    )


_RECORD_KEYS = frozenset(
    {
        "input_ids",
        "token_ids",
        "action_mask",
        "obs_mask",
        "warning_mask",
        "logprobs",
        "world_model_coeff",
        "world_loss_target",
    }
)


def sample_from_record(
    record: Mapping[str, Any],
    *,
    world_model_coeff: float | None = None,
    world_loss_target: Literal["env_only", "all"] | None = None,
    temperature: float = 1.0,
    env_name: str = "",
) -> Sample:
    """[`sample_from_tags`][echoloss.adapters.openenv.sample_from_tags] on a dict: ``input_ids`` (or ``token_ids``), ``action_mask``,
    ``obs_mask``, optional ``warning_mask``, ``logprobs``, ``world_model_coeff``,
    ``world_loss_target``. Keyword arguments override the record's values. Any other key is an
    error (a misspelt ``warnings_mask`` must not be ignored).

    Examples:
        >>> s = sample_from_record({"input_ids": [1, 2, 3], "action_mask": [0, 1, 0],
        ...                         "obs_mask": [0, 0, 1], "world_model_coeff": 0.1})
        >>> s.echo_weights
        [None, None, 0.1]
    """
    if not isinstance(record, Mapping):
        raise TypeError(f"sample_from_record expects a dict, got {type(record).__name__}")
    unknown = sorted(str(k) for k in record if k not in _RECORD_KEYS)
    if unknown:
        raise ValueError(
            f"sample_from_record: unknown key(s) {unknown}; a record holds "
            f"{sorted(_RECORD_KEYS)} (a misspelt mask would otherwise be ignored). Remove or "
            "rename them"
        )
    if "input_ids" in record and "token_ids" in record:
        raise ValueError(
            "sample_from_record: the record has both 'input_ids' and 'token_ids'; keep one"
        )
    ids = record.get("input_ids", record.get("token_ids"))
    if ids is None:
        raise ValueError("record has no 'input_ids' (or 'token_ids')")
    for key in ("action_mask", "obs_mask"):
        if key not in record:
            raise ValueError(f"record has no {key!r}")
    coeff = world_model_coeff if world_model_coeff is not None else record.get("world_model_coeff")
    if coeff is None:
        raise ValueError("no world_model_coeff: put it in the record or pass world_model_coeff=")
    return sample_from_tags(
        ids,
        action_mask=record["action_mask"],
        obs_mask=record["obs_mask"],
        warning_mask=record.get("warning_mask"),
        world_model_coeff=coeff,
        world_loss_target=world_loss_target or record.get("world_loss_target", "env_only"),
        logprobs=record.get("logprobs"),
        temperature=temperature,
        env_name=env_name,
    )
