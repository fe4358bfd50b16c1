"""The contract of the fused row algebra: what it computes (`RowAlgebraParams`), what it reads
(`RowInputs`) and where it writes its metrics and check numbers (`STAT_SLOTS`, `CHECK_SLOTS`).
Shared by ``op.py``, ``fused.py`` and ``naive.py``; imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from echoloss._validate import describe, problem

__all__ = [
    "CHECK_SLOTS",
    "ECHO_NORMALIZATIONS",
    "FLAG_NAMES",
    "POLICIES",
    "STAT_SLOTS",
    "RowAlgebraParams",
    "RowInputs",
]

#: The per-token policies this op computes (``"sft"``: the NLL of the RL rows).
POLICIES = ("dppo", "ppo_clip", "cispo", "reinforce", "sft")

#: The flags each policy reports (``<flag>_frac`` metrics), in the order the policy sets them.
FLAG_NAMES: dict[str, tuple[str, ...]] = {
    "dppo": ("masked", "masked_low", "masked_high"),
    "ppo_clip": ("clipped", "clipped_low", "clipped_high"),
    "cispo": ("clipped", "clipped_low", "clipped_high"),
    "reinforce": (),
    "sft": (),
}

#: Slots of the fp32 ``stats`` output: the loss and its two terms, the metrics (means over RL
#: rows for ``mismatch_kl`` and ``entropy``, fractions of RL rows for the flags).
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

ECHO_NORMALIZATIONS = ("token_mean", "sum", "batch_token_mean")


@dataclass(frozen=True)
class RowAlgebraParams:
    """What the algebra computes (from a ``LossConfig`` and the call's normalisers).

    Attributes:
        policy: one of `POLICIES`.
        adv_tau: advantage scale.
        low, high: the policy's bounds: ``dppo_low``/``dppo_high``, ``eps_low``/``eps_high``
            (ppo_clip), ``cispo_min``/``cispo_max`` (``low`` None = no lower bound).
        dual_clip: ppo_clip's dual-clip constant, or None.
        log_ratio_clamp: clamp of the log ratio before ``exp`` (None = none).
        kl_tau: coefficient of ``ρ²`` (continued linearly beyond the clamp).
        entropy_coef: entropy bonus ``-entropy_coef · H`` on RL rows (0 = off).
        entropy_metric: report the ``entropy`` mean (needs the entropy).
        mismatch_metric: report ``mismatch_kl`` (needs the inference logprobs).
        rl_divisor: divisor of the RL term: None = the call's RL rows (at least 1), else this
            value (given normalisers, at least 1, or ``token_sum_constant``'s constant); a
            device tensor in `RowInputs` replaces it when given.
        echo_normalization: ``token_mean``, ``sum`` or ``batch_token_mean``.
        echo_divisor: ``token_mean``: None = the call's echo rows (at least 1), else this value;
            ``batch_token_mean``: the divisor of the batch count (1 = this call alone).
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
    log_ratio_clamp: float | None = 20.0
    kl_tau: float = 0.0
    entropy_coef: float = 0.0
    entropy_metric: bool = False
    mismatch_metric: bool = False
    rl_divisor: float | None = None
    echo_normalization: str = "token_mean"
    echo_divisor: float | None = None
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

    @property
    def flag_names(self) -> tuple[str, ...]:
        """The flags reported, in order (``dual_clipped`` last when ppo_clip has a dual clip)."""
        names = FLAG_NAMES[self.policy]
        if self.policy == "ppo_clip" and self.dual_clip is not None:
            names = (*names, "dual_clipped")
        return names


class RowInputs(NamedTuple):
    """The per-row fields the algebra reads, flat ``[N]`` on the logprobs' device.

    ``rl`` and ``echo`` are disjoint bool masks; every other field is read only on the rows
    where it matters (placeholders elsewhere, even NaN, are never multiplied). ``rl_divisor``:
    a 0-dim device divisor of the RL term replacing ``RowAlgebraParams.rl_divisor``, or None.
    ``labels`` (int) with ``vocab_size``: check that every participating label is in
    ``[0, vocab_size)`` (the ``label`` check), for a caller whose logprob op did not.
    ``env_of_row`` (int, ``-1`` = no env) with ``num_envs``: the metrics also per env (env
    ``e`` counts the RL and echo rows whose entry is ``e``).
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
