"""The final-loss check: finite inputs that overflow the sum are named, on every entry point.

Every per-token input is checked where it enters; these cases pass those checks (each value is
finite) and overflow only in the product, the sum or its scaling. The check reads one 0-dim
value, and names the term that went non-finite and the input most likely responsible.
"""

from __future__ import annotations

import pytest
import torch

from echoloss import (
    LossConfig,
    LossInputs,
    echo_loss,
    echo_loss_from_hidden,
    echo_loss_from_logprobs,
)
from echoloss.loss.diagnosis import check_final_loss

RL = torch.tensor([True, True, False, False])
LP = torch.tensor([-0.2, -0.4, -80.0, -0.3])


def _x(adv=(1.0, -1.0, 0.0, 0.0), echo=(0.0, 0.0, 0.5, 0.0), inference=LP, **kw):
    return LossInputs(
        rl_mask=RL,
        advantages=torch.tensor(adv),
        echo_weights=torch.tensor(echo),
        inference_logprobs=inference.where(RL, torch.zeros(())),
        **kw,
    )


CASES = [
    # (inputs, config, term named, likely input named)
    (dict(adv=(3e38, 3e38, 0.0, 0.0)), LossConfig(kl_tau=0.0), "loss_rl", "advantages"),
    (dict(echo=(0.0, 0.0, 3e38, 0.0)), LossConfig(), "loss_echo", "echo_weights"),
    ({}, LossConfig(kl_tau=1e308), "loss_rl", "kl_tau=1e\\+308"),
    (
        {},
        LossConfig(rl_normalization="token_sum_constant", rl_normalization_constant=1e-300),
        "loss_rl",
        "rl_normalization_constant=1e-300",
    ),
    ({}, LossConfig(entropy_coef=-3e38), "loss_rl", "entropy_coef=-3e\\+38"),
]


@pytest.mark.parametrize(("kw", "cfg", "term", "cause"), CASES)
def test_overflow_from_logprobs_is_named(kw, cfg, term, cause):
    lp = LP.clone().requires_grad_()
    ent = torch.full((4,), 2.0)
    with pytest.raises(
        ValueError, match=rf"loss must be finite.*{term} \(the .*likely input: {cause}"
    ):
        echo_loss_from_logprobs(lp, _x(**kw), entropy=ent, config=cfg)


@pytest.mark.parametrize(("kw", "cfg", "term", "cause"), CASES)
def test_overflow_from_logits_and_hidden_is_named(kw, cfg, term, cause):
    """The reference logits path and the fused-linear path run the same final check."""
    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([1, 2, 0, 3])
    logits = torch.randn(4, 5, generator=g)
    logits[2, 0] = -80.0  # the echo row's label: a large NLL, so 3e38 · NLL overflows
    lp = logits.log_softmax(-1).gather(1, labels[:, None])[:, 0]  # ratio 1 on the RL rows
    x = _x(labels=labels, inference=lp, **kw)
    with pytest.raises(ValueError, match=rf"{term} \(the .*likely input: {cause}"):
        echo_loss(logits.requires_grad_(), x, config=cfg)
    hidden = torch.eye(5)[:4].clone()
    with pytest.raises(ValueError, match=rf"{term} \(the .*likely input: {cause}"):
        weight = torch.cat([logits.detach(), torch.zeros(1, 5)]).T.contiguous()  # [V, H]
        echo_loss_from_hidden(hidden, weight, x, config=cfg)  # hidden @ weight.T == logits


def test_check_finite_false_returns_the_non_finite_loss():
    lp = LP.clone().requires_grad_()
    cfg = LossConfig(kl_tau=1e308, check_finite=False)
    out = echo_loss_from_logprobs(lp, _x(), config=cfg)
    assert not torch.isfinite(out.loss)


def test_finite_loss_passes_and_the_check_is_one_value():
    out = echo_loss_from_logprobs(LP.clone().requires_grad_(), _x())
    assert torch.isfinite(out.loss)
    check_final_loss(out.loss, out.loss, out.loss)  # no diagnosis needed: returns None


def test_scored_logprobs_above_zero_are_refused():
    """The scored logprobs get the check every other logprob input gets (≤ 0)."""
    with pytest.raises(ValueError, match=r"logprobs\[1\] must be a log-probability ≤ 0"):
        echo_loss_from_logprobs(torch.tensor([-0.2, 0.7, -1.0, -1.0]), _x())
    with pytest.raises(ValueError, match=r"logprobs\[2\] must be a log-probability ≤ 0"):
        echo_loss_from_logprobs(torch.tensor([-0.2, -0.7, 2.0, -1.0]), _x())
    # a row that does not participate is never read
    echo_loss_from_logprobs(torch.tensor([-0.2, -0.7, -1.0, 5.0]), _x())


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf")])
def test_entropy_must_be_finite_and_non_negative(bad):
    ent = torch.tensor([1.0, bad, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"entropy\[1\] must be a finite entropy ≥ 0"):
        echo_loss_from_logprobs(LP.clone(), _x(), entropy=ent)
    # rounding below zero is accepted; a non-RL row is never read
    echo_loss_from_logprobs(LP.clone(), _x(), entropy=torch.tensor([-1e-6, 0.0, -5.0, 1.0]))
