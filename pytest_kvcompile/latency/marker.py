"""``@pytest.mark.latency_budget`` and the ``kv_latency`` probe; the timing rule is `latency.measure`'s.

Budgets: absolute ones (``prefill_ms``, ``decode_ms_per_token``) are enforced on CUDA; on CPU they are
recorded and listed in the terminal summary but enforced only with ``--kv-enforce-latency`` (shared CPU
runners are too noisy for absolute numbers). Relative ones (``relative_to=ENGINE, factor=F``: no slower than
F x that engine, measured side by side in the same test) are enforced everywhere: prefill on the median of the
repeats' paired ratios, decode on the medians, and an over-budget result is measured again (pooled, up to ``ROUNDS``
rounds) before it fails. A median <= 0 (the difference lost in noise) never meets an absolute budget, nor a relative
one unless even its p90 does. The budget (marker, else ``--kv-latency-budget``)
is checked after the test call, like every kvcompile marker; a marked test that never measured fails.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from pytest_kvcompile.config import markers
from pytest_kvcompile.config.options import Option, value, whole
from pytest_kvcompile.verdicts.rows import KVBytes, stats

if TYPE_CHECKING:
    from pytest_kvcompile.latency.measure import Latency, Measured

MARKER = "latency_budget"
FIXTURE = "kv_latency"
ENFORCE = "--kv-enforce-latency"
REPEATS = "--kv-latency-repeats"
BUDGET = "--kv-latency-budget"
NOT_ENFORCED = "latency budgets exceeded, not enforced on CPU (pass --kv-enforce-latency to enforce)"
SECTION = "over budget"
ROUNDS = 3  # a relative budget's measurement, over budget, is repeated (pooled) up to this many rounds before it fails


def latency_budget(log: Log, *, prefill_ms: float | None = None, decode_ms_per_token: float | None = None,
                   relative_to: str | None = None, factor: float | None = None) -> markers.Finding | None:
    """the test's kv_latency measurements must meet these budgets: prefill_ms and decode_ms_per_token
    are absolute medians in milliseconds (enforced on CUDA; on CPU only with --kv-enforce-latency);
    relative_to=ENGINE with factor=F: prefill and decode no slower than F x ENGINE on the same model,
    measured side by side in the same test (enforced everywhere)."""
    budget = Budget(prefill_ms, decode_ms_per_token, relative_to, factor)
    if not log.entries:
        return markers.Finding(f"the test never called {FIXTURE}.measure(): no latency was checked against "
                               f"{budget}")
    over = []
    for entry in log.entries:
        failures, unenforced = check(budget, entry.got, entry.reference, entry.enforce_absolute)
        for line in unenforced:
            log.note(NOT_ENFORCED, f"{entry.at}: {line}")
        if failures:
            over.append(f"{entry.at} is over its latency budget:\n" + "\n".join(f"  {line}" for line in failures)
                        + f"\n  (medians of {entry.repeats} repeats{_rounds(entry.rounds)} timed with "
                        f"{entry.got.timer}, prompt of {entry.got.prompt_len} tokens, decode over "
                        f"{entry.got.decode_tokens} tokens; see pytest_kvcompile.latency.measure)")
    if not over:
        return None
    return markers.Finding(over[0].partition("\n")[0], "\n".join(over), SECTION)


def _rounds(rounds: int) -> str:
    return f" in {rounds} rounds (over budget after each: confirmed)" if rounds > 1 else ""


def _at(where: str, message: str) -> str:
    return f"{where}: {message}" if where else message


@dataclass(frozen=True)
class Budget:
    prefill_ms: float | None = None
    decode_ms_per_token: float | None = None
    relative_to: str | None = None
    factor: float | None = None


def validate(args: tuple, kwargs: dict, where: str) -> Budget:
    """A Budget from marker (or option) arguments; ValueError naming the fix."""
    try:
        values = {k: v for k, v in SPEC.signature.bind(*args, **kwargs).arguments.items() if v is not None}
    except TypeError as exc:
        raise ValueError(_at(where, f"{exc}; write {SPEC.usage(MARKER)}")) from None
    for name in ("prefill_ms", "decode_ms_per_token", "factor"):
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(_at(where, f"{name} must be a number > 0, got {value!r}"))
    relative_to, factor = values.get("relative_to"), values.get("factor")
    if relative_to is not None and (not isinstance(relative_to, str) or not relative_to):
        raise ValueError(_at(where, f"relative_to must be an engine name such as 'hf-eager', got {relative_to!r}"))
    if (relative_to is None) != (factor is None):
        raise ValueError(_at(where, "relative_to and factor go together, e.g. relative_to='hf-eager', factor=1.1"))
    if not values:
        raise ValueError(_at(where, f"give at least one budget: {SPEC.usage(MARKER)}"))
    return Budget(**values)


def parse_spec(spec: str, where: str) -> Budget:
    """``--kv-latency-budget`` syntax: the marker's keywords, comma-separated, e.g.
    ``relative_to=hf-eager,factor=1.1`` or ``decode_ms_per_token=5,prefill_ms=40``."""
    kwargs = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(_at(where, f"{part!r} is not NAME=VALUE; e.g. relative_to=hf-eager,factor=1.1"))
        try:
            kwargs[name.strip()] = value.strip() if name.strip() == "relative_to" else float(value)
        except ValueError:
            raise ValueError(_at(where, f"{name.strip()}={value!r} is not a number")) from None
    return validate((), kwargs, where)


def check(budget: Budget, got: Latency, reference: Latency | None,
          enforce_absolute: bool) -> tuple[list[str], list[str]]:
    """(failures, unenforced) lines for `got` against `budget`; medians are compared."""
    over = []
    for what, limit, median in (("prefill", budget.prefill_ms, got.prefill.median),
                               ("decode", budget.decode_ms_per_token, got.decode.median)):
        if limit is not None and median <= 0:  # noise larger than the signal: never a pass
            over.append(f"{what} median {median:.3f} ms{'/token' if what == 'decode' else ''} is not a time (the "
                        f"difference T(1 + K) - T(1) was lost in noise) against budget {limit:g}: raise "
                        f"{REPEATS}, run on an idle device")
        elif limit is not None and median > limit:
            unit = "ms" if what == "prefill" else "ms/token"
            over.append(f"{what} median {median:.3f} {unit} > budget {limit:g} {unit}")
    relative = _relative(budget, got, reference) if reference is not None else []
    return (relative + over, []) if enforce_absolute else (relative, over)


def _relative(budget: Budget, got: Latency, reference: Latency) -> list[str]:
    """Failures of `got` against F x `reference`. Prefill: the median of the repeats' paired ratios (each repeat
    timed both engines back to back, so a slow stretch of the machine divides out). Decode (a difference, near 0 for a
    fast engine): the medians, and a median <= 0 passes only where even its p90 is within the budget; otherwise the
    difference was lost in noise, never a pass."""
    failures = []
    paired = [mine / theirs for mine, theirs in zip(got.prefill_ms, reference.prefill_ms) if theirs > 0]
    ratio = stats(paired).median if paired else float("inf")
    if ratio > budget.factor:
        failures.append(f"prefill median {got.prefill.median:.3f} ms is {ratio:.2f} x '{reference.engine}' "
                        f"({reference.prefill.median:.3f}; the median of {len(paired)} paired ratios), "
                        f"budget {budget.factor:g} x")
    mine, theirs = got.decode, reference.decode
    limit = budget.factor * theirs.median
    if mine.median <= 0 and not (theirs.median > 0 and mine.p90 <= limit):
        failures.append(f"decode median {mine.median:.3f} ms/token (p90 {mine.p90:.3f}) is not a time (the "
                        f"difference T(1 + K) - T(1) was lost in noise) against {budget.factor:g} x "
                        f"'{reference.engine}' ({theirs.median:.3f}): raise {REPEATS}, run on an idle machine")
    elif mine.median > 0 and mine.median > limit:
        ratio_text = f"{mine.median / theirs.median:.2f} x" if theirs.median > 0 else "slower than"
        failures.append(f"decode median {mine.median:.3f} ms/token is {ratio_text} '{reference.engine}' "
                        f"({theirs.median:.3f}), budget {budget.factor:g} x")
    return failures


@dataclass
class Entry:
    at: str
    got: Latency
    reference: Latency | None
    enforce_absolute: bool
    repeats: int
    rounds: int = 1


@dataclass
class Log:
    """The measurements of one test call, checked against its budget after the call."""

    note: Callable[[str, str], None] = lambda category, line: None
    entries: list[Entry] = field(default_factory=list)


LOG = pytest.StashKey[Log]()


class Probe:
    """The ``kv_latency`` fixture: ``kv_latency.measure()`` measures the test's engine on its model (and, for a
    relative budget, the other engine side by side) and records the numbers for the reports; the budget
    (marker, else ``--kv-latency-budget``) is checked after the call."""

    def __init__(self, item: pytest.Item, engine: Callable[[str | None], Measured], record: Any,
                 settings: Settings, device: str, dtype: str) -> None:
        self.item, self.engine, self.record, self.settings = item, engine, record, settings
        self.device, self.dtype = device, dtype

    def measure(self, engine: Measured | None = None) -> Latency:
        from pytest_kvcompile.latency.measure import measure

        __tracebackhide__ = True
        engine = engine or self.engine(None)
        budget = self.item.stash.get(markers.ARGUMENTS, {}).get(MARKER)
        engines = [engine]
        if budget and budget["relative_to"] and budget["relative_to"] != engine.name:
            engines.append(self.engine(budget["relative_to"]))
        measured, rounds = measure(engines, self.settings.repeats), 1
        if len(engines) > 1:  # over a relative budget: confirmed by more rounds, pooled, before it fails
            relative = Budget(relative_to=budget["relative_to"], factor=budget["factor"])
            while rounds < ROUNDS and _relative(relative, measured[0], measured[1]):
                more = measure(engines, self.settings.repeats, warmup=0)
                measured, rounds = [a.pooled(b) for a, b in zip(measured, more)], rounds + 1
        for eut, latency in zip(engines, measured):
            kv_bytes = None
            if eut.ref.declaration.kv_cache_bytes:
                kv_bytes = KVBytes(None, int(eut.engine.kv_cache_bytes()))
            self.record.metric(engine=eut.name, model=eut.spec.name, latency=latency.record(), kv_bytes=kv_bytes)
        if LOG in self.item.stash:
            at = f"engine '{engine.name}' on model '{engine.spec.name}' ({self.device}, {self.dtype})"
            enforce = self.device.startswith("cuda") or self.settings.enforce_cpu
            self.item.stash[LOG].entries.append(Entry(at, measured[0], measured[1] if len(measured) > 1 else None,
                                                      enforce, self.settings.repeats * rounds, rounds))
        return measured[0]


def _validate(arguments: dict[str, Any], item: pytest.Item) -> dict[str, Any]:
    if FIXTURE not in getattr(item, "fixturenames", ()):
        raise ValueError(f"the test must take the {FIXTURE} fixture and call {FIXTURE}.measure()")
    return validate((), arguments, "").__dict__


@contextmanager
def _log(arguments: dict[str, Any], item: pytest.Item):
    from pytest_kvcompile.verdicts.collect import NOTE

    log = item.stash[LOG] = Log(note=lambda category, line: item.user_properties.append((NOTE, (category, line))))
    try:
        yield log
    finally:
        del item.stash[LOG]


SPEC = markers.Marker(latency_budget, _validate, probe=_log, kind="latency")


def _budget_option(text: str) -> dict[str, Any]:
    return parse_spec(text, "").__dict__ if text.strip() else {}


@dataclass(frozen=True)
class Settings:
    repeats: int = 5
    enforce_cpu: bool = False
    default_budget: dict[str, Any] = field(default_factory=dict)


OPTIONS = [
    Option(ENFORCE, "kv_enforce_latency", False,
           "enforce absolute latency budgets on CPU too (they are always enforced on CUDA; "
           "relative budgets everywhere)",
           ini_type="bool"),
    Option(REPEATS, "kv_latency_repeats", "5", "timed repeats per latency measurement, after warmup (default: 5)", "N",
           whole(1)),
    Option(BUDGET, "kv_latency_budget", "",
           "default latency budget for kv_latency measurements without a marker, "
           "the marker's keywords comma-separated, "
           "e.g. 'relative_to=hf-eager,factor=1.1' or 'decode_ms_per_token=5,prefill_ms=40'", "SPEC", _budget_option),
]


def read(config: pytest.Config) -> Settings:
    enforce, repeats, budget = (value(config, o) for o in OPTIONS)
    return Settings(repeats, bool(enforce), budget or {})


class DefaultBudget:
    """``--kv-latency-budget``: tests that take kv_latency without a marker get the marker with these keywords."""

    def __init__(self, budget: dict[str, Any]) -> None:
        self.budget = {k: v for k, v in budget.items() if v is not None}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if FIXTURE in getattr(item, "fixturenames", ()) and not item.get_closest_marker(MARKER):
                item.add_marker(getattr(pytest.mark, MARKER)(**self.budget))


def register(config: pytest.Config, settings: Settings) -> None:
    """Add the latency_budget marker (and the run's default budget) to this run."""
    markers.register(config, {MARKER: SPEC})
    if settings.default_budget:
        config.pluginmanager.register(DefaultBudget(settings.default_budget), "kvcompile.latency-default")
