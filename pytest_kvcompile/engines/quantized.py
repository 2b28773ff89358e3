"""transformers' ``QuantizedCache`` (KIVI-style: K and V quantized per channel in groups, the most recent positions
kept in the model's dtype) as engines: ``hf-quantized-quanto`` (optimum-quanto, int4), ``hf-quantized-hqq`` (HQQ,
int4) and ``hf-quantized-hqq-int8`` (HQQ, int8). The quantization backend is imported only when an engine is built
(by transformers).

Rules:

- ``generate()`` with the cache ``QuantizedCache(backend, config, nbits=4, residual_length=RESIDUAL)``, a new
  cache per call, otherwise what ``hf-eager`` does (engines/hf.py). transformers' defaults are kept (axis 0, groups of
  64) except the residual window: RESIDUAL = 16 positions instead of 128, so the suite's prompts (1 to 266 tokens)
  cross it and the quantized store is read, not only the full-precision window. (Prefill is quantized at once either
  way: the residual window only holds decode steps.)
- Declared ``kv_cache_dtype`` ("int4", "int8"): the token checks allow the measured noise of storing K and V that way on
  each model (oracles/precision.py: KVComputation), no more; the run prints that noise. Where it flips a quarter of
  the greedy choices or more (int4 on the zoo's tiny models), the token checks are a named skip: nothing could tell
  a bug from it.
- Models with sliding-window layers are ModelNotSupported (transformers' QuantizedCache refuses them at the first
  forward). Its groups must divide kv_heads x head_dim: the recipe builds the zoo with head_dim 32.
- No ``kv_cache_bytes``: the quantized store is the backend's packed tensors and scales, which no ``KVLayout``
  states; the held-memory check bounds what it holds by the model dtype's footprint.
"""

from __future__ import annotations

from pytest_kvcompile.contract.engine import Declaration, ModelNotSupported, ModelSpec
from pytest_kvcompile.engines.hf import HFEager
from pytest_kvcompile.engines.recipe import Recipe
from pytest_kvcompile.models.checkpoints import with_cache
from pytest_kvcompile.models.layers import states_of
from pytest_kvcompile.models.zoo import sliding_layers

RESIDUAL = 16  # positions QuantizedCache keeps in the model's dtype before quantizing them (transformers: 128)
NBITS = 4
RECIPE = Recipe(packages=("optimum-quanto==0.2.7", "hqq==0.2.8.post1"),
                pytest_args=("--kv-zoo-head-dim=32",),
                note="transformers' QuantizedCache backends: optimum-quanto (quanto) and hqq. Its groups of 64 values "
                     "must divide a layer's kv_heads x head_dim, so the zoo is built with head_dim 32.")


def _declaration(backend: str, nbits: int, module: str, package: str) -> Declaration:
    """One QuantizedCache engine's declaration: its backend's package and the KV precision it stores."""
    return Declaration(
        batching=True,
        scoring=True,
        kv_cache_dtype=f"int{nbits}",
        devices=("cpu", "cuda"),
        requires=((module, package),),
        description=f"transformers generate(), QuantizedCache(backend={backend!r}, nbits={nbits}, "
                    f"residual_length={RESIDUAL})",
    )


class QuantizedQuanto(HFEager):
    """transformers ``generate()`` with ``QuantizedCache(backend="quanto", nbits=4)``."""

    backend, nbits = "quanto", NBITS
    kv_declaration = _declaration(backend, nbits, "optimum.quanto", RECIPE.packages[0])

    def __init__(self, spec: ModelSpec):
        sliding, states = sliding_layers(spec.config), states_of(spec.config)
        if states:  # transformers raises at the first generate() here too
            raise ModelNotSupported(f"transformers' QuantizedCache serves models with full-attention layers only "
                                    f"(this one has recurrent layers, {states})")
        if sliding:  # transformers raises at the first generate(): the model is not one QuantizedCache serves
            raise ModelNotSupported(f"transformers' QuantizedCache serves models with full-attention layers only "
                                    f"(this one has sliding-window layers {sliding}: 'QuantizedCache is only "
                                    "supported for models with only full attention layers')")
        super().__init__(spec)

    def _cache_kwargs(self) -> dict:
        from transformers import QuantizedCache

        return with_cache(QuantizedCache(self.backend, self.model.config, nbits=self.nbits, residual_length=RESIDUAL))


class QuantizedHQQ(QuantizedQuanto):
    """transformers ``generate()`` with ``QuantizedCache(backend="hqq", nbits=4)``."""

    backend, nbits = "hqq", NBITS
    kv_declaration = _declaration(backend, nbits, "hqq", RECIPE.packages[1])


class QuantizedHQQInt8(QuantizedQuanto):
    """transformers ``generate()`` with ``QuantizedCache(backend="hqq", nbits=8)``."""

    backend, nbits = "hqq", 8
    kv_declaration = _declaration(backend, nbits, "hqq", RECIPE.packages[1])
