"""bf16 against fp32 on this CPU: a bare transformers forward + backward of the packaged
SmolLM2-135M-Instruct, ``python -m benchmarks.cpu_bf16``.

Three ways, round-robin (A, B, C, A, ...) so that each sees the same machine load, the median of
the repeats reported: fp32 parameters computing in fp32; fp32 parameters under bf16 autocast
(the trainer's ``model.dtype = "bfloat16"`` / ``"fastest"`` on a CPU with bf16 instructions);
bf16 parameters. Input: ``--rows`` x ``--tokens`` random token ids, the loss the mean logit
(the LM head included). Writes ``benchmarks/results/cpu-bf16_<cpu>_<UTC time>.json`` with the
CPU name, whether torch sees AVX512-BF16 / AMX, versions, git sha, threads and load average.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _step(model: Any, ids: torch.Tensor, autocast: bool) -> float:
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    logits.float().mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import transformers

    from benchmarks.harness import _git, cpu_name, loadavg
    from echoloss.pretrained import materialize
    from echoloss.train.runtime import cpu_computes_bf16_natively

    torch.set_num_threads(args.threads)
    path = materialize("smollm2-135m-instruct")
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, fp32.config.vocab_size, (args.rows, args.tokens), generator=g)
    ways = {
        "fp32": (fp32, False),
        "fp32 weights, bf16 autocast": (fp32, True),
        "bf16 weights": (bf16, False),
    }
    load_before = loadavg()
    for model, autocast in ways.values():  # one untimed warm-up each
        _step(model, ids[:1, :16], autocast)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.repeats):
        for name, (model, autocast) in ways.items():
            times[name].append(_step(model, ids, autocast))
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "schema": "echoloss-bench-cpu-bf16/1",
        "what": "SmolLM2-135M-Instruct forward+backward (LM head included), bare transformers",
        "rows": args.rows,
        "tokens": args.tokens,
        "seconds": times,
        "median_s": median,
        "fp32_over": {k: median["fp32"] / v for k, v in median.items()},
        "cpu": cpu_name(),
        "bf16_instructions": cpu_computes_bf16_natively(),
        "threads": args.threads,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "git_sha": _git("rev-parse", "HEAD"),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = json.dumps(result, indent=1)
    print(text)
    cpu = "_".join(cpu_name().split()[:3]).replace("(R)", "")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (ROOT / "benchmarks" / "results" / f"cpu-bf16_{cpu}_{stamp}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
