"""Checkpoint files from elsewhere: the bytes loaded are the bytes verified, ``latest`` stays
inside the run, and every malformed file gives a named CheckpointError."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from echoloss.train import checkpoint as ckpt

NAMES = ("model.pt",)


def _save(root, step, weight=1.0, state=None):
    def write(d):
        torch.save({"w": torch.full((3,), weight)}, d / "model.pt")
        (d / "state.json").write_text(json.dumps(state or {"step": step, "outputs": {}}))

    return ckpt.save_checkpoint(root, step, write, keep=5)


def _rewrite_manifest(d, edit):
    m = json.loads((d / ckpt.MANIFEST).read_text())
    edit(m)
    (d / ckpt.MANIFEST).write_text(json.dumps(m))


def _reseal(d):
    """Recompute the manifest after editing a file (a consistent but edited checkpoint)."""
    (d / ckpt.MANIFEST).write_text(json.dumps(ckpt._manifest(d)))


def test_loads_what_it_verified(tmp_path):
    root = tmp_path / "checkpoints"
    d = _save(root, 3)
    state, files = ckpt.load_checkpoint(d, NAMES)
    assert state["step"] == 3 and torch.equal(files["model.pt"]["w"], torch.ones(3))
    assert ckpt.find_checkpoint(tmp_path) == d  # verified (a first read) ...
    torch.save({"w": torch.full((3,), 9.0)}, d / "model.pt")  # ... then swapped before the load
    with pytest.raises(ckpt.CheckpointError, match=r"model.pt' does not match the manifest"):
        ckpt.load_checkpoint(d, NAMES)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m.pop("format"), r"format is None, this echoloss reads checkpoint format 2"),
        (lambda m: m.update(format=1), r"format is 1"),
        (lambda m: m.update(files=[]), r"'files' is not a table"),
        (lambda m: m["files"].update({"model.pt": "abc"}), r"entry 'model.pt' is not a table"),
        (lambda m: m["files"]["model.pt"].update(bytes="12"), r"'bytes' must be an int >= 0"),
        (lambda m: m["files"]["model.pt"].update(sha256=None), r"'sha256' must be 64 hex digits"),
        (
            lambda m: m["files"].update({"../x": m["files"]["model.pt"]}),
            r"'../x' is not a plain name",
        ),
        (lambda m: m["files"].pop("state.json"), r"lists no state.json"),
    ],
)
def test_malformed_manifest_is_named(tmp_path, edit, match):
    d = _save(tmp_path / "checkpoints", 3)
    _rewrite_manifest(d, edit)
    assert match.replace("\\", "").split("(")[0][:10] in (ckpt.verify_checkpoint(d) or "").replace(
        "\\", ""
    )
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load_checkpoint(d, NAMES)
    assert ckpt.verify_checkpoint(d) is not None


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"step": 10**9}, r"step must be 3 \(the step of its directory step_000003\)"),
        ({"step": -3}, r"step must be an int >= 0"),
        ({"step": "3"}, r"step must be an int >= 0"),
        ({"step": 3, "world_size": 0}, r"world_size must be an int >= 1"),
        ({"step": 3, "outputs": {"metrics.jsonl": -1}}, r"outputs must be a table"),
        ({"step": 3, "config": [1]}, r"config must be a table"),
    ],
)
def test_malformed_state_is_named(tmp_path, state, match):
    d = _save(tmp_path / "checkpoints", 3, state=state)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load_checkpoint(d, NAMES)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.read_state(d)


@pytest.mark.parametrize(
    "target", ["../../elsewhere/checkpoints/step_000003", "/tmp/step_000003", "x"]
)
def test_latest_outside_the_output_directory_is_refused(tmp_path, target):
    root = tmp_path / "run" / "checkpoints"
    _save(root, 3)
    other = _save(tmp_path / "elsewhere" / "checkpoints", 3, weight=5.0)
    assert other.is_dir()
    (root / "latest").write_text(target + "\n")
    with pytest.raises(ckpt.CheckpointError, match=r"not a step_NNNNNN directory of"):
        ckpt.find_checkpoint(tmp_path / "run")


def test_missing_latest_target_falls_back_with_a_warning_naming_both(tmp_path):
    root = tmp_path / "checkpoints"
    d3 = _save(root, 3)
    d5 = _save(root, 5)
    shutil.rmtree(d5)
    with pytest.warns(
        ckpt.ResumeWarning,
        match=r"names step_000005, which does not exist; resuming from .*step_000003",
    ):
        assert ckpt.find_checkpoint(tmp_path) == d3


def test_latest_as_a_link_to_a_checkpoint_is_followed(tmp_path):
    """``ln -s step_000003 latest`` after a rollback: resume from step 3, not the abandoned 5
    (a link was ignored before, and the newest checkpoint used without a word)."""
    root = tmp_path / "checkpoints"
    d3 = _save(root, 3)
    _save(root, 5)
    (root / "latest").unlink()
    (root / "latest").symlink_to("step_000003")
    assert ckpt.find_checkpoint(tmp_path) == d3
    (root / "latest").unlink()
    (root / "latest").symlink_to(d3.resolve())  # an absolute link into the run: the same
    assert ckpt.find_checkpoint(tmp_path) == d3


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda root: (root / "latest").symlink_to("latest"), r"link loop"),
        (
            lambda root: (
                (root / "a").symlink_to("b"),
                (root / "b").symlink_to("a"),
                (root / "latest").symlink_to("a"),
            ),
            r"link loop",
        ),
        (lambda root: (root / "latest").symlink_to(root.parent), r"is a link to .* not a step_"),
        (
            lambda root: (root / "latest").symlink_to(root.parent / "other" / "step_000003"),
            r"is a link to .* not a step_NNNNNN directory of",
        ),
        (lambda root: (root / "latest").mkdir(), r"is not a file"),
    ],
    ids=["self-loop", "two-link loop", "link to the run", "link to another run", "directory"],
)
def test_latest_that_is_a_loop_a_foreign_link_or_a_directory_is_refused(tmp_path, make, match):
    root = tmp_path / "checkpoints"
    _save(root, 3)
    (tmp_path / "other").mkdir()
    _save(tmp_path / "other", 3, weight=5.0)
    (root / "latest").unlink()
    make(root)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.find_checkpoint(tmp_path)


def test_dangling_link_latest_falls_back_with_a_warning(tmp_path):
    root = tmp_path / "checkpoints"
    d3 = _save(root, 3)
    (root / "latest").unlink()
    (root / "latest").symlink_to("step_000009")
    with pytest.warns(ckpt.ResumeWarning, match=r"names step_000009, which does not exist"):
        assert ckpt.find_checkpoint(tmp_path) == d3
