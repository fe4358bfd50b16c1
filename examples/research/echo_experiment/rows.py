"""An experiment's result rows as read back from disk, checked before anything is computed.

A results file is untrusted input: a run killed while writing leaves a cut-off last line, a row
copied in from another experiment carries an arm this one never ran, a hand edit leaves a seed as
a string. Each would otherwise end in a traceback deep in the summary, or worse, change what is
summarised without a word (one foreign arm makes every other seed "incomplete"). `read_results`
and `check_rows` turn each into a `RowsError` whose one-line message names the file and line
(``results.jsonl:7``) or the row (``results.json[3]``), what is wrong and what to do.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from echo_experiment.persistence import arm_label

__all__ = ["RowsError", "check_rows", "read_results"]

#: A row with where it came from: ``("results.jsonl:7", row)``.
Located = tuple[str, dict[str, Any]]


class RowsError(ValueError):
    """A results file that cannot be summarised as asked; the message names the row and the fix."""


def _check_row(row: Any, where: str) -> dict[str, Any]:
    """``row`` when it has what every summary reads (a table with an int ``seed`` >= 0, a string
    ``arm``, a string ``level`` if any); else `RowsError` naming ``where``."""
    if not isinstance(row, dict):
        raise RowsError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    seed = row.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        got = "no seed" if "seed" not in row else f"seed {seed!r}"
        raise RowsError(f"{where}: {got}; every row needs an int seed >= 0 (the run that wrote "
                        "it records one); fix or remove the row")  # fmt: skip
    if not isinstance(row.get("arm"), str):
        raise RowsError(f"{where}: arm {row.get('arm')!r} is not a name; every row needs its "
                        "arm ('grpo', 'echo-0.05', ...); fix or remove the row")  # fmt: skip
    level = row.get("level")
    if level is not None and not isinstance(level, str):
        raise RowsError(f"{where}: level {level!r} is not a name; fix or remove the row")
    if level and row["arm"] != "grpo":
        alpha = row.get("alpha")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float):
            raise RowsError(f"{where}: the {level} {row['arm']} row has alpha {alpha!r}, not a "
                            "number; fix or remove the row")  # fmt: skip
    return row


def _jsonl(path: Path) -> list[Located]:
    lines = path.read_text().splitlines()
    out: list[Located] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if not any(x.strip() for x in lines[i:]):
                raise RowsError(
                    f"{where}: the last line is cut off ({err.msg} at column {err.colno}): a run "
                    "stopped while writing its row. Delete that line; the arm's run directory "
                    "still holds its results, and --resume with the same arguments rebuilds "
                    "its row"
                ) from None
            raise RowsError(f"{where}: not a JSON row ({err.msg} at column {err.colno}); "
                            "fix or remove that line") from None  # fmt: skip
        out.append((where, _check_row(row, where)))
    return out


def read_results(path: Path) -> list[Located]:
    """The rows of ``path`` (``results.jsonl``: one JSON object a line; ``results.json``: a JSON
    list), each checked and with where it came from; ``[]`` when the file does not exist.

    Raises:
        RowsError: a line that is not JSON (a cut-off last line says so), a row that is not an
            object, a missing, negative or non-integer seed, an arm that is not a name.
    """
    if not path.is_file():
        return []
    if path.suffix == ".jsonl":
        return _jsonl(path)
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RowsError(f"{path}:{err.lineno}: not JSON ({err.msg}); restore the file from "
                        "git or rebuild it with --summarize-only") from None  # fmt: skip
    if not isinstance(rows, list):
        raise RowsError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
    return [(f"{path}[{i}]", _check_row(r, f"{path}[{i}]")) for i, r in enumerate(rows)]


def _listed(values: Iterable[Any]) -> str:
    return ", ".join(map(str, values))


def check_rows(
    located: list[Located], *, arms: set[str] | None, seeds: list[int] | None, asked: str
) -> list[dict[str, Any]]:
    """The rows, after refusing every one that does not belong to the experiment asked for:
    an arm outside ``arms`` or a seed outside ``seeds`` (None: any). ``asked`` says what was
    asked (``--mode full --alphas 0.01``), for the message.

    Examples:
        >>> rows = [("r:1", {"arm": "grpo", "seed": 0}), ("r:2", {"arm": "echo-0.2", "seed": 0})]
        >>> check_rows(rows, arms={"grpo", "echo-0.2"}, seeds=None, asked="")[1]["arm"]
        'echo-0.2'
        >>> check_rows(rows, arms={"grpo", "echo-0.05"}, seeds=None, asked="--mode quick")
        Traceback (most recent call last):
        ...
        echo_experiment.rows.RowsError: r:2: arm 'echo-0.2' is not an arm of --mode quick (its arms: echo-0.05, grpo); a row of another experiment? Summarise with the --mode/--alphas/--no-actobs it ran with, or remove the row
    """
    for where, row in located:
        label = arm_label(row)
        if arms is not None and label not in arms:
            raise RowsError(
                f"{where}: arm {label!r} is not an arm of {asked} (its arms: "
                f"{_listed(sorted(arms))}); a row of another experiment? Summarise with the "
                "--mode/--alphas/--no-actobs it ran with, or remove the row"
            )
        if seeds is not None and row["seed"] not in seeds:
            raise RowsError(
                f"{where}: seed {row['seed']} is not one of --seeds {_listed(seeds)}; a row of "
                "another run? Remove it, or list its seed"
            )
    return [row for _, row in located]
