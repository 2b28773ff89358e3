"""Stateful fuzzing of one engine object: hypothesis draws call sequences a user could make, the oracle judges
every row, and a failure shrinks to the shortest sequence that still fails (``--kv-fuzz=N``, suites/test_fuzz.py).

The recompile suite's warmup calls (lengths 7 and 48, and a batch of both) run once before the first example;
each example starts with one neutral call (a 7-token prompt, 2 new tokens) and then runs rules drawing
``generate()`` calls: 1..4 prompts (1 without ``batching``) of lengths around the boundaries caches
care about (1, 2, the window W-1/W/W+1/2W, eviction budgets, 15/16/17 ... 255/256/257, capped by the model's
positions), fresh prompts, prompts sharing a prefix of any length with an earlier one, exact repeats, and 1..64
new tokens. Invariant after every call: every row is right under the verdict rules (token_match: oracle-side
verification, near ties), and an engine that ran compiled code compiled nothing after the warmup.

One engine object serves every example (compiled engines cannot be rebuilt per example), so each example's
calls follow the previous example's; the neutral call at its start overwrites what the last call left (an engine
whose state outlives several calls can make a failure flaky: hypothesis then says so). A failure message ends
with the shrunk sequence as a snippet to replay on a fresh engine.

Profiles (``--kv-fuzz-profile``): ``ci`` is derandomized (the same examples every run: a failure is found again),
4..8 steps per example; ``dev`` draws new examples each run, longer sequences, and keeps failing examples in
hypothesis' database under ``<cache dir>/fuzz-db`` so the next run replays them first. ``--kv-fuzz-budget``
stops drawing new examples after that many seconds per engine and model (shrinking a failure always finishes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from pytest_kvcompile.models.prompts import Prompt, of_length
from pytest_kvcompile.run.options import Option, choice, number, value, whole

PROFILES = ("ci", "dev")
FUZZ, FUZZ_PROFILE, FUZZ_BUDGET, FUZZ_SEED = "--kv-fuzz", "--kv-fuzz-profile", "--kv-fuzz-budget", "--kv-fuzz-seed"
BOUNDARIES = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257)
NEW_TOKENS = (1, 2, 3, 8, 15, 16, 17, 32, 33, 63, 64)


@dataclass(frozen=True)
class FuzzSettings:
    examples: int
    profile: str = "ci"
    budget_s: float = 120.0
    seed: int | None = None


OPTIONS = [
    Option(FUZZ, "kv_fuzz", "0", "fuzz each engine x model with N hypothesis examples of drawn call sequences "
           "(suites/test_fuzz.py); 0 (default): off", "N",
           whole(0, f"give a number of examples >= 0 (0: off), e.g. {FUZZ}=20")),
    Option(FUZZ_PROFILE, "kv_fuzz_profile", "ci",
           "'ci' (default): derandomized, the same examples every run, 8 steps each; 'dev': new examples each run, "
           "24 steps, failures kept in hypothesis' database under the cache dir and replayed first", "ci|dev",
           choice(*PROFILES)),
    Option(FUZZ_BUDGET, "kv_fuzz_budget", "120",
           "seconds per engine x model after which fuzzing draws no new examples (default: 120)", "SECONDS",
           number(0, what="give seconds > 0, e.g. 120", low_open=True)),
    Option(FUZZ_SEED, "kv_fuzz_seed", "",
           "a seed for the fuzzer (random examples, reproducible): measures time-to-find over seeds", "N",
           whole(0, "give a whole number")),
]


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


def replay(calls: list[tuple[list[tuple[int, ...]], int]]) -> str:
    """The call sequence as Python to replay on a fresh engine."""
    lines = [f"    engine.generate({[list(p) for p in prompts]}, {n})" for prompts, n in calls]
    return "\n".join(["  the shortest failing call sequence found (replay it on a fresh engine, in this order):", *lines])


def machine(kv_engine, oracle, lengths: list[int], check_compiles: bool, settings: FuzzSettings,
            neutral: Prompt, stats: dict[str, Any], check: Any = None) -> Any:
    """A RuleBasedStateMachine class fuzzing `kv_engine` (EngineUnderTest) against `oracle` (None: oracle-free:
    an exact repeat must give the same tokens). `check(reference, got, prompt, where)` judges a row (default:
    kv_engine.check; the suite passes the kv_check fixture, which records verdicts). `stats` counts examples and
    notes when the first failure came."""
    from hypothesis import strategies as st
    from hypothesis.stateful import (
        RuleBasedStateMachine,
        initialize,
        precondition,
        rule,
    )

    from pytest_kvcompile.oracles.token_match import TokenMismatch

    vocab, batch = kv_engine.spec.vocab_size, 4 if kv_engine.ref.declaration.batching else 1
    deadline = time.monotonic() + settings.budget_s

    class EngineFuzz(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[list[tuple[int, ...]], int]] = []
            self.prompts: list[tuple[int, ...]] = []
            self.outputs: dict[tuple[tuple[int, ...], int], list[int]] = {}

        @initialize()
        def start(self) -> None:
            # Past the time budget an example draws as usual (hypothesis needs the same draws on a replay) but
            # calls nothing; shrinking a failure found earlier always runs for real.
            self.idle = time.monotonic() > deadline and "found" not in stats
            if not self.idle:
                stats["examples"] += 1
                kv_engine.generate([neutral], 2)

        def _run(self, prompts: list[tuple[int, ...]], n: int) -> None:
            self.calls.append((prompts, n))
            self.prompts += prompts  # bookkept even when idle: rule preconditions read it (same draws on a replay)
            if self.idle:
                return
            try:
                outputs = kv_engine.generate([Prompt(f"fuzz{len(p)}", p) for p in prompts], n)
                where = f"index {{}} of fuzz call {len(self.calls)} {kv_engine.history[-1]}"
                for i, (prompt, got) in enumerate(zip(prompts, outputs)):
                    self._verify(Prompt(f"fuzz/len{len(prompt)}", prompt), got, n, where.format(i))
                call = kv_engine.history[-1]
                if check_compiles and call.compiles:
                    raise TokenMismatch(
                        f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}' compiled {len(call.compiles)} "
                        f"frame(s) during fuzz call {len(self.calls)} {call}, after the warmup:\n"
                        + "\n".join(e.describe() for e in call.compiles))
            except BaseException as exc:
                stats.setdefault("found", (stats["examples"], time.monotonic()))
                if isinstance(exc, AssertionError) or type(exc).__name__ == "Failed":
                    raise type(exc)(f"{exc}\n{replay(self.calls)}") from None
                raise

        def _verify(self, prompt: Prompt, got: list[int], n: int, where: str) -> None:
            if oracle is not None:
                (check or kv_engine.check)(oracle.reference(prompt.ids, n), got, prompt, where)
                return
            seen = self.outputs.setdefault((prompt.ids, n), got)
            if seen != got:
                raise TokenMismatch(f"engine '{kv_engine.name}' on model '{kv_engine.spec.name}': {prompt.name} gave "
                                    f"{seen} earlier and {got} at {where} (no oracle: a repeat must give the same tokens)")

        @rule(size=st.sampled_from(range(1, batch + 1)),
              rows=st.lists(st.tuples(st.sampled_from(lengths) | st.integers(1, max(lengths)), st.integers(0, 2**16)),
                            min_size=batch, max_size=batch),
              n=st.sampled_from(NEW_TOKENS) | st.integers(1, 64))
        def fresh_prompts(self, size, rows, n) -> None:
            self._run([tokens(seed, length, vocab) for length, seed in rows[:size]], n)

        @precondition(lambda self: self.prompts)
        @rule(pick=st.integers(0, 2**16), shared=st.sampled_from(lengths) | st.integers(1, max(lengths)),
              tail=st.integers(1, 40), seed=st.integers(0, 2**16), alone=st.booleans(),
              n=st.sampled_from(NEW_TOKENS) | st.integers(1, 64))
        def shared_prefix(self, pick, shared, tail, seed, alone, n) -> None:
            earlier = self.prompts[pick % len(self.prompts)]
            k = min(shared, len(earlier))
            prompt = (earlier[:k] + tokens(seed, tail, vocab))[: max(lengths)]
            self._run([prompt] if alone or batch == 1 else [prompt, earlier], n)

        @precondition(lambda self: self.prompts)
        @rule(pick=st.integers(0, 2**16), n=st.sampled_from(NEW_TOKENS) | st.integers(1, 64))
        def repeat(self, pick, n) -> None:
            self._run([self.prompts[pick % len(self.prompts)]], n)

    EngineFuzz.__name__ = EngineFuzz.__qualname__ = "EngineFuzz"
    return EngineFuzz


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
        check: Any = None) -> int:
    """Fuzz until the examples or the budget run out; raise the shrunk failure, noting when it was first found.
    Returns the examples run."""
    from hypothesis.stateful import run_state_machine_as_test

    stats: dict[str, Any] = {"examples": 0}
    factory = machine(kv_engine, oracle, lengths, check_compiles, settings, neutral, stats, check)
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
            exc.add_note(f"fuzz: first failure in example {example}, {when - started:.1f} s in; shrunk in "
                         f"{time.monotonic() - when:.1f} s ({stats['examples']} examples run in all)")
        raise exc from None
    return stats["examples"]


def _unflaky(exc: BaseException) -> BaseException:
    """hypothesis' FlakyFailure (an exception group: the failure did not replay identically, because the one
    engine object carries state from call to call and example to example, as it does for a user) -> its first
    inner failure, noted as such; anything else unchanged."""
    from hypothesis.errors import FlakyFailure

    if not isinstance(exc, FlakyFailure):
        return exc
    inner = next((e for e in exc.exceptions if isinstance(e, AssertionError)), exc.exceptions[0] if exc.exceptions else exc)
    if hasattr(inner, "add_note"):
        inner.add_note("fuzz: hypothesis could not replay this failure identically (the engine object keeps state "
                       "across calls and examples), so it is the failing sequence as first found, shrunk as far as "
                       "replays allowed")
    return inner
