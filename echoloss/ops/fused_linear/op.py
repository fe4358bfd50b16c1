"""Selective logprobs (and entropy) straight from hidden states and the LM-head weight.

``linear_selective_logprobs(hidden, weight, labels)`` equals
``selective_logprobs(hidden @ weight.T, labels)`` without ever holding the ``[N, V]`` logits:
the participating rows are gathered first, then processed ``chunk_size`` at a time (chunk logits
``[c, V]`` → the two-phase selective-logprob op of ``backend`` → discarded). Backward recomputes
each chunk's logits (the loss between the phases needs every row's logprob first, so the
gradient cannot be formed in the forward pass), writes ``dlogits`` in place over them, and
accumulates ``d hidden`` and ``d weight`` chunk by chunk. In one chunk with a gradient
recorded, the forward keeps the chunk's logits for backward instead of recomputing them
(logits-then-loss's work with one ``[n, V]`` buffer instead of two).

When the caller can give each row's loss coefficients from that row alone (a chunk-additive
loss: `linear_logprobs_with_gradients`), the forward pass forms the gradients itself, chunk by
chunk, while the chunk's logits are still there: phase 2 runs right after phase 1 and nothing is
recomputed (one LM-head GEMM per chunk instead of two); `attach_gradients` hands them to
autograd, scaled by the incoming gradient.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch

from echoloss._compile import compiler_disable
from echoloss._deferred import on_device_path
from echoloss._validate import (
    check_bool,
    check_chunk_size,
    check_per_token,
    check_tensor,
    describe,
    problem,
)
from echoloss.ops.selective_logprobs import reference, resolve_backend
from echoloss.ops.selective_logprobs.op import LABEL_FIX, labels_checked_on_device
from echoloss.ops.value_checks import check_temperature

__all__ = [
    "DEFAULT_LINEAR_CHUNK_ELEMENTS",
    "EarlyLogits",
    "RowCoefficients",
    "attach_gradients",
    "auto_linear_chunk_size",
    "check_linear_inputs",
    "default_linear_chunk_size",
    "linear_chunk_size_for_memory",
    "linear_logprobs_for_loss",
    "linear_logprobs_rows",
    "linear_logprobs_with_gradients",
    "linear_selective_logprobs",
    "start_logits",
]

#: Logits elements per chunk off CUDA (2^26: 128 MiB of bf16 chunk logits; 441 rows at
#: V = 151,936). On CUDA the chunk is at least four times this and as large as the weight-gradient
#: accumulator allows (`linear_chunk_size_for_memory`).
DEFAULT_LINEAR_CHUNK_ELEMENTS = 1 << 26

# Rows of the weight gradient per [rows, H] partial product when it is accumulated in fp32 for a
# bf16/fp16 weight off CUDA (2^24 elements: a 64 MiB fp32 slice instead of a full [V, H] one).
_GRAD_WEIGHT_SLICE_ELEMENTS = 1 << 24


def default_linear_chunk_size(num_classes: int) -> int:
    """Rows per chunk so that one chunk of logits holds about ``2^26`` elements.

    Examples:
        >>> default_linear_chunk_size(151_936)
        441
    """
    return max(1, DEFAULT_LINEAR_CHUNK_ELEMENTS // max(1, num_classes))


def _logits_chunk(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``h @ weight.T`` for one chunk, ``[c, V]`` in the input dtype (the model's own logits)."""
    return torch.mm(h, weight.t())


#: Whether this torch has the mixed-dtype ``addmm(..., out_dtype=)`` (CUDA kernels).
_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")
#: Whether this torch has the mixed-dtype ``mm(..., out_dtype=)`` (CUDA kernels).
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def linear_chunk_size_for_memory(
    num_classes: int,
    hidden_size: int,
    dtype: torch.dtype,
    *,
    grad_weight: bool,
    free_bytes: int,
    rows: int | None = None,
) -> int:
    """Rows per chunk on a GPU with ``free_bytes`` free, for a ``[V, H]`` LM head of ``dtype``.

    When the weight needs a gradient, a ``[V, H]`` accumulator in the compute dtype (fp32 for
    bf16/fp16, 4·V·H bytes) exists anyway, and every chunk reads and writes all of it once
    (its ``dzᵀ @ h`` is added in the GEMM's epilogue): ``8·V·H`` bytes of traffic per chunk
    against the chunk's ``6·c·V·H`` GEMM flops (logits, ``dX``, ``dW``), a ratio of
    ``4 / (3·c)`` bytes per flop, whatever ``V`` and ``H``. The chunk's logits ``[c, V]`` may
    therefore be as large as that accumulator: ``c = H · acc_bytes / elt_bytes`` rows (``2·H``
    for bf16/fp16, ``H`` for fp32: 8,192 rows at ``H = 4096`` in bf16, 3 chunks for 20k rows
    instead of 12 at the former 1,764), so the peak extra memory stays about twice the
    accumulator, independent of the number of rows (logits-then-loss holds ``N·V`` logits and
    their gradient), and the accumulator's traffic is a fixed small fraction of the GEMM time
    (arithmetic at an H100's peak rates, about 300 bf16 flops per byte of bandwidth, not a
    measurement: ``4·300 / (3·8192)`` ≈ 5% at 8,192 rows, against 23% at 1,764). Never fewer rows than four times
    [`default_linear_chunk_size`][echoloss.ops.fused_linear.default_linear_chunk_size] (larger
    GEMMs gain little below that; the rule without a weight gradient), and at most what a
    quarter of ``free_bytes`` holds (at least one row).

    Given the number of participating ``rows``, all of them form **one chunk** when their
    logits are no larger than that working set (one chunk of logits beside the accumulator,
    ``rows ≤ 2·H·acc_bytes/elt_bytes``: 16,384 rows at ``H = 4096`` in bf16) and fit the
    quarter of ``free_bytes``: one chunk needs no accumulator (its ``dzᵀ @ h`` is one GEMM in
    the weight's dtype with fp32 accumulation, rounded once, as logits-then-loss computes it),
    and its three GEMMs are as large as logits-then-loss's. Measured on an H100 at
    ``N = 16,384``, ``V = 151,936``, ``H = 4096`` (bf16): the logits, ``dX`` and ``dW`` GEMMs
    in two chunks of 8,192 rows took 4.9 ms more than in one (``benchmarks/results/``).

    Examples:
        >>> gib = 2**30
        >>> linear_chunk_size_for_memory(151_936, 4096, torch.bfloat16, grad_weight=True,
        ...                              free_bytes=60 * gib)
        8192
        >>> linear_chunk_size_for_memory(151_936, 4096, torch.bfloat16, grad_weight=False,
        ...                              free_bytes=60 * gib)
        1764
        >>> linear_chunk_size_for_memory(151_936, 4096, torch.bfloat16, grad_weight=True,
        ...                              free_bytes=4 * gib)
        3533
        >>> linear_chunk_size_for_memory(151_936, 4096, torch.bfloat16, grad_weight=True,
        ...                              free_bytes=60 * gib, rows=16_384)  # one chunk
        16384
        >>> linear_chunk_size_for_memory(151_936, 4096, torch.bfloat16, grad_weight=True,
        ...                              free_bytes=60 * gib, rows=16_385)
        8192
    """
    elt = torch.empty((), dtype=dtype).element_size()
    cap = 4 * default_linear_chunk_size(num_classes)
    fit = free_bytes // 4 // max(1, num_classes * elt)
    if grad_weight:
        acc = torch.empty((), dtype=reference.compute_dtype(dtype)).element_size()
        if rows is not None and 0 < rows <= min(fit, 2 * hidden_size * acc // elt):
            return int(rows)
        cap = max(cap, -(-hidden_size * acc // elt))
    return int(max(1, min(cap, fit)))


def auto_linear_chunk_size(
    weight: torch.Tensor, *, rows: int | None = None, grad_weight: bool | None = None
) -> int:
    """Rows per chunk for ``weight [V, H]`` and ``rows`` participating rows.

    A chunk holds ``[c, V]`` logits in the weight's dtype (overwritten by their gradient). On
    CUDA the largest chunk is
    [`linear_chunk_size_for_memory`][echoloss.ops.fused_linear.op.linear_chunk_size_for_memory]
    of the free memory (``torch.cuda.mem_get_info``, a driver query that does not wait for the
    GPU); elsewhere
    [`default_linear_chunk_size`][echoloss.ops.fused_linear.default_linear_chunk_size].
    ``grad_weight`` (whether the weight's gradient is accumulated; default: the weight
    requires a gradient and grad mode is on) decides whether the chunk may grow to the size
    of the accumulator. Given ``rows``, the rows are split into as few chunks as that allows,
    of equal size (within one row): fewer rows in memory at once for the same number of
    chunks.

    Examples:
        >>> auto_linear_chunk_size(torch.zeros(151_936, 1))
        441
        >>> auto_linear_chunk_size(torch.zeros(151_936, 1), rows=500)  # 2 chunks either way
        250
    """
    v = weight.shape[0]
    cap = default_linear_chunk_size(v)
    if weight.device.type == "cuda":
        if grad_weight is None:
            grad_weight = weight.requires_grad and torch.is_grad_enabled()
        free, _ = torch.cuda.mem_get_info(weight.device)
        cap = linear_chunk_size_for_memory(
            v, weight.shape[1], weight.dtype, grad_weight=grad_weight, free_bytes=free, rows=rows
        )
    if rows is None or rows <= cap:
        return cap if rows is None else max(1, rows)
    chunks = -(-rows // cap)
    return -(-rows // chunks)


def _add_grad_weight(
    acc: torch.Tensor | None, dz: torch.Tensor, h: torch.Tensor, acc_dtype: torch.dtype
) -> torch.Tensor:
    """``acc + dz.T @ h`` (``acc`` updated in place), or ``dz.T @ h`` into a new ``[V, H]``
    buffer of ``acc_dtype`` when ``acc`` is None (the first chunk writes the accumulator
    instead of reading zeros: one full ``[V, H]`` write and read fewer, and no zero fill).

    The product is accumulated in ``acc_dtype``. Same dtypes: one ``mm`` (first chunk) or
    ``addmm_``. An fp32 accumulator for bf16/fp16 inputs on CUDA: one GEMM per chunk with
    bf16/fp16 operands and fp32 accumulation *and output* (``mm(..., out_dtype=float32)``,
    then ``addmm(acc, ..., out_dtype=float32, out=acc)``, added in the GEMM's epilogue): no
    ``[V, H]`` temporary and no rounding of the chunk's product to the input dtype. Elsewhere
    (no mixed-dtype GEMM on CPU, or a torch without ``out_dtype=``) in vocabulary slices, each
    upcast to fp32 and multiplied by one GEMM, so no ``[V, H]`` temporary is allocated either.
    Written or added, each element is the same fp32 sum (``0 + x = x``).
    """
    if acc is None and dz.dtype == acc_dtype:
        return torch.mm(dz.t(), h)
    on_cuda = dz.device.type == "cuda"
    if acc is None:
        if on_cuda and _MM_OUT_DTYPE:
            out: torch.Tensor = torch.mm(dz.t(), h, out_dtype=acc_dtype)
            return out
        acc = torch.empty(dz.shape[1], h.shape[1], dtype=acc_dtype, device=dz.device)
        if not (on_cuda and _ADDMM_OUT_DTYPE):
            _sliced_grad_weight(acc, dz, h, first=True)
            return acc
        acc.zero_()  # a torch with addmm(out_dtype=) but without mm(out_dtype=)
    if acc.dtype == dz.dtype:
        acc.addmm_(dz.t(), h)
    elif on_cuda and _ADDMM_OUT_DTYPE:
        torch.addmm(acc, dz.t(), h, out_dtype=acc.dtype, out=acc)
    else:
        _sliced_grad_weight(acc, dz, h, first=False)
    return acc


def _grad_weight_dtype(weight: torch.Tensor, rows: int, chunk_size: int) -> torch.dtype:
    """The dtype ``d weight`` is summed in: over several chunks, the compute dtype (an fp32
    accumulator for a bf16/fp16 weight); in one chunk, the weight's own dtype (one GEMM with
    fp32 accumulation inside it, rounded once: logits-then-loss's ``dW``, without a ``[V, H]``
    fp32 buffer or a pass to round it)."""
    return weight.dtype if rows <= chunk_size else reference.compute_dtype(weight.dtype)


def _sliced_grad_weight(acc: torch.Tensor, dz: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """``acc (=|+=) dz.T @ h`` in fp32 GEMMs over slices of ``2^24 / H`` vocabulary rows."""
    v, hd = acc.shape
    step = max(1, _GRAD_WEIGHT_SLICE_ELEMENTS // max(1, hd))
    h32 = h.to(acc.dtype)
    for v0 in range(0, v, step):
        v1 = min(v, v0 + step)
        dz_t = dz[:, v0:v1].t().to(acc.dtype)
        if first:
            torch.mm(dz_t, h32, out=acc[v0:v1])
        else:
            acc[v0:v1].addmm_(dz_t, h32)


def _zeros_if_unwritten(
    grad_w: torch.Tensor | None, need: bool, weight: torch.Tensor
) -> torch.Tensor | None:
    """The accumulator, or exact zeros when no chunk wrote one (no participating row)."""
    if grad_w is not None or not need:
        return grad_w
    return torch.zeros(
        weight.shape, dtype=reference.compute_dtype(weight.dtype), device=weight.device
    )


class _LinearLogprobsFn(torch.autograd.Function):
    """Forward: chunked logits → phase 1. Backward: phase 2 in place over the logits →
    ``d hidden`` rows and a chunk-accumulated ``d weight``.

    Over several chunks the forward saves only the inputs and ``[n]`` per-row statistics, and
    backward recomputes each chunk's logits. When all participating rows form one chunk and a
    gradient is recorded, the forward keeps that chunk's logits for backward instead (no
    second LM-head GEMM; logits-then-loss holds the same ``[n, V]`` plus their gradient):
    backward overwrites them with their gradient, so a second backward through the same graph
    recomputes them.

    ``rows`` None means every row in order (the device path, or no row masked out): each
    chunk is then a slice of the per-row tensors (a view), not a gather."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        rows: torch.Tensor | None,
        inv_t: float | torch.Tensor,
        need_entropy: bool,
        chunk_size: int,
        impl: ModuleType,
        mask: torch.Tensor | None,
        recorded: bool,
        logits: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        v = weight.shape[0]
        cdtype = reference.compute_dtype(hidden.dtype)
        dev = hidden.device
        n = _num_rows(rows, hidden)
        keep = recorded and 0 < n <= chunk_size  # (grad mode is off inside forward)
        inner = reference.default_chunk_size(v)
        # One chunk of every row, in order (the device path's one chunk): the phase's outputs
        # are the op's, with no [N] buffers allocated and copied into.
        whole = rows is None and 0 < n <= chunk_size
        lse: torch.Tensor | None = None  # [n, 2] per-row log-sum-exp statistics
        ent_c: torch.Tensor | None = None  # [n] the rows' entropy, for backward
        if not whole:
            # Every row in order: each is written by its chunk (no fill); else rows outside
            # the participating ones read exactly 0.
            make = torch.empty if rows is None else torch.zeros
            lp = make(hidden.shape[0], dtype=cdtype, device=dev)
            ent = make(hidden.shape[0] if need_entropy else 0, dtype=cdtype, device=dev)
            lse = torch.empty(n, 2, dtype=cdtype, device=dev)
            ent_c = torch.empty(n, dtype=cdtype, device=dev) if need_entropy else None
        kept: torch.Tensor | None = None
        for start in range(0, n, chunk_size):
            stop = min(n, start + chunk_size)
            if logits is not None and start == 0 and stop == n:  # issued by start_logits
                z = logits
            else:
                z = _logits_chunk(_chunk_rows(hidden, rows, start, stop), weight)
            lp_k, lse_k, ent_k = impl.forward(
                z,
                _chunk_rows(labels, rows, start, stop),
                rows=None,
                inv_temperature=_chunk_inv_t(inv_t, rows, start, stop),
                need_entropy=need_entropy,
                chunk_size=inner,
                **({} if mask is None else {"mask": mask[start:stop]}),
            )
            if keep:
                kept = z
            del z
            if whole:
                lp, lse = lp_k.to(cdtype), lse_k.to(cdtype)
                ent_c = ent_k.to(cdtype) if need_entropy and ent_k is not None else None
                # Also saved as the rows' entropy (saving an output is allowed; an in-place
                # change to it before backward is then reported by autograd).
                ent = torch.zeros(0, dtype=cdtype, device=dev) if ent_c is None else ent_c
                continue
            assert lse is not None
            _write_rows(lp, rows, start, stop, lp_k.to(cdtype))
            lse[start:stop] = lse_k
            if ent_c is not None:
                assert ent_k is not None
                ent_c[start:stop] = ent_k
                _write_rows(ent, rows, start, stop, ent_k.to(cdtype))
        assert lse is not None  # allocated, or the one chunk's
        if not need_entropy:
            ctx.mark_non_differentiable(ent)
        inv_t_t = inv_t if isinstance(inv_t, torch.Tensor) else None
        ctx.save_for_backward(hidden, weight, labels, rows, lse, ent_c, inv_t_t, mask)
        ctx.inv_t_float = None if inv_t_t is not None else inv_t
        ctx.need_entropy = need_entropy
        ctx.chunk_size = chunk_size
        ctx.impl = impl
        # Gradients of unused outputs stay None (the entropy of a metric): no zero-filled [N]
        # for phase 2 to multiply.
        ctx.set_materialize_grads(False)
        # Not a saved tensor: backward overwrites it with its gradient and drops it (a saved
        # tensor would be checked against in-place changes and kept until the graph is freed).
        ctx.kept_logits = kept
        return lp, ent

    @staticmethod
    def backward(
        ctx: Any, grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden, weight, labels, rows, lse, ent_c, inv_t_t, mask = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 9
        kept, ctx.kept_logits = ctx.kept_logits, None  # consumed here (overwritten in place)
        use_ent = ctx.need_entropy and grad_ent is not None and grad_ent.numel() > 0
        if not (need_h or need_w) or (grad_lp is None and not use_ent):
            return (None, None, *nones)
        n_all = hidden.shape[0]
        if grad_lp is None:
            grad_lp = torch.zeros(n_all, dtype=lse.dtype, device=lse.device)
        a = grad_lp if rows is None else grad_lp.index_select(0, rows)
        b = None
        if use_ent:
            assert grad_ent is not None
            b = grad_ent if rows is None else grad_ent.index_select(0, rows)
        ent = None if b is None else ent_c
        live: torch.Tensor | None = None
        if mask is None:
            # Rows whose coefficients are all zero have exactly zero gradient. Recomputed
            # chunks skip them (no GEMM); kept logits are aligned with every participating
            # row, and phase 2 writes the dead ones with exact zeros.
            live = a != 0 if b is None else (a != 0) | (b != 0)
            if kept is None:
                keep = live.nonzero().squeeze(1)
                rows = keep if rows is None else rows[keep]
                a, lse, live = a[keep], lse[keep], live[keep]
                b = None if b is None else b[keep]
                ent = None if ent is None else ent[keep]
        # else the device path: every row keeps its slot (rows is None); the rows outside the
        # mask or with zero coefficients are decided by phase 2 on the device (exact zeros,
        # hence no contribution to either gradient).
        inv_t = ctx.inv_t_float if inv_t_t is None else inv_t_t

        grad_h: torch.Tensor | None = None
        grad_w: torch.Tensor | None = None
        v = weight.shape[0]
        inner = reference.default_chunk_size(v)
        n = _num_rows(rows, hidden)
        acc_dtype = _grad_weight_dtype(weight, n, ctx.chunk_size)
        for start in range(0, n, ctx.chunk_size):
            stop = min(n, start + ctx.chunk_size)
            h = _chunk_rows(hidden, rows, start, stop)
            z = kept if kept is not None else _logits_chunk(h, weight)
            kept = None
            # Every row of z is written by phase 2 (dead rows with zeros): in place is safe.
            dz = ctx.impl.backward(
                z,
                _chunk_rows(labels, rows, start, stop),
                rows=None,
                live=(mask if live is None else live)[start:stop],
                skip_zero_rows=live is None,
                inv_temperature=_chunk_inv_t(inv_t, rows, start, stop),
                lse=lse[start:stop],
                grad_logprobs=a[start:stop],
                grad_entropy=None if b is None else b[start:stop],
                entropy=None if ent is None else ent[start:stop],
                chunk_size=inner,
                out=z,
            )
            if need_h:
                grad_h = _add_grad_hidden(grad_h, dz, weight, rows, start, stop, hidden)
            if need_w:
                grad_w = _add_grad_weight(grad_w, dz, h, acc_dtype)
            del z, dz, h
        if need_h and grad_h is None:
            grad_h = torch.zeros_like(hidden)
        grad_w = _zeros_if_unwritten(grad_w, need_w, weight)
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        return (grad_h, grad_w, *nones)


def _num_rows(rows: torch.Tensor | None, hidden: torch.Tensor) -> int:
    """How many rows take part: every row of ``hidden`` when ``rows`` is None."""
    return hidden.shape[0] if rows is None else int(rows.numel())


def _chunk_rows(t: torch.Tensor, rows: torch.Tensor | None, start: int, stop: int) -> torch.Tensor:
    """Participating rows ``start:stop`` of a per-row tensor ``t [N, ...]``: a slice (a view,
    no launch) when ``rows`` is None (every row in order), else gathered."""
    if rows is None:
        return t[start:stop]
    return t.index_select(0, rows[start:stop])


def _chunk_inv_t(
    inv_t: float | torch.Tensor, rows: torch.Tensor | None, start: int, stop: int
) -> float | torch.Tensor:
    """The chunk's ``1/T``: the float, or its rows of the ``[N]`` per-row values."""
    return inv_t if isinstance(inv_t, float) else _chunk_rows(inv_t, rows, start, stop)


def _write_rows(
    out: torch.Tensor, rows: torch.Tensor | None, start: int, stop: int, values: torch.Tensor
) -> None:
    """``out[rows[start:stop]] = values`` (a slice copy when ``rows`` is None)."""
    if rows is None:
        out[start:stop] = values
    else:
        out.index_copy_(0, rows[start:stop], values)


def _add_grad_hidden(
    grad_h: torch.Tensor | None,
    dz: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor | None,
    start: int,
    stop: int,
    hidden: torch.Tensor,
) -> torch.Tensor:
    """``d hidden`` with the chunk's rows ``dz @ weight`` written: the product itself when the
    chunk is every row; every row in order (``rows`` None): written into its slice of an
    ``[N, H]`` that every chunk fills (no zero fill, no copy); else copied into a zero-filled
    ``[N, H]`` (rows that do not take part get exact zeros)."""
    if rows is None:
        if grad_h is None and stop - start == hidden.shape[0]:
            return torch.mm(dz, weight)
        if grad_h is None:
            grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        torch.mm(dz, weight, out=grad_h[start:stop])
        return grad_h
    if grad_h is None:
        grad_h = torch.zeros_like(hidden)
    grad_h.index_copy_(0, rows[start:stop], torch.mm(dz, weight))
    return grad_h


#: ``coefficients(rows [c] int64, logprobs [c], entropy [c] or None) -> (a [c], b [c] or None)``:
#: the derivatives of the loss with respect to the logprobs and the entropy of rows ``rows``,
#: computed from those rows alone (a chunk-additive loss).
RowCoefficients = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]


class _Prepared(NamedTuple):
    """A call's rows as the chunks read them (`_prepare`): flat int64 labels, the rows to
    compute (None: every row in order, each chunk a slice), ``1/T`` (a float or ``[N]`` in the
    compute dtype) and on the device path the ``[N]`` bool mask."""

    labels: torch.Tensor
    rows: torch.Tensor | None
    inv_t: float | torch.Tensor
    mask: torch.Tensor | None


def _chunk_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    prepared: _Prepared,
    need_entropy: bool,
    chunk_size: int,
    impl: ModuleType,
    coefficients: RowCoefficients,
    need: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One pass over the chunks: logits, phase 1, the rows' coefficients, phase 2 in place
    over the logits, ``d hidden`` rows and the ``d weight`` accumulation (as
    ``_LinearLogprobsFn.backward``, with coefficients known at once). ``prepared.rows``
    None: every row in order, each chunk a slice."""
    labels, rows, inv_t, mask = prepared
    v = weight.shape[0]
    cdtype = reference.compute_dtype(hidden.dtype)
    dev = hidden.device
    n = _num_rows(rows, hidden)
    # Every row in order: each is written by its chunk (no fill).
    make = torch.empty if rows is None else torch.zeros
    lp = make(hidden.shape[0], dtype=cdtype, device=dev)
    ent = make(hidden.shape[0] if need_entropy else 0, dtype=cdtype, device=dev)
    grad_h: torch.Tensor | None = None
    grad_w: torch.Tensor | None = None
    acc_dtype = _grad_weight_dtype(weight, n, chunk_size)
    inner = reference.default_chunk_size(v)
    for start in range(0, n, chunk_size):
        stop = min(n, start + chunk_size)
        h = _chunk_rows(hidden, rows, start, stop)
        z = _logits_chunk(h, weight)
        it = _chunk_inv_t(inv_t, rows, start, stop)
        lab = _chunk_rows(labels, rows, start, stop)
        chunk_mask = None if mask is None else mask[start:stop]
        lp_k, lse_k, ent_k = impl.forward(
            z,
            lab,
            rows=None,
            inv_temperature=it,
            need_entropy=need_entropy,
            chunk_size=inner,
            **({} if chunk_mask is None else {"mask": chunk_mask}),
        )
        lp_k, ent_k = lp_k.to(cdtype), None if ent_k is None else ent_k.to(cdtype)
        _write_rows(lp, rows, start, stop, lp_k)
        if ent_k is not None:
            _write_rows(ent, rows, start, stop, ent_k)
        idx = torch.arange(start, stop, device=dev) if rows is None else rows[start:stop]
        a, b = coefficients(idx, lp_k, ent_k)
        c = stop - start
        # Phase 2 over the chunk's logits, in place: rows outside the mask or with zero
        # coefficients get exact zeros (decided on the device), like the recompute path.
        live = torch.ones(c, dtype=torch.bool, device=dev) if chunk_mask is None else chunk_mask
        dz = impl.backward(
            z,
            lab,
            rows=None,
            live=live,
            skip_zero_rows=True,
            inv_temperature=it,
            lse=lse_k,
            grad_logprobs=a,
            grad_entropy=b,
            entropy=ent_k if b is not None else None,
            chunk_size=inner,
            out=z,
        )
        if need[0]:
            grad_h = _add_grad_hidden(grad_h, dz, weight, rows, start, stop, hidden)
        if need[1]:
            grad_w = _add_grad_weight(grad_w, dz, h, acc_dtype)
        del z, dz, h
    if need[0] and grad_h is None:  # no participating row
        grad_h = torch.zeros_like(hidden)
    return lp, ent, grad_h, _zeros_if_unwritten(grad_w, need[1], weight)


def linear_logprobs_with_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    mask: torch.Tensor,
    need_entropy: bool,
    chunk_size: int | None,
    backend: str,
    coefficients: RowCoefficients,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(logprobs [N], entropy [N] or [0], d hidden, d weight)`` in one pass over the chunks.

    For a loss whose derivative with respect to a row's logprob (and entropy) depends on that
    row alone: ``coefficients`` gives them per chunk, right after phase 1, and phase 2 runs on
    the chunk's logits while they are still in memory, so the backward pass recomputes nothing.
    The logprobs and entropy are returned detached; `attach_gradients` connects the loss to
    ``hidden`` and ``weight`` with the gradients formed here. ``d weight`` is returned as its
    accumulator, in fp32 for a bf16/fp16 weight over several chunks, and held until backward
    (one ``[V, H]`` fp32 buffer more between forward and backward than the recompute path, no
    larger than the forward's own peak of accumulator plus chunk logits): `attach_gradients`
    scales it and rounds it to the weight's dtype in one pass, so that the ``[V, H]`` gradient
    is read once after the chunks, not cast in forward and scaled again in backward. In one
    chunk it is formed in the weight's dtype (one GEMM, rounded once, as ``d hidden`` is):
    for ``loss.backward()`` exactly logits-then-loss's ``dW``; an incoming gradient other than
    1 then rounds it a second time, as it does ``d hidden`` (at most one more unit in the last
    place of the weight's dtype).
    """
    prepared = _prepare(hidden, weight, labels, temperature, mask)
    cs = chunk_size
    if cs is None:
        cs = auto_linear_chunk_size(
            weight, rows=_num_rows(prepared.rows, hidden), grad_weight=weight.requires_grad
        )
    return _gradients_in_forward(hidden, weight, prepared, need_entropy, cs, backend, coefficients)


def _gradients_in_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    prepared: _Prepared,
    need_entropy: bool,
    chunk_size: int,
    backend: str,
    coefficients: RowCoefficients,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`_chunk_gradients` without autograd recording, on `_prepare`'s outputs."""
    with torch.no_grad():
        return _chunk_gradients(
            hidden, weight, prepared, need_entropy, chunk_size,
            resolve_backend(backend, hidden.device),
            _no_grad_coefficients(coefficients), (hidden.requires_grad, weight.requires_grad),
        )  # fmt: skip


def _gradient_recorded(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether autograd records this call for a gradient of ``hidden`` or ``weight``."""
    return torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)


class EarlyLogits(NamedTuple):
    """The one chunk's logits ``[N, V]``, issued before the loss's setup (`start_logits`), and
    the chunk size they were issued for."""

    logits: torch.Tensor
    chunk_size: int


def start_logits(
    hidden: torch.Tensor, weight: torch.Tensor, *, chunk_size: int | None
) -> EarlyLogits | None:
    """Issue the LM-head GEMM now when it will be the op's only one: on the device path (every
    row goes through the LM head, so the chunk is known from the shapes) with a gradient
    recorded and every row within ``chunk_size`` (default `auto_linear_chunk_size`). A loss
    entry point calls it before its checks and setup, so that the GPU computes the logits while
    the host prepares the rest (an idle GPU otherwise waits for that host work before the
    call's first kernel). None otherwise; ``hidden``/``weight`` already checked.

    Examples:
        >>> start_logits(torch.zeros(2, 3), torch.zeros(4, 3), chunk_size=None) is None  # off CUDA
        True
    """
    if not on_device_path(hidden.device):
        return None
    if not _gradient_recorded(hidden, weight):
        return None
    n = hidden.shape[0]
    cs = chunk_size if chunk_size is not None else auto_linear_chunk_size(weight, rows=n)
    if not 0 < n <= cs:
        return None
    with torch.no_grad():  # the op's own backward differentiates them
        return EarlyLogits(_logits_chunk(hidden, weight), cs)


def linear_logprobs_for_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    mask: torch.Tensor,
    need_entropy: bool,
    chunk_size: int | None,
    backend: str,
    coefficients: Callable[[], RowCoefficients] | None,
    *,
    early: EarlyLogits | None = None,
    labels_checked_by_caller: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None] | None]:
    """``(logprobs [N], entropy [N] or [0], [d hidden, d weight] or None)`` for a loss entry
    point, by the cheapest of the op's three paths (``early``: the one chunk's logits from
    `start_logits`, used instead of computing them):

    - **one chunk** (every participating row within ``chunk_size``, the default on CUDA up to
      ``4·H`` rows in bf16): the logits GEMM and phase 1 in forward, the chunk's logits kept
      for backward (no second LM-head GEMM), where phase 2 overwrites them with their
      gradient: the work of logits-then-loss and its ``dW``/``d hidden`` bit for bit, with one
      ``[n, V]`` buffer instead of two, for any loss;
    - **several chunks, chunk-additive loss** (``coefficients`` given: a factory of the rows'
      coefficients, see `linear_logprobs_with_gradients`) with a gradient recorded: the
      gradients formed in forward, one LM-head GEMM per chunk (returned as the third item,
      for `attach_gradients`);
    - otherwise: backward recomputes each chunk's logits.

    ``hidden``/``weight`` already checked (`check_linear_inputs`); ``labels`` and
    ``temperature`` are checked here, unless ``labels_checked_by_caller`` (on the device path
    the caller checks the labels' range, passing ``label_check`` to `loss_from_logprobs`, and
    gives temperatures built from its validated record: as
    `selective_logprobs_checked_by_caller` for logits); rows outside ``mask`` read 0 and get
    no gradient.
    """
    prepared = _prepare(
        hidden, weight, labels, temperature, mask, checked_by_caller=labels_checked_by_caller
    )
    n = _num_rows(prepared.rows, hidden)
    if early is not None:
        if tuple(early.logits.shape) != (n, weight.shape[0]):
            raise ValueError(
                problem(
                    "early",
                    f"the logits of every row, [{n}, {weight.shape[0]}]",
                    describe(early.logits),
                    "pass start_logits(hidden, weight, chunk_size=...) of the same call",
                )
            )
        chunk_size = early.chunk_size
    cs = chunk_size if chunk_size is not None else auto_linear_chunk_size(weight, rows=n)
    recorded = _gradient_recorded(hidden, weight)
    if coefficients is not None and recorded and n > cs:
        lp, ent, grad_h, grad_w = _gradients_in_forward(
            hidden, weight, prepared, need_entropy, cs, backend, coefficients()
        )
        return lp, ent, [grad_h, grad_w]
    logits = None if early is None else early.logits
    lp, ent = _apply(hidden, weight, prepared, need_entropy, cs, backend, logits)
    return lp, ent, None


def _no_grad_coefficients(fn: RowCoefficients) -> RowCoefficients:
    def run(
        idx: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.enable_grad():  # the caller differentiates its per-row loss
            a, b = fn(idx, lp, ent)
        return a.detach(), None if b is None else b.detach()

    return run


def _scaled(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(grad · scale)`` rounded once to ``dtype``: one pass, computed in fp32 (fp64 for fp64).

    ``scale`` is passed as a ``[1]`` tensor so that it is not rounded to a bf16 ``grad``'s
    dtype first (a 0-dim tensor would be), and the output is written in ``dtype`` directly
    (no ``[V, H]`` temporary in the compute dtype)."""
    if _fused_scale_applies(grad, dtype):
        from echoloss.ops.fused_linear import fused

        return fused.scaled(grad, scale, dtype)
    s = scale.to(torch.promote_types(grad.dtype, torch.float32)).reshape(1)
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    return torch.mul(grad, s, out=out)


_FLOATS_32 = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _fused_scale_applies(grad: torch.Tensor, dtype: torch.dtype) -> bool:
    """The Triton product (`fused.scaled`, the same bits) for a contiguous CUDA gradient of
    at most 32 bits: PyTorch's mixed-dtype product takes several times the bandwidth time."""
    return (
        grad.device.type == "cuda"
        and grad.dtype in _FLOATS_32
        and dtype in _FLOATS_32
        and grad.is_contiguous()
        and _triton_installed()
    )


class _AttachGradientsFn(torch.autograd.Function):
    """``loss`` unchanged; backward: the gradients formed in forward, times the incoming one,
    in the dtypes of ``hidden`` and ``weight``."""

    @staticmethod
    def forward(
        ctx: Any,
        loss: torch.Tensor,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        grad_h: torch.Tensor | None,
        grad_w: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.grads = (grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if ctx.grads is None:
            raise RuntimeError(
                "backward through a fused-linear loss (echo_loss_from_hidden, "
                "EchoFusedLinearGRPOLoss) a second time: its "
                "gradients were formed in the forward pass and are freed after one backward "
                "(as a graph's buffers are); compute the loss again for another backward"
            )
        grad_h, grad_w = ctx.grads
        ctx.grads = None  # freed after one backward, as saved tensors are
        dtype_h, dtype_w = ctx.dtypes
        out_h = None if grad_h is None else _scaled(grad_h, grad, dtype_h)
        out_w = None if grad_w is None else _scaled(grad_w, grad, dtype_w)
        return None, out_h, out_w, None, None


def attach_gradients(
    loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> torch.Tensor:
    """``loss`` (0-dim, its value unchanged) whose backward gives ``hidden`` and ``weight`` the
    gradients `linear_logprobs_with_gradients` formed, times the incoming gradient (exactly
    them for ``loss.backward()``), each rounded once to its tensor's dtype (the gradients may
    be given in a wider dtype: the fp32 accumulator of a bf16 weight's gradient). A second
    backward through it is an error, as for any graph whose buffers are freed.

    Examples:
        >>> h, w = torch.ones(2, 3, requires_grad=True), torch.ones(4, 3, requires_grad=True)
        >>> loss = attach_gradients(torch.tensor(1.5), h, w, torch.full((2, 3), 2.0), None)
        >>> (3 * loss).backward(); h.grad[0].tolist(), w.grad
        ([6.0, 6.0, 6.0], None)
    """
    out: torch.Tensor = _AttachGradientsFn.apply(  # type: ignore[no-untyped-call]
        loss, hidden, weight, grad_hidden, grad_weight
    )
    return out


def check_linear_inputs(hidden: Any, weight: Any) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = check_tensor("hidden", hidden)
    weight = check_tensor("weight", weight)
    if not hidden.dtype.is_floating_point or hidden.dim() != 2:
        raise TypeError(
            problem(
                "hidden",
                "a float tensor [N, H] (the final hidden states, one row per token)",
                describe(hidden),
                "flatten [B, T, H] with hidden.reshape(-1, H) and pass every per-token tensor "
                "as [N]",
            )
        )
    if not weight.dtype.is_floating_point or weight.dim() != 2:
        raise TypeError(
            problem(
                "weight",
                "a float tensor [V, H] (the LM-head weight, as in nn.Linear(H, V).weight)",
                describe(weight),
            )
        )
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            problem(
                "weight",
                f"[V, H={hidden.shape[1]}] to match hidden [N, H]",
                describe(weight),
                "pass lm_head.weight (not its transpose)",
            )
        )
    if weight.shape[0] < 1:
        raise ValueError(
            problem("weight", "non-empty over the vocabulary dimension V", describe(weight))
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(
            problem(
                "weight",
                f"of hidden's dtype {hidden.dtype}",
                describe(weight),
                "cast one of them (e.g. hidden.to(weight.dtype)), as the LM head's matmul would "
                "need",
            )
        )
    if weight.device != hidden.device:
        raise ValueError(
            problem(
                "weight",
                f"on hidden's device {hidden.device}",
                describe(weight),
                "move both to one device",
            )
        )
    return hidden, weight


def _check_labels(labels: torch.Tensor, rows: torch.Tensor | None, v: int) -> None:
    lab_used = labels if rows is None else labels.index_select(0, rows)
    bad = (lab_used < 0) | (lab_used >= v)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            problem(
                f"labels[{i if rows is None else int(rows[i])}]",
                f"in [0, V={v}) on a participating row",
                str(int(lab_used[i])),
                LABEL_FIX,  # the same message whichever op, or the loss, checks
            )
        )


def _prepare(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: Any,
    temperature: Any,
    mask: torch.Tensor | None,
    *,
    checked_by_caller: bool = False,
) -> _Prepared:
    """The call's `_Prepared` rows: flat int64 labels, the rows to compute (None: every row in
    order), ``1/T`` (float or ``[N]`` compute dtype), and on the device path the ``[N]`` bool
    mask (the rows are then every row).

    ``checked_by_caller``: the caller checks the participating labels' range and the
    temperatures' values itself (a loss entry point: its fused row algebra checks the labels
    in its own launch, `loss_from_logprobs`'s ``label_check``, and it builds the temperatures
    from its validated record), so on the device path nothing is queued here; the host path
    checks the labels as always."""
    lead = hidden.shape[:1]
    v = weight.shape[0]
    labels = check_per_token(
        "labels",
        labels,
        lead,
        hidden.device,
        "int",
        fix="labels[j] is the token hidden[j] predicts",
    ).long()
    flat_mask: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    if on_device_path(hidden.device):
        # Every row goes through the LM head (their count is not read on the host); rows
        # outside the mask are skipped by phase 1 and get exact zeros from phase 2.
        if checked_by_caller:
            flat_mask = (
                torch.ones_like(labels, dtype=torch.bool) if mask is None else mask.reshape(-1)
            )
        else:
            flat_mask, labels = labels_checked_on_device(labels, mask, v)
    else:
        if mask is not None:
            rows = mask.reshape(-1).nonzero().squeeze(1)
            if int(rows.numel()) == lead[0]:
                rows = None  # every row, in order: chunks are slices
        _check_labels(labels, rows, v)
    temp = check_temperature(temperature, lead, hidden.device, check_values=not checked_by_caller)
    inv_t: float | torch.Tensor
    if isinstance(temp, torch.Tensor):
        inv_t = temp.reshape(-1).to(reference.compute_dtype(hidden.dtype)).reciprocal()
    else:
        inv_t = 1.0 / temp
    return _Prepared(labels, rows, inv_t, flat_mask)


def _apply(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    prepared: _Prepared,
    need_entropy: bool,
    chunk_size: int | None,
    backend: str,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recorded op (`_LinearLogprobsFn`) on `_prepare`'s rows; ``logits``: the one
    chunk's, issued early (`start_logits`)."""
    labels, rows, inv_t, mask = prepared
    impl = resolve_backend(backend, hidden.device)
    cs = chunk_size
    if cs is None:
        cs = auto_linear_chunk_size(weight, rows=_num_rows(rows, hidden))
    recorded = _gradient_recorded(hidden, weight)
    out: tuple[torch.Tensor, torch.Tensor] = _LinearLogprobsFn.apply(  # type: ignore[no-untyped-call]
        hidden, weight, labels, rows, inv_t, need_entropy, cs, impl, mask, recorded, logits
    )
    return out


def linear_logprobs_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    mask: torch.Tensor,
    need_entropy: bool,
    chunk_size: int | None,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs [N], entropy [N] or [0])`` of the rows of ``mask`` (for the loss entry point).

    ``hidden``/``weight`` already checked (`check_linear_inputs`); ``labels`` and
    ``temperature`` are checked here. Rows outside ``mask`` read 0 and get no gradient.
    """
    prepared = _prepare(hidden, weight, labels, temperature, mask)
    return _apply(hidden, weight, prepared, need_entropy, chunk_size, backend)


@compiler_disable
def linear_selective_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
    mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each label (and entropy) under ``softmax(hidden @ weight.T / T)``, chunked.

    Equivalent to ``selective_logprobs(hidden @ weight.T, labels, ...)`` (see
    `echoloss.ops.fused_linear.naive.naive_linear_selective_logprobs`), but the
    ``[N, V]`` logits never exist: only ``chunk_size`` participating rows at a time, in the
    input dtype, with their gradient written in place over them in backward. Differentiable
    w.r.t. ``hidden`` and ``weight``.

    Args:
        hidden: ``[N, H]`` final hidden states (bf16, fp16, fp32 or fp64), any strides.
        weight: ``[V, H]`` LM-head weight, same dtype and device as ``hidden``.
        labels: ``[N]`` integer, in ``[0, V)`` on every row that participates.
        temperature: ``T > 0``: a float, a 0-dim tensor or ``[N]`` per-token values.
        return_entropy: also return the entropy of ``softmax(logits / T)`` per row.
        mask: optional ``[N]`` bool, True = compute this row. Other rows read exactly 0 and
            get exactly zero gradient; off CUDA they cost no matmul, on CUDA they go through the
            chunked matmul (their count is not read on the host) but not through the kernels.
        chunk_size: participating rows per chunk; None = automatic (`auto_linear_chunk_size`):
            about ``2^26`` logits elements per chunk
            ([`default_linear_chunk_size`][echoloss.ops.fused_linear.default_linear_chunk_size]);
            on CUDA logits as large as the weight-gradient accumulator (``2·H`` rows for bf16)
            when the weight's gradient is needed, within a quarter of the free memory; the
            rows split into chunks of equal size.
        backend: the selective-logprob phases on each chunk: ``"auto"`` (Triton on CUDA, the
            PyTorch reference elsewhere), ``"reference"`` or ``"triton"``.

    Returns:
        ``logprobs [N]`` in fp32 (fp64 for fp64 inputs); with ``return_entropy``
        ``(logprobs, entropy)``.

    Raises:
        TypeError, ValueError: on a wrong dtype, shape, device, label or temperature, with the fix.

    Examples:
        >>> import torch
        >>> hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
        >>> weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], requires_grad=True)
        >>> lp = linear_selective_logprobs(hidden, weight, torch.tensor([0, 1]), backend="reference")
        >>> torch.allclose(lp, torch.log_softmax(hidden @ weight.T, -1)[[0, 1], [0, 1]])
        True
        >>> lp.sum().backward()
        >>> hidden.grad.shape, weight.grad.shape
        (torch.Size([2, 2]), torch.Size([3, 2]))
    """
    hidden, weight = check_linear_inputs(hidden, weight)
    if mask is not None:
        mask = check_per_token("mask", mask, hidden.shape[:1], hidden.device, "bool")
    check_bool("return_entropy", return_entropy)
    chunk_size = check_chunk_size(chunk_size)
    prepared = _prepare(hidden, weight, labels, temperature, mask)
    lp, ent = _apply(hidden, weight, prepared, return_entropy, chunk_size, backend)
    if return_entropy:
        return lp, ent
    return lp
