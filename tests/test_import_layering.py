"""Import directions between the layers of echoloss, read from the source (AST, no import).

Layers, bottom up: ``advantages`` (per-group advantages, a leaf) → ``data`` (the data path,
which stamps advantages) ; ``ops`` (kernels and their PyTorch references, leaves) → ``loss`` (the
loss entry points on top of the ops) → ``nn`` (modules around the loss) ; then ``adapters``
(orchestrators), ``io`` (interchange formats) and ``train`` (the reference trainer). The data path
and the loss never import each other: ``LossInputs.from_targets`` reads the targets by name.
Every ``import`` statement counts, including the lazy ones inside functions and those under
``TYPE_CHECKING``: a lazy import still ties the layers together. Below every layer are the root
helpers (``echoloss/_*.py``: argument checks, the deferred-check queue, logging, the registry
type, ...), which import nothing of the package, so any layer may use them. Besides the layers,
no two modules of the package may import each other, directly or through others (no import
circle).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "echoloss"

#: (layer whose modules are checked, packages it must never import, why)
APPS = ("echoloss.adapters", "echoloss.io", "echoloss.train")
RULES = [
    (
        "advantages",
        ("echoloss.data", "echoloss.loss", "echoloss.ops", "echoloss.nn", *APPS),
        "advantages are a leaf: functions of rewards",
    ),
    (
        "data",
        ("echoloss.loss", "echoloss.ops", "echoloss.nn", *APPS),
        "the data path builds batches; it does not know the loss",
    ),
    (
        "ops",
        ("echoloss.loss", "echoloss.data", "echoloss.advantages", "echoloss.nn", *APPS),
        "ops are leaves",
    ),
    (
        "loss",
        ("echoloss.data", "echoloss.advantages", "echoloss.nn", *APPS),
        "the loss is below orchestrators and reads the data path's records by name",
    ),
    ("nn", ("echoloss.data", "echoloss.advantages", *APPS), "modules wrap the loss only"),
    ("adapters", ("echoloss.train", "echoloss.io"), "adapters are library code, below io"),
    ("io", ("echoloss.train", "echoloss.nn"), "interchange formats, below the trainer"),
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
    for layer in ("advantages", "data", "ops", "loss", "nn", "adapters", "io", "train"):
        assert (PACKAGE / layer / "__init__.py").is_file(), layer
    assert len(_modules()) > 20


@pytest.mark.parametrize(("layer", "forbidden", "why"), RULES, ids=[r[0] for r in RULES])
def test_layer_imports_point_down(layer, forbidden, why):
    root = PACKAGE / layer
    bad = _violations(lambda p: root in p.parents, forbidden)
    assert not bad, f"{layer} must not import {forbidden} ({why}):\n" + "\n".join(bad)


def _root_helpers() -> list[Path]:
    return sorted(p for p in PACKAGE.glob("_*.py") if p.name != "__init__.py")


def test_root_helpers_import_nothing_of_the_package():
    """The root helpers are leaves: one that imported a layer (even lazily) would make every
    layer that uses it point up at that layer."""
    helpers = _root_helpers()
    assert {"_deferred.py", "_validate.py", "_registry.py"} <= {p.name for p in helpers}
    bad = [
        f"{p.relative_to(PACKAGE.parent)}:{line} imports {mod}"
        for p in helpers
        for line, mod in _imports(p)
        if _hits(mod, ("echoloss",))
    ]
    assert not bad, "root helpers must import nothing of echoloss:\n" + "\n".join(bad)


def test_nothing_outside_the_trainer_imports_it():
    train = PACKAGE / "train"
    bad = _violations(lambda p: train not in p.parents, ("echoloss.train",))
    assert not bad, "only echoloss/train may import echoloss.train:\n" + "\n".join(bad)


def test_the_package_holds_no_experiment():
    """The experiments live beside the package (examples/research/echo_experiment): no module of
    it imports them, and none writes a docs page block."""
    bad = _violations(lambda p: True, ("echo_experiment",))
    assert not bad, "the package must not import the experiments:\n" + "\n".join(bad)
    # a generated page block is delimited by HTML comments (``<!-- ... generated by ... -->``)
    pages = [str(p.relative_to(PACKAGE.parent)) for p in _modules() if "<!--" in p.read_text()]
    assert not pages, f"modules that write page blocks: {pages}"
    gone = ("experiment", "persistence", "figures", "stats")
    assert not [m for m in gone if (PACKAGE / "train" / f"{m}.py").exists()]


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


# -- import circles ------------------------------------------------------------------------------


def _module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports. ``from pkg import sub`` points at ``pkg.sub``
    when that is a module (importing a submodule runs its package, which is no circle), else at
    ``pkg``; ``import a.b.c`` points at ``a.b.c``."""
    modules = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + [base] * bool(base))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package():
    cycles = _cycles(_module_graph())
    assert not cycles, "modules that import each other (directly or through others):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_finder_sees_lazy_and_relative_circles(tmp_path):
    pkg = tmp_path / "echoloss"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("from echoloss.data import a\n")
    (pkg / "data" / "a.py").write_text("from . import b\n")
    (pkg / "data" / "b.py").write_text("def f():\n    from echoloss.data.a import x\n")
    (pkg / "data" / "c.py").write_text("from echoloss.data import a\n")
    graph = _module_graph(pkg)
    assert graph["echoloss.data.a"] == {"echoloss.data.b"}
    assert graph["echoloss.data"] == {"echoloss.data.a"}  # a submodule, not the package itself
    assert _cycles(graph) == [["echoloss.data.a", "echoloss.data.b"]]
