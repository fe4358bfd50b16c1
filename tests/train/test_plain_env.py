"""An environment with only the training protocol (`echoloss.train.envs.base.Env`) trains: the
measurements (held-out observation CE and its floor, imagined replies, the turns needed) are
optional capabilities, and without them their metrics are absent, not faked."""

from __future__ import annotations

import json
import random
from typing import Any

from _train_helpers import fast_config

from echoloss.train.envs import ENVS, EnvEntry, MirrorGrid
from echoloss.train.envs.base import (
    Env,
    HeldoutObservations,
    HiddenObservations,
    ImaginedObservations,
    ToolSchemas,
    TurnsNeeded,
)


class PlainEnv:
    """The members of `Env` and nothing else (a mirrored grid underneath)."""

    def __init__(self, *, name: str, size: int = 2, max_turns: int | None = None) -> None:
        self._grid = MirrorGrid(size=size, max_turns=max_turns, name=name)
        self.name = name

    @property
    def turn_limit(self) -> int:
        return self._grid.turn_limit

    def task(self, *, seed: int, index: int) -> Any:
        return self._grid.task(seed=seed, index=index)

    def warmup_task(self, *, seed: int, index: int) -> Any:
        return self._grid.warmup_task(seed=seed, index=index)

    def eval_tasks(self) -> Any:
        return self._grid.eval_tasks()

    def start(self, task: Any) -> Any:
        return self._grid.start(task)

    def act(self, episode: Any, text: str) -> str | None:
        return self._grid.act(episode, text)

    def demonstration(self, task: Any, rng: random.Random) -> list[dict[str, Any]]:
        return self._grid.demonstration(task, rng)


def test_an_env_with_only_the_training_protocol_trains(tmp_path, monkeypatch):
    env = PlainEnv(name="plain")
    assert isinstance(env, Env)
    optional = (HeldoutObservations, HiddenObservations, ImaginedObservations, TurnsNeeded)
    assert not any(isinstance(env, c) for c in (*optional, ToolSchemas))
    monkeypatch.setitem(ENVS, "plain", EnvEntry(PlainEnv, ("size", "max_turns"), "a test env"))
    from echoloss.train.recipe import train

    cfg = fast_config(tmp_path, **{"env.name": "plain", "train.plots": False})
    out = train(cfg, log=lambda _: None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # the warm-up step, then the RL step
    rl = rows[-1]
    assert rl["rollouts"] == 4 and "invalid_reply_rate" in rl
    assert "imagined_obs_rate" not in rl  # the env does not recognise imagined replies
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert evals and all("eval_success_greedy" in e for e in evals)
    measured = {"heldout_obs_ce", "obs_ce_floor", "heldout_hidden_ce", "eval_imagined_rate"}
    assert not measured & {k for e in evals for k in e}
    assert (out / "final-model" / "config.json").is_file()
