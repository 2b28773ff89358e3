"""``@pytest.mark.no_recompile`` and the ``kv_compile_recorder`` fixture, for any repo.

Enable with ``recompile_marker.register(config)`` from a ``pytest_configure`` (pytest-kvcompile's
plugin does). Recording covers the test call only: compiles in fixture setup never count.

    @pytest.mark.no_recompile                      # engine warmed up by a fixture:
    def test_decode(warm_engine):                  # the test body compiles nothing
        warm_engine.generate(prompts, 32)

    @pytest.mark.no_recompile(warmup=True)         # the test warms up itself
    def test_decode(engine, kv_compile_recorder):
        engine.generate(prompts, 2)
        kv_compile_recorder.mark_warmup_done()     # compiles after this line count
        engine.generate(prompts, 32)

A failure reads like pytest-memray's: one line saying what broke, then a
``no_recompile: compiles after warmup`` section with each compile's frame, failed guards and
HINTs. Bad marker arguments are a collection error naming the fix. Under pytest-xdist each
worker records its own tests.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest

from pytest_kvcompile.run.markers import bind, validated_at_collection, written
from pytest_kvcompile.recompiles.recorder import CompileRecorder, isolate, verdict

MARKER = "no_recompile"
FIXTURE = "kv_compile_recorder"
SECTION = f"{MARKER}: compiles after warmup"


def no_recompile(*, max_recompiles: int = 0, graph_breaks: bool = False, warmup: bool = False) -> None:
    """fail the test if, during its call, dynamo compiles more than max_recompiles frames after
    warmup, a compile fails or hits a recompile limit, or a graph break happens (graph_breaks=True allows them). warmup=True: the
    test takes the kv_compile_recorder fixture and calls kv_compile_recorder.mark_warmup_done()
    where warmup ends (dynamo is reset before the test, see recompiles.isolate); otherwise every
    compile in the test call counts."""


_SIGNATURE = inspect.signature(no_recompile)
_PARAMS = _SIGNATURE.parameters
_USAGE = f"@pytest.mark.{MARKER}({', '.join(f'{name}={p.default!r}' for name, p in _PARAMS.items())})"


@dataclass(frozen=True)
class Settings:
    """A test's validated ``no_recompile`` arguments."""

    max_recompiles: int
    graph_breaks: bool
    warmup: bool


SETTINGS = pytest.StashKey["Settings | None"]()
RECORDER = pytest.StashKey[CompileRecorder]()
FAILURE = pytest.StashKey[str]()
PLUGIN = pytest.StashKey["RecompilePlugin"]()


def settings(item: pytest.Item) -> Settings | None:
    """The item's validated marker arguments (None: not marked); ValueError names the fix."""
    if SETTINGS in item.stash:
        return item.stash[SETTINGS]
    mark = item.get_closest_marker(MARKER)
    found = None if mark is None else _validate(mark, getattr(item, "fixturenames", ()))
    item.stash[SETTINGS] = found
    return found


def _validate(mark: pytest.Mark, fixturenames: tuple[str, ...] | list[str]) -> Settings:
    where = written(mark)
    bound = bind(_SIGNATURE, mark.args, mark.kwargs, where, _USAGE)
    bound.apply_defaults()
    for name, value in bound.arguments.items():
        default = _PARAMS[name].default
        if type(value) is not type(default) or (type(value) is int and value < 0):
            wanted = "an int >= 0" if type(default) is int else "True or False"
            raise ValueError(f"{where}: {name} must be {wanted}, got {value!r}; the arguments are {_USAGE}")
    if bound.arguments["warmup"] and FIXTURE not in fixturenames:
        raise ValueError(
            f"{where}: warmup=True needs the {FIXTURE} fixture: add it to the test's arguments and call "
            f"{FIXTURE}.mark_warmup_done() where warmup ends"
        )
    return Settings(**bound.arguments)


class RecompilePlugin:
    """The marker's hooks and fixture; per-test state lives in ``item.stash``."""

    pytest_pycollect_makeitem = staticmethod(validated_at_collection(settings))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        for key in (RECORDER, FAILURE):  # a rerun of the item records afresh
            if key in item.stash:
                del item.stash[key]
        try:
            found = settings(item)  # also checks markers added after collection
        except ValueError as exc:
            pytest.fail(f"{item.nodeid}: {exc}", pytrace=False)
        if found and found.warmup:
            isolate()

    @pytest.fixture
    def kv_compile_recorder(self, request: pytest.FixtureRequest) -> CompileRecorder:
        """The CompileRecorder of this test's call (fixture setup is not recorded): call
        ``.mark_warmup_done()`` where warmup ends. Without the no_recompile marker it only records."""
        return request.node.stash.setdefault(RECORDER, CompileRecorder())

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        found = settings(item)
        if found is not None:
            item.stash.setdefault(RECORDER, CompileRecorder())
        recorder = item.stash.get(RECORDER, None)
        if recorder is None:
            return (yield)
        with recorder:
            result = yield
        if found is not None:
            failure = verdict(recorder, max_recompiles=found.max_recompiles, allow_graph_breaks=found.graph_breaks,
                              warmup=found.warmup)
            if failure:
                item.stash[FAILURE] = failure
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        failure = item.stash.get(FAILURE, None)
        if call.when == "call" and failure and report.passed:
            summary, _, details = failure.partition("\n")
            report.outcome = "failed"
            report.longrepr = f"{MARKER}: {summary}"
            if details.strip():
                report.sections.insert(0, (SECTION, details.strip("\n")))  # before captured output
        return report


def register(config: pytest.Config) -> None:
    """Add the no_recompile marker and the kv_compile_recorder fixture to this run (idempotent)."""
    if PLUGIN in config.stash:
        return
    config.addinivalue_line("markers", f"{_USAGE.removeprefix('@pytest.mark.')}: {' '.join(no_recompile.__doc__.split())}")
    config.stash[PLUGIN] = RecompilePlugin()
    config.pluginmanager.register(config.stash[PLUGIN], "kvcompile.recompile")
