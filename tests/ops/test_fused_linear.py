"""Fused-linear path: ``linear_selective_logprobs`` / ``echo_loss_from_hidden`` against the logits
path on ``hidden @ weight.T``, chunked against unchunked, both backends, and input errors."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _fused_cases import (
    DEVICE,
    HAS_TRITON,
    STAT_TOL,
    assert_no_worse_than_reference,
    loss_batch,
    registry_configs,
)

from echoloss import LossConfig, echo_loss, echo_loss_from_hidden
from echoloss.ops.fused_linear import default_linear_chunk_size, linear_selective_logprobs, op
from echoloss.ops.selective_logprobs import selective_logprobs

H, V = 24, 1531
BACKENDS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="needs triton")),
]
# fused-linear vs logits path, same backend and dtype. fp32: the logits of a row come from a GEMM
# over a chunk instead of the whole batch (BLAS may block differently: a few ulps of |z| ≲ 10),
# and the weight gradient sums chunk products (reassociation): 1e-5. bf16: the logits and
# dlogits round to bf16 in both paths, but a few-ulp fp32 difference in z can flip a rounding:
# one bf16 ulp (2^-7 relative) on a handful of elements, which the gradients' GEMMs average.
LINEAR_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2.0**-6)}


#: Vocabulary rows per weight-gradient slice in these tests: 16 slices at V = 1531 instead of
#: the default's one (2^24 / H rows), so a slice that reads the wrong columns changes the result.
#: The Triton vocabulary blocks are lowered likewise by tests/ops/conftest.py (3 blocks), and
#: the tests pass chunk sizes below the number of rows (several chunks).
SLICE_ROWS = 100


@pytest.fixture(autouse=True)
def _several_weight_gradient_slices(monkeypatch):
    monkeypatch.setattr(op, "_GRAD_WEIGHT_SLICE_ELEMENTS", SLICE_ROWS * H)


def test_tiled_loops_iterate_more_than_once():
    from _fused_cases import INTERPRETER_BLOCK_V

    assert (1 << 24) // H >= V  # the default: one slice at this size
    assert -(-V // SLICE_ROWS) > 1 and -(-V // INTERPRETER_BLOCK_V) > 1


def test_bf16_weight_gradient_slices_read_their_own_columns():
    """The fp32-accumulated bf16 weight gradient, slice by slice, equals ``dz.T @ h`` computed in
    fp64 from the same bf16 operands: each slice's product is one bf16 GEMM (fp32 accumulation,
    one bf16 rounding of each product element: 2^-8 relative) added in fp32. Both the first
    chunk (written into a NaN-filled ``torch.empty``, tests/ops/conftest.py) and a second one
    (added)."""
    g = torch.Generator().manual_seed(11)
    c = 37
    dz = torch.randn(2, c, V, generator=g).to(torch.bfloat16)
    h = torch.randn(2, c, H, generator=g).to(torch.bfloat16)
    acc = op._add_grad_weight(None, dz[0], h[0], torch.float32)
    gold = dz[0].double().t() @ h[0].double()
    torch.testing.assert_close(acc.double(), gold, atol=0.05, rtol=2.0**-7)
    acc = op._add_grad_weight(acc, dz[1], h[1], torch.float32)
    gold += dz[1].double().t() @ h[1].double()
    torch.testing.assert_close(acc.double(), gold, atol=0.05, rtol=2.0**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_first_chunk_writes_what_zeros_plus_the_product_would(dtype):
    """The first chunk writes its product into the accumulator instead of adding it to zeros:
    bit for bit the same (``0 + x = x``), and so are the later chunks added to it, here over
    three chunks (several weight-gradient slices each for bf16)."""
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator().manual_seed(3)
    dz = torch.randn(3, 11, V, generator=g, dtype=torch.float64).to(dtype)
    h = torch.randn(3, 11, H, generator=g, dtype=torch.float64).to(dtype)
    written = None
    added = torch.zeros(V, H, dtype=acc_dtype)
    for k in range(3):
        written = op._add_grad_weight(written, dz[k], h[k], acc_dtype)
        added = op._add_grad_weight(added, dz[k], h[k], acc_dtype)
        assert written.dtype == acc_dtype and written.shape == (V, H)
        assert torch.equal(written, added), k


def _as_before_first_chunk_write(monkeypatch):
    """``_add_grad_weight`` as it was: the accumulator zero-filled, every chunk added."""
    add = op._add_grad_weight

    def zero_filled(acc, dz, h, acc_dtype):
        if acc is None:
            acc = torch.zeros(dz.shape[1], h.shape[1], dtype=acc_dtype, device=dz.device)
        return add(acc, dz, h, acc_dtype)

    monkeypatch.setattr(op, "_add_grad_weight", zero_filled)


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4
    return w.to(dtype).to(DEVICE)


def _hidden(n, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, generator=g, dtype=torch.float64) * 1.5).to(dtype).to(DEVICE)


def _batch(seq_lens, seed=0):
    """A loss batch whose logits are replaced by hidden states (the loss fields are reused)."""
    b = loss_batch(seq_lens=seq_lens, vocab=V, seed=seed)
    b.pop("logits")
    return b


def _grads(out, *tensors):
    return torch.autograd.grad(out, [t for t in tensors if t.requires_grad], allow_unused=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", ["scalar", "per_token"])
def test_linear_logprobs_equal_the_logits_path(backend, dtype, temperature):
    n = 29
    h = _hidden(n, dtype).requires_grad_()
    w = _weights(dtype).requires_grad_()
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, V, (n,), generator=g).to(DEVICE)
    mask = (torch.rand(n, generator=g) > 0.3).to(DEVICE)
    labels[~mask] = -100  # never read
    temp = 0.8 if temperature == "scalar" else (torch.rand(n, generator=g) + 0.5).to(DEVICE)
    cot = torch.randn(2, n, generator=g, dtype=torch.float64).to(DEVICE)

    lp, ent = linear_selective_logprobs(
        h,
        w,
        labels,
        temperature=temp,
        return_entropy=True,
        mask=mask,
        chunk_size=6,
        backend=backend,
    )
    gh, gw = _grads((lp * cot[0]).sum() + (ent * cot[1]).sum(), h, w)
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lp2, ent2 = selective_logprobs(
        h2 @ w2.t(), labels, temperature=temp, return_entropy=True, mask=mask, backend=backend
    )
    gh2, gw2 = _grads((lp2 * cot[0]).sum() + (ent2 * cot[1]).sum(), h2, w2)
    atol, rtol = STAT_TOL
    torch.testing.assert_close(lp, lp2, atol=atol, rtol=rtol)
    torch.testing.assert_close(ent, ent2, atol=atol, rtol=rtol)
    atol, rtol = LINEAR_TOL[dtype]
    torch.testing.assert_close(gh.float(), gh2.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(gw.float(), gw2.float(), atol=atol, rtol=rtol)
    assert gh.dtype == h.dtype and gw.dtype == w.dtype
    assert torch.equal(gh[~mask], torch.zeros_like(gh[~mask]))


POLICIES = registry_configs(
    entropy_bonus=LossConfig(policy="ppo_clip", entropy_coef=0.05, compute_entropy=True),
    sampling_T=LossConfig(policy="dppo", echo_temperature="sampling"),
)


def _hidden_loss(batch, h, w, config, backend, *, chunk_size=None, temperature=None):
    kw = {k: v for k, v in batch.items() if k != "labels"}
    if temperature is not None:
        kw["temperature"] = temperature
    return echo_loss_from_hidden(
        h, w, batch["labels"], config=config, backend=backend, chunk_size=chunk_size, **kw
    )


def _logits_loss(batch, h, w, config, backend, *, temperature=None):
    kw = {k: v for k, v in batch.items() if k != "labels"}
    if temperature is not None:
        kw["temperature"] = temperature
    return echo_loss(h @ w.t(), batch["labels"], config=config, backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_echo_loss_from_hidden_equals_echo_loss(policy, backend):
    batch = _batch([10, 7, 9], seed=sorted(POLICIES).index(policy))
    n = batch["labels"].numel()
    h = _hidden(n, torch.float32).requires_grad_()
    w = _weights(torch.float32).requires_grad_()
    cfg = POLICIES[policy]
    out = _hidden_loss(batch, h, w, cfg, backend, chunk_size=4)
    gh, gw = torch.autograd.grad(out.loss, [h, w])
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _logits_loss(batch, h2, w2, cfg, backend)
    gh2, gw2 = torch.autograd.grad(ref.loss, [h2, w2])
    atol, rtol = STAT_TOL
    torch.testing.assert_close(out.loss, ref.loss, atol=atol, rtol=rtol)
    assert out.metrics.keys() == ref.metrics.keys()
    for k in ref.metrics:
        torch.testing.assert_close(out.metrics[k], ref.metrics[k], atol=atol, rtol=rtol)
    atol, rtol = LINEAR_TOL[torch.float32]
    torch.testing.assert_close(gh, gh2, atol=atol, rtol=rtol)
    torch.testing.assert_close(gw, gw2, atol=atol, rtol=rtol)
    idle = ~(batch["rl_mask"] | (batch["echo_weights"] > 0))
    assert torch.equal(gh[idle], torch.zeros_like(gh[idle]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_equals_unchunked(backend):
    batch = _batch([13, 11], seed=3)
    n = batch["labels"].numel()
    cfg = POLICIES["entropy_bonus"]
    results = []
    for chunk in (1, 5, None):
        h = _hidden(n, torch.float32).requires_grad_()
        w = _weights(torch.float32).requires_grad_()
        out = _hidden_loss(batch, h, w, cfg, backend, chunk_size=chunk)
        results.append((out.loss.detach(), *torch.autograd.grad(out.loss, [h, w])))
    assert default_linear_chunk_size(V) >= n  # None is one chunk here
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            # Same rows, same dtype: only the GEMM row blocking and the order of the weight
            # gradient's chunk sum differ.
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_chunks_run_the_kernels(fused_calls):
    batch = _batch([6, 5], seed=1)
    n = batch["labels"].numel()
    h = _hidden(n, torch.bfloat16).requires_grad_()
    w = _weights(torch.bfloat16).requires_grad_()
    out = _hidden_loss(batch, h, w, POLICIES["dppo"], "triton", chunk_size=3)
    out.loss.backward()
    part = int((batch["rl_mask"] | (batch["echo_weights"] > 0)).sum())
    chunks = -(-part // 3)
    assert fused_calls["forward"] == chunks and 1 <= fused_calls["backward"] <= chunks


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_error_no_worse_than_logits_path(backend):
    """Spec §14.1 for the fused-linear path: against the fp64 loss on the same bf16-rounded hidden states
    and weight, its gradients are at most 2x as far off as ``echo_loss`` on bf16 logits (whose
    weight gradient is one bf16 GEMM; ours sums bf16 chunk products in fp32)."""
    batch = _batch([16, 12], seed=6)
    n = batch["labels"].numel()
    cfg = POLICIES["dppo"]
    h16, w16 = _hidden(n, torch.bfloat16), _weights(torch.bfloat16)
    hg, wg = h16.double().requires_grad_(), w16.double().requires_grad_()
    gold = _logits_loss(batch, hg, wg, cfg, "reference")
    g_gold = torch.autograd.grad(gold.loss, [hg, wg])
    hf, wf = h16.clone().requires_grad_(), w16.clone().requires_grad_()
    fused_out = _hidden_loss(batch, hf, wf, cfg, backend, chunk_size=7)
    g_f = torch.autograd.grad(fused_out.loss, [hf, wf])
    hr, wr = h16.clone().requires_grad_(), w16.clone().requires_grad_()
    ref = _logits_loss(batch, hr, wr, cfg, "reference")
    g_r = torch.autograd.grad(ref.loss, [hr, wr])
    assert_no_worse_than_reference(fused_out.loss, ref.loss, gold.loss, what="loss")
    for name, f, r, gd in zip(("hidden.grad", "weight.grad"), g_f, g_r, g_gold, strict=True):
        assert_no_worse_than_reference(f, r, gd, what=name)


@pytest.mark.parametrize("echo_temperature", ["one", "sampling"])
@pytest.mark.parametrize("temperature", ["scalar", "per_token"])
def test_echo_temperature_rule_matches_echo_loss(echo_temperature, temperature):
    batch = _batch([9, 9], seed=8)
    n = batch["labels"].numel()
    t = 0.7 if temperature == "scalar" else torch.linspace(0.6, 1.4, n, dtype=torch.float64)
    cfg = LossConfig(policy="reinforce", echo_temperature=echo_temperature, compute_entropy=True)
    h, w = _hidden(n, torch.float64).requires_grad_(), _weights(torch.float64)
    out = _hidden_loss(batch, h, w, cfg, "reference", temperature=t)
    ref = _logits_loss(batch, h, w, cfg, "reference", temperature=t)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(
        out.metrics["entropy/all"], ref.metrics["entropy/all"], atol=1e-12, rtol=1e-12
    )


def test_idle_rows_are_never_read():
    """Rows outside ``rl_mask | echo`` skip the matmul: NaN hidden states and junk labels there
    change nothing, and their gradient is exactly zero."""
    batch = _batch([8, 6], seed=2)
    n = batch["labels"].numel()
    idle = ~(batch["rl_mask"] | (batch["echo_weights"] > 0))
    h = _hidden(n, torch.float32)
    w = _weights(torch.float32).requires_grad_()
    clean = _hidden_loss(batch, h.clone().requires_grad_(), w, POLICIES["dppo"], "reference")
    dirty_h = h.clone()
    dirty_h[idle] = float("nan")
    dirty_h.requires_grad_()
    batch["labels"] = batch["labels"].masked_fill(idle, -100)
    dirty = _hidden_loss(batch, dirty_h, w, POLICIES["dppo"], "reference")
    assert torch.equal(clean.loss, dirty.loss)
    dirty.loss.backward()
    assert torch.equal(dirty_h.grad[idle], torch.zeros_like(dirty_h.grad[idle]))
    assert torch.isfinite(w.grad).all()


def test_frozen_weight_or_hidden():
    batch = _batch([7], seed=4)
    n = batch["labels"].numel()
    h, w = _hidden(n, torch.float32).requires_grad_(), _weights(torch.float32)
    out = _hidden_loss(batch, h, w, POLICIES["reinforce"], "reference")
    out.loss.backward()
    assert h.grad is not None and w.grad is None
    h2, w2 = _hidden(n, torch.float32), _weights(torch.float32).requires_grad_()
    _hidden_loss(batch, h2, w2, POLICIES["reinforce"], "reference").loss.backward()
    assert w2.grad is not None and torch.isfinite(w2.grad).all()


def test_no_participating_row():
    batch = _batch([5], seed=0)
    batch["rl_mask"] = torch.zeros_like(batch["rl_mask"])
    batch["echo_weights"] = torch.zeros_like(batch["echo_weights"])
    n = batch["labels"].numel()
    h, w = _hidden(n, torch.float32).requires_grad_(), _weights(torch.float32).requires_grad_()
    out = _hidden_loss(batch, h, w, POLICIES["dppo"], "reference")
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        (lambda a: a.update(hidden=a["hidden"][None]), TypeError, r"hidden must be .*\[N, H\]"),
        (lambda a: a.update(weight=a["weight"].t()), ValueError, r"not its transpose"),
        (
            lambda a: a.update(weight=a["weight"].double()),
            TypeError,
            r"weight must be of hidden's dtype",
        ),
        (lambda a: a.update(hidden=a["hidden"].long()), TypeError, r"hidden must be a float"),
        (lambda a: a.update(labels=a["labels"][:-1]), ValueError, r"labels must be of shape"),
        (
            lambda a: a.update(labels=a["labels"] + V),
            ValueError,
            r"labels\[\d+\] must be in \[0, V=1531\)",
        ),
        (lambda a: a.update(rl_mask=a["rl_mask"].float()), TypeError, r"rl_mask must be a bool"),
        (lambda a: a.update(chunk_size=0), ValueError, r"chunk_size must be None or an int"),
        (
            lambda a: a.update(config={"policy": "dppo"}),
            TypeError,
            r"config must be an echoloss.LossConfig",
        ),
        (lambda a: a.update(temperature=0.0), ValueError, r"temperature must be a positive"),
        (lambda a: a.update(backend="cuda"), ValueError, r"backend must be one of"),
    ],
)
def test_errors_name_the_argument_and_the_fix(change, exc, match):
    batch = _batch([4, 3], seed=0)
    n = batch["labels"].numel()
    args = dict(batch, hidden=_hidden(n, torch.float32), weight=_weights(torch.float32))
    change(args)
    hidden, weight, labels = args.pop("hidden"), args.pop("weight"), args.pop("labels")
    with pytest.raises(exc, match=match):
        echo_loss_from_hidden(hidden, weight, labels, **args)


# ------------------------------------------------------------ gradients formed in the forward

FORWARD_GRADIENT_CONFIGS = {
    "dppo": LossConfig(),
    "ppo-kl-entropy-bonus": LossConfig(
        policy="ppo_clip", kl_coef=0.1, entropy_coef=0.05, compute_entropy=True
    ),
    "cispo-batch-token-mean": LossConfig(policy="cispo", echo_normalization="batch_token_mean"),
    "reinforce-token-mismatch": LossConfig(policy="reinforce", mismatch="token_truncate"),
    "dppo-constant-sum": LossConfig(
        rl_normalization="token_sum_constant",
        rl_normalization_constant=7.0,
        echo_normalization="sum",
    ),
    "sft": LossConfig(mode="sft"),
    "dppo-sequence-means": LossConfig(
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
        echo_z_epsilon=1e-3,
    ),
    "ppo-sequence-token-sum": LossConfig(
        policy="ppo_clip", rl_normalization="sequence_mean_token_sum", entropy_coef=0.05
    ),
    "sft-sequence-mean": LossConfig(mode="sft", rl_normalization="sequence_mean_token_mean"),
}


def _recompute_only(monkeypatch):
    import echoloss.loss.hidden as hidden_module

    monkeypatch.setattr(hidden_module, "chunk_additive", lambda cfg, policy_fn: False)


def _gemm_counter(monkeypatch):
    calls = {"n": 0}
    original = op._logits_chunk

    def counted(h, w):
        calls["n"] += 1
        return original(h, w)

    monkeypatch.setattr(op, "_logits_chunk", counted)
    return calls


@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(FORWARD_GRADIENT_CONFIGS))
def test_gradients_in_forward_equal_the_recompute_path(name, backend, dtype, device_path,
                                                       monkeypatch):  # fmt: skip
    """A chunk-additive loss forms its gradients in the forward pass (one LM-head GEMM per chunk,
    counted) and gets the loss, metrics and gradients of the recompute path bit for bit: the
    same GEMMs on the same rows, and each row's coefficient is the loss algebra's own
    derivative (the same operations per row). 5 chunks of at most 4 rows (the chunk loop runs
    more than once), given normalisers for half of the configurations."""
    from contextlib import nullcontext

    from echoloss import Normalizers
    from echoloss._deferred import device_code_path, raise_deferred_errors

    cfg = FORWARD_GRADIENT_CONFIGS[name]
    batch = _batch([9, 6, 5], seed=4)
    if cfg.mode == "sft":
        batch["echo_weights"] = torch.zeros_like(batch["echo_weights"])
    n = batch["labels"].numel()
    if cfg.kl_coef:
        g = torch.Generator().manual_seed(9)
        batch["ref_logprobs"] = -torch.rand(n, generator=g).to(DEVICE)
    norms = None
    if name in ("dppo", "cispo-batch-token-mean", "reinforce-token-mismatch"):
        norms = Normalizers(rl_tokens=40, echo_tokens=30, echo_batches=2)
    if name == "dppo-sequence-means":
        norms = Normalizers(rl_sequences=7, echo_sequences=5)
    results = []
    for recompute in (False, True):
        if recompute:
            _recompute_only(monkeypatch)
        gemms = _gemm_counter(monkeypatch)
        h = _hidden(n, dtype).requires_grad_()
        w = _weights(dtype).requires_grad_()
        kw = {k: v for k, v in batch.items() if k != "labels"}
        with device_code_path() if device_path else nullcontext():
            out = echo_loss_from_hidden(h, w, batch["labels"], config=cfg, normalizers=norms,
                                        backend=backend, chunk_size=4, **kw)  # fmt: skip
            forward_gemms = gemms["n"]
            out.loss.backward()
            raise_deferred_errors()
        results.append((out, h.grad, w.grad, forward_gemms, gemms["n"]))
    (fwd, gh, gw, f_gemms, all_gemms), (rec, gh2, gw2, rf_gemms, rall_gemms) = results
    rows = n if device_path else int((batch["rl_mask"] | (batch["echo_weights"] > 0)).sum())
    chunks = -(-rows // 4)
    assert chunks > 1
    assert (f_gemms, all_gemms) == (chunks, chunks)  # no logits recomputed in backward
    assert (rf_gemms, rall_gemms) == (chunks, 2 * chunks)
    assert torch.equal(fwd.loss, rec.loss)
    for k in rec.metrics:
        assert torch.equal(fwd.metrics[k], rec.metrics[k]), k
    assert gh.dtype == dtype and gw.dtype == dtype
    assert torch.equal(gh, gh2) and torch.equal(gw, gw2)
    assert float(gw.abs().max()) > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["dppo", "ppo-kl-entropy-bonus", "gspo"])
def test_one_chunk_keeps_its_logits_and_is_the_logits_path_bit_for_bit(name, dtype, backend,
                                                                       monkeypatch):  # fmt: skip
    """All rows in one chunk (the device path: every row, as on CUDA): one LM-head GEMM in
    all, forward and backward (the logits are kept for backward, where phase 2 overwrites them
    with their gradient), for chunk-additive losses and others (``gspo``) alike, and the loss,
    metrics and both gradients of logits-then-loss bit for bit (the reference phases; the
    interpreted Triton ones within an fp32 ulp, see below): the same GEMMs on the same tensors
    and the same phase 2 with the same coefficients, also for an incoming gradient other than
    1 (``loss / 3``: the logits path's coefficients carry it, and so do these)."""
    from echoloss._deferred import device_code_path, raise_deferred_errors

    cfg = LossConfig(policy="gspo") if name == "gspo" else FORWARD_GRADIENT_CONFIGS[name]
    batch = _batch([9, 6, 5], seed=4)
    n = batch["labels"].numel()
    if cfg.kl_coef:
        g = torch.Generator().manual_seed(9)
        batch["ref_logprobs"] = -torch.rand(n, generator=g).to(DEVICE)
    gemms = _gemm_counter(monkeypatch)
    h0, w0 = _hidden(n, dtype), _weights(dtype)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    hr, wr = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    with device_code_path():
        out = _hidden_loss(batch, h, w, cfg, backend, chunk_size=n)
        forward_gemms = gemms["n"]
        (out.loss / 3).backward()
        ref = _logits_loss(batch, hr, wr, cfg, backend)
        (ref.loss / 3).backward()
        raise_deferred_errors()
    assert (forward_gemms, gemms["n"]) == (1, 1)
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    pairs = [(out.loss, ref.loss), (h.grad, hr.grad), (w.grad, wr.grad)]
    pairs += [(out.metrics[k], ref.metrics[k]) for k in ref.metrics]
    for got, want in pairs:
        if backend == "reference":
            assert torch.equal(got, want)
        else:
            # Under the Triton interpreter the phases are numpy, whose vectorised exp/log can
            # round an fp32 ulp away from their scalar tails depending on where the arrays lie
            # in memory: the two calls agree bit for bit when run alone, not always after
            # another test has run (4e-9 in dz; the entropy bonus's gradient sums cancel to
            # 1.4e-5 relative). The compiled kernels are compared bit for bit on a GPU
            # (tests/ops/test_fused_gpu.py).
            atol, rtol = (1e-5, 1e-4) if dtype == torch.float32 else LINEAR_TOL[dtype]
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert float(w.grad.abs().max()) > 0


@pytest.mark.parametrize("entry", ["function", "module"])
def test_one_chunk_issues_the_lm_head_gemm_first(entry):
    """On the device code path with every row in one chunk, the LM head's GEMM is the first
    aten op the call issues (views aside), before the checks and setup of the loss: an idle
    GPU starts on it while the host prepares the rest. Off the device path (rows chosen on
    the host first) it is not, and without a recorded gradient nothing is issued early."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from echoloss._deferred import device_code_path, raise_deferred_errors
    from echoloss.nn import EchoFusedLinearGRPOLoss

    class Order(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func._schema.name.startswith(("aten::t", "aten::view", "aten::reshape")):
                self.ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    batch = _batch([9, 6, 5], seed=4)
    n = batch["labels"].numel()

    def prepared(h, w):
        """The call with its inputs built outside the recorder."""
        if entry == "function":
            return lambda: _hidden_loss(batch, h, w, POLICIES["dppo"], "reference")
        b = 4
        t = n // b
        args = (
            h[: b * t].reshape(b, t, H), w, batch["labels"][: b * t].reshape(b, t),
            batch["rl_mask"][: b * t].reshape(b, t).float(), torch.ones(b),
        )  # fmt: skip
        echo = batch["echo_weights"][: b * t].reshape(b, t)
        loss_fn = EchoFusedLinearGRPOLoss(loss_type="dapo", beta=0.0)
        return lambda: loss_fn(*args, echo_weights=echo)

    firsts = []
    for device_path, grad in ((True, True), (False, True), (True, False)):
        h = _hidden(n, torch.float32).requires_grad_(grad)
        w = _weights(torch.float32).requires_grad_(grad)
        run = prepared(h, w)
        with device_code_path() if device_path else contextlib.nullcontext():
            with Order() as order:
                run()
            raise_deferred_errors()
        firsts.append(order.ops[0])
    assert firsts[0] == "aten::mm", firsts
    assert firsts[1] != "aten::mm" and firsts[2] != "aten::mm", firsts


@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
def test_one_chunk_second_backward_recomputes_the_overwritten_logits(device_path, monkeypatch):
    """The kept logits hold their gradient after the first backward: a second backward through
    the same graph (``retain_graph=True``) computes them again (one more GEMM) and gets the same
    gradients bit for bit; the host path keeps the rows whose coefficients are zero in the
    chunk (exact zeros from phase 2), as the kept logits are aligned with them."""
    from contextlib import nullcontext

    from echoloss._deferred import device_code_path, raise_deferred_errors

    batch = _batch([9, 6, 5], seed=2)
    n = batch["labels"].numel()
    gemms = _gemm_counter(monkeypatch)
    h = _hidden(n, torch.float32).requires_grad_()
    w = _weights(torch.float32).requires_grad_()
    with device_code_path() if device_path else nullcontext():
        out = _hidden_loss(batch, h, w, POLICIES["dppo"], "reference", chunk_size=n)
        out.loss.backward(retain_graph=True)
        first = (h.grad.clone(), w.grad.clone(), gemms["n"])
        h.grad, w.grad = None, None
        out.loss.backward()
        raise_deferred_errors()
    assert first[2] == 1 and gemms["n"] == 2
    assert torch.equal(h.grad, first[0]) and torch.equal(w.grad, first[1])


def test_one_chunk_without_a_gradient_keeps_nothing(monkeypatch):
    """No gradient recorded (``torch.no_grad()`` or frozen inputs): the chunk's logits are
    dropped after phase 1 (nothing kept for a backward that cannot come)."""
    kept = []
    original = op._LinearLogprobsFn.forward

    def spy(ctx, *args):
        out = original(ctx, *args)
        kept.append(ctx.kept_logits is not None)
        return out

    monkeypatch.setattr(op._LinearLogprobsFn, "forward", staticmethod(spy))
    batch = _batch([9, 6], seed=1)
    n = batch["labels"].numel()
    h, w = _hidden(n, torch.float32), _weights(torch.float32)
    _hidden_loss(batch, h, w, POLICIES["dppo"], "reference", chunk_size=n)
    with torch.no_grad():
        _hidden_loss(batch, h.requires_grad_(), w, POLICIES["dppo"], "reference", chunk_size=n)
    _hidden_loss(batch, h, w, POLICIES["dppo"], "reference", chunk_size=n)
    assert kept == [False, False, True]


@pytest.mark.parametrize("name", ["gspo", "sequence-mismatch", "custom"])
def test_other_losses_recompute_in_backward(name, monkeypatch):
    """Sequence-level ratios and mismatch weights (a row's weight depends on its sequence's
    other logprobs), and custom policies, are not chunk-additive: backward recomputes the
    logits (a second GEMM per chunk with a live row)."""
    from echoloss import PolicyOutput

    cfg = {
        "gspo": LossConfig(policy="gspo", rl_normalization="sequence_mean_token_mean"),
        "sequence-mismatch": LossConfig(mismatch="sequence_mask"),
        "custom": LossConfig(policy="custom", allow_echo_with_custom_policy=True),
    }[name]

    def custom(inputs, config):
        return PolicyOutput(-inputs.advantages * inputs.logprobs, {})

    policy_fn = custom if name == "custom" else None
    batch = _batch([9, 6, 5], seed=4)
    n = batch["labels"].numel()
    gemms = _gemm_counter(monkeypatch)
    h = _hidden(n, torch.float32).requires_grad_()
    w = _weights(torch.float32).requires_grad_()
    kw = {k: v for k, v in batch.items() if k != "labels"}
    out = echo_loss_from_hidden(h, w, batch["labels"], config=cfg, backend="reference",
                                chunk_size=4, policy_fn=policy_fn, **kw)  # fmt: skip
    chunks = gemms["n"]
    out.loss.backward()
    assert chunks > 1 and gemms["n"] > chunks  # (rows with zero coefficients are skipped)


def test_gradients_formed_in_forward_scale_with_the_incoming_gradient():
    batch = _batch([9, 6], seed=2)
    n = batch["labels"].numel()
    kw = {k: v for k, v in batch.items() if k != "labels"}
    grads = []
    for scale in (1.0, -2.5):
        h = _hidden(n, torch.float32).requires_grad_()
        w = _weights(torch.float32).requires_grad_()
        out = echo_loss_from_hidden(h, w, batch["labels"], backend="reference", chunk_size=4,
                                    **kw)  # fmt: skip
        (scale * out.loss).backward(retain_graph=True)
        grads.append((h.grad, w.grad))
        with pytest.raises(RuntimeError, match="a second time"):
            out.loss.backward()
    torch.testing.assert_close(grads[1][0], -2.5 * grads[0][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(grads[1][1], -2.5 * grads[0][1], rtol=1e-6, atol=0)


def test_frozen_hidden_forms_only_the_weight_gradient():
    batch = _batch([9, 6], seed=2)
    n = batch["labels"].numel()
    kw = {k: v for k, v in batch.items() if k != "labels"}
    h = _hidden(n, torch.float32)
    w = _weights(torch.float32).requires_grad_()
    out = echo_loss_from_hidden(h, w, batch["labels"], backend="reference", chunk_size=4, **kw)
    out.loss.backward()
    assert h.grad is None and w.grad is not None and float(w.grad.abs().max()) > 0
    with torch.no_grad():
        out = echo_loss_from_hidden(h, w, batch["labels"], backend="reference", **kw)
    assert out.loss.grad_fn is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [False, True], ids=["in-forward", "recompute"])
def test_first_chunk_write_leaves_the_gradients_bit_identical(dtype, recompute, monkeypatch):
    """Through the whole op (5 chunks of at most 4 rows, several weight-gradient slices): the
    gradients with the first chunk written are those of a zero-filled accumulator, bit for bit,
    in both gradient paths."""
    batch = _batch([9, 6, 5], seed=4)
    n = batch["labels"].numel()
    kw = {k: v for k, v in batch.items() if k != "labels"}
    if recompute:
        _recompute_only(monkeypatch)
    results = []
    for before in (False, True):
        if before:
            _as_before_first_chunk_write(monkeypatch)
        h = _hidden(n, dtype).requires_grad_()
        w = _weights(dtype).requires_grad_()
        out = echo_loss_from_hidden(h, w, batch["labels"], backend="reference", chunk_size=4,
                                    **kw)  # fmt: skip
        out.loss.backward()
        results.append((out.loss, h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert -(-int((batch["rl_mask"] | (batch["echo_weights"] > 0)).sum()) // 4) > 1
    assert float(results[0][2].abs().max()) > 0


def test_no_participating_row_gives_exact_zero_gradients():
    """No chunk runs: the accumulator no chunk wrote is exact zeros (not uninitialised memory:
    ``torch.empty`` is NaN-filled in these tests)."""
    batch = _batch([5, 4], seed=1)
    batch["rl_mask"] = torch.zeros_like(batch["rl_mask"])
    batch["echo_weights"] = torch.zeros_like(batch["echo_weights"])
    n = batch["labels"].numel()
    kw = {k: v for k, v in batch.items() if k != "labels"}
    h = _hidden(n, torch.bfloat16).requires_grad_()
    w = _weights(torch.bfloat16).requires_grad_()
    out = echo_loss_from_hidden(h, w, batch["labels"], backend="reference", **kw)
    out.loss.backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(h.grad, torch.zeros_like(h))
    assert w.grad.dtype == torch.bfloat16


def test_attached_gradients_are_scaled_and_rounded_once():
    """Backward scales the gradients formed in forward and rounds them to the inputs' dtypes in
    one step, in fp32: the fp32 weight-gradient accumulator times the incoming gradient, one
    bf16 rounding; a bf16 ``d hidden`` times an fp32 scale that is not rounded to bf16 first.
    (Rounding the accumulator first, or the scale to bf16, changes some elements here.)"""
    g = torch.Generator().manual_seed(8)
    acc = torch.randn(V, H, generator=g) * 3  # the fp32 accumulator of a bf16 weight
    gh = torch.randn(7, H, generator=g).to(torch.bfloat16)
    h = torch.zeros(7, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(V, H, dtype=torch.bfloat16, requires_grad=True)
    scale = torch.tensor(1 / 3)
    (op.attach_gradients(torch.tensor(0.25), h, w, gh, acc) * scale).backward()
    want_w = (acc * scale).to(torch.bfloat16)
    want_h = (gh.float() * scale).to(torch.bfloat16)
    assert w.grad.dtype == torch.bfloat16 and torch.equal(w.grad, want_w)
    assert h.grad.dtype == torch.bfloat16 and torch.equal(h.grad, want_h)
    assert not torch.equal(want_w, (acc.to(torch.bfloat16) * scale).to(torch.bfloat16))
    assert not torch.equal(want_h, gh * scale.to(torch.bfloat16))
    h1 = torch.zeros(2, 3, requires_grad=True)
    w1 = torch.zeros(4, 3, dtype=torch.float64, requires_grad=True)  # fp64: scaled in fp64
    g64 = torch.full((4, 3), 1 / 3, dtype=torch.float64)
    op.attach_gradients(torch.tensor(1.0, dtype=torch.float64), h1, w1, None, g64).backward(
        torch.tensor(0.1, dtype=torch.float64)
    )
    assert h1.grad is None and torch.equal(w1.grad, g64 * 0.1)


GIB = 2**30


@pytest.mark.parametrize(
    ("v", "h", "dtype", "grad_weight", "free", "rows"),
    [
        (151_936, 4096, torch.bfloat16, True, 60 * GIB, 8192),  # logits as large as the acc
        (151_936, 4096, torch.float16, True, 60 * GIB, 8192),
        (151_936, 4096, torch.float32, True, 60 * GIB, 4096),  # fp32: acc is 4 bytes too
        (151_936, 4096, torch.float64, True, 60 * GIB, 4096),
        (151_936, 4096, torch.bfloat16, False, 60 * GIB, 1764),  # no acc: 4 x 441
        (151_936, 896, torch.bfloat16, True, 60 * GIB, 1792),  # 2H just above 4 x 441
        (151_936, 128, torch.bfloat16, True, 60 * GIB, 1764),  # never below 4 x 441
        (262_144, 8192, torch.bfloat16, True, 60 * GIB, 16384),
        (151_936, 4096, torch.bfloat16, True, 4 * GIB, 3533),  # a quarter of free memory
        (151_936, 4096, torch.bfloat16, True, 1000, 1),  # at least one row
    ],
)
def test_chunk_size_for_memory(v, h, dtype, grad_weight, free, rows):
    got = op.linear_chunk_size_for_memory(v, h, dtype, grad_weight=grad_weight, free_bytes=free)
    assert got == rows
    elt = torch.empty((), dtype=dtype).element_size()
    assert got * v * elt <= max(free // 4, v * elt)  # within a quarter of the free memory


def _cuda_weight(v, h, dtype=torch.bfloat16, requires_grad=True):
    """What ``auto_linear_chunk_size`` reads of a CUDA weight, without a GPU."""
    import types

    elt = torch.empty((), dtype=dtype).element_size()
    return types.SimpleNamespace(shape=(v, h), device=torch.device("cuda", 1), dtype=dtype,
                                 requires_grad=requires_grad, element_size=lambda: elt)  # fmt: skip


def test_auto_chunk_size_on_cuda_reads_free_memory_and_balances_the_chunks(monkeypatch):
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 60 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    w = _cuda_weight(151_936, 4096)
    auto = op.auto_linear_chunk_size
    assert auto(w) == 8192 and asked == [torch.device("cuda", 1)]
    assert auto(w, rows=16384) == 16384  # 1 chunk: its logits as large as acc + chunk
    assert auto(w, rows=16385) == 5462  # 3 chunks of 5462, 5462, 5461 rather than 8192, 8192, 1
    assert auto(w, rows=8193) == 8193  # one chunk, not two of 8192 and 1
    assert auto(w, rows=100) == 100 and auto(w, rows=0) == 1
    assert auto(w, rows=16384, grad_weight=False) == 1639  # 10 chunks of at most 1764
    assert auto(_cuda_weight(151_936, 4096, requires_grad=False), rows=16384) == 1639
    with torch.no_grad():  # no gradient will be accumulated: the smaller chunk
        assert auto(w) == 1764
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * GIB, 80 * GIB))
    assert auto(w, rows=16384) == 3277  # 5 chunks within a quarter of 4 GiB (3533 rows)


def test_auto_chunk_size_splits_the_rows_into_equal_chunks(monkeypatch):
    """``chunk_size=None`` on CPU: the default chunk (lowered to 4 rows here), the participating
    rows split into as few chunks as that allows, of equal size within one row (GEMMs
    counted), the result of that explicit chunk size bit for bit."""
    monkeypatch.setattr(op, "DEFAULT_LINEAR_CHUNK_ELEMENTS", 4 * V)
    batch = _batch([9, 6, 5], seed=4)
    n = batch["labels"].numel()
    kw = {k: v for k, v in batch.items() if k != "labels"}
    rows = int((batch["rl_mask"] | (batch["echo_weights"] > 0)).sum())
    chunks = -(-rows // 4)
    size = op.auto_linear_chunk_size(torch.zeros(V, 1), rows=rows)
    assert chunks > 1 and size == -(-rows // chunks) and size * (chunks - 1) < rows <= size * chunks
    results = []
    for chunk in (None, size):
        gemms = _gemm_counter(monkeypatch)
        h = _hidden(n, torch.float32).requires_grad_()
        w = _weights(torch.float32).requires_grad_()
        out = echo_loss_from_hidden(h, w, batch["labels"], backend="reference", chunk_size=chunk,
                                    **kw)  # fmt: skip
        out.loss.backward()
        results.append((gemms["n"], out.loss, h.grad, w.grad))
    assert results[0][0] == results[1][0] == chunks
    for a, b in zip(results[0][1:], results[1][1:], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("forward_gradients", [False, True], ids=["recompute", "in-forward"])
def test_one_chunk_weight_gradient_is_the_logits_paths(backend, forward_gradients, monkeypatch):
    """All rows in one chunk: a bf16 weight's gradient is one GEMM in bf16 (fp32 accumulation
    inside it, rounded once), with no fp32 accumulator: bit for bit the logits path's ``dW``
    (the same ``dz`` and the same GEMM), on the recompute path and formed in the forward pass.
    Two chunks sum in an fp32 accumulator instead (its dtype checked)."""
    batch = _batch([9, 8], seed=3)
    n = batch["labels"].numel()
    cfg = POLICIES["dppo"]
    if not forward_gradients:
        cfg = LossConfig(policy="gspo")  # a row's weight reads its sequence: recomputed
    dtypes = []
    original = op._add_grad_weight

    def spy(acc, dz, h, acc_dtype):
        dtypes.append(acc_dtype)
        return original(acc, dz, h, acc_dtype)

    monkeypatch.setattr(op, "_add_grad_weight", spy)
    h16, w16 = _hidden(n, torch.bfloat16), _weights(torch.bfloat16)
    grads = {}
    for chunk in (n, 5):
        dtypes.clear()
        wf = w16.clone().requires_grad_()
        out = _hidden_loss(batch, h16.clone().requires_grad_(), wf, cfg, backend, chunk_size=chunk)
        out.loss.backward()
        grads[chunk] = (wf.grad, list(dtypes))
    wr = w16.clone().requires_grad_()
    _logits_loss(batch, h16.clone().requires_grad_(), wr, cfg, backend).loss.backward()
    one, chunked = grads[n], grads[5]
    assert one[1] == [torch.bfloat16] and set(chunked[1]) == {torch.float32}
    assert one[0].dtype == torch.bfloat16
    _assert_one_gemm_apart(one[0], wr.grad, rows=n)
    torch.testing.assert_close(chunked[0].float(), wr.grad.float(), atol=2e-2, rtol=2.0**-6)


def _assert_one_gemm_apart(got: torch.Tensor, want: torch.Tensor, *, rows: int) -> None:
    """``got`` and ``want`` are the same bf16 GEMM (fp32 accumulation, rounded once): bit for bit
    equal, except where the CPU's bf16 GEMM picks its kernel, and so its fp32 summation order, by
    the operands' strides (oneDNN with AMX does: measured 2 of 36,744 entries 1.5e-8 apart,
    where entries reach 1.1; on the AVX2-only CPU of earlier runs they were bit for bit equal).
    Such entries may differ by the summation error of ``rows`` fp32 terms of the gradient's
    scale, and at most 0.1 % of entries may differ at all."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    differ = got.view(torch.int16) != want.view(torch.int16)
    assert int(differ.sum()) <= max(1, got.numel() // 1000), f"{int(differ.sum())} entries differ"
    bound = rows * 2.0**-24 * float(want.float().abs().max()) + 2.0**-8 * want.float().abs()
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize(
    ("grad_dtype", "out_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
     (torch.float16, torch.float16), (torch.float32, torch.float32)],
)  # fmt: skip
def test_scaled_kernel_is_the_pytorch_product_bit_for_bit(grad_dtype, out_dtype, monkeypatch):
    """The Triton product of a gradient formed in forward and the incoming gradient (run under
    the interpreter, 3 programs of a lowered block with a ragged last one) gives the bits of
    the PyTorch product it replaces on CUDA (fp32 multiply, one round to nearest even), for
    scales that are not representable in bf16 and extreme gradient values (products below the
    normal range are left out: the interpreter flushes them to zero)."""
    from echoloss.ops.fused_linear import fused

    monkeypatch.setattr(fused, "BLOCK", 64)
    g = torch.Generator().manual_seed(11)
    grad = torch.randn(3, 61, generator=g) * 10.0 ** torch.randint(-25, 30, (3, 61), generator=g)
    grad[0, :4] = torch.tensor([0.0, -0.0, 3.0e38, -1.0e-30])  # zeros, overflow to inf
    grad = grad.to(grad_dtype)
    for scale in (1.0, 1.0 / 3.0, -7.123456789, 2.0**-20):
        s = torch.tensor([scale], dtype=torch.float32)
        got = fused.scaled(grad, s, out_dtype)
        want = torch.mul(grad, s, out=torch.empty(grad.shape, dtype=out_dtype))
        assert got.dtype == out_dtype and got.shape == grad.shape
        assert torch.equal(got.view(torch.int16 if out_dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if out_dtype != torch.float32 else torch.int32))  # fmt: skip
    assert fused.scaled(grad[:0], s, out_dtype).shape == (0, 61)


def test_scaled_uses_the_kernel_only_where_it_applies():
    """``_scaled`` takes the Triton product for contiguous CUDA gradients of at most 32 bits
    (decided without a GPU from the tensor's description), PyTorch elsewhere."""
    import types as _types

    def desc(device, dtype, contiguous=True):
        return _types.SimpleNamespace(device=torch.device(device), dtype=dtype,
                                      is_contiguous=lambda: contiguous)  # fmt: skip

    applies = op._fused_scale_applies
    assert applies(desc("cuda", torch.bfloat16), torch.bfloat16) == HAS_TRITON
    assert applies(desc("cuda", torch.float32), torch.bfloat16) == HAS_TRITON
    assert not applies(desc("cuda", torch.float64), torch.float64)
    assert not applies(desc("cuda", torch.bfloat16, contiguous=False), torch.bfloat16)
    assert not applies(desc("cpu", torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("chunk", [None, 7], ids=["one-chunk", "chunks-of-7"])
@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
@pytest.mark.parametrize("layout", ["transposed", "every-other-row"])
def test_strided_hidden_is_read_in_place_with_the_same_result(layout, device_path, chunk):
    """``hidden`` may have any strides: a transposed buffer, or every other row of a larger
    one. Chunks of every row are slices of it (views: the device path, or no row masked), so
    the GEMMs read the strided rows themselves; the loss and both gradients are those of the
    same values in a contiguous tensor."""
    from echoloss._deferred import device_code_path, raise_deferred_errors

    batch = _batch([9, 6, 11], seed=4)
    n = batch["labels"].numel()
    w = _weights(torch.float32)
    dense = _hidden(n, torch.float32)
    if layout == "transposed":
        strided = dense.t().contiguous().t()
    else:
        strided = torch.zeros(2 * n, H, dtype=dense.dtype, device=DEVICE)[::2]
        strided.copy_(dense)
    assert not strided.is_contiguous() and torch.equal(strided, dense)
    results = []
    for h in (dense, strided):
        h, ww = h.detach().clone() if h is dense else h.detach(), w.detach().clone()
        h.requires_grad_()
        ww.requires_grad_()
        with device_code_path() if device_path else contextlib.nullcontext():
            loss = _hidden_loss(batch, h, ww, POLICIES["dppo"], "reference", chunk_size=chunk).loss
            loss.backward()
            raise_deferred_errors()
        results.append((loss.detach(), h.grad, ww.grad))
    # A GEMM with a strided operand may sum in another order (CPU BLAS picks its kernel by
    # layout): fp32 rounding of sums over the 26 rows, about 26 · 2^-24 ≈ 2e-6 relative.
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
