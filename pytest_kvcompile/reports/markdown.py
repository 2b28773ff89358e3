"""``--kv-report-md``: a Markdown summary for a CI job summary or a PR comment."""

from __future__ import annotations

from pytest_kvcompile.reports.baseline import Change
from pytest_kvcompile.reports.live import status_lines
from pytest_kvcompile.reports.sections import sections
from pytest_kvcompile.reports.table import HEADERS, cells, verdicts
from pytest_kvcompile.verdicts.results import Results


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def _runs(results: Results) -> list[str]:
    return [f"- {run.line()}" for run in results.runs]


LIMIT = 65_000  # GitHub caps a job summary and a PR comment at 65,536 characters


def _details(title: str, lines: list[str], keep: int | None = None) -> list[str]:
    if not lines:
        return []
    shown = lines if keep is None else lines[:keep]
    cut = [f"- ... {len(lines) - len(shown)} more not shown (the report is kept under {LIMIT:,} characters for "
           "GitHub; the JSON and HTML reports have them all)"] if len(shown) < len(lines) else []
    return ["", f"<details><summary>{title} ({len(lines)})</summary>", "", *(f"- {_escape(x)}" for x in shown),
            *cut, "", "</details>"]


def render(results: Results, changes: list[Change] | None = None) -> str:
    """The summary, under LIMIT characters: the verdicts, runs, table and regressions always; the detail lists
    (failures, recompiles, near ties) shortened until it fits, saying how many lines were cut."""
    rows = results.rows
    marks = {"PASS": ":white_check_mark:", "FAIL": ":x:", "PASS with known findings": ":warning:",
             "NOT CHECKED": ":grey_question:"}
    lines = ["## pytest-kvcompile results", ""]
    lines += [f"> :boom: {_escape(line)}" for line in status_lines(results)] + ([""] if status_lines(results) else [])
    lines += [f"- {marks[verdict]} **{verdict}** `{engine}`: {counts}"
              for engine, verdict, counts in verdicts(rows, results.problems)]
    lines += [f"- :x: run rule ({p.kind.value}): {_escape(p.line)}" for p in results.problems]
    if changes is not None:  # right after the verdicts, as pytest-codspeed's PR comment leads with its verdict
        regressed = [c.line() for c in changes if c.regressed]
        improved = [c.line() for c in changes if c.improved]
        lines += ["", f"### Baseline: {len(regressed)} regression(s), {len(improved)} improvement(s) in "
                      f"{sum(c.checked for c in changes)} compared number(s)", ""]
        lines += [f"- :x: {_escape(line)}" for line in regressed]
        lines += [f"- :rocket: {_escape(line)}" for line in improved]
    lines += ["", *_runs(results), ""]
    lines += ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(_escape(c) for c in cells(row, rows)) + " |" for row in rows]
    found = sections(rows)
    details = [(section.title, list(section.lines)) for section in (found.failures, found.recompiles,
                                                                   found.near_ties, found.speculation,
                                                                   found.concurrency)]
    keep = None
    while True:
        text = "\n".join(lines + [x for title, found in details for x in _details(title, found, keep)]) + "\n"
        longest = max((len(found) for _, found in details), default=0)
        if len(text) <= LIMIT or keep == 0 or longest == 0:
            return text[:LIMIT] if len(text) > LIMIT else text
        keep = min(longest, keep if keep is not None else longest) // 2
