"""The loss algebra in PyTorch: ``(loss, metrics)`` from ``[N]`` logprobs, in small steps.

`torch_algebra` is the definition every other path is tested against (the fused row program of
``echoloss.ops.row_algebra``, the compiled region of `echoloss.loss.compiled`, the per-row
coefficients of `echoloss.loss.chunks`):

1. `echoloss.loss.diagnosis.check_scored_rows`: the ``O(N)`` non-finite check of the logprobs;
2. `echoloss.loss.normalization.local_sequences` and `row_counts`: local sequences and counts;
3. `echoloss.loss.normalization.resolve_normalizers`: the counts each term divides by;
4. `rl_per_token`: policy loss, mismatch weight, ``kl_tau``, reference KL, entropy bonus;
5. `normalized_rl_term` / `normalized_echo_term`: the two normalised sums, and the final-loss
   check;
6. the metrics (`echoloss.loss.metrics.loss_metrics`).

Every step works on ``[N]`` tensors, rows selected by mask arithmetic, so on CUDA nothing is read
back to the host; value checks go through `echoloss.ops.value_checks.DeferredChecks`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from echoloss._deferred import host_to_device
from echoloss._ratios import exp_may_overflow
from echoloss.loss.checks import reads_sequences
from echoloss.loss.config import LossConfig
from echoloss.loss.diagnosis import (
    check_finite_rows,
    check_scored_rows,
    defer_final_loss_check,
    not_finite_error,
)
from echoloss.loss.inputs import LossInputs
from echoloss.loss.metrics import loss_metrics
from echoloss.loss.normalization import (
    NO_DIVISORS,
    Divisors,
    LocalSequences,
    Normalizers,
    RowCounts,
    at_least_one,
    divisor_or_count,
    local_sequences,
    no_sequences,
    resolve_normalizers,
    row_counts,
)
from echoloss.loss.penalties import k3, kl_penalty, kl_tau_penalty, mismatch_weights
from echoloss.loss.policy import (
    PolicyFn,
    PolicyInputs,
    PolicyOutput,
    PolicySpec,
    RecordRows,
    check_policy_output,
    is_builtin_policy,
)
from echoloss.ops.value_checks import DeferredChecks

__all__ = ["MISMATCH_KL_WHY", "torch_algebra"]

#: Why a non-finite mismatch KL is an error (`LossConfig.check_finite`).
MISMATCH_KL_WHY = (
    "the inference logprobs differ from the logprobs by more than the float range allows in "
    "e^x - x - 1 with log_ratio_clamp=None; set log_ratio_clamp (e.g. 20) or check "
    "inference_logprobs"
)


class _RLRows(NamedTuple):
    per_token: torch.Tensor  # [N] loss before normalisation, 0 outside RL rows
    means: dict[str, torch.Tensor]  # name -> [N] values reported as means over RL rows
    flags: dict[str, torch.Tensor]  # name -> [N] bool reported as fractions of RL rows


def on_rows(rows: torch.Tensor, values: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
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
    lq = None if x.inference_logprobs is None else on_rows(rl, x.inference_logprobs, lp_rl)
    if x.old_logprobs is not None:
        base = on_rows(rl, x.old_logprobs, lp_rl)  # [N]
    elif cfg.mismatch is not None or lq is None:
        base = lp_rl.detach()  # [N] on-policy: the behaviour policy is the current one
    else:
        base = lq  # [N] prime-rl: the ratio is taken against the inference logprobs
    return base.detach(), lq


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


def _check_backward(lp_rl: torch.Tensor, rl: torch.Tensor, policy: str) -> None:
    """Check, when backward reaches them, that the gradients of the RL rows' logprobs are finite.

    A policy function of the caller can have a finite loss and a non-finite derivative (a
    saturated function of an overflowing ratio: ``0·inf``); the final loss check cannot see it
    and one optimiser step would make the model NaN. The built-in policies' derivatives are
    finite wherever their loss is (`is_builtin_policy`) and pay nothing. The check runs in the
    backward pass: at once on the host path (backward raises), deferred on the device path like
    the forward's value checks (no host read).
    """
    if not lp_rl.requires_grad:
        return
    error = not_finite_error(
        f"the gradient of policy {policy!r} (d loss / d logprob)",
        "a finite loss whose derivative is not: a saturated function of an overflowing ratio "
        "gives 0·inf; clamp the ratio (log_ratio_clamp) or write the derivative stably",
    )

    def hook(grad: torch.Tensor) -> torch.Tensor:
        checks = DeferredChecks(grad.device)
        checks.add_rows(grad, rl, "not_finite", lambda v: error(int(v[2]), v[3]) if v[0] else None)
        checks.submit()
        return grad

    lp_rl.register_hook(hook)  # type: ignore[no-untyped-call]


def rl_per_token(
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
    adv = on_rows(rl, x.advantages, lp_rl) * cfg.adv_tau  # [N]
    base, lq = _ratio_base(lp_rl, x, rl, cfg)  # [N], [N] or None
    clamp = cfg.log_ratio_clamp
    fn = spec.fn if spec.fn is not None else policy_fn
    assert fn is not None  # _check_requirements
    inputs = PolicyInputs(lp_rl, base, adv, seqs.rl_index, seqs.size)
    if cfg.check_finite and (policy_fn is not None or not is_builtin_policy(cfg.policy)):
        _check_backward(lp_rl, rl, cfg.policy)
    out = _policy_on_rows(fn, spec, inputs, x, seqs, cfg)
    per_tok = out.loss  # [N]
    if cfg.check_finite:
        check_finite_rows(
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
        ref = on_rows(rl, x.ref_logprobs, lp_rl)  # [N]
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
                check_finite_rows(
                    "entropy", ent, rl, "the entropy bonus (entropy_coef) reads it", checks
                )
            per_tok = per_tok - cfg.entropy_coef * torch.where(rl, ent, 0.0)  # [N]
    if lq is not None:
        with torch.no_grad():
            means["mismatch_kl"] = k3(lp_rl - lq, clamp)  # [N]
        if cfg.check_finite and exp_may_overflow(clamp, lp_rl.dtype):
            # without a clamp, k3 = e^x - x - 1 of x = lp - lq overflows (a metric of inf):
            # logprobs that far from the sampler's are broken inputs (no launch with a clamp)
            check_finite_rows(
                "mismatch_kl (k3 of logprobs - inference_logprobs)",
                means["mismatch_kl"],
                rl,
                MISMATCH_KL_WHY,
                checks,
            )
    return _RLRows(per_tok, means, flags)


# ---------------------------------------------------------------- the two terms


def normalized_rl_term(
    per_tok: torch.Tensor,
    rl: torch.Tensor,
    cfg: LossConfig,
    norms: RowCounts,
    seqs: LocalSequences,
    divisor: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``L_RL``: ``per_tok [N]`` (0 outside RL rows) normalised by ``cfg.rl_normalization``
    (``divisor``, `Divisors.rl`, replaces the mode's denominator when given)."""
    mode = cfg.rl_normalization
    if mode == "token_mean":
        return per_tok.sum() / divisor_or_count(divisor, norms.rl_tokens)  # 0-dim
    if mode == "token_sum_constant":
        if divisor is not None:
            return per_tok.sum() / divisor  # 0-dim
        assert cfg.rl_normalization_constant is not None  # LossConfig
        return per_tok.sum() / cfg.rl_normalization_constant  # 0-dim
    assert seqs.rl_index is not None  # _check_requirements
    if mode == "sequence_mean_token_sum":
        return per_tok.sum() / divisor_or_count(divisor, norms.rl_sequences)  # 0-dim
    # sequence_mean_token_mean: Σ_i (Σ_{t∈RL_i} ℓ_t / |RL_i|) / S_RL
    counts = rl_rows_per_sequence(rl, seqs, per_tok.dtype)  # [S+1]
    per_seq = per_tok.new_zeros(seqs.size).index_add(0, seqs.rl_index, per_tok)  # [S+1]
    per_seq_mean = (per_seq / counts.clamp(min=1))[:-1]  # [N] the padding slot dropped
    return per_seq_mean.sum() / divisor_or_count(divisor, norms.rl_sequences)  # 0-dim


def rl_rows_per_sequence(
    rl: torch.Tensor, seqs: LocalSequences, dtype: torch.dtype
) -> torch.Tensor:
    """``[S + 1]`` in ``dtype``: the RL rows of each local sequence (the padding slot last)."""
    assert seqs.rl_index is not None  # _check_requirements
    counts = torch.zeros(seqs.size, dtype=dtype, device=rl.device)
    return counts.index_add_(0, seqs.rl_index, rl.to(dtype))


def observation_counts(x: LossInputs, seqs: LocalSequences) -> torch.Tensor:
    """``Z [N + 1]``: rows counted in ``Z_i = |O_i|`` (observation or echo) per local sequence."""
    assert x.observation_mask is not None and seqs.row is not None  # _check_requirements
    counted = x.observation_mask.reshape(-1) | x.echo  # [N] Z_i ≥ |O'_i|
    index = torch.where(counted, seqs.row, seqs.pad)  # [N]
    ones = torch.ones_like(index, dtype=torch.int32)
    return torch.zeros(seqs.size, dtype=torch.int32, device=index.device).index_add_(0, index, ones)


def normalized_echo_term(
    per_tok: torch.Tensor,
    x: LossInputs,
    cfg: LossConfig,
    norms: RowCounts,
    n_echo: int | torch.Tensor,
    seqs: LocalSequences,
    divisor: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """``L_echo``: ``per_tok = w·(-log p) [N]`` (0 outside echo rows) normalised by
    ``cfg.echo_normalization`` (``divisor``, `Divisors.echo`, replaces the denominator of
    ``token_mean`` and ``sequence_mean`` when given)."""
    mode = cfg.echo_normalization
    if mode == "token_mean":
        return per_tok.sum() / divisor_or_count(divisor, norms.echo_tokens)  # 0-dim
    if mode == "sum":
        return per_tok.sum()  # 0-dim
    if mode == "batch_token_mean":
        return per_tok.sum() / at_least_one(n_echo) / at_least_one(norms.echo_batches)  # 0-dim
    # sequence_mean: Σ_i (Σ_{t∈O'_i} w_t·nll_t / (Z_i + ε)) / S_echo
    assert seqs.echo_index is not None  # _check_requirements
    z = observation_counts(x, seqs)  # [S+1]
    per_seq = per_tok.new_zeros(seqs.size).index_add(0, seqs.echo_index, per_tok)  # [S+1]
    denom = echo_z_denominator(z, cfg.echo_z_epsilon, per_tok.dtype)  # [S+1]
    return (per_seq / denom)[:-1].sum() / divisor_or_count(divisor, norms.echo_sequences)  # 0-dim


def echo_z_denominator(z: torch.Tensor, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    """``Z_i + ε`` in ``dtype`` (any shape, per sequence or gathered per row), 1 where
    ``Z_i = 0``: a sequence without echo rows contributes 0, not 0/ε. With ε = 0 (the
    default) that is ``max(Z_i, 1)`` of the whole number ``Z_i``: two launches, not four."""
    if epsilon == 0.0:
        return z.to(dtype).clamp(min=1.0)
    return (z.to(dtype) + epsilon).masked_fill(z == 0, 1.0)


def env_of_rows(x: LossInputs, device: torch.device) -> tuple[torch.Tensor | None, list[str]]:
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
    env_of_row, env_list = env_of_rows(x, echo_nll.device)
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


def torch_algebra(
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
    """The loss algebra of `echoloss.loss.core.loss_from_logprobs` in PyTorch: ``(loss, metrics)``
    from the ``[N]`` logprobs (their values checked here; the other arguments as there)."""
    if cfg.check_finite:
        check_scored_rows(lp, x.rl, x.echo, source, checks)
    # Local sequences only where a sequence-level quantity reads them (a sort and a dozen small
    # launches otherwise spent for nothing); their counts are then 0 and never used.
    seqs = local_sequences(x) if reads_sequences(cfg, policy_fn) else no_sequences(x)
    local = row_counts(x, seqs)  # 0-dim device counts, as count_normalizers counts
    norms = resolve_normalizers(normalizers, local, cfg, checks)

    rl = rl_per_token(lp, ent, x, seqs, cfg, spec, policy_fn, checks)
    rl_term = normalized_rl_term(rl.per_token, x.rl, cfg, norms, seqs, divisors.rl)  # 0-dim

    # Echo rows: -w · logprob, no ratio / trust region / KL / adv_tau.
    lp_echo = torch.where(x.echo, lp, 0.0)  # [N]
    w_echo = on_rows(x.echo, x.echo_weights, lp_echo)  # [N]
    echo_term = normalized_echo_term(
        w_echo * -lp_echo, x, cfg, norms, local.echo_tokens, seqs, divisors.echo
    )

    # Connected to the graph through lp even without any RL or echo row (then exactly 0 with
    # zero gradients): distributed backward must not hang.
    loss = rl_term + echo_term  # 0-dim
    if cfg.check_finite:
        defer_final_loss_check(loss, rl_term, echo_term, x, ent, cfg, checks, divisors)
    metrics = _metrics(
        x, rl, ent, cfg, -lp_echo.detach(), {"loss_rl": rl_term, "loss_echo": echo_term}
    )
    checks.pack()  # inside the compiled region (when on): only the copy to the host is left
    return loss, metrics
