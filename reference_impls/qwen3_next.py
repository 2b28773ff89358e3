"""Qwen3-Next (transformers' Qwen3NextForCausalLM): Gated DeltaNet layers beside gated full attention, and routed
experts with a gated shared expert, for the reference engines that keep recurrent states (`model.State`).

What differs from Llama, as transformers 5.24's models/qwen3_next computes it:

- `config.layer_types`: "linear_attention" (a Gated DeltaNet, `linear_attn.*`) or "full_attention" (`self_attn.*`).
- Every RMSNorm scales by (1 + weight) in float32 (Gemma's; the q/k norms too).
- Attention: `q_proj` gives each head its query and an output gate (head_dim each, per head in turn); q-norm and
  k-norm per head, RoPE on the first `partial_rotary_factor` of each head, and the output times sigmoid(gate) before
  `o_proj`.
- The Gated DeltaNet: `in_proj_qkvz` gives per key head its q, k, and its value heads' v and z; `in_proj_ba` per
  key head its value heads' beta (after a sigmoid) and decay input a; a depthwise causal conv of kernel K over
  (q, k, v) with SiLU; q and k L2-normalised in float32, q scaled by 1/sqrt(key_dim), each key head serving
  value_heads / key_heads value heads; g = -exp(A_log) softplus(a + dt_bias); the delta rule (`gated_delta`); an
  RMSNorm per value head gated by silu(z) (`norm`) and `out_proj`.
- MLP: routed experts (moe.py's `softmax_top_k`, renormalised where `norm_topk_prob`) plus a shared expert scaled by
  sigmoid(`shared_expert_gate`), on the layers Qwen3-MoE's rule makes sparse.

The conv keeps its last K-1 inputs (`KVLayout(conv_window_offset=-1)`), the delta-rule state
[value_heads, key_dim, value_dim] float32 in every dtype (what transformers keeps). A pad never reaches a state: the
layer's input, the conv's input and output, beta and the decay are zeroed there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reference_impls.gemma3 import Gemma3RMSNorm
from reference_impls.model import (
    FULL,
    MLP,
    STATE,
    Attention,
    Llama,
    State,
    StateSteps,
    UnsupportedModel,
    activation,
    apply_rope,
)
from reference_impls.qwen3 import SparseMoe, sparse
from reference_impls.recurrent import causal_conv, contract, segment_sum, unit_lower_solve


def gated_delta(q, k, v, g, beta, state, every: bool = False):
    """The gated delta rule over a call's t tokens at once, from `state` [b, h, dk, dv] (float32; None: zeros).

    Per token: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; out = S^T q. Unrolled over the t tokens (G the
    cumulative g): u = (I + A)^-1 (beta v - beta exp(G) S0^T k) with A[i, s] = beta_i exp(G_i - G_s) k_i . k_s for s < i
    (a unit lower-triangular solve), out_i = exp(G_i) S0^T q_i + sum_{s <= i} exp(G_i - G_s) (q_i . k_s) u_s, and the
    state after token l the same sum's outer products. q, k [b, t, h, dk] (normalised, q scaled), v [b, t, h, dv], g
    and beta [b, t, h]. Returns out [b, t, h, dv] and the state after the t tokens (`every`: after each,
    [b, t, h, dk, dv]), float32."""
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))  # [b, h, t, d]
    g, beta = g.float().transpose(1, 2), beta.float().transpose(1, 2)  # [b, h, t]
    t = q.size(2)
    decay = torch.exp(segment_sum(g))  # [b, h, t(i), t(s)]: exp(G_i - G_s) for s <= i, 0 above
    k_beta = k * beta[..., None]
    strictly_below = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-1)
    A = (contract(k_beta, k.transpose(-1, -2)) * decay).masked_fill(~strictly_below, 0)
    rhs = v * beta[..., None]
    if state is not None:
        carried = torch.exp(g.cumsum(-1))[..., None]  # [b, h, t, 1]: the state's decay up to i
        rhs = rhs - contract(k_beta * carried, state)
    u = unit_lower_solve(A, rhs)  # [b, h, t, dv]
    out = contract(contract(q, k.transpose(-1, -2)) * decay, u)
    if state is not None:
        out = out + contract(q * carried, state)
    if every:
        new = contract((decay[..., None] * k[:, :, None]).transpose(-1, -2), u[:, :, None])  # [b, h, l, dk, dv]
        if state is not None:
            new = new + state[:, :, None] * carried[..., None]
        return out.transpose(1, 2), new.transpose(1, 2)
    last = decay.narrow(2, t - 1, 1).transpose(-1, -2)  # [b, h, s, 1]: from just after s to the end
    new = contract((k * last).transpose(-1, -2), u)  # [b, h, dk, dv]
    if state is not None:  # (not carried's last: inductor miscomputes that narrow at an unbacked offset, broadcast)
        new = new + state * torch.exp(g.sum(-1))[..., None, None]
    return out.transpose(1, 2), new


def l2norm(x, eps: float = 1e-6):
    """transformers' (and FLA's) l2norm: x / sqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedNorm(nn.Module):
    """`linear_attn.norm`: RMSNorm per value head in float32, weight applied in the model's dtype, then times
    silu(z) in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, y, z):
        h = y.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(y.dtype)
        return (h * F.silu(z.float())).to(y.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.act = activation(config.hidden_act, "Gated DeltaNet activation")
        self.k_heads, self.v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        if self.v_heads % self.k_heads:
            raise UnsupportedModel(f"Gated DeltaNet with {self.v_heads} value heads over {self.k_heads} key heads")
        self.per_key = self.v_heads // self.k_heads
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False)
        self.in_proj_qkvz = nn.Linear(config.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(config.hidden_size, 2 * self.v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.norm = GatedNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)

    def forward(self, x, real, cache, layer: int):
        """x [b, t, dim]; real [b, t]: the real (non-pad) tokens; the layer's `State` read from and kept in `cache`."""
        b, t, _ = x.shape
        keep = real[..., None].to(x.dtype)
        x = x * keep
        side = self.per_key * self.dv
        q, k, v, z = self.in_proj_qkvz(x).view(b, t, self.k_heads, -1).split([self.dk, self.dk, side, side], dim=-1)
        beta, a = self.in_proj_ba(x).view(b, t, self.k_heads, -1).split([self.per_key, self.per_key], dim=-1)
        mixed = torch.cat((q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)), dim=-1) * keep
        past = cache.state(layer)
        every = cache.every_state
        conv, window = causal_conv(mixed, past.conv if past is not None else None, self.conv1d, every)
        q, k, v = (self.act(conv) * keep).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.float().view(b, t, self.k_heads, self.dk)) / self.dk ** 0.5
        k = l2norm(k.float().view(b, t, self.k_heads, self.dk))
        q, k = (m.repeat_interleave(self.per_key, dim=2) for m in (q, k))
        real_f = real[..., None].float()
        beta = beta.reshape(b, t, self.v_heads).sigmoid().float() * real_f
        g = -self.A_log.float().exp() * F.softplus(a.reshape(b, t, self.v_heads).float() + self.dt_bias) * real_f
        y, state = gated_delta(q, k, v.view(b, t, self.v_heads, self.dv), g, beta,
                               past.ssm if past is not None else None, every)
        cache.update_state(layer, StateSteps(window, state) if every else State(window, state))
        y = self.norm(y.to(x.dtype), z.reshape(b, t, self.v_heads, self.dv))
        return self.out_proj(y.reshape(b, t, self.value_dim))


class Qwen3NextAttention(Attention):
    def __init__(self, config):
        super().__init__(config)
        self.q_proj = nn.Linear(config.hidden_size, 2 * self.n_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)

    def split(self, x):
        """q, k, v [b, t, heads or kv_heads, d] (normed, before RoPE) and the output gate [b, t, heads x d]."""
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        return self.q_norm(q), self.k_norm(k), v, gate.reshape(b, t, -1)

    def project(self, x):
        return self.split(x)[:3]

    def forward(self, x, rope, mask, cache, layer: int):
        b, t, _ = x.shape
        q, k, v, gate = self.split(x)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        k, v = cache.update(layer, k, v)
        y = cache.attend(layer, self, q, k, v, mask).reshape(b, t, self.n_heads * self.head_dim)
        return self.o_proj(y * torch.sigmoid(gate))


class SharedExpertMoe(SparseMoe):
    """`mlp`: Qwen3-MoE's routed experts plus the shared expert times sigmoid(`shared_expert_gate`)."""

    def __init__(self, config):
        super().__init__(config)
        self.shared_expert = MLP(config, inner=config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return super().forward(x) + shared.view_as(x)


class Qwen3NextBlock(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.kind = config.layer_types[layer]
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.kind == STATE:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Qwen3NextAttention(config)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SharedExpertMoe(config) if sparse(config, layer) else MLP(config)

    def forward(self, x, rope, mask, cache, layer: int):
        h = self.input_layernorm(x)
        mixer = self.linear_attn(h, mask, cache, layer) if self.kind == STATE else \
            self.self_attn(h, rope, mask, cache, layer)
        x = x + mixer
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Next(Llama):
    """Parameter names match transformers' Qwen3NextForCausalLM."""

    block, norm = Qwen3NextBlock, Gemma3RMSNorm

    def __init__(self, config):
        kinds = list(config.layer_types)
        if set(kinds) - {STATE, FULL}:
            raise UnsupportedModel(f"Qwen3-Next with layer types {sorted(set(kinds) - {STATE, FULL})} is not "
                                   "supported")
        super().__init__(config)
        self.layer_types, self.window = kinds, None
        self._register_load_state_dict_pre_hook(self._drop_mtp)

    @staticmethod
    def _drop_mtp(state, prefix, *_):
        """Hub checkpoints also hold the multi-token-prediction head (`mtp.*`), which transformers ignores too."""
        for name in [name for name in state if name.startswith(prefix + "mtp.")]:
            del state[name]
