"""MkDocs hook: serve MathJax from the site itself, so that formulas render offline.

``pymdownx.arithmatex`` marks formulas (``$$ ... $$``, ``$ ... $``) for MathJax; the MathJax
files come from the ``django-static-mathjax`` package (MathJax 3, Apache-2.0; in the ``docs``
extra) and are copied to ``assets/mathjax/`` of the built site: no CDN, no network."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

#: What ``tex-svg.js`` loads: the combined component (SVG output: glyphs are paths, no web fonts
#: to fetch, so formulas look the same offline and in print), and the pieces it fetches
#: on demand (TeX extensions, the contextual menu, assistive MathML).
_PARTS = ("tex-svg.js", "input/tex", "ui", "a11y")


def _mathjax_es5() -> Path:
    try:
        import mathjax  # django-static-mathjax
    except ImportError as err:
        raise PluginError(
            "the docs typeset formulas with MathJax served from the site: "
            "pip install 'echoloss[docs]' (from a clone: pip install -e '.[docs]')"
        ) from err
    root = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
    if not (root / "tex-svg.js").is_file():
        raise PluginError(f"MathJax not found at {root}: reinstall django-static-mathjax")
    return root


def on_post_build(config: Any) -> None:
    src = _mathjax_es5()
    dst = Path(config["site_dir"]) / "assets" / "mathjax"
    for part in _PARTS:
        if (src / part).is_dir():
            shutil.copytree(src / part, dst / part, dirs_exist_ok=True)
        else:
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / part, dst / part)
