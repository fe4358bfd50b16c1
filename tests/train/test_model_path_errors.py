"""Every model-load failure of ``echoloss-train`` is one line on stderr and exit 2, naming the
path and the problem (a truncated ``.gguf`` was a ``struct.error`` traceback; a ``config.json``
of ``{}`` said "install sentencepiece")."""

from __future__ import annotations

import json

import pytest

from echoloss.train.command import run
from echoloss.train.model import ModelLoadError, load_model

FAST = "configs/fast.toml"


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


#: (name, files relative to the model path, the model path's name, what stderr says)
CASES = [
    ("config {}", {"m/config.json": "{}"}, "m", r"config.json' has no model_type \(got \[\]\)"),
    ("config []", {"m/config.json": "[]"}, "m", r"has no model_type \(got 'list'\)"),
    ("config not JSON", {"m/config.json": "{bad"}, "m", r"cannot read .*JSONDecodeError"),
    (
        "config only",
        {"m/config.json": json.dumps({"model_type": "qwen2"})},
        "m",
        r"has a config.json but no tokenizer and no weights files",
    ),
    (
        "no weights",
        {"m/config.json": json.dumps({"model_type": "qwen2"}), "m/tokenizer.json": "{}"},
        "m",
        r"has a config.json but no weights files",
    ),
    (
        "broken weights",
        {
            "m/config.json": json.dumps({"model_type": "qwen2"}),
            "m/tokenizer.json": "{}",
            "m/model.safetensors": b"\x00" * 16,
        },
        "m",
        r"cannot load '.*m': \w[\w.]*: .*check that it is a complete",
    ),
    ("truncated gguf", {"x.gguf": b"GGUF\x03\x00\x00\x00"}, "x.gguf", r"struct.error: unpack"),
    ("not gguf", {"x.gguf": b"\x00" * 64}, "x.gguf", r"cannot load '.*x.gguf': ValueError"),
    ("empty gguf", {"x.gguf": b""}, "x.gguf", r"cannot load '.*x.gguf'"),
]


@pytest.mark.parametrize(
    ("files", "name", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_model_load_failures_are_one_line_and_exit_2(tmp_path, capsys, files, name, match):
    for rel, content in files.items():
        _write(tmp_path / rel, content)
    out = tmp_path / "out"
    code = run(
        ["--config", FAST, "--output-dir", str(out), "--set", f"model.path={tmp_path / name}"]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("echoloss-train: model.path: "), err
    assert str(tmp_path / name) in err
    import re

    assert re.search(match, err), err
    assert not out.exists()  # the failed start left nothing behind


def test_load_model_raises_model_load_error_naming_the_file(tmp_path):
    gguf = _write(tmp_path / "x.gguf", b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelLoadError, match=r"x.gguf': struct.error"):
        load_model(gguf, dtype=None, attn_implementation="sdpa")  # type: ignore[arg-type]
    assert issubclass(ModelLoadError, ValueError)  # callers that caught ValueError still do
