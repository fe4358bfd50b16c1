"""The value checks as one Triton program per check (same contract as ``naive.py``).

One program walks the checked entries in blocks of ``BLOCK`` and keeps, per lane, how many it
rejected and the smallest rejected index; the reductions at the end give the four numbers,
written straight into the caller's float64 block (no packing launch). The entries are read
through two strides, so a ``[B]`` tensor expanded to ``[B, T]`` (stride 0) or a transposed
view is checked in place. The rule compares in float64, into which every float and integer
dtype converts exactly (integers up to 2**53); ``above``'s bound arrives as the bits of the
float64 the values' dtype rounds it to, so the comparison is PyTorch's ``values > bound``.

On CPU the program runs only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
this module is first imported), for tests.
"""

from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from echoloss.ops._launch import on_tensor_device
from echoloss.ops.value_checks.contract import RULES, RowCheck

__all__ = ["BLOCK", "interpreter_active", "write"]

#: Entries per loop iteration and warps of the one program: 8 entries per thread in flight per
#: iteration (a 64k-row micro-batch is 32 iterations on one streaming multiprocessor).
BLOCK = 2048
NUM_WARPS = 8

_RULE_CODE = {rule: i for i, rule in enumerate(RULES)}


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _least(a, b):
    return tl.minimum(a, b)


@triton.jit
def _offset(r, inner, stride_outer, stride_inner, FLAT: tl.constexpr):
    """Where flat index ``r`` (int64) lies: ``r · stride_inner`` for a view with one stride,
    else ``(r // inner) · stride_outer + (r % inner) · stride_inner``."""
    if FLAT:  # noqa: SIM108 (a compile-time branch): no 64-bit division per entry
        at = r * stride_inner
    else:
        at = (r // inner) * stride_outer + (r % inner) * stride_inner
    return at


@triton.jit
def _rejected(x, bound, RULE: tl.constexpr):
    """The entries of float64 ``x`` that the rule rejects (`contract.RULES`, in order).

    Written with ordered comparisons only, each NaN case spelled out: ``x == x`` is False for
    NaN, ``|x| < inf`` False for ±inf and NaN."""
    inf = float("inf")
    if RULE == 0:  # not_finite
        bad = ~((x == x) & (tl.abs(x) < inf))
    elif RULE == 1:  # above
        bad = x > bound
    elif RULE == 2:  # below
        bad = x < bound
    elif RULE == 3:  # not_weight
        bad = ~((x >= 0) & (x < inf))
    elif RULE == 4:  # not_01
        bad = ~((x == 0) | (x == 1))
    else:  # not_positive
        bad = ~((x > 0) & (x < inf))
    return bad


@triton.jit
def _value_check_kernel(
    values,
    rows,
    out,
    n,
    inner,
    stride_outer,
    stride_inner,
    bound_bits,
    RULE: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    FLAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # tl.cast, not .to: an argument equal to 1 may arrive as a compile-time constant.
    bound = tl.cast(tl.cast(bound_bits, tl.int64), tl.float64, bitcast=True)
    offs = tl.arange(0, BLOCK)
    count = tl.full([BLOCK], 0, tl.int64)
    none = tl.cast(n, tl.int64)
    first = tl.full([BLOCK], 0, tl.int64) + none  # per lane: smallest rejected index, n = none
    for start in range(0, n, BLOCK):
        r = start + offs
        inside = r < n
        r64 = r.to(tl.int64)
        at = _offset(r64, inner, stride_outer, stride_inner, FLAT)
        x = tl.load(values + at, mask=inside, other=0).to(tl.float64)
        bad = _rejected(x, bound, RULE) & inside
        if HAS_ROWS:
            bad = bad & (tl.load(rows + r, mask=inside, other=0) != 0)
        count += bad.to(tl.int64)
        first = tl.minimum(first, tl.where(bad, r64, none))
    # Reductions with combine functions of this module (not tl.sum / tl.min): under the
    # interpreter triton's own library functions are jitted unless TRITON_INTERPRET was set
    # before triton was first imported.
    total = tl.reduce(count, 0, _add)
    found = total > 0
    row = tl.where(found, tl.reduce(first, 0, _least), 0)
    at = _offset(row, inner, stride_outer, stride_inner, FLAT)
    value = tl.load(values + at, mask=n > 0, other=0).to(tl.float64)
    tl.store(out, found.to(tl.float64))
    tl.store(out + 1, total.to(tl.float64))
    tl.store(out + 2, row.to(tl.float64))
    tl.store(out + 3, value)


def interpreter_active() -> bool:
    """Whether the kernel of this module was defined under the Triton interpreter.

    Examples:
        >>> isinstance(interpreter_active(), bool)
        True
    """
    return type(_value_check_kernel).__name__ == "InterpretedFunction"


def _layout(values: torch.Tensor) -> tuple[torch.Tensor, int, int, int, bool]:
    """``(tensor, inner, stride_outer, stride_inner, flat)``: flat index ``r`` is at
    ``(r // inner) · stride_outer + (r % inner) · stride_inner`` from ``tensor``'s first
    element, or at ``r · stride_inner`` when ``flat`` (one stride walks the view: 1-D, one row
    or column, or rows laid end to end). Views of up to two dimensions are read in place; more
    dimensions are reshaped to two (a copy only where they cannot be viewed so)."""
    if values.numel() == 0:  # nothing is read (and an empty dimension cannot be reshaped to)
        return values.reshape(0), 1, 0, 0, True
    if values.dim() == 0:
        return values, 1, 0, 0, True
    if values.dim() == 1:
        return values, values.shape[0], 0, values.stride(0), True
    if values.dim() > 2:
        values = values.reshape(-1, values.shape[-1])
    (rows, inner), (s0, s1) = values.shape, values.stride()
    if inner == 1:
        return values, 1, s0, s0, True
    if rows == 1 or s0 == inner * s1:
        return values, inner, s0, s1, True
    return values, inner, s0, s1, False


def _bound_bits(check: RowCheck) -> int:
    """The bits of ``check.threshold`` rounded to the values' dtype, as a float64 (the bound
    ``values > threshold`` compares against in PyTorch); an integer's bound as it is."""
    rounded = _rounded(float(check.threshold), check.values.dtype)
    return int(struct.unpack("<q", struct.pack("<d", rounded))[0])


def _rounded(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to nearest-even in ``dtype``, on the host (no tensor: nothing is launched
    or read back); integers and float64 as they are."""
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        try:
            struct.pack("<e" if dtype == torch.float16 else "<f", x)
        except OverflowError:  # beyond the dtype's range: PyTorch's cast gives ±inf
            return math.copysign(math.inf, x)
    if dtype in (torch.float32, torch.bfloat16):
        # float32 first, then bfloat16 (as PyTorch casts a Python float), each to nearest even
        (bits,) = struct.unpack("<I", struct.pack("<f", x))
        if dtype == torch.bfloat16:  # keep the top 16 bits, to nearest even
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return float(struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0])
    if dtype == torch.float16:
        return float(struct.unpack("<e", struct.pack("<e", x))[0])
    return x


def write(check: RowCheck, out: torch.Tensor) -> None:
    """Write `contract.NUMBERS` of ``check`` into ``out`` (``[4]`` float64 on the values'
    device, e.g. a slice of the call's check block): one launch.

    Examples:
        >>> import os
        >>> if os.environ.get("TRITON_INTERPRET") == "1" and interpreter_active():
        ...     out = torch.empty(4, dtype=torch.float64)
        ...     write(RowCheck(torch.tensor([0.0, 2.0, 1.0]), None, "not_01"), out)
        ...     assert out.tolist() == [1.0, 1.0, 1.0, 2.0]
    """
    values = check.values.detach()
    n = values.numel()
    tensor, inner, stride_outer, stride_inner, flat = _layout(values)
    rows = check.rows
    has_rows = rows is not None
    # The rows are read with stride 1: a strided mask (mask[::2]) is copied, not misread.
    flat_rows = rows.reshape(-1).contiguous() if rows is not None else out  # else unread
    with on_tensor_device(values):
        _value_check_kernel[(1,)](
            tensor,
            flat_rows,
            out,
            n,
            inner,
            stride_outer,
            stride_inner,
            _bound_bits(check),
            RULE=_RULE_CODE[check.rule],
            HAS_ROWS=has_rows,
            FLAT=flat,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
