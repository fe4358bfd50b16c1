"""Detached loss metrics, keyed ``<name>/all`` and ``<name>/<env>``.

RL metrics (entropy, mismatch KL, trust-region fractions) are computed on RL rows only; echo rows
(whose inference logprob is a placeholder) never enter them. Every value is a 0-dim fp32 tensor
; a mean over an empty set is 0. To aggregate a mean over micro-batches, weight it by
``rl_tokens/<env>`` (or ``echo_tokens/<env>`` for the echo NLL).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["RESERVED_ENV", "loss_metrics"]

#: The env name that means "every env"; an env may not be called this.
RESERVED_ENV = "all"


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.float().mean() if x.numel() else x.new_zeros((), dtype=torch.float32)


def _max(x: torch.Tensor) -> torch.Tensor:
    return x.float().max() if x.numel() else x.new_zeros((), dtype=torch.float32)


def _count(n: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(float(n), device=device)


def loss_metrics(
    *,
    rl_env: torch.Tensor | None,
    echo_env: torch.Tensor | None,
    env_names: Sequence[str],
    num_rl: int,
    num_echo: int,
    rl_means: dict[str, torch.Tensor],
    rl_flags: dict[str, torch.Tensor],
    echo_nll: torch.Tensor,
    totals: dict[str, torch.Tensor],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Build the metrics dict of one [`echoloss.echo_loss`][echoloss.loss.echo_loss] call.

    Args:
        rl_env: ``[n_rl]`` int64 env index of each RL row (into ``env_names``, ``-1`` = none), or
            None for no per-env keys.
        echo_env: ``[n_echo]`` likewise for echo rows.
        env_names: the distinct env names, index → name.
        num_rl, num_echo: row counts.
        rl_means: name → ``[n_rl]`` per-token values reported as means (``entropy``, ...).
        rl_flags: name → ``[n_rl]`` bool, reported as ``<name>_frac`` (fraction of RL tokens).
        echo_nll: ``[n_echo]`` unweighted NLL of echo rows.
        totals: name → 0-dim value, reported as ``<name>/all`` only (the loss terms).
        device: where the count tensors live.

    Returns:
        ``dict[str, Tensor]`` of detached 0-dim fp32 tensors.

    Examples:
        >>> m = loss_metrics(rl_env=None, echo_env=None, env_names=[], num_rl=2, num_echo=1,
        ...                  rl_means={}, rl_flags={"masked": torch.tensor([True, False])},
        ...                  echo_nll=torch.tensor([0.5]), totals={}, device=torch.device("cpu"))
        >>> {k: round(float(v), 3) for k, v in m.items()}
        {'rl_tokens/all': 2.0, 'echo_tokens/all': 1.0, 'echo_nll_mean/all': 0.5, 'echo_nll_max/all': 0.5, 'masked_frac/all': 0.5}
    """
    out: dict[str, torch.Tensor] = {}

    def add(key: str, rl_sel: torch.Tensor | None, echo_sel: torch.Tensor | None) -> None:
        n_rl = num_rl if rl_sel is None else int(rl_sel.sum())
        n_echo = num_echo if echo_sel is None else int(echo_sel.sum())
        out[f"rl_tokens/{key}"] = _count(n_rl, device)
        out[f"echo_tokens/{key}"] = _count(n_echo, device)
        nll = echo_nll if echo_sel is None else echo_nll[echo_sel]
        out[f"echo_nll_mean/{key}"] = _mean(nll)
        out[f"echo_nll_max/{key}"] = _max(nll)
        for name, vals in rl_means.items():
            out[f"{name}/{key}"] = _mean(vals if rl_sel is None else vals[rl_sel])
        for name, flag in rl_flags.items():
            f = flag if rl_sel is None else flag[rl_sel]
            out[f"{name}_frac/{key}"] = _mean(f)

    with torch.no_grad():
        add(RESERVED_ENV, None, None)
        for name, value in totals.items():
            out[f"{name}/{RESERVED_ENV}"] = value.detach().float()
        for i, env in enumerate(env_names):
            add(
                env,
                None if rl_env is None else rl_env == i,
                None if echo_env is None else echo_env == i,
            )
    return {k: v.detach() for k, v in out.items()}
