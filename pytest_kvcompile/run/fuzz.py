"""Stateful fuzzing of one engine object: hypothesis draws call sequences a user could make, the oracle judges
every row, and a failure shrinks to the shortest sequence that still fails (``--kv-fuzz=N``, suites/test_fuzz.py).

The recompile suite's warmup calls (lengths 7 and 48, and a batch of both) run once before the first example;
each example starts with one neutral call (a 7-token prompt, 2 new tokens) and then runs rules drawing
``generate()`` calls: 1..4 prompts (1 without ``batching``) of lengths around the boundaries caches
care about (1, 2, the window W-1/W/W+1/2W, eviction budgets, 15/16/17 ... 255/256/257, capped by the model's
positions), fresh prompts, prompts sharing a prefix of any length with an earlier one, exact repeats, and 1..64
new tokens or a long generation (LONG_NEW_TOKENS, up to the model's last position: suites/test_long_generation.py's
bugs, a decode buffer that wraps). Invariant after every call: every row is right under the verdict rules
(token_match: oracle-side verification, near ties), and an engine that ran compiled code compiled nothing after the
warmup.

One engine object serves every example (compiled engines cannot be rebuilt per example), so each example's
calls follow the previous example's; the neutral call at its start overwrites what the last call left (an engine
whose state outlives several calls can make a failure flaky: hypothesis then says so). A failure message ends
with the shrunk sequence as a snippet to replay on a fresh engine.

Before hypothesis draws anything, a covering walk (``Walk``) makes one long call sequence over the kinds of call
(issue 24). A kind has four factors: rows (1..4), the length class of the shortest row (1, 2-15, 16-31, 32-63,
64-127, 128-255, 256+), new tokens (1: prefill only; 2-32: decode up to the warmup's 32 steps; 33-64: past them) and
the first row's relation to earlier prompts (fresh, an exact repeat, a shared prefix). A bug of the form "wrong on a
call of kind B right after one of kind A" names some of the eight factors of A and B; the walk makes every condition
on 2..4 of them (at least one of each call) true at least once: a covering array of strength 4 over consecutive
calls (``Coverage``), built greedily as AETG does: each next kind is the one that covers the most conditions not yet
covered; ties go to kinds not decoding past the warmup's 32 steps (cost); where no kind covers anything right after
the last call, the one leading to the most. Each kind is realized cheaply (a boundary length or new-token count half
the time, else anywhere in its length class and the lower quarter of its new-token class) and classified again, so
what is counted is what ran. Such a bug is found by construction, not by luck; the conditions covered over those
possible are reported per engine and model. The walk stops at 3/4 of ``--kv-fuzz-budget`` (``WALK_SHARE``): a budget
too short for every condition reports fewer.

Profiles (``--kv-fuzz-profile``): ``ci`` is derandomized (the same examples every run: a failure is found again),
4..8 steps per example; ``dev`` draws new examples each run, longer sequences, and keeps failing examples in
hypothesis' database under ``<cache dir>/fuzz-db`` so the next run replays them first. ``--kv-fuzz-budget``
stops drawing new examples after that many seconds per engine and model (shrinking a failure always finishes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_kvcompile.config.options import FuzzSettings, Option, choice, number, value, whole
from pytest_kvcompile.models.prompts import Prompt, of_length
from pytest_kvcompile.verdicts import failures

if TYPE_CHECKING:
    import pytest

PROFILES = ("ci", "dev")
FUZZ, FUZZ_PROFILE, FUZZ_BUDGET, FUZZ_SEED = "--kv-fuzz", "--kv-fuzz-profile", "--kv-fuzz-budget", "--kv-fuzz-seed"
BOUNDARIES = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257)
NEW_TOKENS = (1, 2, 3, 8, 15, 16, 17, 32, 33, 63, 64)
LONG_NEW_TOKENS = (96, 97, 128, 255, 256, 400)  # long generations (hypothesis' draws), capped by the model's positions
LONG_SHARE = 8  # one draw of new tokens in LONG_SHARE is a long generation


OPTIONS = [
    Option(FUZZ, "kv_fuzz", "0", "fuzz each engine x model with N hypothesis examples of drawn call sequences "
           "(suites/test_fuzz.py); 0 (default): off", "N",
           whole(0, f"give a number of examples >= 0 (0: off), e.g. {FUZZ}=20")),
    Option(FUZZ_PROFILE, "kv_fuzz_profile", "ci",
           "'ci' (default): derandomized, the same examples every run, 8 steps each; 'dev': new examples each run, "
           "24 steps, failures kept in hypothesis' database under the cache dir and replayed first", "ci|dev",
           choice(*PROFILES)),
    Option(FUZZ_BUDGET, "kv_fuzz_budget", "240",
           "seconds per engine x model: the covering walk stops at 3/4 of it, hypothesis draws no new examples after "
           "it (default: 240)", "SECONDS", number(0, what="give seconds > 0, e.g. 240", low_open=True)),
    Option(FUZZ_SEED, "kv_fuzz_seed", "",
           "a seed for the fuzzer (random examples, reproducible): measures time-to-find over seeds", "N",
           whole(0, "give a whole number")),
]



def _with_replay(exc: BaseException, replay: str) -> BaseException:
    """`exc` again with the replay appended to its message, keeping its typed facts (a Failure, a kind, what an engine
    raised: known findings and the reports read them) and how pytest shows it."""
    again = type(exc)(f"{exc}\n{replay}")
    again.__dict__.update({k: v for k, v in vars(exc).items() if k not in ("msg", "args")})
    return again

def read(config: pytest.Config) -> FuzzSettings | None:
    """The run's fuzz settings from OPTIONS (None: fuzzing off)."""
    examples, profile, budget, seed = (value(config, o) for o in OPTIONS)
    return FuzzSettings(examples, profile, budget, seed if seed != "" else None) if examples else None


def lengths_for(window: int | None, budgets: tuple[int, ...], limit: int) -> list[int]:
    """Prompt lengths around every boundary that matters for this model and strategy, within `limit`."""
    found = set(BOUNDARIES)
    if window:
        found |= {window - 1, window, window + 1, 2 * window}
    for budget in budgets:
        found |= {budget - 1, budget, budget + 1}
    return sorted(n for n in found if 1 <= n <= limit)


def tokens(seed: int, length: int, vocab: int) -> tuple[int, ...]:
    """A prompt drawn as (seed, length): shrinks by both, and stays short to print."""
    return of_length(length, vocab, salt=10_000 + seed).ids


def replay(calls: list[tuple[list[tuple[int, ...]], int]],
           what: str = "the shortest failing call sequence found") -> str:
    """The call sequence as Python to replay on a fresh engine."""
    lines = [f"    engine.generate({[list(p) for p in prompts]}, {n})" for prompts, n in calls]
    return "\n".join([f"  {what} (replay it on a fresh engine, in this order):", *lines])


def machine(kv_engine, oracle, lengths: list[int], check_compiles: bool, deadline: float,
            neutral: Prompt, stats: dict[str, Any], check: Any = None) -> Any:
    """A RuleBasedStateMachine class fuzzing `kv_engine` (EngineUnderTest) against `oracle` (None: oracle-free:
    an exact repeat must give the same tokens). `check(reference, got, prompt, where)` judges a row (default:
    kv_engine.check_tokens; the suite passes the kv_check_tokens fixture, which records verdicts). `stats` counts
    examples and notes when the first failure came."""
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        initialize,
        precondition,
        rule,
    )

    from pytest_kvcompile.models.checkpoints import max_positions  # torch: imported when fuzzing

    vocab, batch = kv_engine.spec.vocab_size, 4 if kv_engine.ref.declaration.batching else 1
    positions = max_positions(kv_engine.spec.config) or max(lengths) + max(LONG_NEW_TOKENS)
    short = st.sampled_from(NEW_TOKENS) | st.integers(1, 64)
    # a long generation in about one draw of LONG_SHARE: it costs up to 400 steps of the engine and the oracle
    new_tokens = st.integers(1, LONG_SHARE).flatmap(lambda i: st.sampled_from(LONG_NEW_TOKENS) if i == LONG_SHARE
                                                   else short)

    class EngineFuzz(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[list[tuple[int, ...]], int]] = []
            self.prompts: list[tuple[int, ...]] = []
            self.caller = Caller(kv_engine, oracle, check_compiles, check)

        @initialize()
        def start(self) -> None:
            # Past the time budget an example draws as usual (hypothesis needs the same draws on a replay) but
            # calls nothing; shrinking a failure found earlier always runs for real.
            self.idle = time.monotonic() > deadline and "found" not in stats
            if not self.idle:
                stats["examples"] += 1
                kv_engine.generate([neutral], 2)

        def _run(self, prompts: list[tuple[int, ...]], n: int) -> None:
            n = max(1, min(n, positions - max(map(len, prompts))))  # a long generation ends at the last position
            self.calls.append((prompts, n))
            self.prompts += prompts  # bookkept even when idle: rule preconditions read it (same draws on a replay)
            if self.idle:
                return
            try:
                self.caller(prompts, n, f"fuzz call {len(self.calls)}")
            except BaseException as exc:
                stats.setdefault("found", (stats["examples"], time.monotonic()))
                if isinstance(exc, AssertionError) or type(exc).__name__ == "Failed":
                    raise _with_replay(exc, replay(self.calls)) from None
                raise

        @rule(size=st.sampled_from(range(1, batch + 1)),
              rows=st.lists(st.tuples(st.sampled_from(lengths) | st.integers(1, max(lengths)), st.integers(0, 2**16)),
                            min_size=batch, max_size=batch),
              n=new_tokens)
        def fresh_prompts(self, size, rows, n) -> None:
            self._run([tokens(seed, length, vocab) for length, seed in rows[:size]], n)

        @precondition(lambda self: self.prompts)
        @rule(pick=st.integers(0, 2**16), shared=st.sampled_from(lengths) | st.integers(1, max(lengths)),
              tail=st.integers(1, 40), seed=st.integers(0, 2**16), alone=st.booleans(),
              n=new_tokens)
        def shared_prefix(self, pick, shared, tail, seed, alone, n) -> None:
            earlier = self.prompts[pick % len(self.prompts)]
            k = min(shared, len(earlier))
            prompt = (earlier[:k] + tokens(seed, tail, vocab))[: max(lengths)]
            self._run([prompt] if alone or batch == 1 else [prompt, earlier], n)

        @precondition(lambda self: self.prompts)
        @rule(pick=st.integers(0, 2**16), n=new_tokens)
        def repeat(self, pick, n) -> None:
            self._run([self.prompts[pick % len(self.prompts)]], n)

    EngineFuzz.__name__ = EngineFuzz.__qualname__ = "EngineFuzz"
    return EngineFuzz


LENGTH_CLASSES = ((1, 1), (2, 15), (16, 31), (32, 63), (64, 127), (128, 255), (256, 1 << 30))  # shortest row
NEW_TOKEN_CLASSES = ((1, 1), (2, 32), (33, 64))  # prefill only; decode up to the warmup's 32 steps; past them
RELATIONS = ("fresh", "repeat", "shared prefix")  # the first row vs the earlier prompts
WARMUP_STEPS = 32  # the decode steps of suites/test_fuzz.py's warmup calls
STRENGTH = 4  # the covering walk's: conditions on up to 4 factors of two consecutive calls
WALK_SHARE = 0.75  # of --kv-fuzz-budget at most for the covering walk: hypothesis always gets the rest


def _span(lo: int, hi: int) -> str:
    return f"{lo}" if lo == hi else f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}"


def length_class(n: int) -> int:
    return next(i for i, (lo, hi) in enumerate(LENGTH_CLASSES) if lo <= n <= hi)


@dataclass(frozen=True)
class Kind:
    """A call's kind: rows, the length class of its shortest row, its new-token class and the first row's relation to
    the earlier prompts (module docstring)."""

    FACTORS = ("rows", "length", "new", "relation")

    rows: int
    length: int  # index into LENGTH_CLASSES
    new: int  # index into NEW_TOKEN_CLASSES
    relation: str

    def __str__(self) -> str:
        return (f"{self.rows} row(s), shortest {_span(*LENGTH_CLASSES[self.length])} tokens, "
                f"{_span(*NEW_TOKEN_CLASSES[self.new])} new token(s), {self.relation}")


class Coverage:
    """The conditions on two consecutive calls a walk must make true at least once, and those it has: every choice of
    values for 2..STRENGTH of the eight factors (each call's ``Kind.FACTORS``), at least one factor from each call
    (a covering array of strength 4 over consecutive calls; module docstring)."""

    def __init__(self, kinds: list[Kind]) -> None:
        import itertools
        import math

        import torch

        self.index = {k: i for i, k in enumerate(kinds)}
        levels = [sorted({getattr(k, f) for k in kinds}, key=str) for f in Kind.FACTORS]
        values = torch.tensor([[levels[f].index(getattr(k, name)) for f, name in enumerate(Kind.FACTORS)]
                               for k in kinds])
        sizes = [len(v) for v in levels] * 2  # factor j < 4: the earlier call's, j >= 4: the later call's
        varied = [j for j in range(8) if sizes[j] > 1]  # a factor with one value adds no condition
        cells, self.ways, offset = [], {}, 0
        for t in range(2, STRENGTH + 1):
            start = offset
            for subset in itertools.combinations(varied, t):
                if min(subset) >= 4 or max(subset) < 4:
                    continue
                cell = torch.zeros(len(kinds), len(kinds), dtype=torch.long)
                for j in subset:  # mixed radix over the subset's factors; rows: earlier call, columns: later call
                    cell = cell * sizes[j] + (values[:, j, None] if j < 4 else values[None, :, j - 4])
                cells.append(cell + offset)
                offset += math.prod(sizes[j] for j in subset)
            self.ways[f"{t}-way"] = (start, offset)
        self.cells = torch.stack(cells, 1).contiguous()  # [earlier kind, factor subsets, later kind] -> condition
        self.covered = torch.zeros(offset, dtype=torch.bool)

    def gains(self, last: Kind) -> list[int]:
        """Per kind (in `kinds` order): the conditions not yet covered that a call of it right after `last` covers."""
        return (~self.covered[self.cells[self.index[last]]]).sum(0).tolist()

    def reach(self) -> list[int]:
        """Per kind: the most conditions a call right after one of it could cover (to leave a kind covering none)."""
        return (~self.covered[self.cells]).sum(1).amax(1).tolist()

    def add(self, a: Kind, b: Kind) -> None:
        if a in self.index and b in self.index:
            self.covered[self.cells[self.index[a], :, self.index[b]]] = True

    @property
    def complete(self) -> bool:
        return bool(self.covered.all())

    def to_dict(self, calls: int, seconds: float) -> dict[str, Any]:
        parts = {way: [int(self.covered[lo:hi].sum()), hi - lo] for way, (lo, hi) in self.ways.items()}
        return {"covered": int(self.covered.sum()), "possible": len(self.covered), "parts": parts, "calls": calls,
                "seconds": round(seconds, 1)}


def kinds_for(batch: int, lengths: list[int]) -> list[Kind]:
    """Every kind an engine taking up to `batch` rows can be given within the fuzzed lengths."""
    classes = sorted({length_class(n) for n in lengths})
    return [Kind(r, c, n, rel) for r in range(1, batch + 1) for c in classes for n in range(len(NEW_TOKEN_CLASSES))
            for rel in RELATIONS]


class Walk:
    """The covering walk: plans each next kind greedily, realizes it as a concrete call, and runs it."""

    def __init__(self, kinds: list[Kind], lengths: list[int], vocab: int, seed: int) -> None:
        import random

        self.kinds, self.lengths, self.vocab, self.seed = kinds, lengths, vocab, seed
        self.rng, self.coverage = random.Random(seed), Coverage(kinds)
        self.prompts: list[tuple[int, ...]] = []  # every prompt so far, in order, and by length class
        self.known: set[tuple[int, ...]] = set()
        self.by_class: dict[int, list[tuple[int, ...]]] = {}
        self.fresh, self.calls, self.made, self.seconds = 0, [], [], 0.0  # made: the kind of each call

    def next_kind(self, last: Kind | None) -> Kind:
        if last is None:
            return self.rng.choice(self.kinds)
        gains = self.coverage.gains(last)
        if not max(gains):  # nothing new right after `last`: go where the call after can cover the most
            gains = self.coverage.reach()
        top = max(gains)
        best = [k for k, g in zip(self.kinds, gains) if g == top]
        within = [k for k in best if NEW_TOKEN_CLASSES[k.new][1] <= WARMUP_STEPS]  # ties: not past the warmup's steps
        return self.rng.choice(within or best)

    def _length(self, cls: int, at_least: int = 1) -> int:
        lo, hi = LENGTH_CLASSES[cls]
        lo, hi = max(lo, at_least), min(hi, max(self.lengths))
        edges = [n for n in self.lengths if lo <= n <= hi]
        return self.rng.choice(edges) if edges and self.rng.random() < 0.5 else self.rng.randint(lo, max(lo, hi))

    def _tokens(self, n: int) -> tuple[int, ...]:
        self.fresh += 1
        return tokens(20_000 + self.fresh, n, self.vocab)

    def realize(self, kind: Kind) -> tuple[list[tuple[int, ...]], int, Kind]:
        """A call of `kind`, as near as the earlier prompts allow, and the kind it is."""
        shortest, relation = self._length(kind.length), "fresh"
        first = self._tokens(shortest)
        same_class = self.by_class.get(kind.length)
        if kind.relation == "repeat" and same_class:
            first, relation = self.rng.choice(same_class), "repeat"
        elif kind.relation != "fresh" and self.prompts:
            earlier = self.rng.choice(self.prompts)
            k = self.rng.randint(1, min(len(earlier), shortest))
            first = earlier[:k] + (self._tokens(shortest - k) if shortest > k else ())
            relation = "repeat" if first in self.known else "shared prefix"
        top = max(map(length_class, self.lengths))
        rows = [first] + [self._tokens(self._length(self.rng.randint(kind.length, min(top, kind.length + 1)),
                                                    at_least=len(first)))
                          for _ in range(kind.rows - 1)]  # the other rows: the shortest's class or the next (cost)
        lo, hi = NEW_TOKEN_CLASSES[kind.new]
        edges = [n for n in NEW_TOKENS if lo <= n <= hi]
        # a boundary half the time, else the class's lower quarter: the walk needs the class, hypothesis draws the rest
        n = self.rng.choice(edges) if edges and self.rng.random() < 0.5 else self.rng.randint(lo, lo + (hi - lo) // 4)
        return rows, n, Kind(len(rows), length_class(min(map(len, rows))), kind.new, relation)

    def remember(self, rows: list[tuple[int, ...]]) -> None:
        for row in rows:
            if row not in self.known:
                self.known.add(row)
                self.prompts.append(row)
                self.by_class.setdefault(length_class(len(row)), []).append(row)

    def run(self, run_call, deadline: float) -> None:
        """Call `run_call(prompts, n, what)` (it verifies every row and raises on a failure) until every condition
        is covered or the deadline passes."""
        started, last = time.monotonic(), None
        try:
            while not self.coverage.complete and time.monotonic() < deadline:
                rows, n, kind = self.realize(self.next_kind(last))
                self.calls.append((rows, n))
                self.made.append(kind)
                run_call(rows, n, f"covering-walk call {len(self.calls)} of kind [{kind}]"
                         + (f", right after a call of kind [{last}]" if last else ""))
                if last is not None:
                    self.coverage.add(last, kind)
                self.remember(rows)
                last = kind
        finally:
            self.seconds = time.monotonic() - started

    def to_dict(self) -> dict[str, Any]:
        return {**self.coverage.to_dict(len(self.calls), self.seconds), "seed": self.seed}


class Caller:
    """One verified generate() call of the fuzzer: every row judged by the oracle (`check(reference, got, prompt,
    where)`), or without one, an exact repeat must give the same tokens; and no compile after the warmup."""

    def __init__(self, kv_engine, oracle, check_compiles: bool, check: Any = None) -> None:
        self.engine, self.oracle, self.check_compiles = kv_engine, oracle, check_compiles
        self.check = check or kv_engine.check_tokens
        self.outputs: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompts: list[tuple[int, ...]], n: int, what: str) -> None:
        from pytest_kvcompile.oracles.token_match import TokenMismatch
        from pytest_kvcompile.recompiles.recorder import RecompileError

        engine = self.engine
        outputs = engine.generate([Prompt(f"fuzz{len(p)}", p) for p in prompts], n)
        call = engine.history[-1]
        for i, (ids, got) in enumerate(zip(prompts, outputs)):
            prompt = Prompt(f"fuzz/len{len(ids)}", ids)
            where = failures.Where(index=i, lengths=tuple(len(p) for p in prompts), number=len(engine.history),
                         note=f"{what} {call}")
            if self.oracle is not None:
                self.check(self.oracle.reference(prompt.ids, n), got, prompt, where)
                continue
            seen = self.outputs.setdefault((prompt.ids, n), got)
            if seen != got:
                raise TokenMismatch(f"engine '{engine.name}' on model '{engine.spec.name}': {prompt.name} gave "
                                    f"{seen} earlier and {got} at {where.describe()} "
                                    f"(no oracle: a repeat must give the same tokens)",
                                    kind=failures.Kind.INCONSISTENT)
        if self.check_compiles and call.compiles:
            raise RecompileError(
                f"engine '{engine.name}' on model '{engine.spec.name}' compiled {len(call.compiles)} frame(s) during "
                f"{what} {call}, after the warmup:\n" + "\n".join(e.describe() for e in call.compiles))


def hypothesis_settings(settings: FuzzSettings, database_dir) -> Any:
    """hypothesis settings of the profile (module docstring)."""
    from hypothesis import HealthCheck, Phase
    from hypothesis import settings as hsettings
    from hypothesis.database import DirectoryBasedExampleDatabase

    phases = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)  # no 'explain': it re-runs
    common = dict(max_examples=settings.examples, deadline=None, suppress_health_check=list(HealthCheck),
                  print_blob=True, phases=phases, report_multiple_bugs=False)
    if settings.profile == "ci" and settings.seed is None:
        return hsettings(derandomize=True, database=None, stateful_step_count=8, **common)
    return hsettings(derandomize=False, database=DirectoryBasedExampleDatabase(str(database_dir)),
                     stateful_step_count=8 if settings.profile == "ci" else 24, **common)


def run(kv_engine, oracle, lengths, check_compiles, settings: FuzzSettings, neutral: Prompt, database_dir, key: str,
        check: Any = None, on_coverage: Any = None) -> int:
    """The covering walk, then hypothesis until the examples or the budget run out; raise the first failure (the
    walk's with its last calls, hypothesis' shrunk), noting when it was found. `on_coverage(Walk.to_dict())` gets the
    walk's coverage, failing or not. Returns the hypothesis examples run."""
    import random

    from hypothesis.stateful import run_state_machine_as_test

    started = time.monotonic()
    deadline = started + settings.budget_s
    batch = 4 if kv_engine.ref.declaration.batching else 1
    seed = 0 if settings.seed is None and settings.profile == "ci" else settings.seed
    plan = Walk(kinds_for(batch, lengths), lengths, kv_engine.spec.vocab_size,
                random.randrange(2**32) if seed is None else seed)
    kv_engine.generate([neutral], 2)
    try:
        plan.run(Caller(kv_engine, oracle, check_compiles, check), started + WALK_SHARE * settings.budget_s)
    except BaseException as exc:
        if isinstance(exc, AssertionError) or type(exc).__name__ == "Failed":
            raise _with_replay(exc, _walk_replay(kv_engine, oracle, check, neutral, plan)) from None
        raise
    finally:
        if on_coverage is not None:
            on_coverage(plan.to_dict())
    if time.monotonic() >= deadline:
        return 0

    stats: dict[str, Any] = {"examples": 0}
    factory = machine(kv_engine, oracle, lengths, check_compiles, deadline, neutral, stats, check)
    factory._hypothesis_internal_add_digest = key.encode()  # one database entry per engine, model and dtype
    if settings.seed is not None:
        factory._hypothesis_internal_use_seed = settings.seed
    started = time.monotonic()
    try:
        run_state_machine_as_test(factory, settings=hypothesis_settings(settings, database_dir))
    except BaseException as exc:
        exc = _unflaky(exc)
        if "found" in stats and hasattr(exc, "add_note"):
            example, when = stats["found"]
            exc.add_note(f"fuzz: first failure in hypothesis example {example}, {when - started:.1f} s after the "
                         f"covering walk; shrunk in {time.monotonic() - when:.1f} s ({stats['examples']} examples run "
                         "in all)")
        raise exc from None
    return stats["examples"]


def _walk_replay(kv_engine, oracle, check, neutral: Prompt, plan: Walk) -> str:
    """The covering walk's failing call and the one before it, replayed once more after a neutral call on the same
    engine object: if they fail again, they are the whole story; if not, the walk's last calls are listed."""
    last = plan.calls[-2:]
    found = (f"fuzz: found by the covering walk at call {len(plan.calls)}, {plan.seconds:.1f} s in (walk seed "
             f"{plan.seed}: --kv-fuzz-seed={plan.seed} walks the same calls)")
    try:
        kv_engine.generate([neutral], 2)
        caller = Caller(kv_engine, oracle, False, check)
        for i, (rows, n) in enumerate(last):
            caller(rows, n, f"replay call {i + 1}")
    except Exception:
        return (f"{found}; these {len(last)} calls fail again after a neutral call on the same engine object\n"
                + replay(last, "the failing call and the one before it"))
    return (f"{found}; its last {len(last)} calls alone did not fail again, so the bug needs more of the history: "
            "the walk's last 8 calls\n" + replay(plan.calls[-8:], "the covering walk's last calls"))


def _unflaky(exc: BaseException) -> BaseException:
    """hypothesis' FlakyFailure (an exception group: the failure did not replay identically, because the one
    engine object carries state from call to call and example to example, as it does for a user) -> its first
    inner failure, noted as such; anything else unchanged."""
    from hypothesis.errors import FlakyFailure

    if not isinstance(exc, FlakyFailure):
        return exc
    inner = next((e for e in exc.exceptions if isinstance(e, AssertionError)),
                 exc.exceptions[0] if exc.exceptions else exc)
    if hasattr(inner, "add_note"):
        inner.add_note("fuzz: hypothesis could not replay this failure identically (the engine object keeps state "
                       "across calls and examples), so it is the failing sequence as first found, shrunk as far as "
                       "replays allowed")
    return inner
