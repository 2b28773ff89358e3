"""The results file: versioned JSON, written by ``--kv-report-json`` and read by ``--kv-baseline``
and ``kvcompile merge``.

Schema (``schema_version`` 3; every key is a field of a dataclass in verdicts/rows.py, written and read there)::

    {"schema_version": 3, "kind": "pytest-kvcompile-results",
     "runs": [{"started", "python", "platform", "torch", "transformers", "pytest_kvcompile", "device",
               "device_name", "dtype", "engines", "compile_backend", "max_new_tokens", "options",
               "command", "suites", "checks"}, ...],  (what ran it; the suites' version and every check they had)
     "rows": [{"engine", "model", "device", "dtype",
               "tests": {"passed": n, "failed": n, "skipped": n, "xfailed": n, "xpassed": n, "error": n},
               "tokens": {"identical": n, "near_tie": n, "mismatch": n},  (sequences)
               "near_ties": [line], "failures": [{"test", "kind", "message", "failure": null | {...}}],
               "verified_tokens": n, "near_tie_tokens": n, "token_checks": n,
               "declared_skips": [reason], "oracle_errors": [message],
               "excluded_ids": [id], "excluded_tokens": n,  (Declaration.never_emits: ids out of the oracle's choice,
                                                           steps where the oracle's best was one of them)
               "checks": {test function: {"ran": n, "failed": n, "xfailed": n, "skipped": n, "reason": str,
                                          "seconds": x, "engine_s": x}},  (its setup + call, of them generate())
               "versions": ["dist==version"],  (the engine's distributions as built: the conformance matrix)
               "compiles": null | {"build": n, "warmup": n, "after_warmup": n, "reasons": [line],
                                   "graph_breaks": [line], "eager_runs": n, "cuda_graph_captures": {phase: n},
                                   "timeline": [{"phase", "call", "compiles": [{"id", "frame", "recompile",
                                                                              "guards", "graph_breaks"}]}]},
               "kv_bytes": null | {"expected": n | null, "measured": n, "held": n | null, "layout": str,
                                   "layers": [{"layer", "kind", "positions", "why", "bytes"}], "call": str},
               "latency": null | {"prompt_len": n, "decode_tokens": n, "timer": str,
                                  "prefill_ms": [sample], "decode_ms_per_token": [sample],
                                  "prefill": {"median", "p90"}, "decode": {"median", "p90"}, "tokens_per_s": x}}],
     "problems": [{"kind", "engine", "model", "device", "dtype", "message"}]}

Verdicts are typed (verdicts/failures.py): a failure's ``kind`` is a `Kind` value (mismatch, drift, length, score,
inconsistent, recompile, memory, latency, crash, other); a token verdict's ``failure`` holds its fields (``kind``,
``engine``, ``model``, ``prompt``, ``prompt_length``, ``where``: {"index", "lengths", "number", "calls", "before",
"note"}, ``step``, ``expected``, ``got``, ``gap``, ``allowed``, ``tolerance``, ``window``, ``scored``, ``oracle``,
``tokens``, ``prompt_tail``, ``top3``, ``near_ties``, ``max_near_ties``, ``excluded``, ``states``, ``hint``). A row's
``noise`` with a ``kv_dtype`` or ``matmul_inputs`` is the measured noise of computing as the engine declares
(a KV cache stored that way, matmul inputs quantised: Declaration.kv_cache_dtype, matmul_inputs), not the model's.
``problems`` are the run rules that failed (`Problem`: vacuous, no_eviction, run_drift, logit_drift), each naming its
engine in a field. A row's ``scored`` (measured runs, engines declaring score()): distinct scored
sequences -> [positions, those beyond the typical noise] (verdicts/run_rules.py: RunRate).
Schema 2 files read as schema 3 (3 made every row, run and status a typed record; the keys are the same).
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

from pytest_kvcompile.verdicts.results import READS, RESULTS_KIND, SCHEMA_VERSION, Results

KIND = RESULTS_KIND
__all__ = ["KIND", "READS", "SCHEMA_VERSION", "ResultsFileError", "dumps", "kept", "load", "loads"]
KEPT_LINES = 12  # a kept file's failure messages: their first lines (the verdict, where, the diff's head)


class ResultsFileError(ValueError):
    """A results file cannot be used; the message names the file and the problem."""


def dumps(results: Results) -> str:
    return json.dumps(results.to_json(), indent=1)


def kept(results: Results, lines: int = KEPT_LINES) -> Results:
    """`results` as a kept file (docs/results: what the conformance matrix and the engines' pages read): each failure's
    message cut to its first `lines` lines, its typed token failure dropped (the message says it), the near ties listed
    cut to as many (their count stays in ``near_tie_tokens``), no live status. Keeping a kept file changes nothing."""
    trimmed = Results.from_json(results.to_json())
    trimmed.status = None
    for row in trimmed.rows:
        row.near_ties = _cut(row.near_ties, lines, "more")
        for entry in row.failures:
            head = entry.message.splitlines()
            cut = _cut(head, lines, "more lines")
            entry.message = entry.message if cut is head else "\n".join(cut)
            entry.failure = None
    return trimmed


def _cut(items: list[str], lines: int, what: str) -> list[str]:
    """`items`' first `lines` and a line saying how many more; as they are where at most one more (a cut's own)."""
    if len(items) <= lines + 1:
        return items
    return items[:lines] + [f"... ({len(items) - lines} {what} in the full report)"]


def loads(text: str) -> Results:
    """Results from a results file's text; ValueError says what is wrong."""
    return Results.from_json(json.loads(text))


def load(path: str | Path) -> Results:
    """Read and validate a results file; ResultsFileError names the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ResultsFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultsFileError(f"{path}: not valid JSON ({exc}); give a file written by --kv-report-json") from None
    try:
        return Results.from_json(data)
    except ValueError as exc:
        raise ResultsFileError(f"{path}: {exc}") from None
