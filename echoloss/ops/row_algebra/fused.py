"""The fused row algebra as one Triton program (same contract as ``naive.py``).

One program walks the ``[N]`` rows twice in blocks of ``BLOCK``: the first loop counts the RL
and echo rows (the denominators need them before any row's derivative), the second computes
every row's loss terms and derivatives and accumulates the sums of the metrics and checks. The
work is ``O(N)`` over a few ``[N]`` vectors (about 30 bytes a row): tens of microseconds for a
64k-row micro-batch on one streaming multiprocessor, against the milliseconds of host time the
hundred PyTorch launches it replaces cost. One program also keeps every sum in one fixed order:
the result does not depend on the grid or on timing (no atomics). When something is per
sequence (a normaliser, a sequence-level ratio, a sequence-level mismatch weight), one sort of the
sequence ids and a program before it (`_sequence_groups_kernel`) give each row its sequence
and each sequence its counts and sums.

The derivatives are autograd's in closed form: ``clamp`` passes the gradient on its bounds,
``minimum``/``maximum`` of equal branches split it in half (ppo_clip's two branches are equal
wherever the ratio is inside the clip range), ``|x|`` has derivative 0 at 0. ``minimum``,
``maximum`` and ``clamp`` propagate NaN as torch's do (Triton's default returns the other
operand): a NaN logprob makes the loss NaN here as in the PyTorch algebra.

On CPU the program runs only under the Triton interpreter (``TRITON_INTERPRET=1`` set before
this module is first imported), for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from echoloss.ops._launch import on_tensor_device
from echoloss.ops.row_algebra.contract import CHECK_SLOTS, STAT_SLOTS, RowAlgebraParams, RowInputs
from echoloss.ops.row_algebra.policies import ROW_POLICIES, SFT_CODE

__all__ = ["BLOCK", "forward", "interpreter_active"]

#: Rows per loop iteration and warps of the one program (4 fp32 values per thread per vector).
BLOCK = 1024
NUM_WARPS = 4

#: Each policy's branch of the program (`POLICY`), from its declaration (``policies.py``).
_POLICY_CODE = {name: row.code for name, row in ROW_POLICIES.items()} | {"sft": SFT_CODE}
_ECHO_CODE = {"token_mean": 0, "sum": 1, "batch_token_mean": 2, "sequence_mean": 3}
_MISMATCH_CODE = {
    None: 0,
    "token_truncate": 1,
    "token_mask": 2,
    "sequence_truncate": 3,
    "sequence_mask": 4,
}
_KL_CODE = {"k1": 1, "k2": 2, "k3": 3}


@triton.jit
def _sum_local(a, b):
    return a + b


@triton.jit
def _max_local(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_local(a, b):
    return tl.minimum(a, b)


# triton.language's own combine functions (as in the selective-logprob kernels: tl.sum / tl.max
# themselves would tie the interpreter to TRITON_INTERPRET at the first import of triton). For the
# same reason the program fills with tl.full, never tl.zeros (a @jit function of triton.language).
_sum = getattr(tl.standard, "_sum_combine", _sum_local)
_max = getattr(tl.standard, "_elementwise_max", _max_local)
_min = getattr(tl.standard, "_elementwise_min", _min_local)


@triton.jit
def _nan_min(a, b):
    """``minimum`` with NaN propagated, as torch's (``tl.minimum`` returns the other operand)."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _nan_max(a, b):
    """``maximum`` with NaN propagated, as torch's (``tl.maximum`` returns the other operand)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _clamp_grad(x, c, HAS_CLAMP: tl.constexpr):
    """``(clamp(x, -c, c), d clamp / d x)``: 1 on the bounds, as autograd; NaN stays NaN."""
    if HAS_CLAMP:
        y = _nan_min(_nan_max(x, -c), c)
        g = tl.where((x >= -c) & (x <= c), 1.0, 0.0)
    else:
        y = x
        g = tl.full(x.shape, 1.0, tl.float32)
    return y, g


@triton.jit
def _sigmoid(x):
    """``1 / (1 + exp(−x))``: 0 and 1 at the ends, never NaN for a finite ``x`` (tl.sigmoid is a
    @jit function of triton.language: see the combine functions above)."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _sapo_slope(x, tau):
    """``σ(z)·(1 − σ(z))·exp(x)`` of ``z = τ·(exp(x) − 1)`` as ``exp(x − |z|) / (1 + exp(−|z|))²``:
    no factor overflows, 0 past the float range (echoloss/_ratios.py's `sapo_gate_slope`)."""
    a = tl.abs(tau * (tl.exp(x) - 1.0))
    e = tl.exp(-a)
    slope = tl.exp(x - a) / ((1.0 + e) * (1.0 + e))
    return tl.where(a == float("inf"), 0.0, slope)


@triton.jit
def _not_finite(x):
    return (x - x) != 0


@triton.jit
def _first_bad(bad, idx, values, first, first_value, n):
    """Fold one block into ``(first bad row, its value)``; ``n`` = none yet."""
    blk = tl.reduce(tl.where(bad, idx, n), 0, _min)
    blk_value = tl.reduce(tl.where(idx == blk, values, 0.0), 0, _sum)
    take = blk < first
    return tl.where(take, blk, first), tl.where(take, blk_value, first_value)


@triton.jit
def _rows_of(RL, ECHO, ENV, idx, m, env, main, HAS_ENV: tl.constexpr):
    """The RL and echo rows of block ``idx``: all of them for the main program, those of env
    ``env`` for an env's program (HAS_ENV)."""
    rl = tl.load(RL + idx, mask=m, other=0) != 0
    echo = tl.load(ECHO + idx, mask=m, other=0) != 0
    if HAS_ENV:
        in_env = (tl.load(ENV + idx, mask=m, other=-1).to(tl.int32) == env) | main
        rl = rl & in_env
        echo = echo & in_env
    return rl, echo


@triton.jit
def _segmented_combine(f1, v1, f2, v2):
    """A sum that restarts where the right operand's segment starts."""
    return f1 | f2, tl.where(f2 != 0, v2, v1 + v2)


@triton.jit
def _segmented_sum(first, values, carry, offs, left, BLOCK: tl.constexpr):
    """Per position of a block, the sum of ``values`` since its segment's start (``carry``
    from the previous block before the block's first start), and the block's last value."""
    starts, sums = tl.associative_scan((first, values), 0, _segmented_combine)
    out = sums + tl.where(starts != 0, 0.0, carry)
    last = tl.minimum(left, BLOCK) - 1
    return out, tl.reduce(tl.where(offs == last, out, 0.0), 0, _sum)


@triton.jit
def _mismatch_weight(log_w, clamp, mm_max, mm_min, MODE: tl.constexpr, HAS_MM_MIN: tl.constexpr,
                     HAS_CLAMP: tl.constexpr):  # fmt: skip
    """``(w, outside)``: ``exp(clamp(log_w))`` truncated to ``[mm_min, mm_max]`` (MODE 1) or
    0 outside it (MODE 2); NaN stays NaN."""
    x, _ = _clamp_grad(log_w, clamp, HAS_CLAMP)
    w = tl.exp(x)
    outside = w > mm_max
    if HAS_MM_MIN:
        outside = outside | (w < mm_min)
    if MODE == 1:
        if HAS_MM_MIN:  # noqa: SIM108 (a constexpr branch, not a runtime select)
            w = _nan_min(_nan_max(w, mm_min), mm_max)
        else:
            w = _nan_min(w, mm_max)
    else:
        w = tl.where(outside, 0.0, w)
    return w, outside


@triton.jit
def _sequence_terms(LP, OLD, LQ, ADV, row, m, rl, adv_tau, clamp, mm_max, mm_min,
                    adv_inner, adv_s_outer, adv_s_inner, ADV_FLAT: tl.constexpr,
                    BASE: tl.constexpr, HAS_LQ: tl.constexpr, HAS_ADV: tl.constexpr,
                    TOKEN_MM: tl.constexpr, HAS_MM_MIN: tl.constexpr,
                    HAS_CLAMP: tl.constexpr):  # fmt: skip
    """What the sequences sum over their RL rows (0 elsewhere): ``ρ = ℓ − b₀``, ``w·A`` for
    ``A > 0`` and for ``A < 0`` (``w`` the token-level mismatch weight, else 1), ``b₀ − lq``."""
    lp = tl.where(rl, tl.load(LP + row, mask=m, other=0.0), 0.0)
    if HAS_LQ:
        lq = tl.where(rl, tl.load(LQ + row, mask=m, other=0.0).to(tl.float32), 0.0)
    else:
        lq = tl.full(lp.shape, 0.0, tl.float32)
    if BASE == 1:
        base = tl.where(rl, tl.load(OLD + row, mask=m, other=0.0).to(tl.float32), 0.0)
    elif BASE == 2:
        base = lq
    else:
        base = lp
    if HAS_ADV:
        at = _offset(row, adv_inner, adv_s_outer, adv_s_inner, ADV_FLAT)
        adv = tl.where(rl, tl.load(ADV + at, mask=m, other=0.0).to(tl.float32), 0.0) * adv_tau
    else:
        adv = tl.full(lp.shape, 0.0, tl.float32)
    if TOKEN_MM != 0:
        w, _ = _mismatch_weight(base - lq, clamp, mm_max, mm_min, TOKEN_MM, HAS_MM_MIN, HAS_CLAMP)
        wa = w * adv
    else:
        wa = adv
    pos_a = tl.where(adv > 0, wa, 0.0)
    neg_a = tl.where(adv < 0, wa, 0.0)
    return lp - base, pos_a, neg_a, tl.where(rl, base - lq, 0.0)


@triton.jit
def _sequence_ratio(SUM_IN, CNT_RL, grp, m, clamp, HAS_CLAMP: tl.constexpr):
    """``(x, gx, |RL_i|)`` of each row's sequence ``i``: ``x = clamp(mean ρ)`` over its RL rows
    (the groups program's sum over their count, at least 1) and ``d x / d mean``."""
    cnt = tl.maximum(tl.load(CNT_RL + grp, mask=m, other=1).to(tl.float32), 1.0)
    x, gx = _clamp_grad(tl.load(SUM_IN + grp, mask=m, other=0.0) / cnt, clamp, HAS_CLAMP)
    return x, gx, cnt


@triton.jit
def _offset(pos, inner, s_outer, s_inner, FLAT: tl.constexpr):
    """Where entry ``pos`` of a field read in place lies: ``pos · s_inner`` for a field one
    stride walks, else ``(pos // inner) · s_outer + (pos % inner) · s_inner`` (a ``[B, T]``
    view, e.g. a per-sequence value expanded over its positions: strides ``(1, 0)``)."""
    if FLAT:
        return pos * s_inner
    else:
        return (pos // inner) * s_outer + (pos % inner) * s_inner


@triton.jit
def _sequence_groups_kernel(
    SKEY,  # [N] int sorted sequence ids (with IN_ORDER: the ids in place, through the strides)
    ORDER,  # [N] int64 row at each sorted position
    RL,  # [N] uint8
    ECHO,  # [N] uint8
    OBS,  # [N] uint8 observation rows (unused unless HAS_OBS)
    GROUP,  # [N] int32 out: per row, the sorted position where its sequence starts
    CNT_RL,  # [N] int32 out: at a sequence's start position, its RL rows (else unwritten)
    CNT_Z,  # [N] int32 out: at a sequence's start position, its observation-or-echo rows
    SEQS,  # [2] int32 out: sequences with an RL row, sequences with an echo row
    LP,  # [N] fp32 logprobs (unused unless SUMS)
    OLD,  # [N] float old logprobs (unused unless BASE == 1)
    LQ,  # [N] float inference logprobs (unused unless HAS_LQ)
    ADV,  # [N] float advantages (unused unless HAS_ADV)
    SUM_OUT,  # [4, N] fp32 out: at a sequence's start, over its RL rows: Σ ρ, Σ w·A⁺, Σ w·A⁻,
    # Σ (b₀ − lq) (unused unless SUMS)
    n,
    id_inner,  # the ids' layout (`_offset`)
    id_s_outer,
    id_s_inner,
    adv_inner,  # the advantages' layout
    adv_s_outer,
    adv_s_inner,
    adv_tau,
    clamp,
    mm_max,
    mm_min,
    ID_FLAT: tl.constexpr,
    ADV_FLAT: tl.constexpr,
    HAS_OBS: tl.constexpr,
    SUMS: tl.constexpr,  # a sequence-level ratio or mismatch correction: the four sums
    BASE: tl.constexpr,  # as the row program's
    HAS_LQ: tl.constexpr,
    HAS_ADV: tl.constexpr,
    TOKEN_MM: tl.constexpr,  # the per-token weight w of Σ w·A: 0 none, 1 truncate, 2 mask
    HAS_MM_MIN: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    IN_ORDER: tl.constexpr,  # the ids never decrease along the rows: position = row, no ORDER
    BLOCK: tl.constexpr,
):
    # Sorted, each sequence is a run of equal ids. Walking the sorted positions in order, a
    # row's sequence starts at the last run start at or before it, and the rows of the run
    # counted before it are a prefix count minus the prefix count at that start: both are
    # non-decreasing along the positions, so a running maximum carries them across blocks.
    # A run's totals are written once, at its last position, into the slot of its start.
    # Float sums cannot be differences of prefix sums (they would cancel): they are segmented
    # scans (restarting at each run start), the last position's value carried to the next
    # block.
    offs = tl.arange(0, BLOCK)
    c_rho = tl.full([], 0.0, tl.float32)
    c_pos = tl.full([], 0.0, tl.float32)
    c_neg = tl.full([], 0.0, tl.float32)
    c_lw = tl.full([], 0.0, tl.float32)
    g_carry = tl.full([], -1, tl.int32)
    base_rl_carry = tl.full([], 0, tl.int32)
    base_z_carry = tl.full([], 0, tl.int32)
    base_echo_carry = tl.full([], 0, tl.int32)
    total_rl = tl.full([], 0, tl.int32)
    total_z = tl.full([], 0, tl.int32)
    total_echo = tl.full([], 0, tl.int32)
    seq_rl = tl.full([BLOCK], 0, tl.int32)
    seq_echo = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, n, BLOCK):
        pos = start + offs
        m = pos < n
        at = _offset(pos, id_inner, id_s_outer, id_s_inner, ID_FLAT)
        key = tl.load(SKEY + at, mask=m, other=0)
        at_prev = _offset(pos - 1, id_inner, id_s_outer, id_s_inner, ID_FLAT)
        prev = tl.load(SKEY + at_prev, mask=m & (pos > 0), other=0)
        at_next = _offset(pos + 1, id_inner, id_s_outer, id_s_inner, ID_FLAT)
        nxt = tl.load(SKEY + at_next, mask=(pos + 1) < n, other=0)
        first = m & ((pos == 0) | (key != prev))
        last = m & ((pos == n - 1) | (key != nxt))
        if IN_ORDER:  # noqa: SIM108 (a constexpr branch, not a runtime select)
            row = pos
        else:
            row = tl.load(ORDER + pos, mask=m, other=0)
        rl = (tl.load(RL + row, mask=m, other=0) != 0).to(tl.int32)
        echo_b = tl.load(ECHO + row, mask=m, other=0) != 0
        echo = echo_b.to(tl.int32)
        if HAS_OBS:  # noqa: SIM108 (a constexpr branch, not a runtime select)
            z = (echo_b | (tl.load(OBS + row, mask=m, other=0) != 0)).to(tl.int32)
        else:
            z = echo
        inc_rl = total_rl + tl.associative_scan(rl, 0, _sum_local)
        inc_z = total_z + tl.associative_scan(z, 0, _sum_local)
        inc_echo = total_echo + tl.associative_scan(echo, 0, _sum_local)
        g = tl.maximum(tl.associative_scan(tl.where(first, pos, -1), 0, _max_local), g_carry)
        base_rl = tl.maximum(
            tl.associative_scan(tl.where(first, inc_rl - rl, -1), 0, _max_local), base_rl_carry
        )
        base_z = tl.maximum(
            tl.associative_scan(tl.where(first, inc_z - z, -1), 0, _max_local), base_z_carry
        )
        base_echo = tl.maximum(
            tl.associative_scan(tl.where(first, inc_echo - echo, -1), 0, _max_local),
            base_echo_carry,
        )
        if SUMS:
            rho, pos_a, neg_a, lw = _sequence_terms(
                LP, OLD, LQ, ADV, row, m, rl != 0, adv_tau, clamp, mm_max, mm_min,
                adv_inner, adv_s_outer, adv_s_inner, ADV_FLAT,
                BASE, HAS_LQ, HAS_ADV, TOKEN_MM, HAS_MM_MIN, HAS_CLAMP,
            )  # fmt: skip
            is_first = first.to(tl.int32)
            s_rho, c_rho = _segmented_sum(is_first, rho, c_rho, offs, n - start, BLOCK)
            s_pos, c_pos = _segmented_sum(is_first, pos_a, c_pos, offs, n - start, BLOCK)
            s_neg, c_neg = _segmented_sum(is_first, neg_a, c_neg, offs, n - start, BLOCK)
            s_lw, c_lw = _segmented_sum(is_first, lw, c_lw, offs, n - start, BLOCK)
            tl.store(SUM_OUT + g, s_rho, mask=last)
            tl.store(SUM_OUT + n + g, s_pos, mask=last)
            tl.store(SUM_OUT + 2 * n + g, s_neg, mask=last)
            tl.store(SUM_OUT + 3 * n + g, s_lw, mask=last)
        tl.store(GROUP + row, g, mask=m)
        n_rl = inc_rl - base_rl
        n_echo = inc_echo - base_echo
        tl.store(CNT_RL + g, n_rl, mask=last)
        tl.store(CNT_Z + g, inc_z - base_z, mask=last)
        seq_rl += (last & (n_rl > 0)).to(tl.int32)
        seq_echo += (last & (n_echo > 0)).to(tl.int32)
        g_carry = tl.reduce(g, 0, _max)
        base_rl_carry = tl.reduce(base_rl, 0, _max)
        base_z_carry = tl.reduce(base_z, 0, _max)
        base_echo_carry = tl.reduce(base_echo, 0, _max)
        total_rl += tl.reduce(rl, 0, _sum)
        total_z += tl.reduce(z, 0, _sum)
        total_echo += tl.reduce(echo, 0, _sum)
    tl.store(SEQS + 0, tl.reduce(seq_rl, 0, _sum))
    tl.store(SEQS + 1, tl.reduce(seq_echo, 0, _sum))


@triton.jit
def _row_algebra_kernel(
    LP,  # [N] fp32
    ENT,  # [N] float (unused unless HAS_ENT)
    RL,  # [N] uint8
    ECHO,  # [N] uint8
    W,  # [N] float echo weights (unused unless HAS_W)
    ADV,  # [N] float, through its layout (unused unless HAS_ADV)
    OLD,  # [N] float old logprobs (unused unless BASE == 1)
    LQ,  # [N] float inference logprobs (unused unless HAS_LQ)
    RL_DIV,  # [1] float device divisor (unused unless RL_DIV_MODE == 2)
    ECHO_DIV,  # [1] float device divisor (unused unless ECHO_DIV_MODE == 2)
    LABELS,  # [N] int labels (unused unless CHECK_LABELS)
    ENV,  # [N] int env of each row, -1 = none (unused unless HAS_ENV)
    GROUP,  # [N] int32 start of each row's sequence (unused unless SEQ)
    CNT_RL,  # [N] int32 RL rows of the sequence starting there (unused unless RL_PER_SEQ)
    CNT_Z,  # [N] int32 Z of the sequence starting there (unused unless ECHO_MODE == 3)
    SEQS,  # [2] int32 sequences with an RL row, with an echo row (unused unless SEQ)
    REF,  # [N] float reference logprobs (unused unless HAS_KL_COEF)
    SUM_IN,  # [4, N] fp32 the sequences' sums (unused unless a sequence ratio or mismatch)
    A,  # [N] fp32 out: d loss / d logprob
    B,  # [N] fp32 out: d loss / d entropy (unused unless TRAIN_ENT)
    LOSS,  # [] fp32 out
    STATS,  # [1 + envs, len(STAT_SLOTS)] fp32 out: all rows, then one row per env
    CHECKS,  # [len(CHECK_SLOTS)] fp64 out
    n,
    adv_tau,
    low,  # the policy's lower bound (sapo: τ for A ≤ 0)
    high,  # the policy's upper bound (sapo: τ for A > 0)
    dual_c,
    clamp,
    kl_tau,
    ent_coef,
    rl_div_value,
    echo_div_value,
    z_eps,
    mm_max,
    mm_min,
    kl_coef,
    lp_tolerance,
    vocab,
    adv_inner,  # the advantages' layout (`_offset`)
    adv_s_outer,
    adv_s_inner,
    ADV_FLAT: tl.constexpr,
    POLICY: tl.constexpr,
    HAS_LOW: tl.constexpr,
    DUAL: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    HAS_KL_TAU: tl.constexpr,
    HAS_ENT: tl.constexpr,
    TRAIN_ENT: tl.constexpr,
    ENT_METRIC: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_ADV: tl.constexpr,
    BASE: tl.constexpr,  # 0: the row's own logprob (on-policy), 1: OLD, 2: LQ
    HAS_LQ: tl.constexpr,
    RL_DIV_MODE: tl.constexpr,  # 0: the call's RL rows (≥ 1), 1: rl_div_value, 2: RL_DIV,
    # 3: the call's RL sequences (≥ 1)
    RL_PER_SEQ: tl.constexpr,  # each RL row also divided by its sequence's RL rows
    ECHO_MODE: tl.constexpr,  # 0: token_mean, 1: sum, 2: batch_token_mean, 3: sequence_mean
    SEQ: tl.constexpr,  # a per-sequence normaliser: GROUP and SEQS are read
    MISMATCH: tl.constexpr,  # 0: none, 1: token_truncate, 2: token_mask (LQ read),
    # 3: sequence_truncate, 4: sequence_mask (SUM_IN read)
    HAS_MM_MIN: tl.constexpr,
    HAS_KL_COEF: tl.constexpr,
    KL_EST: tl.constexpr,  # 1: k1, 2: k2, 3: k3
    ECHO_DIV_MODE: tl.constexpr,  # 0: the call's echo rows / sequences, 1: echo_div_value,
    # 2: ECHO_DIV (token_mean, sequence_mean: the divisor; batch_token_mean: of the count)
    CHECK: tl.constexpr,
    LP_GIVEN: tl.constexpr,
    CHECK_LABELS: tl.constexpr,
    HAS_ENV: tl.constexpr,
    NUM_STATS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program 0 computes everything over all rows; program e + 1 (one per env, HAS_ENV) walks
    # the same rows but keeps only env e's in the RL and echo masks and writes only its row of
    # STATS: the per-env metrics, in parallel with the main program.
    pid = tl.program_id(0)
    main = pid == 0
    env = pid - 1
    n_main = tl.where(main, n, 0)  # rows program 0 writes derivatives for: all of them, or none
    offs = tl.arange(0, BLOCK)
    # ---- loop 1: the counts every denominator and metric needs
    rl_count = tl.full([BLOCK], 0, tl.int32)
    echo_count = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + offs
        m = idx < n
        rl_c, echo_c = _rows_of(RL, ECHO, ENV, idx, m, env, main, HAS_ENV)
        rl_count += rl_c.to(tl.int32)
        echo_count += echo_c.to(tl.int32)
    n_rl = tl.reduce(rl_count, 0, _sum).to(tl.float32)
    n_echo = tl.reduce(echo_count, 0, _sum).to(tl.float32)
    if RL_DIV_MODE == 0:
        rl_div = tl.maximum(n_rl, 1.0)
    elif RL_DIV_MODE == 1:
        rl_div = rl_div_value
    elif RL_DIV_MODE == 2:
        rl_div = tl.load(RL_DIV).to(tl.float32)
    else:
        rl_div = tl.maximum(tl.load(SEQS + 0).to(tl.float32), 1.0)
    # the echo divisor given (a host value or a device tensor), else 1 (batch_token_mean: the
    # count of batches multiplying the call's echo rows)
    if ECHO_DIV_MODE == 2:  # noqa: SIM108 (a constexpr branch, not a runtime select)
        echo_given = tl.load(ECHO_DIV).to(tl.float32)
    else:
        echo_given = echo_div_value
    if ECHO_MODE == 1:
        echo_div = 1.0
    elif ECHO_MODE == 2:
        echo_div = tl.maximum(n_echo, 1.0) * echo_given
    elif ECHO_DIV_MODE != 0:
        echo_div = echo_given
    elif ECHO_MODE == 0:
        echo_div = tl.maximum(n_echo, 1.0)
    else:
        echo_div = tl.maximum(tl.load(SEQS + 1).to(tl.float32), 1.0)

    # ---- loop 2: per-row terms, derivatives, sums
    rl_acc = tl.full([BLOCK], 0, tl.float32)
    echo_acc = tl.full([BLOCK], 0, tl.float32)
    nll_acc = tl.full([BLOCK], 0, tl.float32)
    nll_max = tl.full([BLOCK], float("-inf"), tl.float32)
    kl_acc = tl.full([BLOCK], 0, tl.float64)
    ent_acc = tl.full([BLOCK], 0, tl.float32)
    f0 = tl.full([BLOCK], 0, tl.int32)
    f1 = tl.full([BLOCK], 0, tl.int32)
    f2 = tl.full([BLOCK], 0, tl.int32)
    f3 = tl.full([BLOCK], 0, tl.int32)
    fm = tl.full([BLOCK], 0, tl.int32)
    w_acc = tl.full([BLOCK], 0, tl.float32)
    ref_acc = tl.full([BLOCK], 0, tl.float32)
    bad_count = tl.full([BLOCK], 0, tl.int32)
    first_s = n
    value_s = 0.0
    first_p = n
    value_p = 0.0
    first_e = n
    value_e = 0.0
    first_l = n
    value_l = tl.full([], 0, tl.int64)
    for start in range(0, n, BLOCK):
        idx = start + offs
        m = idx < n
        rl, echo = _rows_of(RL, ECHO, ENV, idx, m, env, main, HAS_ENV)
        lp = tl.load(LP + idx, mask=m, other=0.0)
        lp_rl = tl.where(rl, lp, 0.0)
        lp_echo = tl.where(echo, lp, 0.0)
        # per-row divisors of the per-sequence normalisers: every row has a sequence (its
        # start position) and every sequence its counts (written by the groups program)
        if SEQ:
            grp = tl.load(GROUP + idx, mask=m, other=0)
        if RL_PER_SEQ:
            rl_seq = tl.maximum(tl.load(CNT_RL + grp, mask=m, other=1).to(tl.float32), 1.0)
        # echo rows: w · (-log p), no ratio, trust region or advantage
        if HAS_W:
            w = tl.where(echo, tl.load(W + idx, mask=m, other=0.0).to(tl.float32), 0.0)
        else:
            w = tl.full([BLOCK], 0, tl.float32)
        nll = -lp_echo
        if ECHO_MODE == 3:  # sequence_mean: over Z_i + ε of the row's sequence (≥ 1: its own row)
            z_row = tl.load(CNT_Z + grp, mask=m, other=1).to(tl.float32) + z_eps
            z_seq = tl.where(echo, z_row, 1.0)  # other rows: 0 / 1, never 0 / 0
            echo_acc += w * nll / z_seq
            a = tl.where(echo, -w / z_seq / echo_div, 0.0)
        else:
            echo_acc += w * nll
            a = tl.where(echo, -w / echo_div, 0.0)
        nll_acc += nll
        nll_max = _nan_max(nll_max, tl.where(echo, nll, float("-inf")))
        if CHECK:
            part = rl | echo
            bad = part & _not_finite(lp)
            if LP_GIVEN:
                bad = bad | (part & (lp > lp_tolerance))
            bad_count += bad.to(tl.int32)
            first_s, value_s = _first_bad(bad, idx, lp, first_s, value_s, n)
        if CHECK_LABELS:
            lab = tl.load(LABELS + idx, mask=m, other=0).to(tl.int64)
            bad_l = (rl | echo) & ((lab < 0) | (lab >= vocab))
            blk = tl.reduce(tl.where(bad_l, idx, n), 0, _min)
            blk_lab = tl.reduce(tl.where(idx == blk, lab, 0), 0, _sum)
            value_l = tl.where(blk < first_l, blk_lab, value_l)
            first_l = tl.minimum(first_l, blk)
        if HAS_ENT:
            ent = tl.load(ENT + idx, mask=m, other=0.0).to(tl.float32)
            ent_rl = tl.where(rl, ent, 0.0)
            if ENT_METRIC:
                ent_acc += ent_rl
        # RL rows
        if POLICY == 4:  # sft: the NLL of the RL rows
            per = -lp_rl
            d = tl.where(rl, -1.0, 0.0)
        else:
            if HAS_ADV:
                at = _offset(idx, adv_inner, adv_s_outer, adv_s_inner, ADV_FLAT)
                adv = tl.where(rl, tl.load(ADV + at, mask=m, other=0.0).to(tl.float32), 0.0)
                adv = adv * adv_tau
            else:
                adv = tl.full([BLOCK], 0, tl.float32)
            if BASE == 1:
                base = tl.where(rl, tl.load(OLD + idx, mask=m, other=0.0).to(tl.float32), 0.0)
            elif BASE == 2:
                base = tl.where(rl, tl.load(LQ + idx, mask=m, other=0.0).to(tl.float32), 0.0)
            else:
                base = lp_rl
            log_ratio = lp_rl - base
            if POLICY == 0:  # dppo: tokens outside the probability trust region are dropped
                delta = tl.exp(lp_rl) - tl.exp(base)
                pos = adv > 0
                dropped = tl.where(pos, delta > high, delta < -low)
                keep = ~dropped
                lr = tl.where(keep, log_ratio, 0.0)
                x, gx = _clamp_grad(lr, clamp, HAS_CLAMP)
                r = tl.exp(x)
                keep_f = tl.where(keep, 1.0, 0.0)
                pol = -(keep_f * adv * r)
                d = tl.where(keep, -(adv * r) * gx, 0.0)
                f0 += (dropped & rl).to(tl.int32)
                f1 += (dropped & (adv < 0) & rl).to(tl.int32)
                f2 += (dropped & pos & rl).to(tl.int32)
            elif POLICY == 1:  # ppo_clip (+ dual clip)
                x, gx = _clamp_grad(log_ratio, clamp, HAS_CLAMP)
                r = tl.exp(x)
                lo_b = 1.0 - low
                hi_b = 1.0 + high
                rc = _nan_min(_nan_max(r, lo_b), hi_b)
                gc = tl.where((r >= lo_b) & (r <= hi_b), 1.0, 0.0)
                t1 = r * adv
                t2 = rc * adv
                obj = _nan_min(t1, t2)
                w1 = tl.where(t1 < t2, 1.0, tl.where(t1 == t2, 0.5, 0.0))
                w2 = tl.where(t2 < t1, 1.0, tl.where(t1 == t2, 0.5, 0.0))
                dobj = w1 * adv + w2 * adv * gc  # d obj / d r
                hi_f = (adv > 0) & (r > hi_b)
                lo_f = (adv < 0) & (r < lo_b)
                f0 += ((hi_f | lo_f) & rl).to(tl.int32)
                f1 += (lo_f & rl).to(tl.int32)
                f2 += (hi_f & rl).to(tl.int32)
                if DUAL:
                    neg = adv < 0
                    floor = dual_c * adv
                    f3 += (neg & (obj < floor) & rl).to(tl.int32)
                    wd = tl.where(obj > floor, 1.0, tl.where(obj == floor, 0.5, 0.0))
                    dobj = tl.where(neg, wd * dobj, dobj)
                    obj = tl.where(neg, _nan_max(obj, floor), obj)
                pol = -obj
                # a clipped row's 0 stays 0 where r overflows (autograd's 0·inf would be NaN)
                d = tl.where(dobj == 0, 0.0, -dobj * r * gx)
            elif POLICY == 2 or POLICY == 6:
                # cispo: a clipped, detached weight times the REINFORCE term (6: the weight of
                # the sequence's ratio; detached, so no derivative through it)
                if POLICY == 6:
                    x, _, _ = _sequence_ratio(SUM_IN, CNT_RL, grp, m, clamp, HAS_CLAMP)
                else:
                    x, _ = _clamp_grad(log_ratio, clamp, HAS_CLAMP)
                r = tl.exp(x)
                if HAS_LOW:
                    wgt = _nan_min(_nan_max(r, low), high)
                    lo_f = r < low
                else:
                    wgt = _nan_min(r, high)
                    lo_f = r < float("-inf")  # never, NaN included
                hi_f = r > high
                pol = -(wgt * adv * lp_rl)
                d = -(wgt * adv)
                f0 += ((hi_f | lo_f) & rl).to(tl.int32)
                f1 += (lo_f & rl).to(tl.int32)
                f2 += (hi_f & rl).to(tl.int32)
            elif POLICY == 7:  # sapo: -σ(τ·(r − 1))·4/τ·A, τ = high for A > 0, else low
                x, gx = _clamp_grad(log_ratio, clamp, HAS_CLAMP)
                r = tl.exp(x)
                tau = tl.where(adv > 0, high, low)
                gate = _sigmoid(tau * (r - 1.0))
                pol = -(gate * (4.0 / tau)) * adv
                # d/dr = −(4/τ)·A·τ·σ(1 − σ), times r: σ(1 − σ)·r without overflow
                d = -4.0 * adv * _sapo_slope(x, tau) * gx
            elif POLICY == 8:  # sapo_sequence: sapo's gate on the sequence's ratio
                x, gx, cnt_g = _sequence_ratio(SUM_IN, CNT_RL, grp, m, clamp, HAS_CLAMP)
                s = tl.exp(x)
                gate_pos = _sigmoid(high * (s - 1.0))
                gate_neg = _sigmoid(low * (s - 1.0))
                pos = adv > 0
                pol = -(tl.where(pos, gate_pos * (4.0 / high), gate_neg * (4.0 / low))) * adv
                # as gspo's below: Σ_t w_t·∂pol_t/∂s over the sequence's RL rows is
                # −4·(σ⁺(1 − σ⁺)·Σ w·A⁺ + σ⁻(1 − σ⁻)·Σ w·A⁻), times ∂s/∂ℓ = s·gx/|RL_i|
                # (σ(1 − σ)·s in the form that cannot overflow)
                q = _sapo_slope(x, high) * tl.load(
                    SUM_IN + n + grp, mask=m, other=0.0
                ) + _sapo_slope(x, low) * tl.load(SUM_IN + 2 * n + grp, mask=m, other=0.0)
                q = tl.where(s != s, s, q)  # a NaN ratio: a NaN gradient, as autograd's
                d = -4.0 * q * gx / cnt_g
            elif POLICY == 5:  # gspo: ppo_clip's objective on the sequence's ratio
                x, gx, cnt_g = _sequence_ratio(SUM_IN, CNT_RL, grp, m, clamp, HAS_CLAMP)
                s = tl.exp(x)
                lo_b = 1.0 - low
                hi_b = 1.0 + high
                obj = _nan_min(s * adv, _nan_min(_nan_max(s, lo_b), hi_b) * adv)
                pol = -obj
                hi_f = (adv > 0) & (s > hi_b)
                lo_f = (adv < 0) & (s < lo_b)
                f0 += ((hi_f | lo_f) & rl).to(tl.int32)
                f1 += (lo_f & rl).to(tl.int32)
                f2 += (hi_f & rl).to(tl.int32)
                # Every RL row of the sequence gets d/dℓ of all its rows' losses through s:
                # Σ_t w_t·∂obj_t/∂s = Σ w·A⁺·[s ≤ 1+ε_hi] + Σ w·A⁻·[s ≥ 1−ε_lo] (autograd's
                # min/clamp conventions: equal branches inside the range give the full A),
                # times ∂s/∂ℓ = s·gx/|RL_i| (the normaliser is the same for the whole sequence)
                k_pos = tl.where(s <= hi_b, 1.0, 0.0)
                k_neg = tl.where(s >= lo_b, 1.0, 0.0)
                q = k_pos * tl.load(SUM_IN + n + grp, mask=m, other=0.0) + k_neg * tl.load(
                    SUM_IN + 2 * n + grp, mask=m, other=0.0
                )
                q = tl.where(s != s, s, q)  # a NaN ratio: a NaN gradient, as autograd's
                d = tl.where(q == 0, 0.0, -q * s * gx / cnt_g)  # no 0·inf past the float range
            else:  # reinforce; a code of ROW_POLICIES without its branch above fails to compile
                tl.static_assert(POLICY == 3, "a policy of ROW_POLICIES has no branch here")
                pol = -(adv * lp_rl)
                d = -adv
            pol = tl.where(rl, pol, 0.0)
            d = tl.where(rl, d, 0.0)
            if CHECK:
                first_p, value_p = _first_bad(rl & _not_finite(pol), idx, pol, first_p, value_p, n)
            per = pol
            if MISMATCH != 0:
                # the detached weight exp(clamp(b₀ − lq)) of the policy loss (of the sequence's
                # Σ (b₀ − lq) for the sequence modes), truncated or masked
                if MISMATCH <= 2:
                    lq_m = tl.where(rl, tl.load(LQ + idx, mask=m, other=0.0).to(tl.float32), 0.0)
                    log_w = base - lq_m
                else:
                    log_w = tl.where(rl, tl.load(SUM_IN + 3 * n + grp, mask=m, other=0.0), 0.0)
                wm, outside = _mismatch_weight(log_w, clamp, mm_max, mm_min, 2 - MISMATCH % 2,
                                               HAS_MM_MIN, HAS_CLAMP)  # fmt: skip
                per = per * wm
                if (POLICY != 5 and POLICY != 8) or MISMATCH >= 3:
                    # (the token weights of gspo's and sapo_sequence's are inside their sums)
                    d = d * wm
                fm += (outside & rl).to(tl.int32)
                w_acc += tl.where(rl, wm, 0.0)
            if HAS_KL_TAU:
                # kl_tau · ρ², continued linearly beyond the clamp (d = 2ρ, or 2c·sign(ρ))
                if HAS_CLAMP:
                    ab = tl.abs(log_ratio)
                    inside = ab <= clamp
                    pen = tl.where(inside, log_ratio * log_ratio, 2.0 * clamp * ab - clamp * clamp)
                    sgn = tl.where(log_ratio > 0, 1.0, tl.where(log_ratio < 0, -1.0, 0.0))
                    dpen = tl.where(inside, 2.0 * log_ratio, 2.0 * clamp * sgn)
                else:
                    pen = log_ratio * log_ratio
                    dpen = 2.0 * log_ratio
                per = per + kl_tau * pen
                d = d + tl.where(rl, kl_tau * dpen, 0.0)
            if HAS_KL_COEF:
                # the reference KL of dr = ref − ℓ; d/dℓ = −d/d(dr)
                ref = tl.where(rl, tl.load(REF + idx, mask=m, other=0.0).to(tl.float32), 0.0)
                dr = ref - lp_rl
                if KL_EST == 1:
                    kl = -dr
                    dkl = tl.full([BLOCK], 1.0, tl.float32)
                elif KL_EST == 2:
                    kl = 0.5 * dr * dr
                    dkl = -dr
                else:
                    # exp(x) − x − 1 and its derivative exp(x) − 1 in fp64, series below 1e-3
                    xr, gr = _clamp_grad(dr, clamp, HAS_CLAMP)
                    x64 = xr.to(tl.float64)
                    small = tl.abs(x64) < 1e-3
                    em1 = tl.where(
                        small,
                        x64 * (1.0 + x64 * (0.5 + x64 * (1.0 / 6.0 + x64 * (1.0 / 24.0)))),
                        tl.exp(x64) - 1.0,
                    )
                    series = x64 * x64 * (0.5 + x64 * (1.0 / 6.0 + x64 * (1.0 / 24.0)))
                    kl = tl.where(small, series, em1 - x64).to(tl.float32)
                    dkl = -(em1.to(tl.float32)) * gr
                per = per + kl_coef * kl
                d = d + tl.where(rl, kl_coef * dkl, 0.0)
                ref_acc += tl.where(rl, kl, 0.0)
            if TRAIN_ENT:  # (HAS_ENT is then true: op.py requires the entropy)
                per = per - ent_coef * ent_rl
                if RL_PER_SEQ:
                    b_row = -ent_coef / rl_div / rl_seq
                else:
                    b_row = tl.full([BLOCK], -ent_coef / rl_div, tl.float32)
                tl.store(B + idx, tl.where(rl, b_row, 0.0), mask=idx < n_main)
                if CHECK:
                    first_e, value_e = _first_bad(
                        rl & _not_finite(ent), idx, ent, first_e, value_e, n
                    )
            if HAS_LQ:
                # mismatch_kl = exp(x) - x - 1 of x = lp - lq, in fp64 (a series below 1e-3,
                # where exp(x) - 1 would cancel)
                lq = tl.where(rl, tl.load(LQ + idx, mask=m, other=0.0).to(tl.float32), 0.0)
                xk, _ = _clamp_grad(lp_rl - lq, clamp, HAS_CLAMP)
                x64 = xk.to(tl.float64)
                series = x64 * x64 * (0.5 + x64 * (1.0 / 6.0 + x64 * (1.0 / 24.0)))
                k3 = tl.where(tl.abs(x64) < 1e-3, series, tl.exp(x64) - x64 - 1.0)
                kl_acc += tl.where(rl, k3.to(tl.float32).to(tl.float64), 0.0)
        if RL_PER_SEQ:
            rl_acc += per / rl_seq
            a = tl.where(rl, d / rl_div / rl_seq, a)
        else:
            rl_acc += per
            a = tl.where(rl, d / rl_div, a)
        tl.store(A + idx, a, mask=idx < n_main)

    rl_term = tl.reduce(rl_acc, 0, _sum) / rl_div
    if ECHO_MODE == 2:
        echo_term = tl.reduce(echo_acc, 0, _sum) / tl.maximum(n_echo, 1.0) / echo_given
    else:
        echo_term = tl.reduce(echo_acc, 0, _sum) / echo_div
    loss = rl_term + echo_term
    tl.store(LOSS, loss, mask=main)
    rl_den = tl.maximum(n_rl, 1.0)
    ROW_STATS = STATS + pid * NUM_STATS
    # an env's row holds metrics only: its loss slots are 0
    tl.store(ROW_STATS + 0, tl.where(main, loss, 0.0))
    tl.store(ROW_STATS + 1, tl.where(main, rl_term, 0.0))
    tl.store(ROW_STATS + 2, tl.where(main, echo_term, 0.0))
    tl.store(ROW_STATS + 3, n_rl)
    tl.store(ROW_STATS + 4, n_echo)
    tl.store(ROW_STATS + 5, tl.reduce(nll_acc, 0, _sum) / tl.maximum(n_echo, 1.0))
    # the maximum of the lanes, NaN if one is (the reductions' fast max drops NaN)
    nll_nan = tl.reduce(tl.where(nll_max != nll_max, 1, 0), 0, _sum) > 0
    nll_top = tl.where(nll_nan, float("nan"), tl.reduce(nll_max, 0, _max))
    tl.store(ROW_STATS + 6, tl.where(n_echo > 0, nll_top, 0.0))
    tl.store(ROW_STATS + 7, (tl.reduce(kl_acc, 0, _sum) / rl_den).to(tl.float32))
    tl.store(ROW_STATS + 8, tl.reduce(ent_acc, 0, _sum) / rl_den)
    tl.store(ROW_STATS + 9, tl.reduce(f0, 0, _sum).to(tl.float32) / rl_den)
    tl.store(ROW_STATS + 10, tl.reduce(f1, 0, _sum).to(tl.float32) / rl_den)
    tl.store(ROW_STATS + 11, tl.reduce(f2, 0, _sum).to(tl.float32) / rl_den)
    tl.store(ROW_STATS + 12, tl.reduce(f3, 0, _sum).to(tl.float32) / rl_den)
    if SEQ:  # the call's sequence counts (the main program's row; an env's reads 0)
        tl.store(ROW_STATS + 13, tl.where(main, tl.load(SEQS + 0).to(tl.float32), 0.0))
        tl.store(ROW_STATS + 14, tl.where(main, tl.load(SEQS + 1).to(tl.float32), 0.0))
    else:
        tl.store(ROW_STATS + 13, 0.0)
        tl.store(ROW_STATS + 14, 0.0)
    tl.store(ROW_STATS + 15, tl.reduce(w_acc, 0, _sum) / rl_den)
    tl.store(ROW_STATS + 16, tl.reduce(ref_acc, 0, _sum) / rl_den)
    tl.store(ROW_STATS + 17, tl.reduce(fm, 0, _sum).to(tl.float32) / rl_den)
    if CHECK:
        s_bad = first_s < n
        row_s = tl.where(s_bad, first_s, 0)
        tl.store(CHECKS + 0, tl.where(s_bad, 1, 0).to(tl.float64), mask=main)
        tl.store(CHECKS + 1, row_s.to(tl.float64), mask=main)
        tl.store(CHECKS + 2, tl.reduce(bad_count, 0, _sum).to(tl.float64), mask=main)
        tl.store(CHECKS + 3, value_s.to(tl.float64), mask=main)  # type: ignore[attr-defined]
        rl_at = tl.load(RL + row_s, mask=n > 0, other=0) != 0
        tl.store(CHECKS + 4, tl.where(rl_at, 1.0, 0.0).to(tl.float64), mask=main)
        p_bad = first_p < n
        tl.store(CHECKS + 5, tl.where(p_bad, 1, 0).to(tl.float64), mask=main)
        tl.store(CHECKS + 6, tl.where(p_bad, first_p, 0).to(tl.float64), mask=main)
        tl.store(CHECKS + 7, value_p.to(tl.float64), mask=main)  # type: ignore[attr-defined]
        e_bad = first_e < n
        tl.store(CHECKS + 8, tl.where(e_bad, 1, 0).to(tl.float64), mask=main)
        tl.store(CHECKS + 9, tl.where(e_bad, first_e, 0).to(tl.float64), mask=main)
        tl.store(CHECKS + 10, value_e.to(tl.float64), mask=main)  # type: ignore[attr-defined]
        tl.store(CHECKS + 11, tl.where(_not_finite(loss), 1.0, 0.0).to(tl.float64), mask=main)
        tl.store(CHECKS + 12, loss.to(tl.float64), mask=main)
        tl.store(CHECKS + 13, rl_term.to(tl.float64), mask=main)
        tl.store(CHECKS + 14, echo_term.to(tl.float64), mask=main)
    if CHECK_LABELS:
        l_bad = first_l < n
        tl.store(CHECKS + 15, tl.where(l_bad, 1, 0).to(tl.float64), mask=main)
        tl.store(CHECKS + 16, tl.where(l_bad, first_l, 0).to(tl.float64), mask=main)
        tl.store(CHECKS + 17, value_l.to(tl.float64), mask=main)


def interpreter_active() -> bool:
    """Whether the kernel of this module was defined under the Triton interpreter.

    Examples:
        >>> isinstance(interpreter_active(), bool)
        True
    """
    return type(_row_algebra_kernel).__name__ == "InterpretedFunction"


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cuda" or (t.device.type == "cpu" and interpreter_active()):
        return
    raise RuntimeError(
        f"the fused row algebra runs on CUDA devices (or on cpu under TRITON_INTERPRET=1, set "
        f"before echoloss is imported); the logprobs are on {t.device}: use backend='naive'"
    )


def _flat(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    return dummy if t is None else t.reshape(-1)


def _mask(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # bool → uint8 without a copy or a launch


def _in_place(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the program reads it in place: a ``[B, T]`` view as it is, anything else as
    ``[N]`` (a view where one stride walks it, else a copy)."""
    return t if t.dim() == 2 and t.shape[1] > 0 else t.reshape(-1)


def _layout(t: torch.Tensor) -> tuple[int, int, int, bool]:
    """``(inner, stride_outer, stride_inner, one_stride)`` through which `_offset` reads a
    field `_in_place`: a ``[B, T]`` view (e.g. ``arange(B)`` or ``[B]`` advantages expanded
    over ``T``: strides ``(1, 0)``), or a 1-D tensor (one stride)."""
    if t.dim() == 2:
        inner = t.shape[1]
        s_outer, s_inner = t.stride()
        return inner, s_outer, s_inner, s_outer == inner * s_inner or t.shape[0] <= 1
    return max(t.numel(), 1), 0, t.stride(0), True


#: A layout of a tensor that is not read (a placeholder pointer).
_NO_LAYOUT: tuple[int, int, int, bool] = (1, 0, 1, True)


def _sequence_groups(
    lp: torch.Tensor, rows: RowInputs, p: RowAlgebraParams, base: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(GROUP, CNT_RL, CNT_Z, SEQS, SUM)`` of the sequence-level quantities: one sort of the
    ids and one launch (`_sequence_groups_kernel`); no host read. ``SUM`` ``[4, N]`` (written
    for the sequence-level ratios and mismatch corrections only) holds each sequence's sums of
    its RL rows' ``ρ``, ``w·A⁺``, ``w·A⁻`` and ``b₀ − lq``."""
    assert rows.sequence_ids is not None  # op.py
    ids = rows.sequence_ids
    n = ids.numel()
    dev = ids.device
    if rows.sequences_in_order:  # already sorted (the caller built them so): no sort, no copy
        ids = _in_place(ids)
        sorted_ids, order = ids, ids  # ORDER unread
        layout = _layout(ids)
    else:  # equal ids end up adjacent; their order is free
        sorted_ids, order = torch.sort(ids.reshape(-1))
        layout = _layout(sorted_ids)
    group = torch.empty(n, dtype=torch.int32, device=dev)
    cnt_rl = torch.empty(n, dtype=torch.int32, device=dev)
    cnt_z = torch.empty(n, dtype=torch.int32, device=dev)
    seqs = torch.empty(2, dtype=torch.int32, device=dev)
    sums_needed = p.reads_sequence_sums
    sums = torch.empty((4, n) if sums_needed else (0,), dtype=torch.float32, device=dev)
    obs = rows.observation
    token_mm = p.mismatch if p.mismatch in ("token_truncate", "token_mask") else None
    adv, adv_layout = _advantages(rows, lp)
    with on_tensor_device(ids):
        _sequence_groups_kernel[(1,)](
            sorted_ids,
            order,
            _mask(rows.rl),
            _mask(rows.echo),
            _mask(obs) if obs is not None else _mask(rows.echo),
            group,
            cnt_rl,
            cnt_z,
            seqs,
            lp,
            _flat(rows.old_logprobs, lp),
            _flat(rows.inference_logprobs, lp),
            adv,
            sums if sums_needed else lp,
            n,
            *layout[:3],
            *adv_layout[:3],
            float(p.adv_tau),
            float(p.log_ratio_clamp or 0.0),
            float(p.mismatch_max),
            float(p.mismatch_min or 0.0),
            ID_FLAT=layout[3],
            ADV_FLAT=adv_layout[3],
            HAS_OBS=obs is not None,
            SUMS=sums_needed,
            BASE=base,
            HAS_LQ=rows.inference_logprobs is not None,
            HAS_ADV=rows.advantages is not None,
            TOKEN_MM=_MISMATCH_CODE[token_mm],
            HAS_MM_MIN=p.mismatch_min is not None,
            HAS_CLAMP=p.log_ratio_clamp is not None,
            IN_ORDER=rows.sequences_in_order,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return group, cnt_rl, cnt_z, seqs, sums


def _bounds(p: RowAlgebraParams) -> tuple[float, float]:
    """The program's ``(low, high)``: the policy's bounds (`RowAlgebraParams.bounds`; sapo's
    ``(τ⁻, τ⁺)``), 0 where unread."""
    low, high = p.bounds
    return float(low or 0.0), float(high or 0.0)


def _advantages(
    rows: RowInputs, lp: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, int, int, bool]]:
    """The advantages as the programs read them in place (`_in_place`) and their layout (a
    placeholder without advantages)."""
    if rows.advantages is None:
        return lp, _NO_LAYOUT
    adv = _in_place(rows.advantages)
    return adv, _layout(adv)


def forward(
    lp: torch.Tensor, ent: torch.Tensor | None, rows: RowInputs, p: RowAlgebraParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(loss, a [N], b [N] or None, stats [1 + envs, K], checks)`` in one launch: see
    ``op.py``. With envs the grid has one program more per env (their metrics, in parallel)."""
    _check_device(lp)
    n = lp.numel()
    dev = lp.device
    a = torch.empty(n, dtype=torch.float32, device=dev)
    train_ent = p.entropy_coef != 0
    b = torch.empty(n, dtype=torch.float32, device=dev) if train_ent else None
    loss = torch.empty((), dtype=torch.float32, device=dev)
    envs = rows.num_envs if rows.env_of_row is not None else 0
    stats = torch.empty(1 + envs, len(STAT_SLOTS), dtype=torch.float32, device=dev)
    checks = torch.empty(len(CHECK_SLOTS), dtype=torch.float64, device=dev)
    if not p.check_finite or rows.labels is None:
        checks.zero_()  # slots of the checks not computed read "passed"
    # the ratio's base: the old logprobs, else the inference logprobs (prime-rl), else the
    # row's own (on-policy; with a mismatch correction the inference logprobs only weigh)
    if rows.old_logprobs is not None:
        base = 1
    elif rows.inference_logprobs is not None and p.mismatch is None:
        base = 2
    else:
        base = 0
    groups = _sequence_groups(lp, rows, p, base) if p.reads_sequences else None
    if rows.rl_divisor is not None:
        rl_div_mode = 2
    elif p.rl_divisor is not None:
        rl_div_mode = 1
    else:
        rl_div_mode = 0 if p.rl_normalization == "token" else 3
    # 2: the device divisor, 1: the host one, 0: the call's own count
    echo_div_mode = 2 if rows.echo_divisor is not None else (0 if p.echo_divisor is None else 1)
    echo_div = 1.0 if p.echo_divisor is None else float(p.echo_divisor)
    clamp = p.log_ratio_clamp
    adv, adv_layout = _advantages(rows, lp)
    with on_tensor_device(lp):
        _row_algebra_kernel[(1 + envs,)](
            lp,
            _flat(ent, lp),
            _mask(rows.rl),
            _mask(rows.echo),
            _flat(rows.echo_weights, lp),
            adv,
            _flat(rows.old_logprobs, lp),
            _flat(rows.inference_logprobs, lp),
            _flat(rows.rl_divisor, lp),
            _flat(rows.echo_divisor, lp),
            _flat(rows.labels, lp),
            _flat(rows.env_of_row, lp),
            *(groups[:4] if groups is not None else (lp, lp, lp, lp)),
            _flat(rows.ref_logprobs, lp),
            lp if groups is None else groups[4],
            a,
            a if b is None else b,
            loss,
            stats,
            checks,
            n,
            float(p.adv_tau),
            *_bounds(p),
            float(p.dual_clip_read or 0.0),
            float(clamp or 0.0),
            float(p.kl_tau),
            float(p.entropy_coef),
            1.0 if p.rl_divisor is None else float(p.rl_divisor),
            echo_div,
            float(p.echo_z_epsilon),
            float(p.mismatch_max),
            float(p.mismatch_min or 0.0),
            float(p.kl_coef),
            float(p.logprob_tolerance),
            int(rows.vocab_size),
            *adv_layout[:3],
            ADV_FLAT=adv_layout[3],
            POLICY=_POLICY_CODE[p.policy],
            HAS_LOW=p.low is not None,
            DUAL=p.dual_clip_read is not None,
            HAS_CLAMP=clamp is not None,
            HAS_KL_TAU=p.kl_tau != 0,
            HAS_ENT=ent is not None,
            TRAIN_ENT=train_ent,
            ENT_METRIC=p.entropy_metric,
            HAS_W=rows.echo_weights is not None,
            HAS_ADV=rows.advantages is not None,
            BASE=base,
            HAS_LQ=p.mismatch_metric,
            RL_DIV_MODE=rl_div_mode,
            RL_PER_SEQ=p.rl_normalization == "sequence_mean_token_mean",
            ECHO_MODE=_ECHO_CODE[p.echo_normalization],
            SEQ=groups is not None,
            MISMATCH=_MISMATCH_CODE[p.mismatch],
            HAS_MM_MIN=p.mismatch_min is not None,
            HAS_KL_COEF=p.kl_coef != 0,
            KL_EST=_KL_CODE[p.kl_estimator],
            ECHO_DIV_MODE=echo_div_mode,
            CHECK=p.check_finite,
            LP_GIVEN=p.logprobs_given,
            CHECK_LABELS=rows.labels is not None,
            HAS_ENV=envs > 0,
            NUM_STATS=len(STAT_SLOTS),
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
    return loss, a, b, stats, checks
