"""One PNG per sweep: median time (with the quartiles as error bars) and peak extra memory per
provider, one column per mode, one pair of rows per op; the bandwidth floor where it is known.

``python -m benchmarks.plot FILE.jsonl [...]`` redraws ``FILE.png`` from saved results;
``--split-dir DIR`` also writes one small PNG per op and mode (``DIR/<sweep>_<op>_<mode>.png``),
readable at the width of a documentation page."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.workload import MODES


def _shape_label(r: dict[str, Any]) -> str:
    s = f"N={r['n']}\nV={r['v']}"
    if r.get("h"):
        s += f"\nH={r['h']}"
    return s + f"\n{r['dtype']}"


def _draw(ax_t: Any, ax_m: Any, rows: list[dict[str, Any]], op: str, mode: str) -> None:
    """Median time (quartile error bars, bandwidth floor) on ``ax_t`` and peak extra memory on
    ``ax_m`` for one op and mode, one line per provider and dtype."""
    op_rows = [r for r in rows if r["op"] == op]
    shapes: list[str] = []
    for r in op_rows:
        lab = _shape_label(r)
        if lab not in shapes:
            shapes.append(lab)
    providers = list(dict.fromkeys(r["provider"] for r in op_rows))
    floor: dict[int, float] = {}
    for pi, p in enumerate(providers):
        color = f"C{pi % 10}"
        labelled = False
        # One line per dtype: points of different dtypes are not joined.
        for dtype in dict.fromkeys(r["dtype"] for r in op_rows):
            xs, ys, lo, hi, mx, my = [], [], [], [], [], []
            for r in op_rows:
                if (r["provider"], r["mode"], r["dtype"]) != (p, mode, dtype):
                    continue
                if r["time_ms"] is None:
                    continue
                x = shapes.index(_shape_label(r))
                t = r["time_ms"]
                xs.append(x)
                ys.append(t["median"])
                lo.append(t["median"] - t["p25"])
                hi.append(t["p75"] - t["median"])
                if r.get("peak_extra_bytes"):
                    mx.append(x)
                    my.append(r["peak_extra_bytes"] / 2**20)
                if r.get("floor_ms") is not None:
                    floor[x] = r["floor_ms"]
            label = None if labelled else p
            if xs:
                ax_t.errorbar(
                    xs, ys, yerr=[lo, hi], marker="o", capsize=3, color=color, label=label
                )
                labelled = True
            if mx:
                ax_m.plot(mx, my, marker="o", color=color, label=label)
    if floor:
        fx = sorted(floor)
        ax_t.plot(
            fx, [floor[x] for x in fx], "k--", marker="_", label="bandwidth floor (datasheet peak)"
        )
    for ax, ylabel in ((ax_t, "median time (ms)"), (ax_m, "peak extra memory (MiB)")):
        ax.set_yscale("log")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{op}: {mode}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _ops_and_modes(rows: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    ops = [op for op in ("loss", "linear") if any(r.get("op") == op for r in rows)]
    modes = [m for m in MODES if any(r.get("mode") == m for r in rows)]
    return ops, modes


def plot_split(rows: list[dict[str, Any]], directory: Path, stem: str, title: str) -> list[Path]:
    """One small PNG per op and mode (time and memory side by side), readable at the width of a
    documentation page: ``directory/{stem}_{op}_{mode}.png``. Nothing written (``[]``) when
    matplotlib is missing or nothing ran."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("op") in ("loss", "linear")]
    ops, modes = _ops_and_modes(rows)
    if plt is None or not ops or not modes:
        return []
    out = []
    for op in ops:
        for mode in modes:
            fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
            _draw(ax_t, ax_m, rows, op, mode)
            fig.suptitle(f"{title}: {op}, {mode}", fontsize=10)
            fig.tight_layout()
            path = directory / f"{stem}_{op}_{mode.replace('+', '-')}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=110)
            plt.close(fig)
            out.append(path)
    return out


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Write the chart; None (and nothing written) when matplotlib is missing or nothing ran."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("op") in ("loss", "linear")]
    ops, modes = _ops_and_modes(rows)
    if plt is None or not ops or not modes:
        return None
    fig, axes = plt.subplots(
        2 * len(ops), len(modes), figsize=(5.2 * len(modes), 4.2 * len(ops) * 2), squeeze=False
    )
    for oi, op in enumerate(ops):
        for mi, mode in enumerate(modes):
            _draw(axes[2 * oi, mi], axes[2 * oi + 1, mi], rows, op, mode)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    split_dir = None
    if "--split-dir" in args:  # also one small PNG per op and mode, for the docs
        i = args.index("--split-dir")
        split_dir = Path(args[i + 1])
        del args[i : i + 2]
    paths = [Path(p) for p in args]
    for path in paths:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        env = rows[0]["env"] if rows else {}
        bw = env.get("peak_bandwidth_Bps")
        title = f"{rows[0]['sweep'] if rows else path.stem} — {env.get('device_name', '')}"
        title += f", floor at {bw / 1e12:.2f} TB/s" if bw else ""
        out = plot(rows, path.with_suffix(".png"), title)
        print(f"wrote {out}" if out else f"nothing to plot in {path}")
        if split_dir is not None:
            for p in plot_split(rows, split_dir, path.stem.split("_")[0], title):
                print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
