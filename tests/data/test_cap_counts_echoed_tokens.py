"""``max_tokens_per_message`` counts the tokens that are actually echoed: position 0 of a sample
(never trained) takes no place in the cap."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from echoloss import EchoConfig, RoleEcho, Step, interleave


def test_the_reported_example():
    [s] = interleave(
        [Step(prompt_ids=[], completion_ids=[3, 4, 5], completion_logprobs=[-1.0] * 3)],
        echo=EchoConfig(assistant=RoleEcho(alpha=0.5), max_tokens_per_message=1),
    )
    assert s.echo_weights == [None, 0.5, None]
    assert s.completion_mask == [False, False, True]
    assert s.token_echo_weights() == [0.0, 0.5, 0.0]


def test_a_one_token_message_at_position_zero_keeps_nothing_and_loses_nothing():
    [s] = interleave(
        [Step(prompt_ids=[], completion_ids=[3], completion_logprobs=[-1.0])],
        echo=EchoConfig(assistant=RoleEcho(alpha=0.5), max_tokens_per_message=1),
    )
    assert s.num_echo_tokens == 0 and s.num_rl_tokens == 0


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    cap=st.integers(1, 5),
    prompt=st.lists(st.integers(10, 20), max_size=3),
)
def test_echoed_tokens_of_the_completion_are_min_of_cap_and_trainable(n, cap, prompt):
    """Echoed = min(cap, trainable completion tokens), where position 0 is not trainable."""
    [s] = interleave(
        [Step(prompt_ids=prompt, completion_ids=list(range(n)), completion_logprobs=[-1.0] * n)],
        echo=EchoConfig(assistant=RoleEcho(alpha=0.5), max_tokens_per_message=cap),
    )
    trainable = n - (0 if prompt else 1)
    assert s.num_echo_tokens == min(cap, trainable)
    assert s.num_rl_tokens == trainable - min(cap, trainable)
