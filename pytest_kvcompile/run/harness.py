"""An engine under test: the resolved engine built for one model, every call it served, and the checks' entry points.

Every ``generate()`` runs under a compile recorder (`recompiles.CompileRecorder`): what dynamo compiled during
the call, how often compiled code matched its guards and ran, and how often a frame ran eagerly after its
guards failed. So whether an engine runs compiled code is observed, not declared (suites/test_recompiles.py),
and every check knows the calls the engine object served before it.

Where the engine runs (the pytest process, or a process of its own) is its host (run/host.py): the engine under test
asks the host for what differs (a call's timeout, what dynamo did, memory, the tensor census) and never which one it
is.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_kvcompile.contract import engine_io
from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.contract.registry import EngineRef
from pytest_kvcompile.errors import CallTimeout, EngineFailed, EngineProcessDied, Failed, fail
from pytest_kvcompile.memory.measure import Held
from pytest_kvcompile.models.layers import states_of
from pytest_kvcompile.models.prompts import Prompt
from pytest_kvcompile.models.texts import decoder
from pytest_kvcompile.oracles.reference import Reference
from pytest_kvcompile.oracles.token_match import Verdict
from pytest_kvcompile.recompiles.recorder import CompileEvent
from pytest_kvcompile.run.host import Host, Observed, cuda_allocated, host_of
from pytest_kvcompile.run.host import deadline as deadline  # defined in run/host.py, still importable from here
from pytest_kvcompile.run.judge import Judge
from pytest_kvcompile.verdicts.failures import Where

FRESH_ENGINE = "--kv-fresh-engine"
CALL_TIMEOUT = "--kv-call-timeout"
CONCURRENT_TIMEOUT_S = 300.0  # concurrent calls (`EngineUnderTest.concurrently`) without --kv-call-timeout


@dataclass(frozen=True)
class Call:
    """One ``generate()`` call an engine object served, with what dynamo did during it."""

    lengths: tuple[int, ...]
    max_new_tokens: int
    compiles: tuple[CompileEvent, ...] = ()
    guard_hits: int = 0  # frames entered whose compiled code matched its guards and ran
    eager_runs: int = 0  # frames whose guards failed and that then ran eagerly (no compile followed)
    captures: tuple[str, ...] = ()  # CUDA graph captures during the call: who asked (recompiles.CompileRecorder)

    def __str__(self) -> str:
        return f"generate(<{len(self.lengths)} prompt(s) of lengths {list(self.lengths)}>, {self.max_new_tokens})"

    @property
    def ran_compiled(self) -> bool:
        """Compiled code ran: a guard matched, or dynamo compiled (and so ran) a frame without failing."""
        return self.guard_hits > 0 or any(not (e.limit_hit or e.failed) for e in self.compiles)


@dataclass
class EngineUnderTest:
    ref: EngineRef
    spec: ModelSpec
    engine: Any
    max_new_tokens: int
    tie_tolerance: float
    window: int | None
    build_compiles: tuple[CompileEvent, ...] = ()  # dynamo compiles while the factory ran
    build_captures: tuple[str, ...] = ()  # CUDA graph captures while the factory ran
    max_near_ties: int | None = None
    score_tolerance: float = 0.0
    cuda_grown: int | None = None  # growth of torch.cuda.memory_allocated() while the factory ran and during every
    # call since (CUDA only): what the engine holds, allocations made only from C++ included, and nothing else
    history: list[Call] = field(default_factory=list)
    progress: Callable[[str], None] = field(default=lambda line: None, repr=False)  # long work, as it happens
    #: (engine, model, call, calls served before) before each call: the live reports' beat (reports/live.py)
    on_call: Callable[[str, str, str, int], None] = field(default=lambda *beat: None, repr=False)
    #: seconds each generate() call took (wall, the pipe to an isolated engine included): the run's engine time
    spent: Callable[[float], None] = field(default=lambda seconds: None, repr=False)
    call_timeout: float = 0.0  # --kv-call-timeout, for in-process engines (isolated ones enforce it in the parent)
    broken: str | None = None  # why this engine object must not serve another test (a call timed out, its process died)
    excluded: tuple[int, ...] = ()  # ids it declares it never emits on this model (Declaration.never_emits)
    noise: Any = None  # oracles.precision.Noise its verdict numbers were measured from (16-bit, a KV stored lower)
    #: where the engine runs (run/host.py); without one, the host of `engine` (in process unless it is a proxy)
    host: Host = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.host is None:
            self.host = host_of(self.engine)

    def __repr__(self) -> str:
        return f"<engine '{self.name}' on model '{self.spec.name}'>"

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def compiled_observed(self) -> bool:
        """Dynamo compiled something for this engine (at build or in a call), its compiled code ran, or it captured a
    CUDA graph."""
        return bool(self.build_compiles or self.build_captures) or any(
            c.compiles or c.guard_hits or c.captures for c in self.history)

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int | None = None) -> list[list[int]]:
        """engine.generate over these prompts (one call), validated and recorded in `history`."""
        n = max_new_tokens or self.max_new_tokens
        outside = self.outside_bounds([len(p) for p in prompts], n)
        started = time.perf_counter()
        allocated = cuda_allocated(self.spec.device)
        call = Call(tuple(len(p) for p in prompts), n)
        seen = None
        try:
            with self.host.observing() as seen, self._guarded(call):  # dynamo here and where the engine runs
                return engine_io.generate(self.ref, self.engine, [p.ids for p in prompts], n, self.spec.vocab_size,
                                          outside=outside)
        finally:
            self.spent(time.perf_counter() - started)
            if allocated is not None and self.cuda_grown is not None:
                self.cuda_grown += cuda_allocated(self.spec.device) - allocated
            seen = seen or Observed()  # (the recorder itself failed to start)
            self.history.append(Call(call.lengths, n, seen.compiles, seen.guard_hits, seen.eager_runs, seen.captures))
            if seen.compiles:
                self.progress(f"{self.name} / {self.spec.name}: {self.history[-1]} compiled {len(seen.compiles)} "
                              f"frame(s), {time.perf_counter() - started:.1f} s")

    @contextlib.contextmanager
    def drafting(self, drafter: Any) -> Iterator[None]:
        """A speculative engine's ``use_drafter(drafter)`` (contract/speculative.py) for the calls inside, then its own
        draft again (``use_drafter(None)``): the engine object serves later tests as built."""
        __tracebackhide__ = True
        with self._guarded(f"use_drafter({type(drafter).__name__})"):
            engine_io.use_drafter(self.ref, self.engine, drafter)
        try:
            yield
        finally:
            if not self.broken:
                with self._guarded("use_drafter(None)"):
                    engine_io.use_drafter(self.ref, self.engine, None)

    def acceptance(self, rows: int) -> list[list[tuple[int, int]]]:
        """A speculative engine's ``acceptance()`` after a generate() of `rows` prompts, validated: per row its
        (drafted, accepted) pairs per verify step."""
        __tracebackhide__ = True
        with self._guarded("acceptance()"):
            return engine_io.acceptance(self.ref, self.engine, rows, self.ref.declaration.speculative.k)

    def concurrently(self, calls: Sequence[Sequence[Prompt]],
                     max_new_tokens: int | None = None) -> list[list[list[int]]]:
        """Each entry of `calls` as one ``generate()`` call, all released at once from threads of their own (a
        server's concurrent users; an engine declaring thread_safe), validated like any call and recorded in `history`.
        Fails the test naming the call that raised, or that did not return within --kv-call-timeout (else
        CONCURRENT_TIMEOUT_S): a stuck thread is left behind (a daemon), the engine object is not used again."""
        __tracebackhide__ = True
        n = max_new_tokens or self.max_new_tokens
        limit = self.call_timeout or CONCURRENT_TIMEOUT_S
        found: list[Any] = [None] * len(calls)
        start = threading.Barrier(len(calls))
        shown = [f"{Call(tuple(len(p) for p in call), n)}" for call in calls]

        def run(i: int, engine: Any = None) -> None:
            try:
                if engine is None:
                    start.wait(limit)
                found[i] = ("ok", engine_io.generate(self.ref, engine or self.engine, [p.ids for p in calls[i]], n,
                                                     self.spec.vocab_size,
                                                     outside=self.outside_bounds([len(p) for p in calls[i]], n)))
            except BaseException as exc:  # pytest.fail/skip outcomes too: re-raised in the test's thread
                found[i] = ("raised", exc)

        self.on_call(self.name, self.spec.name, f"{len(calls)} concurrent calls: {'; '.join(shown)}", len(self.history))
        threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"kvcompile-call-{i}")
                   for i in range(len(calls))]
        deadline, started = time.monotonic() + limit, time.perf_counter()
        with self.host.observing() as seen:
            # an isolated engine's process releases the round from its own threads; its answers checked here
            answered = self.host.concurrently([[p.ids for p in call] for call in calls], n, limit)
            for i, answer in enumerate(answered or ()):
                run(i, answer)
            for thread in threads if answered is None else ():
                thread.start()
            for thread in threads if answered is None else ():
                thread.join(max(0.0, deadline - time.monotonic()))
        self.spent(time.perf_counter() - started)  # the round's wall time: the calls overlap
        events = seen.compiles
        self.history += [Call(tuple(len(p) for p in call), n, events if i == 0 else ()) for i, call in enumerate(calls)]
        hung = [i for i, thread in enumerate(threads) if thread.is_alive()]
        if hung:
            self.broken = (f"engine '{self.name}' on model '{self.spec.name}': call {hung[0] + 1} of {len(calls)} sent "
                           f"concurrently, {shown[hung[0]]}, did not return within {limit:g} s "
                           f"({CALL_TIMEOUT} or {CONCURRENT_TIMEOUT_S:g} s); {len(hung)} call(s) still running")
            fail(self.broken + "\n  The next test of this engine x model builds it anew.", pytrace=False)
        raised = next((result[1] for result in found if result[0] == "raised"), None)
        if raised is not None:
            raise raised
        return [result[1] for result in found]

    @property
    def max_positions(self) -> int | None:
        """Prompt + new tokens one call may hold: the model's position table, narrowed by a declared
        ``Bounds(max_positions=N)`` (a static cache's length); None: no limit known. The suites' longest calls (long
        generation, prefix floods) are sized to it, so an engine is checked up to its end rather than skipped."""
        from pytest_kvcompile.models.checkpoints import max_positions

        bounds = self.ref.declaration.bounds
        limits = [n for n in (max_positions(self.spec.config), bounds and bounds.max_positions) if n]
        return min(limits, default=None)

    def outside_bounds(self, lengths: Sequence[int], new_tokens: int) -> str | None:
        """Why this call is outside the shapes the engine declares it refuses (Declaration.bounds), or None. The call
        is still made: a refusal (the engine raises) is a named skip, an answer is judged like any other, so a
        declared bound never hides wrong output (LitGPT 0.5.12 answered prompts longer than its window, wrongly)."""
        bounds = self.ref.declaration.bounds
        outside = bounds.outside(lengths, new_tokens, self.window) if bounds is not None else None
        if not outside:
            return None
        return (f"engine '{self.name}' declares {bounds} on model '{self.spec.name}': this check's call "
                f"generate(<{len(lengths)} prompt(s) of lengths {list(lengths)}>, {new_tokens}) is outside them "
                f"({outside})")

    @property
    def isolated(self) -> bool:
        """The engine runs in a process of its own (run/isolation.py), read-only; the package asks its `host` for
        what differs instead."""
        return self.host.isolated

    def reset_dynamo(self) -> None:
        """A fresh dynamo where the engine compiles (recompiles.recorder.reset_dynamo, in its process if isolated),
        so its compiles are counted from scratch."""
        self._hosted(self.host.reset_dynamo)

    def isolate_compiles(self) -> None:
        """Deprecated: `reset_dynamo` ("isolate" is the engine's own process, --kv-isolate)."""
        warnings.warn("kv_engine.isolate_compiles() is deprecated: call kv_engine.reset_dynamo()", DeprecationWarning,
                      stacklevel=2)
        self.reset_dynamo()

    @contextlib.contextmanager
    def _guarded(self, call: Any) -> Iterator[None]:
        """--kv-call-timeout as the host enforces it (SIGALRM in process; an isolated engine's proxy kills its
        process), and a dead engine: fail the test, mark this object broken (the next test builds the engine anew)."""
        __tracebackhide__ = True
        self.on_call(self.name, self.spec.name, str(call), len(self.history))
        try:
            with self.host.bounded(self.call_timeout):
                yield
        except CallTimeout:
            self.broken = (f"engine '{self.name}' on model '{self.spec.name}': {call} did not return within "
                           f"{self.call_timeout:g} s ({CALL_TIMEOUT}); the call was interrupted (SIGALRM)")
            fail(f"{self.broken}\n{self.served(len(self.history))}\n  The run goes on: the next test of this "
                 "engine x model builds it anew. If the call is only slow, raise "
                 f"{CALL_TIMEOUT}; if it hangs inside C code, isolate the engine (--kv-isolate={self.name})",
                        pytrace=False)
        except Failed:
            if self.host.dead:
                self.broken = self.host.dead
            raise

    def held(self) -> Held:
        """memory.measure.held_by of the engine object, measured where the engine lives."""
        return self._hosted(self.host.held)

    def _hosted(self, what: Callable[[], Any]) -> Any:
        """A measurement or reset where the engine lives; the death of its process fails the test with the engine's
        message."""
        __tracebackhide__ = True
        try:
            return what()
        except EngineProcessDied as exc:
            self.broken = str(exc)
            fail(str(exc), pytrace=False)

    @contextlib.contextmanager
    def tensor_census(self) -> Iterator[Callable[[], int]]:
        """A census of live tensors created from here on (memory.measure.live_tensor_bytes after gc.freeze()), taken
        in the engine's process."""
        self._hosted(self.host.freeze)
        try:
            yield lambda: self._hosted(self.host.live_tensor_bytes)
        finally:
            self._hosted(self.host.unfreeze)

    def served(self, before: int | None = None) -> str:
        """What this engine object served before call number `before` (default: all), for failure messages."""
        calls = self.history[:before]
        if not calls:
            return "  engine object: a fresh one (no earlier calls)"
        shown = "; ".join(map(str, calls[-4:]))
        return (f"  engine object: served {len(calls)} earlier call(s) in this process before this one"
                f"{' (the last 4)' if len(calls) > 4 else ''}: {shown}; to rule out state left by them, rerun with "
                f"{FRESH_ENGINE} (a fresh engine per test)")

    @property
    def judge(self) -> Judge:
        """How this engine's answers are judged on its model (run/judge.py): its verdict numbers, as they are now."""
        return Judge(self.name, self.spec.name, self.max_new_tokens, self.tie_tolerance, self.window,
                     self.max_near_ties, self.score_tolerance, self.excluded, self.noise,
                     str(self.ref.declaration.strategy), decoder(getattr(self.spec, "path", None)),
                     states_of(self.spec.config))

    def check_tokens(self, reference: Reference, got: Sequence[int], prompt: Prompt,
                     where: Where | str = "alone") -> Verdict:
        """token_match.check_tokens with this run's tolerances, the model's window and the engine's call history:
        the verdict, or TokenMismatch (the kv_check_tokens fixture records either for the reports)."""
        __tracebackhide__ = True
        return self.judge.tokens(reference, got, prompt, where, self.served(len(self.history) - 1),
                                 self.host.top_logprobs(prompt.ids, got))

    @property
    def server(self) -> bool:
        """The engine is a server over HTTP (run/host.py: Server): its answers carry its own top-k log-probabilities."""
        return self.host.server

    def near_tie_budget(self, steps: int) -> int | None:
        """Near ties one sequence of `steps` may hold (run/judge.py: Judge.near_tie_budget)."""
        return self.judge.near_tie_budget(steps)

    def check(self, *args: Any, **kwargs: Any) -> Verdict:
        """Deprecated spelling of `check_tokens` (it checks the tokens and records nothing: use kv_check_tokens)."""
        __tracebackhide__ = True
        warnings.warn("kv_engine.check() is deprecated: call kv_engine.check_tokens() (same arguments), or the "
                      "kv_check_tokens fixture, which also records the verdict", DeprecationWarning, stacklevel=2)
        return self.check_tokens(*args, **kwargs)

    def differs(self, prompt: Prompt, first: Sequence[int], second: Sequence[int],
                reference: Reference | Callable[[], Reference | None] | None = None) -> str | None:
        """How two outputs of this engine for `prompt` (alone vs batched, repeated calls) differ beyond a near tie
        ("at step 3 (17 vs 40): ..."), or None. Equal outputs agree; at their first difference the two tokens are
        judged by the rule of the token checks (oracles/token_match.py: the tie tolerance, in 16-bit also the noise at
        the position): on the oracle's logits given their shared prefix (`reference`, or a callable giving it, asked
        only on a difference), else on the engine's own declared score(). Without either, any difference is beyond a
        near tie: nothing can tell it from one (in 16-bit, other shapes legitimately flip near ties)."""
        scored = (lambda: self.scored(prompt, first)) if self.ref.declaration.scoring else None
        return self.judge.difference(first, second, reference, scored)

    def scored(self, prompt: Prompt, got: Sequence[int]) -> Any:
        """The engine's declared score(prompt, got): logits [len(got), vocab], validated (None: it declares none)."""
        __tracebackhide__ = True
        if not self.ref.declaration.scoring:
            return None
        with self._guarded(f"score(<prompt of length {len(prompt)}>, <continuation of length {len(got)}>)"):
            return engine_io.score(self.ref, self.engine, self.spec.vocab_size)(list(prompt.ids), list(got))

    def beyond_noise(self, reference: Reference, got: Sequence[int], scored: Any) -> int:
        """Steps where `scored` is farther from the oracle's rows than the dtype's typical noise (run/judge.py)."""
        return self.judge.beyond_noise(reference, got, scored)

    def check_score(self, reference: Reference, got: Sequence[int], prompt: Prompt, scored: Any = None) -> float | None:
        """A declared score(): its rows (`scored`, else asked now) against the oracle's along `got`, and its argmax
        against `got`; a server's log-probabilities where it declares none."""
        __tracebackhide__ = True
        if not self.ref.declaration.scoring:
            return self._check_logprobs(reference, got, prompt) if self.server else None
        return self.judge.score(reference, got, prompt, self.scored(prompt, got) if scored is None else scored)

    def _check_logprobs(self, reference: Reference, got: Sequence[int], prompt: Prompt) -> float | None:
        """A server's teacher-forced top-k log-probabilities along `got` against the oracle's
        (token_match.check_logprobs): the check of score() for engines giving log-probabilities; None where its API
        gives none (llama.cpp)."""
        __tracebackhide__ = True
        what = f"prompt log-probabilities(<prompt of length {len(prompt)}>, <continuation of length {len(got)}>)"
        with self._guarded(what):
            try:
                rows = self.host.prompt_logprobs(prompt.ids, got)
            except EngineFailed as exc:  # a server gone (then broken) or answering out of its format
                self.broken = self.host.dead
                fail(str(exc), pytrace=False)
        return None if rows is None else self.judge.logprobs(reference, got, prompt, rows)

