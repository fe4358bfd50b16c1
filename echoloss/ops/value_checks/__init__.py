"""Value checks of ``[N]`` inputs as a few numbers each, for checks read later on the host.

[`value_check_numbers`][echoloss.ops.value_checks.op.value_check_numbers] gives, per
`RowCheck` (values, the rows checked, a rule of `RULES`), whether an entry breaks the rule, how
many do, the first one's index and its value: one Triton launch for up to eight checks (a
program each) into one float64 block (``fused.py``) instead of about eight small PyTorch
kernels each and a join (``naive.py``, the gold). `DeferredChecks` (``deferred.py``) gathers a
call's checks and uses it for their numbers on the device path.
"""

from __future__ import annotations

from echoloss.ops.value_checks.contract import NUMBERS, RULES, RowCheck
from echoloss.ops.value_checks.deferred import (
    DeferredChecks,
    Numbers,
    check_finite,
    check_temperature,
)
from echoloss.ops.value_checks.naive import counted
from echoloss.ops.value_checks.op import (
    fuse_value_checks,
    fused_value_checks_run,
    validate_row_check,
    value_check_numbers,
)

__all__ = [
    "NUMBERS",
    "RULES",
    "DeferredChecks",
    "Numbers",
    "RowCheck",
    "check_finite",
    "check_temperature",
    "counted",
    "fuse_value_checks",
    "fused_value_checks_run",
    "validate_row_check",
    "value_check_numbers",
]
