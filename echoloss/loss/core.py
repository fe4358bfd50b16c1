"""The split RL + echo loss: ``L = L_RL(RL rows) + L_echo(echo rows)``, sharing one log-softmax.

Every entry point takes one `LossInputs` record and differs only in
how it gets the log-probabilities: [`echo_loss`][echoloss.loss.echo_loss] from logits (through
[`echoloss.ops.selective_logprobs`][echoloss.ops.selective_logprobs], participating rows only),
[`echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs] from logprobs computed elsewhere, and
`echoloss.echo_loss_from_hidden` from hidden states and the LM head. Everything after the
logprobs is ``[N]``-sized PyTorch in `loss_from_logprobs`, in small steps:

1. `check_requirements`: what the config and policy need from the record;
2. `_check_scored`: the ``O(N)`` non-finite check of the logprobs (names the first bad row);
3. `_local_sequences`: local sequence numbering and per-term sequence counts;
4. `_resolve_normalizers`: the counts each term divides by;
5. `_rl_per_token`: policy loss, mismatch weight, ``kl_tau``, reference KL, entropy bonus;
6. `_rl_term` / `_echo_term`: the two normalised sums;
7. `_metrics`.

The keyword form (``echo_loss(logits, labels, rl_mask=..., ...)``) takes the record's fields by
name (``**fields``) and builds the record with `LossInputs.from_keywords`: no entry point spells a
field, so a new field of the record is a new keyword of every entry point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from echoloss._compile import compiler_disable
from echoloss._validate import check_per_token, check_tensor, describe, problem
from echoloss.loss.checks import check_config, check_requirements, resolve_inputs
from echoloss.loss.config import LossConfig
from echoloss.loss.inputs import LOGPROB_TOLERANCE, LossInputs
from echoloss.loss.metrics import loss_metrics
from echoloss.loss.normalization import Normalizers, count_rows
from echoloss.loss.policy import (
    PolicyFn,
    PolicyInputs,
    PolicySpec,
    RecordRows,
    check_policy_output,
    k3,
    kl_penalty,
    mismatch_weights,
)
from echoloss.ops.selective_logprobs import selective_logprobs

__all__ = [
    "LossOutput",
    "NonFiniteLossError",
    "check_final_loss",
    "check_scored_rows",
    "echo_loss",
    "echo_loss_from_logprobs",
    "loss_from_logprobs",
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


def _check_scored(lp: torch.Tensor, x: LossInputs, source: str) -> None:
    """O(N): every participating row's logprob is finite (else name the first bad row)."""
    check_scored_rows(lp, x.rl, x.echo, source)


def check_scored_rows(lp: torch.Tensor, rl: torch.Tensor, echo: torch.Tensor, source: str) -> None:
    """O(N): every RL or echo row's logprob ``lp [N]`` is finite, else name the first bad row.

    A NaN or +inf anywhere in a row of logits makes its log-sum-exp, hence its logprob,
    non-finite, and -inf at the label gives -inf: one ``isfinite`` over the ``[N]`` logprobs
    catches all of them without reading the ``[N, V]`` logits again. Logprobs given by the
    caller (``source="logprobs"``) must also be ≤ 0 (up to ``LOGPROB_TOLERANCE``), like every
    other logprob input.

    Examples:
        >>> check_scored_rows(torch.tensor([-0.1, float("nan")]), torch.tensor([True, False]),
        ...                   torch.tensor([False, True]), "logits")
        Traceback (most recent call last):
        ...
        echoloss.loss.core.NonFiniteLossError: logits row 1 must be a finite log-probability on an echo row, got nan (1 bad row(s); cause: NaN or +inf in that row of the logits, or -inf at its label); ...
    """
    part = rl | echo  # [N] bool
    bad = part & ~torch.isfinite(lp)  # [N] bool
    if source == "logprobs":
        bad = bad | (part & (lp > LOGPROB_TOLERANCE))  # [N] bool
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        kind = "an RL" if bool(rl[row]) else "an echo"
        value = float(lp[row].detach())
        if math.isfinite(value):  # a positive "logprob": a negative log-likelihood passed
            raise ValueError(
                problem(
                    f"{source}[{row}]",
                    f"a log-probability ≤ 0 (up to {LOGPROB_TOLERANCE}) on {kind} row",
                    repr(round(value, 6)),
                    "pass log p, not the negative log-likelihood -log p",
                )
            )
        raise NonFiniteLossError(
            problem(
                f"{source} row {row}",
                f"a finite log-probability on {kind} row",
                f"{value} ({int(bad.sum())} bad row(s); cause: {_SOURCE_CAUSE[source]})",
                "find where the model's output overflows (e.g. fp16 activations), or set "
                "LossConfig(check_finite=False) to skip this check",
            )
        )


# ---------------------------------------------------------------- 3. sequences


@dataclass(frozen=True)
class _Sequences:
    """Local sequence numbering of the participating rows."""

    num: int  # S_local: sequences with an RL or echo row
    rl_index: torch.Tensor | None  # [n_rl] int64 local sequence of each RL row
    echo_index: torch.Tensor | None  # [n_echo] int64 local sequence of each echo row
    ids: torch.Tensor | None  # [S_local] int64 the sequence id of each local sequence, sorted


def _local_sequences(x: LossInputs, rl_idx: torch.Tensor, echo_idx: torch.Tensor) -> _Sequences:
    """Number the sequences that have an RL or echo row ``0..S_local-1`` (no id-sized table)."""
    sid = x.flat("sequence_ids")
    if sid is None:
        return _Sequences(0, None, None, None)
    sid = sid.long()  # [N]
    part = x.rl | x.echo  # [N] bool
    ids, local = torch.unique(sid[part], return_inverse=True)  # [S], [n_part]
    seq_of_row = torch.full_like(sid, -1)  # [N], -1 = not participating
    seq_of_row[part] = local
    rl_index = seq_of_row[rl_idx]  # [n_rl]
    echo_index = seq_of_row[echo_idx]  # [n_echo]
    return _Sequences(
        num=int(ids.numel()),
        rl_index=rl_index,
        echo_index=echo_index,
        ids=ids,
    )


# ---------------------------------------------------------------- 4. normalisers


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


def _resolve_normalizers(normalizers: Any, local: Normalizers, cfg: LossConfig) -> Normalizers:
    """``normalizers`` (checked to cover this call's own counts), or ``local`` when None."""
    if normalizers is None:
        return local
    if not isinstance(normalizers, Normalizers):
        raise TypeError(
            problem(
                "normalizers",
                "echoloss.Normalizers or None (None = this call is the whole batch)",
                describe(normalizers),
            )
        )
    for name in _used_counts(cfg):
        g, loc = getattr(normalizers, name), getattr(local, name)
        if g < loc:
            hint = (
                " (count_normalizers needs sequence_ids for the sequence_mean* modes)"
                if name.endswith("sequences") and g == 0
                else ""
            )
            raise ValueError(
                f"normalizers.{name}={g} is smaller than this call's {loc}{hint}: normalizers must "
                "be the sum over every micro-batch of the step on every rank (count_normalizers "
                "for each micro-batch, summed, then all_reduce_normalizers)"
            )
    return normalizers


# ---------------------------------------------------------------- 5. RL per-token loss


class _RLRows(NamedTuple):
    per_token: torch.Tensor  # [n_rl] loss before normalisation
    means: dict[str, torch.Tensor]  # name -> [n_rl] values reported as means
    flags: dict[str, torch.Tensor]  # name -> [n_rl] bool reported as fractions


def _ratio_base(
    lp_rl: torch.Tensor, x: LossInputs, rl_idx: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(base [n_rl] detached, inference logprobs [n_rl] or None)``: the ratio's denominator."""
    lq_all = x.flat("inference_logprobs")
    lq = None if lq_all is None else lq_all.index_select(0, rl_idx).to(lp_rl.dtype)  # [n_rl]
    old = x.flat("old_logprobs")
    if old is not None:
        base = old.index_select(0, rl_idx).to(lp_rl.dtype)  # [n_rl]
    elif cfg.mismatch is not None or lq is None:
        base = lp_rl.detach()  # [n_rl] on-policy: the behaviour policy is the current one
    else:
        base = lq  # [n_rl] prime-rl: the ratio is taken against the inference logprobs
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


def _rl_per_token(
    lp: torch.Tensor,
    ent: torch.Tensor | None,
    x: LossInputs,
    rl_idx: torch.Tensor,
    seqs: _Sequences,
    cfg: LossConfig,
    spec: PolicySpec,
    policy_fn: PolicyFn | None,
) -> _RLRows:
    """The RL rows' per-token loss: policy × mismatch weight + kl_tau·ρ² + KL − entropy bonus."""
    lp_rl = lp.index_select(0, rl_idx)  # [n_rl]
    if cfg.mode == "sft" or rl_idx.numel() == 0:
        return _RLRows(-lp_rl, {}, {})  # the SFT NLL; an empty (zero) sum without RL rows
    assert x.advantages is not None  # check_requirements
    adv = x.advantages.reshape(-1).index_select(0, rl_idx).to(lp.dtype) * cfg.adv_tau  # [n_rl]
    base, lq = _ratio_base(lp_rl, x, rl_idx, cfg)  # [n_rl], [n_rl] or None
    clamp = cfg.log_ratio_clamp
    fn = spec.fn if spec.fn is not None else policy_fn
    assert fn is not None  # check_requirements
    rows = RecordRows(x, rl_idx)  # any field of the record, on the RL rows
    out = check_policy_output(
        fn(PolicyInputs(lp_rl, base, adv, seqs.rl_index, seqs.num, rows), cfg), lp_rl, cfg.policy
    )
    per_tok = out.loss  # [n_rl]
    if cfg.check_finite:
        _check_policy_output(per_tok, rl_idx, cfg.policy)
    means: dict[str, torch.Tensor] = {}
    flags = dict(out.flags)  # name -> [n_rl] bool
    if cfg.mismatch is not None:
        assert lq is not None  # check_requirements
        w, wf = mismatch_weights(
            base,
            lq,
            mode=cfg.mismatch,
            weight_max=cfg.mismatch_max,
            weight_min=cfg.mismatch_min,
            sequence_index=seqs.rl_index,
            num_sequences=seqs.num,
            log_ratio_clamp=clamp,
        )  # [n_rl], flags
        per_tok = per_tok * w  # [n_rl]
        flags.update(wf)
        means["is_weight"] = w
    kl_tau = cfg.resolved_kl_tau
    if kl_tau != 0:
        per_tok = per_tok + kl_tau * kl_tau_penalty(lp_rl - base, clamp)  # [n_rl]
    if cfg.kl_coef != 0:
        assert x.ref_logprobs is not None  # check_requirements
        ref = x.ref_logprobs.reshape(-1).index_select(0, rl_idx).to(lp.dtype)  # [n_rl]
        kl = kl_penalty(lp_rl, ref, estimator=cfg.kl_estimator, log_ratio_clamp=clamp)  # [n_rl]
        per_tok = per_tok + cfg.kl_coef * kl  # [n_rl]
        means["ref_kl"] = kl.detach()
    if cfg.entropy_coef != 0:
        if ent is None:
            raise ValueError(
                f"entropy is required by entropy_coef={cfg.entropy_coef} ([N] per-token entropy, "
                "differentiable)"
            )
        ent_rl = ent.index_select(0, rl_idx)  # [n_rl]
        if cfg.check_finite:
            _check_finite_rows(
                "entropy", ent_rl, rl_idx, "the entropy bonus (entropy_coef) reads it"
            )
        per_tok = per_tok - cfg.entropy_coef * ent_rl  # [n_rl]
    if lq is not None:
        with torch.no_grad():
            means["mismatch_kl"] = k3(lp_rl - lq, clamp)  # [n_rl]
    return _RLRows(per_tok, means, flags)


def _check_finite_rows(name: str, values: torch.Tensor, rows: torch.Tensor, why: str) -> None:
    bad = ~torch.isfinite(values)  # [n]
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise ValueError(
            problem(
                f"{name} at row {int(rows[k])}",
                f"finite ({why})",
                f"{float(values[k])}",
                "or set LossConfig(check_finite=False) to skip this check",
            )
        )


def _check_policy_output(per_tok: torch.Tensor, rl_idx: torch.Tensor, policy: str) -> None:
    if per_tok.shape != rl_idx.shape:
        raise ValueError(
            problem(
                f"the loss of policy {policy!r}",
                f"a [n_rl] = {list(rl_idx.shape)} tensor (one entry per RL row)",
                describe(per_tok),
            )
        )
    _check_finite_rows(
        f"the loss of policy {policy!r}",
        per_tok,
        rl_idx,
        "a policy's per-token loss; with log_ratio_clamp=None a ratio can overflow",
    )


# ---------------------------------------------------------------- 6. the two terms


def _rl_term(
    per_tok: torch.Tensor, cfg: LossConfig, norms: Normalizers, seqs: _Sequences
) -> torch.Tensor:
    """``L_RL``: ``per_tok [n_rl]`` normalised by ``cfg.rl_normalization`` (0-dim)."""
    mode = cfg.rl_normalization
    if mode == "token_mean":
        return per_tok.sum() / max(norms.rl_tokens, 1)  # 0-dim
    if mode == "token_sum_constant":
        assert cfg.rl_normalization_constant is not None  # LossConfig
        return per_tok.sum() / cfg.rl_normalization_constant  # 0-dim
    assert seqs.rl_index is not None  # check_requirements
    if mode == "sequence_mean_token_sum":
        return per_tok.sum() / max(norms.rl_sequences, 1)  # 0-dim
    # sequence_mean_token_mean: Σ_i (Σ_{t∈RL_i} ℓ_t / |RL_i|) / S_RL
    counts = torch.bincount(seqs.rl_index, minlength=seqs.num).to(per_tok.dtype)  # [S]
    per_seq = per_tok.new_zeros(seqs.num).index_add(0, seqs.rl_index, per_tok)  # [S]
    return (per_seq / counts.clamp(min=1)).sum() / max(norms.rl_sequences, 1)  # 0-dim


def _observation_counts(x: LossInputs, seqs: _Sequences) -> torch.Tensor:
    """``Z [S_local]``: rows counted in ``Z_i = |O_i|`` (observation or echo) per local sequence."""
    assert x.observation_mask is not None and seqs.ids is not None  # check_requirements
    sid = x.flat("sequence_ids")
    assert sid is not None
    sid = sid.long()  # [N]
    counted = sid[(x.observation_mask.reshape(-1) | x.echo) & (sid >= 0)]  # [m] Z_i ≥ |O'_i|
    pos = torch.searchsorted(seqs.ids, counted).clamp(max=max(seqs.num - 1, 0))  # [m]
    local = seqs.num > 0
    hit = (
        (seqs.ids[pos] == counted) if local else torch.zeros_like(counted, dtype=torch.bool)
    )  # [m]
    return torch.bincount(pos[hit], minlength=seqs.num)  # [S] sequences without a row: skipped


def _echo_term(
    per_tok: torch.Tensor,
    x: LossInputs,
    cfg: LossConfig,
    norms: Normalizers,
    seqs: _Sequences,
) -> torch.Tensor:
    """``L_echo``: ``per_tok = w·(-log p) [n_echo]`` normalised by ``cfg.echo_normalization``."""
    mode = cfg.echo_normalization
    if mode == "token_mean":
        return per_tok.sum() / max(norms.echo_tokens, 1)  # 0-dim
    if mode == "sum":
        return per_tok.sum()  # 0-dim
    if mode == "batch_token_mean":
        return per_tok.sum() / max(per_tok.numel(), 1) / max(norms.echo_batches, 1)  # 0-dim
    # sequence_mean: Σ_i (Σ_{t∈O'_i} w_t·nll_t / (Z_i + ε)) / S_echo
    assert seqs.echo_index is not None  # check_requirements
    z = _observation_counts(x, seqs)  # [S]
    per_seq = per_tok.new_zeros(seqs.num).index_add(0, seqs.echo_index, per_tok)  # [S]
    denom = z.to(per_tok.dtype) + cfg.echo_z_epsilon  # [S]
    denom = denom.masked_fill(z == 0, 1.0)  # [S] a sequence without echo rows contributes 0
    return (per_seq / denom).sum() / max(norms.echo_sequences, 1)  # 0-dim


# ---------------------------------------------------------------- 6b. the final loss


class _Suspects(NamedTuple):
    """What a non-finite term is diagnosed from (read only when the final check fails)."""

    x: LossInputs
    rl_idx: torch.Tensor
    echo_idx: torch.Tensor
    ent: torch.Tensor | None
    cfg: LossConfig
    norms: Normalizers


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
    if cfg.rl_normalization == "token_sum_constant":
        c = cfg.rl_normalization_constant
        assert c is not None  # LossConfig
        out.append((1.0 / c, f"rl_normalization_constant={c:g} (the divisor)"))
    return [o for o in out if o[1]]


def _echo_suspects(s: _Suspects) -> list[tuple[float, str]]:
    out = [_largest("echo_weights", s.x.echo_weights, s.echo_idx)]
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
    terms = {"loss_rl (the RL term)": rl_term, "loss_echo (the echo term)": echo_term}
    parts = [f"{k} = {float(v.detach()):g}" for k, v in terms.items()]
    causes = []
    if suspects is not None:
        for term, finder in ((rl_term, _rl_suspects), (echo_term, _echo_suspects)):
            if not bool(torch.isfinite(term)):
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
    got = f"{float(loss.detach()):g} ({', '.join(parts)})"
    raise NonFiniteLossError(problem("loss", "finite", got, fix))


# ---------------------------------------------------------------- 7. metrics


def _metrics(
    x: LossInputs,
    rl_idx: torch.Tensor,
    echo_idx: torch.Tensor,
    rl: _RLRows,
    ent: torch.Tensor | None,
    cfg: LossConfig,
    echo_nll: torch.Tensor,
    totals: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    means = dict(rl.means)
    if ent is not None and (cfg.compute_entropy or cfg.entropy_coef != 0):
        means["entropy"] = ent.detach().index_select(0, rl_idx)  # [n_rl]
    env_rl = env_echo = None
    env_list: list[str] = []
    sid = x.flat("sequence_ids")
    if x.env_names is not None and sid is not None:
        env_list = sorted({e for e in x.env_names if e})
        lookup = {e: i for i, e in enumerate(env_list)}
        seq_env = torch.tensor(
            [lookup.get(e, -1) for e in x.env_names], dtype=torch.long, device=echo_nll.device
        )  # [num sequence ids] env index, -1 = none
        sid = sid.long()  # [N]
        env_rl = seq_env[sid[rl_idx]]  # [n_rl]
        env_echo = seq_env[sid[echo_idx]]  # [n_echo]
    return loss_metrics(
        rl_env=env_rl,
        echo_env=env_echo,
        env_names=env_list,
        num_rl=int(rl_idx.numel()),
        num_echo=int(echo_idx.numel()),
        rl_means=means,
        rl_flags=rl.flags,
        echo_nll=echo_nll,
        totals=totals,
        device=echo_nll.device,
    )


# ---------------------------------------------------------------- the loss from logprobs


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
) -> LossOutput:
    """The loss algebra shared by every entry point, on ``[N]`` logprobs already scored.

    Args:
        lp: ``[N]`` logprobs (differentiable); rows that do not participate are never read.
        ent: ``[N]`` entropy or None.
        x: the validated record.
        cfg: the loss config.
        normalizers: global counts or None (this call is the whole batch).
        policy_fn: the per-call policy of ``policy="custom"``, else None.
        source: the argument the logprobs came from, for error messages.
        spec: the policy's spec when the requirements were already checked.

    Returns:
        [`LossOutput`][echoloss.loss.LossOutput].
    """
    if spec is None:
        spec = check_requirements(x, cfg, policy_fn)
    if cfg.check_finite:
        _check_scored(lp, x, source)
    rl_idx = x.rl.nonzero().squeeze(1)  # [n_rl]
    echo_idx = x.echo.nonzero().squeeze(1)  # [n_echo]
    seqs = _local_sequences(x, rl_idx, echo_idx)
    n_echo = int(echo_idx.numel())
    local = count_rows(x.rl, x.echo, x.flat("sequence_ids"))  # the counting of count_normalizers
    norms = _resolve_normalizers(normalizers, local, cfg)

    rl = _rl_per_token(lp, ent, x, rl_idx, seqs, cfg, spec, policy_fn)
    rl_term = _rl_term(rl.per_token, cfg, norms, seqs)  # 0-dim

    # Echo rows: -w · logprob, no ratio / trust region / KL / adv_tau.
    lp_echo = lp.index_select(0, echo_idx)  # [n_echo]
    ew = x.flat("echo_weights")
    w_echo = lp_echo.new_zeros(0) if ew is None else ew.index_select(0, echo_idx).to(lp.dtype)
    echo_term = _echo_term(w_echo * -lp_echo, x, cfg, norms, seqs)  # 0-dim

    loss = rl_term + echo_term  # 0-dim
    if cfg.check_finite:
        check_final_loss(loss, rl_term, echo_term, _Suspects(x, rl_idx, echo_idx, ent, cfg, norms))
    if rl_idx.numel() == 0 and n_echo == 0:
        # Keep the (zero) loss connected to the graph: distributed backward must not hang.
        loss = loss + lp.sum() * 0.0
    metrics = _metrics(
        x,
        rl_idx,
        echo_idx,
        rl,
        ent,
        cfg,
        -lp_echo.detach(),
        {"loss_rl": rl_term, "loss_echo": echo_term},
    )
    return LossOutput(loss, metrics)


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
    logprobs = check_tensor("logprobs", logprobs)
    if not logprobs.dtype.is_floating_point:
        raise TypeError(problem("logprobs", "a float tensor", describe(logprobs)))
    if isinstance(inputs, torch.Tensor):
        raise TypeError(problem("inputs", "an echoloss.LossInputs record", describe(inputs)))
    x = resolve_inputs(
        inputs, fields, shape=logprobs.shape, device=logprobs.device, source="logprobs"
    )
    cfg = check_config(config)
    ent = None
    if entropy is not None:
        ent = check_per_token("entropy", entropy, x.shape, x.device, "float").reshape(-1)  # [N]
        if cfg.check_finite:
            _check_entropy(ent, x.rl)
    return loss_from_logprobs(
        logprobs.reshape(-1), ent, x, cfg, normalizers, policy_fn, source="logprobs"
    )


#: Most negative entropy accepted from a caller: an entropy is ≥ 0; one computed in fp32 from a
#: near-one-hot distribution may round a few ulps below 0, never by this much.
ENTROPY_TOLERANCE = 1e-3


def _check_entropy(ent: torch.Tensor, rl: torch.Tensor) -> None:
    """The caller's entropy on RL rows (where it is read): finite and ≥ 0 (up to rounding)."""
    bad = rl & ~(torch.isfinite(ent) & (ent >= -ENTROPY_TOLERANCE))  # [N]
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            problem(
                f"entropy[{row}]",
                f"a finite entropy ≥ 0 (up to -{ENTROPY_TOLERANCE}) on an RL row",
                repr(float(ent[row].detach())),
                "pass the per-token entropy -Σ p log p of the model's distribution",
            )
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
    if config.echo_temperature == "one" and bool(echo.any()):
        if isinstance(temperature, torch.Tensor):
            temp = temperature.reshape(-1).masked_fill(echo, 1.0).view(lead)
        elif float(temperature) != 1.0:
            full = torch.full(lead, float(temperature), dtype=torch.float64, device=rl.device)
            temp = full.view(-1).masked_fill_(echo, 1.0).view(lead)
    need_entropy = bool(rl.any()) and (config.compute_entropy or config.entropy_coef != 0)
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
    spec = check_requirements(x, cfg, policy_fn)
    temp, need_ent = row_temperature_and_entropy(
        x.temperature, cfg, rl=x.rl, echo=x.echo, lead=lead
    )
    res = selective_logprobs(
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
    return loss_from_logprobs(lp, ent, x, cfg, normalizers, policy_fn, source="logits", spec=spec)
