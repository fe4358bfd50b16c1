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
from echoloss.train.config import ModelConfig
from echoloss.train.runtime import Ranks, gather, seed_everything

__all__ = ["appended_outputs", "export_model", "load_run", "save_run"]


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
