"""The documentation site builds with ``mkdocs build --strict`` (broken links between pages,
missing pages, docstring rendering errors all fail it), renders what it promises (pydantic
fields with types and defaults, cross-references, formulas with MathJax served from the site), and
every Python example in the docs runs."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tokenize
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


#: An illustrative fragment that cannot run as written (a signature, a trainer that downloads a
#: model, code that lives inside another framework) says so on the line before its fence:
#: ``<!-- skip-example: why -->``. Every other ```python block runs as written, on its own.
SKIP_MARK = "<!-- skip-example:"
_FENCE = re.compile(
    r"^(?:<!-- skip-example: (?P<reason>[^\n]*?) -->\n)?```python[^\n]*\n(?P<code>.*?)^```",
    flags=re.DOTALL | re.MULTILINE,
)
PAGES = sorted([*DOCS.rglob("*.md"), ROOT / "README.md"])


def _examples():
    for page in PAGES:
        text = page.read_text()
        for m in _FENCE.finditer(text):
            line = text[: m.start()].count("\n") + 1 + (m.group("reason") is not None)
            rel = page.relative_to(ROOT).as_posix()
            yield pytest.param(m.group("code"), m.group("reason"), id=f"{rel}:{line}")


def test_every_skip_marker_has_a_reason_and_a_python_block():
    for page in PAGES:
        text = page.read_text()
        marked = [m for m in _FENCE.finditer(text) if m.group("reason") is not None]
        assert text.count(SKIP_MARK) == len(marked), f"{page}: a skip marker not before ```python"
        assert all(m.group("reason").strip() for m in marked), f"{page}: a skip marker without why"


@pytest.mark.parametrize(("code", "skip_reason"), list(_examples()))
def test_documented_example_runs(code, skip_reason, tmp_path):
    """Every ```python block of the docs and the README, executed on its own in a fresh
    interpreter (a reader copies one block, not the page)."""
    if skip_reason is not None:
        pytest.skip(f"illustrative: {skip_reason}")
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,  # the TRL guide trains a real model for two steps: 4 min on 2 busy cores
    )
    assert res.returncode == 0, res.stderr[-3000:]


def test_docstrings_use_cross_references_not_sphinx_roles():
    """API pages link with mkdocstrings/autorefs (``[`pack`][echoloss.data.packing.pack]``);
    a Sphinx role (``:func:`pack```) would render as literal text."""
    role = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`")
    found = []
    for path in sorted((ROOT / "echoloss").rglob("*.py")):
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in tokens:
            if tok.type == tokenize.STRING and role.search(tok.string):
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]}")
    assert found == [], "write [`name`][echoloss.module.name] instead of :role:`name`"


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    pytest.importorskip("griffe_pydantic")
    pytest.importorskip("mathjax")  # django-static-mathjax
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
    api_loss = (site / "api/loss/index.html").read_text()
    api_data = (site / "api/data/index.html").read_text()
    # The API pages are generated from the docstrings (not empty shells).
    assert "echo_loss_from_logprobs" in api_loss
    # pydantic fields with their real types and defaults (griffe-pydantic), e.g. an optional
    # field shows its default None rather than "required".
    field = re.compile(r"tool_names.{0,400}?None", flags=re.DOTALL)
    assert 'id="echoloss.data.echo_config.RoleEcho.tool_names"' in api_data
    assert field.search(api_data.split('id="echoloss.data.echo_config.RoleEcho.tool_names"')[1])
    assert 'id="echoloss.loss.config.LossConfig.kl_tau"' in api_loss
    # ... and no field of a pydantic model is listed as a "required" parameter of its __init__
    role_echo = api_data.split('id="echoloss.data.echo_config.RoleEcho"')[1]
    role_echo = role_echo.split('id="echoloss.data.echo_config.EchoFilter"')[0]
    assert "frozenset" in role_echo and "required</em>" not in role_echo
    # Docstring cross-references are resolved links, and no Sphinx role survives as text.
    assert api_loss.count("autorefs-internal") > 10
    roles = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):(?:<code>|`)")
    assert [p for p in site.rglob("*.html") if roles.search(p.read_text())] == []
    # Formulas: arithmatex markup, typeset by MathJax served from the site itself (no CDN).
    assert (site / "assets/mathjax/tex-svg.js").is_file()
    loss_page = (site / "loss/index.html").read_text()
    assert '<div class="arithmatex">' in loss_page
    assert re.search(r'<script src="[./]*assets/mathjax/tex-svg.js"', loss_page)
    external = re.compile(r'<script[^>]+src="(?:https?:)?//', flags=re.IGNORECASE)
    assert [p for p in site.rglob("*.html") if external.search(p.read_text())] == []
