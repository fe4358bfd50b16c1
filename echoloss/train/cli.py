"""``echoloss-train``: the command line.

::

    echoloss-train                                   # the embedded default (CPU, ~5 min)
    echoloss-train --config gpu                      # a packaged config (or a path)
    echoloss-train --max-steps 20 --output-dir runs/a --seed 1
    echoloss-train --output-dir runs/a --resume      # continue from runs/a/checkpoints/latest
    echoloss-train --set echo.alpha=0 --set optim.lr=1e-3
    echoloss-train --report-to tensorboard wandb     # besides metrics.jsonl
    torchrun --nproc_per_node=2 -m echoloss.train.cli --config ...   # data parallel (FSDP2)
"""

from __future__ import annotations

import sys

__all__ = ["main"]

#: What ``echoloss-train experiment`` answers: the experiments live beside the package.
EXPERIMENT_MOVED = (
    "echoloss-train: 'experiment' is not a subcommand; the ECHO experiments are research beside "
    "the package: from a source checkout, run `python examples/research/echo_experiment/run.py "
    "--help` (the same flags as before)"
)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``echoloss-train`` console script: one training run
    (`echoloss.train.command`). The ECHO experiments are not part of the package: ``experiment``
    is refused with exit 2 and the command that runs them (from a source checkout)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["experiment"]:
        print(EXPERIMENT_MOVED, file=sys.stderr)
        return 2
    if not {"-h", "--help"} & set(argv):
        from echoloss._optional import MissingExtraError, require_extra

        try:  # every missing module named at once, with the extra that installs them
            require_extra("train", needed_by="echoloss-train")
        except MissingExtraError as err:
            print(f"echoloss-train: {err}", file=sys.stderr)
            return 2
    from echoloss.train.command import run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
