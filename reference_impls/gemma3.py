"""Gemma3 text (transformers' Gemma3ForCausalLM, model_type "gemma3_text") for the reference engines.

What differs from Llama, as transformers 5.23's models/gemma3/modeling_gemma3.py computes it:

- RMSNorm scales by (1 + weight), in float32, then casts back: (norm(x.float()) * (1 + w.float())).type_as(x).
- Token embeddings are multiplied by sqrt(hidden_size), rounded to the weights' dtype first.
- Attention: RMSNorm over head_dim on q and k (q_norm, k_norm) before RoPE; scores scaled by
  query_pre_attn_scalar ** -0.5; `attn_logit_softcapping` c, when set: scores -> c * tanh(scores / c)
  before the mask (eager_attention_forward).
- Sandwich norms: post_attention_layernorm on the attention output and pre_/post_feedforward_layernorm
  around the MLP, each before its residual add.
- MLP activation `hidden_activation` (gelu_pytorch_tanh).
- RoPE per layer type: `rope_parameters["sliding_attention"]` (theta = rope_local_base_freq, 10k)
  for sliding layers, `rope_parameters["full_attention"]` (1M) for global ones; `layer_types` says which.
- `final_logit_softcapping` c, when set: logits -> c * tanh(logits / c).

`use_bidirectional_attention` (encoder use, which also changes the window) is not supported.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reference_impls.model import MLP, Attention, Llama, RMSNorm, UnsupportedModel


class Gemma3RMSNorm(RMSNorm):
    def forward(self, x):
        return (self.normalize(x) * (1.0 + self.weight.float())).type_as(x)


def softcap(x, cap: float | None):
    return x if cap is None else torch.tanh(x / cap) * cap


class Gemma3Attention(Attention):
    def __init__(self, config):
        super().__init__(config)
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcapping

    def project(self, x):
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v

    def attend(self, q, k, v, mask):
        if self.softcap is None:
            return super().attend(q, k, v, mask)
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = softcap(q @ k.transpose(-1, -2) * self.scale, self.softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class Gemma3Block(nn.Module):
    def __init__(self, config, layer: int = 0):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(dim, eps)
        self.self_attn = Gemma3Attention(config)
        self.post_attention_layernorm = Gemma3RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(dim, eps)
        self.mlp = MLP(config, config.hidden_activation)
        self.post_feedforward_layernorm = Gemma3RMSNorm(dim, eps)

    def forward(self, x, rope, mask, cache, layer):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask, cache, layer))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3(Llama):
    """Parameter names match transformers' Gemma3ForCausalLM."""

    block, norm = Gemma3Block, Gemma3RMSNorm

    def __init__(self, config):
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModel("Gemma3 with use_bidirectional_attention=True is not supported (causal LMs only)")
        super().__init__(config)
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = config.final_logit_softcapping

    def embed(self, tokens, pos):
        x = self.model.embed_tokens(tokens)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the dtype, as transformers does

    def head(self, x):
        return softcap(super().head(x), self.final_softcap)
