"""The unchunked gold of the selective-logprob op: the full log-softmax with plain autograd.

Materialises a compute-dtype copy of the logits (and keeps it for backward): for tests and
benchmarks only. Never imports triton.
"""

from __future__ import annotations

import torch

from echoloss.ops.selective_logprobs.reference import LOG_P_FLOOR, compute_dtype

__all__ = ["naive_selective_logprobs"]


def naive_selective_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The unchunked gold: ``log_softmax(logits.float() / T).gather(labels)`` with plain autograd.

    Materialises a full compute-dtype copy of the logits (and keeps it for backward): use it in
    tests and benchmarks only.

    Args:
        logits: ``[..., V]``.
        labels: ``[...]`` int64.
        temperature: a float or a tensor broadcastable to ``labels``.
        return_entropy: also return the entropy.

    Returns:
        ``logprobs [...]`` (and ``entropy [...]``) in the compute dtype.

    Examples:
        >>> import torch
        >>> lp = naive_selective_logprobs(torch.zeros(2, 4), torch.tensor([0, 3]))
        >>> torch.allclose(lp, torch.full((2,), -torch.log(torch.tensor(4.0))))
        True
    """
    x = logits.to(compute_dtype(logits.dtype))
    if isinstance(temperature, torch.Tensor):
        x = x / temperature.to(x.dtype)[..., None]
    elif temperature != 1.0:
        x = x / temperature
    lsm = torch.log_softmax(x, dim=-1)
    lp = lsm.gather(-1, labels[..., None]).squeeze(-1)
    if not return_entropy:
        return lp
    p = lsm.exp()
    ent = -(p * lsm.clamp(min=LOG_P_FLOOR)).sum(-1)
    return lp, ent
