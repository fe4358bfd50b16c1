"""Optional dependencies: import them on first use, and name the pip extra when one is missing.

Adapters, kernels and the trainer import their third-party stacks lazily (``import echoloss``
stays cheap and works with the core dependencies only). A missing stack must not surface as a
bare ``ModuleNotFoundError: tokenizers``: [require][echoloss._optional.require] and
[require_extra][echoloss._optional.require_extra] raise [MissingExtraError][echoloss._optional.MissingExtraError],
whose message names what needs it and the command that installs it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require", "require_extra"]

#: The importable modules behind each extra of ``pyproject.toml`` that code checks for.
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("transformers", "tokenizers", "matplotlib", "tqdm"),
    "triton": ("triton",),
    "bench": ("matplotlib",),
    "trl": ("trl", "transformers", "tokenizers"),
    "verifiers": ("verifiers",),
    "pretrained": ("gguf", "transformers", "tokenizers"),
}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message says which extra provides it."""


def _install_hint(extra: str) -> str:
    return f"pip install 'echoloss[{extra}]' (from a clone: pip install -e '.[{extra}]')"


def require(module: str, *, extra: str, needed_by: str | None = None) -> ModuleType:
    """Import ``module`` or raise an error naming the pip extra that installs it.

    Args:
        module: the importable name, e.g. ``"tokenizers"`` or ``"matplotlib.pyplot"``.
        extra: the echoloss extra that provides it, e.g. ``"train"``.
        needed_by: what needs it, for the message (default: "this feature").

    Returns:
        The imported module.

    Raises:
        MissingExtraError: ``module`` (or one of its own imports) is not installed.

    Example:
        >>> require("json", extra="train").dumps([1])
        '[1]'
        >>> require("no_such_module_xyz", extra="train", needed_by="echoloss-train")
        Traceback (most recent call last):
        ...
        echoloss._optional.MissingExtraError: echoloss-train needs no_such_module_xyz, which is not installed (No module named 'no_such_module_xyz'); install the 'train' extra: pip install 'echoloss[train]' (from a clone: pip install -e '.[train]')
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise MissingExtraError(
            f"{needed_by or 'this feature'} needs {module}, which is not installed ({err}); "
            f"install the {extra!r} extra: {_install_hint(extra)}",
            name=err.name,
        ) from err


def require_extra(extra: str, *, needed_by: str, modules: Sequence[str] | None = None) -> None:
    """Check, without importing them, that every module of ``extra`` is installed.

    One error lists everything that is missing, before any work starts (rather than the first
    missing module minutes into a run).

    Args:
        extra: a key of [EXTRAS][echoloss._optional.EXTRAS] (or any name when ``modules`` is given).
        needed_by: what needs the extra, for the message, e.g. ``"echoloss-train"``.
        modules: the modules to check (default: ``EXTRAS[extra]``).

    Raises:
        MissingExtraError: at least one module is not installed; the message names all of them.
        KeyError: ``extra`` is unknown and ``modules`` is not given.

    Example:
        >>> require_extra("demo", needed_by="this example", modules=["json", "no_such_mod_a"])
        Traceback (most recent call last):
        ...
        echoloss._optional.MissingExtraError: this example needs the 'demo' extra; not installed: no_such_mod_a. Install it with: pip install 'echoloss[demo]' (from a clone: pip install -e '.[demo]')
    """
    names = EXTRAS[extra] if modules is None else tuple(modules)
    missing = [m for m in names if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"{needed_by} needs the {extra!r} extra; not installed: {', '.join(missing)}. "
            f"Install it with: {_install_hint(extra)}",
            name=missing[0],
        )
