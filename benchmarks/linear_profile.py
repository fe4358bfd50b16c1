"""Where the time of the LM head plus loss goes, kernel by kernel: logits-then-loss beside the
fused-linear op.

``python -m benchmarks.linear_profile [--n 16384] [--v 151936] [--hidden 4096] [--top 12]``

One forward+backward of the benchmark's loss (``benchmarks/workload.py``, bf16) each way, after
two warm-ups, under ``torch.profiler``: the number of GPU kernels, their summed time, and the
most expensive kernels by name (the GEMMs, the two vocabulary phases, elementwise work).
Logits-then-loss runs first, then the fused-linear op. GPU only; prints text.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch


def _kernels(fn: Callable[[], None]) -> dict[str, tuple[float, int]]:
    """``{kernel name: (total ms, calls)}`` of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        name = e.name[:90]
        ms, calls = out.get(name, (0.0, 0))
        out[name] = (ms + e.device_time_total / 1e3, calls + 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear_profile")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--v", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.linear_profile needs a CUDA device; nothing measured")
        return 2
    from benchmarks.workload import loss_config, make_workload
    from echoloss import echo_loss_from_hidden
    from echoloss.loss import echo_loss

    wl = make_workload(
        args.n, args.v, torch.bfloat16, torch.device("cuda"), hidden_size=args.hidden
    )
    assert wl.hidden is not None and wl.weight is not None
    hidden, weight = wl.hidden, wl.weight
    x, cfg = wl.loss_inputs(), loss_config()

    def logits_then_loss() -> None:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        echo_loss(h @ w.t(), x, config=cfg).loss.backward()

    def fused_linear() -> None:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        echo_loss_from_hidden(h, w, x, config=cfg).loss.backward()

    print(f"N = {args.n}, V = {args.v}, H = {args.hidden}, bf16, {torch.cuda.get_device_name()}")
    for name, fn in (("logits-then-loss", logits_then_loss), ("fused-linear", fused_linear)):
        kernels = _kernels(fn)
        total = sum(ms for ms, _ in kernels.values())
        count = sum(c for _, c in kernels.values())
        print(f"== {name}: {count} kernels, kernel ms {total:.2f}")
        for kname, (ms, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {ms:8.3f} ms x{calls:<3d} {kname}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
