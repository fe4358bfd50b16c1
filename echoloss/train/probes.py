"""The trainer's evaluations: what a run measures besides its training loss.

* **Held-out success** (`evaluate`): greedy (and sampled) episodes on the env's fixed held-out
  evaluation tasks.
* **Held-out observation CE** (`heldout_observation_ce`): the mean NLL of the tool-observation
  body tokens of a fixed set of held-out conversations, with its exact floor (the env's
  Bayes-optimal NLL).
* **Held-out hidden CE** (`heldout_hidden_ce`): the same restricted to the tokens that depend on
  the env's hidden state, for envs with that capability
  (`echoloss.train.envs.base.HiddenObservations`).
* **Split world-model CE**, zero-variance groups and the echo/PG gradient norms:
  `echoloss.train.probes_world`.

`heldout_set` builds the held-out set once per run. The held-out CEs need the env's optional
capabilities (`echoloss.train.envs.base.HeldoutObservations`, ``HiddenObservations``); without
them their keys are absent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

import echoloss
from echoloss.loss import LossConfig, LossInputs, echo_loss
from echoloss.train.config import DataConfig, TrainSection
from echoloss.train.data import (
    EvalResult,
    evaluate_policy,
    heldout_episodes,
    hidden_token_positions,
    scripted_steps,
)
from echoloss.train.envs import Env, HiddenObservations, ObservationKinds
from echoloss.train.envs.base import HeldoutObservations, ImaginedObservations, tool_schemas
from echoloss.train.model import packed_logits
from echoloss.train.probes_world import WorldModelSet, world_model_ce, world_model_sets

T = TypeVar("T")

__all__ = [
    "Heldout",
    "eval_subset",
    "evaluate",
    "heldout_hidden_ce",
    "heldout_observation_ce",
    "heldout_observation_ces",
    "heldout_set",
]


@dataclass
class Heldout:
    """The held-out observation set: packed (CE of all observation tokens) and as hidden-token
    positions (CE of the hidden-dependent ones), each with its exact floor (nats/token).

    Attributes:
        batches: the held-out conversations, packed, with the observation bodies as echo rows.
        floor: the Bayes-optimal NLL of those observation tokens, per token.
        hidden: per conversation, its token ids and the positions of its hidden-dependent tokens
            (empty when the env does not mark them).
        hidden_floor: the Bayes-optimal NLL of the hidden-dependent tokens, per token.
        world_model: the split world-model CE's sets (`echoloss.train.probes_world`), by name.
        kinds: for envs with observation kinds (`echoloss.train.envs.ObservationKinds`), the
            held-out conversations packed once per kind, with only that kind's observations as
            echo rows (``"result"``, ``"error"``: the held-out CE of each).
    """

    batches: list[echoloss.PackedBatch] = field(default_factory=list)
    floor: float = math.nan
    hidden: list[tuple[list[int], list[int]]] = field(default_factory=list)
    hidden_floor: float = math.nan
    world_model: dict[str, WorldModelSet] = field(default_factory=dict)
    kinds: dict[str, list[echoloss.PackedBatch]] = field(default_factory=dict)


def heldout_set(
    env: Env[Any, Any],
    tok: Any,
    device: torch.device,
    *,
    data: DataConfig,
    micro_batch_tokens: int,
) -> Heldout:
    """The held-out observation set of ``data.heldout_size`` conversations, packed in
    micro-batches of ``micro_batch_tokens`` (``optim.micro_batch_tokens``), and its floors: the
    env's Bayes-optimal NLL of all observation bodies over their token count, and of the
    hidden-dependent tokens over theirs (when the env is a ``HiddenObservations``). Empty with
    ``data.heldout_size = 0``, a JSONL data source (no env to play) or an env without held-out
    random walks and their floor (`echoloss.train.envs.base.HeldoutObservations`)."""
    count = data.heldout_size
    if count == 0 or data.source == "jsonl" or not isinstance(env, HeldoutObservations):
        return Heldout()
    probe = echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=1.0))
    samples = []
    out = Heldout()
    nats = hidden_nats = 0.0
    for messages, start in heldout_episodes(env, count=count):
        nats += env.observation_nats(messages)
        steps = scripted_steps(messages, tok, tool_schemas(env), prompt_messages=start)
        for s in echoloss.interleave(steps, echo=probe):
            s.advantage = 0.0
            samples.append(s)
        if isinstance(env, HiddenObservations):
            hidden_nats += env.hidden_nats(messages)
            out.hidden.append(hidden_token_positions(messages, tok, env.hidden_spans(messages)))
    tokens = sum(sum(1 for w in (s.echo_weights or []) if w) for s in samples)
    batches = echoloss.pack(samples, max_tokens=micro_batch_tokens)
    out.batches = [b.to(device) for b in batches]
    out.floor = nats / max(tokens, 1)
    if out.hidden:
        out.hidden_floor = hidden_nats / max(sum(len(p) for _, p in out.hidden), 1)
    out.world_model = world_model_sets(env, tok, count=count)
    if isinstance(env, ObservationKinds):
        by_kind = _kind_batches(env, tok, count=count, micro_batch_tokens=micro_batch_tokens)
        out.kinds = {kind: [b.to(device) for b in batches] for kind, batches in by_kind.items()}
    return out


def _kind_batches(
    env: ObservationKinds, tok: Any, *, count: int, micro_batch_tokens: int
) -> dict[str, list[echoloss.PackedBatch]]:
    """The ``count`` held-out conversations packed once per observation kind, with only that
    kind's observations echoed (`echoloss.span_echo_filter` on the env's spans of the kind)."""
    probe = echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=1.0))
    episodes = heldout_episodes(env, count=count)
    kinds = sorted({k for messages, _ in episodes for k in env.observation_kinds(messages)})
    out = {}
    for kind in kinds:
        samples = []
        for messages, start in episodes:

            def spans(m: Any, kind: str = kind) -> dict[int, tuple[int, int]]:
                return env.observation_kinds(m).get(kind, {})

            steps = scripted_steps(messages, tok, tool_schemas(env), prompt_messages=start)
            only = echoloss.span_echo_filter(messages, spans, decode=tok.decode)
            for s in echoloss.interleave(steps, echo=probe, echo_filter=only):
                s.advantage = 0.0
                samples.append(s)
        out[kind] = echoloss.pack(samples, max_tokens=micro_batch_tokens)
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
        logits = packed_logits(model, b, attn_implementation=attn).float()
        out = echo_loss(logits, x, config=LossConfig(compute_entropy=False))
        n = int(out.metrics["echo_tokens/all"])
        nll += float(out.metrics["echo_nll_mean/all"]) * n
        count += n
    model.train(was)
    return nll / max(count, 1)


def _echo_rows(batch: echoloss.PackedBatch) -> torch.Tensor:
    """``[L]`` bool: the rows of ``batch`` whose next token is an echoed observation token."""
    return echoloss.next_token_targets(batch).echo_weights > 0


def _shared_prefix(batches: Sequence[echoloss.PackedBatch]) -> list[int]:
    """The tokens every sequence of every batch starts with, ending before the first echo row of
    any (so that no scored row lies in it), or ``[]`` when shorter than `MIN_SHARED_PREFIX`."""
    from echoloss.train.forward import MIN_SHARED_PREFIX, common_prefix_length

    seqs: list[list[int]] = []
    cap = None
    for b in batches:
        ids, cu, rows = b.input_ids.tolist(), b.cu_seqlens.tolist(), _echo_rows(b)
        for k, s in enumerate(b.sample_indices):
            if s < 0:
                continue  # a padding segment
            seqs.append(ids[cu[k] : cu[k + 1]])
            scored = rows[cu[k] : cu[k + 1]].nonzero()
            first = int(scored[0, 0]) if len(scored) else cu[k + 1] - cu[k] - 1
            cap = first if cap is None else min(cap, first)
    if not seqs or cap is None:
        return []
    n = min(cap, min(len(x) for x in seqs) - 1)
    for x in seqs[1:]:
        n = min(n, common_prefix_length(seqs[0], x))
    return seqs[0][:n] if n >= MIN_SHARED_PREFIX else []


@torch.no_grad()
def heldout_observation_ces(
    model: Any, sets: dict[str, list[echoloss.PackedBatch]], *, pad_id: int
) -> dict[str, float]:
    """Mean cross-entropy (nats/token) of each named set's echoed tokens: the value of
    `heldout_observation_ce` for every set, computed for a fraction of its cost.

    The sets are the held-out conversations packed with different echo rows (all observations,
    each observation kind): a batch whose token ids another set already holds is run once. The
    decoder runs the prompt prefix every conversation shares once (keys and values reused, as
    `echoloss.train.forward.SharedPrefixForward` does in the update), then each conversation's
    continuation; the LM head runs only on the rows some set scores, in fp32 (few rows: cheap;
    under bf16 autocast closer to the fp32 value than bf16 logits), and the log-sum-exp in fp32.

    Args:
        model: a Hugging Face causal LM.
        sets: name -> packed batches (``echo_weights > 0`` on the scored tokens).
        pad_id: the token id written on continuation padding.

    Returns:
        name -> mean NLL of its scored tokens (NaN for a set that scores none).

    Examples:
        >>> from echoloss.train.model import build_tiny_model
        >>> m = build_tiny_model(arch="llama", vocab_size=32, hidden_size=16, num_layers=1,
        ...                      num_heads=2, num_kv_heads=1, intermediate_size=32,
        ...                      max_position_embeddings=64, seed=0)
        >>> def talk(k):  # a shared 20-token prompt, then an echoed two-token observation
        ...     return echoloss.Sample(prompt_ids=[*range(1, 21), k], completion_ids=[5, 6],
        ...                            completion_mask=[False, False],
        ...                            completion_logprobs=[0.0, 0.0],
        ...                            echo_weights=[None] * 21 + [1.0, 1.0])
        >>> sets = {"obs": echoloss.pack([talk(21), talk(22)], max_tokens=64)}
        >>> fast = heldout_observation_ces(m, sets, pad_id=0)["obs"]
        >>> abs(fast - heldout_observation_ce(m, sets["obs"], "sdpa")) < 1e-5
        True
    """
    from echoloss.train.forward import SharedPrefixForward, lm_head_weight

    was = model.training
    model.eval()
    every = [b for batches in sets.values() for b in batches]
    prefix = _shared_prefix(every)
    shared = SharedPrefixForward(model, [prefix], pad_id)
    head = lm_head_weight(model).float()  # once: a copy only when the weights are not fp32
    nll = dict.fromkeys(sets, 0.0)
    count = dict.fromkeys(sets, 0)
    distinct: list[tuple[echoloss.PackedBatch, dict[str, torch.Tensor]]] = []  # and set masks
    for name, batches in sets.items():
        for b in batches:
            for seen, masks in distinct:
                if torch.equal(seen.input_ids, b.input_ids):
                    masks[name] = _echo_rows(b)
                    break
            else:
                distinct.append((b, {name: _echo_rows(b)}))
    for b, masks in distinct:
        union = torch.stack(list(masks.values())).any(0)
        rows = union.nonzero().flatten()
        if not len(rows):
            continue
        hidden = shared.hidden(b, 0)[rows]
        with torch.autocast(hidden.device.type, enabled=False):  # few rows: fp32 is cheap
            logits = hidden.float() @ head.T  # [n, V]
        labels = echoloss.next_token_targets(b).labels[rows]
        token_nll = logits.logsumexp(-1) - logits.gather(-1, labels[:, None])[:, 0]
        for name, mask in masks.items():
            picked = mask[rows]
            nll[name] += float(token_nll[picked].double().sum())
            count[name] += int(picked.sum())
    model.train(was)
    return {name: nll[name] / count[name] if count[name] else math.nan for name in sets}


@torch.no_grad()
def heldout_hidden_ce(model: Any, sets: list[tuple[list[int], list[int]]], device: Any) -> float:
    """Mean cross-entropy (nats/token) of the *hidden-dependent* observation tokens of the
    held-out set: ``sets`` holds each conversation's token ids and the positions of those tokens
    (`echoloss.train.data.hidden_token_positions`). Each token is scored from everything before
    it."""
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


def eval_subset(tasks: Sequence[T], count: int | None) -> list[T]:
    """The evaluation tasks ``train.eval_episodes`` asks for: all (None), none (0), or ``count``
    of them spread evenly over the set (every mirroring and region of a grid env, not its
    first pairs), the same ones at every evaluation.

    Examples:
        >>> eval_subset(list(range(10)), 4), eval_subset(list(range(10)), None) == list(range(10))
        ([0, 2, 5, 7], True)
        >>> eval_subset(list(range(10)), 0), eval_subset([1, 2], 5)
        ([], [1, 2])
    """
    if count is None or count >= len(tasks):
        return list(tasks)
    return [tasks[i * len(tasks) // count] for i in range(count)]


def evaluate(
    model: Any,
    tok: Any,
    env: Env[Any, Any],
    heldout: Heldout,
    device: torch.device,
    full: bool,
    *,
    data: DataConfig,
    train: TrainSection,
    attn_implementation: str,
    forward: str = "logits",
) -> dict[str, float]:
    """Held-out success on the env's fixed evaluation tasks (`eval_subset` of them with
    ``train.eval_episodes``; one greedy episode each at ``data``'s sampling settings, plus
    ``train.eval_samples`` sampled ones when ``full``: at the RL start and end) and the held-out
    observation CEs with their floors (the model's forward with ``model.attn_implementation``;
    with the update's ``forward`` ``"shared_prefix"`` through `heldout_observation_ces`, the
    shared prompt once and the LM head on the scored rows only, else the full logits of each
    set). Keys absent when they do not apply."""
    out: dict[str, float] = {}
    tasks = eval_subset(env.eval_tasks(), train.eval_episodes)
    if tasks and data.source != "jsonl":
        r: EvalResult = evaluate_policy(
            model,
            tok,
            env,
            tasks,
            samples=train.eval_samples if full else 0,
            temperature=data.temperature,
            max_new_tokens=data.max_new_tokens,
            device=device,
        )
        out.update(eval_success_greedy=r.success_greedy, eval_episodes=float(r.episodes))
        out["eval_n"] = float(len(tasks))
        if math.isfinite(r.valid_call_rate):
            out["eval_valid_call_rate"] = r.valid_call_rate
        if full and train.eval_samples:
            out.update(eval_success_sampled=r.success_sampled, eval_invalid_rate=r.invalid_rate)
            if isinstance(env, ImaginedObservations):  # an optional capability of the env
                out["eval_imagined_rate"] = r.imagined_rate
    sets = {f"heldout_{kind}_ce": batches for kind, batches in heldout.kinds.items()}
    if heldout.batches:
        sets["heldout_obs_ce"] = heldout.batches
        out["obs_ce_floor"] = heldout.floor
    if sets and forward == "shared_prefix":
        out.update(heldout_observation_ces(model, sets, pad_id=tok.pad_token_id))
    else:  # FSDP, flash attention or a token export: the forward every model has
        for name, batches in sets.items():
            out[name] = heldout_observation_ce(model, batches, attn_implementation)
    if heldout.hidden:
        out["heldout_hidden_ce"] = heldout_hidden_ce(model, heldout.hidden, device)
        out["hidden_ce_floor"] = heldout.hidden_floor
    if heldout.world_model:
        out.update(world_model_ce(model, heldout.world_model, device))
    return out
