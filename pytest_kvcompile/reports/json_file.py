"""The results file: versioned JSON, written by ``--kv-report-json`` and read by ``--kv-baseline``
and ``kvcompile merge``.

Schema (``schema_version`` 2)::

    {"schema_version": 2, "kind": "pytest-kvcompile-results",
     "runs": [{"started", "python", "platform", "torch", "transformers", "pytest_kvcompile", "device",
               "device_name", "dtype", "engines", "compile_backend", "max_new_tokens", "options"}, ...],
     "rows": [{"engine", "model", "device", "dtype",
               "tests": {"passed": n, "failed": n, "skipped": n, "xfailed": n, "xpassed": n, "error": n},
               "tokens": {"identical": n, "near_tie": n, "mismatch": n},  (sequences)
               "near_ties": [line], "failures": [{"test", "kind", "message", "failure": null | {...}}],
               "verified_tokens": n, "near_tie_tokens": n, "token_checks": n,
               "declared_skips": [reason], "oracle_errors": [message],
               "excluded_ids": [id], "excluded_tokens": n,  (Declaration.never_emits: ids out of the oracle's choice,
                                                           steps where the oracle's best was one of them)
               "checks": {test function: {"ran": n, "failed": n, "xfailed": n, "skipped": n, "reason": str}},
               "versions": ["dist==version"],  (the engine's distributions as built: the conformance matrix)
               "compiles": null | {"build": n, "warmup": n, "after_warmup": n, "reasons": [line],
                                   "graph_breaks": [line], "eager_runs": n, "cuda_graph_captures": {phase: n},
                                   "timeline": [entry]},
               "kv_bytes": null | {"expected": n | null, "measured": n},
               "latency": null | {"prompt_len": n, "decode_tokens": n, "timer": str,
                                  "prefill_ms": [sample], "decode_ms_per_token": [sample],
                                  "prefill": {"median", "p90"}, "decode": {"median", "p90"}, "tokens_per_s": x}}],
     "problems": [{"kind", "engine", "model", "device", "dtype", "message"}]}

Verdicts are typed (verdicts/failures.py): a failure's ``kind`` is a `Kind` value (mismatch, drift, length, score,
inconsistent, recompile, memory, latency, crash, other); a token verdict's ``failure`` holds its fields (``kind``,
``engine``, ``model``, ``prompt``, ``prompt_length``, ``where``: {"index", "lengths", "number", "calls", "before",
"note"}, ``step``, ``expected``, ``got``, ``gap``, ``allowed``, ``tolerance``, ``window``, ``scored``, ``oracle``,
``tokens``, ``prompt_tail``, ``top3``, ``near_ties``, ``max_near_ties``, ``excluded``, ``hint``). A row's ``noise``
with a ``kv_dtype`` is the measured noise of a KV cache stored that way (Declaration.kv_dtype), not the model's.
``problems`` are the run rules that failed (`Problem`: vacuous, no_eviction, run_drift, logit_drift), each naming its
engine in a field. A row's ``scored`` (measured runs, engines declaring score()): distinct scored sequences ->
[positions, those beyond the typical noise] (verdicts/rows.py: RunRate).
Schema 1 files (before typed verdicts) are read and upgraded: a failure's kind comes from its token diff (else
"other"), the diff becomes its ``failure`` (its ``where`` string the note of its ``where``), ``problems`` is empty.
Baselines written by earlier versions keep working.

A row's ``oracle`` (``{"source", "engine", "limitations": [line]}``, oracles/store.py: facts) names what judged its
tokens and what that oracle could not check. ``status`` (reports/live.py) says whether the run completed:
``{"complete", "finished_tests", "running": [{"test", "engine", "model", "call", "served_before", "worker"}],
"crashed": [...]}``; a report of a run that died has ``complete: false`` and names what was running. Readers ignore
it (older files lack it).
``compiles.build`` (dynamo compiles while the engine was built) may be absent in older files (read as 0), and so
may the keys from ``verified_tokens`` to ``versions`` (read as empty; a check's ``failed`` and ``xfailed``
as 0); older files' ``tokens.unverified`` is kept as read.
``latency.prefill``, ``latency.decode`` and ``latency.tokens_per_s`` are derived from the samples for
readers' convenience and recomputed on load. A run with several ``--kv-engine`` has one row per engine
and model; merged files list every source run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pytest_kvcompile.reports.table import latency_stats, tokens_per_s
from pytest_kvcompile.verdicts.failures import Failure, Kind, Where
from pytest_kvcompile.verdicts.rows import new_row

SCHEMA_VERSION = 2
READS = (1, 2)  # schema versions load() accepts; older ones are upgraded (_upgrade_1)
KIND = "pytest-kvcompile-results"
_DERIVED = ("prefill", "decode", "tokens_per_s")
_NESTED = {  # field -> required keys and their types
    "compiles": {"warmup": int, "after_warmup": int, "reasons": list},
    "kv_bytes": {"expected": (int, type(None)), "measured": int},
    "latency": {"prompt_len": int, "decode_tokens": int, "timer": str, "prefill_ms": list, "decode_ms_per_token": list},
    "speculation": {"k": int, "steps": int, "drafted": int, "accepted": int, "lengths": dict},
}


class ResultsFileError(ValueError):
    """A results file cannot be used; the message names the file and the problem."""


def dumps(results: dict[str, Any]) -> str:
    rows = []
    for row in results["rows"]:
        row = dict(row)
        found = latency_stats(row)
        if found:
            row["latency"] = {**row["latency"], "prefill": found[0], "decode": found[1],
                              "tokens_per_s": tokens_per_s(row)}
        rows.append(row)
    found = {"schema_version": SCHEMA_VERSION, "kind": KIND, "runs": results["runs"], "rows": rows,
             "problems": results.get("problems", [])}
    if "status" in results:
        found["status"] = results["status"]
    return json.dumps(found, indent=1)


def load(path: str | Path) -> dict[str, Any]:
    """Read and validate a results file; ResultsFileError names the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ResultsFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultsFileError(f"{path}: not valid JSON ({exc}); give a file written by --kv-report-json") from None
    try:
        return _validated(data)
    except ValueError as exc:
        raise ResultsFileError(f"{path}: {exc}") from None


def _validated(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ValueError(f"not a pytest-kvcompile results file (expected an object with \"kind\": \"{KIND}\")")
    version = data.get("schema_version")
    if version not in READS:
        raise ValueError(f"schema_version {version!r} is not supported (this pytest-kvcompile reads "
                         f"{', '.join(map(str, READS))}); re-create the file with this version's --kv-report-json")
    for key in ("runs", "rows"):
        if not isinstance(data.get(key), list):
            raise ValueError(f"missing key {key!r} (a list)")
    if version == 1:
        data = _upgrade_1(data)
    problems = data.get("problems", [])
    for i, problem in enumerate(problems):
        _require(problem, {"kind": str, "engine": str, "device": str, "dtype": str, "message": str}, f"problems[{i}]")
        _kind(problem["kind"], f"problems[{i}].kind")
    return {"runs": data["runs"], "rows": [_row(row, f"rows[{i}]") for i, row in enumerate(data["rows"])],
            "problems": problems}


def _kind(value: str, where: str) -> None:
    if value not in {k.value for k in Kind}:
        raise ValueError(f"{where}: unknown kind {value!r} (one of {', '.join(k.value for k in Kind)})")


def _upgrade_1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 file as schema 2: each failure's kind from its token diff (else "other"), the diff as its typed
    ``failure``; no run rules were stored (``problems`` empty)."""
    rows = []
    for row in data["rows"]:
        if not isinstance(row, dict) or not isinstance(row.get("failures"), list):
            rows.append(row)  # _row names what is wrong
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
            found = {**failure.to_dict(), "hint": diff.get("hint", "")}  # the hint as written then
            failures.append({"test": old.get("test", ""), "kind": failure.kind.value,
                             "message": old.get("message", ""), "failure": found})
        rows.append({**row, "failures": failures})
    return {**data, "rows": rows, "problems": []}


def _require(obj: Any, spec: dict[str, Any], where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
    for key, kind in spec.items():
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r}")
        if not isinstance(obj[key], kind) or isinstance(obj[key], bool):
            raise ValueError(f"{where}.{key}: wrong type {type(obj[key]).__name__}")


def _row(row: Any, where: str) -> dict[str, Any]:
    template = new_row("", "", "", "")
    _require(row, {"engine": str, "model": str, "device": str, "dtype": str, "tests": dict, "tokens": dict,
                   "near_ties": list, "failures": list}, where)
    for counts in ("tests", "tokens"):
        _require(row[counts], dict.fromkeys(template[counts], int), f"{where}.{counts}")
    for i, failure in enumerate(row["failures"]):
        _require(failure, {"test": str, "kind": str, "message": str}, f"{where}.failures[{i}]")
        _kind(failure["kind"], f"{where}.failures[{i}].kind")
    found = {key: row.get(key, value) for key, value in template.items()}
    for field, spec in _NESTED.items():
        if found[field] is not None:
            _require(found[field], spec, f"{where}.{field}")
            found[field] = {k: v for k, v in found[field].items() if k not in _DERIVED}
    lat = found["latency"]
    if lat is not None:
        for key in ("prefill_ms", "decode_ms_per_token"):
            if not lat[key] or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lat[key]):
                raise ValueError(f"{where}.latency.{key}: expected a non-empty list of numbers")
    return found
