"""Reference engine: compiled_dynamic.py's engine with chunked prefill, the state caches' reference.

A prompt goes in `CHUNK` tokens at a time (vLLM's and SGLang's chunked prefill, transformers' `prefill_chunk_size`):
the first chunk through `prefill`, every later chunk through the same compiled `decode` graph as the one-token decode
steps (its new-token count unbacked like the rest), over the K/V and recurrent states the earlier chunks left. So a
chunk boundary falls inside a hybrid model's conv window (its last K-1 inputs cross into the next chunk) and a
state is carried from chunk to chunk, as an engine serving long prompts must; on a model without recurrent layers it
is chunked prefill over a growing K/V cache. Left padding: a padded row's first chunks may be pads alone, which
reach neither its keys (masked) nor its states (bamba.py, qwen3_next.py: a pad adds nothing to a state).

Two compiles, as compiled_dynamic.py: `prefill` (the first chunk) and `decode` (every later chunk and every step).
"""

from __future__ import annotations

import dataclasses

import torch

from pytest_kvcompile.recompiles.hooks import mark_unbacked
from reference_impls.compile import fresh, left_pad, mark_dynamic
from reference_impls.compiled_dynamic import CompiledDynamicCache, DynamicState

CHUNK = 16  # tokens per prefill chunk: the suites' prompts (1 to ~1000 tokens) split unevenly


class ChunkedPrefill(CompiledDynamicCache):
    """Greedy generation with a growing KV cache and recurrent states; prompts prefilled `chunk` tokens at a time."""

    kv_declaration = dataclasses.replace(
        CompiledDynamicCache.kv_declaration,
        description=f"reference: compiled dynamic cache with chunked prefill ({CHUNK} tokens a chunk, the later chunks "
        "through the decode graph), recurrent states (Mamba2 and Gated DeltaNet hybrids) carried across chunks beside "
        "the K/V",
    )

    def __init__(self, spec, *, compile_backend: str = "inductor", chunk: int = CHUNK):
        super().__init__(spec, compile_backend=compile_backend)
        self.chunk = chunk

    def _prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, DynamicState]:
        tokens, valid = left_pad(prompts, self.spec.device)
        first, seen = fresh(tokens[:, :self.chunk]), fresh(valid[:, :self.chunk])
        mark_dynamic(first, seen)
        logits, cache = self.compiled_prefill(self.model, first, seen)
        for start in range(self.chunk, tokens.size(1), self.chunk):
            end = min(start + self.chunk, tokens.size(1))
            logits, cache = self._extend(fresh(tokens[:, start:end]), fresh(valid[:, :end]), cache)
        return logits, DynamicState(valid, cache)

    def _decode(self, tokens: torch.Tensor, state: DynamicState) -> tuple[torch.Tensor, DynamicState]:
        valid = torch.cat((state.valid, state.valid.new_ones(tokens.size(0), 1)), dim=1)
        logits, cache = self._extend(tokens[:, None], valid, state.cache)
        return logits, DynamicState(valid, cache)

    def _extend(self, tokens, valid, cache):
        """t new tokens [b, t] (a chunk or one step) after the cache: one graph whatever t."""
        mark_dynamic(tokens, valid, cache)
        mark_unbacked(tokens, 1)
        return self.compiled_decode(self.model, tokens, valid, cache)
