"""The built-in environments: mirrorgrid's dynamics, its exact observation-CE floor, the held-out
split, the controls, and the imagined-observation diagnostic."""

from __future__ import annotations

import math
import random

import pytest

from echoloss.train.envs import ENV_NAMES, MirrorGrid, MirrorTask, imagined_observation, make_env
from echoloss.train.envs.mirrorgrid import MOVES, consistent_mirrorings


def _contents(messages):
    return [m["content"] for m in messages]


def test_exact_observations_under_each_mirroring():
    env = MirrorGrid(size=4)
    # x mirrored: "right" moves left; y plain. Start (1, 2), goal (3, 0).
    ep = env.start(MirrorTask(start=(1, 2), goal=(3, 0), flip=(True, False)))
    assert _contents(ep.messages) == ["mirrorgrid 4", "start 1,2 goal +2,-2"]
    assert [env.act(ep, a) for a in ("right", "right", "left", "up", "down")] == [
        "goal +3,-2",  # moved to x = 0
        "goal +3,-2",  # the wall at x = 0: no move
        "goal +2,-2",
        "goal +2,-1",
        "goal +2,-2",
    ]
    assert env.act(ep, "jump") == "error" and ep.stats == {"walls": 1.0, "invalid": 1.0}
    # y mirrored: "down" moves up; reaching the goal and saying done pays 1.
    ep = env.start(MirrorTask(start=(0, 1), goal=(0, 0), flip=(False, True)))
    assert env.act(ep, "down") == "goal 0,0"
    assert env.act(ep, "done") is None and ep.done and ep.reward == 1.0


def test_controls_print_the_mirroring_or_add_noise():
    task = MirrorTask(start=(1, 2), goal=(3, 0), flip=(True, False))
    shown = MirrorGrid(size=4, variant="shown")
    assert shown.start(task).messages[1]["content"] == "start 1,2 goal +2,-2 flip 1,0"
    noisy = MirrorGrid(size=4, variant="noise")
    ep = noisy.start(task)
    obs = [noisy.act(ep, "right") for _ in range(3)]
    assert [o.rsplit(" ", 1)[0] for o in obs] == ["goal +3,-2"] * 3
    assert all(o.rsplit(" ", 1)[1] in "0123456789" for o in obs)
    # The noise is a function of the task: the same episode twice gives the same digits.
    ep2 = noisy.start(task)
    assert [noisy.act(ep2, "right") for _ in range(3)] == obs


def _walks(env: MirrorGrid, n: int, seed: int = 0):
    rng = random.Random(seed)
    for i in range(n):
        task = env.task(seed=seed, index=i)
        yield env.random_walk(task, rng, turns=rng.randint(0, env.turn_limit - 1))


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_floor_matches_enumeration_over_the_four_mirrorings(size):
    # Under the uniform prior the Bayes NLL of all observations is -log P(observations)
    # = log 4 - log(#mirrorings consistent with them) (chain rule; the true one is consistent).
    env = MirrorGrid(size=size)
    for messages in _walks(env, 300, seed=size):
        consistent = consistent_mirrorings(size, messages)
        assert len(consistent) >= 1
        exact = math.log(4) - math.log(len(consistent))
        assert env.observation_nats(messages) == pytest.approx(exact, abs=1e-12)  # float sums
    # The noise control adds exactly log 10 per move observation; the shown control is 0.
    noisy, shown = MirrorGrid(size=size, variant="noise"), MirrorGrid(size=size, variant="shown")
    for messages in _walks(noisy, 100):
        moves = sum(1 for m in messages if m["role"] == "assistant" and m["content"] in MOVES)
        base = math.log(4) - math.log(len(consistent_mirrorings(size, messages)))
        assert noisy.observation_nats(messages) == pytest.approx(base + moves * math.log(10))
    assert all(shown.observation_nats(m) == 0.0 for m in _walks(shown, 50))


def test_floor_by_hand():
    env = MirrorGrid(size=3)
    ep = env.start(MirrorTask(start=(1, 1), goal=(2, 2), flip=(False, False)))
    for a in ("right", "left", "down", "up", "up"):
        env.act(ep, a)
    assert env.observation_nats(ep.messages) == pytest.approx(2 * math.log(2))
    ep = env.start(MirrorTask(start=(1, 1), goal=(2, 2), flip=(False, False)))
    for a in ("left", "left", "right"):  # one axis only
        env.act(ep, a)
    assert env.observation_nats(ep.messages) == pytest.approx(math.log(2))


@pytest.mark.parametrize("size", [3, 4, 5])
def test_heldout_split_is_disjoint_and_never_trained_on(size):
    env = MirrorGrid(size=size)
    train, held = set(env.train_pairs()), set(env.eval_pairs())
    assert not train & held
    assert len(train) + len(held) == size * size * (size * size - 1)
    assert len(held) == round(len(train | held) * env.eval_fraction)
    for i in range(2000):  # warm-up and RL draw from the same training stream
        t = env.task(seed=i % 7, index=i)
        assert (t.start, t.goal) in train
    tasks = env.eval_tasks()
    assert len(tasks) == 4 * len(held) == len(set(tasks))
    assert {(t.start, t.goal) for t in tasks} == held
    assert all((env.heldout_task(index=i).start, env.heldout_task(index=i).goal) in held
               for i in range(200))  # fmt: skip
    # The split does not depend on anything but the size: every seed evaluates the same tasks.
    assert MirrorGrid(size=size).eval_tasks() == tasks


def test_demonstrations_succeed_with_the_bayes_optimal_number_of_moves():
    env = MirrorGrid(size=4)
    for i in range(300):
        task = env.task(seed=1, index=i)
        messages = env.demonstration(task, random.Random(i))
        ep = env.start(task)
        for m in messages[2:]:
            if m["role"] == "assistant":
                env.act(ep, m["content"])
        assert ep.done and ep.reward == 1.0 and ep.turns <= env.turn_limit
        # Per axis that needs moves: |d| moves, plus 2 when mirrored (a probe away and back),
        # or 1 when mirrored against a wall (the probe bumps); then "done".
        extra = 0
        for axis in (0, 1):
            d = task.goal[axis] - task.start[axis]
            if d and task.flip[axis]:
                away = task.start[axis] - (1 if d > 0 else -1)
                extra += 2 if 0 <= away < 4 else 1
        moves = sum(abs(task.goal[a] - task.start[a]) for a in (0, 1))
        assert ep.turns == moves + extra + 1


def test_make_env_names_and_errors():
    for name in ENV_NAMES:
        assert make_env(name, size=3).name == name
    with pytest.raises(ValueError, match=r"env\.name: expected one of"):
        make_env("maze", size=3)
    with pytest.raises(ValueError, match="variant"):
        MirrorGrid(variant="loud")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reply", "imagined"),
    [
        ("left", False),
        ("done", False),
        ("h8|", False),
        ("goal +1,-2", True),
        ("+1,-2", True),
        ("pos 1,2", True),
        ("<tool_response>", True),
        ("</tool_response>", True),
        ("<|im_start|>user", True),
        ("right\nuser", True),
    ],
)
def test_imagined_observation(reply, imagined):
    assert imagined_observation(reply) is imagined
