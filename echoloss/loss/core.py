"""The split RL + echo loss: ``L = L_RL(RL rows) + L_echo(echo rows)``, sharing one log-softmax.

Every entry point takes one `LossInputs` record and differs only in
how it gets the log-probabilities: [`echo_loss`][echoloss.loss.echo_loss] from logits (through
[`echoloss.ops.selective_logprobs`][echoloss.ops.selective_logprobs], participating rows only),
[`echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs] from logprobs computed elsewhere, and
`echoloss.echo_loss_from_hidden` from hidden states and the LM head. Everything after the
logprobs is ``[N]``-sized PyTorch in `loss_from_logprobs`, in small steps:

1. `check_requirements`: what the config and policy need from the record;
2. `check_scored_rows`: the ``O(N)`` non-finite check of the logprobs (names the first bad row);
3. `echoloss.loss.normalization.local_sequences`: local sequence numbering and counts;
4. `_resolve_normalizers`: the counts each term divides by;
5. `_rl_per_token`: policy loss, mismatch weight, ``kl_tau``, reference KL, entropy bonus;
6. `_rl_term` / `_echo_term`: the two normalised sums, and the final-loss check;
7. `_metrics`.

Every step works on ``[N]`` tensors, rows selected by mask arithmetic, so on CUDA nothing is
read back to the host; value checks go through `echoloss._deferred.DeferredChecks` (raised at
once on CPU, deferred on CUDA: ``docs/loss.md``, "When a value error is raised").

The keyword form (``echo_loss(logits, labels, rl_mask=..., ...)``) takes the record's fields by
name (``**fields``) and builds the record with `LossInputs.from_keywords`: no entry point spells a
field, so a new field of the record is a new keyword of every entry point.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from echoloss._compile import compiler_disable
from echoloss._deferred import (
    DeferredChecks,
    first_true,
    host_to_device,
    not_finite,
    on_device_path,
    raise_deferred_errors,
)
from echoloss._validate import check_per_token, check_tensor, describe, problem
from echoloss.loss.checks import check_config, check_requirements, resolve_inputs
from echoloss.loss.config import LossConfig
from echoloss.loss.inputs import LOGPROB_TOLERANCE, LossInputs, split_rows
from echoloss.loss.metrics import RESERVED_ENV, loss_metrics
from echoloss.loss.normalization import (
    LocalSequences,
    Normalizers,
    local_sequences,
    row_counts,
)
from echoloss.loss.policy import (
    PolicyFn,
    PolicyInputs,
    PolicyOutput,
    PolicySpec,
    RecordRows,
    check_policy_output,
    get_policy,
    k3,
    kl_penalty,
    mismatch_weights,
)
from echoloss.ops.selective_logprobs import selective_logprobs
from echoloss.ops.selective_logprobs.op import (
    label_range_message,
    labels_checked_on_device,
    selective_logprobs_checked_by_caller,
)
from echoloss.ops.value_checks import fuse_value_checks

__all__ = [
    "LossOutput",
    "NonFiniteLossError",
    "check_final_loss",
    "check_scored_rows",
    "chunk_additive",
    "compile_loss_algebra",
    "echo_loss",
    "echo_loss_from_logprobs",
    "fuse_loss_algebra",
    "fused_algebra_applies",
    "label_check_on_device",
    "loss_from_logprobs",
    "reads_sequences",
    "row_coefficients",
    "row_temperature_and_entropy",
]


class NonFiniteLossError(ValueError):
    """The loss (or a participating row's logprob) is not finite: the message names the term or
    row, the likely input and the fix. A ``ValueError``, so callers catching bad input catch it;
    trainers catch this class to stop with the message instead of training on."""


class LossOutput(NamedTuple):
    """Result of [`echo_loss`][echoloss.loss.echo_loss].

    Attributes:
        loss: 0-dim loss (RL term + echo term), connected to the graph even when no row
            participates (then exactly 0 with zero gradients).
        metrics: detached 0-dim fp32 tensors keyed ``<name>/all`` and ``<name>/<env>``; see
            ``docs/loss.md`` for the list.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


# ---------------------------------------------------------------- 2. non-finite logprobs

_SOURCE_CAUSE = {
    "logits": "NaN or +inf in that row of the logits, or -inf at its label",
    "hidden": "NaN or inf in that row of hidden (or in the LM-head weight), or a logit of "
    "-inf at its label",
    "logprobs": "a NaN or infinite logprob",
}


def _scored_rows_message(source: str) -> Callable[[Sequence[float]], Exception | None]:
    """The error of `check_scored_rows` from its numbers ``(any bad, first bad row, bad rows,
    that row's logprob, whether it is an RL row)``."""

    def message(v: Sequence[float]) -> Exception | None:
        if not v[0]:
            return None
        r, kind, value = int(v[1]), ("an RL" if v[4] else "an echo"), v[3]
        if math.isfinite(value):  # a positive "logprob": a negative log-likelihood passed
            return ValueError(
                problem(
                    f"{source}[{r}]",
                    f"a log-probability ≤ 0 (up to {LOGPROB_TOLERANCE}) on {kind} row",
                    repr(round(value, 6)),
                    "pass log p, not the negative log-likelihood -log p",
                )
            )
        return NonFiniteLossError(
            problem(
                f"{source} row {r}",
                f"a finite log-probability on {kind} row",
                f"{value} ({int(v[2])} bad row(s); cause: {_SOURCE_CAUSE[source]})",
                "find where the model's output overflows (e.g. fp16 activations), or set "
                "LossConfig(check_finite=False) to skip this check",
            )
        )

    return message


def check_scored_rows(
    lp: torch.Tensor,
    rl: torch.Tensor,
    echo: torch.Tensor,
    source: str,
    checks: DeferredChecks | None = None,
) -> None:
    """O(N): every RL or echo row's logprob ``lp [N]`` is finite, else name the first bad row.

    A NaN or +inf anywhere in a row of logits makes its log-sum-exp, hence its logprob,
    non-finite, and -inf at the label gives -inf: one ``isfinite`` over the ``[N]`` logprobs
    catches all of them without reading the ``[N, V]`` logits again. Logprobs given by the
    caller (``source="logprobs"``) must also be ≤ 0 (up to ``LOGPROB_TOLERANCE``), like every
    other logprob input. On the device path the check runs there and the error is deferred
    (``echoloss/_deferred.py``); ``checks`` collects it with the call's other checks (None = its
    own, submitted here).

    Examples:
        >>> check_scored_rows(torch.tensor([-0.1, float("nan")]), torch.tensor([True, False]),
        ...                   torch.tensor([False, True]), "logits")
        Traceback (most recent call last):
        ...
        echoloss.loss.core.NonFiniteLossError: logits row 1 must be a finite log-probability on an echo row, got nan (1 bad row(s); cause: NaN or +inf in that row of the logits, or -inf at its label); ...
    """
    if lp.numel() == 0:
        return
    own = checks is None
    checks = DeferredChecks(lp.device) if checks is None else checks
    part = rl | echo  # [N] bool
    bad = part & not_finite(lp)  # [N] bool
    if source == "logprobs":
        bad = bad | (part & (lp > LOGPROB_TOLERANCE))  # [N] bool
    row = first_true(bad)  # 0-dim
    message = _scored_rows_message(source)
    one = row.view(1)
    checks.add(
        [bad.any(), row, bad.sum(), lp.detach().index_select(0, one), rl.index_select(0, one)],
        message,
    )
    if own:
        checks.submit()


def _defer_first_bad_row(
    checks: DeferredChecks,
    bad: torch.Tensor,
    values: torch.Tensor,
    error: Callable[[int, float], Exception],
) -> None:
    """Queue ``error(row, value)`` for the first True row of ``bad [N] bool`` (on the device:
    no host read until the checks are read)."""
    row = first_true(bad)
    message = _first_bad_row_message(error)
    checks.add([bad.any(), row, values.detach().index_select(0, row.view(1))], message)


def _first_bad_row_message(
    error: Callable[[int, float], Exception],
) -> Callable[[Sequence[float]], Exception | None]:
    """The message of `_defer_first_bad_row` from ``(any bad, first bad row, its value)``."""

    def message(v: Sequence[float]) -> Exception | None:
        return error(int(v[1]), v[2]) if v[0] else None

    return message


def _check_finite_rows(
    name: str, values: torch.Tensor, rows: torch.Tensor, why: str, checks: DeferredChecks
) -> None:
    """``values [N]`` finite on ``rows [N] bool`` (else name the first bad row)."""
    if values.numel() == 0:
        return
    error = _not_finite_error(name, why)
    checks.add_rows(  # (bad, count, first row, its value): one launch on CUDA
        values, rows, "not_finite", lambda v: error(int(v[2]), v[3]) if v[0] else None
    )


def _not_finite_error(name: str, why: str) -> Callable[[int, float], Exception]:
    """The error of `_check_finite_rows` for ``(row, value)``."""
    return lambda row, value: ValueError(
        problem(
            f"{name} at row {row}",
            f"finite ({why})",
            f"{value}",
            "or set LossConfig(check_finite=False) to skip this check",
        )
    )


# ---------------------------------------------------------------- 3. sequences


# Local numbering and counts: `echoloss.loss.normalization.local_sequences` and `row_counts`,
# shared with `count_normalizers` (one counting rule for the loss and the normalisers).


# ---------------------------------------------------------------- 4. normalisers

_COUNT_NAMES = ("rl_tokens", "echo_tokens", "echo_batches", "rl_sequences", "echo_sequences")


class Divisors(NamedTuple):
    """Denominators a caller computed for one call, replacing the loss's own (the ``nn``
    modules: Liger's and TRL's divisors of one step).

    Each is a Python float (a constant of the call: no launch) or a 0-dim fp32 tensor on the
    loss's device (a count given as a tensor or all-reduced over ranks: read by the kernels,
    never by the host); None = the loss's own (its count, the given `Normalizers`, the config's
    constant).

    Attributes:
        rl: the RL term's divisor, in every RL mode: ``token_mean``'s RL-token count,
            ``token_sum_constant``'s constant, the ``sequence_mean*`` modes' ``S_RL``.
        echo: the echo term's divisor of ``token_mean`` (echo tokens) and ``sequence_mean``
            (``S_echo``); refused with ``batch_token_mean`` and ``sum``.

    Example:
        >>> Divisors(rl=4.0)
        Divisors(rl=4.0, echo=None)
    """

    rl: float | torch.Tensor | None = None
    echo: float | torch.Tensor | None = None


#: The loss's own divisors everywhere.
NO_DIVISORS = Divisors()

#: The echo modes whose divisor `Divisors.echo` replaces.
_ECHO_DIVIDED = ("token_mean", "sequence_mean")


def _divisor(
    given: float | torch.Tensor | None, count: int | torch.Tensor
) -> float | int | torch.Tensor:
    """The caller's divisor when given (used as is), else the count, at least 1."""
    return _at_least_one(count) if given is None else given


class _Counts(NamedTuple):
    """The denominators of one call: Python ints (given normalisers) or 0-dim device counts."""

    rl_tokens: int | torch.Tensor
    echo_tokens: int | torch.Tensor
    echo_batches: int | torch.Tensor
    rl_sequences: int | torch.Tensor
    echo_sequences: int | torch.Tensor


def _at_least_one(count: int | torch.Tensor) -> int | torch.Tensor:
    return max(count, 1) if isinstance(count, int) else count.clamp(min=1)


def _used_counts(cfg: LossConfig) -> list[str]:
    used = []
    if cfg.rl_normalization == "token_mean":
        used.append("rl_tokens")
    if cfg.rl_normalization.startswith("sequence"):
        used.append("rl_sequences")
    if cfg.echo_normalization == "token_mean":
        used.append("echo_tokens")
    if cfg.echo_normalization == "batch_token_mean":
        used.append("echo_batches")
    if cfg.echo_normalization == "sequence_mean":
        used.append("echo_sequences")
    return used


def _given_normalizers(normalizers: Any) -> Normalizers:
    """``normalizers`` if it is a `Normalizers`, else a TypeError naming it."""
    if not isinstance(normalizers, Normalizers):
        raise TypeError(
            problem(
                "normalizers",
                "echoloss.Normalizers or None (None = this call is the whole batch)",
                describe(normalizers),
            )
        )
    return normalizers


def _covers_message(name: str, given: int) -> Callable[[Sequence[float]], Exception | None]:
    """The message of the check that ``normalizers.<name>`` (``given``) is at least this
    call's own count (``v[0]``; for ``echo_batches`` the call's echo tokens, 1 if any)."""

    def message(v: Sequence[float]) -> Exception | None:
        loc = int(v[0])
        if name == "echo_batches":
            loc = min(loc, 1)  # this call is one micro-batch: it has echo rows or not
        if given >= loc:
            return None
        hint = (
            " (count_normalizers needs sequence_ids for the sequence_mean* modes)"
            if name.endswith("sequences") and given == 0
            else ""
        )
        return ValueError(
            f"normalizers.{name}={given} is smaller than this call's {loc}{hint}: normalizers "
            "must be the sum over every micro-batch of the step on every rank "
            "(count_normalizers for each micro-batch, summed, then all_reduce_normalizers)"
        )

    return message


def _resolve_normalizers(
    normalizers: Any, local: _Counts, cfg: LossConfig, checks: DeferredChecks
) -> _Counts:
    """``normalizers`` (checked to cover this call's own counts), or ``local`` when None."""
    if normalizers is None:
        return local
    given = _given_normalizers(normalizers)
    for name in _used_counts(cfg):
        checks.add([getattr(local, name)], _covers_message(name, getattr(given, name)))
    return _Counts(*(getattr(given, name) for name in _COUNT_NAMES))


# ---------------------------------------------------------------- 5. RL per-token loss


class _RLRows(NamedTuple):
    per_token: torch.Tensor  # [N] loss before normalisation, 0 outside RL rows
    means: dict[str, torch.Tensor]  # name -> [N] values reported as means over RL rows
    flags: dict[str, torch.Tensor]  # name -> [N] bool reported as fractions of RL rows


def _on_rows(rows: torch.Tensor, values: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``values [N]`` on ``rows``, 0 elsewhere, in ``like``'s dtype (0 when ``values`` is None).

    Rows outside ``rows`` may hold placeholders, even NaN: they are replaced, never multiplied.
    """
    if values is None:
        return torch.zeros_like(like)
    return torch.where(rows, values.reshape(-1).to(like.dtype), 0.0)


def _ratio_base(
    lp_rl: torch.Tensor, x: LossInputs, rl: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(base [N] detached, inference logprobs [N] or None)``: the ratio's denominator.

    Both are 0 outside the RL rows, where ``lp_rl`` is 0 too: the log ratio there is exactly 0.
    """
    lq = None if x.inference_logprobs is None else _on_rows(rl, x.inference_logprobs, lp_rl)
    if x.old_logprobs is not None:
        base = _on_rows(rl, x.old_logprobs, lp_rl)  # [N]
    elif cfg.mismatch is not None or lq is None:
        base = lp_rl.detach()  # [N] on-policy: the behaviour policy is the current one
    else:
        base = lq  # [N] prime-rl: the ratio is taken against the inference logprobs
    return base.detach(), lq


def kl_tau_penalty(log_ratio: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """``ρ²`` for ``|ρ| ≤ clamp``, continued linearly beyond (``2·clamp·|ρ| - clamp²``).

    Equal to prime-rl's ``ρ²`` wherever the log ratio is inside ``±log_ratio_clamp`` (20 by
    default: every realistic token); beyond it the gradient stays at ``±2·clamp`` instead of
    growing with ``ρ``, so a token whose logprob collapsed (``ρ ≈ -1e7`` at an extreme
    temperature) cannot overflow ``dlogits``. ``clamp=None`` is the plain square.

    Examples:
        >>> kl_tau_penalty(torch.tensor([0.5, -30.0]), 20.0).tolist()
        [0.25, 800.0]
    """
    if clamp is None:
        return log_ratio * log_ratio
    a = log_ratio.abs()  # [n]
    return torch.where(a <= clamp, log_ratio * log_ratio, 2.0 * clamp * a - clamp * clamp)  # [n]


def _policy_on_rows(
    fn: PolicyFn,
    spec: PolicySpec,
    inputs: PolicyInputs,
    x: LossInputs,
    seqs: LocalSequences,
    cfg: LossConfig,
) -> PolicyOutput:
    """The policy's per-token loss and flags as ``[N]`` tensors: the loss 0 outside RL rows,
    the flags as the policy set them there (the metrics count flags on RL rows only).

    A policy declared ``all_rows`` (every built-in one) runs on every row at once: rows that
    are not RL carry log ratio 0, advantage 0 and the padding sequence (``inputs.rows`` holds
    every row's fields), and their outputs are masked out, so nothing depends on the number of
    RL rows (no host read). Any other function receives the RL rows compacted, as documented
    for ``register_policy``: that needs their count and sequence count on the host (one sync
    per call). A per-call ``policy_fn`` declares ``all_rows`` with an attribute
    ``all_rows = True`` (``echoloss.nn``'s SAPO and sequence-level CISPO do).
    """
    rl = x.rl
    if spec.all_rows or (spec.fn is None and getattr(fn, "all_rows", False) is True):
        rows = RecordRows(x, torch.arange(rl.numel(), device=rl.device))
        out = check_policy_output(fn(inputs._replace(rows=rows), cfg), inputs.logprobs, cfg.policy)
        flags = dict(out.flags)  # rows that are not RL are masked by the metrics
        return PolicyOutput(torch.where(rl, out.loss, 0.0), flags)
    idx = rl.nonzero().squeeze(1)  # [n_rl]
    sidx = None if inputs.sequence_index is None else inputs.sequence_index.index_select(0, idx)
    lp_rl = inputs.logprobs.index_select(0, idx)  # [n_rl]
    compact = PolicyInputs(
        lp_rl,
        inputs.old_logprobs.index_select(0, idx),
        inputs.advantages.index_select(0, idx),
        sidx,
        int(seqs.num),
        RecordRows(x, idx),
    )
    out = check_policy_output(fn(compact, cfg), lp_rl, cfg.policy)
    loss = inputs.logprobs.new_zeros(rl.shape).index_copy(0, idx, out.loss.to(lp_rl.dtype))
    flags = {k: torch.zeros_like(rl).index_copy_(0, idx, f) for k, f in out.flags.items()}
    return PolicyOutput(loss, flags)


def _rl_per_token(
    lp: torch.Tensor,
    ent: torch.Tensor | None,
    x: LossInputs,
    seqs: LocalSequences,
    cfg: LossConfig,
    spec: PolicySpec,
    policy_fn: PolicyFn | None,
    checks: DeferredChecks,
) -> _RLRows:
    """The RL rows' per-token loss: policy × mismatch weight + kl_tau·ρ² + KL − entropy bonus.

    Every tensor is ``[N]``; rows that are not RL carry neutral values (log ratio 0, advantage
    0) and end with loss 0, so the result does not depend on how many RL rows there are.
    """
    rl = x.rl
    lp_rl = torch.where(rl, lp, 0.0)  # [N] differentiable on RL rows, 0 elsewhere
    if cfg.mode == "sft":
        return _RLRows(-lp_rl, {}, {})  # the SFT NLL
    adv = _on_rows(rl, x.advantages, lp_rl) * cfg.adv_tau  # [N]
    base, lq = _ratio_base(lp_rl, x, rl, cfg)  # [N], [N] or None
    clamp = cfg.log_ratio_clamp
    fn = spec.fn if spec.fn is not None else policy_fn
    assert fn is not None  # _check_requirements
    inputs = PolicyInputs(lp_rl, base, adv, seqs.rl_index, seqs.size)
    out = _policy_on_rows(fn, spec, inputs, x, seqs, cfg)
    per_tok = out.loss  # [N]
    if cfg.check_finite:
        _check_finite_rows(
            f"the loss of policy {cfg.policy!r}",
            per_tok,
            rl,
            "a policy's per-token loss; with log_ratio_clamp=None a ratio can overflow",
            checks,
        )
    means: dict[str, torch.Tensor] = {}
    flags = dict(out.flags)  # name -> [N] bool
    if cfg.mismatch is not None:
        assert lq is not None  # _check_requirements
        w, wf = mismatch_weights(
            base,
            lq,
            mode=cfg.mismatch,
            weight_max=cfg.mismatch_max,
            weight_min=cfg.mismatch_min,
            sequence_index=seqs.rl_index,
            num_sequences=seqs.size,
            log_ratio_clamp=clamp,
        )  # [N], flags
        per_tok = per_tok * w  # [N]
        flags.update(wf)  # rows that are not RL are masked by the metrics
        means["is_weight"] = w
    kl_tau = cfg.resolved_kl_tau
    if kl_tau != 0:
        per_tok = per_tok + kl_tau * kl_tau_penalty(lp_rl - base, clamp)  # [N]
    if cfg.kl_coef != 0:
        ref = _on_rows(rl, x.ref_logprobs, lp_rl)  # [N]
        kl = kl_penalty(lp_rl, ref, estimator=cfg.kl_estimator, log_ratio_clamp=clamp)  # [N]
        per_tok = per_tok + cfg.kl_coef * kl  # [N]
        means["ref_kl"] = kl.detach()
    if cfg.entropy_coef != 0:
        if ent is None:  # an error only when there are RL rows to read it on
            checks.add(
                [rl.any()],
                lambda v: (
                    ValueError(
                        f"entropy is required by entropy_coef={cfg.entropy_coef} ([N] per-token "
                        "entropy, differentiable)"
                    )
                    if v[0]
                    else None
                ),
            )
        else:
            if cfg.check_finite:
                _check_finite_rows(
                    "entropy", ent, rl, "the entropy bonus (entropy_coef) reads it", checks
                )
            per_tok = per_tok - cfg.entropy_coef * torch.where(rl, ent, 0.0)  # [N]
    if lq is not None:
        with torch.no_grad():
            means["mismatch_kl"] = k3(lp_rl - lq, clamp)  # [N]
    return _RLRows(per_tok, means, flags)


# ---------------------------------------------------------------- 6. the two terms


def _rl_term(
    per_tok: torch.Tensor,
    rl: torch.Tensor,
    cfg: LossConfig,
    norms: _Counts,
    seqs: LocalSequences,
    divisor: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``L_RL``: ``per_tok [N]`` (0 outside RL rows) normalised by ``cfg.rl_normalization``
    (``divisor``, `Divisors.rl`, replaces the mode's denominator when given)."""
    mode = cfg.rl_normalization
    if mode == "token_mean":
        return per_tok.sum() / _divisor(divisor, norms.rl_tokens)  # 0-dim
    if mode == "token_sum_constant":
        if divisor is not None:
            return per_tok.sum() / divisor  # 0-dim
        assert cfg.rl_normalization_constant is not None  # LossConfig
        return per_tok.sum() / cfg.rl_normalization_constant  # 0-dim
    assert seqs.rl_index is not None  # _check_requirements
    if mode == "sequence_mean_token_sum":
        return per_tok.sum() / _divisor(divisor, norms.rl_sequences)  # 0-dim
    # sequence_mean_token_mean: Σ_i (Σ_{t∈RL_i} ℓ_t / |RL_i|) / S_RL
    counts = _rl_rows_per_sequence(rl, seqs, per_tok.dtype)  # [S+1]
    per_seq = per_tok.new_zeros(seqs.size).index_add(0, seqs.rl_index, per_tok)  # [S+1]
    per_seq_mean = (per_seq / counts.clamp(min=1))[:-1]  # [N] the padding slot dropped
    return per_seq_mean.sum() / _divisor(divisor, norms.rl_sequences)  # 0-dim


def _rl_rows_per_sequence(
    rl: torch.Tensor, seqs: LocalSequences, dtype: torch.dtype
) -> torch.Tensor:
    """``[S + 1]`` in ``dtype``: the RL rows of each local sequence (the padding slot last)."""
    assert seqs.rl_index is not None  # _check_requirements
    counts = torch.zeros(seqs.size, dtype=dtype, device=rl.device)
    return counts.index_add_(0, seqs.rl_index, rl.to(dtype))


def _observation_counts(x: LossInputs, seqs: LocalSequences) -> torch.Tensor:
    """``Z [N + 1]``: rows counted in ``Z_i = |O_i|`` (observation or echo) per local sequence."""
    assert x.observation_mask is not None and seqs.row is not None  # _check_requirements
    counted = x.observation_mask.reshape(-1) | x.echo  # [N] Z_i ≥ |O'_i|
    index = torch.where(counted, seqs.row, seqs.pad)  # [N]
    ones = torch.ones_like(index, dtype=torch.int32)
    return torch.zeros(seqs.size, dtype=torch.int32, device=index.device).index_add_(0, index, ones)


def _echo_term(
    per_tok: torch.Tensor,
    x: LossInputs,
    cfg: LossConfig,
    norms: _Counts,
    n_echo: torch.Tensor,
    seqs: LocalSequences,
    divisor: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``L_echo``: ``per_tok = w·(-log p) [N]`` (0 outside echo rows) normalised by
    ``cfg.echo_normalization`` (``divisor``, `Divisors.echo`, replaces the denominator of
    ``token_mean`` and ``sequence_mean`` when given)."""
    mode = cfg.echo_normalization
    if mode == "token_mean":
        return per_tok.sum() / _divisor(divisor, norms.echo_tokens)  # 0-dim
    if mode == "sum":
        return per_tok.sum()  # 0-dim
    if mode == "batch_token_mean":
        return per_tok.sum() / n_echo.clamp(min=1) / _at_least_one(norms.echo_batches)  # 0-dim
    # sequence_mean: Σ_i (Σ_{t∈O'_i} w_t·nll_t / (Z_i + ε)) / S_echo
    assert seqs.echo_index is not None  # _check_requirements
    z = _observation_counts(x, seqs)  # [S+1]
    per_seq = per_tok.new_zeros(seqs.size).index_add(0, seqs.echo_index, per_tok)  # [S+1]
    denom = _echo_z_denominator(z, cfg.echo_z_epsilon, per_tok.dtype)  # [S+1]
    return (per_seq / denom)[:-1].sum() / _divisor(divisor, norms.echo_sequences)  # 0-dim


def _echo_z_denominator(z: torch.Tensor, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    """``Z_i + ε`` in ``dtype`` (any shape, per sequence or gathered per row), 1 where
    ``Z_i = 0``: a sequence without echo rows contributes 0, not 0/ε. With ε = 0 (the
    default) that is ``max(Z_i, 1)`` of the whole number ``Z_i``: two launches, not four."""
    if epsilon == 0.0:
        return z.to(dtype).clamp(min=1.0)
    return (z.to(dtype) + epsilon).masked_fill(z == 0, 1.0)


# ---------------------------------------------------------------- 6b. the final loss


class _Suspects(NamedTuple):
    """What a non-finite term is diagnosed from (read only when the final check fails)."""

    x: LossInputs
    rl_idx: torch.Tensor
    echo_idx: torch.Tensor
    ent: torch.Tensor | None
    cfg: LossConfig
    divisors: Divisors = NO_DIVISORS  # the caller's divisors (device ones read only here)


def _largest(name: str, values: torch.Tensor | None, rows: torch.Tensor) -> tuple[float, str]:
    """``(max |value|, "name (largest |value| = v at row r)")`` over ``rows``; (0, "") if none."""
    if values is None or rows.numel() == 0:
        return 0.0, ""
    v = values.detach().reshape(-1).index_select(0, rows).double().abs()  # [n]
    k = int(v.nan_to_num(nan=math.inf).argmax())
    big = float(v[k])
    return (
        math.inf if math.isnan(big) else big
    ), f"{name} (largest |value| {big:.3g} at row {int(rows[k])})"


def _rl_suspects(s: _Suspects) -> list[tuple[float, str]]:
    cfg = s.cfg
    out = [_largest("advantages", s.x.advantages, s.rl_idx)]
    if cfg.adv_tau != 1.0:
        out.append((cfg.adv_tau, f"adv_tau={cfg.adv_tau:g}"))
    if cfg.resolved_kl_tau:
        out.append((cfg.resolved_kl_tau, f"kl_tau={cfg.resolved_kl_tau:g}"))
    if cfg.kl_coef:
        out.append((cfg.kl_coef, f"kl_coef={cfg.kl_coef:g}"))
    if cfg.entropy_coef:
        big, _ = _largest("entropy", s.ent, s.rl_idx)
        out.append((abs(cfg.entropy_coef) * max(big, 1.0), f"entropy_coef={cfg.entropy_coef:g}"))
    given = s.divisors.rl
    if isinstance(given, torch.Tensor):
        # The divisor the call used (a device tensor; read on the host only to build this error).
        d = float(given)
        what = f"{cfg.rl_normalization}'s divisor of this call: the batch's RL tokens per process"
        out.append((1.0 / d, f"the RL divisor {d:g} ({what})"))
    elif cfg.rl_normalization == "token_sum_constant" and given is None:
        c = cfg.rl_normalization_constant
        assert c is not None  # LossConfig
        out.append((1.0 / c, f"rl_normalization_constant={c:g} (the divisor)"))
    return [o for o in out if o[1]]


def _echo_suspects(s: _Suspects) -> list[tuple[float, str]]:
    out = [_largest("echo_weights", s.x.echo_weights, s.echo_idx)]
    if isinstance(s.divisors.echo, torch.Tensor):  # read on the host only for this error
        d = float(s.divisors.echo)
        what = f"{s.cfg.echo_normalization}'s divisor of this call: the batch's echo tokens per process"
        out.append((1.0 / d, f"the echo divisor {d:g} ({what})"))
    if s.cfg.echo_normalization == "sequence_mean" and s.cfg.echo_z_epsilon:
        out.append((0.0, f"echo_z_epsilon={s.cfg.echo_z_epsilon:g}"))
    return [o for o in out if o[1]]


def check_final_loss(
    loss: torch.Tensor, rl_term: torch.Tensor, echo_term: torch.Tensor, suspects: Any = None
) -> None:
    """O(1): the 0-dim loss is finite, else raise naming the non-finite term and the likely input.

    Every per-token input is checked where it enters, but finite inputs can still overflow the
    sum: advantages or echo weights of 3e38, ``kl_tau=1e308``, ``entropy_coef=-1e38``, a
    divisor of 1e-300. One ``isfinite`` of the 0-dim loss (one host read) catches all of them;
    the diagnosis below runs only when it fails.

    Examples:
        >>> check_final_loss(torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0.0))
        >>> check_final_loss(torch.tensor(float("inf")), torch.tensor(float("inf")), torch.tensor(0.0))
        Traceback (most recent call last):
        ...
        echoloss.loss.core.NonFiniteLossError: loss must be finite, got inf (loss_rl (the RL term) = inf, loss_echo (the echo term) = 0); ...
    """
    if bool(torch.isfinite(loss)):
        return
    raise _final_loss_error(
        float(loss.detach()), float(rl_term.detach()), float(echo_term.detach()), suspects
    )


def _final_loss_error(
    loss: float, rl_term: float, echo_term: float, suspects: _Suspects | None
) -> NonFiniteLossError:
    """The error of a non-finite loss from the host values of the loss and its two terms."""
    terms = {"loss_rl (the RL term)": rl_term, "loss_echo (the echo term)": echo_term}
    parts = [f"{k} = {v:g}" for k, v in terms.items()]
    causes = []
    if suspects is not None:
        for term, finder in ((rl_term, _rl_suspects), (echo_term, _echo_suspects)):
            if not math.isfinite(term):
                found = sorted((o for o in finder(suspects) if o[0] > 0), key=lambda o: -o[0])
                if found:
                    causes.append(found[0][1] + "".join(f"; {f[1]}" for f in found[1:3]))
    fix = (
        "the checked inputs were finite, so a product, the sum or its scaling overflowed"
        + (f"; likely input: {' | '.join(causes)}" if causes else "")
        + "; bring that input to a realistic range (advantages and echo weights of order 1, "
        "coefficients well below 1e30, normalisers ≥ 1), or set LossConfig(check_finite=False) "
        "to skip this check"
    )
    got = f"{loss:g} ({', '.join(parts)})"
    return NonFiniteLossError(problem("loss", "finite", got, fix))


def _check_final_loss(
    loss: torch.Tensor,
    rl_term: torch.Tensor,
    echo_term: torch.Tensor,
    x: LossInputs,
    ent: torch.Tensor | None,
    cfg: LossConfig,
    checks: DeferredChecks,
    divisors: Divisors = NO_DIVISORS,
) -> None:
    """`check_final_loss` through ``checks``: the diagnosis (which reads the suspects' values,
    the device ``divisors`` included) runs only when the error is raised."""

    message = _final_loss_message(x, ent, cfg, divisors)
    checks.add([not_finite(loss), loss, rl_term, echo_term], message)


def _final_loss_message(
    x: LossInputs, ent: torch.Tensor | None, cfg: LossConfig, divisors: Divisors
) -> Callable[[Sequence[float]], Exception | None]:
    """The error of `_check_final_loss` from ``(not finite, loss, rl_term, echo_term)``."""

    def message(v: Sequence[float]) -> Exception | None:
        if not v[0]:
            return None
        rl_idx, echo_idx = x.rl.nonzero().squeeze(1), x.echo.nonzero().squeeze(1)
        suspects = _Suspects(x, rl_idx, echo_idx, ent, cfg, divisors)
        return _final_loss_error(v[1], v[2], v[3], suspects)

    return message


# ---------------------------------------------------------------- 7. metrics


def _env_of_rows(x: LossInputs, device: torch.device) -> tuple[torch.Tensor | None, list[str]]:
    """``([N] int64 env index of each row, -1 = none; the distinct env names)`` or ``(None, [])``.

    The name → index table goes to the device from pinned memory without blocking the host.
    """
    if x.env_names is None or x.sequence_ids is None:
        return None, []
    sid = x.sequence_ids.reshape(-1)  # (a copy of a [B, T] view: only with env names)
    env_list = sorted({e for e in x.env_names if e})
    lookup = {e: i for i, e in enumerate(env_list)}
    table = host_to_device([lookup.get(e, -1) for e in x.env_names], device)  # [ids]
    if table.numel() == 0:
        return torch.full_like(sid, -1, dtype=torch.long), env_list
    # Rows whose id is out of the table (padding -1) read entry 0: they are not RL or echo rows.
    return table[sid.long().clamp(0, table.numel() - 1)], env_list


def _metrics(
    x: LossInputs,
    rl: _RLRows,
    ent: torch.Tensor | None,
    cfg: LossConfig,
    echo_nll: torch.Tensor,
    totals: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    means = dict(rl.means)
    if ent is not None and (cfg.compute_entropy or cfg.entropy_coef != 0):
        means["entropy"] = ent.detach()  # [N]
    env_of_row, env_list = _env_of_rows(x, echo_nll.device)
    return loss_metrics(
        rl=x.rl,
        echo=x.echo,
        env_of_row=env_of_row,
        env_names=env_list,
        rl_means=means,
        rl_flags=rl.flags,
        echo_nll=echo_nll,
        totals=totals,
    )


# ---------------------------------------------------------------- the loss from logprobs


def label_check_on_device(
    labels: Any, num_classes: int, device: torch.device
) -> tuple[torch.Tensor, int] | None:
    """The ``label_check`` of `loss_from_logprobs` for an entry point whose logprob op leaves
    the labels' range to the loss: ``(labels [N] int64, V)`` on the device path (the fused
    algebra checks them in its own launch, the PyTorch algebra queues the op's check; the op
    then queues none: about twenty launches fewer), None on the host path (the op checks them
    at once). Labels that are not a tensor are left to the op's error.

    Examples:
        >>> label_check_on_device(torch.tensor([1, 2]), 5, torch.device("cpu")) is None
        True
    """
    if not on_device_path(device) or not isinstance(labels, torch.Tensor):
        return None
    return labels.reshape(-1).long(), num_classes


def loss_from_logprobs(
    lp: torch.Tensor,
    ent: torch.Tensor | None,
    x: LossInputs,
    cfg: LossConfig,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
    *,
    source: str,
    spec: PolicySpec | None = None,
    checks: DeferredChecks | None = None,
    divisors: Divisors = NO_DIVISORS,
    label_check: tuple[torch.Tensor, int] | None = None,
) -> LossOutput:
    """The loss algebra shared by every entry point, on ``[N]`` logprobs already scored.

    Every step works on ``[N]`` tensors with the RL and echo rows selected by mask arithmetic,
    so on the device path nothing is read back to the host (built-in policies; see
    ``echoloss/_deferred.py`` for when value errors are raised there).

    Args:
        lp: ``[N]`` logprobs (differentiable); rows that do not participate are never read.
        ent: ``[N]`` entropy or None.
        x: the validated record.
        cfg: the loss config.
        normalizers: global counts or None (this call is the whole batch).
        policy_fn: the per-call policy of ``policy="custom"``, else None.
        source: the argument the logprobs came from, for error messages.
        spec: the policy's spec when the requirements were already checked.
        checks: the call's value checks so far (submitted here); None = a new set.
        divisors: the caller's denominators of the two terms (`Divisors`), replacing the
            loss's own; each a Python float or a 0-dim fp32 tensor on ``lp``'s device.
        label_check: ``(labels [N], V)`` when the logprob op left the range check of the
            participating labels to this call (device path, fused algebra expected): the
            fused launch checks them; the PyTorch algebra queues the op's own check.

    Returns:
        [`LossOutput`][echoloss.loss.LossOutput].
    """
    checks = DeferredChecks(lp.device) if checks is None else checks
    if divisors.echo is not None and cfg.echo_normalization not in _ECHO_DIVIDED:
        raise ValueError(
            f"divisors.echo: replaces the divisor of echo_normalization {_ECHO_DIVIDED}, got "
            f"echo_normalization={cfg.echo_normalization!r} (pass None)"
        )
    if spec is None:
        spec = check_requirements(x, cfg, policy_fn, checks)
    if fused_algebra_applies(lp, ent, x, cfg, normalizers, policy_fn):
        loss, metrics = _fused_algebra(
            lp, ent, x, cfg, normalizers, source, checks, divisors, label_check
        )
    else:
        if label_check is not None and on_device_path(lp.device):
            labels_checked_on_device(label_check[0], x.rl | x.echo, label_check[1])
        algebra = _algebra
        if _COMPILE.options is not None and on_device_path(lp.device):
            algebra = _compiled_algebra()
        loss, metrics = algebra(
            lp, ent, x, cfg, normalizers, policy_fn, source, spec, checks, divisors
        )
    checks.submit()
    return LossOutput(loss, metrics)


# ---------------------------------------------------------------- the fused algebra

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


#: The built-in policies the fused algebra computes (registered ones run the PyTorch algebra).
_FUSED_POLICIES = frozenset(
    {"dppo", "ppo_clip", "cispo", "reinforce", "gspo", "cispo_sequence", "sapo", "sapo_sequence"}
)


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
    if _COMPILE.options is not None:  # the compiled region of compile_loss_algebra runs instead
        return False
    if ent is not None and ent.dtype != torch.float32:
        return False
    return _fused_algebra_covers(
        lp.device, lp.dtype, ent is not None, x, cfg, normalizers, policy_fn
    )


def _fused_algebra_covers(
    device: torch.device,
    lp_dtype: torch.dtype,
    has_entropy: bool,
    x: LossInputs,
    cfg: LossConfig,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
) -> bool:
    """`fused_algebra_applies` before the logprobs exist (their device, dtype, entropy)."""
    if _COMPILE.options is not None or not _triton_row_algebra_runs(device):
        return False
    if lp_dtype != torch.float32:
        return False
    if policy_fn is not None or (cfg.mode == "rl" and cfg.policy not in _FUSED_POLICIES):
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


def _row_algebra_params(
    cfg: LossConfig, ent: torch.Tensor | None, x: LossInputs, normalizers: Normalizers | None
) -> Any:
    from echoloss.ops.row_algebra import RowAlgebraParams

    rl_mode = cfg.mode == "rl"
    low: float | None
    high: float
    if cfg.mode == "sft":
        policy, low, high = "sft", None, 0.0
    elif cfg.policy == "dppo":
        policy, low, high = "dppo", cfg.dppo_low, cfg.dppo_high
    elif cfg.policy in ("ppo_clip", "gspo"):
        policy, (low, high) = cfg.policy, cfg.resolved_eps
    elif cfg.policy in ("cispo", "cispo_sequence"):
        policy, low, high = cfg.policy, cfg.cispo_min, cfg.cispo_max
    elif cfg.policy in ("sapo", "sapo_sequence"):
        policy, low, high = cfg.policy, None, 0.0  # the temperatures below
    else:
        policy, low, high = "reinforce", None, 0.0
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
        high=high,
        dual_clip=cfg.dual_clip if policy == "ppo_clip" else None,
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
        sequence_ids=x.sequence_ids if x._sequences_in_order else x.flat("sequence_ids"),
        observation=x.flat("observation_mask"),
        ref_logprobs=x.flat("ref_logprobs"),
        sequences_in_order=x._sequences_in_order,
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


def _fused_algebra(
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
    """`_algebra` for a call `fused_algebra_applies` to: one launch of the row algebra, its
    check numbers queued with the messages of the PyTorch algebra's checks, in its order
    (the labels' range first, as the logprob op queues it before the loss)."""
    from echoloss.ops.row_algebra import STAT_SLOTS, row_algebra

    params = _row_algebra_params(cfg, ent, x, normalizers)
    # The caller's divisors: a float is the program's constant, a tensor read by the program.
    rl_host, rl_device = _host_or_device(divisors.rl)
    echo_host, echo_device = _host_or_device(divisors.echo)
    params = dataclasses.replace(
        params,
        logprobs_given=source == "logprobs",
        rl_divisor=params.rl_divisor if rl_host is None else rl_host,
        echo_divisor=params.echo_divisor if echo_host is None else echo_host,
    )
    env_of_row, env_list = _env_of_rows(x, lp.device)  # per-env metrics: one program per env
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
        first.append((_scored_rows_message(source), _check_slots("scored")))
    later: list[tuple[Callable[[Sequence[float]], Exception | None], list[int]]] = []
    if normalizers is not None:  # the given counts must cover this call's own
        given = _given_normalizers(normalizers)
        checks.add_packed(out.checks, first)
        first = []
        # The call's counts are read where the row program wrote them (no launch); a call
        # echoes a row (`echo_batches`) when it has an echo token.
        slot = {"echo_batches": "echo_tokens"}
        checks.add_packed(
            s,
            [
                (
                    _covers_message(name, getattr(given, name)),
                    [STAT_SLOTS.index(slot.get(name, name))],
                )
                for name in _used_counts(cfg)
            ],
        )
    if cfg.check_finite:
        if cfg.mode == "rl":
            name = f"the loss of policy {cfg.policy!r}"
            why = "a policy's per-token loss; with log_ratio_clamp=None a ratio can overflow"
            later.append(
                (_first_bad_row_message(_not_finite_error(name, why)), _check_slots("policy"))
            )
            if params.entropy_coef != 0:
                why = "the entropy bonus (entropy_coef) reads it"
                later.append(
                    (
                        _first_bad_row_message(_not_finite_error("entropy", why)),
                        _check_slots("entropy"),
                    )
                )
        later.append((_final_loss_message(x, ent, cfg, divisors), _check_slots("loss")))
    if first or later:  # one block, no launch (two around the normalisers' checks)
        checks.add_packed(out.checks, first + later)
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


# ---------------------------------------------------------------- chunk-additive losses

#: Built-in policies whose per-token loss depends on that token alone.
_ROW_SEPARABLE_POLICIES = frozenset({"dppo", "ppo_clip", "cispo", "reinforce", "sapo"})


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


def _rows_of(x: LossInputs, idx: torch.Tensor) -> LossInputs:
    """The record's per-token fields on rows ``idx``, without validating them again (they
    were validated in ``x``); sequence ids, env names and the temperature are left out (a
    chunk-additive loss reads none of them)."""
    sub = object.__new__(LossInputs)
    for f in dataclasses.fields(LossInputs):
        value = getattr(x, f.name)
        if f.name in ("sequence_ids", "env_names"):
            value = None
        elif f.name == "temperature":
            value = 1.0
        elif f.name == "_versions":
            value = ()
        elif isinstance(value, torch.Tensor):
            value = value.reshape(-1).index_select(0, idx)
        object.__setattr__(sub, f.name, value)
    return sub


def unchecked_inputs(
    *,
    split: tuple[torch.Tensor, torch.Tensor] | None = None,
    sequences_in_order: bool = False,
    **fields: Any,
) -> LossInputs:
    """A `LossInputs` of ``fields`` whose tensors' values the caller has checked itself: the
    ``echoloss.nn`` modules check each argument as passed (named as passed, on the rows where
    it is read: `check_float_values`, `check_echo_weight_values`) and derive the rest, so
    their record is not validated a second time (under the record's field names, and about a
    hundred launches per call on a GPU). Also for `row_coefficients` before the logprobs
    exist. Metadata is not checked either; ``env_names`` (host strings) is, as `LossInputs`
    checks it. ``split``: the flat ``(rl, echo)`` rows when the caller has them already
    (exactly `split_rows` of ``rl_mask`` and ``echo_weights``), else they are derived.
    ``sequences_in_order``: the caller built ``sequence_ids`` never decreasing along the rows
    (the fused algebra then skips their sort; a wrong promise gives wrong sequence sums).

    Examples:
        >>> x = unchecked_inputs(rl_mask=torch.tensor([True, True]),
        ...                      echo_weights=torch.tensor([0.0, 0.5]))
        >>> x.rl.tolist(), x.echo.tolist()
        ([True, False], [False, True])
    """
    names = {f.name for f in dataclasses.fields(LossInputs) if f.init}
    if set(fields) - names:
        raise TypeError(f"unchecked_inputs: unknown fields {sorted(set(fields) - names)}")
    x = object.__new__(LossInputs)
    for f in dataclasses.fields(LossInputs):
        if f.init:
            value = fields.get(f.name, f.default)
            object.__setattr__(x, f.name, value)
    ew = x.echo_weights
    if split is None:
        split = split_rows(x.rl_mask.reshape(-1), None if ew is None else ew.reshape(-1))
    rl, echo = split
    object.__setattr__(x, "_sequences_in_order", sequences_in_order)
    object.__setattr__(x, "rl", rl)
    object.__setattr__(x, "echo", echo)
    object.__setattr__(x, "_versions", ())
    if x.env_names is not None:
        object.__setattr__(x, "env_names", x._checked_env_names())
    return x


def row_coefficients(
    x: LossInputs,
    cfg: LossConfig,
    spec: PolicySpec,
    normalizers: Normalizers | None,
    *,
    divisors: Divisors = NO_DIVISORS,
    own_old_logprobs: bool = False,
) -> Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]:
    """For a `chunk_additive` loss: ``fn(rows, logprobs [c], entropy [c] or None) -> (a, b)``,
    the derivatives ``d loss / d logprob`` and ``d loss / d entropy`` (None when the entropy is
    not trained) of rows ``rows``, from those rows alone.

    The rows' loss is the loss algebra itself (`_rl_per_token`, `_rl_term`, `_echo_term`) on
    the rows' fields with the call's denominators (counted on all rows here;
    ``divisors`` as in `loss_from_logprobs`), differentiated by autograd: the same
    operations per row as the whole loss, so the same derivatives. Value checks are left to
    the whole loss, which runs them once. ``own_old_logprobs``: the ratio's denominator of each
    row is its own logprob, detached (on-policy, as ``echoloss.nn`` without old logprobs, whose
    whole loss reads ``old_logprobs = logprobs.detach()``); ``x.old_logprobs`` is then unread.
    """
    # The whole record's sequences (only where a normaliser is per sequence), counted as the
    # whole loss counts them (`local_sequences`, `row_counts`).
    seqs_all = local_sequences(x) if reads_sequences(cfg, None) else _no_sequences(x)
    local = row_counts(x, seqs_all)
    counts = _Counts(
        rl_tokens=local.rl_tokens,
        echo_tokens=local.echo_tokens,
        echo_batches=local.echo_batches,
        rl_sequences=local.rl_sequences,
        echo_sequences=local.echo_sequences,
    )
    n_echo = local.echo_tokens
    discard = DeferredChecks(x.device)
    discard.deferred = True  # never submitted: the whole loss runs (and reports) the checks
    norms = _resolve_normalizers(normalizers, counts, cfg, discard)
    rl_rows, z_rows = _sequence_counts_of_rows(x, cfg, seqs_all)  # [N] per row, or None
    fn = spec.fn
    assert fn is not None  # chunk_additive: a built-in policy (or sft)

    def coefficients(
        rows: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        sub = _rows_of(x, rows)
        if own_old_logprobs:
            object.__setattr__(sub, "old_logprobs", lp.detach())
        seqs = LocalSequences(rows.numel() + 1, None, None, None, 0, 0, 0)
        lp_leaf = lp.detach().requires_grad_()
        ent_leaf = None if ent is None else ent.detach()
        if ent_leaf is not None and cfg.entropy_coef != 0:
            ent_leaf.requires_grad_()
        rl = _rl_per_token(lp_leaf, ent_leaf, sub, seqs, cfg, spec, None, discard)
        lp_echo = torch.where(sub.echo, lp_leaf, 0.0)
        w_echo = _on_rows(sub.echo, sub.echo_weights, lp_echo)
        if cfg.rl_normalization == "sequence_mean_token_mean":
            # Σ_i (Σ_t ℓ_t / |RL_i|) / S_RL, as `_rl_term` with each row's |RL_i| gathered:
            # the same operations per row (a division by its sequence's count, then by S_RL)
            assert rl_rows is not None
            count = rl_rows.index_select(0, rows).to(lp_leaf.dtype).clamp(min=1)  # [c]
            rl_term = (rl.per_token / count).sum() / _divisor(divisors.rl, norms.rl_sequences)
        elif cfg.rl_normalization == "sequence_mean_token_sum":
            rl_term = rl.per_token.sum() / _divisor(divisors.rl, norms.rl_sequences)
        else:
            rl_term = _rl_term(rl.per_token, sub.rl, cfg, norms, seqs, divisors.rl)
        if cfg.echo_normalization == "sequence_mean":  # Σ_i (Σ_t w·nll / (Z_i + ε)) / S_echo
            assert z_rows is not None
            z = z_rows.index_select(0, rows)  # [c]
            denom = _echo_z_denominator(z, cfg.echo_z_epsilon, lp_leaf.dtype)
            per_row = (w_echo * -lp_echo) / denom  # [c]
            echo_term = per_row.sum() / _divisor(divisors.echo, norms.echo_sequences)
        else:
            echo_term = _echo_term(w_echo * -lp_echo, sub, cfg, norms, n_echo, seqs, divisors.echo)
        wrt = [lp_leaf] + ([ent_leaf] if ent_leaf is not None and ent_leaf.requires_grad else [])
        grads = torch.autograd.grad(rl_term + echo_term, wrt, allow_unused=True)
        a = torch.zeros_like(lp) if grads[0] is None else grads[0]
        b = None if len(grads) < 2 else grads[1]
        return a, (torch.zeros_like(lp) if b is None and len(grads) == 2 else b)

    return coefficients


def _sequence_counts_of_rows(
    x: LossInputs, cfg: LossConfig, seqs: LocalSequences
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per row, the per-sequence counts `_rl_term` and `_echo_term` divide by (``[N]`` int32:
    its sequence's RL rows; its sequence's ``Z_i``), gathered from the same ``[S + 1]``
    counts; each None where that normaliser is not per sequence."""
    rl_rows = z_rows = None
    if cfg.rl_normalization == "sequence_mean_token_mean":
        assert seqs.rl_index is not None  # check_requirements
        rl_rows = _rl_rows_per_sequence(x.rl, seqs, torch.int32).index_select(0, seqs.rl_index)
    if cfg.echo_normalization == "sequence_mean":
        assert seqs.echo_index is not None  # check_requirements
        z_rows = _observation_counts(x, seqs).index_select(0, seqs.echo_index)  # [N]
    return rl_rows, z_rows


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


def _no_sequences(x: LossInputs) -> LocalSequences:
    return LocalSequences(x.rl.numel() + 1, None, None, None, 0, 0, 0)


class _CompileState:
    options: dict[str, Any] | None = None  # torch.compile options; None = eager
    fn: Any = None


_COMPILE = _CompileState()


def compile_loss_algebra(enabled: bool = True, **options: Any) -> None:
    """Run the ``[N]`` loss algebra (everything between the two phases) as a compiled region.

    On the device path (CUDA) the algebra after the logprobs (policy, normalisers, echo term,
    metrics and the device-side checks) is many small kernels; with this switch it runs through
    ``torch.compile(**options)`` (default ``dynamic=False``: static shapes, one compile per
    micro-batch shape and configuration), which fuses them. Off by default: the first call of
    each shape pays the compile. The region traces without graph breaks for the built-in
    policies (``tests/loss/test_host_syncs.py``); its launch count on a GPU is not measured yet.

    Args:
        enabled: turn the compiled region on (True) or off (False).
        **options: keyword arguments of ``torch.compile`` (e.g. ``mode="max-autotune"``).

    Examples:
        >>> compile_loss_algebra(False)  # the default: eager
    """
    _COMPILE.options = ({"dynamic": False} | options) if enabled else None
    _COMPILE.fn = None


def _compiled_algebra() -> Any:
    if _COMPILE.fn is None:
        _COMPILE.fn = torch.compile(_algebra, **(_COMPILE.options or {}))
    return _COMPILE.fn


def _algebra(
    lp: torch.Tensor,
    ent: torch.Tensor | None,
    x: LossInputs,
    cfg: LossConfig,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
    source: str,
    spec: PolicySpec,
    checks: DeferredChecks,
    divisors: Divisors = NO_DIVISORS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The body of `loss_from_logprobs`: ``(loss, metrics)`` from the ``[N]`` logprobs."""
    if cfg.check_finite:
        check_scored_rows(lp, x.rl, x.echo, source, checks)
    # Local sequences only where a sequence-level quantity reads them (a sort and a dozen small
    # launches otherwise spent for nothing); their counts are then 0 and never used.
    seqs = local_sequences(x) if reads_sequences(cfg, policy_fn) else _no_sequences(x)
    counts = row_counts(x, seqs)  # 0-dim device counts, as count_normalizers counts
    n_echo = counts.echo_tokens
    local = _Counts(
        rl_tokens=counts.rl_tokens,
        echo_tokens=n_echo,
        echo_batches=counts.echo_batches,
        rl_sequences=counts.rl_sequences,
        echo_sequences=counts.echo_sequences,
    )
    norms = _resolve_normalizers(normalizers, local, cfg, checks)

    rl = _rl_per_token(lp, ent, x, seqs, cfg, spec, policy_fn, checks)
    rl_term = _rl_term(rl.per_token, x.rl, cfg, norms, seqs, divisors.rl)  # 0-dim

    # Echo rows: -w · logprob, no ratio / trust region / KL / adv_tau.
    lp_echo = torch.where(x.echo, lp, 0.0)  # [N]
    w_echo = _on_rows(x.echo, x.echo_weights, lp_echo)  # [N]
    echo_term = _echo_term(w_echo * -lp_echo, x, cfg, norms, n_echo, seqs, divisors.echo)

    # Connected to the graph through lp even without any RL or echo row (then exactly 0 with
    # zero gradients): distributed backward must not hang.
    loss = rl_term + echo_term  # 0-dim
    if cfg.check_finite:
        _check_final_loss(loss, rl_term, echo_term, x, ent, cfg, checks, divisors)
    metrics = _metrics(
        x, rl, ent, cfg, -lp_echo.detach(), {"loss_rl": rl_term, "loss_echo": echo_term}
    )
    checks.pack()  # inside the compiled region (when on): only the copy to the host is left
    return loss, metrics


def echo_loss_from_logprobs(
    logprobs: torch.Tensor,
    inputs: LossInputs | None = None,
    *,
    entropy: torch.Tensor | None = None,
    config: LossConfig | None = None,
    normalizers: Normalizers | None = None,
    policy_fn: PolicyFn | None = None,
    **fields: Any,
) -> LossOutput:
    """The loss of [`echo_loss`][echoloss.loss.echo_loss] from per-token logprobs (and entropy) computed elsewhere.

    ``logprobs`` must already be at the right temperature per row (sampling temperature on RL
    rows; see ``LossConfig.echo_temperature`` for echo rows): the record's ``labels`` and
    ``temperature`` are not read here. Values on rows that do not participate are never read.

    Args:
        logprobs: ``[N]`` float, differentiable.
        inputs: the per-token inputs (`echoloss.LossInputs`, shape ``[N]``).
        entropy: ``[N]`` per-token entropy: required when ``config.entropy_coef != 0``; used for
            the ``entropy`` metric when given.
        config, normalizers, policy_fn: as in [`echo_loss`][echoloss.loss.echo_loss].
        **fields: the keyword form, instead of ``inputs``: fields of `echoloss.LossInputs` by
            name (``rl_mask=``, ``advantages=``, ...).

    Returns:
        [`LossOutput`][echoloss.loss.LossOutput].

    Examples:
        >>> from echoloss.loss import LossInputs
        >>> lp = torch.tensor([-0.2, -0.4], requires_grad=True)
        >>> x = LossInputs(rl_mask=torch.tensor([True, False]), echo_weights=torch.tensor([0.0, 0.5]),
        ...                advantages=torch.tensor([1.0, 0.0]),
        ...                inference_logprobs=torch.tensor([-0.2, 0.0]))
        >>> out = echo_loss_from_logprobs(lp, x)
        >>> out.loss  # RL: -1·1·r(=1) / 1 token; echo: -0.5·(-0.4) / 1 token
        tensor(-0.8000, grad_fn=<AddBackward0>)
        >>> out.loss.backward(); lp.grad
        tensor([-1.0000, -0.5000])
    """
    raise_deferred_errors(block=False)
    return logprobs_loss(logprobs, inputs, entropy, config, normalizers, policy_fn, fields)


def logprobs_loss(
    logprobs: torch.Tensor,
    inputs: LossInputs | None,
    entropy: torch.Tensor | None,
    config: LossConfig | None,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
    fields: dict[str, Any],
    *,
    checks: DeferredChecks | None = None,
    divisors: Divisors = NO_DIVISORS,
    label_check: tuple[torch.Tensor, int] | None = None,
) -> LossOutput:
    """The body of `echo_loss_from_logprobs`, for callers (the ``echoloss.nn`` modules) that
    bring their own value ``checks`` (checked before these, reported in one submission), a
    caller's ``divisors`` or the ``label_check`` their logprob op left to the loss (see
    `loss_from_logprobs`)."""
    logprobs = check_tensor("logprobs", logprobs)
    if not logprobs.dtype.is_floating_point:
        raise TypeError(problem("logprobs", "a float tensor", describe(logprobs)))
    if isinstance(inputs, torch.Tensor):
        raise TypeError(problem("inputs", "an echoloss.LossInputs record", describe(inputs)))
    x = resolve_inputs(
        inputs, fields, shape=logprobs.shape, device=logprobs.device, source="logprobs"
    )
    cfg = check_config(config)
    checks = DeferredChecks(logprobs.device) if checks is None else checks
    ent = None
    if entropy is not None:
        ent = check_per_token("entropy", entropy, x.shape, x.device, "float").reshape(-1)  # [N]
        if cfg.check_finite:
            _check_entropy(ent, x.rl, checks)
    return loss_from_logprobs(
        logprobs.reshape(-1),
        ent,
        x,
        cfg,
        normalizers,
        policy_fn,
        source="logprobs",
        checks=checks,
        divisors=divisors,
        label_check=label_check,
    )


#: Most negative entropy accepted from a caller: an entropy is ≥ 0; one computed in fp32 from a
#: near-one-hot distribution may round a few ulps below 0, never by this much.
ENTROPY_TOLERANCE = 1e-3


def _check_entropy(ent: torch.Tensor, rl: torch.Tensor, checks: DeferredChecks) -> None:
    """The caller's entropy on RL rows (where it is read): finite and ≥ 0 (up to rounding)."""
    if ent.numel() == 0:
        return
    _defer_first_bad_row(
        checks,
        rl & ~((ent >= -ENTROPY_TOLERANCE) & (ent < math.inf)),  # [N] NaN fails both
        ent,
        lambda row, value: ValueError(
            problem(
                f"entropy[{row}]",
                f"a finite entropy ≥ 0 (up to -{ENTROPY_TOLERANCE}) on an RL row",
                repr(value),
                "pass the per-token entropy -Σ p log p of the model's distribution",
            )
        ),
    )


def row_temperature_and_entropy(
    temperature: float | torch.Tensor,
    config: LossConfig,
    *,
    rl: torch.Tensor,
    echo: torch.Tensor,
    lead: torch.Size,
) -> tuple[float | torch.Tensor, bool]:
    """The temperature each row is scored at, and whether the entropy must be computed.

    Echo rows are scored at T = 1 unless ``config.echo_temperature == "sampling"``
    (``docs/loss.md``, "Echo temperature"); RL rows keep their sampling temperature. The entropy
    is needed when there are RL rows and it is reported or trained. Shared by every entry point
    that computes logprobs for the loss (logits, fused-linear).

    Args:
        temperature: a float, or ``lead``-shaped per-row temperatures (already checked).
        config: the loss config.
        rl: ``[N]`` bool RL rows (flat).
        echo: ``[N]`` bool echo rows (flat).
        lead: the leading (row) shape of the logits.

    Returns:
        ``(temperature, need_entropy)``; the temperature is ``lead``-shaped when echo rows
        change it, else as given. A scalar temperature becomes an fp64 tensor (every digit of a
        Python float kept; the op casts it to its compute dtype).

    Examples:
        >>> t, ent = row_temperature_and_entropy(
        ...     0.5, LossConfig(), rl=torch.tensor([True, False]),
        ...     echo=torch.tensor([False, True]), lead=torch.Size([2]))
        >>> t.tolist(), ent
        ([0.5, 1.0], True)
    """
    temp: float | torch.Tensor = temperature
    device_path = on_device_path(rl.device)
    # On the device path whether there are echo / RL rows is not read: the per-row
    # temperature is built whenever echo rows could change it, the entropy computed whenever
    # it is reported or trained.
    if config.echo_temperature == "one" and (device_path or bool(echo.any())):
        if isinstance(temperature, torch.Tensor):
            temp = temperature.reshape(-1).masked_fill(echo, 1.0).view(lead)
        elif float(temperature) != 1.0:
            full = torch.full(lead, float(temperature), dtype=torch.float64, device=rl.device)
            temp = full.view(-1).masked_fill_(echo, 1.0).view(lead)
    need_entropy = (device_path or bool(rl.any())) and (
        config.compute_entropy or config.entropy_coef != 0
    )
    return temp, need_entropy


@compiler_disable
def echo_loss(
    logits: torch.Tensor,
    inputs: LossInputs | torch.Tensor | None = None,
    *,
    config: LossConfig | None = None,
    normalizers: Normalizers | None = None,
    backend: str = "auto",
    chunk_size: int | None = None,
    policy_fn: PolicyFn | None = None,
    **fields: Any,
) -> LossOutput:
    """RL loss on action rows plus echo cross-entropy on observation rows, from logits.

    ``loss = L_RL + L_echo``. ``L_RL`` is the configured policy loss (``config.policy``) over RL
    rows, plus ``kl_tau · ρ²``, the optional reference KL and entropy bonus, normalised by
    ``config.rl_normalization``. ``L_echo = Σ_{echo rows} w_t · (-log p_t)`` normalised by
    ``config.echo_normalization``: no importance ratio, trust region, KL, advantage or
    ``adv_tau``, so ``d loss / d log p_t = -w_t / N_echo`` under the default normaliser. Both terms
    share one chunked log-softmax ([`echoloss.selective_logprobs`][echoloss.ops.selective_logprobs]), computed only on rows that
    participate. ``docs/loss.md`` has every formula and decision.

    Two call forms, the same loss:

    - ``echo_loss(logits, inputs)`` with a `echoloss.LossInputs` record (built by
      ``LossInputs.from_targets(next_token_targets(batch))`` or by hand);
    - the keyword form ``echo_loss(logits, labels, rl_mask=..., echo_weights=..., ...)``: every
      field of the record by name (`LossInputs.from_keywords` builds the record), so every field
      the record gains is a keyword here too.

    Args:
        logits: ``[N, V]`` (or ``[B, T, V]``, then every per-token input is ``[B, T]``), any float
            dtype; logprobs are computed in fp32 (fp64 for fp64 logits).
        inputs: the per-token inputs (`echoloss.LossInputs`, ``labels`` required), or the
            labels tensor of the keyword form.
        config: [`echoloss.LossConfig`][echoloss.loss.config.LossConfig]; None = defaults (dppo, token means).
        normalizers: global counts ([`echoloss.Normalizers`][echoloss.loss.normalization.Normalizers]) of the optimiser step; None
            means "this call is the whole batch".
        backend: ``"auto"``, ``"reference"`` or ``"triton"`` (see [`echoloss.selective_logprobs`][echoloss.ops.selective_logprobs]).
        chunk_size: rows per chunk of the logprob computation (None = automatic).
        policy_fn: ``fn(PolicyInputs, LossConfig) -> PolicyOutput`` for ``policy="custom"``
            (or register it once with [`echoloss.loss.register_policy`][echoloss.loss.policy.register_policy]).
        **fields: the keyword form, instead of a record: fields of `echoloss.LossInputs` by
            name, with the same meaning and shapes.

    Returns:
        [`LossOutput`][echoloss.loss.LossOutput] ``(loss, metrics)``.

    Raises:
        TypeError, ValueError: on a bad input (the message names the argument and the fix), on
            echo rows with ``mode="sft"``, with a custom policy unless allowed, or on a
            participating row whose logprob is not finite (NaN/inf logits; ``check_finite``).

    Examples:
        Golden case B (logits chosen so that log p = [-0.2, -0.4]):

        >>> import torch
        >>> from echoloss.loss import LossConfig, LossInputs, Normalizers
        >>> lp = torch.tensor([-0.2, -0.4])
        >>> logits = torch.stack([lp, torch.log(-torch.expm1(lp))], 1).requires_grad_()
        >>> x = LossInputs(labels=torch.tensor([0, 0]), rl_mask=torch.tensor([True, True]),
        ...                echo_weights=torch.tensor([0.0, 2.0]), advantages=torch.tensor([1.0, 2.0]),
        ...                inference_logprobs=lp)
        >>> cfg = LossConfig(dppo_low=10, dppo_high=10, kl_tau=0)
        >>> out = echo_loss(logits, x, config=cfg, normalizers=Normalizers(rl_tokens=1, echo_tokens=4))
        >>> # RL rows: row 0 only (row 1 is echoed); echo_loss_scale 4 as in the golden case
        >>> round(out.loss.item(), 5)  # RL -1.0 + echo -(2·-0.4)/4 = 0.2
        -0.8
        >>> float(out.metrics["echo_tokens/all"])
        1.0
    """
    raise_deferred_errors(block=False)
    logits = check_tensor("logits", logits)
    if not logits.dtype.is_floating_point or logits.dim() not in (2, 3):
        raise TypeError(problem("logits", "a float tensor [N, V] or [B, T, V]", describe(logits)))
    lead = logits.shape[:-1]
    x = resolve_inputs(inputs, fields, shape=lead, device=logits.device, source="logits")
    if x.labels is None:
        raise ValueError(
            "labels is required by echo_loss ([N] int64, the token each logits row predicts): "
            "set LossInputs(labels=...) (from_targets takes them from next_token_targets)"
        )
    cfg = check_config(config)
    checks = DeferredChecks(logits.device)
    spec = check_requirements(x, cfg, policy_fn, checks)
    temp, need_ent = row_temperature_and_entropy(
        x.temperature, cfg, rl=x.rl, echo=x.echo, lead=lead
    )
    # The fused algebra checks the labels' range in its own launch (about ten launches fewer).
    lp_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    fused = on_device_path(logits.device) and _fused_algebra_covers(
        logits.device, lp_dtype, need_ent, x, cfg, normalizers, policy_fn
    )
    op = selective_logprobs_checked_by_caller if fused else selective_logprobs
    with checks.collecting():  # the op's checks of labels and temperatures join the call's
        res = op(
            logits,
            x.labels,
            temperature=temp,
            return_entropy=need_ent,
            chunk_size=chunk_size,
            mask=(x.rl | x.echo).view(lead),
            backend=backend,
        )
    lp, ent = res if isinstance(res, tuple) else (res, None)
    lp = lp.reshape(-1)  # [N]
    ent = None if ent is None else ent.reshape(-1)  # [N]
    if ent is not None and cfg.entropy_coef == 0:
        ent = ent.detach()
    return loss_from_logprobs(
        lp,
        ent,
        x,
        cfg,
        normalizers,
        policy_fn,
        source="logits",
        spec=spec,
        checks=checks,
        label_check=(x.labels.reshape(-1), logits.shape[-1]) if fused else None,
    )
