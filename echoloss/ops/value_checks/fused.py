"""The value checks of a call in one Triton launch (same contract as ``naive.py``).

One launch runs up to `SLOTS` checks, one program per check: the arguments hold each check's
slot (the addresses of its values and row mask, its sizes and strides, its bound and a code
of its rule, dtype and layout) and program ``i`` reads slot ``i``. A program walks the checked
entries in blocks of ``BLOCK`` and keeps, per lane, how many it rejected and the smallest
rejected index; the reductions at the end give the four numbers, written straight into the
caller's float64 block (no packing launch). The values are read through two strides, so a
``[B]`` tensor expanded to ``[B, T]`` (stride 0) or a transposed view is checked in place. The
rule compares in float64, into which every float and integer dtype converts exactly (integers
up to 2**53); ``above``'s bound arrives as the bits of the float64 the values' dtype rounds it
to, so the comparison is PyTorch's ``values > bound``.

Why addresses, not tensors: a check's dtype, rule and layout are values of the slot, so one
compiled program serves every combination (the branch on the dtype picks the typed pointer),
and the arguments are plain integers that are never specialised (a new size or stride does
not compile again).

On CPU the program runs only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
this module is first imported), for tests.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from echoloss.ops._launch import on_tensor_device
from echoloss.ops.value_checks.contract import NUMBERS, RULES, RowCheck

__all__ = ["BLOCK", "SLOTS", "interpreter_active", "write"]

#: Entries per loop iteration and warps of each program: 8 entries per thread in flight per
#: iteration (a 64k-row micro-batch is 32 iterations on one streaming multiprocessor).
BLOCK = 2048
NUM_WARPS = 8
#: Checks per launch (programs of one grid): a module's call queues five or six, a record's
#: nine (two launches).
SLOTS = 8

_RULE_CODE = {rule: i for i, rule in enumerate(RULES)}
#: The dtypes a program reads, by code (the branch in `_value_checks_kernel`); any other real
#: dtype is converted to float64 first (one launch; exact for every float).
_DTYPE_CODE = {
    torch.float64: 0,
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int64: 4,
    torch.int32: 5,
    torch.int16: 6,
    torch.int8: 7,
    torch.uint8: 8,
}
# A slot's code: the rule in bits 0-3, the dtype in bits 4-7, a row mask in bit 8, one
# stride (flat) in bit 9.
_DTYPE_SHIFT, _HAS_ROWS_BIT, _FLAT_BIT = 4, 256, 512
_SLOT_ARGS = ("values", "rows", "n", "inner", "stride_outer", "stride_inner", "bound", "code")


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _least(a, b):
    return tl.minimum(a, b)


# triton.language's own combine functions where this triton has them (the same `a + b` and
# `minimum`): the interpreter reduces with numpy for them, and one element at a time (a Python
# call each, 0.4 s per 2,048-lane block) for any other; the row program does the same.
_sum = getattr(tl.standard, "_sum_combine", _add)
_min = getattr(tl.standard, "_elementwise_min", _least)


@triton.jit
def _offset(r, inner, stride_outer, stride_inner, flat):
    """Where flat index ``r`` (int64) lies: ``r · stride_inner`` for a view with one stride
    (no 64-bit division per entry), else
    ``(r // inner) · stride_outer + (r % inner) · stride_inner``."""
    if flat:  # noqa: SIM108 (a branch on a runtime scalar: Triton has no runtime ternary)
        at = r * stride_inner
    else:
        at = (r // inner) * stride_outer + (r % inner) * stride_inner
    return at


@triton.jit
def _rejected(x, bound, rule):
    """The entries of float64 ``x`` that the rule rejects (`contract.RULES`, in order).

    Written with ordered comparisons only, each NaN case spelled out: ``x == x`` is False for
    NaN, ``|x| < inf`` False for ±inf and NaN."""
    inf = float("inf")
    if rule == 0:  # not_finite
        bad = ~((x == x) & (tl.abs(x) < inf))
    elif rule == 1:  # above
        bad = x > bound
    elif rule == 2:  # below
        bad = x < bound
    elif rule == 3:  # not_weight
        bad = ~((x >= 0) & (x < inf))
    elif rule == 4:  # not_01
        bad = ~((x == 0) | (x == 1))
    else:  # not_positive
        bad = ~((x > 0) & (x < inf))
    return bad


@triton.jit
def _scan(values, rows, n, inner, stride_outer, stride_inner, bound, rule, has_rows, flat, BLOCK):
    """``(count, first, value)`` of one check, ``values`` a typed pointer."""
    offs = tl.arange(0, BLOCK).to(tl.int64)
    count = tl.full([BLOCK], 0, tl.int64)
    first = tl.full([BLOCK], 0, tl.int64) + n  # per lane: smallest rejected index, n = none
    for start in range(0, n, BLOCK):
        r = start + offs
        inside = r < n
        at = _offset(r, inner, stride_outer, stride_inner, flat)
        x = tl.load(values + at, mask=inside, other=0).to(tl.float64)
        bad = _rejected(x, bound, rule) & inside
        if has_rows:
            bad = bad & (tl.load(rows + r, mask=inside, other=0) != 0)
        count += bad.to(tl.int64)
        first = tl.minimum(first, tl.where(bad, r, n))
    # tl.reduce with the combine functions above, not tl.sum / tl.min: under the interpreter
    # those library functions are jitted unless TRITON_INTERPRET was set before triton was
    # first imported.
    total = tl.reduce(count, 0, _sum)
    row = tl.where(total > 0, tl.reduce(first, 0, _min), 0)
    at = _offset(row, inner, stride_outer, stride_inner, flat)
    value = tl.load(values + at, mask=n > 0, other=0).to(tl.float64)
    return total, row, value


@triton.jit
def _pick(pid, x0, x1, x2, x3, x4, x5, x6, x7):
    """Slot ``pid``'s value of one argument, as int64."""
    x = tl.where(pid == 0, tl.cast(x0, tl.int64), tl.cast(x7, tl.int64))
    x = tl.where(pid == 1, tl.cast(x1, tl.int64), x)
    x = tl.where(pid == 2, tl.cast(x2, tl.int64), x)
    x = tl.where(pid == 3, tl.cast(x3, tl.int64), x)
    x = tl.where(pid == 4, tl.cast(x4, tl.int64), x)
    x = tl.where(pid == 5, tl.cast(x5, tl.int64), x)
    return tl.where(pid == 6, tl.cast(x6, tl.int64), x)


_INT_ARGS = [f"{name}{i}" for i in range(SLOTS) for name in _SLOT_ARGS]


@triton.jit(do_not_specialize=_INT_ARGS)
def _value_checks_kernel(
    out,
    values0, rows0, n0, inner0, stride_outer0, stride_inner0, bound0, code0,
    values1, rows1, n1, inner1, stride_outer1, stride_inner1, bound1, code1,
    values2, rows2, n2, inner2, stride_outer2, stride_inner2, bound2, code2,
    values3, rows3, n3, inner3, stride_outer3, stride_inner3, bound3, code3,
    values4, rows4, n4, inner4, stride_outer4, stride_inner4, bound4, code4,
    values5, rows5, n5, inner5, stride_outer5, stride_inner5, bound5, code5,
    values6, rows6, n6, inner6, stride_outer6, stride_inner6, bound6, code6,
    values7, rows7, n7, inner7, stride_outer7, stride_inner7, bound7, code7,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    addr = _pick(pid, values0, values1, values2, values3, values4, values5, values6, values7)
    mask_addr = _pick(pid, rows0, rows1, rows2, rows3, rows4, rows5, rows6, rows7)
    n = _pick(pid, n0, n1, n2, n3, n4, n5, n6, n7)
    inner = _pick(pid, inner0, inner1, inner2, inner3, inner4, inner5, inner6, inner7)
    so = _pick(
        pid,
        stride_outer0, stride_outer1, stride_outer2, stride_outer3,
        stride_outer4, stride_outer5, stride_outer6, stride_outer7,
    )  # fmt: skip
    si = _pick(
        pid,
        stride_inner0, stride_inner1, stride_inner2, stride_inner3,
        stride_inner4, stride_inner5, stride_inner6, stride_inner7,
    )  # fmt: skip
    bound_bits = _pick(pid, bound0, bound1, bound2, bound3, bound4, bound5, bound6, bound7)
    code = _pick(pid, code0, code1, code2, code3, code4, code5, code6, code7)
    bound = tl.cast(bound_bits, tl.float64, bitcast=True)
    # The code's fields as `_slot` packs them (`_DTYPE_SHIFT`, `_HAS_ROWS_BIT`, `_FLAT_BIT`).
    rule = code & 15
    dtype = (code >> 4) & 15
    has_rows = (code & 256) != 0
    flat = (code & 512) != 0
    rows = mask_addr.to(tl.pointer_type(tl.int8))
    # One typed pointer per dtype code (`_DTYPE_CODE`): the branch is uniform per program.
    # Written out per dtype: a Triton variable cannot hold pointers of different types
    # across branches, so the pointer and its scan stay inside each branch.
    if dtype == 0:
        ptr0 = addr.to(tl.pointer_type(tl.float64))
        total, row, value = _scan(ptr0, rows, n, inner, so, si, bound, rule, has_rows, flat, BLOCK)
    elif dtype == 1:
        ptr1 = addr.to(tl.pointer_type(tl.float32))
        total, row, value = _scan(ptr1, rows, n, inner, so, si, bound, rule, has_rows, flat, BLOCK)
    elif dtype == 2:
        ptr2 = addr.to(tl.pointer_type(tl.float16))
        total, row, value = _scan(ptr2, rows, n, inner, so, si, bound, rule, has_rows, flat, BLOCK)
    elif dtype == 3:
        ptr3 = addr.to(tl.pointer_type(tl.bfloat16))
        total, row, value = _scan(ptr3, rows, n, inner, so, si, bound, rule, has_rows, flat, BLOCK)
    elif dtype == 4:
        ptr4 = addr.to(tl.pointer_type(tl.int64))
        total, row, value = _scan(ptr4, rows, n, inner, so, si, bound, rule, has_rows, flat, BLOCK)
    elif dtype == 5:
        ptr5 = addr.to(tl.pointer_type(tl.int32))
        total, row, value = _scan(ptr5, rows, n, inner, so, si, bound, rule, has_rows, flat, BLOCK)
    elif dtype == 6:
        ptr6 = addr.to(tl.pointer_type(tl.int16))
        total, row, value = _scan(ptr6, rows, n, inner, so, si, bound, rule, has_rows, flat, BLOCK)
    elif dtype == 7:
        ptr7 = addr.to(tl.pointer_type(tl.int8))
        total, row, value = _scan(ptr7, rows, n, inner, so, si, bound, rule, has_rows, flat, BLOCK)
    else:
        ptr8 = addr.to(tl.pointer_type(tl.uint8))
        total, row, value = _scan(ptr8, rows, n, inner, so, si, bound, rule, has_rows, flat, BLOCK)
    slot = out + 4 * pid
    tl.store(slot, (total > 0).to(tl.float64))
    tl.store(slot + 1, total.to(tl.float64))
    tl.store(slot + 2, row.to(tl.float64))
    tl.store(slot + 3, value)


def interpreter_active() -> bool:
    """Whether the kernel of this module was defined under the Triton interpreter.

    Examples:
        >>> isinstance(interpreter_active(), bool)
        True
    """
    return type(_value_checks_kernel).__name__ == "InterpretedFunction"


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


def _slot(check: RowCheck, keep: list[torch.Tensor]) -> list[int]:
    """The kernel arguments of one check (`_SLOT_ARGS`); the tensors they point into are
    appended to ``keep`` (alive until the launch is queued)."""
    values = check.values.detach()
    if values.dtype not in _DTYPE_CODE:  # e.g. uint16, float8: float64 holds them exactly
        values = values.to(torch.float64)
    n = values.numel()
    tensor, inner, stride_outer, stride_inner, flat = _layout(values)
    rows = check.rows
    # The rows are read with stride 1: a strided mask (mask[::2]) is copied, not misread.
    flat_rows = None if rows is None else rows.reshape(-1).contiguous()
    keep += [tensor] if flat_rows is None else [tensor, flat_rows]
    code = (
        _RULE_CODE[check.rule]
        | _DTYPE_CODE[tensor.dtype] << _DTYPE_SHIFT
        | (_HAS_ROWS_BIT if flat_rows is not None else 0)
        | (_FLAT_BIT if flat else 0)
    )
    return [
        tensor.data_ptr(),
        0 if flat_rows is None else flat_rows.data_ptr(),
        n,
        inner,
        stride_outer,
        stride_inner,
        _bound_bits(check),
        code,
    ]


def write(checks: Sequence[RowCheck], out: torch.Tensor) -> None:
    """Write `contract.NUMBERS` of each check into ``out`` (``[4 · k]`` float64 on the values'
    device, e.g. a slice of the call's check block), in order: one launch per `SLOTS` checks.

    Examples:
        >>> import os
        >>> if os.environ.get("TRITON_INTERPRET") == "1" and interpreter_active():
        ...     out = torch.empty(8, dtype=torch.float64)
        ...     write([RowCheck(torch.tensor([0.0, 2.0, 1.0]), None, "not_01"),
        ...            RowCheck(torch.tensor([1, 7]), None, "above", 5)], out)
        ...     assert out.tolist() == [1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 7.0]
    """
    width = len(NUMBERS)
    for first in range(0, len(checks), SLOTS):
        group = checks[first : first + SLOTS]
        keep: list[torch.Tensor] = []
        args = [_slot(check, keep) for check in group]
        args += [[0] * len(_SLOT_ARGS)] * (SLOTS - len(group))  # unread: no program
        with on_tensor_device(keep[0]):
            _value_checks_kernel[(len(group),)](
                out[width * first : width * (first + len(group))],
                *[a for slot in args for a in slot],
                BLOCK=BLOCK,
                num_warps=NUM_WARPS,
            )
