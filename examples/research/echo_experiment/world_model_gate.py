"""A gated world-model stage: further rounds of the stage until the start knows the world.

The world-model 2×2's stage (`echo_experiment.world_model_2x2.STAGE`, sized on seed 0) brought
the held-out move-word CE below ``log 2`` at 7 of its 12 seeds, so its pre-registered
manipulation check failed before RL. A design that can decide gates each seed's stage: after a
round (the stage's schedule), if the held-out move CE is not below the bar at the round's last
``GATE_EVALS`` evaluations (the pilot's criterion), another round runs from the round's model
(a warm restart of the schedule, fresh AdamW, new walks: `run_stage`'s ``step_offset``, the KL
still to the warm-start's replies), up to ``MAX_ROUNDS`` rounds.

The pilot (this module's command) asks whether further rounds reach the bar on the seeds the
first round left above it, starting from the 2×2's own first rounds (its stage directories)::

    python examples/research/echo_experiment/run.py world-model-gate-pilot RUN_DIR OUT_DIR \
        --seeds 5 6 7 8 10 11 --rows docs/experiment/world-model-2x2/gate-pilot.json

Each row: ``seed``, ``world``, ``round`` (1: the 2×2's own stage, read back), ``steps`` (stage
steps so far), ``curve`` (``step``, ``ce_walks_move``), ``gate_met``, ``commit``, ``dirty``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from echo_experiment.world_model import StageConfig, run_stage
from echo_experiment.world_model_2x2 import SHAM_WALKS, STAGE, code_commit
from echo_experiment.world_model_report import WORLDS

__all__ = [
    "BAR",
    "GATE_EVALS",
    "MAX_ROUNDS",
    "first_stages",
    "gate_met",
    "gated_seeds",
    "main",
    "merged_rows",
    "run_gated_stage",
    "stage_main",
]

BAR = math.log(2)
GATE_EVALS = 3
MAX_ROUNDS = 4


def gate_met(curve: list[dict[str, Any]], *, bar: float = BAR, last: int = GATE_EVALS) -> bool:
    """Whether the held-out move CE (``ce_walks_move``) is below ``bar`` at each of the round's
    last ``last`` evaluations.

    Examples:
        >>> gate_met([{"ce_walks_move": c} for c in (1.6, 0.6, 0.5, 0.4)])
        True
        >>> gate_met([{"ce_walks_move": c} for c in (0.5, 0.70, 0.67, 0.66)])
        False
    """
    if len(curve) < last:
        return False
    return all(e["ce_walks_move"] < bar for e in curve[-last:])


def run_gated_stage(
    warm_dir: Path,
    out: Path,
    *,
    world: int,
    walks: str,
    cfg: StageConfig,
    seed: int,
    first_round: Path | None = None,
    rounds: int | None = None,
    max_rounds: int = MAX_ROUNDS,
) -> dict[str, Any]:
    """The stage in rounds from the warm-start ``warm_dir`` into ``out``: with ``rounds`` None
    (the world-model stage), rounds until `gate_met` on a round's curve or ``max_rounds``; with
    ``rounds`` (its sham twin), exactly that many, so that the twin has the same steps and
    tokens. Round 1 is ``first_round`` (a stage directory of the same world, walks and seed,
    made before: read back, not run again) when given. Round ``k`` > 1 continues round
    ``k − 1``'s model with the walks of stage steps ``(k − 1) · cfg.steps`` on, the KL kept to
    the warm-start's replies. Writes ``out/round<k>/`` per round run here, ``out/stage.jsonl``
    (every round's evaluations, ``round`` and cumulative ``tokens`` added), ``out/rounds.json``
    (``rounds``, ``gate_met`` of the last round, ``first_round``) and, last, ``out/final-model``
    (the last round's model). Returns ``rounds.json``'s content."""
    import shutil

    from echoloss.train.checkpoint import export_atomically

    if rounds is not None and rounds < 1:
        raise ValueError(f"run_gated_stage: rounds must be >= 1 or None (got {rounds})")
    if max_rounds < 1:
        raise ValueError(f"run_gated_stage: max_rounds must be >= 1 (got {max_rounds})")
    out.mkdir(parents=True, exist_ok=True)
    if first_round is not None:
        rows = _read_stage(first_round / "stage.jsonl")
        got = {r.get("walks") for r in rows}
        if got != {walks}:
            raise ValueError(f"run_gated_stage: first_round {str(first_round)!r} has walks "
                             f"{sorted(map(str, got))}, not {walks!r}; pass that stage's own "
                             "directory")  # fmt: skip
        model = first_round / "final-model"
    else:
        rows = run_stage(warm_dir, out / "round1", world=world, walks=walks, cfg=cfg, seed=seed)
        model = out / "round1" / "final-model"
    merged = [{**r, "round": 1} for r in rows]
    done, tokens = 1, rows[-1]["tokens"]
    want = max_rounds if rounds is None else rounds
    while done < want and (rounds is not None or not gate_met(rows)):
        done += 1
        rows = run_stage(model, out / f"round{done}", world=world, walks=walks, cfg=cfg,
                         seed=seed, step_offset=(done - 1) * cfg.steps,
                         teacher_dir=warm_dir)  # fmt: skip
        merged += [{**r, "round": done, "tokens": tokens + r["tokens"]} for r in rows]
        tokens += rows[-1]["tokens"]
        model = out / f"round{done}" / "final-model"
    summary = {"rounds": done, "gate_met": gate_met(rows), "first_round": (
        None if first_round is None else str(first_round))}  # fmt: skip
    (out / "stage.jsonl").write_text("".join(json.dumps(r) + "\n" for r in merged))
    (out / "rounds.json").write_text(json.dumps(summary, indent=1))

    def copy(d: Path) -> None:
        shutil.copytree(model, d, dirs_exist_ok=True)

    export_atomically(out / "final-model", copy)  # last: its presence means the stage is done
    return summary


def stage_main(argv: list[str] | None = None) -> int:
    """``run_gated_stage`` from the command line (the 2×2 driver's gated stage jobs)."""
    p = argparse.ArgumentParser(prog="world_model_gate stage")
    p.add_argument("warm_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--walks", choices=("world", SHAM_WALKS), required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--first-round", type=Path, default=None)
    p.add_argument("--max-rounds", type=int, default=MAX_ROUNDS)
    p.add_argument("--rounds-like", type=Path, default=None,
                   help="a gated stage's directory: run as many rounds as it did (the sham)")  # fmt: skip
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rounds = None
    if args.rounds_like is not None:
        rounds = int(json.loads((args.rounds_like / "rounds.json").read_text())["rounds"])
    summary = run_gated_stage(args.warm_dir, args.out, world=args.world, walks=args.walks,
                              cfg=STAGE, seed=args.seed, first_round=args.first_round,
                              rounds=rounds, max_rounds=args.max_rounds)  # fmt: skip
    print(json.dumps(summary), flush=True)
    return 0


def first_stages(run_dir: Path) -> list[dict[str, Any]]:
    """The first run's stage curves (``run_dir``: its --output-dir), one row per seed and start:
    ``seed``, ``start``, ``world``, ``curve`` (``step``, ``ce_walks_move``, ``tokens``), and the
    ``commit`` and ``dirty`` the stage job ran at."""
    from echo_experiment.world_model_2x2 import job_commit

    out = []
    for seed in range(len(WORLDS)):
        for start in ("world-model", "sham"):
            name = f"stage-{start}-seed{seed}"
            rows = _read_stage(run_dir / name / "stage.jsonl")
            curve = [{k: r[k] for k in ("step", "ce_walks_move", "tokens")} for r in rows]
            out.append({"seed": seed, "start": start, "world": WORLDS[seed], "curve": curve,
                        **job_commit(run_dir, name)})  # fmt: skip
    return out


def gated_seeds(stages: list[dict[str, Any]]) -> list[int]:
    """The seeds whose first world-model stage did not meet the gate: the gated design reruns
    them (in rounds); the others keep the first run's rows, which that design would repeat.

    Examples:
        >>> gated_seeds([{"seed": 0, "start": "world-model", "curve": [{"ce_walks_move": 0.3}] * 3},
        ...              {"seed": 1, "start": "world-model", "curve": [{"ce_walks_move": 0.9}] * 3},
        ...              {"seed": 1, "start": "sham", "curve": [{"ce_walks_move": 1.7}] * 3}])
        [1]
    """
    return sorted(r["seed"] for r in stages
                  if r["start"] == "world-model" and not gate_met(r["curve"]))  # fmt: skip


def merged_rows(
    first: list[dict[str, Any]], gated: list[dict[str, Any]], seeds: list[int]
) -> list[dict[str, Any]]:
    """The gated design's rows: the first run's for the seeds not in ``seeds`` (their first
    round met the gate), the gated run's for ``seeds``; `world_model_report.verdict` reads them
    with ``commits="seed"`` (each seed's four runs at one commit).

    Examples:
        >>> rows = merged_rows([{"seed": 0, "run": 1}, {"seed": 5, "run": 1}],
        ...                    [{"seed": 5, "run": 2}, {"seed": 0, "run": 2}], [5])
        >>> [(r["seed"], r["run"]) for r in rows]
        [(0, 1), (5, 2)]
    """
    keep = [r for r in first if r["seed"] not in seeds]
    return sorted([*keep, *(r for r in gated if r["seed"] in seeds)], key=lambda r: r["seed"])


def _curve(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"step": r["step"], "ce_walks_move": r["ce_walks_move"]} for r in rows]


def _read_stage(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _write(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """The gate pilot (see the module docstring): for each of ``--seeds``, the first run's
    first round read back, then further rounds until the gate or ``--max-rounds``; one row per
    round in ``--rows``, rewritten after every round. Returns 0 (2 on bad arguments)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the 2×2's --output-dir (its stages and warm-starts)")
    p.add_argument("out", type=Path, help="where the further rounds go")
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--rows", type=Path, required=True, help="the pilot's rows (JSON)")
    p.add_argument("--max-rounds", type=int, default=MAX_ROUNDS)
    args = p.parse_args(argv)
    bad = [s for s in args.seeds if s not in range(len(WORLDS))]
    if bad or args.max_rounds < 1:
        p.error(f"--seeds must be of 0-{len(WORLDS) - 1} (got {bad}) and --max-rounds >= 1 "
                f"(got {args.max_rounds})")  # fmt: skip
    import torch

    torch.set_num_threads(1)
    commit = code_commit()
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        world = WORLDS[seed]
        first = args.run_dir / f"stage-world-model-seed{seed}"
        curve = _curve(_read_stage(first / "stage.jsonl"))
        met = gate_met(curve)
        rows.append({"seed": seed, "world": world, "round": 1, "steps": STAGE.steps,
                     "curve": curve, "gate_met": met, "seconds": None,
                     "source": str(first.name), **commit})  # fmt: skip
        model = first / "final-model"
        for round_ in range(2, args.max_rounds + 1):
            if met:
                break
            out = args.out / f"seed{seed}-round{round_}"
            t0 = time.perf_counter()
            stage_rows = run_stage(
                model, out, world=world, walks="world", cfg=STAGE, seed=seed,
                step_offset=(round_ - 1) * STAGE.steps,
                teacher_dir=args.run_dir / f"warm-seed{seed}" / "final-model",
            )  # fmt: skip
            curve = _curve(stage_rows)
            met = gate_met(curve)
            rows.append({"seed": seed, "world": world, "round": round_,
                         "steps": round_ * STAGE.steps, "curve": curve, "gate_met": met,
                         "seconds": round(time.perf_counter() - t0, 1), "source": out.name,
                         **commit})  # fmt: skip
            print(f"seed {seed} round {round_}: move CE {curve[-1]['ce_walks_move']:.3f}, "
                  f"gate {'met' if met else 'not met'}", flush=True)  # fmt: skip
            model = out / "final-model"
            _write(rows, args.rows)
        _write(rows, args.rows)
    return 0


# ------------------------------------------------------------------------------------------------
# The page: the gate pilot's block and the gated design's result block

GATE_PILOT_MARKERS = (
    "<!-- world-model gate pilot: generated by run.py world-model-gated-page from "
    "docs/experiment/world-model-2x2/gate-pilot.json, do not edit -->",
    "<!-- end of the world-model gate pilot -->",
)
GATED_RESULT_MARKERS = (
    "<!-- world-model gated result: generated by run.py world-model-gated-page from "
    "docs/experiment/world-model-2x2/results.json and gated/results.json, do not edit -->",
    "<!-- end of the world-model gated result -->",
)


def gate_pilot_markdown(
    rows: list[dict[str, Any]], first: list[dict[str, Any]] | None = None
) -> str:
    """Per seed of the gate pilot: each round's held-out move CE at its end, and whether and
    at which round the gate was met; with the first run's rows ``first``, the manipulation
    check as the gated starts would give it if the gated run's stages repeat the pilot's rounds
    (the pilot's last round for its seeds, the first run's start for the others). A pure
    function of the rows.

    Examples:
        >>> gate_pilot_markdown([
        ...     {"seed": 5, "world": 15, "round": 1, "curve": [{"ce_walks_move": 1.061}],
        ...      "gate_met": False, "seconds": None},
        ...     {"seed": 5, "world": 15, "round": 2, "curve": [{"ce_walks_move": 0.287}],
        ...      "gate_met": True, "seconds": 240.0}]).splitlines()[4]
        '| 5 | 15 | 1.061 → 0.287 | met at round 2 |'
    """
    if not rows:
        return "No gate pilot rows yet."
    seeds = sorted({r["seed"] for r in rows})
    met = [s for s in seeds if any(r["gate_met"] for r in rows if r["seed"] == s)]
    lines = [
        f"**Gate pilot: the gate met at {len(met)} of {len(seeds)} seeds within "
        f"{MAX_ROUNDS} rounds.**",
        "",
        "| seed | world | held-out move CE at the end of each round | gate |",
        "|---|---|---|---|",
    ]
    for s in seeds:
        mine = sorted((r for r in rows if r["seed"] == s), key=lambda r: r["round"])
        ces = " → ".join(f"{r['curve'][-1]['ce_walks_move']:.3f}" for r in mine)
        when = next((r["round"] for r in mine if r["gate_met"]), None)
        gate = f"met at round {when}" if when else f"not met in {mine[-1]['round']} rounds"
        lines.append(f"| {s} | {mine[0]['world']} | {ces} | {gate} |")
    lines += ["", "Round 1 is the first run's stage, read back; the later rounds ran at the commit "
              "each row records."]  # fmt: skip
    if first:
        from echo_experiment.stats import paired_ci

        last = {s: max((r for r in rows if r["seed"] == s), key=lambda r: r["round"])
                for s in seeds}  # fmt: skip
        starts = {r["seed"]: r["move_ce_start"] for r in first if r["start"] == "world-model"}
        projected = [last[s]["curve"][-1]["ce_walks_move"] if s in last else ce
                     for s, ce in sorted(starts.items())]  # fmt: skip
        d = paired_ci(projected)
        lines += ["", f"If the gated run's stages repeat these rounds (the same code path, "
                  f"arguments and seeds, one CPU thread), its world-model starts' move CE over "
                  f"the {len(projected)} seeds is {d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}] "
                  f"(the bar: the upper bound below log 2 = {BAR:.3f}): a projection, not a "
                  "result."]  # fmt: skip
    return "\n".join(lines)


def gated_page_main(argv: list[str] | None = None) -> int:
    """Write the gate pilot's block and the gated design's result block of
    ``docs/world-model-2x2.md`` (and, once all 48 rows are in, ``gated/contrasts.png`` and
    ``gated/world_model.png`` of them): the gated run's rows (``RUN_DIR``'s) go to
    ``docs/experiment/world-model-2x2/gated/results.json`` and are merged with the first run's
    committed rows for the seeds the gate names (`gated_seeds` of ``first-stages.json``)."""
    from echo_experiment import world_model_report as report
    from echo_experiment.world_model_page import ROOT, read_rows

    p = argparse.ArgumentParser(prog="run.py world-model-gated-page")
    p.add_argument("run_dir", type=Path, nargs="?", default=None,
                   help="the gated run's --output-dir (none: the committed rows)")  # fmt: skip
    p.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = p.parse_args(argv)
    target = args.docs / "experiment" / "world-model-2x2"
    stages = json.loads((target / "first-stages.json").read_text())
    first = json.loads((target / "results.json").read_text())
    gated_path = target / "gated" / "results.json"
    if args.run_dir is not None:
        gated_path.parent.mkdir(parents=True, exist_ok=True)
        _write(read_rows(args.run_dir), gated_path)
    gated = json.loads(gated_path.read_text()) if gated_path.is_file() else []
    pilot_path = target / "gate-pilot.json"
    pilot = json.loads(pilot_path.read_text()) if pilot_path.is_file() else []
    rows = merged_rows(first, gated, gated_seeds(stages))
    page = args.docs / "world-model-2x2.md"
    text = report._splice(page.read_text(), GATE_PILOT_MARKERS, gate_pilot_markdown(pilot, first))
    block = report.markdown(rows, commits="seed").replace("### Result:", "### Gated result:", 1)
    page.write_text(report._splice(text, GATED_RESULT_MARKERS, block))
    if len(rows) == len(report.SEEDS) * len(report.CELLS):  # complete: the figures of the rows
        report.contrasts_figure(rows, gated_path.parent / "contrasts.png")
        report.world_model_figure(rows, gated_path.parent / "world_model.png")
    v = report.verdict(rows, commits="seed")
    print(f"wrote the gated blocks of {page}: {len(gated)} gated rows; verdict {v['verdict']}")
    return 0
