"""Argument types of the probe commands: a number outside its range is an argparse error (one
line, exit 2) naming the flag, not a traceback from deep inside a run or a run of zero steps."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["at_least", "positive_float"]


def at_least(low: int) -> Callable[[str], int]:
    """An ``int`` argument type that refuses values below ``low``.

    Examples:
        >>> at_least(1)("3")
        3
        >>> at_least(1)("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be an integer >= 1, got '0'
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def positive_float(text: str) -> float:
    """A finite ``float`` argument above 0.

    Examples:
        >>> positive_float("3e-3")
        0.003
        >>> positive_float("nan")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a finite number > 0, got 'nan'
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value
