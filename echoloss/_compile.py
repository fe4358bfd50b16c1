"""``torch.compiler.disable`` without importing ``torch._dynamo`` at ``import echoloss``.

``@torch.compiler.disable`` applied at import time imports ``torch._dynamo`` (and with it
triton), which roughly doubles the cost of ``import echoloss`` over ``import torch``. The loss
entry points only need the decorator when something is being compiled, and nothing can be
compiled before ``torch._dynamo`` has been imported (``torch.compile`` imports it). So
[compiler_disable][echoloss._compile.compiler_disable] returns a wrapper that calls the plain
function while ``torch._dynamo`` is not loaded, and the ``torch.compiler.disable``-d function
(built once, on the first call that needs it) afterwards.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


def compiler_disable(fn: F) -> F:
    """Like ``@torch.compiler.disable``, but ``torch._dynamo`` is imported only once in use.

    Args:
        fn: the function that ``torch.compile`` must not trace.

    Returns:
        A wrapper with ``fn``'s name, docstring and signature. A compiled caller graph-breaks at
        it (it carries dynamo's ``_torchdynamo_disable`` marker, read without importing dynamo)
        and ``fn`` runs eagerly under ``torch.compiler.disable``.

    Example:
        >>> @compiler_disable
        ... def double(x: int) -> int:
        ...     return 2 * x
        >>> double(3), double.__name__
        (6, 'double')
    """
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:  # nothing can be compiling: no dynamo yet
            return fn(*args, **kwargs)
        if not disabled:
            import torch

            disabled.append(torch.compiler.disable(fn))  # type: ignore[no-untyped-call]
        return disabled[0](*args, **kwargs)

    # dynamo reads this marker with inspect.getattr_static: a compiled caller does not inline the
    # wrapper but graph-breaks and calls it eagerly, exactly as for a torch.compiler.disable-d fn.
    wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
    return cast(F, wrapper)
