"""The engines of issue 28 (docs/engines/ctranslate2.md, hf-continuous-batching.md, hf-quantized.md,
openvino.md, mistralrs.md): what holds without their packages (declarations, registry, known findings, the stand-in
vocabularies), and transformers' continuous batching for real (it needs nothing beyond transformers)."""

from types import SimpleNamespace

import pytest

from conftest import run_suites
from findings_scope import covers
from pytest_kvcompile.contract.engine import declaration_of
from pytest_kvcompile.contract.registry import BUILTIN_ENGINES, _import_target
from pytest_kvcompile.engines import ct2, mistralrs, quantized


@pytest.mark.parametrize(("name", "kv_cache_dtype", "batching", "isolated"), [
    ("ctranslate2", None, True, True),
    ("hf-continuous-batching", None, True, None),
    ("hf-continuous-batching-prefix-cache", None, True, None),
    ("hf-quantized-quanto", "int4", True, None),
    ("hf-quantized-hqq", "int4", True, None),
    ("hf-quantized-hqq-int8", "int8", True, None),
    ("openvino", "float16", True, True),  # its KV cache with the f32 hint, made explicit (OV_CONFIG)
    ("mistralrs", None, False, True),
])
def test_declarations(name, kv_cache_dtype, batching, isolated):
    decl = declaration_of(_import_target(name, BUILTIN_ENGINES[name]))
    assert (decl.kv_cache_dtype, decl.batching, decl.isolated) == (kv_cache_dtype, batching, isolated)
    assert decl.requires and not decl.compiled and not decl.kv_cache_bytes


@pytest.mark.parametrize(("test_id", "known"), [
    ("test_token_identity[ctranslate2-mistral-sw-len1]", True),
    ("test_shared_prefixes_batched[ctranslate2-gemma3-hybrid]", True),
    ("test_batch_consistency[ctranslate2-llama]", True),
    ("test_token_identity[ctranslate2-llama-long250]", False),
    ("test_token_identity_batched[ctranslate2-llama]", True),
    ("test_shared_prefixes_batched[ctranslate2-llama]", False),
])
def test_ctranslate2_known_findings_select_only_their_tests(test_id, known):
    assert covers(ct2.KNOWN_FINDINGS, "ctranslate2", test_id) == known, test_id


def test_the_stand_in_vocabularies_are_the_ids():
    vocab = ct2._Vocabulary(SimpleNamespace(vocab_size=5, eos_token_id=[3, 4], bos_token_id=None))
    assert list(vocab.get_vocab()) == ["<t0>", "<t1>", "<t2>", "<t3>", "<t4>"] and len(vocab) == 5
    assert (vocab.eos_token, vocab.bos_token) == ("<t3>", ct2.NO_EOS)  # no null EOS: CTranslate2 refuses one


def test_the_mistralrs_tokenizer_round_trips_ids(tmp_path):
    from tokenizers import Tokenizer

    mistralrs.stand_in_tokenizer(300, tmp_path / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = [5, 299, 0, 17]
    assert tokenizer.encode(" ".join(f"<t{i}>" for i in ids)).ids == ids
    assert [int(i) for i in mistralrs.TOKEN.findall(tokenizer.decode(ids))] == ids


def test_quantized_cache_skips_models_with_sliding_layers(tmp_path):
    from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec
    from pytest_kvcompile.models import zoo

    spec = ModelSpec("mistral-sw", tmp_path, zoo.ZOO["mistral-sw"].build_config())  # refused before any loading
    with pytest.raises(ModelNotSupported, match="QuantizedCache serves models with full-attention layers only"):
        quantized.QuantizedQuanto(spec)


def test_continuous_batching_refuses_a_model_its_paged_cache_cannot_hold(tmp_path):
    """transformers 5.24's paged cache has no allocator for a recurrent layer: a named skip, never an engine FAIL on
    the ValueError its manager raises at the first call (asked of transformers, so a version that pages them runs)."""
    from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec
    from pytest_kvcompile.engines import continuous
    from pytest_kvcompile.models import zoo

    spec = ModelSpec("bamba", tmp_path, zoo.ZOO["bamba"].build_config())  # refused before any loading
    with pytest.raises(ModelNotSupported, match="continuous batching pages only the layer types it has an "
                                                "allocator for .Invalid layer type: linear_attention.; model 'bamba'"):
        continuous.ContinuousBatching(spec)


def test_continuous_batching_prefix_cache_declares_the_pool_it_asks_for():
    from pytest_kvcompile.engines import continuous

    engine = continuous.ContinuousBatchingPrefixCache
    decl, sizes = declaration_of(engine), engine.cache_config
    assert sizes["allow_block_sharing"] is True
    assert (decl.prefix_cache.block_size, decl.prefix_cache.capacity_tokens) == (
        sizes["page_size"], sizes["page_size"] * sizes["num_blocks"])
    assert declaration_of(continuous.ContinuousBatching).prefix_cache is None


def test_continuous_batching_prefix_cache_refuses_a_pool_transformers_built_otherwise(monkeypatch):
    from pytest_kvcompile.engines import continuous

    monkeypatch.setattr(continuous.ContinuousBatching, "generate", lambda self, prompts, n: [[1] * n for _ in prompts])
    engine = continuous.ContinuousBatchingPrefixCache.__new__(continuous.ContinuousBatchingPrefixCache)
    assert engine.generate([[5]], 2) == [[1, 1]]  # no manager yet: nothing to read back
    engine.manager = SimpleNamespace(batch_processor=SimpleNamespace(
        cache=SimpleNamespace(num_blocks=continuous.PREFIX_BLOCKS, use_prefix_sharing=True)))
    assert engine.generate([[5]], 2) == [[1, 1]] and engine.shares_prefixes
    engine.manager.batch_processor.cache.num_blocks = 64
    with pytest.raises(RuntimeError, match=f"a paged cache of 64 blocks, not the {continuous.PREFIX_BLOCKS} this"):
        engine.generate([[5]], 2)


def test_continuous_batching_page_size_is_spelled_as_the_installed_transformers_names_it():
    from pytest_kvcompile.engines.continuous import spelled_for

    def before_5_17(block_size=256, num_blocks=None):
        pass

    def since_5_17(page_size=256, num_blocks=None):
        pass

    options = {"page_size": 16, "num_blocks": 128}
    assert spelled_for(options, before_5_17) == {"block_size": 16, "num_blocks": 128}
    assert spelled_for(options, since_5_17) == options


def test_continuous_batching_gives_the_oracles_tokens(kvtester):
    result = run_suites(kvtester, "--kv-engine=hf-continuous-batching", "-k", "token_identity or stale_state")
    assert result.ret == 0, result.stdout.str()[-3000:]
    outcomes = result.parseoutcomes()
    assert outcomes["passed"] >= 7 and "failed" not in outcomes  # 4 prompts alone, batched, stale state x2
