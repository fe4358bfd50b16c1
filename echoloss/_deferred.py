"""Checks of values that live on the device, without making the host wait for them.

Reading a device value on the host (``bool(t.any())``, ``int(t)``, ``.item()``) blocks the host
until the GPU has finished everything queued before it, so the host stops queueing work and the
GPU idles. On the device code path (CUDA, or the ``device_code_path()`` block that tests use to
run that path on CPU) the loss therefore checks values on the device: each check reduces to a few
numbers (a flag and what its message needs: a row, a count, a value), the numbers of one call
travel to pinned host memory with one asynchronous copy, and the error is raised later, by

1. the next loss call whose device has finished the checked work (a non-blocking poll at the
   start of every entry point: usually the next micro-batch), or
2. [`raise_deferred_errors`][echoloss._deferred.raise_deferred_errors] (blocking), which a
   training loop calls where it reads the loss anyway (``echoloss-train`` does, once per step);
3. at the latest when the interpreter exits: an error still pending then is reported as a
   ``RuntimeWarning`` (raising is no longer possible), so none is lost silently.

The message is the one the host path raises at once. Checks of shapes, dtypes, devices and
configuration never read device values and stay immediate on every path. On the host code path
(CPU tensors) every check is evaluated at once, as before.

This module holds the queue and the device-path switch and imports nothing of echoloss; a call's
checks are gathered by ``echoloss.ops.value_checks.DeferredChecks``, next to the op that
computes their numbers.
"""

from __future__ import annotations

import atexit
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = [
    "Message",
    "device_code_path",
    "enqueue",
    "first_true",
    "host_to_device",
    "not_finite",
    "on_device_path",
    "pending_count",
    "raise_deferred_errors",
]

#: Builds the error from the host copy of a check's numbers; returns None when the check passed.
Message = Callable[[Sequence[float]], "Exception | None"]

_state = threading.local()


def _forced() -> int:
    return int(getattr(_state, "forced", 0))


def on_device_path(device: torch.device) -> bool:
    """Whether code on ``device`` must not read device values on the host (CUDA, or forced).

    Examples:
        >>> on_device_path(torch.device("cpu"))
        False
        >>> with device_code_path():
        ...     on_device_path(torch.device("cpu"))
        True
    """
    return device.type == "cuda" or _forced() > 0


@contextmanager
def device_code_path() -> Iterator[None]:
    """Run the CUDA code path on any device inside the block (for tests and op counts).

    Values are then checked on the device and the errors deferred exactly as on CUDA, so a CPU
    test can count the ops of the CUDA path (``benchmarks/counting.py``) and see when its errors
    are raised.
    """
    _state.forced = _forced() + 1
    try:
        yield
    finally:
        _state.forced = _forced() - 1


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """0-dim int64: the index of the first True of a 1-D ``mask`` (0 when none), on its device.

    Examples:
        >>> int(first_true(torch.tensor([False, True, True])))
        1
    """
    if mask.numel() == 0:
        return mask.new_zeros((), dtype=torch.int64)
    flat = mask.reshape(-1)
    # A bool tensor read as uint8 in place (same bytes, no cast launch): argmax takes no bool.
    return (flat.view(torch.uint8) if flat.dtype == torch.bool else flat.to(torch.uint8)).argmax()


def not_finite(x: torch.Tensor) -> torch.Tensor:
    """``~torch.isfinite(x)`` in two launches instead of four (on CUDA ``isfinite`` is
    ``x == x`` and ``|x| != inf``, combined): ``x - x`` is exactly 0 for a finite ``x`` and NaN
    for ±inf and NaN. Not recorded by autograd.

    Examples:
        >>> not_finite(torch.tensor([1.0, float("inf"), float("nan"), -0.0])).tolist()
        [False, True, True, False]
    """
    x = x.detach()
    return (x - x) != 0


@dataclass
class _Pending:
    host: torch.Tensor  # [k] float64 in (pinned) host memory
    event: torch.cuda.Event | None  # recorded after the copy; None = already on the host
    layout: list[tuple[Message, list[int]]]  # (message, positions of its numbers) per check


def _queue() -> list[_Pending]:
    q = getattr(_state, "queue", None)
    if q is None:
        q = _state.queue = []
    return q


def pending_count() -> int:
    """How many calls' deferred checks are still waiting to be read (this thread)."""
    return len(_queue())


def _evaluate(p: _Pending) -> Exception | None:
    values = p.host.numpy().tolist()  # host memory: no device read
    for message, positions in p.layout:
        err = message([values[i] for i in positions])
        if err is not None:
            return err
    return None


def enqueue(
    host: torch.Tensor, event: torch.cuda.Event | None, layout: list[tuple[Message, list[int]]]
) -> None:
    """Queue one call's check numbers for reading: ``host`` ``[k]`` float64 in (pinned) host
    memory, filled by a copy that ``event`` marks done (None: filled already), and per check
    its message and the positions of its numbers
    (``echoloss.ops.value_checks.DeferredChecks.submit``)."""
    _queue().append(_Pending(host, event, layout))


def raise_deferred_errors(*, block: bool = True) -> None:
    """Raise the first error of the deferred device-side checks of earlier loss calls.

    On CPU every check is raised during the call itself, so this is a no-op there. On CUDA the
    loss entry points check participating values (non-finite logprobs, labels out of range,
    normalisers smaller than the call's counts, ...) on the device and defer the error; call this
    where the training loop reads the loss anyway (``loss.item()`` for a log line), once per
    step: with ``block=True`` it waits for the checked work, then raises the first error with the
    same message the immediate check would have raised. Every loss call also polls with
    ``block=False`` (only checks whose work has finished are read, nothing waits).

    Args:
        block: wait for checks whose device work has not finished yet (one host sync).

    Raises:
        ValueError: the first failed check, in call order; the pending checks are cleared.

    Examples:
        >>> raise_deferred_errors()  # nothing pending: returns None
    """
    q = _queue()
    while q:
        p = q[0]
        if p.event is not None and not block and not p.event.query():  # type: ignore[no-untyped-call]
            return
        if p.event is not None:
            p.event.synchronize()
        q.pop(0)
        err = _evaluate(p)
        if err is not None:
            q.clear()
            raise err


def host_to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[len(values)]`` int64 on ``device`` from host values, without blocking the host.

    Written into (pinned) host memory directly and copied with ``non_blocking=True``; a tensor
    built with ``torch.tensor(values, device=cuda)`` would copy from pageable memory, which
    waits for the device.

    Examples:
        >>> host_to_device([3, -1], torch.device("cpu")).tolist()
        [3, -1]
    """
    host = torch.empty(len(values), dtype=torch.int64, pin_memory=device.type == "cuda")
    if len(values):
        host.numpy()[:] = values
    return host.to(device, non_blocking=True)


def _report_at_exit() -> None:
    """Warn about a deferred error nobody read before the interpreter exits."""
    try:
        raise_deferred_errors()
    except Exception as err:  # the process is ending: say it, do not raise
        warnings.warn(
            f"a deferred loss check failed and was never raised (no loss call or "
            f"echoloss.raise_deferred_errors() after it): {err}",
            RuntimeWarning,
            stacklevel=1,
        )


atexit.register(_report_at_exit)
