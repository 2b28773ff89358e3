"""Bugs that live in call histories (issue 24): each twin is right on a fresh call and wrong only after a particular
earlier call, or compiles again only on a call unlike the warmup's. suites/test_call_history.py and the recompile
suite's one-dimension-at-a-time calls FAIL them, naming what changed; the correct engines pass."""

import pytest

from conftest import run_suites

HISTORY = "kv_test_engines_history:"


def test_a_correct_batched_engine_passes_the_history_checks(kvtester):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_precision:LeftPaddedBatched", "-k", "call_history")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize("twin, check, line", [
    ("PaddingKeptPerBatchSize", "test_same_batch_size_new_length_mix",
     "*index * of a batch of lengths ?20, 5, 40?, call * on one engine object: batch size 3 again, length mix "
     "?20, 5, 40? after ?7, 33, 16?*"),
    ("WrongSingleAfterBatchOf3", "test_single_after_each_batch_size",
     "*call * on one engine object: a single prompt right after a batch of size 3 with lengths ?5, 40, 12?, "
     "shortest 5*"),
])
def test_a_history_twin_fails_the_check_for_its_history(kvtester, twin, check, line):
    result = run_suites(kvtester, f"--kv-engine={HISTORY}{twin}", "-k", "call_history")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines([line])  # (the engine object is shared: the other check may fail on it too)
    failed = [line for line in result.stdout.lines if line.startswith("FAILED")]
    assert any(f"{check}[" in line for line in failed), result.stdout.str()[-2000:]


def test_more_decode_steps_than_warmup_is_a_recompile_named_by_its_dimension(kvtester):
    twin = run_suites(kvtester, f"--kv-engine={HISTORY}RecompilesPastWarmupSteps", "-k", "no_recompiles_after_warmup")
    twin.assert_outcomes(failed=1)
    twin.stdout.fnmatch_lines([
        "*1 dynamo compile(s) after warmup, 0 allowed*",
        "*generate(<1 prompt(s) of lengths ?7?>, 64) "
        "?new: more decode steps (64) than warmup's 32, on warmup length 7?: "
        "1 compile(s)*",
        "*tensor 'room' size mismatch at index 0. expected 32, actual 64*",
    ])
    correct = run_suites(kvtester, "--kv-engine=kv_test_engines:CompiledGreedy", "-k", "no_recompiles_after_warmup")
    correct.assert_outcomes(passed=1)
