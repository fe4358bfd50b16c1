"""``scripts/python.sh``: which Python the README's two commands install into and run with.

``$PYTHON`` first, then the active virtual environment, then the project ``.venv`` (created on
first use, from a Python ≥ 3.10, announced on stderr)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _select(env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Source scripts/python.sh in a clean environment; print the chosen interpreter."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        ["bash", "-c", f'source "{ROOT}/scripts/python.sh" && echo "PY=$PY"'],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _chosen(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1].removeprefix("PY=")


def test_python_variable_wins():
    res = _select({"PYTHON": sys.executable, "VIRTUAL_ENV": "/nonexistent"})
    assert _chosen(res) == sys.executable
    assert "using $PYTHON" in res.stderr


def test_active_virtual_environment_is_used(tmp_path):
    venv = tmp_path / "active"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    res = _select({"VIRTUAL_ENV": str(venv)})
    assert _chosen(res) == f"{venv}/bin/python"
    assert f"using the active virtual environment {venv}" in res.stderr


def _old_python(tmp_path: Path) -> Path:
    """A stand-in for a Python < 3.10: fails the version check the scripts run."""
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    return fake


def test_unsupported_python_is_refused(tmp_path):
    res = _select({"PYTHON": str(_old_python(tmp_path))})
    assert res.returncode != 0
    assert "echoloss needs 3.10 or newer" in res.stderr


def test_unsupported_base_python_is_refused_not_replaced(tmp_path):
    env = {
        "ECHOLOSS_VENV": str(tmp_path / "venv"),
        "ECHOLOSS_BASE_PYTHON": str(_old_python(tmp_path)),
    }
    res = _select(env)
    assert res.returncode != 0
    assert "is not a Python >= 3.10" in res.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.slow
@pytest.mark.parametrize("ensurepip", [True, False], ids=["venv", "without-ensurepip"])
def test_project_venv_is_created_announced_and_reused(tmp_path, ensurepip):
    """Outside any environment: a project venv from the base Python, with a working pip, also
    when ``ensurepip`` is unavailable (Debian without python3-venv); the second call reuses it."""
    env = {"ECHOLOSS_VENV": str(tmp_path / "venv"), "ECHOLOSS_BASE_PYTHON": sys.executable}
    if not ensurepip:
        env["ECHOLOSS_VENV_NO_ENSUREPIP"] = "1"
    first = _select(env)
    py = _chosen(first)
    assert py == f"{tmp_path}/venv/bin/python"
    assert "creating the project environment" in first.stderr
    assert ("bootstrapping pip" in first.stderr) is (not ensurepip)
    pip = subprocess.run([py, "-m", "pip", "--version"], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    second = _select(env)
    assert _chosen(second) == py and "creating" not in second.stderr


def _probe_rows(*args: str) -> list[dict]:
    """scripts/world_model_probe.py on a 16-wide, 1-layer model with batches of 4: its JSON rows."""
    import json

    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "world_model_probe.py"), "--hidden-size", "16",
         "--layers", "1", "--batch", "4", *args],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    return [json.loads(x) for x in out.stdout.splitlines()]


def test_world_model_probe_runs_and_reports_against_the_floor():
    """scripts/world_model_probe.py (docs/experiment.md): a two-step run prints JSON rows with
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
    """scripts/heldout_ce_sets.py: for a saved model, the random-walk set's CE is the probe's
    own held-out CE of that model (the same 64 conversations, the same tokens), and both sets
    carry their exact floors (log 2 per first move along an axis, over the direction words)."""
    import json

    saved = tmp_path / "wm"
    probe = _probe_rows("--steps", "1", "--eval-every", "1", "--save", str(saved))
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "heldout_ce_sets.py"), str(saved)],
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
