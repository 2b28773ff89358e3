"""Any engine as the oracle (issue 25, pytest_kvcompile/oracles/engine.py): a plain-torch model in its own checkpoint
format (tests/kv_own_model.py) checked against its own eager mode; its compiled-only twin fails; an oracle without
score(), one whose score() is not its generate(), one wrong in float64 and one that is not eager are each named."""

import json
import os

import pytest
import torch

from conftest import TOKEN_CHECKS, run_suites
from kv_own_model import write_checkpoint
from pytest_kvcompile import Reference, TokenMismatch, check_tokens
from pytest_kvcompile.config.options import Settings
from pytest_kvcompile.oracles.token_match import token_verdict

OWN = "kv_own_model:"


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("own") / "tinygpt")


def own(kvtester, own_model, engine, *args, oracle="eager"):
    oracles = [f"--kv-oracle={oracle}"] if oracle else []
    return run_suites(kvtester, "--kv-zoo=none", f"--kv-model={own_model}", f"--kv-engine={OWN}{engine}", *oracles,
                      *args)


# --- the own model against its own eager mode ------------------------------------------------------------------------
@pytest.mark.full  # inductor (aot_eager in the fast tier)
def test_the_plain_torch_model_passes_against_its_own_eager_mode_under_inductor(kvtester, own_model):
    result = own(kvtester, own_model, "TinyGPT", "--kv-compile-backend=inductor", "--kv-report-json=r.json")
    assert result.ret == 0, result.stdout.str()[-3000:]
    outcomes = result.parseoutcomes()
    assert outcomes["passed"] >= 10 and "failed" not in outcomes
    result.stdout.fnmatch_lines(["PASS  kv_own_model:TinyGPT: * passed*; against eager: engine 'kv_own_model:TinyGPT' "
                                 "itself under torch.compiler.set_stance('force_eager'), its score() for near ties; "
                                 "the oracle is the engine's own code in eager mode: only what compiling changes is "
                                 "checked (--kv-oracle=hf checks the model's math) (1 model)"])
    row = json.loads((kvtester.path / "r.json").read_text())["rows"][0]
    assert row["verified_tokens"] > 0 and row["compiles"]["warmup"] >= 1  # the compiled path ran and was judged
    assert row["oracle"]["engine"] and len(row["oracle"]["limitations"]) == 1  # score() and the float64 self-check


@pytest.mark.full  # inductor (aot_eager in the fast tier)
def test_its_compiled_only_twin_fails_against_its_eager_mode_under_inductor(kvtester, own_model):
    result = own(kvtester, own_model, "TinyGPTWrongCompiled", "--kv-compile-backend=inductor", "-k", "token_identity")
    assert result.ret == 1
    result.stdout.fnmatch_lines([
        "*engine 'kv_own_model:TinyGPTWrongCompiled' diverges from the oracle on model 'tinygpt', "
        "prompt *: step * of 16",
        "*the oracle prefers * by a logit gap of * > tie tolerance 0.001, so this is a real mismatch*",
        "*reference: eager: engine 'kv_own_model:TinyGPTWrongCompiled' itself under torch.compiler.set_stance("
        "'force_eager')*",
    ])


def test_an_isolated_engine_on_an_own_model_against_its_eager_mode(kvtester, own_model):
    # the default for engines that are not built-in: the engine in its own process, its eager oracle in this one
    good = own(kvtester, own_model, "TinyGPT", "--kv-compile-backend=aot_eager", "--kv-isolate=auto",
               "-k", "token_identity or recompiles")
    assert good.ret == 0, good.stdout.str()[-3000:]
    good.stdout.fnmatch_lines(["kvcompile: kv_own_model:TinyGPT / tinygpt: built in * s in process *"])
    bad = own(kvtester, own_model, "TinyGPTWrongCompiled", "--kv-compile-backend=aot_eager", "--kv-isolate=auto",
              "-k", "token_identity")
    assert bad.ret == 1 and bad.parseoutcomes()["failed"] >= 3


@pytest.mark.full  # the fast tier's verdicts again under xdist
def test_the_same_verdicts_under_xdist(kvtester, own_model):
    good = own(kvtester, own_model, "TinyGPT", "--kv-compile-backend=aot_eager", "-n", "2", "-k", TOKEN_CHECKS)
    assert good.ret == 0, good.stdout.str()[-3000:]
    bad = own(kvtester, own_model, "TinyGPTWrongCompiled", "--kv-compile-backend=aot_eager", "-n", "2",
              "-k", "token_identity")
    assert bad.ret == 1 and bad.parseoutcomes()["failed"] >= 3


def test_a_declared_eager_counterpart_is_the_eager_oracle(kvtester, own_model):
    result = own(kvtester, own_model, "TinyGPTCounterpart", "--kv-compile-backend=aot_eager", "-k", "token_identity")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*reference: eager: engine 'kv_own_model:TinyGPTEager' "
                                 "(its declared eager counterpart)*"])


def test_a_named_oracle_per_engine(kvtester, own_model):
    wrong = f"{OWN}TinyGPTWrongCompiled"
    result = own(kvtester, own_model, "TinyGPTWrongCompiled", "--kv-compile-backend=aot_eager", "-k", "token_identity",
                 oracle=f"{wrong}={OWN}TinyGPT")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*reference: engine: engine 'kv_own_model:TinyGPT', its score() for near ties*"])


# --- what an engine oracle cannot do is named, never a silent pass ----------------------------------------------------
def test_without_score_tokens_must_be_equal_and_the_limitation_is_reported(kvtester, own_model):
    good = own(kvtester, own_model, "TinyGPTNoScore", "--kv-compile-backend=aot_eager", "-k", TOKEN_CHECKS)
    assert good.ret == 0, good.stdout.str()[-3000:]
    good.stdout.fnmatch_lines(["PASS  kv_own_model:TinyGPTNoScore: *; tokens must be equal: the oracle declares no "
                               "score(), so no near tie can be judged and an engine's score() is checked against its "
                               "own generate() only; no float64 self-check of the oracle (none: *"])
    bad = own(kvtester, own_model, "TinyGPTNoScoreWrongCompiled", "--kv-compile-backend=aot_eager",
              "-k", "token_identity")
    assert bad.ret == 1
    bad.stdout.fnmatch_lines(["*expected token *, got *: the oracle has no logits (it declares no score()), so every "
                              "token must be equal*"])


@pytest.mark.parametrize("oracle, message", [
    ("TinyGPTScoreOffByOne", "*oracle unreliable: engine: engine 'kv_own_model:TinyGPTScoreOffByOne'*its generate() "
                             "chose * but its score() prefers *"),  # its score() is not its generate()
    ("TinyGPTOffInFloat64", "*oracle unreliable: torch *, model 'tinygpt' (float32, cpu)*but the oracle engine "
                            "'kv_own_model:TinyGPTOffInFloat64' in float64 * prefers "
                            "*Check the oracle engine*"),  # self-check
])
def test_an_unreliable_engine_oracle_is_not_judged(kvtester, own_model, oracle, message):
    result = own(kvtester, own_model, "TinyGPT", "--kv-compile-backend=aot_eager", "-k", "token_identity", "-rs",
                 oracle=OWN + oracle)
    assert "passed" not in result.parseoutcomes() and result.parseoutcomes()["skipped"] >= 4
    result.stdout.fnmatch_lines([message])


def test_under_force_eager_a_score_that_is_not_its_generate_is_the_engines_failure(kvtester, own_model):
    result = own(kvtester, own_model, "TinyGPTEagerScoreOffByOne", "--kv-compile-backend=aot_eager",
                 "-k", "token_identity and short7")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*engine 'kv_own_model:TinyGPTEagerScoreOffByOne' in its own eager mode: *its "
                                 "generate() chose * but its score() prefers *score() must return the logits of the "
                                 "same path as generate()*"])


def test_a_prompt_the_oracle_engine_refuses_is_not_judged_the_others_are(kvtester, own_model):
    result = own(kvtester, own_model, "TinyGPT", "--kv-compile-backend=aot_eager", "-k", "token_identity", "-rs",
                 oracle=f"{OWN}TinyGPTLimited")
    outcomes = result.parseoutcomes()
    assert result.ret == 0 and outcomes["passed"] == 3, result.stdout.str()[-3000:]  # len1, short7, long48
    result.stdout.fnmatch_lines(["SKIPPED*oracle unreliable: engine: engine 'kv_own_model:TinyGPTLimited', its "
                                 "score() for near ties gave no reference for a prompt of length 250 on model "
                                 "'tinygpt': engine 'kv_own_model:TinyGPTLimited (the oracle)' raised ValueError in "
                                 "generate(*): prompts longer than 100 tokens are not supported. "
                                 "This prompt's token checks are not judged*"])


def test_an_eager_oracle_that_runs_compiled_code_fails(kvtester, own_model):
    result = own(kvtester, own_model, "TinyGPTNotEager", "--kv-compile-backend=aot_eager", "-k", "token_identity")
    assert result.ret == 1 and result.parseoutcomes()["errors"] >= 1
    result.stdout.fnmatch_lines(["*the eager oracle (*) ran compiled code in generate(*): dynamo compiled forward "
                                 "*compiled against compiled proves nothing*"])


def test_a_16_bit_run_on_an_own_model_needs_explicit_numbers(kvtester, own_model):
    skipped = own(kvtester, own_model, "TinyGPT", "--kv-compile-backend=aot_eager", "--kv-dtype=bfloat16",
                  "-k", "token_identity and short7 and not batched", "-rs")
    skipped.stdout.fnmatch_lines(["*model 'tinygpt' is not a transformers checkpoint, so its bfloat16 noise cannot be "
                                  "measured*give --kv-tie-tolerance, --kv-max-near-ties, --kv-max-near-tie-rate "
                                  "explicitly*"])
    numbers = ("--kv-tie-tolerance=0.25", "--kv-max-near-ties=2", "--kv-max-near-tie-rate=0.05")
    both = own(kvtester, own_model, "TinyGPT", f"--kv-engine={OWN}TinyGPTWrongCompiled",
               "--kv-compile-backend=aot_eager", "--kv-dtype=bfloat16", *numbers, "-k", "token_identity")
    assert both.ret == 1, both.stdout.str()[-3000:]
    both.stdout.fnmatch_lines([f"PASS  {OWN}TinyGPT: *"])
    both.stdout.fnmatch_lines([f"FAIL  {OWN}TinyGPTWrongCompiled: *"])


def test_a_declared_layout_on_an_own_model_is_a_named_skip(kvtester, own_model):
    result = own(kvtester, own_model, "TinyGPTWithLayout", "--kv-compile-backend=aot_eager", "-k", "kv_memory", "-rs")
    assert result.ret == 0, result.stdout.str()[-3000:]
    result.stdout.fnmatch_lines(["SKIPPED*model 'tinygpt' is not a transformers checkpoint (its config.json is the "
                                 "engine's own): the footprint of a declared kv_layout cannot be computed from it*"])


# --- the hf oracle and bad input --------------------------------------------------------------------------------------
def test_the_hf_oracle_cannot_load_an_own_model_and_says_what_to_do(kvtester, own_model):
    result = own(kvtester, own_model, "TinyGPT", "-k", "token_identity and short7 and not batched", "-rs",
                 oracle="other=eager")  # an entry for another engine: TinyGPT keeps hf
    result.stdout.fnmatch_lines(["*no oracle for engine 'kv_own_model:TinyGPT' on model 'tinygpt': it is not a "
                                 "transformers checkpoint*--kv-oracle=eager*"])
    plain = own(kvtester, own_model, "TinyGPT", oracle="")
    assert plain.ret == 4
    plain.stderr.fnmatch_lines(["*--kv-model=*tinygpt: transformers cannot read its config.json*checked against an "
                                "engine (--kv-oracle=eager or NAME), any directory with a config.json giving "
                                "vocab_size works*"])


@pytest.mark.parametrize("value, message", [
    ("=eager", "*--kv-oracle='=eager': give 'hf', 'eager', an engine NAME, or 'ENGINE=ORACLE'*"),
    ("kv_own_model:TinyGPT=kv_own_model:TinyGPTEvicting", "*engine 'kv_own_model:TinyGPT' declares strategy exact but "
                                                         "its oracle 'kv_own_model:TinyGPTEvicting' declares "
                                                         "last_recent(budget=16)*"),
    ("kv_own_model:TinyGPT=kv_own_model:TinyGPTEager", None),  # fine: a usage error only for another engine below
    ("eager", None),
    ("kv_own_model:TinyGPT", "*engine 'kv_own_model:TinyGPT' cannot be its own oracle*use "
                             "--kv-oracle=kv_own_model:TinyGPT=eager*"),
    ("no-such-engine", "*unknown engine 'no-such-engine'. Available engines:*"),
])
def test_bad_oracles_are_usage_errors(kvtester, own_model, value, message):
    result = own(kvtester, own_model, "TinyGPT", "--co", oracle=value)
    if message is None:
        assert result.ret == 0, result.stderr.str()
        return
    assert result.ret == 4
    result.stderr.fnmatch_lines([message])


def test_eager_for_an_engine_that_does_not_compile_is_a_usage_error(kvtester, own_model):
    result = own(kvtester, own_model, "TinyGPTEager", "--co")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*--kv-oracle=eager: engine 'kv_own_model:TinyGPTEager' declares neither "
                                 "compiled=True nor an eager counterpart, so its eager mode is itself*"])


def test_an_own_directory_needs_a_vocab_size(kvtester, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"format": "mine"}))
    result = own(kvtester, tmp_path, "TinyGPT")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*transformers cannot read its config.json and it gives no \"vocab_size\"*"])


# --- units ------------------------------------------------------------------------------------------------------------
def test_a_per_engine_oracle_wins_over_the_run_wide_one():
    settings = Settings(engines=("a", "b"), models=(), zoo=None, zoo_head_dim=16, device="cpu", dtype="float32",
                        max_new_tokens=4, tie_tolerance=1e-3, compile_backend="eager", cache_dir=None,
                        oracles=(("a", "x"), ("", "eager"), ("a", "y")))
    assert (settings.oracle("a"), settings.oracle("b")) == ("y", "eager")
    assert Settings(**{**settings.__dict__, "oracles": ()}).oracle("a") == "hf"


def test_a_reference_without_logits_judges_by_equality():
    ref = Reference((1, 2), (3, 4, 5), None, "an engine without score()")
    assert token_verdict(ref, [3, 4, 5], 1e-3).divergences == []
    verdict = token_verdict(ref, [3, 9, 5], 1e3)  # no tolerance makes a difference a near tie without logits
    assert verdict.mismatch.step == 1 and verdict.mismatch.gap == float("inf")
    with pytest.raises(TokenMismatch, match="the oracle has no logits"):
        check_tokens(ref, [3, 9, 5], tie_tolerance=1e3)


def test_the_reference_cache_is_keyed_by_the_oracle(own_model):
    from pytest_kvcompile.contract import registry
    from pytest_kvcompile.contract.engine import ModelSpec, Strategy
    from pytest_kvcompile.models.checkpoints import OwnConfig
    from pytest_kvcompile.oracles.engine import EngineOracle, choose
    from pytest_kvcompile.oracles.store import _fingerprint

    spec = ModelSpec("tinygpt", own_model, OwnConfig(json.loads((own_model / "config.json").read_text())))

    def key(engine, wanted, dtype=torch.float32):
        ref = registry.resolve(OWN + engine)
        oracle = EngineOracle(choose(ref.name, ref, wanted, registry.resolve), spec.__class__(**{
            **spec.__dict__, "dtype": dtype}), "eager")
        return _fingerprint(oracle, Strategy(), oracle.spec)

    keys = [key("TinyGPT", "eager"), key("TinyGPTNoScore", "eager"), key("TinyGPTWrongCompiled", OWN + "TinyGPT"),
            key("TinyGPT", "eager", torch.bfloat16)]
    assert len(set(keys)) == len(keys) and key("TinyGPT", "eager") == keys[0]


def test_the_oracle_store_is_keyed_by_the_checkpoints_content(own_model, tmp_path):
    """Issue 54: a store recorded for a checkpoint (a nightly job's) is found for its copy at another path on another
    machine, and not for a checkpoint differing in one byte; each file is read once (its digest kept by path, size
    and modification time)."""
    import shutil

    from pytest_kvcompile.oracles.recorded import content_digest

    copy = shutil.copytree(own_model, tmp_path / "elsewhere")
    memo = tmp_path / "digests"
    assert content_digest(copy, memo) == content_digest(own_model) == content_digest(copy, memo)
    assert len(list(memo.iterdir())) == len([p for p in copy.iterdir() if p.is_file()])
    weights = next(p for p in copy.iterdir() if p.suffix in (".safetensors", ".pt", ".bin"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    before = weights.stat().st_mtime_ns
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before + 10**9, before + 10**9))  # a second later, even where mtimes are coarse
    assert content_digest(copy, memo) != content_digest(own_model)  # a new modification time: read again


def test_the_html_token_diff_of_an_oracle_without_logits():
    from pytest_kvcompile.reports.html import token_diff

    ref = Reference((1, 2), (3, 4, 5), None, "an engine without score()")
    with pytest.raises(TokenMismatch) as caught:
        check_tokens(ref, [3, 9, 5])
    assert "the oracle has no logits (no score()), so every token must be equal" in token_diff(caught.value.failure)
