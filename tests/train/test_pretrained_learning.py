"""The pieces of the pretrained learning curve and echo pilot: the calculator's observation kinds
(results and errors), ``echo.error_weight``, the held-out CE per kind, the well-formed-call rate,
the 64-question evaluation set, saved rollouts that say what was sampled, and ``--help``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import echoloss
from echoloss.train import recipe
from echoloss.train.config import parse_config
from echoloss.train.data import Rollout, _valid_call_rate, rollout_record, scripted_steps
from echoloss.train.envs.calculator import CalcTask, Calculator, tool_call
from echoloss.train.model import build_tokenizer
from echoloss.train.regimes import phase_at

TASK = CalcTask(question="What is 12 * 34 + 5?", expression="12 * 34 + 5", answer=413)


def _conversation(env: Calculator) -> tuple[list[dict], int]:
    """A bad call (an error observation), a good call (a result), the answer."""
    ep = env.start(TASK)
    start = len(ep.messages)
    env.act(ep, tool_call("12 x 34 + 5"))
    env.act(ep, tool_call("12 * 34 + 5"))
    env.act(ep, "The answer is 413.")
    return ep.messages, start


def test_observation_kinds_split_results_from_errors():
    env = Calculator()
    messages, _ = _conversation(env)
    kinds = env.observation_kinds(messages)
    error, result = kinds["error"], kinds["result"]
    assert [messages[i]["content"] for i in error] == [
        "error: not an expression of integers with + - * and parentheses: '12 x 34 + 5'"
    ]
    # the worked examples' results (prompt, never echoed by the trainer) are results too
    assert [messages[i]["content"] for i in result] == ["950", "355", "300", "413"]
    assert all(s == (0, len(messages[i]["content"])) for i, s in result.items())


@pytest.mark.parametrize("weight", [0.0, 0.25, 1.0])
def test_error_weight_scales_exactly_the_error_observation_tokens(weight):
    env = Calculator()
    tok = build_tokenizer()
    messages, start = _conversation(env)
    steps = scripted_steps(messages, tok, prompt_messages=start)
    cfg = parse_config({"env": {"name": "calculator"}, "echo": {"error_weight": weight}})
    run = SimpleNamespace(cfg=cfg, env=env, tok=tok)
    phase = phase_at(0, 0, warmup=cfg.warmup, echo=cfg.echo, rl_lr=cfg.optim.lr)
    rollout = Rollout(steps, 1.0, 0, "calculator", messages=messages)
    plain = echoloss.interleave(steps, echo=phase.echo)
    got = recipe._error_weighted(run, rollout, phase, plain)
    [s], [p] = got, plain
    alpha = cfg.echo.alpha
    before = [w for w in p.echo_weights if w is not None]
    after = [w for w in s.echo_weights if w is not None]
    error_text = "error: not an expression of integers with + - * and parentheses: '12 x 34 + 5'"
    n_error = len(tok(error_text, add_special_tokens=False)["input_ids"])
    n_result = len(tok("413", add_special_tokens=False)["input_ids"])
    assert before == [alpha] * (n_error + n_result)
    if weight == 0:
        assert after == [alpha] * n_result
    else:
        assert sorted(after) == sorted([alpha * weight] * n_error + [alpha] * n_result)
    # every other stream is untouched, so Z still counts the error tokens
    assert s.token_observation_mask() == p.token_observation_mask()
    assert s.token_ids == p.token_ids


def test_error_weight_needs_an_env_with_observation_kinds(tmp_path):
    from echoloss.train.recipe import _environment

    with pytest.raises(
        ValueError, match=r"echo\.error_weight = 0\.5: env mirrorgrid marks no error"
    ):
        _environment(parse_config({"echo": {"error_weight": 0.5}}))
    (tmp_path / "x.jsonl").write_text("")
    cfg = parse_config(
        {
            "env": {"name": "calculator"},
            "echo": {"error_weight": 0.5},
            "data": {"source": "jsonl", "path": str(tmp_path / "x.jsonl")},
            "warmup": {"steps": 0},
        }
    )
    with pytest.raises(ValueError, match=r"needs data\.source = 'generate'"):
        _environment(cfg)


def test_heldout_sets_of_each_kind_echo_only_that_kind():
    from echoloss.train.probes import _kind_batches

    env = Calculator()
    tok = build_tokenizer()
    cfg = parse_config(
        {
            "env": {"name": "calculator"},
            "data": {"heldout_size": 8, "max_tokens": 4096},
            "optim": {"micro_batch_tokens": 4096},
        }
    )
    tokens = cfg.optim.micro_batch_tokens
    kinds = _kind_batches(env, tok, count=cfg.data.heldout_size, micro_batch_tokens=tokens)
    assert sorted(kinds) == ["error", "result"]
    for kind, batches in kinds.items():
        text = "".join(
            tok.decode(b.input_ids[b.echo_weights > 0].tolist()) for b in batches
        )  # every echoed token, in order
        assert text
        if kind == "error":
            assert text.startswith("error: ") and set(text) - set("0123456789") != set()
        else:
            assert set(text) <= set("0123456789-")


def test_the_heldout_walks_have_errors_and_results():
    from echoloss.train.data import heldout_episodes

    env = Calculator()
    counts = {"error": 0, "result": 0}
    for messages, start in heldout_episodes(env, count=32):
        for kind, spans in env.observation_kinds(messages[start:]).items():
            counts[kind] += len(spans)
    assert counts["error"] >= 16 and counts["result"] >= 16, counts


def test_eval_size_sets_the_heldout_questions_and_keeps_the_first_eight():
    small, big = Calculator().eval_tasks(), Calculator(eval_size=64).eval_tasks()
    assert len(small) == 8 and len(big) == 64 and list(big[:8]) == list(small)
    assert len({t.question for t in big}) == 64
    with pytest.raises(ValueError, match="eval_size must be >= 1"):
        Calculator(eval_size=0)
    with pytest.raises(ValueError, match="eval_size: applies to the environments calculator"):
        parse_config({"env": {"eval_size": 64}})


def test_valid_call_rate_counts_episodes_with_a_call_and_no_invalid_reply():
    def ep(calls, invalid):
        return SimpleNamespace(stats={"tool_calls": calls, "invalid": invalid})

    assert _valid_call_rate([ep(1, 0), ep(2, 1), ep(0, 1), ep(0, 0)]) == 0.25
    assert math.isnan(_valid_call_rate([SimpleNamespace(stats={})]))


def test_saved_rollouts_keep_the_conversation_and_the_sampling_temperature():
    from echoloss.io import RolloutRecord

    env = Calculator()
    tok = build_tokenizer()
    messages, start = _conversation(env)
    steps = scripted_steps(messages, tok, prompt_messages=start)
    for s in steps:
        s.temperature = 0.7
    record = rollout_record(Rollout(steps, 1.0, 0, "calculator", messages=messages))
    back = RolloutRecord.model_validate(json.loads(json.dumps(record)))
    assert back.temperature == 0.7 and all(s.temperature == 0.7 for s in back.steps)
    assert [m.content for m in back.messages] == [m["content"] for m in messages]


def test_help_names_every_packaged_config(capsys):
    from echoloss.train.command import _parser
    from echoloss.train.presets import packaged_configs

    text = " ".join(_parser().format_help().split())
    for name in packaged_configs():
        assert name in text
    assert {"pretrained", "gpu-pretrained", "pretrained-learn"} <= set(packaged_configs())


def test_the_learning_configs_heldout_sizes_read_as_they_are():
    """``data.heldout_size`` counts the held-out *conversations* of the CEs; ``env.eval_size``
    the held-out *questions* of the success evaluation."""
    from _train_helpers import REPO

    from echoloss.train.config import load_config

    for name, conversations, questions in (("pretrained", 4, 8), ("pretrained-learn", 32, 64)):
        cfg = load_config(REPO / "configs" / f"{name}.toml")
        env = Calculator(**{k: v for k, v in cfg.env.options().items() if v is not None})
        assert cfg.data.heldout_size == conversations and len(env.eval_tasks()) == questions
    text = (REPO / "configs" / "pretrained.toml").read_text()
    assert "heldout_size = 4                 # held-out conversations" in text


def test_the_learning_runner_appends_each_evaluation_once(tmp_path):
    """``scripts/pretrained_learning.py`` turns a run's ``eval.jsonl`` into result rows, adds
    only the evaluations it does not have, and keeps the rows sorted."""
    import importlib.util

    from _train_helpers import REPO

    spec = importlib.util.spec_from_file_location(
        "pretrained_learning", REPO / "scripts" / "pretrained_learning.py"
    )
    assert spec is not None and spec.loader is not None
    pl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pl)
    run = tmp_path / "run"
    run.mkdir()
    evals = [
        {"rl_step": 0, "eval_n": 64.0, "eval_success_greedy": 0.5, "eval_valid_call_rate": 0.75,
         "heldout_result_ce": 2.5, "heldout_error_ce": 2.25, "eval_time": 10.0},
        {"rl_step": 5, "eval_n": 64.0, "eval_success_greedy": 0.625, "eval_valid_call_rate": 0.875,
         "heldout_result_ce": 2.0, "heldout_error_ce": 1.5, "eval_time": 11.0},
    ]  # fmt: skip
    (run / "eval.jsonl").write_text(json.dumps(evals[0]) + "\n")
    results = tmp_path / "results.json"
    pl.sync(results, run, 1, "echo", "abc")
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    pl.sync(results, run, 1, "echo", "def")
    pl.sync(results, run, 1, "echo", "def")
    rows = json.loads(results.read_text())
    assert rows == [
        {"seed": 1, "rl_step": 0, "arm": "echo", "eval_n": 64, "eval_success": 0.5,
         "valid_call_rate": 0.75, "result_ce": 2.5, "error_ce": 2.25, "eval_time": 10.0,
         "commit": "abc"},
        {"seed": 1, "rl_step": 5, "arm": "echo", "eval_n": 64, "eval_success": 0.625,
         "valid_call_rate": 0.875, "result_ce": 2.0, "error_ce": 1.5, "eval_time": 11.0,
         "commit": "def"},
    ]  # fmt: skip


def _tiny_lm(tok, *, seed: int = 0):
    import torch

    from echoloss.train.model import build_tiny_model

    torch.manual_seed(seed)
    return build_tiny_model(arch="llama", vocab_size=len(tok), hidden_size=48, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=96,
                            max_position_embeddings=4096, seed=seed)  # fmt: skip


@pytest.mark.parametrize("micro_batch_tokens", [16384, 2048])  # one batch; one per conversation
def test_heldout_ces_with_the_prompt_once_equal_the_full_logits_per_set(micro_batch_tokens):
    """The cheap held-out CE (shared prompt once, LM head on scored rows, one forward for the
    sets that pack the same conversations) equals the full-logits CE of every set in fp32."""
    from echoloss.train.probes import (
        _kind_batches,
        _shared_prefix,
        heldout_observation_ce,
        heldout_observation_ces,
    )

    env, tok = Calculator(), build_tokenizer()
    sets = _kind_batches(env, tok, count=6, micro_batch_tokens=micro_batch_tokens)
    every = [b for batches in sets.values() for b in batches]
    prefix = _shared_prefix(every)
    assert len(prefix) > 100  # the system prompt and worked examples: run once
    model = _tiny_lm(tok)
    fast = heldout_observation_ces(model, sets, pad_id=tok.pad_token_id)
    for name, batches in sets.items():
        full = heldout_observation_ce(model, batches, "sdpa")
        assert fast[name] == pytest.approx(full, rel=2e-6), name  # fp32 sums of ~1e3 terms
    assert model.training  # left as it was


def test_heldout_ces_without_a_shared_prompt_and_with_a_set_that_scores_nothing():
    """A conversation that shares no prefix with the others runs whole (prefix ``[]``); a set
    without a scored token is NaN, not 0."""
    import torch

    from echoloss.train.probes import _shared_prefix, heldout_observation_ce
    from echoloss.train.probes import heldout_observation_ces as ces

    tok = build_tokenizer()
    model = _tiny_lm(tok, seed=1)

    def sample(prompt: list[int], echo: bool) -> echoloss.Sample:
        body = [7, 8, 9, 10]
        return echoloss.Sample(prompt_ids=prompt, completion_ids=body,
                               completion_mask=[False] * 4, completion_logprobs=[0.0] * 4,
                               echo_weights=[None] * len(prompt) + [None, 1.0, 1.0, None] if echo else None,
                               advantage=0.0)  # fmt: skip

    prompts = [list(range(20, 60)), [*range(20, 58), 5, 6], list(range(90, 99))]
    scored = echoloss.pack([sample(p, True) for p in prompts], max_tokens=256)
    silent = echoloss.pack([sample(p, False) for p in prompts], max_tokens=256)
    assert _shared_prefix(scored) == []
    with torch.no_grad():
        got = ces(model, {"scored": scored, "silent": silent}, pad_id=tok.pad_token_id)
    assert got["scored"] == pytest.approx(heldout_observation_ce(model, scored, "sdpa"), rel=1e-6)
    assert math.isnan(got["silent"])


def test_evaluate_reports_the_same_heldout_ces_through_either_forward():
    """`evaluate` takes the cheap CEs under the shared-prefix update forward and the full
    logits under any other (FSDP, flash attention, a token export): the same numbers in fp32."""
    import torch

    from echoloss.train.probes import evaluate, heldout_set

    env, tok = Calculator(), build_tokenizer()
    cfg = parse_config({"env": {"name": "calculator"},
                        "data": {"heldout_size": 3, "max_tokens": 4096},
                        "train": {"eval_episodes": 0}})  # fmt: skip
    held = heldout_set(env, tok, torch.device("cpu"), data=cfg.data, micro_batch_tokens=4096)
    model = _tiny_lm(tok, seed=2)
    got = {
        forward: evaluate(model, tok, env, held, torch.device("cpu"), False, data=cfg.data,
                          train=cfg.train, attn_implementation="sdpa", forward=forward)
        for forward in ("shared_prefix", "logits")
    }  # fmt: skip
    assert {"heldout_error_ce", "heldout_result_ce", "heldout_obs_ce"} <= set(got["logits"])
    assert got["shared_prefix"] == pytest.approx(got["logits"], rel=2e-6)


def test_a_calculator_run_logs_both_heldout_ces_at_every_evaluation(tmp_path):
    """End to end on the tiny model (one process, sdpa: the update forward resolves to
    ``shared_prefix``): the trainer's evaluations at the start and after the RL step log finite
    result and error CEs."""
    from echoloss.train.recipe import train

    cfg = parse_config({
        "env": {"name": "calculator"},
        "data": {"prompts_per_step": 1, "group_size": 2, "max_new_tokens": 4,
                 "heldout_size": 2, "max_tokens": 4096},
        "warmup": {"steps": 0},
        "optim": {"micro_batch_tokens": 4096},
        "train": {"max_steps": 1, "eval_at_start": True, "eval_episodes": 1, "eval_samples": 0,
                  "output_dir": str(tmp_path / "run"), "plots": False, "progress": False},
    })  # fmt: skip
    train(cfg, resume=None, log=lambda line: None)
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["rl_step"] for e in evals] == [0, 1]
    for e in evals:
        assert 0 < e["heldout_result_ce"] < 50 and 0 < e["heldout_error_ce"] < 50, e


def _sync_in_process(script: str, results: str, run: str, seed: int, ready: Any) -> None:
    """One process adding one run's evaluations (what a ``--jobs`` worker does); ``ready`` is
    set just before it syncs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrained_learning", script)
    assert spec is not None and spec.loader is not None
    pl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pl)
    ready.set()
    pl.sync(Path(results), Path(run), seed, "grpo", "abc")


def test_a_parallel_run_waits_for_the_rows_lock_and_loses_no_row(tmp_path):
    """While one process holds ``<results>.lock``, another run's sync waits (no read-modify-write
    can interleave); released, it adds its rows beside the ones already there."""
    import importlib.util
    import multiprocessing

    from _train_helpers import REPO

    script = REPO / "scripts" / "pretrained_learning.py"
    spec = importlib.util.spec_from_file_location("pretrained_learning", script)
    assert spec is not None and spec.loader is not None
    pl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pl)
    results = tmp_path / "results.json"
    for seed in (0, 1):
        run = tmp_path / f"run{seed}"
        run.mkdir()
        evals = [{"rl_step": k, "eval_n": 64.0, "eval_success_greedy": 0.5} for k in (0, 5)]
        (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    other = ctx.Process(
        target=_sync_in_process,
        args=(str(script), str(results), str(tmp_path / "run1"), 1, ready),
    )
    with pl.locked(results):
        other.start()
        assert ready.wait(timeout=120)  # the other process is at its sync
        other.join(timeout=2)  # a sync without the lock takes milliseconds
        assert other.is_alive() and not results.exists()  # it waits for the lock
        rows = pl.read_rows(results)
        pl.write_rows(results, rows + pl.eval_rows(tmp_path / "run0", 0, "grpo", "abc"))
    other.join(timeout=60)
    assert other.exitcode == 0
    rows = json.loads(results.read_text())
    assert sorted((r["seed"], r["rl_step"]) for r in rows) == [(0, 0), (0, 5), (1, 0), (1, 5)]
