"""Engines that crash or hang (tests/kv_test_engines_crash.py): one failure naming the signal or the timeout and
the call, the rest of the run completes and writes its reports; isolation observes as much as in-process runs."""

import json

import pytest

from conftest import run_suites

CRASH = "kv_test_engines_crash:"


def _report(kvtester):
    return json.loads((kvtester.path / "kv.json").read_text())


SIGNALS = {"Segfaults": "SIGSEGV", "Aborts": "SIGABRT"}


def test_crash_fails_one_test_and_the_run_goes_on(kvtester):
    """Both crashing twins in one run (each its own process): one failure each, the rest of the run completes."""
    result = run_suites(kvtester, *(f"--kv-engine={CRASH}{engine}" for engine in SIGNALS),
                        "--kv-engine=kv_test_engines:Greedy", "--kv-report-json=kv.json",
                        "-k", "test_token_identity and not batched and (short7 or long48)")
    result.assert_outcomes(passed=4, failed=2)
    rows = {(r["engine"], r["model"]): r for r in _report(kvtester)["rows"]}
    for engine, signal in SIGNALS.items():
        result.stdout.fnmatch_lines([
            f"*engine '{CRASH}{engine}' on model 'llama' crashed: its process (pid *) died of {signal} (signal *) "
            "during generate(<1 prompt(s) of lengths ?7?>, max_new_tokens=16)*",
            "*its last output (stderr*",
            "*Fatal Python error*",
            "*The run goes on: the next test of this engine x model builds it in a fresh process*",
        ])
        result.stdout.fnmatch_lines([f"FAILED *test_token_identity?{CRASH}{engine}-llama-short7*"])
        assert rows[(f"{CRASH}{engine}", "llama")]["tests"]["failed"] == 1, rows  # the reports were written
    assert rows[("kv_test_engines:Greedy", "llama")]["tests"]["failed"] == 0, rows


@pytest.mark.parametrize("isolate", ["--kv-isolate=kv_test_engines_crash:Hangs", "--kv-isolate=none"])
def test_hang_fails_after_the_call_timeout_naming_the_call(kvtester, isolate):
    result = run_suites(kvtester, f"--kv-engine={CRASH}Hangs", "--kv-call-timeout=3", isolate,
                        "-k", "test_token_identity and not batched and (short7 or long48 or len1)")
    result.assert_outcomes(passed=2, failed=1)
    where = "its process (pid *) was killed" if "Hangs" in isolate else "the call was interrupted (SIGALRM)"
    result.stdout.fnmatch_lines([
        f"*engine '{CRASH}Hangs' on model 'llama': generate(<1 prompt(s) of lengths ?7?>, *16) did not return within "
        f"3 s (--kv-call-timeout); {where}*",
        "*The run goes on*",
    ])
    if "Hangs" in isolate:  # faulthandler's dump of the stuck process shows where it hung
        result.stdout.fnmatch_lines(["*where it was*", "*kv_test_engines_crash.py*in generate*"])


def test_timeout_is_not_swallowed_by_an_engine_catching_exception(kvtester):
    result = run_suites(kvtester, f"--kv-engine={CRASH}SwallowsEverything", "--kv-call-timeout=2",
                        "-k", "test_token_identity and not batched and short7")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*did not return within 2 s (--kv-call-timeout)*"])


def test_isolated_engine_is_observed_like_an_in_process_one(kvtester):
    # compiles in the engine's process are seen: the recompiling twin fails, the correct one passes
    result = run_suites(kvtester, f"--kv-engine={CRASH}IsolatedCompiled", f"--kv-engine={CRASH}IsolatedRecompiling",
                        f"--kv-engine={CRASH}IsolatedStaleCache", "-k",
                        "test_no_recompiles_after_warmup or test_compiled_code_runs "
                        "or (test_stale_state and not batched)")
    result.stdout.fnmatch_lines(["*kvcompile: *IsolatedCompiled / llama: built in * s in process *"])
    outcomes = {line.split(" ")[1]: line.split(" ")[0] for line in result.outlines
                if line.startswith(("PASSED ", "FAILED ", "SKIPPED "))}
    failed = sorted(test for test, outcome in outcomes.items() if outcome == "FAILED")
    assert any("IsolatedRecompiling" in t and "recompiles" in t for t in failed), result.outlines[-30:]
    assert any("IsolatedStaleCache" in t and "stale_state" in t for t in failed), result.outlines[-30:]
    assert not any("IsolatedCompiled" in t for t in failed), failed


def test_isolate_names_must_be_engines_of_the_run(kvtester):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines:Greedy", "--kv-isolate=llama-cpp")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-isolate=llama-cpp: llama-cpp is not an engine of this run (engines: "
                                 "kv_test_engines:Greedy)*"])


def test_isolated_memory_is_measured_in_the_engine_process(kvtester):
    # --kv-isolate=all: held_by and the live-tensor census run where the engine lives, so the leak is still seen
    memory = "kv_test_engines_memory:"
    result = run_suites(kvtester, f"--kv-engine={memory}DynamicBytes", f"--kv-engine={memory}KeepsEveryCache",
                        "--kv-isolate=all", "-k", "memory_held or (memory_growth and KeepsEveryCache)")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        f"*engine '{memory}KeepsEveryCache' on model 'llama': memory grows over 3 repeated calls*",
        "  live tensor bytes: * after 1 warmup call(s), then +*, +*, +* B per call",
        f"FAILED *test_no_memory_growth?{memory}KeepsEveryCache-llama*",
    ])


def test_a_forked_helper_does_not_hide_the_crash(kvtester):
    # no --kv-call-timeout: a helper holding the pipe would leave the parent waiting forever
    result = run_suites(kvtester, f"--kv-engine={CRASH}ForksThenSegfaults",
                        "-k", "test_token_identity and not batched and (short7 or long48)")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([f"*engine '{CRASH}ForksThenSegfaults' on model 'llama' crashed: its process (pid *) "
                                 "died of SIGSEGV*"])


def test_deadline_leaves_an_outer_timer_armed():
    import signal
    import time

    from pytest_kvcompile.errors import CallTimeout
    from pytest_kvcompile.run.harness import deadline

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)  # an outer timer (pytest-timeout's signal method)
        with deadline(5):
            pass
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.5  # re-armed with what it had left
        time.sleep(0.7)
        assert fired == [True]
        with pytest.raises(CallTimeout):
            with deadline(0.2):
                time.sleep(5)
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_concurrent_calls_reach_an_isolated_engine(kvtester):
    # the round released at once from threads in the engine's own process (issue 73): a correct thread-safe engine
    # passes isolated, one wrong only under concurrent calls fails isolated too, and one declaring no thread safety
    # stays a named skip
    engines = {"safe": "kv_test_engines:ThreadSafeGreedy", "shared": "kv_test_engines:SharedStateGreedy",
               "unsafe": "kv_test_engines:Greedy"}
    report = kvtester.path / "r.json"
    result = run_suites(kvtester, *(f"--kv-engine={e}" for e in engines.values()), "--kv-isolate=all",
                        "--kv-max-new-tokens=8", f"--kv-report-json={report}", "-k", "test_concurrent_requests", "-rs")
    rows = {row["engine"]: row for row in json.loads(report.read_text())["rows"]}
    outcome = {label: rows[name]["tests"] for label, name in engines.items()}
    assert outcome["safe"]["passed"] == 1 and outcome["shared"]["failed"] == 1 and outcome["unsafe"]["skipped"] == 1
    assert rows[engines["safe"]]["concurrency"]["warm N=8"] == {"identical": 8, "near_tie": 0, "wrong": 0}
    assert sum(r["wrong"] for r in rows[engines["shared"]]["concurrency"].values()) > 0
    shared = engines["shared"]
    result.stdout.fnmatch_lines([f"*engine '{shared}' diverges from the oracle on model 'llama', *round N=*"])
    assert "cannot reach it" not in result.stdout.str()
