"""The ECHO experiment in one command: GRPO, GRPO + echo at several λ, and an ActObs-style arm,
paired over seeds, evaluated on held-out tasks.

::

    python examples/research/echo_experiment/run.py --mode quick --output-dir runs/echo-quick     # minutes on 2 cores
    python examples/research/echo_experiment/run.py --mode full --output-dir runs/echo-full       # the committed result
    python examples/research/echo_experiment/run.py --summarize-only --output-dir runs/echo-full  # tables + figures again

For every seed, two warm-starts are trained once and shared:

* ``base``: SFT on the env's demonstrations (assistant tokens, plus the observation tokens at
  the small weight ``warmup.obs_weight`` so that they start calibrated);
* ``actobs``: the same with the observation CE at weight `ACTOBS_WEIGHT` (an ActObs-style
  warm-start: actions + weighted CE on observations).

Then every arm continues from its warm-start with RL, differing **only** in λ (``echo.alpha``):
``grpo`` (λ = 0), ``echo-<λ>`` for each λ of ``--alphas``, and ``actobs`` (λ = 0 after the
``actobs`` warm-start). Same seed, same tasks, same sampling stream across arms: the
comparisons are paired. The runs go to ``--jobs`` worker processes (one CPU thread each; a worker
imports torch once and runs ``echoloss-train`` runs one after another, each with its own log).
``--warm-start MODEL_DIR`` replaces the per-seed warm-starts by one model that every arm of every
seed starts from (a longer warm-up, or a pretrained model tuned on the env): the seeds then vary
RL only, and each arm evaluates its own RL start (the same numbers across the arms of a seed).
A finished run's row is appended to ``results.jsonl`` at once, so a cut-off experiment keeps
what it measured. At the end (or with ``--summarize-only``) it writes
``results.json`` (one object per run), ``summary.json`` / ``summary.md`` (means and 95 %
confidence intervals over seeds of the paired differences against ``grpo``) and one figure per
question (`echo_experiment.figures`: ``success.png``, ``observation_ce.png``,
``invalid_replies.png``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo_experiment.figures import write_figures
from echo_experiment.persistence import arm_label, reference_label
from echo_experiment.rows import RowsError, check_rows, read_results
from echo_experiment.stats import paired_ci

__all__ = [
    "MODES",
    "arm_label",
    "complete_rows",
    "main",
    "paired_ci",
    "read_rows",
    "reference_label",
    "runs_table",
    "steps_to",
    "summarize",
]

ACTOBS_WEIGHT = 1.0  # the ActObs-style warm-start's observation CE weight
THRESHOLD = 0.8  # "steps to 80 %": the first evaluation at or above this held-out success
MARGIN = -0.03  # pre-registered non-inferiority margin for echo vs GRPO (success, absolute)

# The persistence design's arms (docs/experiment.md, "Persistence"): (level, arm, λ, extra --set).
# Every arm of a seed starts from that seed's one warm-start (the ordinary world); the placebo
# echoes only the uninformative digit of every observation (echo.span = noise).
LEVEL_ARMS: list[tuple[str, str, float, list[str]]] = [
    ("per-world", "grpo", 0.0, []),
    ("per-world", "echo", 0.01, []),
    ("per-world", "echo", 0.05, []),
    ("per-world", "placebo", 0.05, ["echo.span=noise"]),
    ("per-episode", "grpo", 0.0, []),
    ("per-episode", "echo", 0.05, []),
]
# Per level: --set overrides. The per-world evaluation set has one task per held-out pair (60),
# the per-episode one four (one per mirroring): 16 and 4 sampled episodes per task give 960 each.
LEVEL_SETS: dict[str, list[str]] = {
    "per-world": ["env.level=per-world", "train.eval_samples=16"],
    "per-episode": ["env.level=per-episode", "train.eval_samples=4"],
}
PERSISTENCE_SET = [  # every run of the persistence design (warm-starts included)
    "env.name=mirrorgrid-noise",
    "env.words=compass",
    "train.grad_ratio_every=10",
]

# Per mode: seeds, λ of the echo arms, and --set overrides for every run. A mode with
# ``"levels": True`` runs the persistence design (LEVEL_ARMS) instead of grpo/echo-λ/actobs.
MODES: dict[str, dict[str, Any]] = {
    "persistence": {  # the pre-registered persistence experiment (docs/experiment.md)
        "seeds": list(range(12)),
        "alphas": [],
        "levels": True,
        "set": [*PERSISTENCE_SET, "train.max_steps=60", "train.eval_every=10"],
    },
    "persistence-quick": {  # its shape, at a fraction of the cost
        "seeds": [0, 1],
        "alphas": [],
        "levels": True,
        "set": [
            *PERSISTENCE_SET,
            "train.max_steps=10",
            "train.eval_every=5",
            "data.heldout_size=16",
            "warmup.steps=20",
        ],
    },
    "quick": {  # the shape of the full experiment at a fraction of its cost
        "seeds": [0, 1],
        "alphas": [0.05],
        "set": [
            "train.max_steps=20",
            "train.eval_every=10",
            "train.eval_samples=1",
            "data.heldout_size=32",
        ],
    },
    "full": {
        "seeds": list(range(8)),
        "alphas": [0.005, 0.01, 0.05],
        "set": ["train.max_steps=60", "train.eval_every=20"],
    },
}


def steps_to(evals: list[dict[str, Any]], key: str, threshold: float) -> int | None:
    """The first RL step whose evaluation has ``key >= threshold`` (None: never reached).

    Examples:
        >>> steps_to([{"rl_step": 0, "s": 0.5}, {"rl_step": 10, "s": 0.85}], "s", 0.8)
        10
    """
    for e in sorted(evals, key=lambda e: e["rl_step"]):
        if e.get(key, -math.inf) >= threshold:
            return int(e["rl_step"])
    return None


# ------------------------------------------------------------------------------------------------
# The runs


@dataclass
class _Job:
    name: str
    args: list[str]
    needs: str | None = None  # the job whose final model this one starts from
    state: str = "todo"  # todo, running, done, failed
    wall: float | None = None  # seconds; None for a job kept from before (--resume)
    meta: dict[str, Any] = field(default_factory=dict)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def read_rows(run_dir: Path, *, prog: str, hint: str) -> list[dict[str, Any]]:
    """The rows of the experiment output ``run_dir``: its ``results.jsonl`` if present, else its
    ``results.json`` (a committed folder), each checked (`echo_experiment.rows`). The error
    names ``prog``; a missing file's ends with ``hint``: what to pass instead."""
    for name in ("results.jsonl", "results.json"):
        if (run_dir / name).is_file():
            try:
                return [row for _, row in read_results(run_dir / name)]
            except RowsError as err:
                raise SystemExit(f"{prog}: {err}") from None
    raise SystemExit(f"{prog}: {str(run_dir)!r} has neither results.jsonl nor results.json; {hint}")


def _mean(key: str, rows: list[dict[str, Any]]) -> float | None:
    """The mean of ``key`` over the rows that have it (None: no row has it)."""
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else None


def _rl_start(out: Path, job: _Job) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(start, evals)`` of one arm: its held-out evaluation at RL start (its warm-start job's
    last one, or with a shared ``--warm-start`` its own first one; ``{}`` when there is none) and
    its own evaluations after it."""
    evals = _read_jsonl(out / job.name / "eval.jsonl")
    if job.needs is not None:  # the RL start: the end of its warm-start job, or its start job
        start = [e for e in _read_jsonl(out / job.needs / "eval.jsonl") if e["rl_step"] == 0]
    else:  # a shared --warm-start: the arm evaluated its own RL start
        start = [e for e in evals if e["rl_step"] == 0]
        evals = [e for e in evals if e["rl_step"] > 0]
    return (start[-1] if start else {}), evals


def _persistence_fields(
    job: _Job, first: dict[str, Any], last: dict[str, Any], rl: list[dict[str, Any]]
) -> dict[str, Any]:
    """The persistence design's extra fields of an arm's row (``{}`` for an arm without a
    level): per-split observation CE at RL start and end, their floors, and RL-phase probes."""
    probes = [m for m in rl if m.get("pg_grad_norm")]
    split = sorted({k for e in (first, last) for k in e if k.startswith(("ce_", "floor_"))})
    level = job.meta.get("level")
    if level is None:
        return {}
    return {
        "level": level,
        "model": "tiny",
        "move_ce_start": first.get("ce_walks_move"),
        "move_ce_end": last.get("ce_walks_move"),
        **{f"{k}_start": first.get(k) for k in split if k.startswith("ce_")},
        **{f"{k}_end": last.get(k) for k in split if k.startswith("ce_")},
        **{k: last.get(k) for k in split if k.startswith("floor_")},
        "zero_variance_groups": _mean("zero_variance_groups", rl),
        "echo_pg_grad_ratio": (
            sum(m["echo_grad_norm"] / m["pg_grad_norm"] for m in probes) / len(probes)
            if probes
            else None
        ),
        "echo_nll_first5": _mean("echo_nll", rl[:5]),
    }


#: The evaluation fields of each point of an arm's RL curve.
_CURVE_KEYS = (
    "rl_step",
    "eval_success_greedy",
    "eval_success_sampled",
    "heldout_hidden_ce",
    "heldout_obs_ce",
    "eval_imagined_rate",
    "eval_invalid_rate",
    "ce_walks_move",
    "ce_demos_move",
)


def _arm_row(out: Path, job: _Job, env: str) -> dict[str, Any]:
    """The result row of one finished arm: held-out numbers at RL start (its warm-start job's
    last evaluation, or with a shared ``--warm-start`` its own first one) and at the end, and the
    RL curve's landmarks."""
    first, evals = _rl_start(out, job)
    everything = [{**first, "rl_step": 0}, *evals] if first else evals
    last = max(evals, key=lambda e: e["rl_step"]) if evals else {}
    metrics = _read_jsonl(out / job.name / "metrics.jsonl")
    rl = [m for m in metrics if m.get("phase") == "rl"]
    tail = rl[-max(1, len(rl) // 5) :]
    return {
        "env": env,
        **_persistence_fields(job, first, last, rl),
        "arm": job.meta["arm"],
        "alpha": job.meta["alpha"],
        "seed": job.meta["seed"],
        "warmup": job.meta["warmup"],
        "rl_steps": int(last.get("rl_step", 0)),
        "eval_success_start": first.get("eval_success_greedy"),
        "eval_success_end": last.get("eval_success_greedy"),
        "eval_success_sampled_start": first.get("eval_success_sampled"),
        "eval_success_sampled_end": last.get("eval_success_sampled"),
        "eval_episodes": last.get("eval_episodes"),
        "steps_to_80": steps_to(everything, "eval_success_greedy", THRESHOLD),
        "eval_every": min(
            (int(e["rl_step"]) for e in everything if e["rl_step"] > 0), default=None
        ),
        # the held-out observation CE on the hidden-dependent tokens (the env's hidden_spans),
        # against its exact floor; "_all": on every observation-body token
        "heldout_obs_ce_start": first.get("heldout_hidden_ce", first.get("heldout_obs_ce")),
        "heldout_obs_ce_end": last.get("heldout_hidden_ce", last.get("heldout_obs_ce")),
        "obs_ce_floor": last.get("hidden_ce_floor", last.get("obs_ce_floor")),
        "heldout_obs_ce_all_start": first.get("heldout_obs_ce"),
        "heldout_obs_ce_all_end": last.get("heldout_obs_ce"),
        "obs_ce_all_floor": last.get("obs_ce_floor"),
        "imagined_obs_rate_start": first.get("eval_imagined_rate"),
        "imagined_obs_rate_end": last.get("eval_imagined_rate"),
        "invalid_reply_rate_start": first.get("eval_invalid_rate"),
        "invalid_reply_rate_end": last.get("eval_invalid_rate"),
        "train_reward_last20": _mean("reward", tail),
        "curve": [{k: e.get(k) for k in _CURVE_KEYS} for e in everything],
        "wall_s": None if job.wall is None else round(job.wall, 1),  # None: not run here
    }


def _level_jobs(args: argparse.Namespace, sets: list[str], base_cmd: list[str]) -> list[_Job]:
    """The persistence design: per seed one warm-start in the ordinary world; per level one
    evaluation of that warm-start in the level's world (the RL start of every arm of the level:
    same model, same world, same evaluation generator, so one evaluation is every arm's); then
    every arm of `LEVEL_ARMS` from the warm-start. Seed by seed, so a cut-off run completes whole
    paired seeds first."""
    jobs: list[_Job] = []
    for seed in args.seeds:
        warm = f"warm-base-seed{seed}"
        model = args.output_dir / warm / "final-model"
        cmd = [*base_cmd, "--seed", str(seed), "--output-dir", str(args.output_dir / warm)]
        # the warm job's closing evaluation is in the ordinary world: cut to its greedy part
        only_warm = ["train.max_steps=0", "train.plots=false", "train.eval_samples=0"]
        for item in [*sets, *only_warm]:
            cmd += ["--set", item]
        jobs.append(_Job(warm, cmd, meta={"seed": seed, "kind": "warm"}))
        for level in dict.fromkeys(level for level, *_ in LEVEL_ARMS):
            start = f"{level}-start-seed{seed}"
            cmd = [*base_cmd, "--seed", str(seed), "--output-dir", str(args.output_dir / start)]
            own = [f"model.path={model}", "warmup.steps=0", "train.max_steps=0",
                   "train.eval_at_start=true", "train.plots=false", f"env.world={seed}",
                   *LEVEL_SETS[level]]  # fmt: skip
            for item in [*sets, *own]:
                cmd += ["--set", item]
            jobs.append(_Job(start, cmd, needs=warm, meta={"seed": seed, "kind": "start"}))
        for level, arm, alpha, extra in LEVEL_ARMS:
            name = f"{level}-{arm}{'' if arm == 'grpo' else f'-{alpha:g}'}-seed{seed}"
            cmd = [*base_cmd, "--seed", str(seed), "--output-dir", str(args.output_dir / name)]
            own = [
                f"model.path={model}",
                "warmup.steps=0",
                "train.eval_at_start=false",  # the level's start job evaluated this start
                f"echo.alpha={alpha}",
                f"env.world={seed}",
                *LEVEL_SETS[level],
                *extra,
            ]
            for item in [*sets, *own]:
                cmd += ["--set", item]
            meta = {
                "seed": seed, "kind": "arm", "arm": arm, "alpha": alpha, "warmup": "base",
                "level": level,
            }  # fmt: skip
            jobs.append(_Job(name, cmd, needs=f"{level}-start-seed{seed}", meta=meta))
    return jobs


def _jobs(args: argparse.Namespace, mode: dict[str, Any], base_cmd: list[str]) -> list[_Job]:
    sets = [*mode["set"], *args.set, "train.threads=1", "train.progress=false"]
    if mode.get("levels"):
        return _level_jobs(args, sets, base_cmd)
    jobs: list[_Job] = []
    per_seed_warm_starts: list[tuple[str, float | None]] = (
        [] if args.warm_start is not None else [("base", None)]
    )
    if per_seed_warm_starts and not args.no_actobs:
        per_seed_warm_starts.append(("actobs", ACTOBS_WEIGHT))
    for seed in args.seeds:
        for warm, weight in per_seed_warm_starts:
            extra = ["train.max_steps=0", "train.plots=false"]
            if weight is not None:
                extra.append(f"warmup.obs_weight={weight}")
            name = f"warm-{warm}-seed{seed}"
            cmd = [*base_cmd, "--seed", str(seed), "--output-dir", str(args.output_dir / name)]
            for item in [*sets, *extra]:
                cmd += ["--set", item]
            jobs.append(_Job(name, cmd, meta={"seed": seed, "kind": "warm"}))
        arms = [("grpo", 0.0, "base")]
        arms += [(f"echo-{a:g}", a, "base") for a in args.alphas]
        if not args.no_actobs:
            arms.append(("actobs", 0.0, "actobs"))
        for arm, alpha, warm in arms:
            name = f"{arm}-seed{seed}"
            cmd = [*base_cmd, "--seed", str(seed), "--output-dir", str(args.output_dir / name)]
            needs: str | None
            if args.warm_start is None:
                needs = f"warm-{warm}-seed{seed}"
                model, at_start = args.output_dir / needs / "final-model", "false"
            else:  # one start for every seed; each arm evaluates it (same seed: same numbers)
                needs, warm, model, at_start = None, "shared", args.warm_start, "true"
            extra = [
                f"model.path={model}",
                "warmup.steps=0",
                f"train.eval_at_start={at_start}",  # else the warm-start's evaluation is the start
                f"echo.alpha={alpha}",
            ]
            for item in [*sets, *extra]:
                cmd += ["--set", item]
            meta = {"seed": seed, "kind": "arm", "arm": arm, "alpha": alpha, "warmup": warm}
            jobs.append(_Job(name, cmd, needs=needs, meta=meta))
    return jobs


def _run_one(args: list[str], log: str) -> int:
    """One ``echoloss-train`` run inside a worker process, its output in ``log``."""
    import contextlib
    import traceback

    from echoloss.train.command import run

    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            # a job runs from scratch: an unfinished one of a resumed experiment replaces
            # what its killed run left (the trainer refuses a used directory otherwise)
            return run([*args, "--overwrite"])
        except BaseException:  # the run failed: its log says why, the experiment goes on
            traceback.print_exc()
            return 1


def _next_job(jobs: list[_Job], lock: threading.Condition, bar: Any) -> _Job | None:
    """The next job to run, marked running: the first still to do whose needed job is done (or
    that needs none). A job whose needed job failed is marked failed instead (it cannot run).
    Waits on ``lock`` while every job left waits for a running one; None when none is left."""
    with lock:
        while True:
            by_name = {j.name: j for j in jobs}
            todo = [j for j in jobs if j.state == "todo"]
            if not todo:
                return None
            for j in todo:
                dep = by_name.get(j.needs) if j.needs else None
                if dep is not None and dep.state == "failed":
                    j.state = "failed"  # its warm-start failed: it cannot run
                    bar.update(1)
                    lock.notify_all()
                    break
                if dep is None or dep.state == "done":
                    j.state = "running"
                    return j
            else:
                lock.wait()


def _append_row(out: Path, job: _Job, env: str) -> None:
    """Append the row of the finished arm ``job`` to ``out/results.jsonl``."""
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(_arm_row(out, job, env)) + "\n")


def _args_file(out: Path, job: _Job) -> Path:
    """Where a job's command line is recorded when it starts (beside its log)."""
    return out / f"{job.name}.args.json"


def foreign_runs(jobs: list[_Job], out: Path) -> list[str]:
    """What is wrong with each finished run of ``out`` that ``--resume`` would keep: one made by
    another command line than its job's (another mode, other --set items, another --config) or
    with no record of its command (`_args_file`). Keeping it would pair this experiment's arms
    with another's warm-start, or report another experiment's arm as this one's."""
    bad = []
    for job in jobs:
        if not (out / job.name / "final-model" / "config.json").is_file():
            continue  # not finished: it runs again from the start
        record = _args_file(out, job)
        try:
            made = json.loads(record.read_text())["args"] if record.is_file() else None
        except (json.JSONDecodeError, TypeError, KeyError):
            made = []  # unreadable: not this job's
        if made is None:
            bad.append(f"{job.name} (no record of the command that made it: {record.name})")
        elif made != job.args:
            diff = [a for a in job.args if a not in made] or [a for a in made if a not in job.args]
            bad.append(f"{job.name} (made by another command; this one differs in {diff[:3]})")
    return bad


def _keep_finished(jobs: list[_Job], out: Path, env: str, bar: Any) -> None:
    """Mark done the jobs whose final model exists (a resumed experiment: not run again) and
    append the rows of those that are arms."""
    for job in jobs:
        if (out / job.name / "final-model" / "config.json").is_file():
            job.state = "done"
            bar.update(1)
            if job.meta["kind"] == "arm":
                _append_row(out, job, env)


def _work(
    jobs: list[_Job], out: Path, env: str, pool: Any, lock: threading.Condition, bar: Any
) -> None:
    """One worker thread: run the next ready job in ``pool`` until none is left, recording each
    one's wall time and state, and appending each finished arm's row."""
    while (job := _next_job(jobs, lock, bar)) is not None:
        _args_file(out, job).write_text(json.dumps({"args": job.args}))  # for --resume
        t = time.perf_counter()
        code = pool.submit(_run_one, job.args, str(out / f"{job.name}.log")).result()
        job.wall = time.perf_counter() - t
        with lock:
            job.state = "done" if code == 0 else "failed"
            if job.state == "done" and job.meta["kind"] == "arm":
                _append_row(out, job, env)
            bar.update(1)
            bar.set_postfix_str(f"last: {job.name} {job.wall:.0f}s")
            lock.notify_all()


def _run_all(
    jobs: list[_Job], out: Path, workers: int, env: str, resume: bool = False
) -> list[str]:
    """Run the jobs, ``workers`` at a time, each after the job it needs; stream finished arms'
    rows to ``results.jsonl``. With ``resume``, a job whose final model exists is not run again
    (an arm's row is rebuilt from its files). Returns the names of failed jobs."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(workers, len(jobs)))  # more workers than runs would idle
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    lock = threading.Condition()
    bar = _progress(len(jobs))
    if resume:  # finished before (a resumed experiment): not run again, its row kept
        _keep_finished(jobs, out, env, bar)
    threads = [
        threading.Thread(target=_work, args=(jobs, out, env, pool, lock, bar))
        for _ in range(workers)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    pool.shutdown()
    bar.close()
    return [j.name for j in jobs if j.state == "failed"]


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="experiment", unit="run", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# The summary


def runs_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (arm, seed): the last row written for it wins (a re-run replaces a row)."""
    keyed = {(arm_label(r), r["seed"]): r for r in rows}
    return [keyed[k] for k in sorted(keyed, key=lambda k: (k[1], k[0]))]


def _diff(rows: list[dict[str, Any]], arm: str, key: str) -> tuple[list[float], list[float]]:
    """Per-seed values of ``key`` for ``arm`` and paired differences against its GRPO arm."""
    by = {(arm_label(r), r["seed"]): r for r in rows}
    vals, diffs = [], []
    for (a, seed), r in sorted(by.items()):
        if a != arm or r.get(key) is None:
            continue
        vals.append(float(r[key]))
        ref = by.get((reference_label(arm), seed))
        if ref is not None and ref.get(key) is not None:
            diffs.append(float(r[key]) - float(ref[key]))
    return vals, diffs


# Row fields of the persistence design that the summary also averages (with paired intervals).
LEVEL_KEYS = (
    "move_ce_start",
    "move_ce_end",
    "zero_variance_groups",
    "echo_pg_grad_ratio",
    "echo_nll_first5",
)


def speed_ratio(rows: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    """The co-primary outcome: RL steps to 80 % greedy held-out success, ``arm`` against its GRPO
    arm, as the geometric mean over seeds of ``(T_arm + e) / (T_grpo + e)`` with ``e`` the
    evaluation interval (so a start already at 80 % is finite) and a censored run (never at
    80 %) counted at ``rl_steps + e``, a lower bound on its time; 95 % t interval on the log
    scale. Censoring pulls the ratio towards 1 (conservative). Below 1: ``arm`` is faster.

    Examples:
        >>> rows = [{"level": "w", "arm": "grpo", "seed": 0, "steps_to_80": None, "rl_steps": 60,
        ...          "eval_every": 10},
        ...         {"level": "w", "arm": "echo", "alpha": 0.05, "seed": 0, "steps_to_80": 20,
        ...          "rl_steps": 60, "eval_every": 10}]
        >>> r = speed_ratio(rows, "w echo 0.05")
        >>> round(r["ratio"], 4), r["n"], r["censored_arm"], r["censored_grpo"]
        (0.375, 1, 0, 1)
    """
    by = {(arm_label(r), r["seed"]): r for r in rows}
    logs, cens_arm, cens_ref = [], 0, 0
    for (a, seed), r in sorted(by.items()):
        ref = by.get((reference_label(arm), seed))
        if a != arm or ref is None:
            continue

        def t(row: dict[str, Any]) -> float:
            e = float(row.get("eval_every") or 10)
            reached = row.get("steps_to_80")
            return (float(row["rl_steps"]) + e if reached is None else float(reached)) + e

        cens_arm += r.get("steps_to_80") is None
        cens_ref += ref.get("steps_to_80") is None
        logs.append(math.log(t(r) / t(ref)))
    ci = paired_ci(logs)
    return {
        "ratio": math.exp(ci["mean"]) if logs else None,
        "lo": math.exp(ci["lo"]) if len(logs) > 1 else None,
        "hi": math.exp(ci["hi"]) if len(logs) > 1 else None,
        "n": len(logs),
        "censored_arm": cens_arm,
        "censored_grpo": cens_ref,
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: means over seeds and paired 95 % CIs of the difference against ``grpo``, for
    held-out success (greedy, sampled), its gain over RL, steps to 80 % (runs that never got
    there count as their last RL step + eval interval... reported separately as ``reached``),
    held-out observation CE and its drop."""
    for r in rows:
        for k in ("eval_success", "eval_success_sampled"):
            if r.get(f"{k}_start") is not None and r.get(f"{k}_end") is not None:
                r[f"{k}_gain"] = r[f"{k}_end"] - r[f"{k}_start"]
        if r.get("heldout_obs_ce_start") is not None and r.get("heldout_obs_ce_end") is not None:
            r["heldout_obs_ce_drop"] = r["heldout_obs_ce_start"] - r["heldout_obs_ce_end"]
            if r.get("obs_ce_floor"):
                r["obs_ce_over_floor_end"] = r["heldout_obs_ce_end"] / r["obs_ce_floor"]
        r["steps_to_80_or_censored"] = (
            r["steps_to_80"] if r.get("steps_to_80") is not None else r.get("rl_steps")
        )
    keys = [
        "eval_success_start",
        "eval_success_end",
        "eval_success_gain",
        "eval_success_sampled_start",
        "eval_success_sampled_end",
        "eval_success_sampled_gain",
        "steps_to_80_or_censored",
        "heldout_obs_ce_start",
        "heldout_obs_ce_end",
        "heldout_obs_ce_drop",
        "obs_ce_over_floor_end",
        "heldout_obs_ce_all_start",
        "heldout_obs_ce_all_end",
        "imagined_obs_rate_end",
        "invalid_reply_rate_end",
    ]
    keys += sorted({k for r in rows for k in r if k in LEVEL_KEYS or k.startswith("ce_")})
    arms = sorted({arm_label(r) for r in rows}, key=_arm_order)
    out: dict[str, Any] = {"threshold": THRESHOLD, "margin": MARGIN, "arms": {}}
    for arm in arms:
        mine = [r for r in rows if arm_label(r) == arm]
        entry: dict[str, Any] = {
            "seeds": sorted(r["seed"] for r in mine),
            "reached_80": sum(1 for r in mine if r.get("steps_to_80") is not None),
        }
        for key in keys:
            vals, diffs = _diff(rows, arm, key)
            entry[key] = {"mean": sum(vals) / len(vals) if vals else None, "n": len(vals)}
            if reference_label(arm) != arm:
                entry[key]["diff_vs_grpo"] = paired_ci(diffs)
        if reference_label(arm) != arm and any("level" in r for r in mine):
            entry["speed_ratio_vs_grpo"] = speed_ratio(rows, arm)
        out["arms"][arm] = entry
    floors = [r["obs_ce_floor"] for r in rows if r.get("obs_ce_floor") is not None]
    out["obs_ce_floor"] = floors[0] if floors else None
    return out


def _arm_order(arm: str) -> tuple[int, int, float]:
    if " " in arm:  # the persistence design: per-world arms first, GRPO, echo by λ, placebo
        level, kind, *alpha = arm.split(" ")
        rank = {"grpo": 0, "echo": 1, "placebo": 2}.get(kind, 3)
        return (0 if level == "per-world" else 1, rank, float(alpha[0]) if alpha else 0.0)
    if arm == "grpo":
        return (0, 0, 0.0)
    if arm.startswith("echo-"):
        return (0, 1, float(arm.removeprefix("echo-")))
    return (0, 2, 0.0)


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _markdown(summary: dict[str, Any]) -> str:
    def ci(d: dict[str, float] | None, scale: float = 1.0, digits: int = 3) -> str:
        if not d or d.get("n", 0) == 0:
            return "–"
        m, lo, hi = (d[k] * scale for k in ("mean", "lo", "hi"))
        return f"{m:+.{digits}f} [{_fmt(lo, digits)}, {_fmt(hi, digits)}]"

    def verdict(d: dict[str, float] | None) -> str:
        """Non-inferiority against the pre-registered margin (docs/experiment.md)."""
        if not d or d.get("n", 0) < 2:
            return "–"
        if d["lo"] > MARGIN:
            return "not worse"
        return "worse" if d["hi"] < MARGIN else "undecided"

    floor = _fmt(summary.get("obs_ce_floor"), 4)
    lines = [
        "Held-out success on the fixed held-out task set: sampled (temperature 1, the primary "
        "outcome) and greedy. Differences are paired by seed against `grpo`, mean [95 % t CI]; "
        f"verdict: non-inferiority at the margin {MARGIN:+.2f}.",
        "",
        "| arm | seeds | sampled start → end | Δ sampled end vs grpo | verdict | greedy start → end "
        "| Δ greedy end vs grpo | gain over RL: sampled, greedy | steps to 80 % greedy (reached) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arm, e in summary["arms"].items():
        d_sampled = e["eval_success_sampled_end"].get("diff_vs_grpo")
        lines.append(
            f"| {arm} | {len(e['seeds'])} | {_fmt(e['eval_success_sampled_start']['mean'])} → "
            f"{_fmt(e['eval_success_sampled_end']['mean'])} | {ci(d_sampled)} | "
            f"{verdict(d_sampled) if arm != 'grpo' else '–'} | "
            f"{_fmt(e['eval_success_start']['mean'])} → {_fmt(e['eval_success_end']['mean'])} | "
            f"{ci(e['eval_success_end'].get('diff_vs_grpo'))} | "
            f"{_fmt(e['eval_success_sampled_gain']['mean'])}, "
            f"{_fmt(e['eval_success_gain']['mean'])} | "
            f"{_fmt(e['steps_to_80_or_censored']['mean'], 1)} ({e['reached_80']}) |"
        )
    lines += [
        "",
        "Held-out observation CE (nats/token) on the hidden-dependent tokens (the direction "
        f"words) of held-out random walks, exact floor {floor}; and on every observation-body "
        "token.",
        "",
        "| arm | hidden CE start → end | drop | Δ drop vs grpo | end / floor | all-token CE "
        "start → end | imagined / invalid replies (end) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, e in summary["arms"].items():
        lines.append(
            f"| {arm} | {_fmt(e['heldout_obs_ce_start']['mean'])} → "
            f"{_fmt(e['heldout_obs_ce_end']['mean'])} | {_fmt(e['heldout_obs_ce_drop']['mean'])} | "
            f"{ci(e['heldout_obs_ce_drop'].get('diff_vs_grpo'))} | "
            f"{_fmt(e['obs_ce_over_floor_end']['mean'], 1)} | "
            f"{_fmt(e['heldout_obs_ce_all_start']['mean'])} → "
            f"{_fmt(e['heldout_obs_ce_all_end']['mean'])} | "
            f"{_fmt(e['imagined_obs_rate_end']['mean'])} / "
            f"{_fmt(e['invalid_reply_rate_end']['mean'])} |"
        )
    return "\n".join(lines) + "\n"


def non_finite_keys(value: Any, path: str = "") -> list[str]:
    """The key paths of every NaN or infinite number inside ``value`` (dicts and lists walked).

    Examples:
        >>> non_finite_keys({"a": 1.0, "b": [0.5, float("nan")], "c": {"d": float("inf")}})
        ['b[1]', 'c.d']
    """
    if isinstance(value, float):
        return [] if math.isfinite(value) else [path or "<value>"]
    if isinstance(value, dict):
        return [
            k for key, v in value.items() for k in non_finite_keys(v, f"{path}.{key}".lstrip("."))
        ]
    if isinstance(value, list):
        return [k for i, v in enumerate(value) for k in non_finite_keys(v, f"{path}[{i}]")]
    return []


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON has no NaN).

    Examples:
        >>> _finite({"a": [1.0, float("nan")], "b": {"c": float("inf")}})
        {'a': [1.0, None], 'b': {'c': None}}
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def complete_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """``(rows, seeds)``: the rows of the seeds that have every arm, and those seeds; a cut-off
    experiment's other seeds would unpair its comparisons.

    Examples:
        >>> rows = [{"arm": "grpo", "seed": 0}, {"arm": "echo-0.01", "seed": 0},
        ...         {"arm": "grpo", "seed": 1}]
        >>> complete_rows(rows)
        ([{'arm': 'grpo', 'seed': 0}, {'arm': 'echo-0.01', 'seed': 0}], [0])
    """
    arms = {arm_label(r) for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    complete = [s for s in seeds if {arm_label(r) for r in rows if r["seed"] == s} == arms]
    return [r for r in rows if r["seed"] in complete], complete


def expected_arms(args: argparse.Namespace, mode: dict[str, Any]) -> set[str]:
    """The arm labels (`arm_label`) the experiment asked for runs: the persistence design's
    `LEVEL_ARMS`, or ``grpo``, ``echo-<λ>`` for each of ``args.alphas`` and ``actobs`` unless
    ``args.no_actobs``.

    Examples:
        >>> ns = argparse.Namespace(alphas=[0.05, 0.01], no_actobs=True)
        >>> sorted(expected_arms(ns, MODES["quick"]))
        ['echo-0.01', 'echo-0.05', 'grpo']
        >>> sorted(expected_arms(ns, MODES["persistence"]))[:2]
        ['per-episode echo 0.05', 'per-episode grpo']
    """
    if mode.get("levels"):
        return {arm_label({"level": lv, "arm": a, "alpha": x}) for lv, a, x, _ in LEVEL_ARMS}
    arms = {"grpo", *(f"echo-{a:g}" for a in args.alphas)}
    return arms if args.no_actobs else arms | {"actobs"}


def _asked(args: argparse.Namespace, mode: dict[str, Any]) -> str:
    """The experiment asked for, in the command line's words (for messages)."""
    if mode.get("levels"):
        return f"--mode {args.mode}"
    no_actobs = " --no-actobs" if args.no_actobs else ""
    return f"--mode {args.mode} --alphas {' '.join(f'{a:g}' for a in args.alphas)}{no_actobs}"


def _write_summary(out: Path, args: argparse.Namespace, mode: dict[str, Any]) -> int:
    try:
        rows = runs_table(
            check_rows(
                read_results(out / "results.jsonl"),
                arms=expected_arms(args, mode),
                seeds=args.seeds if args.seeds_given else None,
                asked=_asked(args, mode),
            )
        )
    except RowsError as err:
        print(f"echo_experiment: {err}", file=sys.stderr)
        return 2
    if not rows:
        print(
            f"echo_experiment: no finished runs in {str(out)!r} (no results.jsonl rows); "
            "run the experiment first",
            file=sys.stderr,
        )
        return 2
    bad = [(r, keys) for r in rows if (keys := non_finite_keys(r))]
    if bad:
        named = "; ".join(
            f"{arm_label(r)} seed {r.get('seed')}: {', '.join(keys[:4])}" for r, keys in bad[:5]
        )
        print(
            f"echo_experiment: {len(bad)} run(s) in {str(out)!r} have non-finite "
            f"numbers ({named}); a mean or interval over them is not a number. Find why the run "
            "diverged (its metrics.jsonl), then rerun it (delete its directory and run with "
            "--resume) before summarising",
            file=sys.stderr,
        )
        return 2
    paired, complete = complete_rows(rows)
    seeds = sorted({r["seed"] for r in rows})
    if complete != seeds:  # a cut-off experiment: compare arms on the same seeds only
        partial = sorted(set(seeds) - set(complete))
        print(f"summary and figures over the complete seeds {complete}; seeds {partial} have "
              "only some arms (their rows stay in results.json)")  # fmt: skip
    summary = _finite(summarize(paired))  # an interval of one seed is undefined: null
    summary["complete_seeds"] = complete
    (out / "results.json").write_text(
        json.dumps(
            [{k: v for k, v in r.items() if k != "curve"} | {"curve": r["curve"]} for r in rows],
            indent=1,
            allow_nan=False,
        )
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    if any(r.get("level") for r in paired):  # the persistence design: its own tables, figures
        from echo_experiment import persistence

        md = persistence.markdown(summary)
        (out / "summary.md").write_text(md)
        figures = persistence.plots(paired, summary, out)
        print(md)
        print(f"wrote {out}/results.json, summary.json, summary.md, "
              f"{', '.join(f.name for f in figures)}")  # fmt: skip
        return 0
    md = _markdown(summary)
    (out / "summary.md").write_text(md)
    figures = write_figures(paired, out)
    print(md)
    print(f"wrote {out}/results.json, summary.json, summary.md, "
          f"{', '.join(f.name for f in figures)}")  # fmt: skip
    return 0


def _parser() -> argparse.ArgumentParser:
    """The ``python examples/research/echo_experiment/run.py`` command line."""
    p = argparse.ArgumentParser(
        prog="examples/research/echo_experiment/run.py", description=__doc__.split("::")[0]
    )
    p.add_argument("--config", help="base TOML (default: the embedded default)")
    p.add_argument("--output-dir", type=Path, default=Path("runs/echo-experiment"))
    p.add_argument("--mode", choices=sorted(MODES), default="quick")
    p.add_argument("--seeds", type=int, nargs="+", help="default: the mode's")
    p.add_argument(
        "--alphas", type=float, nargs="+", help="λ of the echo arms (default: the mode's)"
    )
    p.add_argument("--no-actobs", action="store_true", help="leave out the ActObs-style arm")
    p.add_argument("--jobs", type=int, help="runs at a time (each uses one CPU thread; default 2)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run"
    )
    p.add_argument(
        "--warm-start",
        type=Path,
        metavar="MODEL_DIR",
        help="start every seed's arms from this model directory (e.g. a longer warm-up's "
        "final-model) instead of a warm-start per seed; needs --no-actobs",
    )
    p.add_argument("--summarize-only", action="store_true", help="only rebuild tables and figures")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs of --output-dir whose final model exists (a cut-off experiment "
        "continued with the same arguments); the others run from the start",
    )
    return p


def _numbers_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--alphas``, ``--seeds`` or ``--jobs`` (None: nothing)."""
    if not all(math.isfinite(a) and a > 0 for a in args.alphas):
        return (f"echo_experiment: --alphas must be finite and > 0 (got {args.alphas}); "
                "λ = 0 is the grpo arm, always run")  # fmt: skip
    from echoloss.train.config import MAX_SEED

    if not all(0 <= s <= MAX_SEED for s in args.seeds):
        return (f"echo_experiment: --seeds must be in [0, {MAX_SEED}] (got "
                f"{args.seeds})")  # fmt: skip
    for name, values in (("--seeds", args.seeds), ("--alphas", [f"{a:g}" for a in args.alphas])):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            return (f"echo_experiment: {name} lists {twice} more than once: two jobs "
                    "would write the same run directories; list each once")  # fmt: skip
    if args.jobs < 1:
        return f"echo_experiment: --jobs must be >= 1 (got {args.jobs})"
    return None


def _ignored_error(args: argparse.Namespace, mode: dict[str, Any]) -> str | None:
    """The first flag on the command line that this command would ignore (None: none): the
    persistence design's arms and warm-starts are fixed, and ``--summarize-only`` runs nothing.
    Call before the mode's defaults are filled in."""
    given = {
        "--alphas": args.alphas is not None,
        "--no-actobs": args.no_actobs,
        "--warm-start": args.warm_start is not None,
        "--jobs": args.jobs is not None,
        "--set": bool(args.set),
        "--config": args.config is not None,
        "--resume": args.resume,
    }
    if mode.get("levels"):
        for flag in ("--alphas", "--no-actobs", "--warm-start"):
            if given[flag]:
                return (f"echo_experiment: {flag} does not apply to --mode {args.mode}: the "
                        "persistence design's arms (echo at its pre-registered λ, the placebo) "
                        "and its one warm-start per seed are fixed; leave it out")  # fmt: skip
    if args.summarize_only:
        for flag in ("--warm-start", "--jobs", "--set", "--config", "--resume"):
            if given[flag]:
                return (f"echo_experiment: --summarize-only runs nothing, so {flag} would be "
                        "ignored; leave it out (--mode, --alphas, --no-actobs and --seeds say "
                        "which rows belong to the experiment)")  # fmt: skip
    return None


#: ``--set`` keys that every run of the experiment sets itself (a user's value would be
#: overridden in every run), with what sets them instead.
FIXED_KEYS = {
    "echo.alpha": "each arm sets its own λ (--alphas)",
    "train.seed": "each run's seed is one of --seeds",
    "train.output_dir": "each run's directory is inside --output-dir",
    "model.path": "each arm starts from its warm-start (--warm-start: one start for all)",
    "train.threads": "each run uses one CPU thread (--jobs: how many run at once)",
    "train.progress": "the runs' progress bars are off (the experiment shows its own)",
    "train.eval_at_start": "the experiment evaluates each arm's start once, where it is made",
}
#: The same for the persistence design's runs.
FIXED_LEVEL_KEYS = {
    "env.world": "each seed's world is the seed itself",
    "env.level": "each arm's level is the design's (LEVEL_ARMS)",
    "echo.span": "the placebo arm sets it, the others echo the whole observation",
}


def _set_error(args: argparse.Namespace, mode: dict[str, Any]) -> str | None:
    """What is wrong with a ``--set`` item (None: nothing): not ``KEY=VALUE``, or a key that
    every run sets itself (`FIXED_KEYS`), so the value would be silently overridden."""
    fixed = FIXED_KEYS | (FIXED_LEVEL_KEYS if mode.get("levels") else {})
    for item in args.set:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            return f"echo_experiment: --set expects KEY=VALUE, got {item!r}"
        if key.strip() in fixed:
            return (f"echo_experiment: --set {item!r} would be overridden in every run: "
                    f"{fixed[key.strip()]}; leave it out")  # fmt: skip
    return None


def _overrides(items: list[str]) -> dict[str, Any]:
    """``--set`` items as the trainer's command line reads them (JSON values where they parse)."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, text = item.partition("=")
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


def _warm_start_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--warm-start`` for a run (None: nothing, or not given, or only
    summarising); when it is right, resolves it to an absolute path."""
    if args.warm_start is not None and not args.summarize_only:
        if not args.no_actobs:
            return ("echo_experiment: --warm-start gives every arm the same start, but "
                    "the actobs arm is defined by its own warm-start; add --no-actobs")  # fmt: skip
        if not (args.warm_start / "config.json").is_file():
            return (f"echo_experiment: --warm-start {str(args.warm_start)!r} is not a "
                    "model directory (no config.json); pass a run's final-model directory")  # fmt: skip
        args.warm_start = args.warm_start.resolve()
    return None


def _plan(
    args: argparse.Namespace, mode: dict[str, Any], env_name: str, n_jobs: int, out: Path
) -> str:
    """The line that announces the experiment: env, seeds, arms, runs, and where logs go."""
    arms = (
        ", ".join(f"{lv} {a}{'' if a == 'grpo' else f' {x:g}'}" for lv, a, x, _ in LEVEL_ARMS)
        if mode.get("levels")
        else f"λ {args.alphas}{'' if args.no_actobs else ' + actobs'}"
    )
    return (
        f"experiment ({args.mode}): env {env_name}, seeds {args.seeds}, arms: {arms}"
        f"{'' if args.warm_start is None else f', every arm from {str(args.warm_start)!r}'}; "
        f"{n_jobs} runs, {args.jobs} at a time; "
        f"logs in {out}/*.log, rows streamed to {out}/results.jsonl"
    )


def _run_experiment(args: argparse.Namespace, mode: dict[str, Any], out: Path) -> int:
    """Run every job of the experiment into ``out``, then write its summary. Returns the exit
    code: 2 on a bad config, 1 when a run failed, else the summary's."""
    from echoloss.train.config import ConfigError, load_config
    from echoloss.train.presets import resolve_config

    try:  # the mode's and the command line's --set items, validated once before any run
        base = load_config(resolve_config(args.config), _overrides([*mode["set"], *args.set]))
    except (ConfigError, FileNotFoundError) as err:
        print(f"echo_experiment: {err}", file=sys.stderr)
        return 2
    base_cmd: list[str] = []
    if args.config:
        base_cmd += ["--config", args.config]
    jobs = _jobs(args, mode, base_cmd)
    if args.resume and (foreign := foreign_runs(jobs, out)):  # before anything is written
        print(f"echo_experiment: --resume would keep {len(foreign)} finished run(s) of "
              f"{str(out)!r} that this command did not make: {'; '.join(foreign[:4])}. Resume "
              "with the arguments that made them, or delete those run directories (or use "
              "another --output-dir)", file=sys.stderr)  # fmt: skip
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").unlink(missing_ok=True)
    env_name = base.env.name  # with the --set items: --set env.name=... runs a control
    print(_plan(args, mode, env_name, len(jobs), out), flush=True)
    t = time.perf_counter()
    failed = _run_all(jobs, out, args.jobs, env_name, resume=args.resume)
    print(f"{len(jobs) - len(failed)}/{len(jobs)} runs finished in {time.perf_counter() - t:.0f}s")
    if failed:
        print(f"echo_experiment: runs failed, see {[f + '.log' for f in failed]}",
              file=sys.stderr)  # fmt: skip
    code = _write_summary(out, args, mode)
    return 1 if failed else code


def main(argv: list[str] | None = None) -> int:
    """``python examples/research/echo_experiment/run.py``: check the arguments, then run the experiment (or with
    ``--summarize-only`` only rebuild its tables and figures). Returns the exit code."""
    args = _parser().parse_args(argv)
    mode = MODES[args.mode]
    ignored = _ignored_error(args, mode)
    if ignored is not None:
        print(ignored, file=sys.stderr)
        return 2
    args.seeds_given = args.seeds is not None
    args.seeds = args.seeds if args.seeds is not None else mode["seeds"]
    args.alphas = args.alphas if args.alphas is not None else mode["alphas"]
    args.jobs = args.jobs if args.jobs is not None else 2
    error = _numbers_error(args) or _set_error(args, mode) or _warm_start_error(args)
    out: Path = args.output_dir
    if error is None and out.exists() and not out.is_dir():
        error = (f"echo_experiment: --output-dir {str(out)!r} is a file, not a directory; "
                 "pass a directory (it is created when missing)")  # fmt: skip
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    if args.summarize_only:
        return _write_summary(out, args, mode)
    return _run_experiment(args, mode, out)
