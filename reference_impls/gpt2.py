"""GPT-2 (transformers' GPT2LMHeadModel, model_type "gpt2") for the reference engines.

What differs from Llama, as transformers 5.23's models/gpt2/modeling_gpt2.py computes it:

- Learned ABSOLUTE position embeddings instead of RoPE: x = wte(token) + wpe(position). The position
  is the token's index among its row's real tokens (`Decoder.forward`: `valid.cumsum(-1) - 1`), so a
  left-padded row computes what the prompt alone would; transformers agrees when given those
  position_ids (its generate() derives them from the attention mask).
- LayerNorm (weight and bias, `layer_norm_epsilon`): ln_1 before attention, ln_2 before the MLP,
  ln_f before the head.
- Conv1D layers: y = x @ weight + bias, weight [in, out] (an nn.Linear's transposed). `c_attn`
  gives q, k and v fused: three blocks of n_embd, split into n_head heads of n_embd / n_head
  (no GQA). Scores scaled by head_dim ** -0.5 (`scale_attn_weights`), divided by layer + 1 with
  `scale_attn_by_inverse_layer_idx`.
- MLP: c_proj(gelu_new(c_fc(x))); gelu_new is the tanh approximation.
- The head is tied to wte by default: tied checkpoints have no lm_head.weight (`tied_embedding`).

Not supported (UnsupportedModel): cross-attention, activations other than gelu_new.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from reference_impls.model import FULL, Decoder, UnsupportedModel, sdpa


class Conv1D(nn.Module):
    """transformers' Conv1D: a linear layer storing its weight as [in, out]."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.dim, self.n_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = self.dim // self.n_heads
        self.c_attn = Conv1D(self.dim, 3 * self.dim)
        self.c_proj = Conv1D(self.dim, self.dim)
        self.scale = (self.head_dim**-0.5 if config.scale_attn_weights else 1.0) / (
            layer + 1 if config.scale_attn_by_inverse_layer_idx else 1)

    def forward(self, x, mask, cache, layer):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.n_heads, self.head_dim) for y in self.c_attn(x).split(self.dim, dim=-1))
        # views of c_attn's output: copy, so the cache is fresh and contiguous (no stride guards)
        if cache.past is None:
            k, v = k.contiguous(), v.contiguous()
        k, v = cache.update(layer, k, v)
        y = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.scale)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, self.dim))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = Conv1D(config.hidden_size, inner)
        self.c_proj = Conv1D(inner, config.hidden_size)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # gelu_new


class Block(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        LayerNorm = functools.partial(nn.LayerNorm, config.hidden_size, eps=config.layer_norm_epsilon)
        self.ln_1, self.attn, self.ln_2, self.mlp = LayerNorm(), Attention(config, layer), LayerNorm(), MLP(config)

    def forward(self, x, rope, mask, cache, layer):  # rope: always None (no RoPE)
        x = x + self.attn(self.ln_1(x), mask, cache, layer)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class GPT2(Decoder):
    """Parameter names match transformers' GPT2LMHeadModel; `Decoder.forward` runs it over a `GrowingCache`."""

    tied_embedding = "transformer.wte.weight"

    def __init__(self, config):
        super().__init__()
        if config.add_cross_attention or config.activation_function != "gelu_new":
            raise UnsupportedModel(f"GPT-2 with add_cross_attention={config.add_cross_attention}, activation "
                                   f"'{config.activation_function}' is not supported (causal LM, gelu_new only)")
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.layer_types = [FULL] * config.num_hidden_layers  # full attention in every layer
        self.rope = {}  # learned absolute positions instead (wpe)

    @property
    def layers(self):
        return self.transformer.h

    def embed(self, tokens, pos):
        return self.transformer.wte(tokens) + self.transformer.wpe(pos)

    def head(self, x):
        return self.lm_head(self.transformer.ln_f(x))
