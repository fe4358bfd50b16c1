"""The trainer's configuration: every bad input is an error naming its key; nothing is written."""

from __future__ import annotations

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
