"""What the trainer needs from an environment: the `Env` protocol, and its optional capabilities.

An environment is any object with the members of `Env` (no base class to inherit): what training
needs and nothing else. The trainer plays it turn by turn (`Env.start`, `Env.act`), draws its
tasks from pure functions of ``(seed, index)`` (so a resumed run sees the tasks an uninterrupted
one would), warm-starts on its scripted demonstrations and evaluates success on its fixed
held-out tasks. Environments are registered by name in `echoloss.train.envs.ENVS`.

Measurements beyond training are optional capabilities, separate protocols checked with
``isinstance``; an env without one trains all the same, and the measurement is not reported:

* `HeldoutObservations`: held-out tasks, uniformly random walks on them and the exact
  (Bayes-optimal) NLL of their observations; the trainer then reports the held-out observation
  cross-entropy ``heldout_obs_ce`` against its floor ``obs_ce_floor``.
* `HiddenObservations`: the env marks the tokens of each observation that depend on hidden
  state (and their exact floor); with `HeldoutObservations`, the trainer also reports
  ``heldout_hidden_ce``.
* `ImaginedObservations`: the env recognises replies that imagine its observations instead of
  acting; the trainer then reports ``imagined_obs_rate`` and ``eval_imagined_rate``.
* `TurnsNeeded`: the fewest turns in which every task can be solved; the config then warns about
  a smaller ``env.max_turns``.
* `ToolSchemas`: the env's tools have JSON schemas, passed to the chat template
  (``apply_chat_template(tools=...)``) wherever the trainer renders its conversations
  (`tool_schemas`).

Examples:
    >>> from echoloss.train.envs import make_env
    >>> env = make_env("mirrorgrid", size=4)
    >>> isinstance(env, Env), isinstance(env, HeldoutObservations), isinstance(env, HiddenObservations)
    (True, True, True)
    >>> isinstance(make_env("gridwalk", size=4), HiddenObservations)
    False
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "Env",
    "Episode",
    "HeldoutObservations",
    "HiddenObservations",
    "ImaginedObservations",
    "Message",
    "ObservationKinds",
    "ToolSchemas",
    "TurnsNeeded",
    "tool_schemas",
]

#: One chat message: ``{"role": ..., "content": ...}`` (tool messages also carry ``"name"``).
Message = dict[str, Any]

TaskT = TypeVar("TaskT")
EpisodeT = TypeVar("EpisodeT", bound="Episode")


@runtime_checkable
class Episode(Protocol):
    """A conversation in progress, as the trainer reads and updates it.

    Attributes:
        messages: the chat so far (system, user, then assistant/tool turns); `Env.act` appends.
        turns: assistant turns taken.
        done: the episode is over (the agent ended it, or it ran out of turns).
        reward: the episode's reward (final once ``done``).
        stats: per-episode counters, averaged into per-env metrics (``invalid`` counts replies
            that are no action; the trainer adds ``imagined``).
    """

    messages: list[Message]
    turns: int
    done: bool
    reward: float
    stats: dict[str, float]


@runtime_checkable
class Env(Protocol[TaskT, EpisodeT]):
    """A multi-turn tool environment the trainer can warm-start on, train on and evaluate: only
    what training needs (measurements are the optional capabilities of this module).

    ``TaskT`` is the env's task type (whatever `start` needs; a frozen dataclass in the built-in
    envs) and ``EpisodeT`` its `Episode` type. Every task-drawing method is a pure function of
    its arguments.
    """

    @property
    def name(self) -> str:
        """The env's name in per-env metrics and rollout records."""
        ...

    @property
    def turn_limit(self) -> int:
        """Assistant turns after which an episode ends (with reward 0 unless solved)."""
        ...

    def task(self, *, seed: int, index: int) -> TaskT:
        """Training task ``index`` of the stream ``seed`` (RL rollouts)."""
        ...

    def warmup_task(self, *, seed: int, index: int) -> TaskT:
        """Warm-up task ``index`` of the stream ``seed`` (the scripted demonstrations)."""
        ...

    def eval_tasks(self) -> Sequence[TaskT]:
        """The fixed held-out evaluation set (empty: the env has none, success is not measured)."""
        ...

    def start(self, task: TaskT) -> EpisodeT:
        """A new episode on ``task``: its first messages (system, user)."""
        ...

    def act(self, episode: EpisodeT, text: str) -> str | None:
        """Apply the assistant's reply ``text``: appends it (and the tool's answer, if any) to
        ``episode.messages``; returns the observation, or None when the episode ended."""
        ...

    def demonstration(self, task: TaskT, rng: random.Random) -> list[Message]:
        """A scripted, finished conversation on ``task`` (the warm-start's data)."""
        ...


@runtime_checkable
class HeldoutObservations(Protocol[TaskT]):
    """An env with held-out tasks, random walks on them and the exact NLL of their observations:
    the held-out observation cross-entropy and its floor."""

    def heldout_task(self, *, index: int) -> TaskT:
        """Held-out task ``index`` for the observation cross-entropy (no training step uses it)."""
        ...

    def random_walk(self, task: TaskT, rng: random.Random, turns: int) -> list[Message]:
        """A finished conversation of ``turns`` uniformly random actions (held-out data for the
        observation cross-entropy, independent of any policy)."""
        ...

    def observation_nats(self, messages: list[Message]) -> float:
        """The Bayes-optimal total NLL (nats) of the observation bodies of ``messages``, each
        given everything before it (the floor of the observation cross-entropy)."""
        ...


@runtime_checkable
class ImaginedObservations(Protocol):
    """An env that recognises replies imagining its observations instead of acting."""

    def imagined_observation(self, reply: str) -> bool:
        """Whether an assistant reply contains chat scaffold or text that looks like this env's
        observations (the reply imagines the environment instead of acting)."""
        ...


@runtime_checkable
class TurnsNeeded(Protocol):
    """An env that knows the fewest turns in which every task can be solved."""

    @property
    def turns_needed(self) -> int:
        """The fewest assistant turns in which every task's scripted `demonstration` finishes
        (a smaller turn limit leaves some tasks unsolvable; the config warns)."""
        ...


@runtime_checkable
class HiddenObservations(Protocol):
    """An env whose observations depend on hidden state, with the dependent tokens marked."""

    def hidden_spans(self, messages: list[Message]) -> dict[int, tuple[int, int]]:
        """Message index -> character span (in its content) of the part of that observation
        that depends on the hidden state."""
        ...

    def hidden_nats(self, messages: list[Message]) -> float:
        """The Bayes-optimal total NLL (nats) of the `hidden_spans`."""
        ...


@runtime_checkable
class ObservationKinds(Protocol):
    """An env whose observations come in kinds (the calculator's results and error messages):
    the held-out CE is reported per kind, and ``echo.error_weight`` weights the ``"error"``
    kind in the echo term."""

    def observation_kinds(self, messages: list[Message]) -> dict[str, dict[int, tuple[int, int]]]:
        """Kind -> (message index -> character span of that observation's content)."""
        ...


@runtime_checkable
class ToolSchemas(Protocol):
    """An env whose tools have JSON schemas (OpenAI function format)."""

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The schemas, as ``apply_chat_template(tools=...)`` takes them."""
        ...


def tool_schemas(env: object) -> list[dict[str, Any]] | None:
    """``env.tools`` for a `ToolSchemas` env, else None (what the chat template gets).

    Examples:
        >>> from echoloss.train.envs import make_env
        >>> tool_schemas(make_env("gridwalk", size=3)) is None
        True
    """
    return env.tools if isinstance(env, ToolSchemas) else None
