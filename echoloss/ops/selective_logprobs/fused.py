"""Triton kernels for the two phases of the selective-logprob op (same contract as ``reference.py``).

Phase 1 ([`forward`][echoloss.ops.selective_logprobs.reference.forward], ``_logprobs_fwd_kernel``) streams each participating row once: an
online log-sum-exp over ``V`` in fp32 (running max and rescaled sum, one ``BLOCK_V`` block at a
time), the label's logprob and, optionally, the entropy. Phase 2 ([`backward`][echoloss.ops.selective_logprobs.reference.backward],
``_logprobs_bwd_kernel``) streams each live row again and writes
``dlogits = (a·(onehot(y) - p) - b·p·(log p + H)) / T``; every other row of the output is written
with exact zeros, so the output can be an uninitialised buffer or the logits buffer itself (in
place). Everything between the phases (the loss algebra) is ``[N]``-sized PyTorch elsewhere.

The grid is one program per row on axis 0 (``N`` up to 2^31 - 1; no ``[B, L]`` grid), program ids
are widened to int64 before they meet a stride, and every load over ``V`` is masked. fp64 logits
run the PyTorch reference (the kernels accumulate in fp32). On CPU the kernels run only under the
Triton interpreter: ``TRITON_INTERPRET=1`` must be set before this module is first imported
(``triton.jit`` reads it when the kernels are defined). ``README.md`` has the derivation and
``docs/kernels.md`` the design.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from echoloss._validate import describe, problem
from echoloss.ops._launch import on_tensor_device
from echoloss.ops.selective_logprobs import reference

__all__ = ["LAUNCH", "backward", "forward", "forward_launch", "interpreter_active"]

#: Launch parameters: ``BLOCK_V`` elements of a row per loop iteration and warps per program;
#: ``bwd_tile`` columns per phase-2 program (phase 2 runs on a 2-D grid, rows × vocabulary tiles);
#: from ``one_warp_from_v`` columns on, phase 1 runs one warp per row with ``one_warp_block``
#: (`forward_launch`). Chosen from the shape of the work, **not measured**: one bf16 row of 152k
#: is 297 KiB, 38 blocks of 4096; 256 threads hold 16 elements each, two 16-byte loads; a
#: one-warp program has no cross-warp reduction, hence no barrier, in its loop (the compiled
#: sm_90 code of the multi-warp variant has 6 per iteration). The GPU benchmark
#: (``python -m benchmarks --device cuda --sweep-launch``) is where they get tuned.
LAUNCH = {
    "fwd_block": 4096,
    "fwd_warps": 8,
    "bwd_block": 4096,
    "bwd_warps": 8,
    "bwd_tile": 16384,
    "one_warp_from_v": 32768,
    "one_warp_block": 2048,
}


def forward_launch(v: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` of phase 1 for a vocabulary of ``v``: the small shape table.

    Examples:
        >>> forward_launch(151_936)
        (2048, 1)
        >>> forward_launch(4_096)
        (4096, 8)
    """
    if v >= LAUNCH["one_warp_from_v"]:
        return _block(v, LAUNCH["one_warp_block"]), 1
    return _block(v, LAUNCH["fwd_block"]), LAUNCH["fwd_warps"]


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _max_combine_local(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine_local(a, b):
    return a + b


# Reductions are tl.reduce over triton.language's own combine functions: compiled, that is exactly
# tl.max / tl.sum on fp32 (the same tree reduction), and the interpreter recognises them by
# identity and runs np.nanmax / np.sum (pairwise, fast). Calling tl.max / tl.sum themselves would
# tie the interpreter to TRITON_INTERPRET at the first import of *triton* (they are @jit functions
# of triton.language), which torch._dynamo imports early; this way only the import of this module
# counts. The local functions stand in if a Triton release renames the private names.
_max_combine = getattr(tl.standard, "_elementwise_max", _max_combine_local)
_sum_combine = getattr(tl.standard, "_sum_combine", _sum_combine_local)


@triton.jit(do_not_specialize=["rows_per_batch"])
def _logprobs_fwd_kernel(
    LOGPROB,  # [n] fp32 out
    LSE,  # [n, 2] fp32 out: (row max of z, log Σ exp((z - max) / T))
    ENTROPY,  # [n] fp32 out (unused unless NEED_ENTROPY)
    LOGITS,  # [B, T, V] (a 2-D [N, V] is passed as B = 1)
    LABELS,  # [N] int64
    ROWS,  # [n] int64 flat row of each program (unused unless HAS_ROWS)
    MASK,  # [N] uint8, 0 = write zeros and read nothing (unused unless HAS_MASK)
    INV_T,  # [N] fp32 per-row 1/T (unused unless PER_ROW_T)
    inv_t_scalar,
    n_cols,
    rows_per_batch,
    stride_b,
    stride_t,
    stride_v,
    HAS_ROWS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PER_ROW_T: tl.constexpr,
    NEED_ENTROPY: tl.constexpr,
    WIDE_COLS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = tl.load(ROWS + pid).to(tl.int64) if HAS_ROWS else pid
    # A row outside MASK streams no column (the loop runs to 0) and stores exact zeros.
    n_stream = n_cols
    if HAS_MASK:
        active = tl.load(MASK + row) != 0
        n_stream = tl.where(active, n_cols, 0)
    inv_t = tl.load(INV_T + row).to(tl.float32) if PER_ROW_T else inv_t_scalar
    base = LOGITS + (row // rows_per_batch) * stride_b + (row % rows_per_batch) * stride_t
    label = tl.load(LABELS + row).to(tl.int64)
    # A label outside [0, V) (its error is deferred to the host) reads as 0: no read out of
    # bounds, as the reference.
    label = tl.where((label >= 0) & (label < n_cols), label, 0)
    cols = tl.arange(0, BLOCK_V)

    # Online log-sum-exp over d = (z - m) / T, with m the running max of the *raw* logits z:
    # subtracting before scaling keeps d's full relative precision at any |z / T| (z / T - m / T
    # would carry the rounding of |z / T|). acc is the sum of exp(d), ent_acc the sum of
    # exp(d)·d; both are rescaled by exp((m_old - m_new) / T) when m grows.
    m = float("-inf")
    acc = 0.0
    ent_acc = 0.0
    for start in range(0, n_stream, BLOCK_V):
        offs = start + cols
        valid = offs < n_cols
        # int32 column offsets unless (V - 1)·stride_v overflows them (e.g. transposed logits).
        col = offs.to(tl.int64) * stride_v if WIDE_COLS else offs * stride_v
        z = tl.load(base + col, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.reduce(z, 0, _max_combine))
        # A row that is -inf so far keeps m_new = -inf: shift by 0 to keep exp() from NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = (z - m_ref) * inv_t  # [BLOCK_V] ≤ 0, -inf where z = -inf (and on masked lanes)
        e = tl.exp(d)  # [BLOCK_V]
        step = (m - m_ref) * inv_t  # ≤ 0; -inf while nothing has been seen (m = -inf)
        alpha = tl.exp(step)
        if NEED_ENTROPY:
            # step·acc, written so that acc = 0 (and m = -inf) gives 0, not -inf·0 = NaN.
            shift = tl.where(acc > 0.0, step, 0.0) * acc
            d0 = tl.where(z == float("-inf"), 0.0, d)
            ent_acc = alpha * (ent_acc + shift) + tl.reduce(e * d0, 0, _sum_combine)
        acc = alpha * acc + tl.reduce(e, 0, _sum_combine)
        m = m_new

    m_out = tl.where(m == float("-inf"), 0.0, m)
    log_acc = tl.log(acc)
    z_label = tl.load(base + label * stride_v).to(tl.float32)
    lp = (z_label - m_out) * inv_t - log_acc
    # H = -Σ p·log p = log(acc) - Σ e·(s - m) / acc: both terms O(log V), no cancellation
    # against |m| (logits of ±1e4 lose nothing).
    h = log_acc - ent_acc / acc
    if HAS_MASK:
        lp = tl.where(active, lp, 0.0)
        log_acc = tl.where(active, log_acc, 0.0)
        h = tl.where(active, h, 0.0)
    tl.store(LOGPROB + pid, lp)
    tl.store(LSE + 2 * pid, m_out)
    tl.store(LSE + 2 * pid + 1, log_acc)
    if NEED_ENTROPY:
        tl.store(ENTROPY + pid, h)


@triton.jit(do_not_specialize=["rows_per_batch"])
def _logprobs_bwd_kernel(
    DLOGITS,  # [B, T, V] out, every row written (zeros where SLOT < 0)
    LOGITS,  # [B, T, V] (may be DLOGITS itself: each element is read before it is written)
    LABELS,  # [N] int64
    SLOT,  # [N] int32: index into the per-live-row arrays, -1 = write zeros; or, with
    # SLOT_IS_MASK, [N] uint8 live rows (0 = write zeros) whose per-row arrays are [N]
    LSE,  # [n, 2] fp32 (row max of z, log Σ exp((z - max) / T))
    GRAD_LP,  # [n] fp32 coefficient a
    GRAD_ENT,  # [n] fp32 coefficient b (unused unless HAS_ENT)
    ENTROPY,  # [n] fp32 H (unused unless HAS_ENT)
    INV_T,  # [N] fp32 (unused unless PER_ROW_T)
    inv_t_scalar,
    n_cols,
    rows_per_batch,
    stride_b,
    stride_t,
    stride_v,
    out_stride_b,
    out_stride_t,
    out_stride_v,
    HAS_ENT: tl.constexpr,
    PER_ROW_T: tl.constexpr,
    WIDE_COLS: tl.constexpr,
    ROUND_BF16_BY_BITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    TILE_V: tl.constexpr,
    SLOT_IS_MASK: tl.constexpr = False,
    SKIP_ZERO: tl.constexpr = False,
):
    # 2-D grid: axis 0 = rows (up to 2^31 - 1), axis 1 = tiles of TILE_V columns (V / TILE_V is
    # far below axis 1's 65,535). Every element depends only on its row's statistics, so tiles
    # are independent and a row's work spreads over several programs.
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * TILE_V
    b_idx = row // rows_per_batch
    t_idx = row % rows_per_batch
    out = DLOGITS + b_idx * out_stride_b + t_idx * out_stride_t
    cols = tl.arange(0, BLOCK_V)
    if SLOT_IS_MASK:
        # The live rows decided here, not by three small launches before this one: in the
        # mask and, with SKIP_ZERO, with a nonzero coefficient (a zero one gives exact zeros).
        live = tl.load(SLOT + row) != 0
        if SKIP_ZERO:
            nonzero = tl.load(GRAD_LP + row) != 0
            if HAS_ENT:
                nonzero = nonzero | (tl.load(GRAD_ENT + row) != 0)
            live = live & nonzero
        k = tl.where(live, row, -1)
    else:
        k = tl.load(SLOT + row).to(tl.int64)
    if k < 0:
        zero = tl.full([BLOCK_V], 0, dtype=DLOGITS.dtype.element_ty)
        for start in range(0, TILE_V, BLOCK_V):
            offs = col0 + start + cols
            col_out = offs.to(tl.int64) * out_stride_v if WIDE_COLS else offs * out_stride_v
            tl.store(out + col_out, zero, mask=offs < n_cols)
    else:
        base = LOGITS + b_idx * stride_b + t_idx * stride_t
        inv_t = tl.load(INV_T + row).to(tl.float32) if PER_ROW_T else inv_t_scalar
        label = tl.load(LABELS + row).to(tl.int64)
        label = tl.where((label >= 0) & (label < n_cols), label, 0)  # as phase 1
        m = tl.load(LSE + 2 * k)
        log_acc = tl.load(LSE + 2 * k + 1)
        a = tl.load(GRAD_LP + k)
        if HAS_ENT:
            b = tl.load(GRAD_ENT + k)
            h = tl.load(ENTROPY + k)
        for start in range(0, TILE_V, BLOCK_V):
            offs = col0 + start + cols
            valid = offs < n_cols
            if WIDE_COLS:
                col = offs.to(tl.int64) * stride_v
                col_out = offs.to(tl.int64) * out_stride_v
            else:
                col = offs * stride_v
                col_out = offs * out_stride_v
            z = tl.load(base + col, mask=valid, other=float("-inf")).to(tl.float32)
            log_p = (z - m) * inv_t - log_acc
            p = tl.exp(log_p)
            g = -a * p
            if HAS_ENT:
                # -b·p·(log p + H); log p is clamped so that p = 0 (z = -inf) gives 0, not NaN.
                g -= b * p * (tl.maximum(log_p, -3.4028234663852886e38) + h)
            g = tl.where(offs == label, g + a, g) * inv_t
            if ROUND_BF16_BY_BITS:
                # Round-to-nearest-even on the fp32 bits (the interpreter's own fp32 -> bf16 cast
                # truncates; a GPU rounds to nearest even, which this reproduces bit for bit).
                bits = g.to(tl.uint32, bitcast=True)
                bits = bits + 0x7FFF + ((bits >> 16) & 1)
                g_out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            else:
                g_out = g.to(DLOGITS.dtype.element_ty)
            tl.store(out + col_out, g_out, mask=valid)


def interpreter_active() -> bool:
    """Whether the kernels of this module were defined under the Triton interpreter.

    Examples:
        >>> isinstance(interpreter_active(), bool)
        True
    """
    return type(_logprobs_fwd_kernel).__name__ == "InterpretedFunction"


def _check_device(logits: torch.Tensor) -> None:
    # Under the interpreter CUDA tensors are copied to the host and back: slow but correct.
    if logits.device.type == "cuda" or (logits.device.type == "cpu" and interpreter_active()):
        return
    if logits.device.type == "cpu":
        raise RuntimeError(
            "backend='triton' on cpu: the Triton kernels were compiled for a GPU because "
            "TRITON_INTERPRET was not set when echoloss.ops.selective_logprobs.fused was first "
            "imported; set TRITON_INTERPRET=1 before importing echoloss (tests do this in "
            "tests/ops/conftest.py), or use backend='reference'"
        )
    raise RuntimeError(
        f"backend='triton': logits are on {logits.device}, the kernels run on CUDA devices "
        "(or on cpu under TRITON_INTERPRET=1); use backend='reference'"
    )


def _layout(t: torch.Tensor) -> tuple[int, int, int, int]:
    """``(rows_per_batch, stride_b, stride_t, stride_v)`` of a ``[N, V]`` or ``[B, T, V]`` tensor."""
    if t.dim() == 2:
        return max(1, t.shape[0]), 0, t.stride(0), t.stride(1)
    return max(1, t.shape[1]), t.stride(0), t.stride(1), t.stride(2)


def _inv_t_args(
    inv_temperature: float | torch.Tensor, dummy: torch.Tensor
) -> tuple[torch.Tensor, float, bool]:
    if isinstance(inv_temperature, torch.Tensor):
        return inv_temperature.to(torch.float32).contiguous(), 1.0, True
    return dummy, float(inv_temperature), False


def _block(v: int, cap: int) -> int:
    return max(16, min(cap, int(triton.next_power_of_2(max(1, v)))))


def _wide(v: int, stride_v: int) -> bool:
    """Whether the column offsets ``(V - 1 + BLOCK_V)·stride_v`` may overflow int32."""
    reach = (
        LAUNCH["fwd_block"] + LAUNCH["bwd_block"] + LAUNCH["bwd_tile"] + LAUNCH["one_warp_block"]
    )
    return (v + reach) * abs(stride_v) >= 2**31


def _check_dtype(logits: torch.Tensor) -> None:
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"backend='triton': logits dtype {logits.dtype} is not supported (bf16, fp16, fp32; "
            "fp64 runs the reference); cast the logits, or use backend='reference'"
        )


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
    """Phase 1 with the Triton kernel; same arguments and results as ``reference.forward``.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, bf16/fp16/fp32 (fp64 runs the reference), any
            strides (a unit stride over ``V`` gets vectorised loads). Never modified.
        labels: ``[N]`` int64, in ``[0, V)`` on every computed row (with ``mask``, a label
            outside reads as 0: its error is the caller's, deferred).
        rows: ``[n]`` int64 flat indices of the rows to compute, or None for all ``N`` rows.
        inv_temperature: ``1/T``, a Python float or a ``[N]`` float tensor.
        need_entropy: also return the entropy.
        chunk_size: unused (the kernel keeps nothing ``[chunk, V]``-sized); accepted so both
            backends share one signature.
        mask: with ``rows`` None, ``[N]`` bool: rows outside it read nothing and get exact
            zeros (one program per row either way: no host read of the row count).

    Returns:
        ``(logprobs [n], lse [n, 2], entropy [n] or None)``, fp32, one entry per computed row;
        ``lse`` as in ``reference.forward`` (row max of the logits, log-sum of the shifted
        exponentials).
    """
    if logits.dtype == torch.float64:
        return reference.forward(
            logits,
            labels,
            rows=rows,
            inv_temperature=inv_temperature,
            need_entropy=need_entropy,
            chunk_size=chunk_size,
            mask=mask,
        )
    _check_dtype(logits)
    _check_device(logits)
    v = logits.shape[-1]
    n = int(rows.numel()) if rows is not None else int(logits.numel() // max(1, v))
    dev = logits.device
    out_lp = torch.empty(n, dtype=torch.float32, device=dev)
    out_lse = torch.empty(n, 2, dtype=torch.float32, device=dev)
    out_ent = torch.empty(n, dtype=torch.float32, device=dev) if need_entropy else None
    if n == 0:
        return out_lp, out_lse, out_ent
    labels = labels.to(torch.int64).contiguous()
    rows_arg = labels if rows is None else rows.to(torch.int64).contiguous()
    has_mask = mask is not None and rows is None
    mask_arg = mask.reshape(-1).contiguous().view(torch.uint8) if has_mask else labels  # type: ignore[union-attr]
    inv_t_arg, inv_t_scalar, per_row = _inv_t_args(inv_temperature, out_lp)
    rows_per_batch, sb, st, sv = _layout(logits)
    fwd_block, fwd_warps = forward_launch(v)
    with on_tensor_device(logits):
        _logprobs_fwd_kernel[(n,)](
            out_lp,
            out_lse,
            out_ent if out_ent is not None else out_lp,
            logits,
            labels,
            rows_arg,
            mask_arg,
            inv_t_arg,
            inv_t_scalar,
            v,
            rows_per_batch,
            sb,
            st,
            sv,
            HAS_ROWS=rows is not None,
            HAS_MASK=has_mask,
            PER_ROW_T=per_row,
            NEED_ENTROPY=need_entropy,
            WIDE_COLS=_wide(v, sv),
            BLOCK_V=fwd_block,
            num_warps=fwd_warps,
            enable_fp_fusion=True,
        )
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
    """Phase 2 with the Triton kernel; same arguments and result as ``reference.backward``.

    Every row of the result is written: the rows of ``rows`` with the gradient, all others with
    exact zeros. So ``out`` needs no zero fill, and ``out=logits`` computes the gradient in place
    over the logits buffer (each element is read before it is overwritten by the same program);
    the logits are then gone, so only do that when nothing reads them afterwards.

    Args:
        logits: ``[N, V]`` or ``[B, T, V]``, as given to [`forward`][echoloss.ops.selective_logprobs.reference.forward].
        labels: ``[N]`` int64.
        rows: ``[n]`` int64 distinct flat indices of the rows with a gradient.
        inv_temperature: as in [`forward`][echoloss.ops.selective_logprobs.reference.forward].
        lse: ``[n, 2]`` log-sum-exp statistics of each row of ``rows`` (from [`forward`][echoloss.ops.selective_logprobs.reference.forward]).
        grad_logprobs: ``[n]`` coefficient ``a`` per row.
        grad_entropy: ``[n]`` coefficient ``b`` per row, or None.
        entropy: ``[n]`` entropy per row; required with ``grad_entropy``.
        chunk_size: unused (see [`forward`][echoloss.ops.selective_logprobs.reference.forward]).
        out: optional tensor of the logits' shape and dtype to write into (any content), or
            ``logits`` itself. None allocates a contiguous one.
        live: instead of ``rows``: ``[N]`` bool rows with a gradient; ``lse``,
            ``grad_logprobs``, ``grad_entropy`` and ``entropy`` are then ``[N]`` (one entry per
            row, read on live rows only). Nothing is read back to the host.
        skip_zero_rows: with ``live``: a live row whose coefficients (``grad_logprobs``, and
            ``grad_entropy`` when given) are all zero is written with exact zeros too, decided
            in the kernel (no launch to combine the mask with the coefficients).

    Returns:
        ``dlogits`` with the shape and dtype of ``logits`` (``out`` when given).
    """
    if logits.dtype == torch.float64:
        if live is not None:
            return reference.backward(
                logits,
                labels,
                rows=None,
                inv_temperature=inv_temperature,
                lse=lse,
                grad_logprobs=grad_logprobs,
                grad_entropy=grad_entropy,
                entropy=entropy,
                chunk_size=chunk_size,
                out=out,
                live=live,
                skip_zero_rows=skip_zero_rows,
            )
        assert rows is not None, "rows or live is required"
        if out is not None:
            # The reference writes only ``rows`` into ``out``: zero the others first (in place
            # too: the reference copies each chunk of rows before it overwrites them).
            dead = torch.ones(
                out.numel() // max(1, out.shape[-1]), dtype=torch.bool, device=out.device
            )
            dead[rows] = False
            out.view(-1, out.shape[-1])[dead] = 0
        return reference.backward(
            logits,
            labels,
            rows=rows,
            inv_temperature=inv_temperature,
            lse=lse,
            grad_logprobs=grad_logprobs,
            grad_entropy=grad_entropy,
            entropy=entropy,
            chunk_size=chunk_size,
            out=out,
        )
    _check_dtype(logits)
    _check_device(logits)
    if grad_entropy is not None and entropy is None:
        raise ValueError("entropy is required with grad_entropy (the H in p·(log p + H))")
    v = logits.shape[-1]
    n_all = int(logits.numel() // max(1, v))
    dev = logits.device
    if out is None:
        out = torch.empty(logits.shape, dtype=logits.dtype, device=dev)
    elif out.shape != logits.shape or out.dtype != logits.dtype or out.device != dev:
        raise ValueError(
            problem(
                "out",
                f"a tensor of the logits' shape {list(logits.shape)}, dtype {logits.dtype} and "
                f"device {dev}",
                describe(out),
            )
        )
    elif out.data_ptr() == logits.data_ptr() and out.stride() != logits.stride():
        raise ValueError(
            "out: aliases the logits with different strides; pass out=logits itself for an "
            "in-place gradient, or a separate buffer"
        )
    if n_all == 0:
        return out
    if live is not None:
        # Row i's statistics and coefficients are at slot i; the kernel reads the mask itself.
        slot = live.reshape(-1).contiguous().view(torch.uint8)
    else:
        assert rows is not None, "rows or live is required"
        n = int(rows.numel())
        slot = torch.full((n_all,), -1, dtype=torch.int32, device=dev)
        if n:
            slot[rows] = torch.arange(n, dtype=torch.int32, device=dev)
    f32 = torch.float32
    lse = lse.to(f32).contiguous()
    a = grad_logprobs.to(f32).contiguous()
    has_ent = grad_entropy is not None
    b = grad_entropy.to(f32).contiguous() if has_ent else a  # type: ignore[union-attr]
    h = entropy.to(f32).contiguous() if has_ent else a  # type: ignore[union-attr]
    labels = labels.to(torch.int64).contiguous()
    inv_t_arg, inv_t_scalar, per_row = _inv_t_args(inv_temperature, a)
    rows_per_batch, sb, st, sv = _layout(logits)
    _, ob, ot, ov = _layout(out)
    bwd_block = _block(v, LAUNCH["bwd_block"])
    tile = max(bwd_block, min(LAUNCH["bwd_tile"], int(triton.next_power_of_2(v))))
    tile -= tile % bwd_block  # a whole number of blocks per tile
    with on_tensor_device(logits):
        _logprobs_bwd_kernel[(n_all, triton.cdiv(v, tile))](
            out,
            logits,
            labels,
            slot,
            lse,
            a,
            b,
            h,
            inv_t_arg,
            inv_t_scalar,
            v,
            rows_per_batch,
            sb,
            st,
            sv,
            ob,
            ot,
            ov,
            HAS_ENT=has_ent,
            PER_ROW_T=per_row,
            WIDE_COLS=_wide(v, sv) or _wide(v, ov),
            ROUND_BF16_BY_BITS=out.dtype == torch.bfloat16 and interpreter_active(),
            BLOCK_V=bwd_block,
            TILE_V=tile,
            SLOT_IS_MASK=live is not None,
            SKIP_ZERO=live is not None and skip_zero_rows,
            num_warps=LAUNCH["bwd_warps"],
            enable_fp_fusion=True,
        )
    return out
