"""Bamba (transformers' BambaForCausalLM): a hybrid of Mamba2 mixers and full-attention layers, for the reference
engines that keep recurrent states (`model.State`: compiled_dynamic.py, its chunked prefill).

What differs from Llama, as transformers 5.24's models/bamba computes it:

- `config.layer_types`: "linear_attention" (a Mamba2 mixer, `mamba.*`) or "full_attention" (`self_attn.*`, Llama's
  attention with RoPE on the first half of each head: `partial_rotary_factor` 0.5). The MLP is `feed_forward`, the
  norm before it `pre_ff_layernorm`, the final one `model.final_layernorm`.
- The mixer: `in_proj` gives the gate z, the conv's input (x, B, C) and dt per head; a depthwise causal conv of
  kernel K over (x, B, C) with SiLU; the SSM (state space duality) over x with the input-dependent B, C and
  dt = softplus(dt + dt_bias) clamped to `time_step_limit`, A = -exp(A_log), the skip D x; then an RMSNorm of
  y * silu(z) per group (`norm`) and `out_proj`.
- Pads: transformers zeroes the mixer's input at pads and the conv's output there, so a pad adds nothing to a state;
  here the conv's input is zeroed too, so a pad never enters the conv window (the same where `in_proj` has no bias).

The scan here is the SSD's quadratic form over the call's t tokens (one chunk; transformers splits into chunks of
`mamba_chunk_size`, the same sums in another order), from the state the cache holds: every call (a whole prompt, a
prefill chunk, a decode step) is the same code, compiled once with t dynamic. The conv keeps its last K-1 inputs
(vLLM's and SGLang's layout: `KVLayout(conv_window_offset=-1)`), the recurrent state float32 in every dtype (what
transformers keeps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reference_impls.model import (
    FULL,
    MLP,
    STATE,
    Attention,
    Decoder,
    RMSNorm,
    State,
    StateSteps,
    UnsupportedModel,
    activation,
    rope_tables,
)
from reference_impls.recurrent import causal_conv, contract, segment_sum


def ssd(x, dt, A, B, C, D, state, every: bool = False):
    """Mamba2's scan of x [b, t, h, p] from `state` [b, h, p, n] (float32; None: zeros): outputs [b, t, h, p] and the
    state after the t tokens (`every`: after each, [b, t, h, p, n]), both float32. dt [b, t, h] (after softplus), A
    and D [h], B and C [b, t, h, n]."""
    x, dt = x.float(), dt.float()
    B, C = B.float().transpose(1, 2), C.float().transpose(1, 2)  # [b, h, t, n]
    a = (dt * A).transpose(1, 2)  # [b, h, t]: log of each step's decay
    decay = torch.exp(segment_sum(a))  # [b, h, t(l), t(s)]: from just after s up to l
    xdt = (x * dt[..., None]).transpose(1, 2)  # [b, h, t, p]
    y = contract(contract(C, B.transpose(-1, -2)) * decay, xdt)
    if every:  # after each l: the sum over s <= l of decay[l, s] xdt[s] B[s], [b, h, l, p, n]
        new = contract((decay[..., None] * xdt[:, :, None]).transpose(-1, -2), B[:, :, None])
    else:
        last = decay.narrow(2, decay.size(2) - 1, 1).transpose(-1, -2)  # [b, h, s, 1]: from just after s to the end
        new = contract((xdt * last).transpose(-1, -2), B)  # [b, h, p, n]
    if state is not None:
        carried = torch.exp(a.cumsum(-1))  # [b, h, t]: the state's decay up to l
        y = y + contract(C, state.transpose(-1, -2)) * carried[..., None]
        new = new + (state[:, :, None] * carried[..., None, None] if every else
                     state * carried.narrow(2, carried.size(2) - 1, 1)[..., None])
    return y.transpose(1, 2) + D[:, None] * x, new.transpose(1, 2) if every else new


class GatedRMSNorm(nn.Module):
    """`norm`: RMSNorm of y * silu(z) in float32, per group of `group` channels."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.weight, self.group, self.eps = nn.Parameter(torch.ones(dim)), group, eps

    def forward(self, y, z):
        h = (y.float() * F.silu(z.float())).unflatten(-1, (-1, self.group))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * h.to(y.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.act = activation(config.hidden_act, "Mamba2 activation")
        self.heads, self.head_dim = config.mamba_n_heads, config.mamba_d_head
        self.groups, self.state_size = config.mamba_n_groups, config.mamba_d_state
        self.inner = int(config.mamba_expand * config.hidden_size)
        self.conv_dim = self.inner + 2 * self.groups * self.state_size
        self.kernel = config.mamba_d_conv
        self.dt_limit = tuple(config.time_step_limit or (0.0, float("inf")))
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim,
                                bias=config.mamba_conv_bias)
        self.in_proj = nn.Linear(config.hidden_size, self.inner + self.conv_dim + self.heads,
                                 bias=config.mamba_proj_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, config.hidden_size, bias=config.mamba_proj_bias)

    def forward(self, x, real, cache, layer: int):
        """x [b, t, dim]; real [b, t]: the real (non-pad) tokens; the layer's `State` read from and kept in `cache`."""
        b, t, _ = x.shape
        keep = real[..., None].to(x.dtype)
        z, xbc, dt = self.in_proj(x * keep).split([self.inner, self.conv_dim, self.heads], dim=-1)
        past = cache.state(layer)
        every = cache.every_state
        conv, window = causal_conv(xbc * keep, past.conv if past is not None else None, self.conv1d, every)
        xbc = self.act(conv) * keep
        xs, B, C = xbc.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        per_head = self.heads // self.groups
        B, C = (m.view(b, t, self.groups, self.state_size).repeat_interleave(per_head, dim=2) for m in (B, C))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        y, state = ssd(xs.view(b, t, self.heads, self.head_dim), dt, -torch.exp(self.A_log.float()), B, C,
                       self.D.float(), past.ssm if past is not None else None, every)
        cache.update_state(layer, StateSteps(window, state) if every else State(window, state))
        return self.out_proj(self.norm(y.reshape(b, t, self.inner), z).to(x.dtype))


class BambaBlock(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.kind = config.layer_types[layer]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.kind == STATE:
            self.mamba = Mamba2Mixer(config)
        else:
            self.self_attn = Attention(config)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = MLP(config)

    def forward(self, x, rope, mask, cache, layer: int):
        h = self.input_layernorm(x)
        mixer = self.mamba(h, mask, cache, layer) if self.kind == STATE else self.self_attn(h, rope, mask, cache, layer)
        x = x + mixer
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaBackbone(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BambaBlock(config, i) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Bamba(Decoder):
    """Parameter names match transformers' BambaForCausalLM."""

    def __init__(self, config):
        kinds = list(config.layer_types)
        if set(kinds) - {STATE, FULL}:
            raise UnsupportedModel(f"Bamba with layer types {sorted(set(kinds) - {STATE, FULL})} is not supported")
        super().__init__()
        self.model = BambaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.layer_types, self.window = kinds, None
        self.rope = rope_tables(config)

    @property
    def layers(self):
        return self.model.layers

    def embed(self, tokens, pos):
        return self.model.embed_tokens(tokens)

    def head(self, x):
        return self.lm_head(self.model.final_layernorm(x))
