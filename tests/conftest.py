"""Helpers for the plugin's own tests: real pytest runs (pytester) against tests/kv_test_engines.py."""

import atexit
import importlib
import os
import sys
from pathlib import Path

import pytest

import prewarmed

TESTS_DIR = Path(__file__).parent
SUITES_DIR = TESTS_DIR.parent / "suites"
#: -k expression selecting the token-level suites (identity, batch consistency, stale state, determinism)
TOKEN_CHECKS = "token_identity or batch_consistency or stale_state or determinism or shared_prefixes"
TIE = 1e-3  # fp32 near tie: a flip within this logit gap is numerics, not a bug


def assert_matches_oracle(oracle, prompt: list[int], got: list[int], what: str = "") -> None:
    """`got` equals the oracle's greedy tokens, or first differs on a near tie. oracle(prompt, n) ->
    (tokens, logits [n, vocab])."""
    want, logits = oracle(prompt, len(got))
    if got == want:
        return
    step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    gap = float(logits[step, want[step]] - logits[step, got[step]])
    assert gap <= TIE, (f"{what + ', ' if what else ''}prompt len {len(prompt)}: step {step} got {got[step]}, "
                        f"oracle {want[step]} (gap {gap:.2e})")


_ENV = dict(os.environ)  # before any test's monkeypatch: what the prewarmed server imports under
_SERVER: list[prewarmed.Server] = []


def run_pytest(pytester: pytest.Pytester, *args: str, isolate: str | None = "declared") -> pytest.RunResult:
    """`pytester.runpytest_subprocess(*args)`, forked from this worker's prewarmed server (tests/prewarmed.py: torch
    and transformers imported once, not once per run) where the run's environment allows it. The test engines run in
    process (`--kv-isolate=declared`) unless args or `isolate` say otherwise (None: the plugin's default, 'auto'):
    an isolated engine's process imports torch and transformers anew, 10-20 s a run here (tests/test_isolation.py
    and tests/test_crash_safety.py judge isolation)."""
    if isolate and "no:kvcompile" not in args and not any(a.startswith("--kv-isolate") for a in args):
        args = (*args, f"--kv-isolate={isolate}")
    return prewarmed_server().run(pytester, *args)


def prewarmed_server() -> prewarmed.Server:
    """This worker's server, started at its first use."""
    if not _SERVER:
        path = os.pathsep.join(p for p in (str(TESTS_DIR), _ENV.get("PYTHONPATH", "")) if p)  # the caller's kept
        _SERVER.append(prewarmed.Server({**_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}))
        atexit.register(_SERVER[0].close)
    return _SERVER[0]


def pytest_configure(config):
    """torch imported before any test, so an in-process pytester run (which restores sys.modules) never drops it
    and a later import does not initialise its C extension twice (a segfault in a serial run); one torch thread per
    xdist worker, as in the pytester runs (`kvtester`): two workers share the 2 cores. Also transformers' modeling
    base, whose torch.distributed imports register operator libraries: a `pytester` test restores sys.modules after
    it (whether its runs are in-process or not), so a module imported first inside such a test is dropped, and its next
    import registers them twice ("Only a single TORCH_LIBRARY ...": every later model load in that worker fails; seen
    with tests/test_plugin_cli.py before tests/test_precision.py in one worker)."""
    import torch
    import transformers.modeling_utils  # noqa: F401

    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def zoo_cache() -> Path:
    """The zoo checkpoints, the oracle's references and the 16-bit calibrations of every pytester run, kept on disk
    beyond the session (issue 53): under $KVCOMPILE_CACHE_DIR where it is set (CI: one cache for every job), else
    .kvcompile-cache/ in this checkout (git ignores it), so a second run, and every worker and pytester run of one,
    reuses them. Entries are keyed by the torch and transformers versions and the hash of the code that computes them
    (models/zoo.py: `code_hash`, oracles/store.py), so an edit never reads a stale one; files are written to a
    temporary name and renamed (race-safe under xdist). A cold run: point KVCOMPILE_CACHE_DIR at an empty folder."""
    path = Path(os.environ.get("KVCOMPILE_CACHE_DIR") or TESTS_DIR.parent / ".kvcompile-cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def kvtester(pytester: pytest.Pytester, zoo_cache: Path, monkeypatch) -> pytest.Pytester:
    """pytester that can import the test engines (``kv_test_engines:NAME``) and shares the zoo cache.

    Runs are subprocesses: an in-process run restores sys.modules afterwards, which breaks
    transformers' lazy modules and re-registers torch kernels.
    """
    monkeypatch.setenv("KVCOMPILE_CACHE_DIR", str(zoo_cache))
    # One torch thread per run: under `pytest -n 2` two runs share the 2 cores, and OpenMP threads spinning against
    # each other cost more than the tiny models gain from a second thread.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR), prepend=":")
    return pytester


def run_suites(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """Run the project's suites (suites/) with the given options, on the tiny Llama and with --kv-isolate=declared
    unless told otherwise."""
    opts = [str(SUITES_DIR), "-p", "no:cacheprovider", "-p", "no:benchmark", "--rootdir", str(pytester.path)]
    if not any(a.startswith("--kv-zoo") for a in args):
        opts.append("--kv-zoo=llama")
    return run_pytest(pytester, *opts, *args)  # --kv-isolate=declared unless args name one


def import_benchmark(name: str):
    """The module benchmarks/NAME.py (a script directory, not a package), for unit tests of its functions."""
    where = str(TESTS_DIR.parent / "benchmarks")
    sys.path.insert(0, where)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(where)
