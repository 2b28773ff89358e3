"""The eviction reference engines (reference_impls/eviction_engine.py) and their masking oracle
(reference_impls/eviction.py), on the zoo's tiny Llama with the "eager" compile backend.

- each engine equals its oracle token for token AND holds exactly the positions the oracle
  leaves unmasked, per layer and KV head, for every prompt of a batch;
- with a budget no prompt reaches, the eviction oracle is the exact oracle;
- the project suites pass on the engines, and fail two engines that declare the right strategy
  but carry a bug (H2O without its recent window, StreamingLLM without sinks);
- kvpress, where installed, keeps the same sets after prefill as the prefill-only oracle modes.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

import kv_test_engines_eviction as engines  # noqa: E402
from conftest import run_suites  # noqa: E402
from pytest_kvcompile import zoo  # noqa: E402
from pytest_kvcompile.engine import ModelNotSupported, ModelSpec, Strategy, declaration_of  # noqa: E402
from pytest_kvcompile.oracle import HFEagerOracle, oracle_for  # noqa: E402
from pytest_kvcompile.token_match import assert_tokens_match  # noqa: E402
from reference_impls import eviction_engine  # noqa: E402
from reference_impls.eviction import EvictionOracle  # noqa: E402

NEW = 16
ENGINES = [engines.LastRecent, engines.StreamingLLM, engines.H2O, engines.TOVA]


def prompt(length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> ModelSpec:
    path = zoo.checkpoint("llama", tmp_path_factory.mktemp("zoo"))
    return ModelSpec("llama", path, AutoConfig.from_pretrained(path))


@pytest.mark.parametrize("factory", ENGINES, ids=lambda f: f.__name__)
def test_engine_equals_its_oracle_in_tokens_and_kept_positions(llama, factory):
    """A batch of lengths 48, 7, 1, 23 (left-padded): every row evicts during prefill or decode."""
    engine = factory(llama)
    oracle = oracle_for(declaration_of(factory).strategy, llama)
    prompts = [prompt(n) for n in (48, 7, 1, 23)]
    got = engine.generate(prompts, NEW)
    kept = engine.kept_positions()
    for row, p in enumerate(prompts):
        assert_tokens_match(oracle.reference(p, NEW), got[row], engine=factory.__name__, model="llama",
                            prompt=f"prompt of length {len(p)}")
        for layer, want in enumerate(oracle.kept(p, NEW)):
            held = kept[layer][row]
            assert [h[h >= 0].tolist() for h in held] == want.tolist(), f"row {row} (length {len(p)}), layer {layer}"
    budget = engine.policy.budget
    assert all(k.shape[-1] == budget for k in kept)
    assert engine.kv_cache_bytes() == 2 * len(kept) * 4 * 2 * budget * 16 * 4  # 2 layers, b=4, 2 kv heads, d=16, fp32


def test_a_budget_nothing_reaches_is_exact_attention(llama):
    p = prompt(48)
    exact = HFEagerOracle(llama).reference(p, NEW)
    for strategy in (Strategy.of("h2o", heavy=64, recent=64), Strategy.of("tova", budget=64)):
        got = EvictionOracle(llama, strategy).reference(p, NEW)
        assert got.tokens == exact.tokens
        torch.testing.assert_close(got.logits, exact.logits, atol=1e-4, rtol=1e-4)


def test_other_architectures_are_not_supported(llama, tmp_path):
    mistral = ModelSpec("mistral-sw", tmp_path, AutoConfig.for_model("mistral"))
    with pytest.raises(ModelNotSupported, match="implements Llama only, not 'mistral'"):
        eviction_engine.StreamingLLM(mistral, compile_backend="eager")
    with pytest.raises(ModelNotSupported, match="implements Llama only"):
        EvictionOracle(mistral, Strategy.of("tova", budget=4))


def test_the_suites_pass_on_the_h2o_engine(kvtester):
    """Token identity (alone and batched), zero recompiles, stale state, determinism. (All four engines:
    the same run with --kv-engine=kv_test_engines_eviction:{LastRecent,StreamingLLM,TOVA} too.)"""
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_eviction:H2O",
                        "-k", "token_identity or recompiles or stale_state or determinism")
    result.assert_outcomes(passed=9)
    result.stdout.fnmatch_lines(["kv_test_engines_eviction:H2O / llama: 0 compile(s) while building, 2 warmup compile(s) over 3 call(s), "
                                 "0 after warmup over * call(s)"])


def test_engines_with_a_broken_policy_fail_token_identity(kvtester):
    result = run_suites(kvtester, "--kv-engine=kv_test_engines_eviction:H2OForgetsRecent",
                        "--kv-engine=kv_test_engines_eviction:StreamingLLMWithoutSinks",
                        "-k", "test_token_identity and long48 and not batched")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*TokenMismatch: engine 'kv_test_engines_eviction:H2OForgetsRecent' diverges from the oracle on model "
        "'llama', prompt 'long48' (length 48), alone: step * of 16",
        "*reference: transformers eager Llama, all keys kept, evicted ones masked by h2o(heavy=8, recent=8)",
    ])
    result.stdout.fnmatch_lines([
        "*TokenMismatch: engine 'kv_test_engines_eviction:StreamingLLMWithoutSinks' diverges from the oracle on "
        "model 'llama', prompt 'long48' (length 48), alone: step * of 16",
        "*reference: transformers eager Llama, all keys kept, evicted ones masked by streaming_llm(recent=12, sinks=4)",
    ])


@pytest.mark.parametrize("name", ["StreamingLLM", "SnapKV", "TOVA", "KNorm"])
def test_kept_sets_after_prefill_match_kvpress(llama, name):
    """kvpress's press (pytest_kvcompile/engines/kvpress.py, its declared parameters) keeps, per layer and
    KV head, exactly the positions our prefill-only oracle keeps (same model, prompts of 7, 23 and 48
    tokens: each evicts), and the kvpress engine's tokens equal the oracle's. Against our per-step
    policies after prefill: StreamingLLMPress keeps what streaming_llm(n_sink, n_kept - n_sink) keeps;
    TOVAPress keeps what tova(n_kept) keeps when the last token is in that set, otherwise that set's
    best n_kept - 1 plus the last token (kvpress protects it). docs/engines/kvpress.md lists the rules."""
    kvpress = pytest.importorskip("kvpress", reason="kvpress is not installed (kvpress 0.5.5 needs transformers<5.3)")
    from transformers import AutoModelForCausalLM, DynamicCache

    from pytest_kvcompile.engines import kvpress as adapters

    engine = getattr(adapters, name)(llama)
    strategy = declaration_of(type(engine)).strategy
    params = dict(strategy.params)
    oracle = EvictionOracle(llama, strategy)
    model = AutoModelForCausalLM.from_pretrained(llama.path, attn_implementation="eager").eval()
    for n in (7, 23, 48):
        p, n_kept = prompt(n), oracle.policy.n_kept(n)
        ids = torch.tensor([p])
        full, pressed = DynamicCache(config=model.config), DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids, past_key_values=full)
            with getattr(kvpress, engine.press)(**params)(model):
                model(ids, past_key_values=pressed)
        ours = oracle.kept(p, 1)  # the state right after prefill
        per_step = {"StreamingLLM": Strategy.of("streaming_llm", sinks=params.get("n_sink"),
                                                recent=n_kept - params.get("n_sink", 0)),
                    "TOVA": Strategy.of("tova", budget=n_kept)}.get(name)
        step_kept = EvictionOracle(llama, per_step).kept(p, 1) if per_step else None
        for layer, mine in enumerate(ours):
            # which positions kvpress kept: its keys are copies of the uncompressed ones
            distance = torch.cdist(pressed.layers[layer].keys[0], full.layers[layer].keys[0],
                                   compute_mode="donot_use_mm_for_euclid_dist")
            assert distance.min(-1).values.max() < 1e-6
            theirs = distance.argmin(-1).sort(-1).values
            assert theirs.tolist() == mine.tolist(), f"{name}, prompt length {n}, layer {layer}"
            for head in range(mine.shape[0]) if per_step else ():
                kv, step = set(theirs[head].tolist()), set(step_kept[layer][head].tolist())
                assert kv == step or (name == "TOVA" and n - 1 in kv - step and len(kv & step) == n_kept - 1)
        assert_tokens_match(oracle.reference(p, NEW), engine.generate([p], NEW)[0], engine=f"kvpress-{name}",
                            model="llama", prompt=f"prompt of length {n}")
