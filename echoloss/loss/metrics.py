"""Detached loss metrics, keyed ``<name>/all`` and ``<name>/<env>``.

RL metrics (entropy, mismatch KL, trust-region fractions) are computed on RL rows only; echo rows
(whose inference logprob is a placeholder) never enter them. Every value is a 0-dim fp32 tensor;
a mean over an empty set is 0. To aggregate a mean over micro-batches, weight it by
``rl_tokens/<env>`` (or ``echo_tokens/<env>`` for the echo NLL).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["RESERVED_ENV", "loss_metrics"]

#: The env name that means "every env"; an env may not be called this.
RESERVED_ENV = "all"


def loss_metrics(
    *,
    rl: torch.Tensor,
    echo: torch.Tensor,
    env_of_row: torch.Tensor | None,
    env_names: Sequence[str],
    rl_means: dict[str, torch.Tensor],
    rl_flags: dict[str, torch.Tensor],
    echo_nll: torch.Tensor,
    totals: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Build the metrics dict of one [`echoloss.echo_loss`][echoloss.loss.echo_loss] call.

    Every per-env statistic of every metric comes from one ``index_add`` over ``[N]`` rows
    (and one ``scatter_reduce`` for the maxima), with no host read: the values stay on the
    device and each metric is a 0-dim view of the result. Without envs (``env_of_row`` None)
    every row would go to one slot, which on a GPU serialises ``N`` atomic adds onto one
    address per metric: the sums are then one plain reduction over the rows and the maximum
    one ``amax`` (the same values up to fp32 summation order; counts are exact).

    Args:
        rl: ``[N]`` bool RL rows.
        echo: ``[N]`` bool echo rows.
        env_of_row: ``[N]`` int64 env index of each row (into ``env_names``, ``-1`` = none), or
            None for no per-env keys.
        env_names: the distinct env names, index → name.
        rl_means: name → ``[N]`` per-token values reported as means over RL rows (``entropy``,
            ...); other rows are never read.
        rl_flags: name → ``[N]`` bool, reported as ``<name>_frac`` (fraction of RL tokens).
        echo_nll: ``[N]`` unweighted NLL, read on echo rows.
        totals: name → 0-dim value, reported as ``<name>/all`` only (the loss terms).

    Returns:
        ``dict[str, Tensor]`` of detached 0-dim fp32 tensors.

    Examples:
        >>> m = loss_metrics(rl=torch.tensor([True, True, False]),
        ...                  echo=torch.tensor([False, False, True]), env_of_row=None,
        ...                  env_names=[], rl_means={},
        ...                  rl_flags={"masked": torch.tensor([True, False, False])},
        ...                  echo_nll=torch.tensor([0.0, 0.0, 0.5]), totals={})
        >>> {k: round(float(v), 3) for k, v in m.items()}
        {'rl_tokens/all': 2.0, 'echo_tokens/all': 1.0, 'echo_nll_mean/all': 0.5, 'echo_nll_max/all': 0.5, 'masked_frac/all': 0.5}
    """
    f32 = torch.float32
    e = len(env_names) if env_of_row is not None else 0
    with torch.no_grad():
        nll = echo_nll.detach().to(f32)
        names = list(rl_means) + list(rl_flags)
        rl_f = rl.to(f32)
        rows = [rl_f, echo.to(f32), torch.where(echo, nll, 0.0)]
        rows += [torch.where(rl, rl_means[k].detach().to(f32), 0.0) for k in rl_means]
        rows += [(rl_flags[k] & rl).to(f32) for k in rl_flags]
        stacked = torch.stack(rows)  # [k, N]
        if env_of_row is None and stacked.shape[1] > 0:
            sums, nll_max = _totals(stacked, echo, nll)
        else:
            sums, nll_max = _per_env(stacked, echo, nll, env_of_row, e)
        n_rl, n_echo = sums[0], sums[1]  # [1+e]
        nll_mean = sums[2] / n_echo.clamp(min=1)
        rl_stats = sums[3:] / n_rl.clamp(min=1)  # [len(names), 1+e]
    out: dict[str, torch.Tensor] = {}
    keys = [RESERVED_ENV, *env_names]
    for j, key in enumerate(keys):
        out[f"rl_tokens/{key}"] = n_rl[j]
        out[f"echo_tokens/{key}"] = n_echo[j]
        out[f"echo_nll_mean/{key}"] = nll_mean[j]
        out[f"echo_nll_max/{key}"] = nll_max[j]
        for i, name in enumerate(names):
            suffix = "_frac" if i >= len(rl_means) else ""
            out[f"{name}{suffix}/{key}"] = rl_stats[i, j]
        if j == 0:
            for name, value in totals.items():
                out[f"{name}/{RESERVED_ENV}"] = value.detach().float()
    return out


def _totals(
    stacked: torch.Tensor, echo: torch.Tensor, nll: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums [k, 1], echo NLL maximum [1])`` over all ``N > 0`` rows: one reduction each."""
    sums = stacked.sum(1, keepdim=True)  # [k, 1]
    top = torch.where(echo, nll, float("-inf")).amax(0, keepdim=True)  # [1]; -inf: no echo row
    return sums, torch.where(sums[1] > 0, top, 0.0)


def _per_env(
    stacked: torch.Tensor,
    echo: torch.Tensor,
    nll: torch.Tensor,
    env_of_row: torch.Tensor | None,
    e: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums [k, 1+e], echo NLL maxima [1+e])``: "all", then each of the ``e`` envs."""
    # Slot of each row: its env 0..e-1, or e (no env); "all" sums every slot.
    slot = (
        torch.full_like(echo, e, dtype=torch.long)
        if env_of_row is None
        else torch.where(env_of_row >= 0, env_of_row, e)
    )  # [N]
    k = stacked.shape[0]
    per_slot = stacked.new_zeros(k, e + 1).index_add_(1, slot, stacked)  # [k, e+1]
    sums = torch.cat([per_slot.sum(1, keepdim=True), per_slot[:, :e]], 1)  # [k, 1+e]
    # Maxima: empty slots stay 0 (include_self=False leaves the initial value there).
    slot_echo = torch.where(echo, slot, e + 1)  # [N] non-echo rows into a dropped slot
    slot_max = nll.new_zeros(e + 2).scatter_reduce_(0, slot_echo, nll, "amax", include_self=False)
    slot_has = per_slot[1] > 0  # [e+1]
    all_max = torch.where(slot_has, slot_max[: e + 1], float("-inf")).amax(0, keepdim=True)
    nll_max = torch.cat([torch.where(sums[1, :1] > 0, all_max, 0.0), slot_max[:e]])  # [1+e]
    return sums, nll_max
