"""The persistence experiment's report: its tables, its pre-registered verdicts and its figures,
all pure functions of the summary (`echoloss.train.experiment.summarize`) of its rows.

The criteria are the ones docs/experiment.md fixed before the run ("Persistence"):

* **support** for a per-world echo arm: (a) its move-word CE on held-out random walks ends below
  GRPO's (paired 95 % interval of the difference below 0) and its mean below ``log 2``; (b) the
  primary interval (sampled success, arm − GRPO) above 0 or the co-primary interval (speed ratio)
  below 1; (c) the placebo shows no gain (primary lower bound ≤ 0 and speed ratio upper bound
  ≥ 1);
* **refutation**: (a) holds and the primary interval's upper bound is below +0.03;
* otherwise **undecided**.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["arm_label", "markdown", "plots", "reference_label", "verdict"]

LOG2 = math.log(2)
GAIN = 0.03  # gains above this are what a refutation rules out


def arm_label(row: dict[str, Any]) -> str:
    """The arm a row belongs to: its ``arm`` (``echo-0.05``), or with a ``level`` (the
    persistence design) ``"<level> <arm>[ <λ>]"``.

    Examples:
        >>> arm_label({"arm": "echo-0.05"}), arm_label({"level": "per-world", "arm": "grpo"})
        ('echo-0.05', 'per-world grpo')
        >>> arm_label({"level": "per-world", "arm": "placebo", "alpha": 0.05})
        'per-world placebo 0.05'
    """
    level = row.get("level")
    if not level:
        return str(row["arm"])
    return f"{level} {row['arm']}" + ("" if row["arm"] == "grpo" else f" {row['alpha']:g}")


def reference_label(label: str) -> str:
    """The GRPO arm an arm is paired with: ``grpo``, or the GRPO arm of its level."""
    return f"{label.split(' ')[0]} grpo" if " " in label else "grpo"


def _fmt(x: Any, digits: int = 3, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        text = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
        return text.replace("-", "−")
    return str(x)


def _ci(d: dict[str, Any] | None, digits: int = 3) -> str:
    if not d or not d.get("n"):
        return "–"
    return f"{_fmt(d['mean'], digits, True)} [{_fmt(d['lo'], digits, True)}, {_fmt(d['hi'], digits, True)}]"


def _ratio(d: dict[str, Any] | None) -> str:
    if not d or d.get("ratio") is None:
        return "–"
    return f"{_fmt(d['ratio'], 2)} [{_fmt(d['lo'], 2)}, {_fmt(d['hi'], 2)}]"


def _mean(e: dict[str, Any], key: str) -> float | None:
    v = e.get(key)
    return v.get("mean") if isinstance(v, dict) else None


def verdict(summary: dict[str, Any], arm: str) -> dict[str, Any]:
    """The pre-registered verdict of one echo arm (``"per-world echo 0.05"``) against its GRPO
    arm, with each criterion's parts: ``ce_below_grpo``, ``ce_below_log2``, ``success_up``,
    ``speed_up``, ``placebo_no_gain`` (None where not computable) and ``verdict`` (``support``,
    ``refutation`` or ``undecided``).

    Examples:
        >>> arm = {"move_ce_end": {"mean": 0.5, "diff_vs_grpo": {"n": 3, "mean": -0.4, "lo": -0.6, "hi": -0.2}},
        ...        "eval_success_sampled_end": {"diff_vs_grpo": {"n": 3, "mean": 0.0, "lo": -0.02, "hi": 0.02}},
        ...        "speed_ratio_vs_grpo": {"ratio": 1.0, "lo": 0.9, "hi": 1.1, "n": 3}}
        >>> verdict({"arms": {"w echo 0.05": arm}}, "w echo 0.05")["verdict"]
        'refutation'
    """
    arms = summary["arms"]
    e = arms[arm]
    level = arm.split(" ")[0]
    ce = e.get("move_ce_end", {})
    ce_diff = ce.get("diff_vs_grpo") or {}
    success = (e.get("eval_success_sampled_end") or {}).get("diff_vs_grpo") or {}
    speed = e.get("speed_ratio_vs_grpo") or {}

    def known(d: dict[str, Any], key: str) -> bool:
        return d.get(key) is not None and not math.isnan(d[key])

    out: dict[str, Any] = {
        "ce_below_grpo": ce_diff["hi"] < 0 if known(ce_diff, "hi") else None,
        "ce_below_log2": ce["mean"] < LOG2 if ce.get("mean") is not None else None,
        "success_up": success["lo"] > 0 if known(success, "lo") else None,
        "speed_up": speed["hi"] < 1 if known(speed, "hi") else None,
        "gains_above_3_ruled_out": success["hi"] < GAIN if known(success, "hi") else None,
    }
    placebo = next((a for a in arms if a.startswith(f"{level} placebo")), None)
    if placebo is not None:
        p_succ = (arms[placebo].get("eval_success_sampled_end") or {}).get("diff_vs_grpo") or {}
        p_speed = arms[placebo].get("speed_ratio_vs_grpo") or {}
        parts = [known(p_succ, "lo"), known(p_speed, "hi")]
        out["placebo_no_gain"] = (p_succ["lo"] <= 0 and p_speed["hi"] >= 1) if all(parts) else None
    else:
        out["placebo_no_gain"] = None
    ce_falls = bool(out["ce_below_grpo"] and out["ce_below_log2"])
    improves = bool(out["success_up"] or out["speed_up"])
    if ce_falls and improves and out["placebo_no_gain"]:
        out["verdict"] = "support"
    elif ce_falls and out["gains_above_3_ruled_out"]:
        out["verdict"] = "refutation"
    else:
        out["verdict"] = "undecided"
    return out


def _echo_arms(summary: dict[str, Any]) -> list[str]:
    return [a for a in summary["arms"] if " echo " in a]


def _outcome_lines(summary: dict[str, Any]) -> list[str]:
    """The complete seeds and the outcomes table: success at start and end, its difference
    against GRPO, steps to 80 % and the speed ratio, one row per arm."""
    seeds = summary.get("complete_seeds")
    lines = [
        f"Complete paired seeds: {len(seeds) if seeds is not None else '–'}"
        + (f" ({', '.join(str(s) for s in seeds)})" if seeds else "")
        + ". Differences against the GRPO arm of the same level, paired by seed, mean [95 % t CI].",
        "",
        "| arm | seeds | sampled start → end | Δ sampled end vs grpo | greedy start → end "
        "| steps to 80 % greedy (reached) | speed ratio vs grpo |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, e in summary["arms"].items():
        lines.append(
            f"| {arm} | {len(e['seeds'])} | {_fmt(_mean(e, 'eval_success_sampled_start'))} → "
            f"{_fmt(_mean(e, 'eval_success_sampled_end'))} | "
            f"{_ci(e['eval_success_sampled_end'].get('diff_vs_grpo'))} | "
            f"{_fmt(_mean(e, 'eval_success_start'))} → {_fmt(_mean(e, 'eval_success_end'))} | "
            f"{_fmt(_mean(e, 'steps_to_80_or_censored'), 1)} ({e['reached_80']}) | "
            f"{_ratio(e.get('speed_ratio_vs_grpo'))} |"
        )
    return lines


def _world_model_lines(arms: dict[str, Any]) -> list[str]:
    """The world-model table: direction-word CE on held-out random walks and demonstrations,
    one row per arm (preceded by a blank line)."""
    lines = [
        "",
        "Direction-word CE (nats/token) on held-out random walks (floor 0 per world; per episode "
        "log 2 on first moves, 0 later) and on held-out Bayes-optimal demonstrations.",
        "",
        "| arm | move CE, walks: start → end | Δ move CE end vs grpo | wall CE, walks: end "
        "| first / later CE, walks: end | move CE, demos: start → end | first / later CE, demos: end |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, e in arms.items():
        lines.append(
            f"| {arm} | {_fmt(_mean(e, 'move_ce_start'))} → {_fmt(_mean(e, 'move_ce_end'))} | "
            f"{_ci(e['move_ce_end'].get('diff_vs_grpo'))} | "
            f"{_fmt(_mean(e, 'ce_walks_wall_end'))} | "
            f"{_fmt(_mean(e, 'ce_walks_first_end'))} / {_fmt(_mean(e, 'ce_walks_later_end'))} | "
            f"{_fmt(_mean(e, 'ce_demos_move_start'))} → {_fmt(_mean(e, 'ce_demos_move_end'))} | "
            f"{_fmt(_mean(e, 'ce_demos_first_end'))} / {_fmt(_mean(e, 'ce_demos_later_end'))} |"
        )
    return lines


def _diagnostic_lines(arms: dict[str, Any]) -> list[str]:
    """The diagnostics table: invalid and imagined replies, zero-variance groups, the echo to
    policy-gradient norm ratio and the early echo NLL, one row per arm (after a blank line)."""
    lines = [
        "",
        "| arm | invalid / imagined replies (end) | zero-variance groups | ‖∇echo‖ / ‖∇PG‖ "
        "| echo NLL, first 5 RL steps |",
        "|---|---|---|---|---|",
    ]
    for arm, e in arms.items():
        lines.append(
            f"| {arm} | {_fmt(_mean(e, 'invalid_reply_rate_end'))} / "
            f"{_fmt(_mean(e, 'imagined_obs_rate_end'))} | "
            f"{_fmt(_mean(e, 'zero_variance_groups'))} | "
            f"{_fmt(_mean(e, 'echo_pg_grad_ratio'))} | {_fmt(_mean(e, 'echo_nll_first5'))} |"
        )
    return lines


def _yes(x: bool | None) -> str:
    """A criterion's cell: ``yes``, ``no``, or ``–`` when it is not decided."""
    return "–" if x is None else ("yes" if x else "no")


def _verdict_lines(summary: dict[str, Any]) -> list[str]:
    """The verdicts table: each pre-registered criterion and the verdict, one row per echo arm
    (after a blank line)."""
    lines = ["", "| echo arm | (a) move CE below GRPO's / below log 2 | (b) success up / faster "
             "| (c) placebo no gain | gains > 3 points ruled out | verdict |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for arm in _echo_arms(summary):
        v = verdict(summary, arm)
        lines.append(
            f"| {arm} | {_yes(v['ce_below_grpo'])} / {_yes(v['ce_below_log2'])} | "
            f"{_yes(v['success_up'])} / {_yes(v['speed_up'])} | {_yes(v['placebo_no_gain'])} | "
            f"{_yes(v['gains_above_3_ruled_out'])} | **{v['verdict']}** |"
        )
    return lines


def markdown(summary: dict[str, Any]) -> str:
    """The persistence tables (outcomes, world model, diagnostics) and the verdicts."""
    arms = summary["arms"]
    lines = [
        *_outcome_lines(summary),
        *_world_model_lines(arms),
        *_diagnostic_lines(arms),
        *_verdict_lines(summary),
    ]
    return "\n".join(lines) + "\n"


def _curves(
    rows: list[dict[str, Any]], arm: str, key: str
) -> tuple[list[int], list[float], list[dict[int, float]]]:
    curves = [
        {c["rl_step"]: c[key] for c in r.get("curve", []) if c.get(key) is not None}
        for r in rows
        if arm_label(r) == arm
    ]
    curves = [c for c in curves if c]
    if not curves:
        return [], [], []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return steps, [sum(c[s] for c in curves) / len(curves) for s in steps], curves


def _success_figure(
    rows: list[dict[str, Any]], summary: dict[str, Any], colors: dict[str, Any], out: Path
) -> Path:
    """``success.png``, the primary outcome: sampled success at RL step 60, arm − GRPO, per
    seed and mean with its 95 % interval, one line per arm that has a reference."""
    import matplotlib.pyplot as plt

    arms = list(summary["arms"])
    fig, ax = plt.subplots(figsize=(7.5, 4.2), constrained_layout=True)
    others = [a for a in arms if reference_label(a) != a]
    for i, arm in enumerate(others):
        by = {(arm_label(r), r["seed"]): r for r in rows}
        diffs = [
            by[(arm, s)]["eval_success_sampled_end"]
            - by[(reference_label(arm), s)]["eval_success_sampled_end"]
            for (a, s) in by
            if a == arm and (reference_label(arm), s) in by
        ]
        ax.scatter([100 * d for d in diffs], [i] * len(diffs), color=colors[arm], alpha=0.5, s=18)
        d = summary["arms"][arm]["eval_success_sampled_end"].get("diff_vs_grpo") or {}
        if d.get("n", 0) > 1:
            ax.errorbar(100 * d["mean"], i, xerr=[[100 * (d["mean"] - d["lo"])], [100 * (d["hi"] - d["mean"])]],
                        fmt="D", color="k", capsize=4, ms=6)  # fmt: skip
    ax.axvline(0, color="0.4", lw=1)
    for x in (-100 * GAIN, 100 * GAIN):
        ax.axvline(x, color="0.7", lw=1, ls=":")
    ax.set_yticks(range(len(others)), others)
    ax.set_xlabel("held-out sampled success at RL step 60, arm − GRPO (points); dots: seeds")
    ax.set_title("Does echo raise success? (mean, 95 % CI)")
    ax.grid(alpha=0.3, axis="x")
    path = out / "success.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: The curve figures of `plots`: ``(level, key, ylabel, title, file name, reference lines)``.
_CURVE_FIGURES: tuple[tuple[str, str, str, str, str, list[tuple[float, str]]], ...] = (
    ("per-world", "eval_success_greedy", "held-out success (greedy)",
     "Per world: how fast does each arm reach 80 %?", "speed.png", [(0.8, "80 %")]),
    ("per-world", "ce_walks_move", "move-word CE, held-out random walks (nats)",
     "Per world: does echo learn the world (floor 0)?", "world_model.png", [(LOG2, "log 2")]),
    ("per-episode", "eval_success_greedy", "held-out success (greedy)",
     "Per episode (the mirroring redrawn): greedy success", "per_episode.png", [(0.8, "80 %")]),
)  # fmt: skip


def _curve_figure(
    rows: list[dict[str, Any]],
    colors: dict[str, Any],
    out: Path,
    level: str,
    key: str,
    ylabel: str,
    title: str,
    name: str,
    lines: list[tuple[float, str]],
) -> Path:
    """``out/name``: ``key`` against the RL step for every arm of ``level`` (each seed faint,
    the mean over seeds bold), with horizontal reference ``lines`` ``(y, label)``."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), constrained_layout=True)
    for arm in [a for a in colors if a.startswith(level)]:
        steps, mean, curves = _curves(rows, arm, key)
        for c in curves:
            xs = sorted(c)
            ax.plot(xs, [c[x] for x in xs], color=colors[arm], alpha=0.15, lw=0.8)
        if steps:
            ax.plot(steps, mean, color=colors[arm], lw=2.2, marker="o", ms=3,
                    label=f"{arm} (n={len(curves)})")  # fmt: skip
    for y, label in lines:
        ax.axhline(y, color="0.4", lw=1, ls="--", label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(rows: list[dict[str, Any]], summary: dict[str, Any], out: Path) -> list[Path]:
    """One figure per question, each one panel: ``success.png`` (primary: sampled success at
    RL step 60, arm − GRPO, per seed and mean with its 95 % interval), ``speed.png`` (greedy
    held-out success per world against the RL step, the 80 % line), ``world_model.png``
    (move-word CE on held-out random walks per world against the RL step, with log 2) and
    ``per_episode.png`` (the per-episode level's greedy success and move-word CE)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {a: plt.get_cmap("tab10")(i) for i, a in enumerate(summary["arms"])}
    written = [_success_figure(rows, summary, colors, out)]  # 1. the primary outcome
    for figure in _CURVE_FIGURES:
        written.append(_curve_figure(rows, colors, out, *figure))
    return written
