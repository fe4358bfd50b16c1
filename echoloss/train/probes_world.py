"""Measurements of what a run learns about its environment, beside the training loop.

* `world_model_sets` / `world_model_ce`: the held-out cross-entropy of the hidden-dependent
  observation words (the env's ``hidden_tokens``), on two fixed sets, **random walks** (any
  policy's moves: the world model) and **Bayes-optimal demonstrations** (the kind of conversation
  a good policy has), each split by word kind (``move`` / ``wall``) and by ``first`` / ``later``
  (whether the episode's own history already tells the word), each with its exact floor.
* `zero_variance_fraction`: the share of GRPO groups whose rewards are all equal (they give
  no policy gradient).
* `EchoGradient`: the norm of the echo term's gradient against the rest of the loss's,
  ``‖∇echo‖ / ‖∇PG‖``, at the steps where it is asked for (one extra backward pass there).
"""

from __future__ import annotations

import dataclasses
import math
import random
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from echoloss.train.data import hidden_token_positions
from echoloss.train.envs import Env
from echoloss.train.envs.base import HeldoutObservations

__all__ = [
    "EchoGradient",
    "WorldModelSet",
    "world_model_ce",
    "world_model_sets",
    "zero_variance_fraction",
]

CATEGORIES = ("move", "wall", "first", "later")


@runtime_checkable
class WorldModelTokens(Protocol):
    """An env whose hidden-dependent words carry a kind, first/later and an exact floor
    (`echoloss.train.envs.MirrorGrid.hidden_tokens`), with a Bayes-optimal demonstrator
    (``demo_explore = 0``)."""

    demo_explore: float

    def hidden_spans(self, messages: list[dict[str, Any]]) -> dict[int, tuple[int, int]]: ...

    def hidden_tokens(
        self, messages: list[dict[str, Any]]
    ) -> dict[int, tuple[str, str, float]]: ...


@runtime_checkable
class EchoSpans(Protocol):
    """An env that names parts of its observations for a span-restricted echo (``echo.span``)."""

    def echo_spans(
        self, part: str, messages: list[dict[str, Any]]
    ) -> dict[int, tuple[int, int]]: ...


@dataclass
class WorldModelSet:
    """One held-out set: per conversation its token ids, the positions of its hidden-dependent
    tokens, and per position the categories it belongs to and its Bayes-optimal NLL."""

    conversations: list[tuple[list[int], list[int], list[tuple[str, str]], list[float]]] = field(
        default_factory=list
    )


def _bayes_optimal(env: Any) -> Any:
    """The env with exploration off: its `demonstration` is then the Bayes-optimal policy."""
    return dataclasses.replace(env, demo_explore=0.0) if env.demo_explore else env


def world_model_sets(env: Env[Any, Any], tokenizer: Any, *, count: int) -> dict[str, WorldModelSet]:
    """The ``walks`` (random walks, as `heldout_conversations`) and ``demos`` (Bayes-optimal
    demonstrations) held-out sets on the env's held-out tasks; empty when the env marks no
    hidden-dependent tokens (``hidden_tokens``)."""
    from echoloss.train.data import heldout_conversations

    if count == 0 or not (
        isinstance(env, WorldModelTokens) and isinstance(env, HeldoutObservations)
    ):
        return {}
    optimal = _bayes_optimal(env)
    demos = [
        optimal.demonstration(env.heldout_task(index=i), random.Random(f"heldout-demo/{i}"))
        for i in range(count)
    ]
    out = {}
    for name, convs in (("walks", heldout_conversations(env, count=count)), ("demos", demos)):
        s = WorldModelSet()
        for messages in convs:
            info = env.hidden_tokens(messages)
            spans = env.hidden_spans(messages)
            ids, positions = hidden_token_positions(messages, tokenizer, spans)
            # one token per hidden word (the tokenizer's words are single tokens): positions
            # come in message order, as do the sorted message indices of ``info``
            if len(positions) != len(info):
                warnings.warn(
                    f"the split direction-word CE (ce_walks_*, ce_demos_*) is not measured: the "
                    f"tokenizer spells the direction words of {env.name} in {len(positions)} "
                    f"tokens for {len(info)} words, and it needs one token per word (the tiny "
                    "model's tokenizer with env.words = 'compass' builds them as words)",
                    stacklevel=2,
                )
                return {}
            cats = [(info[i][0], info[i][1]) for i in sorted(info)]
            nats = [info[i][2] for i in sorted(info)]
            s.conversations.append((ids, positions, cats, nats))
        out[name] = s
    return out


def world_model_ce(model: Any, sets: dict[str, WorldModelSet], device: Any) -> dict[str, float]:
    """Mean CE (nats/token) of the hidden-dependent tokens of each set, over all of them and per
    category, with the floors: keys ``ce_<set>_<category>`` and ``floor_<set>_<category>``
    (category ``all``, ``move``, ``wall``, ``first``, ``later``; absent when a set has no token
    of that category)."""
    was = model.training
    model.eval()
    out: dict[str, float] = {}
    with torch.no_grad():
        for name, s in sets.items():
            nll: dict[str, list[float]] = {c: [] for c in ("all", *CATEGORIES)}
            floor: dict[str, list[float]] = {c: [] for c in ("all", *CATEGORIES)}
            for ids, positions, cats, nats in s.conversations:
                if not positions:
                    continue
                x = torch.tensor([ids], device=device)
                logprobs = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
                at = torch.tensor(positions, device=device)
                token_nll = (-logprobs[at - 1, x[0, at]]).tolist()
                for v, (kind, when), f in zip(token_nll, cats, nats, strict=True):
                    for c in ("all", kind, when):
                        nll[c].append(v)
                        floor[c].append(f)
            for c, vals in nll.items():
                if vals:
                    out[f"ce_{name}_{c}"] = sum(vals) / len(vals)
                    out[f"floor_{name}_{c}"] = sum(floor[c]) / len(floor[c])
    model.train(was)
    return out


def zero_variance_fraction(rewards_by_group: dict[Any, list[float]]) -> float:
    """The share of groups whose rewards are all equal (no GRPO signal); NaN with no group.

    Examples:
        >>> zero_variance_fraction({0: [1.0, 1.0], 1: [0.0, 1.0], 2: [0.0, 0.0, 0.0]})
        0.6666666666666666
    """
    if not rewards_by_group:
        return math.nan
    flat = sum(1 for r in rewards_by_group.values() if max(r) == min(r))
    return flat / len(rewards_by_group)


class EchoGradient:
    """``‖∇echo‖`` and ``‖∇PG‖`` of one optimiser step: `add` the echo term's loss of each
    micro-batch (before the total loss's backward), then `norms` after the last backward, when
    ``.grad`` holds the whole step's gradient; ``∇PG`` is the rest (the total minus echo).

    Examples:
        >>> w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        >>> g = EchoGradient([w])
        >>> echo = 0.5 * (w ** 2).sum()           # ∇ = w = [1, 2]
        >>> g.add(echo)
        >>> (echo + 3.0 * w[0]).backward()        # total ∇ = [4, 2]: PG part [3, 0]
        >>> [round(n, 6) for n in g.norms()] == [round(math.sqrt(5), 6), 3.0]
        True
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.grads: list[torch.Tensor | None] = [None] * len(params)

    def add(self, echo_loss: torch.Tensor) -> None:
        got = torch.autograd.grad(echo_loss, self.params, retain_graph=True, allow_unused=True)
        for k, g in enumerate(got):
            if g is not None:
                prev = self.grads[k]
                self.grads[k] = g.detach().clone() if prev is None else prev + g.detach()

    def norms(self) -> tuple[float, float]:
        """``(‖∇echo‖, ‖∇PG‖)`` of the step (call after the last backward)."""
        echo_sq = pg_sq = 0.0
        for p, g in zip(self.params, self.grads, strict=True):
            total = p.grad
            if total is None:
                continue
            e = g if g is not None else torch.zeros_like(total)
            echo_sq += float(e.float().pow(2).sum())
            pg_sq += float((total - e).float().pow(2).sum())
        return math.sqrt(echo_sq), math.sqrt(pg_sq)
