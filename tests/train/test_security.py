"""Files and configs from others never run code: pickle gadgets in checkpoints are refused before
they execute, and a config names code by import path only with an explicit opt-in."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import shutil
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_helpers import FAST, fast_config

from echoloss.train import checkpoint as ckpt
from echoloss.train.cli import main
from echoloss.train.command import _overrides, _parser
from echoloss.train.config import ConfigError, advantage_fn, load_config, parse_config
from echoloss.train.recipe import train


class Gadget:
    """A pickle gadget: unpickling it calls ``Path(marker).touch()`` (any callable would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = Path(marker)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def _rewrite_manifest(step: Path) -> None:
    """What a competent attacker does: the manifest's checksums match the swapped file."""
    manifest = json.loads((step / ckpt.MANIFEST).read_text())
    for rel in manifest["files"]:
        data = (step / rel).read_bytes()
        manifest["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / ckpt.MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run with one checkpoint (keep_checkpoints = 1: no older one to fall back to)."""
    out = tmp_path_factory.mktemp("run")
    over = {"train.max_steps": 1, "train.keep_checkpoints": 1, "train.plots": False}
    train(fast_config(out, **over), log=lambda _: None)
    return out


def test_the_gadget_is_live(tmp_path):
    """The payload below really runs code when unpickled without restriction (so the refusals
    in the other tests are what keeps the marker from being written)."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(Gadget(marker)))  # the point of the test: unrestricted pickle
    assert marker.exists()


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "rng.pt"])
@pytest.mark.parametrize("form", ["torch.save", "raw pickle"])
def test_a_pickle_gadget_in_any_tensor_file_is_refused(run, tmp_path, capsys, name, form):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    [step] = sorted((out / "checkpoints").glob("step_*"))
    marker = tmp_path / "pwned"
    if form == "torch.save":
        torch.save({"state": Gadget(marker), "w": torch.zeros(2)}, step / name)
    else:
        (step / name).write_bytes(pickle.dumps({"state": Gadget(marker)}, protocol=2))
    _rewrite_manifest(step)
    assert ckpt.verify_checkpoint(step) is None  # the checksums do not catch it: the loader must
    with pytest.raises(ckpt.CheckpointError, match=rf"refused to load .*{name}"):
        ckpt.load_tensors(step / name)
    assert main(["--config", str(FAST), "--output-dir", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "refused to load" in err and name in err and "weights_only=True" in err, err
    assert not marker.exists()


@pytest.mark.parametrize("name", ["state.json", ckpt.MANIFEST])
def test_a_pickle_gadget_in_a_json_file_is_refused(run, tmp_path, capsys, name):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    [step] = sorted((out / "checkpoints").glob("step_*"))
    marker = tmp_path / "pwned"
    (step / name).write_bytes(pickle.dumps(Gadget(marker)))
    if name != ckpt.MANIFEST:
        _rewrite_manifest(step)
    with pytest.warns(ckpt.ResumeWarning, match=name) if name == ckpt.MANIFEST else nullcontext():
        assert main(["--config", str(FAST), "--output-dir", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    expected = "not valid JSON" if name == "state.json" else "no complete checkpoint"
    assert expected in err, err
    assert not marker.exists()


def test_checkpoints_hold_only_tensors_and_plain_data(run):
    """Every file of a checkpoint loads with the restricted unpickler, and the RNG state
    round-trips through it exactly."""
    [step] = sorted((run / "checkpoints").glob("step_*"))
    for f in ("model.pt", "optimizer.pt", "rng.pt"):
        torch.load(step / f, weights_only=True)  # raises on anything but tensors and containers
    state = ckpt.capture_rng()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    ckpt.restore_rng(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


# ------------------------------------------------------------------------------------------------
# Code named in a configuration


@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """A module whose import writes a marker file (as a module named by a hostile config would
    run its top level), on sys.path."""
    marker = tmp_path / "imported"
    (tmp_path / "evil_adv.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "def fn(rewards, **kw):\n    return [0.0 for _ in rewards]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("evil_adv", None)


@pytest.mark.parametrize("spec", ["evil_adv:fn", "evil_adv.fn", "pydoc:pipepager"])
def test_an_import_path_in_a_config_is_refused_without_opt_in(evil_module, spec):
    data = {"advantages": {"fn": spec, "kwargs": {"cmd": "touch /tmp/never"}}}
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    msg = str(err.value)
    assert "advantages.fn" in msg and "allow_import_paths = true" in msg, msg
    assert "--allow-import-paths" in msg and "grpo" in msg, msg
    assert not evil_module.exists() and "evil_adv" not in sys.modules


def test_the_opt_in_imports_and_uses_the_named_function(evil_module, tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[advantages]\nfn = "evil_adv:fn"\n[train]\nallow_import_paths = true\n')
    cfg = load_config(toml)
    assert evil_module.exists()  # imported at validation: a bad path fails before any work
    assert advantage_fn(cfg)([1.0, 2.0]) == [0.0, 0.0]
    # The command-line flag is the same opt-in.
    args = _parser().parse_args(["--allow-import-paths", "--set", "advantages.fn=evil_adv:fn"])
    assert load_config(None, _overrides(args)).train.allow_import_paths


def test_registered_names_need_no_opt_in_and_misspellings_are_named_before_any_work():
    assert advantage_fn(parse_config({"advantages": {"fn": "rloo"}})) == "rloo"
    with pytest.raises(ConfigError, match=r"advantages\.fn: unknown advantage fn 'grop'.*grpo"):
        parse_config({"advantages": {"fn": "grop"}})


def test_a_config_built_in_python_cannot_bypass_the_opt_in():
    from echoloss.train.config import AdvantageConfig, TrainConfig

    with pytest.raises(ValueError, match="allow_import_paths"):
        TrainConfig(advantages=AdvantageConfig(fn="evil_adv:fn"))
