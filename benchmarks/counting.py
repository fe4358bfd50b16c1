"""Count host syncs and kernel launches of a call, on any device, through a dispatch mode.

A ``TorchDispatchMode`` sees every aten op a call issues (forward, and backward when the backward
runs inside the mode), on CPU as on CUDA, so the counts of the CUDA code path can be taken on a
machine without a GPU when the code path is selected by a flag rather than by the device.

- **Host syncs**: ops that make the host wait for the device on CUDA: reading a value
  (``_local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``, ``float(t)``), ops whose output
  size depends on values (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing,
  ``repeat_interleave`` without ``output_size``, ``bincount``, which reads the maximum), value
  comparisons returning a Python bool (``equal``, ``is_nonzero``), and tensors built from host
  data (``lift_fresh``: ``torch.tensor([...], device=cuda)`` is a blocking copy from pageable
  memory).
- **Launches**: ops that run a kernel, i.e. every op except views, allocations (``empty*``),
  metadata and ``scalar_tensor`` (a Python number wrapped as a CPU scalar, e.g. the ``0.0`` of
  ``torch.where(mask, x, 0.0)``). Triton kernels are not aten ops and are never counted.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounts", "count_ops", "record_launch"]

#: Ops that make the host wait for the device whatever their arguments.
SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::nonzero",
        "aten::masked_select",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
        "aten::bincount",
        "aten::equal",
        "aten::is_nonzero",
        "aten::lift_fresh",
        "aten::_assert_async",
    }
)

#: Ops that launch nothing: allocations and metadata.
NO_LAUNCH_OPS = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::detach",
        "aten::lift_fresh",
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::is_nonzero",
        "aten::equal",
        "aten::sym_size",
        "aten::sym_stride",
        "aten::sym_numel",
        "aten::sym_storage_offset",
        "aten::set_",
        "aten::resize_",
        "aten::scalar_tensor",
        "aten::promote_types",  # dtype arithmetic on the host
        "aten::result_type",
        "aten::_unsafe_view",  # the view after a reshape's copy (the copy is counted)
    }
)


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    if len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return False
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
    )


@dataclass
class OpCounts:
    """What one counted region issued: host syncs and launches, in total and by op name."""

    syncs: collections.Counter[str] = field(default_factory=collections.Counter)
    launches: collections.Counter[str] = field(default_factory=collections.Counter)
    paused: int = 0

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def num_launches(self) -> int:
        return sum(self.launches.values())


class _Counter(TorchDispatchMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self.counts.paused:
            name = func._schema.name
            sync = name in SYNC_OPS
            if name in (
                "aten::index",
                "aten::index_put",
                "aten::index_put_",
                "aten::_index_put_impl_",
            ):
                sync = _has_bool_index(args)
            if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
                sync = True
            if sync:
                self.counts.syncs[name] += 1
            if name not in NO_LAUNCH_OPS and not func.is_view:
                self.counts.launches[name] += 1
        return func(*args, **kwargs)


_ACTIVE: list[OpCounts] = []


@contextmanager
def count_ops() -> Iterator[OpCounts]:
    """Count the host syncs and launches of the ops run inside the block (backward included).

    Examples:
        >>> x = torch.tensor([1.0, -2.0, 3.0])
        >>> with count_ops() as c:
        ...     y = (x * 2).sum()
        ...     n = int((x > 0).nonzero().shape[0])
        >>> c.num_syncs, dict(c.syncs)
        (1, {'aten::nonzero': 1})
    """
    counts = OpCounts()
    _ACTIVE.append(counts)
    try:
        with _Counter(counts):
            yield counts
    finally:
        _ACTIVE.pop()


@contextmanager
def paused() -> Iterator[None]:
    """Stop counting inside the block (e.g. around the two vocabulary-sized phases)."""
    for c in _ACTIVE:
        c.paused += 1
    try:
        yield
    finally:
        for c in _ACTIVE:
            c.paused -= 1


def record_launch(name: str) -> None:
    """Count one launch the dispatch mode cannot see (a Triton kernel: not an aten op) in
    every active, unpaused count, under ``name``.

    Examples:
        >>> with count_ops() as c:
        ...     record_launch("triton::value_check")
        >>> dict(c.launches)
        {'triton::value_check': 1}
    """
    for c in _ACTIVE:
        if not c.paused:
            c.launches[name] += 1


def uncounted_reference_phases() -> Any:
    """The two vocabulary-sized phases as the PyTorch reference with the counter paused: a
    stand-in for ``resolve_backend``'s result (on CUDA they are two Triton launches, not aten
    ops), so that a count sees only what a GPU runs besides them."""
    import types

    from echoloss.ops.selective_logprobs import reference

    def forward(*a: Any, **k: Any) -> Any:
        with paused():
            return reference.forward(*a, **k)

    def backward(*a: Any, **k: Any) -> Any:
        with paused():
            return reference.backward(*a, **k)

    return types.SimpleNamespace(forward=forward, backward=backward)
