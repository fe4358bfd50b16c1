"""``gridwalk``: the first demo environment (every observation prints the optimal move).

The agent stands on a small square grid and must walk to a goal, one tool call per turn, then say
``done``. The first user message states where it starts and where the goal is::

    system     Grid 4x4, x right, y down. Move with up, down, left or right. Say done at the goal.
    user       start 1,2 goal 3,0
    assistant  up
    tool       pos 1,1 goal 3,0         <- the ``move`` tool's answer
    assistant  right
    tool       pos 2,1 goal 3,0
    ...
    assistant  done                     -> reward 1 if the agent stands on the goal, else 0

Why this environment:

* **Observations are deterministic, learnable functions of the actions.** The ``move`` tool
  answers ``pos x,y goal gx,gy`` (the new position, and the goal again), ``wall x,y goal gx,gy``
  when the move would leave the grid (the position does not change) or ``error: unknown move``
  for anything that is not a move. Predicting the answer needs the previous position, the action
  and the goal: a small world model that a tiny model can learn, and that the echo term trains
  directly (RL alone never predicts these tokens).
* **The policy can read its state locally.** Repeating the goal in every observation puts
  everything the next move depends on in the last message, which a two-layer model can learn
  to compare.
* **The reward is reachable by a tiny model.** The optimal policy is a comparison of two digits per
  axis; a short scripted warm-start on shortest-path demonstrations (see
  `demonstration`) teaches the format, RL does the rest.
* **Everything is text in chat messages.** Observations are ``tool`` messages rendered by the chat
  template, so attribution, echo weights, interleaving and packing are the library's own path.

Tasks are a pure function of ``(seed, index)``, so a run's data position is just a task index and
a resumed run sees exactly the tasks an uninterrupted run would.

Examples:
    >>> env = GridWalk(size=4)
    >>> env.start(Task(start=(1, 2), goal=(2, 1))).messages[-1]["content"]
    'start 1,2 goal 2,1 hint right'
    >>> episode = env.start(Task(start=(1, 2), goal=(2, 1)))
    >>> env.act(episode, "up"), env.act(episode, "right"), env.act(episode, "right")
    ('pos 1,1 goal 2,1 hint right', 'pos 2,1 goal 2,1 hint done', 'pos 3,1 goal 2,1 hint left')
    >>> env.act(episode, "right"), env.act(episode, "jump")
    ('wall 3,1 goal 2,1 hint left', 'error: unknown move')
    >>> env.act(episode, "done"), episode.reward, episode.done
    (None, 0.0, True)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from echoloss.train.envs.mirrorgrid import imagined_observation

__all__ = ["Episode", "GridWalk", "Task", "demonstration", "random_walk"]

MOVES = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
TOOL_NAME = "move"


@dataclass(frozen=True)
class Task:
    """Where the agent starts and where the goal is, ``(x, y)`` with ``x`` right and ``y`` down."""

    start: tuple[int, int]
    goal: tuple[int, int]


@dataclass
class Episode:
    """A conversation in progress.

    Attributes:
        task: the task.
        messages: the chat so far (system, user, then assistant/tool pairs).
        pos: the agent's current position.
        turns: assistant turns taken.
        done: the episode is over (``done`` said, or out of turns).
        reward: 1.0 if the agent said ``done`` on the goal, else 0.0 (set when ``done``).
        stats: per-episode counters reported as per-env metrics (walls hit, invalid moves).
    """

    task: Task
    messages: list[dict[str, Any]]
    pos: tuple[int, int]
    turns: int = 0
    done: bool = False
    reward: float = 0.0
    stats: dict[str, float] = field(default_factory=lambda: {"walls": 0.0, "invalid": 0.0})


@dataclass(frozen=True)
class GridWalk:
    """Walk to the goal on a ``size × size`` grid (see the module docstring).

    Args:
        size: the grid's side (2 to 10, so that every coordinate is one digit).
        max_turns: assistant turns before the episode ends with reward 0 (None = the longest
            shortest path + 2: its moves, ``done``, and room for one mistake).
        name: the env name used for per-env metrics.
    """

    size: int = 4
    max_turns: int | None = None
    name: str = "gridwalk"

    def __post_init__(self) -> None:
        if not 2 <= self.size <= 10:
            raise ValueError(
                f"GridWalk.size must be in [2, 10] (one digit per coordinate), got {self.size}"
            )
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"GridWalk.max_turns must be ≥ 1, got {self.max_turns}")

    @property
    def turn_limit(self) -> int:
        return self.max_turns if self.max_turns is not None else 2 * (self.size - 1) + 2

    @property
    def turns_needed(self) -> int:
        """The farthest goal's ``2·(size−1)`` moves, then ``done``."""
        return 2 * (self.size - 1) + 1

    @property
    def system_prompt(self) -> str:
        n = self.size
        return f"Grid {n}x{n}, x right, y down. Moves: up down left right. Say done at the goal."

    def task(self, *, seed: int, index: int) -> Task:
        """Task number ``index`` of the stream ``seed`` (a pure function: resumable, shardable)."""
        rng = random.Random(f"gridwalk/{self.size}/{seed}/{index}")
        cells = [(x, y) for x in range(self.size) for y in range(self.size)]
        start, goal = rng.sample(cells, 2)
        return Task(start=start, goal=goal)

    def warmup_task(self, *, seed: int, index: int) -> Task:
        """The warm-up's task ``index``: the training task (gridwalk has one world)."""
        return self.task(seed=seed, index=index)

    def heldout_task(self, *, index: int) -> Task:
        """Held-out task ``index`` (a stream no training step draws from; the pairs overlap the
        training pairs: gridwalk has no disjoint split)."""
        return self.task(seed=-1, index=index)

    def eval_tasks(self) -> list[Task]:
        """No fixed held-out evaluation set (gridwalk's 240 pairs are all training pairs)."""
        return []

    def observation_nats(self, messages: list[dict[str, Any]]) -> float:
        """The Bayes-optimal NLL of the observations: 0 (every observation is deterministic)."""
        del messages
        return 0.0

    def imagined_observation(self, reply: str) -> bool:
        """Whether ``reply`` holds scaffold or observation-like text (`imagined_observation`)."""
        return imagined_observation(reply)

    def demonstration(self, task: Task, rng: random.Random) -> list[dict[str, Any]]:
        """`demonstration` as a method (the `Env` protocol's member)."""
        return demonstration(self, task, rng)

    def random_walk(self, task: Task, rng: random.Random, turns: int) -> list[dict[str, Any]]:
        """`random_walk` as a method (the `Env` protocol's member)."""
        return random_walk(self, task, rng, turns)

    def start(self, task: Task) -> Episode:
        """A new episode on ``task``: the system and user messages."""
        (sx, sy), (gx, gy) = task.start, task.goal
        messages = [
            {"role": "system", "content": self.system_prompt},
            {
                "role": "user",
                "content": f"start {sx},{sy} goal {gx},{gy} hint {hint(task.start, task.goal)}",
            },
        ]
        return Episode(task=task, messages=messages, pos=task.start)

    def observe(
        self, pos: tuple[int, int], action: str, goal: tuple[int, int]
    ) -> tuple[str, tuple[int, int]]:
        """The ``move`` tool: the observation text and the new position (a pure function)."""
        move = MOVES.get(action.strip())
        if move is None:
            return "error: unknown move", pos
        x, y = pos[0] + move[0], pos[1] + move[1]
        where = "pos"
        if not (0 <= x < self.size and 0 <= y < self.size):
            (x, y), where = pos, "wall"
        return f"{where} {x},{y} goal {goal[0]},{goal[1]} hint {hint((x, y), goal)}", (x, y)

    def act(self, episode: Episode, text: str) -> str | None:
        """Apply the assistant's reply; returns the tool's observation, or None when it ends.

        Appends the assistant message (and the tool message, if any) to ``episode.messages``.
        """
        if episode.done:
            raise RuntimeError("act() on a finished episode")
        episode.messages.append({"role": "assistant", "content": text})
        episode.turns += 1
        if text.strip() == "done":
            episode.done = True
            episode.reward = float(episode.pos == episode.task.goal)
            return None
        obs, new = self.observe(episode.pos, text, episode.task.goal)
        if obs.startswith("wall"):
            episode.stats["walls"] += 1
        elif obs.startswith("error"):
            episode.stats["invalid"] += 1
        episode.pos = new
        if episode.turns >= self.turn_limit:
            episode.done = True  # out of turns: the last observation is never shown to the model
            episode.reward = 0.0
            return None
        episode.messages.append({"role": "tool", "name": TOOL_NAME, "content": obs})
        return obs


def hint(pos: tuple[int, int], goal: tuple[int, int]) -> str:
    """The compass: the x move first, then the y move, ``done`` on the goal (a pure function)."""
    if pos[0] != goal[0]:
        return "right" if goal[0] > pos[0] else "left"
    if pos[1] != goal[1]:
        return "down" if goal[1] > pos[1] else "up"
    return "done"


def demonstration(env: GridWalk, task: Task, rng: random.Random) -> list[dict[str, Any]]:
    """A scripted shortest-path conversation for ``task`` (for the warm-start): the x moves,
    then the y moves (what the hint says), then ``done``. ``rng`` is unused (kept for scripted
    policies that randomise). A goal farther than ``env.turn_limit`` allows gives the
    conversation up to the last turn (the episode ends there, unsolved)."""
    (sx, sy), (gx, gy) = task.start, task.goal
    moves = ["right" if gx > sx else "left"] * abs(gx - sx)
    moves += ["down" if gy > sy else "up"] * abs(gy - sy)
    episode = env.start(task)
    for m in [*moves, "done"]:
        if episode.done:  # out of turns: acting again would be an error
            break
        env.act(episode, m)
    return episode.messages


def random_walk(env: GridWalk, task: Task, rng: random.Random, turns: int) -> list[dict[str, Any]]:
    """A conversation of ``turns`` uniformly random moves (walls included), ending with an
    assistant ``done``: held-out data for the observation cross-entropy, independent of any policy."""
    episode = env.start(task)
    for _ in range(min(turns, env.turn_limit - 1)):
        env.act(episode, rng.choice(list(MOVES)))
    env.act(episode, "done")
    return episode.messages
