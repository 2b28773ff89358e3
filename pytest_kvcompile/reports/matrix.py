"""The conformance matrix: what the engines' result files say, one row per engine (``kvcompile matrix``).

Rule: a cell says what the files say of one check (a suite's test function) on one engine, over every model, dtype
and run they hold: FAIL where any run of it failed, errored or passed a strict xfail (the first failure's line);
KNOWN where its only failures were known findings (strict xfails absorbed them); PASS where it ran and nothing
failed; N/A where it was skipped because the engine does not declare what the check needs (`NOT_APPLICABLE`); SKIP
where it was skipped for another reason (the first one); NEW where the files' suites did not have the check yet (a
file older than the check: `RunInfo.checks`); no cell where it existed but was not selected (not run). The run
rules that failed (vacuous, no eviction, drift: verdicts/failures.py) fail the engine's verdict, the one every
report leads with (table.verdicts). The page leads with one line per engine (its verdict, date, suites' version and
counts per family of checks: verdicts/suite_index.py), then each engine's detail: what did not pass, and why.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

from pytest_kvcompile.reports.table import verdicts
from pytest_kvcompile.verdicts.results import Results
from pytest_kvcompile.verdicts.rows import Check, Row, RunInfo
from pytest_kvcompile.verdicts.suite_index import FAMILY_ORDER, OTHER, SuiteIndex

PASS, FAIL, KNOWN, SKIP, NA, NEW = "pass", "fail", "known", "skip", "n/a", "new"
#: Plain-text marks (no emoji: they read in any font, the colour of the HTML cell says the rest).
MARKS = {PASS: "✓", FAIL: "✗", KNOWN: "!", SKIP: "–", NA: "n/a", NEW: "new"}
WORDS = {PASS: "passed", FAIL: "failed", KNOWN: "known finding", SKIP: "skipped",
         NA: "not applicable (the engine does not declare what the check needs)",
         NEW: "not in the file's suites yet (a newer check)"}
ORDER = (FAIL, KNOWN, SKIP, NA, NEW, PASS)
#: Skip reasons that mean "the engine does not declare what this check needs" (the skips the suites word so).
NOT_APPLICABLE = re.compile(r"does not declare capability|declares no |is neither a server nor declares|"
                            r"takes no .* from the caller")
RULES = "run rules"
NO_REPORT = "NO REPORT"


@dataclass(frozen=True)
class Cell:
    status: str  # PASS, FAIL, KNOWN, SKIP, NA, NEW
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
    suites: str = ""  # the suites' version of its latest run ("" in files that predate the record)
    commands: tuple[str, ...] = ()  # what made its files
    families: dict[str, dict[str, int]] = field(default_factory=dict)  # family -> status -> checks
    not_run: tuple[str, ...] = ()  # why it could not run on some models or devices (its rows' declared skips)


def build(results: Results, pages: Path | None = None, output: Path | None = None,
          expected: tuple[str, ...] = (), suites: SuiteIndex | None = None
          ) -> tuple[list[Engine], list[str], dict[tuple[str, str], Cell]]:
    """(engines, checks, cells by (engine, check)) of merged `results`; `pages`: a directory of findings pages
    (``docs/engines``), each named for the engines whose NAME it starts (``litgpt.md``: litgpt, litgpt-compile);
    `expected`: engines that get a row even without a report (NO REPORT: the matrix names what it does not cover);
    `suites`: the suites the page is judged against (`basis`): a check of theirs a file's suites lacked is NEW."""
    rows, runs, problems = results.rows, results.runs, results.problems
    checks = sorted({name for row in rows for name in row.checks} | set(suites.checks if suites else ()))
    cells: dict[tuple[str, str], Cell] = {}
    found = {engine: (verdict, counts) for engine, verdict, counts in verdicts(rows, problems)}
    engines = []
    for name in dict.fromkeys(r.engine for r in rows):
        mine = [r for r in rows if r.engine == name]
        if name not in found:  # only measured as another engine's reference: not checked itself
            continue
        theirs = [r for r in runs if name in r.engines]
        had = {c for r in theirs for c in r.checks}
        for check in checks:
            cell = _cell(mine, check)
            if cell is None and had and check not in had:
                cell = Cell(NEW, WORDS[NEW], ())
            if cell is not None:
                cells[name, check] = cell
        ruled = [p for p in problems if p.engine == name]
        if ruled:
            cells[name, RULES] = Cell(FAIL, "; ".join(f"{p.kind.value}: {p.line}" for p in ruled),
                                      tuple(sorted({p.model for p in ruled if p.model})))
        run = max(theirs, key=lambda r: r.started, default=RunInfo())
        versions = list(dict.fromkeys(v for r in mine for v in r.versions))
        versions += [f"torch=={run.torch}"] if run.torch else []
        versions += [f"pytest-kvcompile=={run.pytest_kvcompile}"] if run.pytest_kvcompile else []
        families: dict[str, dict[str, int]] = {}
        for check in checks:
            cell = cells.get((name, check))
            if cell is not None:
                counts = families.setdefault(suites.family(check) if suites else OTHER, {})
                counts[cell.status] = counts.get(cell.status, 0) + 1
        engines.append(Engine(name, *found[name], tuple(sorted({r.model for r in mine})),
                              ", ".join(sorted({f"{r.device} {r.dtype}" for r in mine})),
                              run.started[:10], tuple(dict.fromkeys(versions)), _page(name, pages, output),
                              run.suites, tuple(dict.fromkeys(r.command for r in theirs if r.command)), families,
                              tuple(sorted({why for r in mine for why in r.declared_skips}))))
    for name in expected:
        if name not in found:
            engines.append(Engine(name, NO_REPORT, "no result file of it was given", (), "", "", (),
                                  _page(name, pages, output)))
    rank = {name: i for i, name in enumerate(expected)}  # the registry's order, then engines it does not name
    engines.sort(key=lambda e: rank.get(e.name, len(rank)))
    if any((e.name, RULES) in cells for e in engines):
        checks.append(RULES)
    return engines, checks, cells


def basis(results: Results, today: SuiteIndex) -> SuiteIndex:
    """The suites the page is judged against: the newest run's that recorded them (so the page is a function of
    its files alone), each check's family from `today`; `today` where no run recorded its suites."""
    recorded = [r for r in results.runs if r.suites and r.checks]
    if not recorded:
        return today
    newest = max(recorded, key=lambda r: r.started)
    return SuiteIndex(newest.suites, {c: today.family(c) for c in newest.checks})


def stale(files: list[tuple[str, Results]], suites: SuiteIndex) -> list[str]:
    """One warning per file's run that predates a check today's suites have, or records no list of its checks."""
    warnings = []
    for source, results in files:
        for run in results.runs:
            engines = ", ".join(run.engines) or "?"
            if not run.checks:
                warnings.append(f"{source} ({engines}) records no list of its suites' checks (written before it was "
                                "recorded): it cannot say which of today's checks it predates; re-run it")
                continue
            missing = sorted(set(suites.checks) - set(run.checks))
            if missing:
                again = f": {run.command}" if run.command else ""
                warnings.append(f"{source} ({engines}) predates {len(missing)} check(s) the suites now have "
                                f"({', '.join(_short(c) for c in missing)}); re-run it{again}")
    return warnings


def _cell(rows: list[Row], check: str) -> Cell | None:
    """The check's outcome over `rows`; a model the engine could not run at all (the row's declared skips: an
    unsupported model or device) counts only where no model ran the check, its reason then the cell's."""
    runnable = [r for r in rows if not r.declared_skips]
    if any(r.checks.get(check) is not None or any(f.check == check for f in r.failures) for r in runnable):
        rows = runnable
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
        reason = reason or seen.reason or next(iter(row.declared_skips), "")
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
    return Cell(NA if NOT_APPLICABLE.search(reason) else SKIP, reason or f"{skipped} skipped", where)


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


def _families(engines: list[Engine]) -> list[str]:
    present = {f for e in engines for f in e.families}
    return [f for f in (*FAMILY_ORDER, OTHER) if f in present]


def summary(counts: dict[str, int]) -> str:
    """A family's cell: ``✓ 5`` where every check passed, else the non-zero counts, worst first (``✗ 1  ✓ 3``; a mark
    and its count joined by a no-break space, so a narrow cell wraps between counts, never inside one)."""
    return " ".join(f"{MARKS[s]}\u00a0{counts[s]}" for s in ORDER if counts.get(s))


def _suites(engine: Engine, suites: SuiteIndex | None) -> str:
    if not engine.suites:
        return "?" if engine.verdict != NO_REPORT else ""
    return engine.suites + ("" if suites is None or engine.suites == suites.version else " (older)")


def _suites_cell(engine: Engine, suites: SuiteIndex | None) -> str:
    """The summary table's suites cell: whether the row's suites are the newest among the files (``newest`` or
    ``older``: the version itself, ten characters a row, is in the engine's section), the version where no newest is
    known, ``?`` where the file records none."""
    if not engine.suites or suites is None or not suites.version:
        return _suites(engine, suites)
    return "newest" if engine.suites == suites.version else "older"


def legend() -> str:
    return " · ".join(f"{MARKS[s]} {WORDS[s]}" for s in ORDER)


def _notes(engine: Engine, checks: list[str], cells: dict[tuple[str, str], Cell]) -> list[tuple[str, Cell]]:
    """The engine's cells that did not pass, worst first (not applicable and new ones are listed by name only)."""
    mine = [(c, cells[engine.name, c]) for c in checks if (engine.name, c) in cells]
    return sorted(((c, cell) for c, cell in mine if cell.status not in (PASS, NA, NEW)),
                  key=lambda item: ORDER.index(item[1].status))


def _named(engine: Engine, checks: list[str], cells: dict[tuple[str, str], Cell], status: str) -> list[str]:
    return [_short(c) for c in checks if cells.get((engine.name, c), Cell("", "", ())).status == status]


def markdown(results: Results, sources: list[str], pages: Path | None = None, output: Path | None = None,
             expected: tuple[str, ...] = (), suites: SuiteIndex | None = None, command: str = "") -> str:
    """The matrix as Markdown: a summary line per engine, then each engine's checks that did not pass."""
    engines, checks, cells = build(results, pages, output, expected, suites)
    families = _families(engines)
    current = (f" The newest suites among them: version `{suites.version}`, {len(suites.checks)} checks (the suites "
               "column: newest, or older, each engine's version in its section); a check an older version did not "
               "have yet is counted as new."
               if suites and suites.version else "")
    lines = ["---", "hide: [navigation, toc]  # the docs site: the summary table gets the page's whole width", "---",
             "", "# Conformance matrix", "",
             f"Regenerate: `{command or 'kvcompile matrix ' + ' '.join(sources) + ' -o ' + str(output or 'FILE')}`"
             f" (from {len(sources)} result file(s); re-run the engines: "
             f"`kvcompile check-engine --all --out docs/results`).{current}", "",
             f"Each family's cell counts its checks over every model and dtype run: {legend()}.", "",
             "| engine | verdict | run | suites | " + " | ".join(families) + " |",
             "|---" * (4 + len(families)) + "|"]
    for engine in engines:
        name = f"[{engine.name}](#{_anchor(engine.name)})" if engine.verdict != NO_REPORT else engine.name
        row = [name, engine.verdict, f"{engine.date} {engine.where}".strip(), _suites_cell(engine, suites)]
        row += [summary(engine.families.get(f, {})) for f in families]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in row) + " |")
    lines += ["", "## Per engine", ""]
    for engine in engines:
        if engine.verdict == NO_REPORT:
            continue
        lines += [f"### {engine.name}", "", f"**{engine.verdict}** ({engine.counts}). Run {engine.date} on "
                  f"{engine.where}, suites {_suites(engine, suites)}; {', '.join(engine.versions)}."
                  + (f" Findings: [{Path(engine.page).stem}]({engine.page})." if engine.page else ""), ""]
        lines += [f"Made by: `{c}`" for c in engine.commands] + ([""] if engine.commands else [])
        if engine.not_run:
            lines += ["Not run (every check skipped there):", "", *(f"- {why}" for why in engine.not_run), ""]
        notes = _notes(engine, checks, cells)
        if notes:
            lines += ["| check | result | models | detail |", "|---|---|---|---|"]
            lines += [f"| {_short(c)} | {MARKS[cell.status]} {cell.status} | {', '.join(cell.models)} | "
                      f"{cell.detail.replace('|', '/')} |" for c, cell in notes]
            lines.append("")
        for status in (NA, NEW):
            named = _named(engine, checks, cells, status)
            if named:
                lines += [f"{WORDS[status].capitalize()}: {', '.join(named)}.", ""]
    missing = [e for e in engines if e.verdict == NO_REPORT]
    if missing:
        lines += ["## Not in these files", "", "Adapted here, with no result file among these (re-run a group with "
                  "`kvcompile check-engine --all --only GROUP --out docs/results`; an engine's page has its last "
                  "results): " + ", ".join(f"[{e.name}]({e.page})" if e.page else e.name for e in missing) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "", name.lower().replace(" ", "-"))


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px}table{border-collapse:collapse;
font-size:.85em}th,td{border:1px solid #ccc;padding:.25em .5em;text-align:left}td.e{white-space:nowrap}
.pass{background:#e6f4ea}.fail{background:#fde0e0}.known{background:#fff3cd}.skip,.na,.new{color:#555}"""


def _status(counts: dict[str, int]) -> str:
    worst = next((s for s in ORDER if counts.get(s)), "")
    return {FAIL: "fail", KNOWN: "known", PASS: "pass"}.get(worst, "skip")


def html(results: Results, sources: list[str], pages: Path | None = None, output: Path | None = None,
         expected: tuple[str, ...] = (), suites: SuiteIndex | None = None, command: str = "") -> str:
    """The matrix as one self-contained page (inline CSS, no scripts), laid out as the Markdown one."""
    engines, checks, cells = build(results, pages, output, expected, suites)
    families = _families(engines)
    head = "".join(f"<th>{escape(f)}</th>" for f in families)
    body, details = [], []
    for engine in engines:
        name = (f'<a href="#{_anchor(engine.name)}">{escape(engine.name)}</a>' if engine.verdict != NO_REPORT
                else escape(engine.name))
        tds = "".join(f'<td class="{_status(engine.families.get(f, {}))}">{escape(summary(engine.families.get(f, {})))}'
                      "</td>" for f in families)
        body.append(f'<tr><td class="e">{name}</td><td>{escape(engine.verdict)}</td>'
                    f"<td>{escape(engine.date)} {escape(engine.where)}</td>"
                    f"<td>{escape(_suites_cell(engine, suites))}</td>{tds}</tr>")
        if engine.verdict == NO_REPORT:
            continue
        items = "".join(f'<li class="{cell.status}">{MARKS[cell.status]} <b>{escape(_short(c))}</b> '
                        f"({escape(', '.join(cell.models))}): {escape(cell.detail)}</li>"
                        for c, cell in _notes(engine, checks, cells))
        items += "".join(f'<li class="skip">not run: {escape(why)}</li>' for why in engine.not_run)
        details.append(f'<h3 id="{_anchor(engine.name)}">{escape(engine.name)}</h3><p><b>{escape(engine.verdict)}'
                       f"</b> ({escape(engine.counts)}); {escape(', '.join(engine.versions))}</p><ul>{items}</ul>")
    regenerate = command or f"kvcompile matrix {' '.join(sources)} -o {output or 'FILE'}"
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>Conformance matrix</title><style>{STYLE}</style>'
            f"</head><body><h1>Conformance matrix</h1><p>Regenerate: <code>{escape(regenerate)}</code>. "
            f"{escape(legend())}.</p><table class=\"summary\"><tr><th>engine</th><th>verdict</th><th>run</th>"
            f"<th>suites</th>{head}</tr>{''.join(body)}</table><h2>Per engine</h2>{''.join(details)}</body></html>")


WRITERS = {".md": markdown, ".html": html, ".htm": html}


@dataclass(frozen=True)
class Page:
    """`kvcompile matrix`'s page: its `text`, the result `files` it read, `warnings` (files older than today's
    suites), how many `engines` it has rows of, and the built-in engines with no file (`missing`)."""

    text: str
    files: list[str]
    warnings: list[str]
    engines: int
    missing: list[str]


def page(inputs: list[str], output: Path, pages: Path) -> Page:
    """The page `kvcompile matrix INPUTS -o OUTPUT --pages PAGES` writes (a folder stands for its *.json files);
    ResultsFileError or MergeError name a file that cannot be read or merged."""
    from pytest_kvcompile.contract.registry import BUILTIN_ENGINES  # imports torch: only here
    from pytest_kvcompile.reports.json_file import ResultsFileError, load
    from pytest_kvcompile.verdicts.results import merge
    from pytest_kvcompile.verdicts.suite_index import index

    files = []
    for given in inputs:
        path = Path(given)
        found = sorted(str(f) for f in path.glob("*.json")) if path.is_dir() else [given]
        if not found:
            raise ResultsFileError(f"{given}: a folder with no result file (*.json) in it")
        files += found
    loaded = [(path, load(path)) for path in files]
    merged = merge([results for _, results in loaded])
    today = index()
    expected = tuple(BUILTIN_ENGINES)  # every engine the project adapts gets a row, reported or not
    command = shlex.join(["kvcompile", "matrix", *inputs, "-o", str(output)])
    text = WRITERS[output.suffix.lower()](merged, files, pages, output, expected, basis(merged, today), command)
    engines = {row.engine for row in merged.rows}
    return Page(text, files, stale(loaded, today), len(engines), [n for n in expected if n not in engines])
