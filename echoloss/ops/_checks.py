"""Argument checks shared by the public ops and losses: every error names the argument, what was
expected, what was given, and how to fix the call."""

from __future__ import annotations

import math
from typing import Any

import torch


def describe(t: Any) -> str:
    """``float32 [4, 8] on cpu`` for a tensor, the type name otherwise."""
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"
    return type(t).__name__


def check_tensor(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {describe(t)}")
    return t


def check_per_token(
    name: str,
    t: Any,
    shape: torch.Size,
    device: torch.device,
    kind: str,
    fix: str = "",
) -> torch.Tensor:
    """A per-token tensor of exactly ``shape`` (the logits' leading dims) on ``device``.

    ``kind`` is ``"bool"``, ``"int"`` or ``"float"``.
    """
    t = check_tensor(name, t)
    ok = {
        "bool": t.dtype == torch.bool,
        "int": not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool,
        "float": t.dtype.is_floating_point,
    }[kind]
    if not ok:
        hint = {
            "bool": "a bool mask (True = this token participates): pass mask.bool()",
            "int": "an integer tensor: pass x.long()",
            "float": "a floating tensor: pass x.float()",
        }[kind]
        raise TypeError(f"{name}: expected {hint}; got {describe(t)}")
    if t.shape != shape:
        raise ValueError(
            f"{name}: expected shape {list(shape)} (one entry per logits row), got "
            f"{list(t.shape)}{'; ' + fix if fix else ''}"
        )
    if t.device != device:
        raise ValueError(
            f"{name}: expected a tensor on {device} (the logits' device), got one on {t.device}; "
            f"move it with .to(logits.device)"
        )
    return t


def check_finite(name: str, t: torch.Tensor, where: torch.Tensor | None = None) -> None:
    """Raise if ``t`` (restricted to ``where``) holds inf or NaN."""
    vals = t if where is None else t[where]
    bad = ~torch.isfinite(vals)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0]) if where is None else int(where.nonzero()[bad][0, 0])
        raise ValueError(
            f"{name}: expected finite values on the rows that participate, found "
            f"{int(bad.sum())} non-finite (first at row {first}: {float(t.reshape(-1)[first])})"
        )


def check_temperature(
    temperature: Any, shape: torch.Size, device: torch.device
) -> float | torch.Tensor:
    """A positive finite float, or a per-token tensor of ``shape`` (a 0-dim tensor is a scalar)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, torch.Tensor)):
        raise TypeError(
            f"temperature: expected a positive float or a float tensor of shape {list(shape)}, "
            f"got {describe(temperature)}"
        )
    if isinstance(temperature, torch.Tensor):
        if not temperature.dtype.is_floating_point:
            raise TypeError(f"temperature: expected a float tensor, got {describe(temperature)}")
        if temperature.dim() == 0:
            temperature = float(temperature)
        else:
            check_per_token("temperature", temperature, shape, device, "float")
            bad = ~(torch.isfinite(temperature) & (temperature > 0))
            if bool(bad.any()):
                i = int(bad.reshape(-1).nonzero()[0, 0])
                raise ValueError(
                    f"temperature: every entry must be a positive finite number, found "
                    f"{float(temperature.reshape(-1)[i])} at row {i}; padding rows take 1.0"
                )
            return temperature
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature: expected a positive finite number, got {temperature}")
    return t


def check_chunk_size(chunk_size: Any) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size: expected None or an int ≥ 1 (rows per chunk), got {chunk_size!r}"
        )
    return chunk_size
