"""Reference engine: a gpt-fast-style Llama whose KV cache really DROPS entries, under torch.compile.

The rules are the checker's (`pytest_kvcompile/oracles/eviction.py`: last_recent, streaming_llm, h2o,
tova; its `order` ranks, its policies score); this module is the cache, `EvictingCache`, in the layer
loop of `reference_impls/model.py`. Per layer and KV head a fixed buffer of `budget` slots holds keys and
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
queries add nothing to the scores.

`StreamingLLMShifted` (``streaming_llm(..., positions="shifted")``, the paper's pos-shift) stores keys BEFORE
RoPE and rotates them at attention time by their rank among the step's candidates (kept slots + new, by
original position; empty slots and pads excluded); each query is rotated by its own key's rank.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pytest_kvcompile.contract.engine import (
    Declaration,
    KVLayout,
    ModelNotSupported,
    ModelSpec,
    Strategy,
    declaration_of,
)
from pytest_kvcompile.oracles.eviction import EMPTY, Policy, order, policy_for
from pytest_kvcompile.recompiles.hooks import mark_unbacked, torch_check
from reference_impls.compile import compile_fresh, left_pad
from reference_impls.engine import Engine
from reference_impls.loader import load_model
from reference_impls.model import FULL, KVCache, apply_rope, rope_cos_sin


class EvictingCache(KVCache):
    """One step over the buffers, layer by layer: `update` appends the step's keys and values to the layer's
    kept entries (the candidates), then `attend` computes the attention weights explicitly (no SDPA: the policy
    scores by them), scores the candidates and lets `evict` make them the layer's new buffer.

    buffers: per layer (keys, values [b, kv_heads, slots, d], positions [b, kv_heads, slots], scores); pos [b, t]
    the step's positions (-1: padding); rope = (inv_freq fp32, scaling), for the pos-shift.
    """

    def __init__(self, policy: Policy, rope, buffers, pos, evict):
        self.policy, self.rope, self.buffers, self.pos, self.evict = policy, rope, list(buffers), pos, evict
        self.keys_rotated = getattr(policy, "positions", "original") != "shifted"
        self.newest = pos[:, -1, None, None]  # left padding: the last token of every row is real
        self.real_query = (pos >= 0)[:, None, None, :, None]

    def update(self, layer, k, v):
        keys, values, slot_pos, score = self.buffers[layer]
        b, t, kv_heads, _ = k.shape
        slots = keys.size(2)
        keys, values = torch.cat((keys, k.transpose(1, 2)), dim=2), torch.cat((values, v.transpose(1, 2)), dim=2)
        cand = torch.cat((slot_pos, self.pos[:, None].expand(b, kv_heads, t)), dim=-1)  # [b, kv_heads, slots + t]
        idx = torch.arange(cand.size(-1), device=cand.device)
        own = idx == slots + torch.arange(t, device=cand.device)[:, None]  # every query sees itself
        visible = ((cand[:, :, None] >= 0) & (cand[:, :, None] <= self.pos[:, None, :, None])) | own
        self.candidates = slots, cand, F.pad(score, (0, t)), visible  # for `attend`, next
        return keys, values

    def attend(self, layer, attn, q, keys, values, mask):
        """q [b, t, heads, d]; keys, values [b, kv_heads, n, d] -> [b, t, heads, d]. `mask` is unused: the
        candidates' positions decide what each query sees, per KV head."""
        slots, cand, score, visible = self.candidates
        b, t, heads, d = q.shape
        kv_heads = keys.size(1)
        q = q.transpose(1, 2).view(b, kv_heads, heads // kv_heads, t, d)
        attend_keys = keys
        if not self.keys_rotated:  # pos-shift: rotate by rank among the real candidates, each query by its key's
            rank = ((cand[:, :, None, :] >= 0) & (cand[:, :, None, :] < cand[..., None])).sum(-1)
            k_cos, k_sin = rope_cos_sin(rank, self.rope, q.dtype)  # [b, kv_heads, slots + t, d]
            q = apply_rope(q, k_cos[:, :, None, slots:], k_sin[:, :, None, slots:])
            attend_keys = apply_rope(keys, k_cos, k_sin)
        logits = (q @ attend_keys[:, :, None].transpose(-1, -2)) * d**-0.5
        weights = logits.masked_fill(~visible[:, :, None], -torch.inf).softmax(dim=-1, dtype=torch.float32)
        out = weights.to(values.dtype) @ values[:, :, None]  # [b, kv_heads, group, t, d]
        score = self.policy.score(score, weights * self.real_query, cand)
        self.buffers[layer] = self.evict(self.policy, (keys, values, cand, score), self.newest)
        return out.reshape(b, heads, t, d).transpose(1, 2)


def _gather_kept(policy: Policy, entries, newest):
    """Prefill: the first `budget` candidates in the policy's order, padded with empty slots.

    The first `budget` of the order are gathered, not sliced (`keep`): a slice of a size derived from an unbacked
    one (prompt + budget) fails inductor's lowering on CUDA in torch < 2.12 (`KeyError: 'unbacked_bindings'`,
    pytorch#174340; docs/gpu-results.md, finding 2)."""
    keys, values, pos, score = entries
    pad = policy.budget
    keys, values = F.pad(keys, (0, 0, 0, pad)), F.pad(values, (0, 0, 0, pad))
    pos, score = F.pad(pos, (0, pad), value=EMPTY), F.pad(score, (0, pad))
    ranked = order(pos, score, policy.protected(pos, newest))
    kept = ranked.gather(-1, torch.arange(pad, device=pos.device).expand(*ranked.shape[:-1], pad))
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


def step(model, policy: Policy, tokens, pos, buffers, evict):
    """Run new tokens [b, t] at positions pos [b, t] (-1: padding) over the per-layer `buffers`; `evict` turns each
    layer's candidates into its new buffer. Returns the last position's logits [b, vocab] and the new buffers."""
    cache = EvictingCache(policy, model.rope[FULL], buffers, pos, evict)
    return model.run(tokens, pos.clamp(min=0), {FULL: None}, cache), cache.buffers


def prefill(model, policy, tokens, valid):
    b, t = tokens.shape
    torch_check(t >= 2)  # one pad column at least (`_prefill`): see there
    torch_check(valid.size(0) == b)
    torch_check(valid.size(1) == t)
    pos = torch.where(valid, valid.long().cumsum(-1) - 1, EMPTY)
    attn = model.model.layers[0].self_attn
    empty = model.lm_head.weight.new_zeros(b, attn.n_kv_heads, 0, attn.head_dim)
    buffers = [(empty, empty, pos.new_zeros(b, attn.n_kv_heads, 0),
                pos.new_zeros(b, attn.n_kv_heads, 0, dtype=torch.float)) for _ in model.layers]
    logits, buffers = step(model, policy, tokens, pos, buffers, _gather_kept)
    return logits, valid.sum(-1), buffers


def decode(model, policy, tokens, length, buffers):
    b = tokens.size(0)
    torch_check(length.size(0) == b)
    for x in (x for layer in buffers for x in layer):
        torch_check(x.size(0) == b)
    logits, buffers = step(model, policy, tokens, length[:, None], buffers, _evict_one)
    return logits, length + 1, buffers


class EvictionState(NamedTuple):
    length: torch.Tensor  # [b] real tokens so far: the next position
    cache: list[tuple[torch.Tensor, ...]]  # per layer (keys, values, positions, scores), `EvictingCache`


class EvictionEngine(Engine):
    """Greedy generation over a KV cache of `budget` slots per layer and KV head, evicting by the
    policy its declaration's strategy names. Subclass with another `kv_declaration` for other parameters."""

    kv_declaration: Declaration

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor"):
        if spec.config.model_type != "llama":
            raise ModelNotSupported(f"{type(self).__name__} implements Llama only, not '{spec.config.model_type}'")
        self.spec = spec
        self.policy = policy_for(declaration_of(type(self)).strategy)
        self.model = load_model(spec)
        self.compiled_prefill = compile_fresh(prefill, compile_backend)
        self.compiled_decode = compile_fresh(decode, compile_backend)
        self.cache: list[tuple[torch.Tensor, ...]] = []  # the last generate's buffers

    def _prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, EvictionState]:
        # One extra pad column, so the compiled prefill never sees a 1-column batch: inductor's CPU bmm lowering
        # asks whether an unbacked size equals 1 and cannot answer (GuardOnDataDependentSymNode, torch 2.13).
        tokens, valid = (F.pad(x, (1, 0)) for x in left_pad(prompts, self.spec.device))
        for x in (tokens, valid):
            mark_unbacked(x, 0)
            mark_unbacked(x, 1)
        logits, length, cache = self.compiled_prefill(self.model, self.policy, tokens, valid)
        return logits, EvictionState(length, cache)

    def _decode(self, tokens: torch.Tensor, state: EvictionState) -> tuple[torch.Tensor, EvictionState]:
        tokens = tokens[:, None]
        for x in (tokens, state.length, *(x for layer in state.cache for x in layer)):
            mark_unbacked(x, 0)
        logits, length, cache = self.compiled_decode(self.model, self.policy, tokens, state.length, state.cache)
        return logits, EvictionState(length, cache)

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
