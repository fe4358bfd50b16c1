"""Metrics (keys, per-env split, detachment, RL-only) and input validation of echo_loss."""

from __future__ import annotations

import pytest
import torch
from _loss_batches import random_batch

from echoloss.loss import LossConfig, echo_loss, echo_loss_from_logprobs

F64 = torch.float64


def _run(b, **kw):
    args = {
        "rl_mask": b["rl_mask"],
        "echo_weights": b["echo_weights"],
        "advantages": b["advantages"],
        "inference_logprobs": b["inference_logprobs"],
        "temperature": b["temperature"],
        "sequence_ids": b["sequence_ids"],
        "observation_mask": b["observation_mask"],
    }
    args.update(kw)
    return echo_loss(b["logits"], b["labels"], **args)


def test_per_env_metrics_partition_the_all_metrics():
    b = random_batch(seq_lens=[5, 4, 6, 3], seed=21, envs=["math", "shell"])
    names = ["math", "shell", "math", "shell"]  # sequence id -> env (padding rows have id -1)
    out = _run(b, env_names=names)
    m = {k: v.item() for k, v in out.metrics.items()}
    envs = {k.split("/", 1)[1] for k in m}
    assert envs == {"all", "math", "shell"}
    for name in ("rl_tokens", "echo_tokens"):
        assert m[f"{name}/math"] + m[f"{name}/shell"] == m[f"{name}/all"]
    # Token-weighted per-env means recombine into the global mean.
    for name in ("entropy", "mismatch_kl", "masked_frac"):
        combined = sum(m[f"{name}/{e}"] * m[f"rl_tokens/{e}"] for e in ("math", "shell"))
        assert combined / m["rl_tokens/all"] == pytest.approx(m[f"{name}/all"], rel=1e-6)
    assert m["echo_nll_max/all"] == max(m["echo_nll_max/math"], m["echo_nll_max/shell"])
    assert "loss_rl/all" in m and "loss_rl/math" not in m
    for v in out.metrics.values():
        assert v.dim() == 0 and v.dtype == torch.float32 and not v.requires_grad


def test_metrics_values_by_hand():
    lp = torch.tensor([-0.1, -2.0, -0.5, -1.0], dtype=F64, requires_grad=True)
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=torch.tensor([True, False, False, True]),
        echo_weights=torch.tensor([0.0, 0.5, 1.0, 0.0], dtype=F64),
        advantages=torch.tensor([1.0, 0.0, 0.0, -1.0], dtype=F64),
        inference_logprobs=torch.tensor([-3.0, 0.0, 0.0, -1.0], dtype=F64),
        entropy=torch.tensor([1.0, 9.0, 9.0, 2.0], dtype=F64),
        sequence_ids=torch.tensor([0, 0, 1, 1]),
        env_names=["a", "b"],
    )
    m = {k: round(v.item(), 6) for k, v in out.metrics.items()}
    # Row 0: p - p_old = e^-0.1 - e^-3 ≈ 0.855 > 0.2 with A > 0: dropped high. Row 3: kept.
    assert (m["masked_frac/all"], m["masked_high_frac/all"], m["masked_low_frac/all"]) == (
        0.5,
        0.5,
        0,
    )
    assert (m["masked_frac/a"], m["masked_frac/b"]) == (1.0, 0.0)
    assert m["entropy/all"] == 1.5 and m["entropy/a"] == 1.0  # echo rows' 9.0 never enter
    assert (m["echo_nll_mean/all"], m["echo_nll_max/all"]) == (1.25, 2.0)
    assert (m["echo_nll_mean/a"], m["echo_nll_mean/b"]) == (2.0, 0.5)
    # mismatch KL (k3 of KL(π_inf ‖ π_θ)): row 0 ρ = 2.9 → e^2.9 - 3.9; row 3 ρ = 0 → 0.
    assert m["mismatch_kl/all"] == round((torch.tensor(2.9).exp().item() - 3.9) / 2, 6)


def test_env_all_is_reserved_and_names_are_checked():
    b = random_batch(seq_lens=[3, 3], seed=1)
    with pytest.raises(ValueError, match=r"env_names\[1\] = 'all' is reserved"):
        _run(b, env_names=["x", "all", ""])
    with pytest.raises(ValueError, match=r"env_names has length 1, expected 2"):
        _run(b, env_names=["x"])  # shorter: the second sequence would have no env
    with pytest.raises(ValueError, match=r"env_names has length 3, expected 2"):
        _run(b, env_names=["x", "y", "z"])  # longer: names would not match their sequences
    _run(b, env_names=["x", "y", ""])  # a trailing '' names a padding segment: allowed
    with pytest.raises(TypeError, match=r"env_names must be a list of str"):
        _run(b, env_names="x")
    with pytest.raises(ValueError, match=r"sequence_ids is required by env_names"):
        _run(b, env_names=["x", "y"], sequence_ids=None)


@pytest.mark.parametrize(
    ("override", "exc", "match"),
    [
        ({"rl_mask": torch.ones(7)}, TypeError, r"rl_mask must be a bool mask"),
        (
            {"echo_weights": torch.ones(6, dtype=F64)},
            ValueError,
            r"echo_weights must be of shape \[7\]",
        ),
        (
            {"echo_weights": torch.tensor([0, -1.0, 0, 0, 0, 0, 0], dtype=F64)},
            ValueError,
            r"echo_weights\[1\] must be a finite weight ≥ 0 .* got -1.0",
        ),
        (
            {"echo_weights": torch.tensor([0, float("nan"), 0, 0, 0, 0, 0], dtype=F64)},
            ValueError,
            r"echo_weights\[1\] must be a finite weight ≥ 0 .* got nan",
        ),
        ({"advantages": None}, ValueError, r"advantages is required in mode='rl'"),
        (
            {"advantages": torch.full((7,), float("nan"), dtype=F64)},
            ValueError,
            r"advantages must be finite on the rows that participate",
        ),
        (
            {"sequence_ids": torch.tensor([-1, -1, -1, 0, -1, -1, -1])},
            ValueError,
            r"sequence_ids\[0\] must be ≥ 0 on a row that participates",
        ),
        ({"config": {"policy": "dppo"}}, TypeError, r"config must be an echoloss.LossConfig"),
        ({"normalizers": 5}, TypeError, r"normalizers must be echoloss.Normalizers"),
    ],
)
def test_bad_inputs_raise_with_the_argument_name(override, exc, match):
    b = random_batch(seq_lens=[4, 2], seed=0, p_rl=0.6, p_echo=0.3)
    assert b["logits"].shape[0] == 7 and bool((b["rl_mask"] | (b["echo_weights"] > 0)).any())
    with pytest.raises(exc, match=match):
        _run(b, **override)


def test_placeholders_outside_participating_rows_are_never_read():
    b = random_batch(seq_lens=[5, 4], seed=2)
    base = _run(b)
    idle = ~(b["rl_mask"] | (b["echo_weights"] > 0))
    junk = {k: b[k].clone() for k in ("advantages", "inference_logprobs")}
    for t in junk.values():
        t[idle | (b["echo_weights"] > 0)] = float("nan")
    labels = b["labels"].clone()
    labels[idle] = -100
    out = echo_loss(
        b["logits"],
        labels,
        rl_mask=b["rl_mask"],
        echo_weights=b["echo_weights"],
        temperature=b["temperature"],
        sequence_ids=b["sequence_ids"],
        observation_mask=b["observation_mask"],
        **junk,
    )
    assert out.loss.item() == base.loss.item()


def test_config_validation():
    with pytest.raises(ValueError, match=r"dual_clip"):
        LossConfig(dual_clip=1.0)
    with pytest.raises(ValueError, match=r"eps_low=1.0 must be < 1"):
        LossConfig(policy="ppo_clip", eps_low=1.0)
    with pytest.raises(ValueError, match=r"must be finite"):
        LossConfig(entropy_coef=float("inf"))
    with pytest.raises(ValueError, match=r"extra_forbidden|Extra inputs"):
        LossConfig(lambda_=0.1)
    with pytest.raises(ValueError, match=r"cispo_min=2.0 must be ≤ cispo_max=1.0"):
        LossConfig(policy="cispo", cispo_max=1.0, cispo_min=2.0)
    with pytest.raises(
        ValueError,
        match=r"sapo_temperature_pos=2.0 is ignored by policy='dppo' .* a policy that reads it: "
        r"sapo, sapo_sequence",
    ):
        LossConfig(sapo_temperature_pos=2.0)
    with pytest.raises(ValueError, match=r"cispo_max=1.5 is ignored by policy='sapo'"):
        LossConfig(policy="sapo", cispo_max=1.5)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"sapo_temperature_neg\n  Input should be greater"):
            LossConfig(policy="sapo_sequence", sapo_temperature_neg=bad)
    assert LossConfig(policy="cispo_sequence", cispo_max=1.2).cispo_max == 1.2
    cfg = LossConfig(policy="gspo")
    assert cfg.resolved_eps == (3e-4, 4e-4) and cfg.resolved_kl_tau == 0.0
    assert LossConfig(kl_tau=0.0).resolved_kl_tau == 0.0
    with pytest.raises(ValueError, match=r"frozen"):
        cfg.policy = "dppo"  # type: ignore[misc]


def test_bf16_logits_give_fp32_loss_close_to_fp32_gold():
    b = random_batch(seq_lens=[6, 5], vocab=64, seed=3, dtype=torch.float32)
    x32 = b["logits"].clone().requires_grad_()
    out32 = echo_loss(
        x32,
        b["labels"],
        rl_mask=b["rl_mask"],
        echo_weights=b["echo_weights"],
        advantages=b["advantages"],
        inference_logprobs=b["inference_logprobs"],
        config=LossConfig(policy="ppo_clip"),
    )
    x16 = b["logits"].to(torch.bfloat16).requires_grad_()
    out16 = echo_loss(
        x16,
        b["labels"],
        rl_mask=b["rl_mask"],
        echo_weights=b["echo_weights"],
        advantages=b["advantages"],
        inference_logprobs=b["inference_logprobs"],
        config=LossConfig(policy="ppo_clip"),
    )
    assert out16.loss.dtype == torch.float32
    # Per token |Δlp| ≤ 2·2^-8·max|z| (bf16 input rounding, see test_selective_logprobs); the
    # loss is a mean of terms with |d loss / d lp| ≤ max(|A|·r, w) ≤ 4 here → bound 4·that.
    bound = 4 * 2 * 2**-8 * b["logits"].abs().max().item()
    assert abs(out16.loss.item() - out32.loss.item()) <= bound
    out16.loss.backward()
    out32.loss.backward()
    assert x16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x16.grad.float(), x32.grad, rtol=0.05, atol=2 * bound / 64)


@pytest.mark.parametrize("rho", [1e-6, -1e-6, 3e-5, -2e-4])
def test_small_log_ratio_kl_is_accurate_and_never_negative(rho):
    # exp(ρ) - ρ - 1 in fp32 cancels catastrophically for |ρ| ≲ 1e-3 (it read ≈ -1e-9 in the
    # trainer's plots); the true value ≈ ρ²/2 > 0. Both the mismatch-KL metric and the k3
    # reference-KL term must keep ≥ 3 significant digits there.
    lq = torch.tensor([-1.0, -2.0])
    lp = (lq + rho).requires_grad_()
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=torch.tensor([True, True]),
        advantages=torch.tensor([1.0, -1.0]),
        inference_logprobs=lq,
        ref_logprobs=lq,
        config=LossConfig(policy="reinforce", kl_coef=1.0, kl_estimator="k3"),
    )
    exact = (lp.detach().double() - lq.double()).expm1() - (lp.detach().double() - lq.double())
    assert float(out.metrics["mismatch_kl/all"]) == pytest.approx(float(exact.mean()), rel=1e-3)
    assert float(out.metrics["ref_kl/all"]) == pytest.approx(float(exact.mean()), rel=1e-3)


def _metric_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    rl = torch.rand(n, generator=g) < 0.6
    echo = ~rl & (torch.rand(n, generator=g) < 0.7)
    nll = torch.rand(n, generator=g) * 20.0  # [0, 20): NLLs of confident to very wrong tokens
    entropy = torch.rand(n, generator=g) * 5.0
    flag = torch.rand(n, generator=g) < 0.3
    return rl, echo, nll, entropy, flag


@pytest.mark.parametrize("n", [1, 7, 4099])
def test_metrics_without_envs_reduce_like_the_per_env_path(n):
    """Without envs the sums are one reduction over the rows (no atomics onto one slot); the
    per-env path with every row in no env (``env_of_row = -1``) gives the same keys in the same
    order. Counts are integers below 2^24, so exact; the sums only differ in fp32 summation
    order: each is within ``(n-1)·2^-24·Σ|x|`` of the exact sum, so two of them within twice
    that, i.e. ``2·n·2^-24`` of the mean of ``|x|`` after the (exact) count divides; maxima are
    order-free, so exact."""
    from echoloss.loss.metrics import loss_metrics

    rl, echo, nll, entropy, flag = _metric_rows(n, seed=n)
    common = dict(rl=rl, echo=echo, env_names=[], rl_means={"entropy": entropy},
                  rl_flags={"masked": flag}, echo_nll=nll, totals={"loss": torch.tensor(1.5)})  # fmt: skip
    fast = loss_metrics(env_of_row=None, **common)
    slots = loss_metrics(env_of_row=torch.full((n,), -1), **common)
    assert list(fast) == list(slots)
    for key in ("rl_tokens/all", "echo_tokens/all", "echo_nll_max/all", "loss/all"):
        assert torch.equal(fast[key], slots[key]), key
    bound = 2 * n * 2.0**-24
    for key, x, rows in (("echo_nll_mean/all", nll, echo), ("entropy/all", entropy, rl)):
        gold = x.double()[rows].mean() if rows.any() else torch.tensor(0.0, dtype=F64)
        tol = bound * float(gold.abs()) + 1e-30
        assert abs(float(fast[key]) - float(slots[key])) <= tol, key
        assert abs(float(fast[key]) - float(gold)) <= tol, key
    assert float(fast["masked_frac/all"]) == pytest.approx(
        float((flag & rl).sum()) / max(1, int(rl.sum())), rel=2.0**-23
    )
    for v in fast.values():
        assert v.dim() == 0 and v.dtype == torch.float32


def test_metrics_without_envs_on_no_rows_and_no_echo_rows():
    from echoloss.loss.metrics import loss_metrics

    empty = torch.zeros(0, dtype=torch.bool)
    m = loss_metrics(rl=empty, echo=empty, env_of_row=None, env_names=[], rl_means={},
                     rl_flags={}, echo_nll=torch.zeros(0), totals={})  # fmt: skip
    assert {k: float(v) for k, v in m.items()} == dict.fromkeys(
        ["rl_tokens/all", "echo_tokens/all", "echo_nll_mean/all", "echo_nll_max/all"], 0.0
    )
    rl = torch.tensor([True, True])
    m = loss_metrics(rl=rl, echo=~rl, env_of_row=None, env_names=[], rl_means={}, rl_flags={},
                     echo_nll=torch.tensor([3.0, 4.0]), totals={})  # fmt: skip
    assert (float(m["echo_nll_max/all"]), float(m["rl_tokens/all"])) == (0.0, 2.0)
