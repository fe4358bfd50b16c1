"""The tiny model, the local tokenizer + chat template, the packed forward, the environment."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import echoloss
from echoloss.adapters.chat import render_attributed
from echoloss.train.envs.gridwalk import MOVES, GridWalk, Task, demonstration, random_walk
from echoloss.train.model import build_tiny_model, build_tokenizer, packed_logits


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_packed_sequences_do_not_attend_to_each_other(tok, arch):
    model = build_tiny_model(
        arch=arch,
        vocab_size=len(tok),
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        seed=0,
    ).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (7, 3, 11)]
    samples = [
        echoloss.Sample(
            prompt_ids=s[:1],
            completion_ids=s[1:],
            completion_mask=[True] * (len(s) - 1),
            completion_logprobs=[0.0] * (len(s) - 1),
            advantage=1.0,
        )
        for s in seqs
    ]
    [batch] = echoloss.pack(samples, max_tokens=32, pad_to_multiple_of=8)
    with torch.no_grad():
        packed = packed_logits(model, batch, attn_implementation="sdpa")
        cu = batch.cu_seqlens.tolist()
        segments = list(itertools.pairwise(cu))[:-1]  # the last segment is padding
        for k, (a, b) in enumerate(segments):
            alone = model(input_ids=batch.input_ids[a:b][None]).logits[0]
            torch.testing.assert_close(packed[a:b], alone, rtol=0, atol=1e-5, msg=f"sequence {k}")
        # Without the block-diagonal mask the second sequence would see the first: the test bites.
        leaky = model(
            input_ids=batch.input_ids[None], position_ids=batch.position_ids[None]
        ).logits[0]
        assert (leaky[cu[1] : cu[2]] - packed[cu[1] : cu[2]]).abs().max() > 1e-3


def test_tokenizer_round_trips_and_template_attributes_tool_bodies(tok):
    env = GridWalk(size=4)
    messages = demonstration(env, Task(start=(0, 0), goal=(1, 1)), random.Random(0))
    r = render_attributed(messages, tok)
    assert tok.decode(r.token_ids) == r.text
    assert tok(r.text, add_special_tokens=False)["input_ids"] == r.token_ids
    tool_bodies = [
        tok.decode(r.token_ids[s.body_start : s.body_end]) for s in r.spans if s.role == "tool"
    ]
    assert tool_bodies == [m["content"] for m in messages if m["role"] == "tool"]
    assert tool_bodies[-1] == "pos 1,1 goal 1,1 hint done"
    # The <tool_response> wrapper and the role header are scaffold, never echoed.
    att = r.attribution
    echoed = [
        t
        for t, i, c in zip(r.token_ids, att.message_indices, att.is_content, strict=True)
        if c and att.message_roles[i] == "tool"
    ]
    assert tok.decode(echoed) == "".join(tool_bodies)


def test_environment_is_deterministic_and_learnable():
    env = GridWalk(size=4)
    assert env.task(seed=3, index=5) == env.task(seed=3, index=5)
    assert env.task(seed=3, index=5) != env.task(seed=4, index=5)
    for i in range(50):  # demonstrations always succeed, within the turn limit
        task = env.task(seed=0, index=i)
        ep = env.start(task)
        for m in demonstration(env, task, random.Random(i))[2:]:
            if m["role"] == "assistant":
                env.act(ep, m["content"])
        assert ep.done and ep.reward == 1.0 and ep.turns <= env.turn_limit
    # Observations are a pure function of (position, action, goal).
    for pos in [(0, 0), (3, 3), (1, 2)]:
        for a in [*MOVES, "jump"]:
            assert env.observe(pos, a, (2, 2)) == env.observe(pos, a, (2, 2))
    walk = random_walk(env, Task(start=(0, 0), goal=(3, 3)), random.Random(1), turns=5)
    assert [m["role"] for m in walk[-2:]] == ["tool", "assistant"]
