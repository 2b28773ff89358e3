"""What the suites are: their checks (a suite's test functions), each check's family, and the suites' version.

A results file records the index of the suites that ran (`RunInfo.suites`, `RunInfo.checks`), so the conformance
matrix can tell a check a run did not select from a check its suites did not have yet (a file older than the check).
The index is read from the suites' source (no import: neither torch nor pytest is loaded), and the version is a
digest of those files, so any change to a suite's checks or rules is a new version.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

#: The family of each suite file (``suites/test_<stem>.py``): the matrix counts failed, known and skipped checks
#: per family. A suite file missing here is a test failure (tests/test_matrix.py), so a new suite picks its family.
FAMILIES: dict[str, str] = {
    "token_identity": "tokens",
    "batch_consistency": "tokens",
    "determinism": "tokens",
    "stale_state": "tokens",
    "long_generation": "tokens",
    "near_tie_rate": "tokens",
    "fuzz": "tokens",
    "recompiles": "recompiles",
    "call_history": "recompiles",
    "kv_memory": "memory",
    "latency": "latency",
    "prefix_cache": "prefix caches",
    "speculative": "speculation",
    "concurrency": "concurrency",
}
#: The families in the order the matrix's summary shows them.
FAMILY_ORDER = ("tokens", "recompiles", "memory", "prefix caches", "speculation", "concurrency", "latency")
OTHER = "other"


@dataclass(frozen=True)
class SuiteIndex:
    """`version`: the first 10 hex digits of the suite files' sha256; `checks`: check name -> its family."""

    version: str
    checks: dict[str, str]

    def family(self, check: str) -> str:
        return self.checks.get(check, OTHER)


def suites_dir() -> Path | None:
    """The installed suites package's folder (``pytest_kvcompile.suites``), None where it is not installed."""
    try:
        spec = importlib.util.find_spec("pytest_kvcompile.suites")
    except ModuleNotFoundError:
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def index(folder: Path | None = None) -> SuiteIndex:
    """The index of the suites in `folder` (default: the installed suites)."""
    folder = folder or suites_dir()
    if folder is None:
        return SuiteIndex("", {})
    digest, checks = hashlib.sha256(), {}
    for path in sorted(folder.glob("test_*.py")):
        source = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + source)
        family = FAMILIES.get(path.stem.removeprefix("test_"), OTHER)
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                checks[node.name] = family
    return SuiteIndex(digest.hexdigest()[:10], checks)
