"""Correctness-gated length shaping of one group's rewards, applied before any estimator."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from echoloss.advantages._checks import _as_list, _check_rewards, _finite_float
from echoloss.advantages.registry import AdvantageFn, resolve_advantage_fn

__all__ = ["length_shaped_rewards", "with_length_shaping"]


def length_shaped_rewards(rewards: Sequence[float], costs: Sequence[float]) -> list[float]:
    """Amplify the rewards of correct rollouts that were cheaper than the correct average.

    prime-rl's correctness-gated ``length_penalty`` (``tokens`` or ``turns``): a rollout is
    *correct* if its reward equals the group maximum and that maximum is positive. With
    ``mean_c`` the mean cost of the correct rollouts, ``bonus_i = clamp(1 - c_i / mean_c, 0, 1)``
    and ``R'_i = R_i · (1 + bonus_i)`` for correct rollouts (up to 2× for a free rollout);
    incorrect rollouts keep their reward. If the maximum reward is ``<= 0`` or ``mean_c <= 0``
    the rewards are returned unchanged. Feed the result to any estimator (prime-rl uses
    mean-centred GRPO), or use [`with_length_shaping`][echoloss.advantages.length_shaping.with_length_shaping].

    Args:
        rewards: ``[G]`` one group's rewards, finite.
        costs: ``[G]`` each rollout's cost, finite and ``>= 0``: e.g. ``w_c · completion tokens
            + w_t · tool-response tokens`` (``tokens``) or the number of turns (``turns``).

    Returns:
        ``[G]`` shaped rewards.

    Raises:
        ValueError: On mismatched lengths, a non-finite reward or cost, or a negative cost.

    Examples:
        >>> # correct = {0, 1}, mean cost 100: bonus 1 - 50/100 = 0.5, and 1 - 150/100 → 0
        >>> length_shaped_rewards([1.0, 1.0, 0.0], [50.0, 150.0, 10.0])
        [1.5, 1.0, 0.0]
    """
    values = _check_rewards(rewards)
    cost_values = _as_list(costs, "costs")
    if len(cost_values) != len(values):
        raise ValueError(
            f"costs has length {len(cost_values)}, expected {len(values)} (one per reward)"
        )
    checked = []
    for i, c in enumerate(cost_values):
        c = _finite_float(c, f"costs[{i}]", "costs are token or turn counts")
        if c < 0:
            raise ValueError(f"costs[{i}] = {c} is negative; costs are token or turn counts (>= 0)")
        checked.append(c)
    best = max(values)
    if best <= 0:
        return values
    correct = [r >= best for r in values]
    correct_costs = [c for c, ok in zip(checked, correct, strict=True) if ok]
    mean_cost = math.fsum(correct_costs) / len(correct_costs)
    if mean_cost <= 0:
        return values
    shaped = [
        r * (1.0 + min(max(1.0 - c / mean_cost, 0.0), 1.0)) if ok else r
        for r, c, ok in zip(values, checked, correct, strict=True)
    ]
    if not all(math.isfinite(s) for s in shaped):
        raise ValueError(
            "length-shaped rewards overflow float64 (rewards near 1e308); rescale them"
        )
    return shaped


def with_length_shaping(fn: str | AdvantageFn, **kwargs: Any) -> Callable[..., Sequence[float]]:
    """Wrap an estimator so it sees [`length_shaped_rewards`][echoloss.advantages.length_shaping.length_shaped_rewards] instead of the raw rewards.

    Args:
        fn: A registry name, an import path or a per-group function.
        **kwargs: Hyperparameters bound to ``fn``.

    Returns:
        ``shaped(rewards, *, costs) -> fn(length_shaped_rewards(rewards, costs))``.

    Examples:
        >>> shaped_grpo = with_length_shaping("grpo")
        >>> # shaped rewards [1.5, 1.0, 0, 0] (see above), mean 0.625
        >>> shaped_grpo([1.0, 1.0, 0.0, 0.0], costs=[50.0, 150.0, 10.0, 10.0])
        [0.875, 0.375, -0.625, -0.625]
    """
    inner = resolve_advantage_fn(fn, **kwargs)

    def shaped(rewards: Sequence[float], *, costs: Sequence[float]) -> Sequence[float]:
        return inner(length_shaped_rewards(rewards, costs))

    name = getattr(inner, "__name__", "advantage_fn")
    shaped.__name__ = shaped.__qualname__ = f"length_shaped_{name}"
    return shaped
