"""The end-to-end example stays runnable and learns its echo target."""

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_quickstart_runs_and_echo_loss_falls(capsys):
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    history = module.main(steps=6, group_size=2, seed=1)
    assert len(history) == 6
    echo = [h["loss_echo/all"] for h in history]
    # The tool output is a deterministic function of the prompt: its CE must drop quickly
    # (from ~log(258) = 5.55 at random init).
    assert echo[0] > 4.5 and echo[-1] < echo[0] - 0.5
    assert "step  5" in capsys.readouterr().out


def test_quickstart_runs_as_the_readme_says(tmp_path):
    """``python examples/quickstart.py``, from another directory, as a reader runs it."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "step 19" in res.stdout
