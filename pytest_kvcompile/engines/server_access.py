"""How a run may reach a deployed server (issue 57): its API key, read from the environment only and redacted from
every message, and the load a run may put on it (`Limits`, kept by `Pace`). Used by the client (engines/server.py)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: the limits hold per process (Pace)
    fcntl = None  # type: ignore[assignment]

#: where a server's API key is read, in order (never from the command line: names and URLs reach test ids and reports)
KEY_VARIABLES = {"openai": ("KVCOMPILE_API_KEY", "OPENAI_API_KEY"), "sglang": ("KVCOMPILE_API_KEY",),
                 "llamacpp": ("KVCOMPILE_API_KEY",)}
CA_VARIABLE = "KVCOMPILE_CA_BUNDLE"  # the CA bundle an https server's certificate is verified with (else ?ca_bundle=)
_SECRETS: set[str] = set()  # every key read: redacted from every message this module makes


def api_key(api: str) -> tuple[str | None, str | None]:
    """(the key, the variable it came from) for a server speaking `api`, or (None, None)."""
    for variable in KEY_VARIABLES[api]:
        value = os.environ.get(variable, "").strip()
        if value:
            _SECRETS.add(value)
            return value, variable
    return None, None


def redact(text: str) -> str:
    """`text` with every API key read so far replaced by <redacted> (a server may echo the header it refused)."""
    for secret in _SECRETS:
        text = text.replace(secret, "<redacted>")
    return text



@dataclass(frozen=True)
class Limits:
    """The load a run may put on one server (URL ``?max_concurrency=N&max_rps=R``): requests in flight at once and
    requests started per second (None: no cap). A shared staging server is never flooded by a test run."""

    max_concurrency: int | None = None
    max_rps: float | None = None

    def describe(self) -> str:
        caps = [f"at most {self.max_concurrency} request(s) at once" if self.max_concurrency else "",
                f"at most {self.max_rps:g} request(s) started per second" if self.max_rps else ""]
        return ", ".join(c for c in caps if c) or "no cap"


class Pace:
    """`Limits` kept for one server across every process of the run (pytest-xdist workers, isolated engines) and every
    thread: `request()` (a context manager) waits for a free slot and its turn. The slots are lock files under the
    temporary directory named by the server's URL (an advisory ``flock`` on each, released by the kernel when a process
    dies) and the next start time is a file read and written under a lock; without ``fcntl`` (Windows), the limits
    hold per process."""

    POLL_S = 0.02

    def __init__(self, limits: Limits, server: str = "") -> None:
        self.limits = limits
        digest = hashlib.sha256(server.encode()).hexdigest()[:16]
        self.folder = Path(tempfile.gettempdir()) / f"kvcompile-pace-{digest}"
        self._slots = threading.BoundedSemaphore(limits.max_concurrency) if limits.max_concurrency else None
        self._lock = threading.Lock()
        self._next = 0.0

    @contextlib.contextmanager
    def request(self):
        with self._slot():
            if self.limits.max_rps:
                time.sleep(self._turn(1.0 / self.limits.max_rps))
            yield

    @contextlib.contextmanager
    def _slot(self):
        if not self.limits.max_concurrency:
            yield
            return
        if fcntl is None:
            with self._slots:
                yield
            return
        self.folder.mkdir(exist_ok=True)
        while True:
            for i in range(self.limits.max_concurrency):
                handle = open(self.folder / f"slot-{i}", "a+")  # noqa: SIM115 (held open while the request runs)
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    handle.close()
                    continue
                try:
                    yield
                finally:
                    fcntl.flock(handle, fcntl.LOCK_UN)
                    handle.close()
                return
            time.sleep(self.POLL_S)

    def _turn(self, spacing: float) -> float:
        """Seconds to wait before this request starts: `spacing` after the previous one of any process."""
        with self._lock:
            if fcntl is None:
                now = time.time()
                start, self._next = max(now, self._next), max(now, self._next) + spacing
                return start - now
            self.folder.mkdir(exist_ok=True)
            with open(self.folder / "next-start", "a+") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)
                handle.seek(0)
                try:
                    following = float(handle.read() or 0.0)
                except ValueError:
                    following = 0.0
                now = time.time()
                start = max(now, following)
                handle.seek(0)
                handle.truncate()
                handle.write(repr(start + spacing))
                return start - now


NO_LIMITS = Limits()  # the default: no cap (a server the user runs on the loopback)
