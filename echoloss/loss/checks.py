"""The checks every loss entry point runs before computing anything: config, record, requirements.

One definition shared by [`echo_loss`][echoloss.loss.echo_loss],
[`echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs] and
[`echo_loss_from_hidden`][echoloss.loss.echo_loss_from_hidden], and by callers that compute
logprobs their own way (the TRL adapter, the ``echoloss.nn`` modules): `check_config`,
`resolve_inputs` (the call's `LossInputs`, from a record or the keyword form, checked
against the scored tensor) and `check_requirements` (what the config and the policy need from
the record).
"""

from __future__ import annotations

from typing import Any

import torch

from echoloss._deferred import Message
from echoloss._validate import describe, problem
from echoloss.loss.config import LossConfig
from echoloss.loss.inputs import LossInputs
from echoloss.loss.policy import PolicyFn, PolicySpec, get_policy
from echoloss.ops.row_algebra.policies import ROW_POLICIES
from echoloss.ops.value_checks import DeferredChecks

__all__ = [
    "check_config",
    "check_requirements",
    "chunk_additive",
    "reads_sequences",
    "resolve_inputs",
]


def _fail_if(message: str) -> Message:
    """A deferred-check message: ``ValueError(message)`` when the check's flag is set."""
    return lambda v: ValueError(message) if v[0] else None


def check_config(config: Any) -> LossConfig:
    """``config`` as a `LossConfig` (None = the defaults); anything else is a TypeError.

    Examples:
        >>> check_config(None).policy
        'dppo'
    """
    if config is None:
        return LossConfig()
    if not isinstance(config, LossConfig):
        raise TypeError(
            problem(
                "config",
                "an echoloss.LossConfig or None",
                describe(config),
                "build one with LossConfig(**values) (it validates every field)",
            )
        )
    return config


def resolve_inputs(
    inputs: Any,
    fields: dict[str, Any],
    *,
    shape: torch.Size,
    device: torch.device,
    source: str,
) -> LossInputs:
    """The validated record of a call, checked against the scored tensor's rows.

    Args:
        inputs: a `LossInputs`, the labels tensor of the keyword form, or None.
        fields: the keyword form's record fields by name (None = not given); see
            `LossInputs.from_keywords`.
        shape: the per-token shape the record must have (the leading dims of ``source``).
        device: the device of ``source``.
        source: the name of the scored argument (``logits``, ``logprobs``, ``hidden``).

    Returns:
        The `LossInputs` of the call.

    Examples:
        >>> x = resolve_inputs(None, {"rl_mask": torch.tensor([True, False])},
        ...                    shape=torch.Size([2]), device=torch.device("cpu"), source="logprobs")
        >>> x.rl.tolist()
        [True, False]
    """
    x = LossInputs.from_keywords(inputs, **fields)
    x.check_unchanged()
    if x.shape != shape:
        raise ValueError(
            problem(
                "inputs (LossInputs)",
                f"of per-token shape {list(shape)} (one entry per row of {source})",
                f"rl_mask of shape {list(x.shape)}",
            )
        )
    if x.device != device:
        raise ValueError(
            problem("inputs (LossInputs)", f"on {device} (the device of {source})", str(x.device))
        )
    return x


def check_requirements(
    x: LossInputs,
    cfg: LossConfig,
    policy_fn: PolicyFn | None,
    checks: DeferredChecks | None = None,
) -> PolicySpec:
    """What the config and the policy need from the record; returns the policy's spec.

    Requirements that depend on whether the record has RL or echo rows read device values:
    they go through ``checks`` (immediate on the host path, deferred on the device path, see
    ``echoloss/_deferred.py``); None = a set of this call's own, submitted here.

    Raises:
        ValueError: a field the configuration needs is missing (``advantages`` in mode
            ``"rl"``, ``ref_logprobs`` with ``kl_coef > 0``, ``sequence_ids`` for a per-sequence
            mode, ...), echo rows in mode ``"sft"`` or next to an unconfirmed custom policy,
            or a ``policy_fn`` that does not match ``cfg.policy``.

    Examples:
        >>> x = LossInputs(rl_mask=torch.tensor([True]))
        >>> check_requirements(x, LossConfig(), None)
        Traceback (most recent call last):
        ...
        ValueError: advantages is required in mode='rl' ([N] float, 0 outside rl_mask)
    """
    own = checks is None
    checks = DeferredChecks(x.device) if checks is None else checks
    spec = get_policy(cfg.policy)
    rl_mode = cfg.mode == "rl"
    if cfg.mode == "sft":
        checks.add(
            [x.echo.any()],
            _fail_if(
                "echo rows with mode='sft': echo is only defined next to an RL term (the SFT loss "
                "would train the echoed rows with the RL normaliser); put those rows in rl_mask "
                "as SFT targets instead, or use mode='rl'"
            ),
        )
    if spec.fn is None and policy_fn is None and rl_mode:
        raise ValueError(
            f"config.policy={cfg.policy!r} needs policy_fn=fn(inputs, config) -> PolicyOutput; "
            "or register the function once with echoloss.loss.register_policy(name, fn) and "
            "set policy=name"
        )
    if policy_fn is not None and spec.fn is not None:
        raise ValueError(
            f"policy_fn was given but config.policy={cfg.policy!r}; set policy='custom' to use "
            "it (or register it with echoloss.loss.register_policy)"
        )
    if rl_mode and not spec.echo_safe and not cfg.allow_echo_with_custom_policy:
        checks.add(
            [x.echo.any()],
            _fail_if(
                "echo rows with a custom policy: the custom function receives only the RL rows "
                "and cannot see the echo weights, which are trained by the separate echo term. "
                "If it does not need them (e.g. it does not normalise by the total count of "
                "loss tokens), set LossConfig(allow_echo_with_custom_policy=True)"
            ),
        )
    if rl_mode:
        missing = []
        if x.advantages is None:
            missing.append("advantages is required in mode='rl' ([N] float, 0 outside rl_mask)")
        needs_lq = (spec.uses_ratio and x.old_logprobs is None) or cfg.mismatch is not None
        if needs_lq and x.inference_logprobs is None:
            missing.append(
                f"inference_logprobs is required by policy={cfg.policy!r}"
                + (f" with mismatch={cfg.mismatch!r}" if cfg.mismatch else "")
                + " ([N] float sampling logprobs; placeholders outside rl_mask are never read)"
            )
        if cfg.kl_coef > 0 and x.ref_logprobs is None:
            missing.append(
                f"ref_logprobs is required by kl_coef={cfg.kl_coef} ([N] float reference-model "
                "logprobs of the labels); or set kl_coef=0"
            )
        if missing:  # an error only when the record has RL rows
            checks.add([x.rl.any()], _fail_if(missing[0]))
    needs_seq = []
    if rl_mode and spec.needs_sequences:
        needs_seq.append(f"policy={cfg.policy!r}")
    if cfg.mismatch is not None and cfg.mismatch.startswith("sequence"):
        needs_seq.append(f"mismatch={cfg.mismatch!r}")
    if cfg.rl_normalization.startswith("sequence"):
        needs_seq.append(f"rl_normalization={cfg.rl_normalization!r}")
    if cfg.echo_normalization == "sequence_mean":
        needs_seq.append("echo_normalization='sequence_mean'")
        if x.observation_mask is None:
            raise ValueError(
                "observation_mask is required by echo_normalization='sequence_mean' ([N] bool, "
                "the rows counted in the paper's Z_i = |O_i|: observation body tokens, warnings "
                "included); or choose another echo_normalization"
            )
    if needs_seq and x.sequence_ids is None:
        raise ValueError(
            f"sequence_ids is required by {', '.join(needs_seq)} ([N] int64 row -> sequence "
            "within the micro-batch, -1 for padding)"
        )
    if own:
        checks.submit()
    return spec


#: Built-in policies whose per-token loss depends on that token alone (not on the sequence).
_ROW_SEPARABLE_POLICIES = frozenset(
    name for name, row in ROW_POLICIES.items() if not row.sequence_ratio
)


def chunk_additive(cfg: LossConfig, policy_fn: PolicyFn | None) -> bool:
    """Whether the loss is a sum of per-row terms over denominators known before any logprob.

    True for the per-token built-in policies (``dppo``, ``ppo_clip``, ``cispo``,
    ``reinforce``, ``sapo``) and ``mode="sft"``, with a token-level mismatch correction or
    none, and any RL and echo normalisation: the denominators are then given (``normalizers``, constants) or
    counted from the masks and sequence ids alone (a sequence's RL rows and ``Z_i`` too), so
    each row's derivative ``d loss / d logprob`` can be formed from that row as soon as its
    logprob exists. False for a sequence-level ratio (``gspo``, ``cispo_sequence``,
    ``sapo_sequence``) or mismatch correction, whose weight of a row depends on the other
    rows' logprobs, and custom policies.

    Examples:
        >>> chunk_additive(LossConfig(), None), chunk_additive(LossConfig(policy="gspo"), None)
        (True, False)
    """
    if policy_fn is not None or (cfg.mode != "sft" and cfg.policy not in _ROW_SEPARABLE_POLICIES):
        return False
    return cfg.mismatch is None or cfg.mismatch.startswith("token")


def reads_sequences(cfg: LossConfig, policy_fn: PolicyFn | None) -> bool:
    """Whether the loss reads the local sequences: a policy other than the per-token built-in
    ones (``gspo``, registered and per-call functions, which may read ``sequence_index``), a
    ``sequence_*`` normaliser or a sequence-level mismatch correction."""
    return (
        policy_fn is not None
        or (cfg.mode != "sft" and cfg.policy not in _ROW_SEPARABLE_POLICIES)
        or cfg.rl_normalization.startswith("sequence")
        or cfg.echo_normalization == "sequence_mean"
        or (cfg.mismatch is not None and cfg.mismatch.startswith("sequence"))
    )
