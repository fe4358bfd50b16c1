"""Experiment tracking: the trainer's metrics rows to TensorBoard and Weights & Biases.

``metrics.jsonl`` is always written; ``train.report_to`` (or ``--report-to``) adds the trackers,
each through its library's own writer:

=============== ====================================================== ===========================
``tensorboard`` ``torch.utils.tensorboard.SummaryWriter`` (event files  ``pip install
                in ``<output_dir>/tensorboard``)                        'echoloss[tracking]'``
``wandb``       ``wandb.init`` / ``wandb.log`` (run files in            ``pip install
                ``<output_dir>/wandb``; ``WANDB_MODE=offline`` works    'echoloss[tracking]'``
                without an account)
=============== ====================================================== ===========================

Every numeric value of a row is logged as a scalar at the row's ``step`` (strings such as
``phase`` are not scalars and are left out; so are booleans). On ``--resume`` from step ``S``,
TensorBoard drops the events after ``S`` that the interrupted run wrote (``purge_step``), and W&B
continues the same run (its id is kept in ``<output_dir>/wandb/run_id``), so both match
``metrics.jsonl``, which is cut back to ``S`` the same way.

Examples:
    >>> scalars({"step": 3, "phase": "rl", "loss": 0.5, "tokens": 120, "done": True})
    {'loss': 0.5, 'tokens': 120.0}
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

__all__ = ["TRACKERS", "Tracker", "check_trackers", "open_trackers", "scalars"]

#: The trackers ``train.report_to`` accepts, and the modules each needs (the ``tracking`` extra).
TRACKERS: dict[str, tuple[str, ...]] = {"tensorboard": ("tensorboard",), "wandb": ("wandb",)}


class Tracker(Protocol):
    """Where a step's metrics go besides ``metrics.jsonl``."""

    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The loggable scalars of a metrics row: numbers other than ``step`` (bools excluded),
    as floats, non-finite ones included (a NaN loss is worth seeing on a chart)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def check_trackers(report_to: Sequence[str]) -> None:
    """Fail before any work when a requested tracker's library is not installed.

    Raises:
        echoloss._optional.MissingExtraError: naming the missing modules and the ``tracking``
            extra that installs them.
    """
    from echoloss._optional import require_extra

    modules = [m for name in report_to for m in TRACKERS[name]]
    if modules:
        require_extra("tracking", needed_by=f"train.report_to = {list(report_to)}", modules=modules)


class _TensorBoard:
    def __init__(self, out: Path, *, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run first drops the events the interrupted run wrote after its
        # checkpoint (steps > start), as metrics.jsonl is cut back.
        self.writer = SummaryWriter(
            log_dir=str(out / "tensorboard"), purge_step=start + 1 if start else None
        )

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, out: Path, *, config: Mapping[str, Any], start: int) -> None:
        import wandb

        root = out / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        id_file = root / "run_id"
        # One W&B run per output directory: a resumed run continues it.
        run_id = (
            id_file.read_text().strip() if start and id_file.is_file() else uuid.uuid4().hex[:8]
        )
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "echoloss-train"),
            name=out.name,
            id=run_id,
            resume="allow",
            dir=str(out),  # wandb writes its run folders under <dir>/wandb
            config=dict(config),
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackers:
    """Every requested tracker behind one ``log``."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, row: Mapping[str, Any]) -> None:
        """Log a metrics row (its ``step`` key is the step)."""
        values = scalars(row)
        step = int(row["step"])
        for t in self.trackers:
            t.log(values, step)


@contextmanager
def open_trackers(
    report_to: Sequence[str], *, out: Path, config: Mapping[str, Any], start: int = 0
) -> Iterator[_Trackers]:
    """The trackers of ``report_to`` for a run writing to ``out``, closed on exit.

    Args:
        report_to: tracker names (keys of `TRACKERS`); empty = none.
        out: the run's output directory.
        config: the run's configuration (recorded by W&B).
        start: the step the run starts from (> 0 on resume: later events are replaced).
    """
    check_trackers(report_to)
    opened: list[Tracker] = []
    try:
        for name in report_to:
            if name == "tensorboard":
                opened.append(_TensorBoard(out, start=start))
            elif name == "wandb":
                opened.append(_WandB(out, config=config, start=start))
            else:  # pragma: no cover - the config only admits TRACKERS
                raise ValueError(
                    f"train.report_to: unknown tracker {name!r}; known: {list(TRACKERS)}"
                )
        yield _Trackers(opened)
    finally:
        for t in opened:
            t.close()
