"""Phi-3 (transformers' Phi3ForCausalLM) for the reference engines.

What differs from Llama, as transformers 5.24's models/phi3 computes it:

- One fused projection `qkv_proj` ([q; k; v] rows) and one fused `gate_up_proj` ([gate; up] rows) in the MLP.
- Partial rotary: RoPE turns the first head_dim x `partial_rotary_factor` dimensions of each head and passes the
  rest through (model.py: `rope_inv_freq` makes the shorter table, `apply_rope` leaves the tail).
"""

from __future__ import annotations

from torch import nn

from reference_impls.model import Attention, Block, Llama, activation


class Phi3Attention(Attention):
    def __init__(self, config):
        nn.Module.__init__(self)
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split = (q, kv, kv)
        self.qkv_proj = nn.Linear(config.hidden_size, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, config.hidden_size, bias=False)

    def project(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        return (q.view(b, t, self.n_heads, self.head_dim), k.view(b, t, self.n_kv_heads, self.head_dim),
                v.view(b, t, self.n_kv_heads, self.head_dim))


class Phi3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.act = activation(config.hidden_act)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate))


class Phi3Block(Block):
    attention = Phi3Attention

    def feed_forward(self, config, layer: int) -> nn.Module:
        return Phi3MLP(config)


class Phi3(Llama):
    """Parameter names match transformers' Phi3ForCausalLM."""

    block = Phi3Block
