"""Mixture-of-experts layers every MoE architecture shares: the routed experts as transformers stores them, and the
routers (which experts each token takes, with what weight), as transformers 5.24 computes them.

The experts run densely: every expert on every token, each output weighted by the token's routing weight for it
(exactly zero for the experts it did not take), so a compiled graph has no data-dependent shapes and a batch row's
result never depends on its neighbours (a capacity that drops tokens is a bug this suite checks for, not a feature).
The routers return dense weights [tokens, experts].

==================  ====================================================================  ===========================
router              choice and weights                                                    models
==================  ====================================================================  ===========================
`softmax_top_k`     softmax over all experts in float32, the top k, renormalised to sum   Qwen3-MoE, Mixtral
                    1 where `norm_topk_prob` (Mixtral always)
`top_k_softmax`     the top k logits (a biased router), softmax over those k only         GPT-OSS
`grouped_sigmoid`   sigmoid scores in float32; the choice adds a correction bias, keeps   DeepSeek-V3
                    the `topk_group` groups whose best two sum highest, then the top k;
                    the weights are the unbiased scores, renormalised, times
                    `routed_scaling_factor`
==================  ====================================================================  ===========================
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from reference_impls.model import activation


def dense(indices, values, experts: int):
    """Routing weights [tokens, experts]: `values` at `indices` [tokens, k], zero elsewhere."""
    return torch.zeros(indices.size(0), experts, dtype=values.dtype, device=values.device).scatter(1, indices, values)


def softmax_top_k(logits, k: int, renormalise: bool):
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    top, indices = torch.topk(probs, k, dim=-1)
    if renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return dense(indices, top.to(logits.dtype), logits.size(-1))


def top_k_softmax(logits, k: int):
    top, indices = torch.topk(logits, k, dim=-1)
    return dense(indices, F.softmax(top, dim=-1, dtype=top.dtype), logits.size(-1))


def grouped_sigmoid(logits, bias, k: int, groups: int, top_groups: int, renormalise: bool, scale: float):
    scores = logits.float().sigmoid()
    choice = scores + bias
    tokens, experts = choice.shape
    group_scores = choice.view(tokens, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    kept = torch.zeros_like(group_scores).scatter(1, torch.topk(group_scores, top_groups, dim=-1)[1], 1.0)
    kept = kept[:, :, None].expand(tokens, groups, experts // groups).reshape(tokens, experts)
    indices = torch.topk(choice.masked_fill(kept == 0, float("-inf")), k, dim=-1)[1]
    weights = scores.gather(1, indices)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return dense(indices, weights * scale, experts)


class Experts(nn.Module):
    """Routed experts (`experts.*` in transformers' checkpoints): gate_up_proj [experts, 2 x inner, hidden] and
    down_proj [experts, hidden, inner], gate and up halves concatenated; `transposed` (GPT-OSS): [experts, hidden,
    2 x inner] and [experts, inner, hidden] with biases, gate and up interleaved, its clamped SwiGLU."""

    def __init__(self, experts: int, hidden: int, inner: int, act: str = "silu", transposed: bool = False,
                 alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self.act = activation(act, "expert activation")
        self.transposed, self.alpha, self.limit = transposed, alpha, limit
        shapes = ((experts, hidden, 2 * inner), (experts, inner, hidden)) if transposed else (
            (experts, 2 * inner, hidden), (experts, hidden, inner))
        self.gate_up_proj = nn.Parameter(torch.empty(shapes[0]))
        self.down_proj = nn.Parameter(torch.empty(shapes[1]))
        if transposed:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inner))
            self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.experts = experts
        self._register_load_state_dict_pre_hook(self._per_expert)

    def _per_expert(self, state, prefix, *_):
        """Read a checkpoint that stores each expert's own MLP (`experts.E.{gate,up,down}_proj.weight`, how
        transformers saves Qwen3-MoE and DeepSeek-V3, and how their hub checkpoints are): stacked as here."""
        names = [f"{prefix}{e}.{part}_proj.weight" for e in range(self.experts) for part in ("gate", "up", "down")]
        if self.transposed or not all(name in state for name in names):
            return
        rows = {part: [state.pop(f"{prefix}{e}.{part}_proj.weight") for e in range(self.experts)]
                for part in ("gate", "up", "down")}
        state[prefix + "gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(rows["gate"], rows["up"])])
        state[prefix + "down_proj"] = torch.stack(rows["down"])

    def forward(self, x, weights):
        """x [tokens, hidden], weights [tokens, experts] (`dense`) -> [tokens, hidden]: each expert as its own
        matmuls (an einsum over the experts lowers to a bmm, whose inductor lowering guards on whether a compiled
        engine's unbacked token count is 1 and fails)."""
        weights = weights.to(x.dtype)
        out = None
        for e in range(self.experts):
            if self.transposed:
                gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
                gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
                y = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[e] + self.down_proj_bias[e]
            else:
                gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(self.act(gate) * up, self.down_proj[e])
            y = y * weights[:, e, None]
            out = y if out is None else out + y
        return out


__all__ = ["Experts", "dense", "grouped_sigmoid", "softmax_top_k", "top_k_softmax"]
