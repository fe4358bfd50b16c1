"""The fused-linear op's chunk size against its time and memory, beside logits-then-loss.

``python -m benchmarks.linear_chunks [--n 16384] [--v 151936] [--hidden 4096] [--output FILE]``

Forward+backward of the benchmark's loss (``benchmarks/workload.py``, bf16) from ``hidden``
and the LM-head ``weight``: once with the ``[N, V]`` logits materialised (``echo_loss(hidden @
weight.T)``), then through ``echo_loss_from_hidden`` with the automatic chunk size and a few
fixed ones. Median of ``--repeats`` CUDA-event times, the cases in mirrored blocks (A B C C B A,
2 warm-ups per block, `benchmarks.harness.time_cuda_mirrored`: a drift of the clocks during the
run falls on all cases alike), and the peak memory of one more call above what was allocated
before it. GPU only; prints Markdown, ``--output`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _peak_extra_gib(fn: Callable[[], Any]) -> float:
    """Peak memory of one call above what was allocated before it (GiB)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear_chunks")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunks", default="1764,4096,8192")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.linear_chunks needs a CUDA device; nothing measured")
        return 2
    from benchmarks.harness import time_cuda_mirrored
    from benchmarks.providers import Context
    from benchmarks.workload import loss_config, make_workload
    from echoloss import echo_loss_from_hidden
    from echoloss.loss import echo_loss
    from echoloss.ops.fused_linear.op import auto_linear_chunk_size

    dev = torch.device("cuda")
    wl = make_workload(args.n, args.v, torch.bfloat16, dev, hidden_size=args.hidden)
    assert wl.hidden is not None and wl.weight is not None
    hidden, weight = wl.hidden, wl.weight
    x, cfg = wl.loss_inputs(), loss_config()

    def leaves() -> tuple[torch.Tensor, torch.Tensor]:
        return hidden.detach().requires_grad_(), weight.detach().requires_grad_()

    def unfused() -> Any:
        h, w = leaves()
        echo_loss(h @ w.t(), x, config=cfg).loss.backward()
        return h.grad, w.grad

    def fused(chunk: int | None) -> Callable[[], Any]:
        def run() -> Any:
            h, w = leaves()
            echo_loss_from_hidden(h, w, x, config=cfg, chunk_size=chunk).loss.backward()
            return h.grad, w.grad

        return run

    participating = int((x.rl | x.echo).sum())  # the rows the fused op multiplies
    auto = auto_linear_chunk_size(weight.detach().requires_grad_(), rows=participating)
    cases: list[tuple[str, int | None, Callable[[], Any]]] = [
        ("logits-then-loss", None, unfused),
        (f"fused-linear, automatic ({auto} rows)", auto, fused(None)),
    ]
    cases += [(f"fused-linear, {c} rows", c, fused(c)) for c in map(int, args.chunks.split(","))]
    ctx = Context(kind="cuda", device=dev)
    times = time_cuda_mirrored(
        ctx, {name: fn for name, _, fn in cases}, 2, args.repeats, on_error=None
    )
    rows = []
    for name, chunk, fn in cases:
        rows.append({
            "case": name,
            "chunk": chunk,
            "median_ms": statistics.median(times[name]) * 1e3,
            "samples_ms": [round(t * 1e3, 3) for t in times[name]],
            "peak_extra_gib": _peak_extra_gib(fn),
        })  # fmt: skip
    print(
        f"forward+backward, N = {args.n} ({participating} participating rows), V = {args.v}, "
        f"H = {args.hidden}, bf16, {torch.cuda.get_device_name()}, median of {args.repeats} "
        "(mirrored blocks)"
    )
    print("| case | median ms | peak extra GiB |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['median_ms']:.2f} | {r['peak_extra_gib']:.2f} |")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
