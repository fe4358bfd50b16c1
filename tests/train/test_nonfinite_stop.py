"""The reference trainer stops on a non-finite loss with the loss's message (exit status 1)."""

from __future__ import annotations

from echoloss.train.cli import main


def test_overflowing_coefficient_stops_the_trainer(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["--config", "configs/fast.toml", "--set", f"train.output_dir={out}",
               "--set", "loss.entropy_coef=-1e38"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1
    assert "training stopped: loss must be finite" in err
    assert "likely input: entropy_coef=-1e+38" in err
    assert not (out / "final-model").exists()
