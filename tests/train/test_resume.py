"""Resume is idempotent: a run killed anywhere and resumed ends with the uninterrupted run's model
bytes and output files; corrupt checkpoints are skipped; changes and failures are reported."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _train_helpers import FAST, REPO, fast_config

from echoloss.train import checkpoint as ckpt
from echoloss.train import recipe
from echoloss.train.cli import main
from echoloss.train.recipe import train

# Every output a resumed run must reproduce; checkpoints every step so any kill point has one
# behind it, two RL steps after the warm-up step.
OVER: dict[str, Any] = {
    "train.checkpoint_every": 1,
    "train.export_tokens": True,
    "train.save_rollouts": True,
    "train.plots": False,
    "train.max_steps": 3,
}


class Killed(Exception):
    """Stands for a SIGKILL at an exact point (the process dies; nothing after it runs)."""


def _quiet(_: str) -> None:
    pass


def _timing_free(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row without wall-clock measurements (the only values allowed to differ)."""
    return {k: v for k, v in row.items() if "time" not in k and not k.endswith("per_s")}


def snapshot(out: Path) -> dict[str, Any]:
    """What a run leaves behind and must not depend on interruptions: the final model's bytes,
    the metrics and evaluation rows (timings aside), the rollout file and every token export,
    byte for byte."""
    rows = {
        name: [_timing_free(json.loads(x)) for x in (out / name).read_text().splitlines()]
        for name in ("metrics.jsonl", "eval.jsonl")
        if (out / name).is_file()
    }
    files = {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*.jsonl"))
        if p.name not in rows
    }
    return {
        "model": (out / "final-model" / "model.safetensors").read_bytes(),
        "metrics": rows["metrics.jsonl"],
        "rows": rows,
        "files": files,
    }


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run every interrupted one is compared with."""
    out = tmp_path_factory.mktemp("straight")
    train(fast_config(out, **OVER), log=_quiet)
    snap = snapshot(out)
    assert len(snap["metrics"]) >= 3 and snap["files"], snap.keys()  # warm-up and RL steps
    assert any(k.startswith("rollouts.") for k in snap["files"])
    assert any(k.startswith("token_exports") for k in snap["files"])
    return snap


def _assert_same(out: Path, straight: dict[str, Any]) -> None:
    got = snapshot(out)
    assert [r["step"] for r in got["metrics"]] == [r["step"] for r in straight["metrics"]]
    assert got["rows"] == straight["rows"]
    assert sorted(got["files"]) == sorted(straight["files"])
    for name, data in straight["files"].items():
        assert got["files"][name] == data, name
    assert got["model"] == straight["model"]
    assert not list(out.rglob(".tmp-*")), list(out.rglob(".tmp-*"))


def _kill_on_call(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str, n: int) -> None:
    """Make the ``n``-th call of ``obj.name`` die (the earlier ones run normally)."""
    real = getattr(obj, name)
    calls = [0]

    def dying(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise Killed(f"{name} call {n}")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, dying)


def _die_inside_the_final_export(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file of the final model written to its temporary directory, nothing renamed yet."""
    real = ckpt.export_atomically

    def dying(final: Path, write: Any) -> Path:
        def write_then_die(d: Path) -> None:
            write(d)
            raise Killed("inside the final export")

        return real(final, write_then_die)

    monkeypatch.setattr(ckpt, "export_atomically", dying)


@pytest.mark.parametrize(
    "where",
    [
        "checkpoint write",  # model.pt and optimizer.pt of checkpoint 2 on disk, no manifest
        "before a checkpoint",  # step 3's metrics, rollouts and exports written, no checkpoint 3
        "final export",  # every checkpoint complete; the model directory half-written
    ],
)
def test_killed_anywhere_then_resumed_gives_the_same_model_and_files(
    tmp_path, monkeypatch, straight, where
):
    out = tmp_path / "run"
    if where == "checkpoint write":
        _kill_on_call(monkeypatch, ckpt, "_manifest", 2)
    elif where == "before a checkpoint":
        _kill_on_call(monkeypatch, recipe, "save_run", 3)
    else:
        _die_inside_the_final_export(monkeypatch)
    with pytest.raises(Killed):
        train(fast_config(out, **OVER), log=_quiet)
    monkeypatch.undo()
    if where == "final export":
        assert not (out / "final-model").exists()  # never a half-written model directory
    train(fast_config(out, **OVER), resume=out, log=_quiet)
    _assert_same(out, straight)


def test_sigkill_at_a_random_point_then_resume(tmp_path, straight):
    """A real SIGKILL of the trainer process once it has written some steps."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "echoloss.train.cli", "--config", str(FAST)]
    cmd += ["--output-dir", str(out)]
    for k, v in OVER.items():
        cmd += ["--set", f"{k}={json.dumps(v)}"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") >= 2:
            break
        time.sleep(0.02)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGKILL), err[-3000:]
    train(fast_config(out, **OVER), resume=out, log=_quiet)
    _assert_same(out, straight)


def test_resume_after_completion_re_exports_a_missing_model(tmp_path, straight, capsys):
    out = tmp_path / "run"
    train(fast_config(out, **OVER), log=_quiet)
    # As after a crash between the last checkpoint and the export (or a deleted export).
    shutil.rmtree(out / "final-model")
    args = ["--config", str(FAST), "--output-dir", str(out), "--resume"]
    for k, v in OVER.items():
        args += ["--set", f"{k}={json.dumps(v)}"]
    assert main(args) == 0
    [done] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("done: ")]
    # train.plots = false: the line names what was written, and no plots/ folder
    assert done == f"done: {out}/metrics.jsonl, {out}/final-model/"
    _assert_same(out, straight)


def _checkpoints(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("step_*"))


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, straight):
    out = tmp_path / "run"
    with pytest.raises(Killed), pytest.MonkeyPatch.context() as mp:
        _kill_on_call(mp, recipe, "save_run", 3)  # stop before the last step's checkpoint
        train(fast_config(out, **OVER), log=_quiet)
    older, newest = _checkpoints(out)[-2:]
    model = newest / "model.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])  # truncated
    with pytest.warns(ckpt.ResumeWarning, match=rf"skipping checkpoint .*{newest.name}.*model\.pt"):
        train(fast_config(out, **OVER), resume=out, log=_quiet)
    _assert_same(out, straight)
    assert (out / "checkpoints" / "latest").read_text().strip() != older.name  # moved on


@pytest.mark.parametrize("damage", ["flip a byte", "delete the manifest", "delete rng.pt"])
def test_every_kind_of_damage_is_detected(tmp_path, damage):
    root = tmp_path / "checkpoints"

    def write(d: Path) -> None:
        (d / "state.json").write_text('{"step": 1}')
        (d / "rng.pt").write_bytes(b"x" * 100)

    path = ckpt.save_checkpoint(root, 1, write, keep=2)
    assert ckpt.verify_checkpoint(path) is None
    if damage == "flip a byte":
        data = bytearray((path / "rng.pt").read_bytes())
        data[50] ^= 1
        (path / "rng.pt").write_bytes(bytes(data))
        expected = "SHA-256"
    elif damage == "delete the manifest":
        (path / ckpt.MANIFEST).unlink()
        expected = "no manifest.json"
    else:
        (path / "rng.pt").unlink()
        expected = "rng.pt is missing"
    assert expected in (ckpt.verify_checkpoint(path) or "")
    with pytest.warns(ckpt.ResumeWarning, match=expected):
        assert ckpt.latest_checkpoint(root) is None
    with (
        pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"),
        pytest.warns(ckpt.ResumeWarning),
    ):
        ckpt.find_checkpoint(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="cannot be used"):
        ckpt.find_checkpoint(path)  # named explicitly: an error, no silent substitute


def test_checkpoints_newer_than_latest_are_never_resumed(tmp_path):
    """After resuming from an older checkpoint, `latest` names the new branch; a stale newer
    checkpoint of the abandoned branch is not picked up."""
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        ckpt.save_checkpoint(root, step, lambda d: (d / "state.json").write_text("{}"), keep=5)
    ckpt.atomic_write_text(root / "latest", "step_000002\n")
    assert ckpt.latest_checkpoint(root) == root / "step_000002"


def test_resume_lists_changed_hyperparameters(tmp_path):
    out = tmp_path / "run"
    train(fast_config(out, **{**OVER, "train.max_steps": 1}), log=_quiet)
    changed = {**OVER, "train.max_steps": 3, "optim.lr": 0.02, "echo.alpha": 0.5}
    with pytest.warns(ckpt.ResumeWarning) as record:
        train(fast_config(out, **changed), resume=out, log=_quiet)
    [msg] = [str(w.message) for w in record if "configuration differs" in str(w.message)]
    assert "optim.lr: 0.01 -> 0.02" in msg, msg
    assert "echo.alpha: " in msg and "-> 0.5" in msg, msg
    assert "train.max_steps: 1 -> 3" in msg, msg


def test_config_changes_lists_every_key_once():
    old = {"optim": {"lr": 0.1, "betas": [0.9, 0.95]}, "advantages": {"kwargs": {"a": 1}}}
    new = {"optim": {"lr": 0.2, "betas": [0.9, 0.95]}, "advantages": {"kwargs": {"a": 2}}}
    assert ckpt.config_changes(old, new) == [
        "advantages.kwargs: {'a': 1} -> {'a': 2}",
        "optim.lr: 0.1 -> 0.2",
    ]
    assert ckpt.config_changes(old, old) == []


@pytest.mark.parametrize("how", ["no checkpoint", "corrupt checkpoint"])
def test_a_failed_resume_leaves_no_directory(tmp_path, capsys, how):
    new = tmp_path / "new"
    args = ["--config", str(FAST), "--output-dir", str(new), "--resume"]
    if how == "corrupt checkpoint":
        src = tmp_path / "src"
        train(fast_config(src, **{**OVER, "train.max_steps": 1}), log=_quiet)
        step = _checkpoints(src)[-1]
        (step / "optimizer.pt").write_bytes(b"garbage")
        args.append(str(step))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert ("no checkpoint" if how == "no checkpoint" else "cannot be used") in err, err
    assert not new.exists()


def test_outputs_of_a_resumed_run_are_cut_back_exactly(tmp_path):
    """The rows written after the checkpoint (here: a partial line, as a kill mid-write
    leaves) are removed, and nothing before the checkpoint is touched."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"st')
    (out / "token_exports" / "step_2").mkdir(parents=True)
    (out / "token_exports" / "step_3").mkdir(parents=True)
    (out / "token_exports" / "step_2" / "rank_0.jsonl").write_text("a\n")
    (out / "token_exports" / "step_3" / "rank_0.jsonl").write_text("b\n")
    sizes = {"metrics.jsonl": len('{"step": 1}\n{"step": 2}\n')}
    cut = ckpt.truncate_outputs(out, sizes, step=2, rank=0, names=["metrics.jsonl"])
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (out / "token_exports" / "step_2" / "rank_0.jsonl").is_file()
    assert not (out / "token_exports" / "step_3").exists()
    assert len(cut) == 2, cut


def test_leftovers_of_a_killed_save_are_removed_by_the_next_one(tmp_path):
    """A kill inside a save leaves a temporary directory, or the temporary file that replaces
    `latest`; the next save removes both."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ".tmp-step_000002-abc").mkdir()
    (root / ".tmp-step_000002-abc" / "model.pt").write_bytes(b"half")
    (root / ".tmp-latest-xyz").write_text("step_0000")
    ckpt.save_checkpoint(root, 2, lambda d: (d / "state.json").write_text("{}"), keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]


def test_a_checkpoint_of_another_model_shape_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "run"
    train(fast_config(out, **{**OVER, "train.max_steps": 1}), log=_quiet)
    args = ["--config", str(FAST), "--output-dir", str(out), "--resume"]
    args += ["--set", "model.hidden_size=48", "--set", "train.max_steps=2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "does not fit this model" in err and "model.hidden_size: 32 -> 48" in err, err


def test_done_is_printed_only_with_a_model(tmp_path, monkeypatch, capsys):
    """Whatever goes wrong in the export, the command never reports success without weights."""
    monkeypatch.setattr(
        recipe, "export_model", lambda *a, **k: None
    )  # an export that wrote nothing
    out = tmp_path / "run"
    args = ["--config", str(FAST), "--output-dir", str(out), "--set", "train.max_steps=1"]
    assert main([*args, "--set", "train.plots=false"]) == 1
    captured = capsys.readouterr()
    assert "\ndone: " not in "\n" + captured.out, captured.out
    assert "no complete model" in captured.err, captured.err
