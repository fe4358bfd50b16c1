"""Redraw the figures of experiment result folders from their rows (`echo_experiment.figures`).

Each ``RUN_DIR`` is an ``python examples/research/echo_experiment/run.py`` output directory (its ``results.jsonl``) or a
committed folder of docs/experiment/ (its ``results.json``); the figures are written beside the
rows, over the seeds every arm finished. Nothing else is written.

::

    python examples/research/echo_experiment/run.py figures docs/experiment docs/experiment/rl-120

Run from the repository root. The persistence design's folder has its own report
(``examples/research/echo_experiment/run.py page``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from echo_experiment.experiment import complete_rows, read_rows, runs_table
from echo_experiment.figures import write_figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="examples/research/echo_experiment/run.py figures", description=__doc__.split("::")[0]
    )
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    args = p.parse_args(argv)
    for run_dir in args.run_dirs:
        rows = runs_table(
            read_rows(
                run_dir,
                prog="experiment_figures",
                hint="pass a `python examples/research/echo_experiment/run.py` output directory or a folder of docs/experiment/",
            )
        )
        if any(r.get("level") for r in rows):
            print(f"experiment_figures: {str(run_dir)!r} is the persistence design; use "
                  "examples/research/echo_experiment/run.py page", file=sys.stderr)  # fmt: skip
            return 2
        paired, complete = complete_rows(rows)
        written = write_figures(paired, run_dir)
        print(f"{run_dir}: {', '.join(f.name for f in written)} over seeds {complete}")
    return 0
