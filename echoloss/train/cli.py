"""``echoloss-train``: the command line.

::

    echoloss-train                                   # the embedded default (CPU, ~5 min)
    echoloss-train --config gpu                      # a packaged config (or a path)
    echoloss-train --max-steps 20 --output-dir runs/a --seed 1
    echoloss-train --output-dir runs/a --resume      # continue from runs/a/checkpoints/latest
    echoloss-train --set echo.alpha=0 --set optim.lr=1e-3
    echoloss-train --report-to tensorboard wandb     # besides metrics.jsonl
    echoloss-train experiment --output-dir runs/echo # GRPO-only vs RL+echo, same seeds
    torchrun --nproc_per_node=2 -m echoloss.train.cli --config ...   # data parallel (FSDP2)
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``echoloss-train`` console script: ``experiment ...`` runs the ECHO
    experiment (`echoloss.train.experiment`), anything else one training run
    (`echoloss.train.command`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not {"-h", "--help"} & set(argv):
        from echoloss._optional import MissingExtraError, require_extra

        try:  # every missing module named at once, with the extra that installs them
            require_extra("train", needed_by="echoloss-train")
        except MissingExtraError as err:
            print(f"echoloss-train: {err}", file=sys.stderr)
            return 2
    if argv[:1] == ["experiment"]:
        from echoloss.train.experiment import main as experiment_main

        return experiment_main(argv[1:])
    from echoloss.train.command import run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
