"""GPT-OSS (transformers' GptOssForCausalLM) for the reference engines: attention sinks, sliding and full layers,
routed experts.

What differs from Llama, as transformers 5.24's models/gpt_oss computes it:

- Attention sinks: each head has a learned logit `sinks` [heads] that joins every query's softmax as one more
  column (after the mask, before the softmax; the max of the row subtracted first) and is then dropped: it takes
  probability mass and gives no value. It is a parameter, not a position: the cache holds nothing for it, and a
  sliding window counts keys only.
- q, k, v and o projections with biases (`attention_bias`); `layer_types` alternates sliding and full layers.
- RMSNorm multiplies by its weight in float32, then casts (Llama casts first).
- MLP: a biased linear router (`mlp.router`), the top k logits, softmax over those k (moe.py `top_k_softmax`);
  experts stored transposed with biases, gate and up interleaved, SwiGLU clamped at `swiglu_limit` with
  `swiglu_alpha` and (up + 1) (moe.py `Experts(transposed=True)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reference_impls.model import Attention, Block, Llama, RMSNorm, matmul
from reference_impls.moe import Experts, top_k_softmax


class GptOssRMSNorm(RMSNorm):
    def forward(self, x):
        return (self.weight * self.normalize(x)).to(x.dtype)


def sink_softmax(scores, sinks):
    """Softmax of scores [b, heads, t, n] (masked entries -inf) with one more column per head, the sink logit
    [heads], which is then dropped: the probabilities of the n keys, summing to less than 1."""
    column = sinks.view(1, -1, 1, 1).expand(scores.size(0), -1, scores.size(2), 1).to(scores.dtype)
    combined = torch.cat((scores, column), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


class SinkAttention(Attention):
    def __init__(self, config):
        super().__init__(config)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))

    def attend(self, q, k, v, mask):
        """q [b, heads, t, d], k and v [b, kv_heads, n, d], mask [b, 1, t, n]: attention with the sink column."""
        groups = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (matmul(q, k.transpose(-1, -2)) * self.head_dim ** -0.5).masked_fill(~mask, float("-inf"))
        return matmul(sink_softmax(scores, self.sinks).to(v.dtype), v)


class Router(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.num_local_experts))
        self.k = config.num_experts_per_tok

    def forward(self, x):
        return top_k_softmax(F.linear(x, self.weight, self.bias), self.k)


class SparseMoe(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config.num_local_experts, config.hidden_size, config.intermediate_size,
                               transposed=True, alpha=config.swiglu_alpha, limit=config.swiglu_limit)

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))
        return self.experts(flat, self.router(flat)).view_as(x)


class GptOssBlock(Block):
    attention, norm = SinkAttention, GptOssRMSNorm

    def feed_forward(self, config, layer: int) -> nn.Module:
        return SparseMoe(config)


class GptOss(Llama):
    """Parameter names match transformers' GptOssForCausalLM."""

    block, norm = GptOssBlock, GptOssRMSNorm
