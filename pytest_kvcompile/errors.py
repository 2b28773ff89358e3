"""The errors and test outcomes of pytest-kvcompile. Each message names the fix.

The one module below the plugin's shell that imports pytest (tests/test_structure.py): the core raises a check's
failure or skip through `fail` and `skip` and a bad option through `UsageError`, which are pytest's own outcome types,
so the core never imports pytest itself and pytest reports them as it reports its own.
"""

from typing import NoReturn

import pytest

Failed = pytest.fail.Exception  # a check failed: pytest's own outcome (`fail`)
Skipped = pytest.skip.Exception  # a check could not apply: pytest's own outcome (`skip`)
UsageError = pytest.UsageError  # a bad option or argument: pytest stops before collecting and prints the message


def fail(reason: str, pytrace: bool = True) -> NoReturn:
    """Fail the running test with `reason` (``pytest.fail``; `pytrace` False: the message alone, no traceback)."""
    __tracebackhide__ = True
    raise Failed(reason, pytrace=pytrace)


def skip(reason: str) -> NoReturn:
    """Skip the running test, saying why (``pytest.skip``)."""
    __tracebackhide__ = True
    raise Skipped(reason, allow_module_level=False)


class EngineResolutionError(UsageError):
    """An engine NAME given to --kv-engine cannot be resolved or imported."""


class MalformedOutput(Exception):
    """An engine returned something that breaks the engine contract."""


class NotApplicable(Skipped):
    """A skip for a limitation declared or known up front (the engine raised ModelNotSupported, does not declare
    the device or dtype, the model is unavailable, no oracle covers the strategy): the engine x model is not
    failed as vacuous for it, and the reason is listed at the end of the run."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, pytrace=False)


class Unjudgeable(NotApplicable):
    """A skip where the engine's own declaration leaves nothing a check could tell from a bug (a KV format whose
    noise flips a quarter of the greedy choices): named like NotApplicable, the oracle-free checks still run, but it
    does not excuse the engine x model from the vacuous rule (an engine on which no token was checked fails)."""


class OracleUnreliable(Skipped):
    """The oracle disagrees with an independent path: its references cannot judge an engine. A skip wherever it is
    raised (the check is not judged), named in the reports and counted in the engine's verdict line; never an error
    or a failure of the engine (issue 23)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, pytrace=False)


COULD_NOT_RUN = "the oracle could not run"  # how an OracleUnavailable's message begins


class OracleUnavailable(OracleUnreliable):
    """The oracle could not run on a model (it raised: a kernel refusing float64, a model transformers cannot
    evaluate, memory): its token checks there are not judged, named with the cause and what to try; never a failure
    of the engine."""


class EngineFailed(Exception):
    """A failure of the engine's side told in full: str(exc) is the whole failure (what broke, where, what to try),
    shown as it is; `kind` is its verdict kind (a verdicts.failures.Kind value: errors sits below verdicts). A server's
    failed request (engines/server.py: ServerError), an engine process's death."""

    kind = "other"


class EngineProcessDied(EngineFailed):
    """An isolated engine's process crashed or was killed after --kv-call-timeout; str(exc) is the failure."""

    kind = "crash"  # verdicts.failures.Kind.CRASH


class CallTimeout(BaseException):
    """Raised inside an in-process engine call that outlived --kv-call-timeout (SIGALRM). A BaseException, so an
    engine's own ``except Exception`` cannot swallow it."""


class RemoteError(Exception):
    """An exception an isolated engine raised in its own process: its type name, message and traceback, as text."""

    def __init__(self, remote_type: str, message: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.remote_type, self.remote_traceback = remote_type, remote_traceback
