"""What the loss adds to a policy's per-token loss on the RL rows, as PyTorch on ``[n]`` tensors:
the train/inference mismatch weight (`mismatch_weights`), prime-rl's ``kl_tau`` penalty
(`kl_tau_penalty`) and the reference-KL estimators (`kl_penalty`, `k3`).
"""

from __future__ import annotations

import torch

__all__ = ["k3", "kl_penalty", "kl_tau_penalty", "mismatch_weights"]


def _exp_ratio(log_ratio: torch.Tensor, clamp: float | None) -> torch.Tensor:
    return torch.exp(log_ratio if clamp is None else log_ratio.clamp(-clamp, clamp))


def mismatch_weights(
    old_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    *,
    mode: str,
    weight_max: float,
    weight_min: float | None = None,
    sequence_index: torch.Tensor | None = None,
    num_sequences: int = 0,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached train/inference importance weights ``w = p_old / p_inference`` for RL rows.

    Token modes use ``exp(lp_old - lp_inf)`` per token; sequence modes use
    ``exp(Σ_{t ∈ RL_i} (lp_old - lp_inf))`` for every token of sequence ``i`` (TRL's convention).
    ``*_truncate`` clamps ``w`` to ``[weight_min, weight_max]``; ``*_mask`` sets ``w = 0`` outside.

    Args:
        old_logprobs: ``[n]`` trainer-side logprobs of the behaviour policy (detached).
        inference_logprobs: ``[n]`` sampling logprobs.
        mode: ``token_truncate``, ``token_mask``, ``sequence_truncate`` or ``sequence_mask``.
        weight_max, weight_min: the bounds (``weight_min`` None = no lower bound).
        sequence_index, num_sequences: local sequence of each row (sequence modes only).
        log_ratio_clamp: clamp of the log weight before ``exp``.

    Returns:
        ``(w [n], flags)`` with flags ``is_truncated`` or ``is_masked``.

    Examples:
        >>> w, f = mismatch_weights(torch.tensor([0.0, 0.0]), torch.log(torch.tensor([0.5, 0.1])),
        ...                         mode="token_truncate", weight_max=3.0)
        >>> w, f["is_truncated"].tolist()
        (tensor([2., 3.]), [False, True])
    """
    with torch.no_grad():
        log_w = old_logprobs - inference_logprobs
        if mode.startswith("sequence"):
            if sequence_index is None:
                raise ValueError(
                    f"mismatch={mode!r} needs sequence_ids to group tokens into sequences; pass "
                    "sequence_ids to echo_loss"
                )
            seq = log_w.new_zeros(num_sequences).index_add(0, sequence_index, log_w)
            log_w = seq[sequence_index]
        w = _exp_ratio(log_w, log_ratio_clamp)
        outside = w > weight_max
        if weight_min is not None:
            outside = outside | (w < weight_min)
        if mode.endswith("truncate"):
            return w.clamp(min=weight_min, max=weight_max), {"is_truncated": outside}
        return torch.where(outside, torch.zeros_like(w), w), {"is_masked": outside}


def k3(log_ratio: torch.Tensor, clamp: float | None = None) -> torch.Tensor:
    """``exp(x) - x - 1`` without cancellation: ``expm1(x) - x`` in float64, cast back.

    In fp32 ``exp(x) - x - 1`` loses every digit for ``|x| ≲ 1e-3`` (the value is ``≈ x²/2``, far
    below the ulp of 1) and can even come out negative; ``expm1`` in float64 keeps it exact to
    fp32 precision. Differentiable; ``x`` is clamped to ``±clamp`` first when given.

    Examples:
        >>> round(float(k3(torch.tensor([1e-4]))) * 1e8, 4)  # x²/2 = 0.5e-8
        0.5
    """
    x = log_ratio if clamp is None else log_ratio.clamp(-clamp, clamp)
    x64 = x.double()
    return (torch.expm1(x64) - x64).to(log_ratio.dtype)


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    *,
    estimator: str,
    log_ratio_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of ``KL(π_θ ‖ π_ref)`` on samples, differentiable in ``logprobs``.

    With ``d = lp_ref - lp``: k1 = ``-d``; k2 = ``½ d^2``; k3 = ``exp(d) - d - 1``.

    Examples:
        >>> lp, ref = torch.tensor([0.0]), torch.tensor([-1.0])
        >>> [round(float(kl_penalty(lp, ref, estimator=k)), 4) for k in ("k1", "k2", "k3")]
        [1.0, 0.5, 0.3679]
    """
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return k3(d, log_ratio_clamp)
    raise ValueError(f"kl_estimator: expected 'k1', 'k2' or 'k3', got {estimator!r}")


def kl_tau_penalty(log_ratio: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """``ρ²`` for ``|ρ| ≤ clamp``, continued linearly beyond (``2·clamp·|ρ| - clamp²``).

    Equal to prime-rl's ``ρ²`` wherever the log ratio is inside ``±log_ratio_clamp`` (20 by
    default: every realistic token); beyond it the gradient stays at ``±2·clamp`` instead of
    growing with ``ρ``, so a token whose logprob collapsed (``ρ ≈ -1e7`` at an extreme
    temperature) cannot overflow ``dlogits``. ``clamp=None`` is the plain square.

    Examples:
        >>> kl_tau_penalty(torch.tensor([0.5, -30.0]), 20.0).tolist()
        [0.25, 800.0]
    """
    if clamp is None:
        return log_ratio * log_ratio
    a = log_ratio.abs()  # [n]
    return torch.where(a <= clamp, log_ratio * log_ratio, 2.0 * clamp * a - clamp * clamp)  # [n]
