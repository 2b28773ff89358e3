"""Qwen3 and Qwen3-MoE (transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM) for the reference engines.

What differs from Llama, as transformers 5.24's models/qwen3 and models/qwen3_moe compute it:

- qk-norm: an RMSNorm over head_dim on each head of q and of k (`q_norm`, `k_norm`, Llama's RMSNorm), after the
  projection and before RoPE, in every step (prefill and decode alike).
- Qwen3-MoE: a layer's MLP is routed experts (moe.py: `softmax_top_k`, renormalised where `norm_topk_prob`) where
  the layer is not in `mlp_only_layers` and (layer + 1) is a multiple of `decoder_sparse_step`; `mlp.gate` is the
  router, `mlp.experts` the experts ([experts, 2 x moe_intermediate_size, hidden]).
"""

from __future__ import annotations

import torch
from torch import nn

from reference_impls.model import MLP, Attention, Block, Llama, RMSNorm
from reference_impls.moe import Experts, softmax_top_k


class Qwen3Attention(Attention):
    def __init__(self, config):
        super().__init__(config)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project(self, x):
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class Router(nn.Module):
    """`mlp.gate`: a linear router, softmax then top k (moe.py `softmax_top_k`)."""

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.k, self.renormalise = config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", True))

    def forward(self, x):
        return softmax_top_k(nn.functional.linear(x, self.weight), self.k, self.renormalise)


class SparseMoe(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                               config.hidden_act)

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))
        return self.experts(flat, self.gate(flat)).view_as(x)


def sparse(config, layer: int) -> bool:
    """Is layer `layer`'s MLP routed experts (Qwen3-MoE's rule, Qwen3-Next's too): the config has experts, the layer
    is not in `mlp_only_layers` and (layer + 1) is a multiple of `decoder_sparse_step`."""
    return bool(getattr(config, "num_experts", 0)) and layer not in (getattr(config, "mlp_only_layers", None) or []) \
        and (layer + 1) % getattr(config, "decoder_sparse_step", 1) == 0


class Qwen3Block(Block):
    attention = Qwen3Attention

    def feed_forward(self, config, layer: int) -> nn.Module:
        return SparseMoe(config) if sparse(config, layer) else MLP(config)


class Qwen3(Llama):
    """Parameter names match transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM."""

    block = Qwen3Block
