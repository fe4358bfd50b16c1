"""Counts, masks and values of the ``echoloss.nn`` modules: checked where they enter, named as
the caller passed them."""

from __future__ import annotations

import math

import pytest
import torch

from echoloss import LossConfig
from echoloss._deferred import device_code_path, raise_deferred_errors
from echoloss.nn import EchoFusedLinearGRPOLoss, EchoGRPOLoss
from echoloss.nn.grpo import grpo_loss_mapping, scale_echo_weights, with_fields

B, T, V = 2, 3, 5


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    adv = torch.tensor([1.0, -0.5])
    echo = torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
    return logits, ids, mask, adv, echo


@pytest.mark.parametrize(
    "items", [float("nan"), float("inf"), -5, 2.5, 3, torch.tensor(float("nan"))]
)
def test_num_items_in_batch_is_checked(items):
    """NaN/inf/negative/fractional counts, and one smaller than this call's 5 RL tokens."""
    logits, ids, mask, adv, echo = _batch()
    loss_fn = EchoGRPOLoss(beta=0.0, loss_type="dapo")
    with pytest.raises(ValueError, match="num_items_in_batch must be"):
        loss_fn(logits, ids, mask, adv, echo_weights=echo, num_items_in_batch=items)
    loss_fn(logits, ids, mask, adv, echo_weights=echo, num_items_in_batch=5)


@pytest.mark.parametrize("items", [float("inf"), -3, 0.5])
def test_num_echo_items_in_batch_is_checked(items):
    logits, ids, mask, adv, echo = _batch()
    loss_fn = EchoGRPOLoss(beta=0.0, loss_type="grpo")
    with pytest.raises(ValueError, match="num_echo_items_in_batch must be"):
        loss_fn(logits, ids, mask, adv, echo_weights=echo, num_echo_items_in_batch=items)


@pytest.mark.parametrize("length", [0, -5, 2.5, float("nan")])
def test_max_completion_length_is_checked(length):
    with pytest.raises((ValueError, TypeError), match="max_completion_length must be"):
        EchoGRPOLoss(beta=0.0, loss_type="dr_grpo", max_completion_length=length)


@pytest.mark.parametrize("bad", [0.5, float("nan"), -1.0, 2.0])
def test_attention_mask_must_be_zero_or_one(bad):
    logits, ids, mask, adv, echo = _batch()
    mask[1, 2] = bad
    with pytest.raises(ValueError, match=r"attention_mask \(flat index 5\) must be 0 or 1"):
        EchoGRPOLoss(beta=0.0)(logits, ids, mask, adv, echo_weights=echo)


@pytest.mark.parametrize("name", ["sapo_temperature_neg", "sapo_temperature_pos"])
@pytest.mark.parametrize("value", [-1.0, 0.0, float("nan")])
def test_sapo_temperatures_are_checked(name, value):
    with pytest.raises(ValueError, match=f"{name} must be"):
        EchoGRPOLoss(beta=0.0, loss_type="sapo", **{name: value})


@pytest.mark.parametrize("module", ["logits", "hidden"])
def test_on_policy_nan_is_named_by_its_source_not_old_logprobs(module):
    """On-policy, the ratio's denominator is this pass's logprobs: a NaN there is the model's."""
    logits, ids, mask, adv, _ = _batch()
    if module == "logits":
        bad = logits.detach().clone()
        bad[0, 1, 2] = float("nan")
        call = lambda: EchoGRPOLoss(beta=0.0)(bad, ids, mask, adv)  # noqa: E731
    else:
        hidden = torch.randn(B, T, 4)
        hidden[0, 1, 0] = float("nan")
        head = torch.randn(V, 4)
        call = lambda: EchoFusedLinearGRPOLoss(beta=0.0)(hidden, head, ids, mask, adv)  # noqa: E731
    named = "logits" if module == "logits" else "_input"  # the fused module's argument
    with pytest.raises(ValueError, match=rf"^{named} row 1 must be a finite log-probability") as e:
        call()
    assert "old_logprobs" not in str(e.value)


def test_nan_in_the_lm_head_bias_is_not_blamed_on_a_hidden_row():
    """A NaN bias was reported as a bad ``hidden`` row: the message names the head's bias."""
    _, ids, mask, adv, _ = _batch()
    head, bias = torch.randn(V, 4), torch.zeros(V)
    bias[2] = float("nan")
    with pytest.raises(ValueError, match=r"^_input row 0 must be .* in lin_weight or bias"):
        EchoFusedLinearGRPOLoss(beta=0.0)(torch.randn(B, T, 4), head, ids, mask, adv, bias=bias)


def test_given_old_and_ref_logprobs_are_named_as_passed():
    logits, ids, mask, adv, _ = _batch()
    old = torch.full((B, T), -1.0)
    old[1, 0] = 0.5
    with pytest.raises(ValueError, match=r"^old_per_token_logps\[3\] must be a log-probability"):
        EchoGRPOLoss(beta=0.0)(logits, ids, mask, adv, old_per_token_logps=old)
    ref = torch.full((B, T), -1.0)
    ref[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^ref_per_token_logps must be finite"):
        EchoGRPOLoss(beta=0.1)(logits, ids, mask, adv, ref_per_token_logps=ref)


def test_scale_echo_weights_checks_its_counts():
    w = torch.tensor([[0.0, 0.5, 0.5]])
    obs = w > 0
    kw = dict(
        normalization="token_mean", num_processes=1, accumulation_steps=1, steps_per_generation=1
    )
    with pytest.raises(ValueError, match=r"num_echo_items_in_batch must be ≥ 2"):
        scale_echo_weights(w, obs, num_echo_items_in_batch=1, **kw)
    for name in ("num_processes", "accumulation_steps", "steps_per_generation"):
        with pytest.raises(ValueError, match=f"{name} must be a finite whole number ≥ 1"):
            scale_echo_weights(w, obs, **{**kw, name: 0}, num_echo_items_in_batch=2)
    out = scale_echo_weights(w, obs, num_echo_items_in_batch=4, **kw)
    assert out.tolist() == [[0.0, 0.125, 0.125]]


def test_per_call_config_is_validated_not_copied():
    """The per-call normaliser goes through LossConfig's checks (model_copy would skip them)."""
    cfg = LossConfig(rl_normalization="token_sum_constant", rl_normalization_constant=1.0)
    for bad in (0.0, -2.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="rl_normalization_constant"):
            with_fields(cfg, rl_normalization_constant=bad)
    args = type("A", (), dict(loss_type="dr_grpo", beta=0.0, importance_sampling_level="token",
                              delta=None, top_entropy_quantile=1.0))()  # fmt: skip
    m = grpo_loss_mapping(args, epsilon_low=0.2, epsilon_high=0.2)
    with pytest.raises(ValueError, match="max_completion_length must be"):
        m.micro_batch(batch_size=2, max_completion_length=0, num_items_in_batch=None,
                      num_processes=1, accumulation_steps=1, steps_per_generation=1)  # fmt: skip
    with pytest.raises(ValueError, match="num_processes must be"):
        m.micro_batch(batch_size=2, max_completion_length=4, num_items_in_batch=None,
                      num_processes=0, accumulation_steps=1, steps_per_generation=1)  # fmt: skip


def test_module_final_loss_is_checked():
    """The nn path runs the same final-loss check (echo weights that overflow the sum)."""
    logits, ids, mask, adv, _ = _batch()
    logits = logits.detach().clone()
    logits[0, 2] = -200.0
    logits[0, 2, ids[0, 2]] = -300.0  # NLL 100
    echo = torch.tensor([[0.0, 0.0, 3e38], [0.0, 0.0, 0.0]])  # scaled to 1.5e38, NLL 100
    with pytest.raises(ValueError, match=r"loss must be finite.*loss_echo.*echo_weights"):
        EchoGRPOLoss(beta=0.0, loss_type="grpo", echo_normalization="sequence_mean")(
            logits, ids, mask, adv, echo_weights=echo
        )


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("items", [None, 8, torch.tensor(8)], ids=["counted", "given", "tensor"])
def test_non_finite_loss_names_the_real_rl_divisor(items, fused):
    """dapo divides by the batch's RL tokens, a device tensor when given: the diagnosis reads
    it (only when the error is built) and names it, not the config's placeholder constant 1.
    Counted on one process it is the loss's own count of RL rows (``token_mean``), which no
    diagnosis names (as for any token mean)."""
    logits, ids, mask, _, _ = _batch()
    adv = torch.tensor([3e38, 1.0])  # 3 tokens of -3e38 each: the RL sum overflows
    fn = EchoFusedLinearGRPOLoss if fused else EchoGRPOLoss
    loss_fn = fn(beta=0.0, loss_type="dapo")
    args: tuple = (logits,)
    if fused:  # hidden = the logits, identity LM head
        args = (logits.detach().clone().requires_grad_(), torch.eye(V).requires_grad_())
    divisor = (
        ""
        if items is None  # 6 RL tokens in this call, counted by the loss
        else "; the RL divisor 8 (token_sum_constant's divisor of this call: the batch's RL "
        "tokens per process)"
    )
    expected = (
        f"loss must be finite, got -inf (loss_rl (the RL term) = -inf, loss_echo (the echo "
        f"term) = 0); the checked inputs were finite, so a product, the sum or its scaling "
        f"overflowed; likely input: advantages (largest |value| 3e+38 at row 0){divisor}"
        f"; bring that input to a realistic range (advantages and echo weights of order "
        f"1, coefficients well below 1e30, normalisers ≥ 1), or set "
        f"LossConfig(check_finite=False) to skip this check"
    )
    with pytest.raises(ValueError) as err:
        loss_fn(*args, ids, mask, adv, num_items_in_batch=items)
    assert str(err.value) == expected
    with device_code_path():  # deferred: raised at the next host read, with the same text
        out = loss_fn(*args, ids, mask, adv, num_items_in_batch=items)
        out.loss.backward()
        with pytest.raises(ValueError) as err:
            raise_deferred_errors()
    assert str(err.value) == expected


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize(
    "name, value, error, match",
    [
        (
            "ref_per_token_logps",
            torch.zeros(B, T - 1),
            ValueError,
            r"of shape \[2, 3\] \(\[B, T\]\)",
        ),
        ("old_per_token_logps", torch.zeros(B + 1, T), ValueError, r"of shape \[2, 3\]"),
        ("inference_logprobs", torch.zeros(B, T + 1), ValueError, r"of shape \[2, 3\]"),
        ("ref_per_token_logps", [[0.0] * T] * B, TypeError, "must be a torch.Tensor"),
        ("old_per_token_logps", torch.zeros(B, T, dtype=torch.long), TypeError, "floating"),
    ],
)
def test_logprob_inputs_are_named_before_the_forward_reads_them(name, value, error, match, fused):
    """The [B, T] logprob inputs are read per chunk by the gradients formed in the forward: a
    wrong kind or shape is named as passed (not an index error from inside the chunk loop)."""
    logits, ids, mask, adv, echo = _batch()
    loss_fn = (EchoFusedLinearGRPOLoss if fused else EchoGRPOLoss)(loss_type="dapo")
    args: tuple = (logits,)
    if fused:
        args = (logits.detach().clone().requires_grad_(), torch.eye(V).requires_grad_())
    kw = {"ref_per_token_logps": torch.zeros(B, T), name: value}
    with pytest.raises(error, match=f"^{name}.*{match}"):
        loss_fn(*args, ids, mask, adv, echo_weights=echo, **kw)


def _full_setup(monkeypatch):
    """The module with every row-setup shortcut undone: per-row temperatures as a tensor."""
    from echoloss.nn import grpo as grpo_module

    monkeypatch.setattr(
        EchoGRPOLoss,
        "_temperatures",
        lambda self, rl, echo: grpo_module.row_temperature(
            rl, echo, self.temperature, self.config.echo_temperature
        ),
    )


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize(
    ("loss_type", "echo_normalization", "temperature"),
    [
        ("grpo", "token_mean", 1.0),
        ("grpo", "sequence_mean", 1.0),
        ("bnpo", "batch_token_mean", 0.7),
        ("dapo", "sequence_mean", 0.7),
        ("dr_grpo", "token_mean", 1.3),
    ],
)
def test_the_row_setup_shortcuts_change_no_bit(
    loss_type, echo_normalization, temperature, fused, monkeypatch
):
    """A temperature of 1 passed as one float (no per-row tensor): loss, metrics and
    gradients equal those of the full setup, bit for bit."""
    g = torch.Generator().manual_seed(3)
    b, t, v, h = 3, 5, 11, 4
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) < 0.9).float()
    adv = torch.randn(b, generator=g)
    echo = torch.where(torch.rand(b, t, generator=g) < 0.4, 0.5, 0.0)
    obs = torch.rand(b, t, generator=g) < 0.5
    opts = dict(
        beta=0.0,
        loss_type=loss_type,
        echo_normalization=echo_normalization,
        temperature=temperature,
        max_completion_length=t if loss_type == "dr_grpo" else None,
    )
    if fused:
        inputs = (torch.randn(b, t, h, generator=g), torch.randn(v, h, generator=g))
    else:
        inputs = (torch.randn(b, t, v, generator=g),)

    def run():
        leaves = [x.clone().requires_grad_() for x in inputs]
        loss_fn = (EchoFusedLinearGRPOLoss if fused else EchoGRPOLoss)(**opts)
        out = loss_fn(*leaves, ids, mask, adv, echo_weights=echo, observation_mask=obs)
        out.loss.backward()
        return out, [x.grad for x in leaves]

    out, grads = run()
    with monkeypatch.context() as m:
        _full_setup(m)
        full, full_grads = run()
    assert torch.equal(out.loss, full.loss), (out.loss, full.loss)
    assert out.metrics.keys() == full.metrics.keys()
    for k in out.metrics:
        assert torch.equal(out.metrics[k], full.metrics[k]), k
    for a, b_ in zip(grads, full_grads, strict=True):
        assert torch.equal(a, b_)
