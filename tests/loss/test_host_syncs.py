"""The CUDA code path of every loss entry point reads nothing back to the host.

``device_code_path()`` runs the CUDA code path on CPU (the branch the loss takes for CUDA tensors),
and ``benchmarks/counting.py`` counts, through a dispatch mode, every aten op that would make the
host wait for a GPU (``_local_scalar_dense`` behind ``.item()``/``int()``/``bool()``,
``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing, ``bincount``, tensors built
from host data, ...), forward and backward. The vocabulary-sized phases run the PyTorch reference
with the counter paused (on CUDA they are two Triton launches).

History (same counter, phases paused): before the loss algebra worked on ``[N]`` masks,
``echo_loss`` forward+backward issued 16 host syncs on a plain record (15 forward, 1 backward)
and 46 on a record with sequence ids and env names (45 forward, 1 backward); the first GPU
measurements counted 23 on a default record. Now: 0 everywhere below. (Launches, for the record:
134 before and 175 after on the plain record, 193 before and 214 after on the other: mask
arithmetic over all ``N`` rows costs more small kernels than compaction did; fusing them is the
next step, not done here.)
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.counting import count_ops, uncounted_reference_phases  # noqa: E402
from echoloss._deferred import (  # noqa: E402
    device_code_path,
    pending_count,
    raise_deferred_errors,
)
from echoloss.loss import (  # noqa: E402
    LossConfig,
    LossInputs,
    Normalizers,
    echo_loss,
    echo_loss_from_hidden,
    echo_loss_from_logprobs,
)
from echoloss.loss.compiled import compile_loss_algebra  # noqa: E402

N, V, H = 48, 37, 8

CONFIGS = {
    "dppo": LossConfig(),
    "gspo-sequence-means": LossConfig(
        policy="gspo",
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
        mismatch="sequence_truncate",
    ),
    "ppo-kl-entropy": LossConfig(
        policy="ppo_clip", kl_coef=0.1, entropy_coef=0.01, echo_temperature="one"
    ),
    "cispo-batch-mean": LossConfig(policy="cispo", echo_normalization="batch_token_mean"),
    "reinforce-token-mismatch": LossConfig(policy="reinforce", mismatch="token_mask"),
    "sft": LossConfig(mode="sft"),
}


@pytest.fixture(autouse=True)
def _nothing_pending():
    """Every test starts and ends without deferred errors of another test."""
    assert pending_count() == 0
    yield
    try:
        raise_deferred_errors()
    finally:
        assert pending_count() == 0


@pytest.fixture
def phases_uncounted(monkeypatch):
    """The two vocabulary-sized phases run the reference with the counter paused."""

    fake = uncounted_reference_phases()
    for name in ("echoloss.ops.selective_logprobs.op", "echoloss.ops.fused_linear.op"):
        monkeypatch.setattr(importlib.import_module(name), "resolve_backend", lambda b, d: fake)


def _record(cfg: LossConfig, *, seed: int = 0, **changes) -> LossInputs:
    g = torch.Generator().manual_seed(seed)
    rl = torch.rand(N, generator=g) < 0.5
    rl[-4:] = False  # padding rows
    echo = ~rl & (torch.rand(N, generator=g) < 0.6)
    echo[-4:] = False
    if cfg.mode == "sft":
        echo[:] = False
    sid = torch.arange(N) // 8
    sid[-4:] = -1
    labels = torch.randint(0, V, (N,), generator=g)
    labels[-4:] = -100  # never read: not participating
    values = dict(
        labels=labels,
        rl_mask=rl,
        echo_weights=torch.where(echo, 0.5, 0.0),
        advantages=torch.randn(N, generator=g) * rl,
        inference_logprobs=torch.where(rl, -torch.rand(N, generator=g), float("nan")),
        ref_logprobs=torch.where(rl, -torch.rand(N, generator=g), 0.0),
        sequence_ids=sid,
        observation_mask=echo | (torch.rand(N, generator=g) < 0.2),
        temperature=torch.full((N,), 0.8),
        env_names=["a", "b", "", "a", "b", "c"],
    )
    values.update(changes)
    return LossInputs(**values)


def _run(entry: str, cfg: LossConfig, x: LossInputs, normalizers=None):
    torch.manual_seed(1)
    if entry == "logprobs":
        leaf = (-torch.rand(N) - 0.01).requires_grad_()
        ent = torch.rand(N).requires_grad_()
        out = echo_loss_from_logprobs(
            leaf, x.replace(labels=None), entropy=ent, config=cfg, normalizers=normalizers
        )
        leaves = [leaf, ent]
    elif entry == "logits":
        leaf = torch.randn(N, V).requires_grad_()
        out = echo_loss(leaf, x, config=cfg, normalizers=normalizers)
        leaves = [leaf]
    else:
        hidden = torch.randn(N, H).requires_grad_()
        weight = torch.randn(V, H).requires_grad_()
        out = echo_loss_from_hidden(
            hidden, weight, x, config=cfg, normalizers=normalizers, chunk_size=5
        )
        leaves = [hidden, weight]
    return out, leaves


def _counted(entry, cfg, x, normalizers=None):
    with device_code_path():
        with count_ops() as fwd:
            out, leaves = _run(entry, cfg, x, normalizers)
        with count_ops() as bwd:
            out.loss.backward()
        raise_deferred_errors()
    return out, leaves, fwd, bwd


ENTRIES = ["logits", "logprobs", "hidden"]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_host_sync_forward_or_backward(entry, name, phases_uncounted):
    cfg = CONFIGS[name]
    x = _record(cfg)
    if entry == "logprobs" and cfg.echo_temperature == "one":
        x = x.replace(temperature=1.0)
    out, _, fwd, bwd = _counted(entry, cfg, x)
    assert fwd.num_syncs == 0, dict(fwd.syncs)
    assert bwd.num_syncs == 0, dict(bwd.syncs)
    assert fwd.num_launches > 0 and torch.isfinite(out.loss)


@pytest.mark.parametrize("entry", ENTRIES)
def test_no_host_sync_with_given_normalizers(entry, phases_uncounted):
    x = _record(LossConfig())
    norms = Normalizers(rl_tokens=100, echo_tokens=100, sequences=10)
    _, _, fwd, bwd = _counted(entry, LossConfig(), x, norms)
    assert fwd.num_syncs == 0 and bwd.num_syncs == 0, (dict(fwd.syncs), dict(bwd.syncs))


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_device_path_equals_host_path(entry, name):
    """Same loss, metrics and gradients on both paths (the algebra is one implementation; only
    the checks and the phases' row selection differ): fp32 summation order only, 1e-6."""
    cfg = CONFIGS[name]
    x = _record(cfg)
    if entry == "logprobs" and cfg.echo_temperature == "one":
        x = x.replace(temperature=1.0)
    host, host_leaves = _run(entry, cfg, x)
    host.loss.backward()
    with device_code_path():
        dev, dev_leaves = _run(entry, cfg, x)
        dev.loss.backward()
        raise_deferred_errors()
    torch.testing.assert_close(dev.loss, host.loss, rtol=1e-6, atol=1e-6)
    assert dev.metrics.keys() == host.metrics.keys()
    for k in host.metrics:
        torch.testing.assert_close(dev.metrics[k], host.metrics[k], rtol=1e-6, atol=1e-6)
    # fused-linear: the device path chunks all rows, the host path the participating ones, so
    # the fp32 weight gradient is summed in other groups of rows: relative N·2^-24 ≈ 3e-6.
    tol = 1e-5 if entry == "hidden" else 1e-6
    for a, b in zip(dev_leaves, host_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)


def _host_error(fn) -> str:
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("entry", ["logits", "hidden"])
@pytest.mark.parametrize(
    "case",
    ["nan-logit", "label-out-of-range", "small-normalizers", "sft-with-echo", "no-advantages"],
)
def test_value_errors_are_deferred_with_the_same_message(case, entry):
    """``echo_loss`` and ``echo_loss_from_hidden`` (whose op leaves the labels to the loss on
    the device path): the host path's error, deferred, word for word."""
    cfg = LossConfig()
    x = _record(cfg)
    logits = torch.randn(N, V)
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    norms = None
    rl_row = int(x.rl.nonzero()[0, 0])
    if case == "nan-logit":
        logits[rl_row, 3] = float("nan")
        hidden[rl_row, 1] = float("nan")
    elif case == "label-out-of-range":
        labels = x.labels.clone()
        labels[rl_row] = V + 2
        x = x.replace(labels=labels)
    elif case == "small-normalizers":
        norms = Normalizers(rl_tokens=1, echo_tokens=1)
    elif case == "sft-with-echo":
        cfg = LossConfig(mode="sft")
    else:
        x = x.replace(advantages=None)
    logits.requires_grad_()
    hidden.requires_grad_()

    def call():
        if entry == "hidden":
            return echo_loss_from_hidden(hidden, weight, x, config=cfg, normalizers=norms)
        return echo_loss(logits, x, config=cfg, normalizers=norms)

    expected = _host_error(call)
    if case == "nan-logit":
        assert f"{entry} row {rl_row}" in expected, expected
    with device_code_path():
        out = call()  # no error yet: the values were checked on the device
        assert pending_count() >= 1
        out.loss.backward()
        with pytest.raises(ValueError) as e:
            raise_deferred_errors()
        assert str(e.value) == expected
        assert pending_count() == 0
        # The next loss call polls and raises the error of an earlier call whose work is done.
        call()
        with pytest.raises(ValueError) as e:
            echo_loss(torch.randn(N, V), _record(LossConfig()))
        assert pending_count() == 0
        assert str(e.value) == expected
        raise_deferred_errors()


def test_shape_errors_stay_immediate_on_the_device_path():
    x = _record(LossConfig())
    with device_code_path(), pytest.raises(ValueError, match="per-token shape"):
        echo_loss(torch.randn(N + 1, V), x)
    assert pending_count() == 0


@pytest.mark.parametrize("name", ["dppo", "gspo-sequence-means", "ppo-kl-entropy"])
def test_loss_algebra_compiles_without_graph_breaks(name):
    """``compile_loss_algebra()``: the ``[N]`` algebra between the phases is one region that
    dynamo traces without a graph break (backend "eager" here: no inductor compile in the test,
    which takes about a minute on 2 CPU cores), with the loss, metrics, gradients and deferred
    checks of the eager algebra."""
    torch._dynamo.reset()
    cfg = CONFIGS[name]
    x = _record(cfg)
    host, host_leaves = _run("logits", cfg, x)
    host.loss.backward()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compile_loss_algebra(backend="eager")
    try:
        with device_code_path():
            _run("logits", cfg, x)[0].loss.backward()  # a second call reuses the graph
            raise_deferred_errors()
            dev, dev_leaves = _run("logits", cfg, x)
            dev.loss.backward()
            # the op's label and temperature checks join the call's, packed inside the region:
            # one submission per call
            assert pending_count() == 1
            raise_deferred_errors()
    finally:
        compile_loss_algebra(False)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(dev.loss, host.loss, rtol=1e-6, atol=1e-6)
    for k in host.metrics:
        torch.testing.assert_close(dev.metrics[k], host.metrics[k], rtol=1e-6, atol=1e-6)
    for a, b in zip(dev_leaves, host_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_an_unread_deferred_error_is_reported_at_exit():
    from echoloss._deferred import _report_at_exit

    x = _record(LossConfig())
    row = int(x.rl.nonzero()[0, 0])
    logits = torch.randn(N, V)
    logits[row] = float("nan")
    with device_code_path():
        echo_loss(logits, x)
    assert pending_count() >= 1
    with pytest.warns(RuntimeWarning, match=f"never raised.*logits row {row} "):
        _report_at_exit()
    assert pending_count() == 0


# ---------------------------------------------------------------- the echoloss.nn modules

MODULE_CASES = {
    # loss_type, importance_sampling_level, echo_normalization
    "grpo-token-mean": ("grpo", "token", "token_mean"),
    "bnpo-batch-token-mean": ("bnpo", "token", "batch_token_mean"),
    "dr_grpo-sequence-mean": ("dr_grpo", "token", "sequence_mean"),
    "dapo-token-mean": ("dapo", "token", "token_mean"),
    "cispo-sequence-level": ("cispo", "sequence", "token_mean"),
    "sapo-sequence-level": ("sapo", "sequence", "sequence_mean"),
    "sapo": ("sapo", "token", "batch_token_mean"),
    "gspo": ("grpo", "sequence", "token_mean"),
    "luspo": ("luspo", "token", "batch_token_mean"),
}
B, T = 4, 6


def _module_batch(seed: int = 0, **changes):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)  # float, as HF builds it: checked for 0/1 on the device
    mask[0, 4:] = 0
    mask[3, 1:] = 0
    ew = torch.zeros(B, T)
    ew[1, 2] = ew[2, 0] = ew[2, 5] = 0.5
    batch = dict(
        ids=torch.randint(0, V, (B, T), generator=g),
        attention_mask=mask,
        advantages=torch.randn(B, generator=g),
        ref_per_token_logps=-torch.rand(B, T, generator=g),
        echo_weights=ew,
        observation_mask=ew > 0,
    )
    batch.update(changes)
    return batch


def _run_module(fused: bool, module, batch, **kw):
    from echoloss.nn import EchoFusedLinearGRPOLoss, EchoGRPOLoss

    torch.manual_seed(2)
    cls = EchoFusedLinearGRPOLoss if fused else EchoGRPOLoss
    loss_fn = cls(**module) if isinstance(module, dict) else module
    args = (batch["ids"], batch["attention_mask"], batch["advantages"])
    extra = {k: batch[k] for k in ("echo_weights", "observation_mask")}
    if fused:
        hidden = torch.randn(B, T, H).requires_grad_()
        weight = torch.randn(V, H).requires_grad_()
        out = loss_fn(
            hidden, weight, *args, ref_per_token_logps=batch["ref_per_token_logps"], **extra, **kw
        )
        return out, [hidden, weight]
    logits = torch.randn(B, T, V).requires_grad_()
    out = loss_fn(logits, *args, ref_per_token_logps=batch["ref_per_token_logps"], **extra, **kw)
    return out, [logits]


def _options(name: str) -> dict:
    lt, level, echo_norm = MODULE_CASES[name]
    return dict(
        loss_type=lt,
        importance_sampling_level=level,
        echo_normalization=echo_norm,
        max_completion_length=T,
        epsilon_high=5.0 if lt == "cispo" else 0.28,
    )


@pytest.mark.parametrize("chunk", [None, 5], ids=["one-chunk", "chunks-of-5"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("name", sorted(MODULE_CASES))
def test_modules_issue_no_host_sync(name, fused, chunk, phases_uncounted, monkeypatch):
    """``EchoGRPOLoss`` / ``EchoFusedLinearGRPOLoss``: 0 host syncs forward and backward (each
    issued 1 to 5 before the normalisers and counts stayed on the device: the 0/1 check of a
    float ``attention_mask``, the all-reduced RL and echo token counts read as floats, this
    call's counts checked against ``num_*items_in_batch``, and SAPO / sequence-level CISPO
    given the RL rows compacted), with the same loss and gradients as the host path. The fused
    module in one chunk keeps its logits for backward; in chunks of 5 rows its chunk-additive
    cases take the path that forms the gradients in the forward (spied), the others
    recompute."""
    from echoloss.ops.fused_linear import op

    if chunk is not None and not fused:
        pytest.skip("chunks are the fused module's")
    formed = []
    original = op._chunk_gradients

    def counted(*args):
        formed.append(1)
        return original(*args)

    monkeypatch.setattr(op, "_chunk_gradients", counted)
    lt, level, _ = MODULE_CASES[name]
    additive = lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo") and level == "token"
    additive = additive or (lt in ("cispo", "sapo") and level == "token")
    batch = _module_batch()
    options = _options(name) | ({} if chunk is None else {"row_chunk_size": chunk})
    host, host_leaves = _run_module(fused, options, batch)
    host.loss.backward()
    with device_code_path():
        with count_ops() as fwd:
            dev, dev_leaves = _run_module(fused, options, batch)
        with count_ops() as bwd:
            dev.loss.backward()
        raise_deferred_errors()
    assert fwd.num_syncs == 0, dict(fwd.syncs)
    assert bwd.num_syncs == 0, dict(bwd.syncs)
    assert len(formed) == (2 if chunk and additive else 0)  # host run and device run
    torch.testing.assert_close(dev.loss, host.loss, rtol=1e-6, atol=1e-6)
    # In chunks the host path groups only the participating rows (the device path every row),
    # so d weight sums the same fp32 products in other groups: cancellation to 1e-5 absolute.
    atol = 1e-6 if chunk is None else 1e-5
    for a, b in zip(dev_leaves, host_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("items", [lambda n: n + 3, lambda n: torch.tensor(n + 3)])
def test_module_given_counts_issue_no_host_sync(items, phases_uncounted):
    """Counts given as numbers or as tensors (TRL passes ``num_items_in_batch`` as a tensor)."""
    batch = _module_batch()
    n_rl = int((batch["attention_mask"].bool() & ~(batch["echo_weights"] > 0)).sum())
    n_echo = int((batch["echo_weights"] > 0).sum())
    kw = dict(num_items_in_batch=items(n_rl), num_echo_items_in_batch=items(n_echo))
    with device_code_path():
        with count_ops() as fwd:
            out, _ = _run_module(False, _options("dapo-token-mean"), batch, **kw)
        with count_ops() as bwd:
            out.loss.backward()
        raise_deferred_errors()
    assert fwd.num_syncs == 0 and bwd.num_syncs == 0, (dict(fwd.syncs), dict(bwd.syncs))


@contextlib.contextmanager
def value_checks(kind: str):
    """Inside the block the device path's value checks run as ``kind``: ``"pytorch"`` (the
    default off CUDA) or ``"fused"`` (the Triton program, under the interpreter on CPU: what
    CUDA runs)."""
    if kind == "pytorch":
        yield
        return
    pytest.importorskip("triton")
    from echoloss.ops.value_checks import fuse_value_checks

    if not torch.cuda.is_available():
        fused = importlib.import_module("echoloss.ops.value_checks.fused")
        if not fused.interpreter_active():  # imported without the interpreter: define again
            previous = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"
            try:
                importlib.reload(fused)
            finally:
                if previous is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = previous
    fuse_value_checks("always")
    try:
        yield
    finally:
        fuse_value_checks("auto")


#: Values of the modules' arguments checked as passed: the error names the argument (not the
#: record's field it becomes) and shows the value passed (not one scaled or cast from it).
ARGUMENT_CASES = {
    "nan-ref": ("ref_per_token_logps", (1, 1), float("nan"), "ref_per_token_logps must be finite"),
    "positive-old": ("old_per_token_logps", (1, 1), 0.5, "old_per_token_logps[7]"),
    "nan-inference": ("inference_logprobs", (2, 3), float("nan"), "inference_logprobs must be"),
    "negative-echo-weight": ("echo_weights", (1, 2), -1.0, "echo_weights[8] must be a finite"),
    "nan-advantage": ("advantages", (1,), float("inf"), "advantages must be finite"),
}


@pytest.mark.parametrize("checks", ["pytorch", "fused"])
@pytest.mark.parametrize(
    "case",
    ["attention-mask-half", "items-too-small", "echo-items-tensor-too-small", "nan-logit",
     *ARGUMENT_CASES],
)  # fmt: skip
def test_module_value_errors_are_deferred_with_the_same_message(case, checks):
    """Host and device path report the same message (on the device path, once read), with
    the device path's value checks in PyTorch or in the Triton program. History: the device
    path named ``ref_logprobs``/``old_logprobs`` (the record's fields) where the host path
    named the arguments, and both showed an echo weight after its scaling (-0.5 for a -1.0
    passed)."""
    batch, kw = _module_batch(), {}
    if case in ARGUMENT_CASES:
        name, index, value, _ = ARGUMENT_CASES[case]
        base = batch.get(name)
        base = -torch.rand(B, T) if base is None else base.clone()
        base[index] = value
        batch[name] = base
        if name in ("old_per_token_logps", "inference_logprobs"):
            kw[name] = base
    if case == "attention-mask-half":
        batch["attention_mask"] = batch["attention_mask"].clone()
        batch["attention_mask"][2, 3] = 0.5
    elif case == "items-too-small":
        kw["num_items_in_batch"] = 2
    elif case == "echo-items-tensor-too-small":
        kw["num_echo_items_in_batch"] = torch.tensor(1)
    options = _options("dapo-token-mean")
    module = __import__("echoloss.nn", fromlist=["EchoGRPOLoss"]).EchoGRPOLoss(**options)
    if case == "nan-logit":
        original = module.forward

        def forward(logits, *a, **k):
            logits = logits.detach().clone()
            logits[1, 3, 0] = float("nan")
            return original(logits.requires_grad_(), *a, **k)

        module.forward = forward  # type: ignore[method-assign]
    expected = _host_error(lambda: _run_module(False, module, batch, **kw))
    if case in ARGUMENT_CASES:
        assert ARGUMENT_CASES[case][3] in expected, expected
        if case == "negative-echo-weight":
            assert "got -1.0;" in expected, expected
    with device_code_path(), value_checks(checks):
        out, _ = _run_module(False, module, batch, **kw)  # no error yet
        assert pending_count() >= 1
        out.loss.backward()
        with pytest.raises(ValueError) as e:
            raise_deferred_errors()
    assert str(e.value) == expected


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("name", ["dapo-token-mean", "sapo-sequence-level"])
@pytest.mark.parametrize("where", ["rl", "echo"])
def test_module_label_out_of_range_is_reported_by_the_loss(fused, name, where):
    """On the device path the modules' logprob op leaves the labels' range to the loss (the
    fused launch, or the loss's own check when the PyTorch algebra runs): a participating
    label outside ``[0, V)`` is still reported, deferred, with the host path's message; one
    on a row that takes no part is never read."""
    batch = _module_batch()
    ids = batch["ids"].clone()
    row = (1, 2) if where == "echo" else (2, 3)  # echoed / RL tokens of `_module_batch`
    ids[row] = V + 5
    ids[0, 5] = V + 9  # attention mask 0: not read
    batch["ids"] = ids
    module = _options(name)
    expected = _host_error(lambda: _run_module(fused, module, batch))
    assert f"got {V + 5}" in expected or str(V + 5) in expected, expected
    with device_code_path():
        out, _ = _run_module(fused, module, batch)  # no error yet
        assert pending_count() >= 1
        out.loss.backward()
        with pytest.raises(ValueError) as e:
            raise_deferred_errors()
    assert str(e.value) == expected


#: Values a caller may pass by mistake, per argument of the modules (position, bad value).
_BAD_ARGUMENTS = {
    "attention_mask": [0.5, 2.0, -1.0],
    "echo_weights": [float("nan"), -1.0, float("inf")],
    "advantages": [float("nan"), float("-inf")],
    "ref_per_token_logps": [float("nan"), 0.5, float("inf")],
    "old_per_token_logps": [float("nan"), 3.0],
    "inference_logprobs": [float("-inf"), 0.25],
    "ids": [V, V + 7],
}


def _module_errors(checks: str, fused: bool, name: str, argument: str, b: int, t: int, value):
    """The error of the host path and the device path's deferred error (or None) for one bad
    value of ``argument`` at ``[b, t]`` (``[b]`` for advantages)."""
    batch, kw = _module_batch(), {}
    if argument in ("old_per_token_logps", "inference_logprobs"):
        kw[argument] = -torch.rand(B, T, generator=torch.Generator().manual_seed(9))
        kw[argument][b, t] = value
    elif argument == "advantages":
        batch[argument] = batch[argument].clone()
        batch[argument][b] = value
    else:
        batch[argument] = batch[argument].clone()
        batch[argument][b, t] = value
    module = _options(name)
    try:
        _run_module(fused, module, batch, **kw)
        expected = None
    except ValueError as e:
        expected = str(e)
    with device_code_path(), value_checks(checks):
        out, _ = _run_module(fused, module, batch, **kw)  # nothing raised yet
        out.loss.backward()
        try:
            raise_deferred_errors()
            got = None
        except ValueError as e:
            got = str(e)
    return expected, got


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
@given(
    data=st.data(),
    name=st.sampled_from(sorted(MODULE_CASES)),
    argument=st.sampled_from(sorted(_BAD_ARGUMENTS)),
)
@settings(max_examples=25, deadline=None)
def test_module_errors_are_the_same_on_both_paths(fused, data, name, argument):
    """Any one bad value in any argument of either module, at any position: the device path
    reports, once its numbers are read, exactly the host path's error (or neither reports
    one: a value at a position that is never read, such as a label under a zero attention
    mask, is not an error). The device path's value checks in PyTorch here; in the Triton
    program below."""
    b = data.draw(st.integers(0, B - 1), label="b")
    t = data.draw(st.integers(0, T - 1), label="t")
    value = data.draw(st.sampled_from(_BAD_ARGUMENTS[argument]), label="value")
    expected, got = _module_errors("pytorch", fused, name, argument, b, t, value)
    assert got == expected


#: One read position per argument (an RL token of row 2; an echoed token for the echo
#: weights) and one never read (a label under a zero attention mask): the Triton value-check
#: program runs under the interpreter on CPU, ~5 s a case, so it gets each argument once, the
#: modules, entry points and bad values cycled (its slots against the gold: test_value_checks).
_FUSED_CHECK_CASES = [
    (argument, (1, 2) if argument == "echo_weights" else (2, 3), i)
    for i, argument in enumerate(sorted(_BAD_ARGUMENTS))
] + [("ids", (0, 5), 0)]


@pytest.mark.parametrize(("argument", "where", "i"), _FUSED_CHECK_CASES)
def test_module_errors_are_the_same_with_the_fused_value_checks(argument, where, i):
    """As above with the device path's value checks in the Triton program (what CUDA runs)."""
    names = sorted(MODULE_CASES)
    values = _BAD_ARGUMENTS[argument]
    b, t = where
    expected, got = _module_errors(
        "fused", i % 2 == 1, names[i % len(names)], argument, b, t, values[i % len(values)]
    )
    assert got == expected
    assert (expected is None) == (where == (0, 5)), expected  # the read ones are errors


#: Values a caller may put in a record by mistake, per field (the record of `_record`).
_BAD_FIELDS = {
    "echo_weights": [float("nan"), -1.0, float("inf")],
    "advantages": [float("nan"), float("-inf")],
    "inference_logprobs": [float("nan"), 0.5],
    "ref_logprobs": [float("inf"), 2.0],
    "labels": [-3],
    "sequence_ids": [-2],
    "temperature": [0.0, float("nan"), -1.0],
}


def _record_errors(checks: str, field: str, row: int, value):
    """The host path's error and the device path's deferred one (or None) of a `LossInputs`
    with one bad value of ``field`` at ``row``."""
    import dataclasses

    x = _record(LossConfig())
    fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(LossInputs) if f.init}
    fields[field] = fields[field].clone()
    fields[field][row] = value
    try:
        LossInputs(**fields)
        expected = None
    except ValueError as e:
        expected = str(e)
    with device_code_path(), value_checks(checks):
        before = pending_count()
        LossInputs(**fields)  # nothing raised yet
        assert pending_count() == before + 1  # every check of the record in one copy
        try:
            raise_deferred_errors()
            got = None
        except ValueError as e:
            got = str(e)
    return expected, got


@given(data=st.data(), field=st.sampled_from(sorted(_BAD_FIELDS)))
@settings(max_examples=30, deadline=None)
def test_record_errors_are_the_same_on_both_paths(data, field):
    """One bad value in any checked field of a `LossInputs`, at any row: built on the device
    path, the record reports (once its numbers are read, in one copy with its other checks)
    exactly the host path's error, or neither reports one (a row where the field is not read,
    such as an advantage of an echo row, is not an error). Value checks in PyTorch here."""
    row = data.draw(st.integers(0, N - 1), label="row")
    value = data.draw(st.sampled_from(_BAD_FIELDS[field]), label="value")
    expected, got = _record_errors("pytorch", field, row, value)
    assert got == expected


@pytest.mark.parametrize(("field", "i"), [(f, i) for i, f in enumerate(sorted(_BAD_FIELDS))])
def test_record_errors_are_the_same_with_the_fused_value_checks(field, i):
    """As above with the value checks in the Triton program (under the interpreter on CPU, ~4 s
    a case: each field once, at the first or the last row, the bad values cycled)."""
    values = _BAD_FIELDS[field]
    row = 0 if i % 2 == 0 else N - 1
    expected, got = _record_errors("fused", field, row, values[i % len(values)])
    assert got == expected
