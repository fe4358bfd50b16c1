"""Where the time of one loss forward+backward goes on a GPU: kernels, launches, host time.

``python -m benchmarks.profile_step [--n 16384,4096] [--v 151936,32000] [--providers triton,trl]``

For each shape and provider (the benchmark's own, ``benchmarks/providers.py``, bf16 logits):

* **median ms**: CUDA-event time of forward+backward (15 calls after 3 warm-ups; the
  benchmark's harness also flushes L2 before each call, this does not);
* **host ms**: the host time of issuing one forward+backward (the GPU idle at the start); when
  it is close to the median, the host, not the GPU, sets the speed;
* **kernels** and **kernel ms**: the CUDA kernels one call runs and their summed GPU time
  (``torch.profiler``), with the most expensive ones listed.

GPU only. Prints Markdown; ``--output FILE`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _event_ms(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def _host_ms(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return out


def _kernels(fn: Callable[[], Any]) -> dict[str, list[float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            entry = by_name.setdefault(e.name[:80], [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time / 1e3
    return by_name


def profile_one(n: int, v: int, provider: str) -> dict[str, Any]:
    """The row of one shape and provider (see the module docstring)."""
    from benchmarks.providers import REGISTRY, Context
    from benchmarks.workload import make_workload

    ctx = Context(kind="cuda", device=torch.device("cuda"))
    prov = REGISTRY[provider]
    why = prov.unavailable(ctx)
    if why:
        return {"n": n, "v": v, "provider": provider, "skipped": why}
    wl = make_workload(n, v, torch.bfloat16, ctx.device)
    run = prov.build(wl, "forward+backward", ctx)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    median = statistics.median(_event_ms(run, 15))
    host = statistics.median(_host_ms(run, 15))
    kern = _kernels(run)
    top = sorted(((k, int(c), t) for k, (c, t) in kern.items()), key=lambda r: -r[2])
    del wl, run
    torch.cuda.empty_cache()
    return {
        "n": n,
        "v": v,
        "provider": provider,
        "median_ms": median,
        "host_ms": host,
        "kernels": sum(c for _, c, _ in top),
        "kernel_ms": sum(t for _, _, t in top),
        "top": top[:8],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step")
    p.add_argument("--n", type=_ints, default=[16384, 4096])
    p.add_argument("--v", type=_ints, default=[151936, 32000])
    p.add_argument("--providers", type=lambda s: s.split(","), default=["triton", "trl"])
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.profile_step needs a CUDA device; nothing measured")
        return 2
    rows = [
        profile_one(n, v, prov)
        for n, v in zip(args.n, args.v, strict=True)
        for prov in args.providers
    ]
    print(f"one forward+backward, bf16, {torch.cuda.get_device_name()}")
    print("| N | V | provider | median ms | host ms | kernels | kernel ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['n']} | {r['v']} | {r['provider']} | skipped: {r['skipped']} | | | |")
            continue
        print(
            f"| {r['n']} | {r['v']} | {r['provider']} | {r['median_ms']:.2f} | "
            f"{r['host_ms']:.2f} | {r['kernels']} | {r['kernel_ms']:.2f} |"
        )
    for r in rows:
        if "top" in r:
            print(f"\n{r['provider']} N={r['n']} V={r['v']}: most expensive kernels")
            for name, count, ms in r["top"]:
                print(f"  {ms:8.3f} ms  x{count:<3d} {name}")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
