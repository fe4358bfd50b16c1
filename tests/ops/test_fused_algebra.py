"""The loss through the fused ``[N]`` algebra (``fuse_loss_algebra("always")``) against the
PyTorch algebra (``"never"``, the definition), through the public entry points.

``echo_loss`` (the two phases by the reference or, on the interpreter, Triton), and
``echo_loss_from_logprobs`` and the ``echoloss.nn`` modules (which end in the same
``loss_from_logprobs``), inside ``device_code_path()`` (the CUDA code path: deferred checks, no
host reads) and on the host path: the same loss, gradients, metric keys in the same order and
metric values, the same error messages, and which configurations run the fused program at all
(a spy on ``fused.forward``: a test that means to exercise it asserts it ran).

Tolerances: the two algebras compute the same per-row formulas in fp32 and differ in the order
of their sums (``tests/ops/test_row_algebra.py``): sums within ``sum_tol`` of a bound of their
terms' magnitudes, per-row derivatives within ``16·eps`` of a bound of their terms. Gradients
with respect to the logits are ``a_i·(onehot - p) + b_i·(...)`` computed by the same phase from
``a_i`` and ``b_i``: the ``a_i`` difference times ``|onehot - p| ≤ 1`` plus the phase's own
rounding of ``|a_i|`` (a few ulps): ``32·eps·G_i`` per row. Counts and flag fractions are exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from _fused_cases import HAS_CUDA
from _row_algebra_cases import EPS, Case, bounds, ref_kl_scale, sum_tol

from echoloss._deferred import device_code_path, pending_count, raise_deferred_errors
from echoloss._logging import reset_warnings
from echoloss.loss import (
    LossConfig,
    LossInputs,
    Normalizers,
    compiled,
    count_normalizers,
    echo_loss,
    echo_loss_from_hidden,
    echo_loss_from_logprobs,
)
from echoloss.loss import policy as policy_module
from echoloss.loss.fused import (
    fuse_loss_algebra,
    fused_algebra_applies,
    row_algebra_params,
    row_inputs,
)
from echoloss.loss.policy import PolicyOutput, register_policy
from echoloss.ops.row_algebra import fused as fused_module
from echoloss.ops.row_algebra.policies import ROW_POLICIES

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.counting import count_ops, paused, uncounted_reference_phases  # noqa: E402

pytestmark = [
    # The interpreted phases meet -inf and 0/0 on masked lanes, the overflow test inf - inf.
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
    # fuse_loss_algebra("always") on cpu tensors runs the program under the interpreter, which
    # tests/ops/conftest.py turns on only without CUDA (test_row_algebra.py runs on the GPU).
    pytest.mark.skipif(HAS_CUDA, reason="the CPU device path under the Triton interpreter"),
]

NAN = math.nan
#: Rows: three blocks of the program (the last one partial); a small vocabulary.
N, V = 2500, 23

#: Configurations the fused algebra covers (`fused_algebra_applies`).
ACCEPTED = {
    "dppo": LossConfig(),
    "dppo-kl-entropy": LossConfig(kl_tau=0.2, entropy_coef=0.01),
    "ppo_clip-dual-no-clamp": LossConfig(
        policy="ppo_clip", dual_clip=3.0, log_ratio_clamp=None, adv_tau=0.5
    ),
    "ppo_clip-entropy-sum": LossConfig(
        policy="ppo_clip", eps_high=0.28, entropy_coef=0.02, echo_normalization="sum"
    ),
    "cispo-batch-mean": LossConfig(
        policy="cispo", cispo_min=0.5, echo_normalization="batch_token_mean"
    ),
    "cispo-constant": LossConfig(
        policy="cispo", rl_normalization="token_sum_constant", rl_normalization_constant=3000.0
    ),
    "reinforce-no-entropy-metric": LossConfig(policy="reinforce", compute_entropy=False),
    "reinforce-unchecked": LossConfig(policy="reinforce", check_finite=False),
    "sft": LossConfig(mode="sft"),
    "dppo-sequence-means": LossConfig(
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
        echo_z_epsilon=1e-3,
    ),
    "ppo_clip-sequence-token-sum": LossConfig(
        policy="ppo_clip", rl_normalization="sequence_mean_token_sum", entropy_coef=0.01
    ),
    "sft-sequence-mean": LossConfig(mode="sft", rl_normalization="sequence_mean_token_mean"),
    "reinforce-token-mask-k3": LossConfig(
        policy="reinforce", mismatch="token_mask", mismatch_min=0.5, kl_coef=0.1
    ),
    "ppo_clip-token-truncate-k1": LossConfig(
        policy="ppo_clip", mismatch="token_truncate", kl_coef=0.05, kl_estimator="k1"
    ),
    "cispo-k2-sequence-mean": LossConfig(
        policy="cispo",
        kl_coef=0.2,
        kl_estimator="k2",
        rl_normalization="sequence_mean_token_mean",
        entropy_coef=0.01,
    ),
}

ACCEPTED |= {
    "gspo-sequence-means": LossConfig(
        policy="gspo",
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
        mismatch="sequence_truncate",
    ),
    "gspo-wide-token-mask-kl": LossConfig(
        policy="gspo", eps_low=0.2, eps_high=0.2, mismatch="token_mask", kl_coef=0.05
    ),
    "dppo-sequence-mask": LossConfig(mismatch="sequence_mask", mismatch_min=0.5),
    "sapo-entropy": LossConfig(policy="sapo", entropy_coef=0.01, sapo_temperature_neg=1.5),
    "sapo-sequence-means-token-truncate": LossConfig(
        policy="sapo_sequence",
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
        mismatch="token_truncate",
    ),
    "cispo-sequence-k3": LossConfig(policy="cispo_sequence", cispo_max=1.2, kl_coef=0.1),
}

#: Configurations it leaves to the PyTorch algebra (besides custom policies and fp64
#: logprobs, `REJECTED_CALLS`): none of the built-in ones.
REJECTED: dict[str, LossConfig] = {}


@pytest.fixture(autouse=True)
def _restore_mode_and_nothing_pending():
    assert pending_count() == 0
    yield
    fuse_loss_algebra("auto")
    try:
        raise_deferred_errors()
    finally:
        assert pending_count() == 0


@pytest.fixture
def program_calls(monkeypatch):
    """How often the fused program ran (``fused.forward``)."""
    calls = [0]
    real = fused_module.forward

    def spy(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_module, "forward", spy)
    return calls


def _record(cfg: LossConfig, *, n: int = N, seed: int = 0, **changes) -> LossInputs:
    """RL rows, echo rows and padding (the last 7 rows and row 0), NaN placeholders where a
    field is not read; ratios against ``old_logprobs`` spread over the clip ranges."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    rl = u < 0.45
    echo = (u >= 0.45) & (u < 0.8)
    if cfg.mode == "sft":
        echo[:] = False
    for m in (rl, echo):
        m[0] = False
        m[-7:] = False
    labels = torch.randint(0, V, (n,), generator=g)
    labels[~(rl | echo)] = -100  # never read
    values = dict(
        labels=labels,
        rl_mask=rl,
        echo_weights=torch.where(echo, 0.1 + torch.rand(n, generator=g), 0.0),
        advantages=torch.where(rl, torch.randn(n, generator=g), 0.0),
        old_logprobs=torch.where(rl, -3 * torch.rand(n, generator=g) - 0.01, 0.0),
        inference_logprobs=torch.where(rl, -3 * torch.rand(n, generator=g) - 0.01, NAN),
        ref_logprobs=torch.where(rl, -3 * torch.rand(n, generator=g) - 0.01, NAN),
        # 53 sequences, the ids cycling over the rows: each sequence's rows spread over the
        # whole record (none adjacent)
        sequence_ids=(torch.arange(n) * 17) % 53,
        observation_mask=torch.rand(n, generator=g) < 0.2,
    )
    values.update(changes)
    return LossInputs(**values)


def _logprobs_of(x: LossInputs, seed: int = 1) -> torch.Tensor:
    """Logprobs near the old ones (ratios around 1, a few beyond the clip ranges)."""
    g = torch.Generator().manual_seed(seed)
    old = x.flat("old_logprobs")
    base = -3 * torch.rand(N, generator=g) - 0.01 if old is None else old
    lp = (base + 0.3 * torch.randn(base.shape, generator=g)).clamp(max=-1e-3)
    return torch.where(x.rl | x.echo, lp, NAN)


@contextlib.contextmanager
def _mode(mode: str, device_path: bool):
    fuse_loss_algebra(mode)
    try:
        with device_code_path() if device_path else contextlib.nullcontext():
            yield
            raise_deferred_errors()
    finally:
        fuse_loss_algebra("auto")


def _entropy_of(x: LossInputs) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.where(x.rl, 2 * torch.rand(x.rl.shape, generator=g), NAN)


def _from_logprobs(cfg, x, *, mode, device_path, normalizers=None, lp=None):
    lp = (_logprobs_of(x) if lp is None else lp).clone().requires_grad_()
    ent = _entropy_of(x).requires_grad_()
    with _mode(mode, device_path):
        out = echo_loss_from_logprobs(
            lp, x.replace(labels=None), entropy=ent, config=cfg, normalizers=normalizers
        )
        out.loss.backward()
    return out, lp.grad, ent.grad


def _from_logits(cfg, x, *, mode, device_path, backend="reference", normalizers=None, logits=None):
    if logits is None:
        g = torch.Generator().manual_seed(3)
        logits = torch.randn(x.rl.numel(), V, generator=g) * 3
    logits = logits.clone().requires_grad_()
    with _mode(mode, device_path):
        out = echo_loss(logits, x, config=cfg, normalizers=normalizers, backend=backend)
        out.loss.backward()
    return out, logits.grad


def _case(lp, ent, x, cfg, normalizers) -> Case:
    """The row-algebra call the loss makes (for the tolerances' bounds)."""
    params = row_algebra_params(cfg, ent, x, normalizers)
    return Case(lp.detach().reshape(-1).float(), ent, row_inputs(x), params)


#: Metrics that are sums over rows (compared within ``sum_tol``), for "all" and every env;
#: every other one (counts, fractions of counts, maxima) exactly.
SUMS = ("loss_rl", "loss_echo", "echo_nll_mean", "mismatch_kl", "entropy", "is_weight", "ref_kl")


def assert_same_loss(fused, ref, case: Case, what: str) -> None:
    s, _ = bounds(case)
    tol = sum_tol(case.n, s)
    assert abs(float(fused.loss.detach()) - float(ref.loss.detach())) <= tol, (
        what,
        float(fused.loss.detach()),
        float(ref.loss.detach()),
        tol,
    )
    assert list(fused.metrics) == list(ref.metrics), what
    for k, rv in ref.metrics.items():
        fv = fused.metrics[k]
        assert fv.dtype == rv.dtype and fv.shape == rv.shape, (what, k, fv, rv)
        if k.split("/")[0] in SUMS:
            scale = s if k.startswith("loss") else abs(float(rv))  # terms ≥ 0: their sum
            if k.startswith("ref_kl"):
                scale = ref_kl_scale(case)
            assert abs(float(fv) - float(rv)) <= sum_tol(case.n, scale), (what, k, fv, rv)
        else:
            assert float(fv) == float(rv), (what, k, fv, rv)


def assert_same_rows(actual, expected, g_scale, what) -> None:
    """Per-row gradients (``[N]`` or ``[N, V]``) within ``factor·eps·G_i`` of each row."""
    g = g_scale.reshape(-1, *([1] * (actual.dim() - 1)))
    err = (actual.double() - expected.double()).abs()
    bad = ~(err <= g)
    assert not bad.any(), (what, bad.nonzero()[:5].tolist(), float(err.max()))


# ---------------------------------------------------------------- fused vs PyTorch algebra


@pytest.mark.parametrize("device_path", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_from_logprobs_fused_equals_pytorch(name, device_path, program_calls):
    cfg = ACCEPTED[name]
    x = _record(cfg)
    fused, a_f, b_f = _from_logprobs(cfg, x, mode="always", device_path=device_path)
    assert program_calls[0] == 1, "the fused program did not run"
    ref, a_r, b_r = _from_logprobs(cfg, x, mode="never", device_path=device_path)
    assert program_calls[0] == 1
    case = _case(_logprobs_of(x), _entropy_of(x), x, cfg, None)
    assert_same_loss(fused, ref, case, name)
    _, g = bounds(case)
    assert_same_rows(a_f, a_r, 16 * EPS * g, name)
    assert torch.all(a_f[~(x.rl | x.echo)] == 0), name
    if cfg.entropy_coef:
        torch.testing.assert_close(b_f, b_r, rtol=2 * EPS, atol=0.0)
    else:
        assert b_f is None and b_r is None


@pytest.mark.parametrize("device_path", [True, False], ids=["device", "host"])
@pytest.mark.parametrize(
    "name", ["dppo-kl-entropy", "ppo_clip-entropy-sum", "sft", "dppo-sequence-means"]
)
def test_from_logits_fused_equals_pytorch(name, device_path, program_calls):
    cfg = ACCEPTED[name]
    x = _record(cfg, temperature=0.7)  # RL rows at 0.7, echo rows at 1 (echo_temperature)
    fused, d_f = _from_logits(cfg, x, mode="always", device_path=device_path)
    assert program_calls[0] == 1, "the fused program did not run"
    ref, d_r = _from_logits(cfg, x, mode="never", device_path=device_path)
    # the bounds need the logprobs the phase computed: read them from the reference
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(N, V, generator=g) * 3
    lp = torch.log_softmax(logits, -1).gather(1, x.labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    lp = torch.where(x.rl | x.echo, lp, NAN)
    p = torch.softmax(logits, -1)
    ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    case = _case(lp, ent, x, cfg, None)
    assert_same_loss(fused, ref, case, name)
    _, gb = bounds(case)
    # b_i = -entropy_coef/N_rl enters dlogits times p·(log p + H), |log p| + H ≤ 40 here
    assert float(torch.log_softmax(logits, -1).min()) > -35
    b = abs(cfg.entropy_coef) / max(int(x.rl.sum()), 1) * 40
    assert_same_rows(d_f, d_r, 32 * EPS * (gb + b), name)
    assert torch.all(d_f[~(x.rl | x.echo)] == 0)


def test_triton_phases_with_the_fused_algebra(program_calls):
    """Both phases and the algebra as Triton programs (interpreter), device path: the same as
    the reference phases with the PyTorch algebra."""
    cfg = ACCEPTED["dppo-kl-entropy"]
    n = 1100  # above one block of the algebra, kept small: each phase program is interpreted
    x = _record(cfg, n=n)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, V, generator=g) * 3
    fused, d_f = _from_logits(
        cfg, x, mode="always", device_path=True, backend="triton", logits=logits
    )
    assert program_calls[0] == 1
    ref, d_r = _from_logits(cfg, x, mode="never", device_path=False, logits=logits)
    lp = torch.log_softmax(logits, -1).gather(1, x.labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    case = _case(torch.where(x.rl | x.echo, lp, NAN), torch.ones(n), x, cfg, None)
    # the phases differ too (fp32 log-sum-exp in blocks vs log_softmax: ≤ 1e-5 per logprob,
    # tests/ops/_fused_cases.py STAT_TOL), moving each term by |∂L/∂lp_i|·1e-5
    s, gb = bounds(case)
    tol = sum_tol(n, s) + 1e-5 * float(gb.sum())
    assert abs(float(fused.loss.detach()) - float(ref.loss.detach())) <= tol
    assert list(fused.metrics) == list(ref.metrics)
    torch.testing.assert_close(d_f, d_r, rtol=1e-5, atol=1e-5 * float(gb.max()) + 1e-7)


#: Given normalisers larger than the call's counts, and the divisors they give the program.
GIVEN_NORMALIZERS = {
    "token": (
        LossConfig(policy="ppo_clip", echo_normalization="batch_token_mean"),
        Normalizers(rl_tokens=4000, echo_tokens=3000, echo_batches=3, sequences=60),
        (4000, 3),
    ),
    "sequence": (
        ACCEPTED["dppo-sequence-means"],
        Normalizers(rl_tokens=1, echo_tokens=1, rl_sequences=170, echo_sequences=90),
        (170, 90),
    ),
}


@pytest.mark.parametrize("name", sorted(GIVEN_NORMALIZERS))
def test_normalizers_given(name, program_calls):
    """Given normalisers divide both terms, in both algebras (token counts, or the sequence
    counts of the per-sequence means, whose own counts come from the program)."""
    cfg, norms, divisors = GIVEN_NORMALIZERS[name]
    x = _record(cfg)
    for device_path in (True, False):
        fused, a_f, _ = _from_logprobs(
            cfg, x, mode="always", device_path=device_path, normalizers=norms
        )
        ref, a_r, _ = _from_logprobs(
            cfg, x, mode="never", device_path=device_path, normalizers=norms
        )
        case = _case(_logprobs_of(x), None, x, cfg, norms)
        assert (case.params.rl_divisor, case.params.echo_divisor) == divisors
        assert_same_loss(fused, ref, case, name)
        _, g = bounds(case)
        assert_same_rows(a_f, a_r, 16 * EPS * g, name)
    assert program_calls[0] == 2


@pytest.mark.parametrize("count", ["rl_sequences", "echo_sequences"])
def test_same_error_for_too_small_sequence_normalizers(count, program_calls):
    cfg = ACCEPTED["dppo-sequence-means"]
    x = _record(cfg)
    local = count_normalizers(x)
    norms = dataclasses.replace(local, **{count: getattr(local, count) - 1})

    def call():
        lp = _logprobs_of(x).requires_grad_()
        echo_loss_from_logprobs(lp, x.replace(labels=None), config=cfg, normalizers=norms)

    _assert_same_error(call, f"normalizers.{count}={getattr(local, count) - 1}", program_calls)


@pytest.mark.parametrize("module", ["EchoGRPOLoss", "EchoFusedLinearGRPOLoss"])
def test_token_sum_constant_on_the_device_from_the_nn_modules(module, program_calls):
    """``loss_type="dapo"``: the RL divisor is a device tensor (the batch's RL tokens), given
    to the fused program as ``RowInputs.rl_divisor``; on logits, and on hidden states and the
    LM head (gradients formed in its forward pass)."""
    import echoloss.nn

    b, t, h = 6, 400, 8
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(b, t, h, generator=g), torch.randn(V, h, generator=g)
    ids = torch.randint(0, V, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) < 0.9
    adv = torch.randn(b, generator=g)
    echo_w = torch.where(torch.rand(b, t, generator=g) < 0.3, 0.5, 0.0)
    loss_fn = getattr(echoloss.nn, module)(beta=0.0, loss_type="dapo")
    results = {}
    for mode in ("always", "never"):
        leaf = hidden.clone().requires_grad_()
        with _mode(mode, True):
            if module == "EchoGRPOLoss":
                logits = leaf @ weight.T
                loss, metrics = loss_fn(logits, ids, mask, adv, echo_weights=echo_w)
            else:
                loss, metrics = loss_fn(leaf, weight, ids, mask, adv, echo_weights=echo_w)
            loss.backward()
        results[mode] = (loss.detach(), metrics, leaf.grad)
    assert program_calls[0] == 1
    (lf, mf, gf), (lr, mr, gr) = results["always"], results["never"]
    # On-policy (no old logprobs): every ratio is 1, so each RL term is -A_i·(1 or the clip
    # bound 1.2) over the RL tokens; the echo terms are ≥ 0, their sum is loss_echo itself.
    rl = mask & ~(echo_w > 0)
    n_rl = int(rl.sum())
    s = float((adv.unsqueeze(1).expand(b, t).abs() * rl).sum()) * 1.2 / n_rl
    s += float(mr["loss_echo/all"])
    assert abs(float(lf) - float(lr)) <= sum_tol(n_rl, s)
    assert list(mf) == list(mr)
    for k in mr:
        scale = s if k.startswith("loss") else abs(float(mr[k]))  # sums of terms ≥ 0
        tol = sum_tol(b * t, scale) if k.split("/")[0] in SUMS else 0.0
        assert abs(float(mf[k]) - float(mr[k])) <= tol, (k, mf[k], mr[k])
    # a_i = -A_i/N_rl in two operation orders (≤ 2 ulps), times |onehot - p| ≤ 1, then the
    # same phase and matmul arithmetic (each d hidden row is a sum over V of such terms times
    # the weight: the bound scales with the largest gradient)
    torch.testing.assert_close(gf, gr, rtol=4 * EPS, atol=4 * EPS * float(gr.abs().max()))


# ---------------------------------------------------------------- which configs run fused


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_configs_run_the_program(name, program_calls):
    cfg = ACCEPTED[name]
    x = _record(cfg, n=50)
    lp = torch.where(x.rl | x.echo, -torch.rand(50) - 0.01, NAN)
    ent = torch.ones(50)
    fuse_loss_algebra("always")
    assert fused_algebra_applies(lp, ent, x, cfg, None, None)
    fuse_loss_algebra("never")
    assert not fused_algebra_applies(lp, ent, x, cfg, None, None)
    fuse_loss_algebra("auto")  # cpu tensors: only CUDA
    assert not fused_algebra_applies(lp, ent, x, cfg, None, None)


@pytest.mark.parametrize("device_path", [True, False], ids=["device", "host"])
@pytest.mark.parametrize("name", ["dppo-kl-entropy", "ppo_clip-entropy-sum", "sft"])
def test_per_env_metrics_run_the_program(name, device_path, program_calls):
    """``env_names`` with ``sequence_ids``: one program more per env; the same keys in the
    same order (per env: counts, echo NLL, means, flags) and the same values as the PyTorch
    algebra's ``loss_metrics``, an env without rows included (all its metrics 0)."""
    cfg = ACCEPTED[name]
    sid = torch.arange(N) // 50
    sid[-7:] = -1  # the record's padding rows
    last = int(sid.max())
    sid = torch.where(sid == last - 1, last - 2, sid)  # sequence last - 1 has no rows
    names = (["b", "", "a", "b", "c", "a", "", "b", "a"] * N)[: last + 1]
    names[last - 1] = "zz"
    x = _record(cfg, sequence_ids=sid, env_names=names)
    fused, a_f, _ = _from_logprobs(cfg, x, mode="always", device_path=device_path)
    assert program_calls[0] == 1, "the fused program did not run"
    ref, a_r, _ = _from_logprobs(cfg, x, mode="never", device_path=device_path)
    assert [k.split("/")[1] for k in fused.metrics if k.startswith("rl_tokens/")] == [
        "all", "a", "b", "c", "zz"
    ]  # fmt: skip
    assert float(fused.metrics["rl_tokens/zz"]) == 0.0  # its sequence has no rows
    case = _case(_logprobs_of(x), _entropy_of(x), x, cfg, None)
    assert_same_loss(fused, ref, case, name)
    _, g = bounds(case)
    assert_same_rows(a_f, a_r, 16 * EPS * g, name)


def _custom(inputs, cfg):
    return PolicyOutput(-(inputs.advantages * inputs.logprobs), {})


_custom.all_rows = True  # type: ignore[attr-defined]


REJECTED_CALLS = {
    **{k: (cfg, {}) for k, cfg in REJECTED.items()},
    "custom": (
        LossConfig(policy="custom", allow_echo_with_custom_policy=True),
        {"policy_fn": _custom},
    ),
    "fp64": (LossConfig(), {"dtype": torch.float64}),
}


@pytest.mark.parametrize("name", sorted(REJECTED_CALLS))
def test_rejected_configs_run_the_pytorch_algebra(name, program_calls):
    """Outside the fused program's coverage ``"always"`` runs the PyTorch algebra: the program
    never runs and the result is the ``"never"`` one, bit for bit."""
    cfg, extra = REJECTED_CALLS[name]
    extra = dict(extra)
    dtype = extra.pop("dtype", torch.float32)
    policy_fn = extra.pop("policy_fn", None)
    n = 500
    x = _record(cfg, n=n, **extra)
    if cfg.echo_normalization == "sequence_mean":
        x = x.replace(observation_mask=x.echo)
    lp0 = torch.where(x.rl | x.echo, -torch.rand(n) - 0.01, NAN).to(dtype)
    outs = []
    for mode in ("always", "never"):
        lp = lp0.clone().requires_grad_()
        with _mode(mode, True):
            out = echo_loss_from_logprobs(
                lp, x.replace(labels=None), config=cfg, policy_fn=policy_fn
            )
            out.loss.backward()
        outs.append((out, lp.grad))
    assert program_calls[0] == 0, name
    (f, gf), (r, gr) = outs
    assert torch.equal(f.loss, r.loss) and torch.equal(gf, gr), name
    assert list(f.metrics) == list(r.metrics)


# ---------------------------------------------------------------- the same errors


def _error(fn) -> tuple[str, type, str]:
    """``(where, type, message)`` of the error ``fn`` raises: in the ``"call"`` or when the
    deferred checks are read (``"deferred"``)."""
    where = "call"
    try:
        fn()
        where = "deferred"
        raise_deferred_errors()
    except Exception as e:
        return where, type(e), str(e)
    raise AssertionError("no error")


def _errors_in_every_mode(call) -> dict[tuple[str, bool], tuple[str, type, str]]:
    out = {}
    for device_path in (True, False):
        for mode in ("always", "never"):
            fuse_loss_algebra(mode)
            try:
                with device_code_path() if device_path else contextlib.nullcontext():
                    out[mode, device_path] = _error(call)
            finally:
                fuse_loss_algebra("auto")
    return out


def _assert_same_error(call, contains: str, program_calls) -> None:
    errors = _errors_in_every_mode(call)
    assert program_calls[0] >= 1, "the fused program did not run"
    for device_path in (True, False):
        fused, ref = errors["always", device_path], errors["never", device_path]
        assert fused == ref, (device_path, fused, ref)
        assert contains in ref[2], ref
    assert errors["always", True][0] == "deferred"  # the device path reads nothing back


def test_same_error_for_a_nan_logits_row(program_calls):
    cfg = LossConfig()
    x = _record(cfg)
    logits = torch.randn(N, V)
    rows = (x.rl | x.echo).nonzero().flatten()
    logits[rows[1500]] = NAN

    def call():
        echo_loss(logits, x, config=cfg, backend="reference")

    _assert_same_error(call, f"logits row {int(rows[1500])}", program_calls)


@pytest.mark.parametrize("source", ["logits", "hidden"])
def test_same_error_for_a_label_out_of_range(source, program_calls):
    """The logprob op leaves the range check of the labels to the loss on the device path
    (the fused algebra checks them in its launch; the PyTorch algebra queues the op's check):
    the same error either way, for logits and for hidden states."""
    cfg = LossConfig()
    x = _record(cfg)
    rows = (x.rl | x.echo).nonzero().flatten()
    labels = x.labels.clone()
    labels[rows[1900]] = V + 3  # (a negative label is refused by the record itself)
    x = x.replace(labels=labels)
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(N, 8, generator=g), torch.randn(V, 8, generator=g)

    def call():
        if source == "logits":
            echo_loss(torch.randn(N, V), x, config=cfg, backend="reference")
        else:
            echo_loss_from_hidden(hidden, weight, x, config=cfg, backend="reference")

    _assert_same_error(call, f"labels[{int(rows[1900])}]", program_calls)
    _assert_same_error(call, str(V + 3), program_calls)
    messages = {e[2] for e in _errors_in_every_mode(call).values()}
    assert len(messages) == 1, messages  # host and device path, fused or not: one message


@pytest.mark.parametrize("count", ["rl_tokens", "echo_tokens", "echo_batches"])
def test_same_error_for_too_small_normalizers(count, program_calls):
    """The fused path reads the call's counts where the row program wrote them (its stats,
    no launch); ``echo_batches`` from its echo-token count (1 when the call echoes a row)."""
    cfg = LossConfig(
        echo_normalization="batch_token_mean" if count == "echo_batches" else "token_mean"
    )
    x = _record(cfg)
    local = count_normalizers(x)
    assert local.echo_batches == 1  # the record echoes rows
    norms = dataclasses.replace(local, **{count: getattr(local, count) - 1})

    def call():
        lp = _logprobs_of(x).requires_grad_()
        echo_loss_from_logprobs(lp, x.replace(labels=None), config=cfg, normalizers=norms)

    message = f"normalizers.{count}={getattr(local, count) - 1} is smaller than this call's "
    _assert_same_error(call, message + str(getattr(local, count)), program_calls)


def test_same_error_for_a_final_loss_overflow(program_calls):
    """Advantages of 3e38 on RL rows: every row finite, their sum not."""
    cfg = LossConfig(policy="reinforce")
    x = _record(cfg)
    x = x.replace(advantages=torch.where(x.rl, 3e38, 0.0))

    def call():
        lp = torch.where(x.rl | x.echo, torch.tensor(-0.9), NAN).requires_grad_()
        echo_loss_from_logprobs(lp, x.replace(labels=None), config=cfg)

    _assert_same_error(call, "loss must be finite", program_calls)


def test_same_error_for_a_nan_logprob(program_calls):
    cfg = LossConfig(policy="ppo_clip")
    x = _record(cfg)
    rows = x.echo.nonzero().flatten()
    lp0 = _logprobs_of(x)
    lp0[rows[800]] = NAN

    def call():
        echo_loss_from_logprobs(lp0.clone().requires_grad_(), x.replace(labels=None), config=cfg)

    _assert_same_error(call, f"logprobs row {int(rows[800])}", program_calls)


# ---------------------------------------------------------------- host syncs


@pytest.fixture
def phases_uncounted(monkeypatch):
    """The vocabulary-sized phases run the reference with the counter paused (on CUDA they
    are two Triton launches, not aten ops); so does the launch of the fused program, whose
    interpreter copies to numpy stand for one Triton launch (everything around it is counted)."""

    fake = uncounted_reference_phases()
    op = importlib.import_module("echoloss.ops.selective_logprobs.op")
    monkeypatch.setattr(op, "resolve_backend", lambda b, d: fake)
    kernel = fused_module._row_algebra_kernel

    class Launch:  # kernel[grid](...) with the counter paused around the launch alone
        def __getitem__(self, grid):
            def launch(*a, **k):
                with paused():
                    return kernel[grid](*a, **k)

            return launch

    active = fused_module.interpreter_active()  # read from the kernel's type, replaced here
    monkeypatch.setattr(fused_module, "interpreter_active", lambda: active)
    monkeypatch.setattr(fused_module, "_row_algebra_kernel", Launch())


@pytest.mark.parametrize("name", ["dppo-kl-entropy", "dppo-sequence-means"])
@pytest.mark.parametrize("entry", ["logits", "logprobs"])
def test_no_host_sync_on_the_fused_device_path(entry, name, phases_uncounted, monkeypatch):
    cfg = ACCEPTED[name]
    x = _record(cfg, n=300)
    runs = [0]
    program = fused_module.forward

    def counted(*a, **k):
        runs[0] += 1
        return program(*a, **k)

    monkeypatch.setattr(fused_module, "forward", counted)
    fuse_loss_algebra("always")
    try:
        with device_code_path():
            with count_ops() as fwd:
                if entry == "logits":
                    leaf = torch.randn(300, V).requires_grad_()
                    out = echo_loss(leaf, x, config=cfg)
                else:
                    leaf = torch.where(x.rl | x.echo, -torch.rand(300) - 0.01, NAN)
                    leaf.requires_grad_()
                    ent = torch.rand(300).requires_grad_()
                    out = echo_loss_from_logprobs(
                        leaf, x.replace(labels=None), entropy=ent, config=cfg
                    )
            with count_ops() as bwd:
                out.loss.backward()
            raise_deferred_errors()
    finally:
        fuse_loss_algebra("auto")
    assert runs[0] == 1
    assert fwd.num_syncs == 0, dict(fwd.syncs)
    assert bwd.num_syncs == 0, dict(bwd.syncs)


# ---------------------------------------------------------------- failure modes of the field


def test_echo_rows_get_minus_w_over_n_echo_on_the_fused_path(program_calls):
    """Echo rows are not in the trust region: an echo row whose old logprob says ratio e^50 and
    whose inference logprob is NaN still gets exactly -w/N_echo (not selected away, not
    clipped, not dropped by dppo)."""
    token_level = [p for p, row in ROW_POLICIES.items() if not row.sequence_ratio]
    for policy in token_level:
        cfg = LossConfig(policy=policy)
        x = _record(cfg)
        lp = _logprobs_of(x)
        old = torch.where(x.echo, (lp - 50).nan_to_num(-60.0), x.flat("old_logprobs"))
        x = x.replace(old_logprobs=old)
        _, a, _ = _from_logprobs(cfg, x, mode="always", device_path=True, lp=lp)
        w = x.flat("echo_weights")
        n_echo = int(x.echo.sum())
        torch.testing.assert_close(a[x.echo], -w[x.echo] / n_echo, rtol=EPS, atol=0.0)
    assert program_calls[0] == len(token_level)


def test_padding_rows_do_not_dilute_the_fused_denominators(program_calls):
    """Padding rows appended (labels -100, masks False) change neither the loss nor any
    participating row's gradient."""
    cfg = LossConfig(policy="ppo_clip", kl_tau=0.1)
    x = _record(cfg, n=1200)
    lp = torch.where(x.rl | x.echo, -torch.rand(1200) - 0.01, NAN)
    pad = 1500
    fields = {}
    for name in ("labels", "rl_mask", "echo_weights", "advantages", "old_logprobs"):
        t = getattr(x, name)
        fill = -100 if name == "labels" else (False if t.dtype == torch.bool else 0.0)
        fields[name] = torch.cat([t, torch.full((pad,), fill, dtype=t.dtype)])
    big = LossInputs(**fields, inference_logprobs=None)
    small = x.replace(inference_logprobs=None, sequence_ids=None)
    o1, a1, _ = _from_logprobs(cfg, small, mode="always", device_path=True, lp=lp)
    o2, a2, _ = _from_logprobs(
        cfg, big, mode="always", device_path=True, lp=torch.cat([lp, torch.full((pad,), NAN)])
    )
    assert program_calls[0] == 2
    assert float(o2.loss.detach()) == pytest.approx(float(o1.loss.detach()), rel=1e-6)
    assert torch.equal(a2[:1200], a1) and torch.all(a2[1200:] == 0)
    assert float(o2.metrics["rl_tokens/all"]) == float(x.rl.sum())


def test_row_zero_not_participating_gets_exactly_zero_gradient(program_calls):
    """Row 0 is padding (label -100): its logits get exactly zero gradient on the fused path."""
    cfg = LossConfig(entropy_coef=0.01)
    x = _record(cfg)
    assert not (x.rl[0] or x.echo[0])
    _, d = _from_logits(cfg, x, mode="always", device_path=True)
    assert program_calls[0] == 1
    assert torch.equal(d[0], torch.zeros(V))
    assert torch.all(d[~(x.rl | x.echo)] == 0)


@pytest.mark.parametrize("device_path", [True, False], ids=["device", "host"])
def test_from_hidden_fused_equals_pytorch(device_path, program_calls):
    """``echo_loss_from_hidden`` (gradients formed in its forward pass from the rows'
    coefficients, the loss, metrics and checks from the algebra): the same in both modes."""
    from echoloss.loss import echo_loss_from_hidden

    cfg = ACCEPTED["ppo_clip-entropy-sum"]
    n, h = 1500, 8
    x = _record(cfg, n=n)
    g = torch.Generator().manual_seed(8)
    hidden0, weight0 = torch.randn(n, h, generator=g), torch.randn(V, h, generator=g)
    outs = {}
    for mode in ("always", "never"):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        with _mode(mode, device_path):
            out = echo_loss_from_hidden(hidden, weight, x, config=cfg, chunk_size=700)
            out.loss.backward()
        outs[mode] = (out, hidden.grad, weight.grad)
    assert program_calls[0] == 1
    (f, hf, wf), (r, hr, wr) = outs["always"], outs["never"]
    logits = hidden0 @ weight0.T
    lp = torch.log_softmax(logits, -1).gather(1, x.labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    p = torch.softmax(logits, -1)
    ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    case = _case(torch.where(x.rl | x.echo, lp, NAN), ent, x, cfg, None)
    assert_same_loss(f, r, case, "hidden")
    assert torch.equal(hf, hr) and torch.equal(wf, wr)  # the same coefficients, the same GEMMs


def test_compiled_algebra_leaves_the_program_out():
    """``compile_loss_algebra`` runs its compiled region instead of the program."""
    cfg = LossConfig()
    x = _record(cfg, n=20)
    lp = torch.where(x.rl | x.echo, -0.5, NAN)
    fuse_loss_algebra("always")
    assert fused_algebra_applies(lp, None, x, cfg, None, None)
    compiled.compile_loss_algebra(True)
    try:
        assert not fused_algebra_applies(lp, None, x, cfg, None, None)
    finally:
        compiled.compile_loss_algebra(False)


def test_empty_call_in_both_modes(program_calls):
    """No rows at all: loss 0 with an empty gradient and the same metrics in both modes."""
    x = LossInputs(
        rl_mask=torch.zeros(0, dtype=torch.bool),
        advantages=torch.zeros(0),
        echo_weights=torch.zeros(0),
    )
    cfg = LossConfig(policy="ppo_clip")
    outs = {}
    for device_path in (True, False):
        for mode in ("always", "never"):
            lp = torch.zeros(0, requires_grad=True)
            with _mode(mode, device_path):
                out = echo_loss_from_logprobs(lp, x, config=cfg)
                out.loss.backward()
            outs[mode, device_path] = (float(out.loss.detach()), lp.grad.shape, out.metrics)
    assert program_calls[0] == 2
    for device_path in (True, False):
        (lf, gf, mf), (lr, gr, mr) = outs["always", device_path], outs["never", device_path]
        assert lf == lr == 0.0 and gf == gr == (0,)
        assert list(mf) == list(mr)
        assert all(float(mf[k]) == float(mr[k]) == 0.0 for k in mr)


def test_a_registered_policy_is_told_once_that_it_runs_unfused(caplog, program_calls):
    """A policy registered by a user runs the PyTorch algebra where the built-in ones run the
    row program: its author is told once, by the policy's name, with the cost and the way to
    make it fast; a built-in policy's call runs the program and says nothing."""
    name = "signed_nll_unfused"
    x = _record(LossConfig(policy="reinforce"), n=300).replace(labels=None)
    lp = -torch.rand(300) - 0.01
    reset_warnings()
    with policy_module._REGISTRY.isolated(), caplog.at_level(logging.WARNING, logger="echoloss"):
        register_policy(
            name,
            lambda x, c: PolicyOutput(-x.advantages.sign() * x.logprobs, {}),
            uses_ratio=False,
            all_rows=True,
        )
        fuse_loss_algebra("always")
        for _ in range(2):
            echo_loss_from_logprobs(lp, x, config=LossConfig(policy=name))
        assert program_calls[0] == 0
        echo_loss_from_logprobs(lp, x, config=LossConfig(policy="reinforce"))
        assert program_calls[0] == 1
    said = [r.getMessage() for r in caplog.records if "unfused" in r.getMessage()]
    assert len(said) == 1, said
    assert f"policy {name!r} runs the unfused PyTorch loss algebra" in said[0]
    assert "150-185 kernel launches" in said[0] and "takes 8" in said[0]
    assert "'Make a policy fast'" in said[0]


def test_a_mismatch_kl_that_overflows_without_a_clamp_is_an_error_on_the_fused_path():
    """The program's mismatch-KL mean is inf when an RL row's k3 overflows without a clamp:
    read where the program wrote it, raised as the PyTorch algebra's error is (its mean, not a
    row); deferred on the device path."""
    lp = torch.tensor([-0.5, -1.0], requires_grad=True)
    kw = dict(
        rl_mask=torch.ones(2, dtype=torch.bool),
        advantages=torch.tensor([1.0, -1.0]),
        inference_logprobs=torch.tensor([-0.5 - 1e4, -1.1]),
    )
    unclamped = LossConfig(policy="cispo", log_ratio_clamp=None)
    fuse_loss_algebra("always")
    try:
        match = r"mismatch_kl \(k3 of logprobs - inference_logprobs, mean over the RL rows\)"
        with pytest.raises(ValueError, match=match):
            echo_loss_from_logprobs(lp, config=unclamped, **kw)
        with device_code_path():
            echo_loss_from_logprobs(lp, config=unclamped, **kw)
        with pytest.raises(ValueError, match=match):
            raise_deferred_errors()
        out = echo_loss_from_logprobs(lp, config=LossConfig(policy="cispo"), **kw)
        assert torch.isfinite(out.metrics["mismatch_kl/all"])
    finally:
        fuse_loss_algebra("auto")
