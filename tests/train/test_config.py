"""The trainer's configuration: every bad input is an error naming its key; nothing is written."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _train_helpers import REPO

from echoloss.train.cli import main
from echoloss.train.config import ConfigError, load_config, parse_config


def test_embedded_default_and_every_shipped_config_validate(tmp_path):
    cfg = load_config(None)
    assert cfg.model.path is None and cfg.echo.alpha > 0 and cfg.data.source == "generate"
    assert load_config(REPO / "configs" / "default.toml") == cfg  # the file spells out the default
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text("")
    for path in sorted((REPO / "configs").glob("*.toml")):
        if path.name == "gpu.toml":
            with pytest.raises(ConfigError, match=r"model\.path"):  # needs a real model directory
                load_config(path)
            model = tmp_path / "model"
            model.mkdir()
            (model / "config.json").write_text("{}")
            load_config(path, {"model.path": str(model)})
        elif path.name == "jsonl.toml":
            with pytest.raises(ConfigError, match=r"path: no such file"):
                load_config(path)
            load_config(path, {"data.path": str(rollouts)})
        else:
            load_config(path)


@pytest.mark.parametrize(
    ("data", "key", "what"),
    [
        ({"optim": {"lrr": 1e-3}}, "optim.lrr", "unknown key"),
        ({"nonsense": {}}, "nonsense", "unknown key"),
        ({"optim": {"lr": "fast"}}, "optim.lr", "valid number"),
        ({"data": {"group_size": 1.5}}, "data.group_size", "valid integer"),
        ({"model": {"path": "/no/such/model"}}, "model.path", "no such directory"),
        ({"loss": {"policy": "ppo"}}, "loss.policy", "ppo_clip"),
        ({"loss": {"eps_lo": 0.2}}, "loss.eps_lo", "unknown key"),
        ({"data": {"source": "jsonl"}}, "data", "path: required"),
        ({"echo": {"alpha": -1}}, "echo.alpha", "greater than or equal to 0"),
        # `gt=0` alone admits +inf: every float is finite
        ({"optim": {"lr": math.inf}}, "optim.lr", "finite number"),
        ({"optim": {"eps": "inf"}}, "optim.eps", "finite number"),
        ({"data": {"temperature": math.inf}}, "data.temperature", "finite number"),
        ({"echo": {"alpha": math.inf}}, "echo.alpha", "finite number"),
        ({"warmup": {"lr": math.nan}}, "warmup.lr", "finite number"),
        ({"train": {"seed": 10**30}}, "train.seed", "less than or equal to 4294967295"),
        ({"loss": {"policy": "custom"}}, "loss", "policy = 'custom' needs a policy function"),
        ({"advantages": {"fn": "grop"}}, "advantages.fn", "unknown advantage fn 'grop'"),
        ({"advantages": {"kwargs": {"scal": "x"}}}, "advantages.kwargs", "does not accept"),
        ({"advantages": {"fn": "rloo", "rae_decay": 0.9}}, "advantages", "not used when"),
        ({"env": {"max_turns": 1}}, "env", "cannot solve any task"),
    ],
)
def test_bad_config_names_the_key(data, key, what):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    msg = str(err.value)
    assert f"  {key}: " in msg and what in msg, msg


def test_model_path_without_config_json_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.path: .*no config\.json"):
        parse_config({"model": {"path": str(tmp_path)}})


def test_partial_loss_table_keeps_the_trainer_defaults():
    cfg = parse_config({"loss": {"policy": "dppo"}})
    assert cfg.loss.policy == "dppo" and cfg.loss.echo_normalization == "sequence_mean"


def test_overrides_and_toml_errors(tmp_path):
    cfg = load_config(None, {"train.max_steps": 7, "echo.alpha": 0})
    assert cfg.train.max_steps == 7 and cfg.echo.alpha == 0
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nlr = \n")
    with pytest.raises(ConfigError, match=r"not valid TOML.*line 2"):
        load_config(bad)
    with pytest.raises(FileNotFoundError, match="--config"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[optim]\nlr = 'x'\n", "optim.lr"),
        ("[model]\npath = '/definitely/not/here'\n", "model.path"),
        ("[trian]\nmax_steps = 3\n", "trian"),
    ],
)
def test_cli_reports_the_key_and_writes_nothing(tmp_path, capsys, toml, key):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    out = tmp_path / "run"
    assert main(["--config", str(cfg), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{key}: " in err, err
    assert not out.exists()


def test_cli_set_parses_json_values(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--set", "optim.betas=[0.9]", "--output-dir", str(out)]) == 2
    assert "optim.betas" in capsys.readouterr().err
    assert not Path(out).exists()


def test_every_problem_is_reported_in_one_message():
    data = {
        "optim": {"lr": math.inf},
        "advantages": {"fn": "grop"},
        "train": {"seed": 10**30},
        "loss": {"policy": "custom"},
    }
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    lines = str(err.value).splitlines()[1:]
    keys = [line.split(":")[0].strip() for line in lines]
    assert keys == ["advantages.fn", "loss", "optim.lr", "train.seed"], lines


def test_a_turn_limit_that_leaves_tasks_unsolvable_warns(recwarn):
    from echoloss.train.config import ConfigWarning, turns_needed

    need = turns_needed("gridwalk", 4)
    assert need == 7  # the farthest goal on 4x4 is 6 moves, then "done"
    with pytest.warns(ConfigWarning, match=rf"max_turns >= {need}"):
        parse_config({"env": {"name": "gridwalk", "size": 4, "max_turns": need - 1}})
    recwarn.clear()
    parse_config({"env": {"name": "gridwalk", "size": 4, "max_turns": need}})
    assert not [w for w in recwarn if issubclass(w.category, ConfigWarning)]


def test_gridwalk_demonstrations_stop_at_the_turn_limit():
    """The scripted demonstration of a goal farther than the turn limit ends with the episode
    (formerly: "act() on a finished episode" in the warm-up, e.g. the fast config with seed 5
    and three warm-up steps)."""
    import random

    from echoloss.train.envs.gridwalk import GridWalk, Task, demonstration

    env = GridWalk(size=3, max_turns=3)
    messages = demonstration(env, Task(start=(0, 0), goal=(2, 2)), random.Random(0))
    assert [m["content"] for m in messages if m["role"] == "assistant"] == ["right"] * 2 + ["down"]
    full = demonstration(GridWalk(size=3), Task(start=(0, 0), goal=(2, 2)), random.Random(0))
    assert full[-1] == {"role": "assistant", "content": "done"}


def test_every_demonstration_fits_the_turns_the_config_asks_for():
    """turns_needed matches the environments' own scripted demonstrations: at that limit every
    task's demonstration ends with "done" on the goal, and one turn fewer cuts one short."""
    import random

    from echoloss.train.config import turns_needed
    from echoloss.train.envs.gridwalk import GridWalk, Task, demonstration

    for size in (2, 3, 5):
        cells = [(x, y) for x in range(size) for y in range(size)]
        tasks = [Task(start=s, goal=g) for s in cells for g in cells if s != g]

        def solved(limit: int, tasks: list[Task] = tasks, size: int = size) -> bool:
            env = GridWalk(size=size, max_turns=limit)
            return all(
                demonstration(env, t, random.Random(0))[-1]["content"] == "done" for t in tasks
            )

        need = turns_needed("gridwalk", size)
        assert solved(need) and not solved(need - 1), size


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_cpu_machine_is_a_clear_error_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--set", "model.device=cuda", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "model.device: 'cuda' but" in err and "'cpu'" in err, err
    assert not out.exists()


def test_a_dict_is_validated_like_a_file_and_anything_else_is_named(tmp_path):
    from echoloss.train.recipe import train

    with pytest.raises(ConfigError, match=r"optim\.lr: .*finite"):
        train({"optim": {"lr": math.inf}, "train": {"output_dir": str(tmp_path / "x")}})
    with pytest.raises(ConfigError, match=r"expected a table of sections .* got list"):
        parse_config([("optim", {})])  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()


def test_report_to_and_the_opt_in_have_command_line_flags():
    from echoloss.train.command import _overrides, _parser

    args = _parser().parse_args(["--report-to", "tensorboard", "wandb", "--allow-import-paths"])
    assert _overrides(args) == {
        "train.allow_import_paths": True,
        "train.report_to": ["tensorboard", "wandb"],
    }
    assert _overrides(_parser().parse_args([])) == {}


def test_the_experiment_is_not_a_subcommand_and_the_refusal_names_its_command(capsys):
    """The experiments live beside the package (examples/research/echo_experiment): the trainer's
    command refuses ``experiment`` with exit 2 and names the command that runs them, and its
    help does not list it."""
    assert main(["experiment", "--summarize-only", "--output-dir", "x"]) == 2
    err = capsys.readouterr().err
    assert "'experiment' is not a subcommand" in err, err
    assert "python examples/research/echo_experiment/run.py" in err, err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert usage.startswith("usage: echoloss-train") and "experiment" not in usage, usage
    assert "examples/research/echo_experiment/run.py" in " ".join(out.split()), out


@pytest.mark.parametrize("key", ["warmup_flip_prob", "demo_explore"])
def test_mirrorgrid_only_env_options_are_refused_elsewhere_and_range_checked(key):
    with pytest.raises(
        ConfigError,
        match=rf"{key}: applies to the environments mirrorgrid, mirrorgrid-shown, mirrorgrid-noise, not gridwalk",
    ):
        parse_config({"env": {"name": "gridwalk", key: 0.3}})
    with pytest.raises(ConfigError, match=rf"env\.{key}"):
        parse_config({"env": {key: 1.5}})
    cfg = parse_config({"env": {"name": "mirrorgrid-noise", key: 0.3}})
    assert getattr(cfg.env, key) == 0.3
