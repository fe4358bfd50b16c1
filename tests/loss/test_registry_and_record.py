"""The policy registry holds defaults and outputs to LossConfig's rules; a LossInputs written in
place after validation is refused at use."""

from __future__ import annotations

import itertools

import pytest
import torch

from echoloss import LossConfig, LossInputs, echo_loss_from_logprobs
from echoloss.loss import PolicyOutput, register_policy

_names = (f"hardening_policy_{i}" for i in itertools.count())


def _nll(inputs, config):
    return PolicyOutput(-inputs.advantages * inputs.logprobs, {})


@pytest.mark.parametrize(
    ("defaults", "match"),
    [
        ({"kl_tau": float("nan")}, r"defaults\['kl_tau'\] must be finite and ≥ 0"),
        ({"kl_tau": -5.0}, r"defaults\['kl_tau'\] must be finite and ≥ 0"),
        ({"eps_low": 2.0}, r"defaults\['eps_low'\] must be finite and in \[0, 1\)"),
        ({"eps_high": float("inf")}, r"defaults\['eps_high'\] must be finite"),
        ({"dual_clip": 2.0}, r"a policy may default only"),
        ({"kl_tua": 0.1}, r"a policy may default only"),
    ],
)
def test_defaults_follow_lossconfigs_rules(defaults, match):
    with pytest.raises(ValueError, match=match):
        register_policy(next(_names), _nll, uses_ratio=False, defaults=defaults)
    with pytest.raises(TypeError, match="must be a float"):
        register_policy(next(_names), _nll, uses_ratio=False, defaults={"kl_tau": "0.1"})


def _run(fn):
    name = next(_names)
    register_policy(name, fn, uses_ratio=False)
    lp = torch.tensor([-0.5, -1.0, -0.2], requires_grad=True)
    x = LossInputs(
        rl_mask=torch.tensor([True, True, False]), advantages=torch.tensor([1.0, -1.0, 0.0])
    )
    return echo_loss_from_logprobs(lp, x, config=LossConfig(policy=name))


def test_outputs_are_checked():
    with pytest.raises(TypeError, match=r"must be an echoloss\.PolicyOutput.*got Tensor"):
        _run(lambda i, c: -i.logprobs)
    with pytest.raises(ValueError, match="detached, so the RL rows would get no gradient"):
        _run(lambda i, c: PolicyOutput(-i.logprobs.detach(), {}))
    with pytest.raises(
        ValueError, match=r"flag 'clipped' .* must be a bool tensor of shape \[n_rl\] = \[2\]"
    ):
        _run(lambda i, c: PolicyOutput(-i.logprobs, {"clipped": torch.zeros(3, dtype=torch.bool)}))
    with pytest.raises(ValueError, match=r"flag 'clipped' .* got float32"):
        _run(lambda i, c: PolicyOutput(-i.logprobs, {"clipped": torch.zeros(2)}))
    out = _run(lambda i, c: PolicyOutput(-i.logprobs, {"clipped": i.logprobs > -0.7}))
    assert float(out.metrics["clipped_frac/all"]) == 0.5


def test_record_written_in_place_after_validation_is_refused():
    x = LossInputs(
        rl_mask=torch.tensor([True, False, False, False, False]),
        advantages=torch.ones(5),
        echo_weights=torch.tensor([0.0, 0.5, 0.5, 0.5, 0.5]),
    )
    lp = torch.full((5,), -0.5)
    cfg = LossConfig(policy="reinforce")
    echo_loss_from_logprobs(lp, x, config=cfg)
    x.echo_weights[4] = float("nan")
    with pytest.raises(ValueError, match=r"inputs.echo_weights must be unchanged"):
        echo_loss_from_logprobs(lp, x, config=cfg)
    adv = torch.ones(5)
    y = LossInputs(rl_mask=torch.tensor([True] * 5), advantages=adv)
    adv.view(5, 1)[0, 0] = float("inf")  # through a view of the caller's own buffer
    with pytest.raises(ValueError, match=r"inputs.advantages must be unchanged"):
        echo_loss_from_logprobs(lp, y, config=cfg)
    echo_loss_from_logprobs(lp, y.replace(advantages=torch.ones(5)), config=cfg)  # a fresh record
