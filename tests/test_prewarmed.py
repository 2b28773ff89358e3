"""The prewarmed pytester runs (tests/prewarmed.py) behave as `runpytest_subprocess`: outcomes, exit status, output,
working directory, environment and sys.path; a run that dies of a signal reports it; an environment that changes
what torch or transformers read at import gets a real subprocess."""

import signal

import pytest

from conftest import prewarmed_server, run_pytest

FILE = """
import os, sys

def test_sees_its_run(tmp_path):
    print("cwd", os.getcwd(), "path0", sys.path[0], "marker", os.environ.get("KV_PREWARMED_MARKER"))
    assert os.getcwd() == sys.path[0]

def test_fails():
    assert False, "planted"
"""


def test_a_forked_run_is_a_subprocess_run(kvtester, monkeypatch, capsys):
    pytester = kvtester
    imported = prewarmed_server().imported  # as a worker that compiled in process has it: torch set it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", imported.get("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_x"))
    pytester.makepyfile(test_a=FILE)
    monkeypatch.setenv("KV_PREWARMED_MARKER", "seen")
    forked = run_pytest(pytester, "-p", "no:cacheprovider", "-s", "-p", "no:xdist")
    assert "running (forked from the prewarmed server)" in capsys.readouterr().out
    plain = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "-p", "no:xdist")
    for result in (forked, plain):
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.assert_outcomes(passed=1, failed=1)
        result.stdout.fnmatch_lines([f"*cwd {pytester.path} path0 {pytester.path} marker seen*", "*planted*"])


def test_a_run_killed_by_a_signal_reports_it(kvtester):
    pytester = kvtester
    pytester.makepyfile(test_abort="import os\n\ndef test_abort():\n    os.abort()\n")
    result = run_pytest(pytester, "-p", "no:cacheprovider", "-p", "no:faulthandler")
    assert result.ret == -signal.SIGABRT


def test_an_import_time_variable_gets_a_real_subprocess(kvtester, monkeypatch, capsys):
    pytester = kvtester
    pytester.makepyfile(test_v="import os\n\ndef test_v():\n    assert os.environ['TORCH_KV_PREWARMED'] == '1'\n")
    monkeypatch.setenv("TORCH_KV_PREWARMED", "1")  # read at import by nothing, but named like what torch reads
    result = run_pytest(pytester, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "not forked from the prewarmed server (TORCH_KV_PREWARMED differ" in capsys.readouterr().out


ZYGOTE = """
import os, signal, time
from pytest_kvcompile.run import isolation

def test_engine_processes_are_forked_from_the_zygote(tmp_path):
    proc, log = isolation._spawn()
    assert type(proc).__name__ == "Forked" and proc.poll() is None
    assert os.getpgid(proc.pid) == proc.pid != os.getpid()  # a session of its own, not this run's child
    assert os.readlink(f"/proc/{proc.pid}/cwd") == os.getcwd()
    proc.stdin.close()  # EOF: isolation's loop returns, the process exits 0
    assert proc.wait(timeout=30) == 0
    killed, _ = isolation._spawn()
    os.killpg(killed.pid, signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL
"""


def test_isolated_engines_of_a_forked_run_are_forked_too(kvtester):
    """Pipes, session, working directory and exit status as `python -m ...run.isolation` has them (what runs in them:
    tests/test_isolation.py and tests/test_crash_safety.py, crashes, hangs, compiles, memory)."""
    pytester = kvtester
    pytester.makepyfile(test_z=ZYGOTE)
    result = run_pytest(pytester, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
