"""Shared by the tests of the fused ``[N]`` loss algebra: one call's inputs and the bounds its
tolerances are made of (``tests/ops/test_row_algebra.py`` explains them)."""

from __future__ import annotations

import math

import torch

from echoloss.ops.row_algebra import RowAlgebraParams, RowInputs
from echoloss.ops.row_algebra.fused import BLOCK

EPS = float(torch.finfo(torch.float32).eps)


class Case:
    """One call's inputs: ``lp``, ``ent`` ``[N]`` fp32, ``rows`` and ``params``."""

    def __init__(self, lp, ent, rows: RowInputs, params: RowAlgebraParams):
        self.lp, self.ent, self.rows, self.params = lp, ent, rows, params

    @property
    def n(self) -> int:
        return self.lp.numel()


def _sequence_divisors(case: Case) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Per row (fp64): its sequence's RL rows and ``Z_i + ε``; the RL and echo sequences.
    Counted in Python over the ids (a third way, beside the kernel's and the gold's)."""
    rows, p = case.rows, case.params
    ids = rows.sequence_ids.reshape(-1).tolist()
    rl, echo = rows.rl.tolist(), rows.echo.tolist()
    obs = rows.observation.tolist() if rows.observation is not None else [False] * len(ids)
    n_rl: dict[int, int] = {}
    z: dict[int, int] = {}
    n_echo: dict[int, int] = {}
    for i, sid in enumerate(ids):
        n_rl[sid] = n_rl.get(sid, 0) + rl[i]
        z[sid] = z.get(sid, 0) + (echo[i] or obs[i])
        n_echo[sid] = n_echo.get(sid, 0) + echo[i]
    per_rl = torch.tensor([float(max(n_rl[s], 1)) for s in ids], dtype=torch.float64)
    per_z = torch.tensor([max(z[s], 1) + p.echo_z_epsilon for s in ids], dtype=torch.float64)
    s_rl = sum(1 for v in n_rl.values() if v > 0)
    s_echo = sum(1 for v in n_echo.values() if v > 0)
    return per_rl, per_z, s_rl, s_echo


def divisors(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's divisor of its RL term and of its echo term, ``[N]`` fp64."""
    p, rows = case.params, case.rows
    n_rl, n_echo = int(rows.rl.sum()), int(rows.echo.sum())
    ones = torch.ones(case.n, dtype=torch.float64)
    per_rl, per_z, s_rl, s_echo = (
        _sequence_divisors(case) if p.reads_sequences else (ones, ones, 0, 0)
    )
    if p.rl_normalization != "token":
        rl_div = max(s_rl, 1) if p.rl_divisor is None else p.rl_divisor
    elif rows.rl_divisor is not None:
        rl_div = float(rows.rl_divisor)
    elif p.rl_divisor is not None:
        rl_div = p.rl_divisor
    else:
        rl_div = max(n_rl, 1)
    if p.rl_normalization != "sequence_mean_token_mean":
        per_rl = ones
    if p.echo_normalization == "sum":
        echo_div = 1.0
    elif p.echo_normalization == "token_mean":
        echo_div = max(n_echo, 1) if p.echo_divisor is None else p.echo_divisor
    elif p.echo_normalization == "sequence_mean":
        echo_div = max(s_echo, 1) if p.echo_divisor is None else p.echo_divisor
    else:
        echo_div = max(n_echo, 1) * (p.echo_divisor or 1.0)
    if p.echo_normalization != "sequence_mean":
        per_z = ones
    return float(rl_div) * per_rl, float(echo_div) * per_z


def bounds(case: Case) -> tuple[float, torch.Tensor]:
    """``(S, G)``: a bound of Σ|terms| of the loss (each term over its divisor) and per row a
    bound ``G [N]`` of the terms of its derivative ``a`` (fp64)."""
    p, rows = case.params, case.rows
    rl, echo = rows.rl, rows.echo
    lp = torch.where(rl | echo, case.lp.double(), 0.0)

    def on(mask, t):  # (a [B, T] field read in place: its flat order)
        return torch.zeros_like(lp) if t is None else torch.where(mask, t.reshape(-1).double(), 0.0)

    if rows.old_logprobs is not None:
        base = on(rl, rows.old_logprobs)
    elif rows.inference_logprobs is not None and p.mismatch is None:
        base = on(rl, rows.inference_logprobs)
    else:
        base = on(rl, lp)
    rho = torch.where(rl, lp - base, 0.0)
    c = math.inf if p.log_ratio_clamp is None else p.log_ratio_clamp
    r = torch.exp(rho.clamp(-c, c))
    adv = on(rl, rows.advantages).abs() * p.adv_tau
    sequence_ratio = p.policy in ("gspo", "sapo_sequence")  # a derivative through s_i
    if p.reads_sequence_sums:  # each row's sequence, its RL rows and its ratio s_i
        seq = torch.unique(rows.sequence_ids.reshape(-1), return_inverse=True)[1]
        rl_rows = torch.zeros(int(seq.max()) + 1, dtype=torch.float64).index_add(
            0, seq, rl.double()
        )
        mean = torch.zeros_like(rl_rows).index_add(0, seq, rho) / rl_rows.clamp(min=1)
        s_row = torch.exp(mean.clamp(-c, c))[seq]
    if p.policy == "sft":
        t_rl, g_rl = lp.abs(), torch.ones_like(lp)
    else:
        m_grad = None  # the derivative's bound per |A|, where it is not the loss's
        if p.policy == "reinforce":
            m, with_lp = torch.ones_like(r), True
        elif p.policy in ("cispo", "cispo_sequence"):
            m, with_lp = torch.full_like(r, p.high), True
        elif p.policy == "dppo":
            m, with_lp = r, False
        elif p.policy == "gspo":  # the sequence's ratio s_i, ≤ max(s_i, 1 + high) per term
            m, with_lp = s_row.clamp(min=1 + p.high), False
        elif p.policy in ("sapo", "sapo_sequence"):
            # the loss σ·4/τ·|A| ≤ 4/τ·|A|; the derivative 4·|A|·σ·(1 − σ)·r with σ's own
            # rounding entering unscaled through 1 − σ: its terms are bounded by 4·|A|·r
            pos = on(rl, rows.advantages) > 0
            tau = torch.where(pos, p.sapo_temperature_pos, p.sapo_temperature_neg).double()
            m, with_lp = 4 / tau, False
            m_grad = 4 * (s_row if p.policy == "sapo_sequence" else r)
        else:  # ppo_clip: A > 0 is capped by 1 + high, A < 0 grows with r (up to the dual clip)
            pos = on(rl, rows.advantages) > 0
            m = torch.where(pos, torch.full_like(r, 1 + p.high), r.clamp(min=1 + p.high))
            if p.dual_clip is not None:
                m = torch.where(pos, m, m.clamp(max=p.dual_clip))
            with_lp = False
        m_grad = m if m_grad is None else m_grad
        if p.mismatch is not None and p.mismatch.startswith("token"):  # a weight in [min, max]
            lq = on(rl, rows.inference_logprobs)
            weight = torch.exp((base - lq).clamp(-c, c))
            weight = weight.clamp(min=p.mismatch_min or 0.0, max=p.mismatch_max)
            m, m_grad = m * weight, m_grad * weight
        elif p.mismatch is not None:  # the sequence's weight: at most mismatch_max
            m, m_grad = m * p.mismatch_max, m_grad * p.mismatch_max
        t_rl = adv * m * (1 + lp.abs() if with_lp else 1)
        g_rl = adv * m_grad
        if sequence_ratio:  # every row of a sequence gets Σ_t w_t·|A_t|·(bound) / |RL_i|
            seq_sum = torch.zeros_like(rl_rows).index_add(0, seq, g_rl)
            g_rl = torch.where(rl, (seq_sum / rl_rows.clamp(min=1))[seq], 0.0)
        if p.kl_coef:  # the estimate of d = ref - lp and its derivative
            d = torch.where(rl, on(rl, rows.ref_logprobs) - lp, 0.0)
            if p.kl_estimator == "k1":
                kl, dkl = d.abs(), torch.ones_like(d)
            elif p.kl_estimator == "k2":
                kl, dkl = 0.5 * d * d, d.abs()
            else:
                x = d.clamp(-c, c)
                kl, dkl = torch.expm1(x) - x, torch.expm1(x).abs()
            t_rl = t_rl + abs(p.kl_coef) * kl
            g_rl = g_rl + abs(p.kl_coef) * dkl
        if p.kl_tau:
            t_rl = t_rl + p.kl_tau * rho * rho
            g_rl = g_rl + 2 * p.kl_tau * rho.abs().clamp(max=c)
        if p.entropy_coef:
            t_rl = t_rl + abs(p.entropy_coef) * on(rl, case.ent).abs()
    w = on(echo, rows.echo_weights).abs()
    rl_div, echo_div = divisors(case)
    t_echo = w * lp.abs()
    # a non-finite row makes its sum non-finite (compared exactly); the other sum's scale stays
    t_rl, t_echo = (torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (t_rl, t_echo))
    s = float((t_rl / rl_div).sum() + (t_echo / echo_div).sum())
    g = torch.where(rl, g_rl / rl_div, torch.where(echo, w / echo_div, 0.0))
    return s, g


def ref_kl_scale(case: Case) -> float:
    """A bound of the mean |estimate| over RL rows of every KL estimator of ``d = ref - lp``
    (``|d| + d²/2 + expm1(|d|)``: k1 is signed, so its mean does not bound its terms)."""
    rl = case.rows.rl
    if case.rows.ref_logprobs is None or not bool(rl.any()):
        return 0.0
    d = (case.rows.ref_logprobs.double() - case.lp.double())[rl].abs()
    d = torch.nan_to_num(d, nan=0.0, posinf=0.0)
    return float((d + 0.5 * d * d + torch.expm1(d.clamp(max=700))).mean())


def sum_tol(n: int, s: float) -> float:
    """See the module docstring: fp32 sums of ``n`` terms of total magnitude ``s`` in two orders."""
    depth = math.ceil(max(n, 1) / BLOCK) + math.log2(BLOCK) + math.log2(max(n, 2)) + 16
    return depth * EPS * s
