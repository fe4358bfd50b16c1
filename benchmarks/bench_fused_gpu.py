"""Deprecated entry point, kept for its command line and JSON: use ``python -m benchmarks``.

The fused-kernel issue's GPU benchmark (N = 16,384, V = 151,936, bf16, forward+backward of the
split loss) now runs through the harness (:mod:`benchmarks.harness`): the same providers, gate,
CUDA-event timing, peak memory and 3-pass floor, plus the launch-parameter sweep
(``--sweep-launch``, :mod:`benchmarks.launch`) and the fused-linear op (``--hidden H``). This
wrapper maps its old flags onto the harness and writes the old single-document JSON (with the
harness rows under ``"rows"``). The equivalent harness command::

    python -m benchmarks --device cuda --quick --modes forward+backward [--sweep-launch]

Usage::

    python benchmarks/bench_fused_gpu.py [--n 16384] [--v 151936] [--repeats 20]
        [--providers reference,triton,compiled_reference,liger] [--sweep-launch] [--hidden 4096]

Refuses to run (exit 2) without a CUDA device.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness
from benchmarks.providers import REGISTRY, Context
from benchmarks.workload import make_workload

PROVIDERS = ("reference", "triton", "compiled_reference", "liger")
#: Where everything is allocated (a module constant so that the CPU smoke test can redirect it).
DEVICE = torch.device("cuda")
_HARNESS_NAME = {"compiled_reference": "torch-compile"}
MODE = "forward+backward"


def _legacy_entry(row: dict[str, Any], logits_bytes: int) -> dict[str, Any]:
    if row["status"] == "skipped":
        return {"status": f"skipped: {row['reason']}"}
    entry: dict[str, Any] = {"status": row["status"]}
    if row["gate"] is not None:
        entry["gate"] = {"passed": row["gate"]["passed"], **row["gate"]["checks"]}
    if row["status"] != "ok":
        entry["reason"] = row["reason"]
        return entry
    t = row["time_ms"]
    entry.update(median_ms=t["median"], p25_ms=t["p25"], p75_ms=t["p75"])
    entry["peak_extra_bytes"] = row["peak_extra_bytes"]
    entry["peak_extra_over_logits"] = row["peak_extra_bytes"] / logits_bytes
    entry["effective_GBps_3pass"] = row["effective_GBps"]
    if row["pct_of_peak_bandwidth"] is not None:
        entry["fraction_of_3pass_floor"] = row["pct_of_peak_bandwidth"] / 100
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=16_384)
    p.add_argument("--v", type=int, default=151_936)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--sweep-launch", action="store_true", help="time BLOCK_V/num_warps candidates")
    p.add_argument("--hidden", type=int, default=0, help="H > 0 adds the fused-linear providers")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_fused_gpu: needs a CUDA device (none found); nothing was measured",
            file=sys.stderr,
        )
        return 2
    names = [s for s in args.providers.split(",") if s]
    unknown = set(names) - set(PROVIDERS)
    if unknown:
        p.error(f"unknown providers {sorted(unknown)}; choose from {PROVIDERS}")
    names = ["reference", *[s for s in names if s != "reference"]]

    ctx = Context(kind="cuda", device=DEVICE)
    gpu = harness.device_name(ctx)
    peak_bw = harness.peak_bandwidth(gpu)
    env = harness.environment(ctx, torch.get_num_threads(), peak_bw)
    wl = make_workload(args.n, args.v, torch.bfloat16, DEVICE)
    base = harness.base_row("bench_fused_gpu", wl, env)
    provs = [REGISTRY[_HARNESS_NAME.get(s, s)] for s in names]
    rows = harness.run_shape(
        ctx,
        wl,
        provs,
        [MODE],
        repeats=args.repeats,
        warmup=args.warmup,
        base_row=base,
        peak_bw=peak_bw,
    )
    results = {s: _legacy_entry(r, wl.logits_bytes) for s, r in zip(names, rows, strict=True)}
    ok = {k: r for k, r in results.items() if r["status"] == "ok"}
    if "reference" in ok:
        for r in ok.values():
            r["speedup_vs_reference"] = ok["reference"]["median_ms"] / r["median_ms"]
    red = [k for k, r in results.items() if r["status"] in ("gate-failed", "error")]
    traffic = harness.floor_bytes(wl, MODE)
    assert traffic is not None
    doc: dict[str, Any] = {
        "benchmark": "fused_gpu",
        "timestamp": env["timestamp"],
        "gpu": gpu,
        "gpu_peak_bandwidth_Bps": peak_bw,
        "versions": env["versions"],
        "cuda": env["cuda"],
        "git_sha": env["git_sha"],
        "shape": {"N": args.n, "V": args.v, "dtype": "bf16", "rows": "60% RL, 30% echo, 10% idle"},
        "floor_ms_3pass": None if peak_bw is None else traffic / peak_bw * 1e3,
        "logits_bytes": wl.logits_bytes,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "providers": results,
        "red_gates": red,
        "rows": rows,
    }
    if args.sweep_launch:
        from benchmarks.launch import sweep_launch

        launch = sweep_launch(ctx, wl, args.warmup, args.repeats, base)
        doc["rows"] += launch
        merged: dict[tuple[int, int], dict[str, Any]] = {}
        for r in launch:
            m = merged.setdefault(
                (r["block_v"], r["num_warps"]),
                {"block_v": r["block_v"], "num_warps": r["num_warps"], "status": r["status"]},
            )
            m["forward" if r["mode"] == "phase1" else "backward"] = r["time_ms"]
        doc["launch_sweep"] = list(merged.values())
    if args.hidden > 0:
        del wl
        wlh = make_workload(args.n, args.v, torch.bfloat16, DEVICE, hidden_size=args.hidden)
        lin = [REGISTRY["fused-linear"], REGISTRY["linear-echoloss"]]
        lrows = harness.run_shape(
            ctx,
            wlh,
            lin,
            [MODE],
            repeats=args.repeats,
            warmup=args.warmup,
            base_row=harness.base_row("bench_fused_gpu", wlh, env),
            peak_bw=peak_bw,
        )
        doc["rows"] += lrows
        fl = {r["provider"]: r for r in lrows}
        g = fl["fused-linear"]["gate"]
        doc["fused_linear"] = {
            "H": args.hidden,
            "fused_linear": _legacy_entry(fl["fused-linear"], wlh.logits_bytes),
            "linear_then_logits": _legacy_entry(fl["linear-echoloss"], wlh.logits_bytes),
            "gate": None
            if g is None
            else {
                "passed": g["passed"],
                "loss_rel_err": g["checks"]["loss"]["abs_err"]
                / max(abs(g["checks"]["loss"]["reference"]), 1e-30),
                **{k: c["max_abs_err"] for k, c in g["checks"].items() if k != "loss"},
            },
        }
        if g is not None and not g["passed"]:
            red.append("fused_linear")

    slug = re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_")
    out = (
        Path(args.out)
        if args.out
        else Path(__file__).resolve().parent
        / "results"
        / f"fused_gpu_{slug}_N{args.n}_V{args.v}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{gpu}  N={args.n} V={args.v} bf16  (floor {doc['floor_ms_3pass']} ms)")
    for k, r in results.items():
        sp = f"  {r['speedup_vs_reference']:.2f}x" if "speedup_vs_reference" in r else ""
        t = f"{r['median_ms']:8.2f} ms" if "median_ms" in r else r["status"]
        print(f"  {k:20s} {t}{sp}")
    print(f"wrote {out}  ({_dt.datetime.now(_dt.timezone.utc):%H:%M:%S} UTC)")
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
