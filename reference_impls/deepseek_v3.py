"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM; Kimi-K2 has its shape) for the reference engines: multi-head
latent attention whose cache holds the compressed latent, decoded with the absorbed projections, and routed experts
in groups beside a shared expert.

What differs from Llama, as transformers 5.24's models/deepseek_v3 computes it:

- Queries: `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (`q_proj` where `q_lora_rank` is None), per head a part
  without position (`qk_nope_head_dim`) and a rotated part (`qk_rope_head_dim`).
- Keys and values: `kv_a_proj_with_mqa` gives a latent (`kv_lora_rank`, then `kv_a_layernorm`) and one rotated key
  part shared by every head (`qk_rope_head_dim`). **The cache holds those two per token** (`KVCache.update(layer,
  latent [b, t, 1, kv_lora_rank], rope key [b, t, 1, qk_rope_head_dim])`), as transformers' does.
- Attention, absorbed (how vLLM, SGLang and FlashMLA serve it): `kv_b_proj` [heads x (nope + v), kv_lora_rank] is
  split per head into W_uk [nope, latent] and W_uv [v, latent]; a head's score is (q_nope W_uk) . latent +
  q_rope . k_rope, its output (softmax . latent) W_uv^T: the same function as up-projecting the latent to per-head
  K and V first (transformers' form), without ever holding them. Scale qk_head_dim ** -0.5 (times YaRN's mscale^2
  where `mscale_all_dim` is set).
- RoPE on the rotated parts, their pairs interleaved where `rope_interleave` (the default): de-interleaved
  ([x0, x2, ...; x1, x3, ...]) and then rotated as everywhere else, bit for bit transformers' formula.
- MLP: dense for the first `first_k_dense_replace` layers, then moe.py's `grouped_sigmoid` router (`mlp.gate`, its
  weight and `e_score_correction_bias` kept in float32 as transformers keeps them) over `n_routed_experts`, plus
  `shared_experts` (an MLP of moe_intermediate_size x n_shared_experts) added for every token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from reference_impls.model import MLP, Block, Llama, RMSNorm, apply_rope, matmul
from reference_impls.moe import Experts, grouped_sigmoid


def deinterleave(x):
    """[..., (x0, x1), (x2, x3), ...] -> [..., x0, x2, ..., x1, x3, ...]: pairs as rotate_half's halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def softmax_scale(config) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale squared where the RoPE is YaRN with `mscale_all_dim`."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim") and rope.get("factor", 1) > 1:
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class LatentAttention(nn.Module):
    """Multi-head latent attention over a latent cache, absorbed (module docstring)."""

    def __init__(self, config):
        super().__init__()
        self.n_heads, self.latent = config.num_attention_heads, config.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.scale = softmax_scale(config)
        dim, bias, q_dim = config.hidden_size, config.attention_bias, self.n_heads * (self.nope + self.rope_dim)
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(dim, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.latent + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.latent, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, dim, bias=bias)

    def queries(self, x):
        """q without position [b, t, heads, nope] and its rotated part [b, t, heads, rope] (not yet rotated)."""
        b, t, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(b, t, self.n_heads, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)

    def latents(self, x):
        """The cached latent [b, t, 1, kv_lora_rank] and the shared rope key [b, t, 1, rope] (not yet rotated)."""
        b, t, _ = x.shape
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope_dim], dim=-1)
        return self.kv_a_layernorm(latent).view(b, t, 1, self.latent), k_rope.view(b, t, 1, self.rope_dim)

    def absorbed(self):
        """W_uk [heads, nope, latent] and W_uv [heads, v, latent], kv_b_proj's per-head blocks."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.latent)
        return w[:, :self.nope], w[:, self.nope:]

    def attend_latent(self, q_nope, q_rope, latent, k_rope, mask):
        """q parts [b, t, heads, .], the cache's latent [b, n, 1, latent] and rope key [b, n, 1, rope], mask
        [b, 1, t, n] -> [b, t, heads, v]: the absorbed attention (module docstring)."""
        w_uk, w_uv = self.absorbed()
        # [b, heads, t, latent + rope]
        q = torch.cat((matmul(q_nope.transpose(1, 2), w_uk), q_rope.transpose(1, 2)), dim=-1)
        keys = torch.cat((latent, k_rope), dim=-1).transpose(1, 2)  # [b, 1, n, latent + rope]: one for every head
        # attention written out (eager's: scores in the model's dtype, softmax in float32): inductor decomposes SDPA
        # over one key head shared by every head into a bmm, which it cannot lower at unbacked sizes (model.matmul)
        scores = (matmul(q, keys.transpose(-1, -2)) * self.scale).masked_fill(~mask, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = matmul(probs, latent.transpose(1, 2))  # [b, heads, t, latent]
        return matmul(out, w_uv.transpose(-1, -2)).transpose(1, 2)

    def forward(self, x, rope, mask, cache, layer: int):
        b, t, _ = x.shape
        q_nope, q_rope = self.queries(x)
        latent, k_rope = self.latents(x)
        if self.interleaved:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        latent, k_rope = cache.update(layer, latent, k_rope)
        out = self.attend_latent(q_nope, q_rope, latent, k_rope, mask)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.v_dim))  # no -1: b and t are unbacked sizes


class Router(nn.Module):
    """`mlp.gate`: sigmoid scores in float32 with a correction bias, group-limited (moe.py `grouped_sigmoid`)."""

    def __init__(self, config):
        super().__init__()
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(experts))
        self.k, self.groups, self.top_groups = config.num_experts_per_tok, config.n_group, config.topk_group
        self.renormalise, self.scale = bool(config.norm_topk_prob), float(config.routed_scaling_factor)

    def forward(self, x):
        logits = F.linear(x.float(), self.weight.float())
        return grouped_sigmoid(logits, self.e_score_correction_bias.float(), self.k, self.groups, self.top_groups,
                               self.renormalise, self.scale)


class RoutedMoe(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                               config.hidden_act)
        self.shared_experts = MLP(config, inner=config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))
        return self.experts(flat, self.gate(flat)).view_as(x) + self.shared_experts(x)


class DeepseekV3Block(Block):
    attention = LatentAttention

    def feed_forward(self, config, layer: int) -> nn.Module:
        return RoutedMoe(config) if layer >= config.first_k_dense_replace else MLP(config)


class DeepseekV3(Llama):
    """Parameter names match transformers' DeepseekV3ForCausalLM."""

    block = DeepseekV3Block
    keep_in_float32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # as transformers keeps them
