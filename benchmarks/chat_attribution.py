"""Chat attribution cost against one ``apply_chat_template``: ``python -m benchmarks --ops chat``.

The op times :func:`echoloss.adapters.chat.attribute` and the template's own
``apply_chat_template(..., tokenize=True)`` on the same agent conversation (system prompt, tool
schemas, then rounds of user question, assistant tool call, tool result, assistant answer)
at several lengths, round-robin (A, B, A, B, ...) so that both see the same machine load, and
reports the median of the repeats, their ratio, and the time per message. The chat template is
Qwen2.5's as shipped by TRL; the tokenizer is a byte-level BPE with the Llama-3 split regex,
trained here on a fixed corpus (no download), with the template's special tokens.

Before timing, a gate checks that ``attribute`` returns exactly the template's token ids and
that every tool result's body decodes to its content. Results go to
``benchmarks/results/chat-attribution_<cpu>_<UTC time>.jsonl``, one JSON object per provider
and length.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "echoloss-bench-chat/1"
LENGTHS = (25, 50, 100, 200, 400)
SMOKE_LENGTHS = (9, 17)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "run_shell",
        "description": "Run a shell command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "description": "The command."}},
            "required": ["cmd"],
        },
    },
}


def conversation(n_messages: int) -> list[dict[str, Any]]:
    """An agent conversation of exactly ``n_messages`` messages (``n_messages >= 1``)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful shell agent."}]
    i = 0
    while len(out) < n_messages:
        i += 1
        out += [
            {"role": "user", "content": f"Step {i}: list the files in dir{i} and count them."},
            {
                "role": "assistant",
                "content": f"Listing dir{i}.",
                "tool_calls": [
                    {
                        "id": f"call{i:05d}",
                        "type": "function",
                        "function": {"name": "run_shell", "arguments": {"cmd": f"ls dir{i}"}},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": f"call{i:05d}",
                "content": f"a{i}.txt\nb.md\nc.py\n3 files, exit status 0",
            },
            {"role": "assistant", "content": f"dir{i} holds 3 files."},
        ]
    return out[:n_messages]


def tokenizer() -> Any:
    """Qwen2.5's chat template with a locally trained byte-level BPE (Llama-3 split regex)."""
    import transformers
    import trl
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(m) for m in conversation(64)] + template.splitlines(keepends=True)
    trainer = trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tags = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in tags])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf.chat_template = template
    return hf


def gate(tok: Any, messages: list[dict[str, Any]]) -> None:
    """``attribute`` returns the template's own ids, and each tool body decodes to its content."""
    from echoloss.adapters.chat import attribute

    ids, att = attribute(messages, tok, tools=[TOOL])
    want = tok.apply_chat_template(messages, tools=[TOOL], tokenize=True, return_dict=False)
    if ids != want:
        raise AssertionError("attribute's token ids differ from apply_chat_template's")
    for k, m in enumerate(messages):
        if m["role"] != "tool":
            continue
        flags = zip(ids, att.message_indices, att.is_content, strict=True)
        body = [t for t, i, c in flags if c and i == k]
        if tok.decode(body) != m["content"]:
            raise AssertionError(f"message {k}: body {tok.decode(body)!r} != {m['content']!r}")


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(lengths: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """One row per (provider, length): median seconds over ``repeats`` round-robin calls."""
    from echoloss.adapters.chat import attribute

    tok = tokenizer()
    rows: list[dict[str, Any]] = []
    for n in lengths:
        msgs = conversation(n)
        gate(tok, msgs)
        providers: dict[str, Callable[[], object]] = {
            "apply_chat_template": functools.partial(
                tok.apply_chat_template, msgs, tools=[TOOL], tokenize=True, return_dict=False
            ),
            "attribute": functools.partial(attribute, msgs, tok, tools=[TOOL]),
        }
        for fn in providers.values():  # warm-up: compiled template, caches
            fn()
        times: dict[str, list[float]] = {name: [] for name in providers}
        for _ in range(repeats):
            for name, fn in providers.items():
                times[name].append(_time(fn))
        tokens = len(providers["apply_chat_template"]())  # type: ignore[arg-type]
        base = statistics.median(times["apply_chat_template"])
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append(
                {
                    "schema": SCHEMA,
                    "op": "chat",
                    "provider": name,
                    "n_messages": n,
                    "tokens": tokens,
                    "repeats": repeats,
                    "median_s": med,
                    "all_s": ts,
                    "per_message_us": med / n * 1e6,
                    "ratio_to_apply_chat_template": med / base,
                }
            )
    return rows


def environment() -> dict[str, Any]:
    import tokenizers
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "commit": commit,
    }


def main(argv: list[str] | None = None, *, output: Path | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks --ops chat", description=__doc__.split("\n", 1)[0]
    )
    p.add_argument("--repeats", type=int, default=9, help="round-robin repeats (default 9)")
    p.add_argument("--smoke", action="store_true", help="two tiny lengths (tests; seconds)")
    p.add_argument("--lengths", default=None, help="comma list of message counts")
    p.add_argument("--output", type=Path, default=output, help="directory for results")
    args, _ = p.parse_known_args(argv)
    lengths: tuple[int, ...] = SMOKE_LENGTHS if args.smoke else LENGTHS
    if args.lengths:
        lengths = tuple(int(x) for x in args.lengths.split(",") if x)
    env = environment()
    rows = [{**r, "environment": env} for r in measure(lengths, args.repeats)]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    host = re.sub(r"\W+", "_", env["cpu"].split(" ")[0] or "cpu")
    out_dir = args.output or ROOT / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"chat-attribution_{host}_{stamp}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"chat attribution on {env['cpu']} (median of {args.repeats}, round-robin)")
    print(f"{'messages':>8} {'tokens':>7} {'template ms':>12} {'attribute ms':>13} {'ratio':>6}")
    for n in lengths:
        a, b = (
            next(r for r in rows if r["n_messages"] == n and r["provider"] == x)
            for x in ("apply_chat_template", "attribute")
        )
        print(
            f"{n:>8} {a['tokens']:>7} {a['median_s'] * 1e3:>12.2f} {b['median_s'] * 1e3:>13.2f} "
            f"{b['ratio_to_apply_chat_template']:>6.2f}"
        )
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
