"""Run results and reports: ``--kv-report-json/-md/-html``, ``--kv-baseline`` + ``--kv-fail-on``, the
terminal results table and the run notes.

The plugin adds `OPTIONS` and calls ``register(config, settings, collector)``. Under pytest-xdist each worker
collects the rows of its own tests and returns them as JSON (verdicts/results.py: Results) in ``config.workeroutput``;
only the controller merges them, compares with the baseline and writes files.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_kvcompile.config.options import Option, value
from pytest_kvcompile.errors import NotApplicable, OracleUnreliable, Unjudgeable
from pytest_kvcompile.reports import baseline as baseline_mod
from pytest_kvcompile.reports import html, json_file, markdown
from pytest_kvcompile.reports.live import (
    HEARTBEAT_KEY,
    atomic_write,
    read_heartbeat,
    read_heartbeats,
    status,
    with_status,
    write_heartbeat,
)
from pytest_kvcompile.reports.sections import Section, sections
from pytest_kvcompile.reports.table import text_table, verdict_lines
from pytest_kvcompile.verdicts.collect import NOTE, WORKER_KEY, Collector, outcome, params, run_metadata
from pytest_kvcompile.verdicts.failures import Failure, Kind, Problem, kind_of
from pytest_kvcompile.verdicts.lines import first_lines
from pytest_kvcompile.verdicts.results import Results, merge
from pytest_kvcompile.verdicts.rows import Beat, Check, Crash, FailureEntry, Outcomes, Row, RunInfo, Status
from pytest_kvcompile.verdicts.run_rules import run_problems, skipped_everywhere

REPORT_JSON = "--kv-report-json"
REPORT_MD = "--kv-report-md"
REPORT_HTML = "--kv-report-html"
BASELINE = "--kv-baseline"
FAIL_ON = "--kv-fail-on"

def _fail_on(spec: str) -> str:
    baseline_mod.parse_fail_on(spec)  # ValueError names the fix
    return spec


OPTIONS = [
    Option(REPORT_JSON, "kv_report_json", "",
           "write the run's results as versioned JSON to FILE (baseline and merge input)", "FILE"),
    Option(REPORT_MD, "kv_report_md", "",
           "write a Markdown summary to FILE (for a CI job summary or a PR comment)", "FILE"),
    Option(REPORT_HTML, "kv_report_html", "", "write a self-contained HTML report with plots to FILE", "FILE"),
    Option(BASELINE, "kv_baseline", "", "compare this run with a results JSON written by an earlier --kv-report-json",
           "FILE"),
    Option(FAIL_ON, "kv_fail_on", "",
           f"with {BASELINE}: fail the run when a number regressed by more than allowed, e.g. '{baseline_mod.SYNTAX}' "
           "(latency and memory in percent, recompiles as a count)", "SPEC", _fail_on),
]
BY_FLAG = {o.flag: o for o in OPTIONS}

WRITERS: dict[str, Callable[[Results, Any], str]] = {
    ".json": lambda results, changes: json_file.dumps(results),
    ".md": markdown.render,
    ".html": html.render,
    ".htm": html.render,
}
ORACLE_FIXTURES = {"kv_oracle", "kv_oracle_or_none"}  # a test using one is a token check
_FORMAT = {REPORT_JSON: ".json", REPORT_MD: ".md", REPORT_HTML: ".html"}
STALE_KEY = "kvcompile_stale_findings"  # config.workeroutput key: a worker's stale known findings
PLUGIN = pytest.StashKey["ResultsPlugin"]()
SPENT = pytest.StashKey[list]()  # a test's [seconds so far, the collector's engine seconds when its setup began]


def _value(config: pytest.Config, flag: str):
    return value(config, BY_FLAG[flag])


def write(results: Results, path: Path, changes=None, suffix: str | None = None) -> None:
    """Write `results` to `path` in the format of `suffix` (default: the path's extension), atomically."""
    atomic_write(path, WRITERS[suffix or path.suffix.lower()](results, changes))


class ResultsPlugin:
    def __init__(self, config: pytest.Config, settings: Any, collector: Collector) -> None:
        self.config, self.settings = config, settings
        self.collector = collector
        self.workers: list[Results] = []  # what xdist workers sent: per test (kv_results), and at the end
        self.outputs = {flag: Path(v).expanduser() for flag in _FORMAT if (v := _value(config, flag))}
        # live reports (reports/live.py): finished tests, this process's beat, crashed workers, the JSON so far
        self.finished, self.beat = 0, None
        self.test_s = 0.0  # the tests' own seconds (setup, call, teardown; every worker's): engine time's whole
        self.crashed: list[Crash] = []
        self._json_body: str | None = None
        self._run: RunInfo | None = None
        self.worker = getattr(config, "workerinput", {}).get("workerid")
        found = getattr(config, "workerinput", {}).get(HEARTBEAT_KEY)
        self.heartbeats: Path | None = Path(found) if found else None  # xdist: the workers' heartbeat files
        if self.worker:
            collector.track()  # each test's rows travel with its teardown report
        self.baseline = self.fail_on = self.changes = None
        self.notes: list[str] = []
        self.results: Results | None = None
        self.problems: list[Problem] = []
        self.skipped_everywhere: list[str] = []
        self.stale_findings: list[str] = []  # known findings matching no test or no failure (plugin)
        if hasattr(config, "workerinput"):
            return  # workers only collect: the controller validates, compares and writes
        path, spec = _value(config, BASELINE), _value(config, FAIL_ON)
        if spec and not path:
            raise pytest.UsageError(f"{FAIL_ON}={spec!r} needs {BASELINE}=FILE (a JSON written by {REPORT_JSON})")
        self.fail_on = baseline_mod.parse_fail_on(spec) if spec else {}
        if path:
            try:
                self.baseline = json_file.load(Path(path).expanduser())
            except json_file.ResultsFileError as exc:
                raise pytest.UsageError(f"{BASELINE}: {exc}") from None
        for flag, out in self.outputs.items():
            if out.is_dir():
                raise pytest.UsageError(f"{flag}={out}: is a directory; give a file name such as report{_FORMAT[flag]}")

    # --- live reports (reports/live.py) ---------------------------------------------------------------------------
    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        """xdist: each worker writes what it runs to a heartbeat file the controller reads (only with reports)."""
        if self.outputs:
            if self.heartbeats is None:
                self.heartbeats = Path(tempfile.mkdtemp(prefix="kvcompile-heartbeats-"))
            node.workerinput[HEARTBEAT_KEY] = str(self.heartbeats)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        item.stash[SPENT] = [0.0, self.collector.engine_s]
        self._beat(Beat(item.nodeid, *(params(item) or (None, None)), worker=self.worker))

    def on_call(self, engine: str, model: str, call: str, served: int) -> None:
        """An engine call (or build) is about to run in this process (run.harness, run.session)."""
        if self.beat is not None:
            self._beat(dataclasses.replace(self.beat, engine=engine, model=model, call=call, served_before=served))

    def _beat(self, beat: Beat | None) -> None:
        self.beat = beat
        if self.worker:
            if self.heartbeats is not None:
                write_heartbeat(self.heartbeats, self.worker, beat)
            return
        if REPORT_JSON in self.outputs:
            if self._json_body is None:
                self._write_live()
            atomic_write(self.outputs[REPORT_JSON], with_status(self._json_body, self._status(complete=False)))

    def _status(self, complete: bool) -> Status:
        running = [] if complete else [self.beat] if self.beat else read_heartbeats(self.heartbeats) \
            if self.heartbeats else []
        return status(self.finished, running, self.crashed, complete)

    def _results(self) -> Results:
        results = merge([self.collector.results(), *self.workers])
        if self._run is None:  # versions and options: read once (the live reports rewrite after every test)
            self._run = run_metadata(self.config, self.settings)
        results.runs = [self._run]
        return results

    def _write_live(self) -> None:
        """Every requested report from the results so far (after each finished test)."""
        if not self.outputs:
            return
        results = self._results()
        self._json_body = json_file.dumps(results)
        results.status = self._status(complete=False)
        for flag, path in self.outputs.items():
            if flag == REPORT_JSON:
                atomic_write(path, with_status(self._json_body, results.status))
            else:
                write(results, path, None, _FORMAT[flag])

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker:
            return
        self.test_s += getattr(report, "duration", 0.0) or 0.0
        delta = getattr(report, "kv_results", None)
        if delta:  # an xdist worker's rows of this test (JSON)
            self.workers.append(Results.from_json(delta))
        if report.when == "???":  # xdist: the worker running this test died (dsession.handle_crashitem)
            self._crashed(report)
        if report.when in ("teardown", "???"):
            self.finished += 1
            self.beat = None
            self._write_live()

    def _crashed(self, report: pytest.TestReport) -> None:
        """A dead xdist worker: its heartbeat names the engine, model and call; that engine x model gets the
        failure (the test's own report never came)."""
        node = getattr(report, "node", None)
        worker = getattr(getattr(node, "gateway", None), "id", None) or "?"
        beat = read_heartbeat(self.heartbeats, worker) if self.heartbeats else None
        beat = beat or Beat(report.nodeid, worker=worker)
        message = f"xdist worker '{worker}' died running {beat.line()}"
        self.crashed.append(Crash(**{**dataclasses.asdict(beat), "worker": worker}, message=message))
        if beat.engine and beat.model:
            self.collector.add(beat.engine, beat.model, tests=Outcomes.one("failed"),
                               failures=[FailureEntry(report.nodeid, Kind.CRASH, message, None)])

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield  # outermost wrapper: sees the final outcome (xfail, no_recompile)
        found, decided = params(item), outcome(report)
        spent = item.stash.setdefault(SPENT, [0.0, self.collector.engine_s])
        spent[0] += getattr(report, "duration", 0.0) or 0.0
        oracle_error = []
        if decided == "skipped" and call.excinfo is not None and call.excinfo.errisinstance(OracleUnreliable):
            oracle_error = [str(call.excinfo.value.msg).split(". ")[0]]  # not judged: named, counted, no verdict
        if found and decided:
            failures, declared, reason = [], [], ""
            if decided in ("failed", "error"):
                crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
                error = call.excinfo.value if call.excinfo is not None else None
                typed = getattr(error, "failure", None)  # a token verdict as data (verdicts/failures.py)
                kind = getattr(report, "kv_kind", None) or kind_of(error)  # a marker's check, else the exception's
                failures = [FailureEntry(item.nodeid, Kind(kind), first_lines(crash or report.longreprtext),
                                         typed if isinstance(typed, Failure) else None)]
            if decided == "skipped" and isinstance(report.longrepr, tuple):
                reason = report.longrepr[2].removeprefix("Skipped: ")
                if call.excinfo is not None and call.excinfo.errisinstance(NotApplicable) \
                        and not call.excinfo.errisinstance(Unjudgeable):
                    declared, reason = [reason.removeprefix("pytest_kvcompile.errors.NotApplicable: ")], ""
            ran = decided not in ("skipped", "error")
            checks = {item.originalname: Check(int(ran), int(decided in ("failed", "error", "xpassed")),
                                               int(decided == "xfailed"), int(decided == "skipped"), reason,
                                               round(spent[0], 4), round(self.collector.engine_s - spent[1], 4))}
            self.collector.add(*found, tests=Outcomes.one(decided), failures=failures, declared_skips=declared,
                               checks=checks, oracle_errors=oracle_error,
                               token_checks=int(bool(ORACLE_FIXTURES & set(getattr(item, "fixturenames", ())))))
        if self.worker and call.when == "teardown":  # this test's rows, to the controller with its last report
            report.kv_results = self.collector.drain()
            self._beat(None)
        return report

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        found = getattr(node, "workeroutput", {}).get(WORKER_KEY)
        if found:
            self.workers.append(Results.from_json(found))
        stale = getattr(node, "workeroutput", {}).get(STALE_KEY, [])  # each worker collects the whole run
        self.stale_findings += [line for line in stale if line not in self.stale_findings]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = self.config
        if hasattr(config, "workerinput"):
            config.workeroutput[WORKER_KEY] = self.collector.drain()  # what no test's report carried
            config.workeroutput[STALE_KEY] = self.stale_findings
            return
        self.results = self._results()
        self.results.status = self._status(complete=True)
        self.problems = run_problems(self.results.rows, self.settings.max_near_tie_rate)
        self.results.problems = list(self.problems)
        self.skipped_everywhere = skipped_everywhere(self.results.rows)
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.baseline is not None:
            self.changes, self.notes = baseline_mod.compare(self.baseline, self.results, self.fail_on)
            if any(c.regressed for c in self.changes) and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        for flag, path in self.outputs.items():
            write(self.results, path, self.changes, _FORMAT[flag])
        if self.heartbeats is not None:
            shutil.rmtree(self.heartbeats, ignore_errors=True)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.results:
            return
        tr = terminalreporter
        rows = self.results.rows
        if rows:
            tr.write_sep("-", "kvcompile: verdict per engine")
            for line in verdict_lines(rows, self.results.problems):
                tr.write_line(line, red=line.startswith("FAIL"), green=line.startswith("PASS "))
            tr.write_sep("-", "kvcompile: results per engine and model")
            for line in text_table(rows):
                tr.write_line(line)
        found = sections(rows, self.settings.max_near_tie_rate)
        for section in (found.measured, found.rates, found.fuzz, found.speculation, found.builds):
            _write(tr, section)
        timed = sorted((r for r in rows if r.generate_s), key=lambda r: -r.generate_s)
        if timed and self.test_s:
            tr.write_sep("-", "kvcompile: time in the engines vs the harness")
            for line in time_lines(timed, self.test_s) + check_time_lines(rows):
                tr.write_line(line)
        _write(tr, found.declared)
        if self.skipped_everywhere:
            tr.write_sep("-", f"kvcompile: checks skipped for every engine and model ({len(self.skipped_everywhere)})",
                         yellow=True)
            for line in self.skipped_everywhere:
                tr.write_line(line)
        if self.stale_findings:
            tr.write_sep("-", "kvcompile: stale known findings: they match no test or no failure "
                         f"({len(self.stale_findings)})", yellow=True)
            for line in self.stale_findings:
                tr.write_line(line, yellow=True)
        if self.problems:
            tr.write_sep("=", f"kvcompile: the run FAILS on {len(self.problems)} verdict rule(s)", red=True, bold=True)
            for problem in self.problems:
                tr.write_line(problem.line, red=True)
        if self.changes is not None:
            regressed = [c for c in self.changes if c.regressed]
            tr.write_sep("=" if regressed else "-", f"kvcompile: {len(regressed)} regression(s) vs baseline "
                         f"{_value(self.config, BASELINE)} ({sum(c.checked for c in self.changes)} number(s) compared)",
                         red=bool(regressed), bold=bool(regressed))
            for change in regressed:
                tr.write_line(change.line())
            for note in self.notes:
                tr.write_line(f"not compared: {note}")
        for flag, path in self.outputs.items():
            tr.write_line(f"kvcompile: wrote {flag.removeprefix('--kv-report-')} report to {path}")


def _write(tr: Any, section: Section) -> None:
    """A section of the terminal summary: its heading, then its lines (bad ones red); nothing where it is empty."""
    if section:
        tr.write_sep("-", f"kvcompile: {section.heading}")
        for i, line in enumerate(section.lines):
            tr.write_line(line, red=bool(section.bad) and section.bad[i])


def time_lines(rows: list[Row], test_s: float) -> list[str]:
    """Where the tests' time went: each engine x model's generate() seconds (the 5 largest), then all of them as a
    share of the tests' own seconds; the rest is the harness (oracle, checks, engine builds) and pytest."""
    engine_s, build_s = sum(r.generate_s for r in rows), sum(r.build_s for r in rows)
    lines = [f"{r.generate_s:8.1f} s  {r.engine} / {r.model} in generate()" for r in rows[:5]]
    share = engine_s / test_s
    lines.append(f"engines {engine_s:.1f} s of the tests' {test_s:.1f} s ({share:.0%}; every worker's), the harness "
                 f"{max(test_s - engine_s, 0.0):.1f} s ({1 - share:.0%}: oracle, checks, {build_s:.1f} s of engine "
                 "builds, pytest)")
    return lines


def check_time_lines(rows: list[Row], most: int = 5) -> list[str]:
    """The checks (test functions, every engine and model together) that took longest, with their time in the
    engines' generate(): what a smaller --kv-profile would save."""
    seconds: dict[str, list[float]] = {}
    for row in rows:
        for name, check in row.checks.items():
            found = seconds.setdefault(name, [0.0, 0.0])
            found[0], found[1] = found[0] + check.seconds, found[1] + check.engine_s
    top = sorted((s for s in seconds.items() if s[1][0] > 0), key=lambda s: -s[1][0])[:most]
    return ["the slowest checks (every engine and model):"] * bool(top) + [
        f"{total:8.1f} s  {name} (engines {engine:.1f} s)" for name, (total, engine) in top]


class RunNotes:
    """Facts tests record with the ``kv_record`` fixture (near ties accepted as numerics, compile
    counts), listed by category in the terminal summary. They travel as ``user_properties``, so
    they also arrive from xdist workers."""

    def __init__(self) -> None:
        self.notes: dict[str, set[str]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            for key, found in report.user_properties:
                if key == NOTE:
                    self.notes.setdefault(found[0], set()).add(found[1])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for category, lines in sorted(self.notes.items()):
            terminalreporter.write_sep("-", f"kvcompile: {category} ({len(lines)})")
            for line in sorted(lines):
                terminalreporter.write_line(line)


def register(config: pytest.Config, settings: Any, collector: Collector) -> None:
    """Add the results collector, the run notes and the reports to this run (`settings`: config.options.Settings)."""
    config.stash[PLUGIN] = ResultsPlugin(config, settings, collector)
    config.pluginmanager.register(config.stash[PLUGIN], "kvcompile.results")
    config.pluginmanager.register(RunNotes(), "kvcompile.notes")
