"""Reference engine: a gpt-fast-style decoder over a growing KV cache, under torch.compile.

Models: reference_impls/loader.py's table (Llama, Mistral, Gemma3 text, Gemma4 text with KV sharing, GPT-2, Qwen3,
Phi-3, the MoE and latent-attention models, and Bamba and Qwen3-Next, whose Mamba2 and Gated DeltaNet layers keep a
`model.State` beside the K/V), plain PyTorch loaded straight from the checkpoint's safetensors, so every shape is ours.
Sliding-window layers keep every key here and mask by position (the zoo rule: a query at position q sees key k iff q - W
< k <= q); `reference_impls/sliding_window.py` is the engine whose sliding layers hold only the window.

Two functions are compiled, once each: `prefill` (batch and prompt length dynamic) and `decode`
(batch and cache length dynamic, one new token per row). The cache is `model.GrowingCache`
(DynamicCache-like): per-layer K/V tensors [batch, seq, kv_heads, head_dim] that grow by
`torch.cat` every step, so memory follows prompt + generated tokens. cudagraphs stay off: the
shapes change every step.

Dynamic shapes, and why exactly two compiles:

- Every varying dim (batch, prompt length, cache length, mask length) is marked
  `mark_unbacked` before each call (`compile.mark_dynamic`), and the compiled code ties the symbols
  together with `torch._check` (`Decoder.forward`: one batch; one cache length shared by every layer's
  K and V; mask length = cache length + new tokens), so the graph has one batch and one length symbol.
- Unbacked, not `mark_dynamic`: dynamo specialises backed sizes 0 and 1 (batch 1, a 1-token prompt,
  the first decode step after it), and a graph warmed on sizes >= 2 guards `size >= 2`, so each
  of those would compile again. Unbacked sizes are never specialised and install no shape guards:
  warming up on batch 1 / prompt 1 serves batch 4 / prompt 256 and back. The price: the code
  must not branch on a size (there is none: the mask and positions are tensor ops).
- Guards that are not about sizes are kept constant too: the cache tensors are always freshly
  allocated and contiguous (no stride guard can flip between prefill and decode outputs), and
  generate/score always run under `torch.inference_mode()` (a caller's no_grad vs inference_mode
  would otherwise fail a dispatch-key guard).
- Each engine compiles private copies of `prefill`/`decode` (`compile.compile_fresh`): dynamo caches
  per code object, so engines for other models, dtypes or backends never count as its recompiles.

Batches are left-padded; `valid` [batch, keys] marks real tokens. Positions restart at 0 on each
prompt's first real token and pads are masked from every query, so a padded row computes what
the prompt alone would.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pytest_kvcompile.contract.engine import Declaration, KVLayout, ModelSpec
from reference_impls.compile import compile_fresh, left_pad, mark_dynamic
from reference_impls.engine import Engine
from reference_impls.loader import load_model


def prefill(model, tokens, valid):
    return model(tokens, valid)


def decode(model, tokens, valid, cache):
    return model(tokens, valid, cache)


class DynamicState(NamedTuple):
    valid: torch.Tensor  # [b, n]: real tokens among the n cached positions
    cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v) [b, n, kv_heads, d]


class CompiledDynamicCache(Engine):
    """Greedy generation with a growing KV cache; prefill and decode each compiled once."""

    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_cache_bytes=True,
        # sliding layers keep every key (masked), see the docstring; a recurrent layer its conv's last K-1 inputs
        kv_layout=KVLayout("dynamic", windowed=False, conv_window_offset=-1),
        compiled=True,
        description="reference: gpt-fast-style decoders (reference_impls/loader.py's table: Llama to DeepSeek-V3), "
        "dynamic KV cache, torch.compile with unbacked dynamic shapes",
    )

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor"):
        self.spec = spec
        self.model = load_model(spec, states=True)
        self.compiled_prefill = compile_fresh(prefill, compile_backend)
        self.compiled_decode = compile_fresh(decode, compile_backend)
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # the last generate's

    def _prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, DynamicState]:
        """Left-pad the prompts and run them: last logits [b, vocab] and the state."""
        tokens, valid = left_pad(prompts, self.spec.device)
        mark_dynamic(tokens, valid)
        logits, cache = self.compiled_prefill(self.model, tokens, valid)
        return logits, DynamicState(valid, cache)

    def _decode(self, tokens: torch.Tensor, state: DynamicState) -> tuple[torch.Tensor, DynamicState]:
        """Feed one token per row (tokens [b]): logits [b, vocab] and the state, one key longer."""
        tokens, valid = tokens[:, None], torch.cat((state.valid, state.valid.new_ones(tokens.size(0), 1)), dim=1)
        mark_dynamic(tokens, valid, state.cache)
        logits, cache = self.compiled_decode(self.model, tokens, valid, state.cache)
        return logits, DynamicState(valid, cache)

    def kv_cache_bytes(self) -> int:
        """Bytes of the K/V tensors the last generate left (here: prompt width + new tokens - 1 positions)."""
        return super().kv_cache_bytes()
