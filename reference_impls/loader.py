"""The reference models' architecture table and checkpoint loader.

`ARCHITECTURES` maps a config's `model_type` to its model class, written out here (the architecture
modules import the shared model, this table imports them). `load_model` builds the model on the meta
device and assigns the checkpoint's safetensors to it as they are (parameter names match transformers').
"""

from __future__ import annotations

import torch
from torch import nn

from pytest_kvcompile.contract.engine import ModelSpec
from reference_impls.bamba import Bamba
from reference_impls.deepseek_v3 import DeepseekV3
from reference_impls.gemma3 import Gemma3
from reference_impls.gemma4 import Gemma4
from reference_impls.gpt2 import GPT2
from reference_impls.gpt_oss import GptOss
from reference_impls.model import STATE, Llama, UnsupportedModel, rope_tables
from reference_impls.phi3 import Phi3
from reference_impls.qwen3 import Qwen3
from reference_impls.qwen3_next import Qwen3Next

#: config.model_type -> model class.
ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": Llama,
    "mistral": Llama,
    "qwen2": Llama,
    "gemma3_text": Gemma3,
    "gemma4_text": Gemma4,
    "gpt2": GPT2,
    "qwen3": Qwen3,
    "qwen3_moe": Qwen3,
    "phi3": Phi3,
    "deepseek_v3": DeepseekV3,
    "gpt_oss": GptOss,
    "qwen3_next": Qwen3Next,
    "bamba": Bamba,  # recurrent layers: engines that keep `model.State`s only (load_model's `states`)
}


def load_model(spec: ModelSpec, states: bool = False) -> nn.Module:
    """The checkpoint's model in spec.dtype on spec.device, weights straight from its safetensors; `states`: the
    engine keeps recurrent layers' states (`model.State`), else a model with recurrent layers is refused."""
    config = spec.config
    if config.model_type not in ARCHITECTURES:
        raise UnsupportedModel(
            f"reference_impls does not support model_type '{config.model_type}' (model '{spec.name}'); "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    with torch.device("meta"):
        model = ARCHITECTURES[config.model_type](config)
    recurrent = [i for i, kind in enumerate(model.layer_types) if kind == STATE]
    if recurrent and not states:
        raise UnsupportedModel(
            f"model '{spec.name}' has recurrent layers ({', '.join(map(str, recurrent))}: a state per sequence, no "
            "K/V) and this engine keeps keys and values only; ref-compiled-dynamic, ref-chunked-prefill, "
            "ref-paged-prefix, ref-speculative and ref-speculative-lookup keep states"
        )
    state = spec.weights(device=str(spec.device))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state[getattr(model, "tied_embedding", "model.embed_tokens.weight")]
    model.load_state_dict(state, strict=True, assign=True)
    model = model.to(spec.dtype).eval().requires_grad_(False)
    kept = getattr(model, "keep_in_float32", ())  # a router transformers keeps in float32 (DeepSeek-V3's)
    for name in (name for name in state if name.endswith(kept)):
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        buffer = attr in dict(module.named_buffers(recurse=False))  # setattr keeps a buffer a buffer
        setattr(module, attr, state[name].float() if buffer else nn.Parameter(state[name].float(), requires_grad=False))
    if model.rope:  # RoPE models (not GPT-2)
        model.rope = rope_tables(config, spec.device)  # not in the checkpoint; fp32 like transformers
    return model
