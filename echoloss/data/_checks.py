"""Value checks of the data path: token ids, log-probabilities, echo weights, temperatures.

Built on the message style of `echoloss._validate` (``<name> must be <expected>, got
<actual>; <fix>``). The ranges come from where the values end up: packed batches store token ids
as int64 and every float stream as float32, so a value that does not survive that conversion is
an error here rather than a silent ``0``/``inf`` later (docs/spec.md §2.3).
"""

from __future__ import annotations

import math
from typing import Any

from echoloss._validate import describe, finite_float_list, int_list, problem

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "LOGPROB_SLACK",
    "MAX_TOKENS",
    "MAX_TOKEN_ID",
    "exact_bool",
    "exact_int",
    "float32_weight",
    "logprob_list",
    "positive_float32",
    "token_id_list",
]

MAX_TOKEN_ID = 2**63 - 1
"""Largest token id an int64 ``input_ids`` tensor holds."""

MAX_TOKENS = 2**31 - 1
"""Largest token count of a sequence or a packed batch: ``cu_seqlens`` are int32
(FlashAttention's varlen convention). A length beyond it is an error, not an attempt to allocate
it."""

FLOAT32_TINY = 1.1754943508222875e-38
"""Smallest positive normal float32: packed weights and temperatures below it lose precision or
round to 0."""

FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: packed values above it become ``inf``."""

LOGPROB_SLACK = 1e-6
"""Largest accepted log-probability. A log-probability is ``≤ 0``; a log-softmax evaluated as
``x − logsumexp`` can land a few float32 ulps above 0 for a near-certain token, which this slack
admits. Anything larger is not a log-probability (typically a negative log-likelihood column)."""


def exact_int(
    name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None, fix: str = ""
) -> int:
    """An exact ``int`` (``bool``, floats and strings refused) in ``[minimum, maximum]``.

    Examples:
        >>> exact_int("prompt_len", 2.5, minimum=0)
        Traceback (most recent call last):
        ...
        TypeError: prompt_len must be an int >= 0, got float 2.5
    """
    expected = "an int" if minimum is None else f"an int >= {minimum}"
    if maximum is not None:
        expected += f" and <= {maximum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(problem(name, expected, describe(value), fix))
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(problem(name, expected, describe(value), fix))
    return value


def exact_bool(name: str, value: Any, fix: str = "") -> bool:
    """An exact ``bool`` (``"no"``, ``0`` and ``None`` are refused).

    Examples:
        >>> exact_bool("errored", "no")
        Traceback (most recent call last):
        ...
        TypeError: errored must be a bool, got str 'no'
    """
    if not isinstance(value, bool):
        raise TypeError(problem(name, "a bool", describe(value), fix))
    return value


def token_id_list(name: str, values: Any, *, vocab_size: int | None = None) -> list[int]:
    """Token ids: exact ints in ``[0, 2**63)`` (and ``< vocab_size`` when it is known).

    Examples:
        >>> token_id_list("prompt_ids", [1, -2])
        Traceback (most recent call last):
        ...
        ValueError: prompt_ids[1] must be a token id in [0, 2**63), got int -2; token ids index the vocabulary
    """
    out = int_list(name, values)
    upper = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
    for i, v in enumerate(out):
        if v < 0 or v > upper:
            expected = (
                "a token id in [0, 2**63)"
                if vocab_size is None
                else f"a token id in [0, vocab_size={vocab_size})"
            )
            raise ValueError(
                problem(f"{name}[{i}]", expected, describe(v), "token ids index the vocabulary")
            )
    return out


def logprob_list(name: str, values: Any) -> list[float]:
    """Finite log-probabilities: ``≤ 0`` (up to `LOGPROB_SLACK`) and finite in float32.

    Examples:
        >>> logprob_list("completion_logprobs", [-0.5, 0.7])
        Traceback (most recent call last):
        ...
        ValueError: completion_logprobs[1] must be a log-probability (<= 0), got float 0.7; pass log p (sampling log-probabilities), not -log p
    """
    out = finite_float_list(name, values)
    for i, v in enumerate(out):
        if v > LOGPROB_SLACK:
            raise ValueError(
                problem(
                    f"{name}[{i}]",
                    "a log-probability (<= 0)",
                    describe(v),
                    "pass log p (sampling log-probabilities), not -log p",
                )
            )
        if v < -FLOAT32_MAX:
            raise ValueError(
                problem(
                    f"{name}[{i}]",
                    "finite in float32 (>= -3.4e38)",
                    describe(v),
                    "packed batches store log-probabilities as float32",
                )
            )
    return out


def positive_float32(name: str, value: Any, fix: str = "") -> float:
    """A real number in ``[1.18e-38, 3.4e38]``: positive and a normal float32 (temperatures).

    Examples:
        >>> positive_float32("temperature", True)
        Traceback (most recent call last):
        ...
        TypeError: temperature must be a positive float, got bool True
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(problem(name, "a positive float", describe(value), fix))
    v = float(value)
    if not (math.isfinite(v) and FLOAT32_TINY <= v <= FLOAT32_MAX):
        raise ValueError(
            problem(
                name,
                "a positive finite float in [1.18e-38, 3.4e38] (a normal float32)",
                describe(value),
                fix or "packed batches store it as float32",
            )
        )
    return v


def float32_weight(name: str, value: Any) -> float:
    """An echo weight: finite, ``> 0`` and representable as a normal float32 (docs/spec.md §2.3).

    Examples:
        >>> float32_weight("echo_weights[3]", 1e-50)
        Traceback (most recent call last):
        ...
        ValueError: echo_weights[3] must be an echo weight in [1.18e-38, 3.4e38] (finite, > 0, a normal float32), got float 1e-50; packed batches store weights as float32, where this one would round to (almost) 0 and train nothing: use a larger weight, or None for 'not echoed'
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(problem(name, "a float > 0, or None for 'not echoed'", describe(value)))
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(
            problem(
                name,
                "a finite float > 0, or None for 'not echoed'",
                describe(value),
                "a weight of 0 would remove the token from RL and train nothing",
            )
        )
    if not FLOAT32_TINY <= v <= FLOAT32_MAX:
        raise ValueError(
            problem(
                name,
                "an echo weight in [1.18e-38, 3.4e38] (finite, > 0, a normal float32)",
                describe(value),
                "packed batches store weights as float32, where this one would "
                + ("round to (almost) 0 and train nothing" if v < 1 else "overflow to inf")
                + ": use "
                + ("a larger weight, or None for 'not echoed'" if v < 1 else "a smaller weight"),
            )
        )
    return v
