"""The ``echoloss.nn`` modules' echo term against TRL's pre-scaling: the modules hand the echo
normaliser to the loss (its own count, the batch size, or a given count as the divisor), TRL's
adapter pre-divides the weights (`scale_echo_weights`, summed). Same value, same gradient; and
the sequence ids a call builds are kept for the next call of the same shape."""

from __future__ import annotations

import pytest
import torch

from echoloss._deferred import device_code_path, raise_deferred_errors
from echoloss.nn import EchoFusedLinearGRPOLoss, EchoGRPOLoss
from echoloss.nn.grpo import scale_echo_weights

B, T, V, H = 3, 7, 11, 5


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[0, 5:] = 0  # padding
    mask[2, 3:] = 0
    echo = torch.zeros(B, T)
    echo[0, 1] = 0.5
    echo[0, 3] = 0.25
    echo[1, 2] = echo[1, 6] = 0.5  # row 2 has no echo token: it still counts in B
    echo[0, 6] = 0.5  # under a zero attention mask: not echoed
    obs = torch.zeros(B, T, dtype=torch.bool)
    obs[0, 2] = obs[1, 0] = obs[2, 1] = True  # observation tokens that are not echoed
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, mask, echo, obs


def _expected(logits, ids, mask, echo, obs, normalization, items):
    """TRL's echo term: ``Σ_t scale_echo_weights(w)_t · (-log p_t)`` in fp64."""
    valid = mask > 0
    w = torch.where(valid, echo, 0.0).double()
    echoed = w > 0
    own = int(echoed.sum())
    scaled = scale_echo_weights(
        w,
        (obs & valid) | echoed,
        normalization=normalization,
        num_echo_items_in_batch=own if items is None else float(items),
        num_processes=1,
        accumulation_steps=1,
        steps_per_generation=1,
    )
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    return (scaled * -logp).sum()


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize(
    ("normalization", "items"),
    [
        ("token_mean", None),
        ("token_mean", 9),
        ("token_mean", "tensor"),
        ("batch_token_mean", None),
        ("sequence_mean", None),
    ],
)
@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
def test_echo_term_equals_trl_pre_scaled_weights(
    normalization, items, loss_type, fused, device_path
):
    """Advantages 0, so the loss and its gradient are the echo term's. The module computes in
    fp32 (the weights divided once in the sum, TRL's each before it), the reference in fp64
    from the same fp32 inputs: a sum of 5 positive terms and a log-softmax over 11 entries,
    each a few fp32 roundings (2^-24 relative): rtol 2e-6 on the loss, and 1e-5 with atol 1e-7
    (the gradients' entries are at most 0.25, many are 0) on the gradients."""
    ids, mask, echo, obs = _batch()
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    count = None if items is None else 9
    passed = torch.tensor(9.0) if items == "tensor" else items
    module = (EchoFusedLinearGRPOLoss if fused else EchoGRPOLoss)(
        beta=0.0,
        loss_type=loss_type,
        echo_normalization=normalization,
        max_completion_length=T,
    )
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    logits = leaves[0] @ leaves[1].T
    args = (ids, mask, torch.zeros(B))
    kw = dict(echo_weights=echo, observation_mask=obs, num_echo_items_in_batch=passed)
    context = device_code_path() if device_path else torch.enable_grad()
    with context:
        out = module(*leaves, *args, **kw) if fused else module(logits, *args, **kw)
        out.loss.backward()
        raise_deferred_errors()
    ref_leaves = [hidden.double().requires_grad_(), weight.double().requires_grad_()]
    expected = _expected(
        ref_leaves[0] @ ref_leaves[1].T, ids, mask, echo, obs, normalization, count
    )
    expected.backward()
    torch.testing.assert_close(out.loss.double(), expected, rtol=2e-6, atol=0)
    torch.testing.assert_close(out.metrics["loss_echo/all"].double(), expected, rtol=2e-6, atol=0)
    for leaf, ref in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=1e-5, atol=1e-7)


def _arange_launches(module, *args, **kw) -> int:
    from benchmarks.counting import count_ops

    with count_ops() as c:
        module(*args, **kw).loss.backward()
    return c.launches.get("aten::arange", 0)


def test_sequence_ids_are_kept_for_the_next_call_of_the_same_shape():
    """grpo reads per-sequence means: its first call with ``B`` completions builds the ids
    (an arange, expanded over ``T``: a view), the next with ``B`` reuses the arange whatever
    its ``T``, a new ``B`` builds it again; ids made under inference mode are not kept
    (autograd cannot save them for a later training call)."""
    ids, mask, echo, _obs = _batch()
    module = EchoGRPOLoss(beta=0.0, loss_type="grpo")
    adv = torch.tensor([1.0, -0.5, 0.25])

    def logits(b=B, t=T):
        return torch.randn(b, t, V).requires_grad_()

    first = _arange_launches(module, logits(), ids, mask, adv, echo_weights=echo)
    assert _arange_launches(module, logits(), ids, mask, adv, echo_weights=echo) == first - 1
    shorter = (ids[:, :-1], mask[:, :-1], adv)  # a new T, the same B
    assert _arange_launches(module, logits(t=T - 1), *shorter, echo_weights=echo[:, :-1]) == (
        first - 1
    )
    short = (ids[:2], mask[:2], adv[:2])  # a new B
    assert _arange_launches(module, logits(2), *short, echo_weights=echo[:2]) == first
    with torch.inference_mode():
        module(torch.randn(B, T, V), ids, mask, adv, echo_weights=echo)
    out = module(logits(), ids, mask, adv, echo_weights=echo)  # kept ids: not inference ones
    out.loss.backward()
    fresh = EchoGRPOLoss(beta=0.0, loss_type="grpo")
    x = logits()
    torch.testing.assert_close(
        module(x, ids, mask, adv, echo_weights=echo).loss,
        fresh(x, ids, mask, adv, echo_weights=echo).loss,
        rtol=0,
        atol=0,
    )
