"""The fused ``[N]`` loss algebra: contract, parameters and the autograd Function.

Between the two selective-logprob phases the loss is ``[N]``-sized algebra: the policy's
per-token loss, the ``kl_tau`` penalty and entropy bonus, the echo term, the normalisers, the
metrics and the value checks. Written as PyTorch ops it is about a hundred small kernels per
forward+backward, each paying a launch and the host's dispatch; on a GPU the host time of those
launches, not the GPU time, sets the speed at every realistic shape. This op computes all of it
in one pass over the rows for the losses whose derivative with respect to a row's logprob comes
from that row and a few sums over its sequence (the built-in policies ``dppo``, ``ppo_clip``,
``cispo``, ``reinforce``, ``gspo``, ``cispo_sequence``, ``sapo``, ``sapo_sequence`` and
``mode="sft"``, every normaliser, mismatch correction and reference KL):

* forward: the loss, ``a = d loss / d logprob [N]`` and ``b = d loss / d entropy [N]`` (when the
  entropy is trained), the metrics (`STAT_SLOTS`) and the numbers of the value checks
  (`CHECK_SLOTS`), all at once;
* backward: ``a · g`` and ``b · g`` (one launch each), handed to phase 2.

``fused.py`` is one Triton program (two loops over the rows: the counts the denominators need,
then everything else); ``naive.py`` is the same contract in plain PyTorch, its gold. The formulas are the
loss module's (``docs/loss.md``); the loss module's general algebra stays the definition and the
tests hold this op to it, forward and backward.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import torch

from echoloss._validate import describe, problem
from echoloss.ops.row_algebra.contract import (
    CHECK_SLOTS,
    FLAG_NAMES,
    POLICIES,
    STAT_SLOTS,
    RowAlgebraParams,
    RowInputs,
)

__all__ = [
    "CHECK_SLOTS",
    "FLAG_NAMES",
    "POLICIES",
    "STAT_SLOTS",
    "RowAlgebraParams",
    "RowInputs",
    "row_algebra",
]


class RowAlgebraOutput(NamedTuple):
    """``loss`` (0-dim, differentiable), ``stats [len(STAT_SLOTS)]`` fp32 over all rows,
    ``checks [len(CHECK_SLOTS)]`` fp64 and ``env_stats [num_envs, len(STAT_SLOTS)]`` fp32, the
    metrics of each env (``[0, K]`` without envs; their loss slots are unused), all detached."""

    loss: torch.Tensor
    stats: torch.Tensor
    checks: torch.Tensor
    env_stats: torch.Tensor


class _RowAlgebraFn(torch.autograd.Function):
    """Forward: the backend's one pass (loss, derivatives, stats, checks). Backward: the
    derivatives saved in forward times the incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        lp: torch.Tensor,
        ent: torch.Tensor | None,
        rows: RowInputs,
        params: RowAlgebraParams,
        impl: ModuleType,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loss, a, b, stats, checks = impl.forward(
            lp.detach(), None if ent is None else ent.detach(), rows, params
        )
        ctx.save_for_backward(a, b)
        ctx.mark_non_differentiable(stats, checks)
        ctx.set_materialize_grads(False)  # no zero gradients made for stats and checks
        return loss, stats, checks

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor | None, *_: Any) -> tuple[Any, ...]:
        a, b = ctx.saved_tensors
        if grad is None:  # backward reached only through stats or checks (never differentiable)
            return None, None, None, None, None
        grad_lp = a * grad if ctx.needs_input_grad[0] else None
        grad_ent = b * grad if b is not None and ctx.needs_input_grad[1] else None
        return grad_lp, grad_ent, None, None, None


def _impl(backend: str) -> ModuleType:
    if backend == "naive":
        from echoloss.ops.row_algebra import naive

        return naive
    if backend == "triton":
        from echoloss.ops.row_algebra import fused

        return fused
    raise ValueError(problem("backend", "'triton' or 'naive'", describe(backend)))


def row_algebra(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    rows: RowInputs,
    params: RowAlgebraParams,
    *,
    backend: str = "triton",
) -> RowAlgebraOutput:
    """The loss, metrics and check numbers of one call from its ``[N]`` logprobs, in one pass.

    Args:
        logprobs: ``[N]`` fp32, differentiable (rows outside ``rl | echo`` are never read).
        entropy: ``[N]`` fp32 or None; differentiable only when ``params.entropy_coef != 0``
            (required then).
        rows: the per-row fields (`RowInputs`).
        params: what to compute (`RowAlgebraParams`).
        backend: ``"triton"`` (one Triton launch; CUDA, or cpu under ``TRITON_INTERPRET=1``)
            or ``"naive"`` (plain PyTorch with autograd, reading values on the host: for tests).

    Returns:
        `RowAlgebraOutput` ``(loss, stats, checks, env_stats)``; ``loss.backward()`` gives ``logprobs``
        (and ``entropy``) the saved per-row derivatives times the incoming gradient.

    Examples:
        >>> lp = torch.tensor([-0.2, -0.4], requires_grad=True)
        >>> rows = RowInputs(rl=torch.tensor([True, False]), echo=torch.tensor([False, True]),
        ...                  echo_weights=torch.tensor([0.0, 0.5]), advantages=torch.tensor([1.0, 0.0]))
        >>> out = row_algebra(lp, None, rows, RowAlgebraParams("reinforce"), backend="naive")
        >>> round(out.loss.item(), 4)  # RL: -1·(-0.2) / 1; echo: 0.5·0.4 / 1
        0.4
        >>> out.loss.backward(); lp.grad
        tensor([-1.0000, -0.5000])
    """
    if logprobs.dtype != torch.float32 or logprobs.dim() != 1:
        raise TypeError(problem("logprobs", "a 1-D float32 tensor [N]", describe(logprobs)))
    if params.entropy_coef != 0 and entropy is None:
        raise ValueError(
            problem("entropy", "[N] entropy when params.entropy_coef != 0", describe(entropy))
        )
    if params.entropy_metric and entropy is None:
        raise ValueError(problem("entropy", "[N] entropy for entropy_metric", describe(entropy)))
    if params.mismatch_metric and rows.inference_logprobs is None:
        raise ValueError(
            problem(
                "rows.inference_logprobs",
                "[N] inference logprobs for mismatch_metric",
                describe(rows.inference_logprobs),
            )
        )
    if params.mismatch is not None and rows.inference_logprobs is None:
        raise ValueError(
            problem(
                "rows.inference_logprobs",
                f"[N] inference logprobs for mismatch={params.mismatch!r}",
                describe(rows.inference_logprobs),
            )
        )
    if params.kl_coef != 0 and rows.ref_logprobs is None:
        raise ValueError(
            problem(
                "rows.ref_logprobs",
                f"[N] reference logprobs for kl_coef={params.kl_coef}",
                describe(rows.ref_logprobs),
            )
        )
    if params.reads_sequences and rows.sequence_ids is None:
        raise ValueError(
            problem(
                "rows.sequence_ids",
                f"[N] int sequence ids for policy={params.policy!r}, "
                f"mismatch={params.mismatch!r}, rl_normalization={params.rl_normalization!r}, "
                f"echo_normalization={params.echo_normalization!r} (something per sequence)",
                describe(rows.sequence_ids),
            )
        )
    n = logprobs.numel()
    for name in ("sequence_ids", "observation", "echo_weights", "advantages"):
        field = getattr(rows, name)
        if field is not None and field.numel() != n:
            raise ValueError(
                problem(f"rows.{name}", f"{n} entries, one per row of logprobs", describe(field))
            )
    for name, divisor in (("rl_divisor", rows.rl_divisor), ("echo_divisor", rows.echo_divisor)):
        if divisor is not None and (
            not isinstance(divisor, torch.Tensor)
            or divisor.numel() != 1
            or not divisor.dtype.is_floating_point
            or divisor.device != logprobs.device
        ):
            raise ValueError(
                problem(
                    f"rows.{name}",
                    f"None or a 1-element float tensor on {logprobs.device} (the term's divisor)",
                    describe(divisor),
                )
            )
    if params.echo_normalization == "sum" and rows.echo_divisor is not None:
        raise ValueError(
            problem(
                "rows.echo_divisor",
                "None with echo_normalization='sum' (nothing divides the echo sum)",
                describe(rows.echo_divisor),
            )
        )
    if params.echo_normalization == "sequence_mean" and rows.observation is None:
        raise ValueError(
            problem(
                "rows.observation",
                "[N] bool observation rows (counted in Z_i) for echo_normalization='sequence_mean'",
                describe(rows.observation),
            )
        )
    ent = entropy if params.entropy_coef != 0 else (None if entropy is None else entropy.detach())
    if rows.env_of_row is not None and rows.num_envs < 0:
        raise ValueError(problem("rows.num_envs", "≥ 0", describe(rows.num_envs)))
    loss, stats, checks = _RowAlgebraFn.apply(logprobs, ent, rows, params, _impl(backend))  # type: ignore[no-untyped-call]
    return RowAlgebraOutput(loss, stats[0], checks, stats[1:])
