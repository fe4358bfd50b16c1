"""PNG plots of a run's ``metrics.jsonl`` (matplotlib, no display needed): one figure per
question a run answers (`QUESTIONS`: does the policy learn the held-out tasks, what happens to
the held-out observation CE, do the replies stay moves), and ``training.png``, every training
diagnostic of `PANELS` side by side for a look at the whole run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["PANELS", "QUESTIONS", "plot_run", "read_metrics"]

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


# One figure per question: (file, title, y-axis label with units, y scale factor, log scale,
# [(metric key, legend label, colour)]). A floor is drawn dashed in the colour of its CE.
QUESTIONS: list[tuple[str, str, str, float, bool, list[tuple[str, str, str]]]] = [
    ("success.png", "Does the policy learn the held-out tasks?",
     "held-out success (% of held-out episodes)", 100.0, False,
     [("eval_success_greedy", "greedy (one episode per task)", "C0"),
      ("eval_success_sampled", "sampled (T = 1; RL start and end)", "C1")]),
    ("observation_ce.png", "What happens to the held-out observation CE?",
     "held-out observation CE (nats/token, log scale)", 1.0, True,
     [("heldout_hidden_ce", "hidden-dependent tokens", "C0"),
      ("hidden_ce_floor", "their exact floor", "C0"),
      ("heldout_obs_ce", "every observation-body token", "C1"),
      ("obs_ce_floor", "its exact floor", "C1")]),
    ("replies.png", "Do the replies stay moves?",
     "held-out sampled replies (% of replies)", 100.0, False,
     [("eval_invalid_rate", "invalid (neither a move nor done)", "C3"),
      ("eval_imagined_rate", "imagined observation text", "C4")]),
]  # fmt: skip


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


def _question_figure(
    rows: list[dict[str, Any]],
    warm_end: int,
    out: Path,
    question: tuple[str, str, str, float, bool, list[tuple[str, str, str]]],
) -> Path:
    """``out/<file>`` of one `QUESTIONS` entry: its metrics against the optimiser step, the
    warm-up shaded; one run, so no interval (the experiment's figures have them)."""
    import matplotlib.pyplot as plt

    name, title, ylabel, scale, log, series = question
    fig, ax = plt.subplots(figsize=(7.5, 4.4), layout="constrained")
    drawn = False
    for key, label, color in series:
        xs, ys = _series(rows, key)
        floor = key.endswith("_floor")
        if xs:
            ax.plot(xs, [scale * y for y in ys], ls="--" if floor else "-", color=color,
                    marker=None if floor else "o", ms=4, label=label)  # fmt: skip
            drawn = drawn or not floor
    if log and drawn:
        ax.set_yscale("log")  # a floor is far below the start
    if warm_end:
        ax.axvspan(0, warm_end, color="0.9", zorder=0, label="warm-up")
    if not drawn:
        ax.text(0.5, 0.5, "not measured in this run (no held-out evaluation)",
                transform=ax.transAxes, ha="center", va="center")  # fmt: skip
    ax.set_xlabel("optimiser step (warm-up shaded, then RL)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title} (one run)", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    path = out / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(metrics: str | Path, out_dir: str | Path) -> list[Path]:
    """Write one figure per `QUESTIONS` entry (``success.png``, ``observation_ce.png``,
    ``replies.png``), then ``training.png`` (every panel of `PANELS`), to ``out_dir``; returns
    the files in that order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    warm_end = max((r["step"] for r in rows if r.get("phase") == "warmup"), default=0)
    written = [_question_figure(rows, warm_end, out, q) for q in QUESTIONS]
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
    return [*written, path]
