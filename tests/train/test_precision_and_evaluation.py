"""fp32 master weights under bf16, a shortened or skipped evaluation, and the warning about a
pretrained model trained at the tiny model's learning rates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _train_helpers import FAST, REPO, fast_config
from safetensors.torch import load_file

from echoloss.train import config as config_module
from echoloss.train import probes, runtime
from echoloss.train.config import (
    ConfigWarning,
    load_config,
    parse_config,
    pretrained_rates_problem,
)
from echoloss.train.model import build_tiny_model, build_tokenizer, packed_logits
from echoloss.train.recipe import train
from echoloss.train.runtime import autocast, compute_dtype

ONE_UPDATE = {
    "warmup.steps": 0,
    "train.max_steps": 1,
    "optim.lr": 1e-6,  # configs/gpu.toml's RL rate
    "train.plots": False,
    "train.eval_at_start": False,
    "train.eval_episodes": 0,
    "data.heldout_size": 0,
}


def _initial(cfg) -> dict[str, torch.Tensor]:
    m = cfg.model
    model = build_tiny_model(
        arch=m.arch,
        vocab_size=len(build_tokenizer()),
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings,
        seed=cfg.train.seed,
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The fraction of parameter elements that differ (tied weights counted once)."""
    keys = [k for k in before if k in after]
    n = sum(before[k].numel() for k in keys)
    return sum(int((before[k] != after[k]).sum()) for k in keys) / n


def test_a_small_update_moves_fp32_master_weights_under_bf16(tmp_path):
    """One RL step at lr 1e-6 with model.dtype = bfloat16 changes as many weights as the same
    step in fp32: the parameters are fp32 (only the forward runs in bf16). The same update
    applied to bf16 parameters, as the trainer used to, would change almost none."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = fast_config(tmp_path / dtype, **{**ONE_UPDATE, "model.dtype": dtype})
        out = train(cfg, log=lambda _: None)
        runs[dtype] = load_file(str(out / "final-model" / "model.safetensors"))
    before = _initial(cfg)
    assert all(v.dtype == torch.float32 for v in runs["bfloat16"].values())
    fp32, bf16 = _changed(before, runs["float32"]), _changed(before, runs["bfloat16"])
    assert fp32 > 0.3, fp32  # every element with a gradient moves (unused token rows do not)
    assert bf16 >= 0.95 * fp32, (bf16, fp32)
    # The same deltas on bf16 parameters round away: |Δ| ~ 1e-6 < half a bf16 ulp of |w| ~ 0.02.
    on_bf16 = {
        k: (before[k].bfloat16().float() + (runs["bfloat16"][k] - before[k])).bfloat16()
        for k in before
        if k in runs["bfloat16"]
    }
    lost = _changed({k: before[k].bfloat16() for k in on_bf16}, on_bf16)
    assert lost < 0.05 * bf16, (lost, bf16)


def test_the_forward_computes_in_bf16_with_fp32_parameters():
    cfg = parse_config({"model": {"dtype": "bfloat16", "hidden_size": 16, "num_heads": 2,
                                  "num_kv_heads": 1, "intermediate_size": 32}})  # fmt: skip
    tok = build_tokenizer()
    m = cfg.model
    model = build_tiny_model(
        arch=m.arch, vocab_size=len(tok), hidden_size=m.hidden_size, num_layers=1,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size,
        max_position_embeddings=64, seed=0,
    )  # fmt: skip
    import echoloss

    s = echoloss.Sample(prompt_ids=[5, 6], completion_ids=[7, 8], completion_mask=[True, True],
                        completion_logprobs=[-0.1, -0.2], advantage=1.0)  # fmt: skip
    batch = echoloss.pack([s, s], max_tokens=16)[0]
    with autocast(compute_dtype(cfg.model.dtype, torch.device("cpu")), torch.device("cpu")):
        logits = packed_logits(model, batch, attn_implementation="sdpa")
    assert logits.dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32
    fp32 = packed_logits(model, batch, attn_implementation="sdpa")
    assert fp32.dtype == torch.float32
    # the same model, computed in bf16: close to fp32 at bf16's resolution, not equal
    assert torch.allclose(logits.float(), fp32, atol=0.05) and not torch.equal(logits.float(), fp32)


def test_eval_episodes_zero_plays_no_episode(tmp_path, monkeypatch):
    """--max-steps 0 with train.eval_samples = 0 and train.eval_episodes = 0: the closing
    evaluation plays nothing (the held-out observation CE is still measured)."""

    def refuse(*args, **kwargs):
        raise AssertionError("an evaluation episode was played")

    monkeypatch.setattr(probes, "evaluate_policy", refuse)
    over = {"train.max_steps": 0, "train.eval_samples": 0, "train.eval_episodes": 0,
            "train.plots": False}  # fmt: skip
    out = train(fast_config(tmp_path / "w", **over), log=lambda _: None)
    rows = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert rows and all("eval_success_greedy" not in r and "heldout_obs_ce" in r for r in rows)


def test_eval_episodes_shortens_every_evaluation(tmp_path):
    over = {"train.eval_episodes": 3, "train.eval_samples": 1, "train.plots": False}
    out = train(fast_config(tmp_path / "s", **over), log=lambda _: None)
    rows = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    # greedy only between the ends; at the RL start and end one greedy + one sampled per task
    assert [r["eval_episodes"] for r in rows] == [6.0, 6.0], rows


def test_eval_episodes_beyond_the_set_warns(tmp_path):
    over = {**ONE_UPDATE, "train.eval_episodes": 50}
    with pytest.warns(ConfigWarning, match="train.eval_episodes = 50 but env mirrorgrid has 12"):
        train(fast_config(tmp_path / "x", **over), log=lambda _: None)


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_pretrained_rates_problem_names_each_rate_and_the_fix(tmp_path):
    path = str(_model_dir(tmp_path))
    # The embedded default (warmup.lr 1e-2, optim.lr 1e-3) with model.path on the command line.
    tiny_rates = load_config(None, {"model.path": path})
    problem = pretrained_rates_problem(tiny_rates, 135_000_000)
    assert problem is not None
    assert "warmup.lr = 0.01 and optim.lr = 0.001" in problem and "135M parameters" in problem
    assert "--set warmup.lr=1e-5 --set optim.lr=1e-6" in problem
    assert pretrained_rates_problem(tiny_rates, 100_000) is None  # a model trained here
    # The schema defaults count as the tiny model's too (warmup.lr 3e-3).
    schema = parse_config({"model": {"path": path}})
    assert "warmup.lr = 0.003 and optim.lr" in (pretrained_rates_problem(schema, 10**8) or "")
    survivable = load_config(None, {"model.path": path, "warmup.lr": 1e-5, "optim.lr": 1e-6})
    assert pretrained_rates_problem(survivable, 135_000_000) is None
    no_warmup = load_config(None, {"model.path": path, "warmup.steps": 0, "optim.lr": 1e-6})
    assert no_warmup.warmup.lr == 1e-2  # the embedded default's, never used
    assert pretrained_rates_problem(no_warmup, 135_000_000) is None  # the warm-up never runs
    assert pretrained_rates_problem(parse_config({}), 135_000_000) is None  # no model.path


def test_rates_chosen_for_the_model_are_not_the_tiny_models(tmp_path):
    """A rate set on the command line, or in the file or table that sets model.path, was chosen
    for that model; only rates from the defaults or from a tiny-model file are warned about."""
    path = str(_model_dir(tmp_path))
    in_one_table = parse_config({"model": {"path": path}, "warmup": {"lr": 3e-3},
                                 "optim": {"lr": 1e-3}})  # fmt: skip
    assert pretrained_rates_problem(in_one_table, 135_000_000) is None
    on_the_command_line = load_config(None, {"model.path": path, "optim.lr": 1e-3})
    problem = pretrained_rates_problem(on_the_command_line, 135_000_000)  # warmup.lr: default's
    assert problem is not None and "warmup.lr = 0.01 are learning rates" in problem
    fast = load_config(FAST, {"model.path": path})  # a tiny-model file; the path added
    assert "optim.lr = 0.01 are" in (pretrained_rates_problem(fast, 135_000_000) or "")
    gpu = load_config(REPO / "configs" / "gpu.toml", {"model.path": path})
    assert gpu.warmup.lr == 3e-3 and gpu.optim.lr == 1e-6
    assert pretrained_rates_problem(gpu, 600_000_000) is None
    for name in ("pretrained", "gpu-pretrained"):
        shipped = load_config(REPO / "configs" / f"{name}.toml")
        assert pretrained_rates_problem(shipped, 10**8) is None


def test_a_pretrained_model_at_tiny_rates_warns_once(tmp_path, monkeypatch):
    first = train(fast_config(tmp_path / "a", **ONE_UPDATE), log=lambda _: None)
    # the exported tiny model stands in for a pretrained one: lower the size threshold
    monkeypatch.setattr(config_module, "PRETRAINED_PARAMETERS", 1000)
    # configs/fast.toml's RL rate (1e-2, written for the tiny model), model.path added
    over = {k: v for k, v in ONE_UPDATE.items() if k != "optim.lr"}
    over["model.path"] = str(first / "final-model")
    with pytest.warns(ConfigWarning, match="optim.lr = 0.01 are learning rates") as seen:
        train(fast_config(tmp_path / "b", **over), log=lambda _: None)
    assert len([w for w in seen if "learning rates" in str(w.message)]) == 1


@pytest.mark.parametrize("native", [True, False])
def test_fastest_is_bf16_only_where_the_cpu_computes_it_natively(monkeypatch, native):
    """``fastest`` on CPU follows the CPU's bf16 instructions (emulated bf16 is ~24x slower than
    fp32); on a GPU it is bf16; ``auto`` stays fp32 on every CPU."""
    monkeypatch.setattr(runtime, "cpu_computes_bf16_natively", lambda: native)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    fastest = parse_config({"model": {"dtype": "fastest"}}).model.dtype
    assert compute_dtype(fastest, cpu) == (torch.bfloat16 if native else torch.float32)
    assert compute_dtype(fastest, cuda) == torch.bfloat16
    assert compute_dtype(parse_config({}).model.dtype, cpu) == torch.float32
    assert load_config(REPO / "configs" / "pretrained.toml").model.dtype == "fastest"
