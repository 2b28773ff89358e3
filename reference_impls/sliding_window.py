"""Reference engine: every sliding-window layer keeps its KV in a fixed-size ring buffer, under torch.compile.

The rule (`zoo.attention_window`; transformers' `create_sliding_window_causal_mask`, Mistral and
Gemma3 alike): in a sliding layer of window W, a query at position q sees key k iff
``q - W < k <= q`` -- itself and the W - 1 keys before it. So between steps a sliding layer needs
only the last W - 1 keys: its cache is a ring of exactly W slots per row (W - 1 past keys plus
one for the current key), K and V [batch, W, kv_heads, head_dim]. Every step replaces the ring
with one of the same shape, never a longer one, so a sliding layer holds the same bytes for a
1-token and a 10,000-token sequence.

Ring rule: position p lives in slot ``p % W`` (it overwrites p - W, which no query from p on
sees), so slot s holds the newest position ``p <= last`` with ``p % W == s``:
``p = last - ((last - s) % W)``. `ring_pos` [batch, W] records the absolute position each slot
holds (-1: empty); masks come from these stored positions, never from slot order. Full-attention
layers (Gemma3's global ones) keep a growing cache, as in `compiled_dynamic` (`model.GrowingCache`).

One compiled function, `step`, is prefill, chunked prefill and decode alike: the t new tokens
attend to cat(ring, new) [W + t keys] in sliding layers (cat(past, new) in full layers), then the
last W positions of cat(ring, new) become the new ring (a gather: static shape [batch, W]; for a
decode step it writes exactly slot pos % W). Batch, t and the full-layer cache length are
`mark_unbacked`; W is a constant and positions are tensors, so crossing the window changes no
shape and trips no guard: one compile, then none.

Batches are left-padded, as in `compiled_dynamic`: pads are never written to a ring, and in full
layers key j of a row holds position j - (its pad count), so pads have negative positions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pytest_kvcompile.contract.engine import Declaration, KVLayout, ModelSpec
from pytest_kvcompile.models.zoo import sliding_layers
from pytest_kvcompile.recompiles.hooks import mark_unbacked, torch_check
from reference_impls.compile import compile_fresh, left_pad
from reference_impls.engine import Engine
from reference_impls.loader import load_model
from reference_impls.model import (
    FULL,
    SLIDING,
    GrowingCache,
    UnsupportedModel,
    attention_mask,
)


class RingState(NamedTuple):
    length: torch.Tensor  # [b] real tokens seen so far: the next token's position
    ring_pos: torch.Tensor  # [b, W] absolute position held by each ring slot, -1 when empty
    cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v): ring [b, W, ...] or full [b, n, ...]


def ring_sources(length, new_length, ring_pos, window: int, t: int):
    """Where the new ring comes from: (index into cat(ring, chunk) [b, W], new ring_pos [b, W]).

    After the chunk the newest position is last = new_length - 1 and slot s must hold
    p = last - back, back = (last - s) % W. If p is one of this chunk's real tokens
    (back < new_length - length) it sits at chunk index t - 1 - back (pads are on the left), i.e.
    W + t - 1 - back in cat(ring, chunk); otherwise the slot keeps what it holds (index s).
    """
    slots = torch.arange(window, device=length.device)
    last = (new_length - 1)[:, None]
    back = (last - slots) % window
    take = back < (new_length - length)[:, None]
    return torch.where(take, window + t - 1 - back, slots), torch.where(take, last - back, ring_pos)


def gather_ring(x, src):
    """cat(ring, chunk) [b, W + t, kv_heads, d] -> the new ring [b, W, kv_heads, d] (src from `ring_sources`)."""
    return x.gather(1, src[:, :, None, None].expand(-1, -1, x.size(2), x.size(3)))


def step(model, tokens, valid, state: RingState):
    """Run a chunk of t tokens per row (tokens, valid [b, t], pads on the left only).

    Returns the last position's logits [b, vocab] and the state after the chunk.
    """
    b, t = tokens.shape
    window, length, ring_pos = model.window, state.length, state.ring_pos
    full = [kv for kv, kind in zip(state.cache, model.layer_types) if kind == FULL]
    past = full[0][0].size(1) if full else 0
    # Tie the dynamic sizes: one batch, one full-cache length.
    torch_check(t >= 1)
    for x in (valid, length, ring_pos, *(x for kv in state.cache for x in kv)):
        torch_check(x.size(0) == b)
    for x in (x for kv in full for x in kv):
        torch_check(x.size(1) == past)

    new_length = length + valid.sum(-1)
    pos = length[:, None] + valid.long().cumsum(-1) - 1  # the chunk's positions (real tokens)
    ring_keys = torch.cat((ring_pos, torch.where(valid, pos, -1)), dim=1)  # positions of cat(ring, chunk)
    full_keys = torch.arange(past + t, device=tokens.device) - (past + t - new_length)[:, None]
    q_pos = pos.clamp(min=0)  # a pad query's position is arbitrary: its row is never read
    masks = {
        SLIDING: attention_mask(q_pos, ring_keys, ring_keys >= 0, window),
        FULL: attention_mask(q_pos, full_keys, full_keys >= 0),
    }
    kvs = GrowingCache(state.cache)  # each layer attends over cat(ring or past, chunk)
    logits = model.run(tokens, q_pos, masks, kvs)

    src, ring_pos = ring_sources(length, new_length, ring_pos, window, t)
    cache = [(gather_ring(k, src), gather_ring(v, src)) if kind == SLIDING else (k, v)
             for (k, v), kind in zip(kvs.layers, model.layer_types)]
    return logits, RingState(new_length, ring_pos, cache)


def mark_dynamic(tokens, valid, state: RingState, layer_types: list[str]) -> None:
    """Batch, chunk length and full-cache length vary (unbacked: sizes 0 and 1 are not specialised)."""
    for x in (tokens, valid, state.length, state.ring_pos):
        mark_unbacked(x, 0)
    mark_unbacked(tokens, 1)
    mark_unbacked(valid, 1)
    for (k, v), kind in zip(state.cache, layer_types):
        for x in (k, v):
            mark_unbacked(x, 0)
            if kind == FULL:
                mark_unbacked(x, 1)


class SlidingWindowCache(Engine):
    """Greedy generation with ring-buffer sliding layers (W slots each) and growing full layers.

    `prefill_chunk`: run prompts in chunks of this many tokens (same compiled step; None: one chunk).
    """

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_cache_bytes=True,
        kv_layout=KVLayout("dynamic", extra_positions=1),  # W-slot rings; full layers hold one pad key (`_empty`)
        compiled=True,
        description="reference: sliding layers in fixed W-slot ring buffers (memory bounded by the window), "
        "full layers growing; one torch.compile graph",
    )

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor", prefill_chunk: int | None = None):
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive number of tokens or None, got {prefill_chunk!r}")
        if not sliding_layers(spec.config):
            raise UnsupportedModel(
                f"SlidingWindowCache: model '{spec.name}' (model_type '{spec.config.model_type}') has no "
                "sliding-window layers (no config.sliding_window, or layer_types without 'sliding_attention'), "
                "so a ring buffer bounds nothing; serve it with reference_impls.compiled_dynamic:CompiledDynamicCache"
            )
        self.spec = spec
        self.model = load_model(spec)
        self.prefill_chunk = prefill_chunk
        self.compiled_step = compile_fresh(step, compile_backend)
        self.cache = []

    def _empty(self, batch: int) -> RingState:
        """Nothing seen: empty rings (positions -1), and full caches holding one left pad key.

        The pad key is masked like any left pad (its position is negative); it keeps full caches
        non-empty, because dynamo guards a length-0 cache's strides as constants (torch gives dim 0
        stride h * d, not 0 * h * d), which would compile a second graph for the first decode step.
        """
        attn, device, dtype = self.model.model.layers[0].self_attn, self.spec.device, self.spec.dtype
        sizes = {SLIDING: self.model.window, FULL: 1}
        cache = [
            tuple(torch.zeros(batch, sizes[kind], attn.n_kv_heads, attn.head_dim, dtype=dtype, device=device)
                  for _ in "kv")
            for kind in self.model.layer_types
        ]
        length = torch.zeros(batch, dtype=torch.long, device=device)
        return RingState(length, torch.full((batch, self.model.window), -1, device=device), cache)

    def _step(self, tokens, valid, state: RingState):
        # Fresh row-major strides: a [1, t] chunk sliced from a wider prompt is "contiguous" to torch
        # yet keeps stride (width, 1), which would fail the compiled graph's stride guard.
        tokens = tokens.clone(memory_format=torch.contiguous_format)
        valid = valid.clone(memory_format=torch.contiguous_format)
        mark_dynamic(tokens, valid, state, self.model.layer_types)
        return self.compiled_step(self.model, tokens, valid, state)

    def _prefill(self, prompts: list[list[int]]):
        tokens, valid = left_pad(prompts, self.spec.device)
        state = self._empty(len(prompts))
        chunk = self.prefill_chunk or tokens.size(1)
        for part, part_valid in zip(tokens.split(chunk, dim=1), valid.split(chunk, dim=1)):
            logits, state = self._step(part, part_valid, state)
        return logits, state

    def _decode(self, tokens: torch.Tensor, state: RingState):
        """Feed one token per row (tokens [b]) through the same step."""
        return self._step(tokens[:, None], torch.ones_like(tokens, dtype=torch.bool)[:, None], state)

    def kv_cache_bytes(self) -> int:
        """Bytes of the K/V tensors the last generate left: W slots per row in each sliding layer (whatever
        the length), 1 + prompt width + new tokens - 1 positions per row in each full layer (see `_empty`).
        The [b, W] ring positions and [b] lengths (int64) are bookkeeping, not counted."""
        return super().kv_cache_bytes()
