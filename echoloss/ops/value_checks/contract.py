"""The contract of the value checks: which entries a rule rejects (`RULES`), what a check reads
(`RowCheck`) and the four numbers it writes (`NUMBERS`). Shared by ``op.py``, ``naive.py`` and
``fused.py``; imports neither.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["NUMBERS", "RULES", "RowCheck"]

#: What each rule rejects (an entry ``x`` of the values, compared in the values' dtype):
#:
#: - ``not_finite``: NaN or ±inf;
#: - ``above``: ``x > threshold`` (NaN passes: pair it with ``not_finite``);
#: - ``below``: ``x < threshold`` (NaN passes);
#: - ``not_weight``: not a finite number ≥ 0 (NaN fails);
#: - ``not_01``: neither 0 nor 1 (NaN fails);
#: - ``not_positive``: not a finite number > 0 (NaN fails).
RULES = ("not_finite", "above", "below", "not_weight", "not_01", "not_positive")

#: The float64 numbers of one check, in order: 1 if some checked entry is rejected (else 0),
#: how many are, the flat index of the first (0 when none) and the value there, as float64.
NUMBERS = ("bad", "count", "row", "value")


class RowCheck(NamedTuple):
    """One check: no entry of ``values`` on the ``rows`` breaks ``rule``.

    Attributes:
        values: any shape and strides (a ``[B]`` tensor expanded to ``[B, T]`` included),
            read in flat row-major order; bool excluded.
        rows: None (every entry), or a bool tensor with as many entries: True = checked.
        rule: one of `RULES`.
        threshold: the bound of ``above`` and ``below``: for float values it is rounded to
            their dtype, as ``values > threshold`` does in PyTorch; for integer values it must
            be a whole number (compared exactly).
    """

    values: torch.Tensor
    rows: torch.Tensor | None
    rule: str
    threshold: float = 0.0
