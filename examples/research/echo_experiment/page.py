"""Rebuild the persistence experiment's report and its part of docs/experiment.md from its rows.

The persistence section of docs/experiment.md prints, between two marker lines each, a headline
and a result (`echo_experiment.persistence.headline` / `markdown`) of the committed rows; the
page test (tests/train/test_experiment_page.py) recomputes both from
``docs/experiment/persistence/results.json``. This script is the one step from rows to page:

1. reads the rows of ``RUN_DIR`` (``results.jsonl`` of an experiment's output directory, or a
   committed ``results.json``);
2. runs ``python examples/research/echo_experiment/run.py --mode persistence --summarize-only`` on them (in a
   temporary directory, so ``RUN_DIR`` is not written), which writes ``results.json``,
   ``summary.json``, ``summary.md`` and the four figures;
3. copies the rows, the summary and the figures into ``docs/experiment/persistence/`` (the
   markdown goes into the page, not beside it) and writes the two generated blocks of
   ``docs/experiment.md``; nothing else of the page changes.

::

    python examples/research/echo_experiment/run.py page runs/persistence           # a finished or cut-off run
    python examples/research/echo_experiment/run.py page docs/experiment/persistence  # the committed rows again

Run from the repository root. The verdicts read "interim" until all 12 pre-registered seeds
are complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from echo_experiment import experiment, persistence

ROOT = Path(__file__).resolve().parents[3]  # the repository
FILES = (
    "results.json",
    "summary.json",
    "success.png",
    "speed.png",
    "world_model.png",
    "per_episode.png",
)


def main(argv: list[str] | None = None) -> int:
    """Summarise ``RUN_DIR``'s rows into docs/experiment/persistence/ and docs/experiment.md."""
    p = argparse.ArgumentParser(
        prog="examples/research/echo_experiment/run.py page", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "run_dir", type=Path, help="an experiment output directory, or the committed one"
    )
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="the docs folder to write")
    args = p.parse_args(argv)
    rows = experiment.read_rows(
        args.run_dir,
        prog="persistence_page",
        hint="pass the --output-dir of `python examples/research/echo_experiment/run.py --mode persistence`",
    )
    if not rows or any(not r.get("level") for r in rows):
        raise SystemExit(
            f"persistence_page: {str(args.run_dir)!r} holds {len(rows)} rows, not all of the "
            "persistence design (each needs a `level`); pass a persistence run's directory"
        )
    planned = persistence.PRE_REGISTERED_SEEDS
    foreign = sorted({r["seed"] for r in rows} - set(planned))
    if foreign:  # the set of seeds is what was pre-registered, not their number
        print(f"persistence_page: {str(args.run_dir)!r} holds rows of seeds {foreign}, which are "
              f"not pre-registered (seeds {planned[0]}–{planned[-1]}): the page's verdicts are the "
              "pre-registered analysis of those seeds only; remove the other rows (nothing was "
              "written)", file=sys.stderr)  # fmt: skip
        return 2
    target = args.docs / "experiment" / "persistence"
    page = args.docs / "experiment.md"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        code = experiment.main(
            ["--mode", "persistence", "--summarize-only", "--output-dir", str(work)]
        )
        if code != 0:
            return code
        target.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(work / name, target / name)
    summary = json.loads((target / "summary.json").read_text())
    page.write_text(persistence.update_page(page.read_text(), summary))
    seeds = summary["complete_seeds"]
    print(f"wrote {target}/ and the persistence blocks of {page}: {len(seeds)} of "
          f"{len(planned)} pre-registered seeds complete")  # fmt: skip
    return 0
