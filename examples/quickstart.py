"""End-to-end example: tool rollouts → echo weights → samples → advantages → packed loss → step.

Everything here is the library's own path except two stand-ins for the real thing: a ten-line ChatML renderer over bytes (the HF chat-template adapter produces the same
attribution from any tokenizer), and a bigram "policy" (the reference trainer uses a real causal LM).

Run: ``python examples/quickstart.py`` (CPU, a few seconds).
"""

from __future__ import annotations

import random

import torch

import echoloss

IM_START, IM_END, NL = 256, 257, 10
VOCAB = 258


def render(messages: list[dict], *, start_index: int = 0) -> tuple[list[int], dict]:
    """ChatML over bytes: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then the
    generation prompt. Returns token ids and the renderer-style attribution dict."""
    ids: list[int] = []
    idx: list[int] = []
    content: list[bool] = []

    def emit(tokens: list[int], message: int, is_body: bool) -> None:
        ids.extend(tokens)
        idx.extend([message] * len(tokens))
        content.extend([is_body] * len(tokens))

    for m, msg in enumerate(messages):
        emit([IM_START, *msg["role"].encode(), NL], m, False)
        emit(list(msg["content"].encode()), m, True)
        emit([IM_END, NL], m, False)
    emit([IM_START, *b"assistant", NL], -1, False)  # generation prompt: scaffold of no message
    attribution = {
        "message_indices": [i if i < 0 else i + start_index for i in idx],
        "is_content": content,
        "message_roles": [m["role"] for m in messages],
        "message_tool_names": [m.get("name") for m in messages],
    }
    return ids, attribution


def rollout(rng: random.Random, a: int, b: int) -> tuple[list[echoloss.Step], float]:
    """Two turns: the agent calls ``add``, the tool answers, the agent states a final answer."""
    history = [
        {"role": "system", "content": "You can call add(x, y)."},
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]
    prompt, att = render(history)
    call = f"add({a}, {b})"
    c1 = [*call.encode(), IM_END]
    step1 = echoloss.Step(
        prompt_ids=prompt, completion_ids=c1, completion_logprobs=[-1.0] * len(c1), attribution=att
    )
    # Bridged turn 2: history tokens are scaffold (-1); message indices count the new message only.
    tool_ids, tool_att = render([{"role": "tool", "name": "add", "content": str(a + b)}])
    prefix = prompt + c1 + [NL]
    answer = a + b if rng.random() < 0.5 else a + b + rng.choice([-1, 1])
    c2 = [*str(answer).encode(), IM_END]
    att2 = {
        "message_indices": [-1] * len(prefix) + tool_att["message_indices"],
        "is_content": [False] * len(prefix) + tool_att["is_content"],
        "message_roles": tool_att["message_roles"],
        "message_tool_names": tool_att["message_tool_names"],
    }
    step2 = echoloss.Step(
        prompt_ids=prefix + tool_ids,
        completion_ids=c2,
        completion_logprobs=[-1.0] * len(c2),
        attribution=att2,
    )
    return [step1, step2], float(answer == a + b)


def main(steps: int = 20, group_size: int = 4, seed: int = 0) -> list[dict[str, float]]:
    """Train the toy policy for ``steps`` steps; returns the per-step loss terms."""
    rng = random.Random(seed)
    history: list[dict[str, float]] = []
    torch.manual_seed(seed)
    policy = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, VOCAB))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    echo = echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=1.0))

    for step in range(steps):
        samples, rewards, group_ids, owners = [], [], [], []
        for g in range(4):  # 4 prompts x group_size rollouts
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            for _ in range(group_size):
                trajectory, reward = rollout(rng, a, b)
                rewards.append(reward)
                group_ids.append(f"step{step}-group{g}")
                for s in echoloss.interleave(trajectory, echo=echo, env_name="calc"):
                    samples.append(s)
                    owners.append(len(rewards) - 1)
        advantages = echoloss.compute_advantages(rewards, group_ids, fn="grpo")
        for s, owner in zip(samples, owners, strict=True):
            s.advantage = advantages[owner]

        batches = echoloss.pack(samples, max_tokens=1024, pad_to_multiple_of=64)
        # One record per micro-batch: every per-token stream of the loss, row-aligned
        # (labels, masks, echo weights, observation mask, advantages, logprobs, temperatures).
        inputs = [
            echoloss.LossInputs.from_targets(echoloss.next_token_targets(b), env_names=b.env_names)
            for b in batches
        ]
        # Global counts over every micro-batch of the step (all-reduce them too under DDP/FSDP),
        # so the gradient is the true per-token mean of each term over the whole batch.
        counts = sum(echoloss.count_normalizers(x) for x in inputs)
        optimizer.zero_grad()
        totals: dict[str, float] = {}
        for batch, x in zip(batches, inputs, strict=True):
            logits = policy(batch.input_ids)  # [L, V]: a bigram model needs no positions
            out = echoloss.echo_loss(logits, x, normalizers=counts)
            out.loss.backward()
            for key in ("loss_rl/all", "loss_echo/all"):
                totals[key] = totals.get(key, 0.0) + float(out.metrics[key])
        optimizer.step()
        history.append(totals)
        print(
            f"step {step:2d}  rl loss {totals['loss_rl/all']:+.4f}  "
            f"echo loss {totals['loss_echo/all']:.4f}  "
            f"mean reward {sum(rewards) / len(rewards):.2f}  "
            f"rl tokens {counts.rl_tokens}  echo tokens {counts.echo_tokens}"
        )
    return history


if __name__ == "__main__":
    main()
