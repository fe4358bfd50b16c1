"""A vectorised ``tl.associative_scan`` for the Triton interpreter, installed for every test
(``tests/conftest.py``).

The interpreter runs a scan whose combine function is not triton.language's own ``+`` or ``*``
one element at a time: a Python call of the combine function per element of the block, ~1 ms
each. The row program's sequence pass scans blocks of 1,024 rows seven times (segmented sums,
running maxima), so one interpreted call of it took 2-7 s whatever the row count, most of the
kernel tests' time.

`log_step_scan` computes the same inclusive scan in ``⌈log2 n⌉`` vectorised steps
(Hillis-Steele: ``acc[i] = combine(acc[i - s], acc[i])`` for ``s = 1, 2, 4, ...``), calling the
kernel's own combine function on whole arrays. It needs only what ``tl.associative_scan``
already requires of the combine function: associativity. Integer sums, maxima, minima and
boolean ors come out bit-identical to the element-by-element scan; a floating-point sum adds in a
tree order instead of left to right, as a GPU's scan does (warp shuffles, then across warps): a
different rounding within the sum's own bound, which the tests' tolerances already allow for
(``tests/ops/test_row_algebra.py``). ``tests/ops/test_interpreter_scan.py`` holds it to the
interpreter's own scan on the program's combine functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_MARK = "_echoloss_log_step_scan"


def log_step_scan(self: Any, inputs: tuple[Any, ...]) -> list[Any]:
    """``ScanOps.generic_scan`` of the interpreter in ``⌈log2 n⌉`` vectorised combine calls."""
    import triton.language as tl

    axis = self.axis
    dtypes = [arg.dtype for arg in inputs]
    acc = [np.array(arg.handle.data, copy=True) for arg in inputs]
    n = acc[0].shape[axis]
    shape = [1] * acc[0].ndim
    shape[axis] = n
    position = np.arange(n).reshape(shape)
    step = 1
    while step < n:
        # Block shapes stay powers of two: the left operand is the whole block rolled by `step`,
        # and the first `step` positions (whose rolled operand wrapped around) keep their value.
        rolled = [np.roll(a, step, axis=axis) for a in acc]
        operands = [
            self.to_tensor(x, d) for x, d in zip(rolled + acc, dtypes + dtypes, strict=True)
        ]
        result = self.combine_fn.fn(*operands)
        result = result if isinstance(result, tuple) else (result,)
        keep = position < step
        acc = [
            np.where(keep, a, r.handle.data if isinstance(r, tl.core.tensor) else r).astype(a.dtype)
            for a, r in zip(acc, result, strict=True)
        ]
        step *= 2
    return [self.to_tensor(a, d) for a, d in zip(acc, dtypes, strict=True)]


def install() -> bool:
    """Replace the interpreter's element-by-element scan with `log_step_scan` (once); ``False``
    where this triton has no such scan to replace (the tests then run the original, slowly)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    scan_ops = getattr(interpreter, "ScanOps", None)
    if scan_ops is None or not hasattr(scan_ops, "generic_scan"):
        return False
    if not getattr(scan_ops, _MARK, False):
        scan_ops.element_by_element_scan = scan_ops.generic_scan
        scan_ops.generic_scan = log_step_scan
        setattr(scan_ops, _MARK, True)
    return True
