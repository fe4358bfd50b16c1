"""Markdown tables from result files: ``python -m benchmarks.report FILE.jsonl [...]``.

One table per (op, shape, dtype): a row per mode and provider with the median time and its
quartiles, the peak extra memory, the effective bandwidth (and the fraction of the floor when the
GPU's peak is known) or the model TFLOP/s; gate failures and skips show their status instead of
numbers. ``docs/benchmarks.md`` is written from this output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.workload import MODES


def load(paths: list[str]) -> list[dict[str, Any]]:
    rows = []
    for p in paths:
        rows += [json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()]
    return rows


def _cell(r: dict[str, Any]) -> list[str]:
    if r["status"] != "ok" or r["time_ms"] is None:
        why = r["status"]
        if r["status"] == "gate-failed":
            bad = [
                f"{k} max abs err {c.get('max_abs_err', c.get('abs_err')):.2g}"
                for k, c in r["gate"]["checks"].items()
                if not c["passed"]
            ]
            why += ": " + ", ".join(bad)
        return [why, "", ""]
    t = r["time_ms"]
    mem = r["peak_extra_bytes"]
    rate = ""
    if r["effective_GBps"] is not None:
        rate = f"{r['effective_GBps']:.1f} GB/s"
        if r["pct_of_peak_bandwidth"] is not None:
            rate += f" ({r['pct_of_peak_bandwidth']:.0f}%)"
    elif r["model_TFLOPs"] is not None:
        rate = f"{r['model_TFLOPs'] * 1e3:.1f} GFLOP/s"
    return [
        f"{t['median']:.1f} [{t['p25']:.1f}–{t['p75']:.1f}]",
        "" if mem is None else f"{mem / 2**20:.1f}",
        rate,
    ]


def tables(rows: list[dict[str, Any]]) -> str:
    out = []
    keys = list(dict.fromkeys((r["op"], r["n"], r["v"], r["h"], r["dtype"]) for r in rows))
    for op, n, v, h, dtype in keys:
        if op not in ("loss", "linear"):
            continue
        sel = [
            r for r in rows if (r["op"], r["n"], r["v"], r["h"], r["dtype"]) == (op, n, v, h, dtype)
        ]
        head = f"**{op}**, N = {n}, V = {v}" + (f", H = {h}" if h else "") + f", {dtype}"
        rate = "GB/s (floor bytes / time)" if op == "loss" else "model FLOP/s"
        out += [head, "", f"| mode | provider | median ms [p25–p75] | peak extra MiB | {rate} |"]
        out.append("|---|---|---|---|---|")
        for mode in MODES:
            for r in sel:
                if r["mode"] == mode and r["status"] != "skipped":
                    out.append("| " + " | ".join([mode, r["provider"], *_cell(r)]) + " |")
        skipped = sorted(
            {f"{r['provider']} ({r['reason']})" for r in sel if r["status"] == "skipped"}
        )
        if skipped:
            out += ["", "Skipped: " + "; ".join(skipped) + "."]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__)
        return 2
    print(tables(load(paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
