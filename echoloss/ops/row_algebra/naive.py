"""The row algebra in plain PyTorch: the gold of ``fused.py`` (same contract; never imports triton).

Readable rather than fast: each policy's per-row loss is its row form (``policies.py``, the
function the loss module registers under its name), the rest is written as the loss module
writes it, and the derivatives come from autograd on a detached leaf, so they carry autograd's conventions (the
``minimum``/``maximum`` of equal branches splits the gradient in half, ``clamp`` passes it on
its bounds), which the kernel reproduces in closed form.
"""

from __future__ import annotations

import math

import torch

from echoloss.ops.row_algebra.contract import (
    CHECK_SLOTS,
    STAT_SLOTS,
    RowAlgebraParams,
    RowInputs,
)
from echoloss.ops.row_algebra.policies import ROW_POLICIES, RowArgs

__all__ = ["forward"]

F32 = torch.float32


def _on(rows: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
    """``values`` on ``rows`` (fp32), 0 elsewhere (0 everywhere when None)."""
    if values is None:
        return torch.zeros(rows.shape, dtype=F32, device=rows.device)
    return torch.where(rows, values.reshape(-1).to(F32), 0.0)


def _divisor(
    device: torch.Tensor | None, host: float | None, own: torch.Tensor | float
) -> torch.Tensor | float:
    """A term's divisor: the device one (fp32), else the host one, else the call's ``own``."""
    if device is not None:
        return device.to(F32).reshape(())
    return own if host is None else float(host)


def _clamp(x: torch.Tensor, c: float | None) -> torch.Tensor:
    return x if c is None else x.clamp(-c, c)


def _policy(
    rl: torch.Tensor,
    lp_rl: torch.Tensor,
    base: torch.Tensor,
    adv: torch.Tensor,
    p: RowAlgebraParams,
    seq_rl: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(per-token policy loss [N], flags)`` on every row (neutral values off RL): the
    policy's row form (`ROW_POLICIES`). ``seq_rl``: each row's sequence and the sequences' RL
    rows, for the sequence-level ratios (`RowPolicy.sequence_ratio`), whose mean runs over the
    RL rows of each sequence (the other rows go to a padding slot)."""
    row = ROW_POLICIES[p.policy]
    seq = None
    if row.sequence_ratio:
        assert seq_rl is not None
        index, rl_rows = seq_rl
        pad = rl_rows.numel()
        seq = (torch.where(rl, index, pad), pad + 1)
    low, high = p.bounds
    args = RowArgs(low, high, p.dual_clip_read, p.log_ratio_clamp, seq)
    loss, flags = row.loss(lp_rl, base, adv, args)
    return loss, list(flags.values())


def _kl_tau_penalty(log_ratio: torch.Tensor, clamp: float | None) -> torch.Tensor:
    if clamp is None:
        return log_ratio * log_ratio
    a = log_ratio.abs()
    return torch.where(a <= clamp, log_ratio * log_ratio, 2.0 * clamp * a - clamp * clamp)


def _k3(x: torch.Tensor, clamp: float | None) -> torch.Tensor:
    x64 = _clamp(x, clamp).double()
    return (torch.expm1(x64) - x64).to(F32)


def _ref_kl(lp_rl: torch.Tensor, ref: torch.Tensor, p: RowAlgebraParams) -> torch.Tensor:
    """The reference-KL estimate of ``d = ref - lp`` (differentiable in ``lp``)."""
    d = ref - lp_rl
    if p.kl_estimator == "k1":
        return -d
    if p.kl_estimator == "k2":
        return 0.5 * d * d
    return _k3(d, p.log_ratio_clamp)


def _mismatch_weight(
    base: torch.Tensor,
    lq: torch.Tensor,
    p: RowAlgebraParams,
    seq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w [N] detached, outside [N] bool)`` of the mismatch correction (the sequence modes:
    of the sum of ``base - lq`` over the RL rows of each row's sequence ``seq``)."""
    with torch.no_grad():
        log_w = base - lq
        if p.mismatch is not None and p.mismatch.startswith("sequence"):
            assert seq is not None
            sums = torch.zeros(
                int(seq.max()) + 1 if seq.numel() else 0, dtype=F32, device=seq.device
            )
            log_w = sums.index_add(0, seq, log_w)[seq]
        w = torch.exp(_clamp(log_w, p.log_ratio_clamp))
        outside = w > p.mismatch_max
        if p.mismatch_min is not None:
            outside = outside | (w < p.mismatch_min)
        if (p.mismatch or "").endswith("truncate"):
            return w.clamp(min=p.mismatch_min, max=p.mismatch_max), outside
        return torch.where(outside, torch.zeros_like(w), w), outside


def _sequence_counts(
    rows: RowInputs, p: RowAlgebraParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``(sequence of each row [N], its RL rows [S], its Z [S], RL sequences, echo sequences)``
    by ``unique`` on the ids (sequences numbered in id order)."""
    rl, echo = rows.rl.reshape(-1), rows.echo.reshape(-1)
    assert rows.sequence_ids is not None  # op.py
    uniq, seq = torch.unique(rows.sequence_ids.reshape(-1), return_inverse=True)
    s = uniq.numel()
    counted = echo if rows.observation is None else echo | rows.observation.reshape(-1)
    rl_rows = torch.zeros(s, dtype=F32, device=rl.device).index_add_(0, seq, rl.to(F32))
    z = torch.zeros(s, dtype=F32, device=rl.device).index_add_(0, seq, counted.to(F32))
    echo_rows = torch.zeros(s, dtype=F32, device=rl.device).index_add_(0, seq, echo.to(F32))
    return seq, rl_rows, z, int((rl_rows > 0).sum()), int((echo_rows > 0).sum())


def _first(bad: torch.Tensor, values: torch.Tensor) -> tuple[float, float, float]:
    """(flag, first bad row, its value) as floats (row 0 and its value when none)."""
    flag = bool(bad.any())
    row = int(bad.to(torch.uint8).argmax()) if flag else 0
    return float(flag), float(row), float(values[row]) if flag else 0.0


def _stats(
    rl: torch.Tensor,
    echo: torch.Tensor,
    nll: torch.Tensor,
    lp_rl: torch.Tensor,
    lq: torch.Tensor | None,
    ent: torch.Tensor | None,
    flags: list[torch.Tensor],
    p: RowAlgebraParams,
    device: torch.device,
    extra: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The metric slots over the rows of ``rl`` and ``echo`` (the loss slots left 0)."""
    stats = torch.zeros(len(STAT_SLOTS), dtype=F32, device=device)
    n_rl, n_echo = rl.sum().to(F32), echo.sum().to(F32)
    rlf = n_rl.clamp(min=1)
    stats[3], stats[4] = n_rl, n_echo
    stats[5] = torch.where(echo, nll, 0.0).sum() / n_echo.clamp(min=1)
    stats[6] = torch.where(echo, nll, -math.inf).max() if bool(echo.any()) else 0.0
    if lq is not None:
        stats[7] = torch.where(rl, _k3(lp_rl - lq, p.log_ratio_clamp), 0.0).sum() / rlf
    if p.entropy_metric and ent is not None:
        stats[8] = torch.where(rl, ent.to(F32), 0.0).sum() / rlf
    for i, flagged in enumerate(flags):
        stats[9 + i] = (flagged & rl).sum().to(F32) / rlf
    if "is_weight" in extra:
        stats[STAT_SLOTS.index("is_weight")] = torch.where(rl, extra["is_weight"], 0.0).sum() / rlf
        flagged = extra["mismatch_flag"] & rl
        stats[STAT_SLOTS.index("mismatch_flag")] = flagged.sum().to(F32) / rlf
    if "ref_kl" in extra:
        stats[STAT_SLOTS.index("ref_kl")] = torch.where(rl, extra["ref_kl"], 0.0).sum() / rlf
    return stats


def forward(
    lp: torch.Tensor, ent: torch.Tensor | None, rows: RowInputs, p: RowAlgebraParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(loss, a [N], b [N] or None, stats, checks)``: see ``op.py``."""
    rl, echo = rows.rl.reshape(-1), rows.echo.reshape(-1)
    leaf = lp.detach().to(F32).requires_grad_()
    train_ent = p.entropy_coef != 0
    ent_leaf = None
    if ent is not None:
        ent_leaf = ent.detach().to(F32).requires_grad_(train_ent)
    n_rl, n_echo = rl.sum().to(F32), echo.sum().to(F32)
    extra: dict[str, torch.Tensor] = {}
    seq_counts = _sequence_counts(rows, p) if p.reads_sequences else None
    with torch.enable_grad():
        lp_rl = torch.where(rl, leaf, 0.0)
        flags: list[torch.Tensor] = []
        policy_loss = torch.zeros_like(lp_rl)
        if p.policy == "sft":
            per_rl = -lp_rl
        else:
            adv = _on(rl, rows.advantages) * p.adv_tau
            if rows.old_logprobs is not None:
                base = _on(rl, rows.old_logprobs)
            elif rows.inference_logprobs is not None and p.mismatch is None:
                base = _on(rl, rows.inference_logprobs)
            else:  # on-policy (with a mismatch correction: the inference logprobs weigh)
                base = lp_rl.detach()
            seq_rl = None if seq_counts is None else (seq_counts[0], seq_counts[1])
            out, flags = _policy(rl, lp_rl, base, adv, p, seq_rl)
            policy_loss = torch.where(rl, out, 0.0)
            per_rl = policy_loss
            if p.mismatch is not None:
                w_m, outside = _mismatch_weight(
                    base,
                    _on(rl, rows.inference_logprobs),
                    p,
                    None if seq_counts is None else seq_counts[0],
                )
                per_rl = per_rl * w_m
                extra["is_weight"], extra["mismatch_flag"] = w_m, outside
            if p.kl_tau != 0:
                per_rl = per_rl + p.kl_tau * _kl_tau_penalty(lp_rl - base, p.log_ratio_clamp)
            if p.kl_coef != 0:
                kl = _ref_kl(lp_rl, _on(rl, rows.ref_logprobs), p)
                per_rl = per_rl + p.kl_coef * kl
                extra["ref_kl"] = kl.detach()
            if train_ent:
                assert ent_leaf is not None
                per_rl = per_rl - p.entropy_coef * torch.where(rl, ent_leaf, 0.0)
        if seq_counts is not None and p.rl_normalization != "token":
            # as the loss module: per-sequence sums (index_add), then over the sequences
            seq, rl_rows, _, s_rl, _ = seq_counts
            s_div = _divisor(rows.rl_divisor, p.rl_divisor, float(max(s_rl, 1)))
            per_seq = torch.zeros_like(rl_rows).index_add(0, seq, per_rl)
            if p.rl_normalization == "sequence_mean_token_mean":
                per_seq = per_seq / rl_rows.clamp(min=1)
            rl_term = per_seq.sum() / s_div
        else:
            rl_term = per_rl.sum() / _divisor(rows.rl_divisor, p.rl_divisor, n_rl.clamp(min=1))
        lp_echo = torch.where(echo, leaf, 0.0)
        echo_per = _on(echo, rows.echo_weights) * -lp_echo
        echo_sum = echo_per.sum()
        if p.echo_normalization == "sequence_mean":
            assert seq_counts is not None
            seq, _, z, _, s_echo = seq_counts
            s_div = _divisor(rows.echo_divisor, p.echo_divisor, float(max(s_echo, 1)))
            per_seq = torch.zeros_like(z).index_add(0, seq, echo_per)
            denom = (z + p.echo_z_epsilon).masked_fill(z == 0, 1.0)
            echo_term = (per_seq / denom).sum() / s_div
        elif p.echo_normalization == "sum":
            echo_term = echo_sum
        elif p.echo_normalization == "token_mean":
            echo_term = echo_sum / _divisor(rows.echo_divisor, p.echo_divisor, n_echo.clamp(min=1))
        else:
            echo_term = (
                echo_sum / n_echo.clamp(min=1) / _divisor(rows.echo_divisor, p.echo_divisor, 1.0)
            )
        loss = rl_term + echo_term
        wrt = [leaf] + ([ent_leaf] if train_ent and ent_leaf is not None else [])
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    a = grads[0] if grads[0] is not None else torch.zeros_like(leaf)
    b = None
    if train_ent:
        b = grads[1] if grads[1] is not None else torch.zeros_like(leaf)
    with torch.no_grad():
        nll = -lp_echo.detach()
        lq = _on(rl, rows.inference_logprobs) if p.mismatch_metric else None
        stats = _stats(rl, echo, nll, lp_rl.detach(), lq, ent, flags, p, lp.device, extra)
        stats[0], stats[1], stats[2] = loss.detach(), rl_term.detach(), echo_term.detach()
        if seq_counts is not None:
            stats[13], stats[14] = float(seq_counts[3]), float(seq_counts[4])
        env_rows = []
        if rows.env_of_row is not None:
            env = rows.env_of_row.reshape(-1)
            for env_index in range(rows.num_envs):
                here = env == env_index
                env_rows.append(
                    _stats(
                        rl & here,
                        echo & here,
                        nll,
                        lp_rl.detach(),
                        lq,
                        ent,
                        flags,
                        p,
                        lp.device,
                        extra,
                    )
                )
        stats = torch.stack([stats, *env_rows])
        checks: list[float] = [0.0] * len(CHECK_SLOTS)
        if p.check_finite:
            part = rl | echo
            lpd = leaf.detach()
            bad = part & ~torch.isfinite(lpd)
            if p.logprobs_given:
                bad = bad | (part & (lpd > p.logprob_tolerance))
            found, row, value = _first(bad, lpd)
            is_rl = float(bool(rl[int(row)])) if rl.numel() else 0.0  # row 0 when none
            checks[0:5] = [found, row, float(bad.sum()), value, is_rl]
            if p.policy != "sft":
                pl = policy_loss.detach()
                checks[5:8] = list(_first(rl & ~torch.isfinite(pl), pl))
                if train_ent and ent is not None:
                    e = ent.detach().to(F32)
                    checks[8:11] = list(_first(rl & ~torch.isfinite(e), e))
            lv = float(loss)
            checks[11:15] = [float(not math.isfinite(lv)), lv, float(rl_term), float(echo_term)]
        if rows.labels is not None:  # checked whatever check_finite says, as the logprob op does
            lab = rows.labels.reshape(-1).long()
            bad_l = (rl | echo) & ((lab < 0) | (lab >= rows.vocab_size))
            checks[15:18] = list(_first(bad_l, lab.double()))
        check_numbers = torch.tensor(checks, dtype=torch.float64, device=lp.device)
    return loss.detach(), a.detach(), None if b is None else b.detach(), stats, check_numbers
