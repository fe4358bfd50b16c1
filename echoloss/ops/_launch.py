"""What every fused op's launch needs, shared by the ``fused.py`` modules (no triton here)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def on_tensor_device(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Make ``t``'s CUDA device the current one for a Triton launch (Triton launches on the
    current device: a tensor on ``cuda:1`` needs it current); nothing off CUDA.

    Examples:
        >>> with on_tensor_device(torch.zeros(1)):
        ...     pass
    """
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
