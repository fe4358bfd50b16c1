"""The example configs shipped inside the package: ``echoloss-train --config gpu``.

``configs/*.toml`` in the repository are installed with the package (``echoloss/train/configs/``),
so that a wheel install has them too. ``--config`` takes a file path, or the bare name of one of
these (``default``, ``fast``, ``gpu``, ``jsonl``); a file that exists always wins.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["packaged_configs", "resolve_config"]


def _configs_dir() -> Path:
    return Path(str(resources.files("echoloss.train").joinpath("configs")))


def packaged_configs() -> list[str]:
    """The names of the packaged configs, sorted.

    Example:
        >>> {"default", "fast", "gpu", "jsonl"} <= set(packaged_configs())
        True
    """
    return sorted(p.stem for p in _configs_dir().glob("*.toml"))


def resolve_config(arg: str | None) -> str | None:
    """Map a ``--config`` argument to a file path.

    Args:
        arg: None (the embedded default), a path, or the name of a packaged config.

    Returns:
        ``arg`` unchanged when it is None, an existing file or looks like a path (has a ``/`` or
        ends in ``.toml``); otherwise the packaged config of that name.

    Raises:
        FileNotFoundError: a bare name that is neither a file nor a packaged config; the message
            lists the packaged names.

    Example:
        >>> resolve_config("fast").endswith("fast.toml")
        True
        >>> resolve_config("my-run.toml")
        'my-run.toml'
    """
    if arg is None or Path(arg).is_file() or "/" in arg or arg.endswith(".toml"):
        return arg
    path = _configs_dir() / f"{arg}.toml"
    if not path.is_file():
        raise FileNotFoundError(
            f"--config: no file {arg!r} and no packaged config of that name; packaged: "
            f"{', '.join(packaged_configs())} (or give a path to a TOML file)"
        )
    return str(path)
