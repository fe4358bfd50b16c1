"""Redraw the figures of experiment result folders from their rows (`echoloss.train.figures`).

Each ``RUN_DIR`` is an ``echoloss-train experiment`` output directory (its ``results.jsonl``) or a
committed folder of docs/experiment/ (its ``results.json``); the figures are written beside the
rows, over the seeds every arm finished. Nothing else is written.

::

    python scripts/experiment_figures.py docs/experiment docs/experiment/rl-120

Run from the repository root. The persistence design's folder has its own report
(``scripts/persistence_page.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from echoloss.train.experiment import complete_rows, read_rows, runs_table
from echoloss.train.figures import write_figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("::")[0])
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    args = p.parse_args(argv)
    for run_dir in args.run_dirs:
        rows = runs_table(
            read_rows(
                run_dir,
                prog="experiment_figures",
                hint="pass an `echoloss-train experiment` output directory or a folder of docs/experiment/",
            )
        )
        if any(r.get("level") for r in rows):
            print(f"experiment_figures: {str(run_dir)!r} is the persistence design; use "
                  "scripts/persistence_page.py", file=sys.stderr)  # fmt: skip
            return 2
        paired, complete = complete_rows(rows)
        written = write_figures(paired, run_dir)
        print(f"{run_dir}: {', '.join(f.name for f in written)} over seeds {complete}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
