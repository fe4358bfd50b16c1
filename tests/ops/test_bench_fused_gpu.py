"""``benchmarks/bench_fused_gpu.py`` without a GPU: it refuses cleanly, and (with the CUDA timing
and memory calls stubbed, the Triton kernels in the interpreter) every code path runs once on a
tiny shape and writes a well-formed JSON. No number it produces here means anything."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from _fused_cases import HAS_CUDA, HAS_TRITON

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_fused_gpu.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_fused_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal without CUDA")
def test_refuses_without_cuda(capsys):
    bench = _load()
    assert bench.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1e3


@pytest.mark.skipif(HAS_CUDA or not HAS_TRITON, reason="CPU smoke run under the interpreter")
def test_smoke_run_on_cpu(monkeypatch, tmp_path):
    bench = _load()
    monkeypatch.setattr(bench, "DEVICE", torch.device("cpu"))
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "Event", _Event)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(cuda, name, lambda: None)
    monkeypatch.setattr(cuda, "memory_allocated", lambda: 0)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda: 1)
    monkeypatch.setattr(cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3 (stub)")
    out = tmp_path / "r.json"
    argv = ["--n", "64", "--v", "301", "--warmup", "0", "--repeats", "2"]
    argv += ["--providers", "reference,triton,liger", "--sweep-launch", "--hidden", "16"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["providers"]["triton"]["gate"]["passed"] is True
    assert "speedup_vs_reference" in res["providers"]["triton"]
    assert (
        res["providers"]["liger"]["status"].startswith("skipped")
        or "gate" in res["providers"]["liger"]
    )
    assert res["floor_ms_3pass"] == pytest.approx(6 * 64 * 301 / 3.35e12 * 1e3)
    assert len(res["launch_sweep"]) == 12
    assert res["fused_linear"]["gate"]["loss_rel_err"] < 1e-5
