"""llama.cpp on a model's own quantised GGUF (``llama-cpp-gguf``): the file a checkpoint was dequantised from, run
natively, its quantised kernels and all (issue 72).

The truth and every other engine load the checkpoint transformers dequantised from that file (models/trained.py:
`source_gguf`, the zoo's trained model), so the weights are the same numbers on both sides and are not declared: the
4-bit rounding is the model. What llama.cpp computes beyond that is declared, so the verdict allows exactly its noise,
measured on the model (oracles/computations.py: `KVComputation`):

- ``kv_cache_dtype="float16"``: its default KV cache;
- ``matmul_inputs="int8"``: a q4_1 or q8_0 weight's dot product takes its activations quantised to q8_1 or q8_0,
  int8 in blocks of 32 with a half-precision scale (ggml-cpu's ``vec_dot_type``); SmolLM2-135M-Instruct's file holds
  q4_1 projections and a q8_0 embedding (tied to the output), so every matmul but attention's quantises its inputs.

Loaded without llama.cpp's extra buffer types (`_no_extra_buffer_types`: its AMX repacking crashes on this file).
Its one sequence holds the model's positions up to ``MAX_CTX`` (SmolLM2 allows 8,192; the suites' long generation
reaches 1,024, the eviction check 528). Everything else is `LlamaCpp`'s (engines/llamacpp.py): one ``Llama`` per
engine, ids fed as tokens (the file's own tokenizer is not used), greedy ``Llama.generate``, teacher-forced
``score()``. A model with no source GGUF (the random zoo) is ModelNotSupported, named: ``llama-cpp`` converts any
checkpoint to a float32 GGUF instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from pytest_kvcompile.contract.engine import ModelNotSupported, ModelSpec
from pytest_kvcompile.engines.llamacpp import RECIPE, LlamaCpp  # noqa: F401 (RECIPE: its group's, check_engine)
from pytest_kvcompile.models.checkpoints import max_positions
from pytest_kvcompile.models.trained import SOURCE, source_gguf

MAX_CTX = 1024  # positions of the one sequence: the model's own limit up to the longest the suites reach (1024)


class LlamaCppGGUF(LlamaCpp):
    """``llama-cpp`` over the checkpoint's source GGUF, quantised as shipped: f16 KV cache, int8 matmul inputs."""

    kv_declaration = dataclasses.replace(
        LlamaCpp.kv_declaration,
        description="llama.cpp (llama-cpp-python 0.3.36, CPU) Llama.generate greedy over the model's own quantised "
                    "GGUF (SmolLM2: q4_1 weights), KV cache f16, matmul inputs int8 (q8_0/q8_1 dot products)",
        matmul_inputs="int8",
        known_findings=(),
    )

    def __init__(self, spec: ModelSpec):
        source = source_gguf(spec.path)
        if source is None:
            raise ModelNotSupported(
                f"llama-cpp-gguf runs the GGUF file a checkpoint was dequantised from (its '{SOURCE}'); model "
                f"'{spec.name}' has none (random weights, built from a config): run it on --kv-zoo=trained, or use "
                "llama-cpp, which converts any checkpoint to a float32 GGUF")
        from llama_cpp import Llama

        self.spec, self.gguf_path = spec, source
        self.n_ctx = min(max_positions(spec.config) or MAX_CTX, MAX_CTX)
        with _no_extra_buffer_types():
            self.llm = Llama(model_path=str(source), n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx,
                             n_threads=max(1, torch.get_num_threads()), seed=0, verbose=False, **self._kwargs())
        if self.llm.n_vocab() < spec.vocab_size:
            raise ModelNotSupported(f"{source.name} has {self.llm.n_vocab()} tokens, the checkpoint "
                                    f"{spec.vocab_size}: not the file it was dequantised from")

    def _kwargs(self) -> dict[str, Any]:
        return {}


@contextlib.contextmanager
def _no_extra_buffer_types():
    """``llama_model_params.use_extra_bufts = False`` for the models loaded meanwhile (llama-cpp-python's ``Llama``
    takes no such argument: its default parameters are patched while it loads). With extra buffer types, llama.cpp
    0.3.36 repacks q4_1 and q8_0 weights for AMX on a CPU that has it and then crashes (SIGSEGV) in the first
    ``eval`` of this file (docs/engines/llama-cpp.md, finding 6); without them every CPU runs ggml's own q4_1 x q8_1
    and q8_0 x q8_0 dot products."""
    from llama_cpp import llama as module

    default = module.llama_cpp.llama_model_default_params

    def without():
        params = default()
        params.use_extra_bufts = False
        return params

    module.llama_cpp.llama_model_default_params = without
    try:
        yield
    finally:
        module.llama_cpp.llama_model_default_params = default
