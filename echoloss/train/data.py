"""Where the trainer's rollouts come from: on-policy generation, scripted demonstrations, a
held-out set, or a rollout JSONL file.

A `Rollout` is what the training loop consumes: the [`echoloss.Step`][echoloss.data.interleave.Step] list of one
conversation (one step per model call, with the prompt's attribution), its reward, its group and
env. Everything downstream (advantages, ``interleave``, ``pack``, the loss) is the library's own.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

import echoloss
from echoloss.adapters.chat import attribute, render_attributed, steps_from_messages
from echoloss.train.envs.base import HeldoutObservations, ImaginedObservations, tool_schemas

__all__ = [
    "EvalResult",
    "Rollout",
    "SharedPrompt",
    "demo_rollouts",
    "evaluate_policy",
    "generate_rollouts",
    "heldout_conversations",
    "heldout_episodes",
    "hidden_token_positions",
    "prefill",
    "read_rollout_groups",
    "rollout_record",
    "scripted_steps",
    "shared_prompt_length",
]


@dataclass
class Rollout:
    """One finished conversation, ready for [`echoloss.interleave`][echoloss.data.interleave].

    Attributes:
        steps: one [`echoloss.Step`][echoloss.data.interleave.Step] per model call.
        reward: the scalar reward.
        group_id: rollouts of the same prompt share it (GRPO groups).
        env_name: for per-env metrics.
        errored: the rollout failed (it trains nothing and is left out of its group's baseline).
        stats: per-rollout numbers averaged into per-env metrics (turns, walls, ...).
        messages: the conversation (for the token export and debugging).
    """

    steps: list[echoloss.Step]
    reward: float
    group_id: Any
    env_name: str
    errored: bool = False
    stats: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)


def _left_pad(
    rows: Sequence[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


@dataclass
class SharedPrompt:
    """A prompt prefix that every episode of a `_play` call starts with, prefilled once: its
    token ids and each layer's keys and values (``[1, kv_heads, P, D]``)."""

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]

    def starts(self, prompt: Sequence[int]) -> bool:
        """Whether ``prompt`` starts with this prefix (and goes on after it)."""
        n = len(self.ids)
        return len(prompt) > n and list(prompt[:n]) == self.ids


def shared_prompt_length(prompts: Sequence[Sequence[int]]) -> int:
    """The tokens every prompt starts with, leaving each at least one of its own (``generate``
    needs an uncached token per row).

    Examples:
        >>> shared_prompt_length([[1, 2, 3, 4], [1, 2, 3, 5, 6]]), shared_prompt_length([[1, 2]])
        (3, 1)
    """
    from echoloss.train.forward import common_prefix_length

    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        n = min(n, common_prefix_length(prompts[0], p))
    return max(n, 0)


@torch.no_grad()
def prefill(model: Any, ids: list[int], device: torch.device) -> SharedPrompt:
    """Run the decoder once on ``ids`` and keep its keys and values (no LM head)."""
    from echoloss.train.forward import returned_cache

    out = model.get_decoder()(input_ids=torch.tensor([ids], device=device), use_cache=True)
    return SharedPrompt(ids, [(x.keys, x.values) for x in returned_cache(out).layers])


def _prefixed_inputs(
    model: Any, prompts: Sequence[list[int]], shared: SharedPrompt, pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``generate``'s inputs for prompts that all start with ``shared``: the prefix, then each
    prompt's own tokens left-padded (the padding sits between the two: the attention mask hides
    it, and the positions, counted from the mask, run on from the prefix), and the prefix's keys
    and values copied to every row as the cache."""
    from transformers import DynamicCache

    from echoloss.train.forward import cache_keyword

    p, rows = len(shared.ids), len(prompts)
    own, own_mask = _left_pad([r[p:] for r in prompts], pad, device)
    head = torch.tensor([shared.ids], device=device).expand(rows, -1)
    ids = torch.cat([head, own], 1)
    mask = torch.cat([torch.ones_like(head), own_mask], 1)
    cache = DynamicCache()
    for layer, (k, v) in enumerate(shared.kv):
        cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), layer)
    return ids, mask, {cache_keyword(model): cache}


@torch.no_grad()
def _sample(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    synced: bool,
    device: torch.device,
    greedy: bool = False,
    shared: SharedPrompt | None = None,
) -> list[tuple[list[int], list[float]]]:
    """Sample one completion per prompt with HF ``generate``; returns ``(ids, logprobs)`` pairs.

    The completion stops after the first end-of-turn token (kept: the model must learn to emit
    it). Logprobs are ``log_softmax(logits / T)`` of the raw logits, i.e. of exactly the
    distribution sampled from (no top-k / top-p). ``synced`` keeps every data-parallel rank
    stepping until all are done (FSDP gathers parameters in every forward). With ``shared``
    (every prompt starts with it), the prefix's prefilled keys and values are reused: only each
    prompt's own tokens are prefilled.
    """
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    cache: dict[str, Any] = {}
    if shared is not None:
        ids, mask, cache = _prefixed_inputs(model, prompts, shared, pad, device)
    else:
        ids, mask = _left_pad(prompts, pad, device)
    sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if not greedy else {}
    gen = GenerationConfig(
        do_sample=not greedy,
        **sampling,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        return_dict_in_generate=True,
        output_logits=True,
    )
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=gen, synced_gpus=synced, **cache
    )
    new = out.sequences[:, ids.shape[1] :].cpu()
    logits = torch.stack(out.logits, 1).float().cpu()  # [B, T_new, V]
    logp = torch.log_softmax(logits / temperature, -1).gather(-1, new[..., None])[..., 0]
    results = []
    for row, lp in zip(new.tolist(), logp.tolist(), strict=True):
        n = row.index(eos) + 1 if eos in row else len(row)
        results.append((row[:n], lp[:n]))
    return results


def _render_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The prompt the model sees: the chat template with the generation prompt, as token ids."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def _prompt_attributions(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    prompts: list[list[int]],
    tools: list[dict[str, Any]] | None = None,
    *,
    start: int = 0,
) -> list[echoloss.TokenAttribution]:
    """The attribution of every model call's prompt, from one attributed rendering of the whole
    conversation (cheaper than attributing each prompt on its own).

    Prompt ``j`` was rendered from the messages before the ``j``-th assistant message ``k`` at or
    after ``start`` (the episode's first ``start`` messages are its prompt, in-context example
    turns included: the model wrote none of them), plus
    the generation prompt. With a prefix-stable template it is a prefix of the whole rendering;
    its generation prompt (the start of message ``k`` there) becomes scaffold of no message
    (``-1``). A template that rewrites history falls back to attributing that prompt by itself.
    """
    full = render_attributed(messages, tokenizer, tools=tools)
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant" and k >= start]
    att = full.attribution
    out = []
    for k, prompt in zip(assistant, prompts, strict=True):
        n = len(prompt)
        if full.token_ids[:n] != prompt:
            _, a = attribute(messages[:k], tokenizer, tools=tools, add_generation_prompt=True)
            out.append(a)
            continue
        indices = [i if i < k else -1 for i in att.message_indices[:n]]
        names = att.message_tool_names
        out.append(
            echoloss.TokenAttribution(
                message_indices=indices,
                is_content=[c and i >= 0 for c, i in zip(att.is_content[:n], indices, strict=True)],
                message_roles=att.message_roles[:k],
                message_tool_names=None if names is None else names[:k],
            )
        )
    return out


def _reply_text(tokenizer: Any, completion: list[int]) -> str:
    """The reply as written, special tokens included (its closing end-of-turn token removed):
    what the imagined-observation diagnostic reads."""
    eos = tokenizer.eos_token_id
    ids = completion[:-1] if completion and completion[-1] == eos else completion
    text: str = tokenizer.decode(ids, skip_special_tokens=False)
    return text


def _play(
    model: Any,
    tokenizer: Any,
    env: Any,
    episodes: list[Any],
    *,
    temperature: float,
    max_new_tokens: int,
    device: torch.device,
    world_size: int = 1,
    greedy: bool = False,
) -> list[list[tuple[list[int], list[int], list[float]]]]:
    """Play ``episodes`` to the end, turn by turn, all live conversations in one ``generate``
    call per turn. Returns every model call's ``(prompt ids, completion ids, logprobs)`` per
    episode; counts imagined observations in each episode's ``stats["imagined"]`` when the env
    recognises them (`echoloss.train.envs.base.ImaginedObservations`).

    On one process, the prompt prefix every episode starts with (a system prompt, worked
    examples: `shared_prompt_length` of the first turn's prompts, at least
    `echoloss.train.forward.MIN_SHARED_PREFIX` tokens) is prefilled once (`prefill`) and its
    keys and values reused by every ``generate`` call of every turn whose prompts all start
    with it (the weights do not change during the call)."""
    import torch.distributed as dist

    calls: list[list[tuple[list[int], list[int], list[float]]]] = [[] for _ in episodes]
    imagined = isinstance(env, ImaginedObservations)  # an optional capability
    for ep in episodes:
        if imagined:
            ep.stats.setdefault("imagined", 0.0)
    synced = world_size > 1
    shared: SharedPrompt | Literal[False] | None = None  # False: this call shares none
    was_training = model.training
    model.eval()
    while True:
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        if synced:
            flag = torch.tensor([len(live)], dtype=torch.long, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if int(flag) == 0:
                break
        elif not live:
            break
        prompts = [_render_ids(tokenizer, episodes[i].messages, tool_schemas(env)) for i in live]
        if shared is None and prompts and not synced:
            shared = _shared_prompt(model, prompts, device)
        reuse = shared if shared and all(shared.starts(p) for p in prompts) else None
        outs = _sample(
            model,
            tokenizer,
            prompts or [[tokenizer.eos_token_id]],  # a dummy row keeps this rank in step
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            synced=synced,
            device=device,
            greedy=greedy,
            shared=reuse or None,
        )
        for i, prompt, (comp, lp) in zip(live, prompts, outs, strict=False):
            calls[i].append((prompt, comp, lp))
            ep = episodes[i]
            if imagined:
                ep.stats["imagined"] += float(
                    env.imagined_observation(_reply_text(tokenizer, comp))
                )
            env.act(ep, tokenizer.decode(comp, skip_special_tokens=True))
    model.train(was_training)
    return calls


def _shared_prompt(
    model: Any, prompts: Sequence[list[int]], device: torch.device
) -> SharedPrompt | Literal[False]:
    """The prompts' shared prefix, prefilled, or False when it is too short to be worth it."""
    from echoloss.train.forward import MIN_SHARED_PREFIX

    n = shared_prompt_length(prompts)
    return prefill(model, prompts[0][:n], device) if n >= MIN_SHARED_PREFIX else False


@dataclass(frozen=True)
class EvalResult:
    """Success on a fixed task set, greedy and sampled, with the reply diagnostics.

    Attributes:
        success_greedy: mean reward of one greedy episode per task.
        success_sampled: mean reward of ``samples`` sampled episodes per task.
        episodes: episodes played in all (greedy + sampled).
        invalid_rate: replies that are not a move or ``done``, per assistant turn (sampled).
        imagined_rate: replies with scaffold or observation-like text, per assistant turn
            (sampled; see `echoloss.train.envs.imagined_observation`).
        valid_call_rate: greedy episodes that called a tool and wrote no invalid reply (NaN
            for an env that counts no ``tool_calls``).
    """

    success_greedy: float
    success_sampled: float
    episodes: int
    invalid_rate: float
    imagined_rate: float
    valid_call_rate: float = math.nan


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    env: Any,
    tasks: Sequence[Any],
    *,
    samples: int,
    temperature: float,
    max_new_tokens: int,
    device: torch.device,
    chunk: int = 512,
) -> EvalResult:
    """Play every task once greedily and ``samples`` times sampled (batched ``chunk`` episodes
    per ``generate`` call); nothing is trained. ``len(tasks) * (1 + samples)`` episodes."""
    greedy_eps = [env.start(t) for t in tasks]
    sampled_eps = [env.start(t) for t in tasks for _ in range(samples)]
    for eps, greedy in ((greedy_eps, True), (sampled_eps, False)):
        for k in range(0, len(eps), chunk):
            _play(
                model,
                tokenizer,
                env,
                eps[k : k + chunk],
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                device=device,
                greedy=greedy,
            )
    turns = sum(ep.turns for ep in sampled_eps) or math.nan  # no sampled episodes: no rates

    def mean(eps: list[Any]) -> float:
        return sum(ep.reward for ep in eps) / len(eps) if eps else float("nan")

    return EvalResult(
        success_greedy=mean(greedy_eps),
        success_sampled=mean(sampled_eps),
        episodes=len(greedy_eps) + len(sampled_eps),
        invalid_rate=sum(ep.stats.get("invalid", 0.0) for ep in sampled_eps) / turns,
        imagined_rate=(
            sum(ep.stats["imagined"] for ep in sampled_eps) / turns
            if isinstance(env, ImaginedObservations)
            else math.nan  # the env does not recognise imagined observations: not measured
        ),
        valid_call_rate=_valid_call_rate(greedy_eps),
    )


def _valid_call_rate(episodes: list[Any]) -> float:
    """The share of ``episodes`` that called a tool and wrote no invalid reply (NaN when the
    env counts no tool calls)."""
    if not episodes or any("tool_calls" not in ep.stats for ep in episodes):
        return math.nan
    ok = [ep.stats["tool_calls"] >= 1 and ep.stats.get("invalid", 0.0) == 0 for ep in episodes]
    return float(sum(ok)) / len(episodes)


def generate_rollouts(
    model: Any,
    tokenizer: Any,
    env: Any,
    tasks: Sequence[tuple[Any, Any]],
    *,
    group_size: int,
    temperature: float,
    max_new_tokens: int,
    device: torch.device,
    world_size: int = 1,
) -> list[Rollout]:
    """Play ``group_size`` episodes of every ``(group_id, task)`` with the model, turn by turn.

    Every turn renders each live conversation with the chat template, samples all live
    conversations in one batched ``generate`` call, and feeds the decoded replies to the env. A
    model call is one [`echoloss.Step`][echoloss.data.interleave.Step]: the exact prompt ids it saw (attributed by
    [`echoloss.adapters.chat.render_attributed`][echoloss.adapters.chat.render_attributed]) and the exact ids and logprobs it sampled.
    When the next prompt does not extend prompt + completion token for token (a reply cut off
    before its end-of-turn token), [`echoloss.interleave`][echoloss.data.interleave] starts a new sample, as it would
    for any real rollout.

    With ``world_size > 1`` every rank must call this the same number of times; ranks keep
    calling ``generate`` (on a one-row dummy batch when they have nothing left) until no rank has
    a live conversation, because FSDP gathers parameters inside every forward.
    """
    episodes = [(gid, env.start(task)) for gid, task in tasks for _ in range(group_size)]
    starts = [len(ep.messages) for _, ep in episodes]  # the prompt: every message before play
    calls = _play(
        model,
        tokenizer,
        env,
        [ep for _, ep in episodes],
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        device=device,
        world_size=world_size,
    )
    rollouts = []
    for (gid, ep), turns, start in zip(episodes, calls, starts, strict=True):
        atts = _prompt_attributions(
            tokenizer, ep.messages, [p for p, _, _ in turns], tool_schemas(env), start=start
        )
        steps = [
            echoloss.Step(
                prompt_ids=p,
                completion_ids=c,
                completion_logprobs=lp,
                attribution=a,
                temperature=temperature,
            )
            for (p, c, lp), a in zip(turns, atts, strict=True)
        ]
        stats = {"turns": float(ep.turns), "success": ep.reward, **ep.stats}
        rollouts.append(Rollout(steps, ep.reward, gid, env.name, stats=stats, messages=ep.messages))
    return rollouts


class _NoPlaceholderWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "got no logprobs" not in record.getMessage()


def scripted_steps(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    tools: list[dict[str, Any]] | None = None,
    *,
    prompt_messages: int = 0,
) -> list[echoloss.Step]:
    """Steps of a scripted conversation: one per assistant message after the first
    ``prompt_messages`` (the episode's start, ``len(env.start(task).messages)``: a system
    prompt, in-context example turns, the question). Example turns are prompt: they get no
    step, so nothing trains them, and the first step's prompt holds them (echo never reads a
    trajectory's initial prompt, so their tool results are not echoed).

    Nothing sampled the steps, so their logprobs are ``0.0`` placeholders; they are only used by
    the SFT warm-start and the held-out evaluation, which never read them, so the adapter's
    warning about placeholders is silenced here."""
    log = logging.getLogger("echoloss")
    quiet = _NoPlaceholderWarning()
    log.addFilter(quiet)
    try:
        steps = steps_from_messages(messages, tokenizer, tools=tools)
    finally:
        log.removeFilter(quiet)
    examples = sum(m["role"] == "assistant" for m in messages[:prompt_messages])
    return steps[examples:]


def demo_rollouts(
    env: Any, tokenizer: Any, tasks: Sequence[tuple[Any, Any]], seed: int
) -> list[Rollout]:
    """The env's scripted demonstrations (the warm-start's data), as rollouts."""
    out = []
    for gid, task in tasks:
        messages = env.demonstration(task, random.Random(f"demo/{seed}/{gid}"))
        start = len(env.start(task).messages)
        out.append(
            Rollout(
                steps=scripted_steps(messages, tokenizer, tool_schemas(env), prompt_messages=start),
                reward=1.0,
                group_id=gid,
                env_name=env.name,
                messages=messages,
            )
        )
    return out


def heldout_conversations(env: Any, *, count: int) -> list[list[dict[str, Any]]]:
    """The fixed held-out set for the observation cross-entropy: random walks (walls included)
    on the env's held-out tasks, the same for every seed and arm. Random, not scripted or
    on-policy, so the metric measures the world model and not whether the policy's own moves are
    predictable."""
    return [messages for messages, _ in heldout_episodes(env, count=count)]


def heldout_episodes(env: Any, *, count: int) -> list[tuple[list[dict[str, Any]], int]]:
    """`heldout_conversations`, each with its prompt length (the messages of its start, for
    `scripted_steps`'s ``prompt_messages``); none for an env without held-out random walks
    (`echoloss.train.envs.base.HeldoutObservations`)."""
    walks = isinstance(env, HeldoutObservations)  # (not narrowing ``env``: it is an Env too)
    if not walks:
        return []
    out = []
    for i in range(count):
        rng = random.Random(f"heldout/{i}")
        task = env.heldout_task(index=i)
        longest = max(env.turn_limit - 1, 1)  # the last turn is left for 'done'
        walk = env.random_walk(task, rng, turns=rng.randint(min(2, longest), longest))
        out.append((walk, len(env.start(task).messages)))
    return out


def hidden_token_positions(
    messages: list[dict[str, Any]], tokenizer: Any, spans: dict[int, tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """The conversation's token ids and the positions of the tokens inside ``spans`` (message
    index -> character span of that message's content, e.g. `MirrorGrid.hidden_spans`).

    Positions come from the library's chat attribution: the body tokens of each message, in
    order, decode exactly to its content, so their character offsets are running sums.

    Raises:
        ValueError: a span that does not fall on token boundaries (its tokens would also cover
            characters outside it).
    """
    ids, attribution = attribute(messages, tokenizer)
    body: dict[int, list[int]] = {}
    for pos, (msg, content) in enumerate(
        zip(attribution.message_indices, attribution.is_content, strict=True)
    ):
        if content and msg in spans:
            body.setdefault(msg, []).append(pos)
    positions = []
    for msg, (lo, hi) in spans.items():
        at, covered = 0, 0
        for pos in body.get(msg, []):
            width = len(tokenizer.decode([ids[pos]]))
            if lo <= at and at + width <= hi:
                positions.append(pos)
                covered += width
            elif at < hi and at + width > lo:
                raise ValueError(
                    f"message {msg}: token {pos} covers characters [{at}, {at + width}) across "
                    f"the span [{lo}, {hi}); use a tokenizer whose tokens respect the span"
                )
            at += width
        if covered != hi - lo:
            raise ValueError(
                f"message {msg}: the span [{lo}, {hi}) of {messages[msg]['content']!r} is "
                f"covered by tokens of {covered} characters, expected {hi - lo}"
            )
    return ids, sorted(positions)


def read_rollout_groups(path: str, tokenizer: Any, *, default_env: str) -> list[list[Rollout]]:
    """Rollouts from an echoloss rollout JSONL file ([`echoloss.io.rollouts`][echoloss.io.rollouts]), grouped by
    ``group_id`` in order of first appearance.

    Token-form records are used as they are; chat-form records are tokenized with the model's
    chat template. A record with ``error`` set trains nothing (and is left out of its group's
    baseline).

    Raises:
        echoloss.io.RolloutFileError: bad lines, each named by its line number and field.
        ValueError: a record that cannot be turned into steps (naming its line).
    """
    from echoloss.io import read_rollouts

    groups: dict[str, list[Rollout]] = {}
    for n, rec in enumerate(read_rollouts(path), 1):
        try:
            steps = rec.to_steps(tokenizer)
        except ValueError as err:
            raise ValueError(f"{path}: rollout {n} (group {rec.group_id!r}): {err}") from err
        groups.setdefault(rec.group_id, []).append(
            Rollout(
                steps=steps,
                reward=rec.reward,
                group_id=rec.group_id,
                env_name=rec.env_name or default_env,
                errored=rec.error is not None,
                stats=dict(rec.metrics),
                messages=[m.model_dump(exclude_none=True) for m in rec.messages or []],
            )
        )
    if not groups:
        raise ValueError(f"{path}: no rollouts in the file")
    return list(groups.values())


def rollout_record(rollout: Rollout) -> dict[str, Any]:
    """A `Rollout` as an echoloss rollout JSONL record: token form, with attribution, the
    conversation's ``messages`` when it has them, and the rollout's ``temperature`` when every
    call sampled at the same one (each step also carries its own).

    Examples:
        >>> s = echoloss.Step(prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1],
        ...                   temperature=0.7)
        >>> r = Rollout([s], 1.0, "g", "calc", messages=[{"role": "user", "content": "hi"}])
        >>> rec = rollout_record(r)
        >>> rec["temperature"], rec["messages"], rec["steps"][0]["temperature"]
        (0.7, [{'role': 'user', 'content': 'hi'}], 0.7)
    """
    steps = []
    for s in rollout.steps:
        a = s.attribution
        if a is not None and not isinstance(a, echoloss.TokenAttribution):
            a = echoloss.TokenAttribution.from_dict(a)  # the dict form, validated
        steps.append(
            {
                "prompt_ids": s.prompt_ids,
                "completion_ids": s.completion_ids,
                "completion_logprobs": s.completion_logprobs,
                "temperature": s.temperature,
                "attribution": None
                if a is None
                else {
                    "message_indices": list(a.message_indices),
                    "is_content": list(a.is_content),
                    "message_roles": list(a.message_roles),
                    "message_tool_names": None
                    if a.message_tool_names is None
                    else list(a.message_tool_names),
                },
            }
        )
    record: dict[str, Any] = {
        "schema_version": 1,
        "group_id": str(rollout.group_id),
        "reward": rollout.reward,
        "env_name": rollout.env_name,
        "steps": steps,
        "metrics": dict(rollout.stats),
    }
    temps = {s.temperature for s in rollout.steps}
    if len(temps) == 1 and None not in temps:
        record["temperature"] = temps.pop()
    if rollout.messages:
        record["messages"] = [dict(m) for m in rollout.messages]
    return record
