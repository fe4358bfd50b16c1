"""The verl echo policy loss on CPU, against verl 0.9's own ``core_algos`` functions.

verl is imported from its installed source without ray (``_verl_core.py`` says how). Tolerance:
2e-6 absolute on fp32 losses of order 1 (single-precision rounding over a few dozen operations;
measured ≤ 3e-7), 1e-12 in float64 where the same formula is evaluated in another order.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("omegaconf")
pytest.importorskip("tensordict")
if __import__("importlib.util").util.find_spec("verl") is None:
    pytest.skip("verl is not installed (extra 'verl')", allow_module_level=True)

from _verl_core import load_verl  # noqa: E402

from echoloss import LossConfig, echo_loss_from_logprobs  # noqa: E402
from echoloss.adapters import verl as adapter  # noqa: E402

core, losses = load_verl()
BS, L = 4, 7
TOL = 2e-6


class _ActorConfig(SimpleNamespace):
    """The fields verl's ``compute_policy_loss_vanilla`` reads (``ActorConfig`` is a dataclass
    with ``.get``); clip values as verl's defaults except an asymmetric high clip."""

    def get(self, key, default=None):
        return getattr(self, key, default)


def _config():
    return _ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                        clip_ratio_c=3.0, global_batch_info={})  # fmt: skip


def _batch(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    log_prob = (-torch.rand(BS, L, generator=g, dtype=dtype) * 3).requires_grad_()
    old = log_prob.detach() + 0.4 * torch.randn(BS, L, generator=g, dtype=dtype)
    adv = torch.randn(BS, 1, generator=g, dtype=dtype).expand(BS, L).clone()
    mask = torch.ones(BS, L, dtype=torch.bool)
    mask[0, 5:] = False
    mask[1, 2:4] = False  # tool-result tokens: no RL ...
    mask[3] = False  # a sequence with no RL token
    echo = torch.zeros(BS, L, dtype=dtype)
    echo[1, 2:4] = 0.5  # ... echoed instead
    echo[3, 1:3] = 0.25
    return log_prob, old, adv, mask, echo


def _hand_echo(log_prob, echo, mode):
    """The echo term of each mode written out (independent of verl's agg_loss)."""
    nll = -log_prob * echo
    m = echo > 0
    per_seq = nll.sum(-1)
    n_seq = m.any(-1).sum()
    if mode == "token-mean":
        return nll.sum() / m.sum()
    if mode == "token-sum":
        return nll.sum()
    if mode == "seq-mean-token-sum":
        return per_seq.sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        return per_seq.sum() / n_seq / L
    return (per_seq[m.any(-1)] / m.sum(-1)[m.any(-1)]).sum() / n_seq  # seq-mean-token-mean


@pytest.mark.parametrize("base", ["vanilla", "dppo_tv", "geo_mean"])
@pytest.mark.parametrize("mode", adapter.VERL_AGG_MODES)
def test_registered_loss_is_verls_loss_plus_the_echo_term(mode, base):
    fn = adapter.register_echo_policy_loss(f"echo_{base}", base=base)
    assert core.get_policy_loss_fn(f"echo_{base}") is fn
    log_prob, old, adv, mask, echo = _batch()
    kw = dict(old_log_prob=old, advantages=adv, response_mask=mask, loss_agg_mode=mode,
              config=_config())  # fmt: skip
    base_loss, base_metrics = core.get_policy_loss_fn(base)(log_prob=log_prob, **kw)
    (g_base,) = torch.autograd.grad(base_loss, log_prob)
    with adapter.echo_inputs(echo):
        total, metrics = fn(log_prob=log_prob, **kw)
    (g_total,) = torch.autograd.grad(total, log_prob)
    hand = _hand_echo(log_prob, echo, mode)
    (g_hand,) = torch.autograd.grad(hand, log_prob)
    assert float(hand.detach()) > 0
    assert abs(float(total.detach()) - float(base_loss.detach()) - float(hand.detach())) <= TOL
    assert torch.allclose(g_total, g_base + g_hand, atol=TOL, rtol=0)
    assert metrics["actor/echo_tokens"] == 4
    assert {k: metrics[k] for k in base_metrics} == base_metrics


def _verl_to_echoloss(mode, mask):
    """The LossConfig of verl's vanilla loss in each agg mode (the table in docs/guides/verl.md)."""
    s = int(mask.any(-1).sum())
    common = dict(policy="ppo_clip", eps_low=0.2, eps_high=0.28, dual_clip=3.0,
                  log_ratio_clamp=20.0, kl_tau=0.0, compute_entropy=False)  # fmt: skip
    norm = {
        "token-mean": dict(rl_normalization="token_mean"),
        "token-sum": dict(rl_normalization="token_sum_constant", rl_normalization_constant=1.0),
        "seq-mean-token-sum": dict(rl_normalization="sequence_mean_token_sum"),
        "seq-mean-token-sum-norm": dict(
            rl_normalization="token_sum_constant", rl_normalization_constant=float(s * L)
        ),
        "seq-mean-token-mean": dict(rl_normalization="sequence_mean_token_mean"),
    }[mode]
    return LossConfig(**common, **norm)


@pytest.mark.parametrize("mode", adapter.VERL_AGG_MODES)
def test_verl_vanilla_equals_echoloss_ppo_clip(mode):
    """verl's PPO-clip and agg_loss modes are LossConfig settings (measured, fp64)."""
    log_prob, old, adv, mask, _ = _batch(dtype=torch.float64)
    theirs, _ = core.compute_policy_loss_vanilla(
        old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask,
        loss_agg_mode=mode, config=_config())  # fmt: skip
    (g_theirs,) = torch.autograd.grad(theirs, log_prob)
    ours = echo_loss_from_logprobs(
        log_prob, rl_mask=mask, advantages=adv, old_logprobs=old,
        sequence_ids=torch.arange(BS)[:, None].expand(BS, L), config=_verl_to_echoloss(mode, mask),
    ).loss  # fmt: skip
    (g_ours,) = torch.autograd.grad(ours, log_prob)
    # float64, the same formula in another order (verl's seq-mean-token-mean adds 1e-8 to an
    # integer count in float32, where it vanishes); measured ≤ 4e-16.
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-12
    assert torch.allclose(g_ours, g_theirs, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("mode", "echo_normalization", "prescale"),
    [
        ("token-mean", "token_mean", None),
        ("token-sum", "sum", None),
        ("seq-mean-token-mean", "sequence_mean", None),
        ("seq-mean-token-sum", "sum", "sequences"),
    ],
)
def test_echo_term_equals_echoloss_normalisation(mode, echo_normalization, prescale):
    log_prob, _, _, _, echo = _batch(dtype=torch.float64)
    theirs = adapter.echo_agg_loss(log_prob, echo, loss_agg_mode=mode)
    w = echo / int((echo > 0).any(-1).sum()) if prescale else echo
    ours = echo_loss_from_logprobs(
        log_prob, rl_mask=torch.zeros(BS, L, dtype=torch.bool), echo_weights=w,
        sequence_ids=torch.arange(BS)[:, None].expand(BS, L), observation_mask=echo > 0,
        config=LossConfig(echo_normalization=echo_normalization),
    ).loss  # fmt: skip
    assert abs(float(ours.detach()) - float(theirs.detach())) <= 1e-12


def test_global_counts_with_data_parallel():
    """dp_size > 1: the echo term divides by the given global echo counts, times dp_size."""
    log_prob, _, _, _, echo = _batch()
    info = adapter.echo_batch_info(echo, dp_size=2, batch_num_tokens=10, global_batch_size=3)
    got = adapter.echo_agg_loss(log_prob, echo, loss_agg_mode="token-mean", batch_info=info)
    assert abs(float(got.detach()) - float((-log_prob * echo).sum().detach() / 10 * 2)) <= TOL
    with pytest.raises(ValueError, match="batch_num_tokens is required"):  # verl's own check
        adapter.echo_agg_loss(
            log_prob, echo, loss_agg_mode="token-mean",
            batch_info=adapter.echo_batch_info(echo, dp_size=2))  # fmt: skip


def test_no_echo_token_gives_a_zero_connected_term():
    log_prob, *_ = _batch()
    out = adapter.echo_agg_loss(log_prob, torch.zeros(BS, L), loss_agg_mode="token-mean")
    assert float(out.detach()) == 0.0 and out.requires_grad


def test_registered_loss_without_echo_inputs_is_an_error():
    fn = adapter.register_echo_policy_loss("echo_test", base="vanilla")
    log_prob, old, adv, mask, _ = _batch()
    with pytest.raises(ValueError, match="no echo weights reached the loss"):
        fn(old_log_prob=old, log_prob=log_prob, advantages=adv, response_mask=mask,
           loss_agg_mode="token-mean", config=_config())  # fmt: skip


def test_bad_arguments_are_errors():
    log_prob, *_ = _batch()
    with pytest.raises(ValueError, match="not in verl's policy-loss registry"):
        adapter.register_echo_policy_loss("echo_test", base="nope")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        adapter.echo_agg_loss(log_prob, torch.zeros(BS, L), loss_agg_mode="mean")
    with pytest.raises(ValueError, match="finite weights"):
        adapter.echo_agg_loss(log_prob, -torch.ones(BS, L), loss_agg_mode="token-mean")


def test_echo_ppo_loss_runs_verls_actor_loss_with_the_echo_field():
    """verl's own ``ppo_loss`` (padding helpers, global batch info) with the echo field attached."""
    from tensordict import TensorDict

    fn = adapter.register_echo_policy_loss("echo_test", base="vanilla")
    log_prob, old, adv, mask, echo = _batch()
    p = 3
    # verl's no-padding layout: one flat row of log-probs per token; response token j of
    # sequence i sits at offset i·(P+L) + P - 1 + j (the model output is shifted by one).
    flat = torch.zeros(BS, p + L)
    flat[:, p - 1 : p - 1 + L] = log_prob.detach()
    flat = flat.reshape(-1).requires_grad_()
    data = TensorDict(
        {"prompts": torch.ones(BS, p, dtype=torch.long),
         "responses": torch.ones(BS, L, dtype=torch.long),
         "attention_mask": torch.ones(BS, p + L, dtype=torch.long),
         "response_mask": mask.long(), "old_log_probs": old, "advantages": adv,
         "echo_weights": echo},
        batch_size=[BS],
    )  # fmt: skip
    n_rl, n_echo = int(mask.sum()), int((echo > 0).sum())
    for key, value in (("dp_size", 1), ("batch_num_tokens", n_rl), ("global_batch_size", BS),
                       ("echo_batch_num_tokens", n_echo), ("echo_global_batch_size", 2)):  # fmt: skip
        data.set_non_tensor(key, value)
    config = _config()
    config.update = None
    config.loss_agg_mode = "token-mean"
    config.loss_scale_factor = None
    config.policy_loss = {"loss_mode": "echo_test"}
    config.entropy_coeff = 0.0
    config.use_kl_loss = False
    loss, _ = adapter.echo_ppo_loss(config, {"log_probs": flat}, data)
    lp = flat.view(BS, p + L)[:, p - 1 : p - 1 + L]
    config.global_batch_info = {"dp_size": 1, "batch_num_tokens": n_rl,
                                "global_batch_size": BS, "loss_scale_factor": None}  # fmt: skip
    expected, _ = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                     loss_agg_mode="token-mean", config=config, echo_weights=echo)  # fmt: skip
    assert abs(float(loss.detach()) - float(expected.detach())) <= TOL
    (g1,) = torch.autograd.grad(loss, flat)
    (g2,) = torch.autograd.grad(expected, flat)
    assert float(g1.abs().max()) > 1e-3 and torch.allclose(g1, g2, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("key", "value"),
    [("batch_num_tokens", 0), ("batch_num_tokens", -2), ("batch_num_tokens", float("nan")),
     ("batch_num_tokens", 1), ("global_batch_size", 0), ("dp_size", 0), ("dp_size", 1.5)],
)  # fmt: skip
def test_batch_info_counts_are_checked(key, value):
    """Each count that divides or multiplies the echo term, where it enters (1 < the 4 echo
    tokens of this micro-batch, which a global count sums)."""
    _, _, _, _, echo = _batch()
    with pytest.raises(ValueError, match=f"{key} must be"):
        adapter.echo_batch_info(echo, **{key: value})
    log_prob, *_ = _batch()
    info = {"dp_size": 1, "batch_num_tokens": 4, "global_batch_size": 2, "loss_scale_factor": None}
    with pytest.raises(ValueError, match=f"{key} must be"):
        adapter.echo_agg_loss(log_prob, echo, loss_agg_mode="token-mean",
                              batch_info={**info, key: value})  # fmt: skip


@pytest.mark.parametrize("bad", [0.5, float("nan"), float("-inf")])
def test_echoed_log_prob_is_checked(bad):
    log_prob, _, _, _, echo = _batch()
    log_prob = log_prob.detach().clone()
    log_prob[1, 2] = bad
    with pytest.raises(ValueError, match=r"log_prob\[1, 2\] must be a finite log-probability"):
        adapter.echo_agg_loss(log_prob, echo, loss_agg_mode="token-mean")
    log_prob[1, 2] = -1.0
    log_prob[0, 0] = bad  # not echoed: never read
    assert torch.isfinite(adapter.echo_agg_loss(log_prob, echo, loss_agg_mode="token-mean"))


def test_a_name_verl_owns_is_not_replaced_unless_asked():
    vanilla = core.POLICY_LOSS_REGISTRY["vanilla"]
    with pytest.raises(ValueError, match="name must be a name not in verl's policy-loss registry"):
        adapter.register_echo_policy_loss("vanilla", base="gspo")
    assert core.POLICY_LOSS_REGISTRY["vanilla"] is vanilla
    adapter.register_echo_policy_loss("echo_twice", base="vanilla")
    adapter.register_echo_policy_loss("echo_twice", base="gspo")  # its own echo loss: a re-run
    try:
        fn = adapter.register_echo_policy_loss("vanilla", base="gspo", replace=True)
        assert core.POLICY_LOSS_REGISTRY["vanilla"] is fn
    finally:
        core.POLICY_LOSS_REGISTRY["vanilla"] = vanilla


def test_a_batch_without_echo_tokens_gives_zero_even_with_zero_counts_and_nan_rows():
    log_prob, *_ = _batch()
    log_prob = log_prob.detach().clone()
    log_prob[2, 3] = float("nan")  # a row no loss reads
    log_prob.requires_grad_()
    info = adapter.echo_batch_info(torch.zeros(BS, L), dp_size=2, batch_num_tokens=0,
                                   global_batch_size=0)  # fmt: skip
    out = adapter.echo_agg_loss(log_prob, torch.zeros(BS, L), loss_agg_mode="token-mean",
                                batch_info=info)  # fmt: skip
    assert float(out.detach()) == 0.0 and out.requires_grad
    (grad,) = torch.autograd.grad(out, log_prob)
    assert bool((grad == 0).all())


@pytest.mark.parametrize(
    "mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum"]
)
def test_echo_agg_loss_that_overflows_is_refused_naming_the_weights(mode):
    """Echo weights of 3e38 on 2 tokens (each finite, checked) gave an infinite echo term with
    no error: -log_prob · w overflows float32."""
    log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    weights = torch.tensor([[3e38, 3e38]])
    with pytest.raises(
        ValueError, match=r"echo_weights: the echo term is inf .*largest weight 3e\+38"
    ):
        adapter.echo_agg_loss(log_prob, weights, loss_agg_mode=mode)
