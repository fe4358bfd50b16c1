"""The API reference is complete and true: the top-level table names every public name of
``echoloss`` with the module that defines it, and every library subpackage has a page in the nav."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import echoloss

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"


def _table_rows() -> list[tuple[list[str], str]]:
    rows = []
    for line in (API / "echoloss.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[1].startswith("`echoloss"):
            continue
        rows.append((re.findall(r"`([A-Za-z_]\w*)`", cells[0]), cells[1].strip("`")))
    return rows


def test_the_top_level_table_names_every_public_name_once():
    named = [n for names, _ in _table_rows() for n in names]
    assert len(named) == len(set(named)), "a name is listed twice"
    assert set(named) == set(echoloss.__all__) - {"__version__"}


def test_the_top_level_table_gives_the_defining_module():
    for names, module in _table_rows():
        for name in names:
            assert getattr(echoloss, name).__module__ == module, name


def test_every_library_subpackage_has_an_api_page_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    packages = sorted(
        p.name
        for p in (ROOT / "echoloss").iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and p.name != "train"
    )
    assert "nn" in packages
    for name in packages:
        assert (API / f"{name}.md").exists(), name
        assert f"api/{name}.md" in nav, name


def test_every_api_directive_names_an_importable_object():
    for page in API.glob("*.md"):
        for target in re.findall(r"^::: (\S+)", page.read_text(), flags=re.M):
            parts = target.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
                break
            else:
                raise AssertionError(f"{page.name}: {target} does not import")
