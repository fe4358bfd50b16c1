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
"""

from __future__ import annotations

import atexit
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DeferredChecks",
    "device_code_path",
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


def _with_flag(message: Message) -> Message:
    """``message`` of a row check given ``(count, row, value)``: the flag is ``count > 0``,
    formed on the host (no launch for it)."""
    return lambda v: message([float(v[0] > 0), v[0], v[1], v[2]])


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


#: The numbers of one check (0-dim or one-element tensors, or Python numbers).
Numbers = Sequence["torch.Tensor | float"]


class DeferredChecks:
    """The value checks of one call: evaluated at once on the host path, deferred on the device path.

    ``add(numbers, message)`` takes the numbers a check needs (0-dim or one-element tensors,
    flag first by convention) and a function that builds the error from their host values as
    floats (None = passed); ``add_lazy(compute, message)`` takes a function that computes them,
    run when the checks are packed (inside the compiled loss algebra when it is on, so the
    check's own launches are part of the compiled region).
    `submit` sends every number of the call to the host in one asynchronous copy.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.deferred = on_device_path(device)
        # Checks not packed yet, in call order: their numbers, a function computing them, or a
        # row check (`add_rows`, an ``echoloss.ops.value_checks.RowCheck``).
        self._entries: list[tuple[Any, Message]] = []
        self._blocks: list[torch.Tensor] = []  # packed numbers: [k] float64 each
        self._layout: list[tuple[Message, list[int]]] = []  # positions in the blocks

    def _values(self, numbers: Numbers) -> list[torch.Tensor]:
        return [
            n.detach().reshape(())
            if isinstance(n, torch.Tensor)
            else torch.full((), float(n), dtype=torch.float64, device=self.device)
            for n in numbers
        ]

    def add(self, numbers: Numbers, message: Message) -> None:
        """Queue one check; on the host path evaluate it now and raise its error."""
        if not self.deferred:
            err = message([float(v) for v in self._values(numbers)])
            if err is not None:
                raise err
            return
        # Detached now: a reference to a differentiable tensor kept here would make it an
        # output of the compiled region that backward has to give a (zero) gradient.
        self._entries.append(
            ([n.detach() if isinstance(n, torch.Tensor) else n for n in numbers], message)
        )

    def add_rows(
        self,
        values: torch.Tensor,
        rows: torch.Tensor | None,
        rule: str,
        message: Message,
        *,
        threshold: float = 0.0,
    ) -> None:
        """Queue the check that no entry of ``values`` on ``rows`` (None = every entry) breaks
        ``rule`` (``echoloss.ops.value_checks.RULES``); ``message`` reads its four numbers
        ``(bad, count, first flat index, value there)``. On the device path every such check
        of a call is computed when the checks are packed, on CUDA in one Triton launch (a
        program per check, eight per launch), written into one block; on the host path it is
        evaluated now.

        Examples:
            >>> checks = DeferredChecks(torch.device("cpu"))
            >>> checks.add_rows(torch.tensor([1.0, -2.0]), None, "not_weight",
            ...                 lambda v: ValueError(f"row {int(v[2])}: {v[3]}") if v[0] else None)
            Traceback (most recent call last):
            ...
            ValueError: row 1: -2.0
        """
        from echoloss.ops.value_checks import RowCheck, validate_row_check, value_check_numbers

        check = RowCheck(values.detach(), rows, rule, threshold)
        validate_row_check(check)  # at once on every path: a wrong rule is a bug, not a value
        if not self.deferred:
            err = message(value_check_numbers([check], backend="naive").tolist())
            if err is not None:
                raise err
            return
        self._entries.append((check, message))

    def add_lazy(self, compute: Callable[[], Numbers], message: Message) -> None:
        """`add` with the numbers computed by ``compute()`` when the checks are packed (at once
        on the host path)."""
        if not self.deferred:
            self.add(compute(), message)
            return
        self._entries.append((compute, message))

    def add_packed(
        self, numbers: torch.Tensor, checks: Sequence[tuple[Message, Sequence[int]]]
    ) -> None:
        """Queue checks whose numbers a kernel already wrote into one ``[k]`` float tensor
        (float64, or float32 for whole counts below 2**24, e.g. the row program's stats):
        ``checks`` lists ``(message, positions in numbers)`` in call order. No launch is added
        (the block is sent as it is); on the host path evaluate them now and raise.

        Examples:
            >>> checks = DeferredChecks(torch.device("cpu"))
            >>> checks.add_packed(torch.tensor([0.0, 7.0], dtype=torch.float64),
            ...                   [(lambda v: ValueError(f"row {v[1]:g}") if v[0] else None, [0, 1])])
        """
        if not self.deferred:
            values = numbers.detach().double().cpu().tolist()
            for message, positions in checks:
                err = message([values[i] for i in positions])
                if err is not None:
                    raise err
            return
        self.pack()  # the checks queued before these keep their place in the order
        offset = sum(b.numel() for b in self._blocks)
        self._blocks.append(numbers.detach().reshape(-1))
        self._layout += [(m, [offset + i for i in positions]) for m, positions in checks]

    def pack(self) -> None:
        """Gather the checks queued so far into one ``[k]`` float64 block: the row checks'
        numbers first (`add_rows`: with the Triton program, one launch for up to eight,
        written in place), then the others (per dtype one ``stack``, none for a single
        number, and one cast-copy; the row checks' numbers join these on the PyTorch path).
        Called inside the compiled loss algebra, so that computing the lazy checks' numbers
        and packing them is part of the compiled region and only the copy remains outside."""
        if not self._entries:
            return
        from echoloss.ops.value_checks import (
            NUMBERS,
            RowCheck,
            counted,
            fused_value_checks_run,
            value_check_numbers,
        )

        numbers: list[torch.Tensor] = []
        row_checks: list[RowCheck] = []
        # Per check in call order: (row check?, start, stop) of its numbers, its message.
        spans: list[tuple[bool, int, int, Message]] = []
        fused = fused_value_checks_run(self.device)
        for entry, message in self._entries:
            if isinstance(entry, RowCheck) and fused:
                start = len(NUMBERS) * len(row_checks)
                spans.append((True, start, start + len(NUMBERS), message))
                row_checks.append(entry)
                continue
            if isinstance(entry, RowCheck):  # (count, row, value), packed with the others
                values = list(counted(entry))
                message = _with_flag(message)
            else:
                values = self._values(entry() if callable(entry) else entry)
            spans.append((False, len(numbers), len(numbers) + len(values), message))
            numbers += values
        self._entries = []
        if not spans:
            return
        # One block: the row checks' numbers first (the program writes them in place), then
        # the others, each dtype's stacked and copied (cast) into its slice: no join launch.
        width = len(NUMBERS) * len(row_checks)
        block = torch.empty(width + len(numbers), dtype=torch.float64, device=self.device)
        if row_checks:
            value_check_numbers(row_checks, out=block[:width])
        where = [0] * len(numbers)  # position of number i in the block
        groups: dict[torch.dtype, list[int]] = {}
        for i, n in enumerate(numbers):
            groups.setdefault(n.dtype, []).append(i)
        k = width
        for idx in groups.values():
            # One number is copied (cast) as it is: no stack launch for a group of one.
            group = (
                numbers[idx[0]].reshape(1)
                if len(idx) == 1
                else torch.stack([numbers[i] for i in idx])
            )
            block[k : k + len(idx)].copy_(group)
            for i in idx:
                where[i] = k
                k += 1
        offset = sum(b.numel() for b in self._blocks)
        self._blocks.append(block)
        self._layout += [
            (
                m,
                [offset + p for p in range(a, b)]
                if rows
                else [offset + where[i] for i in range(a, b)],
            )
            for rows, a, b, m in spans
        ]

    def submit(self) -> None:
        """Send the queued numbers to the host (non-blocking) and queue them for reading.

        The numbers are packed by dtype (`pack`), so a call's checks cost a handful of launches
        and one copy, whatever their number. Inside `collecting` they join the collector
        instead (one pack and one copy for every check of the block).
        """
        collector = _collector()
        if collector is not None and collector is not self and self.deferred:
            collector.absorb(self)
            return
        self.pack()
        if not self._blocks:
            return
        flat = torch.cat(self._blocks) if len(self._blocks) > 1 else self._blocks[0]
        layout = self._layout
        event = None
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        else:
            host = flat
        _queue().append(_Pending(host, event, layout))
        self._blocks, self._layout = [], []

    @contextmanager
    def collecting(self) -> Iterator[DeferredChecks]:
        """Inside the block, checks that other code submits join these (on the device path).

        A loss entry point wraps the ops it calls (labels, temperatures, a record built inside
        the call), so their checks go to the host with the loss's own, in call order: one pack
        and one copy per call instead of one per op. On the host path every check raises at
        once, as always.

        Examples:
            >>> checks = DeferredChecks(torch.device("cpu"))
            >>> with checks.collecting():
            ...     pass
        """
        stack = getattr(_state, "collectors", None)
        if stack is None:
            stack = _state.collectors = []
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()

    def absorb(self, other: DeferredChecks) -> None:
        """Take ``other``'s checks, after this one's, in their order (``other`` is left empty)."""
        if other._blocks:  # what ``other`` packed stays packed: pack both, then join the blocks
            other.pack()
            self.pack()
            offset = sum(b.numel() for b in self._blocks)
            self._blocks += other._blocks
            self._layout += [(m, [offset + p for p in pos]) for m, pos in other._layout]
        else:
            self._entries += other._entries
        other._entries, other._blocks, other._layout = [], [], []


def _collector() -> DeferredChecks | None:
    stack = getattr(_state, "collectors", None)
    return stack[-1] if stack else None


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
