"""Golden case B (docs/spec.md §13) and failure modes F1-F4, F19-F21, F24, F26 (docs/spec.md §12).

Where a failure mode is a known buggy implementation, the test runs the same check on a small
re-creation of the bug and asserts that the check catches it, so the test cannot pass vacuously.
"""

from __future__ import annotations

import math

import pytest
import torch
from _loss_batches import random_batch

from echoloss.loss import (
    LossConfig,
    Normalizers,
    PolicyOutput,
    echo_loss,
    echo_loss_from_logprobs,
)

F64 = torch.float64


def _leaf(values):
    return torch.tensor(values, dtype=F64, requires_grad=True)


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# ---------------------------------------------------------------- golden case B (docs/spec.md §13 B)


def test_golden_case_b_from_logprobs():
    # lp = [-0.2, -0.4], lq = lp (ratio 1), A = [1, 2], loss mask [T, T], echo mask [F, T]
    # (echo weight 2.0 on row 1, which therefore leaves RL), DPPO thresholds 10, kl_tau 0,
    # rl_loss_scale 1, echo_loss_scale 4.
    lp = _leaf([-0.2, -0.4])
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=torch.tensor([True, True]),
        echo_weights=torch.tensor([0.0, 2.0], dtype=F64),
        advantages=torch.tensor([1.0, 2.0], dtype=F64),
        inference_logprobs=lp.detach().clone(),
        config=LossConfig(dppo_low=10, dppo_high=10, kl_tau=0),
        normalizers=Normalizers(rl_tokens=1, echo_tokens=4),
    )
    # RL = -(1 · 1.0 · exp(0)) / 1 = -1.0; echo = -(2.0 · -0.4) / 4 = 0.2; total -0.8.
    assert out.loss.item() == -1.0 + (2.0 * 0.4) / 4
    assert out.metrics["loss_rl/all"].item() == -1.0
    # Metrics are fp32 by contract: 0.2 to fp32 precision.
    assert out.metrics["loss_echo/all"].item() == pytest.approx(0.2, rel=2**-24, abs=0)
    assert out.metrics["echo_tokens/all"].item() == 1.0
    assert out.metrics["rl_tokens/all"].item() == 1.0
    g = _grad(out.loss, lp)
    assert g.tolist() == [-1.0, -0.5]  # -A·r / 1 on row 0; -2.0 / 4 on the echo row


def test_golden_case_b_from_logits():
    # The same case through the logits path: logits [lp, log(1 - e^lp)] give log p = lp exactly
    # (up to fp64 rounding), so d loss / d logits = coef · (onehot - p).
    lp = torch.tensor([-0.2, -0.4], dtype=F64)
    logits = torch.stack([lp, torch.log(-torch.expm1(lp))], 1).requires_grad_()
    out = echo_loss(
        logits,
        torch.tensor([0, 0]),
        rl_mask=torch.tensor([True, True]),
        echo_weights=torch.tensor([0.0, 2.0], dtype=F64),
        advantages=torch.tensor([1.0, 2.0], dtype=F64),
        inference_logprobs=lp,
        config=LossConfig(dppo_low=10, dppo_high=10, kl_tau=0),
        normalizers=Normalizers(rl_tokens=1, echo_tokens=4),
    )
    assert out.loss.item() == pytest.approx(-0.8, rel=1e-14, abs=0)
    coef = torch.tensor([-1.0, -0.5], dtype=F64)
    p = lp.exp()
    want = coef[:, None] * (
        torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=F64) - torch.stack([p, 1 - p], 1)
    )
    torch.testing.assert_close(_grad(out.loss, logits), want, rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------- spec §12 F1: a select kills the echo gradient


def _f1_buggy_select(lp, *, rl_mask, echo_weights, advantages, inference_logprobs):
    """The design behind spec §12 F1: echo rows stay in the RL path, their log ratio replaced by a constant."""
    echo = echo_weights > 0
    loss_mask = rl_mask | echo
    adv = torch.where(echo, echo_weights, advantages)
    log_ratio = torch.where(echo, torch.zeros_like(lp), lp - inference_logprobs)
    per_tok = -(adv * torch.exp(log_ratio)) * loss_mask
    return per_tok.sum() / loss_mask.sum()


def _echo_grads(fn):
    lp = _leaf([-0.3, -1.2, -0.7, -2.0])
    kw = {
        "rl_mask": torch.tensor([True, False, True, False]),
        "echo_weights": torch.tensor([0.0, 0.5, 0.0, 0.25], dtype=F64),
        "advantages": torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=F64),
        "inference_logprobs": torch.tensor([-0.3, 0.0, -0.7, 0.0], dtype=F64),
    }
    return _grad(fn(lp, **kw), lp)


def test_1_echo_gradient_is_minus_weight_over_echo_count():
    g = _echo_grads(lambda lp, **kw: echo_loss_from_logprobs(lp, **kw).loss)
    # Two echo rows: d loss / d lp = -w / N_echo exactly, and not zero.
    assert g[1].item() == -0.5 / 2 and g[3].item() == -0.25 / 2
    # The same check catches the buggy select (its echo gradient is exactly 0).
    gb = _echo_grads(_f1_buggy_select)
    assert gb[1].item() == 0.0 and gb[3].item() == 0.0


# ---------------------------------------------------------------- spec §12 F2: trust region drops echo rows


def _dppo_echo_in_trust_region(lp, *, rl_mask, echo_weights, advantages, inference_logprobs):
    """Spec §12 F2: echo rows pass a probability-difference trust region (two-sided here, as
    prime-rl's ``ipo`` mask) against their 0.0 placeholder, so ``p - 1 < -0.2`` drops them."""
    echo = echo_weights > 0
    adv = torch.where(echo, echo_weights, advantages)
    delta = lp.detach().exp() - inference_logprobs.exp()
    keep = delta.abs() <= 0.2
    log_ratio = torch.where(echo, torch.zeros_like(lp), lp - inference_logprobs)
    ratio_or_lp = torch.where(echo, lp, torch.exp(log_ratio))
    return -(keep * adv * ratio_or_lp * (rl_mask | echo)).sum()


@pytest.mark.parametrize("placeholder", [0.0, -50.0, 50.0, math.nan, math.inf, -math.inf])
def test_2_echo_ignores_inference_logprobs(placeholder):
    lp = _leaf([-0.3, -1.2, -0.7, -2.0])
    base = {
        "rl_mask": torch.tensor([True, False, True, False]),
        "echo_weights": torch.tensor([0.0, 0.5, 0.0, 0.25], dtype=F64),
        "advantages": torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=F64),
    }
    lq_ref = torch.tensor([-0.3, 0.0, -0.7, 0.0], dtype=F64)
    lq = lq_ref.clone()
    lq[[1, 3]] = placeholder  # echo rows: never read
    out_ref = echo_loss_from_logprobs(lp, inference_logprobs=lq_ref, **base)
    out = echo_loss_from_logprobs(lp, inference_logprobs=lq, **base)
    assert out.loss.item() == out_ref.loss.item()
    assert torch.equal(_grad(out.loss, lp), _grad(out_ref.loss, lp))
    if placeholder == 0.0:
        # The check catches the bug: with placeholder 0, p - 1 < -0.2 drops both echo rows.
        gb = _grad(_dppo_echo_in_trust_region(lp, inference_logprobs=lq, **base), lp)
        assert gb[1].item() == 0.0 and gb[3].item() == 0.0


# ---------------------------------------------------------------- spec §12 F3: echo rows dilute the RL denominator


def _shared_denominator(lp, *, rl_mask, echo_weights, advantages, inference_logprobs):
    echo = echo_weights > 0
    per = torch.where(echo, -echo_weights * lp, -advantages * torch.exp(lp - inference_logprobs))
    return (per * (rl_mask | echo)).sum() / (rl_mask | echo).sum()


@pytest.mark.parametrize("fn_name", ["ours", "shared_denominator"])
def test_3_rl_gradient_unchanged_by_extra_echo_rows(fn_name):
    def run(fn, n_extra):
        lp = _leaf([-0.3, -0.9, -0.7] + [-1.0] * n_extra)
        kw = {
            "rl_mask": torch.tensor([True, True, True] + [False] * n_extra),
            "echo_weights": torch.tensor([0.0] * 3 + [0.5] * n_extra, dtype=F64),
            "advantages": torch.tensor([1.0, -0.5, 2.0] + [0.0] * n_extra, dtype=F64),
            "inference_logprobs": torch.tensor([-0.35, -0.9, -0.6] + [0.0] * n_extra, dtype=F64),
        }
        return _grad(fn(lp, **kw), lp)[:3]

    ours = lambda lp, **kw: echo_loss_from_logprobs(lp, **kw).loss  # noqa: E731
    fn = ours if fn_name == "ours" else _shared_denominator
    same = [torch.equal(run(fn, 0), run(fn, k)) for k in (1, 5)]
    assert all(same) == (fn_name == "ours")


# ---------------------------------------------------------------- spec §12 F4: adv_tau leaks into echo


def test_4_adv_tau_never_scales_echo():
    def grads(adv_tau):
        lp = _leaf([-0.3, -1.2, -0.7])
        out = echo_loss_from_logprobs(
            lp,
            rl_mask=torch.tensor([True, False, True]),
            echo_weights=torch.tensor([0.0, 0.5, 0.0], dtype=F64),
            advantages=torch.tensor([1.0, 0.0, -2.0], dtype=F64),
            inference_logprobs=torch.tensor([-0.3, 0.0, -0.7], dtype=F64),
            config=LossConfig(adv_tau=adv_tau, kl_tau=0),
        )
        return _grad(out.loss, lp)

    g1, g3 = grads(1.0), grads(3.0)
    assert g3[1].item() == g1[1].item() == -0.5  # echo row: -w / 1
    # RL rows (ratio 1, nothing dropped): -adv_tau · A / 2.
    assert g3[[0, 2]].tolist() == [-1.5, 3.0] and g1[[0, 2]].tolist() == [-0.5, 1.0]


# ---------------------------------------------------------------- spec §12 F19: echo where it cannot be honoured


def _custom(inputs, config):
    return PolicyOutput(-(inputs.advantages * inputs.logprobs), {})


def test_19_echo_with_sft_mode_raises():
    lp = _leaf([-0.3, -1.2])
    with pytest.raises(ValueError, match=r"echo rows with mode='sft'"):
        echo_loss_from_logprobs(
            lp,
            rl_mask=torch.tensor([True, False]),
            echo_weights=torch.tensor([0.0, 0.5], dtype=F64),
            config=LossConfig(mode="sft"),
        )
    # Without echo rows the SFT mode is plain NLL over rl_mask with the RL normaliser.
    out = echo_loss_from_logprobs(
        lp, rl_mask=torch.tensor([True, True]), config=LossConfig(mode="sft")
    )
    assert out.loss.item() == (0.3 + 1.2) / 2


def test_19_echo_with_custom_policy_raises_unless_allowed():
    lp = _leaf([-0.3, -1.2])
    kw = {
        "rl_mask": torch.tensor([True, False]),
        "echo_weights": torch.tensor([0.0, 0.5], dtype=F64),
        "advantages": torch.tensor([2.0, 0.0], dtype=F64),
        "policy_fn": _custom,
    }
    with pytest.raises(ValueError, match=r"custom policy.*cannot see the echo weights"):
        echo_loss_from_logprobs(lp, config=LossConfig(policy="custom"), **kw)
    cfg = LossConfig(policy="custom", allow_echo_with_custom_policy=True)
    out = echo_loss_from_logprobs(lp, config=cfg, **kw)
    assert _grad(out.loss, lp).tolist() == [-2.0, -0.5]
    with pytest.raises(ValueError, match=r"needs policy_fn"):
        echo_loss_from_logprobs(
            lp,
            rl_mask=kw["rl_mask"],
            advantages=kw["advantages"],
            config=LossConfig(policy="custom"),
        )
    with pytest.raises(ValueError, match=r"set policy='custom'"):
        echo_loss_from_logprobs(lp, **kw)


def test_custom_policy_sees_rl_rows_only():
    seen = {}

    def spy(inputs, config):
        seen["n"] = inputs.logprobs.numel()
        seen["adv"] = inputs.advantages.tolist()
        return PolicyOutput(
            -(inputs.advantages * inputs.logprobs), {"custom": inputs.advantages > 0}
        )

    out = echo_loss_from_logprobs(
        _leaf([-0.3, -1.2, -0.5]),
        rl_mask=torch.tensor([True, False, True]),
        echo_weights=torch.tensor([0.0, 0.5, 0.0], dtype=F64),
        advantages=torch.tensor([2.0, 9.0, -1.0], dtype=F64),
        config=LossConfig(policy="custom", allow_echo_with_custom_policy=True, adv_tau=0.5),
        policy_fn=spy,
    )
    assert seen == {"n": 2, "adv": [1.0, -0.5]}
    assert out.metrics["custom_frac/all"].item() == 0.5


# ---------------------------------------------------------------- spec §12 F20: empty micro-batch hangs FSDP


@pytest.mark.parametrize(
    "config",
    [
        LossConfig(),
        LossConfig(
            policy="gspo",
            rl_normalization="sequence_mean_token_mean",
            echo_normalization="sequence_mean",
        ),
    ],
)
def test_20_all_masked_micro_batch_backprops_a_connected_zero(config):
    b = random_batch(seq_lens=[4, 3], seed=3)
    logits = b["logits"].clone().requires_grad_()
    out = echo_loss(
        logits,
        b["labels"],
        rl_mask=torch.zeros_like(b["rl_mask"]),
        echo_weights=torch.zeros_like(b["echo_weights"]),
        advantages=b["advantages"],
        inference_logprobs=b["inference_logprobs"],
        sequence_ids=b["sequence_ids"],
        observation_mask=b["observation_mask"],
        config=config,
        normalizers=Normalizers(rl_tokens=5, echo_tokens=2, sequences=2, echo_batches=1),
    )
    assert out.loss.item() == 0.0 and out.loss.requires_grad and out.loss.grad_fn is not None
    out.loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert out.metrics["rl_tokens/all"].item() == 0 and out.metrics["echo_nll_max/all"].item() == 0


# ---------------------------------------------------------------- spec §12 F21: echo rows in RL metrics


def test_21_rl_metrics_never_see_echo_rows():
    b = random_batch(seq_lens=[6, 5], seed=5, p_echo=0.0, p_warning=0.0)
    common = {k: b[k] for k in ("labels", "advantages", "sequence_ids", "temperature")}
    base = echo_loss(
        b["logits"], rl_mask=b["rl_mask"], inference_logprobs=b["inference_logprobs"], **common
    )
    # Turn every non-RL row that predicts something into an echo row with placeholder lq = 0.
    extra = ~b["rl_mask"] & (b["sequence_ids"] >= 0)
    extra[-2] = False  # keep one row that predicts nothing
    with_echo = echo_loss(
        b["logits"],
        rl_mask=b["rl_mask"],
        echo_weights=extra.to(F64),
        inference_logprobs=torch.where(b["rl_mask"], b["inference_logprobs"], 0.0),
        **common,
    )
    assert with_echo.metrics["echo_tokens/all"].item() == float(extra.sum()) > 0
    for key in ("entropy/all", "mismatch_kl/all", "masked_frac/all", "rl_tokens/all"):
        assert with_echo.metrics[key].item() == base.metrics[key].item(), key
    # And they are the RL-only values, computed by hand.
    rl = b["rl_mask"]
    z = b["logits"][rl] / 0.8
    lsm = torch.log_softmax(z, -1)
    ent = -(lsm.exp() * lsm).sum(-1).mean()
    rho = lsm.gather(1, b["labels"][rl][:, None]).squeeze(1) - b["inference_logprobs"][rl]
    kl = (rho.exp() - rho - 1).mean()
    # Metrics are fp32: agreement to fp32 rounding.
    assert with_echo.metrics["entropy/all"].item() == pytest.approx(ent.item(), rel=1e-6)
    assert with_echo.metrics["mismatch_kl/all"].item() == pytest.approx(kl.item(), rel=1e-6)


# ---------------------------------------------------------------- spec §12 F24: weight 0 means "not echoed"


def test_24_weight_zero_rows_are_never_counted():
    def run(n_zero):
        lp = _leaf([-0.3, -1.2] + [-0.5] * n_zero)
        out = echo_loss_from_logprobs(
            lp,
            rl_mask=torch.tensor([True, False] + [False] * n_zero),
            echo_weights=torch.tensor([0.0, 0.5] + [0.0] * n_zero, dtype=F64),
            advantages=torch.tensor([1.0, 0.0] + [0.0] * n_zero, dtype=F64),
            inference_logprobs=torch.tensor([-0.3, 0.0] + [0.0] * n_zero, dtype=F64),
        )
        return out, _grad(out.loss, lp)

    (o0, g0), (o3, g3) = run(0), run(3)
    assert o3.loss.item() == o0.loss.item()
    assert g3[:2].tolist() == g0[:2].tolist() == [-1.0, -0.5]
    assert g3[2:].tolist() == [0.0, 0.0, 0.0]
    assert o3.metrics["echo_tokens/all"].item() == 1.0


def test_echoed_rows_leave_the_rl_set():
    # rl_mask and echo overlap on row 1: echo wins (prime-rl's split), RL count is 1.
    lp = _leaf([-0.3, -1.2])
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=torch.tensor([True, True]),
        echo_weights=torch.tensor([0.0, 0.5], dtype=F64),
        advantages=torch.tensor([1.0, 7.0], dtype=F64),
        inference_logprobs=torch.tensor([-0.3, 0.0], dtype=F64),
    )
    assert out.metrics["rl_tokens/all"].item() == 1.0
    assert _grad(out.loss, lp).tolist() == [-1.0, -0.5]


# ---------------------------------------------------------------- spec §12 F26: echo temperature


@pytest.mark.parametrize("echo_temperature", ["one", "sampling"])
@pytest.mark.parametrize("per_token", [False, True])
def test_26_echo_temperature(echo_temperature, per_token):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, generator=g, dtype=F64)
    labels = torch.tensor([1, 2, 3])
    t = 0.5
    temperature = torch.full((3,), t, dtype=F64) if per_token else t
    out = echo_loss(
        logits,
        labels,
        rl_mask=torch.tensor([True, False, False]),
        echo_weights=torch.tensor([0.0, 1.0, 1.0], dtype=F64),
        advantages=torch.tensor([1.0, 0.0, 0.0], dtype=F64),
        inference_logprobs=torch.tensor([-1.0, 0.0, 0.0], dtype=F64),
        temperature=temperature,
        config=LossConfig(echo_temperature=echo_temperature),
    )
    t_echo = 1.0 if echo_temperature == "one" else t
    nll = -torch.log_softmax(logits[1:] / t_echo, -1).gather(1, labels[1:, None]).squeeze(1)
    assert out.metrics["echo_nll_mean/all"].item() == pytest.approx(nll.mean().item(), rel=1e-6)
    # RL rows always use the sampling temperature.
    lp_rl = torch.log_softmax(logits[0] / t, -1)[1]
    kl = (lp_rl + 1.0).exp() - (lp_rl + 1.0) - 1
    assert out.metrics["mismatch_kl/all"].item() == pytest.approx(kl.item(), rel=1e-6)
