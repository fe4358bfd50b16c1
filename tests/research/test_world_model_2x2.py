"""The world-model 2×2 (docs/experiment.md): its worlds, its stage and sham, its driver's plan and
rows, and its pre-registered verdict on synthetic rows with known answers."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from echo_experiment import world_model_report as report
from echo_experiment.stats import paired_ci
from echo_experiment.world_model import StageConfig, lr_at, observation_batch, stage_walks
from echo_experiment.world_model_2x2 import SHAM_WALKS, Job, arm_row, main, plan, steps_to

from echoloss.train.envs import MirrorGrid
from echoloss.train.envs.mirrorgrid import MOVES, world_permutation

KEYS = tuple(MOVES)  # up, down, left, right
DERANGEMENTS = {
    p for p in itertools.permutations(KEYS) if all(a != b for a, b in zip(p, KEYS, strict=True))
}


# ------------------------------------------------------------------------------------------------
# The worlds


def test_there_are_nine_derangements_of_four_directions() -> None:
    # why 12 distinct worlds with no direction in place cannot exist (docs/experiment.md)
    assert len(DERANGEMENTS) == 9


def test_every_seed_has_a_world_where_no_key_moves_its_own_way() -> None:
    perms = [world_permutation(w) for w in report.WORLDS]
    assert len(perms) == len(report.SEEDS) == 12
    assert all(p in DERANGEMENTS for p in perms)


def test_the_worlds_cover_every_derangement_and_repeat_only_the_pairs_of_swaps() -> None:
    perms = [world_permutation(w) for w in report.WORLDS]
    assert set(perms[:9]) == DERANGEMENTS  # seeds 0-8: all nine, each once
    swaps = {p for p in DERANGEMENTS if all(p[KEYS.index(p[i])] == KEYS[i] for i in range(4))}
    assert len(swaps) == 3 and set(perms[9:]) == swaps  # seeds 9-11: the three pairs of swaps
    kinds = [p in swaps for p in perms]
    assert kinds.count(True) == kinds.count(False) == 6


# ------------------------------------------------------------------------------------------------
# The stage


def _moves(walk: list[dict[str, Any]]) -> list[str]:
    return [m["content"] for m in walk if m["role"] == "assistant"]


def _replay(walk: list[dict[str, Any]], keys: tuple[str, ...] | None) -> list[str]:
    """The observations of ``walk``'s key presses in the world ``keys`` (None: ordinary)."""
    env = MirrorGrid(words="compass")
    first = next(m["content"] for m in walk if m["role"] == "user").split()
    sx, sy = (int(v) for v in first[1].split(","))
    dx, dy = (int(v) for v in first[3].split(","))
    from echoloss.train.envs.mirrorgrid import MirrorTask

    episode = env.start(MirrorTask((sx, sy), (sx + dx, sy + dy), (False, False), keys))  # type: ignore[arg-type]
    return [o for k in _moves(walk) if (o := env.act(episode, k)) is not None]


@pytest.mark.parametrize("step", [0, 7])
def test_sham_presses_the_same_keys_on_the_same_pairs_in_the_ordinary_world(step: int) -> None:
    env = MirrorGrid(level="per-world", world=report.WORLDS[4], words="compass")
    wm = stage_walks(env, seed=4, step=step, batch=16, walks="world")
    sham = stage_walks(env, seed=4, step=step, batch=16, walks="ordinary")
    train = set(env.train_pairs())
    for a, b in zip(wm, sham, strict=True):
        assert a[:2] == b[:2] and _moves(a) == _moves(b)  # same start message, same key presses
        assert [m["content"] for m in a if m["role"] == "tool"] == _replay(
            a, world_permutation(env.world)
        )
        assert [m["content"] for m in b if m["role"] == "tool"] == _replay(b, None)
        first = a[1]["content"].split()
        sx, sy = (int(v) for v in first[1].split(","))
        dx, dy = (int(v) for v in first[3].split(","))
        assert ((sx, sy), (sx + dx, sy + dy)) in train  # never a held-out pair
    # the world differs from the ordinary one somewhere in the batch
    assert any(_moves(a) and a != b for a, b in zip(wm, sham, strict=True))


def _world_of(walk: list[dict[str, Any]]) -> set[tuple[str, ...]]:
    """The permutations of the four directions under which ``walk``'s observations are right."""
    return {p for p in itertools.permutations(KEYS)
            if [m["content"] for m in walk if m["role"] == "tool"] == _replay(walk, p)}  # fmt: skip


def test_the_shuffled_sham_plays_each_walk_in_a_world_of_its_own() -> None:
    env = MirrorGrid(level="per-world", world=report.WORLDS[0], words="compass")
    wm = stage_walks(env, seed=0, step=2, batch=32, walks="world")
    shuffled = stage_walks(env, seed=0, step=2, batch=32, walks="shuffled")
    assert [_moves(a) for a in wm] == [_moves(b) for b in shuffled]  # the same key presses
    assert [a[:2] for a in wm] == [b[:2] for b in shuffled]  # on the same pairs
    worlds = [_world_of(w) for w in shuffled]
    assert all(worlds)  # every walk is consistent with some world ...
    # ... but no one world explains them all: nothing persists across the walks
    assert not set.intersection(*worlds)
    assert all(world_permutation(env.world) in _world_of(w) for w in wm)
    with pytest.raises(ValueError, match="walks must be one of"):
        stage_walks(env, seed=0, step=0, batch=1, walks="sham")


def test_observation_batch_marks_exactly_the_tool_contents() -> None:
    from echoloss.train.model import build_tokenizer

    tok = build_tokenizer(compass=True)
    env = MirrorGrid(level="per-world", world=report.WORLDS[0], words="compass")
    walks = stage_walks(env, seed=0, step=3, batch=5, walks="world")
    x, mask = observation_batch(walks, tok)
    for row, m, walk in zip(x, mask, walks, strict=True):
        text = "".join(tok.decode([int(t)]) for t in row[m])
        assert text == "".join(w["content"] for w in walk if w["role"] == "tool")


def test_reply_kl_is_the_mean_kl_of_the_masked_positions_in_fp64() -> None:
    import torch
    from echo_experiment.world_model import reply_kl

    g = torch.Generator().manual_seed(0)
    held, logits = (torch.randn(3, 5, 7, generator=g, dtype=torch.float64) * 4 for _ in range(2))
    mask = torch.rand(3, 6, generator=g) < 0.5
    mask[0, 1] = True
    p, q = torch.softmax(held, -1), torch.softmax(logits, -1)
    kl = (p * (p.log() - q.log())).sum(-1)  # [3, 5], position t predicts token t + 1
    want = kl[mask[:, 1:]].mean()
    assert float(reply_kl(held, logits, mask)) == pytest.approx(float(want), rel=1e-12)
    assert float(reply_kl(held, held, mask)) == pytest.approx(0.0, abs=1e-12)
    assert float(reply_kl(held, logits, mask)) > 0


def test_lr_schedule_ramps_to_the_peak_then_decays_without_a_zero_step() -> None:
    lrs = [lr_at(k, steps=50, peak=3e-3, warmup=10) for k in range(50)]
    assert lrs[:10] == pytest.approx([3e-3 * (k + 1) / 10 for k in range(10)], rel=1e-12)
    assert all(a > b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] > 0
    # the cosine's midpoint: half the peak, halfway through the decay's 41 intervals
    assert lr_at(10 + 20, steps=50, peak=1.0, warmup=10) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 21 / 41)), rel=1e-12
    )


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [({"steps": 0, "peak_lr": 1e-3}, "steps"), ({"steps": 5, "peak_lr": 0.0}, "peak_lr"),
     ({"steps": 5, "peak_lr": math.inf}, "peak_lr"),
     ({"steps": 5, "peak_lr": 1e-3, "warmup_steps": 5}, "warmup_steps"),
     ({"steps": 20, "peak_lr": 1e-3, "batch": 0}, "batch"),
     ({"steps": 20, "peak_lr": 1e-3, "demos": -1}, "demos")],
)  # fmt: skip
def test_stage_config_refuses_bad_values_by_name(kwargs: dict[str, Any], bad: str) -> None:
    with pytest.raises(ValueError, match=f"StageConfig.{bad} must"):
        StageConfig(**kwargs)


# ------------------------------------------------------------------------------------------------
# The driver


def test_plan_runs_seed_by_seed_each_job_after_the_one_it_needs() -> None:
    jobs = plan(Path("o"), [0, 5])
    names = [j.name for j in jobs]
    assert len(jobs) == 2 * (1 + 2 + 2 + 4)
    assert all(names.index(j.needs) < names.index(j.name) for j in jobs if j.needs)
    assert all(j.meta["seed"] == 0 for j in jobs[:9])
    arms = [j for j in jobs if j.meta["kind"] == "arm"]
    assert {(j.meta["start"], j.meta["arm"], j.meta["alpha"]) for j in arms} == {
        ("world-model", "grpo", 0.0), ("world-model", "echo", 0.05),
        ("sham", "grpo", 0.0), ("sham", "echo", 0.05),
    }  # fmt: skip
    seed5 = [j for j in arms if j.meta["seed"] == 5]
    assert all(f"env.world={report.WORLDS[5]}" in j.args for j in seed5)
    assert all("train.max_steps=100" in j.args and "train.eval_every=20" in j.args for j in seed5)
    sham = next(j for j in jobs if j.name == "stage-sham-seed5")
    wm = next(j for j in jobs if j.name == "stage-world-model-seed5")
    assert sham.args[0] == wm.args[0]  # the same warm-start
    assert wm.args[2:4] == ["--walks", "world"] and sham.args[2:4] == ["--walks", SHAM_WALKS]
    assert sham.args[4:] == wm.args[4:]  # the twin differs in its walks' worlds only


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_arm_row_reads_its_start_its_evaluations_and_its_stage(tmp_path: Path) -> None:
    start = {"rl_step": 0, "eval_success_greedy": 0.5, "eval_success_sampled": 0.45,
             "eval_invalid_rate": 0.01, "ce_walks_move": 0.4}  # fmt: skip
    _write(tmp_path / "start-world-model-seed3" / "eval.jsonl", [start])
    evals = [{"rl_step": s, "eval_success_greedy": g, "ce_walks_move": 0.5} for s, g in
             ((20, 0.7), (40, 0.8), (60, 0.75), (80, 0.9))]  # fmt: skip
    evals.append({"rl_step": 100, "eval_success_greedy": 0.85, "eval_success_sampled": 0.8,
                  "eval_invalid_rate": 0.02, "ce_walks_move": 0.6})  # fmt: skip
    _write(tmp_path / "world-model-echo-seed3" / "eval.jsonl", evals)
    _write(tmp_path / "stage-world-model-seed3" / "stage.jsonl",
           [{"step": 0, "tokens": 0}, {"step": 200, "tokens": 123, "ce_walks_move": 0.3}])  # fmt: skip
    job = Job("world-model-echo-seed3", "train", [], meta={"seed": 3, "start": "world-model",
              "arm": "echo", "alpha": 0.05, "world": 12})  # fmt: skip
    row = arm_row(tmp_path, job, {"commit": "abc", "dirty": False})
    assert (row["eval_success_start"], row["eval_success_end"]) == (0.45, 0.8)
    assert (row["move_ce_start"], row["move_ce_end"]) == (0.4, 0.6)
    assert (row["invalid_start"], row["invalid_end"]) == (0.01, 0.02)
    assert row["steps_to_80"] == 40 and row["rl_steps"] == 100
    assert (row["stage_steps"], row["stage_tokens"]) == (200, 123)
    assert (row["commit"], row["dirty"], row["world"]) == ("abc", False, 12)
    assert [c["rl_step"] for c in row["curve"]] == [0, 20, 40, 60, 80, 100]


def test_steps_to_80_and_its_one_censoring_rule() -> None:
    assert steps_to([{"rl_step": 0, "eval_success_greedy": 0.8}]) == 0
    assert steps_to([{"rl_step": 20, "eval_success_greedy": 0.79}]) is None
    assert report.steps_to_80_or_censored({"steps_to_80": None}) == 120


def test_resume_refuses_a_run_made_at_another_commit(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"commit": "0" * 40, "dirty": False}))
    assert main(["--output-dir", str(tmp_path), "--resume"]) == 2
    assert "resume it from a checkout of that commit" in capsys.readouterr().err
    assert main(["--output-dir", str(tmp_path)]) == 2  # without --resume: never overwritten
    assert "continue it with --resume" in capsys.readouterr().err


def test_bad_seeds_and_jobs_are_refused_by_name(tmp_path: Path, capsys: Any) -> None:
    assert main(["--output-dir", str(tmp_path), "--seeds", "12"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert main(["--output-dir", str(tmp_path), "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err
    assert not (tmp_path / "run.json").exists()


# ------------------------------------------------------------------------------------------------
# The verdict, on synthetic rows


def _rows(
    *,
    p1: float,
    p2: float,
    p3: float = 0.0,
    ce_start: float = 0.3,
    sham_ce: float = 2.0,
    echo_ce_end: float = 0.4,
    grpo_ce_end: float = 0.9,
    noise: float = 0.01,
    seeds: tuple[int, ...] = report.SEEDS,
) -> list[dict[str, Any]]:
    """A complete run whose contrasts are ``p1``, ``p2``, ``p3`` (plus small paired noise)."""
    rng = random.Random(0)
    rows = []
    for s in seeds:
        base = 0.4 + 0.02 * s
        success = {
            "sham grpo": base,
            "world-model grpo": base + p1 + rng.uniform(-noise, noise),
            "sham echo": base + p3 + rng.uniform(-noise, noise),
        }
        success["world-model echo"] = success["world-model grpo"] + p2 + rng.uniform(-noise, noise)
        for c in report.CELLS:
            start, arm = c.split(" ")
            wm = start == "world-model"
            rows.append({
                "level": "per-world", "start": start, "arm": arm,
                "alpha": report.ALPHA if arm == "echo" else 0.0, "seed": s,
                "world": report.WORLDS[s] if s < 12 else 0,
                "eval_success_start": base, "eval_success_end": success[c],
                "eval_success_greedy_end": success[c], "move_ce_start": (ce_start if wm else sham_ce)
                + rng.uniform(-noise, noise),
                "move_ce_end": (echo_ce_end if arm == "echo" else grpo_ce_end) + rng.uniform(-noise, noise),
                "steps_to_80": None, "invalid_start": 0.01, "invalid_end": 0.02,
                "rl_steps": report.RL_STEPS, "commit": "f" * 40, "dirty": False,
            })  # fmt: skip
    return rows


def test_support_when_every_part_holds() -> None:
    v = report.verdict(_rows(p1=0.10, p2=0.05))
    assert v["verdict"] == "support" and v["failed"] == []


def test_refutation_when_knowing_the_world_does_not_help() -> None:
    v = report.verdict(_rows(p1=0.0, p2=0.05))
    assert v["verdict"] == "refutation" and v["because"].startswith("knowing the world")
    assert v["failed"] == ["P1 > 0"]


def test_refutation_when_echo_keeps_the_world_model_and_that_does_not_pay() -> None:
    v = report.verdict(_rows(p1=0.10, p2=0.0, grpo_ce_end=1.2))
    assert v["verdict"] == "refutation" and v["because"].startswith("echo keeps")


def test_undecided_names_the_failed_parts() -> None:
    v = report.verdict(_rows(p1=0.10, p2=0.0, grpo_ce_end=0.6, echo_ce_end=0.5))
    assert v["verdict"] == "undecided"  # GRPO keeps the CE too: branch (b) does not apply
    assert v["failed"] == ["P2 > 0"]


def test_no_refutation_without_the_manipulation() -> None:
    v = report.verdict(_rows(p1=0.0, p2=0.0, ce_start=0.9))
    assert v["verdict"] == "undecided" and "manipulation" in v["failed"]
    assert v["parts"]["manipulation"] is False


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda rows: rows[:-4], "44 of 48 runs"),
        (lambda rows: rows[1:], "47 of 48 runs"),
        (lambda rows: [*rows, rows[0]], "appear more than once"),
        (lambda rows: [r | {"world": 2} if r["seed"] == 1 else r for r in rows], "ran world 2"),
        (lambda rows: [r | {"commit": "e" * 40} if r["seed"] == 1 else r for r in rows], "2 code commits"),
        (lambda rows: [r | {"dirty": True} if r["seed"] == 1 else r for r in rows], "clean tree"),
        (lambda rows: [r | {"rl_steps": 60} if r["seed"] == 1 else r for r in rows], "60 RL steps"),
        (lambda rows: [r | {"alpha": 0.01} if r["arm"] == "echo" else r for r in rows], "λ 0.01"),
        (lambda rows: rows + _rows(p1=0.1, p2=0.05, seeds=(12,)), "seeds [12] are not"),
    ],
)  # fmt: skip
def test_no_verdict_on_any_set_but_the_pre_registered_one(change: Any, why: str) -> None:
    rows = change(_rows(p1=0.10, p2=0.05))
    assert report.verdict(rows)["verdict"] is None
    assert any(why in p for p in report.problems(rows)), report.problems(rows)
    assert "no verdict until complete" in report.markdown(rows)


def test_contrasts_are_the_paired_intervals_of_the_rows() -> None:
    rows = _rows(p1=0.10, p2=0.05, p3=-0.02, noise=0.03)
    by = {(r["seed"], report.cell(r)): r for r in rows}

    def diffs(a: str, b: str, key: str = "eval_success_end") -> list[float]:
        return [by[(s, a)][key] - by[(s, b)][key] for s in report.SEEDS]

    c = report.contrasts(rows)
    assert c["P1"] == paired_ci(diffs("world-model grpo", "sham grpo"))
    assert c["P2"] == paired_ci(diffs("world-model echo", "world-model grpo"))
    assert c["P3"] == paired_ci(diffs("sham echo", "sham grpo"))
    assert c["ce_echo_vs_grpo"] == paired_ci(
        diffs("world-model echo", "world-model grpo", "move_ce_end")
    )
    # a hand-computed case: P1 = 0.1 exactly on two seeds has a zero-width interval
    two = [r for r in _rows(p1=0.1, p2=0.0, noise=0.0) if r["seed"] < 2]
    assert report.contrasts(two)["P1"] == pytest.approx({"mean": 0.1, "lo": 0.1, "hi": 0.1, "n": 2})


def test_the_result_block_prints_the_verdict_of_the_complete_rows() -> None:
    md = report.markdown(_rows(p1=0.0, p2=0.05))
    assert md.startswith("### Result: complete, 48 of 48 runs")
    assert "**Verdict by the pre-registered rule: refutation** (knowing the world" in md


# ------------------------------------------------------------------------------------------------
# The page: every number it prints comes from the committed rows or is a setting of the code

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "world-model-2x2.md"
ROWS = ROOT / "docs" / "experiment" / "world-model-2x2"


def test_the_page_prints_the_report_of_the_committed_rows() -> None:
    """The pilot and result blocks are `update_page` of the committed ``pilot.json`` and
    ``results.json``: every number in them is recomputed from the rows here."""
    pilot = json.loads((ROWS / "pilot.json").read_text())
    rows = json.loads((ROWS / "results.json").read_text())
    progress_file = ROWS / "progress.json"
    progress = json.loads(progress_file.read_text()) if progress_file.is_file() else None
    page = PAGE.read_text()
    assert report.update_page(page, pilot, rows, progress) == page, (
        "docs/world-model-2x2.md does not print the report of its committed rows; run "
        "`python examples/research/echo_experiment/run.py world-model-page "
        "docs/experiment/world-model-2x2`"
    )
    done = len(rows)
    if report.problems(rows):
        assert f"**In progress: {done} of 48 runs; no verdict until complete.**" in page
    assert all(r["commit"] and r["dirty"] is False for r in rows)


def test_the_pilot_rows_meet_what_the_page_says() -> None:
    from echo_experiment import world_model_pilot as pilot_mod
    from echo_experiment.world_model_2x2 import STAGE

    pilot = json.loads((ROWS / "pilot.json").read_text())
    choice = next(r for r in pilot if r["kind"] == "choice")
    stages = [r for r in pilot if r["kind"] == "stage"]
    assert [(r["label"], r["walks"]) for r in stages] == [s[:2] for s in pilot_mod.STAGES]
    wm = [s for s in stages if s["walks"] == "world"]
    assert [s["passes"] for s in wm] == [pilot_mod.passes(s["curve"]) for s in wm]
    assert all(r["commit"] and r["dirty"] is False for r in pilot if r["kind"] != "choice")
    tried = [r for r in pilot if r["kind"] == "start"]
    if choice["chosen"] is not None:
        starts = {r["start"]: r for r in tried if r["label"] == choice["chosen"]}
        assert pilot_mod.met(starts) and starts["sham"]["walks"] == choice["sham"] == SHAM_WALKS
        s = next(s for s in wm if s["label"] == choice["chosen"])
        got = (STAGE.steps, STAGE.peak_lr, STAGE.warmup_steps, STAGE.batch, STAGE.demos)
        assert (*got, STAGE.keep_policy) == (
            s["steps"], s["peak_lr"], s["warmup_steps"], s["batch"], s["demos"], s["keep_policy"])  # fmt: skip
        # every try before the chosen one failed by the criteria
        for label, _ in pilot_mod.TRIES[: [t[0] for t in pilot_mod.TRIES].index(choice["chosen"])]:
            before = {r["start"]: r for r in tried if r["label"] == label}
            assert not before or not pilot_mod.met(before)


def test_the_protocol_prints_the_settings_of_the_code() -> None:
    from echo_experiment import world_model_pilot as pilot_mod

    page = " ".join(PAGE.read_text().split())  # the words, whatever the line breaks
    assert ", ".join(map(str, report.WORLDS)) + "." in page
    assert (
        f"each {report.RL_STEPS} RL steps" in page and f"every {report.EVAL_EVERY} RL steps" in page
    )
    assert f"counted at **{report.CENSORED_AT}**" in page
    assert f"| world-model | echo | {report.ALPHA:g} " in page
    assert f"last {pilot_mod.LAST_K} evaluations" in page
    assert f"at most {round(100 * pilot_mod.MAX_INVALID)} %" in page
    assert f"within {pilot_mod.SHAM_CE} nats" in page
    assert f"within {round(100 * pilot_mod.SHAM_SUCCESS)} points" in page
    from echo_experiment.world_model_2x2 import STAGE

    assert (
        f"peak lr {STAGE.peak_lr:g} over {STAGE.steps} steps ({STAGE.warmup_steps} warm-up)" in page
    )
    assert f"{STAGE.batch} random walks" in page and STAGE.demos == 0 and STAGE.keep_policy


def test_resume_keeps_every_finished_job_and_reads_its_row_back(
    tmp_path: Path, capsys: Any
) -> None:
    from echo_experiment.world_model_2x2 import code_commit

    jobs = plan(tmp_path, [0])
    for j in jobs:  # a run cut off after every job of seed 0 finished
        (tmp_path / j.name / "final-model").mkdir(parents=True)
        (tmp_path / j.name / "final-model" / "config.json").write_text("{}")
        if j.meta["kind"] == "arm":
            row = {"seed": 0, "start": j.meta["start"], "arm": j.meta["arm"]}
            (tmp_path / j.name / "row.json").write_text(json.dumps(row))
    (tmp_path / "run.json").write_text(json.dumps({**code_commit(), "seeds": [0]}))
    assert main(["--output-dir", str(tmp_path), "--seeds", "0", "--resume"]) == 0
    assert "4 of 4 arms finished" in capsys.readouterr().out
    kept = json.loads((tmp_path / "results.json").read_text())
    assert [report.cell(r) for r in kept] == list(report.CELLS)
    assert not list(tmp_path.glob("*.log"))  # nothing ran again


def test_the_pilot_prose_is_its_rows() -> None:
    """The page's account of round 1, checked against the pilot's rows."""
    from echo_experiment import world_model_pilot as pilot_mod

    pilot = json.loads((ROWS / "pilot.json").read_text())
    starts = [r for r in pilot if r["kind"] == "start"]
    first = pilot_mod.TRIES[0][0]
    wm = next(r for r in starts if r["label"] == first and r["start"] == "world-model")
    assert wm["invalid"] == 1.0  # "answered with invalid replies only"
    assert {r["start"] for r in starts if r["label"] == first} == {
        "world-model"
    }  # tried no further
    ordinary = next(r for r in pilot if r["kind"] == "stage" and r["walks"] == "ordinary")
    warm_ce = ordinary["curve"][0]["ce_walks_move"]
    assert ordinary["curve"][-1]["ce_walks_move"] > warm_ce + 4 * pilot_mod.SHAM_CE  # "far above"
    assert not [r for r in starts if r.get("walks") == "shuffled" and r["label"] == first]


def test_progress_names_jobs_done_and_their_wall_times_by_kind() -> None:
    progress = [
        {"job": "warm-seed0", "state": "done", "seconds": 301.0},
        {"job": "stage-world-model-seed0", "state": "done", "seconds": 700.4},
        {"job": "stage-sham-seed0", "state": "done", "seconds": 689.6},
        {"job": "start-world-model-seed0", "state": "failed", "seconds": 12.0},
    ]
    assert report.progress_markdown(progress) == (
        "Jobs finished: 3 of 108 (warm-start 301 s, stages 690–700 s). "
        "Jobs failed: start-world-model-seed0."
    )
    rerun = [*progress, {"job": "start-world-model-seed0", "state": "done", "seconds": 40.0}]
    assert report.progress_markdown(rerun) == (
        "Jobs finished: 4 of 108 (warm-start 301 s, stages 690–700 s, start evaluation 40 s). "
        "Jobs failed: none. Failed once, then finished when run again: start-world-model-seed0."
    )


def test_the_page_reads_a_run_in_progress(tmp_path: Path) -> None:
    from echo_experiment.world_model_page import read_progress, read_rows

    with pytest.raises(SystemExit, match=r"neither results\.jsonl nor results\.json"):
        read_rows(tmp_path)
    (tmp_path / "run.json").write_text("{}")
    assert read_rows(tmp_path) == []  # started, no RL run finished
    rows = [{"seed": 1, "start": "sham", "arm": "echo", "v": 1},
            {"seed": 0, "start": "sham", "arm": "grpo", "v": 2},
            {"seed": 1, "start": "sham", "arm": "echo", "v": 3}]  # fmt: skip
    _write(tmp_path / "results.jsonl", rows)
    assert [r["v"] for r in read_rows(tmp_path)] == [2, 3]  # by seed; a later line wins
    log = tmp_path / "driver.log"
    log.write_text("start warm-seed0\ndone warm-seed0 (197s)\nfailed stage-sham-seed0 (3s)\n")
    assert read_progress(log) == [
        {"job": "warm-seed0", "state": "done", "seconds": 197.0},
        {"job": "stage-sham-seed0", "state": "failed", "seconds": 3.0},
    ]


def test_a_job_cut_off_before_its_first_checkpoint_runs_again_over_its_partial_output(
    tmp_path: Path,
) -> None:
    """A cut-off RL arm continues from its checkpoint; one cut off before its first checkpoint
    (metrics only) reruns with ``--overwrite`` (without it the trainer refuses the used directory
    and the job fails on every ``--resume``); a stage job reruns as planned."""
    from echo_experiment.world_model_2x2 import job_arguments

    by = {j.name: j for j in plan(tmp_path, [1])}
    arm = by["world-model-grpo-seed1"]
    assert job_arguments(tmp_path, arm) == arm.args  # never started
    (tmp_path / arm.name).mkdir()
    assert job_arguments(tmp_path, arm) == arm.args  # an empty directory is not a used one
    (tmp_path / arm.name / "metrics.jsonl").write_text("{}\n")
    assert job_arguments(tmp_path, arm) == [*arm.args, "--overwrite"]
    (tmp_path / arm.name / "checkpoints" / "latest").mkdir(parents=True)
    assert job_arguments(tmp_path, arm) == [*arm.args, "--resume"]
    stage = by["stage-sham-seed1"]
    (tmp_path / stage.name).mkdir()
    (tmp_path / stage.name / "log.jsonl").write_text("{}\n")
    assert job_arguments(tmp_path, stage) == stage.args


def test_in_progress_the_rule_table_uses_the_seeds_of_the_contrasts() -> None:
    """With one seed complete and others partly, the parts shown are those of the complete
    seeds (one: no part decided), not of whichever cells two seeds happen to share."""
    whole = _rows(p1=0.2, p2=0.1, seeds=(0, 1, 2))
    rows = [r for r in whole if r["seed"] == 0 or r["arm"] == "grpo"]  # seeds 1, 2: GRPO only
    assert report.verdict(rows)["parts"]["P1 > 0"] is not None  # three seeds pair P1
    text = report.markdown(rows)
    assert "Contrasts over the paired seeds with all four runs: seed 0 (1)." in text
    assert "| P1 > 0 | – (fewer than two paired seeds) |" in text


# ------------------------------------------------------------------------------------------------
# The committed run: the reading of it, and the rule recomputed without the report module


def _section(page: str, title: str) -> str:
    start = page.index(f"## {title}\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end != -1 else len(page)]


def _committed() -> dict[tuple[int, str, str], dict[str, Any]]:
    rows = json.loads((ROWS / "results.json").read_text())
    return {(r["seed"], r["start"], r["arm"]): r for r in rows}


def _pm(d: dict[str, float], digits: int = 1) -> str:
    return f"{d['mean']:+.{digits}f} [{d['lo']:+.{digits}f}, {d['hi']:+.{digits}f}]".replace(
        "-", "−"
    )


def test_the_reading_of_the_run_is_its_rows() -> None:
    """Every number of "What the run shows, and what it does not", from the committed rows."""
    page_path = Path(__file__).resolve().parents[2] / "docs" / "world-model-2x2.md"
    text = " ".join(
        _section(page_path.read_text(), "What the run shows, and what it does not").split()
    )
    rows = _committed()
    seeds = sorted({s for s, _, _ in rows})
    start = {s: rows[(s, "world-model", "grpo")]["move_ce_start"] for s in seeds}
    met = [s for s in seeds if start[s] < math.log(2)]
    missed = [s for s in seeds if s not in met]
    assert met == [0, 1, 2, 3, 4, 9, 10] and missed == [5, 6, 7, 8, 11]
    assert f"at {len(met)} of the {len(seeds)} seeds (seeds 0, 1, 2, 3, 4, 9, 10: " in text
    assert f"{min(start[s] for s in met):.3f}–{max(start[s] for s in met):.3f} nats)" in text
    assert f"not at the other {len(missed)} (seeds 5, 6, 7, 8, 11: " in text
    assert f"{min(start[s] for s in missed):.3f}–{max(start[s] for s in missed):.3f})" in text
    wm_start = paired_ci([start[s] for s in seeds])
    assert f"mean was {wm_start['mean']:.3f} [{wm_start['lo']:.3f}, {wm_start['hi']:.3f}]" in text
    # the kinds of world: a pair of swaps maps each key's image back to the key
    perms = {s: world_permutation(rows[(s, "world-model", "grpo")]["world"]) for s in seeds}
    swaps = [
        s for s in seeds if all(perms[s][KEYS.index(perms[s][i])] == KEYS[i] for i in range(4))
    ]
    cycles = [s for s in seeds if s not in swaps]
    assert (len(cycles), len(swaps)) == (6, 6)
    in_cycles, in_swaps = len(set(met) & set(cycles)), len(set(met) & set(swaps))
    assert f"it reached it at {in_cycles} of the 6 seeds whose world is a 4-cycle" in text
    assert f"and at {in_swaps} of the 6 whose world is a pair of swaps" in text
    for a, b in ((5, 9), (6, 10), (7, 11)):
        world = rows[(a, "world-model", "grpo")]["world"]
        assert world == rows[(b, "world-model", "grpo")]["world"]
        assert f"world {world}: seed {a} {start[a]:.3f}, seed {b} {start[b]:.3f}" in text

    def end(start_: str, arm: str, s: int) -> float:
        return rows[(s, start_, arm)]["move_ce_end"]

    gap = paired_ci([end("world-model", "echo", s) - end("world-model", "grpo", s) for s in seeds])
    assert f"by {-gap['mean']:.3f} [{-gap['hi']:.3f}, {-gap['lo']:.3f}] nats" in text
    grpo_end = paired_ci([end("world-model", "grpo", s) for s in seeds])
    echo_end = paired_ci([end("world-model", "echo", s) for s in seeds])
    assert f"GRPO's rose from {wm_start['mean']:.3f} to {grpo_end['mean']:.3f}" in text
    assert f"echo's from {wm_start['mean']:.3f} to {echo_end['mean']:.3f}" in text
    assert f"(upper bound {echo_end['hi']:.3f})" in text

    def points(a: tuple[str, str], b: tuple[str, str], on: list[int]) -> dict[str, float]:
        key = "eval_success_end"
        return paired_ci([100 * (rows[(s, *a)][key] - rows[(s, *b)][key]) for s in on])

    wm_grpo, wm_echo, sham_grpo = ("world-model", "grpo"), ("world-model", "echo"), ("sham", "grpo")
    p1, p2 = points(wm_grpo, sham_grpo, seeds), points(wm_echo, wm_grpo, seeds)
    assert f"P1 = {_pm(p1)} points" in text and f"P2 = {_pm(p2)} points" in text
    assert f"a harm and a gain of {min(-p1['lo'], p1['hi']):.0f} points" in text
    p1_met, p2_met = points(wm_grpo, sham_grpo, met), points(wm_echo, wm_grpo, met)
    assert f"On the {len(met)} seeds whose start met the bar, P1 = {_pm(p1_met)} points" in text
    assert f"P2 = {_pm(p2_met)}: no sharper" in text
    # the seeds a ±3-point interval would need at P1's spread
    sd = statistics.stdev(
        [100 * (rows[(s, *wm_grpo)]["eval_success_end"] - rows[(s, *sham_grpo)]["eval_success_end"])
         for s in seeds]
    )  # fmt: skip
    assert f"standard deviation of {sd:.1f} points" in text
    need = next(n for n in range(2, 1000) if report_t975(n - 1) * sd / math.sqrt(n) <= 3)
    assert f"about {need} paired seeds" in text


def report_t975(df: int) -> float:
    from echo_experiment.stats import _t975

    return _t975(df)


#: two-sided 95 % Student t quantiles (standard tables), for the recomputation below
T975 = {6: 2.446912, 11: 2.200985}


def _rule_by_hand(
    rows: dict[tuple[int, str, str], dict[str, Any]],
) -> dict[str, Any]:
    """The written rule on 48 rows keyed by (seed, start, arm), by code of its own (no `report`,
    no `paired_ci`): the quantities it reads, each (mean, lo, hi), and the verdict."""
    seeds = list(range(12))

    def ci(x: list[float]) -> tuple[float, float, float]:
        m = sum(x) / len(x)
        h = T975[len(x) - 1] * statistics.stdev(x) / math.sqrt(len(x))
        return m, m - h, m + h

    def col(start: str, arm: str, key: str) -> list[float]:
        return [rows[(s, start, arm)][key] for s in seeds]

    def diff(a: list[float], b: list[float], scale: float = 1.0) -> list[float]:
        return [scale * (x - y) for x, y in zip(a, b, strict=True)]

    end = "eval_success_end"
    p1 = ci(diff(col("world-model", "grpo", end), col("sham", "grpo", end), 100))
    p2 = ci(diff(col("world-model", "echo", end), col("world-model", "grpo", end), 100))
    wm_start = ci(col("world-model", "grpo", "move_ce_start"))
    sham_gap = ci(
        diff(col("sham", "grpo", "move_ce_start"), col("world-model", "grpo", "move_ce_start"))
    )
    echo_end = ci(col("world-model", "echo", "move_ce_end"))
    grpo_end = ci(col("world-model", "grpo", "move_ce_end"))
    echo_gap = ci(
        diff(col("world-model", "echo", "move_ce_end"), col("world-model", "grpo", "move_ce_end"))
    )
    log2 = math.log(2)
    manipulation = wm_start[2] < log2 and sham_gap[1] > 0
    support = manipulation and p1[1] > 0 and echo_end[0] < log2 and echo_gap[2] < 0 and p2[1] > 0
    refuted = manipulation and (p1[2] < 3 or (echo_end[0] < log2 <= grpo_end[0] and p2[2] < 3))
    verdict = "support" if support else "refutation" if refuted else "undecided"
    return {"p1": p1, "p2": p2, "wm_start": wm_start, "echo_end": echo_end,
            "echo_gap": echo_gap, "manipulation": manipulation, "support": support,
            "refuted": refuted, "verdict": verdict}  # fmt: skip


def test_the_verdict_recomputed_from_the_rows_without_the_report_module() -> None:
    """The written rule applied to the committed rows by code of its own (no `report`, no
    `paired_ci`): the same intervals and the same verdict as the page."""
    rows = _committed()
    assert len(rows) == 48 and {r["commit"] for r in rows.values()} == {
        rows[(0, "sham", "grpo")]["commit"]
    }
    assert not any(r["dirty"] for r in rows.values())

    q = _rule_by_hand(rows)
    p1, p2, wm_start, verdict = q["p1"], q["p2"], q["wm_start"], q["verdict"]
    ours = report.verdict(list(rows.values()))
    assert verdict == ours["verdict"] == "undecided"
    assert set(ours["failed"]) == {"manipulation", "P1 > 0", "echo's end CE below log 2", "P2 > 0"}
    c = report.contrasts(list(rows.values()))
    for (m, lo, hi), key in ((p1, "P1"), (p2, "P2")):  # report's t table has 3 decimals
        assert [100 * c[key][k] for k in ("mean", "lo", "hi")] == pytest.approx(
            [m, lo, hi], abs=0.01
        )
    assert (round(wm_start[2], 3), round(p1[0], 1), round(p2[0], 1)) == (1.032, -0.2, -5.1)


def test_the_gated_verdict_recomputed_without_the_report_or_gate_modules() -> None:
    """The gated design's rule on its rows, by code of its own: the gated run's rows replace the
    first run's for the seeds it ran (no `merged_rows`), one commit per seed, the same verdict
    and the numbers the page prints."""
    first = json.loads((ROWS / "results.json").read_text())
    gated = json.loads((ROWS / "gated" / "results.json").read_text())
    rerun = {r["seed"] for r in gated}
    assert rerun == {5, 6, 7, 8, 11}
    rows = {(r["seed"], r["start"], r["arm"]): r for r in first if r["seed"] not in rerun}
    rows.update({(r["seed"], r["start"], r["arm"]): r for r in gated})
    assert len(rows) == 48 and not any(r["dirty"] for r in rows.values())
    for s in range(12):
        assert len({rows[(s, st, a)]["commit"] for st in ("world-model", "sham")
                    for a in ("grpo", "echo")}) == 1  # fmt: skip

    q = _rule_by_hand(rows)
    p1, p2, wm_start, log2 = q["p1"], q["p2"], q["wm_start"], math.log(2)
    assert q["manipulation"] and not q["support"] and not q["refuted"]  # undecided, met
    assert q["echo_end"][2] < log2 and q["echo_gap"][2] < 0  # echo kept the world model
    assert p1[1] < 0 and p2[1] < 0 and p1[2] > 3 and p2[2] > 3  # what failed, and why not refuted
    assert [round(x, 3) for x in wm_start] == [0.357, 0.277, 0.437]
    assert [round(x, 1) for x in p1] == [-2.5, -13.3, 8.3]
    assert [round(x, 1) for x in p2] == [-0.7, -10.9, 9.4]


# ------------------------------------------------------------------------------------------------
# A further round of a stage


def test_a_further_round_draws_new_walks_counts_on_and_keeps_the_teacher_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``step_offset`` gives a round the walks of the steps after the first round's (not the
    same walks again) and rows that count on; ``teacher_dir`` is the model the KL keeps."""
    from echo_experiment import world_model as wm_mod

    import echoloss.train.model as model_mod
    from echoloss.train.model import build_tiny_model, build_tokenizer

    tok = build_tokenizer(compass=True)
    warm = tmp_path / "warm"
    build_tiny_model(arch="llama", vocab_size=len(tok), hidden_size=16, num_layers=1,
                     num_heads=2, num_kv_heads=1, intermediate_size=32,
                     max_position_embeddings=512, seed=0).save_pretrained(warm)  # fmt: skip
    tok.save_pretrained(warm)
    loaded: list[Path] = []
    drawn: list[int] = []
    real_load, real_walks = model_mod.load_model, wm_mod.stage_walks

    def load(path: Any, **kw: Any) -> Any:
        loaded.append(Path(path))
        return real_load(path, **kw)

    def walks(env: Any, **kw: Any) -> Any:
        drawn.append(kw["step"])
        return real_walks(env, **kw)

    monkeypatch.setattr(model_mod, "load_model", load)
    monkeypatch.setattr(wm_mod, "stage_walks", walks)
    cfg = StageConfig(steps=2, peak_lr=1e-3, warmup_steps=0, batch=2, eval_every=1, heldout=2,
                      keep_policy=True)  # fmt: skip
    first = wm_mod.run_stage(warm, tmp_path / "r1", world=2, walks="world", cfg=cfg, seed=3)
    assert [r["step"] for r in first] == [0, 1, 2] and drawn == [0, 1]
    assert loaded == [warm, warm]  # the model and its teacher
    loaded.clear()
    drawn.clear()
    second = wm_mod.run_stage(tmp_path / "r1" / "final-model", tmp_path / "r2", world=2,
                              walks="world", cfg=cfg, seed=3, step_offset=2, teacher_dir=warm)  # fmt: skip
    assert [r["step"] for r in second] == [2, 3, 4] and drawn == [2, 3]
    assert loaded == [tmp_path / "r1" / "final-model", warm]
    assert second[0]["ce_walks_move"] == pytest.approx(first[-1]["ce_walks_move"], abs=1e-6)
    with pytest.raises(ValueError, match="step_offset must be >= 0"):
        wm_mod.run_stage(warm, tmp_path / "bad", world=2, walks="world", cfg=cfg, seed=3,
                         step_offset=-1)  # fmt: skip


def test_the_gate_pilot_runs_rounds_until_the_gate_and_records_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeds whose first round met the gate get no further round; the others get rounds, each
    with new walks (``step_offset``) and the warm-start as teacher, until the gate or the cap."""
    from echo_experiment import world_model_gate as gate

    run = tmp_path / "run"
    for seed, ces in ((0, (0.5, 0.4, 0.3)), (5, (1.7, 1.6, 1.5))):
        d = run / f"stage-world-model-seed{seed}"
        d.mkdir(parents=True)
        lines = [{"step": 140 + 5 * i, "ce_walks_move": c} for i, c in enumerate(ces)]
        (d / "stage.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    calls: list[dict[str, Any]] = []
    ends = iter([1.2, 0.6])  # seed 5: round 2 misses the bar, round 3 meets it

    def fake_stage(model: Path, out: Path, **kw: Any) -> list[dict[str, Any]]:
        calls.append({"model": model, "out": out, **kw})
        end = next(ends)
        (out / "final-model").mkdir(parents=True)
        return [{"step": kw["step_offset"] + i, "ce_walks_move": end} for i in (130, 140, 150)]

    monkeypatch.setattr(gate, "run_stage", fake_stage)
    rows_path = tmp_path / "gate.json"
    assert gate.main([str(run), str(tmp_path / "out"), "--seeds", "0", "5",
                      "--rows", str(rows_path)]) == 0  # fmt: skip
    rows = json.loads(rows_path.read_text())
    assert [(r["seed"], r["round"], r["steps"], r["gate_met"]) for r in rows] == [
        (0, 1, 150, True), (5, 1, 150, False), (5, 2, 300, False), (5, 3, 450, True),
    ]  # fmt: skip
    assert [c["step_offset"] for c in calls] == [150, 300]
    assert calls[0]["model"] == run / "stage-world-model-seed5" / "final-model"
    assert calls[1]["model"] == tmp_path / "out" / "seed5-round2" / "final-model"
    assert {c["teacher_dir"] for c in calls} == {run / "warm-seed5" / "final-model"}
    assert {c["world"] for c in calls} == {report.WORLDS[5]} and all("commit" in r for r in rows)


def _fake_rounds(monkeypatch: pytest.MonkeyPatch, ends: list[float]) -> list[dict[str, Any]]:
    """``world_model_gate.run_stage`` faked: each round's curve ends at the next of ``ends``."""
    from echo_experiment import world_model_gate as gate

    calls: list[dict[str, Any]] = []
    left = iter(ends)

    def fake_stage(model: Path, out: Path, **kw: Any) -> list[dict[str, Any]]:
        calls.append({"model": model, "out": out, **kw})
        end = next(left)
        (out / "final-model").mkdir(parents=True)
        (out / "final-model" / "config.json").write_text(json.dumps({"end": end}))
        off = kw.get("step_offset", 0)
        return [{"step": off + s, "ce_walks_move": end, "tokens": 100 * (i + 1),
                 "walks": kw["walks"]} for i, s in enumerate((130, 140, 150))]  # fmt: skip

    monkeypatch.setattr(gate, "run_stage", fake_stage)
    return calls


def test_a_gated_stage_runs_rounds_until_the_gate_and_its_sham_as_many(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from echo_experiment import world_model_gate as gate

    calls = _fake_rounds(monkeypatch, [1.5, 1.2, 0.5, 1.7, 1.7, 1.7])
    cfg = StageConfig(steps=150, peak_lr=1e-2)
    warm = tmp_path / "warm"
    wm = gate.run_gated_stage(warm, tmp_path / "wm", world=15, walks="world", cfg=cfg, seed=5)
    assert wm == {"rounds": 3, "gate_met": True, "first_round": None}
    assert [c["step_offset"] for c in calls[1:3]] == [150, 300]
    assert {c.get("teacher_dir") for c in calls[1:3]} == {warm}
    rows = [json.loads(x) for x in (tmp_path / "wm" / "stage.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1] * 3 + [2] * 3 + [3] * 3
    assert [r["tokens"] for r in rows][-1] == 900  # counted on over the rounds
    assert json.loads((tmp_path / "wm" / "final-model" / "config.json").read_text()) == {"end": 0.5}
    sham = gate.run_gated_stage(warm, tmp_path / "sham", world=15, walks="shuffled", cfg=cfg,
                                seed=5, rounds=wm["rounds"])  # fmt: skip
    assert sham["rounds"] == 3 and len(calls) == 6  # as many rounds, gate or not
    assert [c["walks"] for c in calls[3:]] == ["shuffled"] * 3


def test_a_gated_stage_reuses_its_first_round_and_stops_at_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from echo_experiment import world_model_gate as gate

    first = tmp_path / "v1" / "stage-world-model-seed6"
    (first / "final-model").mkdir(parents=True)
    lines = [{"step": s, "ce_walks_move": 1.7, "tokens": 50, "walks": "world"}
             for s in (130, 140, 150)]  # fmt: skip
    (first / "stage.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    calls = _fake_rounds(monkeypatch, [1.6, 1.65, 1.7])
    cfg = StageConfig(steps=150, peak_lr=1e-2)
    got = gate.run_gated_stage(tmp_path / "warm", tmp_path / "wm", world=18, walks="world",
                               cfg=cfg, seed=6, first_round=first, max_rounds=4)  # fmt: skip
    assert got["rounds"] == 4 and got["gate_met"] is False  # the cap, reported as missed
    assert calls[0]["model"] == first / "final-model" and calls[0]["step_offset"] == 150
    with pytest.raises(ValueError, match="has walks \\['world'\\], not 'shuffled'"):
        gate.run_gated_stage(tmp_path / "warm", tmp_path / "x", world=18, walks="shuffled",
                             cfg=cfg, seed=6, first_round=first)  # fmt: skip
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        gate.run_gated_stage(tmp_path / "warm", tmp_path / "x", world=18, walks="world",
                             cfg=cfg, seed=6, rounds=0)  # fmt: skip


def test_the_gated_plan_reuses_the_first_run_and_runs_the_sham_after_its_twin() -> None:
    from echo_experiment.world_model_2x2 import gated_plan

    jobs = {j.name: j for j in gated_plan(Path("o"), [5, 10], Path("v1"))}
    assert len(jobs) == 2 * 8 and not any(n.startswith("warm-") for n in jobs)
    wm, sham = jobs["stage-world-model-seed5"], jobs["stage-sham-seed5"]
    assert wm.kind == sham.kind == "gated-stage" and wm.needs is None
    assert sham.needs == "stage-world-model-seed5"
    assert wm.args[:2] == [
        str(Path("v1/warm-seed5/final-model")),
        str(Path("o/stage-world-model-seed5")),
    ]
    assert sham.args[sham.args.index("--first-round") + 1] == str(Path("v1/stage-sham-seed5"))
    assert sham.args[sham.args.index("--rounds-like") + 1] == str(Path("o/stage-world-model-seed5"))
    assert sham.args[sham.args.index("--walks") + 1] == "shuffled"
    arm = jobs["world-model-echo-seed10"]
    assert f"model.path={Path('o/stage-world-model-seed10/final-model')}" in arm.args
    assert arm.needs == "start-world-model-seed10"


def test_gated_from_must_name_a_run_and_a_resume_keeps_it(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "v2"
    assert main(["--output-dir", str(out), "--gated-from", str(tmp_path / "none")]) == 2
    assert "holds no run (no run.json)" in capsys.readouterr().err
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"commit": "x", "dirty": False, "gated_from": None}))
    first = tmp_path / "v1"
    first.mkdir()
    (first / "run.json").write_text("{}")
    assert main(["--output-dir", str(out), "--resume", "--gated-from", str(first)]) == 2
    assert "resume it as it was started" in capsys.readouterr().err


def test_the_first_stages_are_the_first_runs_and_name_the_seeds_to_gate() -> None:
    """``first-stages.json`` (the first run's stage curves) ends where each row's stage ended,
    and its gate leaves out the seeds whose start missed the bar (and no other)."""
    from echo_experiment.world_model_gate import gated_seeds

    stages = json.loads((ROWS / "first-stages.json").read_text())
    rows = _committed()
    assert len(stages) == 24
    for st in stages:
        row = rows[(st["seed"], st["start"], "grpo")]
        assert st["world"] == row["world"] == report.WORLDS[st["seed"]]
        assert st["curve"][-1]["ce_walks_move"] == row["stage_move_ce_end"] == row["move_ce_start"]
        assert st["curve"][-1]["step"] == row["stage_steps"] == 150
        assert (st["commit"], st["dirty"]) == (row["commit"], False)  # the stage's own job
    gated = gated_seeds(stages)
    missed = [
        s for s in range(12) if rows[(s, "world-model", "grpo")]["move_ce_start"] >= math.log(2)
    ]
    assert gated == missed == [5, 6, 7, 8, 11]


def test_the_gated_designs_numbers_are_the_first_runs() -> None:
    """The gated design's section: its seeds from the first stages, its expectations from the
    first run's rows."""
    from echo_experiment import world_model_gate as gate_mod
    from echo_experiment.stats import _t975
    from echo_experiment.world_model_gate import gated_seeds

    page = (Path(__file__).resolve().parents[2] / "docs" / "world-model-2x2.md").read_text()
    text = " ".join(_section(page, "The gated design (pre-registered before its run)").split())
    rows = _committed()
    gated = gated_seeds(json.loads((ROWS / "first-stages.json").read_text()))
    kept = [s for s in range(12) if s not in gated]
    missed = sum(
        rows[(s, "world-model", "grpo")]["move_ce_start"] >= math.log(2) for s in range(12)
    )
    assert f"left {missed} of the 12 starts above the bar" in text

    def listed(seeds: list[int]) -> str:
        return ", ".join(map(str, seeds[:-1])) + f" and {seeds[-1]}"

    assert f"these are seeds {listed(kept)}." in text and f"Seeds **{listed(gated)}** run" in text
    p1 = [100 * (rows[(s, "world-model", "grpo")]["eval_success_end"]
                 - rows[(s, "sham", "grpo")]["eval_success_end"]) for s in range(12)]  # fmt: skip
    sd = statistics.stdev(p1)
    half = _t975(11) * sd / math.sqrt(12)
    assert f"P1 ({sd:.1f} points over 12 seeds)" in text
    assert f"about ±{half:.0f} points" in text
    assert f"an observed P1 near −{half - 3:.0f} points or lower" in text
    assert f"support one near +{half:.0f} or higher" in text
    gap = statistics.fmean(rows[(s, "sham", "grpo")]["move_ce_start"]
                           - rows[(s, "world-model", "grpo")]["move_ce_start"] for s in range(12))  # fmt: skip
    assert round(gap) == 1 and "(about 1 nat)" in text
    # the pilot's extra seed: met the gate, by less than 0.05 nats at its worst evaluation
    ten = next(st for st in json.loads((ROWS / "first-stages.json").read_text())
               if st["seed"] == 10 and st["start"] == "world-model")  # fmt: skip
    worst = max(e["ce_walks_move"] for e in ten["curve"][-3:])
    assert 10 not in gated and math.log(2) - 0.05 < worst < math.log(2)
    assert "(and seed 10, which met the gate narrowly)" in text
    assert "the gate can be met within 4 rounds" in text and gate_mod.MAX_ROUNDS == 4
    assert (
        f"its {4 * len(gated)} RL runs are done. The block below is the rule's reading of the 48 "
        f"rows: the {4 * len(kept)} kept from the first run and the {4 * len(gated)} of this run"
        in text
    )


def test_the_page_prints_the_gated_blocks_of_the_committed_rows() -> None:
    """The gate pilot's and the gated design's blocks, as `gated_page_main` writes them from
    the committed rows (the first run's for the seeds that met the gate, the gated run's)."""
    from echo_experiment import world_model_gate as gate

    page = (Path(__file__).resolve().parents[2] / "docs" / "world-model-2x2.md").read_text()
    stages = json.loads((ROWS / "first-stages.json").read_text())
    first = json.loads((ROWS / "results.json").read_text())
    gated_path, pilot_path = ROWS / "gated" / "results.json", ROWS / "gate-pilot.json"
    gated = json.loads(gated_path.read_text()) if gated_path.is_file() else []
    pilot = json.loads(pilot_path.read_text()) if pilot_path.is_file() else []
    rows = gate.merged_rows(first, gated, gate.gated_seeds(stages))
    want = report._splice(page, gate.GATE_PILOT_MARKERS, gate.gate_pilot_markdown(pilot, first))
    block = report.markdown(rows, commits="seed").replace("### Result:", "### Gated result:", 1)
    assert report._splice(want, gate.GATED_RESULT_MARKERS, block) == page
    assert {r["seed"] for r in gated} <= set(gate.gated_seeds(stages))
    if len(rows) < 48:
        assert "no verdict until complete" in block


def test_a_seed_may_mix_no_commits_in_the_gated_design() -> None:
    rows = [{"seed": s, "start": st, "arm": a, "commit": f"c{s}", "world": report.WORLDS[s],
             "alpha": report.ALPHA if a == "echo" else 0.0, "rl_steps": report.RL_STEPS,
             "dirty": False} for s in report.SEEDS for st in ("world-model", "sham")
            for a in ("grpo", "echo")]  # fmt: skip
    assert report.problems(rows, commits="seed") == []
    assert "rows from 12 code commits" in report.problems(rows)[0]
    rows[0]["commit"] = "other"
    assert report.problems(rows, commits="seed") == ["seed 0: rows from 2 code commits (c0, other)"]
    with pytest.raises(ValueError, match="commits must be 'run' or 'seed'"):
        report.problems(rows, commits="all")


def test_the_gated_runs_starts_repeat_the_gate_pilots_rounds_exactly() -> None:
    """A check that can fail: each gated seed's world-model start (its stage run again in rounds
    by the gated run) has the move CE of the gate pilot's round that met the gate, to the bit."""
    from echo_experiment import world_model_gate as gate

    gated_path = ROWS / "gated" / "results.json"
    if not gated_path.is_file():
        pytest.skip("the gated run's rows are not committed yet")
    gated = json.loads(gated_path.read_text())
    pilot = json.loads((ROWS / "gate-pilot.json").read_text())
    met = {r["seed"]: r["curve"][-1]["ce_walks_move"] for r in pilot if r["gate_met"]}
    seeds = gate.gated_seeds(json.loads((ROWS / "first-stages.json").read_text()))
    starts = {r["seed"]: r["move_ce_start"] for r in gated if r["start"] == "world-model"}
    assert set(starts) == set(seeds) <= set(met)
    assert {s: starts[s] for s in seeds} == {s: met[s] for s in seeds}


def test_the_reading_of_the_gated_run_is_its_rows() -> None:
    """Every number of "What the gated run shows, and what it does not", and of the other pages
    that quote it, from the committed rows (the first run's 28 kept, the gated run's 20)."""
    from echo_experiment import world_model_gate as gate
    from echo_experiment.world_model_report import _interval

    docs = Path(__file__).resolve().parents[2] / "docs"
    page = " ".join((docs / "world-model-2x2.md").read_text().split())
    start = page.index("**What the gated run shows, and what it does not.**")
    text = page[start : page.index("<!--", start)]
    stages = json.loads((ROWS / "first-stages.json").read_text())
    first = json.loads((ROWS / "results.json").read_text())
    gated = json.loads((ROWS / "gated" / "results.json").read_text())
    rows = gate.merged_rows(first, gated, gate.gated_seeds(stages))
    assert len(rows) == 48 and len(gated) == 20
    v = report.verdict(rows, commits="seed")
    assert v["verdict"] == "undecided" and "**undecided**, with the manipulation met" in text
    c = report.contrasts(rows)

    def ce(d: dict[str, float]) -> str:
        return f"{d['mean']:.3f} [{d['lo']:.3f}, {d['hi']:.3f}]"

    wm_start = c["world-model grpo move_ce_start"]
    assert wm_start["hi"] < math.log(2)
    assert f"move CE is {ce(wm_start)} nats, below `log 2`" in text
    assert f"and {ce(c['ce_sham_vs_wm_start'])} below the sham's" in text
    echo_end, grpo_end = c["world-model echo move_ce_end"], c["world-model grpo move_ce_end"]
    assert echo_end["hi"] < math.log(2) < grpo_end["lo"]
    assert f"echo kept it ({ce(echo_end)} at the end" in text
    assert f"GRPO lost most of it ({ce(grpo_end)}; echo − GRPO" in text
    assert f"echo − GRPO {_interval(c['ce_echo_vs_grpo'])})" in text
    p1, p2 = _interval(c["P1"], 100, 1), _interval(c["P2"], 100, 1)
    assert f"P1 = {p1} points and P2 = {p2}." in text
    half = [f"{100 * (d['hi'] - d['lo']) / 2:.1f}" for d in (c["P1"], c["P2"])]
    assert f"Their half-widths are {half[0]} and {half[1]} points, against the ±7" in text
    assert all(d["lo"] < 0 < 0.03 < d["hi"] for d in (c["P1"], c["P2"]))  # include 0 and +3
    assert f"by less than about {100 * c['P1']['hi']:.0f} points" in text
    experiment = " ".join((docs / "experiment.md").read_text().split())
    assert f"(P1 = {p1} points) nor keeping it (P2 = {p2})" in experiment
    assert f"held ({ce(wm_start)} nats)" in experiment
    changelog = " ".join((docs.parent / "CHANGELOG.md").read_text().split())
    assert f"P1 = {p1}, P2 = {p2} points" in changelog
    assert f"move CE {ce(wm_start)}); echo keeps" in changelog
    assert f"(end {ce(echo_end)}) while GRPO loses it ({ce(grpo_end)})" in changelog
