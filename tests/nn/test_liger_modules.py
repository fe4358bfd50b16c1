"""EchoFusedLinearGRPOLoss against Liger's LigerFusedLinearGRPOLoss on the same inputs.

Liger's module runs with ``compiled=False``: its chunked path is plain PyTorch (no Triton), so
it runs on CPU unchanged. Both compute fp32 logprobs of the same fp32 hidden states and weights
in different chunk orders; the tolerance 2e-6 (relative to the largest gradient entry, absolute on
the loss) covers single-precision rounding (ε = 1.2e-7) over a few dozen operations; measured
differences are below 8e-7.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
liger = pytest.importorskip("liger_kernel.chunked_loss")

from echoloss import LossConfig  # noqa: E402
from echoloss.nn import EchoFusedLinearGRPOLoss, EchoGRPOLoss  # noqa: E402

B, T, H, V = 4, 6, 8, 13
TOL = 2e-6


def _inputs(seed=0, *, off_policy=False, beta=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g, dtype=dtype)
    w = torch.randn(V, H, generator=g) * 0.5
    bias = torch.randn(V, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    adv = torch.randn(B, generator=g)
    extra = {}
    with torch.no_grad():
        lp = ((x.float() @ w.T + bias) / 0.7).log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    if off_policy:
        extra["old_per_token_logps"] = lp + 0.6 * torch.randn(B, T, generator=g)
    if beta:
        extra["ref_per_token_logps"] = lp + 0.3 * torch.randn(B, T, generator=g)
    return x, w, bias, ids, mask, adv, extra


def _run(fn, x, w, bias, ids, mask, adv, extra, **kw):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    bias = None if bias is None else bias.clone().requires_grad_()
    loss = fn(x, w, ids, mask, adv, bias=bias, **extra, **kw)[0]
    loss.backward()
    grads = [x.grad, w.grad] + ([] if bias is None else [bias.grad])
    return float(loss.detach()), grads


def _compare(options, *, off_policy=False, beta=False, with_bias=True, **kw):
    x, w, bias, ids, mask, adv, extra = _inputs(off_policy=off_policy, beta=beta)
    bias = bias if with_bias else None
    options = {**options, "use_ref_model": beta}  # Liger asserts on a missing reference
    theirs, g_l = _run(liger.LigerFusedLinearGRPOLoss(compiled=False, **options),
                       x, w, bias, ids, mask, adv, extra, **kw)  # fmt: skip
    ours, g_o = _run(EchoFusedLinearGRPOLoss(**options), x, w, bias, ids, mask, adv, extra, **kw)
    assert abs(ours - theirs) <= TOL, (ours, theirs)
    for a, b in zip(g_o, g_l, strict=True):
        scale = float(b.abs().max())
        assert scale > 1e-4  # a zero gradient would pass any tolerance
        assert float((a - b).abs().max()) <= TOL * scale
    return ours, theirs


TOKEN_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]


@pytest.mark.parametrize("off_policy", [False, True], ids=["on_policy", "off_policy"])
@pytest.mark.parametrize("loss_type", TOKEN_TYPES)
def test_token_level_equals_liger(loss_type, off_policy):
    opts = {"beta": 0.0, "loss_type": loss_type, "temperature": 0.7, "max_completion_length": T,
            "epsilon_high": 5.0 if loss_type == "cispo" else 0.28}  # fmt: skip
    _compare(opts, off_policy=off_policy)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_sequence_level_equals_liger(loss_type):
    opts = {"beta": 0.0, "loss_type": loss_type, "temperature": 0.7, "max_completion_length": T,
            "importance_sampling_level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4}  # fmt: skip
    _compare(opts, off_policy=True)


def test_k3_kl_delta_and_num_items_equal_liger():
    opts = {"beta": 0.04, "loss_type": "dapo", "temperature": 0.7, "delta": 1.5}
    _compare(opts, off_policy=True, beta=True, num_items_in_batch=40)


def test_without_bias_equals_liger():
    _compare({"beta": 0.0, "loss_type": "grpo"}, off_policy=True, with_bias=False)


def test_bias_gradient_equals_fp64_autograd():
    """The bias column is exact: every gradient matches the fp64 logits path."""
    x, w, bias, ids, mask, adv, extra = _inputs(off_policy=True)
    echo = torch.zeros(B, T)
    echo[1, 2:4] = 0.5
    fused = EchoFusedLinearGRPOLoss(beta=0.0, loss_type="grpo", temperature=0.7)
    _, (gx, gw, gb) = _run(fused, x, w, bias, ids, mask, adv, extra, echo_weights=echo)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, bias))
    logits = x64 @ w64.T + b64
    extra64 = {k: v.double() for k, v in extra.items()}
    loss = EchoGRPOLoss(beta=0.0, loss_type="grpo", temperature=0.7)(
        logits, ids, mask, adv, echo_weights=echo, **extra64
    ).loss
    loss.backward()
    for a, ref in ((gx, x64.grad), (gw, w64.grad), (gb, b64.grad)):
        assert float((a.double() - ref).abs().max()) <= TOL * float(ref.abs().max())


def test_echo_term_adds_the_hand_computed_cross_entropy():
    x, w, bias, ids, mask, adv, extra = _inputs()
    echo = torch.zeros(B, T)
    echo[1, 2:4] = 0.5
    echo[3, 0] = 0.25
    fn = EchoFusedLinearGRPOLoss(beta=0.0, loss_type="dapo", temperature=0.7)
    with_echo, _ = _run(fn, x, w, bias, ids, mask, adv, extra, echo_weights=echo)
    rl_only = mask.bool() & (echo == 0)
    without, _ = _run(fn, x, w, bias, ids, rl_only.float(), adv, extra)
    # Echo rows at T = 1, divided by the echo tokens of the batch (token_mean).
    nll = -(x @ w.T + bias).log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    expected = float((echo * nll).sum() / (echo > 0).sum())
    assert abs(with_echo - without - expected) <= TOL


def test_bf16_hidden_with_fp32_weight_follows_liger_dtype_rule():
    x, w, bias, ids, mask, adv, extra = _inputs(dtype=torch.bfloat16, off_policy=True)
    w = w.clone().requires_grad_()
    fn = EchoFusedLinearGRPOLoss(beta=0.0, loss_type="grpo")
    out = fn(x.requires_grad_(), w, ids, mask, adv, bias=bias.clone().requires_grad_(), **extra)
    out.loss.backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    theirs = liger.LigerFusedLinearGRPOLoss(
        compiled=False, beta=0.0, loss_type="grpo", use_ref_model=False
    )(x.detach(), w.detach(), ids, mask, adv, bias=bias, **extra)[0]
    fp32 = fn(x.detach().float(), w.detach(), ids, mask, adv, bias=bias, **extra).loss
    # bf16 logits (8-bit mantissa, relative rounding 4e-3 per logit): both differ from the fp32
    # loss by ~6e-5 here and from each other only by where the bias is rounded (Liger adds it
    # in fp32 after the bf16 matmul); 1e-3 bounds that with margin, 1e-5 would not hold.
    assert abs(float(out.loss.detach()) - float(theirs)) <= 1e-3
    assert abs(float(out.loss.detach()) - float(fp32)) <= 1e-3


def test_logits_module_equals_fused_module():
    x, w, bias, ids, mask, adv, extra = _inputs(off_policy=True)
    opts = {"beta": 0.0, "loss_type": "sapo", "temperature": 0.7}
    fused = EchoFusedLinearGRPOLoss(**opts)(x, w, ids, mask, adv, bias=bias, **extra).loss
    plain = EchoGRPOLoss(**opts)(x @ w.T + bias, ids, mask, adv, **extra).loss
    assert abs(float(fused) - float(plain)) <= TOL


@pytest.mark.parametrize(
    ("kw", "call", "match"),
    [
        ({"loss_type": "xyz"}, {}, "loss_type='xyz'"),
        ({"loss_type": "vespo"}, {}, "vespo"),
        ({"loss_type": "dr_grpo"}, {}, "max_completion_length"),
        ({"config": LossConfig(), "beta": 0.0}, {}, "both given"),
        ({"beta": 0.04}, {}, "ref_per_token_logps"),
        ({"beta": 0.0}, {"vllm_is_ratio": torch.ones(B, T)}, "vllm_is_ratio"),
        ({"beta": 0.0}, {"ref_input": torch.ones(B, T, H)}, "ref_input"),
        ({"beta": 0.0, "echo_normalization": "mean"}, {}, "echo_normalization"),
    ],
)
def test_options_without_an_exact_equivalent_are_errors(kw, call, match):
    x, w, _bias, ids, mask, adv, _ = _inputs()
    with pytest.raises(ValueError, match=match):
        EchoFusedLinearGRPOLoss(**kw)(x, w, ids, mask, adv, **call)


def test_config_path_uses_any_loss_config():
    x, w, bias, ids, mask, adv, _extra = _inputs()
    out = EchoFusedLinearGRPOLoss(config=LossConfig(kl_tau=0.0))(x, w, ids, mask, adv, bias=bias)
    # DPPO on-policy with token_mean: -mean(A) over the RL tokens.
    rl = mask.bool()
    expected = -float((adv[:, None].expand(B, T)[rl]).mean())
    assert abs(float(out.loss) - expected) <= TOL


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    shape=st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(2, 9), st.integers(2, 17)),
    loss_type=st.sampled_from(TOKEN_TYPES),
    off_policy=st.booleans(),
    keep=st.floats(0.0, 1.0),
)
def test_random_batches_equal_liger(seed, shape, loss_type, off_policy, keep):
    """Any shape, any padding (an all-padding batch included): same loss and gradients."""
    b, t, h, v = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, generator=g)
    w = torch.randn(v, h, generator=g) * 0.5
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) < keep).float()
    adv = torch.randn(b, generator=g)
    extra = {}
    if off_policy:
        with torch.no_grad():
            lp = (x @ w.T).log_softmax(-1).gather(-1, ids[..., None])[..., 0]
        extra["old_per_token_logps"] = (lp + 0.5 * torch.randn(b, t, generator=g)).clamp(max=0)
    opts = {"beta": 0.0, "loss_type": loss_type, "max_completion_length": t,
            "epsilon_high": 5.0 if loss_type == "cispo" else 0.28}  # fmt: skip
    theirs, g_l = _run(liger.LigerFusedLinearGRPOLoss(compiled=False, use_ref_model=False, **opts),
                       x, w, None, ids, mask, adv, extra)  # fmt: skip
    ours, g_o = _run(EchoFusedLinearGRPOLoss(**opts), x, w, None, ids, mask, adv, extra)
    assert abs(ours - theirs) <= TOL * max(1.0, abs(theirs))
    for a, c in zip(g_o, g_l, strict=True):
        assert float((a - c).abs().max()) <= TOL * max(1.0, float(c.abs().max()))
