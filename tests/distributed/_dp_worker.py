"""Worker for test_data_parallel.py, launched by ``torchrun --nproc_per_node=2`` (gloo, CPU).

Each rank trains a tiny linear LM head wrapped in DDP on its own micro-batches (unequal token
counts), with global normalisers (counted, summed and all-reduced once per step) and the
DDP-averaging undone afterwards; and again with the buggy per-rank, per-call denominators. Rank 0
writes both gradients to ``<out_dir>/grads.pt``. :func:`global_batch` and :func:`make_model` are
shared with the single-process side of the test.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch

from echoloss.loss import (
    LossConfig,
    Normalizers,
    all_reduce_normalizers,
    count_normalizers,
    echo_loss,
    undo_data_parallel_averaging,
)

HIDDEN, VOCAB = 8, 13
SEQ_LENS = [9, 12, 7, 3, 4, 2]  # rank 0: sequences 0-2 (28 rows); rank 1: 3-5 (9 rows)
SHARDS = {0: [[0], [1, 2]], 1: [[3, 4, 5]]}  # rank -> micro-batches (lists of sequences)
CONFIGS = {
    "prime_rl": LossConfig(),
    "paper": LossConfig(
        policy="ppo_clip",
        kl_tau=0.0,
        rl_normalization="sequence_mean_token_mean",
        echo_normalization="sequence_mean",
    ),
}


def global_batch() -> dict[str, torch.Tensor]:
    """The whole step's batch: one row per token, sequence ids 0..5 (deterministic)."""
    g = torch.Generator().manual_seed(1234)
    n = sum(SEQ_LENS)
    seq = torch.cat([torch.full((k,), i) for i, k in enumerate(SEQ_LENS)])
    u = torch.rand(n, generator=g)
    last = torch.cumsum(torch.tensor(SEQ_LENS), 0) - 1
    rl = u < 0.5
    echo = (u >= 0.5) & (u < 0.8)
    warning = (u >= 0.8) & (u < 0.9)
    for m in (rl, echo, warning):
        m[last] = False
    adv = torch.randn(len(SEQ_LENS), generator=g, dtype=torch.float64)[seq]
    return {
        "hidden": torch.randn(n, HIDDEN, generator=g, dtype=torch.float64),
        "labels": torch.randint(0, VOCAB, (n,), generator=g),
        "rl_mask": rl,
        "echo_weights": torch.where(echo, 0.5, 0.0).double(),
        "observation_mask": echo | warning,
        "advantages": torch.where(rl, adv, 0.0),
        "inference_logprobs": torch.where(
            rl, -torch.rand(n, generator=g, dtype=torch.float64) * 3, 0.0
        ),
        "sequence_ids": seq,
    }


def micro_batch(batch: dict[str, torch.Tensor], seqs: list[int]) -> dict[str, torch.Tensor]:
    rows = torch.cat([(batch["sequence_ids"] == s).nonzero().squeeze(1) for s in seqs])
    mb = {k: v[rows] for k, v in batch.items()}
    remap = torch.full((len(SEQ_LENS),), -1)
    remap[torch.tensor(seqs)] = torch.arange(len(seqs))
    mb["sequence_ids"] = remap[mb["sequence_ids"]]  # local numbering per micro-batch
    return mb


def make_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, VOCAB).double()


def loss_of(model, mb, config, normalizers):
    return echo_loss(
        model(mb["hidden"]),
        mb["labels"],
        rl_mask=mb["rl_mask"],
        echo_weights=mb["echo_weights"],
        advantages=mb["advantages"],
        inference_logprobs=mb["inference_logprobs"],
        sequence_ids=mb["sequence_ids"],
        observation_mask=mb["observation_mask"],
        config=config,
        normalizers=normalizers,
    ).loss


def _step(ddp, mbs, config, *, global_norms: bool) -> list[torch.Tensor]:
    ddp.zero_grad(set_to_none=True)
    norms = None
    if global_norms:
        local = sum(
            (
                count_normalizers(
                    rl_mask=m["rl_mask"],
                    echo_weights=m["echo_weights"],
                    sequence_ids=m["sequence_ids"],
                )
                for m in mbs
            ),
            Normalizers(),
        )
        norms = all_reduce_normalizers(local)
    for i, mb in enumerate(mbs):
        if i < len(mbs) - 1:
            with ddp.no_sync():  # accumulate locally; DDP reduces on the last backward
                loss_of(ddp, mb, config, norms).backward()
        else:
            loss_of(ddp, mb, config, norms).backward()
    if global_norms:
        undo_data_parallel_averaging(ddp, torch.distributed.get_world_size())
    return [p.grad.detach().clone() for p in ddp.module.parameters()]


def main(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # A bounded timeout: a lost peer fails the run instead of hanging the test suite.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    batch = global_batch()
    mbs = [micro_batch(batch, seqs) for seqs in SHARDS[rank]]
    ddp = DistributedDataParallel(make_model())
    result = {}
    for name, config in CONFIGS.items():
        result[name] = {
            "global": _step(ddp, mbs, config, global_norms=True),
            "per_rank": _step(ddp, mbs, config, global_norms=False),
        }
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "grads.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
