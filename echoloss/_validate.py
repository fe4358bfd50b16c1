"""The one check module: argument checks for untrusted input, shared by every part of echoloss.

One message style everywhere: the message starts with the argument's name (with its index or row
when one entry is wrong), says what was expected and what was given, then how to fix the call::

    <name> must be <expected>, got <actual>; <fix>
    <name> has length <n>, expected <m> (<what>)

Two families of helpers:

- lists of Python values (untrusted per-token lists of the data path): `bool_list`,
  `int_list`, `finite_float_list`, `check_len`;
- tensors (the ops and the loss): `check_tensor`, `check_per_token`, `check_chunk_size`,
  `check_bool`, `check_mask`.

Checks of tensor values that may be deferred on the device path (`check_finite`,
`check_temperature`) are ``echoloss.ops.value_checks``', beside the op that computes their
numbers. This module imports nothing from echoloss, so every layer may use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

__all__ = [
    "bool_list",
    "check_bool",
    "check_chunk_size",
    "check_count",
    "check_len",
    "check_mask",
    "check_per_token",
    "check_tensor",
    "describe",
    "finite_float",
    "finite_float_list",
    "int_list",
    "problem",
    "type_name",
]

TokenKind = Literal["bool", "int", "float"]


def type_name(v: Any) -> str:
    """``int``, ``str`` for builtins; ``numpy.bool`` etc. for everything else.

    Examples:
        >>> type_name(1), type_name(torch.zeros(1))
        ('int', 'torch.Tensor')
    """
    t = type(v)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def describe(v: Any) -> str:
    """``float32 [4, 8] on cpu`` for a tensor, the type name (and a short repr) otherwise.

    Examples:
        >>> describe(torch.zeros(2, 3)), describe("abc"), describe(None)
        ('float32 [2, 3] on cpu', "str 'abc'", 'None')
    """
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')} {list(v.shape)} on {v.device}"
    if v is None:
        return "None"
    if isinstance(v, (bool, int, float, str)):
        r = repr(v)
        return f"{type_name(v)} {r if len(r) <= 40 else r[:37] + '...'}"
    return type_name(v)


def problem(name: str, expected: str, got: str, fix: str = "") -> str:
    """The message of every check: ``<name> must be <expected>, got <got>; <fix>``.

    Examples:
        >>> problem("chunk_size", "an int ≥ 1", "int 0", "pass None for automatic")
        'chunk_size must be an int ≥ 1, got int 0; pass None for automatic'
    """
    return f"{name} must be {expected}, got {got}" + (f"; {fix}" if fix else "")


# ---- lists of Python values ----


def _sequence(field: str, values: Any, what: str) -> list[Any]:
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise TypeError(problem(field, f"a list of {what}", type_name(values)))
    return list(values)


def bool_list(field: str, values: Any) -> list[bool]:
    """Exact ``bool`` elements only: 0/1, numpy bools and strings are mis-built masks.

    Examples:
        >>> bool_list("keep", [True, 1])
        Traceback (most recent call last):
        ...
        TypeError: keep[1] must be a bool, got int 1; masks are exact True/False (True = this token participates): convert with [bool(x) for x in ...]
    """
    out = _sequence(field, values, "bool")
    for i, v in enumerate(out):
        if type(v) is not bool:
            raise TypeError(
                problem(
                    f"{field}[{i}]",
                    "a bool",
                    describe(v),
                    "masks are exact True/False (True = this token participates): convert with "
                    "[bool(x) for x in ...]",
                )
            )
    return out


def int_list(field: str, values: Any) -> list[int]:
    """Exact ``int`` elements (``bool`` is refused).

    Examples:
        >>> int_list("ids", [1, 2])
        [1, 2]
    """
    out = _sequence(field, values, "int")
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(problem(f"{field}[{i}]", "an int", describe(v)))
    return out


def finite_float_list(field: str, values: Any) -> list[float]:
    """Finite real numbers (``bool`` is refused), returned as floats.

    Examples:
        >>> finite_float_list("lp", [-1, -0.5])
        [-1.0, -0.5]
    """
    out = _sequence(field, values, "float")
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(problem(f"{field}[{i}]", "a float", describe(v)))
        if not math.isfinite(v):
            raise ValueError(problem(f"{field}[{i}]", "a finite float", repr(v)))
        out[i] = float(v)
    return out


def finite_float(name: str, value: Any, fix: str = "") -> float:
    """One finite real number (``bool`` is refused), as a float.

    Examples:
        >>> finite_float("reward", 2)
        2.0
        >>> finite_float("reward", float("nan"), "drop the rollout or pass errored=True")
        Traceback (most recent call last):
        ...
        ValueError: reward must be a finite real number, got float nan; drop the rollout or pass errored=True
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(problem(name, "a finite real number", describe(value), fix))
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(problem(name, "a finite real number", describe(out), fix))
    return out


def check_count(
    name: str,
    value: Any,
    *,
    minimum: float = 0.0,
    maximum: float = 2.0**53,
    integer: bool = False,
    fix: str = "",
) -> float:
    """A finite count or constant ``≥ minimum`` (an int, a float or a 0-dim real tensor).

    Every count, constant and factor that reaches a division or a multiplication goes through
    this check where it enters (``num_items_in_batch``, ``dp_size``, ``batch_num_tokens``,
    ...): ``bool`` is refused, NaN and ±inf are refused, and with ``integer=True`` the value
    must be a whole number. Counts above ``maximum`` (2**53: exact in float64 and int64) are
    refused too, before they overflow a conversion.

    Examples:
        >>> check_count("num_items_in_batch", torch.tensor(12.0))
        12.0
        >>> check_count("dp_size", 0, minimum=1, integer=True)
        Traceback (most recent call last):
        ...
        ValueError: dp_size must be a finite whole number ≥ 1, got int 0
    """
    what = f"a finite {'whole number' if integer else 'number'} ≥ {minimum:g}"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(
                problem(name, what + " (an int, a float or a 0-dim tensor)", describe(value), fix)
            )
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(problem(name, what, describe(value), fix))
    out = float(value) if not isinstance(value, int) else value
    if isinstance(out, float) and not math.isfinite(out):
        raise ValueError(problem(name, what, describe(out), fix))
    if out > maximum:
        raise ValueError(problem(name, f"{what} and ≤ {maximum:g}", describe(value), fix))
    if out < minimum or (integer and out != int(out)):
        raise ValueError(problem(name, what, describe(value), fix))
    return float(out)


def check_mask(name: str, t: Any, fix: str = "", *, checks: Any = None) -> torch.Tensor:
    """A ``[...]`` mask as bool: a bool tensor, or an integer/float tensor of exact 0s and 1s.

    HF-style masks arrive as ``long`` or ``float``; any value other than 0 or 1 (0.5, NaN, -1)
    is a mis-built mask and raises, naming the first bad entry, instead of being read as True.
    With ``checks`` (an `echoloss.ops.value_checks.DeferredChecks`) the values are checked through it:
    on the device path without a host read, the same error raised later.

    Examples:
        >>> check_mask("attention_mask", torch.tensor([1.0, 0.0])).tolist()
        [True, False]
        >>> check_mask("attention_mask", torch.tensor([1.0, 0.5]))
        Traceback (most recent call last):
        ...
        ValueError: attention_mask[1] must be 0 or 1 (True = this token takes part), got 0.5
    """
    tensor = check_tensor(name, t)
    if tensor.dtype == torch.bool:
        return tensor
    if tensor.is_complex():
        raise TypeError(problem(name, "a bool or 0/1 mask", describe(tensor), fix))
    integer = not tensor.dtype.is_floating_point

    def error(i: int, value: float) -> ValueError:
        return ValueError(
            problem(
                f"{name}[{i}]" if tensor.dim() <= 1 else f"{name} (flat index {i})",
                "0 or 1 (True = this token takes part)",
                repr(int(value) if integer else value),
                fix,
            )
        )

    if checks is not None and tensor.numel():
        # (bad, count, first flat index, value there): one launch on CUDA, read later.
        checks.add_rows(tensor, None, "not_01", lambda v: error(int(v[2]), v[3]) if v[0] else None)
        return tensor != 0
    bad = ((tensor != 0) & (tensor != 1)).reshape(-1)  # [numel]
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise error(i, tensor.reshape(-1)[i].item())
    return tensor != 0


def check_len(field: str, values: Sequence[Any], expected: int, what: str) -> None:
    """``<field> has length <n>, expected <m> (<what>)`` unless ``len(values) == expected``.

    Examples:
        >>> check_len("mask", [True], 2, "one per token")
        Traceback (most recent call last):
        ...
        ValueError: mask has length 1, expected 2 (one per token)
    """
    if len(values) != expected:
        raise ValueError(f"{field} has length {len(values)}, expected {expected} ({what})")


# ---- tensors ----


def check_tensor(name: str, t: Any) -> torch.Tensor:
    """``t`` itself when it is a tensor.

    Examples:
        >>> check_tensor("logits", [1.0])
        Traceback (most recent call last):
        ...
        TypeError: logits must be a torch.Tensor, got list
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(problem(name, "a torch.Tensor", describe(t)))
    return t


def check_bool(name: str, v: Any) -> bool:
    """An exact ``bool`` (not 0/1, not a string).

    Examples:
        >>> check_bool("return_entropy", 1)
        Traceback (most recent call last):
        ...
        TypeError: return_entropy must be a bool, got int 1
    """
    if not isinstance(v, bool):
        raise TypeError(problem(name, "a bool", describe(v)))
    return v


_KIND_OK: dict[str, Callable[[torch.dtype], bool]] = {
    "bool": lambda d: d == torch.bool,
    "int": lambda d: not d.is_floating_point and not d.is_complex and d != torch.bool,
    "float": lambda d: d.is_floating_point,
}
_KIND_HINT = {
    "bool": ("a bool mask (True = this token participates)", "pass mask.bool()"),
    "int": ("an integer tensor", "pass x.long()"),
    "float": ("a floating tensor", "pass x.float()"),
}


def check_per_token(
    name: str,
    t: Any,
    shape: torch.Size,
    device: torch.device,
    kind: TokenKind,
    fix: str = "",
    what: str = "one entry per logits row",
) -> torch.Tensor:
    """A per-token tensor of exactly ``shape`` on ``device``, of ``kind`` ``bool/int/float``.

    Examples:
        >>> check_per_token("rl_mask", torch.ones(2), torch.Size([2]), torch.device("cpu"), "bool")
        Traceback (most recent call last):
        ...
        TypeError: rl_mask must be a bool mask (True = this token participates), got float32 [2] on cpu; pass mask.bool()
    """
    tensor = check_tensor(name, t)
    if not _KIND_OK[kind](tensor.dtype):
        expected, hint = _KIND_HINT[kind]
        raise TypeError(problem(name, expected, describe(tensor), hint))
    if tensor.shape != shape:
        raise ValueError(problem(name, f"of shape {list(shape)} ({what})", describe(tensor), fix))
    if tensor.device != device:
        raise ValueError(
            problem(
                name,
                f"on {device}",
                f"a tensor on {tensor.device}",
                f"move it with .to('{device}')",
            )
        )
    return tensor


def check_chunk_size(chunk_size: Any) -> int | None:
    """None (automatic) or an int ≥ 1.

    Examples:
        >>> check_chunk_size(0)
        Traceback (most recent call last):
        ...
        ValueError: chunk_size must be None or an int ≥ 1 (rows per chunk), got int 0
    """
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            problem("chunk_size", "None or an int ≥ 1 (rows per chunk)", describe(chunk_size))
        )
    return chunk_size
