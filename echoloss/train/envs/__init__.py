"""The trainer's tool environments, registered by name in one table: `ENVS`.

===================== =========================================================================
``mirrorgrid``        the default: secretly mirrored controls (`.mirrorgrid`); the
                      observation carries what the agent needs, with an exact CE floor
``mirrorgrid-shown``  control: the mirroring printed in the first message (nothing hidden)
``mirrorgrid-noise``  control: one unpredictable digit after every observation
``gridwalk``          the first demo environment (`.gridwalk`): every observation prints the
                      optimal move, so it cannot test echo
``calculator``        for a real instruct model (`.calculator`): arithmetic questions, a
                      calculator tool called in the model's own tool-call format
===================== =========================================================================

Every environment implements the `echoloss.train.envs.base.Env` protocol: what training needs.
Measurements are optional capabilities, separate protocols checked with ``isinstance``
(`echoloss.train.envs.base.HeldoutObservations`, ``HiddenObservations``,
``ImaginedObservations``, ``TurnsNeeded``, ``ToolSchemas``); the built-in environments have
them. ``[env] name`` is validated against `ENVS`, and each entry declares which other ``[env]``
keys it takes (`EnvEntry.options`): the config refuses a value for a key the named environment
does not take.

Adding an environment: a module in this folder whose class has the members of ``Env`` (and of
the capabilities it offers), and one `EnvEntry` line in `ENVS` (the config, ``make_env``, the docs' name list and the tests that loop
over `ENVS` pick it up from there). A new ``[env]`` key also goes into
``echoloss.train.config.EnvConfig`` and the ``options`` of the entries that take it.

Examples:
    >>> make_env("mirrorgrid", size=4).eval_tasks()[0]
    MirrorTask(start=(0, 0), goal=(0, 1), flip=(False, False), keys=None)
    >>> ENVS["gridwalk"].options
    ('size', 'max_turns')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from echoloss.train.envs.base import (
    Env,
    Episode,
    HeldoutObservations,
    HiddenObservations,
    ImaginedObservations,
    ObservationKinds,
    TurnsNeeded,
)
from echoloss.train.envs.calculator import Calculator
from echoloss.train.envs.gridwalk import GridWalk
from echoloss.train.envs.mirrorgrid import MirrorGrid, MirrorTask, Variant, imagined_observation

__all__ = [
    "ENVS",
    "ENV_NAMES",
    "Calculator",
    "Env",
    "EnvEntry",
    "Episode",
    "GridWalk",
    "HeldoutObservations",
    "HiddenObservations",
    "ImaginedObservations",
    "MirrorGrid",
    "MirrorTask",
    "ObservationKinds",
    "TurnsNeeded",
    "imagined_observation",
    "make_env",
]


@dataclass(frozen=True)
class EnvEntry:
    """One registered environment.

    Attributes:
        build: makes the environment; called with ``name=`` (its registered name, for per-env
            metrics) and the keyword arguments named by ``options``.
        options: the ``[env]`` keys (besides ``name``) that it takes, in the order of
            ``EnvConfig``; any other key must keep its default.
        about: one line: what the environment is for.
    """

    build: Callable[..., Env[Any, Any]]
    options: tuple[str, ...]
    about: str


def _mirrorgrid(variant: Variant) -> Callable[..., MirrorGrid]:
    def build(**kwargs: Any) -> MirrorGrid:
        return MirrorGrid(variant=variant, **kwargs)

    return build


_GRID = ("size", "max_turns")
_MIRRORGRID = (*_GRID, "warmup_flip_prob", "demo_explore", "level", "world", "words")

#: Every environment the trainer can run, by ``[env] name`` (the first is the default).
ENVS: dict[str, EnvEntry] = {
    "mirrorgrid": EnvEntry(
        _mirrorgrid("hidden"), _MIRRORGRID, "secretly mirrored controls (the experiment's env)"
    ),
    "mirrorgrid-shown": EnvEntry(
        _mirrorgrid("shown"), _MIRRORGRID, "control: the mirroring printed in the first message"
    ),
    "mirrorgrid-noise": EnvEntry(
        _mirrorgrid("noise"), _MIRRORGRID, "control: a random digit after every observation"
    ),
    "gridwalk": EnvEntry(
        GridWalk, _GRID, "first demo env: observations print the optimal move (no echo test)"
    ),
    "calculator": EnvEntry(
        Calculator,
        ("max_turns", "eval_size"),
        "a real instruct model calls a calculator tool (pretrained)",
    ),
}

#: The registered names, in table order.
ENV_NAMES = tuple(ENVS)


def make_env(name: str, **options: Any) -> Env[Any, Any]:
    """The environment registered as ``name`` in `ENVS`, built with ``options`` (``[env]`` keys).

    Raises:
        ValueError: an unknown name (the message lists the registered ones), or an option the
            environment does not take (the message lists the ones it takes).

    Examples:
        >>> make_env("gridwalk", size=3).turn_limit
        6
        >>> make_env("gridwalk", size=3, demo_explore=0.2)
        Traceback (most recent call last):
        ...
        ValueError: env gridwalk does not take demo_explore; it takes: size, max_turns
    """
    entry = ENVS.get(name)
    if entry is None:
        raise ValueError(f"env.name: expected one of {list(ENVS)}, got {name!r}")
    unknown = [k for k in options if k not in entry.options]
    if unknown:
        raise ValueError(
            f"env {name} does not take {', '.join(unknown)}; it takes: {', '.join(entry.options)}"
        )
    return entry.build(name=name, **options)
