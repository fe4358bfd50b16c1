"""One PNG per sweep: median time (with the quartiles as error bars) and peak extra memory per
provider, one column per mode, one pair of rows per op; the bandwidth floor where it is known."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.workload import MODES


def _shape_label(r: dict[str, Any]) -> str:
    s = f"N={r['n']}\nV={r['v']}"
    if r.get("h"):
        s += f"\nH={r['h']}"
    return s + f"\n{r['dtype']}"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Write the chart; None (and nothing written) when matplotlib is missing or nothing ran."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in rows if r.get("op") in ("loss", "linear")]
    ops = [op for op in ("loss", "linear") if any(r["op"] == op for r in rows)]
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    if not ops or not modes:
        return None
    fig, axes = plt.subplots(
        2 * len(ops), len(modes), figsize=(5.2 * len(modes), 4.2 * len(ops) * 2), squeeze=False
    )
    for oi, op in enumerate(ops):
        op_rows = [r for r in rows if r["op"] == op]
        shapes: list[str] = []
        for r in op_rows:
            lab = _shape_label(r)
            if lab not in shapes:
                shapes.append(lab)
        providers = list(dict.fromkeys(r["provider"] for r in op_rows))
        for mi, mode in enumerate(modes):
            ax_t, ax_m = axes[2 * oi, mi], axes[2 * oi + 1, mi]
            floor: dict[int, float] = {}
            for p in providers:
                xs, ys, lo, hi, mx, my = [], [], [], [], [], []
                for r in op_rows:
                    if r["provider"] != p or r["mode"] != mode or r["time_ms"] is None:
                        continue
                    x = shapes.index(_shape_label(r))
                    t = r["time_ms"]
                    xs.append(x)
                    ys.append(t["median"])
                    lo.append(t["median"] - t["p25"])
                    hi.append(t["p75"] - t["median"])
                    if r.get("peak_extra_bytes") is not None:
                        mx.append(x)
                        my.append(max(r["peak_extra_bytes"], 0) / 2**20)
                    if r.get("floor_ms") is not None:
                        floor[x] = r["floor_ms"]
                if xs:
                    ax_t.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=p)
                if mx:
                    ax_m.plot(mx, my, marker="o", label=p)
            if floor:
                fx = sorted(floor)
                ax_t.plot(
                    fx,
                    [floor[x] for x in fx],
                    "k--",
                    label="bandwidth floor",
                )
            for ax, ylabel in ((ax_t, "median time (ms)"), (ax_m, "peak extra memory (MiB)")):
                ax.set_yscale("log")
                ax.set_xticks(range(len(shapes)))
                ax.set_xticklabels(shapes, fontsize=7)
                ax.set_ylabel(ylabel)
                ax.set_title(f"{op}: {mode}", fontsize=10)
                ax.grid(True, which="both", alpha=0.3)
            ax_t.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
