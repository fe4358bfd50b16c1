"""``echo_loss_from_hidden``: [`echoloss.echo_loss`][echoloss.loss.echo_loss] from hidden states and the LM head.

The third loss entry point: the same `LossInputs` record and loss
algebra (`echoloss.loss.core.loss_from_logprobs`), with the logprobs computed by the
chunked fused-linear op [`echoloss.ops.fused_linear.linear_selective_logprobs`][echoloss.ops.fused_linear.linear_selective_logprobs].
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from echoloss._compile import compiler_disable
from echoloss._deferred import raise_deferred_errors
from echoloss._validate import check_chunk_size
from echoloss.loss.checks import chunk_additive
from echoloss.loss.chunks import row_coefficients
from echoloss.loss.config import LossConfig
from echoloss.loss.core import (
    LossOutput,
    label_check_on_device,
    loss_from_logprobs,
    start_scored_call,
)
from echoloss.loss.inputs import LossInputs
from echoloss.loss.normalization import Normalizers
from echoloss.loss.policy import PolicyFn
from echoloss.ops.fused_linear.op import (
    EarlyLogits,
    attach_gradients,
    check_linear_inputs,
    linear_logprobs_for_loss,
    start_logits,
)

__all__ = ["echo_loss_from_hidden"]


@compiler_disable
def echo_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    inputs: LossInputs | torch.Tensor | None = None,
    *,
    config: LossConfig | None = None,
    normalizers: Normalizers | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    policy_fn: PolicyFn | None = None,
    **fields: Any,
) -> LossOutput:
    """[`echoloss.echo_loss`][echoloss.loss.echo_loss] on ``logits = hidden @ weight.T``, without the ``[N, V]`` logits.

    Same loss, metrics and gradients as ``echo_loss(hidden @ weight.T, labels, ...)`` (up to
    the rounding of a different summation order): the rows that take part in neither term
    are dropped before the matmul, the others go through the LM head ``chunk_size`` rows at a
    time ([`echoloss.ops.fused_linear.linear_selective_logprobs`][echoloss.ops.fused_linear.linear_selective_logprobs]), and the loss algebra is
    [`echoloss.loss.echo_loss_from_logprobs`][echoloss.loss.echo_loss_from_logprobs]. ``hidden.grad`` and ``weight.grad`` are
    accumulated chunk by chunk (``weight.grad`` in fp32 for a bf16/fp16 weight, cast once at the
    end). Rows outside ``rl_mask | echo_weights > 0`` get exactly zero ``hidden.grad``.
    Arguments other than ``rl_mask`` and ``echo_weights`` are validated after the forward
    matmul.

    The gradients take the cheapest of three paths
    (`echoloss.ops.fused_linear.op.linear_logprobs_for_loss`). When every participating row
    fits one chunk (on CUDA the default up to ``4·H`` rows in bf16) and a gradient is
    recorded, the chunk's logits are kept for backward, which writes their gradient over them:
    logits-then-loss's GEMMs and phases on the same tensors (its loss, metrics and gradients
    bit for bit, for any loss and incoming gradient) with one ``[n, V]`` buffer instead of
    two. Over several chunks, when the loss is chunk-additive
    (`echoloss.loss.checks.chunk_additive`: per-token policies with any normaliser, whose
    denominators are known before any logprob), the gradients are formed in the forward pass,
    chunk by chunk, while each chunk's logits are in memory: one LM-head GEMM per chunk
    instead of two (backward only scales them by the incoming gradient); the ``[V, H]``
    weight gradient (fp32 for a bf16/fp16 weight) is then held from forward to backward, and
    the loss supports one backward. Otherwise (a sequence-level ratio or mismatch weight,
    custom policies) backward recomputes each chunk's logits. All give the same gradients
    (tested).

    Args:
        hidden: ``[N, H]`` final hidden states (the LM head's input), bf16/fp16/fp32/fp64.
        weight: ``[V, H]`` LM-head weight (``lm_head.weight``), same dtype and device.
        inputs: the per-token inputs (`echoloss.LossInputs`, shape ``[N]``, ``labels``
            in ``[0, V)`` on every participating row), or the labels tensor of the keyword form.
        config, normalizers, policy_fn: as in [`echoloss.echo_loss`][echoloss.loss.echo_loss].
        **fields: the keyword form, as in [`echoloss.echo_loss`][echoloss.loss.echo_loss]: fields
            of `echoloss.LossInputs` by name, every per-token tensor ``[N]``.
        chunk_size: participating rows per chunk; None = about ``2^26`` logits elements (on
            CUDA as large as the fp32 weight-gradient accumulator, ``2·H`` rows for bf16, and
            all rows in one chunk up to ``4·H`` of them, within a quarter of the free memory:
            `echoloss.ops.fused_linear.op.auto_linear_chunk_size`).
        backend: ``"auto"`` (Triton on CUDA, the PyTorch reference elsewhere), ``"reference"``
            or ``"triton"``: the selective-logprob phases run on each chunk's logits.

    Returns:
        [`echoloss.loss.LossOutput`][echoloss.loss.LossOutput] ``(loss, metrics)``.

    Raises:
        TypeError, ValueError: on a bad input; the message names the argument and the fix.

    Examples:
        Golden case B of ``echo_loss`` with an identity LM head (``logits = hidden``):

        >>> import torch
        >>> from echoloss.loss import LossConfig, LossInputs, Normalizers
        >>> lp = torch.tensor([-0.2, -0.4])
        >>> hidden = torch.stack([lp, torch.log(-torch.expm1(lp))], 1).requires_grad_()
        >>> weight = torch.eye(2, requires_grad=True)
        >>> x = LossInputs(labels=torch.tensor([0, 0]), rl_mask=torch.tensor([True, True]),
        ...                echo_weights=torch.tensor([0.0, 2.0]), advantages=torch.tensor([1.0, 2.0]),
        ...                inference_logprobs=lp)
        >>> out = echo_loss_from_hidden(
        ...     hidden, weight, x, config=LossConfig(dppo_low=10, dppo_high=10, kl_tau=0),
        ...     normalizers=Normalizers(rl_tokens=1, echo_tokens=4), backend="reference")
        >>> round(out.loss.item(), 5)  # RL -1.0 + echo -(2·-0.4)/4
        -0.8
        >>> out.loss.backward()
        >>> hidden.grad.shape, weight.grad.shape
        (torch.Size([2, 2]), torch.Size([2, 2]))
    """
    raise_deferred_errors(block=False)
    hidden, weight = check_linear_inputs(hidden, weight)
    chunk_size = check_chunk_size(chunk_size)
    early = start_logits(
        hidden, weight, chunk_size=chunk_size
    )  # the GPU starts while the host checks
    lead = hidden.shape[:1]
    call = start_scored_call(
        inputs, fields, config, policy_fn, lead=lead, device=hidden.device, source="hidden",
        entry="echo_loss_from_hidden",
    )  # fmt: skip
    x, cfg, spec, checks = call.x, call.cfg, call.spec, call.checks
    label_check = label_check_on_device(call.labels, weight.shape[0], hidden.device)
    with checks.collecting():  # what the op checks joins the call (none on the device path)
        lp, ent_all, grads = _logprobs(
            hidden, weight, x, cfg, spec, normalizers, policy_fn, call.temperature, x.rl | x.echo,
            call.need_entropy, chunk_size, backend, early, labels_checked=label_check is not None,
        )  # fmt: skip
    ent: torch.Tensor | None = None
    if call.need_entropy:
        ent = ent_all if cfg.entropy_coef != 0 else ent_all.detach()
    out = loss_from_logprobs(
        lp, ent, x, cfg, normalizers, policy_fn, source="hidden", spec=spec, checks=checks,
        label_check=label_check,
    )  # fmt: skip
    if grads is None:
        return out
    return LossOutput(attach_gradients(out.loss, hidden, weight, *grads), out.metrics)


def _logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    x: LossInputs,
    cfg: LossConfig,
    spec: Any,
    normalizers: Normalizers | None,
    policy_fn: PolicyFn | None,
    temp: Any,
    mask: torch.Tensor,
    need_ent: bool,
    chunk_size: int | None,
    backend: str,
    early: EarlyLogits | None,
    *,
    labels_checked: bool,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None] | None]:
    """``(logprobs [N], entropy [N] or [0], [d hidden, d weight] or None)``: the gradients
    formed in the forward pass for a chunk-additive loss (see `echo_loss_from_hidden`)."""
    assert x.labels is not None  # echo_loss_from_hidden
    coefficients = None
    if chunk_additive(cfg, policy_fn):
        coefficients = functools.partial(row_coefficients, x, cfg, spec, normalizers)
    return linear_logprobs_for_loss(
        hidden,
        weight,
        x.labels,
        temp,
        mask,
        need_ent,
        chunk_size,
        backend,
        coefficients,
        early=early,
        labels_checked_by_caller=labels_checked,
    )  # [N], [N] or [0]; [d hidden, d weight] formed in forward, or None
