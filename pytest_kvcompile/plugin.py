"""pytest-kvcompile's pytest hooks: the one place that wires the plugin together.

Loaded through the ``pytest11`` entry point ``kvcompile`` (``-p no:kvcompile`` disables it). Importing it
imports neither torch nor transformers: `pytest_configure` reads the options, registers the markers, fixtures
and reports, and builds the run's `run.session.Session` (which loads torch) only when the run selects an
engine or a test uses a ``kv_*`` fixture. Nothing below imports this module back.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import types
import warnings
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from pytest_kvcompile import reports
from pytest_kvcompile.config import markers, options
from pytest_kvcompile.config.profiles import PROFILES, Selection
from pytest_kvcompile.config.tolerances import MEASURED_DTYPES
from pytest_kvcompile.contract.findings import ENGINE_PARAM, LINE_EXAMPLE, KnownFinding, legacy_line
from pytest_kvcompile.latency import marker as latency_marker
from pytest_kvcompile.memory import marker as memory_marker
from pytest_kvcompile.recompiles import marker as recompile_marker
from pytest_kvcompile.run import fixtures, fuzz, grouping
from pytest_kvcompile.verdicts.collect import Collector

NO_ENGINE = options.NO_ENGINE
OPTIONS = [*options.OPTIONS, *fuzz.OPTIONS, *latency_marker.OPTIONS, *reports.OPTIONS]


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add(parser, OPTIONS)
    parser.getgroup("kvcompile").addoption(
        options.LIST_ENGINES, action="store_true", default=False,
        help="list every resolvable engine with its strategy and capabilities, then exit")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config):
    if config.getoption(options.LIST_ENGINES):
        from pytest_kvcompile.contract import registry

        for line in registry.listing():
            print(line)
        return 0
    return None


def _session_fixtures(run: Run) -> types.ModuleType:
    """The ``kv_session`` fixture, on a module object: pytest 10 drops session fixtures defined as methods of a
    plugin instance (PytestRemovedIn10Warning), and finds fixtures on a plugin's type, so not as attributes."""
    holder = types.ModuleType("kvcompile.session")

    @pytest.fixture(scope="session", name="kv_session")
    def kv_session():
        """The run's Session (run.session): settings, engines and oracles built so far, models, prompts."""
        return run.session

    holder.kv_session = kv_session
    return holder


#: ``@pytest.mark.kv_only(condition)``: a suite check deselected (not skipped) unless the run meets the condition
ONLY = {"fuzz": "the run gives --kv-fuzz=N (fuzzing is opt-in)",
        "measured_rates": "the run's verdict numbers are measured (bfloat16, float16, or the engine stores its KV "
                          "cache lower): there is a measured rate to give power to"}


def _deselect(config: pytest.Config, items: list[pytest.Item], left: list[pytest.Item]) -> int:
    """Deselect `left` from `items` (in place, reported to pytest as deselected); how many."""
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [i for i in items if i not in left]
    return len(left)


def peak_memory() -> str:
    """The run's peak memory: host (this process's peak RSS, and the largest of its finished child processes': xdist
    workers, isolated engines), and each CUDA device's peak allocation where this process used one."""
    import resource
    import sys

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale
    line = f"host: {own / 2**30:.2f} GiB peak RSS in this process"
    if children:
        line += f", {children / 2**30:.2f} GiB in the largest of its child processes (workers, isolated engines)"
    if "torch" not in sys.modules:  # a run that loaded no torch used no device
        return line
    import torch

    if torch.cuda.is_initialized():
        peaks = [f"cuda:{i} {torch.cuda.max_memory_allocated(i) / 2**30:.2f} GiB"
                 for i in range(torch.cuda.device_count())]
        line += f"; device (torch's peak allocation in this process): {', '.join(peaks)}"
    return line


class Run:
    """The run's wiring: settings, the engines it selected, and the Session, built on first use. Provides the
    ``kv_session`` fixture every kvcompile fixture gets its collaborators from, and the xdist/collection hooks."""

    def __init__(self, config: pytest.Config, settings: options.Settings, latency: latency_marker.Settings) -> None:
        self.config, self.settings, self.latency = config, settings, latency
        self.collector = Collector(settings.device, settings.dtype)
        self.engines: dict[str, Any] = {}
        self.oracles: dict[str, Any] = {}  # engine NAME -> oracles.engine.Choice (only with --kv-oracle)
        if settings.engines:
            from pytest_kvcompile.contract import registry
            from pytest_kvcompile.oracles.hf import check_strategy

            self.engines = {name: registry.resolve(name) for name in settings.engines}
            for name, ref in self.engines.items():
                problem = check_strategy(ref.declaration.strategy)
                if problem:
                    raise pytest.UsageError(f"engine '{name}' declares strategy {ref.declaration.strategy}: {problem}")
            if settings.oracles:
                from pytest_kvcompile.oracles.engine import choose

                self.oracles = {name: choose(name, ref, settings.oracle(name), registry.resolve)
                                for name, ref in self.engines.items()}
        unknown = [n for n in settings.isolate if n not in self.engines] if isinstance(settings.isolate, tuple) else []
        if unknown:
            raise pytest.UsageError(f"{options.ISOLATE}={','.join(settings.isolate)}: {', '.join(unknown)} "
                                    f"{'is' if len(unknown) == 1 else 'are'} not an engine of this run (engines: "
                                    f"{', '.join(self.engines) or 'none'}); name engines given to {options.ENGINE}, or "
                                    "use 'declared', 'all' or 'none'")
        self.findings, self.deprecated_findings = run_findings(config, self.engines)
        self.finding_runs: dict[str, list[bool]] = {}  # stale-line -> absorbed? per test of it that ran (controller)
        self.profile_left: int | None = None  # tests a smaller --kv-profile deselected (where this process collected)

    @cached_property
    def session(self):
        from pytest_kvcompile.run.session import Session

        return Session(self.settings, self.engines, self.collector, self.latency, self.progress, self.on_call,
                       oracles=self.oracles)

    def on_call(self, engine: str, model: str, call: str, served: int) -> None:
        """Before each engine build and call: the live reports record it (reports/live.py)."""
        found = self.config.stash.get(reports.PLUGIN, None)
        if found is not None:
            found.on_call(engine, model, call, served)

    def progress(self, line: str) -> None:
        """Long work as it happens (an engine build, a call that compiled), one terminal line each: inductor
        compiles take 15-60 s per graph on a CPU. Quiet under -q and in xdist workers (their output is not shown;
        the slowest builds are listed at the end either way)."""
        plugins = self.config.pluginmanager
        reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
        if reporter is None or self.config.get_verbosity() < 0 or hasattr(self.config, "workerinput"):
            return
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            reporter.write_line(f"kvcompile: {line}")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Parametrize engine, model and prompt per the run's options (ids: names)."""
        names = metafunc.fixturenames
        if "kv_engine_name" in names:
            engines = list(self.engines) or [pytest.param(None, id="no-engine")]
            metafunc.parametrize("kv_engine_name", engines, scope="session")
        if "kv_prompt_name" in names:
            session = self.session
            pairs = [(m, p.name) for m in session.models for p in _prompts(session, m)]
            metafunc.parametrize(("kv_model_name", "kv_prompt_name"), pairs, ids=[f"{m}-{p}" for m, p in pairs],
                                 scope="session")
        elif "kv_model_name" in names:
            metafunc.parametrize("kv_model_name", list(self.session.models), scope="session")

    def _model_names(self) -> set[str]:
        """Every model a known finding may name: the zoo's and this run's (imports the zoo: only with findings)."""
        from pytest_kvcompile.models.zoo import ZOO

        return set(ZOO) | set(self.session.models)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        for message in self.deprecated_findings:  # in collection's warning capture: shown in the warnings summary
            warnings.warn(pytest.PytestDeprecationWarning(message), stacklevel=1)
        stale = _known_findings(self.findings, items, self._model_names() if self.findings else set())
        found = config.stash.get(reports.PLUGIN, None)
        if found is not None:
            found.stale_findings = stale
        _deselect(config, items, [i for i in items if "kv_engine" in i.fixturenames and not self._runs(i)])
        profile = PROFILES[self.settings.profile]
        if profile.name != "full":  # a smaller profile (--kv-profile): deselected, and named in the summary
            engine_tests = [i for i in items if "kv_engine_name" in getattr(getattr(i, "callspec", None), "params", {})]
            self.profile_left = _deselect(config, items, [
                i for i in engine_tests if not (profile.runs(getattr(i, "originalname", i.name))
                                                and profile.runs_prompt(i.callspec.params.get("kv_prompt_name")))])
        engine_tests = [i for i in items if getattr(i, "callspec", None) and "kv_engine_name" in i.callspec.params]
        if not self.engines and engine_tests:
            if hasattr(config, "workerinput"):  # a UsageError here would crash the xdist worker: the fixtures error
                return
            raise pytest.UsageError(NO_ENGINE + f" ({len(engine_tests)} collected test(s) need one)")

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The engine checks the run selected, after -k, -m and the profile (every xdist worker collects them all):
        a 16-bit calibration goes only as far as they attend where they are all of bounded length
        (config/profiles.py: Selection)."""
        chosen = [(getattr(i, "originalname", i.name), i.callspec.params) for i in session.items
                  if "kv_engine_name" in getattr(getattr(i, "callspec", None), "params", {})]
        if chosen:
            self.session.selection = Selection(frozenset(name for name, _ in chosen), frozenset(
                params["kv_prompt_name"] for _, params in chosen if "kv_prompt_name" in params))

    def _runs(self, item: pytest.Item) -> bool:
        """Whether this run's options meet the item's ``@pytest.mark.kv_only(condition)`` (`ONLY`; none: it runs)."""
        mark = item.get_closest_marker("kv_only")
        if mark is None:
            return True
        condition = mark.args[0] if mark.args else None
        if condition == "fuzz":
            return self.settings.fuzz is not None
        if condition == "measured_rates":
            declaration = self.declaration(item)
            return self.settings.dtype in MEASURED_DTYPES or bool(declaration and declaration.lowered())
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.kv_only({condition!r}): the condition is one of "
                                f"{', '.join(map(repr, ONLY))}")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        """Tell the report which known findings of the test absorbed its failure (the outermost wrapper: it sees
        the strict xfail's verdict), for the stale rule (b), judged where every report arrives."""
        report = yield
        found = item.stash.get(FINDINGS_KEY, None)
        ran = call.when == "call" or (call.when == "setup" and (report.failed or hasattr(report, "wasxfail")))
        if found and ran:
            error = call.excinfo.value if call.excinfo else None
            params = item.callspec.params
            report.kvcompile_findings = [[line, bool(hasattr(report, "wasxfail") and error is not None
                                                     and finding.matches(error, params))]
                                         for line, finding in found]
        return report

    def pytest_terminal_summary(self, terminalreporter) -> None:
        """The run's peak memory (issue 54), and a profile smaller than 'full' (--kv-profile) names what it left out:
        never a silent pass."""
        if self.engines:
            terminalreporter.write_sep("-", "kvcompile: peak memory")
            terminalreporter.write_line(peak_memory())
        profile = PROFILES[self.settings.profile]
        if profile.name == "full":
            return
        out = [f"the profile '{profile.name}' ran {profile.description}"]
        if profile.keeps is not None:
            out.append("checks left out: every other one")
        else:
            out.append(f"checks left out: {', '.join(profile.leaves_out)}")
        if profile.prompts is not None:
            out.append(f"prompts left out: all but {', '.join(profile.prompts)} (batches as they are)")
        count = self.profile_left  # None on the xdist controller, which collects nothing
        out.append((f"{count} test(s) deselected; " if count is not None else "")
                   + f"the complete run: {options.PROFILE}=full (the default)")
        terminalreporter.write_sep("-", f"kvcompile: profile '{profile.name}' (a smaller run than 'full')")
        for line in out:
            terminalreporter.write_line(line)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for line, absorbed in getattr(report, "kvcompile_findings", None) or ():
            self.finding_runs.setdefault(line, []).append(absorbed)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Stale rule (b): a known finding whose tests ran and none failed the way it names (each also shows as
        XPASS(strict) or as its own failure). In a worker: nothing (the controller gets every report)."""
        found = self.config.stash.get(reports.PLUGIN, None)
        if hasattr(self.config, "workerinput") or found is None:
            return
        for line, absorbed in self.finding_runs.items():
            stale = f"{line}: its {len(absorbed)} test(s) ran and none failed the way it names"
            if not any(absorbed) and stale not in found.stale_findings:
                found.stale_findings.append(stale)

    def declaration(self, item: pytest.Item):
        """The Declaration of the item's engine, or None when the item is not parametrized by one."""
        name = getattr(item, "callspec", None) and item.callspec.params.get("kv_engine_name")
        return self.engines[name].declaration if name in self.engines else None


def kv_requires(measured: None, *capabilities: str) -> None:
    """skip the test, with a reason naming the capability, for an engine whose Declaration does not
    declare each of them (batching, scoring, kv_cache_bytes, compiled)."""


def _kv_requires_spec(run: Run) -> markers.Marker:
    def validate(arguments: dict[str, Any], item: pytest.Item) -> dict[str, Any]:
        from pytest_kvcompile.contract.engine import CAPABILITIES

        capabilities = arguments.get("capabilities", ())
        if not capabilities or any(c not in CAPABILITIES for c in capabilities):
            raise ValueError(f"give one or more capability names as positional arguments: {', '.join(CAPABILITIES)}")
        return arguments

    def setup(arguments: dict[str, Any], item: pytest.Item) -> None:
        declaration, engine = run.declaration(item), getattr(item, "callspec", None)
        for capability in arguments["capabilities"] if declaration else ():
            if not getattr(declaration, capability):
                name = engine.params["kv_engine_name"]
                markers.skip(f"engine '{name}' does not declare capability '{capability}' (declare it with "
                            f"kv_declaration = Declaration({capability}=True) if it supports it)")

    return markers.Marker(kv_requires, validate, setup)


def pytest_configure(config: pytest.Config) -> None:
    settings = options.read_settings(config, fuzz.read(config))
    run = Run(config, settings, latency_marker.read(config))
    if not run.engines and _runs_the_suites(config):
        raise pytest.UsageError(NO_ENGINE)
    if settings.engines or settings.models:
        _ = run.session.models  # read configs now: a bad --kv-model/--kv-zoo is a usage error, not a collection error
        if not hasattr(config, "workerinput"):  # the controller, once: a folder that cannot judge this run
            run.session.check_references()
    if run.engines:
        from pytest_kvcompile.contract import registry

        registry.check_served_models(run.engines, list(run.session.models))  # a user's server: one checkpoint
    config.pluginmanager.register(run, "kvcompile.run")
    config.pluginmanager.register(_session_fixtures(run), "kvcompile.session")
    config.pluginmanager.register(fixtures, "kvcompile.fixtures")
    markers.register(config, {"kv_requires": _kv_requires_spec(run)})
    config.addinivalue_line("markers", "kv_only(condition): a suite check deselected unless the run meets the "
                                       "condition: " + "; ".join(f"'{k}': {v}" for k, v in ONLY.items()))
    recompile_marker.register(config)
    memory_marker.register(config)
    latency_marker.register(config, run.latency)
    reports.register(config, settings, run.collector)
    _group_by_engine_and_model(config, run)
    _share_cores(config)


def _prompts(session, model: str):
    if session.models[model].unavailable:  # still collected, so the skip shows with its reason
        return [fixtures.UNAVAILABLE_PROMPT]
    return session.prompts(model)


def _runs_the_suites(config: pytest.Config) -> bool:
    """Whether the command line points at the conformance suites (``suites/`` or
    ``--pyargs pytest_kvcompile.suites``)."""
    spec = importlib.util.find_spec("pytest_kvcompile.suites")
    where = (Path(next(iter(spec.submodule_search_locations))).resolve()
             if spec and spec.submodule_search_locations else None)
    for arg in config.args:
        if arg.split("::")[0].startswith("pytest_kvcompile.suites"):
            return True
        path = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if where and (path == where or where in path.parents):
            return True
    return False


def _group_by_engine_and_model(config: pytest.Config, run: Run) -> None:
    """Under pytest-xdist's default ``--dist load``, one worker per engine x model (run/grouping.py); an explicit
    --dist wins."""
    if grouping.wants_grouping(config, run.engines):
        config.pluginmanager.register(grouping.SchedulerHook(run.engines, run.session.models), "kvcompile.grouping")


def _share_cores(config: pytest.Config) -> None:
    """In a pytest-xdist worker of a run that checks engines, give torch its share of the cores (cores // workers
    intra-op threads). Each worker's torch otherwise takes every core, and OpenMP threads spinning against each
    other made `-n 2` on 2 cores 3.6x slower than serial (215 s vs 59 s, one engine's suites, warm caches).
    OMP_NUM_THREADS, when set, wins."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers or os.environ.get("OMP_NUM_THREADS") or not config.pluginmanager.get_plugin("kvcompile.run").engines:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


FINDINGS_KEY = pytest.StashKey[list]()  # item -> [(its stale-rule name, KnownFinding)] of the findings covering it


def run_findings(config: pytest.Config,
                 engines: dict[str, Any]) -> tuple[list[tuple[str, KnownFinding]], list[str]]:
    """The run's known findings, (engine NAME, KnownFinding): the engines' declared ones and the run's
    ``--kv-known-finding`` lines (a bad line: a usage error naming the fix), and the deprecation message of each line
    in the deprecated form (warned at collection)."""
    found = [(name, finding) for name, ref in engines.items() for finding in ref.declaration.known_findings]
    deprecated = []
    for line in options.known_findings(config):
        given = f"{options.KNOWN_FINDING}='{line.engine} | {line.check} | {line.kind or line.reason} | " \
                f"{line.reason if line.kind else line.expected}'"
        if line.deprecated:
            deprecated.append(f"{given}: 'ENGINE | TEST-GLOB | REASON | EXPECTED' (a regex over the failure's "
                              f"message) is deprecated: write '{options.KNOWN_FINDING_FORM}', e.g. '{LINE_EXAMPLE}'")
            found.append((line.engine, legacy_line(line.check, line.reason, line.expected)))
            continue
        try:
            found.append((line.engine, KnownFinding.from_line(line.check, line.kind, line.reason)))
        except ValueError as exc:
            raise pytest.UsageError(f"{given}: {exc} (the form: '{options.KNOWN_FINDING_FORM}'; the deprecated "
                                    "'ENGINE | TEST-GLOB | REASON | EXPECTED' has a REASON of words)") from None
    return found, deprecated


class _AbsorbsMeta(type):
    def __instancecheck__(cls, exc: object) -> bool:
        return isinstance(exc, BaseException) and any(f.matches(exc, cls.params) for f in cls.findings)


def expected_failure(findings: list[KnownFinding], params: dict[str, Any]) -> type[BaseException]:
    """An exception "type" for ``pytest.mark.xfail(raises=...)`` that matches the failure one of `findings` names,
    by its typed data (contract/findings.py: `KnownFinding.matches`), for a test of parameters `params`."""
    return _AbsorbsMeta("KnownFailure", (BaseException,), {"findings": tuple(findings), "params": dict(params)})


def _known_findings(findings: list[tuple[str, KnownFinding]], items: list[pytest.Item],
                    models: set[str] = frozenset()) -> list[str]:
    """Mark each test covered by known findings as one strict xfail that absorbs only a failure one of them names
    (any other failure still fails; a pass is XPASS(strict)). Returns the stale ones by rule (a): a finding whose
    check was collected for its engine and models (before -k deselects) but none of whose tests is in its scope (a
    renamed test or prompt), or one naming a model that is none of `models` (the zoo's and the run's: a renamed model);
    a finding whose check or models this run did not collect is not judged. Rule (b), tests that ran and none failed
    its way: `Run.pytest_sessionfinish`."""
    stale, covering = [], {}
    for engine, finding in findings:
        name = f"{engine}: {finding.label}: {finding.reason}"
        unknown = [m for m in finding.models if models and m not in models]
        if unknown:
            stale.append(f"{engine}: {finding.label} names model(s) {', '.join(unknown)}, which neither the zoo nor "
                         f"this run has (renamed model?): {finding.reason}")
        collected = matched = 0
        for item in items:
            callspec = getattr(item, "callspec", None)
            if not callspec or callspec.params.get(ENGINE_PARAM) != engine:
                continue
            original = getattr(item, "originalname", "") or item.name.split("[")[0]
            on_its_models = not finding.models or callspec.params.get("kv_model_name") in finding.models
            collected += on_its_models and finding.covers_check(item.name, original)  # a model not run: not judged
            if finding.in_scope(item.name, original, callspec.params):
                matched += 1
                covering.setdefault(item, []).append((engine, name, finding))
        if collected and not matched:
            what = finding.check if finding.check and finding.check != "*" else "its check"
            stale.append(f"{engine}: {finding.label} matches none of the {collected} collected test(s) of {what} on "
                         f"it (renamed test, model or prompt?): {finding.reason}")
    for item, found in covering.items():
        reason = "; ".join(dict.fromkeys(f"known finding on {engine}: {f.reason}" for engine, _, f in found))
        item.add_marker(pytest.mark.xfail(reason=reason, strict=True, raises=expected_failure(
            [f for _, _, f in found], item.callspec.params)))
        item.stash[FINDINGS_KEY] = [(name, f) for _, name, f in found]
    return stale
