"""Held-out CE of saved models' direction words on two fixed held-out sets of mirrorgrid.

The experiment's held-out observation CE (``heldout_hidden_ce`` in ``eval.jsonl``) scores the
direction words of **random walks** on held-out tasks: policy-independent, so it measures the
world model and not whether the policy's own moves are predictable. A policy that acts well
never walks randomly, though, and echo trains on the policy's own conversations. This script
scores the same tokens, for any saved models (``final-model`` directories, or a warm-start),
on two sets built the same way for every model:

* ``random-walks``: the experiment's set (2 to 11 uniformly random moves per conversation);
* ``demonstrations``: the environment's Bayes-optimal scripted conversations on held-out tasks
  (press towards the goal, switch keys once a move showed the axis mirrored). After the first
  move along an axis, the direction word is "towards the goal": predictable without knowing which
  key was pressed, the shortcut a model trained on a good policy's conversations can learn.

Both have the same exact floor rule (``log 2`` for the first move along each axis, 0 after).

::

    python examples/research/echo_experiment/run.py heldout-ce runs/wm/warm/final-model runs/exp/*/final-model

Prints one JSON object per model and set (model, set, ce, floor, ce / floor, tokens).
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from echo_experiment.argtypes import at_least
from echoloss.train.data import heldout_conversations, hidden_token_positions
from echoloss.train.envs import make_env
from echoloss.train.model import load_model
from echoloss.train.probes import heldout_hidden_ce


def held_out_sets(env, count: int) -> dict[str, list[list[dict]]]:
    """The two fixed sets: ``count`` conversations each, on the env's held-out tasks."""
    demos = [
        env.demonstration(env.heldout_task(index=i), random.Random(f"heldout-demo/{i}"))
        for i in range(count)
    ]
    return {"random-walks": heldout_conversations(env, count=count), "demonstrations": demos}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="examples/research/echo_experiment/run.py heldout-ce",
        description=__doc__.splitlines()[0],
    )
    ap.add_argument("models", nargs="+", help="local model directories (e.g. */final-model)")
    ap.add_argument("--count", type=at_least(1), default=64, help="conversations per set")
    ap.add_argument("--env", choices=["mirrorgrid"], default="mirrorgrid")
    ap.add_argument("--threads", type=at_least(1), default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = make_env(args.env, size=4)  # demo_explore = 0: the Bayes-optimal demonstrator
    sets = held_out_sets(env, args.count)
    for path in args.models:
        model, tok = load_model(path, dtype=torch.float32, attn_implementation="sdpa")
        for name, conversations in sets.items():
            positions = [hidden_token_positions(m, tok, env.hidden_spans(m)) for m in conversations]
            tokens = sum(len(p) for _, p in positions)
            floor = sum(env.hidden_nats(m) for m in conversations) / tokens
            with torch.no_grad():
                ce = heldout_hidden_ce(model, positions, "cpu")
            row = {"model": path, "set": name, "ce": round(ce, 4), "floor": round(floor, 4),
                   "over_floor": round(ce / floor, 2), "tokens": tokens}  # fmt: skip
            print(json.dumps(row), flush=True)
