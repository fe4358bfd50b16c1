"""The experiment CLI refuses arguments that make jobs collide or λ meaningless, and never writes
a non-finite number into its summary."""

from __future__ import annotations

import json

import pytest
from echo_experiment.experiment import main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_experiment import _row


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
    argv = ["--summarize-only", "--alphas", "0.01", "--no-actobs", "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "echo-0.01 seed 0: eval_success_end, eval_success_sampled_end" in err
    assert not (tmp_path / "summary.json").exists()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seeds=st.lists(st.integers(-3, 2**40), min_size=1, max_size=4),
    alphas=st.lists(st.sampled_from(["0.05", "0.01", "nan", "inf", "-1", "0", "1e-300", "3e38"]),
                    min_size=1, max_size=3),
)  # fmt: skip
def test_fuzz_arguments(tmp_path_factory, capsys, seeds, alphas):
    """A message naming --seeds or --alphas, or (valid arguments) the empty directory's."""
    out = tmp_path_factory.mktemp("exp")
    argv = ["--summarize-only", "--output-dir", str(out), "--seeds", *map(str, seeds),
            "--alphas", *alphas]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--seeds" in err or "--alphas" in err or "no finished runs" in err, err
