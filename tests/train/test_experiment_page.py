"""Every result table of docs/experiment.md, recomputed from the committed rows.

Each table sits in a section that names its rows' folder (``docs/experiment/<folder>/``); each
column's header names a statistic (`COLUMNS`), recomputed here with `summarize` / `paired_ci` /
`speed_ratio` from that folder's ``results.json`` and compared with every number printed in the
cell, to the digits printed. A table whose header this test does not know fails, so a new table
needs its statistic here. Prose numbers that carry a claim are checked in `test_prose_claims`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from echoloss.train.experiment import arm_label, paired_ci, summarize

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "experiment.md"
ROWS = ROOT / "docs" / "experiment"

_NUMBER = re.compile(r"[+\-−]?\d+(?:[.,]\d+)*")


def _numbers(cell: str) -> list[tuple[float, int]]:
    """The numbers printed in a cell, each with its count of decimals."""
    out = []
    for m in _NUMBER.finditer(cell.replace("**", "")):
        text = m.group().replace("−", "-").replace(",", "")
        decimals = len(text.split(".")[1]) if "." in text else 0
        out.append((float(text), decimals))
    return out


def _rows(folder: str) -> list[dict[str, Any]]:
    rows = json.loads((ROWS / folder / "results.json").read_text())
    if folder == "":
        rows = [r for r in rows if r["env"] == "mirrorgrid"]
    return [dict(r) for r in rows]


def _ci(d: dict[str, float] | None) -> list[float]:
    return [d["mean"], d["lo"], d["hi"]] if d else []


def _verdict(d: dict[str, float]) -> str:
    if d["lo"] > -0.03:
        return "not worse"
    return "worse" if d["hi"] < -0.03 else "undecided"


def _per_seed(
    rows: list[dict[str, Any]], arm: str, fn: Callable[[dict[str, Any]], float]
) -> list[float]:
    return [fn(r) for r in sorted(rows, key=lambda r: r["seed"]) if arm_label(r) == arm]


def _within_2x(rows: list[dict[str, Any]], arm: str) -> list[float]:
    ends = _per_seed(rows, arm, lambda r: r["heldout_obs_ce_end"] / r["obs_ce_floor"])
    return [sum(ends) / len(ends), sum(1 for x in ends if x <= 2), len(ends)]


# header (a floor in parentheses stripped) -> numbers of the cell, from (summary entry, rows, arm)
Stat = Callable[[dict[str, Any], list[dict[str, Any]], str], list[float]]
COLUMNS: dict[str, Stat] = {
    "seeds": lambda e, rows, arm: [len(e["seeds"])],
    "sampled start → end": lambda e, rows, arm: [
        e["eval_success_sampled_start"]["mean"],
        e["eval_success_sampled_end"]["mean"],
    ],
    "sampled success start → end": lambda e, rows, arm: [
        e["eval_success_sampled_start"]["mean"],
        e["eval_success_sampled_end"]["mean"],
    ],
    "Δ sampled end vs grpo": lambda e, rows, arm: _ci(
        e["eval_success_sampled_end"].get("diff_vs_grpo")
    ),
    "verdict": lambda e, rows, arm: [],
    "greedy start → end": lambda e, rows, arm: [
        e["eval_success_start"]["mean"],
        e["eval_success_end"]["mean"],
    ],
    "Δ greedy end vs grpo": lambda e, rows, arm: _ci(e["eval_success_end"].get("diff_vs_grpo")),
    "gain over RL: sampled, greedy": lambda e, rows, arm: [
        e["eval_success_sampled_gain"]["mean"],
        e["eval_success_gain"]["mean"],
    ],
    "steps to 80 % greedy (reached)": lambda e, rows, arm: [
        e["steps_to_80_or_censored"]["mean"],
        80,
        e["reached_80"],
    ],
    "gain over RL, sampled [95 % CI]": lambda e, rows, arm: _ci(
        paired_ci(
            _per_seed(
                rows, arm, lambda r: r["eval_success_sampled_end"] - r["eval_success_sampled_start"]
            )
        )
    ),
    "hidden CE start → end": lambda e, rows, arm: [
        e["heldout_obs_ce_start"]["mean"],
        e["heldout_obs_ce_end"]["mean"],
    ],
    "hidden CE end": lambda e, rows, arm: [e["heldout_obs_ce_end"]["mean"]],
    "drop": lambda e, rows, arm: [e["heldout_obs_ce_drop"]["mean"]],
    "Δ drop vs grpo": lambda e, rows, arm: _ci(e["heldout_obs_ce_drop"].get("diff_vs_grpo")),
    "end / floor": lambda e, rows, arm: [e["obs_ce_over_floor_end"]["mean"]],
    "end / floor (seeds within 2×)": lambda e, rows, arm: _within_2x(rows, arm),
    "change of the hidden CE [95 % CI]": lambda e, rows, arm: _ci(
        paired_ci(
            _per_seed(rows, arm, lambda r: r["heldout_obs_ce_end"] - r["heldout_obs_ce_start"])
        )
    ),
    "all-token CE start → end": lambda e, rows, arm: [
        e["heldout_obs_ce_all_start"]["mean"],
        e["heldout_obs_ce_all_end"]["mean"],
    ],
    "imagined / invalid replies (end)": lambda e, rows, arm: [
        e["imagined_obs_rate_end"]["mean"],
        e["invalid_reply_rate_end"]["mean"],
    ],
    "invalid replies (end)": lambda e, rows, arm: [e["invalid_reply_rate_end"]["mean"]],
}
# Tables whose numbers are not arm statistics of committed rows: the world-model probe (its
# rows are the probe's jsonl, checked in tests/test_scripts.py), the first version's pilot
# findings, and the persistence design's arm list (settings, not results).
NOT_ROW_TABLES = ("| model | where |", "| finding |", "| level | arm | λ | echo target |")


def _tables() -> list[tuple[str, str, list[str], list[list[str]]]]:
    """Every table: (its section, the folder its section names, header, body rows)."""
    text = PAGE.read_text()
    out = []
    for section in re.split(r"^(?=## )", text, flags=re.M):
        title = section.splitlines()[0] if section else ""
        lines = section.splitlines()
        i = 0
        while i < len(lines):
            if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
                before = "\n".join(lines[:i])
                folders = re.findall(r"docs/experiment/([\w\-/<>]*(?:\.json)?)", before)
                folder = folders[-1].rstrip("/") if folders else None
                if folder and folder.endswith(".json"):  # the main run's files, at the top
                    folder = folder.rpartition("/")[0]
                header = [c.strip() for c in lines[i].strip("|").split("|")]
                body = []
                i += 2
                while i < len(lines) and lines[i].startswith("|"):
                    body.append([c.strip() for c in lines[i].strip("|").split("|")])
                    i += 1
                out.append((title, folder or "", header, body))
            i += 1
    return out


def _column(header: str) -> str:
    return re.sub(r"\s*\((floor[^)]*)\)", "", header).strip()


PERSISTENCE = "persistence"  # its tables are persistence.markdown's, compared verbatim below
TABLES = [
    t
    for t in _tables()
    if t[1] != PERSISTENCE
    and not any(t[2] and ("| " + " | ".join(t[2]) + " |").startswith(p) for p in NOT_ROW_TABLES)
]


def _folder(folder: str) -> str:
    return folder


@pytest.mark.parametrize("table", TABLES, ids=[f"{t[0][3:40]}|{t[2][1]}" for t in TABLES])
def test_every_number_of_every_result_table_is_recomputed(table):
    title, folder, header, body = table
    assert title and folder is not None
    for row in body:
        assert len(row) == len(header), row
        if header[0] == "control":
            control, arm = row[0].strip("`"), row[1]
            rows = _rows(f"controls/{control}")
            cells = list(zip(header[2:], row[2:], strict=True))
        else:
            arm = row[0].replace("**", "")
            rows = _rows(_folder(folder.replace("controls/<env>", "")))
            cells = list(zip(header[1:], row[1:], strict=True))
        summary = summarize([dict(r) for r in rows])
        entry = summary["arms"][arm]
        for head, cell in cells:
            name = _column(head)
            assert name in COLUMNS, f"{title}: column {head!r} has no recomputation in COLUMNS"
            floor = re.search(r"floor ([\d.]+)", head)
            if floor:
                want_floor = rows[0]["obs_ce_floor" if "hidden" in head else "obs_ce_all_floor"]
                digits = len(floor.group(1).split(".")[1])
                assert float(floor.group(1)) == pytest.approx(want_floor, abs=0.5 * 10**-digits)
            if cell in ("–", ""):
                continue
            want = COLUMNS[name](entry, rows, arm)
            if head.endswith("(floor)"):  # the floor printed in the cell (controls: it differs)
                want = [*want, rows[0]["obs_ce_floor"]]
            got = _numbers(cell)
            if name == "steps to 80 % greedy (reached)":
                got = [got[0], (80, 0), got[-1]]  # "60.0 (0)": the 80 of the header is not a cell
            assert got or not want, f"{title}: {arm} {head}: no number in {cell!r}"
            assert len(got) <= len(want), f"{title}: {arm} {head}: {cell!r} has more than {want}"
            for (value, digits), expected in zip(got, want, strict=False):
                tol = 0.5 * 10**-digits + 1e-9
                assert abs(value - expected) <= tol, (
                    f"{title}: {arm} {head}: page {value} vs rows {expected:.5f} in {cell!r}"
                )
            for word in ("not worse", "undecided", "worse"):
                if word in cell.replace("**", "") and name in ("Δ sampled end vs grpo", "verdict"):
                    d = entry["eval_success_sampled_end"]["diff_vs_grpo"]
                    assert _verdict(d) == word, (
                        f"{title}: {arm}: verdict {word!r}, rows {_verdict(d)!r}"
                    )
                    break


def test_every_row_table_is_checked():
    """A table is either recomputed above or named in NOT_ROW_TABLES (never silently skipped)."""
    assert len(TABLES) >= 10
    everything = _tables()
    persistence = [t for t in everything if t[1] == PERSISTENCE]
    assert len(everything) == len(TABLES) + len(NOT_ROW_TABLES) + len(persistence)


def test_the_persistence_tables_are_the_report_of_the_committed_rows():
    """The persistence section prints `persistence.markdown` of its committed rows, verbatim
    (its four tables, the verdicts included), over the seeds whose six arms all finished; its
    summary.json is what `summarize` computes; every row has the documented fields."""
    from echoloss.train import persistence
    from echoloss.train.experiment import LEVEL_ARMS

    folder = ROWS / PERSISTENCE
    if not (folder / "results.json").is_file():
        pytest.skip("the persistence rows are not committed yet")
    rows = json.loads((folder / "results.json").read_text())
    labels = {f"{lv} {a}" + ("" if a == "grpo" else f" {x:g}") for lv, a, x, _ in LEVEL_ARMS}
    complete = sorted(
        s
        for s in {r["seed"] for r in rows}
        if {arm_label(r) for r in rows if r["seed"] == s} == labels
    )
    for r in rows:
        for key in ("level", "arm", "model", "alpha", "seed", "move_ce_start", "move_ce_end"):
            assert r.get(key) is not None, (key, r["arm"], r["seed"])
        assert "steps_to_80" in r and r["model"] == "tiny" and r["rl_steps"] == 60
        assert r["level"] in ("per-world", "per-episode") and r["arm"] in (
            "grpo",
            "echo",
            "placebo",
        )
    summary = summarize([dict(r) for r in rows if r["seed"] in complete])
    summary["complete_seeds"] = complete
    committed = json.loads((folder / "summary.json").read_text())
    assert committed["complete_seeds"] == complete
    for arm, entry in summary["arms"].items():
        for key in ("eval_success_sampled_end", "move_ce_end", "eval_success_end"):
            assert committed["arms"][arm][key]["mean"] == pytest.approx(
                entry[key]["mean"], rel=1e-12
            )
    md = persistence.markdown(summary)
    page = PAGE.read_text()
    assert md.strip() in page, "docs/experiment.md does not print persistence.markdown of its rows"


def _gains(folder: str, arm: str) -> list[float]:
    rows = _rows(folder)
    return _per_seed(
        rows, arm, lambda r: r["eval_success_sampled_end"] - r["eval_success_sampled_start"]
    )


def _ce_changes(folder: str, arm: str) -> list[float]:
    rows = _rows(folder)
    return _per_seed(rows, arm, lambda r: r["heldout_obs_ce_end"] - r["heldout_obs_ce_start"])


def test_prose_claims():
    """Numbers of the page's prose that carry its conclusions, recomputed from the rows (each
    with the sentence it appears in)."""
    text = PAGE.read_text()

    def says(fragment: str) -> None:
        assert fragment in " ".join(text.split()), f"the page no longer says {fragment!r}"

    # GRPO's CE change in the 10 settings: point estimate up in all, interval above 0 in 7
    settings = ["", "rl-120", "copy-1000", "default-24-seeds", "calibrated-start",
                "short-calibrated-start", "exploring-start-400", "world-model-start",
                "controls/mirrorgrid-noise", "controls/mirrorgrid-shown"]  # fmt: skip
    cis = [paired_ci(_ce_changes(f, "grpo")) for f in settings]
    assert all(c["mean"] > 0 for c in cis) and sum(c["lo"] > 0 for c in cis) == 7
    main = cis[0]
    says(f"+{main['mean']:.3f} [−{-main['lo']:.3f}, +{main['hi']:.3f}]")
    says("rises in all 10 settings run, with an interval above 0 in 7 of them")
    # λ = 0.01 from the short calibrated start raised the CE in 8 of 8 seeds; 0.05 lowered it
    up = _ce_changes("short-calibrated-start", "echo-0.01")
    assert sum(c > 0 for c in up) == 8 and len(up) == 8
    says(f"in 8 of 8 seeds: +{min(up):.2f} to +{max(up):.2f}")
    assert all(c < 0 for c in _ce_changes("short-calibrated-start", "echo-0.05"))
    # the exploring start: every GRPO seed gains +21 to +39 points
    g = _gains("exploring-start-400", "grpo")
    assert (round(100 * min(g)), round(100 * max(g))) == (21, 39)
    says("every seed +21 to +39")
    # ActObs: its gain over RL against GRPO's
    s = summarize(_rows(""))
    d = s["arms"]["actobs"]["eval_success_sampled_gain"]["diff_vs_grpo"]
    says(f"+{d['mean']:.3f} [−{-d['lo']:.3f}, +{d['hi']:.3f}]")
    says(f"+{100 * d['mean']:.1f} [−{-100 * d['lo']:.1f}, +{100 * d['hi']:.1f}]")
    # the 300-step pilot: echo's rise about a seventh of GRPO's
    pilot = {
        r["arm"]: r
        for r in json.loads((ROWS / "world-model-start" / "pilot-300-steps.json").read_text())
    }
    rise = {a: r["heldout_obs_ce_end"] - r["heldout_obs_ce_start"] for a, r in pilot.items()}
    assert 1 / 8 < rise["echo-0.2"] / rise["grpo"] < 1 / 6
    says(
        f"a rise of {rise['echo-0.2']:.3f} at λ = 0.2 and {rise['echo-0.05']:.3f} at 0.05, against {rise['grpo']:.3f}"
    )
    # the headline gains of the summary paragraph, each with its interval
    for folder, arm, fragment in [
        ("", "grpo", "11.5 points [+7.9, +15.0]"),
        ("rl-120", "grpo", "18.5 [+14.0, +23.0]"),
        ("short-calibrated-start", "grpo", "+0.3 [−6.8, +7.5]"),
        ("short-calibrated-start", "echo-0.05", "4.9 points [+0.1, +9.6]"),
        ("exploring-start-400", "grpo", "27.6 points [+22.8, +32.3]"),
        ("world-model-start", "grpo", "51.1 points [+48.6, +53.7]"),
    ]:
        c = paired_ci(_gains(folder, arm))
        lo, hi = 100 * c["lo"], 100 * c["hi"]
        want = f"{abs(100 * c['mean']):.1f}"
        assert fragment.lstrip("+").startswith(want), (folder, arm, c)
        assert (
            f"{'+' if lo >= 0 else '−'}{abs(lo):.1f}, {'+' if hi >= 0 else '−'}{abs(hi):.1f}]"
            in fragment
        )
        says(fragment)
    assert not math.isnan(main["mean"])


def test_the_pretrained_step_timing_is_the_committed_measurement():
    text = " ".join(PAGE.read_text().split())
    rows = [
        json.loads(x)
        for x in (ROWS / PERSISTENCE / "pretrained-step-timing.jsonl").read_text().splitlines()
    ]
    warm, rl = rows
    assert (warm["phase"], rl["phase"]) == ("warmup", "rl")
    for fragment in (
        f"one warm-up step (32 demonstrations, {warm['tokens']:,} tokens) took **{warm['step_time']:.0f} s**",
        f"rollouts, {rl['env/mirrorgrid-noise/turns']:.1f} turns each, {rl['tokens']:,} tokens) **{rl['step_time']:.0f} s**",
        f"{rl['gen_time']:.0f} s of it generation",
        f"{100 * rl['invalid_reply_rate']:.1f} % of SmolLM2's replies were invalid",
        f"about {(80 * warm['step_time'] + 60 * rl['step_time']) / 3600:.0f} hours here",
    ):
        assert fragment in text, fragment


def test_the_persistence_prose_is_its_rows():
    """The numbers the persistence result's bullets print, from its committed rows."""
    folder = ROWS / PERSISTENCE
    if not (folder / "results.json").is_file():
        pytest.skip("the persistence rows are not committed yet")
    text = " ".join(PAGE.read_text().split())
    rows = json.loads((folder / "results.json").read_text())
    committed = json.loads((folder / "summary.json").read_text())
    s = summarize([dict(r) for r in rows if r["seed"] in committed["complete_seeds"]])["arms"]

    def m(arm: str, key: str) -> str:
        return f"{s[arm][key]['mean']:.3f}"

    def d(arm: str) -> str:
        return f"{100 * s[arm]['eval_success_sampled_end']['diff_vs_grpo']['mean']:+.1f}"

    walls = sorted(r["wall_s"] for r in rows)
    n = len(committed["complete_seeds"])
    for fragment in (
        f"{n} of 12 seeds, incomplete against the protocol",
        f"an arm took {walls[0]:,.0f}–{walls[-1]:,.0f} s of wall time",
        f"rises {m('per-world grpo', 'move_ce_start')} → {m('per-world grpo', 'move_ce_end')}",
        f"({m('per-world echo 0.01', 'move_ce_end')} at λ = 0.01, {m('per-world echo 0.05', 'move_ce_end')} at 0.05)",
        f"The placebo's rises to {m('per-world placebo 0.05', 'move_ce_end')}",
        f"{d('per-world echo 0.01')} points at λ = 0.01, {d('per-world echo 0.05')} at 0.05 and "
        f"{d('per-world placebo 0.05')} for the placebo; per episode, echo at 0.05 {d('per-episode echo 0.05')}",
    ):
        assert fragment in text, fragment
    assert all(s[a]["reached_80"] == 0 for a in s)  # "every run is censored"
    assert all(
        r["move_ce_end"] > r["move_ce_start"] for r in rows if r["seed"] == 0
    )  # none lowers it
    assert n == 1 and 'every verdict below is "undecided"' in text
