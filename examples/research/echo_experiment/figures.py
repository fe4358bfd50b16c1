"""The figures of an experiment's rows (``python examples/research/echo_experiment/run.py``, docs/experiment.md): one
figure per question, each one panel with labelled axes and units, the number of paired seeds in
its title and 95 % t intervals over seeds (`echo_experiment.stats.paired_ci`).

* ``success.png``: *does echo change held-out success?* Sampled held-out success at the end of RL,
  each arm minus the GRPO arm of the same seed (percentage points): every seed, and the mean with
  its paired 95 % t interval, against 0 and the non-inferiority margin.
* ``observation_ce.png``: *what happens to the observation CE?* The held-out CE of the
  hidden-dependent observation tokens (nats/token) against the RL step, every seed and the mean
  with its 95 % t interval per arm, with the exact floor.
* ``invalid_replies.png``: *does the policy stop answering with moves?* Invalid replies (neither a
  move nor ``done``) at the end of RL, % of sampled held-out replies, per arm (GRPO included):
  every seed and the mean with its 95 % t interval. The imagined-observation rate is not drawn:
  the committed rows computed it with an older pattern that undercounts it.

Every figure is a function of the rows alone, so the committed rows regenerate it
(``python examples/research/echo_experiment/run.py figures docs/experiment/rl-120``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from echo_experiment.persistence import arm_label, reference_label
from echo_experiment.stats import paired_ci

__all__ = [
    "FIGURES",
    "arm_values",
    "interval_text",
    "paired_differences",
    "write_figures",
]

#: The files `write_figures` writes, in order.
FIGURES = ("success.png", "observation_ce.png", "invalid_replies.png")
MARGIN_POINTS = -3.0  # the pre-registered non-inferiority margin (docs/experiment.md, Protocol)
LOG3 = math.log(3)  # mirrorgrid: knowing the rules (a key's direction, its opposite, or wall)


def arm_order(arm: str) -> tuple[int, float, str]:
    """Sort key of an arm label: GRPO first, then echo by λ, then the others by name.

    Examples:
        >>> sorted(["actobs", "echo-0.05", "grpo", "echo-0.005"], key=arm_order)
        ['grpo', 'echo-0.005', 'echo-0.05', 'actobs']
    """
    if reference_label(arm) == arm:
        return (0, 0.0, arm)
    if arm.startswith("echo-"):
        return (1, float(arm.removeprefix("echo-")), arm)
    return (2, 0.0, arm)


def arm_values(rows: list[dict[str, Any]], key: str) -> dict[str, list[float]]:
    """Per arm, the values of ``key`` over its seeds (in seed order; rows without it left out).

    Examples:
        >>> rows = [{"arm": "grpo", "seed": 1, "x": 0.5}, {"arm": "grpo", "seed": 0, "x": 0.25},
        ...         {"arm": "echo-0.01", "seed": 0, "x": None}]
        >>> arm_values(rows, "x")
        {'grpo': [0.25, 0.5]}
    """
    out: dict[str, list[float]] = {}
    for r in sorted(rows, key=lambda r: r["seed"]):
        if r.get(key) is not None:
            out.setdefault(arm_label(r), []).append(float(r[key]))
    return dict(sorted(out.items(), key=lambda kv: arm_order(kv[0])))


def paired_differences(rows: list[dict[str, Any]], key: str) -> dict[str, list[float]]:
    """Per arm that has a reference (not GRPO itself), ``key`` minus its GRPO arm's ``key`` of
    the same seed, one difference per seed that both arms have (in seed order).

    Examples:
        >>> rows = [{"arm": "grpo", "seed": 0, "s": 0.5}, {"arm": "grpo", "seed": 1, "s": 0.25},
        ...         {"arm": "echo-0.05", "seed": 1, "s": 0.5}, {"arm": "echo-0.05", "seed": 0,
        ...          "s": 0.375}, {"arm": "echo-0.05", "seed": 2, "s": 1.0}]
        >>> paired_differences(rows, "s")
        {'echo-0.05': [-0.125, 0.25]}
    """
    by = {(arm_label(r), r["seed"]): r for r in rows if r.get(key) is not None}
    out: dict[str, list[float]] = {}
    for arm, seed in sorted(by, key=lambda k: (arm_order(k[0]), k[1])):
        ref = by.get((reference_label(arm), seed))
        if reference_label(arm) != arm and ref is not None:
            out.setdefault(arm, []).append(float(by[(arm, seed)][key]) - float(ref[key]))
    return out


def _number(x: float, digits: int, signed: bool) -> str:
    """``+1.5`` / ``−0.3`` (``signed``: a difference) or ``1.5`` (a level); a minus sign, as
    the page prints it.

    Examples:
        >>> _number(-0.25, 1, True), _number(0.25, 2, True), _number(3.0, 1, False)
        ('−0.2', '+0.25', '3.0')
    """
    return f"{x:{'+' if signed else ''}.{digits}f}".replace("-", "−")


def interval_text(values: list[float], *, digits: int = 1, signed: bool = True) -> str:
    """``"mean [lo, hi]"`` of ``values`` with its 95 % t interval (`paired_ci`), as a figure
    prints it beside a row; the mean alone from one seed.

    Examples:
        >>> interval_text([1.0, 2.0, 3.0])
        '+2.0 [−0.5, +4.5]'
        >>> interval_text([0.5], signed=False)
        '0.5 (one seed)'
    """
    ci = paired_ci(values)
    if ci["n"] < 2:
        return f"{_number(ci['mean'], digits, signed)} (one seed)"
    m, lo, hi = (_number(ci[k], digits, signed) for k in ("mean", "lo", "hi"))
    return f"{m} [{lo}, {hi}]"


def _setting(rows: list[dict[str, Any]]) -> str:
    """``"mirrorgrid, 60 RL steps, 8 paired seeds"``: what a figure's rows are."""
    envs = sorted({str(r.get("env", "?")) for r in rows})
    steps = sorted({int(r["rl_steps"]) for r in rows if r.get("rl_steps") is not None})
    seeds = len({r["seed"] for r in rows})
    rl = f"{steps[0]} RL steps" if len(steps) == 1 else f"{steps[0]}–{steps[-1]} RL steps"
    return f"{', '.join(envs)}, {rl}, {seeds} paired seed{'s' if seeds != 1 else ''}"


def _dots_and_interval(
    ax: Any, y: float, values: list[float], color: Any, scale: float, signed: bool
) -> None:
    """One row of a dot plot: every seed's value (dots), the mean with its 95 % t interval
    (diamond and bar; a hollow diamond where one seed gives no interval) and the interval as
    text at the right of the row."""
    ax.scatter([scale * v for v in values], [y] * len(values), color=color, alpha=0.55, s=20)
    ci = paired_ci(values)
    if ci["n"] > 1:
        err = [[scale * (ci["mean"] - ci["lo"])], [scale * (ci["hi"] - ci["mean"])]]
        ax.errorbar(scale * ci["mean"], y, xerr=err, fmt="D", color="k", capsize=4, ms=6)
    else:
        ax.plot(scale * ci["mean"], y, "D", mfc="none", mec="k", ms=8)
    text = interval_text([scale * v for v in values], digits=1, signed=signed)
    ax.annotate(text, (1.01, y), xycoords=("axes fraction", "data"), va="center", fontsize=8)


def _success_figure(rows: list[dict[str, Any]], colors: dict[str, Any], out: Path) -> Path:
    import matplotlib.pyplot as plt

    diffs = paired_differences(rows, "eval_success_sampled_end")
    fig, ax = plt.subplots(figsize=(8.0, 1.6 + 0.55 * max(1, len(diffs))), layout="constrained")
    for i, (arm, d) in enumerate(diffs.items()):
        _dots_and_interval(ax, i, d, colors[arm], 100.0, signed=True)
    ax.axvline(0.0, color="0.3", lw=1)
    ax.axvline(MARGIN_POINTS, color="0.5", lw=1, ls=":", label="non-inferiority margin (−3 points)")
    ax.set_yticks(range(len(diffs)), [f"{a} − grpo" for a in diffs])
    ax.set_ylim(-0.6, len(diffs) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("held-out sampled success at the end of RL, arm − GRPO (percentage points)")
    ax.set_title(
        f"Does echo change held-out success? ({_setting(rows)})\n"
        "dots: seeds; diamond, bar: mean and paired 95 % t interval (text at right)",
        fontsize=10,
    )
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="lower left")
    path = out / FIGURES[0]
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ce_key(rows: list[dict[str, Any]]) -> tuple[str, str, str]:
    """``(curve key, floor key, axis label)``: the hidden-dependent tokens' CE where the rows have
    it, else the CE over every observation-body token."""
    if any(c.get("heldout_hidden_ce") is not None for r in rows for c in r.get("curve", [])):
        return ("heldout_hidden_ce", "obs_ce_floor",
                "held-out CE of the direction words (nats/token)")  # fmt: skip
    return ("heldout_obs_ce", "obs_ce_all_floor",
            "held-out CE of the observation tokens (nats/token)")  # fmt: skip


def _ce_figure(rows: list[dict[str, Any]], colors: dict[str, Any], out: Path) -> Path:
    import matplotlib.pyplot as plt

    key, floor_key, ylabel = _ce_key(rows)
    fig, ax = plt.subplots(figsize=(8.0, 4.6), layout="constrained")
    arms = list(colors)
    top = 0.0
    width = max((int(r.get("rl_steps") or 0) for r in rows), default=60) / 150
    for i, arm in enumerate(arms):
        curves = [
            {int(c["rl_step"]): float(c[key]) for c in r.get("curve", []) if c.get(key) is not None}
            for r in sorted(rows, key=lambda r: r["seed"])
            if arm_label(r) == arm
        ]
        curves = [c for c in curves if c]
        for c in curves:
            xs = sorted(c)
            ax.plot(xs, [c[x] for x in xs], color=colors[arm], alpha=0.15, lw=0.8)
            top = max(top, *c.values())
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not steps:
            continue
        cis = [paired_ci([c[s] for c in curves]) for s in steps]
        ax.plot(steps, [ci["mean"] for ci in cis], color=colors[arm], lw=2.2, marker="o", ms=3,
                label=f"{arm} (n = {len(curves)})")  # fmt: skip
        if len(curves) > 1:  # the arms' bars side by side at each evaluation
            dodged = [s + width * (i - (len(arms) - 1) / 2) for s in steps]
            lo = [ci["mean"] - ci["lo"] for ci in cis]
            hi = [ci["hi"] - ci["mean"] for ci in cis]
            ax.errorbar(dodged, [ci["mean"] for ci in cis], yerr=[lo, hi], fmt="none",
                        ecolor=colors[arm], elinewidth=1.2, capsize=2, alpha=0.8)  # fmt: skip
    floors = sorted({float(r[floor_key]) for r in rows if r.get(floor_key) is not None})
    if floors:
        ax.axhline(floors[0], color="0.3", lw=1, ls="--", label=f"exact floor {floors[0]:.3f}")
    if key == "heldout_hidden_ce" and all(str(r.get("env", "")).startswith("mirrorgrid") for r in rows):  # fmt: skip
        ax.axhline(LOG3, color="0.5", lw=1, ls=":", label="log 3: the rules, no inference")
    ax.set_ylim(0.0, 1.08 * max(top, LOG3))  # the seeds decide the range; a wider band is cut
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.set_title(
        f"What happens to the observation CE? ({_setting(rows)})\n"
        "bold: mean over seeds, bars: 95 % t interval; faint: seeds",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = out / FIGURES[1]
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _replies_figure(rows: list[dict[str, Any]], colors: dict[str, Any], out: Path) -> Path:
    import matplotlib.pyplot as plt

    values = arm_values(rows, "invalid_reply_rate_end")
    fig, ax = plt.subplots(figsize=(8.0, 1.6 + 0.55 * max(1, len(values))), layout="constrained")
    for i, (arm, v) in enumerate(values.items()):
        _dots_and_interval(ax, i, v, colors[arm], 100.0, signed=False)
    ax.set_yticks(range(len(values)), list(values))
    ax.set_ylim(-0.6, len(values) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(left=0.0)  # a rate: an interval's part below 0 is cut at the frame
    ax.set_xlabel("invalid replies at the end of RL (% of sampled held-out replies)")
    ax.set_title(
        f"Does the policy stop answering with moves? ({_setting(rows)})\n"
        "dots: seeds; diamond, bar: mean and 95 % t interval (text at right)",
        fontsize=10,
    )
    ax.grid(alpha=0.3, axis="x")
    path = out / FIGURES[2]
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_figures(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write `FIGURES` into ``out`` from an experiment's rows (one per run, each with ``arm``,
    ``seed``, ``env``, ``rl_steps``, ``eval_success_sampled_end``, ``invalid_reply_rate_end``,
    ``obs_ce_floor`` and its evaluation ``curve``), and return their paths. Pass the rows of
    the seeds every arm finished (a cut-off experiment's others would unpair the intervals).

    Examples:
        >>> import tempfile
        >>> rows = [{"arm": a, "seed": s, "env": "mirrorgrid", "rl_steps": 60,
        ...          "eval_success_sampled_end": 0.5 + 0.1 * s, "invalid_reply_rate_end": 0.01,
        ...          "obs_ce_floor": 0.19, "curve": [{"rl_step": 0, "heldout_hidden_ce": 3.0}]}
        ...         for a in ("grpo", "echo-0.01") for s in (0, 1)]
        >>> with tempfile.TemporaryDirectory() as d:
        ...     [p.name for p in write_figures(rows, Path(d))]
        ['success.png', 'observation_ce.png', 'invalid_replies.png']
    """
    if not rows:
        raise ValueError("write_figures: rows is empty; pass the rows of a finished experiment")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({arm_label(r) for r in rows}, key=arm_order)
    colors = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(arms)}
    out.mkdir(parents=True, exist_ok=True)
    return [
        _success_figure(rows, colors, out),
        _ce_figure(rows, colors, out),
        _replies_figure(rows, colors, out),
    ]
