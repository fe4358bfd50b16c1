"""Per-group advantage estimators, RAE baselines, the grouping driver and token broadcast.

One module per job, every public name re-exported here (``echoloss.advantages.X``):

- ``estimators``: the per-group functions; ``length_shaping``: reward shaping before them;
- ``registry``: names and import paths to functions; ``rae``: [`RAE`][echoloss.advantages.rae.RAE];
- ``grouping``: [`compute_advantages`][echoloss.advantages.grouping.compute_advantages]; ``broadcast``: per-rollout to per-token.

Every estimator is a pure function of one group's rewards (``list[float]`` in, one float per
reward out, in input order) so the same arithmetic serves any orchestrator:

- [`grpo`][echoloss.advantages.estimators.grpo] (mean-centred by default; ``scale=`` reproduces TRL / verl / OpenRLHF exactly),
  [`dr_grpo`][echoloss.advantages.estimators.dr_grpo], [`rloo`][echoloss.advantages.estimators.rloo], [`max_rl`][echoloss.advantages.estimators.max_rl] and [`reinforce`][echoloss.advantages.estimators.reinforce];
- [`length_shaped_rewards`][echoloss.advantages.length_shaping.length_shaped_rewards] / [`with_length_shaping`][echoloss.advantages.length_shaping.with_length_shaping]: prime-rl's correctness-gated
  length shaping, applied to the rewards before any estimator;
- [`RAE`][echoloss.advantages.rae.RAE]: SPIRAL's per-key EMA baselines, with both published update orders;
- [`compute_advantages`][echoloss.advantages.grouping.compute_advantages]: groups rollouts by a unique group id, drops errored rollouts
  (partial groups), and validates what a custom estimator returns;
- [`broadcast_advantages`][echoloss.advantages.broadcast.broadcast_advantages] / [`broadcast_packed_advantages`][echoloss.advantages.broadcast.broadcast_packed_advantages]: per-rollout advantages to
  per-token tensors over the RL mask.

Rules shared by every group-relative estimator: a singleton group gets ``[0.0]`` (it has no
baseline of its own), a constant-reward group gets zeros, and no finite input gives NaN or inf.
Means and deviations are computed in exact rational arithmetic and rounded to float64 once, so
results do not depend on the order of the rewards; see ``docs/advantages.md``.
"""

from __future__ import annotations

from echoloss.advantages.broadcast import broadcast_advantages, broadcast_packed_advantages
from echoloss.advantages.estimators import GrpoScale, dr_grpo, grpo, max_rl, reinforce, rloo
from echoloss.advantages.grouping import compute_advantages
from echoloss.advantages.length_shaping import length_shaped_rewards, with_length_shaping
from echoloss.advantages.rae import RAE, RaeOrder
from echoloss.advantages.registry import (
    AdvantageFn,
    list_advantage_fns,
    register_advantage_fn,
    resolve_advantage_fn,
)

__all__ = [
    "RAE",
    "AdvantageFn",
    "GrpoScale",
    "RaeOrder",
    "broadcast_advantages",
    "broadcast_packed_advantages",
    "compute_advantages",
    "dr_grpo",
    "grpo",
    "length_shaped_rewards",
    "list_advantage_fns",
    "max_rl",
    "register_advantage_fn",
    "reinforce",
    "resolve_advantage_fn",
    "rloo",
    "with_length_shaping",
]
