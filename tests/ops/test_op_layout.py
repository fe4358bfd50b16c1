"""Every op folder has one shape: the op in ``op.py``, the unchunked gold in ``naive.py``, an
``__init__`` that only re-exports, and no PyTorch reference that imports triton."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[2] / "echoloss" / "ops"
FOLDERS = sorted(p for p in OPS.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_every_op_folder_is_found():
    assert {p.name for p in FOLDERS} == {
        "fused_linear",
        "row_algebra",
        "selective_logprobs",
        "value_checks",
    }


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_op_and_gold_modules(folder):
    assert (folder / "op.py").exists(), f"{folder.name}: the op belongs in op.py"
    assert (folder / "naive.py").exists(), f"{folder.name}: the unchunked gold belongs in naive.py"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_init_only_reexports(folder):
    tree = ast.parse((folder / "__init__.py").read_text())
    for node in tree.body:
        is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        is_all = isinstance(node, ast.Assign) and [
            t.id for t in node.targets if isinstance(t, ast.Name)
        ] == ["__all__"]
        assert is_doc or is_all or isinstance(node, ast.ImportFrom), (
            f"{folder.name}/__init__.py line {node.lineno}: only imports, __all__ and the "
            "docstring belong here; put code in op.py"
        )


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_references_never_import_triton(folder):
    for name in ("op.py", "naive.py", "reference.py", "__init__.py"):
        path = folder / name
        if path.exists():
            assert not any(m.split(".")[0] == "triton" for m in _imported_modules(path)), (
                f"{folder.name}/{name} imports triton: only fused.py may"
            )
