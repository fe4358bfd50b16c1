"""`value_check_numbers`: the numbers of several value checks in one float64 block."""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

import torch

from echoloss._validate import describe, problem
from echoloss.ops.value_checks import naive
from echoloss.ops.value_checks.contract import NUMBERS, RULES, RowCheck

__all__ = [
    "fuse_value_checks",
    "fused_value_checks_run",
    "validate_row_check",
    "value_check_numbers",
]

_MODES = ("auto", "always", "never")


_MODE = {"mode": "auto"}


def fuse_value_checks(mode: str = "auto") -> None:
    """Choose where `value_check_numbers` runs its checks in Triton (one launch, a program per check).

    Args:
        mode: ``"auto"`` (the default): on CUDA when triton is importable; ``"always"``: also
            on cpu tensors when the Triton interpreter is active (``TRITON_INTERPRET=1`` set
            before echoloss is imported; for tests); ``"never"``: the PyTorch checks only.
            ``echoloss.loss.fused.fuse_loss_algebra`` sets this too.

    Examples:
        >>> fuse_value_checks("auto")
    """
    if mode not in _MODES:
        raise ValueError(
            problem("mode", f"one of {_MODES}", describe(mode), "pass 'auto' unless testing")
        )
    _MODE["mode"] = mode


def fused_value_checks_run(device: torch.device) -> bool:
    """Whether `value_check_numbers` runs the Triton program on ``device`` now
    (`fuse_value_checks`; never inside a compiled region).

    Examples:
        >>> fused_value_checks_run(torch.device("cpu"))
        False
    """
    return _fused_runs(device) is not None


def _fused_runs(device: torch.device) -> ModuleType | None:
    """The Triton module when it runs the checks on ``device`` (`fuse_value_checks`), else None."""
    mode = _MODE["mode"]
    if mode == "never" or (mode == "auto" and device.type != "cuda"):
        return None
    if torch.compiler.is_compiling():  # inside a compiled region: its own kernels do the work
        return None
    try:
        from echoloss.ops.value_checks import fused
    except ImportError:  # no triton: the PyTorch checks give the same numbers
        return None
    if device.type == "cuda" or (device.type == "cpu" and fused.interpreter_active()):
        return fused
    return None


def validate_row_check(check: RowCheck, *, name: str = "check") -> None:
    """Raise naming ``name`` unless ``check`` is a `RowCheck` `value_check_numbers` accepts
    (a known rule, real non-bool values, one bool row per value on their device, a whole
    bound for integer values).

    Examples:
        >>> validate_row_check(RowCheck(torch.zeros(2), None, "not_weight"))
        >>> validate_row_check(RowCheck(torch.zeros(2), None, "finite"))
        Traceback (most recent call last):
        ...
        ValueError: check.rule must be one of ('not_finite', 'above', 'below', 'not_weight', 'not_01', 'not_positive'), got str 'finite'; pick a rule of RULES
    """
    if not isinstance(check, RowCheck):
        raise TypeError(problem(name, "a RowCheck", describe(check), "build one: RowCheck(...)"))
    v = check.values
    _check_one(name, check, v.device if isinstance(v, torch.Tensor) else None)


def _check_one(name: str, check: RowCheck, device: torch.device | None) -> None:
    if not isinstance(check, RowCheck):
        raise TypeError(problem(name, "a RowCheck", describe(check), "build one: RowCheck(...)"))
    if check.rule not in RULES:
        raise ValueError(
            problem(f"{name}.rule", f"one of {RULES}", describe(check.rule), "pick a rule of RULES")
        )
    v = check.values
    if not isinstance(v, torch.Tensor) or v.dtype == torch.bool or v.is_complex():
        raise TypeError(
            problem(
                f"{name}.values",
                "a real, non-bool tensor",
                describe(v),
                "check a float or int tensor",
            )
        )
    if v.device != device:
        raise ValueError(
            problem(f"{name}.values", f"on {device}", f"on {v.device}", "one block per device")
        )
    bound = check.threshold
    if not isinstance(bound, (int, float)) or math.isnan(bound):
        raise TypeError(
            problem(f"{name}.threshold", "a number (not NaN)", describe(bound), "pass a float")
        )
    if not v.dtype.is_floating_point and not float(bound).is_integer():
        raise ValueError(
            problem(
                f"{name}.threshold",
                "a whole number for integer values",
                repr(bound),
                "round the bound",
            )
        )
    r = check.rows
    if r is not None and (
        not isinstance(r, torch.Tensor)
        or r.dtype != torch.bool
        or r.numel() != v.numel()
        or r.device != device
    ):
        raise ValueError(
            problem(
                f"{name}.rows",
                f"None or a bool tensor of {v.numel()} entries on {device} (one per value)",
                describe(r),
                "pass the mask of the rows to check, shaped like the values",
            )
        )


def value_check_numbers(
    checks: Sequence[RowCheck], *, backend: str = "auto", out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[4 · len(checks)]`` float64: the `NUMBERS` of every check, in order.

    Per check: 1 if an entry of ``values`` on ``rows`` breaks ``rule`` (else 0), how many do,
    the flat index of the first (0 when none) and the value there. ``backend="auto"`` runs
    them in one Triton launch (up to eight checks; a program each) writing into one block
    (`fuse_value_checks`), else the PyTorch checks (about eight launches each, then one to
    join them); ``"naive"`` forces the latter.
    Not recorded by autograd.

    Args:
        checks: `RowCheck` s, their values on one device.
        backend: ``"auto"`` or ``"naive"``.
        out: ``[4 · k]`` float64 on that device to write into (e.g. a slice of a larger
            block), or None for a new tensor.

    Returns:
        ``[4 · k]`` float64 on the values' device.

    Examples:
        >>> w = torch.tensor([0.5, -1.0, float("nan")])
        >>> value_check_numbers([RowCheck(w, None, "not_weight"),
        ...                      RowCheck(w, torch.tensor([True, False, False]), "not_weight")]).tolist()
        [1.0, 2.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.5]
    """
    if backend not in ("auto", "naive"):
        raise ValueError(problem("backend", "'auto' or 'naive'", describe(backend), "pass 'auto'"))
    if not checks:
        raise ValueError(problem("checks", "at least one RowCheck", "none", "skip the call"))
    first = getattr(checks[0], "values", None)
    device = first.device if isinstance(first, torch.Tensor) else None
    for i, check in enumerate(checks):
        _check_one(f"checks[{i}]", check, device)
    assert device is not None  # checks[0] passed: its values are a tensor
    width = len(NUMBERS)
    if out is not None and (
        out.dtype != torch.float64 or out.shape != (width * len(checks),) or out.device != device
    ):
        raise ValueError(
            problem(
                "out",
                f"float64 [{width * len(checks)}] on {device} (four numbers per check)",
                describe(out),
                "pass None for a new tensor",
            )
        )
    fused = None if backend == "naive" else _fused_runs(device)
    if fused is None:
        parts = [naive.numbers(c) for c in checks]
        numbers = parts[0] if len(parts) == 1 else torch.cat(parts)
        return numbers if out is None else out.copy_(numbers)
    if out is None:
        out = torch.empty(width * len(checks), dtype=torch.float64, device=device)
    fused.write(checks, out)
    return out
