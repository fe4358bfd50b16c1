"""The grouping driver: per-rollout rewards to per-rollout advantages, one estimator call per group."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from echoloss.advantages._checks import (
    _REWARD_FIX,
    _as_list,
    _check_errored,
    _check_key,
    _finite_float,
    _is_real,
)
from echoloss.advantages.length_shaping import length_shaped_rewards
from echoloss.advantages.registry import AdvantageFn, _describe, resolve_advantage_fn

__all__ = ["compute_advantages"]


def _check_output(
    output: Any, *, n: int, group: Any, indices: list[int], fn_name: str
) -> list[float]:
    where = f"advantage fn {fn_name!r} on group {group!r} (rollouts {indices})"
    if isinstance(output, torch.Tensor) or (
        hasattr(output, "tolist") and not isinstance(output, list)
    ):
        output = output.tolist()
    if isinstance(output, (str, bytes, Mapping)) or not isinstance(output, Sequence):
        raise TypeError(
            f"{where} returned {type(output).__name__}; it must return a list of {n} floats"
        )
    if len(output) != n:
        raise ValueError(
            f"{where} returned {len(output)} values for {n} rewards; it must return exactly one "
            "advantage per reward, in input order"
        )
    result = []
    for j, value in enumerate(output):
        if not _is_real(value):
            raise TypeError(
                f"{where} returned {type(value).__name__} {value!r} at position {j}; expected a float"
            )
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(
                f"{where} returned {value} at position {j} (rollout {indices[j]}); advantages must be finite"
            )
        result.append(value)
    return result


def compute_advantages(
    rewards: Sequence[float | None],
    group_ids: Sequence[Hashable] | None,
    *,
    fn: str | AdvantageFn = "grpo",
    errored: Sequence[bool] | None = None,
    drop_group_on_error: bool = False,
    fn_kwargs: Mapping[str, Any] | None = None,
    length_costs: Sequence[float] | None = None,
) -> list[float | None]:
    """Per-rollout advantages: one call of ``fn`` per group, on that group's survivors.

    Rollouts are grouped by ``group_ids``: use a unique id per *dispatched group*, not
    ``(env, example_id)``, which merges two in-flight groups of the same example. Groups are
    processed in first-appearance order. Errored rollouts get None and are left out of their
    group's baseline (a partial group); a group with no survivors, or any errored rollout when
    ``drop_group_on_error`` (group-scored environments), gets None throughout.

    Args:
        rewards: ``[B]`` per-rollout rewards; finite for every rollout that did not error (an
            errored rollout's reward is ignored and may be None or NaN).
        group_ids: ``[B]`` a hashable group id per rollout, or None for one batch-wide group.
        fn: A registry name (``"grpo"``, ``"dr_grpo"``, ``"rloo"``, ``"max_rl"``,
            ``"reinforce"`` or one you registered), an import path ``"pkg.mod:fn"``, or a callable
            ``fn(rewards, **fn_kwargs)`` returning one finite float per reward.
        errored: ``[B]`` bool, True for rollouts that failed. Default: none failed.
        drop_group_on_error: Give the whole group None if any of its rollouts errored.
        fn_kwargs: Keyword arguments for ``fn``, e.g. ``{"scale": "trl"}``.
        length_costs: ``[B]`` per-rollout costs; if given, each group's rewards go through
            [`length_shaped_rewards`][echoloss.advantages.length_shaping.length_shaped_rewards] (on survivors) before ``fn``.

    Returns:
        ``[B]`` advantages, None for rollouts without one.

    Raises:
        ValueError: On mismatched lengths, a non-finite reward of a surviving rollout (naming the
            index), or ``fn`` returning the wrong count or a non-finite value (naming the group).
        TypeError: On an unhashable group id, a non-bool ``errored`` flag, or non-float output.

    Examples:
        >>> compute_advantages([1.0, 0.0, 0.5, 2.0], ["g0", "g0", "g0", "g1"])
        [0.5, -0.5, 0.0, 0.0]
        >>> failed = [False, True, False, False]
        >>> compute_advantages([1.0, None, 0.0, 3.0], [7, 7, 7, 8], errored=failed)
        [0.5, None, -0.5, 0.0]
        >>> compute_advantages([1.0, None, 0.0, 3.0], [7, 7, 7, 8], errored=failed,
        ...                    drop_group_on_error=True)
        [None, None, None, 0.0]
    """
    reward_list = _as_list(rewards, "rewards")
    n = len(reward_list)
    if group_ids is None:
        id_list: list[Any] = [None] * n
    else:
        id_list = _as_list(group_ids, "group_ids")
        if len(id_list) != n:
            raise ValueError(f"group_ids has length {len(id_list)}, expected {n} (one per reward)")
    failed = _check_errored(errored, n)
    if not isinstance(drop_group_on_error, bool):
        raise TypeError(f"drop_group_on_error must be a bool, got {drop_group_on_error!r}")
    if fn_kwargs is not None and not isinstance(fn_kwargs, Mapping):
        raise TypeError(
            f"fn_kwargs must be a dict of keyword arguments, got {type(fn_kwargs).__name__}"
        )
    values: list[float | None] = [None] * n
    for i in range(n):
        _check_key(id_list[i], f"group_ids[{i}]")
        if not failed[i]:
            values[i] = _finite_float(reward_list[i], f"rewards[{i}]", _REWARD_FIX)
    cost_list: list[Any] | None = None
    if length_costs is not None:
        cost_list = _as_list(length_costs, "length_costs")
        if len(cost_list) != n:
            raise ValueError(
                f"length_costs has length {len(cost_list)}, expected {n} (one per reward)"
            )
    group_fn = resolve_advantage_fn(fn, **dict(fn_kwargs or {}))
    fn_name = fn if isinstance(fn, str) else _describe(fn)

    groups: dict[Hashable, list[int]] = {}
    for i, gid in enumerate(id_list):
        groups.setdefault(gid, []).append(i)

    advantages: list[float | None] = [None] * n
    for gid, members in groups.items():
        survivors = [i for i in members if not failed[i]]
        if not survivors or (drop_group_on_error and len(survivors) < len(members)):
            continue
        group_rewards = [v for i in survivors if (v := values[i]) is not None]  # survivors: set
        try:
            if cost_list is not None:
                costs = [cost_list[i] for i in survivors]
                group_rewards = length_shaped_rewards(group_rewards, costs)
            output = group_fn(group_rewards)
        except (TypeError, ValueError) as err:
            # The estimator's own message indexes within the group; say which rollouts those are.
            error = TypeError if isinstance(err, TypeError) else ValueError
            raise error(
                f"advantage fn {fn_name!r} failed on group {gid!r} (rollouts {survivors}; "
                f"positions in this message are within the group): {err}"
            ) from err
        checked = _check_output(
            output, n=len(survivors), group=gid, indices=survivors, fn_name=fn_name
        )
        for i, a in zip(survivors, checked, strict=True):
            advantages[i] = a
    return advantages
