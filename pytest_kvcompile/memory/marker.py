"""``@pytest.mark.limit_memory("64 MiB")``: fail a test whose call allocates more than a limit, for any repo.

Enable with ``memory_marker.register(config)`` from a ``pytest_configure`` (pytest-kvcompile's plugin
does). The argument reads like pytest-memray's: a number and a unit, B, KB, MB, GB, TB (KiB, MiB, GiB,
TiB are the same), case-insensitive; as in pytest-memray, ``KB`` is 1024 bytes. Only the test call is
measured (fixture setup is not), as the growth of the peak over the memory in use when the call starts:

- ``device="cuda"``: ``torch.cuda.max_memory_allocated()`` after ``torch.cuda.reset_peak_memory_stats()``,
  over ``torch.cuda.memory_allocated()`` at the start: exact bytes of tensors of the caching allocator on
  the current device (not the allocator's reserved pool, not other libraries' CUDA memory).
- ``device="cpu"``: the process's peak resident set (``VmHWM`` in ``/proc/self/status``, reset to the
  current RSS by writing ``5`` to ``/proc/self/clear_refs``) over the RSS at the start, Linux only. It counts
  pages newly touched by anything in the process (other threads included) and misses memory reused from
  pages already resident (freed but kept by malloc); page granularity. ``tracemalloc`` is no alternative: it
  does not see torch tensors (a 40 MB tensor: 80 bytes traced, measured).
- ``device="auto"`` (default): ``cuda`` when torch sees a GPU, else ``cpu``.

Where the measure is unavailable (not Linux, ``clear_refs`` not writable, ``cuda`` without a GPU) the test
is skipped with the reason. A failure reads like pytest-memray's: one line, then a
``limit_memory: memory report`` section. Bad arguments are a collection error naming the fix.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_kvcompile.run.markers import bind, validated_at_collection, written
from pytest_kvcompile.memory.measure import format_bytes

MARKER = "limit_memory"
SECTION = f"{MARKER}: memory report"
DEVICES = ("auto", "cpu", "cuda")
STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def limit_memory(limit: str, *, device: str = "auto") -> None:
    """fail the test if its call allocates more than limit ("64 MiB"; units B, KB, MB, GB, TB or KiB, MiB,
    GiB, TiB, all powers of 1024 as in pytest-memray): on device="cuda" the growth of
    torch.cuda.max_memory_allocated, on "cpu" the growth of the process's peak RSS (VmHWM, Linux);
    "auto" picks cuda when available. Skipped where the measure is unavailable."""


_SIGNATURE = inspect.signature(limit_memory)
_USAGE = '@pytest.mark.limit_memory("64 MiB", device="auto")'
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]i?)?B\s*", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``"64 MiB"`` or ``"1.5GB"`` (powers of 1024); ValueError names the format."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"{text!r} is not a size: write a number and a unit, e.g. \"64 MiB\" "
                         f"(units B, KB, MB, GB, TB or KiB, MiB, GiB, TiB: powers of 1024)")
    number, unit = match.groups()
    return int(float(number) * 1024 ** _POWERS[(unit or "")[:1].upper()])


@dataclass(frozen=True)
class Settings:
    """A test's validated ``limit_memory`` arguments."""

    limit: int
    text: str
    device: str


SETTINGS = pytest.StashKey["Settings | None"]()
FAILURE = pytest.StashKey[tuple[str, str]]()
PLUGIN = pytest.StashKey["MemoryPlugin"]()


def settings(item: pytest.Item) -> Settings | None:
    """The item's validated marker arguments (None: not marked); ValueError names the fix."""
    if SETTINGS not in item.stash:
        mark = item.get_closest_marker(MARKER)
        item.stash[SETTINGS] = None if mark is None else _validate(mark)
    return item.stash[SETTINGS]


def _validate(mark: pytest.Mark) -> Settings:
    where = written(mark)
    bound = bind(_SIGNATURE, mark.args, mark.kwargs, where, _USAGE)
    bound.apply_defaults()
    text, device = bound.arguments["limit"], bound.arguments["device"]
    try:
        limit = parse_size(text)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if device not in DEVICES:
        raise ValueError(f"{where}: device must be one of {', '.join(map(repr, DEVICES))}, got {device!r}")
    return Settings(limit, text, device)


def _status_bytes(field: str) -> int:
    line = next(line for line in STATUS.read_text().splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024  # the kernel writes kB


class _CpuPeak:
    """Peak RSS growth of this process over the test call (see the module docstring)."""

    name = "process peak RSS (VmHWM) over RSS at the call's start"

    @staticmethod
    def unavailable() -> str | None:
        if not STATUS.exists():
            return f"{STATUS} does not exist (the CPU measure needs Linux)"
        try:
            CLEAR_REFS.write_text("5")
        except OSError as exc:
            return f"cannot reset the peak RSS through {CLEAR_REFS} ({exc})"
        return None

    def start(self) -> int:
        CLEAR_REFS.write_text("5")  # VmHWM := VmRSS
        return _status_bytes("VmRSS")

    def peak(self) -> int:
        return _status_bytes("VmHWM")


class _CudaPeak:
    """Peak growth of torch.cuda.memory_allocated on the current device over the test call."""

    name = "torch.cuda.max_memory_allocated() over torch.cuda.memory_allocated() at the call's start"

    @staticmethod
    def unavailable() -> str | None:
        import torch

        return None if torch.cuda.is_available() else "torch sees no CUDA device"

    def start(self) -> int:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        import torch

        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


def _measure(device: str):
    if device == "auto":
        device = "cuda" if _CudaPeak.unavailable() is None else "cpu"
    return device, {"cpu": _CpuPeak, "cuda": _CudaPeak}[device]


class MemoryPlugin:
    """The marker's hooks; per-test state lives in ``item.stash``."""

    pytest_pycollect_makeitem = staticmethod(validated_at_collection(settings))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if FAILURE in item.stash:  # a rerun measures afresh
            del item.stash[FAILURE]
        try:
            found = settings(item)  # also checks markers added after collection
        except ValueError as exc:
            pytest.fail(f"{item.nodeid}: {exc}", pytrace=False)
        if found:
            device, measure = _measure(found.device)
            why = measure.unavailable()
            if why:
                pytest.skip(f"{MARKER}: cannot measure {device} memory here: {why}")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        found = settings(item)
        if found is None:
            return (yield)
        device, measure = _measure(found.device)
        probe = measure()
        baseline = probe.start()
        result = yield
        peak = probe.peak()
        grown = max(peak - baseline, 0)
        if grown > found.limit:
            item.stash[FAILURE] = (
                f"test allocated {format_bytes(grown)}, limit {found.text} ({found.limit:,} B)",
                f"device: {device}\nmeasure: {measure.name}\nat the call's start: {format_bytes(baseline)}\n"
                f"peak during the call: {format_bytes(peak)}\ngrowth: {format_bytes(grown)}\n"
                f"limit: {format_bytes(found.limit)} ({found.text!r})\nover by: {format_bytes(grown - found.limit)}",
            )
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        failure = item.stash.get(FAILURE, None)
        if call.when == "call" and failure and report.passed:
            report.outcome = "failed"
            report.longrepr = f"{MARKER}: {failure[0]}"
            report.sections.insert(0, (SECTION, failure[1]))  # before captured output
        return report


def register(config: pytest.Config) -> None:
    """Add the limit_memory marker to this run (idempotent)."""
    if PLUGIN in config.stash:
        return
    config.addinivalue_line("markers", f"{_USAGE.removeprefix('@pytest.mark.')}: {' '.join(limit_memory.__doc__.split())}")
    config.stash[PLUGIN] = MemoryPlugin()
    config.pluginmanager.register(config.stash[PLUGIN], "kvcompile.memory")
