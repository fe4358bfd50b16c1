"""verifiers v1 traces (built with verifiers' own models) and rollout dicts → samples."""

from __future__ import annotations

import copy
import json
import logging

import pytest

import echoloss
from echoloss import EchoConfig, RoleEcho
from echoloss.adapters.verifiers import samples_from_rollout, samples_from_trace

TOOL = EchoConfig(tool=RoleEcho(alpha=0.25))


def _trace(*, ok: bool = True, trainable: bool = True):
    """A trace with three leaves: two trainable branches sharing nodes 0-3, and an abandoned
    compaction attempt. Node 3 (a tool result without `name`) is shared by both branches."""
    vf_trace = pytest.importorskip("verifiers.v1.trace")
    from verifiers.v1.configs.agent import WireAgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.semantic import ParentLink
    from verifiers.v1.task import WireTaskData
    from verifiers.v1.types import (
        AssistantMessage,
        SamplingConfig,
        SystemMessage,
        ToolCall,
        ToolMessage,
        UserMessage,
    )

    call = ToolCall(id="c1", name="bash", arguments='{"cmd": "ls"}')
    nodes = [
        MessageNode(
            message=SystemMessage(content="sh"),
            token_ids=[100, 11, 12, 101],
            mask=[False] * 4,
            is_content=[False, True, True, False],
        ),
        MessageNode(
            parent=0,
            message=UserMessage(content="list"),
            token_ids=[100, 13, 101],
            mask=[False] * 3,
            is_content=[False, True, False],
        ),
        MessageNode(  # generation prompt [100, 7], then 3 sampled tokens
            parent=1,
            message=AssistantMessage(content="", tool_calls=[call]),
            sampled=True,
            token_ids=[100, 7, 21, 22, 101],
            mask=[False, False, True, True, True],
            is_content=[False, False, True, True, True],
            logprobs=[-0.5, -0.25, -0.125],
        ),
        MessageNode(
            parent=2,
            message=ToolMessage(tool_call_id="c1", content="a.txt b.txt"),
            token_ids=[100, 8, 31, 32, 33, 101],
            mask=[False] * 6,
            is_content=[False, False, True, True, True, False],
        ),
        MessageNode(
            parent=3,
            message=AssistantMessage(content="two files"),
            sampled=True,
            token_ids=[100, 7, 41, 42],
            mask=[False, False, True, True],
            is_content=[False, False, True, True],
            logprobs=[-1.5, -0.75],
        ),
        MessageNode(
            parent=3,
            message=AssistantMessage(content="2 files"),
            sampled=True,
            token_ids=[100, 7, 51],
            mask=[False, False, True],
            is_content=[False, False, True],
            logprobs=[-2.0],
        ),
        MessageNode(
            parent=3,
            message=AssistantMessage(content="summary"),
            sampled=True,
            token_ids=[100, 7, 61],
            mask=[False, False, True],
            is_content=[False, False, True],
            logprobs=[-3.0],
            semantic_parents=[ParentLink(node=3, type="compaction_attempt")],
        ),
    ]
    calls = [
        vf_trace.ModelCall(node=2, sampling=SamplingConfig(temperature=0.7)),
        vf_trace.ModelCall(node=4, sampling=SamplingConfig(temperature=0.9)),
    ]
    return vf_trace.WireTrace(
        task=vf_trace.TraceTask(type="Shell", data=WireTaskData()),
        agent=vf_trace.AgentInfo(
            config=WireAgentConfig(sampling=SamplingConfig(temperature=0.6)), trainable=trainable
        ),
        nodes=nodes,
        calls=calls,
        ok=ok,
    )


def _round_trip(trace):
    """Through verifiers' JSON serialisation (full float precision) and back to its model."""
    from verifiers.v1.trace import WireTrace

    record = json.loads(json.dumps(trace.to_record(float_decimals=None)))
    return record, WireTrace.model_validate(record)


def _key(s: echoloss.Sample):
    return (
        s.prompt_ids,
        s.completion_ids,
        s.completion_mask,
        s.completion_logprobs,
        s.completion_temperatures,
        s.echo_weights,
        s.observation_mask,
    )


def test_trace_branches_become_samples_with_shared_nodes_echoed_once():
    record, trace = _round_trip(_trace())
    samples = samples_from_trace(trace, echo=TOOL, env_name="shell")
    # Leaves 4 and 5 are trainable; leaf 6 is an abandoned compaction attempt.
    assert len(samples) == 2
    a, b = samples
    assert a.env_name == b.env_name == "shell"
    # Prompt: everything before the first sampled token (system, user, generation prompt).
    assert a.prompt_ids == [100, 11, 12, 101, 100, 13, 101, 100, 7]
    assert a.completion_ids == [21, 22, 101, 100, 8, 31, 32, 33, 101, 100, 7, 41, 42]
    assert a.completion_mask == [True] * 3 + [False] * 8 + [True] * 2
    assert a.completion_logprobs == [-0.5, -0.25, -0.125] + [0.0] * 8 + [-1.5, -0.75]
    # Each call's own temperature; observation tokens take the next call's.
    assert a.completion_temperatures == [0.7] * 3 + [0.9] * 10
    # The tool body (31, 32, 33) is echoed, its scaffold is not.
    assert a.echo_weights == [None] * 14 + [0.25] * 3 + [None] * 5
    assert a.observation_mask == [False] * 14 + [True] * 3 + [False] * 5
    # Branch b shares nodes 0-3: the tool result is not echoed (nor counted in Z) again.
    assert b.completion_ids == [21, 22, 101, 100, 8, 31, 32, 33, 101, 100, 7, 51]
    assert b.completion_mask == [True] * 3 + [False] * 8 + [True]
    assert b.echo_weights is None
    assert b.observation_mask == [False] * len(b)
    # No call recorded for node 5: the agent config's temperature.
    assert b.completion_temperatures == [0.7] * 3 + [0.6] * 9
    # The record (dict) and the verifiers object give the same samples.
    assert [_key(s) for s in samples_from_trace(record, echo=TOOL, env_name="shell")] == [
        _key(s) for s in samples
    ]


def test_trace_samples_agree_with_verifiers_own_branch_view():
    _, trace = _round_trip(_trace())
    branches = [br for br in trace.branches if br.trainable]
    samples = samples_from_trace(trace, echo=None)
    assert len(branches) == len(samples) == 2
    for br, s in zip(branches, samples, strict=True):
        assert s.token_ids == br.token_ids
        p = len(s.prompt_ids)
        assert [False] * p + s.completion_mask == br.sampled_mask
        assert s.completion_logprobs == br.logprobs[p:]
        assert s.echo_weights is None


def test_tool_name_resolved_through_tool_call_id_drives_the_allow_list():
    _, trace = _round_trip(_trace())
    allowed = EchoConfig(tool=RoleEcho(alpha=0.5, tool_names={"bash"}))
    other = EchoConfig(tool=RoleEcho(alpha=0.5, tool_names={"python"}))
    [a, _] = samples_from_trace(trace, echo=allowed)
    assert [w for w in a.echo_weights if w] == [0.5] * 3
    [a, _] = samples_from_trace(trace, echo=other)
    assert a.echo_weights is None


def test_initial_prompt_is_never_echoed_and_assistant_echo_replaces_rl():
    _, trace = _round_trip(_trace())
    cfg = EchoConfig(system=RoleEcho(alpha=0.1), user=RoleEcho(alpha=0.1))
    assert [s.echo_weights for s in samples_from_trace(trace, echo=cfg)] == [None, None]
    cfg = EchoConfig(assistant=RoleEcho(alpha=0.3))
    a, b = samples_from_trace(trace, echo=cfg)
    assert a.num_rl_tokens == 0 and a.num_echo_tokens == 5
    # The shared first call was echoed in branch a; branch b echoes only its own call.
    assert b.num_rl_tokens == 0 and b.num_echo_tokens == 1


def test_errored_or_untrainable_trace_trains_nothing():
    _, trace = _round_trip(_trace(ok=False))
    assert samples_from_trace(trace, echo=TOOL) == []
    assert len(samples_from_trace(trace, echo=TOOL, errored=False)) == 2
    _, trace = _round_trip(_trace(trainable=False))
    assert samples_from_trace(trace, echo=TOOL) == []


def test_nodes_without_is_content_fall_back_to_echo_rules(caplog):
    record, _ = _round_trip(_trace())
    for node in record["nodes"]:
        node["is_content"] = []
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        a, _ = samples_from_trace(record, echo=TOOL)
    assert a.echo_weights is None  # content-only echo needs is_content
    assert "is_content" in caplog.text
    whole = EchoConfig(tool=RoleEcho(alpha=0.25), target="message")
    a, _ = samples_from_trace(record, echo=whole)
    assert a.echo_weights == [None] * 12 + [0.25] * 6 + [None] * 4


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda r: r["nodes"][3].update(mask=[False] * 5),
            r"nodes\[3\]\.mask has length 5, expected 6",
        ),
        (
            lambda r: r["nodes"][2].update(logprobs=[-0.5]),
            r"nodes\[2\]\.logprobs has 1 values, expected 3",
        ),
        (
            lambda r: r["nodes"][3].update(is_content=[True]),
            r"nodes\[3\]\.is_content has length 1, expected 6",
        ),
        (
            lambda r: r["nodes"][3]["message"].update(tool_call_id="c9"),
            r"nodes\[3\] \(role 'tool'\) has tool_call_id 'c9'.*\['c1'\]",
        ),
        (lambda r: r["nodes"][1].update(parent=5), r"nodes\[1\]\.parent = 5"),
        (lambda r: r.update(version=2), r"trace\.version = 2"),
    ],
)
def test_inconsistent_traces_are_errors(edit, match):
    record, _ = _round_trip(_trace())
    record = copy.deepcopy(record)
    edit(record)
    with pytest.raises(ValueError, match=match):
        samples_from_trace(record, echo=TOOL)


def test_wrongly_typed_trace_field_names_its_path():
    record, _ = _round_trip(_trace())
    record["nodes"][2]["mask"][2] = 1
    with pytest.raises(ValueError, match=r"nodes\.2\.mask\.2"):
        samples_from_trace(record, echo=TOOL)


# -- rollout dicts with tokens.prompt_attribution (the earlier format) -------------------------


def _rollout(**overrides):
    rollout = {
        "env_name": "shell",
        "error": None,
        "sampling_args": {"temperature": 0.8},
        "trajectory": [
            {
                "prompt": [{"role": "user", "content": "ls"}],
                "tokens": {
                    "prompt_ids": [1, 2],
                    "prompt_mask": [0, 0],
                    "completion_ids": [3, 4],
                    "completion_mask": [1, 1],
                    "completion_logprobs": [-0.1, -0.2],
                    "overlong_prompt": False,
                    "is_truncated": False,
                    "prompt_attribution": {
                        "token_ids": [1, 2],
                        "message_indices": [0, 0],
                        "is_content": [False, True],
                        "message_roles": ["user"],
                        "message_tool_names": [None],
                        "sampled_mask": [False, False],
                    },
                },
            },
            {  # bridged: the history is scaffold (-1), indices count the new messages only
                "tokens": {
                    "prompt_ids": [1, 2, 3, 4, 5, 6],
                    "prompt_mask": [0] * 6,
                    "completion_ids": [7],
                    "completion_mask": [1],
                    "completion_logprobs": [-0.3],
                    "prompt_attribution": {
                        "message_indices": [-1, -1, -1, -1, 0, 0],
                        "is_content": [False, False, False, False, False, True],
                        "message_roles": ["tool"],
                        "message_tool_names": ["lookup"],
                    },
                },
            },
        ],
    }
    rollout.update(overrides)
    return rollout


def test_rollout_dict_worked_example():
    [s] = samples_from_rollout(_rollout(), echo=EchoConfig(tool=RoleEcho(alpha=0.5)))
    assert s.completion_ids == [3, 4, 5, 6, 7]
    assert s.completion_mask == [True, True, False, False, True]
    assert s.echo_weights == [None, None, None, None, None, 0.5, None]
    assert s.completion_temperatures == [0.8] * 5
    assert s.env_name == "shell"
    assert samples_from_rollout(_rollout(error={"type": "Timeout"}), echo=TOOL) == []


def test_rollout_dict_bad_steps_are_errors_naming_the_step():
    r = _rollout()
    r["trajectory"][1]["tokens"] = None
    with pytest.raises(ValueError, match=r"trajectory\[1\]\.tokens is None"):
        samples_from_rollout(r, echo=TOOL)
    r = _rollout()
    r["trajectory"][0]["tokens"]["completion_mask"] = [1, 2]
    with pytest.raises(ValueError, match=r"trajectory\[0\]\.tokens\.completion_mask\[1\] = 2"):
        samples_from_rollout(r, echo=TOOL)
    r = _rollout()
    r["trajectory"][1]["tokens"]["completion_logprobs"] = [-0.3, -0.4]
    with pytest.raises(
        ValueError, match=r"trajectory\[1\]\.tokens: .*completion_logprobs has length 2"
    ):
        samples_from_rollout(r, echo=TOOL)
    with pytest.raises(ValueError, match="trajectory"):
        samples_from_rollout({"error": None}, echo=TOOL)


@pytest.mark.parametrize("no_error", [None, False, "", {}])
def test_rollout_dict_without_an_error_is_kept(no_error):
    # "error": False / "" / {} say "no error"; reading them as errors dropped every rollout.
    [s] = samples_from_rollout(_rollout(error=no_error), echo=TOOL)
    assert s.completion_ids == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("error", [True, "timeout", {"type": "Timeout"}])
def test_rollout_dict_with_an_error_trains_nothing(error):
    assert samples_from_rollout(_rollout(error=error), echo=TOOL) == []


def test_rollout_dict_ambiguous_error_value_is_an_error():
    with pytest.raises(TypeError, match=r"rollout\['error'\] must be None/False/''"):
        samples_from_rollout(_rollout(error=0), echo=TOOL)


def test_trace_record_without_ok_is_an_error_not_an_empty_result():
    record = {
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
    with pytest.raises(ValueError, match=r"no 'ok' field.*pass errored=False"):
        samples_from_trace(record, echo=None)
    [s] = samples_from_trace(record, echo=None, errored=False)
    assert s.token_ids == [1, 2, 3]
    assert samples_from_trace({**record, "ok": False}, echo=None) == []
    with pytest.raises(TypeError, match="errored must be a bool or None"):
        samples_from_trace(record, echo=None, errored="no")


def test_trace_with_a_positive_log_probability_is_an_error():
    record = {
        "version": 1,
        "ok": True,
        "nodes": [
            {"message": {"role": "user"}, "token_ids": [1], "mask": [False]},
            {
                "parent": 0,
                "sampled": True,
                "message": {"role": "assistant"},
                "token_ids": [3],
                "mask": [True],
                "logprobs": [1.5],
            },
        ],
    }
    with pytest.raises(ValueError, match=r"must be a log-probability \(<= 0\), got float 1.5"):
        samples_from_trace(record, echo=None)


def test_generation_prompt_of_a_sampled_node_is_scaffold_of_no_message():
    # The unsampled head of a sampled assistant node (the generation prompt) belongs to no message:
    # even whole-message assistant echo must not train it.
    record = {"version": 1, "ok": True, "nodes": [
        {"message": {"role": "user"}, "token_ids": [1, 2], "mask": [False, False],
         "is_content": [False, True]},
        {"parent": 0, "sampled": True, "token_ids": [3, 4, 5], "mask": [False, True, True],
         "is_content": [False, True, True], "logprobs": [-0.5, -0.1],
         "message": {"role": "assistant"}},
        {"parent": 1, "token_ids": [6, 7, 8], "mask": [False, False, False],
         "is_content": [False, True, True], "message": {"role": "tool", "name": "ls"}},
        {"parent": 2, "sampled": True, "token_ids": [9, 10], "mask": [False, True],
         "is_content": [False, True], "logprobs": [-0.2], "message": {"role": "assistant"}},
    ]}  # fmt: skip
    cfg = EchoConfig(assistant=RoleEcho(alpha=0.1), target="message")
    [s] = samples_from_trace(record, echo=cfg)
    assert s.token_ids == list(range(1, 11))
    assert s.echo_weights == [None, None, None, 0.1, 0.1, None, None, None, None, 0.1]
