"""The unchunked gold for the fused-linear path: full logits, then the naive log-softmax.

Materialises the ``[N, V]`` logits and a compute-dtype copy of them: for tests and benchmarks
only. Never imports triton.
"""

from __future__ import annotations

import torch

from echoloss.ops.selective_logprobs.naive import naive_selective_logprobs

__all__ = ["naive_linear_selective_logprobs"]


def naive_linear_selective_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax((hidden @ weight.T).float() / T).gather(labels)`` with plain autograd.

    The logits are computed in the input dtype (as the model's LM head would), then upcast.

    Args:
        hidden: ``[N, H]``.
        weight: ``[V, H]``.
        labels: ``[N]`` int64.
        temperature: a float or an ``[N]`` tensor.
        return_entropy: also return the entropy.

    Returns:
        ``logprobs [N]`` (and ``entropy [N]``) in the compute dtype.

    Examples:
        >>> import torch
        >>> lp = naive_linear_selective_logprobs(torch.zeros(2, 3), torch.ones(4, 3),
        ...                                      torch.tensor([0, 3]))
        >>> torch.allclose(lp, torch.full((2,), -torch.log(torch.tensor(4.0))))
        True
    """
    return naive_selective_logprobs(
        hidden @ weight.t(), labels, temperature=temperature, return_entropy=return_entropy
    )
