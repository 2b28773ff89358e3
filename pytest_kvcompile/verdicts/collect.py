"""Collecting a run's rows: this process's `Collector`, the ``kv_record`` fixture's `Recorder`, a test report's
outcome and the run's facts (`run_metadata`). pytest's objects are passed in; this module does not import pytest.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from pytest_kvcompile.verdicts import suite_index
from pytest_kvcompile.verdicts.results import Results
from pytest_kvcompile.verdicts.rows import Row, RunInfo, Tokens, new_row

if TYPE_CHECKING:
    import pytest

WORKER_KEY = "kvcompile_results"  # config.workeroutput key
NOTE = "kvcompile"  # user_properties key of run notes: (category, line)
NEAR_TIES = "near ties accepted as numerics"
COMMAND_ENV = "KVCOMPILE_COMMAND"  # set by `kvcompile check-engine`: the command a results file records as its own


def _typed(name: str, value: Any) -> Any:
    """A metric's value as the row field holds it: a record given as a dict (a downstream kv_record.metric call) is
    built from its keys (a key that is no field is a TypeError naming the fields); anything else is taken as given."""
    f = _ROW_FIELDS.get(name)
    if f is None:
        raise TypeError(f"kv_record: {name!r} is not a field of a results row; the fields are "
                        f"{', '.join(list(_ROW_FIELDS)[4:])} (verdicts/rows.py: Row)")
    return _build(f, value, name)


def _build(f: dataclasses.Field, value: Any, where: str) -> Any:
    kind = f.metadata["record"]
    if kind is None or value is None:
        return value
    if f.metadata["items"] == "dict":
        return {k: _one(kind, v, f"{where}[{k!r}]") for k, v in value.items()}
    if f.metadata["items"] == "list":
        return [_one(kind, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return _one(kind, value, where)


def _one(kind: type, value: Any, where: str) -> Any:
    if isinstance(value, kind):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"kv_record: {where} must be a {kind.__name__} (verdicts/rows.py), got {type(value).__name__}")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise TypeError(f"kv_record: {where} has keys {unknown} that are no fields of {kind.__name__}; its fields are "
                        f"{', '.join(fields)} (verdicts/rows.py)")
    return kind(**{k: _build(fields[k], v, f"{where}.{k}") for k, v in value.items()})


_ROW_FIELDS = {f.name: f for f in dataclasses.fields(Row)}


@dataclass
class Collector:
    """This process's rows, keyed by (engine, model, device, dtype)."""

    device: str
    dtype: str

    def __post_init__(self) -> None:
        self.rows: dict[tuple, Row] = {}
        self.pending: dict[tuple, Row] | None = None  # what add() merged since the last drain(), tracked
        self.engine_s = 0.0  # every generate_s add() was given: a test's engine time is its difference

    def track(self) -> None:
        """From now on keep what add() merges until `drain()` (an xdist worker sends it with each test's report)."""
        self.pending = {}

    def row(self, engine: str, model: str) -> Row:
        key = (engine, model, self.device, self.dtype)
        if key not in self.rows:
            self.rows[key] = new_row(*key)
        return self.rows[key]

    def add(self, engine: str, model: str, **fields: Any) -> None:
        """Merge measured fields (compiles=Compiles(...), kv_bytes=KVBytes(...), tokens=Tokens(identical=1), ...) into
        a row; an unknown field is a TypeError naming the fields."""
        row = new_row(engine, model, self.device, self.dtype, **{k: _typed(k, v) for k, v in fields.items()})
        self.engine_s += row.generate_s
        self.row(engine, model).merge(row)
        if self.pending is not None:
            self.pending.setdefault(row.key, new_row(*row.key)).merge(copy.deepcopy(row))

    def drain(self) -> dict[str, Any]:
        """The rows add() merged since the last drain, as JSON (what an xdist worker can send), then forget them."""
        found, self.pending = self.pending or {}, {} if self.pending is not None else None
        return Results(rows=[found[k] for k in sorted(found)]).to_json()

    def results(self) -> Results:
        return Results(rows=[self.rows[k] for k in sorted(self.rows)])


def params(item: pytest.Item) -> tuple[str, str] | None:
    """(engine, model) of a test parametrized by the plugin, else None."""
    callspec = getattr(item, "callspec", None)
    found = callspec and (callspec.params.get("kv_engine_name"), callspec.params.get("kv_model_name"))
    return found if found and all(found) else None


class Recorder:
    """The ``kv_record`` fixture's value.

    ``kv_record(category, line, **metrics)``: a passing-but-notable fact for the run's terminal
    summary (a near tie, a compile count); ``metrics`` (fields of `Row`: ``compiles=Compiles(...)``,
    ``kv_bytes=KVBytes(...)``, ``near_ties=[line]``, ``tokens=Tokens(identical=1)``) go to the current engine and
    model's row of the reports. ``kv_record.metric(**metrics)`` records metrics without a note."""

    def __init__(self, item: pytest.Item, collector: Collector) -> None:
        self.item, self.collector = item, collector

    def __call__(self, category: str, line: str, **metrics: Any) -> None:
        self.item.user_properties.append((NOTE, (category, line)))
        self.metric(**metrics)

    def verdict(self, verdict: Any, at: str, verified: int, evicted: int | None, sequence: str = "") -> None:
        """A token check's verdict (token_match.Verdict, or None for a mismatch) of `verified` engine tokens;
        `at` names engine / model / prompt (where); `evicted`: cache entries the oracle evicted (None: no eviction);
        `sequence`: a key of the prompt and the engine's tokens, so a sequence verified again (repeated calls, other
        checks) counts once in the run's near-tie rate."""
        if verdict is None:
            self.metric(tokens=Tokens(mismatch=1), verified_tokens=verified)
            return
        if sequence:
            self.metric(sequences={sequence: [verified, len(verdict.near_ties)]})
        for tie in verdict.near_ties:
            line = f"{at}: near tie at step {tie.step}, {tie.expected} vs {tie.got}, gap {tie.gap:.3g}" + (
                f", the truth routed the other way: {tie.via}" if tie.via else "")
            self(NEAR_TIES, line, near_ties=[line])
        evictions = {} if evicted is None else {"evictions": evicted, "evicting": 1}
        self.metric(tokens=Tokens(near_tie=1) if verdict.near_ties else Tokens(identical=1), verified_tokens=verified,
                    near_tie_tokens=len(verdict.near_ties), excluded_tokens=len(verdict.excluded_steps), **evictions)

    def metric(self, *, engine: str | None = None, model: str | None = None, **metrics: Any) -> None:
        """Merge metrics into the row of (engine, model): by default the test's own."""
        if not metrics:
            return
        own = params(self.item)
        if (engine is None or model is None) and own is None:
            raise ValueError(f"{self.item.nodeid} is not parametrized by engine and model: pass engine= and model=")
        engine, model = engine or own[0], model or own[1]
        self.collector.add(engine, model, **metrics)


def outcome(report: pytest.TestReport) -> str | None:
    """The test's outcome if this phase decides it, else None."""
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    if report.when == "call":
        return report.outcome
    if report.failed:
        return "error"
    return "skipped" if report.skipped and report.when == "setup" else None


def run_metadata(config: pytest.Config, settings: Any) -> RunInfo:
    """Versions, device and options of this run (`settings`: the run's options.Settings). Imports torch only for
    a CUDA device's name: a run that used no kvcompile feature never loads it."""
    device_name = platform.processor() or platform.machine()
    if settings.device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            device_name = torch.cuda.get_device_name(torch.device(settings.device))
    suites = suite_index.index()
    command = os.environ.get(COMMAND_ENV) or shlex.join(["pytest", *config.invocation_params.args])
    options = {name: value for name, value in vars(config.option).items()
               if name.startswith("kv_") and value not in (None, [], False)}
    return RunInfo(
        started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        python=sys.version.split()[0],
        platform=platform.platform(),
        torch=sys.modules["torch"].__version__ if "torch" in sys.modules else _version("torch"),
        transformers=_version("transformers"),
        pytest_kvcompile=_version("pytest-kvcompile"),
        device=settings.device,
        device_name=device_name,
        dtype=settings.dtype,
        engines=list(settings.engines),
        compile_backend=settings.compile_backend,
        max_new_tokens=settings.max_new_tokens,
        options={k: v if isinstance(v, (bool, int, float)) else str(v) if not isinstance(v, list)
                 else [str(x) for x in v] for k, v in sorted(options.items())},
        command=command,
        suites=suites.version,
        checks=sorted(suites.checks),
    )


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None

