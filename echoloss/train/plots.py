"""PNG plots of a run's ``metrics.jsonl`` (matplotlib, no display needed): one figure per
question a run answers (`QUESTIONS`: does the policy learn the held-out tasks, what happens to
the held-out observation CE, do the replies stay moves), and ``training.png``, every training
diagnostic of `PANELS` side by side for a look at the whole run."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["PANELS", "QUESTIONS", "plot_run", "read_metrics"]

#: (title, y scale factor, metric keys) per panel of the run plot: success and rates in percent,
#: as in the question figures.
PANELS: list[tuple[str, float, list[str]]] = [
    ("held-out success (% of held-out episodes)", 100.0,
     ["eval_success_greedy", "eval_success_sampled"]),
    ("reward (training rollouts; mean of the last 10 steps)", 1.0, ["reward"]),
    ("held-out observation CE (nats/token)", 1.0,
     ["heldout_hidden_ce", "hidden_ce_floor", "heldout_obs_ce", "obs_ce_floor"]),
    ("imagined observations / invalid replies (% of turns)", 100.0,
     ["imagined_obs_rate", "invalid_reply_rate"]),
    ("loss terms", 1.0, ["loss_sft", "loss_obs", "loss_rl", "loss_echo"]),
    ("observation NLL on trained observations (nats/token)", 1.0, ["obs_nll", "echo_nll"]),
    ("policy entropy (RL tokens, nats)", 1.0, ["entropy"]),
    ("gradient norm (before clipping)", 1.0, ["grad_norm", "pg_grad_norm", "echo_grad_norm"]),
    ("mismatch KL (trainer vs sampler)", 1.0, ["mismatch_kl"]),
    ("echo weight λ", 1.0, ["echo_alpha"]),
]  # fmt: skip

#: Said on every figure: a single run has nothing to compare echo with.
ONE_RUN = (
    "one run: it cannot show whether echo helped (that needs GRPO runs beside it, same seeds: "
    "examples/research/echo_experiment)"
)

# One figure per question: (file, title, y-axis label with units, y scale factor,
# [(metric key, legend label, colour)]). A floor is drawn dashed in the colour of its CE. Every
# y axis starts at 0 (or below, for a negative value).
QUESTIONS: list[tuple[str, str, str, float, list[tuple[str, str, str]]]] = [
    ("success.png", "Does the policy learn the held-out tasks?",
     "held-out success (% of held-out episodes)", 100.0,
     [("eval_success_greedy", "greedy (one episode per task)", "C0"),
      ("eval_success_sampled", "sampled (T = 1; RL start and end)", "C1")]),
    ("observation_ce.png", "What happens to the held-out observation CE?",
     "held-out observation CE (nats/token)", 1.0,
     [("heldout_hidden_ce", "hidden-dependent tokens", "C0"),
      ("hidden_ce_floor", "their exact floor", "C0"),
      ("heldout_obs_ce", "every observation-body token", "C1"),
      ("obs_ce_floor", "its exact floor", "C1")]),
    ("replies.png", "Do the replies stay moves?",
     "held-out sampled replies (% of replies)", 100.0,
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


def y_bottom(values: list[float]) -> float:
    """Where a panel's y axis starts: 0, or the lowest value when one is negative.

    Examples:
        >>> y_bottom([0.4, 0.9]), y_bottom([-0.2, 0.5]), y_bottom([])
        (0.0, -0.2, 0.0)
    """
    return min([0.0, *values])


def overview_panels(
    rows: list[dict[str, Any]],
) -> tuple[list[tuple[str, float, list[str]]], list[str]]:
    """The `PANELS` this run logged at least one value of, and the titles of the others (named
    on the figure instead of drawn empty)."""
    logged = [any(_series(rows, key)[0] for key in keys) for _, _, keys in PANELS]
    drawn = [p for p, has in zip(PANELS, logged, strict=True) if has]
    missing = [p[0] for p, has in zip(PANELS, logged, strict=True) if not has]
    return drawn, missing


def _question_figure(
    rows: list[dict[str, Any]],
    warm_end: int,
    out: Path,
    question: tuple[str, str, str, float, list[tuple[str, str, str]]],
) -> Path:
    """``out/<file>`` of one `QUESTIONS` entry: its metrics against the optimiser step, the
    warm-up shaded; one run, so no interval (the experiment's figures have them)."""
    import matplotlib.pyplot as plt

    name, title, ylabel, scale, series = question
    fig, ax = plt.subplots(figsize=(7.5, 4.6), layout="constrained")
    drawn = False
    values: list[float] = []
    for key, label, color in series:
        xs, ys = _series(rows, key)
        floor = key.endswith("_floor")
        if xs:
            values += [scale * y for y in ys]
            ax.plot(xs, [scale * y for y in ys], ls="--" if floor else "-", color=color,
                    marker=None if floor else "o", ms=4, label=label)  # fmt: skip
            drawn = drawn or not floor
    ax.set_ylim(bottom=y_bottom(values))
    if warm_end:
        ax.axvspan(0, warm_end, color="0.9", zorder=0, label="warm-up")
    if not drawn:
        ax.text(0.5, 0.5, "not measured in this run (no held-out evaluation)",
                transform=ax.transAxes, ha="center", va="center")  # fmt: skip
    ax.set_xlabel("optimiser step (warm-up shaded, then RL)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n" + textwrap.fill(f"({ONE_RUN})", 90), fontsize=9)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    path = out / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(metrics: str | Path, out_dir: str | Path) -> list[Path]:
    """Write one figure per `QUESTIONS` entry (``success.png``, ``observation_ce.png``,
    ``replies.png``), then ``training.png`` (every panel of `PANELS` the run logged; the others
    are named under it), to ``out_dir``; returns the files in that order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    warm_end = max((r["step"] for r in rows if r.get("phase") == "warmup"), default=0)
    written = [_question_figure(rows, warm_end, out, q) for q in QUESTIONS]
    panels, missing = overview_panels(rows)
    cols = max(1, min(5, len(panels)))
    nrows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(
        nrows, cols, figsize=(4.4 * cols, 3.6 * nrows + 0.6), constrained_layout=True, squeeze=False
    )
    for ax, panel in zip(axes.flat, panels, strict=False):
        _overview_panel(ax, rows, warm_end, panel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_axis_off()
    note = f"not logged in this run: {'; '.join(missing)}" if missing else ""
    fig.suptitle(f"Training diagnostics ({ONE_RUN})" + (f"\n{note}" if note else ""), fontsize=10)
    path = out / "training.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [*written, path]


def _overview_panel(
    ax: Any, rows: list[dict[str, Any]], warm_end: int, panel: tuple[str, float, list[str]]
) -> None:
    title, scale, keys = panel
    values: list[float] = []
    for key in keys:
        xs, ys = _series(rows, key)
        ys = [scale * y for y in ys]
        values += ys
        if xs:
            ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=key,
                    alpha=0.4 if key == "reward" else 1.0)  # fmt: skip
        if key == "reward" and len(xs) >= 10:  # single steps are noisy: show the trend
            trend = [sum(ys[max(0, i - 9) : i + 1]) / len(ys[max(0, i - 9) : i + 1])
                     for i in range(len(ys))]  # fmt: skip
            ax.plot(xs, trend, color="C1", lw=2, label="mean of last 10")
    ax.set_ylim(bottom=y_bottom(values))
    if warm_end:
        ax.axvspan(0, warm_end, color="0.9", zorder=0, label="warm-start")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0] and (len(keys) > 1 or warm_end):
        ax.legend(fontsize=8)
