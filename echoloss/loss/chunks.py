"""The chunk-additive path: each row's derivatives from that row alone, before the whole loss.

For a loss that `echoloss.loss.checks.chunk_additive` accepts (per-token policies, any
normaliser: every denominator is known before any logprob), `row_coefficients` gives
``d loss / d logprob`` (and ``d loss / d entropy``) of any chunk of rows as soon as its logprobs
exist, so ``echo_loss_from_hidden`` and the ``echoloss.nn`` fused-linear module form the LM
head's gradients chunk by chunk in the forward pass. The rows' loss is the PyTorch algebra itself
(`echoloss.loss.algebra`), so the derivatives are those of the whole loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from echoloss.loss.algebra import (
    echo_z_denominator,
    normalized_echo_term,
    normalized_rl_term,
    observation_counts,
    on_rows,
    rl_per_token,
    rl_rows_per_sequence,
)
from echoloss.loss.checks import reads_sequences
from echoloss.loss.config import LossConfig
from echoloss.loss.inputs import LossInputs, select_rows
from echoloss.loss.normalization import (
    NO_DIVISORS,
    Divisors,
    LocalSequences,
    Normalizers,
    divisor_or_count,
    local_sequences,
    no_sequences,
    resolve_normalizers,
    row_counts,
)
from echoloss.loss.policy import PolicySpec
from echoloss.ops.value_checks import DeferredChecks

__all__ = ["row_coefficients"]


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

    The rows' loss is the loss algebra itself (`rl_per_token`, `normalized_rl_term`, `normalized_echo_term`)
    on the rows' fields with the call's denominators (counted on all rows here;
    ``divisors`` as in `loss_from_logprobs`), differentiated by autograd: the same
    operations per row as the whole loss, so the same derivatives. Value checks are left to
    the whole loss, which runs them once. ``own_old_logprobs``: the ratio's denominator of each
    row is its own logprob, detached (on-policy, as ``echoloss.nn`` without old logprobs, whose
    whole loss reads ``old_logprobs = logprobs.detach()``); ``x.old_logprobs`` is then unread.
    """
    # The whole record's sequences (only where a normaliser is per sequence), counted as the
    # whole loss counts them (`local_sequences`, `row_counts`).
    seqs_all = local_sequences(x) if reads_sequences(cfg, None) else no_sequences(x)
    local = row_counts(x, seqs_all)
    discard = DeferredChecks(x.device)
    discard.deferred = True  # never submitted: the whole loss runs (and reports) the checks
    norms = resolve_normalizers(normalizers, local, cfg, discard)
    rl_rows, z_rows = _sequence_counts_of_rows(x, cfg, seqs_all)  # [N] per row, or None
    fn = spec.fn
    assert fn is not None  # chunk_additive: a built-in policy (or sft)

    def coefficients(
        rows: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        own = {"old_logprobs": lp.detach()} if own_old_logprobs else {}
        sub = select_rows(x, rows, **own)
        seqs = no_sequences(sub)
        lp_leaf = lp.detach().requires_grad_()
        ent_leaf = None if ent is None else ent.detach()
        if ent_leaf is not None and cfg.entropy_coef != 0:
            ent_leaf.requires_grad_()
        rl = rl_per_token(lp_leaf, ent_leaf, sub, seqs, cfg, spec, None, discard)
        lp_echo = torch.where(sub.echo, lp_leaf, 0.0)
        w_echo = on_rows(sub.echo, sub.echo_weights, lp_echo)
        if cfg.rl_normalization == "sequence_mean_token_mean":
            # Σ_i (Σ_t ℓ_t / |RL_i|) / S_RL, as `normalized_rl_term` with each row's |RL_i| gathered:
            # the same operations per row (a division by its sequence's count, then by S_RL)
            assert rl_rows is not None
            count = rl_rows.index_select(0, rows).to(lp_leaf.dtype).clamp(min=1)  # [c]
            rl_term = (rl.per_token / count).sum() / divisor_or_count(
                divisors.rl, norms.rl_sequences
            )
        elif cfg.rl_normalization == "sequence_mean_token_sum":
            rl_term = rl.per_token.sum() / divisor_or_count(divisors.rl, norms.rl_sequences)
        else:
            rl_term = normalized_rl_term(rl.per_token, sub.rl, cfg, norms, seqs, divisors.rl)
        if cfg.echo_normalization == "sequence_mean":  # Σ_i (Σ_t w·nll / (Z_i + ε)) / S_echo
            assert z_rows is not None
            z = z_rows.index_select(0, rows)  # [c]
            denom = echo_z_denominator(z, cfg.echo_z_epsilon, lp_leaf.dtype)
            per_row = (w_echo * -lp_echo) / denom  # [c]
            echo_term = per_row.sum() / divisor_or_count(divisors.echo, norms.echo_sequences)
        else:
            echo_term = normalized_echo_term(
                w_echo * -lp_echo, sub, cfg, norms, local.echo_tokens, seqs, divisors.echo
            )
        wrt = [lp_leaf] + ([ent_leaf] if ent_leaf is not None and ent_leaf.requires_grad else [])
        grads = torch.autograd.grad(rl_term + echo_term, wrt, allow_unused=True)
        a = torch.zeros_like(lp) if grads[0] is None else grads[0]
        b = None if len(grads) < 2 else grads[1]
        return a, (torch.zeros_like(lp) if b is None and len(grads) == 2 else b)

    return coefficients


def _sequence_counts_of_rows(
    x: LossInputs, cfg: LossConfig, seqs: LocalSequences
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per row, the per-sequence counts `normalized_rl_term` and `normalized_echo_term` divide by (``[N]`` int32:
    its sequence's RL rows; its sequence's ``Z_i``), gathered from the same ``[S + 1]``
    counts; each None where that normaliser is not per sequence."""
    rl_rows = z_rows = None
    if cfg.rl_normalization == "sequence_mean_token_mean":
        assert seqs.rl_index is not None  # check_requirements
        rl_rows = rl_rows_per_sequence(x.rl, seqs, torch.int32).index_select(0, seqs.rl_index)
    if cfg.echo_normalization == "sequence_mean":
        assert seqs.echo_index is not None  # check_requirements
        z_rows = observation_counts(x, seqs).index_select(0, seqs.echo_index)  # [N]
    return rl_rows, z_rows
