"""A call's value checks, gathered and evaluated here: at once on the host path, deferred on the
device path (``echoloss/_deferred.py`` holds the queue they are read from and says when).

`DeferredChecks` collects the numbers of a call's checks (a flag and what its message reads)
and sends them to the host in one asynchronous copy; its row checks (`DeferredChecks.add_rows`)
are `value_check_numbers`' (one Triton launch for up to eight on CUDA). `check_finite` and
`check_temperature` are the tensor-value checks the ops and the loss share.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from echoloss._deferred import Message, enqueue, on_device_path
from echoloss._validate import check_per_token, describe, problem
from echoloss.ops.value_checks.contract import NUMBERS, RowCheck
from echoloss.ops.value_checks.naive import counted
from echoloss.ops.value_checks.op import (
    fused_value_checks_run,
    validate_row_check,
    value_check_numbers,
)

__all__ = ["DeferredChecks", "Numbers", "check_finite", "check_temperature"]

#: The collectors of `DeferredChecks.collecting`, innermost last (per thread).
_local = threading.local()


def _with_flag(message: Message) -> Message:
    """``message`` of a row check given ``(count, row, value)``: the flag is ``count > 0``,
    formed on the host (no launch for it)."""
    return lambda v: message([float(v[0] > 0), v[0], v[1], v[2]])


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
        # row check (`add_rows`, a `RowCheck`).
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
        ``rule`` (`RULES`); ``message`` reads its four numbers
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
        enqueue(host, event, layout)
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
        stack = getattr(_local, "collectors", None)
        if stack is None:
            stack = _local.collectors = []
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
    stack = getattr(_local, "collectors", None)
    return stack[-1] if stack else None


def check_finite(
    name: str, t: torch.Tensor, where: torch.Tensor | None = None, fix: str = ""
) -> None:
    """Raise naming the first non-finite entry of ``t`` (restricted to the rows ``where``).

    On the device path the check runs on the device and the error is deferred
    (``echoloss/_deferred.py``).

    Examples:
        >>> check_finite("advantages", torch.tensor([0.0, float("nan")]))
        Traceback (most recent call last):
        ...
        ValueError: advantages must be finite on the rows that participate, got 1 non-finite value(s), the first at row 1: nan
    """
    if t.numel() == 0:
        return

    def message(v: Sequence[float]) -> Exception | None:
        if not v[0]:
            return None
        return ValueError(
            problem(
                name,
                "finite on the rows that participate",
                f"{int(v[1])} non-finite value(s), the first at row {int(v[2])}: {v[3]}",
                fix,
            )
        )

    checks = DeferredChecks(t.device)
    checks.add_rows(t, where, "not_finite", message)  # (bad, count, first row, its value)
    checks.submit()


def _check_temperature_values(flat: torch.Tensor) -> None:
    """Every per-token temperature positive and finite (on the device path: checked there, the
    error deferred; see ``echoloss/_deferred.py``)."""
    if flat.numel() == 0:
        return

    def message(v: Sequence[float]) -> Exception | None:
        if not v[0]:
            return None
        return ValueError(
            problem(
                f"temperature[{int(v[2])}]",
                "a positive finite number",
                repr(v[3]),
                "padding rows take 1.0",
            )
        )

    checks = DeferredChecks(flat.device)
    checks.add_rows(flat, None, "not_positive", message)  # inside a loss call: with its checks
    checks.submit()


def check_temperature(
    temperature: Any, shape: torch.Size, device: torch.device, *, check_values: bool = True
) -> float | torch.Tensor:
    """A positive finite temperature: a Python float, or a per-token float tensor of ``shape``.

    ``check_values=False`` leaves the values of a per-token tensor to a caller that checked
    them already (the loss builds it from a validated record); type, shape and device are
    always checked.

    A 0-dim tensor is a scalar and comes back as a Python float (fp64: an fp64 temperature keeps
    every digit). Strings, bools and other types are refused.

    Examples:
        >>> check_temperature(torch.tensor(0.7, dtype=torch.float64), torch.Size([2]), torch.device("cpu"))
        0.7
        >>> check_temperature("abc", torch.Size([2]), torch.device("cpu"))
        Traceback (most recent call last):
        ...
        TypeError: temperature must be a positive float or a float tensor of shape [2], got str 'abc'; pass temperature=0.7 (not a string), or a tensor of per-token temperatures
    """
    expected = f"a positive float or a float tensor of shape {list(shape)}"
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, torch.Tensor)):
        raise TypeError(
            problem(
                "temperature",
                expected,
                describe(temperature),
                "pass temperature=0.7 (not a string), or a tensor of per-token temperatures",
            )
        )
    if isinstance(temperature, torch.Tensor):
        if not temperature.dtype.is_floating_point:
            raise TypeError(
                problem("temperature", expected, describe(temperature), "pass t.float()")
            )
        if temperature.dim() == 0:
            temperature = float(temperature)
        else:
            check_per_token("temperature", temperature, shape, device, "float")
            if check_values:
                _check_temperature_values(temperature.reshape(-1))
            return temperature
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(problem("temperature", "a positive finite number", repr(temperature)))
    return t
