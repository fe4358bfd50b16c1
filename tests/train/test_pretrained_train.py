"""``echoloss-train`` on the packaged SmolLM2-135M-Instruct: one RL step with echo on the
calculator's results (``--config pretrained``, rollouts from a JSONL file of scripted calculator
conversations so that every completion holds a real tool call; bf16 on CPU)."""

from __future__ import annotations

import json
import math

from _pretrained import smollm2_dir, smollm2_tokenizer
from _train_helpers import REPO


def test_one_rl_step_with_echo_on_the_packaged_model(tmp_path):
    from echoloss.train.config import load_config
    from echoloss.train.data import demo_rollouts, rollout_record
    from echoloss.train.envs import make_env
    from echoloss.train.recipe import train

    smollm2_dir()  # materialised (or skipped with the reason) before the run
    env = make_env("calculator")
    task = env.task(seed=0, index=0)
    rollouts = demo_rollouts(env, smollm2_tokenizer(), [(0, task), (0, task)], seed=0)
    path = tmp_path / "rollouts.jsonl"
    with path.open("w") as f:
        for r, reward in zip(rollouts, (1.0, 0.0), strict=True):
            f.write(json.dumps({**rollout_record(r), "reward": reward}) + "\n")
    cfg = load_config(
        REPO / "configs" / "pretrained.toml",
        {
            "train.output_dir": str(tmp_path / "run"),
            "data.source": "jsonl",
            "data.path": str(path),
            "data.prompts_per_step": 1,
            "warmup.steps": 0,
            "train.max_steps": 1,
            "train.checkpoint_every": 1,
        },
    )
    out = train(cfg, log=lambda _: None)
    [row] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["phase"] == "rl" and row["reward_std"] > 0
    # The echo term trains the calculator's result tokens of both rollouts, and RL the replies.
    n_result = len(smollm2_tokenizer()(str(task.answer), add_special_tokens=False)["input_ids"])
    assert row["echo_tokens"] == 2 * n_result and row["rl_tokens"] > 0
    assert math.isfinite(row["loss_echo"]) and row["loss_echo"] > 0
    assert (out / "final-model" / "config.json").is_file()
