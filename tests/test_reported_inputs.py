"""Reported bad and extreme inputs, each called through the public API as a user would: every one
is a clear error (its type, and a message naming the argument, the expected and the given value,
and the fix) or a correct, exactly checked result.

Non-finite logits / hidden states / policy outputs / entropy and the fp32/fp16 numerics are
checked in ``tests/loss/test_nothing_silent.py``; here only the paths it does not take (the
keyword form of ``echo_loss``, an explicit ``kl_tau`` with echo rows, the gradient through
``echo_loss`` itself). Trainer items are checked without a training run (configuration
validation and the checkpoint functions); kill-and-resume runs are in ``tests/train``.
"""

from __future__ import annotations

import io
import json
import logging
import math
import pickle
import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from echoloss import (
    EchoConfig,
    EchoFilter,
    LossConfig,
    LossInputs,
    RoleEcho,
    Sample,
    Step,
    count_normalizers,
    echo_loss,
    echo_loss_from_logprobs,
    echo_weights,
    interleave,
    pack,
)

F64 = torch.float64
TOOL = EchoConfig(tool=RoleEcho(alpha=0.5))
# prompt [user scaffold, user body, tool scaffold, tool body, tool body]
TOOL_ATT = {
    "message_indices": [0, 0, 1, 1, 1],
    "is_content": [False, True, False, True, True],
    "message_roles": ["user", "tool"],
    "message_tool_names": [None, "ls"],
}


def _step(**kw):
    d = {
        "prompt_ids": [1, 2, 3, 4, 5],
        "completion_ids": [6, 7],
        "completion_logprobs": [-0.1, -0.2],
        "attribution": TOOL_ATT,
    }
    d.update(kw)
    return Step(**d)


def _sample(**kw):
    d = {
        "prompt_ids": [1, 2],
        "completion_ids": [3, 4],
        "completion_mask": [True, True],
        "completion_logprobs": [-0.1, -0.2],
        "advantage": 1.0,
    }
    d.update(kw)
    return Sample(**d)


def _keyword_loss_args(n=2):
    return {
        "labels": torch.tensor([0, 1])[:n],
        "rl_mask": torch.ones(n, dtype=torch.bool),
        "advantages": torch.ones(n),
    }


class _Gadget:
    """Unpickling it calls ``Path(marker).touch()``: a stand-in for any command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


# ================================================================ security


@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt", "model.pt"])
def test_a_pickle_gadget_in_a_checkpoint_file_is_refused_before_it_runs(tmp_path, name):
    from echoloss.train.checkpoint import CheckpointError, load_tensors

    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Gadget(marker)))  # the payload is live ...
    assert marker.exists()
    marker.unlink()
    torch.save({"state": _Gadget(marker)}, tmp_path / name)
    with pytest.raises(CheckpointError, match=rf"refused to load .*{name}.*weights_only=True"):
        load_tensors(tmp_path / name)
    assert not marker.exists()  # ... and the loader never ran it


def test_an_import_path_in_a_trainer_config_is_refused_without_the_opt_in():
    from echoloss.train.config import ConfigError, load_config

    # what `--set advantages.fn=pydoc:pipepager` builds
    over = {"advantages.fn": "pydoc:pipepager", "advantages.kwargs": {"cmd": "touch /never"}}
    with pytest.raises(ConfigError, match=r"advantages\.fn") as err:
        load_config(None, over)
    assert "--allow-import-paths" in str(err.value) and "allow_import_paths = true" in str(
        err.value
    )


def test_an_echo_filter_import_path_is_refused_without_the_opt_in(tmp_path):
    marker = tmp_path / "pwned"
    cfg = EchoConfig(
        tool=RoleEcho(alpha=0.5),
        filter=EchoFilter(import_path="pydoc:pipepager", kwargs={"cmd": f"touch {marker}"}),
    )
    with pytest.raises(
        ValueError, match=r"EchoFilter\.import_path 'pydoc:pipepager'.*allow_import_paths=True"
    ):
        interleave([_step()], echo=cfg)
    assert not marker.exists()


# ================================================================ non-finite (paths not covered elsewhere)


@pytest.mark.parametrize("poison", ["nan", "-inf at the label"])
def test_non_finite_logits_through_the_keyword_form_are_named(poison):
    logits = torch.randn(2, 3)
    kw = _keyword_loss_args()
    if poison == "nan":
        logits[1, 2] = math.nan
    else:
        logits[1, int(kw["labels"][1])] = -math.inf
    with pytest.raises(ValueError, match=r"logits row 1 must be a finite log-probability"):
        echo_loss(logits, **kw, config=LossConfig(policy="reinforce"))


# ================================================================ impossible values


def test_positive_logprob_in_a_tensor_is_refused():
    with pytest.raises(
        ValueError,
        match=r"inference_logprobs\[0\] must be a log-probability ≤ 0.*got 0\.5.*not the negative",
    ):
        LossInputs(rl_mask=torch.tensor([True]), inference_logprobs=torch.tensor([0.5]))


def test_positive_logprob_in_a_step_is_refused():
    with pytest.raises(
        ValueError,
        match=r"Step\.completion_logprobs\[0\] must be a log-probability \(<= 0\), got float 0\.5; pass log p",
    ):
        _step(completion_logprobs=[0.5, -0.2])


def test_positive_logprob_in_rollout_jsonl_is_refused():
    from echoloss.io import read_rollouts

    record = {
        "schema_version": 1,
        "group_id": "g",
        "id": "r0",
        "reward": 1.0,
        "steps": [
            {"prompt_ids": [1, 2], "completion_ids": [3, 4], "completion_logprobs": [-0.1, 2.3]}
        ],
    }
    with pytest.raises(ValueError, match=r"line 1.*steps\.0\.completion_logprobs\.1.*<= 0"):
        read_rollouts(io.StringIO(json.dumps(record) + "\n"))
    record["steps"][0]["completion_logprobs"] = [-0.1, -2.3]
    [ok] = read_rollouts(io.StringIO(json.dumps(record) + "\n"))  # the control reads fine
    assert ok.id == "r0"


def test_step_temperature_true_is_refused():
    with pytest.raises(
        TypeError, match=r"Step\.temperature must be a positive float, got bool True"
    ):
        _step(temperature=True)


def test_interleave_errored_string_is_refused():
    with pytest.raises(TypeError, match=r"errored must be a bool, got str 'no'"):
        interleave([_step()], errored="no")


def test_pad_token_id_float_is_refused():
    with pytest.raises(TypeError, match=r"pad_token_id must be an int >= 0, got float 1\.7"):
        pack([_sample()], max_tokens=8, pad_token_id=1.7)


def test_echo_weight_that_fp32_packing_would_zero_is_refused():
    with pytest.raises(ValidationError, match=r"alpha must be in \[1\.18e-38.*float32.*got 1e-50"):
        RoleEcho(alpha=1e-50)
    with pytest.raises(
        ValueError,
        match=r"Sample\.echo_weights\[1\] must be an echo weight .*got float 1e-50.*use a larger weight",
    ):
        _sample(
            echo_weights=[None, 1e-50, None, None], observation_mask=[False, True, False, False]
        )
    # the smallest weights that are accepted survive packing unchanged (not rounded to 0)
    s = _sample(
        echo_weights=[None, 1e-30, None, None], observation_mask=[False, True, False, False]
    )
    [b] = pack([s], max_tokens=8)
    assert b.echo_weights[1].item() == torch.tensor(1e-30, dtype=torch.float32).item() > 0


@pytest.mark.parametrize("bad", [-1, 2**63])
@pytest.mark.parametrize("where", ["Step", "Sample"])
def test_out_of_range_token_ids_are_refused(where, bad):
    build = _step if where == "Step" else _sample
    with pytest.raises(
        ValueError,
        match=rf"{where}\.prompt_ids\[0\] must be a token id in \[0, 2\*\*63\), got int {bad}",
    ):
        build(prompt_ids=[bad, 2, 3, 4, 5])


def test_token_id_past_the_vocabulary_is_refused_when_pack_knows_it():
    with pytest.raises(ValueError, match=r"vocab"):
        pack([_sample(completion_ids=[3, 40])], max_tokens=8, vocab_size=32)


# ================================================================ ignored input


def test_interleave_echo_filter_is_called_and_narrows():
    calls = []

    def drop_last_prompt_token(steps):
        calls.append(len(steps))
        return [
            [True] * (len(s.prompt_ids) + len(s.completion_ids) - 3) + [False] * 3 for s in steps
        ]

    # the tool body is in the initial prompt here: echo it (instead of building a second step)
    cfg = EchoConfig(tool=RoleEcho(alpha=0.5), skip_initial_prompt=False)
    [full] = interleave([_step()], echo=cfg)
    [narrow] = interleave([_step()], echo=cfg, echo_filter=drop_last_prompt_token)
    assert calls == [1]
    assert full.echo_weights == [None, None, None, 0.5, 0.5, None, None]
    assert narrow.echo_weights == [None, None, None, 0.5, None, None, None]
    with pytest.raises(
        ValueError, match=r"echo_filter is set but echo is None.*Pass echo=EchoConfig"
    ):
        interleave([_step()], echo_filter=drop_last_prompt_token)


def test_misspelt_role_warns_once_naming_it(caplog):
    att = dict(TOOL_ATT, message_roles=["user", "toool"])
    cfg = EchoConfig(tool=RoleEcho(alpha=0.5), skip_initial_prompt=False)
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        [s] = interleave([_step(attribution=att)], echo=cfg)
        interleave([_step(attribution=att)], echo=cfg)
    assert not any(s.echo_weights or [])  # not echoed ...
    hits = [r.getMessage() for r in caplog.records if "'toool'" in r.getMessage()]
    assert len(hits) == 1 and "tool" in hits[0]  # ... and said once


def test_loss_config_parameter_the_policy_ignores_is_refused():
    with pytest.raises(
        ValidationError, match=r"eps_high=0\.3 is ignored by policy='dppo'.*remove eps_high"
    ):
        LossConfig(policy="dppo", eps_high=0.3)


def test_sample_from_record_misspelt_mask_is_refused():
    from echoloss.adapters.openenv import sample_from_record

    record = {"input_ids": [1, 2, 3], "action_mask": [0, 1, 0], "obs_mask": [0, 0, 1]}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['warnings_mask'\].*warning_mask"):
        sample_from_record({**record, "warnings_mask": [0, 0, 1]}, world_model_coeff=0.1)


def test_completion_echo_tool_mask_of_two_is_refused():
    from echoloss.adapters.trl import completion_echo

    with pytest.raises(ValueError, match=r"tool_mask\[1\] must be 0/1 \(or a bool\), got int 2"):
        completion_echo([5, 6], [1, 2], [], None, echo=TOOL)


@pytest.mark.parametrize("names", [["a", "b"], ["a", "b", "c"]])
def test_env_names_longer_than_the_sequences_is_refused(names):
    with pytest.raises(ValueError, match=r"env_names has length \d, expected 1"):
        LossInputs(
            rl_mask=torch.tensor([True, True]),
            sequence_ids=torch.tensor([0, 0]),
            env_names=names,
        )
    ok = LossInputs(
        rl_mask=torch.tensor([True, True]), sequence_ids=torch.tensor([0, 0]), env_names=["a"]
    )
    assert ok.env_names == ("a",)


@pytest.mark.parametrize("bad", [math.nan, -0.5])
def test_count_normalizers_rejects_echo_weights_the_loss_rejects(bad):
    with pytest.raises(ValueError, match=r"echo_weights\[1\] must be a finite weight ≥ 0"):
        count_normalizers(
            rl_mask=torch.tensor([True, False]), echo_weights=torch.tensor([0.0, bad])
        )


# ================================================================ the verifiers adapter drops nothing

_TRACE = {
    "version": 1,
    "nodes": [
        {"message": {"role": "user"}, "token_ids": [1, 2], "mask": [False, False]},
        {
            "parent": 0,
            "sampled": True,
            "message": {"role": "assistant"},
            "token_ids": [3],
            "mask": [True],
            "logprobs": [-0.5],
        },
    ],
}


def test_verifiers_trace_without_ok_is_an_error_not_an_empty_list():
    from echoloss.adapters.verifiers import samples_from_trace

    with pytest.raises(ValueError, match=r"no 'ok' field.*pass errored=False"):
        samples_from_trace(_TRACE, echo=None, temperature=1.0)
    [s] = samples_from_trace(_TRACE, echo=None, temperature=1.0, errored=False)
    assert (s.prompt_ids, s.completion_ids) == ([1, 2], [3])


@pytest.mark.parametrize("no_error", [False, ""])
def test_verifiers_rollout_with_a_false_or_empty_error_is_kept(no_error):
    from echoloss.adapters.verifiers import samples_from_rollout

    rollout = {
        "error": no_error,
        "sampling_args": {"temperature": 1.0},
        "trajectory": [
            {
                "tokens": {
                    "prompt_ids": [1, 2],
                    "prompt_mask": [0, 0],
                    "completion_ids": [3, 4],
                    "completion_mask": [1, 1],
                    "completion_logprobs": [-0.1, -0.2],
                }
            }
        ],
    }
    [s] = samples_from_rollout(rollout, echo=None)
    assert s.completion_ids == [3, 4] and s.completion_logprobs == [-0.1, -0.2]


# ================================================================ masks and counts


def test_assistant_echo_capped_per_message_keeps_returned_tokens_out_of_the_observation_mask():
    """Assistant echo with max_tokens_per_message=1: the first completion token is echoed, the
    other three go back to RL and must not count in Z_i = |O_i|."""
    step = Step(
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5, 6],
        completion_logprobs=[-0.1] * 4,
        attribution={
            "message_indices": [0, 0],
            "is_content": [True, True],
            "message_roles": ["user"],
        },
    )
    [s] = interleave(
        [step], echo=EchoConfig(assistant=RoleEcho(alpha=1.0), max_tokens_per_message=1)
    )
    assert s.completion_mask == [False, True, True, True]
    assert s.echo_weights == [None, None, 1.0, None, None, None]
    assert s.observation_mask == [False, False, True, False, False, False]


def test_assistant_echo_narrowed_by_a_filter_keeps_returned_tokens_out_of_the_observation_mask():
    step = Step(
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5],
        completion_logprobs=[-0.1] * 3,
        attribution={
            "message_indices": [0, 0],
            "is_content": [True, True],
            "message_roles": ["user"],
        },
    )
    keep = [[True, True, True, False, False]]  # the filter keeps only the first completion token
    [s] = interleave([step], echo=EchoConfig(assistant=RoleEcho(alpha=1.0)), keep=keep)
    assert s.completion_mask == [False, True, True]
    assert s.echo_weights == [None, None, 1.0, None, None]
    assert s.observation_mask == [False, False, True, False, False]


def test_pack_truncate_inside_the_prompt_keeps_the_sampling_temperature():
    s = _sample(
        prompt_ids=[1, 2, 3, 4],
        completion_temperatures=[0.5, 0.5],
        echo_weights=[None, 0.5, 0.5, None, None, None],
        observation_mask=[False, True, True, False, False, False],
    )
    [b] = pack([s], max_tokens=3, truncate=True)
    assert b.input_ids.tolist() == [1, 2, 3]
    assert b.temperatures.tolist() == [0.5, 0.5, 0.5]


def test_scalar_fp64_temperature_next_to_an_echo_row_stays_fp64_in_the_keyword_form():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, generator=g, dtype=F64) * 3
    labels = torch.tensor([1, 2, 3])
    rl = torch.tensor([True, False, True])
    adv = torch.tensor([1.0, 0.0, -2.0], dtype=F64)
    ew = torch.tensor([0.0, 1.0, 0.0], dtype=F64)
    out = echo_loss(
        logits,
        labels=labels,
        rl_mask=rl,
        advantages=adv,
        echo_weights=ew,
        temperature=0.7,
        config=LossConfig(policy="reinforce"),
    )
    temps = torch.tensor([0.7, 1.0, 0.7], dtype=F64)  # echo rows at T = 1 (echo_temperature="one")
    lp = torch.log_softmax(logits / temps[:, None], -1).gather(1, labels[:, None]).squeeze(1)
    expected = -(adv * lp)[rl].sum() / 2 - lp[1]
    # fp64 throughout: 1e-14 is ~50 ulps; 0.7 rounded to fp32 would move lp by ~1e-8
    torch.testing.assert_close(out.loss, expected, rtol=1e-14, atol=0.0)


def test_sequence_means_count_sequences_per_term_in_the_keyword_form():
    """Sequence 0 has only RL rows, sequence 1 only echo rows: each term divides by its own
    sequence count (1 each). RL: (0.5 + 2·1.0) / 2 tokens = 1.25; echo: (0.2 + 0.4) / 2 = 0.3."""
    lp = torch.tensor([-0.5, -1.0, -0.2, -0.4], dtype=F64, requires_grad=True)
    out = echo_loss_from_logprobs(
        lp,
        rl_mask=torch.tensor([True, True, False, False]),
        echo_weights=torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=F64),
        advantages=torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=F64),
        sequence_ids=torch.tensor([0, 0, 1, 1]),
        observation_mask=torch.tensor([False, False, True, True]),
        config=LossConfig(
            policy="reinforce",
            rl_normalization="sequence_mean_token_mean",
            echo_normalization="sequence_mean",
        ),
    )
    assert out.loss.item() == pytest.approx(1.25 + 0.3, rel=1e-15)


# ================================================================ numerics


@pytest.mark.parametrize(("offset", "temperature"), [(1e6, 1.0), (-1e6, 1.0), (1e3, 1e-3)])
def test_echo_loss_logits_gradient_matches_fp64_at_huge_logits(offset, temperature):
    """The public loss (RL and echo rows, default backend) at |z / T| ≈ 1e6 in fp32: dlogits
    matches the fp64 gradient of the same fp32 values within 1e-6 of its largest entry (the
    required bound; the fp32 spacing at 1e6 is 0.06, so only a shift-free statistic meets it)."""
    g = torch.Generator().manual_seed(11)
    n, v = 6, 17
    z = (offset + temperature * 2 * torch.randn(n, v, generator=g, dtype=F64)).float()
    labels = torch.randint(0, v, (n,), generator=g)
    rl = torch.tensor([True, True, False, True, False, True])
    ew = torch.tensor([0.0, 0.0, 0.5, 0.0, 1.0, 0.0])
    adv = torch.randn(n, generator=g)
    zz = z.clone().requires_grad_()
    cfg = LossConfig(policy="reinforce", compute_entropy=False)
    out = echo_loss(
        zz,
        labels=labels,
        rl_mask=rl,
        advantages=adv,
        echo_weights=ew,
        temperature=temperature,
        config=cfg,
    )
    (grad,) = torch.autograd.grad(out.loss, zz)

    z64 = z.double().requires_grad_()
    temps = torch.where(ew > 0, 1.0, temperature).double()  # echo rows at T = 1
    lp = torch.log_softmax(z64 / temps[:, None], -1).gather(1, labels[:, None]).squeeze(1)
    gold_loss = -(adv.double() * lp)[rl].sum() / rl.sum() - (ew.double() * lp).sum() / 2
    (gold,) = torch.autograd.grad(gold_loss, z64)
    err = (grad.double() - gold).abs().max() / gold.abs().max()
    assert err <= 1e-6, float(err)


def test_fp16_logits_at_tiny_temperature_with_explicit_kl_tau_and_echo_rows_give_finite_dlogits():
    g = torch.Generator().manual_seed(5)
    n, v = 6, 33
    signs = torch.randint(0, 2, (n, v), generator=g) * 2 - 1
    logits = (signs * 1e4).to(torch.float16).requires_grad_()
    x = LossInputs(
        labels=torch.randint(0, v, (n,), generator=g),
        rl_mask=torch.tensor([True, True, False, True, True, False]),
        echo_weights=torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0]),
        advantages=torch.randn(n, generator=g),
        inference_logprobs=torch.full((n,), -1.0),
        temperature=1e-3,
    )
    out = echo_loss(logits, x, config=LossConfig(policy="dppo", kl_tau=1e-3))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0  # finite because bounded, not because zeroed


# ================================================================ trainer configuration (no run)


@pytest.mark.parametrize("key", ["optim.lr", "optim.eps", "data.temperature", "echo.alpha"])
@pytest.mark.parametrize("value", [math.inf, "Infinity"])
def test_trainer_infinity_is_refused_naming_the_key(key, value):
    from echoloss.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: .*finite"):
        load_config(None, {key: value})


def test_trainer_seed_too_large_is_refused_before_any_work(tmp_path, capsys):
    from echoloss.train.cli import main

    out = tmp_path / "run"
    assert main(["--seed", str(10**30), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "train.seed" in err and "4294967295" in err, err
    assert not out.exists()


def test_trainer_custom_policy_is_refused_naming_the_registry():
    from echoloss.train.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"loss.*policy = 'custom'.*register_policy"):
        parse_config({"loss": {"policy": "custom"}})


def test_trainer_turn_limit_too_small_warns_and_one_turn_is_refused():
    from echoloss.train.config import ConfigError, ConfigWarning, parse_config, turns_needed

    need = turns_needed("gridwalk", 4)
    with pytest.warns(ConfigWarning, match=rf"env\.max_turns = 2.*max_turns >= {need}"):
        parse_config({"env": {"name": "gridwalk", "size": 4, "max_turns": 2}})
    with pytest.raises(ConfigError, match=r"env.*max_turns: 1 turn cannot solve any task"):
        parse_config({"env": {"name": "gridwalk", "size": 4, "max_turns": 1}})


def test_scripted_demonstrations_never_act_on_a_finished_episode():
    """The cause of "act() on a finished episode" in the warm-up (configs/fast.toml with
    --seed 5 --set warmup.steps=3): a demonstration longer than the turn limit. Every task at
    every turn limit from 2 up gives a demonstration that fits the limit."""
    import random

    from echoloss.train.envs.gridwalk import GridWalk, Task, demonstration

    for size in (2, 3, 4):
        cells = [(x, y) for x in range(size) for y in range(size)]
        for limit in range(2, 2 * size + 2):
            env = GridWalk(size=size, max_turns=limit)
            for s in cells:
                for goal in cells:
                    if s != goal:
                        msgs = demonstration(env, Task(start=s, goal=goal), random.Random(5))
                        assert sum(m["role"] == "assistant" for m in msgs) <= limit


def test_trainer_misspelt_advantage_fn_is_refused_at_validation():
    from echoloss.train.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"advantages\.fn: unknown advantage fn 'grop'.*grpo"):
        parse_config({"advantages": {"fn": "grop"}})


# ================================================================ trainer resume (function level)


def _save(root: Path, step: int) -> Path:
    from echoloss.train.checkpoint import save_checkpoint

    def write(d: Path) -> None:
        (d / "state.json").write_text(json.dumps({"step": step}))
        torch.save({"w": torch.full((2,), float(step))}, d / "model.pt")

    return save_checkpoint(root, step, write, keep=3)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path):
    from echoloss.train.checkpoint import ResumeWarning, latest_checkpoint

    root = tmp_path / "checkpoints"
    older = _save(root, 1)
    newest = _save(root, 2)
    data = (newest / "model.pt").read_bytes()
    (newest / "model.pt").write_bytes(data[: len(data) // 2])  # truncated by a crash
    with pytest.warns(
        ResumeWarning, match=r"skipping checkpoint .*step.*2.*trying the previous one"
    ):
        assert latest_checkpoint(root) == older


def test_a_resume_with_changed_hyperparameters_lists_them():
    from echoloss.train.checkpoint import config_changes

    old = {"optim": {"lr": 1e-3}, "echo": {"alpha": 0.05}}
    new = {"optim": {"lr": 3e-4}, "echo": {"alpha": 0.1}}
    assert config_changes(old, new) == ["echo.alpha: 0.05 -> 0.1", "optim.lr: 0.001 -> 0.0003"]


def test_a_crash_inside_the_final_export_leaves_no_partial_model(tmp_path):
    from echoloss.train.checkpoint import export_atomically, final_model_complete

    final = tmp_path / "final-model"

    def crash(d: Path) -> None:
        (d / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed before the weights are written

    with pytest.raises(KeyboardInterrupt):
        export_atomically(final, crash)
    assert not final.exists() and not final_model_complete(final)

    def ok(d: Path) -> None:
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"x")

    export_atomically(final, ok)
    assert final_model_complete(final)


def test_resume_cuts_appended_outputs_back_to_the_checkpoint(tmp_path):
    from echoloss.train.checkpoint import output_sizes, truncate_outputs

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    sizes = output_sizes(tmp_path, ["metrics.jsonl"])  # taken with the checkpoint of step 1
    with metrics.open("a") as f:
        f.write('{"step": 2}\n')  # written after it, before the kill
    truncate_outputs(tmp_path, sizes, step=1, rank=0, names=["metrics.jsonl"])
    assert metrics.read_text() == '{"step": 1}\n'


# ================================================================ unclear messages


def test_echo_loss_string_temperature_names_temperature():
    with pytest.raises(
        TypeError,
        match=r"temperature must be a positive float .*got str 'abc'; pass temperature=0\.7",
    ):
        echo_loss(torch.randn(2, 3), **_keyword_loss_args(), temperature="abc")


def test_echo_weights_fractional_prompt_len_is_named():
    with pytest.raises(TypeError, match=r"prompt_len must be an int >= 0.*got float 2\.5"):
        echo_weights(TOOL_ATT, TOOL, prompt_len=2.5, completion_len=0)


def test_pack_string_pad_to_multiple_of_is_named():
    with pytest.raises(TypeError, match=r"pad_to_multiple_of must be an int >= 1, got str '4'"):
        pack([_sample()], max_tokens=8, pad_to_multiple_of="4")


def test_interleave_a_single_step_says_to_wrap_it():
    with pytest.raises(
        TypeError,
        match=r"steps must be a list of echoloss\.Step .*got a single Step; wrap it: interleave\(\[step\]\)",
    ):
        interleave(_step())


def test_loss_config_as_dict_is_named():
    with pytest.raises(
        TypeError, match=r"config must be an echoloss\.LossConfig or None, got dict"
    ):
        echo_loss(torch.randn(2, 3), **_keyword_loss_args(), config={"policy": "reinforce"})


def test_echo_config_as_dict_is_its_documented_dict_form():
    as_dict = interleave([_step()], echo={"tool": {"alpha": 0.5}, "skip_initial_prompt": False})
    as_cfg = interleave(
        [_step()], echo=EchoConfig(tool=RoleEcho(alpha=0.5), skip_initial_prompt=False)
    )
    assert as_dict == as_cfg
    with pytest.raises(ValidationError, match=r"tol"):
        interleave([_step()], echo={"tol": {"alpha": 0.5}})


def test_trainer_config_as_dict_is_validated(tmp_path):
    from echoloss.train.config import ConfigError
    from echoloss.train.recipe import train

    with pytest.raises(ConfigError, match=r"optim\.lr: .*finite"):
        train({"optim": {"lr": math.inf}, "train": {"output_dir": str(tmp_path / "x")}})
    assert not (tmp_path / "x").exists()


def test_completion_echo_takes_a_dict_echo_config_and_names_a_bad_one():
    from echoloss.adapters.trl import completion_echo

    args = ([5, 6], [1, 1], [{"role": "assistant", "content": "x"}], None)
    # The dict form is validated into an EchoConfig, exactly as interleave(echo=dict) does.
    out = completion_echo(*args, echo={"assistant": {"alpha": 0.5}})
    assert list(out.weights) == [0.5, 0.5]
    with pytest.raises(TypeError, match=r"echo must be an EchoConfig, got str"):
        completion_echo(*args, echo="tool")


def test_huge_sequence_ids_give_the_loss_of_small_ones():
    kw = {"rl_mask": torch.ones(3, dtype=torch.bool), "advantages": torch.ones(3, dtype=F64)}
    lp = torch.tensor([-0.5, -1.0, -2.0], dtype=F64)
    cfg = LossConfig(policy="reinforce", rl_normalization="sequence_mean_token_mean")
    big = torch.tensor([10**12, 10**12, 10**12 + 7])
    out = echo_loss_from_logprobs(lp, **kw, sequence_ids=big, config=cfg)
    assert out.loss.item() == pytest.approx((0.75 + 2.0) / 2, rel=1e-15)
    assert count_normalizers(rl_mask=kw["rl_mask"], sequence_ids=big).sequences == 2


def test_chat_attribute_without_a_tokenizer_names_tokenizer():
    from echoloss.adapters.chat import attribute

    with pytest.raises((TypeError, ValueError), match=r"tokenizer must be .*got None"):
        attribute([{"role": "user", "content": "hi"}], None)
