"""The compiled region of the loss algebra (`compile_loss_algebra`): its switch and its one
``torch.compile`` of `echoloss.loss.algebra.torch_algebra`."""

from __future__ import annotations

from typing import Any

import torch

from echoloss._validate import describe, problem
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
        enabled: turn the compiled region on (True) or off (False): a ``bool`` (a string such
            as ``'false'`` is refused, not read as true).
        **options: keyword arguments of ``torch.compile`` (e.g. ``mode="max-autotune"``),
            checked here by building the compiled function (a bad backend, mode or option is
            refused now, not at the first device-path call).

    Raises:
        TypeError: ``enabled`` is not a bool.
        ValueError: options with ``enabled=False``, or options ``torch.compile`` refuses.

    Examples:
        >>> compile_loss_algebra(False)  # the default: eager
        >>> compile_loss_algebra("false")
        Traceback (most recent call last):
        ...
        TypeError: enabled must be a bool (True: the compiled region, False: eager), got str 'false'; pass False to turn it off
    """
    if not isinstance(enabled, bool):
        raise TypeError(
            problem(
                "enabled",
                "a bool (True: the compiled region, False: eager)",
                describe(enabled),
                "pass False to turn it off",
            )
        )
    if not enabled:
        if options:
            raise ValueError(
                f"compile_loss_algebra(False, {', '.join(options)}=...): options are unused "
                "when the compiled region is off; pass them with True"
            )
        _COMPILE.options, _COMPILE.fn = None, None
        return
    full = {"dynamic": False} | options
    try:
        fn = torch.compile(torch_algebra, **full)
    except Exception as err:  # TypeError, RuntimeError, InvalidBackend, AssertionError
        detail = " ".join(str(err).split())[:300]
        raise ValueError(
            f"compile_loss_algebra: torch.compile refuses {options!r} ({type(err).__name__}: "
            f"{detail}); see help(torch.compile) for its backends, modes and options"
        ) from err
    _COMPILE.options, _COMPILE.fn = full, fn


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
