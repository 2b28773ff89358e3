"""Static-cache engines for the project's own tests (tests/test_reference_static_cache.py): the reference
`StaticCache` on the eager compile backend, and variants that each break one half of its reset rule."""

import torch

from pytest_kvcompile import Declaration
from reference_impls.static_cache import StaticCache, StaticCacheCudaGraph, StaticLlama


class StaticEager(StaticCache):
    """Correct: the reference engine, compiled with the eager backend (fast on CPU)."""

    def __init__(self, spec):
        super().__init__(spec, compile_backend="eager")


class Stale(StaticEager):
    """Bug: never resets, like a cache position kept between calls: each prompt is fed through the decode
    step after the previous call's last slot, so the buffer and valid mask of earlier calls stay in context."""

    kv_declaration = Declaration(description="test engine: static cache never reset")
    next_slot = 0

    def _prefill(self, prompts, steps):
        (prompt,) = prompts
        for token in prompt:
            tokens = torch.full((self.max_batch_size,), token, device=self.spec.device)
            logits = self._decode(tokens, torch.tensor([self.next_slot], device=self.spec.device))
            self.next_slot += 1
        width, self.next_slot = self.next_slot, self.next_slot + steps - 1
        return logits, width


class KeepsValidLlama(StaticLlama):
    def reset(self, pad, width):
        earlier = self.valid.clone()
        super().reset(pad, width)
        self.valid |= earlier  # bug: slots marked by earlier calls stay visible


class StaleValid(StaticEager):
    """Bug: the reset ORs the new valid mask into the old one, so left-pad slots of a batched row can show
    slots an earlier call marked (zeroed, but visible)."""

    model_class = KeepsValidLlama


class NoZeroLlama(StaticLlama):
    def reset(self, pad, width):
        earlier = [(cache.k.clone(), cache.v.clone()) for cache in self.caches]
        super().reset(pad, width)
        for cache, (k, v) in zip(self.caches, earlier):  # bug: K/V keep what earlier calls left
            cache.k.copy_(k)
            cache.v.copy_(v)


class NoZero(StaticEager):
    """Bug: the reset does not zero K/V: a non-finite value an earlier call left in a masked slot turns its
    zero attention weight into NaN."""

    model_class = NoZeroLlama


class LeakyGraph(StaticCacheCudaGraph):
    """Bug: captures a new CUDA graph (new static buffers) on every call and keeps the old ones."""

    def __init__(self, spec):
        super().__init__(spec, compile_backend="eager")
        self.old_graphs = []

    def _prefill(self, prompts, steps):
        self.old_graphs.append((self.graph, self.static_tokens, self.static_logits))
        self._capture(warmup=1)
        return super()._prefill(prompts, steps)
