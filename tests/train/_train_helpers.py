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
