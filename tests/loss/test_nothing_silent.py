"""Bad input is a clear error, never a silent result: non-finite logits / hidden states / policy
outputs / entropy (found in O(N) and named by row), impossible log-probabilities, wrong
temperature types, inconsistent counts; and the numerics at extreme logits and temperatures."""

from __future__ import annotations

import pytest
import torch

from echoloss import (
    LossConfig,
    LossInputs,
    Normalizers,
    PolicyOutput,
    count_normalizers,
    echo_loss,
    echo_loss_from_hidden,
    echo_loss_from_logprobs,
    selective_logprobs,
)
from echoloss.loss.inputs import LOGPROB_TOLERANCE

F64 = torch.float64


def _batch(n=6, v=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g).to(dtype)
    x = LossInputs(
        labels=torch.randint(0, v, (n,), generator=g),
        rl_mask=torch.tensor([True, True, False, True, False, False])[:n],
        echo_weights=torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0])[:n],
        advantages=torch.randn(n, generator=g),
        inference_logprobs=-torch.rand(n, generator=g),
    )
    return logits, x


# ---------------------------------------------------------------- non-finite, O(N), named by row


@pytest.mark.parametrize(
    ("poison", "row"),
    [("nan", 1), ("+inf", 3), ("-inf at label", 2)],
)
def test_non_finite_logits_on_a_participating_row_name_the_row(poison, row):
    logits, x = _batch()
    if poison == "nan":
        logits[row, 0] = float("nan")
    elif poison == "+inf":
        logits[row, 4] = float("inf")
    else:
        logits[row, x.labels[row]] = float("-inf")
    kind = "an echo" if row == 2 else "an RL"
    with pytest.raises(
        ValueError, match=rf"logits row {row} must be a finite log-probability on {kind} row"
    ):
        echo_loss(logits, x)
    # switched off: the caller asked for speed, the result is what it is
    out = echo_loss(logits, x, config=LossConfig(check_finite=False))
    assert not torch.isfinite(out.loss)


def test_non_finite_logits_elsewhere_are_fine():
    logits, x = _batch()
    logits[4, 0] = float("nan")  # row 4 takes part in no term: never read
    other = int((x.labels[0] + 1) % 5)
    logits[0, other] = float("-inf")  # a masked-out token: a legal -inf, not at the label
    out = echo_loss(logits, x)
    assert torch.isfinite(out.loss)


def test_nan_hidden_state_names_the_row():
    logits, x = _batch()
    hidden = logits.clone()
    hidden[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"hidden row 3 must be a finite log-probability"):
        echo_loss_from_hidden(hidden, torch.eye(5), x)


def test_non_finite_custom_policy_output_is_named():
    logits, x = _batch()

    def broken(inputs, config):
        loss = -(inputs.advantages * inputs.logprobs)
        return PolicyOutput(loss / torch.where(loss > 1e9, loss, 0.0), {})  # 0/0 = NaN

    cfg = LossConfig(policy="custom", allow_echo_with_custom_policy=True)
    with pytest.raises(ValueError, match=r"the loss of policy 'custom' at row 0 must be finite"):
        echo_loss(logits, x, config=cfg, policy_fn=broken)


def test_non_finite_entropy_with_entropy_coef_is_named():
    lp = torch.tensor([-0.5, -1.0], requires_grad=True)
    x = LossInputs(rl_mask=torch.tensor([True, True]), advantages=torch.ones(2))
    ent = torch.tensor([1.0, float("inf")])
    cfg = LossConfig(policy="reinforce", entropy_coef=0.1)
    with pytest.raises(ValueError, match=r"entropy\[1\] must be a finite entropy"):
        echo_loss_from_logprobs(lp, x, entropy=ent, config=cfg)


def test_non_finite_logprobs_are_named():
    lp = torch.tensor([-0.5, float("nan")])
    x = LossInputs(rl_mask=torch.tensor([True, True]), advantages=torch.ones(2))
    with pytest.raises(ValueError, match=r"logprobs row 1 must be a finite log-probability"):
        echo_loss_from_logprobs(lp, x, config=LossConfig(policy="reinforce"))


# ---------------------------------------------------------------- impossible log-probabilities


#: The record's log-probability fields, from its declarations (`_token(..., logprob=True)`).
LOGPROB_FIELDS = [f.name for f in LossInputs.per_token_fields() if f.metadata["logprob"]]


@pytest.mark.parametrize("name", LOGPROB_FIELDS)
def test_positive_logprobs_on_rl_rows_are_refused(name):
    good = torch.tensor([-0.3, -0.2, 0.7])  # 0.7 on a row that is not RL: a placeholder
    rl = torch.tensor([True, True, False])
    LossInputs(rl_mask=rl, **{name: good})
    LossInputs(rl_mask=rl, **{name: torch.tensor([-0.3, LOGPROB_TOLERANCE, 0.0])})  # rounding
    with pytest.raises(ValueError, match=rf"{name}\[1\] must be a log-probability ≤ 0.*got 0.2"):
        LossInputs(rl_mask=rl, **{name: torch.tensor([-0.3, 0.2, 0.0])})


# ---------------------------------------------------------------- types


@pytest.mark.parametrize(
    ("temperature", "exc", "match"),
    [
        ("abc", TypeError, r"temperature must be a positive float .* got str 'abc'"),
        (True, TypeError, r"temperature must be a positive float .* got bool True"),
        ([0.7], TypeError, r"temperature must be a positive float .* got list"),
        (float("nan"), ValueError, r"temperature must be a positive finite number, got nan"),
        (torch.tensor([1, 1, 1, 1, 1, 1]), TypeError, r"temperature must be a positive float"),
    ],
)
def test_wrong_temperatures_are_clear_errors(temperature, exc, match):
    logits, x = _batch()
    with pytest.raises(exc, match=match):
        x.replace(temperature=temperature)
    kw = {f: getattr(x, f) for f in ("labels", "rl_mask", "echo_weights", "advantages")}
    with pytest.raises(exc, match=match):
        echo_loss(logits, temperature=temperature, inference_logprobs=x.inference_logprobs, **kw)


def test_record_and_keywords_do_not_mix():
    logits, x = _batch()
    with pytest.raises(TypeError, match=r"per-token keywords must be absent .* got advantages"):
        echo_loss(logits, x, advantages=x.advantages)
    with pytest.raises(TypeError, match=r"inputs must be an echoloss.LossInputs record"):
        echo_loss(logits, {"rl_mask": x.rl_mask})


def test_scalar_fp64_temperature_stays_fp64_next_to_echo_rows():
    """An echo row turns the scalar temperature into a per-row tensor: it must keep every digit
    of the Python float (0.7 rounded to fp32 moves z / T by ~1e-8·|z|, far above fp64's 1e-16)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, generator=g, dtype=F64) * 3
    x = LossInputs(
        labels=torch.tensor([1, 2, 3, 4]),
        rl_mask=torch.tensor([True, False, True, False]),
        echo_weights=torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=F64),
        advantages=torch.tensor([1.0, 0.0, -2.0, 0.0], dtype=F64),
        temperature=0.7,
    )
    out = echo_loss(logits, x, config=LossConfig(policy="reinforce"))
    temps = torch.tensor([0.7, 1.0, 0.7, 1.0], dtype=F64)
    lp = torch.log_softmax(logits / temps[:, None], -1).gather(1, x.labels[:, None]).squeeze(1)
    expected = (-(x.advantages * lp)[x.rl]).sum() / 2 - lp[1]
    torch.testing.assert_close(out.loss, expected, rtol=1e-14, atol=0.0)


# ---------------------------------------------------------------- counts


@pytest.mark.parametrize("bad", [float("nan"), -0.5])
def test_count_normalizers_rejects_what_the_loss_rejects(bad):
    ew = torch.tensor([0.0, bad, 0.5])
    with pytest.raises(ValueError, match=r"echo_weights\[1\] must be a finite weight ≥ 0"):
        count_normalizers(rl_mask=torch.tensor([True, False, False]), echo_weights=ew)
    with pytest.raises(ValueError, match=r"echo_weights\[1\] must be a finite weight ≥ 0"):
        LossInputs(rl_mask=torch.tensor([True, False, False]), echo_weights=ew)


def test_sequence_means_count_sequences_per_term():
    """Sequence 0 trains only RL rows, sequence 1 only echo rows: each term divides by the
    sequences it trains (1 and 1), so the echo-only sequence does not halve the RL term.

    RL (reinforce, sequence_mean_token_mean): (−1·−0.5 + −2·−1.0) / 2 rows / 1 sequence = 1.25.
    Echo (sequence_mean, Z_1 = 3 observation rows): (0.5·0.2 + 1.0·0.4) / 3 / 1 sequence = 1/6.
    """
    lp = torch.tensor([-0.5, -1.0, -0.2, -0.4, -0.9], dtype=F64, requires_grad=True)
    x = LossInputs(
        rl_mask=torch.tensor([True, True, False, False, False]),
        echo_weights=torch.tensor([0.0, 0.0, 0.5, 1.0, 0.0], dtype=F64),
        advantages=torch.tensor([1.0, 2.0, 0.0, 0.0, 0.0], dtype=F64),
        sequence_ids=torch.tensor([0, 0, 1, 1, 1]),
        observation_mask=torch.tensor([False, False, True, True, True]),
    )
    cfg = LossConfig(
        policy="reinforce",
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
    )
    out = echo_loss_from_logprobs(lp, x, config=cfg)
    # the loss is fp64 here; the metrics are fp32 by contract (one fp32 rounding: 6e-8)
    assert out.loss.item() == pytest.approx(1.25 + 0.5 / 3, rel=1e-15)
    assert out.metrics["loss_rl/all"].item() == pytest.approx(1.25, rel=1e-7)
    assert out.metrics["loss_echo/all"].item() == pytest.approx(0.5 / 3, rel=1e-7)
    (g,) = torch.autograd.grad(out.loss, lp)
    expected = torch.tensor([-1 / 2, -2 / 2, -0.5 / 3, -1.0 / 3, 0.0], dtype=F64)
    torch.testing.assert_close(g, expected, rtol=1e-15, atol=0.0)
    n = count_normalizers(
        rl_mask=x.rl_mask, echo_weights=x.echo_weights, sequence_ids=x.sequence_ids
    )
    assert (n.sequences, n.rl_sequences, n.echo_sequences) == (2, 1, 1)
    # the same with explicit global counts: sequence_mean_token_sum divides by rl_sequences
    cfg_sum = cfg.model_copy(update={"rl_normalization": "sequence_mean_token_sum"})
    out = echo_loss_from_logprobs(
        lp, x, config=cfg_sum, normalizers=n + Normalizers(rl_sequences=1, echo_sequences=1)
    )
    assert out.loss.item() == pytest.approx(2.5 / 2 + 0.5 / 3 / 2, rel=1e-15)


# ---------------------------------------------------------------- policy parameters


def test_a_parameter_the_policy_ignores_is_refused():
    with pytest.raises(ValueError, match=r"eps_high=0.3 is ignored by policy='dppo'.*ppo_clip"):
        LossConfig(policy="dppo", eps_high=0.3)
    with pytest.raises(ValueError, match=r"dppo_low=0.1 is ignored by policy='ppo_clip'"):
        LossConfig(policy="ppo_clip", dppo_low=0.1)
    with pytest.raises(ValueError, match=r"cispo_max=2.0 is ignored by policy='reinforce'"):
        LossConfig(policy="reinforce", cispo_max=2.0)
    # the defaults, and a dump/load round trip, are fine
    cfg = LossConfig(policy="gspo", eps_low=1e-3)
    assert LossConfig(**cfg.model_dump()) == cfg
    with pytest.raises(ValueError, match=r"policy must be one of .* got 'dppo2'"):
        LossConfig(policy="dppo2")


# ---------------------------------------------------------------- numerics at extreme scales


def _gold_grad(z, labels, inv_t, a, b):
    zz = z.double().requires_grad_()
    lsm = torch.log_softmax(zz * inv_t, -1)
    lp = lsm.gather(1, labels[:, None]).squeeze(1)
    ent = -(lsm.exp() * lsm).sum(-1)
    (g,) = torch.autograd.grad((a * lp + b * ent).sum(), zz)
    return g


@pytest.mark.parametrize(
    ("offset", "spread", "temperature"),
    [(1e6, 2.0, 1.0), (-1e6, 2.0, 1.0), (1e3, 2e-3, 1e-3), (5e3, 1e-2, 5e-3), (3.0, 1.0, 1.0)],
    ids=["z=1e6", "z=-1e6", "z/T=1e6", "z/T=1e6,T=5e-3", "small"],
)
def test_reference_gradient_matches_fp64_at_extreme_logits(offset, spread, temperature):
    """fp32 logits with |z / T| up to 1e6: the logits gradient (through logprob and entropy)
    matches the fp64 gradient of the same fp32 values to 1e-6 of its largest entry. (The
    statistics are (row max, log-sum of the shifted exponentials): no fp32 quantity of size
    |z / T| is ever subtracted.)"""
    g = torch.Generator().manual_seed(7)
    n, v = 8, 97
    z = (offset + spread * torch.randn(n, v, generator=g, dtype=F64)).float()
    labels = torch.randint(0, v, (n,), generator=g)
    a = torch.randn(n, generator=g, dtype=F64)
    b = torch.randn(n, generator=g, dtype=F64) * 0.1
    zz = z.clone().requires_grad_()
    lp, ent = selective_logprobs(
        zz, labels, temperature=temperature, return_entropy=True, backend="reference", chunk_size=3
    )
    (grad,) = torch.autograd.grad((a.float() * lp + b.float() * ent).sum(), zz)
    gold = _gold_grad(z, labels, 1.0 / temperature, a, b)
    err = (grad.double() - gold).abs().max() / gold.abs().max()
    assert err <= 1e-6, float(err)


def test_fp16_logits_at_extreme_temperature_with_kl_tau_give_finite_gradients():
    """fp16 logits of ±1e4 at T = 1e-3: logprobs near -2e7, so the log ratio to the inference
    logprobs is ~-2e7 and kl_tau·ρ² would have a gradient 2·kl_tau·ρ/T ≈ 4e7 per token, past
    fp16's 65504. Beyond ``log_ratio_clamp`` the penalty grows linearly (bounded gradient)."""
    g = torch.Generator().manual_seed(2)
    n, v = 8, 33
    signs = torch.randint(0, 2, (n, v), generator=g) * 2 - 1
    logits = (signs * 1e4).to(torch.float16).requires_grad_()
    x = LossInputs(
        labels=torch.randint(0, v, (n,), generator=g),
        rl_mask=torch.ones(n, dtype=torch.bool),
        advantages=torch.randn(n, generator=g),
        inference_logprobs=torch.full((n,), -1.0),
        temperature=1e-3,
    )
    out = echo_loss(logits, x, config=LossConfig(policy="dppo"))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_huge_sequence_ids_allocate_nothing_id_sized():
    """Sequence ids are renumbered locally (unique), never used to size a table: ids near 1e12
    (8 TB as an int64 table) work and give the same loss as ids 0 and 1."""
    lp = torch.tensor([-0.5, -1.0, -2.0], dtype=F64)
    cfg = LossConfig(policy="reinforce", rl_normalization="sequence_mean_token_mean")
    losses = []
    for ids in ([0, 0, 1], [10**12, 10**12, 10**12 + 7]):
        x = LossInputs(
            rl_mask=torch.ones(3, dtype=torch.bool),
            advantages=torch.ones(3, dtype=F64),
            sequence_ids=torch.tensor(ids),
        )
        losses.append(echo_loss_from_logprobs(lp, x, config=cfg).loss.item())
    # (mean(0.5, 1.0) + 2.0) / 2 sequences
    assert losses == [pytest.approx((0.75 + 2.0) / 2, rel=1e-15)] * 2


def test_non_finite_policy_output_names_the_first_bad_row_not_row_0():
    # Rows 2 and 3 of the policy's per-token loss are NaN: the message names row 2, the first.
    lp = torch.tensor([-0.5, -1.0, -1.5, -2.0], requires_grad=True)
    x = LossInputs(rl_mask=torch.ones(4, dtype=torch.bool), advantages=torch.ones(4))

    def broken(inputs, config):
        bad = torch.tensor([0.0, 0.0, float("nan"), float("nan")])
        return PolicyOutput(-(inputs.advantages * inputs.logprobs) + bad, {})

    cfg = LossConfig(policy="custom")
    with pytest.raises(ValueError, match=r"the loss of policy 'custom' at row 2 must be finite"):
        echo_loss_from_logprobs(lp, x, config=cfg, policy_fn=broken)
