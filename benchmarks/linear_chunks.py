"""The fused-linear op's chunk size against its time and memory, beside logits-then-loss.

``python -m benchmarks.linear_chunks [--n 16384] [--v 151936] [--hidden 4096] [--output FILE]``

Forward+backward of the benchmark's loss (``benchmarks/workload.py``, bf16) from ``hidden``
and the LM-head ``weight``: once with the ``[N, V]`` logits materialised (``echo_loss(hidden @
weight.T)``), then through ``echo_loss_from_hidden`` with the automatic chunk size and a few
fixed ones. Median of 7 CUDA-event times after 2 warm-ups, and the peak memory above what was
allocated before the calls. GPU only; prints Markdown, ``--output`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _measure(fn: Callable[[], Any]) -> tuple[float, float]:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(7):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
        del out
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear_chunks")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunks", default="1764,4096,8192")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.linear_chunks needs a CUDA device; nothing measured")
        return 2
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

    auto = auto_linear_chunk_size(weight.detach().requires_grad_(), rows=args.n)
    cases: list[tuple[str, int | None, Callable[[], Any]]] = [
        ("logits-then-loss", None, unfused),
        (f"fused-linear, automatic ({auto} rows)", auto, fused(None)),
    ]
    cases += [(f"fused-linear, {c} rows", c, fused(c)) for c in map(int, args.chunks.split(","))]
    rows = []
    for name, chunk, fn in cases:
        ms, gib = _measure(fn)
        rows.append({"case": name, "chunk": chunk, "median_ms": ms, "peak_extra_gib": gib})
    print(
        f"forward+backward, N = {args.n}, V = {args.v}, H = {args.hidden}, bf16, "
        f"{torch.cuda.get_device_name()}"
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
