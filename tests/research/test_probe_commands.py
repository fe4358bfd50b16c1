"""The experiments' probe commands (``run.py world-model-probe``, ``run.py heldout-ce``) and
the committed probe rows of docs/experiment.md."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _probe_rows(*args: str) -> list[dict]:
    """examples/research/echo_experiment/run.py world-model-probe on a 16-wide, 1-layer model with batches of 4: its JSON rows."""
    import json

    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "research" / "echo_experiment" / "run.py"), "world-model-probe", "--hidden-size", "16",
         "--layers", "1", "--batch", "4", *args],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    return [json.loads(x) for x in out.stdout.splitlines()]


def test_world_model_probe_runs_and_reports_against_the_floor():
    """examples/research/echo_experiment/run.py world-model-probe (docs/experiment.md): a two-step run prints JSON rows with
    the held-out CE of the hidden-dependent tokens, above their exact floor."""
    rows = _probe_rows("--steps", "2", "--eval-every", "1")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["heldout_ce"] > r["floor"] > 0 for r in rows)
    assert rows[0]["log3"] == round(math.log(3), 4)


def test_world_model_probe_can_pretrain_induction_first():
    """--pretrain-induction-steps: copy-task rows first (loss on the repeat), then the probe."""
    rows = _probe_rows("--steps", "1", "--eval-every", "2", "--pretrain-induction-steps", "3")
    assert [r.get("pretrain_step") for r in rows[:2]] == [2, 3]
    assert all(r["copy_ce"] > 0 for r in rows[:2])
    assert [r["step"] for r in rows[2:]] == [0] and rows[2]["pretrain_induction_steps"] == 3


def test_world_model_probe_shown_variant_has_floor_zero():
    """--env mirrorgrid-shown prints the mirroring: nothing is hidden, the floor is 0."""
    rows = _probe_rows("--steps", "1", "--eval-every", "1", "--env", "mirrorgrid-shown")
    assert [r["env"] for r in rows] == ["mirrorgrid-shown"] * 2
    assert all(r["floor"] == 0.0 and r["heldout_ce"] > 0 for r in rows)


def test_world_model_probe_saves_a_model_that_a_later_probe_and_the_trainer_load(tmp_path):
    """--target observations supervises every observation-body token (more tokens than the
    direction words, so another training CE); --save writes a Hugging Face directory that
    --init (and the trainer's model.path) loads: the next run starts from those weights, not
    from a fresh model of its seed."""
    pytest.importorskip("transformers")
    import torch

    from echoloss.train.model import load_model

    saved = tmp_path / "wm"
    hidden = _probe_rows("--steps", "1", "--eval-every", "1")
    rows = _probe_rows("--steps", "1", "--eval-every", "1", "--target", "observations",
                       "--save", str(saved))  # fmt: skip
    assert [r["target"] for r in rows] == ["observations"] * 2
    assert rows[0]["train_ce"] != hidden[0]["train_ce"]  # same seed, other tokens supervised
    model, tok = load_model(saved, dtype=torch.float32, attn_implementation="sdpa")
    assert model.config.hidden_size == 16 and tok.chat_template
    again = _probe_rows("--steps", "1", "--eval-every", "1", "--init", str(saved))
    assert again[0]["init"] == str(saved) and again[0]["hidden_size"] == 16
    assert again[0]["heldout_ce"] != hidden[0]["heldout_ce"]  # not a fresh model of that seed


def test_heldout_ce_sets_scores_a_saved_model_as_the_probe_does(tmp_path):
    """examples/research/echo_experiment/run.py heldout-ce: for a saved model, the random-walk set's CE is the probe's
    own held-out CE of that model (the same 64 conversations, the same tokens), and both sets
    carry their exact floors (log 2 per first move along an axis, over the direction words)."""
    import json

    saved = tmp_path / "wm"
    probe = _probe_rows("--steps", "1", "--eval-every", "1", "--save", str(saved))
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "research" / "echo_experiment" / "run.py"), "heldout-ce", str(saved)],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    rows = {r["set"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert set(rows) == {"random-walks", "demonstrations"}
    walks, demos = rows["random-walks"], rows["demonstrations"]
    assert walks["ce"] == pytest.approx(probe[-1]["heldout_ce"], abs=2e-4)  # both rounded to 4
    assert walks["floor"] == probe[-1]["floor"] == 0.1941
    # Bayes-optimal demonstrations take fewer moves after the first along each axis: a larger
    # share of coin-flip words, so a higher floor per word.
    assert demos["floor"] == 0.2872 and demos["tokens"] < walks["tokens"]


def test_committed_probe_rows_are_consistent():
    """docs/experiment/world_model_probe_*.jsonl (the probe tables of docs/experiment.md): steps
    increase from 0, every held-out CE is above its environment's exact floor."""
    import json

    files = sorted((ROOT / "docs" / "experiment").glob("world_model_probe_*.jsonl"))
    assert len(files) >= 8
    for path in files:
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        pretrain = [r for r in lines if "pretrain_step" in r]  # the induction warm-up's rows
        assert bool(pretrain) == ("induction" in path.name), path.name
        assert all(0 <= r["copy_ce"] < 5 for r in pretrain), path.name
        rows = [r for r in lines if "step" in r]
        steps = [r["step"] for r in rows]
        assert steps[0] == 0 and steps == sorted(set(steps)), path.name
        shown = rows[0].get("env") == "mirrorgrid-shown"
        assert shown == ("shown" in path.name), path.name
        floor = 0.0 if shown else 0.1941
        assert all(r["floor"] == floor and r["heldout_ce"] > floor for r in rows), path.name
