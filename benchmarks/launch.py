"""GPU only: the two fused Triton phases alone under candidate ``(BLOCK_V, num_warps)`` pairs.

``fused.LAUNCH`` was chosen from the shape of the work, not measured (docs/kernels.md); this sweep
times the candidates on the workload's participating rows so that the choice can be made from
numbers. Each candidate's phase 1 is checked against the default launch (same logprobs and lse)
before it is timed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import STAT_TOL, summarize, time_cuda
from benchmarks.providers import Context, Outputs
from benchmarks.workload import Workload

BLOCKS = (1024, 2048, 4096, 8192, 16384)
WARPS = (1, 2, 4, 8, 16)


def sweep_launch(
    ctx: Context, wl: Workload, warmup: int, repeats: int, base_row: dict[str, Any]
) -> list[dict[str, Any]]:
    from echoloss.ops.selective_logprobs import fused

    logits, labels = wl.logits, wl.labels
    assert logits is not None
    rows_idx = wl.participating.nonzero().squeeze(1)
    n = rows_idx.numel()
    a = torch.full((n,), 1e-4, device=logits.device)
    buf = torch.empty_like(logits)

    def phase1() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return fused.forward(
            logits, labels, rows=rows_idx, inv_temperature=1.0, chunk_size=1, need_entropy=True
        )

    lp0, lse0, _ = phase1()

    def phase2() -> torch.Tensor:
        return fused.backward(
            logits,
            labels,
            lse=lse0,
            grad_logprobs=a,
            grad_entropy=None,
            entropy=None,
            out=buf,
            rows=rows_idx,
            inv_temperature=1.0,
            chunk_size=1,
        )

    def wrap(f: Callable[[], Any]) -> Callable[[], Outputs]:
        return lambda: (f(), Outputs())[1]

    saved = dict(fused.LAUNCH)
    out: list[dict[str, Any]] = []
    try:
        for block in BLOCKS:
            for warps in WARPS:
                # The candidate applies at every V (the one-warp table entry is switched off).
                fused.LAUNCH.update(
                    fwd_block=block,
                    fwd_warps=warps,
                    bwd_block=block,
                    bwd_warps=warps,
                    one_warp_from_v=2**62,
                )
                lp, lse, _ = phase1()
                ok = bool(
                    torch.allclose(lp, lp0, atol=STAT_TOL[0], rtol=STAT_TOL[1])
                    and torch.allclose(lse, lse0, atol=STAT_TOL[0], rtol=STAT_TOL[1])
                )
                for phase, f in (("phase1", phase1), ("phase2", phase2)):
                    row = {
                        **base_row,
                        "op": "launch",
                        "provider": "triton",
                        "mode": phase,
                        "block_v": block,
                        "num_warps": warps,
                        "status": "ok" if ok else "gate-failed",
                        "time_ms": None,
                    }
                    if ok:
                        row["time_ms"] = summarize(time_cuda(ctx, wrap(f), warmup, repeats))
                    out.append(row)
    finally:
        fused.LAUNCH.update(saved)
    return out
