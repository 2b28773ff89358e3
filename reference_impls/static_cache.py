"""Reference engine: a gpt-fast-style Llama over a preallocated (static) KV cache, under torch.compile,
optionally with its decode step replayed from a CUDA graph.

The cache (gpt-fast's KVCache, transformers' StaticCache): per layer, K and V buffers
[batch, max_cache_len, kv_heads, head_dim], allocated once per engine and written BY POSITION:
a step's keys/values go to the cache slots `cache_pos` (a tensor) with `index_copy_` (`SlotWrites.update`,
called by the layer loop of `model.py`), so no shape depends on how full the cache is and no slot index
needs a host sync. Attention reads the whole buffer; a mask decides which slots count:

    key slot k is visible to the query in slot q of row b  iff  k <= q and valid[b, k]
    (and k == q always: a left-pad query sees only itself, so no softmax row is empty; its output is never read)

`valid` [batch, max_cache_len] marks the slots holding a real token of THIS call.

Stale state is impossible by construction. Every call starts with `StaticLlama.reset` (inside the
compiled prefill): it zeroes the K/V buffers (as transformers' `StaticCache.reset()` does) and
OVERWRITES the whole `valid` mask and the per-row pad widths; then the prompts are written from slot
0, and each decode step writes its slot and sets `valid` there before attending. So every visible
slot was written by this call, and a masked slot holds 0 (a non-finite value left by an earlier call
would turn its zero attention weight into NaN). Writing from slot 0 hides old slots from unpadded rows
(k <= q); overwriting `valid` hides them from the left-pad slots of batched rows.

Batches are left-padded to the longest prompt: slot = index in the padded row, RoPE position =
slot - pad_b. The batch is padded to a fixed `max_batch_size` rows with one-token dummy prompts whose
outputs are dropped, and calls with more prompts run in chunks of `max_batch_size`: one batch shape,
so one decode graph (compiled, and captured for CUDA graphs) serves every call.

Compiles: the decode step has fully static shapes (tokens [max_batch_size, 1], one slot, the fixed
buffers). The prefill's prompt width varies: it is `mark_unbacked` (as in `compiled_dynamic`), so one
compile serves every width, 1 included. Two compiles per engine, then none. Prompts must fit:
width + max_new_tokens <= max_cache_len (ValueError otherwise).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pytest_kvcompile.contract.engine import Bounds, Declaration, KVLayout, ModelSpec
from pytest_kvcompile.models.layers import layer_caches
from pytest_kvcompile.recompiles.hooks import mark_unbacked, torch_check
from reference_impls.compile import compile_fresh
from reference_impls.loader import load_model
from reference_impls.model import FULL, KVCache, Llama, UnsupportedModel, cache_shapes

# defaults, as declared in kv_layout (512: the suites' prompts reach 266 positions)
MAX_CACHE_LEN, MAX_BATCH_SIZE = 512, 4

PAD_ID = 0  # token of left pads and dummy rows; they are masked from every real query


class LayerBuffers(nn.Module):
    """One layer's preallocated keys and values [batch, max_cache_len, kv_heads, head_dim] (`v_shape`: values of
    another shape, a latent layer's rope key)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device, v_shape: tuple[int, ...] | None = None):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape or shape, dtype=dtype, device=device), persistent=False)


class SlotWrites(KVCache):
    """One step over the static buffers: `update` writes a layer's keys and values at slots `cache_pos` [t]
    (`index_copy_`, no host sync) and returns the whole buffers, which the step's mask reads."""

    def __init__(self, buffers: nn.ModuleList, cache_pos):
        self.buffers, self.cache_pos = buffers, cache_pos

    def update(self, layer, k, v):
        buffers = self.buffers[layer]
        buffers.k.index_copy_(1, self.cache_pos, k)
        buffers.v.index_copy_(1, self.cache_pos, v)
        return buffers.k, buffers.v


class StaticLlama(nn.Module):
    """`model.Llama`'s weights run over per-layer `LayerBuffers` (`caches`), plus the call's row state:
    `valid` [batch, max_cache_len] (slots holding a real token of this call) and `pad` [batch] (left pads)."""

    def __init__(self, llama: nn.Module, batch: int, max_cache_len: int):
        super().__init__()
        device, rows = llama.lm_head.weight.device, (batch, max_cache_len)
        self.llama = llama
        self.caches = nn.ModuleList(LayerBuffers((*rows, *k), llama.lm_head.weight.dtype, device, (*rows, *v))
                                    for k, v in cache_shapes(llama))
        self.register_buffer("valid", torch.zeros(batch, max_cache_len, dtype=torch.bool, device=device))
        self.register_buffer("pad", torch.zeros(batch, dtype=torch.long, device=device))
        self.register_buffer("slots", torch.arange(max_cache_len, device=device))

    def reset(self, pad, width):
        """Start a call (the stale-state rule): zero K/V, overwrite `pad` and all of `valid`."""
        for cache in self.caches:
            cache.k.zero_()
            cache.v.zero_()
        self.pad.copy_(pad)
        self.valid.copy_((self.slots >= pad[:, None]) & (self.slots < width))

    def forward(self, tokens, cache_pos):
        """Last-position logits [batch, vocab] for tokens [batch, t] written at slots cache_pos [t]."""
        pos = (cache_pos - self.pad[:, None]).clamp(min=0)  # RoPE position: slot minus the row's left pad
        q_slot, k_slot = cache_pos[:, None], self.slots[None, :]
        mask = ((k_slot <= q_slot) & self.valid[:, None, None, :]) | (k_slot == q_slot)  # [b, 1, t, max_cache_len]
        return self.llama.run(tokens, pos, {FULL: mask}, SlotWrites(self.caches, cache_pos))


def prefill(model: StaticLlama, tokens, pad):
    """A call's first step: reset, then the left-padded prompts tokens [batch, width] at slots 0..width-1."""
    width = tokens.size(1)
    torch_check(width >= 1)
    model.reset(pad, width)
    return model(tokens, torch.arange(width, device=tokens.device))


def decode(model: StaticLlama, tokens, cache_pos):
    """One token per row (tokens [batch, 1]) at slot cache_pos [1], which becomes valid first."""
    model.valid.index_fill_(1, cache_pos, True)
    return model(tokens, cache_pos)


class StaticCache:
    """Greedy generation over a static KV cache; prefill and decode each compiled once, no CUDA graphs."""

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_cache_bytes=True,
        compiled=True,
        kv_layout=KVLayout("static", max_cache_len=MAX_CACHE_LEN, rows=MAX_BATCH_SIZE),
        bounds=Bounds(max_positions=MAX_CACHE_LEN),  # a call holding more is refused (ValueError)
        description="reference: gpt-fast-style Llama, static KV cache written by position, torch.compile "
                    "(decode static shapes, batch padded to max_batch_size)",
    )
    model_class = StaticLlama

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor", max_cache_len: int = MAX_CACHE_LEN,
                 max_batch_size: int = MAX_BATCH_SIZE):
        name = type(self).__name__
        kinds = sorted({cache.kind for cache in layer_caches(spec.config)} - {"full", "latent"})
        if kinds:
            raise UnsupportedModel(
                f"{name} supports full-attention layers only (per-head or latent caches); model '{spec.name}' has "
                f"{', '.join(kinds)} layers (sliding-window and hybrid layouts need a windowed mask, shared KV a "
                "source layer, a recurrent layer its state: docs/state-caches.md)")
        if max_cache_len < 2 or max_batch_size < 1:
            raise ValueError(f"{name} needs max_cache_len >= 2 and max_batch_size >= 1, got {max_cache_len}, "
                             f"{max_batch_size}")
        self.spec, self.max_cache_len, self.max_batch_size = spec, max_cache_len, max_batch_size
        model = load_model(spec)
        if not isinstance(model, Llama):
            raise UnsupportedModel(f"{name} runs the RoPE decoders of reference_impls (Llama and its kin); model "
                                   f"'{spec.name}' is '{spec.config.model_type}'")
        self.model = self.model_class(model, max_batch_size, max_cache_len)
        self.compiled_prefill = compile_fresh(prefill, compile_backend, writes_buffers=True)
        self.compiled_decode = compile_fresh(decode, compile_backend, writes_buffers=True)

    def _prefill(self, prompts: list[list[int]], steps: int):
        """Reset and run up to max_batch_size prompts: (last logits [max_batch_size, vocab], first decode slot)."""
        if not all(prompts):
            raise ValueError("every prompt needs at least one token")
        width = max(map(len, prompts))
        if width + steps > self.max_cache_len:
            raise ValueError(
                f"{type(self).__name__}: a prompt of {width} tokens + max_new_tokens={steps} does not fit "
                f"max_cache_len={self.max_cache_len} (prompts may have at most max_cache_len - max_new_tokens = "
                f"{self.max_cache_len - steps} tokens); build the engine with a larger max_cache_len"
            )
        rows = list(prompts) + [[PAD_ID]] * (self.max_batch_size - len(prompts))
        tokens = torch.tensor([[PAD_ID] * (width - len(p)) + list(p) for p in rows], device=self.spec.device)
        pad = torch.tensor([width - len(p) for p in rows], device=self.spec.device)
        mark_unbacked(tokens, 1)
        return self.compiled_prefill(self.model, tokens, pad), width

    def _decode(self, tokens: torch.Tensor, cache_pos: torch.Tensor) -> torch.Tensor:
        """Logits [max_batch_size, vocab] after tokens [max_batch_size] at slot cache_pos [1]."""
        return self.compiled_decode(self.model, tokens[:, None], cache_pos)

    def _steps(self, prompts: list[list[int]], steps: int, forced: list[int] | None = None):
        """Yield each step's logits [max_batch_size, vocab]: prefill, then steps - 1 decodes fed the greedy
        tokens, or (teacher forcing) forced[i] in every row."""
        logits, width = self._prefill(prompts, steps)
        cache_pos = torch.tensor([width], device=self.spec.device)  # on the device, advanced in place: no sync
        for i in range(steps):
            yield logits
            if i + 1 < steps:
                tokens = (logits.argmax(-1) if forced is None
                          else torch.full_like(logits[:, 0], forced[i], dtype=torch.long))
                logits = self._decode(tokens, cache_pos)
                cache_pos += 1

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        out = []
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = prompts[start : start + self.max_batch_size]
            tokens = torch.stack([logits.argmax(-1) for logits in self._steps(chunk, max_new_tokens)], dim=1)
            out += tokens[: len(chunk)].tolist()
        return out

    @torch.inference_mode()
    def score(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(continuation), vocab] through the generate path (the same decode step)."""
        if not continuation:
            return torch.empty(0, self.spec.vocab_size, dtype=self.spec.dtype, device=self.spec.device)
        return torch.stack([logits[0] for logits in self._steps([prompt], len(continuation), continuation)])

    def kv_cache_bytes(self) -> int:
        """Bytes of the preallocated K/V buffers, whatever the last call used: max_cache_len x layers x 2
        x kv_heads x head_dim x max_batch_size (rows always allocated) x dtype size."""
        return sum(x.numel() * x.element_size() for cache in self.model.caches for x in (cache.k, cache.v))


class StaticCacheCudaGraph(StaticCache):
    """StaticCache whose decode step is one CUDA graph, captured at construction and replayed (seed 001).

    The graph reads fixed input buffers (token ids [max_batch_size, 1] and the slot [1]) and writes a
    fixed logits buffer: each step copies its inputs in, `replay()`s and `.clone()`s the logits (the next
    replay overwrites them). Before capture the compiled decode runs `warmup` times on a side stream
    (compilation, autotuning and lazy allocations must not happen inside the capture). Warmup and capture
    write into the cache at slot 0; every call's reset makes that invisible. The prefill stays compiled,
    not graphed: its width varies. One graph, for the one padded batch shape.
    """

    kv_declaration = dataclasses.replace(
        StaticCache.kv_declaration,
        devices=("cuda",),
        description="reference: static KV cache, torch.compile, decode step replayed from one CUDA graph",
    )

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor", max_cache_len: int = MAX_CACHE_LEN,
                 max_batch_size: int = MAX_BATCH_SIZE, warmup: int = 3):
        if torch.device(spec.device).type != "cuda":
            raise ValueError(f"{type(self).__name__} needs a CUDA device for CUDA graphs, got device '{spec.device}'")
        super().__init__(spec, compile_backend=compile_backend, max_cache_len=max_cache_len,
                         max_batch_size=max_batch_size)
        self._capture(warmup)

    @torch.inference_mode()
    def _capture(self, warmup: int) -> None:
        device = self.spec.device
        self.static_tokens = torch.full((self.max_batch_size, 1), PAD_ID, device=device)
        self.static_cache_pos = torch.zeros(1, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.compiled_decode(self.model, self.static_tokens, self.static_cache_pos)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_logits = self.compiled_decode(self.model, self.static_tokens, self.static_cache_pos)

    def _decode(self, tokens: torch.Tensor, cache_pos: torch.Tensor) -> torch.Tensor:
        self.static_tokens.copy_(tokens[:, None])
        self.static_cache_pos.copy_(cache_pos)
        self.graph.replay()
        return self.static_logits.clone()
