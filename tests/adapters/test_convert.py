"""Converters from echoloss samples to verl / rLLM / OpenEnv per-token fields, and back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from echoloss import LossConfig, Sample, echo_loss_from_logprobs
from echoloss.adapters.convert import openenv_tags, rllm_echo_weights, verl_fields
from echoloss.adapters.openenv import sample_from_tags


@st.composite
def _tags(draw):
    n = draw(st.integers(2, 12))
    roles = draw(st.lists(st.sampled_from("aowc"), min_size=n, max_size=n))  # action/obs/warn/ctx
    roles[0] = draw(st.sampled_from("ac"))  # position 0 is never an observation
    lam = draw(st.sampled_from([0.0, 0.05, 1.0]))
    lp = draw(st.lists(st.floats(-5, 0), min_size=n, max_size=n))
    return dict(
        input_ids=list(range(10, 10 + n)),
        action_mask=[r == "a" for r in roles],
        obs_mask=[r == "o" for r in roles],
        warning_mask=[r == "w" for r in roles],
        world_model_coeff=lam,
        logprobs=[v if r == "a" else 0.0 for v, r in zip(lp, roles, strict=True)],
        temperature=draw(st.sampled_from([1.0, 0.7])),
    )


def _meaning(s):
    """What a loss reads from a sample. ``Z = |O|`` only matters when a token is echoed (a
    sample without an echoed token has no λ to carry, and converts with λ = 0)."""
    echoed = any(s.token_echo_weights())
    z = s.token_observation_mask() if echoed else None
    return (s.prompt_ids, s.completion_ids, s.rl_mask(), s.token_echo_weights(), z,
            s.completion_logprobs, s.completion_temperatures)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(_tags())
def test_openenv_round_trip(tags):
    """tags → Sample → tags → Sample gives the same Sample, and the tags the same roles."""
    first = sample_from_tags(**tags)
    back = openenv_tags(first)
    assert _meaning(sample_from_tags(**back)) == _meaning(first)
    assert back["input_ids"] == tags["input_ids"]
    assert back["action_mask"] == tags["action_mask"]
    if tags["world_model_coeff"] > 0 and any(tags["obs_mask"]):
        assert back["obs_mask"] == tags["obs_mask"]
        assert back["warning_mask"] == tags["warning_mask"]


def _samples():
    a = Sample(prompt_ids=[1, 2], completion_ids=[3, 4, 5, 6, 7],
               completion_mask=[True, False, False, False, True],
               completion_logprobs=[-0.5, 0.0, 0.0, 0.0, -0.2],
               echo_weights=[None, None, None, 0.5, 0.5, None, None],
               observation_mask=[False, False, False, True, True, True, False])  # fmt: skip
    b = Sample(prompt_ids=[1], completion_ids=[3, 4, 5], completion_mask=[True, False, True],
               completion_logprobs=[-0.3, 0.0, -0.1], echo_weights=[None, None, 0.5, None])  # fmt: skip
    return [a, b]


def test_verl_fields_are_the_response_rows():
    a, _ = _samples()
    f = verl_fields(a)
    assert f["prompts"] == [1, 2] and f["responses"] == [3, 4, 5, 6, 7]
    assert f["response_mask"] == [1, 0, 0, 0, 1]
    assert f["echo_weights"] == [0.0, 0.5, 0.5, 0.0, 0.0]
    assert f["aux_token_loss_mask"] == [0, 1, 1, 0, 0] and f["aux_token_loss_coef"] == 0.5
    plain = Sample(prompt_ids=[1], completion_ids=[2], completion_mask=[True],
                   completion_logprobs=[-0.1])  # fmt: skip
    assert verl_fields(plain)["aux_token_loss_coef"] is None


def test_verl_fields_refuse_what_they_cannot_carry():
    on_prompt = Sample(prompt_ids=[1, 2], completion_ids=[3], completion_mask=[True],
                       completion_logprobs=[-0.1], echo_weights=[None, 0.5, None])  # fmt: skip
    with pytest.raises(ValueError, match="prompt token"):
        verl_fields(on_prompt)
    mixed = Sample(prompt_ids=[1], completion_ids=[2, 3], completion_mask=[False, False],
                   completion_logprobs=[0.0, 0.0], echo_weights=[None, 0.5, 0.1])  # fmt: skip
    with pytest.raises(ValueError, match="differ"):
        verl_fields(mixed)
    with pytest.raises(ValueError, match="differ"):
        openenv_tags(mixed)
    with pytest.raises(TypeError, match=r"echoloss\.Sample"):
        verl_fields({"prompt_ids": [1]})


def test_rllm_weights_summed_equal_the_sequence_mean_normaliser():
    """Σ_t w_t · (-log p_t) with w = λ/(n_seq·|O_i|) = echo_normalization='sequence_mean'."""
    samples = _samples()
    weights = rllm_echo_weights(samples)
    # a: |O| = 3 (observation_mask), b: |O| = 1 (the echoed token), n_seq = 2
    assert weights[0][3:5] == [0.5 / 6, 0.5 / 6] and weights[1][2] == 0.5 / 2
    g = torch.Generator().manual_seed(0)
    total = 0.0
    lps, ws, obs, seq = [], [], [], []
    for i, (s, w) in enumerate(zip(samples, weights, strict=True)):
        lp = -torch.rand(len(s), generator=g, dtype=torch.float64)
        total += float((torch.tensor(w, dtype=torch.float64) * -lp).sum())
        lps.append(lp)
        ws.append(torch.tensor(s.token_echo_weights(), dtype=torch.float64))
        obs.append(torch.tensor(s.token_observation_mask()))
        seq.append(torch.full((len(s),), i))
    ours = echo_loss_from_logprobs(
        torch.cat(lps), rl_mask=torch.zeros(sum(map(len, samples)), dtype=torch.bool),
        echo_weights=torch.cat(ws), observation_mask=torch.cat(obs), sequence_ids=torch.cat(seq),
        config=LossConfig(echo_normalization="sequence_mean"),
    ).loss  # fmt: skip
    assert abs(float(ours) - total) <= 1e-12  # float64, same terms in another order
