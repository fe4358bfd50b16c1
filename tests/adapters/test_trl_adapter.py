"""TRL GRPO with the echo term on tool observations: one optimisation step on CPU.

A random-init tiny Qwen3 model, a byte-level tokenizer built locally with TRL's own Qwen3 chat
template and response parser, and a scripted generator (a random model never emits a tool call):
TRL's real tool loop parses the call, runs the tool, appends its result; the trainer echoes the
result's body and trains RL on the model's tokens.
"""

from __future__ import annotations

import _templates as T
import pytest

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from datasets import Dataset  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from trl.chat_template_utils import (  # noqa: E402
    add_response_schema,
    qwen3_chat_template,
    qwen3_training_chat_template,
)

from echoloss import EchoConfig, RoleEcho  # noqa: E402
from echoloss.adapters.trl import completion_echo  # noqa: E402

QWEN3_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
TOOL_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
)
ANSWER = "Sunny.<|im_end|>"


def get_weather(city: str) -> str:
    """Current weather of a city.

    Args:
        city: The city.
    """
    return f"Sunny in {city}"


def _tokenizer():
    tok = T.byte_tokenizer(qwen3_chat_template, QWEN3_SPECIALS, eos="<|im_end|>")
    return add_response_schema(tok)


def test_completion_echo_marks_exactly_the_tool_result_body():
    tok = _tokenizer()
    first = tok.encode(TOOL_CALL, add_special_tokens=False)
    dummy = [
        {"role": "user", "content": "dummy"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {}}}
            ],
        },
    ]
    tool_msg = {"role": "tool", "name": "get_weather", "content": "Sunny in Paris"}
    # TRL renders with its prefix-stable training variant of the template (trainer.chat_template).
    kw = {"chat_template": qwen3_training_chat_template}
    prefix = tok.apply_chat_template(dummy, tokenize=True, return_dict=False, **kw)
    prefix = prefix[: len(prefix) - prefix[::-1].index(tok.eos_token_id)]
    full = tok.apply_chat_template([*dummy, tool_msg], tokenize=True, return_dict=False,
                                   add_generation_prompt=True, **kw)  # fmt: skip
    suffix = full[len(prefix) :]
    answer = tok.encode(ANSWER, add_special_tokens=False)
    ids = first + suffix + answer
    mask = [1] * len(first) + [0] * len(suffix) + [1] * len(answer)
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        tool_msg,
        {"role": "assistant", "content": "Sunny."},
    ]  # fmt: skip
    cfg = EchoConfig(tool=RoleEcho(alpha=0.05))
    sel = completion_echo(ids, mask, messages, tok, echo=cfg, chat_template=kw["chat_template"])
    echoed = [t for t, w in zip(ids, sel.weights, strict=True) if w is not None]
    assert echoed == list(b"Sunny in Paris")
    assert {w for w in sel.weights if w is not None} == {0.05}
    # An allow-list without this tool echoes nothing; a tool/message mismatch is an error.
    none = completion_echo(ids, mask, messages, tok, chat_template=kw["chat_template"],
                           echo=EchoConfig(tool=RoleEcho(alpha=0.05, tool_names={"search"})))  # fmt: skip
    assert all(w is None for w in none.weights)
    with pytest.raises(ValueError, match=r"1 run\(s\) of tool tokens .* 0 group"):
        completion_echo(ids, mask, messages[:1], tok, echo=cfg, **kw)
    with pytest.raises(ValueError, match=r"tool_mask\[1\] must be 0/1 \(or a bool\), got int 2"):
        completion_echo(ids, [1, 2, *mask[2:]], messages, tok, echo=cfg, **kw)
    wrong = [*messages[:1], {**tool_msg, "content": "Rain"}, messages[2]]
    with pytest.raises(ValueError, match="do not render to the completion's tokens"):
        completion_echo(ids, mask, wrong, tok, echo=cfg, **kw)
    # The raw Qwen3 template renders the dummy tool call differently when it is last: refused.
    with pytest.raises(ValueError, match="do not render to the completion's tokens"):
        completion_echo(ids, mask, messages, tok, echo=cfg)


@pytest.mark.parametrize(
    "from_fields", [False, True], ids=["echo_argument", "config_fields_accumulated"]
)
def test_one_grpo_step_with_tool_echo(tmp_path, from_fields):
    """``echo=EchoConfig(...)`` with one micro-batch, or ``EchoGRPOConfig.echo_tool_alpha`` with
    two accumulated micro-batches of one completion each (TRL splits the generation batch)."""
    from echoloss.adapters.trl import EchoGRPOConfig, EchoGRPOTrainer

    tok = _tokenizer()
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = Qwen3ForCausalLM(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    response_open = tok.convert_tokens_to_ids("<tool_response>")
    seen: list[dict] = []

    class Scripted(EchoGRPOTrainer):
        """A random model never calls a tool: script the two turns, keep TRL's tool loop."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):  # fmt: skip
            out = [
                tok.encode(ANSWER if response_open in p else TOOL_CALL, add_special_tokens=False)
                for p in prompt_ids
            ]
            return out, None

        def _compute_loss(self, model, inputs):
            seen.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super()._compute_loss(model, inputs)

    def reward(completions, **kwargs):
        return [float(i) for i in range(len(completions))]

    fields = {"echo_tool_alpha": 0.05, "gradient_accumulation_steps": 2} if from_fields else {}
    args = EchoGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1 if from_fields else 2,
        num_generations=2,
        max_completion_length=256,
        max_steps=1,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        beta=0.0,
        **fields,
    )
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "Weather in Paris?"}]}] * 2
    )
    trainer = Scripted(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        tools=[get_weather],
        echo=None if from_fields else EchoConfig(tool=RoleEcho(alpha=0.05)),
    )
    trainer.train()

    assert len(seen) == (2 if from_fields else 1)
    ids = torch.cat([x["completion_ids"] for x in seen])
    echo = torch.cat([x["echo_weights"] for x in seen])
    tool_mask = torch.cat([x["tool_mask"] for x in seen])
    # The echo-token count of the whole generation batch reaches every micro-batch.
    assert all(int(x["num_echo_items_in_batch"]) == 2 * len(b"Sunny in Paris") for x in seen)
    for row in range(ids.shape[0]):
        echoed = ids[row][echo[row] > 0].tolist()
        assert echoed == list(b"Sunny in Paris")
        # RL never touches the tool tokens; echo only touches tool tokens.
        assert not (tool_mask[row].bool() & (echo[row] > 0)).any()
    assert torch.allclose(echo[echo > 0], torch.tensor(0.05))
    logged = trainer.state.log_history[0]
    # Logged per micro-batch and averaged: the tokens of one micro-batch.
    assert logged["echoloss/echo_tokens"] == 2 * len(b"Sunny in Paris") / len(seen)
    assert logged["echoloss/rl_tokens"] > 0
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "one optimisation step must update the parameters"


@pytest.mark.parametrize("with_weights", [True, False])
def test_rollout_func_can_supply_echo_weights(tmp_path, with_weights, caplog):
    from echoloss.adapters.trl import EchoGRPOTrainer

    tok = _tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    )  # fmt: skip
    action, env, answer = b"ls", b"a.txt", b"ok"
    completion = [*action, *env, *answer, tok.eos_token_id]
    env_mask = [1] * 2 + [0] * 5 + [1] * 3
    weights = [0.0] * 2 + [0.0, 0.2, 0.2, 0.2, 0.2] + [0.0] * 3

    def rollout(prompts, trainer):
        out = {
            "prompt_ids": [list(b"go")] * len(prompts),
            "completion_ids": [completion] * len(prompts),
            "logprobs": [[-1.0] * len(completion)] * len(prompts),
            "env_mask": [env_mask] * len(prompts),
        }
        if with_weights:
            out["echo_weights"] = [weights] * len(prompts)
        return out

    seen: list[dict] = []

    class Spy(EchoGRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super()._compute_loss(model, inputs)

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2,
                          num_generations=2, max_completion_length=32, max_steps=1,
                          report_to="none", use_cpu=True, save_strategy="no")  # fmt: skip
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "go"}]}] * 2)
    trainer = Spy(model=model, reward_funcs=lambda completions, **kw: [0.0, 1.0], args=args,
                  train_dataset=dataset, processing_class=tok, rollout_func=rollout,
                  echo=EchoConfig(tool=RoleEcho(alpha=0.05)))  # fmt: skip
    trainer.train()
    [inputs] = seen
    expected = torch.tensor([weights, weights]) if with_weights else torch.zeros(2, 10)
    assert torch.allclose(inputs["echo_weights"][:, :10], expected)
    if not with_weights:
        assert "no echo_weights" in caplog.text
