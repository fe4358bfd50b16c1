"""The chat-attribution benchmark op (``python -m benchmarks --ops chat``) on tiny lengths: its
gate, its rows, and its wiring into the benchmark command. No number produced here means
anything (performance is read from committed benchmark results, never from tests)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import chat_attribution, cli  # noqa: E402


def test_conversation_has_the_requested_length_and_an_agent_shape():
    msgs = chat_attribution.conversation(9)
    assert len(msgs) == 9
    assert [m["role"] for m in msgs] == ["system", *["user", "assistant", "tool", "assistant"] * 2]


def test_gate_refuses_a_wrong_attribution(monkeypatch):
    tok = chat_attribution.tokenizer()
    msgs = chat_attribution.conversation(5)
    chat_attribution.gate(tok, msgs)  # the real adapter passes

    import echoloss.adapters.chat as chat

    real = chat.attribute

    def shifted(*a, **kw):
        ids, att = real(*a, **kw)
        return ids[1:], att

    monkeypatch.setattr(chat, "attribute", shifted)
    with pytest.raises(AssertionError, match="differ from apply_chat_template"):
        chat_attribution.gate(tok, msgs)


def test_benchmark_command_writes_one_row_per_provider_and_length(tmp_path):
    assert cli.main(["--ops", "chat", "--smoke", "--repeats", "1", "--output", str(tmp_path)]) == 0
    [path] = sorted(tmp_path.glob("chat-attribution_*.jsonl"))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    lengths = chat_attribution.SMOKE_LENGTHS
    assert [(r["provider"], r["n_messages"]) for r in rows] == [
        (p, n) for n in lengths for p in ("apply_chat_template", "attribute")
    ]
    for r in rows:
        assert r["schema"] == chat_attribution.SCHEMA and r["op"] == "chat"
        assert r["median_s"] > 0 and len(r["all_s"]) == r["repeats"] == 1
        assert r["environment"]["transformers"]
