"""Per-group advantage estimators, RAE baselines, the grouping driver and token broadcast.

Every estimator is a pure function of one group's rewards (``list[float]`` in, one float per
reward out, in input order) so the same arithmetic serves any orchestrator:

- :func:`grpo` (mean-centred by default; ``scale=`` reproduces TRL / verl / OpenRLHF exactly),
  :func:`dr_grpo`, :func:`rloo`, :func:`max_rl` and :func:`reinforce`;
- :func:`length_shaped_rewards` / :func:`with_length_shaping`: prime-rl's correctness-gated
  length shaping, applied to the rewards before any estimator;
- :class:`RAE`: SPIRAL's per-key EMA baselines, with both published update orders;
- :func:`compute_advantages`: groups rollouts by a unique group id, drops errored rollouts
  (partial groups), and validates what a custom estimator returns;
- :func:`broadcast_advantages` / :func:`broadcast_packed_advantages`: per-rollout advantages to
  per-token tensors over the RL mask.

Rules shared by every group-relative estimator: a singleton group gets ``[0.0]`` (it has no
baseline of its own), a constant-reward group gets zeros, and no finite input gives NaN or inf.
Means and deviations are computed in exact rational arithmetic and rounded to float64 once, so
results do not depend on the order of the rewards; see ``docs/advantages.md``.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "RAE",
    "AdvantageFn",
    "broadcast_advantages",
    "broadcast_packed_advantages",
    "compute_advantages",
    "dr_grpo",
    "grpo",
    "length_shaped_rewards",
    "list_advantage_fns",
    "max_rl",
    "register_advantage_fn",
    "reinforce",
    "resolve_advantage_fn",
    "rloo",
    "with_length_shaping",
]

AdvantageFn = Callable[..., Sequence[float]]
"""``fn(rewards: list[float], **kwargs) -> one finite float per reward, in input order``."""

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

_RAE_STATE_VERSION = 1


def _is_real(value: Any) -> bool:
    # bool is an int subclass; a mask passed where rewards belong must fail, not become 0/1.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_list(values: Any, field: str) -> list[Any]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{field} must be 1-D, got a tensor of shape {tuple(values.shape)}")
        return values.tolist()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(f"{field} must be a sequence, got {type(values).__name__}")
    if hasattr(values, "tolist"):  # numpy arrays: plain Python scalars, one per rollout
        values = values.tolist()
    return list(values)


def _finite_float(value: Any, field: str, fix: str) -> float:
    if not _is_real(value):
        raise TypeError(
            f"{field} must be a real number, got {type(value).__name__} {value!r}; {fix}"
        )
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{field} = {result} is not finite; {fix}")
    return result


_REWARD_FIX = (
    "every reward must be a finite float (if the rollout failed, pass it in "
    "compute_advantages(errored=...) instead of giving it a placeholder reward)"
)


def _check_rewards(rewards: Any, field: str = "rewards") -> list[float]:
    values = _as_list(rewards, field)
    if not values:
        raise ValueError(f"{field} is empty; a group needs at least one reward")
    return [_finite_float(v, f"{field}[{i}]", _REWARD_FIX) for i, v in enumerate(values)]


def _check_eps(eps: Any) -> float:
    value = _finite_float(eps, "eps", "pass a finite eps >= 0")
    if value < 0:
        raise ValueError(f"eps must be >= 0, got {value}")
    return value


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


_REGISTRY: dict[str, AdvantageFn] = {}


def register_advantage_fn(
    name: str, *, overwrite: bool = False
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register a per-group advantage function under ``name`` (a decorator).

    The function must take one group's rewards as its first positional argument (``[G]``,
    ``list[float]``, survivors only) and return one finite float per reward, in input order;
    hyperparameters are keyword arguments, bound later by :func:`resolve_advantage_fn`.

    Args:
        name: The registry name, e.g. ``"my_grpo"``. It may not contain ``":"`` or ``"."``,
            which mark import paths.
        overwrite: Replace an existing registration instead of raising.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        ValueError: If ``name`` is invalid or already registered and ``overwrite`` is False.

    Examples:
        >>> @register_advantage_fn("sign_doc_example")
        ... def sign(rewards):
        ...     return [float(r > 0) - float(r < 0) for r in rewards]
        >>> compute_advantages([2.0, -1.0], ["a", "a"], fn="sign_doc_example")
        [1.0, -1.0]
    """
    if not isinstance(name, str) or not name or ":" in name or "." in name:
        raise ValueError(
            f"advantage fn name must be a non-empty str without ':' or '.', got {name!r}"
        )

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if not callable(fn):
            raise TypeError(f"register_advantage_fn({name!r}) needs a callable, got {fn!r}")
        if name in _REGISTRY and not overwrite and _REGISTRY[name] is not fn:
            raise ValueError(
                f"advantage fn {name!r} is already registered ({_describe(_REGISTRY[name])}); "
                "pick another name or pass overwrite=True"
            )
        _REGISTRY[name] = fn
        return fn

    return decorator


def list_advantage_fns() -> list[str]:
    """Names accepted by :func:`resolve_advantage_fn` and ``compute_advantages(fn=...)``.

    Returns:
        The registered names, sorted.

    Examples:
        >>> [n for n in list_advantage_fns() if n in ("grpo", "rloo")]
        ['grpo', 'rloo']
    """
    return sorted(_REGISTRY)


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
    return obj


def resolve_advantage_fn(spec: str | AdvantageFn, **kwargs: Any) -> AdvantageFn:
    """Turn a registry name, an import path or a callable into a per-group function.

    Args:
        spec: A registered name (``"grpo"``, ``"rloo"``, … see :func:`list_advantage_fns`), an
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


def length_shaped_rewards(rewards: Sequence[float], costs: Sequence[float]) -> list[float]:
    """Amplify the rewards of correct rollouts that were cheaper than the correct average.

    prime-rl's correctness-gated ``length_penalty`` (``tokens`` or ``turns``): a rollout is
    *correct* if its reward equals the group maximum and that maximum is positive. With
    ``mean_c`` the mean cost of the correct rollouts, ``bonus_i = clamp(1 - c_i / mean_c, 0, 1)``
    and ``R'_i = R_i · (1 + bonus_i)`` for correct rollouts (up to 2× for a free rollout);
    incorrect rollouts keep their reward. If the maximum reward is ``<= 0`` or ``mean_c <= 0``
    the rewards are returned unchanged. Feed the result to any estimator (prime-rl uses
    mean-centred GRPO), or use :func:`with_length_shaping`.

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
    """Wrap an estimator so it sees :func:`length_shaped_rewards` instead of the raw rewards.

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


RaeOrder = Literal["score_then_update", "update_then_score"]


def _key_to_state(key: Any) -> Any:
    # JSON has no tuples; lists are unhashable, so turning lists back into tuples is unambiguous.
    if isinstance(key, tuple):
        return [_key_to_state(k) for k in key]
    return key


def _key_from_state(obj: Any) -> Any:
    if isinstance(obj, list):
        return tuple(_key_from_state(k) for k in obj)
    return obj


def _check_key(key: Any, field: str) -> Hashable:
    try:
        hash(key)
    except TypeError as err:
        raise TypeError(
            f"{field} = {key!r} is not hashable; use a str, int or a tuple of them, e.g. (env, role)"
        ) from err
    return key


class RAE:
    """Role-conditioned advantage estimation (SPIRAL): one EMA baseline per key.

    Each key (any hashable, e.g. ``(env_name, role)``) has a baseline ``b`` that starts at 0 and
    follows ``b ← decay · b + (1 - decay) · R``. Two orders are published:

    - ``"score_then_update"`` (SPIRAL's released code, prime-rl ``algo.type="rae"``):
      ``A = R - b``, then update; the advantage never includes its own reward.
    - ``"update_then_score"`` (the SPIRAL paper's Algorithm 1): update, then
      ``A = R - b_new = decay · (R - b_old)``.

    Rewards are processed in call order, one at a time, so the result depends on the order of
    rollouts sharing a key. No std normalisation; any group size works, including 1. With a
    single key this is REINFORCE with an EMA baseline.

    The state is in memory; :meth:`state_dict` / :meth:`load_state_dict` make a resumed run
    continue bit-identically. Keys that round-trip through JSON: ``str``, ``int``, ``float``,
    ``bool``, ``None`` and (nested) tuples of those; tuples are stored as lists and turned back
    into tuples on load. Other hashables (frozensets, enums, …) round-trip only through pickle
    (``torch.save`` / ``torch.load(weights_only=False)``).

    Args:
        decay: EMA decay in ``[0, 1)`` (SPIRAL's α; default 0.95 as in SPIRAL and prime-rl).
        order: ``"score_then_update"`` (default) or ``"update_then_score"``.

    Raises:
        ValueError: If ``decay`` is outside ``[0, 1)`` or ``order`` is unknown.

    Examples:
        >>> rae = RAE(decay=0.5)
        >>> rae.advantage(("chess", 0), 1.0)  # baseline 0 → A = 1; then b = 0.5·0 + 0.5·1
        1.0
        >>> rae.advantage(("chess", 0), 1.0), rae.baseline(("chess", 0))  # A = 1 - 0.5; b = 0.75
        (0.5, 0.75)
        >>> RAE(decay=0.5, order="update_then_score").advantage("solo", 1.0)  # b = 0.5 first
        0.5
    """

    def __init__(self, decay: float = 0.95, order: RaeOrder = "score_then_update") -> None:
        value = _finite_float(decay, "decay", "pass a decay in [0, 1), e.g. 0.95")
        if not 0.0 <= value < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {value}; SPIRAL and prime-rl use 0.95")
        if order not in ("score_then_update", "update_then_score"):
            raise ValueError(
                f"order must be 'score_then_update' (SPIRAL code, prime-rl) or "
                f"'update_then_score' (SPIRAL paper Alg. 1), got {order!r}"
            )
        self.decay: float = value
        self.order: RaeOrder = order
        self._baselines: dict[Hashable, float] = {}

    def __repr__(self) -> str:
        return f"RAE(decay={self.decay!r}, order={self.order!r}, keys={len(self._baselines)})"

    def baseline(self, key: Hashable) -> float:
        """The current baseline of ``key`` (0.0 if the key was never seen)."""
        return self._baselines.get(_check_key(key, "key"), 0.0)

    def advantage(self, key: Hashable, reward: float) -> float:
        """Score one reward against its key's baseline and update the baseline.

        Args:
            key: Any hashable, e.g. ``(env_name, role)``.
            reward: The rollout's (or the role's) finite scalar reward.

        Returns:
            The advantage ``R - b`` under the configured order.

        Raises:
            ValueError: On a non-finite reward, or an overflowing result (state unchanged).
        """
        key = _check_key(key, "key")
        r = _finite_float(reward, "reward", _REWARD_FIX)
        old = self._baselines.get(key, 0.0)
        new = self.decay * old + (1.0 - self.decay) * r
        advantage = r - (old if self.order == "score_then_update" else new)
        if not (math.isfinite(new) and math.isfinite(advantage)):
            raise ValueError(
                f"RAE advantage for key {key!r} overflows float64; rescale the rewards"
            )
        self._baselines[key] = new
        return advantage

    def advantages(
        self,
        keys: Sequence[Hashable],
        rewards: Sequence[float | None],
        *,
        errored: Sequence[bool] | None = None,
    ) -> list[float | None]:
        """Score a batch in order; errored rollouts get None and leave the baselines alone.

        Args:
            keys: ``[B]`` one key per rollout.
            rewards: ``[B]`` rewards (an errored rollout's reward is ignored and may be None).
            errored: ``[B]`` bool, True for rollouts that failed. Default: none failed.

        Returns:
            ``[B]`` advantages, None where ``errored``.

        Raises:
            ValueError: On mismatched lengths or a non-finite reward of a surviving rollout;
                the state is unchanged then.

        Examples:
            >>> rae = RAE(decay=0.5)
            >>> rae.advantages(["a", "a", "b"], [1.0, None, 2.0], errored=[False, True, False])
            [1.0, None, 2.0]
        """
        key_list = _as_list(keys, "keys")
        reward_list = _as_list(rewards, "rewards")
        n = len(key_list)
        if len(reward_list) != n:
            raise ValueError(f"rewards has length {len(reward_list)}, expected {n} (one per key)")
        failed = _check_errored(errored, n)
        for i in range(n):
            _check_key(key_list[i], f"keys[{i}]")
            if not failed[i]:
                _finite_float(reward_list[i], f"rewards[{i}]", _REWARD_FIX)
        snapshot = dict(self._baselines)
        try:
            return [
                None if failed[i] else self.advantage(key_list[i], reward_list[i]) for i in range(n)
            ]
        except ValueError:
            self._baselines = snapshot
            raise

    def state_dict(self) -> dict[str, Any]:
        """A JSON- and ``torch.save``-friendly copy of the state.

        Returns:
            ``{"version": 1, "decay": float, "order": str, "baselines": [[key, value], ...]}``,
            with tuple keys stored as lists and the baselines in first-seen order.

        Examples:
            >>> rae = RAE(decay=0.5)
            >>> _ = rae.advantage(("env", "p0"), 2.0)
            >>> rae.state_dict()
            {'version': 1, 'decay': 0.5, 'order': 'score_then_update', 'baselines': [[['env', 'p0'], 1.0]]}
        """
        return {
            "version": _RAE_STATE_VERSION,
            "decay": self.decay,
            "order": self.order,
            "baselines": [[_key_to_state(k), v] for k, v in self._baselines.items()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore baselines saved by :meth:`state_dict` (after JSON or ``torch.save``).

        Args:
            state: A state dict whose ``decay`` and ``order`` equal this estimator's.

        Raises:
            ValueError: If the state is malformed, from another version, or was saved with a
                different ``decay``/``order`` (build the estimator with
                :meth:`from_state_dict` to take them from the state instead).

        Examples:
            >>> import json
            >>> rae = RAE(decay=0.5)
            >>> _ = rae.advantage(("env", 1), 3.0)
            >>> restored = RAE(decay=0.5)
            >>> restored.load_state_dict(json.loads(json.dumps(rae.state_dict())))
            >>> restored.baseline(("env", 1))
            1.5
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"RAE state must be a dict from state_dict(), got {type(state).__name__}"
            )
        missing = {"version", "decay", "order", "baselines"} - set(state)
        if missing:
            raise ValueError(
                f"RAE state is missing {sorted(missing)}; expected the output of state_dict()"
            )
        if state["version"] != _RAE_STATE_VERSION:
            raise ValueError(
                f"RAE state version {state['version']!r} is not supported (expected {_RAE_STATE_VERSION})"
            )
        if state["decay"] != self.decay or state["order"] != self.order:
            raise ValueError(
                f"RAE state was saved with decay={state['decay']!r}, order={state['order']!r} but this "
                f"estimator has decay={self.decay!r}, order={self.order!r}; construct it with the "
                "saved values or use RAE.from_state_dict(state)"
            )
        entries = state["baselines"]
        if not isinstance(entries, (list, tuple)):
            raise ValueError(
                f"RAE state 'baselines' must be a list of [key, value] pairs, got {type(entries).__name__}"
            )
        baselines: dict[Hashable, float] = {}
        for i, entry in enumerate(entries):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise ValueError(
                    f"RAE state baselines[{i}] must be a [key, value] pair, got {entry!r}"
                )
            key = _check_key(_key_from_state(entry[0]), f"baselines[{i}] key")
            if key in baselines:
                raise ValueError(f"RAE state baselines[{i}] repeats key {key!r}")
            baselines[key] = _finite_float(
                entry[1], f"baselines[{i}] value", "the state is corrupt"
            )
        self._baselines = baselines

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> RAE:
        """Build an estimator with the ``decay``, ``order`` and baselines of ``state``.

        Examples:
            >>> rae = RAE(decay=0.9, order="update_then_score")
            >>> RAE.from_state_dict(rae.state_dict())
            RAE(decay=0.9, order='update_then_score', keys=0)
        """
        if not isinstance(state, Mapping) or "decay" not in state or "order" not in state:
            raise ValueError("RAE.from_state_dict needs the output of RAE.state_dict()")
        rae = cls(decay=state["decay"], order=state["order"])
        rae.load_state_dict(state)
        return rae


def _check_errored(errored: Sequence[bool] | None, n: int) -> list[bool]:
    if errored is None:
        return [False] * n
    flags = _as_list(errored, "errored")
    if len(flags) != n:
        raise ValueError(f"errored has length {len(flags)}, expected {n} (one per rollout)")
    for i, flag in enumerate(flags):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                f"errored[{i}] must be a bool, got {type(flag).__name__} {flag!r}; "
                "True marks a rollout that failed"
            )
    return [bool(flag) for flag in flags]


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
            :func:`length_shaped_rewards` (on survivors) before ``fn``.

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
        group_rewards = [values[i] for i in survivors]
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


def _advantage_tensor(
    advantages: Sequence[float | None] | torch.Tensor, n: int, device: torch.device, field: str
) -> tuple[torch.Tensor, list[int]]:
    """``[n]`` float32 advantages on ``device`` and the indices that had None."""
    if isinstance(advantages, torch.Tensor):
        if advantages.dim() != 1 or advantages.shape[0] != n:
            raise ValueError(f"{field} must have shape [{n}], got {tuple(advantages.shape)}")
        if not advantages.is_floating_point():
            raise TypeError(f"{field} must be a floating tensor, got {advantages.dtype}")
        values = advantages.to(device=device, dtype=torch.float32)
        missing: list[int] = []
    else:
        items = _as_list(advantages, field)
        if len(items) != n:
            raise ValueError(f"{field} has length {len(items)}, expected {n}")
        missing = [i for i, a in enumerate(items) if a is None]
        floats = [
            0.0 if a is None else _finite_float(a, f"{field}[{i}]", "advantages must be finite")
            for i, a in enumerate(items)
        ]
        values = torch.tensor(floats, dtype=torch.float32, device=device)
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{field}[{i}] is not finite in float32 (got {advantages[i]!r}); advantages must be "
            "finite and below 3.4e38 in magnitude"
        )
    return values, missing


def _check_bool_mask(mask: Any, field: str, dims: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{field} must be a bool tensor (True = token participates), got {mask.dtype}"
        )
    if mask.dim() != dims:
        raise ValueError(f"{field} must be {dims}-D, got shape {tuple(mask.shape)}")
    return mask


def broadcast_advantages(
    advantages: Sequence[float | None] | torch.Tensor, rl_mask: torch.Tensor
) -> torch.Tensor:
    """Spread per-rollout advantages over each rollout's RL tokens.

    Args:
        advantages: ``[B]`` one advantage per rollout (floats, None for rollouts without one,
            or a floating tensor). A None row must have no RL tokens.
        rl_mask: ``[B, T]`` bool, True where the token is trained with RL.

    Returns:
        ``[B, T]`` float32 on ``rl_mask.device``: the rollout's advantage on its RL tokens, 0
        elsewhere.

    Raises:
        TypeError: If ``rl_mask`` is not a bool tensor or ``advantages`` has the wrong type.
        ValueError: On a shape mismatch, a non-finite advantage, or a None advantage whose row
            selects RL tokens.

    Examples:
        >>> mask = torch.tensor([[False, True, True], [True, False, False]])
        >>> broadcast_advantages([0.5, -1.0], mask)
        tensor([[ 0.0000,  0.5000,  0.5000],
                [-1.0000,  0.0000,  0.0000]])
    """
    rl_mask = _check_bool_mask(rl_mask, "rl_mask", 2)
    values, missing = _advantage_tensor(advantages, rl_mask.shape[0], rl_mask.device, "advantages")
    for i in missing:
        count = int(rl_mask[i].sum())
        if count:
            raise ValueError(
                f"advantages[{i}] is None (no advantage, e.g. an errored rollout) but rl_mask[{i}] "
                f"selects {count} tokens; clear that row of the mask or drop the rollout"
            )
    return torch.where(
        rl_mask, values[:, None], torch.zeros((), dtype=torch.float32, device=rl_mask.device)
    )


def broadcast_packed_advantages(
    advantages: Sequence[float | None] | torch.Tensor,
    cu_seqlens: torch.Tensor,
    rl_mask: torch.Tensor,
) -> torch.Tensor:
    """Spread per-sequence advantages over a packed token stream.

    Sequence ``s`` occupies tokens ``cu_seqlens[s]:cu_seqlens[s + 1]`` (the FlashAttention
    varlen convention: ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == L``).

    Args:
        advantages: ``[S]`` one advantage per packed sequence (floats, None for sequences
            without one, or a floating tensor). A None sequence must have no RL tokens.
        cu_seqlens: ``[S + 1]`` int32 (or int64) cumulative sequence lengths.
        rl_mask: ``[L]`` bool, True where the token is trained with RL.

    Returns:
        ``[L]`` float32 on ``rl_mask.device``: each sequence's advantage on its RL tokens, 0
        elsewhere.

    Raises:
        TypeError: On wrong dtypes.
        ValueError: On inconsistent shapes, malformed ``cu_seqlens``, a non-finite advantage,
            or a None advantage whose span selects RL tokens.

    Examples:
        >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        >>> mask = torch.tensor([True, False, False, True, True])
        >>> broadcast_packed_advantages([2.0, -0.5], cu, mask)
        tensor([ 2.0000,  0.0000,  0.0000, -0.5000, -0.5000])
    """
    rl_mask = _check_bool_mask(rl_mask, "rl_mask", 1)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"cu_seqlens must be int32 (FlashAttention convention) or int64, got {cu_seqlens.dtype}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with S + 1 >= 1 entries, got shape {tuple(cu_seqlens.shape)}"
        )
    n_tokens = rl_mask.shape[0]
    bounds = cu_seqlens.to(device=rl_mask.device, dtype=torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    if int(bounds[0]) != 0 or int(bounds[-1]) != n_tokens or bool((lengths < 0).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at L = {n_tokens} (rl_mask length); "
            f"got {cu_seqlens.tolist()}"
        )
    n_seqs = lengths.shape[0]
    values, missing = _advantage_tensor(advantages, n_seqs, rl_mask.device, "advantages")
    for s in missing:
        count = int(rl_mask[int(bounds[s]) : int(bounds[s + 1])].sum())
        if count:
            raise ValueError(
                f"advantages[{s}] is None (no advantage, e.g. an errored rollout) but its span "
                f"{int(bounds[s])}:{int(bounds[s + 1])} has {count} RL tokens; clear them in rl_mask"
            )
    per_token = torch.repeat_interleave(values, lengths, output_size=n_tokens)  # [L]
    return torch.where(
        rl_mask, per_token, torch.zeros((), dtype=torch.float32, device=rl_mask.device)
    )
