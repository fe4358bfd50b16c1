"""Kernel launches of one ``echo_loss`` forward+backward besides the two vocabulary phases.

Counted on CPU on the CUDA code path (``device_code_path()``), the phases run by the PyTorch
reference and not counted (on CUDA they are two Triton launches):

- **eager**: every aten op that runs a kernel (``benchmarks/counting.py``), forward and backward;
- **compiled** (``compile_loss_algebra()``): the aten ops that run *outside* the compiled
  regions, counted with the profiler (a dispatch mode makes dynamo fall back to eager, so it
  cannot count this path), and the number of compiled regions run (forward and backward of the
  ``[N]`` algebra). The compiler here passes the traced graphs through unchanged (no inductor:
  about a minute of compile per configuration on 2 CPU cores); on CUDA inductor turns each
  region into a few fused kernels, a number only a GPU run measures
  (``python -m benchmarks.launch_count``).

The numbers are ceilings: a change that adds launches fails here. On this record (N = 48,
V = 37, per-row temperatures, sequence ids, env names) eager issues 87-232 launches depending on
the configuration (226 for the default ``dppo`` before the local sequences were skipped where
nothing reads them, the checks took two-launch finiteness tests, one submission per call, and
the ops' checks were computed lazily); the compiled algebra runs 2 regions and leaves 5
launches outside them: the row mask, the echo rows' temperature of 1 (a copy and a fill) and
the reciprocal of the temperatures before phase 1, and autograd's seed gradient (sft: one more,
its check that no row is echoed). On CUDA the copy of the check numbers to the host adds one, and
each region is as many kernels as inductor makes of it there: the target of at most 10
launches besides the two phases holds on a GPU only if the two regions take at most 4 kernels
together, which only a GPU run can say (``python -m benchmarks.launch_count``).
"""

from __future__ import annotations

import collections
import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.counting import NO_LAUNCH_OPS, count_ops, paused, record_launch  # noqa: E402
from echoloss._deferred import device_code_path, raise_deferred_errors  # noqa: E402
from echoloss.loss import LossConfig, echo_loss  # noqa: E402
from echoloss.loss.compiled import compile_loss_algebra  # noqa: E402
from echoloss.ops.selective_logprobs import reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_host_syncs import CONFIGS, N, V, _record  # noqa: E402

PHASE = "vocabulary-phase"
REGION = "compiled-region"

#: Ops that launch nothing (views, metadata, allocations) as the profiler names them.
_NO_KERNEL = NO_LAUNCH_OPS | {
    "aten::view", "aten::as_strided", "aten::reshape", "aten::select", "aten::slice",
    "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::t", "aten::transpose",
    "aten::permute", "aten::alias", "aten::_reshape_alias", "aten::unbind", "aten::split",
    "aten::narrow", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
    "aten::promote_types", "aten::_unsafe_view", "aten::expand_as", "aten::view_as",
    "aten::flatten", "aten::contiguous", "aten::to",
}  # fmt: skip


@pytest.fixture
def phases_uncounted(monkeypatch):
    """The phases run the reference, paused for the counter and marked for the profiler."""

    def fwd(*a, **k):
        with paused(), torch.profiler.record_function(PHASE):
            return reference.forward(*a, **k)

    def bwd(*a, **k):
        with paused(), torch.profiler.record_function(PHASE):
            return reference.backward(*a, **k)

    fake = types.SimpleNamespace(forward=fwd, backward=bwd)
    op = importlib.import_module("echoloss.ops.selective_logprobs.op")
    monkeypatch.setattr(op, "resolve_backend", lambda b, d: fake)


def _inputs(name):
    cfg = CONFIGS[name]
    x = _record(cfg)
    logits = torch.randn(N, V, dtype=torch.bfloat16, requires_grad=True)
    return cfg, x, logits


def _step(cfg, x, logits):
    logits.grad = None  # the first gradient of a step is assigned, not accumulated
    echo_loss(logits, x, config=cfg).loss.backward()


def eager_launches(name: str) -> int:
    cfg, x, logits = _inputs(name)
    with device_code_path():
        with count_ops() as c:
            _step(cfg, x, logits)
        raise_deferred_errors()
    assert c.num_syncs == 0
    return c.num_launches


def _kernels(event) -> int:
    """Launches of one profiled aten op: its aten children's, else 1 unless it launches none."""
    kids = sum(_kernels(c) for c in event.cpu_children if c.name.startswith("aten::"))
    if kids:
        return kids
    return 0 if event.name in _NO_KERNEL else 1


def compiled_launches(name: str) -> tuple[int, collections.Counter[str], dict[str, int]]:
    """``(launches outside the compiled regions, by op, regions run by kind)``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    regions: collections.Counter[str] = collections.Counter()

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            run_graph = make_boxed_func(gm)

            def run(args):
                regions[kind] += 1
                with torch.profiler.record_function(REGION):
                    return run_graph(args)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_graph

    cfg, x, logits = _inputs(name)
    torch._dynamo.reset()
    compile_loss_algebra(backend=aot_autograd(fw_compiler=compiler("forward"),
                                              bw_compiler=compiler("backward")))  # fmt: skip
    try:
        with device_code_path():
            _step(cfg, x, logits)  # compiles
            raise_deferred_errors()
            regions.clear()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                _step(cfg, x, logits)
            raise_deferred_errors()
    finally:
        compile_loss_algebra(False)
        torch._dynamo.reset()
    outside: collections.Counter[str] = collections.Counter()

    def walk(event):
        if event.name in (PHASE, REGION):
            return
        if event.name.startswith("aten::"):
            k = _kernels(event)
            if k:
                outside[event.name] += k
            return
        for child in event.cpu_children:
            walk(child)

    for event in p.profiler.function_events:
        if event.cpu_parent is None:
            walk(event)
    return sum(outside.values()), outside, dict(regions)


#: Eager launches per forward+backward (phases excluded), measured on this record (one more
#: each while the checks' numbers of several dtypes were joined by a ``cat``; 4-6 more each
#: while `first_true` cast its bool mask before the argmax).
EAGER_CEILING = {
    "cispo-batch-mean": 124,
    "dppo": 157,
    "gspo-sequence-means": 232,
    "ppo-kl-entropy": 182,
    "reinforce-token-mismatch": 118,
    "sft": 87,
}
#: Launches outside the compiled regions per forward+backward (phases excluded).
COMPILED_OUTSIDE_CEILING = dict.fromkeys(EAGER_CEILING, 5) | {"sft": 6}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_eager_launches_do_not_grow(name, phases_uncounted):
    n = eager_launches(name)
    assert n <= EAGER_CEILING[name], n


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_algebra_leaves_few_launches_outside(name, phases_uncounted):
    n, by_op, regions = compiled_launches(name)
    assert regions == {"forward": 1, "backward": 1}, regions
    assert n <= COMPILED_OUTSIDE_CEILING[name], (n, dict(by_op))


# ---------------------------------------------------------------- the fused row algebra

#: Configurations the fused row algebra covers once the per-env metrics are off
#: (``env_names=None``), three of `CONFIGS` and the per-sequence normalisers of
#: ``echoloss-train`` (the record is otherwise the same).
FUSED_CONFIGS = {
    name: CONFIGS[name]
    for name in (
        "cispo-batch-mean",
        "dppo",
        "gspo-sequence-means",
        "ppo-kl-entropy",
        "reinforce-token-mismatch",
        "sft",
    )
} | {
    "dppo-sequence-means": LossConfig(
        rl_normalization="sequence_mean_token_mean", echo_normalization="sequence_mean"
    ),
}
FUSED = tuple(FUSED_CONFIGS)
#: Launches per forward+backward besides the two phases and the row-algebra launch, on the
#: record with a scalar sampling temperature of 0.8 (the echo rows are scored at 1, so a
#: per-row temperature is built): that temperature (a fill, a masked fill, a cast and the
#: reciprocal), the row mask, autograd's seed gradient and the backward's ``a · g``. The check
#: numbers are written by the kernel: nothing is packed. sft adds its check that no row is
#: echoed (the flag, its cast into the check block and the concatenation with the kernel's
#: block; 11 while a single number was stacked before its cast).
#: (Before the labels' range and the temperatures' values were left to the kernel and to the
#: record: 25-26; with a per-row temperature given in the record, the same.)
#: The per-sequence normalisers add the sort of the sequence ids (one aten op here; on a GPU
#: torch's radix sort is a few kernels of its own above 4,096 rows) and the program that
#: counts each sequence's rows (`echoloss.ops.row_algebra.fused._sequence_groups_kernel`,
#: paused like the row program); the PyTorch algebra spends about 60 launches on the same
#: counts and sums.
FUSED_CEILING = {
    "cispo-batch-mean": 7,
    "dppo": 7,
    "gspo-sequence-means": 8,
    "ppo-kl-entropy": 8,  # the entropy is trained: backward's b · g too
    "reinforce-token-mismatch": 7,
    "sft": 10,
    "dppo-sequence-means": 8,
}


@pytest.fixture
def row_kernel_uncounted(monkeypatch):
    """The fused row algebra's Triton programs run (in the Triton interpreter), paused for the
    counter: on CUDA each is one launch; every launch counted here is one the GPU runs besides
    the kernels."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("counted on CPU (on CUDA the kernel is compiled for the GPU)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused = importlib.import_module("echoloss.ops.row_algebra.fused")
    if not fused.interpreter_active():  # imported before without the interpreter: define again
        fused = importlib.reload(fused)
    from echoloss.loss.fused import fuse_loss_algebra

    class PausedKernel:
        """``kernel[grid](...)`` with the counter paused: the Triton launch itself (one on
        CUDA); the ops around it (the sort of the sequence ids, any fill) are counted."""

        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*a, **k):
                with paused():
                    return launch(*a, **k)

            return run

    class CountedKernel(PausedKernel):
        """A Triton launch the counter cannot see, paused and counted as one launch: the
        value checks' (one per check, a launch the GPU runs besides the kernels)."""

        def __getitem__(self, grid):
            run = super().__getitem__(grid)

            def counted(*a, **k):
                record_launch("triton::value_check")
                return run(*a, **k)

            return counted

    assert fused.interpreter_active()
    monkeypatch.setattr(fused, "interpreter_active", lambda: True)  # it reads the kernel's type
    for name in ("_row_algebra_kernel", "_sequence_groups_kernel"):
        monkeypatch.setattr(fused, name, PausedKernel(getattr(fused, name)))
    checks = importlib.import_module("echoloss.ops.value_checks.fused")
    if not checks.interpreter_active():
        checks = importlib.reload(checks)
    monkeypatch.setattr(checks, "interpreter_active", lambda: True)
    monkeypatch.setattr(checks, "_value_checks_kernel", CountedKernel(checks._value_checks_kernel))
    fuse_loss_algebra("always")
    try:
        yield
    finally:
        fuse_loss_algebra("auto")


@pytest.mark.parametrize("envs", [False, True], ids=["no-envs", "per-env-metrics"])
@pytest.mark.parametrize("name", FUSED)
def test_fused_algebra_launches_at_most_ten(name, envs, phases_uncounted, row_kernel_uncounted):
    """Per-env metrics add the env of each row (a clamp and an index into the name table;
    the table's copy to the device is not a kernel)."""
    from echoloss.loss.fused import fused_algebra_applies

    cfg = FUSED_CONFIGS[name]
    x = _record(cfg, temperature=0.8, **({} if envs else {"env_names": None}))
    logits = torch.randn(N, V, dtype=torch.bfloat16, requires_grad=True)
    lp = torch.zeros(N)
    assert fused_algebra_applies(lp, None if cfg.mode == "sft" else lp, x, cfg, None, None)
    with device_code_path():
        _step(cfg, x, logits)  # warm-up
        raise_deferred_errors()
        with count_ops() as c:
            _step(cfg, x, logits)
        raise_deferred_errors()
    assert c.num_syncs == 0
    assert c.num_launches <= FUSED_CEILING[name] + 2 * envs, dict(c.launches)
    if cfg.mode == "rl":
        assert c.num_launches <= 10


def test_fused_linear_one_chunk_launches_are_logits_then_losss(
    phases_uncounted, row_kernel_uncounted, monkeypatch
):
    """``echo_loss_from_hidden`` on the device path with every row in one chunk launches what
    logits-then-loss launches (``hidden @ weight.T``, ``echo_loss`` on those logits, autograd's
    ``d hidden`` and ``d weight`` GEMMs), op for op: the three GEMMs, the phases and the row
    program, and the same few others (the row mask, the echo rows' temperature, autograd's
    seed gradient, the backward's ``a · g``). History: 49 launches besides the GEMMs when the
    one chunk's ``[N]`` outputs were zero-filled and copied into and its inputs gathered with
    an index of every row; 35 when the op still queued its own check of the labels' range and
    of the temperatures' values (about twenty launches the loss's fused launch makes
    redundant) and formed the live rows of phase 2 in PyTorch; 5 now, as logits-then-loss."""
    from echoloss import echo_loss, echo_loss_from_hidden

    fake = importlib.import_module("echoloss.ops.selective_logprobs.op").resolve_backend
    monkeypatch.setattr(
        importlib.import_module("echoloss.ops.fused_linear.op"), "resolve_backend", fake
    )
    cfg = FUSED_CONFIGS["dppo"]
    x = _record(cfg, env_names=None)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, 16, generator=g, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(V, 16, generator=g, dtype=torch.bfloat16, requires_grad=True)

    def fused_linear():
        hidden.grad = weight.grad = None
        echo_loss_from_hidden(hidden, weight, x, config=cfg).loss.backward()

    def logits_then_loss():
        hidden.grad = weight.grad = None
        echo_loss(hidden @ weight.T, x, config=cfg).loss.backward()

    counts = {}
    for name, step in (("fused", fused_linear), ("logits", logits_then_loss)):
        with device_code_path():
            step()  # warm-up
            raise_deferred_errors()
            with count_ops() as c:
                step()
            raise_deferred_errors()
        assert c.num_syncs == 0, name
        counts[name] = c
    fused, logits = counts["fused"], counts["logits"]
    assert fused.launches["aten::mm"] == 3  # logits, d hidden, d weight: nothing recomputed
    assert dict(fused.launches) == dict(logits.launches), (
        sorted(fused.launches.items()),
        sorted(logits.launches.items()),
    )
    assert fused.num_launches - 3 <= FUSED_LINEAR_CEILING, sorted(fused.launches.items())


FUSED_LINEAR_CEILING = 5


#: Launches per forward+backward of the ``echoloss.nn`` modules on the device path, besides the
#: phases, the row program and (hidden states) the three GEMMs, on `test_host_syncs`'s batch
#: (float attention mask, echo weights, observation mask, reference logprobs with ``beta``,
#: temperature 1). One is the checks of the caller's arguments, all five in one Triton launch
#: (``triton::value_check``: the attention mask's 0/1, the echo weights, the advantages, the
#: reference logprobs' finiteness and their bound; a program each), written into the call's
#: check block; the rest is the rows' setup (the mask as bool, the weights zeroed outside it,
#: the echo rows, the RL rows), the check block's join, and the backward's seed and ``a · g``.
#: The advantages (``[B]`` expanded over ``T``) and the sequence ids (``arange(B)`` expanded
#: over ``T``, kept from the last call with that ``B``; built in order: their program runs
#: without a sort) are read in place by the row program. A temperature other than 1 adds two (the per-row temperatures and their
#: reciprocal); ``dapo``'s divisor is the loss's own count of RL rows on one process without a
#: given count (none here; three more, the count, at least 1, its cast, otherwise). The
#: ``sapo`` and sequence-level ``cispo`` are the row program's built-in policies like the others
#: (as custom policies they ran the PyTorch algebra: 149-184 launches, 168-188 and 221-237 at the
#: steps below). The module from hidden states launches the same. History: 22-29
#: while each argument check was a launch of its own, the temperature of 1 a per-row tensor
#: and its reciprocal, the scored rows ``rl | echo`` formed again, the echo scaling formed
#: the echo rows and the observation rows again and counted in int64 then float64, and the
#: given normalisers' checks stacked the row program's counts; 24-30 while the sequence ids
#: were built for every loss type and sorted; 73-83
#: while each argument check was about seven PyTorch launches and their packing (about 45 in
#: all), the module's own all-reduced echo-token count was checked like a caller's, the record
#: split the rows the module had split already and the temperature was a fill and a masked
#: fill (and the counter took the view after a reshape's copy, ``_unsafe_view``, for a
#: launch); 135-145 (141-151 from hidden states; 275-297 for sapo/cispo at the sequence level) when the
#: op queued its own label and temperature checks and the call's record validated every field
#: a second time under its own names (the on-policy logprobs twice, the op's own entropy
#: once), and each deferred check cast its bool mask before the argmax.
MODULE_CEILING = {
    # 9 while the advantages were made flat (a copy of the [B] expanded over T); 12-15 while
    # the modules pre-divided the echo weights by the echo normaliser (3-5
    # launches) and built the sequence ids on every call (2)
    "grpo-token-mean": 8,
    "bnpo-batch-token-mean": 8,
    "dr_grpo-sequence-mean": 8,
    "dapo-token-mean": 8,
    # 149 and 184 while sapo and sequence-level cispo were custom policies (the PyTorch
    # algebra): now built-in policies of the row program
    "cispo-sequence-level": 8,
    "sapo-sequence-level": 8,
    "sapo": 8,
    "gspo": 8,
    "luspo": 8,
}
#: The modules whose loss reads no sequence ids (no per-sequence ratio, RL or echo mean).
MODULE_WITHOUT_SEQUENCES = ("bnpo-batch-token-mean", "dapo-token-mean", "luspo")
#: The Triton launches of the value checks among them: one for the five argument checks and,
#: for the PyTorch algebra, its check that each RL row's policy loss is finite.
MODULE_VALUE_CHECKS = {name: 1 for name in MODULE_CEILING}


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "hidden"])
@pytest.mark.parametrize("name", sorted(MODULE_CEILING))
def test_module_launches_do_not_grow(
    name, fused, phases_uncounted, row_kernel_uncounted, monkeypatch
):
    """The module's call and its backward, the inputs built before the count."""
    from test_host_syncs import B, T, _module_batch, _options

    from echoloss.nn import EchoFusedLinearGRPOLoss, EchoGRPOLoss

    fake = importlib.import_module("echoloss.ops.selective_logprobs.op").resolve_backend
    monkeypatch.setattr(
        importlib.import_module("echoloss.ops.fused_linear.op"), "resolve_backend", fake
    )
    batch = _module_batch()
    loss_fn = (EchoFusedLinearGRPOLoss if fused else EchoGRPOLoss)(**_options(name))
    g = torch.Generator().manual_seed(4)
    if fused:
        inputs = (torch.randn(B, T, 16, generator=g), torch.randn(V, 16, generator=g))
    else:
        inputs = (torch.randn(B, T, V, generator=g),)
    args = (batch["ids"], batch["attention_mask"], batch["advantages"])
    kw = {k: batch[k] for k in ("ref_per_token_logps", "echo_weights", "observation_mask")}

    def step():
        leaves = [t.detach().requires_grad_() for t in inputs]  # views: no launch
        return loss_fn(*leaves, *args, **kw)

    with device_code_path():
        for _ in range(2):  # warm-up
            step().loss.backward()
            raise_deferred_errors()
        with count_ops() as c:
            step().loss.backward()
        raise_deferred_errors()
        # A batch size new to the module: where the loss reads sequence ids, their arange is
        # built (expanded over T: a view, no copy), then kept for the next call with that B
        # whatever its T.
        loss_fn._last_sequence_ids = None
        with count_ops() as new_shape:
            step().loss.backward()
        raise_deferred_errors()
    assert c.num_syncs == 0, dict(c.syncs)
    gemms = c.launches.get("aten::mm", 0)
    assert gemms == (3 if fused else 0)
    assert c.num_launches - gemms <= MODULE_CEILING[name], sorted(c.launches.items())
    assert c.launches["triton::value_check"] == MODULE_VALUE_CHECKS[name], dict(c.launches)
    assert "aten::argmax" not in c.launches  # no PyTorch check
    built = 0 if name in MODULE_WITHOUT_SEQUENCES else 1
    assert new_shape.num_launches - c.num_launches == built, sorted(new_shape.launches.items())


# ---------------------------------------------------------------- a record's value checks

#: Launches of building a `LossInputs` on the device path, its tensors built before the count
#: (the `CONFIGS` record: labels, RL mask, echo weights, advantages, inference and reference
#: logprobs, sequence ids, observation mask, per-row temperatures, env names): nine value
#: checks (each field on the rows where it is read), the RL/echo split, the largest sequence
#: id for the env names, and the join of the numbers, sent to the host in one copy. With the
#: PyTorch checks each is about six launches; with the fused ones (``triton::value_check``)
#: the nine are two launches (eight checks per launch). History: 16 with the fused checks
#: while each was a launch of its own; 121 launches and ten copies to the host while each
#: field's check was submitted (packed and copied) on its own and computed in PyTorch.
RECORD_CEILING = {"pytorch-checks": 61, "fused-checks": 8}
RECORD_VALUE_CHECKS = 9
#: Their launches: eight checks per launch (`fused.SLOTS`).
RECORD_VALUE_CHECK_LAUNCHES = 2


@pytest.mark.parametrize("checks", sorted(RECORD_CEILING))
def test_a_record_checks_its_fields_in_few_launches(checks, row_kernel_uncounted):
    import dataclasses

    from benchmarks.counting import SYNC_OPS
    from echoloss.loss import LossInputs
    from echoloss.ops.value_checks import fuse_value_checks

    if checks == "pytorch-checks":
        fuse_value_checks("never")  # the fixture sets the fused mode back afterwards
    x = _record(CONFIGS["dppo"])
    fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(LossInputs) if f.init}
    copies = []
    with device_code_path():
        LossInputs(**fields)  # warm-up
        raise_deferred_errors()
        from echoloss import _deferred

        before = _deferred.pending_count()
        with count_ops() as c:
            LossInputs(**fields)
        copies.append(_deferred.pending_count() - before)
        raise_deferred_errors()
    assert c.num_syncs == 0 and not set(c.syncs) & SYNC_OPS
    assert copies == [1]  # every check of the record in one block, one copy
    assert c.num_launches <= RECORD_CEILING[checks], sorted(c.launches.items())
    fused = c.launches.get("triton::value_check", 0)
    assert fused == (RECORD_VALUE_CHECK_LAUNCHES if checks == "fused-checks" else 0)


def test_the_benchmarks_page_states_these_ceilings():
    """``docs/benchmarks.md`` prints the CPU launch counts of this file: its table's "now"
    column is these ceilings."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    block = page.split("<!-- launch-counts-cpu:begin -->")[1].split("<!-- launch-counts-cpu:end")[0]
    rows = [r.split("|")[1:-1] for r in block.strip().splitlines()[2:]]
    now = [r[-1].strip() for r in rows]
    assert now[0] == f"{FUSED_LINEAR_CEILING}"
    sapo_cispo = ("sapo", "sapo-sequence-level", "cispo-sequence-level")
    builtin = [v for k, v in MODULE_CEILING.items() if k not in sapo_cispo]
    formerly_custom = [MODULE_CEILING[k] for k in sapo_cispo]
    assert min(builtin) == max(builtin)  # else the cell would give the range
    first = max(builtin) + 1  # the sequence ids' arange at a new batch size
    assert now[1] == (
        f"{max(builtin)} ({first} at a batch size new to the module where the loss reads "
        "sequence ids)"
    )
    assert min(formerly_custom) == max(formerly_custom)
    assert now[2] == f"{max(formerly_custom)}"
    record = RECORD_CEILING["pytorch-checks"], RECORD_CEILING["fused-checks"]
    assert now[3] == "at most {} / {}".format(*record)
