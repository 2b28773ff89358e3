"""The verdict rules (issue 10): for each class of bug that once fooled the suite, an engine written only against
the public contract that must now FAIL, with a message naming the class; and correct engines that must PASS.
Real pytest runs of suites/ (pytester), engines in tests/kv_test_engines_verdicts.py."""

import json

import pytest

from conftest import TOKEN_CHECKS, run_suites

E = "--kv-engine=kv_test_engines_verdicts:"


# --- correct engines pass -----------------------------------------------------------------------------------------
def test_correct_engines_pass_every_token_check(kvtester):
    """float32 here; Recompute in bfloat16 and float16: tests/test_precision.py (the CI's bfloat16 job: every zoo
    model, gemma3-hybrid too)."""
    engines = ("Recompute", "TinyNoise")
    result = run_suites(kvtester, *(E + engine for engine in engines), "--kv-zoo=llama,gemma3-hybrid,gpt2-abspos",
                        "-k", TOKEN_CHECKS)
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert "failed" not in result.parseoutcomes()
    for engine in engines:
        result.stdout.fnmatch_lines([f"PASS  kv_test_engines_verdicts:{engine}: *"])


# --- 1. nothing after a near tie goes unverified ------------------------------------------------------------------
def test_a_flip_then_garbage_fails_on_the_first_garbage_token(kvtester):
    result = run_suites(kvtester, E + "FlipThenGarbage", "--kv-tie-tolerance=5", "-k", "token_identity and short7")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*diverges from the oracle on model 'llama', prompt 'short7' (length 7), alone: step 3 of 16 (given the "
        "engine's own tokens before it, which left the oracle's path at an earlier near tie)*",
        "*earlier near tie at step 2:*",
    ])


def test_flipping_at_every_close_call_is_numerics_drift(kvtester):
    result = run_suites(kvtester, E + "FlipsAtEveryCloseCall", "--kv-tie-tolerance=5",
                        "-k", "token_identity and long48 and not batched")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*drifts from the oracle on model 'llama', prompt 'long48' (length 48), alone: * near "
                                 "ties in one sequence of 16 steps, more than the 2 allowed (--kv-max-near-ties)*"])


def test_a_declared_score_that_is_not_the_generate_path_fails(kvtester):
    engines = ("ScoreOffByOne", "ScoreLogSoftmax")
    result = run_suites(kvtester, *(E + e for e in engines), "-k", "token_identity and short7 and not batched")
    result.assert_outcomes(failed=2)
    for engine in engines:
        result.stdout.fnmatch_lines([f"*engine 'kv_test_engines_verdicts:{engine}': score() is not the oracle's "
                                     "logits on model 'llama', prompt 'short7'*",
                                     "*its logits differ from the oracle's by up to * > score tolerance 0.01*"])


# --- 2. compiles are observed, not declared -----------------------------------------------------------------------
COMPILE_PROBLEMS = {  # engine: its failure's line
    "CompiledUndeclared": "*: * dynamo compile(s) after warmup, 0 allowed*",
    "EagerOnRecompile": "*frame run(s) after warmup ran EAGERLY after failing their guards*",
    "SwallowsCompileErrors": "*a compile of _item_step * FAILED (*",
    "GraphBreaks": "*graph break(s) in the engine's compiled code, none allowed*",
    "StopsCompiling": "*compiled code stopped running: warmup ran compiled code, but * unseen call(s) entered no "
                      "compiled frame*",
}


def test_compile_problems_are_observed(kvtester):
    result = run_suites(kvtester, *(E + e for e in COMPILE_PROBLEMS), "-k", "no_recompiles_after_warmup")
    result.assert_outcomes(failed=len(COMPILE_PROBLEMS))
    for engine, message in COMPILE_PROBLEMS.items():
        result.stdout.fnmatch_lines([f"FAIL  kv_test_engines_verdicts:{engine}: *"])
        result.stdout.fnmatch_lines([message])


def test_graph_breaks_can_be_allowed(kvtester):
    result = run_suites(kvtester, E + "GraphBreaks", "--kv-allow-graph-breaks", "-k", "no_recompiles_after_warmup")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*GraphBreaks / llama: * graph break(s)*"])


# --- 3. lengths and prefixes that exercise the cache --------------------------------------------------------------
def test_a_cache_that_keeps_only_256_positions_fails_past_256(kvtester):
    result = run_suites(kvtester, E + "KeepsLast256", "-k", "token_identity and not batched")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*prompt 'long250' (length 250), alone: step *"])


def test_a_prefix_cache_keyed_by_16_tokens_fails_the_shared_prefix_check_only(kvtester):
    fixed = run_suites(kvtester, E + "PrefixCacheBug", "-k", "token_identity or stale_state or determinism")
    assert fixed.ret == 0, fixed.stdout.str()[-3000:]
    result = run_suites(kvtester, E + "PrefixCacheBug", "-k", "shared_prefixes")
    result.assert_outcomes(failed=1, skipped=1)  # the batched variant: PrefixCacheBug does not batch
    result.stdout.fnmatch_lines(["*prompt 'shared16+b' (length 24), call 10 of 41 on one engine object, after prompts "
                                 "?shared15+b, shared15+a, shared16+a?: shared-prefix check: step 0*"])


def test_a_strategy_that_never_evicts_fails_the_run_as_vacuous(kvtester):
    result = run_suites(kvtester, E + "NeverEvicts", "-k", "token_identity and not batched")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "failed" not in result.parseoutcomes()
    result.stdout.fnmatch_lines(["*the run FAILS on 1 verdict rule(s)*",
                                 "*its eviction strategy evicted nothing on any of the * verified sequence(s)*"])


# --- 4. absolute positions are visible ----------------------------------------------------------------------------
def test_positions_carried_across_calls_fail_on_the_absolute_position_model_only(kvtester):
    relative = run_suites(kvtester, E + "ContinuesPositions", "-k", "stale_state")
    assert relative.ret == 0, relative.stdout.str()[-3000:]  # invisible under RoPE: why the zoo has gpt2-abspos
    result = run_suites(kvtester, E + "ContinuesPositions", "--kv-zoo=gpt2-abspos", "-k", "stale_state")
    result.assert_outcomes(failed=1, skipped=1)  # test_stale_state_batched: the engine does not batch
    result.stdout.fnmatch_lines(["*diverges from the oracle on model 'gpt2-abspos', prompt *, call 2 of 6*"])


def test_positions_that_ignore_left_padding_fail_batched_on_the_absolute_position_model(kvtester):
    result = run_suites(kvtester, E + "PadPositions", "--kv-zoo=llama,gpt2-abspos", "-k", "token_identity_batched")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED *test_token_identity_batched*PadPositions-gpt2-abspos*"])


# --- 5. memory is measured, not only self-reported ----------------------------------------------------------------
def test_an_engine_holding_16x_what_it_reports_fails(kvtester):
    result = run_suites(kvtester, E + "PreallocatesSixteenX", "-k", "memory_held")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*holds * besides its weights (*) after generate(<*>, 16), more than 1.5 x "
                                 "kv_cache_bytes() = * and its declared KVLayout('dynamic') = * + 65,536 B*"])


def test_a_memo_keyed_by_prompt_fails_the_growth_check(kvtester):
    result = run_suites(kvtester, E + "MemoByPrompt", "-k", "memory_growth")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*memory grows over 3 repeated calls generate(*), each call with other prompts*"])


# --- 6. nothing vacuous -------------------------------------------------------------------------------------------
def test_an_unknown_strategy_is_a_usage_error(kvtester):
    result = run_suites(kvtester, E + "UnknownStrategy")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*strategy kind 'h20' is unknown; known: *h2o*without_oracle*"])


@pytest.mark.parametrize("args", [(), ("--kv-engine=",), pytest.param(("-n", "2"), marks=pytest.mark.full)])
def test_no_engine_is_a_usage_error(kvtester, args):
    result = run_suites(kvtester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-engine*"])


def test_cuda_without_cuda_is_one_usage_error(kvtester):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_suites(kvtester, "--kv-engine=hf-eager", "--kv-device=cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kv-device=cuda: *"])


def test_a_known_finding_absorbs_only_the_failure_it_names(kvtester):
    engine = "kv_test_engines_verdicts:KeepsLast256"
    # twins that must not absorb the mismatch: another kind (an engine error), and the right kind on another model
    other = f"{engine} | test_token_identity | other(raised=ValueError) | cache too short"
    elsewhere = f"{engine} | test_token_identity[gpt2-abspos] | mismatch | cache too short"
    result = run_suites(kvtester, E + "KeepsLast256", f"--kv-known-finding={other}",
                        f"--kv-known-finding={elsewhere}", "-k", "token_identity and long250 and not batched")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"{engine}: test_token_identity other(raised=ValueError): cache too short: its 1 "
                                 "test(s) ran and none failed the way it names"])
    named = f"{engine} | test_token_identity[llama/long250] | mismatch | cache too short"
    result = run_suites(kvtester, E + "KeepsLast256", f"--kv-known-finding={named}",
                        "-k", "token_identity and long250 and not batched")
    result.assert_outcomes(xfailed=1)


def test_a_strategy_without_oracle_gets_the_oracle_free_checks(kvtester):
    good = run_suites(kvtester, E + "WithoutOracle", "-k", TOKEN_CHECKS, "-rs")
    assert good.ret == 0, good.stdout.str()[-3000:]
    good.stdout.fnmatch_lines(["*declares no oracle*the oracle-free checks still run*"])
    bad = run_suites(kvtester, E + "StaleWithoutOracle", "-k", "stale_state and not batched")
    bad.assert_outcomes(failed=1)
    bad.stdout.fnmatch_lines(["*gave * on call 1 but * on call 4 of 6 on one engine object*state leaks*"])


def test_an_engine_on_which_no_token_was_checked_fails_the_run(kvtester):
    result = run_suites(kvtester, E + "SkipsEverything", "-k", "token_identity")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*token check(s) ran but no token was verified*skips: not today*"])


@pytest.mark.full  # the fast tier's verdicts again, in another order
def test_verdicts_do_not_depend_on_test_order(kvtester):
    """A cache kept across calls, on sliding-window models where long prompts hide it: which tests fail depends on
    the calls the engine object served before. Each engine x model runs in one worker, in collection order
    (run/grouping.py), so the object serves the same calls serial and with -n 2: the same rows, test for test."""
    rows = {}
    for workers in ("0", "2"):
        report = kvtester.path / f"report-{workers}.json"
        run_suites(kvtester, "--kv-engine=kv_test_engines:StaleCache", "--kv-zoo=mistral-sw,gemma3-hybrid",
                   "-n", workers, "-k", TOKEN_CHECKS, f"--kv-report-json={report}")
        found = json.loads(report.read_text())["rows"]
        rows[workers] = {(r["engine"], r["model"]): (r["tests"], sorted(f["test"] for f in r["failures"]))
                         for r in found}
    assert rows["0"] == rows["2"]
    mistral = rows["0"][("kv_test_engines:StaleCache", "mistral-sw")][0]
    assert mistral["passed"] and mistral["failed"], mistral  # a mix: the order could have mattered


# --- 8. the oracle checks itself ----------------------------------------------------------------------------------
CORRUPT_ORACLE = '''
import pytest
from pytest_kvcompile.oracles import hf as oracle, truth


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    original = oracle.HFEagerOracle.teacher_forced

    def corrupted(self, prompt, tokens, tie_tolerance=0.0):  # a transformers bug in the oracle's one forward: its
        rows = original(self, prompt, tokens, tie_tolerance).clone()  # step 5 puts the runner-up first
        if len(tokens) > 5:
            best, second = rows[5].topk(2).indices.tolist()
            rows[5, best], rows[5, second] = float(rows[5, second]), float(rows[5, best])
        return rows

    oracle.HFEagerOracle.teacher_forced = corrupted
    truth.WIDE_AT_ONCE = 1000  # the zoo's head counts as a vocabulary's: the float64 path screens it (truth._screen)
    screen = truth._screen
    truth._screen = lambda *a: open("screened", "a").write("1") and screen(*a)
'''


def test_an_oracle_that_fails_its_self_check_skips_the_model_as_not_judged(kvtester):
    """Neither an error nor a failure (the engine is correct): a named skip, counted in the engine's verdict line."""
    kvtester.makepyfile(corrupt_oracle=CORRUPT_ORACLE)  # a plugin (-p): suites/ is outside the test dir
    result = run_suites(kvtester, "--kv-engine=kv_test_engines:Greedy", "-p", "corrupt_oracle", "-rs",
                        f"--kv-cache-dir={kvtester.path / 'private-cache'}",  # keep the corrupted references private
                        "-k", "token_identity and short7 and not batched")
    result.assert_outcomes(skipped=1)
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*oracle unreliable: transformers *, model 'llama' (float32, cpu), "
                                 "prompt of length *, "
                                 "step 5: its logits along the engine's tokens (transformers eager greedy, full "
                                 "DynamicCache) chose *, but "
                                 "transformers eager in float64 without a cache (one full recompute) prefers * by *"
                                 "(this is not a verdict on the engine)*"])
    result.stdout.fnmatch_lines(["NOT CHECKED  kv_test_engines:Greedy: 1 skipped, not judged on llama (oracle "
                                 "unreliable) (1 model)"])
    assert (kvtester.path / "screened").read_text()  # caught by the screened float64 head


REFUSING_KERNEL = '''
import pytest
from pytest_kvcompile.oracles import store


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    def refuses(self, prompt, tokens, tie_tolerance=0.0):  # as transformers' grouped experts kernel in float64
        raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")

    store.NoCacheRecompute.teacher_forced = refuses
'''


def test_an_oracle_that_cannot_run_is_not_checked_with_its_cause_never_the_engines_failure(kvtester):
    """Issue 69: the float64 self-check raising (a kernel refusing float64) is no failure of the engine and no
    traceback of ours: every token check on the model is a named skip saying what raised where and what to try, the
    oracle-free checks still run, the verdict line says the oracle could not run, and no vacuous-run rule fires.
    The fix it names (--kv-oracle-check=off) then judges the same engine."""
    kvtester.makepyfile(refusing_kernel=REFUSING_KERNEL)
    select = "(token_identity and (short7 or long48) and not batched) or test_determinism"
    result = run_suites(kvtester, "--kv-engine=kv_test_engines:Greedy", "-p", "refusing_kernel", "-rs",
                        f"--kv-cache-dir={kvtester.path / 'private-cache'}", "-k", select)
    result.assert_outcomes(passed=2, skipped=2)  # the two determinism checks run, the two token checks skip
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*the oracle could not run on model 'llama' (float32, cpu): RuntimeError: Expected "
                                 "mat_a to be Float32, BFloat16 or Float16 matrix, got Double at refusing_kernel.py:* "
                                 "(refuses), in its float64 self-check (transformers eager greedy*; transformers *, "
                                 "torch *). Its token checks on this model are not judged (no verdict on the engine); "
                                 "try --kv-oracle-check=off*"])
    result.stdout.fnmatch_lines(["PASS  kv_test_engines:Greedy: 2 passed, 2 skipped, not judged on llama (the oracle "
                                 "could not run) (1 model)"])
    assert "Traceback" not in result.stdout.str() and "no token was verified" not in result.stdout.str()
    fixed = run_suites(kvtester, "--kv-engine=kv_test_engines:Greedy", "-p", "refusing_kernel", "-k", select,
                       f"--kv-cache-dir={kvtester.path / 'private-cache'}", "--kv-oracle-check=off")
    fixed.assert_outcomes(passed=4)


def test_the_kv_check_fixture_is_the_deprecated_spelling_of_kv_check_tokens(kvtester):
    """Downstream tests written with ``kv_check`` or ``kv_engine.check`` keep working, warned to move to
    ``kv_check_tokens`` (issue 27)."""
    kvtester.makepyfile(test_old="""
        def test_old(kv_engine, kv_oracle, kv_prompt, kv_check):
            got = kv_engine.generate([kv_prompt])[0]
            kv_check(kv_oracle.reference(kv_prompt.ids, kv_engine.max_new_tokens), got, kv_prompt)

        def test_older(kv_engine, kv_oracle, kv_prompt):
            got = kv_engine.generate([kv_prompt])[0]
            kv_engine.check(kv_oracle.reference(kv_prompt.ids, kv_engine.max_new_tokens), got, kv_prompt)

        def test_new(kv_engine, kv_oracle, kv_prompt, kv_check_tokens):
            got = kv_engine.generate([kv_prompt])[0]
            kv_check_tokens(kv_oracle.reference(kv_prompt.ids, kv_engine.max_new_tokens), got, kv_prompt)
    """)
    result = kvtester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:benchmark", "--kv-zoo=llama",
                                           "--kv-engine=kv_test_engines:Greedy", "-k", "short7", "-rw",
                                           "--kv-isolate=declared")  # (counts
    # warnings: a run forked from the prewarmed server adds pytest's own about the modules the server imported)
    result.assert_outcomes(passed=3, warnings=2)
    result.stdout.fnmatch_lines(["*test_old.py::test_old*", "*PytestDeprecationWarning: the kv_check fixture is "
                                 "deprecated: use kv_check_tokens (same arguments)*"])
    result.stdout.fnmatch_lines(["*test_old.py::test_older*", "*DeprecationWarning: kv_engine.check() is deprecated: "
                                 "call kv_engine.check_tokens() (same arguments)*"])


# --- 9. declared limits narrow what is checked, never widen what passes (issue 28) ---------------------------------
def test_an_id_the_runtime_never_emits_is_out_of_the_oracles_choice_and_reported(kvtester):
    report = kvtester.path / "r.json"
    result = run_suites(kvtester, E + "MasksAnId", "-k", TOKEN_CHECKS, f"--kv-report-json={report}")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["*PASS*MasksAnId: *ids [[]110[]] out of the oracle's choice (declared never "
                                 "emitted), decided * step(s)*"])
    row = json.loads(report.read_text())["rows"][0]
    assert row["excluded_ids"] == [110] and row["excluded_tokens"] > 0, row  # the declaration decided steps


def test_the_same_mask_undeclared_fails_where_the_oracle_chose_the_id_and_so_does_emitting_a_declared_one(kvtester):
    result = run_suites(kvtester, E + "MasksAnIdUndeclared", E + "DeclaresAnIdItEmits",
                        "-k", "token_identity and short7 and not batched")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*'kv_test_engines_verdicts:MasksAnIdUndeclared' diverges from the oracle on model "
                                 "'llama', prompt 'short7' (length 7), alone: step 8 of 16*",
                                 "*expected token 110, got *"])
    result.stdout.fnmatch_lines(["*'kv_test_engines_verdicts:DeclaresAnIdItEmits' returned token 110 on model 'llama', "
                                 "prompt 'short7' (length 7), alone: step 8 of 16, an id it declares it never emits "
                                 "(Declaration.never_emits: ids [[]110[]]*",
                                 "*hint: the engine returned 110, which its Declaration.never_emits rules out*"])


def test_declared_shape_bounds_skip_the_calls_outside_them_by_name_and_never_excuse_an_answer(kvtester):
    """One run: the engine refusing prompts past its declared bound skips those calls by name; the same engine
    undeclared fails them; a bound narrows what must work, never what may be wrong: an engine answering outside it
    is checked."""
    report = kvtester.path / "r.json"
    engines = ("RefusesLongPrompts", "RefusesLongPromptsUndeclared", "DeclaresBoundsAnswersWrong", "HoldsItsPositions",
               "WrongAtItsLastPositions")
    result = run_suites(kvtester, *(E + e for e in engines), "-k", "token_identity and not batched or long_generation",
                        "-rs", f"--kv-report-json={report}")
    rows = {row["engine"].split(":")[1]: row for row in json.loads(report.read_text())["rows"]}
    tests = {name: row["tests"] for name, row in rows.items()}
    declared, undeclared, answers, holds, wrong_late = (tests[e] for e in engines)
    assert declared.get("passed") and declared.get("skipped") and not declared.get("failed"), declared
    assert undeclared.get("failed") == declared["skipped"], tests
    assert answers.get("failed"), tests
    # a declared max_positions (a static cache of 300 on a 512-position model) sizes the long generations to the
    # engine's end: checked there, not skipped, so a cache wrong only in its last slots fails
    assert holds.get("passed") and not holds.get("failed") and not holds.get("skipped"), holds
    assert rows["WrongAtItsLastPositions"]["checks"]["test_long_generation"]["failed"], tests
    assert wrong_late.get("failed") == 2, wrong_late  # the two long generations, nothing else reaches position 280
    result.stdout.fnmatch_lines(["*long generation: 293 new tokens, to position 300*"])
    result.stdout.fnmatch_lines(["*declares Bounds(max_prompt=32) on model 'llama': this check's call generate(<1 "
                                 "prompt(s) of lengths [[]48[]]>, 16) is outside them (a prompt of 48 tokens > "
                                 "max_prompt=32)*"])
    result.stdout.fnmatch_lines(["*ValueError: Prefill length exceeds 32*"])
    result.stdout.fnmatch_lines(["*outside them (a prompt of 48 tokens > max_prompt=32), and the engine refused it "
                                 "(ValueError: Prefill length exceeds 32)*"])
    result.stdout.fnmatch_lines(["*'kv_test_engines_verdicts:DeclaresBoundsAnswersWrong' diverges from the oracle on "
                                 "model 'llama', prompt 'long48' (length 48)*"])


KV_INT8 = ("KVInt8", "KVInt4DeclaredInt8", "int8")
KV_FLOAT8 = ("KVFloat8", "KVFloat8E5M2DeclaredE4M3", "float8_e4m3fn")


@pytest.mark.parametrize(("dtype", "pairs"), [("float32", (KV_INT8,)), ("bfloat16", (KV_INT8, KV_FLOAT8)),
                                              pytest.param("float32", (KV_FLOAT8,), marks=pytest.mark.full)])
def test_a_kv_cache_stored_lower_is_held_to_its_measured_noise_and_no_more(kvtester, dtype, pairs):
    """Declared and stored so, int8 and float8 e4m3 (scaled per vector) pass; int4 declaring int8 and e5m2 declaring
    e4m3 fail (float8 in float32: the full tier, for time)."""
    checks, report = "token_identity or batch_consistency", kvtester.path / "r.json"
    both = run_suites(kvtester, *(E + e for good, bad, _ in pairs for e in (good, bad)), f"--kv-dtype={dtype}",
                      "-k", checks, f"--kv-report-json={report}")
    tests = {row["engine"].split(":")[1]: row["tests"] for row in json.loads(report.read_text())["rows"]}
    assert both.ret == pytest.ExitCode.TESTS_FAILED, both.stdout.str()[-3000:]
    for good, bad, kv in pairs:
        assert not tests[good].get("failed") and tests[good].get("passed"), tests
        both.stdout.fnmatch_lines([f"*llama ({dtype}) with K and V stored as {kv} (Declaration.kv_cache_dtype): tie "
                                   "tolerance *, near-tie rate *, score() tolerance *: what computing that way does*"])
        assert tests[bad].get("failed", 0) >= 2, tests


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.full)])
def test_matmul_inputs_quantised_as_declared_are_held_to_their_measured_noise_and_no_more(kvtester, dtype):
    """Inputs of every matmul in int8 blocks of 32 (llama.cpp's q8_0 dot products; the engine's scale a float, the
    simulation's a half: another rounding of the format) pass declared; int4 declaring int8 fails; undeclared they
    fail in float32 (in bfloat16 int8 blocks round about as finely as bfloat16 itself, within the model's own noise;
    bfloat16: the full tier, for time)."""
    engines, report = ("MatmulInt8", "MatmulInt8Undeclared", "MatmulInt4DeclaredInt8"), kvtester.path / "r.json"
    result = run_suites(kvtester, *(E + e for e in engines), f"--kv-dtype={dtype}", "-k",
                        "token_identity or batch_consistency", f"--kv-report-json={report}")
    tests = {row["engine"].split(":")[1]: row["tests"] for row in json.loads(report.read_text())["rows"]}
    good, undeclared, coarser = (tests[e] for e in engines)
    assert good.get("passed") and not good.get("failed"), tests
    assert coarser.get("failed", 0) >= 2 and (undeclared.get("failed", 0) >= 2) == (dtype == "float32"), tests
    result.stdout.fnmatch_lines([f"*llama ({dtype}) with matmul inputs as int8 (Declaration.matmul_inputs): tie "
                                 "tolerance *: what computing that way does*"])
    result.stdout.fnmatch_lines(["*MatmulInt4DeclaredInt8' diverges from the oracle on model 'llama'*"])


def test_the_same_int8_cache_undeclared_fails_in_float32(kvtester):
    result = run_suites(kvtester, E + "KVInt8Undeclared", "--kv-zoo=llama,gpt2-abspos", "-k", TOKEN_CHECKS)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*KVInt8Undeclared' diverges from the oracle on model 'llama', prompt 'len1'*",
                                 "*by a logit gap of * > tie tolerance 0.001, so this is a real mismatch*"])


def test_a_kv_format_that_flips_most_choices_skips_the_token_checks_by_name_and_fails_as_vacuous(kvtester):
    result = run_suites(kvtester, E + "KVInt2", "-k", "token_identity and not batched", "-rs")
    result.assert_outcomes(skipped=4)
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # declaring int2 is no way out of every token check
    result.stdout.fnmatch_lines(["*4 token check(s) ran but no token was verified*"])
    result.stdout.fnmatch_lines(["*computes with K and V stored as int2 (Declaration.kv_cache_dtype): on model 'llama' "
                                 "that alone "
                                 "changes the model's greedy choice at *% of positions (bound *%), so no token check "
                                 "can tell a bug from it*"])
