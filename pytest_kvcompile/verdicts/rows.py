"""Per-run results, typed: what every engine did on every model, for the reports (the one module that knows the
results JSON's keys).

A *row* (`Row`) holds one (engine, model, device, dtype): test outcomes, token-identity verdicts and near ties,
compile counts with recompile reasons, KV bytes, latency samples. Every field is a dataclass field with its merge
rule beside it (`rule(...)`: how two records of the same row combine) and its JSON written and read back here
(`Results.to_json` / `Results.from_json`, schema `SCHEMA_VERSION`; older files are upgraded on read). Suites,
fixtures and renderers use attributes; nothing outside this module reads or writes a report field by string key.

Each process collects rows for the tests it runs. Under pytest-xdist a worker hands its rows to the controller as
JSON in ``config.workeroutput``; only the controller merges them (``pytest_testnodedown``), compares with
``--kv-baseline`` and writes the reports. ``merge`` also joins result files of separate runs (``kvcompile merge``):
counts add up, lists join, latency samples of the same protocol pool, compile counts keep the worst.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import platform
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import pytest

from pytest_kvcompile.config.tolerances import FALSE_ALARM, POWER_MULTIPLE, binomial_tail, power, run_rate_exceeded
from pytest_kvcompile.verdicts.failures import Failure, Kind, Problem, Where

SCHEMA_VERSION = 3
READS = (1, 2, 3)  # schema versions Results.from_json accepts; older ones are upgraded
RESULTS_KIND = "pytest-kvcompile-results"
OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
TOKEN_VERDICTS = ("identical", "near_tie", "mismatch")
WORKER_KEY = "kvcompile_results"  # config.workeroutput key
NOTE = "kvcompile"  # user_properties key of run notes: (category, line)
NEAR_TIES = "near ties accepted as numerics"


class MergeError(ValueError):
    """Two result sets cannot be merged (say why and where)."""


# --- merge rules ---------------------------------------------------------------------------------------------------
def _add(a: Any, b: Any) -> Any:
    return a + b


def _union(a: list, b: list) -> list:
    return list(dict.fromkeys(a + b))


def _first(a: Any, b: Any) -> Any:
    return a


def _max(a: Any, b: Any) -> Any:
    return max(a, b)


def _update(a: dict, b: dict) -> dict:
    """Keyed by sequence: one seen twice (repeated calls, two workers) counts once."""
    return {**a, **b}


def _records(a: Any, b: Any) -> Any:
    """Two records of one type, merged field by field (`Record.merge`)."""
    merged = copy.deepcopy(a)
    merged.merge(b)
    return merged


def _keyed(a: dict, b: dict) -> dict:
    """Records keyed by name: the same key merged field by field, new keys kept."""
    merged = {k: copy.deepcopy(v) for k, v in a.items()}
    for key, found in b.items():
        merged[key] = _records(merged[key], found) if key in merged else copy.deepcopy(found)
    return merged


def _new_failures(a: list, b: list) -> list:
    return a + [f for f in b if f not in a]


def _either(a: Any, b: Any) -> Any:
    return a or b


def _max_per_key(a: dict, b: dict) -> dict:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in {**a, **b}}


def _count_per_key(a: dict, b: dict) -> dict:
    return dict(Counter(a) + Counter(b))


def rule(merge: Callable[[Any, Any], Any] | None, default: Any = None, *, factory: Callable[[], Any] | None = None,
         record: type | None = None, items: str = "", required: bool = False, types: tuple[type, ...] = ()) -> Any:
    """A `Record` field: `merge(a, b)` combines two records' values (None: a key field, equal in both; an optional
    field's None takes the other side); `record`: the field's Record type (with `items` "dict" or "list": a dict or
    list of them); `required`: a results file must have it; `types`: JSON types a plain value may have."""
    meta = {"merge": merge, "record": record, "items": items, "required": required, "types": types}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def rule_name(merge: Callable[[Any, Any], Any] | None) -> str:
    """How a rule merges, in words (the docs' schema tables)."""
    return {None: "key (equal in both)", _add: "sum", _union: "union, in order", _first: "the first",
            _max: "the larger", _update: "union by key (a sequence counts once)", _records: "field by field",
            _keyed: "by key, field by field", _new_failures: "append the new ones", _either: "the first non-empty",
            _max_per_key: "the larger per key", _count_per_key: "sum per key", _larger_kv: "one with an expectation, "
            "then the larger measurement", _pool: "pool the samples (one protocol, else MergeError)",
            _coverage: "the walk that covered most"}[merge]


def _is(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


class Record:
    """A dataclass of the results: merged, written and read field by field from each field's `rule`."""

    def merge(self, other: Record) -> None:
        """Fold `other` (same type) into this record, each field by its rule."""
        for f in dataclasses.fields(self):
            merge, mine, theirs = f.metadata["merge"], getattr(self, f.name), getattr(other, f.name)
            if merge is None or theirs is None:
                continue
            setattr(self, f.name, theirs if mine is None else merge(mine, theirs))

    def to_json(self) -> dict[str, Any]:
        return {f.name: _encode(getattr(self, f.name), f) for f in dataclasses.fields(self)} | self.derived()

    def derived(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_json(cls, data: Any, where: str) -> Any:
        """The record from its JSON; ValueError names `where` and what is wrong. Unknown keys are ignored, missing
        optional ones take their defaults (older files)."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        found = {}
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if f.name not in data:
                if meta["required"]:
                    raise ValueError(f"{where}: missing key {f.name!r}")
                continue
            value, at = data[f.name], f"{where}.{f.name}"
            if value is None:
                found[f.name] = None
            elif meta["record"] is not None:
                kind = meta["record"]
                if meta["items"] == "dict":
                    if not isinstance(value, dict):
                        raise ValueError(f"{at}: wrong type {type(value).__name__}")
                    found[f.name] = {k: kind.from_json(v, f"{at}[{k!r}]") for k, v in value.items()}
                elif meta["items"] == "list":
                    if not isinstance(value, list):
                        raise ValueError(f"{at}: wrong type {type(value).__name__}")
                    found[f.name] = [kind.from_json(v, f"{at}[{i}]") for i, v in enumerate(value)]
                else:
                    found[f.name] = kind.from_json(value, at)
            elif meta["types"] and not _is(value, meta["types"]):
                raise ValueError(f"{at}: wrong type {type(value).__name__}")
            else:
                found[f.name] = copy.deepcopy(value)
        return cls(**found)  # type: ignore[call-arg]


def _encode(value: Any, f: dataclasses.Field) -> Any:
    if value is None or f.metadata["record"] is None:
        return copy.deepcopy(value)
    if f.metadata["items"] == "dict":
        return {k: v.to_json() for k, v in value.items()}
    if f.metadata["items"] == "list":
        return [v.to_json() for v in value]
    return value.to_json()


INT, NUMBER, TEXT, LIST, DICT = (int,), (int, float), (str,), (list,), (dict,)


# --- the records ---------------------------------------------------------------------------------------------------
@dataclass
class Outcomes(Record):
    """Tests of a row by outcome."""

    passed: int = rule(_add, 0, types=INT, required=True)
    failed: int = rule(_add, 0, types=INT, required=True)
    skipped: int = rule(_add, 0, types=INT, required=True)
    xfailed: int = rule(_add, 0, types=INT, required=True)
    xpassed: int = rule(_add, 0, types=INT, required=True)
    error: int = rule(_add, 0, types=INT, required=True)

    @classmethod
    def one(cls, outcome: str) -> Outcomes:
        """One test with this outcome (an OUTCOMES name)."""
        return cls(**{outcome: 1})

    def items(self) -> list[tuple[str, int]]:
        return [(name, getattr(self, name)) for name in OUTCOMES]

    @property
    def ran(self) -> int:
        return sum(n for name, n in self.items() if name != "skipped")


@dataclass
class Tokens(Record):
    """Verified sequences by verdict: identical to the oracle, within near ties, mismatched."""

    identical: int = rule(_add, 0, types=INT, required=True)
    near_tie: int = rule(_add, 0, types=INT, required=True)
    mismatch: int = rule(_add, 0, types=INT, required=True)

    @property
    def checked(self) -> int:
        return self.identical + self.near_tie + self.mismatch


@dataclass
class Check(Record):
    """One test function's outcomes on a row: `ran` (passed, failed, xfailed, xpassed), of which `failed` (failed,
    xpassed) and `xfailed` (a known finding absorbed), `skipped` with the first `reason`. Schema-1 files lack
    `failed` and `xfailed` (read as 0)."""

    ran: int = rule(_add, 0, types=INT)
    failed: int = rule(_add, 0, types=INT)
    xfailed: int = rule(_add, 0, types=INT)
    skipped: int = rule(_add, 0, types=INT)
    reason: str = rule(_either, "", types=TEXT)


@dataclass
class FailureEntry(Record):
    """A failed test of a row: its `kind`, the first lines of its message, and for a token verdict the typed
    failure (verdicts/failures.py), else None."""

    test: str = rule(None, "", types=TEXT, required=True)
    kind: Kind = rule(None, Kind.OTHER, required=True)
    message: str = rule(None, "", types=TEXT, required=True)
    failure: Failure | None = rule(None)

    def __post_init__(self) -> None:
        self.kind = _kind(self.kind, "failure kind")
        if isinstance(self.failure, dict):
            self.failure = Failure.from_dict(self.failure)

    def to_json(self) -> dict[str, Any]:
        return {"test": self.test, "kind": self.kind.value, "message": self.message,
                "failure": self.failure.to_dict() if self.failure else None}

    @classmethod
    def from_json(cls, data: Any, where: str) -> FailureEntry:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
        for key in ("test", "kind", "message"):
            if key not in data:
                raise ValueError(f"{where}: missing key {key!r}")
            if not isinstance(data[key], str):
                raise ValueError(f"{where}.{key}: wrong type {type(data[key]).__name__}")
        typed = data.get("failure")
        return cls(data["test"], _kind(data["kind"], f"{where}.kind"), data["message"],
                   Failure.from_dict(typed) if isinstance(typed, dict) else None)

    @property
    def check(self) -> str:
        """The test function: ``suites/test_x.py::test_y[engine-model]`` -> ``test_y``."""
        return self.test.rpartition("::")[2].partition("[")[0]

    def line(self) -> str:
        """``test (kind): first line of the message``."""
        return f"{self.test} ({self.kind.value}): {self.message.splitlines()[0] if self.message else ''}"


def _kind(value: Any, where: str) -> Kind:
    try:
        return Kind(value)
    except ValueError:
        raise ValueError(f"{where}: unknown kind {value!r} (one of {', '.join(k.value for k in Kind)})") from None


@dataclass
class Compile(Record):
    """One dynamo compile in the recompile check's timeline: its id, frame, whether it recompiled, failed guards."""

    id: str = rule(None, "", types=TEXT)
    frame: str = rule(None, "", types=TEXT)
    recompile: bool = rule(None, False, types=(bool,))
    guards: list[str] = rule(None, factory=list, types=LIST)
    graph_breaks: int = rule(None, 0, types=INT)


@dataclass
class TimelineCall(Record):
    """One phase or call of the recompile check (build, warmup, after warmup) and what it compiled."""

    phase: str = rule(None, "", types=TEXT)
    call: str = rule(None, "", types=TEXT)
    compiles: list[Compile] = rule(None, factory=list, record=Compile, items="list")


@dataclass
class Compiles(Record):
    """A compiled engine's compiles per phase (suites/test_recompiles.py): counts keep the worst, lists join, the
    timeline of the first run that drew one stays."""

    build: int = rule(_max, 0, types=INT)
    warmup: int = rule(_max, 0, types=INT, required=True)
    after_warmup: int = rule(_max, 0, types=INT, required=True)
    reasons: list[str] = rule(_union, factory=list, types=LIST, required=True)
    graph_breaks: list[str] = rule(_union, factory=list, types=LIST)
    eager_runs: int = rule(_max, 0, types=INT)
    #: phase ("build", "warmup", "after_warmup") -> CUDA graphs captured
    cuda_graph_captures: dict[str, int] = rule(_max_per_key, factory=dict, types=DICT)
    timeline: list[TimelineCall] = rule(_either, factory=list, record=TimelineCall, items="list")

    def captures(self, phase: str) -> int:
        """CUDA graphs captured in `phase` ("build", "warmup", "after_warmup")."""
        return self.cuda_graph_captures.get(phase, 0)


@dataclass
class LayerBytes(Record):
    """One layer's expected KV bytes under the declared layout."""

    layer: int = rule(None, 0, types=INT)
    kind: str = rule(None, "", types=TEXT)  # the layer's attention: full, sliding, shared
    positions: int = rule(None, 0, types=INT)
    why: str = rule(None, "", types=TEXT)
    bytes: int = rule(None, 0, types=INT)


def _larger_kv(a: KVBytes, b: KVBytes) -> KVBytes:
    """One (expected, measured) pair: one with an expectation first, then the larger measurement."""
    return max(a, b, key=lambda x: (x.expected is not None, x.measured))


@dataclass
class KVBytes(Record):
    """KV bytes after a call (suites/test_kv_memory.py): `expected` by the declared layout (None: none declared),
    `measured` (reported by kv_cache_bytes(), else held), `held` (tensors the engine object holds), the layout, the
    per-layer expectation and the call."""

    expected: int | None = rule(None, types=INT, required=True)
    measured: int = rule(None, 0, types=INT, required=True)
    held: int | None = rule(None, types=INT)
    layout: str = rule(None, "", types=TEXT)
    layers: list[LayerBytes] = rule(None, factory=list, record=LayerBytes, items="list")
    call: str = rule(None, "", types=TEXT)


def stats(samples: list[float] | tuple[float, ...]) -> Stats:
    """Median and p90 (nearest rank) of latency samples."""
    ordered = sorted(samples)
    return Stats(statistics.median(ordered), ordered[math.ceil(0.9 * len(ordered)) - 1])


@dataclass(frozen=True)
class Stats:
    median: float
    p90: float


def _pool(a: Timings, b: Timings) -> Timings:
    if a.protocol != b.protocol:
        raise MergeError("latency measured with different protocols: "
                         + " vs ".join(str(dict(zip(("prompt_len", "decode_tokens", "timer"), x.protocol)))
                                       for x in (a, b)))
    return Timings(a.prompt_len, a.decode_tokens, a.timer, a.prefill_ms + b.prefill_ms,
                   a.decode_ms_per_token + b.decode_ms_per_token)


def _samples(value: list) -> bool:
    return bool(value) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)


@dataclass
class Timings(Record):
    """Latency samples of one protocol (latency/measure.py): every timed repeat's prefill ms and decode ms per
    token. The JSON also carries their median/p90 and tokens/s (derived, recomputed on read)."""

    prompt_len: int = rule(None, 0, types=INT, required=True)
    decode_tokens: int = rule(None, 0, types=INT, required=True)
    timer: str = rule(None, "", types=TEXT, required=True)
    prefill_ms: list[float] = rule(None, factory=list, types=LIST, required=True)
    decode_ms_per_token: list[float] = rule(None, factory=list, types=LIST, required=True)

    @property
    def protocol(self) -> tuple[int, int, str]:
        return self.prompt_len, self.decode_tokens, self.timer

    @property
    def prefill(self) -> Stats:
        return stats(self.prefill_ms)

    @property
    def decode(self) -> Stats:
        return stats(self.decode_ms_per_token)

    @property
    def tokens_per_s(self) -> float | None:
        return 1e3 / self.decode.median if self.decode.median > 0 else None

    def derived(self) -> dict[str, Any]:
        return {"prefill": dataclasses.asdict(self.prefill), "decode": dataclasses.asdict(self.decode),
                "tokens_per_s": self.tokens_per_s}

    @classmethod
    def from_json(cls, data: Any, where: str) -> Timings:
        found = super().from_json(data, where)
        for name in ("prefill_ms", "decode_ms_per_token"):
            if not _samples(getattr(found, name)):
                raise ValueError(f"{where}.{name}: expected a non-empty list of numbers")
        return found


@dataclass
class Speculation(Record):
    """A speculative engine's verify steps as it reported them (contract/speculative.py: acceptance()): drafts per step
    `k`, `steps`, tokens `drafted` and `accepted` over them, and per "accepted/drafted" how many steps kept that.
    Steps of separate tests add up."""

    k: int = rule(_max, 0, types=INT, required=True)
    steps: int = rule(_add, 0, types=INT, required=True)
    drafted: int = rule(_add, 0, types=INT, required=True)
    accepted: int = rule(_add, 0, types=INT, required=True)
    lengths: dict[str, int] = rule(_count_per_key, factory=dict, types=DICT, required=True)

    def line(self) -> str:
        """Drafted vs accepted, and each acceptance length with its count."""
        lengths = sorted(self.lengths.items(), key=lambda x: tuple(int(n) for n in reversed(x[0].split("/"))))
        share = f"{self.accepted / self.drafted:.0%}" if self.drafted else "-"
        return (f"{self.steps} verify step(s) of up to {self.k} drafts: {self.accepted} of {self.drafted} "
                f"drafted tokens accepted ({share}); accepted/drafted per step: "
                + ", ".join(f"{length} x{count}" for length, count in lengths))


@dataclass
class OracleFacts(Record):
    """What judged a row's tokens (oracles/store.py: facts): its `source`, whether it is an `engine` (else the model's
    own reference), and what it could not check."""

    source: str = rule(_first, "", types=TEXT)
    engine: bool = rule(_first, False, types=(bool,))
    limitations: list[str] = rule(_union, factory=list, types=LIST)


@dataclass
class Round(Record):
    """One round of the concurrency suite: its responses identical to the oracle, within near ties, wrong."""

    identical: int = rule(_add, 0, types=INT)
    near_tie: int = rule(_add, 0, types=INT)
    wrong: int = rule(_add, 0, types=INT)


def _coverage(a: dict, b: dict) -> dict:
    """One walk per engine and model in a run; across runs, the one that covered most."""
    return max(a, b, key=lambda x: (x["covered"], x["calls"]))


@dataclass
class Row(Record):
    """One engine x model x device x dtype of a run (the results JSON's ``rows``). Each field's `rule` says how two
    records of it merge (workers of one run, separate runs)."""

    engine: str = rule(None, "", types=TEXT, required=True)
    model: str = rule(None, "", types=TEXT, required=True)
    device: str = rule(None, "", types=TEXT, required=True)
    dtype: str = rule(None, "", types=TEXT, required=True)
    tests: Outcomes = rule(_records, factory=Outcomes, record=Outcomes, required=True)
    tokens: Tokens = rule(_records, factory=Tokens, record=Tokens, required=True)  # verified sequences
    near_ties: list[str] = rule(_union, factory=list, types=LIST, required=True)
    verified_tokens: int = rule(_add, 0, types=INT)  # engine tokens verified against the oracle
    near_tie_tokens: int = rule(_add, 0, types=INT)  # of which near ties
    token_checks: int = rule(_add, 0, types=INT)  # token-check tests (using kv_oracle) that reported an outcome
    evicting: int = rule(_add, 0, types=INT)  # verified sequences of an evicting strategy
    evictions: int = rule(_add, 0, types=INT)  # cache entries the oracle evicted along them
    builds: int = rule(_add, 0, types=INT)  # engine objects built for the model
    build_s: float = rule(_add, 0.0, types=NUMBER)  # seconds spent building them (--kv-fresh-engine included)
    generate_s: float = rule(_add, 0.0, types=NUMBER)  # seconds its generate() calls took (the rest: the harness)
    declared_skips: list[str] = rule(_union, factory=list, types=LIST)  # why this engine x model could not run
    excluded_ids: list[int] = rule(_union, factory=list, types=LIST)  # ids it declares it never emits (never_emits)
    excluded_tokens: int = rule(_add, 0, types=INT)  # verified steps where the oracle's best was one of them
    oracle_errors: list[str] = rule(_union, factory=list, types=LIST)  # the oracle failed its self-check: no verdict
    checks: dict[str, Check] = rule(_keyed, factory=dict, record=Check, items="dict")  # test function -> Check
    versions: list[str] = rule(_union, factory=list, types=LIST)  # the engine's distributions, "litgpt==0.5.13"
    failures: list[FailureEntry] = rule(_new_failures, factory=list, record=FailureEntry, items="list", required=True)
    compiles: Compiles | None = rule(_records, record=Compiles)
    kv_bytes: KVBytes | None = rule(_larger_kv, record=KVBytes)
    latency: Timings | None = rule(_pool, record=Timings)
    noise: dict[str, Any] | None = rule(_first, types=DICT)  # oracles.precision.Noise.to_dict(): 16-bit, KV lower
    eviction_noise: dict[str, Any] | None = rule(_first, types=DICT)  # oracles.eviction.ScoreNoise.to_dict()
    fuzz_coverage: dict[str, Any] | None = rule(_coverage, types=DICT)  # run.fuzz: the covering walk's conditions
    speculation: Speculation | None = rule(_records, record=Speculation)
    oracle: OracleFacts | None = rule(_records, record=OracleFacts)
    sequences: dict[str, list[int]] = rule(_update, factory=dict, types=DICT)  # key -> [verified tokens, near ties]
    scored: dict[str, list[int]] = rule(_update, factory=dict, types=DICT)  # score()d -> [positions, beyond noise]
    concurrency: dict[str, Round] = rule(_keyed, factory=dict, record=Round, items="dict")  # round -> responses

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.engine, self.model, self.device, self.dtype

    @property
    def where(self) -> str:
        return " / ".join(self.key)

    def merge(self, other: Record) -> None:
        try:
            super().merge(other)
        except MergeError as exc:
            raise MergeError(f"{self.where}: {exc}") from None

    @property
    def kv_stored(self) -> str:
        """The format its measured noise stores K and V in ('' : the model's dtype)."""
        return (self.noise or {}).get("kv_dtype") or ""

    @property
    def noise_key(self) -> tuple[str, str, str]:
        """(model, dtype, KV storage): rows sharing one measured noise."""
        return self.model, self.dtype, self.kv_stored

    @property
    def eviction_policy(self) -> str:
        return (self.eviction_noise or {}).get("policy", "")


#: Where people see each field of a row: the renderer reading it (module: function). A field written but shown
#: nowhere is a test failure (tests/test_reports.py reads each renderer's source for the attribute).
SHOWN: dict[str, tuple[str, ...]] = {
    "engine": ("reports.table:cells",), "model": ("reports.table:cells",), "device": ("reports.table:cells",),
    "dtype": ("reports.table:cells",), "tests": ("reports.table:cells", "reports.table:verdicts"),
    "tokens": ("reports.table:cells",), "near_ties": ("reports.markdown:render", "reports.html:_engine_section"),
    "verified_tokens": ("verdicts.rows:run_problems",), "near_tie_tokens": ("reports.table:cells",),
    "token_checks": ("verdicts.rows:run_problems",), "evicting": ("verdicts.rows:run_problems",),
    "evictions": ("verdicts.rows:run_problems",),
    "builds": ("reports:ResultsPlugin.pytest_terminal_summary",),
    "build_s": ("reports:ResultsPlugin.pytest_terminal_summary",),
    "generate_s": ("reports:ResultsPlugin.pytest_terminal_summary",),
    "declared_skips": ("reports:ResultsPlugin.pytest_terminal_summary",),
    "excluded_ids": ("reports.table:verdicts",), "excluded_tokens": ("reports.table:verdicts",),
    "oracle_errors": ("reports.table:verdicts",),
    "checks": ("reports.matrix:_cell", "verdicts.rows:skipped_everywhere"),
    "versions": ("reports.matrix:build",), "failures": ("reports.markdown:render", "reports.html:_engine_section"),
    "compiles": ("reports.table:cells", "reports.html:_engine_section"),
    "kv_bytes": ("reports.table:cells", "reports.html:_engine_section"),
    "latency": ("reports.table:cells", "reports.html:_engine_section"),
    "noise": ("verdicts.rows:noise_line", "verdicts.rows:run_rates"),
    "eviction_noise": ("verdicts.rows:eviction_noise_line",),
    "fuzz_coverage": ("reports:ResultsPlugin.pytest_terminal_summary", "reports.html:_engine_section"),
    "speculation": ("reports:ResultsPlugin.pytest_terminal_summary", "reports.markdown:render"),
    "oracle": ("reports.table:verdicts",), "sequences": ("verdicts.rows:run_rates",),
    "scored": ("verdicts.rows:run_rates",), "concurrency": ("reports.markdown:render",),
}


def new_row(engine: str, model: str, device: str, dtype: str, **fields: Any) -> Row:
    """A row with `fields` set; an unknown field is a TypeError naming the fields there are."""
    try:
        return Row(engine, model, device, dtype, **fields)
    except TypeError:
        known = [f.name for f in dataclasses.fields(Row)][4:]
        unknown = sorted(set(fields) - set(known))
        raise TypeError(f"not fields of a results row: {unknown}; the fields are {', '.join(known)} "
                        "(verdicts/rows.py: Row)") from None


# --- the run, the live status, the file ------------------------------------------------------------------------------
@dataclass
class Beat(Record):
    """What one process is running: the test, and the engine call in it (None between calls)."""

    test: str = rule(None, "", types=TEXT)
    engine: str | None = rule(None, types=TEXT)
    model: str | None = rule(None, types=TEXT)
    call: str | None = rule(None, types=TEXT)
    served_before: int = rule(None, 0, types=INT)
    worker: str | None = rule(None, types=TEXT)

    def line(self) -> str:
        where = f"engine '{self.engine}' on model '{self.model}'" if self.engine else "no engine"
        call = f", during {self.call} ({self.served_before} call(s) served before it)" if self.call else ""
        return f"{self.test} ({where}{call})"


@dataclass
class Crash(Beat):
    """A process that died (an xdist worker): what its last beat said, and the message."""

    message: str = rule(None, "", types=TEXT)


@dataclass
class Status(Record):
    """Whether the run completed (reports/live.py): tests finished, what was running, processes that died."""

    complete: bool = rule(None, True, types=(bool,))
    finished_tests: int = rule(None, 0, types=INT)
    running: list[Beat] = rule(None, factory=list, record=Beat, items="list")
    crashed: list[Crash] = rule(None, factory=list, record=Crash, items="list")

    def lines(self) -> list[str]:
        """What the reports say first about an unfinished run or a dead process (empty for a complete clean run)."""
        lines = [f"process died: {c.message}" for c in self.crashed]
        if not self.complete:
            running = "; ".join(b.line() for b in self.running) or "between tests"
            lines.insert(0, f"the run has not completed: {self.finished_tests} test(s) finished, running: {running} "
                            "(a report written during the run, or by a run whose process died)")
        return lines


@dataclass
class RunInfo(Record):
    """Versions, device and options of one run (`run_metadata`); merged files list every source run."""

    started: str = rule(None, "", types=TEXT)
    python: str = rule(None, "", types=TEXT)
    platform: str = rule(None, "", types=TEXT)
    torch: str | None = rule(None, types=TEXT)
    transformers: str | None = rule(None, types=TEXT)
    pytest_kvcompile: str | None = rule(None, types=TEXT)
    device: str = rule(None, "", types=TEXT)
    device_name: str = rule(None, "", types=TEXT)
    dtype: str = rule(None, "", types=TEXT)
    engines: list[str] = rule(None, factory=list, types=LIST)
    compile_backend: str | None = rule(None, types=TEXT)
    max_new_tokens: int | None = rule(None, types=INT)
    options: dict[str, Any] = rule(None, factory=dict, types=DICT)

    def line(self) -> str:
        """``cpu (x86_64), float32: torch 2.13.0, transformers 5.24.0, engines a, b, started ...``."""
        return (f"{self.device or '?'} ({self.device_name or '?'}), {self.dtype or '?'}: torch {self.torch or '?'}, "
                f"transformers {self.transformers or '?'}, engines {', '.join(self.engines) or '-'}, started "
                f"{self.started or '?'}")

    def facts(self) -> list[tuple[str, Any]]:
        """(name, value) of every fact but the options."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "options"]


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


# --- collecting -----------------------------------------------------------------------------------------------------
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
            line = f"{at}: near tie at step {tie.step}, {tie.expected} vs {tie.got}, gap {tie.gap:.3g}"
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
    )


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# --- lines for people -----------------------------------------------------------------------------------------------
def coverage_line(found: dict[str, Any]) -> str:
    """The conditions on two consecutive calls the fuzzer's covering walk made true (run/fuzz.py: Coverage)."""
    parts = ", ".join(f"{p} {c}/{n}" for p, (c, n) in found["parts"].items())
    return (f"{found['covered']}/{found['possible']} conditions on two consecutive calls covered ({parts}) in "
            f"{found['calls']} calls, {found['seconds']} s")


def speculation_line(found: Speculation) -> str:
    """A speculative engine's verify steps: drafted vs accepted, and each acceptance length with its count."""
    return found.line()


def concurrency_line(found: dict[str, Round]) -> str:
    """Per round of the concurrency suite, its responses: identical, within near ties, wrong."""
    return "; ".join(f"{label}: {c.identical} identical, {c.near_tie} within near ties, {c.wrong} wrong"
                     for label, c in found.items())


def noise_line(row: Row) -> str:
    """A row's 16-bit rule, or an engine's KV stored lower, as measured (oracles/precision.py: Noise.to_dict())."""
    model, dtype, noise = row.model, row.dtype, row.noise or {}
    if noise.get("kv_dtype"):
        return (f"{model} ({dtype}) with K and V stored as {noise['kv_dtype']} (Declaration.kv_cache_dtype): tie "
                f"tolerance {noise['tolerance']:.3g} ({noise['factor']:g} x noise scale {noise['scale']:.3g}), "
                f"near-tie rate {noise['flip_rate']:.1%} (bound {noise['flip_rate_bound']:.1%}), score() tolerance "
                f"{noise['score_tolerance']:.3g}: what storing the cache that way does to this model's logits, "
                "measured (oracles/precision.py: KVComputation); the engine is held to the larger of these and the "
                "model's own numbers")
    oracle = next(iter(noise["per_computation"].values()), {})
    return (f"{model} ({dtype}): tie tolerance {noise['tolerance']:.3g} "
            f"({noise['factor']:g} x noise scale {noise['scale']:.3g}, or x "
            f"the noise at the position), near-tie rate of equivalent computations {noise['flip_rate']:.1%} (bound "
            f"{noise['flip_rate_bound']:.1%}), score() tolerance {noise['score_tolerance']:.3g} (or "
            f"{noise.get('score_spread', noise['factor']):.3g} x the computations' error at the position); "
            f"judged against float64 "
            f"on the {dtype} weights: transformers' own {dtype} path flips at {oracle.get('flips', 0)}/"
            f"{noise['positions']} calibration positions")


def eviction_noise_line(row: Row) -> str:
    """A row's measured eviction near-tie rule (oracles/eviction.py: ScoreNoise.to_dict())."""
    model, dtype, noise = row.model, row.dtype, row.eviction_noise or {}
    return (f"{model} ({dtype}) {noise['policy']}: eviction near-tie tolerance {noise['tolerance']:.3g} relative "
            f"({noise['factor']:g} x p99 {noise['scale']:.3g} of the score-difference errors of a {dtype} computation "
            f"vs float64 at "
            f"{noise['cuts']} calibration cuts; it kept another set at {noise['flips']})")


def first_lines(text: str, n: int = 4, width: int = 300) -> str:
    return "\n".join(line[:width] for line in text.strip().splitlines()[:n])


# --- run rules ------------------------------------------------------------------------------------------------------
def run_problems(rows: list[Row], max_near_tie_rate: float | None) -> list[Problem]:
    """What fails the run beyond single tests (verdicts/failures.py: Problem, its engine a field): an engine x model
    whose token checks ran but verified no token (vacuous), unless it was skipped for a declared reason or the oracle
    was unreliable; an engine whose near ties per verified token exceed `max_near_tie_rate` over the run (None, 16-bit
    'auto', or an engine declaring a lower kv_cache_dtype: an engine x model whose near ties a correct engine reaches
    with probability < 1e-4 at the measured flip rate, oracles/precision.py)."""
    problems = []
    for row in rows:
        at = dict(engine=row.engine, model=row.model, device=row.device, dtype=row.dtype)
        if row.token_checks and not row.verified_tokens and not row.declared_skips and not row.oracle_errors:
            reasons = sorted({c.reason for c in row.checks.values() if c.reason})
            problems.append(Problem(Kind.VACUOUS, message=(
                f"{row.token_checks} token check(s) ran but no token was verified: a check that cannot apply "
                f"proves nothing (skips: {'; '.join(reasons) or 'none recorded'})"), **at))
        if row.evicting and not row.evictions:
            problems.append(Problem(Kind.NO_EVICTION, message=(
                f"its eviction strategy evicted nothing on any of the {row.evicting} verified sequence(s), so they "
                "proved nothing about eviction (the prompt set adds budget+1 and 2*budget+3 tokens within the model's "
                "position limit: a larger budget cannot be exercised on this model)"), **at))
        spec = row.speculation
        if spec and not 0 < spec.accepted < spec.drafted:
            missing = ("nothing was drafted" if not spec.drafted else "no draft was accepted"
                       if not spec.accepted else "no draft was rejected")
            problems.append(Problem(Kind.VACUOUS, message=(
                f"it declares speculative decoding, but over its {spec.steps} reported verify step(s) {missing}: "
                "the steps proved nothing about keeping accepted drafts and rolling back rejected ones"), **at))
    by_engine: dict[tuple, list[int]] = {}
    for row in rows:
        at = dict(engine=row.engine, model=row.model, device=row.device, dtype=row.dtype)
        for found in run_rates(row, max_near_tie_rate):
            if found.failed:
                problems.append(Problem(found.kind, message=found.failure(), **at))
        if max_near_tie_rate is None or row.kv_stored:  # measured: a RunRate above
            continue
        found = by_engine.setdefault((row.engine, row.device, row.dtype), [0, 0])
        found[0] += row.near_tie_tokens
        found[1] += row.verified_tokens
    for (engine, device, dtype), (ties, verified) in sorted(by_engine.items()):
        if verified and ties / verified > max_near_tie_rate:
            problems.append(Problem(Kind.RUN_DRIFT, engine, device, dtype, message=(
                f"{ties} near ties in {verified} verified tokens ({ties / verified:.1%}) exceed "
                f"--kv-max-near-tie-rate={max_near_tie_rate:g}: numerics drift over the run (the near ties are listed "
                "above)")))
    return problems


#: What makes an engine's numerics noisier than the dtype's own computations: the failing run rules' advice.
NOISIER = ("a KV cache or activations kept in a format coarser than {dtype} (declare Declaration.kv_cache_dtype if "
           "the cache is stored lower on purpose), RoPE angles or the softmax scale computed in {dtype} rather than "
           "float32, softmax or matmul accumulation in {dtype}: compare its attention and cache step by step with "
           "transformers' {dtype} path on the prompt of a near tie")


@dataclass(frozen=True)
class RunRate:
    """A run-level rate of one engine x model where the verdict numbers are measured (16-bit, or a KV cache stored
    lower: oracles/precision.py): `events` in `positions` (of `sequences` distinct sequences: one verified again
    counts once), against the share `measured` of positions where the noisiest equivalent computation shows the same
    event in calibration, and its 97.5% upper bound `bound`. The rule fails where a computation at the bound shows
    this many events with probability (`p_value`) < FALSE_ALARM, as a sequence's near-tie budget does. `power`: the
    chance that an engine POWER_MULTIPLE x as noisy (POWER_MULTIPLE x `measured`) fails it at these positions.

    Near ties (`kind` RUN_DRIFT): the engine's token is not the truth's best, against the flip rate. score() rows
    (LOGIT_DRIFT): its logits are farther from the truth than `threshold` (the computations' median error on the
    truth's top-8 logit differences), against the beyond rate."""

    kind: Kind
    events: int
    positions: int
    sequences: int
    measured: float
    bound: float
    dtype: str
    threshold: float = 0.0
    stored: str = ""  # the format the engine declares it stores K and V in (Declaration.kv_cache_dtype), if lower

    @property
    def computations(self) -> str:
        """Which computations the engine is held to: the model's dtype, with K and V stored as declared."""
        return f"{self.dtype} (K and V stored as {self.stored})" if self.stored else self.dtype

    @property
    def rate(self) -> float:
        return self.events / self.positions if self.positions else 0.0

    @property
    def p_value(self) -> float:
        return binomial_tail(self.positions, self.bound, self.events)

    @property
    def failed(self) -> bool:
        return run_rate_exceeded(self.events, self.positions, self.bound)

    @property
    def power(self) -> float:
        return power(self.positions, self.bound, min(1.0, POWER_MULTIPLE * self.measured))

    @property
    def what(self) -> str:
        if self.kind == Kind.RUN_DRIFT:
            return f"near ties {self.events} in {self.positions} verified positions"
        return (f"score() beyond {self.threshold:.3g} of the truth at {self.events} of {self.positions} scored "
                "positions")

    def line(self) -> str:
        """`what` beside the computations' rate, the p-value and the power, for the report."""
        return (f"{self.what} ({self.sequences} sequences): {self.rate:.2%} vs correct {self.computations} "
                f"computations {self.measured:.2%} (bound {self.bound:.2%}): p = {self.p_value:.2g}"
                f"{f' < {FALSE_ALARM:g}: FAILS' if self.failed else ''}; an engine {POWER_MULTIPLE}x as noisy fails "
                f"here with probability {self.power:.0%}")

    def failure(self) -> str:
        """The failing rule's message: the rates, the p-value, what to try."""
        if self.kind == Kind.RUN_DRIFT:
            found = (f"{self.events} near ties in {self.positions} verified positions ({self.sequences} distinct "
                     f"sequences), {self.rate:.2%}, where correct {self.computations} computations of this model "
                     f"flip at {self.measured:.2%} (bound {self.bound:.2%}; the near ties are listed above)")
        else:
            found = (f"its score() rows are farther than {self.threshold:.3g} (the median error of the "
                     f"{self.computations} computations) from the float64 truth on its top-8 logit differences at "
                     f"{self.events} of {self.positions} scored positions, {self.rate:.2%}, where the noisiest "
                     f"computation is that far at {self.measured:.2%} (bound {self.bound:.2%}): its logits drift "
                     "more than the dtype's computations do, whether or not a token flips")
        return (f"{found}: p = {self.p_value:.2g} < {FALSE_ALARM:g}, numerics noisier than the dtype's own over the "
                f"run; try: {NOISIER.format(dtype=self.stored or self.dtype)}")


def run_rates(row: Row, max_near_tie_rate: float | None = None) -> list[RunRate]:
    """The measured run-level rates of `row` (RunRate): near ties over its distinct verified sequences unless the
    near-tie rate is given (`max_near_tie_rate`, and the engine stores no KV lower), score() rows over its distinct
    scored ones; none without measured noise."""
    noise = row.noise
    if not noise:
        return []
    found = []
    if max_near_tie_rate is None or row.kv_stored:
        distinct = row.sequences.values()
        found.append(RunRate(Kind.RUN_DRIFT, sum(t for _, t in distinct), sum(v for v, _ in distinct), len(distinct),
                             noise["flip_rate"], noise["flip_rate_bound"], row.dtype, stored=row.kv_stored))
    scored = row.scored.values()
    if scored and "beyond_rate_bound" in noise:
        found.append(RunRate(Kind.LOGIT_DRIFT, sum(b for _, b in scored), sum(n for n, _ in scored), len(scored),
                             noise["beyond_rate"], noise["beyond_rate_bound"], row.dtype, noise["logit_threshold"],
                             row.kv_stored))
    return found


def skipped_everywhere(rows: list[Row]) -> list[str]:
    """Checks skipped for every engine and model of the run, with a reason: nothing was checked by them."""
    seen: dict[str, tuple[list[int], set[str]]] = {}
    for row in rows:
        for name, counts in row.checks.items():
            ran, reasons = seen.setdefault(name, ([0], set()))
            ran[0] += counts.ran
            if counts.reason:
                reasons.add(counts.reason)
    lines = []
    for name, (ran, reasons) in sorted(seen.items()):
        if not ran[0] and reasons:
            ordered = sorted(reasons)
            more = f" (and {len(ordered) - 3} more)" if len(ordered) > 3 else ""
            lines.append(f"{name}: {'; '.join(ordered[:3])}{more}")
    return lines
