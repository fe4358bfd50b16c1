"""Rebuild the world-model 2×2's page blocks and figures from its rows.

::

    python examples/research/echo_experiment/run.py world-model-page runs/wm2x2   # a run so far
    python examples/research/echo_experiment/run.py world-model-page docs/experiment/world-model-2x2

Reads the rows of ``RUN_DIR`` (``results.jsonl`` of a run in progress, the last row of each
start × arm × seed winning, or a committed ``results.json``), the pilot's rows
(``docs/experiment/world-model-2x2/pilot.json``) and, with ``--log DRIVER_LOG`` (the run's
output: its ``done <job> (<s>s)`` lines), how far the run is, kept as ``progress.json`` (a
committed one is read when no log is given); writes ``results.json`` and the figures
(``contrasts.png``, ``world_model.png``, ``pilot.png``) into ``docs/experiment/world-model-2x2/``
and the two generated blocks of ``docs/world-model-2x2.md``; nothing else of the page changes.
Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from echo_experiment import world_model_report as report

__all__ = ["main", "read_progress", "read_rows"]

ROOT = Path(__file__).resolve().parents[3]


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir``, one per start × arm × seed (a later line replaces an earlier
    one), ordered by seed and cell; none for a run in progress without a finished RL run."""
    if (run_dir / "results.jsonl").is_file():
        lines = (run_dir / "results.jsonl").read_text().splitlines()
        rows = [json.loads(x) for x in lines if x.strip()]
    elif (run_dir / "results.json").is_file():
        rows = json.loads((run_dir / "results.json").read_text())
    elif (run_dir / "run.json").is_file():  # a run in progress, no RL run finished yet
        rows = []
    else:
        raise SystemExit(f"world-model-page: {str(run_dir)!r} has neither results.jsonl nor "
                         "results.json; pass the --output-dir of run.py world-model-2x2")  # fmt: skip
    keyed = {(r["seed"], report.cell(r)): r for r in rows}
    return [keyed[k] for k in sorted(keyed, key=lambda k: (k[0], report.CELLS.index(k[1])))]


def read_progress(log: Path) -> list[dict[str, Any]]:
    """The finished jobs of a driver log, in order: ``{"job", "state", "seconds"}`` from each
    ``done <job> (<s>s)`` or ``failed <job> (<s>s)`` line.

    Examples:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "log"
        >>> _ = f.write_text("start warm-seed0\\ndone warm-seed0 (312s)\\nrow: ...\\n")
        >>> read_progress(f)
        [{'job': 'warm-seed0', 'state': 'done', 'seconds': 312.0}]
    """
    import re

    out = []
    for line in log.read_text().splitlines():
        m = re.fullmatch(r"(done|failed) (\S+) \((\d+)s\)", line.strip())
        if m:
            out.append({"job": m[2], "state": m[1], "seconds": float(m[3])})
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the rows, figures and page blocks (see the module docstring)."""
    p = argparse.ArgumentParser(prog="run.py world-model-page", description=__doc__.split("::")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="the docs folder to write")
    p.add_argument("--log", type=Path, help="the run's driver log: how far the run is")
    args = p.parse_args(argv)
    rows = read_rows(args.run_dir)
    target = args.docs / "experiment" / "world-model-2x2"
    pilot = json.loads((target / "pilot.json").read_text())
    target.mkdir(parents=True, exist_ok=True)
    (target / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    report.contrasts_figure(rows, target / "contrasts.png")
    report.world_model_figure(rows, target / "world_model.png")
    report.pilot_figure(pilot, target / "pilot.png")
    page = args.docs / "world-model-2x2.md"
    progress = None
    if args.log is not None:
        progress = read_progress(args.log)
        (target / "progress.json").write_text(json.dumps(progress, indent=1) + "\n")
    elif (target / "progress.json").is_file():
        progress = json.loads((target / "progress.json").read_text())
    page.write_text(report.update_page(page.read_text(), pilot, rows, progress))
    v = report.verdict(rows)
    print(f"wrote {target}/ and the blocks of {page}: {len(rows)} of "
          f"{len(report.SEEDS) * len(report.CELLS)} runs; verdict {v['verdict']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
