"""GPU benchmark: the fused Triton logits path of ``echo_loss`` against its PyTorch reference,
``torch.compile`` of the naive reference op, and (when installed) Liger's Triton GRPO loss.

Workload (issue 5): ``N = 16,384`` tokens, ``V = 151,936`` (Qwen3), bf16 logits, forward+backward
of the split loss with the RL term (ppo_clip), the echo term and the entropy metric. 60% of the
rows are RL rows, 30% echo rows, 10% take part in nothing (prompt/padding).

Providers (each: the median, p20 and p80 of ``--repeats`` timed runs after ``--warmup`` runs,
CUDA events around forward+backward; the peak extra memory of one run over what was allocated
before it, ``torch.cuda.max_memory_allocated``):

- ``reference``: ``echo_loss(..., backend="reference")`` (chunked PyTorch, fp32 math);
- ``triton``: ``echo_loss(..., backend="triton")`` (the two fused phases);
- ``compiled_reference``: ``torch.compile`` of the naive op (``log_softmax(z.float()/T)`` gather
  and entropy, whole batch) feeding ``echo_loss_from_logprobs``;
- ``liger``: ``liger_kernel.transformers.grpo_loss.triton_grpo_loss`` (DAPO loss, beta 0) on the
  same logits as ``[B, L+1, V]`` with per-sequence advantages. It computes **less** (no echo term,
  no entropy), so it is reported but not gated against our loss;
- ``fused_linear`` / ``linear_then_logits`` with ``--hidden H``: ``echo_loss_from_hidden`` against
  ``echo_loss(hidden @ weight.T)`` (GEMM-bound; memory is the point).

A correctness gate runs first: ``triton`` and ``compiled_reference`` are compared with
``reference`` (loss within 1e-5 relative; ``dlogits`` within one bf16 ulp, ``rtol = 2^-7``,
``atol = 1e-5·max|dlogits|``). No speedup is printed or saved for a provider on a red gate.

The bandwidth floor of the logits path is three passes over the bf16 logits (read in phase 1,
read and write in phase 2): ``6·N·V`` bytes, 4.46 ms on an H100 SXM (3.35 TB/s) and 3.11 ms on an
H200 (4.8 TB/s) at this shape (``/work/shared/reference/kernels-and-estimators.md`` §6); the
result reports the achieved fraction where the GPU's datasheet bandwidth is known.

Usage::

    python benchmarks/bench_fused_gpu.py
    python benchmarks/bench_fused_gpu.py --n 4096 --repeats 5 --providers reference,triton
    python benchmarks/bench_fused_gpu.py --sweep-launch      # also time BLOCK_V / num_warps
    python benchmarks/bench_fused_gpu.py --hidden 4096       # add the fused-linear providers

Writes ``benchmarks/results/fused_gpu_<gpu>_N<n>_V<v>.json`` (GPU name, torch/triton/CUDA
versions, git sha). Refuses to run without a CUDA device.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PROVIDERS = ("reference", "triton", "compiled_reference", "liger")
#: Where everything is allocated (a module constant so that the CPU smoke test can redirect it).
DEVICE = torch.device("cuda")
#: Datasheet HBM bandwidth (bytes/s) by device-name pattern, as quoted in
#: kernels-and-estimators.md §6. Other GPUs get GB/s without a floor fraction.
PEAK_BANDWIDTH = [
    (r"H200", 4.8e12),
    (r"H100(?!.*PCIe)", 3.35e12),
    (r"A100.*80GB", 2.0e12),
]


def _git_sha() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "echoloss"], capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _inputs(n: int, v: int, seed: int = 0) -> dict[str, Any]:
    """bf16 logits and the per-token loss inputs on CUDA (60% RL, 30% echo, 10% idle rows)."""
    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(seed)
    logits = torch.empty(n, v, dtype=torch.bfloat16, device=dev)
    for i in range(0, n, 1024):  # no full-size fp32 temporary
        rows = min(1024, n - i)
        logits[i : i + rows] = torch.randn(rows, v, generator=g, device=dev) * 2
    labels = torch.randint(0, v, (n,), generator=g, device=dev)
    u = torch.rand(n, generator=g, device=dev)
    rl, echo = u < 0.6, (u >= 0.6) & (u < 0.9)
    seq_len = 2048 if n % 2048 == 0 else n
    seq = torch.arange(n, device=dev) // seq_len
    seq_adv = torch.randn(int(seq.max()) + 1, generator=g, device=dev)
    with torch.no_grad():
        lp = torch.empty(n, device=dev)
        for i in range(0, n, 1024):
            lp[i : i + 1024] = (
                torch.log_softmax(logits[i : i + 1024].float(), -1)
                .gather(1, labels[i : i + 1024, None])
                .squeeze(1)
            )
    return {
        "logits": logits,
        "labels": labels,
        "rl_mask": rl,
        "echo_weights": torch.where(echo, 0.5, 0.0),
        "advantages": torch.where(rl, seq_adv[seq], 0.0),
        "inference_logprobs": torch.where(
            rl, lp + 0.05 * torch.randn(n, generator=g, device=dev), 0.0
        ),
        "sequence_ids": seq,
        "seq_len": seq_len,
        "seq_adv": seq_adv,
    }


def _loss_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    from echoloss.loss import LossConfig

    return {
        "rl_mask": d["rl_mask"],
        "echo_weights": d["echo_weights"],
        "advantages": d["advantages"],
        "inference_logprobs": d["inference_logprobs"],
        "config": LossConfig(policy="ppo_clip", compute_entropy=True),
    }


def _provider(name: str, d: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``fn(logits_leaf) -> loss`` for a logits provider, or None if it cannot run here."""
    from echoloss.loss import echo_loss, echo_loss_from_logprobs
    from echoloss.ops.selective_logprobs.reference import naive_selective_logprobs

    kw = _loss_kwargs(d)
    if name in ("reference", "triton"):
        return lambda x: echo_loss(x, d["labels"], backend=name, **kw).loss
    if name == "compiled_reference":
        op = torch.compile(naive_selective_logprobs, dynamic=False)

        def compiled(x: torch.Tensor) -> torch.Tensor:
            lp, ent = op(x, d["labels"], return_entropy=True)
            return echo_loss_from_logprobs(lp, entropy=ent.detach(), **kw).loss

        return compiled
    if name == "liger":
        try:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss
        except ImportError:
            return None
        n = d["logits"].shape[0]
        b, seq_len = n // d["seq_len"], d["seq_len"]
        mask = (d["rl_mask"] | (d["echo_weights"] > 0)).view(b, seq_len).int()
        old = d["inference_logprobs"].view(b, seq_len)
        ids = d["labels"].view(b, seq_len)

        def liger(x: torch.Tensor) -> torch.Tensor:
            loss, _ = triton_grpo_loss(
                x,
                old,
                None,
                ids,
                d["seq_adv"][:b],
                mask,
                temperature=1.0,
                beta=0.0,
                inplace=True,
                loss_type="dapo",
                reduce=True,
            )
            return loss

        return liger
    raise ValueError(name)


def _fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    x = logits.detach().requires_grad_()
    fn(x).backward()
    return x.grad


def _time(fn: Callable[[], Any], warmup: int, repeats: int) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {"median_ms": statistics.median(times), "p20_ms": q[1], "p80_ms": q[7]}


def _peak_extra(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def _gate(ref_loss, ref_grad, loss, grad) -> dict[str, Any]:
    loss_err = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-30)
    scale = float(ref_grad.float().abs().max())
    ok_grad = torch.allclose(grad.float(), ref_grad.float(), atol=1e-5 * scale, rtol=2.0**-7)
    mismatch = float((grad != ref_grad).float().mean())
    return {
        "passed": bool(loss_err <= 1e-5 and ok_grad),
        "loss_rel_err": loss_err,
        "dlogits_allclose": bool(ok_grad),
        "dlogits_fraction_not_bit_identical": mismatch,
    }


def _sweep_launch(d: dict[str, Any], warmup: int, repeats: int) -> list[dict[str, Any]]:
    """Phase 1 and phase 2 alone under candidate (BLOCK_V, num_warps) pairs."""
    from echoloss.ops.selective_logprobs import fused

    logits, labels = d["logits"], d["labels"]
    rows = (d["rl_mask"] | (d["echo_weights"] > 0)).nonzero().squeeze(1)
    n = rows.numel()
    a = torch.full((n,), 1e-4, device=logits.device)
    buf = torch.empty_like(logits)
    common = {"rows": rows, "inv_temperature": 1.0, "chunk_size": 1}

    def phase1():
        return fused.forward(logits, labels, need_entropy=True, **common)

    _, lse, _ = phase1()

    def phase2():
        return fused.backward(
            logits, labels, lse=lse, grad_logprobs=a, grad_entropy=None, entropy=None, out=buf,
            **common,
        )  # fmt: skip

    saved = dict(fused.LAUNCH)
    out = []
    try:
        for block in (2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                fused.LAUNCH.update(
                    fwd_block=block, fwd_warps=warps, bwd_block=block, bwd_warps=warps
                )
                out.append(
                    {
                        "block_v": block,
                        "num_warps": warps,
                        "forward": _time(phase1, warmup, repeats),
                        "backward": _time(phase2, warmup, repeats),
                    }
                )
    finally:
        fused.LAUNCH.update(saved)
    return out


def _fused_linear(d: dict[str, Any], hidden_size: int, warmup: int, repeats: int) -> dict[str, Any]:
    from echoloss.loss import echo_loss
    from echoloss.ops.fused_linear import echo_loss_from_hidden

    n, v = d["logits"].shape
    g = torch.Generator(device=DEVICE).manual_seed(3)
    hidden = torch.randn(n, hidden_size, generator=g, device=DEVICE).to(torch.bfloat16)
    weight = (torch.randn(v, hidden_size, generator=g, device=DEVICE) * hidden_size**-0.5).to(
        torch.bfloat16
    )
    kw = _loss_kwargs(d)

    def run(fused: bool):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        if fused:
            loss = echo_loss_from_hidden(h, w, d["labels"], backend="triton", **kw).loss
        else:
            loss = echo_loss(h @ w.t(), d["labels"], backend="triton", **kw).loss
        loss.backward()
        return loss.detach(), h.grad, w.grad

    res = {}
    for name, fused in (("fused_linear", True), ("linear_then_logits", False)):
        res[name] = {
            **_time(lambda f=fused: run(f), warmup, repeats),
            "peak_extra_bytes": _peak_extra(lambda f=fused: run(f)),
        }
    a, b = run(True), run(False)
    res["gate"] = {
        "loss_rel_err": abs(float(a[0]) - float(b[0])) / max(abs(float(b[0])), 1e-30),
        "hidden_grad_max_rel": float(
            (a[1].float() - b[1].float()).abs().max() / b[1].float().abs().max()
        ),
        "weight_grad_max_rel": float(
            (a[2].float() - b[2].float()).abs().max() / b[2].float().abs().max()
        ),
    }
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=16_384)
    p.add_argument("--v", type=int, default=151_936)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--sweep-launch", action="store_true", help="time BLOCK_V/num_warps candidates")
    p.add_argument("--hidden", type=int, default=0, help="H > 0 adds the fused-linear providers")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_fused_gpu: needs a CUDA device (none found); nothing was measured",
            file=sys.stderr,
        )
        return 2
    try:
        import triton
    except ImportError:
        print("bench_fused_gpu: needs triton (pip install 'echoloss[triton]')", file=sys.stderr)
        return 2
    import echoloss
    from echoloss.ops.selective_logprobs import fused

    providers = [s for s in args.providers.split(",") if s]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        p.error(f"unknown providers {sorted(unknown)}; choose from {PROVIDERS}")
    d = _inputs(args.n, args.v)
    logits = d["logits"]
    logits_bytes = logits.numel() * logits.element_size()
    gpu = torch.cuda.get_device_name()
    peak_bw = next((bw for pat, bw in PEAK_BANDWIDTH if re.search(pat, gpu)), None)
    traffic = 6 * args.n * args.v  # 3 passes over bf16 logits (§6)

    ref_fn = _provider("reference", d)
    assert ref_fn is not None
    ref_grad = _fwd_bwd(ref_fn, logits)
    ref_loss = ref_fn(logits.detach()).detach()
    results: dict[str, Any] = {}
    for name in providers:
        fn = _provider(name, d)
        if fn is None:
            results[name] = {"status": "skipped: not installed"}
            continue
        entry: dict[str, Any] = {"status": "ok"}
        if name in ("triton", "compiled_reference"):
            grad = _fwd_bwd(fn, logits)
            entry["gate"] = _gate(ref_loss, ref_grad, fn(logits.detach()).detach(), grad)
            del grad
        elif name == "liger":
            entry["gate"] = {"passed": None, "note": "different loss (no echo, no entropy)"}
        if name == "liger":
            # Liger reads [B, L+1, V] (the last position of each sequence is ignored) and writes
            # its gradient into that buffer: give it its own copy, allocated before measuring.
            b, seq_len = args.n // d["seq_len"], d["seq_len"]
            src = logits.new_zeros(b, seq_len + 1, args.v)
            src[:, :seq_len] = logits.view(b, seq_len, args.v)
        else:
            src = logits

        def run(fn=fn, src=src):
            return _fwd_bwd(fn, src)

        entry.update(_time(run, args.warmup, args.repeats))
        entry["peak_extra_bytes"] = _peak_extra(run)
        entry["peak_extra_over_logits"] = entry["peak_extra_bytes"] / logits_bytes
        entry["effective_GBps_3pass"] = traffic / (entry["median_ms"] * 1e-3) / 1e9
        if peak_bw is not None:
            entry["fraction_of_3pass_floor"] = (traffic / peak_bw * 1e3) / entry["median_ms"]
        results[name] = entry

    gated = {
        k: r
        for k, r in results.items()
        if r.get("status") == "ok" and (k == "reference" or r.get("gate", {}).get("passed"))
    }
    if "reference" in gated:
        base = gated["reference"]["median_ms"]
        for r in gated.values():
            r["speedup_vs_reference"] = base / r["median_ms"]
    red = [k for k, r in results.items() if r.get("gate", {}).get("passed") is False]

    result = {
        "benchmark": "fused_gpu",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "gpu_peak_bandwidth_Bps": peak_bw,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "echoloss": echoloss.__version__,
        "git_sha": _git_sha(),
        "shape": {"N": args.n, "V": args.v, "dtype": "bf16", "rows": "60% RL, 30% echo, 10% idle"},
        "launch": dict(fused.LAUNCH),
        "floor_ms_3pass": None if peak_bw is None else traffic / peak_bw * 1e3,
        "logits_bytes": logits_bytes,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "providers": results,
        "red_gates": red,
    }
    if args.sweep_launch:
        result["launch_sweep"] = _sweep_launch(d, args.warmup, args.repeats)
    if args.hidden > 0:
        result["fused_linear"] = {
            "H": args.hidden,
            **_fused_linear(d, args.hidden, args.warmup, args.repeats),
        }

    slug = re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_")
    out = (
        Path(args.out)
        if args.out
        else (
            Path(__file__).resolve().parent
            / "results"
            / f"fused_gpu_{slug}_N{args.n}_V{args.v}.json"
        )
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{gpu}  N={args.n} V={args.v} bf16  (floor {result['floor_ms_3pass']} ms)")
    for k, r in results.items():
        if r.get("status") != "ok":
            print(f"  {k:20s} {r['status']}")
            continue
        sp = f"  {r['speedup_vs_reference']:.2f}x" if "speedup_vs_reference" in r else ""
        gate = r.get("gate", {}).get("passed")
        print(
            f"  {k:20s} {r['median_ms']:8.2f} ms  peak extra {r['peak_extra_over_logits']:.2f}x "
            f"logits  gate={gate}{sp}"
        )
    print(f"wrote {out}")
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
