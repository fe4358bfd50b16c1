"""The kernel tests' vectorised interpreter scan (``_interpreter_scan.py``) against the
interpreter's own element-by-element scan, on the row program's combine functions.

Integer and boolean scans (counts, running maxima, segment-start flags) must be bit-identical;
the segmented float sum within the sum bound of a different addition order: each output is a
sum of at most ``n`` terms, and any two orders of it are within ``2·(n-1)·eps·Σ|terms|`` of each
other (each within ``(n-1)·eps·Σ|terms|`` of the exact sum). Values are multiples of 1/8 in one
case, so every partial sum is exact in fp32 and the two must agree bit for bit there too.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl
from _fused_cases import HAS_CUDA
from _interpreter_scan import install

from echoloss.ops.row_algebra.fused import _max_local, _segmented_combine, _sum_local

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the interpreter's scan: CPU only")

BLOCK = 256


def _scans_body(FIRST, VALUES, COUNTS, OUT_FIRST, OUT_SUM, OUT_COUNT, OUT_MAX, B: tl.constexpr):
    offs = tl.arange(0, B)
    first = tl.load(FIRST + offs)
    values = tl.load(VALUES + offs)
    counts = tl.load(COUNTS + offs)
    starts, sums = tl.associative_scan((first, values), 0, _segmented_combine)
    tl.store(OUT_FIRST + offs, starts)
    tl.store(OUT_SUM + offs, sums)
    tl.store(OUT_COUNT + offs, tl.associative_scan(counts, 0, _sum_local))
    tl.store(OUT_MAX + offs, tl.associative_scan(tl.where(first != 0, offs, -1), 0, _max_local))


@functools.cache
def _scans_kernel():
    """The kernel, interpreted: ``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        return triton.jit(_scans_body)


def _scans(first, values, counts, *, vectorised: bool):
    from triton.runtime import interpreter

    assert install()
    ops = interpreter.ScanOps
    fast = ops.generic_scan
    out = (torch.empty_like(first), torch.empty_like(values), torch.empty_like(counts))
    out_max = torch.empty(BLOCK, dtype=torch.int32)
    try:
        if not vectorised:
            ops.generic_scan = ops.element_by_element_scan
        _scans_kernel()[(1,)](first, values, counts, *out, out_max, B=BLOCK)
    finally:
        ops.generic_scan = fast
    return (*out, out_max)


def _inputs(seed: int, *, eighths: bool):
    g = torch.Generator().manual_seed(seed)
    first = (torch.rand(BLOCK, generator=g) < 0.1).to(torch.int32)
    if eighths:
        values = torch.randint(-40, 41, (BLOCK,), generator=g).float() / 8
    else:
        values = torch.randn(BLOCK, generator=g) * 10 ** torch.randint(-3, 4, (BLOCK,), generator=g)
    counts = torch.randint(0, 3, (BLOCK,), generator=g, dtype=torch.int32)
    return first, values, counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_scan_equals_the_interpreters(seed, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for eighths in (True, False):
        first, values, counts = _inputs(seed, eighths=eighths)
        fast = _scans(first, values, counts, vectorised=True)
        slow = _scans(first, values, counts, vectorised=False)
        assert torch.equal(fast[0], slow[0]), "segment-start flags"
        assert torch.equal(fast[2], slow[2]), "integer running sum"
        assert torch.equal(fast[3], slow[3]), "running maximum"
        if eighths:
            assert torch.equal(fast[1], slow[1]), "exact segmented sums"
        else:
            # Σ|terms| of each output's segment: the segmented sum of |values|, in fp64.
            abs_sums = _segmented_abs_sums(first.numpy(), values.double().abs().numpy())
            tol = 2 * (BLOCK - 1) * torch.finfo(torch.float32).eps * torch.from_numpy(abs_sums)
            diff = (fast[1].double() - slow[1].double()).abs()
            assert torch.all(diff <= tol), f"segmented sums: max diff {float(diff.max())}"


def test_segmented_sum_by_hand(monkeypatch):
    """Segments start at positions 0, 3 and 4: sums restart there and carry elsewhere."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    first = torch.zeros(BLOCK, dtype=torch.int32)
    first[[0, 3, 4]] = 1
    values = torch.zeros(BLOCK)
    values[:6] = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    counts = torch.ones(BLOCK, dtype=torch.int32)
    starts, sums, running, last_start = _scans(first, values, counts, vectorised=True)
    assert sums[:6].tolist() == [1.0, 3.0, 7.0, 8.0, 16.0, 48.0]
    assert float(sums[-1]) == 48.0  # the last segment runs to the block's end
    assert running.tolist() == list(range(1, BLOCK + 1))
    assert last_start[:6].tolist() == [0, 0, 0, 3, 4, 4]
    assert bool(starts.all())


def _segmented_abs_sums(first: np.ndarray, magnitudes: np.ndarray) -> np.ndarray:
    out = np.empty_like(magnitudes)
    running = 0.0
    for i, (f, m) in enumerate(zip(first, magnitudes, strict=True)):
        running = m if (f or i == 0) else running + m
        out[i] = running
    return out
