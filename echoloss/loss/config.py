"""``LossConfig``: every hyperparameter of [`echoloss.echo_loss`][echoloss.loss.echo_loss], validated at construction."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from echoloss.loss.policy import POLICIES, POLICY_PARAMETERS, get_policy

__all__ = [
    "EchoNormalization",
    "EchoTemperature",
    "KLEstimator",
    "LossConfig",
    "MismatchMode",
    "Policy",
    "RLNormalization",
]

#: The built-in policies (``LossConfig.policy`` also accepts any name given to
#: :func:`echoloss.loss.register_policy`).
Policy = Literal[
    "dppo",
    "ppo_clip",
    "cispo",
    "cispo_sequence",
    "gspo",
    "sapo",
    "sapo_sequence",
    "reinforce",
    "custom",
]
RLNormalization = Literal[
    "token_mean", "sequence_mean_token_mean", "sequence_mean_token_sum", "token_sum_constant"
]
EchoNormalization = Literal["token_mean", "sequence_mean", "batch_token_mean", "sum"]
MismatchMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
KLEstimator = Literal["k1", "k2", "k3"]
EchoTemperature = Literal["one", "sampling"]


class LossConfig(BaseModel):
    """Hyperparameters of the split RL + echo loss (immutable; unknown fields are rejected).

    The RL term covers the rows of ``rl_mask`` (minus echoed rows); the echo term covers the rows
    with ``echo_weights > 0`` and is ``-w · logprob`` with no ratio, trust region, KL, advantage or
    ``adv_tau``. Each term has its own normaliser. ``docs/loss.md`` gives every formula.

    Attributes:
        mode: ``"rl"`` (policy loss on RL rows) or ``"sft"`` (plain ``-logprob`` on the rows of
            ``rl_mask``, no advantages; echo rows are rejected in this mode).
        policy: the RL loss on each RL token: ``"dppo"`` (prime-rl's default), ``"ppo_clip"``,
            ``"cispo"``, ``"gspo"`` (ppo_clip on the sequence-level ratio), ``"sapo"`` (a
            sigmoid-gated soft trust region), ``"cispo_sequence"`` and ``"sapo_sequence"`` (their
            sequence-level ratios), ``"reinforce"`` (no ratio), or
            ``"custom"`` (a ``policy_fn`` given to ``echo_loss``), or a name registered with
            [`echoloss.loss.register_policy`][echoloss.loss.policy.register_policy]. A policy parameter the chosen policy does not
            read (e.g. ``eps_high`` with ``"dppo"``) is rejected unless it keeps its default.
        adv_tau: scale of the advantages of RL tokens (never of echo weights). ≥ 0.
        kl_tau: coefficient of ``(log ratio)^2`` added on every RL token, dropped or not. None =
            the policy's default: 1e-3 for dppo (prime-rl), 0 for the others. ≥ 0.
        dppo_low, dppo_high: dppo trust region in probability space: a token with ``A > 0`` is
            dropped when ``p - p_old > dppo_high``; any other token (``A <= 0``, so ``A == 0``
            too, as in prime-rl) when ``p - p_old < -dppo_low``. ≥ 0.
        eps_low, eps_high: ppo_clip / gspo ratio clip ``[1 - eps_low, 1 + eps_high]``. None = the
            policy default: 0.2/0.2 for ppo_clip, 3e-4/4e-4 for gspo (GSPO paper). ≥ 0.
        dual_clip: ppo_clip dual-clip constant ``c > 1`` bounding the loss of ``A < 0`` tokens
            at ``-c·A``; None = off.
        cispo_max, cispo_min: bounds of CISPO's detached importance weight ``clamp(r, min, max)``;
            ``cispo_min`` None = no lower bound. Read by ``cispo`` and ``cispo_sequence``.
        sapo_temperature_pos, sapo_temperature_neg: the temperatures ``τ`` of SAPO's gate
            ``σ(τ·(r - 1)) · 4/τ`` for tokens with ``A > 0`` and the others (TRL's defaults
            1.0 and 1.05). > 0. Read by ``sapo`` and ``sapo_sequence``.
        log_ratio_clamp: the log ratio is clamped to ``±log_ratio_clamp`` before ``exp`` in every
            ratio (policy ratio, importance weights, k3), as verl and OpenRLHF do; a clamped token
            gets no ratio gradient. None = no clamp. > 0.
        mismatch: train/inference mismatch correction: the detached importance weight
            ``w = p_old / p_inference`` per token or per sequence, ``*_truncate`` clamps it to
            ``[mismatch_min, mismatch_max]``, ``*_mask`` zeroes tokens (or whole sequences) whose
            weight leaves that range. It multiplies the policy term, not the KL terms.
            None = off.
        mismatch_max, mismatch_min: bounds for ``mismatch`` (``mismatch_min`` None = no lower
            bound).
        kl_coef: coefficient of the KL to reference logprobs (needs ``ref_logprobs``); 0 = off.
        kl_estimator: ``"k1"`` (``log p - log p_ref``), ``"k2"`` (``½ (log p - log p_ref)^2``)
            or ``"k3"`` (``exp(log p_ref - log p) - (log p_ref - log p) - 1``).
        entropy_coef: entropy bonus on RL tokens: ``- entropy_coef · H`` per token; 0 = off.
        rl_normalization: ``"token_mean"`` (global RL-token mean), ``"sequence_mean_token_mean"``,
            ``"sequence_mean_token_sum"`` or ``"token_sum_constant"`` (Dr. GRPO: the global token
            sum divided by ``rl_normalization_constant``).
        rl_normalization_constant: the constant of ``token_sum_constant`` (> 0), for the whole
            global batch (e.g. ``num_sequences · max_completion_tokens``).
        echo_normalization: ``"token_mean"`` (global echo-token mean, prime-rl), ``"sequence_mean"``
            (the paper: per sequence ``1 / Z_i`` with ``Z_i = |O_i|``, then a mean over the
            sequences of the global batch), ``"batch_token_mean"`` (each micro-batch's own echo-token
            mean, averaged over the micro-batches of the step: OpenEnv / TRL) or ``"sum"``.
        echo_z_epsilon: added to ``Z_i`` in ``sequence_mean`` (echo-rl adds 1e-3). ≥ 0.
        echo_temperature: temperature of the echo rows: ``"one"`` (default: the model's own
            distribution, ``logits / 1``) or ``"sampling"`` (the rows' given temperature, as
            prime-rl and echo-rl's code do). RL rows always use the sampling temperature.
        compute_entropy: compute the entropy of RL rows for the ``entropy`` metric even when
            ``entropy_coef == 0`` (no gradient then). With ``entropy_coef != 0`` the entropy is
            always computed (the bonus needs it) and reported.
        check_finite: check in ``O(N)`` that every participating row's logprob (hence its logits
            or hidden state), the policy's per-token loss and the entropy used by the bonus are
            finite, and raise naming the first bad row. Costs a few ``[N]`` reductions and one
            host sync; ``False`` skips them.
        allow_echo_with_custom_policy: a custom ``policy_fn`` only ever sees the RL rows; set
            this to confirm that it does not need the echo rows (e.g. for its own normaliser).

    Examples:
        >>> cfg = LossConfig()
        >>> cfg.policy, cfg.resolved_kl_tau, cfg.echo_normalization
        ('dppo', 0.001, 'token_mean')
        >>> LossConfig(policy="ppo_clip").resolved_eps
        (0.2, 0.2)
        >>> LossConfig(policy="dppo", eps_high=0.3)
        Traceback (most recent call last):
        ...
        pydantic_core._pydantic_core.ValidationError: 1 validation error for LossConfig
          Value error, eps_high=0.3 is ignored by policy='dppo' (it reads dppo_low, dppo_high); remove eps_high, or choose a policy that reads it: gspo, ppo_clip ...
        >>> LossConfig(dppo_low=-1)
        Traceback (most recent call last):
        ...
        pydantic_core._pydantic_core.ValidationError: 1 validation error for LossConfig
        dppo_low
          Input should be greater than or equal to 0 [type=greater_than_equal, input_value=-1, input_type=int]
        ...
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["rl", "sft"] = "rl"
    policy: str = "dppo"
    adv_tau: float = Field(1.0, ge=0)
    kl_tau: float | None = Field(None, ge=0)
    dppo_low: float = Field(0.2, ge=0)
    dppo_high: float = Field(0.2, ge=0)
    eps_low: float | None = Field(None, ge=0)
    eps_high: float | None = Field(None, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    cispo_max: float = Field(5.0, gt=0)
    cispo_min: float | None = Field(None, ge=0)
    # SAPO_TEMPERATURE_RANGE: beyond, 4/τ or τ·(r - 1) leaves float32 (echoloss/_ratios.py)
    sapo_temperature_pos: float = Field(1.0, ge=1e-6, le=1e6)
    sapo_temperature_neg: float = Field(1.05, ge=1e-6, le=1e6)
    log_ratio_clamp: float | None = Field(20.0, gt=0)
    mismatch: MismatchMode | None = None
    mismatch_max: float = Field(3.0, gt=0)
    mismatch_min: float | None = Field(None, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    rl_normalization: RLNormalization = "token_mean"
    rl_normalization_constant: float | None = Field(None, gt=0)
    echo_normalization: EchoNormalization = "token_mean"
    echo_z_epsilon: float = Field(0.0, ge=0)
    echo_temperature: EchoTemperature = "one"
    compute_entropy: bool = True
    allow_echo_with_custom_policy: bool = False
    check_finite: bool = True

    @field_validator("*")
    @classmethod
    def _finite(cls, v: object) -> object:
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("policy")
    @classmethod
    def _registered(cls, v: str) -> str:
        get_policy(v)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> LossConfig:
        self._reject_ignored_policy_parameters()
        if self.rl_normalization == "token_sum_constant" and self.rl_normalization_constant is None:
            raise ValueError(
                "rl_normalization='token_sum_constant' needs rl_normalization_constant (> 0): "
                "the Dr. GRPO constant for the whole global batch, e.g. "
                "num_sequences * max_completion_tokens"
            )
        if self.cispo_min is not None and self.cispo_min > self.cispo_max:
            raise ValueError(f"cispo_min={self.cispo_min} must be ≤ cispo_max={self.cispo_max}")
        if self.mismatch_min is not None and self.mismatch_min > self.mismatch_max:
            raise ValueError(
                f"mismatch_min={self.mismatch_min} must be ≤ mismatch_max={self.mismatch_max}"
            )
        if self.eps_low is not None and self.eps_low >= 1:
            raise ValueError(
                f"eps_low={self.eps_low} must be < 1 (the clip's lower bound is 1 - eps_low)"
            )
        return self

    def _reject_ignored_policy_parameters(self) -> None:
        """A policy parameter set away from its default but not read by the policy is an error
        (the value would be silently ignored); derived from the registry's declarations."""
        reads = get_policy(self.policy).reads
        if reads is None or self.mode != "rl":
            return
        for name in POLICY_PARAMETERS:
            value = getattr(self, name)
            if name in reads or value == type(self).model_fields[name].default:
                continue
            readers = sorted(
                p for p, s in POLICIES.items() if s.reads is not None and name in s.reads
            )
            raise ValueError(
                f"{name}={value} is ignored by policy={self.policy!r} (it reads "
                f"{', '.join(reads) or 'no policy parameter'}); remove {name}, or choose a "
                f"policy that reads it: {', '.join(readers)}"
            )

    @property
    def resolved_kl_tau(self) -> float:
        """``kl_tau``, or the policy's default when it is None."""
        if self.kl_tau is not None:
            return self.kl_tau
        return float(get_policy(self.policy).defaults.get("kl_tau", 0.0))

    @property
    def resolved_eps(self) -> tuple[float, float]:
        """``(eps_low, eps_high)``, each defaulting per policy when None (0.2 otherwise)."""
        d = get_policy(self.policy).defaults
        return (
            self.eps_low if self.eps_low is not None else float(d.get("eps_low", 0.2)),
            self.eps_high if self.eps_high is not None else float(d.get("eps_high", 0.2)),
        )

    def policy_parameter(self, name: str) -> float | None:
        """The value of policy parameter ``name`` (one of `POLICY_PARAMETERS`) a policy reads:
        ``eps_low`` and ``eps_high`` as `resolved_eps` gives them, the others as set.

        Examples:
            >>> LossConfig(policy="gspo").policy_parameter("eps_high")
            0.0004
        """
        if name in ("eps_low", "eps_high"):
            return self.resolved_eps[name == "eps_high"]
        value = getattr(self, name)
        return None if value is None else float(value)


# Every parameter a built-in policy declares (`POLICY_PARAMETERS`) is a field above: a policy that
# reads a new one needs its field (type, default, range), and this says so at import.
_MISSING = [name for name in POLICY_PARAMETERS if name not in LossConfig.model_fields]
if _MISSING:
    raise TypeError(
        f"LossConfig has no field for the policy parameters {_MISSING} that a built-in policy "
        "reads (echoloss/ops/row_algebra/policies.py): declare each as a field of LossConfig"
    )
