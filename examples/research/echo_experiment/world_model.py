"""The world-model stage of the world-model 2×2 (docs/experiment.md, "Does knowing the world
help?"): a warm-start model continued on the observation cross-entropy of random walks, so
that RL starts from a model that knows the world by construction, and its sham twins.

Each step's loss is the observation CE of ``batch`` random walks plus, at weight 1 and with
``demos`` > 0, the CE of the replies (and their end-of-turn tokens) of ``demos`` scripted
demonstrations that continue the warm-start's own stream (`stage_demos`: the ordinary world,
20 % random moves), the same for every stage of a seed. The pilot found that the observation
CE alone takes the policy's reply format with it (every sampled reply invalid after its first
candidate stage). The stages differ only in the world the walks are played in (``walks``):

* ``"world"`` (the **world-model** start): random walks on the *training* pairs in the seed's
  world (per world: one fixed permutation of the four directions,
  `echoloss.train.envs.mirrorgrid.world_permutation`); the loss is the CE of every
  observation-body token (the tool messages' contents: direction word, template and goal
  numbers).
* ``"ordinary"`` (a sham): the same walks (the same (start, goal) pairs and the same key presses,
  drawn from the same generator), the same steps, batch and learning-rate schedule, in the
  **ordinary** world (each key moves its own way), which the warm-start already knows.
* ``"shuffled"`` (a sham): the same walks, each in a world of its own, a uniformly random
  permutation of the four directions (the identity included) drawn per walk from a generator of
  its own: the same template and goal arithmetic to learn, and no world that persists.

Both are evaluated on the same held-out random walks **in the seed's world** (held-out pairs,
`echoloss.train.probes_world.world_model_sets`), whose move-word CE has floor 0 given the world.

::

    python -m echo_experiment.world_model WARM_MODEL_DIR OUT_DIR --world 2 --steps 200 --lr 3e-3
    python -m echo_experiment.world_model WARM_MODEL_DIR OUT_DIR --world 2 --walks shuffled ...

writes ``OUT_DIR/final-model`` (a Hugging Face directory, usable as ``model.path``) and
``OUT_DIR/stage.jsonl`` (one line per evaluation: step, learning rate, training CE, the held-out
direction-word CEs, supervised tokens so far).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "STARTS",
    "WALKS",
    "StageConfig",
    "action_batch",
    "lr_at",
    "observation_batch",
    "reply_kl",
    "run_stage",
    "stage_demos",
    "stage_walks",
]

STARTS = ("world-model", "sham")
WALKS = ("world", "ordinary", "shuffled")


@dataclass(frozen=True)
class StageConfig:
    """The stage's schedule: ``steps`` AdamW updates of ``batch`` random walks and ``demos``
    demonstrations each (``demos`` 0: the observation CE alone), the learning rate ramped linearly from ``peak_lr / warmup_steps`` to ``peak_lr`` over ``warmup_steps`` and
    then decayed to 0 along a cosine (`lr_at`); an evaluation every ``eval_every`` steps (and at
    0 and the end) on ``heldout`` held-out walks. AdamW as the trainer's (betas 0.9, 0.95,
    weight decay 0.01, gradient norm clipped at 1)."""

    steps: int
    peak_lr: float
    warmup_steps: int = 10
    batch: int = 32
    eval_every: int = 10
    heldout: int = 64
    demos: int = 0
    keep_policy: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"StageConfig.steps must be >= 1 (got {self.steps})")
        if not (math.isfinite(self.peak_lr) and self.peak_lr > 0):
            raise ValueError(f"StageConfig.peak_lr must be finite and > 0 (got {self.peak_lr})")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(
                f"StageConfig.warmup_steps must be in [0, steps) = [0, {self.steps}) "
                f"(got {self.warmup_steps})"
            )
        for name in ("batch", "eval_every", "heldout"):
            if getattr(self, name) < 1:
                raise ValueError(f"StageConfig.{name} must be >= 1 (got {getattr(self, name)})")
        if self.demos < 0:
            raise ValueError(f"StageConfig.demos must be >= 0 (got {self.demos})")


def lr_at(step: int, *, steps: int, peak: float, warmup: int) -> float:
    """The learning rate of update ``step`` (0-based) of ``steps``: a linear ramp to ``peak``
    over the first ``warmup`` updates, then a cosine decay, one step of it per update, that
    would reach 0 one update after the last (so no update is wasted at lr 0).

    Examples:
        >>> [round(lr_at(k, steps=6, peak=1.0, warmup=2), 4) for k in range(6)]
        [0.5, 1.0, 0.9045, 0.6545, 0.3455, 0.0955]
        >>> round(lr_at(0, steps=3, peak=0.1, warmup=0), 4)
        0.0854
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup + 1) / (steps - warmup + 1)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def stage_walks(env: Any, *, seed: int, step: int, batch: int, walks: str) -> list[Any]:
    """The ``batch`` random walks of update ``step``: pair, walk length and key presses drawn
    from the generator ``world-model-stage/<seed>/<step>/<i>`` on the env's training pairs (never
    a held-out one), played in the world ``walks`` names (`WALKS`: the env's world, the
    ordinary one, or a permutation per walk from the generator
    ``world-model-stage/shuffled/<seed>/<step>/<i>``). Every kind presses the same keys on the
    same pairs.

    Examples:
        >>> from echoloss.train.envs import MirrorGrid
        >>> env = MirrorGrid(level="per-world", world=2, words="compass")
        >>> wm = stage_walks(env, seed=0, step=0, batch=2, walks="world")
        >>> sham = stage_walks(env, seed=0, step=0, batch=2, walks="shuffled")
        >>> keys = lambda w: [m["content"] for m in w if m["role"] == "assistant"]
        >>> [keys(a) == keys(b) for a, b in zip(wm, sham)]
        [True, True]
    """
    from echoloss.train.envs.mirrorgrid import MOVES, MirrorTask, world_permutation

    if walks not in WALKS:
        raise ValueError(f"stage_walks: walks must be one of {WALKS}, got {walks!r}")
    pairs = env.train_pairs()
    longest = max(env.turn_limit - 1, 1)  # the last turn is left for 'done'
    out = []
    for i in range(batch):
        rng = random.Random(f"world-model-stage/{seed}/{step}/{i}")
        start, goal = rng.choice(pairs)
        keys: tuple[str, ...] | None = None  # "ordinary"
        if walks == "world":
            keys = world_permutation(env.world)
        elif walks == "shuffled":  # its own generator: the key presses stay those of the others
            keys = tuple(
                random.Random(f"world-model-stage/shuffled/{seed}/{step}/{i}").sample(
                    list(MOVES), 4
                )
            )
        task = MirrorTask(start, goal, (False, False), keys)  # type: ignore[arg-type]
        out.append(env.random_walk(task, rng, turns=rng.randint(min(2, longest), longest)))
    return out


def observation_batch(walks: list[Any], tok: Any, *, role: str = "tool") -> tuple[Any, Any]:
    """``(input_ids, mask)`` of ``walks``, right-padded to the longest: ``mask[b, t]`` marks
    the tokens of every ``role`` message's content (``tool``: the observation bodies, the
    stage's targets).

    Examples:
        >>> from echoloss.train.envs import MirrorGrid
        >>> from echoloss.train.model import build_tokenizer
        >>> env = MirrorGrid(level="per-world", world=2, words="compass")
        >>> tok = build_tokenizer(compass=True)
        >>> walks = stage_walks(env, seed=0, step=0, batch=3, walks="world")
        >>> x, mask = observation_batch(walks, tok)
        >>> bodies = ["".join(tok.decode([int(t)]) for t in row[m]) for row, m in zip(x, mask)]
        >>> bodies[0] == "".join(m["content"] for m in walks[0] if m["role"] == "tool")
        True
    """
    import torch

    from echoloss.train.data import hidden_token_positions

    sets = []
    for messages in walks:
        spans = {i: (0, len(m["content"])) for i, m in enumerate(messages) if m["role"] == role}
        sets.append(hidden_token_positions(messages, tok, spans))
    width = max(len(ids) for ids, _ in sets)
    x = torch.full((len(sets), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(sets), width, dtype=torch.bool)
    for b, (ids, positions) in enumerate(sets):
        x[b, : len(ids)] = torch.tensor(ids)
        mask[b, positions] = True
    return x, mask


#: The warm-start's demonstrations (the trainer's default warm-up: 80 steps × 32); the stage's
#: continue its stream after them.
WARMUP_DEMOS = 80 * 32
DEMO_EXPLORE = 0.2  # the default warm-up's share of random moves in a demonstration


def stage_demos(env: Any, *, seed: int, step: int, count: int) -> list[Any]:
    """The ``count`` demonstrations of update ``step``: the warm-start's stream continued
    (warm-up tasks, in the ordinary world; demonstration ``WARMUP_DEMOS + step·count + i`` with
    the trainer's generator ``demo/<seed>/<index>``; `DEMO_EXPLORE` random moves), the same for
    every stage of a seed.

    Examples:
        >>> from echoloss.train.envs import MirrorGrid
        >>> env = MirrorGrid(level="per-world", world=2, words="compass")
        >>> d = stage_demos(env, seed=0, step=0, count=2)
        >>> [m["role"] for m in d[0][:3]], d[0][-1]["content"]
        (['system', 'user', 'assistant'], 'done')
    """
    import dataclasses

    demo_env = dataclasses.replace(env, demo_explore=DEMO_EXPLORE)
    out = []
    for i in range(count):
        index = WARMUP_DEMOS + step * count + i
        task = demo_env.warmup_task(seed=seed, index=index)
        out.append(demo_env.demonstration(task, random.Random(f"demo/{seed}/{index}")))
    return out


def action_batch(demos: list[Any], tok: Any) -> tuple[Any, Any]:
    """``(input_ids, mask)`` of ``demos``, right-padded: ``mask`` marks every assistant reply's
    tokens and the end-of-turn token closing each (what the policy generates).

    Examples:
        >>> from echoloss.train.envs import MirrorGrid
        >>> from echoloss.train.model import build_tokenizer
        >>> tok = build_tokenizer(compass=True)
        >>> demos = stage_demos(MirrorGrid(words="compass"), seed=0, step=0, count=1)
        >>> _, replies = observation_batch(demos, tok, role="assistant")
        >>> _, mask = action_batch(demos, tok)
        >>> turns = sum(m["role"] == "assistant" for m in demos[0])
        >>> int(mask.sum()) == int(replies.sum()) + turns
        True
    """
    import torch

    from echoloss.adapters.chat._attribute import attribute

    rows = []
    for messages in demos:
        ids, a = attribute(messages, tok)
        positions = []
        for pos, (msg, content) in enumerate(zip(a.message_indices, a.is_content, strict=True)):
            if not content or msg is None or msg < 0 or messages[msg]["role"] != "assistant":
                continue
            positions.append(pos)
            nxt = pos + 1
            if nxt < len(ids) and a.message_indices[nxt] == msg and not a.is_content[nxt]:
                positions.append(nxt)  # the end-of-turn token closing the reply
        rows.append((ids, positions))
    width = max(len(ids) for ids, _ in rows)
    x = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (ids, positions) in enumerate(rows):
        x[b, : len(ids)] = torch.tensor(ids)
        mask[b, positions] = True
    return x, mask


def _masked_ce(logits: Any, x: Any, mask: Any) -> Any:
    """Mean next-token CE (nats/token) of the masked tokens of ``x`` from ``logits`` (the
    predictions of positions 1 on, ``[B, T-1, V]`` fp32)."""
    import torch

    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, x[:, 1:, None])[..., 0]
    target = mask[:, 1:]
    return -(logprobs * target).sum() / target.sum()


def reply_kl(held: Any, logits: Any, mask: Any) -> Any:
    """Mean over the masked tokens (the replies, `action_batch`) of ``KL(p_held ‖ p)``, the
    next-token distributions of the starting model (``held``) and the model (``logits``), both
    ``[B, T-1, V]`` fp32 predictions of positions 1 on: 0 while the model replies as it started.

    Examples:
        >>> import torch
        >>> a = torch.tensor([[[0.0, 1.0], [2.0, 0.0]]])
        >>> m = torch.tensor([[False, True, True]])
        >>> float(reply_kl(a, a, m))
        0.0
        >>> p, q = torch.softmax(a[0, 0], -1), torch.softmax(a[0, 1], -1)
        >>> kl = float((p * (p.log() - q.log())).sum()) / 2  # one of the two positions differs
        >>> b = torch.tensor([[[2.0, 0.0], [2.0, 0.0]]])
        >>> abs(float(reply_kl(a, b, m)) - kl) < 1e-6
        True
    """
    import torch

    target = mask[:, 1:]
    p_log = torch.log_softmax(held, dim=-1)
    kl = (p_log.exp() * (p_log - torch.log_softmax(logits, dim=-1))).sum(-1)
    return (kl * target).sum() / target.sum()


def _observation_ce(model: Any, x: Any, mask: Any) -> Any:
    """Mean next-token CE (nats/token, fp32) of the masked tokens of ``x``."""
    import torch

    logits = model(input_ids=x).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, x[:, 1:, None])[..., 0]
    target = mask[:, 1:]
    return -(logprobs * target).sum() / target.sum()


def run_stage(
    model_dir: Path,
    out: Path,
    *,
    world: int,
    walks: str,
    cfg: StageConfig,
    seed: int,
    words: str = "compass",
    log: Any = None,
    step_offset: int = 0,
    teacher_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """Continue the model of ``model_dir`` with the stage (see the module docstring) in world
    ``world`` with walks of the kind ``walks`` (`stage_walks`), write ``out/final-model`` and
    ``out/stage.jsonl``; returns the evaluation rows. Deterministic given its arguments (one
    CPU thread).

    A further round of a stage (a warm restart of the schedule from an earlier stage's model)
    passes ``step_offset``, the steps already run: its walks are those of stage steps
    ``step_offset``, ``step_offset + 1``, … (new walks, not the first round's again), and its
    rows' ``step`` counts from there; ``teacher_dir`` is the model whose replies the KL keeps
    (``keep_policy``; default ``model_dir``: for a further round, pass the warm-start's)."""
    import torch

    from echoloss.train.checkpoint import export_atomically
    from echoloss.train.envs import MirrorGrid
    from echoloss.train.model import load_model
    from echoloss.train.probes_world import world_model_ce, world_model_sets

    if step_offset < 0:
        raise ValueError(f"run_stage: step_offset must be >= 0 (got {step_offset})")
    torch.manual_seed(seed + step_offset)
    model, tok = load_model(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    teacher = None
    if cfg.keep_policy:  # a frozen copy of the starting model (or of the one named)
        held_dir = model_dir if teacher_dir is None else teacher_dir
        teacher = load_model(held_dir, dtype=torch.float32, attn_implementation="sdpa")[0].eval()
        teacher.requires_grad_(False)
    env = MirrorGrid(level="per-world", world=world, words=words)  # type: ignore[arg-type]
    heldout = world_model_sets(env, tok, count=cfg.heldout)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.peak_lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    tokens = 0
    t0 = time.perf_counter()

    def record(
        step: int, lr: float | None, train_ce: float | None, action_ce: float | None
    ) -> None:
        ce = world_model_ce(model, heldout, torch.device("cpu"))
        row = {
            "start": "world-model" if walks == "world" else "sham",
            "walks": walks,
            "step": step_offset + step,
            "lr": lr,
            "train_ce": train_ce,
            "action_ce": action_ce,
            "tokens": tokens,
            "seconds": round(time.perf_counter() - t0, 1),
            **{k: v for k, v in ce.items() if k.startswith("ce_walks_")},
        }
        rows.append(row)
        if log is not None:
            log(json.dumps(row))

    record(0, None, None, None)
    model.train()
    for step in range(cfg.steps):
        lr = lr_at(step, steps=cfg.steps, peak=cfg.peak_lr, warmup=cfg.warmup_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        walks_now = stage_walks(
            env, seed=seed, step=step_offset + step, batch=cfg.batch, walks=walks
        )
        x, mask = observation_batch(walks_now, tok)
        tokens += int(mask.sum())
        logits = model(input_ids=x).logits[:, :-1].float()
        loss = _masked_ce(logits, x, mask)
        action = None
        if cfg.demos:  # the replies of the warm-start's demonstrations, continued
            demos = stage_demos(env, seed=seed, step=step_offset + step, count=cfg.demos)
            xa, ma = action_batch(demos, tok)
            action = _observation_ce(model, xa, ma)
        if teacher is not None:  # the starting model's replies, kept where the walks ask for one
            replies = action_batch(walks_now, tok)[1]
            with torch.no_grad():
                held = teacher(input_ids=x).logits[:, :-1].float()
            action = reply_kl(held, logits, replies)
        opt.zero_grad(set_to_none=True)
        (loss if action is None else loss + action).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            record(step + 1, lr, float(loss.detach()),
                   None if action is None else float(action.detach()))  # fmt: skip
    model.eval()

    def write(d: Path) -> None:
        model.save_pretrained(d)
        tok.save_pretrained(d)

    (out / "stage.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    export_atomically(out / "final-model", write)  # last: its presence means the stage is done
    return rows


def main(argv: list[str] | None = None) -> int:
    """The stage from the command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path, help="the warm-start's final-model directory")
    p.add_argument("out", type=Path, help="where final-model/ and stage.jsonl go")
    p.add_argument("--world", type=int, required=True, help="env.world of the seed")
    p.add_argument("--walks", choices=WALKS, default="world",
                   help="the world the walks are played in: the seed's, the ordinary one "
                   "(a sham), or one drawn per walk (a sham)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, required=True, help="the peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--keep-policy", action="store_true",
                   help="add KL(starting model ‖ model) on the walks' replies")  # fmt: skip
    p.add_argument("--demos", type=int, default=0,
                   help="demonstrations per step whose replies are trained too (0: none)")  # fmt: skip
    p.add_argument("--step-offset", type=int, default=0,
                   help="a further round: the stage steps already run (its walks are new ones)")  # fmt: skip
    p.add_argument("--teacher", type=Path, default=None,
                   help="with --keep-policy: the model whose replies are kept (default: "
                   "model_dir; for a further round, the warm-start's)")  # fmt: skip
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    cfg = StageConfig(
        steps=args.steps,
        peak_lr=args.lr,
        warmup_steps=args.warmup_steps,
        batch=args.batch,
        eval_every=args.eval_every,
        demos=args.demos,
        keep_policy=args.keep_policy,
    )
    run_stage(
        args.model_dir,
        args.out,
        world=args.world,
        walks=args.walks,
        cfg=cfg,
        seed=args.seed,
        log=lambda line: print(line, flush=True),
        step_offset=args.step_offset,
        teacher_dir=args.teacher,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
