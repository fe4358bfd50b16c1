"""What ``import echoloss`` costs on top of ``import torch``: ``python -m benchmarks.import_time``.

Each repeat starts two fresh interpreters back to back, ``import torch`` and
``import torch; import echoloss``, both under ``python -X importtime``; the order alternates between
repeats so that a slow spell of the machine hits both sides. Reported: the median wall time of
each interpreter's imports, their difference, and the median cumulative ``importtime`` of the
``echoloss`` package itself (measured inside the second interpreter, after torch is loaded), plus
whether any heavy optional module (``torch._dynamo``, ``triton``, the trainer's stacks) was
imported. Results go to ``benchmarks/results/import-time_<host>_<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch._dynamo", "triton", "transformers", "tokenizers", "trl", "verifiers", "matplotlib")

_PROBE = """
import sys, time
t0 = time.perf_counter()
{imports}
t1 = time.perf_counter()
heavy = [m for m in {heavy!r} if m in sys.modules]
print("RESULT", t1 - t0, ",".join(heavy))
"""
_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)$")


def _run(imports: str) -> tuple[float, dict[str, int], list[str]]:
    """One fresh interpreter: (wall seconds of the imports, cumulative µs per top-level module,
    heavy modules present afterwards)."""
    code = _PROBE.format(imports=imports, heavy=HEAVY)
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    if res.returncode != 0:
        errors = [ln for ln in res.stderr.splitlines() if not ln.startswith("import time:")]
        raise RuntimeError(f"{imports!r} failed:\n" + "\n".join(errors[-20:]))
    cumulative: dict[str, int] = {}
    for line in res.stderr.splitlines():
        m = _LINE.match(line)
        if m and len(m.group(3)) == 1:  # a top-level import (one space of indentation)
            cumulative[m.group(4)] = int(m.group(2))
    [result] = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
    _, wall, heavy = [*result.split(" "), ""][:3]
    return float(wall), cumulative, [h for h in heavy.split(",") if h]


def measure(repeats: int) -> dict[str, Any]:
    torch_wall: list[float] = []
    both_wall: list[float] = []
    echoloss_us: list[int] = []
    heavy: set[str] = set()
    for i in range(repeats):
        order = ("torch", "both") if i % 2 == 0 else ("both", "torch")
        for which in order:
            if which == "torch":
                wall, _, _ = _run("import torch")
                torch_wall.append(wall)
            else:
                wall, cum, h = _run("import torch\nimport echoloss")
                both_wall.append(wall)
                echoloss_us.append(cum["echoloss"])
                heavy.update(h)
    med_torch = statistics.median(torch_wall)
    med_both = statistics.median(both_wall)
    return {
        "repeats": repeats,
        "import_torch_s": {"median": med_torch, "all": torch_wall},
        "import_torch_and_echoloss_s": {"median": med_both, "all": both_wall},
        "echoloss_over_torch_wall_s": med_both - med_torch,
        "echoloss_importtime_cumulative_s": {
            "median": statistics.median(echoloss_us) / 1e6,
            "all": [u / 1e6 for u in echoloss_us],
        },
        "heavy_modules_after_import_echoloss": sorted(heavy),
    }


def _environment() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "commit": commit,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--repeats", type=int, default=9, help="interpreter pairs (default 9)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default benchmarks/results/)")
    p.add_argument("--budget-s", type=float, default=0.3, help="allowed echoloss overhead (0.3 s)")
    args = p.parse_args(argv)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    result = {
        "environment": {**_environment(), "timestamp": stamp},
        **measure(args.repeats),
        "budget_s": args.budget_s,
    }
    host = (
        "_".join(re.sub(r"\W+", "", w) for w in result["environment"]["cpu"].split()[:2]) or "cpu"
    )
    out = args.out or ROOT / "benchmarks" / "results" / f"import-time_{host}_{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    over = result["echoloss_over_torch_wall_s"]
    print(
        f"import torch: {result['import_torch_s']['median']:.3f} s, "
        f"import torch + echoloss: {result['import_torch_and_echoloss_s']['median']:.3f} s "
        f"(median of {args.repeats}); echoloss adds {over:.3f} s "
        f"(its own importtime: {result['echoloss_importtime_cumulative_s']['median']:.3f} s); "
        f"heavy modules: {result['heavy_modules_after_import_echoloss'] or 'none'}\n-> {out}"
    )
    return 0 if over <= args.budget_s else 1


if __name__ == "__main__":
    sys.exit(main())
