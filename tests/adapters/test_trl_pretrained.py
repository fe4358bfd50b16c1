"""EchoGRPOTrainer on a real pretrained model: SmolLM2-135M-Instruct (the packaged model) playing
the calculator environment with its own samples, two TRL steps, fp32 master weights.

SmolLM2's ChatML template ignores ``tools=`` and ``tool_calls`` (TRL's tool loop refuses it), so
a ``rollout_func`` plays each episode: the model samples a reply (TRL's sampling temperature),
the calculator answers a call as a ``tool`` turn, the model samples again, up to the env's turn
limit. The completion TRL trains is the model's sampled tokens (``env_mask = 1``) with the
template's tokens of each tool turn between them (``env_mask = 0``; echoed, weights from
``completion_echo``); the reward is the episode's (1 for the right final number).
"""

from __future__ import annotations

import itertools

import pytest
from _pretrained import fastest_dtype, smollm2_dir, smollm2_tokenizer

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from datasets import Dataset  # noqa: E402

from echoloss import EchoConfig, RoleEcho  # noqa: E402
from echoloss.adapters.trl import EchoGRPOTrainer, completion_echo  # noqa: E402
from echoloss.train.data import generate_rollouts  # noqa: E402
from echoloss.train.envs.calculator import Calculator  # noqa: E402

ECHO = EchoConfig(tool=RoleEcho(alpha=0.05))
MAX_NEW_TOKENS = 48  # per model turn: a call is ~35 tokens in SmolLM2's vocabulary


def trl_completion(calls, eos: int):
    """``(prompt, completion ids, env mask, sampling logprobs, turns)`` of one played episode:
    the model's turns joined by the template's tokens between them (the tool turn and the next
    generation prompt). Stops after a turn cut at the token limit (no end-of-turn token) and
    before a turn whose prompt does not extend the previous prompt and reply token for token
    (the reply re-tokenised differently), so every model token in the completion is one the
    model sampled after exactly the tokens before it."""
    prompt, first, lps = calls[0]
    ids, mask, logps = list(first), [1] * len(first), list(lps)
    turns = 1
    for (p_prev, c_prev, _), (p, c, lp) in itertools.pairwise(calls):
        head = p_prev + c_prev
        if c_prev[-1:] != [eos] or p[: len(head)] != head:
            break
        bridge = p[len(head) :]
        ids += bridge + c
        mask += [0] * len(bridge) + [1] * len(c)
        logps += [0.0] * len(bridge) + lp
        turns += 1
    return prompt, ids, mask, logps, turns


@pytest.mark.slow  # minutes on 2 CPU cores: generation of up to 12 turns, two updates
def test_echo_grpo_trains_smollm2_on_its_own_calculator_episodes(tmp_path):
    from transformers import AutoModelForCausalLM

    tok = smollm2_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=torch.float32)
    env = Calculator()
    tasks = {t.question: t for t in (env.task(seed=0, index=i) for i in range(2))}
    played: list[dict] = []

    def rollout(prompts, trainer):
        played_tasks = [(i, tasks[p[-1]["content"]]) for i, p in enumerate(prompts)]
        start = len(env.start(played_tasks[0][1]).messages)  # the prompt's messages
        policy = trainer.accelerator.unwrap_model(trainer.model)
        with trainer.accelerator.autocast():
            rollouts = generate_rollouts(
                policy,
                tok,
                env,
                played_tasks,
                group_size=1,  # TRL repeats each prompt num_generations times
                temperature=trainer.temperature,
                max_new_tokens=MAX_NEW_TOKENS,
                device=torch.device("cpu"),
            )
        out = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        out |= {"echo_weights": [], "env_reward": []}
        for r in rollouts:
            calls = [(s.prompt_ids, s.completion_ids, s.completion_logprobs) for s in r.steps]
            p, c, mask, logps, turns = trl_completion(calls, tok.eos_token_id)
            messages = r.messages[start : start + 2 * turns - 1]  # assistant, tool, ...
            sel = completion_echo(c, mask, messages, tok, echo=ECHO)
            weights = [0.0 if w is None else w for w in sel.weights]
            out["prompt_ids"].append(p)
            out["completion_ids"].append(c)
            out["logprobs"].append(logps)
            out["env_mask"].append(mask)
            out["echo_weights"].append(weights)
            out["env_reward"].append(r.reward if turns == len(calls) else 0.0)
            tools = [m["content"] for m in messages if m["role"] == "tool"]
            echoed = [t for t, w in zip(c, weights, strict=True) if w > 0]
            played.append({"echoed": echoed, "tools": tools, "model_tokens": sum(mask)})
        return out

    def reward(completions, env_reward, **kwargs):
        return env_reward

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=3 * MAX_NEW_TOKENS + 64,
        max_steps=2,  # the guide's two steps, one question each
        temperature=0.7,  # as configs/pretrained.toml: at 1.0 most calls are malformed JSON
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=fastest_dtype() == torch.bfloat16,  # autocast: the parameters stay fp32
        save_strategy="no",
        seed=0,
        beta=0.0,
    )
    dataset = Dataset.from_list([{"prompt": env.start(t).messages} for t in tasks.values()])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = EchoGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        rollout_func=rollout,
        echo=ECHO,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "echoloss/echo_tokens" in h]
    assert len(logs) == 2 and len(played) == 4
    for h, step in zip(logs, (played[:2], played[2:]), strict=True):
        # The echo term trains on exactly the calculator's answers, and RL on the sampled tokens.
        assert h["echoloss/echo_tokens"] == sum(len(r["echoed"]) for r in step)
        assert h["echoloss/rl_tokens"] == sum(r["model_tokens"] for r in step)
    for r in played:
        assert tok.decode(r["echoed"]) == "".join(r["tools"])
    assert any(r["tools"] for r in played), "no rollout called the calculator: nothing echoed"
    # fp32 master weights: every trained tensor is fp32 and nearly every weight moved (bf16
    # parameters round most lr = 1e-5 updates away).
    moved = total = 0
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32, n
        moved += int((p.detach() != before[n]).sum())
        total += p.numel()
    assert moved / total > 0.5, f"only {moved / total:.1%} of the weights changed"
