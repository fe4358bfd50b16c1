"""The experiment's statistics and summary (pure functions on result rows), and the
imagined-observation diagnostic as the trainer reads it from sampled token ids."""

from __future__ import annotations

import math
import statistics

import pytest
from echo_experiment.experiment import paired_ci, runs_table, steps_to, summarize


def test_paired_ci_by_hand():
    d = [0.02, -0.01, 0.05, 0.0]
    r = paired_ci(d)
    half = 3.182 * statistics.stdev(d) / 2  # t_{0.975, 3} * s / sqrt(4)
    assert r["mean"] == pytest.approx(0.015, abs=1e-15)
    assert (r["lo"], r["hi"]) == pytest.approx((0.015 - half, 0.015 + half), abs=1e-15)
    assert r["n"] == 4
    one = paired_ci([0.3])
    assert one["mean"] == 0.3 and math.isnan(one["lo"]) and math.isnan(one["hi"])
    assert paired_ci([])["n"] == 0


def test_steps_to_threshold():
    evals = [{"rl_step": 30, "s": 0.9}, {"rl_step": 0, "s": 0.5}, {"rl_step": 15, "s": 0.79}]
    assert steps_to(evals, "s", 0.8) == 30
    assert steps_to(evals, "s", 0.95) is None
    assert steps_to(evals, "s", 0.5) == 0


def _row(arm, seed, start, end, ce_start, ce_end, reached=None):
    return {
        "env": "mirrorgrid", "arm": arm, "alpha": 0.0 if arm == "grpo" else 0.01, "seed": seed,
        "rl_steps": 30, "eval_success_start": start, "eval_success_end": end,
        "eval_success_sampled_start": start, "eval_success_sampled_end": end,
        "steps_to_80": reached, "heldout_obs_ce_start": ce_start, "heldout_obs_ce_end": ce_end,
        "obs_ce_floor": 0.03, "imagined_obs_rate_end": 0.0, "invalid_reply_rate_end": 0.0,
        "curve": [],
    }  # fmt: skip


def test_summary_pairs_by_seed_and_censors_steps():
    rows = runs_table(
        [
            _row("grpo", 0, 0.4, 0.5, 0.8, 0.7),
            _row("grpo", 1, 0.5, 0.7, 0.9, 0.85, reached=15),
            _row("echo-0.01", 0, 0.4, 0.6, 0.8, 0.3),
            _row("echo-0.01", 1, 0.5, 0.6, 0.9, 0.4),
            _row("echo-0.01", 1, 0.5, 0.65, 0.9, 0.4),  # a re-run: the last row wins
        ]
    )
    assert [(r["arm"], r["seed"]) for r in rows] == [
        ("echo-0.01", 0), ("grpo", 0), ("echo-0.01", 1), ("grpo", 1)
    ]  # fmt: skip
    s = summarize(rows)
    e = s["arms"]["echo-0.01"]
    diff = e["eval_success_end"]["diff_vs_grpo"]  # (0.6 - 0.5, 0.65 - 0.7)
    assert diff["mean"] == pytest.approx(0.025) and diff["n"] == 2
    assert e["heldout_obs_ce_drop"]["mean"] == pytest.approx(0.5)  # (0.5 + 0.5) / 2
    assert s["arms"]["grpo"]["heldout_obs_ce_drop"]["mean"] == pytest.approx(0.075)
    # Steps to 80 %: a run that never reached it counts at its last RL step (30).
    assert s["arms"]["grpo"]["steps_to_80_or_censored"]["mean"] == pytest.approx(22.5)
    assert s["arms"]["grpo"]["reached_80"] == 1 and e["reached_80"] == 0
    assert "diff_vs_grpo" not in s["arms"]["grpo"]["eval_success_end"]


def test_summarize_only_on_an_empty_directory_is_a_clear_error(tmp_path, capsys):
    from echo_experiment.experiment import main

    assert main(["--summarize-only", "--output-dir", str(tmp_path)]) == 2
    assert "no finished runs" in capsys.readouterr().err


def test_imagined_observations_are_read_with_special_tokens():
    from echoloss.train.data import _reply_text
    from echoloss.train.envs import imagined_observation
    from echoloss.train.model import build_tokenizer

    tok = build_tokenizer()

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    eos = [tok.eos_token_id]
    assert _reply_text(tok, ids("left") + eos) == "left"
    # Special tokens stay in the text the diagnostic reads (decoding would drop them).
    scaffold = [*ids("left"), tok.convert_tokens_to_ids("<|im_start|>"), *ids("user")]
    assert tok.decode(scaffold, skip_special_tokens=True) == "leftuser"
    assert imagined_observation(_reply_text(tok, scaffold))
    assert not imagined_observation(_reply_text(tok, ids("left") + eos))


def test_the_committed_results_are_complete_and_match_their_summary():
    """docs/experiment/results.json holds the measured rows with the documented fields, and
    summary.json is what `summarize` computes from them (the page's numbers come from it)."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs" / "experiment"
    rows = json.loads((docs / "results.json").read_text())
    required = ("env", "arm", "alpha", "seed", "eval_success_start", "eval_success_end",
                "heldout_obs_ce_start", "heldout_obs_ce_end", "obs_ce_floor")  # fmt: skip
    assert isinstance(rows, list) and rows
    for r in rows:
        assert all(r.get(k) is not None for k in required), r["arm"]
        assert 0 <= r["eval_success_start"] <= 1 and 0 <= r["eval_success_end"] <= 1
        assert r["heldout_obs_ce_end"] >= r["obs_ce_floor"] > 0  # nothing beats the exact floor
        assert r["eval_episodes"] >= 1000
    main = [r for r in rows if r["env"] == "mirrorgrid"]
    arms = {r["arm"] for r in main}
    assert {"grpo", "echo-0.005", "echo-0.01", "echo-0.05", "actobs"} <= arms
    for arm in arms:
        assert len({r["seed"] for r in main if r["arm"] == arm}) >= 8, arm
    summary = json.loads((docs / "summary.json").read_text())
    again = summarize([dict(r) for r in main])
    for arm, entry in summary["arms"].items():
        for key in ("eval_success_sampled_end", "heldout_obs_ce_end", "eval_success_end"):
            assert entry[key]["mean"] == pytest.approx(again["arms"][arm][key]["mean"], rel=1e-12)


@pytest.mark.parametrize(
    "folder",
    [
        "controls/mirrorgrid-noise",
        "controls/mirrorgrid-shown",
        "rl-120",
        "copy-1000",
        "default-24-seeds",
        "calibrated-start",
        "short-calibrated-start",
        "exploring-start-400",
        "world-model-start",
    ],
)
def test_the_committed_supplementary_results_match_their_summary(folder):
    """Every supplementary run of docs/experiment.md (controls, 120 RL steps, copy task, 24
    seeds, the calibrated and exploring starts) is what `summarize` computes from its committed
    rows, with complete paired seeds; the verdicts the docs report are recomputed from the rows."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs" / "experiment" / folder
    rows = json.loads((docs / "results.json").read_text())
    summary = json.loads((docs / "summary.json").read_text())
    again = summarize([dict(r) for r in rows])
    assert set(summary["arms"]) == set(again["arms"]) >= {"grpo"}
    for arm in summary["arms"]:
        seeds = {r["seed"] for r in rows if r["arm"] == arm}
        assert seeds == {r["seed"] for r in rows if r["arm"] == "grpo"} and len(seeds) >= 4
        for key in ("eval_success_sampled_end", "heldout_obs_ce_end", "eval_success_end"):
            want = again["arms"][arm][key]["mean"]
            assert summary["arms"][arm][key]["mean"] == pytest.approx(want, rel=1e-12)
    if folder == "rl-120":
        assert {r["rl_steps"] for r in rows} == {120} and len(rows) == 16
    if folder in ("calibrated-start", "short-calibrated-start", "exploring-start-400",
                  "world-model-start"):  # fmt: skip
        assert {r["warmup"] for r in rows} == {"shared"} and len(rows) == 24  # one warm-start
        assert len({r["heldout_obs_ce_start"] for r in rows}) == 1
    if folder == "exploring-start-400":  # the verdicts docs/experiment.md reports
        assert {r["rl_steps"] for r in rows} == {400}
        grpo_gain = again["arms"]["grpo"]["eval_success_sampled_gain"]["mean"]
        assert grpo_gain >= 0.15  # the target, met at 400 RL steps
        echo = again["arms"]["echo-0.05"]["eval_success_sampled_end"]["diff_vs_grpo"]
        assert echo["n"] == 8 and echo["lo"] > -0.03 and echo["hi"] > 0 > echo["lo"]
    if folder == "world-model-start":  # the verdicts docs/experiment.md reports
        assert {r["rl_steps"] for r in rows} == {60}
        arms = again["arms"]
        assert arms["grpo"]["eval_success_sampled_gain"]["mean"] >= 0.15  # met at 60 RL steps
        echo = arms["echo-0.2"]["eval_success_sampled_end"]["diff_vs_grpo"]
        assert echo["n"] == 8 and echo["lo"] > -0.03  # not worse
        floor = rows[0]["obs_ce_floor"]
        for arm in ("echo-0.05", "echo-0.2"):  # the CE target, missed: echo's CE rises, less
            assert arms[arm]["heldout_obs_ce_drop"]["mean"] < 0  # than GRPO's, and ends > 2x
            assert arms[arm]["heldout_obs_ce_drop"]["diff_vs_grpo"]["lo"] > 0
            assert arms[arm]["heldout_obs_ce_end"]["mean"] > 2 * floor
        pilot = json.loads((docs / "pilot-300-steps.json").read_text())
        assert {r["rl_steps"] for r in pilot} == {300} and {r["seed"] for r in pilot} == {0}
        partial = {r["arm"]: r for r in json.loads((docs / "pilot-partial-start.json").read_text())}
        assert {r["rl_steps"] for r in partial.values()} == {200}
        for r in partial.values():  # from a partial world model, echo's CE rises as well
            assert r["heldout_obs_ce_end"] > r["heldout_obs_ce_start"]
        assert partial["echo-0.2"]["heldout_obs_ce_end"] < partial["grpo"]["heldout_obs_ce_end"]
        alpha1 = [
            json.loads(x) for x in (docs / "pilot-alpha1-eval.jsonl").read_text().splitlines()
        ]
        assert alpha1[-1]["rl_step"] == 60 and alpha1[-1]["eval_success_greedy"] == 0.0
    if folder == "default-24-seeds":  # the main experiment's seeds 0-7, extended to 24
        assert {r["rl_steps"] for r in rows} == {60} and len(rows) == 48
        main = json.loads((docs.parent / "results.json").read_text())
        first8 = [r for r in main if r["arm"] in ("grpo", "echo-0.01")]
        assert [r for r in rows if r["seed"] < 8] == first8
        echo = again["arms"]["echo-0.01"]["eval_success_sampled_end"]["diff_vs_grpo"]
        assert echo["n"] == 24 and echo["lo"] > -0.03  # the verdict the docs report


def _t_cdf(x: float, df: int) -> float:
    """Student t CDF by Simpson's rule on its density (error < 1e-9 here): no scipy needed."""
    import numpy as np

    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    t = np.linspace(0.0, x, 200_001)
    pdf = np.exp(log_c - (df + 1) / 2 * np.log1p(t * t / df))
    h = t[1] - t[0]
    return 0.5 + h / 3 * (pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum())


def test_t_quantiles_exact_to_30_and_never_narrower_beyond():
    """The interval half-width uses t_{0.975, n-1}: the tabulated quantile's CDF is 0.975 (to the
    3-decimal rounding) up to df 30, and never below 0.975 after: an anti-conservative 1.96 for
    df 31-119 was a bug."""
    from echo_experiment.stats import _t975

    assert _t_cdf(1.959964, 10_000) == pytest.approx(0.975, abs=2e-5)  # the helper itself
    for df in range(1, 31):
        assert _t_cdf(_t975(df), df) == pytest.approx(0.975, abs=3e-5), df
    for df in [*range(31, 130), 200]:
        assert 0.975 <= _t_cdf(_t975(df), df) <= 0.976, df  # at most ~0.001 wider
    with pytest.raises(ValueError, match="df must be >= 1"):
        _t975(0)


def test_a_shared_warm_start_runs_no_warm_jobs_and_each_arm_evaluates_its_start(tmp_path):
    """--warm-start: every arm of every seed loads the one model, evaluates its own RL start
    (eval_at_start), and its row's start numbers come from that evaluation, not a warm job."""
    import argparse
    import json

    from echo_experiment.experiment import MODES, _arm_row, _jobs

    model = tmp_path / "final-model"
    args = argparse.Namespace(
        seeds=[3, 4], alphas=[0.05], no_actobs=True, set=[], output_dir=tmp_path / "out",
        warm_start=model,
    )  # fmt: skip
    jobs = _jobs(args, MODES["quick"], [])
    assert [j.name for j in jobs] == [
        "grpo-seed3",
        "echo-0.05-seed3",
        "grpo-seed4",
        "echo-0.05-seed4",
    ]
    for j in jobs:
        assert j.needs is None and j.meta["warmup"] == "shared"
        sets = [j.args[i + 1] for i, a in enumerate(j.args) if a == "--set"]
        assert f"model.path={model}" in sets and "train.eval_at_start=true" in sets
        assert sets.index("train.eval_at_start=true") > sets.index("train.max_steps=20")
    per_seed = _jobs(argparse.Namespace(**{**vars(args), "warm_start": None}), MODES["quick"], [])
    assert [j.name for j in per_seed][:3] == ["warm-base-seed3", "grpo-seed3", "echo-0.05-seed3"]

    run = tmp_path / "out" / "grpo-seed3"
    run.mkdir(parents=True)
    evals = [
        {"rl_step": 0, "eval_success_greedy": 0.25, "eval_success_sampled": 0.5, "heldout_hidden_ce": 2.0},
        {"rl_step": 20, "eval_success_greedy": 0.75, "eval_success_sampled": 0.625, "heldout_hidden_ce": 1.5},
    ]  # fmt: skip
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    row = _arm_row(tmp_path / "out", jobs[0], "mirrorgrid")
    assert (row["eval_success_start"], row["eval_success_end"]) == (0.25, 0.75)
    assert (row["eval_success_sampled_start"], row["eval_success_sampled_end"]) == (0.5, 0.625)
    assert (row["heldout_obs_ce_start"], row["heldout_obs_ce_end"], row["rl_steps"]) == (
        2.0,
        1.5,
        20,
    )
    assert [c["rl_step"] for c in row["curve"]] == [0, 20]  # the start is not counted twice


def test_a_shared_warm_start_is_checked_before_anything_runs(tmp_path, capsys):
    from echo_experiment.experiment import main

    model = tmp_path / "final-model"
    model.mkdir()
    out = ["--output-dir", str(tmp_path / "out")]
    assert main(["--warm-start", str(model), *out]) == 2
    assert "add --no-actobs" in capsys.readouterr().err
    assert main(["--warm-start", str(model), "--no-actobs", *out]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _level_row(level, arm, alpha, seed, *, end, move_end, reached=None):
    curve = [
        {"rl_step": s, "eval_success_greedy": 0.2 + end * s / 60, "ce_walks_move": 1.5 - s / 60 * (1.5 - move_end)}
        for s in (0, 10, 20, 30, 40, 50, 60)
    ]  # fmt: skip
    return {
        "env": "mirrorgrid-noise", "level": level, "arm": arm, "alpha": alpha, "seed": seed,
        "model": "tiny", "rl_steps": 60, "eval_every": 10, "steps_to_80": reached,
        "eval_success_start": 0.2, "eval_success_end": end, "eval_success_sampled_start": 0.3,
        "eval_success_sampled_end": end, "heldout_obs_ce_start": 2.0, "heldout_obs_ce_end": 1.0,
        "obs_ce_floor": 0.0, "move_ce_start": 1.5, "move_ce_end": move_end,
        "ce_walks_move_end": move_end, "zero_variance_groups": 0.5, "curve": curve,
    }  # fmt: skip


def test_persistence_verdicts_follow_the_preregistered_criteria(tmp_path):
    """Three seeds: echo 0.05 lowers the move CE below GRPO's and below log 2 and gains 10
    points with reach-80 % speed-ups, the placebo gains nothing -> support; echo 0.01 lowers the
    CE but gains ±1 point -> refutation; per episode the CE does not fall -> undecided."""
    from echo_experiment import persistence
    from echo_experiment.experiment import speed_ratio

    rows = []
    for seed, jitter in enumerate((0.0, 0.01, -0.01)):
        rows += [
            _level_row("per-world", "grpo", 0.0, seed, end=0.5 + jitter, move_end=1.2),
            _level_row("per-world", "echo", 0.01, seed, end=0.5 + jitter + (0.01, -0.01, 0.0)[seed], move_end=0.5 + jitter),
            _level_row("per-world", "echo", 0.05, seed, end=0.6 + 2 * jitter, move_end=0.4, reached=(20, 30, 20)[seed]),
            _level_row("per-world", "placebo", 0.05, seed, end=0.5 + 2 * jitter, move_end=1.2),
            _level_row("per-episode", "grpo", 0.0, seed, end=0.5, move_end=1.0),
            _level_row("per-episode", "echo", 0.05, seed, end=0.5 + jitter, move_end=1.0 - jitter),
        ]  # fmt: skip
    s = summarize([dict(r) for r in rows])
    assert list(s["arms"]) == [
        "per-world grpo", "per-world echo 0.01", "per-world echo 0.05", "per-world placebo 0.05",
        "per-episode grpo", "per-episode echo 0.05",
    ]  # fmt: skip
    strong = persistence.verdict(s, "per-world echo 0.05")
    assert strong["verdict"] == "support" and strong["placebo_no_gain"] is True
    assert strong["success_up"] and strong["speed_up"]  # (20 or 30 + 10) / (60 + 10 + 10)
    r = speed_ratio(rows, "per-world echo 0.05")
    assert r["ratio"] == pytest.approx(math.exp(sum(math.log(x / 80) for x in (30, 40, 30)) / 3))
    assert (r["censored_arm"], r["censored_grpo"]) == (0, 3)
    weak = persistence.verdict(s, "per-world echo 0.01")
    assert weak["ce_below_grpo"] and weak["gains_above_3_ruled_out"]
    assert weak["verdict"] == "refutation"
    assert persistence.verdict(s, "per-episode echo 0.05")["verdict"] == "undecided"
    md = persistence.markdown(s | {"complete_seeds": [0, 1, 2]}, planned_seeds=(0, 1, 2))
    assert "| per-world echo 0.05 | yes / yes | yes / yes | yes | no | **support** |" in md
    assert "| per-world echo 0.01 | yes / yes | no / no | yes | yes | **refutation** |" in md
    interim = persistence.markdown(s | {"complete_seeds": [0, 1, 2]})  # 3 of the 12 planned
    assert "| per-world echo 0.05 | yes / yes | yes / yes | yes | no | **interim** |" in interim
    written = persistence.plots(rows, s, tmp_path)
    assert [p.name for p in written] == [
        "success.png",
        "speed.png",
        "world_model.png",
        "per_episode.png",
    ]
    assert all(p.stat().st_size > 10_000 for p in written)


def test_the_embedded_default_uses_the_setting_the_rows_support():
    """The demo's λ and env are those of docs/experiment.md's measured rows: its echo arm over 24
    paired seeds is not worse than GRPO at the margin (and shows no gain), the larger λ of the
    main run is not (its interval crosses the margin, with more invalid replies), and the rows
    ran the default's env, level, words and RL length."""
    import json
    from pathlib import Path

    from echo_experiment.experiment import MARGIN

    from echoloss.train.config import load_config

    cfg = load_config(None)
    docs = Path(__file__).resolve().parents[2] / "docs" / "experiment"
    arm = f"echo-{cfg.echo.alpha:g}"
    rows24 = json.loads((docs / "default-24-seeds" / "results.json").read_text())
    d24 = summarize([dict(r) for r in rows24])["arms"][arm]["eval_success_sampled_end"]
    assert d24["diff_vs_grpo"]["n"] == 24 and d24["diff_vs_grpo"]["lo"] > MARGIN  # not worse
    assert d24["diff_vs_grpo"]["lo"] < 0  # and no measured gain: the comments claim none
    main = summarize([dict(r) for r in json.loads((docs / "results.json").read_text())])["arms"]
    for larger in [a for a in main if a.startswith("echo-") and float(a[5:]) > cfg.echo.alpha]:
        assert main[larger]["eval_success_sampled_end"]["diff_vs_grpo"]["lo"] < MARGIN, larger
        assert (main[larger]["invalid_reply_rate_end"]["mean"]
                > main[arm]["invalid_reply_rate_end"]["mean"])  # fmt: skip
    for r in rows24:
        assert (r["env"], r["rl_steps"]) == (cfg.env.name, cfg.train.max_steps)
        assert "level" not in r  # the rows before the persistence design: per episode, keys
    assert (cfg.env.level, cfg.env.words) == ("per-episode", "keys")
