"""How well can the trainer's tiny model learn mirrorgrid's world model at all?

The upper bound for what echo can teach: train a fresh tiny model *directly* on the
hidden-dependent observation tokens (the direction words, `MirrorGrid.hidden_spans`) of random
walks in the mirrored world, with nothing else in the loss, and report their held-out CE against
the exact floor and against the two reference points that need no inference from the history:

* ``log 3``: knowing the rules (the word is the key's direction, its opposite, or ``wall``)
  but not inferring the mirroring from earlier moves;
* the floor: inferring it perfectly (``log 2`` for the first move along each axis, 0 after).

::

    python examples/research/echo_experiment/run.py world-model-probe --hidden-size 64 --layers 2 --steps 400
    python examples/research/echo_experiment/run.py world-model-probe --hidden-size 128 --layers 4 --steps 200
    python examples/research/echo_experiment/run.py world-model-probe --env mirrorgrid-shown --steps 800   # a lookup, no inference
    python examples/research/echo_experiment/run.py world-model-probe --pretrain-induction-steps 3000 --steps 800 --eval-every 100
    python examples/research/echo_experiment/run.py world-model-probe --init runs/copy/final-model --target observations \
        --steps 1500 --save runs/wm-pretrained          # a start that has the world model

``--target observations`` supervises every observation-body token of the walks (what a model
pre-trained on the environment's logs would have seen), not only the direction words.
``--save DIR`` writes the trained model as a Hugging Face directory, usable as ``model.path``.

Prints one JSON object per evaluation (step, seconds, train CE, held-out CE, floor).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from echo_experiment.argtypes import at_least, positive_float
from echoloss.train.data import heldout_conversations, hidden_token_positions
from echoloss.train.envs import MirrorGrid, make_env
from echoloss.train.model import build_tiny_model, build_tokenizer, load_model
from echoloss.train.probes import heldout_hidden_ce
from echoloss.train.regimes import copy_task_warmup


def _observation_positions(tok, conversations):
    """Every observation-body token of each conversation: the whole content of every tool
    message, template and goal arithmetic included (what a model reading the logs sees)."""
    return [
        hidden_token_positions(
            m, tok, {i: (0, len(x["content"])) for i, x in enumerate(m) if x["role"] == "tool"}
        )
        for m in conversations
    ]


def _positions(env: MirrorGrid, tok, conversations):
    sets = [hidden_token_positions(m, tok, env.hidden_spans(m)) for m in conversations]
    nats = sum(env.hidden_nats(m) for m in conversations)
    return sets, nats / sum(len(p) for _, p in sets)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="examples/research/echo_experiment/run.py world-model-probe",
        description=__doc__.splitlines()[0],
    )
    ap.add_argument("--hidden-size", type=at_least(4), default=64)
    ap.add_argument("--layers", type=at_least(1), default=2)
    ap.add_argument("--steps", type=at_least(1), default=400)
    ap.add_argument("--batch", type=at_least(1), default=32)
    ap.add_argument("--lr", type=positive_float, default=3e-3)
    ap.add_argument("--eval-every", type=at_least(1), default=50)
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--device", default="cpu", help="e.g. cuda")
    ap.add_argument(
        "--pretrain-induction-steps",
        type=at_least(0),
        default=0,
        help="first train on copying repeated random token sequences (a generic in-context skill)",
    )
    ap.add_argument(
        "--target",
        choices=["hidden", "observations"],
        default="hidden",
        help="the supervised tokens: the direction words only, or every observation-body token",
    )
    ap.add_argument("--init", help="start from this local model directory (e.g. a copy-task model)")
    ap.add_argument("--save", help="write the trained model here (usable as model.path)")
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument(
        "--env",
        choices=["mirrorgrid", "mirrorgrid-shown"],
        default="mirrorgrid",
        help="mirrorgrid-shown prints the mirroring in the first message: a lookup, no inference",
    )
    args = ap.parse_args(argv)
    if args.hidden_size % 4:  # the tiny model's 4 attention heads split it evenly
        ap.error(f"argument --hidden-size: must be a multiple of 4, got {args.hidden_size}")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    env = make_env(args.env, size=4)
    if args.init:  # a saved model (e.g. the copy-task warm-up) and its tokenizer
        model, tok = load_model(args.init, dtype=torch.float32, attn_implementation="sdpa")
    else:
        tok = build_tokenizer()
        model = build_tiny_model(
            arch="qwen3",
            vocab_size=len(tok),
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=3 * args.hidden_size,
            max_position_embeddings=1024,
            seed=args.seed,
        )
    heldout, floor = _positions(env, tok, heldout_conversations(env, count=64))
    model.to(args.device)
    t0 = time.perf_counter()
    if args.pretrain_induction_steps:  # generic in-context copying, nothing about mirrorgrid
        copy_task_warmup(
            model,
            vocab_size=len(tok),
            steps=args.pretrain_induction_steps,
            lr=args.lr,
            seed=args.seed + 1,
            device=args.device,
            batch=args.batch,
            report=lambda k, ce: print(
                json.dumps({"pretrain_step": k, "copy_ce": round(ce, 4)}), flush=True
            ),
            report_every=args.eval_every,
        )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for step in range(args.steps + 1):
        walks = []
        for i in range(args.batch):
            rng = random.Random(f"probe/{args.seed}/{step}/{i}")
            task = env.task(seed=args.seed, index=step * args.batch + i)  # training pairs only
            walks.append(env.random_walk(task, rng, turns=rng.randint(2, env.turn_limit - 1)))
        if args.target == "hidden":
            sets, _ = _positions(env, tok, walks)
        else:
            sets = _observation_positions(tok, walks)
        width = max(len(ids) for ids, _ in sets)
        x = torch.full((len(sets), width), tok.pad_token_id)
        mask = torch.zeros(len(sets), width, dtype=torch.bool)
        for k, (ids, pos) in enumerate(sets):
            x[k, : len(ids)] = torch.tensor(ids)
            mask[k, torch.tensor(pos)] = True
        x, mask = x.to(args.device), mask.to(args.device)
        logits = model(input_ids=x).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, x[:, 1:, None])[..., 0]
        loss = -(logprobs * mask[:, 1:]).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0:
            row = {
                "step": step,
                "seconds": round(time.perf_counter() - t0, 1),
                "train_ce": round(loss.item(), 4),
                "heldout_ce": round(heldout_hidden_ce(model, heldout, args.device), 4),
                "floor": round(floor, 4),
                "log3": round(math.log(3), 4),
                "hidden_size": model.config.hidden_size,
                "layers": model.config.num_hidden_layers,
                "env": args.env,
                "device": str(args.device),
                "pretrain_induction_steps": args.pretrain_induction_steps,
                "target": args.target,
                "init": args.init,
            }
            print(json.dumps(row), flush=True)
    if args.save:
        model.save_pretrained(args.save)
        tok.save_pretrained(args.save)
