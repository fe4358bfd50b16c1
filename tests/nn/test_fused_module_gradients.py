"""``EchoFusedLinearGRPOLoss`` forms its gradients in the forward pass for chunk-additive losses.

Each case runs the module twice on the same inputs: once as shipped, once with
``chunk_additive`` forced False (the recompute path: backward computes each chunk's logits a
second time). The LM-head GEMMs are counted (``_logits_chunk``); loss, every metric and the
coefficient each row's phase 2 receives must be bit-identical (each is the derivative of the
same per-row operations as the whole loss, `echoloss.loss.chunks.row_coefficients`), and so must
the gradients of ``_input``, ``lin_weight`` and ``bias`` where both paths run the same GEMMs on
the same rows (the device path; the host path's exception is justified in the test). ``B·T = 21`` rows in
chunks of 4 (several chunks, the last one partial), fp32 and bf16.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import echoloss.nn.modules as modules_module
from echoloss import LossConfig
from echoloss._deferred import device_code_path, raise_deferred_errors
from echoloss.nn import EchoFusedLinearGRPOLoss
from echoloss.ops.fused_linear import op
from echoloss.ops.selective_logprobs import reference

B, T, H, V = 3, 7, 5, 11
CHUNK = 4

#: Chunk-additive option sets (per-token policies; any normaliser).
ADDITIVE = {
    "dapo": dict(loss_type="dapo", beta=0.0),
    "dapo-kl-delta": dict(loss_type="dapo", beta=0.04, delta=1.5),
    "bnpo": dict(loss_type="bnpo", beta=0.0, echo_normalization="batch_token_mean"),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.0, max_completion_length=T),
    "cispo": dict(loss_type="cispo", beta=0.0, epsilon_high=3.0),
    "sapo": dict(loss_type="sapo", beta=0.0, sapo_temperature_neg=1.3),
    "luspo": dict(loss_type="luspo", beta=0.0, temperature=0.7, echo_temperature="sampling"),
    "config-mismatch-entropy": dict(
        config=LossConfig(
            kl_tau=0.0, mismatch="token_truncate", entropy_coef=0.01, echo_normalization="sum"
        )
    ),
}
ADDITIVE |= {
    # per-sequence normalisers: each row's divisor is counted from the masks
    "grpo": dict(loss_type="grpo", beta=0.0),
    "grpo-kl": dict(loss_type="grpo", beta=0.04),
    "config-sequence-means": dict(
        config=LossConfig(
            kl_tau=0.0,
            rl_normalization="sequence_mean_token_mean",
            echo_normalization="sequence_mean",
            echo_z_epsilon=1e-3,
            entropy_coef=0.01,
        )
    ),
}
#: Not chunk-additive: sequence-level ratios (each row's weight reads its sequence's rows).
RECOMPUTE = {
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.0),
    "sapo-sequence": dict(loss_type="sapo", importance_sampling_level="sequence", beta=0.0),
    "cispo-sequence": dict(loss_type="cispo", importance_sampling_level="sequence", beta=0.0),
}


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 5:] = 0
    mask[2, 2:4] = 0
    echo = torch.zeros(B, T)
    echo[1, 2] = echo[1, 3] = echo[2, 6] = 0.5
    with torch.no_grad():
        lp = (x.float() @ w.float().T + bias.float()).log_softmax(-1)
        lp = lp.gather(-1, ids[..., None])[..., 0]
    extra = dict(
        echo_weights=echo,
        observation_mask=echo > 0,
        ref_per_token_logps=lp + 0.3 * torch.randn(B, T, generator=g),
        inference_logprobs=lp + 0.2 * torch.randn(B, T, generator=g).clamp(max=0),
    )
    old = lp + 0.5 * torch.randn(B, T, generator=g)
    return x, w, bias, ids, mask, torch.randn(B, generator=g), extra, old.clamp(max=0)


def _gemm_counter(monkeypatch):
    calls = {"n": 0}
    original = op._logits_chunk

    def counted(h, w):
        calls["n"] += 1
        return original(h, w)

    monkeypatch.setattr(op, "_logits_chunk", counted)
    return calls


def _coefficient_recorder(monkeypatch):
    """Every ``d loss / d logprob`` (and ``d entropy``) phase 2 receives, in call order."""
    seen: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    original = reference.backward

    def recorded(*args, **kw):
        seen["a"].append(kw["grad_logprobs"].clone())
        if kw.get("grad_entropy") is not None:
            seen["b"].append(kw["grad_entropy"].clone())
        return original(*args, **kw)

    monkeypatch.setattr(reference, "backward", recorded)
    return seen


def _run(options, dtype, *, off_policy, with_bias, monkeypatch, recompute):
    if recompute:
        monkeypatch.setattr(modules_module, "chunk_additive", lambda cfg, policy_fn: False)
    gemms = _gemm_counter(monkeypatch)
    seen = _coefficient_recorder(monkeypatch)
    x, w, bias, ids, mask, adv, extra, old = _inputs(dtype)
    x.requires_grad_()
    w.requires_grad_()
    bias = bias.requires_grad_() if with_bias else None
    opts = dict(options)
    if "config" not in opts:
        extra.pop("inference_logprobs")
    fn = EchoFusedLinearGRPOLoss(**opts, row_chunk_size=CHUNK)
    kw = dict(extra, old_per_token_logps=old if off_policy else None)
    out = fn(x, w, ids, mask, adv, bias=bias, **kw)
    forward_gemms = gemms["n"]
    out.loss.backward()
    raise_deferred_errors()
    grads = [x.grad, w.grad] + ([bias.grad] if with_bias else [])
    coefficients = {k: torch.cat(v) if v else None for k, v in seen.items()}
    return out, grads, coefficients, forward_gemms, gemms["n"]


def _nonzero(t):
    """The nonzero coefficients, None when there are none (zero rows are skipped by phase 2)."""
    t = None if t is None else t[t != 0]
    return None if t is None or t.numel() == 0 else t


@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(ADDITIVE))
def test_gradients_in_forward_equal_the_recompute_path(name, dtype, off_policy, with_bias,
                                                       device_path, monkeypatch):  # fmt: skip
    """Loss, metrics and every row's coefficient bit-identical; one LM-head GEMM per chunk
    instead of two. Gradients: bit-identical on the device path. On the host path the
    recompute path's backward drops the rows whose coefficient is 0 (e.g. clipped) and
    regroups the others into chunks of 4, so its GEMMs sum the same per-row products of
    ``d weight`` in another grouping and form ``d hidden`` rows in GEMMs of another height;
    both are fp32 accumulations of at most 18 rows, so they may differ by a few roundings of
    2^-24 relative to their partial sums: bounded by ``16 · 2^-24`` of the largest entry
    (measured ≤ 0.7 · 2^-24), plus, for bf16, one bf16 rounding (2^-8) of the entry itself."""
    kw = dict(off_policy=off_policy, with_bias=with_bias, monkeypatch=monkeypatch)
    with device_code_path() if device_path else nullcontext():
        fwd, grads, coef, f_gemms, all_gemms = _run(ADDITIVE[name], dtype, recompute=False, **kw)
        rec, rgrads, rcoef, rf_gemms, rall_gemms = _run(ADDITIVE[name], dtype, recompute=True,
                                                        **kw)  # fmt: skip
    rows = B * T if device_path else B * T - 3  # off CUDA only participating rows are computed
    chunks = -(-rows // CHUNK)
    assert chunks > 1
    assert (f_gemms, all_gemms) == (chunks, chunks)  # nothing recomputed in backward
    assert rf_gemms == chunks and chunks < rall_gemms <= 2 * chunks  # (a chunk whose rows all
    # have zero coefficients is not recomputed)
    assert torch.equal(fwd.loss, rec.loss)
    assert fwd.metrics.keys() == rec.metrics.keys()
    for k in rec.metrics:
        assert torch.equal(fwd.metrics[k], rec.metrics[k]), k
    for k in ("a", "b"):
        ours, theirs = _nonzero(coef[k]), _nonzero(rcoef[k])
        assert (ours is None) == (theirs is None), k
        assert ours is None or torch.equal(ours, theirs), k
    assert (coef["b"] is not None) == ("config" in ADDITIVE[name])  # the entropy bonus
    for a, b in zip(grads, rgrads, strict=True):
        assert a.dtype == dtype
        assert float(a.abs().max()) > 0
        if device_path:
            assert torch.equal(a, b)
            continue
        a, b = a.double(), b.double()
        bound = 16 * 2.0**-24 * float(b.abs().max())
        if dtype == torch.bfloat16:
            bound = bound + 2.0**-8 * b.abs()
        assert bool(((a - b).abs() <= bound).all())


def test_entropy_bonus_is_trained():
    """``config=LossConfig(entropy_coef=...)``: the bonus reaches the weights (the entropy is
    not detached): the gradient formed in the forward equals fp64 autograd through the logits
    module (fp32 rounding over a few dozen operations: 1e-5 of the largest entry), and differs
    from the same loss without the bonus."""
    from echoloss.nn import EchoGRPOLoss

    x, w, _bias, ids, mask, adv, extra, _ = _inputs(torch.float32)
    grads = []
    for coef in (0.0, 0.5):
        weight = w.clone().requires_grad_()
        cfg = LossConfig(kl_tau=0.0, entropy_coef=coef)
        out = EchoFusedLinearGRPOLoss(config=cfg, row_chunk_size=CHUNK)(
            x, weight, ids, mask, adv, echo_weights=extra["echo_weights"]
        )
        out.loss.backward()
        grads.append(weight.grad)
    w64 = w.double().requires_grad_()
    ref = EchoGRPOLoss(config=cfg)(
        x.double() @ w64.T, ids, mask, adv.double(), echo_weights=extra["echo_weights"].double()
    )
    ref.loss.backward()
    scale = float(w64.grad.abs().max())
    assert float((grads[1].double() - w64.grad).abs().max()) <= 1e-5 * scale
    assert float((grads[0] - grads[1]).abs().max()) > 1e-3


@pytest.mark.parametrize("name", sorted(RECOMPUTE))
def test_other_losses_recompute_in_backward(name, monkeypatch):
    _out, grads, _, f_gemms, all_gemms = _run(
        RECOMPUTE[name], torch.float32, off_policy=True, with_bias=True,
        monkeypatch=monkeypatch, recompute=False,
    )  # fmt: skip
    assert f_gemms > 1 and f_gemms < all_gemms <= 2 * f_gemms
    assert float(grads[1].abs().max()) > 0


def test_no_grad_and_frozen_inputs_take_the_forward_only_path(monkeypatch):
    """Without a gradient to form (no_grad, or neither input requiring one) the forward runs
    once and nothing is held for backward."""
    gemms = _gemm_counter(monkeypatch)
    x, w, _bias, ids, mask, adv, extra, _ = _inputs(torch.float32)
    fn = EchoFusedLinearGRPOLoss(loss_type="dapo", beta=0.0, row_chunk_size=CHUNK)
    with torch.no_grad():
        a = fn(x, w.requires_grad_(), ids, mask, adv, echo_weights=extra["echo_weights"])
    b = fn(x, w.detach(), ids, mask, adv, echo_weights=extra["echo_weights"])
    assert not a.loss.requires_grad and not b.loss.requires_grad
    assert torch.equal(a.loss, b.loss)
    assert gemms["n"] == 2 * -(-(B * T - 3) // CHUNK)


def test_second_backward_is_an_error():
    x, w, _bias, ids, mask, adv, _extra, _ = _inputs(torch.float32)
    fn = EchoFusedLinearGRPOLoss(loss_type="dapo", beta=0.0, row_chunk_size=CHUNK)
    out = fn(x, w.requires_grad_(), ids, mask, adv)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time"):
        out.loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["dapo", "grpo-kl", "config-sequence-means", "gspo", "sapo"])
def test_one_chunk_keeps_the_logits_and_matches_the_logits_module(name, dtype, monkeypatch):
    """Every token in one chunk (the default here): one LM-head GEMM in all, forward and
    backward (the logits kept for backward), for chunk-additive losses and the others alike,
    and on the device code path the loss, metrics and gradients of ``EchoGRPOLoss`` on
    ``_input @ lin_weight.T`` bit for bit (the same GEMMs and phases on the same tensors)."""
    from echoloss.nn import EchoGRPOLoss

    options = ADDITIVE.get(name) or RECOMPUTE[name]
    x, w, _bias, ids, mask, adv, extra, _old = _inputs(dtype)
    if "config" not in options:
        extra.pop("inference_logprobs")
    gemms = _gemm_counter(monkeypatch)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    with device_code_path():
        fused = EchoFusedLinearGRPOLoss(**options)(xf, wf, ids, mask, adv, **extra)
        forward_gemms = gemms["n"]
        (fused.loss * 0.7).backward()
        logits = EchoGRPOLoss(**options)(xl @ wl.t(), ids, mask, adv, **extra)
        (logits.loss * 0.7).backward()
        raise_deferred_errors()
    assert (forward_gemms, gemms["n"]) == (1, 1)
    assert torch.equal(fused.loss, logits.loss)
    for k in logits.metrics:
        assert torch.equal(fused.metrics[k], logits.metrics[k]), k
    assert torch.equal(xf.grad, xl.grad) and torch.equal(wf.grad, wl.grad)
