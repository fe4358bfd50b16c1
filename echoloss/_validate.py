"""Shared checks for untrusted per-token lists; every error names the field, index and fix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def type_name(v: Any) -> str:
    """``int``, ``str`` for builtins; ``numpy.bool`` etc. for everything else."""
    t = type(v)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _sequence(field: str, values: Any, what: str) -> list[Any]:
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise TypeError(f"{field} must be a list of {what}, got {type_name(values)}")
    return list(values)


def bool_list(field: str, values: Any) -> list[bool]:
    """Exact ``bool`` elements only: 0/1, numpy bools and strings are mis-built masks."""
    out = _sequence(field, values, "bool")
    for i, v in enumerate(out):
        if type(v) is not bool:
            raise TypeError(
                f"{field}[{i}] must be a bool, got {type_name(v)} {v!r}; masks are exact "
                "True/False (True = this token participates): convert with [bool(x) for x in ...]"
            )
    return out


def int_list(field: str, values: Any) -> list[int]:
    out = _sequence(field, values, "int")
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{field}[{i}] must be an int, got {type_name(v)} {v!r}")
    return out


def finite_float_list(field: str, values: Any) -> list[float]:
    out = _sequence(field, values, "float")
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{field}[{i}] must be a float, got {type_name(v)} {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"{field}[{i}] = {v} is not finite")
        out[i] = float(v)
    return out


def check_len(field: str, values: Sequence[Any], expected: int, what: str) -> None:
    if len(values) != expected:
        raise ValueError(f"{field} has length {len(values)}, expected {expected} ({what})")
