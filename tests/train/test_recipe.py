"""The reference trainer end to end on the fast config (CPU, seconds per run)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _train_helpers import fast_config

from echoloss.train import checkpoint as ckpt
from echoloss.train.cli import main
from echoloss.train.model import build_tiny_model, build_tokenizer
from echoloss.train.plots import read_metrics
from echoloss.train.recipe import train

KEYS = {
    "step",
    "phase",
    "rl_step",
    "echo_alpha",
    "invalid_reply_rate",
    "imagined_obs_rate",
    "obs_ce_floor",
    "hidden_ce_floor",
    "eval_success_greedy",
    "reward",
    "reward_std",
    "advantage_mean",
    "advantage_abs",
    "loss",
    "loss_rl",
    "loss_echo",
    "echo_nll",
    "heldout_obs_ce",
    "heldout_hidden_ce",
    "rl_tokens",
    "echo_tokens",
    "tokens",
    "entropy",
    "mismatch_kl",
    "grad_norm",
    "step_time",
    "tokens_per_s",
    "env/mirrorgrid/reward",
    "env/mirrorgrid/turns",
    "env/mirrorgrid/walls",
    "env/mirrorgrid/invalid",
    "env/mirrorgrid/imagined",
    "loss/echo_nll_mean/mirrorgrid",
}
# Metrics of the RL phase only: a warm-up row leaves them out (it is SFT: no policy gradient).
RL_ONLY = {"loss_rl", "entropy", "mismatch_kl", "reward", "loss_echo", "echo_nll", "echo_alpha"}
COMPARED = (
    "loss",
    "loss_rl",
    "loss_echo",
    "echo_nll",
    "reward",
    "grad_norm",
    "entropy",
    "heldout_obs_ce",
)


def _initial_state(cfg) -> dict[str, torch.Tensor]:
    m = cfg.model
    tok = build_tokenizer()
    model = build_tiny_model(
        arch=m.arch,
        vocab_size=len(tok),
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings,
        seed=cfg.train.seed,
    )
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_two_step_run_trains_every_parameter_and_writes_everything(tmp_path):
    cfg = fast_config(
        tmp_path / "run", **{"train.export_tokens": True, "train.save_rollouts": True}
    )
    out = train(cfg, log=lambda _: None)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["phase"] for r in rows] == ["warmup", "rl"]
    rl = rows[-1]
    assert set(rl) >= KEYS, KEYS - set(rl)
    warm = rows[0]
    assert {"loss_sft", "loss_obs", "obs_nll", "warmup_step"} <= set(warm)
    assert not RL_ONLY & set(warm), RL_ONLY & set(warm)
    assert not [k for k in warm if k.startswith("loss/") and "echo" in k]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    assert rl["echo_tokens"] > 0 and rl["loss_echo"] > 0 and rl["rl_tokens"] > 0
    # Every trained parameter changed (weight decay is 0 in the fast config, so a parameter only
    # changes through its gradient).
    before = _initial_state(cfg)
    after = torch.load(out / "checkpoints" / "step_000002" / "model.pt", weights_only=True)
    assert set(before) <= set(after)
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged
    for name in ("success.png", "observation_ce.png", "replies.png", "training.png"):
        assert (out / "plots" / name).stat().st_size > 10_000
    assert (out / "final-model" / "config.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    # The token export and the saved rollouts are valid, readable files.
    [export] = list((out / "token_exports").glob("step_2/rank_0.jsonl"))
    rec = json.loads(export.read_text().splitlines()[0])
    assert {"token_ids", "rl_mask", "echo_weights", "trainer_logprobs"} <= set(rec)
    from echoloss.io import read_rollouts

    records = read_rollouts(out / "rollouts.rank0.jsonl")
    assert len(records) == cfg.data.prompts_per_step * cfg.data.group_size
    # The final weights load as a model directory for the next run.
    again = fast_config(
        tmp_path / "again",
        **{"model.path": str(out / "final-model"), "warmup.steps": 0, "train.max_steps": 1},
    )
    rows2 = read_metrics(train(again, log=lambda _: None) / "metrics.jsonl")
    assert rows2[0]["phase"] == "rl"


def test_resume_gives_exactly_the_same_losses(tmp_path):
    # Warm-up step 1, RL steps 2-5; the interrupted run stops after step 3 and resumes.
    over = {"train.max_steps": 4, "train.checkpoint_every": 3, "train.plots": False}
    straight = train(fast_config(tmp_path / "a", **over), log=lambda _: None)
    half = train(fast_config(tmp_path / "b", **{**over, "train.max_steps": 2}), log=lambda _: None)
    resumed = train(fast_config(tmp_path / "b", **over), resume=half, log=lambda _: None)
    a = read_metrics(straight / "metrics.jsonl")
    b = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra.get(key) == rb.get(key), (ra["step"], key, ra.get(key), rb.get(key))
    assert any(r["loss_rl"] != 0 for r in a[1:]) or any(r["loss_echo"] != 0 for r in a[1:])
    wa = torch.load(straight / "checkpoints" / "step_000005" / "model.pt", weights_only=True)
    wb = torch.load(resumed / "checkpoints" / "step_000005" / "model.pt", weights_only=True)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["--config", str(fast_config(out).train.output_dir) + "/none.toml"]) == 2
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text("")
    assert main(["--config", str(cfg_path), "--output-dir", str(out), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_crash_while_checkpointing_keeps_the_previous_latest(tmp_path):
    root = tmp_path / "checkpoints"

    def good(d: Path) -> None:
        (d / "state.json").write_text('{"step": 1}')

    ckpt.save_checkpoint(root, 1, good, keep=2)

    def crash(d: Path) -> None:
        (d / "state.json").write_text('{"step": 2, "half')
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(root, 2, crash, keep=2)
    assert ckpt.latest_checkpoint(root) == root / "step_000001"
    assert not (root / "step_000002").exists()
    assert not list(root.glob(".tmp-*"))
    ckpt.save_checkpoint(root, 3, good, keep=1)
    assert ckpt.latest_checkpoint(root) == root / "step_000003"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000003"]


def _rollout_lines(tmp_path: Path) -> list[str]:
    """Token-form rollouts written by a generation run (real logprobs and attribution)."""
    cfg = fast_config(tmp_path / "gen", **{"train.save_rollouts": True, "train.plots": False})
    out = train(cfg, log=lambda _: None)
    return (out / "rollouts.rank0.jsonl").read_text().splitlines()


def test_jsonl_source_trains_and_bad_lines_are_named(tmp_path, capsys):
    lines = _rollout_lines(tmp_path)
    good = tmp_path / "good.jsonl"
    recs = [json.loads(x) for x in lines]
    for i, r in enumerate(recs):
        r["reward"] = float(i % 2)  # mixed rewards: non-zero advantages
    good.write_text("".join(json.dumps(r) + "\n" for r in recs))
    over = {"data.source": "jsonl", "data.path": str(good), "warmup.steps": 0, "train.max_steps": 1}
    rows = read_metrics(
        train(fast_config(tmp_path / "j", **over), log=lambda _: None) / "metrics.jsonl"
    )
    assert rows[0]["loss_rl"] != 0 and rows[0]["advantage_abs"] > 0

    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2] + "\n" + lines[2] + "\n")
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'[data]\nsource = "jsonl"\npath = "{bad}"\n[warmup]\nsteps = 0\n')
    out = tmp_path / "never"
    assert main(["--config", str(cfg), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "1 bad rollout record" in err and "line 2: invalid JSON" in err, err
    assert not out.exists()  # nothing half-written


def test_rl_steps_are_counted_after_the_warm_up_and_evaluated_on_held_out_tasks(tmp_path):
    lines: list[str] = []
    over = {
        "warmup.steps": 3,
        "train.max_steps": 2,
        "train.plots": False,
        "train.eval_every": 2,
        "echo.alpha": 0.2,
        "echo.schedule": "warmup",
        "echo.schedule_steps": 2,
    }
    out = train(fast_config(tmp_path / "run", **over), log=lines.append)
    rows = read_metrics(out / "metrics.jsonl")
    # 3 warm-up steps, then exactly train.max_steps = 2 RL steps.
    assert [r["phase"] for r in rows] == ["warmup"] * 3 + ["rl"] * 2
    assert [r.get("rl_step") for r in rows] == [None, None, None, 1, 2]
    # The λ schedule: a linear ramp over 2 RL steps.
    assert [r["echo_alpha"] for r in rows[3:]] == [0.1, 0.2]
    # The banner says what runs, before the first step.
    banner = lines[0]
    for text in ("device cpu", "env    mirrorgrid 2x2", "3 warm-up", "2 RL", "λ = 0.2 (warmup",
                 str(tmp_path / "run"), "resume no"):  # fmt: skip
        assert text in banner, (text, banner)
    assert lines[1].startswith("step    1/5 warmup")
    # Held-out evaluations: at the RL start (full: greedy + sampled) and at the end.
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["rl_step"] for e in evals] == [0, 2]
    env_tasks = 3 * 4  # mirrorgrid 2x2: 3 held-out pairs x 4 mirrorings
    for e in evals:
        assert e["eval_episodes"] == env_tasks * 2  # one greedy + eval_samples = 1 sampled
        assert 0 <= e["eval_success_greedy"] <= 1 and 0 <= e["eval_imagined_rate"] <= 1
        assert e["obs_ce_floor"] > 0 and e["heldout_obs_ce"] > 0
        assert e["hidden_ce_floor"] > e["obs_ce_floor"] and e["heldout_hidden_ce"] > 0


def test_max_steps_zero_is_a_warm_up_only_run_and_says_so(tmp_path):
    lines: list[str] = []
    out = train(
        fast_config(
            tmp_path / "w", **{"train.max_steps": 0, "warmup.steps": 2, "train.plots": False}
        ),
        log=lines.append,
    )
    assert "train.max_steps = 0: warm-up only, no RL step" in lines[0]
    assert [r["phase"] for r in read_metrics(out / "metrics.jsonl")] == ["warmup"] * 2
    assert (out / "final-model" / "config.json").is_file()
    from echoloss.train.config import ConfigError

    nothing = {"train.max_steps": 0, "warmup.steps": 0, "train.eval_at_start": False}
    with pytest.raises(ConfigError, match="nothing to train"):
        fast_config(tmp_path / "x", **nothing)
    with pytest.raises(ConfigError, match="nothing to train"):  # nothing to evaluate either
        fast_config(tmp_path / "w", **{"train.max_steps": 0, "warmup.steps": 0})
    # an evaluation-only run: a given model, evaluated at its start, nothing trained
    only = fast_config(tmp_path / "y", **{"train.max_steps": 0, "warmup.steps": 0,
                                          "model.path": str(out / "final-model")})  # fmt: skip
    assert only.train.eval_at_start
    with pytest.raises(ConfigError, match="nothing to train"):
        fast_config(tmp_path / "z", **{**nothing, "model.path": str(out / "final-model")})


def test_env_options_reach_the_environment_and_the_warm_up_uses_warmup_tasks(tmp_path, monkeypatch):
    # The [env] options are handed to the environment, and warm-up demonstrations come from
    # warmup_task (its own mirroring probability), RL rollouts from task.
    import echoloss.train.recipe as recipe

    seen: dict[str, list] = {"warmup": [], "task": []}
    real_make_env = recipe.make_env

    def spy_make_env(name, **kw):
        env = real_make_env(name, **kw)
        seen["env"] = env

        class Spy(type(env)):  # type: ignore[misc]
            def warmup_task(self, *, seed, index):
                seen["warmup"].append(index)
                return super().warmup_task(seed=seed, index=index)

            def task(self, *, seed, index):
                seen["task"].append(index)
                return super().task(seed=seed, index=index)

        return Spy(**{f: getattr(env, f) for f in env.__dataclass_fields__})

    monkeypatch.setattr(recipe, "make_env", spy_make_env)
    cfg = fast_config(tmp_path / "run", **{"env.warmup_flip_prob": 1.0, "env.demo_explore": 0.3,
                                          "train.plots": False})  # fmt: skip
    train(cfg, log=lambda _: None)
    env = seen["env"]
    assert (env.warmup_flip_prob, env.demo_explore) == (1.0, 0.3)
    assert seen["warmup"] and all(i < 1_000_000 for i in seen["warmup"])
    assert seen["task"] and all(i >= 1_000_000_007 for i in seen["task"])


def test_copy_task_runs_once_before_the_warm_up_and_not_on_resume(tmp_path):
    # warmup.copy_steps: logged in the banner and per 100 steps, changes the model the warm-up
    # starts from, and a resumed run (whose weights come from the checkpoint) does not redo it.
    over = {"train.max_steps": 1, "train.checkpoint_every": 1, "train.plots": False}
    lines: list[str] = []
    plain = train(fast_config(tmp_path / "plain", **over), log=lambda _: None)
    copied = train(fast_config(tmp_path / "copy", **over, **{"warmup.copy_steps": 3}),
                   log=lines.append)  # fmt: skip
    assert any("3 copy-task + " in x for x in lines) and any(
        "copy task     3/3" in x for x in lines
    )
    a, b = read_metrics(plain / "metrics.jsonl"), read_metrics(copied / "metrics.jsonl")
    assert a[0]["loss_sft"] != b[0]["loss_sft"]  # the warm-up started from another model
    resumed_lines: list[str] = []
    more = {**over, "train.max_steps": 2, "warmup.copy_steps": 3}
    with pytest.warns(ckpt.ResumeWarning, match="max_steps"):
        train(fast_config(tmp_path / "copy", **more), resume=copied, log=resumed_lines.append)
    assert not any("copy task" in x or "copy-task" in x for x in resumed_lines)
    loaded_lines: list[str] = []
    loaded = {"model.path": str(copied / "final-model"), "warmup.steps": 0, "train.max_steps": 1,
              "warmup.copy_steps": 3, "train.plots": False}  # fmt: skip
    with pytest.warns(UserWarning, match="copy_steps = 3 is not run: model.path"):
        train(fast_config(tmp_path / "loaded", **loaded), log=loaded_lines.append)
    assert not any("copy task" in x or "copy-task" in x for x in loaded_lines)


def test_copy_task_teaches_copying():
    """`copy_task_warmup` lowers the CE of the repeated half well below log V (what a model that
    cannot copy gets) on a tiny model in a few dozen steps."""
    from echoloss.train.recipe import copy_task_warmup

    m = build_tiny_model(arch="qwen3", vocab_size=20, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, intermediate_size=64, max_position_embeddings=64, seed=0)  # fmt: skip
    first = copy_task_warmup(m, vocab_size=20, steps=1, lr=1e-2, seed=0, device="cpu", half=8)
    last = copy_task_warmup(m, vocab_size=20, steps=150, lr=1e-2, seed=1, device="cpu", half=8)
    assert first > 0.8 * math.log(20) and last < 0.5 * math.log(20), (first, last)


def test_a_run_without_any_rl_signal_is_warned_once(tmp_path, monkeypatch):
    # A collapsed policy (every rollout scored the same) gets exactly zero RL gradient: after
    # NO_SIGNAL_STEPS such RL steps in a row the trainer says so, once per streak.
    import warnings

    import echoloss.train.recipe as recipe

    real_make_env = recipe.make_env

    def zero_reward_env(name, **kw):
        env = real_make_env(name, **kw)

        class NoReward(type(env)):  # type: ignore[misc]
            def act(self, episode, text):
                obs = super().act(episode, text)
                episode.reward = 0.0
                return obs

        return NoReward(**{f: getattr(env, f) for f in env.__dataclass_fields__})

    monkeypatch.setattr(recipe, "make_env", zero_reward_env)
    n = recipe.NO_SIGNAL_STEPS
    cfg = fast_config(tmp_path / "run", **{"train.max_steps": n + 1, "warmup.steps": 1,
                                          "train.plots": False, "train.eval_every": 1000})  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train(cfg, log=lambda _: None)
    said = [str(w.message) for w in caught if "identical rewards" in str(w.message)]
    assert (
        len(said) == 1 and said[0].startswith(f"RL steps 1-{n}: ") and "data.group_size" in said[0]
    )
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "rl"]
    assert len(rows) == n + 1 and all(r["advantage_abs"] == 0 for r in rows)
