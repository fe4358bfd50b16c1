"""``log_ratio_clamp`` on both sides of every ratio, and the entropy bonus whatever
``compute_entropy`` says (from logits, from hidden states and from logprobs)."""

from __future__ import annotations

import math

import pytest
import torch

from echoloss import LossConfig, LossInputs, echo_loss, echo_loss_from_hidden
from echoloss.loss import echo_loss_from_logprobs
from echoloss.loss.penalties import k3, mismatch_weights
from echoloss.loss.policy import PolicyInputs, cispo_loss, dppo_loss, ppo_clip_loss

F64 = torch.float64
CLAMP = 20.0


def _inputs(rho: float) -> PolicyInputs:
    # lp and lp_old both tiny probabilities, so dppo's probability trust region keeps the token.
    lp_value, old_value = (-10.0, -40.0) if rho > 0 else (-40.0, -10.0)
    lp = torch.tensor([lp_value], dtype=F64, requires_grad=True)
    old = torch.tensor([old_value], dtype=F64)
    assert (lp - old).item() == rho
    return PolicyInputs(lp, old, torch.ones(1, dtype=F64), None, 0)


@pytest.mark.parametrize("rho", [30.0, -30.0], ids=["above", "below"])
def test_log_ratio_clamp_bounds_every_ratio_on_both_sides(rho):
    """ρ = ±30 with clamp 20: every ratio is exp(±20) exactly (not exp(±30)) and the clamped
    token has no ratio gradient."""
    r = math.exp(math.copysign(CLAMP, rho))
    x = _inputs(rho)
    # dppo: loss = -A·r (token kept: |δ| ≈ 4.5e-5)
    out = dppo_loss(x, low=0.2, high=0.2, log_ratio_clamp=CLAMP)
    assert out.loss.item() == pytest.approx(-r, rel=1e-12)
    (g,) = torch.autograd.grad(out.loss.sum(), x.logprobs)
    assert g.item() == 0.0
    # ppo_clip with a clip range that contains both ratios: loss = -A·r
    out = ppo_clip_loss(x, eps_low=1 - 1e-12, eps_high=1e12, log_ratio_clamp=CLAMP)
    assert out.loss.item() == pytest.approx(-r, rel=1e-12)
    # cispo: loss = -w·A·lp with the (open-bounded) weight w = r
    out = cispo_loss(x, weight_max=1e30, log_ratio_clamp=CLAMP)
    assert out.loss.item() == pytest.approx(-r * x.logprobs.item(), rel=1e-12)
    # mismatch importance weight exp(lp_old - lp_inf)
    w, _ = mismatch_weights(
        x.old_logprobs,
        x.old_logprobs - rho,
        mode="token_truncate",
        weight_max=1e30,
        log_ratio_clamp=CLAMP,
    )
    assert w.item() == pytest.approx(r, rel=1e-12)
    # k3 = exp(x) - x - 1 on the clamped x
    c = math.copysign(CLAMP, rho)
    assert k3(torch.tensor([rho], dtype=F64), CLAMP).item() == pytest.approx(
        math.expm1(c) - c, rel=1e-12
    )


def _batch():
    g = torch.Generator().manual_seed(3)
    n, v = 6, 7
    logits = torch.randn(n, v, generator=g, dtype=F64)
    labels = torch.randint(0, v, (n,), generator=g)
    rl = torch.tensor([True, True, False, True, False, True])
    x = LossInputs(
        labels=labels,
        rl_mask=rl,
        echo_weights=torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0], dtype=F64),
        advantages=torch.tensor([1.0, -1.0, 0.0, 0.5, 0.0, 2.0], dtype=F64),
    )
    return logits, x


def _hand_loss(z, x, coef):
    """``Σ_RL (-A·lp - c·H) / n_RL + Σ_echo (-w·lp) / n_echo`` in plain autograd."""
    lsm = torch.log_softmax(z, -1)
    lp = lsm.gather(1, x.labels[:, None]).squeeze(1)
    ent = -(lsm.exp() * lsm).sum(-1)
    rl, echo = x.rl, x.echo
    rl_term = (-(x.advantages * lp) - coef * ent)[rl].sum() / int(rl.sum())
    echo_term = -(x.echo_weights * lp)[echo].sum() / int(echo.sum())
    return rl_term + echo_term, ent[rl].mean()


@pytest.mark.parametrize("compute_entropy", [False, True])
@pytest.mark.parametrize("entry", ["logits", "hidden"])
def test_entropy_bonus_is_trained_whatever_compute_entropy_says(entry, compute_entropy):
    """``entropy_coef`` needs the entropy: it is computed (and reported) even with
    ``compute_entropy=False``; loss and logits gradient equal the hand formula's."""
    logits, x = _batch()
    coef = 0.3
    zz = logits.clone().requires_grad_()
    expected, mean_ent = _hand_loss(zz, x, coef)
    (g_expected,) = torch.autograd.grad(expected, zz)
    cfg = LossConfig(policy="reinforce", entropy_coef=coef, compute_entropy=compute_entropy)
    z = logits.clone().requires_grad_()
    if entry == "logits":
        out = echo_loss(z, x, config=cfg)
    else:  # identity LM head: logits = hidden
        out = echo_loss_from_hidden(z, torch.eye(7, dtype=F64), x, config=cfg)
    (g,) = torch.autograd.grad(out.loss, z)
    # fp64 throughout: the two computations differ by summation order only
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g, g_expected, rtol=1e-10, atol=1e-14)
    assert out.metrics["entropy/all"].item() == pytest.approx(mean_ent.item(), rel=1e-6)
    assert coef * mean_ent.item() > 0.1  # the bonus is large enough to matter in the check


def test_entropy_bonus_from_logprobs_needs_the_entropy():
    lp = torch.tensor([-0.5, -1.0], dtype=F64, requires_grad=True)
    x = LossInputs(rl_mask=torch.tensor([True, True]), advantages=torch.ones(2, dtype=F64))
    cfg = LossConfig(policy="reinforce", entropy_coef=0.1, compute_entropy=False)
    with pytest.raises(ValueError, match=r"entropy is required by entropy_coef=0.1"):
        echo_loss_from_logprobs(lp, x, config=cfg)
    ent = torch.tensor([2.0, 4.0], dtype=F64)
    out = echo_loss_from_logprobs(lp, x, entropy=ent, config=cfg)
    assert out.loss.item() == pytest.approx(((0.5 - 0.2) + (1.0 - 0.4)) / 2, rel=1e-12)


def test_a_registered_policy_is_one_function_and_one_registration():
    from echoloss.loss import POLICIES, PolicyOutput, register_policy

    def double_reinforce(inputs, config):
        return PolicyOutput(-2.0 * inputs.advantages * inputs.logprobs, {})

    register_policy("double_reinforce_test", double_reinforce, uses_ratio=False, overwrite=True)
    assert POLICIES["double_reinforce_test"].fn is double_reinforce
    lp = torch.tensor([-0.5, -1.0], dtype=F64, requires_grad=True)
    x = LossInputs(rl_mask=torch.tensor([True, True]), advantages=torch.ones(2, dtype=F64))
    out = echo_loss_from_logprobs(lp, x, config=LossConfig(policy="double_reinforce_test"))
    assert out.loss.item() == pytest.approx(1.5, rel=1e-15)  # -2·(−0.5 − 1.0) / 2
    # it reads no policy parameter: setting one is refused
    with pytest.raises(ValueError, match=r"eps_high=0.3 is ignored by policy='double_reinforce"):
        LossConfig(policy="double_reinforce_test", eps_high=0.3)
    # the same registration again is a no-op; a different one needs overwrite=True
    register_policy("double_reinforce_test", double_reinforce, uses_ratio=False)
    with pytest.raises(ValueError, match=r"already registered .*pass overwrite=True"):
        register_policy("double_reinforce_test", double_reinforce)
    with pytest.raises(ValueError, match=r"policy 'dppo' is built in and cannot be replaced"):
        register_policy("dppo", double_reinforce, overwrite=True)
