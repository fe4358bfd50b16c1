"""The trainer's RL update on the packaged SmolLM2-135M-Instruct, by forward, side by side:
``python -m benchmarks.update_step``.

One set of rollouts, sampled by the trainer's own generation from ``configs/pretrained.toml``
(calculator, T = 0.7; ``--prompts`` x ``--group``), is trained by the trainer's steps 4-6
(`echoloss.train.recipe.make_micro_batches`, ``forward_backward``, ``update``: packing, forward,
loss, backward, clipping, AdamW) with each ``model.update_forward``:

* ``logits``: every row's logits, the update before the hidden-state path and the shared prefix;
* ``packed``: the LM head only on the rows that carry loss;
* ``shared_prefix``: that, and the prompt prefix shared by the samples computed once;

and beside them a plain ``transformers`` forward + backward of the same token sequences
(right-padded batch, ``labels`` on the same loss rows, the model's own cross-entropy) with the
same clipping and AdamW step. Every variant runs under the trainer's autocast (``model.dtype``),
round-robin (A, B, C, D, A, ...) so that each sees the same machine load; the median of the
repeats is reported. AdamW runs at lr 0 (all its work, the weights unchanged), so every step
trains the same weights, and a gate checks that ``packed`` and ``shared_prefix`` gave the
losses and gradient norm of ``logits`` (within 2 %: bf16 compute in different shapes).

The generation of the rollouts is timed too, with the shared prompt prefilled once and without
(the first with the run's seed; the second from the same seed, so it samples the same episodes
up to the rounding of a different prefill).

Results: ``benchmarks/results/update-step_<cpu>_<UTC time>.json`` (CPU name, versions, git sha,
threads, load average before and after).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
FORWARDS = ("logits", "packed", "shared_prefix")


def _plain_step(run: Any, samples: list[Any]) -> float:
    """A plain transformers forward + backward of the samples (right-padded batch, the loss
    rows as labels, everything else -100), then clipping and AdamW: the reference cost."""
    import echoloss
    from echoloss.train.recipe import update
    from echoloss.train.runtime import autocast

    rows = len(samples)
    width = max(len(s) for s in samples)
    pad = run.tok.pad_token_id
    ids = torch.full((rows, width), pad, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    labels = torch.full((rows, width), -100, dtype=torch.long)
    for r, s in enumerate(samples):
        [b] = echoloss.pack([s], max_tokens=len(s))
        n = len(s)
        ids[r, :n] = b.input_ids
        mask[r, :n] = 1
        trained = b.rl_mask | (b.echo_weights > 0)
        labels[r, :n] = torch.where(trained, b.input_ids, torch.full_like(b.input_ids, -100))
    for group in run.opt.param_groups:
        group["lr"] = 0.0  # as the trainer's steps here: AdamW's work, the weights unchanged
    t0 = time.perf_counter()
    with autocast(run.dtype, run.ranks.device):
        loss = run.model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    update(run)
    return time.perf_counter() - t0


def _trainer_step(run: Any, samples: list[Any], phase: Any, forward: str) -> tuple[float, Any]:
    """The trainer's steps 4-6 with ``forward``: (seconds, Trained, grad norm)."""
    from echoloss.train.recipe import forward_backward, make_micro_batches, update

    run.forward = forward
    t0 = time.perf_counter()
    mb = make_micro_batches(run, samples)
    trained = forward_backward(run, mb, phase, 0)
    grad_norm = update(run)
    return time.perf_counter() - t0, (trained, grad_norm, len(mb.batches))


def _gate_values(trained: Any, grad_norm: float) -> dict[str, float]:
    m = {name: sums.result(1) for name, sums in trained.metrics.items()}["main"]
    return {
        "loss_rl": m["loss_rl/all"],
        "loss_echo": m.get("loss_echo/all", 0.0),
        "grad_norm": grad_norm,
    }


def _gate(out: dict[str, dict[str, float]], adv_abs: float) -> list[str]:
    """Where a forward's losses or gradient norm (of its first timed step: lr 0 keeps the
    weights, so all are at the same weights) differ from those of ``logits``: the echo loss and
    the gradient norm within 2 % (bf16 compute in different shapes; the ``logits`` path rounds
    the logits themselves to bf16), the RL loss within 1 % of the mean |advantage| (a GRPO loss
    is a near-cancelling sum of advantages times ratios near 1, so only an absolute tolerance
    on the advantages' scale means anything). Empty when all agree."""
    problems = []
    for forward in [f for f in FORWARDS[1:] if f in out and "logits" in out]:
        for key, want in out["logits"].items():
            got = out[forward][key]
            tol = {"abs_tol": 1e-2 * adv_abs} if key == "loss_rl" else {"rel_tol": 2e-2}
            if not math.isclose(got, want, **tol):
                problems.append(f"{forward} {key} = {got:.6g}, logits gives {want:.6g}")
    return problems


def _generate(run: Any, step: int, shared: bool) -> tuple[float, list[Any]]:
    from echoloss.train import data
    from echoloss.train.runtime import autocast

    seed_state = torch.random.get_rng_state()
    real = data._shared_prompt
    if not shared:
        data._shared_prompt = lambda *a: False
    try:
        torch.manual_seed(run.cfg.train.seed * 1000 + step)
        t0 = time.perf_counter()
        with autocast(run.dtype, run.ranks.device):
            rollouts = run.source.get(step, run.model)
        return time.perf_counter() - t0, rollouts
    finally:
        data._shared_prompt = real
        torch.random.set_rng_state(seed_state)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "pretrained.toml"))
    ap.add_argument("--prompts", type=int, default=2, help="prompts (groups) per step")
    ap.add_argument("--group", type=int, default=4, help="rollouts per prompt")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fastest", help="model.dtype")
    ap.add_argument("--out", default=None, help="result file (default: benchmarks/results/...)")
    ap.add_argument(
        "--variants",
        nargs="+",
        choices=[*FORWARDS, "plain"],
        default=[*FORWARDS, "plain"],
        help="what to time (default: all); a larger step may time only the old and new forward",
    )
    args = ap.parse_args(argv)

    from benchmarks.harness import loadavg
    from echoloss.train.config import load_config
    from echoloss.train.recipe import build_samples, compute_advantages, setup
    from echoloss.train.regimes import phase_at

    torch.set_num_threads(args.threads)
    tmp = ROOT / "runs" / "bench-update-step"
    cfg = load_config(
        args.config,
        {
            "train.output_dir": str(tmp),
            "data.prompts_per_step": args.prompts,
            "data.group_size": args.group,
            "model.dtype": args.dtype,
            "train.threads": args.threads,
            "train.progress": False,
            "train.overwrite": True,  # its own scratch directory, rewritten every run
        },
    )
    args.load_before = loadavg()
    args.stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    with ExitStack() as files:
        run = setup(cfg, resume=None, log=lambda line: print(line, file=sys.stderr), files=files)
        # lr 0: AdamW does all its work but leaves the weights as they are, so that every
        # variant and repeat trains the same weights (the gate compares them).
        rl = phase_at(
            run.warm_steps, run.warm_steps, warmup=cfg.warmup, echo=cfg.echo, rl_lr=cfg.optim.lr
        )
        phase = dataclasses.replace(rl, lr=0.0)
        gen = {}
        for shared in (True, False):
            gen[shared], rollouts = _generate(run, run.warm_steps, shared)
            if shared:
                kept = rollouts
        rollouts = kept
        advantages = compute_advantages(run, rollouts, phase)
        forced = not any(advantages)
        if forced:  # every group tied: a step without RL gradient would be timed as a skip
            advantages = [(-1.0) ** i for i in range(len(advantages))]
        samples = build_samples(run, rollouts, advantages, phase, run.warm_steps)
        times: dict[str, list[float]] = {k: [] for k in args.variants}
        batches: dict[str, int] = {}
        values: dict[str, dict[str, float]] = {}
        adv_abs = sum(abs(a) for a in advantages if a is not None) / len(advantages)
        for _ in range(args.repeats):
            for forward in [f for f in FORWARDS if f in args.variants]:
                seconds, (trained, grad_norm, n) = _trainer_step(run, samples, phase, forward)
                times[forward].append(seconds)
                batches[forward] = n
                values.setdefault(forward, _gate_values(trained, grad_norm))
            if "plain" in args.variants:
                times["plain"].append(_plain_step(run, samples))
            # written after every repeat: a slow machine still leaves the repeats it finished
            _write(args, cfg, samples, rollouts, forced, batches, times, gen, values, adv_abs)
    problems = _gate(values, adv_abs)
    for p in problems:
        print(f"gate: {p}", file=sys.stderr)
    return 1 if problems else 0


def _write(
    args: Any,
    cfg: Any,
    samples: list[Any],
    rollouts: list[Any],
    forced: bool,
    batches: dict[str, int],
    times: dict[str, list[float]],
    gen: dict[bool, float],
    values: dict[str, dict[str, float]],
    adv_abs: float,
) -> None:
    import transformers

    from benchmarks.harness import _git, cpu_name, loadavg
    from echoloss.train.runtime import compute_dtype

    tokens = sum(len(s) for s in samples)
    loss_rows = sum(int(s.num_rl_tokens) for s in samples)
    median = {k: statistics.median(v) for k, v in times.items()}
    result: dict[str, Any] = {
        "schema": "echoloss-bench-update-step/1",
        "what": "trainer RL update (pack, forward, loss, backward, clip, AdamW) by "
        "model.update_forward, and a plain transformers forward+backward+AdamW, same rollouts",
        "model": cfg.model.path,
        "compute_dtype": str(compute_dtype(cfg.model.dtype, torch.device("cpu"))).removeprefix(
            "torch."
        ),
        "prompts": args.prompts,
        "group": args.group,
        "samples": len(samples),
        "tokens": tokens,
        "rl_tokens": loss_rows,
        "echo_tokens": sum(sum(1 for w in (s.echo_weights or []) if w) for s in samples),
        "rewards": [r.reward for r in rollouts],
        "advantages_forced": forced,
        "micro_batches": batches,
        "repeats": min(len(v) for v in times.values()),
        "seconds": times,
        "median_s": median,
        "ratio_to_logits": (
            {k: v / median["logits"] for k, v in median.items()} if "logits" in median else {}
        ),
        "generation_s": {"shared_prompt": gen[True], "unshared": gen[False]},
        "gate": values,
        "gate_problems": _gate(values, adv_abs),
        "advantage_abs": adv_abs,
        "cpu": cpu_name(),
        "threads": args.threads,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--", "echoloss", "benchmarks")),
        "loadavg_before": args.load_before,
        "loadavg_after": loadavg(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out != "-":
        cpu = "_".join(cpu_name().split()[:3]).replace("(R)", "")
        path = Path(args.out) if args.out else (
            ROOT / "benchmarks" / "results" / f"update-step_{cpu}_{args.stamp}.json"
        )  # fmt: skip
        path.write_text(text + "\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
