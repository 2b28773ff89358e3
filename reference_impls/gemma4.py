"""Gemma4 text (transformers' Gemma4ForCausalLM, model_type "gemma4_text") with KV sharing.

The math of transformers 5.23's models/gemma4/modeling_gemma4.py, written out:

- RMSNorm: x * (mean(x^2) + eps) ** -0.5 * weight, in float32, cast back (weight, not 1 + weight;
  `v_norm` has no weight).
- Embeddings times sqrt(hidden_size) (rounded to the weights' dtype). Per-layer inputs (PLE): a second
  embedding table gives each token a [layers, p] vector, scaled by sqrt(p); the main embedding projected
  by `per_layer_model_projection`, times hidden_size ** -0.5, reshaped to [layers, p] and RMS-normed;
  the two summed and scaled by 2 ** -0.5. Layer i gets slice i.
- Attention: q_norm / k_norm (RMS over head_dim) before RoPE, v_norm after projection; score scale 1.0.
  RoPE per layer type (`rope_parameters[layer_type]`: default for sliding layers, proportional with a
  partial rotary factor for full ones); head_dim and KV heads per layer (`per_layer_config`).
- Block: x + post_attention_layernorm(attn(input_layernorm(x))); x + post_feedforward_layernorm(mlp(
  pre_feedforward_layernorm(x))); then x + post_per_layer_input_norm(per_layer_projection(gelu(
  per_layer_input_gate(x)) * ple_i)); then x * layer_scalar.
- KV sharing: with S = num_kv_shared_layers of L layers, layer i >= L - S has no K/V projections and
  attends over the K/V of the last layer j < L - S with the same layer type (`kv_sources`, the
  checker's rule in pytest_kvcompile/oracles/eviction.py).
- Logits: lm_head, then `final_logit_softcapping` when set.

Not supported (UnsupportedModel): MoE blocks, `attention_k_eq_v`, double-wide MLPs, bidirectional attention.
"""

from __future__ import annotations

import torch
from torch import nn

from pytest_kvcompile.oracles.eviction import kv_sources
from reference_impls.gemma3 import softcap
from reference_impls.model import (
    ACTIVATIONS,
    MLP,
    SLIDING,
    Decoder,
    UnsupportedModel,
    apply_rope,
    layer_types,
    rope_tables,
    sdpa,
)


def geometry(config, layer: int) -> tuple[int, int]:
    """(kv_heads, head_dim) of one layer: full layers may have their own (`global_head_dim`, and
    `num_global_key_value_heads` with `attention_k_eq_v`); transformers 5.23 resolves them in `per_layer_config`."""
    if hasattr(config, "per_layer_config"):
        c = config.per_layer_config[layer]
        return c.num_key_value_heads, c.head_dim
    if layer_types(config)[layer] == SLIDING:
        return config.num_key_value_heads, config.head_dim
    return config.num_key_value_heads, getattr(config, "global_head_dim", None) or config.head_dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x):
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (h if self.weight is None else h * self.weight.float()).type_as(x)


class Attention(nn.Module):
    def __init__(self, config, layer: int, shared: bool):
        super().__init__()
        self.n_kv_heads, self.head_dim = geometry(config, layer)
        self.n_heads, dim, eps = config.num_attention_heads, config.hidden_size, config.rms_norm_eps
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=config.attention_bias)
        if not shared:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=config.attention_bias)
            self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=config.attention_bias)
            self.k_norm = RMSNorm(self.head_dim, eps)
            self.v_norm = RMSNorm(self.head_dim, eps, with_scale=False)

    def kv(self, x, rope):
        """This step's keys (after RoPE) and values, [b, t, kv_heads, d]."""
        b, t, _ = x.shape
        k = apply_rope(self.k_norm(self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)), *rope)
        return k, self.v_norm(self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim))

    def forward(self, x, rope, mask, cache, layer: int, source: int | None):
        """A shared layer (`source` set) attends over the K/V its source layer wrote in this step; it writes none."""
        b, t, _ = x.shape
        k, v = cache.update(layer, *self.kv(x, rope)) if source is None else cache.layers[source]
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)), *rope)
        y = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, 1.0, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, config, layer: int, shared: bool):
        super().__init__()
        dim, eps, ple = config.hidden_size, config.rms_norm_eps, config.hidden_size_per_layer_input
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention(config, layer, shared)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.mlp = MLP(config, config.hidden_activation)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)
        self.act = ACTIVATIONS[config.hidden_activation]
        self.per_layer_input_gate = nn.Linear(dim, ple, bias=False)
        self.per_layer_projection = nn.Linear(ple, dim, bias=False)
        self.post_per_layer_input_norm = RMSNorm(dim, eps)
        self.layer_scalar = nn.Buffer(torch.ones(1))

    def forward(self, x, ple, rope, mask, cache, layer: int, source: int | None = None):
        """One layer over x [b, t, dim] with its per-layer input ple [b, t, p]."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask, cache, layer, source))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        g = self.per_layer_projection(self.act(self.per_layer_input_gate(x)) * ple)
        return (x + self.post_per_layer_input_norm(g)) * self.layer_scalar


class Backbone(nn.Module):
    def __init__(self, config):
        super().__init__()
        n, dim, ple = config.num_hidden_layers, config.hidden_size, config.hidden_size_per_layer_input
        shared = kv_sources(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, dim)
        self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, n * ple)
        self.per_layer_model_projection = nn.Linear(dim, n * ple, bias=False)
        self.per_layer_projection_norm = RMSNorm(ple, config.rms_norm_eps)
        self.layers = nn.ModuleList(Block(config, i, i in shared) for i in range(n))
        self.norm = RMSNorm(dim, config.rms_norm_eps)


class Gemma4(Decoder):
    """Parameter names match transformers' Gemma4ForCausalLM. The cache holds the non-shared layers only.

    `forward` is `Decoder.forward` (positions and masks from `valid`, then `run`, its own loop: per-layer inputs and
    KV sharing); `skip_shared_prefill` turns the prefill skip on (reference_impls/kv_shared.py).
    """

    skip_shared_prefill = False

    def __init__(self, config):
        super().__init__()
        unsupported = [name for name in ("enable_moe_block", "attention_k_eq_v", "use_double_wide_mlp",
                                         "use_bidirectional_attention") if getattr(config, name, False)]
        unsupported += [] if config.hidden_size_per_layer_input else ["hidden_size_per_layer_input=0"]
        if unsupported or config.hidden_activation not in ACTIVATIONS:
            raise UnsupportedModel(f"Gemma4 with {', '.join(unsupported) or config.hidden_activation} is not supported")
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.layer_types = layer_types(config)
        self.window = config.sliding_window
        self.kv_sources = kv_sources(config)
        self.first_shared = min(self.kv_sources, default=config.num_hidden_layers)
        self.rope = rope_tables(config)  # the loader rebuilds it on the real device

    def per_layer_inputs(self, tokens, x):
        """PLE: [b, t, layers, p]."""
        n, p = self.config.num_hidden_layers, self.config.hidden_size_per_layer_input
        emb = self.model.embed_tokens_per_layer(tokens)
        emb = (emb * torch.tensor(p**0.5, dtype=emb.dtype)).view(*tokens.shape, n, p)
        proj = self.model.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        return (self.model.per_layer_projection_norm(proj.view(*tokens.shape, n, p)) + emb) * 2**-0.5

    def run(self, tokens, pos, masks, cache, every: bool = False):
        """`Decoder.run` with per-layer inputs and KV sharing: the non-shared layers write `cache`, the shared ones
        read their source's. With `skip_shared_prefill`, the shared layers run on the last position only (the
        prefill skip: their other positions feed nothing); it and `every` (logits of every position) exclude each
        other."""
        t = tokens.size(1)
        x = self.model.embed_tokens(tokens)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        ple = self.per_layer_inputs(tokens, x)
        rope = self.rotary(pos, x.dtype)
        for i, (layer, kind) in enumerate(zip(self.model.layers, self.layer_types)):
            if i == self.first_shared and self.skip_shared_prefill:
                x, ple = x.narrow(1, t - 1, 1), ple.narrow(1, t - 1, 1)
                rope = {k: (c.narrow(1, t - 1, 1), s.narrow(1, t - 1, 1)) for k, (c, s) in rope.items()}
                masks = {k: m.narrow(2, t - 1, 1) for k, m in masks.items()}
            x = layer(x, ple[:, :, i], rope[kind], masks[kind], cache, i, self.kv_sources.get(i))
        x = self.model.norm(x if every else x.narrow(1, x.size(1) - 1, 1))
        logits = softcap(self.lm_head(x), self.config.final_logit_softcapping)
        return logits if every else logits[:, 0]
