import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from _interpreter_scan import install as install_log_step_scan
from hypothesis import HealthCheck, settings

# The experiments (examples/research/echo_experiment, not part of the installed package) are
# imported as ``echo_experiment``, as their ``run.py`` does; their tests in tests/research need the
# ``train`` extra and are not collected without it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "research"))
_TRAIN_EXTRA = ("transformers", "tokenizers", "matplotlib")
collect_ignore_glob = (
    [] if all(importlib.util.find_spec(m) for m in _TRAIN_EXTRA) else ["research/test_*.py"]
)

settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# CI: more examples, and derandomised so a red run reproduces locally with the same profile.
settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Under pytest-xdist (scripts/test.sh) each worker gets its share of the CPUs for torch's
# intra-op threads: the workers together use every core once, not once each.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

# The Triton interpreter's scans vectorised for every test that runs a kernel under it
# (tests/_interpreter_scan.py; a no-op without triton).
install_log_step_scan()


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    from echoloss._logging import reset_warnings

    reset_warnings()
    yield
    reset_warnings()


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests are skipped, not failed, without a CUDA device."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)
