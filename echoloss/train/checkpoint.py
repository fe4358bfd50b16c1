"""Checkpoints that load without running code, are verified before use, and resume idempotently.

Layout of ``<output_dir>/checkpoints/``::

    step_000050/            a complete checkpoint (never modified after it appears)
        model.pt            full (unsharded) model state dict: tensors only
        optimizer.pt        full optimiser state dict: tensors, numbers, lists and dicts
        rng.pt              RNG states of every rank as tensors and numbers (torch, python, numpy)
        state.json          step, data position, RAE state, the config, output file sizes
        manifest.json       size and SHA-256 of every other file; written last
    latest                  text file naming the newest complete checkpoint (a symbolic link
                            to a step_NNNNNN directory of this run is followed too)

**Nothing in a checkpoint runs code.** Every ``.pt`` file is read with
``torch.load(weights_only=True)``, which accepts tensors and plain containers only; a file holding
anything else (a pickled object whose ``__reduce__`` would run a command) is refused with
`CheckpointError` before any of it executes. The rest is JSON.

**How a checkpoint is written**: every file goes into a temporary directory
``.tmp-step_000050-*``; the manifest (sizes and checksums) is written last; each file is fsynced,
the directory is fsynced and renamed to ``step_000050`` (a rename is atomic on POSIX), the parent
is fsynced, and only then is ``latest`` replaced (written to a temporary file, fsynced,
``os.replace``). A crash at any point leaves the previous ``latest``, or the new one, each naming a
complete directory; leftover ``.tmp-*`` directories are removed by the next save.

**How a checkpoint is chosen on resume**: the one ``latest`` names, then older ones, newest first;
the first whose manifest matches its files is used. A skipped (truncated, corrupt, incomplete)
checkpoint gives a `ResumeWarning` naming it and why.

**Outputs are cut back on resume**: ``state.json`` records the size of every append-only output
(``metrics.jsonl``, ``rollouts.rank<R>.jsonl``) when the checkpoint was taken, and
`truncate_outputs` cuts them back to it (token exports: the ``step_N`` files past the
checkpoint are removed), so a resumed run never duplicates a row.

Examples:
    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp()) / "checkpoints"
    >>> def write(d):
    ...     (d / "state.json").write_text('{"step": 3}')
    >>> save_checkpoint(root, 3, write, keep=2).name
    'step_000003'
    >>> verify_checkpoint(root / "step_000003") is None  # complete: no problem to report
    True
    >>> latest_checkpoint(root).name
    'step_000003'
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "ResumeWarning",
    "capture_rng",
    "config_changes",
    "export_atomically",
    "final_model_complete",
    "find_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_tensors",
    "output_sizes",
    "read_state",
    "restore_rng",
    "save_checkpoint",
    "truncate_outputs",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
FORMAT = 2  # 1: pickled RNG state (numpy arrays, tuples) and no manifest; refused since


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, or holding more than data."""


class ResumeWarning(UserWarning):
    """A resume that goes on, but not exactly as asked (a skipped checkpoint, a changed config)."""


# ------------------------------------------------------------------------------------------------
# Durable writes


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest(directory: Path) -> dict[str, Any]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    return {
        "format": FORMAT,
        "files": {
            p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in files
        },
    }


def save_checkpoint(root: Path, step: int, write: Callable[[Path], None], *, keep: int) -> Path:
    """Write a checkpoint for ``step`` atomically; ``write(tmp_dir)`` writes its files.

    The manifest (size and SHA-256 of every file ``write`` wrote) is written last, so a directory
    with a valid manifest is complete. Keeps the newest ``keep`` checkpoints. Returns the final
    directory.
    """
    root.mkdir(parents=True, exist_ok=True)
    # What a crash of an earlier save left: its directory, or the file that replaces `latest`.
    for stale in root.glob(".tmp-*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    name = f"step_{step:06d}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{name}-"))
    try:
        write(tmp)
        (tmp / MANIFEST).write_text(json.dumps(_manifest(tmp), indent=1))
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


# ------------------------------------------------------------------------------------------------
# Verification and choice of a checkpoint


def _manifest_files(raw: bytes) -> dict[str, dict[str, Any]]:
    """The ``files`` table of a manifest, every entry checked (raises ValueError naming it)."""
    manifest = json.loads(raw.decode("utf-8"))
    if not isinstance(manifest, dict):
        raise ValueError("it is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"format is {manifest.get('format')!r}, this echoloss reads checkpoint format {FORMAT}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError("'files' is not a table of file name -> {bytes, sha256}")
    for rel, meta in files.items():
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts or rel == MANIFEST:
            raise ValueError(f"file name {rel!r} is not a plain name inside the checkpoint")
        if not isinstance(meta, dict):
            raise ValueError(f"entry {rel!r} is not a table with 'bytes' and 'sha256'")
        size, digest = meta.get("bytes"), meta.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"entry {rel!r}: 'bytes' must be an int >= 0, got {size!r}")
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= set(_HEX)):
            raise ValueError(f"entry {rel!r}: 'sha256' must be 64 hex digits, got {digest!r}")
    if "state.json" not in files:
        raise ValueError("it lists no state.json")
    return files


_HEX = "0123456789abcdef"


def verify_checkpoint(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when its manifest matches its files."""
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    try:
        files = _manifest_files((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        return f"no {MANIFEST} (incomplete, or written by an echoloss older than checkpoint format {FORMAT})"
    except (ValueError, UnicodeDecodeError) as err:
        return f"{MANIFEST} is unreadable or malformed ({err})"
    for rel, meta in sorted(files.items()):
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size != meta["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {meta['bytes']} (truncated?)"
        if _sha256(f) != meta["sha256"]:
            return f"{rel} does not match its SHA-256 checksum (corrupt or modified)"
    return None


def load_checkpoint(path: Path, names: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, {name: contents})`` of a checkpoint, loaded from the very bytes that were verified.

    Every file is read once, through one handle on the directory (a directory swapped in its
    place afterwards is not read); its size and SHA-256 are checked against the manifest on
    those bytes, and ``state.json`` and the ``.pt`` files in ``names`` are parsed from them
    (``torch.load(weights_only=True)``: no code runs). Nothing is read twice, so nothing can
    change between the check and the load.

    Raises:
        CheckpointError: a malformed manifest or ``state.json``, a file that does not match the
            manifest, or a ``.pt`` file holding more than tensors and plain containers.
    """
    path = Path(path)
    try:
        dfd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as err:
        raise CheckpointError(f"--resume: cannot open checkpoint {str(path)!r} ({err})") from None
    try:
        try:
            files = _manifest_files(_read_at(dfd, MANIFEST))
        except (OSError, ValueError, UnicodeDecodeError) as err:
            raise CheckpointError(
                f"--resume: {str(path / MANIFEST)!r} is missing, unreadable or malformed ({err}); "
                "give another checkpoint"
            ) from None
        data: dict[str, bytes] = {}
        for rel in ("state.json", *names):
            meta = files.get(rel)
            if meta is None:
                raise CheckpointError(f"--resume: {str(path)!r}: the manifest lists no {rel}")
            try:
                raw = _read_at(dfd, rel)
            except OSError as err:
                raise CheckpointError(
                    f"--resume: cannot read {str(path / rel)!r} ({err})"
                ) from None
            if len(raw) != meta["bytes"] or hashlib.sha256(raw).hexdigest() != meta["sha256"]:
                raise CheckpointError(
                    f"--resume: {str(path / rel)!r} does not match the manifest ({len(raw)} bytes, "
                    f"the manifest says {meta['bytes']}, or a different SHA-256): corrupt or "
                    "modified; give another checkpoint"
                )
            data[rel] = raw
    finally:
        os.close(dfd)
    state = _checked_state(data.pop("state.json"), path)
    return state, {rel: _torch_load(io.BytesIO(raw), path / rel) for rel, raw in data.items()}


def _read_at(dfd: int, rel: str) -> bytes:
    fd = os.open(rel, os.O_RDONLY, dir_fd=dfd)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _checked_state(raw: bytes, path: Path) -> dict[str, Any]:
    """``state.json``'s contents, each field the trainer reads checked (CheckpointError naming it).

    ``step`` must equal the directory's ``step_NNNNNN`` number (when it has one) and be ≥ 0.
    """
    f = path / "state.json"
    try:
        state = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"--resume: {str(f)!r} is not valid JSON ({err})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"--resume: {str(f)!r} is not a JSON object")

    def bad(key: str, expected: str) -> CheckpointError:
        return CheckpointError(
            f"--resume: {str(f)!r}: {key} must be {expected}, got {state.get(key)!r}; the file "
            "was not written by echoloss-train, or was edited"
        )

    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad("step", "an int >= 0")
    named = _step_of(path) if path.name.startswith("step_") else None
    if named is not None and named >= 0 and step != named:
        raise bad("step", f"{named} (the step of its directory {path.name})")
    for key, low in (("data_position", 0), ("world_size", 1)):
        v = state.get(key)
        if key in state and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise bad(key, f"an int >= {low}")
    outputs = state.get("outputs", {})
    if not isinstance(outputs, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in outputs.items()
    ):
        raise bad("outputs", "a table of file name -> size in bytes (int >= 0)")
    for key in ("config", "rae"):
        if state.get(key) is not None and not isinstance(state[key], dict):
            raise bad(key, "a table (or null)")
    return state


def _step_of(path: Path) -> int:
    try:
        return int(path.name.removeprefix("step_"))
    except ValueError:
        return -1


def _pointer(root: Path) -> Path | None:
    """The directory ``root/latest`` names (None when there is no ``latest``).

    ``latest`` is the text file `save_checkpoint` writes, or a symbolic link to the checkpoint
    directory (``ln -s step_000003 latest``, a common convention), which is followed under the
    same rules as the name a text file holds.

    Raises:
        CheckpointError: ``latest`` names anything but a ``step_NNNNNN`` directory of ``root``
            (an absolute path, ``..``, another directory, a link out of the run or a link
            loop), or is neither a file nor a link: resuming there would read another run's
            checkpoint and append to this run's outputs; ignoring it would resume from a
            checkpoint the run abandoned.
    """
    pointer = root / "latest"
    fix = (
        "Fix latest to name one of this run's checkpoints (a text file holding step_NNNNNN, or "
        "a link to that directory), or pass that checkpoint directory to --resume"
    )
    if pointer.is_symlink():
        try:
            target = os.readlink(pointer)
            resolved = pointer.resolve(strict=False)
            # resolve() does not raise on a loop before Python 3.13: check that it settled
            loop = resolved.is_symlink()
        except (OSError, RuntimeError) as err:
            target, loop = str(err), True
        if loop:
            raise CheckpointError(
                f"--resume: {str(pointer)!r} is a symbolic link that never reaches a directory "
                f"(a link loop: {target!r}). {fix}"
            )
        named = root / resolved.name
        if (
            resolved.parent != root.resolve()
            or not resolved.name.startswith("step_")
            or _step_of(named) < 0
        ):
            raise CheckpointError(
                f"--resume: {str(pointer)!r} is a link to {target!r} ({str(resolved)!r}), which "
                f"is not a step_NNNNNN directory of {str(root)!r}; a checkpoint elsewhere belongs "
                f"to another run. {fix}"
            )
        return named
    if not pointer.exists():
        return None
    if not pointer.is_file():
        raise CheckpointError(
            f"--resume: {str(pointer)!r} is not a file (a directory?); it must name this run's "
            f"newest checkpoint. {fix}"
        )
    try:
        text = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"--resume: cannot read {str(pointer)!r} ({err})") from None
    named = root / text
    if (
        not text.startswith("step_")
        or Path(text).name != text
        or _step_of(named) < 0
        or named.resolve().parent != root.resolve()
    ):
        raise CheckpointError(
            f"--resume: {str(pointer)!r} names {text!r}, which is not a step_NNNNNN directory "
            f"of {str(root)!r}; a checkpoint elsewhere belongs to another run. Fix latest to name "
            "one of this run's checkpoints, or pass that checkpoint directory to --resume"
        )
    return named


def _candidates(root: Path) -> list[Path]:
    """The checkpoint ``latest`` names, then the older ones, newest first."""
    steps = sorted(
        (p for p in root.glob("step_*") if p.is_dir() and _step_of(p) >= 0),
        key=_step_of,
        reverse=True,
    )
    named = _pointer(root)
    if named is None or not named.is_dir():
        return steps
    # Checkpoints newer than `latest` belong to an abandoned branch of the run (a resume from an
    # older checkpoint wrote `latest` since): never resume from them.
    return [named, *(p for p in steps if _step_of(p) < _step_of(named))]


def latest_checkpoint(root: Path, *, warn: bool = True) -> Path | None:
    """The newest complete checkpoint under ``root``, or None if there is none.

    A newer checkpoint that fails `verify_checkpoint` is skipped with a
    `ResumeWarning` (set ``warn=False`` to skip it silently); so is a ``latest`` that names a
    checkpoint that does not exist (the warning names it and the one used instead).
    """
    root = Path(root)
    named = _pointer(root)
    for path in _candidates(root):
        problem = verify_checkpoint(path)
        if problem is None:
            if warn and named is not None and not named.is_dir():
                warnings.warn(
                    f"--resume: {str(root / 'latest')!r} names {named.name}, which does not "
                    f"exist; resuming from {str(path)!r}, the newest complete checkpoint",
                    ResumeWarning,
                    stacklevel=2,
                )
            return path
        if warn:
            warnings.warn(
                f"--resume: skipping checkpoint {str(path)!r}: {problem}; trying the previous one",
                ResumeWarning,
                stacklevel=2,
            )
    return None


def find_checkpoint(resume: str | Path) -> Path:
    """The checkpoint to resume from: ``resume`` itself (a ``step_NNNNNN`` directory), or the
    newest complete one of an output directory (``resume/checkpoints``).

    Raises:
        FileNotFoundError: nothing that looks like a checkpoint is there.
        CheckpointError: ``resume`` is a checkpoint directory that fails verification, or every
            checkpoint of the output directory does.
    """
    path = Path(resume)
    if (path / "state.json").is_file() or (path / MANIFEST).is_file():
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CheckpointError(
                f"--resume: checkpoint {str(path)!r} cannot be used: {problem}. Give an older "
                f"step_NNNNNN directory, or the output directory to pick the newest complete one"
            )
        return path
    root = path / "checkpoints"
    if not root.is_dir() or not any(root.glob("step_*")):
        raise FileNotFoundError(
            f"--resume: no checkpoint in {str(path)!r} (no state.json, no checkpoints/step_*); "
            "give a step_NNNNNN directory, or an output directory with checkpoints"
        )
    found = latest_checkpoint(root)
    if found is None:
        raise CheckpointError(
            f"--resume: no complete checkpoint in {str(root)!r} (each was skipped: see the "
            "warnings above); start a fresh run, or restore a checkpoint from a backup"
        )
    return found


def read_state(path: Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint directory, checked (`CheckpointError` naming the field)."""
    f = Path(path) / "state.json"
    if not f.is_file():
        raise FileNotFoundError(
            f"--resume: {str(path)!r} is not a checkpoint directory (no state.json); give a "
            "step_NNNNNN directory, or an output directory with checkpoints/latest"
        )
    return _checked_state(f.read_bytes(), Path(path))


def load_tensors(path: Path) -> Any:
    """A ``.pt`` file of a checkpoint, read with ``torch.load(weights_only=True)`` on CPU.

    Raises:
        CheckpointError: the file holds objects other than tensors and plain containers (it is
            refused before any of them is built), or it is truncated or not a torch file.
    """
    return _torch_load(path, path)


def _torch_load(source: Any, path: Path) -> Any:
    try:
        return torch.load(source, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"--resume: refused to load {str(path)!r}: it holds pickled objects other than tensors "
            f"and plain containers ({first}). Checkpoints are read with "
            "torch.load(weights_only=True) and never run code; this file was not written by "
            "echoloss-train (or by one older than checkpoint format 2). Resume from a checkpoint "
            "you trust"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointError(
            f"--resume: cannot read {str(path)!r} ({type(err).__name__}: {err}); truncated or "
            "corrupt"
        ) from None


# ------------------------------------------------------------------------------------------------
# RNG states as tensors (what weights_only=True can load)


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (torch, CUDA, Python, NumPy) as tensors, numbers and dicts."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": {"version": version, "state": torch.tensor(internal), "gauss": gauss},
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the RNG states captured by `capture_rng`."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(
        (
            n["name"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------
# Idempotent outputs


def output_sizes(out: Path, names: list[str]) -> dict[str, int]:
    """Sizes in bytes of the append-only outputs ``names`` (relative to ``out``) that exist."""
    return {n: (out / n).stat().st_size for n in names if (out / n).is_file()}


def truncate_outputs(
    out: Path, sizes: Mapping[str, int], *, step: int, rank: int, names: list[str]
) -> list[str]:
    """Cut this rank's outputs back to the checkpoint at ``step``; returns what was cut.

    ``names`` are this rank's append-only files; each is cut to its size in ``sizes`` (its size
    when the checkpoint was taken; absent = it did not exist yet, so it is emptied). Token exports
    of later steps (``token_exports/step_N/rank_<rank>.jsonl`` with ``N > step``) are removed.
    """
    cut = []
    for name in names:
        f = out / name
        if not f.is_file():
            continue
        keep = int(sizes.get(name, 0))
        size = f.stat().st_size
        if size > keep:
            with open(f, "r+b") as fh:
                fh.truncate(keep)
            cut.append(f"{name}: {size - keep} bytes after step {step}")
        elif size < keep:
            warnings.warn(
                f"--resume: {str(f)!r} has {size} bytes, fewer than the {keep} it had at step "
                f"{step}: it was edited or replaced since; kept as it is",
                ResumeWarning,
                stacklevel=2,
            )
    exports = out / "token_exports"
    for d in sorted(exports.glob("step_*")) if exports.is_dir() else []:
        n = d.name.removeprefix("step_")
        if n.isdigit() and int(n) > step:
            f = d / f"rank_{rank}.jsonl"
            if f.is_file():
                f.unlink()
                cut.append(f"token_exports/{d.name}/{f.name}")
            with contextlib.suppress(OSError):  # the last rank out removes the directory
                d.rmdir()
    return cut


# ------------------------------------------------------------------------------------------------
# The final model


def export_atomically(final: Path, write: Callable[[Path], None]) -> Path:
    """Write a directory atomically: ``write(tmp)`` fills a temporary sibling, which then replaces
    ``final`` by renames, so ``final`` is either absent, the old one, or complete."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    try:
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync_file(f)
        _fsync_dir(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-old-"))
            os.rename(final, old / final.name)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def final_model_complete(final: Path) -> bool:
    """``final`` holds a Hugging Face model: its config and its (possibly sharded) weights."""
    final = Path(final)
    weights = (final / "model.safetensors").is_file() or (
        final / "model.safetensors.index.json"
    ).is_file()
    return weights and (final / "config.json").is_file()


# ------------------------------------------------------------------------------------------------
# Configuration changes


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and key.count(".") < 1:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``"key: old -> new"`` for every configuration key whose value differs (sorted by key).

    Examples:
        >>> config_changes({"optim": {"lr": 1e-3}}, {"optim": {"lr": 3e-4}})
        ['optim.lr: 0.001 -> 0.0003']
    """
    a, b = _flatten(old), _flatten(new)

    def show(d: dict[str, Any], key: str) -> str:
        return repr(d[key]) if key in d else "(absent)"

    return [
        f"{k}: {show(a, k)} -> {show(b, k)}"
        for k in sorted(set(a) | set(b))
        if k not in a or k not in b or a[k] != b[k]
    ]
