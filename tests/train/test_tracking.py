"""Tracking: the metrics rows reach TensorBoard and W&B (offline) through their own writers,
stay consistent with metrics.jsonl across a resume, and a missing library names the extra."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from _train_helpers import fast_config

from echoloss.train import recipe
from echoloss.train.config import ConfigError
from echoloss.train.recipe import train
from echoloss.train.tracking import scalars

OVER: dict[str, Any] = {"train.max_steps": 3, "train.plots": False, "train.checkpoint_every": 1}


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _tensorboard_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _expected(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k, v in scalars(r).items():
            out.setdefault(k, []).append((r["step"], v))
    return out


def _assert_matches(got: dict[str, list[tuple[int, float]]], rows: list[dict[str, Any]]) -> None:
    want = _expected(rows)
    assert set(got) == set(want), set(got) ^ set(want)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        for (_, a), (_, b) in zip(got[tag], points, strict=True):
            # TensorBoard stores scalars as float32: equal to the float64 value rounded once.
            assert a == pytest.approx(b, rel=2**-23, abs=1e-30) or (a != a and b != b), (tag, a, b)


def test_tensorboard_event_file_holds_every_logged_scalar(tmp_path):
    out = train(fast_config(tmp_path / "run", **OVER, **{"train.report_to": ["tensorboard"]}))
    rows = _rows(out)
    got = _tensorboard_scalars(out)
    assert {"loss", "tokens", "grad_norm"} <= set(got)
    _assert_matches(got, rows)


class Killed(Exception):
    pass


def test_tensorboard_after_a_resume_has_each_step_once(tmp_path, monkeypatch):
    over = {**OVER, "train.report_to": ["tensorboard"]}
    out = tmp_path / "run"
    real, calls = recipe.save_run, [0]

    def dying(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:  # step 3 logged everywhere, its checkpoint never written
            raise Killed
        real(*args, **kwargs)

    monkeypatch.setattr(recipe, "save_run", dying)
    with pytest.raises(Killed):
        train(fast_config(out, **over), log=lambda _: None)
    monkeypatch.undo()
    assert _tensorboard_scalars(out)["loss"][-1][0] == 3  # the step the resume rewrites
    train(fast_config(out, **over), resume=out, log=lambda _: None)
    _assert_matches(_tensorboard_scalars(out), _rows(out))


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B without an account or a network: offline mode, every file under tmp_path."""
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path / "wandb-dir"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(key, value)


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` transaction log: a 7-byte header (``:W&B``, magic, version),
    then LevelDB-log framing (32 KiB blocks; each record: crc32c[4], length[2, LE], type[1]
    with 1 = full, 2/3/4 = first/middle/last fragment)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, parts, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(payload)
        elif kind in (2, 3):
            parts = (b"" if kind == 2 else parts) + payload
        elif kind == 4:
            out.append(parts + payload)
    return out


def _wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of an offline run, read back from its ``.wandb`` transaction log."""
    from wandb.proto import wandb_internal_pb2

    [log] = run_dir.glob("run-*.wandb")
    rows = []
    for data in _wandb_records(log):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            items = rec.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def test_wandb_offline_run_is_created_with_the_history(tmp_path, wandb_offline):
    out = train(fast_config(tmp_path / "run", **OVER, **{"train.report_to": ["wandb"]}))
    [run_dir] = (out / "wandb").glob("offline-run-*")
    history = _wandb_history(run_dir)
    rows = _rows(out)
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    for h, r in zip(history, rows, strict=True):
        for key, value in scalars(r).items():
            assert h[key] == pytest.approx(value, rel=1e-12), key  # JSON round trip of a float64
    assert (out / "wandb" / "run_id").read_text().strip() in run_dir.name


def test_a_missing_tracker_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError) as err:
        fast_config(Path("unused"), **{"train.report_to": ["wandb"]})
    msg = str(err.value)
    assert "train.report_to" in msg and "wandb" in msg and "echoloss[tracking]" in msg, msg


def test_an_unknown_tracker_is_named():
    with pytest.raises(ConfigError, match=r"train\.report_to\.0: Input should be 'tensorboard'"):
        fast_config(Path("unused"), **{"train.report_to": ["mlflow"]})


def test_wandb_resume_continues_the_same_run(tmp_path, wandb_offline, monkeypatch):
    over = {**OVER, "train.report_to": ["wandb"]}
    out = tmp_path / "run"
    real, calls = recipe.save_run, [0]

    def dying(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise Killed
        real(*args, **kwargs)

    monkeypatch.setattr(recipe, "save_run", dying)
    with pytest.raises(Killed):
        train(fast_config(out, **over), log=lambda _: None)
    monkeypatch.undo()
    train(fast_config(out, **over), resume=out, log=lambda _: None)
    run_id = (out / "wandb" / "run_id").read_text().strip()
    first, second = sorted((out / "wandb").glob("offline-run-*"))
    # wandb names a run's directory offline-run-<time>-<id>, with "-1" appended when both parts
    # started within the same second.
    same_run = re.compile(rf"^offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?$")
    assert same_run.match(first.name) and same_run.match(second.name), (first.name, second.name)
    # The resumed part logs from the step after the checkpoint (2) to the end.
    steps = [r["step"] for r in _rows(out)]
    assert [h["_step"] for h in _wandb_history(second)] == steps[2:]
