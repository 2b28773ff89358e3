"""Prefill and decode latency of an engine, and ``@pytest.mark.latency_budget``.

Engines only expose ``generate(prompts, max_new_tokens)``, so latency is derived from two calls
on one prompt of ``PROMPT_LEN`` tokens, batch of one:

- ``prefill_ms``          = time(generate([prompt], 1))  (the prompt's forward plus one token)
- ``decode_ms_per_token`` = (time(generate([prompt], 1 + K)) - time(generate([prompt], 1))) / K

with K = ``DECODE_TOKENS``. Per-call overheads (cache allocation, Python, output conversion)
cancel out of the decode difference. ``WARMUP`` untimed calls of each kind come first (compiled
engines compile there), then N repeats (``--kv-latency-repeats``); the median and p90 (nearest
rank) over the repeats are reported and budgets are checked against the median. Timing is CUDA
events around the call on a CUDA device, ``time.perf_counter`` on CPU. Engines measured side by
side (a relative budget) alternate call by call within each repeat, so load changes hit both.

A median <= 0 (the difference lost in noise) never meets an absolute budget.
Budgets: absolute ones (``prefill_ms``, ``decode_ms_per_token``) are enforced on CUDA; on CPU
they are recorded and listed in the terminal summary but enforced only with
``--kv-enforce-latency`` (shared CPU runners are too noisy for absolute numbers). Relative ones
(``relative_to=ENGINE, factor=F``: no slower than F x that engine, measured side by side in the
same test) are enforced everywhere.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import pytest
import torch

from pytest_kvcompile.run.harness import EngineUnderTest
from pytest_kvcompile.run.markers import bind, validated_at_collection, written
from pytest_kvcompile.models.prompts import of_length
from pytest_kvcompile.reports.results import stats

PROMPT_LEN = 32
DECODE_TOKENS = 8
WARMUP = 2
MARKER = "latency_budget"
FIXTURE = "kv_latency"
ENFORCE = "--kv-enforce-latency"
REPEATS = "--kv-latency-repeats"
BUDGET = "--kv-latency-budget"
NOT_ENFORCED = "latency budgets exceeded, not enforced on CPU (pass --kv-enforce-latency to enforce)"


def latency_budget(*, prefill_ms: float | None = None, decode_ms_per_token: float | None = None,
                   relative_to: str | None = None, factor: float | None = None) -> None:
    """the test's kv_latency measurements must meet these budgets: prefill_ms and decode_ms_per_token
    are absolute medians in milliseconds (enforced on CUDA; on CPU only with --kv-enforce-latency);
    relative_to=ENGINE with factor=F: prefill and decode no slower than F x ENGINE on the same model,
    measured side by side in the same test (enforced everywhere)."""


_SIGNATURE = inspect.signature(latency_budget)
_USAGE = f"@pytest.mark.{MARKER}({', '.join(f'{n}=...' for n in _SIGNATURE.parameters)})"


@dataclass(frozen=True)
class Budget:
    prefill_ms: float | None = None
    decode_ms_per_token: float | None = None
    relative_to: str | None = None
    factor: float | None = None


def validate(args: tuple, kwargs: dict, where: str) -> Budget:
    """A Budget from marker (or option) arguments; ValueError naming the fix."""
    values = bind(_SIGNATURE, args, kwargs, where, _USAGE).arguments
    for name in ("prefill_ms", "decode_ms_per_token", "factor"):
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{where}: {name} must be a number > 0, got {value!r}")
    relative_to, factor = values.get("relative_to"), values.get("factor")
    if relative_to is not None and (not isinstance(relative_to, str) or not relative_to):
        raise ValueError(f"{where}: relative_to must be an engine name such as 'hf-eager', got {relative_to!r}")
    if (relative_to is None) != (factor is None):
        raise ValueError(f"{where}: relative_to and factor go together, e.g. relative_to='hf-eager', factor=1.1")
    if not values:
        raise ValueError(f"{where}: give at least one budget: {_USAGE}")
    return Budget(**values)


def parse_spec(spec: str, where: str) -> Budget:
    """``--kv-latency-budget`` syntax: the marker's keywords, comma-separated, e.g.
    ``relative_to=hf-eager,factor=1.1`` or ``decode_ms_per_token=5,prefill_ms=40``."""
    kwargs = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{where}: {part!r} is not NAME=VALUE; e.g. relative_to=hf-eager,factor=1.1")
        try:
            kwargs[name.strip()] = value.strip() if name.strip() == "relative_to" else float(value)
        except ValueError:
            raise ValueError(f"{where}: {name.strip()}={value!r} is not a number") from None
    return validate((), kwargs, where)


def budget_of(item: pytest.Item) -> Budget | None:
    """The item's validated marker budget (None: not marked); ValueError names the fix."""
    mark = item.get_closest_marker(MARKER)
    if mark is None:
        return None
    where = written(mark)
    if FIXTURE not in getattr(item, "fixturenames", ()):
        raise ValueError(f"{where}: the test must take the {FIXTURE} fixture and call {FIXTURE}.measure()")
    return validate(mark.args, mark.kwargs, where)


# --- measuring --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Latency:
    engine: str
    model: str
    prompt_len: int
    decode_tokens: int
    timer: str
    prefill_ms: tuple[float, ...]
    decode_ms_per_token: tuple[float, ...]

    @property
    def prefill(self) -> dict[str, float]:
        return stats(self.prefill_ms)

    @property
    def decode(self) -> dict[str, float]:
        return stats(self.decode_ms_per_token)

    def as_dict(self) -> dict:
        found = asdict(self)
        del found["engine"], found["model"]
        return {**found, "prefill_ms": list(self.prefill_ms), "decode_ms_per_token": list(self.decode_ms_per_token)}


def timer_for(device: str) -> tuple[str, Callable[[Callable[[], object]], float]]:
    """(name, time_ms(fn)): CUDA events on a CUDA device, perf_counter elsewhere."""
    if torch.device(device).type == "cuda":
        if not torch.cuda.is_available():
            pytest.skip(f"latency on device '{device}' needs CUDA, which this torch does not have")

        def cuda_ms(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return "cuda-events", cuda_ms

    def cpu_ms(fn):
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3

    return "perf_counter", cpu_ms


def measure(engines: Sequence[EngineUnderTest], repeats: int, prompt_len: int = PROMPT_LEN,
            decode_tokens: int = DECODE_TOKENS) -> list[Latency]:
    """Latency of each engine (same model) per the module's rule, measured side by side."""
    spec = engines[0].spec
    prompt = of_length(prompt_len, spec.vocab_size, salt=5)
    name, time_ms = timer_for(spec.device)
    for eut in engines:  # validated calls: a broken engine fails here with a clear message
        for _ in range(WARMUP):
            eut.generate([prompt], 1)
            eut.generate([prompt], 1 + decode_tokens)
    prefill: list[list[float]] = [[] for _ in engines]
    decode: list[list[float]] = [[] for _ in engines]
    for _ in range(repeats):
        for i, eut in enumerate(engines):
            one = time_ms(lambda: eut.engine.generate([list(prompt.ids)], 1))
            more = time_ms(lambda: eut.engine.generate([list(prompt.ids)], 1 + decode_tokens))
            prefill[i].append(one)
            decode[i].append((more - one) / decode_tokens)
    return [Latency(eut.name, eut.spec.name, prompt_len, decode_tokens, name, tuple(p), tuple(d))
            for eut, p, d in zip(engines, prefill, decode)]


def check(budget: Budget, got: Latency, reference: Latency | None, enforce_absolute: bool) -> tuple[list[str], list[str]]:
    """(failures, unenforced) lines for `got` against `budget`; medians are compared."""
    over = []
    for what, limit, value in (("prefill", budget.prefill_ms, got.prefill["median"]),
                               ("decode", budget.decode_ms_per_token, got.decode["median"])):
        if limit is not None and value <= 0:  # noise larger than the signal: never a pass
            over.append(f"{what} median {value:.3f} ms{'/token' if what == 'decode' else ''} is not a time (the "
                        f"difference T(1 + K) - T(1) was lost in noise) against budget {limit:g}: raise "
                        f"{REPEATS}, run on an idle device")
        elif limit is not None and value > limit:
            unit = "ms" if what == "prefill" else "ms/token"
            over.append(f"{what} median {value:.3f} {unit} > budget {limit:g} {unit}")
    relative = []
    if reference is not None:
        for what, mine, theirs in (("prefill", got.prefill, reference.prefill), ("decode", got.decode, reference.decode)):
            if mine["median"] > budget.factor * theirs["median"]:
                ratio = f"{mine['median'] / theirs['median']:.2f} x" if theirs["median"] > 0 else "slower than"
                relative.append(
                    f"{what} median {mine['median']:.3f} ms{'/token' if what == 'decode' else ''} is {ratio} "
                    f"'{reference.engine}' ({theirs['median']:.3f}), budget {budget.factor:g} x"
                )
    return (relative + over, []) if enforce_absolute else (relative, over)


class Probe:
    """The ``kv_latency`` fixture: ``kv_latency.measure()`` measures the test's engine on its model,
    records the numbers for the reports and enforces the test's budget (marker, else
    ``--kv-latency-budget``)."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.request = request

    def measure(self, engine: EngineUnderTest | None = None) -> Latency:
        from pytest_kvcompile.run.options import DEVICE
        from pytest_kvcompile.run.session import SESSION

        __tracebackhide__ = True
        request, config = self.request, self.request.config
        engine = engine or request.getfixturevalue("kv_engine")
        budget = budget_of(request.node) or config.stash[DEFAULT_BUDGET]
        session = config.stash[SESSION]
        engines = [engine]
        if budget and budget.relative_to and budget.relative_to != engine.name:
            engines.append(self._reference(session, budget.relative_to, engine.spec.name))
        measured = measure(engines, config.stash[REPEAT_COUNT])
        record = request.getfixturevalue("kv_record")
        for eut, latency in zip(engines, measured):
            kv_bytes = None
            if eut.ref.declaration.kv_cache_bytes:
                kv_bytes = {"expected": None, "measured": int(eut.engine.kv_cache_bytes())}
            record.metric(engine=eut.name, model=eut.spec.name, latency=latency.as_dict(), kv_bytes=kv_bytes)
        if budget is None:
            return measured[0]
        enforce = torch.device(session.settings.device).type == "cuda" or config.stash[ENFORCE_CPU]
        failures, unenforced = check(budget, measured[0], measured[1] if len(measured) > 1 else None, enforce)
        at = f"engine '{engine.name}' on model '{engine.spec.name}' ({session.settings.device}, {session.settings.dtype})"
        for line in unenforced:
            record(NOT_ENFORCED, f"{at}: {line}")
        if failures:
            pytest.fail(
                f"{at} is over its latency budget:\n" + "\n".join(f"  {line}" for line in failures)
                + f"\n  (medians of {config.stash[REPEAT_COUNT]} repeats timed with {measured[0].timer}, prompt of {PROMPT_LEN} tokens, decode over "
                f"{DECODE_TOKENS} tokens; {DEVICE}={session.settings.device}; see pytest_kvcompile.latency.marker)",
                pytrace=False,
            )
        return measured[0]

    @staticmethod
    def _reference(session, name: str, model: str) -> EngineUnderTest:
        """The relative budget's engine, built for the same model (resolved now if the run did not select it)."""
        from pytest_kvcompile.contract import registry
        from pytest_kvcompile.errors import EngineResolutionError

        __tracebackhide__ = True
        if name not in session.engines:
            try:
                session.engines[name] = registry.resolve(name)
            except EngineResolutionError as exc:
                problem = str(exc)
            else:
                problem = None
            if problem:
                pytest.fail(f"latency budget relative_to={name!r}: {problem}", pytrace=False)
        return session.engine(name, model)


DEFAULT_BUDGET = pytest.StashKey["Budget | None"]()
REPEAT_COUNT = pytest.StashKey[int]()
ENFORCE_CPU = pytest.StashKey[bool]()


class LatencyPlugin:
    """The marker's collection-time validation and the kv_latency fixture."""

    pytest_pycollect_makeitem = staticmethod(validated_at_collection(budget_of))

    @pytest.fixture
    def kv_latency(self, request: pytest.FixtureRequest) -> Probe:
        """Measure the test's engine: ``kv_latency.measure()`` (see pytest_kvcompile.latency.marker)."""
        return Probe(request)


OPTIONS = [  # (flag, ini key, ini type, default, help)
    (ENFORCE, "kv_enforce_latency", "bool", False,
     "enforce absolute latency budgets on CPU too (they are always enforced on CUDA; relative budgets everywhere)"),
    (REPEATS, "kv_latency_repeats", "string", "5", "timed repeats per latency measurement, after warmup (default: 5)"),
    (BUDGET, "kv_latency_budget", "string", "",
     "default latency budget for kv_latency measurements without a marker, the marker's keywords comma-separated, "
     "e.g. 'relative_to=hf-eager,factor=1.1' or 'decode_ms_per_token=5,prefill_ms=40'"),
]


def configure(config: pytest.Config, value: Callable[[str], object]) -> None:
    """Validate the latency options into the stash; `value(flag)` reads an option (command line, then ini)."""
    repeats = str(value(REPEATS))
    if not repeats.isdigit() or int(repeats) < 1:
        raise pytest.UsageError(f"{REPEATS}={repeats!r}: give a whole number >= 1")
    try:
        spec = str(value(BUDGET) or "")
        config.stash[DEFAULT_BUDGET] = parse_spec(spec, f"{BUDGET}={spec!r}") if spec.strip() else None
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[REPEAT_COUNT] = int(repeats)
    config.stash[ENFORCE_CPU] = bool(value(ENFORCE))
    usage = _USAGE.removeprefix("@pytest.mark.")
    config.addinivalue_line("markers", f"{usage}: {' '.join(latency_budget.__doc__.split())}")
    config.pluginmanager.register(LatencyPlugin(), "kvcompile.latency")
