"""What a run reports: step metrics summed over micro-batches and ranks, rollout statistics, the
one-line summary of each step and the banner printed before the first."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from echoloss.loss import raise_deferred_errors
from echoloss.train.config import EchoSection, TrainConfig
from echoloss.train.data import Rollout
from echoloss.train.envs import Env
from echoloss.train.model import describe_model
from echoloss.train.regimes import runs_copy_task
from echoloss.train.runtime import compute_dtype, gather

__all__ = ["MetricSums", "banner", "rollout_metrics", "summary_line"]

_SUMMED = ("loss_", "rl_tokens", "echo_tokens")  # per-micro-batch sums; everything else a mean


class MetricSums:
    """Aggregates the loss's per-micro-batch metrics into step values: sums (losses, token
    counts), means weighted by their row counts, and maxima (``*_max``)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = {}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        """One micro-batch's ``LossOutput.metrics``."""
        raise_deferred_errors()  # the loss's device-side checks, read with its metrics
        vals = {k: float(v) for k, v in metrics.items()}
        for key, v in vals.items():
            name, _, env = key.partition("/")
            if name.startswith(_SUMMED):
                self.sums[key] += v
                self.weights[key] = 1.0
            elif name.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, -math.inf), v)
            else:  # a mean over RL rows (or echo rows for the echo NLL): weight by the row count
                count = ("echo_tokens/" if name.startswith("echo_") else "rl_tokens/") + env
                w = vals.get(count, 0.0)
                self.sums[key] += v * w
                self.weights[key] += w

    def result(self, world: int) -> dict[str, float]:
        """The step values over every rank's micro-batches (a collective under data parallel)."""
        parts = gather((dict(self.sums), dict(self.weights), dict(self.maxes)), world)
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        maxes: dict[str, float] = {}
        for s, w, m in parts:
            for k, v in s.items():
                sums[k] += v
            for k, v in w.items():
                weights[k] = max(weights[k], v) if k.startswith(_SUMMED) else weights[k] + v
            for k, v in m.items():
                maxes[k] = max(maxes.get(k, -math.inf), v)
        out = {k: (v / weights[k] if weights[k] else 0.0) for k, v in sums.items()}
        out.update(maxes)
        return out


def rollout_metrics(
    rollouts: list[Rollout], advantages: list[float | None], world: int
) -> dict[str, float]:
    """Reward, advantage and per-env statistics over the global batch."""
    mine = [
        (r.env_name, r.reward, a, r.stats, len(r.steps))
        for r, a in zip(rollouts, advantages, strict=True)
    ]
    rows = [x for part in gather(mine, world) for x in part]
    if not rows:
        return {}
    rewards = np.array([r for _, r, _, _, _ in rows])
    adv = np.array([a for _, _, a, _, _ in rows if a is not None] or [0.0])
    out = {
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "advantage_mean": float(adv.mean()),
        "advantage_std": float(adv.std()),
        "advantage_abs": float(np.abs(adv).mean()),
        "rollouts": float(len(rows)),
    }
    turns = sum(s.get("turns", 0.0) for _, _, _, s, _ in rows)
    if turns:  # per assistant turn: replies that are no action, and those that imagine the env
        out["invalid_reply_rate"] = sum(s.get("invalid", 0.0) for _, _, _, s, _ in rows) / turns
        if any("imagined" in s for _, _, _, s, _ in rows):  # an env that recognises them
            out["imagined_obs_rate"] = sum(s.get("imagined", 0.0) for _, _, _, s, _ in rows) / turns
    by_env: dict[str, list[tuple[float, dict[str, float], int]]] = defaultdict(list)
    for env, r, _, stats, n_steps in rows:
        by_env[env].append((r, stats, n_steps))
    for env, items in sorted(by_env.items()):
        out[f"env/{env}/reward"] = float(np.mean([r for r, _, _ in items]))
        out[f"env/{env}/model_calls"] = float(np.mean([n for _, _, n in items]))
        for key in sorted({k for _, s, _ in items for k in s}):
            out[f"env/{env}/{key}"] = float(np.mean([s.get(key, 0.0) for _, s, _ in items]))
    return out


def summary_line(row: dict[str, Any], total: int) -> str:
    """The one-line summary of a step's metrics row: what moves from step to step.

    An RL step shows the reward (mean ± std over the rollouts), the mean ``|advantage|`` (0: no
    group had mixed rewards, so no policy gradient), the KL between sampler and trainer
    (``mismatch_kl``) and to the reference (``ref_kl``, with ``kl_coef``), the echo loss, the
    gradient norm before clipping and, on the steps the probe measures them
    (``train.grad_ratio_every``), the norms of the RL and echo terms' own gradients. The
    clipped-surrogate loss itself is left out: with advantages of mean zero and on-policy ratios
    of 1 it is ~0 at every step whatever is learned (``loss_rl`` in ``metrics.jsonl``).

    Examples:
        >>> row = {"step": 12, "phase": "rl", "reward": 0.625, "reward_std": 0.484,
        ...        "advantage_abs": 0.41, "mismatch_kl": 0.00123, "loss_rl": 1e-9,
        ...        "loss_echo": 0.0412, "entropy": 0.51, "grad_norm": 0.84,
        ...        "pg_grad_norm": 0.7, "echo_grad_norm": 0.31, "step_time": 1.52}
        >>> summary_line(row, 60)
        'step   12/60 rl      reward 0.625±0.484  |adv| 0.410  kl 1.23e-03  echo 0.0412  ent 0.510  |g| 0.84 (rl 0.70, echo 0.31)  1.52s'
    """
    parts = [f"step {row['step']:>4}/{total} {row['phase']:<6}"]
    reward = row.get("reward")
    if reward is not None:
        std = row.get("reward_std")
        parts.append(f"reward {reward:.3f}" + (f"±{std:.3f}" if std is not None else ""))
    for key, fmt in (
        ("advantage_abs", "|adv| {:.3f}"),
        ("mismatch_kl", "kl {:.2e}"),
        ("loss/ref_kl/all", "ref_kl {:.2e}"),
        ("loss_echo", "echo {:.4f}"),
        ("heldout_obs_ce", "obs_ce {:.3f}"),
        ("heldout_hidden_ce", "hidden_ce {:.3f}"),
        ("entropy", "ent {:.3f}"),
    ):
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(fmt.format(value))
    if "grad_norm" in row:
        norm = f"|g| {row['grad_norm']:.2f}"
        if "pg_grad_norm" in row and "echo_grad_norm" in row:
            norm += f" (rl {row['pg_grad_norm']:.2f}, echo {row['echo_grad_norm']:.2f})"
        parts.append(norm)
    if "step_time" in row:
        parts.append(f"{row['step_time']:.2f}s")
    if row["phase"] == "warmup":
        parts.append(f"sft {row['loss_sft']:.4f}")
        if "loss_obs" in row:
            parts.append(f"obs {row['loss_obs']:.4f}")
    if "eval_success_greedy" in row:
        parts.append(f"heldout success {row['eval_success_greedy']:.3f}")
    return "  ".join(parts)


def _echo_text(e: EchoSection) -> str:
    to = f" to {e.final_alpha:g}" if e.schedule == "decay" else ""
    text = f"{e.alpha:g}"
    if e.schedule != "constant":
        text += f" ({e.schedule} over {e.schedule_steps} RL steps{to})"
    return text + (" (GRPO only)" if e.alpha == 0 else "")


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "torch.float32"
    return f"{dtype} compute, torch.float32 master weights"


def banner(
    cfg: TrainConfig,
    model: Any,
    env: Env[Any, Any],
    device: torch.device,
    out: Path,
    resumed: str | None,
    start: int,
) -> str:
    """What this run is, before it starts: device, dtype, model, env, λ, steps, output."""
    params = sum(p.numel() for p in model.parameters())
    m = cfg.model
    dtype = compute_dtype(m.dtype, device)
    what = (
        describe_model(m.path, m.gguf_file, torch.float32)
        if m.path
        else f"tiny {m.arch} ({m.num_layers} layers)"
    )
    tasks = len(env.eval_tasks())
    played = tasks if cfg.train.eval_episodes is None else min(cfg.train.eval_episodes, tasks)
    grid = f" {cfg.env.size}x{cfg.env.size}" if "size" in cfg.env.options() else ""
    copying = runs_copy_task(cfg.warmup.copy_steps, model_path=m.path, start=start)
    lines = [
        "echoloss-train",
        f"  device {device} ({_precision(dtype)}), {torch.get_num_threads()} CPU thread(s)",
        f"  model  {what}, {params / 1e6:.3g}M parameters",
        f"  env    {cfg.env.name}{grid}, turn limit {env.turn_limit}"
        + (f", {tasks} held-out tasks" if tasks else "")
        + (f" (evaluation plays {played})" if played != tasks else ""),
        "  steps  "
        + (f"{cfg.warmup.copy_steps} copy-task + " if copying else "")
        + f"{cfg.warmup.steps if cfg.data.source != 'jsonl' else 0} warm-up "
        f"(lr {cfg.warmup.lr:g}, obs weight {cfg.warmup.obs_weight:g}) + "
        f"{cfg.train.max_steps} RL (lr {cfg.optim.lr:g}), "
        f"{cfg.data.prompts_per_step}x{cfg.data.group_size} rollouts/step",
        f"  echo   λ = {_echo_text(cfg.echo)}",
        f"  output {out}",
        f"  resume {resumed} (from step {start})" if resumed else "  resume no (fresh start)",
    ]
    if cfg.train.max_steps == 0:
        lines.append("  NOTE   train.max_steps = 0: warm-up only, no RL step")
    if device.type == "cpu" and params > 50e6:
        lines.append(f"  NOTE   a {params / 1e6:.0f}M-parameter model on CPU: expect slow steps")
    return "\n".join(lines)
