"""kvcompile markers, the pytest-memray way: one table ``{marker name: Marker}``, one plugin class.

A `Marker`'s `check` function is the marker: its parameters after the first are the marker's arguments (their
defaults the documented ones), its docstring the marker's help line, and after the test call it returns
nothing or a `Finding` (one line, then a detail section of the report). `MarkersPlugin` validates every marked
test at collection (bad arguments: a collection error naming the fix; a UsageError raised in an xdist worker
would crash it instead), runs `setup` before the test's fixtures (it may skip), measures the call with `probe`
(what the probe yields is the check's first argument) and turns a failed check into a failed test: one line
``<marker>: <what broke>`` and the section ``<marker>: <title>`` before captured output.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Finding:
    """What a marker's check found: `line` says what broke, `detail` is the report section titled `title`."""

    line: str
    detail: str = ""
    title: str = "details"


@dataclass(frozen=True)
class Marker:
    """One marker (see the module docstring). `validate(arguments, item)` returns the checked arguments
    (ValueError names the fix); `setup(arguments, item)` and `probe(arguments, item)` are optional."""

    check: Callable[..., Finding | None]
    validate: Callable[[dict[str, Any], pytest.Item], dict[str, Any]] = lambda arguments, item: arguments
    setup: Callable[[dict[str, Any], pytest.Item], None] | None = None
    probe: Callable[[dict[str, Any], pytest.Item], contextlib.AbstractContextManager[Any]] | None = None
    example: str = ""  # the usage shown in help and errors, e.g. '("64 MiB", device="auto")'; default: the signature
    kind: str = "other"  # the verdict kind of its failures (a verdicts.failures.Kind value: recompile, memory, latency)
    renamed: tuple[tuple[str, str], ...] = ()  # (old keyword, new keyword): the old still works, with a deprecation

    @property
    def signature(self) -> inspect.Signature:
        parameters = list(inspect.signature(self.check).parameters.values())[1:]
        return inspect.Signature(parameters)

    def usage(self, name: str) -> str:
        """e.g. ``@pytest.mark.limit_memory("64 MiB", device="auto")``."""
        if self.example:
            return f"@pytest.mark.{name}{self.example}"
        shown = []
        for p in self.signature.parameters.values():
            star = "*" if p.kind is p.VAR_POSITIONAL else ""
            shown.append(f"{star}{p.name}" if p.default is p.empty else f"{p.name}={p.default!r}")
        return f"@pytest.mark.{name}({', '.join(shown)})"

    def help(self, name: str) -> str:
        """The ini ``markers`` line: usage, then the check's docstring."""
        return f"{self.usage(name).removeprefix('@pytest.mark.')}: {' '.join((self.check.__doc__ or '').split())}"


def skip(reason: str) -> None:
    """Skip from a marker's setup, reported at the test's own location (as pytest's skipif marks are)."""
    raise pytest.skip.Exception(reason, _use_item_location=True)


def written(mark: pytest.Mark) -> str:
    """The marker as the test wrote it, e.g. ``@pytest.mark.limit_memory('64 MiB')``: every argument error starts
    with it."""
    given = ", ".join([*map(repr, mark.args), *(f"{k}={v!r}" for k, v in mark.kwargs.items())])
    return f"@pytest.mark.{mark.name}({given})"


ARGUMENTS = pytest.StashKey[dict[str, Any]]()  # marker name -> validated arguments, per item
FAILURES = pytest.StashKey[list[tuple[str, Finding]]]()
WARNED = pytest.StashKey[set[str]]()  # renamed keywords' deprecations issued for this item
PLUGIN = pytest.StashKey["MarkersPlugin"]()


class MarkersPlugin:
    """Validates, measures and reports every marker of its table; per-test state lives in ``item.stash``."""

    def __init__(self, table: Mapping[str, Marker]) -> None:
        self.table = dict(table)

    def arguments(self, item: pytest.Item) -> dict[str, Any]:
        """{marker name: validated arguments} of the item's kvcompile markers; ValueError names the fix."""
        if ARGUMENTS not in item.stash:
            found = {}
            for name, marker in self.table.items():
                mark = item.get_closest_marker(name)
                if mark is None:
                    continue
                where = written(mark)
                kwargs = dict(mark.kwargs)
                for old, new in marker.renamed:
                    if old in kwargs and new not in kwargs:
                        kwargs[new] = kwargs.pop(old)
                        message = f"{where}: {old}= is deprecated, write {new}="
                        if message not in item.stash.setdefault(WARNED, set()):  # once, not again at setup
                            item.stash[WARNED].add(message)
                            item.warn(pytest.PytestDeprecationWarning(message))
                try:
                    bound = marker.signature.bind(*mark.args, **kwargs)
                except TypeError as exc:
                    raise ValueError(f"{where}: {exc}; write {marker.usage(name)}") from None
                bound.apply_defaults()
                try:
                    found[name] = marker.validate(dict(bound.arguments), item)
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from None
            item.stash[ARGUMENTS] = found
        return item.stash[ARGUMENTS]

    @pytest.hookimpl(wrapper=True)
    def pytest_pycollect_makeitem(self, collector: pytest.Collector, name: str, obj: object):
        result = yield
        for item in result if isinstance(result, list) else [result]:
            if isinstance(item, pytest.Item):
                try:
                    self.arguments(item)
                except ValueError as exc:
                    raise collector.CollectError(f"{item.nodeid}: {exc}") from None
        return result

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        for key in (ARGUMENTS, FAILURES):  # markers added after collection are checked too; a rerun starts afresh
            if key in item.stash:
                del item.stash[key]
        try:
            found = self.arguments(item)
        except ValueError as exc:
            pytest.fail(f"{item.nodeid}: {exc}", pytrace=False)
        for name, arguments in found.items():
            if self.table[name].setup:
                self.table[name].setup(arguments, item)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        found = item.stash.get(ARGUMENTS, {})
        if not found:
            return (yield)
        with contextlib.ExitStack() as stack:
            measured = {name: stack.enter_context(self.table[name].probe(arguments, item))
                        for name, arguments in found.items() if self.table[name].probe}
            result = yield
        failures = []
        for name, arguments in found.items():
            args, kwargs = _split(self.table[name], arguments)
            failure = self.table[name].check(measured.get(name), *args, **kwargs)
            if failure:
                failures.append((name, failure))
        item.stash[FAILURES] = failures
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        failures = item.stash.get(FAILURES, [])
        if call.when == "call" and failures and report.passed:
            report.outcome = "failed"
            report.kv_kind = self.table[failures[0][0]].kind  # the reports' failure kind (verdicts/failures.py)
            report.longrepr = "\n".join(f"{name}: {failure.line}" for name, failure in failures)
            for name, failure in reversed(failures):
                if failure.detail.strip():
                    report.sections.insert(0, (f"{name}: {failure.title}", failure.detail.strip("\n")))
        return report


def _split(marker: Marker, arguments: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Validated arguments as (positional, keywords) for the check: a ``*args`` parameter's values go positionally."""
    star = [p.name for p in marker.signature.parameters.values() if p.kind is p.VAR_POSITIONAL]
    if not star:
        return (), arguments
    rest = {k: v for k, v in arguments.items() if k != star[0]}
    return tuple(arguments.get(star[0], ())), rest


def register(config: pytest.Config, table: Mapping[str, Marker]) -> MarkersPlugin:
    """Add `table`'s markers to this run (one MarkersPlugin per run; later calls add to its table)."""
    plugin = config.stash.get(PLUGIN, None)
    if plugin is None:
        plugin = config.stash[PLUGIN] = MarkersPlugin({})
        config.pluginmanager.register(plugin, "kvcompile.markers")
    for name, marker in table.items():
        if name not in plugin.table:
            plugin.table[name] = marker
            config.addinivalue_line("markers", marker.help(name))
    return plugin
