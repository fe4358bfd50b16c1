"""``scripts/python.sh``: which Python the README's two commands install into and run with.

``$PYTHON`` first, then the active virtual environment, then the project ``.venv`` (created on
first use, from a Python ≥ 3.10, announced on stderr)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _select(env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Source scripts/python.sh in a clean environment; print the chosen interpreter."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        ["bash", "-c", f'source "{ROOT}/scripts/python.sh" && echo "PY=$PY"'],
        cwd=cwd,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _chosen(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1].removeprefix("PY=")


def test_python_variable_wins():
    res = _select({"PYTHON": sys.executable, "VIRTUAL_ENV": "/nonexistent"})
    assert _chosen(res) == sys.executable
    assert "using $PYTHON" in res.stderr


def test_active_virtual_environment_is_used(tmp_path):
    venv = tmp_path / "active"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    res = _select({"VIRTUAL_ENV": str(venv)})
    assert _chosen(res) == f"{venv}/bin/python"
    assert f"using the active virtual environment {venv}" in res.stderr


def _old_python(tmp_path: Path) -> Path:
    """A stand-in for a Python < 3.10: fails the version check the scripts run."""
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    return fake


def test_unsupported_python_is_refused(tmp_path):
    res = _select({"PYTHON": str(_old_python(tmp_path))})
    assert res.returncode != 0
    assert "echoloss needs 3.10 or newer" in res.stderr


def test_unsupported_base_python_is_refused_not_replaced(tmp_path):
    env = {
        "ECHOLOSS_VENV": str(tmp_path / "venv"),
        "ECHOLOSS_BASE_PYTHON": str(_old_python(tmp_path)),
    }
    res = _select(env)
    assert res.returncode != 0
    assert "is not a Python >= 3.10" in res.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.slow
@pytest.mark.parametrize("ensurepip", [True, False], ids=["venv", "without-ensurepip"])
def test_project_venv_is_created_announced_and_reused(tmp_path, ensurepip):
    """Outside any environment: a project venv from the base Python, with a working pip, also
    when ``ensurepip`` is unavailable (Debian without python3-venv); the second call reuses it."""
    env = {"ECHOLOSS_VENV": str(tmp_path / "venv"), "ECHOLOSS_BASE_PYTHON": sys.executable}
    if not ensurepip:
        env["ECHOLOSS_VENV_NO_ENSUREPIP"] = "1"
    first = _select(env)
    py = _chosen(first)
    assert py == f"{tmp_path}/venv/bin/python"
    assert "creating the project environment" in first.stderr
    assert ("bootstrapping pip" in first.stderr) is (not ensurepip)
    pip = subprocess.run([py, "-m", "pip", "--version"], capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    second = _select(env)
    assert _chosen(second) == py and "creating" not in second.stderr


def _demo(tmp: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    """Run a copy of scripts/demo.sh whose install is a no-op and whose Python prints the
    trainer's arguments: ``(the --output-dir it was given, stderr)``."""
    (tmp / "scripts").mkdir(exist_ok=True)
    (tmp / "scripts" / "demo.sh").write_text((ROOT / "scripts" / "demo.sh").read_text())
    (tmp / "scripts" / "install.sh").write_text("true\n")
    (tmp / "scripts" / "python.sh").write_text('PY="$(dirname "$0")/../fake-python"\n')
    fake = tmp / "fake-python"
    fake.write_text('#!/usr/bin/env bash\necho "$@"\n')
    fake.chmod(0o755)
    res = subprocess.run(
        ["bash", str(tmp / "scripts" / "demo.sh"), *args],
        env={"PATH": os.environ["PATH"], **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    argv = res.stdout.split()
    return argv[argv.index("--output-dir") + 1], res.stderr


def test_demo_never_runs_into_an_earlier_run(tmp_path):
    """`bash scripts/demo.sh --max-steps 1` after a full demo cut runs/demo/metrics.jsonl and
    replaced its plots and model: a used runs/demo now gives a fresh, announced directory."""
    assert _demo(tmp_path)[0] == "runs/demo"  # none yet
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    assert _demo(tmp_path)[0] == "runs/demo"  # empty
    (tmp_path / "runs" / "demo" / "metrics.jsonl").write_text("{}\n")
    out, err = _demo(tmp_path, "--max-steps", "1")
    assert out.startswith("runs/demo-") and out != "runs/demo"
    assert "runs/demo holds an earlier run; this one writes to " + out in err
    for chosen in (["--resume"], ["--overwrite"]):  # asked for: the trainer's flags decide
        assert _demo(tmp_path, *chosen)[0] == "runs/demo"
    argv = _demo(tmp_path, "--output-dir", "elsewhere")  # the last --output-dir wins in argparse
    assert argv[0] == "runs/demo"
    assert _demo(tmp_path, env={"ECHOLOSS_DEMO_DIR": "runs/x"})[0] == "runs/x"
