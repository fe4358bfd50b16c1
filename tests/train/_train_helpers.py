"""Helpers shared by the trainer tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FAST = REPO / "configs" / "fast.toml"


def fast_config(out: Path, **overrides: Any):
    """``configs/fast.toml`` with the output in ``out`` and ``{"section.key": value}`` overrides."""
    from echoloss.train.config import load_config

    return load_config(FAST, {"train.output_dir": str(out), **overrides})


def rollout_jsonl(tmp: Path, name: str = "rollouts.jsonl") -> Path:
    """A rollout JSONL file written by a short generation run (real logprobs and attribution),
    with mixed rewards so that advantages are non-zero."""
    import json

    from echoloss.train.recipe import train

    cfg = fast_config(tmp / "gen", **{"train.save_rollouts": True, "train.plots": False})
    out = train(cfg, log=lambda _: None)
    records = [json.loads(x) for x in (out / "rollouts.rank0.jsonl").read_text().splitlines()]
    for i, r in enumerate(records):
        r["reward"] = float(i % 2)
    path = tmp / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
