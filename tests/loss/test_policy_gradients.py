"""Every policy variant: autograd d loss / d logprob against the hand-derived formula, and
``torch.autograd.gradcheck`` in fp64 of the whole loss w.r.t. the logits."""

from __future__ import annotations

import math

import pytest
import torch
from _loss_batches import random_batch

from echoloss.loss import LossConfig, echo_loss, echo_loss_from_logprobs
from echoloss.ops.selective_logprobs.naive import naive_selective_logprobs

F64 = torch.float64
N = 6
SEQ = torch.tensor([0, 0, 0, 1, 1, 1])
LP = torch.tensor([-0.5, -1.0, -2.0, -0.5, -0.8, -1.5], dtype=F64)  # LQ = LP - RHO ≤ 0
# log ratios ρ = lp - lq chosen well away from every clip boundary used below.
RHO = torch.tensor([0.05, 0.7, -0.6, -0.4, 0.3, 0.0], dtype=F64)
LQ = LP - RHO
ADV = torch.tensor([1.0, 2.0, -1.0, -0.5, 0.0, 1.5], dtype=F64)
ALL = torch.ones(N, dtype=torch.bool)


def _grad(config, **extra):
    lp = LP.clone().requires_grad_()
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=extra.pop("rl_mask", ALL),
        advantages=ADV,
        inference_logprobs=LQ,
        sequence_ids=SEQ,
        config=config,
        **extra,
    )
    (g,) = torch.autograd.grad(out.loss, lp)
    return g, out


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kl_tau", [0.0, 0.1])
def test_dppo(kl_tau):
    g, out = _grad(LossConfig(kl_tau=kl_tau))
    r = RHO.exp()
    delta = LP.exp() - LQ.exp()
    dropped = torch.where(ADV > 0, delta > 0.2, delta < -0.2)
    # d/dlp [-keep·A·r + kl_tau·ρ²] = -keep·A·r + 2·kl_tau·ρ, over N RL tokens.
    keep = (~dropped).double()
    _close(g, (-keep * ADV * r + 2 * kl_tau * RHO) / N)
    assert dropped.any() and not dropped.all()  # the case exercises both branches
    assert out.metrics["masked_frac/all"].item() == pytest.approx(dropped.double().mean().item())


def test_dppo_zero_advantage_takes_the_otherwise_branch():
    # A == 0 with δ < -low is dropped (prime-rl); counted in masked, in neither side.
    lp = torch.tensor([-3.0, -0.1, -3.0, -0.1], dtype=F64, requires_grad=True)
    lq = torch.tensor([-0.1, -3.0, -0.1, -3.0], dtype=F64)  # δ ≈ -0.85, +0.85, -0.85, +0.85
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=torch.ones(4, dtype=torch.bool),
        advantages=torch.tensor([0.0, 0.0, -1.0, 1.0], dtype=F64),
        inference_logprobs=lq,
        config=LossConfig(kl_tau=0),
    )
    m = {k.split("/")[0]: v.item() for k, v in out.metrics.items() if k.endswith("/all")}
    # dropped: row 0 (A=0, δ<-low), row 2 (A<0, δ<-low), row 3 (A>0, δ>high); kept: row 1.
    assert (m["masked_frac"], m["masked_low_frac"], m["masked_high_frac"]) == (0.75, 0.25, 0.25)


@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_ppo_clip(dual_clip):
    g, out = _grad(LossConfig(policy="ppo_clip", eps_low=0.2, eps_high=0.28, dual_clip=dual_clip))
    r = RHO.exp()
    active = torch.where(ADV > 0, r <= 1.28, torch.where(ADV < 0, r >= 0.8, True))
    if dual_clip is not None:
        active &= ~((ADV < 0) & (r > dual_clip))
    _close(g, -(active * ADV * r) / N)
    # r = [1.05, 2.01, 0.55, 0.67, 1.35, 1.0]: row 1 clipped high (A>0), rows 2, 3 clipped low.
    assert out.metrics["clipped_high_frac/all"].item() == pytest.approx(1 / 6)
    assert out.metrics["clipped_low_frac/all"].item() == pytest.approx(2 / 6)


def test_ppo_dual_clip_bounds_negative_advantage_tokens():
    lp = torch.tensor([0.0], dtype=F64, requires_grad=True)
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=torch.tensor([True]),
        advantages=torch.tensor([-1.0], dtype=F64),
        inference_logprobs=torch.tensor([-1.5], dtype=F64),  # r = e^1.5 ≈ 4.48 > c = 3
        config=LossConfig(policy="ppo_clip", dual_clip=3.0),
    )
    assert out.loss.item() == 3.0  # -c·A
    assert torch.autograd.grad(out.loss, lp)[0].item() == 0.0
    assert out.metrics["dual_clipped_frac/all"].item() == 1.0


@pytest.mark.parametrize("bounds", [(5.0, None), (1.5, 0.8)])
def test_cispo(bounds):
    hi, lo = bounds
    g, _ = _grad(LossConfig(policy="cispo", cispo_max=hi, cispo_min=lo))
    w = RHO.exp().clamp(min=lo, max=hi)
    _close(g, -(w * ADV) / N)  # every token keeps a gradient, scaled by the clipped weight


@pytest.mark.parametrize("eps", [(0.2, 0.2), (3e-4, 4e-4)])
def test_gspo(eps):
    lo, hi = eps
    g, _ = _grad(LossConfig(policy="gspo", eps_low=lo, eps_high=hi))
    want = torch.zeros(N, dtype=F64)
    for s in (0, 1):
        rows = s == SEQ
        ratio = RHO[rows].mean().exp()
        adv = ADV[rows]
        active = torch.where(adv > 0, ratio <= 1 + hi, torch.where(adv < 0, ratio >= 1 - lo, True))
        # d/dlp_k of -Σ_t active_t·A_t·s_i = -Σ_t active_t·A_t·s_i / |RL_i| for k in sequence i.
        want[rows] = -(active * adv).sum() * ratio / rows.sum() / N
    _close(g, want)


@pytest.mark.parametrize("temperatures", [(1.0, 1.05), (8.0, 0.3)])
def test_sapo(temperatures):
    pos, neg = temperatures
    g, _ = _grad(LossConfig(policy="sapo", sapo_temperature_pos=pos, sapo_temperature_neg=neg))
    r = RHO.exp()
    tau = torch.where(ADV > 0, torch.tensor(pos, dtype=F64), torch.tensor(neg, dtype=F64))
    gate = torch.sigmoid(tau * (r - 1))
    # d/dlp of -σ(τ(r - 1))·4/τ·A = -4·A·σ(1 - σ)·r: the slope of the plain policy gradient at
    # r = 1 (σ = 1/2), smaller away from it on both sides
    _close(g, -4 * ADV * gate * (1 - gate) * r / N)


def test_sequence_level_sapo_and_cispo():
    g_sapo, _ = _grad(LossConfig(policy="sapo_sequence"))
    g_cispo, _ = _grad(LossConfig(policy="cispo_sequence", cispo_max=1.1))
    want_sapo = torch.zeros(N, dtype=F64)
    want_cispo = torch.zeros(N, dtype=F64)
    for s in (0, 1):
        rows = s == SEQ
        ratio = RHO[rows].mean().exp()
        adv = ADV[rows]
        tau = torch.where(adv > 0, torch.tensor(1.0, dtype=F64), torch.tensor(1.05, dtype=F64))
        gate = torch.sigmoid(tau * (ratio - 1))
        # every token of sequence i: Σ_t -4·A_t·σ_t(1 - σ_t) · s_i / |RL_i| (through the mean)
        want_sapo[rows] = (-4 * adv * gate * (1 - gate)).sum() * ratio / rows.sum() / N
        # the weight min(s_i, 1.1) is detached: -w_i·A_t per token
        want_cispo[rows] = -ratio.clamp(max=1.1) * adv / N
    _close(g_sapo, want_sapo)
    _close(g_cispo, want_cispo)


def test_reinforce():
    g, _ = _grad(LossConfig(policy="reinforce"))
    _close(g, -ADV / N)


@pytest.mark.parametrize(
    "mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
)
def test_mismatch_correction(mode):
    old = LP - 0.5 * RHO  # trainer-side behaviour policy: w = exp(old - lq) = exp(ρ/2)
    g, out = _grad(
        LossConfig(policy="reinforce", mismatch=mode, mismatch_max=1.2, mismatch_min=0.9),
        old_logprobs=old,
    )
    log_w = old - LQ
    if mode.startswith("sequence"):
        log_w = torch.stack([log_w[s == SEQ].sum() for s in (0, 1)])[SEQ]
    w = log_w.exp()
    outside = (w > 1.2) | (w < 0.9)
    w = w.clamp(0.9, 1.2) if mode.endswith("truncate") else torch.where(outside, 0.0, w)
    _close(g, -(w * ADV) / N)
    key = "is_truncated_frac/all" if mode.endswith("truncate") else "is_masked_frac/all"
    assert out.metrics[key].item() == pytest.approx(outside.double().mean().item())


def test_mismatch_without_old_logprobs_is_on_policy():
    # No old_logprobs: the behaviour policy is the current one, ratio 1 (gradient of lp), and
    # the importance weight exp(lp - lq) truncated at 3.
    g, _ = _grad(LossConfig(policy="ppo_clip", mismatch="token_truncate", mismatch_max=1.1))
    w = RHO.exp().clamp(max=1.1)
    _close(g, -(w * ADV) / N)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_kl(estimator):
    ref = LP + torch.tensor([0.1, -0.2, 0.3, 0.0, -0.5, 0.25], dtype=F64)
    g, out = _grad(
        LossConfig(policy="reinforce", kl_coef=0.5, kl_estimator=estimator), ref_logprobs=ref
    )
    d = ref - LP
    dk = {"k1": torch.ones(N, dtype=F64), "k2": -d, "k3": 1 - d.exp()}[estimator]
    _close(g, (-ADV + 0.5 * dk) / N)
    assert "ref_kl/all" in out.metrics


def test_entropy_bonus_gradient_on_rl_rows_only():
    lp = LP.clone().requires_grad_()
    ent = torch.full((N,), 1.5, dtype=F64, requires_grad=True)
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=torch.tensor([True, True, True, False, False, False]),
        echo_weights=torch.tensor([0, 0, 0, 1.0, 0, 0], dtype=F64),
        advantages=ADV,
        inference_logprobs=LQ,
        entropy=ent,
        config=LossConfig(policy="reinforce", entropy_coef=0.01),
    )
    (ge,) = torch.autograd.grad(out.loss, ent)
    _close(ge, torch.tensor([-0.01 / 3] * 3 + [0.0] * 3, dtype=F64))


# ------------------------------------------------------------------ gradcheck on the whole loss


GRADCHECK_CONFIGS = {
    "dppo": LossConfig(kl_tau=0.05),
    "sapo": LossConfig(policy="sapo", sapo_temperature_neg=2.0),
    "sapo_sequence_seqmean": LossConfig(
        policy="sapo_sequence", rl_normalization="sequence_mean_token_mean"
    ),
    "ppo_clip_dual": LossConfig(policy="ppo_clip", dual_clip=2.0, eps_high=0.28),
    "gspo_seqmean": LossConfig(
        policy="gspo",
        eps_low=0.2,
        eps_high=0.2,
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
    ),
    "reinforce_kl_entropy": LossConfig(
        policy="reinforce",
        kl_coef=0.1,
        entropy_coef=0.01,
        rl_normalization="sequence_mean_token_sum",
        echo_normalization="batch_token_mean",
        echo_temperature="sampling",
    ),
    "ppo_truncated_is": LossConfig(
        policy="ppo_clip",
        mismatch="sequence_truncate",
        rl_normalization="token_sum_constant",
        rl_normalization_constant=7.0,
        echo_normalization="sum",
    ),
}


@pytest.mark.parametrize("name", list(GRADCHECK_CONFIGS))
def test_gradcheck_full_loss_fp64(name):
    cfg = GRADCHECK_CONFIGS[name]
    b = random_batch(seq_lens=[4, 3, 3], vocab=5, seed=11)
    old = b["inference_logprobs"] + 0.05 if cfg.mismatch else None
    ref = b["inference_logprobs"] - 0.1

    def f(logits):
        return echo_loss(
            logits,
            b["labels"],
            rl_mask=b["rl_mask"],
            echo_weights=b["echo_weights"],
            advantages=b["advantages"],
            inference_logprobs=b["inference_logprobs"],
            temperature=b["temperature"],
            old_logprobs=old,
            ref_logprobs=ref,
            sequence_ids=b["sequence_ids"],
            observation_mask=b["observation_mask"],
            config=cfg,
            chunk_size=3,
        ).loss

    x = b["logits"].clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-9, rtol=1e-6)


def test_cispo_logits_gradient_is_the_stop_gradient_chain():
    # CISPO's weight is detached, so finite differences (gradcheck) would see its change: check
    # instead that d loss / d logits = Σ_t coef_t · d lp_t / d logits with the hand coefficient.
    b = random_batch(seq_lens=[5, 4], vocab=6, seed=2, p_echo=0.0)
    cfg = LossConfig(policy="cispo", cispo_max=1.1)
    x = b["logits"].clone().requires_grad_()
    out = echo_loss(
        x,
        b["labels"],
        rl_mask=b["rl_mask"],
        advantages=b["advantages"],
        inference_logprobs=b["inference_logprobs"],
        temperature=b["temperature"],
        config=cfg,
    )
    (g,) = torch.autograd.grad(out.loss, x)
    x2 = b["logits"].clone().requires_grad_()
    lp = naive_selective_logprobs(x2, b["labels"], temperature=b["temperature"])
    rl = b["rl_mask"]
    w = (lp.detach() - b["inference_logprobs"]).exp().clamp(max=1.1)
    coef = torch.where(rl, -w * b["advantages"] / rl.sum(), 0.0)
    (g2,) = torch.autograd.grad((coef * lp).sum(), x2)
    torch.testing.assert_close(g, g2, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("clamp", [20.0, None])
def test_log_ratio_clamp_keeps_huge_ratios_finite(clamp):
    # A kept DPPO token at tiny probabilities: p = e^-20, p_old = e^-50 (δ ≈ 2e-9, inside the
    # trust region) but ρ = 30, r = e^30 ≈ 1e13. The clamp caps r at e^20 with zero gradient.
    lp = torch.tensor([-20.0], dtype=F64, requires_grad=True)
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=torch.tensor([True]),
        advantages=torch.tensor([-1.0], dtype=F64),
        inference_logprobs=torch.tensor([-50.0], dtype=F64),
        config=LossConfig(kl_tau=0, log_ratio_clamp=clamp),
    )
    (g,) = torch.autograd.grad(out.loss, lp)
    if clamp is None:
        assert g.item() == pytest.approx(torch.tensor(30.0, dtype=F64).exp().item())
    else:
        assert out.loss.item() == pytest.approx(torch.tensor(20.0, dtype=F64).exp().item())
        assert g.item() == 0.0


# ------------------------------------------------------------------ ratios past the float range

#: log ratios whose ratio leaves fp32 (e^±100) or every float (e^±1e4) on row 0; row 1 is 0.1
EXTREME_RHO = [100.0, -100.0, 1e4, -1e4]


def _mp_sapo_slope(rho: float, tau: float) -> float:
    """``σ(z)(1 - σ(z))·e^ρ`` of ``z = τ(e^ρ - 1)`` in 60-digit arithmetic (the exact value)."""
    import mpmath

    with mpmath.workdps(60):
        r = mpmath.exp(mpmath.mpf(rho))
        z = tau * (r - 1)
        # σ(1 - σ) = 1/(4·cosh²(z/2)): no 1 - σ, which cancels even in 60 digits for z > 130
        return float(r / (4 * mpmath.cosh(z / 2) ** 2))


def _extreme_case(rho: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lp, old)`` with ``lp - old = [rho, 0.1]``, both valid logprobs (≤ 0)."""
    lp = torch.tensor([-0.5 + min(rho, 0.0), -1.0], dtype=dtype, requires_grad=True)
    old = torch.tensor([-0.5 - max(rho, 0.0), -1.1], dtype=dtype)
    return lp, old


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rho", EXTREME_RHO)
@pytest.mark.parametrize("adv0", [1.0, -1.0])
def test_sapo_derivative_is_finite_and_exact_past_the_float_range(rho, adv0, dtype):
    """Without a clamp the gate saturates (σ = 1 or σ(-τ)) while ``r`` overflows: autograd of
    ``torch.sigmoid(τ·(exp(ρ) - 1))`` gave ``0·inf = NaN``. The derivative ``-4·A·σ(1 - σ)·r/N``
    against its 60-digit value (mpmath): within 8 ulps of the dtype, forward and backward."""
    lp, old = _extreme_case(rho, dtype)
    adv = torch.tensor([adv0, -0.5], dtype=dtype)
    cfg = LossConfig(policy="sapo", log_ratio_clamp=None, sapo_temperature_neg=1.05)
    out = echo_loss_from_logprobs(
        lp, rl_mask=torch.ones(2, dtype=torch.bool), advantages=adv, old_logprobs=old, config=cfg
    )
    (g,) = torch.autograd.grad(out.loss, lp)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all(), (out.loss, g)
    import mpmath

    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    want_loss = 0.0
    rhos = [rho, float(lp[1].detach() - old[1])]
    for i, (rho_i, a) in enumerate(zip(rhos, [adv0, -0.5], strict=True)):
        tau = 1.0 if a > 0 else 1.05
        want_g = -4 * a * _mp_sapo_slope(rho_i, tau) / 2
        # row 0's derivative is tiny (|ρ| ≥ 100: ≤ e^-99; 0 or a denormal in fp32, 0 at
        # |ρ| = 1e4); ``exp(ρ - |z|)`` carries an error of a few ``eps·(|ρ| + |z|)``
        tol = 8 * eps * (1 + min(abs(rho_i), 100.0)) * abs(want_g) + tiny
        assert abs(float(g[i]) - want_g) <= tol, (i, float(g[i]), want_g)
        with mpmath.workdps(60):
            z = tau * (mpmath.exp(mpmath.mpf(rho_i)) - 1)
            want_loss += float(-(1 / (1 + mpmath.exp(-z))) * 4 / tau * a / 2)
    assert abs(float(out.loss.detach()) - want_loss) <= 8 * eps * 4


@pytest.mark.parametrize("policy", ["sapo_sequence", "gspo", "ppo_clip", "cispo_sequence"])
@pytest.mark.parametrize("rho", EXTREME_RHO)
def test_clipped_and_gated_policies_give_finite_derivatives_past_the_float_range(policy, rho):
    """A flat objective (a clip past its bound, a saturated gate) whose ratio overflows has
    derivative 0, not autograd's ``0·inf = NaN``; fp32 against fp64 autograd of the same loss
    with the clamp at 700 (fp64's ``exp`` is finite there, so plain autograd is the gold)."""
    extra = {"dual_clip": 3.0} if policy == "ppo_clip" else {}
    rho = max(min(rho, 100.0), -100.0) if policy.endswith("sequence") or policy == "gspo" else rho
    grads = {}
    for dtype, clamp in ((torch.float32, None), (torch.float64, 700.0)):
        lp, old = _extreme_case(rho, dtype)
        out = echo_loss_from_logprobs(
            lp,
            rl_mask=torch.ones(2, dtype=torch.bool),
            advantages=torch.tensor([1.0, -1.0], dtype=dtype),
            old_logprobs=old,
            sequence_ids=torch.tensor([0, 1]),
            config=LossConfig(policy=policy, log_ratio_clamp=clamp, **extra),
        )
        (g,) = torch.autograd.grad(out.loss, lp)
        assert torch.isfinite(out.loss) and torch.isfinite(g).all(), (dtype, out.loss, g)
        grads[dtype] = g
    torch.testing.assert_close(
        grads[torch.float32].double(), grads[torch.float64], rtol=4e-7, atol=1e-38
    )


def test_sapo_slope_against_60_digit_arithmetic():
    """``exp(ρ - |z|)/(1 + exp(-|z|))²`` (fp64) against ``σ(z)(1 - σ(z))·e^ρ`` in 60 digits on
    ``ρ ∈ [-50, 8]`` and four temperatures: within ``8·eps·(1 + |ρ| + |z|)`` relative (the
    exponent ``ρ - |z|`` carries an absolute error of a few ``eps·|z|``). The plain fp64 formula
    loses up to ``eps/(1 - σ)`` to the cancellation in ``1 - σ`` (2e-8 at ``z ≈ 19``)."""
    from echoloss._ratios import sapo_gate_slope

    rho = torch.linspace(-50, 8, 233, dtype=F64)
    eps = torch.finfo(F64).eps
    for tau in (0.05, 1.0, 1.05, 8.0):
        got = sapo_gate_slope(rho, torch.full_like(rho, tau))
        for r, g in zip(rho.tolist(), got.tolist(), strict=True):
            want = _mp_sapo_slope(r, tau)
            z = abs(tau * (math.exp(r) - 1))
            assert abs(g - want) <= 8 * eps * (1 + abs(r) + z) * want + 1e-300, (tau, r, g, want)


def test_a_custom_policy_whose_backward_is_not_finite_is_named_by_check_finite():
    """A registered or per-call policy with a finite loss and a non-finite derivative (here
    plain autograd of a saturated gate of an overflowing ratio: 0·inf) is caught in backward,
    naming the policy and the row; the built-in policies are exempt (their derivatives are
    finite wherever their loss is, tested above)."""
    from echoloss.loss.policy import _REGISTRY, PolicyOutput, register_policy

    def naive_gate(inputs, config):
        r = torch.exp(inputs.logprobs - inputs.old_logprobs)
        return PolicyOutput(-torch.sigmoid(r - 1) * inputs.advantages, {})

    lp, old = _extreme_case(100.0, torch.float32)
    kw = dict(
        rl_mask=torch.ones(2, dtype=torch.bool),
        advantages=torch.tensor([1.0, -1.0]),
        old_logprobs=old,
    )
    with _REGISTRY.isolated():
        register_policy("naive_gate", naive_gate, all_rows=True)
        out = echo_loss_from_logprobs(lp, config=LossConfig(policy="naive_gate"), **kw)
        assert torch.isfinite(out.loss)
        with pytest.raises(
            ValueError, match=r"gradient of policy 'naive_gate' .* at row 0 must be finite"
        ):
            out.loss.backward()
        # per call (policy="custom"), and the opt-out
        out = echo_loss_from_logprobs(
            lp, config=LossConfig(policy="custom"), policy_fn=naive_gate, **kw
        )
        with pytest.raises(ValueError, match=r"gradient of policy 'custom'"):
            out.loss.backward()
        # the device path (CUDA): checked in backward without a host read, raised later
        from echoloss._deferred import device_code_path, raise_deferred_errors

        with device_code_path():
            out = echo_loss_from_logprobs(lp, config=LossConfig(policy="naive_gate"), **kw)
            out.loss.backward()  # no host read here
        with pytest.raises(ValueError, match=r"gradient of policy 'naive_gate'"):
            raise_deferred_errors()
        lp.grad = None
        quiet = LossConfig(policy="naive_gate", check_finite=False)
        echo_loss_from_logprobs(lp, config=quiet, **kw).loss.backward()
        assert torch.isnan(lp.grad[0])  # what the check stops


def test_a_mismatch_kl_that_overflows_without_a_clamp_is_an_error():
    """cispo with log_ratio_clamp=None and inference logprobs e^1e4 below the logprobs: the
    metric mismatch_kl/all was inf with no error (k3 = e^x - x - 1 overflows). With the default
    clamp it stays finite and nothing is checked (no launch for it). The fused program's case:
    ``tests/ops/test_fused_algebra.py``."""
    lp = torch.tensor([-0.5, -1.0], requires_grad=True)
    kw = dict(
        rl_mask=torch.ones(2, dtype=torch.bool),
        advantages=torch.tensor([1.0, -1.0]),
        inference_logprobs=torch.tensor([-0.5 - 1e4, -1.1]),
    )
    with pytest.raises(
        ValueError, match=r"mismatch_kl \(k3 of logprobs - inference_logprobs\) at row 0"
    ):
        echo_loss_from_logprobs(lp, config=LossConfig(policy="cispo", log_ratio_clamp=None), **kw)
    out = echo_loss_from_logprobs(lp, config=LossConfig(policy="cispo"), **kw)
    assert torch.isfinite(out.metrics["mismatch_kl/all"])
