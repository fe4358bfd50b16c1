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


def divisors(case: Case) -> tuple[float, float]:
    p, rows = case.params, case.rows
    n_rl, n_echo = int(rows.rl.sum()), int(rows.echo.sum())
    if rows.rl_divisor is not None:
        rl_div = float(rows.rl_divisor)
    elif p.rl_divisor is not None:
        rl_div = p.rl_divisor
    else:
        rl_div = max(n_rl, 1)
    if p.echo_normalization == "sum":
        echo_div = 1.0
    elif p.echo_normalization == "token_mean":
        echo_div = max(n_echo, 1) if p.echo_divisor is None else p.echo_divisor
    else:
        echo_div = max(n_echo, 1) * (p.echo_divisor or 1.0)
    return float(rl_div), float(echo_div)


def bounds(case: Case) -> tuple[float, torch.Tensor]:
    """``(S, G)``: a bound of Σ|terms| of the loss (each term over its divisor) and per row a
    bound ``G [N]`` of the terms of its derivative ``a`` (fp64)."""
    p, rows = case.params, case.rows
    rl, echo = rows.rl, rows.echo
    lp = torch.where(rl | echo, case.lp.double(), 0.0)

    def on(mask, t):
        return torch.zeros_like(lp) if t is None else torch.where(mask, t.double(), 0.0)

    if rows.old_logprobs is not None:
        base = on(rl, rows.old_logprobs)
    elif rows.inference_logprobs is not None:
        base = on(rl, rows.inference_logprobs)
    else:
        base = on(rl, lp)
    rho = torch.where(rl, lp - base, 0.0)
    c = math.inf if p.log_ratio_clamp is None else p.log_ratio_clamp
    r = torch.exp(rho.clamp(-c, c))
    adv = on(rl, rows.advantages).abs() * p.adv_tau
    if p.policy == "sft":
        t_rl, g_rl = lp.abs(), torch.ones_like(lp)
    else:
        if p.policy == "reinforce":
            m, with_lp = torch.ones_like(r), True
        elif p.policy == "cispo":
            m, with_lp = torch.full_like(r, p.high), True
        elif p.policy == "dppo":
            m, with_lp = r, False
        else:  # ppo_clip: A > 0 is capped by 1 + high, A < 0 grows with r (up to the dual clip)
            pos = on(rl, rows.advantages) > 0
            m = torch.where(pos, torch.full_like(r, 1 + p.high), r.clamp(min=1 + p.high))
            if p.dual_clip is not None:
                m = torch.where(pos, m, m.clamp(max=p.dual_clip))
            with_lp = False
        t_rl = adv * m * (1 + lp.abs() if with_lp else 1)
        g_rl = adv * m
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
    s = float(t_rl.sum() / rl_div + t_echo.sum() / echo_div)
    g = torch.where(rl, g_rl / rl_div, torch.where(echo, w / echo_div, 0.0))
    return s, g


def sum_tol(n: int, s: float) -> float:
    """See the module docstring: fp32 sums of ``n`` terms of total magnitude ``s`` in two orders."""
    depth = math.ceil(max(n, 1) / BLOCK) + math.log2(BLOCK) + math.log2(max(n, 2)) + 16
    return depth * EPS * s
