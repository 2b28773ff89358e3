"""``@pytest.mark.limit_memory("64 MiB")``: fail a test whose call allocates more than a limit, for any repo.

Enable with ``pytest_kvcompile.memory.marker.register(config)`` from a ``pytest_configure`` (pytest-kvcompile's plugin
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

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pytest_kvcompile.config import markers
from pytest_kvcompile.memory.units import format_bytes, parse_size

MARKER = "limit_memory"
DEVICES = ("auto", "cpu", "cuda")
STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def limit_memory(measured: dict[str, Any], limit: str, *, device: str = "auto") -> markers.Finding | None:
    """fail the test if its call allocates more than limit ("64 MiB"; units B, KB, MB, GB, TB or KiB, MiB,
    GiB, TiB, all powers of 1024 as in pytest-memray): on device="cuda" the growth of
    torch.cuda.max_memory_allocated, on "cpu" the growth of the process's peak RSS (VmHWM, Linux);
    "auto" picks cuda when available. Skipped where the measure is unavailable."""
    grown, limit_bytes = max(measured["peak"] - measured["start"], 0), parse_size(limit)
    if grown <= limit_bytes:
        return None
    return markers.Finding(
        f"test allocated {format_bytes(grown)}, limit {limit} ({limit_bytes:,} B)",
        f"device: {measured['device']}\nmeasure: {measured['measure']}\nat the call's start: "
        f"{format_bytes(measured['start'])}\npeak during the call: {format_bytes(measured['peak'])}\n"
        f"growth: {format_bytes(grown)}\nlimit: {format_bytes(limit_bytes)} ({limit!r})\n"
        f"over by: {format_bytes(grown - limit_bytes)}",
        "memory report",
    )


def _validate(arguments: dict[str, Any], item: pytest.Item) -> dict[str, Any]:
    parse_size(arguments["limit"])
    if arguments["device"] not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(map(repr, DEVICES))}, got {arguments['device']!r}")
    return arguments


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


def _setup(arguments: dict[str, Any], item: pytest.Item) -> None:
    device, measure = _measure(arguments["device"])
    why = measure.unavailable()
    if why:
        markers.skip(f"{MARKER}: cannot measure {device} memory here: {why}")


@contextmanager
def _peak(arguments: dict[str, Any], item: pytest.Item):
    device, measure = _measure(arguments["device"])
    probe = measure()
    found = {"device": device, "measure": measure.name, "start": probe.start()}
    yield found
    found["peak"] = probe.peak()


SPEC = markers.Marker(limit_memory, _validate, _setup, _peak, example='("64 MiB", device="auto")', kind="memory")


def register(config: pytest.Config) -> None:
    """Add the limit_memory marker to this run, e.g. from a conftest's ``pytest_configure`` (idempotent)."""
    markers.register(config, {MARKER: SPEC})
