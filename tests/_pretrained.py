"""The packaged pretrained models for tests: materialised once per machine (cached), skipped
only where their packages cannot be installed; under CI (``CI=true``, where ``scripts/install.sh
dev`` installs them) a missing package fails instead."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest


def _need(name: str, *, tokenizer_only: bool = False) -> Path:
    from echoloss._optional import MissingExtraError
    from echoloss.pretrained import materialize

    try:
        return materialize(name, tokenizer_only=tokenizer_only)
    except MissingExtraError as err:
        if os.environ.get("CI"):
            raise  # scripts/install.sh dev installs them: missing in CI is a broken install
        pytest.skip(f"packaged model not installed: {err}")


@functools.cache
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (fp32 weights)."""
    return _need("smollm2-135m-instruct")


@functools.cache
def smollm2_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())


@functools.cache
def gemma3_tokenizer() -> Any:
    """Gemma 3 270M's SentencePiece tokenizer (the base model has no chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_need("gemma3-270m", tokenizer_only=True))


def fastest_dtype() -> Any:
    """bf16 where this CPU computes it natively, else fp32 (emulated bf16 is ~24x slower):
    what ``model.dtype = "fastest"`` picks on CPU."""
    import torch

    from echoloss.train.runtime import cpu_computes_bf16_natively

    return torch.bfloat16 if cpu_computes_bf16_natively() else torch.float32


@functools.cache
def smollm2_fastest() -> tuple[Any, Any]:
    """The model in `fastest_dtype` and its tokenizer; shared by the tests that only run it
    (never train it in place)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), dtype=fastest_dtype())
    return model.eval(), smollm2_tokenizer()
