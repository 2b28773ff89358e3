"""pytest-kvcompile's pytest hooks: options, engine resolution, parametrization, reports.

Loaded through the ``pytest11`` entry point ``kvcompile`` (``-p no:kvcompile`` disables it).
"""

from __future__ import annotations

from fnmatch import fnmatch

import pytest

from . import fixtures, memory_marker, options, recompile_marker, registry, reports
from .engine import BATCHING, COMPILED, KV_CACHE_BYTES, SCORING
from .marker_checks import validated_at_collection
from .prompts import prompt_set
from .session import SESSION, Session

CAPABILITIES = (BATCHING, SCORING, KV_CACHE_BYTES, COMPILED)
NOTE = "kvcompile"  # user_properties key of run notes: (category, line)


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
    session = config.stash[SESSION] = Session(settings, engines)
    if settings.engines or settings.models:
        session.models  # read configs now: a bad --kv-model/--kv-zoo is a usage error, not a collection error
    config.pluginmanager.register(fixtures, "kvcompile.fixtures")
    config.pluginmanager.register(RunNotes(), "kvcompile.notes")
    recompile_marker.register(config)
    memory_marker.register(config)
    reports.register(config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize engine, model and prompt per the run's options (ids: names)."""
    session = metafunc.config.stash[SESSION]
    names = metafunc.fixturenames
    if "kv_engine_name" in names:
        engines = list(session.engines) or [pytest.param(
            None, id="no-engine", marks=pytest.mark.skip(reason=f"no engine selected: pass {options.ENGINE}=NAME "
                                                       f"(pytest {options.LIST_ENGINES} lists them)"))]
        metafunc.parametrize("kv_engine_name", engines, scope="session")
    if "kv_prompt_name" in names:
        pairs = [(m, p.name) for m, entry in session.models.items() for p in _prompts(entry)]
        metafunc.parametrize(("kv_model_name", "kv_prompt_name"), pairs, ids=[f"{m}-{p}" for m, p in pairs], scope="session")
    elif "kv_model_name" in names:
        metafunc.parametrize("kv_model_name", list(session.models), scope="session")


def _prompts(entry):
    if entry.unavailable:  # still collected, so the skip shows with its reason
        return [fixtures.UNAVAILABLE_PROMPT]
    return prompt_set(entry.vocab_size, entry.window)


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


def _known_findings(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark known findings as strict xfails: the engines' declared ones and the run's
    ``ENGINE | TEST-GLOB | REASON`` lines."""
    declared = [(name, glob, reason) for name, ref in config.stash[SESSION].engines.items()
                for glob, reason in ref.declaration.known_findings]
    for engine, pattern, reason in declared + options.known_findings(config):
        for item in items:
            callspec = getattr(item, "callspec", None)
            if callspec and callspec.params.get("kv_engine_name") == engine and fnmatch(item.name, pattern):
                item.add_marker(pytest.mark.xfail(reason=f"known finding on {engine}: {reason}", strict=True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _known_findings(config, items)
