"""Reference engine: a gpt-fast-style Llama whose KV cache really DROPS entries, under torch.compile.

The rules live in `reference_impls/eviction.py` (last_recent, streaming_llm, h2o, tova); this
module is the cache. Per layer and KV head a fixed buffer of `budget` slots holds keys and
values (after RoPE: never re-rotated; but see `StreamingLLMShifted` below), each slot's original
position (-1 = empty) and its score.

- prefill (batch and prompt length dynamic, `mark_unbacked`): full causal attention over the
  prompt with explicit weights (no SDPA: the policy needs the weights), then the first `budget`
  candidates in the policy's order are gathered into the buffer (a short prompt leaves slots empty);
- decode (batch dynamic, everything else static): the new token attends over the buffer plus
  itself, the policy ranks the `budget + 1` candidates, and the new key is scattered into the
  slot of the evicted one (nothing is written when the new token itself is evicted).

So each engine compiles twice, once per function, and never again: the buffer's shape never
changes. Batches are left-padded; pads get position -1 (never attended, never kept) and their
queries add nothing to the scores. The model pieces and weight loading are those of
`reference_impls/compiled_dynamic.py`.

`StreamingLLMShifted` (``streaming_llm(..., positions="shifted")``, the paper's pos-shift) stores keys BEFORE
RoPE and rotates them at attention time by their rank among the step's candidates (kept slots + new, by
original position; empty slots and pads excluded); each query is rotated by its own key's rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._dynamo.decorators import mark_unbacked

from pytest_kvcompile.contract.engine import Declaration, ModelNotSupported, ModelSpec, Strategy, declaration_of
from pytest_kvcompile.memory.measure import KVLayout
from reference_impls.compiled_dynamic import compile_fresh, load_model, rope_inv_freq, rotate_half
from reference_impls.eviction import EMPTY, Policy, keep, order, policy_for


def _rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def _cos_sin(pos, rope, dtype):
    """RoPE tables at positions `pos` [...] (clamped at 0): cos, sin [..., d] in `dtype`; rope = (inv_freq, scaling)."""
    freqs = pos.clamp(min=0)[..., None].float() * rope[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * rope[1]).to(dtype), (emb.sin() * rope[1]).to(dtype)


def _attention(q, keys, values, visible):
    """Explicit softmax attention. q [b, heads, t, d]; keys, values [b, kv_heads, n, d];
    visible [b, kv_heads, 1, t, n]. Returns out [b, t, heads * d] and weights [b, kv_heads, group, t, n] (fp32)."""
    b, heads, t, d = q.shape
    q = q.view(b, keys.size(1), heads // keys.size(1), t, d)
    logits = (q @ keys[:, :, None].transpose(-1, -2)) * d**-0.5
    weights = logits.masked_fill(~visible, -torch.inf).softmax(dim=-1, dtype=torch.float32)
    out = weights.to(values.dtype) @ values[:, :, None]
    return out.reshape(b, heads, t, d).transpose(1, 2).reshape(b, t, heads * d), weights


def _forward(model, policy: Policy, rope, tokens, pos, cache, evict):
    """Run new tokens [b, t] at positions pos [b, t] (-1: padding) over the per-layer buffers
    `cache` [(keys, values, slot_pos, score)]; `evict` turns each layer's candidates into its new
    buffer. rope = (inv_freq fp32, scaling). Returns the last position's logits [b, vocab] and the new buffers."""
    b, t = tokens.shape
    x = model.model.embed_tokens(tokens)
    shifted = getattr(policy, "positions", "original") == "shifted"
    cos, sin = _cos_sin(pos[:, None], rope, x.dtype)  # [b, 1, t, d]
    newest = pos[:, -1, None, None]  # left padding: the last token of every row is real
    real_query = (pos >= 0)[:, None, None, :, None]
    new_cache = []
    for layer, (keys, values, slot_pos, score) in zip(model.model.layers, cache):
        attn, h = layer.self_attn, layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, t, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(b, t, -1, attn.head_dim).transpose(1, 2)
        if not shifted:  # keys cached after RoPE at their original positions
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        v = attn.v_proj(h).view(b, t, -1, attn.head_dim).transpose(1, 2)
        kv_heads, slots = k.size(1), keys.size(2)
        keys, values = torch.cat((keys, k), dim=2), torch.cat((values, v), dim=2)
        cand = torch.cat((slot_pos, pos[:, None].expand(b, kv_heads, t)), dim=-1)  # [b, kv_heads, slots + t]
        idx = torch.arange(cand.size(-1), device=cand.device)
        own = idx == slots + torch.arange(t, device=cand.device)[:, None]  # every query sees itself
        visible = ((cand[:, :, None] >= 0) & (cand[:, :, None] <= pos[:, None, :, None])) | own
        if shifted:  # pos-shift: rotate by rank among the real candidates, each query by its own key's rank
            rank = ((cand[:, :, None, :] >= 0) & (cand[:, :, None, :] < cand[..., None])).sum(-1)
            k_cos, k_sin = _cos_sin(rank, rope, x.dtype)  # [b, kv_heads, slots + t, d]
            group = q.size(1) // kv_heads
            q = _rope(q.view(b, kv_heads, group, t, -1), k_cos[:, :, None, slots:], k_sin[:, :, None, slots:])
            q, attend_keys = q.view(b, kv_heads * group, t, -1), _rope(keys, k_cos, k_sin)
        else:
            attend_keys = keys
        out, weights = _attention(q, attend_keys, values, visible[:, :, None])
        score = policy.score(F.pad(score, (0, t)), weights * real_query, cand)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        new_cache.append(evict(policy, (keys, values, cand, score), newest))
    return model.lm_head(model.model.norm(x[:, -1:]))[:, 0], new_cache


def _gather_kept(policy: Policy, entries, newest):
    """Prefill: the first `budget` candidates in the policy's order, padded with empty slots."""
    keys, values, pos, score = entries
    pad = policy.budget
    keys, values = F.pad(keys, (0, 0, 0, pad)), F.pad(values, (0, 0, 0, pad))
    pos, score = F.pad(pos, (0, pad), value=EMPTY), F.pad(score, (0, pad))
    kept = keep(policy, pos, score, newest)
    rows = kept[..., None].expand(*kept.shape, keys.size(-1))
    return keys.gather(2, rows), values.gather(2, rows), pos.gather(2, kept), score.gather(2, kept)


def _write(buffer, new, victim, budget: int):
    """Scatter `new` [b, kv_heads, 1, ...] into slot `victim` [b, kv_heads] of `buffer`; victim == budget
    (the new entry itself is evicted) leaves the buffer as it is."""
    shape = (*victim.shape, 1) + (1,) * (buffer.dim() - 3)
    index = victim.clamp(max=budget - 1).view(shape).expand(*buffer.shape[:2], 1, *buffer.shape[3:])
    return buffer.scatter(2, index, torch.where((victim == budget).view(shape), buffer.gather(2, index), new))


def _evict_one(policy: Policy, entries, newest):
    """Decode: rank the budget + 1 candidates; the last one goes, the new entry takes its slot."""
    pos, score = entries[2], entries[3]
    victim = order(pos, score, policy.protected(pos, newest))[..., -1]
    budget = policy.budget
    return tuple(_write(x[:, :, :budget], x[:, :, budget:], victim, budget) for x in entries)


def prefill(model, policy, rope, tokens, valid):
    b, t = tokens.shape
    torch._check(t >= 2)  # one pad column at least (`_prefill`): see there
    torch._check(valid.size(0) == b)
    torch._check(valid.size(1) == t)
    pos = torch.where(valid, valid.long().cumsum(-1) - 1, EMPTY)
    attn = model.model.layers[0].self_attn
    kv_heads, d = attn.k_proj.out_features // attn.head_dim, attn.head_dim
    empty = model.lm_head.weight.new_zeros(b, kv_heads, 0, d)
    cache = [(empty, empty, pos.new_zeros(b, kv_heads, 0), pos.new_zeros(b, kv_heads, 0, dtype=torch.float))
             for _ in model.model.layers]
    logits, cache = _forward(model, policy, rope, tokens, pos, cache, _gather_kept)
    return logits, valid.sum(-1), cache


def decode(model, policy, rope, tokens, length, cache):
    b = tokens.size(0)
    torch._check(length.size(0) == b)
    for x in (x for layer in cache for x in layer):
        torch._check(x.size(0) == b)
    logits, cache = _forward(model, policy, rope, tokens, length[:, None], cache, _evict_one)
    return logits, length + 1, cache


class EvictionEngine:
    """Greedy generation over a KV cache of `budget` slots per layer and KV head, evicting by the
    policy its declaration's strategy names. Subclass with another `kv_declaration` for other parameters."""

    kv_declaration: Declaration

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor"):
        if spec.config.model_type != "llama":
            raise ModelNotSupported(f"{type(self).__name__} implements Llama only, not '{spec.config.model_type}'")
        self.spec = spec
        self.policy = policy_for(declaration_of(type(self)).strategy)
        self.model = load_model(spec)
        inv_freq, scaling = rope_inv_freq(spec.config)
        self.rope = (inv_freq.to(spec.device), scaling)  # fp32, like transformers
        self.compiled_prefill = compile_fresh(prefill, compile_backend)
        self.compiled_decode = compile_fresh(decode, compile_backend)
        self.cache: list[tuple[torch.Tensor, ...]] = []  # the last generate's buffers

    def _prefill(self, prompts: list[list[int]]):
        if not all(prompts):
            raise ValueError("every prompt needs at least one token")
        # One extra pad column, so the compiled prefill never sees a 1-column batch: inductor's CPU bmm lowering
        # asks whether an unbacked size equals 1 and cannot answer (GuardOnDataDependentSymNode, torch 2.13).
        width, device = max(map(len, prompts)) + 1, self.spec.device
        tokens = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)
        valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts], device=device)
        for x in (tokens, valid):
            mark_unbacked(x, 0)
            mark_unbacked(x, 1)
        return self.compiled_prefill(self.model, self.policy, self.rope, tokens, valid)

    def _decode(self, tokens: torch.Tensor, length: torch.Tensor, cache):
        tokens = tokens[:, None]
        for x in (tokens, length, *(x for layer in cache for x in layer)):
            mark_unbacked(x, 0)
        return self.compiled_decode(self.model, self.policy, self.rope, tokens, length, cache)

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if max_new_tokens <= 0 or not prompts:
            self.cache = []
            return [[] for _ in prompts]
        logits, length, cache = self._prefill(prompts)
        out = [logits.argmax(-1)]
        for _ in range(max_new_tokens - 1):
            logits, length, cache = self._decode(out[-1], length, cache)
            out.append(logits.argmax(-1))
        self.cache = cache
        return torch.stack(out, dim=1).tolist()

    @torch.inference_mode()
    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(continuation), vocab] through the generate path."""
        if not continuation:
            return torch.empty(0, self.spec.vocab_size, dtype=self.spec.dtype, device=self.spec.device)
        logits, length, cache = self._prefill([prompt])
        rows = [logits[0]]
        for token in continuation[:-1]:
            logits, length, cache = self._decode(torch.tensor([token], device=self.spec.device), length, cache)
            rows.append(logits[0])
        return torch.stack(rows)

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer: the positions each row and KV head holds after the last generate, [b, kv_heads, budget]
        sorted ascending (-1 = empty slot)."""
        return [pos.sort(dim=-1).values for _, _, pos, _ in self.cache]

    def kv_cache_bytes(self) -> int:
        """Bytes of the key and value buffers (budget slots per layer and KV head; positions and scores not counted)."""
        return sum(x.numel() * x.element_size() for layer in self.cache for x in layer[:2])


def _declaration(strategy: Strategy, what: str) -> Declaration:
    budget = policy_for(strategy).budget  # slots preallocated per layer, row and KV head
    return Declaration(strategy=strategy, batching=True, scoring=True, kv_cache_bytes=True, compiled=True,
                       kv_layout=KVLayout("static", max_cache_len=budget),
                       description=f"reference: Llama, {what} ({strategy}), fixed buffer, torch.compile")


class LastRecent(EvictionEngine):
    kv_declaration = _declaration(Strategy.of("last_recent", budget=16), "keeps the last 16 tokens")


class StreamingLLM(EvictionEngine):
    kv_declaration = _declaration(Strategy.of("streaming_llm", sinks=4, recent=12), "StreamingLLM sinks + recent")


class H2O(EvictionEngine):
    kv_declaration = _declaration(Strategy.of("h2o", heavy=8, recent=8), "H2O heavy hitters + recent")


class TOVA(EvictionEngine):
    kv_declaration = _declaration(Strategy.of("tova", budget=16), "TOVA, evicts the least attended token")


class StreamingLLMShifted(EvictionEngine):
    kv_declaration = _declaration(Strategy.of("streaming_llm", sinks=4, recent=12, positions="shifted"),
                                  "StreamingLLM sinks + recent, positions re-assigned in the cache (pos-shift)")
