"""Per-token streams, declared once (``STREAMS``): every declared stream survives interleave ->
pack -> unpack and truncation with its alignment intact. The properties loop over the table, so a
stream added to it is covered with no new test; the scratch-copy tests add one the way a
contributor would (a ``Sample`` field and a table row, a ``LossInputs`` field, a policy) and show
both that it reaches the loss and that a row which breaks the round trip fails these properties."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import normal_form_samples, trajectories

import echoloss
from echoloss import EchoConfig, RoleEcho, Sample, interleave, next_token_targets, pack, unpack
from echoloss.data.interleave import STREAMS
from echoloss.data.packing import PackedBatch, truncate_sample
from echoloss.loss import LossInputs

TESTS = Path(__file__).resolve().parents[1]


def _prompt_values(sample: Sample) -> dict:
    return {s.name: s.fill if s.prompt_value is None else s.prompt_value(sample) for s in STREAMS}


def _check_aligned(batch: PackedBatch, samples: list[Sample], prompt_values: list[dict]) -> None:
    """Token t of every segment holds token t of its sample in every stream; the targets hold
    token t + 1 at row t and the stream's fill on the last row of a segment."""
    targets = next_token_targets(batch)
    cu = batch.cu_seqlens.tolist()
    for k, idx in enumerate(batch.sample_indices):
        lo, hi = cu[k], cu[k + 1]
        for stream in STREAMS:
            packed = batch.streams[stream.packed]
            assert packed.dtype == stream.dtype and packed.shape == (len(batch),)
            expected = (
                [stream.fill] * (hi - lo)
                if idx < 0
                else stream.token_values(samples[idx], prompt_values[idx][stream.name])
            )
            want = torch.tensor(expected, dtype=stream.dtype)  # [hi - lo], as packed
            assert torch.equal(packed[lo:hi], want), stream.name
            shifted = targets.streams[stream.packed][lo:hi]
            fill = torch.tensor([stream.fill], dtype=stream.dtype)
            assert torch.equal(shifted, torch.cat([want[1:], fill])), stream.name


def _float32(sample: Sample) -> Sample:
    """``sample`` with every float stream rounded to float32, the precision packing keeps."""

    def rounded(v):
        return v if v is None else torch.tensor(v, dtype=torch.float32).item()

    changes = {
        s.name: [rounded(v) for v in getattr(sample, s.name)]
        for s in STREAMS
        if s.kind == "float" and getattr(sample, s.name) is not None
    }
    return dataclasses.replace(sample, **changes)


def test_the_table_is_consistent():
    names = [s.name for s in STREAMS]
    packed = [s.packed for s in STREAMS]
    assert len(set(names)) == len(names) and len(set(packed)) == len(packed)
    fields = {f.name for f in dataclasses.fields(Sample)}
    for stream in STREAMS:
        assert stream.name in fields
        assert stream.examples, f"{stream.name}: the strategies draw from its examples"
        assert stream.check is not None
        assert stream.check("x", list(stream.examples)) == list(stream.examples)
        assert torch.tensor([stream.fill], dtype=stream.dtype).item() == stream.fill


@given(st.lists(normal_form_samples(), min_size=1, max_size=6), st.sampled_from([None, 4]))
def test_every_stream_survives_pack_and_unpack_aligned(samples, pad):
    batches = pack(samples, max_tokens=24, pad_to_multiple_of=pad)
    values = [_prompt_values(s) for s in samples]
    recovered = {}
    for b in batches:
        _check_aligned(b, samples, values)
        recovered.update(unpack(b))
    assert [recovered[i] for i in range(len(samples))] == samples


@given(normal_form_samples(), st.integers(1, 12))
def test_every_stream_truncates_in_lockstep(sample, max_tokens):
    cut = truncate_sample(sample, max_tokens)
    values = _prompt_values(sample)  # pack reads a prompt value before truncating
    assert len(cut) == min(len(sample), max_tokens)
    for stream in STREAMS:
        full = stream.token_values(sample, values[stream.name])
        assert stream.token_values(cut, values[stream.name]) == full[: len(cut)], stream.name
    [b] = pack([sample], max_tokens=max_tokens, truncate=True)
    _check_aligned(b, [cut], [values])
    [(_, back)] = unpack(b)
    assert back == cut


@given(trajectories(), st.booleans())
def test_every_stream_survives_interleave_pack_unpack(steps, assistant):
    echo = EchoConfig(user=RoleEcho(alpha=0.5), tool=RoleEcho(alpha=1.0))
    if assistant:
        echo = EchoConfig(assistant=RoleEcho(alpha=0.25), tool=RoleEcho(alpha=1.0))
    samples = interleave(steps, echo=echo, env_name="env")
    for s in samples:
        s.advantage = 1.0
        for stream in STREAMS:
            v = getattr(s, stream.name)
            p, c = len(s.prompt_ids), len(s.completion_ids)
            assert v is None or len(v) == stream.length(p, c), stream.name
    if not samples:
        return
    batches = pack(samples, max_tokens=max(len(s) for s in samples) + 3)
    values = [_prompt_values(s) for s in samples]
    recovered = {}
    for b in batches:
        _check_aligned(b, samples, values)
        recovered.update(unpack(b))
    assert [recovered[i] for i in range(len(samples))] == [_float32(s) for s in samples]


# -- adding a stream in a scratch copy -------------------------------------------------------------

SAMPLE_FIELD = "    advantage_weights: list[float] | None = None\n"
STREAM_ROW = """    TokenStream(
        name="advantage_weights",
        packed="advantage_weights",
        kind="float",
        scope="completion",
        fill=1.0,
        optional=True,
        examples=(0.5, 1.0, 2.0),
        check=finite_float_list,{broken}
    ),
"""
LOSS_FIELD = (
    "    advantage_weights: torch.Tensor | None = "
    'field(default=None, metadata=_token("float", "rl"))\n'
)

TO_THE_LOSS = """
import torch
from echoloss import LossInputs, Sample, next_token_targets, pack
from echoloss.loss import LossConfig, PolicyOutput, echo_loss, register_policy

def weighted(inputs, config):  # REINFORCE with a per-token weight on the advantage
    w = inputs.rows["advantage_weights"]
    return PolicyOutput(-(w * inputs.advantages * inputs.logprobs), {})

register_policy("weighted", weighted, uses_ratio=False)
s = Sample(prompt_ids=[5], completion_ids=[6, 7], completion_mask=[True, True],
           completion_logprobs=[-0.1, -0.2], advantage=1.0, advantage_weights=[2.0, 0.5])
[b] = pack([s], max_tokens=4)
t = next_token_targets(b)
x = LossInputs.from_targets(t, env_names=b.env_names)
print(t.streams["advantage_weights"].tolist(), x.advantage_weights.tolist())
logits = torch.zeros(len(b), 8, requires_grad=True)  # log p = -log 8 on every row
out = echo_loss(logits, x, config=LossConfig(policy="weighted"))
print(round(out.loss.item(), 6))
"""


def _scratch_copy(tmp_path: Path, *, broken: bool) -> Path:
    """A copy of the package with one new stream: a Sample field and a STREAMS row (one file),
    a LossInputs field (one file); the policy that reads it is the third file (the script)."""
    root = tmp_path / ("broken" if broken else "ok")
    package = Path(echoloss.__file__).parent
    shutil.copytree(package, root / "echoloss", ignore=shutil.ignore_patterns("__pycache__"))
    inter = root / "echoloss" / "data" / "interleave.py"
    src = inter.read_text()
    anchor = '    env_name: str = ""\n\n    def __post_init__'
    assert src.count(anchor) == 1
    src = src.replace(anchor, SAMPLE_FIELD + anchor)
    end = "\n)\n"
    head, _, tail = src.rpartition(end)
    bad = "\n        pack_values=lambda s: [1.0] * len(s),  # forgets the sample's values"
    src = head + "\n" + STREAM_ROW.format(broken=bad if broken else "").rstrip("\n") + end + tail
    inter.write_text(src)
    inputs = root / "echoloss" / "loss" / "inputs.py"
    src = inputs.read_text()
    anchor = "    temperature: float | torch.Tensor = 1.0\n"
    inputs.write_text(src.replace(anchor, LOSS_FIELD + anchor))
    changed = sorted(
        p.relative_to(root / "echoloss").as_posix()
        for p in (root / "echoloss").rglob("*.py")
        if p.read_bytes() != (package / p.relative_to(root / "echoloss")).read_bytes()
    )
    assert changed == ["data/interleave.py", "loss/inputs.py"]
    shutil.copytree(TESTS, root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root), "HYPOTHESIS_PROFILE": "dev"}
    return subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_a_new_stream_reaches_the_loss_and_is_covered_by_the_round_trip(tmp_path):
    root = _scratch_copy(tmp_path, broken=False)
    run = _run(root, "-c", textwrap.dedent(TO_THE_LOSS))
    assert run.returncode == 0, run.stderr
    packed, loss = run.stdout.strip().splitlines()
    # rows predicting tokens 6 and 7 carry weights 2.0 and 0.5; the last row the fill 1.0
    assert packed == "[2.0, 0.5, 1.0] [2.0, 0.5, 1.0]"
    # -(2.0 + 0.5) · 1 · (-log 8) / 2 RL tokens
    assert float(loss) == pytest.approx(2.5 * torch.log(torch.tensor(8.0)).item() / 2, abs=1e-6)
    props = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/data/test_streams.py"]
    props += ["-k", "pack_and_unpack or truncates or consistent"]
    ok = _run(root, *props)
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "3 passed" in ok.stdout
    broken = _run(_scratch_copy(tmp_path, broken=True), *props)
    assert broken.returncode == 1, broken.stdout[-3000:]
    assert "test_every_stream_survives_pack_and_unpack_aligned FAILED" in broken.stdout or (
        "FAILED tests/data/test_streams.py::test_every_stream_survives_pack_and_unpack_aligned"
        in broken.stdout
    )


def test_streams_named_like_a_record_field_reach_the_loss_record():
    """``LossInputs.from_targets`` takes every packed stream named like one of its fields."""
    s = Sample(
        prompt_ids=[5, 6],
        completion_ids=[7, 8],
        completion_mask=[True, True],
        completion_logprobs=[-0.5, -0.25],
        completion_temperatures=[0.5, 0.5],
        echo_weights=[None, 0.5, None, None],
        advantage=1.0,
    )
    [b] = pack([s], max_tokens=4)
    t = next_token_targets(b)
    x = LossInputs.from_targets(t, env_names=b.env_names)
    taken = [st.packed for st in STREAMS if st.packed in LossInputs.field_names()]
    # every stream the record has a field for (the table's, not a list here), the two the loss
    # cannot run without among them
    assert {"rl_mask", "echo_weights"} <= set(taken)
    for name in taken:
        assert torch.equal(getattr(x, name), t.streams[name]), name
    assert torch.equal(x.temperature, t.streams["temperatures"])  # the record's singular name
