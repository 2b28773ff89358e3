"""The conformance matrix: engines x checks, from the engines' JSON reports (``kvcompile matrix``).

Rule: a cell says what the reports say of one check (a suite's test function) on one engine, over every model and
run they hold: FAIL where any run of it failed, errored or passed a strict xfail (the cell links the engine's
findings page and names the first failure); KNOWN where its only failures were known findings (strict xfails
absorbed them); PASS where it ran and nothing failed; SKIP where it never ran and was skipped (the first reason);
empty where no report selected it. The run rules that failed (vacuous, no eviction, drift: verdicts/failures.py)
are a column of their own, and the engine's verdict is the one every report leads with (table.verdicts). Versions
and dates come from the reports: the latest run that had the engine, the distributions behind the engine as it was
built there (``versions``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from html import escape
from pathlib import Path

from pytest_kvcompile.reports.table import verdicts
from pytest_kvcompile.verdicts.results import Results
from pytest_kvcompile.verdicts.rows import Check, Row, RunInfo

PASS, FAIL, KNOWN, SKIP = "pass", "fail", "known", "skip"
MARKS = {PASS: "✅", FAIL: "❌", KNOWN: "⚠️", SKIP: "⏭️"}  # Markdown (GitHub draws emoji)
TEXT_MARKS = {PASS: "✓", FAIL: "✗", KNOWN: "⚠", SKIP: "–"}  # HTML: glyphs every font has; the colour says the rest
RULES = "run rules"
NO_REPORT = "NO REPORT"


@dataclass(frozen=True)
class Cell:
    status: str  # PASS, FAIL, KNOWN, SKIP
    detail: str  # the first failure's first line, the skip reason, or the counts
    models: tuple[str, ...]


@dataclass(frozen=True)
class Engine:
    """One row of the matrix: what the reports say about the engine as a whole."""

    name: str
    verdict: str
    counts: str
    models: tuple[str, ...]
    where: str  # "cpu float32", ...
    date: str
    versions: tuple[str, ...]  # the engine's distributions, then torch and the plugin of its latest run
    page: str | None  # its findings page, relative to the output


def build(results: Results, pages: Path | None = None, output: Path | None = None,
          expected: tuple[str, ...] = ()) -> tuple[list[Engine], list[str], dict[tuple[str, str], Cell]]:
    """(engines, checks, cells by (engine, check)) of merged `results`; `pages`: a directory of findings pages
    (``docs/engines``), each named for the engines whose NAME it starts (``litgpt.md``: litgpt, litgpt-compile);
    `expected`: engines that get a row even without a report (NO REPORT: the matrix names what it does not cover)."""
    rows, runs, problems = results.rows, results.runs, results.problems
    checks = sorted({name for row in rows for name in row.checks})
    cells: dict[tuple[str, str], Cell] = {}
    found = {engine: (verdict, counts) for engine, verdict, counts in verdicts(rows, problems)}
    engines = []
    for name in dict.fromkeys(r.engine for r in rows):
        mine = [r for r in rows if r.engine == name]
        if name not in found:  # only measured as another engine's reference: not checked itself
            continue
        for check in checks:
            cell = _cell(mine, check)
            if cell is not None:
                cells[name, check] = cell
        ruled = [p for p in problems if p.engine == name]
        if ruled:
            cells[name, RULES] = Cell(FAIL, "; ".join(f"{p.kind.value}: {p.line}" for p in ruled),
                                      tuple(sorted({p.model for p in ruled if p.model})))
        run = max((r for r in runs if name in r.engines), key=lambda r: r.started, default=RunInfo())
        versions = list(dict.fromkeys(v for r in mine for v in r.versions))
        versions += [f"torch=={run.torch}"] if run.torch else []
        versions += [f"pytest-kvcompile=={run.pytest_kvcompile}"] if run.pytest_kvcompile else []
        engines.append(Engine(name, *found[name], tuple(sorted({r.model for r in mine})),
                              ", ".join(sorted({f"{r.device} {r.dtype}" for r in mine})),
                              run.started[:10], tuple(dict.fromkeys(versions)), _page(name, pages, output)))
    for name in expected:
        if name not in found:
            engines.append(Engine(name, NO_REPORT, "no result file of it was given", (), "", "", (),
                                  _page(name, pages, output)))
    if any((e.name, RULES) in cells for e in engines):
        checks.append(RULES)
    return engines, checks, cells


def _cell(rows: list[Row], check: str) -> Cell | None:
    ran = failed = xfailed = skipped = 0
    reason, message, models = "", "", set()
    for row in rows:
        seen = row.checks.get(check)
        failures = [f for f in row.failures if f.check == check]
        if seen is None and not failures:
            continue
        models.add(row.model)
        seen = seen or Check()
        ran += seen.ran
        failed += max(seen.failed, len(failures))  # schema-1 files count no failures per check
        xfailed += seen.xfailed
        skipped += seen.skipped
        reason = reason or seen.reason
        message = message or next((f.message.strip().splitlines()[0] for f in failures if f.message.strip()), "")
    if not models:
        return None
    where = tuple(sorted(models))
    if failed:
        return Cell(FAIL, message or f"{failed} failed", where)
    if xfailed:
        return Cell(KNOWN, f"{xfailed} known finding(s) (strict xfail)", where)
    if ran:
        return Cell(PASS, f"{ran} passed", where)
    return Cell(SKIP, reason or f"{skipped} skipped", where)


def _page(engine: str, pages: Path | None, output: Path | None) -> str | None:
    if pages is None or not pages.is_dir():
        return None
    stems = sorted((p for p in pages.glob("*.md")), key=lambda p: -len(p.stem))
    page = next((p for p in stems if engine == p.stem or engine.startswith(p.stem + "-")), None)
    if page is None:
        return None
    return os.path.relpath(page, output.parent if output else Path.cwd()).replace(os.sep, "/")


def _short(check: str) -> str:
    return check.removeprefix("test_")


def markdown(results: Results, sources: list[str], pages: Path | None = None, output: Path | None = None,
             expected: tuple[str, ...] = ()) -> str:
    """The matrix as GitHub Markdown: one row per engine, then the failures and skips the cells refer to."""
    engines, checks, cells = build(results, pages, output, expected)
    notes: list[str] = []
    lines = ["# Conformance matrix", "",
             f"Generated by `kvcompile matrix` from {len(sources)} report(s): {', '.join(f'`{s}`' for s in sources)}. "
             "A cell is one check (a suite's test function) over every model the reports ran: "
             + " · ".join(f"{MARKS[s]} {s}" for s in (PASS, FAIL, KNOWN, SKIP))
             + " (the numbers point to the notes below); empty: not run.", "",
             f"Regenerate: `kvcompile matrix {' '.join(sources)} -o {output or 'FILE'}`. A result file per engine: "
             "`kvcompile check-engine NAME` (reports/NAME.json), or any run with `--kv-report-json`. An engine with "
             f"{NO_REPORT} is adapted here but no file of it was given.", "",
             "| engine | verdict | run | versions | " + " | ".join(_short(c) for c in checks) + " |",
             "|---" * (4 + len(checks)) + "|"]
    for engine in engines:
        name = f"[{engine.name}]({engine.page})" if engine.page else engine.name
        row = [name, engine.verdict, f"{engine.date} {engine.where}".strip(), ", ".join(engine.versions)]
        for check in checks:
            cell = cells.get((engine.name, check))
            if cell is None:
                row.append("")
                continue
            mark = MARKS[cell.status]
            if cell.status in (FAIL, KNOWN, SKIP):
                notes.append(f"{engine.name} / {_short(check)} ({', '.join(cell.models)}): {cell.detail}")
                mark += f" {len(notes)}"
                if cell.status == FAIL and engine.page:
                    mark = f"[{mark}]({engine.page})"
            row.append(mark)
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in row) + " |")
    lines += ["", "## Notes", ""] + [f"{i}. {note.replace('|', '/')}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines) + "\n"


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:.85em}
th,td{border:1px solid #ccc;padding:.25em .4em;text-align:center}th.c{writing-mode:vertical-rl;transform:rotate(180deg)}
td.e{text-align:left;white-space:nowrap}td.v{text-align:left;font-size:.8em}.pass{background:#e6f4ea}
.fail{background:#fde0e0}.known{background:#fff3cd}.skip{background:#f1f1f1;color:#555}"""


def html(results: Results, sources: list[str], pages: Path | None = None, output: Path | None = None,
         expected: tuple[str, ...] = ()) -> str:
    """The matrix as one self-contained page (inline CSS, no scripts): hover a cell for its detail."""
    engines, checks, cells = build(results, pages, output, expected)
    head = "".join(f'<th class="c">{escape(_short(c))}</th>' for c in checks)
    body = []
    for engine in engines:
        name = (f'<a href="{escape(engine.page)}">{escape(engine.name)}</a>' if engine.page else escape(engine.name))
        tds = []
        for check in checks:
            cell = cells.get((engine.name, check))
            if cell is None:
                tds.append("<td></td>")
                continue
            text = f"{cell.status}: {cell.detail} ({', '.join(cell.models)})"
            mark = TEXT_MARKS[cell.status]
            if cell.status == FAIL and engine.page:
                mark = f'<a href="{escape(engine.page)}">{mark}</a>'
            tds.append(f'<td class="{cell.status}" title="{escape(text)}">{mark}</td>')
        body.append(f'<tr><td class="e">{name}</td><td>{escape(engine.verdict)}</td>'
                    f'<td class="v">{escape(engine.date)} {escape(engine.where)}</td>'
                    f'<td class="v">{escape(", ".join(engine.versions))}</td>{"".join(tds)}</tr>')
    details = "".join(f"<li><b>{escape(e)} / {escape(_short(c))}</b> ({cell.status}, "
                      f"{escape(', '.join(cell.models))}): {escape(cell.detail)}</li>"
                      for (e, c), cell in cells.items() if cell.status != PASS)
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>Conformance matrix</title><style>{STYLE}</style>'
            f"</head><body><h1>Conformance matrix</h1><p>Generated by <code>kvcompile matrix</code> from "
            f"{escape(', '.join(sources))}. A cell is one check over every model the reports ran: "
            + " · ".join(f"{TEXT_MARKS[s]} {s}" for s in (PASS, FAIL, KNOWN, SKIP)) + "; empty: not run.</p>"
            f"<table><tr><th>engine</th><th>verdict</th><th>run</th><th>versions</th>{head}</tr>{''.join(body)}"
            f"</table><h2>Failures, known findings and skips</h2><ul>{details}</ul></body></html>")


WRITERS = {".md": markdown, ".html": html, ".htm": html}
