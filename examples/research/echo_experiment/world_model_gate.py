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

from echo_experiment.world_model import run_stage
from echo_experiment.world_model_2x2 import STAGE, code_commit
from echo_experiment.world_model_report import WORLDS

__all__ = ["BAR", "GATE_EVALS", "MAX_ROUNDS", "gate_met", "main"]

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
