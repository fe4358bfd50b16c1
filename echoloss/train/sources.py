"""Where each step's rollouts come from: warm-up demonstrations, on-policy episodes, or JSONL.

The data position is a pure function of the step (task ``step * P + i`` of the seeded task
stream; JSONL groups in a per-epoch seeded order), so a resumed run draws exactly the data an
uninterrupted run would. Groups are dealt to ranks round-robin.
"""

from __future__ import annotations

import random
from typing import Any

from echoloss.train.config import DataConfig, WarmupConfig
from echoloss.train.data import Rollout, demo_rollouts, generate_rollouts, read_rollout_groups
from echoloss.train.envs import Env
from echoloss.train.runtime import Ranks

__all__ = ["RL_TASK_OFFSET", "RolloutSource"]

#: RL tasks come from a part of each env's task stream that the warm-up never uses.
RL_TASK_OFFSET = 1_000_000_007


class RolloutSource:
    """This rank's rollouts for each step (`get`): scripted demonstrations during the warm-up,
    then on-policy episodes played with the model, or groups read from ``data.path``. It reads
    the ``[data]`` and ``[warmup]`` sections and the run's seed (``train.seed``)."""

    def __init__(
        self,
        env: Env[Any, Any],
        tok: Any,
        ranks: Ranks,
        *,
        data: DataConfig,
        warmup: WarmupConfig,
        seed: int,
    ) -> None:
        self.env, self.tok, self.ranks = env, tok, ranks
        self.data, self.warmup, self.seed = data, warmup, seed
        self.groups: list[list[Rollout]] | None = None
        if data.source == "jsonl":
            assert data.path is not None  # the config requires it with source = "jsonl"
            self.groups = read_rollout_groups(data.path, tok, default_env=env.name)

    def position(self, step: int) -> int:
        """Prompts (groups) consumed before ``step``."""
        return step * self.data.prompts_per_step

    def _mine(self, first: int, count: int) -> list[int]:
        """This rank's indices among ``first .. first + count - 1`` (round-robin)."""
        r = self.ranks
        return [first + i for i in range(count) if i % r.world == r.rank]

    def get(self, step: int, model: Any) -> list[Rollout]:
        """This rank's rollouts of ``step`` (the warm-up's steps come first)."""
        data, seed = self.data, self.seed
        if step < self.warmup.steps:  # scripted demonstrations, one per "group"
            n = self.warmup.demos_per_step
            ids = self._mine(step * n, n)
            tasks = [(g, self.env.warmup_task(seed=seed, index=g)) for g in ids]
            return demo_rollouts(self.env, self.tok, tasks, seed=seed)
        mine = self._mine(self.position(step), data.prompts_per_step)
        if self.groups is not None:
            return [r for g in mine for r in self._jsonl_group(g)]
        tasks = [(g, self.env.task(seed=seed, index=RL_TASK_OFFSET + g)) for g in mine]
        return generate_rollouts(
            model,
            self.tok,
            self.env,
            tasks,
            group_size=data.group_size,
            temperature=data.temperature,
            max_new_tokens=data.max_new_tokens,
            device=self.ranks.device,
            world_size=self.ranks.world,
        )

    def _jsonl_group(self, index: int) -> list[Rollout]:
        """Group ``index`` of the file, cycling through the groups in a per-epoch seeded order."""
        assert self.groups is not None
        epoch, i = divmod(index, len(self.groups))
        order = list(range(len(self.groups)))
        random.Random(f"jsonl/{self.seed}/{epoch}").shuffle(order)
        return self.groups[order[i]]
