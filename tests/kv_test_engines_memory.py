"""Engines for the memory checks (suites/test_kv_memory.py): one correct, and one bug each check must catch."""

import inspect

import torch
from transformers import DynamicCache

from kv_test_engines import Greedy
from pytest_kvcompile import Declaration, KVLayout
from pytest_kvcompile.memory.measure import cache_tensors, held_bytes


class DynamicBytes(Greedy):
    """Correct: a fresh DynamicCache per prompt; kv_cache_bytes() = the storages the last one holds."""

    kv_declaration = Declaration(scoring=True, kv_cache_bytes=True, kv_layout=KVLayout("dynamic"),
                                 description="test engine: dynamic cache, reports held bytes")

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        self.cache = DynamicCache(config=self.model.config)
        return super()._run(prompt, steps, forced, cache=self.cache)

    def kv_cache_bytes(self):
        return held_bytes(cache_tensors(self.cache))


class NbytesNotStorage(DynamicBytes):
    """Bug: counts tensor.nbytes, so a sliding layer's W-1 view of a W-position buffer is counted as W-1."""

    def kv_cache_bytes(self):
        return sum(t.nbytes for t in cache_tensors(self.cache) if t is not None)


class KeepsEveryCache(DynamicBytes):
    """Bug: every call's cache is kept in a list (reported bytes stay right: only the last cache is counted)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.history = []

    def generate(self, prompts, max_new_tokens):
        out = super().generate(prompts, max_new_tokens)
        self.history.append(self.cache)
        return out


class KeepsOutOfWindowKeys(DynamicBytes):
    """Bug (memory only, tokens stay right): a DynamicCache built without the config keeps every position in
    sliding layers too; the mask hides the keys that left the window, but they stay in memory."""

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        self.cache = DynamicCache()
        return Greedy._run(self, prompt, steps, forced, cache=self.cache)


class CachesExpandedLatent(DynamicBytes):
    """Bug (memory only, tokens stay right) on a latent-attention model: what it keeps per layer is K and V per head,
    the latent up-projected through kv_b_proj (the non-absorbed MLA path), not the latent itself."""

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        out = super()._run(prompt, steps, forced)
        self.expanded = [tuple(t.contiguous() for t in layer.self_attn.expand_kv(c.keys, c.values))
                         for layer, c in zip(self.model.model.layers, self.cache.layers)]
        return out

    def kv_cache_bytes(self):
        return held_bytes([t for pair in self.expanded for t in pair])


class StateNotCounted(DynamicBytes):
    """Bug (memory only, tokens stay right) on a hybrid model: kv_cache_bytes() counts the attention layers' keys and
    values only, not the recurrent layers' conv and recurrent states (vLLM's and SGLang's separate state pools)."""

    def kv_cache_bytes(self):
        return held_bytes([getattr(layer, name, None) for layer in self.cache.layers for name in ("keys", "values")])


class StateGrowsWithLength(DynamicBytes):
    """Bug (memory only, tokens stay right) on a hybrid model: the recurrent layers record every conv input
    (transformers' activate_past_recording(), there for a speculative rollback) and nothing ever crops them, so the
    state that should be one size per sequence grows with it."""

    @torch.inference_mode()
    def _run(self, prompt, steps, forced, cache=None):
        self.cache = DynamicCache(config=self.model.config)
        for layer in self.cache.layers:
            if hasattr(layer, "activate_past_recording"):
                # 5.25 added recurrent_states_to_keep, whose default None breaks Qwen3-Next's prefill (min(None, n))
                keep = "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters
                layer.activate_past_recording(**({"recurrent_states_to_keep": 0} if keep else {}))
        return Greedy._run(self, prompt, steps, forced, cache=self.cache)


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("NbytesNotStorage", "KeepsEveryCache", "KeepsOutOfWindowKeys", "CachesExpandedLatent", "StateNotCounted",
             "StateGrowsWithLength")
MUST_PASS = ("DynamicBytes",)
MUST_SKIP: tuple[str, ...] = ()
HELPERS: tuple[str, ...] = ()
