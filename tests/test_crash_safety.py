"""Crash-safe by default (issue 26): with no isolation flag, an engine that is not built-in runs in a process of its
own, so an abort or a native hang fails its own tests and the run completes with its reports; an engine trusted to
run in process (isolated=False) that dies still leaves valid reports naming the test, engine, model and call.
Serial and -n 2. Engines: tests/kv_test_engines_crash.py."""

import json
from pathlib import Path

import pytest

from conftest import SUITES_DIR, run_pytest
from pytest_kvcompile.config.options import Settings
from pytest_kvcompile.reports import json_file

CRASH = "kv_test_engines_crash:"
XDIST = {"serial": (), "-n 2": ("-n", "2")}
MODES = ["serial", pytest.param("-n 2", marks=pytest.mark.full)]  # under xdist: the full tier (tests/test_tiers.py)


def suites(kvtester, *args):
    """The README's command, no --kv-isolate (run_pytest would add one): the plugin's default, 'auto'."""
    return run_pytest(kvtester, str(SUITES_DIR), "-p", "no:cacheprovider", "-p", "no:benchmark", "--rootdir",
                      str(kvtester.path), "--kv-zoo=llama", "--kv-report-json=r.json", *args, isolate=None)


def rows(kvtester) -> dict:
    json_file.load(kvtester.path / "r.json")  # a valid results file, then its rows as written
    return {r["engine"]: r for r in json.loads((kvtester.path / "r.json").read_text())["rows"]}


def status(kvtester) -> dict:
    return json.loads((kvtester.path / "r.json").read_text())["status"]


@pytest.mark.parametrize("mode", MODES)
def test_an_aborting_engine_fails_alone_and_the_run_keeps_its_reports(kvtester, mode):
    result = suites(kvtester, f"--kv-engine={CRASH}AbortsOnThirdCall", "--kv-engine=hf-eager", "--kv-call-timeout=60",
                    "-k", "token_identity or stale_state", *XDIST[mode])
    assert result.ret == 1, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines([f"*engine '{CRASH}AbortsOnThirdCall' on model 'llama' crashed: its process (pid *) "
                                 "died of SIGABRT (signal 6) during generate(*"])
    found = rows(kvtester)
    assert found["hf-eager"]["tests"]["passed"] == 7 and found["hf-eager"]["tests"]["failed"] == 0
    assert found[f"{CRASH}AbortsOnThirdCall"]["tests"]["failed"] >= 1
    assert status(kvtester)["complete"] is True and status(kvtester)["finished_tests"] == 14


def test_built_in_engines_stay_in_process_others_get_their_own(kvtester):
    result = suites(kvtester, f"--kv-engine={CRASH}AbortsOnThirdCall", "--kv-engine=hf-eager",
                    "-k", "token_identity and len1")
    result.stdout.fnmatch_lines([f"kvcompile: {CRASH}AbortsOnThirdCall / llama: built in * s in process *"])
    assert "kvcompile: hf-eager / llama: built in" in result.stdout.str()
    result.stdout.no_fnmatch_line("kvcompile: hf-eager / llama: built in * s in process *")


@pytest.mark.parametrize("mode", MODES)
def test_a_hang_in_native_code_is_stopped_by_the_call_timeout(kvtester, mode):
    result = suites(kvtester, f"--kv-engine={CRASH}HangsInC", "--kv-engine=hf-eager", "--kv-call-timeout=5",
                    "-k", "token_identity and not batched", *XDIST[mode])
    assert result.ret == 1
    result.stdout.fnmatch_lines([f"*engine '{CRASH}HangsInC' on model 'llama': generate(<1 prompt(s) of lengths ?7?>, "
                                 "max_new_tokens=16) did not return within 5 s (--kv-call-timeout); "
                                 "its process (pid *) "
                                 "was killed*"])
    found = rows(kvtester)
    assert found["hf-eager"]["tests"]["passed"] == 4 and found[f"{CRASH}HangsInC"]["tests"]["failed"] == 1


def test_reports_survive_an_engine_that_kills_the_pytest_process(kvtester):
    result = suites(kvtester, "--kv-engine=hf-eager", f"--kv-engine={CRASH}AbortsInProcess", "--kv-report-md=r.md",
                    "--kv-report-html=r.html", "-p", "no:faulthandler", "-k", "token_identity or stale_state")
    assert result.ret not in (0, 1)  # the process died of SIGABRT
    found = status(kvtester)  # a valid report of every finished test, naming what was running
    assert found["complete"] is False and found["finished_tests"] >= 2
    (running,) = found["running"]
    assert running["engine"] == f"{CRASH}AbortsInProcess" and running["model"] == "llama"
    assert f"[{CRASH}AbortsInProcess-llama" in running["test"] and running["served_before"] == 2
    assert running["call"].startswith("generate(<1 prompt(s) of lengths [")
    assert sum(r["tests"]["passed"] for r in rows(kvtester).values()) == found["finished_tests"]
    assert "the run has not completed" in (kvtester.path / "r.md").read_text()
    assert "the run has not completed" in (kvtester.path / "r.html").read_text()


@pytest.mark.full  # xdist's own worker loss
def test_under_xdist_a_dead_worker_is_named_with_its_call(kvtester):
    result = suites(kvtester, "--kv-engine=hf-eager", f"--kv-engine={CRASH}AbortsInProcess",
                    "-k", "token_identity and not batched", "-n", "2")
    assert result.ret == 1
    found = status(kvtester)
    assert found["complete"] is True and found["crashed"]
    crash = found["crashed"][0]
    assert crash["engine"] == f"{CRASH}AbortsInProcess" and crash["call"].startswith("generate(<1 prompt(s)")
    assert crash["served_before"] == 2 and "xdist worker" in crash["message"]
    got = rows(kvtester)
    assert got["hf-eager"]["tests"] == {**got["hf-eager"]["tests"], "passed": 4, "failed": 0}
    assert any("died running" in f["message"] for f in got[f"{CRASH}AbortsInProcess"]["failures"])


def test_which_engines_are_isolated():
    settings = Settings(engines=(), models=(), zoo=None, zoo_head_dim=16, device="cpu", dtype="float32",
                        max_new_tokens=4, tie_tolerance=1e-3, compile_backend="eager", cache_dir=Path("."))
    assert settings.isolate == "auto"
    auto = [settings.isolated("e", declared, builtin) for declared in (None, True, False) for builtin in (True, False)]
    assert auto == [False, True, True, True, False, False]
    declared = Settings(**{**settings.__dict__, "isolate": "declared"})
    assert [declared.isolated("e", d, False) for d in (None, True, False)] == [False, True, False]
    assert Settings(**{**settings.__dict__, "isolate": "none"}).isolated("e", True, False) is False
    assert Settings(**{**settings.__dict__, "isolate": ("e",)}).isolated("e", False, True) is True


def test_an_isolated_engine_is_timed_in_its_own_process():
    from pytest_kvcompile.latency.measure import _timed
    from pytest_kvcompile.run.host import InProcess, Subprocess

    class Engine:  # the isolated engine's proxy (run/isolation.py): its process timed the last generate()
        last_ms, build_compiles, build_captures = 12.5, (), ()

        def generate(self, prompts, n):
            return [[0] * n]

    class Isolated:
        engine = Engine()
        host = Subprocess(engine)

    class InProcessEngine:
        engine = Engine()
        host = InProcess(engine)

    assert _timed(Isolated(), lambda call: 999.0, lambda: Isolated.engine.generate([[1]], 1)) == 12.5
    assert _timed(InProcessEngine(), lambda call: 999.0, lambda: InProcessEngine.engine.generate([[1]], 1)) == 999.0
