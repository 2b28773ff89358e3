"""Engines in a process of their own: a crash or a hang fails one test, not the run.

Native runtimes (llama.cpp, ONNX Runtime, C++ engines) can segfault, abort or hang inside C code, and in the
pytest process that takes the run and its reports with it. An *isolated* engine (its declaration says
``isolated=True``, or ``--kv-isolate=NAME,...|all``) is built in a child Python process; ``generate``, ``score``,
``kv_cache_bytes``, a speculative engine's ``use_drafter`` and ``acceptance``, the concurrency suite's rounds
(released at once from threads in the child, as in process) and the memory measurements are forwarded to it over a
pipe, and what dynamo did in the child comes back with every call, so the recompile and memory
checks still observe the engine itself.

- The child dies (a signal, ``os._exit``): the test fails naming the signal, the call and the engine's last output
  (faulthandler's Python stack included).
- A call outlives ``--kv-call-timeout``: the child's Python stacks are dumped, it is killed, and the test fails
  naming the call and where it was.

Either way the next test of that engine x model builds it anew in a fresh process.

Protocol: length-prefixed pickles over the child's stdin and its original stdout; the child points its fd 1 at
its stderr, which goes to a log file whose tail the failure quotes.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any

from pytest_kvcompile.errors import EngineProcessDied, Failed, RemoteError, Skipped, fail, skip

_HEADER = struct.Struct("<Q")
LOG_TAIL_LINES = 30
BUILD_TIMEOUT_FACTOR = 10  # with --kv-call-timeout=T, building the engine may take 10 T (compiles, conversions)
POLL_S = 1.0  # how often a waiting parent checks that the child is still alive (a forked helper keeps the pipe open)
_LIVE: weakref.WeakSet[IsolatedEngine] = weakref.WeakSet()


def _signal_name(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"{signal.Signals(-returncode).name} (signal {-returncode})"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


class IsolatedEngine:
    """The parent's handle on an engine built in a child process; quacks like the engine (generate, score,
    kv_cache_bytes) and answers `remote()` for measurements taken where the engine lives. Only its host uses the
    rest (run/host.py: Subprocess: `observed`, `last_ms`, `dead`, `proc`, `close`)."""

    def __init__(self, name: str, target: str, source: str, spec: Any, compile_backend: str,
                 timeout: float | None) -> None:
        self.name, self.model, self.timeout = name, spec.name, timeout or None
        self.calls: list[str] = []
        self.dead: str | None = None
        self.proc, self._log = _take_process()
        _LIVE.add(self)
        weakref.finalize(self, _reap, self.proc, self._log.name)  # dropped without close(): no process or log left
        what = f"its factory {target}(ModelSpec(name='{spec.name}', ...))"
        try:  # the reply to "build": what dynamo compiled and captured while the factory ran
            self.build_compiles, self.build_captures = self._ask(
                ("build", list(sys.path), name, target, source, spec, compile_backend, _threads()), what,
                timeout=self.timeout and BUILD_TIMEOUT_FACTOR * self.timeout)
        except RemoteError as exc:
            self.close()

            fail(f"engine '{name}' raised {exc.remote_type} in {what} (in its own process): {exc}\n"
                 f"The traceback:\n{exc.remote_traceback}", pytrace=False)
        except BaseException:
            self.close()
            raise

    # --- the engine's methods ---------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Any:
        what = f"generate(<{len(prompts)} prompt(s) of lengths {[len(p) for p in prompts]}>, max_new_tokens=" \
               f"{max_new_tokens})"
        self.observed, self.last_ms = ((), 0, 0, ()), None
        out, self.observed, self.last_ms = self._ask(("generate", prompts, max_new_tokens), what)
        return out

    def score(self, prompt: list[int], continuation: list[int]) -> Any:
        return self._ask(("score", prompt, continuation),
                         f"score(<prompt of length {len(prompt)}>, <continuation of length {len(continuation)}>)")

    def kv_cache_bytes(self) -> Any:
        return self._ask(("kv_cache_bytes",), "kv_cache_bytes()")

    def use_drafter(self, drafter: Any) -> None:  # a speculative engine's (contract/speculative.py): picklable drafters
        self._ask(("use_drafter", drafter), f"use_drafter({type(drafter).__name__})")

    def acceptance(self) -> Any:
        return self._ask(("acceptance",), "acceptance()")

    def concurrently(self, calls: list[list[list[int]]], max_new_tokens: int, timeout: float) -> list[Answered]:
        """Each of `calls` as one generate() in the engine's process, all released at once from threads of their own
        there (as run/harness.py's concurrently does in process); the answers, each to be replayed through
        contract/engine_io.py for its checks. The whole round is bounded by `timeout`."""
        what = (f"{len(calls)} concurrent generate() calls (lengths {[[len(p) for p in c] for c in calls]}, "
                f"max_new_tokens={max_new_tokens})")
        self.observed, self.last_ms = ((), 0, 0, ()), None
        answers, self.observed, self.last_ms = self._ask(("concurrent", calls, max_new_tokens, timeout), what,
                                                        timeout=timeout)
        self.calls += [f"generate(<{len(c)} prompt(s) of lengths {[len(p) for p in c]}>, max_new_tokens="
                       f"{max_new_tokens}) (concurrent)" for c in calls]
        return [Answered(tuple(answer)) for answer in answers]

    def remote(self, what: str) -> Any:
        """A measurement or reset in the engine's process: 'held' (memory.measure.held_by of the engine),
        'freeze' / 'live' / 'unfreeze' (the live-tensor census, memory.measure.live_tensor_bytes), 'reset'
        (recompiles.recorder.reset_dynamo: a fresh dynamo)."""
        return self._ask((what,), f"measuring '{what}'")

    observed: tuple[tuple, int, int, tuple] = ((), 0, 0, ())  # the last call's (compiles, hits, eager runs, captures)
    last_ms: float | None = None  # the last generate()'s wall time in the engine's process (latency/measure.py)
    closed = False  # close() ran

    # --- the pipe -------------------------------------------------------------------------------------------------
    def _ask(self, request: tuple, what: str, timeout: float | None | str = "call") -> Any:
        if self.dead:
            raise EngineProcessDied(self.dead)
        data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        limit = self.timeout if timeout == "call" else timeout
        deadline = None if limit is None else time.monotonic() + limit
        try:
            try:
                self.proc.stdin.write(_HEADER.pack(len(data)) + data)  # a buffered pipe: write() sends it all
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._died(what)
            (size,) = _HEADER.unpack(self._read(_HEADER.size, what, deadline))
            status, *payload = pickle.loads(self._read(size, what, deadline))
        except EngineProcessDied:
            raise
        except BaseException:  # interrupted mid-call (a test timeout, Ctrl-C): its reply would answer the next call
            self.dead = f"engine '{self.name}' on model '{self.model}': {what} was interrupted; its process was killed"
            self.close()
            raise
        if request[0] in ("generate", "score"):
            self.calls.append(what)
        return _decoded(status, payload)

    def _read(self, size: int, what: str, deadline: float | None) -> bytes:
        fd, chunks, got = self.proc.stdout.fileno(), [], 0
        while got < size:
            wait = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
            ready = select.poll()
            ready.register(fd, select.POLLIN | select.POLLHUP)
            if not ready.poll(wait * 1000):
                if self.proc.poll() is not None:  # dead, though something it forked still holds the pipe
                    self._died(what)
                if deadline is not None and time.monotonic() >= deadline:
                    self._timed_out(what)
                continue
            chunk = os.read(fd, size - got)
            if not chunk:
                self._died(what)
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _tail(self) -> str:
        self._log.flush()
        with open(self._log.name, errors="replace") as log:
            lines = [line if len(line) <= 200 else line[:200] + " ..." for line in log.read().splitlines()
                     if line.strip() and not line.startswith("Extension modules:")][-LOG_TAIL_LINES:]
        return "\n".join("    " + line for line in lines) or "    (nothing)"

    def _served(self) -> str:
        if not self.calls:
            return "  calls it served before: none"
        return f"  calls it served before: {len(self.calls)}, the last: {self.calls[-1]}"

    def _died(self, what: str) -> None:
        status = _signal_name(self.proc.wait())
        self.dead = (
            f"engine '{self.name}' on model '{self.model}' crashed: its process (pid {self.proc.pid}) died of {status} "
            f"during {what}\n{self._served()}\n  its last output (stderr, {LOG_TAIL_LINES} lines at most):\n"
            f"{self._tail()}\n  The run goes on: the next test of this engine x model builds it in a fresh process. "
            "Reproduce the call outside pytest to debug it; the Python stack above (faulthandler) shows where it died.")
        self.close()
        raise EngineProcessDied(self.dead)

    def _timed_out(self, what: str) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)  # faulthandler dumps every thread's Python stack to the log
            time.sleep(0.5)
        self.dead = (
            f"engine '{self.name}' on model '{self.model}': {what} did not return within {self.timeout:g} s "
            f"(--kv-call-timeout); its process (pid {self.proc.pid}) was killed\n{self._served()}\n"
            f"  where it was (its threads' Python stacks, then its last output):\n{self._tail()}\n"
            "  The run goes on: the next test of this engine x model builds it in a fresh process. If the call is "
            "only slow, raise --kv-call-timeout.")
        self.close()
        raise EngineProcessDied(self.dead)

    def close(self) -> None:
        """End the child: EOF on its stdin, then a kill of its whole session (what it forked too) if it does not
        leave within 5 s, or at once when it is dead or stuck. Once: a later close() (its host's on a rebuild, the
        one at exit) does nothing, so no signal can reach a process that took over the pid."""
        if self.closed:
            return
        self.closed = True
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5 if not self.dead else 0.01)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)

    def __repr__(self) -> str:
        return f"<engine '{self.name}' in process {self.proc.pid}>"


def _decoded(status: str, payload: list) -> Any:
    """A reply from the engine's process as the call's outcome here: its value, or what it raised or decided."""
    if status == "ok":
        return payload[0] if len(payload) == 1 else payload
    if status == "raised":
        raise RemoteError(*payload)

    from pytest_kvcompile.errors import NotApplicable

    if status == "not-applicable":
        raise NotApplicable(payload[0])
    if status == "skip":
        skip(payload[0])
    fail(payload[0], pytrace=False)


class Answered:
    """One generate() answered in the engine's process during a concurrent round, standing in for the engine so that
    the call's checks (contract/engine_io.py: generate) read it as they read any call: its output, or what it
    raised."""

    def __init__(self, reply: tuple) -> None:
        self.reply = reply

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> Any:
        status, *payload = self.reply
        return _decoded(status, payload)


def _threads() -> int | None:
    """torch's intra-op threads in this process, where torch is loaded: the engine's process uses as many."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


_SPARE: list[tuple[subprocess.Popen, Any]] = []  # at most one child started ahead, importing torch while unused
_TAKEN: list[int] = [0]  # children handed to engines in this process


def _spawn() -> tuple[subprocess.Popen, Any]:
    log = tempfile.NamedTemporaryFile(prefix="kvcompile-engine-", suffix=".log", delete=False)
    proc = subprocess.Popen(  # a session of its own: close() kills whatever the engine forked, too
        [sys.executable, "-m", "pytest_kvcompile.run.isolation"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=log, start_new_session=True)
    return proc, log


def _take_process() -> tuple[subprocess.Popen, Any]:
    """A child for the next engine: the spare started at the previous build (its imports done while the run went on),
    else a new one; then, from a run's second isolated engine on, the next spare starts. A process start costs ~3 s
    of imports (torch, transformers): with a spare, only the first two isolated engines of a run wait for it, and a
    run that builds one (a single engine x model, no fresh engine) starts no process it never uses."""
    found = None
    while _SPARE and found is None:
        proc, log = _SPARE.pop()
        if proc.poll() is None:
            found = proc, log
        else:
            _reap(proc, log.name)
    found = found or _spawn()
    _TAKEN[0] += 1
    if _TAKEN[0] >= 2:
        _SPARE.append(_spawn())
    return found


def _reap(proc: subprocess.Popen, log: str) -> None:
    """What close() guarantees, for an engine object collected without it (e.g. a fresh engine of one check)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    if os.path.exists(log):
        os.unlink(log)


@atexit.register
def _close_all() -> None:
    for engine in list(_LIVE):
        engine.close()
    while _SPARE:
        proc, log = _SPARE.pop()
        _reap(proc, log.name)


# --- the child ---------------------------------------------------------------------------------------------------
def _serve() -> None:
    """The child's loop: import what every engine needs (a spare does it before it is used), build the engine, then
    answer requests until stdin closes."""
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the engine's prints go to the log, not into the protocol
    # a process the engine forks must not hold the pipe: the parent would never see this process die
    os.register_at_fork(after_in_child=lambda: (os.close(channel.fileno()), os.close(0)))
    sys.stdout = sys.stderr
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch  # noqa: F401  (what every engine needs, imported before the build request comes)
    import transformers  # noqa: F401

    from pytest_kvcompile.contract import engine_io, registry  # noqa: F401
    from pytest_kvcompile.memory import measure  # noqa: F401
    from pytest_kvcompile.recompiles import recorder  # noqa: F401

    engine = None
    while True:
        header = sys.stdin.buffer.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        body = sys.stdin.buffer.read(_HEADER.unpack(header)[0])
        try:
            request = pickle.loads(body)
            if request[0] == "build":
                engine, reply = _build(*request[1:])
            else:
                reply = _answer(engine, request)
            data = pickle.dumps(("ok", reply), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # every failure goes back to the parent, which decides
            try:
                data = pickle.dumps(_failure(exc), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as unsendable:
                data = pickle.dumps(("raised", type(exc).__name__, f"(its message could not be sent: {unsendable!r})",
                                     ""), protocol=pickle.HIGHEST_PROTOCOL)
        channel.write(_HEADER.pack(len(data)) + data)
        channel.flush()


def _build(path: list[str], name: str, target: str, source: str, spec: Any, backend: str,
           threads: int | None) -> tuple[Any, Any]:
    sys.path[:] = path
    if threads:  # the parent's share of the cores (an xdist worker's, plugin._share_cores): timings as in process
        import torch

        torch.set_num_threads(threads)
    from pytest_kvcompile.contract import engine_io, registry
    from pytest_kvcompile.contract.engine import declaration_of
    from pytest_kvcompile.recompiles.recorder import CompileRecorder

    factory = registry._import_target(name, target)
    ref = registry.EngineRef(name, target, source, factory, declaration_of(factory))
    with CompileRecorder() as recorder:
        engine = engine_io.build(ref, spec, backend)
    return engine, (tuple(recorder.events), tuple(recorder.captures))


def _answer(engine: Any, request: tuple) -> Any:
    from pytest_kvcompile.memory.measure import held_by, live_tensor_bytes
    from pytest_kvcompile.recompiles.recorder import CompileRecorder

    kind, args = request[0], request[1:]
    if kind == "generate":  # timed here, as in process: the pipe and pickles are not the engine's latency
        with CompileRecorder() as recorder:
            _synchronize()
            started = time.perf_counter()
            out = engine.generate(*args)
            _synchronize()
            ms = (time.perf_counter() - started) * 1e3
        return out, (tuple(recorder.events), *recorder.guards, tuple(recorder.captures)), ms
    if kind == "concurrent":
        return _concurrently(engine, *args)
    if kind == "score":
        return engine.score(*args)
    if kind == "kv_cache_bytes":
        return engine.kv_cache_bytes()
    if kind == "use_drafter":
        return engine.use_drafter(*args)
    if kind == "acceptance":
        return engine.acceptance()
    if kind == "held":
        return held_by(engine)
    if kind == "freeze":
        gc.collect()
        return gc.freeze()
    if kind == "live":
        return live_tensor_bytes()
    if kind == "unfreeze":
        return gc.unfreeze()
    if kind == "reset":  # recompiles.recorder.reset_dynamo() where the engine compiles: its compiles from scratch
        from pytest_kvcompile.recompiles.recorder import reset_dynamo

        return reset_dynamo()
    raise ValueError(f"unknown request {kind!r}")


def _concurrently(engine: Any, calls: list, max_new_tokens: int, timeout: float) -> tuple:
    """Each call's generate() from a thread of its own, all released at once (a barrier); per call ("ok", output) or
    its failure, what dynamo did over the round, its wall time. The parent's wait on the pipe bounds the round: at
    `timeout` it dumps this process's stacks and kills it (a stuck call fails its test naming the round)."""
    import threading

    from pytest_kvcompile.recompiles.recorder import CompileRecorder

    found: list[tuple] = [("raised", "RuntimeError", "the call's thread ended without an answer", "")] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        try:
            start.wait(timeout)
            out = engine.generate(calls[i], max_new_tokens)
            pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)  # one call's unsendable output fails that call alone
            found[i] = ("ok", out)
        except BaseException as exc:
            found[i] = _failure(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"kvcompile-call-{i}")
               for i in range(len(calls))]
    with CompileRecorder() as recorder:
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        _synchronize()
        ms = (time.perf_counter() - started) * 1e3
    return found, (tuple(recorder.events), *recorder.guards, tuple(recorder.captures)), ms


def _synchronize() -> None:
    """Wait for queued CUDA work (a timed call ends when its kernels do), where CUDA is in use."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _failure(exc: BaseException) -> tuple:
    import traceback

    from pytest_kvcompile.errors import NotApplicable

    if isinstance(exc, NotApplicable):
        return ("not-applicable", exc.msg)
    if isinstance(exc, Skipped):
        return ("skip", exc.msg)
    if isinstance(exc, Failed):
        return ("fail", exc.msg)
    frames = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if f.filename != __file__]
    text = "".join(traceback.format_list(frames) + traceback.format_exception_only(type(exc), exc))
    return ("raised", type(exc).__name__, str(exc), text)


if __name__ == "__main__":
    _serve()
