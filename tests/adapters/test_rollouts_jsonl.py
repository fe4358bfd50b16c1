"""Rollout JSONL (schema, reader errors, writer round trip) and the token JSONL export."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from pydantic import ValidationError

import echoloss
from echoloss.io import (
    RecordError,
    RolloutFileError,
    RolloutRecord,
    TokenExporter,
    dump_rollout,
    iter_rollouts,
    read_rollouts,
    token_records,
    write_rollouts,
)

STEPS_ROLLOUT = {
    "schema_version": 1,
    "group_id": "q17",
    "id": "r0",
    "env_name": "terminal",
    "reward": 1.0,
    "temperature": 0.8,
    "steps": [
        {
            "prompt_ids": [1, 2],
            "completion_ids": [3, 4],
            "completion_logprobs": [-0.1, -0.2],
            "attribution": {
                "message_indices": [0, 0],
                "is_content": [False, True],
                "message_roles": ["user"],
            },
        },
        {
            "prompt_ids": [1, 2, 3, 4, 5, 6],
            "completion_ids": [7],
            "completion_logprobs": [-0.3],
            "completion_mask": [True],
            "temperature": 0.6,
            "attribution": {
                "message_indices": [-1, -1, -1, -1, 0, 0],
                "is_content": [False, False, False, False, False, True],
                "message_roles": ["tool"],
                "message_tool_names": ["bash"],
            },
        },
    ],
    "metrics": {"turns": 2.0},
    "metadata": {"seed": 3},
}

MESSAGES_ROLLOUT = {
    "schema_version": 1,
    "group_id": "q18",
    "reward": 0.0,
    "messages": [
        {"role": "user", "content": "ls"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "assistant", "content": "one file"},
    ],
}


def test_round_trip_through_the_writer_and_reader(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    assert (
        write_rollouts(path, [STEPS_ROLLOUT, RolloutRecord.model_validate(MESSAGES_ROLLOUT)]) == 2
    )
    assert write_rollouts(path, [STEPS_ROLLOUT], append=True) == 1
    records = read_rollouts(path)
    assert [r.group_id for r in records] == ["q17", "q18", "q17"]
    assert records[0].model_dump(mode="json") == RolloutRecord.model_validate(
        STEPS_ROLLOUT
    ).model_dump(mode="json")
    assert records[1].messages[1].tool_calls[0]["function"]["name"] == "bash"
    assert [r.id for r in iter_rollouts(path)] == ["r0", None, "r0"]
    # The same text parses from an open file or a list of lines.
    assert len(read_rollouts(io.StringIO(path.read_text()))) == 3
    assert json.loads(dump_rollout(STEPS_ROLLOUT))["steps"][1]["temperature"] == 0.6


def test_token_steps_become_samples_with_echo_and_per_step_temperature():
    record = RolloutRecord.model_validate(STEPS_ROLLOUT)
    [s] = record.to_samples(echo=echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=0.5)))
    assert s.completion_ids == [3, 4, 5, 6, 7]
    assert s.completion_mask == [True, True, False, False, True]
    assert s.completion_temperatures == [0.8, 0.8, 0.6, 0.6, 0.6]
    assert s.echo_weights == [None] * 5 + [0.5, None]
    assert s.env_name == "terminal"
    errored = RolloutRecord.model_validate({**STEPS_ROLLOUT, "error": "sandbox died"})
    assert errored.to_samples(echo=None) == []


def test_message_rollouts_are_tokenized_with_a_chat_template():
    templates = pytest.importorskip("_templates")
    record = RolloutRecord.model_validate(MESSAGES_ROLLOUT)
    with pytest.raises(ValueError, match="pass a tokenizer"):
        record.to_steps()
    tok = templates.chatml()
    [s] = record.to_samples(
        echo=echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=0.5)), tokenizer=tok
    )
    assert [t for t, w in zip(s.token_ids, s.echo_weights, strict=True) if w] == list(b"a.txt")
    # Logprobs ride on the assistant messages, one per completion token.
    steps = record.to_steps(tok)
    msgs = json.loads(json.dumps(MESSAGES_ROLLOUT))
    msgs["messages"][1]["completion_logprobs"] = [-0.5] * len(steps[0].completion_ids)
    msgs["messages"][3]["completion_logprobs"] = [-0.25] * len(steps[1].completion_ids)
    steps = RolloutRecord.model_validate(msgs).to_steps(tok)
    assert steps[1].completion_logprobs == [-0.25] * len(steps[1].completion_ids)
    del msgs["messages"][3]["completion_logprobs"]
    with pytest.raises(ValueError, match="on every assistant message or on none"):
        RolloutRecord.model_validate(msgs).to_steps(tok)


def test_reader_reports_line_and_field_of_every_bad_record(tmp_path):
    good = json.dumps(STEPS_ROLLOUT)
    bad_logprobs = json.loads(good)
    bad_logprobs["steps"][1]["completion_logprobs"] = [-0.3, -0.4]
    bad_attribution = json.loads(good)
    bad_attribution["steps"][0]["attribution"]["is_content"] = [True]
    bad_mask = json.loads(good)
    bad_mask["steps"][0]["completion_mask"] = [1, 0]
    lines = [
        good,  # 1
        "{not json",  # 2
        "[1, 2]",  # 3
        json.dumps({**STEPS_ROLLOUT, "schema_version": 2}),  # 4
        json.dumps({k: v for k, v in STEPS_ROLLOUT.items() if k != "group_id"}),  # 5
        json.dumps(bad_logprobs),  # 6
        "",  # 7: blank lines are not records
        json.dumps(bad_attribution),  # 8
        good.replace('"reward": 1.0', '"reward": NaN'),  # 9
        json.dumps(bad_mask),  # 10
        json.dumps({**STEPS_ROLLOUT, "steps": [], "messages": None}),  # 11
        json.dumps({**STEPS_ROLLOUT, "rewards": 1.0}),  # 12: unknown field (typo)
        good,  # 13
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RolloutFileError) as e:
        read_rollouts(path)
    got = [(err.line, err.field) for err in e.value.errors]
    assert got == [
        (2, ""),
        (3, ""),
        (4, "schema_version"),
        (5, "group_id"),
        (6, "steps.1"),
        (8, "steps.0.attribution"),
        (9, ""),
        (10, "steps.0.completion_mask.0"),
        (10, "steps.0.completion_mask.1"),
        (11, ""),
        (12, "rewards"),
    ]
    by_line = {err.line: err for err in e.value.errors}
    assert "completion_logprobs has length 2, expected 1" in by_line[6].message
    assert "is_content has length 1" in by_line[8].message
    assert "NaN" in by_line[9].message
    assert "2 is not supported" in by_line[4].message
    assert "needs 'steps'" in by_line[11].message
    assert str(e.value).startswith(f"{path}: 11 bad rollout record(s):\n  line 2: invalid JSON")
    assert str(RecordError(6, "steps.1", "x")) == "line 6, steps.1: x"
    # The streaming reader stops at the first bad line.
    it = iter_rollouts(path)
    assert next(it).group_id == "q17"
    with pytest.raises(RolloutFileError, match="line 2"):
        next(it)


def test_writer_validates_records():
    with pytest.raises(ValidationError, match="reward"):
        dump_rollout({**STEPS_ROLLOUT, "reward": float("inf")})
    with pytest.raises(ValidationError, match="env_name 'all' is reserved"):
        dump_rollout({**STEPS_ROLLOUT, "env_name": "all"})
    out = io.StringIO()
    with pytest.raises(ValidationError):
        write_rollouts(out, [STEPS_ROLLOUT, {"schema_version": 1}])
    assert out.getvalue().count("\n") == 1  # the good record before it was written


# -- token export -----------------------------------------------------------------------------


def _batch():
    rl_sample = echoloss.Sample(
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5],
        completion_mask=[True, False, True],
        completion_logprobs=[-0.5, 0.0, -0.25],
        echo_weights=[None, None, None, 0.1, None],
        observation_mask=[False, False, False, True, False],
        advantage=2.0,
        env_name="term",
    )
    idle = echoloss.Sample(  # trains nothing: not exported
        prompt_ids=[9, 9], completion_ids=[9], completion_mask=[False], completion_logprobs=[0.0]
    )
    [batch] = echoloss.pack([rl_sample, idle], max_tokens=16, pad_to_multiple_of=16)
    return batch


def test_token_records_columns_nulls_and_alignment():
    batch = _batch()
    n = len(batch)
    stats = torch.full((n,), 0.5)
    stats[2] = float("nan")
    ratio = torch.arange(n, dtype=torch.float32)
    rows = torch.arange(n, dtype=torch.float32) * 10  # row j predicts token j + 1
    [rec] = token_records(
        batch,
        step=7,
        rank=1,
        micro_step=2,
        token_stats={"trainer_logprobs": stats, "importance_ratio": ratio},
        row_stats={"entropy": rows},
        first_index=5,
    )
    assert rec["step"] == 7 and rec["rank"] == 1 and rec["micro_step"] == 2
    assert rec["export_sequence_idx"] == 5 and rec["sample_index"] == 0
    assert rec["env_name"] == "term" and rec["prompt_len"] == 2 and rec["advantage"] == 2.0
    assert rec["token_ids"] == [1, 2, 3, 4, 5]
    assert rec["position_ids"] == [0, 1, 2, 3, 4]
    assert rec["rl_mask"] == [False, False, True, False, True]
    assert rec["echo_mask"] == [False, False, False, True, False]
    assert rec["loss_mask"] == [False, False, True, True, True]
    assert rec["echo_weights"] == [None, None, None, 0.1, None]
    assert rec["observation_mask"] == [False, False, False, True, False]
    assert rec["inference_logprobs"] == [0.0, 0.0, -0.5, 0.0, -0.25]
    assert rec["advantages"] == [0.0, 0.0, 2.0, 0.0, 2.0]
    assert rec["trainer_logprobs"] == [0.5, 0.5, None, 0.5, 0.5]  # NaN → null
    seg = batch.sample_indices.index(0)
    start = batch.cu_seqlens.tolist()[seg]
    assert rec["importance_ratio"] == [None, None, float(start + 2), None, float(start + 4)]
    assert rec["entropy"] == [None, *[float(10 * (start + j)) for j in range(4)]]
    json.dumps(rec, allow_nan=False)  # valid JSON


def test_token_export_files_per_step_and_rank(tmp_path):
    batch = _batch()
    with TokenExporter(tmp_path, rank=3) as ex:
        assert ex.write(batch, step=0) == 1
        assert ex.write(batch, step=0, micro_step=1) == 1
        assert ex.write(batch, step=1) == 1
    lines = (tmp_path / "step_0" / "rank_3.jsonl").read_text().splitlines()
    recs = [json.loads(x, parse_constant=lambda c: pytest.fail(c)) for x in lines]
    assert [(r["micro_step"], r["export_sequence_idx"]) for r in recs] == [(0, 0), (1, 1)]
    assert (tmp_path / "step_1" / "rank_3.jsonl").read_text().count("\n") == 1
    with pytest.raises(ValueError, match="collides with a built-in column"):
        token_records(batch, step=0, token_stats={"rl_mask": [0.0] * len(batch)})
    with pytest.raises(ValueError, match="has length 3, expected 16"):
        token_records(batch, step=0, token_stats={"x": [0.0] * 3})


@pytest.mark.parametrize(
    ("edit", "field", "match"),
    [
        (lambda r: r["steps"][0].update(completion_logprobs=[-0.1, 0.2]),
         "steps.0.completion_logprobs.1", "a log-probability is <= 0"),
        (lambda r: r["steps"][0].update(prompt_ids=[-1, 2]),
         "steps.0.prompt_ids.0", "greater than or equal to 0"),
        (lambda r: r["steps"][0].update(completion_ids=[3, 2**63]),
         "steps.0.completion_ids.1", "less than or equal to"),
        (lambda r: r.update(error=""), "error", "at least 1 character"),
        (lambda r: r.update(temperature=1e-50), "temperature", "normal float32"),
    ],
)  # fmt: skip
def test_impossible_values_are_reported_with_their_field(edit, field, match):
    record = json.loads(json.dumps(STEPS_ROLLOUT))
    edit(record)
    with pytest.raises(RolloutFileError) as info:
        read_rollouts([json.dumps(record)])
    [err] = info.value.errors
    assert err.field == field
    assert re.search(match, err.message), err.message
