"""The pretrained model's learning curve: GRPO and GRPO + echo on SmolLM2-135M-Instruct, several
seeds, ``configs/pretrained-learn.toml``, one run at a time, resumable.

    python scripts/pretrained_learning.py [--seeds 0 1 2] [--arms grpo echo] [--steps 30]
        [--results docs/pretrained/learning/results.json] [--out runs/pretrained-learning]
        [--jobs 1]

Each (seed, arm) trains in ``OUT/<arm>-seed<seed>`` (``grpo``: ``echo.alpha = 0``; ``echo``: the
config's λ). After every step, the run's new evaluations (``eval.jsonl``: greedy success on the
held-out questions, well-formed-call rate, held-out result CE and error CE) become rows of
``--results``, one per (seed, arm, RL step), rewritten atomically, each with the code commit.
Run it again to go on: a finished run is skipped, an interrupted one resumes from its last
checkpoint (every evaluation), and rows already there are kept. ``--jobs N`` trains N runs at
once, each in its own process on the config's one thread (N = the machine's cores, and
about 12 GB of memory per run at its peak, measured on CPU); the rows
file is updated under a lock (``<results>.lock``), so no run's rows overwrite another's. The protocol, and what counts
as learning, is ``docs/pretrained.md``'s; run it from a frozen worktree
(``git worktree add --detach DIR COMMIT``) so that the code under a running experiment does not
change.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"grpo": {"echo.alpha": 0.0}, "echo": {}}
#: eval.jsonl key -> row key
FIELDS = {
    "eval_n": "eval_n",
    "eval_success_greedy": "eval_success",
    "eval_valid_call_rate": "valid_call_rate",
    "heldout_result_ce": "result_ce",
    "heldout_error_ce": "error_ce",
    "eval_time": "eval_time",  # seconds: how long the evaluation took (for sizing)
}


def commit() -> str:
    """The code's commit (``+dirty`` when the tree differs from it)."""
    sha = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "echoloss", "configs", "scripts"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout.strip()  # fmt: skip
    return sha + ("+dirty" if dirty else "")


def read_rows(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.is_file() else []


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Rows sorted by (seed, arm, RL step), written to a temporary file renamed into place."""
    rows = sorted(rows, key=lambda r: (r["seed"], r["arm"], r["rl_step"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, path)


def eval_rows(run_dir: Path, seed: int, arm: str, code: str) -> list[dict[str, Any]]:
    """The run's evaluations as result rows."""
    path = run_dir / "eval.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        row: dict[str, Any] = {"seed": seed, "rl_step": e["rl_step"], "arm": arm}
        row.update({ours: e.get(theirs) for theirs, ours in FIELDS.items()})
        row["eval_n"] = int(row["eval_n"]) if row["eval_n"] is not None else None
        row["commit"] = code
        rows.append(row)
    return rows


@contextlib.contextmanager
def locked(results: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<results>.lock`` (runs in other processes wait for it)."""
    results.parent.mkdir(parents=True, exist_ok=True)
    with open(results.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sync(results: Path, run_dir: Path, seed: int, arm: str, code: str) -> None:
    """Add the run's evaluations not yet in ``results`` (read and rewritten under the lock)."""
    with locked(results):
        rows = read_rows(results)
        have = {(r["seed"], r["arm"], r["rl_step"]) for r in rows}
        new = [r for r in eval_rows(run_dir, seed, arm, code)
               if (seed, arm, r["rl_step"]) not in have]  # fmt: skip
        if new:
            write_rows(results, rows + new)


def run_one(args: argparse.Namespace, seed: int, arm: str, code: str) -> None:
    from echoloss.train.config import load_config
    from echoloss.train.recipe import train

    out = Path(args.out) / f"{arm}-seed{seed}"
    results = Path(args.results)
    done = {r["rl_step"] for r in read_rows(results) if r["seed"] == seed and r["arm"] == arm}
    if args.steps in done:
        print(f"{arm} seed {seed}: finished", flush=True)
        return
    overrides = {
        "train.seed": seed,
        "train.max_steps": args.steps,
        "train.output_dir": str(out),
        "train.progress": False,
        **ARMS[arm],
    }
    resume = out if (out / "checkpoints" / "latest").exists() else None  # its last checkpoint
    if resume is None and out.exists():  # stopped before its first checkpoint: start it again
        overrides["train.overwrite"] = True
    cfg = load_config(args.config, overrides)

    def log(line: str) -> None:
        print(f"{arm} seed {seed}: {line}", flush=True)
        sync(results, out, seed, arm, code)

    train(cfg, resume=resume, log=log)
    sync(results, out, seed, arm, code)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "pretrained-learn.toml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--results", default=str(ROOT / "docs/pretrained/learning/results.json"))
    ap.add_argument("--out", default=str(ROOT / "runs" / "pretrained-learning"))
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, one process each")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1 (got {args.jobs})")
    code = commit()
    runs = [(seed, arm) for seed in args.seeds for arm in args.arms]
    if args.jobs == 1:
        for seed, arm in runs:
            run_one(args, seed, arm, code)
        return 0
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(runs))) as pool:
        for done in [pool.submit(run_one, args, seed, arm, code) for seed, arm in runs]:
            done.result()  # a failed run raises here, after the others have finished
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
