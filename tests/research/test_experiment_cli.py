"""The experiment's command refuses what it would ignore or get wrong, with one line naming the
flag, the file and line, or the run directory, and the fix: flags a mode or --summarize-only
does not use, a --resume that would keep another command's runs, results files with a foreign
arm, a cut-off last line or a bad seed, and a page built from other seeds than the
pre-registered ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from echo_experiment.experiment import MODES, _jobs, _parser, foreign_runs, main
from test_experiment import _row

ROOT = Path(__file__).resolve().parents[2]


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "flags", [["--alphas", "0.05"], ["--warm-start", "somewhere"], ["--no-actobs"]]
)
@pytest.mark.parametrize("mode", ["persistence", "persistence-quick"])
def test_the_persistence_design_refuses_the_flags_it_would_ignore(tmp_path, capsys, flags, mode):
    out = tmp_path / "p"
    assert main(["--mode", mode, *flags, "--output-dir", str(out)]) == 2
    err = _err(capsys)
    assert f"{flags[0]} does not apply to --mode {mode}" in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "flags",
    [["--jobs", "3"], ["--set", "optim.lr=1"], ["--config", "fast"], ["--resume"],
     ["--warm-start", "somewhere"]],
)  # fmt: skip
def test_summarize_only_refuses_the_flags_it_would_ignore(tmp_path, capsys, flags):
    assert main(["--summarize-only", *flags, "--output-dir", str(tmp_path)]) == 2
    assert f"--summarize-only runs nothing, so {flags[0]} would be ignored" in _err(capsys)


def _write(out: Path, rows: list, tail: str = "") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def _two_seeds() -> list[dict]:
    return [
        _row("grpo", 0, 0.4, 0.5, 0.8, 0.7),
        _row("echo-0.01", 0, 0.4, 0.6, 0.8, 0.3),
        _row("grpo", 1, 0.5, 0.7, 0.9, 0.85),
        _row("echo-0.01", 1, 0.5, 0.6, 0.9, 0.4),
    ]


SUMMARY = ["--summarize-only", "--alphas", "0.01", "--no-actobs"]


def test_summarize_only_keeps_every_seed_of_the_experiment_asked_for(tmp_path, capsys):
    _write(tmp_path, _two_seeds())
    assert main([*SUMMARY, "--output-dir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["complete_seeds"] == [0, 1]


def test_a_foreign_arm_is_refused_by_line_not_allowed_to_drop_the_other_seeds(tmp_path, capsys):
    """A row of another experiment's arm (seed 0 only) used to join the arm set, so seed 1
    lacked an arm and was dropped from the summary as "incomplete"."""
    path = _write(tmp_path, [*_two_seeds(), _row("echo-0.2", 0, 0.4, 0.6, 0.8, 0.3)])
    assert main([*SUMMARY, "--output-dir", str(tmp_path)]) == 2
    err = _err(capsys)
    assert f"{path}:5: arm 'echo-0.2' is not an arm of --mode quick --alphas 0.01" in err, err
    assert not (tmp_path / "summary.json").exists()


def test_a_seed_outside_the_listed_seeds_is_refused(tmp_path, capsys):
    path = _write(tmp_path, _two_seeds())
    assert main([*SUMMARY, "--seeds", "0", "--output-dir", str(tmp_path)]) == 2
    assert f"{path}:3: seed 1 is not one of --seeds 0" in _err(capsys)


def test_a_cut_off_last_line_is_named_with_what_to_do(tmp_path, capsys):
    path = _write(tmp_path, _two_seeds(), tail='{"env": "mirrorgrid", "arm": "gr')
    assert main([*SUMMARY, "--output-dir", str(tmp_path)]) == 2
    err = _err(capsys)
    assert f"{path}:5: the last line is cut off" in err and "--resume" in err, err


def test_a_broken_line_before_the_last_is_named(tmp_path, capsys):
    path = _write(tmp_path, _two_seeds()[:1], tail="not json\n" + json.dumps(_two_seeds()[1]))
    assert main([*SUMMARY, "--output-dir", str(tmp_path)]) == 2
    assert f"{path}:2: not a JSON row" in _err(capsys)


@pytest.mark.parametrize(
    ("change", "said"),
    [({"seed": None}, "no seed"), ({"seed": "1"}, "seed '1'"), ({"seed": -1}, "seed -1"),
     ({"seed": True}, "seed True"), ({"arm": None}, "arm None"), ({"arm": 3}, "arm 3")],
)  # fmt: skip
def test_a_row_with_a_bad_seed_or_arm_is_named_by_line(tmp_path, capsys, change, said):
    rows = _two_seeds()
    rows[2] = {k: v for k, v in (rows[2] | change).items() if v is not None}
    path = _write(tmp_path, rows)
    assert main([*SUMMARY, "--output-dir", str(tmp_path)]) == 2
    assert f"{path}:3: {said}" in _err(capsys)


def test_a_row_that_is_not_an_object_is_named(tmp_path, capsys):
    path = _write(tmp_path, [*_two_seeds(), [1, 2]])
    assert main([*SUMMARY, "--output-dir", str(tmp_path)]) == 2
    assert f"{path}:5: a row must be a JSON object, got list" in _err(capsys)


def _persistence_jobs(out: Path, mode: str = "persistence-quick"):
    args = _parser().parse_args(["--mode", mode, "--seeds", "0", "--output-dir", str(out)])
    args.seeds, args.alphas, args.warm_start, args.no_actobs = [0], [], None, False
    return _jobs(args, MODES[mode], [])


def _finish(out: Path, job, args: list[str] | None) -> None:
    """A finished run of ``job`` (its final model's config), made by ``args`` (None: no record)."""
    (out / job.name / "final-model").mkdir(parents=True)
    (out / job.name / "final-model" / "config.json").write_text("{}")
    if args is not None:
        (out / f"{job.name}.args.json").write_text(json.dumps({"args": args}))


def test_resume_refuses_a_warm_start_made_by_another_mode(tmp_path, capsys):
    """``warm-base-seed0`` is the warm-start's name in every mode: a --mode quick one (the
    ordinary env, no compass words) kept by a persistence --resume would be every arm's start."""
    out = tmp_path / "p"
    quick = _parser().parse_args(["--mode", "quick", "--seeds", "0", "--output-dir", str(out)])
    quick.seeds, quick.alphas, quick.warm_start, quick.no_actobs = [0], [0.05], None, False
    [warm_quick] = [j for j in _jobs(quick, MODES["quick"], []) if j.name == "warm-base-seed0"]
    _finish(out, warm_quick, warm_quick.args)
    _write(out, [])
    argv = ["--mode", "persistence-quick", "--seeds", "0", "--resume", "--output-dir", str(out)]
    assert main(argv) == 2
    err = _err(capsys)
    assert "--resume would keep 1 finished run(s)" in err and "warm-base-seed0" in err, err
    assert "env.name=mirrorgrid-noise" in err, err  # what differs
    assert (out / "results.jsonl").exists()  # refused before anything was written


def test_resume_keeps_its_own_runs_and_refuses_unrecorded_ones(tmp_path):
    out = tmp_path / "p"
    jobs = _persistence_jobs(out)
    _finish(out, jobs[0], jobs[0].args)
    assert foreign_runs(jobs, out) == []
    _finish(out, jobs[1], None)
    [bad] = foreign_runs(jobs, out)
    assert bad.startswith(jobs[1].name) and "no record of the command" in bad


def _persistence_rows(seeds: list[int]) -> list[dict]:
    rows = json.loads((ROOT / "docs/experiment/persistence/results.json").read_text())
    seed0 = [r for r in rows if r["seed"] == 0]
    return [{**r, "seed": s} for s in seeds for r in seed0]


@pytest.mark.parametrize(
    ("seeds", "foreign"), [([*range(11), 99], "[99]"), (list(range(13)), "[12]")]
)
def test_the_page_checks_the_pre_registered_seed_set_not_its_size(tmp_path, capsys, seeds, foreign):
    """Seeds 0–10 and 99 are twelve seeds, but not the twelve pre-registered ones; 0–12 are
    thirteen. Either used to publish "complete" verdicts ("12 of 12", "13 of 12")."""
    from echo_experiment import page

    run = tmp_path / "run"
    _write(run, _persistence_rows(seeds))
    docs = tmp_path / "docs"
    docs.mkdir()
    before = (ROOT / "docs" / "experiment.md").read_text()
    (docs / "experiment.md").write_text(before)
    assert page.main([str(run), "--docs", str(docs)]) == 2
    err = _err(capsys)
    assert f"rows of seeds {foreign}, which are not pre-registered (seeds 0–11)" in err, err
    assert (docs / "experiment.md").read_text() == before
    assert not (docs / "experiment").exists()


@pytest.mark.parametrize(
    ("item", "said"),
    [("echo.alpha=0.3", "each arm sets its own λ (--alphas)"),
     ("train.seed=4", "--seeds"), ("model.path=/m", "--warm-start"),
     ("train.threads=4", "one CPU thread"), ("train.output_dir=x", "inside --output-dir"),
     ("novalue", "--set expects KEY=VALUE")],
)  # fmt: skip
def test_a_set_item_every_run_would_override_is_refused(tmp_path, capsys, item, said):
    out = tmp_path / "e"
    assert main(["--set", item, "--output-dir", str(out)]) == 2
    assert said in _err(capsys)
    assert not out.exists()


@pytest.mark.parametrize("item", ["env.world=3", "env.level=per-episode", "echo.span=noise"])
def test_the_persistence_design_refuses_set_items_it_fixes(tmp_path, capsys, item):
    assert main(["--mode", "persistence", "--set", item, "--output-dir", str(tmp_path / "p")]) == 2
    assert f"--set {item!r} would be overridden in every run" in _err(capsys)


def test_a_bad_set_value_is_refused_once_before_any_run(tmp_path, capsys):
    """An invalid value used to reach every run, each failing in its own log."""
    out = tmp_path / "e"
    assert main(["--set", "env.name=maze", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err  # the trainer's config message: a line per bad key
    assert "Traceback" not in err and "env.name: expected one of" in err, err
    assert not out.exists()


def test_an_output_dir_that_is_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "f"
    path.write_text("x")
    assert main(["--output-dir", str(path)]) == 2
    assert "is a file, not a directory" in _err(capsys)
    assert main(["--summarize-only", "--output-dir", str(path)]) == 2
    assert "is a file, not a directory" in _err(capsys)


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["world-model-probe", "--steps", "-1"], "argument --steps: must be an integer >= 1"),
     (["world-model-probe", "--batch", "0"], "argument --batch: must be an integer >= 1"),
     (["world-model-probe", "--hidden-size", "0"], "argument --hidden-size: must be an integer >= 4"),
     (["world-model-probe", "--hidden-size", "18"], "--hidden-size: must be a multiple of 4"),
     (["world-model-probe", "--lr", "nan"], "argument --lr: must be a finite number > 0"),
     (["heldout-ce", "x", "--count", "0"], "argument --count: must be an integer >= 1")],
)  # fmt: skip
def test_the_probe_commands_refuse_numbers_out_of_range(capsys, argv, said):
    """--steps -1 used to run nothing and print nothing; --batch 0 and --hidden-size 0 ended in
    ZeroDivisionError tracebacks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "echo_experiment_run", ROOT / "examples" / "research" / "echo_experiment" / "run.py"
    )
    assert spec and spec.loader
    command = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(command)
    with pytest.raises(SystemExit) as exit_:
        command.main(argv)
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["world-model-probe", "heldout-ce"])
def test_a_missing_model_directory_is_one_line(tmp_path, capsys, sub):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "echo_experiment_run", ROOT / "examples" / "research" / "echo_experiment" / "run.py"
    )
    assert spec and spec.loader
    command = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(command)
    missing = str(tmp_path / "none")
    argv = (
        [sub, "--init", missing, "--steps", "1"] if sub == "world-model-probe" else [sub, missing]
    )
    assert command.main(argv) == 2
    err = _err(capsys)
    assert err.startswith(f"{sub}: model.path: {missing!r} is not a local Hugging Face model"), err
