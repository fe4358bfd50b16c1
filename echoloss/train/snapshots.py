"""A run's state on disk: checkpoints (weights, optimiser, RNG, data position) and the final
model. The file-level machinery (atomic writes, checksums, ``latest``, safe loading) is
`echoloss.train.checkpoint`; this module decides what a run saves and restores."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import echoloss
from echoloss.train import checkpoint as ckpt
from echoloss.train.config import ModelConfig, TrainSection
from echoloss.train.runtime import Ranks, gather, seed_everything

__all__ = [
    "RUN_OUTPUTS",
    "appended_outputs",
    "claim_output_dir",
    "export_model",
    "load_run",
    "save_run",
]

#: What a run writes in its output directory (``rollouts.rank<R>.jsonl`` per rank): what
#: ``--overwrite`` removes, and what marks a directory as holding a run.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "eval.jsonl",
    "rollouts.rank*.jsonl",
    "token_exports",
    "checkpoints",
    "final-model",
    "plots",
    "tensorboard",
    "wandb",
)


def claim_output_dir(train: TrainSection, resume: str | Path | None, rank: int) -> None:
    """Check the ``[train]`` section's ``output_dir`` before anything is loaded or written;
    with ``overwrite``, remove the earlier run's `RUN_OUTPUTS` (rank 0 only).

    A fresh run (or one resumed from a checkpoint of another directory) into a directory that
    already holds files would truncate its ``metrics.jsonl``, replace its plots and final model
    and leave its newer checkpoints beside the new ones: refused unless ``train.overwrite``.

    Raises:
        ConfigError: ``output_dir`` is an existing file, or a non-empty directory that is not
            being resumed (the message names ``--output-dir`` and the ways on).
    """
    from echoloss.train.config import ConfigError

    out = Path(train.output_dir)
    flag = f"--output-dir (train.output_dir) {str(out)!r}"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} is an existing file, not a directory; name a new directory")
    if rank != 0 or not out.is_dir():
        return
    if resume is not None and Path(resume).resolve().is_relative_to(out.resolve()):
        return  # resuming this directory's own run: it cuts its outputs back itself
    held = sorted(p.name for p in out.iterdir())
    if not held:
        return
    if not train.overwrite:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ConfigError(
            f"{flag} is not empty ({shown}): a new run would truncate its metrics and leave its "
            "checkpoints beside the new ones. Continue that run with --resume, replace it with "
            "--overwrite (train.overwrite = true), or give a new --output-dir"
        )
    import shutil

    for pattern in RUN_OUTPUTS:
        for path in out.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def appended_outputs(rank: int, *, save_rollouts: bool) -> list[str]:
    """This rank's append-only output files (relative to the output directory): rank 0's
    metrics and evaluations, and its rollouts with ``train.save_rollouts``.

    Example:
        >>> appended_outputs(0, save_rollouts=True), appended_outputs(1, save_rollouts=False)
        (['metrics.jsonl', 'eval.jsonl', 'rollouts.rank0.jsonl'], [])
    """
    names = ["metrics.jsonl", "eval.jsonl"] if rank == 0 else []
    return [*names, f"rollouts.rank{rank}.jsonl"] if save_rollouts else names


def save_run(
    out: Path,
    step: int,
    model: Any,
    opt: torch.optim.Optimizer,
    rae: echoloss.RAE | None,
    ranks: Ranks,
    *,
    config: dict[str, Any],
    prompts_per_step: int,
    keep: int,
    save_rollouts: bool,
) -> None:
    """Checkpoint ``step`` under ``out/checkpoints`` (a collective under FSDP; rank 0 writes),
    keeping the newest ``keep`` (``train.keep_checkpoints``). ``config`` is the run's
    configuration as JSON (saved beside the weights, compared on resume); the data position is
    ``step * prompts_per_step``; with ``save_rollouts`` the rollout files' sizes are saved too
    (a resumed run cuts them back)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    rank, world = ranks.rank, ranks.world
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=full)
    opt_sd = get_optimizer_state_dict(model, opt, options=full)
    rngs = gather(ckpt.capture_rng(), world)  # tensors and numbers: loads with weights_only
    names = appended_outputs(rank, save_rollouts=save_rollouts)
    sizes = gather(ckpt.output_sizes(out, names), world)
    if rank != 0:
        return

    def write(d: Path) -> None:
        torch.save(model_sd, d / "model.pt")
        torch.save(opt_sd, d / "optimizer.pt")
        torch.save(rngs, d / "rng.pt")
        state = {
            "step": step,
            "data_position": step * prompts_per_step,
            "world_size": world,
            "rae": rae.state_dict() if rae is not None else None,
            "config": config,
            "outputs": {k: v for part in sizes for k, v in part.items()},  # cut back on resume
        }
        (d / "state.json").write_text(json.dumps(state, indent=1))

    ckpt.save_checkpoint(out / "checkpoints", step, write, keep=keep)


def load_run(
    path: Path, model: Any, opt: torch.optim.Optimizer, ranks: Ranks, *, model_config: ModelConfig
) -> dict[str, Any]:
    """Restore weights, optimiser and this rank's RNG from checkpoint ``path``; returns its
    ``state.json``. A checkpoint of another model shape is a `ckpt.CheckpointError` naming the
    ``[model]`` settings that differ from the checkpoint's (``model_config`` is this run's)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    # One read: the bytes checked against the manifest are the bytes loaded (weights_only: a
    # checkpoint file never runs code)
    names = ("model.pt", "optimizer.pt", "rng.pt")
    state, files = ckpt.load_checkpoint(path, names)
    model_sd, opt_sd, rngs = (files[f] for f in names)
    try:
        set_model_state_dict(model, model_sd, options=full)
        set_optimizer_state_dict(model, opt, opt_sd, options=full)
    except (RuntimeError, KeyError, ValueError) as err:
        now = {"model": model_config.model_dump(mode="json")}
        changed = [
            c for c in ckpt.config_changes(state.get("config", {}), now) if c.startswith("model.")
        ]
        raise ckpt.CheckpointError(
            f"--resume: checkpoint {str(path)!r} does not fit this model "
            f"({str(err).strip().splitlines()[0]}); changed [model] settings: "
            f"{'; '.join(changed) or 'none'}. Resume with the checkpoint's [model] settings"
        ) from None
    if len(rngs) == ranks.world:
        ckpt.restore_rng(rngs[ranks.rank])
    else:
        print(
            f"echoloss-train: checkpoint written by {len(rngs)} rank(s), resuming on "
            f"{ranks.world}: sampling RNG reseeded (the run continues, but not bit-identically)",
            file=sys.stderr,
        )
        seed_everything(int(state["step"]) * 7919 + ranks.rank)
    return state


def export_model(out: Path, model: Any, tok: Any, rank: int) -> None:
    """The final weights as a Hugging Face directory ``out/final-model``, usable as
    ``model.path`` (written atomically: a crash leaves no half model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:

        def write(d: Path) -> None:
            model.save_pretrained(d, state_dict=sd)
            tok.save_pretrained(d)

        ckpt.export_atomically(out / "final-model", write)
