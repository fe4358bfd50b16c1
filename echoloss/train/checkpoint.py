"""Atomic checkpoints: a crash mid-write never leaves a corrupt latest checkpoint.

Layout of ``<output_dir>/checkpoints/``::

    step_000050/            a complete checkpoint (never modified after it appears)
        model.pt            full (unsharded) model state dict
        optimizer.pt        full optimiser state dict
        rng.pt              RNG states of every rank (torch, python, numpy)
        state.json          step, data position, RAE state, the config
    latest                  text file naming the newest complete checkpoint

How a checkpoint is written: every file goes into a temporary directory ``.tmp-step_000050-*``,
each file is fsynced, the directory is fsynced and renamed to ``step_000050`` (a rename is atomic
on POSIX), the parent is fsynced, and only then is ``latest`` replaced (written to a temporary file,
fsynced, ``os.replace``). A crash at any point leaves either the previous ``latest`` or the new
one, each pointing to a complete directory; leftover ``.tmp-*`` directories are removed by the
next save.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["latest_checkpoint", "save_checkpoint"]


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], *, keep: int) -> Path:
    """Write a checkpoint for ``step`` atomically; ``write(tmp_dir)`` writes its files.

    Keeps the newest ``keep`` checkpoints. Returns the final directory.
    """
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # a crash of an earlier save
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    name = f"step_{step:06d}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync_file(f)
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (a resumed run reaching it again)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / "latest", name + "\n")
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[:-keep]:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (following ``latest``), or None."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


def read_state(path: Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint directory, with a clear error when it is not one."""
    f = Path(path) / "state.json"
    if not f.is_file():
        raise FileNotFoundError(
            f"--resume: {str(path)!r} is not a checkpoint directory (no state.json); give a "
            "step_NNNNNN directory, or an output directory with checkpoints/latest"
        )
    return json.loads(f.read_text())
