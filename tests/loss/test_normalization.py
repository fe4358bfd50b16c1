"""Normalisation modes (hand-computed), gradient accumulation with global normalisers, helpers."""

from __future__ import annotations

import itertools

import pytest
import torch
from _loss_batches import random_batch, split_by_sequence

from echoloss.loss import (
    LossConfig,
    Normalizers,
    all_reduce_normalizers,
    count_normalizers,
    echo_loss,
    echo_loss_from_logprobs,
    undo_data_parallel_averaging,
)
from echoloss.ops.row_algebra.contract import SEQUENCE_RATIO_POLICIES

F64 = torch.float64

# Two sequences. Row kinds: R = RL, E = echo, W = warning (observation, not echoed), - = nothing.
#   seq 0: R(A=1, lp=-1)  R(A=1, lp=-2)  E(w=.5, lp=-.5)  W(lp=-9)  E(w=.5, lp=-1.5)
#   seq 1: R(A=-.5, lp=-2)  E(w=1, lp=-.25)  -(padding, seq -1)
# With reinforce (ℓ = -A·lp): RL per token [1, 2 | -1]; echo per token w·nll [.25, .75 | .25].
HAND = {
    "lp": [-1.0, -2.0, -0.5, -9.0, -1.5, -2.0, -0.25, -7.0],
    "rl": [True, True, False, False, False, True, False, False],
    "w": [0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 1.0, 0.0],
    "obs": [False, False, True, True, True, False, True, False],
    "adv": [1.0, 1.0, 0.0, 0.0, 0.0, -0.5, 0.0, 0.0],
    "seq": [0, 0, 0, 0, 0, 1, 1, -1],
}

RL_EXPECTED = {
    "token_mean": (1 + 2 - 1) / 3,
    "sequence_mean_token_mean": ((1 + 2) / 2 + (-1) / 1) / 2,  # 0.25
    "sequence_mean_token_sum": ((1 + 2) + (-1)) / 2,  # 1.0
    "token_sum_constant": (1 + 2 - 1) / 8,  # C = 8
}
ECHO_EXPECTED = {
    "token_mean": (0.25 + 0.75 + 0.25) / 3,
    # Z_0 = |O_0| = 2 echo + 1 warning = 3; Z_1 = 1; mean over the S = 2 sequences.
    "sequence_mean": ((0.25 + 0.75) / 3 + 0.25 / 1) / 2,  # 7/24
    "batch_token_mean": (0.25 + 0.75 + 0.25) / 3,  # one micro-batch: its own mean
    "sum": 0.25 + 0.75 + 0.25,
}


def _hand(config, **kw):
    t = {k: torch.tensor(v) for k, v in HAND.items()}
    return echo_loss_from_logprobs(
        t["lp"].to(F64),
        rl_mask=t["rl"],
        echo_weights=t["w"].to(F64),
        advantages=t["adv"].to(F64),
        observation_mask=t["obs"],
        sequence_ids=t["seq"],
        config=config,
        **kw,
    )


@pytest.mark.parametrize(("rl_mode", "echo_mode"), itertools.product(RL_EXPECTED, ECHO_EXPECTED))
def test_hand_computed_modes(rl_mode, echo_mode):
    cfg = LossConfig(
        policy="reinforce",
        rl_normalization=rl_mode,
        rl_normalization_constant=8.0 if rl_mode == "token_sum_constant" else None,
        echo_normalization=echo_mode,
    )
    out = _hand(cfg)
    want = RL_EXPECTED[rl_mode] + ECHO_EXPECTED[echo_mode]
    assert out.loss.item() == pytest.approx(want, rel=1e-15, abs=1e-16)


def test_sequence_mean_matches_the_papers_formula_with_epsilon():
    # echo-rl: Σ_i Σ_t -lp·mask / (Z_i + 1e-3) / len(batch)
    out = _hand(
        LossConfig(policy="reinforce", echo_normalization="sequence_mean", echo_z_epsilon=1e-3)
    )
    want = (1 + 2 - 1) / 3 + ((0.25 + 0.75) / 3.001 + 0.25 / 1.001) / 2
    assert out.loss.item() == pytest.approx(want, rel=1e-15)


def test_warnings_count_in_z_but_are_not_trained():
    # Dropping the warning row from observation_mask changes Z_0 from 3 to 2.
    obs = torch.tensor(HAND["obs"])
    obs[3] = False
    out = _hand(
        LossConfig(policy="reinforce", echo_normalization="sequence_mean"),
    )
    out2 = echo_loss_from_logprobs(
        torch.tensor(HAND["lp"], dtype=F64),
        rl_mask=torch.tensor(HAND["rl"]),
        echo_weights=torch.tensor(HAND["w"], dtype=F64),
        advantages=torch.tensor(HAND["adv"], dtype=F64),
        observation_mask=obs,
        sequence_ids=torch.tensor(HAND["seq"]),
        config=LossConfig(policy="reinforce", echo_normalization="sequence_mean"),
    )
    assert out.metrics["loss_echo/all"].item() == pytest.approx(7 / 24, rel=1e-7)
    assert out2.metrics["loss_echo/all"].item() == pytest.approx(
        ((0.25 + 0.75) / 2 + 0.25) / 2, rel=1e-7
    )
    # Echo rows missing from observation_mask still count in Z (Z_i ≥ |O'_i| always).
    out3 = echo_loss_from_logprobs(
        torch.tensor(HAND["lp"], dtype=F64),
        rl_mask=torch.tensor(HAND["rl"]),
        echo_weights=torch.tensor(HAND["w"], dtype=F64),
        advantages=torch.tensor(HAND["adv"], dtype=F64),
        observation_mask=torch.zeros(8, dtype=torch.bool),
        sequence_ids=torch.tensor(HAND["seq"]),
        config=LossConfig(policy="reinforce", echo_normalization="sequence_mean"),
    )
    assert out3.metrics["loss_echo/all"].item() == pytest.approx(
        out2.metrics["loss_echo/all"].item()
    )


def test_lambda_conversion_equal_lengths_no_warnings():
    # docs/normalization.md: with every sequence holding the same number Z of observation
    # tokens, all echoed (no warnings), token_mean with weight λ equals the paper's sequence_mean
    # with weight λ; batch_token_mean too (one micro-batch); sum needs λ / (S·Z).
    g = torch.Generator().manual_seed(0)
    s, z = 3, 4
    lp = -torch.rand(s * z, generator=g, dtype=F64)
    kw = {
        "rl_mask": torch.zeros(s * z, dtype=torch.bool),
        "observation_mask": torch.ones(s * z, dtype=torch.bool),
        "sequence_ids": torch.arange(s).repeat_interleave(z),
        "advantages": torch.zeros(s * z, dtype=F64),
    }
    lam = 0.05

    def loss(mode, w):
        cfg = LossConfig(echo_normalization=mode)
        return echo_loss_from_logprobs(
            lp, echo_weights=torch.full((s * z,), w, dtype=F64), config=cfg, **kw
        ).loss.item()

    paper = loss("sequence_mean", lam)
    assert loss("token_mean", lam) == pytest.approx(paper, rel=1e-14)
    assert loss("batch_token_mean", lam) == pytest.approx(paper, rel=1e-14)
    assert loss("sum", lam / (s * z)) == pytest.approx(paper, rel=1e-14)


def test_lambda_conversion_per_sequence_weights_reproduce_the_paper_exactly():
    # Unequal lengths + warnings: token_mean reproduces the paper exactly with per-sequence
    # weights w_i = λ · N_echo / (S · Z_i) (the table's exact column).
    t = {k: torch.tensor(v) for k, v in HAND.items()}
    lam = 0.05
    n_echo, s_count = 3, 2
    z = torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0], dtype=F64)
    w = torch.where(t["w"] > 0, lam * n_echo / (s_count * z), 0.0)
    w_paper = torch.where(t["w"] > 0, torch.tensor(lam, dtype=F64), 0.0)

    def run(mode, weights):
        return echo_loss_from_logprobs(
            t["lp"].to(F64),
            rl_mask=torch.zeros(8, dtype=torch.bool),
            echo_weights=weights,
            advantages=torch.zeros(8, dtype=F64),
            observation_mask=t["obs"],
            sequence_ids=t["seq"],
            config=LossConfig(echo_normalization=mode),
        ).loss.item()

    assert run("token_mean", w) == pytest.approx(run("sequence_mean", w_paper), rel=1e-14)


# ------------------------------------------------------------------ gradient accumulation


def _call(mb, cfg, normalizers, logits):
    return echo_loss(
        logits,
        mb["labels"],
        rl_mask=mb["rl_mask"],
        echo_weights=mb["echo_weights"],
        advantages=mb["advantages"],
        inference_logprobs=mb["inference_logprobs"],
        temperature=mb["temperature"],
        sequence_ids=mb["sequence_ids"],
        observation_mask=mb["observation_mask"],
        env_names=mb["env_names"],
        config=cfg,
        normalizers=normalizers,
    )


GA_POLICIES = ["dppo", "ppo_clip", "gspo"]
GA_RL = ["token_mean", "sequence_mean_token_mean", "sequence_mean_token_sum", "token_sum_constant"]
GA_ECHO = ["token_mean", "sequence_mean", "sum"]


@pytest.mark.parametrize("policy", GA_POLICIES)
def test_micro_batches_with_global_normalizers_equal_one_call(policy):
    batch = random_batch(seq_lens=[5, 3, 6, 2, 4], vocab=9, seed=7)
    groups = [[0, 3], [1], [2, 4]]  # unequal token counts per micro-batch
    mbs = split_by_sequence(batch, groups)
    norms = sum(
        (
            count_normalizers(
                rl_mask=m["rl_mask"], echo_weights=m["echo_weights"], sequence_ids=m["sequence_ids"]
            )
            for m in mbs
        ),
        Normalizers(),
    )
    whole_rows = torch.cat(
        [(batch["sequence_ids"] == s).nonzero().squeeze(1) for g in groups for s in g]
    )
    for rl_mode, echo_mode in itertools.product(GA_RL, GA_ECHO):
        cfg = LossConfig(
            policy=policy,
            rl_normalization=rl_mode,
            rl_normalization_constant=11.0,
            echo_normalization=echo_mode,
        )
        x = batch["logits"].clone().requires_grad_()
        whole = _call(batch, cfg, None, x)
        whole.loss.backward()
        total = 0.0
        grads = torch.zeros_like(x)
        for m, group in zip(mbs, groups, strict=True):
            xm = m["logits"].clone().requires_grad_()
            out = _call(m, cfg, norms, xm)
            out.loss.backward()
            total += out.loss.item()
            rows = torch.cat([(batch["sequence_ids"] == s).nonzero().squeeze(1) for s in group])
            grads[rows] += xm.grad
        assert total == pytest.approx(whole.loss.item(), rel=1e-12, abs=1e-14), (rl_mode, echo_mode)
        torch.testing.assert_close(grads[whole_rows], x.grad[whole_rows], rtol=1e-10, atol=1e-14)


def test_batch_token_mean_is_the_mean_of_micro_batch_means():
    batch = random_batch(seq_lens=[5, 3, 6, 2], vocab=9, seed=8)
    mbs = split_by_sequence(batch, [[0], [1, 2], [3]])
    cfg = LossConfig(echo_normalization="batch_token_mean", policy="reinforce")
    counts = [count_normalizers(rl_mask=m["rl_mask"], echo_weights=m["echo_weights"]) for m in mbs]
    norms = sum(counts, Normalizers())
    assert norms.echo_batches == sum(c.echo_tokens > 0 for c in counts) >= 2
    got = sum(_call(m, cfg, norms, m["logits"]).metrics["loss_echo/all"].item() for m in mbs)
    own = [_call(m, cfg, None, m["logits"]).metrics["loss_echo/all"].item() for m in mbs]
    want = sum(own) / norms.echo_batches
    assert got == pytest.approx(want, rel=1e-6)


def test_batch_token_mean_counts_only_micro_batches_with_echo_rows():
    """A micro-batch without an echo row is no batch of the echo mean: of four micro-batches,
    two echo-free (sequence 3's echo weights zeroed, sequence 1 has none), the echo term is
    the mean of the other two's own means, counted by hand here (a count of every micro-batch
    would divide by 4)."""
    batch = random_batch(seq_lens=[5, 3, 6, 2], vocab=9, seed=8)
    batch["echo_weights"] = torch.where(batch["sequence_ids"] == 3, 0.0, batch["echo_weights"])
    mbs = split_by_sequence(batch, [[0], [1], [2], [3]])
    with_echo = [m for m in mbs if bool((m["echo_weights"] > 0).any())]
    assert len(mbs) == 4 and len(with_echo) == 2
    cfg = LossConfig(echo_normalization="batch_token_mean", policy="reinforce")
    norms = sum(
        (count_normalizers(rl_mask=m["rl_mask"], echo_weights=m["echo_weights"]) for m in mbs),
        Normalizers(),
    )
    got = sum(_call(m, cfg, norms, m["logits"]).metrics["loss_echo/all"].item() for m in mbs)
    own = [_call(m, cfg, None, m["logits"]).metrics["loss_echo/all"].item() for m in with_echo]
    assert got == pytest.approx(sum(own) / 2, rel=1e-12)


def test_per_call_local_normalizers_are_biased():
    # The bug docs/spec.md F14 guards against, at micro-batch level: per-call denominators overweight
    # micro-batches with few tokens.
    batch = random_batch(seq_lens=[8, 2], vocab=9, seed=9)
    mbs = split_by_sequence(batch, [[0], [1]])
    cfg = LossConfig(policy="reinforce")
    local = sum(_call(m, cfg, None, m["logits"]).loss.item() for m in mbs) / 2
    whole = _call(batch, cfg, None, batch["logits"]).loss.item()
    assert abs(local - whole) > 1e-3


# ------------------------------------------------------------------ helpers and guards


def test_normalizers_arithmetic_and_tensor_round_trip():
    a = Normalizers(rl_tokens=3, echo_tokens=2, sequences=1, echo_batches=1, echo_sequences=1)
    b = Normalizers(rl_tokens=1, sequences=2, rl_sequences=2)
    assert a + b == Normalizers(4, 2, 3, 1, 2, 1)
    assert sum([a, b]) == a + b
    assert Normalizers.from_tensor(a.as_tensor()) == a
    assert all_reduce_normalizers(a) == a  # not distributed: unchanged
    with pytest.raises(
        ValueError, match=r"Normalizers.rl_tokens must be an int in \[0, \d+\] .*, got int -1"
    ):
        Normalizers(rl_tokens=-1)
    with pytest.raises(TypeError, match=r"normalizers must be echoloss.Normalizers"):
        all_reduce_normalizers({"rl_tokens": 1})


def test_count_normalizers_matches_the_loss():
    b = random_batch(seq_lens=[5, 4], seed=4)
    n = count_normalizers(
        rl_mask=b["rl_mask"], echo_weights=b["echo_weights"], sequence_ids=b["sequence_ids"]
    )
    out = _call(b, LossConfig(), None, b["logits"])
    assert n.rl_tokens == out.metrics["rl_tokens/all"].item()
    assert n.echo_tokens == out.metrics["echo_tokens/all"].item()
    assert n.sequences == 2 and n.echo_batches == 1
    assert (n.rl_sequences, n.echo_sequences) == (2, 2)
    with pytest.raises(
        ValueError, match=r"sequence_ids\[0\] must be ≥ 0 on a row that participates"
    ):
        count_normalizers(rl_mask=torch.tensor([True]), sequence_ids=torch.tensor([-1]))


@pytest.mark.parametrize(
    ("config", "norms", "match"),
    [
        (
            LossConfig(),
            Normalizers(rl_tokens=1, echo_tokens=100),
            r"normalizers.rl_tokens=1 is smaller",
        ),
        (LossConfig(), Normalizers(rl_tokens=100, echo_tokens=0), r"normalizers.echo_tokens=0"),
        (
            LossConfig(rl_normalization="sequence_mean_token_mean"),
            Normalizers(rl_tokens=100, echo_tokens=100),
            r"normalizers.rl_sequences=0 .*count_normalizers needs sequence_ids",
        ),
        (
            LossConfig(echo_normalization="batch_token_mean"),
            Normalizers(rl_tokens=100, echo_tokens=100),
            r"normalizers.echo_batches=0",
        ),
    ],
)
def test_inconsistent_normalizers_are_rejected(config, norms, match):
    with pytest.raises(ValueError, match=match):
        _hand(config.model_copy(update={"policy": "reinforce"}), normalizers=norms)


def test_missing_inputs_for_a_mode_are_named():
    lp = torch.tensor([-1.0, -2.0], dtype=F64)
    kw = {
        "rl_mask": torch.tensor([True, False]),
        "echo_weights": torch.tensor([0.0, 1.0], dtype=F64),
        "advantages": torch.tensor([1.0, 0.0], dtype=F64),
    }
    with pytest.raises(
        ValueError, match=r"observation_mask is required by echo_normalization='sequence_mean'"
    ):
        echo_loss_from_logprobs(
            lp,
            config=LossConfig(policy="reinforce", echo_normalization="sequence_mean"),
            sequence_ids=torch.tensor([0, 0]),
            **kw,
        )
    with pytest.raises(
        ValueError, match=r"sequence_ids is required by rl_normalization='sequence_mean_token_sum'"
    ):
        echo_loss_from_logprobs(
            lp,
            config=LossConfig(policy="reinforce", rl_normalization="sequence_mean_token_sum"),
            **kw,
        )
    for policy in SEQUENCE_RATIO_POLICIES:
        with pytest.raises(ValueError, match=rf"sequence_ids is required by policy='{policy}'"):
            echo_loss_from_logprobs(
                lp, config=LossConfig(policy=policy), inference_logprobs=lp, **kw
            )
    with pytest.raises(ValueError, match=r"inference_logprobs is required by policy='dppo'"):
        echo_loss_from_logprobs(lp, **kw)
    with pytest.raises(ValueError, match=r"ref_logprobs is required by kl_coef=0.1"):
        echo_loss_from_logprobs(lp, config=LossConfig(policy="reinforce", kl_coef=0.1), **kw)
    with pytest.raises(ValueError, match=r"entropy is required by entropy_coef"):
        echo_loss_from_logprobs(lp, config=LossConfig(policy="reinforce", entropy_coef=0.1), **kw)
    with pytest.raises(ValueError, match=r"needs rl_normalization_constant"):
        LossConfig(rl_normalization="token_sum_constant")


def test_undo_data_parallel_averaging():
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(2))  # no gradient: skipped
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    undo_data_parallel_averaging([p, q], 2)
    assert p.grad.tolist() == [2.0, 4.0, 6.0] and q.grad is None
    with pytest.raises(ValueError, match=r"world_size must be an int ≥ 1"):
        undo_data_parallel_averaging([p], 0)


def test_observation_rows_outside_any_trained_sequence_do_not_count():
    # An observation row on a padding row (sequence id -1) must not land in another sequence's
    # Z: indexing with -1 would wrap to the last sequence (Z_1 = 2, echo term 5/24 + ...).
    t = {k: torch.tensor(v) for k, v in HAND.items()}
    obs = t["obs"].clone()
    obs[7] = True  # the padding row
    out = echo_loss_from_logprobs(
        t["lp"].to(F64),
        rl_mask=t["rl"],
        echo_weights=t["w"].to(F64),
        advantages=t["adv"].to(F64),
        observation_mask=obs,
        sequence_ids=t["seq"],
        config=LossConfig(policy="reinforce", echo_normalization="sequence_mean"),
    )
    assert out.metrics["loss_echo/all"].item() == pytest.approx(7 / 24, rel=1e-7)
