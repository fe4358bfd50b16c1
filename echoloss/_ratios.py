"""Importance ratios ``r = exp(ρ)`` whose derivatives never form ``0 · inf``.

Without a clamp of the log ratio ``ρ``, ``exp(ρ)`` overflows (fp32 beyond ``ρ ≈ 88.7``, fp64
beyond ``ρ ≈ 709.8``) where the objective that reads it is flat: a PPO clip past its bound, a
saturated SAPO gate. The loss is then finite and exact, but autograd's chain rule multiplies the
flat part's 0 by ``d r / d ρ = r = inf`` and every gradient of the batch becomes NaN. The two
functions here give the same values with derivatives that stay finite:

- `exp_ratio`: ``exp(ρ)``, whose backward passes an incoming 0 as 0 (the true derivative of a
  flat objective), every other gradient as ``g · r``;
- `sapo_gate`: ``σ(τ·(exp(ρ) - 1))`` with ``d/dρ = τ·σ(1 - σ)·exp(ρ)`` written as
  ``τ·exp(ρ - |z|) / (1 + exp(-|z|))²`` (``z = τ·(exp(ρ) - 1)``): no factor can overflow.

This module imports nothing from echoloss: the loss (``loss/policy.py``) and the row algebra's gold
(``ops/row_algebra/naive.py``) share it; the fused program writes the same closed forms.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "SAPO_TEMPERATURE_RANGE",
    "exp_may_overflow",
    "exp_ratio",
    "sapo_gate",
    "sapo_gate_slope",
    "sapo_temperature_problem",
]

#: The temperatures SAPO's gate accepts. The loss is ``-σ(τ·(r - 1))·4/τ·A``: at ``τ = 1e-38``
#: ``4/τ`` overflows float32 (a finite advantage gives an infinite loss), at ``τ = 1e39`` ``τ``
#: itself does; ``[1e-6, 1e6]`` keeps ``4/τ·A`` finite for ``|A| < 1e32`` and ``τ·(r - 1)`` for
#: ratios below ``1e32``, six orders of magnitude around the usual 1.0 and 1.05 either way.
SAPO_TEMPERATURE_RANGE = (1e-6, 1e6)


def sapo_temperature_problem(name: str, value: object) -> str | None:
    """Why ``value`` is not a SAPO temperature (None when it is one).

    Examples:
        >>> sapo_temperature_problem("sapo_temperature_pos", 1.05) is None
        True
        >>> sapo_temperature_problem("sapo_temperature_neg", 1e-38)
        'sapo_temperature_neg must be a float in [1e-06, 1e+06] (SAPO divides by it: 4/τ and τ·(r - 1) must stay finite in float32), got 1e-38; the usual values are 1.0 (A > 0) and 1.05 (A ≤ 0)'
    """
    lo, hi = SAPO_TEMPERATURE_RANGE
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi
    if ok:
        return None
    return (
        f"{name} must be a float in [{lo:g}, {hi:g}] (SAPO divides by it: 4/τ and τ·(r - 1) "
        f"must stay finite in float32), got {value!r}; the usual values are 1.0 (A > 0) and "
        "1.05 (A ≤ 0)"
    )


def exp_may_overflow(clamp: float | None, dtype: torch.dtype) -> bool:
    """Whether ``exp`` of a log ratio clamped at ``clamp`` (None = not clamped) can leave the
    range of ``dtype``.

    Examples:
        >>> exp_may_overflow(20.0, torch.float32), exp_may_overflow(None, torch.float32)
        (False, True)
    """
    return clamp is None or clamp >= math.log(torch.finfo(dtype).max)


def sapo_gate_slope(log_ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``σ(z)·(1 - σ(z))·exp(ρ)`` for ``z = τ·(exp(ρ) - 1)``, computed without overflow.

    ``σ(z)(1 - σ(z)) = exp(-|z|) / (1 + exp(-|z|))²``; the factor ``exp(ρ)`` joins the exponent,
    so a ratio past the float range (``z = inf``) gives exactly 0, the limit.

    Examples:
        >>> sapo_gate_slope(torch.tensor([0.0, 100.0, 1e4]), torch.ones(3)).tolist()
        [0.25, 0.0, 0.0]
    """
    z = tau * (torch.exp(log_ratio) - 1)
    a = z.abs()
    slope = torch.exp(log_ratio - a) / (1 + torch.exp(-a)) ** 2
    # z = inf only past the float range (ρ finite there): the limit is 0; ρ - |z| would be NaN
    # for ρ = inf.
    return torch.where(torch.isinf(z), torch.zeros_like(slope), slope)


class _ExpRatio(torch.autograd.Function):
    @staticmethod
    def forward(log_ratio: torch.Tensor) -> torch.Tensor:
        return torch.exp(log_ratio)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (ratio,) = ctx.saved_tensors
        # A flat objective (grad 0) has derivative 0 in ρ whatever the ratio: not 0 · inf.
        return torch.where(grad == 0, torch.zeros_like(grad), grad * ratio)


class _SapoGate(torch.autograd.Function):
    @staticmethod
    def forward(log_ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(tau * (torch.exp(log_ratio) - 1))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_ratio, tau = ctx.saved_tensors
        return grad * tau * sapo_gate_slope(log_ratio, tau), None


def exp_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(ρ)``, differentiable; a zero incoming gradient stays 0 even where ``exp(ρ) = inf``.

    Examples:
        >>> rho = torch.tensor([0.0, 100.0], requires_grad=True)
        >>> r = exp_ratio(rho)
        >>> r.tolist()
        [1.0, inf]
        >>> torch.autograd.grad(r.clamp(max=2.0).sum(), rho)[0].tolist()  # torch.exp: [1, nan]
        [1.0, 0.0]
    """
    return _ExpRatio.apply(log_ratio)  # type: ignore[no-untyped-call,no-any-return]


def sapo_gate(log_ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """SAPO's gate ``σ(τ·(exp(ρ) - 1))`` of the log ratio ``ρ`` (differentiable in ``ρ``, with
    the overflow-free derivative `sapo_gate_slope` times ``τ``); ``tau`` broadcasts with ``ρ``.

    Examples:
        >>> rho = torch.tensor([0.0, 100.0], requires_grad=True)
        >>> gate = sapo_gate(rho, torch.ones(2))
        >>> gate.tolist()
        [0.5, 1.0]
        >>> torch.autograd.grad(gate.sum(), rho)[0].tolist()  # autograd of torch.sigmoid: nan
        [0.25, 0.0]
    """
    return _SapoGate.apply(log_ratio, tau)  # type: ignore[no-untyped-call,no-any-return]
