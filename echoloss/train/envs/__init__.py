"""The trainer's built-in tool environments, by name.

===================== =========================================================================
``mirrorgrid``        the default: secretly mirrored controls (`.mirrorgrid`); the
                      observation carries what the agent needs, with an exact CE floor
``mirrorgrid-shown``  control: the mirroring printed in the first message (nothing hidden)
``mirrorgrid-noise``  control: one unpredictable digit after every observation
``gridwalk``          the first demo environment (`echoloss.train.env`): every
                      observation prints the optimal move, so it cannot test echo
===================== =========================================================================

Every environment has the same interface: ``name``, ``turn_limit``, ``task(seed=, index=)``,
``warmup_task(seed=, index=)``, ``start(task)``, ``act(episode, text)``, ``demonstration(task, rng)``,
``random_walk(task, rng, turns)``, ``heldout_task(index=)``, ``eval_tasks()`` (the fixed
held-out evaluation set, or an empty list) and ``observation_nats(messages)`` (the exact
Bayes-optimal observation NLL, or None when unknown).

Examples:
    >>> make_env("mirrorgrid", size=4).eval_tasks()[0]
    MirrorTask(start=(0, 0), goal=(0, 1), flip=(False, False))
"""

from __future__ import annotations

from typing import Any

from echoloss.train.envs.mirrorgrid import MirrorGrid, MirrorTask, imagined_observation

__all__ = ["ENV_NAMES", "MirrorGrid", "MirrorTask", "imagined_observation", "make_env"]

ENV_NAMES = ("mirrorgrid", "mirrorgrid-shown", "mirrorgrid-noise", "gridwalk")


def make_env(
    name: str,
    *,
    size: int,
    max_turns: int | None = None,
    warmup_flip_prob: float = 0.0,
    demo_explore: float = 0.0,
) -> Any:
    """The environment called ``name`` (one of `ENV_NAMES`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name == "gridwalk":
        from echoloss.train.env import GridWalk

        return GridWalk(size=size, max_turns=max_turns, name=name)
    variants = {"mirrorgrid": "hidden", "mirrorgrid-shown": "shown", "mirrorgrid-noise": "noise"}
    if name not in variants:
        raise ValueError(f"env.name: expected one of {list(ENV_NAMES)}, got {name!r}")
    return MirrorGrid(
        size=size,
        max_turns=max_turns,
        variant=variants[name],  # type: ignore[arg-type]
        warmup_flip_prob=warmup_flip_prob,
        demo_explore=demo_explore,
        name=name,
    )
