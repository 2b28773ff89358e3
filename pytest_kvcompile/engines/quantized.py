"""transformers' ``QuantizedCache`` (KIVI-style: K and V quantized per channel in groups, the most recent positions
kept in the model's dtype) as engines: ``hf-quantized-quanto`` (optimum-quanto, int4) and ``hf-quantized-hqq``
(HQQ, int4). The quantization backend is imported only when an engine is built (by transformers).

Rules:

- ``generate()`` with ``past_key_values=QuantizedCache(backend, config, nbits=4, residual_length=RESIDUAL)``, a new
  cache per call, otherwise what ``hf-eager`` does (engines/hf.py). transformers' defaults are kept (axis 0, groups of
  64) except the residual window: RESIDUAL = 16 positions instead of 128, so the suite's prompts (1 to 266 tokens)
  cross it and the quantized store is read, not only the full-precision window. (Prefill is quantized at once either
  way: the residual window only holds decode steps.)
- Declared ``kv_dtype="int4"``: the token checks allow the measured noise of storing K and V in int4 on each model
  (oracles/precision.py: KVComputation), no more; the run's verdict lines and reports print that noise.
- No ``kv_cache_bytes``: the quantized store is the backend's packed tensors and scales, which no ``KVLayout``
  states; the held-memory check bounds what it holds by the model dtype's footprint.
"""

from __future__ import annotations

from pytest_kvcompile.contract.engine import Declaration
from pytest_kvcompile.engines.hf import HFEager
from pytest_kvcompile.engines.recipe import Recipe

RESIDUAL = 16  # positions QuantizedCache keeps in the model's dtype before quantizing them (transformers: 128)
NBITS = 4
RECIPE = Recipe(packages=("optimum-quanto==0.2.7", "hqq==0.2.8.post1"),
                note="transformers' QuantizedCache backends: optimum-quanto (quanto) and hqq.")


class QuantizedQuanto(HFEager):
    """transformers ``generate()`` with ``QuantizedCache(backend="quanto", nbits=4)``."""

    backend = "quanto"
    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_dtype="int4",
        devices=("cpu", "cuda"),
        requires=(("optimum.quanto", RECIPE.packages[0]),),
        description=f"transformers generate(), QuantizedCache(backend='quanto', nbits={NBITS}, "
                    f"residual_length={RESIDUAL})",
    )

    def _cache_kwargs(self) -> dict:
        from transformers import QuantizedCache

        return {"past_key_values": QuantizedCache(self.backend, self.model.config, nbits=NBITS,
                                                  residual_length=RESIDUAL)}


class QuantizedHQQ(QuantizedQuanto):
    """transformers ``generate()`` with ``QuantizedCache(backend="hqq", nbits=4)``."""

    backend = "hqq"
    kv_declaration = Declaration(
        batching=True,
        scoring=True,
        kv_dtype="int4",
        devices=("cpu", "cuda"),
        requires=(("hqq", RECIPE.packages[1]),),
        description=f"transformers generate(), QuantizedCache(backend='hqq', nbits={NBITS}, "
                    f"residual_length={RESIDUAL})",
    )
