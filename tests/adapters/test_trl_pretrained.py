"""EchoGRPOTrainer on a real pretrained model: SmolLM2-135M-Instruct (the packaged model) with
the calculator tool dataset, in SmolLM2's own chat template.

SmolLM2's ChatML template ignores ``tools=`` and ``tool_calls`` (TRL's tool loop refuses it), so
the completions come from a ``rollout_func``: each is a conversation of the calculator
environment whose assistant turn calls the tool in SmolLM2's format, the calculator's result as
a ``tool`` turn (``env_mask = 0``, echoed; weights from ``completion_echo``) and a final answer,
right for one completion of each group and wrong for the other (rewards 1 and 0). The old
logprobs are the model's own for those tokens.
"""

from __future__ import annotations

import random

import pytest
from _pretrained import fastest_dtype, smollm2_dir, smollm2_tokenizer

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from datasets import Dataset  # noqa: E402

from echoloss import EchoConfig, RoleEcho  # noqa: E402
from echoloss.adapters.trl import EchoGRPOTrainer, completion_echo  # noqa: E402
from echoloss.train.envs.calculator import TOOLS, Calculator  # noqa: E402

ECHO = EchoConfig(tool=RoleEcho(alpha=0.05))


def _render(tok, messages, gen=False):
    return tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=gen, tokenize=True, return_dict=False
    )


def calculator_completion(tok, env, task, *, right: bool):
    """``(prompt ids, completion ids, env mask, completion messages, reward)`` of one scripted
    calculator conversation in the tokenizer's own template."""
    messages = env.demonstration(task, random.Random(0))
    if not right:
        messages[-1] = {"role": "assistant", "content": f"The answer is {task.answer + 1}."}
    start = len(env.start(task).messages)  # the system prompt, the worked examples, the question
    prompt = _render(tok, messages[:start], gen=True)
    full = _render(tok, messages)
    end = len(full) - full[::-1].index(tok.eos_token_id)  # the answer's end-of-turn token
    completion = full[len(prompt) : end]
    call_end = completion.index(tok.eos_token_id) + 1  # the call turn's end-of-turn token
    answer_start = len(_render(tok, messages[: start + 2], gen=True)) - len(prompt)
    mask = (
        [1] * call_end + [0] * (answer_start - call_end) + [1] * (end - len(prompt) - answer_start)
    )
    reward = 1.0 if right else 0.0
    return prompt, completion, mask, messages[start:], reward


@torch.no_grad()
def _logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].tolist()


def test_echo_grpo_steps_on_smollm2_with_tool_calls(tmp_path):
    from transformers import AutoModelForCausalLM

    tok = smollm2_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=fastest_dtype())
    env = Calculator()
    rewards: dict[str, float] = {}
    result_tokens: list[int] = []

    def rollout(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "echo_weights": []}  # fmt: skip
        for i, _ in enumerate(prompts):
            task = env.task(seed=0, index=i // 2)
            p, c, mask, msgs, r = calculator_completion(tok, env, task, right=i % 2 == 0)
            sel = completion_echo(c, mask, msgs, tok, echo=ECHO)
            echoed = [t for t, w in zip(c, sel.weights, strict=True) if w is not None]
            assert tok.decode(echoed) == str(task.answer)  # exactly the calculator's result
            result_tokens.append(len(echoed))
            out["prompt_ids"].append(p)
            out["completion_ids"].append(c)
            out["logprobs"].append(_logprobs(trainer.model, p, c))
            out["env_mask"].append(mask)
            out["echo_weights"].append([0.0 if w is None else w for w in sel.weights])
            rewards[tok.decode(c)] = r
        return out

    def reward(completions, completion_ids, **kwargs):
        return [rewards[tok.decode(c)] for c in completion_ids]

    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=128,
        max_steps=1,
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=fastest_dtype() == torch.bfloat16,
        save_strategy="no",
        beta=0.0,
    )
    prompt = [{"role": "user", "content": "calculator task"}]  # replaced by the rollout
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    trainer = EchoGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": prompt}] * 2),
        processing_class=tok,
        rollout_func=rollout,
        echo=ECHO,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "echoloss/echo_tokens" in h]
    [h] = logs
    # The echo term sees the calculator's result tokens, and only those.
    assert h["echoloss/echo_tokens"] == sum(result_tokens)
    assert h["echoloss/loss_echo"] > 0 and h["echoloss/rl_tokens"] > 0
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.float(), before[n])]
    assert changed
