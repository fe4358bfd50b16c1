"""Kernel tests: Triton interpreter on CPU and NaN-poisoned ``torch.empty``.

Without CUDA the fused kernels run under the Triton interpreter. ``triton.jit`` decides between
the compiled and the interpreted kernel when the kernel is *defined* (``TRITON_INTERPRET`` is
read at import of ``fused.py``), so ``fused.py`` is imported here, at collection time, with the
variable set, and re-imported if something imported it before. The variable itself is set only
while a test of this folder runs (``resolve_backend`` reads it at call time), so the rest of the
suite still sees ``backend="triton"`` refused on CPU.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch
import torch._dynamo
from _fused_cases import HAS_CUDA, HAS_TRITON, INTERPRETER_BLOCK_V

# torch._dynamo is imported above, before `poison_empty` patches torch.empty: its tables record
# the torch functions when it is first imported (which a TorchDispatchMode does lazily, e.g.
# benchmarks/counting.py's), and a wrapper recorded there breaks every later compiled graph of
# the process at torch.empty.

if HAS_TRITON and not HAS_CUDA:
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for _name in (
            "echoloss.ops.selective_logprobs.fused",
            "echoloss.ops.row_algebra.fused",
            "echoloss.ops.value_checks.fused",
        ):
            _fused = importlib.import_module(_name)
            if not _fused.interpreter_active():  # imported earlier without the interpreter
                importlib.reload(_fused)
        _scale = importlib.import_module("echoloss.ops.fused_linear.fused")
        if not _scale.interpreter_active():
            importlib.reload(_scale)
    finally:
        if _prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _prev


@pytest.fixture(autouse=True)
def _triton_interpret(monkeypatch):
    """``TRITON_INTERPRET=1`` for the duration of each test when there is no CUDA device."""
    if HAS_TRITON and not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def _poison(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(math.nan)
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(t.dtype).max)
    return t


def _called_from_echoloss() -> bool:
    return sys._getframe(2).f_globals.get("__name__", "").startswith("echoloss")


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """``torch.empty``/``empty_like``/``Tensor.new_empty`` called from echoloss return garbage
    (NaN for floats, the dtype's max for integers, True for bools): any element a kernel or the
    reference forgets to write shows up in the results instead of passing by luck on zeroed memory."""
    real_empty, real_empty_like = torch.empty, torch.empty_like
    real_new_empty = torch.Tensor.new_empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return _poison(t) if _called_from_echoloss() else t

    def empty_like(*args, **kwargs):
        t = real_empty_like(*args, **kwargs)
        return _poison(t) if _called_from_echoloss() else t

    def new_empty(self, *args, **kwargs):
        t = real_new_empty(self, *args, **kwargs)
        return _poison(t) if _called_from_echoloss() else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    yield


@pytest.fixture(autouse=True)
def _several_vocab_blocks(monkeypatch):
    if HAS_TRITON and not HAS_CUDA:
        from echoloss.ops.selective_logprobs import fused

        monkeypatch.setitem(fused.LAUNCH, "fwd_block", INTERPRETER_BLOCK_V)
        monkeypatch.setitem(fused.LAUNCH, "bwd_block", INTERPRETER_BLOCK_V)
        # Phase 2's grid gets several vocabulary tiles of two blocks each (V ≥ 1531).
        monkeypatch.setitem(fused.LAUNCH, "bwd_tile", 2 * INTERPRETER_BLOCK_V)
        monkeypatch.setitem(fused.LAUNCH, "one_warp_block", INTERPRETER_BLOCK_V)
    yield


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of the Triton phases, ``{"forward": n, "backward": m}``: a test that
    means to exercise the kernels asserts they ran (and not a silent fallback)."""
    from echoloss.ops.selective_logprobs import fused

    calls = {"forward": 0, "backward": 0}
    for name in calls:
        real = getattr(fused, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused, name, spy)
    return calls
