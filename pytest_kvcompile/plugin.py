"""pytest-kvcompile's pytest hooks: options, engine resolution, parametrization, reports.

Loaded through the ``pytest11`` entry point ``kvcompile`` (``-p no:kvcompile`` disables it).
"""

from __future__ import annotations

import importlib.util
import os
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

from pytest_kvcompile import reports
from pytest_kvcompile.run import fixtures
from pytest_kvcompile.memory import marker as memory_marker
from pytest_kvcompile.run import options
from pytest_kvcompile.recompiles import marker as recompile_marker
from pytest_kvcompile.contract import registry
from pytest_kvcompile.contract.engine import BATCHING, COMPILED, KV_CACHE_BYTES, SCORING
from pytest_kvcompile.run.markers import validated_at_collection
from pytest_kvcompile.oracles.hf import check_strategy
from pytest_kvcompile.run.session import SESSION, Session

CAPABILITIES = (BATCHING, SCORING, KV_CACHE_BYTES, COMPILED)
NOTE = "kvcompile"  # user_properties key of run notes: (category, line)
NO_ENGINE = options.NO_ENGINE


def kv_requires(*capabilities: str) -> None:
    """kv_requires(*capabilities): skip the test, with a reason naming the capability, for an
    engine whose Declaration does not declare each of them (batching, scoring, kv_cache_bytes, compiled)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)
    reports.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config):
    if config.getoption(options.LIST_ENGINES):
        for line in registry.listing():
            print(line)
        return 0
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"kv_requires(*capabilities): {kv_requires.__doc__.split(':', 1)[1].strip()}")
    settings = options.read_settings(config)
    options.known_findings(config)  # validate now: a malformed line is a usage error
    engines = {name: registry.resolve(name) for name in settings.engines}
    for name, ref in engines.items():
        problem = check_strategy(ref.declaration.strategy)
        if problem:
            raise pytest.UsageError(f"engine '{name}' declares strategy {ref.declaration.strategy}: {problem}")
    if not engines and _runs_the_suites(config):
        raise pytest.UsageError(NO_ENGINE)
    session = config.stash[SESSION] = Session(settings, engines)
    if settings.engines or settings.models:
        session.models  # read configs now: a bad --kv-model/--kv-zoo is a usage error, not a collection error
    _group_by_engine_and_model(config, settings)
    _share_cores(config)
    config.pluginmanager.register(fixtures, "kvcompile.fixtures")
    config.pluginmanager.register(RunNotes(), "kvcompile.notes")
    recompile_marker.register(config)
    memory_marker.register(config)
    reports.register(config)


def _runs_the_suites(config: pytest.Config) -> bool:
    """Whether the command line points at the conformance suites (``suites/`` or ``--pyargs pytest_kvcompile.suites``)."""
    spec = importlib.util.find_spec("pytest_kvcompile.suites")
    where = Path(next(iter(spec.submodule_search_locations))).resolve() if spec and spec.submodule_search_locations else None
    for arg in config.args:
        if arg.split("::")[0].startswith("pytest_kvcompile.suites"):
            return True
        path = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if where and (path == where or where in path.parents):
            return True
    return False


def _group_by_engine_and_model(config: pytest.Config, settings) -> None:
    """Under pytest-xdist's default ``--dist load``, switch to ``loadgroup`` with one group per engine x model
    (`pytest_collection_modifyitems`): each engine is built and compiled in one worker, and its object serves
    the same calls in the same order as in a serial run, so verdicts do not depend on -n. An explicit --dist wins."""
    if getattr(config, "workerinput", {}).get(LOADGROUP):  # a worker: it parsed the original --dist load
        config.option.loadgroup = True  # read by xdist's worker to suffix node ids with their group
        return
    explicit = any(a == "--dist" or a.startswith("--dist=") or a == "-d" for a in config.invocation_params.args)
    if (settings.engines and config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and getattr(config.option, "dist", "no") == "load" and not explicit):
        config.option.dist = "loadgroup"
        config.pluginmanager.register(_TellWorkers(), "kvcompile.loadgroup")


LOADGROUP = "kvcompile_loadgroup"


class _TellWorkers:
    """Workers re-parse the command line (``--dist load``): tell each that the controller groups by engine x model."""

    @staticmethod
    def pytest_configure_node(node) -> None:
        node.workerinput[LOADGROUP] = True


def _share_cores(config: pytest.Config) -> None:
    """In a pytest-xdist worker, give torch its share of the cores (cores // workers intra-op threads). Each
    worker's torch otherwise takes every core, and OpenMP threads spinning against each other made `-n 2` on 2
    cores 3.6x slower than serial (215 s vs 59 s, one engine's suites, warm caches). OMP_NUM_THREADS, when set,
    wins."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if not workers or os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize engine, model and prompt per the run's options (ids: names)."""
    session = metafunc.config.stash[SESSION]
    names = metafunc.fixturenames
    if "kv_engine_name" in names:
        engines = list(session.engines) or [pytest.param(None, id="no-engine")]
        metafunc.parametrize("kv_engine_name", engines, scope="session")
    if "kv_prompt_name" in names:
        pairs = [(m, p.name) for m, entry in session.models.items() for p in _prompts(session, m)]
        metafunc.parametrize(("kv_model_name", "kv_prompt_name"), pairs, ids=[f"{m}-{p}" for m, p in pairs], scope="session")
    elif "kv_model_name" in names:
        metafunc.parametrize("kv_model_name", list(session.models), scope="session")


def _prompts(session: Session, model: str):
    if session.models[model].unavailable:  # still collected, so the skip shows with its reason
        return [fixtures.UNAVAILABLE_PROMPT]
    return session.prompts(model)


def _check_kv_requires(item: pytest.Item) -> None:
    for mark in item.iter_markers("kv_requires"):
        if mark.kwargs or not mark.args or any(c not in CAPABILITIES for c in mark.args):
            raise ValueError(
                f"@pytest.mark.kv_requires{mark.args or ''}{mark.kwargs or ''} is invalid; "
                f"give one or more capability names as positional arguments: {', '.join(CAPABILITIES)}"
            )


pytest_pycollect_makeitem = validated_at_collection(_check_kv_requires)


class RunNotes:
    """Facts tests record with the ``kv_record`` fixture (near ties accepted as numerics, compile
    counts), listed by category in the terminal summary. They travel as ``user_properties``, so
    they also arrive from xdist workers."""

    def __init__(self) -> None:
        self.notes: dict[str, set[str]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            for key, value in report.user_properties:
                if key == NOTE:
                    self.notes.setdefault(value[0], set()).add(value[1])

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for category, lines in sorted(self.notes.items()):
            terminalreporter.write_sep("-", f"kvcompile: {category} ({len(lines)})")
            for line in sorted(lines):
                terminalreporter.write_line(line)


class _ExpectedMeta(type):
    def __instancecheck__(cls, exc: object) -> bool:
        return bool(cls.pattern.search(f"{type(exc).__name__}: {exc}"))


def expected_failure(pattern: str) -> type[BaseException]:
    """An exception "type" for ``pytest.mark.xfail(raises=...)`` that matches any exception whose
    ``"<type name>: <message>"`` contains the regex `pattern`: a known finding absorbs only the failure it names."""
    return _ExpectedMeta(f"Matching({pattern!r})", (BaseException,), {"pattern": re.compile(pattern)})


def _known_findings(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark known findings as strict xfails that expect the failure they name: the engines' declared ones and
    the run's ``ENGINE | TEST-GLOB | REASON | EXPECTED`` lines. Another failure stays a failure."""
    declared = [(name, *finding) for name, ref in config.stash[SESSION].engines.items()
                for finding in ref.declaration.known_findings]
    for engine, pattern, reason, expected in declared + options.known_findings(config):
        for item in items:
            callspec = getattr(item, "callspec", None)
            if callspec and callspec.params.get("kv_engine_name") == engine and fnmatch(item.name, pattern):
                item.add_marker(pytest.mark.xfail(reason=f"known finding on {engine}: {reason}", strict=True,
                                                  raises=expected_failure(expected)))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _known_findings(config, items)
    if config.stash[SESSION].settings.fuzz is None:  # fuzzing is opt-in (--kv-fuzz=N): deselect, don't skip
        fuzzing = [i for i in items if getattr(i, "originalname", "") == "test_fuzz" and "kv_engine" in i.fixturenames]
        if fuzzing:
            config.hook.pytest_deselected(items=fuzzing)
            items[:] = [i for i in items if i not in fuzzing]
    engine_tests = [i for i in items if getattr(i, "callspec", None) and "kv_engine_name" in i.callspec.params]
    if not config.stash[SESSION].engines and engine_tests:
        if hasattr(config, "workerinput"):  # a UsageError here would crash the xdist worker: the fixtures error
            return
        raise pytest.UsageError(NO_ENGINE + f" ({len(engine_tests)} collected test(s) need one)")
    if getattr(config.option, "loadgroup", False):  # xdist worker in loadgroup mode: one group per engine x model
        for item in engine_tests:
            params = item.callspec.params
            item.add_marker(pytest.mark.xdist_group(f"kv:{params['kv_engine_name']}:{params.get('kv_model_name', '')}"))
