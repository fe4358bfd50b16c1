"""The fused row algebra: when the ``[N]`` loss algebra runs as one Triton launch, and how a
call's config, record and divisors become that launch (``echoloss.ops.row_algebra``).

`fused_algebra_applies` decides; `row_algebra_params` and `row_inputs` translate the config and
the record; `fused_algebra` launches the row program and queues its check numbers with the
messages of the PyTorch algebra's checks (`echoloss.loss.diagnosis`), in the same order, so both
paths report the same errors. Everything it does not cover runs the PyTorch algebra
(`echoloss.loss.algebra`), which is also the definition it is tested against.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from echoloss._logging import warn_once
from echoloss._ratios import exp_may_overflow
from echoloss._validate import describe, problem
from echoloss.loss.algebra import MISMATCH_KL_WHY, env_of_rows
from echoloss.loss.compiled import compiling
from echoloss.loss.config import LossConfig
from echoloss.loss.diagnosis import (
    final_loss_message,
    first_bad_row_message,
    not_finite_error,
    scored_rows_message,
)
from echoloss.loss.inputs import LOGPROB_TOLERANCE, LossInputs
from echoloss.loss.metrics import RESERVED_ENV
from echoloss.loss.normalization import (
    Divisors,
    Normalizers,
    covers_message,
    given_normalizers,
    used_counts,
)
from echoloss.loss.policy import PolicyFn, get_policy
from echoloss.ops.row_algebra.policies import ROW_POLICIES
from echoloss.ops.selective_logprobs.op import label_range_message
from echoloss.ops.value_checks import DeferredChecks, fuse_value_checks

__all__ = [
    "fuse_loss_algebra",
    "fused_algebra",
    "fused_algebra_applies",
    "fused_algebra_covers",
    "row_algebra_params",
    "row_inputs",
]


#: Where the fused row algebra runs (`fuse_loss_algebra`).
_FUSE_MODES = ("auto", "always", "never")
_FUSE = {"mode": "auto"}


def fuse_loss_algebra(mode: str = "auto") -> None:
    """Choose where the ``[N]`` loss algebra runs as one fused Triton launch.

    Between the two selective-logprob phases the loss is ``[N]``-sized algebra (policy,
    normalisers, echo term, metrics, value checks). For the losses whose per-row derivative
    comes from that row alone (`fused_algebra_applies`) it runs as one Triton program
    (``echoloss.ops.row_algebra``) that writes the loss, the per-row derivatives, the metrics
    and the check numbers at once; backward is one multiplication per input. Otherwise (and
    for the compiled region of `compile_loss_algebra`) the PyTorch algebra runs. The deferred
    value checks of the call's arguments follow the same mode
    (`echoloss.ops.value_checks.fuse_value_checks`: one Triton launch per eight checks).

    Args:
        mode: ``"auto"`` (the default): on CUDA when triton is importable; ``"always"``: also
            on cpu tensors when the Triton interpreter is active (``TRITON_INTERPRET=1`` set
            before echoloss is imported; for tests); ``"never"``: the PyTorch algebra only.

    Examples:
        >>> fuse_loss_algebra("auto")
    """
    if mode not in _FUSE_MODES:
        raise ValueError(problem("mode", f"one of {_FUSE_MODES}", describe(mode)))
    _FUSE["mode"] = mode
    fuse_value_checks(mode)  # the call's deferred value checks follow the algebra


def _triton_row_algebra_runs(device: torch.device) -> bool:
    mode = _FUSE["mode"]
    if mode == "never" or (mode == "auto" and device.type != "cuda"):
        return False
    try:
        from echoloss.ops.row_algebra import fused
    except ImportError:  # no triton: the PyTorch algebra computes the same loss
        return False
    return device.type == "cuda" or (device.type == "cpu" and fused.interpreter_active())


def fused_algebra_applies(
    lp: torch.Tensor,
    ent: torch.Tensor | None,
    x: LossInputs,
    cfg: LossConfig,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
) -> bool:
    """Whether this call's algebra runs fused (`fuse_loss_algebra`).

    Covered: ``mode="sft"`` and every built-in policy (``dppo``, ``ppo_clip``, ``cispo``,
    ``reinforce``, ``gspo``, ``cispo_sequence``, ``sapo``, ``sapo_sequence``) with ``kl_tau``,
    the entropy bonus, the reference KL (``kl_coef``) and any mismatch correction or none, every RL and echo normalisation (what
    is per sequence, with one sort of the sequence ids and one launch more), fp32 logprobs,
    with or without the per-env metrics of ``env_names`` (one program more per env). Custom
    policies run the PyTorch algebra, which is also the definition the fused one is tested
    against.

    Examples:
        >>> lp = torch.zeros(2)
        >>> x = LossInputs(rl_mask=torch.tensor([True, False]))
        >>> fused_algebra_applies(lp, None, x, LossConfig(), None, None)  # cpu tensors
        False
    """
    if compiling():  # the compiled region of compile_loss_algebra runs instead
        return False
    if ent is not None and ent.dtype != torch.float32:
        return False
    return fused_algebra_covers(
        lp.device, lp.dtype, ent is not None, x, cfg, normalizers, policy_fn
    )


def fused_algebra_covers(
    device: torch.device,
    lp_dtype: torch.dtype,
    has_entropy: bool,
    x: LossInputs,
    cfg: LossConfig,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
) -> bool:
    """`fused_algebra_applies` before the logprobs exist (their device, dtype, entropy)."""
    if compiling() or not _triton_row_algebra_runs(device):
        return False
    if lp_dtype != torch.float32:
        return False
    if policy_fn is not None or (cfg.mode == "rl" and cfg.policy not in ROW_POLICIES):
        _warn_unfused(cfg.policy)
        return False
    if cfg.mode == "rl" and cfg.mismatch is not None and x.inference_logprobs is None:
        return False  # the PyTorch algebra reports the missing inference logprobs
    per_sequence = cfg.mode == "rl" and (
        get_policy(cfg.policy).needs_sequences
        or (cfg.mismatch is not None and cfg.mismatch.startswith("sequence"))
    )
    if per_sequence and x.sequence_ids is None:
        return False  # ... and the missing sequence ids
    if cfg.mode == "rl" and cfg.kl_coef != 0 and x.ref_logprobs is None:
        return False  # the PyTorch algebra reports the missing reference logprobs
    if cfg.mode == "rl" and cfg.entropy_coef != 0 and not has_entropy:
        return False  # the PyTorch algebra reports the missing entropy
    if cfg.rl_normalization.startswith("sequence") or cfg.echo_normalization == "sequence_mean":
        if x.sequence_ids is None:
            return False  # the PyTorch algebra reports the missing ids
        if cfg.echo_normalization == "sequence_mean" and x.observation_mask is None:
            return False  # ... and the missing observation mask
    # a normalizers of the wrong type: the PyTorch algebra raises the TypeError
    return normalizers is None or isinstance(normalizers, Normalizers)


def _warn_unfused(policy: str) -> None:
    """Tell a policy's author, once per process, that its calls run the PyTorch algebra where
    the built-in policies run the row program, and what that costs."""
    who = "the per-call policy_fn" if policy == "custom" else f"policy {policy!r}"
    warn_once(
        f"unfused policy {policy}",
        f"{who} runs the unfused PyTorch loss algebra: about 150-185 kernel launches per "
        "forward and backward where a built-in policy's fused row program takes 8 (counted "
        "for the echoloss.nn modules, docs/benchmarks.md); the row program covers the built-in "
        f"policies ({', '.join(ROW_POLICIES)}). To make it fast, declare it as a built-in "
        "policy with a branch of the row program (CONTRIBUTING.md, 'Make a policy fast'), or "
        "run the algebra compiled (echoloss.loss.compiled.compile_loss_algebra)",
    )


def row_algebra_params(
    cfg: LossConfig, ent: torch.Tensor | None, x: LossInputs, normalizers: Normalizers | None
) -> Any:
    """The `echoloss.ops.row_algebra.RowAlgebraParams` of a call `fused_algebra_applies` to:
    the policy's bounds read as its declaration says (`RowPolicy.bounds`), the config's other
    terms, and the divisors of the given ``normalizers`` (at least 1)."""
    from echoloss.ops.row_algebra import RowAlgebraParams

    rl_mode = cfg.mode == "rl"
    policy, dual_clip = "sft", None
    low: float | None = None
    high: float | None = None
    if rl_mode:  # the policy's bounds and dual clip, as its declaration reads them
        policy, row = cfg.policy, ROW_POLICIES[cfg.policy]
        low, high = (None if b is None else cfg.policy_parameter(b) for b in row.bounds)
        dual_clip = cfg.dual_clip if "dual_clip" in row.reads else None
    rl_divisor: float | None = None
    echo_divisor: float | None = None
    rl_normalization = "token"
    if cfg.rl_normalization == "token_sum_constant":
        rl_divisor = cfg.rl_normalization_constant
    elif cfg.rl_normalization.startswith("sequence"):
        rl_normalization = cfg.rl_normalization
        if normalizers is not None:
            rl_divisor = float(max(normalizers.rl_sequences, 1))
    elif normalizers is not None:
        rl_divisor = float(max(normalizers.rl_tokens, 1))
    if cfg.echo_normalization == "token_mean" and normalizers is not None:
        echo_divisor = float(max(normalizers.echo_tokens, 1))
    elif cfg.echo_normalization == "sequence_mean" and normalizers is not None:
        echo_divisor = float(max(normalizers.echo_sequences, 1))
    elif cfg.echo_normalization == "batch_token_mean":
        # this call alone: max(1 if echo rows else 0, 1) = 1
        echo_divisor = 1.0 if normalizers is None else float(max(normalizers.echo_batches, 1))
    return RowAlgebraParams(
        policy,
        adv_tau=cfg.adv_tau,
        low=low,
        high=0.0 if high is None else high,
        dual_clip=dual_clip,
        sapo_temperature_pos=cfg.sapo_temperature_pos,
        sapo_temperature_neg=cfg.sapo_temperature_neg,
        log_ratio_clamp=cfg.log_ratio_clamp,
        kl_tau=cfg.resolved_kl_tau if rl_mode else 0.0,
        entropy_coef=cfg.entropy_coef if rl_mode else 0.0,
        entropy_metric=ent is not None and (cfg.compute_entropy or cfg.entropy_coef != 0),
        mismatch_metric=rl_mode and x.inference_logprobs is not None,
        mismatch=cfg.mismatch if rl_mode else None,
        mismatch_max=cfg.mismatch_max,
        mismatch_min=cfg.mismatch_min,
        kl_coef=cfg.kl_coef if rl_mode else 0.0,
        kl_estimator=cfg.kl_estimator,
        rl_normalization=rl_normalization,
        rl_divisor=rl_divisor,
        echo_normalization=cfg.echo_normalization,
        echo_divisor=echo_divisor,
        echo_z_epsilon=cfg.echo_z_epsilon,
        check_finite=cfg.check_finite,
        logprobs_given=False,
        logprob_tolerance=LOGPROB_TOLERANCE,
    )


def row_inputs(x: LossInputs) -> Any:
    """The record's per-row fields as the fused row algebra reads them
    (`echoloss.ops.row_algebra.RowInputs`, flat ``[N]`` but the advantages and sequence ids
    in order, which the program reads in place; divisors, labels and envs unset;
    the sequence ids and observation rows are read only by per-sequence normalisers)."""
    from echoloss.ops.row_algebra import RowInputs

    return RowInputs(
        rl=x.rl,
        echo=x.echo,
        echo_weights=x.flat("echo_weights"),
        advantages=x.advantages,  # read in place (a [B] expanded over T stays a view)
        old_logprobs=x.flat("old_logprobs"),
        inference_logprobs=x.flat("inference_logprobs"),
        # ids in order are read in place (a [B, T] view stays one: no copy)
        sequence_ids=x.sequence_ids if x.sequences_in_order else x.flat("sequence_ids"),
        observation=x.flat("observation_mask"),
        ref_logprobs=x.flat("ref_logprobs"),
        sequences_in_order=x.sequences_in_order,
    )


def _check_slots(check: str) -> list[int]:
    """Positions of one check's numbers in the row algebra's ``checks`` (`CHECK_SLOTS` names
    them ``<check>_...``), in the order its message reads them."""
    from echoloss.ops.row_algebra import CHECK_SLOTS

    return [i for i, name in enumerate(CHECK_SLOTS) if name.split("_")[0] == check]


def _host_or_device(
    divisor: float | torch.Tensor | None,
) -> tuple[float | None, torch.Tensor | None]:
    """A `Divisors` entry as ``(host constant, device tensor)``, at most one of them set."""
    if divisor is None or isinstance(divisor, torch.Tensor):
        return None, divisor
    return float(divisor), None


def _mismatch_kl_message(v: Sequence[float]) -> Exception | None:
    """The error of a non-finite mismatch-KL mean (the program's stat slot)."""
    if math.isfinite(v[0]):
        return None
    return ValueError(
        problem(
            "mismatch_kl (k3 of logprobs - inference_logprobs, mean over the RL rows)",
            f"finite ({MISMATCH_KL_WHY})",
            f"{v[0]}",
            "or set LossConfig(check_finite=False) to skip this check",
        )
    )


def fused_algebra(
    lp: torch.Tensor,
    ent: torch.Tensor | None,
    x: LossInputs,
    cfg: LossConfig,
    normalizers: Normalizers | None,
    source: str,
    checks: DeferredChecks,
    divisors: Divisors,
    label_check: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`torch_algebra` for a call `fused_algebra_applies` to: one launch of the row algebra, its
    check numbers queued with the messages of the PyTorch algebra's checks, in its order
    (the labels' range first, as the logprob op queues it before the loss)."""
    from echoloss.ops.row_algebra import STAT_SLOTS, row_algebra

    params = row_algebra_params(cfg, ent, x, normalizers)
    # The caller's divisors: a float is the program's constant, a tensor read by the program.
    rl_host, rl_device = _host_or_device(divisors.rl)
    echo_host, echo_device = _host_or_device(divisors.echo)
    params = dataclasses.replace(
        params,
        logprobs_given=source == "logprobs",
        rl_divisor=params.rl_divisor if rl_host is None else rl_host,
        echo_divisor=params.echo_divisor if echo_host is None else echo_host,
    )
    env_of_row, env_list = env_of_rows(x, lp.device)  # per-env metrics: one program per env
    rows = row_inputs(x)._replace(
        rl_divisor=rl_device,
        echo_divisor=echo_device,
        labels=None if label_check is None else label_check[0],
        vocab_size=0 if label_check is None else label_check[1],
        env_of_row=env_of_row if env_list else None,
        num_envs=len(env_list),
    )
    out = row_algebra(lp, ent, rows, params, backend="triton")
    s = out.stats
    first: list[tuple[Callable[[Sequence[float]], Exception | None], list[int]]] = []
    if label_check is not None:
        first.append((label_range_message(label_check[1]), _check_slots("label")))
    if cfg.check_finite:
        first.append((scored_rows_message(source), _check_slots("scored")))
    later: list[tuple[Callable[[Sequence[float]], Exception | None], list[int]]] = []
    if normalizers is not None:  # the given counts must cover this call's own
        given = given_normalizers(normalizers)
        checks.add_packed(out.checks, first)
        first = []
        # The call's counts are read where the row program wrote them (no launch); a call
        # echoes a row (`echo_batches`) when it has an echo token.
        slot = {"echo_batches": "echo_tokens"}
        checks.add_packed(
            s,
            [
                (
                    covers_message(name, getattr(given, name)),
                    [STAT_SLOTS.index(slot.get(name, name))],
                )
                for name in used_counts(cfg)
            ],
        )
    if cfg.check_finite:
        if cfg.mode == "rl":
            name = f"the loss of policy {cfg.policy!r}"
            why = "a policy's per-token loss; with log_ratio_clamp=None a ratio can overflow"
            later.append(
                (first_bad_row_message(not_finite_error(name, why)), _check_slots("policy"))
            )
            if params.entropy_coef != 0:
                why = "the entropy bonus (entropy_coef) reads it"
                later.append(
                    (
                        first_bad_row_message(not_finite_error("entropy", why)),
                        _check_slots("entropy"),
                    )
                )
        later.append((final_loss_message(x, ent, cfg, divisors), _check_slots("loss")))
    if first or later:  # one block, no launch (two around the normalisers' checks)
        checks.add_packed(out.checks, first + later)
    if (
        cfg.check_finite
        and params.mismatch_metric
        and exp_may_overflow(cfg.log_ratio_clamp, torch.float32)
    ):
        # The program's mismatch-KL mean, read where it wrote it: inf when an RL row's k3
        # overflowed without a clamp (the PyTorch algebra names the row). Never with a clamp
        # that keeps exp finite (no block, no copy).
        checks.add_packed(s, [(_mismatch_kl_message, [STAT_SLOTS.index("mismatch_kl")])])
    # The keys in `loss_metrics`' order: per key (all, then each env) the counts, the echo NLL,
    # the means (mismatch weight, reference KL, mismatch KL, entropy) and the flags (the
    # policy's, then the mismatch correction's); the two terms after the "all" ones.
    means = [
        ("is_weight", params.mismatch is not None),
        ("ref_kl", params.kl_coef != 0),
        ("mismatch_kl", params.mismatch_metric),
        ("entropy", params.entropy_metric),
    ]
    slots = [
        (name, STAT_SLOTS.index(slot))
        for name, slot in [
            ("rl_tokens", "rl_tokens"),
            ("echo_tokens", "echo_tokens"),
            ("echo_nll_mean", "echo_nll_mean"),
            ("echo_nll_max", "echo_nll_max"),
            *((name, name) for name, on in means if on),
            *((f"{flag}_frac", f"flag{i}") for i, flag in enumerate(params.flag_names)),
            *(
                [(f"{params.mismatch_flag_name}_frac", "mismatch_flag")]
                if params.mismatch_flag_name is not None
                else []
            ),
        ]
    ]
    metrics: dict[str, torch.Tensor] = {}
    for key, row in [(RESERVED_ENV, s), *zip(env_list, out.env_stats, strict=True)]:
        for name, i in slots:
            metrics[f"{name}/{key}"] = row[i]
        if key == RESERVED_ENV:
            metrics[f"loss_rl/{key}"] = s[STAT_SLOTS.index("loss_rl")]
            metrics[f"loss_echo/{key}"] = s[STAT_SLOTS.index("loss_echo")]
    return out.loss, metrics
