"""docs/pretrained.md prints the measured CPU run of ``echoloss-train --config pretrained`` from
its committed rows (``docs/pretrained/cpu-run/``): every number of its RL table is recomputed
here from ``metrics.jsonl`` and ``eval.jsonl``, character for character."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "docs" / "pretrained" / "cpu-run"


def _rows(name: str) -> list[dict[str, float]]:
    return [json.loads(x) for x in (RUN / name).read_text().splitlines() if x.strip()]


def rl_table(metrics: list[dict[str, float]], group_size: int) -> list[str]:
    """The page's table of the RL steps: times, tool use, echo and reward per step."""
    lines = [
        "| RL step | rollout (`gen_time`) | update and the rest | tool calls per rollout "
        "| invalid replies per rollout | `echo_tokens` | `rl_tokens` | reward (mean ± std) "
        "| groups with mixed rewards | `advantage_abs` |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in metrics:
        assert m["phase"] == "rl"
        groups = round(m["rollouts"] / group_size)
        mixed = round((1 - m["zero_variance_groups"]) * groups)
        lines.append(
            f"| {m['rl_step']} | {m['gen_time']:.0f} s | {m['step_time'] - m['gen_time']:.0f} s "
            f"| {m['env/calculator/tool_calls']:.3f} | {m['env/calculator/invalid']:.3f} "
            f"| {m['echo_tokens']} | {m['rl_tokens']} | {m['reward']:.3f} ± "
            f"{m['reward_std']:.3f} | {mixed} of {groups} | {m['advantage_abs']:.3f} |"
        )
    return lines


def test_the_page_prints_the_committed_run():
    page = (ROOT / "docs" / "pretrained.md").read_text()
    from echoloss.train.config import load_config

    group_size = load_config(ROOT / "configs" / "pretrained.toml").data.group_size
    table = "\n".join(rl_table(_rows("metrics.jsonl"), group_size))
    assert table in page, f"docs/pretrained.md should contain:\n{table}"
    [final] = _rows("eval.jsonl")
    solved = round(final["eval_success_greedy"] * final["eval_episodes"])
    said = (
        f"final greedy evaluation solved {solved} of {final['eval_episodes']:.0f} held-out "
        f"questions ({final['eval_time']:.0f} s); the held-out observation CE was "
        f"{final['heldout_obs_ce']:.2f} nats per token (floor 0)"
    )
    assert said in " ".join(page.split()), f"docs/pretrained.md should say: {said}"
