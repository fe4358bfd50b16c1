"""The goals summary of the GPU check: ``python -m benchmarks.gpu_goals DIR [--write FILE]
[--store RESULTS]``.

Reads what ``benchmarks/gpu_check.sh`` left in ``DIR`` (``steps.jsonl``, ``log.txt``,
``check.jsonl``, ``values.jsonl``, ``linear-rounds.json``, ``launches.md``; any of them may be
missing, after a step that failed or ran out of time) and prints one block, each goal with its
numbers and a verdict (``met``, ``NOT MET`` or ``no result``):

* fastest of echoloss (``triton``), TRL's kernel path (``trl``: TRL's log-softmax kernels plus
  echoloss's own loss algebra) and Liger at every shape of the check (median forward+backward);
* at N ≥ 16k and V ≥ 128k, echoloss at ≥ 80 % of the bandwidth floor. The floor is three passes
  over the ``[N, V]`` logits (read, read, write) at the GPU's datasheet bandwidth, looked up by
  its name (`benchmarks.harness.peak_bandwidth`: 4.8 TB/s for an H200, 3.35 TB/s for an H100
  SXM). The kernels move fewer bytes: phase 1 reads only the participating rows, so the bytes
  moved are ``(1 + 2·p)`` passes for a share ``p`` of participating rows (about 2.8 in the
  check's workload); the share of that smaller floor is printed beside;
* fused-linear forward+backward no slower than logits-then-loss at H = 4096 (the check's row
  and the paired rounds: the median of the per-round differences, the rounds it was faster in,
  a two-sided sign test), with its memory beside;
* launches and host syncs per call (``launches.md``);
* the GPU tests (``pytest -m gpu``: passed / failed / errors from the log) and the ``nn``
  modules on CUDA against the CPU path (``values.jsonl``);
* each step's time against its box.

``--store RESULTS`` copies the check's files into ``RESULTS`` (``benchmarks/results``) under the
names the pages cite, ``<kind>_<GPU>_<time>.<ext>`` (`stored_names`), and prints them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import Any

GOAL_PCT = 80.0
PEERS = ("trl", "liger")
BIG_N, BIG_V = 16384, 128256


def _jsonl(path: Path) -> list[dict[str, Any]] | None:
    if not path.exists():
        return None
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut off by a time-out: the rows before it stand
                break
    return rows


def _median(rows: list[dict[str, Any]], op: str, n: int, v: int, provider: str) -> float | None:
    for r in rows:
        if (r["op"], r["n"], r["v"], r["provider"]) == (op, n, v, provider):
            return None if r.get("time_ms") is None else float(r["time_ms"]["median"])
    return None


def _verdict(ok: bool | None) -> str:
    return "no result" if ok is None else "met" if ok else "NOT MET"


def fastest(rows: list[dict[str, Any]] | None) -> tuple[list[str], bool | None]:
    if not rows:
        return ["  no check rows"], None
    shapes = sorted({(r["n"], r["v"]) for r in rows if r["op"] == "loss"})
    lines, ok = [], True
    for n, v in shapes:
        ours = _median(rows, "loss", n, v, "triton")
        peers = {p: _median(rows, "loss", n, v, p) for p in PEERS}
        won = ours is not None and all(t is None or ours < t for t in peers.values())
        ok = ok and won
        cells = ", ".join(f"{p} {'—' if t is None else f'{t:.2f}'}" for p, t in peers.items())
        mine = "—" if ours is None else f"{ours:.2f}"
        lines.append(
            f"  N={n} V={v}: echoloss {mine} ms; {cells} ms: {'fastest' if won else 'NOT fastest'}"
        )
    return lines, ok if shapes else None


def floor(rows: list[dict[str, Any]] | None) -> tuple[list[str], bool | None]:
    if not rows:
        return ["  no check rows"], None
    big = [
        r
        for r in rows
        if r["op"] == "loss" and r["provider"] == "triton" and r["n"] >= BIG_N and r["v"] >= BIG_V
    ]
    got = [r for r in big if r.get("pct_of_peak_bandwidth") is not None]
    if not got:
        return ["  no floor: the GPU's peak bandwidth is not in the table"], None
    env = got[0]["env"]
    peak = env.get("peak_bandwidth_Bps") or 0.0
    lines = [
        f"  floor: 3 passes over the [N, V] logits at {peak / 1e12:.2f} TB/s "
        f"({env.get('device_name')})"
    ]
    for r in got:
        w = r["workload"]
        moved = 1 + 2 * (w["rl_rows"] + w["echo_rows"]) / r["n"]
        pct = r["pct_of_peak_bandwidth"]
        lines.append(
            f"  N={r['n']} V={r['v']}: {pct:.1f} % of the floor ({pct * moved / 3:.1f} % of "
            f"the {moved:.2f} passes moved)"
        )
    pcts = [r["pct_of_peak_bandwidth"] for r in got]
    lines.append(f"  span {min(pcts):.1f}–{max(pcts):.1f} % (goal ≥ {GOAL_PCT:.0f} %)")
    return lines, min(pcts) >= GOAL_PCT and len(got) == len(big)


def sign_test_p(k: int, n: int) -> float:
    """Two-sided sign test: the probability of ``min(k, n - k)`` or fewer wins of a fair coin,
    doubled (capped at 1)."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return float(min(1.0, 2 * tail))


def linear(
    rows: list[dict[str, Any]] | None, rounds: list[dict[str, Any]] | None
) -> tuple[list[str], bool | None]:
    lines: list[str] = []
    ok: bool | None = None
    if rows:
        lin = [r for r in rows if r["op"] == "linear"]
        for n, v, h in sorted({(r["n"], r["v"], r["h"]) for r in lin}):
            a = _median(rows, "linear", n, v, "linear-echoloss")
            b = _median(rows, "linear", n, v, "fused-linear")
            if a is not None and b is not None:
                lines.append(
                    f"  check N={n} V={v} H={h}: fused-linear {b:.2f} against logits-then-loss "
                    f"{a:.2f} ms ({100 * (b / a - 1):+.1f} %)"
                )
    if rounds and len(rounds) >= 2 and "round_medians_ms" in rounds[0]:
        base, fused = rounds[0], rounds[1]
        d = [
            x - y for x, y in zip(fused["round_medians_ms"], base["round_medians_ms"], strict=True)
        ]
        k = sum(x < 0 for x in d)
        med = statistics.median(d)
        lines.append(
            f"  {len(d)} paired rounds: median difference {med:+.2f} ms "
            f"({100 * med / base['median_ms']:+.2f} %), faster in {k} of {len(d)} "
            f"(sign test p = {sign_test_p(k, len(d)):.3f}); peak extra "
            f"{fused['peak_extra_gib']:.2f} against {base['peak_extra_gib']:.2f} GiB"
        )
        ok = med <= 0 and fused["peak_extra_gib"] < base["peak_extra_gib"]
    if not lines:
        lines = ["  no fused-linear rows"]
    return lines, ok


def launches(text: str | None) -> list[str]:
    if not text:
        return ["  no launch counts"]
    lines = []
    for m in re.finditer(r"^\| ([^|]+) \| (eager|triton|pytorch) \| (\d+) \| (\d+) \|", text, re.M):
        what, kind, syncs, count = (g.strip() for g in m.groups())
        lines.append(f"  {what} ({kind}): {count} launches, {syncs} host syncs")
    return lines or ["  no launch rows in launches.md"]


def tests(log: str | None) -> tuple[list[str], bool | None]:
    if not log:
        return ["  no log"], None
    m = re.search(r"^== tests .*?$(.*?)^== tests: rc (\d+)", log, re.M | re.S)
    if not m:
        return ["  the tests step did not run"], None
    body, rc = m.group(1), int(m.group(2))
    counts = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", body)
    }
    said = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no pytest summary"
    ok = rc == 0 and counts.get("passed", 0) > 0
    return [f"  pytest -m gpu tests/ops: {said} (rc {rc})"], ok


def values(rows: list[dict[str, Any]] | None) -> tuple[list[str], bool | None]:
    if not rows:
        return ["  no module value rows"], None
    cases: dict[tuple[str, str, str], bool] = {}
    for r in rows:
        if r["status"] == "refused":
            continue
        key = (r["module"], r["loss_type"], r["level"])
        cases[key] = cases.get(key, True) and r["status"] == "ok"
    bad = sorted(k for k, good in cases.items() if not good)
    lines = [f"  {len(cases) - len(bad)} of {len(cases)} module × loss_type × level cases pass"]
    lines += [f"  FAILED {' '.join(k)}" for k in bad]
    return lines, not bad and bool(cases)


def steps(records: list[dict[str, Any]] | None) -> list[str]:
    if not records:
        return ["  no step records"]
    out = []
    for r in records:
        state = (
            "TIMED OUT" if r["timed_out"] else "ok" if r["rc"] == 0 else f"FAILED (rc {r['rc']})"
        )
        out.append(f"  {r['step']:9s} {r['seconds']:6.1f} of {r['box_s']:3d} s  {state}")
    total = sum(r["box_s"] for r in records)
    out.append(f"  boxes so far {total} s")
    return out


def summary(folder: Path) -> str:
    def text(name: str) -> str | None:
        p = folder / name
        return p.read_text() if p.exists() else None

    check = _jsonl(folder / "check.jsonl")
    rounds_text = text("linear-rounds.json")
    try:
        rounds = json.loads(rounds_text) if rounds_text else None
    except json.JSONDecodeError:
        rounds = None
    sha = {r["env"].get("git_sha") for r in check or []} or {"(no rows)"}
    out = [f"== GOALS (commit {', '.join(sorted(str(s) for s in sha))}) =="]
    for title, (lines, ok) in (
        ("echoloss fastest of the three at every shape of the check", fastest(check)),
        (f"≥ {GOAL_PCT:.0f} % of the floor at N ≥ 16k, V ≥ 128k", floor(check)),
        ("fused-linear no slower than logits-then-loss (H = 4096)", linear(check, rounds)),
        ("GPU tests pass", tests(text("log.txt"))),
        ("nn modules on CUDA = the CPU path", values(_jsonl(folder / "values.jsonl"))),
    ):
        out.append(f"{title}: {_verdict(ok)}")
        out += lines
    out.append("launches per forward+backward (the phases included on CUDA):")
    out += launches(text("launches.md"))
    out.append("steps:")
    out += steps(_jsonl(folder / "steps.jsonl"))
    return "\n".join(out)


#: The check's files and the kind each is stored as (``--store``).
STORED = {
    "check.jsonl": "cuda-check",
    "values.jsonl": "cuda-values",
    "linear-rounds.json": "cuda-linear-chunks",
    "launches.md": "cuda-launch-count",
    "env.txt": "gpu-check-env",
    "log.txt": "gpu-check-log",
    "steps.jsonl": "gpu-check-steps",
    "summary.md": "gpu-check-summary",
}


def stored_names(folder: Path) -> dict[str, str]:
    """``{file in folder: name in benchmarks/results}``: the GPU's name and the time of the
    check's first row (else of the values' rows), as the other result files are named."""
    rows = (_jsonl(folder / "check.jsonl") or []) + (_jsonl(folder / "values.jsonl") or [])
    if not rows:
        raise SystemExit(f"{folder}: no check or values rows to name the files by")
    env = rows[0].get("env", rows[0])
    gpu = re.sub(r"[^A-Za-z0-9]+", "_", env["device_name"]).strip("_")[:40]
    stamp = re.sub(r"[-:]", "", env["timestamp"])[:15] + "Z"
    return {
        name: f"{kind}_{gpu}_{stamp}{''.join(Path(name).suffixes)}"
        for name, kind in STORED.items()
        if (folder / name).exists()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_goals")
    p.add_argument("folder", type=Path)
    p.add_argument("--write", type=Path, default=None, help="also write the summary here")
    p.add_argument("--store", type=Path, default=None, help="copy the files into this folder")
    args = p.parse_args(argv)
    s = summary(args.folder)
    if args.write is not None:
        args.write.write_text(s + "\n")
    print(s)
    if args.store is not None:
        args.store.mkdir(parents=True, exist_ok=True)
        for name, target in stored_names(args.folder).items():
            dest = args.store / target
            if dest.exists():
                raise SystemExit(f"{dest} exists: not overwritten")
            dest.write_bytes((args.folder / name).read_bytes())
            print(f"stored {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
