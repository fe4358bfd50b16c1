"""The fused-linear op's chunk size against its time and memory, beside logits-then-loss.

``python -m benchmarks.linear_chunks [--n 16384] [--v 151936] [--hidden 4096] [--rounds R]
[--new-buffer] [--output FILE]``

Forward+backward of the benchmark's loss (``benchmarks/workload.py``, bf16) from ``hidden``
and the LM-head ``weight``: once with the ``[N, V]`` logits materialised (``echo_loss(hidden @
weight.T)``), then through ``echo_loss_from_hidden`` with the automatic chunk size and a few
fixed ones. Median of ``--repeats`` CUDA-event times, the cases in mirrored blocks (A B C C B A,
2 warm-ups per block, `benchmarks.harness.time_cuda_mirrored`: a drift of the clocks during the
run falls on all cases alike), and the peak memory of one more call above what was allocated
before it. With ``--rounds R`` the mirrored timing is repeated ``R`` times and each round's
medians are paired: the fused cases' difference to logits-then-loss per round, its median over
the rounds and how many rounds each side won (a one-GPU call to call spread of several percent
made a median of 10 unable to resolve a difference of 2-3 %). ``--new-buffer`` adds the
automatic chunk with phase 2 writing into a new ``[N, V]`` buffer instead of over the kept
logits (`phase2_into_new_buffer`; the op itself always writes in place, which is its memory
saving): whether writing over the logits costs time. GPU only; prints Markdown, ``--output``
writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch


@contextlib.contextmanager
def phase2_into_new_buffer() -> Iterator[None]:
    """Inside the block, the fused-linear op's phase 2 writes each chunk's ``dlogits`` into a
    new buffer instead of over the chunk's logits (the ``out=`` of its backend dropped): the
    same values, one more ``[c, V]`` buffer. For timing the in-place write against the usual
    one; the op is unchanged outside the block (the backend is captured at forward time)."""
    from echoloss.ops.fused_linear import op

    # The op looks its backend up by this module-level name at each call: wrap what is there.
    resolve = op.resolve_backend  # type: ignore[attr-defined]

    def new_buffer(backend: str, device: torch.device) -> Any:
        impl = resolve(backend, device)

        def backward(*args: Any, out: torch.Tensor | None = None, **kwargs: Any) -> Any:
            return impl.backward(*args, **kwargs)

        return types.SimpleNamespace(forward=impl.forward, backward=backward)

    op.resolve_backend = new_buffer  # type: ignore[attr-defined]
    try:
        yield
    finally:
        op.resolve_backend = resolve  # type: ignore[attr-defined]


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
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--new-buffer", action="store_true")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.linear_chunks needs a CUDA device; nothing measured")
        return 2
    from benchmarks.harness import environment, time_cuda_mirrored
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

    def fused(chunk: int | None, new_buffer: bool = False) -> Callable[[], Any]:
        def run() -> Any:
            h, w = leaves()
            with phase2_into_new_buffer() if new_buffer else contextlib.nullcontext():
                loss = echo_loss_from_hidden(h, w, x, config=cfg, chunk_size=chunk).loss
            loss.backward()
            return h.grad, w.grad

        return run

    participating = int((x.rl | x.echo).sum())  # the rows the fused op multiplies
    auto = auto_linear_chunk_size(weight.detach().requires_grad_(), rows=participating)
    cases: list[tuple[str, int | None, Callable[[], Any]]] = [
        ("logits-then-loss", None, unfused),
        (f"fused-linear, automatic ({auto} rows)", auto, fused(None)),
    ]
    if args.new_buffer:
        cases.append(
            ("fused-linear, automatic, phase 2 into a new buffer", auto, fused(None, True))
        )
    fixed = [int(c) for c in args.chunks.split(",") if c.strip()]  # --chunks "": none
    cases += [(f"fused-linear, {c} rows", c, fused(c)) for c in fixed]
    ctx = Context(kind="cuda", device=dev)
    fns = {name: fn for name, _, fn in cases}
    rounds = [time_cuda_mirrored(ctx, fns, 2, args.repeats, on_error=None)
              for _ in range(max(1, args.rounds))]  # fmt: skip
    base = cases[0][0]
    env = environment(ctx, torch.get_num_threads(), None)  # every row names its GPU and commit
    rows = []
    for name, chunk, fn in cases:
        samples = [t for r in rounds for t in r[name]]
        row: dict[str, Any] = {
            "case": name,
            "chunk": chunk,
            "median_ms": statistics.median(samples) * 1e3,
            "samples_ms": [round(t * 1e3, 3) for t in samples],
            "peak_extra_gib": _peak_extra_gib(fn),
            "device_name": env["device_name"],
            "git_sha": env["git_sha"],
        }
        if args.rounds > 1:
            row["round_medians_ms"] = [round(statistics.median(r[name]) * 1e3, 3) for r in rounds]
        rows.append(row)
    print(
        f"forward+backward, N = {args.n} ({participating} participating rows), V = {args.v}, "
        f"H = {args.hidden}, bf16, {torch.cuda.get_device_name()}, median of "
        f"{args.repeats * max(1, args.rounds)} (mirrored blocks, {max(1, args.rounds)} rounds)"
    )
    print("| case | median ms | peak extra GiB |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['median_ms']:.2f} | {r['peak_extra_gib']:.2f} |")
    if args.rounds > 1:
        print(f"\npaired by round, minus {base} (ms)")
        print("| case | median difference | min | max | rounds faster |")
        print("|---|---|---|---|---|")
        for r in rows[1:]:
            d = [
                a - b
                for a, b in zip(r["round_medians_ms"], rows[0]["round_medians_ms"], strict=True)
            ]
            faster = sum(x < 0 for x in d)
            print(f"| {r['case']} | {statistics.median(d):+.2f} | {min(d):+.2f} | "
                  f"{max(d):+.2f} | {faster} of {len(d)} |")  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
