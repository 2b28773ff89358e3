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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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


@dataclass
class Beat:
    """What one process is running: the test, and the engine call in it (None between calls)."""

    test: str
    engine: str | None = None
    model: str | None = None
    call: str | None = None
    served_before: int = 0
    worker: str | None = None

    def line(self) -> str:
        where = f"engine '{self.engine}' on model '{self.model}'" if self.engine else "no engine"
        call = f", during {self.call} ({self.served_before} call(s) served before it)" if self.call else ""
        return f"{self.test} ({where}{call})"


def status(finished: int, running: list[Beat], crashed: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
    return {"complete": complete, "finished_tests": finished, "running": [asdict(b) for b in running],
            "crashed": crashed}


def with_status(json_text: str, found: dict[str, Any]) -> str:
    """A JSON report (an object, as json_file.dumps writes it) with its "status" key set to `found`."""
    body = json_text.rstrip()
    assert body.endswith("}"), "a results JSON is an object"
    return body[:-1].rstrip() + ',\n "status": ' + json.dumps(found) + "\n}\n"


def write_heartbeat(directory: Path, worker: str, beat: Beat | None) -> None:
    """The worker's current beat (None: between tests)."""
    atomic_write(directory / f"{worker}.json", json.dumps(asdict(beat) if beat else None))


def read_heartbeat(directory: Path, worker: str) -> Beat | None:
    try:
        found = json.loads((directory / f"{worker}.json").read_text())
    except (OSError, ValueError):
        return None
    return Beat(**found) if isinstance(found, dict) else None


def read_heartbeats(directory: Path) -> list[Beat]:
    return [b for p in sorted(directory.glob("*.json")) if (b := read_heartbeat(directory, p.stem))]


def status_lines(results: dict[str, Any]) -> list[str]:
    """What the reports say first about an unfinished run or a dead process (empty for a complete clean run)."""
    found = results.get("status") or {}
    lines = [f"process died: {c['message']}" for c in found.get("crashed", [])]
    if found and not found.get("complete", True):
        running = "; ".join(Beat(**b).line() for b in found.get("running", [])) or "between tests"
        lines.insert(0, f"the run has not completed: {found.get('finished_tests', 0)} test(s) finished, running: "
                        f"{running} (a report written during the run, or by a run whose process died)")
    return lines
