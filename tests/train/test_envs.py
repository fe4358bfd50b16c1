"""The built-in environments: mirrorgrid's dynamics, its exact observation-CE floor, the held-out
split, the controls, and the imagined-observation diagnostic."""

from __future__ import annotations

import math
import random

import pytest

from echoloss.train.envs import (
    ENV_NAMES,
    ENVS,
    Env,
    Episode,
    HiddenObservations,
    MirrorGrid,
    MirrorTask,
    imagined_observation,
    make_env,
)
from echoloss.train.envs.mirrorgrid import MOVES, consistent_mirrorings


def _contents(messages):
    return [m["content"] for m in messages]


def test_exact_observations_under_each_mirroring():
    env = MirrorGrid(size=4)
    # x mirrored: "right" moves left; y plain. Start (1, 2), goal (3, 0).
    ep = env.start(MirrorTask(start=(1, 2), goal=(3, 0), flip=(True, False)))
    assert _contents(ep.messages) == ["mirrorgrid 4", "start 1,2 goal +2,-2"]
    assert [env.act(ep, a) for a in ("right", "right", "left", "up", "down")] == [
        "left goal +3,-2",  # moved to x = 0
        "wall goal +3,-2",  # the wall at x = 0: no move
        "right goal +2,-2",
        "up goal +2,-1",
        "down goal +2,-2",
    ]
    assert env.act(ep, "jump") == "error" and ep.stats == {"walls": 1.0, "invalid": 1.0}
    # y mirrored: "down" moves up; reaching the goal and saying done pays 1.
    ep = env.start(MirrorTask(start=(0, 1), goal=(0, 0), flip=(False, True)))
    assert env.act(ep, "down") == "up goal 0,0"
    assert env.act(ep, "done") is None and ep.done and ep.reward == 1.0


def test_controls_print_the_mirroring_or_add_noise():
    task = MirrorTask(start=(1, 2), goal=(3, 0), flip=(True, False))
    shown = MirrorGrid(size=4, variant="shown")
    assert shown.start(task).messages[1]["content"] == "start 1,2 goal +2,-2 flip 1,0"
    noisy = MirrorGrid(size=4, variant="noise")
    ep = noisy.start(task)
    obs = [noisy.act(ep, "right") for _ in range(3)]
    assert [o.rsplit(" ", 1)[0] for o in obs] == ["left goal +3,-2"] + ["wall goal +3,-2"] * 2
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


@pytest.mark.parametrize("variant", ["hidden", "shown", "noise"])
def test_hidden_spans_hold_all_the_hidden_information(variant):
    # Every move observation's span is its direction word; the exact NLL of those words alone
    # equals the Bayes NLL of the whole observations minus the noise digits (checked against
    # the enumeration of the four mirrorings above): the rest of an observation is determined.
    env = MirrorGrid(size=4, variant=variant)
    for messages in _walks(env, 200, seed=3):
        spans = env.hidden_spans(messages)
        moves = [i for i, m in enumerate(messages) if m["role"] == "tool" and
                 messages[i - 1]["content"] in MOVES]  # fmt: skip
        assert sorted(spans) == moves
        for i, (a, b) in spans.items():
            assert messages[i]["content"][a:b] in {*MOVES, "wall"} and a == 0
        noise = len(moves) * math.log(10) if variant == "noise" else 0.0
        assert env.hidden_nats(messages) == pytest.approx(env.observation_nats(messages) - noise)


def test_hidden_token_positions_pick_exactly_the_direction_words():
    from echoloss.train.data import hidden_token_positions
    from echoloss.train.model import build_tokenizer

    tok = build_tokenizer(compass=True)
    env = MirrorGrid(size=4)
    task = MirrorTask(start=(1, 2), goal=(3, 0), flip=(True, False))
    messages = env.random_walk(task, random.Random(1), turns=5)
    ids, positions = hidden_token_positions(messages, tok, env.hidden_spans(messages))
    words = [messages[i]["content"].split()[0] for i in sorted(env.hidden_spans(messages))]
    assert [tok.decode([ids[p]]) for p in positions] == words
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    # A span that cuts a token in two is an error, not a silently widened span.
    first = min(env.hidden_spans(messages))
    with pytest.raises(ValueError, match=rf"message {first}: token \d+ covers"):
        hidden_token_positions(messages, tok, {first: (0, 2)})


def test_warmup_tasks_mirror_with_their_own_probability():
    # Same (start, goal) stream as the RL tasks; only the mirroring's probability differs.
    for p, expect in ((0.0, 0.0), (1.0, 1.0), (0.5, 0.5)):
        env = MirrorGrid(size=4, warmup_flip_prob=p)
        tasks = [env.warmup_task(seed=2, index=i) for i in range(400)]
        same = [env.task(seed=2, index=i) for i in range(400)]
        assert [(t.start, t.goal) for t in tasks] == [(t.start, t.goal) for t in same]
        rate = sum(f for t in tasks for f in t.flip) / 800
        assert rate == pytest.approx(expect, abs=0.06)
    with pytest.raises(ValueError, match="warmup_flip_prob must be in"):
        MirrorGrid(size=4, warmup_flip_prob=1.5)


def test_exploring_demonstrations_still_infer_the_mirroring():
    # With random turns mixed in, every non-random turn after an axis's first move goes the
    # right way: the script uses what any move (its own or a random one) showed.
    env = MirrorGrid(size=4, demo_explore=0.3)
    away, solved = 0, 0
    for i in range(300):
        task = env.task(seed=4, index=i)
        messages = env.demonstration(task, random.Random(i))
        ep = env.start(task)
        for m in messages[2:]:
            if m["role"] == "assistant":
                before = ep.pos
                env.act(ep, m["content"])
                if m["content"] in MOVES:
                    away += sum(abs(task.goal[a] - ep.pos[a]) > abs(task.goal[a] - before[a])
                                for a in (0, 1))  # fmt: skip
        solved += ep.reward == 1.0
    assert away > 100  # the demonstrations do cover moves away from the goal
    assert solved >= 0.9 * 300  # and still mostly reach it within the turn limit
    with pytest.raises(ValueError, match="demo_explore must be in"):
        MirrorGrid(size=4, demo_explore=1.0)


def test_make_env_names_and_errors():
    for name in ENV_NAMES:
        options = {"size": 3} if "size" in ENVS[name].options else {}
        assert make_env(name, **options).name == name
    with pytest.raises(ValueError, match=r"env\.name: expected one of"):
        make_env("maze", size=3)
    with pytest.raises(ValueError, match="gridwalk does not take demo_explore; it takes: size"):
        make_env("gridwalk", size=3, demo_explore=0.1)
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
        ("wall goal ", True),  # what echo-trained policies wrote in the experiment
        ("wall -2", True),
        ("left -1", True),
        ("up", False),
    ],
)
def test_imagined_observation(reply, imagined):
    assert imagined_observation(reply) is imagined


@pytest.mark.parametrize("name", list(ENVS))
def test_every_registered_env_implements_the_protocol(name):
    """Each entry of the one table builds an `Env` with the options it declares, its task
    streams are pure functions, and a demonstration and a random walk play out to the end. The
    built-in envs also have every measurement capability (a new env needs only `Env`:
    tests/train/test_plain_env.py)."""
    from echoloss.train.config import EnvConfig
    from echoloss.train.envs import HeldoutObservations, ImaginedObservations, TurnsNeeded

    entry = ENVS[name]
    env = make_env(name, **EnvConfig(name=name).options())
    assert isinstance(env, Env) and env.name == name
    assert all(isinstance(env, c) for c in (HeldoutObservations, ImaginedObservations, TurnsNeeded))
    assert env.task(seed=3, index=5) == env.task(seed=3, index=5)
    assert env.warmup_task(seed=3, index=5) == env.warmup_task(seed=3, index=5)
    assert env.heldout_task(index=2) == env.heldout_task(index=2)
    demo = env.demonstration(env.warmup_task(seed=0, index=0), random.Random(0))
    assert demo[-1]["role"] == "assistant" and env.observation_nats(demo) >= 0
    walk = env.random_walk(env.heldout_task(index=0), random.Random(0), turns=2)
    assert walk[-1]["role"] == "assistant" and any(m["role"] == "tool" for m in walk)
    episode = env.start(env.task(seed=0, index=0))
    assert isinstance(episode, Episode) and not episode.done
    assert env.turns_needed <= env.turn_limit
    assert set(entry.options) <= set(EnvConfig.model_fields), entry.options


def test_the_config_validates_env_names_against_the_registry():
    from echoloss.train.config import ConfigError, parse_config

    for name in ENVS:
        assert parse_config({"env": {"name": name}}).env.name == name
    with pytest.raises(ConfigError, match=r"env\.name: .*expected one of \['mirrorgrid'"):
        parse_config({"env": {"name": "maze"}})


def test_hidden_observations_is_a_capability_checked_by_isinstance():
    assert isinstance(make_env("mirrorgrid", size=3), HiddenObservations)
    assert not isinstance(make_env("gridwalk", size=3), HiddenObservations)


def test_the_trainer_docs_list_exactly_the_registered_envs():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `[env]`"))
    listed = re.search(r"`name` \(([^)]*)\)", row)
    assert listed is not None, row
    assert re.findall(r"`([a-z-]+)`", listed.group(1)) == list(ENVS)


# -- persistence levels, the observation vocabulary, the exact per-token floors -----------------


def test_per_world_permutation_is_fixed_never_the_identity_and_moves_the_agent():
    from echoloss.train.envs.mirrorgrid import world_permutation

    keys = tuple(MOVES)
    perms = {w: world_permutation(w) for w in range(200)}
    assert all(p != keys and sorted(p) == sorted(keys) for p in perms.values())
    assert len(set(perms.values())) == 23  # every non-identity permutation of 4 occurs
    env = MirrorGrid(size=4, level="per-world", world=7, words="compass")
    perm = world_permutation(7)
    tasks = [env.task(seed=s, index=i) for s in (0, 1) for i in range(20)]
    assert {t.keys for t in tasks} == {perm} and {t.flip for t in tasks} == {(False, False)}
    assert {t.keys for t in env.eval_tasks()} == {perm} and len(env.eval_tasks()) == 60
    assert {env.heldout_task(index=i).keys for i in range(10)} == {perm}
    # same (start, goal) stream at both levels; warm-up stays in the ordinary world
    episode = MirrorGrid(size=4)
    assert [(t.start, t.goal) for t in tasks[:20]] == [
        (episode.task(seed=0, index=i).start, episode.task(seed=0, index=i).goal) for i in range(20)
    ]
    assert env.warmup_task(seed=0, index=3).keys is None
    assert env.warmup_task(seed=0, index=3).flip == (False, False)
    # each key moves where the permutation says; the observation names it in compass words
    compass = {"up": "north", "down": "south", "left": "west", "right": "east"}
    start = (1, 1)
    for key, went in zip(MOVES, perm, strict=True):
        ep = env.start(MirrorTask(start, (3, 3), (False, False), perm))
        obs = env.act(ep, key)
        dx, dy = MOVES[went]
        assert ep.pos == (1 + dx, 1 + dy)
        assert obs.split()[0] == compass[went]


def test_compass_words_share_no_token_with_the_action_keys():
    from echoloss.train.model import build_tokenizer

    tok = build_tokenizer(compass=True)

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    keys = {i for k in (*MOVES, "done") for i in ids(k)}
    plain = build_tokenizer()  # the default vocabulary is every earlier run's: compass only adds
    assert len(tok) == len(plain) + 4 and tok.get_vocab() | plain.get_vocab() == tok.get_vocab()
    assert all(tok.get_vocab()[w] == i for w, i in plain.get_vocab().items())
    for word in ("north", "south", "west", "east", "wall"):
        assert len(ids(word)) == 1 and not set(ids(word)) & keys, word
    env = MirrorGrid(size=4, words="compass", variant="noise")
    msgs = env.random_walk(MirrorTask((1, 2), (3, 0), (True, False)), random.Random(1), turns=6)
    for i in env.hidden_spans(msgs):
        assert not set(ids(msgs[i]["content"])) & keys


@pytest.mark.parametrize("level", ["per-episode", "per-world"])
@pytest.mark.parametrize("variant", ["hidden", "noise"])
def test_hidden_token_floors_match_enumeration(level, variant):
    """Per hidden word, the exact Bayes NLL: per world 0 (the world is known); per episode the
    posterior over the four mirrorings, re-derived here by brute force from the observations."""
    env = MirrorGrid(size=4, level=level, world=3, words="compass", variant=variant)
    for i in range(40):
        rng = random.Random(i)
        task = env.heldout_task(index=i)
        msgs = env.random_walk(task, rng, turns=rng.randint(2, 11))
        info = env.hidden_tokens(msgs)
        assert sorted(info) == sorted(env.hidden_spans(msgs))
        for k, (kind, when, nats) in info.items():
            word = msgs[k]["content"].split()[0]
            assert kind == ("wall" if word == "wall" else "move")
            if level == "per-world":
                assert nats == 0.0
                continue
            before = consistent_mirrorings(4, msgs[:k])
            after = consistent_mirrorings(4, msgs[: k + 1])
            assert nats == pytest.approx(math.log(len(before) / len(after)), abs=1e-12)
            axis = 0 if msgs[k - 1]["content"] in ("left", "right") else 1
            earlier = [msgs[j - 1]["content"] for j in info if j < k]
            seen = any((0 if a in ("left", "right") else 1) == axis for a in earlier)
            assert when == ("later" if seen else "first")
            assert nats == pytest.approx(0.0 if seen else math.log(2), abs=1e-12)
        noise = math.log(10) * len(info) if variant == "noise" else 0.0
        assert env.observation_nats(msgs) == pytest.approx(env.hidden_nats(msgs) + noise)


def test_per_world_first_is_the_first_press_of_each_key():
    env = MirrorGrid(size=4, level="per-world", world=0, words="compass")
    task = env.heldout_task(index=0)
    ep = env.start(task)
    for key in ("up", "up", "left", "up", "left", "right"):
        env.act(ep, key)
    whens = [w for _, w, _ in env.hidden_tokens(ep.messages).values()]
    assert whens == ["first", "later", "first", "later", "later", "first"]


def test_bayes_optimal_world_demonstration_walks_straight_to_the_goal():
    env = MirrorGrid(size=4, level="per-world", world=5, words="compass")
    for i in range(30):
        task = env.heldout_task(index=i)
        msgs = env.demonstration(task, random.Random(i))
        distance = abs(task.goal[0] - task.start[0]) + abs(task.goal[1] - task.start[1])
        moves = [m for m in msgs if m["role"] == "assistant"]
        assert len(moves) == distance + 1 and moves[-1]["content"] == "done"
        assert all(w == "move" for w, _, _ in env.hidden_tokens(msgs).values())


def test_noise_spans_mark_the_digit_only_and_levels_validate():
    env = MirrorGrid(size=4, variant="noise", words="compass")
    msgs = env.random_walk(MirrorTask((0, 0), (3, 3), (False, True)), random.Random(2), turns=5)
    spans = env.noise_spans(msgs)
    assert sorted(spans) == sorted(env.hidden_spans(msgs))
    for i, (a, b) in spans.items():
        assert b - a == 1 and msgs[i]["content"][a:b].isdigit() and msgs[i]["content"][a - 1] == " "
    assert env.echo_spans("hidden", msgs) == env.hidden_spans(msgs)
    assert MirrorGrid(size=4).noise_spans(msgs) == {}
    with pytest.raises(ValueError, match="part must be"):
        env.echo_spans("goal", msgs)
    with pytest.raises(ValueError, match="level must be"):
        MirrorGrid(level="per-run")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no per-world form"):
        MirrorGrid(level="per-world", variant="shown")
    with pytest.raises(ValueError, match="permutation"):
        MirrorTask((0, 0), (1, 1), (False, False), ("up", "up", "left", "right"))
    with pytest.raises(ValueError, match="does not take level"):
        make_env("gridwalk", size=4, level="per-world")
