"""The world-model 2×2's pre-registered analysis: its verdict, its page section and its figures,
each a pure function of the rows (``docs/experiment/world-model-2x2/results.json``).

The design (docs/experiment.md, "Does knowing the world help? A pre-registered 2×2"): two RL
starts, **world-model** (the seed's warm-start continued on the observation CE of random walks in
the seed's world, `echo_experiment.world_model`) and **sham** (the same stage in the ordinary
world), times two arms, **grpo** and **echo** (GRPO + echo at λ = `ALPHA`), over the paired
seeds `SEEDS`, each seed in its world `WORLDS[seed]`. One row per start × arm × seed.

The rule, fixed before the run (`verdict`), on the sampled held-out success at the last RL step
(``eval_success_end``), differences paired by seed with 95 % t intervals:

* P1 = world-model grpo − sham grpo (does knowing the world help at all);
* P2 = world-model echo − world-model grpo (does echo keep it, and does that pay);
* P3 = sham echo − sham grpo (reported; not part of the rule).
* **manipulation** (before RL): the world-model start's move-word CE (held-out random walks in
  the seed's world, ``move_ce_start``) has its 95 % interval over seeds below ``log 2``, and the
  sham start's is above it (paired sham − world-model interval above 0).
* **support**: the manipulation holds, P1 > 0, world-model echo's end move CE has its mean below
  ``log 2`` and is below world-model grpo's (paired interval below 0), and P2 > 0 (each "> 0": the
  interval's lower bound above 0).
* **refutation** (only where support fails): the manipulation holds and either P1's upper bound is
  below +3 points (knowing the world does not help here), or echo keeps the CE (world-model
  echo's end mean below ``log 2``) while GRPO loses it (world-model grpo's end mean at or above
  ``log 2``) and P2's upper bound is below +3 points.
* otherwise **undecided**, naming the parts that failed.

No verdict is given unless the rows are exactly the pre-registered set (`problems`): every seed
of `SEEDS` with its world, all four cells, `RL_STEPS` RL steps, one code commit, a clean tree.
"""

from __future__ import annotations

import math
from typing import Any

from echo_experiment.stats import paired_ci

__all__ = [
    "ALPHA",
    "CELLS",
    "RL_STEPS",
    "SEEDS",
    "WORLDS",
    "cell",
    "contrasts",
    "job_kind",
    "problems",
    "progress_markdown",
    "steps_to_80_or_censored",
    "verdict",
]

LOG2 = math.log(2)
GAIN = 0.03  # +3 points: the smallest gain a refutation must rule out
ALPHA = 0.05  # echo's λ
RL_STEPS = 100
EVAL_EVERY = 20
THRESHOLD = 0.8  # steps to 80 %: greedy held-out success
CENSORED_AT = RL_STEPS + EVAL_EVERY  # a run that never reaches 80 % by step 100 counts as 120
SEEDS = tuple(range(12))
#: The seed's world (``env.world``; `echoloss.train.envs.mirrorgrid.world_permutation`): every
#: one a derangement (no key moves its own way). Four directions have only 9 derangements, so 12
#: distinct ones do not exist: seeds 0–8 have the 9 (six 4-cycles, three pairs of swaps) and seeds
#: 9–11 repeat the three pairs of swaps, so that each kind has six seeds.
WORLDS = (2, 9, 11, 12, 13, 15, 18, 27, 43, 15, 18, 27)
STARTS = ("world-model", "sham")
ARMS = ("grpo", "echo")
CELLS = tuple(f"{s} {a}" for s in STARTS for a in ARMS)


def cell(row: dict[str, Any]) -> str:
    """The row's cell: ``"<start> <arm>"``.

    Examples:
        >>> cell({"start": "sham", "arm": "echo"})
        'sham echo'
    """
    return f"{row['start']} {row['arm']}"


def steps_to_80_or_censored(row: dict[str, Any]) -> int:
    """The row's RL steps to 80 % greedy held-out success, a run that never got there counted at
    `CENSORED_AT` (the one censoring rule of every table and figure).

    Examples:
        >>> steps_to_80_or_censored({"steps_to_80": 40}), steps_to_80_or_censored({"steps_to_80": None})
        (40, 120)
    """
    reached = row.get("steps_to_80")
    return CENSORED_AT if reached is None else int(reached)


def problems(rows: list[dict[str, Any]], *, commits: str = "run") -> list[str]:
    """Why ``rows`` are not the complete pre-registered run (empty when they are): a missing or
    repeated cell, a seed outside `SEEDS`, a world other than `WORLDS[seed]`, another λ, RL
    length, more than one code commit (``commits="seed"``, the gated design: more than one
    within a seed's four runs), or a dirty tree.

    Examples:
        >>> problems([])[0]
        '0 of 48 runs'
    """
    out = []
    keys = [(r["seed"], cell(r)) for r in rows]
    want = {(s, c) for s in SEEDS for c in CELLS}
    if set(keys) != want or len(keys) != len(want):
        out.append(f"{len(want & set(keys))} of {len(want)} runs")
    extra = sorted({s for s, _ in keys} - set(SEEDS))
    if extra:
        out.append(f"seeds {extra} are not pre-registered")
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        out.append(f"runs {twice} appear more than once")
    for r in rows:
        s = r["seed"]
        if s in SEEDS and r.get("world") != WORLDS[s]:
            out.append(f"seed {s} ran world {r.get('world')}, not {WORLDS[s]}")
        alpha = ALPHA if r["arm"] == "echo" else 0.0
        if r.get("alpha") != alpha:
            out.append(f"seed {s} {cell(r)}: λ {r.get('alpha')}, not {alpha}")
        if r.get("rl_steps") != RL_STEPS:
            out.append(f"seed {s} {cell(r)}: {r.get('rl_steps')} RL steps, not {RL_STEPS}")
        if r.get("dirty") is not False:
            out.append(f"seed {s} {cell(r)}: not from a clean tree (dirty {r.get('dirty')})")
    if commits not in ("run", "seed"):
        raise ValueError(f"problems: commits must be 'run' or 'seed' (got {commits!r})")
    groups = [rows] if commits == "run" else [
        [r for r in rows if r["seed"] == s] for s in sorted({r["seed"] for r in rows})]  # fmt: skip
    for group in groups:
        shas = sorted({str(r.get("commit")) for r in group})
        if len(shas) > 1:
            where = "" if commits == "run" else f"seed {group[0]['seed']}: "
            out.append(f"{where}rows from {len(shas)} code commits ({', '.join(shas)})")
    return list(dict.fromkeys(out))


def _paired(rows: list[dict[str, Any]], a: str, b: str, key: str) -> dict[str, float]:
    """``key`` of cell ``a`` minus cell ``b``, paired by seed over the seeds that have both."""
    by = {(r["seed"], cell(r)): r for r in rows}
    seeds = sorted({s for s, c in by if c == a} & {s for s, c in by if c == b})
    return paired_ci([by[(s, a)][key] - by[(s, b)][key] for s in seeds])


def _over_seeds(rows: list[dict[str, Any]], c: str, key: str) -> dict[str, float]:
    """``key`` of cell ``c``: mean over its seeds and the 95 % t interval of that mean."""
    return paired_ci([r[key] for r in sorted(rows, key=lambda r: r["seed"]) if cell(r) == c])


def contrasts(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The pre-registered quantities, each ``{"mean", "lo", "hi", "n"}``: ``P1``, ``P2``,
    ``P3`` (sampled success at the last RL step), ``ce_echo_vs_grpo`` (world-model echo − grpo,
    end move CE), ``ce_sham_vs_wm_start`` (sham − world-model, start move CE), and per cell
    ``"<cell> move_ce_start"`` / ``"<cell> move_ce_end"`` (mean and interval over seeds)."""
    wm, sham = "world-model", "sham"
    out = {
        "P1": _paired(rows, f"{wm} grpo", f"{sham} grpo", "eval_success_end"),
        "P2": _paired(rows, f"{wm} echo", f"{wm} grpo", "eval_success_end"),
        "P3": _paired(rows, f"{sham} echo", f"{sham} grpo", "eval_success_end"),
        "ce_echo_vs_grpo": _paired(rows, f"{wm} echo", f"{wm} grpo", "move_ce_end"),
        "ce_sham_vs_wm_start": _paired(rows, f"{sham} grpo", f"{wm} grpo", "move_ce_start"),
    }
    for c in CELLS:
        for key in ("move_ce_start", "move_ce_end"):
            out[f"{c} {key}"] = _over_seeds(rows, c, key)
    return out


def _below(d: dict[str, float], key: str, bar: float) -> bool | None:
    """Whether ``d[key] < bar``; None without two seeds (no interval)."""
    return None if d.get("n", 0) < 2 or math.isnan(d[key]) else d[key] < bar


def _above(d: dict[str, float], key: str, bar: float) -> bool | None:
    """Whether ``d[key] > bar``; None without two seeds (no interval)."""
    return None if d.get("n", 0) < 2 or math.isnan(d[key]) else d[key] > bar


def _not(part: bool | None) -> bool | None:
    """``not part``, None staying None."""
    return None if part is None else not part


def _all(*parts: bool | None) -> bool | None:
    """All of ``parts`` (None when one is unknown and none is false)."""
    if any(p is False for p in parts):
        return False
    return None if any(p is None for p in parts) else True


def verdict(rows: list[dict[str, Any]], *, commits: str = "run") -> dict[str, Any]:
    """The pre-registered verdict of ``rows`` (see the module docstring): ``verdict``
    (``"support"``, ``"refutation"``, ``"undecided"``, or None when `problems` lists any;
    ``commits`` as there), each
    criterion's part (``parts``: name -> bool, None without two paired seeds), the refutation's
    branch (``because``) and the support parts that do not hold (``failed``).

    Examples:
        >>> verdict([])["verdict"] is None
        True
    """
    c = contrasts(rows)
    wm_echo_end = c["world-model echo move_ce_end"]
    wm_grpo_end = c["world-model grpo move_ce_end"]
    parts = {
        "manipulation": _all(
            _below(c["world-model grpo move_ce_start"], "hi", LOG2),
            _above(c["ce_sham_vs_wm_start"], "lo", 0.0),
        ),
        "P1 > 0": _above(c["P1"], "lo", 0.0),
        "echo's end CE below log 2": _below(wm_echo_end, "mean", LOG2),
        "echo's end CE below GRPO's": _below(c["ce_echo_vs_grpo"], "hi", 0.0),
        "P2 > 0": _above(c["P2"], "lo", 0.0),
        "P1 < +3 points": _below(c["P1"], "hi", GAIN),
        "GRPO's end CE at or above log 2": _not(_below(wm_grpo_end, "mean", LOG2)),
        "P2 < +3 points": _below(c["P2"], "hi", GAIN),
    }
    support = ("manipulation", "P1 > 0", "echo's end CE below log 2", "echo's end CE below GRPO's",
               "P2 > 0")  # fmt: skip
    failed = [p for p in support if parts[p] is not True]
    because = None
    if _all(parts["manipulation"], parts["P1 < +3 points"]):
        because = "knowing the world does not help here (P1 < +3 points)"
    elif _all(
        parts["manipulation"],
        parts["echo's end CE below log 2"],
        parts["GRPO's end CE at or above log 2"],
        parts["P2 < +3 points"],
    ):
        because = (
            "echo keeps the world model while GRPO loses it, and that does not pay (P2 < +3 points)"
        )
    if problems(rows, commits=commits):
        decided = None
    elif not failed:
        decided = "support"
    elif because is not None:
        decided = "refutation"
    else:
        decided = "undecided"
    return {
        "verdict": decided,
        "parts": parts,
        "failed": failed,
        "because": because if decided == "refutation" else None,
        "contrasts": c,
    }


# ------------------------------------------------------------------------------------------------
# The page: the pilot's and the result's generated blocks of docs/experiment.md

PILOT_MARKERS = (
    "<!-- world-model pilot: generated by run.py world-model-page from "
    "docs/experiment/world-model-2x2/pilot.json, do not edit -->",
    "<!-- end of the world-model pilot -->",
)
RESULT_MARKERS = (
    "<!-- world-model result: generated by run.py world-model-page from "
    "docs/experiment/world-model-2x2/results.json, do not edit -->",
    "<!-- end of the world-model result -->",
)


def _f(x: Any, digits: int = 3, signed: bool = False) -> str:
    """A number as the page prints it (``−`` for minus; ``–`` for none)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    text = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return text.replace("-", "−")


def _interval(d: dict[str, float], scale: float = 1.0, digits: int = 3) -> str:
    """``+0.036 [−0.010, +0.082]`` (mean and 95 % t interval), ``+0.036 (one seed)``, or ``–``."""
    if not d.get("n"):
        return "–"
    mean = _f(scale * d["mean"], digits, True)
    if d["n"] < 2:
        return f"{mean} (one seed)"
    return f"{mean} [{_f(scale * d['lo'], digits, True)}, {_f(scale * d['hi'], digits, True)}]"


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def _complete_seeds(rows: list[dict[str, Any]]) -> list[int]:
    """The seeds that have all four cells."""
    have: dict[int, set[str]] = {}
    for r in rows:
        have.setdefault(r["seed"], set()).add(cell(r))
    return sorted(s for s, cells in have.items() if cells == set(CELLS))


def _seed_list(seeds: list[int]) -> str:
    """``"seeds 0, 1 (2)"``, ``"seed 0 (1)"`` or ``"no seed yet"``.

    Examples:
        >>> _seed_list([0]), _seed_list([0, 3]), _seed_list([])
        ('seed 0 (1)', 'seeds 0, 3 (2)', 'no seed yet')
    """
    if not seeds:
        return "no seed yet"
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} ({len(seeds)})"


def _cell_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| start, arm | runs | sampled success: start → end | greedy success: end "
        "| move CE: start → end | invalid replies: start / end | steps to 80 % "
        f"(reached; never: {CENSORED_AT}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in CELLS:
        mine = [r for r in rows if cell(r) == c]
        steps = [steps_to_80_or_censored(r) for r in mine]
        reached = sum(r.get("steps_to_80") is not None for r in mine)
        lines.append(
            f"| {c} | {len(mine)} | {_f(_mean(mine, 'eval_success_start'))} → "
            f"{_f(_mean(mine, 'eval_success_end'))} | {_f(_mean(mine, 'eval_success_greedy_end'))} | "
            f"{_f(_mean(mine, 'move_ce_start'))} → {_f(_mean(mine, 'move_ce_end'))} | "
            f"{_f(_mean(mine, 'invalid_start'))} / {_f(_mean(mine, 'invalid_end'))} | "
            f"{_f(sum(steps) / len(steps) if steps else None, 1)} ({reached}) |"
        )
    return lines


def _contrast_lines(c: dict[str, dict[str, float]]) -> list[str]:
    return [
        "| quantity | paired seeds | mean [95 % t CI] |",
        "|---|---|---|",
        f"| P1 = world-model grpo − sham grpo, sampled success at RL step {RL_STEPS} (points) "
        f"| {c['P1']['n']} | {_interval(c['P1'], 100, 1)} |",
        f"| P2 = world-model echo − world-model grpo (points) | {c['P2']['n']} "
        f"| {_interval(c['P2'], 100, 1)} |",
        f"| P3 = sham echo − sham grpo (points) | {c['P3']['n']} | {_interval(c['P3'], 100, 1)} |",
        "| world-model start's move CE, RL step 0 (nats/token; bar log 2 = 0.693) "
        f"| {c['world-model grpo move_ce_start']['n']} "
        f"| {_interval(c['world-model grpo move_ce_start'])} |",
        f"| sham − world-model start, move CE at RL step 0 | {c['ce_sham_vs_wm_start']['n']} "
        f"| {_interval(c['ce_sham_vs_wm_start'])} |",
        f"| world-model echo's move CE, RL step {RL_STEPS} | "
        f"{c['world-model echo move_ce_end']['n']} | {_interval(c['world-model echo move_ce_end'])} |",
        f"| world-model grpo's move CE, RL step {RL_STEPS} | "
        f"{c['world-model grpo move_ce_end']['n']} | {_interval(c['world-model grpo move_ce_end'])} |",
        f"| world-model echo − grpo, move CE at RL step {RL_STEPS} | "
        f"{c['ce_echo_vs_grpo']['n']} | {_interval(c['ce_echo_vs_grpo'])} |",
    ]


def markdown(rows: list[dict[str, Any]], *, commits: str = "run") -> str:
    """The result block: how much of the run the rows cover, the per-cell table, the contrasts
    over the complete paired seeds, each part of the rule and the verdict, which reads **none**
    until `problems` is empty (``commits`` as there). A pure function of the rows.

    Examples:
        >>> markdown([]).splitlines()[0]
        '### Result: in progress, 0 of 48 runs'
    """
    v = verdict(rows, commits=commits)
    seeds = _complete_seeds(rows)
    paired = [r for r in rows if r["seed"] in seeds]
    c = contrasts(paired)
    issues = problems(rows, commits=commits)
    total = len(SEEDS) * len(CELLS)
    done = len({(r["seed"], cell(r)) for r in rows})
    if v["verdict"] is None:
        head = [
            f"### Result: in progress, {done} of {total} runs",
            "",
            f"**In progress: {done} of {total} runs; no verdict until complete.** The rule "
            "gives no verdict on these rows: " + "; ".join(issues) + ". The numbers below are "
            f"what the finished runs measured (contrasts over {_seed_list(seeds)}), not a "
            "result.",
        ]
    else:
        head = [
            f"### Result: complete, {done} of {total} runs",
            "",
            f"**Verdict by the pre-registered rule: {v['verdict']}**"
            + (f" ({v['because']})" if v["because"] else "")
            + (f"; failed: {', '.join(v['failed'])}" if v["verdict"] == "undecided" else "")
            + ".",
        ]
    yes = {True: "yes", False: "no", None: "– (fewer than two paired seeds)"}
    # In progress, each part on the same complete seeds as the contrasts above it (the rule's own
    # parts pair whatever cells two seeds share); complete, the rule's parts as they decided.
    shown = verdict(paired, commits=commits)["parts"] if v["verdict"] is None else v["parts"]
    parts = [f"| {name} | {yes[ok]} |" for name, ok in shown.items()]
    walls = sorted(r["wall_s"] for r in rows if r.get("wall_s") is not None)
    timing = (
        f"Wall time of the {len(walls)} RL runs timed here (`wall_s`: 100 RL steps and their "
        f"evaluations, one CPU thread each on the shared machine): {walls[0]:.0f}–"
        f"{walls[-1]:.0f} s, mean {sum(walls) / len(walls):.0f} s."
        if walls
        else "No RL run has finished yet, so none is timed."
    )
    return "\n".join([
        *head,
        "",
        "Means over the finished runs of each start and arm (sampled: 960 held-out episodes at "
        "T = 1; greedy: 60; move CE: held-out random walks in the seed's world, nats/token, "
        "floor 0):",
        "",
        *_cell_lines(rows),
        "",
        f"Contrasts over the paired seeds with all four runs: {_seed_list(seeds)}.",
        "",
        *_contrast_lines(c),
        "",
        "| part of the rule | holds on these rows |",
        "|---|---|",
        *parts,
        "",
        f"Verdict: **{v['verdict'] or 'none (in progress)'}**.",
        "",
        timing,
    ]) + "\n"  # fmt: skip


def pilot_markdown(pilot: list[dict[str, Any]]) -> str:
    """The pilot block, a pure function of the pilot's rows (``pilot.json``): each stage's
    held-out move CE by stage step and whether it passed, each evaluated start, and the choice.

    Examples:
        >>> pilot_markdown([{"kind": "choice", "chosen": None}]).splitlines()[0]
        '**Chosen: none; the pilot is not met.**'
    """
    choice = next(r for r in pilot if r["kind"] == "choice")
    head = (f"**Chosen: the stage {choice['chosen']} with the {choice['sham']} sham; the pilot "
            "is met.**" if choice["chosen"] else "**Chosen: none; the pilot is not met.**")  # fmt: skip
    lines = [head, ""]
    for s in (r for r in pilot if r["kind"] == "stage"):
        curve = ", ".join(f"{e['step']}: {_f(e['ce_walks_move'])}" for e in s["curve"])
        passed = "" if s["passes"] is None else ("; passes" if s["passes"] else "; fails")
        last = s["curve"][-1]
        lines.append(
            f"* stage {s['label']}, {s['walks']} walks (peak lr {s['peak_lr']:g}, {s['steps']} "
            f"steps, {s['warmup_steps']} warm-up, {s['demos']} demonstrations per step; "
            f"{last['tokens']} observation tokens, {last['seconds']:.0f} s){passed}. Held-out "
            f"move CE by stage step: {curve}."
        )
    starts = [r for r in pilot if r["kind"] == "start"]
    if starts:
        lines += [
            "",
            "| stage | start | sampled success | greedy success | invalid replies | move CE "
            "| wall CE |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in starts:
            name = r["start"] if r["start"] != "sham" else f"sham ({r['walks']} walks)"
            lines.append(
                f"| {r['label']} | {name} | {_f(r['eval_success_sampled'])} | "
                f"{_f(r['eval_success_greedy'])} | {_f(r['invalid'])} | {_f(r['move_ce'])} | "
                f"{_f(r['wall_ce'])} |"
            )
    return "\n".join(lines) + "\n"


def _splice(page: str, markers: tuple[str, str], text: str) -> str:
    """``page`` with the text between the two ``markers`` lines replaced by ``text``."""
    begin, end = markers
    if page.count(begin) != 1 or page.count(end) != 1 or page.index(begin) > page.index(end):
        raise ValueError(
            f"update_page: the page must hold the marker {begin!r} once, followed by {end!r} "
            f"once (found {page.count(begin)} and {page.count(end)}); put both lines back"
        )
    head, rest = page.split(begin)
    return f"{head}{begin}\n{text.strip()}\n{end}{rest.split(end, 1)[1]}"


#: The jobs of the complete run: per seed a warm-start, two stages, two start evaluations and
#: four RL runs (`echo_experiment.world_model_2x2.plan`).
JOBS_PER_SEED = {"warm": 1, "stage": 2, "start": 2, "arm": 4}
_KIND_NAMES = {"warm": "warm-start", "stage": "stage", "start": "start evaluation",
               "arm": "RL run"}  # fmt: skip


def job_kind(name: str) -> str:
    """The kind of a job by its name (`plan`'s names).

    Examples:
        >>> [job_kind(n) for n in ("warm-seed0", "stage-sham-seed0", "start-sham-seed0",
        ...                        "world-model-echo-seed3")]
        ['warm', 'stage', 'start', 'arm']
    """
    for kind in ("warm", "stage", "start"):
        if name.startswith(f"{kind}-"):
            return kind
    return "arm"


def progress_markdown(progress: list[dict[str, Any]]) -> str:
    """How far the run is, a pure function of its finished jobs (``progress.json``: ``job``,
    ``state``, ``seconds``, from the driver's log): jobs done of all, and the wall time of each
    kind of job done so far.

    Examples:
        >>> progress_markdown([{"job": "warm-seed0", "state": "done", "seconds": 300}])
        'Jobs finished: 1 of 108 (warm-start 300 s). Jobs failed: none.'
    """
    total = len(SEEDS) * sum(JOBS_PER_SEED.values())
    done = [p for p in progress if p["state"] == "done"]
    finished = {p["job"] for p in done}
    failed = [p["job"] for p in progress if p["state"] != "done"]
    # a job that failed and then finished on a resume is not a failed job: say both
    rerun = [job for job in failed if job in finished]
    failed = [job for job in failed if job not in finished]
    times = []
    for kind, name in _KIND_NAMES.items():
        secs = [p["seconds"] for p in done if job_kind(p["job"]) == kind]
        if len(secs) == 1:
            times.append(f"{name} {secs[0]:.0f} s")
        elif secs:
            times.append(f"{name}s {min(secs):.0f}–{max(secs):.0f} s")
    timing = f" ({', '.join(times)})" if times else ""
    again = f" Failed once, then finished when run again: {', '.join(rerun)}." if rerun else ""
    return (f"Jobs finished: {len(done)} of {total}{timing}. "
            f"Jobs failed: {', '.join(failed) or 'none'}.{again}")  # fmt: skip


def update_page(
    page: str,
    pilot: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    progress: list[dict[str, Any]] | None = None,
) -> str:
    """``page`` with its pilot and result blocks (`PILOT_MARKERS`, `RESULT_MARKERS`) replaced by
    `pilot_markdown` and `markdown` (followed by `progress_markdown` when ``progress`` is
    given); everything else unchanged."""
    page = _splice(page, PILOT_MARKERS, pilot_markdown(pilot))
    extra = "" if progress is None else "\n" + progress_markdown(progress) + "\n"
    return _splice(page, RESULT_MARKERS, markdown(rows) + extra)


# ------------------------------------------------------------------------------------------------
# The figures: one question each


def _axes(title: str) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2), constrained_layout=True)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Any) -> Any:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")  # long titles and labels stay whole
    plt.close(fig)
    return path


def contrasts_figure(rows: list[dict[str, Any]], path: Any) -> Any:
    """``path``: P1, P2 and P3 (points) per paired seed and their means with 95 % t intervals,
    the 0 and +3-point lines: which contrasts exclude no effect, which exclude +3 points?"""
    seeds = _complete_seeds(rows)
    by = {(r["seed"], cell(r)): r for r in rows}
    pairs = (("P1", "world-model grpo", "sham grpo"), ("P2", "world-model echo", "world-model grpo"),
             ("P3", "sham echo", "sham grpo"))  # fmt: skip
    n = len(seeds)
    fig, ax = _axes(
        f"Does knowing the world help, and does echo add to it? ({n} of {len(SEEDS)} paired "
        f"seeds{'' if n == len(SEEDS) else ', in progress'})\n"
        "dots: seeds; diamond, bar: mean, 95 % t CI; dotted: +3 points"
    )
    for i, (_name, a, b) in enumerate(pairs):
        d = [100 * (by[(s, a)]["eval_success_end"] - by[(s, b)]["eval_success_end"]) for s in seeds]
        ax.scatter(d, [i] * len(d), alpha=0.5, s=18)
        ci = paired_ci([x / 100 for x in d])
        if ci["n"] > 1:
            ax.errorbar(100 * ci["mean"], i, xerr=[[100 * (ci["mean"] - ci["lo"])],
                        [100 * (ci["hi"] - ci["mean"])]], fmt="D", color="k", capsize=4)  # fmt: skip
    ax.axvline(0, color="0.4", lw=1)
    ax.axvline(100 * GAIN, color="0.6", lw=1, ls=":")
    ax.set_yticks(range(3), [f"{n}: {a} − {b}" for n, a, b in pairs])
    ax.set_xlabel(f"held-out sampled success at RL step {RL_STEPS}, difference (percentage points)")
    return _save(fig, path)


def world_model_figure(rows: list[dict[str, Any]], path: Any) -> Any:
    """``path``: the move-word CE on held-out random walks in the seed's world against the RL
    step, per start and arm (each seed faint, the mean bold), with ``log 2``: does echo keep the
    world model through RL, and does GRPO lose it?"""
    fig, ax = _axes(
        f"Does echo keep the world model through RL? ({len(rows)} of "
        f"{len(SEEDS) * len(CELLS)} runs)\nbold: mean over seeds; faint: seeds; dashed: log 2"
    )
    for i, c in enumerate(CELLS):
        color = f"C{i}"
        curves = [
            {e["rl_step"]: e["ce_walks_move"] for e in r["curve"]} for r in rows if cell(r) == c
        ]
        for cv in curves:
            ax.plot(sorted(cv), [cv[k] for k in sorted(cv)], color=color, alpha=0.2, lw=0.8)
        if curves:
            steps = sorted(set.intersection(*(set(cv) for cv in curves)))
            means = [sum(cv[k] for cv in curves) / len(curves) for k in steps]
            ax.plot(
                steps, means, color=color, lw=2.2, marker="o", ms=3, label=f"{c} (n={len(curves)})"
            )
    ax.axhline(LOG2, color="0.4", lw=1, ls="--", label="log 2")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("RL step")
    ax.set_ylabel("move-word CE, held-out walks in the seed's world (nats/token)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def pilot_figure(pilot: list[dict[str, Any]], path: Any) -> Any:
    """``path``: the pilot stages' held-out move-word CE against the stage step, with ``log 2``:
    does the stage bring the world model in reach, and does the sham leave it out?"""
    fig, ax = _axes(
        f"Pilot (seed 0, world {WORLDS[0]}): does the stage bring the world model in reach?\n"
        "move-word CE on held-out random walks in the seed's world; dashed: log 2"
    )
    for s in (r for r in pilot if r["kind"] == "stage"):
        ax.plot([e["step"] for e in s["curve"]], [e["ce_walks_move"] for e in s["curve"]],
                marker="o", ms=3, label=f"{s['start']} {s['label']}")  # fmt: skip
    ax.axhline(LOG2, color="0.4", lw=1, ls="--", label="log 2")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("stage step (32 random walks each)")
    ax.set_ylabel("move-word CE (nats/token)")
    ax.legend(fontsize=8)
    return _save(fig, path)
