"""The value checks in plain PyTorch: the gold of ``fused.py`` (never imports triton).

One check is about six small kernels here (the rule, the row mask, the first index, the count
and the gather), then its share of the packing; ``fused.py`` does the same in one launch.
"""

from __future__ import annotations

import math

import torch

from echoloss.ops.value_checks.contract import RowCheck

__all__ = ["counted", "numbers", "rejected"]


def rejected(x: torch.Tensor, rule: str, threshold: float = 0.0) -> torch.Tensor:
    """Bool ``[...]``: the entries of ``x`` that ``rule`` rejects (`contract.RULES`).

    Examples:
        >>> rejected(torch.tensor([0.0, -1.0, float("nan")]), "not_weight").tolist()
        [False, True, True]
    """
    if rule == "not_finite":
        return (x - x) != 0  # exactly 0 for a finite x, NaN for ±inf and NaN
    if rule == "above":
        return x > threshold
    if rule == "below":
        return x < threshold
    if rule == "not_weight":
        return ~((x >= 0) & (x < math.inf))
    if rule == "not_01":
        return (x != 0) & (x != 1)
    if rule == "not_positive":
        return ~((x > 0) & (x < math.inf))
    raise ValueError(f"rule={rule!r}: not a value-check rule")


def counted(check: RowCheck) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """0-dim ``(count, first flat index, value there)`` of one check, unpacked: the flag is
    ``count > 0``, so a caller that packs numbers of several dtypes (``DeferredChecks``)
    spends no launch on it. Six launches for ``not_finite`` with rows.

    Examples:
        >>> [t.item() for t in counted(RowCheck(torch.tensor([0.0, 2.0, 3.0]), None, "not_01"))]
        [2, 1, 2.0]
    """
    flat = check.values.detach().reshape(-1)
    if flat.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64, device=flat.device)
        return zero, zero, torch.zeros((), dtype=torch.float64, device=flat.device)
    bad = rejected(flat, check.rule, check.threshold)
    if check.rows is not None:
        bad = bad & check.rows.reshape(-1)
    row = bad.view(torch.uint8).argmax()  # the first True (0 when none): bool read as uint8
    return bad.sum(), row, flat.index_select(0, row.view(1)).reshape(())


def numbers(check: RowCheck) -> torch.Tensor:
    """``[4]`` float64 on the values' device: `contract.NUMBERS` of one check.

    Examples:
        >>> numbers(RowCheck(torch.tensor([1.0, float("inf"), 2.0]), None, "not_finite")).tolist()
        [1.0, 1.0, 1.0, inf]
    """
    count, row, value = counted(check)
    parts = [count > 0, count, row, value]
    return torch.stack([p.to(torch.float64) for p in parts])
