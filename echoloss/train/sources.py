"""Where each step's rollouts come from: warm-up demonstrations, on-policy episodes, or JSONL.

The data position is a pure function of the step (task ``step * P + i`` of the seeded task
stream; JSONL groups in a per-epoch seeded order), so a resumed run draws exactly the data an
uninterrupted run would. Groups are dealt to ranks round-robin.
"""

from __future__ import annotations

import random
from typing import Any

from echoloss.train.config import TrainConfig
from echoloss.train.data import Rollout, demo_rollouts, generate_rollouts, read_rollout_groups
from echoloss.train.envs import Env
from echoloss.train.runtime import Ranks

__all__ = ["RL_TASK_OFFSET", "RolloutSource"]

#: RL tasks come from a part of each env's task stream that the warm-up never uses.
RL_TASK_OFFSET = 1_000_000_007


class RolloutSource:
    """This rank's rollouts for each step (`get`): scripted demonstrations during the warm-up,
    then on-policy episodes played with the model, or groups read from ``data.path``."""

    def __init__(self, cfg: TrainConfig, env: Env[Any, Any], tok: Any, ranks: Ranks) -> None:
        self.cfg, self.env, self.tok, self.ranks = cfg, env, tok, ranks
        self.groups: list[list[Rollout]] | None = None
        if cfg.data.source == "jsonl":
            assert cfg.data.path is not None  # the config requires it with source = "jsonl"
            self.groups = read_rollout_groups(cfg.data.path, tok, default_env=env.name)

    def position(self, step: int) -> int:
        """Prompts (groups) consumed before ``step``."""
        return step * self.cfg.data.prompts_per_step

    def _mine(self, first: int, count: int) -> list[int]:
        """This rank's indices among ``first .. first + count - 1`` (round-robin)."""
        r = self.ranks
        return [first + i for i in range(count) if i % r.world == r.rank]

    def get(self, step: int, model: Any) -> list[Rollout]:
        """This rank's rollouts of ``step`` (the warm-up's steps come first)."""
        cfg = self.cfg
        if step < cfg.warmup.steps:  # scripted demonstrations, one per "group"
            n = cfg.warmup.demos_per_step
            ids = self._mine(step * n, n)
            tasks = [(g, self.env.warmup_task(seed=cfg.train.seed, index=g)) for g in ids]
            return demo_rollouts(self.env, self.tok, tasks, seed=cfg.train.seed)
        mine = self._mine(self.position(step), cfg.data.prompts_per_step)
        if self.groups is not None:
            return [r for g in mine for r in self._jsonl_group(g)]
        tasks = [(g, self.env.task(seed=cfg.train.seed, index=RL_TASK_OFFSET + g)) for g in mine]
        return generate_rollouts(
            model,
            self.tok,
            self.env,
            tasks,
            group_size=cfg.data.group_size,
            temperature=cfg.data.temperature,
            max_new_tokens=cfg.data.max_new_tokens,
            device=self.ranks.device,
            world_size=self.ranks.world,
        )

    def _jsonl_group(self, index: int) -> list[Rollout]:
        """Group ``index`` of the file, cycling through the groups in a per-epoch seeded order."""
        assert self.groups is not None
        epoch, i = divmod(index, len(self.groups))
        order = list(range(len(self.groups)))
        random.Random(f"jsonl/{self.cfg.train.seed}/{epoch}").shuffle(order)
        return self.groups[order[i]]
