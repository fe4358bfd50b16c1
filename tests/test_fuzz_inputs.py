"""Fuzzing the data path's public entry points: every input gives a clear error or a correct result.

"Clear error" is a ``ValueError`` or ``TypeError`` (pydantic's ``ValidationError`` is a
``ValueError``) whose message names the argument or field at fault; anything else (IndexError,
AttributeError, KeyError, ZeroDivisionError, ...) fails the test, and so does a result that holds a
non-finite number or breaks the stream invariants (docs/spec.md §2, §7, §8).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import attributed_prompts, echo_configs, normal_form_samples, trajectories

from echoloss import (
    EchoConfig,
    RoleEcho,
    Sample,
    Step,
    TokenAttribution,
    compute_advantages,
    echo_weights,
    interleave,
    next_token_targets,
    pack,
)
from echoloss.adapters.openenv import sample_from_record, sample_from_tags
from echoloss.adapters.verifiers import samples_from_rollout, samples_from_trace
from echoloss.io import read_rollouts

FUZZ = settings(
    max_examples=100,
    deadline=None,  # 2 shared CPU cores: wall time varies too much for a per-example deadline
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# -- inputs -----------------------------------------------------------------------------------------

# Scalars a hostile or careless caller passes: wrong types, bools for numbers, non-finite and
# extreme floats, huge and negative ints, strings that look like numbers.
junk_scalars = st.one_of(
    st.none(),
    st.booleans(),
    # Small ints, and ints beyond every length bound (2**31 tokens): lengths in between are legal
    # and would make the fuzz allocate gigabytes.
    st.integers(-5, 50),
    st.integers(2**31, 2**70),
    st.integers(-(2**70), -(2**31)),
    st.sampled_from([0, 1, -1, 2**63, 2**63 - 1, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-50, 1e39, -0.0, 2.5, 0.7, -1e-7, 5e-7]),
    st.text(max_size=4),
    st.sampled_from(["4", "no", "tool", "", "1.5"]),
)
junk = st.recursive(
    junk_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
ids = st.lists(st.integers(0, 40), max_size=5)
logprobs = st.lists(st.floats(-5.0, 0.0), max_size=5)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly valid values (4 in 5), sometimes junk, so that the success path is exercised too."""
    return st.one_of(valid, valid, valid, valid, junk)


def clear_error_or_result(call: Any, names: list[str]) -> Any:
    """Run ``call``; a ValueError/TypeError must name one of ``names``; others propagate."""
    try:
        return call()
    except (ValueError, TypeError) as e:
        message = str(e)
        assert any(n in message for n in names), (
            f"{type(e).__name__} names none of {names}: {message}"
        )
        return None


def assert_finite(values: Any) -> None:
    for v in values:
        if v is not None:
            assert math.isfinite(v), values


def assert_sample_ok(s: Sample) -> None:
    s.validate()
    n = len(s)
    assert_finite(s.completion_logprobs)
    assert all(lp <= 1e-6 for lp in s.completion_logprobs)
    assert all(t >= 0 for t in s.token_ids)
    if s.echo_weights is not None:
        assert len(s.echo_weights) == n
        assert s.echo_weights[0] is None  # position 0 is never trained (docs/spec.md §7)
    assert not s.rl_mask()[0]


# -- attribution and per-step echo weights ------------------------------------------------------


attribution_dicts = st.fixed_dictionaries(
    {},
    optional={
        "message_indices": maybe(st.lists(st.integers(-2, 3), max_size=5)),
        "is_content": maybe(st.lists(st.booleans(), max_size=5)),
        "message_roles": maybe(st.lists(st.sampled_from(["user", "tool", "toool"]), max_size=3)),
        "message_tool_names": maybe(st.none() | st.lists(st.none() | st.text(max_size=3))),
        "is_warning": maybe(st.none() | st.lists(st.booleans(), max_size=5)),
        "token_ids": maybe(ids),
        "extra": junk,
    },
)


@FUZZ
@given(attribution_dicts)
def test_attribution_from_dict(d):
    att = clear_error_or_result(lambda: TokenAttribution.from_dict(d), ["TokenAttribution"])
    if att is not None:
        assert TokenAttribution.from_dict(att.to_dict()) == att


@FUZZ
@given(
    attribution=st.one_of(attributed_prompts().map(lambda a: a[0]), attribution_dicts, junk),
    config=st.one_of(echo_configs(), echo_configs().map(lambda c: c.model_dump()), junk),
    prompt_len=maybe(st.integers(0, 12)),
    completion_len=maybe(st.integers(0, 4)),
    initial_prompt_len=maybe(st.none() | st.integers(0, 12)),
    seen_prefix_len=maybe(st.integers(0, 12)),
    data=st.data(),
)
def test_echo_weights(
    attribution, config, prompt_len, completion_len, initial_prompt_len, seen_prefix_len, data
):
    n = 0
    if isinstance(prompt_len, int) and isinstance(completion_len, int):
        n = min(max(prompt_len + completion_len, 0), 20)
    keep = data.draw(
        maybe(st.none() | st.lists(st.booleans(), min_size=max(n, 0), max_size=max(n, 0)))
    )
    names = ["prompt_len", "completion_len", "initial_prompt_len", "seen_prefix_len", "config",
             "keep", "echo filter", "EchoConfig", "alpha", "tool_names", "target",
             "max_tokens_per_message", "roles", "Extra inputs", "Input should"]  # fmt: skip
    weights = clear_error_or_result(
        lambda: echo_weights(
            attribution,
            config,
            prompt_len=prompt_len,
            completion_len=completion_len,
            keep=keep,
            initial_prompt_len=initial_prompt_len,
            seen_prefix_len=seen_prefix_len,
        ),
        names,
    )
    if weights is not None:
        assert len(weights) == prompt_len + completion_len
        assert all(w is None or (math.isfinite(w) and w > 0) for w in weights)


# -- steps, samples, interleave -----------------------------------------------------------------


@FUZZ
@given(
    prompt_ids=maybe(ids),
    completion_ids=maybe(ids),
    completion_logprobs=maybe(logprobs),
    completion_mask=maybe(st.none() | st.lists(st.booleans(), max_size=5)),
    temperature=maybe(st.floats(0.1, 2.0)),
    metadata=maybe(st.just({})),
)
def test_step(
    prompt_ids, completion_ids, completion_logprobs, completion_mask, temperature, metadata
):
    step = clear_error_or_result(
        lambda: Step(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            completion_logprobs=completion_logprobs,
            completion_mask=completion_mask,
            temperature=temperature,
            metadata=metadata,
        ),
        ["Step."],
    )
    if step is not None:
        assert (
            len(step.completion_logprobs) == len(step.completion_mask) == len(step.completion_ids)
        )
        assert_finite(step.completion_logprobs)
        assert 0 < step.temperature < math.inf


@FUZZ
@given(
    prompt_ids=maybe(ids),
    completion_ids=maybe(ids),
    data=st.data(),
    advantage=maybe(st.none() | st.floats(-2, 2)),
    env_name=maybe(st.sampled_from(["", "env"])),
)
def test_sample(prompt_ids, completion_ids, data, advantage, env_name):
    c = len(completion_ids) if isinstance(completion_ids, list) else 0
    n = c + (len(prompt_ids) if isinstance(prompt_ids, list) else 0)
    kwargs = {
        "completion_mask": data.draw(maybe(st.lists(st.booleans(), min_size=c, max_size=c))),
        "completion_logprobs": data.draw(maybe(st.lists(st.floats(-3, 0), min_size=c, max_size=c))),
        "completion_temperatures": data.draw(
            maybe(st.none() | st.lists(st.floats(0.5, 1.5), min_size=c, max_size=c))
        ),
        "echo_weights": data.draw(
            maybe(st.none() | st.lists(st.none() | st.floats(0.01, 2), min_size=n, max_size=n))
        ),
        "observation_mask": data.draw(
            maybe(st.none() | st.lists(st.booleans(), min_size=n, max_size=n))
        ),
    }
    s = clear_error_or_result(
        lambda: Sample(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            advantage=advantage,
            env_name=env_name,
            **kwargs,
        ),
        ["Sample."],
    )
    if s is not None:
        assert len(s) == n > 0


@FUZZ
@given(
    steps=st.one_of(maybe(trajectories()), trajectories().map(lambda t: t[0])),
    echo=st.one_of(st.none(), echo_configs(), echo_configs().map(lambda c: c.model_dump()), junk),
    errored=maybe(st.booleans()),
    env_name=maybe(st.sampled_from(["", "env"])),
    keep=st.one_of(st.none(), st.none(), junk),
)
def test_interleave(steps, echo, errored, env_name, keep):
    names = ["interleave", "echo", "keep", "errored", "env_name", "steps", "EchoConfig", "Input should",
             "Extra inputs", "alpha", "tool_names"]  # fmt: skip
    samples = clear_error_or_result(
        lambda: interleave(steps, echo=echo, errored=errored, env_name=env_name, keep=keep), names
    )
    for s in samples or []:
        assert_sample_ok(s)
        if s.echo_weights is not None and s.observation_mask is not None:
            for w, o in zip(s.echo_weights, s.observation_mask, strict=True):
                assert w is None or o  # every echoed token is an observation (docs/spec.md §2.4)


# -- packing and targets ------------------------------------------------------------------------


@FUZZ
@given(
    samples=maybe(st.lists(normal_form_samples(), min_size=1, max_size=4)),
    max_tokens=maybe(st.sampled_from([4, 8, 16])),
    pad_to_multiple_of=maybe(st.sampled_from([None, 2, 4])),
    pad_token_id=maybe(st.integers(0, 60)),
    truncate=maybe(st.booleans()),
    vocab_size=maybe(st.none() | st.integers(1, 80)),
)
def test_pack_and_targets(
    samples, max_tokens, pad_to_multiple_of, pad_token_id, truncate, vocab_size
):
    names = ["pack", "samples"]
    batches = clear_error_or_result(
        lambda: pack(
            samples,
            max_tokens=max_tokens,
            pad_to_multiple_of=pad_to_multiple_of,
            pad_token_id=pad_token_id,
            truncate=truncate,
            vocab_size=vocab_size,
        ),
        names,
    )
    for b in batches or []:
        assert len(b) <= max_tokens
        for t in (b.echo_weights, b.advantages, b.inference_logprobs, b.temperatures):
            assert bool(torch.isfinite(t).all())
        assert bool((b.temperatures > 0).all())
        assert not bool((b.rl_mask & (b.echo_weights > 0)).any())
        targets = next_token_targets(b)
        assert all(
            x.shape == (len(b),)
            for x in (
                targets.labels,
                targets.sequence_ids,
                targets.advantages,
                *targets.streams.values(),
            )
        )
        assert not bool(targets.rl_mask[-1]) and float(targets.echo_weights[-1]) == 0.0


@FUZZ
@given(junk)
def test_next_token_targets_rejects_anything_but_a_batch(value):
    clear_error_or_result(lambda: next_token_targets(value), ["batch"])


# -- advantages ---------------------------------------------------------------------------------


@FUZZ
@given(
    rewards=maybe(st.lists(st.floats(-10, 10), min_size=1, max_size=6)),
    data=st.data(),
    fn=maybe(st.sampled_from(["grpo", "dr_grpo", "rloo", "max_rl", "reinforce"])),
    fn_kwargs=st.one_of(st.none(), st.none(), junk),
    drop_group_on_error=maybe(st.booleans()),
)
def test_compute_advantages(rewards, data, fn, fn_kwargs, drop_group_on_error):
    n = len(rewards) if isinstance(rewards, list) else 0
    group_ids = data.draw(
        maybe(st.none() | st.lists(st.sampled_from(["a", "b", 1]), min_size=n, max_size=n))
    )
    errored = data.draw(maybe(st.none() | st.lists(st.booleans(), min_size=n, max_size=n)))
    length_costs = data.draw(
        st.one_of(st.none(), st.none(), st.lists(st.floats(0, 100), min_size=n, max_size=n), junk)
    )
    names = ["rewards", "group_ids", "errored", "advantage fn", "drop_group_on_error", "fn_kwargs",
             "length_costs", "costs", "fn"]  # fmt: skip
    out = clear_error_or_result(
        lambda: compute_advantages(
            rewards,
            group_ids,
            fn=fn,
            errored=errored,
            drop_group_on_error=drop_group_on_error,
            fn_kwargs=fn_kwargs,
            length_costs=length_costs,
        ),
        names,
    )
    if out is not None:
        assert len(out) == n
        assert_finite(out)


# -- file formats and adapters ------------------------------------------------------------------


def _rollout_record(draw: Any) -> dict[str, Any]:
    p, c = draw(ids), draw(ids)
    record: dict[str, Any] = {
        "schema_version": draw(maybe(st.just(1))),
        "group_id": draw(maybe(st.just("g"))),
        "reward": draw(maybe(st.floats(-1, 1))),
        "steps": [
            {
                "prompt_ids": draw(maybe(st.just(p))),
                "completion_ids": c,
                "completion_logprobs": draw(
                    maybe(st.lists(st.floats(-3, 0), min_size=len(c), max_size=len(c)))
                ),
            }
        ],
    }
    for key in draw(
        st.lists(st.sampled_from(["temperature", "error", "env_name", "bogus"]), max_size=2)
    ):
        record[key] = draw(junk)
    return record


@FUZZ
@given(st.data())
def test_read_rollouts(data):
    record = _rollout_record(data.draw)
    try:
        line = json.dumps(record, allow_nan=True)
    except (TypeError, ValueError):
        return
    records = clear_error_or_result(lambda: read_rollouts([line]), ["line 1"])
    for r in records or []:
        for s in r.to_samples(echo=EchoConfig(tool=RoleEcho(alpha=0.5))):
            assert_sample_ok(s)


@FUZZ
@given(
    input_ids=maybe(st.lists(st.integers(0, 9), min_size=1, max_size=5)),
    data=st.data(),
    world_model_coeff=maybe(st.floats(0, 1)),
    world_loss_target=maybe(st.sampled_from(["env_only", "all"])),
    temperature=maybe(st.floats(0.1, 2)),
    extra=st.dictionaries(
        st.sampled_from(["warnings_mask", "logprobs", "bogus"]), junk, max_size=1
    ),
)
def test_openenv_records(input_ids, data, world_model_coeff, world_loss_target, temperature, extra):
    n = len(input_ids) if isinstance(input_ids, list) else 0
    action = data.draw(
        maybe(st.lists(st.sampled_from([0, 1, True, False]), min_size=n, max_size=n))
    )
    obs = data.draw(maybe(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)))
    record = {"input_ids": input_ids, "action_mask": action, "obs_mask": obs, **extra}
    names = ["input_ids", "action_mask", "obs_mask", "warning_mask", "logprobs", "world_model_coeff",
             "world_loss_target", "temperature", "record", "token ", "Sample."]  # fmt: skip
    s = clear_error_or_result(
        lambda: sample_from_record(
            record,
            world_model_coeff=world_model_coeff,
            world_loss_target=world_loss_target,
            temperature=temperature,
        ),
        names,
    )
    if s is not None:
        assert_sample_ok(s)
    clear_error_or_result(
        lambda: sample_from_tags(
            input_ids, action_mask=action, obs_mask=obs, world_model_coeff=world_model_coeff
        ),
        names,
    )


@FUZZ
@given(st.data())
def test_verifiers_rollout_dicts(data):
    p, c = data.draw(ids), data.draw(ids)
    rollout = {
        "error": data.draw(st.one_of(st.none(), st.sampled_from([False, "", {}, "boom"]), junk)),
        "sampling_args": data.draw(st.one_of(st.none(), st.just({"temperature": 0.7}), junk)),
        "trajectory": [
            {
                "tokens": {
                    "prompt_ids": data.draw(maybe(st.just(p))),
                    "completion_ids": c,
                    "completion_mask": data.draw(
                        maybe(st.lists(st.sampled_from([0, 1]), min_size=len(c), max_size=len(c)))
                    ),
                    "completion_logprobs": data.draw(
                        maybe(st.lists(st.floats(-3, 0), min_size=len(c), max_size=len(c)))
                    ),
                    "prompt_attribution": data.draw(st.one_of(st.none(), attribution_dicts)),
                }
            }
        ],
    }
    names = ["rollout", "trajectory", "error", "temperature", "Step.", "Input should"]
    for s in (
        clear_error_or_result(
            lambda: samples_from_rollout(rollout, echo=EchoConfig(tool=RoleEcho(alpha=0.5))), names
        )
        or []
    ):
        assert_sample_ok(s)


@FUZZ
@given(st.data())
def test_verifiers_traces(data):
    n0, n1 = data.draw(st.integers(0, 3)), data.draw(st.integers(1, 3))
    mask1 = data.draw(st.lists(st.booleans(), min_size=n1, max_size=n1))
    record = {
        "version": data.draw(maybe(st.just(1))),
        "ok": data.draw(st.one_of(st.booleans(), junk)),
        "nodes": [
            {"message": {"role": data.draw(st.sampled_from(["user", "tool", "toool"]))},
             "token_ids": data.draw(maybe(st.lists(st.integers(0, 9), min_size=n0, max_size=n0))),
             "mask": [False] * n0},
            {"parent": data.draw(maybe(st.just(0))), "sampled": True,
             "message": {"role": "assistant"},
             "token_ids": list(range(n1)), "mask": mask1,
             "logprobs": data.draw(maybe(st.lists(st.floats(-3, 0), min_size=sum(mask1), max_size=sum(mask1))))},
        ],
    }  # fmt: skip
    names = ["trace", "nodes", "ok", "version", "Step.", "Input should", "errored"]
    for s in (
        clear_error_or_result(
            lambda: samples_from_trace(record, echo=EchoConfig(tool=RoleEcho(alpha=0.5))), names
        )
        or []
    ):
        assert_sample_ok(s)


def _tensor_or_raw(value: Any, dtype: torch.dtype) -> Any:
    """A tensor when the drawn value converts cleanly (the library's input), else the raw value."""
    try:
        t = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return value
    return t.to(dtype) if t.dtype in (torch.bool, torch.int64) and t.dim() >= 1 else value


@FUZZ
@given(
    advantages=maybe(st.lists(st.none() | st.floats(-3, 3), min_size=2, max_size=2)),
    rows=maybe(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=2, max_size=2)),
    packed=maybe(st.sampled_from([[0, 1, 3], [0, 3, 3], [0, 2, 3]])),
)
def test_broadcast_advantages(advantages, rows, packed):
    from echoloss import broadcast_advantages, broadcast_packed_advantages

    names = ["advantages", "rl_mask", "cu_seqlens"]
    mask = _tensor_or_raw(rows, torch.bool)
    out = clear_error_or_result(lambda: broadcast_advantages(advantages, mask), names)
    if out is not None:
        assert out.shape == mask.shape and bool(torch.isfinite(out).all())
    cu = _tensor_or_raw(packed, torch.int32)
    flat = mask.reshape(-1)[:3] if isinstance(mask, torch.Tensor) else mask
    out = clear_error_or_result(lambda: broadcast_packed_advantages(advantages, cu, flat), names)
    if out is not None:
        assert out.shape == (3,) and bool(torch.isfinite(out).all())


@FUZZ
@given(
    decay=maybe(st.floats(0, 0.99)),
    order=maybe(st.sampled_from(["score_then_update", "update_then_score"])),
    keys=maybe(st.lists(st.sampled_from(["a", ("env", 1), 3]), min_size=3, max_size=3)),
    rewards=maybe(st.lists(st.none() | st.floats(-5, 5), min_size=3, max_size=3)),
    errored=maybe(st.none() | st.lists(st.booleans(), min_size=3, max_size=3)),
)
def test_rae(decay, order, keys, rewards, errored):
    from echoloss import RAE

    names = ["decay", "order", "keys", "rewards", "errored", "reward", "key"]
    rae = clear_error_or_result(lambda: RAE(decay=decay, order=order), names)
    if rae is None:
        return
    out = clear_error_or_result(lambda: rae.advantages(keys, rewards, errored=errored), names)
    if out is not None:
        assert len(out) == len(keys)  # one advantage per rollout (none for an empty batch)
        assert_finite(out)
        assert RAE.from_state_dict(json.loads(json.dumps(rae.state_dict()))).state_dict() == (
            rae.state_dict()
        )


@FUZZ
@given(
    message_indices=maybe(st.lists(st.integers(-1, 1), max_size=3)),
    is_content=maybe(st.lists(st.booleans(), max_size=3)),
    message_roles=maybe(st.lists(st.sampled_from(["user", "tool"]), min_size=2, max_size=2)),
    message_tool_names=maybe(st.none() | st.lists(st.none() | st.just("ls"), max_size=3)),
    is_warning=maybe(st.none() | st.lists(st.booleans(), max_size=3)),
)
def test_token_attribution(
    message_indices, is_content, message_roles, message_tool_names, is_warning
):
    att = clear_error_or_result(
        lambda: TokenAttribution(
            message_indices=message_indices,
            is_content=is_content,
            message_roles=message_roles,
            message_tool_names=message_tool_names,
            is_warning=is_warning,
        ),
        ["TokenAttribution"],
    )
    if att is not None:
        assert isinstance(att.message_indices, tuple) and hash(att) == hash(att)
