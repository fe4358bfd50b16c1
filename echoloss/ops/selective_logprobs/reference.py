"""Pure-PyTorch reference of the selective-logprob op, in the two phases a fused kernel has.

Phase 1 ([`forward`][echoloss.ops.selective_logprobs.reference.forward]) reads the logits once per row and returns the label's logprob, the row's
log-sum-exp and, optionally, its entropy, all at the temperature ``T`` of the row. Phase 2
([`backward`][echoloss.ops.selective_logprobs.reference.backward]) reads the logits again and writes ``dlogits`` from one coefficient per row (the
derivative of the whole loss w.r.t. that row's logprob, and optionally w.r.t. its entropy). All the
loss algebra in between happens elsewhere, on ``[N]``-sized tensors. The math is in ``README.md``.

Rows are processed ``chunk_size`` at a time, so the extra memory is a few ``[chunk_size, V]``
buffers in the compute dtype (fp32, or fp64 for fp64 logits), never a full-size fp32 copy.
This module never imports triton.
"""

from __future__ import annotations

import torch

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "backward",
    "compute_dtype",
    "default_chunk_size",
    "forward",
]

# Elements per chunk of rows (2^22 fp32 = 16 MiB per buffer; at most three buffers are live).
# Chosen on the CPU benchmark (python -m benchmarks --device cpu --ops loss): smaller chunks stay in
# cache and are as fast as one big log_softmax; larger ones only cost memory.
DEFAULT_CHUNK_ELEMENTS = 1 << 22


#: Floor for log p in the entropy terms. exp(-1e4) is exactly 0 in fp32 and fp64, so the floor
#: changes no value of p·log p, but it keeps b·(log p + H) finite where a logit is -inf (the
#: dtype's own minimum would overflow to -inf once multiplied by an entropy coefficient |b| > 1,
#: and 0·inf is NaN).
LOG_P_FLOOR = -1e4


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for logits of ``dtype``: fp32, or fp64 for fp64 logits.

    Examples:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.promote_types(dtype, torch.float32)


def default_chunk_size(num_classes: int) -> int:
    """Rows per chunk so that one fp32 ``[rows, V]`` buffer holds about 2^22 elements.

    Examples:
        >>> default_chunk_size(65_536), default_chunk_size(262_144), default_chunk_size(10**8)
        (64, 16, 1)
    """
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, num_classes))


class _Workspace:
    """Chunk-sized buffers reused across chunks (no allocation churn, no page faults per chunk).

    ``x``: the scaled compute-dtype rows; ``a``, ``b``: two more compute-dtype buffers;
    ``native``: gathered rows in the logits dtype. Each is created on first use.
    """

    def __init__(self, rows: int, v: int, cdtype: torch.dtype, logits: torch.Tensor) -> None:
        self._shape = (rows, v)
        self._cdtype = cdtype
        self._logits = logits
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, c: int) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None:
            dtype = self._logits.dtype if name == "native" else self._cdtype
            buf = torch.empty(self._shape, dtype=dtype, device=self._logits.device)
            self._bufs[name] = buf
        return buf[:c]


def _load_shifted(
    logits: torch.Tensor,
    rows: torch.Tensor | None,
    start: int,
    stop: int,
    inv_t: float | torch.Tensor,
    ws: _Workspace,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``start:stop`` of the row list as ``d = (z - m) / T`` in the compute dtype, ``[c, V]``.

    ``m`` is each row's maximum logit (computed here, or ``shift`` when given), subtracted
    *before* the division by ``T``: ``z - m`` is exact or rounded relative to the difference
    itself, so ``d`` keeps full relative precision whatever ``|z / T|`` (``z / T - m / T`` would
    carry the rounding of ``|z / T|``: 0.06 at 1e6 in fp32). Returns ``(d, m [c])``; ``d`` is the
    workspace buffer ``x``. A row whose maximum is ``-inf`` is shifted by 0 (stays ``-inf``).
    """
    c = stop - start
    cdtype = ws._cdtype
    x = ws.get("x", c)
    if rows is None and logits.dim() == 2:
        x.copy_(logits[start:stop])
    elif logits.dim() == 2:
        assert rows is not None  # the branch above takes rows is None
        idx = rows[start:stop]
        if logits.dtype == cdtype:
            torch.index_select(logits, 0, idx, out=x)
        else:
            x.copy_(torch.index_select(logits, 0, idx, out=ws.get("native", c)))
    else:  # [B, T, V] that cannot be viewed as [N, V]: gather (a chunk-sized copy)
        idx = torch.arange(start, stop, device=logits.device) if rows is None else rows[start:stop]
        t = logits.shape[1]
        x.copy_(logits[idx // t, idx % t])
    m = x.amax(dim=1) if shift is None else shift.to(cdtype)  # [c]
    m = m.masked_fill(m == float("-inf"), 0.0)  # [c] an all -inf row keeps d = -inf, not NaN
    x.sub_(m[:, None])
    if isinstance(inv_t, float):
        if inv_t != 1.0:
            x.mul_(inv_t)
    else:
        x.mul_(inv_t[:, None])
    return x, m


def _chunk_inv_t(
    inv_temperature: float | torch.Tensor, rows: torch.Tensor | None, start: int, stop: int
) -> float | torch.Tensor:
    if isinstance(inv_temperature, float):
        return inv_temperature
    if rows is None:
        return inv_temperature[start:stop]
    return inv_temperature.index_select(0, rows[start:stop])


def _num_rows(logits: torch.Tensor, rows: torch.Tensor | None) -> int:
    if rows is not None:
        return int(rows.numel())
    return int(logits.numel() // logits.shape[-1]) if logits.shape[-1] else 0


def _labels_in_range(labels: torch.Tensor, v: int) -> torch.Tensor:
    """Labels outside ``[0, V)`` read as 0 (device path: the range check is deferred, the
    phases must not read out of bounds meanwhile; the kernels do the same per row)."""
    return torch.where((labels >= 0) & (labels < v), labels, 0)


def forward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    rows: torch.Tensor | None,
    inv_temperature: float | torch.Tensor,
    need_entropy: bool,
    chunk_size: int,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Phase 1: logprob of the label, log-sum-exp and entropy of ``softmax(logits / T)``.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, any float dtype, any strides. Never modified.
        labels: ``[N]`` int64, flat over ``B·T``.
        rows: ``[n]`` int64 flat indices of the rows to compute, or None for all ``N`` rows.
        inv_temperature: ``1/T`` as a Python float, or a ``[N]`` tensor in the compute dtype.
        need_entropy: also return the entropy.
        chunk_size: rows per chunk (≥ 1).
        mask: with ``rows`` None, ``[N]`` bool: rows outside it read exactly 0 in every output
            (they are computed and discarded here, without reading the row count on the host).
            Labels outside ``[0, V)`` then read as 0 (the caller reports them; as the kernels).

    Returns:
        ``(logprobs [n], lse [n, 2], entropy [n] or None)`` in the compute dtype, one entry per
        computed row (``n = N`` when ``rows`` is None). ``lse`` holds each row's log-sum-exp as
        the pair ``(m, log Σ_j exp((z_j - m) / T))`` with ``m`` the row's maximum logit, i.e.
        ``log Σ exp(z / T) = m / T + lse[:, 1]``: kept apart so that phase 2 can form
        ``log p = (z - m) / T - lse[:, 1]`` without the rounding of ``|z / T|``.
    """
    n = _num_rows(logits, rows)
    cdtype = compute_dtype(logits.dtype)
    dev = logits.device
    if mask is not None and rows is None:
        labels = _labels_in_range(labels, logits.shape[-1])
    out_lp = torch.empty(n, dtype=cdtype, device=dev)
    out_lse = torch.empty(n, 2, dtype=cdtype, device=dev)
    out_ent = torch.empty(n, dtype=cdtype, device=dev) if need_entropy else None
    ws = _Workspace(min(chunk_size, max(n, 1)), logits.shape[-1], cdtype, logits)
    for start in range(0, n, chunk_size):
        stop = min(n, start + chunk_size)
        c = stop - start
        lab = (labels[start:stop] if rows is None else labels.index_select(0, rows[start:stop]))[
            :, None
        ]  # [c, 1]
        inv_t = _chunk_inv_t(inv_temperature, rows, start, stop)
        d, m = _load_shifted(logits, rows, start, stop, inv_t, ws)  # [c, V], [c]
        e = torch.exp(d, out=ws.get("a", c))  # [c, V] exp((z - m) / T), 0 at z = -inf
        log_acc = e.sum(dim=1).log_()  # [c] log Σ exp(d) ∈ [0, log V]
        out_lp[start:stop] = d.gather(1, lab).squeeze(1) - log_acc
        out_lse[start:stop, 0] = m
        out_lse[start:stop, 1] = log_acc
        if out_ent is not None:
            # H = log Σ - Σ p·d: two O(log V) terms. d is floored so that p = 0 (z = -inf) gives
            # 0·floor = 0, not 0·(-inf) = NaN (exp(floor) is exactly 0: no value changes).
            pd = e.mul_(d.clamp_(min=LOG_P_FLOOR)).sum(dim=1)  # [c] Σ e·d
            out_ent[start:stop] = log_acc - pd / log_acc.exp()
    if mask is not None and rows is None:
        keep = mask.reshape(-1)
        out_lp = torch.where(keep, out_lp, 0.0)
        out_lse = torch.where(keep[:, None], out_lse, 0.0)
        out_ent = None if out_ent is None else torch.where(keep, out_ent, 0.0)
    return out_lp, out_lse, out_ent


def backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    rows: torch.Tensor | None,
    inv_temperature: float | torch.Tensor,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    chunk_size: int,
    out: torch.Tensor | None = None,
    live: torch.Tensor | None = None,
    skip_zero_rows: bool = False,
) -> torch.Tensor:
    """Phase 2: ``dlogits`` of the given rows from per-row coefficients; other rows exact zeros.

    For row ``i`` with ``p = softmax(z / T)`` (``log p = (z - m) / T - log Σ`` from the saved
    statistics), label ``y``, coefficient ``a`` on the logprob and ``b`` on the entropy ``H``::

        dL/dz = (a·(onehot(y) - p) - b·p·(log p + H)) / T

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, as given to [`forward`][echoloss.ops.selective_logprobs.reference.forward].
        labels: ``[N]`` int64.
        rows: ``[n]`` int64 flat indices of the rows to write (any subset of the forward rows).
        inv_temperature: as in [`forward`][echoloss.ops.selective_logprobs.reference.forward].
        lse: ``[n]`` log-sum-exp of each row of ``rows`` (from [`forward`][echoloss.ops.selective_logprobs.reference.forward]).
        grad_logprobs: ``[n]`` coefficient ``a`` per row.
        grad_entropy: ``[n]`` coefficient ``b`` per row, or None for no entropy gradient.
        entropy: ``[n]`` entropy per row; required when ``grad_entropy`` is given.
        chunk_size: rows per chunk.
        out: optional zero-filled tensor of the logits' shape and dtype to write into.
        live: instead of ``rows``: ``[N]`` bool rows with a gradient, every per-row argument
            ``[N]``; every row is computed and the dead ones written with exact zeros (no host
            read of the live count).
        skip_zero_rows: with ``live``: a live row whose coefficients (``grad_logprobs``, and
            ``grad_entropy`` when given) are all zero is written with exact zeros too.

    Returns:
        ``dlogits`` with the shape and dtype of ``logits``.
    """
    cdtype = compute_dtype(logits.dtype)
    dead = None
    if live is not None:
        labels = _labels_in_range(labels, logits.shape[-1])
        n_all = logits.numel() // max(logits.shape[-1], 1)
        rows = torch.arange(n_all, device=logits.device)
        dead = ~live.reshape(-1)
        if skip_zero_rows:
            zero = grad_logprobs.reshape(-1) == 0
            if grad_entropy is not None:
                zero = zero & (grad_entropy.reshape(-1) == 0)
            dead = dead | zero
    assert rows is not None, "rows or live is required"
    n = int(rows.numel())
    if out is None:
        # Every row written: no need to zero-fill first (one pass over [N, V] saved).
        covers_all = n == logits.numel() // max(logits.shape[-1], 1)
        make = torch.empty_like if covers_all else torch.zeros_like
        out = make(logits, memory_format=torch.contiguous_format)
    grad = out
    flat = grad.view(-1, logits.shape[-1])
    ws = _Workspace(min(chunk_size, max(n, 1)), logits.shape[-1], cdtype, logits)
    for start in range(0, n, chunk_size):
        stop = min(n, start + chunk_size)
        c = stop - start
        idx = rows[start:stop]
        inv_t = _chunk_inv_t(inv_temperature, rows, start, stop)
        stats = lse[start:stop].to(cdtype)  # [c, 2] (m, log Σ)
        d, _ = _load_shifted(logits, rows, start, stop, inv_t, ws, shift=stats[:, 0])  # [c, V]
        a = grad_logprobs[start:stop, None].to(cdtype)  # [c, 1]
        g = d.sub_(stats[:, 1:])  # [c, V] log p = (z - m) / T - log Σ, in place
        if grad_entropy is None:
            g.exp_().mul_(-a)  # -a·p
        else:
            assert entropy is not None, "entropy is required with grad_entropy"
            b = grad_entropy[start:stop, None].to(cdtype)  # [c, 1]
            p = torch.exp(g, out=ws.get("b", c))  # [c, V]
            # -p·(a + b·(log p + H)), reusing the log p buffer for the factor.
            g.clamp_(min=LOG_P_FLOOR).add_(entropy[start:stop, None]).mul_(b).add_(a)
            g = p.mul_(g).neg_()
        g.scatter_add_(1, labels.index_select(0, idx)[:, None], a)  # + a·onehot(y)
        if isinstance(inv_t, float):
            if inv_t != 1.0:
                g.mul_(inv_t)
        else:
            g.mul_(inv_t[:, None])
        if dead is not None:  # dead rows: exact zeros, whatever their (unread) statistics
            g.masked_fill_(dead[start:stop, None], 0.0)
        if g.dtype != logits.dtype:
            g = ws.get("native", c).copy_(g)
        flat.index_copy_(0, idx, g)
    return grad
