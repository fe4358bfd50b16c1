"""The benchmark harness (``python -m benchmarks``) on tiny shapes: the JSON-lines schema, the
correctness gate (a deliberately wrong provider gets no numbers), and the GPU code path on CPU
with the CUDA timing and memory calls stubbed. No number produced here means anything."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import cli, harness  # noqa: E402
from benchmarks.providers import REGISTRY, Outputs, Provider, register  # noqa: E402
from benchmarks.workload import MODES, naive_logprobs_entropy, naive_loss  # noqa: E402

ROW_KEYS = {
    "schema", "sweep", "op", "provider", "mode", "n", "v", "h", "dtype", "status", "reason",
    "gate", "time_ms", "peak_bytes", "peak_extra_bytes", "floor_bytes", "effective_GBps",
    "pct_of_peak_bandwidth", "floor_ms", "model_TFLOPs", "note", "workload", "env",
    "loadavg_before_after", "host_syncs", "launches",
}  # fmt: skip
ENV_KEYS = {
    "device_kind", "device_name", "versions", "git_sha", "timestamp", "torch_threads",
    "logical_cpus", "loadavg_start", "peak_bandwidth_Bps",
}  # fmt: skip


def _rows(out_dir: Path) -> list[dict]:
    files = sorted(out_dir.glob("*.jsonl"))
    assert len(files) == 1, files
    return [json.loads(line) for line in files[0].read_text().splitlines()]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("bench")
    rc = cli.main(["--device", "cpu", "--smoke", "--output", str(out)])
    return rc, out


def test_cpu_smoke_schema(smoke):
    rc, out = smoke
    assert rc == 0
    rows = _rows(out)
    assert {(r["op"], r["provider"], r["mode"]) for r in rows} == {
        (op, p, m)
        for op, ps in (("loss", cli.CPU_LOSS), ("linear", cli.LINEAR))
        for p in ps
        for m in MODES
    }
    for r in rows:
        assert set(r) >= ROW_KEYS, ROW_KEYS - set(r)
        assert set(r["env"]) >= ENV_KEYS, ENV_KEYS - set(r["env"])
        assert r["schema"] == harness.SCHEMA
        assert r["env"]["device_kind"] == "cpu" and r["env"]["torch_threads"] == 1
        assert r["status"] == "ok", (r["provider"], r["mode"], r["reason"])
        assert r["gate"]["passed"] is True
        checks = set(r["gate"]["checks"])
        want = {"no-grad": {"logprobs"}, "forward": {"loss"}}.get(r["mode"])
        if want is None:  # forward+backward
            want = {"loss", "dlogits"} if r["op"] == "loss" else {"loss", "dhidden", "dweight"}
        assert checks == want
        t = r["time_ms"]
        assert t["repeats"] == 3 and len(t["samples"]) == 3
        assert t["min"] <= t["p25"] <= t["median"] <= t["p75"] <= t["max"]
        assert r["peak_extra_bytes"] is not None and r["peak_extra_bytes"] >= 0
        assert len(r["loadavg_before_after"]) == 2
        if r["op"] == "loss":
            passes = 3 if r["mode"] == "forward+backward" else 1
            assert r["floor_bytes"] == passes * r["n"] * r["v"] * 4
            assert r["effective_GBps"] > 0 and r["model_TFLOPs"] is None
        else:
            assert r["floor_bytes"] is None and r["model_TFLOPs"] > 0
        assert r["pct_of_peak_bandwidth"] is None  # no CPU peak bandwidth in the table
    assert list(out.glob("*.png")), "matplotlib is installed here: the plot must be written"


def test_naive_forward_backward_holds_more_memory(smoke):
    """The memory measurement sees the full-vocabulary copies the naive path makes."""
    rows = {
        (r["provider"], r["mode"]): r["peak_extra_bytes"]
        for r in _rows(smoke[1])
        if r["op"] == "loss"
    }
    logits_bytes = 256 * 4096 * 4
    assert rows[("naive", "no-grad")] >= logits_bytes  # the fp32 log_softmax
    assert rows[("naive", "forward+backward")] >= 2 * logits_bytes  # + the gradient


def _wrong(kind: str):
    """A provider that is the naive one with a small error in what ``kind`` names."""

    def build(wl, mode, ctx):
        logits = wl.logits
        if mode == "no-grad":
            bias = 1e-3 if kind == "logprobs" else 0.0
            return lambda: Outputs(
                logprobs=naive_logprobs_entropy(logits, wl.labels, entropy=False)[0] + bias
            )

        def run():
            x = logits.detach().requires_grad_()
            loss = naive_loss(x, wl)
            # "grad": the same value with the gradient scaled by 1.01; else the value is off.
            loss = loss + 0.01 * (loss - loss.detach()) if kind == "grad" else loss * 1.001
            if mode == "forward":
                return Outputs(loss=loss)
            loss.backward()
            return Outputs(loss=loss.detach(), grad_rows=lambda idx: x.grad.index_select(0, idx))

        return run

    return build


@pytest.mark.parametrize("kind", ["logprobs", "grad"])
def test_gate_rejects_a_wrong_provider(tmp_path, kind):
    name = f"wrong-{kind}"
    register(Provider(name, "loss", "deliberately wrong", _wrong(kind)))
    try:
        argv = ["--device", "cpu", "--smoke", "--ops", "loss", "--no-plot", "--repeats", "2"]
        argv += ["--providers", f"naive,{name}", "--output", str(tmp_path)]
        assert cli.main(argv) == 1  # a red gate fails the run
    finally:
        del REGISTRY[name]
    rows = {(r["provider"], r["mode"]): r for r in _rows(tmp_path)}
    assert all(rows[("naive", m)]["status"] == "ok" for m in MODES)
    for mode in MODES:
        r = rows[(name, mode)]
        if kind == "grad" and mode != "forward+backward":
            assert r["status"] == "ok"  # the value is right; only the gradient is wrong
            continue
        assert r["status"] == "gate-failed"
        assert r["gate"]["passed"] is False
        for key in ("time_ms", "peak_extra_bytes", "effective_GBps", "peak_bytes"):
            assert r[key] is None, key  # no number for a provider on a red gate
        failed = {k for k, c in r["gate"]["checks"].items() if not c["passed"]}
        expected = {
            ("logprobs", "no-grad"): {"logprobs"},
            ("logprobs", "forward"): {"loss"},
            ("logprobs", "forward+backward"): {"loss", "dlogits"},
            ("grad", "forward+backward"): {"dlogits"},
        }[(kind, mode)]
        assert failed == expected


def test_select_overrides_and_unknown_names():
    args = cli.parse_args(["--device", "cpu", "--quick", "--n", "512", "--providers", "naive"])
    sweep = cli.select(args, "cpu")
    assert [(b.op, b.ns, b.vs, b.providers) for b in sweep.blocks] == [
        ("loss", (512,), (32000,), ("naive",))
    ]
    with pytest.raises(SystemExit):
        cli.select(cli.parse_args(["--providers", "nope"]), "cpu")
    # The CPU sweeps never time the Triton interpreter.
    for (kind, _), sw in cli.SWEEPS.items():
        if kind == "cpu":
            assert all("triton" not in b.providers for b in sw.blocks)


def test_triton_and_liger_are_never_timed_on_cpu():
    from benchmarks.providers import Context

    ctx = Context("cpu", torch.device("cpu"))
    assert "interpreter" in REGISTRY["triton"].unavailable(ctx)
    assert REGISTRY["liger"].unavailable(ctx) is not None


def test_floor_and_summary():
    assert harness.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert harness.peak_bandwidth("NVIDIA H100 PCIe") is None
    assert harness.peak_bandwidth("NVIDIA H200") == 4.8e12
    t = harness.summarize([0.004, 0.001, 0.002, 0.003, 0.005])
    assert (t["min"], t["p25"], t["median"], t["p75"], t["max"]) == (1.0, 2.0, 3.0, 4.0, 5.0)


def test_refuses_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the refusal without CUDA")
    assert cli.main(["--device", "cuda", "--output", "/nonexistent"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


_CUDA_STUB = """
import sys, time, torch
class Event:
    def __init__(self, enable_timing=False): self.t = 0.0
    def record(self): self.t = time.perf_counter()
    def elapsed_time(self, end): return (end.t - self.t) * 1e3
c = torch.cuda
c.is_available = lambda: True
c.Event = Event
for n in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
    setattr(c, n, lambda: None)
c.memory_allocated = lambda: 0
c.max_memory_allocated = lambda: 1
c.get_device_name = lambda: "NVIDIA H100 80GB HBM3 (stub)"
from benchmarks.cli import parse_args, run
from benchmarks.providers import Context
args = parse_args(["--device", "cuda", "--smoke", "--output", sys.argv[1], "--no-plot", *sys.argv[2:]])
sys.exit(run(args, Context("cuda", torch.device("cpu"))))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU stand-in for the GPU path")
def test_gpu_path_on_cpu_with_stubs(tmp_path):
    """The CUDA sweep's code (CUDA-event timing, allocator memory, floor, Triton and Liger
    providers, fused-linear) end to end on cpu tensors, the kernels in the Triton interpreter
    (set before triton is imported, so Liger's kernels can run too)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    argv = ["--modes", "no-grad,forward+backward", "--dtype", "float32"]
    res = subprocess.run(
        [sys.executable, "-c", _CUDA_STUB, str(tmp_path), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = _rows(tmp_path)
    by = {(r["op"], r["provider"], r["mode"]): r for r in rows}
    for key in [("loss", "triton", "forward+backward"), ("linear", "fused-linear", "no-grad")]:
        r = by[key]
        assert r["status"] == "ok" and r["gate"]["passed"], r
        assert r["env"]["device_kind"] == "cuda" and r["env"]["peak_bandwidth_Bps"] == 3.35e12
        assert r["peak_bytes"] == 1 and r["peak_extra_bytes"] == 1  # the stubbed counters
    fb = by[("loss", "triton", "forward+backward")]
    assert fb["floor_ms"] == pytest.approx(3 * 64 * 301 * 4 / 3.35e12 * 1e3)
    assert fb["pct_of_peak_bandwidth"] == pytest.approx(
        100 * fb["floor_ms"] / fb["time_ms"]["median"]
    )
    liger = by[("loss", "liger", "forward+backward")]
    assert liger["status"] in ("ok", "skipped"), liger
    if liger["status"] == "ok":
        assert liger["gate"]["checks"]["dlogits"]["passed"]


def test_a_peer_on_a_red_gate_is_recorded_not_a_failure(tmp_path):
    register(
        Provider("wrong-peer", "loss", "a peer that disagrees", _wrong("logprobs"), ours=False)
    )
    try:
        argv = ["--device", "cpu", "--smoke", "--ops", "loss", "--no-plot", "--repeats", "1"]
        argv += ["--modes", "no-grad", "--providers", "naive,wrong-peer", "--output", str(tmp_path)]
        assert cli.main(argv) == 0
    finally:
        del REGISTRY["wrong-peer"]
    rows = {r["provider"]: r for r in _rows(tmp_path)}
    assert rows["wrong-peer"]["status"] == "gate-failed" and rows["wrong-peer"]["time_ms"] is None
    assert rows["naive"]["status"] == "ok"


def test_no_reference_means_no_numbers(tmp_path, monkeypatch):
    """If the gate's reference cannot be computed (e.g. out of memory), nothing is measured."""

    def boom(wl, mode):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(harness, "compute_reference", boom)
    argv = ["--device", "cpu", "--smoke", "--ops", "loss", "--no-plot", "--modes", "no-grad"]
    assert cli.main([*argv, "--providers", "naive,reference", "--output", str(tmp_path)]) == 0
    rows = _rows(tmp_path)
    assert {r["provider"] for r in rows} == {"naive", "reference"}
    for r in rows:
        assert r["status"] == "oom" and r["reason"].startswith("no reference")
        assert r["time_ms"] is None and r["peak_extra_bytes"] is None


def test_git_sha_from_the_environment_wins_over_a_stale_git(monkeypatch):
    """A tree copied to a GPU machine may carry an old .git: ECHOLOSS_GIT_SHA names the commit."""
    from benchmarks.providers import Context

    ctx = Context("cpu", torch.device("cpu"))
    monkeypatch.delenv("ECHOLOSS_GIT_SHA", raising=False)
    from_git = harness.environment(ctx, 1, None)["git_sha"]
    monkeypatch.setenv("ECHOLOSS_GIT_SHA", "0123abcd" * 5)
    assert harness.environment(ctx, 1, None)["git_sha"] == "0123abcd" * 5 != from_git


def test_check_mode_prints_one_table_with_sync_and_launch_counts(tmp_path, capsys):
    """``--check`` on CPU at tiny shapes: every provider gets a line with its host syncs and
    launches on the CUDA code path; echoloss's own providers issue no host sync."""
    rc = cli.main(["--device", "cpu", "--check", "--output", str(tmp_path), "--no-plot"])
    assert rc == 0
    out = capsys.readouterr().out
    table = out[out.index("| op | N | V |") :]
    rows = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(r["host_syncs"] is not None and r["launches"] > 0 for r in ok)
    ours = [r for r in ok if r["provider"] in ("reference", "linear-echoloss")]
    assert ours and all(r["host_syncs"] == 0 for r in ours), [
        (r["provider"], r["host_syncs"]) for r in ours
    ]
    assert len(table.strip().splitlines()) == 2 + len(rows)


def test_launch_count_runs_on_cpu(capsys):
    """``python -m benchmarks.launch_count`` (eager only: the compiled column takes a minute of
    inductor compile on CPU) prints its table with no host sync on the CUDA code path."""
    from benchmarks import launch_count

    assert launch_count.main(["--n", "32", "--v", "64", "--no-compile"]) == 0
    out = capsys.readouterr().out
    rows = [x.split("|") for x in out.splitlines() if "| eager |" in x]
    assert [r[1].strip() for r in rows] == list(launch_count._configs())
    assert all(r[3].strip() == "0" for r in rows), rows  # no host sync


def test_launch_count_modules_table_runs_on_cpu(capsys):
    """``--modules``: one row per module case and value-check kind, no host sync; off CUDA
    both kinds are the PyTorch checks, so their launches are equal."""
    from benchmarks import launch_count

    assert launch_count.main(["--n", "64", "--v", "32", "--no-compile", "--modules"]) == 0
    out = capsys.readouterr().out
    rows = [x.split("|") for x in out.splitlines() if x.startswith("| EchoGRPOLoss")]
    assert len(rows) == 2 * len(launch_count.MODULE_CASES)
    assert all(r[2].strip() == "pytorch" and r[3].strip() == "0" for r in rows), rows
    launches = [int(r[4]) for r in rows]
    assert launches[0::2] == launches[1::2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize(
    "module", ["profile_step", "linear_chunks", "gemm_chunks", "linear_profile"]
)
def test_gpu_only_tools_say_so_on_cpu(module, capsys):
    """The GPU-only measurements refuse to run without CUDA, with a message and exit code 2."""
    import importlib

    tool = importlib.import_module(f"benchmarks.{module}")
    assert tool.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize("chunk", [None, 7], ids=["one-chunk", "chunks-of-7"])
def test_phase2_into_a_new_buffer_changes_no_value(chunk):
    """`benchmarks.linear_chunks --new-buffer` times the fused-linear op with phase 2 writing
    into a new buffer: the same loss and gradients bit for bit (only where the values are
    written changes), and the op writes in place again after the block."""
    from benchmarks.linear_chunks import phase2_into_new_buffer
    from echoloss import LossInputs, echo_loss_from_hidden
    from echoloss.ops.fused_linear import op

    g = torch.Generator().manual_seed(0)
    n, v, h = 20, 33, 8
    x = LossInputs(
        labels=torch.randint(0, v, (n,), generator=g),
        rl_mask=torch.rand(n, generator=g) > 0.3,
        echo_weights=(torch.rand(n, generator=g) > 0.7).float() * 0.5,
        advantages=torch.randn(n, generator=g),
        inference_logprobs=-torch.rand(n, generator=g),
    )
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    written: list[bool] = []
    real = op.resolve_backend

    def spy(backend, device):
        impl = real(backend, device)

        def backward(*a, out=None, **k):
            written.append(out is not None)
            return impl.backward(*a, out=out, **k) if out is not None else impl.backward(*a, **k)

        return type(
            "Impl", (), {"forward": staticmethod(impl.forward), "backward": staticmethod(backward)}
        )

    def grads():
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = echo_loss_from_hidden(hh, ww, x, chunk_size=chunk, backend="reference").loss
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    op.resolve_backend = spy  # under the wrapper: it sees what the wrapper passes on
    try:
        in_place = grads()
        first, written[:] = list(written), []
        with phase2_into_new_buffer():
            new_buffer = grads()
        second, written[:] = list(written), []
        again = grads()
    finally:
        op.resolve_backend = real
    assert first and all(first) and written == first  # in place, before and after the block
    assert second and not any(second)  # into new buffers inside it
    for a, b, c in zip(in_place, new_buffer, again, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_cuda_timing_runs_mirrored_blocks(monkeypatch):
    """GPU timing order without a GPU (CUDA events faked): each provider warms up, then runs
    half of the repeats in a block, first in order and then in reverse (A B C C B A), so that
    each sits at the same mean position; a provider that raises is reported and dropped."""
    calls: list[str] = []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            calls.append("event")

        def elapsed_time(self, other):
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ctx = harness.Context(kind="cpu", device=torch.device("cpu"))
    broken = {"left": 3}

    def fn(name):
        def run():
            calls.append(name)
            if name == "c":
                broken["left"] -= 1
                if broken["left"] == 0:
                    raise RuntimeError("boom")

        return run

    errors = []
    times = harness.time_cuda_mirrored(
        ctx, {k: fn(k) for k in "abc"}, warmup=1, repeats=5,
        on_error=lambda name, e: errors.append((name, str(e))),
    )  # fmt: skip
    order = [c for c in calls if c != "event"]
    # a: 1 warm-up + 3 timed, b: 4, c fails on its third call; then b, a: 1 + 2 each.
    assert order == ["a"] * 4 + ["b"] * 4 + ["c"] * 3 + ["b"] * 3 + ["a"] * 3
    assert errors == [("c", "boom")] and set(times) == {"a", "b"}
    assert times["a"] == [0.002] * 5 and times["b"] == [0.002] * 5


# -- the GPU check script (benchmarks/gpu_check.sh), dry run -------------------------------------

GPU_CHECK = ROOT / "benchmarks" / "gpu_check.sh"
GPU_RESULTS = ROOT / "benchmarks" / "results"
H100 = "NVIDIA_H100_80GB_HBM3"


def _gpu_check(tmp_path, stub="", fixtures=None, steps=""):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_DRY_BOX": "2", "OUT": str(out),
           "PYTHON": sys.executable, "GPU_CHECK_STUB": stub, "GPU_CHECK_STEPS": steps,
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    if fixtures is not None:
        env["GPU_CHECK_DRY_FIXTURES"] = str(fixtures)
    res = subprocess.run(["bash", str(GPU_CHECK)], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    steps_run = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    return res.stdout, out, steps_run


def test_gpu_check_time_boxes_fit_one_ten_minute_command():
    """The boxes as the script declares them: at most 540 s together, and with each step's
    5 s to exit after its box still inside a 600 s command."""
    text = GPU_CHECK.read_text()
    boxes = {
        k: int(v)
        for k, v in re.findall(r"\[(\w+)\]=(\d+)", text.split("declare -A BOX=")[1].splitlines()[0])
    }
    steps = re.search(r"^STEPS=\((.*)\)$", text, re.M).group(1).split()
    assert list(boxes) == steps
    assert sum(boxes.values()) <= 540
    grace = int(re.search(r"^GRACE_S=(\d+)$", text, re.M).group(1))
    assert sum(boxes.values()) + grace * len(steps) < 600
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for step, box in boxes.items():  # the header's table and the page's say the same
        assert re.search(rf"^#   {step}\s+{box} s ", text, re.M), step
        assert re.search(rf"^    \| {step} \| {box} s \|", page, re.M), step
    assert "set -e" not in text  # a failing step must not stop the others


def test_gpu_check_dry_run_records_failures_and_time_outs_and_goes_on(tmp_path):
    """A failing step and a step past its box are recorded; every later step still runs; the
    goals summary is the last thing printed; at most 8 files come back."""
    stdout, out, steps = _gpu_check(tmp_path, stub="tests=fail,check=hang")
    assert [s["step"] for s in steps] == ["setup", "tests", "values", "check", "rounds",
                                          "launches", "goals"]  # fmt: skip
    by = {s["step"]: s for s in steps}
    assert by["tests"]["rc"] == 3 and not by["tests"]["timed_out"]
    assert by["check"]["timed_out"] and by["check"]["rc"] in (124, 137)
    assert all(by[s]["rc"] == 0 for s in ("setup", "values", "rounds", "launches", "goals"))
    assert by["check"]["box_s"] == 150  # the real box is recorded, the dry run's is 2 s
    assert stdout[stdout.index("== GOALS") :].count("== ") == 1  # nothing printed after it
    assert "GPU tests pass: NOT MET" in stdout and "TIMED OUT" in stdout
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8


def test_gpu_check_dry_run_over_committed_rows_gives_the_goals(tmp_path):
    """The collection and the summary over the committed H100 rows of 2026-11-27 (the check
    at d20d5e9, 20 paired linear rounds, launch counts): every goal line from those numbers,
    and all 8 files present."""
    fx = tmp_path / "fx"
    fx.mkdir()
    for src, name in ((f"cuda-check_{H100}_20261127T213515Z.jsonl", "check.jsonl"),
                      (f"cuda-linear-chunks_{H100}_20261127T222546Z.json", "linear-rounds.json"),
                      (f"cuda-launch-count_{H100}_20261127T171750Z.md", "launches.md")):  # fmt: skip
        (fx / name).write_text((GPU_RESULTS / src).read_text())
    (fx / "tests.txt").write_text("....\n34 passed, 474 deselected, 1 warning in 32.94s\n")
    stdout, out, _ = _gpu_check(tmp_path, fixtures=fx)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["env.txt", "log.txt", "steps.jsonl", "check.jsonl", "values.jsonl",
                            "linear-rounds.json", "launches.md", "summary.md"])  # fmt: skip
    summary = stdout[stdout.index("== GOALS") :]
    assert summary.strip() == (out / "summary.md").read_text().strip()
    assert "commit d20d5e98ce789dbc8856aeebd6e38bdc65799276" in summary
    assert "at every shape of the check: met" in summary
    assert "N=16384 V=151936: echoloss 5.43 ms; trl 5.61, liger 29.43 ms: fastest" in summary
    assert "span 82.1–87.8 % (goal ≥ 80 %)" in summary and "at 3.35 TB/s" in summary
    assert "(76.7 % of the 2.80 passes moved)" in summary
    assert "logits-then-loss (H = 4096): NOT MET" in summary
    assert "20 paired rounds: median difference +0.23 ms" in summary
    assert "faster in 5 of 20 (sign test p = 0.041)" in summary
    assert "pytest -m gpu tests/ops: 34 passed, 474 deselected (rc 0)" in summary
    assert "dppo (eager): 11 launches, 0 host syncs" in summary
    assert "nn modules on CUDA = the CPU path: no result" in summary  # its fixture is empty


def test_sign_test():
    from benchmarks.gpu_goals import sign_test_p

    assert sign_test_p(5, 20) == pytest.approx(2 * sum(math.comb(20, i) for i in range(6)) / 2**20)
    assert sign_test_p(10, 20) == 1.0 and sign_test_p(0, 0) == 1.0


def test_device_values_on_the_cpu_device_path(tmp_path):
    """``python -m benchmarks.device_values`` off CUDA compares the CUDA code path (PyTorch
    phases) with the CPU path and the fp64 gold: one module and two loss types here."""
    from benchmarks import device_values

    out = tmp_path / "values.jsonl"
    argv = ["--device", "cpu", "--output", str(out), "--modules", "EchoGRPOLoss",
            "--loss-types", "dapo,sapo"]  # fmt: skip
    assert device_values.main(argv) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert {(r["loss_type"], r["level"]) for r in rows} == {
        (t, lv) for t in ("dapo", "sapo") for lv in ("token", "sequence")
    }
    assert all(r["status"] == "ok" and r["err_device"] <= r["allowed"] for r in rows)
    assert {"loss", "d_logits"} <= {r["value"] for r in rows}


def test_gpu_goals_stores_the_files_under_the_names_the_pages_cite(tmp_path, capsys):
    """``--store``: each file of the check under ``<kind>_<GPU>_<time>``, from its rows; a file
    already there is not overwritten."""
    from benchmarks import gpu_goals

    folder = tmp_path / "out"
    folder.mkdir()
    src = GPU_RESULTS / f"cuda-check_{H100}_20261127T213515Z.jsonl"
    (folder / "check.jsonl").write_text(src.read_text())
    (folder / "summary.md").write_text("== GOALS ==\n")
    results = tmp_path / "results"
    assert gpu_goals.main([str(folder), "--store", str(results)]) == 0
    assert sorted(p.name for p in results.iterdir()) == [
        f"cuda-check_{H100}_20261127T213515Z.jsonl",
        f"gpu-check-summary_{H100}_20261127T213515Z.md",
    ]
    assert (results / src.name).read_text() == src.read_text()
    with pytest.raises(SystemExit, match="not overwritten"):
        gpu_goals.main([str(folder), "--store", str(results)])


def test_device_values_pass_rule_fails_a_wrong_value():
    """The rule of `benchmarks.device_values.compare`: an error below 4x the CPU path's passes, one
    more does not (above the 64-ulp floor); a NaN where the gold is finite, or another NaN
    pattern, fails; a wrong shape fails."""
    from benchmarks.device_values import compare

    gold = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    cpu = gold + torch.tensor([0.0, 1e-3, 0.0], dtype=torch.float64)
    assert compare("x", gold + torch.tensor([0.0, 0.0, 3.9e-3], dtype=torch.float64), cpu, gold)[
        "passed"
    ]
    assert not compare(
        "x", gold + torch.tensor([0.0, 0.0, 4.1e-3], dtype=torch.float64), cpu, gold
    )["passed"]
    assert compare("x", gold.clone(), gold.clone(), gold)["passed"]  # both exact
    nan = torch.tensor([1.0, math.nan, 0.5], dtype=torch.float64)
    assert not compare("x", nan, gold.clone(), gold)["passed"]
    assert compare("x", nan.clone(), nan.clone(), nan)["passed"]  # the same non-finite gold
    assert not compare("x", gold[:2], cpu, gold)["passed"]


def test_gpu_goals_say_not_met():
    """A peer faster at one shape, a span below 80 %, the op slower in the rounds: each goal
    says NOT MET with the numbers."""
    from benchmarks.gpu_goals import fastest, floor, linear

    rows = [
        json.loads(x)
        for x in (GPU_RESULTS / f"cuda-check_{H100}_20261127T213515Z.jsonl")
        .read_text()
        .splitlines()
    ]
    for r in rows:
        if (r["provider"], r["n"], r["v"]) == ("trl", 16384, 151936):
            r["time_ms"]["median"] = 5.0  # faster than echoloss's 5.43
        if (r["provider"], r["n"], r["v"]) == ("triton", 16384, 262144):
            r["pct_of_peak_bandwidth"] = 79.4
    lines, ok = fastest(rows)
    assert (
        ok is False
        and "  N=16384 V=151936: echoloss 5.43 ms; trl 5.00, liger 29.43 ms: NOT fastest" in lines
    )
    lines, ok = floor(rows)
    assert ok is False and "  span 79.4–87.8 % (goal ≥ 80 %)" in lines
    base = {"round_medians_ms": [10.0, 10.0, 10.0], "median_ms": 10.0, "peak_extra_gib": 9.0}
    op = {"round_medians_ms": [10.1, 9.9, 10.2], "median_ms": 10.1, "peak_extra_gib": 6.0}
    lines, ok = linear(None, [base, op])
    assert ok is False and "median difference +0.10 ms (+1.00 %), faster in 1 of 3" in lines[0]
    op["round_medians_ms"] = [9.9, 9.8, 10.1]
    assert linear(None, [base, op])[1] is True


def test_gpu_check_refuses_an_unknown_step(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_STEPS": "setup chek",
           "OUT": str(tmp_path / "out")}  # fmt: skip
    res = subprocess.run(["bash", str(GPU_CHECK)], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert res.returncode == 2 and "GPU_CHECK_STEPS names 'chek'" in res.stderr
