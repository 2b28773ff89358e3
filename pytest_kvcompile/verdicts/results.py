"""The results file: one run's rows (or several runs merged) as JSON, schema `SCHEMA_VERSION`, older schemas upgraded
on read (``kvcompile merge``, the reports, ``--kv-baseline``).

Each process collects rows for the tests it runs (verdicts/collect.py). Under pytest-xdist a worker hands its rows to
the controller as JSON in ``config.workeroutput``; only the controller merges them (``pytest_testnodedown``), compares
with ``--kv-baseline`` and writes the reports. ``merge`` also joins result files of separate runs: counts add up, lists
join, latency samples of the same protocol pool, compile counts keep the worst.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pytest_kvcompile.verdicts.failures import Failure, Kind, Problem, Where
from pytest_kvcompile.verdicts.rows import Row, RunInfo, Status, _kind

SCHEMA_VERSION = 3
READS = (1, 2, 3)  # schema versions Results.from_json accepts; older ones are upgraded
RESULTS_KIND = "pytest-kvcompile-results"


@dataclass
class Results:
    """A run's results (or several runs merged): the runs, one row per engine x model x device x dtype, the run
    rules that failed, and (a report written during the run) its status."""

    runs: list[RunInfo] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    status: Status | None = None

    def to_json(self) -> dict[str, Any]:
        """The results file's object (schema SCHEMA_VERSION), ``status`` only when set."""
        found = {"schema_version": SCHEMA_VERSION, "kind": RESULTS_KIND, "runs": [r.to_json() for r in self.runs],
                 "rows": [r.to_json() for r in self.rows], "problems": [p.to_dict() for p in self.problems]}
        if self.status is not None:
            found["status"] = self.status.to_json()
        return found

    @classmethod
    def from_json(cls, data: Any) -> Results:
        """Results from a file's object, of any schema in READS (older ones upgraded); ValueError says what is
        wrong."""
        if not isinstance(data, dict) or data.get("kind") != RESULTS_KIND:
            raise ValueError(f"not a pytest-kvcompile results file (expected an object with \"kind\": "
                             f"\"{RESULTS_KIND}\")")
        schema = data.get("schema_version")
        if schema not in READS:
            raise ValueError(f"schema_version {schema!r} is not supported (this pytest-kvcompile reads "
                             f"{', '.join(map(str, READS))}); re-create the file with this version's --kv-report-json")
        for key in ("runs", "rows"):
            if not isinstance(data.get(key), list):
                raise ValueError(f"missing key {key!r} (a list)")
        if schema == 1:
            data = _upgrade_1(data)
        problems = []
        for i, problem in enumerate(data.get("problems", [])):
            at = f"problems[{i}]"
            if not isinstance(problem, dict):
                raise ValueError(f"{at}: expected an object, got {type(problem).__name__}")
            for key in ("kind", "engine", "device", "dtype", "message"):
                if not isinstance(problem.get(key), str):
                    raise ValueError(f"{at}: missing key {key!r}" if key not in problem else
                                     f"{at}.{key}: wrong type {type(problem[key]).__name__}")
            _kind(problem["kind"], f"{at}.kind")
            problems.append(Problem.from_dict({k: problem.get(k) for k in ("kind", "engine", "device", "dtype",
                                                                            "message", "model")}))
        status = data.get("status")
        return cls([RunInfo.from_json(r, f"runs[{i}]") for i, r in enumerate(data["runs"])],
                   [Row.from_json(r, f"rows[{i}]") for i, r in enumerate(data["rows"])], problems,
                   Status.from_json(status, "status") if isinstance(status, dict) else None)


def _upgrade_1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 file as schema 2: each failure's kind from its token diff (else "other"), the diff as its typed
    ``failure``; no run rules were stored (``problems`` empty)."""
    rows = []
    for row in data["rows"]:
        if not isinstance(row, dict) or not isinstance(row.get("failures"), list):
            rows.append(row)  # Row.from_json names what is wrong
            continue
        failures = []
        for old in row["failures"]:
            diff = old.get("diff") if isinstance(old, dict) else None
            if not isinstance(diff, dict):
                failures.append({**old, "kind": Kind.OTHER.value, "failure": None} if isinstance(old, dict) else old)
                continue
            failure = Failure(
                Kind(diff.get("kind", "mismatch")), row.get("engine", ""), row.get("model", ""), diff.get("prompt", ""),
                diff.get("prompt_length", 0), Where(note=diff.get("where", "")), step=diff.get("step"),
                gap=diff.get("gap"), tolerance=diff.get("tolerance"), scored=diff.get("gap") is not None or
                diff.get("step") is None, oracle=tuple(diff.get("oracle", ())), tokens=tuple(diff.get("engine", ())),
                prompt_tail=tuple(diff.get("prompt_tail", ())), top3=tuple(tuple(t) for t in diff.get("top3", ())),
                near_ties=tuple(tuple(t) for t in diff.get("near_ties", ())))
            failures.append({"test": old.get("test", ""), "kind": failure.kind.value,
                             "message": old.get("message", ""), "failure": failure.to_dict()})
        rows.append({**row, "failures": failures})
    return {**data, "rows": rows, "problems": []}


def merge(results: list[Results]) -> Results:
    """One Results from several (workers of one run, or separate runs): runs are listed, rows merged, the run rules
    that failed in any of them kept."""
    rows: dict[tuple, Row] = {}
    runs, problems = [], []
    for result in results:
        runs += result.runs
        problems += [p for p in result.problems if p not in problems]
        for row in result.rows:
            if row.key in rows:
                rows[row.key].merge(row)
            else:
                rows[row.key] = copy.deepcopy(row)
    return Results(runs, [rows[k] for k in sorted(rows)], problems)

