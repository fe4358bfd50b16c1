"""The ECHO experiments of docs/experiment.md in one command, from the repository root.

::

    python examples/research/echo_experiment/run.py --mode quick --output-dir runs/echo-quick
    python examples/research/echo_experiment/run.py --mode full --output-dir runs/echo-full
    python examples/research/echo_experiment/run.py --mode persistence --output-dir runs/p
    python examples/research/echo_experiment/run.py --summarize-only --output-dir runs/echo-full
    python examples/research/echo_experiment/run.py page runs/p        # rows -> docs/experiment.md
    python examples/research/echo_experiment/run.py figures docs/experiment/rl-120
    python examples/research/echo_experiment/run.py world-model-probe --steps 400
    python examples/research/echo_experiment/run.py heldout-ce runs/exp/*/final-model
    python examples/research/echo_experiment/run.py world-model-2x2 --output-dir runs/wm2x2 --jobs 1

Without a subcommand it runs the experiment (`echo_experiment.experiment`: the arms, paired over
seeds, each an ``echoloss-train`` run). The subcommands:

=================== =========================================================================
``page``            the persistence design's rows -> its report and the generated blocks of
                    docs/experiment.md (`echo_experiment.page`)
``figures``         redraw the figures of result folders from their rows
                    (`echo_experiment.redraw_figures`)
``world-model-probe`` how well the tiny model learns mirrorgrid's world model when trained on it
                    directly (`echo_experiment.world_model_probe`)
``heldout-ce``      saved models' direction-word CE on two held-out sets
                    (`echo_experiment.heldout_ce_sets`)
``world-model-2x2`` the pre-registered world-model 2×2 of docs/world-model-2x2.md
                    (`echo_experiment.world_model_2x2`; ``--resume`` continues it)
``world-model-pilot`` its pilot (`echo_experiment.world_model_pilot`)
``world-model-page`` its rows -> its figures and the generated blocks of docs/world-model-2x2.md
                    (`echo_experiment.world_model_page`)
``world-model-stage`` one world-model (or sham) stage (`echo_experiment.world_model`)
``world-model-gate-pilot`` further stage rounds where the 2×2's stage missed the bar
                    (`echo_experiment.world_model_gate`)
``world-model-gated-page`` the gate pilot's and the gated design's page blocks
=================== =========================================================================

Needs the trainer: ``pip install -e '.[train]'`` (or ``[dev]``).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The folder above this one holds the ``echo_experiment`` package (not installed): put it on the
# path, so that this file runs from anywhere and the spawned worker processes find it too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SUBCOMMANDS = {
    "page": "echo_experiment.page",
    "figures": "echo_experiment.redraw_figures",
    "world-model-probe": "echo_experiment.world_model_probe",
    "heldout-ce": "echo_experiment.heldout_ce_sets",
    "world-model-2x2": "echo_experiment.world_model_2x2",
    "world-model-pilot": "echo_experiment.world_model_pilot",
    "world-model-page": "echo_experiment.world_model_page",
    "world-model-stage": "echo_experiment.world_model",
    "world-model-gate-pilot": "echo_experiment.world_model_gate",
    "world-model-gated-page": "echo_experiment.world_model_gate:gated_page_main",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv``: a subcommand of `SUBCOMMANDS`, else the experiment's own flags."""
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        name, _, entry = SUBCOMMANDS[argv[0]].partition(":")  # "module[:function]"
        command = getattr(importlib.import_module(name), entry or "main")
        try:
            return int(command(argv[1:]) or 0)
        except FileNotFoundError as err:  # a model or rows path that is not there: one line
            print(f"{argv[0]}: {err}", file=sys.stderr)
            return 2
    from echo_experiment.experiment import main as experiment_main

    return experiment_main(argv)


if __name__ == "__main__":
    sys.exit(main())
