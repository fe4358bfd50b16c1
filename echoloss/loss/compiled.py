"""The compiled region of the loss algebra (`compile_loss_algebra`): its switch and its one
``torch.compile`` of `echoloss.loss.algebra.torch_algebra`."""

from __future__ import annotations

from typing import Any

import torch

from echoloss.loss.algebra import torch_algebra

__all__ = ["compile_loss_algebra", "compiled_algebra", "compiling"]


class _CompileState:
    options: dict[str, Any] | None = None  # torch.compile options; None = eager
    fn: Any = None


_COMPILE = _CompileState()


def compile_loss_algebra(enabled: bool = True, **options: Any) -> None:
    """Run the ``[N]`` loss algebra (everything between the two phases) as a compiled region.

    On the device path (CUDA) the algebra after the logprobs (policy, normalisers, echo term,
    metrics and the device-side checks) is many small kernels; with this switch it runs through
    ``torch.compile(**options)`` (default ``dynamic=False``: static shapes, one compile per
    micro-batch shape and configuration), which fuses them. Off by default: the first call of
    each shape pays the compile. The region traces without graph breaks for the built-in
    policies (``tests/loss/test_host_syncs.py``); its launch count on a GPU is not measured yet.

    Args:
        enabled: turn the compiled region on (True) or off (False).
        **options: keyword arguments of ``torch.compile`` (e.g. ``mode="max-autotune"``).

    Examples:
        >>> compile_loss_algebra(False)  # the default: eager
    """
    _COMPILE.options = ({"dynamic": False} | options) if enabled else None
    _COMPILE.fn = None


def compiling() -> bool:
    """Whether `compile_loss_algebra` turned the compiled region on (the fused algebra then
    stands aside: the compiled region runs instead)."""
    return _COMPILE.options is not None


def compiled_algebra() -> Any:
    """`echoloss.loss.algebra.torch_algebra` through ``torch.compile`` with the options of
    `compile_loss_algebra` (compiled once per switch)."""
    if _COMPILE.fn is None:
        _COMPILE.fn = torch.compile(torch_algebra, **(_COMPILE.options or {}))
    return _COMPILE.fn
