"""The layouts and policies the kernels gained since their last GPU run, as GPU tests with a CPU
twin: every test runs the same cases twice over, on CUDA (``@pytest.mark.gpu``: ``pytest -m gpu
tests/ops``, skipped without a GPU) and on the CPU under the Triton interpreter (what CI runs;
skipped where there is a GPU, whose run is the CUDA one). Small odd shapes: row counts just past
a program block (``BLOCK = 1024``), a vocabulary of several interpreter blocks.

* the row program reading ``[B, T]`` sequence ids and advantages in place through their strides
  (expanded, transposed), for ``ppo_clip``, ``sapo``, ``sapo_sequence`` and ``cispo_sequence``:
  bit for bit the result of the same values flat, and the plain-PyTorch gold's within the
  tolerances of ``tests/ops/test_row_algebra.py``;
* in-order sequence ids (``sequences_in_order``: no sort) for the sequence-level policies;
* ``echo_loss`` end to end with the fused row algebra against the PyTorch algebra for the new
  policies (the same phases: only the algebra's summation order differs);
* the value-check program against its gold, strided views and every rule and dtype;
* the fused-linear op writing every row of its ``torch.empty`` buffers: ``torch.empty`` called
  from echoloss is NaN-filled in these tests (``tests/ops/conftest.py``, on CUDA too), so a row
  or a column left unwritten shows as a NaN or a wrong value in the loss or the gradients.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _fused_cases import HAS_CUDA

pytest.importorskip("triton")

import test_row_algebra as rows_tests
from _row_algebra_cases import Case

from echoloss.loss import LossConfig, LossInputs
from echoloss.ops.row_algebra.contract import SEQUENCE_RATIO_POLICIES

# The interpreted kernels meet -inf and 0/0 on masked lanes (numpy warns; the compiled ones do not).
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

NAN = math.nan
DEVICES = [
    pytest.param(
        "cpu", id="interpreter", marks=pytest.mark.skipif(HAS_CUDA, reason="the CUDA twin runs")
    ),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture
def on(request, monkeypatch):
    """The test's device; the row-algebra helpers run their calls there, and the fused row
    algebra and value checks run on it (``"always"``: also on cpu tensors under the
    interpreter, as ``"auto"`` does on CUDA)."""
    from echoloss.loss.fused import fuse_loss_algebra

    device = torch.device(request.node.callspec.params["device"])
    monkeypatch.setattr(rows_tests, "DEVICE", device)
    fuse_loss_algebra("always")
    yield device
    fuse_loss_algebra("auto")


@pytest.fixture
def ran(monkeypatch):
    """Calls of the row program and of the value-check program: a test that means to run them
    asserts they ran (and not the PyTorch path in their place)."""
    from echoloss.ops.row_algebra import fused as rows_fused
    from echoloss.ops.value_checks import fused as checks_fused

    calls = {"rows": 0, "checks": 0}
    for key, module, name in (("rows", rows_fused, "forward"), ("checks", checks_fused, "write")):
        real = getattr(module, name)

        def spy(*args, _real=real, _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


# ------------------------------------------------------------------ the row program

B, T = 7, 151  # 1057 rows: one program block and a part; sequences cross the block edge
assert B * T > rows_tests.BLOCK


def _layout(case: Case, layout: str) -> tuple[Case, Case]:
    """``(flat, view)``: the same ids (``arange(B)`` over ``T``) and advantages, flat and as a
    ``[B, T]`` view of the layout."""
    flat_ids = torch.arange(B).repeat_interleave(T)
    if layout == "expanded":
        ids = torch.arange(B).unsqueeze(1).expand(B, T)  # strides (1, 0)
    else:
        ids = torch.arange(B).repeat(T).reshape(T, B).t()  # strides (1, B)
    assert torch.equal(ids.reshape(-1), flat_ids) and not ids.is_contiguous()
    per_sequence = torch.randn(B, generator=torch.Generator().manual_seed(2))
    adv_flat = torch.where(case.rows.rl, per_sequence.repeat_interleave(T), NAN)
    if layout == "expanded":
        adv_view = per_sequence.unsqueeze(1).expand(B, T)
    else:
        adv_view = adv_flat.reshape(B, T).t().contiguous().t()  # strides (1, B)
        assert not adv_view.is_contiguous()
    flat = case.rows._replace(sequence_ids=flat_ids, sequences_in_order=True, advantages=adv_flat)
    view = case.rows._replace(sequence_ids=ids, sequences_in_order=True, advantages=adv_view)
    return Case(case.lp, case.ent, flat, case.params), Case(case.lp, case.ent, view, case.params)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["expanded", "transposed"])
@pytest.mark.parametrize("variant", ["ppo_clip", "sapo", "sapo_sequence", "cispo_sequence"])
def test_row_program_reads_bt_views_in_place(device, layout, variant, on, ran):
    """``[B, T]`` ids and advantages read through their strides: the flat values' result bit
    for bit, and the gold's."""
    case = rows_tests._per_sequence_case(variant, B * T, seed=41)
    flat, view = _layout(case, layout)
    expected, a_expected, _ = rows_tests._run(flat, "triton")
    got, a_got, _ = rows_tests._run(view, "triton")
    assert ran["rows"] == 2
    assert torch.equal(got.stats, expected.stats) and torch.equal(a_got, a_expected)
    assert torch.equal(got.checks.nan_to_num(), expected.checks.nan_to_num())
    rows_tests.assert_same_as_naive(view, f"{variant} {layout} on {on}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", SEQUENCE_RATIO_POLICIES)
def test_in_order_ids_without_a_sort(device, variant, on, monkeypatch):
    """Ids that never decrease (runs of 1 to 80 rows), promised in order: no sort runs and the
    result is the gold's."""
    n = B * T
    case = rows_tests._per_sequence_case(variant, n, seed=43, echo_z_epsilon=1e-3)
    g = torch.Generator().manual_seed(7)
    ids = torch.repeat_interleave(torch.arange(n), torch.randint(1, 81, (n,), generator=g))[:n]
    case.rows = case.rows._replace(sequence_ids=ids, sequences_in_order=True)
    sorts: list[int] = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    rows_tests._run(case, "triton")
    assert not sorts
    monkeypatch.setattr(torch, "sort", real_sort)
    rows_tests.assert_same_as_naive(case, f"{variant} in order on {on}")


# ------------------------------------------------------------------ echo_loss, new policies

_POLICIES = {
    "sapo": LossConfig(policy="sapo", kl_coef=0.05),
    "sapo-sequence-means": LossConfig(
        policy="sapo_sequence", rl_normalization="sequence_mean_token_mean"
    ),
    "cispo-sequence": LossConfig(
        policy="cispo_sequence", cispo_max=1.5, echo_normalization="sequence_mean"
    ),
}


def _record(n: int, v: int, device: torch.device) -> LossInputs:
    g = torch.Generator().manual_seed(1)
    rl = torch.rand(n, generator=g) < 0.6
    echo = ~rl & (torch.rand(n, generator=g) < 0.5)
    fields = dict(
        labels=torch.randint(0, v, (n,), generator=g),
        rl_mask=rl,
        echo_weights=torch.where(echo, torch.rand(n, generator=g), 0.0),
        advantages=torch.randn(n, generator=g),
        inference_logprobs=-torch.rand(n, generator=g) * 12,
        ref_logprobs=-torch.rand(n, generator=g) * 12,
        sequence_ids=(torch.arange(n) * 31) % 97,  # a sequence's rows spread over the record
        observation_mask=torch.rand(n, generator=g) < 0.2,
    )
    return LossInputs(**{k: t.to(device) for k, t in fields.items()})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_POLICIES))
def test_new_policies_fused_algebra_equals_the_pytorch_algebra(device, name, on, ran):
    """``echo_loss`` with the fused row algebra against the PyTorch algebra
    (``fuse_loss_algebra("never")``), the same phases: loss and metrics within
    ``N·2^-24`` relative (fp32 sums of N terms in another order), gradients within one bf16
    ulp of the largest entry."""
    from echoloss._deferred import device_code_path, raise_deferred_errors
    from echoloss.loss import echo_loss
    from echoloss.loss.fused import fuse_loss_algebra

    n, v = 1031, 37  # rows past one program block; the algebra does not read the vocabulary
    # the phases: Triton on CUDA; on CPU the reference (interpreted, 1,031 rows of phase
    # programs take about a minute per call; the phases have their own interpreter tests)
    phases = "triton" if on.type == "cuda" else "reference"
    x = _record(n, v, on)
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(n, v, generator=g) * 2).bfloat16().to(on)
    results = []
    try:
        for mode in ("never", "always"):
            fuse_loss_algebra(mode)
            assert ran["rows"] == 0 or mode == "always"
            leaf = logits.clone().requires_grad_()
            with device_code_path():
                out = echo_loss(leaf, x, config=_POLICIES[name], backend=phases)
                out.loss.backward()
                raise_deferred_errors()
            results.append((out.loss.detach().double(), leaf.grad.double(), out.metrics))
    finally:
        fuse_loss_algebra("always")
    assert ran["rows"] == 1  # the fused algebra ran once, in the second call
    (a, ga, ma), (b, gb, mb) = results
    tol = n * 2.0**-24
    assert list(ma) == list(mb)
    assert float((a - b).abs()) <= tol * max(1.0, float(a.abs()))
    for key in ma:
        ref = float(ma[key])
        assert abs(float(mb[key]) - ref) <= tol * max(1.0, abs(ref)), key
    assert bool(torch.isfinite(gb).all())
    assert float((ga - gb).abs().max()) <= 2.0**-8 * float(ga.abs().max())


# ------------------------------------------------------------------ the value-check program


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_value_check_program_equals_the_gold(device, dtype, on, ran):
    """Every rule on 1, 1025 and 2051 entries (one block, a block and one, two and a part),
    whole, transposed and one column of a ``[n, 2]`` buffer, with and without a row mask."""
    from echoloss.ops.value_checks import RULES, RowCheck, value_check_numbers

    g = torch.Generator().manual_seed(0)
    for n in (1, 1025, 2051):
        base = torch.randn(n, 2, generator=g, dtype=torch.float64)
        base[n // 3, 0] = NAN
        base[n - 1, 1] = -math.inf
        values = base.to(dtype) if dtype.is_floating_point else (base > 1).to(dtype) * 3
        values = values.to(on)
        rows = (torch.rand(n, 2, generator=g) < 0.9).to(on)
        threshold = 1e-3 if dtype.is_floating_point else 1
        for rule, view in itertools.product(RULES, (values, values.t(), values[:, :1])):
            mask = rows if view.shape == values.shape else None
            checks = [RowCheck(view, mask, rule, threshold)]
            fused = value_check_numbers(checks)
            gold = value_check_numbers(checks, backend="naive")
            assert fused.dtype == gold.dtype == torch.float64, (rule, n)
            assert torch.equal(fused.isnan(), gold.isnan()), (rule, n, fused, gold)
            assert torch.equal(fused.nan_to_num(), gold.nan_to_num()), (rule, n, fused, gold)
    assert ran["checks"] == 3 * len(RULES) * 3  # every fused call ran the program


# ------------------------------------------------------------------ fused-linear buffers

_V, _H = 601, 40  # two interpreter vocabulary blocks of 512 (tests/ops/conftest.py)


def _linear_case(n: int, device: torch.device, *, idle: bool):
    g = torch.Generator().manual_seed(n)
    hidden = torch.randn(n, _H, generator=g, dtype=torch.float64).float().to(device)
    weight = (torch.randn(_V, _H, generator=g, dtype=torch.float64) * 0.4).float().to(device)
    rl = torch.rand(n, generator=g) < 0.5
    echo = ~rl & (torch.rand(n, generator=g) < 0.5)
    if idle:  # no participating row at all
        rl[:], echo[:] = False, False
    fields = dict(
        labels=torch.randint(0, _V, (n,), generator=g),
        rl_mask=rl,
        echo_weights=torch.where(echo, 0.3, 0.0),
        advantages=torch.randn(n, generator=g),
        inference_logprobs=-torch.rand(n, generator=g) * 3,
        sequence_ids=torch.arange(n) // 9,  # runs of 9 rows (sapo_sequence reads them)
    )
    return hidden, weight, LossInputs(**{k: t.to(device) for k, t in fields.items()})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [None, 7], ids=["one-chunk", "chunks-of-7"])
@pytest.mark.parametrize("policy", ["dppo", "sapo_sequence"])
def test_fused_linear_writes_every_row_of_its_buffers(device, chunk, policy, on, ran):
    """``echo_loss_from_hidden`` (NaN-filled ``torch.empty``) against logits-then-loss on the
    same fp32 inputs, 53 rows of which about a quarter take no part: the same loss and
    gradients (one chunk: the same GEMMs and phases; chunks of 7: fp32 sums over chunks, the
    weight gradient accumulated in another order), every value finite."""
    from echoloss import echo_loss_from_hidden
    from echoloss._deferred import device_code_path, raise_deferred_errors
    from echoloss.loss import echo_loss

    n = 53
    hidden, weight, x = _linear_case(n, on, idle=False)
    cfg = LossConfig(policy=policy)
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with device_code_path():
            if fused:
                out = echo_loss_from_hidden(h, w, x, config=cfg, chunk_size=chunk, backend="triton")
            else:
                out = echo_loss(h @ w.t(), x, config=cfg, backend="triton")
            (out.loss / 3).backward()
            raise_deferred_errors()
        results.append((out.loss.detach(), h.grad, w.grad))
    assert ran["rows"] == 2  # the fused row algebra on both paths
    for got, want in zip(*results, strict=True):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert float(results[0][2].abs().max()) > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [None, 7], ids=["one-chunk", "chunks-of-7"])
def test_fused_linear_without_participating_rows_gives_exact_zeros(device, chunk, on):
    """No participating row: a loss of exactly 0 and gradients of exactly 0 everywhere (not
    the NaN ``torch.empty`` holds in these tests)."""
    from echoloss import echo_loss_from_hidden
    from echoloss._deferred import device_code_path, raise_deferred_errors

    hidden, weight, x = _linear_case(29, on, idle=True)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with device_code_path():
        out = echo_loss_from_hidden(h, w, x, chunk_size=chunk, backend="triton")
        out.loss.backward()
        raise_deferred_errors()
    assert float(out.loss.detach()) == 0.0
    for grad in (h.grad, w.grad):
        assert grad is None or torch.equal(grad, torch.zeros_like(grad))
