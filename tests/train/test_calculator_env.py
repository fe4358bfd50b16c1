"""The ``calculator`` environment: a real instruct model's tool use in its own chat template."""

from __future__ import annotations

import random

import pytest
from _pretrained import smollm2_tokenizer

from echoloss.train.envs import make_env
from echoloss.train.envs.base import ToolSchemas, tool_schemas
from echoloss.train.envs.calculator import (
    EXAMPLES,
    TOOLS,
    CalcTask,
    evaluate,
    parse_tool_calls,
    tool_call,
)


def _random_expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 2 or rng.random() < 0.3:
        return str(rng.randint(0, 999))
    a, b = _random_expression(rng, depth + 1), _random_expression(rng, depth + 1)
    op = rng.choice(["+", "-", "*"])
    return f"({a} {op} {b})" if rng.random() < 0.5 else f"{a} {op} {b}"


def test_evaluate_agrees_with_python_on_random_expressions():
    rng = random.Random(0)
    for _ in range(500):
        e = _random_expression(rng)
        assert evaluate(e) == eval(e), e  # the test's own expressions: eval is safe here


@pytest.mark.parametrize(
    "bad", ["2 ** 3", "2 / 3", "__import__('os')", "(1 + 2", "1 +", "", "1 2", "9" * 81]
)
def test_evaluate_refuses_anything_else(bad):
    with pytest.raises(ValueError):
        evaluate(bad)


def test_a_scripted_episode_and_the_invalid_replies():
    env = make_env("calculator")
    assert isinstance(env, ToolSchemas) and tool_schemas(env) == TOOLS
    task = CalcTask(question="What is 37 * 48 + 12?", expression="37 * 48 + 12", answer=1788)
    ep = env.start(task)
    assert ep.messages[0]["role"] == "system" and "<tools>" in ep.messages[0]["content"]
    assert ep.messages[-1] == {"role": "user", "content": task.question}
    assert env.act(ep, '<tool_call>[{"name": "calc"}]</tool_call>').startswith("error: call")
    assert env.act(ep, tool_call("37 * 48 + 12")) == "1788"
    assert env.act(ep, "So 1,788 pens.") is None
    assert (ep.reward, ep.done, ep.stats["invalid"], ep.stats["tool_calls"]) == (1.0, True, 1, 2)
    ep = env.start(task)
    assert env.act(ep, "<tool_call>[{not json}]</tool_call>").startswith("error: the tool call")
    assert env.act(ep, "<tool_call>oops").startswith("error: a <tool_call> without")
    assert env.act(ep, tool_call("1 + 1")) is None  # out of turns: reward 0
    assert ep.done and ep.reward == 0.0
    ep = env.start(task)
    env.act(ep, "The answer is 1787.")
    assert ep.done and ep.reward == 0.0 and ep.stats["tool_calls"] == 0
    assert parse_tool_calls("no call") is None


def test_tasks_are_pure_and_their_answers_are_right():
    env = make_env("calculator")
    for i in range(50):
        t = env.task(seed=1, index=i)
        assert t == env.task(seed=1, index=i) and t.answer == evaluate(t.expression) > 0
    assert env.task(seed=1, index=0) != env.warmup_task(seed=1, index=0)
    assert len(env.eval_tasks()) == 8


def test_smollm2_attributes_the_calculator_result_exactly():
    """The demonstration in SmolLM2's own template (tool schemas passed, ignored by ChatML):
    every message's body tokens decode to its content; the tool result is echoed and nothing
    else of the tool turn is."""
    import echoloss
    from echoloss.adapters.chat import render_attributed
    from echoloss.train.data import scripted_steps

    tok = smollm2_tokenizer()
    env = make_env("calculator")
    task = env.task(seed=0, index=3)
    messages = env.demonstration(task, random.Random(0))
    r = render_attributed(messages, tok, tools=TOOLS)
    assert r.token_ids == tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, return_dict=False
    )
    att = r.attribution
    for k, m in enumerate(messages):
        body = [
            r.token_ids[t]
            for t in range(len(att))
            if att.message_indices[t] == k and att.is_content[t]
        ]
        assert tok.decode(body) == m["content"], k
    # The worked examples are prompt: one step per turn the policy takes (the call, the
    # answer), and only this episode's result is echoed, not the examples' results.
    start = len(env.start(task).messages)
    assert start == len(EXAMPLES) + 2
    steps = scripted_steps(messages, tok, TOOLS, prompt_messages=start)
    assert [tok.decode(s.completion_ids) for s in steps] == [
        tool_call(task.expression) + "<|im_end|>",
        f"The answer is {task.answer}.<|im_end|>",
    ]
    cfg = echoloss.EchoConfig(tool=echoloss.RoleEcho(alpha=0.05))
    [sample] = echoloss.interleave(steps, echo=cfg)
    weights = sample.token_echo_weights()
    echoed = [t for t, w in zip(sample.token_ids, weights, strict=True) if w > 0]
    assert tok.decode(echoed) == str(task.answer)
    trained = [t for t, m in zip(sample.token_ids, sample.rl_mask(), strict=True) if m]
    assert tok.decode(trained) == (
        f"{tool_call(task.expression)}<|im_end|>The answer is {task.answer}.<|im_end|>"
    )


def test_the_worked_examples_are_right_and_in_every_prompt():
    env = make_env("calculator")
    ep = env.start(env.task(seed=0, index=0))
    assert ep.messages[1 : 1 + len(EXAMPLES)] == list(EXAMPLES)
    roles = [m["role"] for m in EXAMPLES]
    assert roles == ["user", "assistant", "tool", "assistant"] * 3
    for k in range(0, len(EXAMPLES), 4):
        [call] = parse_tool_calls(EXAMPLES[k + 1]["content"]) or []
        result = evaluate(call["arguments"]["expression"])
        assert EXAMPLES[k + 2]["content"] == str(result)
        assert EXAMPLES[k + 3]["content"] == f"The answer is {result}."
    ep.messages[1]["content"] = "changed"  # an episode's messages are its own
    assert env.start(env.task(seed=0, index=0)).messages[1] == EXAMPLES[0]
