"""GPU-only checks of the fused kernels (skipped without CUDA): sizes the interpreter cannot reach,
compiled-kernel reuse across sizes, and memory. Run with ``pytest -m gpu tests/ops``.

Not run in this repository's CI (no GPU); run them on a GPU machine with ``pytest -m gpu tests/ops``.
"""

from __future__ import annotations

import pytest
import torch
from _fused_cases import HAS_TRITON, STAT_TOL, assert_grad_close

from echoloss.loss import LossConfig
from echoloss.ops import selective_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_TRITON, reason="needs triton")]

CUDA = torch.device("cuda")


def _lp_ent_grad(logits, labels, backend, *, mask=None, temperature=0.9, seed=0):
    x = logits.detach().clone().requires_grad_()
    lp, ent = selective_logprobs(
        x, labels, temperature=temperature, return_entropy=True, mask=mask, backend=backend
    )
    g = torch.Generator(device=logits.device).manual_seed(seed)
    c1 = torch.randn(lp.shape, generator=g, device=logits.device)
    c2 = torch.randn(ent.shape, generator=g, device=logits.device)
    (grad,) = torch.autograd.grad((lp * c1).sum() + (ent * c2).sum(), x)
    return lp.detach(), ent.detach(), grad


@pytest.mark.parametrize(
    ("n", "v"),
    [(70_000, 4096), (64, 262_144), (1, 151_936), (3, 1)],
    ids=["N70000-flat-grid", "V262144", "T1-V151936", "V1"],
)
def test_large_shapes_match_reference(n, v):
    """N above the 65,535 grid-axis limit of a [B, L] grid, and the largest vocabulary."""
    g = torch.Generator(device=CUDA).manual_seed(n + v)
    logits = (torch.randn(n, v, generator=g, device=CUDA) * 3).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=g, device=CUDA)
    mask = torch.rand(n, generator=g, device=CUDA) > 0.1
    lp_f, ent_f, g_f = _lp_ent_grad(logits, labels, "triton", mask=mask)
    lp_r, ent_r, g_r = _lp_ent_grad(logits, labels, "reference", mask=mask)
    torch.testing.assert_close(lp_f, lp_r, atol=STAT_TOL[0], rtol=STAT_TOL[1])
    torch.testing.assert_close(ent_f, ent_r, atol=STAT_TOL[0], rtol=STAT_TOL[1])
    assert_grad_close(g_f, g_r, coef_scale=5.0 / 0.9)
    assert torch.equal(g_f[~mask], torch.zeros_like(g_f[~mask]))


def _compiled_variants(kernel) -> int:
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


def test_sizes_do_not_recompile():
    """Token counts and sequence lengths vary per call; they must not each compile a kernel."""
    from echoloss.ops.selective_logprobs import fused

    v = 4096
    g = torch.Generator(device=CUDA).manual_seed(0)

    def call(*lead):
        logits = torch.randn(*lead, v, generator=g, device=CUDA).to(torch.bfloat16)
        labels = torch.randint(0, v, lead, generator=g, device=CUDA)
        _lp_ent_grad(logits, labels, "triton", temperature=1.0)

    call(100)
    call(4, 37)
    before = (
        _compiled_variants(fused._logprobs_fwd_kernel),
        _compiled_variants(fused._logprobs_bwd_kernel),
    )
    for lead in [(101,), (257,), (1000,), (3, 50), (8, 129), (2, 1023)]:
        call(*lead)
    after = (
        _compiled_variants(fused._logprobs_fwd_kernel),
        _compiled_variants(fused._logprobs_bwd_kernel),
    )
    assert after == before, f"recompiled for new sizes: {before} -> {after}"


def test_peak_extra_memory_is_one_gradient_buffer():
    """Forward + backward allocate one [N, V] gradient and O(N) vectors: peak extra ≤ 1.1x the
    logits (the design target), and phase 2 in place over the logits adds only O(N)."""
    from echoloss.ops.selective_logprobs import fused

    n, v = 8192, 32_000
    logits = torch.randn(n, v, device=CUDA).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,), device=CUDA)
    size = logits.numel() * logits.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = selective_logprobs(logits, labels, return_entropy=True, backend="triton")
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= 1.1 * size, f"peak extra {extra / size:.3f}x the logits"

    with torch.no_grad():
        _, lse, _ = fused.forward(
            logits, labels, rows=None, inv_temperature=1.0, need_entropy=False, chunk_size=1
        )
        rows = torch.arange(n, device=CUDA)
        buf = logits.detach().clone()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fused.backward(
            buf,
            labels,
            rows=rows,
            inv_temperature=1.0,
            lse=lse,
            grad_logprobs=torch.ones(n, device=CUDA),
            grad_entropy=None,
            entropy=None,
            chunk_size=1,
            out=buf,
        )
        torch.cuda.synchronize()
        in_place_extra = torch.cuda.max_memory_allocated() - base
    assert in_place_extra <= 64 * n, f"in-place phase 2 allocated {in_place_extra} bytes"


def test_fused_linear_on_gpu_matches_logits_path_with_less_memory():
    from echoloss import echo_loss_from_hidden
    from echoloss.loss import echo_loss

    n, h, v = 4096, 1024, 32_000
    g = torch.Generator(device=CUDA).manual_seed(1)
    hidden = (torch.randn(n, h, generator=g, device=CUDA)).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g, device=CUDA) * h**-0.5).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=g, device=CUDA)
    rl = torch.rand(n, generator=g, device=CUDA) < 0.6
    ew = torch.where(~rl & (torch.rand(n, generator=g, device=CUDA) < 0.5), 0.3, 0.0)
    kw = dict(
        rl_mask=rl,
        echo_weights=ew,
        advantages=torch.randn(n, generator=g, device=CUDA),
        inference_logprobs=torch.full((n,), -10.0, device=CUDA),
        config=LossConfig(policy="ppo_clip"),
    )

    def run(fn):
        hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(hd, wt)
        out.loss.backward()
        torch.cuda.synchronize()
        return out.loss.detach(), hd.grad, wt.grad, torch.cuda.max_memory_allocated() - base

    fused_res = run(lambda hd, wt: echo_loss_from_hidden(hd, wt, labels, backend="triton", **kw))
    ref_res = run(lambda hd, wt: echo_loss(hd @ wt.t(), labels, backend="triton", **kw))
    torch.testing.assert_close(fused_res[0], ref_res[0], atol=1e-4, rtol=1e-4)
    # bf16 gradients through different GEMM groupings (chunks vs whole batch; fp32 weight-grad
    # accumulation vs one bf16 GEMM): a few bf16 ulps.
    torch.testing.assert_close(fused_res[1].float(), ref_res[1].float(), atol=1e-3, rtol=2**-5)
    torch.testing.assert_close(fused_res[2].float(), ref_res[2].float(), atol=1e-3, rtol=2**-5)
    assert fused_res[3] < ref_res[3], (fused_res[3], ref_res[3])


def _linear_inputs(n, h, v, *, seed, echo_share):
    """bf16 ``hidden [n, h]``, an LM head ``[v, h]``, labels and the loss fields: 60 % RL rows,
    and an echo weight of 0.3 on each other row with probability ``echo_share``."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=CUDA).to(torch.bfloat16)
    weight = (torch.randn(v, h, generator=g, device=CUDA) * h**-0.5).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), generator=g, device=CUDA)
    rl = torch.rand(n, generator=g, device=CUDA) < 0.6
    echo = ~rl
    if echo_share < 1:
        echo &= torch.rand(n, generator=g, device=CUDA) < echo_share
    kw = dict(
        rl_mask=rl,
        echo_weights=torch.where(echo, 0.3, 0.0),
        advantages=torch.randn(n, generator=g, device=CUDA),
        inference_logprobs=torch.full((n,), -10.0, device=CUDA),
    )
    return hidden, weight, labels, kw


def test_fused_linear_one_chunk_is_the_logits_path_bit_for_bit_on_gpu():
    """One chunk on CUDA (every row: the device path): the logits kept for backward, and the
    loss and both bf16 gradients of logits-then-loss bit for bit (the same cuBLAS GEMMs on the
    same tensors, the same Triton phases with the same coefficients), for an incoming gradient
    of 1/3."""
    from echoloss import echo_loss_from_hidden
    from echoloss.loss import echo_loss
    from echoloss.ops.fused_linear import op

    n = 2048
    hidden, weight, labels, kw = _linear_inputs(n, 1024, 32_000, seed=5, echo_share=0.5)
    assert op.auto_linear_chunk_size(weight.clone().requires_grad_(), rows=n) == n
    results = []
    for fused in (True, False):
        hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            out = echo_loss_from_hidden(hd, wt, labels, backend="triton", **kw)
        else:
            out = echo_loss(hd @ wt.t(), labels, backend="triton", **kw)
        (out.loss / 3).backward()
        results.append((out.loss.detach(), hd.grad, wt.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_weight_gradient_first_chunk_written_on_gpu():
    """CUDA's mixed-dtype path: the first chunk's ``dzᵀ @ h`` written by
    ``mm(out_dtype=float32)``, the second added by ``addmm(out_dtype=float32, out=acc)``. Each
    bf16×bf16 product is exact in fp32, so each element is an fp32 sum of ``2·c`` exact terms:
    within ``2·c·2^-24·Σ|terms|`` of the fp64 sum, whatever order cuBLAS adds them in (and so is
    the zero-filled accumulator the first chunk used to be added to)."""
    from echoloss.ops.fused_linear import op

    c, v, h = 512, 4096, 256
    g = torch.Generator(device=CUDA).manual_seed(4)
    dz = torch.randn(2, c, v, generator=g, device=CUDA).to(torch.bfloat16)
    hs = torch.randn(2, c, h, generator=g, device=CUDA).to(torch.bfloat16)
    written = op._add_grad_weight(None, dz[0], hs[0], torch.float32)
    written = op._add_grad_weight(written, dz[1], hs[1], torch.float32)
    added = torch.zeros(v, h, dtype=torch.float32, device=CUDA)
    for k in range(2):
        added = op._add_grad_weight(added, dz[k], hs[k], torch.float32)
    d64, h64 = dz.double(), hs.double()
    gold = d64[0].t() @ h64[0] + d64[1].t() @ h64[1]
    bound = 2 * c * 2.0**-24 * (d64[0].abs().t() @ h64[0].abs() + d64[1].abs().t() @ h64[1].abs())
    assert written.dtype == torch.float32
    assert bool(((written.double() - gold).abs() <= bound).all())
    assert bool(((added.double() - gold).abs() <= bound).all())


@pytest.mark.parametrize(("n", "chunks"), [(6144, 3), (4096, 1)])
def test_fused_linear_chunks_as_large_as_the_accumulator_on_gpu(monkeypatch, n, chunks):
    """At ``V = 151,936``, ``H = 1024`` in bf16 the chunk is ``2·H = 2048`` rows (more than
    4 × 441): 6144 rows run in 3 LM-head GEMMs (counted), and the peak extra memory is the
    fp32 accumulator plus one chunk of logits plus a few ``[N, H]`` buffers (``d hidden``, its
    scaled copy, a chunk's hidden rows and their ``dX``), independent of ``N``. Up to
    ``4·H = 4096`` rows the rows form one chunk (one GEMM, no accumulator): its logits plus
    the bf16 ``[V, H]`` gradient, no more than the chunked working set plus that gradient. Both
    stay below the logits path's ``N·V`` logits and their gradient."""
    from echoloss import echo_loss_from_hidden
    from echoloss.ops.fused_linear import op

    h, v = 1024, 151_936
    hidden, weight, labels, kw = _linear_inputs(n, h, v, seed=2, echo_share=1.0)
    w = weight.clone().requires_grad_()
    assert op.auto_linear_chunk_size(w, rows=n) == -(-n // chunks)
    calls = {"n": 0}
    original = op._logits_chunk

    def counted(hh, ww):
        calls["n"] += 1
        return original(hh, ww)

    monkeypatch.setattr(op, "_logits_chunk", counted)
    hd = hidden.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = echo_loss_from_hidden(hd, w, labels, backend="triton", **kw)
    out.loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert calls["n"] == chunks
    rows = n * h * 2
    if chunks > 1:
        acc, chunk = 4 * v * h, 2 * h * v * 2
        assert extra <= acc + chunk + 6 * rows + 8 * 2**20, (extra, acc + chunk)
    else:
        logits, grad_w = n * v * 2, v * h * 2
        assert extra <= logits + 2 * grad_w + 6 * rows + 8 * 2**20, (extra, logits + grad_w)
    assert extra < 2 * n * v * 2  # the logits path's [N, V] logits and their gradient
    assert w.grad.dtype == torch.bfloat16 and bool(w.grad.abs().amax() > 0)


_FUSED_CONFIGS = {
    "dppo": LossConfig(),
    "ppo_clip": LossConfig(policy="ppo_clip"),
    "ppo_clip-dual-entropy": LossConfig(policy="ppo_clip", dual_clip=2.0, entropy_coef=0.01),
    "cispo-min": LossConfig(policy="cispo", cispo_min=0.5),
    "reinforce-sum": LossConfig(policy="reinforce", echo_normalization="sum"),
    "sft": LossConfig(mode="sft"),
    "dppo-constant-batch": LossConfig(
        rl_normalization="token_sum_constant",
        rl_normalization_constant=100.0,
        echo_normalization="batch_token_mean",
    ),
    "dppo-sequence-means": LossConfig(
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
        echo_z_epsilon=1e-3,
    ),
    "reinforce-token-mask-k3": LossConfig(
        policy="reinforce", mismatch="token_mask", mismatch_min=0.5, kl_coef=0.1
    ),
    "gspo-sequence-means": LossConfig(
        policy="gspo", eps_low=0.2, eps_high=0.2, rl_normalization="sequence_mean_token_mean"
    ),
    "sapo": LossConfig(policy="sapo", kl_coef=0.05),
    "sapo-sequence-means": LossConfig(
        policy="sapo_sequence", rl_normalization="sequence_mean_token_mean"
    ),
    "cispo-sequence": LossConfig(policy="cispo_sequence", cispo_max=1.5),
}


def _fused_record(n, v, *, sft=False):
    from echoloss.loss import LossInputs

    g = torch.Generator(device=CUDA).manual_seed(1)
    rl = torch.rand(n, generator=g, device=CUDA) < 0.6
    echo = ~rl & (torch.rand(n, generator=g, device=CUDA) < 0.5)
    return LossInputs(
        labels=torch.randint(0, v, (n,), generator=g, device=CUDA),
        rl_mask=rl,
        echo_weights=None
        if sft
        else torch.where(echo, torch.rand(n, generator=g, device=CUDA), 0.0),
        advantages=torch.randn(n, generator=g, device=CUDA),
        inference_logprobs=-torch.rand(n, generator=g, device=CUDA) * 12,
        ref_logprobs=-torch.rand(n, generator=g, device=CUDA) * 12,
        # 97 sequences, each row's id cycling: a sequence's rows spread over the record
        sequence_ids=(torch.arange(n, device=CUDA) * 31) % 97,
        observation_mask=torch.rand(n, generator=g, device=CUDA) < 0.2,
    )


@pytest.mark.parametrize("name", list(_FUSED_CONFIGS))
@pytest.mark.parametrize("given", [False, True], ids=["own-counts", "normalizers"])
def test_fused_row_algebra_matches_the_pytorch_algebra_on_cuda(name, given):
    """`echo_loss` on CUDA with the fused row algebra (the default there) against the PyTorch
    algebra (`fuse_loss_algebra("never")`) on the same bf16 logits: the phases are the same
    kernels, so only the algebra's summation order differs. Loss and metrics within
    ``N · 2^-24`` relative (fp32 sums of N terms in another order), gradients within one bf16
    ulp of the largest entry (both are rounded once from fp32 coefficients that agree to a few
    fp32 ulps); the metric keys in the same order."""
    from echoloss._deferred import raise_deferred_errors
    from echoloss.loss import Normalizers, echo_loss
    from echoloss.loss.fused import fuse_loss_algebra, fused_algebra_applies

    n, v = 5000, 32000
    cfg = _FUSED_CONFIGS[name]
    x = _fused_record(n, v, sft=cfg.mode == "sft")
    norms = None
    if given:
        norms = Normalizers(
            rl_tokens=9000, echo_tokens=4000, echo_batches=2, rl_sequences=300, echo_sequences=250
        )
    g = torch.Generator(device=CUDA).manual_seed(2)
    logits = (torch.randn(n, v, generator=g, device=CUDA) * 2).bfloat16()
    lp = torch.zeros(n, device=CUDA)
    assert fused_algebra_applies(lp, lp, x, cfg, norms, None)
    results = []
    try:
        for mode in ("never", "auto"):
            fuse_loss_algebra(mode)
            leaf = logits.clone().requires_grad_()
            out = echo_loss(leaf, x, config=cfg, normalizers=norms)
            out.loss.backward()
            raise_deferred_errors()
            results.append((out.loss.double(), leaf.grad.double(), out.metrics))
    finally:
        fuse_loss_algebra("auto")
    (a, ga, ma), (b, gb, mb) = results
    tol = n * 2.0**-24
    assert list(ma) == list(mb)
    assert float((a - b).abs()) <= tol * max(1.0, float(a.abs()))
    for key in ma:
        ref = float(ma[key])
        assert abs(float(mb[key]) - ref) <= tol * max(1.0, abs(ref)), key
    assert float((ga - gb).abs().max()) <= 2.0**-8 * float(ga.abs().max())


def test_fused_row_algebra_defers_the_same_error_on_cuda():
    """A NaN logits row on CUDA: the same deferred error with and without the fused algebra."""
    from echoloss._deferred import raise_deferred_errors
    from echoloss.loss import echo_loss
    from echoloss.loss.fused import fuse_loss_algebra

    n, v = 300, 1000
    x = _fused_record(n, v)
    logits = torch.randn(n, v, device=CUDA)
    logits[int(x.rl.nonzero()[3])] = float("nan")
    messages = []
    try:
        for mode in ("never", "auto"):
            fuse_loss_algebra(mode)
            echo_loss(logits.clone().requires_grad_(), x)
            with pytest.raises(ValueError) as err:
                raise_deferred_errors()
            messages.append(str(err.value))
    finally:
        fuse_loss_algebra("auto")
    assert messages[0] == messages[1]


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_fused_linear_scale_kernel_matches_pytorch_on_gpu(grad_dtype):
    """The Triton product of a gradient formed in forward and the incoming gradient: the bits
    of PyTorch's mixed-dtype product on the GPU (normal-range products, several programs)."""
    from echoloss.ops.fused_linear import fused, op

    g = torch.Generator(device=CUDA).manual_seed(4)
    grad = (torch.randn(1000, 97, generator=g, device=CUDA) * 1e3).to(grad_dtype)
    for scale in (1.0, 1.0 / 3.0, -5.5e-3):
        s = torch.tensor([scale], device=CUDA)
        got = fused.scaled(grad, s, torch.bfloat16)
        want = torch.mul(grad, s, out=torch.empty(grad.shape, dtype=torch.bfloat16, device=CUDA))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert torch.equal(op._scaled(grad, s, torch.bfloat16), got)
