"""Where an engine under test runs: its host, one interface (`Host`) with three implementations.

- `InProcess`: the engine object lives in the pytest process. A call is bounded by --kv-call-timeout with SIGALRM
  (`deadline`), dynamo is observed here, memory is measured on the object itself, the caller times a call.
- `Subprocess`: the engine is built in a child process of its own (run/isolation.py: `IsolatedEngine`, the parent's
  proxy for it, ``--kv-isolate``). The proxy enforces --kv-call-timeout on the pipe; what dynamo did in the child
  comes back with every call and is merged with what the parent saw; memory, the tensor census and dynamo resets
  happen in the child; a generate() is timed in the child, without the pipe. Its death (a signal, a kill after the
  timeout) is `dead`, and what fails the test is `EngineProcessDied` with the whole message.
- `Server`: an engine over HTTP (engines/server.py), its client in process: its answers carry the server's top-k
  log-probabilities (`top_logprobs`, `prompt_logprobs`), it takes concurrent requests up to its own cap
  (`max_concurrency`), and `close` stops it.

Everything that differs between the hosts lives here and in run/isolation.py: the engine under test
(run/harness.py: EngineUnderTest), the session, the latency rule and the suites use a host's methods and never ask
which host an engine has (tests/test_host.py checks it).
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_kvcompile.contract import engine_io
from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.contract.registry import EngineRef
from pytest_kvcompile.engines.server import ServerEngine
from pytest_kvcompile.errors import CallTimeout
from pytest_kvcompile.memory.measure import Held, held_by, live_tensor_bytes
from pytest_kvcompile.recompiles.recorder import CompileEvent, CompileRecorder, reset_dynamo
from pytest_kvcompile.run.isolation import IsolatedEngine

TimeMs = Callable[[Callable[[], object]], float]  # latency.measure.timer_for's timer: fn's wall time in ms


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise CallTimeout in this (main) thread after `seconds` (SIGALRM; 0: no limit). Interrupts Python code,
    sleeps and lock waits; not C code that never returns to the interpreter (isolate such engines)."""
    usable = seconds > 0 and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    outer = signal.getitimer(signal.ITIMER_REAL) if usable else (0.0, 0.0)
    previous = signal.getsignal(signal.SIGALRM) if usable else None
    # an outer timer due first (pytest-timeout's signal method, an enclosing deadline) keeps the alarm to itself;
    # a handler installed from C cannot be restored: leave both alone
    if not usable or previous is None or (outer[0] and outer[0] <= seconds):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise CallTimeout(seconds)

    started = time.monotonic()
    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer[0]:  # re-arm the outer timer with what it had left
            signal.setitimer(signal.ITIMER_REAL, max(outer[0] - (time.monotonic() - started), 1e-3), outer[1])


def cuda_allocated(device: str) -> int | None:
    """torch.cuda.memory_allocated() of `device` after a synchronize, without cuBLAS workspaces, or None off CUDA.

    cuBLAS keeps a workspace per (handle, stream) in the caching allocator (32 MiB each on Hopper), made by
    whichever code runs the first matmul on a stream: process state, not an engine's. They are cleared
    before reading, as torch's own CUDA leak check does (`recompiles.hooks.clear_cublas_workspaces`); a graph
    captured with one keeps it in its private pool, which still counts."""
    import torch

    from pytest_kvcompile.recompiles.hooks import clear_cublas_workspaces

    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    clear_cublas_workspaces()
    return torch.cuda.memory_allocated(device)


@dataclass
class Observed:
    """What dynamo did during one call, wherever the engine runs (filled when `Host.observing` exits)."""

    compiles: tuple[CompileEvent, ...] = ()
    guard_hits: int = 0  # frames entered whose compiled code matched its guards and ran
    eager_runs: int = 0  # frames whose guards failed and that then ran eagerly
    captures: tuple[str, ...] = ()  # CUDA graph captures: who asked


class Host(ABC):
    """Where an engine runs, and everything that depends on it. `engine` is what calls go to (through
    contract/engine_io.py): the engine object itself, or a proxy forwarding the engine contract's calls.

    Methods that reach the engine's process (`reset_dynamo`, `held`, the census) raise `EngineProcessDied` when it
    is gone; its message is the whole failure (the engine under test fails the test with it)."""

    engine: Any
    isolated: bool  # runs in a process of its own (kept for EngineUnderTest.isolated, a public read-only property)
    build_compiles: tuple[CompileEvent, ...] = ()  # dynamo compiles while the factory ran
    build_captures: tuple[str, ...] = ()  # CUDA graph captures while the factory ran
    cuda_grown: int | None = None  # growth of torch.cuda.memory_allocated() while the factory ran (None: not here)
    #: torch.cuda in this process counts the engine's allocations (False: they are another process's)
    cuda_here: bool = True
    #: why `engine` answers only the contract's calls, not the engine object's own attributes (a server's
    #: `served`), or None
    unreachable: str | None = None
    #: the engine is a server over HTTP (`Server`): its answers carry its own top-k log-probabilities
    server: bool = False

    def top_logprobs(self, prompt: Sequence[int], tokens: Sequence[int]) -> list[dict[int, float]] | None:
        """The engine's own top-k log-probabilities along `tokens` where its answers carry them (a server), else
        None."""
        return None

    def prompt_logprobs(self, prompt: Sequence[int], tokens: Sequence[int]) -> Any:
        """The engine's own top-k log-probabilities teacher-forced along `tokens` where its API gives them (a server:
        engines/server.py, ServerEngine.teacher_forced), else None."""
        return None

    @property
    def max_concurrency(self) -> int | None:
        """Requests the engine takes at once by its own limit (a server's ``?max_concurrency=N``), None: no limit."""
        return None

    def concurrently(self, calls: list[list[list[int]]], max_new_tokens: int, timeout: float) -> list[Any] | None:
        """Where the engine's process runs a round of concurrent calls itself (isolated): per call a stand-in whose
        ``generate()`` gives that call's answer, for the call's own checks. None: the caller releases the calls from
        threads in this process."""
        return None

    @property
    def where(self) -> str:
        """Where the engine runs, as a suffix for messages ("built in 1.2 s in process 4242"): '' in process."""
        return ""

    @property
    def dead(self) -> str | None:
        """Why the engine can serve no further call (its process died or was killed; a server gone), else None."""
        return None

    @contextlib.contextmanager
    def bounded(self, seconds: float) -> Iterator[None]:
        """--kv-call-timeout around one call, as this host enforces it (see the implementations)."""
        yield

    @contextlib.contextmanager
    def observing(self) -> Iterator[Observed]:
        """What dynamo did during the calls inside (in this process, and where the engine runs): the yielded
        `Observed` is filled on exit, exception or not."""
        seen, recorder = Observed(), CompileRecorder()
        try:
            with recorder:
                yield seen
        finally:
            (seen.guard_hits, seen.eager_runs), seen.compiles = recorder.guards, tuple(recorder.events)
            seen.captures = tuple(recorder.captures)
            self._merge(seen)

    @abstractmethod
    def _merge(self, seen: Observed) -> None:
        """Add what dynamo did where the engine runs, when that is not here."""

    @abstractmethod
    def reset_dynamo(self) -> None:
        """A fresh dynamo where the engine compiles (recompiles.recorder.reset_dynamo)."""

    @abstractmethod
    def held(self) -> Held:
        """memory.measure.held_by of the engine object, measured where the engine lives."""

    @abstractmethod
    def freeze(self) -> None:
        """Start a live-tensor census where the engine lives: gc.collect(), then gc.freeze()."""

    @abstractmethod
    def live_tensor_bytes(self) -> int:
        """memory.measure.live_tensor_bytes where the engine lives (tensors created since `freeze`)."""

    @abstractmethod
    def unfreeze(self) -> None:
        """End the census: gc.unfreeze() where the engine lives (nothing once its process is gone)."""

    @abstractmethod
    def timed(self, call: Callable[[], object], time_ms: TimeMs) -> float:
        """`call` (one generate() of the engine) made, and its time in ms: `time_ms(call)`, or the engine's own
        process's measure of it where the pipe to it would be counted otherwise."""

    @abstractmethod
    def close(self) -> None:
        """Release what runs the engine now rather than when collected."""


class InProcess(Host):
    """The engine object in the pytest process."""

    isolated = False

    def __init__(self, engine: Any, build_compiles: tuple[CompileEvent, ...] = (), build_captures: tuple[str, ...] = (),
                 cuda_grown: int | None = None) -> None:
        self.engine, self.build_compiles, self.build_captures = engine, build_compiles, build_captures
        self.cuda_grown = cuda_grown

    @classmethod
    def build(cls, ref: EngineRef, spec: ModelSpec, compile_backend: str) -> InProcess:
        """The engine's factory run here, under a compile recorder (engines that compile up front, vLLM, do it
        then) and with the growth of CUDA memory while it ran."""
        before = cuda_allocated(spec.device)
        with CompileRecorder() as recorder:
            engine = engine_io.build(ref, spec, compile_backend)
        grown = None if before is None else cuda_allocated(spec.device) - before
        return cls(engine, tuple(recorder.events), tuple(recorder.captures), grown)

    def bounded(self, seconds: float) -> contextlib.AbstractContextManager[None]:
        """SIGALRM after `seconds` (`deadline`: CallTimeout; 0: no limit)."""
        return deadline(seconds)

    def _merge(self, seen: Observed) -> None:
        """Nothing: the recorder ran where the engine did."""

    def reset_dynamo(self) -> None:
        reset_dynamo()

    def held(self) -> Held:
        return held_by(self.engine)

    def freeze(self) -> None:
        gc.collect()
        gc.freeze()

    def live_tensor_bytes(self) -> int:
        return live_tensor_bytes()

    def unfreeze(self) -> None:
        gc.unfreeze()

    def timed(self, call: Callable[[], object], time_ms: TimeMs) -> float:
        return time_ms(call)

    def close(self) -> None:
        """Nothing: the engine is left to the garbage collector."""


class Server(InProcess):
    """An engine reached over HTTP (engines/server.py: ServerEngine): its client object in this process, the model
    in the server's. Its answers carry the server's top-k log-probabilities, it takes concurrent requests up to its
    own cap, and closing it stops the server (a managed one's process)."""

    server = True
    engine: ServerEngine

    @property
    def dead(self) -> str | None:
        """What the client says of its server: gone (unreachable, timed out; engines/server.py), else None."""
        return self.engine.dead

    def top_logprobs(self, prompt: Sequence[int], tokens: Sequence[int]) -> list[dict[int, float]] | None:
        return self.engine.top_logprobs(prompt, tokens)

    def prompt_logprobs(self, prompt: Sequence[int], tokens: Sequence[int]) -> Any:
        return self.engine.teacher_forced(prompt, tokens)

    @property
    def max_concurrency(self) -> int | None:
        limits = getattr(self.engine, "limits", None)
        return getattr(limits, "max_concurrency", None)

    def close(self) -> None:
        self.engine.close()


class Subprocess(Host):
    """The engine in a child process of its own, reached through its proxy (run/isolation.py: IsolatedEngine)."""

    isolated = True
    cuda_here = False
    unreachable = "the engine runs isolated"

    def __init__(self, engine: IsolatedEngine) -> None:
        self.engine: IsolatedEngine = engine
        self.build_compiles, self.build_captures = engine.build_compiles, engine.build_captures

    @classmethod
    def build(cls, ref: EngineRef, spec: ModelSpec, compile_backend: str, call_timeout: float) -> Subprocess:
        """The engine built in a child process, which reports what dynamo did there while its factory ran; its
        CUDA allocations are that process's (`cuda_grown` stays None)."""
        return cls(IsolatedEngine(ref.name, ref.target, ref.source, spec, compile_backend, call_timeout))

    @property
    def where(self) -> str:
        return f" in process {self.engine.proc.pid}"

    @property
    def dead(self) -> str | None:
        return self.engine.dead

    # bounded: no SIGALRM here, the proxy's wait on the pipe enforces the call timeout (and kills the process)

    def _merge(self, seen: Observed) -> None:
        """What dynamo did in the engine's process during the last generate() (the proxy's `observed`)."""
        compiles, hits, eager, captures = self.engine.observed
        seen.compiles, seen.guard_hits = seen.compiles + tuple(compiles), seen.guard_hits + hits
        seen.eager_runs, seen.captures = seen.eager_runs + eager, seen.captures + tuple(captures)

    def concurrently(self, calls: list[list[list[int]]], max_new_tokens: int, timeout: float) -> list[Any]:
        """The round released at once from threads in the engine's process (run/isolation.py: IsolatedEngine)."""
        return self.engine.concurrently(calls, max_new_tokens, timeout)

    def reset_dynamo(self) -> None:
        self.engine.remote("reset")

    def held(self) -> Held:
        return self.engine.remote("held")

    def freeze(self) -> None:
        self.engine.remote("freeze")

    def live_tensor_bytes(self) -> int:
        return self.engine.remote("live")

    def unfreeze(self) -> None:
        if not self.engine.dead:
            self.engine.remote("unfreeze")

    def timed(self, call: Callable[[], object], time_ms: TimeMs) -> float:
        """The engine's process times generate() itself (perf_counter after a CUDA synchronize): not the pipe."""
        call()
        return self.engine.last_ms

    def close(self) -> None:
        """End the engine's process (and what it forked)."""
        self.engine.close()


def build(ref: EngineRef, spec: ModelSpec, compile_backend: str, call_timeout: float, isolated: bool) -> Host:
    """The engine built for `spec` where the run says it runs (config.options.Settings.isolated)."""
    if isolated:
        return Subprocess.build(ref, spec, compile_backend, call_timeout)
    return _served(InProcess.build(ref, spec, compile_backend))


def _served(host: InProcess) -> InProcess:
    """A server's client is a `Server` host."""
    if isinstance(host.engine, ServerEngine):
        return Server(host.engine, host.build_compiles, host.build_captures, host.cuda_grown)
    return host


def host_of(engine: Any) -> Host:
    """The host of an engine object built elsewhere (an EngineUnderTest constructed without one)."""
    return Subprocess(engine) if isinstance(engine, IsolatedEngine) else _served(InProcess(engine))
