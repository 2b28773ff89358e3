"""Tests of the tiny model zoo (pytest_kvcompile.models.zoo).

transformers may swap the module object in sys.modules (seen after from_pretrained in 5.23),
so patches name the target as a string, which resolves the current module.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import dataclasses
import statistics

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from pytest_kvcompile.models import prompts, zoo
from pytest_kvcompile.models.checkpoints import returned_cache, with_cache
from pytest_kvcompile.models.layers import StateLayer, layer_caches

NAMES = zoo.RANDOM  # the random-weight models (the trained one: tests/test_trained.py)
STATES = {"qwen3-next": [0, 1, 2], "bamba": [0, 2]}  # zoo name -> its recurrent layers
WINDOWED = ["mistral-sw", "gemma3-hybrid", "gemma4-kvshared", "gpt-oss", "qwen2-sw", "gemma2-hybrid"]
#: zoo name -> (sliding layers, attention window, shared-KV layers)
LAYOUT = {
    "llama": ([], None, []),
    "mistral-sw": ([0, 1], zoo.WINDOW, []),
    "gemma3-hybrid": ([0, 2], zoo.WINDOW, []),
    "gemma4-kvshared": ([0, 2], zoo.WINDOW, [2, 3]),
    "gpt2-abspos": ([], None, []),
    "qwen3": ([], None, []),
    "phi3": ([], None, []),
    "qwen3-moe": ([], None, []),
    "deepseek-v3": ([], None, []),
    "gpt-oss": ([0, 2], zoo.WINDOW, []),
    "qwen3-next": ([], None, []),
    "bamba": ([], None, []),
    "qwen2-sw": ([0, 1], zoo.WINDOW, []),
    "gemma2-hybrid": ([0, 2], zoo.WINDOW, []),
    "llama-yarn": ([], None, []),
}


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """load(name) -> the zoo model from a module-wide cache, eager attention, eval mode."""
    root, models = tmp_path_factory.mktemp("zoo"), {}

    def get(name):
        if name not in models:
            try:
                path = zoo.checkpoint(name, root)
            except zoo.ModelUnavailable as exc:
                pytest.skip(str(exc))
            models[name] = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        return models[name]

    return get


def test_zoo_names_in_order():
    assert NAMES == ["llama", "mistral-sw", "gemma3-hybrid", "gemma4-kvshared", "gpt2-abspos", "qwen3", "phi3",
                     "qwen3-moe", "deepseek-v3", "gpt-oss", "qwen3-next", "bamba", "qwen2-sw", "gemma2-hybrid",
                     "llama-yarn"]
    assert zoo.GROUPS["all"] == NAMES[:5] == zoo.GROUPS["classic"]
    assert zoo.GROUPS["served"] == ["qwen3", "phi3", "qwen3-moe", "deepseek-v3", "gpt-oss"]
    assert zoo.GROUPS["released"] == ["qwen2-sw", "gemma2-hybrid", "llama-yarn"]  # named only, as the served ones
    assert zoo.GROUPS["recurrent"] == ["qwen3-next", "bamba"]
    assert list(zoo.ZOO) == NAMES[:12] + ["smollm2-135m"] + NAMES[12:] and zoo.GROUPS["trained"] == ["smollm2-135m"]
    assert zoo.selected(["llama", "served", "qwen3"]) == ["llama", "qwen3", "phi3", "qwen3-moe", "deepseek-v3",
                                                          "gpt-oss"]
    assert all(m.name == n and m.description and "\n" not in m.description for n, m in zoo.ZOO.items())


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_is_deterministic(tmp_path, name):
    """Same bytes whatever the global RNG state; no dependence on transformers' init."""
    torch.manual_seed(0)
    a = zoo.checkpoint(name, tmp_path / "a")
    torch.manual_seed(1)
    b = zoo.checkpoint(name, tmp_path / "b")
    assert a.name == b.name
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def test_checkpoint_is_cached_and_loads_cleanly(tmp_path, monkeypatch):
    path = zoo.checkpoint("gemma4-kvshared", tmp_path)
    assert {"config.json", "model.safetensors"} <= {p.name for p in path.iterdir()}
    assert path.name.startswith("gemma4-kvshared-") and f"seed{zoo.SEED}" in path.name
    assert f"-tf{transformers.__version__}-torch{torch.__version__}-code" in path.name

    def no_rebuild(config, *gains):
        raise AssertionError("rebuilt a cached checkpoint")

    monkeypatch.setattr(zoo, "_build_model", no_rebuild)
    assert zoo.checkpoint("gemma4-kvshared", tmp_path) == path
    assert [p.name for p in tmp_path.iterdir()] == [path.name]

    saved_only = {"_name_or_path", "architectures", "dtype"}
    reloaded, built = AutoConfig.from_pretrained(path).to_dict(), zoo.ZOO["gemma4-kvshared"].build_config().to_dict()
    assert {k: v for k, v in reloaded.items() if k not in saved_only} == {
        k: v for k, v in built.items() if k not in saved_only
    }
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info


def test_cache_key_changes_with_config_seed_and_version(monkeypatch):
    config = zoo.ZOO["mistral-sw"].build_config()
    key = zoo._cache_key("mistral-sw", config)
    assert zoo._cache_key("llama", config) != key
    config.sliding_window += 1
    assert zoo._cache_key("mistral-sw", config) != key
    config.sliding_window -= 1
    assert zoo._cache_key("mistral-sw", config) == key
    monkeypatch.setattr(zoo, "SEED", zoo.SEED + 1)
    assert zoo._cache_key("mistral-sw", config) != key
    monkeypatch.undo()
    monkeypatch.setattr("transformers.__version__", "0.0.0")
    assert zoo._cache_key("mistral-sw", config) != key
    monkeypatch.undo()
    monkeypatch.setitem(zoo.ZOO, "mistral-sw", dataclasses.replace(zoo.ZOO["mistral-sw"], head_gain=5.0))
    assert zoo._cache_key("mistral-sw", config) != key


def test_fan_in_per_module_type():
    """nn.Linear [out, in] and GPT-2's Conv1D [in, out] both scale by their inputs; embeddings by shape[-1]."""
    from transformers.pytorch_utils import Conv1D

    linear, conv, embedding = torch.nn.Linear(64, 192), Conv1D(192, 64), torch.nn.Embedding(512, 64)
    assert conv.weight.shape == (64, 192)
    assert [zoo._fan_in(m, p) for m in (linear, conv, embedding) for p in m.parameters()] == [64, 64, 64, 64, 64]


def test_concurrent_build_loser_discards_its_copy(tmp_path, monkeypatch):
    """Another worker renames its build into place while we build: we return its copy, leave nothing behind."""
    real_build = zoo._build_model

    def racing_build(config, *gains):
        monkeypatch.setattr(zoo, "_build_model", real_build)
        winner = zoo.checkpoint("llama", tmp_path)
        (winner / "built-by-winner").touch()
        return real_build(config, *gains)

    monkeypatch.setattr(zoo, "_build_model", racing_build)
    path = zoo.checkpoint("llama", tmp_path)
    assert (path / "built-by-winner").exists()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_decoding_is_non_degenerate(load, name):
    """6 random prompts (lengths 1..40), 32 greedy tokens each.

    Measured on transformers 5.2, 5.5 and 5.23 (gpt2-abspos: 5.2 and 5.23): >= 17 distinct tokens per
    continuation, median top-1/top-2 logit gap 0.80-1.21, at most 1% of gaps below 1e-2.
    """
    model = load(name)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen) for n in torch.randint(1, 41, (6,), generator=gen)]
    distinct, gaps = [], []
    for prompt in prompts:
        out = model.generate(
            prompt[None], max_new_tokens=32, do_sample=False, return_dict_in_generate=True, output_logits=True
        )
        distinct.append(len(set(out.sequences[0, len(prompt):].tolist())))
        for step_logits in out.logits:
            top2 = step_logits[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
    assert min(distinct) >= 12, distinct
    assert statistics.median(gaps) >= 0.5
    assert sum(g < 1e-2 for g in gaps) <= 0.05 * len(gaps)


@pytest.mark.parametrize("name", NAMES)
def test_layer_layout(load, name):
    model = load(name)
    sliding, window, shared = LAYOUT[name]
    assert zoo.sliding_layers(model.config) == sliding
    assert zoo.attention_window(model.config) == window
    assert zoo.shared_kv_layers(model.config) == shared
    attns = [m for n, m in model.named_modules() if n.endswith((".self_attn", ".attn"))]  # GPT-2: transformer.h.N.attn
    states = [c.layer for c in layer_caches(model.config) if isinstance(c, StateLayer)]
    assert states == STATES.get(name, [])  # a hybrid model's recurrent layers: no attention module
    assert len(attns) == model.config.num_hidden_layers - len(states)
    assert [i for i, a in enumerate(attns) if getattr(a, "is_kv_shared_layer", False)] == shared


@pytest.mark.parametrize("name", WINDOWED)
def test_attention_window_matches_eager_attention_weights(load, name):
    """In every layer, for every query (prefill) and for a cached decode step, exactly the keys
    the rule admits get nonzero attention: q - W < k <= q in sliding layers, k <= q elsewhere."""
    model = load(name)
    config, window = model.config, zoo.attention_window(model.config)
    length = 2 * window + 3
    ids = torch.randint(0, 256, (1, length + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        prefill = model(ids[:, :length], output_attentions=True, use_cache=True)
        step = model(ids[:, length:], **with_cache(returned_cache(prefill)), output_attentions=True)
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    for i in range(config.num_hidden_layers):
        w = window if i in zoo.sliding_layers(config) else length + 1
        expected = (k <= q) & (k > q - w)
        assert torch.equal(prefill.attentions[i][0] > 0, expected.expand(config.num_attention_heads, -1, -1)), i
        seen = (step.attentions[i][0, :, -1] > 0).sum(-1)
        assert seen.tolist() == [min(w, length + 1)] * config.num_attention_heads, i


@pytest.mark.parametrize("name", WINDOWED)
def test_first_layer_output_depends_exactly_on_the_window(load, name):
    """Layer 0 is sliding and everything before its attention is position-wise, so its output at
    the last position changes with the token W-1 places back and not with the one W places back."""
    model = load(name)
    window = zoo.attention_window(model.config)
    assert zoo.sliding_layers(model.config)[0] == 0
    ids = torch.randint(0, 256, (1, 2 * window + 3), generator=torch.Generator().manual_seed(2))
    captured = []
    hook = model.model.layers[0].register_forward_hook(
        lambda mod, args, out: captured.append((out[0] if isinstance(out, tuple) else out)[..., -1, :])
    )
    try:
        with torch.no_grad():
            for back in (None, window - 1, window):
                perturbed = ids.clone()
                if back is not None:
                    perturbed[0, -1 - back] = (perturbed[0, -1 - back] + 1) % 256
                model(perturbed, use_cache=False)
    finally:
        hook.remove()
    base, visible, invisible = captured
    assert not torch.equal(base, visible)
    assert torch.equal(base, invisible)


@torch.no_grad()
def greedy(model, prompt, steps: int, shift: int = 0) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and logits [steps, vocab] with a DynamicCache, every position shifted by `shift`."""
    cache, ids, tokens, rows = DynamicCache(config=model.config), torch.tensor([prompt]), [], []
    for _ in range(steps):
        pos = torch.arange(ids.size(1))[None] + cache.get_seq_length() + shift
        rows.append(model(input_ids=ids, position_ids=pos, **with_cache(cache), use_cache=True).logits[0, -1])
        tokens.append(int(rows[-1].argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(rows)


@pytest.mark.parametrize("name", ["gpt2-abspos", "llama"])
def test_only_gpt2_sees_absolute_positions(load, name):
    """position_ids + 7 on every standard prompt: learned position embeddings (GPT-2) change the greedy
    tokens; RoPE (Llama) is relative, so logits stay equal up to rounding and tokens do not change."""
    model = load(name)
    for prompt in prompts.prompt_set(model.config.vocab_size, None):
        tokens, logits = greedy(model, list(prompt.ids), 16)
        shifted_tokens, shifted_logits = greedy(model, list(prompt.ids), 16, shift=7)
        if name == "gpt2-abspos":
            assert shifted_tokens != tokens, prompt
        else:
            assert shifted_tokens == tokens, prompt
            torch.testing.assert_close(shifted_logits, logits, atol=1e-4, rtol=1e-4)


def test_gemma4_falls_back_to_gemma3n(monkeypatch):
    monkeypatch.setattr("transformers.Gemma4TextConfig", None, raising=False)
    config = zoo.ZOO["gemma4-kvshared"].build_config()
    assert config.model_type == "gemma3n_text"
    assert zoo.shared_kv_layers(config) == [2, 3]
    assert zoo.attention_window(config) == zoo.WINDOW


def test_model_unavailable_names_the_version(tmp_path, monkeypatch):
    monkeypatch.setattr("transformers.Gemma4TextConfig", None, raising=False)
    monkeypatch.setattr("transformers.Gemma3nTextConfig", None, raising=False)
    with pytest.raises(zoo.ModelUnavailable, match=f"transformers {transformers.__version__} has no Gemma4"):
        zoo.checkpoint("gemma4-kvshared", tmp_path)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_llama_yarn_has_yarn_rope_in_transformers_and_in_the_reference():
    """The YaRN model (kvpress PR #85's case) on transformers 4.x (`rope_scaling`) and 5.x (`rope_parameters`): the
    model's rotary embedding and reference_impls' `rope_inv_freq` agree, attention factor 0.1 ln 4 + 1."""
    import math

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from reference_impls.model import rope_inv_freq

    config = zoo.ZOO["llama-yarn"].build_config()
    rotary = LlamaRotaryEmbedding(config=config)
    inv_freq, factor = rope_inv_freq(config)
    assert rotary.rope_type == "yarn" and factor == pytest.approx(rotary.attention_scaling)
    assert factor == pytest.approx(0.1 * math.log(4) + 1) and torch.equal(inv_freq, rotary.inv_freq)
    assert rope_inv_freq(zoo.ZOO["llama"].build_config())[1] == 1.0


class _CountingOracle:
    """An oracle counting the references it computes (the store's rebuild test)."""

    source = "counting"

    def __init__(self):
        self.computed = 0

    def reference(self, prompt, max_new_tokens):
        from pytest_kvcompile.oracles.reference import Reference

        self.computed += 1
        return Reference(tuple(prompt), (1,) * max_new_tokens, torch.zeros(max_new_tokens, 4), self.source)


def test_a_changed_code_hash_builds_the_zoo_and_the_oracle_store_anew(tmp_path, monkeypatch):
    """Stores outlive a session (issue 53): reused while their key holds, rebuilt when the code that produced them
    changes (here: its hash, models/zoo.py `code_hash`)."""
    from pytest_kvcompile.contract.engine import ModelSpec, Strategy
    from pytest_kvcompile.oracles import store

    path = zoo.checkpoint("llama", tmp_path / "zoo")
    assert zoo.checkpoint("llama", tmp_path / "zoo") == path  # the same key: reused
    spec = ModelSpec("llama", path, AutoConfig.from_pretrained(path))

    def stored(oracle):
        return store.StoredOracle(oracle, Strategy(), spec, 1e-3, tmp_path / "oracle", check=False)

    first, again = _CountingOracle(), _CountingOracle()
    stored(first).cached_reference([3, 4, 5], 2)
    stored(again).cached_reference([3, 4, 5], 2)
    assert (first.computed, again.computed) == (1, 0)  # a second session reads it from disk

    monkeypatch.setattr("pytest_kvcompile.models.zoo.code_hash", lambda *packages: "edited")
    monkeypatch.setattr("pytest_kvcompile.oracles.store.code_hash", lambda *packages: "edited")
    rebuilt = zoo.checkpoint("llama", tmp_path / "zoo")
    assert rebuilt != path and rebuilt.name.endswith("-codeedited")
    changed = _CountingOracle()
    stored(changed).cached_reference([3, 4, 5], 2)
    assert changed.computed == 1  # a new key: computed anew, never the old entry


@pytest.mark.parametrize("name", ["qwen3-moe", "deepseek-v3", "gpt-oss", "qwen3-next"])
def test_the_truths_per_expert_path_computes_what_the_grouped_kernel_does(name, zoo_cache):
    """Issue 69: transformers' grouped experts kernel refuses float64, so the float64 truth runs the per-expert loop
    (checkpoints.per_expert): in float32 both give the same logits to rounding, the widened float64 forward runs,
    agrees with them, and leaves the model's own implementation as it was."""
    from pytest_kvcompile.models.checkpoints import experts_implementation, per_expert, pretrained
    from pytest_kvcompile.oracles.truth import Widened

    model = pretrained(zoo.checkpoint(name, zoo_cache), torch.float32).eval()
    own = experts_implementation(model)
    assert own is not None and set(own.values()) != {"eager"}  # the grouped kernel by default
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        grouped = model(ids).logits
        wide = Widened(model)(input_ids=ids).logits
        assert experts_implementation(model) == own  # restored after the float64 call
        per_expert(model)
        looped = model(ids).logits
    torch.testing.assert_close(looped, grouped, atol=1e-5, rtol=1e-5)
    assert wide.dtype == torch.float64

    def rmse(x):
        return x.double().pow(2).mean().sqrt().item()
    # torch's own accuracy rule (torch._dynamo.utils.same, fp64_ref): the grouped kernel is within 2x the per-expert
    # loop's RMSE to float64 (both float32), and the loop is float32 rounding away from it (Qwen3-Next's chunked
    # delta rule in float32 is 1.4e-4 away at most, on logits of RMS 4)
    assert rmse(grouped - wide) <= 2 * rmse(looped - wide), (rmse(grouped - wide), rmse(looped - wide))
    assert rmse(looped - wide) <= 1e-5 * rmse(wide), (rmse(looped - wide), rmse(wide))
