"""The one-line console summary of a step (`echoloss.train.metrics.summary_line`): what moves."""

from __future__ import annotations

import math

from echoloss.train.metrics import summary_line


def test_an_rl_step_shows_reward_kl_and_each_terms_gradient_not_the_surrogate():
    row = {"step": 95, "phase": "rl", "reward": 0.40625, "reward_std": 0.491,
           "advantage_abs": 0.25, "mismatch_kl": 2.5e-4, "loss/ref_kl/all": 0.0125,
           "loss_rl": 1.5e-8, "loss_echo": 0.04125, "entropy": 0.5125, "grad_norm": 1.115,
           "pg_grad_norm": 0.515, "echo_grad_norm": 0.9875, "step_time": 1.525}  # fmt: skip
    assert summary_line(row, 140) == (
        "step   95/140 rl      reward 0.406±0.491  |adv| 0.250  kl 2.50e-04  ref_kl 1.25e-02  "
        "echo 0.0413  ent 0.512  |g| 1.11 (rl 0.52, echo 0.99)  1.52s"
    )


def test_without_the_probe_or_echo_only_the_total_norm_and_no_nan():
    row = {"step": 3, "phase": "rl", "reward": 0.0, "reward_std": 0.0, "advantage_abs": 0.0,
           "mismatch_kl": math.nan, "loss_rl": 0.0, "entropy": 1.0, "grad_norm": 0.0,
           "step_time": 2.0}  # fmt: skip
    assert summary_line(row, 10) == (
        "step    3/10 rl      reward 0.000±0.000  |adv| 0.000  ent 1.000  |g| 0.00  2.00s"
    )


def test_a_warmup_step_shows_its_losses():
    row = {"step": 1, "phase": "warmup", "loss_sft": 2.5, "loss_obs": 0.125, "grad_norm": 3.0,
           "step_time": 0.5}  # fmt: skip
    assert summary_line(row, 140) == "step    1/140 warmup  |g| 3.00  0.50s  sft 2.5000  obs 0.1250"
