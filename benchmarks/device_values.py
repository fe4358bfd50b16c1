"""The ``echoloss.nn`` modules for every ``loss_type`` on a device against the CPU path.

``python -m benchmarks.device_values [--device cuda] [--output FILE.jsonl]``: for each TRL
``loss_type`` that echoloss maps (`echoloss.nn.grpo.GRPO_LOSS_TYPES`), at both
``importance_sampling_level`` values, `EchoGRPOLoss` (logits) and `EchoFusedLinearGRPOLoss`
(hidden states and LM head) run once on the device (its code path: Triton phases, row program
and value checks on CUDA) and once on the CPU (the PyTorch path CI tests), both on the same fp32
inputs, and once on the CPU in fp64 (the gold). Each value is compared with the gold: the loss,
every metric and the gradients (of the logits, or of the hidden states and the LM head).

Pass rule, per value (the device's error against the gold's fp64 may be no larger than the CPU
path's own error, up to the difference summation order makes): ``err_device ≤ max(4·err_cpu,
64·ulp32(max|gold|))``. 64 fp32 ulps of the largest value cover sums of the few thousand terms
here in another order (their rounding errors grow like ``√N·ulp``, about 50 ulps at N = 2,500,
and the sums are of terms of one sign or of both); 4× the CPU error covers a device whose error
is of the same size as the CPU's but not of the same sign. A wrong row, a missed row or a
derivative of the wrong sign moves a value by far more.

Shapes: ``B = 5`` completions of ``T = 503`` tokens (odd: the last program block partial), ``V
= 1531``, ``H = 96``; a float attention mask with padding at the end of each completion, echo
weights on about a fifth of the tokens, old and reference logprobs (``beta = 0.04``).

Exit status: 0 when every value passes, 1 when one fails or a case raises on the device (its
row says why), 2 when the device is not there. Without ``--device`` the device is CUDA when
available, else the CPU's device code path (``echoloss._deferred.device_code_path``): the CUDA
code path with the PyTorch phases, which CI runs (``tests/test_benchmarks.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

B, T, V, H = 5, 503, 1531, 96
#: Multiples of the pass rule (module docstring).
CPU_FACTOR = 4.0
ULPS = 64.0
MODULES = ("EchoGRPOLoss", "EchoFusedLinearGRPOLoss")
LEVELS = ("token", "sequence")


def loss_types() -> list[str]:
    from echoloss.nn.grpo import GRPO_LOSS_TYPES

    return [k for k, what in GRPO_LOSS_TYPES.items() if what == "mapped"]


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """One batch in fp64 on the CPU (cast per run)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.float64)
    for b in range(B):
        mask[b, T - 1 - 37 * b :] = 0  # padding at the end, of another length per completion
    return {
        "hidden": torch.randn(B, T, H, generator=g, dtype=torch.float64),
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64) * H**-0.5 * 3,
        "ids": torch.randint(0, V, (B, T), generator=g),
        "mask": mask,
        "advantages": torch.randn(B, generator=g, dtype=torch.float64),
        "ref": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        "old": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        "echo": torch.where(torch.rand(B, T, generator=g) < 0.2, 0.25, 0.0).double() * mask,
    }


def run_case(
    module: str,
    loss_type: str,
    level: str,
    x: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """One forward+backward; every value returned in fp64 on the CPU."""
    from echoloss import nn as enn

    cls = getattr(enn, module)
    loss_fn = cls(
        loss_type=loss_type, importance_sampling_level=level, beta=0.04, max_completion_length=T
    )
    t = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in x.items()}
    kw = dict(echo_weights=t["echo"])
    if module == "EchoGRPOLoss":
        logits = (t["hidden"] @ t["weight"].t()).detach().requires_grad_()
        out = loss_fn(logits, t["ids"], t["mask"], t["advantages"], t["ref"], t["old"], **kw)
        leaves = {"d_logits": logits}
    else:
        hidden = t["hidden"].detach().requires_grad_()
        weight = t["weight"].detach().requires_grad_()
        out = loss_fn(
            hidden,
            weight,
            t["ids"],
            t["mask"],
            t["advantages"],
            ref_per_token_logps=t["ref"],
            old_per_token_logps=t["old"],
            **kw,
        )
        leaves = {"d_hidden": hidden, "d_weight": weight}
    out.loss.backward()
    values = {"loss": out.loss.detach()}
    values |= {f"metric {k}": v.detach() for k, v in out.metrics.items()}
    values |= {k: leaf.grad for k, leaf in leaves.items() if leaf.grad is not None}
    return {k: v.detach().to("cpu", torch.float64) for k, v in values.items()}


def _ulp32(x: float) -> float:
    return math.ulp(max(abs(x), float(torch.finfo(torch.float32).tiny))) * 2.0**29  # fp64 → fp32


def compare(name: str, dev: torch.Tensor, cpu: torch.Tensor, gold: torch.Tensor) -> dict[str, Any]:
    """One value's errors against the gold and the pass rule (module docstring)."""
    scale = float(gold.abs().max()) if gold.numel() else 0.0
    finite = bool(torch.isfinite(gold).all())

    def err(a: torch.Tensor) -> float:
        if a.shape != gold.shape:
            return math.inf
        if not finite:  # a non-finite gold value must be the same non-finite value
            same = torch.equal(a.isnan(), gold.isnan()) and torch.equal(
                a.nan_to_num(), gold.nan_to_num()
            )
            return 0.0 if same else math.inf
        return float((a - gold).abs().max()) if a.numel() else 0.0

    e_dev, e_cpu = err(dev), err(cpu)
    allowed = max(CPU_FACTOR * e_cpu, ULPS * _ulp32(scale))
    return {
        "value": name,
        "max_abs_gold": scale,
        "err_device": e_dev,
        "err_cpu": e_cpu,
        "allowed": allowed,
        "passed": bool(e_dev <= allowed),
    }


def check(
    device: torch.device,
    env: dict[str, Any],
    *,
    modules: tuple[str, ...] = MODULES,
    types: tuple[str, ...] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Every module × loss_type × level: rows of compared values (or one row of an error)."""
    from echoloss._deferred import device_code_path, raise_deferred_errors

    x = inputs()
    rows: list[dict[str, Any]] = []
    for module in modules:
        for loss_type in types or loss_types():
            for level in LEVELS:
                base = {"module": module, "loss_type": loss_type, "level": level, **env}
                try:
                    gold = run_case(module, loss_type, level, x, torch.device("cpu"), torch.float64)
                except ValueError as e:  # a combination the mapping refuses (on every device)
                    rows.append({**base, "status": "refused", "reason": str(e)[:300]})
                    log(f"{module:24s} {loss_type:8s} {level:8s} refused: {str(e)[:80]}")
                    continue
                cpu = run_case(module, loss_type, level, x, torch.device("cpu"), torch.float32)
                try:
                    with device_code_path():
                        dev = run_case(module, loss_type, level, x, device, torch.float32)
                        raise_deferred_errors()
                except Exception as e:  # recorded: the device run failed where the CPU's ran
                    rows.append({**base, "status": "error", "reason": f"{type(e).__name__}: {e}"})
                    log(f"{module:24s} {loss_type:8s} {level:8s} ERROR {type(e).__name__}: {e}")
                    continue
                missing = sorted(set(gold) ^ set(dev))
                if missing:
                    rows.append({**base, "status": "error", "reason": f"values differ: {missing}"})
                    log(f"{module:24s} {loss_type:8s} {level:8s} ERROR values {missing}")
                    continue
                case = [compare(k, dev[k], cpu[k], gold[k]) for k in gold]
                bad = [c["value"] for c in case if not c["passed"]]
                for c in case:
                    rows.append({**base, "status": "ok" if c["passed"] else "failed", **c})
                worst = max(c["err_device"] / c["allowed"] if c["allowed"] else 0 for c in case)
                verdict = f"FAILED {bad}" if bad else "ok"
                log(
                    f"{module:24s} {loss_type:8s} {level:8s} {len(case):3d} values, worst "
                    f"{worst:.2f} of allowed: {verdict}"
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_values")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--output", type=Path, default=None, help="JSON lines, one per value")
    p.add_argument("--modules", default=",".join(MODULES), help="comma list (default: both)")
    p.add_argument("--loss-types", default="", help="comma list (default: every mapped one)")
    args = p.parse_args(argv)
    modules = tuple(x for x in args.modules.split(",") if x)
    types = tuple(x for x in args.loss_types.split(",") if x) or None
    unknown = (set(modules) - set(MODULES)) | (set(types or ()) - set(loss_types()))
    if unknown:
        p.error(f"unknown modules or loss types {sorted(unknown)}")
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        print("benchmarks.device_values: --device cuda needs a CUDA device (none found)")
        return 2
    from benchmarks.harness import device_name, environment
    from benchmarks.providers import Context

    ctx = Context(kind=kind, device=torch.device(kind))
    full = environment(ctx, torch.get_num_threads(), None)
    env = {k: full[k] for k in ("device_name", "git_sha", "git_dirty", "timestamp", "versions")}
    print(f"echoloss.nn on {device_name(ctx)} ({kind} code path) against the CPU path, fp32")
    rows = check(torch.device(kind), env, modules=modules, types=types)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cases = {(r["module"], r["loss_type"], r["level"]) for r in rows if r["status"] != "refused"}
    bad = {
        (r["module"], r["loss_type"], r["level"])
        for r in rows
        if r["status"] in ("failed", "error")
    }
    print(f"{len(cases) - len(bad)} of {len(cases)} module cases pass ({len(rows)} rows)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
