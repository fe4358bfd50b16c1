"""The world-model 2×2 in one command: per seed a warm-start, a world-model stage and its sham
(`echo_experiment.world_model`), an evaluation of each start, and four RL arms (each start ×
{GRPO, GRPO + echo}); one row per start × arm × seed (`echo_experiment.world_model_report`).

::

    python examples/research/echo_experiment/run.py world-model-2x2 --output-dir runs/wm2x2 --jobs 1
    python examples/research/echo_experiment/run.py world-model-2x2 --output-dir runs/wm2x2 --resume

Jobs run seed by seed (`plan`), ``--jobs`` at a time in worker processes (one CPU thread each).
A finished arm's row goes to ``results.jsonl`` at once and to ``<arm>/row.json``; every job
leaves ``<job>.log`` and ``<job>.commit.json`` (the code commit it ran) beside its directory. ``--resume``
continues a cut-off run in the same ``--output-dir``: a job whose ``final-model`` exists is kept
(an arm's row is read back from its ``row.json``), an RL arm cut off after a checkpoint continues
from it (``echoloss-train --resume``), anything else runs again from its start. The code commit
(``git rev-parse HEAD``, and whether the tree had uncommitted changes) is recorded in
``run.json`` when the run starts and in every row; ``--resume`` refuses another commit, so no
run mixes code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echo_experiment.world_model import StageConfig
from echo_experiment.world_model_report import (
    ALPHA,
    EVAL_EVERY,
    RL_STEPS,
    SEEDS,
    THRESHOLD,
    WORLDS,
    cell,
)

__all__ = [
    "SHAM_WALKS",
    "STAGE",
    "arm_row",
    "code_commit",
    "gated_plan",
    "job_commit",
    "main",
    "plan",
    "steps_to",
]

REPO = Path(__file__).resolve().parents[3]
#: The stage of both starts (the pilot's choice: docs/experiment.md, "The pilot").
STAGE = StageConfig(
    steps=150, peak_lr=1e-2, warmup_steps=20, batch=32, eval_every=10, keep_policy=True
)
#: The sham's walks (`echo_experiment.world_model.WALKS`; the pilot's choice).
SHAM_WALKS = "shuffled"
#: Every trainer run of the design: the per-world mirrorgrid with its own direction words.
ENV_SET = ["env.name=mirrorgrid", "env.words=compass", "env.level=per-world"]
RUN_SET = ["train.threads=1", "train.progress=false", "train.plots=false"]


@dataclass
class Job:
    """One run: ``kind`` ``"train"`` (``echoloss-train`` with ``args``) or ``"stage"``
    (`echo_experiment.world_model.main` with ``args``), after the job ``needs``."""

    name: str
    kind: str
    args: list[str]
    needs: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    state: str = "todo"  # todo, running, done, failed
    wall: float | None = None


def _train(out: Path, name: str, seed: int, world: int, sets: list[str]) -> list[str]:
    """The ``echoloss-train`` arguments of job ``name``."""
    args = ["--seed", str(seed), "--output-dir", str(out / name)]
    for item in [*ENV_SET, f"env.world={world}", *RUN_SET, *sets]:
        args += ["--set", item]
    return args


def gated_plan(out: Path, seeds: list[int], first: Path) -> list[Job]:
    """The gated design's jobs for ``seeds``, from the first run ``first`` (its warm-starts and
    first stage rounds, reused): ``stage-world-model-seed<s>`` (`world_model_gate`: rounds until
    the gate), ``stage-sham-seed<s>`` (as many rounds, after it), the two start evaluations and
    the four arms, as in `plan`.

    Examples:
        >>> [j.name for j in gated_plan(Path("o"), [5], Path("v1"))][:4]
        ['stage-world-model-seed5', 'start-world-model-seed5', 'stage-sham-seed5', 'start-sham-seed5']
    """
    jobs = []
    for job in plan(out, seeds):
        seed = job.meta["seed"]
        if job.meta["kind"] == "warm":
            continue
        if job.meta["kind"] == "stage":
            start = "world-model" if job.name.startswith("stage-world-model") else "sham"
            walks = "world" if start == "world-model" else SHAM_WALKS
            args = [str(first / f"warm-seed{seed}" / "final-model"), str(out / job.name),
                    "--world", str(WORLDS[seed]), "--walks", walks, "--seed", str(seed),
                    "--first-round", str(first / job.name)]  # fmt: skip
            needs = None
            if start == "sham":  # as many rounds as the world-model stage ran
                needs = f"stage-world-model-seed{seed}"
                args += ["--rounds-like", str(out / needs)]
            job = Job(job.name, "gated-stage", args, needs=needs, meta=job.meta)
        jobs.append(job)
    return jobs


def plan(out: Path, seeds: list[int], stage: StageConfig = STAGE) -> list[Job]:
    """The jobs, seed by seed: ``warm-seed<s>`` (80 SFT steps in the ordinary world, the
    trainer's default warm-up), ``stage-<start>-seed<s>`` (the stage from it),
    ``start-<start>-seed<s>`` (held-out evaluation of the stage's model in the seed's world: the
    RL start of both arms), ``<start>-<arm>-seed<s>`` (`RL_STEPS` RL steps from the stage's model).

    Examples:
        >>> [j.name for j in plan(Path("o"), [3])][:4]
        ['warm-seed3', 'stage-world-model-seed3', 'start-world-model-seed3', 'stage-sham-seed3']
    """
    jobs = []
    for seed in seeds:
        world = WORLDS[seed]
        warm = f"warm-seed{seed}"
        jobs.append(Job(warm, "train", _train(out, warm, seed, world,
                        ["train.max_steps=0", "train.eval_samples=0"]),
                        meta={"seed": seed, "kind": "warm"}))  # fmt: skip
        for start in ("world-model", "sham"):
            stage_name = f"stage-{start}-seed{seed}"
            walks = "world" if start == "world-model" else SHAM_WALKS
            args = [str(out / warm / "final-model"), str(out / stage_name), "--walks", walks,
                    "--world", str(world),
                    "--seed", str(seed), "--steps", str(stage.steps), "--lr", str(stage.peak_lr),
                    "--warmup-steps", str(stage.warmup_steps), "--batch", str(stage.batch),
                    "--eval-every", str(stage.eval_every), "--demos", str(stage.demos),
                    *(["--keep-policy"] if stage.keep_policy else [])]  # fmt: skip
            jobs.append(
                Job(stage_name, "stage", args, needs=warm, meta={"seed": seed, "kind": "stage"})
            )
            model = out / stage_name / "final-model"
            start_name = f"start-{start}-seed{seed}"
            sets = [f"model.path={model}", "warmup.steps=0", "train.max_steps=0",
                    "train.eval_at_start=true", "train.eval_samples=16"]  # fmt: skip
            jobs.append(Job(start_name, "train", _train(out, start_name, seed, world, sets),
                            needs=stage_name, meta={"seed": seed, "kind": "start"}))  # fmt: skip
        for start in ("world-model", "sham"):
            model = out / f"stage-{start}-seed{seed}" / "final-model"
            for arm in ("grpo", "echo"):
                alpha = ALPHA if arm == "echo" else 0.0
                name = f"{start}-{arm}-seed{seed}"
                sets = [f"model.path={model}", "warmup.steps=0", f"train.max_steps={RL_STEPS}",
                        f"train.eval_every={EVAL_EVERY}", "train.eval_at_start=false",
                        "train.eval_samples=16", f"echo.alpha={alpha}"]  # fmt: skip
                meta = {"seed": seed, "kind": "arm", "start": start, "arm": arm, "alpha": alpha,
                        "world": world}  # fmt: skip
                jobs.append(Job(name, "train", _train(out, name, seed, world, sets),
                                needs=f"start-{start}-seed{seed}", meta=meta))  # fmt: skip
    return jobs


def code_commit(repo: Path = REPO) -> dict[str, Any]:
    """``{"commit": sha, "dirty": bool}`` of the git checkout ``repo`` (``dirty``: tracked files
    differ from the commit); ``{"commit": None, "dirty": None}`` outside a checkout."""
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True,
                                check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha, "dirty": bool(status.strip())}


def job_commit(out: Path, name: str) -> dict[str, Any]:
    """The code commit job ``name`` of ``out`` ran (``<name>.commit.json``); ``{"commit": None,
    "dirty": None}`` when it left none."""
    path = out / f"{name}.commit.json"
    if not path.is_file():
        return {"commit": None, "dirty": None}
    got: dict[str, Any] = json.loads(path.read_text())
    return {"commit": got.get("commit"), "dirty": got.get("dirty")}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def steps_to(evals: list[dict[str, Any]], threshold: float = THRESHOLD) -> int | None:
    """The first RL step whose greedy held-out success is at least ``threshold`` (None: never).

    Examples:
        >>> steps_to([{"rl_step": 0, "eval_success_greedy": 0.5},
        ...           {"rl_step": 20, "eval_success_greedy": 0.85}])
        20
    """
    for e in sorted(evals, key=lambda e: e["rl_step"]):
        if e.get("eval_success_greedy", -1.0) >= threshold:
            return int(e["rl_step"])
    return None


_CURVE = ("rl_step", "eval_success_greedy", "eval_success_sampled", "ce_walks_move",
          "eval_invalid_rate")  # fmt: skip


def arm_row(out: Path, job: Job, commit: dict[str, Any]) -> dict[str, Any]:
    """The row of the finished arm ``job``: its start's evaluation (RL step 0) and its own (RL
    steps `EVAL_EVERY`, …, `RL_STEPS`), the stage that made its start, and ``commit``."""
    m = job.meta
    first = next(e for e in _jsonl(out / f"start-{m['start']}-seed{m['seed']}" / "eval.jsonl")
                 if e["rl_step"] == 0)  # fmt: skip
    evals = [e for e in _jsonl(out / job.name / "eval.jsonl") if e["rl_step"] > 0]
    last = max(evals, key=lambda e: e["rl_step"])
    stage = _jsonl(out / f"stage-{m['start']}-seed{m['seed']}" / "stage.jsonl")
    curve = [{**first, "rl_step": 0}, *sorted(evals, key=lambda e: e["rl_step"])]
    return {
        "level": "per-world",
        "start": m["start"],
        "arm": m["arm"],
        "alpha": m["alpha"],
        "seed": m["seed"],
        "world": m["world"],
        "stage_walks": stage[-1].get("walks") if stage else None,
        "eval_success_start": first.get("eval_success_sampled"),
        "eval_success_end": last.get("eval_success_sampled"),
        "eval_success_greedy_start": first.get("eval_success_greedy"),
        "eval_success_greedy_end": last.get("eval_success_greedy"),
        "move_ce_start": first.get("ce_walks_move"),
        "move_ce_end": last.get("ce_walks_move"),
        "steps_to_80": steps_to(curve),
        "invalid_start": first.get("eval_invalid_rate"),
        "invalid_end": last.get("eval_invalid_rate"),
        "rl_steps": int(last["rl_step"]),
        "eval_every": EVAL_EVERY,
        "stage_steps": stage[-1]["step"] if stage else None,
        "stage_tokens": stage[-1]["tokens"] if stage else None,
        "stage_move_ce_end": stage[-1].get("ce_walks_move") if stage else None,
        "stage_rounds": stage[-1].get("round", 1) if stage else None,
        "curve": [{k: e.get(k) for k in _CURVE} for e in curve],
        "commit": commit["commit"],
        "dirty": commit["dirty"],
        "wall_s": None if job.wall is None else round(job.wall, 1),
    }


def _run_one(kind: str, args: list[str], log: str) -> int:
    """One job inside a worker process, its output in ``log``."""
    import contextlib
    import traceback

    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            if kind == "stage":
                from echo_experiment.world_model import main as stage_main

                return stage_main(args)
            if kind == "gated-stage":
                from echo_experiment.world_model_gate import stage_main as gated_main

                return gated_main(args)
            from echoloss.train.command import run

            return run(args)
        except BaseException:  # the job failed: its log says why, the others go on
            traceback.print_exc()
            return 1


def _done(out: Path, job: Job) -> bool:
    return (out / job.name / "final-model" / "config.json").is_file()


def _next(jobs: list[Job], lock: threading.Condition) -> Job | None:
    """The first job still to do whose needed job is done, marked running (a job whose needed
    job failed is marked failed); waits while every job left waits; None when none is left."""
    with lock:
        while True:
            by = {j.name: j for j in jobs}
            todo = [j for j in jobs if j.state == "todo"]
            if not todo:
                return None
            for j in todo:
                dep = by.get(j.needs) if j.needs else None
                if dep is not None and dep.state == "failed":
                    j.state = "failed"
                    lock.notify_all()
                    break
                if dep is None or dep.state == "done":
                    j.state = "running"
                    return j
            else:
                lock.wait()


def _finish(out: Path, job: Job, commit: dict[str, Any]) -> None:
    """Record a finished arm's row (``row.json`` and a line of ``results.jsonl``)."""
    row = arm_row(out, job, commit)
    (out / job.name / "row.json").write_text(json.dumps(row, indent=1))
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"row: {cell(row)} seed {row['seed']}: sampled success {row['eval_success_end']}, "
          f"move CE {row['move_ce_start']} -> {row['move_ce_end']}, {job.wall:.0f}s", flush=True)  # fmt: skip


def job_arguments(out: Path, job: Job) -> list[str]:
    """``job``'s arguments for this attempt: a training job cut off after a checkpoint continues
    from it (``--resume``); one cut off before its first checkpoint left metrics but nothing to
    continue from, so it runs again from its start over them (``--overwrite``: the trainer
    refuses a used output directory otherwise, and the job would fail on every resume)."""
    args = list(job.args)
    run_dir = out / job.name
    if job.kind != "train" or not run_dir.is_dir():
        return args
    if (run_dir / "checkpoints" / "latest").exists():
        return [*args, "--resume"]
    if any(run_dir.iterdir()):
        return [*args, "--overwrite"]
    return args


def _work(
    jobs: list[Job], out: Path, pool: Any, lock: threading.Condition, commit: dict[str, Any]
) -> None:
    while (job := _next(jobs, lock)) is not None:
        args = job_arguments(out, job)
        print(f"start {job.name}", flush=True)
        (out / f"{job.name}.commit.json").write_text(json.dumps(commit))  # the code it ran
        t = time.perf_counter()
        code = pool.submit(_run_one, job.kind, args, str(out / f"{job.name}.log")).result()
        job.wall = time.perf_counter() - t
        with lock:
            job.state = "done" if code == 0 and _done(out, job) else "failed"
            print(f"{job.state} {job.name} ({job.wall:.0f}s)", flush=True)
            if job.state == "done" and job.meta["kind"] == "arm":
                _finish(out, job, commit)
            lock.notify_all()


def run_all(jobs: list[Job], out: Path, workers: int, commit: dict[str, Any]) -> list[str]:
    """Run the jobs not yet done, ``workers`` at a time; returns the names of failed ones."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    for job in jobs:
        if _done(out, job):
            job.state = "done"
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    lock = threading.Condition()
    threads = [threading.Thread(target=_work, args=(jobs, out, pool, lock, commit))
               for _ in range(workers)]  # fmt: skip
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    pool.shutdown()
    return [j.name for j in jobs if j.state == "failed"]


def _rows(out: Path, jobs: list[Job]) -> list[dict[str, Any]]:
    """Every finished arm's row (from its ``row.json``), in plan order."""
    return [json.loads((out / j.name / "row.json").read_text()) for j in jobs
            if j.meta["kind"] == "arm" and (out / j.name / "row.json").is_file()]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run (or with ``--resume`` continue) the 2×2 into ``--output-dir``; at the end write
    ``results.json`` (every finished arm's row). Returns 0, 1 when a job failed, 2 on bad
    arguments."""
    p = argparse.ArgumentParser(prog="run.py world-model-2x2", description=__doc__.split("::")[0])
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (one CPU thread each)")
    p.add_argument("--resume", action="store_true", help="continue a cut-off run in --output-dir")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                   help="default: the pre-registered 0-11 (others give no verdict)")  # fmt: skip
    p.add_argument("--gated-from", type=Path, default=None,
                   help="the gated design: each stage in rounds until the gate "
                   "(echo_experiment.world_model_gate), from this first run's warm-starts and "
                   "first rounds")  # fmt: skip
    args = p.parse_args(argv)
    out: Path = args.output_dir
    if args.jobs < 1:
        print(f"world-model-2x2: --jobs must be >= 1 (got {args.jobs})", file=sys.stderr)
        return 2
    bad = [s for s in args.seeds if s not in range(len(WORLDS))]
    if bad or len(set(args.seeds)) != len(args.seeds):
        print(f"world-model-2x2: --seeds must be distinct seeds of 0-{len(WORLDS) - 1} (the "
              f"seeds with a world), got {args.seeds}", file=sys.stderr)  # fmt: skip
        return 2
    if args.gated_from is not None and not (args.gated_from / "run.json").is_file():
        print(f"world-model-2x2: --gated-from {str(args.gated_from)!r} holds no run (no "
              "run.json); pass the first run's --output-dir", file=sys.stderr)  # fmt: skip
        return 2
    commit = code_commit()
    meta = out / "run.json"
    if meta.is_file():
        before = json.loads(meta.read_text())
        if not args.resume:
            print(f"world-model-2x2: {str(out)!r} holds a run already; continue it with "
                  "--resume, or pick another --output-dir", file=sys.stderr)  # fmt: skip
            return 2
        gated = None if args.gated_from is None else str(args.gated_from)
        if before.get("gated_from") != gated:
            print(f"world-model-2x2: {str(out)!r} was run with --gated-from "
                  f"{before.get('gated_from')}, not {gated}; resume it as it was started",
                  file=sys.stderr)  # fmt: skip
            return 2
        if before["commit"] != commit["commit"] or before["dirty"] != commit["dirty"]:
            print(f"world-model-2x2: {str(out)!r} was run at commit {before['commit']} (dirty "
                  f"{before['dirty']}), this checkout is {commit['commit']} (dirty "
                  f"{commit['dirty']}); resume it from a checkout of that commit",
                  file=sys.stderr)  # fmt: skip
            return 2
    else:
        out.mkdir(parents=True, exist_ok=True)
        gated = None if args.gated_from is None else str(args.gated_from)
        meta.write_text(json.dumps({**commit, "seeds": args.seeds, "gated_from": gated}, indent=1))
    jobs = plan(out, args.seeds) if args.gated_from is None else gated_plan(
        out, args.seeds, args.gated_from)  # fmt: skip
    print(f"world-model 2x2: seeds {args.seeds}, {len(jobs)} jobs, {args.jobs} at a time, "
          f"commit {commit['commit']} (dirty {commit['dirty']}); logs in {out}/*.log",
          flush=True)  # fmt: skip
    failed = run_all(jobs, out, args.jobs, commit)
    rows = _rows(out, jobs)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} of {4 * len(args.seeds)} arms finished; rows in {out}/results.json")
    if failed:
        print(f"world-model-2x2: failed: {failed} (see their .log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
