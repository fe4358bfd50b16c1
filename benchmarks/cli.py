"""``python -m benchmarks``: run a sweep, write JSON lines (and a PNG) into ``--output``.

Examples (from the repository root)::

    python -m benchmarks --device cpu --quick --output /tmp/bench     # < 1 minute on 2 cores
    python -m benchmarks --device cpu                                  # the CPU sweep
    python -m benchmarks --device cuda                                 # the GPU sweep
    python -m benchmarks --device cuda --quick --sweep-launch          # + BLOCK_V / num_warps
    python -m benchmarks --device cuda --n 16384 --v 151936 --providers reference,triton,liger

Exit status: 0 when every echoloss provider (and the naive baseline) passed the correctness
gate, 1 when one failed it or crashed (its row says why), 2 when the device is not there. A peer
(TRL, Liger, torch.compile) that fails the gate is recorded and reported, not a failure.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.plot import plot
from benchmarks.providers import REGISTRY, Context
from benchmarks.workload import MODES, make_workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Shapes:
    """One block of a sweep: the product of ``ns`` × ``vs`` for one op, dtype and provider set."""

    op: str
    dtype: str
    ns: tuple[int, ...]
    vs: tuple[int, ...]
    providers: tuple[str, ...]
    hidden: int | None = None


@dataclass(frozen=True)
class Sweep:
    name: str
    blocks: tuple[Shapes, ...]
    repeats: int
    warmup: int = 0
    modes: tuple[str, ...] = MODES
    extra: dict[str, Any] = field(default_factory=dict)


CPU_LOSS = ("naive", "reference", "trl")
GPU_LOSS = ("naive", "reference", "triton", "torch-compile", "trl", "liger")
LINEAR = ("linear-naive", "linear-echoloss", "fused-linear")
CHECK_LOSS = ("naive", "triton", "trl", "liger")
V_GPU = (32000, 128256, 151936, 262144)  # Llama-2/Mistral, Llama-3, Qwen2.5/3, Gemma 3

SWEEPS: dict[tuple[str, str], Sweep] = {
    ("cpu", "smoke"): Sweep(
        "cpu-smoke",
        (
            Shapes("loss", "float32", (256,), (4096,), CPU_LOSS),
            Shapes("linear", "float32", (256,), (4096,), LINEAR, hidden=64),
        ),
        repeats=3,
    ),
    ("cpu", "quick"): Sweep(
        "cpu-quick", (Shapes("loss", "float32", (1024,), (32000,), CPU_LOSS),), repeats=5
    ),
    ("cpu", "full"): Sweep(
        "cpu-full",
        (
            Shapes(
                "loss",
                "float32",
                (1024, 2048),
                (32000, 128256, 151936),
                (*CPU_LOSS, "torch-compile"),
            ),
            Shapes("loss", "bfloat16", (1024,), (32000, 151936), CPU_LOSS),
            Shapes("linear", "float32", (1024, 2048), (32000, 151936), LINEAR, hidden=256),
        ),
        repeats=5,
    ),
    # The check: one table, echoloss vs its peers at shapes of real models (bf16), fwd+bwd.
    ("cpu", "check"): Sweep(
        "cpu-check",
        (
            Shapes("loss", "float32", (64, 256), (301, 4096), ("naive", "reference", "trl")),
            Shapes("linear", "float32", (64,), (301,), LINEAR, hidden=32),
        ),
        repeats=3,
        modes=("forward+backward",),
    ),
    ("cuda", "check"): Sweep(
        "cuda-check",
        (
            Shapes("loss", "bfloat16", (4096,), (32000,), CHECK_LOSS),
            Shapes("loss", "bfloat16", (16384,), (128256, 151936, 262144), CHECK_LOSS),
            Shapes("loss", "bfloat16", (65536,), (151936,), CHECK_LOSS),
            Shapes("linear", "bfloat16", (16384,), (151936,), LINEAR, hidden=4096),
        ),
        repeats=10,
        warmup=2,
        modes=("forward+backward",),
    ),
    ("cuda", "smoke"): Sweep(
        "cuda-smoke",
        (
            Shapes("loss", "bfloat16", (64,), (301,), ("reference", "triton", "liger")),
            Shapes("linear", "bfloat16", (64,), (301,), LINEAR, hidden=16),
        ),
        repeats=2,
    ),
    ("cuda", "quick"): Sweep(
        "cuda-quick",
        (
            Shapes("loss", "bfloat16", (16384,), (151936,), GPU_LOSS),
            Shapes("linear", "bfloat16", (16384,), (151936,), LINEAR, hidden=4096),
        ),
        repeats=20,
        warmup=3,
    ),
    ("cuda", "full"): Sweep(
        "cuda-full",
        (
            Shapes("loss", "bfloat16", (4096, 16384, 65536), V_GPU, GPU_LOSS),
            Shapes("linear", "bfloat16", (4096, 16384), V_GPU, LINEAR, hidden=4096),
        ),
        repeats=10,
        warmup=2,
    ),
}


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _names(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="echoloss kernel benchmarks: correctness-gated, side by side, JSON lines.",
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="cuda if available, else cpu"
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="one representative shape")
    size.add_argument("--smoke", action="store_true", help="tiny shapes (tests; seconds)")
    size.add_argument(
        "--check",
        action="store_true",
        help="one table: echoloss vs TRL vs Liger vs naive at 5 shapes + fused-linear (fwd+bwd)",
    )
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="directory for results")
    p.add_argument("--name", default=None, help="file stem (default: <sweep>_<device>_<time>)")
    p.add_argument("--n", type=_ints, default=None, help="override N (comma list)")
    p.add_argument("--v", type=_ints, default=None, help="override V (comma list)")
    p.add_argument("--hidden", type=int, default=None, help="override H of the linear op")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="override the dtype")
    p.add_argument(
        "--ops", type=_names, default=None, help="subset of: loss,linear; or chat (on its own)"
    )
    p.add_argument("--providers", type=_names, default=None, help="subset of the providers")
    p.add_argument("--modes", type=_names, default=None, help=f"subset of: {','.join(MODES)}")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="CUDA warm-up calls (after the gate)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (CPU default 1: reproducible on a shared machine)",
    )
    p.add_argument(
        "--peak-bandwidth",
        type=float,
        default=None,
        help="GPU peak bandwidth in GB/s for the floor (default: datasheet table)",
    )
    p.add_argument("--sweep-launch", action="store_true", help="GPU: time BLOCK_V/num_warps")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--list", action="store_true", help="list providers and sweeps, then exit")
    return p.parse_args(argv)


def select(args: argparse.Namespace, kind: str) -> Sweep:
    """The sweep for the device and size, with the command-line overrides applied."""
    size = "smoke" if args.smoke else "quick" if args.quick else "check" if args.check else "full"
    sw = SWEEPS[(kind, size)]
    blocks = []
    for b in sw.blocks:
        if args.ops and b.op not in args.ops:
            continue
        prov = b.providers
        if args.providers:
            prov = tuple(x for x in args.providers if REGISTRY.get(x) and REGISTRY[x].op == b.op)
            if not prov:
                continue
        blocks.append(
            replace(
                b,
                providers=prov,
                ns=args.n or b.ns,
                vs=args.v or b.vs,
                dtype=args.dtype or b.dtype,
                hidden=(args.hidden or b.hidden) if b.op == "linear" else None,
            )
        )
    unknown = set(args.providers or ()) - set(REGISTRY)
    if unknown:
        raise SystemExit(f"unknown providers {sorted(unknown)}; known: {sorted(REGISTRY)}")
    modes = sw.modes
    if args.modes:
        bad = set(args.modes) - set(MODES)
        if bad:
            raise SystemExit(f"unknown modes {sorted(bad)}; known: {MODES}")
        modes = tuple(m for m in MODES if m in args.modes)
    # Ops that only exist as one block keep their dedup order (loss first).
    dedup: list[Shapes] = []
    for b in blocks:
        if b not in dedup:
            dedup.append(b)
    custom = any(
        getattr(args, k) for k in ("n", "v", "hidden", "dtype", "ops", "providers", "modes")
    )
    return replace(
        sw,
        name=sw.name + ("-custom" if custom else ""),
        blocks=tuple(dedup),
        modes=modes,
        repeats=args.repeats or sw.repeats,
        warmup=sw.warmup if args.warmup is None else args.warmup,
    )


def check_table(rows: list[dict[str, Any]]) -> str:
    """The check's one table: a line per (op, shape, provider), forward+backward.

    ``% floor``: the 3-pass bandwidth floor (read the logits twice, write the gradient once)
    over the median time, when the GPU's peak bandwidth is known. ``syncs`` / ``launches``: of
    one call on the CUDA code path, Triton kernels not counted.
    """
    head = "| op | N | V | H | provider | median ms | % floor | syncs | launches | extra MiB |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r.get("time_ms")
        med = f"{t['median']:.2f}" if t else r["status"]
        pct = r.get("pct_of_peak_bandwidth")
        mem = r.get("peak_extra_bytes")
        cells = [
            r["op"],
            str(r["n"]),
            str(r["v"]),
            str(r["h"] or ""),
            r["provider"],
            med,
            "" if pct is None else f"{pct:.0f}",
            "" if r.get("host_syncs") is None else str(r["host_syncs"]),
            "" if r.get("launches") is None else str(r["launches"]),
            "" if mem is None else f"{mem / 2**20:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_")[:40]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for p in REGISTRY.values():
            print(f"{p.name:16s} [{p.op}] {p.description}")
        for (kind, size), sw in SWEEPS.items():
            print(
                f"{kind:5s} {size:6s} {sw.name}: {[(b.op, b.ns, b.vs, b.dtype) for b in sw.blocks]}"
            )
        return 0
    if args.ops and "chat" in args.ops:  # chat attribution: CPU, no tensors, its own runner
        from benchmarks.chat_attribution import main as chat_main

        argv_chat = ["--repeats", str(args.repeats or 9), *(["--smoke"] if args.smoke else [])]
        return chat_main(argv_chat, output=args.output)
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks: --device cuda needs a CUDA device (none found); nothing measured",
            file=sys.stderr,
        )
        return 2
    return run(args, Context(kind=kind, device=torch.device(kind)))


def run(args: argparse.Namespace, ctx: Context) -> int:
    """Run the selected sweep in ``ctx`` (the CPU smoke tests pass a stubbed CUDA context)."""
    sweep = select(args, ctx.kind)
    threads = args.threads or (1 if ctx.kind == "cpu" else torch.get_num_threads())
    torch.set_num_threads(threads)
    name = harness.device_name(ctx)
    peak_bw = args.peak_bandwidth * 1e9 if args.peak_bandwidth else harness.peak_bandwidth(name)
    env = harness.environment(ctx, threads, peak_bw)
    env["loadavg_start"] = harness.loadavg()
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    stem = args.name or f"{sweep.name}_{_slug(name)}_{stamp}"
    args.output.mkdir(parents=True, exist_ok=True)
    out_path = args.output / f"{stem}.jsonl"
    print(f"{sweep.name} on {name} ({ctx.kind}, {threads} threads), repeats {sweep.repeats}")
    if peak_bw:
        print(f"peak bandwidth {peak_bw / 1e12:.2f} TB/s (floor = bytes / peak)")
    rows: list[dict[str, Any]] = []
    with out_path.open("w") as f:
        for block in sweep.blocks:
            provs = [REGISTRY[p] for p in block.providers]
            for n in block.ns:
                for v in block.vs:
                    print(
                        f"\n{block.op} N={n} V={v}"
                        + (f" H={block.hidden}" if block.hidden else "")
                        + f" {block.dtype}"
                    )
                    try:
                        wl = make_workload(
                            n, v, DTYPES[block.dtype], ctx.device, hidden_size=block.hidden
                        )
                    except Exception as e:
                        if not harness._is_oom(e):
                            raise
                        print(f"  inputs do not fit: {e}")
                        continue
                    base = harness.base_row(sweep.name, wl, env)
                    new = harness.run_shape(
                        ctx,
                        wl,
                        provs,
                        list(sweep.modes),
                        repeats=sweep.repeats,
                        warmup=sweep.warmup,
                        base_row=base,
                        peak_bw=peak_bw,
                    )
                    if args.sweep_launch and block.op == "loss" and ctx.kind == "cuda":
                        from benchmarks.launch import sweep_launch

                        new += sweep_launch(ctx, wl, sweep.warmup, sweep.repeats, base)
                    for r in new:
                        f.write(json.dumps(r) + "\n")
                    f.flush()
                    rows += new
                    del wl
                    if ctx.kind == "cuda":
                        torch.cuda.empty_cache()
    print(f"\nwrote {out_path}")
    if not args.no_plot:
        bw = f", floor at {peak_bw / 1e12:.2f} TB/s" if peak_bw else ""
        png = plot(rows, args.output / f"{stem}.png", f"{sweep.name} — {name}{bw}")
        print(
            f"wrote {png}" if png else "no plot (matplotlib missing: pip install 'echoloss[bench]')"
        )
    if args.check:
        print("\n" + check_table(rows))
    red = [r for r in rows if r["status"] in ("gate-failed", "error")]
    bad = [r for r in red if REGISTRY[r["provider"]].ours]
    for r in red:
        what = "FAILED" if r in bad else "peer disagrees (recorded, not a failure)"
        print(
            f"{what}: {r['op']} {r['provider']} {r['mode']} N={r['n']} V={r['v']} {r['dtype']}: "
            f"{r['status']}",
            file=sys.stderr,
        )
    return 1 if bad else 0
