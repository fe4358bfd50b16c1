"""The documentation site builds with ``mkdocs build --strict`` (broken links between pages,
missing pages, docstring rendering errors all fail it), and the getting-started example runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _nav_files(text: str) -> list[str]:
    return re.findall(r":\s*([\w./-]+\.md)\s*$", text, flags=re.MULTILINE)


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_files((ROOT / "mkdocs.yml").read_text())
    assert nav, "mkdocs.yml has no nav"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert sorted(set(nav) - pages) == [], "nav entries without a page"
    assert sorted(pages - set(nav)) == [], "pages missing from the nav"


def test_getting_started_example_runs():
    """The ten-line example of docs/getting-started.md, executed as written."""
    text = (DOCS / "getting-started.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    example = next(b for b in blocks if "import echoloss" in b)
    exec(compile(example, "getting-started.md", "exec"), {})


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    site = tmp_path / "site"
    for page in ("index.html", "benchmarks/index.html", "api/loss/index.html"):
        assert (site / page).is_file(), page
    # The API pages are generated from the docstrings (not empty shells).
    assert "echo_loss_from_logprobs" in (site / "api/loss/index.html").read_text()
