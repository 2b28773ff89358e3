"""Reports that survive the run's process (issue 26): written as the run goes, atomically, naming what was running.

Rule: a process that dies at any moment leaves a valid report of every finished test.

- After every finished test the controller (serial: the one process) rewrites each requested report from the results
  so far (`atomic_write`: a temporary file renamed over the report, never a half-written file). The JSON carries
  ``"status": {"complete": false, "finished_tests": n, "running": [...], "crashed": [...]}`` until the run ends.
- Before every engine call (and build) the process running the engine records the test, engine, model, the call and
  how many calls that engine object served before (`Beat`): serially, into the JSON report itself (its results
  part is serialized once per test, so a beat costs one small write); in a pytest-xdist worker, into that worker's
  heartbeat file, which the controller reads into ``running`` and, when xdist reports the worker crashed, into
  ``crashed`` and a failure on that engine x model.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pytest_kvcompile.verdicts.results import Results
from pytest_kvcompile.verdicts.rows import Beat, Crash, Status

HEARTBEAT_KEY = "kvcompile_heartbeat_dir"  # workerinput: where the workers' heartbeat files go


def atomic_write(path: Path, text: str) -> None:
    """`text` to `path` through a temporary file in the same directory, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def status(finished: int, running: list[Beat], crashed: list[Crash], complete: bool) -> Status:
    return Status(complete, finished, list(running), list(crashed))


def with_status(json_text: str, found: Status) -> str:
    """A JSON report (an object, as json_file.dumps writes it) with its status set to `found`."""
    body = json_text.rstrip()
    assert body.endswith("}"), "a results JSON is an object"
    return body[:-1].rstrip() + ',\n "status": ' + json.dumps(found.to_json()) + "\n}\n"


def write_heartbeat(directory: Path, worker: str, beat: Beat | None) -> None:
    """The worker's current beat (None: between tests)."""
    atomic_write(directory / f"{worker}.json", json.dumps(beat.to_json() if beat else None))


def read_heartbeat(directory: Path, worker: str) -> Beat | None:
    try:
        found = json.loads((directory / f"{worker}.json").read_text())
    except (OSError, ValueError):
        return None
    try:
        return Beat.from_json(found, str(directory / f"{worker}.json")) if isinstance(found, dict) else None
    except ValueError:
        return None


def read_heartbeats(directory: Path) -> list[Beat]:
    return [b for p in sorted(directory.glob("*.json")) if (b := read_heartbeat(directory, p.stem))]


def status_lines(results: Results) -> list[str]:
    """What the reports say first about an unfinished run or a dead process (empty for a complete clean run)."""
    return results.status.lines() if results.status else []
