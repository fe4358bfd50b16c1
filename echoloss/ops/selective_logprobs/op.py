"""The selective-logprob op: logprob of each label (and entropy) from logits, fp32 results.

The public entry is [`selective_logprobs`][echoloss.ops.selective_logprobs.selective_logprobs]. The work happens in two phases behind a private
autograd Function: phase 1 (forward) computes the label's logprob, the log-sum-exp and optionally
the entropy of each participating row; phase 2 (backward) writes ``dlogits`` from one coefficient
per row. ``reference.py`` implements both phases in PyTorch; a fused kernel implements the same two
functions (``forward`` and ``backward``) and plugs in through ``backend``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from echoloss._compile import compiler_disable
from echoloss._deferred import first_true, on_device_path
from echoloss._logging import warn_once
from echoloss._validate import (
    check_bool,
    check_chunk_size,
    check_per_token,
    check_tensor,
    describe,
    problem,
)
from echoloss.ops.selective_logprobs import reference
from echoloss.ops.value_checks import DeferredChecks, check_temperature

__all__ = [
    "BACKENDS",
    "label_range_message",
    "resolve_backend",
    "selective_logprobs",
    "selective_logprobs_checked_by_caller",
]

#: Accepted values of ``backend``.
BACKENDS = ("auto", "reference", "triton")


def resolve_backend(backend: str, device: torch.device) -> ModuleType:
    """The module implementing the two phases for ``backend`` on ``device``.

    ``"reference"``: the chunked PyTorch reference. ``"triton"``: the fused Triton kernels
    (``fused.py``, needs ``pip install 'echoloss[triton]'``) on CUDA, or on cpu when the
    environment has ``TRITON_INTERPRET=1`` (the Triton interpreter: slow, for tests; it must be
    set before ``fused.py`` is first imported). ``"auto"``: Triton on CUDA when triton is
    installed (else the reference, with a one-time warning), the reference on every other device.

    Raises:
        NotImplementedError: ``"triton"`` where it cannot run (no triton, or a non-CUDA device
            without ``TRITON_INTERPRET=1``).

    Examples:
        >>> import torch
        >>> resolve_backend("auto", torch.device("cpu")).__name__
        'echoloss.ops.selective_logprobs.reference'
    """
    if backend not in BACKENDS:
        raise ValueError(problem("backend", f"one of {BACKENDS}", describe(backend)))
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return reference
    interpret = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
    if backend == "triton" and device.type != "cuda" and not (device.type == "cpu" and interpret):
        raise NotImplementedError(
            f"backend='triton' on {device}: the Triton kernels need a CUDA device (on cpu, "
            "TRITON_INTERPRET=1 runs them in the Triton interpreter, for tests); use "
            "backend='auto' or 'reference', which compute the same values in chunked PyTorch"
        )
    try:
        from echoloss.ops.selective_logprobs import fused
    except ImportError as e:
        if backend == "auto":
            warn_once(
                "auto-backend-no-triton",
                f"backend='auto' on CUDA: triton is not importable ({e}), using the PyTorch "
                "reference; pip install 'echoloss[triton]' for the fused kernels",
            )
            return reference
        raise NotImplementedError(
            f"backend='triton': triton is not importable ({e}); pip install 'echoloss[triton]', "
            "or use backend='auto' or 'reference', which compute the same values in chunked "
            "PyTorch"
        ) from e
    return fused


class _SelectiveLogprobsFn(torch.autograd.Function):
    """Phase 1 in forward, phase 2 in backward; nothing ``[N, V]``-sized is saved but the input."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        rows: torch.Tensor | None,
        inv_t: float | torch.Tensor,
        need_entropy: bool,
        chunk_size: int,
        impl: ModuleType,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_all = labels.numel()
        lp_c, lse, ent_c = impl.forward(
            logits,
            labels,
            rows=rows,
            inv_temperature=inv_t,
            need_entropy=need_entropy,
            chunk_size=chunk_size,
            **({} if mask is None else {"mask": mask}),
        )
        if rows is None:
            lp, ent = lp_c, ent_c
        else:
            # Rows that do not participate read exactly 0 (never an uninitialised value).
            lp = lp_c.new_zeros(n_all).index_copy_(0, rows, lp_c)
            ent = None if ent_c is None else lp_c.new_zeros(n_all).index_copy_(0, rows, ent_c)
        if ent is None:
            ent = lp.new_zeros(0)
            ctx.mark_non_differentiable(ent)
        inv_t_t = inv_t if isinstance(inv_t, torch.Tensor) else None
        ctx.save_for_backward(logits, labels, rows, lse, ent_c, inv_t_t, mask)
        ctx.inv_t_float = inv_t if not isinstance(inv_t, torch.Tensor) else None
        ctx.need_entropy = need_entropy
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)
        ctx.impl = impl
        return lp, ent

    @staticmethod
    def backward(ctx: Any, grad_lp: torch.Tensor, grad_ent: torch.Tensor) -> tuple[Any, ...]:
        logits, labels, rows, lse, ent_c, inv_t_t, mask = ctx.saved_tensors
        nones = (None,) * 7
        if not ctx.needs_input_grad[0]:
            return (None, *nones)
        inv_t = ctx.inv_t_float if inv_t_t is None else inv_t_t
        # Gradients are not materialised (``set_materialize_grads(False)``): an unused output
        # (the entropy of a metric) gets None, not a zero tensor that phase 2 would multiply.
        use_ent = ctx.need_entropy and grad_ent is not None and grad_ent.numel() > 0
        if grad_lp is None:
            if not use_ent:
                return (None, *nones)
            grad_lp = torch.zeros(labels.numel(), dtype=lse.dtype, device=labels.device)
        if mask is not None:
            # Device path: every row keeps its slot; rows outside the mask or with zero
            # coefficients are dead (exact zeros), decided by phase 2 on the device.
            b = grad_ent if use_ent else None
            grad = ctx.impl.backward(
                logits,
                labels,
                rows=None,
                inv_temperature=inv_t,
                lse=lse,
                grad_logprobs=grad_lp,
                grad_entropy=b,
                entropy=ent_c if b is not None else None,
                chunk_size=ctx.chunk_size,
                live=mask,
                skip_zero_rows=True,
            )
            return (grad, *nones)
        if rows is None:
            rows = torch.arange(labels.numel(), device=labels.device)
        a = grad_lp.index_select(0, rows)
        b = grad_ent.index_select(0, rows) if use_ent else None
        ent = ent_c
        # Rows whose coefficients are all zero have an exactly zero gradient: skip them.
        live = a != 0 if b is None else (a != 0) | (b != 0)
        if not bool(live.all()):
            keep = live.nonzero().squeeze(1)
            rows, a, lse = rows[keep], a[keep], lse[keep]
            b = None if b is None else b[keep]
            ent = None if ent is None else ent[keep]
        grad = ctx.impl.backward(
            logits,
            labels,
            rows=rows,
            inv_temperature=inv_t,
            lse=lse,
            grad_logprobs=a,
            grad_entropy=b,
            entropy=ent if b is not None else None,
            chunk_size=ctx.chunk_size,
        )
        return (grad, *nones)


#: The fix named by a label out of range (shared by every op and loss that checks labels).
LABEL_FIX = (
    "pass mask= to skip rows that predict nothing (e.g. the last row of each sequence, "
    "ignore_index -100)"
)


def _check_labels_now(labels: torch.Tensor, rows: torch.Tensor | None, v: int) -> None:
    """Host path: every participating label in ``[0, V)`` (else name the first bad row)."""
    lab_used = labels if rows is None else labels.index_select(0, rows)
    bad = (lab_used < 0) | (lab_used >= v)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        row = i if rows is None else int(rows[i])
        raise ValueError(
            problem(
                f"labels[{row}]",
                f"in [0, V={v}) on a participating row",
                str(int(lab_used[i])),
                LABEL_FIX,
            )
        )


def labels_checked_on_device(
    labels: torch.Tensor, mask: torch.Tensor | None, v: int, fix: str = LABEL_FIX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device path: ``(mask [N] bool, labels [N])``, the range check deferred.

    A participating label outside ``[0, V)`` is reported later (``echoloss/_deferred.py``) with
    the host path's message; meanwhile both phases read it as 0 (the kernels and the
    reference check the range per row), so nothing reads out of bounds. The check is queued
    lazily: inside a loss call its launches run with the loss's packing of the checks (in the
    compiled region when `compile_loss_algebra` is on), none before phase 1.
    """
    flat_mask = torch.ones_like(labels, dtype=torch.bool) if mask is None else mask.reshape(-1)
    if labels.numel():

        def numbers() -> list[torch.Tensor]:
            bad = flat_mask & (labels.clamp(0, v - 1) != labels)  # [N] participating, outside
            row = first_true(bad)
            return [bad.any(), row, labels.index_select(0, row.view(1))]

        checks = DeferredChecks(labels.device)
        checks.add_lazy(numbers, label_range_message(v, fix))
        checks.submit()
    return flat_mask, labels


def label_range_message(
    v: int, fix: str = LABEL_FIX
) -> Callable[[Sequence[float]], Exception | None]:
    """The deferred label-range error from ``(any bad, first bad row, its label)``."""

    def message(x: Sequence[float]) -> Exception | None:
        if not x[0]:
            return None
        return ValueError(
            problem(
                f"labels[{int(x[1])}]",
                f"in [0, V={v}) on a participating row",
                str(int(x[2])),
                fix,
            )
        )

    return message


@compiler_disable
def selective_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each label (and entropy) under ``softmax(logits / T)``, chunked over tokens.

    Equivalent to ``log_softmax(logits.float() / T, -1).gather(-1, labels[..., None])`` (see
    [`echoloss.ops.selective_logprobs.naive.naive_selective_logprobs`][echoloss.ops.selective_logprobs.naive.naive_selective_logprobs]), but computed
    ``chunk_size`` rows at a time: the peak extra memory is a few ``[chunk_size, V]`` fp32 buffers,
    never a full fp32 copy of the logits, and backward re-reads the logits instead of keeping the
    softmax. Differentiable w.r.t. ``logits`` through both outputs.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, any float dtype (bf16, fp16, fp32, fp64), any
            strides (``logits[:, :-1]`` is read without a copy). Never modified.
        labels: ``[N]`` or ``[B, T]`` integer: the token each row predicts (already shifted).
            Must lie in ``[0, V)`` on every row that participates; other rows are not read.
        temperature: sampling temperature ``T > 0``: a float, a 0-dim tensor, or one value per
            row (``[N]`` / ``[B, T]``). Treated as a constant (no gradient).
        return_entropy: also return the entropy of ``softmax(logits / T)`` per row.
        chunk_size: rows per chunk; None picks about 2^22 elements per chunk (``2^22 // V``).
        mask: optional ``[N]`` / ``[B, T]`` bool, True = compute this row. Other rows cost no work
            and read exactly 0 in both outputs, with zero gradient.
        backend: ``"auto"`` (the Triton kernels on CUDA, the reference elsewhere),
            ``"reference"`` or ``"triton"`` (CUDA, or cpu under ``TRITON_INTERPRET=1``); see
            [`resolve_backend`][echoloss.ops.selective_logprobs.resolve_backend].

    Returns:
        ``logprobs`` of shape ``labels.shape``, fp32 (fp64 for fp64 logits); with
        ``return_entropy`` the tuple ``(logprobs, entropy)``.

    Raises:
        TypeError, ValueError: on a wrong dtype, shape, device, label or temperature, with the fix.

    Examples:
        >>> import torch
        >>> logits = torch.tensor([[0.0, 0.0], [0.0, 2.0]], requires_grad=True)
        >>> lp, ent = selective_logprobs(logits, torch.tensor([0, 1]), return_entropy=True)
        >>> lp.detach()  # log(1/2), log(e^2 / (1 + e^2))
        tensor([-0.6931, -0.1269])
        >>> lp.sum().backward()
        >>> logits.grad  # onehot - softmax
        tensor([[ 0.5000, -0.5000],
                [-0.1192,  0.1192]])
        >>> selective_logprobs(logits, torch.tensor([0, 1]), mask=torch.tensor([False, True])).detach()
        tensor([ 0.0000, -0.1269])
    """
    check_bool("return_entropy", return_entropy)
    args = _checked_args(logits, labels, temperature, chunk_size, mask, backend)
    return _run(*args, return_entropy, check_labels=True)


def selective_logprobs_checked_by_caller(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor,
    return_entropy: bool,
    chunk_size: int | None,
    mask: torch.Tensor,
    backend: str,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[`selective_logprobs`][echoloss.ops.selective_logprobs.selective_logprobs] for a caller
    that checks the values of its labels and per-row temperatures itself: on the device path
    that every label of ``mask`` is in ``[0, V)`` (the loss's fused row algebra does, in its
    one launch, with `label_range_message`), and the temperatures before the call (the loss
    builds them from its validated record). The op then queues no value check of its own on
    the device path (about twenty launches fewer with per-row temperatures). Labels outside
    the range still read as 0 in both phases, and the host path checks them here as always.
    Same arguments and result."""
    args = _checked_args(
        logits, labels, temperature, chunk_size, mask, backend, temperature_values=False
    )
    return _run(*args, return_entropy, check_labels=False)


def _checked_args(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    chunk_size: int | None,
    mask: torch.Tensor | None,
    backend: str,
    *,
    temperature_values: bool = True,
) -> tuple[
    torch.Tensor, torch.Tensor, float | torch.Tensor, int | None, torch.Tensor | None, ModuleType
]:
    """The op's arguments, checked (metadata; values only on the host path, in `_run`)."""
    logits = check_tensor("logits", logits)
    if not logits.dtype.is_floating_point or logits.dim() not in (2, 3):
        raise TypeError(problem("logits", "a float tensor [N, V] or [B, T, V]", describe(logits)))
    lead = logits.shape[:-1]
    v = logits.shape[-1]
    if v < 1:
        raise ValueError(
            problem("logits", "non-empty over the vocabulary (last) dimension", describe(logits))
        )
    labels = check_per_token(
        "labels",
        labels,
        lead,
        logits.device,
        "int",
        fix="labels[j] is the token logits[j] predicts",
    )
    if mask is not None:
        mask = check_per_token("mask", mask, lead, logits.device, "bool")
    chunk_size = check_chunk_size(chunk_size)
    temp = check_temperature(temperature, lead, logits.device, check_values=temperature_values)
    impl = resolve_backend(backend, logits.device)
    return logits, labels, temp, chunk_size, mask, impl


def _run(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temp: float | torch.Tensor,
    chunk_size: int | None,
    mask: torch.Tensor | None,
    impl: ModuleType,
    return_entropy: bool,
    *,
    check_labels: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    lead = logits.shape[:-1]
    v = logits.shape[-1]
    flat_labels = labels.reshape(-1).long()
    flat_mask: torch.Tensor | None = None
    if on_device_path(logits.device):
        rows = None
        if check_labels:
            flat_mask, flat_labels = labels_checked_on_device(flat_labels, mask, v)
        elif mask is not None:
            flat_mask = mask.reshape(-1)
    else:
        rows = None if mask is None else mask.reshape(-1).nonzero().squeeze(1)
        _check_labels_now(flat_labels, rows, v)
    if logits.dim() == 3:
        try:
            logits_in = logits.view(-1, v)
        except RuntimeError:  # e.g. logits[:, :-1]: read rows in place instead of copying
            logits_in = logits
    else:
        logits_in = logits
    cdtype = reference.compute_dtype(logits.dtype)
    inv_t: float | torch.Tensor
    if isinstance(temp, torch.Tensor):
        inv_t = temp.reshape(-1).to(cdtype).reciprocal()
    else:
        inv_t = 1.0 / temp
    cs = chunk_size if chunk_size is not None else reference.default_chunk_size(v)
    out: tuple[torch.Tensor, torch.Tensor] = _SelectiveLogprobsFn.apply(  # type: ignore[no-untyped-call]
        logits_in, flat_labels, rows, inv_t, return_entropy, cs, impl, flat_mask
    )
    lp, ent = out
    lp = lp.view(lead)
    if return_entropy:
        return lp, ent.view(lead)
    return lp
