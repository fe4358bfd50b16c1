"""The ECHO experiment: GRPO alone vs GRPO + echo, same seeds, same everything else.

::

    echoloss-train experiment --output-dir runs/echo-experiment          # embedded default, 3 seeds
    echoloss-train experiment --config my.toml --seeds 0 1 --alpha 0.2 --jobs 2

For each seed it runs two arms that differ **only** in ``echo.alpha`` (``0`` for GRPO, the given
value for echo), each as its own ``echoloss-train`` process (``--jobs`` at a time), then writes
``comparison.png`` (held-out observation cross-entropy and reward against the step, per seed and
averaged) and ``results.md`` / ``results.json`` (the table). The claim under test (the ECHO paper's main result):
echo lowers the held-out observation-token CE sharply while GRPO alone barely moves it, at no cost
in reward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from echoloss.train.plots import read_metrics

__all__ = ["main", "summarize"]

ARMS = ("grpo", "echo")


def _run(args: list[str], log: Path) -> int:
    with open(log, "w") as f:
        return subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, check=False).returncode


def _window_mean(rows: list[dict[str, Any]], key: str, frac: float) -> float | None:
    vals = [r[key] for r in rows if key in r]
    if not vals:
        return None
    k = max(1, round(len(vals) * frac))
    return sum(vals[-k:]) / k


def summarize(out: Path, seeds: list[int]) -> dict[str, Any]:
    """Read every arm's ``metrics.jsonl`` under ``out`` and build the result table."""
    table: dict[str, Any] = {"seeds": seeds, "arms": {}}
    for arm in ARMS:
        per_seed = []
        for seed in seeds:
            rows = read_metrics(out / f"{arm}-seed{seed}" / "metrics.jsonl")
            rl = [r for r in rows if r.get("phase") == "rl"]
            ce = [r for r in rows if "heldout_obs_ce" in r]
            start = [r for r in ce if r["step"] <= (rl[0]["step"] - 1 if rl else 0)]
            per_seed.append(
                {
                    "seed": seed,
                    "obs_ce_start": (start[-1] if start else ce[0])["heldout_obs_ce"],
                    "obs_ce_end": ce[-1]["heldout_obs_ce"],
                    "reward_first": _first_mean(rl, "reward", 0.2),
                    "reward_last": _window_mean(rl, "reward", 0.2),
                    "steps": rows[-1]["step"],
                }
            )
        mean = {
            k: sum(p[k] for p in per_seed) / len(per_seed)
            for k in ("obs_ce_start", "obs_ce_end", "reward_first", "reward_last")
        }
        table["arms"][arm] = {"per_seed": per_seed, "mean": mean}
    return table


def _first_mean(rows: list[dict[str, Any]], key: str, frac: float) -> float:
    vals = [r[key] for r in rows if key in r]
    k = max(1, round(len(vals) * frac))
    return sum(vals[:k]) / k if vals else float("nan")


def _markdown(table: dict[str, Any], alpha: float) -> str:
    lines = [
        f"Seeds {table['seeds']}; echo arm alpha = {alpha}. Held-out observation CE in nats/token "
        "on the fixed held-out random-walk set; reward = mean training-rollout reward over the "
        "first / last 20% of the RL steps.",
        "",
        "| arm | seed | obs CE at RL start | obs CE at end | reward (first 20%) | reward (last 20%) |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        a = table["arms"][arm]
        for p in a["per_seed"]:
            lines.append(
                f"| {arm} | {p['seed']} | {p['obs_ce_start']:.3f} | {p['obs_ce_end']:.3f} | "
                f"{p['reward_first']:.3f} | {p['reward_last']:.3f} |"
            )
        m = a["mean"]
        lines.append(
            f"| **{arm}** | mean | {m['obs_ce_start']:.3f} | **{m['obs_ce_end']:.3f}** | "
            f"{m['reward_first']:.3f} | **{m['reward_last']:.3f}** |"
        )
    return "\n".join(lines) + "\n"


def plot(out: Path, seeds: list[int], path: Path) -> None:
    """``comparison.png``: held-out observation CE and reward per arm (thin: seeds, thick: mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
    colors = {"grpo": "tab:blue", "echo": "tab:orange"}
    for arm in ARMS:
        curves = {"heldout_obs_ce": [], "reward": []}
        for seed in seeds:
            rows = read_metrics(out / f"{arm}-seed{seed}" / "metrics.jsonl")
            for key, ax in zip(curves, axes, strict=True):
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if key == "reward":  # smooth the noisy per-step reward a little
                    pts = _smooth(pts, 5)
                curves[key].append(dict(pts))
                ax.plot(*zip(*pts, strict=True), color=colors[arm], alpha=0.25, lw=0.8)
        for key, ax in zip(curves, axes, strict=True):
            steps = sorted(set.intersection(*(set(c) for c in curves[key])))
            mean = [sum(c[s] for c in curves[key]) / len(curves[key]) for s in steps]
            ax.plot(steps, mean, color=colors[arm], lw=2.2, label=f"{arm} (mean of {len(seeds)})")
    warm = [
        r["step"]
        for r in read_metrics(out / f"grpo-seed{seeds[0]}" / "metrics.jsonl")
        if r.get("phase") == "warmup"
    ]
    for ax, title in zip(
        axes,
        ("held-out observation CE (nats/token)", "reward (training rollouts, 5-step mean)"),
        strict=True,
    ):
        if warm:
            ax.axvspan(0, max(warm), color="0.9", zorder=0, label="warm-start (shared)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _smooth(pts: list[tuple[int, float]], k: int) -> list[tuple[int, float]]:
    out = []
    for i, (s, _) in enumerate(pts):
        window = [v for _, v in pts[max(0, i - k + 1) : i + 1]]
        out.append((s, sum(window) / len(window)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="echoloss-train experiment", description=__doc__.split("::")[0]
    )
    p.add_argument("--config", help="base TOML (default: the embedded default)")
    p.add_argument("--output-dir", default="runs/echo-experiment")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--alpha", type=float, default=None, help="echo arm's echo.alpha (default: the config's)"
    )
    p.add_argument("--max-steps", type=int)
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (each uses one CPU thread)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run"
    )
    p.add_argument("--summarize-only", action="store_true", help="only rebuild the table and plot")
    args = p.parse_args(argv)

    from echoloss.train.config import ConfigError, load_config

    try:
        base = load_config(args.config)
    except (ConfigError, FileNotFoundError) as err:
        print(f"echoloss-train experiment: {err}", file=sys.stderr)
        return 2
    alpha = args.alpha if args.alpha is not None else base.echo.alpha
    if alpha <= 0:
        print("echoloss-train experiment: the echo arm needs alpha > 0", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    if args.summarize_only:
        runs = [out / f"{arm}-seed{seed}" / "metrics.jsonl" for seed in args.seeds for arm in ARMS]
        missing = [str(m) for m in runs if not m.is_file()]
        if missing:
            print(
                f"echoloss-train experiment: --summarize-only: {len(missing)} of {len(runs)} runs "
                f"have no metrics ({', '.join(missing)}); run the experiment first, or give the "
                "--output-dir and --seeds of a finished one",
                file=sys.stderr,
            )
            return 2
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for seed in args.seeds:
        for arm in ARMS:
            cmd = [sys.executable, "-m", "echoloss.train.cli"]
            if args.config:
                cmd += ["--config", args.config]
            cmd += ["--seed", str(seed), "--output-dir", str(out / f"{arm}-seed{seed}")]
            if args.max_steps:
                cmd += ["--max-steps", str(args.max_steps)]
            for item in [*args.set, "train.threads=1", "train.progress=false"]:
                cmd += ["--set", item]
            cmd += ["--set", f"echo.alpha={alpha if arm == 'echo' else 0.0}"]
            jobs.append((cmd, out / f"{arm}-seed{seed}.log"))
    if not args.summarize_only:
        print(f"running {len(jobs)} runs, {args.jobs} at a time; logs in {out}/*.log", flush=True)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            codes = list(pool.map(lambda j: _run(*j), jobs))
        failed = [str(log) for (_, log), c in zip(jobs, codes, strict=True) if c != 0]
        if failed:
            print(f"echoloss-train experiment: runs failed, see {failed}", file=sys.stderr)
            return 1
    table = summarize(out, args.seeds)
    table["alpha"] = alpha
    (out / "results.json").write_text(json.dumps(table, indent=1))
    md = _markdown(table, alpha)
    (out / "results.md").write_text(md)
    plot(out, args.seeds, out / "comparison.png")
    print(md)
    print(f"wrote {out}/comparison.png, {out}/results.md, {out}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
