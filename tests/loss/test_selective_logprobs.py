"""selective_logprobs: against the naive gold, chunking, dtypes, extreme inputs, errors."""

from __future__ import annotations

import math

import pytest
import torch

from echoloss.ops import selective_logprobs
from echoloss.ops.selective_logprobs import reference, resolve_backend
from echoloss.ops.selective_logprobs.naive import naive_selective_logprobs


def _inputs(shape, v, *, dtype=torch.float64, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, v, shape, generator=g)
    temps = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
    mask = torch.rand(shape, generator=g) > 0.3
    return logits, labels, temps, mask


def _value_and_grads(fn, logits, seed=1):
    """Outputs, and d(Σ g1·lp + Σ g2·ent)/d logits with fixed random cotangents."""
    x = logits.detach().clone().requires_grad_()
    lp, ent = fn(x)
    g = torch.Generator().manual_seed(seed)
    g1 = torch.randn(lp.shape, generator=g, dtype=torch.float64).to(lp.dtype)
    g2 = torch.randn(ent.shape, generator=g, dtype=torch.float64).to(ent.dtype)
    (grad,) = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), x)
    return lp.detach(), ent.detach(), grad


@pytest.mark.parametrize("shape", [(7,), (2, 5)], ids=["N7", "B2-T5"])
@pytest.mark.parametrize("temperature", ["one", "scalar", "per_token"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "mask"])
def test_matches_naive_gold_fp64(shape, temperature, masked):
    logits, labels, temps, mask = _inputs(shape, 13)
    temp = {"one": 1.0, "scalar": 0.7, "per_token": temps}[temperature]
    m = mask if masked else None

    def ours(x):
        return selective_logprobs(x, labels, temperature=temp, return_entropy=True, mask=m)

    def gold(x):
        lp, ent = naive_selective_logprobs(x, labels, temperature=temp, return_entropy=True)
        if m is not None:  # rows outside the mask read exactly 0
            lp, ent = lp * m, ent * m
        return lp, ent

    lp, ent, grad = _value_and_grads(ours, logits)
    lp_g, ent_g, grad_g = _value_and_grads(gold, logits)
    assert lp.dtype == torch.float64 and lp.shape == labels.shape
    # fp64 throughout; the only difference is x·(1/T) vs x/T (≤ 1 ulp per logit).
    torch.testing.assert_close(lp, lp_g, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ent_g, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_g, rtol=1e-12, atol=1e-12)
    if m is not None:
        assert torch.equal(lp[~m], torch.zeros_like(lp[~m]))
        assert torch.equal(grad[~m], torch.zeros_like(grad[~m]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_chunked_equals_unchunked(dtype, chunk_size):
    # Every reduction is per row, so the chunking cannot change a single bit.
    logits, labels, temps, mask = _inputs((37,), 1000, dtype=dtype)
    temps = temps.float()

    def run(cs, m):
        return _value_and_grads(
            lambda x: selective_logprobs(
                x, labels, temperature=temps, return_entropy=True, chunk_size=cs, mask=m
            ),
            logits,
        )

    for m in (None, mask):
        whole = run(37, m)
        chunked = run(chunk_size, m)
        for a, b in zip(whole, chunked, strict=True):
            assert torch.equal(a, b)


def test_gradcheck_fp64_logprobs_and_entropy():
    logits, labels, temps, mask = _inputs((5,), 6)
    x = logits.clone().requires_grad_()

    def f(z):
        lp, ent = selective_logprobs(
            z, labels, temperature=temps, return_entropy=True, chunk_size=2, mask=mask
        )
        return lp, ent

    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8)


def test_bf16_against_fp32_gold():
    """bf16 logits: our fp32 math adds nothing beyond the bf16 rounding of the input.

    Tolerances, derived rather than tuned:
    - against the gold computed from the *same* bf16 values upcast to fp32, the two paths differ
      only by fp32 rounding: |Δ| ≤ a few ulp of |lp| + |lse| (≤ 60 here) → atol 2e-5, rtol 1e-6;
    - against the gold of the original fp32 logits, the input itself moved by at most one bf16
      rounding, |Δz| ≤ 2^-8·|z| (8 significant bits). lp = z_y - lse(z) and lse is 1-Lipschitz in
      ‖·‖∞, so |Δlp| ≤ 2·2^-8·‖z‖∞ per row; the entropy is bounded the same way by
      |ΔH| ≤ 2·‖Δz‖∞·(1 + ...) - we use the first-order bound 2·2^-8·‖z‖∞ as well;
    - the gradient is written in bf16: per element one bf16 rounding (2^-8 relative) on top of
      the fp32 value, so rtol 2^-8 against the gold on the same bf16 values, atol 1e-7 for the
      exactly-representable zeros' neighbours.
    A bf16-native log_softmax (no upcast) misses the first tolerance by three orders of magnitude.
    """
    logits32, labels, _, _ = _inputs((64,), 4096, dtype=torch.float32, scale=4.0)
    logits16 = logits32.to(torch.bfloat16)

    def ours(x):
        return selective_logprobs(x, labels, return_entropy=True)

    def gold(x):
        return naive_selective_logprobs(x, labels, return_entropy=True)

    lp16, ent16, g16 = _value_and_grads(ours, logits16)
    assert lp16.dtype == torch.float32 and g16.dtype == torch.bfloat16
    lp_same, ent_same, g_same = _value_and_grads(gold, logits16.float())
    torch.testing.assert_close(lp16, lp_same, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(ent16, ent_same, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(g16.float(), g_same, rtol=2**-8, atol=1e-7)

    lp_gold, ent_gold, _ = _value_and_grads(gold, logits32)
    bound = 2 * 2**-8 * logits32.abs().amax(dim=-1)  # per row
    assert bool(((lp16 - lp_gold).abs() <= bound).all())
    assert bool(((ent16 - ent_gold).abs() <= bound).all())
    # The first tolerance is not vacuous: bf16-native math on the same input is far outside it.
    naive16 = torch.log_softmax(logits16, -1).gather(-1, labels[:, None]).squeeze(-1).float()
    assert (naive16 - lp_same).abs().max() > 100 * 2e-5


def test_large_vocab_few_rows():
    v = 262_144
    logits, labels, _, _ = _inputs((3,), v, dtype=torch.float32, scale=2.0)
    lp, ent, grad = _value_and_grads(
        lambda x: selective_logprobs(x, labels, return_entropy=True), logits
    )
    lp_g, ent_g, grad_g = _value_and_grads(
        lambda x: naive_selective_logprobs(x, labels, return_entropy=True), logits
    )
    # fp32 sums over 2^18 terms: relative error ~ log2(V)·2^-24 ≈ 1e-6 on lse (≈ 14 here).
    torch.testing.assert_close(lp, lp_g, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent, ent_g, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, grad_g, rtol=1e-5, atol=1e-9)
    assert reference.default_chunk_size(v) == 16


def test_single_row_and_single_step():
    logits, labels, _, _ = _inputs((1,), 5)
    lp = selective_logprobs(logits, labels)
    torch.testing.assert_close(lp, naive_selective_logprobs(logits, labels), rtol=0, atol=1e-15)
    logits3, labels3, _, _ = _inputs((4, 1), 5)  # T = 1
    lp3 = selective_logprobs(logits3, labels3)
    assert lp3.shape == (4, 1)
    torch.testing.assert_close(lp3, naive_selective_logprobs(logits3, labels3), rtol=0, atol=1e-15)


def test_non_viewable_3d_logits_are_read_in_place():
    full, labels, temps, mask = _inputs((3, 6), 11)
    logits = full[:, :-1]  # the usual HF slice: cannot be viewed as [N, V]
    with pytest.raises(RuntimeError):
        logits.view(-1, 11)
    labels, temps, mask = labels[:, :-1], temps[:, :-1], mask[:, :-1]
    for m in (None, mask):
        got = _value_and_grads(
            lambda x, m=m: selective_logprobs(
                x, labels, temperature=temps, return_entropy=True, mask=m
            ),
            logits,
        )
        want = _value_and_grads(
            lambda x, m=m: selective_logprobs(
                x.contiguous(), labels, temperature=temps, return_entropy=True, mask=m
            ),
            logits,
        )
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_extreme_logits_stay_finite(dtype):
    g = torch.Generator().manual_seed(0)
    logits = ((torch.rand(6, 50, generator=g) > 0.5).float() * 2e4 - 1e4).to(dtype)
    logits[0] = 1e4  # a row of ties at the top
    logits[1, :] = -1e4
    labels = torch.randint(0, 50, (6,), generator=g)
    labels[2] = int((logits[2] < 0).nonzero()[0])  # a label at -1e4 against +1e4: lp ≈ -2e4
    lp, ent, grad = _value_and_grads(
        lambda x: selective_logprobs(x, labels, temperature=0.5, return_entropy=True), logits
    )
    assert bool(torch.isfinite(lp).all() and torch.isfinite(ent).all())
    assert bool(torch.isfinite(grad.float()).all())
    # Row 2: (z_y - max z) / T - log(#maxima) ≈ -4e4 (z_y = -1e4 rounds to -9984 in bf16).
    z = logits[2].double()
    k = int((z == z.max()).sum())
    assert float(lp[2]) == pytest.approx(
        float((z[labels[2]] - z.max()) / 0.5) - math.log(k), rel=1e-6
    )
    assert float(lp[0]) == pytest.approx(-math.log(50), abs=1e-5)
    assert float(ent[0]) == pytest.approx(math.log(50), abs=1e-5)


def test_minus_inf_logits_off_label():
    # Vocabulary masking with -inf must not turn the entropy or its gradient into NaN.
    logits = torch.tensor([[0.0, -math.inf, 1.0], [2.0, 0.5, -math.inf]])
    labels = torch.tensor([2, 0])
    lp, ent, grad = _value_and_grads(
        lambda x: selective_logprobs(x, labels, return_entropy=True), logits
    )
    assert bool(torch.isfinite(lp).all() and torch.isfinite(ent).all())
    assert bool(torch.isfinite(grad).all())
    assert grad[0, 1] == 0 and grad[1, 2] == 0
    p = torch.softmax(torch.tensor([0.0, 1.0]), 0)
    assert float(ent[0]) == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)


@pytest.mark.parametrize("coef", [1.0, 3.0, -50.0])
def test_minus_inf_logit_with_large_entropy_coefficient(coef):
    # An entropy cotangent |b| > 1 on a row with a -inf logit: the p·b·(log p + H) term must be
    # exactly 0 there (p = 0), not b·(-huge) overflowing to -inf and 0·inf = NaN.
    logits = torch.tensor([[0.0, -math.inf, 1.0]], requires_grad=True)
    labels = torch.tensor([2])
    for fn in (selective_logprobs, naive_selective_logprobs):
        x = logits.detach().clone().requires_grad_()
        lp, ent = fn(x, labels, return_entropy=True)
        (grad,) = torch.autograd.grad(lp.sum() + coef * ent.sum(), x)
        assert bool(torch.isfinite(grad).all()), (fn.__name__, grad)
        assert grad[0, 1] == 0
        # Closed form on the two live entries: dH/ds = -p·(log p + H).
        p = torch.softmax(torch.tensor([0.0, 1.0], dtype=torch.float64), 0)
        h = -(p * p.log()).sum()
        expected = torch.tensor([0.0, 1.0], dtype=torch.float64) - p - coef * p * (p.log() + h)
        torch.testing.assert_close(grad[0, [0, 2]].double(), expected, rtol=1e-5, atol=1e-6)


def test_masked_rows_need_no_valid_label_and_get_zero_grad():
    logits, labels, _, _ = _inputs((4,), 5)
    labels[1] = -100
    mask = torch.tensor([True, False, True, True])
    lp, ent, grad = _value_and_grads(
        lambda x: selective_logprobs(x, labels, return_entropy=True, mask=mask), logits
    )
    assert lp[1] == 0 and ent[1] == 0 and bool((grad[1] == 0).all())
    with pytest.raises(ValueError, match=r"labels\[1\] must be in \[0, V=.*got -100.*mask="):
        selective_logprobs(logits, labels)


def test_all_masked_rows_backprop_exact_zero():
    logits, labels, _, _ = _inputs((3,), 4)
    x = logits.clone().requires_grad_()
    lp = selective_logprobs(x, labels, mask=torch.zeros(3, dtype=torch.bool))
    (lp.sum() * 1.0).backward()
    assert torch.equal(lp, torch.zeros(3, dtype=lp.dtype))
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"labels": torch.zeros(4)}, TypeError, r"labels must be an integer tensor"),
        (
            {"labels": torch.zeros(3, dtype=torch.long)},
            ValueError,
            r"labels must be of shape \[4\]",
        ),
        ({"labels": torch.full((4,), 9)}, ValueError, r"labels\[0\] must be in \[0, V=5\)"),
        ({"mask": torch.ones(4)}, TypeError, r"mask must be a bool mask"),
        ({"temperature": 0.0}, ValueError, r"temperature must be a positive finite"),
        (
            {"temperature": torch.tensor([1.0, 1.0, -1.0, 1.0])},
            ValueError,
            r"temperature\[2\] must be a positive finite number, got -1.0",
        ),
        ({"temperature": torch.ones(3)}, ValueError, r"temperature must be of shape \[4\]"),
        ({"chunk_size": 0}, ValueError, r"chunk_size must be None or an int ≥ 1"),
        ({"backend": "cuda"}, ValueError, r"backend must be one of"),
        ({"logits": torch.zeros(4, 5, dtype=torch.long)}, TypeError, r"logits must be a float"),
    ],
)
def test_errors_name_the_argument(kwargs, exc, match):
    args = {"logits": torch.zeros(4, 5), "labels": torch.zeros(4, dtype=torch.long)}
    args.update(kwargs)
    logits, labels = args.pop("logits"), args.pop("labels")
    with pytest.raises(exc, match=match):
        selective_logprobs(logits, labels, **args)


def test_triton_backend_where_it_cannot_run_names_the_fix():
    # Backend resolution belongs to the fused-kernel module; here only: a refusal says what to do.
    try:
        resolve_backend("triton", torch.device("cpu"))
    except NotImplementedError as e:
        assert "'reference'" in str(e)
    else:
        pytest.skip("the Triton interpreter is enabled here: backend='triton' runs on cpu")
    assert resolve_backend("auto", torch.device("cpu")) is reference
