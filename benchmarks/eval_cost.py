"""What an evaluation of ``configs/pretrained-learn.toml`` costs on the packaged
SmolLM2-135M-Instruct, part by part: ``python -m benchmarks.eval_cost``.

* **Held-out observation CEs**, the two ways side by side, round-robin (A, B, A, B) on the same
  weights and conversations: ``full_logits`` (`echoloss.train.probes.heldout_observation_ce` once
  per set: every row's logits, each set's own forward) and ``shared_prompt``
  (`echoloss.train.probes.heldout_observation_ces`: the shared prompt once, one forward for the
  sets of the same conversations, the LM head on the scored rows). Their values are recorded
  too (bf16 compute in different shapes: not bit-equal).
* **The greedy evaluation** of ``--questions`` held-out questions
  (`echoloss.train.data.evaluate_policy`), with the time and shape of every batched
  ``generate`` call (rows, prompt tokens after the shared prefix, new tokens).
* **One RL step's rollouts** (``data.prompts_per_step`` x ``data.group_size``, sampled at the
  config's temperature), per ``generate`` call the same way.

Everything runs under the trainer's autocast (``model.dtype``) on ``--threads`` threads. Results:
``benchmarks/results/eval-cost_<cpu>_<UTC time>.json`` (CPU name, versions, git sha, load
average before and after).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _timed_generate_calls(calls: list[dict[str, Any]]) -> Any:
    """Wrap the trainer's batched ``generate`` call so that every call's shape and time is
    appended to ``calls``; returns the original, to put back."""
    from echoloss.train import data

    real = data._sample

    def timed(model: Any, tok: Any, prompts: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        out = real(model, tok, prompts, **kw)
        shared = kw.get("shared")
        p = len(shared.ids) if shared is not None else 0
        calls.append(
            {
                "rows": len(prompts),
                "shared_prefix": p,
                "own_tokens_max": max(len(x) - p for x in prompts),
                "new_tokens_max": max(len(c) for c, _ in out),
                "new_tokens_mean": statistics.fmean(len(c) for c, _ in out),
                "seconds": time.perf_counter() - t,
            }
        )
        return out

    data._sample = timed  # type: ignore[assignment]  # the same call, timed
    return real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "pretrained-learn.toml"))
    ap.add_argument("--questions", type=int, default=64, help="greedy held-out questions")
    ap.add_argument("--heldout", type=int, default=8, help="held-out conversations for the CEs")
    ap.add_argument("--repeats", type=int, default=2, help="of each CE way")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="result file (default: benchmarks/results/...)")
    args = ap.parse_args(argv)

    from benchmarks.harness import _git, cpu_name, loadavg
    from echoloss.train import data
    from echoloss.train.config import load_config
    from echoloss.train.probes import heldout_observation_ce, heldout_observation_ces
    from echoloss.train.recipe import setup
    from echoloss.train.runtime import autocast

    torch.set_num_threads(args.threads)
    cfg = load_config(
        args.config,
        {
            "train.output_dir": str(ROOT / "runs" / "bench-eval-cost"),
            "env.eval_size": args.questions,
            "data.heldout_size": args.heldout,
            "train.threads": args.threads,
            "train.progress": False,
            "train.overwrite": True,  # its own scratch directory, rewritten every run
        },
    )
    load_before = loadavg()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    result: dict[str, Any] = {"schema": "echoloss-bench-eval-cost/1", "config": args.config}
    with ExitStack() as files:
        run = setup(cfg, resume=None, log=lambda line: print(line, file=sys.stderr), files=files)
        sets = run.heldout.kinds
        attn = cfg.model.attn_implementation
        times: dict[str, list[float]] = {"full_logits": [], "shared_prompt": []}
        values: dict[str, dict[str, float]] = {}
        with autocast(run.dtype, run.ranks.device):
            for _ in range(args.repeats):
                t = time.perf_counter()
                values["full_logits"] = {
                    k: heldout_observation_ce(run.model, b, attn) for k, b in sets.items()
                }
                times["full_logits"].append(time.perf_counter() - t)
                t = time.perf_counter()
                values["shared_prompt"] = heldout_observation_ces(
                    run.model, sets, pad_id=run.tok.pad_token_id
                )
                times["shared_prompt"].append(time.perf_counter() - t)
            result["heldout_ce"] = {
                "conversations": args.heldout,
                "sets": sorted(sets),
                "tokens_per_set": sum(len(b) for b in next(iter(sets.values()))),
                "seconds": times,
                "median_s": {k: statistics.median(v) for k, v in times.items()},
                "values": values,
            }
            calls: list[dict[str, Any]] = []
            real = _timed_generate_calls(calls)
            try:
                tasks = run.env.eval_tasks()[: args.questions]
                t = time.perf_counter()
                ev = data.evaluate_policy(
                    run.model, run.tok, run.env, tasks, samples=0,
                    temperature=cfg.data.temperature, max_new_tokens=cfg.data.max_new_tokens,
                    device=run.ranks.device,
                )  # fmt: skip
                result["greedy_eval"] = {
                    "questions": len(tasks),
                    "seconds": time.perf_counter() - t,
                    "success": ev.success_greedy,
                    "valid_call_rate": ev.valid_call_rate,
                    "generate_calls": calls[:],
                }
                calls.clear()
                torch.manual_seed(cfg.train.seed)
                t = time.perf_counter()
                rollouts = run.source.get(run.warm_steps, run.model)
                result["rollouts"] = {
                    "rollouts": len(rollouts),
                    "seconds": time.perf_counter() - t,
                    "generate_calls": calls[:],
                }
            finally:
                data._sample = real
    import transformers

    result.update(
        cpu=cpu_name(),
        threads=args.threads,
        compute_dtype=str(run.dtype).removeprefix("torch."),
        versions={
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        git_sha=_git("rev-parse", "HEAD"),
        git_dirty=bool(_git("status", "--porcelain", "--", "echoloss", "benchmarks")),
        loadavg_before=load_before,
        loadavg_after=loadavg(),
        utc=stamp,
    )
    out = Path(args.out) if args.out else _default_out(result["cpu"], stamp)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _default_out(cpu: str, stamp: str) -> Path:
    safe = "".join(c if c.isalnum() else "_" for c in cpu).strip("_")[:40]
    return ROOT / "benchmarks" / "results" / f"eval-cost_{safe}_{stamp}.json"


if __name__ == "__main__":
    raise SystemExit(main())
