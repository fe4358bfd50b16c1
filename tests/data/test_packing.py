"""Packing, truncation, unpacking and the next-token view (docs/spec.md §7-§9, F5-F7)."""

import dataclasses
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import normal_form_samples, trajectories

from echoloss import (
    EchoConfig,
    RoleEcho,
    Sample,
    interleave,
    next_token_targets,
    pack,
    unpack,
)
from echoloss.data.packing import truncate_sample


def sample(p, c, *, mask=None, echo=None, obs=None, adv=1.0, env="", temps=None, lp=None):
    return Sample(
        prompt_ids=list(p),
        completion_ids=list(c),
        completion_mask=mask if mask is not None else [True] * len(c),
        completion_logprobs=lp if lp is not None else [-0.5] * len(c),
        completion_temperatures=temps,
        echo_weights=echo,
        observation_mask=obs,
        advantage=adv,
        env_name=env,
    )


def test_golden_a_overlay():
    # docs/spec.md §13 A (weight 0 is rejected, see the next test):
    # index 0 is ignored; completion token 3 becomes echo and leaves RL; token 4 stays RL.
    s = sample([1, 2], [3, 4], mask=[True, True], echo=[0.5, 0.125, 0.25, None], adv=1.0)
    [b] = pack([s], max_tokens=4)
    assert b.echo_weights.tolist() == [0.0, 0.125, 0.25, 0.0]
    assert b.rl_mask.tolist() == [False, False, False, True]
    assert b.advantages.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert b.rl_mask.logical_and(b.echo_weights > 0).sum() == 0


def test_golden_a_zero_weight_is_an_error():
    with pytest.raises(
        ValueError, match=r"echo_weights\[1\] must be a finite float > 0, or None .*got float 0.0"
    ):
        sample([1, 2], [3, 4], echo=[0.5, 0.0, 0.25, None])


def test_position_zero_ignored_and_warned_once(caplog):
    with caplog.at_level(logging.WARNING, logger="echoloss"):
        [b] = pack(
            [sample([1], [2], echo=[0.5, None]), sample([3], [4], echo=[0.5, None])], max_tokens=8
        )
    assert b.echo_weights.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert len([r for r in caplog.records if "position 0" in r.message]) == 1


def test_packed_boundary_rows_predict_nothing():
    # docs/spec.md F5: the last row of a sequence must not be trained to predict the next sequence's token 0.
    a = sample([1, 2], [3], echo=[None, 0.5, None], obs=[False, True, False], adv=2.0)
    b = sample([4], [5, 6], adv=-1.0)
    [batch] = pack([a, b], max_tokens=8, pad_to_multiple_of=4)
    t = next_token_targets(batch)
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert t.labels.tolist() == [2, 3, 0, 5, 6, 0, 0, 0]
    assert t.rl_mask.tolist() == [False, True, False, True, True, False, False, False]
    assert t.echo_weights.tolist() == [0.5, 0, 0, 0, 0, 0, 0, 0]
    assert t.observation_mask.tolist() == [True] + [False] * 7
    assert t.advantages.tolist() == [0.0, 2.0, 0.0, -1.0, -1.0, 0.0, 0.0, 0.0]
    assert t.sequence_ids.tolist() == [0, 0, 0, 1, 1, 1, -1, -1]


def test_misaligned_echo_stream_is_an_error():
    # docs/spec.md F6
    with pytest.raises(ValueError, match=r"echo_weights has length 3, expected 4"):
        sample([1, 2], [3, 4], echo=[None, 0.5, None])
    s = sample([1, 2], [3, 4])
    s.echo_weights = [None, 0.5, None]  # mutated after construction: pack re-validates
    with pytest.raises(ValueError, match=r"samples\[0\].echo_weights has length 3, expected 4"):
        pack([s], max_tokens=8)


@pytest.mark.parametrize("order", ["plain_first", "echo_first"])
def test_optional_streams_backfilled_in_mixed_bins(order):
    # docs/spec.md F7: a bin mixing samples with and without echo / observation / temperatures stays aligned.
    plain = sample([1, 2], [3], adv=1.0)
    echoed = sample(
        [4, 5],
        [6, 7],
        echo=[None, 0.5, None, None],
        obs=[False, True, True, False],
        temps=[0.7, 0.7],
        adv=-1.0,
    )
    samples = [plain, echoed] if order == "plain_first" else [echoed, plain]
    [b] = pack(samples, max_tokens=16)
    segs = dict(zip(b.sample_indices, b.cu_seqlens.tolist(), strict=False))
    e = segs[samples.index(echoed)]
    p = segs[samples.index(plain)]
    assert b.input_ids[e : e + 4].tolist() == [4, 5, 6, 7]
    assert b.echo_weights[e : e + 4].tolist() == [0.0, 0.5, 0.0, 0.0]
    assert b.observation_mask[e : e + 4].tolist() == [False, True, True, False]
    assert b.temperatures[e : e + 4].tolist() == pytest.approx([0.7] * 4)
    assert b.input_ids[p : p + 3].tolist() == [1, 2, 3]
    assert b.echo_weights[p : p + 3].tolist() == [0.0] * 3
    assert b.observation_mask[p : p + 3].tolist() == [False] * 3
    assert b.temperatures[p : p + 3].tolist() == [1.0] * 3
    for stream in (
        b.position_ids,
        b.rl_mask,
        b.echo_weights,
        b.observation_mask,
        b.advantages,
        b.inference_logprobs,
        b.temperatures,
    ):
        assert stream.shape == b.input_ids.shape


def test_over_long_sample_is_an_error_unless_truncating():
    s = sample([1, 2, 3], [4, 5, 6], echo=[None, None, 0.5, None, 0.25, None], adv=1.0)
    with pytest.raises(
        ValueError, match="has 6 tokens > max_tokens=4; raise max_tokens, or pass truncate=True"
    ):
        pack([s], max_tokens=4)
    [b] = pack([s], max_tokens=4, truncate=True)
    assert b.input_ids.tolist() == [1, 2, 3, 4]
    assert b.echo_weights.tolist() == [0.0, 0.0, 0.5, 0.0]
    assert b.rl_mask.tolist() == [False, False, False, True]


def test_truncation_inside_the_prompt_empties_the_completion():
    s = sample(
        [1, 2, 3], [4], echo=[None, 0.5, 0.5, None], obs=[False, True, True, False], temps=[0.5]
    )
    t = truncate_sample(s, 2)
    assert t.prompt_ids == [1, 2] and t.completion_ids == [] and t.completion_temperatures == []
    assert t.echo_weights == [None, 0.5] and t.observation_mask == [False, True]


def test_rl_tokens_need_an_advantage():
    s = sample([1], [2], adv=None)
    with pytest.raises(ValueError, match="has 1 RL tokens but advantage=None"):
        pack([s], max_tokens=4)
    pack([sample([1], [2], mask=[False], adv=None)], max_tokens=4)  # nothing to weight: fine


def test_pad_multiple_must_divide_budget():
    with pytest.raises(ValueError, match="pad_to_multiple_of=3 must divide max_tokens=8"):
        pack([sample([1], [2])], max_tokens=8, pad_to_multiple_of=3)


def test_reserved_env_name():
    with pytest.raises(ValueError, match="env_name 'all' is reserved"):
        sample([1], [2], env="all")


def test_first_fit_decreasing_bins():
    lens = [5, 3, 4, 2, 2]
    samples = [sample([1] * (n - 1), [2], adv=0.0) for n in lens]
    batches = pack(samples, max_tokens=8)
    # FFD: 5 -> bin0; 4 -> bin1; 3 -> bin0 (5+3); 2 -> bin1 (4+2); 2 -> bin1 (6+2)
    assert [b.sample_indices for b in batches] == [(0, 1), (2, 3, 4)]
    assert [len(b) for b in batches] == [8, 8]


# -- properties ---------------------------------------------------------------------------------


@given(
    st.lists(normal_form_samples(), min_size=1, max_size=8),
    st.sampled_from([12, 16, 24]),
    st.sampled_from([None, 4]),
)
def test_pack_then_unpack_returns_the_samples(samples, max_tokens, pad):
    batches = pack(samples, max_tokens=max_tokens, pad_to_multiple_of=pad, truncate=True)
    recovered = {}
    for b in batches:
        assert len(b) <= max_tokens
        if pad:
            assert len(b) % pad == 0
        n = len(b)
        for stream in (
            b.position_ids,
            b.rl_mask,
            b.echo_weights,
            b.observation_mask,
            b.advantages,
            b.inference_logprobs,
            b.temperatures,
        ):
            assert stream.shape == (n,)
        assert int(b.cu_seqlens[-1]) == n
        assert not bool((b.rl_mask & (b.echo_weights > 0)).any())
        assert bool((b.observation_mask | ~(b.echo_weights > 0)).all())
        starts = b.cu_seqlens[:-1].long()
        assert b.position_ids[starts].eq(0).all()
        assert not b.rl_mask[starts].any() and b.echo_weights[starts].eq(0).all()
        t = next_token_targets(b)
        assert all(
            x.shape == (n,) for x in (t.labels, t.sequence_ids, t.advantages, *t.streams.values())
        )
        # Within a segment, row j predicts token j + 1.
        for k in range(len(b.sample_indices)):
            lo, hi = int(b.cu_seqlens[k]), int(b.cu_seqlens[k + 1])
            assert t.labels[lo : hi - 1].tolist() == b.input_ids[lo + 1 : hi].tolist()
        for idx, s in unpack(b):
            recovered[idx] = s
    assert sorted(recovered) == list(range(len(samples)))
    for i, s in enumerate(samples):
        expected = truncate_sample(s, max_tokens)
        assert recovered[i] == expected


@given(trajectories(), st.booleans(), st.booleans())
def test_interleave_streams_aligned_and_rl_echo_disjoint(steps, skip_initial, assistant):
    cfg = EchoConfig(
        tool=RoleEcho(alpha=0.5),
        user=RoleEcho(alpha=0.25),
        assistant=RoleEcho(alpha=1.0) if assistant else None,
        skip_initial_prompt=skip_initial,
    )
    samples = interleave(steps, echo=cfg)
    assert sum(len(s.completion_ids) for s in samples) >= sum(
        len(st_.completion_ids) for st_ in steps
    )
    for s in samples:
        n = len(s)
        c = len(s.completion_ids)
        assert (
            len(s.completion_mask)
            == len(s.completion_logprobs)
            == len(s.completion_temperatures)
            == c
        )
        rl = s.rl_mask()
        echo = s.token_echo_weights()
        obs = s.token_observation_mask()
        assert len(rl) == len(echo) == len(obs) == n
        assert not any(r and w > 0 for r, w in zip(rl, echo, strict=True))
        assert rl == [False] * len(s.prompt_ids) + s.completion_mask or not s.prompt_ids
        assert echo[0] == 0.0 and not rl[0]
        s.advantage = 0.5
    batches = pack(samples, max_tokens=64, truncate=True)
    assert sum(b.num_sequences for b in batches) == len(samples)


def test_sample_rl_mask_clears_position_zero():
    # docs/spec.md §7, F5: a sample without a prompt has its first completion token at position 0.
    s = sample([], [5, 6, 7], mask=[True, True, True])
    assert s.rl_mask() == [False, True, True]
    assert s.num_rl_tokens == 2
    [b] = pack([s], max_tokens=4)
    assert b.rl_mask.tolist() == [False, True, True]
    assert next_token_targets(b).rl_mask.tolist() == [True, True, False]


def test_targets_reject_a_trained_segment_start():
    # docs/spec.md §7: next_token_targets checks position 0 itself instead of trusting the batch.
    [b] = pack([sample([1], [2, 3]), sample([4], [5])], max_tokens=8)
    start = int(b.cu_seqlens[1])
    for name, value in (("rl_mask", True), ("echo_weights", 0.5), ("observation_mask", True)):
        stream = getattr(b, name).clone()
        stream[start] = value
        bad = dataclasses.replace(b, streams={**b.streams, name: stream})
        with pytest.raises(ValueError, match=rf"batch.{name}\[{start}\] marks the first token"):
            next_token_targets(bad)
    with pytest.raises(TypeError, match=r"batch must be an echoloss\.PackedBatch"):
        next_token_targets([b])


def test_zero_advantage_sample_keeps_its_echo():
    # docs/spec.md §11.4, F11: an equal-reward group gives advantage 0; the echo is still trained.
    s = sample([1, 2], [3, 4], echo=[None, 0.5, None, None], adv=0.0)
    [b] = pack([s], max_tokens=4)
    assert b.echo_weights.tolist() == [0.0, 0.5, 0.0, 0.0]
    assert b.advantages.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_truncation_inside_the_prompt_keeps_the_temperature():
    # docs/spec.md §8.4, F28: the remaining prompt tokens keep the sample's sampling temperature.
    s = sample([1, 2, 3], [4, 5], temps=[0.5, 0.5])
    [b] = pack([s], max_tokens=2, truncate=True)
    assert b.input_ids.tolist() == [1, 2]
    assert b.temperatures.tolist() == [0.5, 0.5]


def test_weight_that_underflows_float32_is_rejected():
    # docs/spec.md §2.3, F29: 1e-50 would be stored as 0.0 by float32 packing and train nothing.
    with pytest.raises(ValueError, match=r"echo_weights\[1\] must be an echo weight in \[1.18e-38"):
        sample([1, 2], [3], echo=[None, 1e-50, None])
    with pytest.raises(ValueError, match="overflow to inf"):
        sample([1, 2], [3], echo=[None, 1e39, None])
    tiny = 2.0**-126  # the smallest normal float32 is kept exactly
    [b] = pack([sample([1, 2], [3], echo=[None, tiny, None])], max_tokens=4)
    assert b.echo_weights[1].item() == tiny


def test_pack_argument_errors_name_the_argument():
    s = sample([1], [2])
    with pytest.raises(TypeError, match=r"pad_token_id must be an int >= 0, got float 1.7"):
        pack([s], max_tokens=4, pad_to_multiple_of=4, pad_token_id=1.7)
    with pytest.raises(TypeError, match=r"pad_to_multiple_of must be an int >= 1, got str '4'"):
        pack([s], max_tokens=4, pad_to_multiple_of="4")
    with pytest.raises(TypeError, match=r"samples must be a list of echoloss.Sample.*wrap it"):
        pack(s, max_tokens=4)
    with pytest.raises(TypeError, match=r"truncate must be a bool"):
        pack([s], max_tokens=4, truncate="yes")
    with pytest.raises(
        ValueError, match=r"token_ids\[1\] must be a token id in \[0, vocab_size=2\)"
    ):
        pack([s], max_tokens=4, vocab_size=2)
    with pytest.raises(ValueError, match=r"pad_token_id must be < vocab_size=3"):
        pack([s], max_tokens=4, pad_token_id=3, vocab_size=3)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\] must be a token id"):
        sample([-5], [2])
    with pytest.raises(ValueError, match=r"completion_logprobs\[0\] must be a log-probability"):
        sample([1], [2], lp=[2.3])


def test_observation_at_position_zero_is_cleared():
    # docs/spec.md §7: position 0 is never an observation either (it would count in Z = |O|).
    s = sample([1], [2], mask=[False], echo=[None, 0.5], obs=[True, True])
    assert s.token_observation_mask() == [False, True]
    [b] = pack([s], max_tokens=2)
    assert b.observation_mask.tolist() == [False, True]
    assert next_token_targets(b).observation_mask.tolist() == [True, False]
