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
