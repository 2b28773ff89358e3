"""Engines for the served architectures (issue 69): the reference engines run eagerly, and one bug each from the
engines people serve these models with, as a patch on the reference model's own module. Each must fail the suites
on its model (tests/test_served.py), in float32 and bfloat16, while the reference passes.

The reference's prefill and decode run as plain functions, without dynamo: these bugs are in the model's math, and
a dynamo trace of each twin's MoE model cost ~10 s of its ~12 s (the compiled reference's own checks run in CI's
served job and the suites). A bug that hits the decode step only reads the engine's own flag (`decoding`), set around
its decode calls.
"""

import dataclasses
import types

import torch
import torch.nn.functional as F

from reference_impls import compiled_dynamic, moe
from reference_impls.compiled_dynamic import CompiledDynamicCache
from reference_impls.deepseek_v3 import LatentAttention, RoutedMoe
from reference_impls.deepseek_v3 import Router as GroupedRouter
from reference_impls.gpt_oss import Router as TopKRouter
from reference_impls.gpt_oss import SinkAttention
from reference_impls.model import apply_rope
from reference_impls.qwen3 import Qwen3Attention
from reference_impls.qwen3 import Router as SoftmaxRouter
from reference_impls.sliding_window import SlidingWindowCache


class Eager(CompiledDynamicCache):
    """Correct: the dynamic-cache reference with its prefill and decode run eagerly (no dynamo); `decoding` is True
    inside its decode steps (the twins' decode-only bugs read it)."""

    kv_declaration = dataclasses.replace(CompiledDynamicCache.kv_declaration, compiled=False,
                                         description="test engine: dynamic-cache reference, run eagerly")

    def __init__(self, spec):
        super().__init__(spec, compile_backend="eager")
        self.compiled_prefill, self.compiled_decode = compiled_dynamic.prefill, compiled_dynamic.decode
        self.model.decoding = False
        self.patch()

    def patch(self):
        """Where a twin puts its bug into the model."""

    def modules(self, cls):
        return [m for m in self.model.modules() if isinstance(m, cls)]

    def _decode(self, tokens, state):
        self.model.decoding = True
        try:
            return super()._decode(tokens, state)
        finally:
            self.model.decoding = False


def _bind(module, name, function):
    setattr(module, name, types.MethodType(function, module))


# --------------------------------------------------------------------------- latent attention (deepseek-v3)


class LatentHeadsMixedUp(Eager):
    """Bug: kv_b_proj's rows read as [nope + v, heads, latent] instead of [heads, nope + v, latent] when the
    projections are absorbed, so every head up-projects the latent with another head's rows."""

    def patch(self):
        def absorbed(attn):
            w = attn.kv_b_proj.weight.view(attn.nope + attn.v_dim, attn.n_heads, attn.latent).transpose(0, 1)
            return w[:, :attn.nope], w[:, attn.nope:]

        for attn in self.modules(LatentAttention):
            _bind(attn, "absorbed", absorbed)


class LatentRopeKeyOffByOne(Eager):
    """Bug: the shared RoPE key is cached after rotation at the next position (a position counter advanced before
    the write), in every step: each cached key sits one position late."""

    def patch(self):
        def forward(attn, x, rope, mask, cache, layer):
            b, t, _ = x.shape
            q_nope, q_rope = attn.queries(x)
            latent, k_rope = attn.latents(x)
            q_rope, k_rope = _deinterleave(attn, q_rope), _deinterleave(attn, k_rope)
            cos, sin = rope
            late = _rotated_by(cos, sin, self.model, 1)
            q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, *late)
            latent, k_rope = cache.update(layer, latent, k_rope)
            out = attn.attend_latent(q_nope, q_rope, latent, k_rope, mask)
            return attn.o_proj(out.reshape(b, t, attn.n_heads * attn.v_dim))

        for attn in self.modules(LatentAttention):
            _bind(attn, "forward", forward)


def _deinterleave(attn, x):
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if attn.interleaved else x


def _rotated_by(cos, sin, model, offset: int):
    """cos, sin of the angles `offset` positions further (the addition rule on the tables' own angles)."""
    inv_freq, _ = next(iter(model.rope.values()))
    step = torch.cat((inv_freq, inv_freq)) * offset
    c, s = step.cos().to(cos.dtype), step.sin().to(cos.dtype)
    return cos * c - sin * s, sin * c + cos * s


# --------------------------------------------------------------------------- attention sinks (gpt-oss)


class SinksOmitted(Eager):
    """Bug: the sink logit left out of the softmax (a kernel without sink support), every key's weight too high."""

    def patch(self):
        def attend(attn, q, k, v, mask):
            groups = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = (q @ k.transpose(-1, -2) * attn.head_dim ** -0.5).masked_fill(~mask, float("-inf"))
            return F.softmax(scores, dim=-1, dtype=scores.dtype).to(v.dtype) @ v

        for attn in self.modules(SinkAttention):
            _bind(attn, "attend", attend)


class SinksAfterSoftmax(Eager):
    """Bug: the sink applied after the softmax, as a gate sigmoid(-sink) on the keys' weights, not as a column of
    the softmax (it then takes the same share at every query)."""

    def patch(self):
        def attend(attn, q, k, v, mask):
            groups = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = (q @ k.transpose(-1, -2) * attn.head_dim ** -0.5).masked_fill(~mask, float("-inf"))
            probs = F.softmax(scores, dim=-1, dtype=scores.dtype) * torch.sigmoid(-attn.sinks).view(1, -1, 1, 1)
            return probs.to(v.dtype) @ v

        for attn in self.modules(SinkAttention):
            _bind(attn, "attend", attend)


class SlidingSinksWindowOneTooWide(SlidingWindowCache):
    """Bug (SGLang #34273): sliding layers with sinks keep W + 1 keys, one key too wide."""

    kv_declaration = dataclasses.replace(SlidingWindowCache.kv_declaration,
                                         description="test engine: ring buffers one key too wide")

    def __init__(self, spec):
        super().__init__(spec, compile_backend="eager")
        self.model.window += 1


# --------------------------------------------------------------------------- partial RoPE (phi3), qk-norm (qwen3)


class PartialRotaryOnWholeHead(Eager):
    """Bug (vLLM #51049's class): RoPE over the whole head where the model rotates only part of it."""

    def patch(self):
        head_dim, theta = self.model.layers[0].self_attn.head_dim, self.spec.config.rope_parameters["rope_theta"]
        whole = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=self.spec.device) / head_dim)
        self.model.rope = {kind: (whole, 1.0) for kind in self.model.rope}


class QkNormSkippedInDecode(Eager):
    """Bug: the per-head q/k RMSNorm applied in prefill, skipped in the decode step (a fused decode kernel without
    it)."""

    def patch(self):
        model = self.model

        def project(attn, x):
            q, k, v = super(Qwen3Attention, attn).project(x)
            return (q, k, v) if model.decoding else (attn.q_norm(q), attn.k_norm(k), v)

        for attn in self.modules(Qwen3Attention):
            _bind(attn, "project", project)


# --------------------------------------------------------------------------- routing (qwen3-moe, deepseek-v3, gpt-oss)


class TopKNotRenormalised(Eager):
    """Bug: the top-k probabilities used as they are where the model renormalises them (norm_topk_prob)."""

    def patch(self):
        for router in self.modules(SoftmaxRouter):
            router.renormalise = False


class SoftmaxBeforeTopK(Eager):
    """Bug on GPT-OSS (top k logits, then a softmax over those k): the softmax over every expert first, the top k of
    those probabilities used unrenormalised (Qwen-style routing where the model says otherwise)."""

    def patch(self):
        def forward(router, x):
            return moe.softmax_top_k(F.linear(x, router.weight, router.bias), router.k, renormalise=False)

        for router in self.modules(TopKRouter):
            _bind(router, "forward", forward)


class CorrectionBiasIgnored(Eager):
    """Bug: DeepSeek's e_score_correction_bias left out of the expert choice."""

    def patch(self):
        for router in self.modules(GroupedRouter):
            router.e_score_correction_bias.zero_()


class CorrectionBiasInWeights(Eager):
    """Bug: the correction bias applied to the routing weights too (it only steers the choice)."""

    def patch(self):
        def forward(router, x):
            logits = F.linear(x.float(), router.weight.float())
            bias = router.e_score_correction_bias.float()
            weights = moe.grouped_sigmoid(logits, bias, router.k, router.groups, router.top_groups,
                                          router.renormalise, router.scale)
            chosen = weights != 0
            biased = (logits.sigmoid() + bias).masked_fill(~chosen, 0.0)
            return biased / (biased.sum(dim=-1, keepdim=True) + 1e-20) * router.scale

        for router in self.modules(GroupedRouter):
            _bind(router, "forward", forward)


class GroupLimitIgnored(Eager):
    """Bug: the top k taken over every expert, not within the topk_group best groups."""

    def patch(self):
        for router in self.modules(GroupedRouter):
            router.top_groups = router.groups


class SharedExpertDropped(Eager):
    """Bug: the shared expert not added (an expert-parallel path that runs routed experts only)."""

    def patch(self):
        def forward(block, x):
            flat = x.reshape(-1, x.size(-1))
            return block.experts(flat, block.gate(flat)).view_as(x)

        for block in self.modules(RoutedMoe):
            _bind(block, "forward", forward)


class ExpertCapacityDropsTokens(Eager):
    """Bug: an expert capacity (capacity factor 1.0: tokens x k / experts per expert and forward) drops the tokens
    over it, as training-style MoE layers do: a long prompt's later tokens lose experts in prefill."""

    def patch(self):
        def forward(router, x):
            weights = SoftmaxRouter.forward(router, x)
            chosen = (weights != 0).long()
            capacity = (chosen.sum() // weights.size(-1)).clamp(min=1)  # tokens x k / experts, as a tensor
            return weights.masked_fill(chosen.cumsum(dim=0) > capacity, 0.0)

        for router in self.modules(SoftmaxRouter):
            _bind(router, "forward", forward)


# The roles of this module's engines (tests/test_tiers.py): each twin must fail on its model; Eager is the twins'
# base (the built-in reference is what the tests hold to passing).
# --------------------------------------------------------------------------- a KV cache stored lower (llama.cpp's f16)


class KVFloat16(Eager):
    """Correct under its declaration: the reference with its K/V cache stored as float16 after each forward (the
    forward itself attends to its own keys unrounded, as a prefill kernel writing its cache as it goes does),
    declared kv_cache_dtype='float16' (llama.cpp's default cache)."""

    kv_declaration = dataclasses.replace(Eager.kv_declaration, kv_cache_dtype="float16",
                                         description="test engine: dynamic-cache reference, K/V stored as float16")

    def _prefill(self, prompts):
        logits, state = super()._prefill(prompts)
        return logits, self._stored(state)

    def _decode(self, tokens, state):
        logits, state = super()._decode(tokens, state)
        return logits, self._stored(state)

    @staticmethod
    def _stored(state):
        return state._replace(cache=[tuple(t.half().to(t.dtype) for t in kv) if isinstance(kv, tuple) else kv
                                     for kv in state.cache])


class TopKNotRenormalisedHalfKV(KVFloat16, TopKNotRenormalised):
    """Bug twin of a KV cache declared float16: the top-k probabilities not renormalised (its routing near ties are
    followed within the float16 cache's router noise; this bug moves every routing weight)."""


class ExpertCapacityDropsTokensHalfKV(KVFloat16, ExpertCapacityDropsTokens):
    """Bug twin of a KV cache declared float16: an expert capacity that drops a long prompt's later tokens."""


MUST_FAIL = ("LatentHeadsMixedUp", "LatentRopeKeyOffByOne", "SinksOmitted", "SinksAfterSoftmax",
             "SlidingSinksWindowOneTooWide", "PartialRotaryOnWholeHead", "QkNormSkippedInDecode",
             "TopKNotRenormalised", "SoftmaxBeforeTopK", "CorrectionBiasIgnored", "CorrectionBiasInWeights",
             "GroupLimitIgnored", "SharedExpertDropped", "ExpertCapacityDropsTokens", "TopKNotRenormalisedHalfKV",
             "ExpertCapacityDropsTokensHalfKV")
MUST_PASS = ("KVFloat16",)
MUST_SKIP: tuple[str, ...] = ()
HELPERS = ("Eager",)
