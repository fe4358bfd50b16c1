"""The experiment's figures: one file per question, drawn from rows alone (no pixels compared),
the intervals they print are `paired_ci`'s, and every figure docs/experiment.md shows exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from echo_experiment.figures import FIGURES, interval_text, paired_differences, write_figures
from echo_experiment.stats import paired_ci

DOCS = Path(__file__).resolve().parents[2] / "docs"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(seeds: list[int]) -> list[dict]:
    """Three arms over ``seeds``, each with a three-point evaluation curve."""
    rows = []
    for a, arm in enumerate(("grpo", "echo-0.01", "echo-0.05")):
        for s in seeds:
            rows.append({
                "env": "mirrorgrid", "arm": arm, "alpha": [0.0, 0.01, 0.05][a], "seed": s,
                "rl_steps": 40, "eval_success_sampled_end": 0.4 + 0.05 * a + 0.01 * s,
                "invalid_reply_rate_end": 0.01 * (a + 1), "obs_ce_floor": 0.19,
                "curve": [{"rl_step": t, "heldout_hidden_ce": 3.0 - 0.2 * a * t / 20 + 0.1 * s}
                          for t in (0, 20, 40)],
            })  # fmt: skip
    return rows


@pytest.mark.parametrize("seeds", [[0, 1, 2], [5]], ids=["three seeds", "one seed"])
def test_one_file_per_question_and_nothing_else(tmp_path, seeds):
    written = write_figures(_rows(seeds), tmp_path / "figs")
    assert written == [tmp_path / "figs" / name for name in FIGURES]
    assert len(set(FIGURES)) == 3
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == sorted(FIGURES)
    for path in written:
        assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 10_000


def test_no_rows_is_an_error_naming_the_argument(tmp_path):
    with pytest.raises(ValueError, match="rows is empty"):
        write_figures([], tmp_path)
    assert not list(tmp_path.iterdir())


def test_the_success_figure_pairs_each_arm_with_grpo_by_seed():
    rows = _rows([0, 1, 2])
    rows[0]["eval_success_sampled_end"] = 0.1  # grpo seed 0
    del rows[-1]["eval_success_sampled_end"]  # echo-0.05 seed 2: not paired
    diffs = paired_differences(rows, "eval_success_sampled_end")
    assert list(diffs) == ["echo-0.01", "echo-0.05"]
    assert diffs["echo-0.01"] == pytest.approx([0.45 - 0.1, 0.05, 0.05], abs=1e-12)
    assert diffs["echo-0.05"] == pytest.approx([0.5 - 0.1, 0.1], abs=1e-12)
    # The text beside a row is paired_ci of the differences, in points, with minus signs.
    d = [100 * x for x in diffs["echo-0.01"]]
    ci = paired_ci(d)
    text = f"+{ci['mean']:.1f} [{ci['lo']:+.1f}, +{ci['hi']:.1f}]".replace("-", "−")
    assert interval_text(d) == text == "+15.0 [−28.0, +58.0]"


def test_summarize_only_draws_the_figures_from_the_rows(tmp_path, capsys):
    """``--summarize-only`` on the main run's committed rows writes the three figures (and no
    multi-panel comparison.png)."""
    from echo_experiment.experiment import main

    rows = json.loads((DOCS / "experiment" / "results.json").read_text())
    keep = [r for r in rows if r["seed"] < 2 and r["arm"] in ("grpo", "echo-0.05")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keep))
    assert main(["--mode", "full", "--summarize-only", "--output-dir", str(tmp_path)]) == 0
    assert ", ".join(FIGURES) in capsys.readouterr().out
    assert {p.name for p in tmp_path.glob("*.png")} == set(FIGURES)


def test_every_figure_the_experiment_page_shows_exists_with_its_siblings():
    page = (DOCS / "experiment.md").read_text()
    targets = re.findall(r"!\[[^\]]+\]\((experiment/[^)]+\.png)\)", page)
    assert targets and not [t for t in targets if t.endswith("comparison.png")]
    missing = [t for t in targets if not (DOCS / t).is_file()]
    assert not missing, f"the page shows figures that do not exist: {missing}"
    folders = {Path(t).parent for t in targets if Path(t).name in FIGURES[1:]}
    for folder in folders:  # a folder's figures are shown together, one question each
        assert {t for t in targets if Path(t).parent == folder} >= {
            str(folder / name) for name in FIGURES
        }, folder
        assert (DOCS / folder / "results.json").is_file()  # drawn from committed rows
