"""The value checks (``echoloss.ops.value_checks``): the Triton program against its PyTorch gold
bit for bit, hand-computed numbers for every rule, the bound of ``above``/``below`` rounded as
PyTorch rounds it, strided views read in place, and `DeferredChecks` keeping the call order.

The program runs under the Triton interpreter on CPU (``tests/ops/conftest.py``). Sizes above
``BLOCK`` (2048) make its loop run several times (5000: three blocks, the last one partial).
Every number is exact: a flag, a count, an index and a value copied from the input into
float64 (every float and integer dtype here converts exactly), so fused and gold must be equal
(NaN where the value is NaN).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from echoloss._deferred import device_code_path, raise_deferred_errors
from echoloss.ops.value_checks import (
    RULES,
    DeferredChecks,
    RowCheck,
    fuse_value_checks,
    value_check_numbers,
)
from echoloss.ops.value_checks import fused as fused_module
from echoloss.ops.value_checks.fused import BLOCK, _rounded
from echoloss.ops.value_checks.naive import rejected

NAN, INF = math.nan, math.inf
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INTS = (torch.int64, torch.int32, torch.uint8)


@pytest.fixture(autouse=True)
def fused_checks():
    if not torch.cuda.is_available():
        assert fused_module.interpreter_active()  # conftest imported it under the interpreter
    fuse_value_checks("always")
    yield
    fuse_value_checks("auto")


def both(checks):
    """``(fused, gold)`` numbers of ``checks``."""
    return value_check_numbers(checks), value_check_numbers(checks, backend="naive")


def assert_same(a, b):
    assert a.dtype == b.dtype == torch.float64 and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan()), (a.tolist(), b.tolist())
    assert torch.equal(a.nan_to_num(), b.nan_to_num()), (a.tolist(), b.tolist())


# ------------------------------------------------------------------ hand-computed numbers

HAND = [
    # (rule, values, rows, threshold, [bad, count, row, value])
    ("not_finite", [1.0, INF, -2.0, NAN, -INF], None, 0.0, [1, 3, 1, INF]),
    ("not_finite", [1.0, INF, -2.0, NAN], [False, False, True, True], 0.0, [1, 1, 3, NAN]),
    ("not_finite", [1.0, -2.0], None, 0.0, [0, 0, 0, 1.0]),
    ("above", [-1.0, 0.5, NAN, 2.0], None, 0.1, [1, 2, 1, 0.5]),  # NaN passes
    ("below", [3.0, 0.0, -1.0, NAN, -5.0], None, 0.0, [1, 2, 2, -1.0]),
    ("not_weight", [0.0, 0.5, -0.0, NAN, -1.0, INF], None, 0.0, [1, 3, 3, NAN]),
    ("not_01", [0.0, 1.0, 0.5, NAN, -1.0], None, 0.0, [1, 3, 2, 0.5]),
    ("not_01", [1.0, 0.0, 2.0], [True, True, False], 0.0, [0, 0, 0, 1.0]),
    ("not_positive", [1.0, 0.0, INF, NAN, 1e-30], None, 0.0, [1, 3, 1, 0.0]),
]


@pytest.mark.parametrize(("rule", "values", "rows", "threshold", "expected"), HAND)
def test_hand_computed_numbers(rule, values, rows, threshold, expected):
    check = RowCheck(
        torch.tensor(values, dtype=torch.float64),
        None if rows is None else torch.tensor(rows),
        rule,
        threshold,
    )
    fused, gold = both([check])
    assert_same(fused, gold)
    want = torch.tensor(expected, dtype=torch.float64)
    assert_same(fused, want)


def test_every_rule_has_a_hand_case():
    assert {case[0] for case in HAND} == set(RULES)


def test_empty_values_write_zeros():
    for rule in RULES:
        for empty in (torch.empty(0), torch.empty(3, 0, 2), torch.empty(2, 4, 0)):
            fused, gold = both([RowCheck(empty, None, rule)])
            assert fused.tolist() == gold.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_integer_masks_and_their_values():
    mask = torch.tensor([[1, 0, 1], [0, 7, -3]])
    fused, gold = both([RowCheck(mask, None, "not_01"), RowCheck(mask.int(), None, "below")])
    assert_same(fused, gold)
    assert fused.tolist() == [1, 2, 4, 7, 1, 1, 5, -3]


# ------------------------------------------------------------------ the bound, as PyTorch rounds it


@pytest.mark.parametrize("dtype", FLOATS)
def test_above_compares_with_the_bound_rounded_to_the_values_dtype(dtype):
    """A value equal to the dtype's rounding of 1e-3 is not above it; the next value up is.
    (Compared with 1e-3 in float64, the fp32/bf16 rounding of 1e-3, which is above 1e-3,
    would be rejected.)"""
    bound = torch.tensor(1e-3, dtype=dtype)
    up = torch.nextafter(bound.double(), torch.tensor(INF, dtype=torch.float64)).to(dtype)
    if up == bound:  # rounded back down in a short dtype: the next representable value
        up = torch.tensor(_next_up(bound), dtype=dtype)
    values = torch.stack([bound, up])
    fused, gold = both([RowCheck(values, None, "above", 1e-3)])
    assert_same(fused, gold)
    assert fused.tolist()[:3] == [1.0, 1.0, 1.0]


def _next_up(x: torch.Tensor) -> float:
    bits = x.view(torch.int16 if x.element_size() == 2 else torch.int32)
    return float((bits + 1).view(x.dtype))


def test_rounding_of_the_bound_matches_pytorch_casts():
    values = [1e-3, 0.0, -2.5, 1 / 3, 65504.0, 65520.0, 1e-8, 1e39, -1e39, 3.4e38, 1e-45]
    values += [(-1) ** k * 1.2345678912345 * 10.0 ** (k % 80 - 40) for k in range(400)]
    for dtype in FLOATS:
        for x in values:
            assert _rounded(x, dtype) == float(torch.tensor(x, dtype=dtype)), (dtype, x)


# ------------------------------------------------------------------ fused == gold


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS + INTS),
    n=st.sampled_from([1, 3, 700, 2048, 2049, 5000]),
    rule=st.sampled_from(RULES),
    with_rows=st.booleans(),
    bad_fraction=st.sampled_from([0.0, 0.001, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_fused_equals_gold(dtype, n, rule, with_rows, bad_fraction, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        values = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        special = torch.tensor([NAN, INF, -INF, 0.0, 1.0, -0.0, 1e-3, 2.0], dtype=dtype)
    else:
        values = torch.randint(0, 2, (n,), generator=g).to(dtype)
        special = torch.tensor([2, 0, 1, 5], dtype=dtype)
    hit = torch.rand(n, generator=g) < bad_fraction
    pick = torch.randint(0, special.numel(), (n,), generator=g)
    values = torch.where(hit, special[pick], values)
    rows = (torch.rand(n, generator=g) < 0.7) if with_rows else None
    threshold = 1e-3 if dtype.is_floating_point else 1.0
    fused, gold = both([RowCheck(values, rows, rule, threshold)])
    assert_same(fused, gold)


def test_the_loop_runs_several_blocks_and_finds_the_first_bad_entry_in_any():
    assert BLOCK == 2048
    n = 2 * BLOCK + 900  # three iterations, the last one partial
    for where in (0, BLOCK - 1, BLOCK, 2 * BLOCK - 1, 2 * BLOCK, n - 1):
        values = torch.zeros(n)
        values[where] = NAN
        values[n - 1] = INF
        for view in (values, values.reshape(-1, 2).t()):  # flat, and two strides
            fused, gold = both([RowCheck(view, None, "not_finite")])
            assert_same(fused, gold)
        flat = both([RowCheck(values, None, "not_finite")])[0]
        assert flat.tolist()[:3] == [1.0, 1.0 + (where != n - 1), float(where)]


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t[:, :1].expand(7, 300),  # a [B] column expanded to [B, T]: stride 0
        lambda t: t.t(),  # transposed
        lambda t: t[1:, 3:250:2],  # an offset and a step
        lambda t: t.reshape(7, 30, 10)[:, :, 4],  # 3-D base, a strided 2-D view
        lambda t: t.reshape(7, 30, 10).transpose(0, 1),  # 3-D, not viewable as 1-D
        lambda t: t[3, 5],  # 0-dim
        lambda t: t[2].unsqueeze(0).expand(4, 300),  # a [T] row expanded to [B, T]: stride 0
        lambda t: t[:, 7:8],  # one column: a single stride of 300
        lambda t: t[4:5, 10:],  # one row with an offset
        lambda t: t[2:6],  # rows laid end to end: one stride
        lambda t: t.reshape(7, 30, 10)[:, 3:5, :],  # 3-D, rows of two blocks
    ],
    ids=[
        "expanded",
        "transposed",
        "offset-step",
        "strided-2d",
        "3d",
        "0-dim",
        "row-expanded",
        "column",
        "one-row",
        "end-to-end",
        "3d-blocks",
    ],
)
def test_strided_views_are_read_in_place_with_the_golds_numbers(make):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(7, 300, generator=g)
    base[2, ::37] = NAN
    base[5, 4] = INF
    values = make(base)
    rows = torch.rand(values.shape, generator=g) < 0.8
    for r in (None, rows):
        fused, gold = both([RowCheck(values, r, "not_finite")])
        assert_same(fused, gold)


def test_strided_row_masks_are_read_as_masks():
    """A row mask that is itself a view (every other entry of a longer mask, a transposed one)
    selects the same rows in the program as in the gold."""
    g = torch.Generator().manual_seed(3)
    values = torch.randn(300, generator=g)
    values[::7] = NAN
    long_mask = torch.rand(600, generator=g) < 0.5
    square = torch.rand(20, 15, generator=g) < 0.5
    for rows in (long_mask[::2], long_mask[1::2], square.t().reshape(-1)[:300]):
        fused, gold = both([RowCheck(values, rows, "not_finite")])
        assert_same(fused, gold)
        assert fused[1] == (values.isnan() & rows).sum()
    fused, gold = both([RowCheck(values.reshape(15, 20).t(), square, "not_finite")])
    assert_same(fused, gold)


def test_several_checks_fill_one_block_in_order():
    a = torch.tensor([0.0, -1.0])
    b = torch.tensor([1.0, NAN, 3.0])
    fused, gold = both([RowCheck(a, None, "not_weight"), RowCheck(b, None, "not_finite")])
    assert_same(fused, gold)
    assert fused.numel() == 8 and fused.tolist()[:4] == [1.0, 1.0, 1.0, -1.0]


def test_one_launch_holds_every_dtype_rule_and_layout_and_more_checks_take_more(monkeypatch):
    """A launch runs `SLOTS` checks, each program reading its own slot: checks of every dtype,
    rule and layout (flat, strided, expanded, with and without rows) mixed in one launch, and
    over several launches (`SLOTS` + 3 checks: the second launch's programs read slots 0-2
    again), give the gold's numbers in order; the launches are counted."""
    from echoloss.ops.value_checks import fused as fused_checks

    if torch.cuda.is_available():
        pytest.skip("cpu tensors run the program under the interpreter only without CUDA")
    g = torch.Generator().manual_seed(7)
    dtypes = (*FLOATS, *INTS, torch.int16, torch.int8)
    checks = []
    for i in range(fused_checks.SLOTS + 3):
        dtype = dtypes[i % len(dtypes)]
        rule = RULES[i % len(RULES)]
        base = torch.randint(-2, 3, (3 * BLOCK // 2 + i,), generator=g)
        if dtype == torch.uint8:
            base = base.abs()
        values = base.to(dtype)
        if i % 3 == 1:  # strided: every other entry of a [2, k] view's transpose
            values = values[: 2 * (values.numel() // 2)].reshape(2, -1).t()
        elif i % 3 == 2:  # a [B] expanded to [B, T] (stride 0)
            values = values[:40].unsqueeze(1).expand(40, 9)
        rows = None if i % 2 else torch.rand(values.shape, generator=g) < 0.5
        checks.append(RowCheck(values, rows, rule, 1.0))
    launches = []
    kernel = fused_checks._value_checks_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    active = fused_checks.interpreter_active()  # reads the kernel's type: asked before
    monkeypatch.setattr(fused_checks, "interpreter_active", lambda: active)
    monkeypatch.setattr(fused_checks, "_value_checks_kernel", Counted())
    fused, gold = both(checks)
    assert_same(fused, gold)
    assert launches == [(fused_checks.SLOTS,), (3,)]
    assert fused.view(-1, 4)[:, 0].sum() >= 3  # some checks fail, some pass


def test_bad_checks_raise_naming_the_field():
    x = torch.zeros(3)
    cases = [
        (RowCheck(x, None, "nope"), "checks[0].rule must be one of"),
        (RowCheck(x.bool(), None, "not_01"), "checks[0].values must be a real, non-bool tensor"),
        (RowCheck(x, torch.ones(2, dtype=torch.bool), "not_finite"), "checks[0].rows must be"),
        (RowCheck(x, torch.ones(3), "not_finite"), "checks[0].rows must be"),
        (RowCheck(x.long(), None, "above", 0.5), "checks[0].threshold must be a whole number"),
        (RowCheck(x.long(), None, "above", math.inf), "checks[0].threshold must be a whole"),
        (RowCheck(x, None, "above", math.nan), "checks[0].threshold must be a number (not NaN)"),
        ((x, None, "above"), "checks[0] must be a RowCheck"),
        (RowCheck(x, None, "not_finite"), None),  # the one below is on another device: "meta"
    ]
    cases[-1] = (
        RowCheck(torch.zeros(3, device="meta"), None, "not_finite"),
        "checks[1].values must be on cpu",
    )
    for check, message in cases:
        first = [RowCheck(x, None, "not_finite")] if "checks[1]" in message else []
        with pytest.raises((TypeError, ValueError), match=re.escape(message)):
            value_check_numbers([*first, check])
    with pytest.raises(ValueError, match=re.escape("out must be float64 [4] on cpu")):
        value_check_numbers([RowCheck(x, None, "not_finite")], out=torch.empty(4))
    with pytest.raises(ValueError, match="backend must be 'auto' or 'naive'"):
        value_check_numbers([RowCheck(x, None, "not_finite")], backend="triton")
    with pytest.raises(ValueError, match="mode must be one of"):
        fuse_value_checks("sometimes")


def test_naive_rule_names_are_the_contracts():
    x = torch.tensor([NAN])
    for rule in RULES:
        rejected(x, rule)
    with pytest.raises(ValueError, match="not a value-check rule"):
        rejected(x, "nope")


# ------------------------------------------------------------------ DeferredChecks


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
def test_add_rows_refuses_a_bad_check_at_once(device_path):
    path = device_code_path() if device_path else contextlib.nullcontext()
    with path, pytest.raises(ValueError, match=r"^check.rule must be one of"):
        checks = DeferredChecks(torch.device("cpu"))
        assert checks.deferred == device_path
        checks.add_rows(torch.zeros(2), None, "finite", _error_after)


def _error_after(v):
    return ValueError(f"row {int(v[2])} value {v[3]}") if v[0] else None


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
def test_deferred_checks_keep_the_call_order_across_row_and_number_checks(device_path):
    """The first failing check in call order is raised, whichever block its numbers are in;
    the same error on the host path (at once) and on the device path (at the next read)."""

    def run():
        checks = DeferredChecks(torch.device("cpu"))
        checks.add_rows(torch.tensor([1.0, 2.0]), None, "not_finite", _error_after)  # passes
        checks.add([torch.tensor(0.0)], lambda v: ValueError("number") if v[0] else None)
        checks.add_rows(torch.tensor([0.0, 0.5, 3.0]), None, "not_01", _error_after)  # fails
        checks.add([torch.tensor(1.0)], lambda v: ValueError("later") if v[0] else None)
        checks.submit()

    if device_path:
        with device_code_path():
            run()  # nothing raised yet
            with pytest.raises(ValueError, match=r"^row 1 value 0.5$"):
                raise_deferred_errors()
    else:
        with pytest.raises(ValueError, match=r"^row 1 value 0.5$"):
            run()


# ------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_the_compiled_program_equals_the_gold_on_cuda(dtype):
    """The compiled program (not the interpreter) on 1 to 300,000 entries, strided too."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (1, 1025, 300_000):
        base = torch.randn(n, 2, generator=g, device="cuda", dtype=torch.float64)
        base[n // 3, 0] = NAN
        base[n - 1, 1] = -INF
        values = base.to(dtype) if dtype.is_floating_point else (base > 1).to(dtype) * 3
        rows = torch.rand(n, 2, generator=g, device="cuda") < 0.9
        for rule, view in itertools.product(RULES, (values, values.t(), values[:, :1])):
            r = rows[: view.shape[0], : view.shape[1]] if view.dim() == 2 else None
            if view.shape != values.shape:
                r = None
            threshold = 1e-3 if dtype.is_floating_point else 1
            fused, gold = both([RowCheck(view, r, rule, threshold)])
            assert_same(fused, gold)
