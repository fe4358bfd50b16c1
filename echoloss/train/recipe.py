"""The reference trainer as a recipe: `setup` builds a `Run`, `step` trains one optimiser step.

`step` is the numbered steps of ``docs/trainer.md``, one function each::

    1. collect_rollouts    play G episodes per prompt with the model   (or: demos / a rollout JSONL)
    2. compute_advantages  echoloss.compute_advantages over the global batch (GRPO, or RAE)
    3. build_samples       echoloss.interleave(rollout.steps, echo=...)  (one per conversation)
    4. make_micro_batches  echoloss.pack(...) and the global normalisers (all-reduced once)
    5. forward_backward    per micro-batch: the phase's losses, .backward() (none without a
                           gradient)
    6. update              undo data-parallel averaging; clip; AdamW step
    7. evaluate_if_due     held-out success and observation CEs, when due
    8. log_step            one JSON line per step, a one-line summary
    9. checkpoint_if_due   atomic checkpoint, when due (the last step always gets one)

The regimes a run goes through (copy-task pre-training, SFT warm-up with the observation CE,
RL + echo) are `echoloss.train.regimes`; the research probes (held-out success, observation and
hidden CEs) are `echoloss.train.probes`.

What was simplified, and why (this is a recipe, not a framework):

* **One policy update per batch** (fully on-policy, as the ECHO paper's released config:
  ``train_batch_size == policy_mini_batch_size``). The importance ratio is taken against the
  sampling logprobs, so it only corrects the small numerical mismatch between ``generate``'s
  padded forward and the packed training forward (``mismatch_kl`` reports it).
* **Generation is HF ``generate``**, turn by turn over all live conversations of the rank. Fine
  for a tiny model on CPU and for a small real model on one GPU; a production run would use an
  inference server and read its rollouts with ``data.source = "jsonl"``.
* **The packed forward** uses a block-diagonal 4D attention mask (or FlashAttention's varlen path
  when ``model.attn_implementation`` is a flash one), built from the batch's ``cu_seqlens``. On
  one process the update runs the LM head only on the rows that carry loss and computes a prompt
  prefix shared by several samples once (``model.update_forward``, `echoloss.train.forward`);
  a step without any gradient (no loss row, or every advantage 0 and no echo) runs no forward.
* **Data parallelism is FSDP2 ``fully_shard``** per decoder layer and at the root, under
  ``torchrun``. Every rank must run the same number of forwards (FSDP gathers parameters in each),
  so ranks pad their micro-batch count with empty batches whose loss is an exact, connected zero.
* **The warm-start** is plain SFT on scripted shortest-path demonstrations (assistant tokens only,
  no echo, identical for every arm of the ECHO experiment) for ``warmup.steps`` steps, before the
  ``train.max_steps`` RL steps. It teaches the reply format; RL does the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch
from torch.distributed.tensor import DTensor

import echoloss
from echoloss.io import TokenExporter, write_rollouts
from echoloss.loss import (
    LossInputs,
    Normalizers,
    all_reduce_normalizers,
    count_normalizers,
    undo_data_parallel_averaging,
)
from echoloss.train import checkpoint as ckpt
from echoloss.train import tracking
from echoloss.train.config import (
    ConfigWarning,
    TrainConfig,
    advantage_fn,
    parse_config,
    pretrained_rates_problem,
)
from echoloss.train.data import Rollout, rollout_record
from echoloss.train.envs import Env, ObservationKinds, make_env
from echoloss.train.forward import (
    SharedPrefixForward,
    first_loss_rows,
    lm_head_weight,
    loss_rows,
    packed_hidden,
    prefix_clusters,
    resolve_update_forward,
)
from echoloss.train.metrics import MetricSums, banner, rollout_metrics, summary_line
from echoloss.train.model import build_tiny_model, build_tokenizer, load_model, packed_logits
from echoloss.train.probes import Heldout, evaluate, heldout_set
from echoloss.train.probes_world import EchoGradient, EchoSpans, zero_variance_fraction
from echoloss.train.regimes import (
    Phase,
    Scores,
    copy_task_warmup,
    observation_ce,
    phase_at,
    phase_row,
    runs_copy_task,
    step_losses,
)
from echoloss.train.runtime import (
    Ranks,
    autocast,
    compute_dtype,
    gather,
    release_process_group,
    seed_everything,
    shard,
    start_ranks,
)
from echoloss.train.snapshots import (
    appended_outputs,
    claim_output_dir,
    export_model,
    load_run,
    save_run,
)
from echoloss.train.sources import RolloutSource

__all__ = [
    "NO_SIGNAL_STEPS",
    "MicroBatches",
    "Outputs",
    "Run",
    "build_samples",
    "checkpoint_if_due",
    "collect_rollouts",
    "compute_advantages",
    "evaluate_if_due",
    "forward_backward",
    "log_step",
    "make_micro_batches",
    "setup",
    "step",
    "train",
    "update",
]

#: RL steps in a row without any non-zero advantage before the trainer warns (a collapsed
#: policy whose groups all score the same gets no RL gradient, docs/experiment.md).
NO_SIGNAL_STEPS = 10

#: The policies whose per-token loss is the advantage times a function of the ratio (zero
#: gradient at advantage 0; `no_gradient`).
_BUILT_IN_POLICIES = frozenset(
    {"dppo", "ppo_clip", "cispo", "cispo_sequence", "gspo", "sapo", "sapo_sequence", "reinforce"}
)


# ------------------------------------------------------------------------------------------------
# The run state


@dataclass
class Outputs:
    """What a run writes as it goes (opened by `setup`, closed when `train` returns): rank 0's
    metrics and evaluation lines, trackers and progress bar; every rank's rollouts and token
    exports when asked for. ``log`` takes the one-line summaries (rank 0)."""

    log: Callable[[str], None]
    metrics: TextIO | None = None
    evals: TextIO | None = None
    rollouts: TextIO | None = None
    tokens: TokenExporter | None = None
    trackers: Any = None  # echoloss.train.tracking.open_trackers's handle
    bar: Any = None  # a tqdm bar on a terminal


@dataclass
class Run:
    """Everything a step reads, built once by `setup`.

    Attributes:
        cfg: the validated configuration.
        ranks: device, rank and number of ranks.
        out: the output directory.
        model, tok, opt: the policy, its tokenizer and its optimiser.
        env: the environment (`echoloss.train.envs.Env`).
        source: where each step's rollouts come from.
        rae: the RAE baseline (``advantages.rae_decay``), or None.
        heldout: the held-out observation set of the probes.
        start, total, warm_steps: the first step to run, the step count (warm-up + RL) and how
            many of them are the warm-up.
        outputs: the files the run appends to.
        no_signal: RL steps in a row on which every advantage was 0.
        forward: the update's forward (`echoloss.train.forward.resolve_update_forward`).
        dtype: the dtype the model computes in (`echoloss.train.runtime.compute_dtype`).
    """

    cfg: TrainConfig
    ranks: Ranks
    out: Path
    model: Any
    tok: Any
    opt: torch.optim.Optimizer
    env: Env[Any, Any]
    source: RolloutSource
    rae: echoloss.RAE | None
    heldout: Heldout
    start: int
    total: int
    warm_steps: int
    outputs: Outputs
    no_signal: int = 0
    forward: str = "logits"
    dtype: torch.dtype = torch.float32


@dataclass
class MicroBatches:
    """Step 4's result: this rank's micro-batches on the device, their next-token targets and
    loss inputs, how many are real (the dummies that equalise ranks come last), the global
    normalisers and, with ``model.update_forward = "shared_prefix"``, each micro-batch's prefix
    (an index into ``prefixes``, the token ids every sequence of that micro-batch starts with;
    ``[]`` for sequences that share none)."""

    batches: list[echoloss.PackedBatch]
    targets: list[echoloss.NextTokenTargets]
    inputs: list[LossInputs]
    real: int
    norms: Normalizers
    prefix_of: list[int] = field(default_factory=list)
    prefixes: list[list[int]] = field(default_factory=list)


@dataclass
class Trained:
    """Step 5's result: each named loss's metrics (``"main"``, ``"obs"``), the tokens seen, the
    forward that ran (``"skipped: ..."`` with the reason when the step had no gradient) and, on
    the steps the gradient probe runs (``train.grad_ratio_every``), ``(‖∇echo‖, ‖∇PG‖)``."""

    metrics: dict[str, MetricSums] = field(default_factory=dict)
    tokens: int = 0
    echo_pg_norms: tuple[float, float] | None = None
    forward: str = ""


# ------------------------------------------------------------------------------------------------
# The loop


def train(
    cfg: TrainConfig | dict[str, Any],
    *,
    resume: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Run the configured training; returns the output directory.

    Process-wide torch settings it changes (deterministic algorithms, CPU threads) are restored
    when it returns, so it can be called from tests and notebooks.

    Args:
        cfg: a validated `echoloss.train.config.TrainConfig`, or a dict of sections
            (validated here; `ConfigError` names every bad key).
        resume: a checkpoint directory, or an output directory whose ``checkpoints/latest`` names
            one, or None to start fresh.
        log: where the one-line-per-step summaries go (rank 0 only; default: stdout).
    """
    if not isinstance(cfg, TrainConfig):  # a plain dict (a parsed TOML table): validate it
        cfg = parse_config(cfg)
    deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    try:
        return _run(cfg, resume, log or _print)  # its frame, and the model, gone when it returns
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
        release_process_group()


def _run(cfg: TrainConfig, resume: str | Path | None, log: Callable[[str], None]) -> Path:
    """`setup`, every `step` from the run's start, the end; returns the output directory."""
    with ExitStack() as files:  # every file the run opens is closed, even on an error
        run = setup(cfg, resume=resume, log=log, files=files)
        if run.start == 0 and run.warm_steps == 0 and cfg.train.eval_at_start:
            _record_evaluation(run, 0, 0, full=True)  # the RL start, before any update
        for index in range(run.start, run.total):
            step(run, index)
    _finish(run)
    return run.out


def step(run: Run, index: int) -> None:
    """Optimiser step ``index`` (0-based; the warm-up's steps come first): the numbered steps."""
    t0 = time.perf_counter()
    c = run.cfg
    phase = phase_at(index, run.warm_steps, warmup=c.warmup, echo=c.echo, rl_lr=c.optim.lr)
    rollouts = collect_rollouts(run, index, phase)  # 1.
    gen_time = time.perf_counter() - t0
    advantages = compute_advantages(run, rollouts, phase)  # 2.
    samples = build_samples(run, rollouts, advantages, phase, index)  # 3.
    mb = make_micro_batches(run, samples)  # 4.
    trained = forward_backward(run, mb, phase, index)  # 5.
    grad_norm = update(run)  # 6.
    times = {"gen_time": gen_time, "step_time": time.perf_counter() - t0}
    evals = evaluate_if_due(run, index, phase)  # 7.
    row = {"grad_norm": grad_norm, **times, **evals}
    log_step(run, index, phase, rollouts, advantages, mb, trained, row)  # 8.
    checkpoint_if_due(run, index)  # 9.


# ------------------------------------------------------------------------------------------------
# Set-up


def setup(
    cfg: TrainConfig,
    *,
    resume: str | Path | None,
    log: Callable[[str], None],
    files: ExitStack,
) -> Run:
    """Everything before step 1: ranks and seeds, model and optimiser, environment, data
    source, held-out set, checkpoint (on resume), copy-task pre-training, output files. Every
    check of the inputs runs before the first file is written."""
    claim_output_dir(cfg.train, resume, rank=int(os.environ.get("RANK", "0")))
    ranks = start_ranks(cfg.model.device)
    _process_settings(cfg, ranks)
    m = cfg.model
    forward = resolve_update_forward(  # its errors before any file is written
        m.update_forward,
        attn_implementation=m.attn_implementation,
        world=ranks.world,
        export_tokens=cfg.train.export_tokens,
    )
    dtype = compute_dtype(m.dtype, ranks.device)
    model, tok = _build_model(cfg, ranks.device)
    if ranks.world > 1:
        shard(model)
    opt = _optimizer(cfg, model)
    env = _environment(cfg)
    _warn_unsuitable(cfg, model, env, ranks)
    source = RolloutSource(env, tok, ranks, data=cfg.data, warmup=cfg.warmup, seed=cfg.train.seed)
    decay = cfg.advantages.rae_decay
    rae = echoloss.RAE(decay=decay) if decay is not None else None
    tokens = cfg.optim.micro_batch_tokens
    heldout = heldout_set(env, tok, ranks.device, data=cfg.data, micro_batch_tokens=tokens)
    out = Path(cfg.train.output_dir)
    start, resumed = _resume(cfg, resume, model, opt, rae, ranks, out, log)
    if ranks.rank == 0:
        log(banner(cfg, model, env, ranks.device, out, resumed, start))
    _copy_task(cfg, model, tok, ranks, dtype, start, log)
    warm_steps = cfg.warmup.steps if cfg.data.source != "jsonl" else 0
    total = warm_steps + cfg.train.max_steps  # the warm-up comes before the RL steps
    outputs = _open_outputs(cfg, out, ranks, (start, total), resume is not None, files, log)
    return Run(
        cfg, ranks, out, model, tok, opt, env, source, rae, heldout, start, total, warm_steps,
        outputs, forward=forward, dtype=dtype,
    )  # fmt: skip


def _process_settings(cfg: TrainConfig, ranks: Ranks) -> None:
    """Torch's CPU threads, deterministic algorithms and the seeds (``train`` restores the
    first two when it returns)."""
    if cfg.train.threads is not None:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=ranks.device.type == "cuda")
    seed_everything(cfg.train.seed * 1000 + ranks.rank)


def _print(line: str) -> None:
    print(line, flush=True)


def _build_model(cfg: TrainConfig, device: torch.device) -> tuple[Any, Any]:
    """The model (``model.path``, or the built-in tiny one) and its tokenizer, on ``device``,
    with fp32 parameters (the optimiser's master weights)."""
    m = cfg.model
    master = torch.float32  # the parameters; the forward computes in model.dtype (autocast)
    if m.path is not None:
        model, tok = load_model(
            m.path, dtype=master, attn_implementation=m.attn_implementation, gguf_file=m.gguf_file
        )
        return model.to(device=device, dtype=master), tok
    tok = build_tokenizer(compass=cfg.env.words == "compass")
    model = build_tiny_model(
        arch=m.arch,
        vocab_size=len(tok),
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings,
        seed=cfg.train.seed,
        attn_implementation=m.attn_implementation,
    )
    return model.to(master).to(device), tok


def _environment(cfg: TrainConfig) -> Env[Any, Any]:
    """The configured environment, with the capabilities the configuration asks of it."""
    env = make_env(cfg.env.name, **cfg.env.options())
    if cfg.echo.span != "observation" and not isinstance(env, EchoSpans):
        raise ValueError(
            f"echo.span = {cfg.echo.span!r}: env {cfg.env.name} names no observation spans "
            "(no echo_spans); use a mirrorgrid env, or echo.span = 'observation'"
        )
    weight = cfg.echo.error_weight
    if weight != 1 and not isinstance(env, ObservationKinds):
        raise ValueError(
            f"echo.error_weight = {weight}: env {cfg.env.name} marks no error observations "
            "(no observation_kinds); use the calculator env, or echo.error_weight = 1"
        )
    if weight != 1 and (cfg.echo.span != "observation" or cfg.data.source == "jsonl"):
        raise ValueError(
            f"echo.error_weight = {weight} reads each generated conversation's messages and "
            "weights whole observations: it needs data.source = 'generate' and echo.span = "
            "'observation'; set echo.error_weight = 1"
        )
    return env


def _warn_unsuitable(cfg: TrainConfig, model: Any, env: Env[Any, Any], ranks: Ranks) -> None:
    """Warn (rank 0) about settings that are legal but do not suit this model or env."""
    problems = [pretrained_rates_problem(cfg, sum(p.numel() for p in model.parameters()))]
    asked, tasks = cfg.train.eval_episodes, len(env.eval_tasks())
    if asked is not None and asked > tasks and cfg.data.source != "jsonl":
        problems.append(
            f"train.eval_episodes = {asked} but env {env.name} has {tasks} held-out evaluation "
            f"tasks: each evaluation plays all {tasks}; set at most {tasks}, or leave it unset"
        )
    for problem in problems:
        if problem is not None and ranks.rank == 0:
            warnings.warn(problem, ConfigWarning, stacklevel=3)


def _optimizer(cfg: TrainConfig, model: Any) -> torch.optim.Optimizer:
    o = cfg.optim
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        trained, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
    )


def _resume(
    cfg: TrainConfig,
    resume: str | Path | None,
    model: Any,
    opt: torch.optim.Optimizer,
    rae: echoloss.RAE | None,
    ranks: Ranks,
    out: Path,
    log: Callable[[str], None],
) -> tuple[int, str | None]:
    """Restore a checkpoint (``--resume``): returns the step to start from and the checkpoint's
    path (``(0, None)`` on a fresh start). Outputs written after it are cut back."""
    if resume is None:
        return 0, None
    path = ckpt.find_checkpoint(resume)  # verified (checksums); before anything is written
    state = load_run(path, model, opt, ranks, model_config=cfg.model)
    start = int(state["step"])
    if rae is not None and state.get("rae") is not None:
        rae.load_state_dict(state["rae"])
    changed = ckpt.config_changes(state.get("config", {}), cfg.model_dump(mode="json"))
    if ranks.rank == 0 and changed:
        warnings.warn(
            f"--resume: the configuration differs from the checkpoint's ({path}): "
            + "; ".join(changed),
            ckpt.ResumeWarning,
            stacklevel=2,
        )
    if path.resolve().is_relative_to(out.resolve()):  # the resumed run rewrites what follows
        names = appended_outputs(ranks.rank, save_rollouts=cfg.train.save_rollouts)
        ckpt.truncate_outputs(
            out, state.get("outputs", {}), step=start, rank=ranks.rank, names=names
        )
    if ranks.rank == 0:
        log(f"resumed from {path} at step {start}")
    return start, str(path)


def _copy_task(
    cfg: TrainConfig,
    model: Any,
    tok: Any,
    ranks: Ranks,
    dtype: torch.dtype,
    start: int,
    log: Callable[[str], None],
) -> None:
    """Copy-task pre-training (``warmup.copy_steps``) of a fresh built-in tiny model."""
    steps = cfg.warmup.copy_steps
    if steps and cfg.model.path is not None and ranks.rank == 0:
        # The experiment's arms load their warm-start this way: copying is already in it.
        warnings.warn(
            f"warmup.copy_steps = {steps} is not run: model.path loads a trained model (the "
            "copy task is for the built-in tiny model before its warm-up)",
            stacklevel=3,
        )
    if not runs_copy_task(steps, model_path=cfg.model.path, start=start):
        return

    def report(k: int, ce: float) -> None:
        log(f"copy task {k:>5}/{steps}  ce {ce:.4f}")

    with autocast(dtype, ranks.device):
        copy_task_warmup(
            model,
            vocab_size=len(tok),
            steps=steps,
            lr=cfg.warmup.copy_lr,
            seed=cfg.train.seed,
            device=ranks.device,
            report=report if ranks.rank == 0 else None,
        )


def _open_outputs(
    cfg: TrainConfig,
    out: Path,
    ranks: Ranks,
    steps: tuple[int, int],
    resumed: bool,
    files: ExitStack,
    log: Callable[[str], None],
) -> Outputs:
    """Create the output directory and open what the run appends to (closed with ``files``);
    ``steps`` is ``(start, total)``."""
    o = Outputs(log=log)
    t = cfg.train
    start, total = steps
    if ranks.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        config = cfg.model_dump(mode="json")
        o.trackers = files.enter_context(
            tracking.open_trackers(t.report_to, out=out, config=config, start=start)
        )
        o.metrics = files.enter_context(open(out / "metrics.jsonl", "a" if resumed else "w"))  # noqa: SIM115
    if t.save_rollouts:
        o.rollouts = files.enter_context(open(out / f"rollouts.rank{ranks.rank}.jsonl", "a"))  # noqa: SIM115
    if t.export_tokens:
        o.tokens = files.enter_context(TokenExporter(out / "token_exports", rank=ranks.rank))
    if ranks.rank == 0 and t.progress and sys.stderr.isatty():
        from tqdm import tqdm

        o.bar = files.enter_context(
            tqdm(total=total, initial=start, desc="echoloss-train", unit="step")
        )
    if ranks.rank == 0:
        o.evals = files.enter_context(open(out / "eval.jsonl", "a"))  # noqa: SIM115
        if start == 0:
            o.evals.truncate(0)
    return o


# ------------------------------------------------------------------------------------------------
# The numbered steps


def collect_rollouts(run: Run, index: int, phase: Phase) -> list[Rollout]:
    """1. This rank's share of the step's rollouts; RL rollouts also go to the rollout file."""
    with autocast(run.dtype, run.ranks.device):
        rollouts = run.source.get(index, run.model)
    f = run.outputs.rollouts
    if f is not None and not phase.warm:  # echoloss rollout JSONL, readable as data
        write_rollouts(f, [rollout_record(r) for r in rollouts])
        f.flush()
    return rollouts


def compute_advantages(run: Run, rollouts: list[Rollout], phase: Phase) -> list[float | None]:
    """2. Advantages of this rank's rollouts, computed on the *global* batch (1 in the warm-up).

    Every rank gathers every reward and runs the same computation, so the result does not depend
    on the number of ranks (and a stateful RAE stays identical on every rank).
    """
    if phase.warm:
        return [1.0] * len(rollouts)
    world = run.ranks.world
    mine = [(r.group_id, r.reward, r.errored, r.env_name) for r in rollouts]
    everything = [x for part in gather(mine, world) for x in part]
    start = sum(gather(len(mine), world)[: run.ranks.rank])
    rewards = [r for _, r, _, _ in everything]
    errored = [e for _, _, e, _ in everything]
    if run.rae is not None:
        adv = run.rae.advantages([env for *_, env in everything], rewards, errored=errored)
    else:
        groups = [g for g, _, _, _ in everything]
        fn, kwargs = advantage_fn(run.cfg), run.cfg.advantages.kwargs
        adv = echoloss.compute_advantages(rewards, groups, fn=fn, errored=errored, fn_kwargs=kwargs)
    return adv[start : start + len(mine)]


def build_samples(
    run: Run,
    rollouts: list[Rollout],
    advantages: list[float | None],
    phase: Phase,
    index: int,
) -> list[echoloss.Sample]:
    """3. Samples through the library's data path: ``interleave`` with the phase's echo config
    (restricted to the env's spans with ``echo.span``), each with its rollout's advantage (a
    rollout without one trains nothing)."""
    samples: list[echoloss.Sample] = []
    for r, a in zip(rollouts, advantages, strict=True):
        if a is None:
            continue  # errored, or a group without survivors: trains nothing
        only = _span_filter(run, r, phase)
        made = echoloss.interleave(
            r.steps, echo=phase.echo, errored=r.errored, env_name=r.env_name, echo_filter=only
        )
        for s in _error_weighted(run, r, phase, made):
            s.advantage = a
            samples.append(s)
    limit = run.cfg.data.max_tokens
    too_long = [len(s) for s in samples if len(s) > limit]
    if too_long:
        raise ValueError(
            f"step {index}: a sample has {max(too_long)} tokens > data.max_tokens={limit}; "
            "raise data.max_tokens (and optim.micro_batch_tokens)"
        )
    return samples


def _error_weighted(
    run: Run, rollout: Rollout, phase: Phase, samples: list[echoloss.Sample]
) -> list[echoloss.Sample]:
    """``samples`` with the echo weights of the env's error observations scaled by
    ``echo.error_weight`` (0: not echoed; they still count in ``Z``). The error tokens are the
    echo rows of the same steps interleaved with only the error spans kept, so the two
    interleavings have the same tokens in the same samples."""
    weight, env = run.cfg.echo.error_weight, run.env
    if weight == 1 or phase.warm or phase.echo is None or not isinstance(env, ObservationKinds):
        return samples

    def errors(messages: Any) -> dict[int, tuple[int, int]]:
        return env.observation_kinds(messages).get("error", {})

    only = echoloss.span_echo_filter(rollout.messages, errors, decode=run.tok.decode)
    marked = echoloss.interleave(
        rollout.steps, echo=phase.echo, errored=rollout.errored, env_name=rollout.env_name,
        echo_filter=only,
    )  # fmt: skip
    out = []
    for s, e in zip(samples, marked, strict=True):
        if s.echo_weights is None or e.echo_weights is None:
            out.append(s)
            continue
        scaled = [
            w if w is None or x is None else (w * weight if weight else None)
            for w, x in zip(s.echo_weights, e.echo_weights, strict=True)
        ]
        out.append(dataclasses.replace(s, echo_weights=scaled))
    return out


def _span_filter(
    run: Run, rollout: Rollout, phase: Phase
) -> Callable[[list[echoloss.Step]], list[list[bool]]] | None:
    """Echo restricted to the env's spans (``echo.span``, e.g. the placebo's), or None."""
    span, env = run.cfg.echo.span, run.env
    if phase.warm or phase.echo is None or span == "observation":
        return None
    if not isinstance(env, EchoSpans):  # setup refused this combination
        raise TypeError(f"echo.span = {span!r} needs an env with echo_spans")
    spans = partial(env.echo_spans, span)
    return echoloss.span_echo_filter(rollout.messages, spans, decode=run.tok.decode)


def make_micro_batches(run: Run, samples: list[echoloss.Sample]) -> MicroBatches:
    """4. Pack into micro-batches (padded with dummies to the ranks' largest count, so that every
    rank runs as many forwards) and count the global normalisers (all-reduced once). With a
    shared-prefix forward, samples are first grouped by their common prompt prefix
    (`echoloss.train.forward.prefix_clusters`) and each micro-batch holds one group's samples."""
    budget = run.cfg.optim.micro_batch_tokens
    prefix_of: list[int] = []
    prefixes: list[list[int]] = []
    if run.forward == "shared_prefix" and samples:
        batches = []
        ids = [s.token_ids for s in samples]
        for c in prefix_clusters(ids, first_loss_rows(samples)):
            prefixes.append(ids[c.members[0]][: c.prefix_len])
            for chunk in _continuation_chunks(samples, c.members, c.prefix_len, budget):
                batches += echoloss.pack(chunk, max_tokens=sum(len(s) for s in chunk))
                prefix_of.append(len(prefixes) - 1)
    else:
        batches = echoloss.pack(samples, max_tokens=budget) if samples else []
    real = len(batches)
    if run.ranks.world > 1:
        most = max(gather(len(batches), run.ranks.world))
        batches += [_dummy_batch(run.tok.pad_token_id) for _ in range(most - len(batches))]
    on_device = [b.to(run.ranks.device) for b in batches]
    targets = [echoloss.next_token_targets(b) for b in on_device]
    inputs = [
        LossInputs.from_targets(t, env_names=list(b.env_names))
        for b, t in zip(on_device, targets, strict=True)
    ]
    local = sum((count_normalizers(x) for x in inputs), Normalizers())
    norms = all_reduce_normalizers(local)
    return MicroBatches(on_device, targets, inputs, real, norms, prefix_of, prefixes)


def _continuation_chunks(
    samples: list[echoloss.Sample], members: tuple[int, ...], prefix_len: int, budget: int
) -> list[list[echoloss.Sample]]:
    """A prefix group's samples in micro-batches of at most ``budget`` continuation tokens,
    padding included (rows are right-padded to the longest continuation: longest first)."""
    order = sorted(members, key=lambda i: -len(samples[i]))
    chunks: list[list[echoloss.Sample]] = []
    width = 0
    for i in order:
        n = len(samples[i]) - prefix_len
        if chunks and (len(chunks[-1]) + 1) * width <= budget:
            chunks[-1].append(samples[i])
        else:
            chunks.append([samples[i]])
            width = n
    return chunks


def _dummy_batch(pad_id: int) -> echoloss.PackedBatch:
    """A two-token batch that trains nothing: its loss is an exact zero, still connected to the
    graph, so a rank with fewer micro-batches can match the others' forwards and backwards."""
    s = echoloss.Sample(
        prompt_ids=[pad_id],
        completion_ids=[pad_id],
        completion_mask=[False],
        completion_logprobs=[0.0],
    )
    return echoloss.pack([s], max_tokens=2)[0]


def forward_backward(run: Run, mb: MicroBatches, phase: Phase, index: int) -> Trained:
    """5. Per micro-batch: the forward (`_scores`), the phase's losses, their backward
    (gradients accumulate as sums in ``.grad``; under FSDP reduce-scattered once, after the
    last). A step without any gradient (`no_gradient`) runs no forward: its gradients are set to
    exact zeros, which is what the backward would have left, and the optimiser steps as usual."""
    cfg, model = run.cfg, run.model
    for group in run.opt.param_groups:  # Adam makes steps ~lr whatever the gradient's scale
        group["lr"] = phase.lr
    done, probe = Trained(), _gradient_probe(run, phase)
    reason = no_gradient(run, mb, phase)
    if reason is not None:
        return _skipped(model, reason)
    # The probe's echo gradient must include the prefix's share: it runs unshared.
    done.forward = "packed" if probe is not None and run.forward == "shared_prefix" else run.forward
    shared = (
        SharedPrefixForward(model, mb.prefixes, run.tok.pad_token_id)
        if done.forward == "shared_prefix"
        else None
    )
    for i, (b, t, x) in enumerate(zip(mb.batches, mb.targets, mb.inputs, strict=True)):
        if run.ranks.world > 1:
            model.set_requires_gradient_sync(i == len(mb.batches) - 1)
        with autocast(run.dtype, run.ranks.device):  # the forward only; the loss reads its scores
            scores = _scores(run, done.forward, shared, mb, i, b, x)
        losses = step_losses(phase, cfg.loss, scores, mb.norms)
        for k, (name, loss) in enumerate(losses):
            res = loss()
            if probe is not None and name == "main" and i < mb.real:  # echo's own gradient
                probe.add(observation_ce(cfg.loss, scores, mb.norms).loss)
            res.loss.backward(retain_graph=k < len(losses) - 1)
            if i < mb.real:  # a dummy batch counts in no metric and no export
                done.metrics.setdefault(name, MetricSums()).add(res.metrics)
        if i >= mb.real:
            continue
        done.tokens += len(b) - b.num_padding
        if run.outputs.tokens is not None and not phase.warm and scores.logits is not None:
            _export_tokens(run.outputs.tokens, b, t, scores.logits, index, i)
    if shared is not None:  # the prefixes' share of the gradient, once per prefix
        shared.backward()
    if probe is not None:  # one rank only: .grad holds the step's whole gradient
        done.echo_pg_norms = probe.norms()
    return done


def _skipped(model: Any, reason: str) -> Trained:
    """A step without a gradient: exact zero gradients (what the backward would leave), no
    forward, the reason as the step's ``update_forward``."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return Trained(forward=f"skipped: {reason}")


def _scores(
    run: Run,
    forward: str,
    shared: SharedPrefixForward | None,
    mb: MicroBatches,
    i: int,
    b: echoloss.PackedBatch,
    x: LossInputs,
) -> Scores:
    """What micro-batch ``i``'s losses score, by the update's forward: every row's logits, or
    the LM head's input at the rows that carry loss (packed, or against a shared prefix)."""
    model, attn = run.model, run.cfg.model.attn_implementation
    if forward == "logits":
        return Scores(x, logits=packed_logits(model, b, attn_implementation=attn))
    if shared is not None:
        hidden = shared.hidden(b, mb.prefix_of[i])
    else:
        hidden = packed_hidden(model, b, attn_implementation=attn)
    rows = loss_rows(hidden, lm_head_weight(model), x)
    return Scores(rows.inputs, hidden=rows.hidden, weight=rows.weight)


def no_gradient(run: Run, mb: MicroBatches, phase: Phase) -> str | None:
    """Why this step's loss has no gradient, or None when it may have one: no row of any rank
    carries loss; or, in RL without echo rows, every RL row's advantage is 0 and the loss has no
    term that trains without an advantage (``kl_coef``, ``entropy_coef``, the resolved
    ``kl_tau`` all 0; a built-in policy, whose per-token loss is the advantage times a function
    of the ratio)."""
    norms = mb.norms
    if norms.rl_tokens == 0 and norms.echo_tokens == 0:
        return "no row carries loss"
    loss = run.cfg.loss
    if phase.warm or norms.echo_tokens or loss.mode != "rl":
        return None
    if loss.kl_coef or loss.entropy_coef or loss.resolved_kl_tau or loss.policy == "custom":
        return None
    if loss.policy not in _BUILT_IN_POLICIES:
        return None
    local = any(
        bool((x.advantages[x.rl] != 0).any()) for x in mb.inputs if x.advantages is not None
    )
    if any(gather(local, run.ranks.world)):
        return None
    return "every advantage is 0 and no echo row"


def _gradient_probe(run: Run, phase: Phase) -> EchoGradient | None:
    """``‖∇echo‖`` against ``‖∇PG‖`` every ``train.grad_ratio_every`` RL steps with echo (one
    rank only), or None."""
    every = run.cfg.train.grad_ratio_every
    if phase.warm or phase.echo is None or not every or run.ranks.world != 1:
        return None
    if phase.rl_step % every:
        return None
    return EchoGradient([p for p in run.model.parameters() if p.requires_grad])


def _export_tokens(
    exporter: TokenExporter,
    b: echoloss.PackedBatch,
    t: echoloss.NextTokenTargets,
    logits: torch.Tensor,
    index: int,
    micro_step: int,
) -> None:
    """The micro-batch's tokens with the trainer's logprob of each label, at the loss's T."""
    with torch.no_grad():
        temps = t.temperatures.masked_fill(t.echo_weights > 0, 1.0)[:, None]
        lp = torch.log_softmax(logits.float() / temps, -1).gather(1, t.labels[:, None])
    exporter.write(
        b, step=index + 1, micro_step=micro_step, row_stats={"trainer_logprobs": lp[:, 0]}
    )


def update(run: Run) -> float:
    """6. The optimiser step: FSDP averaged the ranks' gradients and the global normalisers want
    their sum (undone first), gradient clipping, AdamW. Returns the gradient norm."""
    undo_data_parallel_averaging(run.model, run.ranks.world)
    clip = run.cfg.optim.grad_clip if run.cfg.optim.grad_clip is not None else math.inf
    params = [p for p in run.model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
    if isinstance(grad_norm, DTensor):  # sharded: the global norm
        grad_norm = grad_norm.full_tensor()
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    return float(grad_norm)


def evaluate_if_due(run: Run, index: int, phase: Phase) -> dict[str, float]:
    """7. Evaluate after this step when due: at the RL start (after the warm-up's last step),
    every ``train.eval_every`` RL steps, and after the last step. Returns the evaluation's
    values (empty when none is due)."""
    t = run.cfg.train
    last = index + 1 == run.total
    rl_done = phase.rl_step + 1  # RL steps finished after this step (≤ 0 in the warm-up)
    at_start = index + 1 == run.warm_steps and t.max_steps > 0 and t.eval_at_start
    periodic = not phase.warm and (rl_done % t.eval_every == 0 or last)
    if not (at_start or periodic or (phase.warm and last)):
        return {}
    return _record_evaluation(run, index + 1, max(rl_done, 0), full=at_start or last)


def _record_evaluation(run: Run, step_no: int, rl_step: int, full: bool) -> dict[str, float]:
    """Evaluate (`echoloss.train.probes.evaluate`) and append the result to ``eval.jsonl``."""
    t, c = time.perf_counter(), run.cfg
    device = run.ranks.device
    # Its own seeded RNG: evaluating never shifts the training run's sampling stream (a
    # resumed run stays bit-identical), and every arm samples the same way at a given step.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(c.train.seed * 1_000_003 + step_no)
        with autocast(run.dtype, device):
            ev = evaluate(
                run.model,
                run.tok,
                run.env,
                run.heldout,
                device,
                full,
                data=c.data,
                train=c.train,
                attn_implementation=c.model.attn_implementation,
                forward=run.forward,
            )
    f = run.outputs.evals
    if ev and f is not None:
        row = {"step": step_no, "rl_step": rl_step, **ev, "eval_time": time.perf_counter() - t}
        f.write(json.dumps(row) + "\n")
        f.flush()
    return ev


def log_step(
    run: Run,
    index: int,
    phase: Phase,
    rollouts: list[Rollout],
    advantages: list[float | None],
    mb: MicroBatches,
    trained: Trained,
    extra: dict[str, float],
) -> None:
    """8. One JSON line per step in ``metrics.jsonl`` (and the trackers), and a one-line summary:
    the metrics of the step's phase, the loss's per-env metrics, ``extra`` (grad norm, times,
    evaluation)."""
    world = run.ranks.world
    metrics = {name: sums.result(world) for name, sums in trained.metrics.items()}
    tokens = sum(gather(trained.tokens, world))
    row: dict[str, Any] = {"step": index + 1, "phase": phase.kind}
    if phase.warm:
        row["warmup_step"] = index + 1
    else:
        row["rl_step"] = phase.rl_step + 1
        row.update(rollout_metrics(rollouts, advantages, world))
        row["zero_variance_groups"] = _zero_variance_groups(rollouts)
        if trained.echo_pg_norms is not None:  # before clipping; their ratio is echo's pull
            echo_norm, pg_norm = trained.echo_pg_norms
            row.update(echo_grad_norm=echo_norm, pg_grad_norm=pg_norm)
    row.update(phase_row(phase, metrics))
    if not phase.warm:
        _warn_without_signal(run, phase, row)
    row.update(_common_metrics(run, mb, tokens, extra))
    row["update_forward"] = trained.forward
    no_echo = phase.warm or phase.echo is None  # echo metrics only on steps with echo
    m = metrics.get("main", {})
    row.update({f"loss/{k}": v for k, v in sorted(m.items()) if not (no_echo and "echo" in k)})
    row.update({k: v for k, v in extra.items() if k not in row})
    _write_row(run, row)


def _zero_variance_groups(rollouts: list[Rollout]) -> float:
    """The share of this rank's GRPO groups whose rewards are all equal (no policy gradient)."""
    groups: dict[Any, list[float]] = defaultdict(list)
    for r in rollouts:
        groups[r.group_id].append(r.reward)
    return zero_variance_fraction(dict(groups))


def _common_metrics(
    run: Run, mb: MicroBatches, tokens: int, extra: dict[str, float]
) -> dict[str, float]:
    """The metrics every step logs: token counts, gradient norm, lr, times, throughput."""
    step_time, gen_time = extra["step_time"], extra["gen_time"]
    return {
        "rl_tokens": mb.norms.rl_tokens,
        "echo_tokens": mb.norms.echo_tokens,
        "sequences": mb.norms.sequences,
        "tokens": tokens,
        "grad_norm": extra["grad_norm"],
        "lr": run.opt.param_groups[0]["lr"],
        "gen_time": gen_time,
        "step_time": step_time,
        "tokens_per_s": tokens / max(step_time - gen_time, 1e-9),
    }


def _warn_without_signal(run: Run, phase: Phase, row: dict[str, Any]) -> None:
    """Warn once RL has had no signal for `NO_SIGNAL_STEPS` RL steps in a row."""
    run.no_signal = run.no_signal + 1 if row.get("advantage_abs", 1.0) == 0 else 0
    if run.no_signal == NO_SIGNAL_STEPS and run.ranks.rank == 0:
        warnings.warn(
            f"RL steps {phase.rl_step + 2 - NO_SIGNAL_STEPS}-{phase.rl_step + 1}: every group "
            f"had identical rewards (mean reward {row['reward']:.3f}), so every advantage and "
            "the RL gradient were 0; RL alone cannot leave this state (an echo or entropy term "
            "still trains). Read invalid_reply_rate in metrics.jsonl; consider stopping the "
            "run, a larger data.group_size or a lower optim.lr",
            stacklevel=4,
        )


def _write_row(run: Run, row: dict[str, Any]) -> None:
    o = run.outputs
    if o.metrics is None:
        return
    o.metrics.write(json.dumps(row) + "\n")
    o.metrics.flush()
    if o.trackers is not None:
        o.trackers.log(row)
    line = summary_line(row, run.total)
    if o.bar is not None:
        o.bar.update(1)
        o.bar.write(line)
    else:
        o.log(line)


def checkpoint_if_due(run: Run, index: int) -> None:
    """9. A checkpoint (atomic) every ``train.checkpoint_every`` steps and after the last."""
    done, c = index + 1, run.cfg
    if done % c.train.checkpoint_every == 0 or done == run.total:
        save_run(
            run.out,
            done,
            run.model,
            run.opt,
            run.rae,
            run.ranks,
            config=c.model_dump(mode="json"),
            prompts_per_step=c.data.prompts_per_step,
            keep=c.train.keep_checkpoints,
            save_rollouts=c.train.save_rollouts,
        )


# ------------------------------------------------------------------------------------------------
# The end


def _finish(run: Run) -> None:
    """After the last step: the final weights as an HF directory, and the plots."""
    ranks = run.ranks
    exported = gather(ckpt.final_model_complete(run.out / "final-model"), ranks.world)[0]
    if run.start < run.total or not exported:  # (re-)export after a crash during export
        export_model(run.out, run.model, run.tok, ranks.rank)
    if ranks.rank == 0 and run.cfg.train.plots:
        from echoloss.train.plots import plot_run

        plot_run(run.out / "metrics.jsonl", run.out / "plots")
    if ranks.world > 1:
        torch.distributed.barrier()
