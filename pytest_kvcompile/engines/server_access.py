"""How a run may reach a deployed server (issue 57): its API key, read from the environment only and redacted from
every message, and the load a run may put on it (`Limits`, kept by `Pace`). Used by the client (engines/server.py)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass

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
    """`Limits` kept: a request waits for a free slot and its turn (`request()` is a context manager)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.max_concurrency) if limits.max_concurrency else None
        self._lock = threading.Lock()
        self._next = 0.0

    @contextlib.contextmanager
    def request(self):
        if self._slots is not None:
            self._slots.acquire()
        try:
            if self.limits.max_rps:
                with self._lock:
                    now = time.monotonic()
                    start = max(now, self._next)
                    self._next = start + 1.0 / self.limits.max_rps
                time.sleep(max(0.0, start - now))
            yield
        finally:
            if self._slots is not None:
                self._slots.release()


NO_LIMITS = Limits()  # the default: no cap (a server the user runs on the loopback)
