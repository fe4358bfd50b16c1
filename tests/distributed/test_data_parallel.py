"""§12 #14: two real ranks (torchrun, gloo) with unequal token counts give the gradient of one
process on the whole batch, with global normalisers and the DDP averaging undone; per-rank
denominators do not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dp_worker import CONFIGS, SEQ_LENS, global_batch, loss_of, make_model, micro_batch

WORKER = Path(__file__).with_name("_dp_worker.py")


@pytest.fixture(scope="module")
def two_rank_grads(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return torch.load(out / "grads.pt")


def _single_process(config):
    batch = global_batch()
    whole = micro_batch(batch, list(range(len(SEQ_LENS))))
    model = make_model()
    loss_of(model, whole, config, None).backward()  # normalizers=None: this call is the batch
    return [p.grad for p in model.parameters()]


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_match_one_process(two_rank_grads, name):
    want = _single_process(CONFIGS[name])
    got = two_rank_grads[name]["global"]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
    # The bug it guards against: per-rank denominators + DDP averaging give another gradient.
    buggy = two_rank_grads[name]["per_rank"]
    rel = max(float((b - w).norm() / w.norm()) for b, w in zip(buggy, want, strict=True))
    assert rel > 1e-2
