"""Two ranks under ``torchrun --nproc_per_node=2`` (gloo, FSDP2) make the same update as one rank
on the same global batch."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from _train_helpers import FAST, fast_config, rollout_jsonl

from echoloss.train.plots import read_metrics
from echoloss.train.recipe import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_two_ranks_equal_one_rank(tmp_path):
    data = rollout_jsonl(tmp_path)
    over = {
        "data.source": "jsonl",
        "data.path": str(data),
        "warmup.steps": 0,
        "train.max_steps": 2,
        "train.plots": False,
        "optim.micro_batch_tokens": 256,  # several micro-batches, unequal across ranks
    }
    one = train(fast_config(tmp_path / "one", **over), log=lambda _: None)
    torchrun = shutil.which("torchrun") or f"{sys.executable} -m torch.distributed.run"
    cmd = [*torchrun.split(), "--standalone", "--nproc_per_node=2", "-m", "echoloss.train.cli"]
    cmd += ["--config", str(FAST), "--output-dir", str(tmp_path / "two")]
    for k, v in over.items():
        cmd += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A generous limit: two processes on a loaded two-core machine may take several times the
    # ~40 s of an idle one, and the test is about equality, not speed.
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    a = read_metrics(one / "metrics.jsonl")
    b = read_metrics(tmp_path / "two" / "metrics.jsonl")
    for ra, rb in zip(a, b, strict=True):
        assert ra["rl_tokens"] == rb["rl_tokens"] and ra["echo_tokens"] == rb["echo_tokens"]
        assert ra["tokens"] == rb["tokens"]  # the ranks' dummy micro-batches count no token
        assert ra["sequences"] == rb["sequences"]
        for key in ("loss", "loss_rl", "loss_echo", "grad_norm", "advantage_abs"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    wa = torch.load(one / "checkpoints" / "step_000002" / "model.pt", weights_only=True)
    wb = torch.load(
        tmp_path / "two" / "checkpoints" / "step_000002" / "model.pt", weights_only=True
    )
    assert set(wa) == set(wb)
    # The gradients agree to float summation order (the losses and gradient norms above, to
    # 1e-5). AdamW's first steps are ~lr·g/(|g| + eps): on a coordinate whose gradient is near
    # eps, a 1e-9 difference moves the update by a visible fraction of lr, so the weights are
    # compared to 0.5% of lr (lr = 1e-2 in the fast config).
    lr = fast_config(tmp_path).optim.lr
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=5e-3 * lr, msg=k)
