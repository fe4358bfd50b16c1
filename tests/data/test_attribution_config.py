"""TokenAttribution and EchoConfig: construction, validation and error messages."""

import math

import numpy as np
import pytest
from pydantic import ValidationError

from echoloss import (
    EchoConfig,
    EchoFilter,
    RoleEcho,
    TokenAttribution,
    list_echo_filters,
    register_echo_filter,
)

GOOD = {
    "message_indices": [-1, 0, 0, 1, 1],
    "is_content": [False, False, True, False, True],
    "message_roles": ["user", "tool"],
    "message_tool_names": [None, "ls"],
}


def test_from_dict_round_trips_and_ignores_renderer_keys():
    d = dict(GOOD, token_ids=[1, 2, 3, 4, 5], sampled_mask=[False] * 5, multi_modal_data=None)
    att = TokenAttribution.from_dict(d)
    assert att.message_indices == (-1, 0, 0, 1, 1)
    assert att.role_of(1) == "tool" and att.tool_name_of(1) == "ls"
    assert att.tool_name_of(0) is None
    assert TokenAttribution.from_dict(att.to_dict()) == att


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['message_index'\]"):
        TokenAttribution.from_dict(dict(GOOD, message_index=[0]))


def test_missing_required_key_is_named():
    d = dict(GOOD)
    del d["message_roles"]
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['message_roles'\]"):
        TokenAttribution.from_dict(d)


def test_not_a_dict():
    with pytest.raises(TypeError, match="expects a dict, got list"):
        TokenAttribution.from_dict([1, 2])


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("is_content", [True, False], "is_content has length 2 but message_indices has length 5"),
        ("is_warning", [False] * 4, "is_warning has length 4 but message_indices has length 5"),
        (
            "message_tool_names",
            [None, "ls", "cat"],
            "message_tool_names has length 3 but message_roles has length 2",
        ),
        ("token_ids", [1, 2, 3], "token_ids has length 3 but message_indices has length 5"),
    ],
)
def test_length_errors_name_field_and_both_lengths(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        TokenAttribution.from_dict(dict(GOOD, **{field: value}))


@pytest.mark.parametrize("bad", [1, 0, np.bool_(True), "True"])
def test_non_bool_masks_rejected_with_index(bad):
    is_content = [False, False, True, False, bad]
    with pytest.raises(TypeError, match=r"is_content\[4\] must be a bool"):
        TokenAttribution.from_dict(dict(GOOD, is_content=is_content))


def test_message_index_out_of_range():
    with pytest.raises(ValueError, match=r"message_indices\[4\] = 2 but only 2 message role"):
        TokenAttribution.from_dict(dict(GOOD, message_indices=[-1, 0, 0, 1, 2]))


def test_message_index_below_minus_one():
    with pytest.raises(ValueError, match=r"message_indices\[0\] = -2"):
        TokenAttribution.from_dict(dict(GOOD, message_indices=[-2, 0, 0, 1, 1]))


def test_warning_on_scaffold_rejected():
    with pytest.raises(ValueError, match=r"is_warning\[0\] is True on a scaffold token"):
        TokenAttribution.from_dict(dict(GOOD, is_warning=[True, False, False, False, False]))


def test_short_tool_name_list_is_tolerated():
    # verifiers' prompt truncation rebuilds attribution without message_tool_names: an empty list.
    att = TokenAttribution.from_dict(dict(GOOD, message_tool_names=[]))
    assert att.tool_name_of(1) is None


def test_empty_is_content_means_no_signal():
    att = TokenAttribution.from_dict(dict(GOOD, is_content=[]))
    assert not att.has_content_signal


# -- EchoConfig ---------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [math.nan, math.inf, -math.inf, 0.0, -0.1])
def test_alpha_must_be_finite_and_positive(alpha):
    with pytest.raises(ValidationError, match="alpha"):
        RoleEcho(alpha=alpha)


def test_empty_tool_allow_list_rejected():
    with pytest.raises(ValidationError, match="non-empty set"):
        RoleEcho(alpha=0.1, tool_names=[])


def test_tool_names_list_becomes_a_set():
    assert RoleEcho(alpha=0.1, tool_names=["a", "a", "b"]).tool_names == frozenset({"a", "b"})


def test_at_least_one_role_and_filter_alone_does_not_count():
    with pytest.raises(ValidationError, match="enables no role"):
        EchoConfig(filter=EchoFilter(import_path="os.path:join"))


def test_unknown_config_key_rejected():
    with pytest.raises(ValidationError, match="toool"):
        EchoConfig(toool=RoleEcho(alpha=0.1))


def test_tool_names_only_on_tool_role():
    with pytest.raises(ValidationError, match=r"user\.tool_names is set"):
        EchoConfig(user=RoleEcho(alpha=0.1, tool_names=["x"]))


def test_other_roles_cannot_shadow_standard_roles():
    with pytest.raises(ValidationError, match="standard role"):
        EchoConfig(other_roles={"tool": RoleEcho(alpha=0.1)})


def test_defaults_follow_the_paper():
    cfg = EchoConfig(tool=RoleEcho(alpha=0.05))
    assert cfg.skip_initial_prompt is True
    assert cfg.target == "content"
    assert cfg.echo_warnings is False
    assert cfg.reecho_restarted_prompts is False
    assert cfg.enabled_roles() == {"tool": 0.05}


def test_cap_must_be_positive():
    with pytest.raises(ValidationError, match="max_tokens_per_message"):
        EchoConfig(tool=RoleEcho(alpha=0.1), max_tokens_per_message=0)


def test_filter_resolves_and_binds_kwargs():
    fn = EchoFilter(import_path="builtins:max", kwargs={"default": 7}).resolve(
        allow_import_paths=True
    )
    assert fn([]) == 7


def test_filter_import_paths_need_an_opt_in():
    # docs/spec.md F32: a config (or a file it came from) may not name arbitrary code.
    with pytest.raises(ValueError, match=r"'os:system' is an import path.*allow_import_paths=True"):
        EchoFilter(import_path="os:system").resolve()
    with pytest.raises(
        ValueError, match=r"'echoloss.io.rollouts:write_rollouts' is an import path"
    ):
        EchoFilter(import_path="echoloss.io.rollouts:write_rollouts").resolve()
    with pytest.raises(ValueError, match="'no_such_filter' is not a registered echo filter"):
        EchoFilter(import_path="no_such_filter").resolve()
    with pytest.raises(TypeError, match="allow_import_paths must be a bool"):
        EchoFilter(import_path="os:system").resolve(allow_import_paths="yes")


def test_registered_filter_resolves_by_name_and_binds_kwargs():
    @register_echo_filter("test_keep_none", overwrite=True)
    def keep_none(steps, *, value):
        return [[value] * (len(s.prompt_ids) + len(s.completion_ids)) for s in steps]

    fn = EchoFilter(import_path="test_keep_none", kwargs={"value": False}).resolve()
    assert fn.__name__ == "keep_none"
    assert "test_keep_none" in list_echo_filters()
    with pytest.raises(ValueError, match="already registered"):
        register_echo_filter("test_keep_none")(lambda steps: steps)
    with pytest.raises(ValueError, match=r"without ':' or '\.'"):
        register_echo_filter("a.b")


@pytest.mark.parametrize(
    ("path", "pattern"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("os.path:no_such_fn", "has no attribute 'no_such_fn'"),
        ("nodots", "not a registered echo filter"),
    ],
)
def test_filter_import_errors_name_the_path(path, pattern):
    with pytest.raises((ImportError, ValueError), match=pattern):
        EchoFilter(import_path=path).resolve(allow_import_paths=True)


def test_alpha_must_be_representable_in_float32():
    # docs/spec.md §2.3: a weight that float32 packing would turn into 0 or inf fails at the config.
    for alpha in (1e-50, 1e39):
        with pytest.raises(ValidationError, match="normal float32"):
            RoleEcho(alpha=alpha)


def test_ignored_roles_cannot_name_known_roles():
    with pytest.raises(ValidationError, match="ignored_roles"):
        EchoConfig(tool=RoleEcho(alpha=0.1), ignored_roles={"user"})
    with pytest.raises(ValidationError, match="ignored_roles"):
        EchoConfig(
            tool=RoleEcho(alpha=0.1),
            other_roles={"developer": RoleEcho(alpha=0.1)},
            ignored_roles={"developer"},
        )
