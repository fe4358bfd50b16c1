"""Schedules for the echo weight λ over training steps.

The echo term's weight need not be constant: a **warm-up** ramp lets the policy settle before the
world-model term pulls on shared weights, a **decay** hands the capacity back to the policy once
the observations are learned. Each schedule is a pure function of the step, so a resumed run
uses exactly the λ an uninterrupted run would.

Examples:
    >>> [round(echo_alpha(s, alpha=0.05, schedule="warmup", steps=4), 4) for s in range(6)]
    [0.0125, 0.025, 0.0375, 0.05, 0.05, 0.05]
    >>> [round(echo_alpha(s, alpha=0.05, schedule="decay", steps=4, final_alpha=0.01), 4)
    ...  for s in range(6)]
    [0.05, 0.04, 0.03, 0.02, 0.01, 0.01]
"""

from __future__ import annotations

import math
from typing import Literal

__all__ = ["SCHEDULES", "Schedule", "echo_alpha", "unused_schedule_settings"]

Schedule = Literal["constant", "warmup", "decay"]
SCHEDULES: tuple[Schedule, ...] = ("constant", "warmup", "decay")


def echo_alpha(
    step: int,
    *,
    alpha: float,
    schedule: Schedule = "constant",
    steps: int = 0,
    final_alpha: float = 0.0,
) -> float:
    """The echo weight λ at RL step ``step`` (0-based).

    Args:
        step: the RL step, counted from 0 (warm-start steps not included).
        alpha: the peak weight, finite and ``≥ 0``.
        schedule: ``"constant"`` (``alpha`` throughout), ``"warmup"`` (linear from
            ``alpha / steps`` at step 0 to ``alpha`` at step ``steps − 1``, then constant) or
            ``"decay"`` (linear from ``alpha`` at step 0 to ``final_alpha`` at step ``steps``, then
            constant).
        steps: the ramp's length in steps (``≥ 1`` for ``"warmup"`` and ``"decay"``).
        final_alpha: where ``"decay"`` ends, finite and ``≥ 0``.

    Returns:
        λ for that step (a float ``≥ 0``; ``0.0`` means no echo term at that step).

    Raises:
        ValueError: a negative step, a negative or non-finite weight, an unknown schedule, or a
            ramp schedule with ``steps < 1``.

    Examples:
        >>> echo_alpha(10, alpha=0.01)
        0.01
        >>> echo_alpha(0, alpha=0.01, schedule="warmup", steps=0)
        Traceback (most recent call last):
        ...
        ValueError: steps must be >= 1 for schedule='warmup', got 0 (the ramp's length in RL steps)
    """
    for name, count in (("step", step), ("steps", steps)):
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"{name} must be an int, got {type(count).__name__} {count!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    for name, value in (("alpha", alpha), ("final_alpha", final_alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    ignored = unused_schedule_settings(schedule, steps=steps, final_alpha=final_alpha)
    if ignored:
        raise ValueError(ignored)
    if schedule == "constant":
        return float(alpha)
    if steps < 1:
        raise ValueError(
            f"steps must be >= 1 for schedule={schedule!r}, got {steps} (the ramp's length in "
            "RL steps)"
        )
    if schedule == "warmup":
        return alpha * min(step + 1, steps) / steps
    frac = min(step, steps) / steps
    return alpha + (final_alpha - alpha) * frac


def unused_schedule_settings(schedule: str, *, steps: int, final_alpha: float) -> str:
    """The message for a setting ``schedule`` ignores (set away from its default), or ``""``.

    ``steps`` is read by the ramps only, ``final_alpha`` by ``"decay"`` only; a value the
    schedule would ignore is an error rather than silently unused.

    Examples:
        >>> unused_schedule_settings("warmup", steps=4, final_alpha=0.01)
        "final_alpha=0.01 is ignored by schedule='warmup' (only 'decay' ends at final_alpha); remove it or use schedule='decay'"
        >>> unused_schedule_settings("decay", steps=4, final_alpha=0.01)
        ''
    """
    if schedule == "constant" and steps != 0:
        return (
            f"steps={steps} is ignored by schedule='constant' (the weight never changes); "
            "remove it or use schedule='warmup' or 'decay'"
        )
    if schedule != "decay" and final_alpha != 0:
        return (
            f"final_alpha={final_alpha} is ignored by schedule={schedule!r} (only 'decay' ends "
            "at final_alpha); remove it or use schedule='decay'"
        )
    return ""
