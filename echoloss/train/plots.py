"""PNG plots of a run's ``metrics.jsonl`` (matplotlib, no display needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["PANELS", "plot_run", "read_metrics"]

# (title, metric keys) per panel of the run plot.
PANELS: list[tuple[str, list[str]]] = [
    ("held-out success (fixed held-out tasks)", ["eval_success_greedy", "eval_success_sampled"]),
    ("reward (training rollouts; mean of the last 10 steps)", ["reward"]),
    (
        "held-out observation CE (nats/token)",
        ["heldout_hidden_ce", "hidden_ce_floor", "heldout_obs_ce", "obs_ce_floor"],
    ),
    ("imagined observations / invalid replies", ["imagined_obs_rate", "invalid_reply_rate"]),
    ("loss terms", ["loss_sft", "loss_obs", "loss_rl", "loss_echo"]),
    ("observation NLL on trained observations", ["obs_nll", "echo_nll"]),
    ("policy entropy (RL tokens)", ["entropy"]),
    ("gradient norm (before clipping)", ["grad_norm"]),
    ("mismatch KL (trainer vs sampler)", ["mismatch_kl"]),
    ("echo weight λ", ["echo_alpha"]),
]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (a resumed run's repeated steps: the last one wins)."""
    rows: dict[int, dict[str, Any]] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not a JSON line: {err}") from None
                rows[int(row["step"])] = row
    return [rows[k] for k in sorted(rows)]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot_run(metrics: str | Path, out_dir: str | Path) -> list[Path]:
    """Write ``training.png`` (every panel of `PANELS`) to ``out_dir``; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    warm_end = max((r["step"] for r in rows if r.get("phase") == "warmup"), default=0)
    fig, axes = plt.subplots(2, 5, figsize=(22, 7.5), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=key,
                        alpha=0.4 if key == "reward" else 1.0)  # fmt: skip
            if key == "reward" and len(xs) >= 10:  # single steps are noisy: show the trend
                trend = [sum(ys[max(0, i - 9) : i + 1]) / len(ys[max(0, i - 9) : i + 1])
                         for i in range(len(ys))]  # fmt: skip
                ax.plot(xs, trend, color="C1", lw=2, label="mean of last 10")
        if title.startswith("held-out observation CE") and _series(rows, keys[0])[0]:
            ax.set_yscale("log")  # the floor is far below the start
        if warm_end:
            ax.axvspan(0, warm_end, color="0.9", zorder=0, label="warm-start")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0] and (len(keys) > 1 or warm_end):
            ax.legend(fontsize=8)
    path = out / "training.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]
