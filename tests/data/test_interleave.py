"""Trajectory → samples: golden value G of docs/spec.md §13 and the merge failure modes of §12."""

import logging

import pytest

from echoloss import EchoConfig, EchoFilter, RoleEcho, Step, interleave

TOOL = EchoConfig(tool=RoleEcho(alpha=0.5))


def step(prompt, completion, *, att=None, mask=None, temperature=1.0, lp=None):
    return Step(
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        completion_logprobs=lp if lp is not None else [-0.25] * len(completion),
        completion_mask=mask,
        attribution=att,
        temperature=temperature,
    )


S, U, A1, A2, W, T, B1 = 101, 102, 201, 202, 301, 302, 203


def worked_example_steps():
    s0 = step(
        [S, U],
        [A1, A2],
        att={
            "message_indices": [0, 1],
            "is_content": [True, True],
            "message_roles": ["system", "user"],
        },
    )
    s1 = step(
        [S, U, A1, A2, W, T],
        [B1],
        att={
            "message_indices": [-1, -1, -1, -1, 0, 0],
            "is_content": [False, False, False, False, False, True],
            "message_roles": ["tool"],
            "message_tool_names": ["lookup"],
        },
        lp=[-0.75],
    )
    return [s0, s1]


def test_worked_example_bridged_tool_turn():
    [sample] = interleave(worked_example_steps(), echo=TOOL)
    assert sample.prompt_ids == [S, U]
    assert sample.completion_ids == [A1, A2, W, T, B1]
    assert sample.completion_mask == [True, True, False, False, True]
    assert sample.completion_logprobs == [-0.25, -0.25, 0.0, 0.0, -0.75]
    assert sample.echo_weights == [None, None, None, None, None, 0.5, None]
    assert sample.observation_mask == [False] * 5 + [True, False]
    assert sample.completion_temperatures == [1.0] * 5


def test_no_echo_config_means_no_echo_streams():
    [sample] = interleave(worked_example_steps())
    assert sample.echo_weights is None and sample.observation_mask is None
    assert sample.completion_mask == [True, True, False, False, True]


def test_three_turn_merge_stays_one_sample():
    # docs/spec.md F16: the prefix must be the full prompt+completion of the last merged step.
    s0 = step([1, 2], [3])
    s1 = step([1, 2, 3, 4], [5])
    s2 = step([1, 2, 3, 4, 5, 6, 7], [8, 9], temperature=0.5)
    [sample] = interleave([s0, s1, s2])
    assert sample.prompt_ids == [1, 2]
    assert sample.completion_ids == [3, 4, 5, 6, 7, 8, 9]
    assert sample.completion_mask == [True, False, True, False, False, True, True]
    # docs/spec.md F13: temperatures extend in lockstep; env tokens take the temperature of their step.
    assert sample.completion_temperatures == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]


def test_rollback_longest_prefix_wins():
    # docs/spec.md F15: after a rollback, one active prefix is a strict prefix of another.
    steps = [
        step([1, 2], [3]),  # sample 0: prefix [1,2,3]
        step([1, 2, 3, 4], [5]),  # extends sample 0: prefix [1,2,3,4,5]
        step([1, 2], [3, 4, 5, 6]),  # rollback: prompt [1,2] matches nothing -> sample 1
        step([1, 2, 3, 4, 5, 6, 7], [8]),  # matches both prefixes; the longer (sample 1) wins
    ]
    a, b = interleave(steps)
    assert a.token_ids == [1, 2, 3, 4, 5] and a.completion_mask == [True, False, True]
    assert b.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    # First-match would have merged step 3 into sample 0 with token 6 (generated) as env input.
    assert b.completion_mask == [True, True, True, True, False, True]


def test_interleaved_agents_become_separate_samples():
    steps = [step([1], [2]), step([1, 2, 3], [4]), step([9], [8]), step([1, 2, 3, 4, 5], [6])]
    a, b = interleave(steps)
    assert a.token_ids == [1, 2, 3, 4, 5, 6]
    assert b.token_ids == [9, 8]


def test_empty_completion_step_is_fine():
    # docs/spec.md F13: a tool-only step with no completion used to crash on temperatures.
    s0 = step([1, 2], [3])
    s1 = step([1, 2, 3, 4], [])
    [sample] = interleave([s0, s1])
    assert sample.completion_ids == [3, 4]
    assert sample.completion_temperatures == [1.0, 1.0]
    assert len(sample.completion_mask) == len(sample.completion_logprobs) == 2


def test_errored_rollout_trains_nothing_even_with_assistant_echo():
    # docs/spec.md F22: assistant echo must not re-enable training on an errored rollout.
    cfg = EchoConfig(assistant=RoleEcho(alpha=1.0), tool=RoleEcho(alpha=1.0))
    assert interleave(worked_example_steps(), echo=cfg, errored=True) == []


def test_assistant_echo_takes_completion_out_of_rl():
    cfg = EchoConfig(assistant=RoleEcho(alpha=0.3))
    [sample] = interleave([step([1, 2], [3, 4])], echo=cfg)
    assert sample.completion_mask == [False, False]
    assert sample.echo_weights == [None, None, 0.3, 0.3]
    assert sample.num_rl_tokens == 0 and sample.num_echo_tokens == 2


def test_position_zero_never_echoed():
    # docs/spec.md F5: the system prompt's first token is body here, yet position 0 has no prediction.
    att = {"message_indices": [0, 0], "is_content": [True, True], "message_roles": ["system"]}
    cfg = EchoConfig(system=RoleEcho(alpha=1.0), skip_initial_prompt=False)
    [sample] = interleave([step([1, 2], [3], att=att)], echo=cfg)
    assert sample.echo_weights == [None, 1.0, None]
    assert sample.observation_mask == [False, True, False]


def test_position_zero_never_rl_without_a_prompt():
    [sample] = interleave([step([], [3, 4])])
    assert sample.completion_mask == [False, True]


FULL_RENDER_TURN_2 = {
    # not bridged: [system, user task | assistant a1, tool output]
    "message_indices": [0, 1, 2, 3],
    "is_content": [True, True, True, True],
    "message_roles": ["system", "user", "assistant", "tool"],
}


def test_initial_prompt_skipped_on_full_re_renders():
    every = EchoConfig(
        system=RoleEcho(alpha=1.0), user=RoleEcho(alpha=1.0), tool=RoleEcho(alpha=0.5)
    )
    s0 = step(
        [1, 2],
        [3],
        att={
            "message_indices": [0, 1],
            "is_content": [True, True],
            "message_roles": ["system", "user"],
        },
    )
    s1 = step([1, 2, 3, 4], [5], att=FULL_RENDER_TURN_2)
    [sample] = interleave([s0, s1], echo=every)
    assert sample.echo_weights == [None, None, None, 0.5, None]
    both = every.model_copy(update={"skip_initial_prompt": False})
    [sample] = interleave([s0, s1], echo=both)
    assert sample.echo_weights == [None, 1.0, None, 0.5, None]


def test_initial_prompt_skipped_with_bridged_attribution():
    cfg = EchoConfig(user=RoleEcho(alpha=1.0), tool=RoleEcho(alpha=0.5))
    [sample] = interleave(worked_example_steps(), echo=cfg, allow_import_paths=True)
    assert sample.echo_weights == [None, None, None, None, None, 0.5, None]


def test_restarted_sample_does_not_re_echo_shared_tokens():
    # docs/spec.md F23: a step that cannot extend (context compaction) restarts a sample whose prompt shares
    # the first turn's tokens. They were covered by sample 0; the default does not train them twice.
    att0 = {
        "message_indices": [0, 1],
        "is_content": [True, True],
        "message_roles": ["system", "user"],
    }
    att1 = {
        "message_indices": [-1, -1, -1, 0],
        "is_content": [False, False, False, True],
        "message_roles": ["tool"],
    }
    att2 = {  # full render after compaction: [system, user, tool(obs 1), user(summary), tool(obs 2)]
        "message_indices": [0, 1, 2, 3, 4],
        "is_content": [True] * 5,
        "message_roles": ["system", "user", "tool", "user", "tool"],
    }
    steps = [
        step([1, 2], [3], att=att0),
        step([1, 2, 3, 4], [5], att=att1),
        step([1, 2, 4, 7, 8], [9], att=att2),
    ]
    cfg = EchoConfig(tool=RoleEcho(alpha=0.5), user=RoleEcho(alpha=0.1))
    a, b = interleave(steps, echo=cfg)
    assert a.echo_weights == [None, None, None, 0.5, None]
    # b shares only [1, 2] with earlier steps (initial prompt, already covered). Token 4 was echoed
    # in sample 0 too, but after a different context: dedupe is by shared prefix, i.e. by identical
    # prediction, so it is a new target here.
    assert b.echo_weights == [None, None, 0.5, 0.1, 0.5, None]
    # Sequence [1, 2, 4] shares only [1, 2] with the first turn; the restart rule hides nothing else.
    again = cfg.model_copy(update={"reecho_restarted_prompts": True, "skip_initial_prompt": False})
    _, b2 = interleave(steps, echo=again)
    assert b2.echo_weights == [None, 0.1, 0.5, 0.1, 0.5, None]


def test_restart_dedupe_hides_tokens_an_earlier_sample_echoed():
    att_obs = {
        "message_indices": [-1, -1, -1, 0, 0],
        "is_content": [False, False, False, True, True],
        "message_roles": ["tool"],
    }
    att_restart = {
        "message_indices": [0, 0, 1, 2, 2],
        "is_content": [True, True, True, True, True],
        "message_roles": ["user", "assistant", "tool"],
    }
    steps = [
        step([1, 2], [3]),
        step([1, 2, 3, 4, 5], [6], att=att_obs),
        step([1, 2, 3, 4, 5], [7], att=att_restart),
    ]
    # Step 2 retries step 1's prompt. Sample 0's prefix is now [1..6], which [1..5] does not start
    # with, so a new sample starts whose whole prompt is a context sample 0 already trained.
    cfg = EchoConfig(tool=RoleEcho(alpha=0.5))
    a, b = interleave(steps, echo=cfg)
    assert a.echo_weights == [None, None, None, 0.5, 0.5, None]
    assert b.echo_weights is None  # the tool output [4, 5] was already echoed by sample 0
    again = cfg.model_copy(update={"reecho_restarted_prompts": True})
    _, b2 = interleave(steps, echo=again)
    assert b2.echo_weights == [None, None, None, 0.5, 0.5, None]


def keep_first_token_only(steps, *, also=False):
    return [
        [i == 0 or also for i in range(len(s.prompt_ids) + len(s.completion_ids))] for s in steps
    ]


def test_config_filter_by_import_path_narrows():
    cfg = EchoConfig(
        tool=RoleEcho(alpha=0.5),
        filter=EchoFilter(import_path="test_interleave:keep_first_token_only"),
    )
    with pytest.raises(ValueError, match="allow_import_paths=True"):
        interleave(worked_example_steps(), echo=cfg)
    [sample] = interleave(worked_example_steps(), echo=cfg, allow_import_paths=True)
    assert sample.echo_weights is None
    cfg = cfg.model_copy(
        update={
            "filter": EchoFilter(
                import_path="test_interleave:keep_first_token_only", kwargs={"also": True}
            )
        }
    )
    [sample] = interleave(worked_example_steps(), echo=cfg, allow_import_paths=True)
    assert sample.echo_weights == [None, None, None, None, None, 0.5, None]


def test_explicit_keep_and_filter_are_anded():
    cfg = EchoConfig(
        tool=RoleEcho(alpha=0.5),
        filter=EchoFilter(
            import_path="test_interleave:keep_first_token_only", kwargs={"also": True}
        ),
    )
    keep = [[True] * 4, [True] * 5 + [False, True]]
    [sample] = interleave(worked_example_steps(), echo=cfg, keep=keep, allow_import_paths=True)
    assert sample.echo_weights is None


def test_filter_outer_length_and_type_errors():
    def too_few(steps):
        return [[True] * 4]

    def not_a_list(steps):
        return ((True,) * 4, (True,) * 7)

    with pytest.raises(ValueError, match="returned 1 masks for 2 steps"):
        interleave(
            worked_example_steps(),
            echo=TOOL.model_copy(update={"filter": EchoFilter(import_path="x:y")}),
            echo_filter=too_few,
        )
    with pytest.raises(TypeError, match="must return list\\[list\\[bool\\]\\]"):
        interleave(
            worked_example_steps(),
            echo=TOOL.model_copy(update={"filter": EchoFilter(import_path="x:y")}),
            echo_filter=not_a_list,
        )
    with pytest.raises(ValueError, match="step 1: mask has length 6, expected 7"):
        interleave(worked_example_steps(), echo=TOOL, keep=[[True] * 4, [True] * 6])


def test_filter_exceptions_propagate():
    def boom(steps):
        raise RuntimeError("user filter failed")

    with pytest.raises(RuntimeError, match="user filter failed"):
        interleave(
            worked_example_steps(),
            echo=TOOL.model_copy(update={"filter": EchoFilter(import_path="x:y")}),
            echo_filter=boom,
        )


def test_multiple_prefix_matches_warn_once(caplog):
    steps = [
        step([1, 2], [3]),
        step([1, 2, 3, 4], [5]),
        step([1, 2], [3, 4, 5, 6]),
        step([1, 2, 3, 4, 5, 6, 7], [8]),
    ]
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        interleave(steps)
        interleave(steps)
    assert len([r for r in caplog.records if "longest prefix wins" in r.message]) == 1


def test_bad_steps_rejected():
    with pytest.raises(TypeError, match=r"steps\[0\] must be an echoloss.Step"):
        interleave([{"prompt_ids": [1]}])
    with pytest.raises(ValueError, match=r"Step.completion_logprobs has length 1, expected 2"):
        step([1], [2, 3], lp=[-1.0])
    with pytest.raises(TypeError, match=r"Step.completion_mask\[0\] must be a bool, got int"):
        step([1], [2], mask=[1])
    with pytest.raises(ValueError, match=r"Step\.temperature must be a positive finite float"):
        step([1], [2], temperature=0.0)


def test_empty_trajectory_yields_nothing_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        assert interleave([]) == []
    assert "empty trajectory" in caplog.text


def test_prompt_equal_to_previous_sequence_extends():
    # docs/spec.md §6.1, F16: a step whose prompt is exactly the previous prompt + completion (the
    # environment wrote nothing in between) extends the sample with an empty tail.
    steps = [step([1, 2], [3]), step([1, 2, 3], [4]), step([1, 2, 3, 4, 5], [6])]
    [sample] = interleave(steps)
    assert sample.prompt_ids == [1, 2]
    assert sample.completion_ids == [3, 4, 5, 6]
    assert sample.completion_mask == [True, True, False, True]


def test_completion_tokens_returned_to_rl_do_not_count_in_z():
    # docs/spec.md §5.3, F27: with assistant echo capped at one token per message, the second
    # completion token goes back to RL and must not count in Z = |O|.
    att = {"message_indices": [0], "is_content": [True], "message_roles": ["user"]}
    cfg = EchoConfig(assistant=RoleEcho(alpha=0.5), max_tokens_per_message=1)
    [sample] = interleave([step([7], [8, 9], att=att)], echo=cfg)
    assert sample.echo_weights == [None, 0.5, None]
    assert sample.completion_mask == [False, True]
    assert sample.observation_mask == [False, True, False]
    # The same with a filter instead of the cap.
    cfg = EchoConfig(assistant=RoleEcho(alpha=0.5))
    [sample] = interleave([step([7], [8, 9], att=att)], echo=cfg, keep=[[True, True, False]])
    assert sample.completion_mask == [False, True]
    assert sample.observation_mask == [False, True, False]


def test_echo_filter_argument_is_called_without_a_config_filter():
    # docs/spec.md F31: an echo_filter passed to interleave is used even when the config names none.
    calls = []

    def drop_everything(steps):
        calls.append(len(steps))
        return [[False] * (len(s.prompt_ids) + len(s.completion_ids)) for s in steps]

    [sample] = interleave(worked_example_steps(), echo=TOOL, echo_filter=drop_everything)
    assert calls == [2]
    assert sample.echo_weights is None
    with pytest.raises(ValueError, match="echo_filter is set but echo is None"):
        interleave(worked_example_steps(), echo_filter=drop_everything)
    with pytest.raises(ValueError, match="keep is set but echo is None"):
        interleave(worked_example_steps(), keep=[[False] * 4, [False] * 7])
    with pytest.raises(TypeError, match="echo_filter must be a callable or None"):
        interleave(worked_example_steps(), echo=TOOL, echo_filter="my_module:fn")


def test_interleave_argument_errors_name_the_argument_and_the_fix():
    steps = worked_example_steps()
    with pytest.raises(TypeError, match=r"errored must be a bool, got str 'no'"):
        interleave(steps, errored="no")
    with pytest.raises(TypeError, match=r"steps must be a list of echoloss.Step.*wrap it"):
        interleave(steps[0])
    with pytest.raises(TypeError, match=r"echo must be an EchoConfig or None, got str"):
        interleave(steps, echo="tool")
    with pytest.raises(TypeError, match=r"env_name must be a str, got int 3"):
        interleave(steps, env_name=3)
    # The dict form of a config is validated into one (pydantic at the boundary).
    [a] = interleave(steps, echo={"tool": {"alpha": 0.5}})
    [b] = interleave(steps, echo=TOOL)
    assert a == b
    with pytest.raises(ValueError, match="toool"):
        interleave(steps, echo={"toool": {"alpha": 0.5}})


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"lp": [0.7]}, ValueError, r"completion_logprobs\[0\] must be a log-probability \(<= 0\)"),
        ({"temperature": True}, TypeError, r"Step.temperature must be a positive float, got bool"),
        ({"temperature": 1e-50}, ValueError, r"Step.temperature must be a positive finite float"),
        (
            {"prompt": [-1]},
            ValueError,
            r"Step.prompt_ids\[0\] must be a token id in \[0, 2\*\*63\)",
        ),
        ({"completion": [2**63]}, ValueError, r"Step.completion_ids\[0\] must be a token id"),
    ],
)
def test_step_rejects_impossible_values(kwargs, error, pattern):
    args = {"prompt": [1], "completion": [2], **kwargs}
    with pytest.raises(error, match=pattern):
        step(
            args["prompt"],
            args["completion"],
            lp=args.get("lp"),
            temperature=args.get("temperature", 1.0),
        )


def test_step_accepts_a_log_probability_rounded_just_above_zero():
    # LOGPROB_SLACK: a near-certain token's log-softmax may land a few float32 ulps above 0.
    assert step([1], [2], lp=[1e-7]).completion_logprobs == [1e-7]
