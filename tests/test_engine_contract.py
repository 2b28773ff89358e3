"""Engines that break the contract fail with a message naming the problem and the fix,
showing the engine's own traceback, never the plugin's internals; undeclared capabilities skip."""

import pytest

from conftest import TOKEN_CHECKS, run_suites

ONE_CALL = """
def test_generate(kv_engine, kv_prompts):
    kv_engine.generate(kv_prompts[:1])
"""


@pytest.mark.parametrize("engine, lines", [
    ("RaisesInInit", [
        "*engine 'kv_test_engines:RaisesInInit' raised RuntimeError in its factory kv_test_engines:RaisesInInit"
        "(ModelSpec(name='llama', ...)): weights not found: simulated engine init failure",
        "The engine's traceback:",
        "*kv_test_engines.py*in __init__*",
    ]),
    ("RaisesInGenerate", [
        "*engine 'kv_test_engines:RaisesInGenerate' raised ValueError in generate(<1 prompt(s) of lengths ?1?>, "
        "max_new_tokens=16): simulated kernel failure for batch of 1",
        "*kv_test_engines.py*in _explode*",
    ]),
    ("WrongCount", ["*returned malformed output from generate(*): continuation 0 has 15 tokens, expected exactly "
                    "max_new_tokens=16 (the suite never stops at EOS: generate all of them)"]),
    ("FloatTokens", ["*continuation 0, step 0: *.0 (float) is not an int token id"]),
    ("OutOfVocab", ["*continuation 0, step 0: token id 261 is outside the vocabulary ?0, 256)"]),
    ("ReturnsTensor", ["*got a torch.Tensor of shape (1, 16); return plain lists: `tokens.tolist()`"]),
    ("NoGenerate", ["*its factory returned a NoGenerate without a generate() method*"]),
])
def test_contract_violations_fail_clearly(kvtester, engine, lines):
    kvtester.makepyfile(ONE_CALL)
    result = kvtester.runpytest_subprocess(f"--kv-engine=kv_test_engines:{engine}", "--kv-zoo=llama")
    # an engine that cannot be built is an error in the test's setup; a bad call fails the test
    result.assert_outcomes(**({"errors": 1} if engine in ("RaisesInInit", "NoGenerate") else {"failed": 1}))
    result.stdout.fnmatch_lines(lines)
    out = result.stdout.str()
    assert "engine_io.py" not in out and "session.py" not in out


def test_failed_build_fails_later_tests_fast(kvtester):
    kvtester.makepyfile(ONE_CALL + ONE_CALL.replace("test_generate", "test_again"))
    result = kvtester.runpytest_subprocess("--kv-engine=kv_test_engines:RaisesInInit", "--kv-zoo=llama")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*failed to build for model 'llama' in an earlier test (see its first failure*"])


def test_undeclared_capabilities_skip_with_the_capability_named(kvtester):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines:Unbatched", "-rs", "-k", TOKEN_CHECKS)
    result.assert_outcomes(passed=7, skipped=5)
    reason = ("engine 'kv_test_engines:Unbatched' does not declare capability 'batching' "
              "(declare it with kv_declaration = Declaration(batching=True) if it supports it)")
    result.stdout.fnmatch_lines([f"SKIPPED ?1? *{name}.py:*: {reason}" for name in
                                 ("test_batch_consistency", "test_determinism", "test_prefix_cache", "test_stale_state",
                                  "test_token_identity")])


def test_undeclared_device_skips(kvtester):
    kvtester.makepyfile(ONE_CALL)
    result = kvtester.runpytest_subprocess("--kv-engine=kv_test_engines:CudaOnly", "--kv-zoo=llama", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*engine 'kv_test_engines:CudaOnly' does not declare device 'cpu' "
                                 "(declares devices=?'cuda'?)*"])
