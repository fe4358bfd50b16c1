"""``echo_loss(..., backend="triton")`` against ``backend="reference"`` and the fp64 gold, for every
policy variant: the loss algebra between the two phases is shared PyTorch, so only the logprob,
entropy and ``dlogits`` of the kernels can differ (tolerances in ``_fused_cases.py``)."""

from __future__ import annotations

import pytest
import torch
from _fused_cases import (
    DTYPES,
    HAS_TRITON,
    STAT_TOL,
    assert_grad_close,
    assert_no_worse_than_reference,
    loss_batch,
    registry_configs,
)

from echoloss.loss import LossConfig, echo_loss

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")

VOCAB = 1531  # odd; three blocks of 512 on the interpreter (tests/ops/conftest.py)
POLICIES = registry_configs(
    **{
        "entropy+kl": LossConfig(
            policy="ppo_clip",
            entropy_coef=0.05,
            kl_coef=0.1,
            kl_estimator="k3",
            compute_entropy=True,
        ),
        "sampling_T+seq_norm": LossConfig(
            policy="dppo",
            echo_temperature="sampling",
            rl_normalization="sequence_mean_token_mean",
            echo_normalization="sequence_mean",
        ),
    }
)


def _loss(batch, dtype, backend, config):
    x = batch["logits"].to(dtype).detach().requires_grad_()
    kw = {k: v for k, v in batch.items() if k not in ("logits", "labels")}
    if config.kl_coef:
        kw["ref_logprobs"] = kw["inference_logprobs"] - 0.05
    out = echo_loss(x, batch["labels"], config=config, backend=backend, **kw)
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_loss_and_grad_match_reference(policy, dtype, fused_calls):
    batch = loss_batch(seq_lens=[9, 6, 11], vocab=VOCAB, seed=sorted(POLICIES).index(policy))
    cfg = POLICIES[policy]
    out_f, g_f = _loss(batch, dtype, "triton", cfg)
    assert fused_calls == {"forward": 1, "backward": 1}
    out_r, g_r = _loss(batch, dtype, "reference", cfg)
    atol, rtol = STAT_TOL
    torch.testing.assert_close(out_f.loss, out_r.loss, atol=atol, rtol=rtol)
    assert out_f.metrics.keys() == out_r.metrics.keys()
    for k in out_r.metrics:
        torch.testing.assert_close(out_f.metrics[k], out_r.metrics[k], atol=atol, rtol=rtol)
    # The coefficients are d loss / d logprob: at most max(|A|·ratio, w)/N_tokens ≲ 1 here.
    assert_grad_close(g_f, g_r, coef_scale=1.0)
    idle = ~(batch["rl_mask"] | (batch["echo_weights"] > 0))
    assert bool(idle.any())
    assert torch.equal(g_f[idle], torch.zeros_like(g_f[idle]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("policy", ["dppo", "gspo", "entropy+kl"])
def test_low_precision_error_no_worse_than_reference(policy, dtype):
    """Spec §14.1 at the loss level: the gold is the reference in fp64 on the same rounded logits."""
    batch = loss_batch(seq_lens=[12, 7], vocab=VOCAB, seed=4)
    cfg = POLICIES[policy]
    rounded = dict(batch, logits=batch["logits"].to(dtype).double())
    gold, g_gold = _loss(rounded, torch.float64, "reference", cfg)
    out_f, g_f = _loss(batch, dtype, "triton", cfg)
    out_r, g_r = _loss(batch, dtype, "reference", cfg)
    assert_no_worse_than_reference(out_f.loss, out_r.loss, gold.loss.float(), what="loss")
    assert_no_worse_than_reference(g_f, g_r, g_gold, what="dlogits")


def test_fp32_loss_matches_fp64_gold():
    """fp32 is the gold standard for the fused path: loss within 1e-5 relative of fp64, gradient
    within the fp32 dlogits tolerance."""
    batch = loss_batch(seq_lens=[8, 8, 5], vocab=VOCAB, seed=9)
    cfg = POLICIES["entropy+kl"]
    gold, g_gold = _loss(batch, torch.float64, "reference", cfg)
    out, g = _loss(batch, torch.float32, "triton", cfg)
    torch.testing.assert_close(out.loss.double(), gold.loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g.double(), g_gold, atol=1e-5, rtol=1e-4)


def test_no_participating_row_gives_zero_grad():
    batch = loss_batch(seq_lens=[5, 4], vocab=VOCAB, seed=2)
    batch["rl_mask"] = torch.zeros_like(batch["rl_mask"])
    batch["echo_weights"] = torch.zeros_like(batch["echo_weights"])
    out, g = _loss(batch, torch.bfloat16, "triton", POLICIES["dppo"])
    assert float(out.loss.detach()) == 0.0
    assert torch.equal(g, torch.zeros_like(g))


# the interpreter runs the kernels in numpy, which warns on inf - inf: the NaN is the point here
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("poison", ["nan", "+inf", "-inf at label"])
def test_non_finite_logits_are_found_from_the_kernel_statistics(poison):
    """The O(N) check reads the kernels' [N] logprobs: a NaN or +inf anywhere in a row (any
    vocabulary block) or -inf at the label makes that row's logprob non-finite, so the fused
    path names the row like the reference does; a row that takes part in no term is not read."""
    from echoloss import LossInputs

    g = torch.Generator().manual_seed(5)
    n = 6
    logits = torch.randn(n, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    x = LossInputs(
        labels=labels,
        rl_mask=torch.tensor([True, True, False, True, False, False]),
        advantages=torch.ones(n),
        inference_logprobs=torch.full((n,), -1.0),
    )
    bad = logits.clone()
    if poison == "nan":
        bad[3, 1200] = float("nan")  # third vocabulary block
    elif poison == "+inf":
        bad[3, 700] = float("inf")
    else:
        bad[3, labels[3]] = float("-inf")
    bad[4, 5] = float("nan")  # idle row: never read
    for backend in ("triton", "reference"):
        with pytest.raises(ValueError, match=r"logits row 3 must be a finite log-probability"):
            echo_loss(bad, x, backend=backend)
    out = echo_loss(
        logits.masked_fill(torch.arange(n)[:, None] == 4, float("nan")), x, backend="triton"
    )
    assert torch.isfinite(out.loss)
