"""Per-group advantage estimators: pure functions of one group's rewards.

[`grpo`][echoloss.advantages.estimators.grpo] (mean-centred by default; ``scale=`` reproduces TRL / verl / OpenRLHF exactly),
[`dr_grpo`][echoloss.advantages.estimators.dr_grpo], [`rloo`][echoloss.advantages.estimators.rloo], [`max_rl`][echoloss.advantages.estimators.max_rl] and [`reinforce`][echoloss.advantages.estimators.reinforce], each registered by name.
Means and deviations are computed in exact rational arithmetic and rounded to float64 once, so
results do not depend on the order of the rewards; see ``docs/advantages.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Literal

from echoloss.advantages._checks import _check_eps, _check_rewards, _finite_float
from echoloss.advantages.registry import register_advantage_fn

__all__ = ["GrpoScale", "dr_grpo", "grpo", "max_rl", "reinforce", "rloo"]

GrpoScale = Literal["none", "group", "trl", "verl", "openrlhf"]

# (bessel, eps) per std-scaling option; eps is always added to the std, outside the sqrt.
# Sources: TRL trainer/grpo_trainer.py, verl trainer/ppo/core_algos.py, OpenRLHF
# trainer/ppo_utils/experience_maker.py (each uses torch.std / nanstd with Bessel correction).
_STD_SCALES: dict[str, tuple[bool, float]] = {
    "group": (True, 1e-6),  # default constants = verl's, which SkyRL and the ECHO config use
    "trl": (True, 1e-4),  # GRPOTrainer, scale_rewards="group": (r - mean) / (nanstd + 1e-4)
    "verl": (True, 1e-6),  # compute_grpo_outcome_advantage: (r - mean) / (torch.std + 1e-6)
    "openrlhf": (True, 1e-9),  # advantage_estimator="group_norm": (r - mean) / (std + 1e-9)
}

# Scaling a group by a power of two is exact, so the std is computed on rewards rescaled into
# [-1, 1): the variance can then neither overflow nor underflow, and the result is bit-identical
# to the unscaled formula whenever that formula does not. Scaling up stops at 2**1000 because
# 2**1074 (needed for the smallest subnormal) is not a finite double.
_MIN_SCALE_EXPONENT = -1000


def _to_unit_range(values: list[float]) -> tuple[list[float], float]:
    """Rescale by a power of two so that ``max|v| < 1``; returns ``(scaled, scale)``."""
    largest = max(abs(v) for v in values)
    if largest == 0.0:
        return list(values), 1.0
    exponent = max(math.frexp(largest)[1], _MIN_SCALE_EXPONENT)
    scale = math.ldexp(1.0, -exponent)
    return [v * scale for v in values], scale


def _exact(values: list[float]) -> list[Fraction]:
    return [Fraction(v) for v in values]


def _exact_deviations(values: list[float]) -> list[Fraction]:
    """``R_i - mean(R)`` in exact rational arithmetic (rounded once, by the caller)."""
    exact = _exact(values)
    mean = sum(exact, Fraction(0)) / len(exact)
    return [x - mean for x in exact]


def _rounded(values: list[Fraction], what: str) -> list[float]:
    try:
        return [float(v) for v in values]
    except OverflowError:
        raise ValueError(
            f"{what} advantages overflow float64: the rewards differ by more than ~1.8e308; "
            "rescale the rewards"
        ) from None


def _is_constant(values: list[float]) -> bool:
    return max(values) == min(values)


@register_advantage_fn("grpo")
def grpo(
    rewards: Sequence[float],
    *,
    scale: GrpoScale = "none",
    eps: float | None = None,
    bessel: bool | None = None,
) -> list[float]:
    """GRPO advantages of one group: the reward minus the group mean, optionally over the std.

    ``A_i = R_i - mean(R)`` with ``scale="none"`` (prime-rl's default, and Dr. GRPO);
    ``A_i = (R_i - mean(R)) / (std(R) + eps)`` otherwise, with ``eps`` added to the std
    (outside the square root). The options reproduce each framework's constants exactly:

    - ``"none"``: no std; prime-rl's default, and Dr. GRPO.
    - ``"group"``: Bessel (``n - 1``) std, ``eps=1e-6`` unless given; verl's constants.
    - ``"trl"``: Bessel std, ``eps=1e-4`` (TRL ``scale_rewards="group"``, ``nanstd``).
    - ``"verl"``: Bessel std (``torch.std``), ``eps=1e-6`` (verl ``grpo``; SkyRL and the
      ECHO paper's released config).
    - ``"openrlhf"``: Bessel std (``torch.std``), ``eps=1e-9`` (OpenRLHF ``group_norm``).

    Only ``"group"`` accepts ``eps`` and ``bessel`` (population std with ``bessel=False``); the
    framework names fix both. Deliberate differences from the frameworks, for every option: a
    singleton group gets ``[0.0]`` (verl gives ``R / (1 + 1e-6)``; OpenRLHF, and TRL's
    ``nanstd``, give NaN), and a constant group gets exact zeros (the frameworks can leave
    ``±1e-13``-sized residue from a rounded mean).

    Args:
        rewards: ``[G]`` one group's rewards (survivors only), finite, ``G >= 1``.
        scale: ``"none"`` or a std-scaling option from the table.
        eps: Added to the std; only with ``scale="group"`` (default 1e-6). Must be ``>= 0``.
        bessel: Bessel-corrected (``n - 1``) std; only with ``scale="group"`` (default True).

    Returns:
        ``[G]`` advantages, in input order.

    Raises:
        ValueError: On a non-finite reward, an unknown ``scale``, or ``eps``/``bessel`` given
            with a scale that fixes them.

    Examples:
        >>> grpo([1.0, 0.0, 0.0, 1.0])
        [0.5, -0.5, -0.5, 0.5]
        >>> grpo([0.0, 2.0, 4.0], scale="trl")  # std 2 (Bessel); ±2 / (2 + 1e-4)
        [-0.9999500024998749, 0.0, 0.9999500024998749]
        >>> grpo([0.0, 0.0, 2.0, 2.0], scale="group", eps=0.0, bessel=False)
        [-1.0, -1.0, 1.0, 1.0]
        >>> grpo([5.0]), grpo([0.3, 0.3, 0.3], scale="verl")
        ([0.0], [0.0, 0.0, 0.0])
    """
    values = _check_rewards(rewards)
    if scale == "none":
        if eps is not None or bessel is not None:
            raise ValueError(
                "grpo(scale='none') does not divide by a std, so eps/bessel have no effect; "
                "pass scale='group' (or 'trl', 'verl', 'openrlhf') to normalise by the std"
            )
    elif scale not in _STD_SCALES:
        raise ValueError(
            f"grpo scale must be one of 'none', {', '.join(repr(s) for s in _STD_SCALES)}; got {scale!r}"
        )
    elif scale != "group" and (eps is not None or bessel is not None):
        raise ValueError(
            f"grpo(scale={scale!r}) fixes eps and bessel to that framework's constants "
            f"(bessel={_STD_SCALES[scale][0]}, eps={_STD_SCALES[scale][1]}); "
            "pass scale='group' with your own eps/bessel instead"
        )
    if bessel is not None and not isinstance(bessel, bool):
        raise TypeError(f"bessel must be a bool, got {type(bessel).__name__} {bessel!r}")
    eps_value = None if eps is None else _check_eps(eps)
    n = len(values)
    if n == 1 or _is_constant(values):
        return [0.0] * n
    if scale == "none":
        return _rounded(_exact_deviations(values), "grpo")
    default_bessel, default_eps = _STD_SCALES[scale]
    use_bessel = default_bessel if bessel is None else bessel
    if eps_value is None:
        eps_value = default_eps
    # Work on the group rescaled into [-1, 1) so the variance can neither overflow nor underflow;
    # the std and eps then both carry the factor `unit`, which leaves the ratio unchanged.
    scaled, unit = _to_unit_range(values)
    deviations = _exact_deviations(scaled)
    variance = sum((d * d for d in deviations), Fraction(0)) / (n - 1 if use_bessel else n)
    denominator = math.sqrt(float(variance)) + eps_value * unit
    return [float(d) / denominator for d in deviations]


@register_advantage_fn("dr_grpo")
def dr_grpo(rewards: Sequence[float]) -> list[float]:
    """Dr. GRPO advantages: ``A_i = R_i - mean(R)``, no std (identical to ``grpo(rewards)``).

    Dr. GRPO's other change, the constant loss normaliser, belongs to the loss, not here.
    Matches verl ``norm_adv_by_std_in_grpo=False``, TRL ``scale_rewards="none"`` and OpenRLHF
    ``dr_grpo``.

    Args:
        rewards: ``[G]`` one group's rewards (survivors only), finite, ``G >= 1``.

    Returns:
        ``[G]`` advantages; ``[0.0]`` for a singleton, zeros for a constant group.

    Examples:
        >>> dr_grpo([3.0, 1.0])
        [1.0, -1.0]
    """
    return grpo(rewards)


@register_advantage_fn("rloo")
def rloo(rewards: Sequence[float]) -> list[float]:
    """RLOO advantages: each reward minus the mean of the *other* rewards in its group.

    ``A_i = R_i - (Σ_j R_j - R_i) / (G - 1)``, which equals ``G / (G - 1) · (R_i - mean(R))``;
    the same estimator as verl ``rloo`` and OpenRLHF ``rloo`` (no std). Computed exactly and
    rounded once, so ``rloo([1, 0, 0, 1])`` is symmetric (``±2/3``), unlike ``1 - 1/3``.

    Args:
        rewards: ``[G]`` one group's rewards (survivors only), finite, ``G >= 1``.

    Returns:
        ``[G]`` advantages; ``[0.0]`` for a singleton (no other rollout to compare with), zeros
        for a constant group.

    Raises:
        ValueError: On a non-finite reward, or rewards so large (~1e308) that the result
            overflows.

    Examples:
        >>> rloo([3.0, 1.0, 2.0])  # 3 - (1+2)/2, 1 - (3+2)/2, 2 - (3+1)/2
        [1.5, -1.5, 0.0]
    """
    values = _check_rewards(rewards)
    n = len(values)
    if n == 1 or _is_constant(values):
        return [0.0] * n
    exact = _exact(values)
    total = sum(exact, Fraction(0))
    return _rounded([x - (total - x) / (n - 1) for x in exact], "rloo")


@register_advantage_fn("max_rl")
def max_rl(rewards: Sequence[float]) -> list[float]:
    """MaxRL advantages: the reward minus the group mean, divided by the mean.

    ``A_i = (R_i - mean(R)) / mean(R)`` (Maximum Likelihood RL, arXiv 2602.02710; prime-rl
    ``max_rl``). For binary rewards this weights a prompt by ``1 / pass rate``. Rewards must be
    non-negative; a group whose mean is 0 carries no signal and gets zeros, as in prime-rl.
    With non-negative rewards ``|A_i| <= G - 1``, so the result never overflows.

    Args:
        rewards: ``[G]`` one group's rewards (survivors only), finite and ``>= 0``, ``G >= 1``.

    Returns:
        ``[G]`` advantages; ``[0.0]`` for a singleton, zeros for a constant or all-zero group.

    Raises:
        ValueError: On a non-finite or negative reward.

    Examples:
        >>> max_rl([1.0, 0.0, 0.0, 0.0])  # mean 1/4: (1 - 1/4) / (1/4) = 3, (0 - 1/4) / (1/4) = -1
        [3.0, -1.0, -1.0, -1.0]
    """
    values = _check_rewards(rewards)
    for i, r in enumerate(values):
        if r < 0:
            raise ValueError(
                f"rewards[{i}] = {r} is negative; max_rl divides by the mean reward and needs "
                "rewards >= 0 (e.g. a pass rate); shift the rewards or use grpo/rloo"
            )
    if len(values) == 1 or _is_constant(values):
        return [0.0] * len(values)
    exact = _exact(values)
    mean = sum(exact, Fraction(0)) / len(exact)
    return [float((x - mean) / mean) for x in exact]


@register_advantage_fn("reinforce")
def reinforce(rewards: Sequence[float], *, baseline: float | None = None) -> list[float]:
    """REINFORCE advantages with a baseline: ``A_i = R_i - b``.

    With ``baseline=None``, ``b`` is the mean of ``rewards``; through the driver with
    ``group_ids=None`` (every rollout in one group) that is REINFORCE with a batch-mean baseline
    over the surviving rollouts. With a float, ``b`` is that value (e.g. a batch mean you
    computed across groups, or a running average): the baseline then comes from outside the
    group, so a singleton gets ``R - b`` rather than 0, and ``baseline=0.0`` gives the raw
    rewards (plain REINFORCE, prime-rl with no advantage config).

    Args:
        rewards: ``[G]`` rewards, finite, ``G >= 1``.
        baseline: A finite baseline, or None for the mean of ``rewards``.

    Returns:
        ``[G]`` advantages.

    Raises:
        ValueError: On a non-finite reward or baseline, or if ``R - b`` overflows.

    Examples:
        >>> reinforce([1.0, 0.0, 0.5])  # batch mean 0.5
        [0.5, -0.5, 0.0]
        >>> reinforce([1.0, 0.0], baseline=0.25)
        [0.75, -0.25]
    """
    values = _check_rewards(rewards)
    if baseline is None:
        return grpo(values)
    b = _finite_float(baseline, "baseline", "pass a finite baseline or None for the mean")
    advantages = [r - b for r in values]
    if not all(math.isfinite(a) for a in advantages):
        raise ValueError(f"reinforce advantages R - {b} overflow float64; rescale the rewards")
    return advantages
