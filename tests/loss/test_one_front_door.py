"""One currency for the loss: every entry point takes the `LossInputs` record; the keyword form is
the record's field table by name, so a new field of the record needs no edit to any entry point.

The scratch-copy test makes that change the way a contributor would (one field added to
``echoloss/loss/inputs.py`` of a copy of the package, nothing else) and runs every entry point and
a policy reading the new field."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import echoloss
from echoloss.loss import (
    LossConfig,
    LossInputs,
    count_normalizers,
    echo_loss,
    echo_loss_from_hidden,
    echo_loss_from_logprobs,
)
from echoloss.loss.policy import PolicyInputs, PolicyOutput, RecordRows

F64 = torch.float64
ENTRY_POINTS = [echo_loss, echo_loss_from_logprobs, echo_loss_from_hidden, count_normalizers]


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda f: f.__name__)
def test_no_entry_point_spells_a_record_field(fn):
    """The keyword form is ``**fields``: no parameter of an entry point repeats a record field."""
    params = inspect.signature(fn).parameters
    assert not set(params) & set(LossInputs.field_names()) - {"inputs"}
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _pair():
    lp = torch.tensor([-0.5, -1.0, -2.0], dtype=F64, requires_grad=True)
    fields = {
        "rl_mask": torch.tensor([True, False, True]),
        "echo_weights": torch.tensor([0.0, 0.5, 0.0], dtype=F64),
        "advantages": torch.tensor([1.0, 0.0, -2.0], dtype=F64),
        "observation_mask": torch.tensor([False, True, False]),
        "sequence_ids": torch.tensor([0, 0, 1]),
    }
    return lp, fields


def test_keyword_form_is_the_record():
    """Both forms give the same loss and gradient (reinforce: hand-computed value)."""
    lp, fields = _pair()
    cfg = LossConfig(policy="reinforce", echo_normalization="sequence_mean")
    kw = echo_loss_from_logprobs(lp, config=cfg, **fields).loss
    (g_kw,) = torch.autograd.grad(kw, lp)
    rec = echo_loss_from_logprobs(lp, LossInputs(**fields), config=cfg).loss
    (g_rec,) = torch.autograd.grad(rec, lp)
    # RL: -(1·-0.5 + -2·-2.0) / 2 = -1.75; echo: 0.5·1.0 / |O_0| = 0.5 over 1 sequence
    assert kw.item() == rec.item() == pytest.approx(-1.75 + 0.5, rel=1e-15)
    assert torch.equal(g_kw, g_rec)


def test_observation_mask_reaches_the_loss_in_both_forms():
    """``observation_mask`` sets ``Z_i = |O_i|``: dropping it changes the loss (or raises)."""
    lp, fields = _pair()
    fields["observation_mask"] = torch.tensor([True, True, False])  # |O_0| = 2
    cfg = LossConfig(policy="reinforce", echo_normalization="sequence_mean")
    out = echo_loss_from_logprobs(lp, LossInputs(**fields), config=cfg).loss
    assert out.item() == pytest.approx(-1.75 + 0.5 * 1.0 / 2, rel=1e-15)
    del fields["observation_mask"]
    with pytest.raises(ValueError, match="observation_mask is required"):
        echo_loss_from_logprobs(lp, config=cfg, **fields)


def test_unknown_keyword_names_the_record_fields():
    lp, fields = _pair()
    with pytest.raises(TypeError, match=r"rl_masks.*a LossInputs field \(rl_mask, echo_weights"):
        echo_loss_from_logprobs(lp, rl_masks=fields["rl_mask"])
    with pytest.raises(TypeError, match="absent when a LossInputs record is given"):
        echo_loss_from_logprobs(lp, LossInputs(**fields), advantages=fields["advantages"])


def test_count_normalizers_counts_as_the_loss_does():
    """``count_normalizers(record)`` equals the loss's own local counts: giving them as
    ``normalizers`` changes nothing, for every normalisation mode."""
    lp, fields = _pair()
    x = LossInputs(**fields)
    assert count_normalizers(x) == count_normalizers(**fields)
    for rl_norm in ("token_mean", "sequence_mean_token_mean", "sequence_mean_token_sum"):
        for echo_norm in ("token_mean", "sequence_mean", "batch_token_mean"):
            cfg = LossConfig(
                policy="reinforce", rl_normalization=rl_norm, echo_normalization=echo_norm
            )
            alone = echo_loss_from_logprobs(lp, x, config=cfg).loss
            given = echo_loss_from_logprobs(lp, x, config=cfg, normalizers=count_normalizers(x))
            assert alone.item() == given.loss.item()


def test_policy_reads_any_record_field_on_the_rl_rows():
    x = LossInputs(
        rl_mask=torch.tensor([True, False, True]),
        advantages=torch.tensor([1.0, 0.0, 3.0]),
        old_logprobs=torch.tensor([-0.1, 0.0, -0.3]),
    )
    rows = RecordRows(x, torch.tensor([0, 2]))
    assert rows["old_logprobs"].tolist() == pytest.approx([-0.1, -0.3])
    assert set(rows) == {"rl_mask", "advantages", "old_logprobs"}
    with pytest.raises(KeyError, match="'ref_logprobs' is not a per-token field given"):
        rows["ref_logprobs"]
    seen = {}

    def spy(inputs: PolicyInputs, config) -> PolicyOutput:
        seen["old"] = inputs.rows["old_logprobs"]
        return PolicyOutput(-inputs.advantages * inputs.logprobs, {})

    lp = torch.tensor([-0.5, -1.0, -2.0])
    echo_loss_from_logprobs(lp, x, config=LossConfig(policy="custom"), policy_fn=spy)
    assert seen["old"].tolist() == pytest.approx([-0.1, -0.3])


NEW_FIELD = """
    token_scale: torch.Tensor | None = field(default=None, metadata=_token("float", "rl"))
"""

SCRIPT = """
import torch
from echoloss.loss import (LossConfig, LossInputs, PolicyOutput, count_normalizers, echo_loss,
                           echo_loss_from_hidden, echo_loss_from_logprobs, register_policy)

def scaled(inputs, config):  # reads the new field on the RL rows
    return PolicyOutput(-inputs.rows["token_scale"] * inputs.advantages * inputs.logprobs, {})

register_policy("scaled", scaled, uses_ratio=False)
cfg = LossConfig(policy="scaled")
fields = dict(rl_mask=torch.tensor([True, True]), advantages=torch.tensor([1.0, 1.0]),
              labels=torch.tensor([0, 0]), token_scale=torch.tensor([2.0, 4.0]))
lp = torch.tensor([-0.5, -0.25])
logits = torch.stack([lp, torch.log(-torch.expm1(lp))], 1)  # log_softmax(logits)[:, 0] == lp
losses = [
    echo_loss_from_logprobs(lp, config=cfg, **fields).loss,
    echo_loss_from_logprobs(lp, LossInputs(**fields), config=cfg).loss,
    echo_loss(logits, config=cfg, **fields).loss,
    echo_loss(logits, LossInputs(**fields), config=cfg).loss,
    echo_loss_from_hidden(logits, torch.eye(2), config=cfg, backend="reference", **fields).loss,
]
print(" ".join(f"{v.item():.6f}" for v in losses))
try:
    LossInputs(rl_mask=torch.tensor([True]), token_scale=torch.tensor([float("nan")]))
except ValueError as e:
    print("checked:", e)
print(count_normalizers(**fields).rl_tokens)
"""


def test_a_new_record_field_needs_no_entry_point_edit(tmp_path: Path):
    """Add one field to ``LossInputs`` in a scratch copy (its field table only): every entry point
    accepts it in both forms, validates it and hands it to a policy."""
    package = Path(echoloss.__file__).parent
    copy = tmp_path / "echoloss"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    inputs_py = copy / "loss" / "inputs.py"
    source = inputs_py.read_text()
    anchor = "    temperature: float | torch.Tensor = 1.0\n"
    assert source.count(anchor) == 1
    inputs_py.write_text(source.replace(anchor, NEW_FIELD.lstrip("\n") + anchor))
    changed = [
        p.relative_to(copy).as_posix()
        for p in copy.rglob("*.py")
        if p.read_bytes() != (package / p.relative_to(copy)).read_bytes()
    ]
    assert changed == ["loss/inputs.py"]
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    losses, checked, rl_tokens = run.stdout.strip().splitlines()
    # -(2·1·-0.5 + 4·1·-0.25) / 2 RL tokens = 1.0, the same in every entry point and form
    assert losses.split() == ["1.000000"] * 5
    assert checked.startswith("checked: token_scale must be finite")
    assert rl_tokens == "2"
