"""The trainer reads as a recipe: the documented numbered steps are the code's, every function of
the trainer fits on a screen, ``echoloss.train`` has no import circle, and the scripts import only
public names. Read from the source (AST and text), nothing is run."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from echoloss.train import recipe

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "echoloss" / "train"

#: The longest function body (lines of code after its docstring) allowed in the trainer's
#: recipe modules, and anywhere in echoloss/train.
RECIPE_LIMIT = 40
TRAINER_LIMIT = 60
RECIPE_MODULES = ("recipe", "regimes", "probes", "metrics", "sources", "snapshots", "runtime")


def _code_steps() -> list[tuple[int, str]]:
    """``(number, function)`` of each ``name(...)  # N.`` line of `recipe.step`."""
    pairs = re.findall(r"(\w+)\(.*\)\s+# (\d+)\.", inspect.getsource(recipe.step))
    return [(int(n), name) for name, n in pairs]


def _doc_steps(text: str) -> list[tuple[int, str]]:
    """``(number, function)`` of each ``N. **Title** (`function`...`` item of the loop section."""
    section = text.split("## The loop", 1)[1].split("\n## ", 1)[0]
    return [(int(n), f) for n, f in re.findall(r"^(\d+)\. \*\*[^*]+\*\* \(`(\w+)`", section, re.M)]


def test_the_docs_number_the_steps_as_the_code_does():
    code = _code_steps()
    assert [n for n, _ in code] == list(range(1, len(code) + 1)) and len(code) >= 7, code
    assert _doc_steps((REPO / "docs" / "trainer.md").read_text()) == code
    # the recipe's own docstring lists them too
    listed = re.findall(r"^\s+(\d+)\. (\w+)", recipe.__doc__ or "", re.M)
    assert [(int(n), f) for n, f in listed] == code
    for _, name in code:
        assert name in recipe.__all__, name


def test_the_doc_check_sees_a_renumbered_step():
    doc = (REPO / "docs" / "trainer.md").read_text()
    broken = doc.replace("2. **Advantages** (`compute_advantages`)", "2. **Advantages** (`other`)")
    assert broken != doc
    assert _doc_steps(broken) != _code_steps()


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = fn.body
    doc = isinstance(body[0], ast.Expr) and isinstance(
        getattr(body[0], "value", None), ast.Constant
    )
    first = body[1] if doc and len(body) > 1 else body[0]
    return (fn.end_lineno or fn.lineno) - first.lineno + 1


def _long_functions(limit: int, modules: list[Path]) -> list[str]:
    out = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _body_lines(node)
                if n > limit:
                    out.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    return out


def test_every_recipe_function_fits_on_a_screen():
    modules = [TRAIN / f"{m}.py" for m in RECIPE_MODULES]
    assert not _long_functions(RECIPE_LIMIT, modules)


def test_no_trainer_function_is_over_the_hard_limit():
    assert not _long_functions(TRAINER_LIMIT, sorted(TRAIN.rglob("*.py")))


def _train_imports() -> dict[str, set[str]]:
    """Module -> the ``echoloss.train`` modules it imports (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(TRAIN.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d.startswith("echoloss.train")}
    known = set(graph)
    return {m: {d for d in deps if d in known and d != m} for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_trainer_has_no_import_circle():
    graph = _train_imports()
    assert "echoloss.train.recipe" in graph["echoloss.train.cli"] | graph["echoloss.train.command"]
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_circle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module, not a submodule
        return False


def test_scripts_import_only_public_names():
    """``from echoloss... import name`` in scripts/ names only what the module lists in
    ``__all__`` (or a submodule)."""
    import importlib

    bad = []
    for path in sorted((REPO / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("echoloss")
            ):
                continue
            mod = importlib.import_module(node.module or "")
            public = set(getattr(mod, "__all__", ()))
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if alias.name not in public and not _is_module(sub):
                    bad.append(f"{path.name}:{node.lineno} {sub}")
    assert not bad, bad


def test_the_trainer_checks_capabilities_by_protocol_not_by_attribute_name():
    """Optional env capabilities are protocols checked with isinstance (echoloss.train.envs.base),
    never ``hasattr`` duck typing."""
    bad = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in sorted(TRAIN.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr"
    ]
    assert not bad, bad


#: The modules that hold the whole `TrainConfig`: the config itself, the command line that loads
#: it and the recipe, whose `recipe.setup` and steps hand every other part of the trainer only
#: the values (or the config section) it reads.
CONFIG_HOLDERS = ("config", "cli", "command", "recipe")
#: Functions elsewhere in ``echoloss.train`` that still take the whole `TrainConfig`, each with
#: the reason it needs all of it.
WHOLE_CONFIG_TAKERS = {
    "metrics.banner": "prints what the run is before step 1: it reads 8 of the config's 9 "
    "sections (model, env, data, warmup, echo, optim, train and the dtype)",
}


def _config_takers(source: str, module: str) -> set[str]:
    """``module.[Class.]function`` of each function of ``source`` with a parameter annotated
    with `TrainConfig` (alone, in a union, quoted) or named ``cfg``, and ``"module: imports
    TrainConfig"`` when it imports the class (an attribute or a local holding it)."""
    found: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                if any(
                    p is not None
                    and (
                        p.arg == "cfg"
                        or (p.annotation is not None and "TrainConfig" in ast.unparse(p.annotation))
                    )
                    for p in params
                ):
                    found.add(f"{prefix}{child.name}")
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ImportFrom):
                if any(alias.name == "TrainConfig" for alias in child.names):
                    found.add(f"{module}: imports TrainConfig")
            else:
                visit(child, prefix)

    visit(ast.parse(source), f"{module}.")
    return found


def _trainer_config_takers() -> set[str]:
    found: set[str] = set()
    for path in sorted(TRAIN.rglob("*.py")):
        module = ".".join(path.relative_to(TRAIN).with_suffix("").parts)
        if module not in CONFIG_HOLDERS:
            found |= _config_takers(path.read_text(), module)
    return found


def test_the_trainer_config_stops_at_the_recipe():
    """Below `recipe.setup`, functions take plain values or one config section (`DataConfig`,
    `EchoSection`, ...), never the whole `TrainConfig`: what each part of the trainer reads is in
    its signature (a new setting reaches only the functions that are given it)."""
    allowed = set(WHOLE_CONFIG_TAKERS)
    allowed |= {f"{name.split('.')[0]}: imports TrainConfig" for name in WHOLE_CONFIG_TAKERS}
    found = _trainer_config_takers()
    assert not found - allowed, sorted(found - allowed)
    assert not set(WHOLE_CONFIG_TAKERS) - found, "stale entries in WHOLE_CONFIG_TAKERS"


def test_the_config_check_sees_every_way_of_taking_it():
    source = """
from echoloss.train.config import DataConfig, TrainConfig
def a(cfg): ...
def b(x: int, c: TrainConfig | None = None): ...
class S:
    def __init__(self, *, config: "TrainConfig") -> None: ...
    def get(self, step: int) -> None: ...
def fine(data: DataConfig, seed: int) -> None: ...
"""
    assert _config_takers(source, "m") == {"m: imports TrainConfig", "m.a", "m.b", "m.S.__init__"}
    assert _config_takers("from echoloss.train.config import DataConfig\n", "m") == set()
