"""``mirrorgrid``: a grid whose controls are secretly mirrored, per episode and per axis.

The agent must walk from a start cell to a goal cell and say ``done`` there. Each episode draws,
independently and uniformly, whether the x controls are mirrored (``right`` moves left) and
whether the y controls are (``down`` moves up). Nothing says which in advance: the ``move``
tool answers, after the fact, which way the agent actually went (``wall`` when it could not
move) and where the goal now is, relative to the agent (``goal dx,dy``, signed)::

    system     mirrorgrid 4
    user       start 1,2 goal +2,-2     <- the start cell, and the goal relative to it
    assistant  right
    tool       left goal +3,-2          <- x is mirrored: "right" moved left
    assistant  left
    tool       right goal +2,-2
    ...
    assistant  done                     -> reward 1 if the agent stands on the goal, else 0

Relative observations keep the *policy* simple for a tiny model (the sign says where the goal
is) and put all the difficulty where the experiment wants it: the mirroring, which only the
outcomes of the agent's own moves reveal. The direction word is the observation's
*hidden-dependent* token (`MirrorGrid.hidden_spans`): the only part of an observation that the
mirroring decides; the rest follows from it and from what came before.

Why this environment tests the echo claim (``docs/experiment.md``):

* **The observation carries what the agent needs.** One move per axis reveals that axis's
  mirroring; acting well afterwards needs exactly that knowledge, and predicting the next
  observation needs the same knowledge. A world model (what echo trains) and a policy (what RL
  trains) share one hidden variable.
* **The observation CE has an exact floor** (`MirrorGrid.observation_nats`): the first move
  along an axis is a fair coin for the direction word (``log 2`` nats: both outcomes are
  distinct cells, or a cell and the wall), every later observation is deterministic given the moves seen
  (walls included: the start cell is in the first message).
  Under the uniform prior this equals ``log 4 − log(#mirrorings consistent with the episode)``,
  which `consistent_mirrorings` computes by enumeration.
* **Held-out tasks are really held out**: the (start, goal) pairs are split once, by a fixed
  seed, into training pairs (warm-up and RL) and evaluation pairs (`MirrorGrid.eval_tasks`),
  with all four mirrorings of each evaluation pair in the evaluation set.

Two controls, same dynamics:

* ``variant="shown"`` prints the mirroring in the first user message (``flip 1,0``): nothing is
  hidden, every observation is deterministic (floor 0): echo should cost nothing and help little.
* ``variant="noise"`` appends one uniformly random digit to every observation
  (``left goal +3,-2 7``):
  ``log 10`` nats per observation that no model can learn. If echo helped through generic
  regularisation it would help here as much; it can only help through the world model.

Two levels of persistence of the hidden dynamics (``level``):

* ``"per-episode"`` (the default, above): the mirroring is drawn again for every episode, so the
  only world model to learn is an inference from the episode's own history.
* ``"per-world"``: one fixed random permutation of the four directions per world (``world``, a
  seed; never the identity) says where each key moves (``right`` may move up), the same in every
  RL and evaluation episode. A model that knows the world predicts every direction word exactly
  (CE floor 0 given the world); learning it means learning something that persists across
  episodes, the way a pretrained agent learns how a tool behaves. Warm-up tasks stay in the
  ordinary world (`warmup_task`).

``words="compass"`` gives the observations their own vocabulary (``north``, ``south``,
``west``, ``east``, ``wall``), sharing no token with the action keys::

    user       start 1,2 goal +2,-2
    assistant  right
    tool       west goal +3,-2

Tasks are pure functions of ``(seed, index)``: a resumed run sees exactly the tasks an
uninterrupted run would.

Examples:
    >>> env = MirrorGrid(size=4)
    >>> task = MirrorTask(start=(1, 2), goal=(3, 0), flip=(True, False))
    >>> episode = env.start(task)
    >>> episode.messages[-1]["content"]
    'start 1,2 goal +2,-2'
    >>> env.act(episode, "right"), env.act(episode, "left"), env.act(episode, "left")
    ('left goal +3,-2', 'right goal +2,-2', 'right goal +1,-2')
    >>> env.act(episode, "up"), env.act(episode, "jump")
    ('up goal +1,-1', 'error')
    >>> round(env.observation_nats(episode.messages), 6) == round(2 * math.log(2), 6)
    True
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "MirrorGrid",
    "MirrorTask",
    "consistent_mirrorings",
    "imagined_observation",
    "world_permutation",
]

MOVES: dict[str, tuple[int, int]] = {
    "up": (0, -1),
    "down": (0, 1),
    "left": (-1, 0),
    "right": (1, 0),
}
TOOL_NAME = "move"
_KEYS = ({1: "right", -1: "left"}, {1: "down", -1: "up"})  # per axis: direction -> key
Variant = Literal["hidden", "shown", "noise"]
Level = Literal["per-episode", "per-world"]
Words = Literal["keys", "compass"]
# The observation's direction words: the key names themselves, or their own vocabulary.
_WORDS: dict[str, dict[str, str]] = {
    "keys": {name: name for name in MOVES} | {"wall": "wall"},
    "compass": {"up": "north", "down": "south", "left": "west", "right": "east", "wall": "wall"},
}
_SPLIT_SEED = "mirrorgrid-split-v1"  # fixed: the evaluation pairs never depend on the run's seed


@dataclass(frozen=True)
class MirrorTask:
    """Start and goal ``(x, y)`` (x right, y down) and the hidden dynamics: the mirroring per
    axis, or (a per-world task) ``keys``, the direction each key moves (names of ``MOVES``, in the
    order up, down, left, right), with ``flip`` then ``(False, False)``."""

    start: tuple[int, int]
    goal: tuple[int, int]
    flip: tuple[bool, bool]
    keys: tuple[str, str, str, str] | None = None

    def __post_init__(self) -> None:
        if self.keys is not None:
            if sorted(self.keys) != sorted(MOVES):
                raise ValueError(
                    f"MirrorTask.keys must be a permutation of {list(MOVES)}, got {self.keys!r}"
                )
            if any(self.flip):
                raise ValueError(
                    f"MirrorTask: a task with keys (a per-world permutation) has flip "
                    f"(False, False), got flip={self.flip}"
                )


def world_permutation(world: int) -> tuple[str, str, str, str]:
    """The per-world dynamics of world ``world``: the direction each key moves (in the order
    up, down, left, right), a uniformly random permutation other than the identity.

    Examples:
        >>> world_permutation(0) != ("up", "down", "left", "right")
        True
        >>> sorted(world_permutation(3)) == sorted(MOVES)
        True
    """
    rng = random.Random(f"mirrorgrid-world/{world}")
    keys = list(MOVES)
    while True:
        perm = list(keys)
        rng.shuffle(perm)
        if perm != keys:
            return (perm[0], perm[1], perm[2], perm[3])


def _delta(task: MirrorTask, action: str) -> tuple[int, int]:
    """The move ``action`` makes in ``task``'s world."""
    if task.keys is not None:
        return MOVES[task.keys[list(MOVES).index(action)]]
    return _flipped(MOVES[action], task.flip)


def _flipped(d: tuple[int, int], flip: tuple[bool, bool]) -> tuple[int, int]:
    return (-d[0] if flip[0] else d[0], -d[1] if flip[1] else d[1])


@dataclass
class MirrorEpisode:
    """A conversation in progress (an `echoloss.train.envs.base.Episode`; ``rng`` draws the
    noise digits)."""

    task: MirrorTask
    messages: list[dict[str, Any]]
    pos: tuple[int, int]
    rng: random.Random
    turns: int = 0
    done: bool = False
    reward: float = 0.0
    stats: dict[str, float] = field(default_factory=lambda: {"walls": 0.0, "invalid": 0.0})


def _step(size: int, pos: tuple[int, int], delta: tuple[int, int]) -> tuple[int, int]:
    """Where the move ``delta`` leads from ``pos`` (a wall keeps the agent in place)."""
    x, y = pos[0] + delta[0], pos[1] + delta[1]
    return (x, y) if 0 <= x < size and 0 <= y < size else pos


def consistent_mirrorings(size: int, messages: list[dict[str, Any]]) -> list[tuple[bool, bool]]:
    """The mirrorings under which every ``pos`` observation of ``messages`` is what the dynamics
    give (by enumeration of the four; used to check `MirrorGrid.observation_nats`).

    Examples:
        >>> msgs = [{"role": "user", "content": "start 0,0 goal +1,+1"},
        ...         {"role": "assistant", "content": "right"},
        ...         {"role": "tool", "content": "wall goal +1,+1"}]
        >>> consistent_mirrorings(2, msgs)
        [(True, False), (True, True)]
    """
    start, goal = _parse_start(messages)
    out = []
    for flip in [(False, False), (True, False), (False, True), (True, True)]:
        pos, ok = start, True
        for action, obs in _moves_and_observations(messages):
            if action in MOVES:
                pos = _step(size, pos, _flipped(MOVES[action], flip))
                ok = ok and obs.split()[2] == _relative(pos, goal)
        if ok:
            out.append(flip)
    return out


def _went(before: tuple[int, int], after: tuple[int, int], words: str = "keys") -> str:
    """The direction the agent actually moved (``wall`` when it stayed), in ``words``."""
    d = (after[0] - before[0], after[1] - before[1])
    return _WORDS[words][next((name for name, v in MOVES.items() if v == d), "wall")]


def _relative(pos: tuple[int, int], goal: tuple[int, int]) -> str:
    """``+2,-1``: the goal relative to ``pos`` (a signed number per axis, ``0`` unsigned)."""

    def signed(d: int) -> str:
        return f"{d:+d}" if d else "0"

    return f"{signed(goal[0] - pos[0])},{signed(goal[1] - pos[1])}"


def _parse_start(messages: list[dict[str, Any]]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The start cell and the goal cell from the first user message."""
    words = next(m["content"] for m in messages if m["role"] == "user").split()
    sx, sy = (int(v) for v in words[1].split(","))
    dx, dy = (int(v) for v in words[3].split(","))
    return (sx, sy), (sx + dx, sy + dy)


def _moves_and_observations(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(assistant reply, tool answer)`` pairs, in order (the reply before each tool message)."""
    pairs = []
    for prev, msg in itertools.pairwise(messages):
        if msg["role"] == "tool" and prev["role"] == "assistant":
            pairs.append((prev["content"].strip(), msg["content"]))
    return pairs


@dataclass(frozen=True)
class MirrorGrid:
    """Walk to the goal with secretly mirrored controls (see the module docstring).

    Args:
        size: the grid's side (2 to 10: one digit per coordinate).
        max_turns: assistant turns before the episode ends with reward 0 (None = the longest
            shortest path, one probing move and one return move per axis, ``done`` and one spare).
        variant: ``"hidden"`` (the experiment), ``"shown"`` (mirroring printed: the no-cost
            control) or ``"noise"`` (a random digit after every observation: the regulariser
            control).
        eval_fraction: the share of (start, goal) pairs held out for evaluation.
        warmup_flip_prob: the probability that an axis is mirrored in a *warm-up* task
            (`warmup_task`). RL and evaluation tasks always mirror each axis with probability
            ½. 0 (the default): the warm-start sees only the ordinary, unmirrored world, the way
            a pretrained model knows how tools usually behave; what the mirroring does is
            then only learnt from RL episodes.
        demo_explore: the probability that a turn of a scripted `demonstration` is a random
            move (exploration in the warm-start's data: moves away from the goal, walls and
            recoveries; the warm-started policy keeps that much entropy to explore with).
        name: the env name used for per-env metrics.
        level: ``"per-episode"`` (the mirroring drawn again every episode) or ``"per-world"``
            (one fixed permutation of the directions, `world_permutation`, in every RL and
            evaluation task; warm-up tasks stay in the ordinary world).
        world: the per-world level's world (a seed: the experiment uses the run's seed).
        words: the observation's direction words: ``"keys"`` (``left``, the key names) or
            ``"compass"`` (``west``: a vocabulary of their own, no token shared with the keys).
    """

    size: int = 4
    max_turns: int | None = None
    variant: Variant = "hidden"
    eval_fraction: float = 0.25
    warmup_flip_prob: float = 0.0
    demo_explore: float = 0.0
    name: str = "mirrorgrid"
    level: Level = "per-episode"
    world: int = 0
    words: Words = "keys"

    def __post_init__(self) -> None:
        if not 2 <= self.size <= 10:
            raise ValueError(
                f"MirrorGrid.size must be in [2, 10] (one digit per coordinate), got {self.size}"
            )
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"MirrorGrid.max_turns must be ≥ 1, got {self.max_turns}")
        if self.variant not in ("hidden", "shown", "noise"):
            raise ValueError(
                f"MirrorGrid.variant must be 'hidden', 'shown' or 'noise', got {self.variant!r}"
            )
        if not 0 < self.eval_fraction < 1:
            raise ValueError(
                f"MirrorGrid.eval_fraction must be in (0, 1), got {self.eval_fraction}"
            )
        if not 0 <= self.demo_explore < 1:
            raise ValueError(f"MirrorGrid.demo_explore must be in [0, 1), got {self.demo_explore}")
        if self.level not in ("per-episode", "per-world"):
            raise ValueError(
                f"MirrorGrid.level must be 'per-episode' or 'per-world', got {self.level!r}"
            )
        if self.words not in _WORDS:
            raise ValueError(f"MirrorGrid.words must be one of {list(_WORDS)}, got {self.words!r}")
        if self.level == "per-world" and self.variant == "shown":
            raise ValueError(
                "MirrorGrid: variant='shown' prints a per-episode mirroring; it has no per-world "
                "form (level='per-world' needs variant 'hidden' or 'noise')"
            )
        if not 0 <= self.warmup_flip_prob <= 1:
            raise ValueError(
                f"MirrorGrid.warmup_flip_prob must be in [0, 1], got {self.warmup_flip_prob}"
            )

    @property
    def turn_limit(self) -> int:
        return self.max_turns if self.max_turns is not None else 2 * (self.size - 1) + 6

    @property
    def turns_needed(self) -> int:
        """The farthest goal's ``2·(size−1)`` moves and ``done``, plus a probing move and a move
        back per axis where the mirroring is hidden (not in ``shown``)."""
        probes = 0 if self.variant == "shown" else 4
        return 2 * (self.size - 1) + 1 + probes

    @property
    def system_prompt(self) -> str:
        return f"mirrorgrid {self.size}"

    # -- tasks ------------------------------------------------------------------------------------

    def _pairs(self) -> tuple[list[tuple[tuple[int, int], tuple[int, int]]], ...]:
        cells = [(x, y) for x in range(self.size) for y in range(self.size)]
        pairs = [(s, g) for s in cells for g in cells if s != g]
        random.Random(f"{_SPLIT_SEED}/{self.size}").shuffle(pairs)
        k = max(1, round(len(pairs) * self.eval_fraction))
        return sorted(pairs[k:]), sorted(pairs[:k])

    def train_pairs(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """The (start, goal) pairs of warm-up and RL tasks (disjoint from `eval_pairs`)."""
        return self._pairs()[0]

    def eval_pairs(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """The held-out (start, goal) pairs: no warm-up or RL task uses one."""
        return self._pairs()[1]

    def _dynamics(
        self, start: tuple[int, int], goal: tuple[int, int], rng: random.Random
    ) -> MirrorTask:
        """A task on ``(start, goal)`` in this env's RL world: a fresh mirroring per episode, or
        the world's fixed permutation (the draws are made either way: same pairs at both levels)."""
        flip = (rng.random() < 0.5, rng.random() < 0.5)
        if self.level == "per-world":
            return MirrorTask(start, goal, (False, False), world_permutation(self.world))
        return MirrorTask(start, goal, flip)

    def task(self, *, seed: int, index: int) -> MirrorTask:
        """Training task ``index`` of the stream ``seed`` (a pure function: resumable)."""
        rng = random.Random(f"mirrorgrid/{self.size}/{seed}/{index}")
        start, goal = rng.choice(self.train_pairs())
        return self._dynamics(start, goal, rng)

    def warmup_task(self, *, seed: int, index: int) -> MirrorTask:
        """Warm-up task ``index``: the training task of the same index, with each axis mirrored
        with probability ``warmup_flip_prob`` instead of ½."""
        rng = random.Random(f"mirrorgrid/{self.size}/{seed}/{index}")
        start, goal = rng.choice(self.train_pairs())
        p = self.warmup_flip_prob
        return MirrorTask(start, goal, (rng.random() < p, rng.random() < p))

    def eval_tasks(self) -> list[MirrorTask]:
        """The fixed evaluation set: every held-out pair under each of the four mirrorings
        (per-world: every held-out pair once, in the world)."""
        if self.level == "per-world":
            keys = world_permutation(self.world)
            return [MirrorTask(s, g, (False, False), keys) for s, g in self.eval_pairs()]
        return [
            MirrorTask(s, g, (fx, fy))
            for s, g in self.eval_pairs()
            for fx in (False, True)
            for fy in (False, True)
        ]

    def heldout_task(self, *, index: int) -> MirrorTask:
        """Held-out task ``index`` for the observation CE (evaluation pairs, seeded mirroring)."""
        rng = random.Random(f"mirrorgrid-heldout/{self.size}/{index}")
        start, goal = rng.choice(self.eval_pairs())
        return self._dynamics(start, goal, rng)

    # -- the episode ------------------------------------------------------------------------------

    def start(self, task: MirrorTask) -> MirrorEpisode:
        """A new episode on ``task``: the system and user messages."""
        sx, sy = task.start
        text = f"start {sx},{sy} goal {_relative(task.start, task.goal)}"
        if self.variant == "shown":
            text += f" flip {int(task.flip[0])},{int(task.flip[1])}"
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": text},
        ]
        rng = random.Random(f"mirrorgrid-noise/{task}")  # noise digits: a function of the task
        return MirrorEpisode(task=task, messages=messages, pos=task.start, rng=rng)

    def act(self, episode: MirrorEpisode, text: str) -> str | None:
        """Apply the assistant's reply; returns the tool's observation, or None when it ends."""
        if episode.done:
            raise RuntimeError("act() on a finished episode")
        episode.messages.append({"role": "assistant", "content": text})
        episode.turns += 1
        action = text.strip()
        if action == "done":
            episode.done = True
            episode.reward = float(episode.pos == episode.task.goal)
            return None
        if action in MOVES:
            before = episode.pos
            new = _step(self.size, episode.pos, _delta(episode.task, action))
            episode.stats["walls"] += float(new == episode.pos)
            episode.pos = new
            obs = f"{_went(before, new, self.words)} goal {_relative(new, episode.task.goal)}"
            if self.variant == "noise":
                obs += f" {episode.rng.randrange(10)}"
        else:
            episode.stats["invalid"] += 1
            obs = "error"
        if episode.turns >= self.turn_limit:
            episode.done = True  # out of turns: the last observation is never shown to the model
            episode.reward = 0.0
            return None
        episode.messages.append({"role": "tool", "name": TOOL_NAME, "content": obs})
        return obs

    # -- scripted conversations -------------------------------------------------------------------

    def demonstration(self, task: MirrorTask, rng: random.Random) -> list[dict[str, Any]]:
        """The scripted conversation, which does *not* know the mirroring: per axis (x, then y)
        press the key that would move towards the goal unmirrored; once a move along an axis
        shows that axis's mirroring (the agent went the other way, or into a wall), press the
        other key; at the goal, ``done``. With probability ``demo_explore`` a turn is a
        uniformly random move instead (what it shows about the mirroring is used too), so the
        demonstrations also cover moves away from the goal, walls and recoveries. With
        ``demo_explore = 0`` this is the Bayes-optimal policy. A per-world task (``task.keys``)
        is played knowing its world: the key that moves towards the goal is pressed at once."""
        if task.keys is not None:
            return self._world_demonstration(task, rng)
        episode = self.start(task)
        shown = self.variant == "shown"
        flipped: list[bool | None] = [task.flip[0], task.flip[1]] if shown else [None, None]
        while not episode.done:
            axis = next((a for a in (0, 1) if episode.pos[a] != task.goal[a]), None)
            if axis is None:
                self.act(episode, "done")
                break
            if rng.random() < self.demo_explore:
                key = rng.choice(list(MOVES))
            else:
                sign = 1 if task.goal[axis] > episode.pos[axis] else -1
                if flipped[axis]:
                    sign = -sign
                key = _KEYS[axis][sign]
            before = episode.pos
            self.act(episode, key)
            moved_axis = 0 if key in ("left", "right") else 1
            if flipped[moved_axis] is None:
                pressed = MOVES[key][moved_axis]
                went = episode.pos[moved_axis] - before[moved_axis]
                if went == 0:  # a wall: the agent tried to leave the grid on that side
                    went = -1 if before[moved_axis] == 0 else 1
                flipped[moved_axis] = went != pressed
        return episode.messages

    def _world_demonstration(self, task: MirrorTask, rng: random.Random) -> list[dict[str, Any]]:
        assert task.keys is not None
        episode = self.start(task)
        key_for = {MOVES[went]: key for key, went in zip(MOVES, task.keys, strict=True)}
        while not episode.done:
            axis = next((a for a in (0, 1) if episode.pos[a] != task.goal[a]), None)
            if axis is None:
                self.act(episode, "done")
                break
            if rng.random() < self.demo_explore:
                key = rng.choice(list(MOVES))
            else:
                sign = 1 if task.goal[axis] > episode.pos[axis] else -1
                key = key_for[(sign, 0) if axis == 0 else (0, sign)]
            self.act(episode, key)
        return episode.messages

    def random_walk(self, task: MirrorTask, rng: random.Random, turns: int) -> list[dict[str, Any]]:
        """``turns`` uniformly random moves, then ``done``: held-out data for the observation CE,
        independent of any policy."""
        episode = self.start(task)
        for _ in range(min(turns, self.turn_limit - 1)):
            self.act(episode, rng.choice(list(MOVES)))
        self.act(episode, "done")
        return episode.messages

    def imagined_observation(self, reply: str) -> bool:
        """Whether ``reply`` holds scaffold or observation-like text (`imagined_observation`)."""
        return imagined_observation(reply)

    # -- the floor --------------------------------------------------------------------------------

    def hidden_spans(self, messages: list[dict[str, Any]]) -> dict[int, tuple[int, int]]:
        """The *hidden-dependent* part of each observation: for every tool message that answers
        a move, the character span (in its content) of the direction word (``left`` in
        ``left goal +3,-2``). Only this word depends on the mirroring (the goal numbers follow
        from it and from the previous observation; a noise digit depends on nothing).

        Examples:
            >>> env = MirrorGrid(size=4)
            >>> msgs = env.random_walk(MirrorTask((1, 2), (3, 0), (True, False)),
            ...                        random.Random(0), turns=2)
            >>> [(msgs[i - 1]["content"], msgs[i]["content"][a:b])
            ...  for i, (a, b) in env.hidden_spans(msgs).items()]
            [('right', 'left'), ('right', 'wall')]
        """
        out: dict[int, tuple[int, int]] = {}
        for i in range(1, len(messages)):
            prev, msg = messages[i - 1], messages[i]
            action = prev["content"].strip() if prev["role"] == "assistant" else ""
            if msg["role"] != "tool" or action not in MOVES:
                continue
            out[i] = (0, msg["content"].index(" "))  # the direction actually moved, or "wall"
        return out

    def hidden_tokens(self, messages: list[dict[str, Any]]) -> dict[int, tuple[str, str, float]]:
        """Per `hidden_spans` entry (message index): its word kind (``"move"`` or ``"wall"``),
        ``"first"`` or ``"later"``, and its Bayes-optimal NLL in nats given everything before it.

        ``"first"``: per episode, the first move along that axis (a fair coin: ``log 2``; every
        later word follows from the moves seen); per world, the first press of that key in the
        episode (a model that only reads the episode's history cannot know it; one that knows
        the world can). The NLL is exact: the posterior over the four mirrorings (per episode),
        0 given the world (per world) or given the printed mirroring (``shown``).

        Examples:
            >>> env = MirrorGrid(size=4)
            >>> msgs = env.random_walk(MirrorTask((1, 2), (3, 0), (True, False)),
            ...                        random.Random(0), turns=2)
            >>> [(k, f, round(n, 4)) for k, f, n in env.hidden_tokens(msgs).values()]
            [('move', 'first', 0.6931), ('wall', 'later', 0.0)]
        """
        start, goal = _parse_start(messages)
        known = self.variant == "shown" or self.level == "per-world"
        flips = [(False, False), (True, False), (False, True), (True, True)]
        where = {f: start for f in flips}  # each mirroring still consistent, and its position
        seen_axes: set[int] = set()
        seen_keys: set[str] = set()
        out: dict[int, tuple[str, str, float]] = {}
        spans = self.hidden_spans(messages)
        for i in sorted(spans):
            action, obs = messages[i - 1]["content"].strip(), messages[i]["content"]
            word = obs[spans[i][0] : spans[i][1]]
            axis = 0 if action in ("left", "right") else 1
            first = (
                (action not in seen_keys) if self.level == "per-world" else (axis not in seen_axes)
            )
            seen_axes.add(axis)
            seen_keys.add(action)
            nats = 0.0
            if not known:
                outcome = {}
                for f, pos in where.items():
                    new = _step(self.size, pos, _flipped(MOVES[action], f))
                    outcome[f] = (new, _went(pos, new, self.words))
                agree = [f for f in where if outcome[f][1] == word]
                if not agree:
                    raise ValueError(
                        f"message {i}: observation {obs!r} is impossible under every mirroring "
                        "consistent with the episode so far"
                    )
                nats = math.log(len(where) / len(agree))
                where = {f: outcome[f][0] for f in agree}
            kind = "wall" if word == "wall" else "move"
            out[i] = (kind, "first" if first else "later", nats)
        del goal
        return out

    def hidden_nats(self, messages: list[dict[str, Any]]) -> float:
        """The Bayes-optimal total NLL (nats) of the `hidden_spans`: ``log 2`` for the first
        move along each axis (``0`` in the ``shown`` variant, where nothing is hidden, and at the
        per-world level, given the world)."""
        return sum(n for _, _, n in self.hidden_tokens(messages).values())

    def observation_nats(self, messages: list[dict[str, Any]]) -> float:
        """The Bayes-optimal total NLL (nats) of the conversation's observation bodies given
        everything before each: the `hidden_nats` (``log 2`` for the first move along each axis
        per episode, 0 per world), ``log 10`` per noise digit, 0 otherwise. Divide by the number
        of observation tokens for the floor in nats/token."""
        nats = self.hidden_nats(messages)
        if self.variant == "noise":
            moves = sum(1 for action, _ in _moves_and_observations(messages) if action in MOVES)
            nats += moves * math.log(10)
        return nats

    def noise_spans(self, messages: list[dict[str, Any]]) -> dict[int, tuple[int, int]]:
        """The uninformative part of each observation (``variant="noise"``): the character span
        of the random digit after each move's answer; empty in the other variants. The placebo
        arm echoes only these (a CE of the observation's kind that says nothing about the world).

        Examples:
            >>> env = MirrorGrid(size=4, variant="noise")
            >>> msgs = env.random_walk(MirrorTask((1, 2), (3, 0), (True, False)),
            ...                        random.Random(0), turns=1)
            >>> [msgs[i]["content"][a:b].isdigit() for i, (a, b) in env.noise_spans(msgs).items()]
            [True]
        """
        if self.variant != "noise":
            return {}
        out = {}
        for i in self.hidden_spans(messages):
            content = messages[i]["content"]
            out[i] = (len(content) - 1, len(content))
        return out

    def echo_spans(self, part: str, messages: list[dict[str, Any]]) -> dict[int, tuple[int, int]]:
        """The character spans of ``part`` of the observations: ``"hidden"`` (`hidden_spans`) or
        ``"noise"`` (`noise_spans`)."""
        if part == "hidden":
            return self.hidden_spans(messages)
        if part == "noise":
            return self.noise_spans(messages)
        raise ValueError(f"echo_spans: part must be 'hidden' or 'noise', got {part!r}")


def imagined_observation(text: str) -> bool:
    """Whether an assistant reply contains environment scaffold or observation-like text: chat
    or tool tags, a role name, ``pos``/``error``/``start``/``goal``/``wall``, a signed number
    (``-2``) or a coordinate pair (``1,2``, ``+1,-2``).

    Examples:
        >>> imagined_observation("left"), imagined_observation("pos 1,2"), imagined_observation("h8|")
        (False, True, False)
        >>> imagined_observation("</tool_response>"), imagined_observation("wall -2")
        (True, True)
    """
    import re

    return bool(
        re.search(
            r"<\|?/?(tool_response|im_start|im_end)"
            r"|\b(pos|error|start|goal|wall|user|system|tool)\b"
            r"|\d\s*,\s*[+-]?\d|[+-]\d",
            text,
        )
    )
