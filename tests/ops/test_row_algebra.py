"""The fused ``[N]`` loss algebra (``echoloss.ops.row_algebra``): the Triton program against its
plain-PyTorch gold (``naive.py``) for every policy and option, hand-computed values, derivatives
against fp64 autograd of the loss module's algebra, non-finite rows and extreme inputs.

The program runs under the Triton interpreter on CPU (``tests/ops/conftest.py``). Row counts above
``BLOCK`` make both loops of the program run several times (2500: three blocks, the last one
partial; 2048: two full blocks); 700 and 1 run one partial block.

Tolerances (both backends compute in fp32 from the same inputs):

* sums (the loss and its two terms, the echo-NLL mean, the mismatch-KL and entropy means): each
  of the program's ``BLOCK`` lanes adds ``⌈N/BLOCK⌉`` terms in sequence and the lanes are then
  reduced as a tree of ``log2(BLOCK)`` levels; torch's CPU sum is a cascade (pairwise) sum of
  depth about ``log2(N)``. Each is within (its depth)·eps·Σ|x_i| of the exact sum, and each term
  carries a few ulps of its per-row formula: `_sum_tol` = ``(⌈N/BLOCK⌉ + log2(BLOCK) + log2(N)
  + 16)·eps·S`` with ``S`` a bound of Σ|x_i| computed from the inputs (`_bounds`). One row of
  2500 left out or counted twice moves a sum by about ``S/N``, 10x more than this.
* per-row derivatives ``a`` and ``b``: the same formula per row, in closed form in the program
  and through autograd's chain rule in the gold, about six roundings apart, plus the ulp by which
  numpy's (the interpreter's) and torch's fp32 ``exp`` may differ: ``16·eps·G_i``, ``G_i`` a bound
  of the row's derivative terms before they cancel (the ``kl_tau`` term can cancel the policy's).
* counts, flag fractions (an integer count divided by the same fp32 count), the echo-NLL
  maximum (order-free) and the check numbers that read an input or a non-finite value: exact.
* hand-computed values: the formula's value in fp64 on the test's numbers, which the fp32
  inputs (``log(1.5)``, ``0.7``) and a handful of fp32 operations round: within ``4·eps``
  relative (``eps`` where the result is one rounding away, e.g. ``-w/N``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from _fused_cases import DEVICE
from _row_algebra_cases import EPS, Case, bounds, ref_kl_scale, sum_tol

from echoloss.loss import LossConfig, LossInputs
from echoloss.loss.core import echo_loss_from_logprobs
from echoloss.loss.fused import fuse_loss_algebra
from echoloss.ops.row_algebra import CHECK_SLOTS, STAT_SLOTS, RowAlgebraParams, RowInputs
from echoloss.ops.row_algebra import row_algebra as row_algebra_op
from echoloss.ops.row_algebra.fused import BLOCK
from echoloss.ops.row_algebra.op import FLAG_NAMES, POLICIES
from echoloss.ops.row_algebra.policies import ROW_POLICIES

# Non-finite test inputs make numpy (the interpreter) warn about inf - inf and overflows.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

NAN = math.nan
#: Row counts: three blocks (last partial), two full blocks, one partial block, one row.
NS = (2500, 2 * BLOCK, 700, 1)
assert NS[0] > 2 * BLOCK and NS[0] % BLOCK and NS[2] < BLOCK

#: Policy variants: (name, RowAlgebraParams keywords).
VARIANTS = {
    "dppo": dict(policy="dppo", low=0.2, high=0.2),
    "ppo_clip": dict(policy="ppo_clip", low=0.2, high=0.28),
    "ppo_clip_dual": dict(policy="ppo_clip", low=0.2, high=0.2, dual_clip=3.0),
    "cispo": dict(policy="cispo", low=0.5, high=2.0),
    "cispo_no_low": dict(policy="cispo", low=None, high=2.0),
    "reinforce": dict(policy="reinforce", low=None, high=0.0, adv_tau=0.7),
    "sft": dict(policy="sft", low=None, high=0.0),
    "gspo": dict(policy="gspo", low=3e-4, high=4e-4),
    "gspo_wide": dict(policy="gspo", low=0.2, high=0.28, adv_tau=0.7),
    "cispo_sequence": dict(policy="cispo_sequence", low=0.5, high=1.5),
    # TRL's default temperatures; sharp gates (τ = 8: saturated beyond |r − 1| ≈ 1) with an
    # advantage scale
    "sapo": dict(policy="sapo", low=None, high=0.0),
    "sapo_sharp": dict(
        policy="sapo", low=None, high=0.0, sapo_temperature_pos=8.0, sapo_temperature_neg=0.3
    ),
    "sapo_sequence": dict(
        policy="sapo_sequence",
        low=None,
        high=0.0,
        sapo_temperature_pos=0.7,
        sapo_temperature_neg=2.5,
        adv_tau=0.7,
    ),
}

#: The options and their values; every value of every option runs for every variant
#: (`test_options_cover_every_value`).
OPTIONS: dict[str, tuple[Any, ...]] = {
    "log_ratio_clamp": (20.0, None),
    "kl_tau": (0.0, 0.3),
    "entropy_coef": (0.0, 0.05),
    "entropy_metric": (False, True),
    "mismatch_metric": (False, True),
    "rl_divisor": ("count", "host", "device"),
    "rl_normalization": ("token", "sequence_mean_token_mean", "sequence_mean_token_sum"),
    "echo": (
        ("token_mean", None),
        ("token_mean", 5000.0),
        ("token_mean", "device"),
        ("sum", None),
        ("batch_token_mean", None),
        ("batch_token_mean", 4.0),
        ("batch_token_mean", "device"),
        ("sequence_mean", None),
        ("sequence_mean", 40.0),
        ("sequence_mean", "device"),
    ),
    "echo_z_epsilon": (0.0, 1e-3),
    # the ratio's base (old, inference or no logprobs given) with the mismatch correction,
    # which reads the inference logprobs
    "base_mismatch": (
        ("old", None),
        ("inference", None),
        ("none", None),
        ("old", "token_truncate"),
        ("inference", "token_mask"),
        ("old", "sequence_truncate"),
        ("inference", "sequence_mask"),
    ),
    "mismatch_min": (None, 0.5),
    "kl": ((None, 0.0), ("k1", 0.1), ("k2", 0.2), ("k3", 0.1)),
    # how rows group into sequences: runs of consecutive rows, ids scattered over the rows
    # (a sequence's rows far apart), one sequence over every block
    "sequences": ("runs", "scattered", "one"),
    "echo_weights": (True, False),
    "advantages": (True, True, False),
    "far_ratios": (False, True),
}
SETS_PER_VARIANT = 12


def _option_sets(variant: str) -> list[dict[str, Any]]:
    """``SETS_PER_VARIANT`` option sets for ``variant``: each option's values in a shuffled
    cycle (every value appears), the options shuffled independently of each other."""
    rng = random.Random(f"row-algebra-{variant}")
    columns = {}
    for name, values in OPTIONS.items():
        cycle = [values[k % len(values)] for k in range(SETS_PER_VARIANT)]
        rng.shuffle(cycle)
        columns[name] = cycle
    sets = []
    for k in range(SETS_PER_VARIANT):
        o = _consistent(variant, {name: col[k] for name, col in columns.items()})
        o["n"] = NS[k % len(NS)]
        sets.append(o)
    return sets


def _consistent(variant: str, o: dict[str, Any]) -> dict[str, Any]:
    """``o`` with the options that cannot go together resolved (what `RowAlgebraParams` and
    the op reject)."""
    o = dict(o)
    if "base_mismatch" in o:
        o["base"], o["mismatch"] = o.pop("base_mismatch")
    if o["base"] == "none":  # no inference logprobs to read
        o["mismatch_metric"] = False
    if variant == "sft":  # the NLL of the RL rows: no policy terms (RowAlgebraParams)
        o.update(kl_tau=0.0, entropy_coef=0.0, mismatch_metric=False, mismatch=None, kl=(None, 0.0))
    return o


def _masks(n: int, g: torch.Generator, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if n == 1:  # the one row is RL, echo or padding in turn
        kind = seed % 3
        return torch.tensor([kind == 0]), torch.tensor([kind == 1])
    u = torch.rand(n, generator=g)
    rl = u < 0.45
    echo = (u >= 0.45) & (u < 0.8)  # the rest (20 %) is padding
    return rl, echo


def _sequence_ids(n: int, layout: str, part: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``[N]`` int64 sequence ids; rows that do not participate get -1 or a participating
    sequence's id (a prompt token of that sequence) at random."""
    if layout == "runs":  # runs of 1-80 rows, ids increasing
        lengths = torch.randint(1, 81, (n,), generator=g)
        sid = torch.repeat_interleave(torch.arange(n), lengths)[:n]
    elif layout == "scattered":  # ids in random order, each sequence's rows spread out
        sid = torch.randint(0, max(n // 25, 1), (n,), generator=g) * 7 + 3
    else:
        sid = torch.full((n,), 5)
    padding = torch.rand(n, generator=g) < 0.5
    return torch.where(part | ~padding, sid, -1)


def _make_case(variant: str, o: dict[str, Any], seed: int) -> Case:
    """Random rows with NaN placeholders on every row where a field is not read."""
    n = o["n"]
    g = torch.Generator().manual_seed(seed)
    rl, echo = _masks(n, g, seed)
    part = rl | echo
    lp = -(torch.rand(n, generator=g) * 4 + 1e-3)
    shift = torch.randn(n, generator=g) * 0.4
    shift[::13] = 0.0  # ratio exactly 1 (ppo_clip's two branches tie)
    if o["far_ratios"]:  # beyond log_ratio_clamp: |ρ| in (20, 28)
        far = torch.rand(n, generator=g) < 0.03
        far_shift = torch.sign(torch.randn(n, generator=g)) * (20 + 8 * torch.rand(n, generator=g))
        shift = torch.where(far, far_shift, shift)
        # ρ = lp - old < -20 needs lp < -20 (old is a log-probability too)
        lp = torch.where(far & (far_shift < 0), lp + far_shift - 1, lp)
    shift = shift * o.get("shift_scale", 1.0)
    old = (lp - shift).clamp(max=0.0)
    lq = (lp - torch.randn(n, generator=g) * 0.3).clamp(max=0.0)
    ref = (lp - torch.randn(n, generator=g) * 0.5).clamp(max=0.0)
    ref[::11] = lp[::11]  # d = 0: k3's series branch, k1/k2 at their zero
    adv = torch.randn(n, generator=g) * o.get("adv_scale", 1.0)
    adv[::7] = 0.0
    w = 0.1 + 2 * torch.rand(n, generator=g)
    ent = 3 * torch.rand(n, generator=g)
    nan = torch.tensor(NAN)
    lp = torch.where(part, lp, nan)
    old, lq, adv, ent, ref = (torch.where(rl, t, nan) for t in (old, lq, adv, ent, ref))
    w = torch.where(echo, w, nan)
    sid = _sequence_ids(n, o["sequences"], part, g)
    observation = torch.rand(n, generator=g) < 0.3

    base = o["base"]
    echo_norm, echo_div = o["echo"]
    echo_div_dev = None
    if echo_div == "device":
        echo_div = 9.0  # replaced by the device tensor
        echo_div_dev = torch.tensor(321.5 if echo_norm == "token_mean" else 3.5)
    rl_div_host: float | None = None
    rl_div_dev = None
    if o["rl_divisor"] == "host":
        rl_div_host = 3000.0
    elif o["rl_divisor"] == "device":
        rl_div_host = 7.0  # replaced by the device tensor
        rl_div_dev = torch.tensor(1234.5)
    rows = RowInputs(
        rl=rl,
        echo=echo,
        echo_weights=w if o["echo_weights"] else None,
        advantages=adv if o["advantages"] else None,
        old_logprobs=old if base == "old" else None,
        inference_logprobs=lq if base in ("old", "inference") else None,
        rl_divisor=rl_div_dev,
        sequence_ids=sid,
        observation=observation,
        ref_logprobs=ref,
        echo_divisor=echo_div_dev,
    )
    kl_estimator, kl_coef = o["kl"]
    keys = (
        "log_ratio_clamp",
        "kl_tau",
        "entropy_coef",
        "entropy_metric",
        "mismatch_metric",
        "rl_normalization",
        "echo_z_epsilon",
        "mismatch",
        "mismatch_min",
    )
    params = RowAlgebraParams(
        **VARIANTS[variant],
        **{k: o[k] for k in keys},
        rl_divisor=rl_div_host,
        echo_normalization=echo_norm,
        echo_divisor=echo_div,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator or "k3",
    )
    need_ent = params.entropy_coef != 0 or params.entropy_metric
    return Case(lp, ent if need_ent else None, rows, params)


# ---------------------------------------------------------------- comparisons


def _run(case: Case, backend: str):
    """One call on ``DEVICE`` (the interpreter on CPU): ``(output, a, b)`` back on the CPU."""
    lp = case.lp.to(DEVICE, copy=True).requires_grad_()
    train_ent = case.params.entropy_coef != 0
    ent = None if case.ent is None else case.ent.to(DEVICE, copy=True).requires_grad_(train_ent)
    rows = RowInputs(*(t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in case.rows))
    out = row_algebra_op(lp, ent, rows, case.params, backend=backend)
    out.loss.backward()
    b = ent.grad.cpu() if train_ent else None
    return type(out)(*(t.detach().cpu() for t in out)), lp.grad.cpu(), b


def check(out, name: str) -> float:
    return float(out.checks[CHECK_SLOTS.index(name)])


def stat(out, name: str) -> float:
    return float(out.stats[STAT_SLOTS.index(name)])


def _same(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))


def _close(actual: float, expected: float, tol: float, what: str) -> None:
    if math.isfinite(expected):
        assert abs(actual - expected) <= tol, f"{what}: {actual!r} vs {expected!r} (tol {tol:.3g})"
    else:
        assert _same(actual, expected), f"{what}: {actual!r} vs {expected!r}"


def assert_checks_equal(fused, naive, *, loss_tol: float, what: str = "") -> None:
    """Check numbers: flags, rows and counts exact; value slots where their flag is set (the
    per-row values exactly: an input or a non-finite loss; the loss slots within ``loss_tol``)."""
    for prefix, values in (
        ("scored", ("row", "count", "value", "is_rl")),
        ("policy", ("row", "value")),
        ("entropy", ("row", "value")),
    ):
        flag = check(naive, f"{prefix}_bad")
        assert check(fused, f"{prefix}_bad") == flag, f"{what} {prefix}_bad"
        if flag:
            for v in values:
                name = f"{prefix}_{v}"
                assert _same(check(fused, name), check(naive, name)), (
                    f"{what} {name}: {check(fused, name)} vs {check(naive, name)}"
                )
    assert check(fused, "loss_bad") == check(naive, "loss_bad"), what
    for name in ("loss", "loss_rl", "loss_echo"):
        _close(check(fused, name), check(naive, name), loss_tol, f"{what} check {name}")


def assert_same_as_naive(case: Case, what: str = "") -> None:
    """Fused vs naive: loss, every stat slot, ``a``, ``b`` and the checks (module docstring)."""
    fused, a_f, b_f = _run(case, "triton")
    naive, a_n, b_n = _run(case, "naive")
    s, g = bounds(case)
    tol = sum_tol(case.n, s)
    rows = case.rows
    what = f"{what} n={case.n} {case.params}"
    _close(float(fused.loss.detach()), float(naive.loss.detach()), tol, f"{what} loss")
    p = case.params
    n_echo = max(int(rows.echo.sum()), 1)
    lp_echo = torch.where(rows.echo, case.lp.double(), 0.0)
    sum_scales = {
        "loss": s,
        "loss_rl": s,
        "loss_echo": s,
        "echo_nll_mean": float(lp_echo.abs().sum()) / n_echo,
        "mismatch_kl": float(naive.stats[STAT_SLOTS.index("mismatch_kl")]),  # Σ of terms ≥ 0
        "entropy": float(naive.stats[STAT_SLOTS.index("entropy")]),  # Σ of terms ≥ 0
        "is_weight": float(naive.stats[STAT_SLOTS.index("is_weight")]),  # Σ of terms ≥ 0
        "ref_kl": ref_kl_scale(case),
    }
    for i, name in enumerate(STAT_SLOTS):
        fv, nv = float(fused.stats[i]), float(naive.stats[i])
        if name in sum_scales:
            _close(fv, nv, sum_tol(case.n, abs(sum_scales[name])), f"{what} stat {name}")
        else:
            assert _same(fv, nv), f"{what} stat {name}: {fv} vs {nv}"
    # a: exactly 0 off the participating rows (NaN placeholders there), few ulps elsewhere
    part = rows.rl | rows.echo
    assert torch.all(a_f[~part] == 0) and torch.all(a_n[~part] == 0), what
    diff = (a_f.double() - a_n.double()).abs()
    bad = ~(diff <= 16 * EPS * g)
    assert not bad.any(), (
        f"{what} a: rows {bad.nonzero().flatten()[:5].tolist()} fused "
        f"{a_f[bad][:5].tolist()} naive {a_n[bad][:5].tolist()}"
    )
    if p.entropy_coef != 0:
        assert b_f is not None and b_n is not None
        assert torch.all(b_f[~rows.rl] == 0) and torch.all(b_n[~rows.rl] == 0), what
        torch.testing.assert_close(b_f, b_n, rtol=4 * EPS, atol=0.0, msg=what)
    if p.check_finite:
        assert_checks_equal(fused, naive, loss_tol=tol, what=what)


# ---------------------------------------------------------------- fused vs naive


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_equals_naive_for_every_option(variant):
    for k, o in enumerate(_option_sets(variant)):
        case = _make_case(variant, o, seed=1000 * k + len(variant))
        assert_same_as_naive(case, f"{variant} set {k} {o}")


def test_options_cover_every_value():
    for variant in VARIANTS:
        sets = _option_sets(variant)
        for name, values in OPTIONS.items():
            if name == "base_mismatch":
                seen = {repr((o["base"], o["mismatch"])) for o in sets}
            else:
                seen = {repr(o[name]) for o in sets}
            expected = {repr(v) for v in values}
            if variant == "sft" and name in ("kl_tau", "entropy_coef", "mismatch_metric", "kl"):
                expected = {repr(values[0])}
            if variant == "sft" and name == "base_mismatch":
                expected = {repr((b, None)) for b, _ in values}
            assert expected <= seen, (variant, name, seen)
        assert {o["n"] for o in sets} == set(NS)


@pytest.mark.parametrize("n", [BLOCK, 3 * BLOCK + 1])
def test_block_edges(n):
    """Exactly one block, and one row into a fourth block (the masked tail of one lane)."""
    o = _option_sets("ppo_clip_dual")[1] | {"n": n, "entropy_coef": 0.05, "kl_tau": 0.3}
    assert_same_as_naive(_make_case("ppo_clip_dual", o, seed=n), "block edge")


def test_device_divisor_replaces_the_host_value():
    """``RowInputs.rl_divisor`` and ``echo_divisor`` (device tensors) win over the host values
    of `RowAlgebraParams` and over the call's own counts, in every mode that divides."""
    lp = torch.tensor([-0.5, -1.0, -2.0, -4.0])
    rows = RowInputs(
        torch.tensor([True, True, False, False]),
        torch.tensor([False, False, True, True]),
        echo_weights=torch.tensor([NAN, NAN, 1.0, 0.5]),
        advantages=torch.tensor([1.0, 3.0, NAN, NAN]),
        rl_divisor=torch.tensor(4.0),
        sequence_ids=torch.tensor([0, 0, 0, 1]),
        observation=torch.tensor([False, False, True, False]),
        echo_divisor=torch.tensor(8.0),
    )
    rl_sum, echo_sum = 0.5 + 3.0, 2.0 + 2.0
    cases = {  # (rl mode, echo mode): (loss, RL a, echo a)
        ("token", "token_mean"): (rl_sum / 4 + echo_sum / 8, [-1 / 4, -3 / 4], [-1 / 8, -0.5 / 8]),
        # batch_token_mean: the device value divides the echo rows' count (2)
        ("token", "batch_token_mean"): (
            rl_sum / 4 + echo_sum / 16,
            [-1 / 4, -3 / 4],
            [-1 / 16, -0.5 / 16],
        ),
        # per sequence: sequence 0 holds both RL rows and Z = 1 echo row; sequence 1 Z = 1
        ("sequence_mean_token_sum", "sequence_mean"): (
            rl_sum / 4 + (2.0 / 1 + 2.0 / 1) / 8,
            [-1 / 4, -3 / 4],
            [-1 / 8, -0.5 / 8],
        ),
        ("sequence_mean_token_mean", "sequence_mean"): (
            rl_sum / 2 / 4 + (2.0 / 1 + 2.0 / 1) / 8,
            [-1 / 8, -3 / 8],
            [-1 / 8, -0.5 / 8],
        ),
    }
    for (rl_mode, echo_mode), (loss, rl_a, echo_a) in cases.items():
        p = RowAlgebraParams(
            "reinforce",
            rl_divisor=7.0,
            rl_normalization=rl_mode,
            echo_normalization=echo_mode,
            echo_divisor=5.0,
        )
        for backend in ("triton", "naive"):
            out, a, _ = _run(Case(lp, None, rows, p), backend)
            what = (rl_mode, echo_mode, backend)
            assert float(out.loss.detach()) == pytest.approx(loss, rel=2 * EPS), what
            assert a.tolist() == [*rl_a, *echo_a], what


def test_device_divisors_are_one_float_on_the_device():
    lp = torch.tensor([-0.5])
    rows = RowInputs(rl=torch.tensor([True]), echo=torch.tensor([False]))
    p = RowAlgebraParams("sft", low=None, high=0.0)
    for field, value in (
        ("rl_divisor", torch.tensor([2.0, 3.0])),
        ("echo_divisor", torch.tensor(2)),
        ("echo_divisor", 2.0),
    ):
        with pytest.raises(ValueError, match=rf"rows\.{field}.*1-element float tensor"):
            row_algebra_op(lp, None, rows._replace(**{field: value}), p, backend="naive")
    summed = dataclasses.replace(p, echo_normalization="sum")
    with pytest.raises(ValueError, match=r"rows\.echo_divisor.*'sum'"):
        row_algebra_op(
            lp, None, rows._replace(echo_divisor=torch.tensor(2.0)), summed, backend="naive"
        )


# ---------------------------------------------------------------- hand-computed values


def _both(case: Case):
    return [(_run(case, b), b) for b in ("triton", "naive")]


def test_ppo_clip_by_hand_clipped_row_tie_and_echo():
    """ppo_clip (eps 0.2), 5 rows, ratios against ``old_logprobs``:

    row 0, A = 1,  r = 1.5 > 1.2: clipped high, term -1.2, gradient 0;
    row 1, A = 2,  r = 1 (old = lp): both branches equal 2, gradient the full -A·r = -2 (not half);
    row 2, A = -1, r = 0.5 < 0.8: clipped low, min(-0.5, -0.8) = -0.8, term +0.8, gradient 0;
    row 3, echo, w = 0.5, lp = -0.7: 0.35 over 1 echo row, gradient -0.5;
    row 4, padding: NaN everywhere, gradient exactly 0.
    loss = (-1.2 - 2 + 0.8)/3 + 0.35 = -0.45.
    """
    lp = torch.tensor([-1.0, -0.3, -2.0, -0.7, NAN])
    old = torch.tensor([-1.0 - math.log(1.5), -0.3, -2.0 - math.log(0.5), NAN, NAN])
    rows = RowInputs(
        rl=torch.tensor([True, True, True, False, False]),
        echo=torch.tensor([False, False, False, True, False]),
        echo_weights=torch.tensor([NAN, NAN, NAN, 0.5, NAN]),
        advantages=torch.tensor([1.0, 2.0, -1.0, NAN, NAN]),
        old_logprobs=old,
    )
    p = RowAlgebraParams("ppo_clip", low=0.2, high=0.2)
    for (out, a, _), backend in _both(Case(lp, None, rows, p)):
        assert float(out.loss.detach()) == pytest.approx(-0.45, rel=4 * EPS, abs=4 * EPS), backend
        assert stat(out, "loss_rl") == pytest.approx(-0.8, rel=4 * EPS)
        assert stat(out, "loss_echo") == pytest.approx(0.35, rel=4 * EPS)
        torch.testing.assert_close(a, torch.tensor([0.0, -2 / 3, 0.0, -0.5, 0.0]), rtol=EPS, atol=0)
        assert a[0] == 0 and a[2] == 0 and a[4] == 0
        assert [stat(out, k) for k in ("rl_tokens", "echo_tokens")] == [3.0, 1.0]
        assert stat(out, "echo_nll_mean") == pytest.approx(0.7, rel=EPS)
        assert stat(out, "echo_nll_max") == pytest.approx(0.7, rel=EPS)
        assert [stat(out, f"flag{i}") for i in range(4)] == pytest.approx(
            [2 / 3, 1 / 3, 1 / 3, 0.0], rel=EPS
        )
        assert check(out, "scored_bad") == check(out, "policy_bad") == check(out, "loss_bad") == 0


def test_ppo_clip_at_the_exact_clip_bound_the_clamp_passes_the_gradient():
    """eps_low = eps_high = 0: both clip bounds are 1, and on-policy ratios are exactly 1. Both
    branches tie (``r·A = clamp(r, 1, 1)·A``) and the clamp passes the gradient on its bound
    (autograd's convention), so each row's gradient is the full ``-A·r / N_rl`` (half of it if the
    clamp blocked the gradient on its bound, since min splits ties in half)."""
    lp = torch.tensor([-0.4, -1.3, -2.0])
    adv = torch.tensor([3.0, -3.0, 0.5])
    rows = RowInputs(
        torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool), advantages=adv
    )
    for dual in (None, 3.0):
        p = RowAlgebraParams("ppo_clip", low=0.0, high=0.0, dual_clip=dual)
        for (out, a, _), backend in _both(Case(lp, None, rows, p)):
            assert a.tolist() == pytest.approx([-1.0, 1.0, -0.5 / 3], rel=EPS), (backend, dual)
            assert float(out.loss.detach()) == pytest.approx(-0.5 / 3, rel=4 * EPS)
            assert stat(out, "flag0") == 0.0  # r = 1 is not beyond a bound of 1


def test_dppo_by_hand_dropped_row_and_echo_mean():
    """dppo (probability trust region 0.2), 4 rows:

    row 0, A = 1, p = 0.9 vs p_old = 0.5: Δ = 0.4 > 0.2, dropped (masked_high): 0, gradient 0;
    row 1, A = -1, p = 0.5 vs p_old = 0.6: Δ = -0.1 ≥ -0.2, kept: term +r = 5/6, gradient +r/2;
    row 2, echo w = 1, lp = -2; row 3, echo w = 0.25, lp = -0.4: (2 + 0.1)/2 = 1.05, gradients
    -1/2 and -0.25/2, whatever the (NaN) old logprobs there say.
    """
    lp = torch.tensor([math.log(0.9), math.log(0.5), -2.0, -0.4])
    rows = RowInputs(
        rl=torch.tensor([True, True, False, False]),
        echo=torch.tensor([False, False, True, True]),
        echo_weights=torch.tensor([NAN, NAN, 1.0, 0.25]),
        advantages=torch.tensor([1.0, -1.0, NAN, NAN]),
        old_logprobs=torch.tensor([math.log(0.5), math.log(0.6), NAN, NAN]),
        inference_logprobs=torch.tensor([-0.1, -0.1, NAN, NAN]),
    )
    r = 0.5 / 0.6
    p = RowAlgebraParams("dppo", low=0.2, high=0.2)
    for (out, a, _), backend in _both(Case(lp, None, rows, p)):
        assert float(out.loss.detach()) == pytest.approx(r / 2 + 1.05, rel=4 * EPS), backend
        assert a.tolist() == pytest.approx([0.0, r / 2, -0.5, -0.125], rel=4 * EPS)
        assert a[0] == 0
        assert [stat(out, f"flag{i}") for i in range(3)] == [0.5, 0.0, 0.5]
        assert stat(out, "echo_nll_max") == pytest.approx(2.0, rel=EPS)


def test_cispo_and_reinforce_and_sft_by_hand():
    """cispo: -(clamp(r, low, high)·A·lp) with the weight detached: gradient -w·A; reinforce:
    -(A·lp)·adv_tau; sft: the NLL of the RL rows."""
    lp = torch.tensor([-1.0, -0.5])
    rows = RowInputs(
        rl=torch.tensor([True, True]),
        echo=torch.tensor([False, False]),
        advantages=torch.tensor([2.0, -1.0]),
        old_logprobs=torch.tensor([-1.0 - math.log(4.0), -0.5 - math.log(0.25)]),  # r = 4, 0.25
    )
    cases = {
        # weights clamp(4, 0.5, 2) = 2 and clamp(0.25, 0.5, 2) = 0.5
        "cispo": (
            RowAlgebraParams("cispo", low=0.5, high=2.0),
            (-(2 * 2 * -1.0) - (0.5 * -1 * -0.5)) / 2,
            [-2.0, 0.25],
            [1.0, 0.5, 0.5],
        ),
        "cispo_no_low": (
            RowAlgebraParams("cispo", low=None, high=2.0),
            (4.0 - 0.25 * 0.5) / 2,
            [-2.0, 0.125],
            [0.5, 0.0, 0.5],
        ),
        "reinforce": (
            RowAlgebraParams("reinforce", adv_tau=0.5, low=None, high=0.0),
            (1.0 - 0.25) / 2,
            [-0.5, 0.25],
            [0.0, 0.0, 0.0],
        ),
        "sft": (RowAlgebraParams("sft", low=None, high=0.0), 0.75, [-0.5, -0.5], [0.0] * 3),
    }
    for name, (p, loss, grad, flags) in cases.items():
        for (out, a, _), backend in _both(Case(lp, None, rows, p)):
            assert float(out.loss.detach()) == pytest.approx(loss, rel=4 * EPS), (name, backend)
            assert a.tolist() == pytest.approx(grad, rel=4 * EPS), (name, backend)
            assert [stat(out, f"flag{i}") for i in range(3)] == flags, (name, backend)


def test_kl_tau_and_entropy_bonus_by_hand():
    """kl_tau·ρ² (continued linearly beyond the clamp, 2·c·|ρ| - c²) and -entropy_coef·H on RL rows:
    ρ = 0.5 inside and ρ = -30 beyond c = 20; reinforce with A = 0 isolates the penalty."""
    lp = torch.tensor([-0.5, -31.0])
    ent = torch.tensor([1.5, 0.5])
    rows = RowInputs(
        torch.tensor([True, True]),
        torch.tensor([False, False]),
        advantages=torch.tensor([0.0, 0.0]),
        old_logprobs=torch.tensor([-1.0, -1.0]),
    )
    p = RowAlgebraParams("reinforce", low=None, high=0.0, kl_tau=0.1, entropy_coef=0.2)
    loss = (0.1 * 0.25 + 0.1 * (2 * 20 * 30 - 400) - 0.2 * (1.5 + 0.5)) / 2
    for (out, a, b), backend in _both(Case(lp, ent, rows, p)):
        assert float(out.loss.detach()) == pytest.approx(loss, rel=4 * EPS), backend
        assert a.tolist() == pytest.approx([0.1 * 2 * 0.5 / 2, 0.1 * 2 * 20 * -1 / 2], rel=4 * EPS)
        assert b.tolist() == pytest.approx([-0.1, -0.1], rel=EPS)


def test_echo_normalizations_by_hand():
    """Echo rows w·(-log p): token_mean over the call's echo rows or a given divisor, sum, and
    batch_token_mean (the token mean over a divisor of batches)."""
    lp = torch.tensor([-1.0, -2.0, -0.5, NAN])
    rows = RowInputs(
        torch.tensor([False, False, False, False]),
        torch.tensor([True, True, True, False]),
        echo_weights=torch.tensor([1.0, 0.5, 2.0, NAN]),
    )
    total = 1.0 + 1.0 + 1.0  # Σ w·nll
    cases = [
        ("token_mean", None, 3.0),
        ("token_mean", 10.0, 10.0),
        ("sum", None, 1.0),
        ("batch_token_mean", None, 3.0),
        ("batch_token_mean", 4.0, 12.0),
    ]
    for norm, div, d in cases:
        p = RowAlgebraParams("dppo", echo_normalization=norm, echo_divisor=div)
        for (out, a, _), backend in _both(Case(lp, None, rows, p)):
            assert float(out.loss.detach()) == pytest.approx(total / d, rel=4 * EPS), (
                norm,
                div,
                backend,
            )
            assert a.tolist() == pytest.approx([-1.0 / d, -0.5 / d, -2.0 / d, 0.0], rel=4 * EPS)
            assert stat(out, "loss_rl") == 0.0 and stat(out, "rl_tokens") == 0.0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("mismatch", ["token_truncate", "token_mask"])
def test_mismatch_correction_and_reference_kl_by_hand(mismatch, estimator):
    """reinforce on three RL rows with ``w = exp(old - lq)`` = 2, 1, 0.5 against the bounds
    [0.6, 1.5] (rows 0 and 2 outside: truncated to 1.5 and 0.6, or masked to 0) and
    ``d = ref - lp`` = -0.5, 0, 1 under ``kl_coef = 0.1``; a padding row of NaN."""
    ln2 = math.log(2.0)
    lp = torch.tensor([-1.0, -0.5, -2.0, NAN])
    rows = RowInputs(
        rl=torch.tensor([True, True, True, False]),
        echo=torch.tensor([False, False, False, False]),
        advantages=torch.tensor([1.0, 2.0, -1.0, NAN]),
        old_logprobs=torch.tensor([-1.0, -0.5, -2.0, NAN]),
        inference_logprobs=torch.tensor([-1.0 - ln2, -0.5, -2.0 + ln2, NAN]),
        ref_logprobs=torch.tensor([-1.5, -0.5, -1.0, NAN]),
    )
    w = [1.5, 1.0, 0.6] if mismatch == "token_truncate" else [0.0, 1.0, 0.0]
    d = [-0.5, 0.0, 1.0]
    kl, dkl = {  # the estimate and its derivative with respect to lp
        "k1": ([-x for x in d], [1.0, 1.0, 1.0]),
        "k2": ([0.5 * x * x for x in d], [-x for x in d]),
        "k3": ([math.expm1(x) - x for x in d], [-math.expm1(x) for x in d]),
    }[estimator]
    adv, lps = [1.0, 2.0, -1.0], [-1.0, -0.5, -2.0]
    loss = sum(-adv[i] * lps[i] * w[i] + 0.1 * kl[i] for i in range(3)) / 3
    a = [(-adv[i] * w[i] + 0.1 * dkl[i]) / 3 for i in range(3)]
    p = RowAlgebraParams(
        "reinforce",
        low=None,
        high=0.0,
        mismatch=mismatch,
        mismatch_max=1.5,
        mismatch_min=0.6,
        kl_coef=0.1,
        kl_estimator=estimator,
    )
    for (out, grad, _), backend in _both(Case(lp, None, rows, p)):
        what = (mismatch, estimator, backend)
        assert float(out.loss.detach()) == pytest.approx(loss, rel=8 * EPS, abs=8 * EPS), what
        assert grad.tolist() == pytest.approx([*a, 0.0], rel=8 * EPS, abs=8 * EPS), what
        assert stat(out, "is_weight") == pytest.approx(sum(w) / 3, rel=4 * EPS), what
        assert stat(out, "ref_kl") == pytest.approx(sum(kl) / 3, rel=4 * EPS, abs=4 * EPS), what
        assert stat(out, "mismatch_flag") == pytest.approx(2 / 3, rel=EPS), what


def test_gspo_by_hand():
    """gspo (eps 0.2) on two sequences whose rows are interleaved (ids 7, 3, 7):

    sequence 7, rows 0 (A = 1) and 2 (A = -1), ρ = 0.1 and 0.3: s = e^0.2 = 1.2214 > 1.2.
    Row 0 is clipped high (term -1.2, nothing flows back); row 2's unclipped branch is the
    smaller, -s·(-1) = s: its term s, and ∂s/∂ℓ = s/2 on both rows: a = s/2/3 on rows 0 and 2.
    Sequence 3, row 1 (A = 2), ρ = -0.1: s = e^-0.1 inside the range: term -2s, a = -2s/3.
    Row 3 is echo (w = 1, lp = -0.4: 0.4 over one echo row), row 4 padding."""
    lp = torch.tensor([-1.0, -2.0, -0.5, -0.4, NAN])
    rows = RowInputs(
        rl=torch.tensor([True, True, True, False, False]),
        echo=torch.tensor([False, False, False, True, False]),
        echo_weights=torch.tensor([NAN, NAN, NAN, 1.0, NAN]),
        advantages=torch.tensor([1.0, 2.0, -1.0, NAN, NAN]),
        old_logprobs=torch.tensor([-1.1, -1.9, -0.8, NAN, NAN]),
        sequence_ids=torch.tensor([7, 3, 7, 3, -1]),
    )
    s7, s3 = math.exp(0.2), math.exp(-0.1)
    p = RowAlgebraParams("gspo", low=0.2, high=0.2)
    loss = (-1.2 + s7 - 2 * s3) / 3 + 0.4
    for (out, a, _), backend in _both(Case(lp, None, rows, p)):
        # fp32 inputs: ρ = lp - old carries the rounding of -1.1, -0.8 (a few ulps of 1)
        assert float(out.loss.detach()) == pytest.approx(loss, rel=1e-6), backend
        expected = [s7 / 2 / 3, -2 * s3 / 3, s7 / 2 / 3, -1.0, 0.0]
        assert a.tolist() == pytest.approx(expected, rel=1e-6), backend
        assert stat(out, "flag0") == pytest.approx(1 / 3, rel=EPS), backend  # clipped
        assert stat(out, "flag2") == pytest.approx(1 / 3, rel=EPS), backend  # clipped_high
        assert stat(out, "flag1") == 0.0, backend


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_by_hand():
    """sapo (τ⁺ = 1, τ⁻ = 1.05): ``−σ(τ·(r − 1))·4/τ·A`` over 3 RL rows, token_mean.

    row 0, A = 1,  r = 1.5: σ(0.5) = 0.62246, term −4·0.62246, a = −4·σ(1 − σ)·r/3;
    row 1, A = −2, r = 0.5: σ(−0.525), term +2·4/1.05·σ, a = +8·σ(1 − σ)·0.5/3;
    row 2, A = 0,  r = 1: term 0 and a = 0 (τ⁻ for A ≤ 0, as TRL; no term either way);
    row 3, echo, w = 0.5, lp = −0.7: 0.35, a = −0.5. No flags."""
    lp = torch.tensor([-1.0, -2.0, -0.3, -0.7])
    rows = RowInputs(
        rl=torch.tensor([True, True, True, False]),
        echo=torch.tensor([False, False, False, True]),
        echo_weights=torch.tensor([NAN, NAN, NAN, 0.5]),
        advantages=torch.tensor([1.0, -2.0, 0.0, NAN]),
        old_logprobs=torch.tensor([-1.0 - math.log(1.5), -2.0 - math.log(0.5), -0.3, NAN]),
    )
    p = RowAlgebraParams("sapo", low=None, high=0.0, sapo_temperature_neg=1.05)
    g0, g1 = _sigmoid(0.5), _sigmoid(1.05 * -0.5)
    loss = (-4 * g0 + 2 * 4 / 1.05 * g1) / 3 + 0.35
    expected = [-4 * g0 * (1 - g0) * 1.5 / 3, 8 * g1 * (1 - g1) * 0.5 / 3, 0.0, -0.5]
    for (out, a, _), backend in _both(Case(lp, None, rows, p)):
        # fp32 inputs: old = lp − log r rounds, so r is 1.5 and 0.5 to a few ulps
        assert float(out.loss.detach()) == pytest.approx(loss, rel=1e-6), backend
        assert a.tolist() == pytest.approx(expected, rel=1e-6), backend
        assert a[2] == 0, backend
        assert [stat(out, f"flag{i}") for i in range(4)] == [0.0] * 4, backend


def test_sequence_level_sapo_and_cispo_by_hand():
    """One sequence (id 4) of two RL rows, ρ = 0.1 and 0.3 (s = e^0.2), A = 1 and −1, and
    one sequence (id 2) of one RL row, ρ = −0.1 (s = e^−0.1), A = 2; token_mean over 3.

    sapo_sequence (τ⁺ = 1, τ⁻ = 2): rows 0 and 1 share s = e^0.2 but not τ: terms
    −4σ(0.2214) and +2σ(2·0.2214), and ∂/∂ℓ of both through the mean, −4·(σ⁺(1 − σ⁺)·1 +
    σ⁻(1 − σ⁻)·(−1))·s/2 on each; row 2 −2·σ(e^−0.1 − 1)·4, a = −8σ(1 − σ)·s.
    cispo_sequence (max 1.2): weights min(s, 1.2) = 1.2 (clipped high) on both rows of
    sequence 4 and e^−0.1 on row 2; the weight is detached: a = −w·A/3."""
    lp = torch.tensor([-1.0, -0.5, -2.0, -0.4])
    rows = RowInputs(
        rl=torch.tensor([True, True, True, False]),
        echo=torch.tensor([False, False, False, True]),
        echo_weights=torch.tensor([NAN, NAN, NAN, 1.0]),
        advantages=torch.tensor([1.0, -1.0, 2.0, NAN]),
        old_logprobs=torch.tensor([-1.1, -0.8, -1.9, NAN]),
        sequence_ids=torch.tensor([4, 4, 2, 2]),
    )
    s4, s2 = math.exp(0.2), math.exp(-0.1)
    gp, gn, g2 = _sigmoid(s4 - 1), _sigmoid(2 * (s4 - 1)), _sigmoid(s2 - 1)
    through_mean = -4 * (gp * (1 - gp) - gn * (1 - gn)) * s4 / 2 / 3
    sapo = (
        RowAlgebraParams("sapo_sequence", low=None, high=0.0, sapo_temperature_neg=2.0),
        (-4 * gp + 2 * gn - 8 * g2) / 3 + 0.4,
        [through_mean, through_mean, -8 * g2 * (1 - g2) * s2 / 3, -1.0],
        [0.0, 0.0, 0.0],
    )
    cispo = (
        RowAlgebraParams("cispo_sequence", low=None, high=1.2),
        (-(1.2 * 1 * -1.0) - (1.2 * -1 * -0.5) - (s2 * 2 * -2.0)) / 3 + 0.4,  # −w·A·lp
        [-1.2 / 3, 1.2 / 3, -2 * s2 / 3, -1.0],
        [2 / 3, 0.0, 2 / 3],
    )
    for name, (p, loss, expected, flags) in {"sapo": sapo, "cispo": cispo}.items():
        for (out, a, _), backend in _both(Case(lp, None, rows, p)):
            # fp32 inputs: ρ = lp − old carries the rounding of −1.1, −0.8 (a few ulps of 1)
            assert float(out.loss.detach()) == pytest.approx(loss, rel=1e-6), (name, backend)
            assert a.tolist() == pytest.approx(expected, rel=1e-5), (name, backend)
            got = [stat(out, f"flag{i}") for i in range(3)]
            assert got == pytest.approx(flags, rel=EPS), (name, backend)


def test_sequence_normalizations_by_hand():
    """Per-sequence normalisers on three sequences whose rows are interleaved (ids 9, 4, 9,
    2, 4, 9 ...): reinforce RL rows, echo rows, observation rows counted in ``Z_i``.

    Sequence 9: RL rows 0 (A = 1, lp = -0.5) and 2 (A = 2, lp = -1), echo row 5 (w = 0.5,
    lp = -2), observation row 7: Z = 2. Sequence 4: RL row 1 (A = -1, lp = -0.25), echo row 4
    (w = 1, lp = -1.5): Z = 1. Sequence 2: echo row 3 (w = 2, lp = -3; also an observation
    row, counted once): Z = 1. Row 6 (id 4) and row 7 take no part; row 8 is padding (-1).
    """
    lp = torch.tensor([-0.5, -0.25, -1.0, -3.0, -1.5, -2.0, NAN, NAN, NAN])
    rows = RowInputs(
        rl=torch.tensor([True, True, True, False, False, False, False, False, False]),
        echo=torch.tensor([False, False, False, True, True, True, False, False, False]),
        echo_weights=torch.tensor([NAN, NAN, NAN, 2.0, 1.0, 0.5, NAN, NAN, NAN]),
        advantages=torch.tensor([1.0, -1.0, 2.0, NAN, NAN, NAN, NAN, NAN, NAN]),
        sequence_ids=torch.tensor([9, 4, 9, 2, 4, 9, 4, 9, -1]),
        observation=torch.tensor([False, False, False, True, False, False, False, True, True]),
    )
    # RL per-token loss -A·lp: 0.5 and 2 (sequence 9), -0.25 (sequence 4); 2 RL sequences
    rl_cases = {
        "sequence_mean_token_mean": ((2.5 / 2 - 0.25) / 2, [-1 / 4, 1 / 2, -2 / 4]),
        "sequence_mean_token_sum": ((2.5 - 0.25) / 2, [-1 / 2, 1 / 2, -2 / 2]),
    }
    # echo w·nll / Z: 0.5·2 / 2 (sequence 9), 1·1.5 / 1, 2·3 / 1; 3 echo sequences
    echo_loss = (0.5 + 1.5 + 6.0) / 3
    echo_a = [-2 / 1 / 3, -1 / 1 / 3, -0.5 / 2 / 3]  # rows 3, 4, 5
    for rl_norm, (rl_loss, rl_a) in rl_cases.items():
        p = RowAlgebraParams(
            "reinforce",
            low=None,
            high=0.0,
            rl_normalization=rl_norm,
            echo_normalization="sequence_mean",
        )
        for (out, a, _), backend in _both(Case(lp, None, rows, p)):
            what = (rl_norm, backend)
            assert float(out.loss.detach()) == pytest.approx(rl_loss + echo_loss, rel=4 * EPS)
            assert stat(out, "loss_rl") == pytest.approx(rl_loss, rel=4 * EPS), what
            assert stat(out, "loss_echo") == pytest.approx(echo_loss, rel=4 * EPS), what
            assert a.tolist() == pytest.approx([*rl_a, *echo_a, 0, 0, 0], rel=4 * EPS), what
            assert (stat(out, "rl_sequences"), stat(out, "echo_sequences")) == (2.0, 3.0), what
    # ε added to Z; given sequence counts replace the call's
    p = RowAlgebraParams(
        "reinforce",
        low=None,
        high=0.0,
        rl_normalization="sequence_mean_token_sum",
        rl_divisor=5.0,
        echo_normalization="sequence_mean",
        echo_divisor=8.0,
        echo_z_epsilon=0.5,
    )
    for (out, a, _), backend in _both(Case(lp, None, rows, p)):
        expected = 2.25 / 5 + (1.0 / 2.5 + 1.5 / 1.5 + 6.0 / 1.5) / 8
        assert float(out.loss.detach()) == pytest.approx(expected, rel=4 * EPS), backend
        e = [-2 / 1.5 / 8, -1 / 1.5 / 8, -0.5 / 2.5 / 8]
        assert a.tolist() == pytest.approx([-1 / 5, 1 / 5, -2 / 5, *e, 0, 0, 0], rel=4 * EPS)


def test_sequence_normalizers_need_their_inputs():
    lp = torch.tensor([-0.5])
    rows = RowInputs(rl=torch.tensor([True]), echo=torch.tensor([False]))
    seq = RowAlgebraParams("sft", low=None, high=0.0, rl_normalization="sequence_mean_token_sum")
    with pytest.raises(ValueError, match=r"rows\.sequence_ids"):
        row_algebra_op(lp, None, rows, seq, backend="naive")
    echo = RowAlgebraParams("sft", low=None, high=0.0, echo_normalization="sequence_mean")
    with pytest.raises(ValueError, match=r"rows\.observation"):
        row_algebra_op(lp, None, rows._replace(sequence_ids=torch.tensor([0])), echo)
    with pytest.raises(ValueError, match="rl_normalization"):
        RowAlgebraParams("sft", low=None, high=0.0, rl_normalization="sequence")
    with pytest.raises(ValueError, match="echo_z_epsilon"):
        RowAlgebraParams("sft", low=None, high=0.0, echo_z_epsilon=-1.0)


@pytest.mark.parametrize("layout", ["runs", "scattered", "one"])
def test_sequence_groups_across_blocks(layout):
    """Sequences that cross the program's blocks (``3·BLOCK + 5`` rows), kernel vs gold."""
    n = 3 * BLOCK + 5
    o = dict(_option_sets("ppo_clip")[0])
    o.update(
        n=n,
        sequences=layout,
        rl_divisor="count",
        rl_normalization="sequence_mean_token_mean",
        echo=("sequence_mean", None),
        echo_z_epsilon=1e-3,
    )
    assert_same_as_naive(_make_case("ppo_clip", o, seed=77), layout)


def _per_sequence_case(variant: str, n: int, *, seed: int, **options: Any) -> Case:
    """``n`` rows of ``variant`` in runs of sequences, with both per-sequence normalisers."""
    o = dict(_option_sets(variant)[0])
    o.update(
        n=n,
        sequences="runs",
        rl_divisor="count",
        rl_normalization="sequence_mean_token_mean",
        echo=("sequence_mean", None),
        **options,
    )
    return _make_case(variant, o, seed=seed)


@pytest.mark.parametrize("variant", ["ppo_clip", "gspo"])
def test_sequences_in_order_skip_the_sort(variant, monkeypatch):
    """Ids that never decrease along the rows (runs, padding rows inside their sequence, as the
    ``nn`` modules build them), promised by ``sequences_in_order``: the program reads the rows
    in place of a sorted order, no sort runs, and the result is the gold's (``3·BLOCK + 5``
    rows: sequences cross the blocks)."""
    n = 3 * BLOCK + 5
    case = _per_sequence_case(variant, n, seed=78, echo_z_epsilon=1e-3)
    g = torch.Generator().manual_seed(5)
    ids = torch.repeat_interleave(torch.arange(n), torch.randint(1, 81, (n,), generator=g))[:n]
    case.rows = case.rows._replace(sequence_ids=ids, sequences_in_order=True)
    assert_same_as_naive(case, f"{variant}-in-order")
    sorts = []
    original = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or original(*a, **k))
    _run(case, "triton")
    assert not sorts
    _run(
        Case(case.lp, case.ent, case.rows._replace(sequences_in_order=False), case.params), "triton"
    )
    assert sorts  # without the promise the ids are sorted


@pytest.mark.parametrize("layout", ["expanded", "transposed", "contiguous-2d"])
@pytest.mark.parametrize("variant", ["ppo_clip", "sapo_sequence"])
def test_ids_in_order_are_read_in_place_through_their_strides(variant, layout):
    """In-order ids given as a ``[B, T]`` view (the modules' ``arange(B)`` expanded over ``T``,
    strides ``(1, 0)``; a transposed view, strides ``(1, B)``; a plain ``[B, T]``), and the
    advantages as a ``[B]`` expanded over ``T`` (else a plain ``[B, T]``), are read where they
    lie, with the result of the same values flat: bit for bit (the same rows in the same
    order). With ``[B]`` advantages the padding rows read a finite advantage (the flat
    version NaN there): unread either way. ``B·T = 37·85`` rows, three blocks and a part:
    sequences cross the blocks."""
    b, t = 37, 3 * BLOCK // 37 + 2
    case = _per_sequence_case(variant, b * t, seed=31)
    flat = torch.arange(b).repeat_interleave(t)
    if layout == "expanded":
        ids = torch.arange(b).unsqueeze(1).expand(b, t)
    elif layout == "transposed":
        ids = torch.arange(b).repeat(t).reshape(t, b).t()  # a view: strides (1, b)
    else:
        ids = flat.reshape(b, t)
    assert torch.equal(ids.reshape(-1), flat)
    # the advantages as the modules pass them: one per sequence, expanded over its positions
    per_sequence = torch.randn(b, generator=torch.Generator().manual_seed(2))
    adv_view = per_sequence.unsqueeze(1).expand(b, t)
    adv_flat = torch.where(case.rows.rl, adv_view.reshape(-1), NAN)
    adv_view = adv_view if layout == "expanded" else adv_flat.reshape(b, t)
    flat_rows = case.rows._replace(sequence_ids=flat, sequences_in_order=True, advantages=adv_flat)
    view_rows = case.rows._replace(sequence_ids=ids, sequences_in_order=True, advantages=adv_view)
    expected, a_expected, _ = _run(Case(case.lp, case.ent, flat_rows, case.params), "triton")
    got, a_got, _ = _run(Case(case.lp, case.ent, view_rows, case.params), "triton")
    assert torch.equal(got.stats, expected.stats) and torch.equal(a_got, a_expected)
    assert_same_as_naive(Case(case.lp, case.ent, view_rows, case.params), f"{variant} {layout}")


def test_row_fields_of_the_wrong_size_are_refused():
    case = _make_case("gspo", dict(_option_sets("gspo")[0], n=700), seed=3)
    rows = case.rows._replace(sequence_ids=case.rows.sequence_ids[:-1])
    with pytest.raises(
        ValueError,
        match=r"rows.sequence_ids must be 700 entries, one per row of logprobs, got int64 \[699\]",
    ):
        row_algebra_op(case.lp, case.ent, rows, case.params, backend="triton")


# ---------------------------------------------------------------- fp64 derivatives


def _loss_config(p: RowAlgebraParams) -> LossConfig:
    """The LossConfig whose PyTorch algebra computes ``p`` (rl_divisor: token_sum_constant)."""
    kw: dict[str, Any] = dict(
        adv_tau=p.adv_tau,
        log_ratio_clamp=p.log_ratio_clamp,
        kl_tau=p.kl_tau,
        entropy_coef=p.entropy_coef,
        echo_normalization=p.echo_normalization,
        echo_z_epsilon=p.echo_z_epsilon,
        kl_coef=p.kl_coef,
        kl_estimator=p.kl_estimator,
        mismatch=p.mismatch,
        mismatch_max=p.mismatch_max,
        mismatch_min=p.mismatch_min,
    )
    if p.rl_normalization != "token":
        assert p.rl_divisor is None  # the call's own sequence counts
        kw.update(rl_normalization=p.rl_normalization)
    elif p.rl_divisor is not None:
        kw.update(rl_normalization="token_sum_constant", rl_normalization_constant=p.rl_divisor)
    if p.policy == "sft":
        drop = ("kl_tau", "kl_coef", "mismatch", "mismatch_max", "mismatch_min", "kl_estimator")
        return LossConfig(mode="sft", **{k: v for k, v in kw.items() if k not in drop})
    row = ROW_POLICIES[p.policy]  # its parameters, as its declaration names them
    kw.update({name: value for name, value in zip(row.bounds, p.bounds, strict=True) if name})
    if "dual_clip" in row.reads:
        kw.update(dual_clip=p.dual_clip)
    return LossConfig(policy=p.policy, **kw)


FP64_CASES = {
    "dppo": dict(kl_tau=0.3, entropy_coef=0.05),
    "ppo_clip_dual": dict(kl_tau=0.3),
    "cispo": dict(entropy_coef=0.05, rl_divisor=900.0),
    "cispo_no_low": dict(echo_normalization="sum"),
    "reinforce": dict(echo_normalization="batch_token_mean"),
    "sft": dict(),
    "sapo": dict(kl_tau=0.3, entropy_coef=0.05),
    "sapo_sharp": dict(rl_divisor=900.0),
}
#: The same with per-sequence normalisers (`test_derivatives_against_fp64_autograd_of_the_loss_module`).
FP64_SEQUENCE_CASES = {
    "dppo": dict(
        kl_tau=0.3,
        entropy_coef=0.05,
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
        echo_z_epsilon=1e-3,
    ),
    "ppo_clip_dual": dict(
        rl_normalization="sequence_mean_token_sum", echo_normalization="sequence_mean"
    ),
    "sft": dict(rl_normalization="sequence_mean_token_mean"),
    "sapo_sequence": dict(
        rl_normalization="sequence_mean_token_mean", echo_normalization="sequence_mean"
    ),
    "cispo_sequence": dict(rl_normalization="sequence_mean_token_sum", entropy_coef=0.05),
}
#: The same with a mismatch correction and the reference KL.
FP64_CORRECTION_CASES = {
    "cispo": dict(mismatch="token_truncate", mismatch_min=0.5, kl_coef=0.2, kl_estimator="k3"),
    "ppo_clip": dict(mismatch="token_mask", kl_coef=0.1, kl_estimator="k2"),
    "reinforce": dict(kl_coef=0.3, kl_estimator="k1"),
    "gspo": dict(rl_normalization="sequence_mean_token_mean", kl_tau=0.2),
    "gspo_wide": dict(mismatch="sequence_truncate", mismatch_min=0.5, kl_coef=0.1),
    "sapo_sequence": dict(mismatch="token_truncate", mismatch_min=0.5, kl_tau=0.2),
    "sapo": dict(mismatch="token_mask", kl_coef=0.1, kl_estimator="k3"),
    "cispo_sequence": dict(mismatch="sequence_mask", kl_coef=0.2, kl_estimator="k1"),
}


@pytest.mark.parametrize(
    ("variant", "extra"),
    [(v, FP64_CASES[v]) for v in sorted(FP64_CASES)]
    + [(v, FP64_SEQUENCE_CASES[v]) for v in sorted(FP64_SEQUENCE_CASES)]
    + [(v, FP64_CORRECTION_CASES[v]) for v in sorted(FP64_CORRECTION_CASES)],
    ids=[
        *sorted(FP64_CASES),
        *(f"{v}-sequences" for v in sorted(FP64_SEQUENCE_CASES)),
        *(f"{v}-mismatch-kl" for v in sorted(FP64_CORRECTION_CASES)),
    ],
)
def test_derivatives_against_fp64_autograd_of_the_loss_module(variant, extra):
    """``a`` and ``b`` of both backends vs ``torch.autograd.grad`` of the loss module's PyTorch
    algebra in fp64 (``fuse_loss_algebra("never")``) on the same (fp32-representable) inputs:
    within 16·eps·G_i per row (fp32 rounding of a handful of operations; the fp64 gold is exact
    at this scale). Ratios are kept inside the clip ranges' interiors or clearly outside them, so
    no flag depends on the rounding."""
    n = 700
    o = dict(
        _option_sets(variant)[0],
        n=n,
        far_ratios=False,
        base="old",
        advantages=True,
        echo_weights=True,
        mismatch_metric=False,
        rl_divisor="count",
        rl_normalization="token",
        echo=("token_mean", None),
        sequences="scattered",
    )
    case = _make_case(variant, o, seed=7)
    p = dataclasses.replace(case.params, entropy_metric=False, **extra)
    rows = case.rows
    if variant == "sft":  # mode="sft" has no echo rows
        rows = rows._replace(echo=torch.zeros_like(rows.echo))
    case = Case(case.lp, case.ent if p.entropy_coef else None, rows, p)
    # placeholders the loss module's validation reads: finite values on rows that are not read
    fill = {"lp": -1.0}
    lp64 = torch.where(rows.rl | rows.echo, case.lp, fill["lp"]).double().requires_grad_()
    x = LossInputs(
        rl_mask=rows.rl,
        echo_weights=torch.where(rows.echo, rows.echo_weights, 0.0).double(),
        advantages=torch.where(rows.rl, rows.advantages, 0.0).double(),
        old_logprobs=torch.where(rows.rl, rows.old_logprobs, -1.0).double(),
        sequence_ids=rows.sequence_ids,
        observation_mask=rows.observation,
        inference_logprobs=torch.where(rows.rl, rows.inference_logprobs, -1.0).double()
        if p.mismatch is not None
        else None,
        ref_logprobs=torch.where(rows.rl, rows.ref_logprobs, -1.0).double() if p.kl_coef else None,
    )
    ent64 = None
    if p.entropy_coef:
        ent64 = torch.where(rows.rl, case.ent, 1.0).double().requires_grad_()
    fuse_loss_algebra("never")
    try:
        out64 = echo_loss_from_logprobs(lp64, x, entropy=ent64, config=_loss_config(p))
    finally:
        fuse_loss_algebra("auto")
    grads = torch.autograd.grad(out64.loss, [lp64] + ([ent64] if ent64 is not None else []))
    _, g = bounds(case)
    for backend in ("triton", "naive"):
        out, a, b = _run(case, backend)
        assert float(out.loss.detach()) == pytest.approx(
            float(out64.loss.detach()), abs=sum_tol(n, bounds(case)[0])
        )
        err = (a.double() - grads[0]).abs()
        assert torch.all(err <= 16 * EPS * g), (backend, float((err / g.clamp(min=1e-30)).max()))
        if ent64 is not None:
            assert torch.all((b.double() - grads[1]).abs() <= 2 * EPS * grads[1].abs()), backend


# ---------------------------------------------------------------- non-finite rows


def _small(policy="ppo_clip", n=2500, **kw):
    """A row set over several blocks with finite values (RL rows 0, 3, 6, ...; echo 1, 4, ...)."""
    idx = torch.arange(n)
    rl, echo = idx % 3 == 0, idx % 3 == 1
    g = torch.Generator().manual_seed(3)
    lp = -(torch.rand(n, generator=g) * 3 + 0.01)
    rows = RowInputs(
        rl=rl,
        echo=echo,
        echo_weights=torch.where(echo, 0.5, NAN),
        advantages=torch.where(rl, torch.randn(n, generator=g), NAN),
        old_logprobs=torch.where(rl, lp + 0.1 * torch.randn(n, generator=g), NAN),
        sequence_ids=idx // 37,
    )
    ent = torch.where(rl, torch.rand(n, generator=g), NAN)
    return Case(lp, ent, rows, RowAlgebraParams(policy, **kw))


def _set(t: torch.Tensor, at: dict[int, float]) -> torch.Tensor:
    t = t.clone()
    for i, v in at.items():
        t[i] = v
    return t


def _checks_as_naive(case: Case, expect: dict[str, float]) -> None:
    """The check numbers as the naive backend's (and ``expect``), the loss and echo-NLL
    maximum too (NaN or inf where the naive one is)."""
    fused, _, _ = _run(case, "triton")
    naive, _, _ = _run(case, "naive")
    tol = sum_tol(case.n, bounds(case)[0])
    assert_checks_equal(fused, naive, loss_tol=tol)
    _close(float(fused.loss.detach()), float(naive.loss.detach()), tol, "loss")
    assert _same(stat(fused, "echo_nll_max"), stat(naive, "echo_nll_max"))
    for name, v in expect.items():
        assert _same(check(fused, name), v), (name, check(fused, name), v)


@pytest.mark.parametrize("value", [NAN, math.inf, -math.inf])
def test_non_finite_logprob_on_an_rl_row_and_an_echo_row(value):
    """The first bad row (in the third block) and the count of bad rows; an echo row first."""
    case = _small()
    case.lp = _set(case.lp, {2050: value, 2100: value, 2199: value})  # echo, RL, RL
    assert case.rows.echo[2050] and case.rows.rl[2100] and case.rows.rl[2199]
    _checks_as_naive(
        case,
        {
            "scored_bad": 1,
            "scored_row": 2050,
            "scored_count": 3,
            "scored_value": value,
            "scored_is_rl": 0,
            "loss_bad": 1,
        },
    )
    case.lp = _set(_small().lp, {2100: value})
    # ±inf on an RL row: the log ratio is clamped to ±20, the policy loss stays finite
    _checks_as_naive(
        case,
        {
            "scored_bad": 1,
            "scored_row": 2100,
            "scored_count": 1,
            "scored_is_rl": 1,
            "loss_bad": float(math.isnan(value)),
        },
    )


def test_non_finite_logprob_on_a_padding_row_is_not_read():
    case = _small()
    rows = case.rows._replace(rl=_set(case.rows.rl, {5: False}))  # row 5 (idx%3 == 2) is padding
    case = Case(_set(case.lp, {5: NAN, 2: math.inf}), case.ent, rows, case.params)
    _checks_as_naive(case, {"scored_bad": 0, "loss_bad": 0, "policy_bad": 0})


def test_positive_given_logprob_fails_the_check():
    """logprobs_given: a logprob above the tolerance is a passed NLL (both the first row and
    the count); at the tolerance it passes."""
    case = _small(logprobs_given=True, logprob_tolerance=1e-4)
    case.lp = _set(case.lp, {1201: 0.5, 1500: 1e-4, 2302: 2.0})  # RL 1500: at the tolerance
    _checks_as_naive(
        case,
        {
            "scored_bad": 1,
            "scored_row": 1201,
            "scored_count": 2,
            "scored_value": 0.5,
            "scored_is_rl": 0,
            "loss_bad": 0,
        },
    )
    case.params = dataclasses.replace(case.params, logprobs_given=False)
    _checks_as_naive(case, {"scored_bad": 0})


def test_policy_loss_overflow_without_the_clamp():
    """log_ratio_clamp None and a log ratio of 200 on an RL row with A < 0: r = inf, the policy
    loss is +inf (ppo_clip) on that row; with the clamp the same row is finite."""
    case = _small("ppo_clip", log_ratio_clamp=None)
    row = 1503
    assert case.rows.rl[row]
    adv = _set(case.rows.advantages, {row: -1.0})
    old = _set(case.rows.old_logprobs, {row: float(case.lp[row]) - 200.0})
    case.rows = case.rows._replace(advantages=adv, old_logprobs=old)
    _checks_as_naive(
        case,
        {
            "policy_bad": 1,
            "policy_row": row,
            "policy_value": math.inf,
            "loss_bad": 1,
            "scored_bad": 0,
        },
    )
    case.params = dataclasses.replace(case.params, log_ratio_clamp=20.0)
    _checks_as_naive(case, {"policy_bad": 0, "loss_bad": 0})
    for policy in ("dppo", "cispo", "reinforce"):
        c = _small(policy, log_ratio_clamp=None, low=0.2 if policy != "reinforce" else None)
        c.rows = case.rows
        _checks_as_naive(c, {})


@pytest.mark.parametrize("variant", ["sapo", "sapo_sequence", "ppo_clip", "ppo_clip_dual", "gspo"])
def test_saturated_objectives_past_the_float_range_have_finite_derivatives(variant):
    """log_ratio_clamp None and log ratios of ±100 and ±1e4 (r = e^ρ leaves fp32) where the
    objective is flat: a saturated sapo gate, a clip past its bound, a dual clip's floor. The
    loss is finite, and so is every derivative: 0 (or a denormal) on those rows, where the
    program's ``-dobj·r`` and ``σ(1 - σ)·r`` gave ``0·inf = NaN`` before; the program as its gold
    within 16 eps of each row's derivative."""
    kw = {k: v for k, v in VARIANTS[variant].items() if k != "policy"}
    case = _small(VARIANTS[variant]["policy"], n=700, log_ratio_clamp=None, **kw)
    rl, lp = case.rows.rl, case.lp.clone()
    adv, old = case.rows.advantages.clone(), case.rows.old_logprobs.clone()
    sequence_level = variant in ("sapo_sequence", "gspo")
    if sequence_level:  # sequence 0 (rows 0-36): mean ρ ≈ 1e4/13; sequence 1: ≈ -1e4/12
        adv[:37] = torch.where(rl[:37], adv[:37].abs() + 0.1, NAN)
        extreme = {3: 1e4, 39: -1e4}
    else:  # A < 0 with r → inf is -inf for a clip without the dual floor: A > 0 there
        neg = -1.0 if variant != "ppo_clip" else 1.0
        extreme = {3: 100.0, 6: 1e4, 9: -100.0, 12: -1e4, 15: 100.0}
        for row, a in {3: 1.0, 6: neg, 9: -1.0, 12: 1.0, 15: neg}.items():
            adv[row] = a
    for row, rho in extreme.items():
        assert rl[row]
        lp[row] = -0.5 + min(rho, 0.0)
        old[row] = -0.5 - max(rho, 0.0)
    case.lp = lp
    case.rows = case.rows._replace(advantages=adv, old_logprobs=old)
    (fused, a_f, _), (naive, a_n, _) = (_run(case, b) for b in ("triton", "naive"))
    for out, a, backend in ((fused, a_f, "triton"), (naive, a_n, "naive")):
        assert math.isfinite(float(out.loss)), backend
        assert torch.isfinite(a).all(), (backend, a[~torch.isfinite(a)][:5])
    assert (a_f - a_n).abs().max() <= 16 * EPS * a_n.abs().max()
    for row in extreme:  # flat (or e^-99 small) there: 0 or below the float range
        assert a_f[row].abs() < 1e-30 and a_n[row].abs() < 1e-30, (row, a_f[row], a_n[row])


def test_entropy_nan_with_entropy_coef():
    case = _small("dppo", entropy_coef=0.01)
    case.ent = _set(case.ent, {1800: NAN, 2400: math.inf, 1801: NAN})  # RL, RL; 1801 echo: unread
    _checks_as_naive(
        case, {"entropy_bad": 1, "entropy_row": 1800, "entropy_value": NAN, "loss_bad": 1}
    )
    case.params = dataclasses.replace(case.params, entropy_coef=0.0, entropy_metric=True)
    _checks_as_naive(case, {"entropy_bad": 0})  # not trained: not checked


def test_loss_overflow_from_huge_advantages():
    """Advantages of 3e38 on two RL rows: each row's loss is finite, their sum is not."""
    case = _small("reinforce", low=None, high=0.0)
    adv = _set(case.rows.advantages, {0: 3e38, 3: 3e38})
    case.lp = _set(case.lp, {0: -2.0, 3: -2.0})
    case.rows = case.rows._replace(advantages=adv)
    _checks_as_naive(case, {"policy_bad": 1, "loss_bad": 1, "loss": math.inf, "loss_rl": math.inf})
    # each row's loss 2.1e38 is finite, their sum 4.2e38 is not (fp32 max 3.4e38)
    case.lp = _set(case.lp, {0: -0.7, 3: -0.7})
    _checks_as_naive(case, {"policy_bad": 0, "loss_bad": 1, "loss": math.inf})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_nan_logprob_makes_the_loss_nan_without_checks(variant):
    """check_finite off: a NaN logprob on an RL row makes the loss NaN (the clamps and the
    min/max of the policies keep NaN, as torch's), and on an echo row the echo-NLL maximum NaN;
    never a finite value computed past the NaN."""
    for row in (1500, 2050):  # RL, echo
        case = _small(**VARIANTS[variant], check_finite=False, kl_tau=0.0)
        case.lp = _set(case.lp, {row: NAN})
        for backend in ("triton", "naive"):
            out, _, _ = _run(case, backend)
            assert math.isnan(float(out.loss.detach())), (backend, row)
            assert math.isnan(stat(out, "echo_nll_max")) == (row == 2050), (backend, row)


def test_check_finite_off_writes_zero_checks():
    case = _small(check_finite=False)
    case.lp = _set(case.lp, {0: NAN})
    for backend in ("triton", "naive"):
        out, _, _ = _run(case, backend)
        assert out.checks.tolist() == [0.0] * len(CHECK_SLOTS), backend


# ---------------------------------------------------------------- extreme inputs


def _nan_rows(n: int, rl, echo) -> RowInputs:
    """Every per-row input NaN wherever it is not read."""
    g = torch.Generator().manual_seed(5)
    return RowInputs(
        rl=rl,
        echo=echo,
        echo_weights=torch.where(echo, torch.rand(n, generator=g) + 0.1, NAN),
        advantages=torch.where(rl, torch.randn(n, generator=g), NAN),
        old_logprobs=torch.where(rl, -torch.rand(n, generator=g), NAN),
        inference_logprobs=torch.where(rl, -torch.rand(n, generator=g), NAN),
        sequence_ids=torch.arange(n) // 37,
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_participating_rows_gives_exact_zeros(variant):
    """Every row is padding (NaN in every field): loss exactly 0, gradients exactly 0, every stat
    0, every check clear, for every policy with every term switched on."""
    n = 2500
    none = torch.zeros(n, dtype=torch.bool)
    rows = _nan_rows(n, none, none)
    extra = {} if variant == "sft" else dict(kl_tau=0.3, entropy_coef=0.05, mismatch_metric=True)
    p = RowAlgebraParams(**VARIANTS[variant], entropy_metric=True, **extra)
    lp = torch.full((n,), NAN)
    ent = torch.full((n,), NAN)
    for backend in ("triton", "naive"):
        out, a, b = _run(Case(lp, ent, rows, p), backend)
        assert float(out.loss.detach()) == 0.0, backend
        assert torch.equal(a, torch.zeros(n)), backend
        if b is not None:
            assert torch.equal(b, torch.zeros(n)), backend
        assert out.stats.tolist() == [0.0] * len(STAT_SLOTS), backend
        assert out.checks.tolist() == [0.0] * len(CHECK_SLOTS), backend


@pytest.mark.parametrize("variant", ["dppo", "ppo_clip_dual", "cispo", "reinforce"])
def test_zero_advantages_everywhere(variant):
    """A = 0 on every RL row: the policy term and its gradient are exactly 0 on RL rows; echo
    rows keep -w/N_echo."""
    n = 2500
    idx = torch.arange(n)
    rl, echo = idx % 2 == 0, idx % 4 == 1
    rows = _nan_rows(n, rl, echo)
    rows = rows._replace(advantages=torch.where(rl, 0.0, NAN))
    lp = torch.where(rl | echo, -torch.rand(n, generator=torch.Generator().manual_seed(1)), NAN)
    p = RowAlgebraParams(**VARIANTS[variant])
    for backend in ("triton", "naive"):
        out, a, _ = _run(Case(lp, None, rows, p), backend)
        assert torch.all(a[rl] == 0), backend
        assert stat(out, "loss_rl") == 0.0, backend
        n_echo = int(echo.sum())
        torch.testing.assert_close(a[echo], -rows.echo_weights[echo] / n_echo, rtol=EPS, atol=0)


@pytest.mark.parametrize("which", ["no_rl", "no_echo"])
def test_only_one_kind_of_rows(which):
    """No RL rows: loss_rl exactly 0 (the divisor max(0, 1) = 1), echo unchanged; no echo rows:
    loss_echo exactly 0, the echo metrics 0; compared with naive on every slot."""
    n = 2500
    idx = torch.arange(n)
    rl = (idx % 3 == 0) if which == "no_echo" else torch.zeros(n, dtype=torch.bool)
    echo = (idx % 3 == 1) if which == "no_rl" else torch.zeros(n, dtype=torch.bool)
    rows = _nan_rows(n, rl, echo)
    lp = torch.where(rl | echo, -torch.rand(n, generator=torch.Generator().manual_seed(2)), NAN)
    ent = torch.where(rl, torch.rand(n), NAN)
    p = RowAlgebraParams(
        "ppo_clip", kl_tau=0.1, entropy_coef=0.02, entropy_metric=True, mismatch_metric=True
    )
    case = Case(lp, ent, rows, p)
    assert_same_as_naive(case, which)
    out, _, b = _run(case, "triton")
    zero = "loss_rl" if which == "no_rl" else "loss_echo"
    assert stat(out, zero) == 0.0
    if which == "no_echo":
        assert stat(out, "echo_nll_mean") == stat(out, "echo_nll_max") == 0.0
    else:
        assert torch.equal(b, torch.zeros(n))


def test_nan_placeholders_never_leak():
    """NaN in every per-row input on the rows where it is not read, vs the same call with 0
    placeholders: identical loss, gradients, stats and checks (bit for bit, both backends)."""
    n = 2500
    idx = torch.arange(n)
    rl, echo = idx % 3 == 0, idx % 3 == 1
    g = torch.Generator().manual_seed(9)
    vals = {k: torch.randn(n, generator=g) for k in ("w", "adv", "old", "lq", "ent", "lp")}
    p = RowAlgebraParams(
        "ppo_clip",
        dual_clip=3.0,
        kl_tau=0.2,
        entropy_coef=0.03,
        entropy_metric=True,
        mismatch_metric=True,
    )

    def build(fill):
        lp = torch.where(rl | echo, -vals["lp"].abs(), fill)
        rows = RowInputs(
            rl=rl,
            echo=echo,
            echo_weights=torch.where(echo, vals["w"].abs(), fill),
            advantages=torch.where(rl, vals["adv"], fill),
            old_logprobs=torch.where(rl, -vals["old"].abs(), fill),
            inference_logprobs=torch.where(rl, -vals["lq"].abs(), fill),
        )
        return Case(lp, torch.where(rl, vals["ent"].abs(), fill), rows, p)

    for backend in ("triton", "naive"):
        ref, a0, b0 = _run(build(0.0), backend)
        for fill in (NAN, math.inf, -math.inf):
            out, a, b = _run(build(fill), backend)
            assert torch.equal(out.loss, ref.loss), (backend, fill)
            assert torch.equal(a, a0) and torch.equal(b, b0), (backend, fill)
            assert torch.equal(out.stats, ref.stats), (backend, fill)
            assert torch.equal(out.checks, ref.checks), (backend, fill)


def test_one_row():
    """N = 1 (one partial block), as RL, echo and padding row, every policy."""
    for variant in VARIANTS:
        for kind in range(3):
            o = dict(_option_sets(variant)[0], n=1)
            assert_same_as_naive(_make_case(variant, o, seed=kind), f"{variant} kind {kind}")


# ---------------------------------------------------------------- field failure modes


def test_echo_rows_get_minus_w_over_n_echo_whatever_their_ratio():
    """An echo row is never caught by the trust region or the clip: with a log ratio of ±50
    against its (placeholder) old logprob, a NaN inference logprob and a NaN advantage it still
    gets exactly -w/N_echo, for every policy."""
    n = 2500
    idx = torch.arange(n)
    rl, echo = idx % 2 == 0, idx % 2 == 1
    g = torch.Generator().manual_seed(4)
    lp = -torch.rand(n, generator=g) - 0.01
    w = torch.where(echo, torch.rand(n, generator=g) + 0.5, NAN)
    rows = RowInputs(
        rl=rl,
        echo=echo,
        echo_weights=w,
        advantages=torch.where(rl, torch.randn(n, generator=g), NAN),
        old_logprobs=torch.where(rl, lp, lp + torch.where(idx % 4 == 1, 50.0, -50.0)),
        inference_logprobs=torch.where(rl, lp - 0.1, NAN),
        sequence_ids=idx // 37,  # gspo's sequences: echo rows among their RL rows
    )
    n_echo = int(echo.sum())
    for variant in VARIANTS:
        p = RowAlgebraParams(**VARIANTS[variant])
        for backend in ("triton", "naive"):
            _, a, _ = _run(Case(lp, None, rows, p), backend)
            torch.testing.assert_close(a[echo], -w[echo] / n_echo, rtol=EPS, atol=0)


def test_padding_rows_do_not_dilute_the_denominators():
    """Adding 3000 padding rows (NaN everywhere) changes nothing: the RL and echo divisors count
    participating rows only."""
    case = _small("dppo", n=900, kl_tau=0.1)
    pad = 3000
    grow = {
        f: None
        if getattr(case.rows, f) is None
        else torch.cat(
            [
                getattr(case.rows, f),
                torch.full((pad,), NAN)
                if getattr(case.rows, f).is_floating_point()
                else torch.zeros(pad, dtype=torch.bool),
            ]
        )
        for f in ("rl", "echo", "echo_weights", "advantages", "old_logprobs")
    }
    big = Case(torch.cat([case.lp, torch.full((pad,), NAN)]), None, RowInputs(**grow), case.params)
    small = Case(case.lp, None, case.rows, case.params)
    for backend in ("triton", "naive"):
        o1, a1, _ = _run(small, backend)
        o2, a2, _ = _run(big, backend)
        assert float(o2.loss.detach()) == pytest.approx(float(o1.loss.detach()), rel=1e-6), backend
        assert torch.equal(a2[:900], a1) and torch.all(a2[900:] == 0), backend
        assert stat(o2, "rl_tokens") == stat(o1, "rl_tokens") == 300


def test_row_zero_not_participating_gets_exactly_zero():
    """Token 0 is never supervised by accident: row 0 padding (NaN lp, NaN fields) has a = 0 and
    does not move the loss; it is not reported by the checks either."""
    case = _small("ppo_clip", n=2500, kl_tau=0.2, entropy_coef=0.01)
    rows = case.rows._replace(rl=_set(case.rows.rl, {0: False}))
    ent = _set(case.ent, {0: NAN})
    lp = _set(case.lp, {0: NAN})
    c = Case(lp, ent, rows, case.params)
    assert_same_as_naive(c, "row 0 padding")
    for backend in ("triton", "naive"):
        out, a, b = _run(c, backend)
        assert a[0] == 0 and b[0] == 0, backend
        assert check(out, "scored_bad") == 0 and check(out, "loss_bad") == 0


# ---------------------------------------------------------------- contract


def test_sft_rejects_policy_terms():
    """``policy="sft"`` (the NLL of the RL rows) has no ratio, penalty, bonus or mismatch metric:
    setting one of them is an error naming it, not a term silently dropped (the Triton program
    would otherwise leave ``b`` unwritten)."""
    for kw in (dict(kl_tau=0.1), dict(entropy_coef=0.01), dict(mismatch_metric=True)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            RowAlgebraParams("sft", **kw)


def test_every_policy_of_the_op_has_a_variant():
    """The variants are test data (each policy's parameters); the policies are the op's table:
    a policy declared without a variant would run in none of the tests above."""
    assert {kw["policy"] for kw in VARIANTS.values()} == set(POLICIES)


def test_flag_names_cover_the_flag_slots():
    assert set(FLAG_NAMES) == set(POLICIES)
    for variant, kw in VARIANTS.items():
        names = RowAlgebraParams(**kw).flag_names
        assert len(names) <= sum(s.startswith("flag") for s in STAT_SLOTS), variant
    assert RowAlgebraParams("ppo_clip", dual_clip=2.0).flag_names[-1] == "dual_clipped"


# ---------------------------------------------------------------- labels' range


@pytest.mark.parametrize("check_finite", [True, False])
def test_label_range_check_as_naive(check_finite):
    """``RowInputs.labels`` with ``vocab_size``: the first participating row whose label is
    outside ``[0, V)`` and that label (in the third block, after an out-of-range label on a
    padding row, which is not read); checked whatever ``check_finite`` says."""
    case = _small(check_finite=check_finite)
    v = 50
    labels = torch.randint(0, v, (case.n,), generator=torch.Generator().manual_seed(6))
    idx = torch.arange(case.n)
    labels = torch.where(idx % 3 == 2, -100, labels)  # padding rows: -100, never read
    # row 2300 is padding (not read), 2301 and 2499 are RL rows
    labels = _set(labels, {2300: v, 2301: -1, 2499: v + 7})
    rows = case.rows._replace(labels=labels, vocab_size=v)
    first = 2301
    outs = {b: _run(Case(case.lp, None, rows, case.params), b)[0] for b in ("triton", "naive")}
    for name in ("label_bad", "label_row", "label_value"):
        assert check(outs["triton"], name) == check(outs["naive"], name), name
    assert check(outs["triton"], "label_bad") == 1
    assert check(outs["triton"], "label_row") == first
    assert check(outs["triton"], "label_value") == float(labels[first])
    # every label in range (padding rows still -100): the check passes
    ok = torch.where(idx % 3 == 2, -100, torch.zeros(case.n, dtype=torch.long))
    out, _, _ = _run(Case(case.lp, None, rows._replace(labels=ok), case.params), "triton")
    assert check(out, "label_bad") == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_per_row_fields_in_other_dtypes(dtype):
    """Advantages, echo weights, old and inference logprobs and the device divisor in another
    float dtype: both backends read them as fp32 (the same rounded values)."""
    o = _option_sets("ppo_clip_dual")[0] | {
        "n": 2500,
        "base": "old",
        "mismatch_metric": True,
        "advantages": True,
        "echo_weights": True,
        "rl_divisor": "device",
        "rl_normalization": "token",
        "kl": ("k3", 0.1),
    }
    case = _make_case("ppo_clip_dual", o, seed=11)
    fields = (
        "echo_weights",
        "advantages",
        "old_logprobs",
        "inference_logprobs",
        "ref_logprobs",
        "rl_divisor",
    )
    case.rows = case.rows._replace(**{f: getattr(case.rows, f).to(dtype) for f in fields})
    assert_same_as_naive(case, str(dtype))


@settings(max_examples=12, deadline=None)
@given(
    variant=st.sampled_from(sorted(VARIANTS)),
    n=st.sampled_from([2, 3, BLOCK - 1, BLOCK + 1, 2 * BLOCK + 3]),
    seed=st.integers(0, 2**16),
    options=st.fixed_dictionaries(
        {name: st.sampled_from(values) for name, values in OPTIONS.items()}
    ),
    adv_scale=st.sampled_from([1e-3, 1.0, 1e3]),
    shift_scale=st.sampled_from([0.0, 0.1, 3.0]),
)
def test_fused_equals_naive_property(variant, n, seed, options, adv_scale, shift_scale):
    """Any option set, row count, advantage scale and ratio spread (0: every ratio exactly 1)."""
    o = _consistent(variant, dict(options, n=n, adv_scale=adv_scale, shift_scale=shift_scale))
    assert_same_as_naive(_make_case(variant, o, seed), f"{variant} {o}")


@pytest.mark.parametrize("variant", ["ppo_clip_dual", "sft"])
def test_zero_rows(variant):
    """N = 0 (an empty micro-batch): loss 0, empty gradient, every stat and check 0."""
    empty = torch.zeros(0)
    rows = RowInputs(
        torch.zeros(0, dtype=torch.bool),
        torch.zeros(0, dtype=torch.bool),
        echo_weights=empty,
        advantages=empty,
        old_logprobs=empty,
        inference_logprobs=empty,
    )
    extra = {} if variant == "sft" else dict(entropy_coef=0.1, mismatch_metric=True)
    p = RowAlgebraParams(**VARIANTS[variant], entropy_metric=True, **extra)
    for backend in ("triton", "naive"):
        out, a, _ = _run(Case(empty, empty, rows, p), backend)
        assert float(out.loss) == 0.0 and a.shape == (0,), backend
        assert out.stats.tolist() == [0.0] * len(STAT_SLOTS), backend
        assert out.checks.tolist() == [0.0] * len(CHECK_SLOTS), backend


@pytest.mark.parametrize("n", [2500, 700])
@pytest.mark.parametrize("sequences", [False, True], ids=["token", "per-sequence"])
def test_per_env_metrics_fused_equal_naive(n, sequences):
    """``env_of_row``/``num_envs``: program e + 1 writes env e's metrics (the main program
    still writes everything over all rows); against the gold, slot by slot: counts, fractions
    and maxima exactly, sums within `sum_tol`, the loss slots of an env row 0; an env with no
    row (env 3) all 0; rows of env -1 only in "all"."""
    g = torch.Generator().manual_seed(7)
    rl = torch.rand(n, generator=g) < 0.5
    echo = ~rl & (torch.rand(n, generator=g) < 0.6)
    env = torch.randint(-1, 3, (n,), generator=g)  # envs 0..2 and none; env 3 empty
    rows = RowInputs(
        rl=rl.to(DEVICE),
        echo=echo.to(DEVICE),
        echo_weights=torch.where(echo, 0.5, 0.0).to(DEVICE),
        advantages=torch.randn(n, generator=g).to(DEVICE),
        inference_logprobs=(-3 * torch.rand(n, generator=g) - 0.01).to(DEVICE),
        env_of_row=env.to(DEVICE),
        num_envs=4,
        sequence_ids=(torch.arange(n) // 30).to(DEVICE),
        observation=(torch.rand(n, generator=g) < 0.3).to(DEVICE),
    )
    lp = (-3 * torch.rand(n, generator=g) - 0.01).to(DEVICE)
    ent = (2 * torch.rand(n, generator=g)).to(DEVICE)
    norms = {}
    if sequences:  # the env programs read the sequence counts too; the main one writes them
        norms = dict(
            rl_normalization="sequence_mean_token_mean", echo_normalization="sequence_mean"
        )
    params = RowAlgebraParams(
        "ppo_clip",
        low=0.2,
        high=0.2,
        dual_clip=3.0,
        entropy_metric=True,
        mismatch_metric=True,
        **norms,
    )
    fused = row_algebra_op(lp.clone().requires_grad_(), ent, rows, params, backend="triton")
    gold = row_algebra_op(lp.clone().requires_grad_(), ent, rows, params, backend="naive")
    assert fused.env_stats.shape == gold.env_stats.shape == (4, len(STAT_SLOTS))
    exact = {"rl_tokens", "echo_tokens", "echo_nll_max", "flag0", "flag1", "flag2", "flag3"}
    for e in range(4):
        for i, name in enumerate(STAT_SLOTS):
            f, r = float(fused.env_stats[e, i]), float(gold.env_stats[e, i])
            if name in ("loss", "loss_rl", "loss_echo"):
                assert f == r == 0.0, (e, name)
            elif name in exact:
                assert f == r, (e, name, f, r)
            else:  # means of non-negative terms: their own magnitude bounds the sum's rounding
                assert abs(f - r) <= sum_tol(n, abs(r)), (e, name, f, r)
    assert fused.env_stats[3].abs().sum() == 0
    assert float(fused.stats[STAT_SLOTS.index("rl_tokens")]) == float(rl.sum())
    for name in ("rl_sequences", "echo_sequences"):
        i = STAT_SLOTS.index(name)
        assert float(fused.stats[i]) == float(gold.stats[i]) == (n // 30 + (n % 30 > 0)) * sequences
    host_rows = RowInputs(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in rows))
    s_bound, _ = bounds(Case(lp.cpu(), ent.cpu(), host_rows, params))
    assert abs(float(fused.loss.detach()) - float(gold.loss.detach())) <= sum_tol(n, s_bound)
    assert float(fused.env_stats[:3, STAT_SLOTS.index("rl_tokens")].sum()) == float(
        (rl & (env >= 0)).sum()
    )


# ---------------------------------------------------------------- the sequence program


@settings(max_examples=15, deadline=None)
@given(
    n=st.sampled_from([1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 7]),
    num_ids=st.sampled_from([1, 2, 5, 300]),
    negative=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sequence_program_against_python(n, num_ids, negative, seed):
    """`_sequence_groups` (the sort and the sequence program) against plain Python over the
    same rows: every row's sequence counts (RL rows, ``Z_i``) exactly, the two sequence totals
    exactly, and the four per-sequence sums within fp32 rounding of their terms (a scan in
    another order: ``(terms + log2 BLOCK)·eps·Σ|terms|``). Ids repeat at random positions (a
    sequence's rows scattered over the blocks), negative ids only on rows that take no part."""
    from echoloss.ops.row_algebra import fused

    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    rl, echo = u < 0.4, (u >= 0.4) & (u < 0.7)
    ids = torch.randint(0, num_ids, (n,), generator=g) * 13 - (5 if negative else 0)
    ids = torch.where((rl | echo) & (ids < 0), -ids, ids)  # participating rows: ids ≥ 0
    obs = torch.rand(n, generator=g) < 0.3
    lp = -torch.rand(n, generator=g) * 3
    old = lp - torch.randn(n, generator=g) * 0.2
    lq = lp - torch.randn(n, generator=g) * 0.2
    adv = torch.randn(n, generator=g)
    rows = RowInputs(
        rl=rl, echo=echo, advantages=adv, old_logprobs=old, inference_logprobs=lq,
        sequence_ids=ids, observation=obs,
    )  # fmt: skip
    p = RowAlgebraParams("gspo", low=0.2, high=0.2, adv_tau=0.5, mismatch="token_truncate")
    dev = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in rows]
    group, cnt_rl, cnt_z, seqs, sums = fused._sequence_groups(
        lp.to(DEVICE), RowInputs(*dev), p, base=1
    )
    group, cnt_rl, cnt_z, seqs, sums = (t.cpu() for t in (group, cnt_rl, cnt_z, seqs, sums))
    # Python: per id, its RL rows, Z, echo rows and the four sums in fp64
    by_id: dict[int, list[int]] = {}
    for i, sid in enumerate(ids.tolist()):
        by_id.setdefault(sid, []).append(i)
    w = torch.exp((old - lq).double()).clamp(max=3.0)
    for members in by_id.values():
        idx = torch.tensor(members)
        m_rl = rl[idx]
        want = [int(m_rl.sum()), int((echo[idx] | obs[idx]).sum())]
        for i in members:  # every row of the sequence reads the same slot
            assert [int(cnt_rl[group[i]]), int(cnt_z[group[i]])] == want, (i, members)
        a = adv[idx].double() * 0.5
        terms = [
            torch.where(m_rl, lp[idx].double() - old[idx].double(), 0.0),
            torch.where(m_rl & (a > 0), w[idx] * a, 0.0),
            torch.where(m_rl & (a < 0), w[idx] * a, 0.0),
            torch.where(m_rl, old[idx].double() - lq[idx].double(), 0.0),
        ]
        slot = int(group[members[0]])
        for k, t in enumerate(terms):
            tol = (len(members) + 10 + 8) * EPS * float(t.abs().sum())
            assert abs(float(sums[k, slot]) - float(t.sum())) <= tol, (k, members)
    assert int(seqs[0]) == sum(bool(rl[torch.tensor(m)].any()) for m in by_id.values())
    assert int(seqs[1]) == sum(bool(echo[torch.tensor(m)].any()) for m in by_id.values())
