"""``calculator``: arithmetic word problems with a calculator tool, for a real instruct model.

Every turn is natural text in the model's own chat template. The system prompt tells the model
what the tool is and how to call it; the user asks a question the model cannot reliably answer
in its head; the model calls the tool in the format it was trained on (SmolLM2's: a JSON list
inside ``<tool_call>`` tags, written in the assistant's content, which is what a ChatML template
renders); the tool's answer comes back as a ``tool`` message (the echo term's observation); then
the model answers. Three solved episodes come first, as real turns of the template (a small
instruct model follows examples in its own format far more than instructions)::

    system     You are a calculator assistant. ... <tools>[{...}]</tools>
    user, assistant, tool, assistant (three times)   <- `EXAMPLES` (prompt)
    user       A shop sells 37 boxes of 48 pens and 12 loose pens. How many pens is that?
    assistant  <tool_call>[{"name": "calculator", "arguments": {"expression": "37 * 48 + 12"}}]</tool_call>
    tool       1788                              <- the calculator (echoed)
    assistant  The shop sells 1788 pens.         -> reward 1: the last number is the answer

The reward is 1 when the last integer of the final answer equals the true value, else 0 (also
when the turn limit runs out). A reply is *invalid* (``stats["invalid"]``) when it opens a tool
call that is not a well-formed call of ``calculator`` with an ``expression`` string; the tool
then answers ``error: ...`` and the episode goes on.

What echo learns here: every observation is a deterministic function of the call, so its exact
floor is 0 nats. A *result* (``1788``) is the value of the expression the model just wrote:
predicting it is computing that product, which the model never needs to do itself (the tool
does it), so a lower result CE says the model predicts the tool, not that it answers better. An
*error* (``error: the tool call is not JSON (...)``, ``error: not an expression of integers
...: '37 x 48'``) is the parser's fixed wording, sometimes quoting the model's own broken call:
echo on it learns that text. `Calculator.observation_kinds` tells the two apart, for the
held-out CE of each (`echoloss.train.probes`) and for ``echo.error_weight``, which weights or
excludes the error observations in the echo term.

Tasks are pure functions of ``(seed, index)``. The expression evaluator is a small parser of
integers, ``+ - *`` and parentheses (never ``eval``).

Examples:
    >>> env = Calculator()
    >>> task = CalcTask(question="What is 2 * 3 + 4?", expression="2 * 3 + 4", answer=10)
    >>> ep = env.start(task)
    >>> env.act(ep, tool_call("2 * 3 + 4"))
    '10'
    >>> env.act(ep, "The answer is 10."), ep.reward, ep.done
    (None, 1.0, True)
    >>> evaluate("(12 - 5) * 3")
    21
    >>> env.act(env.start(task), tool_call("2 x 3"))
    "error: not an expression of integers with + - * and parentheses: '2 x 3'"
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from echoloss.train.envs.base import Message

__all__ = [
    "EXAMPLES",
    "TOOLS",
    "CalcEpisode",
    "CalcTask",
    "Calculator",
    "evaluate",
    "parse_tool_calls",
    "tool_call",
]

ERROR_PREFIX = "error: "  # how every error observation starts (`Calculator.observe`)
#: Held-out random walks call one of these in place of a valid expression half of the time, so
#: that the held-out set has error observations too (their CE is reported apart from results).
_BAD_CALLS: tuple[str, ...] = (
    "{a} x {b} + {c}",  # a letter for the product
    "{a} ** {b}",  # a power
    "{a} * {b} = {c}",  # an equation
    "{a} * ({b} + {c}",  # an unclosed parenthesis
)

TOOL_NAME = "calculator"
#: The tool schema, passed to ``apply_chat_template(tools=...)`` and printed in the system prompt
#: (templates that ignore ``tools=``, such as SmolLM2's ChatML, only see it there).
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Evaluate an arithmetic expression of integers with + - * and "
            "parentheses; returns the integer result.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": "The expression, e.g. '37 * 48 + 12'.",
                    }
                },
                "required": ["expression"],
            },
        },
    }
]
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_INT = re.compile(r"-?\d[\d,]*")
_TOKEN = re.compile(r"\s*(\d+|[-+*()])")
_MAX_EXPRESSION = 80  # characters: longer "expressions" are refused, not parsed

# Question templates: (text with {a} {b} {c}, expression). Numbers make the product hard to do
# in one's head and keep every result a positive integer.
_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is {a} * {b} + {c}?", "{a} * {b} + {c}"),
    (
        "A shop sells {a} boxes of {b} pens and {c} loose pens. How many pens is that?",
        "{a} * {b} + {c}",
    ),
    (
        "A hall has {a} rows of {b} seats; {c} seats are taken. How many are free?",
        "{a} * {b} - {c}",
    ),
    ("What is ({a} + {c}) * {b}?", "({a} + {c}) * {b}"),
)


@dataclass(frozen=True)
class CalcTask:
    """A question, the expression that answers it, and the answer."""

    question: str
    expression: str
    answer: int


@dataclass
class CalcEpisode:
    """A conversation in progress (the fields of `echoloss.train.envs.base.Episode`)."""

    task: CalcTask
    messages: list[Message]
    turns: int = 0
    done: bool = False
    reward: float = 0.0
    stats: dict[str, float] = field(
        default_factory=lambda: {"invalid": 0.0, "tool_calls": 0.0, "answered": 0.0}
    )


def evaluate(expression: str) -> int:
    """The integer value of ``expression`` (integers, ``+ - *``, parentheses).

    Raises:
        ValueError: anything else, or an expression longer than 80 characters.

    Examples:
        >>> evaluate("2 + 3 * 4"), evaluate("(2 + 3) * 4"), evaluate("-3 * -2")
        (14, 20, 6)
        >>> evaluate("2 ** 10")
        Traceback (most recent call last):
        ...
        ValueError: not an expression of integers with + - * and parentheses: '2 ** 10'
    """
    bad = ValueError(f"not an expression of integers with + - * and parentheses: {expression!r}")
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION} characters")
    parser = _Parser(_tokenize(expression, bad), bad)
    value = parser.expr()
    if parser.at != len(parser.tokens):
        raise bad
    return value


def _tokenize(expression: str, bad: ValueError) -> list[str]:
    """The tokens of ``expression`` (integers and ``+ - * ( )``); raises ``bad`` on anything else."""
    tokens: list[str] = []
    pos = 0
    rest = expression.rstrip()
    while pos < len(rest):
        m = _TOKEN.match(rest, pos)
        if m is None:
            raise bad
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


class _Parser:
    """Recursive descent over ``tokens``: ``expr = term (('+'|'-') term)*``,
    ``term = atom ('*' atom)*``, ``atom = '-' atom | '(' expr ')' | integer``; raises ``bad``
    on any token out of place."""

    def __init__(self, tokens: list[str], bad: ValueError) -> None:
        self.tokens = tokens
        self.bad = bad
        self.at = 0

    def peek(self) -> str | None:
        """The next token, or None at the end."""
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> str:
        """Consume and return the next token (``bad`` at the end)."""
        if self.at >= len(self.tokens):
            raise self.bad
        self.at += 1
        return self.tokens[self.at - 1]

    def atom(self) -> int:
        """A negated atom, a parenthesised expression or an integer."""
        t = self.take()
        if t == "-":
            return -self.atom()
        if t == "(":
            v = self.expr()
            if self.take() != ")":
                raise self.bad
            return v
        if not t.isdigit():
            raise self.bad
        return int(t)

    def term(self) -> int:
        """A product of atoms (``**`` is refused)."""
        v = self.atom()
        while self.peek() == "*":
            self.take()
            if self.peek() == "*":
                raise self.bad
            v *= self.atom()
        return v

    def expr(self) -> int:
        """A sum or difference of terms, left to right."""
        v = self.term()
        while self.peek() in ("+", "-"):
            v = v + self.term() if self.take() == "+" else v - self.term()
        return v


def tool_call(expression: str) -> str:
    """The assistant text that calls the calculator (SmolLM2's tool-call format).

    Examples:
        >>> tool_call("1 + 1")
        '<tool_call>[{"name": "calculator", "arguments": {"expression": "1 + 1"}}]</tool_call>'
    """
    call = [{"name": TOOL_NAME, "arguments": {"expression": expression}}]
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls in ``text``'s ``<tool_call>`` blocks (a JSON object or list each), ``None`` when
    it has none; raises ``ValueError`` on a block that is not JSON of that shape.

    Examples:
        >>> parse_tool_calls(tool_call("2 * 3"))
        [{'name': 'calculator', 'arguments': {'expression': '2 * 3'}}]
        >>> parse_tool_calls("The answer is 6.") is None
        True
    """
    blocks = _CALL.findall(text)
    if not blocks:
        if "<tool_call>" in text:
            raise ValueError("a <tool_call> without its closing </tool_call>")
        return None
    calls: list[dict[str, Any]] = []
    for block in blocks:
        try:
            data = json.loads(block)
        except json.JSONDecodeError as err:
            raise ValueError(f"the tool call is not JSON ({err.msg})") from None
        for call in data if isinstance(data, list) else [data]:
            if not isinstance(call, dict):
                raise ValueError("a tool call must be an object with name and arguments")
            calls.append(call)
    return calls


def _system_prompt() -> str:
    return (
        "You are a calculator assistant. You never do arithmetic yourself: for every question "
        "you first reply with only a call of the calculator tool, like\n"
        f"{tool_call('12 * 34 + 5')}\n"
        "The tool's result comes back in the next message; then you answer with a short "
        "sentence ending with that number.\n"
        f"Tools: <tools>{json.dumps(TOOLS)}</tools>"
    )


def _worked_example(question: str, expression: str) -> list[Message]:
    """A solved episode as chat turns: the question, the call, the result, the answer."""
    answer = evaluate(expression)
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": tool_call(expression)},
        {"role": "tool", "name": TOOL_NAME, "content": str(answer)},
        {"role": "assistant", "content": f"The answer is {answer}."},
    ]


#: Three solved episodes, one per kind of question, shown before every question as real turns
#: of the model's own chat template (in-context examples). Measured on SmolLM2-135M-Instruct
#: with this system prompt, as the probability (teacher-forced, mean over 8 questions) that the
#: reply opens with ``<tool_call>``: 0.000 with the instructions alone (0.000 too with an example
#: written out in the system prompt), 0.24 with the first example as turns, 0.74 with two; on
#: the first 8 RL questions, two examples 0.67 and three 0.84, and the probability of the whole
#: right call (the exact expression) 0.031 with two and 0.115 with three (the third teaches
#: copying parentheses). They are prompt, not the policy's turns: the trainer trains neither
#: them nor their results (`echoloss.train.data.scripted_steps`, ``prompt_messages``).
EXAMPLES: tuple[Message, ...] = (
    *_worked_example("What is 23 * 41 + 7?", "23 * 41 + 7"),
    *_worked_example(
        "A farm has 14 pens of 26 sheep; 9 sheep are sold. How many sheep are left?",
        "14 * 26 - 9",
    ),
    *_worked_example("What is (18 + 7) * 12?", "(18 + 7) * 12"),
)


@dataclass(frozen=True)
class Calculator:
    """Arithmetic questions answered with a calculator tool (see the module docstring).

    Args:
        max_turns: assistant turns before the episode ends with reward 0 (None = 3: a call, a
            retry after an error, and the answer).
        eval_size: held-out evaluation questions (`eval_tasks`; None = 8).
        name: the env name used for per-env metrics.
    """

    max_turns: int | None = None
    eval_size: int | None = None
    name: str = "calculator"

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"Calculator.max_turns must be >= 1, got {self.max_turns}")
        if self.eval_size is not None and self.eval_size < 1:
            raise ValueError(f"Calculator.eval_size must be >= 1, got {self.eval_size}")

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tool schemas for ``apply_chat_template(tools=...)``."""
        return TOOLS

    @property
    def turn_limit(self) -> int:
        return self.max_turns if self.max_turns is not None else 3

    @property
    def turns_needed(self) -> int:
        """A call and the answer."""
        return 2

    def _draw(self, rng: random.Random) -> CalcTask:
        text, expression = rng.choice(_QUESTIONS)
        a, b, c = rng.randint(12, 99), rng.randint(12, 99), rng.randint(2, 99)
        expression = expression.format(a=a, b=b, c=c)
        return CalcTask(
            question=text.format(a=a, b=b, c=c), expression=expression, answer=evaluate(expression)
        )

    def task(self, *, seed: int, index: int) -> CalcTask:
        """Training task ``index`` of the stream ``seed`` (a pure function)."""
        return self._draw(random.Random(f"calculator/train/{seed}/{index}"))

    def warmup_task(self, *, seed: int, index: int) -> CalcTask:
        """Warm-up task ``index`` (its own stream)."""
        return self._draw(random.Random(f"calculator/warmup/{seed}/{index}"))

    def heldout_task(self, *, index: int) -> CalcTask:
        """Held-out task ``index`` (a stream no training step draws from)."""
        return self._draw(random.Random(f"calculator/heldout/{index}"))

    def eval_tasks(self) -> Sequence[CalcTask]:
        """A fixed evaluation set of ``eval_size`` held-out questions (default 8; each
        evaluation plays them greedily, plus ``train.eval_samples`` sampled episodes each:
        minutes per evaluation on a CPU). The first 8 are the same for every size."""
        n = self.eval_size if self.eval_size is not None else 8
        return [self._draw(random.Random(f"calculator/eval/{i}")) for i in range(n)]

    def start(self, task: CalcTask) -> CalcEpisode:
        """A new episode: the system prompt (the tool and its call format), the three worked
        examples of `EXAMPLES` as turns, and the question."""
        messages: list[Message] = [
            {"role": "system", "content": _system_prompt()},
            *(dict(m) for m in EXAMPLES),
            {"role": "user", "content": task.question},
        ]
        return CalcEpisode(task=task, messages=messages)

    def observe(self, calls: list[dict[str, Any]]) -> tuple[str, bool]:
        """The tool's answer to ``calls`` and whether they were all valid."""
        results = []
        valid = True
        for call in calls:
            args = call.get("arguments")
            expression = args.get("expression") if isinstance(args, dict) else None
            if call.get("name") != TOOL_NAME or not isinstance(expression, str):
                results.append(f"error: call {TOOL_NAME} with an expression string")
                valid = False
                continue
            try:
                results.append(str(evaluate(expression)))
            except ValueError as err:
                results.append(f"error: {err}")
                valid = False
        return "\n".join(results), valid

    def act(self, episode: CalcEpisode, text: str) -> str | None:
        """Apply the assistant's reply: a tool call gets the calculator's answer (returned and
        appended as a ``tool`` message); any other reply is the final answer and ends the
        episode."""
        if episode.done:
            raise RuntimeError("act() on a finished episode")
        episode.messages.append({"role": "assistant", "content": text})
        episode.turns += 1
        try:
            calls = parse_tool_calls(text)
        except ValueError as err:
            obs, valid = f"error: {err}", False
        else:
            if calls is None:  # the final answer
                numbers = _INT.findall(text)
                answer = int(numbers[-1].replace(",", "")) if numbers else None
                episode.done = True
                episode.stats["answered"] = 1.0
                episode.reward = float(answer == episode.task.answer)
                return None
            obs, valid = self.observe(calls)
            episode.stats["tool_calls"] += 1
        if not valid:
            episode.stats["invalid"] += 1
        if episode.turns >= self.turn_limit:
            episode.done = True
            episode.reward = 0.0
            return None
        episode.messages.append({"role": "tool", "name": TOOL_NAME, "content": obs})
        return obs

    def demonstration(self, task: CalcTask, rng: random.Random) -> list[Message]:
        """The scripted conversation: call the calculator with the task's expression, answer."""
        del rng
        episode = self.start(task)
        self.act(episode, tool_call(task.expression))
        self.act(episode, f"The answer is {task.answer}.")
        return episode.messages

    def random_walk(self, task: CalcTask, rng: random.Random, turns: int) -> list[Message]:
        """``turns`` calls of random expressions (held-out observation data independent of any
        policy), then a final answer. Half the calls (at random) write a bad expression of
        `_BAD_CALLS`, so the walk has error observations too."""
        episode = self.start(task)
        for _ in range(min(turns, self.turn_limit - 1)):
            a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 99)
            form = rng.choice(_BAD_CALLS) if rng.random() < 0.5 else "{a} * {b} + {c}"
            self.act(episode, tool_call(form.format(a=a, b=b, c=c)))
        self.act(episode, f"The answer is {task.answer}.")
        return episode.messages

    def observation_kinds(self, messages: list[Message]) -> dict[str, dict[int, tuple[int, int]]]:
        """The tool observations by kind: ``"result"`` (the calculator's value) and ``"error"``
        (a body starting with ``error: ``), each as message index -> the span of its whole
        content (`echoloss.train.envs.base.ObservationKinds`).

        Examples:
            >>> msgs = [{"role": "tool", "content": "12"}, {"role": "tool", "content": "error: x"}]
            >>> Calculator().observation_kinds(msgs)
            {'result': {0: (0, 2)}, 'error': {1: (0, 8)}}
        """
        kinds: dict[str, dict[int, tuple[int, int]]] = {"result": {}, "error": {}}
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                kind = "error" if m["content"].startswith(ERROR_PREFIX) else "result"
                kinds[kind][i] = (0, len(m["content"]))
        return kinds

    def observation_nats(self, messages: list[Message]) -> float:
        """0: the calculator's answer is a deterministic function of the call."""
        del messages
        return 0.0

    def imagined_observation(self, reply: str) -> bool:
        """The reply writes chat scaffold or a result block instead of acting."""
        return "<|im_start|>" in reply or "<tool_response>" in reply or "<|im_end|>" in reply
