"""The LitGPT engines: what holds without litgpt (import, declarations, config mapping; the missing-package
usage error is in test_check_engine.py), and, where litgpt is installed, conversion and scoring against transformers."""


import pytest
import torch

from findings_scope import covers
from pytest_kvcompile.contract.engine import KVLayout, ModelNotSupported, ModelSpec, declaration_of
from pytest_kvcompile.contract.registry import _accepts_backend
from pytest_kvcompile.engines import litgpt as adapter
from pytest_kvcompile.models import zoo


def test_declarations():
    eager, compiled = declaration_of(adapter.LitGPT), declaration_of(adapter.LitGPTCompiled)
    for decl in (eager, compiled):
        assert decl.requires == (("litgpt", "litgpt==0.5.13"),)
        assert not decl.batching and decl.scoring and decl.kv_cache_bytes
        assert decl.kv_layout == KVLayout("static", max_cache_len=adapter.MAX_SEQ_LENGTH, rows=1)
        # its deliberate limit, declared: a prompt past the sliding window is refused (a named skip, never a pass)
        assert decl.bounds.outside([9], 16, window=8) and decl.bounds.outside([8], 16, window=8) is None
    assert not eager.compiled and compiled.compiled
    assert not _accepts_backend(adapter.LitGPT) and _accepts_backend(adapter.LitGPTCompiled)


@pytest.mark.parametrize(("engine", "test_id", "known"), [
    ("litgpt", "test_token_identity[litgpt-mistral-sw-W+1=9]", False),  # past the window: the declared bound skips it
    ("litgpt", "test_memory_held_matches_reported[litgpt-llama]", True),
    ("litgpt", "test_token_identity[litgpt-mistral-sw-W=8]", False),  # fits the window: must pass
    ("litgpt", "test_token_identity[litgpt-llama-long48]", False),
    ("litgpt", "test_stale_state[litgpt-llama]", False),
    ("litgpt-compile", "test_no_recompiles_after_warmup[litgpt-compile-llama]", True),
    ("litgpt-compile", "test_no_recompiles_after_warmup[litgpt-compile-gemma3-hybrid]", False),
    ("litgpt-compile", "test_token_identity[litgpt-compile-llama-len1]", False),
])
def test_known_findings_select_only_their_tests(engine, test_id, known):
    factory = {"litgpt": adapter.LitGPT, "litgpt-compile": adapter.LitGPTCompiled}[engine]
    assert covers(declaration_of(factory).known_findings, engine, test_id) == known, test_id


def _kwargs(name):
    return adapter.litgpt_config_kwargs(zoo.ZOO[name].build_config())


def test_config_mapping_llama_and_mistral():
    llama, mistral = _kwargs("llama"), _kwargs("mistral-sw")
    for kw in (llama, mistral):
        assert kw["mlp_class_name"] == "LLaMAMLP" and kw["norm_class_name"] == "RMSNorm"
        assert "Gemma" not in kw["name"]  # LitGPT would add 1 to the RMSNorm weight
        assert (kw["n_layer"], kw["n_embd"], kw["n_head"], kw["n_query_groups"], kw["head_size"]) == (2, 64, 4, 2, 16)
        assert kw["padded_vocab_size"] == kw["vocab_size"] == 256 and kw["rope_base"] == 10000
        assert not kw["parallel_residual"] and not kw["bias"] and kw["rotary_percentage"] == 1.0
    assert "sliding_window_size" not in llama
    assert (mistral["sliding_window_size"], mistral["sliding_window_indices"]) == (zoo.WINDOW, [1, 1])


def test_config_mapping_gemma3():
    kw = _kwargs("gemma3-hybrid")
    assert "Gemma" in kw["name"]  # RMSNorm scales by (1 + weight), as Gemma3RMSNorm
    assert kw["mlp_class_name"] == "GemmaMLP" and kw["gelu_approximate"] == "tanh"
    assert kw["sliding_window_size"] == zoo.WINDOW and kw["sliding_window_indices"] == [1, 0, 1, 0]
    assert kw["rope_indices"] == [1, 0, 1, 0]
    assert (kw["rope_base"], kw["rope_local_base_freq"]) == (1_000_000, 10_000)
    assert kw["attention_scores_scalar"] == 16 and kw["scale_embeddings"] and kw["norm_qk"]
    assert kw["post_attention_norm"] and kw["post_mlp_norm"]


def test_kv_sharing_model_is_not_supported():
    with pytest.raises(ModelNotSupported, match=r"cannot reuse another layer's KV \(num_kv_shared_layers=2\)"):
        _kwargs("gemma4-kvshared")


def test_unmapped_options_are_not_supported():
    config = zoo.ZOO["llama"].build_config()
    config.attention_bias = True
    with pytest.raises(ModelNotSupported, match="attention_bias=True"):
        adapter.litgpt_config_kwargs(config)
    config = zoo.ZOO["llama"].build_config()
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    with pytest.raises(ModelNotSupported, match="RoPE type 'llama3'"):
        adapter.litgpt_config_kwargs(config)
    config = zoo.ZOO["llama"].build_config()
    config.model_type = "qwen2"
    with pytest.raises(ModelNotSupported, match="model_type 'qwen2'"):
        adapter.litgpt_config_kwargs(config)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("litgpt",
                        reason="the litgpt engines need litgpt==0.5.13 (its own venv: engines/litgpt.py RECIPE)")
    name = "llama"
    return ModelSpec(name, zoo.checkpoint(name, tmp_path_factory.mktemp("zoo")), zoo.ZOO[name].build_config())


def test_score_is_teacher_forced_through_the_cache(llama):
    """score() rows equal transformers' full-forward logits, and generate() is their argmax."""
    from transformers import AutoModelForCausalLM

    engine = adapter.LitGPT(llama)
    prompt = [5, 17, 200, 9, 3]
    tokens = engine.generate([prompt], 6)[0]
    rows = engine.score(prompt, tokens)
    hf = AutoModelForCausalLM.from_pretrained(llama.path).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    assert rows.shape == (6, llama.vocab_size)
    torch.testing.assert_close(rows, reference, atol=1e-4, rtol=1e-4)
    assert rows.argmax(-1).tolist() == tokens


def test_compiled_engine_matches_eager(llama):
    from pytest_kvcompile.recompiles.recorder import reset_dynamo

    reset_dynamo()
    prompts = [[5, 17, 200], [1] * 12]
    compiled = adapter.LitGPTCompiled(llama, compile_backend="eager")
    assert compiled.generate(prompts, 5) == adapter.LitGPT(llama).generate(prompts, 5)
