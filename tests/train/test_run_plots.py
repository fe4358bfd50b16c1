"""The run's figures (`echoloss.train.plots.plot_run`): one file per question plus the
diagnostics overview, from a metrics.jsonl alone (no pixels compared)."""

from __future__ import annotations

import json

import pytest

from echoloss.train.plots import QUESTIONS, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(path, evaluated: bool) -> None:
    rows = []
    for step in range(1, 13):
        warm = step <= 4
        row = {"step": step, "phase": "warmup" if warm else "rl", "loss_sft": 1.0 / step,
               "grad_norm": 0.5, "reward": 0.1 * (step % 3), "invalid_reply_rate": 0.05}  # fmt: skip
        if evaluated and step in (4, 8, 12):  # the RL start (last warm-up step), then every 4
            row |= {"eval_success_greedy": 0.3 + 0.02 * step, "heldout_hidden_ce": 3.0 / step,
                    "hidden_ce_floor": 0.19, "heldout_obs_ce": 1.0, "obs_ce_floor": 0.02}  # fmt: skip
            if step in (4, 12):
                row |= {"eval_success_sampled": 0.4, "eval_invalid_rate": 0.01,
                        "eval_imagined_rate": 0.0}  # fmt: skip
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("evaluated", [True, False], ids=["evaluated", "no evaluation"])
def test_one_figure_per_question_then_the_overview(tmp_path, evaluated):
    _metrics(tmp_path / "metrics.jsonl", evaluated)
    written = plot_run(tmp_path / "metrics.jsonl", tmp_path / "plots")
    names = [q[0] for q in QUESTIONS]
    assert len(set(names)) == len(names) == 3
    assert [p.name for p in written] == [*names, "training.png"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in written)
    for p in written:
        assert p.read_bytes().startswith(PNG_MAGIC) and p.stat().st_size > 10_000


def test_the_overview_draws_only_logged_panels_and_names_the_others(tmp_path):
    """A run without evaluations, echo or a mismatch KL: those panels are named, not drawn
    empty (the demo's overview had two empty panels)."""
    from echoloss.train.plots import PANELS, overview_panels, read_metrics

    _metrics(tmp_path / "metrics.jsonl", evaluated=False)
    drawn, missing = overview_panels(read_metrics(tmp_path / "metrics.jsonl"))
    assert [p[0] for p in drawn] == [
        "reward (training rollouts; mean of the last 10 steps)",
        "imagined observations / invalid replies (% of turns)",
        "loss terms",
        "gradient norm (before clipping)",
    ]
    assert len(drawn) + len(missing) == len(PANELS)
    assert "mismatch KL (trainer vs sampler)" in missing


def test_rates_are_percent_everywhere_and_axes_start_at_zero():
    """Success and reply rates are drawn in percent in the overview as in the question figures;
    an axis starts at 0 unless a value is negative (loss_rl can be)."""
    from echoloss.train.plots import PANELS, y_bottom

    rate = ("eval_success", "_rate")
    for title, scale, keys in PANELS:
        if any(k.startswith(rate[0]) or k.endswith(rate[1]) for k in keys):
            assert scale == 100.0 and "%" in title, title
        else:
            assert scale == 1.0, title
    for _, _, ylabel, scale, series in QUESTIONS:
        if any(k.startswith(rate[0]) or k.endswith(rate[1]) for k, _, _ in series):
            assert scale == 100.0 and "%" in ylabel
    assert y_bottom([0.2, 3.0]) == 0.0 and y_bottom([-1.5, 2.0]) == -1.5
