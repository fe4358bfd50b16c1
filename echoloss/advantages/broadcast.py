"""Per-rollout advantages spread over each rollout's RL tokens (padded ``[B, T]`` or packed ``[L]``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from echoloss.advantages._checks import _as_list, _finite_float

__all__ = ["broadcast_advantages", "broadcast_packed_advantages"]


def _advantage_tensor(
    advantages: Sequence[float | None] | torch.Tensor, n: int, device: torch.device, field: str
) -> tuple[torch.Tensor, list[int]]:
    """``[n]`` float32 advantages on ``device`` and the indices that had None."""
    if isinstance(advantages, torch.Tensor):
        if advantages.dim() != 1 or advantages.shape[0] != n:
            raise ValueError(f"{field} must have shape [{n}], got {tuple(advantages.shape)}")
        if not advantages.is_floating_point():
            raise TypeError(f"{field} must be a floating tensor, got {advantages.dtype}")
        values = advantages.to(device=device, dtype=torch.float32)
        missing: list[int] = []
    else:
        items = _as_list(advantages, field)
        if len(items) != n:
            raise ValueError(f"{field} has length {len(items)}, expected {n}")
        missing = [i for i, a in enumerate(items) if a is None]
        floats = [
            0.0 if a is None else _finite_float(a, f"{field}[{i}]", "advantages must be finite")
            for i, a in enumerate(items)
        ]
        values = torch.tensor(floats, dtype=torch.float32, device=device)
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{field}[{i}] is not finite in float32 (got {advantages[i]!r}); advantages must be "
            "finite and below 3.4e38 in magnitude"
        )
    return values, missing


def _check_bool_mask(mask: Any, field: str, dims: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{field} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{field} must be a bool tensor (True = token participates), got {mask.dtype}"
        )
    if mask.dim() != dims:
        raise ValueError(f"{field} must be {dims}-D, got shape {tuple(mask.shape)}")
    return mask


def broadcast_advantages(
    advantages: Sequence[float | None] | torch.Tensor, rl_mask: torch.Tensor
) -> torch.Tensor:
    """Spread per-rollout advantages over each rollout's RL tokens.

    Args:
        advantages: ``[B]`` one advantage per rollout (floats, None for rollouts without one,
            or a floating tensor). A None row must have no RL tokens.
        rl_mask: ``[B, T]`` bool, True where the token is trained with RL.

    Returns:
        ``[B, T]`` float32 on ``rl_mask.device``: the rollout's advantage on its RL tokens, 0
        elsewhere.

    Raises:
        TypeError: If ``rl_mask`` is not a bool tensor or ``advantages`` has the wrong type.
        ValueError: On a shape mismatch, a non-finite advantage, or a None advantage whose row
            selects RL tokens.

    Examples:
        >>> mask = torch.tensor([[False, True, True], [True, False, False]])
        >>> broadcast_advantages([0.5, -1.0], mask)
        tensor([[ 0.0000,  0.5000,  0.5000],
                [-1.0000,  0.0000,  0.0000]])
    """
    rl_mask = _check_bool_mask(rl_mask, "rl_mask", 2)
    values, missing = _advantage_tensor(advantages, rl_mask.shape[0], rl_mask.device, "advantages")
    for i in missing:
        count = int(rl_mask[i].sum())
        if count:
            raise ValueError(
                f"advantages[{i}] is None (no advantage, e.g. an errored rollout) but rl_mask[{i}] "
                f"selects {count} tokens; clear that row of the mask or drop the rollout"
            )
    return torch.where(
        rl_mask, values[:, None], torch.zeros((), dtype=torch.float32, device=rl_mask.device)
    )


def broadcast_packed_advantages(
    advantages: Sequence[float | None] | torch.Tensor,
    cu_seqlens: torch.Tensor,
    rl_mask: torch.Tensor,
) -> torch.Tensor:
    """Spread per-sequence advantages over a packed token stream.

    Sequence ``s`` occupies tokens ``cu_seqlens[s]:cu_seqlens[s + 1]`` (the FlashAttention
    varlen convention: ``cu_seqlens[0] == 0``, non-decreasing, ``cu_seqlens[-1] == L``).

    Args:
        advantages: ``[S]`` one advantage per packed sequence (floats, None for sequences
            without one, or a floating tensor). A None sequence must have no RL tokens.
        cu_seqlens: ``[S + 1]`` int32 (or int64) cumulative sequence lengths.
        rl_mask: ``[L]`` bool, True where the token is trained with RL.

    Returns:
        ``[L]`` float32 on ``rl_mask.device``: each sequence's advantage on its RL tokens, 0
        elsewhere.

    Raises:
        TypeError: On wrong dtypes.
        ValueError: On inconsistent shapes, malformed ``cu_seqlens``, a non-finite advantage,
            or a None advantage whose span selects RL tokens.

    Examples:
        >>> cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        >>> mask = torch.tensor([True, False, False, True, True])
        >>> broadcast_packed_advantages([2.0, -0.5], cu, mask)
        tensor([ 2.0000,  0.0000,  0.0000, -0.5000, -0.5000])
    """
    rl_mask = _check_bool_mask(rl_mask, "rl_mask", 1)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"cu_seqlens must be int32 (FlashAttention convention) or int64, got {cu_seqlens.dtype}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with S + 1 >= 1 entries, got shape {tuple(cu_seqlens.shape)}"
        )
    n_tokens = rl_mask.shape[0]
    bounds = cu_seqlens.to(device=rl_mask.device, dtype=torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    if int(bounds[0]) != 0 or int(bounds[-1]) != n_tokens or bool((lengths < 0).any()):
        raise ValueError(
            f"cu_seqlens must start at 0, be non-decreasing and end at L = {n_tokens} (rl_mask length); "
            f"got {cu_seqlens.tolist()}"
        )
    n_seqs = lengths.shape[0]
    values, missing = _advantage_tensor(advantages, n_seqs, rl_mask.device, "advantages")
    for s in missing:
        count = int(rl_mask[int(bounds[s]) : int(bounds[s + 1])].sum())
        if count:
            raise ValueError(
                f"advantages[{s}] is None (no advantage, e.g. an errored rollout) but its span "
                f"{int(bounds[s])}:{int(bounds[s + 1])} has {count} RL tokens; clear them in rl_mask"
            )
    per_token = torch.repeat_interleave(values, lengths, output_size=n_tokens)  # [L]
    return torch.where(
        rl_mask, per_token, torch.zeros((), dtype=torch.float32, device=rl_mask.device)
    )
