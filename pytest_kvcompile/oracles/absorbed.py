"""Multi-head latent attention computed absorbed: an equivalent computation of a model with latent layers
(`models.layers.LatentLayer`, DeepSeek-V3's MLA), as vLLM, SGLang and FlashMLA decode it (issue 69).

transformers up-projects the cached latent to per-head K and V (``kv_b_proj``) and attends over them. A serving engine
never holds them: it splits ``kv_b_proj`` per head into W_uk [nope, latent] and W_uv [v, latent], scores a head as
(q_nope W_uk) . latent + q_rope . k_rope, and projects its output (probs . latent) W_uv^T. The same function in exact
arithmetic (float32: ~1e-5 apart), other roundings in 16-bit: the products of the query with W_uk and of the latent
output with W_uv round where transformers' K and V would have. Without it among the computations the noise of a
latent model is that of the up-projected form only, and a correct absorbed engine is judged on another kernel's
rounding (ref-compiled-dynamic on deepseek-v3 in bfloat16 was, docs/precision.md).

`absorbed(model)`: the model called with every latent layer's attention absorbed (transformers' own module: its
projections, RoPE, cache and masks; only ``expand_kv`` and the attention kernel replaced, per call), or None where
this transformers' latent attention has no ``expand_kv`` to replace (before 5.2x: the computation is then left out,
and the calibration's line lists the computations it ran).
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_kvcompile.models.layers import LatentLayer, layer_caches
from pytest_kvcompile.recompiles.hooks import attention_kernel

KERNEL = "kvcompile_absorbed_mla"  # the attention implementation's name in transformers' AttentionInterface


def latent_modules(model: Any) -> list[Any]:
    """transformers' attention modules of `model`'s latent layers, [] where it has none or their attention cannot be
    absorbed here (no ``expand_kv``, or fewer such modules than the config's latent layers)."""
    try:
        wanted = sum(isinstance(c, LatentLayer) for c in layer_caches(model.config))
    except (AttributeError, TypeError, IndexError):
        return []
    found = [m for m in model.modules() if hasattr(m, "kv_b_proj") and callable(getattr(m, "expand_kv", None))
             and all(hasattr(m, a) for a in ("qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "num_heads"))]
    return found if wanted and len(found) == wanted else []


def _latent_keys(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``expand_kv`` replaced: the keys are the latent and the shared rope key ([b, 1, n, latent + rope], one head for
    all), the values the latent ([b, 1, n, latent]); `_attention` absorbs the up-projection."""
    return torch.cat((kv_nope, k_rot), dim=-1), kv_nope


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The absorbed attention of one latent layer: query [b, heads, t, nope + rope], key and value as `_latent_keys`
    gives them, an additive mask (eager's) -> [b, t, heads, v] as transformers' kernels return it; scores in the
    model's dtype and the softmax in float32, as eager's."""
    nope, v = module.qk_nope_head_dim, module.v_head_dim
    w = module.kv_b_proj.weight.view(module.num_heads, nope + v, module.kv_lora_rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_nope, q_rope = query.split([nope, query.size(-1) - nope], dim=-1)
    q = torch.cat((q_nope @ w_uk, q_rope), dim=-1)  # [b, heads, t, latent + rope]
    scores = (q @ key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return ((probs @ value) @ w_uv.transpose(-1, -2)).transpose(1, 2).contiguous(), None


def _register() -> bool:
    """`KERNEL` in transformers' attention and mask interfaces (once per process); False where it has none."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask
    except ImportError:
        return False
    if KERNEL not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(KERNEL, _attention)
        AttentionMaskInterface.register(KERNEL, eager_mask)
    return True


class Absorbed:
    """`model` called with its latent layers' attention absorbed (module docstring), restored after each call."""

    def __init__(self, model: Any, modules: list[Any]):
        self.model, self.modules, self.config = model, modules, model.config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        home = attention_kernel(self.model)
        for module in self.modules:
            module.expand_kv = _latent_keys  # an instance attribute over the method, deleted below
        self.model.set_attn_implementation(KERNEL)
        try:
            return self.model(*args, **kwargs)
        finally:
            self.model.set_attn_implementation(home)
            for module in self.modules:
                del module.expand_kv


def absorbed(model: Any) -> Absorbed | None:
    """`model` with its latent attention absorbed, or None where it has none to absorb (module docstring)."""
    modules = latent_modules(model)
    if not modules or not callable(getattr(model, "set_attn_implementation", None)) or not _register():
        return None
    return Absorbed(model, modules)
