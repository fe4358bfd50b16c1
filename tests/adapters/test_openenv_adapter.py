"""OpenEnv RFC 010 token-role masks → samples."""

from __future__ import annotations

import logging

import pytest
import torch

import echoloss
from echoloss.adapters.openenv import sample_from_record, sample_from_tags

# context(2) action(2) warning(1) env_output(3) action(1)
IDS = [10, 11, 20, 21, 30, 40, 41, 42, 22]
ACTION = [0, 0, 1, 1, 0, 0, 0, 0, 1]
OBS = [0, 0, 0, 0, 0, 1, 1, 1, 0]
WARN = [0, 0, 0, 0, 1, 0, 0, 0, 0]


def test_env_only_echoes_output_but_counts_warnings_in_z():
    s = sample_from_tags(
        torch.tensor(IDS),
        action_mask=torch.tensor(ACTION, dtype=torch.bool),
        obs_mask=OBS,
        warning_mask=WARN,
        world_model_coeff=0.05,
        logprobs=[-0.1, -0.2, -0.3],
        temperature=0.8,
        env_name="term",
    )
    assert s.prompt_ids == [10, 11]
    assert s.completion_ids == [20, 21, 30, 40, 41, 42, 22]
    assert s.completion_mask == [True, True, False, False, False, False, True]
    assert s.completion_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.3]
    assert s.completion_temperatures == [0.8] * 7
    assert s.echo_weights == [None] * 5 + [0.05] * 3 + [None]
    assert s.observation_mask == [False] * 4 + [True] * 4 + [False]
    assert s.env_name == "term"
    # What the loss sees after packing: RL on actions, echo on env output, disjoint.
    s.advantage = 1.0
    [batch] = echoloss.pack([s], max_tokens=16)
    assert batch.rl_mask.tolist()[:9] == [bool(a) for a in ACTION]
    assert batch.echo_weights.tolist()[:9] == pytest.approx([0, 0, 0, 0, 0, 0.05, 0.05, 0.05, 0])


def test_all_target_and_openenv_style_obs_mask_that_already_holds_warnings():
    expected = [None] * 4 + [0.5] * 4 + [None]
    s = sample_from_tags(IDS, action_mask=ACTION, obs_mask=OBS, warning_mask=WARN,
                         world_model_coeff=0.5, world_loss_target="all")  # fmt: skip
    assert s.echo_weights == expected
    merged = [o or w for o, w in zip(OBS, WARN, strict=True)]
    s = sample_from_record({"input_ids": IDS, "action_mask": ACTION, "obs_mask": merged,
                            "warning_mask": WARN, "world_model_coeff": 0.5,
                            "world_loss_target": "all"})  # fmt: skip
    assert s.echo_weights == expected
    # env_only subtracts the warnings again
    s = sample_from_record({"token_ids": IDS, "action_mask": ACTION, "obs_mask": merged,
                            "warning_mask": WARN}, world_model_coeff=0.5)  # fmt: skip
    assert s.echo_weights == [None] * 5 + [0.5] * 3 + [None]


def test_zero_coefficient_is_plain_grpo_and_full_length_logprobs_are_accepted():
    lp = [0.0, 0.0, -0.1, -0.2, 9.0, 9.0, 9.0, 9.0, -0.3]  # values off actions are ignored
    s = sample_from_tags(IDS, action_mask=ACTION, obs_mask=OBS, world_model_coeff=0.0, logprobs=lp)
    assert s.echo_weights is None and s.observation_mask is None
    assert s.completion_logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.3]


def test_observation_at_position_zero_is_not_echoed(caplog):
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        s = sample_from_tags([1, 2, 3], action_mask=[0, 0, 1], obs_mask=[1, 1, 0],
                             world_model_coeff=0.1)  # fmt: skip
    assert s.echo_weights == [None, 0.1, None]
    assert s.observation_mask == [False, True, False]
    assert "position 0" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"obs_mask": OBS[:-1]}, ValueError, "obs_mask has length 8, expected 9"),
        ({"warning_mask": [2] * 9}, ValueError, r"warning_mask\[0\] = 2"),
        ({"obs_mask": [1] * 9}, ValueError, "token 2 is in both action_mask and obs_mask"),
        ({"world_model_coeff": -0.1}, ValueError, "must be >= 0"),
        ({"world_model_coeff": float("nan")}, ValueError, "finite"),
        ({"world_loss_target": "warnings"}, ValueError, "expected 'env_only' or 'all'"),
        ({"logprobs": [0.0] * 4}, ValueError, r"logprobs has length 4; expected 9 .* or 3"),
        ({"input_ids": [[1, 2]]}, TypeError, r"input_ids\[0\] must be an int"),
    ],
)
def test_bad_tags_are_errors(kwargs, error, match):
    args = {
        "input_ids": IDS,
        "action_mask": ACTION,
        "obs_mask": OBS,
        "warning_mask": WARN,
        "world_model_coeff": 0.05,
    }
    args.update(kwargs)
    ids = args.pop("input_ids")
    with pytest.raises(error, match=match):
        sample_from_tags(ids, **args)


def test_record_without_required_fields_is_an_error():
    with pytest.raises(ValueError, match="no 'input_ids'"):
        sample_from_record({"action_mask": ACTION})
    with pytest.raises(ValueError, match="no 'obs_mask'"):
        sample_from_record({"input_ids": IDS, "action_mask": ACTION})
    with pytest.raises(ValueError, match="no world_model_coeff"):
        sample_from_record({"input_ids": IDS, "action_mask": ACTION, "obs_mask": OBS})


def test_record_with_an_unknown_key_is_an_error():
    record = {"input_ids": [1, 2, 3], "action_mask": [0, 1, 0], "obs_mask": [0, 0, 1],
              "warnings_mask": [0, 0, 1], "world_model_coeff": 0.1}  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['warnings_mask'\]"):
        sample_from_record(record)
    with pytest.raises(ValueError, match="both 'input_ids' and 'token_ids'"):
        sample_from_record(
            {"input_ids": [1], "token_ids": [1], "action_mask": [1], "obs_mask": [0]}
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"logprobs": [-0.1, 0.4, -0.3]}, ValueError, r"must be a log-probability \(<= 0\)"),
        ({"temperature": True}, TypeError, "temperature must be a positive float, got bool"),
        ({"world_loss_target": ["all"]}, ValueError, "world_loss_target"),
    ],
)
def test_impossible_values_are_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        sample_from_tags(IDS, action_mask=ACTION, obs_mask=OBS, world_model_coeff=0.1, **kwargs)


def test_negative_token_id_is_an_error():
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] must be a token id"):
        sample_from_tags([-1, 2], action_mask=[0, 1], obs_mask=[0, 0], world_model_coeff=0.0)
