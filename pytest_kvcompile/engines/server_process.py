"""Managed servers: a server engine (engines/server.py) that starts its server on the checkpoint, on a free 127.0.0.1
port, waits until it answers, keeps its log (past the stop only when a failure quoted it), and stops it when the
engine is dropped or the process exits. Recipes: engines/vllm_server.py, engines/llamacpp_server.py."""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from dataclasses import dataclass
from pathlib import Path

from pytest_kvcompile.contract.engine import Declaration, ModelSpec
from pytest_kvcompile.engines.server import REQUEST_TIMEOUT_S, ServerEngine, ServerError, free_port
from pytest_kvcompile.engines.server_wire import API, TOP_K

READY_TIMEOUT_S = 600.0  # a managed server's start (vLLM on CPU compiles first)
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class Launch:
    """How a managed server starts: its command (with the port), extra environment, and the API it speaks."""

    command: list[str]
    api: str
    env: dict[str, str]
    ready_timeout: float = READY_TIMEOUT_S


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the server gets SIGTERM when the process that started it dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A server started by this process: its log file, readiness, and a stop that always happens."""

    def __init__(self, launch: Launch, name: str) -> None:
        self.name, self.launch = name, launch
        self.log = _Log(Path(tempfile.mkdtemp(prefix=f"kvcompile-server-{name}-")))
        self.log_path = self.log.folder / "server.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(launch.command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **launch.env}, start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.log)  # also runs at exit (finalize.atexit)

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        self._finalizer()

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The end of the server's log, for a failure message: the log is then kept when the server stops."""
        if not self.log.folder.exists():
            return f"\n  (its log {self.log_path} was removed when this harness stopped the server)"
        self.log.quoted = True
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"\n  (its log {self.log_path} cannot be read)"
        shown = "\n".join("    " + line for line in text) or "    (empty)"
        return f"\n  server log {self.log_path} (last {len(text)} lines):\n{shown}"


@dataclass
class _Log:
    """A server's log folder; kept after the server stops only if a message quoted it or the server died by itself."""

    folder: Path
    quoted: bool = False


def _stop(proc: subprocess.Popen, log: _Log) -> None:
    """SIGTERM to the server's process group, SIGKILL after 10 s; then its log folder goes unless it is evidence (a
    message quoted it, or the server had already died with a failing status)."""
    died = proc.poll() not in (None, 0)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    if not (log.quoted or died):
        shutil.rmtree(log.folder, ignore_errors=True)


class ManagedServer(ServerEngine):
    """A server this engine starts on the checkpoint (subclasses say how: `launch`), on a free 127.0.0.1 port; stopped
    when the engine is dropped and when the process exits. A failure names the server's log and quotes its end."""

    kv_declaration = Declaration(batching=True, isolated=False, thread_safe=True, description="a managed server")
    timeout = REQUEST_TIMEOUT_S

    def launch(self, spec: ModelSpec, port: int) -> Launch:
        raise NotImplementedError

    def __init__(self, spec: ModelSpec) -> None:
        port = free_port()
        launch = self.launch(spec, port)
        name = type(self).__name__
        self.process = ServerProcess(launch, name)
        url = f"http://127.0.0.1:{port}"
        who = f"the managed {name} server at {url} (pid {self.process.proc.pid})"
        try:
            self._wait_ready(url, API[launch.api].ready, launch.ready_timeout, who)
            super().__init__(spec, launch.api, url, self.timeout, TOP_K, who=who)
        except BaseException:
            self.process.stop()
            raise

    def _wait_ready(self, url: str, path: str, timeout: float, who: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status = self.process.exited()
            if status is not None:
                raise ServerError(f"{who} exited (status {status}) before it answered GET {path}; command: "
                                  f"{' '.join(self.process.launch.command)}{self.process.tail()}", gone=True)
            with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                with urllib.request.urlopen(url + path, timeout=5) as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                self.process.stop()
                raise ServerError(f"{who} did not answer GET {path} within {timeout:g} s of its start; command: "
                                  f"{' '.join(self.process.launch.command)}{self.process.tail()}", gone=True)
            time.sleep(0.25)

    def not_reachable(self) -> str:
        status = self.process.exited()
        if status is not None:
            return f"its process exited (status {status})"
        return "its process is still running but does not accept connections"

    def log_tail(self) -> str:
        return self.process.tail()

    def close(self) -> None:
        self.process.stop()


__all__ = ["Launch", "ManagedServer", "ServerProcess"]
