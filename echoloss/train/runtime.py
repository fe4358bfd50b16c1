"""Where a run executes: device, compute dtype, data-parallel ranks, seeding, FSDP2 sharding.

Every rank of a ``torchrun`` launch runs the same recipe; `gather` is the one collective the
recipe uses for plain Python values (rewards, counts, metric sums), so that every rank computes
the same global numbers.
"""

from __future__ import annotations

import gc
import os
import random
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "Ranks",
    "autocast",
    "compute_dtype",
    "cpu_computes_bf16_natively",
    "gather",
    "release_process_group",
    "seed_everything",
    "shard",
    "start_ranks",
]

_OWNED_GROUP: list[bool] = []  # non-empty while a process group this module created is alive


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: its device, its rank and the number of ranks."""

    device: torch.device
    rank: int
    world: int


def _pick_device(device: str) -> torch.device:
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def start_ranks(device: str) -> Ranks:
    """The device ``model.device`` names (``"auto"``: a GPU when there is one, else the CPU;
    ``"cpu"``; ``"cuda"``), and ``(rank, world_size)``; under ``torchrun`` also initialises the
    process group (`release_process_group` destroys it again)."""
    picked = _pick_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks(picked, 0, 1)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if picked.type == "cuda" else "gloo")
        _OWNED_GROUP.append(True)
    return Ranks(picked, dist.get_rank(), world)


def release_process_group() -> None:
    """Destroy the process group `start_ranks` created, if any (a live gloo group aborts the
    interpreter at exit); one created by the caller is left alone."""
    if _OWNED_GROUP and dist.is_initialized():
        # FSDP2's modules hold the group through reference cycles (hooks, the device mesh):
        # collect them now, while every rank is past the final barrier, so the group is torn
        # down here and not by the garbage collector during interpreter exit, where gloo's
        # threads abort the process (SIGABRT) when a peer has already gone.
        gc.collect()
        dist.destroy_process_group()
        _OWNED_GROUP.clear()


def cpu_computes_bf16_natively() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX). Without them PyTorch
    emulates bf16 matmuls: a SmolLM2-135M forward+backward on 4 x 400 tokens took 407 s in bf16
    and 17 s in fp32 on an AVX2-only CPU; with them bf16 is the faster one (measured in
    ``docs/pretrained.md``, ``benchmarks/cpu_bf16.py``).

    Example:
        >>> isinstance(cpu_computes_bf16_natively(), bool)
        True
    """
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype the model computes in on ``device`` for ``model.dtype = dtype``: ``auto`` is bf16 on a GPU and
    fp32 on CPU, and ``fastest`` is bf16 on a GPU or on a CPU that computes bf16 natively
    (`cpu_computes_bf16_natively`) and fp32 elsewhere. The parameters are fp32 whatever it is
    (fp32 master weights: `autocast`).

    Example:
        >>> compute_dtype("auto", torch.device("cpu")), compute_dtype("auto", torch.device("cuda"))
        (torch.float32, torch.bfloat16)
    """
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "fastest":
        native = device.type == "cuda" or cpu_computes_bf16_natively()
        return torch.bfloat16 if native else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def autocast(dtype: torch.dtype, device: torch.device) -> AbstractContextManager[Any]:
    """Where the model runs (generation, the training forward, evaluation): the parameters stay
    fp32 and the forward computes in ``dtype`` (the run's `compute_dtype`) under
    ``torch.autocast``, so that AdamW
    updates fp32 weights. On bf16 parameters an update below half a bf16 ulp of a weight
    (``|w|·2⁻⁹``) rounds away: one step at lr 1e-6 changed 0.392 % of SmolLM2-135M-Instruct's
    parameters, against 99.949 % with fp32 master weights (``scripts/bf16_update_probe.py``).
    No-op in fp32.

    Example:
        >>> with autocast(torch.bfloat16, torch.device("cpu")):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.bfloat16
    """
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def shard(model: Any) -> None:
    """FSDP2: one unit per decoder layer, plus the root (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers if layers is not None else []:
        fully_shard(layer)
    fully_shard(model)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def gather(obj: Any, world: int) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` without data parallelism)."""
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out
