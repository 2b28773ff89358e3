"""Per-run results: what every engine did on every model, for the reports: JSON-ready dicts typed by `Row`.

A *row* (`Row`) holds one (engine, model, device, dtype): test outcomes, token-identity verdicts and
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
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypedDict

import pytest

from pytest_kvcompile.config.tolerances import FALSE_ALARM, POWER_MULTIPLE, binomial_tail, power, run_rate_exceeded
from pytest_kvcompile.verdicts.failures import Kind, Problem

OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error")
TOKEN_VERDICTS = ("identical", "near_tie", "mismatch")
# summed on merge
COUNTERS = ("verified_tokens", "near_tie_tokens", "token_checks", "evicting", "evictions", "builds", "build_s",
            "excluded_tokens")
WORKER_KEY = "kvcompile_results"  # config.workeroutput key
NOTE = "kvcompile"  # user_properties key of run notes: (category, line)
NEAR_TIES = "near ties accepted as numerics"


class FailureEntry(TypedDict):
    """A failed test of a row: its kind (a `Kind` value), the first lines of its message, and for a token verdict
    the typed failure (`Failure.to_dict()`, verdicts/failures.py), else None."""

    test: str
    kind: str
    message: str
    failure: dict[str, Any] | None


class Compiles(TypedDict, total=False):
    """A compiled engine's compiles per phase (suites/test_recompiles.py), each key merged by `COMPILES_MERGE`."""

    build: int
    warmup: int
    after_warmup: int
    reasons: list[str]
    graph_breaks: list[str]
    eager_runs: int
    cuda_graph_captures: dict[str, int]  # phase ("build", "warmup", "after_warmup") -> CUDA graphs captured
    timeline: list[dict[str, Any]]


class KVBytes(TypedDict):
    expected: int | None
    measured: int


class Speculation(TypedDict):
    """A speculative engine's verify steps as it reported them (contract/speculative.py: acceptance()): drafts per step
    `k`, `steps`, tokens `drafted` and `accepted` over them, and per "accepted/drafted" how many steps kept that."""

    k: int
    steps: int
    drafted: int
    accepted: int
    lengths: dict[str, int]


class Check(TypedDict, total=False):
    """One test function's outcomes on a row: `ran` (passed, failed, xfailed, xpassed), of which `failed` (failed,
    xpassed) and `xfailed` (a known finding absorbed), `skipped` with the first `reason`. Schema-1 files lack
    `failed` and `xfailed` (read as 0)."""

    ran: int
    failed: int
    xfailed: int
    skipped: int
    reason: str


class Row(TypedDict):
    """One engine x model x device x dtype of a run (the results JSON's ``rows``, reports/json_file.py)."""

    engine: str
    model: str
    device: str
    dtype: str
    tests: dict[str, int]  # OUTCOMES -> count
    tokens: dict[str, int]  # TOKEN_VERDICTS -> verified sequences
    near_ties: list[str]
    verified_tokens: int
    near_tie_tokens: int
    token_checks: int
    evicting: int
    evictions: int
    builds: int
    build_s: float
    declared_skips: list[str]
    excluded_ids: list[int]
    excluded_tokens: int
    oracle_errors: list[str]
    checks: dict[str, Check]
    versions: list[str]
    failures: list[FailureEntry]
    compiles: Compiles | None
    kv_bytes: KVBytes | None
    latency: dict[str, Any] | None  # latency.measure.Latency.as_dict()
    noise: dict[str, Any] | None  # oracles.precision.Noise.to_dict()
    eviction_noise: dict[str, Any] | None  # oracles.eviction.ScoreNoise.to_dict()
    fuzz_coverage: dict[str, Any] | None  # run.fuzz.Coverage
    speculation: Speculation | None
    oracle: dict[str, Any] | None  # {"source", "engine", "limitations"}
    sequences: dict[str, list[int]]
    scored: dict[str, list[int]]  # distinct scored sequences -> [positions, beyond the typical noise] (RunRate)
    concurrency: dict[str, dict[str, int]]  # round ("alone", "N=4", ...) -> responses: identical, near_tie, wrong


class MergeError(ValueError):
    """Two result sets cannot be merged (say why and where)."""


def new_row(engine: str, model: str, device: str, dtype: str) -> Row:
    return {
        "engine": engine, "model": model, "device": device, "dtype": dtype,
        "tests": dict.fromkeys(OUTCOMES, 0),
        "tokens": dict.fromkeys(TOKEN_VERDICTS, 0),
        "near_ties": [],
        "verified_tokens": 0,  # engine tokens verified against the oracle
        "near_tie_tokens": 0,  # of which near ties
        "token_checks": 0,  # token-check tests (tests using kv_oracle) that reported an outcome
        "evicting": 0,  # verified sequences of an evicting strategy
        "evictions": 0,  # cache entries the oracle evicted along them
        "builds": 0,  # engine objects built for the model
        "build_s": 0.0,  # seconds spent building the engine for the model (every build, --kv-fresh-engine included)
        "declared_skips": [],  # why this engine x model could not run: ModelNotSupported, device/dtype, no oracle
        "excluded_ids": [],  # ids out of the oracle's choice: the engine declares it never emits them (never_emits)
        "excluded_tokens": 0,  # verified steps where the oracle's best was one of them (chosen among the others)
        "oracle_errors": [],  # the oracle failed its self-check on this model: no verdict on the engine
        "checks": {},  # test function -> Check: {"ran", "failed", "xfailed", "skipped": n, "reason": first skip reason}
        "versions": [],  # the engine's distributions as built here, e.g. "litgpt==0.5.13" (registry.versions)
        "failures": [],  # {"test": nodeid, "kind": Kind, "message": first lines, "failure": Failure.to_dict() | None}
        "compiles": None,  # {"build", "warmup", "after_warmup", "reasons": [str], "graph_breaks": [str], "eager_runs"}
        "kv_bytes": None,  # {"expected": int | None, "measured": int}
        "latency": None,  # see latency.Latency.as_dict()
        "noise": None,  # 16-bit runs: the model's measured noise and the verdict numbers from it (oracles/precision.py)
        "eviction_noise": None,  # 16-bit runs of a scoring eviction policy: its cuts' noise (oracles/eviction.py)
        "fuzz_coverage": None,  # --kv-fuzz: conditions on two consecutive calls the covering walk made (run/fuzz.py)
        "speculation": None,  # a speculative engine's reported verify steps (suites/test_speculative.py)
        "oracle": None,  # {"source", "engine": an engine oracle, "limitations": [str]} (oracles/store.py: facts)
        "sequences": {},  # distinct verified sequences (key of prompt + engine tokens) -> [verified tokens, near ties]
        "scored": {},  # measured runs: distinct score()d sequences -> [positions, beyond the typical noise] (RunRate)
        "concurrency": {},  # suites/test_concurrency.py: round -> {"identical", "near_tie", "wrong"} responses
    }


def row_key(row: Row) -> tuple[str, str, str, str]:
    return row["engine"], row["model"], row["device"], row["dtype"]


def _union(a: list, b: list) -> list:
    return list(dict.fromkeys(a + b))


#: How two records of one engine x model's compiles merge, per key of `Compiles` (every key has a rule: a key
#: written by a suite but missing here would be dropped, tests/test_reports.py checks it): counts keep the worst,
#: lists join, the timeline of the first run that drew one stays.
COMPILES_MERGE = {
    "build": max, "warmup": max, "after_warmup": max, "eager_runs": max,
    "reasons": _union, "graph_breaks": _union,
    "cuda_graph_captures": lambda a, b: {p: max(a.get(p, 0), b.get(p, 0)) for p in {**a, **b}},
    "timeline": lambda a, b: a or b,
}


def _merge_compiles(a, b):
    unknown = (set(a) | set(b)) - set(COMPILES_MERGE)
    if unknown:
        raise MergeError(f"compiles record has keys with no merge rule: {sorted(unknown)} (verdicts/rows.py: "
                         "COMPILES_MERGE)")
    return {key: rule(a[key], b[key]) if key in a and key in b else a.get(key, b.get(key))
            for key, rule in COMPILES_MERGE.items() if key in a or key in b}


def _merge_kv_bytes(a, b):
    """Keep one (expected, measured) pair: one with an expectation first, then the larger measurement."""
    return max(a, b, key=lambda x: (x["expected"] is not None, x["measured"]))


def _merge_speculation(a, b):
    """Steps of separate tests add up."""
    lengths = Counter(a["lengths"]) + Counter(b["lengths"])
    return {**{n: a[n] + b[n] for n in ("steps", "drafted", "accepted")}, "k": max(a["k"], b["k"]),
            "lengths": dict(lengths)}


def _merge_latency(a, b):
    protocol = ("prompt_len", "decode_tokens", "timer")
    if any(a[k] != b[k] for k in protocol):
        raise MergeError("latency measured with different protocols: "
                         + " vs ".join(str({k: x[k] for k in protocol}) for x in (a, b)))
    return {**a, "prefill_ms": a["prefill_ms"] + b["prefill_ms"],
            "decode_ms_per_token": a["decode_ms_per_token"] + b["decode_ms_per_token"]}


_OPTIONAL = {"compiles": _merge_compiles, "kv_bytes": _merge_kv_bytes, "latency": _merge_latency,
             # one measurement per model and dtype: the same in every worker
             "noise": lambda a, b: a, "eviction_noise": lambda a, b: a,
             "oracle": lambda a, b: {**a, "limitations": list(dict.fromkeys(a["limitations"] + b["limitations"]))},
             # one walk per engine and model in a run; across runs, the one that covered most
             "fuzz_coverage": lambda a, b: max(a, b, key=lambda x: (x["covered"], x["calls"])),
             "speculation": _merge_speculation}


def merge_row(into: Row, row: Row) -> None:
    """Fold `row` into `into` (same key)."""
    for counts in ("tests", "tokens"):
        for name, n in row[counts].items():
            into[counts][name] = into[counts].get(name, 0) + n
    for name in COUNTERS:
        into[name] = into.get(name, 0) + row.get(name, 0)
    for name in ("near_ties", "declared_skips", "oracle_errors", "excluded_ids"):
        into[name] = list(dict.fromkeys(into.get(name, []) + row.get(name, [])))
    for name, seen in row.get("checks", {}).items():
        mine = into.setdefault("checks", {}).setdefault(name, {"ran": 0, "failed": 0, "xfailed": 0, "skipped": 0,
                                                               "reason": ""})
        for count in ("ran", "failed", "xfailed", "skipped"):
            mine[count] = mine.get(count, 0) + seen.get(count, 0)
        mine["reason"] = mine["reason"] or seen["reason"]
    into["versions"] = list(dict.fromkeys(into.get("versions", []) + row.get("versions", [])))
    into["failures"] += [f for f in row["failures"] if f not in into["failures"]]
    for name in ("sequences", "scored"):  # keyed by sequence: one verified twice, or in two workers, counts once
        into[name] = {**into.get(name, {}), **row.get(name, {})}
    for label, counts in row.get("concurrency", {}).items():
        mine = into.setdefault("concurrency", {}).setdefault(label, {})
        for name, n in counts.items():
            mine[name] = mine.get(name, 0) + n
    for field, merge in _OPTIONAL.items():
        if row.get(field) is not None:
            try:
                into[field] = row[field] if into.get(field) is None else merge(into[field], row[field])
            except MergeError as exc:
                raise MergeError(f"{' / '.join(row_key(row))}: {exc}") from None


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One results dict from several (workers of one run, or separate runs): runs are listed, rows merged, the run
    rules that failed in any of them kept."""
    rows: dict[tuple, Row] = {}
    runs, problems = [], []
    for result in results:
        runs += result["runs"]
        problems += [p for p in result.get("problems", []) if p not in problems]
        for row in result["rows"]:
            key = row_key(row)
            if key in rows:
                merge_row(rows[key], row)
            else:
                rows[key] = copy.deepcopy(row)
    return {"runs": runs, "rows": [rows[k] for k in sorted(rows)], "problems": problems}


def coverage_line(found: dict[str, Any]) -> str:
    """The conditions on two consecutive calls the fuzzer's covering walk made true (run/fuzz.py: Coverage)."""
    parts = ", ".join(f"{p} {c}/{n}" for p, (c, n) in found["parts"].items())
    return (f"{found['covered']}/{found['possible']} conditions on two consecutive calls covered ({parts}) in "
            f"{found['calls']} calls, {found['seconds']} s")


def speculation_line(found: Speculation) -> str:
    """A speculative engine's verify steps: drafted vs accepted, and each acceptance length with its count."""
    lengths = sorted(found["lengths"].items(), key=lambda x: tuple(int(n) for n in reversed(x[0].split("/"))))
    share = f"{found['accepted'] / found['drafted']:.0%}" if found["drafted"] else "-"
    return (f"{found['steps']} verify step(s) of up to {found['k']} drafts: {found['accepted']} of {found['drafted']} "
            f"drafted tokens accepted ({share}); accepted/drafted per step: "
            + ", ".join(f"{length} x{count}" for length, count in lengths))


def concurrency_line(found: dict[str, dict[str, int]]) -> str:
    """Per round of the concurrency suite, its responses: identical, within near ties, wrong."""
    return "; ".join(f"{label}: {c.get('identical', 0)} identical, {c.get('near_tie', 0)} within near ties, "
                     f"{c.get('wrong', 0)} wrong" for label, c in found.items())


def stats(samples: list[float] | tuple[float, ...]) -> dict[str, float]:
    """Median and p90 (nearest rank) of latency samples."""
    ordered = sorted(samples)
    return {"median": statistics.median(ordered), "p90": ordered[math.ceil(0.9 * len(ordered)) - 1]}


def run_metadata(config: pytest.Config, settings: Any) -> dict[str, Any]:
    """Versions, device and options of this run (`settings`: the run's options.Settings). Imports torch only for
    a CUDA device's name: a run that used no kvcompile feature never loads it."""
    device_name = platform.processor() or platform.machine()
    if settings.device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            device_name = torch.cuda.get_device_name(torch.device(settings.device))
    options = {name: value for name, value in vars(config.option).items()
               if name.startswith("kv_") and value not in (None, [], False)}
    return {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": sys.modules["torch"].__version__ if "torch" in sys.modules else _version("torch"),
        "transformers": _version("transformers"),
        "pytest_kvcompile": _version("pytest-kvcompile"),
        "device": settings.device,
        "device_name": device_name,
        "dtype": settings.dtype,
        "engines": list(settings.engines),
        "compile_backend": settings.compile_backend,
        "max_new_tokens": settings.max_new_tokens,
        "options": {k: v if isinstance(v, (bool, int, float))
                    else str(v) if not isinstance(v, list) else [str(x) for x in v]
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
        """Merge measured fields (compiles=..., kv_bytes=..., latency=..., tokens=..., near_ties=...) into a row."""
        row = new_row(engine, model, self.device, self.dtype)
        row.update(fields)
        merge_row(self.row(engine, model), row)
        if self.pending is not None:
            key = row_key(row)
            merge_row(self.pending.setdefault(key, new_row(*key)), copy.deepcopy(row))

    def drain(self) -> dict[str, Any]:
        """The rows add() merged since the last drain (a results dict to `merge`), then forget them."""
        found, self.pending = self.pending or {}, {} if self.pending is not None else None
        return {"runs": [], "rows": [found[k] for k in sorted(found)]}

    def as_dict(self) -> dict[str, Any]:
        return {"runs": [], "rows": [self.rows[k] for k in sorted(self.rows)]}



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
            self.metric(tokens={"mismatch": 1}, verified_tokens=verified)
            return
        if sequence:
            self.metric(sequences={sequence: [verified, len(verdict.near_ties)]})
        for tie in verdict.near_ties:
            line = f"{at}: near tie at step {tie.step}, {tie.expected} vs {tie.got}, gap {tie.gap:.3g}"
            self(NEAR_TIES, line, near_ties=[line])
        evictions = {} if evicted is None else {"evictions": evicted, "evicting": 1}
        self.metric(tokens={"near_tie" if verdict.near_ties else "identical": 1}, verified_tokens=verified,
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


def run_problems(rows: list[Row], max_near_tie_rate: float | None) -> list[Problem]:
    """What fails the run beyond single tests (verdicts/failures.py: Problem, its engine a field): an engine x model
    whose token checks ran but verified no token (vacuous), unless it was skipped for a declared reason or the oracle
    was unreliable; an engine whose near ties per verified token exceed `max_near_tie_rate` over the run (None, 16-bit
    'auto', or an engine declaring a lower kv_dtype: an engine x model whose near ties a correct engine reaches with
    probability < 1e-4 at the measured flip rate, oracles/precision.py)."""
    problems = []
    for row in rows:
        at = dict(engine=row["engine"], model=row["model"], device=row["device"], dtype=row["dtype"])
        if row.get("token_checks") and not row.get("verified_tokens") and not row.get("declared_skips") \
                and not row.get("oracle_errors"):
            reasons = sorted({c["reason"] for c in row.get("checks", {}).values() if c["reason"]})
            problems.append(Problem(Kind.VACUOUS, message=(
                f"{row['token_checks']} token check(s) ran but no token was verified: a check that cannot apply "
                f"proves nothing (skips: {'; '.join(reasons) or 'none recorded'})"), **at))
        if row.get("evicting") and not row.get("evictions"):
            problems.append(Problem(Kind.NO_EVICTION, message=(
                f"its eviction strategy evicted nothing on any of the {row['evicting']} verified sequence(s), so they "
                "proved nothing about eviction (the prompt set adds budget+1 and 2*budget+3 tokens within the model's "
                "position limit: a larger budget cannot be exercised on this model)"), **at))
        spec = row.get("speculation")
        if spec and not 0 < spec["accepted"] < spec["drafted"]:
            missing = ("nothing was drafted" if not spec["drafted"] else "no draft was accepted"
                       if not spec["accepted"] else "no draft was rejected")
            problems.append(Problem(Kind.VACUOUS, message=(
                f"it declares speculative decoding, but over its {spec['steps']} reported verify step(s) {missing}: "
                "the steps proved nothing about keeping accepted drafts and rolling back rejected ones"), **at))
    by_engine: dict[tuple, list[int]] = {}
    for row in rows:
        at = dict(engine=row["engine"], model=row["model"], device=row["device"], dtype=row["dtype"])
        for found in run_rates(row, max_near_tie_rate):
            if found.failed:
                problems.append(Problem(found.kind, message=found.failure(), **at))
        if max_near_tie_rate is None or (row.get("noise") or {}).get("kv_dtype"):  # measured: a RunRate above
            continue
        found = by_engine.setdefault((row["engine"], row["device"], row["dtype"]), [0, 0])
        found[0] += row.get("near_tie_tokens", 0)
        found[1] += row.get("verified_tokens", 0)
    for (engine, device, dtype), (ties, verified) in sorted(by_engine.items()):
        if verified and ties / verified > max_near_tie_rate:
            problems.append(Problem(Kind.RUN_DRIFT, engine, device, dtype, message=(
                f"{ties} near ties in {verified} verified tokens ({ties / verified:.1%}) exceed "
                f"--kv-max-near-tie-rate={max_near_tie_rate:g}: numerics drift over the run (the near ties are listed "
                "above)")))
    return problems


#: What makes an engine's numerics noisier than the dtype's own computations: the failing run rules' advice.
NOISIER = ("a KV cache or activations kept in a format coarser than {dtype} (declare Declaration.kv_dtype if the cache "
           "is stored lower on purpose), RoPE angles or the softmax scale computed in {dtype} rather than float32, "
           "softmax or matmul accumulation in {dtype}: compare its attention and cache step by step with transformers' "
           "{dtype} path on the prompt of a near tie")


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
        return (f"{self.what} ({self.sequences} sequences): {self.rate:.2%} vs correct {self.dtype} computations "
                f"{self.measured:.2%} (bound {self.bound:.2%}): p = {self.p_value:.2g}"
                f"{f' < {FALSE_ALARM:g}: FAILS' if self.failed else ''}; an engine {POWER_MULTIPLE}x as noisy fails "
                f"here with probability {self.power:.0%}")

    def failure(self) -> str:
        """The failing rule's message: the rates, the p-value, what to try."""
        if self.kind == Kind.RUN_DRIFT:
            found = (f"{self.events} near ties in {self.positions} verified positions ({self.sequences} distinct "
                     f"sequences), {self.rate:.2%}, where correct {self.dtype} computations of this model flip at "
                     f"{self.measured:.2%} (bound {self.bound:.2%}; the near ties are listed above)")
        else:
            found = (f"its score() rows are farther than {self.threshold:.3g} (the median error of the {self.dtype} "
                     f"computations) from the float64 truth on its top-8 logit differences at {self.events} of "
                     f"{self.positions} scored positions, {self.rate:.2%}, where the noisiest computation is that "
                     f"far at {self.measured:.2%} (bound {self.bound:.2%}): its logits drift more than the dtype's "
                     "computations do, whether or not a token flips")
        return (f"{found}: p = {self.p_value:.2g} < {FALSE_ALARM:g}, numerics noisier than the dtype's own over the "
                f"run; try: {NOISIER.format(dtype=self.dtype)}")


def run_rates(row: Row, max_near_tie_rate: float | None = None) -> list[RunRate]:
    """The measured run-level rates of `row` (RunRate): near ties over its distinct verified sequences unless the
    near-tie rate is given (`max_near_tie_rate`, and the engine stores no KV lower), score() rows over its distinct
    scored ones; none without measured noise."""
    noise = row.get("noise")
    if not noise:
        return []
    found = []
    if max_near_tie_rate is None or noise.get("kv_dtype"):
        distinct = row.get("sequences", {}).values()
        found.append(RunRate(Kind.RUN_DRIFT, sum(t for _, t in distinct), sum(v for v, _ in distinct), len(distinct),
                             noise["flip_rate"], noise["flip_rate_bound"], row["dtype"]))
    scored = row.get("scored", {}).values()
    if scored and "beyond_rate_bound" in noise:
        found.append(RunRate(Kind.LOGIT_DRIFT, sum(b for _, b in scored), sum(n for n, _ in scored), len(scored),
                             noise["beyond_rate"], noise["beyond_rate_bound"], row["dtype"], noise["logit_threshold"]))
    return found


def skipped_everywhere(rows: list[Row]) -> list[str]:
    """Checks skipped for every engine and model of the run, with a reason: nothing was checked by them."""
    seen: dict[str, dict[str, Any]] = {}
    for row in rows:
        for name, counts in row.get("checks", {}).items():
            mine = seen.setdefault(name, {"ran": 0, "reasons": set()})
            mine["ran"] += counts["ran"]
            if counts["reason"]:
                mine["reasons"].add(counts["reason"])
    lines = []
    for name, found in sorted(seen.items()):
        if not found["ran"] and found["reasons"]:
            reasons = sorted(found["reasons"])
            more = f" (and {len(reasons) - 3} more)" if len(reasons) > 3 else ""
            lines.append(f"{name}: {'; '.join(reasons[:3])}{more}")
    return lines


def first_lines(text: str, n: int = 4, width: int = 300) -> str:
    return "\n".join(line[:width] for line in text.strip().splitlines()[:n])
