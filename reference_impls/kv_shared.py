"""Reference engine: prefill skip for layers that reuse another layer's KV (seed 004).

Source: vLLM PR #19719 / #22628 ("partial prefill skip for layers reusing shared KV cache", the
idea of SwiftKV / YOCO), and transformers 5.23's Gemma4 `_maybe_slice_kv_shared_inputs`.

The rule. In a model whose last S of L layers reuse the K/V of earlier layers (Gemma4 text,
`num_kv_shared_layers = S`; `reference_impls/gemma4.py`), a shared layer writes no cache: the K/V
every later step attends over come from the first L - S layers only. A prompt's output is the
logits at its last position. So the shared layers' outputs at every other prompt position feed
nothing, and prefill runs those layers on the last position of each prompt only (the last
column of a left-padded batch). Decode steps are one position already: nothing changes there.

Saving: the shared layers process 1 of N prompt positions, so in a model of equal layers the
prefill's layer work drops by S/L x (N-1)/N. The shared layers here are cheaper than the others
(no K/V projections), so the real saving is (their share of the layer work) x (N-1)/N, a little
less: tests/test_reference_kv_shared.py counts it, benchmarks/bench_kv_shared_prefill.py times it.

Everything else is `CompiledDynamicCache`: a growing cache (non-shared layers only), prefill and
decode each compiled once with unbacked dynamic shapes.
"""

from __future__ import annotations

import dataclasses

from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec
from pytest_kvcompile.models.zoo import shared_kv_layers
from reference_impls.compiled_dynamic import CompiledDynamicCache


class KVSharedPrefillSkip(CompiledDynamicCache):
    """`ref-kv-shared`: Gemma4 with KV-shared layers, the shared layers skipped at prefill (all but the last
    position)."""

    kv_declaration = dataclasses.replace(
        CompiledDynamicCache.kv_declaration,
        description="reference: Gemma4 KV-shared layers run prefill for each prompt's last token only "
        "(dynamic KV cache, torch.compile)",
    )

    def __init__(self, spec: ModelSpec, *, compile_backend: str = "inductor", skip: bool = True):
        if spec.config.model_type != "gemma4_text" or not shared_kv_layers(spec.config):
            raise ModelNotSupported(
                f"model '{spec.name}' ({spec.config.model_type}) has no KV-shared layers: the prefill skip "
                "applies to Gemma4 text with num_kv_shared_layers > 0")
        super().__init__(spec, compile_backend=compile_backend)
        self.model.skip_shared_prefill = skip
