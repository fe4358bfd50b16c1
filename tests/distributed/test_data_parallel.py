"""docs/spec.md F14: two real ranks (torchrun, gloo) with unequal token counts give the gradient of one
process on the whole batch, with global normalisers and the DDP averaging undone; per-rank
denominators do not."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dp_worker import CONFIGS, SEQ_LENS, global_batch, loss_of, make_model, micro_batch

WORKER = Path(__file__).with_name("_dp_worker.py")


def _torchrun(out: Path, timeout: float) -> tuple[int | None, str]:
    """Run the two workers in their own process group; on timeout kill the whole group."""
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
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both workers: no orphans
        output, _ = proc.communicate()
        return None, output


@pytest.fixture(scope="module")
def two_rank_grads(tmp_path_factory):
    # One retry: on a shared, overloaded machine the rendezvous port can be taken between the
    # agent choosing it and the workers connecting, which times out rather than fails.
    log = []
    for attempt in range(2):
        out = tmp_path_factory.mktemp(f"dp{attempt}")
        rc, output = _torchrun(out, timeout=120)
        log.append(f"attempt {attempt}: rc={rc}\n{output[-3000:]}")
        if rc == 0:
            return torch.load(out / "grads.pt")
    pytest.fail("torchrun failed twice:\n" + "\n".join(log))


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
