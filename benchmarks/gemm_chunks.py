"""Where a chunked LM head's extra time goes: its three GEMMs in one chunk and in two.

``python -m benchmarks.gemm_chunks [--n 16384] [--v 151936] [--hidden 4096] [--repeats 7]``

The fused-linear op multiplies the participating rows in chunks: per chunk the logits
``h @ W.T``, the hidden gradient ``dz @ W`` and the weight gradient ``dzᵀ @ h``, summed over the
chunks (for a bf16 weight in an fp32 accumulator, added in the GEMM's epilogue with
``addmm(..., out_dtype=float32)``, then rounded to bf16 once). This times each GEMM on random
bf16 operands of the given shape in one chunk of ``N`` rows and in two of ``N / 2``, and the
variants of the weight-gradient sum (fp32 accumulator with and without the final rounding, a
bf16 accumulator, a bf16 partial product added by a bf16 ``addmm``), so that the cost of
chunking is read GEMM by GEMM. Median of ``--repeats`` CUDA-event times after one warm-up, each
call after an L2 flush (`benchmarks.harness.time_cuda`).
GPU only; prints Markdown.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median CUDA-event time (ms) after one warm-up, each call after an L2 flush."""
    from benchmarks.harness import time_cuda
    from benchmarks.providers import Context

    ctx = Context(kind="cuda", device=torch.device("cuda"))
    return statistics.median(time_cuda(ctx, fn, 1, repeats)) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gemm_chunks")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gemm_chunks needs a CUDA device; nothing measured")
        return 2
    n, v, hd, dev = args.n, args.v, args.hidden, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, hd, generator=g, device=dev).to(torch.bfloat16)
    dz = (torch.randn(n, v, generator=g, device=dev) * 1e-3).to(torch.bfloat16)
    w = (torch.randn(v, hd, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    half = n // 2
    f32 = torch.float32

    def fp32_accumulator(round_to_bf16: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            acc = torch.mm(dz[:half].t(), h[:half], out_dtype=f32)
            torch.addmm(acc, dz[half:].t(), h[half:], out_dtype=f32, out=acc)
            return acc.to(torch.bfloat16) if round_to_bf16 else acc

        return run

    def bf16_accumulator() -> torch.Tensor:
        acc = torch.mm(dz[:half].t(), h[:half])
        return acc.addmm_(dz[half:].t(), h[half:])

    cases: dict[str, Callable[[], Any]] = {
        f"logits h @ W.T, {n} rows": lambda: torch.mm(h, w.t()),
        f"logits h @ W.T, 2 x {half} rows": lambda: (
            torch.mm(h[:half], w.t()),
            torch.mm(h[half:], w.t()),
        ),
        f"dX = dz @ W, {n} rows": lambda: torch.mm(dz, w),
        f"dX = dz @ W, 2 x {half} rows": lambda: (torch.mm(dz[:half], w), torch.mm(dz[half:], w)),
        f"dW = dz.T @ h, {n} rows, bf16 out": lambda: torch.mm(dz.t(), h),
        f"dW, 2 x {half} rows, fp32 accumulator + rounding to bf16": fp32_accumulator(True),
        f"dW, 2 x {half} rows, fp32 accumulator (no rounding)": fp32_accumulator(False),
        f"dW, 2 x {half} rows, bf16 accumulator": bf16_accumulator,
        f"rounding an fp32 [{v}, {hd}] to bf16": lambda: torch.empty(v, hd, device=dev).to(
            torch.bfloat16
        ),
    }
    print(f"N = {n}, V = {v}, H = {hd}, bf16, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, median of {args.repeats}")  # fmt: skip
    print("| GEMM | median ms |")
    print("|---|---|")
    for name, fn in cases.items():
        print(f"| {name} | {_median_ms(fn, args.repeats):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
