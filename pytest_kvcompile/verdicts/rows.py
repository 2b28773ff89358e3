"""Per-run results, typed: what every engine did on every model (verdicts/record.py: how each field merges, is written).

A *row* (`Row`) holds one (engine, model, device, dtype): test outcomes, token-identity verdicts and near ties, compile
counts with recompile reasons, KV bytes, latency samples. Suites, fixtures and renderers use attributes; nothing outside
these modules reads or writes a report field by string key. Beside the rows: the run's facts (`RunInfo`) and, for a
report written during the run, its status (`Status`: what each process was running). The file: verdicts/results.py; the
collector: verdicts/collect.py; the run-level rules: verdicts/run_rules.py; their lines for people: verdicts/lines.py.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any

from pytest_kvcompile.verdicts.failures import Failure, Kind
from pytest_kvcompile.verdicts.lowered import Lowered
from pytest_kvcompile.verdicts.record import (
    DICT,
    INT,
    LIST,
    NUMBER,
    TEXT,
    MergeError,
    Record,
    _add,
    _count_per_key,
    _either,
    _first,
    _keyed,
    _max,
    _max_per_key,
    _new_failures,
    _records,
    _union,
    _update,
    described,
    rule,
)

OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
TOKEN_VERDICTS = ("identical", "near_tie", "mismatch")


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
    xpassed) and `xfailed` (a known finding absorbed), `skipped` with the first `reason`; `seconds` its setup and
    call took, `engine_s` of them in the engine's generate() calls. Schema-1 files lack `failed` and `xfailed`, older
    files the times (read as 0)."""

    ran: int = rule(_add, 0, types=INT)
    failed: int = rule(_add, 0, types=INT)
    xfailed: int = rule(_add, 0, types=INT)
    skipped: int = rule(_add, 0, types=INT)
    reason: str = rule(_either, "", types=TEXT)
    seconds: float = rule(_add, 0.0, types=NUMBER)
    engine_s: float = rule(_add, 0.0, types=NUMBER)


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


@described('one with an expectation, then the larger measurement')
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


@described('pool the samples (one protocol, else MergeError)')
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


@dataclass
class MeasuredNoise(Record):
    """A row's measured 16-bit noise (oracles/precision.py: Noise.to_dict()), of the model or of a lower KV cache."""

    model: str = rule(None, "", types=TEXT)
    dtype: str = rule(None, "", types=TEXT)
    scale: float = rule(None, 0.0, types=NUMBER)
    max_error: float = rule(None, 0.0, types=NUMBER)
    median_error: float = rule(None, 0.0, types=NUMBER)
    flips: int = rule(None, 0, types=INT)
    positions: int = rule(None, 0, types=INT)
    logit_error: float = rule(None, 0.0, types=NUMBER)
    per_computation: dict[str, dict[str, float]] = rule(None, factory=dict, types=DICT)
    kv_dtype: str | None = rule(None, types=TEXT)
    matmul_inputs: str | None = rule(None, types=TEXT)  # the noise of matmul inputs quantised so (with kv_dtype's)
    beyond: int = rule(None, 0, types=INT)
    spread: float = rule(None, 0.0, types=NUMBER)
    attended: int = rule(None, 0, types=INT)
    long_scale: float = rule(None, 0.0, types=NUMBER)
    limited: bool = rule(None, False, types=(bool,))  # calibrated only as far as a smaller --kv-profile attends
    tolerance: float = rule(None, 0.0, types=NUMBER)
    score_tolerance: float = rule(None, 0.0, types=NUMBER)
    flip_rate: float = rule(None, 0.0, types=NUMBER)
    flip_rate_bound: float = rule(None, 0.0, types=NUMBER)
    factor: float = rule(None, 0.0, types=NUMBER)
    logit_threshold: float | None = rule(None, types=NUMBER)
    beyond_rate: float | None = rule(None, types=NUMBER)
    beyond_rate_bound: float | None = rule(None, types=NUMBER)  # None: a file from before the score() rate
    score_spread: float | None = rule(None, types=NUMBER)
    positions_needed: int | None = rule(None, types=INT)
    routed: bool = rule(None, False, types=(bool,))  # the scale from computations routed as the truth routes (MoE)
    seconds: float = rule(None, 0.0, types=NUMBER)  # the calibration's own wall time where it was measured
    cached: bool = rule(None, False, types=(bool,))  # read from the store (cache dir or recorded references)
    reach: float = rule(None, 0.0, types=NUMBER)  # the rule's position term (Noise.reach; 0: a file from before it)


@dataclass
class RouterNoise(Record):
    """A row's measured routing near-tie rule (oracles/routing.py: RouterNoise.to_dict())."""

    model: str = rule(None, "", types=TEXT)
    dtype: str = rule(None, "", types=TEXT)
    scale: float = rule(None, 0.0, types=NUMBER)
    max_error: float = rule(None, 0.0, types=NUMBER)
    decisions: int = rule(None, 0, types=INT)
    flips: int = rule(None, 0, types=INT)
    factor: float = rule(None, 0.0, types=NUMBER)
    tolerance: float = rule(None, 0.0, types=NUMBER)
    lowered: str = rule(None, "", types=TEXT)  # an engine computing lower as it declares: that computation's


@dataclass
class EvictionNoise(Record):
    """A row's measured eviction near-tie rule (oracles/eviction_noise.py: ScoreNoise.to_dict())."""

    policy: str = rule(None, "", types=TEXT)
    scale: float = rule(None, 0.0, types=NUMBER)
    max_error: float = rule(None, 0.0, types=NUMBER)
    cuts: int = rule(None, 0, types=INT)
    flips: int = rule(None, 0, types=INT)
    tolerance: float = rule(None, 0.0, types=NUMBER)
    factor: float = rule(None, 0.0, types=NUMBER)


@dataclass
class Coverage(Record):
    """The fuzzer's covering walk on one engine and model (run/fuzz.py: Coverage.to_dict())."""

    covered: int = rule(None, 0, types=INT)
    possible: int = rule(None, 0, types=INT)
    parts: dict[str, list[int]] = rule(None, factory=dict, types=DICT)  # way -> [covered, possible]
    calls: int = rule(None, 0, types=INT)
    seconds: float = rule(None, 0.0, types=NUMBER)
    seed: int | None = rule(None, types=INT)  # --kv-fuzz-seed's walk (None: the default walk)


@described('the first, a measured one before one read from the store')
def _measured_noise(a: MeasuredNoise, b: MeasuredNoise) -> MeasuredNoise:
    """One model's calibration per run: where one worker measured it and another read it, the measured one (its
    seconds and `cached` say what this run paid)."""
    return b if a.cached and not b.cached else a


@described('the walk that covered most')
def _coverage(a: Coverage, b: Coverage) -> Coverage:
    """One walk per engine and model in a run; across runs, the one that covered most."""
    return max(a, b, key=lambda x: (x.covered, x.calls))


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
    noise: MeasuredNoise | None = rule(_measured_noise, record=MeasuredNoise)  # 16-bit, or a KV stored lower
    eviction_noise: EvictionNoise | None = rule(_first, record=EvictionNoise)
    router_noise: RouterNoise | None = rule(_first, record=RouterNoise)  # 16-bit, a mixture-of-experts model
    fuzz_coverage: Coverage | None = rule(_coverage, record=Coverage)  # run.fuzz: the covering walk's conditions
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
        """What its measured noise computes below the model's dtype, in words ('': the model's own noise)."""
        return str(Lowered(self.noise.kv_dtype, self.noise.matmul_inputs)) if self.noise else ""

    @property
    def noise_key(self) -> tuple[str, str, str]:
        """(model, dtype, KV storage): rows sharing one measured noise."""
        return self.model, self.dtype, self.kv_stored

    @property
    def eviction_policy(self) -> str:
        return self.eviction_noise.policy if self.eviction_noise else ""


#: Where people see each field of a row: the renderer reading it (module: function). A field written but shown
#: nowhere is a test failure (tests/test_reports.py reads each renderer's source for the attribute).
SHOWN: dict[str, tuple[str, ...]] = {
    "engine": ("reports.table:cells",), "model": ("reports.table:cells",), "device": ("reports.table:cells",),
    "dtype": ("reports.table:cells",), "tests": ("reports.table:cells", "reports.table:verdicts"),
    "tokens": ("reports.table:cells",), "near_ties": ("reports.sections:sections",),
    "verified_tokens": ("verdicts.run_rules:run_problems",), "near_tie_tokens": ("reports.table:cells",),
    "token_checks": ("verdicts.run_rules:run_problems",), "evicting": ("verdicts.run_rules:run_problems",),
    "evictions": ("verdicts.run_rules:run_problems",), "builds": ("reports.sections:sections",),
    "build_s": ("reports.sections:sections", "reports:time_lines"),
    "generate_s": ("reports:ResultsPlugin.pytest_terminal_summary",),
    "declared_skips": ("reports.sections:sections",),
    "excluded_ids": ("reports.table:verdicts",), "excluded_tokens": ("reports.table:verdicts",),
    "oracle_errors": ("reports.table:verdicts",),
    "checks": ("reports.matrix:_cell", "verdicts.run_rules:skipped_everywhere"),
    "versions": ("reports.matrix:build",), "failures": ("reports.sections:sections", "reports.html:_engine_section"),
    "compiles": ("reports.table:cells", "reports.html:_engine_section", "reports.sections:sections"),
    "kv_bytes": ("reports.table:cells", "reports.html:_engine_section"),
    "latency": ("reports.table:cells", "reports.html:_engine_section"),
    "noise": ("verdicts.lines:noise_line", "verdicts.run_rules:run_rates"),
    "eviction_noise": ("verdicts.lines:eviction_noise_line",),
    "router_noise": ("verdicts.lines:router_noise_line",),
    "fuzz_coverage": ("reports.sections:sections",), "speculation": ("reports.sections:sections",),
    "oracle": ("reports.table:verdicts",), "sequences": ("verdicts.run_rules:run_rates",),
    "scored": ("verdicts.run_rules:run_rates",), "concurrency": ("reports.sections:sections",),
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
    command: str = rule(None, "", types=TEXT)  # what ran it: `kvcompile check-engine ...` or `pytest ...`
    suites: str = rule(None, "", types=TEXT)  # the suites' version (verdicts/suite_index.py); "" in older files
    checks: list[str] = rule(None, factory=list, types=LIST)  # every check its suites had, selected or not

    def line(self) -> str:
        """``cpu (x86_64), float32: torch 2.13.0, transformers 5.24.0, engines a, b, started ...``."""
        return (f"{self.device or '?'} ({self.device_name or '?'}), {self.dtype or '?'}: torch {self.torch or '?'}, "
                f"transformers {self.transformers or '?'}, engines {', '.join(self.engines) or '-'}, started "
                f"{self.started or '?'}")

    def facts(self) -> list[tuple[str, Any]]:
        """(name, value) of every fact but the options and the suites' list of checks."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("options", "checks")]

