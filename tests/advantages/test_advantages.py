"""Tests for echoloss.advantages: hand-computed values, framework parity, properties, bad input."""

from __future__ import annotations

import io
import json
import math
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import (
    MAX_GROUP,
    any_finite_rewards,
    dyadic_rewards,
    group_rewards,
    rae_keys,
    reward_values,
)

import echoloss.advantages.registry as registry_module
from echoloss.advantages import (
    RAE,
    broadcast_advantages,
    broadcast_packed_advantages,
    compute_advantages,
    dr_grpo,
    grpo,
    length_shaped_rewards,
    list_advantage_fns,
    max_rl,
    register_advantage_fn,
    reinforce,
    resolve_advantage_fn,
    rloo,
    with_length_shaping,
)

STD_SCALES = ["group", "trl", "verl", "openrlhf"]
FRAMEWORK_EPS = {"group": 1e-6, "trl": 1e-4, "verl": 1e-6, "openrlhf": 1e-9}
MEAN_CENTRED = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce": reinforce,
}
ALL_GROUP_FNS = {
    **MEAN_CENTRED,
    **{f"grpo_{s}": (lambda r, s=s: grpo(r, scale=s)) for s in STD_SCALES},
    "max_rl": max_rl,
}


def _ulp_budget(rewards: list[float]) -> float:
    # Summing n deviations, each rounded once, plus the rounded mean: a few ulps of the largest.
    return 8 * len(rewards) * max(1.0, max(abs(r) for r in rewards)) * 2.0**-52


# Hand-computed values (exact equality: every expression below rounds the same way as the code)


def test_grpo_mean_centred_hand_values():
    # mean(1, 0, 0, 1) = 0.5 → 1 - 0.5, 0 - 0.5
    assert grpo([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    # mean(3, 1, 2) = 2
    assert grpo([3.0, 1.0, 2.0]) == [1.0, -1.0, 0.0]
    assert dr_grpo([3.0, 1.0, 2.0]) == [1.0, -1.0, 0.0]


def test_grpo_group_std_hand_values():
    # [0, 2, 4]: mean 2, deviations (-2, 0, 2), Bessel var (4 + 0 + 4) / 2 = 4, std 2
    assert grpo([0.0, 2.0, 4.0], scale="group", eps=0.0) == [-1.0, 0.0, 1.0]
    # population std: [0, 0, 2, 2] → deviations ±1, var 4 / 4 = 1
    assert grpo([0.0, 0.0, 2.0, 2.0], scale="group", eps=0.0, bessel=False) == [
        -1.0,
        -1.0,
        1.0,
        1.0,
    ]
    # default eps of "group" is verl's 1e-6: ±2 / (2 + 1e-6)
    assert grpo([0.0, 2.0, 4.0], scale="group") == [-2 / (2 + 1e-6), 0.0, 2 / (2 + 1e-6)]
    # explicit eps: ±2 / (2 + 0.5) = ±0.8
    assert grpo([0.0, 2.0, 4.0], scale="group", eps=0.5) == [-0.8, 0.0, 0.8]


@pytest.mark.parametrize(
    ("scale", "eps"),
    [("trl", 1e-4), ("verl", 1e-6), ("openrlhf", 1e-9)],
    ids=["trl", "verl", "openrlhf"],
)
def test_framework_constants_hand_values(scale, eps):
    # [0, 2, 4]: Bessel std exactly 2, so A = ±2 / (2 + eps) with each framework's eps
    assert grpo([0.0, 2.0, 4.0], scale=scale) == [-2 / (2 + eps), 0.0, 2 / (2 + eps)]
    # [1, 0, 0, 1]: mean 0.5, Bessel var (4 · 0.25) / 3 = 1/3, A = ±0.5 / (sqrt(1/3) + eps)
    a = 0.5 / (math.sqrt(1 / 3) + eps)
    assert grpo([1.0, 0.0, 0.0, 1.0], scale=scale) == [a, -a, -a, a]


def test_framework_parity_values_differ_only_by_eps():
    # The three frameworks agree on Bessel and disagree on eps: 2/(2+1e-4) vs 2/(2+1e-6) vs 2/(2+1e-9)
    trl, verl, openrlhf = (grpo([0.0, 2.0, 4.0], scale=s)[2] for s in ("trl", "verl", "openrlhf"))
    assert trl == 0.9999500024998749
    assert verl == 0.99999950000025
    assert openrlhf == 0.9999999995


def _torch_reference(rewards: list[float], eps: float, unbiased: bool = True) -> list[float]:
    # The frameworks' own formula, written in torch float64: (r - mean) / (torch.std + eps).
    r = torch.tensor(rewards, dtype=torch.float64)
    std = r.std(correction=1 if unbiased else 0)
    return ((r - r.mean()) / (std + eps)).tolist()


def _parity_tolerance(rewards: list[float]) -> float:
    # torch's float64 mean is off by ~n ulps of the largest reward; divided by the spread, that
    # is how far the float formula itself can be from the exact answer.
    spread = max(rewards) - min(rewards)
    return 1e-12 + 64 * len(rewards) * max(abs(r) for r in rewards) * 2.0**-52 / spread


@pytest.mark.parametrize("scale", ["trl", "verl", "openrlhf"])
@given(rewards=st.lists(reward_values, min_size=2, max_size=MAX_GROUP))
def test_framework_parity_against_torch_formula(scale, rewards):
    assume(max(rewards) != min(rewards))
    expected = _torch_reference(rewards, FRAMEWORK_EPS[scale])
    got = grpo(rewards, scale=scale)
    assert got == pytest.approx(expected, rel=1e-12, abs=_parity_tolerance(rewards))


@given(rewards=st.lists(reward_values, min_size=2, max_size=MAX_GROUP), bessel=st.booleans())
def test_group_std_parity_against_torch_formula(rewards, bessel):
    assume(max(rewards) != min(rewards))
    expected = _torch_reference(rewards, 1e-3, unbiased=bessel)
    assert grpo(rewards, scale="group", eps=1e-3, bessel=bessel) == pytest.approx(
        expected, rel=1e-10, abs=1e-12
    )


def test_verl_singleton_deviation_is_documented_choice():
    # verl gives a singleton mean 0 and std 1, i.e. R / (1 + 1e-6); echoloss gives 0 (no baseline).
    assert grpo([0.7], scale="verl") == [0.0]


def test_rloo_hand_values():
    # 3 - (1+2)/2 = 1.5, 1 - (3+2)/2 = -1.5, 2 - (3+1)/2 = 0
    assert rloo([3.0, 1.0, 2.0]) == [1.5, -1.5, 0.0]
    # [1, 0, 0, 1]: 1 - (0+0+1)/3 = 2/3 and 0 - (1+0+1)/3 = -2/3, each rounded once, so the
    # result is symmetric (float `1 - 1/3` rounds twice and gives 0.6666666666666667)
    assert rloo([1.0, 0.0, 0.0, 1.0]) == [2 / 3, -2 / 3, -2 / 3, 2 / 3]
    # two rollouts: each minus the other
    assert rloo([5.0, 2.0]) == [3.0, -3.0]


@given(rewards=st.lists(reward_values, min_size=2, max_size=MAX_GROUP))
def test_rloo_equals_verl_and_openrlhf_forms(rewards):
    n = len(rewards)
    mean = math.fsum(rewards) / n
    verl_form = [r * n / (n - 1) - mean * n / (n - 1) for r in rewards]  # verl rloo
    openrlhf_form = [r - (math.fsum(rewards) - r) / (n - 1) for r in rewards]  # OpenRLHF rloo
    tol = 1e-9 * max(1.0, max(abs(r) for r in rewards))
    assert rloo(rewards) == pytest.approx(verl_form, abs=tol)
    assert rloo(rewards) == pytest.approx(openrlhf_form, abs=tol)


def test_max_rl_hand_values():
    # mean 1/4: (1 - 1/4) / (1/4) = 3, (0 - 1/4) / (1/4) = -1
    assert max_rl([1.0, 0.0, 0.0, 0.0]) == [3.0, -1.0, -1.0, -1.0]
    # mean 1/2: (1 - 1/2) / (1/2) = 1
    assert max_rl([1.0, 1.0, 0.0, 0.0]) == [1.0, 1.0, -1.0, -1.0]
    # mean 2: (3 - 2) / 2 = 0.5, (1 - 2) / 2 = -0.5
    assert max_rl([3.0, 1.0]) == [0.5, -0.5]
    assert max_rl([0.0, 0.0, 0.0]) == [0.0, 0.0, 0.0]  # mean 0: no signal (prime-rl)


def test_reinforce_hand_values():
    assert reinforce([1.0, 0.0, 0.5]) == [0.5, -0.5, 0.0]  # batch mean 0.5
    assert reinforce([1.0, 0.0], baseline=0.25) == [0.75, -0.25]
    assert reinforce([2.0], baseline=0.5) == [1.5]  # external baseline: a singleton keeps R - b
    assert reinforce([2.0, -1.0], baseline=0.0) == [2.0, -1.0]  # plain REINFORCE


@pytest.mark.parametrize("name", sorted(ALL_GROUP_FNS))
def test_singleton_and_constant_groups(name):
    fn = ALL_GROUP_FNS[name]
    assert fn([0.37]) == [0.0]
    # 0.1 · 3 does not divide back to 0.1 exactly; the rule still gives exact zeros.
    assert fn([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert fn([7.0] * 5) == [0.0] * 5


def test_near_duplicate_rewards_keep_their_exact_deviations():
    # [x, x+u, x+u] with u one ulp of 1e6: the exact mean is x + 2u/3; a float mean rounds to
    # x + u and would give deviations (-u, 0, 0). Exact deviations (-2u/3, u/3, u/3) give
    # Bessel std u/sqrt(3), so the std-scaled advantages are (-2/sqrt(3), 1/sqrt(3), 1/sqrt(3)).
    x = 1e6
    u = math.ulp(x)
    got = grpo([x, x + u, x + u], scale="group", eps=0.0)
    assert got == pytest.approx([-2 / math.sqrt(3), 1 / math.sqrt(3), 1 / math.sqrt(3)], rel=1e-15)
    assert sum(got) == pytest.approx(0.0, abs=1e-15)


def test_constant_group_has_no_rounding_residue():
    # A naive (r - mean) leaves ±1e-17 here; divided by a tiny std it would become ±1e-13 or worse.
    naive_mean = math.fsum([0.1] * 3) / 3
    assert 0.1 - naive_mean != 0.0
    assert grpo([0.1] * 3, scale="openrlhf") == [0.0, 0.0, 0.0]


# Properties


@pytest.mark.parametrize("name", sorted(MEAN_CENTRED))
@given(rewards=group_rewards)
def test_mean_centred_sum_to_zero(name, rewards):
    advantages = MEAN_CENTRED[name](rewards)
    assert abs(math.fsum(advantages)) <= _ulp_budget(rewards) * (2 if name == "rloo" else 1)


@pytest.mark.parametrize("scale", STD_SCALES)
@given(rewards=group_rewards)
def test_std_scaled_sum_to_zero(scale, rewards):
    assert abs(math.fsum(grpo(rewards, scale=scale))) <= 1e-9


@pytest.mark.parametrize("name", sorted(set(ALL_GROUP_FNS) - {"max_rl"}))
@given(rewards=dyadic_rewards, shift=st.integers(-1000, 1000))
def test_invariant_to_adding_a_constant(name, rewards, shift):
    fn = ALL_GROUP_FNS[name]
    shifted = fn([r + shift for r in rewards])
    assert shifted == pytest.approx(fn(rewards), abs=1e-9)


@pytest.mark.parametrize("bessel", [True, False])
@given(rewards=group_rewards, exponent=st.integers(-60, 60))
def test_std_scaled_exactly_invariant_to_power_of_two_scaling(bessel, rewards, exponent):
    factor = 2.0**exponent
    scaled = [r * factor for r in rewards]
    assume(all(s / factor == r for s, r in zip(scaled, rewards, strict=True)))  # no underflow
    assert grpo(scaled, scale="group", eps=0.0, bessel=bessel) == grpo(
        rewards, scale="group", eps=0.0, bessel=bessel
    )


@given(rewards=group_rewards, factor=st.floats(1e-3, 1e3))
def test_std_scaled_invariant_to_positive_scaling(rewards, factor):
    scaled = [r * factor for r in rewards]
    assume(max(scaled) != min(scaled) or max(rewards) == min(rewards))
    assert grpo(scaled, scale="group", eps=0.0) == pytest.approx(
        grpo(rewards, scale="group", eps=0.0), rel=1e-6, abs=1e-6
    )


@given(
    rewards=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=MAX_GROUP),
    factor=st.floats(1e-3, 1e3),
)
def test_max_rl_invariant_to_positive_scaling(rewards, factor):
    scaled = [r * factor for r in rewards]
    assume(max(scaled) != min(scaled) or max(rewards) == min(rewards))
    assert max_rl(scaled) == pytest.approx(max_rl(rewards), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("name", sorted(ALL_GROUP_FNS))
@given(data=st.data())
def test_permutation_equivariance_is_exact(name, data):
    fn = ALL_GROUP_FNS[name]
    strategy = (
        st.lists(st.floats(0.0, 1e6), min_size=1, max_size=MAX_GROUP)
        if name == "max_rl"
        else group_rewards
    )
    rewards = data.draw(strategy)
    order = data.draw(st.permutations(range(len(rewards))))
    # Every sum is exactly rounded (fsum), so the result does not depend on the order at all.
    assert fn([rewards[i] for i in order]) == [fn(rewards)[i] for i in order]


@pytest.mark.parametrize("name", sorted(ALL_GROUP_FNS))
@given(rewards=any_finite_rewards)
def test_no_nan_or_inf_for_any_finite_input(name, rewards):
    if name == "max_rl":
        rewards = [abs(r) for r in rewards]
    fn = ALL_GROUP_FNS[name]
    try:
        advantages = fn(rewards)
    except ValueError as err:
        # Only a mean-centred result can be too large for float64 (rewards near ±1.8e308).
        assert name in MEAN_CENTRED
        assert "overflow" in str(err)
        assert max(abs(r) for r in rewards) > 1e307
        return
    assert len(advantages) == len(rewards)
    assert all(math.isfinite(a) for a in advantages)
    if len(rewards) == 1 or max(rewards) == min(rewards):
        assert advantages == [0.0] * len(rewards)


@given(rewards=any_finite_rewards)
def test_std_scaled_is_bounded(rewards):
    # |deviation| / Bessel std <= (n - 1) / sqrt(n); eps only shrinks it.
    n = len(rewards)
    bound = (n - 1) / math.sqrt(n) + 1e-9 if n > 1 else 0.0
    assert all(abs(a) <= bound for a in grpo(rewards, scale="trl"))


# Length shaping


def test_length_shaping_hand_values():
    # correct = {0, 1} (reward 1 = max); mean correct cost (50 + 150) / 2 = 100
    # bonus_0 = 1 - 50/100 = 0.5 → 1 · 1.5; bonus_1 = 1 - 150/100 → clamped to 0; incorrect untouched
    assert length_shaped_rewards([1.0, 1.0, 0.0], [50.0, 150.0, 10.0]) == [1.5, 1.0, 0.0]
    # a free correct rollout is doubled: bonus 1 - 0/50 = 1 (mean cost (0 + 100) / 2 = 50)
    assert length_shaped_rewards([2.0, 2.0], [0.0, 100.0]) == [4.0, 2.0]
    # partial credit: only rewards equal to the max are "correct"
    assert length_shaped_rewards([0.5, 1.0, 0.5], [1.0, 4.0, 1.0]) == [0.5, 1.0, 0.5]


def test_length_shaping_gates():
    assert length_shaped_rewards([0.0, 0.0], [1.0, 9.0]) == [0.0, 0.0]  # max reward <= 0
    assert length_shaped_rewards([-1.0, -2.0], [1.0, 9.0]) == [-1.0, -2.0]
    assert length_shaped_rewards([1.0, 1.0], [0.0, 0.0]) == [1.0, 1.0]  # mean correct cost 0
    assert length_shaped_rewards([3.0], [5.0]) == [3.0]  # singleton: bonus 1 - 5/5 = 0


def test_length_shaping_wrapper_and_driver():
    # shaped [1.5, 1.0, 0, 0], mean 0.625 → [0.875, 0.375, -0.625, -0.625]
    expected = [0.875, 0.375, -0.625, -0.625]
    assert (
        with_length_shaping("grpo")([1.0, 1.0, 0.0, 0.0], costs=[50.0, 150.0, 10.0, 10.0])
        == expected
    )
    got = compute_advantages(
        [1.0, 1.0, 0.0, 9.0, 0.0],
        ["a", "a", "a", "b", "a"],
        errored=[False, False, False, True, False],
        length_costs=[50.0, 150.0, 10.0, 1.0, 10.0],
    )
    assert got == [0.875, 0.375, -0.625, None, -0.625]


def test_length_shaping_bad_input():
    with pytest.raises(ValueError, match="costs has length 1, expected 2"):
        length_shaped_rewards([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match=r"costs\[1\] = -3.0 is negative"):
        length_shaped_rewards([1.0, 0.0], [1.0, -3.0])
    with pytest.raises(ValueError, match=r"costs\[0\] must be a finite real number, got float nan"):
        length_shaped_rewards([1.0, 0.0], [float("nan"), 1.0])


# RAE


def test_rae_score_then_update_hand_values():
    rae = RAE(decay=0.5)
    # b = 0 → A = 1 - 0 = 1; b ← 0.5·0 + 0.5·1 = 0.5
    assert rae.advantage("p0", 1.0) == 1.0
    # A = 0 - 0.5 = -0.5; b ← 0.5·0.5 + 0.5·0 = 0.25
    assert rae.advantage("p0", 0.0) == -0.5
    assert rae.baseline("p0") == 0.25
    # another key has its own baseline, starting at 0
    assert rae.advantage("p1", -2.0) == -2.0
    assert rae.baseline("p1") == -1.0
    assert rae.baseline("never seen") == 0.0


def test_rae_update_then_score_hand_values():
    rae = RAE(decay=0.5, order="update_then_score")
    # b ← 0.5·0 + 0.5·1 = 0.5, then A = 1 - 0.5 = 0.5 (= decay · (R - b_old))
    assert rae.advantage("p0", 1.0) == 0.5
    # b ← 0.5·0.5 + 0.5·0 = 0.25, then A = 0 - 0.25
    assert rae.advantage("p0", 0.0) == -0.25


def test_rae_default_decay_matches_spiral():
    rae = RAE()
    assert rae.decay == 0.95 and rae.order == "score_then_update"
    assert rae.advantage(("kuhn", 0), 1.0) == 1.0
    assert rae.baseline(("kuhn", 0)) == 0.95 * 0.0 + (1 - 0.95) * 1.0


def test_rae_decay_zero_tracks_last_reward():
    rae = RAE(decay=0.0)
    assert [rae.advantage("k", r) for r in (1.0, 3.0, 2.0)] == [1.0, 2.0, -1.0]


def test_rae_batch_skips_errored():
    rae = RAE(decay=0.5)
    got = rae.advantages(["a", "a", "a"], [1.0, float("nan"), 1.0], errored=[False, True, False])
    assert got == [1.0, None, 0.5]
    assert rae.baseline("a") == 0.75


def test_rae_state_dict_json_round_trip_with_tuple_and_int_keys():
    rae = RAE(decay=0.9)
    keys = [("env", 0), ("env", 1), 7, "solo", ("nested", (1, None)), None, 2.5, True]
    for i, key in enumerate(keys):
        rae.advantage(key, 0.1 * (i + 1))
    state = json.loads(json.dumps(rae.state_dict()))
    restored = RAE.from_state_dict(state)
    assert restored.state_dict() == rae.state_dict()
    for key in keys:
        assert restored.baseline(key) == rae.baseline(key)


def test_rae_state_dict_torch_save_weights_only():
    rae = RAE(decay=0.95, order="update_then_score")
    rae.advantage(("env", "p0"), 0.3)
    buffer = io.BytesIO()
    torch.save(rae.state_dict(), buffer)
    buffer.seek(0)
    restored = RAE.from_state_dict(torch.load(buffer, weights_only=True))
    assert restored.baseline(("env", "p0")) == rae.baseline(("env", "p0"))


@given(
    steps=st.lists(st.tuples(rae_keys, reward_values), min_size=1, max_size=30),
    split=st.integers(0, 30),
    decay=st.sampled_from([0.0, 0.5, 0.9, 0.95, 0.999]),
    order=st.sampled_from(["score_then_update", "update_then_score"]),
)
def test_rae_resume_is_bit_identical(steps, split, decay, order):
    split = min(split, len(steps))
    uninterrupted = RAE(decay=decay, order=order)
    expected = [uninterrupted.advantage(k, r) for k, r in steps]

    first = RAE(decay=decay, order=order)
    got = [first.advantage(k, r) for k, r in steps[:split]]
    resumed = RAE.from_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [resumed.advantage(k, r) for k, r in steps[split:]]

    assert got == expected  # exact: floats survive JSON bit-for-bit
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_rae_bad_input():
    for decay in (1.0, -0.1, float("nan"), 1.5):
        with pytest.raises(ValueError, match="decay"):
            RAE(decay=decay)
    with pytest.raises(TypeError, match="decay"):
        RAE(decay=True)
    with pytest.raises(ValueError, match="order must be"):
        RAE(order="update")
    rae = RAE(decay=0.5)
    with pytest.raises(ValueError, match=r"reward must be a finite real number, got float nan"):
        rae.advantage("k", float("nan"))
    with pytest.raises(TypeError, match="key must be hashable, got list"):
        rae.advantage(["list", "key"], 1.0)
    with pytest.raises(ValueError, match=r"decay=0\.9"):
        rae.load_state_dict(RAE(decay=0.9).state_dict())
    with pytest.raises(ValueError, match="missing"):
        rae.load_state_dict({"decay": 0.5})
    bad = rae.state_dict() | {"baselines": [["k", float("inf")]]}
    with pytest.raises(
        ValueError, match=r"baselines\[0\] value must be a finite real number, got float inf"
    ):
        rae.load_state_dict(bad)
    with pytest.raises(ValueError, match="repeats key"):
        rae.load_state_dict(rae.state_dict() | {"baselines": [["k", 1.0], ["k", 2.0]]})


def test_rae_failed_batch_leaves_state_unchanged():
    rae = RAE(decay=0.5)
    rae.advantage("k", 1.0)
    before = rae.state_dict()
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        rae.advantages(["k", "k"], [1.0, float("inf")])
    with pytest.raises(ValueError, match="overflow"):
        rae.advantages(["j", "j"], [1.7e308, -1.7e308])
    assert rae.state_dict() == before


# The driver


def test_driver_groups_partial_groups_and_errors():
    rewards = [1.0, 0.0, None, 3.0, 1.0, 5.0]
    group_ids = ["g0", "g0", "g0", "g1", "g1", "g2"]
    errored = [False, False, True, False, False, True]
    # g0 survivors [1, 0] → ±0.5; g1 [3, 1] → ±1; g2 has no survivors → None
    assert compute_advantages(rewards, group_ids, errored=errored) == [
        0.5,
        -0.5,
        None,
        1.0,
        -1.0,
        None,
    ]
    # dropping whole groups on any failure: only g1 remains
    assert compute_advantages(rewards, group_ids, errored=errored, drop_group_on_error=True) == [
        None,
        None,
        None,
        1.0,
        -1.0,
        None,
    ]


def test_driver_singleton_survivor_gets_zero():
    assert compute_advantages([1.0, 0.0], [0, 0], errored=[False, True]) == [0.0, None]


def test_driver_two_in_flight_groups_of_one_example_stay_separate():
    # Same (env, example_id) twice in flight: grouping by it would merge them (prime-rl 31e71f918).
    example = ("math", 17)
    rewards = [1.0, 0.0, 1.0, 1.0]
    merged = compute_advantages(rewards, [example] * 4)
    separate = compute_advantages(rewards, [(example, "uuid-a")] * 2 + [(example, "uuid-b")] * 2)
    assert merged == [0.25, -0.75, 0.25, 0.25]
    assert separate == [0.5, -0.5, 0.0, 0.0]


def test_driver_batch_group_reinforce():
    # group_ids=None → one batch-wide group: REINFORCE with the survivors' batch-mean baseline
    got = compute_advantages(
        [1.0, 0.0, 9.0, 0.5], None, fn="reinforce", errored=[False, False, True, False]
    )
    assert got == [0.5, -0.5, None, 0.0]


def test_driver_fn_by_name_kwargs_path_and_callable():
    rewards, ids = [0.0, 2.0, 4.0, 3.0, 1.0, 2.0], [0, 0, 0, 1, 1, 1]
    trl = compute_advantages(rewards, ids, fn="grpo", fn_kwargs={"scale": "trl"})
    assert trl == grpo([0.0, 2.0, 4.0], scale="trl") + grpo([3.0, 1.0, 2.0], scale="trl")
    expected = rloo([0.0, 2.0, 4.0]) + rloo([3.0, 1.0, 2.0])
    assert compute_advantages(rewards, ids, fn="rloo") == expected
    assert compute_advantages(rewards, ids, fn="echoloss.advantages:rloo") == expected
    assert compute_advantages(rewards, ids, fn="echoloss.advantages.rloo") == expected
    assert compute_advantages(rewards, ids, fn=rloo) == expected
    assert compute_advantages(rewards, ids, fn="max_rl")[:3] == max_rl([0.0, 2.0, 4.0])


@given(
    data=st.data(),
    name=st.sampled_from(["grpo", "rloo", "dr_grpo", "reinforce"]),
)
def test_driver_equals_per_group_calls_on_survivors(data, name):
    n = data.draw(st.integers(1, 24))
    rewards = data.draw(st.lists(reward_values, min_size=n, max_size=n))
    group_ids = data.draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    errored = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    got = compute_advantages(rewards, group_ids, fn=name, errored=errored)
    fn = resolve_advantage_fn(name)
    for gid in set(group_ids):
        survivors = [i for i in range(n) if group_ids[i] == gid and not errored[i]]
        if survivors:
            assert [got[i] for i in survivors] == fn([rewards[i] for i in survivors])
    assert all((got[i] is None) == errored[i] for i in range(n))


def test_driver_accepts_numpy_and_tensor_inputs_and_outputs():
    rewards = np.array([1.0, 0.0, 0.5])
    assert compute_advantages(rewards, np.array([3, 3, 3])) == [0.5, -0.5, 0.0]
    assert compute_advantages(torch.tensor([1.0, 0.0]), [0, 0]) == [0.5, -0.5]

    def tensor_fn(group):
        return torch.tensor(group, dtype=torch.float64) * 2

    assert compute_advantages([1.0, 0.5], [0, 0], fn=tensor_fn) == [2.0, 1.0]


def test_driver_bad_rewards_name_index_and_value():
    with pytest.raises(
        ValueError, match=r"rewards\[2\] must be a finite real number, got float nan.*errored="
    ):
        compute_advantages([1.0, 0.0, float("nan")], [0, 0, 0])
    with pytest.raises(
        ValueError, match=r"rewards\[0\] must be a finite real number, got float inf"
    ):
        compute_advantages([float("inf")], [0])
    with pytest.raises(TypeError, match=r"rewards\[1\] must be a real number, got None"):
        compute_advantages([1.0, None], [0, 0])
    with pytest.raises(TypeError, match=r"rewards\[0\] must be a real number, got bool True"):
        compute_advantages([True, 0.0], [0, 0])


def test_driver_names_the_group_when_an_estimator_rejects_it():
    with pytest.raises(
        ValueError, match=r"failed on group 'b' \(rollouts \[1, 3\].*rewards\[1\] = -2.0"
    ):
        compute_advantages([1.0, 1.0, 0.0, -2.0], ["a", "b", "a", "b"], fn="max_rl")
    with pytest.raises(ValueError, match=r"failed on group 0 .*costs\[0\] = -1.0 is negative"):
        compute_advantages([1.0, 0.0], [0, 0], length_costs=[-1.0, 1.0])
    with pytest.raises(ValueError, match=r"failed on group 0 .*scale must be one of"):
        compute_advantages([1.0, 0.0], [0, 0], fn_kwargs={"scale": "std"})


def test_driver_bad_shapes_and_flags():
    with pytest.raises(ValueError, match="group_ids has length 2, expected 3"):
        compute_advantages([1.0, 0.0, 1.0], [0, 0])
    with pytest.raises(
        ValueError, match=r"errored must be of length 2 \(one per rollout\), got length 1"
    ):
        compute_advantages([1.0, 0.0], [0, 0], errored=[True])
    with pytest.raises(TypeError, match=r"errored\[1\] must be a bool, got int"):
        compute_advantages([1.0, 0.0], [0, 0], errored=[False, 1])
    with pytest.raises(TypeError, match=r"group_ids\[0\] must be hashable, got list"):
        compute_advantages([1.0], [["a"]])
    with pytest.raises(ValueError, match="length_costs has length 1, expected 2"):
        compute_advantages([1.0, 0.0], [0, 0], length_costs=[1.0])
    with pytest.raises(TypeError, match="fn_kwargs must be a dict"):
        compute_advantages([1.0], [0], fn_kwargs=[("scale", "trl")])


def _returns_nan(rewards):
    return [float("nan")] * len(rewards)


def _returns_strings(rewards):
    return ["0.5"] * len(rewards)


def _returns_scalar(rewards):
    return 0.5


def test_driver_validates_custom_fn_output_naming_the_group():
    def short_for_g1(rewards):
        return rewards[:-1] if rewards == [1.0, 0.5] else list(rewards)

    with pytest.raises(
        ValueError, match=r"on group 'g1' \(rollouts \[2, 3\]\) returned 1 values for 2 rewards"
    ):
        compute_advantages([1.0, 0.0, 1.0, 0.5], ["g0", "g0", "g1", "g1"], fn=short_for_g1)
    with pytest.raises(ValueError, match=r"returned nan at position 0 \(rollout 0\)"):
        compute_advantages([1.0, 0.0], [0, 0], fn=_returns_nan)
    with pytest.raises(TypeError, match=r"returned str '0\.5' at position 0"):
        compute_advantages([1.0, 0.0], [0, 0], fn=_returns_strings)
    with pytest.raises(TypeError, match="returned float; it must return a list of 2 floats"):
        compute_advantages([1.0, 0.0], [0, 0], fn=_returns_scalar)


# Registry


def test_registry_lists_builtins():
    assert {"grpo", "dr_grpo", "rloo", "max_rl", "reinforce"} <= set(list_advantage_fns())


@pytest.fixture
def isolated_registry():
    with registry_module._REGISTRY.isolated():
        yield


def test_register_and_resolve_custom_fn(isolated_registry):
    @register_advantage_fn("test_sign")
    def sign(rewards, *, scale=1.0):
        return [scale * ((r > 0) - (r < 0)) for r in rewards]

    assert compute_advantages(
        [2.0, -3.0, 0.0], [0, 0, 0], fn="test_sign", fn_kwargs={"scale": 2.0}
    ) == [
        2.0,
        -2.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_fn("test_sign")(lambda r: r)
    register_advantage_fn("test_sign", overwrite=True)(lambda r: [0.0] * len(r))
    assert compute_advantages([2.0], [0], fn="test_sign") == [0.0]


def test_resolve_from_an_import_path_in_a_user_module(monkeypatch):
    module = types.ModuleType("user_advantages_mod")
    module.centre = lambda rewards, *, offset=0.0: [r - offset for r in rewards]
    monkeypatch.setitem(sys.modules, "user_advantages_mod", module)
    fn = resolve_advantage_fn("user_advantages_mod:centre", offset=1.0)
    assert fn([3.0, 1.0]) == [2.0, 0.0]


def test_registry_bad_input():
    with pytest.raises(ValueError, match=r"unknown advantage fn 'grop'.*grpo"):
        resolve_advantage_fn("grop")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg_xyz'"):
        resolve_advantage_fn("no_such_pkg_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve_advantage_fn("echoloss.advantages:nope")
    with pytest.raises(TypeError, match="non-callable"):
        resolve_advantage_fn("echoloss.advantages:__all__")
    with pytest.raises(TypeError, match="does not accept"):
        resolve_advantage_fn("rloo", scale="trl")
    with pytest.raises(ValueError, match=r"without ':' or '\.'"):
        register_advantage_fn("pkg.mod")
    with pytest.raises(TypeError, match="a name, an import path or a callable"):
        resolve_advantage_fn(3)


# Bad input to the estimators


def test_grpo_bad_options():
    with pytest.raises(ValueError, match="scale must be one of"):
        grpo([1.0, 0.0], scale="std")
    with pytest.raises(ValueError, match="eps/bessel have no effect"):
        grpo([1.0, 0.0], eps=1e-4)
    with pytest.raises(ValueError, match=r"fixes eps and bessel.*eps=0.0001"):
        grpo([1.0, 0.0], scale="trl", eps=1e-6)
    with pytest.raises(ValueError, match="eps must be >= 0, got float -"):
        grpo([1.0, 0.0], scale="group", eps=-1.0)
    with pytest.raises(TypeError, match="bessel must be a bool"):
        grpo([1.0, 0.0], scale="group", bessel=1)


@pytest.mark.parametrize("name", sorted(ALL_GROUP_FNS))
def test_estimators_reject_bad_rewards(name):
    fn = ALL_GROUP_FNS[name]
    with pytest.raises(
        ValueError, match=r"rewards\[1\] must be a finite real number, got float nan"
    ):
        fn([1.0, float("nan")])
    with pytest.raises(
        ValueError, match=r"rewards\[0\] must be a finite real number, got float -inf"
    ):
        fn([float("-inf")])
    with pytest.raises(ValueError, match="rewards must be non-empty, got an empty sequence"):
        fn([])
    with pytest.raises(TypeError, match="rewards must be a sequence"):
        fn("10")


def test_max_rl_rejects_negative_rewards():
    with pytest.raises(ValueError, match=r"rewards\[1\] = -1.0 is negative.*use grpo/rloo"):
        max_rl([1.0, -1.0])


def test_mean_centred_overflow_is_an_error_not_inf():
    with pytest.raises(ValueError, match="overflow float64"):
        grpo([1.7e308, 1.7e308, -1.7e308])
    # the std-scaled result is bounded, so it is still computed
    assert all(math.isfinite(a) for a in grpo([1.7e308, 1.7e308, -1.7e308], scale="verl"))


# Broadcast to tokens


def test_broadcast_hand_values():
    mask = torch.tensor([[False, True, True], [True, False, False], [False, False, False]])
    got = broadcast_advantages([0.5, -1.0, None], mask)
    expected = torch.tensor([[0.0, 0.5, 0.5], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)
    from_tensor = broadcast_advantages(torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64), mask)
    assert torch.equal(from_tensor, expected)


def test_broadcast_bad_input():
    mask = torch.tensor([[True, False], [True, True]])
    with pytest.raises(ValueError, match=r"advantages\[1\] is None.*selects 2 tokens"):
        broadcast_advantages([1.0, None], mask)
    with pytest.raises(TypeError, match="bool tensor"):
        broadcast_advantages([1.0, 2.0], mask.long())
    with pytest.raises(ValueError, match="must be 2-D"):
        broadcast_advantages([1.0, 2.0], mask[0])
    with pytest.raises(ValueError, match="length 3, expected 2"):
        broadcast_advantages([1.0, 2.0, 3.0], mask)
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        broadcast_advantages(torch.zeros(3), mask)
    with pytest.raises(TypeError, match="floating tensor"):
        broadcast_advantages(torch.zeros(2, dtype=torch.int64), mask)
    with pytest.raises(
        ValueError, match=r"advantages\[0\] must be a finite real number, got float nan"
    ):
        broadcast_advantages([float("nan"), 0.0], mask)
    with pytest.raises(ValueError, match=r"advantages\[1\] is not finite in float32"):
        broadcast_advantages([0.0, 1e39], mask)
    with pytest.raises(ValueError, match=r"advantages\[0\] is not finite"):
        broadcast_advantages(torch.tensor([float("inf"), 0.0]), mask)


def test_broadcast_packed_hand_values():
    # sequences: [0, 2) adv 2.0, [2, 2) empty adv None, [2, 5) adv -0.5
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    mask = torch.tensor([True, False, False, True, True])
    got = broadcast_packed_advantages([2.0, None, -0.5], cu, mask)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.tensor([2.0, 0.0, 0.0, -0.5, -0.5]))


def test_broadcast_packed_bad_input():
    mask = torch.tensor([True, True, False])
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"advantages\[1\] is None.*span 1:3 has 1 RL tokens"):
        broadcast_packed_advantages([1.0, None], cu, mask)
    with pytest.raises(TypeError, match="int32"):
        broadcast_packed_advantages([1.0, 1.0], cu.float(), mask)
    with pytest.raises(ValueError, match="end at L = 3"):
        broadcast_packed_advantages([1.0, 1.0], torch.tensor([0, 1, 4], dtype=torch.int32), mask)
    with pytest.raises(ValueError, match="start at 0"):
        broadcast_packed_advantages([1.0, 1.0], torch.tensor([1, 2, 3], dtype=torch.int32), mask)
    with pytest.raises(ValueError, match="non-decreasing"):
        broadcast_packed_advantages([1.0, 1.0], torch.tensor([0, 4, 3], dtype=torch.int32), mask)
    with pytest.raises(ValueError, match="length 1, expected 2"):
        broadcast_packed_advantages([1.0], cu, mask)
    with pytest.raises(ValueError, match="must be 1-D"):
        broadcast_packed_advantages([1.0, 1.0], cu, mask[None])


@given(data=st.data())
def test_packed_and_padded_broadcast_agree(data):
    lengths = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=6))
    advantages = data.draw(
        st.lists(
            st.floats(-10, 10).map(lambda x: float(np.float32(x))),
            min_size=len(lengths),
            max_size=len(lengths),
        )
    )
    T = max(lengths)
    padded_mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    packed_mask = []
    for s, length in enumerate(lengths):
        row = data.draw(st.lists(st.booleans(), min_size=length, max_size=length))
        padded_mask[s, :length] = torch.tensor(row, dtype=torch.bool)
        packed_mask += row
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    packed = broadcast_packed_advantages(
        advantages, cu, torch.tensor(packed_mask, dtype=torch.bool)
    )
    padded = broadcast_advantages(advantages, padded_mask)
    unpadded = torch.cat([padded[s, :length] for s, length in enumerate(lengths)])
    assert torch.equal(packed, unpadded)


def test_nan_group_id_is_an_error():
    # NaN != NaN, so NaN group ids would silently give singleton groups (advantage 0).
    with pytest.raises(ValueError, match=r"group_ids\[1\] must be a key equal to itself, got NaN"):
        compute_advantages([1.0, 0.0], ["a", float("nan")])
    with pytest.raises(ValueError, match=r"keys\[0\] must be a key equal to itself, got NaN"):
        RAE().advantages([float("nan")], [1.0])
