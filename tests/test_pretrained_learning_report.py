"""The learning curve's pre-registered rule (``scripts/pretrained_learning_report.py``) on rows
with known answers, and the page's block as the committed rows give it."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "pretrained_learning_report", ROOT / "scripts" / "pretrained_learning_report.py"
)
assert _spec is not None and _spec.loader is not None
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def rows_of(arm: str, deltas: dict[int, tuple[float, float]], **end: float) -> list[dict[str, Any]]:
    """One arm's rows: per seed, a start and an end (RL step 30) ``deltas[seed]`` higher in
    success and well-formed-call rate; ``end`` overrides values at the end."""
    out = []
    for seed, (d_success, d_valid) in deltas.items():
        start = {"eval_success": 0.5, "valid_call_rate": 0.8, "result_ce": 2.7, "error_ce": 2.5}
        last = {"eval_success": 0.5 + d_success, "valid_call_rate": 0.8 + d_valid,
                "result_ce": 2.7, "error_ce": 2.5, **end}  # fmt: skip
        for step, values in ((0, start), (5, start), (30, last)):
            out.append({"arm": arm, "seed": seed, "rl_step": step, **values})
    return out


def test_the_interval_is_the_t_interval_by_hand() -> None:
    d = report.interval([0.1, 0.2, 0.4])
    half = 4.303 * statistics.stdev([0.1, 0.2, 0.4]) / math.sqrt(3)
    assert (d["mean"], d["lo"], d["hi"], d["n"]) == pytest.approx(
        (0.7 / 3, 0.7 / 3 - half, 0.7 / 3 + half, 3)
    )
    with pytest.raises(ValueError, match="at least 2 values"):
        report.interval([0.1])


@pytest.mark.parametrize(
    ("deltas", "reading"),
    [
        ({0: (0.10, 0.05), 1: (0.12, 0.06), 2: (0.08, 0.04)}, "learns"),
        ({0: (0.10, 0.05), 1: (0.12, -0.06), 2: (0.08, 0.04)}, "not shown"),  # validity spans 0
        ({0: (-0.10, 0.05), 1: (-0.12, 0.06), 2: (-0.08, 0.04)}, "gets worse"),  # either below
        ({0: (0.10, 0.05), 1: (0.11, 0.06)}, None),  # 2 seeds: no reading
    ],
)
def test_learning_reads_both_intervals(
    deltas: dict[int, tuple[float, float]], reading: Any
) -> None:
    assert report.learning(rows_of("grpo", deltas), "grpo")["reading"] == reading


def test_a_run_short_of_the_last_evaluation_is_not_read() -> None:
    rows = rows_of("grpo", {0: (0.1, 0.05), 1: (0.12, 0.06), 2: (0.08, 0.04)})
    cut = [r for r in rows if not (r["seed"] == 2 and r["rl_step"] == 30)]
    out = report.learning(cut, "grpo")
    assert out["seeds"] == [0, 1] and out["reading"] is None
    assert "no reading yet: 2 of the 3 seeds" in report.markdown(cut)


def test_two_rows_for_one_evaluation_are_refused() -> None:
    rows = rows_of("grpo", {0: (0.1, 0.05)})
    with pytest.raises(ValueError, match="two rows for arm grpo, seed 0, RL step 30"):
        report.learning([*rows, rows[-1]], "grpo")


def test_the_echo_pilot_pairs_by_seed_and_reads_each_quantity() -> None:
    deltas = {0: (0.1, 0.05), 1: (0.12, 0.06), 2: (0.08, 0.04)}
    grpo = rows_of("grpo", deltas)
    echo = [
        {**r, "error_ce": r["error_ce"] - (0.5 + r["seed"] / 10) * (r["rl_step"] == 30)}
        for r in rows_of("echo", deltas)
    ]
    out = report.echo_pilot(grpo + echo)
    assert out["seeds"] == [0, 1, 2]
    assert out["error_ce"]["reading"] == "lowers"
    assert out["error_ce"]["mean"] == pytest.approx(-0.6)
    assert out["result_ce"]["reading"] == "no effect shown"  # identical: a zero-width interval
    assert out["eval_success"]["reading"] == "no effect shown"
    raised = [{**r, "result_ce": r["result_ce"] + 0.2 + r["seed"] / 100} for r in echo]
    assert report.echo_pilot(grpo + raised)["result_ce"]["reading"] == "raises"
    text = report.markdown(grpo + echo)
    assert "held-out error CE (nats/token) −0.600 [" in text and ": lowers." in text
    assert report.echo_pilot(grpo + echo[:-1])["error_ce"]["reading"] is None  # seed 2 cut


def test_the_error_weight_default_follows_the_two_ce_readings() -> None:
    deltas = {0: (0.1, 0.05), 1: (0.12, 0.06), 2: (0.08, 0.04)}
    grpo = rows_of("grpo", deltas)
    errors_only = [
        {**r, "error_ce": r["error_ce"] - (0.5 + r["seed"] / 10) * (r["rl_step"] == 30)}
        for r in rows_of("echo", deltas)
    ]
    assert report.error_weight_default(report.echo_pilot(grpo + errors_only)) == 0.0
    assert "default** by the rule: **0** (echo lowers the error CE but not" in report.markdown(
        grpo + errors_only
    )
    both = [{**r, "result_ce": r["result_ce"] - (0.2 + r["seed"] / 100) * (r["rl_step"] == 30)}
            for r in errors_only]  # fmt: skip
    assert report.error_weight_default(report.echo_pilot(grpo + both)) == 1.0
    neither = rows_of("echo", deltas)
    assert report.error_weight_default(report.echo_pilot(grpo + neither)) == 1.0
    assert report.error_weight_default(report.echo_pilot(grpo + both[:-1])) is None


def test_the_configs_error_weight_default_is_the_committed_pilots() -> None:
    from echoloss.train.config import EchoSection

    rows = json.loads((report.LEARNING / "results.json").read_text())
    chosen = report.error_weight_default(report.echo_pilot(rows))
    if chosen is None:
        pytest.skip("the echo pilot has no reading yet (fewer than 3 paired seeds at RL step 30)")
    assert EchoSection().error_weight == chosen, (
        f"echo.error_weight defaults to {EchoSection().error_weight}, the committed pilot's rule "
        f"gives {chosen}: set it in echoloss/train/config.py"
    )


def test_the_block_is_spliced_between_its_markers_only() -> None:
    begin, end = report.MARKERS
    page = f"a\n{begin}\nold\n{end}\nb\n"
    assert report.update_page(page, []) == f"a\n{begin}\n{report.markdown([])}\n{end}\nb\n"
    with pytest.raises(ValueError, match="exactly one"):
        report.update_page("no markers", [])


def test_the_page_prints_the_readings_and_the_rows_of_the_committed_rows() -> None:
    def read(name: str) -> list[dict[str, Any]]:
        path = report.LEARNING / name
        return json.loads(path.read_text()) if path.is_file() else []

    page = report.PAGE.read_text()
    assert report.update_page(page, read("results.json"), read("pilot.json")) == page, (
        "docs/pretrained.md's learning verdict is stale: run "
        "python scripts/pretrained_learning_report.py"
    )


def test_the_scripts_examples_run() -> None:
    import doctest

    failed, tried = doctest.testmod(report, optionflags=doctest.ELLIPSIS)
    assert tried >= 4 and failed == 0


def test_the_pages_result_prose_is_the_committed_rows() -> None:
    """The numbers the result paragraph of docs/pretrained.md states, recomputed from the rows."""
    rows = json.loads((report.LEARNING / "results.json").read_text())
    page = report.PAGE.read_text()
    if "**Result: complete, 6 of 6 runs" not in page:
        pytest.skip("the page states no result yet")
    at = {(r["arm"], r["seed"], r["rl_step"]): r for r in rows}
    runs = sorted({(r["arm"], r["seed"]) for r in rows})
    assert len(runs) == 6 and all((a, s, 30) in at for a, s in runs)
    assert len({r["commit"] for r in rows}) == 1  # "all at one commit"
    n = {r["eval_n"] for r in rows}
    assert n == {64}
    starts = {(at[(a, s, 0)]["eval_success"], at[(a, s, 0)]["valid_call_rate"]) for a, s in runs}
    assert starts == {(31 / 64, 0.8125)}  # "from 31 of 64 (0.484)", "from 0.812"
    solved = [round(at[(a, s, 30)]["eval_success"] * 64) for a, s in runs]
    assert min(solved) == 52 and max(solved) == 64 and solved.count(52) == 4
    assert all(at[(a, s, 30)]["valid_call_rate"] == 1.0 for a, s in runs)
    dips = {(a, s): at[(a, s, 5)]["eval_success"] for a, s in runs
            if at[(a, s, 5)]["eval_success"] < 31 / 64}  # fmt: skip
    assert {k: round(v, 3) for k, v in dips.items()} == {
        ("echo", 1): 0.328,
        ("echo", 2): 0.219,
        ("grpo", 2): 0.312,
    }
    assert "(0.328 and 0.219), and so had GRPO's in seed 2 (0.312)" in page
    assert all(at[(a, s, 15)]["eval_success"] > 31 / 64 for a, s in runs)  # recovered by 15
    pilot = report.echo_pilot(rows)
    assert pilot["result_ce"]["reading"] == pilot["error_ce"]["reading"] == "lowers"
    assert pilot["error_ce"]["mean"] < pilot["result_ce"]["mean"]  # "far more than the results"
    assert (
        pilot["valid_call_rate"]["reading"]
        == pilot["eval_success"]["reading"]
        == ("no effect shown")
    )
    half = (pilot["eval_success"]["hi"] - pilot["eval_success"]["lo"]) / 2
    assert 0.25 < half < 0.35  # "spans about ±0.3"
    for arm in ("grpo", "echo"):
        d = report.learning(rows, arm)
        assert d["reading"] == "learns"
        assert d["valid_call_rate"]["lo"] == d["valid_call_rate"]["hi"] == pytest.approx(0.1875)


def test_the_readme_and_changelog_quote_the_committed_rows() -> None:
    rows = json.loads((report.LEARNING / "results.json").read_text())
    if len(report.finished_seeds(rows, "echo")) < report.MIN_SEEDS:
        pytest.skip("the curve is not complete")
    solved = sorted(round(r["eval_success"] * 64) for r in rows if r["rl_step"] == 30)
    readme = (report.ROOT / "README.md").read_text()
    assert f"from 31 of 64 questions to {solved[0]}–{solved[-1]} in all six runs" in " ".join(
        readme.split()
    )
    changelog = " ".join((report.ROOT / "CHANGELOG.md").read_text().split())
    pilot = report.echo_pilot(rows)
    for quoted in (
        f"{report._ci(report.learning(rows, 'grpo')['eval_success'])} (GRPO)",
        f"{report._ci(report.learning(rows, 'echo')['eval_success'])} (echo)",
        f"({report._ci(pilot['result_ce'])} nats/token)",
        f"error CE ({report._ci(pilot['error_ce'])})",
    ):
        assert quoted in changelog, quoted
