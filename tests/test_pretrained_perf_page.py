"""docs/pretrained.md's numbers of the update benchmark and of the learning rows, recomputed from
the committed results (``benchmarks/results/update-step_*.json``, ``cpu-bf16_*.json`` and
``docs/pretrained/learning/*.json``), character for character."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "pretrained.md"
LEARNING = ROOT / "docs" / "pretrained" / "learning"
NAMES = {
    "logits": "`logits`: every row's logits (the update before this change)",
    "packed": "`packed`: the LM head on the loss rows only",
    "shared_prefix": "`shared_prefix`: that, and the shared prompt prefix once",
    "plain": "plain transformers forward + backward (right-padded batch)",
}


def _page() -> str:
    return " ".join(PAGE.read_text().split())


def _latest(pattern: str, **where: object) -> dict:
    """The newest committed result matching ``pattern`` whose fields equal ``where``."""
    files = sorted((ROOT / "benchmarks" / "results").glob(pattern))
    found = [r for r in map(lambda f: json.loads(f.read_text()), files)
             if all(r.get(k) == v for k, v in where.items())]  # fmt: skip
    if not found:
        pytest.skip(f"no benchmarks/results/{pattern} with {where} committed")
    return found[-1]


def update_table(r: dict) -> list[str]:
    lines = [
        "| update (steps 4–6: pack, forward, loss, backward, clip, AdamW) | median | "
        "relative to `logits` | micro-batches |",
        "|---|---|---|---|",
    ]
    for key, name in NAMES.items():
        if key not in r["median_s"]:
            continue  # not timed (--variants)
        med = r["median_s"][key]
        mbs = r["micro_batches"].get(key, 1)
        lines.append(f"| {name} | {med:.1f} s | {med / r['median_s']['logits']:.2f} | {mbs} |")
    return lines


def test_the_update_table_is_the_committed_benchmark():
    r = _latest("update-step_*.json", prompts=2, group=4)  # the shipped config's step
    text = PAGE.read_text()
    table = "\n".join(update_table(r))
    assert table in text, f"docs/pretrained.md should contain:\n{table}"
    g = r["generation_s"]
    m = r["median_s"]
    ratio = (
        f"costs {m['shared_prefix'] / m['logits']:.2f} of the update before this change "
        f"({m['shared_prefix']:.1f} s against {m['logits']:.1f} s) and "
        f"{m['shared_prefix'] / m['plain']:.2f} of the plain transformers forward + backward"
    )
    assert ratio in _page(), f"docs/pretrained.md should say: {ratio}"
    said = (
        f"{r['prompts']} × {r['group']} rollouts ({r['samples']} samples, {r['tokens']} tokens, "
        f"{r['rl_tokens']} RL and {r['echo_tokens']} echo tokens), {r['repeats']} repeats, "
        f"{r['threads']} thread on {r['cpu']} (load average "
        f"{r['loadavg_before'][0]:.1f} before, {r['loadavg_after'][0]:.1f} after), "
        f"torch {r['versions']['torch']}, transformers {r['versions']['transformers']}, "
        f"in {r['compute_dtype']}"
    )
    assert said in _page(), f"docs/pretrained.md should say: {said}"
    gen = (
        f"enerating these rollouts took {g['shared_prompt']:.0f} s with the shared prompt "
        f"prefilled once and {g['unshared']:.0f} s without"
    )
    assert gen in _page(), f"docs/pretrained.md should say: {gen}"


def test_the_learning_configs_step_is_the_committed_benchmark():
    """The done-when of the learning config: its step's update at most 1/3 of the old one."""
    r = _latest("update-step_*.json", prompts=4, group=8)
    table = "\n".join(update_table(r))
    assert table in PAGE.read_text(), f"docs/pretrained.md should contain:\n{table}"
    m, g = r["median_s"], r["generation_s"]
    assert m["shared_prefix"] / m["logits"] <= 1 / 3 and not r["gate_problems"]
    said = (
        f"({r['samples']} samples, {r['tokens']} tokens, {r['rl_tokens']} RL and "
        f"{r['echo_tokens']} echo tokens), {r['repeats']} repeat, {r['threads']} thread "
        f"(load average {r['loadavg_before'][0]:.1f} before, {r['loadavg_after'][0]:.1f} after): "
        f"the update costs {m['shared_prefix'] / m['logits']:.2f} of the update before this change "
        f"({m['shared_prefix']:.1f} s against {m['logits']:.1f} s). Generating these rollouts "
        f"took {g['shared_prompt']:.0f} s with the shared prompt prefilled once and "
        f"{g['unshared']:.0f} s without"
    )
    assert said in _page(), f"docs/pretrained.md should say: {said}"


def test_the_bf16_sentence_is_the_committed_measurement():
    r = _latest("cpu-bf16_*.json")
    m = r["median_s"]
    said = (
        f"fp32 {m['fp32']:.1f} s, bf16 autocast on fp32 weights "
        f"{m['fp32 weights, bf16 autocast']:.1f} s, bf16 weights {m['bf16 weights']:.1f} s "
        f"({r['rows']} × {r['tokens']} tokens, {r['threads']} threads, {r['cpu']}, "
        f"load average {r['loadavg_before'][0]:.1f})"
    )
    assert said in _page(), f"docs/pretrained.md should say: {said}"
    sec = r["seconds"]
    spread = (
        ", ".join(
            f"{min(sec[k]):.0f}–{max(sec[k]):.0f} s"
            for k in ("fp32", "fp32 weights, bf16 autocast")
        )
        + f" and {min(sec['bf16 weights']):.0f}–{max(sec['bf16 weights']):.0f} s"
    )
    assert f"spread over {spread}" in _page()


def learning_table(rows: list[dict]) -> list[str]:
    lines = [
        "| set | seed | arm | RL step | questions | success | well-formed calls | result CE | "
        "error CE | commit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in rows:
        lines.append(
            f"| {kind} | {r['seed']} | {r['arm']} | {r['rl_step']} | {r['eval_n']} | "
            f"{r['eval_success']:.3f} | {r['valid_call_rate']:.3f} | {r['result_ce']:.3f} | "
            f"{r['error_ce']:.3f} | {r['commit'][:7]} |"
        )
    return lines


def _learning_rows() -> list[tuple[str, dict]]:
    out = []
    for kind, name in (("pilot", "pilot.json"), ("run", "results.json")):
        path = LEARNING / name
        if path.is_file():
            out += [(kind, r) for r in json.loads(path.read_text())]
    return out


def test_the_learning_rows_are_printed_and_no_claim_is_made_early():
    rows = _learning_rows()
    text = PAGE.read_text()
    if not rows:
        assert "### Learning rows so far\n\nNo rows yet." in text
        return
    table = "\n".join(learning_table(rows))
    assert table in text, f"docs/pretrained.md should contain:\n{table}"
    for r in (r for _, r in rows):
        assert set(r) >= {"seed", "rl_step", "arm", "eval_n", "eval_success", "valid_call_rate"}
        assert r["eval_n"] == 64 and 0 <= r["eval_success"] <= 1
    pilot = [r for k, r in rows if k == "pilot"]
    start = next(r for r in pilot if r["rl_step"] == 0)
    said = (
        f"solved {round(start['eval_success'] * start['eval_n'])} of {start['eval_n']} held-out "
        f"questions greedily ({start['eval_success']:.3f}), {start['valid_call_rate']:.3f} of "
        f"its episodes called the calculator with no invalid reply, and the held-out CE was "
        f"{start['result_ce']:.3f} nats per result token and {start['error_ce']:.3f} per error "
        f"token; this evaluation alone took {start['eval_time']:.0f} s"
    )
    assert said in _page(), f"docs/pretrained.md should say: {said}"
    metrics = LEARNING / "pilot-metrics.jsonl"
    if metrics.is_file():
        first = json.loads(metrics.read_text().splitlines()[0])
        from echoloss.train.config import load_config

        groups = load_config(ROOT / "configs" / "pretrained-learn.toml").data.prompts_per_step
        mixed = round((1 - first["zero_variance_groups"]) * groups)
        said = (
            f"{mixed} of {groups} groups had mixed rewards (mean reward {first['reward']:.3f}); "
            f"its {round(first['rollouts'])} rollouts ({first['tokens']} tokens) took "
            f"{first['gen_time']:.0f} s to generate and "
            f"{first['step_time'] - first['gen_time']:.0f} s to train (`update_forward`: "
            f"`{first['update_forward']}`)"
        )
        assert said in _page(), f"docs/pretrained.md should say: {said}"
    finished = _finished_seeds([r for k, r in rows if k == "run"])
    if min((len(v) for v in finished.values()), default=0) < 3:
        for claim in ("*learns*:", "gets worse:", "learning is not shown:"):
            assert claim not in text, "no verdict before 3 seeds reach the last evaluation"


def _finished_seeds(rows: list[dict], last: int = 30) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in rows:
        if r["rl_step"] == last:
            out.setdefault(r["arm"], []).append(r["seed"])
    return out


def test_the_evaluation_costs_are_the_committed_benchmark():
    r = _latest("eval-cost_*.json")
    h, g, roll = r["heldout_ce"], r["greedy_eval"], r["rollouts"]
    med, val = h["median_s"], h["values"]
    first, second = g["generate_calls"][:2]
    said = (
        f"load average {r['loadavg_before'][0]:.1f} before, {r['loadavg_after'][0]:.1f} after). "
        f"The held-out CEs of {h['conversations']} conversations ({h['tokens_per_set']} tokens, "
        f"both kinds) took {med['shared_prompt']:.1f} s with the shared prompt once"
    )
    assert said in _page(), f"docs/pretrained.md should say: {said}"
    assert f"against {med['full_logits']:.1f} s with every row's logits" in _page()
    old, new = val["full_logits"], val["shared_prompt"]
    assert f"(result {old['result']:.3f}, error {old['error']:.3f})" in _page()
    assert f"(result {new['result']:.3f}, error {new['error']:.3f})" in _page()
    said = (
        f"The greedy evaluation of the {g['questions']} questions took {g['seconds']:.1f} s "
        f"({round(g['success'] * g['questions'])} of {g['questions']} solved, as the pilot's row): "
        f"its first turn, {first['rows']} rows with the {first['shared_prefix']}-token shared "
        f"prompt prefilled once and up to {first['new_tokens_max']} new tokens, "
        f"{first['seconds']:.1f} s; its second, {second['seconds']:.1f} s. One RL step's "
        f"{roll['rollouts']} rollouts took {roll['seconds']:.1f} s"
    )
    assert said in _page(), f"docs/pretrained.md should say: {said}"
    pilot = json.loads((LEARNING / "pilot.json").read_text())[0]
    assert math.isclose(old["result"], pilot["result_ce"], rel_tol=1e-12)  # "to the last digit"
    assert math.isclose(old["error"], pilot["error_ce"], rel_tol=1e-12)
    assert g["success"] == pilot["eval_success"]


def test_the_estimate_of_a_run_is_the_measured_parts():
    """The status paragraph's cost of one run: 30 RL steps (generation, from the eval-cost and
    the learning config's update-step benchmark, and the update) and 7 evaluations."""
    ev = _latest("eval-cost_*.json")
    step = _latest("update-step_*.json", prompts=4, group=8)
    evaluation = ev["greedy_eval"]["seconds"] + ev["heldout_ce"]["median_s"]["shared_prompt"]
    gens = sorted([ev["rollouts"]["seconds"], step["generation_s"]["shared_prompt"]])
    update = step["median_s"]["shared_prefix"]
    hours = [(30 * (g + update) + 7 * evaluation) / 3600 for g in gens]
    said = (
        f"measures](#what-an-evaluation-costs-now) {evaluation:.0f} s at a load average near 3; "
        f"from the parts measured there and in [the learning config's "
        f"step](#a-step-that-pays-for-what-it-trains) (generation {gens[0]:.0f}–{gens[1]:.0f} s, "
        f"update {update:.0f} s), one run of 30 RL steps and 7 evaluations is estimated at "
        f"{hours[0]:.1f}–{hours[1]:.1f} hours of one core at that load, the six runs at "
        f"{6 * hours[0]:.0f}–{6 * hours[1]:.0f} core-hours"
    )
    assert said in _page(), f"docs/pretrained.md should say: {said}"
