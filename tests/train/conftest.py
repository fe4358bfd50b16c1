"""The trainer tests need the ``train`` extra (transformers, tokenizers, matplotlib); without it
they are not collected."""

import importlib.util

_EXTRA = ("transformers", "tokenizers", "matplotlib")
collect_ignore_glob = [] if all(importlib.util.find_spec(m) for m in _EXTRA) else ["test_*.py"]
