"""The three registries named in configurations (policies, advantage functions, echo filters) are
one `Registry` type: the same decorator and direct forms, the same ``overwrite`` flag, the same
sorted listing, the same errors."""

from __future__ import annotations

import pytest

from echoloss import advantages, data
from echoloss._registry import Registry
from echoloss.advantages import registry as advantage_registry
from echoloss.data import echo_config
from echoloss.loss import PolicyOutput, policy

REGISTRIES = {
    "policy": (policy._REGISTRY, policy.register_policy, policy.list_policies),
    "advantage fn": (
        advantage_registry._REGISTRY,
        advantages.register_advantage_fn,
        advantages.list_advantage_fns,
    ),
    "echo filter": (echo_config._FILTERS, data.register_echo_filter, data.list_echo_filters),
}


def _fn(inputs, config=None):
    return PolicyOutput(-inputs.advantages * inputs.logprobs, {})


def _other(inputs, config=None):
    return PolicyOutput(inputs.advantages * inputs.logprobs, {})


def _registered(kind, registry, name):
    value = registry[name]
    return value.fn if kind == "policy" else value


@pytest.mark.parametrize("kind", REGISTRIES)
def test_one_decorator_style_one_flag_one_listing(kind):
    registry, register, listing = REGISTRIES[kind]
    assert isinstance(registry, Registry)
    with registry.isolated():
        decorated = register("reg_test_a")(_fn)  # the decorator form returns the function
        assert decorated is _fn and _registered(kind, registry, "reg_test_a") is _fn
        register("reg_test_b", _fn)  # the direct form
        assert _registered(kind, registry, "reg_test_b") is _fn
        register("reg_test_b", _fn)  # the same again: a no-op
        with pytest.raises(ValueError, match=rf"{kind} 'reg_test_b' is already registered"):
            register("reg_test_b", _other)
        register("reg_test_b", _other, overwrite=True)
        assert _registered(kind, registry, "reg_test_b") is _other
        names = listing()
        assert names == sorted(names) and {"reg_test_a", "reg_test_b"} <= set(names)
    assert "reg_test_a" not in listing()  # isolated() undid the registrations


@pytest.mark.parametrize("kind", REGISTRIES)
def test_a_non_callable_is_refused(kind):
    registry, register, _ = REGISTRIES[kind]
    with registry.isolated(), pytest.raises(TypeError, match="callable"):
        register("reg_test_c", 3)


def test_built_in_policies_cannot_be_replaced():
    with pytest.raises(ValueError, match="policy 'dppo' is built in and cannot be replaced"):
        policy.register_policy("dppo", _fn, overwrite=True)
