"""``@pytest.mark.no_recompile`` and the ``kv_compile_recorder`` fixture, for any repo.

Enable with ``pytest_kvcompile.recompiles.marker.register(config)`` from a ``pytest_configure`` (pytest-kvcompile's
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

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest

from pytest_kvcompile.config import markers

if TYPE_CHECKING:
    from pytest_kvcompile.recompiles.recorder import CompileRecorder

MARKER = "no_recompile"
FIXTURE = "kv_compile_recorder"
SECTION = "compiles after warmup"
RECORDER = pytest.StashKey["CompileRecorder"]()


def no_recompile(recorder: CompileRecorder, *, max_recompiles: int = 0, allow_graph_breaks: bool = False,
                 warmup: bool = False) -> markers.Finding | None:
    """fail the test if, during its call, dynamo compiles more than max_recompiles frames after
    warmup, a compile fails or hits a recompile limit, or a graph break happens (allow_graph_breaks=True allows
    them). warmup=True: the test takes the kv_compile_recorder fixture and calls
    kv_compile_recorder.mark_warmup_done() where warmup ends (dynamo is reset before the test, see
    recompiles.recorder.reset_dynamo); otherwise every compile in the test call counts."""
    from pytest_kvcompile.recompiles.recorder import verdict

    failure = verdict(recorder, max_recompiles=max_recompiles, allow_graph_breaks=allow_graph_breaks, warmup=warmup)
    if not failure:
        return None
    line, _, details = failure.partition("\n")
    return markers.Finding(line, details, SECTION)


def _validate(arguments: dict[str, Any], item: pytest.Item) -> dict[str, Any]:
    usage = SPEC.usage(MARKER)
    for name, value in arguments.items():
        default = SPEC.signature.parameters[name].default
        if type(value) is not type(default) or (type(value) is int and value < 0):
            wanted = "an int >= 0" if type(default) is int else "True or False"
            raise ValueError(f"{name} must be {wanted}, got {value!r}; the arguments are {usage}")
    if arguments["warmup"] and FIXTURE not in getattr(item, "fixturenames", ()):
        raise ValueError(f"warmup=True needs the {FIXTURE} fixture: add it to the test's arguments and call "
                         f"{FIXTURE}.mark_warmup_done() where warmup ends")
    return arguments


def _setup(arguments: dict[str, Any], item: pytest.Item) -> None:
    if RECORDER in item.stash:  # a rerun of the item records afresh
        del item.stash[RECORDER]
    if arguments["warmup"]:
        from pytest_kvcompile.recompiles.recorder import reset_dynamo

        reset_dynamo()


def recorder_of(item: pytest.Item) -> CompileRecorder:
    """The CompileRecorder of this test's call, shared by the marker and the kv_compile_recorder fixture."""
    if RECORDER not in item.stash:
        from pytest_kvcompile.recompiles.recorder import CompileRecorder

        item.stash[RECORDER] = CompileRecorder()
    return item.stash[RECORDER]


@contextmanager
def _record(arguments: dict[str, Any], item: pytest.Item):
    recorder = recorder_of(item)
    with recorder:
        yield recorder


SPEC = markers.Marker(no_recompile, _validate, _setup, _record, kind="recompile",
                      renamed=(("graph_breaks", "allow_graph_breaks"),))  # the name until issue 27


class RecorderFixture:
    """The ``kv_compile_recorder`` fixture, for any repo."""

    @pytest.fixture
    def kv_compile_recorder(self, request: pytest.FixtureRequest) -> CompileRecorder:
        """The CompileRecorder of this test's call (fixture setup is not recorded): call
        ``.mark_warmup_done()`` where warmup ends. Without the no_recompile marker it only records."""
        return recorder_of(request.node)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        if RECORDER not in item.stash or item.get_closest_marker(MARKER):  # marked: the marker's probe records
            return (yield)
        with item.stash[RECORDER]:
            return (yield)


def register(config: pytest.Config) -> None:
    """Add the no_recompile marker and the kv_compile_recorder fixture to this run, e.g. from a conftest's
    ``pytest_configure`` with ``-p no:kvcompile`` (idempotent)."""
    markers.register(config, {MARKER: SPEC})
    if not config.pluginmanager.has_plugin("kvcompile.recorder-fixture"):
        config.pluginmanager.register(RecorderFixture(), "kvcompile.recorder-fixture")
