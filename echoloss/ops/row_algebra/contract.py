"""The contract of the fused row algebra: what it computes (`RowAlgebraParams`), what it reads
(`RowInputs`) and where it writes its metrics and check numbers (`STAT_SLOTS`, `CHECK_SLOTS`).
Shared by ``op.py``, ``fused.py`` and ``naive.py``; imports neither. The policies are those of
``policies.py``, each declared once there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from echoloss._ratios import sapo_temperature_problem
from echoloss._validate import describe, problem
from echoloss.ops.row_algebra.policies import ROW_POLICIES, SFT_CODE

__all__ = [
    "CHECK_SLOTS",
    "ECHO_NORMALIZATIONS",
    "FLAG_NAMES",
    "KL_ESTIMATORS",
    "MISMATCH_MODES",
    "POLICIES",
    "RL_NORMALIZATIONS",
    "SEQUENCE_RATIO_POLICIES",
    "STAT_SLOTS",
    "RowAlgebraParams",
    "RowInputs",
]

#: The policies this op computes (``"sft"``: the NLL of the RL rows), in the order of their
#: program codes: the built-in policies of `ROW_POLICIES` and ``"sft"``.
POLICIES = tuple(
    sorted([*ROW_POLICIES, "sft"], key=lambda p: SFT_CODE if p == "sft" else ROW_POLICIES[p].code)
)

#: The policies whose ratio is the sequence's, ``exp(clamp(mean ρ))`` over its RL rows.
SEQUENCE_RATIO_POLICIES = tuple(p for p, row in ROW_POLICIES.items() if row.sequence_ratio)

#: The flags each policy reports (``<flag>_frac`` metrics), in the order the policy sets them.
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    p: () if p == "sft" else ROW_POLICIES[p].flags for p in POLICIES
}

#: Slots of the fp32 ``stats`` output: the loss and its two terms, the metrics (means over RL
#: rows for ``mismatch_kl`` and ``entropy``, fractions of RL rows for the flags) and, with a
#: sequence-level normaliser, the call's sequences with an RL row and with an echo row (0
#: otherwise; what given normalisers are checked against); the means over RL rows of the
#: mismatch weight and of the reference-KL estimate, and the fraction of RL rows the mismatch
#: correction truncated or masked.
STAT_SLOTS = (
    "loss",
    "loss_rl",
    "loss_echo",
    "rl_tokens",
    "echo_tokens",
    "echo_nll_mean",
    "echo_nll_max",
    "mismatch_kl",
    "entropy",
    "flag0",
    "flag1",
    "flag2",
    "flag3",
    "rl_sequences",
    "echo_sequences",
    "is_weight",
    "ref_kl",
    "mismatch_flag",
)

#: Slots of the fp64 ``checks`` output: per check a flag (1 = failed) and what its message
#: reads. ``scored``: first participating row whose logprob is not finite (or > the tolerance
#: for given logprobs); ``policy``: first RL row whose policy loss is not finite; ``entropy``:
#: first RL row whose trained entropy is not finite; ``loss``: the loss is not finite;
#: ``label``: first participating row whose label is outside ``[0, vocab_size)`` (only when
#: `RowInputs` carries the labels).
CHECK_SLOTS = (
    "scored_bad",
    "scored_row",
    "scored_count",
    "scored_value",
    "scored_is_rl",
    "policy_bad",
    "policy_row",
    "policy_value",
    "entropy_bad",
    "entropy_row",
    "entropy_value",
    "loss_bad",
    "loss",
    "loss_rl",
    "loss_echo",
    "label_bad",
    "label_row",
    "label_value",
)

ECHO_NORMALIZATIONS = ("token_mean", "sum", "batch_token_mean", "sequence_mean")

#: How the RL term is normalised: ``token`` (one divisor, `RowAlgebraParams.rl_divisor`), or
#: per sequence (``docs/normalization.md``): ``sequence_mean_token_mean`` divides each row by
#: its sequence's RL rows and the sum by the RL sequences, ``sequence_mean_token_sum`` the
#: sum by the RL sequences alone.
RL_NORMALIZATIONS = ("token", "sequence_mean_token_mean", "sequence_mean_token_sum")

#: Train/inference mismatch corrections: a weight per token, or per sequence (of the sum of its
#: RL rows' log weights).
MISMATCH_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

#: Per-token estimators of the reference KL.
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class RowAlgebraParams:
    """What the algebra computes (from a ``LossConfig`` and the call's normalisers).

    Attributes:
        policy: one of `POLICIES` (``gspo``, ``cispo_sequence``, ``sapo_sequence``: ppo_clip's
            objective, cispo's weight and sapo's gate on the sequence's ratio
            ``exp(clamp(mean ρ))`` over its RL rows).
        adv_tau: advantage scale.
        low, high: the policy's bounds: ``dppo_low``/``dppo_high``, ``eps_low``/``eps_high``
            (ppo_clip, gspo), ``cispo_min``/``cispo_max`` (cispo, cispo_sequence; ``low`` None =
            no lower bound); unread by sapo.
        sapo_temperature_pos, sapo_temperature_neg: sapo's gate temperatures for ``A > 0`` and
            the other rows (> 0).
        dual_clip: ppo_clip's dual-clip constant, or None.
        log_ratio_clamp: clamp of the log ratio before ``exp`` (None = none).
        kl_tau: coefficient of ``ρ²`` (continued linearly beyond the clamp).
        entropy_coef: entropy bonus ``-entropy_coef · H`` on RL rows (0 = off).
        entropy_metric: report the ``entropy`` mean (needs the entropy).
        mismatch_metric: report ``mismatch_kl`` (needs the inference logprobs).
        mismatch: None, or a mismatch correction (`MISMATCH_MODES`): the policy loss of an RL
            row times the detached ``w = exp(clamp(b₀ − lq))`` (``sequence_*``: of the sum of
            ``b₀ − lq`` over the sequence's RL rows), ``b₀`` the old logprobs (else the row's
            own, detached), clamped to ``[mismatch_min, mismatch_max]`` (``*_truncate``) or 0
            outside it (``*_mask``); needs the inference logprobs.
        mismatch_max, mismatch_min: the bounds (``mismatch_min`` None = none).
        kl_coef: coefficient of the reference-KL estimate ``kl_estimator`` of ``d = ref − ℓ``
            (``k1 = −d``, ``k2 = d²/2``, ``k3 = exp(d) − d − 1`` on the clamped ``d``); needs
            ``RowInputs.ref_logprobs``.
        kl_estimator: one of `KL_ESTIMATORS`.
        rl_normalization: one of `RL_NORMALIZATIONS`; the sequence modes read
            ``RowInputs.sequence_ids``.
        rl_divisor: divisor of the RL term. ``token``: None = the call's RL rows (at least 1),
            else this value (given normalisers, at least 1, or ``token_sum_constant``'s
            constant). Sequence modes: None = the call's sequences with an RL row (at least
            1), else this value (the given ``rl_sequences``, at least 1). In every mode a
            device tensor in `RowInputs` replaces it when given.
        echo_normalization: ``token_mean``, ``sum``, ``batch_token_mean`` or
            ``sequence_mean`` (each echo row divided by ``Z_i + echo_z_epsilon``, ``Z_i`` the
            rows of its sequence that are observation (``RowInputs.observation``) or echo rows,
            and the sum by the echo sequences).
        echo_divisor: ``token_mean``: None = the call's echo rows (at least 1), else this value;
            ``batch_token_mean``: the divisor of the batch count (1 = this call alone);
            ``sequence_mean``: None = the call's sequences with an echo row (at least 1), else
            this value (the given ``echo_sequences``, at least 1). In these three modes a
            device tensor in `RowInputs` (``echo_divisor``) replaces it when given.
        echo_z_epsilon: added to ``Z_i`` by ``sequence_mean`` (≥ 0).
        check_finite: compute the value checks.
        logprobs_given: the logprobs come from the caller (a logprob > ``logprob_tolerance``
            then also fails the check).
        logprob_tolerance: see ``logprobs_given``.
    """

    policy: str
    adv_tau: float = 1.0
    low: float | None = 0.2
    high: float = 0.2
    dual_clip: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    log_ratio_clamp: float | None = 20.0
    kl_tau: float = 0.0
    entropy_coef: float = 0.0
    entropy_metric: bool = False
    mismatch_metric: bool = False
    mismatch: str | None = None
    mismatch_max: float = 3.0
    mismatch_min: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    rl_normalization: str = "token"
    rl_divisor: float | None = None
    echo_normalization: str = "token_mean"
    echo_divisor: float | None = None
    echo_z_epsilon: float = 0.0
    check_finite: bool = True
    logprobs_given: bool = False
    logprob_tolerance: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(problem("policy", f"one of {POLICIES}", describe(self.policy)))
        if self.policy == "sft":  # the NLL of the RL rows: no ratio, penalty or bonus
            for name, value in (
                ("kl_tau", self.kl_tau),
                ("entropy_coef", self.entropy_coef),
                ("mismatch_metric", self.mismatch_metric),
                ("mismatch", self.mismatch),
                ("kl_coef", self.kl_coef),
            ):
                if value:
                    raise ValueError(
                        problem(
                            name,
                            "0 (False) with policy='sft', which has no RL policy terms",
                            repr(value),
                            "the loss module's mode='sft' passes none of them",
                        )
                    )
        if self.echo_normalization not in ECHO_NORMALIZATIONS:
            raise ValueError(
                problem(
                    "echo_normalization", f"one of {ECHO_NORMALIZATIONS}", self.echo_normalization
                )
            )
        if self.rl_normalization not in RL_NORMALIZATIONS:
            raise ValueError(
                problem("rl_normalization", f"one of {RL_NORMALIZATIONS}", self.rl_normalization)
            )
        if self.mismatch is not None and self.mismatch not in MISMATCH_MODES:
            raise ValueError(
                problem("mismatch", f"None or one of {MISMATCH_MODES}", repr(self.mismatch))
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                problem("kl_estimator", f"one of {KL_ESTIMATORS}", repr(self.kl_estimator))
            )
        if not self.echo_z_epsilon >= 0:  # NaN fails too
            raise ValueError(problem("echo_z_epsilon", "≥ 0", repr(self.echo_z_epsilon)))
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            bad = sapo_temperature_problem(name, getattr(self, name))  # NaN fails too
            if bad is not None:
                raise ValueError(bad)

    @property
    def reads_sequences(self) -> bool:
        """Whether a normaliser, the policy's ratio or the mismatch correction is per
        sequence (``RowInputs.sequence_ids`` required)."""
        return (
            self.rl_normalization != "token"
            or self.echo_normalization == "sequence_mean"
            or self.reads_sequence_sums
        )

    @property
    def reads_sequence_sums(self) -> bool:
        """Whether a row's terms need sums over its sequence's rows (a sequence-level ratio, a
        sequence-level mismatch weight), not just its sequence's counts."""
        return self.policy in SEQUENCE_RATIO_POLICIES or (self.mismatch or "").startswith(
            "sequence"
        )

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        """``(low, high)`` as the policy's branch of the program and its row form read them
        (`echoloss.ops.row_algebra.policies.RowPolicy.bounds`): a bound these parameters hold
        under its own name (sapo's temperatures ``(τ⁻, τ⁺)``), else `low` and `high`.

        Examples:
            >>> RowAlgebraParams("sapo", sapo_temperature_neg=2.0).bounds
            (2.0, 1.0)
            >>> RowAlgebraParams("cispo", low=None, high=5.0).bounds
            (None, 5.0)
        """
        names = ROW_POLICIES[self.policy].bounds if self.policy in ROW_POLICIES else (None, None)
        given = (self.low, self.high)
        return (
            given[0] if names[0] is None else getattr(self, names[0], given[0]),
            given[1] if names[1] is None else getattr(self, names[1], given[1]),
        )

    @property
    def dual_clip_read(self) -> float | None:
        """`dual_clip` when the policy reads one (``RowPolicy.reads``), else None."""
        reads = ROW_POLICIES[self.policy].reads if self.policy in ROW_POLICIES else ()
        return self.dual_clip if "dual_clip" in reads else None

    @property
    def flag_names(self) -> tuple[str, ...]:
        """The policy's flags, in order (``dual_clipped`` last when ppo_clip has a dual clip);
        the mismatch correction's flag is `mismatch_flag_name`."""
        names = FLAG_NAMES[self.policy]
        if self.dual_clip_read is not None:
            names = (*names, "dual_clipped")
        return names

    @property
    def mismatch_flag_name(self) -> str | None:
        """``is_truncated`` or ``is_masked`` (the ``mismatch_flag`` slot), or None."""
        if self.mismatch is None:
            return None
        return "is_truncated" if self.mismatch.endswith("truncate") else "is_masked"


class RowInputs(NamedTuple):
    """The per-row fields the algebra reads, flat ``[N]`` on the logprobs' device.

    ``rl`` and ``echo`` are disjoint bool masks; every other field is read only on the rows
    where it matters (placeholders elsewhere, even NaN, are never multiplied). ``rl_divisor``
    and ``echo_divisor``: 0-dim device divisors replacing ``RowAlgebraParams.rl_divisor`` and
    ``RowAlgebraParams.echo_divisor`` (in every mode that reads those), or None.
    ``labels`` (int) with ``vocab_size``: check that every participating label is in
    ``[0, vocab_size)`` (the ``label`` check), for a caller whose logprob op did not.
    ``env_of_row`` (int, ``-1`` = no env) with ``num_envs``: the metrics also per env (env
    ``e`` counts the RL and echo rows whose entry is ``e``). ``sequence_ids`` (int; rows with
    equal ids form a sequence, in any order; participating rows have ids ≥ 0, which the caller
    checked) for the per-sequence normalisers, and ``observation`` (bool), the rows besides
    the echo rows that ``Z_i`` of echo ``sequence_mean`` counts. ``ref_logprobs``: the
    reference policy's logprobs of ``kl_coef``. ``sequences_in_order``: the caller guarantees
    that ``sequence_ids`` never decrease along the rows (it built them so, as the ``nn``
    modules build the batch row of each token): the sort of the ids is skipped, and the ids
    may then be a ``[B, T]`` view that the program reads in place through its strides (the
    modules pass ``arange(B)`` expanded over ``T``: no ``[N]`` tensor is made). The
    ``advantages`` too may be a ``[B, T]`` view (a ``[B]`` tensor expanded over ``T``), read in
    place; every other field is flat ``[N]``.
    """

    rl: torch.Tensor
    echo: torch.Tensor
    echo_weights: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    inference_logprobs: torch.Tensor | None = None
    rl_divisor: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    vocab_size: int = 0
    env_of_row: torch.Tensor | None = None
    num_envs: int = 0
    sequence_ids: torch.Tensor | None = None
    observation: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sequences_in_order: bool = False
    echo_divisor: torch.Tensor | None = None
