"""Per-run results: what every engine did on every model, as plain dicts, for the reports.

A *row* holds one (engine, model, device, dtype): test outcomes, token-identity verdicts and
near ties, compile counts with recompile reasons, KV bytes, latency samples. Each process
collects rows for the tests it runs. Under pytest-xdist a worker hands its rows to the
controller as plain dicts in ``config.workeroutput``; only the controller merges them
(``pytest_testnodedown``), compares with ``--kv-baseline`` and writes the reports.

``merge`` also joins result files of separate runs (``kvcompile merge``): counts add up,
lists join, latency samples of the same protocol pool, compile counts keep the worst.
"""

from __future__ import annotations

import copy
import math
import platform
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import pytest

OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
TOKEN_VERDICTS = ("identical", "near_tie", "unverified", "mismatch")
WORKER_KEY = "kvcompile_results"  # config.workeroutput key



class MergeError(ValueError):
    """Two result sets cannot be merged (say why and where)."""


def new_row(engine: str, model: str, device: str, dtype: str) -> dict[str, Any]:
    return {
        "engine": engine, "model": model, "device": device, "dtype": dtype,
        "tests": dict.fromkeys(OUTCOMES, 0),
        "tokens": dict.fromkeys(TOKEN_VERDICTS, 0),
        "near_ties": [],
        "failures": [],  # {"test": nodeid, "message": first lines}
        "compiles": None,  # {"build": int, "warmup": int, "after_warmup": int, "reasons": [str]}
        "kv_bytes": None,  # {"expected": int | None, "measured": int}
        "latency": None,  # see latency.Latency.as_dict()
    }


def row_key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    return row["engine"], row["model"], row["device"], row["dtype"]


def _merge_compiles(a, b):
    return {"build": max(a.get("build", 0), b.get("build", 0)),
            "warmup": max(a["warmup"], b["warmup"]), "after_warmup": max(a["after_warmup"], b["after_warmup"]),
            "reasons": list(dict.fromkeys(a["reasons"] + b["reasons"]))}


def _merge_kv_bytes(a, b):
    """Keep one (expected, measured) pair: one with an expectation first, then the larger measurement."""
    return max(a, b, key=lambda x: (x["expected"] is not None, x["measured"]))


def _merge_latency(a, b):
    protocol = ("prompt_len", "decode_tokens", "timer")
    if any(a[k] != b[k] for k in protocol):
        raise MergeError("latency measured with different protocols: "
                         + " vs ".join(str({k: x[k] for k in protocol}) for x in (a, b)))
    return {**a, "prefill_ms": a["prefill_ms"] + b["prefill_ms"],
            "decode_ms_per_token": a["decode_ms_per_token"] + b["decode_ms_per_token"]}


_OPTIONAL = {"compiles": _merge_compiles, "kv_bytes": _merge_kv_bytes, "latency": _merge_latency}


def merge_row(into: dict[str, Any], row: dict[str, Any]) -> None:
    """Fold `row` into `into` (same key)."""
    for counts in ("tests", "tokens"):
        for name, n in row[counts].items():
            into[counts][name] = into[counts].get(name, 0) + n
    into["near_ties"] = list(dict.fromkeys(into["near_ties"] + row["near_ties"]))
    into["failures"] += [f for f in row["failures"] if f not in into["failures"]]
    for field, merge in _OPTIONAL.items():
        if row[field] is not None:
            try:
                into[field] = row[field] if into[field] is None else merge(into[field], row[field])
            except MergeError as exc:
                raise MergeError(f"{' / '.join(row_key(row))}: {exc}") from None


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One results dict from several (workers of one run, or separate runs): runs are listed, rows merged."""
    rows: dict[tuple, dict[str, Any]] = {}
    runs = []
    for result in results:
        runs += result["runs"]
        for row in result["rows"]:
            key = row_key(row)
            if key in rows:
                merge_row(rows[key], row)
            else:
                rows[key] = copy.deepcopy(row)
    return {"runs": runs, "rows": [rows[k] for k in sorted(rows)]}


def stats(samples: list[float] | tuple[float, ...]) -> dict[str, float]:
    """Median and p90 (nearest rank) of latency samples."""
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "p90": ordered[math.ceil(0.9 * len(ordered)) - 1]}


def run_metadata(config: pytest.Config) -> dict[str, Any]:
    """Versions, device and options of this run."""
    from .session import SESSION

    settings = config.stash[SESSION].settings
    import torch

    device = torch.device(settings.device)
    device_name = platform.processor() or platform.machine()
    if device.type == "cuda" and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(device)
    options = {name: value for name, value in vars(config.option).items()
               if name.startswith("kv_") and value not in (None, [], False)}
    return {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "pytest_kvcompile": _version("pytest-kvcompile"),
        "device": settings.device,
        "device_name": device_name,
        "dtype": settings.dtype,
        "engines": list(settings.engines),
        "compile_backend": settings.compile_backend,
        "max_new_tokens": settings.max_new_tokens,
        "options": {k: v if isinstance(v, (bool, int, float)) else str(v) if not isinstance(v, list) else [str(x) for x in v]
                    for k, v in sorted(options.items())},
    }


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


@dataclass
class Collector:
    """This process's rows, keyed by (engine, model, device, dtype)."""

    device: str
    dtype: str

    def __post_init__(self) -> None:
        self.rows: dict[tuple, dict[str, Any]] = {}

    def row(self, engine: str, model: str) -> dict[str, Any]:
        key = (engine, model, self.device, self.dtype)
        if key not in self.rows:
            self.rows[key] = new_row(*key)
        return self.rows[key]

    def add(self, engine: str, model: str, **fields: Any) -> None:
        """Merge measured fields (compiles=..., kv_bytes=..., latency=..., tokens=..., near_ties=...) into a row."""
        row = new_row(engine, model, self.device, self.dtype)
        row.update(fields)
        merge_row(self.row(engine, model), row)

    def as_dict(self) -> dict[str, Any]:
        return {"runs": [], "rows": [self.rows[k] for k in sorted(self.rows)]}


COLLECTOR = pytest.StashKey[Collector]()


def params(item: pytest.Item) -> tuple[str, str] | None:
    """(engine, model) of a test parametrized by the plugin, else None."""
    callspec = getattr(item, "callspec", None)
    found = callspec and (callspec.params.get("kv_engine_name"), callspec.params.get("kv_model_name"))
    return found if found and all(found) else None


class Recorder:
    """The ``kv_record`` fixture's value.

    ``kv_record(category, line, **metrics)``: a passing-but-notable fact for the run's terminal
    summary (a near tie, a compile count); ``metrics`` (e.g. ``compiles={...}``, ``kv_bytes={...}``,
    ``near_ties=[line]``, ``tokens={"identical": 1}``) go to the current engine and model's row of
    the reports. ``kv_record.metric(**metrics)`` records metrics without a note."""

    def __init__(self, item: pytest.Item) -> None:
        self.item = item

    def __call__(self, category: str, line: str, **metrics: Any) -> None:
        from .plugin import NOTE

        self.item.user_properties.append((NOTE, (category, line)))
        self.metric(**metrics)

    def metric(self, *, engine: str | None = None, model: str | None = None, **metrics: Any) -> None:
        """Merge metrics into the row of (engine, model): by default the test's own."""
        if not metrics:
            return
        own = params(self.item)
        if (engine is None or model is None) and own is None:
            raise ValueError(f"{self.item.nodeid} is not parametrized by engine and model: pass engine= and model=")
        engine, model = engine or own[0], model or own[1]
        self.item.config.stash[COLLECTOR].add(engine, model, **metrics)


def outcome(report: pytest.TestReport) -> str | None:
    """The test's outcome if this phase decides it, else None."""
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    if report.when == "call":
        return report.outcome
    if report.failed:
        return "error"
    return "skipped" if report.skipped and report.when == "setup" else None


def first_lines(text: str, n: int = 4, width: int = 300) -> str:
    return "\n".join(line[:width] for line in text.strip().splitlines()[:n])
