"""Import directions between the layers of echoloss, read from the source (AST, no import).

Layers, bottom up: ``ops`` (kernels and their PyTorch references) → ``loss`` (the loss entry
points on top of the ops) → ``adapters`` (orchestrators) → ``train`` (the reference trainer).
Every ``import`` statement counts, including the lazy ones inside functions and those under
``TYPE_CHECKING``: a lazy import still ties the layers together.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "echoloss"

#: (layer whose modules are checked, packages it must never import, why)
RULES = [
    ("ops", ("echoloss.loss", "echoloss.train", "echoloss.adapters"), "ops are leaves"),
    ("loss", ("echoloss.train", "echoloss.adapters"), "the loss is below orchestrators"),
    ("adapters", ("echoloss.train",), "adapters are library code, the trainer is an app"),
]


def _module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path`` (relative ones resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            # ``from echoloss import train`` imports the subpackage by name.
            out += [(node.lineno, f"{mod}.{alias.name}") for alias in node.names]
    return out


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _hits(module: str, forbidden: tuple[str, ...]) -> bool:
    return any(module == f or module.startswith(f + ".") for f in forbidden)


def _violations(layer_of: Callable[[Path], bool], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in _modules():
        if not layer_of(path):
            continue
        for line, mod in _imports(path):
            if _hits(mod, forbidden):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {mod}")
    return bad


def test_the_package_has_the_layers_this_test_checks():
    for layer in ("ops", "loss", "adapters", "train"):
        assert (PACKAGE / layer / "__init__.py").is_file(), layer
    assert len(_modules()) > 20


@pytest.mark.parametrize(("layer", "forbidden", "why"), RULES, ids=[r[0] for r in RULES])
def test_layer_imports_point_down(layer, forbidden, why):
    root = PACKAGE / layer
    bad = _violations(lambda p: root in p.parents, forbidden)
    assert not bad, f"{layer} must not import {forbidden} ({why}):\n" + "\n".join(bad)


def test_nothing_outside_the_trainer_imports_it():
    train = PACKAGE / "train"
    bad = _violations(lambda p: train not in p.parents, ("echoloss.train",))
    assert not bad, "only echoloss/train may import echoloss.train:\n" + "\n".join(bad)


def test_the_checker_sees_relative_lazy_and_from_package_imports(tmp_path):
    # The rules above are only as good as the import parser: feed it every spelling.
    pkg = tmp_path / "echoloss"
    (pkg / "ops").mkdir(parents=True)
    src = (
        "import echoloss.train.recipe\n"
        "from echoloss import train\n"
        "from ..loss import core\n"
        "def f():\n"
        "    from echoloss.adapters.trl import x\n"
    )
    (pkg / "ops" / "mod.py").write_text(src)
    found = {m for _, m in _imports(pkg / "ops" / "mod.py", pkg)}
    assert {"echoloss.train.recipe", "echoloss.train", "echoloss.loss.core"} <= found
    assert "echoloss.adapters.trl" in found
    assert _hits("echoloss.train", ("echoloss.train",))
    assert not _hits("echoloss.training_utils", ("echoloss.train",))
