"""One ``echoloss-train`` run from the command line: arguments, config, `train`, exit code.

`echoloss.train.cli.main` hands every command line that is not a subcommand to `run`; the
experiment's workers call `run` directly, once per run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

__all__ = ["run"]


def _value(text: str) -> Any:
    """``--set`` values are JSON when they parse (numbers, booleans, lists), strings otherwise."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="echoloss-train",
        description="Reference trainer: on-policy RL + echo on a built-in tool environment. "
        "With no --config it runs the embedded default (a tiny model on CPU). "
        "The ECHO experiments (docs/experiment.md) are not part of the package: "
        "`python examples/research/echo_experiment/run.py --help` in a source checkout.",
    )
    from echoloss.train.presets import packaged_configs

    p.add_argument(
        "--config",
        help="a TOML file, or a packaged config by name: "
        f"{', '.join(packaged_configs())} (default: the embedded default)",
    )
    p.add_argument("--max-steps", type=int, help="train.max_steps")
    p.add_argument("--output-dir", help="train.output_dir")
    p.add_argument("--seed", type=int, help="train.seed")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="PATH",
        help="resume from a checkpoint directory, or (no value) from OUTPUT_DIR/checkpoints/latest",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        default=None,
        help="train.overwrite: replace the earlier run in OUTPUT_DIR (its metrics, plots, "
        "checkpoints, final model); without it a fresh run into a used directory is refused",
    )
    p.add_argument(
        "--allow-import-paths",
        action="store_true",
        default=None,
        help="train.allow_import_paths: let the config name code by import path "
        "(advantages.fn = 'pkg.mod:fn'); only for configs you trust",
    )
    p.add_argument(
        "--report-to",
        nargs="+",
        choices=["tensorboard", "wandb"],
        metavar="{tensorboard,wandb}",
        help="train.report_to: also log metrics to TensorBoard and/or Weights & Biases",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any key, e.g. --set echo.alpha=0 (repeatable)",
    )
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.set:
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"echoloss-train: --set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = _value(val)
    for key, val in (
        ("train.max_steps", args.max_steps),
        ("train.output_dir", args.output_dir),
        ("train.seed", args.seed),
        ("train.overwrite", args.overwrite),
        ("train.allow_import_paths", args.allow_import_paths),
        ("train.report_to", args.report_to),
    ):
        if val is not None:
            out[key] = val
    return out


def run(argv: list[str]) -> int:
    """One training run for the command line ``argv`` (no subcommand); returns the exit code:
    0 done, 2 bad input (said on stderr, no traceback), 1 no complete model at the end."""
    args = _parser().parse_args(argv)
    from echoloss.train.config import ConfigError, load_config

    _plain_warnings()
    from echoloss.train.presets import resolve_config

    try:
        cfg = load_config(resolve_config(args.config), _overrides(args))
    except (ConfigError, FileNotFoundError) as err:
        print(f"echoloss-train: {err}", file=sys.stderr)
        return 2
    from echoloss.io import RolloutFileError
    from echoloss.loss import NonFiniteLossError
    from echoloss.train.checkpoint import CheckpointError, final_model_complete
    from echoloss.train.model import ModelLoadError
    from echoloss.train.recipe import train

    resume = None
    if args.resume is not None:
        resume = args.resume or cfg.train.output_dir
    out_dir = Path(cfg.train.output_dir)
    existed = out_dir.exists()
    try:
        out = train(cfg, resume=resume)
    except (
        FileNotFoundError,
        RolloutFileError,
        CheckpointError,
        ConfigError,
        ModelLoadError,
    ) as err:
        # Bad input: say what, no traceback, and leave no directory this run created.
        _remove_if_created(out_dir, existed)
        print(f"echoloss-train: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        # Training on would turn every parameter into NaN: stop, keep what was written.
        print(f"echoloss-train: training stopped: {err}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        if not final_model_complete(out / "final-model"):  # never "done" without the model
            print(f"echoloss-train: no complete model in {out}/final-model/", file=sys.stderr)
            return 1
        plots = [f"{out}/plots/"] if (out / "plots").is_dir() else []  # train.plots = false: none
        print("done: " + ", ".join([f"{out}/metrics.jsonl", *plots, f"{out}/final-model/"]))
    return 0


def _plain_warnings() -> None:
    """The trainer's own warnings (a changed config on resume, a skipped checkpoint, a suspicious
    setting) print as ``echoloss-train: warning: ...``, not in Python's file:line form (only the
    text changes: filters and ``pytest.warns`` see them as before)."""
    from echoloss.train.checkpoint import ResumeWarning
    from echoloss.train.config import ConfigWarning

    default = warnings.formatwarning

    def plain(message: Any, category: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(category, type) and issubclass(category, (ResumeWarning, ConfigWarning)):
            return f"echoloss-train: warning: {message}\n"
        return default(message, category, *args, **kwargs)

    warnings.formatwarning = plain


def _remove_if_created(out: Path, existed: bool) -> None:
    """Remove ``out`` if this run created it and it is still empty (a start that failed)."""
    if not existed and out.is_dir() and not any(out.iterdir()):
        out.rmdir()
