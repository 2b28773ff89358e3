"""The fuzzer (issue 12): it finds a bug that needs a specific combination of calls, which every fixed suite check
misses, and reports the shrunk call sequence; it is off unless asked for; its options are validated."""

import pytest

from conftest import run_suites

LEAKY = "--kv-engine=kv_test_engines_verdicts:LeaksAfterBatchOfThree"


def test_a_bug_needing_a_combination_of_calls_passes_the_fixed_checks_and_is_found_by_the_fuzzer(kvtester):
    fixed = run_suites(kvtester, LEAKY, "-p", "no:benchmark", "-k", "not latency")
    assert fixed.ret == 0, fixed.stdout.str()[-3000:]
    collected = run_suites(kvtester, LEAKY, "--co", "-q")
    assert "test_fuzz" not in collected.stdout.str()  # off unless --kv-fuzz=N: deselected
    found = run_suites(kvtester, LEAKY, "--kv-fuzz=20", "-k", "fuzz")
    found.assert_outcomes(failed=1)
    found.stdout.fnmatch_lines([
        "*TokenMismatch: engine 'kv_test_engines_verdicts:LeaksAfterBatchOfThree' diverges from the oracle*",
        "*the shortest failing call sequence found (replay it on a fresh engine, in this order):*",
        "*engine.generate(??*], ?*], ?*]], *)",  # a batch of three ...
        "*engine.generate(??*]], *)",  # ... then one shorter prompt
    ])


def test_a_correct_engine_passes_the_ci_profile(kvtester):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines:Greedy", "--kv-fuzz=4", "-k", "fuzz")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*kv_test_engines:Greedy / llama: * example(s) of up to 8 calls, profile ci, no failure*"])


@pytest.mark.parametrize("option, message", [
    ("--kv-fuzz=some", "*--kv-fuzz='some': give a number of examples >= 0*"),
    ("--kv-fuzz-profile=nightly", "*--kv-fuzz-profile='nightly': choose one of ci, dev*"),
    ("--kv-fuzz-budget=0", "*--kv-fuzz-budget='0': give seconds > 0*"),
    ("--kv-fuzz-seed=x", "*--kv-fuzz-seed='x': give a whole number*"),
])
def test_bad_fuzz_options_are_usage_errors(kvtester, option, message):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines:Greedy", option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
