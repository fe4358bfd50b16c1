"""Measurement: the correctness gate, timing, peak memory, the bandwidth floor, the run metadata.

Everything here is shared by the CPU and the GPU sweeps; only :class:`providers.Context.kind`
decides how time and memory are measured:

* ``cpu``: wall clock (``time.perf_counter``), the providers of one shape and mode run
  **round-robin** (A, B, C, A, B, C, ...) so that all of them see the same machine load; peak
  memory from the profiler's allocation events (every tensor allocation and free of one call, in
  order), i.e. the peak of live tensor bytes over those live before the call, independent of
  how the C allocator reuses pages;
* ``cuda``: CUDA events around each call after a 256 MiB L2 flush (what
  ``triton.testing.do_bench`` does), providers in mirrored blocks (A B C C B A); peak memory from the caching
  allocator (``torch.cuda.max_memory_allocated``), both absolute (inputs included, as Liger
  reports it) and over what was allocated before the call.

The gate runs before anything is measured; a provider that fails it gets no time and no memory,
only the disagreement.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import gc
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.providers import Context, Outputs, Provider, trl_note, versions
from benchmarks.workload import Workload, loss_config

SCHEMA = "echoloss-bench/1"
ROOT = Path(__file__).resolve().parent.parent

#: Datasheet HBM bandwidth (bytes/s) by GPU-name pattern, first match wins
#: (vendor datasheet figures for the SXM parts). Others get GB/s but no floor.
PEAK_BANDWIDTH: list[tuple[str, float]] = [
    (r"(?<!G)H200", 4.8e12),  # not GH200 (a Grace Hopper superchip: other memory)
    (r"(?<!G)H100(?!.*(PCIe|NVL))", 3.35e12),  # SXM only: PCIe and NVL differ
    (r"A100.*80GB", 2.0e12),
]

#: Gate tolerances. Every provider computes in fp32 from the same input values, so fp32
#: quantities differ only by summation order: ``STAT_TOL`` (atol, rtol) for logprobs, ``LOSS_TOL``
#: for the scalar loss. ``dlogits`` are compared in the logits dtype: rtol one ulp of it, atol
#: ``1e-5`` per unit of the largest per-row coefficient ``|d loss / d logprob|``. Computing the
#: log-softmax in bf16 (errors ~4e-3: bf16 keeps 8 mantissa bits) fails these by design.
STAT_TOL = (1e-4, 1e-4)
LOSS_TOL = (1e-6, 1e-4)
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
GRAD_ATOL_PER_COEF = 1e-5
#: Linear op: hidden/weight gradients (GEMM accumulation order differs; tests/ops/test_fused_linear).
LINEAR_GRAD_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2.0**-6)}
#: Rows of ``dlogits`` compared by the gate (all rows when N is smaller).
GATE_ROWS = 512


# -- environment ---------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def device_name(ctx: Context) -> str:
    return torch.cuda.get_device_name() if ctx.kind == "cuda" else cpu_name()


def peak_bandwidth(name: str) -> float | None:
    return next((bw for pat, bw in PEAK_BANDWIDTH if re.search(pat, name)), None)


def environment(ctx: Context, threads: int, peak_bw: float | None) -> dict[str, Any]:
    """Metadata stored with every row: device, versions, git sha, time, threads, load."""
    dirty = _git("status", "--porcelain", "--", "echoloss", "benchmarks", ":!benchmarks/results")
    env: dict[str, Any] = {
        "device_kind": ctx.kind,
        "device_name": device_name(ctx),
        "peak_bandwidth_Bps": peak_bw,
        "versions": {**versions(), "python": platform.python_version()},
        "cuda": torch.version.cuda,
        # set where the tree was copied to another machine: its .git, if any, may be stale there
        "git_sha": os.environ.get("ECHOLOSS_GIT_SHA") or _git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": threads,
    }
    return env


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# -- memory --------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence fd 2 (the profiler's C++ start/stop log lines) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak_extra(fn: Callable[[], Outputs]) -> int | None:
    """Peak of the tensor bytes allocated during one call over those live before it, from the
    profiler's allocation events (every CPU tensor allocation and free, in order): the CPU
    counterpart of ``max_memory_allocated() - memory_allocated()``, independent of how the C
    allocator reuses or returns pages."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except AttributeError:  # a torch without the raw event list
        return None
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU:  # type: ignore[attr-defined]
            cur += e.nbytes()
            peak = max(peak, cur)
    return int(peak)


def measure_memory(ctx: Context, fn: Callable[[], Outputs]) -> dict[str, Any]:
    """Peak memory of one call. ``peak_extra_bytes``: the peak of tensor allocations over what
    was allocated before the call (CUDA: the caching allocator's counters; CPU: the profiler's
    allocation events). ``peak_bytes`` (CUDA only): the absolute peak, inputs included."""
    gc.collect()
    if ctx.kind == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del out
        return {"peak_bytes": int(peak), "peak_extra_bytes": int(peak - base)}
    return {"peak_bytes": None, "peak_extra_bytes": _cpu_peak_extra(fn)}


# -- timing --------------------------------------------------------------------------------


def summarize(times_s: list[float]) -> dict[str, Any]:
    """Median and quartiles (ms) of the repeats; the samples themselves are kept."""
    ms = sorted(t * 1e3 for t in times_s)
    if len(ms) >= 2:
        q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    else:
        q1 = q3 = ms[0]
    return {
        "median": statistics.median(ms),
        "p25": q1,
        "p75": q3,
        "min": ms[0],
        "max": ms[-1],
        "repeats": len(ms),
        "samples": [round(t, 4) for t in ms],
    }


def time_cpu(fns: dict[str, Callable[[], Outputs]], repeats: int) -> dict[str, list[float]]:
    """Round-robin wall-clock times (s) of already warmed-up functions."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            del out
    return times


def time_cuda(ctx: Context, fn: Callable[[], Outputs], warmup: int, repeats: int) -> list[float]:
    """CUDA-event times (s) of one function, each call after an L2 flush."""
    return time_cuda_mirrored(ctx, {"fn": fn}, warmup, repeats, on_error=None)["fn"]


def time_cuda_mirrored(
    ctx: Context,
    fns: dict[str, Callable[[], Outputs]],
    warmup: int,
    repeats: int,
    *,
    on_error: Callable[[str, Exception], None] | None,
) -> dict[str, list[float]]:
    """CUDA-event times (s) of several functions in mirrored blocks: the functions in order,
    then in reverse order (A B C C B A), each block ``warmup`` untimed calls then half of the
    ``repeats`` timed ones, each call after an L2 flush. Within a block a function runs back
    to back (its allocator and cache state its own, as a trainer calls it); mirroring puts
    every function at the same mean position in the run, so that a linear drift of the GPU's
    clocks during the run falls on all of them alike (timed in one block each, one after the
    other, two runs of the same check read TRL's path faster at one shape and ours at the
    other). Interleaving single calls instead (A B C A B C) measured every provider up to
    1 ms slower on an H100, each call then following another provider's ``[N, V]`` work. A
    function that raises is reported to ``on_error`` and dropped (re-raised when ``on_error``
    is None)."""
    flush = (
        torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=ctx.device)
        if ctx.device.type == "cuda"
        else None
    )
    times: dict[str, list[float]] = {name: [] for name in fns}
    failed: set[str] = set()
    first = (repeats + 1) // 2
    order = list(fns)
    for names, count in ((order, first), (order[::-1], repeats - first)):
        for name in names:
            if name in failed or count == 0:
                continue
            try:
                for _ in range(warmup):
                    fns[name]()
                torch.cuda.synchronize()
                for _ in range(count):
                    if flush is not None:
                        flush.zero_()
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = fns[name]()
                    end.record()
                    torch.cuda.synchronize()
                    del out
                    times[name].append(start.elapsed_time(end) * 1e-3)
            except Exception as e:
                if on_error is None:
                    raise
                on_error(name, e)
                failed.add(name)
                del times[name]
    return times


# -- floor ---------------------------------------------------------------------------------


def floor_bytes(wl: Workload, mode: str) -> int | None:
    """Bytes a logits-level kernel must move: one read of the ``[N, V]`` logits for no-grad and
    forward, three passes (read, read, write) for forward+backward (docs/kernels.md, "Bandwidth
    floor").
    None for the linear op, which is GEMM-bound."""
    if wl.logits is None:
        return None
    return (3 if mode == "forward+backward" else 1) * wl.logits_bytes


def model_flops(wl: Workload, mode: str) -> int | None:
    """LM-head GEMM FLOPs of the linear op: ``2·N·H·V`` forward, ``6·N·H·V`` with backward
    (``dX`` and ``dW``; a fused-linear backward of a loss that is not chunk-additive also
    recomputes the logits, not counted; a chunk-additive one does ``dX`` and ``dW`` in its
    forward pass)."""
    if wl.hidden is None:
        return None
    return (6 if mode == "forward+backward" else 2) * wl.n * int(wl.h or 0) * wl.v


# -- the gate ------------------------------------------------------------------------------


def _gate_rows(wl: Workload) -> torch.Tensor:
    if wl.n <= GATE_ROWS:
        return torch.arange(wl.n, device=wl.device)
    idx = torch.linspace(0, wl.n - 1, GATE_ROWS, device=wl.device).round().long()
    out: torch.Tensor = torch.unique(idx)
    return out


def _ref_logits(wl: Workload, mode: str) -> dict[str, Any]:
    from echoloss.loss import echo_loss_from_logprobs
    from echoloss.ops import selective_logprobs
    from echoloss.ops.selective_logprobs import reference as ref

    logits = wl.logits
    assert logits is not None
    if mode == "no-grad":
        with torch.no_grad():
            return {"logprobs": selective_logprobs(logits, wl.labels, backend="reference")}
    with torch.no_grad():
        lp, ent = selective_logprobs(
            logits, wl.labels, return_entropy=True, mask=wl.participating, backend="reference"
        )
    lp = lp.clone().requires_grad_()
    loss = echo_loss_from_logprobs(lp, wl.loss_inputs(), entropy=ent, config=loss_config()).loss
    out: dict[str, Any] = {"loss": loss.detach()}
    if mode == "forward+backward":
        (coef,) = torch.autograd.grad(loss, lp)
        idx = _gate_rows(wl)
        sub = logits.index_select(0, idx)
        lab = wl.labels.index_select(0, idx)
        cs = ref.default_chunk_size(wl.v)
        _, lse, _ = ref.forward(
            sub, lab, rows=None, inv_temperature=1.0, need_entropy=False, chunk_size=cs
        )
        rows = torch.arange(idx.numel(), device=wl.device)
        a = coef.index_select(0, idx)
        out["grad_idx"] = idx
        out["grad_rows"] = ref.backward(
            sub,
            lab,
            rows=rows,
            inv_temperature=1.0,
            lse=lse,
            grad_logprobs=a,
            grad_entropy=None,
            entropy=None,
            chunk_size=cs,
        )
        out["coef_scale"] = float(coef.abs().max())
    return out


def _ref_linear(wl: Workload, mode: str) -> dict[str, Any]:
    from echoloss.loss import echo_loss
    from echoloss.ops import selective_logprobs

    h, w = wl.hidden, wl.weight
    assert h is not None and w is not None
    if mode == "no-grad":
        with torch.no_grad():
            return {"logprobs": selective_logprobs(h @ w.t(), wl.labels, backend="reference")}
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = echo_loss(hh @ ww.t(), wl.loss_inputs(), config=loss_config(), backend="reference").loss
    out: dict[str, Any] = {"loss": loss.detach()}
    if mode == "forward+backward":
        loss.backward()
        out["grads"] = {"hidden": hh.grad, "weight": ww.grad}
    return out


def compute_reference(wl: Workload, mode: str) -> dict[str, Any]:
    return _ref_logits(wl, mode) if wl.logits is not None else _ref_linear(wl, mode)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[bool, float]:
    a64, b64 = a.detach().double(), b.detach().double()
    err = float((a64 - b64).abs().max()) if a.numel() else 0.0
    ok = a.shape == b.shape and bool(torch.isfinite(a64).all()) and err == err
    ok = ok and bool(((a64 - b64).abs() <= atol + rtol * b64.abs()).all())
    return ok, err


def gate(wl: Workload, mode: str, out: Outputs, ref: dict[str, Any]) -> dict[str, Any]:
    """Compare one provider's outputs with the reference: ``passed`` and every error checked."""
    checks: dict[str, Any] = {}
    if mode == "no-grad":
        assert out.logprobs is not None
        ok, err = _close(out.logprobs.reshape(-1).float(), ref["logprobs"], *STAT_TOL)
        checks["logprobs"] = {
            "passed": ok,
            "max_abs_err": err,
            "atol": STAT_TOL[0],
            "rtol": STAT_TOL[1],
        }
    else:
        assert out.loss is not None
        ok, err = _close(out.loss.reshape(()).float(), ref["loss"].float(), *LOSS_TOL)
        checks["loss"] = {
            "passed": ok,
            "abs_err": err,
            "value": float(out.loss.detach()),
            "reference": float(ref["loss"]),
            "atol": LOSS_TOL[0],
            "rtol": LOSS_TOL[1],
        }
    if mode == "forward+backward" and "grad_rows" in ref:
        assert out.grad_rows is not None
        idx = ref["grad_idx"]
        got = out.grad_rows(idx)
        exp = ref["grad_rows"]
        rtol = GRAD_RTOL.get(exp.dtype, 1e-4)
        atol = GRAD_ATOL_PER_COEF * ref["coef_scale"]
        ok_dtype = got.dtype == exp.dtype
        ok, err = _close(got.float(), exp.float(), atol, rtol)
        checks["dlogits"] = {
            "passed": ok and ok_dtype,
            "max_abs_err": err,
            "rows_checked": int(idx.numel()),
            "dtype": str(got.dtype).replace("torch.", ""),
            "atol": atol,
            "rtol": rtol,
        }
    if mode == "forward+backward" and "grads" in ref:
        atol_r, rtol = LINEAR_GRAD_TOL.get(wl.dtype, (1e-4, 1e-4))
        for k, exp in ref["grads"].items():
            got = out.grads[k]
            scale = float(exp.float().abs().max())
            ok, err = _close(got.float(), exp.float(), atol_r * scale, rtol)
            checks[f"d{k}"] = {
                "passed": ok,
                "max_abs_err": err,
                "atol": atol_r * scale,
                "rtol": rtol,
            }
    return {"passed": all(c["passed"] for c in checks.values()), "checks": checks}


# -- one shape -----------------------------------------------------------------------------


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(e)


def new_row(base_row: dict[str, Any], wl: Workload, p: Provider, mode: str) -> dict[str, Any]:
    """A result row with every field of the schema, nothing measured yet."""
    return {
        **base_row,
        "op": p.op,
        "provider": p.name,
        "mode": mode,
        "status": "ok",
        "reason": None,
        "gate": None,
        "time_ms": None,
        "peak_bytes": None,
        "peak_extra_bytes": None,
        "floor_bytes": floor_bytes(wl, mode),
        "effective_GBps": None,
        "pct_of_peak_bandwidth": None,
        "floor_ms": None,
        "model_TFLOPs": None,
        "note": p.note,
        "host_syncs": None,
        "launches": None,
        "loadavg_before_after": None,
    }


def count_call(fn: Callable[[], Outputs]) -> dict[str, Any]:
    """Host syncs and aten launches of one call, on the CUDA code path (``benchmarks/counting.py``).

    Triton kernels are not aten ops: on CUDA ``launches`` counts everything *besides* them. On
    CPU the echoloss providers run their CUDA code path here (``device_code_path``) with the
    PyTorch reference as the phases, whose ops are then part of ``launches``.
    """
    from benchmarks.counting import count_ops
    from echoloss._deferred import device_code_path, raise_deferred_errors

    with device_code_path(), count_ops() as c:
        fn()
    raise_deferred_errors()
    return {"host_syncs": c.num_syncs, "launches": c.num_launches}


def run_shape(
    ctx: Context,
    wl: Workload,
    providers: list[Provider],
    modes: list[str],
    *,
    repeats: int,
    warmup: int,
    base_row: dict[str, Any],
    peak_bw: float | None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Gate, then measure, every provider in every mode at one shape. Returns the rows."""
    rows: list[dict[str, Any]] = []
    for mode in modes:
        try:
            ref = compute_reference(wl, mode)
        except Exception as e:  # the gate cannot run: record every provider, measure nothing
            failed: dict[str, Any] = {}
            _fail(ctx, failed, e)
            for p in providers:
                row = new_row(base_row, wl, p, mode)
                row.update(status=failed["status"], reason=f"no reference: {failed['reason']}")
                rows.append(row)
            log(f"  {mode:17s} reference failed ({failed['status']}): nothing measured")
            continue
        runnable: dict[str, Callable[[], Outputs]] = {}
        mode_rows: dict[str, dict[str, Any]] = {}
        for p in providers:
            row = new_row(base_row, wl, p, mode)
            if p.name == "trl":
                row["note"] = trl_note(wl)
            mode_rows[p.name] = row
            rows.append(row)
            reason = p.unavailable(ctx)
            if reason is not None:
                row.update(status="skipped", reason=reason)
                log(f"  {mode:17s} {p.name:16s} skipped: {reason}")
                continue
            try:
                fn = p.build(wl, mode, ctx)
                g = gate(wl, mode, fn(), ref)
            except Exception as e:  # a provider that crashes is recorded, not fatal
                _fail(ctx, row, e)
                log(f"  {mode:17s} {p.name:16s} {row['status']}: {row['reason'][:160]}")
                continue
            row["gate"] = g
            if not g["passed"]:
                row.update(status="gate-failed", reason="outputs disagree with the reference")
                log(f"  {mode:17s} {p.name:16s} GATE FAILED: {_gate_summary(g)}")
                continue
            runnable[p.name] = fn
        # Memory: one call each (the gate call was the warm-up); then one counted call.
        for name, fn in list(runnable.items()):
            try:
                mode_rows[name].update(measure_memory(ctx, fn))
                mode_rows[name].update(count_call(fn))
            except Exception as e:
                _fail(ctx, mode_rows[name], e)
                del runnable[name]
        load_before = loadavg()
        if ctx.kind == "cpu":
            times = time_cpu(runnable, repeats)
        else:
            times = time_cuda_mirrored(
                ctx,
                runnable,
                warmup,
                repeats,
                on_error=functools.partial(_fail_named, ctx, mode_rows),
            )
            for name in set(runnable) - set(times):
                del runnable[name]
        load_after = loadavg()
        for name, ts in times.items():
            row = mode_rows[name]
            t = summarize(ts)
            row["time_ms"] = t
            row["loadavg_before_after"] = [load_before, load_after]
            fb = row["floor_bytes"]
            if fb is not None:
                row["effective_GBps"] = fb / (t["median"] * 1e-3) / 1e9
                if peak_bw is not None:
                    row["floor_ms"] = fb / peak_bw * 1e3
                    row["pct_of_peak_bandwidth"] = 100.0 * row["floor_ms"] / t["median"]
            fl = model_flops(wl, mode)
            if fl is not None:
                row["model_TFLOPs"] = fl / (t["median"] * 1e-3) / 1e12
        for name in mode_rows:
            log("  " + format_row(mode_rows[name]))
        del ref
    return rows


def _fail_named(ctx: Context, rows: dict[str, dict[str, Any]], name: str, e: BaseException) -> None:
    """`_fail` for the row of provider ``name``."""
    _fail(ctx, rows[name], e)


def _fail(ctx: Context, row: dict[str, Any], e: BaseException) -> None:
    """Record a crash (``oom`` or ``error``) and drop what the failed call left allocated."""
    e.__traceback__ = None  # its frames hold the failed call's tensors
    gc.collect()
    if ctx.kind == "cuda":
        torch.cuda.empty_cache()
    row.update(
        status="oom" if _is_oom(e) else "error",
        reason=f"{type(e).__name__}: {e}"[:500],
        peak_bytes=None,
        peak_extra_bytes=None,
    )


def _gate_summary(g: dict[str, Any]) -> str:
    parts = []
    for k, c in g["checks"].items():
        if not c["passed"]:
            err = c.get("max_abs_err", c.get("abs_err"))
            parts.append(f"{k} max|Δ|={err:.3g}")
    return ", ".join(parts)


def format_row(r: dict[str, Any]) -> str:
    head = f"{r['mode']:17s} {r['provider']:16s}"
    if r["status"] != "ok" or r["time_ms"] is None:
        return f"{head} {r['status']}" + (f": {r['reason'][:120]}" if r["reason"] else "")
    t = r["time_ms"]
    s = f"{head} {t['median']:9.2f} ms [{t['p25']:.2f}, {t['p75']:.2f}]"
    if r["peak_extra_bytes"] is not None:
        s += f"  peak extra {r['peak_extra_bytes'] / 2**20:9.1f} MiB"
    if r["effective_GBps"] is not None:
        s += f"  {r['effective_GBps']:8.1f} GB/s"
    if r["pct_of_peak_bandwidth"] is not None:
        s += f" ({r['pct_of_peak_bandwidth']:.0f}% of floor)"
    if r["model_TFLOPs"] is not None:
        s += f"  {r['model_TFLOPs']:.2f} TFLOP/s"
    return s


def base_row(sweep: str, wl: Workload, env: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "sweep": sweep,
        "n": wl.n,
        "v": wl.v,
        "h": wl.h,
        "dtype": str(wl.dtype).replace("torch.", ""),
        "workload": {
            "rl_rows": int(wl.rl_mask.sum()),
            "echo_rows": int((wl.echo_weights > 0).sum()),
            "seq_len": wl.seq_len,
            "loss": loss_config().model_dump(
                include={"policy", "rl_normalization", "echo_normalization"}
            ),
        },
        "env": env,
    }
