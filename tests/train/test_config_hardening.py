"""Schedule and trainer-config settings that were ignored or crashed: a named error instead."""

from __future__ import annotations

import math
import warnings

import pytest

from echoloss.schedules import echo_alpha
from echoloss.train.config import ConfigError, load_config
from echoloss.train.data import heldout_conversations
from echoloss.train.envs import make_env

FAST = "configs/fast.toml"


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"step": math.nan}, TypeError, "step must be an int"),
        ({"step": 1.0}, TypeError, "step must be an int"),
        ({"alpha": True}, TypeError, "alpha must be a float"),
        ({"schedule": "warmup", "steps": math.nan}, TypeError, "steps must be an int"),
        ({"final_alpha": 0.01}, ValueError, "final_alpha=0.01 is ignored by schedule='constant'"),
        ({"steps": 3}, ValueError, "steps=3 is ignored by schedule='constant'"),
        (
            {"schedule": "warmup", "steps": 3, "final_alpha": 0.01},
            ValueError,
            "final_alpha=0.01 is ignored by schedule='warmup'",
        ),
    ],
)
def test_echo_alpha_refuses_bad_or_ignored_settings(kw, error, match):
    with pytest.raises(error, match=match):
        echo_alpha(**{"step": 0, "alpha": 0.1, **kw})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"echo.final_alpha": 0.01},
            r"echo.final_alpha=0.01 is ignored by echo.schedule='constant'",
        ),
        (
            {"echo.schedule_steps": 3},
            r"echo.schedule_steps=3 is ignored by echo.schedule='constant'",
        ),
        (
            {"echo.schedule": "warmup", "echo.schedule_steps": 3, "echo.final_alpha": 0.5},
            r"echo.final_alpha=0.5 is ignored by echo.schedule='warmup'",
        ),
        ({"train.output_dir": ""}, r"output_dir is empty"),
        ({"train.output_dir": "  "}, r"output_dir is empty"),
        (
            {"train.report_to": ["tensorboard", "tensorboard"]},
            r"report_to lists tensorboard more than once",
        ),
    ],
)
def test_config_refuses_ignored_or_harmful_settings(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(FAST, overrides)


def test_two_turn_limit_builds_its_held_out_set():
    """env.max_turns=2 crashed building the held-out walks (empty randrange); it warns instead
    (some tasks unsolvable) and the walks take the one move the limit leaves."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = make_env("mirrorgrid", size=4, max_turns=2)
    walks = heldout_conversations(env, count=3)
    assert len(walks) == 3 and all(len(w) > 1 for w in walks)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"env.max_turns": 10**9}, r"env.max_turns = 1000000000: .* data.max_tokens = 1024"),
        ({"data.group_size": 10**9}, r"data.prompts_per_step \* data.group_size = \d+ samples"),
        ({"data.heldout_size": 10**12}, r"data.heldout_size = 1000000000000 samples"),
        ({"warmup.demos_per_step": 10**12}, r"warmup.demos_per_step = 1000000000000 samples"),
        ({"model.hidden_size": 2**20, "model.num_heads": 4}, r"model: hidden_size = 1048576"),
        ({"model.num_layers": 10**9}, r"num_layers = 1000000000 make"),
    ],
)
def test_sizes_the_machine_cannot_hold_are_refused_at_validation(overrides, match):
    """env.max_turns = 10**9 was accepted: the first held-out walk ran 673 M turns (a hang or
    an out-of-memory kill at start-up); the other counts allocated before any check."""
    with pytest.raises(ConfigError, match=match):
        load_config(FAST, overrides)


def test_size_bounds_follow_the_machine_and_the_token_limit():
    from echoloss.train.config import parse_config, size_problems

    cfg = parse_config({"env": {"max_turns": 1024}, "data": {"max_tokens": 1024}})
    assert size_problems(cfg) == []
    with pytest.raises(ConfigError, match=r"env.max_turns = 1000000000: .* <= 1024"):
        parse_config({"env": {"name": "calculator", "max_turns": 10**9}})
    small = parse_config({"data": {"prompts_per_step": 2, "group_size": 2}})
    (problem,) = [p for p in size_problems(small, memory=3 * 1024) if "group_size" in p]
    assert "4 samples need at least" in problem


def _cli(argv, capsys):
    from echoloss.train.command import run

    code = run(["--config", FAST, *argv])
    return code, capsys.readouterr().err


def test_output_dir_that_is_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    """Was a 20-line FileExistsError traceback."""
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    code, err = _cli(["--output-dir", str(f)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "--output-dir (train.output_dir)" in err and "is an existing file" in err
    assert f.read_text() == "keep me"


def test_a_fresh_run_into_a_used_output_dir_is_refused_and_nothing_is_touched(tmp_path, capsys):
    """A re-run (`bash scripts/demo.sh --max-steps 1` after a full demo) truncated
    metrics.jsonl and left the old step_000100 beside the new checkpoints, with no word."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step_000100").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n' * 140)
    code, err = _cli(["--output-dir", str(out), "--max-steps", "1"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "is not empty (checkpoints, metrics.jsonl)" in err
    assert "--resume" in err and "--overwrite" in err and "new --output-dir" in err
    assert (out / "metrics.jsonl").read_text().count("\n") == 140
    assert (out / "checkpoints" / "step_000100").is_dir()


def test_overwrite_removes_the_earlier_runs_outputs_only(tmp_path):
    from echoloss.train.config import parse_config
    from echoloss.train.snapshots import claim_output_dir

    out = tmp_path / "run"
    for d in ("checkpoints/step_000100", "final-model", "plots", "token_exports"):
        (out / d).mkdir(parents=True)
    for name in ("metrics.jsonl", "eval.jsonl", "rollouts.rank0.jsonl", "rollouts.rank3.jsonl"):
        (out / name).write_text("x\n")
    (out / "my-notes.md").write_text("mine")
    cfg = parse_config({"train": {"output_dir": str(out), "overwrite": True}})
    claim_output_dir(cfg.train, None, rank=1)  # other ranks never remove anything
    assert (out / "metrics.jsonl").exists()
    claim_output_dir(cfg.train, None, rank=0)
    assert sorted(p.name for p in out.iterdir()) == ["my-notes.md"]
    # resuming the directory's own run is never refused; another directory's checkpoint is
    (out / "metrics.jsonl").write_text("x\n")
    plain = parse_config({"train": {"output_dir": str(out)}})
    claim_output_dir(plain.train, out, rank=0)
    claim_output_dir(plain.train, out / "checkpoints" / "step_000001", rank=0)
    with pytest.raises(ConfigError, match="is not empty"):
        claim_output_dir(plain.train, tmp_path / "elsewhere" / "step_000001", rank=0)
