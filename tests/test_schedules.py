"""λ schedules: exact values by hand, the ramp ends, and errors that name the argument."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from echoloss.schedules import echo_alpha


def test_constant_warmup_and_decay_by_hand():
    assert [echo_alpha(s, alpha=0.02) for s in (0, 5, 10_000)] == [0.02, 0.02, 0.02]
    # warmup over 4 steps: alpha * (s + 1) / 4, then alpha
    assert [echo_alpha(s, alpha=0.4, schedule="warmup", steps=4) for s in range(6)] == [
        0.1,
        0.2,
        0.30000000000000004,  # 0.4 * 3 / 4 in binary floating point
        0.4,
        0.4,
        0.4,
    ]
    # decay over 2 steps from 0.3 to 0.1: 0.3, 0.2, 0.1, then 0.1
    got = [echo_alpha(s, alpha=0.3, schedule="decay", steps=2, final_alpha=0.1) for s in range(4)]
    assert got == pytest.approx([0.3, 0.2, 0.1, 0.1], abs=1e-15)  # two roundings at most
    assert echo_alpha(7, alpha=0.3, schedule="decay", steps=2) == 0.0  # to 0 by default


@given(
    st.integers(0, 500),
    st.floats(0, 1),
    st.integers(1, 100),
    st.floats(0, 1),
    st.sampled_from(["constant", "warmup", "decay"]),
)
def test_stays_between_its_end_points(step, alpha, steps, final, schedule):
    # a setting the schedule does not read is an error (tests/train/test_config_hardening.py)
    steps = 0 if schedule == "constant" else steps
    final = final if schedule == "decay" else 0.0
    a = echo_alpha(step, alpha=alpha, schedule=schedule, steps=steps, final_alpha=final)
    lo, hi = (0.0, alpha) if schedule == "warmup" else (min(alpha, final), max(alpha, final))
    if schedule == "constant":
        lo = hi = alpha
    assert lo - 1e-12 <= a <= hi + 1e-12  # one rounding of a product of values <= 1
    if step >= steps and schedule != "constant":
        assert a == pytest.approx(alpha if schedule == "warmup" else final, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step": -1, "alpha": 0.1}, "step must be >= 0, got -1"),
        ({"step": 0, "alpha": -0.1}, "alpha must be finite and >= 0, got -0.1"),
        ({"step": 0, "alpha": math.nan}, "alpha must be finite"),
        ({"step": 0, "alpha": 0.1, "schedule": "decay", "steps": 2, "final_alpha": math.inf},
         "final_alpha must be finite"),
        ({"step": 0, "alpha": 0.1, "schedule": "cosine", "steps": 2}, "schedule must be one of"),
        ({"step": 0, "alpha": 0.1, "schedule": "decay"}, "steps must be >= 1 for schedule='decay'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        echo_alpha(**kwargs)
