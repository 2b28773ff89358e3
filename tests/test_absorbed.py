"""The absorbed latent-attention computation (oracles/absorbed.py): on a model with latent layers (DeepSeek-V3's MLA)
the 16-bit calibration also decodes with the attention absorbed, as vLLM, SGLang and FlashMLA do -- the same function
as transformers' up-projected form (float32), another rounding (bfloat16) -- and transformers' model is left as it
was; a model without latent layers has no such computation."""

from __future__ import annotations

import pytest
import torch

from pytest_kvcompile.contract.engine import ModelSpec
from pytest_kvcompile.models import zoo
from pytest_kvcompile.oracles.absorbed import absorbed, latent_modules
from pytest_kvcompile.oracles.computations import ABSORBED, COMPUTATIONS, Computations
from pytest_kvcompile.recompiles.hooks import attention_kernel

PROMPT, TOKENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [9, 3, 2, 3, 8, 4, 6, 2]


def _spec(name, root, dtype):
    return ModelSpec(name, zoo.checkpoint(name, root), zoo.ZOO[name].build_config(), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_attention_absorbed_is_transformers_function_with_its_own_rounding(zoo_cache, dtype):
    computed = Computations(_spec("deepseek-v3", zoo_cache / "zoo", dtype))
    assert computed.names == (*COMPUTATIONS, ABSORBED)
    home = attention_kernel(computed.base)
    rows = computed.along(PROMPT, TOKENS)  # [5, steps, vocab]: eager with its cache first, absorbed last
    assert rows.shape == (5, len(TOKENS), computed.spec.vocab_size)
    apart = float((rows[-1] - rows[0]).abs().max())
    if dtype == torch.float32:  # the same function: rounding apart (~1e-5 of logits ~10)
        assert apart < 1e-3, apart
    else:  # other products rounded to bfloat16 (q_nope W_uk, probs . latent) than the up-projected K and V
        assert apart > 1e-3, apart
    # pinned to the truth's routing too (the scale of a mixture-of-experts model)
    assert computed.along(PROMPT, TOKENS, pinned=True).shape == rows.shape
    # transformers' model as it was: its attention kernel and its own expand_kv
    assert attention_kernel(computed.base) == home
    assert all("expand_kv" not in vars(m) for m in latent_modules(computed.base))


def test_a_model_without_latent_layers_has_no_absorbed_computation(zoo_cache):
    computed = Computations(_spec("llama", zoo_cache / "zoo", torch.bfloat16))
    assert computed.names == COMPUTATIONS and absorbed(computed.base) is None
    assert computed.along(PROMPT, TOKENS).shape == (len(COMPUTATIONS), len(TOKENS), computed.spec.vocab_size)
