"""CPU benchmark: chunked ``selective_logprobs`` against the naive full-vocabulary path.

Reports, side by side in one run, the peak extra memory and the median time of

- ``naive``: ``log_softmax(logits.float() / T, -1).gather(-1, labels)`` (plus the entropy
  ``-(p · log p).sum(-1)`` for the ``+entropy`` rows), and
- ``chunked``: :func:`echoloss.selective_logprobs` (``return_entropy`` for the ``+entropy`` rows),

in forward only (``no_grad``: old/reference logprobs) and forward+backward (``lp.sum()`` (+ entropy)
backward, which allocates the ``[N, V]`` gradient in both paths). Targets (issue 4): at N = 4096,
V = 65,536 the chunked forward uses ≤ 0.25× the naive peak extra memory and ≤ 1.2× its time.

Method: memory is measured in a fresh subprocess per variant, so that one variant's allocations
cannot hide another's: the child builds the inputs, resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``), runs the variant once and reads ``VmHWM - VmRSS(before)``, the peak
extra resident memory of that call. Time is measured in one subprocess per (dtype, mode,
entropy) that runs naive and chunked alternately, ``--repeats`` times each after a warm-up call,
and reports the medians: both paths see the same machine state. A correctness gate compares the
two paths on a few rows before anything is measured: no ratio is reported on a red gate.

Usage::

    python benchmarks/bench_selective_logprobs_cpu.py            # N=4096, V=65536, fp32 and bf16
    python benchmarks/bench_selective_logprobs_cpu.py --n 512 --v 8192 --repeats 3 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

VARIANTS = ["naive", "chunked", "naive+entropy", "chunked+entropy"]
MODES = ["forward", "forward+backward"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _inputs(n: int, v: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.empty(n, v, dtype=dtype)
    for i in range(0, n, 256):  # fill in slices: no full-size fp32 temporary
        logits[i : i + 256] = torch.randn(min(256, n - i), v, generator=g) * 2
    labels = torch.randint(0, v, (n,), generator=g)
    return logits, labels


def _naive(logits, labels, entropy: bool):
    lsm = torch.log_softmax(logits.float(), dim=-1)
    lp = lsm.gather(-1, labels[:, None]).squeeze(-1)
    if not entropy:
        return lp, None
    return lp, -(lsm.exp() * lsm).sum(-1)


def _chunked(logits, labels, entropy: bool):
    from echoloss.ops import selective_logprobs

    out = selective_logprobs(logits, labels, return_entropy=entropy)
    return out if entropy else (out, None)


def _call(variant: str, mode: str, logits, labels):
    fn = _naive if variant.startswith("naive") else _chunked
    entropy = variant.endswith("+entropy")
    if mode == "forward":
        with torch.no_grad():
            return fn(logits, labels, entropy)
    x = logits.detach().requires_grad_()
    lp, ent = fn(x, labels, entropy)
    (lp.sum() + (ent.sum() if ent is not None else 0)).backward()
    return lp, ent


def memory_child(spec: dict) -> dict:
    """Runs in a fresh subprocess: the peak extra memory of one call of one variant."""
    torch.set_num_threads(spec["threads"])
    logits, labels = _inputs(spec["n"], spec["v"], DTYPES[spec["dtype"]])
    _call(spec["variant"], spec["mode"], logits[:8], labels[:8])  # import/dispatch warm-up
    before = _status_kib("VmRSS")
    reset = _reset_peak()
    _call(spec["variant"], spec["mode"], logits, labels)
    peak = _status_kib("VmHWM")
    return {"peak_extra_mib": (peak - before) / 1024, "peak_reset_ok": reset}


def timing_child(spec: dict) -> dict:
    """Runs in a subprocess: naive and chunked timed alternately on the same inputs.

    Alternating the two (after one warm-up call each) gives both the same machine state, which
    matters on VMs where first-touch page faults are slow and the load varies over time.
    """
    torch.set_num_threads(spec["threads"])
    logits, labels = _inputs(spec["n"], spec["v"], DTYPES[spec["dtype"]])
    ent = "+entropy" if spec["entropy"] else ""
    times: dict[str, list[float]] = {"naive" + ent: [], "chunked" + ent: []}
    for variant in times:
        _call(variant, spec["mode"], logits, labels)
    for _ in range(spec["repeats"]):
        for variant, ts in times.items():
            t0 = time.perf_counter()
            _call(variant, spec["mode"], logits, labels)
            ts.append(time.perf_counter() - t0)
    return {
        v: {"median_s": statistics.median(ts), "min_s": min(ts), "times_s": ts}
        for v, ts in times.items()
    }


def _run_child(kind: str, spec: dict) -> dict:
    res = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps({**spec, "kind": kind})],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"])},
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def correctness_gate(v: int, dtype: torch.dtype) -> float:
    """Max |Δ| of logprob and entropy between the two paths on 16 rows (must be tiny)."""
    logits, labels = _inputs(16, v, dtype, seed=1)
    with torch.no_grad():
        a = _naive(logits, labels, True)
        b = _chunked(logits, labels, True)
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--v", type=int, default=65536)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    p.add_argument("--note", default="", help="free text stored in the JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        spec = json.loads(args.child)
        fn = memory_child if spec["kind"] == "memory" else timing_child
        print(json.dumps(fn(spec)))
        return

    from echoloss.ops.selective_logprobs.reference import default_chunk_size

    dtypes = args.dtypes.split(",")
    rows, ratios = [], []
    load_start = os.getloadavg()
    base = {"n": args.n, "v": args.v, "repeats": args.repeats, "threads": args.threads}
    for dt in dtypes:
        err = correctness_gate(args.v, DTYPES[dt])
        if not err < 1e-3:
            sys.exit(f"correctness gate failed for {dt}: max |Δ| = {err}; no numbers reported")
        for mode in MODES:
            for entropy in (False, True):
                spec = {**base, "dtype": dt, "mode": mode, "entropy": entropy}
                timing = _run_child("timing", spec)
                pair = {}
                for variant, t in timing.items():
                    mem = _run_child("memory", {**spec, "variant": variant})
                    r = {**spec, "variant": variant, **mem, **t, "gate_max_abs_err": err}
                    rows.append(r)
                    pair[variant.split("+")[0]] = r
                    print(
                        f"{dt:5s} {mode:17s} {variant:16s} peak extra "
                        f"{r['peak_extra_mib']:8.1f} MiB   median {r['median_s'] * 1e3:8.1f} ms"
                        f"   min {r['min_s'] * 1e3:8.1f} ms",
                        flush=True,
                    )
                ratios.append(
                    {
                        "dtype": dt,
                        "mode": mode,
                        "entropy": entropy,
                        "memory_ratio": pair["chunked"]["peak_extra_mib"]
                        / max(pair["naive"]["peak_extra_mib"], 1e-9),
                        "time_ratio": pair["chunked"]["median_s"] / pair["naive"]["median_s"],
                        "time_ratio_min": pair["chunked"]["min_s"] / pair["naive"]["min_s"],
                        # Ratio of each alternated (naive, chunked) pair, then the median: the
                        # most load-robust estimate on a shared machine.
                        "time_ratio_paired_median": statistics.median(
                            c / n
                            for c, n in zip(
                                pair["chunked"]["times_s"], pair["naive"]["times_s"], strict=True
                            )
                        ),
                    }
                )

    print("\nchunked / naive (targets for forward: memory ≤ 0.25, time ≤ 1.2)")
    for r in ratios:
        print(
            f"{r['dtype']:5s} {r['mode']:17s} entropy={r['entropy']!s:5s} "
            f"memory {r['memory_ratio']:.3f}x   time {r['time_ratio']:.3f}x "
            f"(min {r['time_ratio_min']:.3f}x, paired {r['time_ratio_paired_median']:.3f}x)"
        )
    fwd = [r for r in ratios if r["mode"] == "forward"]
    result = {
        "benchmark": "selective_logprobs_cpu",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": _git_sha(),
        "machine": {
            "cpu": _cpu_name(),
            "logical_cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "torch_version": torch.__version__,
        "torch_threads": args.threads,
        "note": args.note,
        "loadavg_start_end": [list(load_start), list(os.getloadavg())],
        "n": args.n,
        "v": args.v,
        "chunk_rows": default_chunk_size(args.v),
        "repeats": args.repeats,
        "method": "memory: a fresh subprocess per variant, peak extra = VmHWM - VmRSS before "
        "one call (VmHWM reset via /proc/self/clear_refs); time: naive and chunked alternated "
        "in one subprocess after a warm-up call each, median of the repeats",
        "targets": {"forward_memory_ratio_max": 0.25, "forward_time_ratio_max": 1.2},
        "targets_met": all(r["memory_ratio"] <= 0.25 and r["time_ratio"] <= 1.2 for r in fwd),
        "results": rows,
        "ratios": ratios,
    }
    out = (
        Path(args.out)
        if args.out
        else (
            Path(__file__).resolve().parent
            / "results"
            / f"selective_logprobs_cpu_N{args.n}_V{args.v}_t{args.threads}.json"
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
