"""The experiment CLI refuses arguments that make jobs collide or λ meaningless, and never writes
a non-finite number into its summary."""

from __future__ import annotations

import json

import pytest
from test_experiment import _row

from echoloss.train.experiment import main


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--seeds", "0", "1", "0"], r"--seeds lists \[0\] more than once"),
        (["--alphas", "0.05", "0.05"], r"--alphas lists \['0.05'\] more than once"),
        (["--alphas", "nan"], r"--alphas must be finite and > 0"),
        (["--alphas", "inf"], r"--alphas must be finite and > 0"),
        (["--alphas", "0"], r"--alphas must be finite and > 0"),
        (["--jobs", "0"], r"--jobs must be >= 1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys, args, match):
    out = tmp_path / "exp"
    assert main([*args, "--output-dir", str(out)]) == 2
    assert __import__("re").search(match, capsys.readouterr().err)
    assert not out.exists()


def test_a_run_with_non_finite_numbers_is_named_not_summarised(tmp_path, capsys):
    rows = [
        _row("grpo", 0, 0.4, 0.5, 0.8, 0.7),
        _row("echo-0.01", 0, 0.4, float("nan"), 0.8, 0.3),
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--summarize-only", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "echo-0.01 seed 0: eval_success_end, eval_success_sampled_end" in err
    assert not (tmp_path / "summary.json").exists()
