"""MkDocs hooks.

Links from a page to files outside ``docs/`` (``../echoloss/train/recipe.py``,
``../configs/gpu.toml``) work on GitHub but are not pages of the site. They become links to the
repository (``extra.source_url`` + path) when that is set, else the path as inline code, so that
``mkdocs build --strict`` passes without weakening its check of links between pages.
Cross-references in docstrings are mkdocstrings/autorefs links (``[`pack`][echoloss.pack]``)."""

from __future__ import annotations

import logging
import posixpath
import re
from typing import Any

#: griffe warnings about docstrings that group several argument names on lines of their own
#: ("rl_mask, echo_weights, ...,\n    ref_logprobs, ...: as in echo_loss"): a line that is only
#: comma-separated names. The text renders fine; the grouping is the docstrings' choice.
#: Anything else still fails a strict build.
_KNOWN_GRIFFE = re.compile(r"Failed to get 'name: description' pair from '(\w+, )+\w*,?'")


class _DropKnown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _KNOWN_GRIFFE.search(record.getMessage())


def on_config(config: Any) -> Any:
    for h in logging.getLogger("mkdocs").handlers:
        if not any(isinstance(f, _DropKnown) for f in h.filters):
            h.addFilter(_DropKnown())
    return config


_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    src_dir = posixpath.dirname(page.file.src_uri)
    base = (config.get("extra") or {}).get("source_url")

    def repl(m: re.Match[str]) -> str:
        text, target, anchor = m.group(1), m.group(2), m.group(3) or ""
        path = posixpath.normpath(posixpath.join("docs", src_dir, target))
        if not path.startswith("..") and path.startswith("docs/"):
            return m.group(0)  # a page or asset of the site: mkdocs checks it
        if base:
            return f"[{text}]({base.rstrip('/')}/{path}{anchor})"
        return text if text.strip("`") == path else f"{text} (`{path}`)"

    return _LINK.sub(repl, markdown)
