"""Kernel launches and host syncs of one ``echo_loss`` forward+backward, eager vs compiled algebra.

``python -m benchmarks.launch_count [--n N] [--v V] [--no-compile] [--modules]``. On CUDA the launches are
the CUDA kernels the profiler records (the two Triton phases included, so the target "≤ 10
besides the phases" reads as ≤ 12); host syncs come from the dispatch-mode counter
(``benchmarks/counting.py``; dynamo does not compile under a dispatch mode, so the syncs of the
compiled row are counted on the same code eagerly). On CPU (no profiler kernels) both columns of
the eager row come from the counter on the CUDA code path, the phases' ops not counted; the
compiled row's launches are not counted there (the counter would see the eager fallback):
``tests/loss/test_launch_counts.py`` counts the launches left outside the compiled regions.
Three loss configurations (`CONFIGS`): the default, ``echoloss-train``'s per-sequence
normalisers, and ``gspo`` with them and a sequence-level mismatch correction (the compiled
algebra for the default only). Prints one Markdown table; ``--modules`` adds one of
`EchoGRPOLoss` (``grpo``, ``dapo`` and sequence-level ``sapo``) with the value checks in Triton and in PyTorch side by
side (on CUDA: kernels and median time; the checks run in PyTorch off CUDA).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.counting import count_ops, uncounted_reference_phases


def _configs() -> dict[str, Any]:
    from echoloss.loss import LossConfig

    sequence_means = dict(
        rl_normalization="sequence_mean_token_mean", echo_normalization="sequence_mean"
    )
    return {
        "dppo": LossConfig(),
        "dppo-sequence-means": LossConfig(**sequence_means),
        "gspo-sequence-means": LossConfig(
            policy="gspo", mismatch="sequence_truncate", **sequence_means
        ),
    }


def _record(n: int, v: int, device: torch.device) -> Any:
    from echoloss.loss import LossInputs

    g = torch.Generator().manual_seed(0)
    rl = torch.rand(n, generator=g) < 0.6
    echo = ~rl & (torch.rand(n, generator=g) < 0.5)
    return LossInputs(
        labels=torch.randint(0, v, (n,), generator=g).to(device),
        rl_mask=rl.to(device),
        echo_weights=torch.where(echo, 0.1, 0.0).to(device),
        advantages=(torch.randn(n, generator=g) * rl).to(device),
        inference_logprobs=(-torch.rand(n, generator=g)).to(device),
        sequence_ids=(torch.arange(n) // max(1, n // 8)).to(device),
        observation_mask=echo.to(device),
    )


def _cuda_kernels(fn: Callable[[], None]) -> tuple[int, dict[str, int]]:
    """Kernels one call runs on the GPU, and how many of each (by name, shortened)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    tally: dict[str, int] = {}
    for name in names:
        short = name.split("<")[0].split("(")[0][:60]
        tally[short] = tally.get(short, 0) + 1
    return len(names), tally


def _cuda_median_ms(fn: Callable[[], None], repeats: int = 21) -> float:
    """Median CUDA-event time (ms) of one call after one warm-up, each after an L2 flush."""
    from benchmarks.harness import time_cuda
    from benchmarks.providers import Context, Outputs

    def run() -> Outputs:
        fn()
        return Outputs()

    ctx = Context(kind="cuda", device=torch.device("cuda"))
    return statistics.median(time_cuda(ctx, run, 1, repeats)) * 1e3


def measure(
    n: int, v: int, device: torch.device, compiled: bool, config: str = "dppo"
) -> dict[str, Any]:
    """Syncs and launches of one forward+backward after a warm-up call."""
    from echoloss._deferred import device_code_path, raise_deferred_errors
    from echoloss.loss import echo_loss
    from echoloss.loss.compiled import compile_loss_algebra

    x = _record(n, v, device)
    logits = torch.randn(n, v, device=device, dtype=torch.bfloat16, requires_grad=True)

    cfg = _configs()[config]

    def step() -> None:
        echo_loss(logits, x, config=cfg).loss.backward()

    compile_loss_algebra(compiled)
    try:
        with device_code_path():
            step()  # warm-up (and the compile)
            raise_deferred_errors()
            with count_ops() as c:
                step()
            launches: int | None = c.num_launches
            kernels: dict[str, int] = {}
            ms = None
            if device.type == "cuda":
                launches, kernels = _cuda_kernels(step)
                ms = _cuda_median_ms(step)
            elif compiled:
                launches = None  # the counter saw the eager fallback, not the compiled code
            raise_deferred_errors()
    finally:
        compile_loss_algebra(False)
    return {
        "config": config,
        "compiled": compiled,
        "host_syncs": c.num_syncs,
        "launches": launches,
        "kernels": kernels,
        "median_ms": ms,
    }


#: The `echoloss.nn` module rows of ``--modules``: (loss_type, importance_sampling_level).
MODULE_CASES = (("grpo", "token"), ("dapo", "token"), ("sapo", "sequence"))


def measure_module(
    n: int, v: int, device: torch.device, loss_type: str, level: str, fused_checks: bool
) -> dict[str, Any]:
    """Syncs, launches and median time of one `EchoGRPOLoss` forward+backward (rows of
    ``T = min(n, 1024)`` tokens, a float attention mask, echo weights on about 30 % of the
    tokens, reference logprobs with ``beta = 0.04``), its value checks in the Triton program
    (``fused_checks``) or in PyTorch: what the one-program-per-check trade costs or saves."""
    from echoloss._deferred import device_code_path, raise_deferred_errors
    from echoloss.nn import EchoGRPOLoss
    from echoloss.ops.value_checks import fuse_value_checks

    t = min(n, 1024)
    b = max(1, n // t)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(b, t)
    mask[:, t - t // 8 :] = 0  # padding at the end of every completion
    echo_weights = torch.where(torch.rand(b, t, generator=g) < 0.3, 0.1, 0.0) * mask
    args = [
        torch.randint(0, v, (b, t), generator=g).to(device),
        mask.to(device),
        torch.randn(b, generator=g).to(device),
        (-torch.rand(b, t, generator=g)).to(device),
    ]
    echo_weights = echo_weights.to(device)
    logits = torch.randn(b, t, v, device=device, dtype=torch.bfloat16, requires_grad=True)
    loss_fn = EchoGRPOLoss(
        loss_type=loss_type, importance_sampling_level=level, max_completion_length=t
    )

    def step() -> None:
        logits.grad = None
        loss_fn(logits, *args, echo_weights=echo_weights).loss.backward()

    fuse_value_checks("auto" if fused_checks else "never")
    try:
        with device_code_path():
            step()  # warm-up (and the Triton compile)
            raise_deferred_errors()
            with count_ops() as c:
                step()
            launches, ms = c.num_launches, None
            if device.type == "cuda":
                launches, _ = _cuda_kernels(step)
                ms = _cuda_median_ms(step)
            raise_deferred_errors()
    finally:
        fuse_value_checks("auto")
    return {
        "config": f"EchoGRPOLoss {loss_type} ({level})",
        "checks": "triton" if fused_checks and device.type == "cuda" else "pytorch",
        "host_syncs": c.num_syncs,
        "launches": launches,
        "median_ms": ms,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.launch_count")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--v", type=int, default=32000)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--modules",
        action="store_true",
        help="also time EchoGRPOLoss with the value checks in Triton and in PyTorch",
    )
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        # The phases are not counted on CPU (they are two Triton launches on CUDA).
        import importlib

        phases = uncounted_reference_phases()
        op = importlib.import_module("echoloss.ops.selective_logprobs.op")
        setattr(op, "resolve_backend", lambda b, d: phases)  # noqa: B010 (a module's name)
    rows = [measure(args.n, args.v, device, False, config) for config in _configs()]
    if not args.no_compile:
        rows.insert(1, measure(args.n, args.v, device, True))
    print(f"echo_loss forward+backward, N = {args.n}, V = {args.v}, bf16, {device.type}")
    print("| config | algebra | host syncs | launches | median ms (CUDA) |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = "compiled" if r["compiled"] else "eager"
        launches = "not counted on CPU" if r["launches"] is None else r["launches"]
        ms = "" if r["median_ms"] is None else f"{r['median_ms']:.3f}"
        print(f"| {r['config']} | {name} | {r['host_syncs']} | {launches} | {ms} |")
    for r in rows:
        if r["kernels"]:
            tally = ", ".join(f"{k} x{c}" for k, c in sorted(r["kernels"].items()))
            print(f"\n{r['config']} ({'compiled' if r['compiled'] else 'eager'}): {tally}")
    if args.modules:
        _print_modules(args.n, args.v, device)
    return 0


def _print_modules(n: int, v: int, device: torch.device) -> None:
    """The ``--modules`` table: each module case with the value checks fused, then in PyTorch
    (the same rows off CUDA, where the checks always run in PyTorch)."""
    print(f"\nEchoGRPOLoss forward+backward, N = {n} tokens, V = {v}, bf16, {device.type}")
    print("| module | value checks | host syncs | launches | median ms (CUDA) |")
    print("|---|---|---|---|---|")
    for loss_type, level in MODULE_CASES:
        for fused in (True, False):
            r = measure_module(n, v, device, loss_type, level, fused)
            ms = "" if r["median_ms"] is None else f"{r['median_ms']:.3f}"
            print(f"| {r['config']} | {r['checks']} | {r['host_syncs']} | {r['launches']} | {ms} |")


if __name__ == "__main__":
    raise SystemExit(main())
