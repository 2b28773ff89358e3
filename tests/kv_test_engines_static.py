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


# --- CUDA graphs: broken twins of StaticCacheCudaGraph (GPU only; tests/test_gpu.py) ------------------------------
class RecapturePerBatch(StaticCacheCudaGraph):
    """Bug: keeps one decode graph per batch size and captures it on first use, so a batch size warmup did not
    see captures a new graph after warmup (a dynamo-silent re-capture)."""

    def __init__(self, spec, compile_backend="inductor"):
        super().__init__(spec, compile_backend=compile_backend)
        self.graphs = {}

    def _prefill(self, prompts, steps):
        n = len(prompts)
        if n not in self.graphs:
            self._capture(warmup=1)
            self.graphs[n] = (self.graph, self.static_tokens, self.static_cache_pos, self.static_logits)
        self.graph, self.static_tokens, self.static_cache_pos, self.static_logits = self.graphs[n]
        return super()._prefill(prompts, steps)


class StaleGraphOutput(StaticCacheCudaGraph):
    """Bug: copies the graph's output buffer before replaying, so each decode step returns the previous replay's
    logits."""

    def _decode(self, tokens, cache_pos):
        out = self.static_logits.clone()
        self.static_tokens.copy_(tokens[:, None])
        self.static_cache_pos.copy_(cache_pos)
        self.graph.replay()
        return out


_WORKSPACES = []  # module-level: not reachable from the engine object


class HiddenWorkspace(StaticCacheCudaGraph):
    """Bug: reports its K/V buffers exactly, but allocates a workspace 16x their size in a module-level list (as
    kernels' global workspaces do), which no attribute of the engine reaches: only the CUDA allocator sees it."""

    def __init__(self, spec, compile_backend="inductor"):
        super().__init__(spec, compile_backend=compile_backend)
        _WORKSPACES.append(torch.empty(16 * self.kv_cache_bytes(), dtype=torch.uint8, device=spec.device))


# The roles of this module's engines (tests/test_tiers.py: each one is run by a test of the fast tier, and
# counted): must fail the check it carries a bug for, must pass, must be a named skip; helpers are no engine.
MUST_FAIL = ("Stale", "StaleValid", "NoZero", "LeakyGraph", "RecapturePerBatch", "StaleGraphOutput",
    "HiddenWorkspace")
MUST_PASS = ("StaticEager",)
MUST_SKIP: tuple[str, ...] = ()
HELPERS = ("KeepsValidLlama", "NoZeroLlama")
