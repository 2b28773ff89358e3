"""Run results and reports: ``--kv-report-json/-md/-html``, ``--kv-baseline`` + ``--kv-fail-on``,
the terminal results table, and the latency options (see ``pytest_kvcompile.latency.marker``).

Enable with ``add_options(parser)`` in ``pytest_addoption`` and ``register(config)`` in
``pytest_configure`` (pytest-kvcompile's plugin does both). Under pytest-xdist each worker
collects the rows of its own tests and returns them as plain dicts in ``config.workeroutput``;
only the controller merges them, compares with the baseline and writes files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from pytest_kvcompile.latency import marker as latency
from pytest_kvcompile.errors import NotApplicable
from pytest_kvcompile.oracles.store import OracleUnreliable
from pytest_kvcompile.reports.results import (COLLECTOR, WORKER_KEY, Collector, first_lines, merge, outcome, params, run_metadata, run_problems,
                       skipped_everywhere)
from pytest_kvcompile.run.session import SESSION
from pytest_kvcompile.reports import baseline as baseline_mod
from pytest_kvcompile.reports import html, json_file, markdown
from pytest_kvcompile.reports.table import text_table

REPORT_JSON = "--kv-report-json"
REPORT_MD = "--kv-report-md"
REPORT_HTML = "--kv-report-html"
BASELINE = "--kv-baseline"
FAIL_ON = "--kv-fail-on"

OPTIONS = [  # (flag, ini key, ini type, default, help)
    (REPORT_JSON, "kv_report_json", "string", "", "write the run's results as versioned JSON to FILE (baseline and merge input)"),
    (REPORT_MD, "kv_report_md", "string", "", "write a Markdown summary to FILE (for a CI job summary or a PR comment)"),
    (REPORT_HTML, "kv_report_html", "string", "", "write a self-contained HTML report with plots to FILE"),
    (BASELINE, "kv_baseline", "string", "", "compare this run with a results JSON written by an earlier --kv-report-json"),
    (FAIL_ON, "kv_fail_on", "string", "",
     f"with {BASELINE}: fail the run when a number regressed by more than allowed, e.g. '{baseline_mod.SYNTAX}' "
     "(latency and memory in percent, recompiles as a count)"),
] + latency.OPTIONS

WRITERS: dict[str, Callable[[dict[str, Any], Any], str]] = {
    ".json": lambda results, changes: json_file.dumps(results),
    ".md": markdown.render,
    ".html": html.render,
    ".htm": html.render,
}
ORACLE_FIXTURES = {"kv_oracle", "kv_oracle_or_none"}  # a test using one is a token check
_FORMAT = {REPORT_JSON: ".json", REPORT_MD: ".md", REPORT_HTML: ".html"}
PLUGIN = pytest.StashKey["ResultsPlugin"]()


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcompile")
    for flag, ini, kind, default, help_text in OPTIONS:
        cli_help = help_text.replace("%", "%%")  # argparse formats help with %
        if kind == "bool":
            group.addoption(flag, action="store_true", default=None, help=cli_help)
        else:
            metavar = ("FILE" if flag in (REPORT_JSON, REPORT_MD, REPORT_HTML, BASELINE)
                       else "N" if flag == latency.REPEATS else "SPEC")
            group.addoption(flag, action="store", default=None, metavar=metavar, help=cli_help)
        parser.addini(ini, help=help_text, type=kind, default=default)


def _value(config: pytest.Config, flag: str):
    cli = config.getoption(flag)
    return cli if cli is not None else config.getini(next(o[1] for o in OPTIONS if o[0] == flag))


def write(results: dict[str, Any], path: Path, changes=None, suffix: str | None = None) -> None:
    """Write `results` to `path` in the format of `suffix` (default: the path's extension)."""
    render = WRITERS[suffix or path.suffix.lower()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(results, changes))


class ResultsPlugin:
    def __init__(self, config: pytest.Config, collector: Collector) -> None:
        self.config = config
        self.collector = collector
        self.workers: list[dict[str, Any]] = []
        self.outputs = {flag: Path(v).expanduser() for flag in _FORMAT if (v := _value(config, flag))}
        self.baseline = self.fail_on = self.changes = None
        self.notes: list[str] = []
        self.results: dict[str, Any] | None = None
        self.problems: list[str] = []
        self.skipped_everywhere: list[str] = []
        if hasattr(config, "workerinput"):
            return  # workers only collect: the controller validates, compares and writes
        path, spec = _value(config, BASELINE), _value(config, FAIL_ON)
        if spec and not path:
            raise pytest.UsageError(f"{FAIL_ON}={spec!r} needs {BASELINE}=FILE (a JSON written by {REPORT_JSON})")
        try:
            self.fail_on = baseline_mod.parse_fail_on(spec) if spec else {}
        except ValueError as exc:
            raise pytest.UsageError(f"{FAIL_ON}={spec!r}: {exc}") from None
        if path:
            try:
                self.baseline = json_file.load(Path(path).expanduser())
            except json_file.ResultsFileError as exc:
                raise pytest.UsageError(f"{BASELINE}: {exc}") from None
        for flag, out in self.outputs.items():
            if out.is_dir():
                raise pytest.UsageError(f"{flag}={out}: is a directory; give a file name such as report{_FORMAT[flag]}")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield  # outermost wrapper: sees the final outcome (xfail, no_recompile)
        found, decided = params(item), outcome(report)
        oracle_error = []
        if decided == "failed" and call.excinfo is not None and call.excinfo.errisinstance(OracleUnreliable):
            decided, oracle_error = "error", [str(call.excinfo.value).split(". ")[0]]
        if found and decided:
            failures, declared, reason = [], [], ""
            if decided in ("failed", "error"):
                crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
                test = item.nodeid.partition("@kv:")[0]  # without xdist's loadgroup suffix: the same name serial or -n
                failures = [{"test": test, "message": first_lines(crash or report.longreprtext)}]
            if decided == "skipped" and isinstance(report.longrepr, tuple):
                reason = report.longrepr[2].removeprefix("Skipped: ")
                if call.excinfo is not None and call.excinfo.errisinstance(NotApplicable):
                    declared, reason = [reason.removeprefix("pytest_kvcompile.errors.NotApplicable: ")], ""
            ran = decided not in ("skipped", "error")
            checks = {item.originalname: {"ran": int(ran), "skipped": int(decided == "skipped"), "reason": reason}}
            self.collector.add(*found, tests={decided: 1}, failures=failures, declared_skips=declared, checks=checks,
                               oracle_errors=oracle_error,
                               token_checks=int(bool(ORACLE_FIXTURES & set(getattr(item, "fixturenames", ())))))
        return report

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        found = getattr(node, "workeroutput", {}).get(WORKER_KEY)
        if found:
            self.workers.append(found)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = self.config
        if hasattr(config, "workerinput"):
            config.workeroutput[WORKER_KEY] = self.collector.as_dict()
            return
        self.results = merge([self.collector.as_dict(), *self.workers])
        self.results["runs"] = [run_metadata(config)]
        settings = config.stash[SESSION].settings
        self.problems = run_problems(self.results["rows"], settings.max_near_tie_rate)
        self.skipped_everywhere = skipped_everywhere(self.results["rows"])
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.baseline is not None:
            self.changes, self.notes = baseline_mod.compare(self.baseline, self.results, self.fail_on)
            if any(c.regressed for c in self.changes) and session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = pytest.ExitCode.TESTS_FAILED
        for flag, path in self.outputs.items():
            write(self.results, path, self.changes, _FORMAT[flag])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.results:
            return
        tr = terminalreporter
        if self.results["rows"]:
            tr.write_sep("-", "kvcompile: results per engine and model")
            for line in text_table(self.results["rows"]):
                tr.write_line(line)
        declared = sorted({f"{r['engine']} / {r['model']}: {why}" for r in self.results["rows"]
                           for why in r.get("declared_skips", [])})
        if declared:
            tr.write_sep("-", f"kvcompile: not checked, declared or known limitations ({len(declared)})")
            for line in declared:
                tr.write_line(line)
        if self.skipped_everywhere:
            tr.write_sep("-", f"kvcompile: checks skipped for every engine and model ({len(self.skipped_everywhere)})",
                         yellow=True)
            for line in self.skipped_everywhere:
                tr.write_line(line)
        if self.problems:
            tr.write_sep("=", f"kvcompile: the run FAILS on {len(self.problems)} verdict rule(s)", red=True, bold=True)
            for line in self.problems:
                tr.write_line(line, red=True)
        if self.changes is not None:
            regressed = [c for c in self.changes if c.regressed]
            tr.write_sep("=" if regressed else "-", f"kvcompile: {len(regressed)} regression(s) vs baseline "
                         f"{_value(self.config, BASELINE)} ({len(self.changes)} number(s) compared)",
                         red=bool(regressed), bold=bool(regressed))
            for change in regressed:
                tr.write_line(change.line())
            for note in self.notes:
                tr.write_line(f"not compared: {note}")
        for flag, path in self.outputs.items():
            tr.write_line(f"kvcompile: wrote {flag.removeprefix('--kv-report-')} report to {path}")


def register(config: pytest.Config) -> None:
    """Validate the options and add the results collector, reports and latency fixture to this run."""
    settings = config.stash[SESSION].settings
    latency.configure(config, lambda flag: _value(config, flag))
    collector = config.stash[COLLECTOR] = Collector(settings.device, settings.dtype)
    config.stash[PLUGIN] = ResultsPlugin(config, collector)
    config.pluginmanager.register(config.stash[PLUGIN], "kvcompile.results")
