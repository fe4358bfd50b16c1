"""The learning curve's figure from its committed rows: held-out greedy success and well-formed
call rate against the RL step, one line per seed and arm: a colour per arm, a marker per seed
(the pilot's rows dashed, grey). The title gives the readings of the pre-registered rule
(``scripts/pretrained_learning_report.py``) once each arm has them.

    python scripts/pretrained_learning_figure.py  # -> docs/pretrained/learning/curve.png
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEARNING = ROOT / "docs" / "pretrained" / "learning"
COLOURS = {"grpo": "tab:blue", "echo": "tab:orange"}
MARKERS = "osD^v"


def _report() -> Any:  # the rule's module, beside this script (scripts/ is not a package)
    spec = importlib.util.spec_from_file_location(
        "pretrained_learning_report", Path(__file__).with_name("pretrained_learning_report.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = []
    for kind, name in (("pilot", "pilot.json"), ("run", "results.json")):
        path = LEARNING / name
        if path.is_file():
            sets.append((kind, json.loads(path.read_text())))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharex=True)
    for ax, key, title in (
        (axes[0], "eval_success", "held-out greedy success"),
        (axes[1], "valid_call_rate", "well-formed-call rate"),
    ):
        for kind, rows in sets:
            for seed, arm in sorted({(r["seed"], r["arm"]) for r in rows}):
                pts = sorted(
                    (r["rl_step"], r[key]) for r in rows if (r["seed"], r["arm"]) == (seed, arm)
                )
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], "--" if kind == "pilot" else "-",
                    marker=MARKERS[seed % len(MARKERS)], alpha=0.85,
                    color="grey" if kind == "pilot" else COLOURS.get(arm, "black"),
                    label=f"{kind}: {arm}, seed {seed}",
                )  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.set_ylim(0, 1)
        ax.set_xlim(-1, 31)  # the protocol's 30 RL steps
    axes[0].set_ylabel("share of the 64 held-out questions")
    axes[1].legend(fontsize=7, loc="lower right")
    report = _report()
    rows = dict(sets).get("run", [])
    readings = [(arm, report.learning(rows, arm)["reading"]) for arm in ("grpo", "echo")]
    if any(reading is None for _, reading in readings):
        verdict = "in progress: no claim; the page reads the rows by its pre-registered rule"
    else:
        verdict = "pre-registered rule, 3 seeds: " + ", ".join(f"{a} {r}" for a, r in readings)
    fig.suptitle(f"SmolLM2-135M-Instruct, configs/pretrained-learn.toml ({verdict})", fontsize=9)
    fig.tight_layout()
    out = LEARNING / "curve.png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
