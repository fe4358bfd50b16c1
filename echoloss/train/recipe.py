"""The reference trainer: on-policy RL + echo, one loop to read top to bottom.

Per optimiser step::

    rollouts   = play G episodes per prompt with the model        (or: demos / a rollout JSONL)
    advantages = echoloss.compute_advantages(rewards, group_ids)   (GRPO by default, or RAE)
    samples    = echoloss.interleave(rollout.steps, echo=...)      (one per conversation)
    batches    = echoloss.pack(samples, max_tokens=micro_batch)    (micro-batches of packed rows)
    norms      = all_reduce(Σ count_normalizers(batch))            (global denominators)
    for batch:   echo_loss(logits, ..., normalizers=norms).backward()
    undo_data_parallel_averaging; clip; AdamW step

What was simplified, and why (this is a recipe, not a framework):

* **One policy update per batch** (fully on-policy, as the ECHO paper's released config:
  ``train_batch_size == policy_mini_batch_size``). The importance ratio is taken against the
  sampling logprobs, so it only corrects the small numerical mismatch between ``generate``'s
  padded forward and the packed training forward (``mismatch_kl`` reports it).
* **Generation is HF ``generate``**, turn by turn over all live conversations of the rank. Fine
  for a tiny model on CPU and for a small real model on one GPU; a production run would use an
  inference server and read its rollouts with ``data.source = "jsonl"``.
* **The packed forward** uses a block-diagonal 4D attention mask (or FlashAttention's varlen path
  when ``model.attn_implementation`` is a flash one), built from the batch's ``cu_seqlens``.
* **Data parallelism is FSDP2 ``fully_shard``** per decoder layer and at the root, under
  ``torchrun``. Every rank must run the same number of forwards (FSDP gathers parameters in each),
  so ranks pad their micro-batch count with empty batches whose loss is an exact, connected zero.
* **The warm-start** is plain SFT on scripted shortest-path demonstrations (assistant tokens only,
  no echo, identical for every arm of the ECHO experiment) for ``warmup.steps`` steps, counted in
  ``train.max_steps``. It teaches the reply format; RL does the rest.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import echoloss
from echoloss.loss import (
    LossConfig,
    LossInputs,
    Normalizers,
    all_reduce_normalizers,
    count_normalizers,
    echo_loss,
    raise_deferred_errors,
    undo_data_parallel_averaging,
)
from echoloss.schedules import echo_alpha
from echoloss.train import checkpoint as ckpt
from echoloss.train import tracking
from echoloss.train.config import TrainConfig, advantage_fn, parse_config
from echoloss.train.data import (
    EvalResult,
    Rollout,
    demo_rollouts,
    evaluate_policy,
    generate_rollouts,
    heldout_conversations,
    hidden_token_positions,
    read_rollout_groups,
    rollout_record,
    scripted_steps,
)
from echoloss.train.envs import HiddenObservations, make_env
from echoloss.train.model import (
    build_tiny_model,
    build_tokenizer,
    describe_model,
    load_model,
    packed_logits,
)
from echoloss.train.probes_world import (
    EchoGradient,
    EchoSpans,
    WorldModelSet,
    world_model_ce,
    world_model_sets,
    zero_variance_fraction,
)

__all__ = ["train"]

#: RL steps in a row without any non-zero advantage before the trainer warns (a collapsed
#: policy whose groups all score the same gets no RL gradient, docs/experiment.md).
NO_SIGNAL_STEPS = 10

SFT = LossConfig(mode="sft", compute_entropy=False)  # the warm-start's loss (no RL, no echo)
_OWNED_GROUP: list[bool] = []  # non-empty while a process group train() created is alive


# ------------------------------------------------------------------------------------------------
# Set-up helpers


def _init_distributed(device: torch.device) -> tuple[int, int]:
    """``(rank, world_size)``; under ``torchrun`` also initialises the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        _OWNED_GROUP.append(True)  # train() destroys it again on the way out
    return dist.get_rank(), world


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.model.device == "cuda" or (cfg.model.device == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]


def _build_model(cfg: TrainConfig, device: torch.device) -> tuple[Any, Any]:
    m = cfg.model
    if m.path is not None:
        model, tok = load_model(
            m.path,
            dtype=_dtype(cfg, device),
            attn_implementation=m.attn_implementation,
            gguf_file=m.gguf_file,
        )
    else:
        tok = build_tokenizer(compass=cfg.env.words == "compass")
        model = build_tiny_model(
            arch=m.arch,
            vocab_size=len(tok),
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size,
            max_position_embeddings=m.max_position_embeddings,
            seed=cfg.train.seed,
            attn_implementation=m.attn_implementation,
        ).to(_dtype(cfg, device))
    return model.to(device), tok


def _shard(model: Any) -> None:
    """FSDP2: one unit per decoder layer, plus the root (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers if layers is not None else []:
        fully_shard(layer)
    fully_shard(model)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# Data: where each step's rollouts come from


class Batches:
    """This rank's rollouts for each step: warm-start demos, on-policy episodes, or JSONL groups.

    The data position is a pure function of the step (task ``step * P + i`` of the seeded task
    stream; JSONL groups in a per-epoch seeded order), so a resumed run draws exactly the data
    an uninterrupted run would. Groups are dealt to ranks round-robin.
    """

    def __init__(self, cfg: TrainConfig, env: Any, tok: Any, rank: int, world: int) -> None:
        self.cfg, self.env, self.tok, self.rank, self.world = cfg, env, tok, rank, world
        self.groups: list[list[Rollout]] | None = None
        if cfg.data.source == "jsonl":
            self.groups = read_rollout_groups(cfg.data.path, tok, default_env=env.name)

    def position(self, step: int) -> int:
        """Prompts (groups) consumed before ``step``."""
        return step * self.cfg.data.prompts_per_step

    def _mine(self, step: int) -> list[int]:
        start = self.position(step)
        return [
            start + i for i in range(self.cfg.data.prompts_per_step) if i % self.world == self.rank
        ]

    def get(self, step: int, model: Any, device: torch.device) -> list[Rollout]:
        cfg = self.cfg
        if step < cfg.warmup.steps:  # scripted demonstrations, one per "group"
            n = cfg.warmup.demos_per_step
            start = step * n
            ids = [start + i for i in range(n) if i % self.world == self.rank]
            tasks = [(g, self.env.warmup_task(seed=cfg.train.seed, index=g)) for g in ids]
            return demo_rollouts(self.env, self.tok, tasks, seed=cfg.train.seed)
        if self.groups is not None:  # rollouts produced elsewhere
            out = []
            for g in self._mine(step):
                epoch, i = divmod(g, len(self.groups))
                order = list(range(len(self.groups)))
                random.Random(f"jsonl/{cfg.train.seed}/{epoch}").shuffle(order)
                out.extend(self.groups[order[i]])
            return out
        # On-policy: G episodes of each of this rank's prompts, with the current model.
        offset = 1_000_000_007  # RL tasks come from a part of the stream the warm-start never uses
        tasks = [
            (g, self.env.task(seed=cfg.train.seed, index=offset + g)) for g in self._mine(step)
        ]
        return generate_rollouts(
            model,
            self.tok,
            self.env,
            tasks,
            group_size=cfg.data.group_size,
            temperature=cfg.data.temperature,
            max_new_tokens=cfg.data.max_new_tokens,
            device=device,
            world_size=self.world,
        )


def _gather(obj: Any, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _advantages(
    cfg: TrainConfig, rollouts: list[Rollout], rae: echoloss.RAE | None, world: int
) -> list[float | None]:
    """Advantages of this rank's rollouts, computed on the *global* batch.

    Every rank gathers every reward and runs the same computation, so the result does not depend
    on the number of ranks (and a stateful RAE stays identical on every rank).
    """
    mine = [(r.group_id, r.reward, r.errored, r.env_name) for r in rollouts]
    everything = [x for part in _gather(mine, world) for x in part]
    rank = dist.get_rank() if world > 1 else 0
    start = sum(_gather(len(mine), world)[:rank])
    groups = [g for g, _, _, _ in everything]
    rewards = [r for _, r, _, _ in everything]
    errored = [e for _, _, e, _ in everything]
    if rae is not None:
        adv = rae.advantages([env for *_, env in everything], rewards, errored=errored)
    else:
        adv = echoloss.compute_advantages(
            rewards, groups, fn=advantage_fn(cfg), errored=errored, fn_kwargs=cfg.advantages.kwargs
        )
    return adv[start : start + len(mine)]


def _echo_config(cfg: TrainConfig, alpha: float) -> echoloss.EchoConfig | None:
    """The echo config of one RL step, with that step's λ (``alpha``) from the schedule."""
    e = cfg.echo
    if alpha == 0:
        return None  # plain RL: no echo weights at all
    return echoloss.EchoConfig(
        tool=echoloss.RoleEcho(alpha=alpha),
        target=e.target,
        echo_warnings=e.echo_warnings,
        max_tokens_per_message=e.max_tokens_per_message,
    )


def _dummy_batch(pad_id: int) -> echoloss.PackedBatch:
    """A two-token batch that trains nothing: its loss is an exact zero, still connected to the
    graph, so a rank with fewer micro-batches can match the others' forwards and backwards."""
    s = echoloss.Sample(
        prompt_ids=[pad_id],
        completion_ids=[pad_id],
        completion_mask=[False],
        completion_logprobs=[0.0],
    )
    return echoloss.pack([s], max_tokens=2)[0]


def _micro_batches(
    samples: list[echoloss.Sample], cfg: TrainConfig, pad_id: int, world: int
) -> tuple[list[echoloss.PackedBatch], int]:
    """This rank's micro-batches, padded with dummies to the ranks' largest count, and how many
    of them are real (the dummies come last; they count in no metric and no export)."""
    batches = echoloss.pack(samples, max_tokens=cfg.optim.micro_batch_tokens) if samples else []
    real = len(batches)
    if world > 1:  # same count of forwards on every rank
        most = max(_gather(len(batches), world))
        batches += [_dummy_batch(pad_id) for _ in range(most - len(batches))]
    return batches, real


# ------------------------------------------------------------------------------------------------
# Metrics


class _Metrics:
    """Aggregates the loss's per-micro-batch metrics into step values (sums, weighted means, max)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)
        self.maxes: dict[str, float] = {}

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        raise_deferred_errors()  # the loss's device-side checks, read with its metrics
        vals = {k: float(v) for k, v in metrics.items()}
        for key, v in vals.items():
            name, _, env = key.partition("/")
            if name.startswith(("loss_", "rl_tokens", "echo_tokens")):
                self.sums[key] += v
                self.weights[key] = 1.0
            elif name.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, -math.inf), v)
            else:  # a mean over RL rows (or echo rows for the echo NLL): weight by the row count
                w = vals.get(
                    ("echo_tokens/" if name.startswith("echo_") else "rl_tokens/") + env, 0.0
                )
                self.sums[key] += v * w
                self.weights[key] += w

    def result(self, world: int) -> dict[str, float]:
        parts = _gather((dict(self.sums), dict(self.weights), dict(self.maxes)), world)
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        maxes: dict[str, float] = {}
        for s, w, m in parts:
            for k, v in s.items():
                sums[k] += v
            for k, v in w.items():
                weights[k] = (
                    max(weights[k], v)
                    if k.startswith(("loss_", "rl_tokens", "echo_tokens"))
                    else weights[k] + v
                )
            for k, v in m.items():
                maxes[k] = max(maxes.get(k, -math.inf), v)
        out = {k: (v / weights[k] if weights[k] else 0.0) for k, v in sums.items()}
        out.update(maxes)
        return out


@torch.no_grad()
def heldout_observation_ce(model: Any, batches: list[echoloss.PackedBatch], attn: str) -> float:
    """Mean cross-entropy (nats/token) of the tool-observation body tokens of the held-out set.

    The observation tokens are chosen by the library itself: the held-out conversations go
    through ``interleave`` with a tool echo config, and the echo rows are the observation bodies.
    """
    was = model.training
    model.eval()
    nll, count = 0.0, 0
    for b in batches:
        t = echoloss.next_token_targets(b)
        x = LossInputs(
            rl_mask=torch.zeros_like(t.rl_mask), echo_weights=t.echo_weights, labels=t.labels
        )
        out = echo_loss(
            packed_logits(model, b, attn_implementation=attn).float(),
            x,
            config=LossConfig(compute_entropy=False),
        )
        n = int(out.metrics["echo_tokens/all"])
        nll += float(out.metrics["echo_nll_mean/all"]) * n
        count += n
    model.train(was)
    return nll / max(count, 1)


def _runs_copy_task(cfg: TrainConfig, start: int) -> bool:
    """Whether this run trains the copy task: asked for, on a fresh start of the built-in tiny
    model (a resumed run's weights already hold it; a loaded ``model.path`` is trained)."""
    return bool(cfg.warmup.copy_steps) and cfg.model.path is None and start == 0


def copy_task_warmup(
    model: Any,
    *,
    vocab_size: int,
    steps: int,
    lr: float,
    seed: int,
    device: Any,
    batch: int = 32,
    half: int = 32,
    report: Callable[[int, float], None] | None = None,
    report_every: int = 100,
) -> float:
    """Train ``model`` on generic in-context copying: each row is ``half`` random token ids
    ``[batch, half]`` repeated once, and the loss is the CE of the repeat (predictable only by
    finding the earlier occurrence of the current token and copying what followed it). Returns
    the last step's loss (nats/token; ``log vocab_size`` for a model that cannot copy).
    ``report(step, loss)`` is called every ``report_every`` steps and after the last.

    Example:
        >>> from echoloss.train.model import build_tiny_model
        >>> m = build_tiny_model(arch="qwen3", vocab_size=50, hidden_size=16, num_layers=1,
        ...                      num_heads=2, num_kv_heads=1, intermediate_size=32,
        ...                      max_position_embeddings=128, seed=0)
        >>> 0 < copy_task_warmup(m, vocab_size=50, steps=2, lr=1e-3, seed=0, device="cpu") < 5
        True
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)  # its own: discarded afterwards
    loss = torch.tensor(math.log(vocab_size))
    for step in range(1, steps + 1):
        first = torch.randint(0, vocab_size, (batch, half), generator=g)
        x = torch.cat([first, first], dim=1).to(device)
        logits = model(input_ids=x).logits[:, half - 1 : -1].float()
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, half:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if report is not None and (step % report_every == 0 or step == steps):
            report(step, loss.item())
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


@torch.no_grad()
def heldout_hidden_ce(model: Any, sets: list[tuple[list[int], list[int]]], device: Any) -> float:
    """Mean cross-entropy (nats/token) of the *hidden-dependent* observation tokens of the
    held-out set: ``sets`` holds each conversation's token ids and the positions of those tokens
    (`hidden_token_positions`). Each token is scored from everything before it."""
    was = model.training
    model.eval()
    nll, count = 0.0, 0
    for ids, positions in sets:
        if not positions:
            continue
        x = torch.tensor([ids], device=device)
        logprobs = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        at = torch.tensor(positions, device=device)
        nll -= float(logprobs[at - 1, x[0, at]].sum())
        count += len(positions)
    model.train(was)
    return nll / max(count, 1)


@dataclass
class _Heldout:
    """The held-out observation set: packed (CE of all observation tokens) and as hidden-token
    positions (CE of the hidden-dependent ones), each with its exact floor (nats/token)."""

    batches: list[echoloss.PackedBatch] = field(default_factory=list)
    floor: float = math.nan
    hidden: list[tuple[list[int], list[int]]] = field(default_factory=list)
    hidden_floor: float = math.nan
    world_model: dict[str, WorldModelSet] = field(default_factory=dict)  # the split CE's sets


def _heldout_batches(cfg: TrainConfig, env: Any, tok: Any, device: torch.device) -> _Heldout:
    """The held-out observation set and its floors: the env's Bayes-optimal NLL of all
    observation bodies over their token count, and of the hidden-dependent tokens over theirs
    (when the env marks them: ``hidden_spans``)."""
    if cfg.data.heldout_size == 0 or cfg.data.source == "jsonl":
        return _Heldout()
    probe = echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=1.0))
    samples = []
    out = _Heldout()
    nats = hidden_nats = 0.0
    for messages in heldout_conversations(env, count=cfg.data.heldout_size):
        nats += env.observation_nats(messages)
        for s in echoloss.interleave(scripted_steps(messages, tok), echo=probe):
            s.advantage = 0.0
            samples.append(s)
        if isinstance(env, HiddenObservations):
            hidden_nats += env.hidden_nats(messages)
            out.hidden.append(hidden_token_positions(messages, tok, env.hidden_spans(messages)))
    tokens = sum(sum(1 for w in (s.echo_weights or []) if w) for s in samples)
    batches = echoloss.pack(samples, max_tokens=cfg.optim.micro_batch_tokens)
    out.batches = [b.to(device) for b in batches]
    out.floor = nats / max(tokens, 1)
    if out.hidden:
        out.hidden_floor = hidden_nats / max(sum(len(p) for _, p in out.hidden), 1)
    out.world_model = world_model_sets(env, tok, count=cfg.data.heldout_size)
    return out


def _evaluate(
    cfg: TrainConfig,
    model: Any,
    tok: Any,
    env: Any,
    heldout: _Heldout,
    device: torch.device,
    full: bool,
) -> dict[str, float]:
    """Held-out success on the env's fixed evaluation tasks (one greedy episode each, plus
    ``train.eval_samples`` sampled ones when ``full``: at the RL start and end) and the held-out
    observation CE with its floor. Keys absent when they do not apply."""
    out: dict[str, float] = {}
    tasks = env.eval_tasks()
    if tasks and cfg.data.source != "jsonl":
        r: EvalResult = evaluate_policy(
            model,
            tok,
            env,
            tasks,
            samples=cfg.train.eval_samples if full else 0,
            temperature=cfg.data.temperature,
            max_new_tokens=cfg.data.max_new_tokens,
            device=device,
        )
        out.update(eval_success_greedy=r.success_greedy, eval_episodes=float(r.episodes))
        if full and cfg.train.eval_samples:
            out.update(
                eval_success_sampled=r.success_sampled,
                eval_invalid_rate=r.invalid_rate,
                eval_imagined_rate=r.imagined_rate,
            )
    if heldout.batches:
        out["heldout_obs_ce"] = heldout_observation_ce(
            model, heldout.batches, cfg.model.attn_implementation
        )
        out["obs_ce_floor"] = heldout.floor
    if heldout.hidden:
        out["heldout_hidden_ce"] = heldout_hidden_ce(model, heldout.hidden, device)
        out["hidden_ce_floor"] = heldout.hidden_floor
    if heldout.world_model:
        out.update(world_model_ce(model, heldout.world_model, device))
    return out


def _rollout_metrics(
    rollouts: list[Rollout], advantages: list[float | None], world: int
) -> dict[str, float]:
    """Reward, advantage and per-env statistics over the global batch."""
    mine = [
        (r.env_name, r.reward, a, r.stats, len(r.steps))
        for r, a in zip(rollouts, advantages, strict=True)
    ]
    rows = [x for part in _gather(mine, world) for x in part]
    out: dict[str, float] = {}
    if not rows:
        return out
    rewards = np.array([r for _, r, _, _, _ in rows])
    adv = np.array([a for _, _, a, _, _ in rows if a is not None] or [0.0])
    out.update(
        reward=float(rewards.mean()),
        reward_std=float(rewards.std()),
        advantage_mean=float(adv.mean()),
        advantage_std=float(adv.std()),
        advantage_abs=float(np.abs(adv).mean()),
        rollouts=float(len(rows)),
    )
    turns = sum(s.get("turns", 0.0) for _, _, _, s, _ in rows)
    if turns:  # per assistant turn: replies that are no action, and those that imagine the env
        out["invalid_reply_rate"] = sum(s.get("invalid", 0.0) for _, _, _, s, _ in rows) / turns
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


# ------------------------------------------------------------------------------------------------
# Checkpoints


def _save(
    out: Path,
    step: int,
    model: Any,
    opt: Any,
    rae: echoloss.RAE | None,
    cfg: TrainConfig,
    rank: int,
    world: int,
) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=full)  # collective under FSDP
    opt_sd = get_optimizer_state_dict(model, opt, options=full)
    rngs = _gather(ckpt.capture_rng(), world)  # tensors and numbers: loads with weights_only
    sizes = _gather(ckpt.output_sizes(out, _appended_outputs(cfg, rank)), world)
    if rank != 0:
        return

    def write(d: Path) -> None:
        torch.save(model_sd, d / "model.pt")
        torch.save(opt_sd, d / "optimizer.pt")
        torch.save(rngs, d / "rng.pt")
        state = {
            "step": step,
            "data_position": step * cfg.data.prompts_per_step,
            "world_size": world,
            "rae": rae.state_dict() if rae is not None else None,
            "config": cfg.model_dump(mode="json"),
            "outputs": {k: v for part in sizes for k, v in part.items()},  # cut back on resume
        }
        (d / "state.json").write_text(json.dumps(state, indent=1))

    ckpt.save_checkpoint(out / "checkpoints", step, write, keep=cfg.train.keep_checkpoints)


def _appended_outputs(cfg: TrainConfig, rank: int) -> list[str]:
    """This rank's append-only output files (relative to the output directory)."""
    names = ["metrics.jsonl", "eval.jsonl"] if rank == 0 else []
    return [*names, f"rollouts.rank{rank}.jsonl"] if cfg.train.save_rollouts else names


def _load(
    path: Path, model: Any, opt: Any, rank: int, world: int, cfg_model: dict[str, Any]
) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    # One read: the bytes checked against the manifest are the bytes loaded (weights_only: a
    # checkpoint file never runs code)
    names = ("model.pt", "optimizer.pt", "rng.pt")
    state, files = ckpt.load_checkpoint(path, names)
    model_sd, opt_sd, rngs = (files[f] for f in names)
    try:
        set_model_state_dict(model, model_sd, options=full)
        set_optimizer_state_dict(model, opt, opt_sd, options=full)
    except (RuntimeError, KeyError, ValueError) as err:
        changed = [
            c
            for c in ckpt.config_changes(state.get("config", {}), {"model": cfg_model})
            if c.startswith("model.")
        ]
        raise ckpt.CheckpointError(
            f"--resume: checkpoint {str(path)!r} does not fit this model "
            f"({str(err).strip().splitlines()[0]}); changed [model] settings: "
            f"{'; '.join(changed) or 'none'}. Resume with the checkpoint's [model] settings"
        ) from None
    if len(rngs) == world:
        ckpt.restore_rng(rngs[rank])
    else:
        print(
            f"echoloss-train: checkpoint written by {len(rngs)} rank(s), resuming on {world}: "
            "sampling RNG reseeded (the run continues, but not bit-identically)",
            file=sys.stderr,
        )
        _seed_everything(int(state["step"]) * 7919 + rank)
    return state


def _export_model(out: Path, model: Any, tok: Any, rank: int) -> None:
    """The final weights as a Hugging Face directory, usable as ``model.path``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:

        def write(d: Path) -> None:
            model.save_pretrained(d, state_dict=sd)
            tok.save_pretrained(d)

        ckpt.export_atomically(out / "final-model", write)  # a crash leaves no half model


# ------------------------------------------------------------------------------------------------
# The loop


def train(
    cfg: TrainConfig | dict[str, Any],
    *,
    resume: str | Path | None = None,
    log: Any = None,
) -> Path:
    """Run the configured training; returns the output directory.

    Process-wide torch settings it changes (deterministic algorithms, CPU threads) are restored
    when it returns, so it can be called from tests and notebooks.

    Args:
        cfg: a validated `echoloss.train.config.TrainConfig`, or a dict of sections
            (validated here; `ConfigError` names every bad key).
        resume: a checkpoint directory, or an output directory whose ``checkpoints/latest`` names
            one, or None to start fresh.
        log: where the one-line-per-step summaries go (rank 0 only).
    """
    if log is None:

        def log(line: str) -> None:
            print(line, flush=True)

    if not isinstance(cfg, TrainConfig):  # a plain dict (a parsed TOML table): validate it
        cfg = parse_config(cfg)
    deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    try:
        with ExitStack() as files:  # every file the run opens is closed, even on an error
            return _train(cfg, resume, log, files)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
        if _OWNED_GROUP and dist.is_initialized():
            # FSDP2's modules hold the group through reference cycles (hooks, the device mesh):
            # collect them now, while every rank is past the final barrier, so the group is torn
            # down here and not by the garbage collector during interpreter exit, where gloo's
            # threads abort the process (SIGABRT) when a peer has already gone.
            gc.collect()
            dist.destroy_process_group()
            _OWNED_GROUP.clear()


def _train(cfg: TrainConfig, resume: str | Path | None, log: Any, files: ExitStack) -> Path:
    device = _device(cfg)
    rank, world = _init_distributed(device)
    out = Path(cfg.train.output_dir)
    if cfg.train.threads is not None:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")
    _seed_everything(cfg.train.seed * 1000 + rank)

    # -- model, tokenizer, optimiser -------------------------------------------------------------
    model, tok = _build_model(cfg, device)
    if world > 1:
        _shard(model)
    attn = cfg.model.attn_implementation
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [p for _, p in trained],
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )
    env = make_env(cfg.env.name, **cfg.env.options())
    if cfg.echo.span != "observation" and not isinstance(env, EchoSpans):
        raise ValueError(
            f"echo.span = {cfg.echo.span!r}: env {cfg.env.name} names no observation spans "
            "(no echo_spans); use a mirrorgrid env, or echo.span = 'observation'"
        )
    data = Batches(cfg, env, tok, rank, world)
    warm_steps = cfg.warmup.steps if cfg.data.source != "jsonl" else 0
    total = warm_steps + cfg.train.max_steps  # the warm-up comes before the RL steps
    rae = (
        echoloss.RAE(decay=cfg.advantages.rae_decay)
        if cfg.advantages.rae_decay is not None
        else None
    )
    heldout = _heldout_batches(cfg, env, tok, device)
    pad_id = tok.pad_token_id

    # -- resume ----------------------------------------------------------------------------------
    start = 0
    if resume is not None:
        path = ckpt.find_checkpoint(resume)  # verified (checksums); before anything is written
        state = _load(path, model, opt, rank, world, cfg.model.model_dump(mode="json"))
        start = int(state["step"])
        if rae is not None and state.get("rae") is not None:
            rae.load_state_dict(state["rae"])
        changed = ckpt.config_changes(state.get("config", {}), cfg.model_dump(mode="json"))
        if rank == 0 and changed:
            warnings.warn(
                f"--resume: the configuration differs from the checkpoint's ({path}): "
                + "; ".join(changed),
                ckpt.ResumeWarning,
                stacklevel=2,
            )
        # Outputs written after this run's checkpoint are cut back: the resumed run rewrites them.
        if path.resolve().is_relative_to(out.resolve()):
            ckpt.truncate_outputs(
                out,
                state.get("outputs", {}),
                step=start,
                rank=rank,
                names=_appended_outputs(cfg, rank),
            )
        if rank == 0:
            log(f"resumed from {path} at step {start}")
    if rank == 0:
        log(_banner(cfg, model, env, device, out, None if resume is None else str(path), start))
    if cfg.warmup.copy_steps and cfg.model.path is not None and rank == 0:
        # The experiment's arms load their warm-start this way: copying is already in it.
        warnings.warn(
            f"warmup.copy_steps = {cfg.warmup.copy_steps} is not run: model.path loads a "
            "trained model (the copy task is for the built-in tiny model before its warm-up)",
            stacklevel=2,
        )
    if _runs_copy_task(cfg, start):
        copy_task_warmup(
            model,
            vocab_size=len(tok),
            steps=cfg.warmup.copy_steps,
            lr=cfg.warmup.copy_lr,
            seed=cfg.train.seed,
            device=device,
            report=(lambda k, ce: log(f"copy task {k:>5}/{cfg.warmup.copy_steps}  ce {ce:.4f}"))
            if rank == 0
            else None,
        )

    # Everything that can fail on bad input (config, model, data, checkpoint) has run: now write.
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)

    metrics_file = rollout_file = export = bar = trackers = None
    if rank == 0:
        trackers = files.enter_context(  # TensorBoard / W&B, besides metrics.jsonl
            tracking.open_trackers(
                cfg.train.report_to, out=out, config=cfg.model_dump(mode="json"), start=start
            )
        )
        mode = "a" if resume is not None else "w"
        metrics_file = files.enter_context(open(out / "metrics.jsonl", mode))  # noqa: SIM115
    if cfg.train.save_rollouts:
        rollout_file = files.enter_context(open(out / f"rollouts.rank{rank}.jsonl", "a"))  # noqa: SIM115
    if cfg.train.export_tokens:
        from echoloss.io import TokenExporter

        export = files.enter_context(TokenExporter(out / "token_exports", rank=rank))
    if rank == 0 and cfg.train.progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = files.enter_context(
            tqdm(total=total, initial=start, desc="echoloss-train", unit="step")
        )

    # -- the loop --------------------------------------------------------------------------------
    eval_file = files.enter_context(open(out / "eval.jsonl", "a")) if rank == 0 else None  # noqa: SIM115
    if rank == 0 and start == 0:
        eval_file.truncate(0)  # type: ignore[union-attr]

    def evaluate(step: int, rl_step: int, full: bool) -> dict[str, float]:
        t = time.perf_counter()
        # Its own seeded RNG: evaluating never shifts the training run's sampling stream (a
        # resumed run stays bit-identical), and every arm samples the same way at a given step.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.train.seed * 1_000_003 + step)
            ev = _evaluate(cfg, model, tok, env, heldout, device, full)
        if ev and eval_file is not None:
            row = {"step": step, "rl_step": rl_step, **ev, "eval_time": time.perf_counter() - t}
            eval_file.write(json.dumps(row) + "\n")
            eval_file.flush()
        return ev

    if start == 0 and warm_steps == 0 and cfg.train.eval_at_start:
        evaluate(
            start, 0, True
        )  # the RL start, before any update (with a warm-up: after its last step)
    no_signal = 0  # RL steps in a row on which every advantage was 0
    for step in range(start, total):
        t0 = time.perf_counter()
        warm = step < warm_steps
        rl_step = step - warm_steps  # 0-based RL step (negative in the warm-up)
        alpha = (
            0.0
            if warm
            else echo_alpha(
                rl_step,
                alpha=cfg.echo.alpha,
                schedule=cfg.echo.schedule,
                steps=cfg.echo.schedule_steps,
                final_alpha=cfg.echo.final_alpha,
            )
        )
        echo = _observation_config(cfg.warmup.obs_weight) if warm else _echo_config(cfg, alpha)

        # 1. Rollouts for this step (this rank's share of the global batch).
        rollouts = data.get(step, model, device)
        t_gen = time.perf_counter() - t0
        if rollout_file is not None and not warm:  # echoloss rollout JSONL, readable as data
            from echoloss.io import write_rollouts

            write_rollouts(rollout_file, [rollout_record(r) for r in rollouts])
            rollout_file.flush()

        # 2. Advantages over the global batch; samples through the library's data path.
        advantages = [1.0] * len(rollouts) if warm else _advantages(cfg, rollouts, rae, world)
        samples: list[echoloss.Sample] = []
        for r, a in zip(rollouts, advantages, strict=True):
            if a is None:
                continue  # errored, or a group without survivors: trains nothing
            only = None  # echo restricted to the env's spans (echo.span), e.g. the placebo's
            if (
                not warm
                and echo is not None
                and isinstance(env, EchoSpans)
                and cfg.echo.span != "observation"
            ):
                only = echoloss.span_echo_filter(
                    r.messages, partial(env.echo_spans, cfg.echo.span), decode=tok.decode
                )
            for s in echoloss.interleave(
                r.steps, echo=echo, errored=r.errored, env_name=r.env_name, echo_filter=only
            ):
                s.advantage = a
                samples.append(s)
        too_long = [len(s) for s in samples if len(s) > cfg.data.max_tokens]
        if too_long:
            raise ValueError(
                f"step {step}: a sample has {max(too_long)} tokens > data.max_tokens="
                f"{cfg.data.max_tokens}; raise data.max_tokens (and optim.micro_batch_tokens)"
            )

        # 3. Micro-batches and the global normalisers (counted once, all-reduced once).
        packed, real = _micro_batches(samples, cfg, pad_id, world)
        batches = [b.to(device) for b in packed]
        targets = [echoloss.next_token_targets(b) for b in batches]
        records = [
            LossInputs.from_targets(t, env_names=list(b.env_names))
            for b, t in zip(batches, targets, strict=True)
        ]
        local = sum((count_normalizers(x) for x in records), Normalizers())
        norms = all_reduce_normalizers(local)

        # 4. Forward + backward per micro-batch; gradients accumulate (sum) in .grad.
        loss_cfg = SFT if warm else cfg.loss
        for group in opt.param_groups:  # Adam makes steps ~lr whatever the gradient's scale
            group["lr"] = _warmup_lr(cfg, step) if warm else cfg.optim.lr
        agg, agg_obs = _Metrics(), _Metrics()
        tokens = 0
        every = cfg.train.grad_ratio_every
        grad_probe = (
            EchoGradient([p for _, p in trained])
            if not warm and echo is not None and every and rl_step % every == 0 and world == 1
            else None
        )
        for i, (b, t, x) in enumerate(zip(batches, targets, records, strict=True)):
            sync = model.set_requires_gradient_sync if world > 1 else None
            if sync is not None:
                sync(i == len(batches) - 1)  # reduce-scatter once, after the last micro-batch
            logits = packed_logits(model, b, attn_implementation=attn)
            if warm and echo is not None:  # the warm-up's observation CE (SFT mode has no echo)
                obs = echo_loss(
                    logits,
                    x.replace(rl_mask=torch.zeros_like(x.rl_mask), temperature=1.0, env_names=None),
                    config=cfg.loss.model_copy(update={"compute_entropy": False}),
                    normalizers=norms,
                )
                obs.loss.backward(retain_graph=True)
                if i < real:
                    agg_obs.add(obs.metrics)
            res = echo_loss(
                logits,
                x.replace(echo_weights=None) if warm else x,
                config=loss_cfg,
                normalizers=norms,
                backend="auto",
            )
            if grad_probe is not None and i < real:  # the echo term's own gradient, this batch
                part = echo_loss(
                    logits,
                    x.replace(rl_mask=torch.zeros_like(x.rl_mask), temperature=1.0, env_names=None),
                    config=cfg.loss.model_copy(update={"compute_entropy": False}),
                    normalizers=norms,
                )
                grad_probe.add(part.loss)
            res.loss.backward()
            if i >= real:
                continue  # a dummy batch: trains nothing, counts in no metric and no export
            agg.add(res.metrics)
            tokens += len(b) - b.num_padding
            if export is not None and not warm:
                with torch.no_grad():  # what the trainer thinks of each label, at the loss's T
                    temps = t.temperatures.masked_fill(t.echo_weights > 0, 1.0)[:, None]
                    lp = torch.log_softmax(logits.float() / temps, -1).gather(1, t.labels[:, None])
                export.write(
                    b, step=step + 1, micro_step=i, row_stats={"trainer_logprobs": lp[:, 0]}
                )

        # 5. Data parallel: FSDP averaged the ranks' gradients; the global normalisers want the sum.
        undo_data_parallel_averaging(model, world)
        echo_pg_norms = grad_probe.norms() if grad_probe is not None else None
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in trained], clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_time = time.perf_counter() - t0

        # 6. Metrics: one JSON line per step, and a one-line summary.
        m = agg.result(world)
        total_tokens = sum(_gather(tokens, world))
        row: dict[str, Any] = {"step": step + 1, "phase": "warmup" if warm else "rl"}
        if warm:  # the warm-up: SFT on actions (+ observation CE); no policy-gradient metrics
            row.update(warmup_step=step + 1, loss_sft=m.get("loss_rl/all", math.nan))
            if echo is not None:
                o = agg_obs.result(world)
                row.update(
                    loss_obs=o.get("loss_echo/all", math.nan),
                    obs_nll=o.get("echo_nll_mean/all", math.nan),
                )
            row["loss"] = row["loss_sft"] + row.get("loss_obs", 0.0)
        else:
            row["rl_step"] = rl_step + 1
            row.update(_rollout_metrics(rollouts, advantages, world))
            groups: dict[Any, list[float]] = defaultdict(list)
            for r in rollouts:
                groups[r.group_id].append(r.reward)
            row["zero_variance_groups"] = zero_variance_fraction(dict(groups))
            if echo_pg_norms is not None:  # before clipping; their ratio is echo's pull
                row.update(echo_grad_norm=echo_pg_norms[0], pg_grad_norm=echo_pg_norms[1])
            row.update(
                loss_rl=m.get("loss_rl/all", math.nan),
                entropy=m.get("entropy/all", math.nan),
                mismatch_kl=m.get("mismatch_kl/all", math.nan),
                echo_alpha=alpha,
            )
            if echo is not None:  # echo on at this step
                row.update(
                    loss_echo=m.get("loss_echo/all", math.nan),
                    echo_nll=m.get("echo_nll_mean/all", math.nan),
                )
            row["loss"] = row["loss_rl"] + row.get("loss_echo", 0.0)
            no_signal = no_signal + 1 if row.get("advantage_abs", 1.0) == 0 else 0
            if no_signal == NO_SIGNAL_STEPS and rank == 0:
                warnings.warn(
                    f"RL steps {rl_step + 2 - NO_SIGNAL_STEPS}-{rl_step + 1}: every group had "
                    f"identical rewards (mean reward {row['reward']:.3f}), so every advantage and "
                    "the RL gradient were 0; RL alone cannot leave this state (an echo or "
                    "entropy term still trains). Read invalid_reply_rate in metrics.jsonl; "
                    "consider stopping the run, a larger data.group_size or a lower optim.lr",
                    stacklevel=2,
                )
        row.update(
            rl_tokens=norms.rl_tokens,
            echo_tokens=norms.echo_tokens,
            sequences=norms.sequences,
            tokens=total_tokens,
            grad_norm=float(grad_norm),
            lr=opt.param_groups[0]["lr"],
            gen_time=t_gen,
            step_time=step_time,
            tokens_per_s=total_tokens / max(step_time - t_gen, 1e-9),
        )
        # the loss's per-env metrics; echo ones only on steps with echo (nothing logged as 0.0)
        no_echo = warm or echo is None
        row.update({f"loss/{k}": v for k, v in sorted(m.items()) if not (no_echo and "echo" in k)})
        last = step + 1 == total
        at_start = step + 1 == warm_steps and cfg.train.max_steps > 0 and cfg.train.eval_at_start
        periodic = not warm and ((rl_step + 1) % cfg.train.eval_every == 0 or last)
        if at_start or periodic or (warm and last):
            row.update(evaluate(step + 1, max(rl_step + 1, 0), full=at_start or last))
        if metrics_file is not None:
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            if trackers is not None:
                trackers.log(row)
            line = _summary(row, total)
            if bar is not None:
                bar.update(1)
                bar.write(line)
            else:
                log(line)

        # 7. Checkpoint (atomic); the last step always gets one.
        if (step + 1) % cfg.train.checkpoint_every == 0 or last:
            _save(out, step + 1, model, opt, rae, cfg, rank, world)

    # -- the end: final weights as an HF directory, plots ------------------------------------------
    files.close()
    exported = _gather(ckpt.final_model_complete(out / "final-model"), world)[0]
    if start < total or not exported:  # (re-)export after a crash during export
        _export_model(out, model, tok, rank)
    if rank == 0 and cfg.train.plots:
        from echoloss.train.plots import plot_run

        plot_run(out / "metrics.jsonl", out / "plots")
    if world > 1:
        dist.barrier()
    return out


def _summary(row: dict[str, Any], total: int) -> str:
    parts = [f"step {row['step']:>4}/{total} {row['phase']:<6}"]
    for key, fmt in (
        ("reward", "reward {:.3f}"),
        ("loss_rl", "rl {:+.4f}"),
        ("loss_echo", "echo {:.4f}"),
        ("heldout_obs_ce", "obs_ce {:.3f}"),
        ("heldout_hidden_ce", "hidden_ce {:.3f}"),
        ("entropy", "ent {:.3f}"),
        ("grad_norm", "|g| {:.2f}"),
        ("step_time", "{:.2f}s"),
    ):
        if key in row:
            parts.append(fmt.format(row[key]))
    if row["phase"] == "warmup":
        parts.append(f"sft {row['loss_sft']:.4f}")
        if "loss_obs" in row:
            parts.append(f"obs {row['loss_obs']:.4f}")
    if "eval_success_greedy" in row:
        parts.append(f"heldout success {row['eval_success_greedy']:.3f}")
    return "  ".join(parts)


def _observation_config(weight: float) -> echoloss.EchoConfig | None:
    """The warm-up's observation-token CE (weight ``warmup.obs_weight``), or None when 0."""
    return None if weight == 0 else echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=weight))


def _warmup_lr(cfg: TrainConfig, step: int) -> float:
    """The warm-up lr: a linear ramp over ``warmup.lr_ramp_steps``, then ``warmup.lr``. A cold
    start at the full SFT lr spikes the gradient norm (43 at lr 3e-3 on a random-init model)."""
    ramp = cfg.warmup.lr_ramp_steps
    return cfg.warmup.lr * (min(step + 1, ramp) / ramp if ramp else 1.0)


def _banner(
    cfg: TrainConfig,
    model: Any,
    env: Any,
    device: torch.device,
    out: Path,
    resumed: str | None,
    start: int,
) -> str:
    """What this run is, before it starts: device, dtype, model, env, λ, steps, output."""
    params = sum(p.numel() for p in model.parameters())
    what = (
        describe_model(cfg.model.path, cfg.model.gguf_file, _dtype(cfg, device))
        if cfg.model.path
        else f"tiny {cfg.model.arch} ({cfg.model.num_layers} layers)"
    )
    e = cfg.echo
    lam = (
        f"{e.alpha:g}"
        if e.schedule == "constant"
        else (
            f"{e.alpha:g} ({e.schedule} over {e.schedule_steps} RL steps"
            + (f" to {e.final_alpha:g})" if e.schedule == "decay" else ")")
        )
    )
    tasks = len(env.eval_tasks())
    lines = [
        "echoloss-train",
        f"  device {device} ({_dtype(cfg, device)}), {torch.get_num_threads()} CPU thread(s)",
        f"  model  {what}, {params / 1e6:.3g}M parameters",
        f"  env    {cfg.env.name}"
        + (f" {cfg.env.size}x{cfg.env.size}" if "size" in cfg.env.options() else "")
        + f", turn limit {env.turn_limit}"
        + (f", {tasks} held-out tasks" if tasks else ""),
        "  steps  "
        + (f"{cfg.warmup.copy_steps} copy-task + " if _runs_copy_task(cfg, start) else "")
        + f"{cfg.warmup.steps if cfg.data.source != 'jsonl' else 0} warm-up "
        f"(lr {cfg.warmup.lr:g}, obs weight {cfg.warmup.obs_weight:g}) + "
        f"{cfg.train.max_steps} RL (lr {cfg.optim.lr:g}), "
        f"{cfg.data.prompts_per_step}x{cfg.data.group_size} rollouts/step",
        f"  echo   λ = {lam}" + (" (GRPO only)" if e.alpha == 0 else ""),
        f"  output {out}",
        f"  resume {resumed} (from step {start})" if resumed else "  resume no (fresh start)",
    ]
    if cfg.train.max_steps == 0:
        lines.append("  NOTE   train.max_steps = 0: warm-up only, no RL step")
    if device.type == "cpu" and params > 50e6:
        lines.append(f"  NOTE   a {params / 1e6:.0f}M-parameter model on CPU: expect slow steps")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    from echoloss.train.cli import main

    main()
