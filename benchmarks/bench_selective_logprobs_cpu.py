"""Deprecated entry point of the original CPU benchmark: use ``python -m benchmarks``.

It compared the chunked :func:`echoloss.selective_logprobs` with the naive full-vocabulary path
at N = 4096, V = 65,536 (fp32 and bf16). The harness now measures the same pair (providers
``naive`` and ``reference``, plus TRL's helpers) in all three modes, correctness-gated, with
round-robin timing and allocator-level peak memory; this wrapper runs it at the old shape::

    python -m benchmarks --device cpu --ops loss --providers naive,reference \\
        --n 4096 --v 65536 --dtype float32 --repeats 7

The original result, ``results/selective_logprobs_cpu_N4096_V65536_t1.json``, was measured
by the previous version of this script (peak resident memory of one call in a fresh subprocess,
naive and chunked alternated in another) and is kept as history.

Usage::

    python benchmarks/bench_selective_logprobs_cpu.py [--n 4096] [--v 65536] [--dtypes fp32,bf16]
        [--repeats 7] [--threads 1] [--output DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import cli

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--v", type=int, default=65536)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=str(cli.DEFAULT_OUTPUT))
    args = p.parse_args(argv)
    rc = 0
    for dt in args.dtypes.split(","):
        rc |= cli.main(
            [
                "--device", "cpu", "--ops", "loss", "--providers", "naive,reference",
                "--n", str(args.n), "--v", str(args.v), "--dtype", _DTYPES.get(dt, dt),
                "--repeats", str(args.repeats), "--threads", str(args.threads),
                "--output", args.output,
            ]
        )  # fmt: skip
    return rc


if __name__ == "__main__":
    sys.exit(main())
