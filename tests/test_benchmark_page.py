"""The GPU numbers ``docs/benchmarks.md`` and ``docs/kernels.md`` print for the check of
2026-11-27 are the committed result files' (``benchmarks/results/``), recomputed here."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cli import check_table  # noqa: E402
from benchmarks.report import load  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GPU = "NVIDIA_H100_80GB_HBM3"
START = RESULTS / f"cuda-check_{GPU}_20261127T110943Z.jsonl"
END = RESULTS / f"cuda-check_{GPU}_20261127T114010Z.jsonl"
PROFILE = RESULTS / f"cuda-profile-step_{GPU}_20261127T114010Z.json"
CHUNKS = RESULTS / f"cuda-linear-chunks_{GPU}_20261127T114010Z.json"
PAGE = (ROOT / "docs" / "benchmarks.md").read_text()
KERNELS = (ROOT / "docs" / "kernels.md").read_text()


def _block(name: str) -> str:
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", PAGE, re.S)
    assert m, f"docs/benchmarks.md has no {name} block"
    return m.group(1)


def _median(rows, op, n, v, provider):
    [r] = [r for r in rows if (r["op"], r["n"], r["v"], r["provider"]) == (op, n, v, provider)]
    return None if r["time_ms"] is None else r["time_ms"]["median"], r


def _fmt(x):
    return "oom" if x is None else f"{x:.2f}"


def test_check_table_is_the_committed_run():
    assert _block("check-table") == check_table(load([str(END)]))


def test_start_and_end_table():
    start, end = load([str(START)]), load([str(END)])
    lines = [
        "| N | V | triton at 11ac199 | triton at ef40baa | trl at ef40baa | liger at ef40baa "
        "| % floor at ef40baa |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, v in [(4096, 32000), (16384, 128256), (16384, 151936), (16384, 262144), (65536, 151936)]:
        t0, _ = _median(start, "loss", n, v, "triton")
        t1, r1 = _median(end, "loss", n, v, "triton")
        cells = [_fmt(t0), _fmt(t1)]
        cells += [_fmt(_median(end, "loss", n, v, p)[0]) for p in ("trl", "liger")]
        cells.append(f"{r1['pct_of_peak_bandwidth']:.0f}")
        lines.append(f"| {n} | {v} | " + " | ".join(cells) + " |")
    assert _block("check-start-end") == "\n".join(lines)
    # the commits named are the rows' own
    assert {r["env"]["git_sha"][:7] for r in start} == {"11ac199"}
    assert {r["env"]["git_sha"][:7] for r in end} == {"ef40baa"}


def test_criteria_as_the_page_states_them():
    end = load([str(END)])
    shapes = {(r["n"], r["v"]) for r in end if r["op"] == "loss"}
    for n, v in shapes:  # fastest at every shape of the check
        ours, _ = _median(end, "loss", n, v, "triton")
        for peer in ("trl", "liger"):
            theirs, _ = _median(end, "loss", n, v, peer)
            assert theirs is None or ours < theirs, (n, v, peer)
    pct = [
        _median(end, "loss", n, v, "triton")[1]["pct_of_peak_bandwidth"]
        for n, v in shapes
        if n >= 16384 and v >= 128256
    ]
    assert "80–87 %" in PAGE and (round(min(pct)), round(max(pct))) == (80, 87)
    assert "measured 80–87 % of the floor" in " ".join(KERNELS.split())
    lin, _ = _median(end, "linear", 16384, 151936, "linear-echoloss")
    fused, _ = _median(end, "linear", 16384, 151936, "fused-linear")
    assert (
        f"{fused:.2f}\n  against {lin:.2f} ms" in PAGE or f"{fused:.2f} against {lin:.2f}" in PAGE
    )
    assert round(100 * (fused / lin - 1)) == 3 and "by 3 % in the check" in PAGE


def test_profile_and_chunk_numbers():
    prof = {(r["n"], r["v"], r["provider"]): r for r in json.loads(PROFILE.read_text())}
    big, small = prof[(16384, 151936, "triton")], prof[(4096, 32000, "triton")]
    text = " ".join(PAGE.split())
    assert f"one call is {big['median_ms']:.2f} ms for {big['kernel_ms']:.2f} ms of kernels" in text
    assert f"and {big['host_ms']:.2f} ms of host time" in text
    assert (
        f"host time ({small['host_ms']:.2f} ms) still is the call ({small['median_ms']:.2f} ms"
        in text
    )
    assert f"against {prof[(4096, 32000, 'trl')]['host_ms']:.2f} ms of host time on TRL" in text
    cases = json.loads(CHUNKS.read_text())
    [unfused] = [r for r in cases if r["case"] == "logits-then-loss"]
    [auto] = [r for r in cases if r["case"].startswith("fused-linear, automatic")]
    assert auto["chunk"] == 8192
    rows = {r["chunk"]: r for r in cases if "automatic" not in r["case"]}
    assert f"{auto['median_ms']:.2f} against {unfused['median_ms']:.2f} ms" in text
    assert round(100 * (auto["median_ms"] / unfused["median_ms"] - 1)) == 5
    for chunk in (1764, 4096):
        assert f"{rows[chunk]['median_ms']:.2f} ms" in text
    k = " ".join(KERNELS.split())
    assert f"{auto['peak_extra_gib']:.2f} against {unfused['peak_extra_gib']:.2f} GiB" in k


@pytest.mark.parametrize("path", [START, END, PROFILE, CHUNKS])
def test_result_files_are_committed(path):
    assert path.exists(), path


def test_phase_times_against_trl():
    prof = {(r["n"], r["v"], r["provider"]): r for r in json.loads(PROFILE.read_text())}

    def phases(provider):
        top = {name: ms for name, _, ms in prof[(16384, 151936, provider)]["top"]}
        fwd = [ms for name, ms in top.items() if "fwd" in name or "_forward" in name]
        bwd = [ms for name, ms in top.items() if "bwd" in name or "_backward" in name]
        return fwd[0], bwd[0], top.get("_row_algebra_kernel")

    f, b, row = phases("triton")
    tf, tb, _ = phases("trl")
    text = " ".join(PAGE.split())
    assert f"({f:.2f} + {b:.2f} against {tf:.2f} + {tb:.2f} ms" in text
    k = " ".join(KERNELS.split())
    assert f"phase 1 takes {f:.2f} ms and phase 2 {b:.2f} ms of it" in k
    assert f"the row algebra {row:.2f} ms" in k


def test_phase_bandwidths_on_kernels_page():
    """Phase 1 reads the participating rows once; phase 2 reads them and writes every row."""
    prof = {(r["n"], r["v"], r["provider"]): r for r in json.loads(PROFILE.read_text())}
    top = {name: ms for name, _, ms in prof[(16384, 151936, "triton")]["top"]}
    [w] = [
        r["workload"]
        for r in load([str(END)])
        if (r["n"], r["v"], r["provider"]) == (16384, 151936, "triton")
    ]
    row_bytes = 151936 * 2
    part = (w["rl_rows"] + w["echo_rows"]) * row_bytes
    p1 = part / (top["_logprobs_fwd_kernel"] * 1e-3) / 1e12
    p2 = (part + 16384 * row_bytes) / (top["_logprobs_bwd_kernel"] * 1e-3) / 1e12
    assert f"({p1:.2f} and {p2:.2f} TB/s" in " ".join(KERNELS.split())


def test_start_profile_numbers_on_kernels_page():
    text = (RESULTS / f"cuda-profile-step_{GPU}_20261127T110943Z.md").read_text()
    found = re.findall(
        r"N=(\d+) V=(\d+): median ([\d.]+) ms, kernels \d+, kernel time ([\d.]+)", text
    )
    k = " ".join(KERNELS.split())
    for n, v, median, kernel in found:
        assert f"{float(median):.2f} ms for {float(kernel):.2f} ms" in k, (n, v)
    assert len(found) == 2


# -- the fused-linear op in one chunk (2026-11-27, mirrored timing) ------------------------------

PLAIN = RESULTS / f"cuda-check_{GPU}_20261127T170700Z.jsonl"
MIRRORED = [RESULTS / f"cuda-check_{GPU}_20261127T{t}.jsonl" for t in ("172236Z", "172843Z")]
LAST_CHUNKS = RESULTS / f"cuda-linear-chunks_{GPU}_20261127T172843Z.json"
LINEAR_PROFILE = RESULTS / f"cuda-linear-profile_{GPU}_20261127T172500Z.md"
GEMMS = RESULTS / f"cuda-gemm-chunks_{GPU}_20261127T170700Z.md"
SEQUENCE_LAUNCHES = RESULTS / f"cuda-launch-count_{GPU}_20261127T171750Z.md"
SHAPES = [(4096, 32000), (16384, 128256), (16384, 151936), (16384, 262144), (65536, 151936)]


def _text(page=PAGE):
    return " ".join(page.split())


def _pct(rows, n, v, provider):
    return _median(rows, "loss", n, v, provider)[1]["pct_of_peak_bandwidth"]


def test_mirrored_checks_table_and_criteria():
    a, b = (load([str(p)]) for p in MIRRORED)
    assert {r["env"]["git_sha"][:7] for r in a} == {"f699940"}
    assert {r["env"]["git_sha"][:7] for r in b} == {"59018bc"}
    lines = [
        "| N | V | triton at f699940 | trl | liger | % floor | triton at 59018bc | trl | liger "
        "| % floor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, v in SHAPES:
        cells = []
        for rows in (a, b):
            cells += [_fmt(_median(rows, "loss", n, v, p)[0]) for p in ("triton", "trl", "liger")]
            cells.append(f"{_pct(rows, n, v, 'triton'):.0f}")
        lines.append(f"| {n} | {v} | " + " | ".join(cells) + " |")
    assert _block("check-mirrored") == "\n".join(lines)
    assert _block("check-table-end") == check_table(b)
    text = _text()
    for rows, span in ((a, "81–87 %"), (b, "78–87 %")):
        for n, v in SHAPES:  # fastest at every shape, both runs
            ours = _median(rows, "loss", n, v, "triton")[0]
            assert all(
                (t := _median(rows, "loss", n, v, p)[0]) is None or ours < t
                for p in ("trl", "liger")
            ), (n, v)
        big = [round(_pct(rows, n, v, "triton")) for n, v in SHAPES if n >= 16384]
        assert f"{min(big)}–{max(big)} %" == span and span in text
    trl = [round(_pct(rows, 16384, 128256, "trl")) for rows in (a, b)]
    assert f"TRL's share went from {trl[0]} to {trl[1]} % at V = 128,256" in text


def test_plain_timing_run_as_the_page_states_it():
    rows = load([str(PLAIN)])
    assert {r["env"]["git_sha"][:7] for r in rows} == {"803eade"}
    t = {(n, v, p): _median(rows, "loss", n, v, p)[0] for n, v in SHAPES for p in ("triton", "trl")}
    text = _text()
    for n, v in SHAPES[:2]:  # TRL's path ahead, as the page prints it
        trl, ours = t[(n, v, "trl")], t[(n, v, "triton")]
        assert trl < ours and f"({trl:.2f} against {ours:.2f} ms)" in text, (n, v)
    for n, v in SHAPES[2:]:
        assert t[(n, v, "triton")] < t[(n, v, "trl")], (n, v)


def test_one_chunk_fused_linear_numbers():
    cases = {r["case"].split(" (")[0]: r for r in json.loads(LAST_CHUNKS.read_text())}
    unfused, auto = cases["logits-then-loss"], cases["fused-linear, automatic"]
    assert auto["chunk"] == 14759  # one chunk of every participating row
    text, kernels = _text(), _text(KERNELS)
    pair = f"{auto['median_ms']:.2f} against {unfused['median_ms']:.2f} ms"
    assert pair in text and pair in kernels
    mem = f"{auto['peak_extra_gib']:.2f} against {unfused['peak_extra_gib']:.2f} GiB"
    assert mem in text and mem in kernels
    slower = round(100 * (auto["median_ms"] / unfused["median_ms"] - 1))
    assert f"({slower} % slower)" in kernels
    b = load([str(MIRRORED[1])])
    lin = _median(b, "linear", 16384, 151936, "linear-echoloss")[0]
    fused = _median(b, "linear", 16384, 151936, "fused-linear")[0]
    assert f"in the last check {fused:.2f} against {lin:.2f} ms" in text
    assert fused > lin and auto["median_ms"] > unfused["median_ms"]  # the criterion is not met


def test_linear_profile_and_gemm_numbers():
    prof = LINEAR_PROFILE.read_text()
    sections = prof.split("== ")[1:]
    gemm_ms = {}
    for sec in sections:
        name = sec.split(":")[0]
        gemm_ms[name] = sum(
            float(ms)
            for ms, kname in re.findall(r"([\d.]+) ms x\d+\s+(\S+)", sec)
            if "nvjet" in kname
        )
    scale = sum(
        float(ms)
        for ms in re.findall(r"([\d.]+) ms x2\s+void at::native::elementwise_kernel<128, 4", prof)
    )
    alone = sum(
        float(ms)
        for label, ms in re.findall(
            r"\| (logits h @ W.T|dX = dz @ W|dW = dz.T @ h), 14759 rows[^|]*\| ([\d.]+) \|", prof
        )
    )
    text, kernels = _text(), _text(KERNELS)
    what = (
        f"three GEMMs took {gemm_ms['fused-linear']:.2f} ms against "
        f"{gemm_ms['logits-then-loss']:.2f} ms for the logits path's on all rows, and "
        f"{alone:.2f} ms for the same shapes alone"
    )
    assert what in text and what in kernels
    assert f"took {scale:.2f} ms" in text and f"took {scale:.2f} ms" in kernels
    g = {
        k.strip(): float(v)
        for k, v in re.findall(r"\| ([^|]+) \| ([\d.]+) ms \|", GEMMS.read_text())
    }
    one = g["logits mm 16384 rows"] + g["dX mm 16384"] + g["dW one mm bf16 out"]
    two = g["logits mm 8192 rows x2"] + g["dX mm 8192 x2"] + g["dW 2 chunks fp32 acc + cast"]
    assert f"took {two - one:.1f} ms more in two chunks of 8,192 rows than in one" in text
    assert f"took {two - one:.1f} ms more in two chunks of 8,192 rows than in one" in kernels
    acc = g["dW 2 chunks fp32 acc + cast"] - g["dW one mm bf16 out"]
    assert f"accumulator's extra traffic cost {acc:.1f} ms" in text
    for a, b in ((g["logits mm 8192 rows x2"], g["logits mm 16384 rows"]),
                 (g["dX mm 8192 x2"], g["dX mm 16384"])):  # fmt: skip
        assert f"{a:.2f} against {b:.2f}" in kernels


def test_sequence_launch_numbers():
    rows = re.findall(
        r"\| ([\w-]+) \| eager \| (\d+) \| (\d+) \| ([\d.]+) \|", SEQUENCE_LAUNCHES.read_text()
    )
    got = {name: (int(s), int(k), float(ms)) for name, s, k, ms in rows}
    text = _text()
    d, s, g = got["dppo"], got["dppo-sequence-means"], got["gspo-sequence-means"]
    assert {d[0], s[0], g[0]} == {0}
    assert f"the default {d[1]} kernels and {d[2]:.2f} ms" in text
    assert f"normalisers {s[1]} kernels and {s[2]:.2f} ms" in text
    assert f"`gspo` with them {g[1]} and {g[2]:.2f} ms" in text
    assert f"The {s[1] - d[1]} more kernels" in text and f"about {s[2] - d[2]:.1f} ms" in text


@pytest.mark.parametrize(
    "path", [PLAIN, *MIRRORED, LAST_CHUNKS, LINEAR_PROFILE, GEMMS, SEQUENCE_LAUNCHES]
)
def test_session_result_files_are_committed(path):
    assert path.exists(), path


ROUNDS_FILE = RESULTS / f"cuda-linear-chunks_{GPU}_20261127T213442Z.json"


def test_readme_states_the_mirrored_runs():
    """README: fastest in both checks timed in mirrored blocks, their span of the floor, and
    the earlier run with TRL's path ahead at two shapes."""
    spans = []
    for path in [*MIRRORED, RESULTS / f"cuda-check_{GPU}_20261127T213515Z.jsonl"]:
        rows = load([str(path)])
        for n, v in SHAPES:
            ours = _median(rows, "loss", n, v, "triton")[0]
            for peer in ("trl", "liger"):
                theirs = _median(rows, "loss", n, v, peer)[0]
                assert theirs is None or ours < theirs, (path.name, n, v, peer)
        spans += [_pct(rows, n, v, "triton") for n, v in SHAPES if n >= 16384]
    plain = load([str(PLAIN)])
    ahead = [
        (n, v) for n, v in SHAPES
        if _median(plain, "loss", n, v, "trl")[0] < _median(plain, "loss", n, v, "triton")[0]
    ]  # fmt: skip
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "fastest of the three in all three H100 runs timed in mirrored blocks" in readme
    assert f"at {round(min(spans))}–{round(max(spans))} % of the bandwidth floor" in readme
    assert len(ahead) == 2 and "TRL's path ahead at two shapes" in readme
    base, fused = json.loads(ROUNDS_FILE.read_text())
    assert 0.6 < fused["peak_extra_gib"] / base["peak_extra_gib"] < 0.7
    assert "in one chunk with about two thirds of its memory" in readme


def test_kernels_page_states_the_mirrored_spans():
    k = _text(KERNELS)
    parts = []
    for path in MIRRORED:
        rows = load([str(path)])
        big = [round(_pct(rows, n, v, "triton")) for n, v in SHAPES if n >= 16384]
        parts.append(f"{min(big)}–{max(big)} %")
    assert f"mirrored blocks measured {parts[0]} and {parts[1]}" in k
    t = [_median(load([str(p)]), "loss", 16384, 151936, "triton")[0] for p in MIRRORED]
    assert f"{t[0]:.2f} and {t[1]:.2f} ms at this shape" in k


# -- the fused-linear op keeps its logits (2026-11-27, evening) ---------------------------------

EVENING_CHECK = RESULTS / f"cuda-check_{GPU}_20261127T213515Z.jsonl"
ROUNDS = RESULTS / f"cuda-linear-chunks_{GPU}_20261127T213442Z.json"
ONE_ROUND = RESULTS / f"cuda-linear-chunks_{GPU}_20261127T213003Z.json"
EVENING_PROFILE = RESULTS / f"cuda-linear-profile_{GPU}_20261127T213003Z.md"
EVENING_ENV = RESULTS / f"gpu-check-env_{GPU}_20261127T213003Z.txt"


def test_evening_check_tables_and_criteria():
    rows = load([str(EVENING_CHECK)])
    assert {r["env"]["git_sha"][:7] for r in rows} == {"d20d5e9"}
    lines = [
        "| N | V | triton | trl | liger | % floor (triton) | % floor (trl) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, v in SHAPES:
        cells = [_fmt(_median(rows, "loss", n, v, p)[0]) for p in ("triton", "trl", "liger")]
        cells += [f"{_pct(rows, n, v, p):.0f}" for p in ("triton", "trl")]
        lines.append(f"| {n} | {v} | " + " | ".join(cells) + " |")
        ours = _median(rows, "loss", n, v, "triton")[0]
        assert all(
            (t := _median(rows, "loss", n, v, p)[0]) is None or ours < t for p in ("trl", "liger")
        ), (n, v)
    assert _block("check-evening") == "\n".join(lines)
    assert _block("check-table-evening") == check_table(rows)
    big = [round(_pct(rows, n, v, "triton")) for n, v in SHAPES if n >= 16384]
    text = _text()
    assert min(big) >= 80 and f"at {min(big)}–{max(big)} % of the floor" in text
    small = [_median(load([str(p)]), "loss", 4096, 32000, "triton")[0] for p in MIRRORED]
    trl_small = [_median(load([str(p)]), "loss", 4096, 32000, "trl")[0] for p in MIRRORED]
    now, trl_now = (_median(rows, "loss", 4096, 32000, p)[0] for p in ("triton", "trl"))
    assert (
        f"took {now:.2f} ms here against {min(small):.2f}–{max(small):.2f} ms in the runs above, "
        f"and TRL's path {trl_now:.2f} against {min(trl_small):.2f}–{max(trl_small):.2f}"
    ) in text
    lin = _median(rows, "linear", 16384, 151936, "linear-echoloss")
    fused = _median(rows, "linear", 16384, 151936, "fused-linear")
    behind = 100 * (fused[0] / lin[0] - 1)
    assert f"the op {behind:.1f} % behind ({fused[0]:.2f} against {lin[0]:.2f} ms)" in text
    launches = f"{fused[1]['launches']} against {lin[1]['launches']} in the check's launch column"
    assert launches in text
    mib = f"{fused[1]['peak_extra_bytes'] / 2**20:,.0f} against {lin[1]['peak_extra_bytes'] / 2**20:,.0f} MiB"
    assert mib in text


def test_paired_rounds_as_the_pages_state_them():
    base, fused = json.loads(ROUNDS.read_text())
    assert base["case"] == "logits-then-loss" and fused["chunk"] == 14759
    d = [a - b for a, b in zip(fused["round_medians_ms"], base["round_medians_ms"], strict=True)]
    med, lo, hi = statistics.median(d), min(d), max(d)
    faster = sum(x < 0 for x in d)
    for r in (base, fused):  # the medians over every round's samples
        assert r["median_ms"] == pytest.approx(statistics.median(r["samples_ms"]), abs=1e-3)
    table = _block("linear-rounds")
    assert f"| logits-then-loss | {base['median_ms']:.2f} | {base['peak_extra_gib']:.2f} |" in table
    assert (
        f"| {fused['case']} | {med:+.2f} | {lo:+.2f} | {hi:+.2f} | {faster} of {len(d)} |"
    ) in table
    text, kernels = _text(), _text(KERNELS)
    assert (
        f"The op's median is {med:.2f} ms above logits-then-loss's "
        f"({100 * med / base['median_ms']:.1f} %), between {lo:.2f} and +{hi:.2f} ms"
    ).replace("between -", "between −") in text
    assert f"faster in {faster} of {len(d)} rounds" in text
    first, last = base["round_medians_ms"][0], base["round_medians_ms"][-1]
    assert f"from {first:.2f} ms in the first round to {last:.2f} in the last" in text
    summary = (
        f"a median difference of +{med:.2f} ms to logits-then-loss ({fused['median_ms']:.2f} "
        f"against {base['median_ms']:.2f} ms over {len(fused['samples_ms'])} calls each; per round "
        f"from {lo:.2f} to +{hi:.2f} ms, the op faster in {faster} of {len(d)} rounds) for "
        f"{fused['peak_extra_gib']:.2f} against {base['peak_extra_gib']:.2f} GiB"
    ).replace("from -", "from −")
    assert summary in kernels
    mem = f"{fused['peak_extra_gib']:.2f} against {base['peak_extra_gib']:.2f} GiB"
    assert mem in text
    one = {r["case"]: r for r in json.loads(ONE_ROUND.read_text())}
    lo_hi = [(min(r["samples_ms"]), max(r["samples_ms"]), r["median_ms"]) for r in one.values()]
    (a0, a1, am), (b0, b1, bm) = lo_hi[0], lo_hi[1]
    assert (
        f"spread from {a0:.2f} to {a1:.2f} ms (logits-then-loss) and from {b0:.2f} to {b1:.2f} ms "
        f"(the op), more than the difference sought (its medians {am:.2f} and {bm:.2f} ms)"
    ) in text


def test_evening_profile_as_the_page_states_it():
    prof = EVENING_PROFILE.read_text()
    kernels = {}
    for sec in prof.split("== ")[1:]:
        name = sec.split(":")[0]
        count, total = re.search(r": (\d+) kernels, kernel ms ([\d.]+)", sec).groups()
        per = {k: float(ms) for ms, k in re.findall(r"([\d.]+) ms x\d+\s+(\S+)", sec)}
        kernels[name] = (int(count), float(total), per)
    (lc, lt, lk), (fc, ft, fk) = kernels["logits-then-loss"], kernels["fused-linear"]
    gemms = [k for k in lk if "nvjet" in k]
    assert len(gemms) == 3 and set(gemms) == {k for k in fk if "nvjet" in k}
    diffs = sorted(fk[k] - lk[k] for k in gemms)
    phases = ("_logprobs_bwd_kernel", "_logprobs_fwd_kernel")
    text = _text()
    assert (
        f"logits-then-loss {lc} kernels and {lt:.2f} ms of kernel time, the op {fc} kernels and "
        f"{ft:.2f} ms"
    ) in text
    assert (
        f"({sum(lk[k] for k in gemms):.2f} against {sum(fk[k] for k in gemms):.2f} ms in all: one "
        f"of them {-diffs[0]:.2f} ms faster in the op, the others {diffs[1]:.2f} and "
        f"{diffs[2]:.2f} ms slower)"
    ) in text
    assert (
        f"the two phases ({sum(lk[k] for k in phases):.2f} against "
        f"{sum(fk[k] for k in phases):.2f} ms)"
    ) in text
    env = EVENING_ENV.read_text()
    passed = re.search(r"(\d+) passed", env).group(1)
    assert f"`tests/ops` ({passed} passed" in text


@pytest.mark.parametrize("path", [EVENING_CHECK, ROUNDS, ONE_ROUND, EVENING_PROFILE, EVENING_ENV])
def test_evening_result_files_are_committed(path):
    assert path.exists(), path


_TWENTY_AT = ("220502Z", "221202Z", "222546Z")
TWENTY = [RESULTS / f"cuda-linear-chunks_{GPU}_20261127T{t}.json" for t in _TWENTY_AT]
TWENTY_ENV = [RESULTS / f"gpu-check-env_{GPU}_20261127T{t}.txt" for t in _TWENTY_AT]


def _round_differences(path):
    base, fused = json.loads(path.read_text())
    assert base["case"] == "logits-then-loss" and len(base["round_medians_ms"]) == 20
    return [a - b for a, b in zip(fused["round_medians_ms"], base["round_medians_ms"], strict=True)]


def test_twenty_round_runs_and_the_verdict():
    import math

    per_run = [_round_differences(p) for p in TWENTY]
    text, kernels = _text(), _text(KERNELS)
    meds = [statistics.median(d) for d in per_run]
    wins = [sum(x < 0 for x in d) for d in per_run]
    assert f"median differences of +{meds[0]:.2f}, +{meds[1]:.2f} and +{meds[2]:.2f} ms" in text
    assert f"faster in {wins[0]}, {wins[1]} and {wins[2]} of 20 rounds" in text
    pooled = [x for d in per_run for x in d]
    k, n = sum(x < 0 for x in pooled), len(pooled)
    p = 2 * sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    med = statistics.median(pooled)
    base = json.loads(TWENTY[-1].read_text())[0]["median_ms"]
    assert (
        f"Over the {n} rounds the op is {med:.2f} ms slower at the median "
        f"({100 * med / base:.1f} %) and faster in {k} (a two-sided sign test gives p = {p:.4f})"
    ) in text
    assert (
        f"put it at +{med:.2f} ms, the op faster in {k} of {n} (two-sided sign test p = {p:.4f})"
        in kernels
    )
    assert med > 0 and "is not met**, by about 0.3 ms in 93" in text
    for env in TWENTY_ENV:
        assert "34 passed" in env.read_text()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"about {100 * med / base:.1f} % slower)" in readme


# -- every GPU number on the two pages is a committed row's, measured at a named commit --------

#: A result file cited in a page, by name (``*`` standing for the GPU's name, ``{a,b}`` for
#: extensions); only names with a timestamp cite rows.
_CITED = re.compile(
    r"`(?:benchmarks/results/)?((?:cuda|gpu)-[\w*.{},-]*\d{8}T\d{6}Z[\w*.{},-]*"
    r"|\*_\d{8}T\d{6}Z\.[\w*{},]+)`"
)
_MS = re.compile(r"(?<![\w.])(\d+\.\d+)(?= ms)")
_PCT_FLOOR = re.compile(r"(?<![\w.])(\d+)(?:–(\d+))? % of the (?:3-pass )?(?:bandwidth )?floor")
_SHA = re.compile(r"`([0-9a-f]{7,40})`")
#: Numbers the pages derive from several values of their files (sums of kernels, differences of
#: paired rounds, spans over runs): each is recomputed by the test of this module named here.
DERIVED = {
    ("benchmarks", "82.69"): "test_linear_profile_and_gemm_numbers",
    ("benchmarks", "76.41"): "test_linear_profile_and_gemm_numbers",
    ("benchmarks", "72.97"): "test_linear_profile_and_gemm_numbers",
    ("kernels", "82.69"): "test_linear_profile_and_gemm_numbers",
    ("kernels", "76.41"): "test_linear_profile_and_gemm_numbers",
    ("kernels", "72.97"): "test_linear_profile_and_gemm_numbers",
    ("benchmarks", "82.40"): "test_evening_profile_as_the_page_states_it",
    ("benchmarks", "2.52"): "test_evening_profile_as_the_page_states_it",
    ("benchmarks", "0.27"): "test_twenty_round_runs_and_the_verdict",
    ("kernels", "0.27"): "test_twenty_round_runs_and_the_verdict",
    ("kernels", "0.29"): "test_paired_rounds_as_the_pages_state_them",
    ("kernels", "1.59"): "test_paired_rounds_as_the_pages_state_them",
    ("benchmarks", "1.96"): "test_evening_check_tables_and_criteria",
    ("benchmarks", "0.3"): "test_linear_profile_and_gemm_numbers",
    ("benchmarks", "0.4"): "test_sequence_launch_numbers",
    ("benchmarks", "94.29"): "test_paired_rounds_as_the_pages_state_them",
    ("benchmarks", "106.46"): "test_paired_rounds_as_the_pages_state_them",
    # the floor at datasheet bandwidth, a formula: not a measurement
    ("kernels", "1.49"): "test_floor_table",
    ("kernels", "4.46"): "test_floor_table",
    ("kernels", "5.9"): "test_floor_table",
    ("kernels", "1.04"): "test_floor_table",
    ("kernels", "3.11"): "test_floor_table",
    ("kernels", "4.1"): "test_floor_table",
}


def _sections(text):
    parts = re.split(r"^(#{1,4} .*)$", text, flags=re.M)
    return [("(top)", parts[0])] + [(parts[i], parts[i + 1]) for i in range(1, len(parts), 2)]


def _resolve(name):
    m = re.match(r"(.*)\{(.*)\}$", name)
    names = [m.group(1) + e for e in m.group(2).split(",")] if m else [name]
    return [p for n in names for p in sorted(RESULTS.glob(n)) if p.suffix != ".png"]


def _commit(path):
    """The commit a result file measured: its rows' (``env.git_sha`` or ``git_sha``), else a
    ``commit <sha>`` in its text, else in the ``gpu-check-env_*.txt`` of the same time."""
    text = path.read_text()
    shas = set(re.findall(r'"git_sha": "([0-9a-f]{7,40})"', text))
    shas |= set(re.findall(r"commit[ `]+([0-9a-f]{7,40})", text))
    if not shas:
        stamp = re.search(r"_(\d{8}T\d{6}Z)", path.name).group(1)
        for env in RESULTS.glob(f"gpu-check-env_*_{stamp}.txt"):
            shas |= set(re.findall(r"commit[ `]+([0-9a-f]{7,40})", env.read_text()))
    return {s[:7] for s in shas}


def _leaves(x, key=""):
    """The numbers of a JSON value, without the per-call samples and quartiles (the pages print a
    row's median; the samples would match almost any time)."""
    if key in ("samples", "samples_ms", "p25", "p75", "min", "max", "loadavg_before_after"):
        return
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, k)
    elif isinstance(x, list):
        for v in x:
            yield from _leaves(v, key)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield float(x)


def _numbers(paths):
    out = []
    for p in paths:
        text = p.read_text()
        if p.suffix == ".jsonl":
            out += [
                v for line in text.splitlines() if line.strip() for v in _leaves(json.loads(line))
            ]
        elif p.suffix == ".json":
            out += list(_leaves(json.loads(text)))
        else:
            out += [float(x) for x in re.findall(r"-?\d+\.\d+", text)]
    return out


def _gpu_sections(page):
    for head, body in _sections({"benchmarks": PAGE, "kernels": KERNELS}[page]):
        if re.search(r"H100|H200|GPU", head + body) and (
            _MS.search(body) or _PCT_FLOOR.search(body)
        ):
            yield head, body


@pytest.mark.parametrize("page", ["benchmarks", "kernels"])
def test_every_gpu_number_is_a_committed_rows_at_a_named_commit(page):
    """In every section of the page that reports GPU times: each cited result file exists,
    names the commit it measured, and that commit is named in the section; every ``x.xx ms``
    and every "% of the floor" is a value of the section's files at the printed precision, or
    a derived number (`DERIVED`) that a named test recomputes."""
    checked, missing = 0, []
    for head, body in _gpu_sections(page):
        cited = _CITED.findall(body)
        files = [p for name in cited for p in _resolve(name)]
        assert files, f"{page} {head!r}: GPU numbers without a result file"
        named = {sha[:7] for sha in _SHA.findall(body)}
        for path in files:
            shas = _commit(path)
            assert shas, f"{path.name} names no commit"
            assert shas & named, f"{page} {head!r}: {path.name} measured {shas}, not named"
        values = _numbers(files)
        for x in _MS.findall(body):
            checked += 1
            if (page, x) in DERIVED:
                assert DERIVED[(page, x)] in globals()
                continue
            d = len(x.split(".")[1])
            if not any(abs(round(y, d) - float(x)) < 1e-9 for y in values):
                missing.append((head, x))
        pcts = [r.get("pct_of_peak_bandwidth") for p in files if p.suffix == ".jsonl"
                for r in load([str(p)])]  # fmt: skip
        for lo_hi in _PCT_FLOOR.findall(body):
            for x in filter(None, lo_hi):
                checked += 1
                if not any(p is not None and round(p) == int(x) for p in pcts):
                    missing.append((head, f"{x} %"))
    assert not missing, f"{page}: GPU numbers in no cited file: {missing}"
    assert checked > 20


def test_floor_definition_as_the_pages_state_it():
    """The passes the check's workload moves, ``1 + 2p``, and what the floor reads high by."""
    rows = load([str(EVENING_CHECK)])
    moved = {round(1 + 2 * (r["workload"]["rl_rows"] + r["workload"]["echo_rows"]) / r["n"], 2)
             for r in rows if r["op"] == "loss" and r["n"] >= 16384}  # fmt: skip
    assert moved == {2.80}
    share = round(100 * (3 / 2.80 - 1))
    text, kernels = _text(), _text(KERNELS)
    assert f'2.80 passes, and its "% of the floor" reads {share} % higher' in text
    assert f'**2.80 passes**, so its "% of the floor" reads 3 / 2.80 = {share} % higher' in kernels
    [r] = [r for r in rows if (r["op"], r["n"], r["v"], r["provider"]) ==
           ("loss", 16384, 151936, "triton")]  # fmt: skip
    pct = r["pct_of_peak_bandwidth"]
    assert (
        f"**{r['time_ms']['median']:.2f} ms, {pct:.0f} % of the floor** "
        f"({pct * 2.8016 / 3:.0f} % of the 2.80 passes it moves)"
    ) in kernels
    from benchmarks.harness import peak_bandwidth

    assert (
        peak_bandwidth("NVIDIA H200") == 4.8e12
        and peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    )
    assert "4.8 TB/s for an H200" in text and "4.8 TB/s for an H200" in kernels
    big = [round(r["pct_of_peak_bandwidth"]) for r in rows
           if r["op"] == "loss" and r["provider"] == "triton" and r["n"] >= 16384]  # fmt: skip
    assert f"{min(big)}–{max(big)} % of the 3-pass bandwidth floor" in kernels


def test_launch_sweep_as_the_pages_state_it():
    rows = load([str(RESULTS / f"cuda-check-custom_{GPU}_20261127T112341Z.jsonl")])
    phase2 = {(r["block_v"], r["num_warps"]): r["time_ms"]["median"] for r in rows
              if r["op"] == "launch" and r["mode"] == "phase2"}  # fmt: skip
    best = min(phase2, key=phase2.get)
    default = phase2[(4096, 8)]
    slower = 100 * (default / phase2[best] - 1)
    assert best == (4096, 16) and round(slower) == 3
    for page in (_text(), _text(KERNELS)):
        assert f"{slower:.0f} % slower than the best" in page
        assert f"{default:.2f} ms" in page and f"{phase2[best]:.2f} ms" in page
    assert "within 2 % of the best" not in _text() and "within 3 % of" not in _text(KERNELS)
    assert {r["env"]["git_sha"][:7] for r in rows} == {"68e3629"}


def test_stale_claims_are_gone():
    k = _text(KERNELS)
    assert "46–70 %" not in k and "3–26 % faster" not in k and "5.54 ms" not in k
    assert "3.2–3.75 TB/s" not in k  # an estimate with no row behind it
    text = _text()
    assert (
        "TRL's Triton logprob and entropy kernels" in text and "echoloss's own loss algebra" in text
    )
    quoted = _text(re.sub(r"^> ?", "", KERNELS, flags=re.M))  # the page's opening is a quote
    assert "TRL's logprob and entropy kernels with echoloss's own loss algebra" in quoted


def test_floor_table():
    """The kernels page's floor at N = 16,384, V = 151,936 (bf16) for each GPU's datasheet
    bandwidth: one read, three passes, and the time of 75 % of the floor."""
    from benchmarks.harness import peak_bandwidth

    k = _text(KERNELS)
    one = 16384 * 151936 * 2
    for name, label in (("NVIDIA H100 80GB HBM3", "H100 SXM (3.35 TB/s)"),
                        ("NVIDIA H200", "H200 (4.8 TB/s)")):  # fmt: skip
        bw = peak_bandwidth(name)
        read, floor = one / bw * 1e3, 3 * one / bw * 1e3
        row = f"| {label} | {read:.2f} ms | {floor:.2f} ms | ≤ {floor / 0.75:.1f} ms |"
        assert row in KERNELS, row
    assert "(4.98 GB of bf16 logits)" in k and f"{one / 1e9:.2f}" == "4.98"
