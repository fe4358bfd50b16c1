"""Hypothesis strategies shared by the test modules: rewards, attribution, echo configs, samples,
trajectories. Import them as ``from strategies import ...`` (``tests/`` is on the import path)."""

from __future__ import annotations

from hypothesis import strategies as st

from echoloss import EchoConfig, RoleEcho, Sample, Step, TokenAttribution
from echoloss.data.interleave import STREAMS

# -- rewards and advantage keys -------------------------------------------------------------------

MAX_GROUP = 12

# Rewards as agent environments produce them: binary, small integers, or arbitrary floats.
reward_values = st.one_of(
    st.sampled_from([0.0, 1.0]),
    st.integers(-5, 5).map(float),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
)
group_rewards = st.lists(reward_values, min_size=1, max_size=MAX_GROUP)
# Quarter-integers: shifting by an integer is exact, so shift invariance is tested without
# the rounding of the shift itself.
dyadic_rewards = st.lists(st.integers(-32, 32).map(lambda q: q / 4), min_size=1, max_size=MAX_GROUP)
any_finite_rewards = st.lists(
    st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=MAX_GROUP
)
rae_keys = st.one_of(
    st.text(max_size=3),
    st.integers(-3, 3),
    st.tuples(st.sampled_from(["env_a", "env_b"]), st.integers(0, 1)),
    st.tuples(st.text(max_size=2), st.tuples(st.integers(0, 2), st.none())),
)


# -- attribution and echo configs -----------------------------------------------------------------

ROLES = ["system", "user", "assistant", "tool", "developer"]


@st.composite
def attributed_prompts(draw):
    m = draw(st.integers(0, 4))
    roles = draw(st.lists(st.sampled_from(ROLES), min_size=m, max_size=m))
    names = draw(st.lists(st.sampled_from([None, "ls", "cat"]), min_size=m, max_size=m))
    p = draw(st.integers(0, 12))
    idx = draw(st.lists(st.integers(-1, m - 1), min_size=p, max_size=p))
    content = draw(st.lists(st.booleans(), min_size=p, max_size=p))
    warning = [c and i >= 0 and draw(st.booleans()) for c, i in zip(content, idx, strict=True)]
    att = TokenAttribution(
        message_indices=idx,
        is_content=content,
        message_roles=roles,
        message_tool_names=names,
        is_warning=warning,
    )
    return att, p


@st.composite
def echo_configs(draw):
    def role(tool=False):
        if not draw(st.booleans()):
            return None
        names = (
            draw(st.none() | st.sets(st.sampled_from(["ls", "cat"]), min_size=1)) if tool else None
        )
        return RoleEcho(alpha=draw(st.sampled_from([0.05, 0.5, 1.0])), tool_names=names)

    roles = {"system": role(), "user": role(), "assistant": role(), "tool": role(tool=True)}
    if not any(roles.values()):
        roles["tool"] = RoleEcho(alpha=1.0)
    return EchoConfig(
        **roles,
        skip_initial_prompt=draw(st.booleans()),
        target=draw(st.sampled_from(["content", "message"])),
        echo_warnings=draw(st.booleans()),
        max_tokens_per_message=draw(st.none() | st.integers(1, 3)),
    )


# -- samples and trajectories ----------------------------------------------------------------------

# Every stream's values are drawn from its declared examples (exactly representable in float32, so
# that unpack(pack(x)) == x holds bit for bit): a stream added to STREAMS is drawn with no edit here.


def normal_form(values: dict, p: int) -> dict:
    """The streams of a sample in normal form (docs/spec.md §7), what pack -> unpack returns as
    is: nothing trained at position 0, echoed tokens out of the RL mask, every echoed token an
    observation. Only the built-in streams' relations need a rule; any other stream is kept."""
    for stream in STREAMS:
        v = values[stream.name]
        if v and stream.untrained_at_zero and (stream.scope == "sequence" or p == 0):
            v[0] = stream.missing
    echo = values["echo_weights"]
    if echo is not None:
        values["completion_mask"] = [
            m and echo[p + k] is None for k, m in enumerate(values["completion_mask"])
        ]
        if values["observation_mask"] is not None:
            values["observation_mask"] = [
                o or w is not None for o, w in zip(values["observation_mask"], echo, strict=True)
            ]
    return values


@st.composite
def normal_form_samples(draw):
    p = draw(st.integers(0, 5))
    c = draw(st.integers(0 if p else 1, 6))
    values = {}
    for stream in STREAMS:
        if stream.optional and draw(st.booleans()):
            values[stream.name] = None
            continue
        n = stream.length(p, c)
        values[stream.name] = draw(
            st.lists(st.sampled_from(stream.examples), min_size=n, max_size=n)
        )
    return Sample(
        prompt_ids=draw(st.lists(st.integers(1, 50), min_size=p, max_size=p)),
        completion_ids=draw(st.lists(st.integers(1, 50), min_size=c, max_size=c)),
        advantage=draw(st.sampled_from([-1.0, 0.0, 0.5])),
        env_name=draw(st.sampled_from(["", "env-a", "env-b"])),
        **normal_form(values, p),
    )


ROLE_NAMES = ["system", "user", "assistant", "tool"]


@st.composite
def trajectories(draw):
    """Multi-turn trajectories that mostly extend (bridged attribution), sometimes restart."""
    steps = []
    history: list[int] = []
    for turn in range(draw(st.integers(1, 4))):
        restart = turn == 0 or draw(st.integers(0, 4)) == 0
        new = draw(
            st.lists(st.integers(1, 30), min_size=0 if history and not restart else 1, max_size=5)
        )
        prompt = new if restart else history + new
        m = draw(st.integers(1, 2))
        roles = draw(st.lists(st.sampled_from(ROLE_NAMES), min_size=m, max_size=m))
        offset = 0 if restart else len(history)
        idx = [-1] * offset + [draw(st.integers(-1, m - 1)) for _ in new]
        content = [False] * offset + [draw(st.booleans()) for _ in new]
        completion = draw(st.lists(st.integers(1, 30), min_size=0, max_size=4))
        steps.append(
            Step(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[-1.0] * len(completion),
                completion_mask=[draw(st.booleans()) for _ in completion],
                attribution={"message_indices": idx, "is_content": content, "message_roles": roles},
                temperature=draw(st.sampled_from([0.6, 1.0])),
            )
        )
        history = prompt + completion
    return steps
