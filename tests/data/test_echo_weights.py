"""Per-step echo weights: the golden values of docs/spec.md §13 and its failure modes (§12)."""

import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import attributed_prompts, echo_configs

from echoloss import EchoConfig, RoleEcho, TokenAttribution, echo_weights, select_step_echo

ROLES = ["system", "user", "assistant", "tool", "developer"]


def cfg(**kw):
    kw.setdefault("skip_initial_prompt", False)
    return EchoConfig(**kw)


# -- golden values (docs/spec.md §13) -------------------------------------------------------------


def test_golden_c_tool_allow_list():
    att = {
        "message_indices": [0, 0, 1, 1, 2, 2],
        "is_content": [False, True, False, True, False, True],
        "message_roles": ["user", "tool", "tool"],
        "message_tool_names": [None, "calc", "lookup"],
    }
    c = cfg(tool=RoleEcho(alpha=0.5, tool_names={"lookup"}))
    assert echo_weights(att, c, prompt_len=6, completion_len=0) == [
        None,
        None,
        None,
        None,
        None,
        0.5,
    ]


ALL_ROLES = dict(
    tool=RoleEcho(alpha=0.5),
    system=RoleEcho(alpha=0.05),
    user=RoleEcho(alpha=0.1),
    assistant=RoleEcho(alpha=0.9),
)


def test_golden_d_all_roles():
    att = {
        "message_indices": [0, 1, 2],
        "is_content": [True] * 3,
        "message_roles": ["user", "tool", "system"],
    }
    assert echo_weights(att, cfg(**ALL_ROLES), prompt_len=3, completion_len=2) == [
        0.1,
        0.5,
        0.05,
        0.9,
        0.9,
    ]


def test_golden_d_with_filter():
    att = {
        "message_indices": [0, 1, 2],
        "is_content": [True] * 3,
        "message_roles": ["system", "user", "tool"],
    }
    keep = [True, False, True, True, False]
    assert echo_weights(att, cfg(**ALL_ROLES), prompt_len=3, completion_len=2, keep=keep) == [
        0.05,
        None,
        0.5,
        0.9,
        None,
    ]


def test_golden_e_no_attribution_assistant_only(caplog):
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        w = echo_weights(None, cfg(assistant=RoleEcho(alpha=0.3)), prompt_len=4, completion_len=2)
    assert w == [None, None, None, None, 0.3, 0.3]
    assert "no prompt attribution" in caplog.text


def test_golden_e_train_sink_variant_with_filter():
    w = echo_weights(
        None,
        cfg(assistant=RoleEcho(alpha=0.3)),
        prompt_len=2,
        completion_len=2,
        keep=[True, True, True, False],
    )
    assert w == [None, None, 0.3, None]


def test_golden_f_alpha_zero_is_rejected_not_silently_meaningful():
    # An assistant alpha of 0 as a way to "kill RL" does not exist: weight 0 is an error
    # (docs/spec.md §2.2, F24).
    with pytest.raises(ValueError, match="alpha"):
        RoleEcho(alpha=0.0)


# -- attribution robustness (docs/spec.md F8, F9, F10) --------------------------------------------


def test_dict_attribution_accepted_and_equivalent_to_object():
    d = {"message_indices": [0, 1], "is_content": [True, True], "message_roles": ["user", "tool"]}
    c = cfg(tool=RoleEcho(alpha=0.2))
    assert (
        echo_weights(d, c, prompt_len=2, completion_len=0)
        == echo_weights(TokenAttribution.from_dict(d), c, prompt_len=2, completion_len=0)
        == [None, 0.2]
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"message_indices": [0, 1], "is_content": [True, True]},  # missing roles
        {
            "message_indices": [0, 1],
            "is_content": [True, True],
            "message_roles": ["user", "tool"],
            "extra": 1,
        },
        {"message_indices": [0, 5], "is_content": [True, True], "message_roles": ["user", "tool"]},
    ],
)
def test_unusable_dict_degrades_to_no_prompt_echo_with_one_warning(bad, caplog):
    c = cfg(tool=RoleEcho(alpha=0.2), assistant=RoleEcho(alpha=0.4))
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        for _ in range(3):
            w = echo_weights(bad, c, prompt_len=2, completion_len=1)
            assert w == [None, None, 0.4]
    assert len([r for r in caplog.records if "attribution is invalid" in r.message]) == 1


def test_attribution_length_mismatch_degrades_with_warning(caplog):
    att = {"message_indices": [0, 1], "is_content": [True, True], "message_roles": ["user", "tool"]}
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        w = echo_weights(att, cfg(tool=RoleEcho(alpha=0.2)), prompt_len=3, completion_len=0)
    assert w == [None, None, None]
    assert "covers 2 tokens but the prompt has 3" in caplog.text


def test_empty_is_content_disables_content_mode_but_not_message_mode(caplog):
    att = {"message_indices": [-1, 0, 0], "is_content": [], "message_roles": ["tool"]}
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        assert (
            echo_weights(att, cfg(tool=RoleEcho(alpha=0.2)), prompt_len=3, completion_len=0)
            == [None] * 3
        )
    assert "empty is_content" in caplog.text
    whole = cfg(tool=RoleEcho(alpha=0.2), target="message")
    assert echo_weights(att, whole, prompt_len=3, completion_len=0) == [None, 0.2, 0.2]


BRIDGED_NO_NAME = {
    # turn 2, bridged: history is -1, the tool message carries no name (issuer outside the slice)
    "message_indices": [-1, -1, -1, 0, 0, 0],
    "is_content": [False, False, False, False, True, True],
    "message_roles": ["tool"],
    "message_tool_names": [None],
}


def test_unresolved_tool_name_with_allow_list_is_not_echoed():
    c = cfg(tool=RoleEcho(alpha=0.5, tool_names={"bash"}))
    assert echo_weights(BRIDGED_NO_NAME, c, prompt_len=6, completion_len=0) == [None] * 6


def test_unresolved_tool_name_without_allow_list_is_echoed():
    c = cfg(tool=RoleEcho(alpha=0.5))
    assert echo_weights(BRIDGED_NO_NAME, c, prompt_len=6, completion_len=0) == [None] * 4 + [
        0.5,
        0.5,
    ]


def test_missing_tool_name_list_warns_once_under_allow_list(caplog):
    att = dict(BRIDGED_NO_NAME, message_tool_names=[])
    c = cfg(tool=RoleEcho(alpha=0.5, tool_names={"bash"}))
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        echo_weights(att, c, prompt_len=6, completion_len=0)
        echo_weights(att, c, prompt_len=6, completion_len=0)
    assert len([r for r in caplog.records if "no resolved name" in r.message]) == 1


def test_only_content_tokens_are_echoed_and_all_scaffold_messages_give_nothing():
    att = {
        "message_indices": [-1, 0, 0, 0, -1, 1, 1, -1],
        "is_content": [False, False, True, False, False, False, False, False],
        "message_roles": ["tool", "tool"],  # message 1 is all scaffold (an empty tool output)
    }
    w = echo_weights(att, cfg(tool=RoleEcho(alpha=1.0)), prompt_len=8, completion_len=0)
    assert w == [None, None, 1.0, None, None, None, None, None]


def test_message_target_takes_scaffold_of_the_message_but_never_unattributed_tokens():
    att = {
        "message_indices": [-1, 0, 0, 0, -1],
        "is_content": [False, False, True, False, False],
        "message_roles": ["tool"],
    }
    c = cfg(tool=RoleEcho(alpha=1.0), target="message")
    assert echo_weights(att, c, prompt_len=5, completion_len=0) == [None, 1.0, 1.0, 1.0, None]


def test_unknown_roles_are_not_echoed_unless_named():
    att = {
        "message_indices": [0, 1],
        "is_content": [True, True],
        "message_roles": ["developer", "ipython"],
    }
    every_standard = cfg(
        system=RoleEcho(alpha=1.0), user=RoleEcho(alpha=1.0), tool=RoleEcho(alpha=1.0)
    )
    assert echo_weights(att, every_standard, prompt_len=2, completion_len=0) == [None, None]
    named = cfg(other_roles={"ipython": RoleEcho(alpha=0.3)})
    assert echo_weights(att, named, prompt_len=2, completion_len=0) == [None, 0.3]


# -- warnings, cap, initial prompt ----------------------------------------------------------------

WARN = {
    "message_indices": [0, 0, -1, 1, 1, 1, 1, -1],
    "is_content": [False, True, False, False, True, True, True, False],
    "message_roles": ["user", "tool"],
    "is_warning": [False, False, False, False, True, False, False, False],
}


def test_warning_excluded_from_target_but_counted_in_observation():
    s = select_step_echo(
        WARN,
        EchoConfig(tool=RoleEcho(alpha=1.0)),
        prompt_len=8,
        completion_len=0,
        initial_prompt_len=3,
    )
    assert s.weights == [None] * 5 + [1.0, 1.0, None]
    assert s.observation == [False] * 4 + [True, True, True, False]  # Z = 3: warning + 2 env tokens


def test_echo_warnings_opt_in():
    c = EchoConfig(tool=RoleEcho(alpha=1.0), echo_warnings=True)
    w = echo_weights(WARN, c, prompt_len=8, completion_len=0, initial_prompt_len=3)
    assert w == [None] * 4 + [1.0, 1.0, 1.0, None]


def test_cap_keeps_first_tokens_of_each_message_and_z_is_uncapped():
    att = {
        "message_indices": [0, 0, 0, 1, 1, 1],
        "is_content": [True] * 6,
        "message_roles": ["tool", "tool"],
    }
    c = cfg(tool=RoleEcho(alpha=1.0), max_tokens_per_message=2)
    s = select_step_echo(att, c, prompt_len=6, completion_len=3)
    assert s.weights == [1.0, 1.0, None, 1.0, 1.0, None, None, None, None]
    assert s.observation == [True] * 6 + [False] * 3


def test_cap_counts_only_tokens_the_filter_keeps():
    att = {"message_indices": [0, 0, 0], "is_content": [True] * 3, "message_roles": ["tool"]}
    c = cfg(tool=RoleEcho(alpha=1.0), max_tokens_per_message=1)
    w = echo_weights(att, c, prompt_len=3, completion_len=0, keep=[False, True, True])
    assert w == [None, 1.0, None]


def test_cap_applies_to_the_completion_as_one_message():
    c = cfg(assistant=RoleEcho(alpha=1.0), max_tokens_per_message=1)
    assert echo_weights(None, c, prompt_len=0, completion_len=3) == [1.0, None, None]


def test_initial_prompt_skipped_by_default_on_the_first_step():
    att = {
        "message_indices": [0, 1, 2],
        "is_content": [True] * 3,
        "message_roles": ["system", "user", "tool"],
    }
    c = EchoConfig(system=RoleEcho(alpha=1.0), user=RoleEcho(alpha=1.0), tool=RoleEcho(alpha=1.0))
    assert echo_weights(att, c, prompt_len=3, completion_len=0) == [None] * 3


def test_initial_prompt_len_limits_the_skip_on_a_full_re_render():
    # turn 2 rendered in full: [system, user task | assistant, tool, user feedback]
    att = {
        "message_indices": [0, 1, 2, 3, 4],
        "is_content": [True] * 5,
        "message_roles": ["system", "user", "assistant", "tool", "user"],
    }
    c = EchoConfig(user=RoleEcho(alpha=0.1), tool=RoleEcho(alpha=0.5))
    assert echo_weights(att, c, prompt_len=5, completion_len=0, initial_prompt_len=2) == [
        None,
        None,
        None,
        0.5,
        0.1,
    ]


def test_seen_prefix_not_re_echoed_unless_asked():
    att = {"message_indices": [0, 0, 0], "is_content": [True] * 3, "message_roles": ["tool"]}
    base = dict(tool=RoleEcho(alpha=1.0), skip_initial_prompt=False)
    assert echo_weights(
        att, EchoConfig(**base), prompt_len=3, completion_len=0, seen_prefix_len=2
    ) == [
        None,
        None,
        1.0,
    ]
    again = EchoConfig(**base, reecho_restarted_prompts=True)
    assert echo_weights(att, again, prompt_len=3, completion_len=0, seen_prefix_len=2) == [1.0] * 3


# -- filter validation (docs/spec.md F17, F18) ----------------------------------------------------


@pytest.mark.parametrize(
    ("keep", "exc", "pattern"),
    [
        ((True, True), TypeError, "step 3: expected list\\[bool\\], got tuple"),
        (
            [True],
            ValueError,
            "step 3: mask has length 1, expected 2 \\(prompt_len=1 \\+ completion_len=1\\)",
        ),
        ([True, 1], TypeError, r"step 3, keep\[1\] must be a bool, got int"),
        ([np.bool_(True), True], TypeError, r"step 3, keep\[0\] must be a bool, got numpy.bool"),
        (["yes", True], TypeError, r"step 3, keep\[0\] must be a bool, got str"),
    ],
)
def test_filter_output_validated_exactly(keep, exc, pattern):
    with pytest.raises(exc, match=pattern):
        echo_weights(
            None,
            cfg(assistant=RoleEcho(alpha=1.0)),
            prompt_len=1,
            completion_len=1,
            keep=keep,
            step_index=3,
        )


def test_filter_cannot_enable_disabled_roles():
    att = {"message_indices": [0, 1], "is_content": [True, True], "message_roles": ["user", "tool"]}
    w = echo_weights(
        att, cfg(tool=RoleEcho(alpha=0.5)), prompt_len=2, completion_len=1, keep=[True] * 3
    )
    assert w == [None, 0.5, None]


# -- properties -----------------------------------------------------------------------------------


@given(attributed_prompts(), echo_configs(), st.integers(0, 4), st.data())
def test_filter_only_narrows_and_echo_implies_observation(prompt, config, c, data):
    att, p = prompt
    keep = data.draw(st.lists(st.booleans(), min_size=p + c, max_size=p + c))
    initial = data.draw(st.none() | st.integers(0, p))
    free = select_step_echo(att, config, prompt_len=p, completion_len=c, initial_prompt_len=initial)
    kept = select_step_echo(
        att, config, prompt_len=p, completion_len=c, keep=keep, initial_prompt_len=initial
    )
    assert len(kept.weights) == len(kept.observation) == p + c
    # Z does not depend on the filter on the prompt side; a completion token counts only while it
    # is echoed (docs/spec.md §5.3).
    assert kept.observation[:p] == free.observation[:p]
    assert kept.observation[p:] == [w is not None for w in kept.weights[p:]]
    for k in range(p + c):
        if kept.weights[k] is not None:
            assert keep[k]
            assert kept.observation[k]
            if config.max_tokens_per_message is None:
                assert free.weights[k] == kept.weights[k]
        if free.weights[k] is not None:
            assert free.observation[k]
            if k < p:  # prompt-side selection is body of an enabled role, never scaffold (-1)
                assert att.message_indices[k] >= 0
                role = att.message_roles[att.message_indices[k]]
                assert role in config.enabled_roles()
                assert free.weights[k] == config.enabled_roles()[role]
                if config.target == "content":
                    assert att.is_content[k]
                if config.skip_initial_prompt:
                    assert k >= (p if initial is None else initial)
            else:
                assert config.assistant is not None


def test_unknown_role_string_warns_once_naming_the_known_roles(caplog):
    # docs/spec.md §4.2, F30: a misspelt role is not echoed, and that is said once.
    att = {
        "message_indices": [0, 1],
        "is_content": [True, True],
        "message_roles": ["user", "toool"],
    }
    c = cfg(tool=RoleEcho(alpha=0.5))
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        assert echo_weights(att, c, prompt_len=2, completion_len=0) == [None, None]
        echo_weights(att, c, prompt_len=2, completion_len=0)
    hits = [r.message for r in caplog.records if "'toool'" in r.message]
    assert len(hits) == 1
    assert "known roles: ['assistant', 'system', 'tool', 'user']" in hits[0]
    # A role declared as deliberately not echoed is silent.
    caplog.clear()
    quiet = cfg(tool=RoleEcho(alpha=0.5), ignored_roles={"developer"})
    att["message_roles"] = ["user", "developer"]
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        assert echo_weights(att, quiet, prompt_len=2, completion_len=0) == [None, None]
    assert "developer" not in caplog.text


def test_echo_weights_argument_errors_name_the_argument():
    c = cfg(tool=RoleEcho(alpha=0.5))
    with pytest.raises(
        TypeError, match=r"prompt_len must be an int >= 0 and <= 2147483647, got float 2.5"
    ):
        echo_weights(None, c, prompt_len=2.5, completion_len=0)
    with pytest.raises(
        ValueError, match=r"completion_len must be an int >= 0 and <= 2147483646, got int -1"
    ):
        echo_weights(None, c, prompt_len=1, completion_len=-1)
    with pytest.raises(TypeError, match=r"config must be an EchoConfig, got None"):
        echo_weights(None, None, prompt_len=1, completion_len=0)
    att = {"message_indices": [0], "is_content": [True], "message_roles": ["tool"]}
    assert echo_weights(
        att, {"tool": {"alpha": 0.5}, "skip_initial_prompt": False}, prompt_len=1, completion_len=0
    ) == [0.5]
