"""The world-model 2×2's feasibility pilot (seed 0, world `WORLDS[0]`): which stage puts the
world model in reach before RL, and does its sham leave the warm-start as it was?

::

    python examples/research/echo_experiment/run.py world-model-pilot --output-dir runs/pilot

Steps (a step whose ``final-model`` exists is kept, so a cut-off pilot continues):

1. the seed's warm-start (as in the 2×2: `echo_experiment.world_model_2x2.plan`);
2. the world-model stage under each of `CANDIDATES` (peak learning rate, steps, warm-up steps;
   cosine decay, 32 random walks per step, an evaluation every 10 steps);
3. the order of choice, by criteria fixed here before any candidate was read: a candidate
   **passes** when the world-model stage's held-out move-word CE (random walks on held-out pairs
   in the seed's world) is below ``log 2`` at each of its last `LAST_K` evaluations; passing
   candidates are tried with the fewest steps first (a tie: the lower peak learning rate);
4. for the candidate tried, and each sham of `SHAMS` in turn: the sham stage under its
   schedule, then a held-out evaluation in the seed's world (60 greedy and 960 sampled
   episodes, the move CE) of the warm-start, the world-model start and the sham start. The
   pilot **is met** by the first candidate and sham whose invalid replies are at most
   `MAX_INVALID` at both starts and whose sham start stays near the warm-start: its move CE
   within `SHAM_CE` nats and its sampled success within `SHAM_SUCCESS` of the warm-start's.
   That pair is chosen; none: the pilot is not met.

The first round had one sham, ``ordinary`` (the walks in the ordinary world), and was stopped
after its first candidate: that sham's move CE in the seed's world rose far above the
warm-start's (its curve is in the rows): a start confidently wrong about every key, not one that
merely does not know the world. ``shuffled`` (each walk in a random world of its own,
`echo_experiment.world_model.stage_walks`) was added then, after that reading, as the second
sham; the criteria did not change.

It writes ``--rows`` (``pilot.json``: one row per stage with its evaluation curve, one per
evaluated start, and the choice), each row with the code commit its job ran
(``<job>.commit.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from echo_experiment.world_model import StageConfig
from echo_experiment.world_model_2x2 import Job, _jsonl, _train, code_commit, job_commit, run_all
from echo_experiment.world_model_report import WORLDS

__all__ = ["CANDIDATES", "main", "met", "order", "passes"]

SEED = 0
LOG2 = math.log(2)
LAST_K = 3
MAX_INVALID = 0.05
SHAM_CE = 0.5
SHAM_SUCCESS = 0.05
#: (peak lr, steps, warm-up steps): below the positive control's unstable constant 1e-2, and
#: above its constant 1e-3 (which crossed log 2 only after 220–240 steps), each decayed to 0.
CANDIDATES = ((3e-3, 200, 10), (1e-2, 150, 20))
#: The shams, in the order tried (``ordinary``: the first round's; ``shuffled``: added after it).
SHAMS = ("ordinary", "shuffled")


def _label(lr: float, steps: int) -> str:
    return f"lr{lr:g}-{steps}"


def passes(curve: list[dict[str, Any]], k: int = LAST_K) -> bool:
    """Whether the last ``k`` evaluations of a stage's ``curve`` all have move CE below log 2.

    Examples:
        >>> passes([{"ce_walks_move": 0.9}, {"ce_walks_move": 0.6}, {"ce_walks_move": 0.5}], k=2)
        True
        >>> passes([{"ce_walks_move": 0.6}, {"ce_walks_move": 0.7}], k=2)
        False
    """
    tail = curve[-k:]
    return len(tail) == k and all(e["ce_walks_move"] < LOG2 for e in tail)


def order(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The passing stage rows (``peak_lr``, ``steps``, ``passes``) in the order they are tried:
    fewest steps first, then the lowest peak lr.

    Examples:
        >>> [s["peak_lr"] for s in order([{"peak_lr": 3e-3, "steps": 200, "passes": True},
        ...                               {"peak_lr": 1e-2, "steps": 150, "passes": True},
        ...                               {"peak_lr": 1e-3, "steps": 100, "passes": False}])]
        [0.01, 0.003]
    """
    return sorted((s for s in stages if s["passes"]), key=lambda s: (s["steps"], s["peak_lr"]))


def met(starts: dict[str, dict[str, Any]]) -> bool:
    """Whether evaluated starts (``warm``, ``world-model``, ``sham``: ``invalid``, ``move_ce``,
    ``eval_success_sampled``) meet the pilot's start criteria.

    Examples:
        >>> w = {"invalid": 0.01, "move_ce": 1.7, "eval_success_sampled": 0.40}
        >>> met({"warm": w, "world-model": w | {"move_ce": 0.3}, "sham": w | {"move_ce": 2.1}})
        True
        >>> met({"warm": w, "world-model": w | {"invalid": 0.06}, "sham": w})
        False
    """
    warm, wm, sham = starts["warm"], starts["world-model"], starts["sham"]
    return bool(
        wm["invalid"] <= MAX_INVALID
        and sham["invalid"] <= MAX_INVALID
        and abs(sham["move_ce"] - warm["move_ce"]) <= SHAM_CE
        and abs(sham["eval_success_sampled"] - warm["eval_success_sampled"]) <= SHAM_SUCCESS
    )


def _stage_job(out: Path, warm: Path, name: str, cfg: StageConfig, walks: str) -> Job:
    args = ["--walks", walks, str(warm), str(out / name), "--world", str(WORLDS[SEED]), "--seed", str(SEED),
            "--steps", str(cfg.steps), "--lr", str(cfg.peak_lr), "--warmup-steps",
            str(cfg.warmup_steps), "--batch", str(cfg.batch), "--eval-every", str(cfg.eval_every)]  # fmt: skip
    return Job(name, "stage", args, meta={"kind": "stage"})


def _eval_job(out: Path, name: str, model: Path) -> Job:
    sets = [f"model.path={model}", "warmup.steps=0", "train.max_steps=0",
            "train.eval_at_start=true", "train.eval_samples=16"]  # fmt: skip
    return Job(name, "train", _train(out, name, SEED, WORLDS[SEED], sets), meta={"kind": "start"})


def main(argv: list[str] | None = None) -> int:
    """Run the pilot into ``--output-dir`` and write its rows to ``--rows``."""
    p = argparse.ArgumentParser(prog="run.py world-model-pilot", description=__doc__.split("::")[0])
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--rows", type=Path, required=True, help="where pilot.json goes")
    args = p.parse_args(argv)
    out: Path = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    commit = code_commit()
    warm_name = f"warm-seed{SEED}"
    warm = out / warm_name / "final-model"
    jobs = [Job(warm_name, "train", _train(out, warm_name, SEED, WORLDS[SEED],
                ["train.max_steps=0", "train.eval_samples=0"]), meta={"kind": "warm"})]  # fmt: skip
    configs = {_label(lr, n): StageConfig(steps=n, peak_lr=lr, warmup_steps=w, eval_every=10)
               for lr, n, w in CANDIDATES}  # fmt: skip
    jobs += [_stage_job(out, warm, f"wm-{k}", c, "world") for k, c in configs.items()]
    if run_all(jobs, out, 1, commit):
        return 1
    stages = []
    for k, c in configs.items():
        curve = _jsonl(out / f"wm-{k}" / "stage.jsonl")
        stages.append({"kind": "stage", "start": "world-model", "label": k, "peak_lr": c.peak_lr,
                       "steps": c.steps, "warmup_steps": c.warmup_steps, "batch": c.batch,
                       "passes": passes(curve), "curve": curve,
                     **job_commit(out, f"wm-{k}")})  # fmt: skip
    rows: list[dict[str, Any]] = list(stages)
    chosen: dict[str, str] | None = None
    tries = [(t["label"], walks) for t in order(stages) for walks in SHAMS]
    for label, walks in tries:
        c = configs[label]
        sham = f"sham-{walks}-{label}"
        wm_start, sham_start = f"start-world-model-{label}", f"start-sham-{walks}-{label}"
        jobs = [_stage_job(out, warm, sham, c, walks),
                _eval_job(out, "start-warm", warm),
                _eval_job(out, wm_start, out / f"wm-{label}" / "final-model"),
                _eval_job(out, sham_start, out / sham / "final-model")]  # fmt: skip
        if run_all(jobs, out, 1, commit):
            return 1
        rows.append({"kind": "stage", "start": "sham", "walks": walks, "label": label,
                     "peak_lr": c.peak_lr, "steps": c.steps, "warmup_steps": c.warmup_steps,
                     "batch": c.batch, "passes": None,
                     "curve": _jsonl(out / sham / "stage.jsonl"), **job_commit(out, sham)})  # fmt: skip
        starts = {}
        for start, name in (
            ("warm", "start-warm"),
            ("world-model", wm_start),
            ("sham", sham_start),
        ):
            e = next(x for x in _jsonl(out / name / "eval.jsonl") if x["rl_step"] == 0)
            starts[start] = {"kind": "start", "start": start, "label": label,
                             "walks": walks if start == "sham" else None,
                             "eval_success_greedy": e.get("eval_success_greedy"),
                             "eval_success_sampled": e.get("eval_success_sampled"),
                             "invalid": e.get("eval_invalid_rate"),
                             "move_ce": e.get("ce_walks_move"), "wall_ce": e.get("ce_walks_wall"),
                             **job_commit(out, name)}  # fmt: skip
        rows += starts.values()
        if met(starts):
            chosen = {"label": label, "sham": walks}
            break
    rows.append({"kind": "choice", "chosen": None if chosen is None else chosen["label"],
                 "sham": None if chosen is None else chosen["sham"]})  # fmt: skip
    rows[-1].update(commit)  # the choice: made by this code
    for r in rows:
        r.update(seed=SEED, world=WORLDS[SEED])
    args.rows.parent.mkdir(parents=True, exist_ok=True)
    args.rows.write_text(json.dumps(rows, indent=1))
    print(f"pilot: chosen {rows[-1]['chosen']}; rows in {args.rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
