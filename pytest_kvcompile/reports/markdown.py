"""``--kv-report-md``: a Markdown summary for a CI job summary or a PR comment."""

from __future__ import annotations

from typing import Any

from pytest_kvcompile.reports.baseline import Change
from pytest_kvcompile.reports.table import HEADERS, cells, verdicts


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def _runs(results: dict[str, Any]) -> list[str]:
    return [f"- {run.get('device', '?')} ({run.get('device_name', '?')}), {run.get('dtype', '?')}: torch "
            f"{run.get('torch', '?')}, transformers {run.get('transformers', '?')}, engines "
            f"{', '.join(run.get('engines', [])) or '-'}, started {run.get('started', '?')}" for run in results["runs"]]


def _details(title: str, lines: list[str]) -> list[str]:
    if not lines:
        return []
    return ["", f"<details><summary>{title} ({len(lines)})</summary>", "", *(f"- {_escape(x)}" for x in lines), "",
            "</details>"]


def render(results: dict[str, Any], changes: list[Change] | None = None) -> str:
    rows = results["rows"]
    marks = {"PASS": ":white_check_mark:", "FAIL": ":x:", "PASS with known findings": ":warning:",
             "NOT CHECKED": ":grey_question:"}
    lines = ["## pytest-kvcompile results", ""]
    lines += [f"- {marks[verdict]} **{verdict}** `{engine}`: {counts}"
              for engine, verdict, counts in verdicts(rows, results.get("problems", ()))]
    lines += ["", *_runs(results), ""]
    lines += ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(_escape(c) for c in cells(row, rows)) + " |" for row in rows]
    if changes is not None:
        regressed = [c.line() for c in changes if c.regressed]
        lines += ["", f"### Baseline: {len(regressed)} regression(s) in {len(changes)} compared number(s)"]
        lines += [f"- :x: {_escape(line)}" for line in regressed]
    lines += _details("failures", [f"{f['test']}: {f['message'].splitlines()[0] if f['message'] else ''}"
                                   for row in rows for f in row["failures"]])
    lines += _details("recompiles after warmup", [f"{row['engine']} / {row['model']}: {reason}" for row in rows
                                                   if row["compiles"] for reason in row["compiles"]["reasons"]])
    lines += _details("near ties", [tie for row in rows for tie in row["near_ties"]])
    return "\n".join(lines) + "\n"
