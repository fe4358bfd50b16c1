"""echoloss samples → the per-token fields other stacks consume, and back.

Each converter says which normaliser its fields imply, so that a λ means the same thing on both
sides (``docs/guides/verl.md`` and ``docs/normalization.md`` have the tables):

- [`verl_fields`][echoloss.adapters.convert.verl_fields]: verl's response fields plus the echo
  weights and the auxiliary-mask + coefficient pair proposed for verl's agent loop
  (``aux_token_loss_mask``, ``aux_token_loss_coef``). With
  [`register_echo_policy_loss`][echoloss.adapters.verl.register_echo_policy_loss] the echo term is
  normalised by verl's ``loss_agg_mode`` over the echo tokens: ``token-mean`` =
  ``LossConfig(echo_normalization="token_mean")``.
- [`rllm_echo_weights`][echoloss.adapters.convert.rllm_echo_weights]: rLLM-style per-token
  weights ``λ / (n_seq · |O_i|)``, to be **summed**: the ECHO paper's per-sequence mean,
  ``echo_normalization="sequence_mean"`` with every sequence of the batch counted.
- [`openenv_tags`][echoloss.adapters.convert.openenv_tags]: OpenEnv RFC 010 role masks and
  ``world_model_coeff``, the inverse of
  [`sample_from_tags`][echoloss.adapters.openenv.sample_from_tags]; the normaliser stays the
  consumer's choice (OpenEnv's examples: a batch token mean, ``"batch_token_mean"``).

Nothing is dropped: a field that cannot carry what the sample holds is an error naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from echoloss import Sample

__all__ = ["openenv_tags", "rllm_echo_weights", "verl_fields"]


def _check_sample(sample: Any, name: str = "sample") -> Sample:
    if not isinstance(sample, Sample):
        raise TypeError(f"{name}: expected an echoloss.Sample, got {type(sample).__name__}")
    return sample


def _uniform(values: Sequence[float], what: str) -> float | None:
    distinct = sorted(set(values))
    if len(distinct) > 1:
        raise ValueError(
            f"{what}: the sample's echo weights differ ({distinct[0]} … {distinct[-1]}); a single "
            "coefficient cannot carry them: use the per-token weights instead"
        )
    return distinct[0] if distinct else None


def verl_fields(sample: Sample) -> dict[str, Any]:
    """verl's per-response-token fields of one sample, with the echo term's.

    verl trains the response (``completion_ids``) only, each token predicted from everything
    before it, exactly as echoloss's completion rows.

    Args:
        sample: an [`echoloss.Sample`][echoloss.Sample].

    Returns:
        ``prompts`` ``[P]``, ``responses`` ``[C]``, ``response_mask`` ``[C]`` (1 = RL; echoed
        tokens are 0), ``echo_weights`` ``[C]`` (λ, 0.0 = not echoed; the field read by
        [`echo_ppo_loss`][echoloss.adapters.verl.echo_ppo_loss]), ``aux_token_loss_mask``
        ``[C]`` (1 = echoed) and ``aux_token_loss_coef`` (the λ shared by every echoed token;
        None without echo).

    Raises:
        ValueError: an echo weight on a prompt token (verl would never train it), or echo
            weights that differ within the sample (the coefficient form cannot carry them).

    Examples:
        >>> s = Sample(prompt_ids=[1, 2], completion_ids=[3, 4, 5],
        ...            completion_mask=[True, False, True], completion_logprobs=[-0.1, 0.0, -0.2],
        ...            echo_weights=[None, None, None, 0.05, None])
        >>> f = verl_fields(s)
        >>> f["response_mask"], f["echo_weights"], f["aux_token_loss_mask"], f["aux_token_loss_coef"]
        ([1, 0, 1], [0.0, 0.05, 0.0], [0, 1, 0], 0.05)
    """
    sample = _check_sample(sample)
    p = len(sample.prompt_ids)
    weights = sample.token_echo_weights()
    if any(w > 0 for w in weights[:p]):
        k = next(i for i, w in enumerate(weights[:p]) if w > 0)
        raise ValueError(
            f"sample.echo_weights[{k}] = {weights[k]} is on a prompt token; verl trains the "
            "response only. Move the echoed turns into the completion (echoloss.interleave) or "
            "drop their weights explicitly"
        )
    rl = sample.rl_mask()[p:]
    echo = weights[p:]
    coef = _uniform([w for w in echo if w > 0], "aux_token_loss_coef") if any(echo) else None
    return {
        "prompts": list(sample.prompt_ids),
        "responses": list(sample.completion_ids),
        "response_mask": [int(m) for m in rl],
        "echo_weights": echo,
        "aux_token_loss_mask": [int(w > 0) for w in echo],
        "aux_token_loss_coef": coef,
    }


def rllm_echo_weights(samples: Sequence[Sample]) -> list[list[float]]:
    """Per-token echo weights ``λ_t / (n_seq · |O_i|)`` over each sample's ``[P + C]`` tokens.

    Summed over a batch of ``n_seq`` samples they give the ECHO paper's objective
    ``(1 / n_seq) Σ_i (1 / |O_i|) Σ_{t ∈ O'_i} λ_t · (-log p_t)`` with ``|O_i|`` the observation
    tokens of sample ``i`` (``observation_mask``, warnings included; the echoed tokens when it
    is None). That is ``LossConfig(echo_normalization="sequence_mean")`` when every sample has
    an echo token; echoloss divides by the sequences that have one, these weights by all.

    Args:
        samples: the batch (every sample counts in ``n_seq``).

    Returns:
        One ``[P + C]`` list per sample (0.0 = not echoed).

    Examples:
        >>> a = Sample(prompt_ids=[1], completion_ids=[2, 3, 4], completion_mask=[True, False, False],
        ...            completion_logprobs=[-0.1, 0.0, 0.0], echo_weights=[None, None, 0.5, 0.5])
        >>> b = Sample(prompt_ids=[1], completion_ids=[2], completion_mask=[True],
        ...            completion_logprobs=[-0.1])
        >>> rllm_echo_weights([a, b])  # 0.5 / (2 sequences · |O| = 2 tokens)
        [[0.0, 0.0, 0.125, 0.125], [0.0, 0.0]]
    """
    if isinstance(samples, (Sample, str, bytes)) or not isinstance(samples, Sequence):
        raise TypeError(
            f"samples: expected a list of echoloss.Sample (the whole batch: the weights divide by "
            f"its size), got {type(samples).__name__}"
        )
    samples = [_check_sample(s, f"samples[{i}]") for i, s in enumerate(samples)]
    n = len(samples)
    out = []
    for s in samples:
        w = s.token_echo_weights()
        z = sum(s.token_observation_mask())
        out.append([x / (n * z) if x > 0 else 0.0 for x in w])
    return out


def openenv_tags(sample: Sample) -> dict[str, Any]:
    """OpenEnv RFC 010 tags of one sample: the inverse of
    [`sample_from_tags`][echoloss.adapters.openenv.sample_from_tags] (``"env_only"`` target).

    Echoed tokens become ``obs_mask``; observation tokens that are not echoed (warnings, or
    tokens an echo filter left out) become ``warning_mask``, so ``sample_from_tags`` gives back
    the same echo weights and ``Z = |O|``.

    Args:
        sample: an [`echoloss.Sample`][echoloss.Sample] whose echoed tokens share one λ.

    Returns:
        ``input_ids``, ``action_mask``, ``obs_mask``, ``warning_mask`` (``[P + C]`` bool),
        ``world_model_coeff`` (λ; 0.0 when no token is echoed, as there is then no λ to carry
        and ``Z = |O|`` is read by no loss), ``world_loss_target`` (``"env_only"``),
        ``logprobs`` (``[P + C]``, 0.0 off the action tokens) and ``temperature``.

    Raises:
        ValueError: echo weights or sampling temperatures that differ within the sample.

    Examples:
        >>> from echoloss.adapters.openenv import sample_from_tags
        >>> tags = dict(action_mask=[0, 1, 0, 0, 1], obs_mask=[0, 0, 1, 0, 0],
        ...             warning_mask=[0, 0, 0, 1, 0], world_model_coeff=0.05)
        >>> s = sample_from_tags([5, 6, 7, 8, 9], logprobs=[-0.1, -0.2], **tags)
        >>> back = openenv_tags(s)
        >>> [back[k] for k in ("action_mask", "obs_mask", "warning_mask", "world_model_coeff")]
        [[False, True, False, False, True], [False, False, True, False, False], [False, False, False, True, False], 0.05]
    """
    sample = _check_sample(sample)
    p = len(sample.prompt_ids)
    weights = sample.token_echo_weights()
    echoed = [w > 0 for w in weights]
    observed = sample.token_observation_mask()
    coef = _uniform([w for w in weights if w > 0], "world_model_coeff") or 0.0
    temps = sample.completion_temperatures or [1.0]
    if len(set(temps)) > 1:
        raise ValueError(
            "completion_temperatures: the sample's sampling temperatures differ; RFC 010 carries "
            "one temperature per rollout"
        )
    action = [False] * p + [bool(m) for m in sample.completion_mask]
    action = [a and not e for a, e in zip(action, echoed, strict=True)]
    return {
        "input_ids": sample.token_ids,
        "action_mask": action,
        "obs_mask": echoed,
        "warning_mask": [o and not e for o, e in zip(observed, echoed, strict=True)],
        "world_model_coeff": float(coef),
        "world_loss_target": "env_only",
        "logprobs": [0.0] * p + list(sample.completion_logprobs),
        "temperature": float(temps[0]) if sample.completion_temperatures else 1.0,
    }
