"""transformers 4.x (models/checkpoints.py: `pretrained`, `dynamic_cache`, `per_layer_cache`): the released-bug rows
run there. Before 4.56 the loaders say ``torch_dtype=`` and the oracles recompute each step without a cache; that
path must give the cached oracle's tokens and logits, checked here on this transformers by pretending to be 4.51."""

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.models import checkpoints, zoo
from pytest_kvcompile.oracles.hf import HFEagerOracle


@pytest.fixture
def old_transformers(monkeypatch):
    monkeypatch.setattr(checkpoints, "transformers_version", lambda: (4, 51))


def test_before_4_56_models_load_with_torch_dtype_and_caches_without_a_config(old_transformers, monkeypatch):
    seen = {}
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda path, **kw: seen.update(kw))
    checkpoints.pretrained("somewhere", torch.bfloat16, attn_implementation="eager")
    assert seen == {"torch_dtype": torch.bfloat16, "attn_implementation": "eager"}
    assert not checkpoints.per_layer_cache()
    assert type(checkpoints.dynamic_cache(object())) is DynamicCache  # no config: a 4.x DynamicCache takes none


# the 4.x path passes past_key_values=, which the installed 5.x still takes with a FutureWarning: expected here
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("name", ["llama", "mistral-sw", "gemma3-hybrid"])
def test_the_cacheless_oracle_of_old_releases_equals_the_cached_one(name, zoo_cache, monkeypatch):
    path = zoo.checkpoint(name, zoo_cache)
    spec = ModelSpec(name, path, AutoConfig.from_pretrained(path))
    prompt = [(i * 37 + 11) % 256 for i in range(19)]  # 2W+3: decoding crosses the window
    cached = HFEagerOracle(spec).reference(prompt, 16)
    monkeypatch.setattr(checkpoints, "transformers_version", lambda: (4, 51))
    recomputed = HFEagerOracle(spec).reference(prompt, 16)
    assert recomputed.tokens == cached.tokens
    torch.testing.assert_close(recomputed.logits, cached.logits, atol=1e-4, rtol=1e-4)


def test_the_reference_that_catches_qwen2_35924_matches_transformers(zoo_cache):
    """Qwen2 in `reference_impls` (Mistral with q/k/v biases): the oracle of the #35924 row, where transformers'
    own shares the bug. On this transformers (window applied) both give the same logits past the window."""
    from pytest_kvcompile.models.checkpoints import pretrained
    from reference_impls.loader import load_model

    path = zoo.checkpoint("qwen2-sw", zoo_cache)
    spec = ModelSpec("qwen2-sw", path, AutoConfig.from_pretrained(path))
    assert zoo.sliding_layers(spec.config) == [0, 1]
    tokens = torch.tensor([[(i * 37 + 11) % 256 for i in range(19)]])
    with torch.no_grad():
        ours, _ = load_model(spec)(tokens, torch.ones_like(tokens, dtype=torch.bool))
        theirs = pretrained(path, torch.float32, attn_implementation="eager")(tokens).logits[:, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
