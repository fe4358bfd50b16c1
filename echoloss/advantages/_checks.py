"""Input checks shared by the advantage estimators, the grouping driver and broadcast.

Messages use the one style of `echoloss._validate` (``<name> must be <expected>, got <actual>;
<fix>``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from echoloss._validate import describe, problem, type_name


def _is_real(value: Any) -> bool:
    # bool is an int subclass; a mask passed where rewards belong must fail, not become 0/1.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_list(values: Any, field: str) -> list[Any]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(problem(field, "1-D", describe(values)))
        return values.tolist()
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(problem(field, "a sequence", type_name(values)))
    if hasattr(values, "tolist"):  # numpy arrays: plain Python scalars, one per rollout
        values = values.tolist()
    return list(values)


def _finite_float(value: Any, field: str, fix: str) -> float:
    if not _is_real(value):
        raise TypeError(problem(field, "a real number", describe(value), fix))
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(problem(field, "a finite real number", describe(result), fix))
    return result


_REWARD_FIX = (
    "every reward must be a finite float (if the rollout failed, pass it in "
    "compute_advantages(errored=...) instead of giving it a placeholder reward)"
)


def _check_rewards(rewards: Any, field: str = "rewards") -> list[float]:
    values = _as_list(rewards, field)
    if not values:
        raise ValueError(
            problem(field, "non-empty", "an empty sequence", "a group needs at least one reward")
        )
    return [_finite_float(v, f"{field}[{i}]", _REWARD_FIX) for i, v in enumerate(values)]


def _check_eps(eps: Any) -> float:
    value = _finite_float(eps, "eps", "pass a finite eps >= 0")
    if value < 0:
        raise ValueError(problem("eps", ">= 0", describe(value)))
    return value


def _check_key(key: Any, field: str) -> Hashable:
    try:
        hash(key)
    except TypeError as err:
        raise TypeError(
            problem(
                field,
                "hashable",
                describe(key),
                "use a str, int or a tuple of them, e.g. (env, role)",
            )
        ) from err
    if isinstance(key, float) and math.isnan(key):
        # NaN != NaN: two rollouts keyed by NaN would land in separate groups (or baselines).
        raise ValueError(
            problem(
                field,
                "a key equal to itself",
                "NaN",
                "a NaN key never equals itself, so it groups nothing",
            )
        )
    return cast(Hashable, key)


def _check_errored(errored: Sequence[bool] | None, n: int) -> list[bool]:
    if errored is None:
        return [False] * n
    flags = _as_list(errored, "errored")
    if len(flags) != n:
        raise ValueError(
            problem("errored", f"of length {n} (one per rollout)", f"length {len(flags)}")
        )
    for i, flag in enumerate(flags):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(
                problem(
                    f"errored[{i}]", "a bool", describe(flag), "True marks a rollout that failed"
                )
            )
    return [bool(flag) for flag in flags]
