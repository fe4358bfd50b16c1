"""Paired 95 % t intervals over seeds: the statistics of docs/experiment.md's tables.

A leaf module (standard library only), shared by the experiment driver
(`echo_experiment.experiment`) and its report (`echo_experiment.persistence`).
"""

from __future__ import annotations

import math
import statistics

__all__ = ["paired_ci"]

# Two-sided 95 % Student t quantiles t_{0.975, df} (df = n − 1 seeds), to 3 decimals; every df
# to 30, then a few anchors rounded up. Between anchors the smaller df's (larger) quantile is
# used, so an interval is never narrower than the exact one.
_T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
    10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110,
    18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060,
    26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 35: 2.031, 40: 2.022, 50: 2.009, 60: 2.001, 80: 1.991, 120: 1.980,
}  # fmt: skip


def _t975(df: int) -> float:
    """t_{0.975, df}: exact (3 decimals) to df 30, conservative beyond (the nearest tabulated
    smaller df; 1.980 from df 120 on, against the limit 1.960)."""
    if df < 1:
        raise ValueError(f"_t975: df must be >= 1 (got {df}); a t interval needs two seeds")
    return _T975[max(d for d in _T975 if d <= df)]


def paired_ci(diffs: list[float]) -> dict[str, float]:
    """Mean and two-sided 95 % t confidence interval of paired differences (one per seed).

    Examples:
        >>> r = paired_ci([0.1, 0.2, 0.3])
        >>> round(r["mean"], 3), round(r["lo"], 3), round(r["hi"], 3), r["n"]
        (0.2, -0.048, 0.448, 3)
    """
    n = len(diffs)
    if n == 0:
        return {"mean": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    mean = sum(diffs) / n
    if n == 1:
        return {"mean": mean, "lo": math.nan, "hi": math.nan, "n": 1}
    half = _t975(n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}
